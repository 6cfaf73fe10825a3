//! The speculative decoding benchmark behind `cargo xtask bench spec` (run it through xtask,
//! which builds it in release mode and runs mlx-lm on the same prompts beside it).
//!
//! Loads one target (and up to two draft models, when given) once, then for each prompt of a
//! prompt set (the first `--num-prompts` input-grounded and free-form prompts) runs greedy
//! plain decoding, the default drafter (`suffix`: the suffix drafter under the cost-aware
//! length policy; `suffix-fixed`: every proposed token; both without the cross-request store,
//! which would copy earlier runs of the same prompt), n-gram speculative decoding (γ 10,
//! constant and heuristic schedules) and the `--draft` model's speculative decoding (γ 3, and
//! `-adaptive`: the cost-aware policy up to γ 8; the arms are `two-model*` for a small model,
//! `dspark*` for a DSpark checkpoint; `--draft-b`, e.g. a 4-bit copy of the drafter, as a
//! second such arm, `two-model-b*` / `dspark-b*`), interleaved per prompt (odd `--repeats` in reverse order) so machine
//! noise hits every arm alike. With `--temp` above 0 every arm samples (prompt `i` with seed
//! `i`; exact match keeps the outputs equal to plain decoding's), and each draft model arm gets
//! a `-greedy-draft` twin whose draft model picks the argmax instead of sampling with the
//! request's keys, the drafting of earlier versions: the acceptance gained by coupled
//! drafting, side by side. Reports per prompt kind the
//! decode tokens/s of each arm (emitted tokens over decode time, prefill excluded), its
//! ratio to plain, the steady rate (tokens after the second over the time since the second
//! was handed over: no prefill, no first round, no re-prefill), tau and acceptance rate, and
//! whether every output equaled plain's; then per prompt kind and arm the per-prompt tokens/s
//! ratio to plain (median and minimum over prompts), tau, and the ratio the cost model
//! predicts from the target's measured t(T) and the rounds the arm ran (target forwards
//! only: drafting and bookkeeping are the gap); with `--json FILE` also the raw numbers.
//!
//! `--fallback-arm` adds the `fallback` arm: speculative decoding whose target cache refuses
//! every rollback without declaring it (`rollback_reach` `None`, a test double over
//! `make_cache`), drafting one token (id 0) per round, so the first rejected draft forces the
//! executor's fallback to plain decoding after one token and the rest of the request runs on
//! the fallback path; its steady rate against plain's is the fallback's speed (also printed:
//! the per-run ratios and their median, and the same for the rate of each run's median
//! step). `--arms`
//! keeps only the named arms (plain always runs), `--repeats` runs each prompt several times
//! (arms interleaved within each repetition). `--target gemma3-270m` is Gemma 3 270M, fetched
//! and imported on first use (`test_support::fixtures`). For example:
//!
//! ```sh
//! cargo run --release -p spec --example spec_bench -- --target gemma3-270m \
//!     --prompts fixtures/prompts/spec-equality.jsonl --fallback-arm --arms fallback \
//!     --num-prompts 1 --max-tokens 120 --repeats 3
//! ```
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use mlx_core::Array;
use models::generate::generate;
use models::tokenizer::Tokenizer;
use models::{GenerateParams, LayerCache, LoadOptions, ModelCache, Sampler, Transformer, load_model};
use spec::ngram::DraftSchedule;
use spec::policy::{CostModel, CurveCache, predicted_ratio};
use spec::prompts::{PromptKind, load_prompts};
use spec::providers::{DraftKind, DraftLength, DraftTarget, DrafterArgs, DrafterSpec, LoadedDrafter, SuffixSpec};
use spec::two_model::DraftSampling;
use spec::{DraftProvider, DraftSource, speculative_generate_with_cache};

