//! Integration tests for `mlx_core::fast`: RMS norm, layer norm, RoPE and scaled dot-product
//! attention, each against the reference formula computed here in plain f64 loops.

use mlx_core::fast::{self, AttentionMask, Rope};
use mlx_core::*;

// ---------------------------------------------------------------- helpers

/// Deterministic test data in about [-2, 2]: a sum of two incommensurate sines.
fn data(n: usize, seed: f64) -> Vec<f32> {
    (0..n)
        .map(|i| (1.5 * (i as f64 * 0.731 + seed).sin() + 0.5 * (i as f64 * 2.17 + 3.0 * seed).cos()) as f32)
        .collect()
}

fn arr(data: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.to_vec::<f32>().unwrap()
}

/// Asserts `|got - want| <= tol * max(1, |want|)` elementwise.
#[track_caller]
fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "length");
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / w.abs().max(1.0);
        assert!(err.is_finite(), "element {i}: got {g}, want {w}");
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let i = worst.1;
    assert!(worst.0 <= tol, "element {i}: got {}, want {} (relative error {:e} > {tol:e})", got[i], want[i], worst.0);
}

const TOL: f64 = 1e-5;

// ---------------------------------------------------------------- norms

/// `x / sqrt(mean(x^2) + eps) * w` over rows of length `h`.
fn rms_norm_ref(x: &[f32], h: usize, w: Option<&[f32]>, eps: f64) -> Vec<f64> {
    x.chunks(h)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / h as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            row.iter().enumerate().map(move |(j, &v)| v as f64 * inv * w.map_or(1.0, |w| w[j] as f64))
        })
        .collect()
}

/// `(x - mean) / sqrt(var + eps) * w + b` over rows of length `h` (biased variance).
fn layer_norm_ref(x: &[f32], h: usize, w: Option<&[f32]>, b: Option<&[f32]>, eps: f64) -> Vec<f64> {
    x.chunks(h)
        .flat_map(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / h as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / h as f64;
            let inv = 1.0 / (var + eps).sqrt();
            row.iter().enumerate().map(move |(j, &v)| {
                (v as f64 - mean) * inv * w.map_or(1.0, |w| w[j] as f64) + b.map_or(0.0, |b| b[j] as f64)
            })
        })
        .collect()
}

#[test]
fn rms_norm_with_and_without_weight() {
    let h = 16;
    let x = data(3 * 4 * h, 0.3);
    let w = data(h, 1.1);
    let xa = arr(&x, &[3, 4, h as i32]);
    let wa = arr(&w, &[h as i32]);
    for eps in [1e-5f32, 1e-2] {
        let r = fast::rms_norm(&xa, Some(&wa), eps, &KernelPolicy::default()).unwrap();
        assert_eq!(r.shape(), vec![3, 4, h as i32]);
        assert_eq!(r.dtype(), Dtype::Float32);
        assert_close(&f32s(&r), &rms_norm_ref(&x, h, Some(&w), eps as f64), TOL);

        let r = fast::rms_norm(&xa, None, eps, &KernelPolicy::default()).unwrap();
        assert_close(&f32s(&r), &rms_norm_ref(&x, h, None, eps as f64), TOL);
    }
    // A hand-checked row: [3, 4] has mean square 12.5, so with eps 0 the output is x / sqrt(12.5).
    let r =
        fast::rms_norm(&arr(&[3., 4.], &[1, 2]), Some(&arr(&[1., 2.], &[2])), 0.0, &KernelPolicy::default()).unwrap();
    let s = 12.5f64.sqrt();
    assert_close(&f32s(&r), &[3.0 / s, 8.0 / s], TOL);
    // The weight must be [H].
    assert!(fast::rms_norm(&xa, Some(&arr(&[1., 2.], &[2])), 1e-5, &KernelPolicy::default()).is_err());
}

#[test]
fn rms_norm_bf16_input() {
    let h = 8;
    let x = data(2 * h, 0.9);
    let xa = arr(&x, &[2, h as i32]).astype(Dtype::Bfloat16).unwrap();
    let r = fast::rms_norm(&xa, None, 1e-5, &KernelPolicy::default()).unwrap();
    assert_eq!(r.dtype(), Dtype::Bfloat16);
    // Reference on the bf16-rounded inputs; bf16 output has about 3 significant digits.
    let xr = f32s(&xa.astype(Dtype::Float32).unwrap());
    assert_close(&f32s(&r.astype(Dtype::Float32).unwrap()), &rms_norm_ref(&xr, h, None, 1e-5), 1e-2);
}

