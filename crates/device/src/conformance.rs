//! A conformance suite generic over [`Device`]: one function per scenario.
//!
//! Every scenario takes `&D`, returns `Ok(())` or a description of the first
//! thing that went wrong, and never panics, so the same functions run in
//! `cargo test` on `sim` and `host` and in the `#[ignore]` tests of the `cuda`
//! backend on a real GPU. [`run_all`] runs them all.
//!
//! Everything a scenario creates it gives back, on success and on failure.
//! On devices with a model ([`Device::introspect`]) each scenario also checks
//! the model's invariants and that its live counts return to where they
//! started, and memory figures are compared exactly; on a real GPU, whose free
//! memory moves with other processes and driver overhead, they are compared
//! with a tolerance of a quarter of the bytes involved.

use crate::model::LiveCounts;
use crate::{round_up, Device, DeviceError, DeviceResult, Event, PhysHandle, Stream};

/// The outcome of a scenario: `Err` describes the first failure.
pub type Outcome = Result<(), String>;

/// A scenario: a name and the function that runs it.
pub type Scenario<D> = (&'static str, fn(&D) -> Outcome);

/// Every scenario, in the order [`run_all`] runs them.
pub fn scenarios<D: Device + ?Sized>() -> Vec<Scenario<D>> {
    vec![
        ("caps_sane", caps_sane::<D>),
        ("reserve_free", reserve_free::<D>),
        ("vmm_lifecycle", vmm_lifecycle::<D>),
        ("release_while_mapped", release_while_mapped::<D>),
        ("data_round_trip", data_round_trip::<D>),
        ("export_import", export_import::<D>),
        ("streams_events", streams_events::<D>),
        ("mem_info_accounting", mem_info_accounting::<D>),
        ("oom_create", oom_create::<D>),
        ("plain_alloc_free", plain_alloc_free::<D>),
    ]
}

/// Runs every scenario; the error lists each failed one as `name: what`, one a line.
pub fn run_all<D: Device + ?Sized>(dev: &D) -> Outcome {
    let failures: Vec<String> = scenarios::<D>()
        .into_iter()
        .filter_map(|(name, f)| f(dev).err().map(|e| format!("{name}: {e}")))
        .collect();
    if failures.is_empty() {
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

// ---------------------------------------------------------------------------
// Helpers

fn call<T>(what: &str, r: DeviceResult<T>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

/// Whether memory figures can be compared exactly (a model device).
fn exact<D: Device + ?Sized>(dev: &D) -> bool {
    dev.introspect().is_some()
}

/// Checks that `got` is `want`, exactly on model devices, within `slack` on a real one.
fn near<D: Device + ?Sized>(dev: &D, what: &str, got: u64, want: u64, slack: u64) -> Outcome {
    let slack = if exact(dev) { 0 } else { slack };
    ensure(got.abs_diff(want) <= slack, || {
        format!("{what}: {got} bytes, expected {want} (tolerance {slack})")
    })
}

fn free_bytes<D: Device + ?Sized>(dev: &D) -> Result<u64, String> {
    call("mem_info", dev.mem_info()).map(|m| m.free)
}

/// The model's live counts at the start of a scenario.
struct Baseline(Option<LiveCounts>);

fn baseline<D: Device + ?Sized>(dev: &D) -> Result<Baseline, String> {
    match dev.introspect() {
        None => Ok(Baseline(None)),
        Some(i) => {
            i.check()
                .map_err(|e| format!("model invariant broken before the scenario: {e}"))?;
            Ok(Baseline(Some(i.live())))
        }
    }
}

fn verify<D: Device + ?Sized>(dev: &D, base: &Baseline, when: &str) -> Outcome {
    if let (Some(i), Some(start)) = (dev.introspect(), base.0) {
        i.check()
            .map_err(|e| format!("{when}: model invariant broken: {e}"))?;
        let now = i.live();
        ensure(now == start, || {
            format!("{when}: live objects {now:?}, expected {start:?}")
        })?;
    }
    Ok(())
}

/// A deterministic byte pattern.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// What a scenario holds; given back in reverse order of creation by
/// [`Scope::finish`], or best effort (errors ignored) when dropped early.
struct Scope<'a, D: Device + ?Sized> {
    dev: &'a D,
    reservations: Vec<(u64, u64)>,
    handles: Vec<PhysHandle>,
    mappings: Vec<(u64, u64)>,
    plain: Vec<u64>,
    events: Vec<Event>,
    fds: Vec<i32>,
}

impl<'a, D: Device + ?Sized> Scope<'a, D> {
    fn new(dev: &'a D) -> Self {
        Scope {
            dev,
            reservations: Vec::new(),
            handles: Vec::new(),
            mappings: Vec::new(),
            plain: Vec::new(),
            events: Vec::new(),
            fds: Vec::new(),
        }
    }

    fn reserve(&mut self, size: u64, align: u64) -> Result<u64, String> {
        let a = call(
            &format!("reserve({size:#x}, align {align:#x})"),
            self.dev.reserve(size, align),
        )?;
        self.reservations.push((a, size));
        Ok(a)
    }

    fn free_reservation(&mut self, addr: u64, size: u64) -> Outcome {
        call("free_reservation", self.dev.free_reservation(addr, size))?;
        self.reservations.retain(|r| *r != (addr, size));
        Ok(())
    }

    fn create(&mut self, size: u64) -> Result<PhysHandle, String> {
        let h = call(&format!("create({size:#x})"), self.dev.create(size))?;
        self.handles.push(h);
        Ok(h)
    }

    fn release(&mut self, h: PhysHandle) -> Outcome {
        call("release", self.dev.release(h))?;
        self.handles.retain(|x| *x != h);
        Ok(())
    }

    fn map(&mut self, addr: u64, size: u64, h: PhysHandle) -> Outcome {
        call(
            &format!("map([{addr:#x}, +{size:#x}))"),
            self.dev.map(addr, size, h),
        )?;
        self.mappings.push((addr, size));
        Ok(())
    }

    fn set_access(&mut self, addr: u64, size: u64) -> Outcome {
        call(
            &format!("set_access([{addr:#x}, +{size:#x}))"),
            self.dev.set_access(addr, size),
        )
    }

    /// Unmaps a range covering whole mappings made through this scope.
    fn unmap(&mut self, addr: u64, size: u64) -> Outcome {
        call(
            &format!("unmap([{addr:#x}, +{size:#x}))"),
            self.dev.unmap(addr, size),
        )?;
        self.mappings.retain(|&(a, _)| a < addr || a >= addr + size);
        Ok(())
    }

    fn alloc(&mut self, size: u64) -> Result<u64, String> {
        let p = call(&format!("alloc({size})"), self.dev.alloc(size))?;
        self.plain.push(p);
        Ok(p)
    }

    fn free(&mut self, p: u64) -> Outcome {
        call("free", self.dev.free(p))?;
        self.plain.retain(|x| *x != p);
        Ok(())
    }

    fn event(&mut self) -> Result<Event, String> {
        let e = call("create_event", self.dev.create_event())?;
        self.events.push(e);
        Ok(e)
    }

    fn destroy_event(&mut self, e: Event) -> Outcome {
        call("destroy_event", self.dev.destroy_event(e))?;
        self.events.retain(|x| *x != e);
        Ok(())
    }

    /// Gives everything back; the first error is returned, the rest still done.
    fn finish(mut self) -> Outcome {
        let errs = self.give_back();
        match errs.into_iter().next() {
            Some(e) => Err(format!("cleanup: {e}")),
            None => Ok(()),
        }
    }

    fn give_back(&mut self) -> Vec<String> {
        let dev = self.dev;
        let mut errs = Vec::new();
        let mut note = |what: &str, r: DeviceResult<()>| {
            if let Err(e) = r {
                errs.push(format!("{what}: {e}"));
            }
        };
        if !self.mappings.is_empty() {
            note("synchronize", dev.synchronize());
        }
        for (a, s) in self.mappings.drain(..).rev() {
            note("unmap", dev.unmap(a, s));
        }
        for h in self.handles.drain(..).rev() {
            note("release", dev.release(h));
        }
        for (a, s) in self.reservations.drain(..).rev() {
            note("free_reservation", dev.free_reservation(a, s));
        }
        for p in self.plain.drain(..).rev() {
            note("free", dev.free(p));
        }
        for e in self.events.drain(..).rev() {
            note("destroy_event", dev.destroy_event(e));
        }
        for fd in self.fds.drain(..) {
            close_fd(fd);
        }
        errs
    }
}

impl<D: Device + ?Sized> Drop for Scope<'_, D> {
    fn drop(&mut self) {
        let _ = self.give_back();
    }
}

/// Closes an exported descriptor (the caller owns it, per [`Device::export_fd`]).
/// Errors are ignored: a backend without real descriptors (`sim`) hands out
/// numbers no open descriptor has, and closing one only fails with `EBADF`.
fn close_fd(fd: i32) {
    // SAFETY: the descriptor was returned by `export_fd`, which transfers its
    // ownership to us; nothing else uses it.
    unsafe {
        libc::close(fd);
    }
}

fn expect_err<T>(what: &str, r: DeviceResult<T>) -> Result<DeviceError, String> {
    match r {
        Ok(_) => Err(format!("{what}: succeeded, expected an error")),
        Err(e) => Ok(e),
    }
}

/// A size of `n` granules, at most a quarter of the device (at least one granule).
fn granules<D: Device + ?Sized>(dev: &D, n: u64) -> u64 {
    let g = dev.caps().granularity;
    let quarter = (dev.caps().total_memory / 4) / g * g;
    (n * g).min(quarter).max(g)
}

// ---------------------------------------------------------------------------
// Scenarios

/// Capabilities are sane: a power-of-two granularity, VMM support, memory
/// figures consistent with `mem_info`.
pub fn caps_sane<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let c = dev.caps();
    ensure(!c.name.is_empty(), || "empty device name".into())?;
    ensure(c.granularity.is_power_of_two(), || {
        format!("granularity {:#x} is not a power of two", c.granularity)
    })?;
    ensure(c.vmm_supported, || {
        "device does not support the virtual-memory API".into()
    })?;
    ensure(c.total_memory >= c.granularity, || {
        format!("total memory {} is below one granule", c.total_memory)
    })?;
    let m = call("mem_info", dev.mem_info())?;
    ensure(m.free <= m.total, || {
        format!("mem_info free {} > total {}", m.free, m.total)
    })?;
    // A model reports exactly its capacity; a driver never more than the device has.
    let total_ok = if exact(dev) {
        m.total == c.total_memory
    } else {
        m.total <= c.total_memory
    };
    ensure(total_ok, || {
        format!("mem_info total {} but caps say {}", m.total, c.total_memory)
    })?;
    verify(dev, &base, "end")
}

/// Reserve and free virtual ranges: aligned as asked, disjoint, larger than
/// physical memory if need be.
pub fn reserve_free<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let g = dev.caps().granularity;
    let mut sc = Scope::new(dev);
    let a = sc.reserve(g, 0)?;
    ensure(a != 0 && a % g == 0, || {
        format!("reserve returned {a:#x}, not granule-aligned")
    })?;
    let b = sc.reserve(4 * g, 4 * g)?;
    ensure(b % (4 * g) == 0, || {
        format!("reserve(align {:#x}) returned {b:#x}", 4 * g)
    })?;
    ensure(a + g <= b || b + 4 * g <= a, || {
        format!("reservations {a:#x} and {b:#x} overlap")
    })?;
    // More address space than physical memory (PyTorch reserves 1.125 x).
    let big = round_up(dev.caps().total_memory + dev.caps().total_memory / 8, g);
    let c = sc.reserve(big, 0)?;
    ensure(c + big <= a || a + g <= c, || {
        "the large reservation overlaps".into()
    })?;
    if let Some(i) = dev.introspect() {
        let n = i.live().reservations;
        ensure(n == base.0.map_or(0, |l| l.reservations) + 3, || {
            format!("{n} live reservations")
        })?;
    }
    sc.free_reservation(c, big)?;
    sc.free_reservation(b, 4 * g)?;
    sc.free_reservation(a, g)?;
    sc.finish()?;
    verify(dev, &base, "end")
}

