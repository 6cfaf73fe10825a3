//! The acceptance A/B on the tiny fixtures (vocab 256, no chat template): the llama target
//! with itself as arm A and its 4-bit copy as arm B; the report adds up and the verdict
//! follows its two rules.
use std::path::PathBuf;

use models::tokenizer::Tokenizer;
use models::{LoadOptions, Transformer, load_model};
use spec::ab::run_ab;
use spec::prompts::{Prompt, PromptKind};
use spec::two_model::TwoModelProvider;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name)
}

fn load(name: &str) -> Transformer {
    load_model(&dir(name), &LoadOptions::default()).unwrap()
}

/// A byte-level tokenizer over the fixtures' 256 ids (the fixtures ship none).
fn byte_tokenizer() -> Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..256u32).map(|i| (format!("<0x{i:02X}>"), i.into())).collect();
    let json = serde_json::json!({
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<0x00>"},
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
            source: format!("tiny:{i}"),
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
