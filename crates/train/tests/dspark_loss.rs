//! The drafter's training forward and the DSpark loss against DeepSpec's own training code
//! (`fixtures/deepspec/train/make_loss_golden.py`): forward outputs, loss value and the
//! gradient of every trainable parameter, on the tiny Qwen3 DSpark checkpoint and the two tiny
//! Gemma4 ones (K = V and with `v_proj`).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use drafter::training::{TrainingSequence, anchor_candidates};
use drafter::{Drafter, DrafterConfig};
use mlx_core::{Array, Dtype, KernelPolicy, autograd, io};
use models::LoadOptions;
use models::weights::Weights;
use train::DSparkLoss;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepspec")
}

fn options() -> LoadOptions {
    LoadOptions { dtype: Some(Dtype::Float32), kernels: KernelPolicy::mlx() }
}

/// The checkpoint's tensors, f32, split into trainable (in `names` order) and frozen.
fn split_params(dir: &Path, names: &[String]) -> (Vec<Array>, BTreeMap<String, Array>) {
    let file = io::load_safetensors(dir.join("model.safetensors")).unwrap();
    let mut all: BTreeMap<String, Array> =
        file.tensors.into_iter().map(|(k, v)| (k, v.astype(Dtype::Float32).unwrap())).collect();
    let trainable = names.iter().map(|n| all.remove(n).unwrap_or_else(|| panic!("{n} in the checkpoint"))).collect();
    // frozen: the shared embedding and head, and Gemma4's layer scalars (buffers, not parameters)
    assert!(
        all.keys()
            .all(|k| ["embed_tokens.weight", "lm_head.weight"].contains(&k.as_str()) || k.ends_with(".layer_scalar")),
        "{:?}",
        all.keys()
    );
    (trainable, all)
}

fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

#[test]
fn qwen3_forward_loss_and_gradients_match_deepspec() {
    check_golden("qwen3", "train/loss_golden.safetensors");
}

#[test]
fn gemma4_k_eq_v_forward_loss_and_gradients_match_deepspec() {
    check_golden("gemma4/k_eq_v", "train/loss_golden_gemma4_k_eq_v.safetensors");
}

#[test]
fn gemma4_v_proj_forward_loss_and_gradients_match_deepspec() {
    check_golden("gemma4/v_proj", "train/loss_golden_gemma4_v_proj.safetensors");
}

/// The golden training steps in `golden` (under `fixtures/deepspec`) of the checkpoint in
/// `checkpoint`.
fn check_golden(checkpoint: &str, golden: &str) {
    let golden = io::load_safetensors(fixtures().join(golden)).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&golden.metadata["golden"]).unwrap();
    let dir = fixtures().join(checkpoint);
    let config = DrafterConfig::from_dir(&dir).unwrap();
    for case in meta["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let get = |k: &str| golden.get(&format!("{name}.{k}")).unwrap().clone();
        let ids: Vec<u32> = get("input_ids").to_vec::<i32>().unwrap().into_iter().map(|t| t as u32).collect();
        let loss_mask: Vec<bool> = get("loss_mask").to_vec::<f32>().unwrap().into_iter().map(|m| m > 0.5).collect();
        let keep = get("keep").to_vec::<u8>().unwrap();
        let anchors: Vec<usize> = get("anchors")
            .to_vec::<i32>()
            .unwrap()
            .into_iter()
            .zip(&keep)
            .filter(|&(_, &k)| k == 1)
            .map(|(a, _)| a as usize)
            .collect();
        assert!(anchors.iter().all(|a| anchor_candidates(&loss_mask).contains(a)));
        let (taps, hidden) = (get("taps"), get("target_last_hidden"));
        let seq = TrainingSequence { input_ids: &ids, taps: &taps, target_hidden: &hidden, loss_mask: &loss_mask };
        let names: Vec<String> =
            case["trainable"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
        let (params, frozen) = split_params(&dir, &names);

        let build = |p: &[Array]| -> drafter::Result<Drafter> {
            let mut tensors = frozen.clone();
            tensors.extend(names.iter().cloned().zip(p.iter().cloned()));
            Drafter::from_weights(config.clone(), Weights::from_tensors(&dir, tensors), &options())
        };

        // The forward on the kept blocks (DeepSpec's dummy anchors carry no loss and are absent here).
        let out = build(&params).unwrap().training_forward(&seq, &anchors).unwrap();
        let n = anchors.len() as i32;
        let kept = |a: Array| a.slice_axis(0, 0, n).unwrap();
        let cmp = |what: &str, got: &Array, want: Array, tol: f32| {
            assert_eq!(got.shape(), want.shape(), "{name}: {what}");
            let d = max_rel(
                &got.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(),
                &want.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(),
            );
            assert!(d <= tol, "{name}: {what} differs by {d} of its largest entry");
        };
        cmp("draft logits", &out.draft_logits, kept(get("draft_logits")), 1e-5);
        cmp("confidence logits", out.confidence_logits.as_ref().unwrap(), kept(get("confidence_logits")), 1e-5);
        cmp("eval mask", &out.eval_mask, kept(get("eval_mask")), 0.0);
        cmp("target ids", &out.target_ids, kept(get("target_ids")), 0.0);

        let (loss, grads) = autograd::value_and_grad(
            |p| -> train::Result<Array> {
                let out = build(p)?.training_forward(&seq, &anchors)?;
                Ok(DSparkLoss::default().terms(&out)?.total)
            },
            &params,
        )
        .unwrap();
        let want = case["loss"].as_f64().unwrap();
        let got = loss.item().unwrap();
        assert!((got - want).abs() <= 1e-5 * want, "{name}: loss {got} vs DeepSpec {want}");
        for (pname, g) in names.iter().zip(&grads) {
            cmp(&format!("gradient of {pname}"), g, get(&format!("grad.{pname}")), 1e-5);
        }
    }
}

