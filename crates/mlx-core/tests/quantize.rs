//! Affine quantization against Python MLX (`fixtures/quantize/make_goldens.py`, mlx 0.32.4):
//! packed weights, scales, biases and the dequantized matrix must be bit-identical.
use mlx_core::io::load_safetensors;
use mlx_core::quant::{self, QuantSpec};
use mlx_core::{Array, Dtype, Error, random};

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

#[derive(serde::Deserialize)]
struct Case {
    key: String,
    shape: Vec<i32>,
    dtype: String,
    bits: i32,
    group_size: i32,
}

#[test]
fn quantize_is_bit_identical_to_python_mlx() {
    let g = load_safetensors(fixtures().join("quantize/goldens.safetensors")).unwrap();
    let cases: Vec<Case> = serde_json::from_str(&g.metadata["cases"]).unwrap();
    assert_eq!(cases.len(), 25);
    let mut seen = std::collections::BTreeSet::new();
    for c in &cases {
        let w = g.get(&format!("{}.w", c.key)).unwrap();
        assert_eq!(w.shape(), c.shape);
        assert_eq!(w.dtype(), Dtype::from_name(&c.dtype).unwrap());
        let spec = QuantSpec::new(c.group_size, c.bits).unwrap();
        let q = quant::quantize(w, spec).unwrap();
        for (name, ours) in [("wq", &q.weight), ("scales", &q.scales), ("biases", &q.biases)] {
            let want = g.get(&format!("{}.{name}", c.key)).unwrap();
            assert_eq!(ours.shape(), want.shape(), "{} {name} shape", c.key);
            assert_eq!(ours.dtype(), want.dtype(), "{} {name} dtype", c.key);
            assert!(
                ours.to_bytes().unwrap() == want.to_bytes().unwrap(),
                "{} {name}: bytes differ ({c:?})",
                c.key,
                c = (c.bits, c.group_size, &c.dtype)
            );
        }
        let dq = q.dequantize().unwrap();
        let want = g.get(&format!("{}.dq", c.key)).unwrap();
        assert!(dq.to_bytes().unwrap() == want.to_bytes().unwrap(), "{} dequantize differs", c.key);
        seen.insert((c.bits, c.group_size));
    }
    // every supported bits x group size pair is covered
    assert_eq!(seen.len(), quant::SUPPORTED_BITS.len() * quant::SUPPORTED_GROUP_SIZES.len());
}

#[test]
fn packed_layout_shapes() {
    let w = random::normal(&[6, 256], Dtype::Float32, 0.0, 1.0, &random::Key::new(1)).unwrap();
    for bits in quant::SUPPORTED_BITS {
        for gs in quant::SUPPORTED_GROUP_SIZES {
            let q = quant::quantize(&w, QuantSpec::new(gs, bits).unwrap()).unwrap();
            assert_eq!(q.weight.dtype(), Dtype::Uint32);
            assert_eq!(q.weight.shape(), vec![6, 256 * bits / 32]);
            assert_eq!(q.scales.shape(), vec![6, 256 / gs]);
            assert_eq!(q.biases.shape(), vec![6, 256 / gs]);
        }
    }
}

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn quantized_matmul_matches_dequantize_then_matmul() {
    let key = random::Key::new(3);
    let ks = key.split(2).unwrap();
    let w = random::normal(&[96, 256], Dtype::Float32, 0.0, 1.0, &ks[0]).unwrap();
    for rows in [1, 5] {
        let x = random::normal(&[rows, 256], Dtype::Float32, 0.0, 1.0, &ks[1]).unwrap();
        for bits in quant::SUPPORTED_BITS {
            for gs in quant::SUPPORTED_GROUP_SIZES {
                let q = quant::quantize(&w, QuantSpec::new(gs, bits).unwrap()).unwrap();
                let y = q.matmul_t(&x).unwrap();
                assert_eq!(y.shape(), vec![rows, 96]);
                let reference = x.matmul(&q.dequantize().unwrap().t().unwrap()).unwrap();
                let d = max_abs_diff(&y, &reference);
                assert!(d < 1e-3, "bits {bits} gs {gs} rows {rows}: max |qmm - dq@x| = {d}");
                // transpose = false: the quantized matrix is W^T, used as [K, N]; its rows
                // (length N = 96) split into groups only for group size 32.
                if 96 % gs == 0 {
                    let wt = quant::quantize(&w.t().unwrap().contiguous().unwrap(), QuantSpec::new(gs, bits).unwrap())
                        .unwrap();
                    let y2 = quant::quantized_matmul(&x, &wt.weight, &wt.scales, &wt.biases, false, wt.spec).unwrap();
                    assert_eq!(y2.shape(), vec![rows, 96]);
                    let r2 = x.matmul(&wt.dequantize().unwrap()).unwrap();
                    assert!(max_abs_diff(&y2, &r2) < 1e-3, "transpose=false bits {bits} gs {gs}");
                }
            }
        }
    }
}

#[test]
fn quantization_error_shrinks_with_bits() {
    let w = random::normal(&[64, 512], Dtype::Float32, 0.0, 1.0, &random::Key::new(9)).unwrap();
    let mut last = f32::INFINITY;
    for bits in quant::SUPPORTED_BITS {
        let q = quant::quantize(&w, QuantSpec::new(64, bits).unwrap()).unwrap();
        let err = max_abs_diff(&q.dequantize().unwrap(), &w);
        assert!(err < last, "bits {bits}: error {err} not below {last}");
        last = err;
    }
    assert!(last < 0.05);
}

#[test]
fn invalid_specs_and_shapes_are_errors() {
    assert!(matches!(QuantSpec::new(64, 7), Err(Error::Invalid { .. })));
    assert!(matches!(QuantSpec::new(48, 4), Err(Error::Invalid { .. })));
    let msg = QuantSpec::new(64, 7).unwrap_err().to_string();
    assert!(msg.contains("bits") && msg.contains('7'), "{msg}");
    let w = Array::zeros(&[4, 100], Dtype::Float32).unwrap();
    let e = quant::quantize(&w, QuantSpec::new(64, 4).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Mlx { op: "quantize", .. }), "{e}");
    let q = quant::quantize(&Array::zeros(&[4, 128], Dtype::Float32).unwrap(), QuantSpec::new(64, 4).unwrap()).unwrap();
    let x = Array::zeros(&[1, 64], Dtype::Float32).unwrap();
    assert!(q.matmul_t(&x).is_err());
}

#[test]
fn bits_per_weight() {
    assert_eq!(QuantSpec::new(64, 4).unwrap().bits_per_weight(2), 4.5);
    assert_eq!(QuantSpec::new(32, 8).unwrap().bits_per_weight(2), 9.0);
}
