//! The OpenAI wire format: request bodies of `POST /v1/chat/completions` and
//! `POST /v1/completions`, their validation into one [`GenRequest`], and the response and
//! stream-chunk bodies.
//!
//! Unknown fields are accepted and ignored (clients send `store`, `metadata`, `user`, ...).
//! Every parse or validation failure is an [`ApiError::BadRequest`] naming the field
//! (`param`), e.g. `messages[0].content` or `temperature`.
use models::Sampler;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use spec::providers::DraftKind;

use crate::error::ApiError;

/// The most `top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A string, or a list of them (`stop`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Every chunk carries `"usage": null`, and one last chunk with `"choices": []` carries
    /// the usage.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// One part of a message's content array: only `{"type": "text", "text": ...}` is supported.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    /// The part's type; only `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// A message's `content`: a string or an array of parts (null is allowed too).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Text parts, concatenated.
    Parts(Vec<ContentPart>),
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, `developer`, ... (passed to the chat template).
    pub role: String,
    /// The text; `null` or absent is an empty string.
    #[serde(default)]
    pub content: Option<Content>,
}

/// The sampling and control fields the two endpoints share (flattened into each request).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    /// The served model name (`--served-model-name`); any other name is a 400.
    #[serde(default)]
    pub model: Option<String>,
    /// The most tokens to generate (`--max-tokens` when absent).
    #[serde(default)]
    pub max_tokens: Option<i64>,
    /// Chat only in OpenAI's API, accepted on both; wins over `max_tokens`.
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature, `>= 0` (0 = greedy; the default).
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus mass in `(0, 1]` (1 = off; the default).
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Keep the `k` most likely tokens (0 or -1 = off; the default).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Minimum probability relative to the top token, in `[0, 1]` (0 = off).
    #[serde(default)]
    pub min_p: Option<f64>,
    /// The seed of the per-step sampling keys (default 0).
    #[serde(default)]
    pub seed: Option<i64>,
    /// Stop strings: the text ends before the first one (excluded).
    #[serde(default)]
    pub stop: Option<OneOrMany>,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options (ignored without `stream`).
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Choices per request: only 1.
    #[serde(default)]
    pub n: Option<i64>,
    /// Extension: drafts per round (0 = plain decoding; default: the server's).
    #[serde(default)]
    pub num_draft_tokens: Option<i64>,
    /// Extension: the drafter of this request: `suffix`, `ngram`, `none`, or `model` when
    /// the server loaded one.
    #[serde(default)]
    pub draft_kind: Option<String>,
    /// Test hook (only with `--test-faults`): `error`, `panic` or `kill_engine`.
    #[serde(default)]
    pub x_test_fault: Option<String>,
}

/// The body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation, rendered by the chat template.
    pub messages: Vec<Message>,
    /// Return log-probabilities of the generated tokens.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// With `logprobs`: the most likely alternatives per token, `0..=20`.
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// Extra chat template variables (`{"enable_thinking": false}`), over the server's
    /// `--chat-template-args`.
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// The fields shared with completions (read from the same body by [`parse_body`]).
    #[serde(skip)]
    pub common: Common,
}

/// A completions `prompt`: a string, one string in a list, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text, tokenized with the tokenizer's special tokens (BOS).
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
    /// A batch of texts: only one is supported.
    Texts(Vec<String>),
    /// A batch of token lists: only one is supported.
    TokenLists(Vec<Vec<u32>>),
}

/// The body of `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The prompt (no chat template).
    pub prompt: Prompt,
    /// Log-probabilities: the number of alternatives per token, `0..=20` (OpenAI's legacy
    /// meaning: present = on).
    #[serde(default)]
    pub logprobs: Option<i64>,
    /// Echo the prompt: only `false`.
    #[serde(default)]
    pub echo: Option<bool>,
    /// The fields shared with chat (read from the same body by [`parse_body`]).
    #[serde(skip)]
    pub common: Common,
}