#[derive(Parser)]
struct Args {
    /// Target model directory, or `gemma3-270m` (fetched and imported on first use).
    #[arg(long)]
    target: PathBuf,
    /// Draft model directory: a small model (`two-model*` arms) or a DSpark checkpoint
    /// (`dspark*` arms); those arms are skipped without it.
    #[arg(long)]
    draft: Option<PathBuf>,
    /// A second draft model for second draft model arms (`two-model-b*` / `dspark-b*`).
    #[arg(long)]
    draft_b: Option<PathBuf>,
    /// Prompt set (JSON lines, see `spec::prompts`).
    #[arg(long)]
    prompts: PathBuf,
    /// Prompts of each kind (grounded, free-form).
    #[arg(long, default_value_t = 4)]
    num_prompts: usize,
    /// Tokens to generate per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Drafts per round for the n-gram arm.
    #[arg(long, default_value_t = 10)]
    ngram_draft_tokens: usize,
    /// Drafts per round for the two-model arm.
    #[arg(long, default_value_t = 3)]
    num_draft_tokens: usize,
    /// Compute dtype of both models: float32, float16 or bfloat16.
    #[arg(long, default_value = "float32")]
    dtype: String,
    /// Sampling temperature of every arm (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Nucleus sampling mass (0 or 1 = off).
    #[arg(long, default_value_t = 0.0)]
    top_p: f32,
    /// Top-k filter (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Min-p filter (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Write the per-prompt numbers as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Add the `fallback` arm (a forced fallback to plain decoding after the first token).
    #[arg(long)]
    fallback_arm: bool,
    /// Run only these arms besides plain (comma-separated names; default: all).
    #[arg(long, value_delimiter = ',')]
    arms: Option<Vec<String>>,
    /// Runs of each prompt (every arm once per run, interleaved).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
    /// Also run this many two-turn edit sessions (the first grounded prompts; turn 2 asks to
    /// repeat turn 1's answer with a change) and report turn 2: plain, `suffix` (no store)
    /// and `suffix-store` (turn 1 ran through the same provider, whose store holds it).
    #[arg(long, default_value_t = 0)]
    two_turn: usize,
}

/// Totals of one arm over the prompts of one kind.
#[derive(Default, Clone, serde::Serialize)]
struct Arm {
    tokens: usize,
    decode_s: f64,
    /// Tokens after the second, and the time from the second to the last.
    steady_tokens: usize,
    steady_s: f64,
    rounds: usize,
    accepted: usize,
    drafted: usize,
    mismatches: usize,
    /// The executor's phases summed over runs, milliseconds ([`spec::RoundProfile`]), and
    /// the executor's decode time.
    phases_ms: [f64; 7],
    executor_decode_ms: f64,
}

impl Arm {
    fn tps(&self) -> f64 {
        self.tokens as f64 / self.decode_s.max(1e-9)
    }

    fn steady_tps(&self) -> f64 {
        self.steady_tokens as f64 / self.steady_s.max(1e-9)
    }

    /// Adds a run's steady part from the times its tokens were handed over.
    fn add_steady(&mut self, times: &[Instant]) -> f64 {
        if times.len() < 3 {
            return 0.0;
        }
        let (n, s) = (times.len() - 2, (times[times.len() - 1] - times[1]).as_secs_f64());
        self.steady_tokens += n;
        self.steady_s += s;
        n as f64 / s.max(1e-9)
    }
}

/// The `fallback` arm's source: one draft, token 0, every round.
struct OneDraft;

impl DraftProvider for OneDraft {
    fn name(&self) -> &str {
        "one-draft"
    }
    fn open<'a>(&'a self, _: &'a Transformer, _: &Sampler) -> spec::Result<Box<dyn DraftSource + 'a>> {
        Ok(Box::new(OneDraft))
    }
}

impl DraftSource for OneDraft {
    fn name(&self) -> &str {
        "one-draft"
    }
    fn prefill(&mut self, _: &[u32], _: Option<&[Array]>) -> spec::Result<()> {
        Ok(())
    }
    fn draft(&mut self, _: &[u32], n: usize, _: usize) -> spec::Result<Vec<u32>> {
        Ok(vec![0; n.min(1)])
    }
    fn commit(&mut self, _: usize, _: usize, _: Option<&[Array]>) -> spec::Result<()> {
        Ok(())
    }
}