#[test]
fn layer_norm_weight_and_bias_combinations() {
    let h = 12;
    let x = data(5 * h, 2.0);
    let w = data(h, 0.4);
    let b = data(h, 5.0);
    let xa = arr(&x, &[5, h as i32]);
    let (wa, ba) = (arr(&w, &[h as i32]), arr(&b, &[h as i32]));
    let eps = 1e-5;
    // (use weight, use bias)
    for (use_w, use_b) in [(true, true), (true, false), (false, true), (false, false)] {
        let (wa, w) = if use_w { (Some(&wa), Some(&w[..])) } else { (None, None) };
        let (ba, b) = if use_b { (Some(&ba), Some(&b[..])) } else { (None, None) };
        let r = fast::layer_norm(&xa, wa, ba, eps).unwrap();
        assert_eq!(r.shape(), vec![5, h as i32]);
        assert_close(&f32s(&r), &layer_norm_ref(&x, h, w, b, eps as f64), TOL);
    }
    // Hand-checked: [1, 3] has mean 2, variance 1 -> [-1, 1] (eps 0), then * [2, 3] + [10, 20].
    let r = fast::layer_norm(&arr(&[1., 3.], &[1, 2]), Some(&arr(&[2., 3.], &[2])), Some(&arr(&[10., 20.], &[2])), 0.0)
        .unwrap();
    assert_close(&f32s(&r), &[8.0, 23.0], TOL);
    // A 3-D input normalizes over the last axis only.
    let x3 = arr(&x, &[5, 2, 6]);
    let r = fast::layer_norm(&x3, None, None, eps).unwrap();
    assert_close(&f32s(&r), &layer_norm_ref(&x, 6, None, None, eps as f64), TOL);
    assert!(fast::layer_norm(&xa, None, Some(&arr(&[1.], &[1])), eps).is_err());
}

// ---------------------------------------------------------------- RoPE

