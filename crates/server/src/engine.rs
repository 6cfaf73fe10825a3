//! The engine thread: MLX arrays are `!Send`, so one thread (`mlx-engine`) loads and owns the
//! target, the drafters and the prompt cache, and runs the requests: one at a time
//! ([`serve_one_at_a_time`], the default of [`Backend::serve`]) or several together in one
//! batch (`SpecBackend`'s continuous batching, `--max-batch`).
//!
//! ```text
//! handler --submit--> [admission: --max-queue + running permits, else 503] --job channel--> engine
//!    ^                                                                                 |
//!    +------------- per-request unbounded event channel (Token*, Done | Failed) -------+
//! ```
//!
//! - A handler gets a [`Ticket`]: the request's events and a [`CancelOnDrop`] guard. Dropping
//!   the guard (the client went away: the handler future or the SSE body was dropped) or
//!   calling [`CancelOnDrop::cancel`] (a stop string matched) sets the request's cancel flag;
//!   the engine skips a cancelled queued job and the backend stops a running one within one
//!   prefill chunk or one round.
//! - The event channel is unbounded, so a slow client never blocks the engine.
//! - Each request runs under `catch_unwind`: an error or a panic fails that request only.
//! - If the engine thread ends (the model failed to load, an injected `kill_engine`, a panic
//!   outside a request), [`Health`] turns [`Health::Dead`], the queued jobs are dropped (their
//!   handlers see the channel close and answer an error) and later submits get a 503.
//!
//! The MLX work itself is behind the [`Backend`] trait ([`crate::backend::SpecBackend`] in
//! production), so the queueing, cancellation and fault paths are tested without a model.
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use models::Sampler;
use spec::providers::DraftKind;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::Fault;
pub use spec::{Finish, TokenLogprobs};

/// One generation request as the engine runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    /// The prompt's token ids (non-empty).
    pub prompt: Vec<u32>,
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampler: Sampler,
    /// Drafts per round (`None`: the drafter's default; 0: plain decoding).
    pub num_draft_tokens: Option<usize>,
    /// The drafter (`None`: the server's).
    pub draft_kind: Option<DraftKind>,
    /// `Some(k)`: log-probabilities with `k` alternatives per token.
    pub logprobs: Option<usize>,
    /// An injected failure (`--test-faults`).
    pub fault: Option<Fault>,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct Token {
    /// Its id.
    pub id: u32,
    /// Its log-probabilities, when asked for.
    pub logprobs: Option<TokenLogprobs>,
}

/// What a finished request reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Why it ended (`None` only in `Default`).
    pub finish: Option<Finish>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prompt cache.
    pub cached_tokens: usize,
    /// Tokens generated (EOS excluded).
    pub completion_tokens: usize,
    /// Verify rounds.
    pub rounds: usize,
    /// Rounds that carried drafts.
    pub draft_rounds: usize,
    /// Draft tokens verified.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Accepted drafts by block position.
    pub accepted_by_pos: Vec<usize>,
    /// Mean tokens per round.
    pub tau: f64,
    /// Prefill wall time, ms.
    pub prefill_ms: f64,
    /// Decode wall time, ms.
    pub decode_ms: f64,
    /// Whether it fell back to plain decoding.
    pub fell_back: bool,
}

/// What the engine sends a request's handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token.
    Token(Token),
    /// The request finished (the last event).
    Done(Summary),
    /// The request failed (the last event).
    Failed(String),
}

/// Gauges a backend reports after each request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Prompt-cache bytes.
    pub cache_bytes: usize,
    /// Prompt-cache entries.
    pub cache_entries: usize,
    /// MLX active memory, bytes.
    pub active_memory: usize,
}

