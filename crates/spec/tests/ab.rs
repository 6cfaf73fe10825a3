//! The acceptance A/B on the tiny fixtures (vocab 256, no chat template): the llama target
//! with itself as arm A and its 4-bit copy as arm B; the report adds up and the verdict
//! follows its two rules; the A/B's `ngram` arm is the drafter of `generate --draft-kind
//! ngram`.
use std::path::PathBuf;

use models::tokenizer::Tokenizer;
use models::{LoadOptions, Transformer, load_model};
use spec::ab::run_ab;
use spec::ngram::DraftSchedule;
use spec::prompts::{Prompt, PromptKind};
use spec::providers::{DraftKind, DraftTarget, DrafterArgs, DrafterSpec, LoadedDrafter};
use spec::two_model::TwoModelProvider;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name)
}

fn load(name: &str) -> Transformer {
    load_model(&dir(name), &LoadOptions::default()).unwrap()
}

/// A byte-level tokenizer over the fixtures' 256 ids (the fixtures ship none).
fn byte_tokenizer() -> Tokenizer {
    tokenizer((0..256u32).map(|i| format!("<0x{i:02X}>")))
}

/// A tokenizer whose token `i` is the `i`-th of `names` (the fixtures' vocabulary is 256).
fn tokenizer(names: impl Iterator<Item = String>) -> Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> = names.zip(0..256u32).map(|(n, i)| (n, i.into())).collect();
    let first = vocab.iter().find(|(_, v)| **v == 0).map(|(k, _)| k.clone()).unwrap();
    let json = serde_json::json!({
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": first},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated", "invert": false},
    });
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("tokenizer.json"), json.to_string()).unwrap();
    std::fs::write(tmp.path().join("tokenizer_config.json"), "{}").unwrap();
    Tokenizer::from_dir(tmp.path()).unwrap()
}

#[test]
fn ab_report_adds_up() {
    let target = load("llama");
    let tok = byte_tokenizer();
    let prompts: Vec<Prompt> = (0..4)
        .map(|i| Prompt {
            kind: if i % 2 == 0 { PromptKind::Grounded } else { PromptKind::Free },
            source: format!("{}:{i}", if i < 2 { "one" } else { "two" }),
            prompt: "<0x01><0x02>".repeat(i + 2),
        })
        .collect();
    let a = TwoModelProvider::new(load("llama"), "llama");
    let b = TwoModelProvider::new(load("llama_q4"), "llama_q4");
    let mut seen = 0;
    let report = run_ab(&target, &tok, &prompts, &a, &b, 4, 12, 3.0, |_, _| seen += 1).unwrap();
    assert_eq!(seen, prompts.len());
    for arm in [&report.a, &report.b] {
        assert_eq!(arm.prompts.len(), prompts.len());
        let drafted: usize = arm.prompts.iter().map(|p| p.drafted).sum();
        assert_eq!(drafted, arm.drafted_by_pos.iter().sum::<usize>());
        assert!(arm.acceptance_by_pos().iter().all(|r| (0.0..=1.0).contains(r)));
        // tau per domain pools that domain's prompts only
        assert_eq!(arm.tau_by_domain.keys().collect::<Vec<_>>(), ["one", "two"]);
        for (d, tau) in &arm.tau_by_domain {
            let of: Vec<_> = arm.prompts.iter().filter(|p| p.source.starts_with(&format!("{d}:"))).collect();
            let rounds: usize = of.iter().map(|p| p.rounds).sum();
            let accepted: usize = of.iter().map(|p| p.accepted).sum();
            assert_eq!(*tau, (accepted + rounds) as f64 / rounds as f64, "{d}");
        }
    }
    // A drafts for itself: everything is accepted.
    assert_eq!(report.a.acceptance_rate, 1.0);
    let drop = 100.0 * (report.a.acceptance_rate - report.b.acceptance_rate);
    assert!((report.acceptance_drop_points - drop).abs() < 1e-9);
    assert_eq!(report.pass, report.acceptance_drop_points <= 3.0 && report.speed_ratio > 1.0);
    assert_eq!(report.verdict().starts_with("PASS"), report.pass);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["a"]["prompts"].as_array().unwrap().len(), 4);
}

