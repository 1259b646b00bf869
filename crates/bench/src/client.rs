//! The I/O shell: model discovery, one streamed request, the worker pool.
//! Every decision about bytes and timings is made by `sse` and `request`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use serde_json::{Value, json};

use crate::prompt;
use crate::request::{ErrorKind, Outcome, Trace};
use crate::sse::{SseEvent, SseParser};

/// Longest wait for the rest of a body after `[DONE]`. Reading it to its end
/// returns the connection to the pool, so the next request does not pay for
/// a new connection in its TTFT; a server that keeps the stream open after
/// `[DONE]` costs at most this.
const DRAIN_MAX: Duration = Duration::from_millis(500);

/// Longest wait for `/v1/models`, which only names the model.
const DISCOVER_TIMEOUT_MAX: Duration = Duration::from_secs(30);

/// What the server's `/v1/models` says about the model under test.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ServerModel {
    pub id: String,
    pub quantisation: String,
}

/// Asks `{base}/v1/models` for the model (the first listed, or the one named
/// `wanted`) and its quantisation. Never fails: an unreachable or odd server
/// gives `wanted` (or "default") and "unknown".
pub(crate) async fn discover(
    client: &reqwest::Client,
    base: &str,
    api_key: Option<&str>,
    wanted: Option<&str>,
    timeout: Duration,
) -> ServerModel {
    let mut req = client.get(format!("{base}/v1/models"));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let listing = async {
        let resp = req.send().await.ok()?.error_for_status().ok()?;
        resp.json::<Value>().await.ok()
    };
    let listing = tokio::time::timeout(timeout.min(DISCOVER_TIMEOUT_MAX), listing)
        .await
        .ok()
        .flatten();
    model_from_listing(listing.as_ref(), wanted)
}

/// The server's speculative decoding counters from its `/metrics`, if it
/// has them (Flotilla); `None` for any other server or an unreachable one.
pub(crate) async fn spec_counts(
    client: &reqwest::Client,
    base: &str,
    api_key: Option<&str>,
) -> Option<crate::report::SpecCounts> {
    let text = metrics_page(client, base, api_key).await?;
    crate::report::SpecCounts::from_metrics(&text)
}

/// GETs `{base}{path}`; `None` on any failure or after the discovery timeout.
async fn get_text(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    api_key: Option<&str>,
) -> Option<String> {
    let mut req = client.get(format!("{base}{path}"));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let text = async {
        let resp = req.send().await.ok()?.error_for_status().ok()?;
        resp.text().await.ok()
    };
    tokio::time::timeout(DISCOVER_TIMEOUT_MAX, text)
        .await
        .ok()
        .flatten()
}

/// The server's `/metrics` page, if it has one.
pub(crate) async fn metrics_page(
    client: &reqwest::Client,
    base: &str,
    api_key: Option<&str>,
) -> Option<String> {
    get_text(client, base, "/metrics", api_key).await
}

/// The server's settings from its `/config` (Flotilla's), if it has one
/// that answers a JSON object.
pub(crate) async fn server_config(
    client: &reqwest::Client,
    base: &str,
    api_key: Option<&str>,
) -> Option<Value> {
    let text = get_text(client, base, "/config", api_key).await?;
    serde_json::from_str::<Value>(&text)
        .ok()
        .filter(Value::is_object)
}

/// Picks the model out of a `/v1/models` answer (pure, for tests).
pub(crate) fn model_from_listing(listing: Option<&Value>, wanted: Option<&str>) -> ServerModel {
    let entries = listing
        .and_then(|l| l.get("data"))
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let id_of = |e: &Value| e.get("id").and_then(Value::as_str).map(str::to_owned);
    let entry = match wanted {
        Some(w) => entries.iter().find(|e| id_of(e).as_deref() == Some(w)),
        None => entries.first(),
    };
    let id = wanted
        .map(str::to_owned)
        .or_else(|| entry.and_then(id_of))
        .unwrap_or_else(|| "default".to_owned());
    // llama-server also lists Ollama-style `models` entries with `details`.
    let ollama = listing
        .and_then(|l| l.get("models"))
        .and_then(Value::as_array)
        .and_then(|m| {
            m.iter().find(|e| {
                ["name", "model"]
                    .iter()
                    .any(|k| e.get(*k).and_then(Value::as_str) == Some(&id))
            })
        });
    let quantisation = entry
        .and_then(|e| quant_field(e, 0))
        .or_else(|| ollama.and_then(|e| quant_field(e, 0)))
        .or_else(|| quant_from_name(&id))
        .unwrap_or_else(|| "unknown".to_owned());
    ServerModel { id, quantisation }
}

