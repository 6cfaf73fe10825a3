//! `Gguf::load` against gguf-py (`fixtures/gguf_import/make_fixtures.py`): every supported
//! block type decodes to gguf-py's values, including those MLX's own loader got wrong (Q4_K),
//! refused (Q5_0, Q5_1, Q3_K, Q5_K) or rounded (BF16 as f16); f64 metadata loads (MLX
//! aborted); unsupported types are errors naming the tensor (MLX dropped TQ1_0 silently).
use std::path::{Path, PathBuf};

use mlx_core::io::gguf::{GgmlType, GgufFile};
use mlx_core::io::{Gguf, GgufValue, load_safetensors};
use mlx_core::quant::{self, QuantSpec};
use mlx_core::{Array, Dtype, Error};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(rel)
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn expected(name: &str) -> Vec<f32> {
    let st = load_safetensors(fixture("gguf_import/blocks.expected.safetensors")).unwrap();
    st.get(name).unwrap().to_vec::<f32>().unwrap()
}

fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits());
    assert!(bad.is_none(), "{what}: element {bad:?} is {:?}, gguf-py says {:?}", got[bad.unwrap()], want[bad.unwrap()]);
}

#[test]
fn q4_k_loads_as_gguf_py_dequantizes_it() {
    let g = Gguf::load(fixture("gguf_import/blocks.gguf")).unwrap();
    let t = g.tensor("t.Q4_K").unwrap();
    assert_eq!((t.dtype(), t.shape()), (Dtype::Float32, vec![2, 512]));
    assert_bits_eq(&t.to_vec::<f32>().unwrap(), &expected("t.Q4_K"), "Q4_K");
}

#[test]
fn every_supported_block_type_matches_gguf_py() {
    let g = Gguf::load(fixture("gguf_import/blocks.gguf")).unwrap();
    let raw = GgufFile::open(&[fixture("gguf_import/blocks.gguf")]).unwrap();
    assert_eq!(raw.tensors.len(), 13);
    for info in &raw.tensors {
        let name = &info.name;
        let want = expected(name);
        let t = g.tensor(name).unwrap();
        match info.ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
                // MLX's layout: uint32 weight, f16 scales and biases, group size 32; the
                // names have no `.weight` suffix here, so the triple is `X`, `X.scales`, `X.biases`.
                let bits = if info.ty == GgmlType::Q8_0 { 8 } else { 4 };
                let (s, b) =
                    (g.tensor(&format!("{name}.scales")).unwrap(), g.tensor(&format!("{name}.biases")).unwrap());
                assert_eq!((t.dtype(), t.shape()), (Dtype::Uint32, vec![2, 512 * bits / 32]), "{name}");
                assert_eq!((s.dtype(), s.shape()), (Dtype::Float16, vec![2, 16]), "{name}");
                assert_eq!((b.dtype(), b.shape()), (Dtype::Float16, vec![2, 16]), "{name}");
                // The f16 scales and biases are exact, so with f32 arithmetic the values are
                // gguf-py's up to one f32 rounding.
                let (s, b) = (s.astype(Dtype::Float32).unwrap(), b.astype(Dtype::Float32).unwrap());
                let d = quant::dequantize(t, &s, &b, QuantSpec::new(32, bits).unwrap()).unwrap();
                for (x, y) in f32s(&d).iter().zip(&want) {
                    assert!((x - y).abs() <= 1e-6 * y.abs().max(1e-2), "{name}: {x} vs {y}");
                }
            }
            ty => {
                let dtype = match ty {
                    GgmlType::F16 => Dtype::Float16,
                    GgmlType::BF16 => Dtype::Bfloat16,
                    _ => Dtype::Float32,
                };
                assert_eq!((t.dtype(), t.shape()), (dtype, vec![2, 512]), "{name}");
                assert_bits_eq(&f32s(t), &want, name);
            }
        }
    }
    assert_eq!(g.tensors.len(), 13 + 3 * 2, "three tensors became triples");
}