/// RoPE over `x [..., L, D]` (flattened; `rows` = product of the leading dims).
#[allow(clippy::too_many_arguments)]
fn rope_ref(
    x: &[f32],
    l: usize,
    d: usize,
    dims: usize,
    traditional: bool,
    base: f64,
    scale: f64,
    offset: i32,
    freqs: Option<&[f32]>,
) -> Vec<f64> {
    let half = dims / 2;
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for (r, row) in x.chunks(d).enumerate() {
        let pos = (offset as usize + r % l) as f64;
        for i in 0..half {
            let inv_freq = match freqs {
                Some(f) => 1.0 / f[i] as f64,
                None => base.powf(-2.0 * i as f64 / dims as f64),
            };
            let angle = pos * scale * inv_freq;
            let (a, b) = if traditional { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (xa, xb) = (row[a] as f64, row[b] as f64);
            out[r * d + a] = xa * angle.cos() - xb * angle.sin();
            out[r * d + b] = xa * angle.sin() + xb * angle.cos();
        }
    }
    out
}

/// `x [2, 3, 7, 8]` (B, H, L, D).
const RB: usize = 2;
const RH: usize = 3;
const RL: usize = 7;
const RD: usize = 8;

fn rope_input() -> (Vec<f32>, Array) {
    let x = data(RB * RH * RL * RD, 0.77);
    let a = arr(&x, &[RB as i32, RH as i32, RL as i32, RD as i32]);
    (x, a)
}

#[test]
fn rope_full_dims_both_layouts() {
    let (x, xa) = rope_input();
    for traditional in [false, true] {
        let rope = Rope { dims: RD as i32, traditional, base: 10000.0, scale: 1.0, freqs: None };
        let r = rope.apply(&xa, 0, &KernelPolicy::default()).unwrap();
        assert_eq!(r.shape(), xa.shape());
        let want = rope_ref(&x, RL, RD, RD, traditional, 10000.0, 1.0, 0, None);
        assert_close(&f32s(&r), &want, TOL);
    }
    // The two layouts really differ (so the test above tells them apart).
    let a = Rope { dims: RD as i32, traditional: false, base: 10000.0, scale: 1.0, freqs: None };
    let b = Rope { traditional: true, ..a.clone() };
    let (ra, rb) = (
        f32s(&a.apply(&xa, 0, &KernelPolicy::default()).unwrap()),
        f32s(&b.apply(&xa, 0, &KernelPolicy::default()).unwrap()),
    );
    assert!(ra.iter().zip(&rb).any(|(p, q)| (p - q).abs() > 1e-2));
    // Position 0 is the identity.
    assert_eq!(&ra[..RD], &x[..RD]);
}

#[test]
fn rope_with_offset_and_scale() {
    let (x, xa) = rope_input();
    for traditional in [false, true] {
        for (offset, scale) in [(5, 1.0f32), (13, 0.25), (0, 0.5)] {
            let rope = Rope { dims: RD as i32, traditional, base: 500.0, scale, freqs: None };
            let r = rope.apply(&xa, offset, &KernelPolicy::default()).unwrap();
            let want = rope_ref(&x, RL, RD, RD, traditional, 500.0, scale as f64, offset, None);
            assert_close(&f32s(&r), &want, TOL);
        }
    }
    // Offset k on row 0 equals offset 0 on row k (the KV-cache property).
    let rope = Rope { dims: RD as i32, traditional: false, base: 10000.0, scale: 1.0, freqs: None };
    let row3 = xa.slice_axis(2, 3, 4).unwrap();
    let direct = f32s(&rope.apply(&xa, 0, &KernelPolicy::default()).unwrap().slice_axis(2, 3, 4).unwrap());
    let shifted = f32s(&rope.apply(&row3, 3, &KernelPolicy::default()).unwrap());
    let direct64: Vec<f64> = direct.iter().map(|&v| v as f64).collect();
    assert_close(&shifted, &direct64, TOL);
}

/// Per-row positions (several requests' rows in one node) give each row the bits of the
/// one-offset call at that row's position; MLX's path declines them; bad positions are
/// refused.
#[test]
fn rope_at_positions_equals_rope_at_each_offset() {
    let (_, xa) = rope_input();
    // Rows 0..3 of request A from offset 40, rows 3..7 of request B from offset 2.
    let positions = [40, 41, 42, 2, 3, 4, 5];
    let pos = Array::from_slice(&positions, &[RL as i32]).unwrap();
    let freqs = Array::from_slice(&[1.0f32, 30.0, 900.0, 27000.0], &[4]).unwrap();
    for rope in [
        Rope { dims: RD as i32, traditional: false, base: 10000.0, scale: 0.5, freqs: None },
        Rope { dims: 4, traditional: true, base: 500.0, scale: 1.0, freqs: None },
        Rope { dims: RD as i32, traditional: false, base: 0.0, scale: 1.0, freqs: Some(freqs.clone()) },
    ] {
        let all = rope.apply_at(&xa, &pos, &KernelPolicy::default()).unwrap().unwrap();
        let bits = |a: &Array| f32s(a).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (lo, hi, offset) in [(0, 3, 40), (3, 7, 2)] {
            let alone = rope.apply(&xa.slice_axis(2, lo, hi).unwrap(), offset, &KernelPolicy::default()).unwrap();
            assert_eq!(bits(&all.slice_axis(2, lo, hi).unwrap()), bits(&alone), "{rope:?} rows {lo}..{hi}");
        }
    }
    let rope = Rope { dims: RD as i32, traditional: false, base: 10000.0, scale: 1.0, freqs: None };
    let mlx = KernelPolicy { fast_norm_rope: false, ..KernelPolicy::default() };
    assert!(rope.apply_at(&xa, &pos, &mlx).unwrap().is_none());
    let short = Array::from_slice(&[1i32, 2], &[2]).unwrap();
    let err =
        rope.apply_at(&xa, &short, &KernelPolicy::default()).and_then(|a| a.unwrap().eval().map(|_| ())).unwrap_err();
    assert!(err.to_string().contains("positions must be int32 [7]"), "{err}");
}

#[test]
fn rope_custom_freqs() {
    let (x, xa) = rope_input();
    // Wavelengths (periods), theta_i = 1 / freqs[i].
    let freqs = [1.0f32, 3.5, 40.0, 900.0];
    let fa = arr(&freqs, &[4]);
    for traditional in [false, true] {
        // `base` is ignored when freqs are given.
        let rope = Rope { dims: RD as i32, traditional, base: 12345.0, scale: 1.0, freqs: Some(fa.clone()) };
        let r = rope.apply(&xa, 2, &KernelPolicy::default()).unwrap();
        let want = rope_ref(&x, RL, RD, RD, traditional, 0.0, 1.0, 2, Some(&freqs));
        assert_close(&f32s(&r), &want, TOL);
    }
    // freqs equal to base^(2i/dims) reproduce the default schedule.
    let base: f64 = 10000.0;
    let std_freqs: Vec<f32> = (0..RD / 2).map(|i| base.powf(2.0 * i as f64 / RD as f64) as f32).collect();
    let custom =
        Rope { dims: RD as i32, traditional: false, base: 1.0, scale: 1.0, freqs: Some(arr(&std_freqs, &[4])) };
    let default = Rope { dims: RD as i32, traditional: false, base: 10000.0, scale: 1.0, freqs: None };
    let c = f32s(&custom.apply(&xa, 1, &KernelPolicy::default()).unwrap());
    let d: Vec<f64> =
        f32s(&default.apply(&xa, 1, &KernelPolicy::default()).unwrap()).iter().map(|&v| v as f64).collect();
    assert_close(&c, &d, TOL);
    // freqs of the wrong length are rejected.
    let bad = Rope { freqs: Some(arr(&[1., 2.], &[2])), ..custom };
    assert!(bad.apply(&xa, 0, &KernelPolicy::default()).is_err());
}

#[test]
fn rope_partial_dims() {
    let (x, xa) = rope_input();
    for traditional in [false, true] {
        let rope = Rope { dims: 4, traditional, base: 10000.0, scale: 1.0, freqs: None };
        let r = f32s(&rope.apply(&xa, 1, &KernelPolicy::default()).unwrap());
        let want = rope_ref(&x, RL, RD, 4, traditional, 10000.0, 1.0, 1, None);
        assert_close(&r, &want, TOL);
        // Features 4.. pass through unchanged.
        for (row_out, row_in) in r.chunks(RD).zip(x.chunks(RD)) {
            assert_eq!(&row_out[4..], &row_in[4..]);
        }
    }
    // Partial dims with custom freqs ([dims / 2]).
    let freqs = [2.0f32, 50.0];
    let rope = Rope { dims: 4, traditional: false, base: 10000.0, scale: 1.0, freqs: Some(arr(&freqs, &[2])) };
    let want = rope_ref(&x, RL, RD, 4, false, 0.0, 1.0, 4, Some(&freqs));
    assert_close(&f32s(&rope.apply(&xa, 4, &KernelPolicy::default()).unwrap()), &want, TOL);
    // dims > D or odd dims are errors.
    let too_big = Rope { dims: 10, traditional: false, base: 10000.0, scale: 1.0, freqs: None };
    let e = too_big.apply(&xa, 0, &KernelPolicy::default()).unwrap_err();
    assert!(e.to_string().starts_with("rope: "), "{e}");
}

#[test]
fn rope_3d_input() {
    // [H, L, D] without a batch axis.
    let x = data(2 * 5 * 6, 1.9);
    let xa = arr(&x, &[2, 5, 6]);
    let rope = Rope { dims: 6, traditional: true, base: 100.0, scale: 1.0, freqs: None };
    let want = rope_ref(&x, 5, 6, 6, true, 100.0, 1.0, 7, None);
    assert_close(&f32s(&rope.apply(&xa, 7, &KernelPolicy::default()).unwrap()), &want, TOL);
}

// ---------------------------------------------------------------- attention

/// Shapes of one attention problem.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    lq: usize,
    lk: usize,
    d: usize,
    dv: usize,
}