/// A non-empty string under a quantisation-like key, searched a few levels deep.
fn quant_field(v: &Value, depth: usize) -> Option<String> {
    const KEYS: [&str; 5] = [
        "quantization",
        "quantisation",
        "quantization_level",
        "quant_type",
        "quant",
    ];
    const DEPTH_MAX: usize = 4;
    let obj = v.as_object()?;
    for k in KEYS {
        if let Some(s) = obj.get(k).and_then(Value::as_str).filter(|s| !s.is_empty()) {
            return Some(s.to_owned());
        }
    }
    if depth >= DEPTH_MAX {
        return None;
    }
    obj.values().find_map(|c| quant_field(c, depth + 1))
}

/// A GGUF quantisation tag in a model name, e.g. `Q4_K_M` in
/// `Llama-3-8B-Q4_K_M.gguf` (llama-server names models by file).
fn quant_from_name(name: &str) -> Option<String> {
    const FLOATS: [&str; 5] = ["F32", "F16", "BF16", "FP16", "FP8"];
    name.split(['-', '.', '/', ' ', '\\'])
        .map(str::to_ascii_uppercase)
        .find(|t| {
            let body = t.strip_prefix("IQ").or_else(|| t.strip_prefix('Q'));
            body.is_some_and(|b| b.starts_with(|c: char| c.is_ascii_digit()))
                && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                || FLOATS.contains(&t.as_str())
        })
}

/// Wait after a 429/503 without a usable Retry-After.
const BACKOFF_DEFAULT: Duration = Duration::from_millis(500);
/// Longest wait after a 429/503, whatever Retry-After says.
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// State shared by the workers of one run.
pub(crate) struct Pool {
    pub client: reqwest::Client,
    /// Full URL of the completions endpoint.
    pub endpoint_url: String,
    pub api_key: Option<String>,
    pub model: String,
    pub chat: bool,
    pub max_tokens: u32,
    /// Smallest per-request max_tokens (equal to `max_tokens` for a fixed length).
    pub max_tokens_min: u32,
    pub ignore_eos: bool,
    pub seed: u64,
    pub words_min: usize,
    pub words_max: usize,
    pub timeout: Duration,
    /// Honour Retry-After on 429/503 before the worker's next request.
    pub backoff: bool,
    /// Fraction of requests dropped on purpose mid-stream.
    pub cancel_fraction: f64,
    /// Every request's output constrained to this JSON Schema.
    pub json_schema: Option<Value>,
    pub requests: usize,
    /// Next request index to send; may run past `requests` as workers stop.
    pub next: AtomicUsize,
    pub outcomes: Mutex<Vec<Outcome>>,
    /// Content chunks received so far, all requests together.
    pub chunks: AtomicU64,
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub progress: ProgressBar,
}

impl Pool {
    /// Requests handed to a worker so far.
    pub fn started(&self) -> usize {
        self.next.load(Ordering::Relaxed).min(self.requests)
    }

    /// One worker: sends requests one after another until none are left.
    pub async fn worker(&self) {
        loop {
            let index = self.next.fetch_add(1, Ordering::Relaxed);
            if index >= self.requests {
                return;
            }
            let outcome = self.one(index as u64).await;
            self.record(outcome);
        }
    }

