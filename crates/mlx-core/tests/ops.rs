//! Integration tests for every public op of `mlx-core` (construction, inspection, copy-out,
//! elementwise math, matmul, shape manipulation, indexing, reductions, scans, sorting,
//! joining) and for its error reporting.
//!
//! Expected values are hand-computed unless a comment says otherwise. Values marked
//! "numpy" were made with numpy 2.4.6 (`/tmp/venv/bin/python`) in f64 and printed as
//! `float(np.float32(v))`, e.g. `np.log(np.exp(M).sum(1))` for the logsumexp test; the
//! expression is given next to each such literal.

// Literals are pasted as printed by numpy, so some carry more digits than f32 holds, and
// ln 2 / ln 10 appear as plain numbers in tables of expected values.
#![allow(clippy::excessive_precision, clippy::approx_constant)]

use mlx_core::*;

// ---------------------------------------------------------------- helpers

fn arr(data: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

fn arr_i32(data: &[i32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

fn arr_bool(data: &[bool], shape: &[i32]) -> Array {
    let bytes: Vec<u8> = data.iter().map(|&b| b as u8).collect();
    Array::from_bytes(&bytes, shape, Dtype::Bool).unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.to_vec::<f32>().unwrap()
}

fn i32s(a: &Array) -> Vec<i32> {
    a.to_vec::<i32>().unwrap()
}

fn u32s(a: &Array) -> Vec<u32> {
    a.to_vec::<u32>().unwrap()
}

fn bools(a: &Array) -> Vec<bool> {
    a.to_vec_bool().unwrap()
}

/// Asserts `|got - want| <= tol * max(1, |want|)` elementwise (inf must match exactly).
#[track_caller]
fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "length: got {got:?}, want {want:?}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_infinite() {
            assert_eq!(g, w, "element {i}: got {got:?}, want {want:?}");
            continue;
        }
        let err = (g - w).abs();
        assert!(err <= tol * w.abs().max(1.0), "element {i}: got {g}, want {w} (all: got {got:?}, want {want:?})");
    }
}

/// The matrix `[[1, 2, 3], [4, 5, 6]]` (f32).
fn m23() -> Array {
    arr(&[1., 2., 3., 4., 5., 6.], &[2, 3])
}

// ---------------------------------------------------------------- construction

#[test]
fn from_slice_float_types() {
    let a = Array::from_slice(&[1.5f32, -2.0, 3.25], &[3]).unwrap();
    assert_eq!(a.dtype(), Dtype::Float32);
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.25]);

    let a = Array::from_slice(&[1.5f64, -2.0, 1e-300], &[3]).unwrap();
    assert_eq!(a.dtype(), Dtype::Float64);
    assert_eq!(a.to_vec::<f64>().unwrap(), vec![1.5, -2.0, 1e-300]);

    let h: Vec<f16> = [0.5f32, -1.25, 65504.0, 1.0 / 3.0].iter().map(|&v| f16::from_f32(v)).collect();
    let a = Array::from_slice(&h, &[2, 2]).unwrap();
    assert_eq!(a.dtype(), Dtype::Float16);
    assert_eq!(a.nbytes(), 8);
    let back = a.to_vec::<f16>().unwrap();
    assert_eq!(back, h);
    // f16 nearest to 1/3 is 0.333251953125 (numpy: float(np.float16(1/3))).
    assert_eq!(back[3].to_f32(), 0.333_251_95);
    // Widening to f32 keeps the exact f16 values.
    assert_eq!(f32s(&a.astype(Dtype::Float32).unwrap()), vec![0.5, -1.25, 65504.0, 0.333_251_95]);

    let b: Vec<bf16> = [0.5f32, -1.25, 3.0e38, 1.0 / 3.0].iter().map(|&v| bf16::from_f32(v)).collect();
    let a = Array::from_slice(&b, &[4]).unwrap();
    assert_eq!(a.dtype(), Dtype::Bfloat16);
    assert_eq!(a.nbytes(), 8);
    assert_eq!(a.to_vec::<bf16>().unwrap(), b);
    // bf16 nearest to 1/3 is 0.333984375 (8 mantissa bits: 0x3EAB).
    assert_eq!(a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()[3], 0.333_984_38);
}

#[test]
fn from_slice_integer_types() {
    macro_rules! roundtrip {
        ($t:ty, $d:expr, $vals:expr) => {{
            let v: Vec<$t> = $vals;
            let a = Array::from_slice(&v, &[v.len() as i32]).unwrap();
            assert_eq!(a.dtype(), $d);
            assert_eq!(a.nbytes(), v.len() * std::mem::size_of::<$t>());
            assert_eq!(a.to_vec::<$t>().unwrap(), v);
        }};
    }
    roundtrip!(u8, Dtype::Uint8, vec![0, 1, 255]);
    roundtrip!(u16, Dtype::Uint16, vec![0, 1, 65535]);
    roundtrip!(u32, Dtype::Uint32, vec![0, 7, u32::MAX]);
    roundtrip!(u64, Dtype::Uint64, vec![0, 7, u64::MAX]);
    roundtrip!(i8, Dtype::Int8, vec![-128, 0, 127]);
    roundtrip!(i16, Dtype::Int16, vec![-32768, 0, 32767]);
    roundtrip!(i32, Dtype::Int32, vec![i32::MIN, -1, i32::MAX]);
    roundtrip!(i64, Dtype::Int64, vec![i64::MIN, -1, i64::MAX]);
}

