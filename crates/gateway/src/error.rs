//! Every way the gateway refuses or fails a request, and the one table that
//! maps each class to an HTTP status, an OpenAI error `type` and `code`, and
//! the rejection kind counted in metrics.
//!
//! Errors are classified once, where they arise (validation, auth, the
//! engine's admission answer, a failure event); nothing else in the crate
//! picks a status code.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use flotilla_proto::{DrainRefusal, EngineFailure, Rejection};
use serde_json::{Value, json};

/// A request the gateway answers with an error, in OpenAI's error shape.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or out of range (400).
    #[error("{message}")]
    Invalid {
        /// What is wrong, for the client.
        message: String,
        /// The request field at fault, when one is.
        param: Option<String>,
        /// A machine-readable code, when a specific one applies.
        code: Option<&'static str>,
    },
    /// Prompt plus completion exceed the model's context (400).
    #[error("{message}")]
    ContextLength {
        /// Names the numbers.
        message: String,
        /// `messages` or `prompt`.
        param: &'static str,
    },
    /// The `model` field names a model this server does not serve (400).
    #[error("the model '{requested}' does not exist; this server serves '{served}'")]
    ModelNotFound {
        /// What the client asked for.
        requested: String,
        /// What is served.
        served: String,
    },
    /// Missing or unknown API key while keys are configured (401).
    #[error("invalid or missing API key: send 'Authorization: Bearer <key>'")]
    Unauthorized,
    /// No such route (404).
    #[error("no route for {method} {path}")]
    NotFound {
        /// The request method.
        method: String,
        /// The request path.
        path: String,
    },
    /// The route exists but not with this method (405).
    #[error("method {method} is not allowed for {path}")]
    MethodNotAllowed {
        /// The request method.
        method: String,
        /// The request path.
        path: String,
    },
    /// An admin endpoint while the config names no admin keys (403).
    #[error(
        "admin endpoints are off: list keys in admin_keys of the [cluster] section of the router's config"
    )]
    AdminOff,
    /// An admin endpoint without a valid admin key (401).
    #[error("invalid or missing admin key: send 'Authorization: Bearer <admin key>'")]
    AdminUnauthorized,
    /// `/metrics` without one of the config's detail keys (401).
    #[error(
        "invalid or missing key for the server's metrics: send 'Authorization: Bearer <a key of \
         [telemetry] detail_keys>'"
    )]
    DetailUnauthorized,
    /// A drain the Router would not ask for (404 no such node or no
    /// nodes at all, 409 a node not up).
    #[error(transparent)]
    Drain(DrainRefusal),
    /// The body is larger than the configured limit (413).
    #[error("request body is larger than the limit of {limit_bytes} bytes")]
    BodyTooLarge {
        /// The limit, bytes.
        limit_bytes: usize,
    },
    /// The engine refused the request at admission (429, 503 or 400).
    #[error(transparent)]
    Rejected(Rejection),
    /// The engine accepted the request and then failed it (503, 400 or 500).
    #[error(transparent)]
    Failed(EngineFailure),
}

/// How one error class is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorClass {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI error `type`.
    pub kind: &'static str,
    /// OpenAI error `code`.
    pub code: &'static str,
    /// The rejection kind for `Metrics::request_rejected`; `None` for
    /// failures of accepted requests, which are not refusals.
    pub metric: Option<&'static str>,
    /// Seconds for a `Retry-After` header, when a retry may succeed.
    pub retry_after_s: Option<u32>,
}

const INVALID: &str = "invalid_request_error";
const SERVER: &str = "server_error";

