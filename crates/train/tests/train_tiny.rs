//! A whole training run on the tiny Qwen3 target of `test-support`: self-distilled samples,
//! teacher states, a fresh drafter, training with a checkpoint and a resume; the loss falls
//! and the trained checkpoint (DeepSpec format, bf16) drafts for the target through the
//! speculative executor, losslessly and with a stated acceptance.
use std::path::Path;

use drafter::Drafter;
use mlx_core::{Dtype, KernelPolicy, io};
use models::{GenerateParams, LoadOptions, ModelConfig, Sampler, Transformer, load_model};
use spec::dspark::DSparkProvider;
use spec::{DraftProvider, SpecOptions, speculative_generate};
use train::distill::{Answering, Sample, TeacherStates, generate_samples, teacher_states};
use train::init::{DrafterShape, Init, drafter_config, frequent_tokens, new_drafter_weights};
use train::run::{Run, RunSettings};

fn prompts(seed: u64, n: usize) -> Vec<(String, Vec<u32>)> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|i| (format!("random:{i}"), (0..6).map(|_| rng.u32(1..250)).collect())).collect()
}

fn f32_options() -> LoadOptions {
    LoadOptions { dtype: Some(Dtype::Float32), kernels: KernelPolicy::mlx() }
}

/// Greedy speculative decoding of `prompts` with the drafter in `dir` (blocks of 4):
/// (tau, every output equal to plain decoding).
fn acceptance(target: &Transformer, dir: &Path, prompts: &[(String, Vec<u32>)]) -> (f64, bool) {
    let provider = DSparkProvider::new(Drafter::load(dir, &f32_options()).unwrap(), "trained").unwrap();
    let params = GenerateParams { max_tokens: 32, sampler: Sampler::default(), eos: vec![] };
    let (mut accepted, mut rounds, mut lossless) = (0, 0, true);
    for (_, prompt) in prompts {
        let mut source = provider.open(target, &params.sampler).unwrap();
        let mut got = Vec::new();
        let stats = speculative_generate(target, source.as_mut(), prompt, &params, SpecOptions::from(4), |t| {
            got.push(t);
            true
        })
        .unwrap();
        let mut plain = Vec::new();
        models::generate(target, prompt, &params, |t| {
            plain.push(t);
            true
        })
        .unwrap();
        lossless &= got == plain;
        accepted += stats.accepted;
        rounds += stats.rounds;
    }
    ((accepted + rounds) as f64 / rounds.max(1) as f64, lossless)
}

fn bytes_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    io::load_safetensors(dir.join("model.safetensors"))
        .unwrap()
        .tensors
        .into_iter()
        .map(|(k, a)| (k, a.to_bytes().unwrap()))
        .collect()
}

/// The tiny target in a temporary directory and its greedy answers (40 tokens) to 24 random
/// prompts: `(dir, target directory, target, config, samples)`.
fn tiny_target_and_samples() -> (tempfile::TempDir, std::path::PathBuf, Transformer, ModelConfig, Vec<Sample>) {
    let tmp = tempfile::tempdir().unwrap();
    let target_dir = tmp.path().join("target");
    std::fs::create_dir_all(&target_dir).unwrap();
    test_support::dspark::write_tiny_target(&target_dir, 5, 0.3).unwrap();
    let target = load_model(&target_dir, &f32_options()).unwrap();
    let config = ModelConfig::from_dir(&target_dir).unwrap();
    let samples = generate_samples(&target, &prompts(1, 24), 40, &[], &batched(&ngram()), &mut |_| Ok(())).unwrap();
    (tmp, target_dir, target, config, samples)
}

fn ngram() -> spec::ngram::NgramProvider {
    spec::providers::NgramSpec::default().provider().unwrap()
}

/// Four requests at once, drafted by `drafts`.
fn batched(drafts: &dyn spec::DraftProvider) -> Answering<'_> {
    Answering { drafts, num_draft_tokens: 4, max_batch: 4, deadline: None }
}