#[test]
fn from_bytes_and_to_bytes() {
    let vals = [1.0f32, -2.0, 0.5, 8.0];
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let a = Array::from_bytes(&bytes, &[2, 2], Dtype::Float32).unwrap();
    assert_eq!(a.shape(), vec![2, 2]);
    assert_eq!(f32s(&a), vals.to_vec());
    assert_eq!(a.to_bytes().unwrap(), bytes);

    // Bool from bytes.
    let b = Array::from_bytes(&[1, 0, 1], &[3], Dtype::Bool).unwrap();
    assert_eq!(b.dtype(), Dtype::Bool);
    assert_eq!(bools(&b), vec![true, false, true]);
    assert_eq!(b.to_bytes().unwrap(), vec![1, 0, 1]);

    // bf16 from its raw bits: 0x3F80 = 1.0, 0xC000 = -2.0.
    let a = Array::from_bytes(&[0x80, 0x3F, 0x00, 0xC0], &[2], Dtype::Bfloat16).unwrap();
    assert_eq!(f32s(&a.astype(Dtype::Float32).unwrap()), vec![1.0, -2.0]);

    // Wrong byte count.
    match Array::from_bytes(&bytes[..15], &[2, 2], Dtype::Float32) {
        Err(Error::Shape { op, shape, expected, found }) => {
            assert_eq!(op, "from_bytes");
            assert_eq!(shape, vec![2, 2]);
            assert_eq!(expected, 16);
            assert_eq!(found, 15);
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
}

#[test]
fn full_zeros_ones() {
    let a = Array::full(&[2, 3], 7.5, Dtype::Float32).unwrap();
    assert_eq!(a.shape(), vec![2, 3]);
    assert_eq!(f32s(&a), vec![7.5; 6]);

    let z = Array::zeros(&[3, 1], Dtype::Int32).unwrap();
    assert_eq!(z.dtype(), Dtype::Int32);
    assert_eq!(z.shape(), vec![3, 1]);
    assert_eq!(i32s(&z), vec![0; 3]);

    let o = Array::ones(&[2], Dtype::Float16).unwrap();
    assert_eq!(o.dtype(), Dtype::Float16);
    assert_eq!(o.to_vec::<f16>().unwrap(), vec![f16::ONE; 2]);

    // Cast from f64 to an integer dtype truncates toward zero.
    let t = Array::full(&[2], -3.7, Dtype::Int32).unwrap();
    assert_eq!(i32s(&t), vec![-3, -3]);

    let e = Array::full(&[-1], 1.0, Dtype::Float32).unwrap_err();
    assert!(matches!(e, Error::Mlx { op: "full", .. }), "{e:?}");

    let empty = Array::zeros(&[0, 4], Dtype::Float32).unwrap();
    assert_eq!(empty.size(), 0);
    assert_eq!(empty.nbytes(), 0);
    assert_eq!(f32s(&empty), Vec::<f32>::new());
}

#[test]
fn arange_values() {
    let a = Array::arange(0.0, 5.0, 1.0, Dtype::Int32).unwrap();
    assert_eq!(a.shape(), vec![5]);
    assert_eq!(i32s(&a), vec![0, 1, 2, 3, 4]);

    let a = Array::arange(1.0, 2.0, 0.25, Dtype::Float32).unwrap();
    assert_eq!(f32s(&a), vec![1.0, 1.25, 1.5, 1.75]);

    // ceil((0 - 5) / -2) = 3 elements.
    let a = Array::arange(5.0, 0.0, -2.0, Dtype::Float32).unwrap();
    assert_eq!(f32s(&a), vec![5.0, 3.0, 1.0]);

    // ceil(10 / 3) = 4 elements.
    let a = Array::arange(0.0, 10.0, 3.0, Dtype::Int64).unwrap();
    assert_eq!(a.to_vec::<i64>().unwrap(), vec![0, 3, 6, 9]);

    let e = Array::arange(0.0, 5.0, 0.0, Dtype::Float32).unwrap_err();
    assert!(e.to_string().contains("arange"), "{e}");
}

#[test]
fn scalar_and_scalar_as() {
    let s = Array::scalar(3.5);
    assert_eq!(s.shape(), Vec::<i32>::new());
    assert_eq!(s.ndim(), 0);
    assert_eq!(s.size(), 1);
    assert_eq!(s.dtype(), Dtype::Float32);
    assert_eq!(s.nbytes(), 4);
    assert_eq!(s.item().unwrap(), 3.5);
    assert_eq!(f32s(&s), vec![3.5]);

    let h = Array::scalar_as(2.0, Dtype::Float16).unwrap();
    assert_eq!(h.dtype(), Dtype::Float16);
    assert_eq!(h.ndim(), 0);
    assert_eq!(h.item().unwrap(), 2.0);
    // An f16 array times an f16 scalar stays f16.
    let x = Array::from_slice(&[f16::from_f32(1.5), f16::from_f32(-3.0)], &[2]).unwrap();
    let y = x.multiply(&h).unwrap();
    assert_eq!(y.dtype(), Dtype::Float16);
    assert_eq!(y.to_vec::<f16>().unwrap(), vec![f16::from_f32(3.0), f16::from_f32(-6.0)]);
    // ... while an f32 scalar promotes it.
    assert_eq!(x.multiply(&Array::scalar(2.0)).unwrap().dtype(), Dtype::Float32);

    let i = Array::scalar_as(-7.9, Dtype::Int32).unwrap();
    assert_eq!(i.dtype(), Dtype::Int32);
    assert_eq!(i.item().unwrap(), -7.0);

    let b = Array::scalar_as(1.0, Dtype::Bfloat16).unwrap();
    assert_eq!(b.to_vec::<bf16>().unwrap(), vec![bf16::ONE]);
}

// ---------------------------------------------------------------- inspection

#[test]
fn shape_ndim_size_dim_dtype_nbytes() {
    let a = Array::zeros(&[2, 3, 4], Dtype::Float32).unwrap();
    assert_eq!(a.shape(), vec![2, 3, 4]);
    assert_eq!(a.ndim(), 3);
    assert_eq!(a.size(), 24);
    assert_eq!(a.dim(0).unwrap(), 2);
    assert_eq!(a.dim(2).unwrap(), 4);
    assert_eq!(a.dim(-1).unwrap(), 4);
    assert_eq!(a.dim(-3).unwrap(), 2);
    assert!(matches!(a.dim(3), Err(Error::Invalid { op: "dim", .. })));
    assert!(matches!(a.dim(-4), Err(Error::Invalid { op: "dim", .. })));
    assert_eq!(a.dtype(), Dtype::Float32);
    assert_eq!(a.nbytes(), 96);

    let b = Array::zeros(&[5], Dtype::Bfloat16).unwrap();
    assert_eq!(b.nbytes(), 10);
    let c = Array::zeros(&[5], Dtype::Int64).unwrap();
    assert_eq!(c.nbytes(), 40);
    assert_eq!(format!("{a:?}"), "Array([2, 3, 4], float32)");
}

#[test]
fn dtype_names_and_sizes() {
    assert_eq!(Dtype::from_name("float32").unwrap(), Dtype::Float32);
    assert_eq!(Dtype::from_name("f32").unwrap(), Dtype::Float32);
    assert_eq!(Dtype::from_name("bf16").unwrap(), Dtype::Bfloat16);
    assert_eq!(Dtype::from_name("f16").unwrap(), Dtype::Float16);
    assert_eq!(Dtype::from_name("f64").unwrap(), Dtype::Float64);
    assert_eq!(Dtype::from_name("uint32").unwrap(), Dtype::Uint32);
    assert_eq!(Dtype::Bfloat16.name(), "bfloat16");
    assert_eq!(Dtype::Int8.to_string(), "int8");
    assert_eq!(Dtype::Bfloat16.size(), 2);
    assert_eq!(Dtype::Complex64.size(), 8);
    assert!(Dtype::Float16.is_float());
    assert!(!Dtype::Int32.is_float());
    // Every dtype survives a round trip through MLX.
    for d in [
        Dtype::Bool,
        Dtype::Uint8,
        Dtype::Uint16,
        Dtype::Uint32,
        Dtype::Uint64,
        Dtype::Int8,
        Dtype::Int16,
        Dtype::Int32,
        Dtype::Int64,
        Dtype::Float16,
        Dtype::Float32,
        Dtype::Float64,
        Dtype::Bfloat16,
    ] {
        let a = Array::zeros(&[3], d).unwrap();
        assert_eq!(a.dtype(), d);
        assert_eq!(a.nbytes(), 3 * d.size());
        assert_eq!(Dtype::from_name(d.name()).unwrap(), d);
    }
}

// ---------------------------------------------------------------- copy-out

#[test]
fn to_vec_bool_item_to_bytes() {
    let b = arr(&[1., 5., 3.], &[3]).greater(&Array::scalar(2.0)).unwrap();
    assert_eq!(b.dtype(), Dtype::Bool);
    assert_eq!(bools(&b), vec![false, true, true]);

    assert_eq!(arr_i32(&[42], &[1, 1]).item().unwrap(), 42.0);
    assert_eq!(arr_bool(&[true], &[1]).item().unwrap(), 1.0);
    assert_eq!(Array::from_slice(&[bf16::from_f32(-0.5)], &[1]).unwrap().item().unwrap(), -0.5);
    let e = m23().item().unwrap_err();
    assert!(matches!(e, Error::Mlx { op: "item", .. }), "{e:?}");

    let i = arr_i32(&[1, -1], &[2]);
    assert_eq!(i.to_bytes().unwrap(), vec![1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);

    // to_vec_bool on a non-bool array.
    match m23().to_vec_bool() {
        Err(Error::Dtype { op, expected, found }) => {
            assert_eq!((op, expected, found), ("to_vec_bool", Dtype::Bool, Dtype::Float32));
        }
        other => panic!("expected Error::Dtype, got {other:?}"),
    }
}

#[test]
fn lazy_graph_eval_and_clone() {
    let a = arr(&[1., 2.], &[2]);
    let b = a.add(&a).unwrap();
    let c = b.clone();
    b.eval().unwrap();
    eval(&[&b, &c]).unwrap();
    async_eval(&[&c]).unwrap();
    assert_eq!(f32s(&c), vec![2., 4.]);
    assert_eq!(f32s(&a), vec![1., 2.]);
}

// ---------------------------------------------------------------- unary ops

#[test]
fn unary_ops_on_signed_values() {
    let x = arr(&[-2.5, -0.5, 0.0, 0.5, 1.5, 2.5], &[2, 3]);
    let t = 1e-6;
    let check = |r: Result<Array>, want: &[f32]| {
        let r = r.unwrap();
        assert_eq!(r.shape(), vec![2, 3]);
        assert_eq!(r.dtype(), Dtype::Float32);
        assert_close(&f32s(&r), want, t);
    };
    check(x.abs(), &[2.5, 0.5, 0.0, 0.5, 1.5, 2.5]);
    check(x.negative(), &[2.5, 0.5, 0.0, -0.5, -1.5, -2.5]);
    check(x.square(), &[6.25, 0.25, 0.0, 0.25, 2.25, 6.25]);
    check(x.floor(), &[-3.0, -1.0, 0.0, 0.0, 1.0, 2.0]);
    check(x.ceil(), &[-2.0, 0.0, 0.0, 1.0, 2.0, 3.0]);
    // Half to even.
    check(x.round(), &[-2.0, 0.0, 0.0, 0.0, 2.0, 2.0]);
    check(x.sign(), &[-1.0, -1.0, 0.0, 1.0, 1.0, 1.0]);
    // numpy: np.exp(x)
    check(x.exp(), &[0.082_084_996, 0.606_530_67, 1.0, 1.648_721_2, 4.481_689, 12.182_494]);
    // numpy: np.sin(x), np.cos(x), np.tanh(x)
    check(x.sin(), &[-0.598_472_1, -0.479_425_55, 0.0, 0.479_425_55, 0.997_495, 0.598_472_1]);
    check(x.cos(), &[-0.801_143_6, 0.877_582_55, 1.0, 0.877_582_55, 0.070_737_2, -0.801_143_6]);
    check(x.tanh(), &[-0.986_614_3, -0.462_117_17, 0.0, 0.462_117_17, 0.905_148_3, 0.986_614_3]);
    // numpy: 1 / (1 + np.exp(-x))
    check(x.sigmoid(), &[0.075_858_18, 0.377_540_68, 0.5, 0.622_459_3, 0.817_574_5, 0.924_141_8]);
    // python: math.erf(v)
    check(x.erf(), &[-0.999_593, -0.520_499_9, 0.0, 0.520_499_9, 0.966_105_16, 0.999_593]);
}

#[test]
fn unary_ops_on_positive_values() {
    let p = arr(&[0.25, 1.0, 2.0, 4.0, 9.0], &[5]);
    let t = 1e-6;
    // numpy: np.log(p), np.log1p(p)
    assert_close(&f32s(&p.log().unwrap()), &[-1.386_294_4, 0.0, 0.693_147_2, 1.386_294_4, 2.197_224_6], t);
    assert_close(&f32s(&p.log1p().unwrap()), &[0.223_143_55, 0.693_147_2, 1.098_612_3, 1.609_438, 2.302_585_1], t);
    assert_close(&f32s(&p.sqrt().unwrap()), &[0.5, 1.0, std::f32::consts::SQRT_2, 2.0, 3.0], t);
    assert_close(&f32s(&p.rsqrt().unwrap()), &[2.0, 1.0, std::f32::consts::FRAC_1_SQRT_2, 0.5, 1.0 / 3.0], t);
    assert_close(&f32s(&p.reciprocal().unwrap()), &[4.0, 1.0, 0.5, 0.25, 1.0 / 9.0], t);
    // log1p is accurate near zero where log(1 + x) in f32 is not.
    let tiny = arr(&[1e-10], &[1]);
    assert_close(&f32s(&tiny.log1p().unwrap()), &[1e-10], 1e-12);
}

#[test]
fn unary_ops_on_integers_and_special_values() {
    let i = arr_i32(&[-3, 0, 4], &[3]);
    assert_eq!(i.abs().unwrap().dtype(), Dtype::Int32);
    assert_eq!(i32s(&i.abs().unwrap()), vec![3, 0, 4]);
    assert_eq!(i32s(&i.negative().unwrap()), vec![3, 0, -4]);
    assert_eq!(i32s(&i.square().unwrap()), vec![9, 0, 16]);
    assert_eq!(i32s(&i.sign().unwrap()), vec![-1, 0, 1]);

    let b = arr_bool(&[true, false, true], &[3]);
    let nb = b.logical_not().unwrap();
    assert_eq!(nb.dtype(), Dtype::Bool);
    assert_eq!(bools(&nb), vec![false, true, false]);

    let s = arr(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0, 0.0], &[5]);
    assert_eq!(bools(&s.isnan().unwrap()), vec![true, false, false, false, false]);
    assert_eq!(bools(&s.isinf().unwrap()), vec![false, true, true, false, false]);
    // log(0) = -inf, sqrt(-1) = NaN, 1/0 = inf.
    let z = arr(&[0.0, -1.0], &[2]);
    let l = f32s(&z.log().unwrap());
    assert_eq!(l[0], f32::NEG_INFINITY);
    assert!(f32s(&z.sqrt().unwrap())[1].is_nan());
    assert_eq!(f32s(&z.reciprocal().unwrap())[0], f32::INFINITY);
}

// ---------------------------------------------------------------- binary ops

#[test]
fn arithmetic_with_broadcasting() {
    let a = m23();
    let row = arr(&[10., 20., 30.], &[3]);
    let col = arr(&[1., -1.], &[2, 1]);

    let r = a.add(&row).unwrap();
    assert_eq!(r.shape(), vec![2, 3]);
    assert_eq!(f32s(&r), vec![11., 22., 33., 14., 25., 36.]);

    let r = a.subtract(&col).unwrap();
    assert_eq!(f32s(&r), vec![0., 1., 2., 5., 6., 7.]);

    // [2, 1] * [3] -> [2, 3] outer product.
    let r = col.multiply(&row).unwrap();
    assert_eq!(r.shape(), vec![2, 3]);
    assert_eq!(f32s(&r), vec![10., 20., 30., -10., -20., -30.]);

    let r = a.divide(&arr(&[2.], &[1])).unwrap();
    assert_eq!(f32s(&r), vec![0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);

    let r = a.multiply(&Array::scalar(-2.0)).unwrap();
    assert_eq!(f32s(&r), vec![-2., -4., -6., -8., -10., -12.]);

    // [2, 1, 3] + [4, 1] -> [2, 4, 3].
    let x = Array::arange(0.0, 6.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 1, 3]).unwrap();
    let y = arr(&[0., 100., 200., 300.], &[4, 1]);
    let r = x.add(&y).unwrap();
    assert_eq!(r.shape(), vec![2, 4, 3]);
    let v = f32s(&r);
    for i in 0..2 {
        for j in 0..4 {
            for k in 0..3 {
                assert_eq!(v[i * 12 + j * 3 + k], (i * 3 + k) as f32 + 100.0 * j as f32);
            }
        }
    }
}

#[test]
fn integer_division_remainder_and_promotion() {
    let a = arr_i32(&[7, -7, 7, -7], &[4]);
    let b = arr_i32(&[2, 2, -2, -2], &[4]);

    let d = a.divide(&b).unwrap();
    assert_eq!(d.dtype(), Dtype::Float32);
    assert_eq!(f32s(&d), vec![3.5, -3.5, -3.5, 3.5]);

    let fd = a.floor_divide(&b).unwrap();
    assert_eq!(fd.dtype(), Dtype::Int32);
    assert_eq!(i32s(&fd), vec![3, -4, -4, 3]);

    // Python `%`: the sign of the divisor.
    let r = a.remainder(&b).unwrap();
    assert_eq!(i32s(&r), vec![1, 1, -1, -1]);

    let af = arr(&[7.5, -7.5, 5.0], &[3]);
    let bf = arr(&[2.0, 2.0, -3.0], &[3]);
    assert_eq!(f32s(&af.floor_divide(&bf).unwrap()), vec![3.0, -4.0, -2.0]);
    assert_eq!(f32s(&af.remainder(&bf).unwrap()), vec![1.5, 0.5, -1.0]);

    // int32 + f32 promotes to f32; int32 + int32 stays int32.
    assert_eq!(a.add(&arr(&[0.5], &[1])).unwrap().dtype(), Dtype::Float32);
    assert_eq!(i32s(&a.add(&b).unwrap()), vec![9, -5, 5, -9]);
    assert_eq!(i32s(&a.subtract(&b).unwrap()), vec![5, -9, 9, -5]);
    assert_eq!(i32s(&a.multiply(&b).unwrap()), vec![14, -14, -14, 14]);
}

#[test]
fn power_maximum_minimum_logaddexp() {
    let base = arr(&[2., 3., 4., 9.], &[4]);
    let ex = arr(&[3., 0.5, -1., 0.5], &[4]);
    // numpy: np.power(base, ex)
    assert_close(&f32s(&base.power(&ex).unwrap()), &[8.0, 1.732_050_8, 0.25, 3.0], 1e-6);
    let ip = arr_i32(&[2, 3, 5], &[3]).power(&arr_i32(&[10, 3, 0], &[3])).unwrap();
    assert_eq!(i32s(&ip), vec![1024, 27, 1]);

    let a = arr(&[1., 2., -3., 4.], &[4]);
    let b = arr(&[0.5, -1., 2., 3.], &[4]);
    assert_eq!(f32s(&a.maximum(&b).unwrap()), vec![1., 2., 2., 4.]);
    assert_eq!(f32s(&a.minimum(&b).unwrap()), vec![0.5, -1., -3., 3.]);
    // Broadcast against a scalar: ReLU.
    assert_eq!(f32s(&a.maximum(&Array::scalar(0.0)).unwrap()), vec![1., 2., 0., 4.]);
    // numpy: np.logaddexp(a, b)
    assert_close(&f32s(&a.logaddexp(&b).unwrap()), &[1.474_077, 2.048_587_3, 2.006_715_3, 4.313_261_5], 1e-6);
    // Stable for large inputs: log(e^1000 + e^1000) = 1000 + ln 2.
    let big = arr(&[1000.0], &[1]);
    assert_close(&f32s(&big.logaddexp(&big).unwrap()), &[1000.0 + std::f32::consts::LN_2], 1e-6);
    let ninf = arr(&[f32::NEG_INFINITY], &[1]);
    assert_eq!(f32s(&ninf.logaddexp(&arr(&[2.0], &[1])).unwrap()), vec![2.0]);
}

#[test]
fn comparisons() {
    let a = arr(&[1., 2., 3., 4.], &[4]);
    let b = arr(&[1., 3., 2., 4.], &[4]);
    let cmp = |r: Result<Array>| {
        let r = r.unwrap();
        assert_eq!(r.dtype(), Dtype::Bool);
        bools(&r)
    };
    assert_eq!(cmp(a.equal(&b)), vec![true, false, false, true]);
    assert_eq!(cmp(a.not_equal(&b)), vec![false, true, true, false]);
    assert_eq!(cmp(a.less(&b)), vec![false, true, false, false]);
    assert_eq!(cmp(a.less_equal(&b)), vec![true, true, false, true]);
    assert_eq!(cmp(a.greater(&b)), vec![false, false, true, false]);
    assert_eq!(cmp(a.greater_equal(&b)), vec![true, false, true, true]);

    // Broadcasting: [2, 1] vs [3] -> [2, 3].
    let col = arr(&[1., 2.], &[2, 1]);
    let row = arr(&[0., 1., 2.], &[3]);
    let r = col.greater(&row).unwrap();
    assert_eq!(r.shape(), vec![2, 3]);
    assert_eq!(bools(&r), vec![true, false, false, true, true, false]);

    // Mixed int/float and NaN.
    let i = arr_i32(&[1, 2], &[2]);
    assert_eq!(cmp(i.equal(&arr(&[1.0, 2.5], &[2]))), vec![true, false]);
    let n = arr(&[f32::NAN], &[1]);
    assert_eq!(cmp(n.equal(&n)), vec![false]);
    assert_eq!(cmp(n.not_equal(&n)), vec![true]);
}

#[test]
fn logical_and_or() {
    let a = arr_bool(&[true, true, false, false], &[4]);
    let b = arr_bool(&[true, false, true, false], &[4]);
    let and = a.logical_and(&b).unwrap();
    assert_eq!(and.dtype(), Dtype::Bool);
    assert_eq!(bools(&and), vec![true, false, false, false]);
    assert_eq!(bools(&a.logical_or(&b).unwrap()), vec![true, true, true, false]);
    // Broadcast with a [2, 1] column.
    let c = arr_bool(&[true, false], &[2, 1]);
    let r = c.logical_and(&a).unwrap();
    assert_eq!(r.shape(), vec![2, 4]);
    assert_eq!(bools(&r), vec![true, true, false, false, false, false, false, false]);
}

// ---------------------------------------------------------------- astype

#[test]
fn astype_conversions() {
    let x = arr(&[1.7, -1.7, 2.5, -0.2], &[4]);
    let i = x.astype(Dtype::Int32).unwrap();
    assert_eq!(i.dtype(), Dtype::Int32);
    assert_eq!(i32s(&i), vec![1, -1, 2, 0]);

    let f = arr_i32(&[3, -4], &[2]).astype(Dtype::Float32).unwrap();
    assert_eq!(f32s(&f), vec![3.0, -4.0]);

    let h = arr(&[0.5, 1.0 / 3.0, 70000.0], &[3]).astype(Dtype::Float16).unwrap();
    assert_eq!(h.dtype(), Dtype::Float16);
    let hv = h.to_vec::<f16>().unwrap();
    assert_eq!(hv[0], f16::from_f32(0.5));
    assert_eq!(hv[1], f16::from_f32(1.0 / 3.0));
    assert!(hv[2].is_infinite()); // beyond f16's max (65504)

    let b = arr(&[1.0, 1.0 / 3.0], &[2]).astype(Dtype::Bfloat16).unwrap();
    assert_eq!(b.to_vec::<bf16>().unwrap(), vec![bf16::ONE, bf16::from_f32(1.0 / 3.0)]);

    let bo = arr(&[0.0, -2.0, 0.5], &[3]).astype(Dtype::Bool).unwrap();
    assert_eq!(bools(&bo), vec![false, true, true]);
    let back = bo.astype(Dtype::Float32).unwrap();
    assert_eq!(f32s(&back), vec![0.0, 1.0, 1.0]);

    let u = arr_i32(&[300, -1], &[2]).astype(Dtype::Uint8).unwrap();
    assert_eq!(u.to_vec::<u8>().unwrap(), vec![44, 255]); // modulo 256

    // Same dtype: unchanged.
    let same = x.astype(Dtype::Float32).unwrap();
    assert_eq!(f32s(&same), f32s(&x));
    let d = x.astype(Dtype::Float64).unwrap();
    assert_eq!(d.to_vec::<f64>().unwrap(), vec![1.7f32 as f64, -1.7f32 as f64, 2.5, -0.2f32 as f64]);
}

// ---------------------------------------------------------------- matmul

#[test]
fn matmul_2d() {
    let a = m23();
    let b = arr(&[7., 8., 9., 10., 11., 12.], &[3, 2]);
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.shape(), vec![2, 2]);
    assert_eq!(f32s(&c), vec![58., 64., 139., 154.]);
    // A transposed view as the right operand: a @ a^T.
    let c = a.matmul(&a.t().unwrap()).unwrap();
    assert_eq!(f32s(&c), vec![14., 32., 32., 77.]);
    // a^T @ a ([3, 3]).
    let c = a.t().unwrap().matmul(&a).unwrap();
    assert_eq!(c.shape(), vec![3, 3]);
    assert_eq!(f32s(&c), vec![17., 22., 27., 22., 29., 36., 27., 36., 45.]);
    // Non-f32 dtypes.
    let ad = a.astype(Dtype::Float64).unwrap();
    let cd = ad.matmul(&b.astype(Dtype::Float64).unwrap()).unwrap();
    assert_eq!(cd.to_vec::<f64>().unwrap(), vec![58., 64., 139., 154.]);
    let ah = a.astype(Dtype::Float16).unwrap();
    let ch = ah.matmul(&b.astype(Dtype::Float16).unwrap()).unwrap();
    assert_eq!(ch.dtype(), Dtype::Float16);
    assert_eq!(f32s(&ch.astype(Dtype::Float32).unwrap()), vec![58., 64., 139., 154.]);
}

#[test]
fn matmul_batched_and_broadcast() {
    // a[b] = [[b+1, b+2, b+3], [b+4, b+5, b+6]], w[b] = I (3x2 "identity") * (b + 1).
    let a = Array::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 2, 3]).unwrap();
    let w = arr(&[1., 0., 0., 1., 0., 0., 2., 0., 0., 2., 0., 0.], &[2, 3, 2]);
    let c = a.matmul(&w).unwrap();
    assert_eq!(c.shape(), vec![2, 2, 2]);
    // batch 0: [[0,1],[3,4]] * 1; batch 1: [[6,7],[9,10]] * 2
    assert_eq!(f32s(&c), vec![0., 1., 3., 4., 12., 14., 18., 20.]);

    // Batch broadcast: [2, 2, 3] @ [3, 1].
    let ones = Array::ones(&[3, 1], Dtype::Float32).unwrap();
    let c = a.matmul(&ones).unwrap();
    assert_eq!(c.shape(), vec![2, 2, 1]);
    assert_eq!(f32s(&c), vec![3., 12., 21., 30.]);

    // [1, 2, 3] @ [2, 3, 2] broadcasts the left batch.
    let a0 = a.slice_axis(0, 0, 1).unwrap();
    let c = a0.matmul(&w).unwrap();
    assert_eq!(c.shape(), vec![2, 2, 2]);
    assert_eq!(f32s(&c), vec![0., 1., 3., 4., 0., 2., 6., 8.]);
}

