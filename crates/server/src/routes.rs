//! The HTTP surface: routes, Bearer auth, CORS, the body limit, and the request flow
//! (parse and validate, tokenize off the engine thread, submit, answer as JSON or SSE).
//!
//! | Route | |
//! |---|---|
//! | `POST /v1/chat/completions` (and `/chat/completions`) | chat, streaming or not |
//! | `POST /v1/completions` (and `/completions`) | text completion, streaming or not |
//! | `GET /v1/models` (and `/models`) | the one served model |
//! | `GET /health` (and `/v1/health`) | 200 `{"status": "ok"}` while the engine is ready, else 503; no key needed |
//! | `GET /metrics` | Prometheus text |
//!
//! SSE streams: `data: {json}` events with the same `id` on every chunk, the role only in the
//! first chat delta, `:` comment keep-alives, an in-stream OpenAI error event on failure, and
//! `data: [DONE]` last. With `stream_options.include_usage`, every chunk carries
//! `"usage": null` and one last chunk with `"choices": []` carries the usage.
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use models::tokenizer::{ChatMessage, Tokenizer};
use serde_json::{Map, Value, json};
use spec::providers::DraftKind;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

use crate::config::{BODY_LIMIT, KEEP_ALIVE};
use crate::engine::{EngineHandle, Event, Finish, Health, JobSpec, Summary, Ticket, Token};
use crate::error::ApiError;
use crate::openai::{
    ChatRequest, CompletionRequest, FinishReason, GenRequest, Limits, Prompt, Timings, TokenLogprob, Usage,
    chat_logprobs, completion_logprobs, parse_body,
};
use crate::stop::StopMatcher;

/// What every handler shares.
#[derive(Debug)]
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The target's tokenizer (and chat template).
    pub tokenizer: Arc<Tokenizer>,
    /// Validation limits and the served name.
    pub limits: Limits,
    /// `--chat-template-args`.
    pub template_args: Map<String, Value>,
    /// `--api-key`.
    pub api_key: Option<String>,
    /// The model's context length (`max_position_embeddings`), if it states one.
    pub context: Option<usize>,
    /// The drafter kinds a request may name.
    pub kinds: Vec<DraftKind>,
    /// `--allowed-origins`.
    pub allowed_origins: Vec<String>,
    /// Unix seconds the server started (`created` of `/v1/models`).
    pub created: u64,
}

/// The router with every route and layer.
pub fn router(state: Arc<AppState>) -> Router {
    let cors = if state.allowed_origins.iter().any(|o| o == "*") {
        CorsLayer::new().allow_origin(Any)
    } else {
        let origins: Vec<HeaderValue> =
            state.allowed_origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()).collect();
        CorsLayer::new().allow_origin(AllowOrigin::list(origins))
    }
    .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
    .allow_headers(Any);
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/models", get(list_models))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed("method not allowed on this route".into()) })
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(cors)
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

async fn auth(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let open = matches!(req.uri().path(), "/health" | "/v1/health") || req.method() == Method::OPTIONS;
    if let Some(key) = s.api_key.as_deref()
        && !open
    {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let ok = given.and_then(|v| v.strip_prefix("Bearer ")).is_some_and(|k| k.trim() == key);
        if !ok {
            return ApiError::Unauthorized("invalid or missing API key (Authorization: Bearer KEY)".into())
                .into_response();
        }
    }
    next.run(req).await
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    match s.engine.health() {
        Health::Ready => (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response(),
        Health::Loading => ApiError::Unavailable("the model is loading".into()).into_response(),
        Health::Dead(why) => ApiError::Unavailable(format!("the engine is not running: {why}")).into_response(),
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let body = s.engine.metrics().render();
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], body).into_response()
}

async fn list_models(State(s): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{
        "id": s.limits.served_model_name, "object": "model", "created": s.created, "owned_by": "mlx-spec",
    }]}))
    .into_response()
}

/// Which endpoint a request came through (shapes the answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
}

async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    chat_inner(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    completion_inner(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::Internal(format!("tokenizing failed: {e}")))?
}

async fn chat_inner(s: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let request: ChatRequest = parse_body(&body)?;
    let kwargs = request.chat_template_kwargs.clone().unwrap_or_default();
    let (req, messages) = request.validate(&s.limits)?;
    let state = s.clone();
    let prompt = blocking(move || render_chat(&state, &messages, kwargs)).await?;
    generate(s, req, prompt, Endpoint::Chat, "messages").await
}

