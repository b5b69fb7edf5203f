//! The `host` backend on real memory: bytes survive unmap and remap, the
//! process's mappings are exactly what the model says, and nothing leaks.
//!
//! Tests here count this process's descriptors and read its memory map, so
//! they run one at a time (`serial()`).

use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;
use vmmalloc_device::host::{HostConfig, HostDevice};
use vmmalloc_device::{Call, Device, DeviceError, Introspect, Rule, GIB, MIB};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock()
}

const G: u64 = 2 * MIB;

fn host(capacity: u64) -> HostDevice {
    HostDevice::with_capacity(capacity).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The permissions and path of the process mapping that holds `addr`, if any.
fn vma(addr: u64) -> Option<(String, String)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        let range = parts.next()?;
        let perms = parts.next()?.to_string();
        let path = parts.nth(3).unwrap_or("").to_string();
        let (lo, hi) = range.split_once('-')?;
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).ok()?,
            u64::from_str_radix(hi, 16).ok()?,
        );
        (lo <= addr && addr < hi).then_some((perms, path))
    })
}

fn memfd_lines(name: &str) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.contains(&format!("/memfd:{name}")))
        .count()
}

#[test]
fn data_survives_unmap_and_map_elsewhere_and_through_an_imported_handle() {
    let _s = serial();
    let d = host(64 * MIB);
    let a = d.reserve(2 * G, 0).unwrap();
    let b = d.reserve(6 * G, 0).unwrap();
    let h = d.create(2 * G).unwrap();
    d.map(a, 2 * G, h).unwrap();
    d.set_access(a, 2 * G).unwrap();
    let data = pattern(1, (2 * G) as usize);
    d.copy_to_device(a, &data).unwrap();
    d.unmap(a, 2 * G).unwrap();

    // Same handle, another reservation, another offset.
    d.map(b + 3 * G, 2 * G, h).unwrap();
    d.set_access(b + 3 * G, 2 * G).unwrap();
    let mut back = vec![0u8; data.len()];
    d.copy_from_device(b + 3 * G, &mut back).unwrap();
    assert!(back == data, "bytes lost across unmap / map elsewhere");

    // Through an imported handle, after the original is released and unmapped.
    let fd = d.export_fd(h).unwrap();
    let h2 = d.import_fd(fd).unwrap();
    // SAFETY: we own the exported descriptor; the imported handle has its own.
    unsafe { libc::close(fd) };
    d.unmap(b + 3 * G, 2 * G).unwrap();
    d.release(h).unwrap();
    d.map(a, 2 * G, h2).unwrap();
    d.set_access(a, 2 * G).unwrap();
    let mut again = vec![0u8; data.len()];
    d.copy_from_device(a, &mut again).unwrap();
    assert!(again == data, "bytes lost through the imported handle");
    // Writes through one view are seen through another of the same memory.
    let fd2 = d.export_fd(h2).unwrap();
    let h3 = d.import_fd(fd2).unwrap();
    // SAFETY: we own the exported descriptor.
    unsafe { libc::close(fd2) };
    d.map(b, 2 * G, h3).unwrap();
    d.set_access(b, 2 * G).unwrap();
    d.copy_to_device(b + 5, b"shared").unwrap();
    let mut six = [0u8; 6];
    d.copy_from_device(a + 5, &mut six).unwrap();
    assert_eq!(&six, b"shared");
    d.unmap(a, 2 * G).unwrap();
    d.unmap(b, 2 * G).unwrap();
    d.release(h2).unwrap();
    d.release(h3).unwrap();
    d.free_reservation(a, 2 * G).unwrap();
    d.free_reservation(b, 6 * G).unwrap();
    d.check().unwrap();
    assert!(d.live().is_empty());
}