#[test]
fn matmul_vectors() {
    let a = m23();
    let v3 = arr(&[1., 0., -1.], &[3]);
    let v2 = arr(&[1., 2.], &[2]);
    // [2, 3] @ [3] -> [2]
    let r = a.matmul(&v3).unwrap();
    assert_eq!(r.shape(), vec![2]);
    assert_eq!(f32s(&r), vec![-2., -2.]);
    // [2] @ [2, 3] -> [3]
    let r = v2.matmul(&a).unwrap();
    assert_eq!(r.shape(), vec![3]);
    assert_eq!(f32s(&r), vec![9., 12., 15.]);
    // [3] @ [3] -> scalar
    let r = v3.matmul(&arr(&[4., 5., 6.], &[3])).unwrap();
    assert_eq!(r.ndim(), 0);
    assert_eq!(r.item().unwrap(), -2.0);
}

#[test]
fn addmm_values() {
    let a = m23();
    let b = arr(&[7., 8., 9., 10., 11., 12.], &[3, 2]);
    let c = arr(&[1., 2., 3., 4.], &[2, 2]);
    // 0.5 * c + 2 * (a @ b)
    let r = c.addmm(&a, &b, 2.0, 0.5).unwrap();
    assert_eq!(r.shape(), vec![2, 2]);
    assert_eq!(f32s(&r), vec![116.5, 129., 279.5, 310.]);
    // A bias row broadcast over rows: 1 * bias + 1 * (a @ b).
    let bias = arr(&[100., -100.], &[2]);
    let r = bias.addmm(&a, &b, 1.0, 1.0).unwrap();
    assert_eq!(f32s(&r), vec![158., -36., 239., 54.]);
    // beta = 0 ignores c.
    let r = c.addmm(&a, &b, 1.0, 0.0).unwrap();
    assert_eq!(f32s(&r), vec![58., 64., 139., 154.]);
}

