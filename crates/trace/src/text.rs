//! The plain text trace format, `vmmalloc-trace 1` (specified in
//! docs/trace-format.md), so that traces from other frameworks can be fed to
//! the replayer.
//!
//! ```text
//! vmmalloc-trace 1
//! # a comment
//! name my-run
//! device 0
//! setting expandable_segments False
//! pre 0x7f0000000000 4096 0
//! alloc 0x7f0000200000 1048576 0 1000
//! free 0x7f0000000000
//! ```
//!
//! The writer emits a canonical form (hex addresses, every event with its
//! size and stream); `write(read(write(t)))` is byte-identical and
//! `read(write(t)) == t` for every trace without final segments (segments are
//! reference data of snapshots and are not written).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::Path;

use crate::error::{ErrorKind, Result, TraceError};
use crate::model::{Alloc, DeviceTrace, DeviceTraceParts, Event, EventKind, Trace};

/// The first line of every text trace.
pub const HEADER: &str = "vmmalloc-trace 1";

/// The keywords a text trace may use, besides the event kinds.
const DIRECTIVES: [&str; 5] = ["name", "device", "setting", "warning", "pre"];

/// Reads the text trace at `path`; without a `name` line it is named after the file stem.
pub fn read_text(path: &Path) -> Result<Trace> {
    let bytes = std::fs::read(path).map_err(|e| TraceError::from(e).in_file(path))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        TraceError::new(ErrorKind::BadHeader(format!("not UTF-8 text ({e})"))).in_file(path)
    })?;
    parse_text(&text, &crate::pytorch::file_stem(path)).map_err(|e| e.in_file(path))
}

/// Whether `text` starts (after blank and comment lines) with the header line.
pub fn looks_like_text(text: &[u8]) -> bool {
    let head = &text[..text.len().min(4096)];
    let head = String::from_utf8_lossy(head);
    head.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .is_some_and(|l| l.split_whitespace().next() == Some("vmmalloc-trace"))
}

struct Section {
    parts: DeviceTraceParts,
    /// Line of each event, to report `DeviceTrace::new` errors at their line.
    event_lines: Vec<usize>,
    /// Live allocations: address → (size, stream), for the short `free ADDR` form.
    live: HashMap<u64, (u64, u64)>,
}

impl Section {
    fn new(device: u32) -> Section {
        Section {
            parts: DeviceTraceParts {
                device,
                ..Default::default()
            },
            event_lines: Vec::new(),
            live: HashMap::new(),
        }
    }
}

/// Parses a text trace; `default_name` names it when it has no `name` line.
pub fn parse_text(text: &str, default_name: &str) -> Result<Trace> {
    let mut reader = TextReader::default();
    for (n, raw) in text.lines().enumerate() {
        reader.line(n + 1, raw.trim())?;
    }
    reader.finish(default_name)
}

/// The error `kind` at line `line_no`.
fn at_line(line_no: usize) -> impl Fn(ErrorKind) -> TraceError {
    move |kind| TraceError::new(kind).at_line(line_no)
}

/// What [`parse_text`] has read so far.
#[derive(Default)]
struct TextReader {
    name: Option<String>,
    header_seen: bool,
    /// Finished device sections.
    done: BTreeMap<u32, Section>,
    /// The section being read.
    current: Option<Section>,
}

