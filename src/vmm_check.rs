//! `vmmalloc vmm-check`: the smallest use of the CUDA virtual memory
//! management API on one device — reserve → create → map → set access →
//! write/read → unmap → release → free the reservation — each call reported
//! on its own line, then one verdict line that says whether this environment
//! (driver, container, sandbox such as gVisor) supports the VMM API at all.
//!
//! It is step 0 of `scripts/gpu-check.sh`: a box that fails it cannot run any
//! other GPU step of vmmalloc, and the failing call and the driver's error
//! say why. The sequence is the one the CUDA Programming Guide gives for the
//! VMM API ("Virtual Memory Management": `cuMemAddressReserve`,
//! `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, then `cuMemUnmap`,
//! `cuMemRelease`, `cuMemAddressFree`), through the `cuda` backend unchanged.
//! What was done before a failing call is undone (best effort) before exit.

use anyhow::{bail, Result};
use vmmalloc_device::cuda::CudaDevice;
use vmmalloc_device::{Device, PhysHandle};

/// Arguments of `vmmalloc vmm-check`.
#[derive(clap::Args, Debug)]
pub struct VmmCheckArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = crate::whole_number::<u32>)]
    pub device: u32,
    /// Granularity pages to reserve, create and map (at least 1).
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = crate::whole_number::<u64>)]
    pub pages: u64,
}

/// What has been done so far, to undo on failure.
#[derive(Default)]
struct Undo {
    reservation: Option<(u64, u64)>,
    handle: Option<PhysHandle>,
    mapped: Option<(u64, u64)>,
}

impl Undo {
    /// Best-effort rollback in reverse order (errors ignored: the first
    /// failure is the one reported).
    fn run(&mut self, d: &CudaDevice) {
        if let Some((a, s)) = self.mapped.take() {
            let _ = d.unmap(a, s);
        }
        if let Some(h) = self.handle.take() {
            let _ = d.release(h);
        }
        if let Some((a, s)) = self.reservation.take() {
            let _ = d.free_reservation(a, s);
        }
    }
}

/// Prints `step: ok` or `step: FAILED: err` and turns the error into a
/// verdict naming the step.
fn step<T, E: std::fmt::Display>(name: &str, r: Result<T, E>) -> Result<T, String> {
    match r {
        Ok(v) => {
            println!("  {name}: ok");
            Ok(v)
        }
        Err(e) => {
            print!(
                "{}",
                crate::compare::wrap_hanging(&format!("{name}: FAILED: {e}"), 2, 4)
            );
            Err(format!("{name} failed: {e}"))
        }
    }
}

/// Runs `vmmalloc vmm-check`. Exit status 0 when the whole sequence worked,
/// 1 (after the verdict line, printed last) when it did not.
pub fn run(args: VmmCheckArgs) -> Result<()> {
    if args.pages == 0 {
        bail!("--pages must be at least 1");
    }
    let dev = args.device;
    println!("VMM check on CUDA device {dev}:");
    let d = match step(
        "open device (cuInit, primary context)",
        CudaDevice::open(dev),
    ) {
        Ok(d) => d,
        Err(why) => {
            println!("VMM API: NOT usable here: {why}");
            // The verdict is the last line printed (scripts/gpu-check.sh quotes it).
            std::process::exit(1);
        }
    };
    let mut undo = Undo::default();
    let verdict = sequence(&d, args.pages, &mut undo);
    undo.run(&d);
    let caps = d.caps();
    match verdict {
        Ok(()) => {
            println!(
                "VMM API: supported on device {dev} ({}, granularity {} KiB)",
                caps.name,
                caps.granularity / 1024
            );
            Ok(())
        }
        Err(why) => {
            println!(
                "VMM API: NOT supported on device {dev} ({}): {why}",
                caps.name
            );
            std::process::exit(1);
        }
    }
}

/// The sequence itself; fills `undo` as it goes.
fn sequence(d: &CudaDevice, pages: u64, undo: &mut Undo) -> Result<(), String> {
    let caps = d.caps();
    if !caps.vmm_supported {
        println!("  device attribute VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 0");
        return Err("the driver reports no VMM support on this device \
                    (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0)"
            .into());
    }
    let g = caps.granularity;
    let size = g * pages;
    let base = step("reserve (cuMemAddressReserve)", d.reserve(size, 0))?;
    undo.reservation = Some((base, size));
    let handle = step("create (cuMemCreate)", d.create(size))?;
    undo.handle = Some(handle);
    step("map (cuMemMap)", d.map(base, size, handle))?;
    undo.mapped = Some((base, size));
    step("set access (cuMemSetAccess)", d.set_access(base, size))?;
    // A pattern that differs per byte and per page, written and read back.
    let data: Vec<u8> = (0..size as usize)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8)
        .collect();
    step("write (cuMemcpyHtoD)", d.copy_to_device(base, &data))?;
    let mut back = vec![0u8; data.len()];
    step("read (cuMemcpyDtoH)", d.copy_from_device(base, &mut back))?;
    if back != data {
        println!("  compare: FAILED: the bytes read back differ from those written");
        return Err("the bytes read back differ from those written".into());
    }
    println!("  compare: ok ({size} bytes)");
    undo.mapped = None;
    step("unmap (cuMemUnmap)", d.unmap(base, size))?;
    undo.handle = None;
    step("release (cuMemRelease)", d.release(handle))?;
    undo.reservation = None;
    step(
        "free reservation (cuMemAddressFree)",
        d.free_reservation(base, size),
    )?;
    Ok(())
}