// ---------------------------------------------------------------- where / clip

#[test]
fn where_selects_and_broadcasts() {
    let cond = arr_bool(&[true, false, true, false, false, true], &[2, 3]);
    let x = m23();
    let y = arr(&[-1., -2., -3., -4., -5., -6.], &[2, 3]);
    assert_eq!(f32s(&cond.where_(&x, &y).unwrap()), vec![1., -2., 3., -4., -5., 6.]);
    // Scalar fallback and row condition.
    let cond_row = arr_bool(&[false, true, false], &[3]);
    let r = cond_row.where_(&x, &Array::scalar(0.0)).unwrap();
    assert_eq!(r.shape(), vec![2, 3]);
    assert_eq!(f32s(&r), vec![0., 2., 0., 0., 5., 0.]);
    // Masking with -inf as attention masks do.
    let neg = Array::scalar(f32::NEG_INFINITY);
    let r = cond_row.where_(&Array::scalar(1.0), &neg).unwrap();
    assert_eq!(f32s(&r), vec![f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY]);
}

#[test]
fn clip_bounds() {
    let x = arr(&[-3., -1., 0., 2., 5.], &[5]);
    let lo = Array::scalar(-1.5);
    let hi = Array::scalar(2.5);
    assert_eq!(f32s(&x.clip(Some(&lo), Some(&hi)).unwrap()), vec![-1.5, -1., 0., 2., 2.5]);
    assert_eq!(f32s(&x.clip(Some(&lo), None).unwrap()), vec![-1.5, -1., 0., 2., 5.]);
    assert_eq!(f32s(&x.clip(None, Some(&hi)).unwrap()), vec![-3., -1., 0., 2., 2.5]);
    // Per-element bounds.
    let lo_v = arr(&[0., 0., 1., 1., 1.], &[5]);
    assert_eq!(f32s(&x.clip(Some(&lo_v), Some(&hi)).unwrap()), vec![0., 0., 1., 2., 2.5]);
    let e = x.clip(None, None).unwrap_err();
    assert!(matches!(e, Error::Mlx { op: "clip", .. }), "{e:?}");
}

// ---------------------------------------------------------------- shape manipulation

#[test]
fn reshape_values() {
    let a = Array::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap();
    let r = a.reshape(&[3, 4]).unwrap();
    assert_eq!(r.shape(), vec![3, 4]);
    assert_eq!(f32s(&r), (0..12).map(|v| v as f32).collect::<Vec<_>>());
    let r = a.reshape(&[2, -1, 3]).unwrap();
    assert_eq!(r.shape(), vec![2, 2, 3]);
    let r = r.reshape(&[-1]).unwrap();
    assert_eq!(r.shape(), vec![12]);
    let s = arr(&[5.0], &[1, 1]).reshape(&[]).unwrap();
    assert_eq!(s.ndim(), 0);
    assert_eq!(s.item().unwrap(), 5.0);
    // Reshaping a transposed view reads it in logical order.
    let t = m23().t().unwrap().reshape(&[6]).unwrap();
    assert_eq!(f32s(&t), vec![1., 4., 2., 5., 3., 6.]);
}

#[test]
fn transpose_t_swapaxes() {
    let a = m23();
    let t = a.t().unwrap();
    assert_eq!(t.shape(), vec![3, 2]);
    assert_eq!(f32s(&t), vec![1., 4., 2., 5., 3., 6.]);
    assert_eq!(f32s(&a.transpose(&[1, 0]).unwrap()), vec![1., 4., 2., 5., 3., 6.]);
    assert_eq!(f32s(&a.transpose(&[0, 1]).unwrap()), vec![1., 2., 3., 4., 5., 6.]);

    // x[i, j, k] = 100 i + 10 j + k, shape [2, 3, 4].
    let vals: Vec<f32> =
        (0..2).flat_map(|i| (0..3).flat_map(move |j| (0..4).map(move |k| (100 * i + 10 * j + k) as f32))).collect();
    let x = arr(&vals, &[2, 3, 4]);
    // transpose([2, 0, 1]): out[k, i, j] = x[i, j, k].
    let p = x.transpose(&[2, 0, 1]).unwrap();
    assert_eq!(p.shape(), vec![4, 2, 3]);
    let pv = f32s(&p);
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                assert_eq!(pv[k * 6 + i * 3 + j], (100 * i + 10 * j + k) as f32);
            }
        }
    }
    // t() reverses all axes: out[k, j, i].
    let r = x.t().unwrap();
    assert_eq!(r.shape(), vec![4, 3, 2]);
    let rv = f32s(&r);
    assert_eq!(&rv[..4], &[0., 100., 10., 110.]);
    // swapaxes(0, 2) reverses all three axes as well.
    assert_eq!(f32s(&x.swapaxes(0, 2).unwrap()), rv);
    // swapaxes(-1, -2): out[i, k, j].
    let s = x.swapaxes(-1, -2).unwrap();
    assert_eq!(s.shape(), vec![2, 4, 3]);
    let sv = f32s(&s);
    assert_eq!(&sv[..6], &[0., 10., 20., 1., 11., 21.]);
    assert!(x.transpose(&[0, 0, 1]).is_err());
}