#[test]
fn the_process_memory_map_is_what_the_model_says() {
    let _s = serial();
    let d = host(64 * MIB);
    let name = d.memfd_name().to_string();
    let va = d.reserve(4 * G, 0).unwrap();
    let (perms, path) = vma(va).unwrap();
    assert_eq!((perms.as_str(), path.as_str()), ("---p", ""), "reservation");
    let h = d.create(2 * G).unwrap();
    d.map(va + G, 2 * G, h).unwrap();
    let (perms, path) = vma(va + G).unwrap();
    assert_eq!(perms, "---s", "mapped but not yet accessible");
    assert!(path.contains(&name), "{path}");
    d.set_access(va + G, 2 * G).unwrap();
    assert_eq!(vma(va + 2 * G).unwrap().0, "rw-s");
    assert_eq!(
        vma(va).unwrap().0,
        "---p",
        "the unmapped head stays inaccessible"
    );
    assert_eq!(
        vma(va + 3 * G).unwrap().0,
        "---p",
        "the unmapped tail stays inaccessible"
    );
    d.unmap(va + G, 2 * G).unwrap();
    let (perms, path) = vma(va + G).unwrap();
    assert_eq!((perms.as_str(), path.as_str()), ("---p", ""), "after unmap");
    assert_eq!(memfd_lines(&name), 0);
    d.release(h).unwrap();
    d.free_reservation(va, 4 * G).unwrap();
    assert!(vma(va).is_none_or(|(_, p)| !p.contains(&name)));
}

#[test]
fn reading_unmapped_or_not_yet_accessible_memory_is_refused() {
    let _s = serial();
    let d = host(64 * MIB);
    let va = d.reserve(2 * G, 0).unwrap();
    let mut buf = [0u8; 8];
    let refused = |r: Result<(), DeviceError>| {
        let e = r.unwrap_err();
        assert_eq!(e.broken_rule(), Some(Rule::NotAccessible), "{e}");
        assert_eq!(e.cuda_code(), 700);
    };
    // Reserved, never mapped.
    refused(d.copy_from_device(va, &mut buf));
    let h = d.create(G).unwrap();
    d.map(va, G, h).unwrap();
    // Mapped, not yet accessible.
    refused(d.copy_from_device(va, &mut buf));
    refused(d.copy_to_device(va, &buf));
    d.set_access(va, G).unwrap();
    d.copy_to_device(va, b"12345678").unwrap();
    // Running off the end of the mapping.
    refused(d.copy_from_device(va + G - 4, &mut buf));
    d.unmap(va, G).unwrap();
    // Unmapped again.
    refused(d.copy_from_device(va, &mut buf));
    // Not device memory at all.
    refused(d.copy_from_device(buf.as_ptr() as u64, &mut [0u8; 4]));
    refused(d.copy_from_device(0, &mut buf));
    d.release(h).unwrap();
    d.free_reservation(va, 2 * G).unwrap();
}

#[test]
fn create_beyond_capacity_is_out_of_memory_and_opens_no_descriptor() {
    let _s = serial();
    let d = host(8 * MIB);
    let fds = open_fds();
    let e = d.create(10 * MIB).unwrap_err();
    assert!(e.is_out_of_memory() && e.cuda_code() == 2, "{e}");
    assert_eq!(open_fds(), fds);
    let a = d.create(6 * MIB).unwrap();
    assert!(d.create(4 * MIB).unwrap_err().is_out_of_memory());
    assert!(d.alloc(3 * MIB).unwrap_err().is_out_of_memory());
    d.release(a).unwrap();
    let b = d.create(8 * MIB).unwrap();
    d.release(b).unwrap();
    assert_eq!(open_fds(), fds);
}

#[test]
fn capacity_is_bookkeeping_pages_are_committed_only_when_touched() {
    let _s = serial();
    let d = host(64 * GIB);
    let size = 16 * GIB;
    let va = d.reserve(size, 0).unwrap();
    let h = d.create(size).unwrap();
    d.map(va, size, h).unwrap();
    d.set_access(va, size).unwrap();
    d.copy_to_device(va, b"first").unwrap();
    d.copy_to_device(va + size - 4, b"last").unwrap();
    let mut b = [0u8; 4];
    d.copy_from_device(va + size - 4, &mut b).unwrap();
    assert_eq!(&b, b"last");
    d.unmap(va, size).unwrap();
    d.release(h).unwrap();
    d.free_reservation(va, size).unwrap();
}