/// The MLX side of the engine: lives on the engine thread (need not be `Send`).
pub trait Backend {
    /// Runs `job`, calling `on_token` with each token as soon as it is final; stops when
    /// `on_token` returns `false` ([`Finish::Stopped`]) or `cancel` is set
    /// ([`Finish::Cancelled`], checked between prefill chunks and rounds).
    ///
    /// # Errors
    /// Anything that fails the request (the message goes to the client).
    fn generate(
        &mut self,
        job: &JobSpec,
        cancel: &AtomicBool,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> anyhow::Result<Summary>;

    /// The gauges to publish after a request.
    fn gauges(&self) -> Gauges {
        Gauges::default()
    }

    /// Serves the jobs of `queue` until it closes (every sender gone, or an injected
    /// `kill_engine`). The default runs them one at a time through [`Backend::generate`]
    /// ([`serve_one_at_a_time`]); a batching backend takes new jobs between its rounds.
    fn serve(&mut self, queue: &mut dyn JobQueue)
    where
        Self: Sized,
    {
        serve_one_at_a_time(self, queue);
    }
}

/// The engine's side of [`Backend::serve`]: the queued jobs.
pub trait JobQueue {
    /// The next job to run: waits for one when `wait` (`None`: the queue closed), else
    /// `None` at once when none is queued. Cancelled jobs are skipped, injected faults
    /// handled (a failing or panicking request fails here; `kill_engine` closes the queue).
    fn next(&mut self, wait: bool) -> Option<Admitted>;

    /// Whether the queue has closed: the backend should return, dropping what it runs (their
    /// clients see the engine gone).
    fn is_closed(&self) -> bool;

    /// The server's metrics (gauges, batch shape).
    fn metrics(&self) -> &Metrics;
}

/// A job taken off the queue, as a backend runs it: its [`JobSpec`], its cancel flag, a
/// [`TokenSink`] for its tokens and [`Admitted::finish`] for its end. Dropping it unfinished
/// closes the client's event channel (the handler answers that the engine went away).
pub struct Admitted {
    job: Job,
    metrics: Arc<Metrics>,
    /// Set by [`Admitted::finish`]; a job dropped unfinished still leaves the running count.
    finished: bool,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if !self.finished {
            self.metrics.requests_running.dec();
        }
    }
}

/// Where a running request's tokens go; records time to first token and inter-token
/// latency.
pub struct TokenSink {
    events: mpsc::UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    arrived: Instant,
    last: Option<Instant>,
    metrics: Arc<Metrics>,
}

impl TokenSink {
    /// Sends `t`; `false` when the request should stop (cancelled, a stop string matched, or
    /// the client went away).
    pub fn send(&mut self, t: Token) -> bool {
        if self.cancel.load(Ordering::Relaxed) || self.stop.load(Ordering::Relaxed) || self.events.is_closed() {
            return false;
        }
        let now = Instant::now();
        match self.last {
            None => self.metrics.time_to_first_token.observe((now - self.arrived).as_secs_f64()),
            Some(prev) => self.metrics.inter_token_latency.observe((now - prev).as_secs_f64()),
        }
        self.last = Some(now);
        self.events.send(Event::Token(t)).is_ok()
    }
}

impl Admitted {
    /// The request.
    pub fn spec(&self) -> &JobSpec {
        &self.job.spec
    }

    /// Its cancel flag (set when the client goes away).
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.job.cancel.clone()
    }

    /// A sink for its tokens.
    pub fn sink(&self) -> TokenSink {
        TokenSink {
            events: self.job.events.clone(),
            cancel: self.job.cancel.clone(),
            stop: self.job.stop.clone(),
            arrived: self.job.arrived,
            last: None,
            metrics: self.metrics.clone(),
        }
    }

    /// Ends the request with `result` (an `Err` is sent to the client as the failure's
    /// message): records its metrics, frees its admission slot, then sends `Done` or
    /// `Failed`.
    pub fn finish(mut self, result: anyhow::Result<Summary>) {
        let event = record(&self.metrics, &self.job, result);
        self.metrics.requests_running.dec();
        self.finished = true;
        // Free the request's queue slot before its client hears it is done, so a client that
        // sends its next request at once finds the slot free.
        drop(self.job.permit.take());
        let _ = self.job.events.send(event);
    }
}

/// The error of a job's injected `error` or `panic` fault (`--test-faults`); the panic is
/// raised and caught as a backend's would be.
pub fn injected_failure(spec: &JobSpec) -> Option<anyhow::Error> {
    match spec.fault {
        Some(Fault::Error) => Some(anyhow::anyhow!("an injected error (x_test_fault: error)")),
        Some(Fault::Panic) => {
            let p = catch_unwind(|| panic!("an injected panic (x_test_fault: panic)")).expect_err("it panics");
            Some(panicked(p.as_ref()))
        }
        _ => None,
    }
}