#[test]
fn expand_dims_squeeze_broadcast_to() {
    let v = arr(&[1., 2., 3.], &[3]);
    assert_eq!(v.expand_dims(&[0]).unwrap().shape(), vec![1, 3]);
    assert_eq!(v.expand_dims(&[1]).unwrap().shape(), vec![3, 1]);
    assert_eq!(v.expand_dims(&[-1]).unwrap().shape(), vec![3, 1]);
    let e = v.expand_dims(&[0, 2]).unwrap();
    assert_eq!(e.shape(), vec![1, 3, 1]);
    assert_eq!(f32s(&e), vec![1., 2., 3.]);

    assert_eq!(e.squeeze(&[]).unwrap().shape(), vec![3]);
    assert_eq!(e.squeeze(&[0]).unwrap().shape(), vec![3, 1]);
    assert_eq!(e.squeeze(&[-1]).unwrap().shape(), vec![1, 3]);
    assert_eq!(f32s(&e.squeeze(&[]).unwrap()), vec![1., 2., 3.]);
    let err = e.squeeze(&[1]).unwrap_err();
    assert!(err.to_string().contains("squeeze"), "{err}");

    let b = v.broadcast_to(&[2, 3]).unwrap();
    assert_eq!(b.shape(), vec![2, 3]);
    assert_eq!(f32s(&b), vec![1., 2., 3., 1., 2., 3.]);
    let c = arr(&[1., 2.], &[2, 1]).broadcast_to(&[2, 2, 3]).unwrap();
    assert_eq!(f32s(&c), vec![1., 1., 1., 2., 2., 2., 1., 1., 1., 2., 2., 2.]);
    assert!(v.broadcast_to(&[2, 4]).is_err());
}

// ---------------------------------------------------------------- slicing

#[test]
fn slice_with_strides() {
    // x[i, j] = 10 i + j, shape [4, 5].
    let vals: Vec<f32> = (0..4).flat_map(|i| (0..5).map(move |j| (10 * i + j) as f32)).collect();
    let x = arr(&vals, &[4, 5]);
    let s = x.slice(&[1, 0], &[3, 5], &[1, 2]).unwrap();
    assert_eq!(s.shape(), vec![2, 3]);
    assert_eq!(f32s(&s), vec![10., 12., 14., 20., 22., 24.]);
    let s = x.slice(&[0, 1], &[4, 3], &[3, 1]).unwrap();
    assert_eq!(s.shape(), vec![2, 2]);
    assert_eq!(f32s(&s), vec![1., 2., 31., 32.]);
    // Negative stride walks backwards (numpy x[3:0:-2, 4:1:-1]).
    let s = x.slice(&[3, 4], &[0, 1], &[-2, -1]).unwrap();
    assert_eq!(s.shape(), vec![2, 3]);
    assert_eq!(f32s(&s), vec![34., 33., 32., 14., 13., 12.]);
}

#[test]
fn slice_axis_values() {
    let vals: Vec<f32> = (0..4).flat_map(|i| (0..5).map(move |j| (10 * i + j) as f32)).collect();
    let x = arr(&vals, &[4, 5]);
    let s = x.slice_axis(1, 1, 3).unwrap();
    assert_eq!(s.shape(), vec![4, 2]);
    assert_eq!(f32s(&s), vec![1., 2., 11., 12., 21., 22., 31., 32.]);
    // Negative axis and bounds: the last two rows.
    let s = x.slice_axis(-2, -2, 4).unwrap();
    assert_eq!(s.shape(), vec![2, 5]);
    assert_eq!(f32s(&s), vec![20., 21., 22., 23., 24., 30., 31., 32., 33., 34.]);
    // Bounds are clamped to the axis: x[:, 3:100] and x[:, -100:1].
    assert_eq!(f32s(&x.slice_axis(1, 3, 100).unwrap().slice_axis(0, 0, 1).unwrap()), vec![3., 4.]);
    assert_eq!(x.slice_axis(1, -100, 1).unwrap().shape(), vec![4, 1]);
    // -1 stop: drops the last column.
    assert_eq!(x.slice_axis(1, 0, -1).unwrap().shape(), vec![4, 4]);
    assert!(matches!(x.slice_axis(2, 0, 1), Err(Error::Invalid { op: "slice_axis", .. })));
    assert!(matches!(x.slice_axis(-3, 0, 1), Err(Error::Invalid { op: "slice_axis", .. })));
}

#[test]
fn slice_update_values() {
    let z = Array::zeros(&[3, 4], Dtype::Float32).unwrap();
    let upd = arr(&[1., 2., 3., 4.], &[2, 2]);
    let r = z.slice_update(&upd, &[1, 1], &[3, 3], &[1, 1]).unwrap();
    assert_eq!(f32s(&r), vec![0., 0., 0., 0., 0., 1., 2., 0., 0., 3., 4., 0.]);
    // The source is unchanged (functional update).
    assert_eq!(f32s(&z), vec![0.; 12]);
    // Strided update with a broadcast scalar: every other column of row 0.
    let r = z.slice_update(&Array::scalar(9.0), &[0, 0], &[1, 4], &[1, 2]).unwrap();
    assert_eq!(f32s(&r), vec![9., 0., 9., 0., 0., 0., 0., 0., 0., 0., 0., 0.]);
    // KV-cache style: write one row at position 2.
    let row = arr(&[5., 6., 7., 8.], &[1, 4]);
    let r = z.slice_update(&row, &[2, 0], &[3, 4], &[1, 1]).unwrap();
    assert_eq!(f32s(&r)[8..], [5., 6., 7., 8.]);
    assert!(z.slice_update(&arr(&[1., 2., 3.], &[3]), &[0, 0], &[1, 4], &[1, 1]).is_err());
}

// ---------------------------------------------------------------- gather / scatter

#[test]
fn take_embedding_lookup() {
    // table[r] = [10 r, 10 r + 1, 10 r + 2], 4 rows.
    let table = arr(&[0., 1., 2., 10., 11., 12., 20., 21., 22., 30., 31., 32.], &[4, 3]);
    let ids = arr_i32(&[0, 3, 2, 2], &[2, 2]);
    let e = table.take(&ids, 0).unwrap();
    assert_eq!(e.shape(), vec![2, 2, 3]);
    assert_eq!(f32s(&e), vec![0., 1., 2., 30., 31., 32., 20., 21., 22., 20., 21., 22.]);
    // uint32 ids (as argmax returns) work too.
    let ids = Array::from_slice(&[1u32], &[1]).unwrap();
    assert_eq!(f32s(&table.take(&ids, 0).unwrap()), vec![10., 11., 12.]);
    // Along axis 1: columns [2, 0].
    let c = table.take(&arr_i32(&[2, 0], &[2]), 1).unwrap();
    assert_eq!(c.shape(), vec![4, 2]);
    assert_eq!(f32s(&c), vec![2., 0., 12., 10., 22., 20., 32., 30.]);
    // Negative index counts from the end.
    assert_eq!(f32s(&table.take(&arr_i32(&[-1], &[1]), 0).unwrap()), vec![30., 31., 32.]);
    // A 0-d index removes the axis.
    let s = table.take(&Array::scalar_as(1.0, Dtype::Int32).unwrap(), 0).unwrap();
    assert_eq!(s.shape(), vec![3]);
    assert!(table.take(&arr(&[0.0], &[1]), 0).is_err());
}

#[test]
fn take_and_put_along_axis() {
    let x = arr(&[10., 30., 20., 5., 4., 6.], &[2, 3]);
    let idx = arr_i32(&[1, 0, 2, 2], &[2, 2]);
    let r = x.take_along_axis(&idx, 1).unwrap();
    assert_eq!(r.shape(), vec![2, 2]);
    assert_eq!(f32s(&r), vec![30., 10., 6., 6.]);
    // Along axis 0 with a [1, 3] index: picks row per column.
    let r = x.take_along_axis(&arr_i32(&[1, 0, 1], &[1, 3]), 0).unwrap();
    assert_eq!(f32s(&r), vec![5., 30., 6.]);
    // take_along_axis(argmax) gives the max.
    let am = x.argmax(1, true).unwrap();
    assert_eq!(f32s(&x.take_along_axis(&am, 1).unwrap()), vec![30., 6.]);

    let z = Array::zeros(&[2, 3], Dtype::Float32).unwrap();
    let idx = arr_i32(&[2, 0], &[2, 1]);
    let vals = arr(&[7., 8.], &[2, 1]);
    let r = z.put_along_axis(&idx, &vals, 1).unwrap();
    assert_eq!(f32s(&r), vec![0., 0., 7., 8., 0., 0.]);
    // Round trip: put then take the same positions.
    assert_eq!(f32s(&r.take_along_axis(&idx, 1).unwrap()), vec![7., 8.]);
    // Scalar value broadcast to the index shape.
    let r = x.put_along_axis(&arr_i32(&[0, 1], &[2, 1]), &Array::scalar(-1.0), 1).unwrap();
    assert_eq!(f32s(&r), vec![-1., 30., 20., 5., -1., 6.]);
}

#[test]
fn contiguous_reads_transposed_view() {
    let a = m23();
    let t = a.t().unwrap();
    let c = t.contiguous().unwrap();
    assert_eq!(c.shape(), vec![3, 2]);
    assert_eq!(f32s(&c), vec![1., 4., 2., 5., 3., 6.]);
    let want: Vec<u8> = [1f32, 4., 2., 5., 3., 6.].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(c.to_bytes().unwrap(), want);
    // The view itself reads back in logical order too.
    assert_eq!(t.to_bytes().unwrap(), want);
    // A strided slice and a broadcast.
    let s = arr(&[0., 1., 2., 3., 4., 5.], &[6]).slice(&[1], &[6], &[2]).unwrap().contiguous().unwrap();
    assert_eq!(f32s(&s), vec![1., 3., 5.]);
    let b = arr(&[1., 2.], &[2, 1]).broadcast_to(&[2, 2]).unwrap().contiguous().unwrap();
    assert_eq!(f32s(&b), vec![1., 1., 2., 2.]);
    // Already contiguous: unchanged.
    assert_eq!(f32s(&a.contiguous().unwrap()), vec![1., 2., 3., 4., 5., 6.]);
}

// ---------------------------------------------------------------- reductions

