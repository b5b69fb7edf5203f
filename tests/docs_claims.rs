//! What the docs say works in PyTorch agrees with the one table that says
//! it: the torch companion's capability table (`FEATURES` in
//! python/vmmalloc/_companion.py, issue 45). A paragraph of README.md,
//! python/README.md or docs/ that names a PyTorch API the companion serves
//! and says it raises or is not supported must say under which condition
//! (without the companion); `advise` counts its features from the same
//! table (src/advise.rs, tested there and in tests/cli_explain.rs).

use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The PyTorch APIs the companion's FEATURES name: each description's
/// dotted or underscored names (`torch.backends.cudnn.benchmark`,
/// `torch.cuda.memory._record_memory_history`), with their last part.
fn companion_apis() -> Vec<String> {
    let src = std::fs::read_to_string(root().join("python/vmmalloc/_companion.py")).unwrap();
    let start = src.find("\nFEATURES = (\n").expect("FEATURES table");
    let end = start + src[start..].find("\n)\n").expect("end of FEATURES");
    let mut out = Vec::new();
    for word in src[start..end].split(|c: char| c.is_whitespace() || "\"(),:=".contains(c)) {
        // An exception type is raised by design (`torch.cuda.OutOfMemoryError`).
        if word.starts_with("torch.") && word.len() > "torch.".len() && !word.ends_with("Error") {
            out.push(word.trim_end_matches('.').to_string());
            let last = word.rsplit('.').next().unwrap();
            if last.starts_with('_') && last.len() > 8 {
                out.push(last.to_string());
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Words that say a feature does not work.
const NEGATIVE: [&str; 5] = [
    "raises",
    "not supported",
    "does not support",
    "unsupported",
    "does not work",
];

/// The statements (list items or paragraphs) of `text` that say an API of
/// `apis` fails, in a sentence or clause of their own, and never name the
/// companion (the condition under which it fails).
fn unconditional_failures(text: &str, apis: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for para in text.split("\n\n") {
        // List items are statements of their own.
        for item in para.split("\n- ") {
            let flat = item.split_whitespace().collect::<Vec<_>>().join(" ");
            let claims = flat.split(". ").flat_map(|s| s.split("; ")).any(|s| {
                apis.iter().any(|a| s.contains(a.as_str()))
                    && NEGATIVE.iter().any(|n| s.contains(n))
            });
            if claims && !flat.to_lowercase().contains("companion") {
                out.push(flat);
            }
        }
    }
    out
}

#[test]
fn the_check_finds_the_stale_limits_advise_printed() {
    let apis = companion_apis();
    let stale = "What the plug-in does not support yet:\n\
                 - torch.backends.cudnn.benchmark = True raises: CUDAPluggableAllocator has no cacheInfo hook\n\
                 - torch.cuda.memory._record_memory_history raises: set record_history:True";
    assert_eq!(unconditional_failures(stale, &apis).len(), 2);
    let fine = "Without the torch companion: torch.backends.cudnn.benchmark = True raises.";
    assert!(unconditional_failures(fine, &apis).is_empty());
}

#[test]
fn a_companion_feature_is_said_to_fail_only_without_the_companion() {
    let apis = companion_apis();
    for api in [
        "torch.backends.cudnn.benchmark",
        "_record_memory_history",
        "torch.multiprocessing",
    ] {
        assert!(
            apis.iter().any(|a| a == api),
            "{api} not read from FEATURES: {apis:?}"
        );
    }
    let mut pages = vec![root().join("README.md"), root().join("python/README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p);
        }
    }
    let mut wrong = Vec::new();
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        for claim in unconditional_failures(&text, &apis) {
            wrong.push(format!("{}: {claim}", page.display()));
        }
    }
    assert!(
        wrong.is_empty(),
        "statements that a companion feature fails, with no condition:\n{}",
        wrong.join("\n\n")
    );
}
