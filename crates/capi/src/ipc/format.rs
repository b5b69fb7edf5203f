//! The byte format of a vmmalloc IPC handle, and PyTorch's own formats.
//!
//! All integers little-endian. vmmalloc's version 2:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `VMMIPC\0\0` |
//! | 4 | version (2) |
//! | 4 | backend: 1 = `cuda`, 2 = `host` |
//! | 4 | producer pid |
//! | 4 | producer device ordinal |
//! | 8 | export id (unique in the producer) |
//! | 16 | token (random; also written in the producer's liveness table) |
//! | 8 | allocation size in bytes |
//! | 8 | offset of the pointer within the first chunk |
//! | 4 | descriptor number of the liveness table in the producer |
//! | 4 | the export's slot in that table |
//! | 4 | number of chunks `n` |
//! | 2 | length `m` of the socket name |
//! | m | abstract Unix socket name of the producer's descriptor server |
//! | 16·n | per chunk: size (8), descriptor number in the producer (4), 0 (4) |
//!
//! Version 1 (before issue 35) had a token file per export instead of a slot
//! in one table, and no slot field. A consumer refuses any other magic or
//! version with an error naming both formats.
//!
//! PyTorch's own handles (`[version][type][payload]`, see `shareIpcHandle`
//! in c10/cuda/CUDACachingAllocator.cpp) are recognised and read
//! ([`TorchHandle`]): expandable-segments ones (`'e'`) of versions 2 and 3,
//! and legacy `cudaIpcMemHandle_t` ones (`'c'`, or a bare 64-byte handle).
//! vmmalloc also writes `'e'` handles ([`TorchHandle::encode_expandable`]) so
//! that a stock PyTorch consumer can import its memory; its own format stays
//! for what PyTorch's cannot carry (chunks of different sizes, the socket
//! fallback, the liveness check).

/// First 8 bytes of every vmmalloc IPC handle.
pub const MAGIC: [u8; 8] = *b"VMMIPC\0\0";
/// The handle version this build writes and reads.
pub const VERSION: u32 = 2;
/// Bytes before the socket name.
const FIXED: usize = 8 + 4 + 4 + 4 + 4 + 8 + 16 + 8 + 8 + 4 + 4 + 4 + 2;
/// Bytes per chunk.
const PER_CHUNK: usize = 16;
/// Longest abstract socket name (`sun_path` is 108 bytes, one is the leading NUL).
pub const MAX_SOCKET_NAME: usize = 100;

/// This build's format, as error messages name it.
pub fn this_format() -> String {
    format!("vmmalloc IPC handle v{VERSION}")
}

/// The device backend that made the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A GPU (`device:cuda`): descriptors from `cuMemExportToShareableHandle`.
    Cuda,
    /// The `host` backend: memfds.
    Host,
}

impl Backend {
    fn code(self) -> u32 {
        match self {
            Backend::Cuda => 1,
            Backend::Host => 2,
        }
    }

    fn from_code(c: u32) -> Option<Backend> {
        match c {
            1 => Some(Backend::Cuda),
            2 => Some(Backend::Host),
            _ => None,
        }
    }

    /// The `device:` value naming it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cuda => "cuda",
            Backend::Host => "host",
        }
    }
}

/// One chunk: its size and its descriptor's number in the producer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRef {
    /// Bytes.
    pub size: u64,
    /// Descriptor number in the producer process.
    pub fd: i32,
}

/// A decoded handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handle {
    /// Who made the memory.
    pub backend: Backend,
    /// Producer process id.
    pub pid: u32,
    /// Producer device ordinal.
    pub device: u32,
    /// Export id in the producer.
    pub export_id: u64,
    /// Random token, also in the producer's liveness table.
    pub token: [u8; 16],
    /// Allocation size.
    pub size: u64,
    /// Offset of the pointer in the first chunk.
    pub offset: u64,
    /// The liveness table's descriptor number in the producer
    /// ([`super::transport::LiveTable`]).
    pub token_fd: i32,
    /// The export's slot in the liveness table.
    pub slot: u32,
    /// Abstract socket name of the producer's descriptor server.
    pub socket: String,
    /// Chunks in address order.
    pub chunks: Vec<ChunkRef>,
}

