//! Prometheus metrics, prefix `mlx_spec:`, shaped like vLLM's (`vllm:num_requests_running`,
//! `vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`, ...) so dashboards port.
//!
//! Each server owns its own [`Metrics`] (its own registry), so several servers can run in one
//! process (the tests do). Counters get the `_total` suffix from the encoder.
use std::sync::atomic::{AtomicI64, AtomicU64};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The label set of the labelled families (`position`, `finished_reason`).
pub type Labels = Vec<(String, String)>;

/// Every metric of one server; update from any thread.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests the engine is generating for (up to `--max-batch`).
    pub requests_running: Gauge<i64, AtomicI64>,
    /// Requests admitted and waiting for the engine.
    pub requests_waiting: Gauge<i64, AtomicI64>,
    /// Finished requests by `finished_reason` (`stop`, `length`, `cancelled`, `error`).
    pub requests_finished: Family<Labels, Counter>,
    /// Requests refused with 503 because the queue was full.
    pub requests_rejected: Counter,
    /// Prompt tokens of finished requests (cached ones included).
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub generation_tokens: Counter,
    /// Prompt tokens served from the prompt cache.
    pub prompt_tokens_cached: Counter,
    /// Prompt-cache lookups, in tokens (each request adds its prompt length), as vLLM counts.
    pub prefix_cache_queries: Counter,
    /// Prompt-cache hits, in tokens (each request adds the tokens it reused).
    pub prefix_cache_hits: Counter,
    /// Bytes held by the prompt cache (target KV and drafter state).
    pub prompt_cache_bytes: Gauge<i64, AtomicI64>,
    /// Entries in the prompt cache.
    pub prompt_cache_entries: Gauge<i64, AtomicI64>,
    /// MLX bytes held by live arrays, read after each request.
    pub mlx_active_memory_bytes: Gauge<i64, AtomicI64>,
    /// Time from arrival to the first generated token, seconds.
    pub time_to_first_token: Histogram,
    /// Time between consecutive generated tokens, seconds (tokens of one speculative round
    /// come out together).
    pub inter_token_latency: Histogram,
    /// Time from arrival to the last token, seconds.
    pub e2e_request_latency: Histogram,
    /// Time waiting in the queue, seconds.
    pub request_queue_time: Histogram,
    /// Verify rounds that carried drafts.
    pub spec_decode_num_drafts: Counter,
    /// Draft tokens verified.
    pub spec_decode_num_draft_tokens: Counter,
    /// Draft tokens accepted.
    pub spec_decode_num_accepted_tokens: Counter,
    /// Accepted drafts by position in the block (`position="0"`, ...).
    pub spec_decode_num_accepted_tokens_per_pos: Family<Labels, Counter>,
    /// Requests that fell back to plain decoding (the target cache could not roll back).
    pub spec_decode_fallbacks: Counter,
    /// 1 while the engine thread runs with the model loaded, 0 otherwise.
    pub engine_alive: Gauge<i64, AtomicI64>,
    /// Mean acceptance length of the last request (tau), for a glance.
    pub last_tau: Gauge<f64, AtomicU64>,
    /// Requests in the last batched target forward (continuous batching).
    pub batch_size: Gauge<i64, AtomicI64>,
    /// Rows (tokens of every request's verify window) per batched target forward.
    pub batch_rows: Histogram,
}