/// The training forward's blocks are the inference draft calls: for an anchor `p` of a golden
/// sequence whose next tokens are the drafter's own greedy drafts (so the training forward's
/// teacher-forced Markov inputs equal the inference walk's), the Markov-corrected logits and
/// the confidence logits of every slot of [`Drafter::propose`] over a context of the taps at
/// positions `0 .. p` equal the training forward's block anchored at `p`. A mismatch here
/// (positions, the context's reach, the taps' order) would train a drafter for other inputs
/// than it sees when drafting.
fn check_training_is_inference(checkpoint: &str, golden: &str, kernels: &KernelPolicy, tol: f32) {
    let golden = io::load_safetensors(fixtures().join(golden)).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&golden.metadata["golden"]).unwrap();
    let dir = fixtures().join(checkpoint);
    let config = DrafterConfig::from_dir(&dir).unwrap();
    let b = config.block_size;
    let all: BTreeMap<String, Array> = io::load_safetensors(dir.join("model.safetensors"))
        .unwrap()
        .tensors
        .into_iter()
        .map(|(k, v)| (k, v.astype(Dtype::Float32).unwrap()))
        .collect();
    let load = LoadOptions { dtype: Some(Dtype::Float32), kernels: kernels.clone() };
    let d = Drafter::from_weights(config.clone(), Weights::from_tensors(&dir, all), &load).unwrap();
    let case = &meta["cases"][0];
    let name = case["name"].as_str().unwrap();
    let get = |k: &str| golden.get(&format!("{name}.{k}")).unwrap().clone();
    let mut ids: Vec<u32> = get("input_ids").to_vec::<i32>().unwrap().into_iter().map(|t| t as u32).collect();
    let (taps, hidden) = (get("taps"), get("target_last_hidden"));
    let l = ids.len();
    let width = taps.shape()[1];
    for p in [1, l / 2, l - b - 1] {
        let mut ctx = d.new_context();
        d.ingest(&mut ctx, &taps.slice_axis(0, 0, p as i32).unwrap()).unwrap();
        let proposal = d.propose(&mut ctx, ids[p], 0.0).unwrap();
        // the sequence continues with the drafts, so that teacher forcing feeds what the walk fed
        ids[p + 1..p + b].copy_from_slice(&proposal.all_drafts[..b - 1]);
        let loss_mask: Vec<bool> = (0..l).map(|i| i >= p).collect();
        let seq = TrainingSequence { input_ids: &ids, taps: &taps, target_hidden: &hidden, loss_mask: &loss_mask };
        let out = d.training_forward(&seq, &[p]).unwrap();
        let v = |a: &Array| a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
        let train_z = v(&out.draft_logits);
        let infer_z = v(&proposal.logits);
        let diff = max_rel(&infer_z, &train_z);
        assert!(diff <= tol, "{checkpoint}, anchor {p} of {l} ({width}-wide taps): draft logits differ by {diff}");
        let train_c = v(out.confidence_logits.as_ref().unwrap());
        let diff = max_rel(proposal.confidence_logits.as_ref().unwrap(), &train_c);
        assert!(diff <= tol, "{checkpoint}, anchor {p}: confidence logits differ by {diff}");
    }
}

#[test]
fn training_blocks_are_the_inference_draft_calls() {
    for kernels in &[KernelPolicy::mlx(), KernelPolicy::default()] {
        check_training_is_inference("qwen3", "train/loss_golden.safetensors", kernels, 1e-5);
        check_training_is_inference("gemma4/k_eq_v", "train/loss_golden_gemma4_k_eq_v.safetensors", kernels, 1e-5);
        check_training_is_inference("gemma4/v_proj", "train/loss_golden_gemma4_v_proj.safetensors", kernels, 1e-5);
    }
}
