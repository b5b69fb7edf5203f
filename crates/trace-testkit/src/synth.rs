//! Synthetic PyTorch memory snapshots of any size, written as
//! `torch.cuda.memory._dump_snapshot` writes them, for benchmarks and tests.
//!
//! The content is a training loop recorded with
//! `_record_memory_history(stacks="all")`: weights and optimizer state live
//! before recording began (they appear only as active blocks of the final
//! segments), then each step allocates an activation per layer with two
//! temporaries, frees them in the backward pass and runs an optimizer step.
//! Sequence lengths vary per step, so sizes vary. Every allocation event
//! carries a stack of Python and C++ frames; `free_requested` carries the
//! stack of the free site, `free_completed` an empty one.
//!
//! The bytes are those of Python's `pickle.dump` (protocol 4 by default, as
//! `_dump_snapshot` uses) of the object graph PyTorch builds: every frame dict
//! is one object shared by all the stacks that contain it (PyTorch's
//! `py_symbolize` deduplicates frames), so after its first use it is a memo
//! reference (`LONG_BINGET`); each event has a list of its own; dict keys and
//! action names are shared strings; `compile_context` is a new string per
//! event. The writer streams: memory stays small whatever the size.
//! A test checks the bytes against Python's own pickler.

use std::collections::HashMap;
use std::io::{self, Write};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[cfg(test)]
use vmmalloc_trace::model::Frame;

/// The pickle opcodes the writer uses (CPython's `Lib/pickle.py`; the
/// library's reader has its own table, so a wrong code here is caught by the
/// test against Python's pickler rather than shared with the reader).
mod op {
    pub const APPEND: u8 = b'a';
    pub const APPENDS: u8 = b'e';
    pub const BINFLOAT: u8 = b'G';
    pub const BINGET: u8 = b'h';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const BINPUT: u8 = b'q';
    pub const BINUNICODE: u8 = b'X';
    pub const BINUNICODE8: u8 = 0x8d;
    pub const EMPTY_DICT: u8 = b'}';
    pub const EMPTY_LIST: u8 = b']';
    pub const FRAME: u8 = 0x95;
    pub const LONG1: u8 = 0x8a;
    pub const LONG_BINGET: u8 = b'j';
    pub const LONG_BINPUT: u8 = b'r';
    pub const MARK: u8 = b'(';
    pub const MEMOIZE: u8 = 0x94;
    pub const NEWFALSE: u8 = 0x89;
    pub const NEWTRUE: u8 = 0x88;
    pub const PROTO: u8 = 0x80;
    pub const SETITEM: u8 = b's';
    pub const SETITEMS: u8 = b'u';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const STOP: u8 = b'.';
    pub const TUPLE2: u8 = 0x86;
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct SynthConfig {
    /// Approximate size of the file in bytes (rounded to whole training
    /// steps, at least one; within a few % from 10 MB up, the final segments
    /// add a fixed part below that).
    pub target_bytes: u64,
    /// Transformer layers of the simulated model.
    pub layers: u32,
    /// Devices, each with its own trace and segments.
    pub devices: u32,
    /// Pickle protocol (2–5; `_dump_snapshot` writes Python's default, 4 or 5).
    pub protocol: u8,
    /// Seed of the sizes.
    pub seed: u64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            target_bytes: 10 << 20,
            layers: 24,
            devices: 1,
            protocol: 4,
            seed: 1,
        }
    }
}

/// What was generated, and the figures a reader must find in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SynthSummary {
    /// Bytes written.
    pub bytes: u64,
    /// Training steps per device.
    pub steps: u64,
    /// Events over all devices.
    pub events: u64,
    /// `alloc` events over all devices.
    pub allocs: u64,
    /// Allocations live before recording began, per device.
    pub pre_trace: u64,
    /// Peak of requested live bytes of device 0, pre-trace allocations included.
    pub peak_live: u64,
}

/// Python's `_Framer` target size: a frame is committed once it holds this much.
const FRAME_TARGET: usize = 64 * 1024;