/// The whole lifecycle: create, map, set access (one call over two mappings),
/// unmap (one call over both), release, free.
pub fn vmm_lifecycle<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let g = dev.caps().granularity;
    let mut sc = Scope::new(dev);
    let va = sc.reserve(4 * g, 0)?;
    let h1 = sc.create(g)?;
    let h2 = sc.create(2 * g)?;
    ensure(h1 != h2, || "two creates returned the same handle".into())?;
    sc.map(va, g, h1)?;
    sc.map(va + g, 2 * g, h2)?;
    if let Some(i) = dev.introspect() {
        ensure(!i.is_accessible(va, g), || {
            "mapped memory accessible before set_access".into()
        })?;
    }
    sc.set_access(va, 3 * g)?;
    if let Some(i) = dev.introspect() {
        ensure(i.is_accessible(va, 3 * g), || {
            "set_access did not make the range accessible".into()
        })?;
        ensure(!i.is_accessible(va + 3 * g, g), || {
            "unmapped tail is accessible".into()
        })?;
        let l = i.live();
        let start = base.0.unwrap_or_default();
        ensure(
            l.mappings == start.mappings + 2 && l.handles == start.handles + 2,
            || format!("live {l:?} after two maps"),
        )?;
    }
    sc.unmap(va, 3 * g)?;
    if let Some(i) = dev.introspect() {
        ensure(!i.is_accessible(va, g), || {
            "unmapped memory is accessible".into()
        })?;
    }
    // The handles survive unmap and map again.
    sc.map(va + 2 * g, g, h1)?;
    sc.set_access(va + 2 * g, g)?;
    sc.unmap(va + 2 * g, g)?;
    sc.release(h2)?;
    sc.release(h1)?;
    sc.free_reservation(va, 4 * g)?;
    sc.finish()?;
    verify(dev, &base, "end")
}