/// The `fallback` arm's target cache layer: refuses every rollback, without declaring a
/// rollback reach (so the executor drafts and then has to fall back).
struct NoRollback(Box<dyn LayerCache>);

impl LayerCache for NoRollback {
    fn offset(&self) -> usize {
        self.0.offset()
    }
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> models::Result<(Array, Array)> {
        self.0.update_and_fetch(keys, values)
    }
    fn can_trim(&self, _: usize) -> bool {
        false
    }
    fn trim(&mut self, _: usize) -> usize {
        0
    }
    fn state(&self) -> Vec<Array> {
        self.0.state()
    }
    fn attention_mask(&self) -> models::Result<Option<Array>> {
        self.0.attention_mask()
    }
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    if a.target.as_os_str() == "gemma3-270m" {
        a.target = test_support::fixtures::ensure_gemma3_270m(&mut |_| {}).context("fetching Gemma 3 270M")?;
    }
    let dtype = mlx_core::Dtype::from_name(&a.dtype).with_context(|| format!("--dtype {}", a.dtype))?;
    let load = LoadOptions { dtype: Some(dtype), ..LoadOptions::default() };
    let target = load_model(&a.target, &load).with_context(|| format!("loading {}", a.target.display()))?;
    let tok = Tokenizer::from_dir(&a.target)?;
    // Every drafter comes from the factory `mlx-spec generate` uses, from the same flags.
    let draft_target = DraftTarget { dir: &a.target, tokenizer: &tok, load: &load };
    let build = |args: DrafterArgs, sampling: DraftSampling| -> Result<(Box<dyn DraftProvider>, usize)> {
        let spec = DrafterSpec::from_args(&args)?.with_draft_sampling(sampling);
        let LoadedDrafter { provider, num_draft_tokens } = spec.load(draft_target)?.context("a drafter")?;
        Ok((provider, num_draft_tokens))
    };
    let ngram = |schedule| DrafterArgs {
        draft_kind: Some(DraftKind::Ngram),
        num_draft_tokens: Some(a.ngram_draft_tokens),
        ngram_schedule: Some(schedule),
        ..DrafterArgs::default()
    };
    let model = |dir: &PathBuf| DrafterArgs {
        draft_model: Some(dir.clone()),
        num_draft_tokens: Some(a.num_draft_tokens),
        ..DrafterArgs::default()
    };
    // (name, provider, drafts per round); "plain" is slot 0.
    let mut providers: Vec<(String, Box<dyn DraftProvider>, usize)> = Vec::new();
    // The default drafter without its cross-request store: the repetitions of a prompt
    // (and the same prompt in other arms' runs) would otherwise be copied from earlier runs.
    for (name, adaptive) in [("suffix", true), ("suffix-fixed", false)] {
        let spec = DrafterSpec::Suffix(SuffixSpec { adaptive, store_requests: 0, ..SuffixSpec::default() });
        let LoadedDrafter { provider, num_draft_tokens } = spec.load(draft_target)?.context("a drafter")?;
        providers.push((name.into(), provider, num_draft_tokens));
    }
    for (name, schedule) in [("ngram", DraftSchedule::Constant), ("ngram-heur", DraftSchedule::Heuristic)] {
        let (provider, n) = build(ngram(schedule), DraftSampling::default())?;
        providers.push((name.into(), provider, n));
    }
    let sampled = a.temp > 0.0;
    for (b, dir) in [("", &a.draft), ("-b", &a.draft_b)] {
        if let Some(dir) = dir {
            // A DSpark checkpoint's arms are `dspark*`, a small model's `two-model*`.
            let kind = if spec::providers::is_dspark_dir(dir) { "dspark" } else { "two-model" };
            let name = format!("{kind}{b}");
            let (provider, n) = build(model(dir), DraftSampling::Request)?;
            providers.push((name.clone(), provider, n));
            let adaptive = DrafterArgs {
                draft_length: Some(DraftLength::Adaptive),
                num_draft_tokens: Some(a.num_draft_tokens.max(8)),
                ..model(dir)
            };
            let (provider, n) = build(adaptive, DraftSampling::Request)?;
            providers.push((format!("{name}-adaptive"), provider, n));
            if sampled {
                let (provider, n) = build(model(dir), DraftSampling::Greedy)?;
                providers.push((format!("{name}-greedy-draft"), provider, n));
            }
        }
    }
    if a.fallback_arm {
        providers.push(("fallback".into(), Box::new(OneDraft), 1));
    }
    if let Some(keep) = &a.arms {
        if let Some(bad) = keep.iter().find(|k| !providers.iter().any(|p| &p.0 == *k)) {
            bail!("--arms: no arm {bad} (arms: {:?})", providers.iter().map(|p| &p.0).collect::<Vec<_>>());
        }
        providers.retain(|p| keep.contains(&p.0));
    }
    // The target's cost curve (measured once, or read from the cache the default drafter
    // shares) for the predicted ratios.
    let curve = CostModel::measure(Some(CurveCache::for_model(&a.target, &load))).curve(&target)?;
    eprintln!("target cost curve t(T), T = 1..: {}", curve.describe());
    let all = load_prompts(&a.prompts)?;
    let sampler = Sampler { temp: a.temp, top_p: a.top_p, top_k: a.top_k, min_p: a.min_p, seed: 0 };
    let base = GenerateParams { max_tokens: a.max_tokens, sampler, eos: tok.eos_ids().to_vec() };

