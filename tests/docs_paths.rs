//! Every repository path that README.md, python/README.md and docs/ name
//! exists (issue 45): a file or folder under a top-level folder of the
//! repository (`crates/device/src/cuda/mod.rs`, `scripts/gpu-check.sh`), a
//! markdown link relative to its page (`results/long/report.md`), and a
//! bare `*.md` page name (`expandable.md`, found beside the page, at the
//! root, in docs/ or in python/). A crate's section may name its files
//! from the crate's folder (`tests/rules.rs`): such a path counts where
//! exactly one crate has it. Build outputs (`target/...`), what commands
//! write ([`OUTPUTS`]), patterns (`memory-*.svg`, `<profile>`) and
//! addresses are not paths.

use std::path::{Path, PathBuf};

/// The repository's top-level folders a path may start with.
const TOP: [&str; 11] = [
    "crates/",
    "src/",
    "tests/",
    "docs/",
    "scripts/",
    "python/",
    "examples/",
    "vmm-sys/",
    "vendor/",
    ".ci/",
    "shared/",
];

/// Names of files the tools write, not repository paths: `compare --out`'s
/// report, and a test binary's name in the GPU bundle (scripts/gpu-bundle.sh).
const OUTPUTS: [&str; 3] = ["report.md", "report.html", "tests/vmmalloc-device.cuda_gpu"];

/// The crates' folders, for paths named from a crate's folder.
fn crate_dirs() -> Vec<PathBuf> {
    let mut out = vec![root().join("vmm-sys")];
    for e in std::fs::read_dir(root().join("crates")).unwrap() {
        out.push(e.unwrap().path());
    }
    out
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The markdown pages checked: README.md, python/README.md and docs/**.md.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md"), root().join("python/README.md")];
    let mut dirs = vec![root().join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A token as a path: surrounding punctuation, a `#anchor` and a `:LINE`
/// suffix removed; `None` for what is no path.
fn as_path(token: &str) -> Option<String> {
    let t = token.trim_matches(|c: char| "`'\"()[]<>,.;:!?*_".contains(c));
    let t = t.split('#').next()?;
    // `file.rs::test_name`: the file.
    let t = t.split("::").next()?;
    let t = match t.rsplit_once(':') {
        Some((p, n)) if n.chars().all(|c| c.is_ascii_digit()) => p,
        _ => t,
    };
    if t.is_empty()
        || t.contains("://")
        || t.contains("...")
        || t.chars().any(|c| "*<>{}$%=@|\\,()[]'\"`".contains(c))
    {
        return None;
    }
    Some(t.to_string())
}

/// The paths `text` (the page `page`) names: (path, where to look).
fn named(page: &Path, text: &str) -> Vec<(String, Vec<PathBuf>)> {
    let here = page.parent().unwrap().to_path_buf();
    let bases_md = vec![
        here.clone(),
        root(),
        root().join("docs"),
        root().join("python"),
    ];
    let mut out = Vec::new();
    // Markdown link targets, relative to the page.
    for part in text.split("](").skip(1) {
        let Some(target) = part.split(')').next() else {
            continue;
        };
        if let Some(p) = as_path(target) {
            if !p.contains("://") && !p.is_empty() {
                out.push((p, vec![here.clone(), root()]));
            }
        }
    }
    for token in text.split(|c: char| c.is_whitespace() || c == '`' || c == '(' || c == ')') {
        let Some(p) = as_path(token) else {
            continue;
        };
        if OUTPUTS.contains(&p.as_str()) {
            continue;
        }
        if p.starts_with("tests/") || p.starts_with("src/") {
            // The root package's, or one crate's (named from its folder).
            let mut bases = vec![root()];
            let crates: Vec<PathBuf> = crate_dirs()
                .into_iter()
                .filter(|c| c.join(&p).exists())
                .collect();
            if crates.len() == 1 {
                bases.extend(crates);
            }
            out.push((p, bases));
        } else if TOP.iter().any(|t| p.starts_with(t)) {
            out.push((p, vec![root()]));
        } else if !p.contains('/') && p.ends_with(".md") && p.len() > 3 {
            out.push((p, bases_md.clone()));
        }
    }
    out
}

#[test]
fn every_repository_path_named_in_the_docs_exists() {
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (p, bases) in named(&page, &text) {
            checked += 1;
            if !bases.iter().any(|b| b.join(&p).exists()) {
                let rel = page.strip_prefix(root()).unwrap().display().to_string();
                missing.push(format!("{rel}: {p}"));
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        checked > 100,
        "only {checked} paths found: the scan is broken"
    );
    assert!(
        missing.is_empty(),
        "{} paths named in the docs do not exist:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

#[test]
fn the_scan_finds_paths_and_skips_what_is_no_path() {
    let page = root().join("docs/guide.md");
    let found: Vec<String> = named(
        &page,
        "see `crates/device/src/cuda.rs`, [the page](expandable.md#limits), DESIGN.md, \
         `target/release/x`, memory-*.svg, https://example.org/a.md and scripts/x.sh:12.",
    )
    .into_iter()
    .map(|(p, _)| p)
    .collect();
    assert!(
        found.contains(&"crates/device/src/cuda.rs".to_string()),
        "{found:?}"
    );
    assert!(found.contains(&"expandable.md".to_string()), "{found:?}");
    assert!(found.contains(&"DESIGN.md".to_string()), "{found:?}");
    assert!(found.contains(&"scripts/x.sh".to_string()), "{found:?}");
    assert!(
        !found
            .iter()
            .any(|p| p.starts_with("target/") || p.contains('*')),
        "{found:?}"
    );
    assert!(
        !found.iter().any(|p| p.contains("example.org")),
        "{found:?}"
    );
}
