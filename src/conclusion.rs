//! The conclusion under `vmmalloc compare`'s table: which allocator, and
//! why, in sentences computed from the rows as the table prints them (the
//! cells' rounded values, never the unrounded figures behind them), so
//! that every claim can be checked against the table by a reader or a test.
//!
//! Driver time is compared only between replays that fit the tight device
//! (no out-of-memory error, cold or steady), trace by trace, and each claim
//! says how many traces it covers; replays that ran out of memory are named
//! instead. Memory is compared by the smallest device each policy needs
//! (its own search, valid whether or not the tight replay fit). Where
//! nothing fits, the conclusion says so and names the smallest device that
//! would.

use crate::advise::{STEADY_TIE_FRACTION, STEADY_TIE_MS};
use crate::compare::{PolicyRow, TraceRow};
use vmmalloc_alloc::Policy;

/// Memory within this fraction counts as equal (1 %).
pub const MEMORY_TIE: f64 = 0.01;

/// One policy's row, as the default table prints it.
#[derive(Debug, Clone, PartialEq)]
pub struct Printed {
    /// The row's label (the policy spec as written).
    pub label: String,
    /// The policy, where the row is a policy with no options (`None`: a
    /// spec with options, which the conclusion leaves to the table).
    pub plain: Option<Policy>,
    /// The `min cap GiB` cell (`None`: `-`, no device found).
    pub min_cap_gib: Option<f64>,
    /// The `tight` cell says `ok`: no out-of-memory error, cold or steady.
    pub fits: bool,
    /// The cold `driver ms` cell.
    pub cold_ms: f64,
    /// The steady `driver ms` cell (`None`: `-`, no steady pass).
    pub steady_ms: Option<f64>,
}

/// One trace's block of the default table.
#[derive(Debug, Clone, PartialEq)]
pub struct PrintedTrace {
    /// The name the conclusion gives it (the trace, and its device where
    /// the input has several).
    pub name: String,
    /// Its rows.
    pub rows: Vec<Printed>,
}

impl PrintedTrace {
    /// The plain row of `policy`.
    pub fn plain(&self, policy: Policy) -> Option<&Printed> {
        self.rows.iter().find(|r| r.plain == Some(policy))
    }

    /// The smallest `min cap` of its rows, and the first row that needs it.
    pub fn smallest(&self) -> Option<(f64, &str)> {
        self.rows
            .iter()
            .filter_map(|r| Some((r.min_cap_gib?, r.label.as_str())))
            .fold(None, |best: Option<(f64, &str)>, (c, l)| match best {
                Some((b, _)) if b <= c => best,
                _ => Some((c, l)),
            })
    }
}

/// A cell's text read back as the number it shows.
fn shown(cell: &str) -> Option<f64> {
    cell.parse().ok()
}

/// The rows as the default table prints them ([`crate::compare::narrow_table`]
/// uses the same cells).
pub fn printed(rows: &[TraceRow]) -> Vec<PrintedTrace> {
    rows.iter()
        .map(|t| PrintedTrace {
            name: trace_name(rows, t),
            rows: t
                .policies
                .iter()
                .map(|p| Printed {
                    label: p.label().to_string(),
                    plain: p.spec.is_plain().then_some(p.policy),
                    min_cap_gib: shown(&p.min_capacity_cell()),
                    fits: p.fits(),
                    cold_ms: shown(&p.cold_ms_cell()).unwrap_or(0.0),
                    steady_ms: p.steady_ms_cell().as_deref().and_then(shown),
                })
                .collect(),
        })
        .collect()
}

/// The trace's name in the conclusion: its name, with `device D` where the
/// input has more than one device.
pub fn trace_name(rows: &[TraceRow], t: &TraceRow) -> String {
    if rows.iter().filter(|r| r.name == t.name).count() > 1 {
        format!("{} device {}", t.name, t.device)
    } else {
        t.name.clone()
    }
}