    let arms: Vec<&str> = std::iter::once("plain").chain(providers.iter().map(|p| p.0.as_str())).collect();
    let mut rows = Vec::new();
    let mut totals: Vec<(PromptKind, Vec<Arm>)> = Vec::new();
    for kind in [PromptKind::Grounded, PromptKind::Free] {
        let mut sums: Vec<Arm> = vec![Arm::default(); arms.len()];
        let chosen: Vec<_> = all.iter().filter(|p| p.kind == kind).take(a.num_prompts).enumerate().collect();
        for (rep, (i, p)) in (0..a.repeats).flat_map(|r| chosen.iter().map(move |&p| (r, p))) {
            let ids = p.ids(&tok)?;
            let params = GenerateParams { sampler: Sampler { seed: i as u64, ..base.sampler.clone() }, ..base.clone() };
            // Odd repetitions run the arms in reverse order (plain last), so a drift in the
            // machine's load favours no arm.
            let mut order: Vec<usize> = (0..arms.len()).collect();
            if rep % 2 == 1 {
                order.reverse();
            }
            let mut runs: Vec<Option<Run>> = (0..arms.len()).map(|_| None).collect();
            for slot in order {
                runs[slot] = Some(match slot {
                    0 => plain(&target, &ids, &params)?,
                    _ => {
                        let (name, provider, n) = &providers[slot - 1];
                        speculative(&target, provider.as_ref(), *name == "fallback", &ids, &params, *n)?
                    }
                });
            }
            let runs: Vec<Run> = runs.into_iter().map(|r| r.expect("every arm ran")).collect();
            let want = &runs[0].tokens;
            let mut row = serde_json::json!({
                "kind": format!("{kind:?}"), "source": p.source, "repeat": rep, "prompt_tokens": ids.len()
            });
            for (slot, run) in runs.iter().enumerate() {
                let arm = &mut sums[slot];
                row[format!("{}_steady_tps", arms[slot])] = arm.add_steady(&run.times).into();
                row[format!("{}_median_step_tps", arms[slot])] = median_step_tps(&run.times).into();
                row[format!("{}_tps", arms[slot])] = (run.tokens.len() as f64 / run.decode_s.max(1e-9)).into();
                arm.tokens += run.tokens.len();
                arm.decode_s += run.decode_s;
                arm.mismatches += usize::from(&run.tokens != want);
                if let Some(stats) = &run.stats {
                    arm.rounds += stats.rounds;
                    arm.accepted += stats.accepted;
                    arm.drafted += stats.drafted;
                    for (sum, (_, ms)) in arm.phases_ms.iter_mut().zip(stats.profile.phases()) {
                        *sum += ms;
                    }
                    arm.executor_decode_ms += stats.decode_ms;
                    row[format!("{}_tau", arms[slot])] = stats.tau.into();
                    row[format!("{}_predicted", arms[slot])] = predicted_ratio(&curve, stats).into();
                    row[format!("{}_fallback_at", arms[slot])] = stats.fallback_at.into();
                }
            }
            eprintln!("{row}");
            rows.push(row);
        }
        totals.push((kind, sums));
    }

