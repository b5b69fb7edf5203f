//! The byte format of a vmmalloc IPC handle, and recognition of foreign ones.
//!
//! All integers little-endian. Version 1:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `VMMIPC\0\0` |
//! | 4 | version (1) |
//! | 4 | backend: 1 = `cuda`, 2 = `host` |
//! | 4 | producer pid |
//! | 4 | producer device ordinal |
//! | 8 | export id (unique in the producer) |
//! | 16 | token (random; also written in the producer's token file) |
//! | 8 | allocation size in bytes |
//! | 8 | offset of the pointer within the first chunk |
//! | 4 | descriptor number of the token file in the producer |
//! | 4 | number of chunks `n` |
//! | 2 | length `m` of the socket name |
//! | m | abstract Unix socket name of the producer's descriptor server |
//! | 16·n | per chunk: size (8), descriptor number in the producer (4), 0 (4) |
//!
//! A consumer refuses any other magic or version with an error naming both
//! formats. PyTorch's own handles (`[version][type][payload]`, see
//! `shareIpcHandle` in c10/cuda/CUDACachingAllocator.cpp) are recognised:
//! expandable-segments ones (`'e'`) of known versions are read
//! ([`TorchHandle`]), legacy `cudaIpcMemHandle_t` ones (`'c'`) are refused
//! by name.

/// First 8 bytes of every vmmalloc IPC handle.
pub const MAGIC: [u8; 8] = *b"VMMIPC\0\0";
/// The handle version this build writes and reads.
pub const VERSION: u32 = 1;
/// Bytes before the socket name.
const FIXED: usize = 8 + 4 + 4 + 4 + 4 + 8 + 16 + 8 + 8 + 4 + 4 + 2;
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
    /// Random token, also in the producer's token file.
    pub token: [u8; 16],
    /// Allocation size.
    pub size: u64,
    /// Offset of the pointer in the first chunk.
    pub offset: u64,
    /// The token file's descriptor number in the producer.
    pub token_fd: i32,
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
            socket,
            chunks,
        })
    }
}

/// A handle written by PyTorch's own caching allocator
/// (`NativeCachingAllocator::shareIpcHandle`, c10/cuda/CUDACachingAllocator.cpp):
/// `[SHAREABLE_HANDLE_VERSION][type][payload]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TorchHandle {
    /// Type `'e'` (`SHAREABLE_CUDA_EXPANDABLE_SEGMENT`): `ShareHeader {pid_t
    /// pid; size_t segment_size; size_t num_handles}` (24 bytes with its
    /// padding) then one `int` descriptor per handle, each `segment_size`
    /// bytes, mapped one after the other (`ExpandableSegment::share`).
    /// Seen from PyTorch 2.11 (version byte 2) on an H200.
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
}

/// PyTorch's version bytes whose `'e'` payload has the layout above:
/// 2 (PyTorch 2.11, seen) and 3 (2.13, which bumped the byte without
/// changing the payloads, as NeMo-RL's `cuda_ipc` shim documents).
const TORCH_VERSIONS: [u8; 2] = [2, 3];

impl TorchHandle {
    /// Parses `b` if it is PyTorch's expandable-segments handle of a known
    /// version; `Ok(None)` if it is not PyTorch's at all; an error naming the
    /// format when it is PyTorch's but cannot be read.
    pub fn parse(b: &[u8]) -> Result<Option<TorchHandle>, String> {
        if b.len() < 2 || !matches!(b[1], b'c' | b'e') || b[0] == 0 || b[0] > 16 {
            return Ok(None);
        }
        let (version, kind) = (b[0], b[1]);
        if kind == b'c' {
            return Err(format!(
                "the handle is PyTorch's cudaMalloc IPC handle (version {version}, 'c' + \
                 cudaIpcMemHandle_t, from its native caching allocator without expandable \
                 segments); vmmalloc reads only {} and PyTorch's expandable-segments handles \
                 (reading legacy CUDA IPC handles needs cuIpcOpenMemHandle, not implemented)",
                this_format()
            ));
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
        if b.len() < 2 + 24 {
            return bad("too short for its header");
        }
        let mut r = Reader { b, at: 2 };
        let pid = r.u32();
        let _pad = r.u32();
        let segment_size = r.u64();
        let n = r.u64();
        if n == 0 || n > 1 << 20 || b.len() as u64 != 26 + 4 * n || segment_size == 0 {
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
        b[8..12].copy_from_slice(&2u32.to_le_bytes());
        let e = Handle::decode(&b).unwrap_err();
        assert!(
            e.contains("v2") && e.contains("vmmalloc IPC handle v1"),
            "{e}"
        );
        let mut torch = vec![2, b'e'];
        torch.extend_from_slice(&[0; 40]);
        let e = Handle::decode(&torch).unwrap_err();
        assert!(e.contains("expandable-segments") && e.contains("v1"), "{e}");
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
        let mut legacy = vec![2, b'c'];
        legacy.extend_from_slice(&[0; 64]);
        assert!(TorchHandle::parse(&legacy)
            .unwrap_err()
            .contains("cuIpcOpenMemHandle"));
        assert_eq!(TorchHandle::parse(&sample().encode()).unwrap(), None);
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