#[test]
fn sum_and_mean() {
    let a = m23();
    let s = a.sum(&[], false).unwrap();
    assert_eq!(s.ndim(), 0);
    assert_eq!(s.item().unwrap(), 21.0);
    let s = a.sum(&[0], false).unwrap();
    assert_eq!(s.shape(), vec![3]);
    assert_eq!(f32s(&s), vec![5., 7., 9.]);
    let s = a.sum(&[-1], true).unwrap();
    assert_eq!(s.shape(), vec![2, 1]);
    assert_eq!(f32s(&s), vec![6., 15.]);
    let s = a.sum(&[], true).unwrap();
    assert_eq!(s.shape(), vec![1, 1]);
    assert_eq!(f32s(&s), vec![21.]);

    // x = arange(24).reshape(2, 3, 4); sum over axes (0, 2): 60 + 32 j.
    let x = Array::arange(0.0, 24.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 3, 4]).unwrap();
    let s = x.sum(&[0, 2], false).unwrap();
    assert_eq!(f32s(&s), vec![60., 92., 124.]);
    assert_eq!(x.sum(&[0, -1], true).unwrap().shape(), vec![1, 3, 1]);
    // Integer sums stay integer.
    let i = arr_i32(&[1, 2, 3, 4], &[2, 2]);
    assert_eq!(i.sum(&[1], false).unwrap().dtype(), Dtype::Int32);
    assert_eq!(i32s(&i.sum(&[1], false).unwrap()), vec![3, 7]);

    assert_eq!(a.mean(&[], false).unwrap().item().unwrap(), 3.5);
    assert_eq!(f32s(&a.mean(&[1], false).unwrap()), vec![2., 5.]);
    let m = a.mean(&[0], true).unwrap();
    assert_eq!(m.shape(), vec![1, 3]);
    assert_eq!(f32s(&m), vec![2.5, 3.5, 4.5]);
    // mean over (0, 2): (60 + 32 j) / 8.
    assert_eq!(f32s(&x.mean(&[0, 2], false).unwrap()), vec![7.5, 11.5, 15.5]);
    // The mean of an int array is a float.
    assert_eq!(f32s(&arr_i32(&[1, 2], &[2]).mean(&[], false).unwrap()), vec![1.5]);
}

#[test]
fn max_min_prod() {
    let a = arr(&[3., -1., 7., 2., 9., -4.], &[2, 3]);
    assert_eq!(a.max(&[], false).unwrap().item().unwrap(), 9.0);
    assert_eq!(a.min(&[], false).unwrap().item().unwrap(), -4.0);
    assert_eq!(f32s(&a.max(&[0], false).unwrap()), vec![3., 9., 7.]);
    assert_eq!(f32s(&a.min(&[0], false).unwrap()), vec![2., -1., -4.]);
    let m = a.max(&[1], true).unwrap();
    assert_eq!(m.shape(), vec![2, 1]);
    assert_eq!(f32s(&m), vec![7., 9.]);
    let m = a.min(&[-1], true).unwrap();
    assert_eq!(f32s(&m), vec![-1., -4.]);

    let p = m23().prod(&[1], false).unwrap();
    assert_eq!(f32s(&p), vec![6., 120.]);
    assert_eq!(m23().prod(&[], false).unwrap().item().unwrap(), 720.0);
    let p = m23().prod(&[0], true).unwrap();
    assert_eq!(p.shape(), vec![1, 3]);
    assert_eq!(f32s(&p), vec![4., 10., 18.]);
    assert_eq!(i32s(&arr_i32(&[-2, 3, 5], &[3]).prod(&[0], false).unwrap()), vec![-30]);
}

#[test]
fn all_and_any() {
    let b = arr_bool(&[true, false, true, true, true, true], &[2, 3]);
    let r = b.all(&[1], false).unwrap();
    assert_eq!(r.dtype(), Dtype::Bool);
    assert_eq!(bools(&r), vec![false, true]);
    assert_eq!(bools(&b.all(&[0], false).unwrap()), vec![true, false, true]);
    assert_eq!(bools(&b.all(&[], false).unwrap()), vec![false]);
    let r = b.all(&[-1], true).unwrap();
    assert_eq!(r.shape(), vec![2, 1]);

    let c = arr_bool(&[false, false, false, true, false, false], &[2, 3]);
    assert_eq!(bools(&c.any(&[1], false).unwrap()), vec![false, true]);
    assert_eq!(bools(&c.any(&[0], false).unwrap()), vec![true, false, false]);
    assert_eq!(bools(&c.any(&[], false).unwrap()), vec![true]);
    let r = c.any(&[0, 1], true).unwrap();
    assert_eq!(r.shape(), vec![1, 1]);
    assert_eq!(bools(&r), vec![true]);
    // Numbers: nonzero is true.
    assert_eq!(bools(&arr(&[0., 0.5], &[2]).any(&[], false).unwrap()), vec![true]);
    assert_eq!(bools(&arr(&[0., 0.5], &[2]).all(&[], false).unwrap()), vec![false]);
}

#[test]
fn logsumexp_values() {
    let a = m23();
    // numpy: np.log(np.exp(M).sum(1)), np.log(np.exp(M).sum())
    let r = a.logsumexp(&[1], false).unwrap();
    assert_eq!(r.shape(), vec![2]);
    assert_close(&f32s(&r), &[3.407_605_9, 6.407_606], 1e-6);
    let r = a.logsumexp(&[-1], true).unwrap();
    assert_eq!(r.shape(), vec![2, 1]);
    assert_close(&f32s(&r), &[3.407_605_9, 6.407_606], 1e-6);
    assert_close(&[a.logsumexp(&[], false).unwrap().item().unwrap() as f32], &[6.456_193_4], 1e-6);
    // Axis 0: log(e^1 + e^4) = 4 + log1p(e^-3).
    let want0: Vec<f32> = (0..3).map(|j| (4.0 + j as f64 + (-3.0f64).exp().ln_1p()) as f32).collect();
    assert_close(&f32s(&a.logsumexp(&[0], false).unwrap()), &want0, 1e-6);
    // Stable for large values.
    let big = arr(&[1000., 1000.], &[2]);
    assert_close(&f32s(&big.logsumexp(&[], false).unwrap()), &[1000.0 + std::f32::consts::LN_2], 1e-6);
}

#[test]
fn argmax_argmin() {
    let a = arr(&[3., -1., 7., 2., 9., -4.], &[2, 3]);
    let r = a.argmax(1, false).unwrap();
    assert_eq!(r.dtype(), Dtype::Uint32);
    assert_eq!(r.shape(), vec![2]);
    assert_eq!(u32s(&r), vec![2, 1]);
    assert_eq!(u32s(&a.argmax(0, false).unwrap()), vec![0, 1, 0]);
    assert_eq!(u32s(&a.argmin(1, false).unwrap()), vec![1, 2]);
    assert_eq!(u32s(&a.argmin(-2, false).unwrap()), vec![1, 0, 1]);
    let r = a.argmax(-1, true).unwrap();
    assert_eq!(r.shape(), vec![2, 1]);
    assert_eq!(u32s(&r), vec![2, 1]);
    // Ties: the first occurrence.
    let t = arr(&[1., 5., 5., 0., 0.], &[5]);
    assert_eq!(u32s(&t.argmax(0, false).unwrap()), vec![1]);
    assert_eq!(u32s(&t.argmin(0, false).unwrap()), vec![3]);
}

#[test]
fn softmax_values() {
    let s = arr(&[1., 2., 3., 1., 1., 1.], &[2, 3]);
    let r = s.softmax(&[-1], false).unwrap();
    assert_eq!(r.shape(), vec![2, 3]);
    // numpy: e = np.exp(S - S.max(1, keepdims=True)); e / e.sum(1, keepdims=True)
    let want = [0.090_030_57, 0.244_728_48, 0.665_240_94, 1. / 3., 1. / 3., 1. / 3.];
    assert_close(&f32s(&r), &want, 1e-6);
    assert_close(&f32s(&s.softmax(&[1], true).unwrap()), &want, 1e-6);
    // Over both axes. numpy: np.exp(M) / np.exp(M).sum()
    let r = m23().softmax(&[0, 1], false).unwrap();
    assert_close(
        &f32s(&r),
        &[0.004_269_779, 0.011_606_461, 0.031_549_633, 0.085_760_795, 0.233_122, 0.633_691_3],
        1e-6,
    );
    // Over axis 0. numpy: np.exp(M) / np.exp(M).sum(0, keepdims=True)
    let r = m23().softmax(&[0], false).unwrap();
    assert_close(
        &f32s(&r),
        &[0.047_425_874, 0.047_425_874, 0.047_425_874, 0.952_574_1, 0.952_574_1, 0.952_574_1],
        1e-6,
    );
    // Large logits and -inf entries do not produce NaN.
    let x = arr(&[1000., f32::NEG_INFINITY, 1000.], &[3]);
    assert_close(&f32s(&x.softmax(&[0], false).unwrap()), &[0.5, 0.0, 0.5], 1e-6);
    // bf16 input, precise accumulation.
    let h = s.astype(Dtype::Bfloat16).unwrap().softmax(&[-1], true).unwrap();
    assert_eq!(h.dtype(), Dtype::Bfloat16);
    assert_close(&f32s(&h.astype(Dtype::Float32).unwrap()), &want, 1e-2);
}

// ---------------------------------------------------------------- scans

#[test]
fn cumsum_variants() {
    let x = arr(&[3., 1., 4., 1., 5.], &[5]);
    assert_eq!(f32s(&x.cumsum(0, false, true).unwrap()), vec![3., 4., 8., 9., 14.]);
    assert_eq!(f32s(&x.cumsum(0, false, false).unwrap()), vec![0., 3., 4., 8., 9.]);
    assert_eq!(f32s(&x.cumsum(0, true, true).unwrap()), vec![14., 11., 10., 6., 5.]);
    assert_eq!(f32s(&x.cumsum(0, true, false).unwrap()), vec![11., 10., 6., 5., 0.]);
    // 2-D along each axis.
    let a = m23();
    let r = a.cumsum(1, false, true).unwrap();
    assert_eq!(r.shape(), vec![2, 3]);
    assert_eq!(f32s(&r), vec![1., 3., 6., 4., 9., 15.]);
    assert_eq!(f32s(&a.cumsum(0, false, true).unwrap()), vec![1., 2., 3., 5., 7., 9.]);
    assert_eq!(f32s(&a.cumsum(-1, true, false).unwrap()), vec![5., 3., 0., 11., 6., 0.]);
    // Integers.
    assert_eq!(i32s(&arr_i32(&[1, 2, 3], &[3]).cumsum(0, false, true).unwrap()), vec![1, 3, 6]);
}

