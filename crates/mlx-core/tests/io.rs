//! safetensors and GGUF IO, including the errors for bad files.
use mlx_core::io::{Gguf, GgufValue, load_safetensors, save_safetensors};
use mlx_core::{Array, Dtype, Error, bf16, f16};

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

#[test]
fn safetensors_round_trip_keeps_values_dtypes_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let a = Array::from_slice(&[1.5f32, -2.0, 3.25, 0.0, 7.0, 8.0], &[2, 3]).unwrap();
    let b = Array::from_slice(&[f16::from_f32(0.5), f16::from_f32(-1.0)], &[2]).unwrap();
    let c = Array::from_slice(&[bf16::from_f32(3.0)], &[1, 1]).unwrap();
    let d = Array::from_slice(&[7u32, 8, 9], &[3]).unwrap();
    save_safetensors(&path, [("a", &a), ("b.weight", &b), ("c", &c), ("d", &d)], [("format", "mlx")]).unwrap();
    // no temporary file left beside it
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    let st = load_safetensors(&path).unwrap();
    assert_eq!(st.metadata.get("format").map(String::as_str), Some("mlx"));
    assert_eq!(st.tensors.len(), 4);
    assert_eq!(st.get("a").unwrap().to_vec::<f32>().unwrap(), a.to_vec::<f32>().unwrap());
    assert_eq!(st.get("a").unwrap().shape(), vec![2, 3]);
    assert_eq!(st.get("b.weight").unwrap().dtype(), Dtype::Float16);
    assert_eq!(st.get("b.weight").unwrap().to_vec::<f16>().unwrap(), b.to_vec::<f16>().unwrap());
    assert_eq!(st.get("c").unwrap().dtype(), Dtype::Bfloat16);
    assert_eq!(st.get("d").unwrap().to_vec::<u32>().unwrap(), vec![7, 8, 9]);
    let e = st.get("nope").unwrap_err();
    assert!(matches!(e, Error::Missing { .. }));
    assert!(e.to_string().contains("nope") && e.to_string().contains("model.safetensors"), "{e}");
}

#[test]
fn missing_file_names_the_path() {
    let e = load_safetensors("/definitely/not/here.safetensors").unwrap_err();
    assert!(matches!(e, Error::File { .. }));
    let msg = e.to_string();
    assert!(msg.contains("/definitely/not/here.safetensors") && msg.contains("no such file"), "{msg}");
    let e = Gguf::load("/definitely/not/here.gguf").unwrap_err();
    assert!(e.to_string().contains("here.gguf"), "{e}");
}

#[test]
fn truncated_safetensors_is_an_error_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    let a = Array::from_slice(&vec![1.0f32; 64], &[8, 8]).unwrap();
    save_safetensors(&good, [("a", &a)], []).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;

    // 1. cut inside the JSON header
    let cut = dir.path().join("cut-header.safetensors");
    std::fs::write(&cut, &bytes[..8 + header_len / 2]).unwrap();
    let msg = load_safetensors(&cut).unwrap_err().to_string();
    assert!(msg.contains("cut-header.safetensors"), "{msg}");

    // 2. shorter than the 8-byte length prefix
    let tiny = dir.path().join("tiny.safetensors");
    std::fs::write(&tiny, [1u8, 2, 3]).unwrap();
    let msg = load_safetensors(&tiny).unwrap_err().to_string();
    assert!(msg.contains("tiny.safetensors"), "{msg}");

    // 3. header intact, tensor data cut
    let cut_data = dir.path().join("cut-data.safetensors");
    std::fs::write(&cut_data, &bytes[..bytes.len() - 16]).unwrap();
    let msg = load_safetensors(&cut_data).unwrap_err().to_string();
    assert!(msg.contains("cut-data.safetensors"), "{msg}");

    // 4. garbage header
    let junk = dir.path().join("junk.safetensors");
    let mut j = 20u64.to_le_bytes().to_vec();
    j.extend_from_slice(b"this is not json!!!!");
    std::fs::write(&junk, &j).unwrap();
    let msg = load_safetensors(&junk).unwrap_err().to_string();
    assert!(msg.contains("junk.safetensors"), "{msg}");
}

#[test]
fn save_into_missing_directory_is_an_error() {
    let a = Array::scalar(1.0);
    let e = save_safetensors("/definitely/not/here/x.safetensors", [("a", &a)], []).unwrap_err();
    assert!(e.to_string().contains("/definitely/not/here/x.safetensors"), "{e}");
}

