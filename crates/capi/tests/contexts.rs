//! Issue 11, defect 1, through the C ABI: after every entry point PyTorch
//! calls, the calling thread's CUDA context stack is exactly what it was —
//! nothing current, the other device's primary context (PyTorch's current
//! device), or contexts another library pushed. Runs `device:cuda` over the
//! fake libcuda (tests/fake-cuda) with two devices, in a child process
//! (`vmmalloc_test_support::in_child`), reading the stack through the fake's
//! own `cuCtxGetCurrent` and `fakeCudaContextDepth`.

#![deny(clippy::undocumented_unsafe_blocks)]

use libloading::Library;
use std::ffi::{c_char, c_double, c_int, c_uint, c_void, CStr};

const MIB: usize = 1 << 20;

/// `libvmmalloc.so` next to this test binary (as in tests/capi.rs).
fn vmmalloc() -> &'static Library {
    let path = vmmalloc_test_support::built_cdylib("libvmmalloc.so");
    assert!(path.is_file(), "libvmmalloc.so is built before this test");
    // SAFETY: loading our own library runs no initialisers with preconditions.
    let lib = unsafe { Library::new(&path) }.expect("load libvmmalloc.so");
    Box::leak(Box::new(lib))
}

/// The fake driver, the same instance libvmmalloc loads (same path).
fn fake() -> &'static Library {
    let path = vmmalloc_test_support::fake_cuda_library();
    // SAFETY: the fake's initialisers have no preconditions.
    let lib = unsafe { Library::new(&path) }.expect("load the fake libcuda");
    Box::leak(Box::new(lib))
}

/// Resolves `name` with type `F` in `lib`.
///
/// # Safety
/// `F` is the symbol's exact C signature.
unsafe fn sym<F: Copy>(lib: &'static Library, name: &str) -> F {
    let mut n = name.as_bytes().to_vec();
    n.push(0);
    // SAFETY: the caller names the exact signature; the library is leaked.
    *unsafe { lib.get::<F>(&n) }.unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn c_abi_entry_points_leave_the_callers_context_as_found() {
    vmmalloc_test_support::in_child(
        "c_abi_entry_points_leave_the_callers_context_as_found",
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("VMMALLOC_CONF", "log:off,backend:expandable"),
        ],
        child,
    );
}