impl TextReader {
    /// Reads one trimmed line.
    fn line(&mut self, line_no: usize, line: &str) -> Result<()> {
        let at = at_line(line_no);
        if line.is_empty() || line.starts_with('#') {
            return Ok(());
        }
        let (word, rest) = match line.split_once(char::is_whitespace) {
            Some((w, r)) => (w, r.trim_start()),
            None => (line, ""),
        };
        if !self.header_seen {
            check_header(line, word, rest).map_err(at)?;
            self.header_seen = true;
            return Ok(());
        }
        match word {
            "name" => {
                if self.name.is_some() {
                    return Err(at(ErrorKind::Syntax("a second `name` line".into())));
                }
                self.name = Some(unescape(rest).map_err(at)?);
            }
            "device" => self.start_device(line_no, rest)?,
            "setting" => {
                let sec = self.section();
                let (k, v) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
                if k.is_empty() {
                    return Err(at(ErrorKind::Syntax("`setting` needs a key".into())));
                }
                let k = unescape(k).map_err(&at)?;
                let v = unescape(v.trim_start()).map_err(at)?;
                sec.parts.allocator_settings.insert(k, v);
            }
            "warning" => {
                let sec = self.section();
                sec.parts.warnings.push(unescape(rest).map_err(at)?);
            }
            "pre" => self.section().pre(line_no, rest)?,
            _ => {
                let Some(kind) = EventKind::from_name(word) else {
                    let mut known: Vec<&str> = DIRECTIVES.to_vec();
                    known.extend(EventKind::ALL.iter().map(|k| k.name()));
                    return Err(at(ErrorKind::UnknownAction {
                        action: word.to_string(),
                        known: known.join(", "),
                    }));
                };
                self.section().event(line_no, kind, rest)?;
            }
        }
        Ok(())
    }

    /// The section events and directives go to (device 0 before any `device` line).
    fn section(&mut self) -> &mut Section {
        self.current.get_or_insert_with(|| Section::new(0))
    }

    /// `device N`: ends the current section and starts device N's.
    fn start_device(&mut self, line_no: usize, rest: &str) -> Result<()> {
        let at = at_line(line_no);
        let d = parse_u64(rest, "device").map_err(&at)?;
        let d = u32::try_from(d)
            .map_err(|_| at(ErrorKind::Syntax(format!("device {d} out of range"))))?;
        if let Some(s) = self.current.take() {
            let prev = s.parts.device;
            if self.done.insert(prev, s).is_some() {
                return Err(at(ErrorKind::DuplicateDevice(prev)));
            }
        }
        if self.done.contains_key(&d) {
            return Err(at(ErrorKind::DuplicateDevice(d)));
        }
        self.current = Some(Section::new(d));
        Ok(())
    }

    /// The trace, once every line is read.
    fn finish(mut self, default_name: &str) -> Result<Trace> {
        if !self.header_seen {
            return Err(ErrorKind::BadHeader(format!("empty file (expected `{HEADER}`)")).into());
        }
        if let Some(s) = self.current.take() {
            let d = s.parts.device;
            if self.done.insert(d, s).is_some() {
                return Err(ErrorKind::DuplicateDevice(d).into());
            }
        }
        let mut devices = Vec::with_capacity(self.done.len());
        for (_, s) in self.done {
            let Section {
                parts, event_lines, ..
            } = s;
            let dt = DeviceTrace::new(parts).map_err(|e| {
                match e.index.and_then(|i| event_lines.get(i)) {
                    Some(&l) => e.at_line(l),
                    None => e,
                }
            })?;
            devices.push(dt);
        }
        Ok(Trace {
            name: self.name.unwrap_or_else(|| default_name.to_string()),
            devices,
        })
    }
}

/// Checks the first line: `vmmalloc-trace 1`.
fn check_header(line: &str, word: &str, rest: &str) -> std::result::Result<(), ErrorKind> {
    if word != "vmmalloc-trace" {
        return Err(ErrorKind::BadHeader(format!(
            "expected `{HEADER}` as the first line, found `{}`",
            clip(line)
        )));
    }
    if rest != "1" {
        return Err(ErrorKind::BadHeader(format!(
            "version `{}` is not supported (1 is)",
            clip(rest)
        )));
    }
    Ok(())
}

impl Section {
    /// `pre ADDR SIZE STREAM`: an allocation live before the first event.
    fn pre(&mut self, line_no: usize, rest: &str) -> Result<()> {
        let at = at_line(line_no);
        if !self.parts.events.is_empty() {
            return Err(at(ErrorKind::Syntax(
                "`pre` after the device's first event".into(),
            )));
        }
        let f = fields(rest, 3, 3, "pre ADDR SIZE STREAM").map_err(&at)?;
        let addr = parse_u64(f[0], "address").map_err(&at)?;
        let size = parse_u64(f[1], "size").map_err(&at)?;
        let stream = parse_u64(f[2], "stream").map_err(&at)?;
        if size == 0 {
            return Err(at(ErrorKind::ZeroSize).on_device(self.parts.device));
        }
        if size > crate::model::MAX_SIZE {
            let kind = ErrorKind::Absurd {
                field: "size",
                value: size.into(),
            };
            return Err(at(kind).on_device(self.parts.device));
        }
        if self.live.insert(addr, (size, stream)).is_some() {
            return Err(at(ErrorKind::DuplicatePre { addr }).on_device(self.parts.device));
        }
        self.parts.pre_trace.push(Alloc { addr, size, stream });
        Ok(())
    }