#[test]
fn batched_speculative_answers_are_plain_greedy_decodings() {
    let tmp = tempfile::tempdir().unwrap();
    test_support::dspark::write_tiny_target(tmp.path(), 5, 0.3).unwrap();
    let target = load_model(tmp.path(), &f32_options()).unwrap();
    let prompts = prompts(7, 9);
    let eos = [17u32];
    let mut seen = Vec::new();
    let drafts = ngram();
    let samples = generate_samples(&target, &prompts, 30, &eos, &batched(&drafts), &mut |s| {
        seen.push(s.source.clone());
        Ok(())
    })
    .unwrap();
    assert_eq!(samples.len(), prompts.len());
    seen.sort();
    let mut sources: Vec<String> = prompts.iter().map(|(s, _)| s.clone()).collect();
    sources.sort();
    assert_eq!(seen, sources, "on_sample sees every answer once");
    let params = models::GenerateParams { max_tokens: 30, sampler: models::Sampler::default(), eos: eos.to_vec() };
    for ((source, prompt), sample) in prompts.iter().zip(&samples) {
        let mut plain = prompt.clone();
        models::generate(&target, prompt, &params, |t| {
            plain.push(t);
            true
        })
        .unwrap();
        assert_eq!(&sample.source, source, "samples come back in prompt order");
        assert_eq!(sample.prompt_len, prompt.len());
        assert_eq!(sample.ids, plain, "{source}: the batched answer differs from plain greedy decoding");
    }
    // A deadline already passed answers nothing.
    let late = Answering { deadline: Some(std::time::Instant::now()), ..batched(&drafts) };
    assert!(generate_samples(&target, &prompts, 30, &eos, &late, &mut |_| Ok(())).unwrap().is_empty());
}

/// 120 steps of one sequence and 16 blocks each at learning rate 3e-3.
fn settings(checkpoint_every: u64) -> RunSettings {
    RunSettings {
        steps: 120,
        lr: 3e-3,
        warmup_ratio: 0.05,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
        num_anchors: 16,
        seed: 9,
        checkpoint_every,
        init: Init::Random,
        ce_loss_alpha: 0.1,
        l1_loss_alpha: 0.9,
    }
}

#[test]
fn a_drafter_trained_on_the_tiny_targets_own_answers_learns_to_draft_for_it() {
    let (tmp, target_dir, target, config, samples) = tiny_target_and_samples();
    assert!(samples.iter().all(|s| s.answer_len() == 40 && s.prompt_len == 6));
    let held_out = prompts(2, 6);

    let shape = DrafterShape { block_size: 4, markov_rank: 16, ..DrafterShape::for_target(&config, 0) };
    assert_eq!(shape.tap_layers, vec![0, 1, 2]);
    let teacher: Vec<TeacherStates> =
        samples.iter().map(|s| teacher_states(&target, &s.ids, &shape.tap_layers).unwrap()).collect();
    let weights = new_drafter_weights(&target_dir, &config, &shape, 3, Init::Random).unwrap();
    let settings = settings(50);
    let cfg = drafter_config(&config, &shape, settings.num_anchors);
    let open = |name: &str| {
        let (work, out) = (tmp.path().join(format!("{name}-work")), tmp.path().join(name));
        Run::open(&work, &out, cfg.clone(), weights.clone(), settings.clone()).unwrap()
    };

    // The untrained drafter drafts (almost) nothing the target accepts.
    let fresh = open("fresh");
    fresh.checkpoint().unwrap();
    let (tau_before, lossless) = acceptance(&target, &tmp.path().join("fresh"), &held_out);
    assert!(lossless);

    // One run straight through; another stopped at step 70 (checkpoint at 50 and on stop),
    // reopened from its files and finished: the same drafter, bit for bit.
    let mut losses = Vec::new();
    open("straight").train(&samples, &teacher, None, None, &mut |r| losses.push(r.loss)).unwrap();
    open("resumed").train(&samples, &teacher, Some(70), None, &mut |_| {}).unwrap();
    let mut resumed = open("resumed");
    assert_eq!(resumed.step(), 70);
    resumed.train(&samples, &teacher, None, None, &mut |_| {}).unwrap();
    assert_eq!(resumed.step(), 120);
    assert!(
        bytes_of(&tmp.path().join("resumed")) == bytes_of(&tmp.path().join("straight")),
        "resume changed the result"
    );

    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (early, late) = (mean(&losses[..5]), mean(&losses[losses.len() - 10..]));
    let (tau_after, lossless) = acceptance(&target, &tmp.path().join("straight"), &held_out);
    eprintln!("loss {early:.3} -> {late:.3}; tau on held-out prompts {tau_before:.2} -> {tau_after:.2}");
    assert!(lossless, "speculation with the trained drafter changed the output");
    assert!(late < 0.65 * early, "the loss did not fall: {early} -> {late}");
    assert!(tau_after >= 2.0 && tau_after > tau_before + 0.8, "tau {tau_before} -> {tau_after}");
}