/// An injected failure (`x_test_fault`, only with `--test-faults`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request fails with an error inside the engine.
    Error,
    /// The request panics inside the engine.
    Panic,
    /// The engine thread exits: `/health` turns 503 and every request fails.
    KillEngine,
}

/// A validated request, either endpoint: what the engine and the response writer need.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// Sampling (temperature, filters, seed).
    pub sampler: Sampler,
    /// Stop strings (non-empty strings).
    pub stop: Vec<String>,
    /// Stream as server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage` (false without `stream`).
    pub include_usage: bool,
    /// `Some(k)`: report each token's log-probability and its `k` most likely alternatives.
    pub logprobs: Option<usize>,
    /// Drafts per round for this request (`None`: the drafter's default; 0: plain decoding).
    pub num_draft_tokens: Option<usize>,
    /// The drafter for this request (`None`: the server's).
    pub draft_kind: Option<DraftKind>,
    /// An injected failure.
    pub fault: Option<Fault>,
}

/// What validation needs from the server.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The name `model` must be (besides `default` or absent).
    pub served_model_name: String,
    /// The default `max_tokens`.
    pub default_max_tokens: usize,
    /// Whether `x_test_fault` is accepted.
    pub test_faults: bool,
}

/// A request body type whose [`Common`] fields are read from the same JSON object.
pub trait WithCommon: serde::de::DeserializeOwned {
    /// Where the shared fields go.
    fn common_mut(&mut self) -> &mut Common;
}

impl WithCommon for ChatRequest {
    fn common_mut(&mut self) -> &mut Common {
        &mut self.common
    }
}

impl WithCommon for CompletionRequest {
    fn common_mut(&mut self) -> &mut Common {
        &mut self.common
    }
}

fn from_value<T: serde::de::DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            return ApiError::bad_request(format!("invalid request body: {inner}"));
        }
        ApiError::bad(path.clone(), format!("{path}: {inner}"))
    })
}

/// Parses a JSON body (whatever its content type) into `T` and its [`Common`] fields,
/// mapping every failure to a 400 naming the field.
///
/// # Errors
/// [`ApiError::BadRequest`]: `param` is the path of the field at fault (`messages[0].role`),
/// or none for malformed JSON or a body that is not an object.
pub fn parse_body<T: WithCommon>(body: &[u8]) -> Result<T, ApiError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("malformed JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("invalid request body: expected a JSON object"));
    }
    refuse_unsupported(&value)?;
    let mut request: T = from_value(&value)?;
    *request.common_mut() = from_value(&value)?;
    Ok(request)
}

/// A refused field: its name, the test for its no-op value, and why it is refused.
type Unsupported = (&'static str, fn(&Value) -> bool, &'static str);

/// Fields of the OpenAI schema that would change the
/// output and that this server does not implement, each with the test for its no-op value
/// (null counts as absent). Other fields it does not read (`user`, `metadata`, `store`,
/// `service_tier`, ...) do not change the tokens and are accepted.
const UNSUPPORTED: [Unsupported; 8] = [
    ("tools", |v| v.as_array().is_some_and(Vec::is_empty), "tool calling is not supported"),
    ("functions", |v| v.as_array().is_some_and(Vec::is_empty), "function calling is not supported"),
    ("tool_choice", |v| v == "none" || v == "auto", "tool calling is not supported"),
    ("function_call", |v| v == "none" || v == "auto", "function calling is not supported"),
    ("response_format", |v| v.get("type").is_some_and(|t| t == "text"), "only {\"type\": \"text\"} is supported"),
    ("logit_bias", |v| v.as_object().is_some_and(Map::is_empty), "logit_bias is not supported"),
    ("presence_penalty", |v| v.as_f64() == Some(0.0), "penalties are not supported (only 0)"),
    ("frequency_penalty", |v| v.as_f64() == Some(0.0), "penalties are not supported (only 0)"),
];

/// Refuses a field of [`UNSUPPORTED`] that holds anything but its no-op value, rather than
/// answering as if it had not been sent.
fn refuse_unsupported(body: &Value) -> Result<(), ApiError> {
    for (field, no_op, why) in UNSUPPORTED {
        match body.get(field) {
            None | Some(Value::Null) => {}
            Some(v) if no_op(v) => {}
            Some(v) => return Err(ApiError::bad(field, format!("{field} {v}: {why} by this server"))),
        }
    }
    Ok(())
}