#[test]
fn gguf_tensors_and_metadata_match_gguf_py() {
    let g = Gguf::load(fixtures().join("gguf/tiny.gguf")).unwrap();
    let expected = load_safetensors(fixtures().join("gguf/tiny.expected.safetensors")).unwrap();
    assert_eq!(g.string("general.architecture").unwrap(), "llama");
    assert_eq!(g.number("llama.block_count").unwrap(), 2.0);
    assert_eq!(g.number("llama.embedding_length").unwrap(), 64.0);
    assert!((g.number("llama.rope.freq_base").unwrap() - 10000.0).abs() < 1e-3);
    assert_eq!(g.number("tiny.flag").unwrap(), 1.0);
    assert_eq!(g.strings("tokenizer.ggml.tokens").unwrap(), ["<s>", "</s>", "hello", "world"]);
    assert!(g.string("tokenizer.chat_template").unwrap().contains("messages"));
    match &g.metadata["tiny.int_list"] {
        GgufValue::Array(a) => assert_eq!(a.astype(Dtype::Int64).unwrap().to_vec::<i64>().unwrap(), vec![1, 2, 3]),
        other => panic!("tiny.int_list: {other:?}"),
    }
    assert!(matches!(g.string("llama.block_count"), Err(Error::File { .. })));
    assert!(matches!(g.number("nope"), Err(Error::Missing { .. })));

    // Dense tensors load as themselves; Q8_0/Q4_0/Q4_1 load as affine triples (group 32)
    // whose dequantization equals gguf-py's to within f16 rounding of the scales.
    assert_eq!(g.tensor("f32.weight").unwrap().dtype(), Dtype::Float32);
    assert_eq!(g.tensor("f16.weight").unwrap().dtype(), Dtype::Float16);
    assert_eq!(g.tensor("norm").unwrap().shape(), vec![64]);
    for (name, bits) in [("q8_0", 8), ("q4_0", 4), ("q4_1", 4)] {
        let w = g.tensor(&format!("{name}.weight")).unwrap();
        assert_eq!(w.dtype(), Dtype::Uint32);
        assert_eq!(w.shape(), vec![4, 64 * bits / 32]);
        let spec = mlx_core::quant::QuantSpec::new(32, bits).unwrap();
        let dq = mlx_core::quant::dequantize(
            w,
            g.tensor(&format!("{name}.scales")).unwrap(),
            g.tensor(&format!("{name}.biases")).unwrap(),
            spec,
        )
        .unwrap()
        .astype(Dtype::Float32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
        let want = expected.get(&format!("{name}.weight")).unwrap().to_vec::<f32>().unwrap();
        let d = dq.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d < 2e-3, "{name}: max diff {d}");
    }
    for name in ["f32.weight", "f16.weight"] {
        let ours = g.tensor(name).unwrap().astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
        let want = expected.get(name).unwrap().to_vec::<f32>().unwrap();
        let d = ours.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d < 1e-6, "{name}: max diff {d}");
    }
}

#[test]
fn not_a_gguf_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("fake.gguf");
    std::fs::write(&p, b"GGUF but not really").unwrap();
    let msg = Gguf::load(&p).unwrap_err().to_string();
    assert!(msg.contains("fake.gguf"), "{msg}");
}

#[test]
fn safetensors_shorter_than_the_length_prefix_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.safetensors");
    std::fs::write(&tiny, [1u8, 2, 3]).unwrap();
    let e = load_safetensors(&tiny).unwrap_err();
    assert!(matches!(e, Error::File { .. }));
    let msg = e.to_string();
    assert!(msg.contains("tiny.safetensors") && msg.contains("3 bytes") && msg.contains("too short"), "{msg}");
}

#[test]
fn save_into_missing_directory_names_the_target_and_the_os_reason() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("missing/x.safetensors");
    let a = Array::scalar(1.0);
    let msg = save_safetensors(&target, [("a", &a)], []).unwrap_err().to_string();
    assert!(msg.starts_with(&target.display().to_string()), "{msg}");
    assert!(msg.contains("No such file or directory") && !msg.contains(".tmp-"), "{msg}");
    // A file where the directory should be.
    std::fs::write(dir.path().join("file"), "x").unwrap();
    let msg = save_safetensors(dir.path().join("file/x.safetensors"), [("a", &a)], []).unwrap_err().to_string();
    assert!(msg.contains("is not a directory"), "{msg}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "nothing left behind");
}

/// A safetensors file with `header` (JSON) and `data_len` zero bytes of data.
fn raw_safetensors(dir: &std::path::Path, header: serde_json::Value, data_len: usize) -> std::path::PathBuf {
    let path = dir.join("raw.safetensors");
    let h = header.to_string().into_bytes();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h);
    bytes.extend(std::iter::repeat_n(0u8, data_len));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn safetensors_headers_are_checked_before_mlx_trusts_them() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        // Two tensors over the same bytes.
        (
            serde_json::json!({
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}
            }),
            24,
            "overlap",
        ),
        // A dimension of 2^32 + 576, which a 32-bit reader sees as 576.
        (
            serde_json::json!({"a": {"dtype": "U8", "shape": [4_294_967_872u64], "data_offsets": [0, 576]}}),
            576,
            "needs 4294967872",
        ),
        // Offsets past the end of the file.
        (serde_json::json!({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}), 16, "past the end"),
        (serde_json::json!(["not", "an", "object"]), 0, "not a safetensors JSON object"),
    ];
    for (header, data_len, want) in cases {
        let path = raw_safetensors(dir.path(), header, data_len);
        let msg = load_safetensors(&path).unwrap_err().to_string();
        assert!(msg.contains(want) && msg.contains("raw.safetensors"), "{want}: {msg}");
    }
}