    /// An event line (`alloc`, `free`, …) of kind `kind`.
    fn event(&mut self, line_no: usize, kind: EventKind, rest: &str) -> Result<()> {
        let index = self.parts.events.len();
        let dev = self.parts.device;
        let at = at_line(line_no);
        let at_ev = |k: ErrorKind| at(k).on_device(dev).at_event(index);
        let event = if kind == EventKind::Free {
            self.free_event(rest, &at_ev)?
        } else {
            self.creating_event(kind, rest, &at_ev)?
        };
        self.parts.events.push(event);
        self.event_lines.push(line_no);
        Ok(())
    }

    /// `free ADDR [SIZE STREAM [TIME_US]]`: size and stream default to the
    /// allocation's.
    fn free_event(
        &mut self,
        rest: &str,
        at_ev: &impl Fn(ErrorKind) -> TraceError,
    ) -> Result<Event> {
        let f = fields(rest, 1, 4, "free ADDR [SIZE STREAM [TIME_US]]").map_err(at_ev)?;
        if f.len() == 2 {
            return Err(at_ev(ErrorKind::Syntax(
                "`free` takes ADDR alone or ADDR SIZE STREAM [TIME_US]".into(),
            )));
        }
        let addr = parse_u64(f[0], "address").map_err(at_ev)?;
        let Some((live_size, live_stream)) = self.live.remove(&addr) else {
            return Err(at_ev(ErrorKind::FreeOfUnknown { addr }));
        };
        let (size, stream) = if f.len() >= 3 {
            (
                parse_u64(f[1], "size").map_err(at_ev)?,
                parse_u64(f[2], "stream").map_err(at_ev)?,
            )
        } else {
            (live_size, live_stream)
        };
        let time_us = f
            .get(3)
            .map(|t| parse_i64(t, "time_us"))
            .transpose()
            .map_err(at_ev)?;
        Ok(Event {
            kind: EventKind::Free,
            addr,
            size,
            stream,
            time_us,
        })
    }

    /// `KIND ADDR SIZE STREAM [TIME_US]` for every kind but `free`.
    fn creating_event(
        &mut self,
        kind: EventKind,
        rest: &str,
        at_ev: &impl Fn(ErrorKind) -> TraceError,
    ) -> Result<Event> {
        let usage = format!("{} ADDR SIZE STREAM [TIME_US]", kind.name());
        let f = fields(rest, 3, 4, &usage).map_err(at_ev)?;
        let addr = parse_u64(f[0], "address").map_err(at_ev)?;
        let size = parse_u64(f[1], "size").map_err(at_ev)?;
        let stream = parse_u64(f[2], "stream").map_err(at_ev)?;
        let time_us = f
            .get(3)
            .map(|t| parse_i64(t, "time_us"))
            .transpose()
            .map_err(at_ev)?;
        // A growable region (`reserve`) is live until its `free` too.
        let creates = matches!(kind, EventKind::Alloc | EventKind::Reserve);
        if creates && self.live.insert(addr, (size, stream)).is_some() {
            return Err(at_ev(ErrorKind::DoubleAlloc { addr }));
        }
        Ok(Event {
            kind,
            addr,
            size,
            stream,
            time_us,
        })
    }
}