fn float(param: &str, v: Option<f64>, default: f32, ok: impl Fn(f64) -> bool, want: &str) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && ok(x) => Ok(x as f32),
        Some(x) => Err(ApiError::bad(param, format!("{param} {x}: expected {want}"))),
    }
}

impl Common {
    /// Checks the shared fields. `logprobs` comes from the endpoint's own fields.
    ///
    /// # Errors
    /// [`ApiError::BadRequest`] naming the field: an unknown model (`code:
    /// "model_not_found"`), `n != 1`, negative token counts, a temperature below 0,
    /// `top_p` outside `(0, 1]`, `min_p` outside `[0, 1]`, `top_k < -1`, an empty stop string,
    /// an unknown `draft_kind`, `x_test_fault` without `--test-faults`.
    pub fn validate(self, limits: &Limits, logprobs: Option<usize>) -> Result<GenRequest, ApiError> {
        if let Some(m) = &self.model
            && m != &limits.served_model_name
            && m != "default"
        {
            return Err(ApiError::BadRequest {
                message: format!("the model `{m}` does not exist; this server serves `{}`", limits.served_model_name),
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::bad("n", format!("n {n}: only one choice per request (n = 1) is supported")));
        }
        let count = |param: &str, v: i64| {
            usize::try_from(v).map_err(|_| ApiError::bad(param, format!("{param} {v}: expected an integer >= 0")))
        };
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => count("max_completion_tokens", v)?,
            (None, Some(v)) => count("max_tokens", v)?,
            (None, None) => limits.default_max_tokens,
        };
        let temp = float("temperature", self.temperature, 0.0, |x| x >= 0.0, "a number >= 0 (0 = greedy)")?;
        let top_p = float("top_p", self.top_p, 1.0, |x| x > 0.0 && x <= 1.0, "a number in (0, 1] (1 = off)")?;
        let min_p = float("min_p", self.min_p, 0.0, |x| (0.0..=1.0).contains(&x), "a number in [0, 1] (0 = off)")?;
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) => count("top_k", k)?,
        };
        // Any 64-bit seed is accepted; negative ones are taken as their two's complement.
        let seed = self.seed.map_or(0, |s| s as u64);
        let stop = self.stop.map(OneOrMany::into_vec).unwrap_or_default();
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::bad("stop", "stop: stop strings must not be empty"));
        }
        let stream = self.stream.unwrap_or(false);
        // As mlx_lm and llama.cpp do: stream_options without stream is ignored.
        let include_usage = stream && self.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        let num_draft_tokens = self.num_draft_tokens.map(|v| count("num_draft_tokens", v)).transpose()?;
        let draft_kind = match self.draft_kind.as_deref() {
            None => None,
            Some(word) => Some(word.parse::<DraftKind>().map_err(|e| ApiError::bad("draft_kind", e))?),
        };
        let fault = match self.x_test_fault.as_deref() {
            None => None,
            Some(_) if !limits.test_faults => {
                return Err(ApiError::bad("x_test_fault", "x_test_fault needs a server started with --test-faults"));
            }
            Some("error") => Some(Fault::Error),
            Some("panic") => Some(Fault::Panic),
            Some("kill_engine") => Some(Fault::KillEngine),
            Some(other) => {
                return Err(ApiError::bad(
                    "x_test_fault",
                    format!("x_test_fault `{other}`: expected `error`, `panic` or `kill_engine`"),
                ));
            }
        };
        Ok(GenRequest {
            max_tokens,
            sampler: Sampler { temp, top_p, top_k, min_p, seed },
            stop,
            stream,
            include_usage,
            logprobs,
            num_draft_tokens,
            draft_kind,
            fault,
        })
    }
}

