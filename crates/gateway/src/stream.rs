//! Answers for accepted requests: the SSE stream and the one-shot JSON body,
//! in OpenAI's shapes.
//!
//! Both own the engine's `RequestStream` inside the response future or body
//! stream, never in a detached task: when the client goes away, hyper drops
//! the future or body and with it the stream, which cancels the request in
//! the engine. A stop-string match drops it at once for the same reason.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use flotilla_engine::RequestStream;
use flotilla_proto::{EngineEvent, EngineFailure, FinishReason, Usage};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::openai::Endpoint;
use crate::text::{Assembler, Delta, TokenLogprob};
use crate::tools::{Collected, ToolCallParser, ToolEvent};

/// A stream with no event for this long gets an SSE comment, so a client
/// that went away while the request queues is noticed (the write fails).
const KEEPALIVE: Duration = Duration::from_secs(10);

/// What every response chunk repeats.
pub struct Meta {
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Which API shape.
    pub endpoint: Endpoint,
    /// Send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Log-probabilities were asked for.
    pub logprobs: bool,
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// Reads tool calls out of the text (chat with tools).
    pub tools: Option<ToolCallParser>,
    /// The request's HTTP span when it is traced; ends when the response
    /// does (or the client goes away).
    pub span: Option<ReqSpan>,
    /// Where the time to the first token sent is recorded: the metrics,
    /// the tier's name and when the request came in; taken at the first
    /// token.
    pub first: Option<(
        std::sync::Arc<flotilla_telemetry::Metrics>,
        String,
        std::time::Instant,
    )>,
    /// The tenant's place among its live requests, given back when the
    /// response (and so this) is dropped.
    pub slot: Option<crate::limits::TenantSlot>,
}

/// A traced request's server span.
pub struct ReqSpan {
    /// The span.
    pub span: flotilla_telemetry::ServerSpan,
    /// How the request ended (`finished`, `failed`, `refused`) if it did
    /// before the span; a span dropped without an end is a client that
    /// went away (`cancelled`).
    pub ended: Option<&'static str>,
}

impl Drop for ReqSpan {
    fn drop(&mut self) {
        let end = self.ended.unwrap_or("cancelled");
        self.span
            .set(vec![flotilla_telemetry::KeyValue::new("flotilla.end", end)]);
    }
}

impl Meta {
    /// Notes on the request's span what a step sent: the first token, the
    /// end and its counts, or the failure.
    fn trace_step(&mut self, step: &Step) {
        use flotilla_telemetry::KeyValue;
        let mut ttft = None;
        if matches!(step, Step::Text(_) | Step::Done { .. })
            && let Some((m, tier, arrival)) = self.first.take()
        {
            let s = arrival.elapsed().as_secs_f64();
            m.http_ttft(&tier, s);
            ttft = Some(s);
        }
        let Some(t) = &mut self.span else { return };
        if let Some(s) = ttft {
            t.span.event("first_token", Vec::new());
            t.span.set(vec![KeyValue::new("flotilla.ttft_ms", s * 1e3)]);
        }
        match step {
            Step::Done { reason, usage, .. } => {
                t.ended = Some("finished");
                t.span.set(vec![
                    KeyValue::new(
                        "gen_ai.response.finish_reasons",
                        finish_str(*reason, &self.tools),
                    ),
                    KeyValue::new("gen_ai.usage.input_tokens", i64::from(usage.prompt_tokens)),
                    KeyValue::new(
                        "gen_ai.usage.output_tokens",
                        i64::from(usage.completion_tokens),
                    ),
                    KeyValue::new("flotilla.cached_tokens", i64::from(usage.cached_tokens)),
                ]);
            }
            Step::Fail(f) => {
                t.ended = Some("failed");
                t.span.fail(f.to_string());
            }
            Step::Text(_) | Step::Idle => {}
        }
    }
}

/// Why a request ended, as the response says it: `tool_calls` when the
/// model stopped after calling tools.
fn finish_str(reason: FinishReason, tools: &Option<ToolCallParser>) -> &'static str {
    match tools {
        Some(p) if p.calls() > 0 && reason == FinishReason::Stop => "tool_calls",
        _ => reason.as_str(),
    }
}

/// The text pieces of one token, through the tool parser when there is one.
fn events(tools: &mut Option<ToolCallParser>, text: &str, last: bool) -> Vec<ToolEvent> {
    match tools {
        None if text.is_empty() => Vec::new(),
        None => vec![ToolEvent::Content(text.to_owned())],
        Some(p) => {
            let mut ev = p.push(text);
            if last {
                ev.extend(p.finish());
            }
            ev
        }
    }
}

/// One step of an accepted request.
enum Step {
    /// Text and log-probabilities of one token.
    Text(Delta),
    /// The end: the last text, why, and the counts.
    Done {
        last: Delta,
        reason: FinishReason,
        usage: Usage,
    },
    /// The engine failed the request.
    Fail(EngineFailure),
    /// Nothing for a while (streams only).
    Idle,
}

