//! PyTorch's `torch.cuda.memory_summary()` table over any allocator's
//! [`Stats`], row for row and column for column (75 characters wide, the same
//! metrics, unit scaling and pool breakdown), titled for vmmalloc, followed by
//! a vmmalloc section: backend and device, physical pages mapped and pooled,
//! targeted reclaims, stream syncs, and driver calls per kind.
//!
//! The plug-in's `vmmalloc_memory_summary` and the `vmmalloc summary` command
//! both print it.

use crate::Stats;
use std::collections::BTreeMap;
use vmmalloc_device::DeviceCaps;

pub use crate::error::format_bytes;

const WIDTH: usize = 75;

/// PyTorch's `_format_size`: scale by the "all" value of the column.
fn format_size(mut sz: i64, pref: i64) -> String {
    const PREFIXES: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut prefix = PREFIXES[0];
    let mut pref = pref as f64;
    for p in &PREFIXES[1..] {
        if pref < 768.0 * 1024.0 {
            break;
        }
        prefix = p;
        sz = sz.div_euclid(1024);
        pref /= 1024.0;
    }
    format!("{sz:6} {prefix}")
}

/// PyTorch's `_format_count`.
fn format_count(mut cnt: i64, pref: i64) -> String {
    const PREFIXES: [&str; 3] = [" ", "K", "M"];
    let mut prefix = PREFIXES[0];
    let mut pref = pref as f64;
    for p in &PREFIXES[1..] {
        if pref < 750.0 * 1000.0 {
            break;
        }
        prefix = p;
        cnt = cnt.div_euclid(1000);
        pref /= 1000.0;
    }
    format!("{cnt:7} {prefix} ")
}

/// Pads or truncates a line body to the table width.
fn fit(s: String) -> String {
    let n = s.chars().count();
    if n >= WIDTH {
        s.chars().take(WIDTH).collect()
    } else {
        format!("{s}{}", " ".repeat(WIDTH - n))
    }
}

/// What the vmmalloc section shows besides the stats.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// Device ordinal.
    pub device: u32,
    /// Policy name.
    pub backend: &'a str,
    /// Device backend name (`cuda`, `host`, `sim`).
    pub device_kind: &'a str,
    /// The device's capabilities (None: allocator not created yet).
    pub caps: Option<&'a DeviceCaps>,
    /// Recorded events dropped for lack of room (the plug-in's history ring
    /// buffer); the row is shown only when this is not 0.
    pub dropped_events: u64,
    /// Bytes per page when the policy's pages are not the granularity
    /// (`page_size_mb`); `None`: the device granularity.
    pub page_size: Option<u64>,
}

/// The summary text.
pub fn summary(stats: &Stats, ctx: &Context<'_>) -> String {
    let mut lines: Vec<String> = Vec::new();
    pytorch_rows(stats, ctx, &mut lines);
    vmmalloc_rows(stats, ctx, &mut lines);
    let mut out = String::new();
    for l in lines {
        out.push('|');
        out.push_str(&l);
        out.push_str("|\n");
    }
    out
}

/// A rule of `c` across the summary.
fn rule(c: char) -> String {
    c.to_string().repeat(WIDTH)
}

/// The rows of PyTorch's `memory_summary`: the title, the OOM and retry
/// counts, the stat metrics by pool.
fn pytorch_rows(stats: &Stats, ctx: &Context<'_>, lines: &mut Vec<String>) {
    let m: BTreeMap<String, i64> = stats.to_map();
    let get = |k: &str| m.get(k).copied().unwrap_or(0);
    lines.push(rule('='));
    lines.push(fit(format!(
        " {:16} vmmalloc CUDA memory summary, device ID {:<16} ",
        "", ctx.device
    )));
    lines.push(rule('-'));
    lines.push(fit(format!(
        "  {:9} CUDA OOMs: {:<12} | {:6} cudaMalloc retries: {:<8}  ",
        "",
        get("num_ooms"),
        "",
        get("num_alloc_retries")
    )));
    lines.push(rule('='));
    lines.push(
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".to_string(),
    );
    type Fmt = fn(i64, i64) -> String;
    let metrics: [(&str, &str, Fmt); 9] = [
        ("allocated_bytes", "Allocated memory", format_size),
        ("active_bytes", "Active memory", format_size),
        ("requested_bytes", "Requested memory", format_size),
        ("reserved_bytes", "GPU reserved memory", format_size),
        ("inactive_split_bytes", "Non-releasable memory", format_size),
        ("allocation", "Allocations", format_count),
        ("active", "Active allocs", format_count),
        ("segment", "GPU reserved segments", format_count),
        ("inactive_split", "Non-releasable allocs", format_count),
    ];
    let cols = ["current", "peak", "allocated", "freed"];
    for (key, name, f) in metrics {
        lines.push(rule('-'));
        let pref: Vec<i64> = cols
            .iter()
            .map(|c| get(&format!("{key}.all.{c}")))
            .collect();
        for (sub, label) in [
            ("all", name),
            ("large_pool", "      from large pool"),
            ("small_pool", "      from small pool"),
        ] {
            let v: Vec<String> = cols
                .iter()
                .zip(&pref)
                .map(|(c, p)| f(get(&format!("{key}.{sub}.{c}")), *p))
                .collect();
            lines.push(format!(
                " {label:<21} | {} | {} | {} | {} ",
                v[0], v[1], v[2], v[3]
            ));
        }
    }
    for (key, name) in [
        ("oversize_allocations", "Oversize allocations"),
        ("oversize_segments", "Oversize GPU segments"),
    ] {
        lines.push(rule('-'));
        let v: Vec<String> = cols
            .iter()
            .map(|c| {
                let x = get(&format!("{key}.{c}"));
                format_count(x, x)
            })
            .collect();
        lines.push(format!(
            " {name:<21} | {} | {} | {} | {} ",
            v[0], v[1], v[2], v[3]
        ));
    }
    lines.push(rule('='));
}

