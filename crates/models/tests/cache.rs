//! The KV cache against a reference that keeps every written row in a Vec: random
//! sequences of multi-token writes and trims, across the 256-position growth boundary.
use mlx_core::{Array, Dtype};
use models::{KvCache, LayerCache, ModelCache};
use proptest::prelude::*;

const H: i32 = 2;
const D: i32 = 3;

/// A `[1, H, L, D]` block whose values encode (position, head, feature) uniquely.
fn block(start: usize, len: usize, salt: f32) -> (Array, Vec<Vec<f32>>) {
    let mut data = vec![0f32; (H as usize) * len * D as usize];
    let mut rows = Vec::new();
    for l in 0..len {
        let mut row = Vec::new();
        for h in 0..H as usize {
            for d in 0..D as usize {
                let v = salt + (start + l) as f32 * 100.0 + h as f32 * 10.0 + d as f32;
                data[(h * len + l) * D as usize + d] = v;
                row.push(v);
            }
        }
        rows.push(row);
    }
    (Array::from_slice(&data, &[1, H, len as i32, D]).unwrap(), rows)
}

/// Rows of a fetched `[1, H, T, D]` array, position-major like `block`'s.
fn rows_of(a: &Array) -> Vec<Vec<f32>> {
    let t = a.shape()[2] as usize;
    let v = a.to_vec::<f32>().unwrap();
    (0..t)
        .map(|l| {
            let mut row = Vec::new();
            for h in 0..H as usize {
                for d in 0..D as usize {
                    row.push(v[(h * t + l) * D as usize + d]);
                }
            }
            row
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Write(usize),
    Trim(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![3 => (1usize..40).prop_map(Op::Write), 1 => (0usize..50).prop_map(Op::Trim)],
        1..30,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn cache_matches_reference(ops in ops()) {
        let mut cache = KvCache::new();
        let mut reference: Vec<Vec<f32>> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Write(len) => {
                    let (k, rows) = block(reference.len(), len, i as f32 * 0.001);
                    let v = k.multiply(&Array::scalar(-1.0)).unwrap();
                    let (ck, cv) = cache.update_and_fetch(&k, &v).unwrap();
                    reference.extend(rows);
                    prop_assert_eq!(cache.offset(), reference.len());
                    prop_assert_eq!(rows_of(&ck), reference.clone());
                    let neg: Vec<Vec<f32>> = reference.iter().map(|r| r.iter().map(|x| -x).collect()).collect();
                    prop_assert_eq!(rows_of(&cv), neg);
                }
                Op::Trim(n) => {
                    let expect = n.min(reference.len());
                    prop_assert_eq!(cache.trim(n), expect);
                    reference.truncate(reference.len() - expect);
                    prop_assert_eq!(cache.offset(), reference.len());
                }
            }
        }
    }
}

#[test]
fn model_cache_trims_every_layer_and_reports_the_count() {
    let mut c = ModelCache::full(3);
    let (k, _) = block(0, 5, 0.0);
    for l in c.layers.iter_mut() {
        l.update_and_fetch(&k, &k).unwrap();
    }
    assert_eq!(c.offset(), 5);
    assert!(c.can_trim(2));
    assert_eq!(c.trim(2), 2);
    assert_eq!(c.offset(), 3);
    assert_eq!(c.trim(10), 3);
    assert_eq!(c.offset(), 0);
    assert_eq!(c.state().len(), 6);
    assert_eq!(c.state()[0].dtype(), Dtype::Float32);
}

/// The exact-rollback reach: unbounded for full caches, `R` for a rotating layer, the
/// smallest over the layers of a model cache.
#[test]
fn rollback_reach_is_the_smallest_bound_of_the_layers() {
    use models::RotatingKvCache;
    assert_eq!(KvCache::new().rollback_reach(), None);
    assert_eq!(ModelCache::full(3).rollback_reach(), None);
    assert_eq!(RotatingKvCache::new(8, 5).rollback_reach(), Some(5));
    let mixed = ModelCache {
        layers: vec![
            Box::new(KvCache::new()),
            Box::new(RotatingKvCache::new(8, 7)),
            Box::new(RotatingKvCache::new(16, 3)),
        ],
    };
    assert_eq!(mixed.rollback_reach(), Some(3));
}