/// A streaming pickler that writes what CPython's `pickle` writes for the
/// same object graph: memo ids in order, `MEMOIZE` (protocol 4+) or
/// `BINPUT`/`LONG_BINPUT`, batches of 1000 with `MARK … APPENDS/SETITEMS`
/// (`APPEND`/`SETITEM` for a batch of one), frames of 64 KiB.
struct Pickler<W: Write> {
    out: W,
    buf: Vec<u8>,
    proto: u8,
    memo: u32,
    written: u64,
}

impl<W: Write> Pickler<W> {
    fn new(mut out: W, proto: u8) -> io::Result<Self> {
        out.write_all(&[op::PROTO, proto])?;
        Ok(Pickler {
            out,
            buf: Vec::with_capacity(2 * FRAME_TARGET),
            proto,
            memo: 0,
            written: 2,
        })
    }

    fn commit(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        if self.proto >= 4 {
            self.out.write_all(&[op::FRAME])?;
            self.out.write_all(&(self.buf.len() as u64).to_le_bytes())?;
            self.written += 9;
        }
        self.out.write_all(&self.buf)?;
        self.written += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }

    /// After a complete value: commit the frame if it is full.
    fn boundary(&mut self) -> io::Result<()> {
        if self.buf.len() >= FRAME_TARGET {
            self.commit()?;
        }
        Ok(())
    }

    fn memoize(&mut self) -> u32 {
        let id = self.memo;
        self.memo += 1;
        if self.proto >= 4 {
            self.buf.push(op::MEMOIZE);
        } else if id < 256 {
            self.buf.extend_from_slice(&[op::BINPUT, id as u8]);
        } else {
            self.buf.push(op::LONG_BINPUT);
            self.buf.extend_from_slice(&id.to_le_bytes());
        }
        id
    }

    fn get(&mut self, id: u32) -> io::Result<()> {
        if id < 256 {
            self.buf.extend_from_slice(&[op::BINGET, id as u8]);
        } else {
            self.buf.push(op::LONG_BINGET);
            self.buf.extend_from_slice(&id.to_le_bytes());
        }
        self.boundary()
    }

    fn int(&mut self, x: i64) -> io::Result<()> {
        if (0..=0xff).contains(&x) {
            self.buf.extend_from_slice(&[op::BININT1, x as u8]);
        } else if (0..=0xffff).contains(&x) {
            self.buf.push(op::BININT2);
            self.buf.extend_from_slice(&(x as u16).to_le_bytes());
        } else if let Ok(i) = i32::try_from(x) {
            self.buf.push(op::BININT);
            self.buf.extend_from_slice(&i.to_le_bytes());
        } else {
            // Python's encode_long: (bit_length >> 3) + 1 bytes, two's complement.
            let bits = 64
                - if x < 0 {
                    (!x).leading_zeros()
                } else {
                    x.leading_zeros()
                };
            let n = (bits as usize >> 3) + 1;
            let mut b = x.to_le_bytes()[..n.min(8)].to_vec();
            if x < 0 && n > 1 && b[n - 1] == 0xff && b[n - 2] & 0x80 != 0 {
                b.pop();
            }
            self.buf.extend_from_slice(&[op::LONG1, b.len() as u8]);
            self.buf.extend_from_slice(&b);
        }
        self.boundary()
    }

    fn float(&mut self, f: f64) -> io::Result<()> {
        self.buf.push(op::BINFLOAT);
        self.buf.extend_from_slice(&f.to_be_bytes());
        self.boundary()
    }

    fn bool(&mut self, b: bool) -> io::Result<()> {
        self.buf.push(if b { op::NEWTRUE } else { op::NEWFALSE });
        self.boundary()
    }

    /// A new string object; returns its memo id.
    fn str(&mut self, s: &str) -> io::Result<u32> {
        let b = s.as_bytes();
        if b.len() < 256 && self.proto >= 4 {
            self.buf
                .extend_from_slice(&[op::SHORT_BINUNICODE, b.len() as u8]);
        } else if b.len() <= u32::MAX as usize {
            self.buf.push(op::BINUNICODE);
            self.buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
        } else {
            self.buf.push(op::BINUNICODE8);
            self.buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
        }
        self.buf.extend_from_slice(b);
        let id = self.memoize();
        self.boundary()?;
        Ok(id)
    }

