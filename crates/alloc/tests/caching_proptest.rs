//! Random operation sequences on the `sim` device for `caching` and `torch-es`,
//! checked against a shadow model of live allocations, with `validate()` after
//! every step, and a run with injected driver faults.

use proptest::prelude::*;
use std::sync::Arc;
use vmmalloc_alloc::caching::{CachingAllocator, CachingConfig};
use vmmalloc_alloc::torch_es::TorchEsAllocator;
use vmmalloc_alloc::{AllocError, Allocation, Allocator};
use vmmalloc_device::adaptors::{FaultInjecting, FaultKind, FaultPlan};
use vmmalloc_device::sim::SimDevice;
use vmmalloc_device::{Device, Introspect, Stream, MIB};

const CAPACITY: u64 = 256 * MIB;

#[derive(Debug, Clone)]
enum Op {
    Malloc {
        class: u8,
        raw: u64,
        stream: usize,
    },
    Free {
        idx: usize,
    },
    /// Queue work using the allocation on its own stream.
    Use {
        idx: usize,
    },
    /// `record_stream` on another stream and queue work there.
    UseOn {
        idx: usize,
        stream: usize,
    },
    Complete {
        stream: usize,
    },
    EmptyCache,
    Fraction {
        f: f64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u8..3, any::<u64>(), 0usize..2).prop_map(|(class, raw, stream)| Op::Malloc { class, raw, stream }),
        5 => any::<usize>().prop_map(|idx| Op::Free { idx }),
        2 => any::<usize>().prop_map(|idx| Op::Use { idx }),
        2 => (any::<usize>(), 0usize..2).prop_map(|(idx, stream)| Op::UseOn { idx, stream }),
        2 => (0usize..2).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
        1 => (30u32..=100).prop_map(|p| Op::Fraction { f: p as f64 / 100.0 }),
    ]
}

fn size_of(class: u8, raw: u64) -> u64 {
    match class {
        0 => 1 + raw % MIB,               // small pool
        1 => MIB + 1 + raw % (9 * MIB),   // 20 MiB segments / pages
        _ => 10 * MIB + raw % (70 * MIB), // rounded segments / several pages
    }
}

const CONFIGS: [&str; 5] = [
    "",
    "max_split_size_mb:32",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.5",
    "max_split_size_mb:40,roundup_power2_divisions:[1:2,16:4,>:8],max_non_split_rounding_mb:24",
];

struct Shadow {
    live: Vec<Allocation>,
}

impl Shadow {
    fn check_new(&self, x: &Allocation) -> Result<(), TestCaseError> {
        prop_assert!(x.size >= x.requested);
        for y in &self.live {
            prop_assert!(
                x.ptr + x.size <= y.ptr || y.ptr + y.size <= x.ptr,
                "{x:?} overlaps live {y:?}"
            );
        }
        Ok(())
    }
}

