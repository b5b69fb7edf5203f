//! Where the commands write files (`compare --json FILE` and `--out DIR`,
//! `snapshot --out FILE`, `calibrate --json FILE`, `bench --json FILE`):
//! one rule for folders that do not exist yet. They are created where they
//! lie under the current directory, or anywhere when the user passes
//! `--mkdir`; elsewhere the command refuses, before it runs anything, with a
//! message that says how to proceed. So a typo never creates a folder at
//! the filesystem's root (`--json /nonexistent/x.json`).

use anyhow::{bail, Context, Result};
use std::path::{Component, Path, PathBuf};

/// The `--mkdir` option of every command that writes a file.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct MkdirArg {
    /// Create the output's missing folders wherever they are (without it,
    /// only folders under the current directory are created).
    #[arg(long)]
    pub mkdir: bool,
}

/// Makes sure the folder that will hold the file `path` exists (see the
/// module's rule); `flag` names the option in the message.
pub fn prepare_file(flag: &str, path: &Path, mkdir: bool) -> Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => ensure_dir(flag, path, parent, mkdir),
        None => Ok(()),
    }
}

/// Makes sure the folder `dir` (an output folder the user named) exists:
/// `dir` itself is created, its missing parents by the module's rule.
pub fn prepare_dir(flag: &str, dir: &Path, mkdir: bool) -> Result<()> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        ensure_dir(flag, dir, parent, mkdir)?;
    }
    if !dir.is_dir() {
        std::fs::create_dir(dir)
            .with_context(|| format!("{flag} {}: creating it", dir.display()))?;
    }
    Ok(())
}

/// Creates `dir` (the folder of `output`) if it is missing and the rule allows.
fn ensure_dir(flag: &str, output: &Path, dir: &Path, mkdir: bool) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if dir.exists() {
        bail!(
            "{flag} {}: {} is not a folder",
            output.display(),
            dir.display()
        );
    }
    if !mkdir && !under_current_dir(dir) {
        bail!(
            "{flag} {}: the folder {} does not exist (create it, or pass --mkdir; only folders under \
             the current directory are created without asking)",
            output.display(),
            missing_top(dir).display()
        );
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{flag} {}: creating {}", output.display(), dir.display()))
}

/// The outermost missing folder of `dir` (what `--mkdir` would create first).
fn missing_top(dir: &Path) -> PathBuf {
    let mut top = dir.to_path_buf();
    while let Some(p) = top
        .parent()
        .filter(|p| !p.as_os_str().is_empty() && !p.exists())
    {
        top = p.to_path_buf();
    }
    top
}

/// Whether `dir` lies under the current directory, judged on the path as
/// written (a relative path that never climbs above its start with `..`,
/// or an absolute one that starts with the current directory).
fn under_current_dir(dir: &Path) -> bool {
    let Ok(cwd) = std::env::current_dir() else {
        return false;
    };
    // Joining an absolute path gives that path.
    let Some(normal) = normalize(&cwd.join(dir)) else {
        return false;
    };
    [Some(cwd.clone()), cwd.canonicalize().ok()]
        .into_iter()
        .flatten()
        .any(|c| normal != c && normal.starts_with(&c))
}

/// `path` without `.` and `..` components (lexically; `None` if `..`
/// climbs above the root).
fn normalize(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            other => out.push(other),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_are_created_only_under_the_current_directory() {
        let cwd = std::env::current_dir().unwrap();
        assert!(under_current_dir(Path::new("a/b")));
        assert!(under_current_dir(&cwd.join("a")));
        assert!(!under_current_dir(Path::new("../elsewhere")));
        assert!(!under_current_dir(Path::new("a/../../elsewhere")));
        assert!(!under_current_dir(Path::new("/nonexistent")));
        assert!(!under_current_dir(&cwd));
        let e = prepare_file("--json", Path::new("/nonexistent-vmmalloc/x.json"), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent-vmmalloc does not exist") && e.contains("--mkdir"),
            "{e}"
        );
        assert!(!Path::new("/nonexistent-vmmalloc").exists());
        assert_eq!(
            missing_top(Path::new("/nonexistent-vmmalloc/a/b")),
            Path::new("/nonexistent-vmmalloc")
        );
    }
}