    /// A `(a, b)` tuple of small ints.
    fn tuple2(&mut self, a: i64, b: i64) -> io::Result<()> {
        self.int(a)?;
        self.int(b)?;
        self.buf.push(op::TUPLE2);
        self.memoize();
        self.boundary()
    }

    /// A container of `n` items, written by `item(self, i)` (a key and a value
    /// for a dict); returns its memo id.
    fn container(
        &mut self,
        dict: bool,
        n: usize,
        mut item: impl FnMut(&mut Self, usize) -> io::Result<()>,
    ) -> io::Result<u32> {
        self.buf
            .push(if dict { op::EMPTY_DICT } else { op::EMPTY_LIST });
        let id = self.memoize();
        self.boundary()?;
        let mut i = 0;
        while i < n {
            let batch = (n - i).min(1000);
            if batch > 1 {
                self.buf.push(op::MARK);
            }
            for j in i..i + batch {
                item(self, j)?;
            }
            self.buf.push(match (dict, batch > 1) {
                (true, true) => op::SETITEMS,
                (true, false) => op::SETITEM,
                (false, true) => op::APPENDS,
                (false, false) => op::APPEND,
            });
            self.boundary()?;
            i += batch;
        }
        Ok(id)
    }

    fn finish(mut self) -> io::Result<u64> {
        self.buf.push(op::STOP);
        self.commit()?;
        self.out.flush()?;
        Ok(self.written)
    }
}