fn top_logprobs(param: &str, v: i64) -> Result<usize, ApiError> {
    usize::try_from(v)
        .ok()
        .filter(|&k| k <= MAX_TOP_LOGPROBS)
        .ok_or_else(|| ApiError::bad(param, format!("{param} {v}: expected an integer in 0..={MAX_TOP_LOGPROBS}")))
}

impl ChatRequest {
    /// Validates the request; returns it with the messages as the chat template takes them.
    ///
    /// # Errors
    /// As [`Common::validate`]; also an empty `messages`, a content part that is not text,
    /// `top_logprobs` outside `0..=20`.
    pub fn validate(self, limits: &Limits) -> Result<(GenRequest, Vec<models::tokenizer::ChatMessage>), ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad("messages", "messages: expected at least one message"));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.into_iter().enumerate() {
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.into_iter().enumerate() {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::bad(
                                    format!("messages[{i}].content[{j}]"),
                                    format!("content part of type `{kind}`: only text parts with `text` are supported"),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            messages.push(models::tokenizer::ChatMessage::new(m.role, content));
        }
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (true, k) => Some(k.map(|k| top_logprobs("top_logprobs", k)).transpose()?.unwrap_or(0)),
            (false, Some(k)) => {
                top_logprobs("top_logprobs", k)?;
                None
            }
            (false, None) => None,
        };
        Ok((self.common.validate(limits, logprobs)?, messages))
    }
}

impl CompletionRequest {
    /// Validates the request; returns it with its prompt.
    ///
    /// # Errors
    /// As [`Common::validate`]; also a batch of several prompts, `echo: true`, `logprobs`
    /// outside `0..=20`.
    pub fn validate(self, limits: &Limits) -> Result<(GenRequest, Prompt), ApiError> {
        let prompt = match self.prompt {
            Prompt::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
            Prompt::TokenLists(mut v) if v.len() == 1 => Prompt::Tokens(v.remove(0)),
            Prompt::Texts(_) | Prompt::TokenLists(_) => {
                return Err(ApiError::bad("prompt", "prompt: only one prompt per request is supported"));
            }
            p => p,
        };
        if self.echo == Some(true) {
            return Err(ApiError::bad("echo", "echo: true is not supported"));
        }
        let logprobs = self.logprobs.map(|k| top_logprobs("logprobs", k)).transpose()?;
        Ok((self.common.validate(limits, logprobs)?, prompt))
    }
}

/// Why a choice ended, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// `"stop"` or `"length"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// The counts of one finished request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// Prompt tokens (cached ones included).
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prompt cache.
    pub cached_tokens: usize,
    /// Tokens generated and sent (EOS excluded; with a stop string, up to the token that
    /// completed it).
    pub completion_tokens: usize,
}

impl Usage {
    /// `{"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details":
    /// {"cached_tokens"}}`.
    pub fn to_json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// llama.cpp-style `timings` of one response, with the speculative counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Prompt tokens prefilled (not from the cache).
    pub prompt_n: usize,
    /// Prompt tokens from the prompt cache.
    pub cache_n: usize,
    /// Prefill wall time, milliseconds.
    pub prompt_ms: f64,
    /// Tokens the engine generated (as `mlx_spec:generation_tokens_total` counts them; with
    /// a stop string this can exceed `usage.completion_tokens`, which stops at the token that
    /// completed it).
    pub predicted_n: usize,
    /// Decode wall time, milliseconds.
    pub predicted_ms: f64,
    /// Draft tokens verified.
    pub draft_n: usize,
    /// Draft tokens accepted.
    pub draft_n_accepted: usize,
    /// Mean tokens per verify round (accepted + 1).
    pub tau: f64,
}

impl Timings {
    /// The `timings` object: `prompt_n`, `cache_n`, `prompt_ms`, `prompt_per_second`,
    /// `predicted_n`, `predicted_ms`, `predicted_per_second`, `draft_n`, `draft_n_accepted`,
    /// `tau`.
    pub fn to_json(&self) -> Value {
        let per_s = |n: usize, ms: f64| if ms > 0.0 { n as f64 / (ms / 1e3) } else { 0.0 };
        json!({
            "prompt_n": self.prompt_n,
            "cache_n": self.cache_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_second": per_s(self.prompt_n, self.prompt_ms),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_second": per_s(self.predicted_n, self.predicted_ms),
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "tau": self.tau,
        })
    }
}