/// The error a request fails with when its backend call panicked.
pub fn panicked(p: &(dyn std::any::Any + Send)) -> anyhow::Error {
    let msg = panic_message(p);
    tracing::error!("request panicked: {msg}");
    anyhow::anyhow!("the request failed inside the engine (a panic: {msg})")
}

/// [`Backend::serve`]'s default: each job in turn through [`Backend::generate`], under
/// `catch_unwind` (a panic fails that request only), gauges published after each.
pub fn serve_one_at_a_time<B: Backend>(backend: &mut B, queue: &mut dyn JobQueue) {
    while let Some(job) = queue.next(true) {
        let mut sink = job.sink();
        let result =
            catch_unwind(AssertUnwindSafe(|| backend.generate(job.spec(), &job.job.cancel, &mut |t| sink.send(t))))
                .unwrap_or_else(|p| Err(panicked(p.as_ref())));
        publish(queue.metrics(), backend.gauges());
        job.finish(result);
    }
}

/// Sets the gauge metrics from `g`: prompt-cache bytes and entries, MLX active memory (bytes).
pub fn publish(metrics: &Metrics, g: Gauges) {
    metrics.prompt_cache_bytes.set(g.cache_bytes as i64);
    metrics.prompt_cache_entries.set(g.cache_entries as i64);
    metrics.mlx_active_memory_bytes.set(g.active_memory as i64);
}

/// The engine's state as `/health` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// The model is loading (requests queue meanwhile).
    Loading,
    /// Serving.
    Ready,
    /// The engine thread has ended; the message says why.
    Dead(String),
}

struct Job {
    spec: JobSpec,
    events: mpsc::UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    arrived: Instant,
    /// Held until the engine is done with the job: admission counts waiting + running.
    permit: Option<OwnedSemaphorePermit>,
}

/// Sets a request's cancel flag when dropped (the client went away); [`CancelOnDrop::stop`]
/// ends it early on purpose (a stop string matched).
#[derive(Debug)]
pub struct CancelOnDrop {
    cancel: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl CancelOnDrop {
    /// Nothing more is wanted (a stop string matched): the engine stops at the next token
    /// ([`Finish::Stopped`]) and still reports the request's `Done`.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Cancels now, as dropping does ([`Finish::Cancelled`]).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// A submitted request: its events, and the guard that cancels it when dropped.
#[derive(Debug)]
pub struct Ticket {
    /// Token events, then `Done` or `Failed`. The channel closing without either means the
    /// engine died.
    pub events: mpsc::UnboundedReceiver<Event>,
    /// Cancels the request when dropped.
    pub cancel: CancelOnDrop,
}

/// The handlers' side of the engine: cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::UnboundedSender<Job>,
    admission: Arc<Semaphore>,
    health: Arc<Mutex<Health>>,
    metrics: Arc<Metrics>,
    /// The engine thread, taken by [`EngineHandle::finish`].
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("health", &self.health()).finish()
    }
}

/// Marks the engine dead when the thread ends, however it ends.
struct DeadOnExit {
    health: Arc<Mutex<Health>>,
    metrics: Arc<Metrics>,
    why: String,
}

impl Drop for DeadOnExit {
    fn drop(&mut self) {
        let why = if std::thread::panicking() { "the engine thread panicked".to_string() } else { self.why.clone() };
        *self.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Dead(why);
        self.metrics.engine_alive.set(0);
        self.metrics.requests_running.set(0);
        self.metrics.requests_waiting.set(0);
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_string())
}

impl EngineHandle {
    /// Starts the engine thread: it runs `load` (on the thread: the backend need not be
    /// `Send`), then serves jobs. `max_queue` requests may wait while up to `max_running`
    /// run (the backend's batch size); more get 503.
    ///
    /// # Errors
    /// The OS refused to spawn the thread.
    pub fn start<B, F>(
        load: F,
        max_queue: usize,
        max_running: usize,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<EngineHandle>
    where
        B: Backend + 'static,
        F: FnOnce() -> anyhow::Result<B> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let handle = EngineHandle {
            jobs: tx,
            admission: Arc::new(Semaphore::new(
                max_queue.saturating_add(max_running.max(1)).min(Semaphore::MAX_PERMITS),
            )),
            health: Arc::new(Mutex::new(Health::Loading)),
            metrics,
            thread: Arc::new(Mutex::new(None)),
        };
        let (health, metrics) = (handle.health.clone(), handle.metrics.clone());
        let thread =
            std::thread::Builder::new().name("mlx-engine".into()).spawn(move || run(load, rx, health, metrics))?;
        *handle.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        Ok(handle)
    }