fn render_chat(s: &AppState, messages: &[ChatMessage], kwargs: Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let tok = &s.tokenizer;
    if tok.chat_template().is_none() {
        return Err(ApiError::bad_request(
            "this model has no chat template: use /v1/completions, or start the server with --chat-template",
        ));
    }
    let mut extra = s.template_args.clone();
    extra.extend(kwargs);
    // The template's own errors (`raise_exception("roles must alternate")`) are the client's.
    let text =
        tok.apply_chat_template_with(messages, true, &extra).map_err(|e| ApiError::bad("messages", e.to_string()))?;
    tok.encode(&text, false).map_err(|e| ApiError::bad("messages", format!("tokenizing the prompt: {e}")))
}

async fn completion_inner(s: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse_body(&body)?;
    let (req, prompt) = request.validate(&s.limits)?;
    let prompt = match prompt {
        Prompt::Tokens(ids) => {
            let vocab = s.tokenizer.vocab_size();
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::bad("prompt", format!("prompt: token id {bad} is outside the vocabulary")));
            }
            ids
        }
        Prompt::Text(text) => {
            let tok = s.tokenizer.clone();
            blocking(move || {
                tok.encode(&text, true).map_err(|e| ApiError::bad("prompt", format!("tokenizing the prompt: {e}")))
            })
            .await?
        }
        Prompt::Texts(_) | Prompt::TokenLists(_) => unreachable!("validate keeps one prompt"),
    };
    generate(s, req, prompt, Endpoint::Completion, "prompt").await
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn new_id(endpoint: Endpoint) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
    format!("{prefix}-{nanos:x}{n:04x}")
}

async fn generate(
    s: Arc<AppState>,
    req: GenRequest,
    prompt: Vec<u32>,
    endpoint: Endpoint,
    prompt_param: &str,
) -> Result<Response, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::bad(prompt_param, format!("{prompt_param}: the prompt has no tokens")));
    }
    if let Some(ctx) = s.context
        && prompt.len() >= ctx
    {
        return Err(ApiError::BadRequest {
            message: format!(
                "the prompt has {} tokens; this model's context is {ctx} tokens (and one more is generated)",
                prompt.len()
            ),
            param: Some(prompt_param.into()),
            code: Some("context_length_exceeded"),
        });
    }
    if let Some(kind) = req.draft_kind
        && !s.kinds.contains(&kind)
    {
        let offered: Vec<&str> = s.kinds.iter().map(|&k| k.as_str()).collect();
        return Err(ApiError::bad(
            "draft_kind",
            format!("draft_kind `{}`: this server offers {}", kind.as_str(), offered.join(", ")),
        ));
    }
    // Never past the context: the answer then ends with finish_reason "length".
    let max_tokens = s.context.map_or(req.max_tokens, |ctx| req.max_tokens.min(ctx - prompt.len()));
    let job = JobSpec {
        prompt,
        max_tokens,
        sampler: req.sampler.clone(),
        num_draft_tokens: req.num_draft_tokens,
        draft_kind: req.draft_kind,
        logprobs: req.logprobs,
        fault: req.fault,
    };
    let ticket = s.engine.submit(job)?;
    let reply =
        Reply { id: new_id(endpoint), created: unix_now(), model: s.limits.served_model_name.clone(), endpoint };
    if req.stream { Ok(stream(s, req, ticket, reply)) } else { collect(s, req, ticket, reply).await }
}

/// The fields every response and chunk of one request repeat.
#[derive(Debug, Clone)]
struct Reply {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
}

impl Reply {
    /// A stream chunk with one choice (`delta` for chat, `text` for completions).
    fn chunk(&self, content: Option<Value>, finish: Option<&str>, logprobs: Value, usage: bool) -> Value {
        let mut choice = json!({"index": 0, "logprobs": logprobs, "finish_reason": finish});
        let object = match self.endpoint {
            Endpoint::Chat => {
                choice["delta"] = content.unwrap_or_else(|| json!({}));
                "chat.completion.chunk"
            }
            Endpoint::Completion => {
                choice["text"] = content.unwrap_or_else(|| json!(""));
                "text_completion"
            }
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
                           "choices": [choice]});
        if usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn text_content(&self, text: &str) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!({"content": text}),
            Endpoint::Completion => json!(text),
        }
    }

    fn logprobs(&self, entries: &[TokenLogprob], offset: usize) -> Value {
        match self.endpoint {
            Endpoint::Chat => chat_logprobs(entries),
            Endpoint::Completion => completion_logprobs(entries, offset),
        }
    }
}

