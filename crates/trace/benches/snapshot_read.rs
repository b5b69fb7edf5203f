//! `cargo bench -p vmmalloc-trace --bench snapshot_read [-- OPTIONS]`: speed
//! and peak resident memory of the PyTorch snapshot reader (issue 34), side by
//! side in one run with the reader it replaced and with Python's
//! `pickle.load` of the same file.
//!
//! Inputs: the bundled real snapshot (`tests/fixtures/cs336_lm_step.pickle`)
//! and synthetic snapshots of the sizes asked for, written by
//! [`vmmalloc_trace_testkit::synth`] (a training loop recorded with stacks,
//! shared frames, as `_dump_snapshot` pickles them) into
//! `target/tmp/snapshot_read/` and kept there for the next run.
//!
//! Each measurement is a fresh child process (this binary again), so each
//! peak RSS (`VmHWM` in `/proc/self/status`, Linux) is that reader's alone:
//!
//! - `new`: [`vmmalloc_trace::load_path`], what every command uses (streams the file);
//! - `old`: [`vmmalloc_trace_testkit::legacy::read_snapshot`], the reader before
//!   issue 34 (the whole file, then serde-pickle's value tree), kept only as
//!   this baseline and as the tests' oracle;
//! - `python`: `pickle.load` of the file (`python3`; skipped if absent), the
//!   same `VmHWM` (not `ru_maxrss`, which Linux carries over `exec` from the
//!   parent).
//!
//! The last column is the new reader's own memory counter
//! (`ReadStats::peak_held`, deterministic) against its bound
//! (`ReadLimits::memory_bound` of the file's size; issue 41).
//!
//! Time is the read alone, measured inside the child (process start-up
//! excluded); peak RSS includes the process's own baseline (a few MB for the
//! Rust child, ~10 MB for Python). The readers run interleaved, `--runs`
//! times each; the table gives medians and the ratios of medians.
//!
//! Options: `--sizes MB,MB,…` (default `10,100,1000`), `--runs N` (default 5),
//! `--old-max-mb MB` (default 10: the old reader needs ~230× the file size in
//! memory), `--python-max-mb MB` (default 1000).
//!
//! Without `--bench` (`cargo test --bench snapshot_read`, as `.ci/run` does)
//! it runs once on the real snapshot and a 2 MB synthetic one, every reader
//! once, and checks that old and new read the same trace.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use vmmalloc_test_support::median;
use vmmalloc_trace::pytorch::{read_snapshot_limited, ReadLimits};
use vmmalloc_trace_testkit::legacy;
use vmmalloc_trace_testkit::synth::{write_snapshot, SynthConfig};

/// The environment variable that makes this binary a measuring child.
const CHILD: &str = "VMMALLOC_SNAPSHOT_READ_CHILD";

const PYTHON: &str = "import pickle, sys, time\n\
t = time.perf_counter()\n\
f = open(sys.argv[1], 'rb')\n\
o = pickle.load(f)\n\
dt = time.perf_counter() - t\n\
n = sum(len(x) for x in o.get('device_traces', []))\n\
hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n\
print(dt, hwm.split()[1], n, 0)\n";

/// One measurement: seconds, peak RSS in KiB, events read, and the peak
/// bytes the new reader's own counter held (`ReadStats::peak_held`; 0 for
/// the others).
#[derive(Debug, Clone, Copy)]
struct Sample {
    secs: f64,
    peak_kib: u64,
    events: u64,
    counted: u64,
}

fn peak_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The child: reads `path` with `reader` and prints `secs peak_kib events
/// counted`.
fn child(reader: &str, path: &Path) -> ! {
    let t = Instant::now();
    let (trace, counted) = match reader {
        "old" => (legacy::read_snapshot(path), 0),
        _ => {
            // What `load_path` does for a pickle, with the reader's counters.
            let f = std::fs::File::open(path).expect("open the snapshot");
            let (r, st) = read_snapshot_limited(f, "bench", &ReadLimits::default());
            (r, st.peak_held)
        }
    };
    let secs = t.elapsed().as_secs_f64();
    match trace {
        Ok(trace) => {
            println!("{secs} {} {} {counted}", peak_kib(), trace.num_events());
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("{reader} reader: {e}");
            std::process::exit(1)
        }
    }
}