    /// Drops this handle and waits up to `wait` for the engine thread to end; `true` when it
    /// did. Once every other handle is gone (the router's, after the server stopped), the
    /// job channel closes, the engine's loop returns and the thread drops the backend (the
    /// model's MLX arrays). A process that exits meanwhile races that teardown against MLX's
    /// static destructors: `serve` once ended with SIGABRT after SIGTERM on a loaded machine.
    pub fn finish(self, wait: Duration) -> bool {
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(self);
        let Some(thread) = thread else { return true };
        let deadline = Instant::now() + wait;
        while !thread.is_finished() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        thread.join().is_ok()
    }

    /// The engine's state.
    pub fn health(&self) -> Health {
        self.health.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The server's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Queues `spec`.
    ///
    /// # Errors
    /// [`ApiError::Overloaded`] (503, `Retry-After`) when `max_queue` requests wait already;
    /// [`ApiError::Unavailable`] (503) when the engine thread has ended.
    pub fn submit(&self, spec: JobSpec) -> Result<Ticket, ApiError> {
        if let Health::Dead(why) = self.health() {
            return Err(ApiError::Unavailable(format!("the engine is not running: {why}")));
        }
        let Ok(permit) = self.admission.clone().try_acquire_owned() else {
            self.metrics.requests_rejected.inc();
            return Err(ApiError::Overloaded("the server is busy: the request queue is full; retry later".into()));
        };
        let (events_tx, events) = mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let job = Job {
            spec,
            events: events_tx,
            cancel: cancel.clone(),
            stop: stop.clone(),
            arrived: Instant::now(),
            permit: Some(permit),
        };
        self.metrics.requests_waiting.inc();
        if self.jobs.send(job).is_err() {
            self.metrics.requests_waiting.dec();
            return Err(ApiError::Unavailable("the engine is not running".into()));
        }
        Ok(Ticket { events, cancel: CancelOnDrop { cancel, stop } })
    }
}

fn run<B: Backend, F: FnOnce() -> anyhow::Result<B>>(
    load: F,
    jobs: mpsc::UnboundedReceiver<Job>,
    health: Arc<Mutex<Health>>,
    metrics: Arc<Metrics>,
) {
    let mut guard = DeadOnExit { health: health.clone(), metrics: metrics.clone(), why: String::new() };
    let mut backend = match catch_unwind(AssertUnwindSafe(load)) {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            tracing::error!("loading the model failed: {e:#}");
            guard.why = format!("loading the model failed: {e:#}");
            return;
        }
        Err(p) => {
            guard.why = format!("loading the model panicked: {}", panic_message(p.as_ref()));
            return;
        }
    };
    *health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Ready;
    metrics.engine_alive.set(1);
    tracing::info!("engine ready");
    let mut queue = Queue { jobs: Some(jobs), health, metrics, why: None };
    backend.serve(&mut queue);
    guard.why = queue.why.unwrap_or_else(|| "the server is shutting down".into());
}

/// The engine thread's [`JobQueue`] over the job channel.
struct Queue {
    /// `None` once closed (an injected `kill_engine`): the queued jobs are dropped with it
    /// and their handlers see the channel close.
    jobs: Option<mpsc::UnboundedReceiver<Job>>,
    health: Arc<Mutex<Health>>,
    metrics: Arc<Metrics>,
    /// Why the queue closed, when it was killed.
    why: Option<String>,
}

