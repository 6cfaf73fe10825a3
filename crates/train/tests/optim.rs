//! `train`'s optimizer, clipping and schedule against a trajectory of DeepSpec's own
//! `BF16Optimizer` (`fixtures/train/make_optim_golden.py`), and the optimizer state's resume.
use std::path::PathBuf;

use mlx_core::{Array, Dtype, autograd, io};
use train::{AdamW, AdamWConfig, Error, WarmupCosine, clip_grad_norm};

fn golden() -> (io::Safetensors, serde_json::Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/train/optim_golden.safetensors");
    let file = io::load_safetensors(path).unwrap();
    let meta = serde_json::from_str(&file.metadata["golden"]).unwrap();
    (file, meta)
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn names() -> Vec<String> {
    vec!["w".into(), "b".into()]
}

#[test]
fn replays_deepspecs_bf16_optimizer_step_for_step() {
    let (g, meta) = golden();
    let steps = meta["steps"].as_u64().unwrap();
    let config = AdamWConfig { weight_decay: meta["weight_decay"].as_f64().unwrap(), ..AdamWConfig::default() };
    let params = vec![g.get("init.w").unwrap().clone(), g.get("init.b").unwrap().clone()];
    assert_eq!(params[0].dtype(), Dtype::Bfloat16);
    let mut opt = AdamW::new(config, &names(), &params).unwrap();
    for step in 0..steps {
        let grads: Vec<Array> =
            ["w", "b"].iter().map(|n| g.get(&format!("step{step}.grad.{n}")).unwrap().clone()).collect();
        let (grads, norm) = clip_grad_norm(&grads, meta["max_grad_norm"].as_f64().unwrap()).unwrap();
        let want_norm = meta["grad_norms"][step as usize].as_f64().unwrap();
        assert!((norm - want_norm).abs() <= 1e-6 * want_norm, "step {step}: norm {norm} vs {want_norm}");
        // The learning rate DeepSpec's scheduler gave this step (its own schedule is checked below).
        let lr = meta["lrs"][step as usize].as_f64().unwrap();
        let params = opt.step(&grads, lr).unwrap();
        for (i, n) in ["w", "b"].iter().enumerate() {
            let want = f32s(g.get(&format!("step{step}.master.{n}")).unwrap());
            let got = f32s(&opt.master_weights().unwrap()[i]);
            for (a, b) in got.iter().zip(&want) {
                // f32 rounding at the parameters' scale (about 1): a few units of 1e-7
                assert!((a - b).abs() <= 1e-6, "step {step} master {n}: {a} vs {b}");
            }
            assert_eq!(params[i].dtype(), Dtype::Bfloat16);
            let want = f32s(g.get(&format!("step{step}.param.{n}")).unwrap());
            for (a, b) in f32s(&params[i]).iter().zip(&want) {
                // one bf16 unit where the f32 master sits on a rounding boundary
                assert!((a - b).abs() <= b.abs() * 2f32.powi(-8), "step {step} param {n}: {a} vs {b}");
            }
        }
    }
    assert_eq!(opt.steps_taken(), steps);
}

#[test]
fn schedule_is_warmup_then_cosine_and_deepspecs_differs_by_its_stated_factor() {
    let (_, meta) = golden();
    let steps = meta["steps"].as_u64().unwrap();
    let warmup = (meta["warmup_ratio"].as_f64().unwrap() * steps as f64) as u64;
    let base = meta["lr"].as_f64().unwrap();
    let s = WarmupCosine::new(base, steps, warmup, 0.0).unwrap();
    assert_eq!(s.lr(0), base / warmup as f64);
    assert_eq!(s.lr(warmup - 1), base);
    assert_eq!(s.lr(warmup), base);
    assert!(s.lr(steps) == 0.0 && s.lr(steps + 5) == 0.0);
    let lrs: Vec<f64> = meta["lrs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let factor = 2.0 / (1.0 + (std::f64::consts::PI / (steps - warmup) as f64).cos());
    for (step, want) in lrs.iter().enumerate() {
        let step = step as u64;
        let ours = s.lr(step);
        // DeepSpec's warm-up equals ours; its cosine phase is ours times `factor`.
        let deepspec = if step < warmup { ours } else { ours * factor };
        assert!((deepspec - want).abs() <= 1e-12, "step {step}: {deepspec} vs DeepSpec {want}");
    }
    for (args, setting) in [
        ((0.0, 10, 1, 0.0), "lr"),
        ((1.0, 0, 0, 0.0), "total_steps"),
        ((1.0, 10, 11, 0.0), "warmup_steps"),
        ((1.0, 10, 1, 2.0), "eta_min"),
    ] {
        let err = WarmupCosine::new(args.0, args.1, args.2, args.3).unwrap_err();
        assert!(matches!(err, Error::Config { setting: s, .. } if s == setting), "{err}");
    }
}

/// Trains f(w) = sum((w - t)^2) for `steps` steps from `opt`.
fn train(opt: &mut AdamW, params: Vec<Array>, schedule: &WarmupCosine, steps: std::ops::Range<u64>) -> Vec<Array> {
    let target = Array::from_slice(&[0.5f32, -1.5, 2.0, 0.25], &[4]).unwrap();
    let mut params = params;
    for step in steps {
        let (_, grads) =
            autograd::value_and_grad(|p| p[0].subtract(&target)?.square()?.sum(&[], false), &params).unwrap();
        let (grads, _) = clip_grad_norm(&grads, 1.0).unwrap();
        params = opt.step(&grads, schedule.lr(step)).unwrap();
    }
    params
}

#[test]
fn resuming_from_a_saved_state_continues_bit_for_bit() {
    let names = vec!["w".to_string()];
    let init = vec![Array::from_slice(&[1f32, 1., 1., 1.], &[4]).unwrap().astype(Dtype::Bfloat16).unwrap()];
    let config = AdamWConfig { weight_decay: 0.01, ..AdamWConfig::default() };
    let schedule = WarmupCosine::new(0.1, 20, 2, 0.0).unwrap();

    let mut straight = AdamW::new(config, &names, &init).unwrap();
    let end = train(&mut straight, init.clone(), &schedule, 0..20);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optimizer.safetensors");
    let mut first = AdamW::new(config, &names, &init).unwrap();
    let mid = train(&mut first, init.clone(), &schedule, 0..7);
    first.save(&path).unwrap();
    drop(first);
    let mut resumed = AdamW::load(&path, &names, &mid).unwrap();
    assert_eq!(resumed.steps_taken(), 7);
    assert_eq!(f32s(&resumed.params().unwrap()[0]), f32s(&mid[0]));
    let resumed_end = train(&mut resumed, mid, &schedule, 7..20);
    assert_eq!(f32s(&resumed.master_weights().unwrap()[0]), f32s(&straight.master_weights().unwrap()[0]));
    assert_eq!(f32s(&resumed_end[0]), f32s(&end[0]));
    // and it learned: w moved from 1 toward the target
    assert!(f32s(&end[0])[1] < 0.0);
}

#[test]
fn bad_inputs_are_named() {
    let names = vec!["w".to_string(), "b".to_string()];
    let params = vec![Array::zeros(&[2, 3], Dtype::Float32).unwrap(), Array::zeros(&[3], Dtype::Float32).unwrap()];
    let mut opt = AdamW::new(AdamWConfig::default(), &names, &params).unwrap();
    let err = opt.step(&params[..1], 0.1).unwrap_err();
    assert!(err.to_string().contains("1 gradients for 2 parameters"), "{err}");
    let err = opt.step(&[params[1].clone(), params[0].clone()], 0.1).unwrap_err();
    assert!(matches!(&err, Error::Parameter { name, .. } if name == "w") && err.to_string().contains("[3]"), "{err}");
    let err = opt.step(&params, f64::NAN).unwrap_err();
    assert!(matches!(err, Error::Config { setting: "lr", .. }), "{err}");
    let err = AdamW::new(AdamWConfig { beta2: 1.0, ..AdamWConfig::default() }, &names, &params).unwrap_err();
    assert!(matches!(err, Error::Config { setting: "beta2", .. }), "{err}");
    let ints = vec![Array::zeros(&[2], Dtype::Int32).unwrap(), params[1].clone()];
    let err = AdamW::new(AdamWConfig::default(), &names, &ints).unwrap_err();
    assert!(err.to_string().contains("parameter `w`") && err.to_string().contains("int32"), "{err}");
    let err = clip_grad_norm(&params, 0.0).unwrap_err();
    assert!(matches!(err, Error::Config { setting: "max_grad_norm", .. }), "{err}");

    // A state saved for other parameters, and a file that is not a state at all.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("opt.safetensors");
    opt.save(&path).unwrap();
    let other = vec!["w".to_string(), "c".to_string()];
    let err = AdamW::load(&path, &other, &params).unwrap_err();
    assert!(err.to_string().contains("\"c\"") && err.to_string().contains("\"b\""), "{err}");
    let plain = dir.path().join("plain.safetensors");
    io::save_safetensors(&plain, [("w", &params[0])], []).unwrap();
    let err = AdamW::load(&plain, &names, &params).unwrap_err();
    assert!(matches!(err, Error::State { .. }) && err.to_string().contains("plain.safetensors"), "{err}");
    let wrong_shape = vec![Array::zeros(&[3, 2], Dtype::Float32).unwrap(), params[1].clone()];
    let err = AdamW::load(&path, &names, &wrong_shape).unwrap_err();
    assert!(err.to_string().contains("master.w") && err.to_string().contains("[3, 2]"), "{err}");
}
