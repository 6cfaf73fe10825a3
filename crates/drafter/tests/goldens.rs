//! The drafter forward against DeepSpec's own outputs (`fixtures/deepspec/`, made by the
//! real DeepSpec code; see the READMEs there): a four-call decoding session A, B, D, E per
//! checkpoint (Qwen3; Gemma4 with `k_eq_v` and with `v_proj`), checking the context
//! projection, block embeddings, every layer's output, the final hidden, base and
//! Markov-corrected logits, greedy drafts, confidence, and the context K/V cache after each
//! call. f32 execution uses the README's f32-port tolerances (1e-4 on hidden states and
//! logits, 1e-5 on sigmoids and cache, exact drafts); bf16 execution uses its bf16-port
//! tolerances against the f32 golden (0.15 hidden, 0.25 logits, 0.03 sigmoid).
use std::path::PathBuf;

use drafter::{Architecture, Drafter};
use mlx_core::io::{Safetensors, load_safetensors};
use mlx_core::{Array, Dtype};
use models::LoadOptions;

fn dir(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepspec").join(variant)
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().reshape(&[-1]).unwrap().to_vec::<f32>().unwrap()
}

fn ints(g: &Safetensors, name: &str) -> Vec<i64> {
    g.get(name).unwrap().astype(Dtype::Int64).unwrap().to_vec::<i64>().unwrap()
}

/// Max |got - want| after checking the element counts; panics above `atol + rtol * |want|`.
fn close(label: &str, got: &Array, want: &Array, atol: f32, rtol: f32) -> f32 {
    let (g, w) = (f32s(got), f32s(want));
    assert_eq!(g.len(), w.len(), "{label}: {:?} vs golden {:?}", got.shape(), want.shape());
    let mut worst = 0f32;
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let d = (a - b).abs();
        assert!(
            d <= atol + rtol * b.abs(),
            "{label}[{i}]: got {a}, golden {b} (|diff| {d} > {atol} + {rtol}*|golden|)"
        );
        worst = worst.max(d);
    }
    worst
}

struct Tol {
    hidden: f32,
    /// Relative tolerance on the un-normed residual stream (bf16 rounds it to 2^-8 relative).
    stream_rtol: f32,
    logits: f32,
    rtol: f32,
    sigmoid: f32,
    cache: f32,
}

const F32: Tol = Tol { hidden: 1e-4, stream_rtol: 1e-4, logits: 1e-4, rtol: 1e-4, sigmoid: 1e-5, cache: 1e-5 };
const BF16: Tol = Tol { hidden: 0.15, stream_rtol: 0.05, logits: 0.25, rtol: 0.0, sigmoid: 0.03, cache: 0.1 };