#[test]
fn metadata_of_every_value_type_loads_as_mlx_gave_it() {
    let g = Gguf::load(fixture("gguf_import/blocks.gguf")).unwrap();
    for (k, dtype) in [
        ("uint8", Dtype::Uint8),
        ("int8", Dtype::Int8),
        ("uint16", Dtype::Uint16),
        ("int16", Dtype::Int16),
        ("uint32", Dtype::Uint32),
        ("int32", Dtype::Int32),
        ("float32", Dtype::Float32),
        ("bool", Dtype::Bool),
        ("uint64", Dtype::Uint64),
        ("int64", Dtype::Int64),
        ("float64", Dtype::Float64),
    ] {
        let GgufValue::Array(a) = &g.metadata[&format!("test.scalar.{k}")] else { panic!("{k}") };
        assert_eq!((a.dtype(), a.ndim()), (dtype, 0), "scalar {k}");
        let GgufValue::Array(a) = &g.metadata[&format!("test.array.{k}")] else { panic!("{k}") };
        assert_eq!((a.dtype(), a.shape()), (dtype, vec![if k == "bool" { 2 } else { 3 }]), "array {k}");
    }
    assert_eq!(g.number("test.scalar.float64").unwrap(), 7.0);
    assert_eq!(g.number("test.scalar.int8_negative").unwrap(), -5.0);
    assert_eq!(g.number("test.scalar.bool").unwrap(), 1.0);
    assert_eq!(g.string("test.string").unwrap(), "héllo");
    assert_eq!(g.strings("test.strings").unwrap(), ["a", "", "ü"]);
}

#[test]
fn split_parts_load_like_the_whole_file() {
    let whole = fixture("gguf/tiny.gguf");
    let data = std::fs::read(&whole).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let parts: Vec<PathBuf> = [&data[..100], &data[100..2000], &data[2000..]]
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let p = dir.path().join(format!("tiny.gguf.part{}", i + 1));
            std::fs::write(&p, d).unwrap();
            p
        })
        .collect();
    let a = Gguf::load(&whole).unwrap();
    let b = Gguf::from_file(&GgufFile::open(&parts).unwrap()).unwrap();
    assert_eq!(b.path, parts[0]);
    assert_eq!(a.tensors.keys().collect::<Vec<_>>(), b.tensors.keys().collect::<Vec<_>>());
    for (k, v) in &a.tensors {
        assert_eq!((v.dtype(), v.to_bytes().unwrap()), (b.tensors[k].dtype(), b.tensors[k].to_bytes().unwrap()), "{k}");
    }
    assert_eq!(a.metadata.len(), b.metadata.len());
}