/// `mlx-spec generate --draft-kind ngram` resolves its flags with `DrafterSpec::from_args`,
/// the A/B (`examples/ab.rs`, `cargo xtask ab ... ngram`) with `DrafterSpec::parse("ngram")`:
/// both build the same drafter (the heuristic schedule), and it drafts the same tokens on
/// the same prompts; the constant schedule, which the A/B used before, does not.
#[test]
fn the_ab_and_generate_build_the_same_ngram_drafter() {
    let target = load("llama");
    // One token per character: ids 1..=26 are `a`..`z`.
    let tok = tokenizer(
        std::iter::once("<unk>".to_string())
            .chain((0..255u8).map(|i| char::from(b'a' + i % 26).to_string() + &"'".repeat(usize::from(i / 26)))),
    );
    let load_options = LoadOptions::default();
    let on = DraftTarget { dir: &dir("llama"), tokenizer: &tok, load: &load_options };
    let cli_flags = DrafterArgs { draft_kind: Some(DraftKind::Ngram), ..DrafterArgs::default() };
    let cli = DrafterSpec::from_args(&cli_flags).unwrap();
    let ab = DrafterSpec::parse("ngram").unwrap();
    assert_eq!(cli, ab);
    let DrafterSpec::Ngram(ngram) = &ab else { panic!("{ab:?}") };
    assert_eq!(ngram.schedule, DraftSchedule::Heuristic);
    assert_eq!(ngram.provider().unwrap().schedule(), DraftSchedule::Heuristic);

    let build = |spec: &DrafterSpec| -> LoadedDrafter { spec.load(on).unwrap().unwrap() };
    let (from_cli, from_ab) = (build(&cli), build(&ab));
    assert_eq!(from_cli.num_draft_tokens, from_ab.num_draft_tokens);
    let constant =
        DrafterSpec::from_args(&DrafterArgs { ngram_schedule: Some(DraftSchedule::Constant), ..cli_flags }).unwrap();
    let constant = build(&constant);

    // Pseudo-random text over a few byte ids: n-gram matches everywhere, continuations
    // mostly wrong, so the heuristic budgets shrink.
    let mut x = 0x2545_f491u32;
    let prompts: Vec<Prompt> = (0..4)
        .map(|i| Prompt {
            kind: if i % 2 == 0 { PromptKind::Grounded } else { PromptKind::Free },
            source: format!("{}:{i}", if i < 2 { "one" } else { "two" }),
            prompt: (0..48)
                .map(|_| {
                    x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    char::from(b'a' + ((x >> 16) % 6) as u8)
                })
                .collect(),
        })
        .collect();
    let n = from_ab.num_draft_tokens;
    let same =
        run_ab(&target, &tok, &prompts, from_cli.provider.as_ref(), from_ab.provider.as_ref(), n, 32, 3.0, |_, _| {})
            .unwrap();
    let counts = |arm: &spec::ab::ArmReport| {
        let per_prompt: Vec<_> = arm.prompts.iter().map(|p| (p.emitted, p.rounds, p.drafted, p.accepted)).collect();
        (per_prompt, arm.drafted_by_pos.clone(), arm.accepted_by_pos.clone())
    };
    assert_eq!(counts(&same.a), counts(&same.b));
    assert!(same.a.drafted_by_pos.iter().sum::<usize>() > 0, "the prompts offer n-gram matches: {:?}", same.a);
    let other =
        run_ab(&target, &tok, &prompts, from_ab.provider.as_ref(), constant.provider.as_ref(), n, 32, 3.0, |_, _| {})
            .unwrap();
    assert_ne!(counts(&other.a), counts(&other.b), "the schedule changes what is drafted");
}