/// Turns tokens into released text: the tokenizer's stream decoder, then the stop matcher.
struct Assembly<'t> {
    tokenizer: &'t Tokenizer,
    decoder: models::tokenizer::StreamDecoder<'t>,
    stop: StopMatcher,
    /// Tokens consumed (up to the one that completed a stop string).
    tokens: usize,
    logprobs: bool,
}

impl<'t> Assembly<'t> {
    fn new(tokenizer: &'t Tokenizer, stops: Vec<String>, logprobs: bool) -> Self {
        Assembly {
            tokenizer,
            decoder: tokenizer.stream_decoder(true),
            stop: StopMatcher::new(stops),
            tokens: 0,
            logprobs,
        }
    }

    /// The text `t` releases, its log-probabilities, and whether a stop string matched.
    fn push(&mut self, t: &Token) -> Result<(String, Option<TokenLogprob>, bool), ApiError> {
        if self.stop.stopped() {
            return Ok((String::new(), None, true));
        }
        self.tokens += 1;
        let piece = self.decoder.push(t.id).map_err(|e| ApiError::Internal(format!("detokenizing: {e}")))?;
        let released = self.stop.push(&piece);
        let lp = match (&t.logprobs, self.logprobs) {
            (Some(lp), true) => Some(TokenLogprob {
                token: self.piece(t.id),
                logprob: lp.logprob,
                top: lp.top.iter().map(|&(id, l)| (self.piece(id), l)).collect(),
            }),
            _ => None,
        };
        Ok((released.text, lp, released.stopped))
    }

