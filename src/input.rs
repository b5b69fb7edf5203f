//! How every command reads its inputs: one function, so `compare`, `replay`,
//! `summary`, `snapshot` and `advise` accept the same things — a snapshot
//! pickle, a text trace, a workload spec (`train-varlen`, `serve-kv:seed=3`),
//! or the bundled snapshot's name ([`BUILTIN_FIXTURE_NAME`]).

use anyhow::{bail, Context, Result};
use vmmalloc_trace::{Input, Trace};

/// The bundled real snapshot (a CS336 language-model training step).
pub const BUILTIN_FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/cs336_lm_step.pickle"
);

/// The built-in snapshot's name: an input naming it (and no file of that
/// name) loads [`BUILTIN_FIXTURE`].
pub const BUILTIN_FIXTURE_NAME: &str = "cs336_lm_step";

/// Resolves an input as written: [`BUILTIN_FIXTURE_NAME`] (or its file name)
/// is the bundled snapshot unless a file of that name exists here; anything
/// else is unchanged.
pub fn resolve_input(s: &str) -> String {
    let t = s.trim();
    if (t == BUILTIN_FIXTURE_NAME || t == "cs336_lm_step.pickle")
        && !std::path::Path::new(t).exists()
    {
        BUILTIN_FIXTURE.to_string()
    } else {
        s.to_string()
    }
}

/// The inputs a command runs on when none is given: the bundled snapshot
/// and every workload.
pub fn default_inputs() -> Vec<String> {
    let mut v = vec![BUILTIN_FIXTURE_NAME.to_string()];
    v.extend(vmmalloc_trace::WORKLOADS.iter().map(|s| s.to_string()));
    v
}

/// Reads (or generates) one input, as every command does. Errors name the
/// input once and say what it is not; an input with no allocation to replay
/// on any device (a header-only text trace) is the same error for every
/// command ([`NOTHING_TO_REPLAY`]).
pub fn load_input(s: &str) -> Result<Trace> {
    let resolved = resolve_input(s);
    let input: Input = resolved.parse().with_context(|| {
        format!("input `{s}` (the bundled snapshot is `{BUILTIN_FIXTURE_NAME}`)")
    })?;
    // A file's errors already start with its path.
    let trace = match &input {
        Input::Path(_) => input.load().map_err(anyhow::Error::from),
        Input::Workload(_) => input.load().with_context(|| format!("workload `{s}`")),
    }?;
    if trace.devices.iter().all(|d| d.replay_ops().is_empty()) {
        bail!("{s}: {NOTHING_TO_REPLAY}");
    }
    Ok(trace)
}

/// What every command says of an input with no allocation to replay.
pub const NOTHING_TO_REPLAY: &str = "no allocations to replay (a snapshot needs \
     torch.cuda.memory._record_memory_history() before the run it describes; a text trace needs \
     `alloc` or `pre` lines, docs/trace-format.md)";

/// Loads `inputs` with [`load_input`], or the default set when empty.
pub fn load_inputs(inputs: &[String]) -> Result<Vec<Trace>> {
    if inputs.is_empty() {
        default_inputs().iter().map(|s| load_input(s)).collect()
    } else {
        inputs.iter().map(|s| load_input(s)).collect()
    }
}