fn plural(n: usize, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

/// Joins names as a list (`a`, `a and b`, `a, b and c`).
fn list(names: &[String]) -> String {
    match names {
        [] => String::new(),
        [a] => a.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// PyTorch's allocators, the conclusion's comparison points.
const PYTORCH: [Policy; 2] = [Policy::Caching, Policy::TorchEs];

/// Driver time where `expandable` and `q` both fit: the traces and the sums.
#[derive(Debug, Default)]
struct Shared {
    traces: usize,
    e_cold: f64,
    e_steady: f64,
    q_cold: f64,
    q_steady: f64,
}

/// Whether steady times `a` and `b` (ms) tie, as `advise` judges them.
fn steady_ties(a: f64, b: f64) -> bool {
    (a - b).abs() <= STEADY_TIE_MS.max(STEADY_TIE_FRACTION * a.max(b))
}

/// The conclusion's sentences, computed from [`printed`] rows (empty when
/// there is nothing to conclude).
pub fn conclusion(rows: &[TraceRow]) -> String {
    let s = sentences(&printed(rows));
    if s.is_empty() {
        String::new()
    } else {
        format!("Conclusion: {}", s.join(" "))
    }
}

/// The conclusion's sentences from the printed table.
pub fn sentences(traces: &[PrintedTrace]) -> Vec<String> {
    let mut out = Vec::new();
    if traces.is_empty() {
        return out;
    }
    // 1. Where nothing fits, the smallest device that would.
    let nothing_fits = fit_sentence(traces, &mut out);
    // The traces with a plain expandable row and a plain PyTorch one.
    let pairs: Vec<&PrintedTrace> = traces
        .iter()
        .filter(|t| {
            t.plain(Policy::Expandable).is_some() && PYTORCH.iter().any(|&q| t.plain(q).is_some())
        })
        .collect();
    if pairs.is_empty() {
        return out;
    }
    // 2. Memory: the smallest device each needs.
    let (memory, smallest) = memory_sentence(&pairs);
    out.push(memory);
    if nothing_fits {
        return out;
    }
    // 3. Driver time, only where both fit.
    let shared = driver_time_sentences(&pairs, &mut out);
    // 4. The advice that follows from the sentences above.
    out.push(advice(&pairs, &shared, smallest));
    out
}

/// The sentence on the traces where no policy fits the tight device (none
/// when every trace has a fit), pushed to `out`; whether nothing fits at all.
fn fit_sentence(traces: &[PrintedTrace], out: &mut Vec<String>) -> bool {
    let none_fit: Vec<&PrintedTrace> = traces
        .iter()
        .filter(|t| t.rows.iter().all(|r| !r.fits))
        .collect();
    let needs = |t: &PrintedTrace| match t.smallest() {
        Some((c, l)) => format!("{} needs {c:.2} GiB with {l}", t.name),
        None => format!("{}: no policy fits any device searched", t.name),
    };
    let nothing_fits = none_fit.len() == traces.len();
    if nothing_fits {
        let mut s = format!(
            "Nothing fits: every policy ran out of memory at the tight device on {} ({}).",
            if traces.len() == 1 {
                "the trace".to_string()
            } else {
                format!("all {} traces", traces.len())
            },
            none_fit
                .iter()
                .map(|t| needs(t))
                .collect::<Vec<_>>()
                .join("; ")
        );
        let all: Option<Vec<f64>> = none_fit
            .iter()
            .map(|t| t.smallest().map(|(c, _)| c))
            .collect();
        match all.and_then(|v| v.into_iter().reduce(f64::max)) {
            Some(m) if traces.len() > 1 => {
                s.push_str(&format!(
                    " The smallest device that would fit them all is {m:.2} GiB."
                ));
            }
            _ => {}
        }
        out.push(s);
    } else if !none_fit.is_empty() {
        out.push(format!(
            "No policy fits the tight device on {} of {} ({}).",
            plural(none_fit.len(), "trace"),
            traces.len(),
            none_fit
                .iter()
                .map(|t| needs(t))
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    nothing_fits
}

/// The memory sentence over `pairs`, and on how many traces expandable needs
/// no more than PyTorch's allocators.
fn memory_sentence(pairs: &[&PrintedTrace]) -> (String, usize) {
    let mut smallest = 0usize;
    let mut best_gain: Option<(f64, &str, &str)> = None;
    let mut no_device: Vec<String> = Vec::new();
    for t in pairs {
        let e = t.plain(Policy::Expandable).expect("filtered");
        let mut least = e.min_cap_gib.is_some();
        for q in PYTORCH.iter().filter_map(|&q| t.plain(q)) {
            match (e.min_cap_gib, q.min_cap_gib) {
                (Some(ec), Some(qc)) => {
                    if ec > qc * (1.0 + MEMORY_TIE) {
                        least = false;
                    }
                    let gain = (qc - ec) / qc * 100.0;
                    if best_gain.is_none_or(|(g, ..)| gain > g) {
                        best_gain = Some((gain, &t.name, &q.label));
                    }
                }
                (Some(_), None) => no_device.push(format!("{} on {}", q.label, t.name)),
                (None, _) => {}
            }
        }
        if least {
            smallest += 1;
        }
    }
    let mut s = format!(
        "Memory: expandable needs no more than PyTorch's allocators (within 1 %) on {smallest} of {}",
        plural(pairs.len(), "trace")
    );
    if let Some((g, t, q)) = best_gain.filter(|(g, ..)| *g >= 0.05) {
        s.push_str(&format!(", up to {g:.1} % less than {q} (on {t})"));
    }
    if !no_device.is_empty() {
        s.push_str(&format!("; no device fits {}", list(&no_device)));
    }
    s.push('.');
    (s, smallest)
}

/// The driver-time sentences over `pairs` (summed where both fit, and the
/// policies out of memory), pushed to `out`; the sums per PyTorch allocator.
fn driver_time_sentences(
    pairs: &[&PrintedTrace],
    out: &mut Vec<String>,
) -> Vec<(&'static str, Shared)> {
    let mut misfits: Vec<(String, Vec<String>)> = Vec::new();
    for p in std::iter::once(Policy::Expandable).chain(PYTORCH) {
        let names: Vec<String> = pairs
            .iter()
            .filter(|t| t.plain(p).is_some_and(|r| !r.fits))
            .map(|t| t.name.clone())
            .collect();
        if !names.is_empty() {
            misfits.push((p.name().to_string(), names));
        }
    }
    let shared = shared_driver_time(pairs);
    let compared: Vec<String> = shared
        .iter()
        .map(|(q, sh)| {
            if sh.traces == 0 {
                format!("against {q}, no trace where both fit")
            } else {
                format!(
                    "against {q} on {}, expandable {:.1} ms cold and {:.1} ms per further pass, {q} {:.1} and {:.1}",
                    plural(sh.traces, "trace"),
                    sh.e_cold,
                    sh.e_steady,
                    sh.q_cold,
                    sh.q_steady
                )
            }
        })
        .collect();
    out.push(format!(
        "Driver time, summed over the traces where both fit the tight device: {}.",
        compared.join("; ")
    ));
    if !misfits.is_empty() {
        out.push(format!(
            "Out of memory at the tight device, so not compared: {}.",
            misfits
                .iter()
                .map(|(p, names)| format!("{p} on {}", list(names)))
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    shared
}

/// Per PyTorch allocator present in `pairs`: expandable's and its driver
/// time summed over the traces where both fit.
fn shared_driver_time(pairs: &[&PrintedTrace]) -> Vec<(&'static str, Shared)> {
    let mut shared = Vec::new();
    for q in PYTORCH {
        let mut sh = Shared::default();
        let mut present = false;
        for t in pairs {
            let (Some(e), Some(r)) = (t.plain(Policy::Expandable), t.plain(q)) else {
                continue;
            };
            present = true;
            if e.fits && r.fits {
                sh.traces += 1;
                sh.e_cold += e.cold_ms;
                sh.q_cold += r.cold_ms;
                sh.e_steady += e.steady_ms.unwrap_or(0.0);
                sh.q_steady += r.steady_ms.unwrap_or(0.0);
            }
        }
        if present {
            shared.push((q.name(), sh));
        }
    }
    shared
}

/// The advice that follows from the memory and driver-time sentences
/// (`smallest`: the traces where expandable needs the least memory).
fn advice(pairs: &[&PrintedTrace], shared: &[(&str, Shared)], smallest: usize) -> String {
    let e_fits_wherever_any = pairs.iter().all(|t| {
        t.plain(Policy::Expandable).is_some_and(|e| e.fits) || t.rows.iter().all(|r| !r.fits)
    });
    let dearer: Vec<&str> = shared
        .iter()
        .filter(|(_, sh)| {
            sh.traces > 0 && sh.e_steady > sh.q_steady && !steady_ties(sh.e_steady, sh.q_steady)
        })
        .map(|(q, _)| *q)
        .collect();
    match pytorch_to_keep(pairs, shared) {
        Some(q) => format!(
            "Memory does not decide here: {q} fits every trace in as little (within 1 %) and spends no more \
             driver time per further pass, so keep PyTorch's allocator (`vmmalloc advise` checks your trace \
             and GPU)."
        ),
        _ if smallest == pairs.len() && e_fits_wherever_any && dearer.is_empty() => {
            "So expandable: of the allocators that cache memory (expandable, caching, torch-es), it \
             needs the smallest device and, where a PyTorch allocator fits too, no more driver time \
             per further pass."
                .to_string()
        }
        _ if smallest == pairs.len() && e_fits_wherever_any => format!(
            "So expandable where memory is tight; where {} fit{}, {} less driver time per further pass \
             (`vmmalloc advise` weighs both for your GPU).",
            list(&dearer.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
            if dearer.len() == 1 { "s" } else { "" },
            if dearer.len() == 1 { "it spends" } else { "they spend" }
        ),
        _ => "Neither wins everywhere: `vmmalloc advise` weighs memory and driver time for your \
              trace and GPU."
            .to_string(),
    }
}

/// A PyTorch allocator that fits every trace with as little memory
/// (within 1 %) as expandable and no more driver time per further pass.
fn pytorch_to_keep(pairs: &[&PrintedTrace], shared: &[(&str, Shared)]) -> Option<Policy> {
    PYTORCH.into_iter().find(|&q| {
        let cheap = shared.iter().any(|(n, sh)| {
            *n == q.name() && (sh.q_steady <= sh.e_steady || steady_ties(sh.e_steady, sh.q_steady))
        });
        cheap
            && pairs
                .iter()
                .all(|t| match (t.plain(Policy::Expandable), t.plain(q)) {
                    (Some(e), Some(r)) => {
                        r.fits
                            && match (e.min_cap_gib, r.min_cap_gib) {
                                (Some(ec), Some(qc)) => (ec - qc).abs() <= ec.min(qc) * MEMORY_TIE,
                                _ => false,
                            }
                    }
                    _ => false,
                })
    })
}

impl PolicyRow {
    /// Whether the replay at the tight device fit: no out-of-memory error
    /// and no stop, cold or steady (the table's `ok`).
    pub fn fits(&self) -> bool {
        self.tight.ok
            && self.tight.error.is_none()
            && self
                .tight
                .steady
                .as_ref()
                .is_none_or(|s| s.ok && s.error.is_none())
    }

    /// The cold pass's modeled driver time at the tight device, ms, as a cell.
    pub fn cold_ms_cell(&self) -> String {
        format!("{:.1}", self.tight.modeled_driver_us / 1000.0)
    }

    /// The steady pass's modeled driver time at the tight device, ms, as a
    /// cell (`None`: no steady pass).
    pub fn steady_ms_cell(&self) -> Option<String> {
        self.tight
            .steady
            .as_ref()
            .map(|s| format!("{:.1}", s.modeled_driver_us / 1000.0))
    }
}

/// The claim checker the CLI tests use (tests/common/conclusion.rs), here
/// run on tables generated at random.
#[cfg(test)]
#[path = "../tests/common/conclusion.rs"]
mod check;

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift64*).
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        /// A value with one or two decimals, as a cell prints it.
        fn cell(&mut self, lo: f64, span: f64, decimals: i32) -> f64 {
            let x = lo + span * (self.below(10_000) as f64 / 10_000.0);
            let p = 10f64.powi(decimals);
            (x * p).round() / p
        }
    }

    const POLICIES: [Policy; 4] = [
        Policy::Expandable,
        Policy::Caching,
        Policy::TorchEs,
        Policy::Native,
    ];

    /// A random table where `fails` (if any) runs out of memory on some or
    /// every trace, and any policy may run out elsewhere too.
    fn table(g: &mut Gen, fails: Option<Policy>, everywhere: bool) -> Vec<PrintedTrace> {
        let n = 1 + g.below(4) as usize;
        (0..n)
            .map(|i| {
                let peak = g.cell(5.0, 50.0, 2);
                let present: Vec<Policy> = POLICIES
                    .into_iter()
                    .filter(|&p| p == Policy::Expandable || g.below(5) > 0)
                    .collect();
                let rows = present
                    .into_iter()
                    .map(|p| {
                        let forced = fails == Some(p) && (everywhere || g.below(2) == 0);
                        let fits = !forced && g.below(6) > 0;
                        // Min capacities close together, so ties happen.
                        let min_cap_gib = (g.below(12) > 0).then(|| g.cell(peak, peak * 0.03, 2));
                        let steady = (fits || g.below(2) == 0).then(|| {
                            if g.below(3) == 0 {
                                0.0
                            } else {
                                g.cell(0.0, 100.0, 1)
                            }
                        });
                        Printed {
                            label: p.name().to_string(),
                            plain: Some(p),
                            min_cap_gib,
                            fits,
                            cold_ms: g.cell(1.0, 500.0, 1),
                            steady_ms: steady,
                        }
                    })
                    .collect();
                PrintedTrace {
                    name: format!("trace-{i}"),
                    rows,
                }
            })
            .collect()
    }

    fn blocks(traces: &[PrintedTrace]) -> Vec<check::Block> {
        traces
            .iter()
            .map(|t| check::Block {
                name: t.name.clone(),
                rows: t
                    .rows
                    .iter()
                    .map(|r| check::Row {
                        label: r.label.clone(),
                        min_cap: r.min_cap_gib,
                        ok: r.fits,
                        cold: r.cold_ms,
                        steady: r.steady_ms,
                    })
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn every_claim_follows_from_generated_tables_where_each_policy_fails_in_turn() {
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        let mut seen_nothing_fits = 0;
        for fails in std::iter::once(None).chain(POLICIES.map(Some)) {
            for everywhere in [false, true] {
                for _ in 0..400 {
                    let t = table(&mut g, fails, everywhere);
                    let s = sentences(&t).join(" ");
                    if s.starts_with("Nothing fits") {
                        seen_nothing_fits += 1;
                    }
                    check::check(&blocks(&t), &s);
                }
            }
        }
        assert!(seen_nothing_fits > 0);
    }

    #[test]
    fn the_checker_catches_a_claim_the_table_contradicts() {
        let mut g = Gen(7);
        let t = table(&mut g, Some(Policy::Caching), true);
        let s = sentences(&t).join(" ");
        // A sum off by 1 ms, or a trace count off by one, is caught.
        let bumped = s.replacen(" ms cold", "1 ms cold", 1);
        let recounted = s.replacen(" of ", " of 1", 1);
        for wrong in [bumped, recounted] {
            if wrong != s {
                let b = blocks(&t);
                assert!(
                    std::panic::catch_unwind(|| check::check(&b, &wrong)).is_err(),
                    "{wrong}"
                );
            }
        }
    }

    #[test]
    fn nothing_fits_names_the_smallest_device_and_gives_no_advice() {
        let t = vec![PrintedTrace {
            name: "t".into(),
            rows: POLICIES
                .iter()
                .enumerate()
                .map(|(i, &p)| Printed {
                    label: p.name().into(),
                    plain: Some(p),
                    min_cap_gib: Some(12.0 + i as f64),
                    fits: false,
                    cold_ms: 1.0,
                    steady_ms: None,
                })
                .collect(),
        }];
        let s = sentences(&t).join(" ");
        assert!(
            s.starts_with("Nothing fits: every policy ran out of memory at the tight device on the trace (t needs 12.00 GiB with expandable)."),
            "{s}"
        );
        assert!(!s.contains("So expandable") && !s.contains("keep"), "{s}");
        check::check(&blocks(&t), &s);
    }
}