    let shown = |d: &Option<PathBuf>| d.as_ref().map_or("-".into(), |d| d.display().to_string());
    println!("\ntarget {} ({}), draft {}, draft-b {}", a.target.display(), a.dtype, shown(&a.draft), shown(&a.draft_b));
    println!("sampler: {:?}", base.sampler);
    println!(
        "{:<10} {:<12} {:>8} {:>7} {:>8} {:>7} {:>6} {:>7} {:>9}",
        "prompts", "arm", "tok/s", "x plain", "steady", "x plain", "tau", "accept", "mismatch"
    );
    for (kind, sums) in &totals {
        for (i, arm) in sums.iter().enumerate() {
            if arm.tokens == 0 {
                continue;
            }
            let tau = if arm.rounds > 0 { (arm.accepted + arm.rounds) as f64 / arm.rounds as f64 } else { 1.0 };
            let rate = if arm.drafted > 0 { arm.accepted as f64 / arm.drafted as f64 } else { 0.0 };
            println!(
                "{:<10} {:<12} {:>8.2} {:>7.2} {:>8.2} {:>7.3} {:>6.2} {:>7.2} {:>9}",
                format!("{kind:?}").to_lowercase(),
                arms[i],
                arm.tps(),
                arm.tps() / sums[0].tps(),
                arm.steady_tps(),
                arm.steady_tps() / sums[0].steady_tps(),
                tau,
                rate,
                arm.mismatches
            );
        }
    }
    // Where each speculative arm's decode time went, per emitted token (plain decoding's
    // whole step for comparison): the forward is the cost model's part, the rest its gap.
    let names = spec::RoundProfile::default().phases().map(|(name, _)| name);
    println!("\nround profile, ms per emitted token (plain: {:.3} ms):", 1e3 / sums_plain_tps(&totals));
    println!("{:<10} {:<22} {}  other", "prompts", "arm", names.map(|n| format!("{n:>8}")).join(" "));
    for (kind, sums) in &totals {
        for (i, arm) in sums.iter().enumerate().skip(1) {
            if arm.tokens == 0 || arm.executor_decode_ms == 0.0 {
                continue;
            }
            let per = |ms: f64| ms / arm.tokens as f64;
            let other = arm.executor_decode_ms - arm.phases_ms.iter().sum::<f64>();
            println!(
                "{:<10} {:<22} {} {:>8.3}",
                format!("{kind:?}").to_lowercase(),
                arms[i],
                arm.phases_ms.map(|ms| format!("{:>8.3}", per(ms))).join(" "),
                per(other)
            );
        }
    }
    // Per run, each arm's steady rate over plain's in the same repetition, and the same for
    // the rate of the median step: medians are robust to runs and steps disturbed by other
    // load on the machine.
    for arm in &arms[1..] {
        for key in ["steady_tps", "median_step_tps"] {
            let mut ratios: Vec<f64> = rows
                .iter()
                .filter_map(|r| Some(r[format!("{arm}_{key}")].as_f64()? / r[format!("plain_{key}")].as_f64()?))
                .collect();
            ratios.sort_by(f64::total_cmp);
            if let Some(mid) = ratios.get(ratios.len() / 2) {
                println!("{arm} / plain, {key} per run: median {mid:.3} over {} runs: {ratios:.3?}", ratios.len());
            }
        }
    }
    // Per prompt kind: each arm's per-run tokens/s over plain's in the same run, median and
    // minimum, with tau and the cost model's predicted ratio (median over runs).
    println!("\n{:<10} {:<22} {:>9} {:>9} {:>6} {:>10}", "prompts", "arm", "median x", "min x", "tau", "predicted");
    for kind in [PromptKind::Grounded, PromptKind::Free] {
        let of_kind: Vec<&serde_json::Value> =
            rows.iter().filter(|r| r["kind"].as_str() == Some(format!("{kind:?}").as_str())).collect();
        for arm in &arms[1..] {
            let mut ratios: Vec<f64> = of_kind
                .iter()
                .filter_map(|r| Some(r[format!("{arm}_tps")].as_f64()? / r["plain_tps"].as_f64()?))
                .collect();
            let mut taus: Vec<f64> = of_kind.iter().filter_map(|r| r[format!("{arm}_tau")].as_f64()).collect();
            let mut predicted: Vec<f64> =
                of_kind.iter().filter_map(|r| r[format!("{arm}_predicted")].as_f64()).collect();
            if ratios.is_empty() {
                continue;
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
            };
            let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            println!(
                "{:<10} {:<22} {:>9.3} {:>9.3} {:>6.2} {:>10.3}",
                format!("{kind:?}").to_lowercase(),
                arm,
                median(&mut ratios),
                min,
                median(&mut taus),
                median(&mut predicted)
            );
        }
    }
    let two_turn_rows = if a.two_turn > 0 {
        let sessions: Vec<_> = all.iter().filter(|p| p.kind == PromptKind::Grounded).take(a.two_turn).collect();
        two_turn(&target, &tok, draft_target, &sessions, &base)?
    } else {
        Vec::new()
    };
    if let Some(path) = &a.json {
        let report = serde_json::json!({"cost_curve": curve.describe(), "two_turn": two_turn_rows, "prompts": rows, "totals": totals.iter().map(|(k, s)| serde_json::json!({"kind": k, "arms": s})).collect::<Vec<_>>()});
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if totals.iter().any(|(_, s)| s.iter().any(|a| a.mismatches > 0)) {
        bail!("a speculative output differed from plain decoding");
    }
    Ok(())
}

/// Plain decoding's tokens/s over every prompt kind.
fn sums_plain_tps(totals: &[(PromptKind, Vec<Arm>)]) -> f64 {
    let (tokens, s) = totals.iter().fold((0, 0.0), |(t, s), (_, arms)| (t + arms[0].tokens, s + arms[0].decode_s));
    tokens as f64 / s.max(1e-9)
}

/// The two-turn edit sessions: turn 1 answers `p` (plain decoding, and through the
/// `suffix-store` provider so its store holds the stream), turn 2 asks to repeat that answer
/// with a change; prints per session turn 2's ratio to plain of `suffix` (no store) and
/// `suffix-store`, with tau, and their medians.
fn two_turn(
    target: &Transformer,
    tok: &Tokenizer,
    draft_target: DraftTarget<'_>,
    sessions: &[&spec::prompts::Prompt],
    params: &GenerateParams,
) -> Result<Vec<serde_json::Value>> {
    use models::tokenizer::ChatMessage;
    let load = |store_requests| -> Result<Box<dyn DraftProvider>> {
        let spec = DrafterSpec::Suffix(SuffixSpec { store_requests, ..SuffixSpec::default() });
        Ok(spec.load(draft_target)?.context("a drafter")?.provider)
    };
    let (no_store, with_store) = (load(0)?, load(16)?);
    let mut rows = Vec::new();
    println!("\ntwo-turn edit sessions, turn 2 (x plain, tau):");
    for p in sessions {
        let first_ids = p.ids(tok)?;
        let first = plain(target, &first_ids, params)?;
        speculative(target, with_store.as_ref(), false, &first_ids, params, 32)?;
        let answer = tok.decode(&first.tokens, true)?;
        let msgs = [
            ChatMessage::user(p.prompt.clone()),
            ChatMessage::assistant(answer),
            ChatMessage::user(
                "Repeat your previous answer in full, with one change: rename the main function to `solve`."
                    .to_string(),
            ),
        ];
        let ids = tok.encode(&tok.apply_chat_template(&msgs, true)?, false)?;
        let base = plain(target, &ids, params)?;
        let tps = |r: &Run| r.tokens.len() as f64 / r.decode_s.max(1e-9);
        let mut row = serde_json::json!({"source": p.source, "prompt_tokens": ids.len(), "plain_tps": tps(&base)});
        for (name, provider) in [("suffix", &no_store), ("suffix-store", &with_store)] {
            let run = speculative(target, provider.as_ref(), false, &ids, params, 32)?;
            if run.tokens != base.tokens {
                bail!("two-turn {}: {name} output differs from plain", p.source);
            }
            let tau = run.stats.as_ref().map_or(0.0, |s| s.tau);
            row[format!("{name}_ratio")] = (tps(&run) / tps(&base)).into();
            row[format!("{name}_tau")] = tau.into();
        }
        println!(
            "  {:<24} suffix {:.3}x (tau {:.2})  suffix-store {:.3}x (tau {:.2})",
            p.source,
            row["suffix_ratio"].as_f64().unwrap_or(0.0),
            row["suffix_tau"].as_f64().unwrap_or(0.0),
            row["suffix-store_ratio"].as_f64().unwrap_or(0.0),
            row["suffix-store_tau"].as_f64().unwrap_or(0.0)
        );
        rows.push(row);
    }
    for name in ["suffix", "suffix-store"] {
        let mut v: Vec<f64> = rows.iter().filter_map(|r| r[format!("{name}_ratio")].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        if let Some(m) = v.get(v.len() / 2) {
            println!("  median turn-2 ratio, {name}: {m:.3}x over {} sessions", v.len());
        }
    }
    Ok(rows)
}

/// 1 / the median time between consecutive tokens after the second (0 for fewer than 4
/// tokens), tokens/s.
fn median_step_tps(times: &[Instant]) -> f64 {
    if times.len() < 4 {
        return 0.0;
    }
    let mut steps: Vec<f64> = times[1..].windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
    steps.sort_by(f64::total_cmp);
    1.0 / steps[steps.len() / 2].max(1e-9)
}

/// One arm's run on one prompt.
struct Run {
    tokens: Vec<u32>,
    /// Decode time, seconds (prefill excluded).
    decode_s: f64,
    /// When each token was handed over.
    times: Vec<Instant>,
    stats: Option<spec::SpecStats>,
}

/// Speculative decoding with `params`; `forced_fallback` gives the target a cache that refuses every
/// rollback ([`NoRollback`]).
fn speculative(
    target: &Transformer,
    provider: &dyn DraftProvider,
    forced_fallback: bool,
    ids: &[u32],
    params: &GenerateParams,
    n: usize,
) -> Result<Run> {
    let mut source = provider.open(target, &params.sampler)?;
    let mut cache = target.make_cache();
    if forced_fallback {
        let layers = cache.layers.into_iter().map(|l| Box::new(NoRollback(l)) as Box<dyn LayerCache>);
        cache = ModelCache { layers: layers.collect() };
    }
    let (mut tokens, mut times) = (Vec::new(), Vec::new());
    let stats = speculative_generate_with_cache(target, cache, source.as_mut(), ids, params, n, |t| {
        tokens.push(t);
        times.push(Instant::now());
        true
    })?;
    Ok(Run { tokens, decode_s: stats.decode_ms / 1e3, times, stats: Some(stats) })
}

/// Plain decoding with `params`.
fn plain(target: &Transformer, ids: &[u32], params: &GenerateParams) -> Result<Run> {
    let mut out = Vec::new();
    let mut times = Vec::new();
    let t0 = Instant::now();
    let stats = generate(target, ids, params, |t| {
        out.push(t);
        times.push(Instant::now());
        true
    })?;
    let decode_s = if stats.generation_tps > 0.0 {
        stats.generation_tokens as f64 / stats.generation_tps
    } else {
        t0.elapsed().as_secs_f64()
    };
    Ok(Run { tokens: out, decode_s, times, stats: None })
}