fn child() {
    let (v, f) = (vmmalloc(), fake());
    // SAFETY: every `sym` names the signature declared in
    // crates/capi/src/lib.rs, cuda.h or tests/fake-cuda/src/hooks.rs.
    let abi = unsafe {
        (
            sym::<unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void>(
                v,
                "vmmalloc_malloc",
            ),
            sym::<unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void)>(v, "vmmalloc_free"),
            sym::<unsafe extern "C" fn(c_int)>(v, "vmmalloc_init"),
            sym::<unsafe extern "C" fn()>(v, "vmmalloc_empty_cache"),
            sym::<unsafe extern "C" fn(c_double, c_int)>(v, "vmmalloc_set_memory_fraction"),
            sym::<unsafe extern "C" fn(*mut c_void, *mut c_void)>(v, "vmmalloc_record_stream"),
            sym::<unsafe extern "C" fn(c_int) -> *mut c_char>(v, "vmmalloc_memory_stats_json"),
            sym::<unsafe extern "C" fn(*mut c_char)>(v, "vmmalloc_free_string"),
            sym::<unsafe extern "C" fn() -> *const c_char>(v, "vmmalloc_last_error"),
        )
    };
    let (
        malloc,
        free,
        init,
        empty_cache,
        set_fraction,
        record_stream,
        stats,
        free_string,
        last_error,
    ) = abi;
    // SAFETY: as above.
    let (cu_init, retain, get_current, push, pop, depth) = unsafe {
        (
            sym::<unsafe extern "C" fn(c_uint) -> u32>(f, "cuInit"),
            sym::<unsafe extern "C" fn(*mut *mut c_void, c_int) -> u32>(
                f,
                "cuDevicePrimaryCtxRetain",
            ),
            sym::<unsafe extern "C" fn(*mut *mut c_void) -> u32>(f, "cuCtxGetCurrent"),
            sym::<unsafe extern "C" fn(*mut c_void) -> u32>(f, "cuCtxPushCurrent_v2"),
            sym::<unsafe extern "C" fn(*mut *mut c_void) -> u32>(f, "cuCtxPopCurrent_v2"),
            sym::<unsafe extern "C" fn(*mut c_int) -> u32>(f, "fakeCudaContextDepth"),
        )
    };
    let stack = || {
        let mut c = std::ptr::null_mut();
        let mut d = 0;
        // SAFETY: valid out-pointers.
        unsafe {
            assert_eq!(get_current(&mut c), 0);
            assert_eq!(depth(&mut d), 0);
        }
        (c.addr(), d)
    };
    let error = || {
        // SAFETY: NULL or a NUL-terminated string, copied at once.
        let p = unsafe { last_error() };
        (!p.is_null()).then(|| {
            // SAFETY: non-null, NUL-terminated (the C ABI's contract).
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        })
    };
    // SAFETY: the fake's cuInit and retain take valid out-pointers.
    let (c0, c1) = unsafe {
        assert_eq!(cu_init(0), 0);
        let (mut c0, mut c1) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(retain(&mut c0, 0), 0);
        assert_eq!(retain(&mut c1, 1), 0);
        (c0, c1)
    };
    let mut live = Vec::new();
    for (what, pushed) in [
        ("nothing current", vec![]),
        ("device 1 current", vec![c1]),
        ("device 0 current", vec![c0]),
        ("device 1, then device 0 pushed", vec![c1, c0]),
    ] {
        for &c in &pushed {
            // SAFETY: retained primary contexts.
            assert_eq!(unsafe { push(c) }, 0);
        }
        let before = stack();
        let check = |op: &str| assert_eq!(stack(), before, "{what}: after {op} ({:?})", error());
        // SAFETY: each call below keeps the C ABI's documented contracts:
        // sizes, ordinals and pointers it returned; NULL streams.
        unsafe {
            init(2);
            check("vmmalloc_init");
            for dev in [0, 1] {
                let p = malloc(3 * MIB, dev, std::ptr::null_mut());
                assert!(!p.is_null(), "{what}: malloc on {dev}: {:?}", error());
                check("vmmalloc_malloc");
                record_stream(p, std::ptr::null_mut());
                check("vmmalloc_record_stream");
                let s = stats(dev);
                assert!(!s.is_null());
                free_string(s);
                check("vmmalloc_memory_stats_json");
                live.push((p, dev));
            }
            let (p, dev) = live.remove(0);
            free(p, 3 * MIB, dev, std::ptr::null_mut());
            check("vmmalloc_free");
            set_fraction(0.9, 1);
            check("vmmalloc_set_memory_fraction");
            empty_cache();
            check("vmmalloc_empty_cache");
        }
        for _ in &pushed {
            // SAFETY: pops what this test pushed.
            assert_eq!(unsafe { pop(std::ptr::null_mut()) }, 0);
        }
    }
    for (p, dev) in live {
        // SAFETY: pointers the library returned.
        unsafe { free(p, 3 * MIB, dev, std::ptr::null_mut()) };
    }
}

#[test]
fn untouched_devices_get_no_context() {
    vmmalloc_test_support::in_child(
        "untouched_devices_get_no_context",
        &[("FAKE_CUDA_DEVICES", "2"), ("VMMALLOC_CONF", "log:off")],
        untouched_child,
    );
}

/// PyTorch's `empty_cache` walks every device and
/// `set_per_process_memory_fraction` may name one it never used: neither may
/// create a primary context there (`cuDevicePrimaryCtxGetState` stays inactive).
fn untouched_child() {
    let (v, f) = (vmmalloc(), fake());
    // SAFETY: every `sym` names the signature declared in
    // crates/capi/src/lib.rs or cuda.h.
    let (init, empty_cache, set_fraction, cu_init, get_state) = unsafe {
        (
            sym::<unsafe extern "C" fn(c_int)>(v, "vmmalloc_init"),
            sym::<unsafe extern "C" fn()>(v, "vmmalloc_empty_cache"),
            sym::<unsafe extern "C" fn(c_double, c_int)>(v, "vmmalloc_set_memory_fraction"),
            sym::<unsafe extern "C" fn(c_uint) -> u32>(f, "cuInit"),
            sym::<unsafe extern "C" fn(c_int, *mut c_uint, *mut c_int) -> u32>(
                f,
                "cuDevicePrimaryCtxGetState",
            ),
        )
    };
    let active = |dev: c_int| {
        let (mut flags, mut active) = (0, 0);
        // SAFETY: valid out-pointers; cuInit was called.
        assert_eq!(unsafe { get_state(dev, &mut flags, &mut active) }, 0);
        active != 0
    };
    // SAFETY: the C ABI's contracts (plain values).
    unsafe {
        assert_eq!(cu_init(0), 0);
        init(2);
        set_fraction(0.5, 1);
        empty_cache();
    }
    assert!(!active(0) && !active(1), "a primary context was created");
}