/// A drafter with a reduced draft vocabulary (at most the 32 most frequent answer tokens of
/// 256) trains and drafts losslessly; the tokens it lacks are never drafted.
#[test]
fn a_drafter_with_a_reduced_draft_vocabulary_trains_and_drafts_losslessly() {
    let (tmp, target_dir, target, config, samples) = tiny_target_and_samples();
    let vocab = frequent_tokens(&samples, 32, &[7]);
    assert!(vocab.len() <= 32 && vocab.contains(&7) && vocab.windows(2).all(|w| w[0] < w[1]), "{vocab:?}");
    let k = vocab.len() as i32;
    let shape = DrafterShape {
        block_size: 4,
        markov_rank: 16,
        draft_vocab: Some(vocab.clone()),
        ..DrafterShape::for_target(&config, 0)
    };
    let teacher: Vec<TeacherStates> =
        samples.iter().map(|s| teacher_states(&target, &s.ids, &shape.tap_layers).unwrap()).collect();
    let weights = new_drafter_weights(&target_dir, &config, &shape, 3, Init::Random).unwrap();
    assert_eq!(weights["lm_head.weight"].shape(), vec![k, 64]);
    assert_eq!(weights["markov_head.markov_w2.weight"].shape(), vec![k, 16]);
    let settings = settings(200);
    let out = tmp.path().join("drafter");
    let mut run = Run::open(
        &tmp.path().join("work"),
        &out,
        drafter_config(&config, &shape, settings.num_anchors),
        weights,
        settings,
    )
    .unwrap();
    let mut losses = Vec::new();
    run.train(&samples, &teacher, None, None, &mut |r| losses.push(r.loss)).unwrap();
    let d = Drafter::load(&out, &f32_options()).unwrap();
    assert_eq!(d.draft_vocab_ids(), Some(vocab.as_slice()));
    assert_eq!(d.config().draft_vocab_size, Some(vocab.len()));
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["num_anchors"], 16, "the config records the anchors per step it was trained with");
    let (tau, lossless) = acceptance(&target, &out, &prompts(2, 6));
    eprintln!("reduced vocabulary: loss {:.3} -> {:.3}, tau {tau:.2}", losses[0], losses[losses.len() - 1]);
    assert!(lossless);
    assert!(tau >= 1.8, "tau {tau}");
    // Every draft is a token of the draft vocabulary.
    let mut ctx = d.new_context();
    let width = d.config().feature_width() as i32;
    d.ingest(&mut ctx, &mlx_core::Array::zeros(&[1, 3, width], Dtype::Float32).unwrap()).unwrap();
    let p = d.propose(&mut ctx, 5, 0.0).unwrap();
    assert!(p.all_drafts.iter().all(|t| vocab.binary_search(t).is_ok()), "{:?}", p.all_drafts);
    assert_eq!(p.logits.shape(), vec![1, 4, 256]);
}

