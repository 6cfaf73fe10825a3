//! The acceptance A/B behind `cargo xtask ab` (run it through xtask, which builds it in
//! release mode): one target loaded once, drafters A and B over the same prompts at
//! temperature 0 ([`spec::ab::run_ab`]); prints a table and the verdict, writes
//! `ab.json` (the whole [`spec::ab::AbReport`]) and `ab.png` (acceptance by draft position
//! of both arms) into `--out`.
//!
//! A drafter is `ngram` (the defaults of `mlx-spec generate --draft-kind ngram`, heuristic
//! schedule included) or a directory: a DeepSpec DSpark checkpoint (bf16 or quantized)
//! drafts through `spec::dspark`; any other model directory in the mlx-lm layout drafts as
//! a two-model drafter (its tokenizer must be the target's). Both arms are built by
//! [`spec::providers::DrafterSpec::parse`], the factory `generate` uses; `--num-draft-tokens`
//! applies to both.
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Parser;
use models::tokenizer::Tokenizer;
use models::{LoadOptions, load_model};
use plotters::prelude::*;
use spec::DraftProvider;
use spec::ab::{AbReport, run_ab};
use spec::prompts::{PromptKind, load_prompts};
use spec::providers::{DraftTarget, DrafterSpec};

#[derive(Parser)]
struct Args {
    /// Target model directory.
    #[arg(long)]
    target: PathBuf,
    /// Baseline drafter: `ngram` or a directory.
    #[arg(long)]
    drafter_a: String,
    /// Candidate drafter (e.g. the quantized copy of A).
    #[arg(long)]
    drafter_b: String,
    /// Prompt set (JSON lines, see `spec::prompts`).
    #[arg(long)]
    prompts: PathBuf,
    /// Prompts to use, alternating input-grounded and free-form.
    #[arg(long, default_value_t = 32)]
    num_prompts: usize,
    /// Drafts per round (γ).
    #[arg(long, default_value_t = 3)]
    num_draft_tokens: usize,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// The largest acceptance drop of B, in percentage points, that still passes.
    #[arg(long, default_value_t = 3.0)]
    max_drop: f64,
    /// Compute dtype of the models.
    #[arg(long, default_value = "float32")]
    dtype: String,
    /// Directory for ab.json and ab.png.
    #[arg(long, default_value = "target/ab")]
    out: PathBuf,
    /// Exit with an error when B's acceptance drops by more than --max-drop (a gate; the
    /// speed half of the verdict is only reported, as it moves with the machine's load).
    #[arg(long)]
    gate_acceptance: bool,
}

/// The provider of one arm, named `ngram` or by a directory.
fn drafter(word: &str, target: DraftTarget<'_>) -> Result<Box<dyn DraftProvider>> {
    let spec = DrafterSpec::parse(word)?;
    let loaded = spec.load(target).with_context(|| format!("drafter {word}"))?;
    Ok(loaded.context("a drafter spec parsed from a word is never none")?.provider)
}