/// vmmalloc's own rows: the backend and device, pages, reclaims, syncs,
/// device allocations, dropped history and the driver calls.
fn vmmalloc_rows(stats: &Stats, ctx: &Context<'_>, lines: &mut Vec<String>) {
    let page = ctx
        .page_size
        .or(ctx.caps.map(|c| c.granularity))
        .unwrap_or(0);
    let bytes = format_bytes;
    let title = match ctx.caps {
        Some(c) => format!(
            " vmmalloc: backend {} on {} device \"{}\"",
            ctx.backend, ctx.device_kind, c.name
        ),
        None => format!(
            " vmmalloc: backend {} on {} (allocator not created yet)",
            ctx.backend, ctx.device_kind
        ),
    };
    lines.push(fit(title));
    lines.push(rule('-'));
    let row = |name: &str, value: String| fit(format!(" {name:<21} | {value}"));
    let pages = |n: u64| {
        if page > 0 {
            format!("{n} pages ({})", bytes(n.saturating_mul(page)))
        } else {
            format!("{n} pages")
        }
    };
    if let Some(c) = ctx.caps {
        lines.push(row(
            "Device memory",
            format!(
                "{} (granularity {})",
                bytes(c.total_memory),
                bytes(c.granularity)
            ),
        ));
    }
    lines.push(row("Mapped pages", pages(stats.pages_mapped)));
    lines.push(row("Pooled pages", pages(stats.pages_pooled)));
    lines.push(row(
        "Targeted reclaims",
        format!(
            "{} ({} unmapped)",
            stats.reclaims,
            bytes(stats.reclaimed_bytes)
        ),
    ));
    // Syncs as every report counts them (`CallCounts::syncs`): stream/event
    // waits and device-wide ones, each cuMemFree included. PyTorch's
    // `num_sync_all_streams` counts something else (passes of
    // `synchronize_and_free_events`), so it gets its own row.
    let c = &stats.driver_calls;
    lines.push(row(
        "Syncs",
        format!(
            "{} stream/event, {} device-wide",
            c.stream_syncs(),
            c.device_syncs()
        ),
    ));
    if stats.num_sync_all_streams > 0 {
        lines.push(row(
            "Sync-all-streams",
            format!("{} (num_sync_all_streams)", stats.num_sync_all_streams),
        ));
    }
    lines.push(row(
        "Device allocs / frees",
        format!("{} / {}", stats.num_device_alloc, stats.num_device_free),
    ));
    if ctx.dropped_events > 0 {
        lines.push(row(
            "History dropped",
            format!("{} events (max_entries)", ctx.dropped_events),
        ));
    }
    lines.push(rule('-'));
    let calls = stats.driver_calls.nonzero();
    if calls.is_empty() {
        lines.push(row("Driver calls", "none".into()));
    } else {
        for (i, (name, n)) in calls.iter().enumerate() {
            let kind = vmmalloc_device::Call::from_name(name).map_or(*name, |c| c.driver_symbol());
            lines.push(row(
                if i == 0 { "Driver calls" } else { "" },
                format!("{n:>10}  {kind}"),
            ));
        }
    }
    lines.push(rule('='));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StatType;

    #[test]
    fn pytorch_unit_scaling() {
        assert_eq!(format_size(512, 512), "   512 B  ");
        // PyTorch moves to the next unit only from 768 of it on.
        assert_eq!(format_size(3 << 20, 3 << 20), "  3072 KiB");
        assert_eq!(format_size(3 << 30, 3 << 30), "  3072 MiB");
        // Scaled by the column's "all" value, not its own.
        assert_eq!(format_size(1 << 10, 5 << 30), "     0 MiB");
        assert_eq!(format_count(999, 999), "    999   ");
        assert_eq!(format_count(2_000_000, 2_000_000), "   2000 K ");
    }

    #[test]
    fn bytes_read_like_pytorch_messages() {
        assert_eq!(format_bytes(1023), "1023 bytes");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(3 << 30), "3.00 GiB");
        assert_eq!(format_bytes(2 << 50), "2.00 PiB");
    }

    #[test]
    fn every_line_is_75_wide_and_framed() {
        let mut s = Stats::default();
        s.allocated_bytes.update(StatType::Large, 3 << 30);
        s.allocation.update(StatType::Small, 7);
        s.driver_calls.add(vmmalloc_device::Call::Create);
        s.pages_mapped = 1536;
        let caps = DeviceCaps {
            name: "host0 (4 GiB) with a very long name that would overflow the table width".into(),
            ordinal: 0,
            granularity: 2 << 20,
            total_memory: 4 << 30,
            vmm_supported: true,
            posix_fd_handles: true,
            has_memory: true,
        };
        let text = summary(
            &s,
            &Context {
                device: 0,
                backend: "native",
                device_kind: "host",
                caps: Some(&caps),
                dropped_events: 0,
                page_size: None,
            },
        );
        for l in text.lines() {
            assert_eq!(l.chars().count(), WIDTH + 2, "{l:?}");
            assert!(l.starts_with('|') && l.ends_with('|'), "{l:?}");
        }
        assert!(
            text.contains(
                " Allocated memory      |   3072 MiB |   3072 MiB |   3072 MiB |      0 B   "
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "      from small pool |      0 MiB |      0 MiB |      0 MiB |      0 B   "
            ),
            "{text}"
        );
        assert!(text.contains("1536 pages (3.00 GiB)"), "{text}");
        assert!(text.contains("cuMemCreate"), "{text}");
    }
}