/// `Init::Target`: draft layer `j` starts as the target's layer `L - L_d + j` (projections,
/// norms, per-head norms), `hidden_norm` as that first layer's input norm, and `fc` passes the
/// last tap through unchanged.
#[test]
fn a_drafter_initialised_from_the_target_copies_its_last_layers_and_selects_the_last_tap() {
    let tmp = tempfile::tempdir().unwrap();
    test_support::dspark::write_tiny_target(tmp.path(), 5, 0.3).unwrap();
    let config = ModelConfig::from_dir(tmp.path()).unwrap();
    let shape = DrafterShape { layers: 2, block_size: 4, markov_rank: 16, ..DrafterShape::for_target(&config, 0) };
    let w = new_drafter_weights(tmp.path(), &config, &shape, 3, Init::Target).unwrap();
    let target = models::weights::Weights::load(tmp.path()).unwrap();
    let first = config.num_hidden_layers - 2;
    let bytes = |a: &mlx_core::Array| a.astype(Dtype::Float32).unwrap().to_bytes().unwrap();
    for j in 0..2 {
        for m in ["self_attn.q_proj", "self_attn.o_proj", "self_attn.q_norm", "mlp.down_proj", "input_layernorm"] {
            let source = target.get(&format!("model.layers.{}.{m}.weight", first + j)).unwrap();
            assert_eq!(bytes(&w[&format!("layers.{j}.{m}.weight")]), bytes(source), "layers.{j}.{m}");
        }
    }
    assert_eq!(
        bytes(&w["hidden_norm.weight"]),
        bytes(target.get(&format!("model.layers.{first}.input_layernorm.weight")).unwrap())
    );
    let taps = shape.tap_layers.len() as i32;
    let h = config.hidden_size as i32;
    let f = mlx_core::random::normal(&[3, taps * h], Dtype::Float32, 0.0, 1.0, &mlx_core::random::Key::new(4)).unwrap();
    let through = f.matmul(&w["fc.weight"].transpose(&[1, 0]).unwrap()).unwrap();
    assert_eq!(bytes(&through), bytes(&f.slice_axis(1, (taps - 1) * h, taps * h).unwrap()));
    // Under the default initialisation nothing is copied.
    let r = new_drafter_weights(tmp.path(), &config, &shape, 3, Init::Random).unwrap();
    assert_ne!(bytes(&r["layers.0.mlp.down_proj.weight"]), bytes(&w["layers.0.mlp.down_proj.weight"]));
}

/// The objective's weights are run settings: a run with `ce_loss_alpha` 1 and
/// `l1_loss_alpha` 0 reports a loss of exactly its cross entropy plus its confidence term;
/// negative, non-finite or all-zero weights are refused naming both, before the work
/// directory is created; a resume with other weights is refused naming them.
#[test]
fn the_objectives_weights_are_settings_checked_on_open_and_resume() {
    let (tmp, target_dir, target, config, samples) = tiny_target_and_samples();
    let shape = DrafterShape { block_size: 4, markov_rank: 16, ..DrafterShape::for_target(&config, 0) };
    let teacher: Vec<TeacherStates> =
        samples.iter().map(|s| teacher_states(&target, &s.ids, &shape.tap_layers).unwrap()).collect();
    let weights = new_drafter_weights(&target_dir, &config, &shape, 3, Init::Random).unwrap();
    let hard = RunSettings { ce_loss_alpha: 1.0, l1_loss_alpha: 0.0, ..settings(50) };
    let cfg = drafter_config(&config, &shape, hard.num_anchors);
    let (work, out) = (tmp.path().join("work"), tmp.path().join("out"));
    let open = |s: &RunSettings| Run::open(&work, &out, cfg.clone(), weights.clone(), s.clone());

    let mut reports = Vec::new();
    open(&hard).unwrap().train(&samples, &teacher, Some(3), None, &mut |r| reports.push(r.clone())).unwrap();
    assert_eq!(reports.len(), 3);
    for r in &reports {
        assert!(r.l1 > 0.0, "the L1 term is still measured: {r:?}");
        assert!((r.loss - (r.ce + r.confidence)).abs() <= 1e-5 * r.loss.abs().max(1.0), "{r:?}");
    }

    let other = settings(50);
    let err = open(&other).err().expect("a resume with other loss weights").to_string();
    assert!(err.contains("ce_loss_alpha") && err.contains("l1_loss_alpha"), "{err}");
    for (ce, l1) in [(-0.1, 0.9), (0.0, 0.0), (f32::NAN, 1.0)] {
        let bad = RunSettings { ce_loss_alpha: ce, l1_loss_alpha: l1, ..settings(50) };
        let dir = tmp.path().join("bad");
        let err = Run::open(&dir, &out, cfg.clone(), weights.clone(), bad).err().expect("bad weights").to_string();
        assert!(err.contains("ce_loss_alpha") && err.contains("l1_loss_alpha"), "{err}");
        assert!(!dir.exists(), "a refused run created its work directory");
    }
}
