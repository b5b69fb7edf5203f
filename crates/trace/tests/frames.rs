//! Stack frames from the input survive into the replay's out-of-memory report.

use std::collections::BTreeMap;
use std::sync::Arc;
use vmmalloc_alloc::{Frame, Policy};
use vmmalloc_trace::replay::{replay, ReplayConfig};
use vmmalloc_trace::{DeviceTrace, DeviceTraceParts, Event, EventKind};

const MIB: u64 = 1 << 20;

fn ev(kind: EventKind, addr: u64, size: u64) -> Event {
    Event {
        kind,
        addr,
        size,
        stream: 0,
        time_us: None,
    }
}

#[test]
fn oom_report_names_the_stacks_of_pinning_allocations() {
    // Three 20 MiB caching segments, each split into a 6 MiB block that stays
    // (allocated at model.py:54 forward) and a 14 MiB one that is freed; then
    // 16 MiB does not fit in 64 MiB.
    let mut events = Vec::new();
    let mut frames = BTreeMap::new();
    for i in 0..3u64 {
        frames.insert(
            events.len(),
            Arc::from(vec![
                Frame {
                    filename: "/venv/lib/python3.12/site-packages/torch/nn/functional.py".into(),
                    line: 10,
                    name: "linear".into(),
                },
                Frame {
                    filename: "/home/u/model.py".into(),
                    line: 54,
                    name: "forward".into(),
                },
            ]),
        );
        events.push(ev(EventKind::Alloc, 0x1000 + i, 6 * MIB));
        events.push(ev(EventKind::Alloc, 0x2000 + i, 14 * MIB));
    }
    for i in 0..3u64 {
        events.push(ev(EventKind::Free, 0x2000 + i, 14 * MIB));
    }
    events.push(ev(EventKind::Alloc, 0x3000, 16 * MIB));
    let dt = DeviceTrace::new(DeviceTraceParts {
        events,
        frames,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(dt.frames().len(), 3);
    let mut cfg = ReplayConfig::new(Policy::Caching, 64 * MIB);
    let plain = replay(dt.replay_ops(), &cfg);
    let m = plain.oom_message.expect("out of memory");
    assert!(!m.contains("model.py"), "{m}");
    cfg.frames = Some(dt.frames().clone());
    let r = replay(dt.replay_ops(), &cfg);
    let m = r.oom_message.expect("out of memory");
    assert_eq!(m.matches("(model.py:54 forward)").count(), 3, "{m}");
}
