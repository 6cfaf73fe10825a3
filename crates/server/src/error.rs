//! The one error type of the HTTP layer, rendered in OpenAI's shape:
//! `{"error": {"message", "type", "param", "code"}}`.
//!
//! Every mistake a client can make is a 400 (`invalid_request_error`, with `param` naming
//! the field where there is one), never a 5xx: OpenAI clients retry 5xx and 429 twice, which
//! would repeat an expensive prefill for a request that can never succeed.
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Seconds a client is told to wait (`Retry-After`) when the queue is full.
pub const RETRY_AFTER_SECS: u64 = 1;

/// An error answered to an HTTP client.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// 400 `invalid_request_error`: the request is wrong (malformed JSON, a wrong type, a
    /// value out of range, an unknown model, a prompt longer than the context).
    #[error("{message}")]
    BadRequest {
        /// What is wrong, for a person.
        message: String,
        /// The field at fault (`messages[0].content`, `max_tokens`), if one is.
        param: Option<String>,
        /// A machine-readable code (`model_not_found`, `context_length_exceeded`), if any.
        code: Option<&'static str>,
    },
    /// 401 `authentication_error`: a missing or wrong `Authorization: Bearer` key.
    #[error("{0}")]
    Unauthorized(String),
    /// 404 `not_found_error`: no such route.
    #[error("{0}")]
    NotFound(String),
    /// 405 `invalid_request_error`: the route exists, the method does not.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// 503 `overloaded_error` with `Retry-After`: `--max-queue` requests are waiting already.
    #[error("{0}")]
    Overloaded(String),
    /// 503 `unavailable_error`: the engine thread has died (or failed to load the model).
    #[error("{0}")]
    Unavailable(String),
    /// 500 `server_error`: the request failed inside the engine (a model error or a panic).
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 naming the field `param`.
    pub fn bad(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::BadRequest { message: message.into(), param: Some(param.into()), code: None }
    }

    /// A 400 with no field to name.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::BadRequest { message: message.into(), param: None, code: None }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Overloaded(_) | ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `type` string.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } | ApiError::MethodNotAllowed(_) => "invalid_request_error",
            ApiError::Unauthorized(_) => "authentication_error",
            ApiError::NotFound(_) => "not_found_error",
            ApiError::Overloaded(_) => "overloaded_error",
            ApiError::Unavailable(_) => "unavailable_error",
            ApiError::Internal(_) => "server_error",
        }
    }

    /// The body: `{"error": {"message", "type", "param", "code"}}` (`param` and `code` may be
    /// null). Also the payload of an in-stream error event.
    pub fn body(&self) -> serde_json::Value {
        let (param, code) = match self {
            ApiError::BadRequest { param, code, .. } => (param.clone(), code.map(str::to_string)),
            ApiError::Unauthorized(_) => (None, Some("invalid_api_key".to_string())),
            _ => (None, None),
        };
        json!({"error": {"message": self.to_string(), "type": self.kind(), "param": param, "code": code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if matches!(self, ApiError::Overloaded(_)) {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
        }
        if matches!(self, ApiError::Unauthorized(_)) {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_have_the_openai_shape() {
        let e = ApiError::bad("max_tokens", "max_tokens: expected an integer >= 0");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            e.body(),
            json!({"error": {"message": "max_tokens: expected an integer >= 0", "type": "invalid_request_error",
                             "param": "max_tokens", "code": null}})
        );
        let e = ApiError::Overloaded("queue full".into());
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE);
        let r = e.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(ApiError::Unauthorized("no".into()).body()["error"]["type"], "authentication_error");
    }
}
