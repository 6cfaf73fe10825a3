//! `mlx-spec generate` end to end on SmolLM2-135M-Instruct (fetched into the cache on first
//! use): the default speculates with the adaptive suffix drafter and reports its cost curve,
//! every drafting flag reaches the executor (it shows in `--stats-json`), speculative
//! output equals plain output (`--draft-kind none`), `MLX_SPEC_LOG=spec::round=debug` traces rounds, a draft model with another
//! tokenizer is refused, and flag combinations that would be ignored are errors.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn smollm2() -> PathBuf {
    models::default_model::ensure_default_model(&mut |_| {}).expect("SmolLM2 fixture")
}

/// Raw text (no chat template) whose continuation repeats what came before, so n-gram
/// lookup finds matches.
const PROMPT: &str = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n";

fn mlx_spec(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlx-spec"));
    c.arg("generate").args(args).env_remove("MLX_SPEC_LOG");
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().expect("run mlx-spec")
}

/// Runs `generate` on [`PROMPT`] (raw, 24 tokens) with `--stats-json`; returns (stdout text,
/// stats).
fn run(model: &Path, extra: &[&str]) -> (String, Value) {
    let mut args = vec!["--ignore-chat-template", "--max-tokens", "24"];
    args.extend_from_slice(extra);
    run_prompt(model, PROMPT, &args)
}

/// Runs `generate --model MODEL -p PROMPT --stats-json` with `extra`; returns (stdout text,
/// stats). Panics with its stderr when it fails.
fn run_prompt(model: &Path, prompt: &str, extra: &[&str]) -> (String, Value) {
    let mut args = vec!["--model", model.to_str().unwrap(), "-p", prompt, "--stats-json"];
    args.extend_from_slice(extra);
    let out = mlx_spec(&args, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "mlx-spec generate {extra:?} failed: {stderr}");
    let json = stderr.lines().rev().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON in {stderr}"));
    (String::from_utf8(out.stdout).unwrap(), serde_json::from_str(json).unwrap())
}

