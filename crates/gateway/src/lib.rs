//! The Router's HTTP front (axum): OpenAI API, auth, validation, SSE, health, readiness, metrics.
//!
//! A request is authenticated, parsed and validated here ([`openai`]) before
//! it reaches the engine; every refusal is an [`error::ApiError`] whose class
//! fixes its status code in one table. The engine is asked to admit the
//! request before any response starts, so its refusals keep their status
//! codes even for streams ([`stream`]).

pub mod error;
pub mod limits;
pub mod openai;
pub mod stream;
pub mod text;
pub mod tools;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use flotilla_config::ClusterConfig;
use flotilla_engine::Engine;
use flotilla_proto::{EngineRequest, TenantId};
use flotilla_telemetry::Metrics;
use flotilla_text::TextSide;
use serde_json::json;

use crate::error::ApiError;
use crate::openai::{Endpoint, ParseCtx};
use crate::stream::Meta;
use crate::text::Assembler;

/// Default cap on a request body, bytes.
pub const BODY_LIMIT_BYTES_DEFAULT: usize = 1 << 20;

/// The tier label of refusals that happen before the tenant is known.
const TIER_UNKNOWN: &str = "unknown";

/// What the gateway serves and under which limits.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The model name clients send in `model` and see in `/v1/models`.
    pub model_name: String,
    /// Prompt plus completion tokens allowed per request.
    pub max_model_len: usize,
    /// Largest request body, bytes (larger gets 413).
    pub body_limit_bytes: usize,
    /// Tenants, tiers and API keys.
    pub cluster: Arc<ClusterConfig>,
    /// Checks output constraints (`response_format` and the like) before a
    /// request leaves the gateway, so a bad schema is a 400 here wherever
    /// the request would run; `None` leaves that to the engine.
    pub constraints: Option<Arc<dyn flotilla_proto::ConstraintCompiler>>,
    /// Traces requests (a server span per request, its context passed to
    /// the engines); `None`: tracing is off.
    pub tracing: Option<flotilla_telemetry::Tracing>,
    /// What `GET /config` answers: the server's model, precision and
    /// engine settings (load-test reports record them). `Null`: 404.
    pub server_info: serde_json::Value,
    /// This front's place among the cluster's Routers and how many there
    /// are, `(index, routers)`: each holds its share of a tenant's limits.
    pub limits_share: (usize, usize),
}

impl GatewayConfig {
    /// A config with the default body limit.
    pub fn new(
        model_name: impl Into<String>,
        max_model_len: usize,
        cluster: Arc<ClusterConfig>,
    ) -> Self {
        GatewayConfig {
            model_name: model_name.into(),
            max_model_len,
            body_limit_bytes: BODY_LIMIT_BYTES_DEFAULT,
            cluster,
            constraints: None,
            tracing: None,
            server_info: serde_json::Value::Null,
            limits_share: (0, 1),
        }
    }
}

struct Gateway {
    engine: Arc<dyn Engine>,
    text: Arc<TextSide>,
    metrics: Arc<Metrics>,
    /// Tenants' concurrency and rate, held here where requests enter.
    limits: Arc<limits::TenantLimits>,
    cfg: GatewayConfig,
    /// Requests seen: names responses and seeds requests that bring no seed.
    requests: AtomicU64,
}

type Shared = State<Arc<Gateway>>;

/// The HTTP service: OpenAI endpoints, `/health`, `/ready`, `/metrics`.
pub fn router(
    engine: Arc<dyn Engine>,
    text: Arc<TextSide>,
    metrics: Arc<Metrics>,
    cfg: GatewayConfig,
) -> Router {
    let limit = cfg.body_limit_bytes;
    observed(Router::new())
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/admin/drain", post(drain))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(Gateway::new(engine, text, metrics, cfg))
}

/// An engine node's observability service: `/metrics`, `/health`, `/ready`
/// and `/config` as the API router serves them, for this node's engine
/// alone; no API and no admin endpoint (everything else is 404).
pub fn observability_router(
    engine: Arc<dyn Engine>,
    text: Arc<TextSide>,
    metrics: Arc<Metrics>,
    cfg: GatewayConfig,
) -> Router {
    observed(Router::new())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(Gateway::new(engine, text, metrics, cfg))
}

