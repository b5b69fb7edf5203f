//! What both C ABI pair benches share (`capi_pair`, criterion;
//! `capi_pair_rounds`, interleaved rounds): the configuration, the sizes,
//! the policy built directly, and the two ways into the C ABI.

use std::ffi::{c_int, c_void, CString};
use std::sync::Arc;
use vmmalloc::config::MODEL_GRANULARITY;
use vmmalloc::*;
use vmmalloc_alloc::Allocator;
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::Device;

// The C++ shim's entry point (crates/capi/src/shim.cpp), linked from this
// crate's static library. A cache hit never throws.
extern "C-unwind" {
    fn vmmalloc_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void;
}

/// The configuration of every variant: the default expandable policy over
/// a 1 GiB host device.
pub const CONF: &str = "device:host,capacity_gb:1,log:off,backend:expandable";

/// Request sizes, cycled: small-pool and large-pool blocks of 512 B – 3 MiB.
pub const SIZES: [usize; 8] = [
    512,
    4 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    (1 << 20) + 512,
    2 << 20,
    3 << 20,
];

/// The policy allocator the C ABI builds for `CONF`, built directly.
pub fn policy() -> Box<dyn Allocator> {
    let config = Config::parse(CONF).expect("CONF parses");
    let device: Arc<dyn Device> = Arc::new(
        HostDevice::new(HostConfig {
            name: "host0".into(),
            capacity: config.model_capacity(),
            granularity: MODEL_GRANULARITY,
            ordinal: 0,
        })
        .expect("host device"),
    );
    let options = config.policy_options().expect("options");
    vmmalloc_alloc::build(config.effective_policy(), device, &options).expect("allocator")
}

/// A fresh C ABI runtime configured with `CONF`.
pub fn configure() {
    vmmalloc_reset_for_tests();
    let c = CString::new(CONF).unwrap();
    // SAFETY: `c` is NUL-terminated.
    assert_eq!(unsafe { vmmalloc_configure(c.as_ptr()) }, 0);
}

/// A cache hit through `vmmalloc_try_malloc` (the Rust entry point).
pub fn try_malloc(size: usize) -> *mut c_void {
    let mut out = std::ptr::null_mut();
    // SAFETY: `out` is valid for a write; the stream is the default one.
    let rc = unsafe { vmmalloc_try_malloc(size, 0, std::ptr::null_mut(), &mut out) };
    assert_eq!(rc, VMMALLOC_OK, "cache-hit malloc of {size}");
    out
}

/// A cache hit through the C++ shim's `vmmalloc_malloc` (what PyTorch calls).
pub fn shim_malloc(size: usize) -> *mut c_void {
    // SAFETY: the shim's contract: any size, a valid ordinal, a stream
    // (NULL: the default); it throws only on failure, which a cache hit of
    // a configured host device is not.
    let p = unsafe { vmmalloc_malloc(size, 0, std::ptr::null_mut()) };
    assert!(!p.is_null(), "cache-hit malloc of {size}");
    p
}
