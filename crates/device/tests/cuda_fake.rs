//! The `cuda` backend and vmm-sys against the fake libcuda (`tests/fake-cuda`),
//! in every `cargo test`, on machines without a GPU.
//!
//! The fake is a workspace member built as `target/<profile>/libcuda.so`;
//! integration tests of this crate do not build it, so the first test that
//! needs it runs `cargo build -p fake-cuda` (same profile and target
//! directory; a no-op when it is up to date). Set `VMMALLOC_FAKE_CUDA` to a
//! built library to skip that. Both this and the child-process runner below
//! live in `vmmalloc-test-support` (tests/support).
//!
//! The fake reads its configuration (`FAKE_CUDA_*`) once and keeps its state
//! (devices, contexts, call counts) for the life of the process, so every test
//! runs its body in a child process of this test binary, with the environment
//! it asks for: tests cannot see each other's objects, injected failures or
//! call counts, and live-object counts are exact. A child's output (with the
//! fake's trace of every failed call) is shown when it fails.
//!
//! What this proves and what it cannot: docs/fake-cuda.md.

use std::ffi::{c_char, c_int, c_void, CString};
use std::process::Command;
use std::sync::Arc;
use vmm_sys::{
    CUmemAccessDesc, CUmemAllocationProp, Driver, CU_MEM_ACCESS_FLAGS_PROT_READ,
    CU_MEM_ALLOC_GRANULARITY_MINIMUM, CU_MEM_HANDLE_TYPE_FABRIC,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
};
use vmmalloc_device::cuda::{self, CudaDevice};
use vmmalloc_device::{
    conformance, Call, Device, DeviceError, DeviceResult, Event, IpcMemHandle, PhysHandle, Rule,
    Stream, MIB,
};

// Building and finding the fake, and running each test in a child process:
// `vmmalloc-test-support` (tests/support), shared with the allocator's and the
// C ABI's tests over the fake.
use vmmalloc_test_support::{fake_cuda_library as fake_library, profile_dir, FAKE_LIBRARY_ENV};

/// Runs `body` with the loaded fake in a child process of this test binary
/// ([`vmmalloc_test_support::in_child`]): `env` on top of `FAKE_CUDA_TRACE=1`
/// and `VMMALLOC_CUDA_LIBRARY` pointing at the fake, without the parent's own
/// `FAKE_CUDA_*` variables.
fn in_child(name: &str, env: &[(&str, &str)], body: impl FnOnce(&Fake)) {
    vmmalloc_test_support::in_child(name, env, || body(&Fake::load()));
}