/// `cuMemRelease` of a mapped handle succeeds; the mapping stays usable until unmapped.
pub fn release_while_mapped<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let g = dev.caps().granularity;
    let mut sc = Scope::new(dev);
    let va = sc.reserve(2 * g, 0)?;
    let h = sc.create(2 * g)?;
    sc.map(va, 2 * g, h)?;
    sc.set_access(va, 2 * g)?;
    sc.release(h)?;
    if let Some(i) = dev.introspect() {
        ensure(i.is_accessible(va, 2 * g), || {
            "a released but mapped handle became inaccessible".into()
        })?;
    }
    if dev.caps().has_memory {
        let data = pattern(7, 4096);
        call(
            "copy_to_device after release",
            dev.copy_to_device(va + g, &data),
        )?;
        let mut back = vec![0u8; data.len()];
        call(
            "copy_from_device after release",
            dev.copy_from_device(va + g, &mut back),
        )?;
        ensure(back == data, || {
            "bytes changed after release of the mapped handle".into()
        })?;
    }
    sc.unmap(va, 2 * g)?;
    sc.free_reservation(va, 2 * g)?;
    sc.finish()?;
    verify(dev, &base, "end")
}

/// Bytes survive unmap and a map of the same handle at another address
/// (devices with memory); a device without memory refuses copies.
pub fn data_round_trip<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let g = dev.caps().granularity;
    let mut sc = Scope::new(dev);
    let a = sc.reserve(2 * g, 0)?;
    let b = sc.reserve(4 * g, 0)?;
    let h = sc.create(2 * g)?;
    sc.map(a, 2 * g, h)?;
    sc.set_access(a, 2 * g)?;
    let len = usize::try_from(2 * g).map_err(|e| e.to_string())?;
    let data = pattern(g, len);
    if !dev.caps().has_memory {
        expect_err(
            "copy_to_device on a device without memory",
            dev.copy_to_device(a, &data[..64]),
        )?;
        sc.finish()?;
        return verify(dev, &base, "end");
    }
    call("copy_to_device", dev.copy_to_device(a, &data))?;
    let mut back = vec![0u8; len];
    call("copy_from_device", dev.copy_from_device(a, &mut back))?;
    ensure(back == data, || {
        "bytes read back differ from bytes written".into()
    })?;
    sc.unmap(a, 2 * g)?;
    // Elsewhere, at an offset inside a larger reservation.
    sc.map(b + g, 2 * g, h)?;
    sc.set_access(b + g, 2 * g)?;
    let mut again = vec![0u8; len];
    call(
        "copy_from_device after remap",
        dev.copy_from_device(b + g, &mut again),
    )?;
    ensure(again == data, || {
        "bytes lost across unmap and map elsewhere".into()
    })?;
    // A copy straddling the two granules of the mapping.
    let patch = pattern(3, 128);
    call(
        "copy_to_device across granules",
        dev.copy_to_device(b + g + g - 64, &patch),
    )?;
    let mut small = vec![0u8; 128];
    call(
        "copy_from_device across granules",
        dev.copy_from_device(b + 2 * g - 64, &mut small),
    )?;
    ensure(small == patch, || {
        "bytes across the granule boundary differ".into()
    })?;
    sc.unmap(b + g, 2 * g)?;
    sc.release(h)?;
    sc.free_reservation(b, 4 * g)?;
    sc.free_reservation(a, 2 * g)?;
    sc.finish()?;
    verify(dev, &base, "end")
}