/// The routes both services have: `/config`, `/health`, `/ready`,
/// `/metrics` (each adds its fallbacks after its last route: axum's
/// method fallback covers the routes added before it).
fn observed(r: Router<Arc<Gateway>>) -> Router<Arc<Gateway>> {
    r.route("/config", get(config))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(prometheus_text))
}

impl Gateway {
    fn new(
        engine: Arc<dyn Engine>,
        text: Arc<TextSide>,
        metrics: Arc<Metrics>,
        cfg: GatewayConfig,
    ) -> Arc<Gateway> {
        Arc::new(Gateway {
            engine,
            text,
            metrics,
            limits: Arc::new(limits::TenantLimits::share(
                &cfg.cluster,
                cfg.limits_share.0,
                cfg.limits_share.1,
            )),
            cfg,
            requests: AtomicU64::new(0),
        })
    }

    /// Answers a refusal and counts it; the one exit of every refused request.
    fn refuse(&self, tier: &str, err: ApiError) -> Response {
        let class = err.class();
        if let Some(kind) = class.metric {
            self.metrics.request_rejected(tier, kind);
        }
        tracing::debug!(tier, status = class.status.as_u16(), error = %err, "request refused");
        err.into_response()
    }

    /// The tenant behind the request's API key (tenant 0 when the config is open).
    fn authenticate(&self, headers: &HeaderMap) -> Result<TenantId, ApiError> {
        let cluster = &self.cfg.cluster;
        if cluster.is_open() {
            return Ok(TenantId(0));
        }
        let key = bearer(headers).ok_or(ApiError::Unauthorized)?;
        let t = cluster.tenant_for_key(key).ok_or(ApiError::Unauthorized)?;
        Ok(TenantId(t as u32))
    }

    /// Checks an admin endpoint's key against `[cluster] admin_keys`.
    fn authenticate_admin(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let keys = self
            .cfg
            .cluster
            .cluster
            .as_ref()
            .map_or(&[][..], |c| &c.admin_keys[..]);
        if keys.is_empty() {
            return Err(ApiError::AdminOff);
        }
        let key = bearer(headers).ok_or(ApiError::AdminUnauthorized)?;
        let hit = any_key_is(keys, key);
        if hit {
            Ok(())
        } else {
            Err(ApiError::AdminUnauthorized)
        }
    }

    /// Whether the request may see `/metrics` and `/ready`'s detail: the
    /// config lists no detail keys, or it brings one.
    fn detail_allowed(&self, headers: &HeaderMap) -> bool {
        let keys = &self.cfg.cluster.telemetry.detail_keys;
        keys.is_empty() || bearer(headers).is_some_and(|key| any_key_is(keys, key))
    }