/// `#[test] fn name() { ... }` whose body runs in a child process (see
/// [`in_child`]), with optional `FAKE_CUDA_*` settings.
macro_rules! fake_test {
    ($(#[$m:meta])* fn $name:ident($fake:ident) $body:block) => {
        fake_test!($(#[$m])* env [] fn $name($fake) $body);
    };
    ($(#[$m:meta])* env [$(($k:expr, $v:expr)),* $(,)?] fn $name:ident($fake:ident) $body:block) => {
        $(#[$m])*
        #[test]
        fn $name() {
            in_child(stringify!($name), &[$(($k, $v)),*], |$fake: &Fake| $body);
        }
    };
}

// ---------------------------------------------------------------------------
// The fake, loaded, with its test hooks

/// `FakeCudaLive` of tests/fake-cuda/src/hooks.rs.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Live {
    reservations: u64,
    handles: u64,
    mappings: u64,
    plain_allocs: u64,
    physical_bytes: u64,
    events: u64,
    streams: u64,
    primary_refs: u64,
    destroyed_live: u64,
}

impl Live {
    /// Nothing left but streams (which cannot be destroyed) and context retains.
    fn is_clean(&self) -> bool {
        Live {
            streams: 0,
            primary_refs: 0,
            ..*self
        } == Live::default()
    }
}

type LiveFn = unsafe extern "C" fn(c_int, *mut Live) -> u32;
type CheckFn = unsafe extern "C" fn(c_int) -> u32;
type SubmitFn = unsafe extern "C" fn(*mut c_void, u64, usize) -> u32;
type CallCountFn = unsafe extern "C" fn(*const c_char, *mut u64) -> u32;
type LastErrorFn = unsafe extern "C" fn(*mut c_char, usize) -> u32;
type DepthFn = unsafe extern "C" fn(*mut c_int) -> u32;
type PinnedFn = unsafe extern "C" fn(*mut u64, *mut u64) -> u32;

/// The loaded fake: a vmm-sys driver on it and its `fakeCuda*` hooks.
struct Fake {
    driver: Arc<Driver>,
    live: LiveFn,
    check: CheckFn,
    submit: SubmitFn,
    call_count: CallCountFn,
    last_error: LastErrorFn,
    depth: DepthFn,
    pinned: PinnedFn,
}

/// Resolves `name` in the already loaded library `handle`.
///
/// # Safety
/// `F` is the symbol's real function-pointer type.
unsafe fn sym<F: Copy>(handle: *mut c_void, name: &str) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    let c = CString::new(name).unwrap();
    // SAFETY: `handle` came from dlopen and `c` is NUL-terminated.
    let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
    assert!(!p.is_null(), "the fake does not export {name}");
    // SAFETY: a non-null symbol of type F (function contract), same size as a pointer.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

impl Fake {
    /// Loads the fake through vmm-sys and finds its hooks.
    fn load() -> Fake {
        let path = fake_library();
        let driver = Driver::load_from(&path).unwrap_or_else(|e| panic!("loading the fake: {e}"));
        let c = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: RTLD_NOLOAD only returns the library vmm-sys already loaded
        // (one more reference, never released: the library stays loaded).
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        assert!(!handle.is_null(), "{} is not loaded", path.display());
        // SAFETY: the types are those of tests/fake-cuda/src/hooks.rs.
        unsafe {
            Fake {
                live: sym(handle, "fakeCudaLive"),
                check: sym(handle, "fakeCudaCheck"),
                submit: sym(handle, "fakeCudaSubmitWork"),
                call_count: sym(handle, "fakeCudaCallCount"),
                last_error: sym(handle, "fakeCudaLastError"),
                depth: sym(handle, "fakeCudaContextDepth"),
                pinned: sym(handle, "fakeCudaPinned"),
                driver,
            }
        }
    }

    /// Opens device `ordinal` through the `cuda` backend.
    fn open(&self, ordinal: u32) -> CudaDevice {
        CudaDevice::open_with(Arc::clone(&self.driver), ordinal)
            .unwrap_or_else(|e| panic!("opening fake device {ordinal}: {e}"))
    }

    /// Opens device `ordinal` with `ipc:true` (exportable handles).
    fn open_ipc(&self, ordinal: u32) -> CudaDevice {
        let options = cuda::CudaOptions {
            ipc: true,
            ..Default::default()
        };
        CudaDevice::open_with_options(Arc::clone(&self.driver), ordinal, &options)
            .unwrap_or_else(|e| panic!("opening fake device {ordinal}: {e}"))
    }

    fn live(&self, ordinal: i32) -> Live {
        let mut l = Live::default();
        // SAFETY: `l` is a writable FakeCudaLive.
        let rc = unsafe { (self.live)(ordinal, &mut l) };
        assert_eq!(rc, 0, "fakeCudaLive({ordinal})");
        l
    }

    /// Checks the fake device's model invariants.
    fn check(&self, ordinal: i32) {
        // SAFETY: no pointers.
        let rc = unsafe { (self.check)(ordinal) };
        assert_eq!(rc, 0, "fake device {ordinal}: {}", self.last_error());
    }

    /// Queues work on `stream` of `dev` that uses `[addr, addr+len)`, as a
    /// kernel would (in `dev`'s context, as a launch is).
    fn submit(&self, dev: &CudaDevice, stream: Stream, addr: u64, len: u64) {
        let _ctx = dev.enter(Call::EventRecord).unwrap();
        // SAFETY: the stream value came from the backend (a fake CUstream) or is null.
        let rc = unsafe {
            (self.submit)(
                std::ptr::with_exposed_provenance_mut(stream.0 as usize),
                addr,
                len as usize,
            )
        };
        assert_eq!(rc, 0, "fakeCudaSubmitWork: {}", self.last_error());
    }

    /// Calls made so far to a CUDA entry point.
    fn calls(&self, entry: &str) -> u64 {
        let c = CString::new(entry).unwrap();
        let mut n = 0u64;
        // SAFETY: a NUL-terminated string and a writable u64.
        let rc = unsafe { (self.call_count)(c.as_ptr(), &mut n) };
        assert_eq!(rc, 0, "fakeCudaCallCount({entry})");
        n
    }

    /// The calling thread's context stack: (current context, depth).
    /// Bytes and count of live `cuMemHostAlloc` allocations.
    fn pinned(&self) -> (u64, u64) {
        let (mut b, mut n) = (0u64, 0u64);
        assert_eq!(unsafe { (self.pinned)(&mut b, &mut n) }, 0);
        (b, n)
    }

    fn context_stack(&self) -> (usize, i32) {
        let mut d = 0;
        // SAFETY: `d` is a writable int.
        assert_eq!(unsafe { (self.depth)(&mut d) }, 0);
        let cur = self.driver.ctx_get_current().unwrap().expose_provenance();
        (cur, d)
    }

    /// Why the last failed call on this thread failed, as the fake says.
    fn last_error(&self) -> String {
        let mut buf = vec![0 as c_char; 1024];
        // SAFETY: `buf` is writable for its length.
        let rc = unsafe { (self.last_error)(buf.as_mut_ptr(), buf.len()) };
        assert_eq!(rc, 0);
        // SAFETY: the hook NUL-terminates within the buffer.
        unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// `cuInit` and a primary context current on this thread, for raw calls.
    fn raw_context(&self, ordinal: i32) -> vmm_sys::CUcontext {
        let d = &self.driver;
        d.init(0).unwrap();
        let dev = d.device_get(ordinal).unwrap();
        let ctx = d.device_primary_ctx_retain(dev).unwrap();
        // SAFETY: just retained.
        unsafe { d.ctx_set_current(ctx) }.unwrap();
        ctx
    }
}

// ---------------------------------------------------------------------------
// Helpers

/// Asserts that `r` failed the way the model says `rule` fails: either the
/// backend caught it before calling the driver (`DeviceError::Rule`) or the
/// fake did (`DeviceError::Driver` with the rule's code, the driver's name for
/// it, and the fake naming the rule).
#[track_caller]
fn expect_rule<T: std::fmt::Debug>(fake: &Fake, r: DeviceResult<T>, rule: Rule) -> DeviceError {
    let e = r.expect_err(&format!("expected {rule:?}"));
    assert_eq!(e.cuda_code(), rule.cuda_code(), "{e}");
    match &e {
        DeviceError::Rule { rule: got, .. } => assert_eq!(*got, rule, "{e}"),
        DeviceError::Driver { code, name, .. } => {
            assert_eq!(*code, rule.cuda_code(), "{e}");
            assert_eq!(Some(name.as_str()), vmm_sys::result_name(*code), "{e}");
            let why = fake.last_error();
            assert!(
                why.contains(rule.describe()),
                "expected {rule:?}, the fake said: {why}"
            );
        }
        other => panic!("expected {rule:?}, got {other:?}"),
    }
    e
}

/// Asserts that the fake rejected `r` itself (not the backend's own checks).
#[track_caller]
fn expect_driver<T: std::fmt::Debug>(fake: &Fake, r: DeviceResult<T>, rule: Rule) {
    let e = expect_rule(fake, r, rule);
    assert!(
        matches!(e, DeviceError::Driver { .. }),
        "the backend answered itself: {e:?}"
    );
}

/// Asserts a raw vmm-sys call failed with `code`.
#[track_caller]
fn expect_code<T: std::fmt::Debug>(r: Result<T, vmm_sys::CuError>, code: u32) {
    match r {
        Err(e) => assert_eq!(e.code, code, "{e}"),
        Ok(v) => panic!("expected CUresult {code}, got Ok({v:?})"),
    }
}

/// A byte pattern.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

/// Asserts the device's fake counterpart is clean and consistent.
#[track_caller]
fn assert_clean(fake: &Fake, ordinal: i32) {
    fake.check(ordinal);
    let l = fake.live(ordinal);
    assert!(l.is_clean(), "device {ordinal} still holds {l:?}");
}

// ---------------------------------------------------------------------------
// The conformance suite

fake_test! {
    /// The whole conformance suite through the `cuda` backend; afterwards the
    /// fake holds nothing, and dropping the device releases its context
    /// without the driver having to clean up after it.
    fn conformance_suite_passes(fake) {
        let dev = fake.open(0);
        if let Err(e) = conformance::run_all(&dev) {
            panic!("conformance on the fake failed:\n{e}");
        }
        assert_clean(fake, 0);
        assert_eq!(fake.live(0).primary_refs, 1);
        drop(dev);
        let l = fake.live(0);
        assert_eq!((l.primary_refs, l.destroyed_live), (0, 0), "{l:?}");
    }
}

fake_test! {
    /// Each scenario alone, on a fresh device each time, leaves nothing behind.
    env [("FAKE_CUDA_CAPACITY_MB", "256")]
    fn each_scenario_alone_leaves_nothing_behind(fake) {
        for (name, scenario) in conformance::scenarios::<CudaDevice>() {
            let dev = fake.open(0);
            scenario(&dev).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_clean(fake, 0);
            drop(dev);
            assert_eq!(fake.live(0).destroyed_live, 0, "{name}");
        }
    }
}

fake_test! {
    /// Capacity and granularity come from the environment, and the suite
    /// passes with a granularity other than 2 MiB.
    env [("FAKE_CUDA_CAPACITY_MB", "96"), ("FAKE_CUDA_GRANULARITY_KB", "64")]
    fn caps_follow_the_configuration(fake) {
        let plain = fake.open(0);
        assert!(!plain.caps().posix_fd_handles, "handle types are requested only with ipc:true");
        drop(plain);
        let dev = fake.open_ipc(0);
        let caps = dev.caps();
        assert_eq!(caps.granularity, 64 * 1024);
        assert_eq!(caps.total_memory, 96 * MIB);
        assert!(caps.vmm_supported && caps.posix_fd_handles && caps.has_memory, "{caps:?}");
        assert_eq!(caps.name, "vmmalloc fake-cuda device 0");
        assert_eq!(caps.ordinal, 0);
        conformance::run_all(&dev).unwrap();
        assert_clean(fake, 0);
        assert_eq!(cuda::device_count().unwrap(), 1);
        assert_eq!(cuda::driver_version().unwrap(), 12080);
    }
}

// ---------------------------------------------------------------------------
// One test per driver rule, through the `cuda` backend

fake_test! {
    fn rule_misaligned_sizes_and_addresses(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        expect_driver(fake, dev.create(g / 2), Rule::Misaligned);
        expect_driver(fake, dev.reserve(g + g / 2, 0), Rule::Misaligned);
        expect_driver(fake, dev.reserve(g, 3 * g), Rule::Misaligned);
        let va = dev.reserve(4 * g, 0).unwrap();
        let h = dev.create(g).unwrap();
        expect_driver(fake, dev.map(va + g / 2, g, h), Rule::Misaligned);
        dev.release(h).unwrap();
        dev.free_reservation(va, 4 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_zero_size(fake) {
        let dev = fake.open(0);
        expect_driver(fake, dev.create(0), Rule::ZeroSize);
        expect_driver(fake, dev.reserve(0, 0), Rule::ZeroSize);
        expect_driver(fake, dev.alloc(0), Rule::ZeroSize);
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_map_covers_a_whole_handle(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(4 * g, 0).unwrap();
        let h = dev.create(2 * g).unwrap();
        expect_driver(fake, dev.map(va, g, h), Rule::PartialHandleMap);
        expect_driver(fake, dev.map(va, 4 * g, h), Rule::PartialHandleMap);
        dev.release(h).unwrap();
        dev.free_reservation(va, 4 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_map_inside_one_reservation(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(2 * g, 0).unwrap();
        let h = dev.create(2 * g).unwrap();
        expect_driver(fake, dev.map(va + g, 2 * g, h), Rule::OutsideReservation);
        // Never reserved at all.
        let gone = dev.reserve(2 * g, 0).unwrap();
        dev.free_reservation(gone, 2 * g).unwrap();
        expect_driver(fake, dev.map(gone, 2 * g, h), Rule::OutsideReservation);
        dev.release(h).unwrap();
        dev.free_reservation(va, 2 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_no_map_over_a_mapping(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(2 * g, 0).unwrap();
        let a = dev.create(2 * g).unwrap();
        let b = dev.create(g).unwrap();
        dev.map(va, 2 * g, a).unwrap();
        expect_driver(fake, dev.map(va + g, g, b), Rule::AlreadyMapped);
        dev.unmap(va, 2 * g).unwrap();
        dev.release(a).unwrap();
        dev.release(b).unwrap();
        dev.free_reservation(va, 2 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_set_access_and_unmap_need_mapped_ranges(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(3 * g, 0).unwrap();
        let h = dev.create(g).unwrap();
        dev.map(va, g, h).unwrap();
        expect_driver(fake, dev.set_access(va, 2 * g), Rule::NotMapped);
        expect_driver(fake, dev.unmap(va + g, g), Rule::NotMapped);
        dev.set_access(va, g).unwrap();
        dev.unmap(va, g).unwrap();
        dev.release(h).unwrap();
        dev.free_reservation(va, 3 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_unmap_whole_mappings_only(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(2 * g, 0).unwrap();
        let h = dev.create(2 * g).unwrap();
        dev.map(va, 2 * g, h).unwrap();
        expect_driver(fake, dev.unmap(va, g), Rule::PartialUnmap);
        expect_driver(fake, dev.unmap(va + g, g), Rule::PartialUnmap);
        dev.unmap(va, 2 * g).unwrap();
        dev.release(h).unwrap();
        dev.free_reservation(va, 2 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// A released handle is refused by the backend's registry, and by the
    /// fake when the raw value reaches it.
    fn rule_unknown_handle(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let h = dev.create(g).unwrap();
        dev.release(h).unwrap();
        expect_rule(fake, dev.release(h), Rule::UnknownHandle);
        expect_rule(fake, dev.map(0, g, h), Rule::UnknownHandle);
        expect_rule(fake, dev.release(PhysHandle(12345)), Rule::UnknownHandle);
        // SAFETY: the fake validates handles (that is the point of the test).
        expect_code(unsafe { fake.driver.mem_release(h.0) }, 1);
        assert!(fake.last_error().contains(Rule::UnknownHandle.describe()), "{}", fake.last_error());
        // SAFETY: as above; nothing is mapped at 0.
        expect_code(unsafe { fake.driver.mem_map(0, g as usize, 0, h.0, 0) }, 1);
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_free_exactly_a_reservation(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(4 * g, 0).unwrap();
        expect_rule(fake, dev.free_reservation(va + g, g), Rule::NotAReservation);
        expect_rule(fake, dev.free_reservation(va, 2 * g), Rule::NotAReservation);
        // SAFETY: the fake checks the range against its reservations.
        expect_code(unsafe { fake.driver.mem_address_free(va, 2 * g as usize) }, 1);
        assert!(fake.last_error().contains(Rule::NotAReservation.describe()), "{}", fake.last_error());
        // SAFETY: as above.
        expect_code(unsafe { fake.driver.mem_address_free(va + g, g as usize) }, 1);
        dev.free_reservation(va, 4 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// Freeing a reservation with mappings fails in the driver; the backend
    /// gives the range back to its own books, so it can still be freed later.
    fn rule_no_free_of_a_reservation_in_use(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(2 * g, 0).unwrap();
        let h = dev.create(g).unwrap();
        dev.map(va + g, g, h).unwrap();
        dev.set_access(va + g, g).unwrap();
        expect_driver(fake, dev.free_reservation(va, 2 * g), Rule::ReservationInUse);
        // Still the backend's: copies into it are allowed, and it frees later.
        dev.copy_to_device(va + g, &[1, 2, 3]).unwrap();
        dev.unmap(va + g, g).unwrap();
        dev.release(h).unwrap();
        dev.free_reservation(va, 2 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// Copies need mapped and accessible memory: the fake's pages are
    /// `PROT_NONE` until `cuMemSetAccess`, and the model says 700.
    fn rule_memory_is_accessible_only_after_set_access(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(2 * g, 0).unwrap();
        expect_driver(fake, dev.copy_to_device(va, &[1; 16]), Rule::NotAccessible);
        let h = dev.create(g).unwrap();
        dev.map(va, g, h).unwrap();
        expect_driver(fake, dev.copy_to_device(va, &[1; 16]), Rule::NotAccessible);
        let mut back = [0u8; 16];
        expect_driver(fake, dev.copy_from_device(va, &mut back), Rule::NotAccessible);
        dev.set_access(va, g).unwrap();
        dev.copy_to_device(va, &[1; 16]).unwrap();
        // Past the end of the mapping.
        expect_driver(fake, dev.copy_to_device(va + g - 8, &[1; 16]), Rule::NotAccessible);
        // Outside every range of this device: the backend refuses to pass it on.
        expect_rule(fake, dev.copy_to_device(va + 2 * g, &[1; 16]), Rule::NotAccessible);
        dev.unmap(va, g).unwrap();
        expect_driver(fake, dev.copy_from_device(va, &mut back), Rule::NotAccessible);
        dev.release(h).unwrap();
        dev.free_reservation(va, 2 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// Pages used by queued work may not be unmapped until the stream is
    /// synchronized; the event recorded after the work is not ready until then.
    fn rule_no_unmap_under_queued_work(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(2 * g, 0).unwrap();
        let h = dev.create(2 * g).unwrap();
        dev.map(va, 2 * g, h).unwrap();
        dev.set_access(va, 2 * g).unwrap();
        let s = dev.create_stream().unwrap();
        fake.submit(&dev, s, va + g, 4096);
        let e = dev.create_event().unwrap();
        dev.record_event(e, s).unwrap();
        assert!(!dev.query_event(e).unwrap(), "event ready while work is queued");
        expect_driver(fake, dev.unmap(va, 2 * g), Rule::InUseByStream);
        dev.synchronize_stream(s).unwrap();
        assert!(dev.query_event(e).unwrap());
        // Again, waited for through the event this time.
        fake.submit(&dev, s, va, 16);
        dev.record_event(e, s).unwrap();
        expect_driver(fake, dev.unmap(va, 2 * g), Rule::InUseByStream);
        dev.synchronize_event(e).unwrap();
        dev.unmap(va, 2 * g).unwrap();
        // And on the default stream, through a device-wide synchronize.
        dev.map(va, 2 * g, h).unwrap();
        fake.submit(&dev, Stream::DEFAULT, va, 16);
        expect_driver(fake, dev.unmap(va, 2 * g), Rule::InUseByStream);
        dev.synchronize().unwrap();
        dev.unmap(va, 2 * g).unwrap();
        dev.destroy_event(e).unwrap();
        dev.release(h).unwrap();
        dev.free_reservation(va, 2 * g).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_unknown_pointer(fake) {
        let dev = fake.open(0);
        let p = dev.alloc(1000).unwrap();
        dev.free(p).unwrap();
        expect_rule(fake, dev.free(p), Rule::UnknownPointer);
        let _ctx = dev.enter(Call::Free).unwrap();
        // SAFETY: the fake validates the pointer.
        expect_code(unsafe { fake.driver.mem_free(p) }, 1);
        assert!(fake.last_error().contains(Rule::UnknownPointer.describe()), "{}", fake.last_error());
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_unknown_stream_and_event(fake) {
        let dev = fake.open(0);
        expect_rule(fake, dev.synchronize_stream(Stream(0xdead_0000)), Rule::UnknownStream);
        let e = dev.create_event().unwrap();
        expect_rule(fake, dev.record_event(e, Stream(0xdead_0000)), Rule::UnknownStream);
        dev.destroy_event(e).unwrap();
        expect_rule(fake, dev.destroy_event(e), Rule::UnknownEvent);
        expect_rule(fake, dev.query_event(e), Rule::UnknownEvent);
        expect_rule(fake, dev.query_event(Event(42)), Rule::UnknownEvent);
        // The raw values reach the fake: CUDA_ERROR_INVALID_HANDLE.
        let bogus = std::ptr::with_exposed_provenance_mut(0xdead_0000);
        // SAFETY: the fake validates stream and event values.
        unsafe {
            expect_code(fake.driver.stream_synchronize(bogus), 400);
            assert!(fake.last_error().contains(Rule::UnknownStream.describe()), "{}", fake.last_error());
            expect_code(fake.driver.event_query(std::ptr::with_exposed_provenance_mut(e.0 as usize)), 400);
            assert!(fake.last_error().contains(Rule::UnknownEvent.describe()), "{}", fake.last_error());
            expect_code(fake.driver.event_destroy(std::ptr::with_exposed_provenance_mut(e.0 as usize)), 400);
        }
        assert_clean(fake, 0);
    }
}

fake_test! {
    fn rule_import_needs_an_exported_descriptor(fake) {
        let dev = fake.open_ipc(0);
        let f = std::fs::File::open("/dev/null").unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        expect_driver(fake, dev.import_fd(fd), Rule::UnknownShareableHandle);
        expect_driver(fake, dev.import_fd(-1), Rule::UnknownShareableHandle);
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// Out of memory is its own error, with the figures of `cuMemGetInfo`,
    /// and recoverable.
    env [("FAKE_CUDA_CAPACITY_MB", "64")]
    fn rule_out_of_memory(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let h = dev.create(48 * MIB).unwrap();
        match dev.create(32 * MIB) {
            Err(DeviceError::OutOfMemory { call, requested, free, total }) => {
                assert_eq!((call, requested, free, total), (Call::Create, 32 * MIB, 16 * MIB, 64 * MIB));
            }
            other => panic!("expected out-of-memory, got {other:?}"),
        }
        match dev.alloc(17 * MIB) {
            Err(e @ DeviceError::OutOfMemory { .. }) => assert_eq!(e.cuda_code(), 2),
            other => panic!("expected out-of-memory, got {other:?}"),
        }
        assert!(fake.last_error().contains("out of memory"), "{}", fake.last_error());
        dev.release(h).unwrap();
        let again = dev.create(32 * MIB).unwrap();
        dev.release(again).unwrap();
        let h = dev.create(g).unwrap();
        dev.release(h).unwrap();
        assert_clean(fake, 0);
    }
}

// ---------------------------------------------------------------------------
// Memory NCCL can register (`nccl_ready`, issue 43)

/// Opens device 0 as the C ABI does by default (`ipc:auto`,
/// `nccl_register:True`).
fn open_nccl_ready(fake: &Fake) -> CudaDevice {
    let options = cuda::CudaOptions {
        ipc_auto: true,
        nccl_ready: true,
        ..Default::default()
    };
    CudaDevice::open_with_options(Arc::clone(&fake.driver), 0, &options)
        .unwrap_or_else(|e| panic!("opening fake device 0: {e}"))
}

/// Runs `f` with device `d`'s primary context current, for raw driver calls.
fn with_context<T>(fake: &Fake, d: &CudaDevice, f: impl FnOnce() -> T) -> T {
    // SAFETY: the primary context `d` retained.
    unsafe { fake.driver.ctx_push_current(d.context().unwrap()) }.unwrap();
    let out = f();
    // SAFETY: pops what was pushed above.
    unsafe { fake.driver.ctx_pop_current() }.unwrap();
    out
}

fake_test! {
    /// Where the device offers fabric handles and a larger recommended
    /// granularity, `nccl_ready` memory is what NCCL's ncclMemAlloc makes:
    /// POSIX fd and fabric handle types, the RDMA flag, pages of the
    /// recommended granularity; both kinds of handle export, and the fabric
    /// handle imports.
    env [("FAKE_CUDA_FABRIC", "imex"), ("FAKE_CUDA_RECOMMENDED_GRANULARITY_KB", "8192")]
    fn nccl_ready_memory_is_what_ncclmemalloc_makes(fake) {
        let d = open_nccl_ready(fake);
        assert_eq!(d.caps().granularity, 8 * MIB, "the recommended granularity is the page");
        let prop = d.allocation_prop();
        assert_eq!(
            prop.requestedHandleTypes,
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC
        );
        assert_eq!(prop.allocFlags.gpuDirectRDMACapable, 1);
        let g = d.caps().granularity;
        let va = d.reserve(2 * g, 0).unwrap();
        let h = d.create(2 * g).unwrap();
        assert_eq!(fake.calls("cuMemCreate"), 1);
        d.map(va, 2 * g, h).unwrap();
        d.set_access(va, 2 * g).unwrap();
        d.copy_to_device(va, &pattern(4096, 7)).unwrap();
        // NCCL's registration exports each allocation with its handle type.
        let fabric = with_context(fake, &d, || {
            // SAFETY: `h` is live (created above, not released).
            unsafe { fake.driver.mem_export_to_fabric(h.0) }.unwrap()
        });
        let imported = with_context(fake, &d, || fake.driver.mem_import_from_fabric(&fabric)).unwrap();
        assert_eq!(fake.live(0).physical_bytes, 2 * g, "an import makes no new memory");
        // SAFETY: the handle was just imported and is released once.
        unsafe { fake.driver.mem_release(imported) }.unwrap();
        let fd = d.export_fd(h).unwrap();
        // SAFETY: the descriptor was exported to us.
        unsafe { libc::close(fd) };
        d.unmap(va, 2 * g).unwrap();
        d.release(h).unwrap();
        d.free_reservation(va, 2 * g).unwrap();
        fake.check(0);
    }
}

fake_test! {
    /// A device that reports fabric support but whose process may not use
    /// the fabric (no IMEX channel): the first cuMemCreate is refused with
    /// CUDA_ERROR_NOT_PERMITTED and made again without the fabric type, as
    /// ncclMemAlloc does; later ones do not ask again. Spill's host-located
    /// chunks keep the handle types but not the RDMA flag.
    env [("FAKE_CUDA_FABRIC", "no-imex")]
    fn nccl_ready_drops_fabric_the_driver_refuses(fake) {
        let d = open_nccl_ready(fake);
        assert_eq!(d.caps().granularity, 2 * MIB);
        assert_ne!(d.allocation_prop().requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC, 0);
        let g = d.caps().granularity;
        let h = d.create(g).unwrap();
        assert_eq!(fake.calls("cuMemCreate"), 2, "refused with fabric, made without");
        assert_eq!(d.allocation_prop().requestedHandleTypes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        let h2 = d.create(g).unwrap();
        assert_eq!(fake.calls("cuMemCreate"), 3, "fabric is not asked for again");
        // The handle cannot be exported as fabric, but as a descriptor.
        // SAFETY: `h` is live.
        expect_code(unsafe { fake.driver.mem_export_to_fabric(h.0) }, 1);
        let fd = d.export_fd(h).unwrap();
        // SAFETY: the descriptor was exported to us.
        unsafe { libc::close(fd) };
        let host = d.create_on_host(g).unwrap();
        d.release(host).unwrap();
        d.release(h).unwrap();
        d.release(h2).unwrap();
        fake.check(0);
    }
}

fake_test! {
    /// Another failure of the first cuMemCreate is not taken for a refused
    /// fabric type: it is the caller's error, and fabric is still asked for.
    env [("FAKE_CUDA_FABRIC", "imex"), ("FAKE_CUDA_FAIL", "cuMemCreate:1")]
    fn nccl_ready_keeps_fabric_after_an_out_of_memory(fake) {
        let d = open_nccl_ready(fake);
        let g = d.caps().granularity;
        assert!(matches!(d.create(g), Err(DeviceError::OutOfMemory { .. })));
        assert_eq!(fake.calls("cuMemCreate"), 1);
        assert_ne!(d.allocation_prop().requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC, 0);
        let h = d.create(g).unwrap();
        d.release(h).unwrap();
        fake.check(0);
    }
}

fake_test! {
    /// Without fabric support nothing but the POSIX type is asked for, and
    /// without `nccl_ready` the page stays the minimum granularity and no
    /// RDMA flag is set even where a larger one is recommended. The fake
    /// refuses a fabric type it does not offer, as the driver does.
    env [("FAKE_CUDA_RECOMMENDED_GRANULARITY_KB", "4096")]
    fn nccl_ready_only_where_offered_and_asked(fake) {
        let d = open_nccl_ready(fake);
        assert_eq!(d.caps().granularity, 4 * MIB);
        assert_eq!(d.allocation_prop().requestedHandleTypes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        let plain = fake.open_ipc(0);
        assert_eq!(plain.caps().granularity, 2 * MIB);
        assert_eq!(plain.allocation_prop().allocFlags.gpuDirectRDMACapable, 0);
        let mut prop = plain.allocation_prop();
        prop.requestedHandleTypes |= CU_MEM_HANDLE_TYPE_FABRIC;
        expect_code(with_context(fake, &plain, || fake.driver.mem_create(2 * MIB as usize, &prop, 0)), 801);
        fake.check(0);
    }
}

// ---------------------------------------------------------------------------
// Two devices

fake_test! {
    /// Two devices: separate memory and contexts, unique addresses, the
    /// backend switching the current context as it goes, the suite on both
    /// at once, and a handle shared from one to the other.
    env [("FAKE_CUDA_DEVICES", "2"), ("FAKE_CUDA_CAPACITY_MB", "512,256")]
    fn two_devices(fake) {
        assert_eq!(cuda::device_count().unwrap(), 2);
        let d0 = fake.open_ipc(0);
        let ipc = cuda::CudaOptions { ipc: true, ..Default::default() };
        let d1 = CudaDevice::open_configured(1, &ipc).unwrap(); // through VMMALLOC_CUDA_LIBRARY
        assert_eq!(d0.caps().total_memory, 512 * MIB);
        assert_eq!((d1.caps().total_memory, d1.caps().ordinal), (256 * MIB, 1));
        assert_eq!(d1.caps().name, "vmmalloc fake-cuda device 1");
        assert_ne!(d0.context().unwrap(), d1.context().unwrap());
        let g = d0.caps().granularity;

        // Interleaved on one thread: every call lands on its own device.
        let v0 = d0.reserve(2 * g, 0).unwrap();
        let v1 = d1.reserve(2 * g, 0).unwrap();
        assert!(v0 + 2 * g <= v1 || v1 + 2 * g <= v0, "reservations overlap");
        let h0 = d0.create(2 * g).unwrap();
        let h1 = d1.create(g).unwrap();
        d1.map(v1, g, h1).unwrap();
        d0.map(v0, 2 * g, h0).unwrap();
        d0.set_access(v0, 2 * g).unwrap();
        d1.set_access(v1, g).unwrap();
        let (l0, l1) = (fake.live(0), fake.live(1));
        assert_eq!((l0.handles, l0.mappings, l0.physical_bytes), (1, 1, 2 * g));
        assert_eq!((l1.handles, l1.mappings, l1.physical_bytes), (1, 1, g));
        assert_eq!(d0.mem_info().unwrap().free, 512 * MIB - 2 * g);
        assert_eq!(d1.mem_info().unwrap().free, 256 * MIB - g);
        d0.copy_to_device(v0, &pattern(4096, 0)).unwrap();
        d1.copy_to_device(v1, &pattern(4096, 1)).unwrap();
        let mut b = vec![0u8; 4096];
        d0.copy_from_device(v0, &mut b).unwrap();
        assert_eq!(b, pattern(4096, 0));
        // A device's own books refuse the other device's addresses.
        expect_rule(fake, d1.copy_from_device(v0, &mut b), Rule::NotAccessible);

        // A handle exported by device 0 and imported through device 1 names
        // device 0's memory (no new physical memory anywhere).
        let fd = d0.export_fd(h0).unwrap();
        let shared = d1.import_fd(fd).unwrap();
        assert_eq!(fake.live(1).physical_bytes, g);
        let v2 = d0.reserve(2 * g, 0).unwrap();
        d1.map(v2, 2 * g, shared).unwrap();
        d0.set_access(v2, 2 * g).unwrap();
        d0.copy_from_device(v2, &mut b).unwrap();
        assert_eq!(b, pattern(4096, 0), "the imported handle is not the exported memory");
        d0.unmap(v2, 2 * g).unwrap();
        d1.release(shared).unwrap();
        d0.free_reservation(v2, 2 * g).unwrap();
        // SAFETY: the descriptor was exported to us.
        unsafe { libc::close(fd) };

        d0.unmap(v0, 2 * g).unwrap();
        d1.unmap(v1, g).unwrap();
        d0.release(h0).unwrap();
        d1.release(h1).unwrap();
        d0.free_reservation(v0, 2 * g).unwrap();
        d1.free_reservation(v1, 2 * g).unwrap();
        assert_clean(fake, 0);
        assert_clean(fake, 1);

        // The suite on both devices at once, from two threads.
        std::thread::scope(|s| {
            let a = s.spawn(|| conformance::run_all(&d0));
            let b = s.spawn(|| conformance::run_all(&d1));
            a.join().unwrap().unwrap();
            b.join().unwrap().unwrap();
        });
        assert_clean(fake, 0);
        assert_clean(fake, 1);
        drop((d0, d1));
        assert_eq!(fake.live(0).primary_refs + fake.live(1).primary_refs, 0);
    }
}

fake_test! {
    /// One device used from many threads at once: the backend makes its
    /// context current on each (the fake answers 201 otherwise).
    fn one_device_from_many_threads(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let dev = &dev;
                s.spawn(move || {
                    for i in 0..8u8 {
                        let va = dev.reserve(2 * g, 0).unwrap();
                        let h = dev.create(g).unwrap();
                        dev.map(va + g, g, h).unwrap();
                        dev.set_access(va + g, g).unwrap();
                        let data = pattern(512, t * 16 + i);
                        dev.copy_to_device(va + g + 100, &data).unwrap();
                        let mut back = vec![0u8; 512];
                        dev.copy_from_device(va + g + 100, &mut back).unwrap();
                        assert_eq!(back, data);
                        dev.unmap(va + g, g).unwrap();
                        dev.release(h).unwrap();
                        dev.free_reservation(va, 2 * g).unwrap();
                    }
                });
            }
        });
        assert_clean(fake, 0);
    }
}

// ---------------------------------------------------------------------------
// Ownership of the primary context

fake_test! {
    /// Two backends on one device share its primary context: dropping one
    /// keeps the other's memory alive; the last drop releases the context.
    /// Whatever is still allocated then is freed by the driver (and counted).
    fn primary_context_is_shared_and_released_once(fake) {
        let a = fake.open(0);
        let b = fake.open(0);
        assert_eq!(a.context().unwrap(), b.context().unwrap());
        assert_eq!(fake.live(0).primary_refs, 2);
        let g = a.caps().granularity;
        let va = a.reserve(g, 0).unwrap();
        let h = a.create(g).unwrap();
        drop(b);
        assert_eq!(fake.live(0).primary_refs, 1);
        a.map(va, g, h).unwrap();
        a.set_access(va, g).unwrap();
        a.copy_to_device(va, &[7; 64]).unwrap();
        drop(a);
        let l = fake.live(0);
        assert_eq!(l.primary_refs, 0);
        // A reservation, a handle and a mapping were left behind.
        assert_eq!(l.destroyed_live, 3, "{l:?}");
        assert!(Live { destroyed_live: 0, ..l }.is_clean(), "{l:?}");
        // The device opens again, empty.
        let c = fake.open(0);
        assert_eq!(c.mem_info().unwrap().free, c.caps().total_memory);
    }
}

// ---------------------------------------------------------------------------
// vmm-sys's raw calls: NOT_INITIALIZED, INVALID_CONTEXT, INVALID_DEVICE, arguments

fake_test! {
    fn raw_calls_before_cu_init_are_not_initialized(fake) {
        let d = &fake.driver;
        // Needs no cuInit.
        assert_eq!(d.driver_get_version().unwrap(), 12080);
        assert_eq!(d.error_name(2).as_deref(), Some("CUDA_ERROR_OUT_OF_MEMORY"));
        assert_eq!(d.error_string(2).as_deref(), Some("out of memory"));
        assert_eq!(d.error_name(424242), None);
        // Everything else does.
        expect_code(d.device_get_count(), 3);
        expect_code(d.device_get(0), 3);
        expect_code(d.ctx_get_current(), 3);
        expect_code(d.device_primary_ctx_retain(0), 3);
        expect_code(d.mem_get_info(), 3);
        expect_code(d.mem_address_reserve(2 * MIB as usize, 0, 0, 0), 3);
        expect_code(d.mem_create(2 * MIB as usize, &CUmemAllocationProp::pinned_on_device(0, 0), 0), 3);
        expect_code(d.stream_create(0), 3);
        assert!(fake.last_error().contains("cuInit"), "{}", fake.last_error());
        expect_code(d.init(1), 1);
        d.init(0).unwrap();
        d.init(0).unwrap();
        assert_eq!(d.device_get_count().unwrap(), 1);
        assert_eq!(fake.calls("cuInit"), 3);
    }
}

fake_test! {
    fn raw_calls_without_a_current_context_are_invalid_context(fake) {
        let d = &fake.driver;
        d.init(0).unwrap();
        assert!(d.ctx_get_current().unwrap().is_null());
        expect_code(d.mem_get_info(), 201);
        expect_code(d.mem_alloc(4096), 201);
        expect_code(d.mem_address_reserve(2 * MIB as usize, 0, 0, 0), 201);
        expect_code(d.stream_create(0), 201);
        expect_code(d.event_create(0), 201);
        expect_code(d.ctx_synchronize(), 201);
        // SAFETY: the legacy default stream needs a current context.
        expect_code(unsafe { d.stream_synchronize(std::ptr::null_mut()) }, 201);
        // Calls naming their device need none.
        assert_eq!(d.device_total_mem(0).unwrap(), 1 << 30);
        let prop = CUmemAllocationProp::pinned_on_device(0, 0);
        let g = d.mem_get_allocation_granularity(&prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM).unwrap();
        assert_eq!(g, 2 << 20);

        let ctx = fake.raw_context(0);
        assert_eq!(d.ctx_get_current().unwrap(), ctx);
        let (free, total) = d.mem_get_info().unwrap();
        assert_eq!((free, total), (1 << 30, 1 << 30));
        // A value that is not a context.
        // SAFETY: the fake validates context values.
        expect_code(unsafe { d.ctx_set_current(std::ptr::with_exposed_provenance_mut(0x1234)) }, 201);
        // Another thread has no current context until it sets one.
        std::thread::scope(|s| {
            s.spawn(|| expect_code(d.mem_get_info(), 201)).join().unwrap();
        });
        // Released to zero: the context is gone, though still current here.
        // SAFETY: balances the retain of raw_context.
        unsafe { d.device_primary_ctx_release(0) }.unwrap();
        expect_code(d.mem_get_info(), 201);
        // SAFETY: nothing is retained any more; the fake refuses.
        expect_code(unsafe { d.device_primary_ctx_release(0) }, 201);
        // SAFETY: null unsets the current context.
        unsafe { d.ctx_set_current(std::ptr::null_mut()) }.unwrap();
        assert!(d.ctx_get_current().unwrap().is_null());
    }
}

fake_test! {
    env [("FAKE_CUDA_DEVICES", "2")]
    fn raw_calls_with_a_bad_ordinal_are_invalid_device(fake) {
        let d = &fake.driver;
        d.init(0).unwrap();
        expect_code(d.device_get(2), 101);
        expect_code(d.device_get(-1), 101);
        expect_code(d.device_get_name(7), 101);
        expect_code(d.device_total_mem(2), 101);
        expect_code(d.device_get_attribute(102, 2), 101);
        expect_code(d.device_primary_ctx_retain(2), 101);
        expect_code(d.mem_create(2 << 20, &CUmemAllocationProp::pinned_on_device(2, 0), 0), 101);
        let e = CudaDevice::open_with(Arc::clone(&fake.driver), 2).unwrap_err();
        assert!(matches!(e, DeviceError::Unavailable(_)), "{e:?}");
        assert!(e.to_string().contains("ordinal 2 (2 device(s) present)"), "{e}");
    }
}

fake_test! {
    /// The fake checks the arguments the driver checks before touching memory.
    fn raw_arguments_are_checked(fake) {
        let d = &fake.driver;
        fake.raw_context(0);
        let g = 2usize << 20;
        let prop = CUmemAllocationProp::pinned_on_device(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        // Device attributes.
        assert_eq!(d.device_get_attribute(102, 0).unwrap(), 1);
        assert_eq!(d.device_get_attribute(103, 0).unwrap(), 1);
        assert_eq!(d.device_get_attribute(75, 0).unwrap(), 9);
        expect_code(d.device_get_attribute(144, 0), 1);
        assert_eq!(d.device_get_name(0).unwrap(), "vmmalloc fake-cuda device 0");
        // Allocation properties.
        expect_code(d.mem_create(g, &CUmemAllocationProp::default(), 0), 1);
        expect_code(d.mem_create(g, &prop, 1), 1);
        let mut fabric = prop;
        fabric.requestedHandleTypes = 0x8;
        expect_code(d.mem_create(g, &fabric, 0), 801);
        let mut host_located = prop;
        host_located.location.type_ = 2;
        expect_code(d.mem_create(g, &host_located, 0), 1);
        let mut compressed = prop;
        compressed.allocFlags.compressionType = 1;
        expect_code(d.mem_create(g, &compressed, 0), 801);
        expect_code(d.mem_get_allocation_granularity(&prop, 7), 1);
        assert_eq!(d.mem_get_allocation_granularity(&prop, 1).unwrap(), g);
        // Reserve, map and access flags.
        expect_code(d.mem_address_reserve(g, 0, 0, 1), 1);
        let va = d.mem_address_reserve(2 * g, 0, 0x1234_0000_0000, 0).unwrap();
        let h = d.mem_create(g, &prop, 0).unwrap();
        // SAFETY: the handle and range are ours; the fake validates the rest.
        unsafe {
            expect_code(d.mem_map(va, g, g, h, 0), 1);
            assert!(fake.last_error().contains("offset"), "{}", fake.last_error());
            expect_code(d.mem_map(va, g, 0, h, 1), 1);
            d.mem_map(va, g, 0, h, 0).unwrap();
            expect_code(d.mem_set_access(va, g, &[]), 1);
            let read_only = CUmemAccessDesc { flags: CU_MEM_ACCESS_FLAGS_PROT_READ, ..CUmemAccessDesc::read_write(0) };
            expect_code(d.mem_set_access(va, g, &[read_only]), 801);
            expect_code(d.mem_set_access(va, g, &[CUmemAccessDesc::read_write(3)]), 101);
            d.mem_set_access(va, g, &[CUmemAccessDesc::read_write(0)]).unwrap();
            // Export: an fd that imports back to the same memory.
            let fd = d.mem_export_to_fd(h).unwrap();
            let h2 = d.mem_import_from_fd(fd).unwrap();
            assert_ne!(h, h2);
            libc::close(fd);
            d.memcpy_htod(va + 8, b"fake-cuda").unwrap();
            let mut back = [0u8; 9];
            d.memcpy_dtoh(&mut back, va + 8).unwrap();
            assert_eq!(&back, b"fake-cuda");
            d.mem_unmap(va, g).unwrap();
            d.mem_release(h).unwrap();
            d.mem_release(h2).unwrap();
            // A handle created without the POSIX type cannot be exported.
            let plain = d.mem_create(g, &CUmemAllocationProp::pinned_on_device(0, 0), 0).unwrap();
            expect_code(d.mem_export_to_fd(plain), 1);
            d.mem_release(plain).unwrap();
            d.mem_address_free(va, 2 * g).unwrap();
        }
        // Null out-pointers.
        let raw = d.raw();
        // SAFETY: the fake must refuse null out-pointers, not write through them.
        unsafe {
            assert_eq!((raw.cuDeviceGetCount)(std::ptr::null_mut()), 1);
            assert_eq!((raw.cuMemGetInfo_v2)(std::ptr::null_mut(), std::ptr::null_mut()), 1);
            assert_eq!((raw.cuMemCreate)(std::ptr::null_mut(), g, &prop, 0), 1);
            assert_eq!((raw.cuMemAddressReserve)(std::ptr::null_mut(), g, 0, 0, 0), 1);
            assert_eq!((raw.cuMemAlloc_v2)(std::ptr::null_mut(), 16), 1);
            assert_eq!((raw.cuStreamCreate)(std::ptr::null_mut(), 0), 1);
            assert_eq!((raw.cuGetErrorName)(0, std::ptr::null_mut()), 1);
            let mut p: *const c_char = std::ptr::null();
            assert_eq!((raw.cuGetErrorName)(424242, &mut p), 1);
            assert!(p.is_null());
        }
        assert_clean(fake, 0);
    }
}

// ---------------------------------------------------------------------------
// Configuration and injected failures

fake_test! {
    /// `FAKE_CUDA_FAIL` fails exactly the Nth call of an entry point; the
    /// backend reports it (out-of-memory for `cuMemCreate` by default) and
    /// carries on.
    env [("FAKE_CUDA_FAIL", "cuMemCreate:3,cuMemMap:2,cuMemSetAccess:1:700")]
    fn fail_the_nth_call(fake) {
        let dev = fake.open(0);
        let g = dev.caps().granularity;
        let va = dev.reserve(4 * g, 0).unwrap();
        let a = dev.create(g).unwrap();
        let b = dev.create(g).unwrap();
        match dev.create(g) {
            Err(e @ DeviceError::OutOfMemory { .. }) => assert_eq!(e.call(), Some(Call::Create)),
            other => panic!("the 3rd cuMemCreate should fail with out-of-memory: {other:?}"),
        }
        assert!(fake.last_error().contains("injected failure of call 3"), "{}", fake.last_error());
        let c = dev.create(g).unwrap();
        assert_eq!(fake.calls("cuMemCreate"), 4);
        dev.map(va, g, a).unwrap();
        match dev.map(va + g, g, b) {
            Err(DeviceError::Driver { call: Call::Map, code: 999, name, .. }) => assert_eq!(name, "CUDA_ERROR_UNKNOWN"),
            other => panic!("the 2nd cuMemMap should fail with 999: {other:?}"),
        }
        dev.map(va + g, g, b).unwrap();
        match dev.set_access(va, 2 * g) {
            Err(DeviceError::Driver { code: 700, .. }) => {}
            other => panic!("the 1st cuMemSetAccess should fail with 700: {other:?}"),
        }
        dev.set_access(va, 2 * g).unwrap();
        dev.unmap(va, 2 * g).unwrap();
        for h in [a, b, c] {
            dev.release(h).unwrap();
        }
        dev.free_reservation(va, 4 * g).unwrap();
        assert_clean(fake, 0);
        assert_eq!(fake.calls("cuMemMap"), 3);
    }
}

fake_test! {
    /// A failed `cuInit` makes the device unavailable, not a panic; the next
    /// open succeeds.
    env [("FAKE_CUDA_FAIL", "cuInit:1"), ("FAKE_CUDA_FAIL_CODE", "999")]
    fn injected_cu_init_failure_is_unavailable(fake) {
        let e = CudaDevice::open_with(Arc::clone(&fake.driver), 0).unwrap_err();
        assert!(matches!(e, DeviceError::Unavailable(_)), "{e:?}");
        assert!(e.to_string().contains("cuInit"), "{e}");
        let dev = fake.open(0);
        assert_eq!(dev.caps().ordinal, 0);
    }
}

fake_test! {
    env [("FAKE_CUDA_DEVICES", "0")]
    fn no_devices(fake) {
        assert_eq!(cuda::device_count().unwrap(), 0);
        let e = CudaDevice::open_with(Arc::clone(&fake.driver), 0).unwrap_err();
        assert!(e.to_string().contains("no CUDA device found"), "{e}");
    }
}

fake_test! {
    env [("FAKE_CUDA_CAPACITY_MB", "lots")]
    fn malformed_configuration_refuses_to_initialize(fake) {
        expect_code(fake.driver.init(0), 1);
        assert!(fake.last_error().contains("FAKE_CUDA_CAPACITY_MB=lots"), "{}", fake.last_error());
        let e = CudaDevice::open_with(Arc::clone(&fake.driver), 0).unwrap_err();
        assert!(matches!(e, DeviceError::Unavailable(_)), "{e:?}");
    }
}

// ---------------------------------------------------------------------------
// `vmmalloc info`

/// `vmmalloc info` with `VMMALLOC_CUDA_LIBRARY` pointing at the fake lists its
/// devices and the `cuda` backend. Runs `target/<profile>/vmmalloc` when it has
/// been built (by `cargo test --workspace`, or `cargo build`); says so and
/// checks nothing otherwise.
#[test]
fn vmmalloc_info_shows_the_fake_devices() {
    let bin = profile_dir().join("vmmalloc");
    if !bin.exists() {
        eprintln!("skipped: {} is not built", bin.display());
        return;
    }
    let lib = fake_library();
    let mut cmd = Command::new(&bin);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("FAKE_CUDA_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd
        .arg("info")
        .env(vmm_sys::LIBRARY_ENV, &lib)
        .env("FAKE_CUDA_DEVICES", "2")
        .env("FAKE_CUDA_CAPACITY_MB", "2048,1024")
        // Item 10: info creates no context. Any retain, push or set would
        // fail here and show a device as unusable.
        .env(
            "FAKE_CUDA_FAIL",
            "cuDevicePrimaryCtxRetain:1,cuCtxPushCurrent_v2:1,cuCtxSetCurrent:1",
        )
        .output()
        .expect("run vmmalloc info");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let want = [
        format!(
            "CUDA driver: CUDA 12.8 (12080) from {}, 2 device(s)",
            lib.display()
        ),
        "  [0] vmmalloc fake-cuda device 0: 2 GiB memory, VMM supported, granularity 2 MiB"
            .to_owned(),
        // No NVML on a machine with the fake: nothing to match.
        "      PCI 0000:10:00.0, GPU-fa4ec0da-0000-4000-8000-000000000000, no NVML device matches"
            .to_owned(),
        "  [1] vmmalloc fake-cuda device 1: 1 GiB memory, VMM supported, granularity 2 MiB"
            .to_owned(),
        "      PCI 0000:11:00.0, GPU-fa4ec0da-0000-4000-8000-000000000001, no NVML device matches"
            .to_owned(),
        "backends available: cuda, host, sim".to_owned(),
    ];
    for line in want {
        assert!(
            stdout.lines().any(|l| l == line),
            "missing `{line}` in:\n{stdout}\n{stderr}"
        );
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// The harness itself: the library is built where the tests look for it.
#[test]
fn the_fake_is_built_next_to_this_test() {
    let lib = fake_library();
    assert!(lib.is_file(), "{}", lib.display());
    if std::env::var_os(FAKE_LIBRARY_ENV).is_none() {
        assert_eq!(lib, profile_dir().join("libcuda.so"));
    }
}

// ---------------------------------------------------------------------------
// Issue 11: contexts, peers, handle types, special streams, capture

/// One call of every kind through `dev`, each followed by `after(kind)`.
fn every_operation(dev: &CudaDevice, after: &mut dyn FnMut(&str)) {
    let g = dev.caps().granularity;
    let va = dev.reserve(2 * g, 0).unwrap();
    after("reserve");
    let h = dev.create(2 * g).unwrap();
    after("create");
    dev.map(va, 2 * g, h).unwrap();
    after("map");
    dev.set_access(va, 2 * g).unwrap();
    after("set_access");
    dev.copy_to_device(va, &pattern(4096, 3)).unwrap();
    after("copy_to_device");
    let mut b = vec![0u8; 4096];
    dev.copy_from_device(va, &mut b).unwrap();
    after("copy_from_device");
    dev.mem_info().unwrap();
    after("mem_info");
    let s = dev.create_stream().unwrap();
    after("create_stream");
    let e = dev.create_event().unwrap();
    after("create_event");
    dev.record_event(e, s).unwrap();
    after("record_event");
    dev.query_event(e).unwrap();
    after("query_event");
    dev.synchronize_event(e).unwrap();
    after("synchronize_event");
    assert!(!dev.is_capturing(s).unwrap());
    after("is_capturing");
    dev.synchronize_stream(s).unwrap();
    after("synchronize_stream");
    dev.synchronize_stream(Stream::DEFAULT).unwrap();
    after("synchronize_stream(default)");
    dev.synchronize().unwrap();
    after("synchronize");
    dev.destroy_event(e).unwrap();
    after("destroy_event");
    dev.unmap(va, 2 * g).unwrap();
    after("unmap");
    dev.release(h).unwrap();
    after("release");
    dev.free_reservation(va, 2 * g).unwrap();
    after("free_reservation");
    let p = dev.alloc(4096).unwrap();
    after("alloc");
    dev.free(p).unwrap();
    after("free");
    // Failing calls restore the context too.
    assert!(dev.free(p).is_err());
    after("free (refused)");
    assert!(dev.unmap(va, g).is_err());
    after("unmap (refused by the driver)");
    assert!(dev.ipc_open(&IpcMemHandle([0; 64])).is_err());
    after("ipc_open (refused by the driver)");
    assert!(dev.ipc_close(p).is_err());
    after("ipc_close (refused)");
}

fake_test! {
    /// Defect 1: after every operation the calling thread's context stack is
    /// exactly as it was, whatever the caller had current: nothing, the
    /// other device's primary context (PyTorch's current device), or a stack
    /// of contexts another library pushed.
    env [("FAKE_CUDA_DEVICES", "2")]
    fn every_call_leaves_the_callers_context_as_found(fake) {
        let d0 = fake.open(0);
        let d1 = fake.open(1);
        let c1 = d1.context().unwrap().expose_provenance();
        let c0 = d0.context().unwrap().expose_provenance();
        let stacks: [(&str, Vec<usize>); 4] = [
            ("nothing current", vec![]),
            ("device 1 current", vec![c1]),
            ("device 0 current", vec![c0]),
            ("device 0 then device 1 pushed", vec![c0, c1]),
        ];
        for (what, stack) in stacks {
            for &c in &stack {
                // SAFETY: primary contexts retained by d0 / d1.
                unsafe { fake.driver.ctx_push_current(std::ptr::with_exposed_provenance_mut(c)) }
                    .unwrap();
            }
            let before = fake.context_stack();
            assert_eq!(before.1 as usize, stack.len());
            every_operation(&d0, &mut |op| {
                assert_eq!(fake.context_stack(), before, "{what}: after {op}");
            });
            for _ in &stack {
                // SAFETY: pops what this test pushed.
                unsafe { fake.driver.ctx_pop_current() }.unwrap();
            }
        }
        // From a fresh thread, with nothing current.
        std::thread::scope(|s| {
            s.spawn(|| {
                every_operation(&d1, &mut |op| {
                    assert_eq!(fake.context_stack(), (0, 0), "fresh thread: after {op}");
                });
            });
        });
        assert_clean(fake, 0);
        assert_clean(fake, 1);
    }
}

fake_test! {
    /// Defect 1: opening a device creates no context; the first call that
    /// needs one retains it, and queries never do.
    env [("FAKE_CUDA_DEVICES", "2")]
    fn opening_is_lazy_about_the_primary_context(fake) {
        let d1 = fake.open(1);
        assert_eq!(fake.live(1).primary_refs, 0);
        assert!(!d1.primary_context_active().unwrap());
        assert!(!d1.has_retained_context());
        assert_eq!(d1.caps().granularity, 2 * MIB);
        // Waiting on or asking about a device without a context creates none.
        d1.synchronize().unwrap();
        d1.synchronize_stream(Stream::DEFAULT).unwrap();
        assert!(!d1.is_capturing(Stream::DEFAULT).unwrap());
        assert_eq!(fake.live(1).primary_refs, 0);
        assert!(!d1.primary_context_active().unwrap());
        d1.mem_info().unwrap();
        assert_eq!(fake.live(1).primary_refs, 1);
        assert!(d1.primary_context_active().unwrap() && d1.has_retained_context());
        drop(d1);
        assert_eq!(fake.live(1).primary_refs, 0);
        assert_eq!(fake.context_stack(), (0, 0));
    }
}

/// `cuMemGetAccess` of device `peer` to `addr`.
fn access_of(fake: &Fake, peer: i32, addr: u64) -> u64 {
    let loc = vmm_sys::CUmemLocation {
        type_: vmm_sys::CU_MEM_LOCATION_TYPE_DEVICE,
        id: peer,
    };
    fake.driver.mem_get_access(&loc, addr).unwrap()
}

/// Maps two granules on `dev` and grants access; returns (va, handle).
fn mapped(dev: &CudaDevice) -> (u64, PhysHandle) {
    let g = dev.caps().granularity;
    let va = dev.reserve(2 * g, 0).unwrap();
    let h = dev.create(2 * g).unwrap();
    dev.map(va, 2 * g, h).unwrap();
    dev.set_access(va, 2 * g).unwrap();
    (va, h)
}

fn unmapped(dev: &CudaDevice, va: u64, h: PhysHandle) {
    let g = dev.caps().granularity;
    dev.unmap(va, 2 * g).unwrap();
    dev.release(h).unwrap();
    dev.free_reservation(va, 2 * g).unwrap();
}

fake_test! {
    /// Defect 2: under peers:auto (the default) device 1 can read and write
    /// device 0's memory; under peers:none it cannot; an unmap takes the
    /// access away.
    env [("FAKE_CUDA_DEVICES", "3"), ("FAKE_CUDA_PEERS", "0-1")]
    fn peers_get_read_write_access(fake) {
        use vmm_sys::{CU_MEM_ACCESS_FLAGS_PROT_NONE as NONE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE as RW};
        let (rw, none) = (u64::from(RW), u64::from(NONE));
        let d0 = fake.open(0);
        assert_eq!(d0.peers(), &[1], "device 2 is not peer-capable");
        let g = d0.caps().granularity;
        let (va, h) = mapped(&d0);
        let _ctx = d0.enter(Call::SetAccess).unwrap();
        for addr in [va, va + g, va + 2 * g - 1] {
            assert_eq!(access_of(fake, 0, addr), rw);
            assert_eq!(access_of(fake, 1, addr), rw, "peer 1 at {addr:#x}");
            assert_eq!(access_of(fake, 2, addr), none);
        }
        d0.unmap(va, 2 * g).unwrap();
        d0.map(va, 2 * g, h).unwrap();
        assert_eq!(access_of(fake, 1, va), none, "access survived an unmap");
        d0.unmap(va, 2 * g).unwrap();
        d0.release(h).unwrap();
        d0.free_reservation(va, 2 * g).unwrap();
        drop(_ctx);

        let none_opts = cuda::CudaOptions { peers: cuda::Peers::None, ..Default::default() };
        let d0n = CudaDevice::open_with_options(Arc::clone(&fake.driver), 0, &none_opts).unwrap();
        assert!(d0n.peers().is_empty());
        let (va, h) = mapped(&d0n);
        {
            let _ctx = d0n.enter(Call::SetAccess).unwrap();
            assert_eq!(access_of(fake, 0, va), rw);
            assert_eq!(access_of(fake, 1, va), none);
        }
        unmapped(&d0n, va, h);

        // A list: device 1 is fine, device 2 cannot access, device 7 does not exist.
        let list = |l: Vec<u32>| cuda::CudaOptions { peers: cuda::Peers::List(l), ..Default::default() };
        let d = CudaDevice::open_with_options(Arc::clone(&fake.driver), 0, &list(vec![0, 1])).unwrap();
        assert_eq!(d.peers(), &[1]);
        for (l, want) in [(vec![2], "cannot access"), (vec![1, 7], "does not exist")] {
            let e = CudaDevice::open_with_options(Arc::clone(&fake.driver), 0, &list(l)).unwrap_err();
            let text = e.to_string();
            assert!(text.starts_with("peers:") && text.contains(want), "{text}");
        }
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// The fake refuses a peer that cannot access the owner, with the code
    /// cuda.h lists for cuMemSetAccess.
    env [("FAKE_CUDA_DEVICES", "2"), ("FAKE_CUDA_PEERS", "none")]
    fn the_fake_refuses_peers_that_cannot_access(fake) {
        let d0 = fake.open(0);
        assert!(d0.peers().is_empty(), "peers:auto found no peer-capable device");
        let g = d0.caps().granularity;
        let va = d0.reserve(g, 0).unwrap();
        let h = d0.create(g).unwrap();
        d0.map(va, g, h).unwrap();
        let _ctx = d0.enter(Call::SetAccess).unwrap();
        let desc = [CUmemAccessDesc::read_write(0), CUmemAccessDesc::read_write(1)];
        // SAFETY: a range of this test; the fake validates it.
        expect_code(unsafe { fake.driver.mem_set_access(va, g as usize, &desc) }, 101);
        assert!(fake.last_error().contains("cuDeviceCanAccessPeer"), "{}", fake.last_error());
        d0.unmap(va, g).unwrap();
        d0.release(h).unwrap();
        d0.free_reservation(va, g).unwrap();
    }
}

fake_test! {
    /// Defect 6: no handle type unless ipc:true; exporting then fails with a
    /// clear error naming the key.
    fn handle_types_only_with_ipc(fake) {
        let dev = fake.open(0);
        let h = dev.create(dev.caps().granularity).unwrap();
        let e = dev.export_fd(h).unwrap_err();
        assert!(e.to_string().contains("ipc:true"), "{e}");
        assert_eq!(e.cuda_code(), 801);
        dev.release(h).unwrap();
        let dev = fake.open_ipc(0);
        let h = dev.create(dev.caps().granularity).unwrap();
        let fd = dev.export_fd(h).unwrap();
        // SAFETY: exported to us.
        unsafe { libc::close(fd) };
        dev.release(h).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// Capture through the `cuda` backend: `is_capturing` follows begin/end
    /// capture, and what the driver forbids during a capture fails with its
    /// code (900, 907) and invalidates the capture (901 at the end).
    fn capture_state_and_forbidden_calls(fake) {
        use vmm_sys::CU_STREAM_CAPTURE_MODE_GLOBAL as GLOBAL;
        let dev = fake.open(0);
        let s = dev.create_stream().unwrap();
        let raw = std::ptr::with_exposed_provenance_mut(s.0 as usize);
        let e = dev.create_event().unwrap();
        assert!(!dev.is_capturing(s).unwrap());
        let ctx = dev.enter(Call::StreamSync).unwrap();
        // SAFETY: a stream of this device.
        unsafe { fake.driver.stream_begin_capture(raw, GLOBAL) }.unwrap();
        drop(ctx);
        assert!(dev.is_capturing(s).unwrap());
        // Non-blocking streams do not make the legacy stream part of the capture.
        assert!(!dev.is_capturing(Stream::DEFAULT).unwrap());
        dev.record_event(e, s).unwrap();
        assert_eq!(dev.query_event(e).unwrap_err().cuda_code(), 907);
        assert_eq!(dev.synchronize_event(e).unwrap_err().cuda_code(), 907);
        assert_eq!(dev.synchronize_stream(s).unwrap_err().cuda_code(), 900);
        assert_eq!(dev.synchronize().unwrap_err().cuda_code(), 900);
        assert!(dev.is_capturing(s).unwrap(), "an invalidated capture is still a capture");
        let ctx = dev.enter(Call::StreamSync).unwrap();
        // SAFETY: as above.
        expect_code(unsafe { fake.driver.stream_end_capture(raw) }, 901);
        expect_code(unsafe { fake.driver.stream_end_capture(raw) }, 903);
        // SAFETY: the legacy stream cannot be captured.
        expect_code(unsafe { fake.driver.stream_begin_capture(std::ptr::null_mut(), GLOBAL) }, 900);
        drop(ctx);
        assert!(!dev.is_capturing(s).unwrap());
        dev.synchronize().unwrap();
        dev.record_event(e, s).unwrap();
        assert!(dev.query_event(e).unwrap());
        dev.destroy_event(e).unwrap();
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// Defect 9: CU_STREAM_LEGACY is the default stream; CU_STREAM_PER_THREAD
    /// is a different stream on every thread, and its key works from any thread.
    fn per_thread_and_legacy_streams(fake) {
        use vmm_sys::{CU_STREAM_CAPTURE_MODE_RELAXED as RELAXED, CU_STREAM_PER_THREAD as PT};
        let dev = fake.open(0);
        dev.accept_external_streams(true);
        assert_eq!(cuda::stream_key(0x1), Stream::DEFAULT);
        let a = cuda::stream_key(PT as u64);
        assert_eq!(a, cuda::stream_key(PT as u64), "stable on one thread");
        assert!(cuda::is_per_thread_key(a));
        let b = std::thread::scope(|sc| sc.spawn(|| cuda::stream_key(PT as u64)).join().unwrap());
        assert_ne!(a, b, "one key for two threads' streams");
        let (va, h) = mapped(&dev);
        // Work queued on this thread's per-thread stream ...
        fake.submit(&dev, Stream(PT as u64), va, 16);
        let e = dev.create_event().unwrap();
        dev.record_event(e, a).unwrap();
        assert!(!dev.query_event(e).unwrap(), "the event ignored this thread's stream");
        // ... is not on another thread's per-thread stream.
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mine = cuda::stream_key(PT as u64);
                let e2 = dev.create_event().unwrap();
                dev.record_event(e2, mine).unwrap();
                assert!(dev.query_event(e2).unwrap());
                dev.destroy_event(e2).unwrap();
                // The other thread's key: recorded (on the legacy stream) and
                // synchronized (the whole context) without naming it.
                let e3 = dev.create_event().unwrap();
                dev.record_event(e3, a).unwrap();
                assert!(
                    !dev.query_event(e3).unwrap(),
                    "an event for the other thread's stream ignored its queued work"
                );
                dev.synchronize_stream(a).unwrap();
                assert!(dev.query_event(e3).unwrap());
                dev.destroy_event(e3).unwrap();
            });
        });
        assert!(dev.query_event(e).unwrap(), "synchronizing the key did not reach the stream");
        // Capturing the per-thread stream: seen from this thread through the
        // key, and from another one through the legacy stream (906 -> true).
        {
            let _ctx = dev.enter(Call::StreamSync).unwrap();
            // SAFETY: this thread's per-thread stream.
            unsafe { fake.driver.stream_begin_capture(std::ptr::with_exposed_provenance_mut(PT), RELAXED) }
                .unwrap();
        }
        assert!(dev.is_capturing(a).unwrap());
        std::thread::scope(|sc| {
            sc.spawn(|| {
                assert!(dev.is_capturing(a).unwrap(), "another thread's capturing stream");
                assert!(!dev.is_capturing(cuda::stream_key(PT as u64)).unwrap());
            });
        });
        {
            let _ctx = dev.enter(Call::StreamSync).unwrap();
            // SAFETY: as above.
            unsafe { fake.driver.stream_end_capture(std::ptr::with_exposed_provenance_mut(PT)) }.unwrap();
        }
        dev.destroy_event(e).unwrap();
        unmapped(&dev, va, h);
        assert_clean(fake, 0);
    }
}

fake_test! {
    /// Spill through the `cuda` backend: `create_on_host` is `cuMemCreate`
    /// with a host NUMA location (node from `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`);
    /// the chunk maps into a device reservation, holds bytes, uses no device
    /// memory, and is released like any handle.
    env [("FAKE_CUDA_CAPACITY_MB", "64")]
    fn host_located_chunks_map_like_device_ones(fake) {
        let dev = fake.open(0);
        let free0 = dev.mem_info().unwrap().free;
        let va = dev.reserve(8 * MIB, 2 * MIB).unwrap();
        let h = dev.create_on_host(8 * MIB).unwrap();
        assert_eq!(dev.mem_info().unwrap().free, free0, "host memory, not device memory");
        dev.map(va, 8 * MIB, h).unwrap();
        dev.set_access(va, 8 * MIB).unwrap();
        let data = pattern(4096, 7);
        dev.copy_to_device(va + 3 * MIB, &data).unwrap();
        let mut back = vec![0u8; 4096];
        dev.copy_from_device(va + 3 * MIB, &mut back).unwrap();
        assert_eq!(back, data);
        // More than the device holds: host memory is a separate budget.
        let big = dev.create_on_host(128 * MIB).unwrap();
        dev.release(big).unwrap();
        dev.unmap(va, 8 * MIB).unwrap();
        dev.release(h).unwrap();
        dev.free_reservation(va, 8 * MIB).unwrap();
        assert_clean(fake, 0);
    }
}

// ---------------------------------------------------------------------------
// Page-locked host buffers (cuMemHostAlloc / cuMemFreeHost)

fake_test! {
    /// `alloc_host_buffer` on `cuda` is `cuMemHostAlloc` memory (zeroed,
    /// usable for copies both ways), freed by `cuMemFreeHost` on drop with the
    /// caller's context stack untouched, and still freed correctly when the
    /// device was dropped first (the buffer holds its own context retain).
    fn host_buffers_are_pinned_and_freed_on_drop(fake) {
        let dev = fake.open(0);
        let (va, h) = mapped(&dev);
        let stack = fake.context_stack();
        let mut b = dev.alloc_host_buffer(4096).unwrap();
        assert_eq!(fake.context_stack(), stack, "the caller's context is restored");
        assert!(b.is_pinned());
        assert_eq!(b.len(), 4096);
        assert!(b.iter().all(|&x| x == 0));
        assert_eq!(fake.pinned(), (4096, 1));
        let data = pattern(4096, 7);
        b.copy_from_slice(&data);
        dev.copy_to_device(va, &b).unwrap();
        let mut back = dev.alloc_host_buffer(4096).unwrap();
        dev.copy_from_device(va, &mut back).unwrap();
        assert_eq!(&back[..], &data[..]);
        assert_eq!(fake.pinned(), (8192, 2));
        let frees = fake.calls("cuMemFreeHost");
        drop(back);
        assert_eq!(fake.pinned(), (4096, 1));
        assert_eq!(fake.calls("cuMemFreeHost"), frees + 1);
        // Length 0: an empty buffer, no driver call.
        let calls = fake.calls("cuMemHostAlloc");
        assert_eq!(dev.alloc_host_buffer(0).unwrap().len(), 0);
        assert_eq!(fake.calls("cuMemHostAlloc"), calls);
        unmapped(&dev, va, h);
        drop(dev);
        assert_eq!(fake.pinned(), (4096, 1));
        drop(b);
        assert_eq!(fake.pinned(), (0, 0));
        assert_eq!(fake.calls("cuMemFreeHost"), frees + 2);
        assert_eq!(fake.last_error(), "", "no call failed");
        assert_clean(fake, 0);
        assert_eq!(fake.live(0).primary_refs, 0, "every retain released");
    }
}

fake_test! {
    /// A failing `cuMemHostAlloc` (out of memory) falls back to pageable
    /// memory: the buffer works, nothing is pinned, nothing leaks.
    env [("FAKE_CUDA_FAIL", "cuMemHostAlloc:1:2")]
    fn failed_pinning_falls_back_to_pageable_memory(fake) {
        let dev = fake.open(0);
        let mut b = dev.alloc_host_buffer(10_000).unwrap();
        assert!(!b.is_pinned());
        assert_eq!(fake.pinned(), (0, 0));
        b[9_999] = 1;
        let c = dev.alloc_host_buffer(10_000).unwrap();
        assert!(c.is_pinned(), "only the first call was made to fail");
        drop((b, c));
        assert_eq!(fake.pinned(), (0, 0));
        drop(dev);
        assert_eq!(fake.live(0).primary_refs, 0);
    }
}

fake_test! {
    /// The fake is as strict as the driver: a current context is needed,
    /// only `CU_MEMHOSTALLOC_*` flags, and `cuMemFreeHost` of a pointer that
    /// is not a live `cuMemHostAlloc` allocation is `CUDA_ERROR_INVALID_VALUE`.
    fn the_fakes_pinned_memory_rules(fake) {
        let d = &fake.driver;
        d.init(0).unwrap();
        expect_code(d.mem_host_alloc(4096, 0), vmm_sys::CUDA_ERROR_INVALID_CONTEXT);
        let dev = fake.open(0);
        let _ctx = dev.enter(Call::HostAlloc).unwrap();
        expect_code(d.mem_host_alloc(4096, 0x8), vmm_sys::CUDA_ERROR_INVALID_VALUE);
        expect_code(d.mem_host_alloc(0, 0), vmm_sys::CUDA_ERROR_INVALID_VALUE);
        let p = d.mem_host_alloc(4096, 0x1 | 0x2 | 0x4).unwrap();
        let mut local = 0u8;
        expect_code(
            unsafe { d.mem_free_host(std::ptr::from_mut(&mut local).cast()) },
            vmm_sys::CUDA_ERROR_INVALID_VALUE,
        );
        unsafe { d.mem_free_host(p) }.unwrap();
        expect_code(unsafe { d.mem_free_host(p) }, vmm_sys::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(fake.pinned(), (0, 0));
    }
}

fake_test! {
    /// Every adaptor forwards `alloc_host_buffer` to the backend (the buffer
    /// is still pinned through them), `Counting` counts it as
    /// `Call::HostAlloc`, `CapacityLimit` does not charge it, and an injected
    /// fault reaches the caller as an error (the allocator then falls back).
    fn adaptors_forward_host_buffers(fake) {
        use vmmalloc_device::adaptors::{
            CapacityLimit, Counting, FaultInjecting, FaultKind, FaultPlan,
        };
        let counting = Counting::counting(Arc::new(fake.open(0)));
        let b = counting.alloc_host_buffer(8192).unwrap();
        assert!(b.is_pinned());
        assert_eq!(counting.hook().counts().get(Call::HostAlloc), 1);
        let limited = CapacityLimit::new(&counting, 4096);
        let c = limited.alloc_host_buffer(1 << 20).unwrap();
        assert!(c.is_pinned(), "host memory is not device capacity");
        assert_eq!(counting.hook().counts().get(Call::HostAlloc), 2);
        assert_eq!(fake.pinned(), (8192 + (1 << 20), 2));
        let faulty = FaultInjecting::with_plan(
            &counting,
            FaultPlan::Nth {
                call: Call::HostAlloc,
                n: 1,
                kind: FaultKind::OutOfMemory,
            },
        );
        assert!(faulty.alloc_host_buffer(4096).is_err());
        assert!(faulty.alloc_host_buffer(4096).unwrap().is_pinned());
        drop((b, c));
        assert_eq!(fake.pinned(), (0, 0));
    }
}

// ---------------------------------------------------------------------------
// Legacy CUDA IPC (`Device::ipc_open` / `ipc_close`, `ipc::OpenedIpcMem`)

/// The consumer's side of [`legacy_ipc_handles_open_in_another_process`]:
/// the handle, in hex.
const LEGACY_HANDLE_ENV: &str = "VMMALLOC_TEST_LEGACY_IPC_HANDLE";
/// Bytes of the shared allocation.
const LEGACY_BYTES: usize = 3 * MIB as usize + 100;

/// The consumer: opens the handle twice (one pointer, two references, as
/// cuda.h says), reads the producer's bytes and writes its own through the
/// CPU (the fake's IPC mappings are host memory, docs/fake-cuda.md), and
/// closes each open once, through a counting adaptor; a third close never
/// reaches the driver.
fn legacy_consumer(fake: &Fake, hex: &str) {
    use vmmalloc_device::adaptors::Counting;
    use vmmalloc_device::ipc::OpenedIpcMem;
    let mut raw = [0u8; 64];
    for (i, b) in raw.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let dev = Counting::counting(fake.open(0));
    let a = OpenedIpcMem::open(&dev, &IpcMemHandle(raw)).unwrap();
    let b = OpenedIpcMem::open(&dev, &IpcMemHandle(raw)).unwrap();
    assert_eq!(a.ptr(), b.ptr(), "the driver counts references");
    let p = std::ptr::with_exposed_provenance_mut::<u8>(a.ptr() as usize);
    // SAFETY: the fake mapped LEGACY_BYTES of host memory at the pointer,
    // open until the closes below; nothing else touches it here.
    let bytes = unsafe { std::slice::from_raw_parts_mut(p, LEGACY_BYTES) };
    assert!(
        bytes == pattern(LEGACY_BYTES, 1).as_slice(),
        "the producer's bytes"
    );
    bytes.copy_from_slice(&pattern(LEGACY_BYTES, 2));
    let ptr = a.ptr();
    a.close(Stream::DEFAULT).unwrap();
    b.close(Stream::DEFAULT).unwrap();
    let counts = dev.hook().counts();
    assert_eq!(
        (counts.get(Call::IpcOpen), counts.get(Call::IpcClose)),
        (2, 2)
    );
    assert_eq!(fake.calls("cuIpcCloseMemHandle"), 2);
    expect_rule(fake, dev.ipc_close(ptr), Rule::UnknownPointer);
    assert_eq!(
        fake.calls("cuIpcCloseMemHandle"),
        2,
        "refused before the driver"
    );
}

/// The `cuda` backend opens a legacy IPC handle of another process's
/// `cuMemAlloc` memory (`cuIpcOpenMemHandle`) and closes it: the producer
/// cannot open its own handle (cuda.h: handles are for "other processes";
/// the fake answers `CUDA_ERROR_INVALID_CONTEXT`), a consumer process can,
/// and sees and changes the same bytes; after the producer frees the memory
/// the handle no longer opens. Other backends refuse both calls.
#[test]
fn legacy_ipc_handles_open_in_another_process() {
    const NAME: &str = "legacy_ipc_handles_open_in_another_process";
    in_child(NAME, &[], |fake| {
        if let Ok(hex) = std::env::var(LEGACY_HANDLE_ENV) {
            return legacy_consumer(fake, &hex);
        }
        let dev = fake.open(0);
        let ptr = dev.alloc(LEGACY_BYTES as u64).unwrap();
        dev.copy_to_device(ptr, &pattern(LEGACY_BYTES, 1)).unwrap();
        let h = {
            let _ctx = dev.enter(Call::IpcOpen).unwrap();
            fake.driver.ipc_get_mem_handle(ptr).unwrap()
        };
        let raw = IpcMemHandle(h.reserved.map(|c| c as u8));
        let e = dev.ipc_open(&raw).unwrap_err();
        assert!(
            matches!(
                e,
                DeviceError::Driver {
                    call: Call::IpcOpen,
                    code: 201,
                    ..
                }
            ),
            "{e:?}"
        );
        let hex: String = raw.0.iter().map(|b| format!("{b:02x}")).collect();
        let consumer = |expect_ok: bool| {
            let out = Command::new(std::env::current_exe().unwrap())
                .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
                .env(LEGACY_HANDLE_ENV, &hex)
                .output()
                .unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(out.status.success(), expect_ok, "consumer:\n{text}");
            text
        };
        consumer(true);
        let mut back = vec![0u8; LEGACY_BYTES];
        dev.copy_from_device(ptr, &mut back).unwrap();
        assert!(
            back == pattern(LEGACY_BYTES, 2),
            "the consumer's write, seen here"
        );
        dev.free(ptr).unwrap();
        let text = consumer(false);
        assert!(text.contains("CUDA_ERROR_INVALID_HANDLE"), "{text}");
        assert_clean(fake, 0);
        // The models hold no cuMemAlloc memory of another process.
        let sim = vmmalloc_device::sim::SimDevice::new(Default::default());
        let e = sim.ipc_open(&raw).unwrap_err();
        assert!(
            matches!(
                e,
                DeviceError::Unsupported {
                    call: Call::IpcOpen,
                    ..
                }
            ),
            "{e}"
        );
        let e = sim.ipc_close(ptr).unwrap_err();
        assert!(
            matches!(
                e,
                DeviceError::Unsupported {
                    call: Call::IpcClose,
                    ..
                }
            ),
            "{e}"
        );
    });
}