/// Shared strings (dict keys, action names, the empty string): written once,
/// referenced after.
#[derive(Default)]
struct Shared(HashMap<&'static str, u32>);

impl Shared {
    fn put<W: Write>(&mut self, p: &mut Pickler<W>, s: &'static str) -> io::Result<()> {
        match self.0.get(s) {
            Some(&id) => p.get(id),
            None => {
                let id = p.str(s)?;
                self.0.insert(s, id);
                Ok(())
            }
        }
    }
}

const PY: &str = "/opt/conda/lib/python3.11/site-packages/torch";
const LIB: &str = "/opt/conda/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so";

/// The distinct frames `(filename, line, name)` and the stacks built of them.
struct Code {
    frames: Vec<(String, i64, String)>,
    /// Forward allocation sites (activation, temporaries), the backward
    /// temporary, optimizer temporaries, weight initialisation.
    fwd: [Vec<usize>; 3],
    bwd: Vec<usize>,
    opt: Vec<usize>,
    init: Vec<usize>,
    /// The free site (autograd releasing saved tensors).
    free: Vec<usize>,
}

fn code() -> Code {
    let mut frames = Vec::new();
    let mut f = |file: String, line: i64, name: &str| {
        frames.push((file, line, name.to_string()));
        frames.len() - 1
    };
    let cpp_alloc: Vec<usize> = [
        "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)",
        "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(void**, signed char, unsigned long, CUstream_st*)",
        "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)",
        "at::TensorBase at::detail::_empty_generic<long>(c10::ArrayRef<long>, c10::Allocator*, c10::DispatchKeySet, c10::ScalarType, std::optional<c10::MemoryFormat>)",
        "at::detail::empty_cuda(c10::ArrayRef<long>, c10::ScalarType, std::optional<c10::Device>, std::optional<c10::MemoryFormat>)",
        "at::native::empty_cuda(c10::ArrayRef<long>, std::optional<c10::ScalarType>, std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat>)",
    ]
    .iter()
    .map(|n| f(LIB.to_string(), 0, n))
    .collect();
    let module = f(format!("{PY}/nn/modules/module.py"), 1762, "_call_impl");
    let wrapped = f(
        format!("{PY}/nn/modules/module.py"),
        1751,
        "_wrapped_call_impl",
    );
    let linear = f(format!("{PY}/nn/modules/linear.py"), 125, "forward");
    let norm = f(format!("{PY}/nn/functional.py"), 2910, "layer_norm");
    let gelu = f(format!("{PY}/nn/functional.py"), 1700, "gelu");
    let attn = f("/home/user/proj/model.py".into(), 88, "forward");
    let mlp = f("/home/user/proj/model.py".into(), 131, "forward");
    let block = f("/home/user/proj/model.py".into(), 172, "forward");
    let model = f("/home/user/proj/model.py".into(), 245, "forward");
    let step = f("/home/user/proj/train.py".into(), 61, "train_step");
    let main = f("/home/user/proj/train.py".into(), 140, "<module>");
    let backward = f("/home/user/proj/train.py".into(), 64, "train_step");
    let tensor_bw = f(format!("{PY}/_tensor.py"), 648, "backward");
    let autograd_bw = f(format!("{PY}/autograd/__init__.py"), 353, "backward");
    let engine = f(
        format!("{PY}/autograd/graph.py"),
        824,
        "_engine_run_backward",
    );
    let adamw = f(format!("{PY}/optim/adamw.py"), 480, "_multi_tensor_adamw");
    let opt_step = f(format!("{PY}/optim/optimizer.py"), 485, "wrapper");
    let init = f("/home/user/proj/train.py".into(), 30, "<module>");
    let cpp_free: Vec<usize> = [
        "torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&, torch::autograd::Node*, torch::autograd::InputBuffer&, std::shared_ptr<torch::autograd::ReadyQueue> const&)",
        "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)",
        "torch::autograd::python::PythonEngine::thread_init(int, std::shared_ptr<torch::autograd::ReadyQueue> const&, bool)",
    ]
    .iter()
    .map(|n| f(LIB.to_string(), 0, n))
    .collect();
    let python_fwd = |leaf: usize, site: usize| {
        let mut s = cpp_alloc.clone();
        s.extend([
            leaf, module, wrapped, site, module, wrapped, block, module, wrapped,
        ]);
        s.extend([model, module, wrapped, step, main]);
        s
    };
    let mut bwd = cpp_alloc.clone();
    bwd.extend(cpp_free.iter().copied());
    bwd.extend([engine, autograd_bw, tensor_bw, backward, main]);
    let mut opt = cpp_alloc.clone();
    opt.extend([adamw, opt_step, main]);
    let mut init_s = cpp_alloc.clone();
    init_s.extend([linear, init]);
    let mut free = cpp_free.clone();
    free.extend([engine, autograd_bw, tensor_bw, backward, main]);
    Code {
        fwd: [
            python_fwd(linear, attn),
            python_fwd(norm, attn),
            python_fwd(gelu, mlp),
        ],
        bwd,
        opt,
        init: init_s,
        free,
        frames,
    }
}

/// One event as written.
struct Ev {
    action: &'static str,
    addr: u64,
    size: u64,
    stack: Option<&'static str>,
}

/// One training step's events on one device.
struct Step {
    events: Vec<Ev>,
    /// Peak requested bytes live in the step.
    live_peak: u64,
    /// Peak extent of the activation arena.
    top_peak: u64,
}

/// The activation arena: a stack, since a step frees in reverse order.
struct Arena {
    base: u64,
    top: u64,
    live: u64,
    stack: Vec<(u64, u64)>,
    step: Step,
}

impl Arena {
    fn alloc(&mut self, size: u64, site: &'static str) {
        let addr = self.base + self.top;
        self.step.events.push(Ev {
            action: "alloc",
            addr,
            size,
            stack: Some(site),
        });
        self.stack.push((addr, size));
        self.top += size.div_ceil(512) * 512;
        self.live += size;
        self.step.live_peak = self.step.live_peak.max(self.live);
        self.step.top_peak = self.step.top_peak.max(self.top);
    }

    fn free(&mut self) {
        let (addr, size) = self.stack.pop().expect("frees follow allocations");
        self.step.events.push(Ev {
            action: "free_requested",
            addr,
            size,
            stack: Some("free"),
        });
        self.step.events.push(Ev {
            action: "free_completed",
            addr,
            size,
            stack: None,
        });
        self.top = addr - self.base;
        self.live -= size;
    }
}

/// Step `s` of device `d`: forward (per layer an activation and two
/// temporaries), backward (per layer a temporary, then the activation is
/// freed), four optimizer temporaries. Nothing of the step is live after it.
fn step(cfg: &SynthConfig, layers: u64, base: u64, d: u64, s: u64) -> Step {
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ (d << 32) ^ ((s + 1) << 8));
    let seq = rng.gen_range(256u64..2048);
    let mut a = Arena {
        base,
        top: 0,
        live: 0,
        stack: Vec::new(),
        step: Step {
            events: Vec::with_capacity((layers * 15 + 12) as usize),
            live_peak: 0,
            top_peak: 0,
        },
    };
    for l in 0..layers {
        a.alloc(seq * 1024 * (2 + l % 3) + rng.gen_range(0..512), "fwd0");
        a.alloc(seq * 4096 + rng.gen_range(1..4096), "fwd1");
        a.free();
        a.alloc(seq * 8192 + rng.gen_range(1..4096), "fwd2");
        a.free();
    }
    for l in (0..layers).rev() {
        a.alloc(seq * 2048 + l * 512 + rng.gen_range(1..512), "bwd");
        a.free();
        a.free();
    }
    for _ in 0..4 {
        a.alloc(rng.gen_range(1u64 << 16..8 << 20), "opt");
        a.free();
    }
    a.step
}