impl Handle {
    /// The bytes of this handle.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(FIXED + self.socket.len() + PER_CHUNK * self.chunks.len());
        v.extend_from_slice(&MAGIC);
        v.extend_from_slice(&VERSION.to_le_bytes());
        v.extend_from_slice(&self.backend.code().to_le_bytes());
        v.extend_from_slice(&self.pid.to_le_bytes());
        v.extend_from_slice(&self.device.to_le_bytes());
        v.extend_from_slice(&self.export_id.to_le_bytes());
        v.extend_from_slice(&self.token);
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.token_fd.to_le_bytes());
        v.extend_from_slice(&self.slot.to_le_bytes());
        v.extend_from_slice(&(self.chunks.len() as u32).to_le_bytes());
        v.extend_from_slice(&(self.socket.len() as u16).to_le_bytes());
        v.extend_from_slice(self.socket.as_bytes());
        for c in &self.chunks {
            v.extend_from_slice(&c.size.to_le_bytes());
            v.extend_from_slice(&c.fd.to_le_bytes());
            v.extend_from_slice(&0u32.to_le_bytes());
        }
        v
    }

    /// Decodes `b`; an error says what is wrong, naming both formats when
    /// the handle is of another format or version.
    pub fn decode(b: &[u8]) -> Result<Handle, String> {
        if b.len() < 12 || b[..8] != MAGIC {
            return Err(format!(
                "not a {} but {}",
                this_format(),
                describe_foreign(b)
            ));
        }
        let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(format!(
                "the handle is a vmmalloc IPC handle v{version}, but this vmmalloc reads only {} \
                 (producer and consumer run different vmmalloc versions)",
                this_format()
            ));
        }
        let short = || format!("truncated {} ({} bytes)", this_format(), b.len());
        if b.len() < FIXED {
            return Err(short());
        }
        let mut r = Reader { b, at: 12 };
        let backend_code = r.u32();
        let backend = Backend::from_code(backend_code)
            .ok_or_else(|| format!("{}: unknown backend {backend_code}", this_format()))?;
        let pid = r.u32();
        let device = r.u32();
        let export_id = r.u64();
        let token: [u8; 16] = r.take(16).try_into().expect("16 bytes");
        let size = r.u64();
        let offset = r.u64();
        let token_fd = r.u32() as i32;
        let slot = r.u32();
        let n = r.u32() as usize;
        let m = r.u16() as usize;
        if m > MAX_SOCKET_NAME || b.len() != FIXED + m + n.saturating_mul(PER_CHUNK) {
            return Err(format!(
                "malformed {}: {} bytes for {n} chunks and a {m}-byte socket name",
                this_format(),
                b.len()
            ));
        }
        let socket = String::from_utf8(r.take(m).to_vec())
            .map_err(|_| format!("malformed {}: socket name is not UTF-8", this_format()))?;
        let mut chunks = Vec::with_capacity(n);
        for _ in 0..n {
            let size = r.u64();
            let fd = r.u32() as i32;
            let _pad = r.u32();
            chunks.push(ChunkRef { size, fd });
        }
        let total: u64 = chunks.iter().map(|c| c.size).sum();
        if n == 0 || size == 0 || offset.checked_add(size).is_none_or(|end| end > total) {
            return Err(format!(
                "malformed {}: offset {offset} + size {size} does not fit in {n} chunks of {total} bytes",
                this_format()
            ));
        }
        Ok(Handle {
            backend,
            pid,
            device,
            export_id,
            token,
            size,
            offset,
            token_fd,
            slot,
            socket,
            chunks,
        })
    }
}

/// PyTorch's `ShareableHandleType` (c10/cuda/CUDACachingAllocator.cpp):
/// `SHAREABLE_CUDA_MALLOC`.
pub const TORCH_CUDA_MALLOC: u8 = b'c';
/// `SHAREABLE_CUDA_EXPANDABLE_SEGMENT`.
pub const TORCH_EXPANDABLE: u8 = b'e';
/// `sizeof(cudaIpcMemHandle_t)` (`CU_IPC_HANDLE_SIZE`, cuda.h).
pub const CUDA_IPC_HANDLE_SIZE: usize = 64;
/// `Expandable_Segments_Handle_Type::POSIX_FD` (c10/cuda/CUDAAllocatorConfig.h).
pub const TORCH_HANDLE_POSIX_FD: u32 = 1;
/// `Expandable_Segments_Handle_Type::FABRIC_HANDLE`: 64-byte
/// `CUmemFabricHandle`s instead of descriptors.
pub const TORCH_HANDLE_FABRIC: u32 = 2;
/// Bytes of a `CUmemFabricHandle` (cuda.h).
const FABRIC_HANDLE_SIZE: usize = 64;

