//! CUDA-graph capture on the CPU models (`sim`, `host`): `begin_capture` /
//! `end_capture` test controls, `is_capturing`, and the calls the real driver
//! refuses during a capture, with its codes (cuda.h:
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` 900, `..._INVALIDATED` 901,
//! `..._UNMATCHED` 903, `CUDA_ERROR_CAPTURED_EVENT` 907).

use vmmalloc_device::host::HostDevice;
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{CaptureMode, Device, DeviceResult, Rule, Stream, MIB};

#[track_caller]
fn refused<T: std::fmt::Debug>(r: DeviceResult<T>, rule: Rule, code: u32) {
    let e = r.expect_err(&format!("expected {rule:?}"));
    assert_eq!(e.broken_rule(), Some(rule), "{e}");
    assert_eq!(e.cuda_code(), code, "{e}");
}

/// The scenario, over any model device with its capture controls.
fn scenario<D: Device>(
    d: &D,
    begin: impl Fn(&D, Stream) -> DeviceResult<()>,
    end: impl Fn(&D, Stream) -> DeviceResult<()>,
    can_alloc: bool,
) {
    let s = d.create_stream().unwrap();
    let other = d.create_stream().unwrap();
    assert!(!d.is_capturing(s).unwrap());
    refused(begin(d, Stream::DEFAULT), Rule::CaptureUnsupported, 900);
    refused(end(d, s), Rule::NotCapturing, 903);

    // A clean capture: events recorded outside stay queryable, events
    // recorded inside cannot be queried or waited on.
    let before = d.create_event().unwrap();
    d.record_event(before, s).unwrap();
    begin(d, s).unwrap();
    assert!(d.is_capturing(s).unwrap());
    assert!(!d.is_capturing(other).unwrap());
    refused(begin(d, s), Rule::CaptureUnsupported, 900);
    assert!(d.query_event(before).unwrap());
    let inside = d.create_event().unwrap();
    d.record_event(inside, s).unwrap();
    refused(d.query_event(inside), Rule::CapturedEvent, 907);
    refused(d.synchronize_event(inside), Rule::CapturedEvent, 907);
    // Other streams may still be synchronized.
    d.synchronize_stream(other).unwrap();
    end(d, s).unwrap();
    assert!(!d.is_capturing(s).unwrap());
    // Recorded again outside a capture, the event is an ordinary one.
    refused(d.query_event(inside), Rule::CapturedEvent, 907);
    d.record_event(inside, other).unwrap();
    assert!(d.query_event(inside).unwrap());

    // Stream synchronize during capture: refused, and the capture is invalidated.
    begin(d, s).unwrap();
    refused(d.synchronize_stream(s), Rule::CaptureUnsupported, 900);
    assert!(d.is_capturing(s).unwrap());
    refused(end(d, s), Rule::CaptureInvalidated, 901);
    assert!(!d.is_capturing(s).unwrap());

    // Device synchronize (global mode): refused, invalidated.
    begin(d, s).unwrap();
    refused(d.synchronize(), Rule::CaptureUnsupported, 900);
    refused(end(d, s), Rule::CaptureInvalidated, 901);
    d.synchronize().unwrap();

    if can_alloc {
        // cuMemAlloc / cuMemFree are potentially unsafe calls.
        let p = d.alloc(MIB).unwrap();
        begin(d, s).unwrap();
        refused(d.alloc(MIB), Rule::CaptureUnsupported, 900);
        refused(d.free(p), Rule::CaptureUnsupported, 900);
        refused(end(d, s), Rule::CaptureInvalidated, 901);
        d.free(p).unwrap();
    }
    d.destroy_event(before).unwrap();
    d.destroy_event(inside).unwrap();
}

#[test]
fn sim_models_capture() {
    let d = SimDevice::with_capacity(256 * MIB);
    scenario(&d, SimDevice::begin_capture, SimDevice::end_capture, true);
}

#[test]
fn host_models_capture() {
    let d = HostDevice::with_capacity(64 * MIB).unwrap();
    scenario(&d, HostDevice::begin_capture, HostDevice::end_capture, true);
}

#[test]
fn capture_modes_decide_what_is_unsafe() {
    let d = SimDevice::with_capacity(256 * MIB);
    let m = vmmalloc_device::Introspect::streams(&d);
    let s = d.create_stream().unwrap();
    // Relaxed: device synchronize allowed.
    m.begin_capture(s, CaptureMode::Relaxed).unwrap();
    d.synchronize().unwrap();
    m.end_capture(s).unwrap();
    // Thread-local: forbidden on the capturing thread only.
    m.begin_capture(s, CaptureMode::ThreadLocal).unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| d.synchronize().unwrap()).join().unwrap();
    });
    refused(d.synchronize(), Rule::CaptureUnsupported, 900);
    refused(m.end_capture(s), Rule::CaptureInvalidated, 901);
    // Global: forbidden on every thread.
    m.begin_capture(s, CaptureMode::Global).unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| refused(d.synchronize(), Rule::CaptureUnsupported, 900))
            .join()
            .unwrap();
    });
    refused(m.end_capture(s), Rule::CaptureInvalidated, 901);
}

#[test]
fn an_event_joined_to_other_streams_waits_for_all_of_them() {
    let d = SimDevice::with_capacity(256 * MIB);
    let m = vmmalloc_device::Introspect::streams(&d);
    let (a, b) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    m.submit(a, 0, 0).unwrap();
    m.submit(b, 0, 0).unwrap();
    let e = d.create_event().unwrap();
    m.record_joined(e, Stream::DEFAULT, &[a, b]).unwrap();
    assert!(!d.query_event(e).unwrap());
    d.synchronize_stream(a).unwrap();
    assert!(!d.query_event(e).unwrap(), "b's work is still queued");
    d.synchronize_event(e).unwrap();
    assert_eq!(m.pending_items(b), 0);
    assert!(d.query_event(e).unwrap());
    // A plain record afterwards forgets the join.
    m.submit(b, 0, 0).unwrap();
    d.record_event(e, a).unwrap();
    assert!(d.query_event(e).unwrap());
}