/// One generated token's log-probabilities, with its text.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability under the target's raw distribution.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(String, f32)>,
}

/// Chat's `logprobs` object: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
pub fn chat_logprobs(entries: &[TokenLogprob]) -> Value {
    let item = |t: &str, lp: f32| json!({"token": t, "logprob": lp, "bytes": t.as_bytes()});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = item(&e.token, e.logprob);
            v["top_logprobs"] = Value::Array(e.top.iter().map(|(t, lp)| item(t, *lp)).collect());
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' legacy `logprobs` object: `{"tokens", "token_logprobs", "top_logprobs",
/// "text_offset"}`; `offset` is the text length before the first entry.
pub fn completion_logprobs(entries: &[TokenLogprob], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in entries {
        text_offset.push(offset);
        offset += e.token.len();
    }
    json!({
        "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(|e| {
            Value::Object(e.top.iter().map(|(t, lp)| (t.clone(), json!(lp))).collect())
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits { served_model_name: "smol".into(), default_max_tokens: 512, test_faults: false }
    }

    fn chat(body: &str) -> Result<GenRequest, ApiError> {
        parse_body::<ChatRequest>(body.as_bytes())?.validate(&limits()).map(|(r, _)| r)
    }

    #[test]
    fn fields_that_would_change_the_output_are_refused_unless_no_op() {
        let base = r#""model": "smol", "messages": [{"role": "user", "content": "hi"}]"#;
        for (extra, field) in [
            (r#""tools": [{"type": "function", "function": {"name": "f"}}]"#, "tools"),
            (r#""tool_choice": "required""#, "tool_choice"),
            (r#""response_format": {"type": "json_object"}"#, "response_format"),
            (r#""logit_bias": {"42": 5}"#, "logit_bias"),
            (r#""presence_penalty": 0.5"#, "presence_penalty"),
            (r#""frequency_penalty": -1"#, "frequency_penalty"),
            (r#""functions": [{"name": "f"}]"#, "functions"),
            (r#""function_call": {"name": "f"}"#, "function_call"),
        ] {
            let e = chat(&format!("{{{base}, {extra}}}")).unwrap_err();
            assert_eq!(param(e).as_deref(), Some(field), "{extra}");
        }
        for extra in [
            r#""tools": []"#,
            r#""tools": null, "tool_choice": "none""#,
            r#""response_format": {"type": "text"}"#,
            r#""logit_bias": {}"#,
            r#""presence_penalty": 0, "frequency_penalty": 0.0"#,
            r#""user": "u1", "metadata": {"k": "v"}"#,
        ] {
            assert!(chat(&format!("{{{base}, {extra}}}")).is_ok(), "{extra}");
        }
    }

    fn param(e: ApiError) -> Option<String> {
        match e {
            ApiError::BadRequest { param, .. } => param,
            other => panic!("not a 400: {other:?}"),
        }
    }

    #[test]
    fn defaults_and_precedence() {
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"store":true}"#).unwrap();
        assert_eq!(r.max_tokens, 512);
        assert_eq!(r.sampler, Sampler { temp: 0.0, top_p: 1.0, top_k: 0, min_p: 0.0, seed: 0 });
        assert!(!r.stream && !r.include_usage && r.logprobs.is_none());
        let r = chat(
            r#"{"model":"smol","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],
               "max_tokens":5,"max_completion_tokens":7,"stop":"x","stream":true,
               "stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":3,
               "num_draft_tokens":0,"draft_kind":"ngram","top_k":-1,"seed":-1}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, 7);
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert!(r.stream && r.include_usage);
        assert_eq!(r.logprobs, Some(3));
        assert_eq!(r.num_draft_tokens, Some(0));
        assert_eq!(r.draft_kind, Some(DraftKind::Ngram));
        assert_eq!(r.sampler.seed, u64::MAX);
        // stream_options without stream is ignored.
        let r = chat(r#"{"messages":[{"role":"user"}],"stream_options":{"include_usage":true}}"#).unwrap();
        assert!(!r.include_usage);
    }

    #[test]
    fn client_mistakes_are_400s_naming_the_field() {
        let cases = [
            (r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":"ten"}"#, Some("max_tokens")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":-1}"#, Some("max_tokens")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"temperature":-0.5}"#, Some("temperature")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"top_p":0}"#, Some("top_p")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"min_p":2}"#, Some("min_p")),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"top_logprobs":21,"logprobs":true}"#,
                Some("top_logprobs"),
            ),
            (r#"{"messages":[{"role":"user","content":"hi"}],"stop":["a",""]}"#, Some("stop")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"n":2}"#, Some("n")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"model":"gpt-4"}"#, Some("model")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"draft_kind":"magic"}"#, Some("draft_kind")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"x_test_fault":"panic"}"#, Some("x_test_fault")),
            (r#"{"messages":[{"role":"user","content":"hi"}],"num_draft_tokens":-3}"#, Some("num_draft_tokens")),
            (r#"{"messages":[{"content":"hi"}]}"#, Some("messages[0]")),
            (r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#, Some("messages[0].content[0]")),
            (r#"{"messages":[]}"#, Some("messages")),
            (r#"{"messages": 3}"#, Some("messages")),
            (r#"{"messages":[{"role":"user","content":"hi"}]"#, None),
            (r#"[]"#, None),
        ];
        for (body, want) in cases {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST, "{body}");
            let got = param(e);
            match want {
                Some(w) => assert!(got.as_deref().is_some_and(|g| g.starts_with(w)), "{body}: {got:?}"),
                None => assert_eq!(got, None, "{body}"),
            }
        }
        let e = chat(r#"{"messages":[{"role":"user","content":"hi"}],"model":"gpt-4"}"#).unwrap_err();
        assert_eq!(e.body()["error"]["code"], "model_not_found");
    }

    #[test]
    fn completion_prompts_and_faults() {
        let lim = Limits { test_faults: true, ..limits() };
        let parse = |b: &str| parse_body::<CompletionRequest>(b.as_bytes()).and_then(|r| r.validate(&lim));
        let (r, p) = parse(r#"{"prompt":["hi"],"logprobs":2,"x_test_fault":"kill_engine"}"#).unwrap();
        assert!(matches!(p, Prompt::Text(t) if t == "hi"));
        assert_eq!((r.logprobs, r.fault), (Some(2), Some(Fault::KillEngine)));
        let (_, p) = parse(r#"{"prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(p, Prompt::Tokens(t) if t == [1, 2, 3]));
        assert_eq!(param(parse(r#"{"prompt":["a","b"]}"#).unwrap_err()).as_deref(), Some("prompt"));
        assert_eq!(param(parse(r#"{"prompt":"a","echo":true}"#).unwrap_err()).as_deref(), Some("echo"));
        assert_eq!(param(parse(r#"{"max_tokens":3}"#).unwrap_err()), None);
    }

    #[test]
    fn usage_timings_and_logprobs_shapes() {
        let u = Usage { prompt_tokens: 10, cached_tokens: 4, completion_tokens: 3 };
        assert_eq!(u.to_json()["total_tokens"], 13);
        assert_eq!(u.to_json()["prompt_tokens_details"]["cached_tokens"], 4);
        let t = Timings { predicted_n: 10, predicted_ms: 500.0, ..Timings::default() }.to_json();
        assert_eq!(t["predicted_per_second"], 20.0);
        let e = [TokenLogprob { token: "ab".into(), logprob: -0.5, top: vec![("ab".into(), -0.5)] }];
        assert_eq!(chat_logprobs(&e)["content"][0]["top_logprobs"][0]["bytes"], json!([97, 98]));
        assert_eq!(completion_logprobs(&e, 3)["text_offset"], json!([3]));
    }
}