/// Writes a synthetic snapshot to `out` (see the module docs).
pub fn write_snapshot<W: Write>(out: W, cfg: &SynthConfig) -> io::Result<SynthSummary> {
    if !(2..=5).contains(&cfg.protocol) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("protocol {} (2-5 are)", cfg.protocol),
        ));
    }
    let layers = cfg.layers.max(1) as u64;
    let devices = cfg.devices.max(1) as u64;
    // Bytes per step, measured on this writer's output (about 116 per event).
    let events_per_step = layers * 12 + 12;
    let per_step = events_per_step * 116;
    let steps = ((cfg.target_bytes / devices + per_step / 2) / per_step).max(1);
    let code = code();
    let mut p = Pickler::new(io::BufWriter::with_capacity(1 << 20, out), cfg.protocol)?;
    let mut w = Graph {
        cfg,
        layers,
        devices,
        code: &code,
        keys: Shared::default(),
        frame_ids: vec![None; code.frames.len()],
    };
    let weights = weights(cfg, layers, devices);
    let (mut summary, top_peaks) = w.count(steps, &weights);
    let events_total = summary.events;
    p.container(true, 4, |p, k| match k {
        0 => {
            w.keys.put(p, "segments")?;
            w.segments(p, &weights, &top_peaks)
        }
        1 => {
            w.keys.put(p, "device_traces")?;
            w.device_traces(p, events_total)
        }
        2 => {
            w.keys.put(p, "allocator_settings")?;
            w.allocator_settings(p)
        }
        _ => {
            w.keys.put(p, "external_annotations")?;
            p.container(false, 0, |_, _| Ok(())).map(drop)
        }
    })?;
    summary.bytes = p.finish()?;
    Ok(summary)
}

/// Weights and optimizer state of each device: per layer four matrices and
/// two Adam moments each, `(address, requested size)`.
fn weights(cfg: &SynthConfig, layers: u64, devices: u64) -> Vec<Vec<(u64, u64)>> {
    let mut weights: Vec<Vec<(u64, u64)>> = Vec::new();
    for d in 0..devices {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ (d << 32));
        let base = 0x7f00_0000_0000u64 + (d << 40);
        let mut at = base;
        let mut w = Vec::new();
        for _ in 0..layers * 12 {
            let size = rng.gen_range(1u64 << 20..48 << 20) & !511;
            w.push((at, size));
            at += size.div_ceil(2 << 20) * (2 << 20);
        }
        weights.push(w);
    }
    weights
}

/// The base address of device `d`'s activation arena.
fn act_base(d: u64) -> u64 {
    0x7f80_0000_0000u64 + (d << 40)
}

impl Code {
    /// The stack of allocation (or free) site `name`.
    fn site(&self, name: &str) -> &[usize] {
        match name {
            "fwd0" => &self.fwd[0],
            "fwd1" => &self.fwd[1],
            "fwd2" => &self.fwd[2],
            "bwd" => &self.bwd,
            "opt" => &self.opt,
            "init" => &self.init,
            _ => &self.free,
        }
    }
}

/// What the parts of the object graph are written with: the configuration,
/// the frames, and the strings and frame dicts already written (memo ids).
struct Graph<'a> {
    cfg: &'a SynthConfig,
    layers: u64,
    devices: u64,
    code: &'a Code,
    keys: Shared,
    frame_ids: Vec<Option<u32>>,
}