/// Export a handle as a descriptor and import it back: a new handle to the
/// same memory (bytes shared on devices with memory; no new physical memory).
pub fn export_import<D: Device + ?Sized>(dev: &D) -> Outcome {
    if !dev.caps().posix_fd_handles {
        return Ok(());
    }
    let base = baseline(dev)?;
    let g = dev.caps().granularity;
    let mut sc = Scope::new(dev);
    let h = sc.create(g)?;
    let free_created = free_bytes(dev)?;
    let fd = call("export_fd", dev.export_fd(h))?;
    sc.fds.push(fd);
    let h2 = call("import_fd", dev.import_fd(fd))?;
    sc.handles.push(h2);
    ensure(h2 != h, || {
        "import returned the exported handle itself".into()
    })?;
    near(
        dev,
        "free after import",
        free_bytes(dev)?,
        free_created,
        g / 4,
    )?;
    if let Some(i) = dev.introspect() {
        let start = base.0.unwrap_or_default();
        let l = i.live();
        ensure(
            l.handles == start.handles + 2 && l.physical_bytes == start.physical_bytes + g,
            || format!("live {l:?} after import (one allocation, two handles)"),
        )?;
    }
    let va = sc.reserve(2 * g, 0)?;
    sc.map(va, g, h)?;
    sc.map(va + g, g, h2)?;
    sc.set_access(va, 2 * g)?;
    if dev.caps().has_memory {
        let data = pattern(11, 1000);
        call("copy_to_device", dev.copy_to_device(va + 24, &data))?;
        let mut back = vec![0u8; data.len()];
        call(
            "copy_from_device through the imported handle",
            dev.copy_from_device(va + g + 24, &mut back),
        )?;
        ensure(back == data, || {
            "the imported handle does not share the exported memory".into()
        })?;
    }
    sc.unmap(va, 2 * g)?;
    sc.release(h)?;
    // The imported handle still holds the memory.
    near(
        dev,
        "free after releasing one of two handles",
        free_bytes(dev)?,
        free_created,
        g / 4,
    )?;
    sc.release(h2)?;
    sc.free_reservation(va, 2 * g)?;
    sc.finish()?;
    verify(dev, &base, "end")
}