fn main() -> Result<()> {
    let a = Args::parse();
    let dtype = mlx_core::Dtype::from_name(&a.dtype).with_context(|| format!("--dtype {}", a.dtype))?;
    let load = LoadOptions { dtype: Some(dtype), ..LoadOptions::default() };
    let target = load_model(&a.target, &load).with_context(|| format!("loading {}", a.target.display()))?;
    let tok = Tokenizer::from_dir(&a.target)?;
    let draft_target = DraftTarget { dir: &a.target, tokenizer: &tok, load: &load };
    let arm_a = drafter(&a.drafter_a, draft_target)?;
    let arm_b = drafter(&a.drafter_b, draft_target)?;

    // Alternate grounded and free-form prompts so any prefix of the set mixes both.
    let all = load_prompts(&a.prompts)?;
    let (grounded, free): (Vec<_>, Vec<_>) = all.into_iter().partition(|p| p.kind == PromptKind::Grounded);
    let mut prompts = Vec::new();
    let (mut g, mut f) = (grounded.into_iter(), free.into_iter());
    while prompts.len() < a.num_prompts {
        match (g.next(), f.next()) {
            (None, None) => break,
            (x, y) => prompts.extend(x.into_iter().chain(y)),
        }
    }
    prompts.truncate(a.num_prompts);

    eprintln!("{:<16} {:>9} {:>9} {:>9} {:>9}", "prompt", "A accept", "B accept", "A tok/s", "B tok/s");
    let rate = |p: &spec::ab::PromptResult| p.accepted as f64 / p.drafted.max(1) as f64;
    let tps = |p: &spec::ab::PromptResult| p.emitted as f64 / (p.decode_ms / 1e3).max(1e-9);
    let report = run_ab(
        &target,
        &tok,
        &prompts,
        arm_a.as_ref(),
        arm_b.as_ref(),
        a.num_draft_tokens,
        a.max_tokens,
        a.max_drop,
        |x, y| {
            eprintln!("{:<16} {:>9.3} {:>9.3} {:>9.2} {:>9.2}", x.source, rate(x), rate(y), tps(x), tps(y));
        },
    )?;
    print_table(&report);
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let json = a.out.join("ab.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let png = a.out.join("ab.png");
    plot(&report, &png).with_context(|| format!("plotting {}", png.display()))?;
    println!("wrote {} and {}", json.display(), png.display());
    if a.gate_acceptance && report.acceptance_drop_points > a.max_drop {
        anyhow::bail!(
            "acceptance gate: B drafts {:.2} points worse than A (allowed: {})",
            report.acceptance_drop_points,
            a.max_drop
        );
    }
    Ok(())
}

fn print_table(r: &AbReport) {
    println!(
        "\n{} prompts, {} draft tokens, {} max tokens, temperature 0",
        r.a.prompts.len(),
        r.num_draft_tokens,
        r.max_tokens
    );
    println!("{:<4} {:<50} {:>8} {:>6} {:>8}  acceptance by position", "arm", "drafter", "accept", "tau", "tok/s");
    for arm in [&r.a, &r.b] {
        let by_pos: Vec<String> = arm.acceptance_by_pos().iter().map(|x| format!("{x:.2}")).collect();
        println!(
            "{:<4} {:<50} {:>8.3} {:>6.2} {:>8.2}  {}",
            arm.label,
            arm.drafter,
            arm.acceptance_rate,
            arm.tau,
            arm.tokens_per_s,
            by_pos.join(" ")
        );
    }
    for arm in [&r.a, &r.b] {
        let per: Vec<String> = arm.tau_by_domain.iter().map(|(d, tau)| format!("{d} {tau:.2}")).collect();
        println!("{:<4} tau by domain: {}", arm.label, per.join(", "));
    }
    println!(
        "acceptance drop {:.2} points (paired mean {:+.2}), speed B/A {:.3}x -> {}",
        r.acceptance_drop_points,
        r.paired_mean_diff_points,
        r.speed_ratio,
        r.verdict()
    );
}

/// Acceptance rate by draft position, both arms, as a PNG. Labels need a TrueType font
/// (DejaVu Sans from the system); without one the plot is drawn without text.
fn plot(r: &AbReport, path: &Path) -> Result<()> {
    let font = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/TTF/DejaVuSans.ttf"]
        .iter()
        .find_map(|p| std::fs::read(p).ok());
    let labels = match font {
        Some(bytes) => {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| anyhow::anyhow!("DejaVuSans.ttf is not a usable font"))?;
            true
        }
        None => {
            eprintln!("no DejaVuSans.ttf found: the plot has no labels");
            false
        }
    };
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = r.num_draft_tokens.max(1);
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20).x_label_area_size(40).y_label_area_size(50);
    if labels {
        builder.caption(format!("acceptance by draft position: {}", r.verdict()), ("sans-serif", 20));
    }
    let mut chart = builder.build_cartesian_2d(0.5f64..n as f64 + 0.5, 0f64..1.05)?;
    if labels {
        chart.configure_mesh().x_desc("draft position").y_desc("accepted / drafted").draw()?;
    } else {
        chart.configure_mesh().disable_x_mesh().x_labels(0).y_labels(0).draw()?;
    }
    for (arm, color) in [(&r.a, BLUE), (&r.b, RED)] {
        let points: Vec<(f64, f64)> =
            arm.acceptance_by_pos().iter().enumerate().map(|(j, &y)| (j as f64 + 1.0, y)).collect();
        let series = chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?;
        if labels {
            series
                .label(format!("{} {} ({:.1}%)", arm.label, arm.drafter, 100.0 * arm.acceptance_rate))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    if labels {
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE).draw()?;
    }
    root.present()?;
    Ok(())
}