/// The `SHAREABLE_HANDLE_VERSION` a PyTorch writes (and the newest its
/// `getIpcDevPtr` accepts), by its version, where vmmalloc knows the layout of
/// its `'e'` handle:
///
/// - 3 for PyTorch 2.13 and newer: read from the 2.15 wheel's
///   `libc10_cuda.so` (`DeviceCachingAllocator::shareIpcHandle` writes
///   `put(3)`; `NativeCachingAllocator::getIpcDevPtr` refuses versions above
///   3); NeMo-RL's `nemo_rl/utils/cuda_ipc.py` dates the bump to 2.13.
/// - 2 for PyTorch 2.11 and 2.12: seen from 2.11 on an H200
///   (scripts/torch_ipc_checks.py); NeMo-RL: "the version byte torch <= 2.12
///   writes".
/// - `None` before 2.11 and after 2.15: not verified here, so vmmalloc
///   writes its own format for them (a newer PyTorch may change the layout
///   again without refusing the older version byte; docs/pytorch.md, "IPC").
pub fn torch_handle_version(major: u32, minor: u32) -> Option<u8> {
    match (major, minor) {
        (2, 13..=15) => Some(3),
        (2, 11 | 12) => Some(2),
        _ => None,
    }
}

/// A handle written by PyTorch's own caching allocator
/// (`NativeCachingAllocator::shareIpcHandle`, c10/cuda/CUDACachingAllocator.cpp):
/// `[SHAREABLE_HANDLE_VERSION][type][payload]`, or (before the version byte
/// existed, and still accepted by `getIpcDevPtr`) a bare 64-byte
/// `cudaIpcMemHandle_t`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TorchHandle {
    /// Type `'e'`, a range of an expandable segment
    /// (`ExpandableSegment::share`): a `ShareHeader` then one `int`
    /// descriptor per handle, each `segment_size` bytes, mapped one after the
    /// other (`ExpandableSegment::fromShared`). The header:
    ///
    /// - version 2 (PyTorch 2.11, 2.12): `{pid_t pid; size_t segment_size;
    ///   size_t num_handles;}`, 24 bytes with the padding after `pid`;
    /// - version 3 (PyTorch 2.13+, pytorch#179618): the same then
    ///   `Expandable_Segments_Handle_Type handle_type` (an `int`), 32 bytes
    ///   with padding after `pid` and after `handle_type`; the payload is one
    ///   `int` per handle for `POSIX_FD` (1), a 64-byte `CUmemFabricHandle`
    ///   for `FABRIC_HANDLE` (2). Layout read from the 2.15 wheel's
    ///   `shareIpcHandle` (`write(&header, 0x20)`: pid at 0, segment_size at
    ///   8, num_handles at 16, handle_type at 24) and `getIpcDevPtr`
    ///   (`read(&header, 0x20)`, then 4 or 64 bytes per handle by type).
    Expandable {
        /// The version byte.
        version: u8,
        /// Producer pid.
        pid: u32,
        /// Bytes per handle.
        segment_size: u64,
        /// Descriptor numbers in the producer.
        fds: Vec<i32>,
    },
    /// Type `'c'`: a `cudaMalloc` block's `cudaIpcMemHandle_t`
    /// (`cudaIpcGetMemHandle` on the segment's base block in
    /// `DeviceCachingAllocator::shareIpcHandle`), opened with
    /// `cudaIpcOpenMemHandle` in `getIpcDevPtr`; the pointer is the base
    /// block's, PyTorch adds the storage's offset.
    CudaMalloc {
        /// The version byte (`None`: a bare 64-byte handle).
        version: Option<u8>,
        /// The `cudaIpcMemHandle_t` (= `CUipcMemHandle`) bytes.
        handle: [u8; CUDA_IPC_HANDLE_SIZE],
    },
}

/// PyTorch's version bytes whose `'e'` payload vmmalloc reads.
const TORCH_VERSIONS: [u8; 2] = [2, 3];