    /// The request body, or why it cannot be read (413 over the limit).
    fn read_body(&self, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
        body.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge {
                    limit_bytes: self.cfg.body_limit_bytes,
                }
            } else {
                ApiError::invalid_body(format!("cannot read the request body: {}", r.body_text()))
            }
        })
    }

    /// The server span of a parsed request, if tracing is on and it is
    /// sampled: a child of the client's `traceparent`, if it sent one.
    #[allow(clippy::too_many_arguments)]
    fn server_span(
        &self,
        endpoint: Endpoint,
        headers: &HeaderMap,
        arrival: SystemTime,
        p: &openai::Parsed,
        tenant: TenantId,
        tier: &str,
        n: u64,
    ) -> Option<stream::ReqSpan> {
        use flotilla_telemetry::KeyValue;
        let tr = self.cfg.tracing.as_ref()?;
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let (path, op, id) = match endpoint {
            Endpoint::Chat => ("/v1/chat/completions", "chat", format!("chatcmpl-{n}")),
            Endpoint::Completions => ("/v1/completions", "text_completion", format!("cmpl-{n}")),
        };
        let attrs = vec![
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("http.route", path),
            KeyValue::new("gen_ai.operation.name", op),
            KeyValue::new("gen_ai.request.model", self.cfg.model_name.clone()),
            KeyValue::new("gen_ai.request.max_tokens", i64::from(p.max_tokens)),
            KeyValue::new(
                "gen_ai.request.temperature",
                f64::from(p.sampling.temperature),
            ),
            KeyValue::new("gen_ai.request.top_p", f64::from(p.sampling.top_p)),
            KeyValue::new("gen_ai.response.id", id),
            KeyValue::new("gen_ai.request.stream", p.stream),
            KeyValue::new("flotilla.tier", tier.to_owned()),
            KeyValue::new("flotilla.tenant", i64::from(tenant.0)),
        ];
        let span = tr.server_span(
            format!("POST {path}"),
            header("traceparent"),
            header("tracestate"),
            arrival,
            attrs,
        )?;
        Some(stream::ReqSpan { span, ended: None })
    }

    fn tier_name(&self, tenant: TenantId) -> &str {
        let c = &self.cfg.cluster;
        c.tenants
            .get(tenant.0 as usize)
            .and_then(|t| c.tiers.get(t.tier))
            .map_or(TIER_UNKNOWN, |t| t.name.as_str())
    }

    async fn generate(
        &self,
        endpoint: Endpoint,
        headers: HeaderMap,
        body: Result<Bytes, BytesRejection>,
    ) -> Response {
        let arrival = SystemTime::now();
        let arrived = std::time::Instant::now();
        let tenant = match self.authenticate(&headers) {
            Ok(t) => t,
            Err(e) => return self.refuse(TIER_UNKNOWN, e),
        };
        let tier = self.tier_name(tenant);
        let body = match self.read_body(body) {
            Ok(b) => b,
            Err(e) => return self.refuse(tier, e),
        };
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        let ctx = ParseCtx {
            text: &self.text,
            model_name: &self.cfg.model_name,
            max_model_len: self.cfg.max_model_len,
            default_seed: mix(n),
            constraints: self.cfg.constraints.as_deref(),
        };
        let p = match openai::parse(endpoint, &body, &ctx) {
            Ok(p) => p,
            Err(e) => return self.refuse(tier, e),
        };
        // The tenant's limits, across every node behind this front; the
        // slot goes back when the response ends, however it ends.
        let slot = match self.limits.acquire(tenant) {
            Ok(s) => s,
            Err(r) => return self.refuse(tier, ApiError::Rejected(r)),
        };
        let prompt_tokens = p.prompt.len() as u32;
        let mut span = self.server_span(endpoint, &headers, arrival, &p, tenant, tier, n);
        let mut hidden = self.text.stop_tokens.clone();
        hidden.extend(&p.stop_token_ids);
        let asm = Assembler::new(self.text.clone(), hidden, p.stop, p.sampling.logprobs);
        let meta = Meta {
            id: match endpoint {
                Endpoint::Chat => format!("chatcmpl-{n}"),
                Endpoint::Completions => format!("cmpl-{n}"),
            },
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: self.cfg.model_name.clone(),
            endpoint,
            include_usage: p.include_usage,
            logprobs: p.sampling.logprobs,
            prompt_tokens,
            tools: p
                .tools
                .as_ref()
                .map(|t| tools::ToolCallParser::new(t.names(), mix(!n), !t.parallel)),
            span: None,
            first: Some((self.metrics.clone(), tier.to_owned(), arrived)),
            slot: Some(slot),
        };
        let req = EngineRequest {
            tenant,
            prompt: p.prompt,
            max_tokens: p.max_tokens,
            sampling: p.sampling,
            logit_bias: p.logit_bias,
            generated: 0,
            constraint: p.constraint,
            ignore_eos: p.ignore_eos,
            stop_token_ids: p.stop_token_ids,
            speculative: p.speculative,
            trace: span.as_ref().map(|s| s.span.context().clone()),
        };
        let submitted = SystemTime::now();
        // Admission first: a refusal keeps its status code, even for streams.
        let answer = self.engine.submit(req).await;
        if let (Some(s), Some(tr)) = (&span, &self.cfg.tracing) {
            let at = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap_or_default();
            let tr = tr.with_epoch(UNIX_EPOCH);
            let parent = s.span.context();
            let prep =
                flotilla_telemetry::SpanRec::new("gateway.prepare", at(arrival), at(submitted))
                    .attr("gen_ai.usage.input_tokens", i64::from(prompt_tokens));
            tr.export(parent, prep);
            let mut admit = flotilla_telemetry::SpanRec::new(
                "gateway.admit",
                at(submitted),
                at(SystemTime::now()),
            );
            if let Err(r) = &answer {
                admit.error = Some(r.to_string());
            }
            tr.export(parent, admit);
        }
        let rs = match answer {
            Ok(rs) => rs,
            Err(r) => {
                if let Some(s) = &mut span {
                    s.ended = Some("refused");
                    s.span.fail(format!("refused: {r}"));
                }
                return self.refuse(tier, ApiError::Rejected(r));
            }
        };
        let mut meta = meta;
        meta.span = span;
        if p.stream {
            stream::sse(rs, asm, meta)
        } else {
            stream::collect(rs, asm, meta).await
        }
    }
}