#[test]
fn cumprod_cummax_cummin() {
    let x = arr(&[3., 1., 4., 1., 5.], &[5]);
    assert_eq!(f32s(&x.cumprod(0, false, true).unwrap()), vec![3., 3., 12., 12., 60.]);
    assert_eq!(f32s(&x.cumprod(0, false, false).unwrap()), vec![1., 3., 3., 12., 12.]);
    assert_eq!(f32s(&x.cumprod(0, true, true).unwrap()), vec![60., 20., 20., 5., 5.]);
    assert_eq!(f32s(&x.cumprod(0, true, false).unwrap()), vec![20., 20., 5., 5., 1.]);

    assert_eq!(f32s(&x.cummax(0, false, true).unwrap()), vec![3., 3., 4., 4., 5.]);
    assert_eq!(f32s(&x.cummax(0, true, true).unwrap()), vec![5., 5., 5., 5., 5.]);
    // Exclusive: the identity of max is -inf.
    assert_eq!(f32s(&x.cummax(0, false, false).unwrap()), vec![f32::NEG_INFINITY, 3., 3., 4., 4.]);
    assert_eq!(f32s(&x.cummax(0, true, false).unwrap()), vec![5., 5., 5., 5., f32::NEG_INFINITY]);

    assert_eq!(f32s(&x.cummin(0, false, true).unwrap()), vec![3., 1., 1., 1., 1.]);
    assert_eq!(f32s(&x.cummin(0, true, true).unwrap()), vec![1., 1., 1., 1., 5.]);
    assert_eq!(f32s(&x.cummin(0, false, false).unwrap()), vec![f32::INFINITY, 3., 1., 1., 1.]);
    assert_eq!(f32s(&x.cummin(0, true, false).unwrap()), vec![1., 1., 1., 5., f32::INFINITY]);

    // 2-D: along axis 0.
    let a = arr(&[3., -1., 7., 2., 9., -4.], &[2, 3]);
    assert_eq!(f32s(&a.cummax(0, false, true).unwrap()), vec![3., -1., 7., 3., 9., 7.]);
    assert_eq!(f32s(&a.cummin(1, false, true).unwrap()), vec![3., -1., -1., 2., 2., -4.]);
    assert_eq!(f32s(&a.cumprod(1, false, true).unwrap()), vec![3., -3., -21., 2., 18., -72.]);
}

#[test]
fn logcumsumexp_variants() {
    let x = arr(&[3., 1., 4., 1., 5.], &[5]);
    // numpy: np.logaddexp.accumulate(x)
    let fwd = [3.0, 3.126_928, 4.349_012_4, 4.383_528_7, 5.431_682_6];
    // numpy: np.logaddexp.accumulate(x[::-1])[::-1]
    let rev = [5.431_682_6, 5.339_688_8, 5.326_562_4, 5.018_15, 5.0];
    assert_close(&f32s(&x.logcumsumexp(0, false, true).unwrap()), &fwd, 1e-6);
    assert_close(&f32s(&x.logcumsumexp(0, true, true).unwrap()), &rev, 1e-6);
    // Exclusive: shifted by one, identity -inf.
    assert_close(
        &f32s(&x.logcumsumexp(0, false, false).unwrap()),
        &[f32::NEG_INFINITY, fwd[0], fwd[1], fwd[2], fwd[3]],
        1e-6,
    );
    assert_close(
        &f32s(&x.logcumsumexp(0, true, false).unwrap()),
        &[rev[1], rev[2], rev[3], rev[4], f32::NEG_INFINITY],
        1e-6,
    );
    // Consistent with logsumexp on the last element, row by row.
    let a = m23();
    let r = f32s(&a.logcumsumexp(1, false, true).unwrap());
    assert_close(&[r[2], r[5]], &[3.407_605_9, 6.407_606], 1e-6);
}

// ---------------------------------------------------------------- sorting

#[test]
fn sort_and_argsort() {
    let x = arr(&[3., 1., 2., 1., -5.], &[5]);
    assert_eq!(f32s(&x.sort(0).unwrap()), vec![-5., 1., 1., 2., 3.]);
    let idx = x.argsort(0).unwrap();
    assert_eq!(idx.dtype(), Dtype::Uint32);
    let idx = u32s(&idx);
    // Ties between positions 1 and 3 may come in either order.
    assert_eq!(idx[0], 4);
    assert_eq!(idx[3..], [2, 0]);
    let mut mid = idx[1..3].to_vec();
    mid.sort();
    assert_eq!(mid, vec![1, 3]);
    // Sorting by the indices gives the sorted array.
    let by_idx = x.take(&Array::from_slice(&idx, &[5]).unwrap(), 0).unwrap();
    assert_eq!(f32s(&by_idx), vec![-5., 1., 1., 2., 3.]);

    // 2-D along each axis.
    let a = arr(&[3., -1., 7., 2., 9., -4.], &[2, 3]);
    assert_eq!(f32s(&a.sort(-1).unwrap()), vec![-1., 3., 7., -4., 2., 9.]);
    assert_eq!(f32s(&a.sort(0).unwrap()), vec![2., -1., -4., 3., 9., 7.]);
    assert_eq!(u32s(&a.argsort(1).unwrap()), vec![1, 0, 2, 2, 0, 1]);
    assert_eq!(u32s(&a.argsort(0).unwrap()), vec![1, 0, 1, 0, 1, 0]);
    // Integers.
    assert_eq!(i32s(&arr_i32(&[5, -2, 0], &[3]).sort(0).unwrap()), vec![-2, 0, 5]);
}

#[test]
fn topk_set_semantics() {
    let x = arr(&[5., 1., 9., 3., 7.], &[5]);
    let t = x.topk(2, 0).unwrap();
    assert_eq!(t.shape(), vec![2]);
    let mut v = f32s(&t);
    v.sort_by(f32::total_cmp);
    assert_eq!(v, vec![7., 9.]);
    let mut v = f32s(&x.topk(3, -1).unwrap());
    v.sort_by(f32::total_cmp);
    assert_eq!(v, vec![5., 7., 9.]);
    let mut v = f32s(&x.topk(5, 0).unwrap());
    v.sort_by(f32::total_cmp);
    assert_eq!(v, vec![1., 3., 5., 7., 9.]);
    // Row-wise on 2-D.
    let a = arr(&[3., -1., 7., 2., 9., -4.], &[2, 3]);
    let t = a.topk(2, 1).unwrap();
    assert_eq!(t.shape(), vec![2, 2]);
    let v = f32s(&t);
    let (mut r0, mut r1) = (v[..2].to_vec(), v[2..].to_vec());
    r0.sort_by(f32::total_cmp);
    r1.sort_by(f32::total_cmp);
    assert_eq!((r0, r1), (vec![3., 7.], vec![2., 9.]));
    // Along axis 0: the larger of each column.
    assert_eq!(f32s(&a.topk(1, 0).unwrap()), vec![3., 9., 7.]);
    assert!(x.topk(6, 0).is_err());
}

#[test]
fn argpartition_set_semantics() {
    let vals = [5., 1., 9., 3., 7., 0.];
    let x = arr(&vals, &[6]);
    for kth in 0..6 {
        let p = x.argpartition(kth, 0).unwrap();
        assert_eq!(p.dtype(), Dtype::Uint32);
        let p = u32s(&p);
        // A permutation of 0..6.
        let mut perm = p.clone();
        perm.sort();
        assert_eq!(perm, vec![0, 1, 2, 3, 4, 5]);
        let v: Vec<f32> = p.iter().map(|&i| vals[i as usize]).collect();
        let mut sorted = vals.to_vec();
        sorted.sort_by(f32::total_cmp);
        let k = kth as usize;
        // The kth element is in its sorted place, smaller ones before, larger ones after.
        assert_eq!(v[k], sorted[k], "kth {kth}: {v:?}");
        assert!(v[..k].iter().all(|&e| e <= v[k]), "kth {kth}: {v:?}");
        assert!(v[k + 1..].iter().all(|&e| e >= v[k]), "kth {kth}: {v:?}");
    }
    // 2-D along the last axis.
    let a = arr(&[3., -1., 7., 2., 9., -4.], &[2, 3]);
    let p = u32s(&a.argpartition(0, -1).unwrap());
    assert_eq!((p[0], p[3]), (1, 2));
    assert!(x.argpartition(6, 0).is_err());
}

// ---------------------------------------------------------------- triangles

#[test]
fn tril_triu() {
    let a = Array::ones(&[3, 4], Dtype::Float32).unwrap();
    #[rustfmt::skip]
    let low = vec![
        1., 0., 0., 0.,
        1., 1., 0., 0.,
        1., 1., 1., 0.,
    ];
    assert_eq!(f32s(&a.tril(0).unwrap()), low);
    #[rustfmt::skip]
    let low_m1 = vec![
        0., 0., 0., 0.,
        1., 0., 0., 0.,
        1., 1., 0., 0.,
    ];
    assert_eq!(f32s(&a.tril(-1).unwrap()), low_m1);
    #[rustfmt::skip]
    let up1 = vec![
        0., 1., 1., 1.,
        0., 0., 1., 1.,
        0., 0., 0., 1.,
    ];
    assert_eq!(f32s(&a.triu(1).unwrap()), up1);
    #[rustfmt::skip]
    let up_m1 = vec![
        1., 1., 1., 1.,
        1., 1., 1., 1.,
        0., 1., 1., 1.,
    ];
    assert_eq!(f32s(&a.triu(-1).unwrap()), up_m1);
    // Values are kept, not replaced by ones; batched over leading axes.
    let x = Array::arange(1.0, 9.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 2, 2]).unwrap();
    assert_eq!(f32s(&x.tril(0).unwrap()), vec![1., 0., 3., 4., 5., 0., 7., 8.]);
    assert_eq!(f32s(&x.triu(0).unwrap()), vec![1., 2., 0., 4., 5., 6., 0., 8.]);
    assert!(arr(&[1., 2.], &[2]).tril(0).is_err());
}

// ---------------------------------------------------------------- split / concatenate / stack

