//! The bundled real snapshot: counts, reconstruction, peak live, text round trip.

use std::path::PathBuf;

use vmmalloc_trace::{load_path, pytorch, text, EventKind, Trace};

fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cs336_lm_step.pickle")
}

fn fixture() -> Trace {
    pytorch::read_snapshot(&fixture_path()).expect("the fixture reads")
}

#[test]
fn fixture_counts() {
    let t = fixture();
    assert_eq!(t.name, "cs336_lm_step");
    assert_eq!(t.devices.len(), 1);
    let d = &t.devices[0];
    assert_eq!(d.device(), 0);
    assert_eq!(d.events().len(), 5163);
    assert_eq!(d.allocs(), 1721);
    let count = |k: EventKind| d.events().iter().filter(|e| e.kind == k).count();
    assert_eq!(count(EventKind::Alloc), 1721);
    assert_eq!(count(EventKind::Free), 1721);
    assert_eq!(count(EventKind::FreeRequested), 1721);
    assert_eq!(d.segments_final().len(), 216);
    assert!(d
        .segments_final()
        .iter()
        .all(|s| s.is_expandable == Some(false)));
    assert_eq!(
        d.allocator_settings()
            .get("expandable_segments")
            .map(String::as_str),
        Some("False")
    );
    assert!(d.warnings().is_empty(), "{:?}", d.warnings());
    assert!(d.events().iter().all(|e| e.time_us.is_some()));
}

#[test]
fn fixture_peak_live_is_the_reference_figure() {
    let t = fixture();
    let d = &t.devices[0];
    assert_eq!(d.peak_live_bytes(), 13_923_997_700);
    // 227 final active blocks never touched by the trace, plus 2 addresses
    // freed before being allocated.
    assert_eq!(d.pre_trace().len(), 229);
    assert_eq!(d.pre_trace_live_bytes(), 1_373_919_236);
    assert!(d.pre_trace().windows(2).all(|w| w[0].addr < w[1].addr));
    assert_eq!(d.num_ids() as usize, 229 + 1721);
}

#[test]
fn fixture_through_text_keeps_replay_and_peak() {
    let t = fixture();
    let s = text::to_text(&t);
    let back = text::parse_text(&s, "ignored").unwrap();
    assert_eq!(back.name, t.name);
    let (a, b) = (&t.devices[0], &back.devices[0]);
    assert_eq!(a.replay_ops(), b.replay_ops());
    assert_eq!(a.peak_live_bytes(), b.peak_live_bytes());
    assert_eq!(a.events(), b.events());
    assert_eq!(a.pre_trace(), b.pre_trace());
    assert_eq!(a.allocator_settings(), b.allocator_settings());
    assert!(b.segments_final().is_empty());
    assert_eq!(text::to_text(&back), s);
}

#[test]
fn load_path_detects_both_formats() {
    let t = load_path(&fixture_path()).unwrap();
    assert_eq!(t.devices[0].peak_live_bytes(), 13_923_997_700);
    let dir = std::env::temp_dir().join(format!("vmmalloc-trace-fixture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("cs336.trace");
    text::write_text(&t, &p).unwrap();
    let back = load_path(&p).unwrap();
    assert_eq!(back.devices[0].replay_ops(), t.devices[0].replay_ops());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_fixture_keeps_the_stacks_of_its_allocations() {
    let t = fixture();
    let dt = &t.devices[0];
    // 655 of its 1721 `alloc` events carry frames.
    assert!(
        dt.warnings().iter().all(|w| !w.contains("frames")),
        "{:?}",
        dt.warnings()
    );
    assert_eq!(dt.frames().len(), 655);
    assert_eq!(dt.parts().frames.len(), 655);
    let st = dt.frames().values().next().unwrap();
    assert!(!st.is_empty());
    let all: Vec<String> = dt
        .frames()
        .values()
        .map(|s| vmmalloc_alloc::frames::describe(s))
        .collect();
    assert!(
        all.iter().any(|d| d.starts_with("model.py:54 forward")),
        "{:?}",
        &all[..5]
    );
}