fn measure(reader: &str, path: &Path) -> Sample {
    let out = if reader == "python" {
        Command::new("python3")
            .arg("-c")
            .arg(PYTHON)
            .arg(path)
            .output()
    } else {
        Command::new(std::env::current_exe().expect("own path"))
            .env(CHILD, reader)
            .arg(path)
            .output()
    }
    .unwrap_or_else(|e| panic!("running the {reader} reader: {e}"));
    assert!(
        out.status.success(),
        "{reader} reader on {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let f: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(f.len(), 4, "{reader} reader printed {text:?}");
    Sample {
        secs: f[0].parse().expect("seconds"),
        peak_kib: f[1].parse().expect("KiB"),
        events: f[2].parse().expect("events"),
        counted: f[3].parse().expect("counted bytes"),
    }
}

/// A synthetic snapshot of about `mb` MB (10^6 bytes), written once and kept.
fn synthetic(dir: &Path, mb: f64) -> PathBuf {
    let path = dir.join(format!("synth-{mb}MB-seed1.pickle"));
    if !path.exists() {
        let tmp = path.with_extension("partial");
        let f = std::fs::File::create(&tmp).expect("create the synthetic snapshot");
        let cfg = SynthConfig {
            target_bytes: (mb * 1e6) as u64,
            ..SynthConfig::default()
        };
        let t = Instant::now();
        let s = write_snapshot(std::io::BufWriter::new(f), &cfg).expect("write");
        eprintln!(
            "wrote {} ({} bytes, {} events) in {:.1} s",
            path.display(),
            s.bytes,
            s.events,
            t.elapsed().as_secs_f64()
        );
        std::fs::rename(&tmp, &path).expect("rename");
    }
    path
}

fn have_python() -> bool {
    Command::new("python3")
        .arg("-c")
        .arg("import pickle")
        .output()
        .is_ok_and(|o| o.status.success())
}

struct Opts {
    bench: bool,
    sizes: Vec<f64>,
    runs: usize,
    old_max_mb: f64,
    python_max_mb: f64,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut o = Opts {
        bench: args.iter().any(|a| a == "--bench"),
        sizes: vec![10.0, 100.0, 1000.0],
        runs: 5,
        old_max_mb: 10.0,
        python_max_mb: 1000.0,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--sizes" => {
                o.sizes = val()
                    .split(',')
                    .map(|s| s.parse().expect("--sizes MB,MB,…"))
                    .collect()
            }
            "--runs" => o.runs = val().parse().expect("--runs N"),
            "--old-max-mb" => o.old_max_mb = val().parse().expect("--old-max-mb MB"),
            "--python-max-mb" => o.python_max_mb = val().parse().expect("--python-max-mb MB"),
            _ => {}
        }
    }
    if !o.bench {
        o.sizes = vec![2.0];
        o.runs = 1;
        o.old_max_mb = f64::INFINITY;
        o.python_max_mb = f64::INFINITY;
    }
    o
}

fn main() {
    if let Ok(reader) = std::env::var(CHILD) {
        let path = std::env::args_os().nth(1).expect("a snapshot path");
        child(&reader, Path::new(&path));
    }
    let o = opts();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("snapshot_read");
    std::fs::create_dir_all(&dir).expect("create target/tmp/snapshot_read");
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cs336_lm_step.pickle");
    let mut files = vec![fixture];
    files.extend(o.sizes.iter().map(|&mb| synthetic(&dir, mb)));
    let python = have_python();
    if !python {
        eprintln!("python3 not found: no pickle.load column");
    }

    if !o.bench {
        // Test mode: old and new agree on every input, each reader runs once.
        for f in &files {
            let new = vmmalloc_trace::load_path(f).expect("new reader");
            let old = legacy::read_snapshot(f).expect("old reader");
            assert!(new == old, "old and new readers differ on {}", f.display());
        }
    }

    println!(
        "| file | MB | events | reader | median time | MB/s | median peak RSS | RSS / file | old/new time | old/new RSS | new/python time | counted peak / bound |"
    );
    println!("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for f in &files {
        let bytes = std::fs::metadata(f).expect("stat").len();
        let mb = bytes as f64 / 1e6;
        let mut readers = vec!["new"];
        if mb <= o.old_max_mb {
            readers.push("old");
        }
        if python && mb <= o.python_max_mb {
            readers.push("python");
        }
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); readers.len()];
        for _ in 0..o.runs {
            for (i, r) in readers.iter().enumerate() {
                samples[i].push(measure(r, f));
            }
        }
        let med: Vec<(f64, f64)> = samples
            .iter()
            .map(|s| {
                (
                    median(&mut s.iter().map(|x| x.secs).collect::<Vec<_>>()),
                    median(
                        &mut s
                            .iter()
                            .map(|x| x.peak_kib as f64 / 1024.0)
                            .collect::<Vec<_>>(),
                    ),
                )
            })
            .collect();
        let events = samples[0][0].events;
        // The new reader's counter against its memory bound (deterministic).
        let counted = format!(
            "{:.1} / {:.1} MiB",
            samples[0][0].counted as f64 / (1 << 20) as f64,
            ReadLimits::default().memory_bound(bytes) as f64 / (1 << 20) as f64
        );
        for (i, r) in readers.iter().enumerate() {
            assert_eq!(
                samples[i][0].events,
                events,
                "{r} read another number of events from {}",
                f.display()
            );
        }
        let name = f.file_name().unwrap_or_default().to_string_lossy();
        let col = |r: &str| readers.iter().position(|x| *x == r);
        let ratio = |a: Option<usize>, b: Option<usize>, pick: fn(&(f64, f64)) -> f64| match (a, b)
        {
            (Some(a), Some(b)) => format!("{:.1}×", pick(&med[a]) / pick(&med[b])),
            _ => "–".to_string(),
        };
        for (i, r) in readers.iter().enumerate() {
            let (t, rss) = med[i];
            let first = i == 0;
            println!(
                "| {} | {:.1} | {} | {r} | {:.3} s | {:.0} | {:.0} MiB | {:.1} | {} | {} | {} | {} |",
                if first { name.as_ref() } else { "" },
                mb,
                events,
                t,
                mb / t,
                rss,
                rss * (1 << 20) as f64 / bytes as f64,
                if first {
                    ratio(col("old"), col("new"), |m| m.0)
                } else {
                    String::new()
                },
                if first {
                    ratio(col("old"), col("new"), |m| m.1)
                } else {
                    String::new()
                },
                if first {
                    ratio(col("new"), col("python"), |m| m.0)
                } else {
                    String::new()
                },
                if first { counted.as_str() } else { "" },
            );
        }
    }
    println!(
        "(medians of {} runs each, interleaved; RSS in MiB incl. the process baseline)",
        o.runs
    );
}
