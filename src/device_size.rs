//! The one check every simulated device size goes through: `--capacity`,
//! `--gpu`, `--tight-factor` (a multiple of each trace's peak live bytes),
//! the default tight device, the "unlimited" device, and the granularity
//! they are rounded up to. A size is refused up front, in one line naming
//! what asked for it and the limit, never discovered by a replay that
//! fails or a division that panics.

use anyhow::{bail, Result};
use vmmalloc_alloc::summary::format_bytes;
use vmmalloc_device::{round_up, GIB, MIB};

/// The largest device capacity the simulated device models: 1 TiB. Its
/// virtual address window (`vmmalloc_device::model::VA_BASE..VA_END`, just
/// under 16 TiB) must hold what the policies reserve: `expandable` reserves
/// an arena of 4 x the device (docs/expandable.md), more arenas when its
/// slices run out, and `torch-es` 1.125 x the device per (stream, pool)
/// segment (PyTorch's expandable segments). The largest GPUs have 288 GB.
pub const MAX_CAPACITY: u64 = 1 << 40;

/// The largest granularity (`--granularity-mb`) the simulated device takes:
/// 1 GiB. Real GPUs have 2 MiB; a page of more than 1 GiB would make every
/// small tensor a device's worth of memory.
pub const MAX_GRANULARITY_MB: u64 = 1024;

/// The granularity `--granularity-mb MB` asks for, in bytes: a power of two
/// from 1 to [`MAX_GRANULARITY_MB`].
pub fn granularity(mb: u64) -> Result<u64> {
    if mb == 0 || !mb.is_power_of_two() || mb > MAX_GRANULARITY_MB {
        bail!(
            "--granularity-mb {mb}: the granularity must be a power of two from 1 to {MAX_GRANULARITY_MB} \
             (MiB; real GPUs have 2)"
        );
    }
    Ok(mb * MIB)
}

/// The device `what` asks for (`asked` bytes, any size, `u128` so that no
/// product overflows before it is checked), rounded up to `granularity`:
/// refused when it is zero or above [`MAX_CAPACITY`]. `what` reads as the
/// start of the message: `--capacity 4TiB`, `--tight-factor 1000 on
/// cs336_lm_step (peak live 12.06 GiB)`.
pub fn device_size(what: &str, asked: u128, granularity: u64) -> Result<u64> {
    let g = u128::from(granularity.max(1));
    let rounded = asked.div_ceil(g).saturating_mul(g);
    if rounded > u128::from(MAX_CAPACITY) {
        bail!(
            "{what}: larger than the simulated device can model (at most {}: its {} virtual address \
             window must hold the policies' reservations, up to 4 x the device for `expandable`)",
            format_bytes(MAX_CAPACITY),
            format_bytes(vmmalloc_device::model::VA_END - vmmalloc_device::model::VA_BASE)
        );
    }
    if rounded == 0 {
        bail!("{what}: a device of no bytes");
    }
    Ok(rounded as u64)
}

/// Parses a device size given by `flag` (`--capacity`, `--gpu`) and checks
/// it with [`device_size`]: the device's bytes, rounded up to `granularity`.
pub fn parse_capacity(flag: &str, s: &str, granularity: u64) -> Result<u64> {
    let what = format!("{flag} {}", s.trim());
    if let Some(bytes) = beyond_tib(s) {
        // Units past TiB are not taken; a size in them is too large anyway
        // (or says to write it in TiB).
        device_size(&what, bytes, granularity)?;
        bail!("{what}: write it in TiB or smaller units (sizes take B, KiB .. TiB, kB .. TB)");
    }
    let b = vmmalloc_alloc::parse_size_unbounded(s).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    device_size(&what, b, granularity)
}

/// The bytes of a size written in a unit beyond TiB (`10PiB`, `2EB`), which
/// sizes do not take; `None` for anything else.
fn beyond_tib(s: &str) -> Option<u128> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic())?;
    let (num, unit) = t.split_at(split);
    let scale: f64 = match unit {
        "P" | "Pi" | "PiB" => 2f64.powi(50),
        "PB" => 1e15,
        "E" | "Ei" | "EiB" => 2f64.powi(60),
        "EB" => 1e18,
        "Z" | "Zi" | "ZiB" => 2f64.powi(70),
        "ZB" => 1e21,
        _ => return None,
    };
    let n: f64 = num
        .trim()
        .parse()
        .ok()
        .filter(|n: &f64| n.is_finite() && *n >= 0.0)?;
    // `as` saturates: a product beyond u128 stays beyond the limit.
    Some((n * scale).ceil() as u128)
}

/// The device `factor` x `peak_live` bytes, rounded up to `granularity`,
/// checked with [`device_size`]; `what` names the rule and the trace.
pub fn factor_size(what: &str, factor: f64, peak_live: u64, granularity: u64) -> Result<u64> {
    // `as` saturates: a product beyond u128 stays beyond the limit.
    let asked = (peak_live as f64 * factor).ceil() as u128;
    device_size(what, asked, granularity)
}

/// A factor as messages write it: `1.05`, `1000`, and `1e308` rather than
/// its 309 digits.
pub fn factor_text(f: f64) -> String {
    if f.abs() < 1e9 {
        format!("{f}")
    } else {
        format!("{f:e}")
    }
}

