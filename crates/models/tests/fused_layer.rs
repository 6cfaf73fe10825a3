//! The fused decoder layer (`mlx_core::cpu_layer`: two CPU nodes per layer) gives the logits
//! and hidden-state taps of the op-by-op layer bit for bit, on every llama/qwen variation it
//! takes (Qwen2's q/k/v biases, Llama's o bias and llama3 RoPE frequencies, Qwen3's per-head
//! q/k norms, 4- and 8-bit weights of several group sizes, the three precisions), for a
//! prompt, a verify window and a one-token step; and it is what those models run on.
use std::path::{Path, PathBuf};

use mlx_core::{Dtype, KernelPolicy, Precision};
use models::generate::ids;
use models::{LoadOptions, load_model};
use quantize::{QuantizeOptions, quantize_model_dir};

fn parity(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name)
}

/// `name` quantized to `bits` / `group_size` in `tmp`.
fn quantized(name: &str, bits: i32, group_size: i32, tmp: &Path) -> PathBuf {
    let dst = tmp.join(format!("{name}-{bits}-{group_size}"));
    let options = QuantizeOptions { bits, group_size, ..QuantizeOptions::default() };
    quantize_model_dir(&parity(name), &dst, &options, &mut |_| {}).unwrap();
    dst
}

/// `llama_untied_bias` (q/k/v and o biases, llama3 RoPE frequencies) without its MLP biases,
/// which the fused layer does not take.
fn llama_attention_bias(tmp: &Path) -> PathBuf {
    let (src, dst) = (parity("llama_untied_bias"), tmp.join("llama_attention_bias"));
    std::fs::create_dir_all(&dst).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["mlp_bias"] = false.into();
    std::fs::write(dst.join("config.json"), config.to_string()).unwrap();
    let st = mlx_core::io::load_safetensors(src.join("model.safetensors")).unwrap();
    let kept = st.tensors.iter().filter(|(n, _)| !(n.contains(".mlp.") && n.ends_with(".bias")));
    mlx_core::io::save_safetensors(dst.join("model.safetensors"), kept.map(|(n, a)| (n.as_str(), a)), []).unwrap();
    dst
}

/// Logits and taps (flattened, in order) of a 5-token prompt, a 4-token window and a
/// one-token step, and the layer nodes the run evaluated.
fn run(dir: &Path, kernels: KernelPolicy) -> (Vec<Vec<f32>>, u64) {
    let model = load_model(dir, &LoadOptions { dtype: Some(Dtype::Float32), kernels }).unwrap();
    let mut cache = model.make_cache();
    let before = mlx_core::cpu_layer::calls();
    let mut out = Vec::new();
    for part in [&[3u32, 17, 42, 5, 99][..], &[23, 7, 64, 12], &[31]] {
        let f = model.forward_with_taps(&ids(part).unwrap(), &mut cache, &[0, 1]).unwrap();
        out.push(f.logits.to_vec::<f32>().unwrap());
        out.extend(f.taps.iter().map(|t| t.to_vec::<f32>().unwrap()));
    }
    (out, mlx_core::cpu_layer::calls() - before)
}

#[test]
fn fused_layer_equals_the_op_by_op_layer_bit_for_bit() {
    if mlx_core::backend() != mlx_core::Backend::Cpu {
        eprintln!("skipped: the fused layer runs on the CPU backend only");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let cases = [("llama", 4, 32), ("llama", 8, 64), ("qwen2", 4, 32), ("qwen3", 8, 32), ("qwen3", 4, 64)];
    let mut dirs: Vec<(String, PathBuf)> =
        cases.iter().map(|&(n, b, g)| (format!("{n} {b}-bit g{g}"), quantized(n, b, g, tmp.path()))).collect();
    let attention_bias = llama_attention_bias(tmp.path());
    let options = QuantizeOptions { bits: 4, group_size: 64, ..QuantizeOptions::default() };
    let biased = tmp.path().join("llama_attention_bias-4-64");
    quantize_model_dir(&attention_bias, &biased, &options, &mut |_| {}).unwrap();
    dirs.push(("llama with q/k/v/o biases and llama3 RoPE, 4-bit g64".into(), biased));
    dirs.push(("llama_q4 (mlx-lm)".into(), parity("llama_q4")));
    for (name, dir) in &dirs {
        for precision in [Precision::F32, Precision::Bf16, Precision::Int8] {
            let on = KernelPolicy::all_on().with_precision(precision);
            let off = KernelPolicy { layer: false, ..on.clone() };
            let (fused, nodes) = run(dir, on.clone());
            let (separate, none) = run(dir, off);
            assert_eq!(nodes, 3 * 2 * 2, "{name} {precision}: two layers, two nodes each, three forwards");
            assert_eq!(none, 0, "{name} {precision}: the layer switch off runs op by op");
            assert_eq!(fused.len(), separate.len());
            for (i, (a, b)) in fused.iter().zip(&separate).enumerate() {
                let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{name} {precision}: output {i} differs between the fused and the op-by-op layer");
            }
        }
    }
}

#[test]
fn dense_models_and_a_policy_without_the_layer_keep_the_op_by_op_layer() {
    if mlx_core::backend() != mlx_core::Backend::Cpu {
        return;
    }
    let (_, dense_nodes) = run(&parity("llama"), KernelPolicy::all_on());
    assert_eq!(dense_nodes, 0, "dense weights do not take the quantized layer");
    let off = KernelPolicy { sdpa: false, ..KernelPolicy::all_on() };
    let (_, nodes) = run(&parity("llama_q4"), off);
    assert_eq!(nodes, 0, "the layer needs every kernel it is made of");
    let tmp = tempfile::tempdir().unwrap();
    let (_, mlp_bias) = run(&quantized("llama_untied_bias", 4, 64, tmp.path()), KernelPolicy::all_on());
    assert_eq!(mlp_bias, 0, "MLP biases keep the op-by-op layer");
}