impl ApiError {
    /// A 400 about one request field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            message: message.into(),
            param: Some(param.to_owned()),
            code: None,
        }
    }

    /// A 400 about the request as a whole (body, encoding).
    pub fn invalid_body(message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// A 400 for a parameter this server does not implement.
    pub fn unsupported(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::Invalid {
            message: message.into(),
            param: Some(param.to_owned()),
            code: Some("unsupported_parameter"),
        }
    }

    /// The one status/type/code table.
    pub fn class(&self) -> ErrorClass {
        use StatusCode as S;
        let c = |status, kind, code, metric: Option<&'static str>| ErrorClass {
            status,
            kind,
            code,
            metric,
            retry_after_s: None,
        };
        match self {
            ApiError::Invalid { code, .. } => c(
                S::BAD_REQUEST,
                INVALID,
                code.unwrap_or("invalid_request"),
                Some("invalid"),
            ),
            ApiError::ContextLength { .. } => c(
                S::BAD_REQUEST,
                INVALID,
                "context_length_exceeded",
                Some("invalid"),
            ),
            ApiError::ModelNotFound { .. } => {
                c(S::BAD_REQUEST, INVALID, "model_not_found", Some("invalid"))
            }
            ApiError::Unauthorized => c(
                S::UNAUTHORIZED,
                INVALID,
                "invalid_api_key",
                Some("unauthorized"),
            ),
            ApiError::NotFound { .. } => c(S::NOT_FOUND, INVALID, "not_found", Some("invalid")),
            ApiError::MethodNotAllowed { .. } => c(
                S::METHOD_NOT_ALLOWED,
                INVALID,
                "method_not_allowed",
                Some("invalid"),
            ),
            ApiError::AdminOff => c(
                S::FORBIDDEN,
                INVALID,
                "admin_disabled",
                Some("unauthorized"),
            ),
            ApiError::AdminUnauthorized => c(
                S::UNAUTHORIZED,
                INVALID,
                "invalid_admin_key",
                Some("unauthorized"),
            ),
            ApiError::DetailUnauthorized => c(
                S::UNAUTHORIZED,
                INVALID,
                "invalid_detail_key",
                Some("unauthorized"),
            ),
            ApiError::Drain(DrainRefusal::NotUp(_)) => {
                c(S::CONFLICT, INVALID, "node_not_up", Some("invalid"))
            }
            ApiError::Drain(DrainRefusal::UnknownNode { .. } | DrainRefusal::NoNodes) => {
                c(S::NOT_FOUND, INVALID, "node_not_found", Some("invalid"))
            }
            ApiError::BodyTooLarge { .. } => c(
                S::PAYLOAD_TOO_LARGE,
                INVALID,
                "request_too_large",
                Some("too_large"),
            ),
            ApiError::Rejected(r) => match r {
                Rejection::TenantLimit { retry_after_s, .. } => ErrorClass {
                    retry_after_s: Some(*retry_after_s),
                    ..c(
                        S::TOO_MANY_REQUESTS,
                        "rate_limit_error",
                        "rate_limit_exceeded",
                        Some("tenant_limit"),
                    )
                },
                Rejection::QueueFull { retry_after_s, .. } => ErrorClass {
                    retry_after_s: Some(*retry_after_s),
                    ..c(
                        S::SERVICE_UNAVAILABLE,
                        SERVER,
                        "queue_full",
                        Some("queue_full"),
                    )
                },
                Rejection::TooLong { .. } => c(
                    S::BAD_REQUEST,
                    INVALID,
                    "context_length_exceeded",
                    Some("invalid"),
                ),
                Rejection::Invalid(_) => {
                    c(S::BAD_REQUEST, INVALID, "invalid_request", Some("invalid"))
                }
                Rejection::Unavailable => c(
                    S::SERVICE_UNAVAILABLE,
                    SERVER,
                    "engine_unavailable",
                    Some("unavailable"),
                ),
            },
            ApiError::Failed(f) => match f {
                EngineFailure::QueueTimeout { .. } => {
                    c(S::SERVICE_UNAVAILABLE, SERVER, "queue_timeout", None)
                }
                EngineFailure::ShuttingDown => {
                    c(S::SERVICE_UNAVAILABLE, SERVER, "shutting_down", None)
                }
                EngineFailure::TooLargeForCache { .. } => {
                    c(S::BAD_REQUEST, INVALID, "too_large_for_kv_cache", None)
                }
                EngineFailure::Internal(_) => {
                    c(S::INTERNAL_SERVER_ERROR, SERVER, "internal_error", None)
                }
                EngineFailure::KvTransfer(_) => {
                    c(S::SERVICE_UNAVAILABLE, SERVER, "kv_transfer_failed", None)
                }
                EngineFailure::RouterLost(_) => {
                    c(S::SERVICE_UNAVAILABLE, SERVER, "worker_lost", None)
                }
                EngineFailure::EngineLost(_) => {
                    c(S::SERVICE_UNAVAILABLE, SERVER, "engine_lost", None)
                }
            },
        }
    }

    /// The field at fault, if any.
    fn param(&self) -> Option<&str> {
        match self {
            ApiError::Invalid { param, .. } => param.as_deref(),
            ApiError::ContextLength { param, .. } => Some(param),
            ApiError::Rejected(Rejection::TooLong { .. }) => Some("max_tokens"),
            ApiError::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    /// The `{"error": {...}}` body, also sent as an SSE event when a stream fails.
    pub fn body(&self) -> Value {
        let class = self.class();
        json!({
            "error": {
                "message": self.to_string(),
                "type": class.kind,
                "param": self.param(),
                "code": class.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let class = self.class();
        let mut resp = (class.status, axum::Json(self.body())).into_response();
        if let Some(s) = class.retry_after_s {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s.max(1)));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_client_error_is_a_5xx_and_retries_carry_retry_after() {
        let client = [
            ApiError::invalid("x", "bad"),
            ApiError::Unauthorized,
            ApiError::AdminOff,
            ApiError::AdminUnauthorized,
            ApiError::Drain(DrainRefusal::NoNodes),
            ApiError::Drain(DrainRefusal::NotUp("w".into())),
            ApiError::BodyTooLarge { limit_bytes: 1 },
            ApiError::ModelNotFound {
                requested: "a".into(),
                served: "b".into(),
            },
        ];
        for e in client {
            assert!(e.class().status.is_client_error(), "{e:?}");
            assert!(e.class().metric.is_some());
        }
        let r = ApiError::Rejected(Rejection::TenantLimit {
            tenant: "t".into(),
            reason: "r".into(),
            retry_after_s: 0,
        })
        .into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let b = ApiError::ModelNotFound {
            requested: "a".into(),
            served: "b".into(),
        }
        .body();
        assert_eq!(b["error"]["code"], "model_not_found");
        assert_eq!(b["error"]["param"], "model");
    }
}