/// Parses `--tight-factor F`: a multiple of peak live, at least 1 (errors
/// worded as `--capacity`'s are).
pub fn parse_factor(flag: &str, s: &str) -> Result<f64> {
    let t = s.trim();
    if t.starts_with('-') {
        bail!("{flag}: `{t}` is negative: a multiple of peak live must be at least 1 (e.g. 1.05, 1.2)");
    }
    match t.parse::<f64>() {
        Ok(f) if f.is_finite() && f >= 1.0 => Ok(f),
        Ok(f) if f.is_finite() => bail!(
            "{flag}: `{t}` is below 1: a device smaller than peak live cannot run the trace \
             (a multiple of peak live, e.g. 1.05, 1.2)"
        ),
        _ => bail!("{flag}: `{t}` is not a number (a multiple of peak live, e.g. 1.05, 1.2)"),
    }
}

/// The "unlimited" device of a trace: far above its need (8 x peak live,
/// at least 80 GiB, whole GiB), but never above [`MAX_CAPACITY`] nor below
/// `tight` (the tight device, already checked).
pub fn unlimited_capacity(peak_live: u64, tight: u64) -> u64 {
    round_up(
        peak_live.saturating_mul(8).clamp(80 * GIB, MAX_CAPACITY),
        GIB,
    )
    .max(tight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_fits_the_simulated_address_window_many_times() {
        use vmmalloc_device::model::{VA_BASE, VA_END};
        // expandable's first arena (4 x) plus torch-es's segments for a few
        // streams (1.125 x each) fit with room to spare.
        const { assert!(MAX_CAPACITY * 15 <= VA_END - VA_BASE) };
        assert_eq!(
            parse_capacity("--capacity", "1TiB", 2 * MIB).unwrap(),
            MAX_CAPACITY
        );
        let e = parse_capacity("--capacity", "4TiB", 2 * MIB)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--capacity 4TiB: larger than") && e.contains("at most 1.00 TiB"),
            "{e}"
        );
    }

    #[test]
    fn every_size_is_checked_after_rounding() {
        // Just under the limit, rounded up by a 1 GiB granularity: still 1 TiB.
        assert_eq!(
            parse_capacity("--capacity", "1099511627775", GIB).unwrap(),
            MAX_CAPACITY
        );
        // 2^64 bytes: too large for the device, not "not positive".
        let e = parse_capacity("--capacity", "18446744073709551616", 2 * MIB)
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than the simulated device"), "{e}");
        let e = factor_size("--tight-factor 1000", 1000.0, 12 * GIB, 2 * MIB)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--tight-factor 1000: larger than"), "{e}");
        assert_eq!(
            factor_size("f", 1.05, 100 * MIB, 2 * MIB).unwrap(),
            106 * MIB
        );
        assert!(factor_size("f", f64::MAX, u64::MAX, 2 * MIB).is_err());
        assert_eq!(factor_text(1e308), "1e308");
        assert_eq!(factor_text(1.05), "1.05");
        // Units past TiB: too large, or written in TiB.
        let e = parse_capacity("--capacity", "10PiB", 2 * MIB)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("--capacity 10PiB: larger than"), "{e}");
        let e = parse_capacity("--capacity", "2EB", 2 * MIB)
            .unwrap_err()
            .to_string();
        assert!(e.contains("larger than"), "{e}");
        let e = parse_capacity("--capacity", "0.0001PiB", 2 * MIB)
            .unwrap_err()
            .to_string();
        assert!(e.contains("write it in TiB"), "{e}");
        assert!(device_size("d", 0, 2 * MIB).is_err());
        assert_eq!(device_size("d", 1, 2 * MIB).unwrap(), 2 * MIB);
        assert!(device_size("d", u128::MAX, 2 * MIB).is_err());
    }

    #[test]
    fn granularity_is_a_bounded_power_of_two() {
        assert_eq!(granularity(2).unwrap(), 2 * MIB);
        assert_eq!(granularity(1024).unwrap(), GIB);
        for bad in [0, 3, 2048, 1 << 20, 17_592_186_044_416] {
            let e = granularity(bad).unwrap_err().to_string();
            assert!(e.contains("power of two from 1 to 1024"), "{bad}: {e}");
        }
    }

    #[test]
    fn factors_are_worded_as_sizes_are() {
        assert_eq!(parse_factor("--tight-factor", "1.05").unwrap(), 1.05);
        let neg = parse_factor("--tight-factor", "-1")
            .unwrap_err()
            .to_string();
        let size = parse_capacity("--capacity", "-5GiB", 2 * MIB)
            .unwrap_err()
            .to_string();
        assert!(
            neg.starts_with("--tight-factor: `-1` is negative:"),
            "{neg}"
        );
        assert!(
            size.starts_with("--capacity: `-5GiB` is negative:"),
            "{size}"
        );
        assert!(parse_factor("--tight-factor", "0.5").is_err());
        assert!(parse_factor("--tight-factor", "nan").is_err());
        assert!(parse_factor("--tight-factor", "inf").is_err());
    }

    #[test]
    fn the_unlimited_device_stays_within_the_limit() {
        assert_eq!(unlimited_capacity(GIB, 2 * GIB), 80 * GIB);
        assert_eq!(unlimited_capacity(20 * GIB, 21 * GIB), 160 * GIB);
        assert_eq!(unlimited_capacity(900 * GIB, 945 * GIB), MAX_CAPACITY);
        assert_eq!(unlimited_capacity(u64::MAX, MAX_CAPACITY), MAX_CAPACITY);
    }
}
