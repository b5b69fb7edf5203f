//! Memory another process shared, opened in this one: what an IPC consumer
//! needs from a device, with each driver object released exactly once.
//!
//! - [`MappedImport`]: exported physical handles (POSIX file descriptors,
//!   `cuMemExportToShareableHandle` on the producer's side) imported with
//!   [`Device::import_fd`] (`cuMemImportFromShareableHandle`), mapped in
//!   order into a fresh reservation ([`Device::reserve`], [`Device::map`])
//!   and made accessible to this device ([`Device::set_access`]). A failed
//!   step rolls back every earlier one. Closing unmaps, releases the
//!   imported handles and frees the reservation; the physical memory stays
//!   alive while the producer (or another importer) still holds a handle to
//!   it ("the memory is only freed once all handles are released", CUDA
//!   Driver API, `cuMemRelease`).
//! - [`OpenedIpcMem`]: a legacy `cudaIpcMemHandle_t` of another process's
//!   `cuMemAlloc` memory, opened with [`Device::ipc_open`]
//!   (`cuIpcOpenMemHandle`) and closed with [`Device::ipc_close`].
//!
//! Both close only after the work queued on a stream is done
//! ([`wait_for_stream`]): unmapping memory that queued work still uses is
//! undefined behaviour (CUDA Driver API, `cuMemUnmap`). Dropping one that
//! was not closed waits for the whole device first, then closes it, and
//! reports a failure on stderr (a destructor cannot return it).
//!
//! The calls go through the device they were given, so an adaptor around it
//! (counting, fault injection) sees each one.

use crate::{Device, DeviceError, IpcMemHandle, PhysHandle, Stream};
use std::fmt;

/// The step of an import that failed ([`ImportError`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportStep {
    /// Reserving the address range (`cuMemAddressReserve`).
    Reserve,
    /// Importing chunk `index` (`cuMemImportFromShareableHandle`).
    Import {
        /// The chunk's position in the list.
        index: usize,
    },
    /// Mapping chunk `index` (`cuMemMap`).
    Map {
        /// The chunk's position in the list.
        index: usize,
    },
    /// Granting this device access to the whole range (`cuMemSetAccess`).
    SetAccess,
}

/// An import that failed, rolled back: the step, its error, and any failure
/// while undoing the earlier steps (a rollback that failed may leave the
/// objects it names behind).
#[derive(Debug, Clone, PartialEq)]
pub struct ImportError {
    /// The step that failed.
    pub step: ImportStep,
    /// Bytes of the step: the whole range (reserve, access), or the chunk.
    pub bytes: u64,
    /// Why it failed.
    pub error: DeviceError,
    /// Failures while rolling back (empty: nothing is left behind).
    pub rollback: Vec<DeviceError>,
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (bytes, e) = (self.bytes, &self.error);
        match self.step {
            ImportStep::Reserve => write!(f, "reserving {bytes:#x} bytes for the import: {e}")?,
            ImportStep::Import { index } => {
                write!(f, "importing chunk {index} ({bytes:#x} bytes): {e}")?
            }
            ImportStep::Map { index } => {
                write!(f, "mapping imported chunk {index} ({bytes:#x} bytes): {e}")?
            }
            ImportStep::SetAccess => write!(f, "granting access to the import: {e}")?,
        }
        for r in &self.rollback {
            write!(f, "; rolling back: {r}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ImportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// One failure while closing ([`CloseError`]).
#[derive(Debug, Clone, PartialEq)]
pub enum CloseFailure {
    /// Waiting for the stream failed, and so did the device-wide wait that
    /// replaced it (the memory was closed all the same).
    Wait {
        /// The stream waited for.
        stream: Stream,
        /// Why the event on the stream failed.
        on_stream: DeviceError,
        /// Why the device-wide synchronize failed.
        on_device: DeviceError,
    },
    /// `cuMemUnmap` of the range.
    Unmap(DeviceError),
    /// `cuMemRelease` of an imported handle.
    Release(DeviceError),
    /// `cuMemAddressFree` of the reservation.
    FreeReservation(DeviceError),
    /// `cuIpcCloseMemHandle`.
    IpcClose(DeviceError),
}

impl fmt::Display for CloseFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseFailure::Wait {
                stream,
                on_stream,
                on_device,
            } => write!(
                f,
                "waiting for {stream}: {on_stream}; then for the device: {on_device}"
            ),
            CloseFailure::Unmap(e) => write!(f, "unmap: {e}"),
            CloseFailure::Release(e) => write!(f, "release: {e}"),
            CloseFailure::FreeReservation(e) => write!(f, "free reservation: {e}"),
            CloseFailure::IpcClose(e) => write!(f, "cuIpcCloseMemHandle: {e}"),
        }
    }
}

