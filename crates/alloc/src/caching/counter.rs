//! Counts of the device calls an allocator makes, and handles it could not give back.

use vmmalloc_device::{Call, CallCounts, DeviceError, PhysHandle};

/// Device calls made (failed ones included, as the `sim` device counts them),
/// stream/event synchronizations forced, and physical handles whose release
/// failed (retried on teardown).
#[derive(Debug, Default)]
pub(crate) struct Counter {
    pub calls: CallCounts,
    pub stream_syncs: u64,
    pub orphans: Vec<PhysHandle>,
}

impl Counter {
    /// Counts one call of `call`.
    pub fn add(&mut self, call: Call) {
        self.calls.add(call);
    }
    /// Counts one forced stream or event synchronization.
    pub fn stream_sync(&mut self) {
        self.stream_syncs += 1;
    }
    /// Remembers a handle whose `cuMemRelease` failed.
    pub fn orphan(&mut self, h: PhysHandle, e: &DeviceError) {
        eprintln!("vmmalloc: releasing a physical handle failed ({e}); retrying on teardown");
        self.orphans.push(h);
    }
    /// Logs a failure during a rollback.
    pub fn note_failure(&mut self, e: &DeviceError) {
        eprintln!("vmmalloc: a driver call failed while rolling back: {e}");
    }
}