/// Streams and events: a fresh stream records, queries and synchronizes; an
/// event never recorded, or recorded on an idle stream, is complete.
pub fn streams_events<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let mut sc = Scope::new(dev);
    let s = call("create_stream", dev.create_stream())?;
    let s2 = call("create_stream", dev.create_stream())?;
    ensure(s != s2, || format!("two streams are both {s}"))?;
    let e = sc.event()?;
    ensure(
        call("query_event (never recorded)", dev.query_event(e))?,
        || "an event never recorded is not complete".into(),
    )?;
    call("record_event", dev.record_event(e, s))?;
    call("synchronize_stream", dev.synchronize_stream(s))?;
    ensure(call("query_event", dev.query_event(e))?, || {
        "an event recorded on an idle, synchronized stream is not complete".into()
    })?;
    call(
        "record_event on the default stream",
        dev.record_event(e, Stream::DEFAULT),
    )?;
    call("synchronize_event", dev.synchronize_event(e))?;
    ensure(call("query_event", dev.query_event(e))?, || {
        "event incomplete after its synchronize".into()
    })?;
    if let Some(i) = dev.introspect() {
        // Queued work keeps a later event pending until it is waited for.
        call("submit", i.streams().submit(s2, 0, 0))?;
        call("record_event", dev.record_event(e, s2))?;
        ensure(!call("query_event", dev.query_event(e))?, || {
            "event complete while work before it is queued".into()
        })?;
        call("synchronize_event", dev.synchronize_event(e))?;
        ensure(call("query_event", dev.query_event(e))?, || {
            "event incomplete after its synchronize".into()
        })?;
        ensure(i.streams().pending_items(s2) == 0, || {
            "work still pending after the event".into()
        })?;
    }
    let e2 = sc.event()?;
    call("record_event", dev.record_event(e2, s2))?;
    call("synchronize", dev.synchronize())?;
    ensure(call("query_event", dev.query_event(e2))?, || {
        "event incomplete after a device sync".into()
    })?;
    sc.destroy_event(e2)?;
    sc.destroy_event(e)?;
    sc.finish()?;
    verify(dev, &base, "end")
}

