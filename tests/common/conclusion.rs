//! Checks `vmmalloc compare`'s conclusion against the table printed above
//! it, claim by claim, recomputing every number and every verdict from the
//! table's cells alone (issue 36). Written apart from the code that makes
//! the conclusion (src/conclusion.rs): the CLI tests read the printed
//! output with [`parse_output`], and that module's own tests check tables
//! it generates at random through [`check`].

#![allow(dead_code)]

/// One row of a trace's block, as printed.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The policy label.
    pub label: String,
    /// `min cap GiB` (`None`: `-`).
    pub min_cap: Option<f64>,
    /// The `tight` cell is `ok`.
    pub ok: bool,
    /// Cold `driver ms`.
    pub cold: f64,
    /// Steady `driver ms` (`None`: `-`).
    pub steady: Option<f64>,
}

/// One trace's block.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// The name the conclusion uses.
    pub name: String,
    /// Its rows.
    pub rows: Vec<Row>,
}

impl Block {
    fn row(&self, label: &str) -> Option<&Row> {
        self.rows.iter().find(|r| r.label == label)
    }
}

/// Reads the default output of `vmmalloc compare`: every trace's block and
/// the conclusion paragraph (lines joined), if any.
pub fn parse_output(out: &str) -> (Vec<Block>, Option<String>) {
    let lines: Vec<&str> = out.lines().collect();
    let mut raw: Vec<(String, u32, Vec<Row>)> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        let heading = l
            .split_once(" (device ")
            .filter(|(_, rest)| rest.contains("): peak live ") && !l.starts_with(' '));
        if let (Some((name, rest)), Some(next)) = (heading, lines.get(i + 1)) {
            if next.starts_with("policy ") {
                let device: u32 = rest.split(')').next().unwrap().parse().unwrap();
                let mut rows = Vec::new();
                i += 3; // heading, header, rule
                while i < lines.len() && !lines[i].is_empty() && !lines[i].starts_with(' ') {
                    rows.push(parse_row(lines[i]));
                    i += 1;
                }
                raw.push((name.to_string(), device, rows));
                continue;
            }
        }
        i += 1;
    }
    let blocks = raw
        .iter()
        .map(|(name, device, rows)| Block {
            name: if raw.iter().filter(|(n, ..)| n == name).count() > 1 {
                format!("{name} device {device}")
            } else {
                name.clone()
            },
            rows: rows.clone(),
        })
        .collect();
    let conclusion = out
        .split("\n\n")
        .find(|p| p.starts_with("Conclusion: "))
        .map(|p| p.trim_end().replace('\n', " "));
    (blocks, conclusion)
}

/// One table row: cells are two or more spaces apart.
fn parse_row(line: &str) -> Row {
    let cells: Vec<&str> = line
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(cells.len(), 7, "not a row of 7 cells: {line}");
    let (cold, steady) = cells[5].split_once(" / ").expect("cold / steady");
    Row {
        label: cells[0].to_string(),
        min_cap: cells[1].parse().ok(),
        ok: cells[3] == "ok",
        cold: cold.parse().unwrap(),
        steady: steady.parse().ok(),
    }
}

const PYTORCH: [&str; 2] = ["caching", "torch-es"];

fn list(names: &[String]) -> String {
    match names {
        [] => String::new(),
        [a] => a.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

fn traces(n: usize) -> String {
    format!("{n} trace{}", if n == 1 { "" } else { "s" })
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 0.051
}

/// Takes the sentence that starts with `prefix` out of `rest`.
fn take<'a>(rest: &mut Vec<&'a str>, prefix: &str) -> Option<&'a str> {
    let i = rest.iter().position(|s| s.starts_with(prefix))?;
    Some(rest.remove(i))
}