fn latency() -> Histogram {
    // 1 ms .. ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let mut m = Metrics {
            registry: Registry::default(),
            requests_running: Gauge::default(),
            requests_waiting: Gauge::default(),
            requests_finished: Family::default(),
            requests_rejected: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            prompt_tokens_cached: Counter::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            prompt_cache_bytes: Gauge::default(),
            prompt_cache_entries: Gauge::default(),
            mlx_active_memory_bytes: Gauge::default(),
            time_to_first_token: latency(),
            inter_token_latency: latency(),
            e2e_request_latency: latency(),
            request_queue_time: latency(),
            spec_decode_num_drafts: Counter::default(),
            spec_decode_num_draft_tokens: Counter::default(),
            spec_decode_num_accepted_tokens: Counter::default(),
            spec_decode_num_accepted_tokens_per_pos: Family::default(),
            spec_decode_fallbacks: Counter::default(),
            engine_alive: Gauge::default(),
            last_tau: Gauge::default(),
            batch_size: Gauge::default(),
            batch_rows: Histogram::new(exponential_buckets(1.0, 2.0, 9)),
        };
        let r = &mut m.registry;
        let p = |name: &str| format!("mlx_spec:{name}");
        r.register(p("num_requests_running"), "Requests the engine is generating for", m.requests_running.clone());
        r.register(p("num_requests_waiting"), "Requests waiting for the engine", m.requests_waiting.clone());
        r.register(p("request_success"), "Finished requests by finished_reason", m.requests_finished.clone());
        r.register(p("request_rejected"), "Requests refused with 503: queue full", m.requests_rejected.clone());
        r.register(p("prompt_tokens"), "Prompt tokens (cached ones included)", m.prompt_tokens.clone());
        r.register(p("generation_tokens"), "Generated tokens", m.generation_tokens.clone());
        r.register(
            p("prompt_tokens_cached"),
            "Prompt tokens served from the prompt cache",
            m.prompt_tokens_cached.clone(),
        );
        r.register(p("prefix_cache_queries"), "Prompt-cache queries, in tokens", m.prefix_cache_queries.clone());
        r.register(p("prefix_cache_hits"), "Prompt-cache hits, in tokens", m.prefix_cache_hits.clone());
        r.register(p("prompt_cache_bytes"), "Bytes held by the prompt cache", m.prompt_cache_bytes.clone());
        r.register(p("prompt_cache_entries"), "Entries in the prompt cache", m.prompt_cache_entries.clone());
        r.register(p("mlx_active_memory_bytes"), "MLX bytes held by live arrays", m.mlx_active_memory_bytes.clone());
        r.register(p("time_to_first_token_seconds"), "Arrival to first token", m.time_to_first_token.clone());
        r.register(p("inter_token_latency_seconds"), "Time between tokens", m.inter_token_latency.clone());
        r.register(p("e2e_request_latency_seconds"), "Arrival to last token", m.e2e_request_latency.clone());
        r.register(p("request_queue_time_seconds"), "Time in the queue", m.request_queue_time.clone());
        r.register(p("spec_decode_num_drafts"), "Verify rounds with drafts", m.spec_decode_num_drafts.clone());
        r.register(p("spec_decode_num_draft_tokens"), "Draft tokens verified", m.spec_decode_num_draft_tokens.clone());
        r.register(
            p("spec_decode_num_accepted_tokens"),
            "Draft tokens accepted",
            m.spec_decode_num_accepted_tokens.clone(),
        );
        r.register(
            p("spec_decode_num_accepted_tokens_per_pos"),
            "Draft tokens accepted by position in the block",
            m.spec_decode_num_accepted_tokens_per_pos.clone(),
        );
        r.register(
            p("spec_decode_fallbacks"),
            "Requests that fell back to plain decoding",
            m.spec_decode_fallbacks.clone(),
        );
        r.register(p("engine_alive"), "1 while the engine thread runs with the model loaded", m.engine_alive.clone());
        r.register(p("last_request_tau"), "Mean acceptance length of the last request", m.last_tau.clone());
        r.register(p("batch_size"), "Requests in the last batched target forward", m.batch_size.clone());
        r.register(
            p("batch_rows"),
            "Rows (verify-window tokens of all requests) per batched forward",
            m.batch_rows.clone(),
        );
        m
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }

    /// Counts one finished request with reason `reason`.
    pub fn finished(&self, reason: &str) {
        self.requests_finished.get_or_create(&vec![("finished_reason".to_string(), reason.to_string())]).inc();
    }

    /// Adds `accepted_by_pos[j]` to position `j`'s counter.
    pub fn accepted_per_pos(&self, accepted_by_pos: &[usize]) {
        for (j, &n) in accepted_by_pos.iter().enumerate() {
            if n > 0 {
                let labels = vec![("position".to_string(), j.to_string())];
                self.spec_decode_num_accepted_tokens_per_pos.get_or_create(&labels).inc_by(n as u64);
            }
        }
    }
}

/// Reads one sample from a Prometheus text exposition: the value of the line that starts with
/// `series` followed by a space (`series` may carry labels: `name{position="0"}`). For tests
/// and tools.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_prefix_and_vllm_shapes() {
        let m = Metrics::new();
        m.prompt_tokens.inc_by(7);
        m.requests_running.set(1);
        m.accepted_per_pos(&[3, 0, 1]);
        m.finished("stop");
        m.time_to_first_token.observe(0.01);
        let text = m.render();
        assert_eq!(sample(&text, "mlx_spec:prompt_tokens_total"), Some(7.0), "{text}");
        assert_eq!(sample(&text, "mlx_spec:num_requests_running"), Some(1.0));
        assert_eq!(sample(&text, r#"mlx_spec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}"#), Some(3.0));
        assert_eq!(sample(&text, r#"mlx_spec:spec_decode_num_accepted_tokens_per_pos_total{position="1"}"#), None);
        assert_eq!(sample(&text, r#"mlx_spec:request_success_total{finished_reason="stop"}"#), Some(1.0));
        assert_eq!(sample(&text, "mlx_spec:time_to_first_token_seconds_count"), Some(1.0));
        for name in ["spec_decode_num_drafts_total", "spec_decode_fallbacks_total", "prefix_cache_hits_total"] {
            assert!(text.contains(&format!("mlx_spec:{name}")), "{name}");
        }
        // Two servers in one process: separate registries.
        assert_eq!(sample(&Metrics::new().render(), "mlx_spec:prompt_tokens_total"), Some(0.0));
    }
}