async fn next_step(
    rs: &mut RequestStream,
    asm: &mut Assembler,
    meta: &Meta,
    idle: Option<Duration>,
) -> Step {
    let ev = match idle {
        Some(d) => match tokio::time::timeout(d, rs.recv()).await {
            Ok(ev) => ev,
            Err(_) => return Step::Idle,
        },
        None => rs.recv().await,
    };
    match ev {
        Some(EngineEvent::Token(s)) => {
            let d = asm.push(&s);
            if d.stopped {
                rs.ended_by_stop_string();
                let usage = Usage {
                    prompt_tokens: meta.prompt_tokens,
                    completion_tokens: asm.tokens(),
                    cached_tokens: 0,
                };
                return Step::Done {
                    last: d,
                    reason: FinishReason::Stop,
                    usage,
                };
            }
            Step::Text(d)
        }
        Some(EngineEvent::Finished { reason, usage }) => Step::Done {
            last: asm.finish(),
            reason,
            usage: Usage {
                prompt_tokens: meta.prompt_tokens,
                ..usage
            },
        },
        Some(EngineEvent::Failed(f)) => Step::Fail(f),
        None => Step::Fail(EngineFailure::Internal(
            "the engine ended the request without a result".into(),
        )),
    }
}

/// The end of a request whose tool parser has read the one call allowed:
/// the rest is not wanted, so the request ends here as a stop string ends it.
fn tools_done(rs: &mut RequestStream, asm: &Assembler, meta: &Meta) -> Option<Step> {
    if !meta.tools.as_ref().is_some_and(ToolCallParser::done) {
        return None;
    }
    rs.ended_by_stop_string();
    Some(Step::Done {
        last: Delta::default(),
        reason: FinishReason::Stop,
        usage: Usage {
            prompt_tokens: meta.prompt_tokens,
            completion_tokens: asm.tokens(),
            cached_tokens: 0,
        },
    })
}

/// Waits for the whole completion and answers with one JSON body.
pub async fn collect(mut rs: RequestStream, mut asm: Assembler, mut meta: Meta) -> Response {
    let mut out = Collected::default();
    let mut lps: Vec<TokenLogprob> = Vec::new();
    loop {
        let mut step = next_step(&mut rs, &mut asm, &meta, None).await;
        meta.trace_step(&step);
        if let Step::Text(d) = &step {
            out.apply(events(&mut meta.tools, &d.text, false));
            lps.extend(d.logprob.clone());
            match tools_done(&mut rs, &asm, &meta) {
                Some(done) => {
                    meta.trace_step(&done);
                    step = done;
                }
                None => continue,
            }
        }
        match step {
            Step::Text(_) | Step::Idle => {}
            Step::Done {
                last,
                reason,
                usage,
            } => {
                drop(rs);
                out.apply(events(&mut meta.tools, &last.text, true));
                lps.extend(last.logprob);
                let lp = meta.logprobs.then(|| logprobs_json(meta.endpoint, &lps));
                let finish = finish_str(reason, &meta.tools);
                let choice = match meta.endpoint {
                    Endpoint::Chat => {
                        let mut message = json!({"role": "assistant", "content": out.content});
                        if !out.calls.is_empty() {
                            if out.content.trim().is_empty() {
                                message["content"] = Value::Null;
                            }
                            message["tool_calls"] = out
                                .calls
                                .iter()
                                .map(|(id, name, args)| {
                                    json!({"id": id, "type": "function",
                                           "function": {"name": name, "arguments": args}})
                                })
                                .collect();
                        }
                        json!({
                            "index": 0,
                            "message": message,
                            "logprobs": lp,
                            "finish_reason": finish,
                        })
                    }
                    Endpoint::Completions => json!({
                        "index": 0,
                        "text": out.content,
                        "logprobs": lp,
                        "finish_reason": finish,
                    }),
                };
                let object = match meta.endpoint {
                    Endpoint::Chat => "chat.completion",
                    Endpoint::Completions => "text_completion",
                };
                return axum::Json(json!({
                    "id": meta.id,
                    "object": object,
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [choice],
                    "usage": usage_json(&usage),
                }))
                .into_response();
            }
            Step::Fail(f) => return ApiError::Failed(f).into_response(),
        }
    }
}

/// State of one SSE body.
struct Sse {
    /// `None` once the request is over (dropping it cancels in the engine).
    rs: Option<RequestStream>,
    asm: Assembler,
    meta: Meta,
    out: std::collections::VecDeque<Bytes>,
}

impl Sse {
    fn data(&mut self, v: &Value) {
        self.out.push_back(Bytes::from(format!("data: {v}\n\n")));
    }

    fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        lps: &[TokenLogprob],
        finish: Option<&str>,
    ) -> Value {
        self.chunk_with(text, None, role, lps, finish)
    }

    /// A chunk; `call` is a chat delta's `tool_calls` entry.
    fn chunk_with(
        &self,
        text: Option<&str>,
        call: Option<Value>,
        role: bool,
        lps: &[TokenLogprob],
        finish: Option<&str>,
    ) -> Value {
        let lp =
            (self.meta.logprobs && !lps.is_empty()).then(|| logprobs_json(self.meta.endpoint, lps));
        let (object, choice) = match self.meta.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                if let Some(c) = call {
                    delta.insert("tool_calls".into(), json!([c]));
                }
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}),
                )
            }
            Endpoint::Completions => (
                "text_completion",
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish}),
            ),
        };
        let mut v = json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [choice],
        });
        if self.meta.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The chunks for a token (its log-probability rides on the first),
    /// unless it adds nothing.
    fn delta(&mut self, d: &Delta, last: bool) {
        let ev = events(&mut self.meta.tools, &d.text, last);
        let mut lps: Vec<TokenLogprob> = d.logprob.iter().cloned().collect();
        if ev.is_empty() && !lps.is_empty() {
            let c = self.chunk_with(Some(""), None, false, &lps, None);
            self.data(&c);
        }
        for e in ev {
            let c = match e {
                ToolEvent::Content(t) => self.chunk_with(Some(&t), None, false, &lps, None),
                ToolEvent::Start { index, id, name } => {
                    let call = json!({"index": index, "id": id, "type": "function",
                                      "function": {"name": name, "arguments": ""}});
                    self.chunk_with(None, Some(call), false, &lps, None)
                }
                ToolEvent::Args { index, text } => {
                    let call = json!({"index": index, "function": {"arguments": text}});
                    self.chunk_with(None, Some(call), false, &lps, None)
                }
            };
            lps.clear();
            self.data(&c);
        }
    }

    /// Queues the next frames; the request ends in `out` with `[DONE]`.
    async fn advance(&mut self) {
        let Some(rs) = self.rs.as_mut() else { return };
        let mut step = next_step(rs, &mut self.asm, &self.meta, Some(KEEPALIVE)).await;
        self.meta.trace_step(&step);
        if let Step::Text(d) = &step {
            self.delta(d, false);
            let Some(rs) = self.rs.as_mut() else { return };
            match tools_done(rs, &self.asm, &self.meta) {
                Some(done) => {
                    self.meta.trace_step(&done);
                    step = done;
                }
                None => return,
            }
        }
        match step {
            Step::Text(_) => {}
            Step::Idle => self.out.push_back(Bytes::from_static(b": keep-alive\n\n")),
            Step::Done {
                last,
                reason,
                usage,
            } => {
                self.rs = None;
                self.delta(&last, true);
                // Chat's last chunk has an empty delta; completions' an empty text.
                let finish = finish_str(reason, &self.meta.tools);
                let fin = self.chunk(None, false, &[], Some(finish));
                self.data(&fin);
                if self.meta.include_usage {
                    let u = json!({
                        "id": self.meta.id,
                        "object": match self.meta.endpoint {
                            Endpoint::Chat => "chat.completion.chunk",
                            Endpoint::Completions => "text_completion",
                        },
                        "created": self.meta.created,
                        "model": self.meta.model,
                        "choices": [],
                        "usage": usage_json(&usage),
                    });
                    self.data(&u);
                }
                self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            }
            Step::Fail(f) => {
                self.rs = None;
                let e = ApiError::Failed(f).body();
                self.data(&e);
                self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            }
        }
    }
}

/// Answers with server-sent events; the body owns the request stream.
pub fn sse(rs: RequestStream, asm: Assembler, meta: Meta) -> Response {
    let mut st = Sse {
        rs: Some(rs),
        asm,
        meta,
        out: Default::default(),
    };
    if st.meta.endpoint == Endpoint::Chat {
        let first = st.chunk(Some(""), true, &[], None);
        st.data(&first);
    }
    let body = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(b) = st.out.pop_front() {
                return Some((Ok::<_, Infallible>(b), st));
            }
            st.rs.as_ref()?;
            st.advance().await;
        }
    });
    let mut resp = Body::from_stream(body).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

fn logprobs_json(endpoint: Endpoint, lps: &[TokenLogprob]) -> Value {
    match endpoint {
        Endpoint::Chat => json!({
            "content": lps.iter().map(|t| json!({
                "token": t.token,
                "logprob": t.logprob,
                "bytes": t.bytes,
                "top_logprobs": t.top.iter().map(|(tok, b, lp)| json!({
                    "token": tok, "logprob": lp, "bytes": b,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        }),
        Endpoint::Completions => json!({
            "tokens": lps.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|t| {
                t.top.iter().map(|(tok, _, lp)| (tok.clone(), json!(lp)))
                    .collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "text_offset": lps.iter().map(|t| t.text_offset).collect::<Vec<_>>(),
        }),
    }
}