/// Well-spread seeds from a counter (SplitMix64's draw at state `n`).
fn mix(n: u64) -> u64 {
    flotilla_exec::rng::SplitMix64(n).next_u64()
}

async fn chat(
    State(gw): Shared,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    gw.generate(Endpoint::Chat, headers, body).await
}

async fn completions(
    State(gw): Shared,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    gw.generate(Endpoint::Completions, headers, body).await
}

/// The key of an `Authorization: Bearer KEY` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, key) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
        })
}

/// Whether `key` is one of `keys`, every key compared in full, so the time
/// taken says nothing of how much of one matched.
fn any_key_is(keys: &[String], key: &str) -> bool {
    keys.iter().fold(false, |hit, k| hit | same_bytes(k, key))
}

/// Equal strings, compared in time that depends on their lengths only.
fn same_bytes(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Longest grace a drain may ask for, seconds.
const DRAIN_GRACE_MAX_S: f64 = 3600.0;

/// `POST /admin/drain` `{"node": NAME, "grace_s": S}` (admin key): asks
/// an engine node to drain, as SIGTERM to it would (`grace_s` 30 unless
/// given: how long what runs there may finish before it moves).
async fn drain(
    State(gw): Shared,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if let Err(e) = gw.authenticate_admin(&headers) {
        return gw.refuse(TIER_UNKNOWN, e);
    }
    let body = match gw.read_body(body) {
        Ok(b) => b,
        Err(e) => return gw.refuse(TIER_UNKNOWN, e),
    };
    let v: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            let e = ApiError::invalid_body(format!("the body is not JSON: {e}"));
            return gw.refuse(TIER_UNKNOWN, e);
        }
    };
    let Some(node) = v.get("node").and_then(|n| n.as_str()) else {
        let e = ApiError::invalid(
            "node",
            "'node' (the engine node's name, a string) is required",
        );
        return gw.refuse(TIER_UNKNOWN, e);
    };
    let grace_s = match v.get("grace_s") {
        None | Some(serde_json::Value::Null) => 30.0,
        Some(g) => match g.as_f64() {
            Some(s) if (0.0..=DRAIN_GRACE_MAX_S).contains(&s) => s,
            _ => {
                let e = ApiError::invalid(
                    "grace_s",
                    format!("'grace_s' must be a number of seconds from 0 to {DRAIN_GRACE_MAX_S}"),
                );
                return gw.refuse(TIER_UNKNOWN, e);
            }
        },
    };
    let grace = std::time::Duration::from_secs_f64(grace_s);
    match gw.engine.drain_node(node, grace).await {
        Ok(()) => (
            StatusCode::ACCEPTED,
            Json(json!({ "node": node, "draining": true, "grace_s": grace_s })),
        )
            .into_response(),
        Err(r) => gw.refuse(TIER_UNKNOWN, ApiError::Drain(r)),
    }
}

async fn models(State(gw): Shared, headers: HeaderMap) -> Response {
    if let Err(e) = gw.authenticate(&headers) {
        return gw.refuse(TIER_UNKNOWN, e);
    }
    Json(json!({
        "object": "list",
        "data": [{
            "id": gw.cfg.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "flotilla",
            "max_model_len": gw.cfg.max_model_len,
        }],
    }))
    .into_response()
}