/// Checks every sentence of `conclusion` (without the `Conclusion: `
/// prefix or with it) against `blocks`; panics naming the claim that the
/// table contradicts, and on any sentence it does not know.
pub fn check(blocks: &[Block], conclusion: &str) {
    let text = conclusion
        .strip_prefix("Conclusion: ")
        .unwrap_or(conclusion);
    let mut rest: Vec<&str> = text
        .split_inclusive(". ")
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect();
    let ctx = |claim: &str| format!("claim `{claim}` against the table {blocks:#?}");
    // Nothing fits / no policy fits some traces.
    let misfit: Vec<&Block> = blocks
        .iter()
        .filter(|b| b.rows.iter().all(|r| !r.ok))
        .collect();
    let needs = |b: &Block| {
        let m = b
            .rows
            .iter()
            .filter_map(|r| r.min_cap)
            .fold(f64::INFINITY, f64::min);
        (
            m,
            b.rows
                .iter()
                .filter(|r| r.min_cap == Some(m))
                .map(|r| r.label.clone())
                .collect::<Vec<_>>(),
        )
    };
    let check_needs = |claim: &str| {
        for b in &misfit {
            let (m, who) = needs(b);
            let named = if m.is_finite() {
                who.iter()
                    .any(|w| claim.contains(&format!("{} needs {m:.2} GiB with {w}", b.name)))
            } else {
                claim.contains(&format!("{}: no policy fits any device searched", b.name))
            };
            assert!(named, "{}", ctx(claim));
        }
    };
    let nothing = misfit.len() == blocks.len() && !blocks.is_empty();
    match take(&mut rest, "Nothing fits:") {
        Some(claim) => {
            assert!(nothing, "{}", ctx(claim));
            check_needs(claim);
            let all = misfit.iter().map(|b| needs(b).0).fold(0.0, f64::max);
            let them = take(&mut rest, "The smallest device that would fit them all");
            if blocks.len() > 1 && all.is_finite() {
                let s = them.unwrap_or_else(|| panic!("no smallest device named: {text}"));
                assert!(s.contains(&format!("is {all:.2} GiB")), "{}", ctx(s));
            } else {
                assert!(them.is_none(), "{text}");
            }
        }
        None => assert!(
            !nothing,
            "nothing fits, and the conclusion does not say so: {text}"
        ),
    }
    match take(&mut rest, "No policy fits the tight device on") {
        Some(claim) => {
            assert!(!nothing && !misfit.is_empty(), "{}", ctx(claim));
            assert!(
                claim.contains(&format!("on {} of {}", traces(misfit.len()), blocks.len())),
                "{}",
                ctx(claim)
            );
            check_needs(claim);
        }
        None => assert!(
            nothing || misfit.is_empty(),
            "traces where nothing fits go unmentioned: {text}"
        ),
    }
    // The traces with a plain expandable row and a PyTorch one.
    let pairs: Vec<&Block> = blocks
        .iter()
        .filter(|b| b.row("expandable").is_some() && PYTORCH.iter().any(|q| b.row(q).is_some()))
        .collect();
    if pairs.is_empty() {
        assert!(rest.is_empty(), "unchecked sentences: {rest:?}");
        return;
    }
    // Memory.
    let claim = take(&mut rest, "Memory: ").unwrap_or_else(|| panic!("no memory claim: {text}"));
    let mut least = 0;
    let mut gains: Vec<(f64, String, String)> = Vec::new();
    let mut no_device = Vec::new();
    for b in &pairs {
        let e = b.row("expandable").unwrap();
        let mut ok = e.min_cap.is_some();
        for q in PYTORCH.iter().filter_map(|q| b.row(q)) {
            match (e.min_cap, q.min_cap) {
                (Some(ec), Some(qc)) => {
                    ok &= ec <= qc * 1.01;
                    gains.push(((qc - ec) / qc * 100.0, q.label.clone(), b.name.clone()));
                }
                (Some(_), None) => no_device.push(format!("{} on {}", q.label, b.name)),
                (None, _) => {}
            }
        }
        least += usize::from(ok);
    }
    assert!(
        claim.contains(&format!(
            "(within 1 %) on {least} of {}",
            traces(pairs.len())
        )),
        "{}",
        ctx(claim)
    );
    let top = gains.iter().map(|g| g.0).fold(f64::NEG_INFINITY, f64::max);
    if let Some(up) = claim.split_once(", up to ").map(|(_, r)| r) {
        let (g, tail) = up.split_once(" % less than ").unwrap();
        let g: f64 = g.parse().unwrap();
        assert!(close(g, top), "{}", ctx(claim));
        // The policy and trace named reach that gain.
        assert!(
            gains
                .iter()
                .any(|(x, q, t)| close(*x, g) && tail.starts_with(&format!("{q} (on {t})"))),
            "{}",
            ctx(claim)
        );
    } else {
        assert!(gains.is_empty() || top < 0.05, "{}", ctx(claim));
    }
    if no_device.is_empty() {
        assert!(!claim.contains("no device fits"), "{}", ctx(claim));
    } else {
        assert!(
            claim.contains(&format!("no device fits {}", list(&no_device))),
            "{}",
            ctx(claim)
        );
    }
    if nothing {
        assert!(
            rest.is_empty(),
            "claims beyond memory where nothing fits: {rest:?}"
        );
        return;
    }
    // Driver time where both fit, per PyTorch allocator.
    let claim = take(
        &mut rest,
        "Driver time, summed over the traces where both fit",
    )
    .unwrap_or_else(|| panic!("no driver-time claim: {text}"));
    let mut sums: Vec<(&str, usize, [f64; 4])> = Vec::new();
    for q in PYTORCH {
        if !pairs.iter().any(|b| b.row(q).is_some()) {
            assert!(!claim.contains(&format!("against {q}")), "{}", ctx(claim));
            continue;
        }
        let both: Vec<(&Row, &Row)> = pairs
            .iter()
            .filter_map(|b| Some((b.row("expandable")?, b.row(q)?)))
            .filter(|(e, r)| e.ok && r.ok)
            .collect();
        let s = [
            both.iter().map(|(e, _)| e.cold).sum::<f64>(),
            both.iter()
                .map(|(e, _)| e.steady.unwrap_or(0.0))
                .sum::<f64>(),
            both.iter().map(|(_, r)| r.cold).sum::<f64>(),
            both.iter()
                .map(|(_, r)| r.steady.unwrap_or(0.0))
                .sum::<f64>(),
        ];
        let want = if both.is_empty() {
            format!("against {q}, no trace where both fit")
        } else {
            format!(
                "against {q} on {}, expandable {:.1} ms cold and {:.1} ms per further pass, {q} {:.1} and {:.1}",
                traces(both.len()),
                s[0],
                s[1],
                s[2],
                s[3]
            )
        };
        assert!(claim.contains(&want), "wanted `{want}`: {}", ctx(claim));
        sums.push((q, both.len(), s));
    }
    // The replays left out, by policy.
    let mut misfits = Vec::new();
    for p in ["expandable", "caching", "torch-es"] {
        let names: Vec<String> = pairs
            .iter()
            .filter(|b| b.row(p).is_some_and(|r| !r.ok))
            .map(|b| b.name.clone())
            .collect();
        if !names.is_empty() {
            misfits.push(format!("{p} on {}", list(&names)));
        }
    }
    match take(
        &mut rest,
        "Out of memory at the tight device, so not compared: ",
    ) {
        Some(claim) => assert_eq!(
            claim,
            format!(
                "Out of memory at the tight device, so not compared: {}.",
                misfits.join("; ")
            ),
            "{}",
            ctx(claim)
        ),
        None => assert!(
            misfits.is_empty(),
            "replays that did not fit go unnamed: {text}"
        ),
    }
    // The advice follows from the figures.
    let advice = rest.pop().unwrap_or_else(|| panic!("no advice: {text}"));
    assert!(rest.is_empty(), "unchecked sentences: {rest:?}");
    let ties = |a: f64, b: f64| (a - b).abs() <= 1.0f64.max(0.05 * a.max(b));
    let dearer: Vec<&str> = sums
        .iter()
        .filter(|(_, n, s)| *n > 0 && s[1] > s[3] && !ties(s[1], s[3]))
        .map(|(q, ..)| *q)
        .collect();
    let keep = PYTORCH.iter().find(|&&q| {
        sums.iter()
            .any(|(n, _, s)| *n == q && (s[3] <= s[1] || ties(s[1], s[3])))
            && pairs.iter().all(|b| match (b.row("expandable"), b.row(q)) {
                (Some(e), Some(r)) => {
                    r.ok && matches!((e.min_cap, r.min_cap),
                        (Some(ec), Some(qc)) if (ec - qc).abs() <= ec.min(qc) * 0.01)
                }
                _ => false,
            })
    });
    let e_fits = pairs
        .iter()
        .all(|b| b.row("expandable").is_some_and(|e| e.ok) || b.rows.iter().all(|r| !r.ok));
    if let Some(q) = keep {
        assert!(
            advice.starts_with(&format!(
                "Memory does not decide here: {q} fits every trace"
            )),
            "{}",
            ctx(advice)
        );
    } else if least == pairs.len() && e_fits && dearer.is_empty() {
        // The claim names the set it compares: native (no cache) may need less.
        assert!(
            advice.starts_with("So expandable: of the allocators that cache memory"),
            "{}",
            ctx(advice)
        );
    } else if least == pairs.len() && e_fits {
        assert!(
            advice.starts_with(&format!(
                "So expandable where memory is tight; where {} fit",
                list(&dearer.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            )),
            "{}",
            ctx(advice)
        );
    } else {
        assert!(
            advice.starts_with("Neither wins everywhere"),
            "{}",
            ctx(advice)
        );
    }
}