    fn piece(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// The text still held at the end (nothing after a stop string).
    fn finish(&mut self) -> Result<String, ApiError> {
        if self.stop.stopped() {
            return Ok(String::new());
        }
        let tail = self.decoder.finish().map_err(|e| ApiError::Internal(format!("detokenizing: {e}")))?;
        let mut text = self.stop.push(&tail).text;
        text.push_str(&self.stop.finish());
        Ok(text)
    }

    fn finish_reason(&self, summary: &Summary) -> FinishReason {
        match summary.finish {
            Some(Finish::MaxTokens) if !self.stop.stopped() => FinishReason::Length,
            _ => FinishReason::Stop,
        }
    }

    fn usage(&self, summary: &Summary) -> (Usage, Timings) {
        let usage = Usage {
            prompt_tokens: summary.prompt_tokens,
            cached_tokens: summary.cached_tokens,
            completion_tokens: self.tokens,
        };
        let timings = Timings {
            prompt_n: summary.prompt_tokens - summary.cached_tokens,
            cache_n: summary.cached_tokens,
            prompt_ms: summary.prefill_ms,
            // What the engine generated (the metrics count the same): with a stop string, a
            // round can run past the token that completed it.
            predicted_n: summary.completion_tokens,
            predicted_ms: summary.decode_ms,
            draft_n: summary.drafted,
            draft_n_accepted: summary.accepted,
            tau: summary.tau,
        };
        (usage, timings)
    }
}

const ENGINE_GONE: &str = "the engine stopped before the request finished";

async fn collect(s: Arc<AppState>, req: GenRequest, mut ticket: Ticket, reply: Reply) -> Result<Response, ApiError> {
    let mut asm = Assembly::new(&s.tokenizer, req.stop.clone(), req.logprobs.is_some());
    let mut text = String::new();
    let mut logprobs = Vec::new();
    let summary = loop {
        match ticket.events.recv().await {
            Some(Event::Token(t)) => {
                if asm.stop.stopped() {
                    continue;
                }
                let (piece, lp, stopped) = asm.push(&t)?;
                text.push_str(&piece);
                logprobs.extend(lp);
                if stopped {
                    ticket.cancel.stop();
                }
            }
            Some(Event::Done(summary)) => break summary,
            Some(Event::Failed(m)) => return Err(ApiError::Internal(m)),
            None => return Err(ApiError::Unavailable(ENGINE_GONE.into())),
        }
    };
    text.push_str(&asm.finish()?);
    let (usage, timings) = asm.usage(&summary);
    let finish = asm.finish_reason(&summary).as_str();
    let lp = if req.logprobs.is_some() { reply.logprobs(&logprobs, 0) } else { Value::Null };
    let choice = match reply.endpoint {
        Endpoint::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text, "refusal": null},
                                 "logprobs": lp, "finish_reason": finish}),
        Endpoint::Completion => json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}),
    };
    let object = if reply.endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" };
    Ok(axum::Json(json!({
        "id": reply.id, "object": object, "created": reply.created, "model": reply.model,
        "choices": [choice], "usage": usage.to_json(), "timings": timings.to_json(),
    }))
    .into_response())
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn stream(s: Arc<AppState>, req: GenRequest, ticket: Ticket, reply: Reply) -> Response {
    let (tx, rx) = mpsc::channel::<SseEvent>(32);
    tokio::spawn(async move {
        // Ends when the client goes away (a send fails): dropping the ticket cancels the job.
        let _ = pump(&s, &req, ticket, &reply, &tx).await;
    });
    let body = ReceiverStream::new(rx).map(Ok::<_, Infallible>);
    let mut response =
        Sse::new(body).keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive")).into_response();
    response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Sends one request's SSE events into `tx`; `Err(())` when the client is gone.
async fn pump(
    s: &AppState,
    req: &GenRequest,
    mut ticket: Ticket,
    reply: &Reply,
    tx: &mpsc::Sender<SseEvent>,
) -> Result<(), ()> {
    let send = |v: Value| async move { tx.send(data(&v)).await.map_err(|_| ()) };
    let usage_null = req.include_usage;
    if reply.endpoint == Endpoint::Chat {
        send(reply.chunk(Some(json!({"role": "assistant", "content": ""})), None, Value::Null, usage_null)).await?;
    }
    let mut asm = Assembly::new(&s.tokenizer, req.stop.clone(), req.logprobs.is_some());
    let mut offset = 0;
    let outcome = loop {
        // The body going away (hyper drops it when a write, a token or a keep-alive, fails)
        // ends the pump even while no event comes (a long prefill): dropping the ticket
        // cancels the job before its next prefill chunk.
        let event = tokio::select! {
            event = ticket.events.recv() => event,
            () = tx.closed() => return Err(()),
        };
        match event {
            Some(Event::Token(t)) => {
                if asm.stop.stopped() {
                    continue;
                }
                let (piece, lp, stopped) = match asm.push(&t) {
                    Ok(x) => x,
                    Err(e) => break Err(e),
                };
                if stopped {
                    ticket.cancel.stop();
                }
                if !piece.is_empty() || lp.is_some() {
                    let lps = lp.map_or(Value::Null, |lp| reply.logprobs(&[lp], offset));
                    offset += piece.len();
                    send(reply.chunk(Some(reply.text_content(&piece)), None, lps, usage_null)).await?;
                }
            }
            Some(Event::Done(summary)) => break Ok(summary),
            Some(Event::Failed(m)) => break Err(ApiError::Internal(m)),
            None => break Err(ApiError::Unavailable(ENGINE_GONE.into())),
        }
    };
    match outcome.and_then(|summary| Ok((asm.finish()?, summary))) {
        Ok((tail, summary)) => {
            if !tail.is_empty() {
                send(reply.chunk(Some(reply.text_content(&tail)), None, Value::Null, usage_null)).await?;
            }
            let (usage, timings) = asm.usage(&summary);
            let finish = asm.finish_reason(&summary).as_str();
            let empty = match reply.endpoint {
                Endpoint::Chat => json!({}),
                Endpoint::Completion => json!(""),
            };
            let mut last = reply.chunk(Some(empty), Some(finish), Value::Null, usage_null);
            last["timings"] = timings.to_json();
            send(last).await?;
            if req.include_usage {
                let mut u = reply.chunk(None, None, Value::Null, false);
                u["choices"] = json!([]);
                u["usage"] = usage.to_json();
                send(u).await?;
            }
        }
        Err(e) => send(e.body()).await?,
    }
    tx.send(SseEvent::default().data("[DONE]")).await.map_err(|_| ())
}