#[test]
fn drafting_flags_reach_the_executor() {
    let model = smollm2();
    let dir = model.to_str().unwrap();
    let (plain_text, plain) = run(&model, &["--draft-kind", "none"]);
    assert!(plain.get("rounds").is_none(), "plain decoding reports no rounds: {plain}");

    // The default: the suffix drafter under the cost-aware policy, with the curve it used.
    let (text, default) = run(&model, &[]);
    assert_eq!(text, plain_text, "default (suffix) output differs from plain");
    assert_eq!(default["drafter"], serde_json::json!({"kind": "suffix", "policy": "cost-aware", "store_requests": 16}));
    assert_eq!(default["num_draft_tokens"], 32);
    assert_eq!(default["drafted_by_pos"].as_array().unwrap().len(), 32);
    let t = default["policy"]["cost_curve"]["t"].as_array().unwrap();
    assert_eq!(t.len(), 33, "{default}");
    assert_eq!(t[0], 1.0);
    assert!(default["predicted_ratio"].as_f64().unwrap() > 0.0, "{default}");
    // The quantized matmuls' arithmetic (the environment's, f32 unless MLX_SPEC_PRECISION says).
    let env_precision = std::env::var("MLX_SPEC_PRECISION").unwrap_or_else(|_| "f32".into());
    assert_eq!(plain["precision"], env_precision.as_str(), "{plain}");
    assert_eq!(default["precision"], env_precision.as_str(), "{default}");
    let (text, explicit) = run(&model, &["--draft-kind", "suffix", "--num-draft-tokens", "6"]);
    assert_eq!(text, plain_text);
    assert_eq!(explicit["num_draft_tokens"], 6);

    let (text, ngram) = run(&model, &["--draft-kind", "ngram"]);
    assert_eq!(text, plain_text, "n-gram output differs from plain");
    assert_eq!(
        ngram["drafter"],
        serde_json::json!({"kind": "ngram", "ngram_max": 3, "ngram_min": 1, "schedule": "heuristic"})
    );
    assert_eq!(ngram["num_draft_tokens"], 10);
    assert!(ngram["accepted"].as_u64().unwrap() > 0, "{ngram}");

    // The constant schedule drafts everything a match offers: more drafts than the heuristic.
    let (text, constant) = run(&model, &["--draft-kind", "ngram", "--ngram-schedule", "constant"]);
    assert_eq!(text, plain_text);
    assert_eq!(constant["drafter"]["schedule"], "constant");
    assert!(constant["drafted"].as_u64() > ngram["drafted"].as_u64(), "constant {constant}\nheuristic {ngram}");

    let (text, four) = run(&model, &["--draft-kind", "ngram", "--num-draft-tokens", "4"]);
    assert_eq!(text, plain_text);
    assert_eq!(four["num_draft_tokens"], 4);
    assert_eq!(four["drafted_by_pos"].as_array().unwrap().len(), 4);

    // Only 3-grams: fewer matches than the default 3..1 fallback chain.
    let (text, strict) = run(&model, &["--draft-kind", "ngram", "--ngram-min", "3"]);
    assert_eq!(text, plain_text);
    assert_eq!(strict["drafter"]["ngram_min"], 3);
    assert_ne!(strict["accepted_by_pos"], ngram["accepted_by_pos"], "--ngram-min 3 changed nothing: {strict}");
    let (text, short) = run(&model, &["--draft-kind", "ngram", "--ngram-max", "1"]);
    assert_eq!(text, plain_text);
    assert_eq!(short["drafter"]["ngram_max"], 1);

    let (text, two) = run(&model, &["--draft-model", dir]);
    assert_eq!(text, plain_text, "two-model output differs from plain");
    assert_eq!(two["drafter"], serde_json::json!({"kind": "model", "path": dir}));
    assert_eq!(two["num_draft_tokens"], 3);
    assert_eq!(two["acceptance"], "exact_match");
    // The model drafting for itself agrees with itself.
    assert!(two["acceptance_rate"].as_f64().unwrap() > 0.9, "{two}");

    let (_, rejection) =
        run(&model, &["--draft-model", dir, "--temp", "0.7", "--seed", "3", "--acceptance", "rejection"]);
    assert_eq!(rejection["acceptance"], "rejection");
    assert!(rejection["drafted"].as_u64().unwrap() > 0);
}

#[test]
fn sampled_speculative_output_equals_plain_with_the_same_seed() {
    let model = smollm2();
    let sampling = ["--temp", "0.8", "--top-p", "0.9", "--seed", "11"];
    let mut plain = sampling.to_vec();
    plain.extend(["--draft-kind", "none"]);
    let (plain_text, _) = run(&model, &plain);
    let mut args = sampling.to_vec();
    args.extend(["--draft-kind", "ngram"]);
    let (text, stats) = run(&model, &args);
    assert_eq!(text, plain_text);
    assert!(stats["rounds"].as_u64().unwrap() > 0);
    // The default drafter, sampling with the same seed.
    let (text, stats) = run(&model, &sampling);
    assert_eq!(text, plain_text);
    assert_eq!(stats["drafter"]["kind"], "suffix");
}

