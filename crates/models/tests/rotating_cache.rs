//! The rotating (sliding-window) KV cache against a reference that keeps the full history
//! and recomputes windowed attention over it: random sequences of multi-token writes (in the
//! ring and, when longer than the rollback reach, through the concatenation path) and trims,
//! at any offset, before and after the ring wraps.
use mlx_core::fast::{AttentionMask, scaled_dot_product_attention};
use mlx_core::{Array, Dtype, KernelPolicy};
use models::{LayerCache, RotatingKvCache};
use proptest::prelude::*;

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 4;

/// A deterministic pseudo-random stream in [-1, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn rows(&mut self, n: usize, heads: usize) -> Vec<Vec<f32>> {
        // rows[position][head * D + d]
        (0..n).map(|_| (0..heads * D).map(|_| self.next()).collect()).collect()
    }
}

/// `[1, heads, L, D]` from position-major rows.
fn to_array(rows: &[Vec<f32>], heads: usize) -> Array {
    let l = rows.len();
    let mut data = vec![0f32; heads * l * D];
    for (p, row) in rows.iter().enumerate() {
        for h in 0..heads {
            for d in 0..D {
                data[(h * l + p) * D + d] = row[h * D + d];
            }
        }
    }
    Array::from_slice(&data, &[1, heads as i32, l as i32, D as i32]).unwrap()
}

/// Windowed attention of queries at positions `first..first + L` over the whole history.
fn reference(q: &[Vec<f32>], first: usize, keys: &[Vec<f32>], values: &[Vec<f32>], w: usize, scale: f32) -> Vec<f32> {
    let l = q.len();
    let mut out = vec![0f32; HQ * l * D];
    for (i, qrow) in q.iter().enumerate() {
        let pos = first + i;
        let lo = (pos + 1).saturating_sub(w);
        for h in 0..HQ {
            let kh = h / (HQ / HKV);
            let scores: Vec<f64> = (lo..=pos)
                .map(|k| (0..D).map(|d| (qrow[h * D + d] * keys[k][kh * D + d]) as f64).sum::<f64>() * scale as f64)
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..D {
                let v: f64 = (lo..=pos).zip(&e).map(|(k, p)| p * values[k][kh * D + d] as f64).sum();
                out[(h * l + i) * D + d] = (v / z) as f32;
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
enum Op {
    Write(usize),
    Trim(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            4 => (1usize..6).prop_map(Op::Write),
            1 => (6usize..20).prop_map(Op::Write),
            3 => (0usize..8).prop_map(Op::Trim),
        ],
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn rotating_cache_matches_full_history_windowed_attention(
        window in 1usize..7,
        rollback in 1usize..6,
        seed in any::<u64>(),
        ops in ops(),
    ) {
        let mut rng = Lcg(seed);
        let mut cache = RotatingKvCache::new(window, rollback);
        let (mut keys, mut values): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (Vec::new(), Vec::new());
        let scale = 0.7f32;
        // Length of the last write, None after a trim: rolling back within it by up to R
        // positions is always exact.
        let mut last_write: Option<usize> = None;
        for op in &ops {
            match *op {
                Op::Write(len) => {
                    let (k, v, q) = (rng.rows(len, HKV), rng.rows(len, HKV), rng.rows(len, HQ));
                    let first = keys.len();
                    keys.extend(k.iter().cloned());
                    values.extend(v.iter().cloned());
                    let (ck, cv) = cache.update_and_fetch(&to_array(&k, HKV), &to_array(&v, HKV)).unwrap();
                    prop_assert_eq!(cache.offset(), keys.len());
                    let mask = cache.attention_mask().unwrap();
                    let m = match &mask {
                        Some(m) => AttentionMask::Array(m),
                        None if len > 1 => AttentionMask::Causal,
                        None => AttentionMask::None,
                    };
                    let out = scaled_dot_product_attention(&to_array(&q, HQ), &ck, &cv, scale, m, &KernelPolicy::default())
                        .unwrap();
                    let got = out.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                    let want = reference(&q, first, &keys, &values, window, scale);
                    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                    prop_assert!(err < 1e-5, "write of {} at {}: attention differs by {}", len, first, err);
                    // The ring never holds more than W - 1 + R rows.
                    prop_assert!(ck.shape()[2] as usize <= (window - 1 + rollback).max(window - 1 + len));
                    last_write = Some(len);
                }
                Op::Trim(n) => {
                    let offset = keys.len();
                    let can = cache.can_trim(n);
                    if let Some(len) = last_write && n <= rollback.min(len) {
                        prop_assert!(can, "trim of {} <= rollback {} within the last write ({}) must be exact", n, rollback, len);
                    }
                    if n > offset {
                        prop_assert!(!can);
                    }
                    let removed = cache.trim(n);
                    if can {
                        prop_assert_eq!(removed, n);
                        keys.truncate(offset - n);
                        values.truncate(offset - n);
                    } else {
                        prop_assert_eq!(removed, 0, "an inexact trim must remove nothing");
                    }
                    prop_assert_eq!(cache.offset(), keys.len());
                    last_write = None;
                }
            }
        }
    }
}

/// A verify window of `R + 1` tokens after many wraps rolls back by up to `R` positions
/// exactly, at every offset modulo the ring size.
#[test]
fn verify_windows_roll_back_at_every_ring_offset() {
    let (w, r) = (5usize, 4usize);
    let cap = w - 1 + r;
    for start in 0..3 * cap {
        for rejected in 0..=r {
            let mut cache = RotatingKvCache::new(w, r);
            let mut rng = Lcg(start as u64 * 31 + rejected as u64);
            for _ in 0..start {
                let (k, v) = (rng.rows(1, HKV), rng.rows(1, HKV));
                cache.update_and_fetch(&to_array(&k, HKV), &to_array(&v, HKV)).unwrap();
            }
            let (k, v) = (rng.rows(r + 1, HKV), rng.rows(r + 1, HKV));
            cache.update_and_fetch(&to_array(&k, HKV), &to_array(&v, HKV)).unwrap();
            assert!(cache.can_trim(rejected), "start {start}, reject {rejected}");
            assert_eq!(cache.trim(rejected), rejected);
            assert_eq!(cache.offset(), start + r + 1 - rejected);
        }
    }
}