impl TorchHandle {
    /// Parses `b` if it is one of PyTorch's handles of a known version;
    /// `Ok(None)` if it is not PyTorch's at all; an error naming the format
    /// when it is PyTorch's but cannot be read.
    pub fn parse(b: &[u8]) -> Result<Option<TorchHandle>, String> {
        if b.starts_with(&MAGIC[..6]) {
            return Ok(None);
        }
        if b.len() == CUDA_IPC_HANDLE_SIZE {
            // getIpcDevPtr: "if (handle.size() == sizeof(cudaIpcMemHandle_t))"
            // — the handle of a PyTorch that wrote no version byte.
            return Ok(Some(TorchHandle::CudaMalloc {
                version: None,
                handle: b.try_into().expect("64 bytes"),
            }));
        }
        if b.len() < 2
            || !matches!(b[1], TORCH_CUDA_MALLOC | TORCH_EXPANDABLE)
            || b[0] == 0
            || b[0] > 16
        {
            return Ok(None);
        }
        let (version, kind) = (b[0], b[1]);
        if kind == TORCH_CUDA_MALLOC {
            // The 'c' payload is the same in versions 1 to 3 (NeMo-RL's
            // cuda_ipc.py compares 2 and 3; 2.15's getIpcDevPtr reads 64
            // bytes after the type for every version up to 3).
            if version > 3 || b.len() != 2 + CUDA_IPC_HANDLE_SIZE {
                return Err(format!(
                    "the handle is PyTorch's cudaMalloc IPC handle ('c') version {version} of {} \
                     bytes, which this vmmalloc cannot read: it reads versions 1 to 3 of {} \
                     bytes",
                    b.len(),
                    2 + CUDA_IPC_HANDLE_SIZE
                ));
            }
            return Ok(Some(TorchHandle::CudaMalloc {
                version: Some(version),
                handle: b[2..].try_into().expect("64 bytes"),
            }));
        }
        let bad = |why: &str| {
            Err(format!(
                "the handle is PyTorch's expandable-segments IPC handle version {version} ({} \
                 bytes), which this vmmalloc cannot read: {why}; it reads {} and PyTorch's \
                 versions {TORCH_VERSIONS:?}",
                b.len(),
                this_format()
            ))
        };
        if !TORCH_VERSIONS.contains(&version) {
            return bad("unknown version");
        }
        let header = if version == 2 { 24 } else { 32 };
        if b.len() < 2 + header {
            return bad("too short for its header");
        }
        let mut r = Reader { b, at: 2 };
        let pid = r.u32();
        let _pad = r.u32();
        let segment_size = r.u64();
        let n = r.u64();
        let handle_type = if version == 2 {
            // Version 2 does not say; 2.11/2.12 write descriptors unless the
            // producer runs expandable_segments_handle_type:fabric_handle.
            if n > 0 && b.len() as u64 == 26 + FABRIC_HANDLE_SIZE as u64 * n {
                TORCH_HANDLE_FABRIC
            } else {
                TORCH_HANDLE_POSIX_FD
            }
        } else {
            let t = r.u32();
            let _pad = r.u32();
            t
        };
        if handle_type == TORCH_HANDLE_FABRIC {
            return bad(
                "it carries CUmemFabricHandles (expandable_segments_handle_type:fabric_handle), \
                 which vmmalloc does not import; run the producer with POSIX descriptors",
            );
        }
        if handle_type != TORCH_HANDLE_POSIX_FD {
            return bad(&format!("unknown handle type {handle_type}"));
        }
        if n == 0
            || n > 1 << 20
            || b.len() as u64 != (2 + header) as u64 + 4 * n
            || segment_size == 0
        {
            return bad(&format!(
                "{n} handles of {segment_size} bytes do not match its length"
            ));
        }
        let fds = (0..n).map(|_| r.u32() as i32).collect();
        Ok(Some(TorchHandle::Expandable {
            version,
            pid,
            segment_size,
            fds,
        }))
    }

    /// The bytes of an `'e'` handle of `version` (2 or 3) that PyTorch's
    /// `ExpandableSegment::fromShared` of that version reads: `pid`'s `n =
    /// fds.len()` descriptors, `segment_size` bytes each, POSIX descriptors.
    /// The header's padding is written as zeros (PyTorch leaves it
    /// uninitialized, pytorch#198305), so the same range always gets the same
    /// bytes, which PyTorch's consumer uses as its cache key
    /// (`ipcMemHandle_to_devptr`).
    pub fn encode_expandable(version: u8, pid: u32, segment_size: u64, fds: &[i32]) -> Vec<u8> {
        let mut v = Vec::with_capacity(2 + 32 + 4 * fds.len());
        v.push(version);
        v.push(TORCH_EXPANDABLE);
        v.extend_from_slice(&pid.to_le_bytes());
        v.extend_from_slice(&[0; 4]);
        v.extend_from_slice(&segment_size.to_le_bytes());
        v.extend_from_slice(&(fds.len() as u64).to_le_bytes());
        if version >= 3 {
            v.extend_from_slice(&TORCH_HANDLE_POSIX_FD.to_le_bytes());
            v.extend_from_slice(&[0; 4]);
        }
        for fd in fds {
            v.extend_from_slice(&fd.to_le_bytes());
        }
        v
    }
}