/// What went wrong while closing: every step was tried, these failed.
#[derive(Debug, Clone, PartialEq)]
pub struct CloseError(pub Vec<CloseFailure>);

impl fmt::Display for CloseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, x) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CloseError {}

/// Waits until the work queued on `stream` so far has finished: an event
/// recorded there, then waited for (not a device-wide synchronize). Where
/// that fails (a stream the device does not know, say), waits for the whole
/// device instead, so that nothing still running loses its memory; fails
/// only when that fails too.
pub fn wait_for_stream<D: Device + ?Sized>(dev: &D, stream: Stream) -> Result<(), CloseFailure> {
    let on_event = dev.create_event().and_then(|e| {
        let r = dev
            .record_event(e, stream)
            .and_then(|()| dev.synchronize_event(e));
        let _ = dev.destroy_event(e);
        r
    });
    match on_event {
        Ok(()) => Ok(()),
        Err(on_stream) => dev.synchronize().map_err(|on_device| CloseFailure::Wait {
            stream,
            on_stream,
            on_device,
        }),
    }
}

/// Shared physical memory mapped into a reservation of this process.
///
/// Invariant: `[base, base + len)` is a reservation of `dev`, mapped in full
/// by `handles` (in order, each imported once) and accessible to it, until
/// [`MappedImport::close`] (or drop) unmaps and releases it, once.
#[derive(Debug)]
pub struct MappedImport<D: Device> {
    dev: D,
    base: u64,
    len: u64,
    handles: Vec<PhysHandle>,
    closed: bool,
}

impl<D: Device> MappedImport<D> {
    /// Imports each `(descriptor, size)` chunk (a descriptor as
    /// [`Device::import_fd`] takes it, owned by the caller; sizes are
    /// multiples of the granularity) and maps them one after the other into
    /// a fresh reservation of their total size, then grants this device
    /// read-write access to the whole. On failure every step already done is
    /// undone, in reverse.
    pub fn map(dev: D, chunks: &[(i32, u64)]) -> Result<Self, ImportError> {
        let len: u64 = chunks.iter().map(|c| c.1).sum();
        let base = dev.reserve(len, 0).map_err(|error| ImportError {
            step: ImportStep::Reserve,
            bytes: len,
            error,
            rollback: Vec::new(),
        })?;
        let mut import = MappedImport {
            dev,
            base,
            len,
            handles: Vec::with_capacity(chunks.len()),
            closed: false,
        };
        let mut mapped = 0u64;
        for (index, (fd, size)) in chunks.iter().enumerate() {
            let h = match import.dev.import_fd(*fd) {
                Ok(h) => h,
                Err(error) => {
                    let step = ImportStep::Import { index };
                    return Err(import.roll_back(mapped, step, *size, error));
                }
            };
            import.handles.push(h);
            if let Err(error) = import.dev.map(base + mapped, *size, h) {
                let step = ImportStep::Map { index };
                return Err(import.roll_back(mapped, step, *size, error));
            }
            mapped += size;
        }
        if let Err(error) = import.dev.set_access(base, len) {
            return Err(import.roll_back(mapped, ImportStep::SetAccess, len, error));
        }
        Ok(import)
    }

