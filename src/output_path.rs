//! Where the commands write files (`compare --json FILE` and `--out DIR`,
//! `snapshot --out FILE`, `calibrate --json FILE`, `bench --json FILE`):
//! one rule for folders that do not exist yet. They are created where they
//! lie under the current directory, or anywhere when the user passes
//! `--mkdir`; elsewhere the command refuses, before it runs anything, with a
//! message that says how to proceed. So a typo never creates a folder at
//! the filesystem's root (`--json /nonexistent/x.json`).
//!
//! And one rule for inputs: no command writes over one of its own inputs
//! (the same path, a link to it, or the same file by device and inode);
//! [`refuse_inputs`] says so before anything runs, the input untouched.
//! A file that replaces an existing one is written to a temporary file in
//! the same folder and renamed over it ([`write_via_temp`]), so an
//! interrupted run never leaves half a file (and an output that was a link
//! becomes a file of its own; what it pointed to is left alone).

use anyhow::{bail, Context, Result};
use std::os::unix::fs::MetadataExt as _;
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

/// The files among a command's inputs as written (`compare a.pickle
/// serve-kv`, `--cost-file FILE`): the bundled snapshot's name resolved to
/// its file, workload specs and missing paths left out. An empty list of
/// traces means the default inputs, as for [`crate::input::load_inputs`].
pub fn input_files(traces: &[String], others: &[Option<&Path>]) -> Vec<PathBuf> {
    let traces = if traces.is_empty() {
        crate::input::default_inputs()
    } else {
        traces.to_vec()
    };
    traces
        .iter()
        .map(|t| PathBuf::from(crate::input::resolve_input(t)))
        .chain(others.iter().flatten().map(|p| p.to_path_buf()))
        .filter(|p| p.is_file())
        .collect()
}

/// Refuses to write `output` (named by option `flag`) when it is one of
/// `inputs`: the same path, a link to it, or the same file by device and
/// inode (a hard link). An output that does not exist yet is no input.
pub fn refuse_inputs(flag: &str, output: &Path, inputs: &[PathBuf]) -> Result<()> {
    if let Some(input) = inputs.iter().find(|i| same_file(output, i)) {
        let same = if output == input.as_path() {
            String::new()
        } else {
            format!(" (the same file as input {})", input.display())
        };
        bail!(
            "{flag} {}{same} is one of this command's inputs: writing it would replace the input              (choose another output)",
            output.display()
        );
    }
    Ok(())
}

/// Refuses an output folder (`compare --out DIR`) where the report would
/// replace one of `inputs`: `report.md`, `report.html`, `overhead.svg` or a
/// `memory-*.svg` plot in `dir`.
pub fn refuse_inputs_in_dir(flag: &str, dir: &Path, inputs: &[PathBuf]) -> Result<()> {
    for input in inputs {
        let Some(name) = input.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let written = name == "report.md"
            || name == "report.html"
            || name == "overhead.svg"
            || (name.starts_with("memory-") && name.ends_with(".svg"));
        if written && same_file(&dir.join(name), input) {
            bail!(
                "{flag} {}: the report writes {name} there, which is this command's input {} \
                 (choose another folder)",
                dir.display(),
                input.display()
            );
        }
    }
    Ok(())
}

/// Whether `a` and `b` name the same existing file (links followed).
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Writes the file `path` through `write`, which is given a temporary path
/// in the same folder; the temporary file is then renamed to `path` (or
/// removed if `write` fails), so an existing `path` is replaced whole or
/// not at all.
pub fn write_via_temp(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".vmmalloc-tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let done = write(&tmp).and_then(|()| {
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    });
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// Writes `contents` to the file `path` by [`write_via_temp`].
pub fn write_file(path: &Path, contents: &[u8]) -> Result<()> {
    write_via_temp(path, |tmp| {
        std::fs::write(tmp, contents).with_context(|| format!("writing {}", path.display()))
    })
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

    #[test]
    fn an_output_is_refused_when_it_is_an_input_by_path_link_or_inode() {
        let dir = std::env::temp_dir().join(format!("vmmalloc-outpath-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let input = dir.join("in.txt");
        std::fs::write(&input, "x").unwrap();
        std::os::unix::fs::symlink(&input, dir.join("link.txt")).unwrap();
        std::fs::hard_link(&input, dir.join("hard.txt")).unwrap();
        std::fs::write(dir.join("other.txt"), "y").unwrap();
        let inputs = vec![input.clone()];
        for out in ["in.txt", "link.txt", "hard.txt", "./in.txt"] {
            let out = dir.join(out);
            let e = refuse_inputs("--out", &out, &inputs)
                .unwrap_err()
                .to_string();
            assert!(e.contains("one of this command's inputs"), "{e}");
        }
        refuse_inputs("--out", &dir.join("other.txt"), &inputs).unwrap();
        refuse_inputs("--out", &dir.join("new.txt"), &inputs).unwrap();
        std::fs::write(dir.join("report.md"), "z").unwrap();
        let e = refuse_inputs_in_dir("--out", &dir, &[dir.join("report.md")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("report.md"), "{e}");
        refuse_inputs_in_dir("--out", &dir, &inputs).unwrap();
        // Replacing renames a new file over the old: the other name of a
        // hard link keeps its bytes, and a failed write leaves no trace.
        write_file(&dir.join("hard.txt"), b"new").unwrap();
        assert_eq!(std::fs::read(&input).unwrap(), b"x");
        assert_eq!(std::fs::read(dir.join("hard.txt")).unwrap(), b"new");
        let failed = write_via_temp(&dir.join("other.txt"), |tmp| {
            std::fs::write(tmp, "partial").unwrap();
            bail!("stopped")
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read(dir.join("other.txt")).unwrap(), b"y");
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["hard.txt", "in.txt", "link.txt", "other.txt", "report.md"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
