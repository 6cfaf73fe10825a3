//! `mlx-spec train-drafter` end to end on the tiny target of `test-support` (byte tokenizer,
//! ChatML template): the checkpoint and its companions, the held-out report with the STS
//! calibration, a resume that finds the work done, the drafter in `generate --draft-model`,
//! and clear errors for bad flags and data.
use std::path::Path;
use std::process::{Command, Output};

fn mlx_spec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(args)
        .env_remove("MLX_SPEC_LOG")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run mlx-spec")
}

fn prompts(dir: &Path, n: usize) -> String {
    let path = dir.join("prompts.jsonl");
    let lines: Vec<String> = (0..n)
        .map(|i| {
            serde_json::json!({"kind": "free", "source": format!("t:{i}"), "prompt": format!("tell me {i} things")})
                .to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn trains_resumes_calibrates_and_drafts() {
    let root = tempfile::tempdir().unwrap();
    let (target, _) = test_support::dspark::write_tiny_pair(root.path()).unwrap();
    let target = target.to_str().unwrap();
    let prompts = prompts(root.path(), 10);
    let out = root.path().join("drafter");
    let out_s = out.to_str().unwrap();
    #[rustfmt::skip]
    let args = [
        "train-drafter", "--target", target, "--out", out_s, "--prompts", &prompts, "--num-prompts", "6",
        "--held-out", "4", "--max-new-tokens", "24", "--steps", "30", "--checkpoint-every", "10",
        "--num-anchors", "8", "--block-size", "4", "--markov-rank", "16", "--mask-token-id", "0",
    ];
    let run = mlx_spec(&args);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("after 30 of 30 steps") && stdout.contains("ECE"), "{stdout}");
    for f in ["config.json", "model.safetensors", "training.json", "loss_curve.png"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "Qwen3DSparkModel");
    assert_eq!(config["confidence_temperatures"].as_array().map(Vec::len), Some(4));
    let work = root.path().join("drafter.work");
    for f in
        ["samples.jsonl", "held_out.jsonl", "run.json", "optimizer.safetensors", "losses.jsonl", "held_out_eval.json"]
    {
        assert!(work.join(f).is_file(), "{f} missing");
    }
    assert_eq!(std::fs::read_to_string(work.join("samples.jsonl")).unwrap().lines().count(), 6);
    assert_eq!(std::fs::read_to_string(work.join("losses.jsonl")).unwrap().lines().count(), 30);

    // Again: nothing left to generate or train; it evaluates and says where it stands.
    let again = mlx_spec(&args);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert!(String::from_utf8_lossy(&again.stderr).contains("resuming at step 30"));
    assert_eq!(std::fs::read_to_string(work.join("losses.jsonl")).unwrap().lines().count(), 30);

    // The checkpoint drafts for the target.
    let generated =
        mlx_spec(&["generate", "--model", target, "--draft-model", out_s, "--prompt", "tell me", "--max-tokens", "16"]);
    assert!(generated.status.success(), "{}", String::from_utf8_lossy(&generated.stderr));
    assert!(String::from_utf8_lossy(&generated.stderr).contains("DSpark drafter"));
    // The drafter given as the target is named for what it is.
    let wrong = mlx_spec(&["generate", "--model", out_s, "--prompt", "tell me", "--max-tokens", "2"]);
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(!wrong.status.success() && err.contains("is a DeepSpec drafter") && err.contains("--draft-model"), "{err}");

    // Other settings in the same work directory are refused, naming both.
    let mut other = args.to_vec();
    let steps = other.iter().position(|a| *a == "30").unwrap();
    other[steps] = "40";
    let refused = mlx_spec(&other);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("run.json") && err.contains("steps: 30 -> 40"), "{err}");
    // So is another drafter shape: the checkpoint would claim a block size it never trained.
    let mut other = args.to_vec();
    let block = other.iter().position(|a| *a == "--block-size").unwrap() + 1;
    other[block] = "5";
    let refused = mlx_spec(&other);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("block_size: 4 -> 5"), "{err}");
    // And another initialisation (the default starts from the target).
    let mut other = args.to_vec();
    other.extend(["--init", "random"]);
    let refused = mlx_spec(&other);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("init: \"target\" -> \"random\""), "{err}");
    // And answers of another length or to other prompts: they would mix into the run's data.
    let mut other = args.to_vec();
    let len = other.iter().position(|a| *a == "--max-new-tokens").unwrap() + 1;
    other[len] = "32";
    let count = other.iter().position(|a| *a == "--num-prompts").unwrap() + 1;
    other[count] = "5";
    let refused = mlx_spec(&other);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("--num-prompts: 6 -> 5, --max-new-tokens: 24 -> 32"), "{err}");
}