/// Runs the session; `bf16` selects bf16 execution (weights as stored) instead of f32.
fn session(variant: &str, arch: Architecture, bf16: bool) {
    let d = dir(variant);
    let dtype = if bf16 { None } else { Some(Dtype::Float32) };
    let drafter = Drafter::load(&d, &LoadOptions { dtype, ..LoadOptions::default() })
        .unwrap_or_else(|e| panic!("load {variant}: {e}"));
    assert_eq!(drafter.config().architecture, arch);
    let g = load_safetensors(d.join("cases.safetensors")).unwrap();
    let t = if bf16 { BF16 } else { F32 };
    let b = drafter.block_size();
    let mut ctx = drafter.new_context();
    let mut worst = [0f32; 4];
    for case in ["A", "B", "D", "E"] {
        let x = |n: &str| g.get(&format!("{case}.{n}")).unwrap().clone();
        let feats = x("ctx_feats");
        let n = feats.shape()[0] as usize;
        let positions = ints(&g, &format!("{case}.positions"));
        assert_eq!(positions[0] as usize, ctx.len(), "{case}: context rows before the call");
        let start = ctx.len() + n;
        assert_eq!(positions.len(), n + b);
        assert_eq!(positions[n] as usize, start, "{case}: anchor position");

        let c = drafter.project_context(&feats.expand_dims(&[0]).unwrap()).unwrap();
        worst[0] = worst[0].max(close(&format!("{variant} {case}.C"), &c, &x("C"), t.hidden, t.rtol));
        drafter.ingest(&mut ctx, &feats).unwrap();
        assert_eq!(ctx.len(), start);

        let anchor = ints(&g, &format!("{case}.anchor"))[0] as u32;
        let p = drafter.propose(&mut ctx, anchor, 0.0).unwrap();
        assert_eq!(ctx.len(), start, "{case}: block rows must not persist");
        let label = |n: &str| format!("{variant} {} {case}.{n}", if bf16 { "bf16" } else { "f32" });
        close(&label("embed"), &p.block.embed, &x("embed"), t.hidden, t.rtol);
        for (i, out) in p.block.layer_outputs.iter().enumerate() {
            let n = format!("layer{i}_out");
            worst[0] = worst[0].max(close(&label(&n), out, &x(&n), t.hidden, t.stream_rtol));
        }
        worst[0] = worst[0].max(close(&label("h"), &p.block.hidden, &x("h"), t.hidden, t.rtol));
        worst[1] = worst[1].max(close(&label("U"), &p.base_logits, &x("U"), t.logits, t.rtol));
        // z_k and conf_k depend on prev_k = d_{k-1}: compare the slots whose previous drafts
        // agree with the golden's (all of them in f32, where drafts must be exact).
        let want = ints(&g, &format!("{case}.drafts"));
        let got: Vec<i64> = p.all_drafts.iter().map(|&t| t as i64).collect();
        let same = 1 + got.iter().zip(&want).take(b - 1).take_while(|(a, b)| a == b).count();
        let rows = |a: &Array| a.reshape(&[b as i32, -1]).unwrap().slice_axis(0, 0, same as i32).unwrap();
        worst[1] = worst[1].max(close(&label("z"), &rows(&p.logits), &rows(&x("z")), t.logits, t.rtol));
        let conf = Array::from_slice(p.confidence.as_ref().unwrap(), &[b as i32]).unwrap();
        worst[2] = worst[2].max(close(&label("conf_sigmoid"), &rows(&conf), &rows(&x("conf_sigmoid")), t.sigmoid, 0.0));
        if bf16 {
            // The same call executed in bf16 by DeepSpec.
            let y = |n: &str| g.get(&format!("bf16.{case}.{n}")).unwrap().clone();
            close(&label("h vs bf16 run"), &p.block.hidden, &y("h"), t.hidden, 0.0);
            close(&label("U vs bf16 run"), &p.base_logits, &y("U"), t.logits, 0.0);
            close(&label("z vs bf16 run"), &rows(&p.logits), &rows(&y("z")), t.logits, 0.0);
            close(&label("conf vs bf16 run"), &rows(&conf), &rows(&y("conf_sigmoid")), t.sigmoid, 0.0);
        } else {
            let logit = Array::from_slice(p.confidence_logits.as_ref().unwrap(), &[b as i32]).unwrap();
            close(&label("conf_logit"), &logit, &x("conf_logit"), t.logits, t.rtol);
        }

        // Drafts: exact in f32; in bf16 exact wherever the golden's top-1 margin of z is
        // above the bf16 logit tolerance, and never worse than the prefix before the first
        // near-tie.
        assert_eq!(p.drafts, p.all_drafts, "threshold 0 keeps every draft");
        if bf16 {
            let z = f32s(&x("z"));
            let v = z.len() / b;
            for k in 0..b {
                let mut row: Vec<f32> = z[k * v..(k + 1) * v].to_vec();
                row.sort_by(|a, b| b.partial_cmp(a).unwrap());
                if row[0] - row[1] > 0.25 {
                    assert_eq!(got[k], want[k], "{} slot {k}", label("drafts"));
                } else {
                    break;
                }
            }
        } else {
            assert_eq!(got, want, "{}", label("drafts"));
        }
        let verify = ints(&g, &format!("{case}.verify_input_ids"));
        assert_eq!(verify[0], anchor as i64);

        for layer in 0..drafter.config().num_layers {
            let (k, v) = ctx.layer_kv(layer).unwrap().unwrap();
            let ck = close(&label(&format!("cache_k.{layer}")), &k, &x(&format!("cache_k.{layer}")), t.cache, t.rtol);
            let cv = close(&label(&format!("cache_v.{layer}")), &v, &x(&format!("cache_v.{layer}")), t.cache, t.rtol);
            worst[3] = worst[3].max(ck.max(cv));
        }
    }
    eprintln!(
        "{variant} {}: max |diff| hidden {:.2e}, logits {:.2e}, sigmoid {:.2e}, cache {:.2e}",
        if bf16 { "bf16" } else { "f32" },
        worst[0],
        worst[1],
        worst[2],
        worst[3]
    );
}

