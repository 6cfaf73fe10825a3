//! The disk cache of a target's cost curve (`spec::policy::CurveCache`) on the tiny llama
//! fixture: a cached curve whose one-token step time the machine no longer runs at (one
//! measured while the machine was loaded) is measured again and replaced, not reused.
use std::path::PathBuf;

use models::{LoadOptions, load_model};
use spec::policy::{CostCurve, CostModel, CurveCache, STALE_STEP_RATIO};

#[test]
fn a_curve_cached_at_another_pace_is_measured_again() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity/llama");
    let target = load_model(&dir, &LoadOptions::default()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let cache = CurveCache { path: tmp.path().join("curve.json"), key: "test-key".into() };
    // "measured" on a machine 10 s per step slow: no machine runs the tiny fixture that slowly
    let loaded = CostCurve::from_ms(&[10_000.0, 30_000.0, 50_000.0]).unwrap();
    cache.store(&loaded);
    assert_eq!(cache.load().unwrap().step_ms, 10_000.0);

    let curve = CostModel::measure(Some(cache.clone())).curve(&target).unwrap();
    assert_eq!(curve.origin, "measured", "{curve:?}");
    assert!(curve.step_ms * STALE_STEP_RATIO < 10_000.0, "{curve:?}");
    let stored = cache.load().expect("the new curve replaces the stale one");
    // (the file holds the times rounded as `CostCurve` serializes them)
    assert!((stored.step_ms - curve.step_ms).abs() <= 1e-9 * curve.step_ms, "{stored:?} vs {curve:?}");
}