impl Graph<'_> {
    /// Step `s` of device `d`.
    fn step_events(&self, d: u64, s: u64) -> Step {
        step(self.cfg, self.layers, act_base(d), d, s)
    }

    /// The summary (events, allocations, peaks of device 0) and each device's
    /// activation arena size (a first pass over the steps; their events are
    /// regenerated when written).
    fn count(&self, steps: u64, weights: &[Vec<(u64, u64)>]) -> (SynthSummary, Vec<u64>) {
        let mut summary = SynthSummary {
            steps,
            ..SynthSummary::default()
        };
        let mut top_peaks = Vec::new();
        for d in 0..self.devices {
            let (mut lp, mut tp) = (0, 0);
            for s in 0..steps {
                let st = self.step_events(d, s);
                lp = u64::max(lp, st.live_peak);
                tp = u64::max(tp, st.top_peak);
                summary.events += st.events.len() as u64;
                summary.allocs += st.events.iter().filter(|e| e.action == "alloc").count() as u64;
            }
            if d == 0 {
                summary.peak_live = weights[0].iter().map(|w| w.1).sum::<u64>() + lp;
            }
            top_peaks.push(tp.max(1).div_ceil(2 << 20) * (2 << 20));
        }
        summary.pre_trace = weights[0].len() as u64;
        (summary, top_peaks)
    }

    /// A stack: a new list of shared frame dicts.
    fn stack<W: Write>(&mut self, p: &mut Pickler<W>, frames: &[usize]) -> io::Result<()> {
        p.container(false, frames.len(), |p, i| {
            let f = frames[i];
            if let Some(id) = self.frame_ids[f] {
                return p.get(id);
            }
            let (file, line, name) = &self.code.frames[f];
            let keys = &mut self.keys;
            let id = p.container(true, 3, |p, k| match k {
                0 => {
                    keys.put(p, "name")?;
                    p.str(name).map(drop)
                }
                1 => {
                    keys.put(p, "filename")?;
                    p.str(file).map(drop)
                }
                _ => {
                    keys.put(p, "line")?;
                    p.int(*line)
                }
            })?;
            self.frame_ids[f] = Some(id);
            Ok(())
        })
        .map(drop)
    }

    /// `segments`: one per weight (active) and one activation arena per
    /// device (inactive).
    fn segments<W: Write>(
        &mut self,
        p: &mut Pickler<W>,
        weights: &[Vec<(u64, u64)>],
        top_peaks: &[u64],
    ) -> io::Result<()> {
        let n_segments = weights.iter().map(Vec::len).sum::<usize>() + self.devices as usize;
        p.container(false, n_segments, |p, i| {
            // Segment i: a weight, or a device's activation arena.
            let mut left = i;
            let mut d = 0;
            while left > weights[d].len() {
                left -= weights[d].len() + 1;
                d += 1;
            }
            let seg = if left < weights[d].len() {
                let (a, s) = weights[d][left];
                (a, s.div_ceil(2 << 20) * (2 << 20), s, "active_allocated")
            } else {
                (act_base(d as u64), top_peaks[d], 0, "inactive")
            };
            self.segment(p, d, seg)
        })
        .map(drop)
    }

    /// One segment of device `d` holding one block: `(address, total size,
    /// requested size, block state)`.
    fn segment<W: Write>(
        &mut self,
        p: &mut Pickler<W>,
        d: usize,
        (address, total, requested, state): (u64, u64, u64, &'static str),
    ) -> io::Result<()> {
        let active = if requested > 0 { total } else { 0 };
        p.container(true, 12, |p, k| match k {
            0 => {
                self.keys.put(p, "device")?;
                p.int(d as i64)
            }
            1 => {
                self.keys.put(p, "address")?;
                p.int(address as i64)
            }
            2 => {
                self.keys.put(p, "total_size")?;
                p.int(total as i64)
            }
            3 => {
                self.keys.put(p, "allocated_size")?;
                p.int(active as i64)
            }
            4 => {
                self.keys.put(p, "active_size")?;
                p.int(active as i64)
            }
            5 => {
                self.keys.put(p, "requested_size")?;
                p.int(requested as i64)
            }
            6 => {
                self.keys.put(p, "stream")?;
                p.int(0)
            }
            7 => {
                self.keys.put(p, "segment_type")?;
                self.keys.put(p, "large")
            }
            8 => {
                self.keys.put(p, "segment_pool_id")?;
                p.tuple2(0, 0)
            }
            9 => {
                self.keys.put(p, "is_expandable")?;
                p.bool(false)
            }
            10 => {
                self.keys.put(p, "frames")?;
                p.container(false, 0, |_, _| Ok(())).map(drop)
            }
            _ => {
                self.keys.put(p, "blocks")?;
                p.container(false, 1, |p, _| {
                    p.container(true, 5, |p, k| match k {
                        0 => {
                            self.keys.put(p, "address")?;
                            p.int(address as i64)
                        }
                        1 => {
                            self.keys.put(p, "size")?;
                            p.int(total as i64)
                        }
                        2 => {
                            self.keys.put(p, "requested_size")?;
                            p.int(requested as i64)
                        }
                        3 => {
                            self.keys.put(p, "state")?;
                            self.keys.put(p, state)
                        }
                        _ => {
                            self.keys.put(p, "frames")?;
                            let code = self.code;
                            let st: &[usize] = if requested > 0 {
                                code.site("init")
                            } else {
                                &[]
                            };
                            self.stack(p, st)
                        }
                    })
                    .map(drop)
                })
                .map(drop)
            }
        })
        .map(drop)
    }

    /// `device_traces`: per device, its steps' events one after another.
    fn device_traces<W: Write>(&mut self, p: &mut Pickler<W>, events_total: u64) -> io::Result<()> {
        let mut time = 1_765_000_000_000_000i64;
        let devices = self.devices;
        p.container(false, devices as usize, |p, d| {
            let n = (events_total / devices) as usize;
            let mut cur: Option<(u64, std::vec::IntoIter<Ev>)> = None;
            p.container(false, n, |p, _| {
                let e = loop {
                    if let Some((_, it)) = cur.as_mut() {
                        if let Some(e) = it.next() {
                            break e;
                        }
                    }
                    let s = cur.as_ref().map_or(0, |c| c.0 + 1);
                    cur = Some((s, self.step_events(d as u64, s).events.into_iter()));
                };
                time += 7;
                self.event(p, &e, time)
            })
            .map(drop)
        })
        .map(drop)
    }

    /// One event dict at `time` (µs).
    fn event<W: Write>(&mut self, p: &mut Pickler<W>, e: &Ev, time: i64) -> io::Result<()> {
        p.container(true, 8, |p, k| match k {
            0 => {
                self.keys.put(p, "action")?;
                self.keys.put(p, e.action)
            }
            1 => {
                self.keys.put(p, "addr")?;
                p.int(e.addr as i64)
            }
            2 => {
                self.keys.put(p, "size")?;
                p.int(e.size as i64)
            }
            3 => {
                self.keys.put(p, "stream")?;
                p.int(0)
            }
            4 => {
                self.keys.put(p, "time_us")?;
                p.int(time)
            }
            5 => {
                self.keys.put(p, "compile_context")?;
                p.str("N/A").map(drop)
            }
            6 => {
                self.keys.put(p, "user_metadata")?;
                self.keys.put(p, "")
            }
            _ => {
                self.keys.put(p, "frames")?;
                let code = self.code;
                let st: &[usize] = e.stack.map_or(&[], |s| code.site(s));
                self.stack(p, st)
            }
        })
        .map(drop)
    }

    /// `allocator_settings` as PyTorch's defaults show them.
    fn allocator_settings<W: Write>(&mut self, p: &mut Pickler<W>) -> io::Result<()> {
        let keys = &mut self.keys;
        p.container(true, 9, |p, k| match k {
            0 => {
                keys.put(p, "PYTORCH_CUDA_ALLOC_CONF")?;
                keys.put(p, "")
            }
            1 => {
                keys.put(p, "max_split_size")?;
                p.int(-1)
            }
            2 => {
                keys.put(p, "garbage_collection_threshold")?;
                p.float(0.0)
            }
            3 => {
                keys.put(p, "expandable_segments")?;
                p.bool(false)
            }
            4 => {
                keys.put(p, "pinned_num_register_threads")?;
                p.int(1)
            }
            5 => {
                keys.put(p, "release_lock_on_cudamalloc")?;
                p.bool(false)
            }
            6 => {
                keys.put(p, "pinned_use_cuda_host_register")?;
                p.bool(false)
            }
            7 => {
                keys.put(p, "graph_capture_record_stream_reuse")?;
                p.bool(false)
            }
            _ => {
                keys.put(p, "roundup_power2_divisions")?;
                const POW: [&str; 16] = [
                    "1", "2", "4", "8", "16", "32", "64", "128", "256", "512", "1024", "2048",
                    "4096", "8192", "16384", "32768",
                ];
                p.container(true, POW.len(), |p, i| {
                    keys.put(p, POW[i])?;
                    p.int(0)
                })
                .map(drop)
            }
        })
        .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(cfg: &SynthConfig) -> (Vec<u8>, SynthSummary) {
        let mut b = Vec::new();
        let s = write_snapshot(&mut b, cfg).unwrap();
        assert_eq!(s.bytes, b.len() as u64);
        (b, s)
    }

    #[test]
    fn the_reader_finds_what_the_generator_wrote_and_agrees_with_the_old_reader() {
        for (protocol, devices) in [(4, 1), (5, 2), (2, 1), (3, 2)] {
            let cfg = SynthConfig {
                target_bytes: 400_000,
                layers: 6,
                devices,
                protocol,
                seed: 7,
            };
            let (b, s) = snapshot(&cfg);
            let t = vmmalloc_trace::pytorch::parse_snapshot(&b, "synth").unwrap();
            assert_eq!(t.devices.len(), devices as usize);
            let d = &t.devices[0];
            assert!(d.warnings().is_empty(), "{:?}", d.warnings());
            assert_eq!(d.peak_live_bytes(), s.peak_live);
            assert_eq!(d.pre_trace().len() as u64, s.pre_trace);
            assert_eq!(t.num_events() as u64, s.events);
            assert_eq!(
                t.devices.iter().map(|d| d.allocs() as u64).sum::<u64>(),
                s.allocs
            );
            // Every allocation has its stack; the stacks are shared, not copied.
            assert_eq!(d.frames().len(), d.allocs());
            let distinct: std::collections::HashSet<*const Frame> =
                d.frames().values().map(|st| st.as_ptr()).collect();
            assert_eq!(distinct.len(), 5, "one stack per allocation site");
            let old = crate::legacy::parse_snapshot(&b, "synth").unwrap();
            assert_eq!(t, old, "protocol {protocol}");
        }
    }

    #[test]
    fn sizes_follow_the_target() {
        for target in [200_000u64, 2_000_000] {
            let (b, _) = snapshot(&SynthConfig {
                target_bytes: target,
                ..SynthConfig::default()
            });
            let ratio = b.len() as f64 / target as f64;
            assert!((0.8..1.3).contains(&ratio), "{} for {target}", b.len());
        }
    }

    /// Python's own pickler writes the same opcodes for the object graph it
    /// reads back (frame boundaries aside, which no reader depends on).
    #[test]
    fn python_pickles_the_same_object_graph_the_same_way() {
        let (b, _) = snapshot(&SynthConfig {
            target_bytes: 300_000,
            layers: 4,
            ..SynthConfig::default()
        });
        let dir = std::env::temp_dir().join(format!("vmmalloc-synth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.pickle");
        std::fs::write(&path, &b).unwrap();
        let script = "import pickle, pickletools, sys\n\
            d = open(sys.argv[1], 'rb').read()\n\
            o = pickle.loads(d)\n\
            ops = lambda b: [(op.name, a) for op, a, _ in pickletools.genops(b) if op.name != 'FRAME']\n\
            r = pickle.dumps(o, protocol=4)\n\
            assert ops(r) == ops(d), 'opcodes differ'\n\
            assert len(r) == len(d)\n\
            print(len(o['device_traces'][0]))\n";
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&path)
            .output()
            .expect("python3 runs (the CI has it for the plug-in's tests)");
        std::fs::remove_dir_all(&dir).ok();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