#[test]
fn trace_prints_every_round() {
    let model = smollm2();
    let out = mlx_spec(
        &[
            "--model",
            model.to_str().unwrap(),
            "-p",
            PROMPT,
            "--max-tokens",
            "8",
            "--draft-kind",
            "ngram",
            "--stats-json",
        ],
        &[("MLX_SPEC_LOG", "spec::round=debug")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rounds = stderr.lines().filter(|l| l.contains("spec::round") && l.contains(" drafts [")).count();
    let json: Value = serde_json::from_str(stderr.lines().rev().find(|l| l.starts_with('{')).unwrap()).unwrap();
    assert_eq!(rounds as u64, json["rounds"].as_u64().unwrap(), "{stderr}");
    assert!(stderr.contains("drafts ["), "{stderr}");
}

/// A copy of SmolLM2's config and tokenizer files whose vocabulary differs in two ids.
fn mismatched_tokenizer_dir(model: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name.ends_with(".json") && name != "tokenizer.json" {
            std::fs::copy(&path, dir.path().join(&name)).unwrap();
        }
    }
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(model.join("tokenizer.json")).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    // Swap the ids of two tokens: both stay in the vocabulary (the merges still load).
    let (a, b) = (vocab["hello"].clone(), vocab["world"].clone());
    vocab.insert("hello".into(), b);
    vocab.insert("world".into(), a);
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
    dir
}

#[test]
fn a_draft_model_with_another_tokenizer_is_refused() {
    let model = smollm2();
    let other = mismatched_tokenizer_dir(&model);
    let out = mlx_spec(
        &["--model", model.to_str().unwrap(), "--draft-model", other.path().to_str().unwrap(), "--max-tokens", "4"],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a mismatched draft model was accepted");
    assert!(stderr.contains(other.path().to_str().unwrap()) && stderr.contains(model.to_str().unwrap()), "{stderr}");
    assert!(stderr.contains("\"hello\"") || stderr.contains("\"world\""), "the message names the token: {stderr}");
    assert!(out.stdout.is_empty(), "nothing is generated");
}

#[test]
fn ignored_flag_combinations_are_errors() {
    let cases: [(&[&str], &str); 11] = [
        (&["--num-draft-tokens", "0"], "use --draft-kind none"),
        (&["-m", "0"], "nothing to generate"),
        (&["--draft-kind", "ngram", "--draft-length", "fixed"], "--draft-length applies"),
        (&["--ngram-max", "2"], "--draft-kind ngram"),
        (&["--ngram-schedule", "constant"], "--draft-kind ngram"),
        (&["--draft-kind", "none", "--num-draft-tokens", "4"], "needs a drafter"),
        (&["--draft-kind", "none", "--acceptance", "rejection"], "needs a drafter"),
        (&["--draft-kind", "suffix", "--draft-model", "/nonexistent"], "drop --draft-model"),
        (&["--draft-kind", "model"], "needs --draft-model"),
        (&["--draft-kind", "ngram", "--draft-model", "/nonexistent"], "drop --draft-model"),
        (&["--draft-model", "/nonexistent/draft"], "does not exist"),
    ];
    for (args, expected) in cases {
        let out = mlx_spec(args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(expected), "{args:?}: {stderr}");
    }
    let out = mlx_spec(&["--draft-kind", "ngram", "--ngram-min", "3", "--ngram-max", "2"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("expected 1 <= ngram-min <= ngram-max"), "{stderr}");
}

#[test]
fn silent_surprises_are_said() {
    let model = smollm2();
    let dir = model.to_str().unwrap();
    // A prompt longer than the model's context is refused.
    let long = "word ".repeat(9000);
    let out =
        mlx_spec(&["--model", dir, "--ignore-chat-template", "-p", &long, "-m", "1", "--draft-kind", "none"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("longer than the model's context of 8192"), "{stderr}");
    // A slow compute dtype on the CPU gets one warning.
    let args =
        ["--model", dir, "--ignore-chat-template", "-p", "Hi", "-m", "1", "--dtype", "float16", "--draft-kind", "none"];
    let out = mlx_spec(&args, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.matches("100x to 1000x slower").count() == 1, "{stderr}");
    // A model directory without a chat template: the prompt goes in as text, with a warning.
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&model).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "tokenizer_config.json" {
            std::os::unix::fs::symlink(&path, tmp.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let other = tmp.path().to_str().unwrap();
    let out = mlx_spec(&["--model", other, "-p", "Hi", "-m", "2", "--draft-kind", "none"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.contains("has no chat template"), "{stderr}");
    let out = mlx_spec(&["--model", other, "-p", "Hi", "-m", "2", "--system-prompt", "be brief"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--system-prompt needs a chat template"), "{stderr}");
}

/// The tiny Qwen3 target with its byte-level tokenizer and its DSpark drafter
/// ([`test_support::dspark::write_tiny_pair`]): greedy DSpark output equals plain output,
/// chat-templated and raw, at the default block size and at a smaller k, and it drafts.
#[test]
fn a_dspark_drafter_equals_plain_on_the_tiny_pair() {
    let root = tempfile::tempdir().unwrap();
    let (target, dspark) = test_support::dspark::write_tiny_pair(root.path()).unwrap();
    let dspark = dspark.to_str().unwrap();
    let generate = |prompt: &str, extra: &[&str]| -> (String, Value) {
        let mut args = vec!["--max-tokens", "40", "--temp", "0"];
        args.extend_from_slice(extra);
        run_prompt(&target, prompt, &args)
    };
    for (prompt, raw) in [("Tell me about the sea.", false), ("Once upon a time", true)] {
        let raw: &[&str] = if raw { &["--ignore-chat-template"] } else { &[] };
        let (plain, stats) = generate(prompt, &[raw, &["--draft-kind", "none"]].concat());
        assert_eq!(stats["generation_tokens"], 40, "{prompt:?}: the tiny target stopped early: {stats}");
        for k in [None, Some("3")] {
            let mut extra = [raw, &["--draft-model", dspark]].concat();
            if let Some(k) = k {
                extra.extend(["--num-draft-tokens", k]);
            }
            let (text, stats) = generate(prompt, &extra);
            assert_eq!(text, plain, "{prompt:?} k {k:?}: DSpark output differs from plain");
            assert_eq!(stats["drafter"]["kind"], "dspark", "{stats}");
            let want_k = k.map_or(test_support::dspark::BLOCK_SIZE as u64, |k| k.parse().unwrap());
            assert_eq!(stats["num_draft_tokens"], want_k, "{stats}");
            assert!(stats["accepted"].as_u64().unwrap() > 0, "{prompt:?} k {k:?}: nothing accepted: {stats}");
        }
    }
}

/// A prompt of three prefill chunks on the tiny pair, plain and with its DSpark drafter:
/// with stderr captured (not a terminal) nothing of a prefill bar is printed; on a
/// pseudo-terminal (util-linux `script`, stdout still redirected to a file) stderr shows the
/// bar, and stdout is the same text as without one.
#[test]
fn a_long_prefill_shows_a_bar_only_on_a_terminal() {
    let root = tempfile::tempdir().unwrap();
    let (target, dspark) = test_support::dspark::write_tiny_pair(root.path()).unwrap();
    let (target, dspark) = (target.to_str().unwrap(), dspark.to_str().unwrap());
    // 1,300 bytes, one token each with the byte tokenizer.
    let prompt = "The sea is calm tonight. ".repeat(52);
    let base = ["--model", target, "-p", &prompt, "--ignore-chat-template", "--max-tokens", "8", "--temp", "0"];
    for extra in [&["--draft-kind", "none"][..], &["--draft-model", dspark][..]] {
        let args = [&base[..], extra].concat();
        let out = mlx_spec(&args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?}: {stderr}");
        assert!(stderr.contains("Prompt: 1300 tokens"), "{extra:?}: {stderr}");
        assert!(
            !stderr.contains("prefill") && !stderr.contains('\r') && !stderr.contains('\x1b'),
            "{extra:?}: {stderr}"
        );

        // The same command with stderr on a pseudo-terminal.
        let text = root.path().join("stdout.txt");
        let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
        let mut line = quote(env!("CARGO_BIN_EXE_mlx-spec")) + " generate";
        for a in &args {
            line += &format!(" {}", quote(a));
        }
        line += &format!(" > {}", quote(text.to_str().unwrap()));
        let tty = Command::new("script")
            .args(["-qec", &line, "/dev/null"])
            .env("TERM", "xterm")
            .env_remove("MLX_SPEC_LOG")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run util-linux `script`");
        let shown = String::from_utf8_lossy(&tty.stdout);
        assert!(tty.status.success(), "{extra:?} on a terminal: {shown}");
        assert!(shown.contains("prefill") && shown.contains("/1300 tokens"), "{extra:?}: no prefill bar in {shown:?}");
        assert_eq!(std::fs::read_to_string(&text).unwrap(), String::from_utf8(out.stdout).unwrap(), "{extra:?}");
    }
}