/// `mem_info` accounting: free drops by the bytes created, stays down while a
/// released handle is still mapped, and comes back after the unmap.
pub fn mem_info_accounting<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let size = granules(dev, 64);
    let slack = size / 4;
    let mut sc = Scope::new(dev);
    let before = free_bytes(dev)?;
    let h = sc.create(size)?;
    near(
        dev,
        "free after create",
        free_bytes(dev)?,
        before.saturating_sub(size),
        slack,
    )?;
    let va = sc.reserve(size, 0)?;
    sc.map(va, size, h)?;
    sc.set_access(va, size)?;
    sc.release(h)?;
    near(
        dev,
        "free after release of a mapped handle",
        free_bytes(dev)?,
        before.saturating_sub(size),
        slack,
    )?;
    sc.unmap(va, size)?;
    near(
        dev,
        "free after unmap of the released handle",
        free_bytes(dev)?,
        before,
        slack,
    )?;
    sc.free_reservation(va, size)?;
    sc.finish()?;
    verify(dev, &base, "end")
}

/// A create larger than free memory fails with out-of-memory, changes
/// nothing, and the device still creates afterwards (recoverable).
pub fn oom_create<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let g = dev.caps().granularity;
    let info = call("mem_info", dev.mem_info())?;
    let too_big = round_up(info.total.max(info.free), g) + g;
    match dev.create(too_big) {
        Ok(h) => {
            let _ = dev.release(h);
            return Err(format!(
                "create({too_big:#x}) beyond {} free bytes succeeded",
                info.free
            ));
        }
        Err(e) => ensure(e.is_out_of_memory() && e.cuda_code() == 2, || {
            format!(
                "create beyond free memory: expected out-of-memory (2), got {e} (code {})",
                e.cuda_code()
            )
        })?,
    }
    verify(dev, &base, "after the failed create")?;
    near(
        dev,
        "free after a failed create",
        free_bytes(dev)?,
        info.free,
        granules(dev, 64) / 4,
    )?;
    let mut sc = Scope::new(dev);
    let h = sc.create(g)?;
    sc.release(h)?;
    sc.finish()?;
    verify(dev, &base, "end")
}

/// Plain allocations: allocate odd sizes, use them (devices with memory),
/// free them; a second free of the same pointer is an error.
pub fn plain_alloc_free<D: Device + ?Sized>(dev: &D) -> Outcome {
    let base = baseline(dev)?;
    let g = dev.caps().granularity;
    let mut sc = Scope::new(dev);
    let before = free_bytes(dev)?;
    let p = sc.alloc(1000)?;
    ensure(p != 0, || "alloc returned a null pointer".into())?;
    let q = sc.alloc(3 * g + 1)?;
    ensure(q + 3 * g < p || p + 1000 <= q, || {
        format!("allocations {p:#x} and {q:#x} overlap")
    })?;
    if exact(dev) {
        let after = free_bytes(dev)?;
        ensure(after + 1000 + 3 * g < before, || {
            format!("free {after} after allocating from {before}")
        })?;
    }
    if let Some(i) = dev.introspect() {
        ensure(
            i.is_accessible(p, 1000) && i.is_accessible(q, 3 * g + 1),
            || "plain allocations are not accessible".into(),
        )?;
    }
    if dev.caps().has_memory {
        let data = pattern(5, 1000);
        call("copy_to_device", dev.copy_to_device(p, &data))?;
        let mut back = vec![0u8; 1000];
        call("copy_from_device", dev.copy_from_device(p, &mut back))?;
        ensure(back == data, || "plain allocation bytes differ".into())?;
    }
    sc.free(q)?;
    sc.free(p)?;
    expect_err("second free of the same pointer", dev.free(p))?;
    near(
        dev,
        "free after freeing everything",
        free_bytes(dev)?,
        before,
        4 * g,
    )?;
    sc.finish()?;
    verify(dev, &base, "end")
}