/// `softmax(q k^T * scale + mask) v`; `mask(b, h, i, j)` is additive (-inf blocks).
fn sdpa_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: Dims,
    scale: f64,
    mask: impl Fn(usize, usize, usize, usize) -> f64,
) -> Vec<f64> {
    let group = s.hq / s.hkv;
    let mut out = vec![0.0; s.b * s.hq * s.lq * s.dv];
    for b in 0..s.b {
        for h in 0..s.hq {
            let kh = h / group;
            for i in 0..s.lq {
                let qrow = &q[((b * s.hq + h) * s.lq + i) * s.d..][..s.d];
                let scores: Vec<f64> = (0..s.lk)
                    .map(|j| {
                        let krow = &k[((b * s.hkv + kh) * s.lk + j) * s.d..][..s.d];
                        let dot: f64 = qrow.iter().zip(krow).map(|(&a, &c)| a as f64 * c as f64).sum();
                        dot * scale + mask(b, h, i, j)
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|&x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let o = &mut out[((b * s.hq + h) * s.lq + i) * s.dv..][..s.dv];
                for j in 0..s.lk {
                    let vrow = &v[((b * s.hkv + kh) * s.lk + j) * s.dv..][..s.dv];
                    for (oc, &vc) in o.iter_mut().zip(vrow) {
                        *oc += e[j] / z * vc as f64;
                    }
                }
            }
        }
    }
    out
}

struct Qkv {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    qa: Array,
    ka: Array,
    va: Array,
}

impl Qkv {
    /// `fast::scaled_dot_product_attention` of these inputs under the default kernel policy.
    fn sdpa(&self, scale: f32, mask: AttentionMask) -> mlx_core::Result<Array> {
        fast::scaled_dot_product_attention(&self.qa, &self.ka, &self.va, scale, mask, &KernelPolicy::default())
    }
}

fn qkv(s: Dims) -> Qkv {
    let q = data(s.b * s.hq * s.lq * s.d, 0.1);
    let k = data(s.b * s.hkv * s.lk * s.d, 2.3);
    let v = data(s.b * s.hkv * s.lk * s.dv, 4.7);
    let qa = arr(&q, &[s.b as i32, s.hq as i32, s.lq as i32, s.d as i32]);
    let ka = arr(&k, &[s.b as i32, s.hkv as i32, s.lk as i32, s.d as i32]);
    let va = arr(&v, &[s.b as i32, s.hkv as i32, s.lk as i32, s.dv as i32]);
    Qkv { q, k, v, qa, ka, va }
}

const MHA: Dims = Dims { b: 2, hq: 2, hkv: 2, lq: 3, lk: 5, d: 8, dv: 8 };

#[test]
fn sdpa_no_mask() {
    for s in [MHA, Dims { lq: 5, ..MHA }, Dims { lq: 1, lk: 9, ..MHA }, Dims { dv: 6, ..MHA }] {
        let t = qkv(s);
        let scale = 1.0 / (s.d as f32).sqrt();
        let r = t.sdpa(scale, AttentionMask::None).unwrap();
        assert_eq!(r.shape(), vec![s.b as i32, s.hq as i32, s.lq as i32, s.dv as i32]);
        let want = sdpa_ref(&t.q, &t.k, &t.v, s, scale as f64, |_, _, _, _| 0.0);
        assert_close(&f32s(&r), &want, TOL);
    }
}

#[test]
fn sdpa_causal_with_shorter_queries() {
    // Lq = 3 < Lk = 5: query i sees keys 0 ..= 2 + i.
    for s in [MHA, Dims { lq: 5, ..MHA }, Dims { lq: 1, lk: 4, ..MHA }] {
        let t = qkv(s);
        let scale = 0.3;
        let r = t.sdpa(scale, AttentionMask::Causal).unwrap();
        let off = s.lk - s.lq;
        let want = sdpa_ref(
            &t.q,
            &t.k,
            &t.v,
            s,
            scale as f64,
            |_, _, i, j| if j <= off + i { 0.0 } else { f64::NEG_INFINITY },
        );
        assert_close(&f32s(&r), &want, TOL);
    }
    // The causal result differs from the unmasked one (the mask is really applied).
    let t = qkv(MHA);
    let c = f32s(&t.sdpa(0.3, AttentionMask::Causal).unwrap());
    let n = f32s(&t.sdpa(0.3, AttentionMask::None).unwrap());
    assert!(c.iter().zip(&n).any(|(a, b)| (a - b).abs() > 1e-3));
}

#[test]
fn sdpa_additive_float_mask() {
    let s = MHA;
    let t = qkv(s);
    // [B, 1, Lq, Lk]: varied finite biases plus a blocked position per row.
    let mut m = vec![0.0f32; s.b * s.lq * s.lk];
    for b in 0..s.b {
        for i in 0..s.lq {
            for j in 0..s.lk {
                m[(b * s.lq + i) * s.lk + j] =
                    if (i + j + b) % 4 == 0 { f32::NEG_INFINITY } else { 0.5 * ((i * 3 + j + b) as f32).sin() };
            }
        }
    }
    let ma = arr(&m, &[s.b as i32, 1, s.lq as i32, s.lk as i32]);
    let scale = 0.35;
    let r = t.sdpa(scale, AttentionMask::Array(&ma)).unwrap();
    let want = sdpa_ref(&t.q, &t.k, &t.v, s, scale as f64, |b, _, i, j| m[(b * s.lq + i) * s.lk + j] as f64);
    assert_close(&f32s(&r), &want, TOL);

    // A [Lq, Lk] mask broadcasts over batch and heads.
    let m2: Vec<f32> = (0..s.lq * s.lk).map(|n| (n as f32 * 0.37).cos()).collect();
    let m2a = arr(&m2, &[s.lq as i32, s.lk as i32]);
    let r = t.sdpa(scale, AttentionMask::Array(&m2a)).unwrap();
    let want = sdpa_ref(&t.q, &t.k, &t.v, s, scale as f64, |_, _, i, j| m2[i * s.lk + j] as f64);
    assert_close(&f32s(&r), &want, TOL);
}

#[test]
fn sdpa_boolean_mask() {
    let s = MHA;
    let t = qkv(s);
    // [Lq, Lk], true = attend; every row keeps at least one key.
    let keep: Vec<bool> = (0..s.lq * s.lk).map(|n| n % 3 != 1).collect();
    let bytes: Vec<u8> = keep.iter().map(|&b| b as u8).collect();
    let ma = Array::from_bytes(&bytes, &[s.lq as i32, s.lk as i32], Dtype::Bool).unwrap();
    let scale = 0.4;
    let r = t.sdpa(scale, AttentionMask::Array(&ma)).unwrap();
    let want = sdpa_ref(
        &t.q,
        &t.k,
        &t.v,
        s,
        scale as f64,
        |_, _, i, j| {
            if keep[i * s.lk + j] { 0.0 } else { f64::NEG_INFINITY }
        },
    );
    assert_close(&f32s(&r), &want, TOL);

    // A bool causal mask built by hand equals AttentionMask::Causal.
    let off = (s.lk - s.lq) as i32;
    let qi = Array::arange(0.0, s.lq as f64, 1.0, Dtype::Int32).unwrap().reshape(&[s.lq as i32, 1]).unwrap();
    let kj = Array::arange(0.0, s.lk as f64, 1.0, Dtype::Int32).unwrap();
    let causal = kj.less_equal(&qi.add(&Array::scalar_as(off as f64, Dtype::Int32).unwrap()).unwrap()).unwrap();
    let by_mask = f32s(&t.sdpa(scale, AttentionMask::Array(&causal)).unwrap());
    let by_mode = t.sdpa(scale, AttentionMask::Causal).unwrap();
    let by_mask64: Vec<f64> = by_mask.iter().map(|&v| v as f64).collect();
    assert_close(&f32s(&by_mode), &by_mask64, TOL);
}

#[test]
fn sdpa_grouped_query_attention() {
    // Hq = 4 query heads share Hkv = 2 KV heads: heads 0, 1 use KV 0; heads 2, 3 use KV 1.
    let s = Dims { b: 2, hq: 4, hkv: 2, lq: 3, lk: 6, d: 8, dv: 8 };
    let t = qkv(s);
    let scale = 1.0 / (s.d as f32).sqrt();
    for causal in [false, true] {
        let mask = if causal { AttentionMask::Causal } else { AttentionMask::None };
        let r = t.sdpa(scale, mask).unwrap();
        assert_eq!(r.shape(), vec![2, 4, 3, 8]);
        let off = s.lk - s.lq;
        let want =
            sdpa_ref(
                &t.q,
                &t.k,
                &t.v,
                s,
                scale as f64,
                |_, _, i, j| {
                    if !causal || j <= off + i { 0.0 } else { f64::NEG_INFINITY }
                },
            );
        assert_close(&f32s(&r), &want, TOL);
    }
    // With a float mask [B, Hq, Lq, Lk] that differs per head.
    let m: Vec<f32> = (0..s.b * s.hq * s.lq * s.lk).map(|n| (n as f32 * 0.61).sin()).collect();
    let ma = arr(&m, &[s.b as i32, s.hq as i32, s.lq as i32, s.lk as i32]);
    let r = t.sdpa(scale, AttentionMask::Array(&ma)).unwrap();
    let want =
        sdpa_ref(&t.q, &t.k, &t.v, s, scale as f64, |b, h, i, j| m[((b * s.hq + h) * s.lq + i) * s.lk + j] as f64);
    assert_close(&f32s(&r), &want, TOL);
    // Head counts that do not divide are rejected.
    let bad = arr(&data(2 * 3 * 6 * 8, 0.0), &[2, 3, 6, 8]);
    let e = fast::scaled_dot_product_attention(&t.qa, &bad, &bad, scale, AttentionMask::None, &KernelPolicy::default())
        .unwrap_err();
    assert!(e.to_string().starts_with("scaled_dot_product_attention: "), "{e}");
}