/// Runs `ops`; with `faults`, device errors are allowed but must change nothing.
fn run<D: Device>(
    dev: &D,
    a: &dyn Allocator,
    streams: &[Stream; 2],
    ops: &[Op],
    faults: bool,
) -> Result<(), TestCaseError> {
    let model = dev.introspect().expect("a model device");
    let mut sh = Shadow { live: Vec::new() };
    for op in ops {
        match *op {
            Op::Malloc { class, raw, stream } => {
                let size = size_of(class, raw);
                match a.malloc(size, streams[stream]) {
                    Ok(x) => {
                        prop_assert_eq!(x.requested, size);
                        prop_assert_eq!(x.stream, streams[stream]);
                        sh.check_new(&x)?;
                        prop_assert!(model.is_accessible(x.ptr, x.size));
                        sh.live.push(x);
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(AllocError::Device(_)) if faults => {}
                    Err(e) => prop_assert!(false, "malloc({size}) failed: {e}"),
                }
            }
            Op::Free { idx } => {
                if sh.live.is_empty() {
                    prop_assert!(a.free(0xdead_0000).is_err());
                } else {
                    let i = idx % sh.live.len();
                    match a.free(sh.live[i].ptr) {
                        Ok(()) => {
                            let x = sh.live.swap_remove(i);
                            prop_assert!(a.free(x.ptr).is_err(), "double free accepted");
                        }
                        Err(AllocError::Device(_)) if faults => {}
                        Err(e) => prop_assert!(false, "free failed: {e}"),
                    }
                }
            }
            Op::Use { idx } => {
                if !sh.live.is_empty() {
                    let x = sh.live[idx % sh.live.len()];
                    model
                        .streams()
                        .submit(x.stream, x.ptr, x.requested)
                        .unwrap();
                }
            }
            Op::UseOn { idx, stream } => {
                if !sh.live.is_empty() {
                    let x = sh.live[idx % sh.live.len()];
                    a.record_stream(x.ptr, streams[stream]).unwrap();
                    model
                        .streams()
                        .submit(streams[stream], x.ptr, x.requested)
                        .unwrap();
                }
            }
            Op::Complete { stream } => model.streams().complete(streams[stream]).unwrap(),
            Op::EmptyCache => match a.empty_cache() {
                Ok(()) => {}
                Err(AllocError::Device(_)) if faults => {}
                Err(e) => prop_assert!(false, "empty_cache failed: {e}"),
            },
            Op::Fraction { f } => match a.set_memory_fraction(f) {
                Ok(()) => {}
                Err(AllocError::Device(_)) if faults => {}
                Err(e) => prop_assert!(false, "set_memory_fraction failed: {e}"),
            },
        }
        if let Err(e) = a.validate() {
            prop_assert!(false, "after {op:?}: {e}");
        }
        let s = a.stats();
        prop_assert_eq!(s.allocation.all().current, sh.live.len() as i64);
        prop_assert_eq!(
            s.allocated_bytes.all().current,
            sh.live.iter().map(|x| x.size as i64).sum::<i64>()
        );
    }
    Ok(())
}

fn check_policy(expandable: bool, conf: &str, ops: &[Op]) -> Result<(), TestCaseError> {
    let dev = Arc::new(SimDevice::with_capacity(CAPACITY));
    let streams = [Stream::DEFAULT, dev.create_stream().unwrap()];
    let config = CachingConfig::parse(conf).unwrap();
    {
        let a: Box<dyn Allocator> = if expandable {
            Box::new(TorchEsAllocator::new(dev.clone(), config).unwrap())
        } else {
            Box::new(CachingAllocator::new(dev.clone(), config).unwrap())
        };
        run(&dev, a.as_ref(), &streams, ops, false)?;
    }
    prop_assert!(
        dev.live().is_empty(),
        "left on the device after drop: {:?}",
        dev.live()
    );
    prop_assert!(dev.check().is_ok());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn caching_validates_after_every_step(conf in 0usize..CONFIGS.len(), ops in prop::collection::vec(op(), 1..60)) {
        check_policy(false, CONFIGS[conf], &ops)?;
    }

    #[test]
    fn torch_es_validates_after_every_step(conf in 0usize..CONFIGS.len(), ops in prop::collection::vec(op(), 1..60)) {
        check_policy(true, CONFIGS[conf], &ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn driver_faults_never_corrupt_state(
        expandable in any::<bool>(),
        seed in any::<u64>(),
        ops in prop::collection::vec(op(), 1..50),
    ) {
        let dev = Arc::new(SimDevice::with_capacity(CAPACITY));
        let faulty = Arc::new(FaultInjecting::with_plan(dev.clone(), FaultPlan::None));
        let streams = [Stream::DEFAULT, faulty.create_stream().unwrap()];
        let a: Box<dyn Allocator> = if expandable {
            Box::new(TorchEsAllocator::new(faulty.clone(), CachingConfig::default()).unwrap())
        } else {
            Box::new(CachingAllocator::new(faulty.clone(), CachingConfig::default()).unwrap())
        };
        faulty.hook().set_plan(FaultPlan::Random { calls: vec![], p: 0.05, seed, kind: FaultKind::Driver(999) });
        run(&faulty, a.as_ref(), &streams, &ops, true)?;
        faulty.hook().set_plan(FaultPlan::None);
        a.validate().map_err(TestCaseError::fail)?;
    }
}
