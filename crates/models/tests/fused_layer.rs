//! The fused decoder layer (`mlx_core::cpu_layer`: one CPU node per layer writing a full
//! cache, two around a rotating cache's write) gives the logits and hidden-state taps of the
//! op-by-op layer bit for bit, on every llama/qwen variation it takes (Qwen2's q/k/v biases,
//! Llama's o bias and llama3 RoPE frequencies, Qwen3's per-head q/k norms, 4- and 8-bit
//! weights of several group sizes, the three precisions), for a prompt, a verify window and a
//! one-token step; it is what those models run on; and the one-node layer's cache writes
//! (in place, or into a copy when a snapshot shares the buffers) survive growth, rollback
//! and prompt-cache copies.
use std::path::{Path, PathBuf};

use mlx_core::{Dtype, KernelPolicy, LayerNodes, Precision};
use models::generate::ids;
use models::{LoadOptions, ModelCache, RotatingKvCache, Transformer, load_model};
use quantize::{QuantizeOptions, quantize_model_dir};

/// The layer-node counter is process-wide: tests that read it run one at a time.
static COUNTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
/// one-token step, and the layer nodes the run evaluated; with full caches, or with
/// rotating ones wider than the run when `rotating`.
fn run(dir: &Path, kernels: KernelPolicy, rotating: bool) -> (Vec<Vec<f32>>, u64) {
    let model = load_model(dir, &LoadOptions { dtype: Some(Dtype::Float32), kernels }).unwrap();
    let mut cache = if rotating {
        let n = model.config.num_hidden_layers;
        ModelCache { layers: (0..n).map(|_| Box::new(RotatingKvCache::new(64, 8)) as _).collect() }
    } else {
        model.make_cache()
    };
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
    let _serial = COUNTER.lock().unwrap_or_else(|e| e.into_inner());
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
            let off = KernelPolicy { layer: LayerNodes::Ops, ..on.clone() };
            let (one, one_nodes) = run(dir, on.clone(), false);
            let (two, two_nodes) = run(dir, on.clone(), true);
            let (split, split_nodes) = run(dir, KernelPolicy { layer: LayerNodes::Split, ..on.clone() }, false);
            let (separate, none) = run(dir, off, false);
            assert_eq!(one_nodes, 3 * 2, "{name} {precision}: two layers, one node each, three forwards");
            assert_eq!(two_nodes, 3 * 2 * 2, "{name} {precision}: two layers, two nodes each around a rotating cache");
            assert_eq!(split_nodes, 3 * 2 * 2, "{name} {precision}: `split`, two nodes a layer");
            assert_eq!(none, 0, "{name} {precision}: the layer switch off runs op by op");
            for (what, fused) in [("one-node", &one), ("two-node (rotating cache)", &two), ("split", &split)] {
                assert_eq!(fused.len(), separate.len());
                for (i, (a, b)) in fused.iter().zip(&separate).enumerate() {
                    assert!(
                        same_bits(a, b),
                        "{name} {precision}: output {i} differs between the {what} and the op-by-op layer"
                    );
                }
            }
        }
    }
}

/// Under the int8 precision the loader gives the q/k/v, output and down projections f32
/// activations and gate/up int8 ones (`Precision::of`), the fused layer's node the same: the
/// test above finds the two paths equal bit for bit, this one that the split is the one meant.
#[test]
fn int8_layers_keep_f32_activations_for_qkv_o_and_down() {
    let dir = parity("llama_q4");
    let config = models::ModelConfig::from_dir(&dir).unwrap();
    let quant = models::config::QuantizationConfig::from_config(&config, &dir.join("config.json")).unwrap();
    let kernels = KernelPolicy::all_on().with_precision(Precision::Int8);
    let ctx = models::layers::LoadContext { quant, dtype: Some(Dtype::Float32), kernels };
    let mut weights = models::weights::Weights::load(&dir).unwrap();
    let mut loader = models::loader::Loader::new(&mut weights, &ctx);
    let (h, i, heads) = (config.hidden_size, config.intermediate_size, config.num_attention_heads);
    let kv = config.num_key_value_heads.unwrap_or(heads) * (h / heads);
    for (name, out, inp, want) in [
        ("model.layers.0.self_attn.q_proj", h, h, Precision::F32),
        ("model.layers.0.self_attn.k_proj", kv, h, Precision::F32),
        ("model.layers.0.self_attn.v_proj", kv, h, Precision::F32),
        ("model.layers.0.self_attn.o_proj", h, h, Precision::F32),
        ("model.layers.0.mlp.gate_proj", i, h, Precision::Int8),
        ("model.layers.0.mlp.up_proj", i, h, Precision::Int8),
        ("model.layers.0.mlp.down_proj", h, i, Precision::F32),
    ] {
        let linear = loader.linear(name, out, inp, false).unwrap();
        assert!(linear.quantized().is_some(), "{name}");
        assert_eq!(linear.kernels().precision, want, "{name}");
    }
}