#[test]
fn qwen3_f32_matches_deepspec() {
    session("qwen3", Architecture::Qwen3, false);
}

#[test]
fn qwen3_bf16_within_bf16_tolerance() {
    session("qwen3", Architecture::Qwen3, true);
}

#[test]
fn gemma4_k_eq_v_f32_matches_deepspec() {
    session("gemma4/k_eq_v", Architecture::Gemma4, false);
}

#[test]
fn gemma4_k_eq_v_bf16_within_bf16_tolerance() {
    session("gemma4/k_eq_v", Architecture::Gemma4, true);
}

#[test]
fn gemma4_v_proj_f32_matches_deepspec() {
    session("gemma4/v_proj", Architecture::Gemma4, false);
}

#[test]
fn gemma4_v_proj_bf16_within_bf16_tolerance() {
    session("gemma4/v_proj", Architecture::Gemma4, true);
}

/// The taps the goldens were fed are the target's `hidden_states[l + 1]` for `l` in
/// `target_layer_ids` (entry 0 = the embedding output, so `-1` selects it), concatenated in
/// that order: the mapping the spec source relies on.
#[test]
fn tap_mapping_matches_hidden_states() {
    for variant in ["qwen3", "gemma4/k_eq_v"] {
        let d = dir(variant);
        let drafter =
            Drafter::load(&d, &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }).unwrap();
        let g = load_safetensors(d.join("cases.safetensors")).unwrap();
        let hs = g.get("inputs.prefill_hidden_states").unwrap();
        let taps: Vec<Array> = drafter
            .target_layer_ids()
            .iter()
            .map(|&l| hs.slice_axis(0, (l + 1) as i32, (l + 2) as i32).unwrap())
            .collect();
        let feats = drafter.concat_taps(&taps).unwrap().squeeze(&[0]).unwrap();
        close(&format!("{variant} A.ctx_feats"), &feats, g.get("A.ctx_feats").unwrap(), 0.0, 0.0);
    }
}

/// A longer session on the Gemma4 `k_eq_v` drafter (`fixtures/deepspec/gemma4/session2`:
/// eight calls, 45 context rows at the end), each call compared with DeepSpec run in the
/// same dtype: f32 against DeepSpec's f32 within the f32-port tolerances, bf16 against
/// DeepSpec's own bf16 execution (not the f32 golden) within the bf16-port logit tolerance.
#[test]
fn gemma4_long_session_matches_deepspec_in_both_dtypes() {
    let d = dir("gemma4/session2");
    let g = load_safetensors(d.join("session.safetensors")).unwrap();
    let anchors = ints(&g, "inputs.anchor");
    for (run, dtype, t) in [("f32", Some(Dtype::Float32), F32), ("bf16", None, BF16)] {
        let drafter = Drafter::load(&dir("gemma4/k_eq_v"), &LoadOptions { dtype, ..LoadOptions::default() }).unwrap();
        let mut ctx = drafter.new_context();
        let mut worst = [0f32; 3];
        for (i, &anchor) in anchors.iter().enumerate() {
            let x = |n: &str| g.get(&format!("{run}.{i}.{n}")).unwrap().clone();
            drafter.ingest(&mut ctx, g.get(&format!("inputs.ctx.{i}")).unwrap()).unwrap();
            let p = drafter.propose(&mut ctx, anchor as u32, 0.0).unwrap();
            let label = |n: &str| format!("{run} call {i} {n}");
            worst[0] = worst[0].max(close(&label("U"), &p.base_logits, &x("U"), t.logits, t.rtol));
            worst[1] = worst[1].max(close(&label("z"), &p.logits, &x("z"), t.logits, t.rtol));
            let conf = Array::from_slice(p.confidence_logits.as_ref().unwrap(), &[7]).unwrap();
            worst[2] = worst[2].max(close(&label("confidence logit"), &conf, &x("conf"), t.logits, t.rtol));
            let want: Vec<u32> = ints(&g, &format!("{run}.{i}.drafts")).into_iter().map(|v| v as u32).collect();
            assert_eq!(p.all_drafts, want, "{run} call {i} drafts");
        }
        eprintln!(
            "gemma4 session2 {run}: max |diff| U {:.2e}, z {:.2e}, confidence logit {:.2e}",
            worst[0], worst[1], worst[2]
        );
    }
}