/// Writes `trace` in the canonical text form (final segments are not written).
pub fn to_text(trace: &Trace) -> String {
    let mut out = String::with_capacity(64 + 48 * trace.num_events());
    out.push_str(HEADER);
    out.push('\n');
    let _ = writeln!(out, "name {}", escape(&trace.name, false));
    for d in &trace.devices {
        let _ = writeln!(out, "device {}", d.device());
        for (k, v) in d.allocator_settings() {
            let _ = writeln!(out, "setting {} {}", escape(k, true), escape(v, false));
        }
        for w in d.warnings() {
            let _ = writeln!(out, "warning {}", escape(w, false));
        }
        for a in d.pre_trace() {
            let _ = writeln!(out, "pre {:#x} {} {}", a.addr, a.size, a.stream);
        }
        for e in d.events() {
            let _ = write!(
                out,
                "{} {:#x} {} {}",
                e.kind.name(),
                e.addr,
                e.size,
                e.stream
            );
            if let Some(t) = e.time_us {
                let _ = write!(out, " {t}");
            }
            out.push('\n');
        }
    }
    out
}

/// Writes `trace` to `path` in the canonical text form.
pub fn write_text(trace: &Trace, path: &Path) -> Result<()> {
    std::fs::write(path, to_text(trace)).map_err(|e| TraceError::from(e).in_file(path))
}

fn fields<'a>(
    rest: &'a str,
    min: usize,
    max: usize,
    usage: &str,
) -> std::result::Result<Vec<&'a str>, ErrorKind> {
    let f: Vec<&str> = rest.split_whitespace().collect();
    if f.len() < min || f.len() > max {
        return Err(ErrorKind::Syntax(format!(
            "expected `{usage}`, found {} fields",
            f.len()
        )));
    }
    Ok(f)
}

fn parse_u64(s: &str, what: &str) -> std::result::Result<u64, ErrorKind> {
    let parsed = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16)
    } else {
        s.parse::<u64>()
    };
    parsed.map_err(|_| {
        if s.starts_with('-') && s[1..].bytes().all(|b| b.is_ascii_digit()) && s.len() > 1 {
            ErrorKind::Negative {
                field: static_what(what),
                value: s.parse::<i128>().unwrap_or(i128::MIN),
            }
        } else if s.bytes().all(|b| b.is_ascii_digit()) && !s.is_empty() {
            ErrorKind::Absurd {
                field: static_what(what),
                value: s.parse::<u128>().unwrap_or(u128::MAX),
            }
        } else {
            ErrorKind::Syntax(format!(
                "bad {what} `{}` (expected a decimal or 0x-hex integer)",
                clip(s)
            ))
        }
    })
}

fn parse_i64(s: &str, what: &str) -> std::result::Result<i64, ErrorKind> {
    s.parse::<i64>().map_err(|_| {
        ErrorKind::Syntax(format!(
            "bad {what} `{}` (expected a decimal integer)",
            clip(s)
        ))
    })
}

fn static_what(what: &str) -> &'static str {
    match what {
        "address" => "address",
        "stream" => "stream",
        "device" => "device",
        _ => "size",
    }
}

fn clip(s: &str) -> String {
    let mut c: String = s.chars().take(60).collect();
    if c.len() < s.len() {
        c.push('…');
    }
    c
}

/// Escapes backslash, newline, carriage return, tab (and space, for keys).
fn escape(s: &str, space: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ' ' if space => out.push_str("\\s"),
            c => out.push(c),
        }
    }
    out
}