    /// Undoes a half-done import whose first `mapped` bytes are mapped.
    fn roll_back(
        mut self,
        mapped: u64,
        step: ImportStep,
        bytes: u64,
        error: DeviceError,
    ) -> ImportError {
        self.closed = true;
        let mut rollback = Vec::new();
        if mapped > 0 {
            rollback.extend(self.dev.unmap(self.base, mapped).err());
        }
        for &h in &self.handles {
            rollback.extend(self.dev.release(h).err());
        }
        rollback.extend(self.dev.free_reservation(self.base, self.len).err());
        ImportError {
            step,
            bytes,
            error,
            rollback,
        }
    }

    /// The first mapped byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Bytes mapped (the chunks' total).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether no byte is mapped (an import of no chunks).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is mapped on.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Waits for the work queued on `after` ([`wait_for_stream`]), then
    /// unmaps the range, releases the imported handles and frees the
    /// reservation. Every step is tried; the error lists those that failed.
    pub fn close(mut self, after: Stream) -> Result<(), CloseError> {
        let mut failed: Vec<CloseFailure> = wait_for_stream(&self.dev, after)
            .err()
            .into_iter()
            .collect();
        self.tear_down(&mut failed);
        if failed.is_empty() {
            Ok(())
        } else {
            Err(CloseError(failed))
        }
    }

    fn tear_down(&mut self, failed: &mut Vec<CloseFailure>) {
        self.closed = true;
        if self.len > 0 {
            if let Err(e) = self.dev.unmap(self.base, self.len) {
                failed.push(CloseFailure::Unmap(e));
            }
        }
        for &h in &self.handles {
            if let Err(e) = self.dev.release(h) {
                failed.push(CloseFailure::Release(e));
            }
        }
        if let Err(e) = self.dev.free_reservation(self.base, self.len) {
            failed.push(CloseFailure::FreeReservation(e));
        }
    }
}

impl<D: Device> Drop for MappedImport<D> {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let mut failed = Vec::new();
        if let Err(e) = self.dev.synchronize() {
            eprintln!("vmmalloc: an import dropped unclosed: waiting for the device: {e}");
        }
        self.tear_down(&mut failed);
        if !failed.is_empty() {
            eprintln!(
                "vmmalloc: closing an import dropped unclosed at {:#x}: {}",
                self.base,
                CloseError(failed)
            );
        }
    }
}

/// Another process's `cuMemAlloc` memory, opened here by its legacy IPC
/// handle ([`Device::ipc_open`]); closed once, by [`OpenedIpcMem::close`] or
/// on drop.
#[derive(Debug)]
pub struct OpenedIpcMem<D: Device> {
    dev: D,
    ptr: u64,
    closed: bool,
}

impl<D: Device> OpenedIpcMem<D> {
    /// Opens `handle` on `dev` (`cuIpcOpenMemHandle`). Opening one handle
    /// twice gives two values with the same pointer; each closes once.
    pub fn open(dev: D, handle: &IpcMemHandle) -> Result<Self, DeviceError> {
        let ptr = dev.ipc_open(handle)?;
        Ok(OpenedIpcMem {
            dev,
            ptr,
            closed: false,
        })
    }

    /// The pointer the driver mapped the memory at.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The device the memory is open on.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Waits for the work queued on `after` ([`wait_for_stream`]), then
    /// closes the handle (`cuIpcCloseMemHandle`).
    pub fn close(mut self, after: Stream) -> Result<(), CloseError> {
        self.closed = true;
        let mut failed: Vec<CloseFailure> = wait_for_stream(&self.dev, after)
            .err()
            .into_iter()
            .collect();
        if let Err(e) = self.dev.ipc_close(self.ptr) {
            failed.push(CloseFailure::IpcClose(e));
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(CloseError(failed))
        }
    }
}

impl<D: Device> Drop for OpenedIpcMem<D> {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        if let Err(e) = self.dev.synchronize() {
            eprintln!("vmmalloc: an IPC handle dropped unclosed: waiting for the device: {e}");
        }
        if let Err(e) = self.dev.ipc_close(self.ptr) {
            eprintln!(
                "vmmalloc: closing an IPC handle dropped unclosed at {:#x}: {}",
                self.ptr,
                CloseFailure::IpcClose(e)
            );
        }
    }
}