/// A GGUF v3 file built by hand: metadata entries and tensors (dims innermost first).
#[derive(Default)]
struct Builder {
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Builder {
    /// `value` is the encoded value after its type id.
    fn kv(mut self, key: &str, ty: u32, value: &[u8]) -> Self {
        put_str(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) -> Self {
        self.data.resize(self.data.len().div_ceil(32) * 32, 0);
        put_str(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| self.infos.extend(d.to_le_bytes()));
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend((self.data.len() as u64).to_le_bytes());
        self.data.extend(bytes);
        self.n_tensors += 1;
        self
    }

    fn write(self, dir: &Path, name: &str) -> PathBuf {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(self.n_tensors.to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        out.resize(out.len().div_ceil(32) * 32, 0);
        out.extend(&self.data);
        let p = dir.join(name);
        std::fs::write(&p, out).unwrap();
        p
    }
}

fn load_err(p: &Path) -> String {
    let e = Gguf::load(p).unwrap_err();
    assert!(matches!(e, Error::File { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&p.display().to_string()), "{msg}");
    msg
}

#[test]
fn unsupported_tensor_types_are_errors_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    // TQ1_0 (id 34): 256 elements in 54 bytes. MLX's loader dropped it without a word.
    let p = Builder::default().tensor("tq.weight", &[256], 34, &[0; 54]).write(dir.path(), "tq1_0.gguf");
    let msg = load_err(&p);
    assert!(msg.contains("tq.weight") && msg.contains("TQ1_0") && msg.contains("not supported"), "{msg}");
    let msg = load_err(&fixture("gguf_import/unsupported_type.gguf"));
    assert!(msg.contains("token_embd.weight") && msg.contains("IQ4_NL"), "{msg}");
    // An id GGML does not define.
    let p = Builder::default().tensor("x", &[4], 99, &[0; 16]).write(dir.path(), "type99.gguf");
    assert!(load_err(&p).contains("unknown tensor type id 99"));
}

#[test]
fn malformed_headers_are_errors_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let cases = [
        (
            Builder::default().tensor("a", &[2], 0, &f32s(&[1., 2.])).tensor("a", &[2], 0, &f32s(&[3., 4.])),
            "tensor `a` appears twice",
        ),
        (Builder::default().kv("k", 4, &1u32.to_le_bytes()).kv("k", 4, &2u32.to_le_bytes()), "`k` appears twice"),
        (Builder::default().kv("k", 13, &[0; 8]), "unknown value type 13"),
        (Builder::default().tensor("x", &[1, 1, 1, 1, 1], 0, &f32s(&[1.])), "5 dimensions"),
        (Builder::default().tensor("q", &[48], 8, &[0; 51]), "not a multiple of the block size 32"),
        (
            // `a.weight` as Q8_0 becomes `a.weight`, `a.scales`, `a.biases`: a tensor named
            // `a.scales` collides, as it did in MLX's loader.
            Builder::default().tensor("a.weight", &[32], 8, &[0; 34]).tensor("a.scales", &[1], 0, &f32s(&[1.])),
            "a second tensor is named `a.scales`",
        ),
    ];
    for (i, (b, want)) in cases.into_iter().enumerate() {
        let p = b.write(dir.path(), &format!("case{i}.gguf"));
        let msg = load_err(&p);
        assert!(msg.contains(want), "case {i}: {msg}");
    }
}

#[test]
fn handmade_file_loads_with_mlx_conventions() {
    let dir = tempfile::tempdir().unwrap();
    // An array of arrays has no MLX form (GgufValue::None); f64 is a float64 0-d array.
    let mut nested = 4u32.to_le_bytes().to_vec(); // element type: u32
    nested.extend(1u64.to_le_bytes());
    nested.extend(9u32.to_le_bytes());
    let mut outer = 9u32.to_le_bytes().to_vec(); // element type: array
    outer.extend(1u64.to_le_bytes());
    outer.extend(&nested);
    let f64s: Vec<u8> = [0.5f64, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut f64_array = 12u32.to_le_bytes().to_vec();
    f64_array.extend(2u64.to_le_bytes());
    f64_array.extend(&f64s);
    let p = Builder::default()
        .kv("nested", 9, &outer)
        .kv("pi", 12, &std::f64::consts::PI.to_le_bytes())
        .kv("f64s", 9, &f64_array)
        .tensor("d", &[2], 28, &f64s) // F64 tensor: dequantized to f32
        .tensor("e", &[0, 3], 0, &[]) // an empty F32 tensor
        .write(dir.path(), "handmade.gguf");
    let g = Gguf::load(&p).unwrap();
    assert!(matches!(g.metadata["nested"], GgufValue::None));
    assert_eq!(g.number("pi").unwrap(), std::f64::consts::PI);
    let GgufValue::Array(a) = &g.metadata["f64s"] else { panic!() };
    assert_eq!((a.dtype(), a.to_vec::<f64>().unwrap()), (Dtype::Float64, vec![0.5, -2.0]));
    let d = g.tensor("d").unwrap();
    assert_eq!((d.dtype(), d.to_vec::<f32>().unwrap()), (Dtype::Float32, vec![0.5, -2.0]));
    assert_eq!(g.tensor("e").unwrap().shape(), vec![3, 0]);
}