/// `GET /config`: the model, its precision and the engine's settings, as
/// the server runs them (no keys, no tenants' names).
async fn config(State(gw): Shared, headers: HeaderMap) -> Response {
    if let Err(e) = gw.authenticate(&headers) {
        return gw.refuse(TIER_UNKNOWN, e);
    }
    if gw.cfg.server_info.is_null() {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"message": "no settings to show", "type": "not_found_error"}})),
        )
            .into_response();
    }
    Json(gw.cfg.server_info.clone()).into_response()
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn ready(State(gw): Shared, headers: HeaderMap) -> Response {
    let s = gw.engine.status().await;
    let status = if s.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    // Probes need only the status; the load and the nodes are the
    // operators' (`[telemetry] detail_keys`).
    if !gw.detail_allowed(&headers) {
        return (status, Json(json!({ "ready": s.ready }))).into_response();
    }
    let queue: serde_json::Map<String, serde_json::Value> = s
        .tiers
        .iter()
        .map(|t| (t.name.clone(), json!(t.queued)))
        .collect();
    let body = json!({
        "ready": s.ready,
        "model": gw.cfg.model_name,
        "steps": s.steps,
        "running": s.running,
        "queue": queue,
        "tiers": s.tiers.iter().map(|t| json!({
            "name": t.name, "queued": t.queued, "running": t.running,
        })).collect::<Vec<_>>(),
        "kv_blocks": {
            "total": s.kv.total, "used": s.kv.used, "free": s.kv.free, "cached": s.kv.cached,
            "held_for_transfer": s.kv.held, "reserved_for_import": s.kv.reserved,
        },
        "kv_cache_dtype": s.kv.dtype.name(),
        "kv_offload": {
            "total": s.kv.offload.total, "held": s.kv.offload.held,
            "active": s.kv.offload.active,
            "spilled": s.kv.offload.spilled, "restored": s.kv.offload.restored,
            "dropped": s.kv.offload.dropped,
            "lookups": s.kv.offload.lookups, "hits": s.kv.offload.hits,
            "move_us_per_block": s.kv.offload.move_ns as f64 / 1e3,
            "recompute_us_per_block": s.kv.offload.recompute_ns as f64 / 1e3,
        },
        "preemptions": s.preemptions,
        // What the KV cache was sized from (a container's memory limit or
        // the host's), where this process loaded the model.
        "memory": gw.cfg.server_info.get("memory").cloned().unwrap_or(serde_json::Value::Null),
        // A draft model's KV is in the same blocks (each of `kv_blocks`
        // holds both halves): its share of each block's bytes.
        "draft_model": gw.cfg.server_info.get("draft_model").cloned().unwrap_or(serde_json::Value::Null),
        // A Router's placements and its prefix index's part in them.
        "routing": json!({
            "placements": s.routing.placements,
            "cache_candidate": s.routing.cache_candidate,
            "prompt_blocks": s.routing.prompt_blocks,
            "matched_blocks": s.routing.matched_blocks,
            "prefix_snapshots": s.routing.prefix_snapshots,
        }),
        "nodes": s.nodes.iter().map(|n| json!({
            "name": n.name, "up": n.up, "epoch": n.epoch, "in_flight": n.in_flight,
            "routed": n.routed, "downs": n.downs, "moved_away": n.moved_away,
            "moved_by_kv": n.moved_by_kv, "kv_short": n.kv_short,
            "kv_orphans": n.kv_orphans,
            "kv_cache_dtype": n.kv_dtype.name(), "kv_blocks": n.kv_blocks,
        })).collect::<Vec<_>>(),
    });
    (status, Json(body)).into_response()
}

async fn prometheus_text(State(gw): Shared, headers: HeaderMap) -> Response {
    if !gw.detail_allowed(&headers) {
        return ApiError::DetailUnauthorized.into_response();
    }
    // The load as the engine sees it now (on a Router: every node's, summed),
    // so that a Router's page carries the queue an autoscaler reads.
    // An engine that does not answer in time leaves the gauges as they were.
    let status = tokio::time::timeout(std::time::Duration::from_secs(2), gw.engine.status());
    if let Ok(s) = status.await {
        for t in &s.tiers {
            gw.metrics
                .tier_load(&t.name, t.queued as u64, t.running as u64);
        }
        gw.metrics
            .kv(s.kv.used as u64, s.kv.free as u64, s.kv.cached as u64);
        if !s.nodes.is_empty() {
            gw.metrics.routing(&s.routing);
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        gw.metrics.render(),
    )
        .into_response()
}

async fn not_found(State(gw): Shared, method: Method, uri: Uri) -> Response {
    let e = ApiError::NotFound {
        method: method.to_string(),
        path: uri.path().to_owned(),
    };
    gw.refuse(TIER_UNKNOWN, e)
}

async fn method_not_allowed(State(gw): Shared, method: Method, uri: Uri) -> Response {
    let e = ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    };
    gw.refuse(TIER_UNKNOWN, e)
}
