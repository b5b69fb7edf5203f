//! Stack frames of an allocation, as PyTorch's memory snapshots record them
//! (`torch.cuda.memory._record_memory_history(stacks="python")`: each trace
//! entry and block has `frames`, a list of `{filename, line, name}` dicts,
//! innermost first; `torch/cuda/_memory_viz.py` `_frame_fmt` prints one as
//! `filename:line:name`).

use std::sync::Arc;

/// One stack frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Source file as recorded (any path style).
    pub filename: String,
    /// Line number.
    pub line: i64,
    /// Function name.
    pub name: String,
}

/// A shared stack, innermost frame first.
pub type Stack = Arc<[Frame]>;

impl Frame {
    /// `model.py:54 forward`: the file name without its directories.
    pub fn short(&self) -> String {
        let file = self
            .filename
            .rsplit(['/', '\\'])
            .next()
            .unwrap_or(&self.filename);
        format!("{file}:{} {}", self.line, self.name)
    }

    /// Whether the frame is inside an installed package or PyTorch itself
    /// (`site-packages`, `dist-packages`, `torch/`), not the user's code.
    pub fn is_library(&self) -> bool {
        let f = self.filename.replace('\\', "/");
        f.contains("site-packages/")
            || f.contains("dist-packages/")
            || f.contains("/torch/")
            || f.starts_with('<')
    }
}

/// Where a stack was allocated, in a few words: its two innermost frames of
/// user code (`model.py:54 forward < model.py:245 forward`), or the innermost
/// frame where all are library code; empty for an empty stack.
pub fn describe(stack: &[Frame]) -> String {
    let user: Vec<String> = stack
        .iter()
        .filter(|f| !f.is_library())
        .take(2)
        .map(Frame::short)
        .collect();
    if user.is_empty() {
        stack.first().map(Frame::short).unwrap_or_default()
    } else {
        user.join(" < ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(file: &str, line: i64, name: &str) -> Frame {
        Frame {
            filename: file.into(),
            line,
            name: name.into(),
        }
    }

    #[test]
    fn describe_prefers_user_frames() {
        let stack = [
            f(
                r"C:\venv\Lib\site-packages\torch\nn\functional.py",
                10,
                "linear",
            ),
            f(r"D:\proj\model.py", 54, "forward"),
            f(
                "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py",
                1790,
                "_call_impl",
            ),
            f("/home/u/proj/model.py", 245, "forward"),
            f("/home/u/proj/train.py", 65, "<module>"),
        ];
        assert_eq!(
            describe(&stack),
            "model.py:54 forward < model.py:245 forward"
        );
        assert_eq!(describe(&stack[..1]), "functional.py:10 linear");
        assert_eq!(describe(&[]), "");
    }
}