fn unescape(s: &str) -> std::result::Result<String, ErrorKind> {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('\\') => out.push('\\'),
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some('s') => out.push(' '),
            other => {
                return Err(ErrorKind::Syntax(format!(
                    "bad escape `\\{}` (known: \\\\ \\n \\r \\t \\s)",
                    other.map(String::from).unwrap_or_default()
                )))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
# produced by hand
vmmalloc-trace 1
name demo run
device 1
setting max_split_size -1
warning 1 thing is odd
pre 0x100 10 0
alloc 0x200 20 7 5
# comment between events
free 0x100
free_requested 0x200 20 7
free 0x200 20 7 9
device 0
alloc 1 5 0
";

    #[test]
    fn reads_sample() {
        let t = parse_text(SAMPLE, "x").unwrap();
        assert_eq!(t.name, "demo run");
        assert_eq!(t.devices.len(), 2);
        assert_eq!(t.devices[0].device(), 0);
        let d1 = t.device(1).unwrap();
        assert_eq!(d1.allocator_settings()["max_split_size"], "-1");
        assert_eq!(d1.warnings(), &["1 thing is odd".to_string()]);
        assert_eq!(d1.events().len(), 4);
        assert_eq!(
            d1.events()[1],
            Event {
                kind: EventKind::Free,
                addr: 0x100,
                size: 10,
                stream: 0,
                time_us: None
            }
        );
        assert_eq!(d1.peak_live_bytes(), 30);
    }

    #[test]
    fn canonical_round_trip() {
        let t = parse_text(SAMPLE, "x").unwrap();
        let w = to_text(&t);
        let t2 = parse_text(&w, "y").unwrap();
        assert_eq!(t, t2);
        assert_eq!(to_text(&t2), w);
    }

    #[test]
    fn escapes_round_trip() {
        for s in ["a b", "x\\y", "line\nbreak\ttab\r", ""] {
            assert_eq!(unescape(&escape(s, true)).unwrap(), s);
            assert_eq!(unescape(&escape(s, false)).unwrap(), s);
        }
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("vmmalloc-trace 2\n", 1, "version `2`"),
            ("hello\n", 1, "expected `vmmalloc-trace 1`"),
            (
                "vmmalloc-trace 1\nalloc 0x1 10\n",
                2,
                "expected `alloc ADDR SIZE STREAM [TIME_US]`",
            ),
            ("vmmalloc-trace 1\nalloc 0x1 ten 0\n", 2, "bad size `ten`"),
            ("vmmalloc-trace 1\nalloc 0x1 -5 0\n", 2, "negative size: -5"),
            (
                "vmmalloc-trace 1\nalloc 0x1 99999999999999999999999 0\n",
                2,
                "absurd size",
            ),
            (
                "vmmalloc-trace 1\nalloc 0x1 1125899906842625 0\n",
                2,
                "absurd size",
            ),
            ("vmmalloc-trace 1\nalloc 0x1 0 0\n", 2, "size 0"),
            (
                "vmmalloc-trace 1\nreserve 0x1 4096 0\nresize 0x1 8192 0\n",
                3,
                "resize of 0x1 to 8192 bytes: more than the 4096 bytes its `reserve` set aside",
            ),
            (
                "vmmalloc-trace 1\nalloc 0x1 4096 0\nresize 0x1 512 0\n",
                3,
                "it is no region",
            ),
            (
                "vmmalloc-trace 1\nalloc 0x1 10 0\nfree 0x2\n",
                3,
                "free of unknown address 0x2",
            ),
            (
                "vmmalloc-trace 1\nalloc 0x1 10 0\nalloc 0x1 10 0\n",
                3,
                "still live",
            ),
            (
                "vmmalloc-trace 1\nmalloc 0x1 10 0\n",
                2,
                "unknown action `malloc`",
            ),
            (
                "vmmalloc-trace 1\ndevice 0\ndevice 0\n",
                3,
                "device 0 appears twice",
            ),
            (
                "vmmalloc-trace 1\nalloc 1 1 0\npre 2 2 0\n",
                3,
                "`pre` after",
            ),
            ("vmmalloc-trace 1\nfree 1 2\n", 2, "ADDR alone"),
            ("vmmalloc-trace 1\npre 1 0 0\n", 2, "size 0"),
            (
                "vmmalloc-trace 1\npre 1 1 0\npre 1 2 0\n",
                3,
                "two pre-trace allocations",
            ),
        ];
        for (text, line, msg) in cases {
            let e = parse_text(text, "t").unwrap_err();
            assert_eq!(e.line, Some(line), "{text:?}: {e}");
            let s = e.to_string();
            assert!(s.contains(msg), "{text:?}: {s}");
        }
        let e = parse_text(
            "vmmalloc-trace 1\n\nalloc 0x1 10 0\nfree 0x1\nfree 0x1\n",
            "t",
        )
        .unwrap_err();
        assert_eq!((e.line, e.device, e.index), (Some(5), Some(0), Some(2)));
        assert_eq!(
            e.to_string(),
            "line 5: device 0, event 2: free of unknown address 0x1 (not live at this point)"
        );
    }

    #[test]
    fn detects_text() {
        assert!(looks_like_text(b"# c\n\nvmmalloc-trace 1\n"));
        assert!(!looks_like_text(b"\x80\x04"));
        assert!(!looks_like_text(b"alloc 1 2 3\n"));
    }
}
