//! The `rl-colocate` section of `vmmalloc compare`: the device memory each
//! phase needs with and without sleep, per policy (only `expandable` can
//! sleep; the table says so for the others instead of a number).

use anyhow::{Context, Result};
use vmmalloc_alloc::PolicySpec;
use vmmalloc_trace::workloads::rl_colocate;

/// The section for every `rl-colocate` input among `inputs` (trace names
/// are the specs as written); empty when there is none.
pub fn section(inputs: &[String], policies: &[PolicySpec]) -> Result<String> {
    let mut out = String::new();
    for spec in inputs {
        let Some(params) = rl_colocate::params_from_spec(spec) else {
            continue;
        };
        let params = params.with_context(|| format!("input `{spec}`"))?;
        // The roomy device is checked as every device size is.
        let cap = crate::device_size::device_size(
            &format!("{spec}: the device of the sleep table"),
            rl_colocate::roomy_capacity(&params).into(),
            1,
        )?;
        out.push('\n');
        out.push_str(&crate::compare::wrap(
            &format!(
                "{spec}: device memory each phase needs (GiB), trainer and inference engine on one GPU"
            ),
            crate::compare::TERMINAL_WIDTH,
        ));
        out.push_str(&format!(
            "{:<28} {:<10} {:>14} {:>14}\n",
            "policy", "phase", "without sleep", "with sleep"
        ));
        for p in policies {
            let needs = rl_colocate::phase_needs(&params, p, cap)
                .with_context(|| format!("{spec} with {}", p.label))?;
            for n in needs {
                let with = match &n.with_sleep {
                    Ok(b) => crate::compare::gib(*b),
                    Err(m) => m.clone(),
                };
                out.push_str(&format!(
                    "{:<28} {:<10} {:>14} {:>14}\n",
                    p.label,
                    n.phase,
                    crate::compare::gib(n.without_sleep),
                    with
                ));
            }
        }
        out.push_str(&crate::compare::wrap(
            "peak device memory in use (cuMemGetInfo total - free) on a simulated device; with sleep the idle engine is paused \
             (weights and trainer state backed up to host memory, KV cache dropped).",
            crate::compare::TERMINAL_WIDTH,
        ));
    }
    Ok(out)
}