    /// The open loop: request `i` sent at the `i`-th time of a Poisson
    /// process of `rate` per second (seeded), whatever the server's pace;
    /// at most `cap` in flight (beyond it the next waits for a slot).
    /// Ends when every request sent has ended; dropping it drops them.
    pub async fn open_loop(self: std::sync::Arc<Self>, rate: f64, cap: usize, seed: u64) {
        let start = tokio::time::Instant::now();
        let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(cap));
        let mut rng = flotilla_exec::rng::SplitMix64(seed ^ 0x6f70_656e_6c6f_6f70);
        let mut at = 0.0f64;
        let mut inflight = tokio::task::JoinSet::new();
        for index in 0..self.requests {
            // Exponential gaps: -ln(U) / rate, U in (0, 1].
            let u = 1.0 - rng.f64();
            at += -u.ln() / rate;
            tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
            let Ok(slot) = std::sync::Arc::clone(&slots).acquire_owned().await else {
                return;
            };
            self.next.fetch_add(1, Ordering::Relaxed);
            let pool = std::sync::Arc::clone(&self);
            inflight.spawn(async move {
                let outcome = pool.one(index as u64).await;
                pool.record(outcome);
                drop(slot);
            });
            while let Some(done) = inflight.try_join_next() {
                if let Err(e) = done
                    && e.is_panic()
                {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        }
        while let Some(done) = inflight.join_next().await {
            if let Err(e) = done
                && e.is_panic()
            {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }

    /// Counts one request's outcome and keeps it.
    fn record(&self, outcome: Outcome) {
        let (ok, failed) = if outcome.is_ok() {
            (
                self.ok.fetch_add(1, Ordering::Relaxed) + 1,
                self.failed.load(Ordering::Relaxed),
            )
        } else {
            (
                self.ok.load(Ordering::Relaxed),
                self.failed.fetch_add(1, Ordering::Relaxed) + 1,
            )
        };
        self.outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(outcome);
        self.progress
            .set_message(format!("ok {ok}, failed {failed}"));
        self.progress.inc(1);
    }

    fn body(&self, index: u64) -> Value {
        let text = prompt::prompt(self.seed, index, self.words_min, self.words_max);
        let mut body = json!({
            "model": self.model,
            "max_tokens": prompt::max_tokens_for(self.seed, index, self.max_tokens_min, self.max_tokens),
            "temperature": 0.0,
            "stream": true,
            "stream_options": { "include_usage": true },
            "ignore_eos": self.ignore_eos,
        });
        if self.chat {
            body["messages"] = json!([{ "role": "user", "content": text }]);
        } else {
            body["prompt"] = Value::String(text);
        }
        if let Some(schema) = &self.json_schema {
            body["response_format"] = json!({"type": "json_schema",
                "json_schema": {"name": "bench", "schema": schema, "strict": true}});
        }
        body
    }

    /// Sends request `index` and classifies how it went.
    pub(crate) async fn one(&self, index: u64) -> Outcome {
        let mut req = self.client.post(&self.endpoint_url).json(&self.body(index));
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let mut leftover = None;
        let mut retry_wait = None;
        let sent = Instant::now();
        let drop_after = prompt::cancel_after(self.seed, index, self.cancel_fraction);
        let outcome = tokio::time::timeout(
            self.timeout,
            self.stream(req, sent, drop_after, &mut leftover, &mut retry_wait),
        )
        .await
        .unwrap_or(Err(ErrorKind::Timeout));
        if let Some(mut resp) = leftover {
            let drain = async { while let Ok(Some(_)) = resp.chunk().await {} };
            let _ = tokio::time::timeout(DRAIN_MAX, drain).await;
        }
        // Outside the request's timeout: the wait is the worker's, not the request's.
        if let Some(w) = retry_wait {
            tokio::time::sleep(w).await;
        }
        outcome
    }

    /// Streams one response into a [`Trace`]. On `[DONE]` the response is
    /// left in `leftover` for the caller to drain outside the timeout.
    async fn stream(
        &self,
        req: reqwest::RequestBuilder,
        sent: Instant,
        drop_after: Option<u64>,
        leftover: &mut Option<reqwest::Response>,
        retry_wait: &mut Option<Duration>,
    ) -> Outcome {
        let mut resp = req.send().await.map_err(|e| {
            if e.is_timeout() {
                ErrorKind::Timeout
            } else {
                ErrorKind::Connect
            }
        })?;
        if !resp.status().is_success() {
            let code = resp.status().as_u16();
            if self.backoff && (code == 429 || code == 503) {
                // As OpenAI's clients do: wait as the server asks before
                // this worker's next request (at most BACKOFF_MAX), so a
                // refused flood does not turn into a busy loop of refusals.
                let wait = resp
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map_or(BACKOFF_DEFAULT, Duration::from_secs_f64)
                    .min(BACKOFF_MAX);
                *retry_wait = Some(wait);
            }
            return Err(ErrorKind::Http(code));
        }
        let mut trace = Trace::new(self.max_tokens as usize);
        let mut sse = SseParser::new();
        while !trace.is_done() {
            let chunk = resp.chunk().await.map_err(|e| {
                if e.is_timeout() {
                    ErrorKind::Timeout
                } else {
                    ErrorKind::Stream
                }
            })?;
            let at = sent.elapsed();
            let Some(chunk) = chunk else {
                if let Some(event) = sse.finish().map_err(|_| ErrorKind::Stream)? {
                    apply(&mut trace, at, event)?;
                }
                return trace.finish(at);
            };
            sse.feed(&chunk).map_err(|_| ErrorKind::Stream)?;
            let seen = trace.content_chunks();
            while let Some(event) = sse.next_event().map_err(|_| ErrorKind::Stream)? {
                apply(&mut trace, at, event)?;
                if trace.is_done() {
                    break;
                }
            }
            self.chunks
                .fetch_add(trace.content_chunks() - seen, Ordering::Relaxed);
            if drop_after.is_some_and(|k| trace.content_chunks() >= k) {
                // Dropping the response closes the connection mid-stream,
                // as a client that goes away does.
                return Err(ErrorKind::Dropped);
            }
        }
        let end = sent.elapsed();
        *leftover = Some(resp);
        trace.finish(end)
    }
}

fn apply(trace: &mut Trace, at: Duration, event: SseEvent<'_>) -> Result<(), ErrorKind> {
    match event {
        SseEvent::Data(d) => trace.on_data(at, d),
        SseEvent::Done => {
            trace.on_done();
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_and_quantisation_from_listing() {
        let vllm =
            json!({"object": "list", "data": [{"id": "Qwen/Qwen2.5-7B", "object": "model"}]});
        assert_eq!(
            model_from_listing(Some(&vllm), None),
            ServerModel {
                id: "Qwen/Qwen2.5-7B".into(),
                quantisation: "unknown".into()
            }
        );
        let llama = json!({
            "models": [{"name": "m.gguf", "model": "m.gguf", "details": {"quantization_level": "Q8_0"}}],
            "data": [{"id": "m.gguf", "meta": {"n_params": 1}}],
        });
        assert_eq!(model_from_listing(Some(&llama), None).quantisation, "Q8_0");
        let named =
            json!({"data": [{"id": "a"}, {"id": "/models/llama-3-8b-instruct-q4_k_m.gguf"}]});
        let m = model_from_listing(
            Some(&named),
            Some("/models/llama-3-8b-instruct-q4_k_m.gguf"),
        );
        assert_eq!(m.quantisation, "Q4_K_M");
        let own = json!({"data": [{"id": "smol", "quantisation": "q4_1"}]});
        assert_eq!(model_from_listing(Some(&own), None).quantisation, "q4_1");
        assert_eq!(model_from_listing(None, None).id, "default");
        assert_eq!(model_from_listing(None, Some("x")).id, "x");
        assert_eq!(
            quant_from_name("gemma-2b-it-BF16.gguf").as_deref(),
            Some("BF16")
        );
        assert_eq!(quant_from_name("Qwen2.5-7B"), None);
        assert_eq!(
            quant_from_name("model-IQ3_XS.gguf").as_deref(),
            Some("IQ3_XS")
        );
    }
}