/// Which format a handle that is not ours looks like.
pub fn describe_foreign(b: &[u8]) -> String {
    // c10/cuda/CUDACachingAllocator.cpp, NativeCachingAllocator::shareIpcHandle:
    // a version byte (SHAREABLE_HANDLE_VERSION), then the ShareableHandleType,
    // SHAREABLE_CUDA_MALLOC ('c') followed by a 64-byte cudaIpcMemHandle_t, or
    // SHAREABLE_CUDA_EXPANDABLE_SEGMENT ('e') followed by the segment's header
    // and descriptors.
    match b {
        [] => "an empty handle".into(),
        [v, b'c', ..] if *v <= 16 => format!(
            "PyTorch's cudaMalloc IPC handle (version {v}, 'c' + cudaIpcMemHandle_t, from its \
             native caching allocator without expandable segments)"
        ),
        [v, b'e', ..] if *v <= 16 => format!(
            "PyTorch's expandable-segments IPC handle (version {v}, 'e' + segment header, from \
             its native caching allocator with expandable_segments:True)"
        ),
        _ if b.starts_with(b"VMMIPC") => "a vmmalloc IPC handle with a damaged magic".into(),
        _ => format!("an unknown format ({} bytes)", b.len()),
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take(2).try_into().expect("2 bytes"))
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Handle {
        Handle {
            backend: Backend::Host,
            pid: 42,
            device: 1,
            export_id: 7,
            token: [9; 16],
            size: 3 << 20,
            offset: 512,
            token_fd: 11,
            slot: 3,
            socket: "vmmalloc-ipc-42-abc".into(),
            chunks: vec![
                ChunkRef {
                    size: 2 << 20,
                    fd: 12,
                },
                ChunkRef {
                    size: 2 << 20,
                    fd: 13,
                },
            ],
        }
    }

    #[test]
    fn round_trips() {
        let h = sample();
        assert_eq!(Handle::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn other_versions_and_formats_are_named() {
        let mut b = sample().encode();
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        let e = Handle::decode(&b).unwrap_err();
        assert!(
            e.contains("v1") && e.contains("vmmalloc IPC handle v2"),
            "{e}"
        );
        let mut torch = vec![2, b'e'];
        torch.extend_from_slice(&[0; 40]);
        let e = Handle::decode(&torch).unwrap_err();
        assert!(e.contains("expandable-segments") && e.contains("v2"), "{e}");
        let mut legacy = vec![2, b'c'];
        legacy.extend_from_slice(&[0; 64]);
        assert!(Handle::decode(&legacy)
            .unwrap_err()
            .contains("cudaIpcMemHandle_t"));
        assert!(Handle::decode(&[]).unwrap_err().contains("empty"));
    }

    #[test]
    fn torch_expandable_handles_parse_as_seen_from_pytorch_2_11() {
        // The 30 bytes PyTorch 2.11 wrote for a 4 MiB tensor under
        // expandable_segments:True on an H200 (scripts/torch_ipc_checks.py).
        let seen = [
            0x02, 0x65, 0x99, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0x40, 0x01, 0, 0, 0, 0, 0x01, 0, 0, 0,
            0, 0, 0, 0, 0x2f, 0, 0, 0,
        ];
        assert_eq!(
            TorchHandle::parse(&seen).unwrap(),
            Some(TorchHandle::Expandable {
                version: 2,
                pid: 0x299,
                segment_size: 20 << 20,
                fds: vec![0x2f],
            })
        );
        let mut v9 = seen;
        v9[0] = 9;
        assert!(TorchHandle::parse(&v9)
            .unwrap_err()
            .contains("unknown version"));
        assert!(TorchHandle::parse(&seen[..29])
            .unwrap_err()
            .contains("do not match"));
        // The 30 bytes of a 2.11 handle read as version 3 are too short for
        // its 32-byte header: 2.13+ changed the layout (pytorch#179618).
        let mut as_v3 = seen;
        as_v3[0] = 3;
        assert!(TorchHandle::parse(&as_v3)
            .unwrap_err()
            .contains("too short"));
        assert_eq!(TorchHandle::parse(&sample().encode()).unwrap(), None);
    }

    #[test]
    fn torch_expandable_handles_parse_as_pytorch_2_15_writes_them() {
        // DeviceCachingAllocator::shareIpcHandle in the 2.15 wheel: put(3),
        // put('e'), a 32-byte ShareHeader {pid @0, (pad), segment_size @8,
        // num_handles @16, handle_type @24, (pad)}, then an int per handle.
        // The padding is whatever was on the stack: 0xAB here.
        let mut b = vec![3u8, b'e'];
        b.extend_from_slice(&0x1234u32.to_le_bytes());
        b.extend_from_slice(&[0xAB; 4]);
        b.extend_from_slice(&(20u64 << 20).to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&TORCH_HANDLE_POSIX_FD.to_le_bytes());
        b.extend_from_slice(&[0xAB; 4]);
        b.extend_from_slice(&40i32.to_le_bytes());
        b.extend_from_slice(&41i32.to_le_bytes());
        assert_eq!(b.len(), 2 + 32 + 8);
        let want = TorchHandle::Expandable {
            version: 3,
            pid: 0x1234,
            segment_size: 20 << 20,
            fds: vec![40, 41],
        };
        assert_eq!(TorchHandle::parse(&b).unwrap(), Some(want.clone()));
        // What vmmalloc writes reads back the same, padding zeroed.
        let ours = TorchHandle::encode_expandable(3, 0x1234, 20 << 20, &[40, 41]);
        assert_eq!(ours.len(), b.len());
        assert_eq!(TorchHandle::parse(&ours).unwrap(), Some(want));
        assert_eq!(&ours[6..10], &[0; 4]);
        let v2 = TorchHandle::encode_expandable(2, 7, 2 << 20, &[5]);
        assert_eq!(v2.len(), 2 + 24 + 4);
        assert!(matches!(
            TorchHandle::parse(&v2).unwrap(),
            Some(TorchHandle::Expandable {
                version: 2,
                pid: 7,
                ..
            })
        ));
        // Fabric handles (handle_type 2) are refused by name.
        let mut fabric = b.clone();
        fabric[26..30].copy_from_slice(&TORCH_HANDLE_FABRIC.to_le_bytes());
        fabric.truncate(34);
        fabric.extend_from_slice(&[0; 128]);
        assert!(TorchHandle::parse(&fabric)
            .unwrap_err()
            .contains("CUmemFabricHandle"));
        let mut odd = b.clone();
        odd[26..30].copy_from_slice(&7u32.to_le_bytes());
        assert!(TorchHandle::parse(&odd)
            .unwrap_err()
            .contains("unknown handle type 7"));
    }

    #[test]
    fn legacy_cuda_malloc_handles_parse() {
        let mut legacy = vec![3, b'c'];
        legacy.extend((0..64).map(|i| i as u8));
        match TorchHandle::parse(&legacy).unwrap() {
            Some(TorchHandle::CudaMalloc { version, handle }) => {
                assert_eq!(version, Some(3));
                assert_eq!(handle[63], 63);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            TorchHandle::parse(&legacy[2..]).unwrap(),
            Some(TorchHandle::CudaMalloc { version: None, .. })
        ));
        assert!(TorchHandle::parse(&legacy[..40])
            .unwrap_err()
            .contains("cudaMalloc"));
        legacy[0] = 4;
        assert!(TorchHandle::parse(&legacy)
            .unwrap_err()
            .contains("versions 1 to 3"));
    }

    #[test]
    fn torch_versions_map_to_handle_versions() {
        assert_eq!(torch_handle_version(2, 15), Some(3));
        assert_eq!(torch_handle_version(2, 13), Some(3));
        assert_eq!(torch_handle_version(2, 12), Some(2));
        assert_eq!(torch_handle_version(2, 11), Some(2));
        assert_eq!(torch_handle_version(2, 10), None);
        assert_eq!(torch_handle_version(2, 16), None);
    }

    #[test]
    fn truncated_or_inconsistent_handles_are_refused() {
        let b = sample().encode();
        for cut in [12, 30, b.len() - 1] {
            assert!(Handle::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut h = sample();
        h.offset = 2 << 20; // offset + size beyond the chunks
        assert!(Handle::decode(&h.encode())
            .unwrap_err()
            .contains("does not fit"));
    }
}