impl JobQueue for Queue {
    fn next(&mut self, wait: bool) -> Option<Admitted> {
        loop {
            let jobs = self.jobs.as_mut()?;
            let job = if wait { jobs.blocking_recv() } else { jobs.try_recv().ok() };
            let Some(mut job) = job else {
                if wait {
                    self.jobs = None;
                }
                return None;
            };
            self.metrics.requests_waiting.dec();
            if job.cancel.load(Ordering::Relaxed) || job.events.is_closed() {
                self.metrics.finished("cancelled");
                continue;
            }
            if job.spec.fault == Some(Fault::KillEngine) {
                let why = "killed by an injected fault (x_test_fault: kill_engine)".to_string();
                // Dead before the client hears of it: its next /health must say so.
                *self.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Dead(why.clone());
                let _ = job.events.send(Event::Failed("the engine was killed (x_test_fault: kill_engine)".into()));
                self.why = Some(why);
                self.jobs = None;
                drop(job.permit.take());
                return None;
            }
            self.metrics.request_queue_time.observe(job.arrived.elapsed().as_secs_f64());
            self.metrics.requests_running.inc();
            let admitted = Admitted { job, metrics: self.metrics.clone(), finished: false };
            if let Some(e) = injected_failure(admitted.spec()) {
                admitted.finish(Err(e));
                continue;
            }
            return Some(admitted);
        }
    }