#[test]
fn dense_models_and_a_policy_without_the_layer_keep_the_op_by_op_layer() {
    let _serial = COUNTER.lock().unwrap_or_else(|e| e.into_inner());
    if mlx_core::backend() != mlx_core::Backend::Cpu {
        return;
    }
    let (_, dense_nodes) = run(&parity("llama"), KernelPolicy::all_on(), false);
    assert_eq!(dense_nodes, 0, "dense weights do not take the quantized layer");
    let off = KernelPolicy { sdpa: false, ..KernelPolicy::all_on() };
    let (_, nodes) = run(&parity("llama_q4"), off, false);
    assert_eq!(nodes, 0, "the layer needs every kernel it is made of");
    let tmp = tempfile::tempdir().unwrap();
    let (_, mlp_bias) = run(&quantized("llama_untied_bias", 4, 64, tmp.path()), KernelPolicy::all_on(), false);
    assert_eq!(mlp_bias, 0, "MLP biases keep the op-by-op layer");
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The logits of `tokens` fed to `cache` in one forward.
fn logits(model: &Transformer, cache: &mut ModelCache, tokens: &[u32]) -> Vec<f32> {
    model.forward(&ids(tokens).unwrap(), cache).unwrap().to_vec::<f32>().unwrap()
}

/// The one-node layer writes the cache's buffers itself: across a growth of the buffers
/// (prompt rows copied), after a rollback (rows rewritten), and with a prompt-cache copy
/// sharing the buffers (its write goes to a copy, never into the buffers the other cache
/// reads), the logits equal the op-by-op layer's on the same token stream.
#[test]
fn the_one_node_layer_keeps_caches_right_through_growth_rollback_and_copies() {
    let _serial = COUNTER.lock().unwrap_or_else(|e| e.into_inner());
    if mlx_core::backend() != mlx_core::Backend::Cpu {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = quantized("llama", 4, 32, tmp.path());
    let load = |kernels| load_model(&dir, &LoadOptions { dtype: Some(Dtype::Float32), kernels }).unwrap();
    let on = KernelPolicy::all_on();
    let (fused, reference) = (load(on.clone()), load(KernelPolicy { layer: LayerNodes::Ops, ..on }));
    let vocab = fused.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..250u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let window: Vec<u32> = (0..10u32).map(|i| (i * 31 + 5) % vocab).collect();
    let before = mlx_core::cpu_layer::calls();
    // One stream of forwards on both models: a 250-token prompt, a 10-token window that grows
    // the buffers past 256 positions, a rollback of 6, a one-token step.
    let script = |model: &Transformer| {
        let mut cache = model.make_cache();
        let mut out = vec![logits(model, &mut cache, &prompt), logits(model, &mut cache, &window)];
        assert_eq!(cache.trim(6), 6);
        out.push(logits(model, &mut cache, &[77 % vocab]));
        out
    };
    let (a, b) = (script(&fused), script(&reference));
    assert!(mlx_core::cpu_layer::calls() > before, "the fused model ran its layer nodes");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(same_bits(x, y), "forward {i}: the one-node layer differs from the op-by-op layer");
    }
    // A prompt-cache copy shares the buffers: the original and the copy each write their own
    // next token at the same position, then the original steps again. Its logits must be
    // those of a cache that never shared anything.
    let mut cache = fused.make_cache();
    logits(&fused, &mut cache, &prompt[..40]);
    assert!(vocab > 203, "three distinct tokens");
    let mut copy = cache.prefix(40).expect("a full cache copies");
    logits(&fused, &mut cache, &[101 % vocab]);
    logits(&fused, &mut copy, &[202 % vocab]);
    let shared = logits(&fused, &mut cache, &[203 % vocab]);
    let mut alone = reference.make_cache();
    logits(&reference, &mut alone, &prompt[..40]);
    logits(&reference, &mut alone, &[101 % vocab]);
    let expected = logits(&reference, &mut alone, &[203 % vocab]);
    assert!(same_bits(&shared, &expected), "a copy's write reached the buffers of the cache it was copied from");
    let copied = logits(&fused, &mut copy, &[203 % vocab]);
    let mut other = reference.make_cache();
    logits(&reference, &mut other, &prompt[..40]);
    logits(&reference, &mut other, &[202 % vocab]);
    assert!(same_bits(&copied, &logits(&reference, &mut other, &[203 % vocab])), "the copy lost its own write");
}