#[test]
fn no_descriptor_or_mapping_leaks_across_a_workload() {
    let _s = serial();
    let d = host(64 * MIB);
    let name = d.memfd_name().to_string();
    let fds = open_fds();
    for round in 0..3 {
        let va = d.reserve(8 * G, 0).unwrap();
        let hs: Vec<_> = (0..4).map(|_| d.create(G).unwrap()).collect();
        for (i, h) in hs.iter().enumerate() {
            d.map(va + 2 * i as u64 * G, G, *h).unwrap();
        }
        let fd = d.export_fd(hs[0]).unwrap();
        let imported = d.import_fd(fd).unwrap();
        // SAFETY: we own the exported descriptor.
        unsafe { libc::close(fd) };
        d.set_access(va, G).unwrap();
        let p = d.alloc(12345 + round).unwrap();
        d.copy_to_device(p, &[7u8; 100]).unwrap();
        assert!(open_fds() > fds);
        // Release first (mappings keep the memory), then unmap.
        for h in &hs {
            d.release(*h).unwrap();
        }
        d.release(imported).unwrap();
        assert_eq!(open_fds(), fds, "released handles still hold descriptors");
        for i in 0..4 {
            d.unmap(va + 2 * i * G, G).unwrap();
        }
        d.free(p).unwrap();
        d.free_reservation(va, 8 * G).unwrap();
    }
    assert_eq!(open_fds(), fds);
    assert_eq!(memfd_lines(&name), 0);
    assert!(d.live().is_empty());
    d.check().unwrap();
}

#[test]
fn drop_gives_back_everything_still_live() {
    let _s = serial();
    let fds = open_fds();
    let d = HostDevice::new(HostConfig {
        name: "drop-test".into(),
        ..HostConfig::with_capacity(64 * MIB)
    })
    .unwrap();
    let name = d.memfd_name().to_string();
    let va = d.reserve(4 * G, 0).unwrap();
    let h1 = d.create(G).unwrap();
    let h2 = d.create(G).unwrap();
    let _h3 = d.create(G).unwrap();
    d.map(va, G, h1).unwrap();
    d.map(va + G, G, h2).unwrap();
    d.set_access(va, 2 * G).unwrap();
    d.release(h2).unwrap();
    let p = d.alloc(5000).unwrap();
    assert!(open_fds() >= fds + 2);
    assert_eq!(memfd_lines(&name), 2);
    assert!(vma(p).is_some());
    drop(d);
    assert_eq!(open_fds(), fds, "descriptors left after drop");
    assert_eq!(memfd_lines(&name), 0, "memfd mappings left after drop");
    for addr in [va, va + G, va + 3 * G] {
        assert!(
            vma(addr).is_none_or(|(perms, _)| perms != "---p" && perms != "rw-s"),
            "{addr:#x}"
        );
    }
}

#[test]
fn counts_calls_per_kind() {
    let _s = serial();
    let d = host(64 * MIB);
    let va = d.reserve(2 * G, 0).unwrap();
    let h = d.create(G).unwrap();
    assert!(d.map(va + G / 2, G, h).is_err());
    d.map(va, G, h).unwrap();
    d.set_access(va, G).unwrap();
    d.unmap(va, G).unwrap();
    d.release(h).unwrap();
    d.free_reservation(va, 2 * G).unwrap();
    let c = d.counts();
    assert_eq!(c.get(Call::Map), 2, "failed calls are counted too");
    for call in [
        Call::Reserve,
        Call::Create,
        Call::SetAccess,
        Call::Unmap,
        Call::Release,
        Call::AddressFree,
    ] {
        assert_eq!(c.get(call), 1, "{call}");
    }
    assert_eq!(c.total(), 8);
    d.reset_counters();
    assert_eq!(d.counts().total(), 0);
}

#[test]
fn threads_map_write_and_unmap_concurrently() {
    let _s = serial();
    let d = Arc::new(
        HostDevice::new(HostConfig::with_capacity(64 * MIB).granularity(64 * 1024)).unwrap(),
    );
    let g = d.caps().granularity;
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let d = Arc::clone(&d);
            std::thread::spawn(move || {
                let va = d.reserve(8 * g, 0).unwrap();
                for i in 0..32u64 {
                    let h = d.create(2 * g).unwrap();
                    let at = va + (i % 4) * 2 * g;
                    d.map(at, 2 * g, h).unwrap();
                    d.set_access(at, 2 * g).unwrap();
                    let data = pattern(t.wrapping_mul(17).wrapping_add(i as u8), 4096);
                    d.copy_to_device(at + g - 100, &data).unwrap();
                    let mut back = vec![0u8; data.len()];
                    d.copy_from_device(at + g - 100, &mut back).unwrap();
                    assert!(back == data);
                    d.unmap(at, 2 * g).unwrap();
                    d.release(h).unwrap();
                }
                d.free_reservation(va, 8 * g).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    d.check().unwrap();
    assert!(d.live().is_empty());
}