#[test]
fn split_at_values() {
    let x = Array::arange(0.0, 10.0, 1.0, Dtype::Int32).unwrap();
    let parts = x.split_at(&[2, 5], 0).unwrap();
    assert_eq!(parts.len(), 3);
    assert_eq!(i32s(&parts[0]), vec![0, 1]);
    assert_eq!(i32s(&parts[1]), vec![2, 3, 4]);
    assert_eq!(i32s(&parts[2]), vec![5, 6, 7, 8, 9]);

    // Along axis 1 of [2, 4]: q/k/v style split.
    let a = Array::arange(0.0, 8.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 4]).unwrap();
    let parts = a.split_at(&[1, 3], -1).unwrap();
    assert_eq!(parts.iter().map(|p| p.shape()).collect::<Vec<_>>(), vec![vec![2, 1], vec![2, 2], vec![2, 1]]);
    assert_eq!(f32s(&parts[0]), vec![0., 4.]);
    assert_eq!(f32s(&parts[1]), vec![1., 2., 5., 6.]);
    assert_eq!(f32s(&parts[2]), vec![3., 7.]);
    // No indices: one part, the whole array.
    let one = a.split_at(&[], 0).unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(f32s(&one[0]), f32s(&a));
    assert!(a.split_at(&[1], 2).is_err());
}

#[test]
fn concatenate_and_stack() {
    let a = m23();
    let b = arr(&[7., 8., 9.], &[1, 3]);
    let c = concatenate(&[&a, &b], 0).unwrap();
    assert_eq!(c.shape(), vec![3, 3]);
    assert_eq!(f32s(&c), vec![1., 2., 3., 4., 5., 6., 7., 8., 9.]);
    let d = arr(&[10., 20.], &[2, 1]);
    let c = concatenate(&[&a, &d, &d], -1).unwrap();
    assert_eq!(c.shape(), vec![2, 5]);
    assert_eq!(f32s(&c), vec![1., 2., 3., 10., 10., 4., 5., 6., 20., 20.]);
    let one = concatenate(&[&a], 1).unwrap();
    assert_eq!(f32s(&one), f32s(&a));
    assert!(concatenate(&[&a, &b], 1).is_err());
    let e = concatenate(&[], 0).unwrap_err();
    assert!(matches!(e, Error::Mlx { op: "concatenate", .. }), "{e:?}");

    let x = arr(&[1., 2.], &[2]);
    let y = arr(&[3., 4.], &[2]);
    let s = stack(&[&x, &y], 0).unwrap();
    assert_eq!(s.shape(), vec![2, 2]);
    assert_eq!(f32s(&s), vec![1., 2., 3., 4.]);
    let s = stack(&[&x, &y, &x], 1).unwrap();
    assert_eq!(s.shape(), vec![2, 3]);
    assert_eq!(f32s(&s), vec![1., 3., 1., 2., 4., 2.]);
    let s = stack(&[&x, &y], -1).unwrap();
    assert_eq!(f32s(&s), vec![1., 3., 2., 4.]);
    assert!(stack(&[&x, &a], 0).is_err());
    assert!(stack(&[], 0).is_err());
}

// ---------------------------------------------------------------- errors

#[test]
fn matmul_shape_mismatch_error() {
    let a = Array::zeros(&[2, 3], Dtype::Float32).unwrap();
    let b = Array::zeros(&[4, 2], Dtype::Float32).unwrap();
    let e = a.matmul(&b).unwrap_err();
    assert!(matches!(e, Error::Mlx { op: "matmul", .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.starts_with("matmul: "), "{msg}");
    assert!(msg.contains("(2,3)") && msg.contains("(4,2)"), "{msg}");

    let e = a.addmm(&a, &b, 1.0, 1.0).unwrap_err();
    assert!(e.to_string().starts_with("addmm: "), "{e}");
}

#[test]
fn reshape_wrong_count_error() {
    let a = Array::zeros(&[2, 3], Dtype::Float32).unwrap();
    let e = a.reshape(&[4]).unwrap_err();
    assert!(matches!(e, Error::Mlx { op: "reshape", .. }), "{e:?}");
    let msg = e.to_string();
    // MLX names the element count (6) and the requested shape (4), not the input shape.
    assert!(msg.starts_with("reshape: "), "{msg}");
    assert!(msg.contains('6') && msg.contains("(4)"), "{msg}");
    assert!(a.reshape(&[-1, -1]).is_err());
}

#[test]
fn broadcast_mismatch_error() {
    let a = Array::zeros(&[2, 3], Dtype::Float32).unwrap();
    let b = Array::zeros(&[4, 2], Dtype::Float32).unwrap();
    let e = a.add(&b).unwrap_err();
    let msg = e.to_string();
    assert!(msg.starts_with("add: "), "{msg}");
    assert!(msg.contains("(2,3)") && msg.contains("(4,2)"), "{msg}");
    assert!(a.equal(&b).unwrap_err().to_string().starts_with("equal: "));
    assert!(a.where_(&a, &b).unwrap_err().to_string().starts_with("where: "));
}

#[test]
fn from_slice_wrong_length_is_shape_error() {
    let e = Array::from_slice(&[1f32, 2., 3.], &[2, 2]).unwrap_err();
    match &e {
        Error::Shape { op, shape, expected, found } => {
            assert_eq!(*op, "from_slice");
            assert_eq!(shape, &vec![2, 2]);
            assert_eq!((*expected, *found), (4, 3));
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("from_slice") && msg.contains("[2, 2]") && msg.contains('4') && msg.contains('3'), "{msg}");
    // A negative dimension is rejected without a panic.
    assert!(Array::from_slice(&[1f32], &[-1]).is_err());
    assert!(Array::from_slice::<i32>(&[], &[0]).is_ok());
}

#[test]
fn to_vec_wrong_dtype_error() {
    let a = arr_i32(&[1, 2], &[2]);
    let e = a.to_vec::<f32>().unwrap_err();
    match &e {
        Error::Dtype { op, expected, found } => {
            assert_eq!((*op, *expected, *found), ("to_vec", Dtype::Float32, Dtype::Int32));
        }
        other => panic!("expected Error::Dtype, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("to_vec") && msg.contains("float32") && msg.contains("int32"), "{msg}");
    assert!(matches!(
        Array::zeros(&[1], Dtype::Bfloat16).unwrap().to_vec::<f16>(),
        Err(Error::Dtype { expected: Dtype::Float16, found: Dtype::Bfloat16, .. })
    ));
}

#[test]
fn dtype_from_name_unknown() {
    let e = Dtype::from_name("nope").unwrap_err();
    assert!(matches!(e, Error::Invalid { op: "Dtype::from_name", .. }), "{e:?}");
    assert!(e.to_string().contains("nope"), "{e}");
    assert!(Dtype::from_name("").is_err());
    assert!(Dtype::from_name("Float32").is_err());
}

#[test]
fn bad_axes_are_errors_not_panics() {
    let a = m23();
    assert!(a.sum(&[2], false).is_err());
    assert!(a.logsumexp(&[-3], false).is_err());
    assert!(a.argmax(2, false).is_err());
    assert!(a.cumsum(5, false, true).is_err());
    assert!(a.sort(2).is_err());
    assert!(a.softmax(&[3], false).is_err());
    assert!(a.take(&arr_i32(&[0], &[1]), 2).is_err());
    assert!(a.take_along_axis(&arr_i32(&[0], &[1]), 1).is_err());
    assert!(a.swapaxes(0, 2).is_err());
    assert!(a.expand_dims(&[4]).is_err());
    assert!(a.slice(&[0], &[1], &[1]).is_err());
    assert!(a.transpose(&[0]).is_err());
    let e = a.sum(&[2], false).unwrap_err();
    assert!(e.to_string().starts_with("sum: "), "{e}");
}

#[test]
fn softmax_with_no_axes_normalizes_over_all_elements() {
    let a = Array::from_slice(&[0f32, 0., 0., 0.], &[2, 2]).unwrap();
    assert_eq!(a.softmax(&[], false).unwrap().to_vec::<f32>().unwrap(), vec![0.25; 4]);
}

#[test]
fn reshape_error_names_the_input_shape() {
    let a = Array::zeros(&[2, 3], Dtype::Float32).unwrap();
    let msg = a.reshape(&[4]).unwrap_err().to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("(4)"), "{msg}");
}

#[test]
fn out_of_range_and_malformed_indices_are_errors_not_crashes() {
    let a = Array::from_slice(&[1f32, 2., 3., 4.], &[4]).unwrap();
    for bad in [vec![1_000_000_000i32], vec![4, 5, 100], vec![-5]] {
        let idx = Array::from_slice(&bad, &[bad.len() as i32]).unwrap();
        let e = a.take(&idx, 0).unwrap_err();
        assert!(matches!(e, Error::Invalid { op: "take", .. }), "{e}");
        assert!(e.to_string().contains("out of range"), "{e}");
        assert!(a.take_along_axis(&idx, 0).is_err());
        assert!(a.put_along_axis(&idx, &Array::zeros(&[bad.len() as i32], Dtype::Float32).unwrap(), 0).is_err());
    }
    let big = Array::from_slice(&[u32::MAX], &[1]).unwrap();
    assert!(a.take(&big, 0).is_err());
    let f = Array::from_slice(&[1.0f32], &[1]).unwrap();
    assert!(a.take(&f, 0).unwrap_err().to_string().contains("integers"));
    let ok = Array::from_slice(&[3i32, 0], &[2]).unwrap();
    assert_eq!(a.take(&ok, 0).unwrap().to_vec::<f32>().unwrap(), vec![4., 1.]);
}

#[test]
fn zero_strides_bad_shapes_and_overflow_are_errors() {
    let a = Array::from_slice(&[1f32, 2., 3., 4.], &[4]).unwrap();
    assert!(matches!(a.slice(&[0], &[4], &[0]), Err(Error::Invalid { .. })));
    assert!(matches!(a.slice(&[0, 0], &[4, 1], &[1, 1]), Err(Error::Invalid { .. })));
    assert!(matches!(a.slice_update(&a, &[0], &[4], &[0]), Err(Error::Invalid { .. })));
    assert!(matches!(a.reshape(&[-2, -2]), Err(Error::Invalid { .. })));
    assert!(matches!(a.reshape(&[-1, -1]), Err(Error::Invalid { .. })));
    assert_eq!(a.reshape(&[2, -1]).unwrap().shape(), vec![2, 2]);
    assert!(Array::from_bytes(&[], &[1 << 30, 1 << 30, 4], Dtype::Float32).is_err());
}