    fn is_closed(&self) -> bool {
        self.jobs.is_none()
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// Records a finished request's metrics; returns its last event.
fn record(metrics: &Metrics, job: &Job, result: anyhow::Result<Summary>) -> Event {
    metrics.e2e_request_latency.observe(job.arrived.elapsed().as_secs_f64());
    match result {
        Ok(summary) => {
            metrics.prompt_tokens.inc_by(summary.prompt_tokens as u64);
            metrics.generation_tokens.inc_by(summary.completion_tokens as u64);
            metrics.prompt_tokens_cached.inc_by(summary.cached_tokens as u64);
            metrics.prefix_cache_queries.inc_by(summary.prompt_tokens as u64);
            metrics.prefix_cache_hits.inc_by(summary.cached_tokens as u64);
            metrics.spec_decode_num_drafts.inc_by(summary.draft_rounds as u64);
            metrics.spec_decode_num_draft_tokens.inc_by(summary.drafted as u64);
            metrics.spec_decode_num_accepted_tokens.inc_by(summary.accepted as u64);
            metrics.accepted_per_pos(&summary.accepted_by_pos);
            if summary.fell_back {
                metrics.spec_decode_fallbacks.inc();
            }
            metrics.last_tau.set(summary.tau);
            let reason = match summary.finish {
                Some(Finish::Eos | Finish::Stopped) => "stop",
                Some(Finish::MaxTokens) => "length",
                Some(Finish::Cancelled) | None => "cancelled",
            };
            metrics.finished(reason);
            Event::Done(summary)
        }
        Err(e) => {
            tracing::warn!("request failed: {e:#}");
            metrics.finished("error");
            Event::Failed(format!("{e:#}"))
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use super::*;

    /// Emits `prompt[0] + 1, + 2, ...` with a pause per token; honours cancel; fails on
    /// prompt `[13]`.
    pub(crate) struct Counting {
        pub pause: Duration,
    }

    impl Backend for Counting {
        fn generate(
            &mut self,
            job: &JobSpec,
            cancel: &AtomicBool,
            on_token: &mut dyn FnMut(Token) -> bool,
        ) -> anyhow::Result<Summary> {
            anyhow::ensure!(job.prompt != [13], "unlucky prompt");
            let mut summary = Summary { prompt_tokens: job.prompt.len(), ..Summary::default() };
            for i in 0..job.max_tokens {
                if cancel.load(Ordering::Relaxed) {
                    summary.finish = Some(Finish::Cancelled);
                    return Ok(summary);
                }
                std::thread::sleep(self.pause);
                summary.completion_tokens += 1;
                if !on_token(Token { id: job.prompt[0] + 1 + i as u32, logprobs: None }) {
                    summary.finish = Some(Finish::Stopped);
                    return Ok(summary);
                }
            }
            summary.finish = Some(Finish::MaxTokens);
            Ok(summary)
        }
    }

    pub(crate) fn job(prompt: u32, max_tokens: usize) -> JobSpec {
        JobSpec {
            prompt: vec![prompt],
            max_tokens,
            sampler: Sampler::default(),
            num_draft_tokens: None,
            draft_kind: None,
            logprobs: None,
            fault: None,
        }
    }

    fn start(pause_ms: u64, max_queue: usize) -> EngineHandle {
        let pause = Duration::from_millis(pause_ms);
        EngineHandle::start(move || Ok(Counting { pause }), max_queue, 1, Arc::new(Metrics::new())).unwrap()
    }

    fn drain(t: &mut Ticket) -> (Vec<u32>, Option<Event>) {
        let mut ids = Vec::new();
        loop {
            match t.events.blocking_recv() {
                Some(Event::Token(tok)) => ids.push(tok.id),
                other => return (ids, other),
            }
        }
    }

    fn wait_for(mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            assert!(start.elapsed() < Duration::from_secs(10), "timed out");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn jobs_run_in_order_and_report() {
        let e = start(0, 4);
        let mut t = e.submit(job(10, 3)).unwrap();
        let (ids, last) = drain(&mut t);
        assert_eq!(ids, [11, 12, 13]);
        assert!(matches!(last, Some(Event::Done(s)) if s.finish == Some(Finish::MaxTokens)));
        assert_eq!(e.health(), Health::Ready);
        let text = e.metrics().render();
        assert_eq!(crate::metrics::sample(&text, "mlx_spec:generation_tokens_total"), Some(3.0));
    }

    #[test]
    fn errors_and_panics_fail_one_request_only() {
        let e = start(0, 4);
        let mut t = e.submit(JobSpec { prompt: vec![13], ..job(13, 2) }).unwrap();
        assert!(matches!(drain(&mut t).1, Some(Event::Failed(m)) if m.contains("unlucky")));
        let mut t = e.submit(JobSpec { fault: Some(Fault::Panic), ..job(1, 2) }).unwrap();
        assert!(matches!(drain(&mut t).1, Some(Event::Failed(m)) if m.contains("injected panic")));
        let mut t = e.submit(job(1, 2)).unwrap();
        assert_eq!(drain(&mut t).0, [2, 3]);
        assert_eq!(e.health(), Health::Ready);
    }

    #[test]
    fn a_killed_engine_fails_the_queue_and_refuses_new_work() {
        let e = start(20, 8);
        let mut running = e.submit(job(1, 10)).unwrap();
        let mut kill = e.submit(JobSpec { fault: Some(Fault::KillEngine), ..job(1, 1) }).unwrap();
        let mut queued = e.submit(job(1, 1)).unwrap();
        assert_eq!(drain(&mut running).0.len(), 10);
        assert!(matches!(drain(&mut kill).1, Some(Event::Failed(_))));
        assert_eq!(drain(&mut queued), (vec![], None));
        wait_for(|| matches!(e.health(), Health::Dead(_)));
        assert!(matches!(e.submit(job(1, 1)), Err(ApiError::Unavailable(_))));
    }

    #[test]
    fn the_queue_bound_gives_503_and_cancellation_frees_it() {
        let e = start(20, 1);
        let running = e.submit(job(1, 1000)).unwrap();
        let queued = e.submit(job(1, 1)).unwrap();
        assert!(matches!(e.submit(job(1, 1)), Err(ApiError::Overloaded(_))));
        // Dropping both tickets (the clients went away) stops the running job within a token
        // and skips the queued one.
        drop(running);
        drop(queued);
        wait_for(|| e.admission.available_permits() == 2);
        let mut t = e.submit(job(5, 1)).unwrap();
        assert_eq!(drain(&mut t).0, [6]);
        wait_for(|| crate::metrics::sample(&e.metrics().render(), "mlx_spec:num_requests_running") == Some(0.0));
    }

    #[test]
    fn requests_wait_while_the_model_loads() {
        let e = EngineHandle::start(
            || {
                std::thread::sleep(Duration::from_millis(300));
                Ok(Counting { pause: Duration::ZERO })
            },
            4,
            1,
            Arc::default(),
        )
        .unwrap();
        assert_eq!(e.health(), Health::Loading);
        let mut t = e.submit(job(1, 2)).unwrap();
        assert_eq!(drain(&mut t).0, [2, 3]);
        assert_eq!(e.health(), Health::Ready);
    }

    #[test]
    fn a_failed_load_is_a_dead_engine() {
        let e =
            EngineHandle::start(|| -> anyhow::Result<Counting> { anyhow::bail!("no weights") }, 1, 1, Arc::default())
                .unwrap();
        wait_for(|| matches!(e.health(), Health::Dead(_)));
        let Health::Dead(why) = e.health() else { unreachable!() };
        assert!(why.contains("no weights"), "{why}");
        assert!(matches!(e.submit(job(1, 1)), Err(ApiError::Unavailable(_))));
    }
}