#[test]
fn a_time_limit_during_data_generation_chooses_and_trains_nothing() {
    let root = tempfile::tempdir().unwrap();
    let (target, _) = test_support::dspark::write_tiny_pair(root.path()).unwrap();
    let prompts = prompts(root.path(), 4);
    let out = root.path().join("d");
    #[rustfmt::skip]
    let args = [
        "train-drafter", "--target", target.to_str().unwrap(), "--out", out.to_str().unwrap(), "--prompts", &prompts,
        "--num-prompts", "2", "--held-out", "1", "--max-new-tokens", "8", "--steps", "4", "--num-anchors", "4",
        "--block-size", "4", "--markov-rank", "8", "--mask-token-id", "0",
    ];
    let r = mlx_spec(&[&args[..], &["--time-limit-minutes", "0"]].concat());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success() && err.contains("ended the data generation after 0 of 2"), "{err}");
    let work = root.path().join("d.work");
    assert!(!work.join("draft_vocab.json").exists() && !out.exists());
    // Without the limit the same command generates everything and trains.
    let r = mlx_spec(&args);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(out.join("model.safetensors").is_file());
}

#[test]
fn bad_flags_and_data_are_named() {
    let root = tempfile::tempdir().unwrap();
    let (target, _) = test_support::dspark::write_tiny_pair(root.path()).unwrap();
    let target = target.to_str().unwrap();
    let prompts = prompts(root.path(), 4);
    let out = root.path().join("d");
    let base = ["train-drafter", "--target", target, "--out", out.to_str().unwrap(), "--prompts", &prompts];
    let fails = |extra: &[&str], needle: &str| {
        let r = mlx_spec(&[&base[..], extra].concat());
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success() && err.contains(needle), "{extra:?}: {err}");
    };
    fails(&["--num-prompts", "4", "--held-out", "1", "--mask-token-id", "0"], "--num-prompts 4 + --held-out 1");
    fails(&["--num-prompts", "2", "--held-out", "1", "--tap-layers", "1,9", "--mask-token-id", "0"], "tap_layers");
    fails(&["--num-prompts", "2", "--held-out", "1", "--mask-token-id", "999"], "mask_token_id");
    fails(&["--num-prompts", "2", "--held-out", "1", "--steps", "0", "--mask-token-id", "0"], "--steps");
    // The byte tokenizer has no special token to fill blocks with: the flag is asked for.
    fails(&["--num-prompts", "2", "--held-out", "1"], "--mask-token-id");
    std::fs::write(
        root.path().join("bad.jsonl"),
        "{\"prompt\": \"x\", \"kind\": \"free\", \"source\": \"a\"}\nnot json\n",
    )
    .unwrap();
    let bad = root.path().join("bad.jsonl");
    let r = mlx_spec(&[
        "train-drafter",
        "--target",
        target,
        "--out",
        out.to_str().unwrap(),
        "--prompts",
        bad.to_str().unwrap(),
        "--num-prompts",
        "1",
        "--held-out",
        "1",
        "--mask-token-id",
        "0",
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("bad.jsonl line 2"), "{err}");
    assert!(!out.exists(), "a failed run must not leave a checkpoint");
    // A work directory from before the held-out split was recorded held out the prompts after
    // the training ones: its answers are not resumed under the per-domain split.
    let work = root.path().join("d.work");
    std::fs::create_dir_all(&work).unwrap();
    let old = serde_json::json!({
        "target": target, "prompts": prompts, "num_prompts": 2, "held_out": 1, "max_new_tokens": 256,
    });
    std::fs::write(work.join("data.json"), old.to_string()).unwrap();
    fails(
        &["--num-prompts", "2", "--held-out", "1", "--mask-token-id", "0"],
        "the held-out split: after the training prompts -> last of each domain",
    );
}
