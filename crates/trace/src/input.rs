//! What the command line accepts as a trace: a snapshot pickle, a text trace,
//! or a workload name with overrides.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::error::{ErrorKind, Result, TraceError};
use crate::model::Trace;
use crate::workloads::{self, WORKLOADS};

/// Loads the trace at `path`, detecting its format: a pickle (first byte
/// `0x80`, protocols 2–5) is read as a PyTorch snapshot (streamed, never
/// held in memory), a file whose first non-comment line is
/// `vmmalloc-trace 1` as a text trace.
pub fn load_path(path: &Path) -> Result<Trace> {
    let mut f = std::fs::File::open(path).map_err(|e| TraceError::from(e).in_file(path))?;
    let mut first = [0u8; 1];
    let n = loop {
        match f.read(&mut first) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => break r.map_err(|e| TraceError::from(e).in_file(path))?,
        }
    };
    if n == 1 && first[0] == 0x80 {
        return crate::pytorch::read_snapshot_from(
            first.chain(f),
            &crate::pytorch::file_stem(path),
        )
        .map_err(|e| e.in_file(path));
    }
    let mut bytes = first[..n].to_vec();
    f.read_to_end(&mut bytes)
        .map_err(|e| TraceError::from(e).in_file(path))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        Err(TraceError::new(ErrorKind::Empty).in_file(path))
    } else if crate::text::looks_like_text(&bytes) {
        crate::text::read_text(path)
    } else {
        Err(TraceError::new(ErrorKind::UnknownFormat).in_file(path))
    }
}

/// One input of `vmmalloc compare` / `replay`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A snapshot pickle or a text trace.
    Path(PathBuf),
    /// A workload spec: `name` or `name:key=value,key=value`.
    Workload(String),
}

impl Input {
    /// Classifies `s`: an existing file is a path; else a known workload name
    /// (with optional `:key=value,…` overrides) is a workload; else something
    /// that looks like a path (has a `/` or an extension) is a path, so loading
    /// it reports the missing file; anything else is an error listing the workloads.
    pub fn parse(s: &str) -> Result<Input> {
        let s = s.trim();
        if Path::new(s).is_file() {
            return Ok(Input::Path(PathBuf::from(s)));
        }
        let base = s.split(':').next().unwrap_or("");
        if WORKLOADS.contains(&base) {
            return Ok(Input::Workload(s.to_string()));
        }
        if s.contains('/')
            || s.contains(std::path::MAIN_SEPARATOR)
            || Path::new(s).extension().is_some()
        {
            return Ok(Input::Path(PathBuf::from(s)));
        }
        Err(ErrorKind::UnknownInput {
            input: s.to_string(),
            valid: WORKLOADS.join(", "),
        }
        .into())
    }

    /// Reads or generates the trace.
    pub fn load(&self) -> Result<Trace> {
        match self {
            Input::Path(p) => load_path(p),
            Input::Workload(spec) => workloads::workload_by_name(spec),
        }
    }
}

impl FromStr for Input {
    type Err = TraceError;

    fn from_str(s: &str) -> Result<Input> {
        Input::parse(s)
    }
}

impl std::fmt::Display for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Input::Path(p) => write!(f, "{}", p.display()),
            Input::Workload(w) => f.write_str(w),
        }
    }
}
