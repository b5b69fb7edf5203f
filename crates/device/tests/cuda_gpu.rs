//! The `cuda` backend on a real GPU. Every test is `#[ignore]`d: run them with
//! `scripts/gpu-check.sh` (or `cargo test -p vmmalloc-device --test cuda_gpu --
//! --ignored`) on a machine with an NVIDIA GPU and driver.
//!
//! The device ordinal is `VMMALLOC_TEST_DEVICE` (default 0).

use std::sync::Arc;
use vmmalloc_device::cuda::{self, CudaDevice};
use vmmalloc_device::{round_up, Device, DeviceError, PhysHandle, Rule, Stream, MIB};

fn ordinal() -> u32 {
    std::env::var("VMMALLOC_TEST_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn open() -> CudaDevice {
    match CudaDevice::open(ordinal()) {
        Ok(d) => d,
        Err(e) => panic!("cannot open CUDA device {}: {e}", ordinal()),
    }
}

/// Opened with `ipc:true` (exportable handles), `None` where the device
/// cannot export POSIX file descriptors.
fn open_ipc() -> Option<CudaDevice> {
    let options = cuda::CudaOptions {
        ipc: true,
        ..Default::default()
    };
    match CudaDevice::open_configured(ordinal(), &options) {
        Ok(d) => Some(d),
        Err(e) if e.to_string().contains("ipc:true") => None,
        Err(e) => panic!("cannot open CUDA device {}: {e}", ordinal()),
    }
}

/// A byte pattern that differs per page and per offset.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn open_reports_caps() {
    let d = open();
    let caps = d.caps();
    eprintln!("{caps:?}");
    assert!(caps.vmm_supported);
    assert!(caps.has_memory);
    assert!(!caps.name.is_empty());
    assert_eq!(caps.ordinal, ordinal());
    assert!(caps.total_memory >= 1 << 30, "{}", caps.total_memory);
    assert!(caps.granularity.is_power_of_two() && caps.granularity >= 4096);
    // Every GPU of the A100/H100/H200 generations maps 2 MiB pages.
    assert!(
        caps.granularity <= 2 * MIB,
        "granularity {}",
        caps.granularity
    );
    assert!(cuda::device_count().unwrap() > ordinal());
    assert!(cuda::driver_version().unwrap() >= 11020);
    let info = d.mem_info().unwrap();
    assert_eq!(info.total, caps.total_memory);
    assert!(info.free > 0 && info.free <= info.total);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_ordinal_is_unavailable() {
    let n = cuda::device_count().unwrap();
    let err = CudaDevice::open(n + 3).unwrap_err();
    assert!(matches!(err, DeviceError::Unavailable(_)), "{err:?}");
    assert!(err.to_string().contains("ordinal"), "{err}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn reserve_create_map_access_copy_unmap_release() {
    let d = open();
    let g = d.caps().granularity;
    let base = d.reserve(4 * g, 0).unwrap();
    assert_eq!(base % g, 0);
    let a = d.create(g).unwrap();
    let b = d.create(g).unwrap();
    d.map(base, g, a).unwrap();
    d.map(base + g, g, b).unwrap();
    // One set_access over the contiguous run of two mappings.
    d.set_access(base, 2 * g).unwrap();

    // Bytes written across the page boundary read back.
    let data = pattern(2 * g as usize, 7);
    d.copy_to_device(base, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    d.copy_from_device(base, &mut back).unwrap();
    assert!(back == data, "round trip through two mappings differs");

    // Unmap page A and map the same handle elsewhere: its bytes survive.
    d.unmap(base, g).unwrap();
    d.map(base + 3 * g, g, a).unwrap();
    d.set_access(base + 3 * g, g).unwrap();
    let mut page = vec![0u8; g as usize];
    d.copy_from_device(base + 3 * g, &mut page).unwrap();
    assert!(
        page[..] == data[..g as usize],
        "handle A lost its bytes across unmap/remap"
    );

    // Tear down: release while mapped is allowed; memory returns on unmap.
    d.release(a).unwrap();
    d.release(b).unwrap();
    d.unmap(base + g, g).unwrap();
    d.unmap(base + 3 * g, g).unwrap();
    d.free_reservation(base, 4 * g).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn misuse_is_an_error_not_a_crash() {
    let d = open();
    let g = d.caps().granularity;
    // Unknown handle: caught before the driver sees it.
    let err = d.release(PhysHandle(0xdead_beef)).unwrap_err();
    assert_eq!(err.broken_rule(), Some(Rule::UnknownHandle), "{err:?}");
    let base = d.reserve(2 * g, 0).unwrap();
    let h = d.create(g).unwrap();
    // Unaligned map address: the driver answers CUDA_ERROR_INVALID_VALUE.
    let err = d.map(base + 4096, g, h).unwrap_err();
    assert_eq!(err.cuda_code(), 1, "{err:?}");
    // (No copy into unmapped or inaccessible memory here: on a real GPU that
    // may be an MMU fault, which poisons the context for every later test.)
    // Copy outside anything this device owns: refused before the driver.
    let err = d.copy_to_device(0x10, &[1]).unwrap_err();
    assert_eq!(err.broken_rule(), Some(Rule::NotAccessible), "{err:?}");
    // Partial free of a reservation.
    let err = d.free_reservation(base, g).unwrap_err();
    assert_eq!(err.broken_rule(), Some(Rule::NotAReservation), "{err:?}");
    d.release(h).unwrap();
    let err = d.release(h).unwrap_err();
    assert_eq!(err.broken_rule(), Some(Rule::UnknownHandle), "{err:?}");
    d.free_reservation(base, 2 * g).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn out_of_memory_on_huge_create_is_recoverable() {
    let d = open();
    let g = d.caps().granularity;
    let huge = round_up(d.caps().total_memory * 2, g);
    let err = d.create(huge).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
    match err {
        DeviceError::OutOfMemory {
            requested, total, ..
        } => {
            assert_eq!(requested, huge);
            assert_eq!(total, d.caps().total_memory);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Recoverable: a normal create still works.
    let h = d.create(g).unwrap();
    d.release(h).unwrap();
    // Plain allocation too.
    let err = d.alloc(huge).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn plain_alloc_copy_free() {
    let d = open();
    let p = d.alloc(MIB + 123).unwrap();
    let data = pattern((MIB + 123) as usize, 3);
    d.copy_to_device(p, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    d.copy_from_device(p, &mut back).unwrap();
    assert!(back == data);
    d.free(p).unwrap();
    let err = d.free(p).unwrap_err();
    assert_eq!(err.broken_rule(), Some(Rule::UnknownPointer), "{err:?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn streams_and_events() {
    let d = open();
    let s = d.create_stream().unwrap();
    assert_ne!(s, Stream::DEFAULT);
    let e = d.create_event().unwrap();
    // A never-recorded event is complete.
    assert!(d.query_event(e).unwrap());
    d.record_event(e, s).unwrap();
    d.synchronize_event(e).unwrap();
    assert!(d.query_event(e).unwrap());
    d.record_event(e, Stream::DEFAULT).unwrap();
    d.synchronize_stream(Stream::DEFAULT).unwrap();
    assert!(d.query_event(e).unwrap());
    d.synchronize_stream(s).unwrap();
    d.synchronize().unwrap();
    d.destroy_event(e).unwrap();
    let err = d.query_event(e).unwrap_err();
    assert_eq!(err.broken_rule(), Some(Rule::UnknownEvent), "{err:?}");
    let err = d.synchronize_stream(Stream(0x1234)).unwrap_err();
    assert_eq!(err.broken_rule(), Some(Rule::UnknownStream), "{err:?}");
}

/// Memory made for NCCL (`nccl_ready`, what the C ABI does with
/// `nccl_register:True`, the default), as NCCL's ncclMemAlloc makes it: the
/// page is the recommended granularity (a multiple of the minimum), the
/// first cuMemCreate succeeds whether or not the process may use fabric
/// handles (the backend drops the type the driver refuses), and every handle
/// type still requested after it exports. Prints what this GPU gave, for the
/// GPU check's log.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn nccl_ready_memory_exports_as_nccl_needs() {
    let options = cuda::CudaOptions {
        ipc_auto: true,
        nccl_ready: true,
        ..Default::default()
    };
    let d = CudaDevice::open_configured(ordinal(), &options).unwrap();
    let plain = open();
    let g = d.caps().granularity;
    assert_eq!(
        g % plain.caps().granularity,
        0,
        "the page is a multiple of the minimum"
    );
    let asked = d.allocation_prop();
    let h = d.create(g).unwrap();
    let kept = d.allocation_prop();
    eprintln!(
        "nccl_ready: page {} KiB (minimum {} KiB), handle types asked {:#x}, kept {:#x}, \
         gpuDirectRDMACapable {}",
        g / 1024,
        plain.caps().granularity / 1024,
        asked.requestedHandleTypes,
        kept.requestedHandleTypes,
        kept.allocFlags.gpuDirectRDMACapable
    );
    if kept.requestedHandleTypes & vmm_sys::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR != 0 {
        let fd = d.export_fd(h).unwrap();
        // SAFETY: `fd` was returned by export_fd, is owned here and closed once.
        unsafe { libc::close(fd) };
    }
    if kept.requestedHandleTypes & vmm_sys::CU_MEM_HANDLE_TYPE_FABRIC != 0 {
        let ctx = d.context().unwrap();
        // SAFETY: the primary context `d` retained; popped below.
        unsafe { d.driver().ctx_push_current(ctx) }.unwrap();
        // SAFETY: `h` is live (created above, released below).
        let exported = unsafe { d.driver().mem_export_to_fabric(h.0) };
        // SAFETY: pops what was pushed above.
        unsafe { d.driver().ctx_pop_current() }.unwrap();
        exported.expect("a handle created with CU_MEM_HANDLE_TYPE_FABRIC exports as fabric");
    }
    d.release(h).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn export_import_fd_shares_memory() {
    let Some(d) = open_ipc() else {
        eprintln!("skipped: device cannot export POSIX fds");
        return;
    };
    let g = d.caps().granularity;
    let base = d.reserve(2 * g, 0).unwrap();
    let h = d.create(g).unwrap();
    d.map(base, g, h).unwrap();
    d.set_access(base, g).unwrap();
    let data = pattern(g as usize, 11);
    d.copy_to_device(base, &data).unwrap();

    let fd = d.export_fd(h).unwrap();
    assert!(fd >= 0);
    let h2 = d.import_fd(fd).unwrap();
    // SAFETY: `fd` was returned by export_fd, is owned here and closed once.
    unsafe { libc::close(fd) };
    d.map(base + g, g, h2).unwrap();
    d.set_access(base + g, g).unwrap();
    let mut back = vec![0u8; g as usize];
    d.copy_from_device(base + g, &mut back).unwrap();
    assert!(
        back == data,
        "imported handle does not see the exported memory"
    );

    d.unmap(base, 2 * g).unwrap();
    d.release(h).unwrap();
    d.release(h2).unwrap();
    d.free_reservation(base, 2 * g).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn works_from_many_threads() {
    // Each thread starts with no current context; the device binds its own.
    let d = Arc::new(open());
    let g = d.caps().granularity;
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let d = Arc::clone(&d);
            std::thread::spawn(move || {
                for round in 0..8u8 {
                    let base = d.reserve(g, 0).unwrap();
                    let h = d.create(g).unwrap();
                    d.map(base, g, h).unwrap();
                    d.set_access(base, g).unwrap();
                    let data = pattern(4096, t.wrapping_mul(16).wrapping_add(round));
                    d.copy_to_device(base + g - 4096, &data).unwrap();
                    let mut back = vec![0u8; 4096];
                    d.copy_from_device(base + g - 4096, &mut back).unwrap();
                    assert_eq!(back, data);
                    d.unmap(base, g).unwrap();
                    d.release(h).unwrap();
                    d.free_reservation(base, g).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn physical_memory_returns_after_release_and_unmap() {
    let d = open();
    let g = d.caps().granularity;
    let n = 64u64; // 128 MiB at 2 MiB pages
    let before = d.mem_info().unwrap().free;
    let base = d.reserve(n * g, 0).unwrap();
    let hs: Vec<_> = (0..n).map(|_| d.create(g).unwrap()).collect();
    for (i, h) in hs.iter().enumerate() {
        d.map(base + i as u64 * g, g, *h).unwrap();
    }
    d.set_access(base, n * g).unwrap();
    let during = d.mem_info().unwrap().free;
    assert!(
        before.saturating_sub(during) >= n * g / 2,
        "free memory barely moved: {before} -> {during}"
    );
    for h in hs {
        d.release(h).unwrap();
    }
    d.unmap(base, n * g).unwrap();
    d.free_reservation(base, n * g).unwrap();
    let after = d.mem_info().unwrap().free;
    // Other processes may allocate meanwhile; allow slack of 16 pages.
    assert!(
        after + 16 * g >= before,
        "memory not returned: {before} -> {after}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn conformance_suite() {
    let d = open();
    if let Err(failures) = vmmalloc_device::conformance::run_all(&d) {
        panic!("conformance failures on {}:\n{failures}", d.caps().name);
    }
}

// More suites over `CudaDevice` (allocator policies, ...) go below, each
// test `#[ignore]`d.

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn calls_leave_the_callers_context_and_see_captures() {
    let d = open();
    let drv = Arc::clone(d.driver());
    // Nothing current: still nothing current after each call.
    while !drv.ctx_get_current().unwrap().is_null() {
        // SAFETY: null unsets (pops) the current context.
        unsafe { drv.ctx_set_current(std::ptr::null_mut()) }.unwrap();
    }
    let g = d.caps().granularity;
    let va = d.reserve(g, 0).unwrap();
    assert!(drv.ctx_get_current().unwrap().is_null());
    let h = d.create(g).unwrap();
    d.map(va, g, h).unwrap();
    d.set_access(va, g).unwrap();
    d.mem_info().unwrap();
    assert!(
        drv.ctx_get_current().unwrap().is_null(),
        "a call left a context current"
    );
    // A real capture seen by is_capturing; a stream sync then fails with 900.
    let s = d.create_stream().unwrap();
    let raw = std::ptr::with_exposed_provenance_mut(s.0 as usize);
    {
        let _ctx = d.enter(vmmalloc_device::Call::StreamSync).unwrap();
        // SAFETY: a stream of this device.
        unsafe { drv.stream_begin_capture(raw, vmm_sys::CU_STREAM_CAPTURE_MODE_RELAXED) }.unwrap();
    }
    assert!(d.is_capturing(s).unwrap());
    assert_eq!(d.synchronize_stream(s).unwrap_err().cuda_code(), 900);
    {
        let _ctx = d.enter(vmmalloc_device::Call::StreamSync).unwrap();
        // SAFETY: as above; the invalidated capture ends with 901.
        let e = unsafe { drv.stream_end_capture(raw) }.unwrap_err();
        assert_eq!(e.code, 901);
    }
    assert!(!d.is_capturing(s).unwrap());
    assert!(drv.ctx_get_current().unwrap().is_null());
    d.unmap(va, g).unwrap();
    d.release(h).unwrap();
    d.free_reservation(va, g).unwrap();
    eprintln!("peers granted on every set_access: {:?}", d.peers());
}

/// `alloc_host_buffer` is page-locked on a real driver, copies both ways
/// through it are exact, and it is freed on drop. Prints the device-to-host
/// and host-to-device throughput of 256 MiB through a pinned buffer and a
/// pageable one (the figure issue 12's pinned backups are for; CUDA C
/// Programming Guide, "Page-Locked Host Memory": pageable copies stage
/// through a bounce buffer). Informational: no timed assertion.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pinned_host_buffers_copy_exactly_and_faster() {
    use std::time::Instant;
    let d = open();
    let len = 256 * MIB;
    let p = d.alloc(len).unwrap();
    let mut pinned = d.alloc_host_buffer(len).unwrap();
    assert!(pinned.is_pinned(), "cuMemHostAlloc failed on a real driver");
    let mut pageable = vmmalloc_device::HostBuffer::heap(len).unwrap();
    let data = pattern(len as usize, 3);
    pinned.copy_from_slice(&data);
    pageable.copy_from_slice(&data);
    let gbs = |t: std::time::Duration| len as f64 / t.as_secs_f64() / 1e9;
    for (name, buf) in [("pinned", &mut pinned), ("pageable", &mut pageable)] {
        d.copy_to_device(p, buf).unwrap(); // warm-up
        let t = Instant::now();
        d.copy_to_device(p, buf).unwrap();
        let htod = gbs(t.elapsed());
        buf.fill(0);
        let t = Instant::now();
        d.copy_from_device(p, buf).unwrap();
        let dtoh = gbs(t.elapsed());
        assert!(
            buf[..] == data[..],
            "{name}: bytes differ after the round trip"
        );
        eprintln!("{name}: HtoD {htod:.1} GB/s, DtoH {dtoh:.1} GB/s (256 MiB)");
    }
    drop(pinned);
    d.free(p).unwrap();
}
