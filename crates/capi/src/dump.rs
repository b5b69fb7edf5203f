//! `vmmalloc_dump_snapshot`: every active device's allocator state as a pickle
//! in PyTorch's snapshot schema, written by
//! [`vmmalloc_alloc::pickle_snapshot`]. This module only gathers the
//! plug-in's part: each device's snapshot and history ring buffer, and the
//! configuration as `allocator_settings` (`VMMALLOC_CONF`, every setting, and
//! `expandable_segments` as PyTorch writes it).

use crate::config::Config;
use crate::error::Error;
use crate::runtime::Runtime;
use std::path::Path;
use vmmalloc_alloc::pickle_snapshot::{self, DeviceDump, Setting};
use vmmalloc_alloc::Policy;

/// The configuration as `allocator_settings` pairs.
fn settings(config: &Config) -> Vec<(&'static str, Setting)> {
    let mut items: Vec<(&str, Setting)> = vec![("VMMALLOC_CONF", config.source.clone().into())];
    for (k, v) in config.settings() {
        items.push((k, v.into()));
    }
    let policy = config.effective_policy();
    items.push((
        "expandable_segments",
        matches!(policy, Policy::Expandable | Policy::TorchEs).into(),
    ));
    items
}

/// Writes the snapshot pickle of every active device to `path`.
pub fn dump(rt: &Runtime, path: &Path) -> Result<(), Error> {
    let config = rt.config()?;
    for d in rt.active_devices() {
        d.check()?;
    }
    let snaps: Vec<_> = rt
        .active_devices()
        .map(|d| {
            // The allocator's snapshot names the device it was built over,
            // which is the ordinal of this slot.
            (
                d.allocator.snapshot(),
                (d.history.is_on() || d.history.recorded_any()).then(|| d.history.entries()),
            )
        })
        .collect();
    let parts: Vec<DeviceDump<'_>> = snaps
        .iter()
        .map(|(snapshot, trace)| DeviceDump {
            snapshot,
            trace: trace.as_deref(),
            frames: None,
        })
        .collect();
    // The path is the caller's: a file that cannot be written is a bad argument.
    pickle_snapshot::write(path, &parts, &settings(config)).map_err(Error::invalid)
}
