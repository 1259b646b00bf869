//! Refusals and operations over HTTP: bad input never reaches the engine,
//! engine rejections and failures keep their status codes, and the health,
//! readiness, metrics and model endpoints.

mod common;

use std::sync::atomic::Ordering;

use common::*;
use flotilla_config::ClusterConfig;
use flotilla_proto::{EngineFailure, Rejection};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const CMPL: &str = "/v1/completions";
const KEY: &str = "Bearer sk-acme-0001";

/// Sends one bad request; checks the status, the OpenAI error shape and
/// that the engine saw nothing. Returns the `error` object.
async fn refused(
    s: &Server,
    name: &str,
    path: &str,
    auth: Option<&str>,
    body: Vec<u8>,
    want: u16,
) -> Value {
    let mut r = s.http.post(format!("{}{path}", s.base)).body(body);
    if let Some(a) = auth {
        r = r.header("authorization", a);
    }
    let resp = r.send().await.unwrap_or_else(|e| panic!("{name}: {e}"));
    let status = resp.status().as_u16();
    let v: Value = resp
        .json()
        .await
        .unwrap_or_else(|e| panic!("{name}: not JSON: {e}"));
    assert_eq!(status, want, "{name}: {v}");
    let err = v["error"].clone();
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{name}: {v}"
    );
    assert!(
        err["type"].is_string() && err["code"].is_string(),
        "{name}: {v}"
    );
    assert!(
        err.as_object().unwrap().contains_key("param"),
        "{name}: {v}"
    );
    assert_eq!(s.fake.count(), 0, "{name} reached the engine");
    err
}

#[tokio::test]
async fn bad_input_never_reaches_the_engine() {
    let s = serve(ClusterConfig::parse(KEYED, "t").unwrap()).await;
    let stop20: Vec<String> = (0..20).map(|i| format!("s{i}")).collect();
    let msgs = |m: Value| json!({ "messages": m });
    // (name, body, param named in the error)
    let chat_cases = [
        (
            "wrong type",
            chat_body(json!({"max_tokens": "x"})),
            "max_tokens",
        ),
        (
            "negative max_tokens",
            chat_body(json!({"max_tokens": -5})),
            "max_tokens",
        ),
        (
            "temperature 5",
            chat_body(json!({"temperature": 5})),
            "temperature",
        ),
        ("top_p 0", chat_body(json!({"top_p": 0})), "top_p"),
        ("n=2", chat_body(json!({"n": 2})), "n"),
        (
            "penalty out of range",
            chat_body(json!({"presence_penalty": 2.5})),
            "presence_penalty",
        ),
        (
            "frequency penalty out of range",
            chat_body(json!({"frequency_penalty": -3})),
            "frequency_penalty",
        ),
        ("unknown field", chat_body(json!({"min_p": 0.1})), "min_p"),
        (
            "a completions field on chat",
            chat_body(json!({"best_of": 1})),
            "best_of",
        ),
        (
            "json_schema without its object",
            chat_body(json!({"response_format": {"type": "json_schema"}})),
            "response_format.json_schema",
        ),
        (
            "a schema that is not an object",
            chat_body(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": 3}}})),
            "response_format.json_schema.schema",
        ),
        (
            "unknown response_format type",
            chat_body(json!({"response_format": {"type": "yaml"}})),
            "response_format",
        ),
        (
            "two constraints",
            chat_body(json!({"response_format": {"type": "json_object"},
                             "guided_regex": "[0-9]+"})),
            "guided_regex",
        ),
        (
            "empty regex",
            chat_body(json!({"guided_regex": ""})),
            "guided_regex",
        ),
        (
            "tool of another type",
            chat_body(json!({"tools": [{"type": "code_interpreter"}]})),
            "tools[0].type",
        ),
        (
            "tool name with a space",
            chat_body(json!({"tools": [{"type": "function",
                "function": {"name": "get weather"}}]})),
            "tools[0].function.name",
        ),
        (
            "tool_choice required without tools",
            chat_body(json!({"tool_choice": "required"})),
            "tool_choice",
        ),
        (
            "tool_choice names an unlisted function",
            chat_body(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                             "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            ),
            "tool_choice",
        ),
        (
            "a required call and a response_format",
            chat_body(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                             "tool_choice": "required",
                             "response_format": {"type": "json_object"}}),
            ),
            "tool_choice",
        ),
        (
            "tool message without tool_call_id",
            msgs(json!([{"role": "user", "content": "hi"},
                        {"role": "tool", "content": "42"}])),
            "messages[1].tool_call_id",
        ),
        (
            "assistant call with arguments that are not JSON",
            msgs(json!([{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": null, "tool_calls": [{"id": "c",
                         "type": "function", "function": {"name": "f", "arguments": "{x"}}]}])),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            "legacy functions",
            chat_body(json!({"functions": [{"name": "f"}]})),
            "functions",
        ),
        (
            "audio",
            chat_body(json!({"modalities": ["text", "audio"]})),
            "modalities",
        ),
        (
            "logit_bias key not an id",
            chat_body(json!({"logit_bias": {"hello": 1}})),
            "logit_bias",
        ),
        (
            "logit_bias id out of range",
            chat_body(json!({"logit_bias": {"99999999": 1}})),
            "logit_bias",
        ),
        (
            "logit_bias value out of range",
            chat_body(json!({"logit_bias": {"5": 101}})),
            "logit_bias",
        ),
        (
            "logit_bias the same id twice",
            chat_body(json!({"logit_bias": {"5": 1, "05": 2}})),
            "logit_bias",
        ),
        ("suffix", json!({"prompt": "a", "suffix": "b"}), "suffix"),
        (
            "unknown role",
            msgs(json!([{"role": "wizard", "content": "x"}])),
            "messages[0].role",
        ),
        ("empty messages", msgs(json!([])), "messages"),
        (
            "image part",
            msgs(json!([{"role": "user", "content": [{"type": "image_url"}]}])),
            "messages[0].content[0].type",
        ),
        (
            "unknown model",
            chat_body(json!({"model": "gpt-4"})),
            "model",
        ),
        (
            "context overflow",
            chat_body(json!({"max_tokens": 250})),
            "messages",
        ),
        (
            "stop with 20 entries",
            chat_body(json!({"stop": stop20})),
            "stop",
        ),
        ("empty stop", chat_body(json!({"stop": [""]})), "stop"),
        (
            "top_logprobs 21",
            chat_body(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (
            "prompt overflow",
            json!({"prompt": "word ".repeat(400)}),
            "prompt",
        ),
        ("empty prompt", json!({"prompt": ""}), "prompt"),
        ("bad token id", json!({"prompt": [1, 99_999_999]}), "prompt"),
        ("negative token id", json!({"prompt": [1, -1]}), "prompt"),
        ("batched prompt", json!({"prompt": ["a", "b"]}), "prompt"),
    ];
    for (name, body, param) in chat_cases {
        let path = if body.get("prompt").is_some() {
            CMPL
        } else {
            CHAT
        };
        let err = refused(&s, name, path, Some(KEY), body.to_string().into(), 400).await;
        assert_eq!(err["param"], param, "{name}: {err}");
        match name {
            "context overflow" => {
                let m = err["message"].as_str().unwrap();
                assert!(
                    m.contains("256 tokens") && m.contains("250 in the completion"),
                    "{m}"
                );
                assert_eq!(err["code"], "context_length_exceeded");
            }
            "unknown model" => assert_eq!(err["code"], "model_not_found"),
            _ => {}
        }
    }
    let raw: [(&str, &[u8]); 3] = [
        ("malformed json", b"{\"messages\": ["),
        ("invalid utf-8", b"{\xff\xfe}"),
        ("not an object", b"[1,2]"),
    ];
    for (name, body) in raw {
        refused(&s, name, CHAT, Some(KEY), body.to_vec(), 400).await;
    }
    let good = chat_body(json!({"max_tokens": 8})).to_string().into_bytes();
    let big = vec![b' '; (1 << 20) + 4096];
    refused(&s, "oversized body", CHAT, Some(KEY), big, 413).await;
    for (name, auth) in [
        ("unknown key", Some("Bearer sk-nobody-00")),
        ("missing key", None),
    ] {
        let err = refused(&s, name, CHAT, auth, good.clone(), 401).await;
        assert_eq!(err["code"], "invalid_api_key");
    }
    refused(
        &s,
        "unknown route",
        "/v1/nothing",
        Some(KEY),
        good.clone(),
        404,
    )
    .await;
    let r = s
        .http
        .get(format!("{}{CHAT}", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "method_not_allowed"
    );

    let m = s.metrics.render();
    assert!(m.contains("unauthorized") && m.contains("too_large"), "{m}");
    // After all of that a valid request still succeeds, as the right tenant.
    let r = s
        .http
        .post(format!("{}{CHAT}", s.base))
        .header("authorization", "Bearer sk-hobby-001")
        .body(good)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(s.fake.count(), 1);
    assert_eq!(s.fake.last().0.tenant.0, 1);
}

#[tokio::test]
async fn engine_rejections_keep_their_status_and_retry_after() {
    let s = serve(ClusterConfig::open()).await;
    let cases = [
        (
            Rejection::TenantLimit {
                tenant: "default".into(),
                reason: "max_concurrent".into(),
                retry_after_s: 2,
            },
            429,
            Some("2"),
        ),
        (
            Rejection::QueueFull {
                tier: "default".into(),
                queue_len_max: 4,
                retry_after_s: 5,
            },
            503,
            Some("5"),
        ),
        (Rejection::Unavailable, 503, None),
        (Rejection::Invalid("nope".into()), 400, None),
        (
            Rejection::TooLong {
                prompt_tokens: 1,
                max_tokens: 2,
                max_model_len: 2,
            },
            400,
            None,
        ),
    ];
    for (rej, want, retry) in cases {
        s.fake.set(Mode::Reject(rej.clone()));
        for stream in [false, true] {
            let r = s
                .http
                .post(format!("{}/v1/chat/completions", s.base))
                .json(&chat_body(json!({"stream": stream})))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), want, "{rej:?}");
            let ra = r
                .headers()
                .get("retry-after")
                .map(|h| h.to_str().unwrap().to_owned());
            assert_eq!(ra.as_deref(), retry, "{rej:?}");
            let v: Value = r.json().await.unwrap();
            assert!(v["error"]["message"].is_string(), "{v}");
        }
    }
    let m = s.metrics.render();
    assert!(
        m.contains("tenant_limit") && m.contains("queue_full"),
        "{m}"
    );
}

#[tokio::test]
async fn engine_failures_map_to_status_or_an_error_event() {
    let s = serve(ClusterConfig::open()).await;
    let cases = [
        (
            EngineFailure::QueueTimeout {
                waited_ms: 10,
                limit_ms: 5,
            },
            503,
        ),
        (EngineFailure::ShuttingDown, 503),
        (
            EngineFailure::TooLargeForCache {
                need_blocks: 9,
                max_blocks: 3,
            },
            400,
        ),
        (EngineFailure::Internal("boom".into()), 500),
        (EngineFailure::EngineLost("stage 1 lost".into()), 503),
    ];
    for (f, want) in cases {
        s.fake
            .set(Mode::Fail(script_ids()[..2].to_vec(), f.clone()));
        let (st, v) = s
            .post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 8}))
            .await;
        assert_eq!(st, want, "{f:?}: {v}");
        assert!(v["error"]["message"].is_string());

        let body = json!({"prompt": "hi", "max_tokens": 8, "stream": true});
        let (st, data) = s.post_sse("/v1/completions", &body).await;
        assert_eq!(st, 200);
        let chunks = parse_chunks(&data);
        let last = chunks.last().unwrap();
        assert!(last["error"]["message"].is_string(), "{f:?}: {data:?}");
        assert_eq!(chunks.len(), 3, "two tokens then the error: {data:?}");
    }
}

/// With `[telemetry] detail_keys`, `/metrics` wants one (401 in OpenAI's
/// shape otherwise) and `/ready` without one answers its status and
/// `ready` only (what a probe needs); `/health` stays open.
#[tokio::test]
async fn metrics_and_ready_detail_behind_a_key() {
    let cfg = ClusterConfig::parse(
        "[telemetry]\ndetail_keys = [\"ops-0123456789abcdef\"]\n\n[[tiers]]\nname = \"t\"\n\n\
         [[tenants]]\nname = \"a\"\ntier = \"t\"\napi_keys = [\"sk-a-0123456789\"]\n",
        "c.toml",
    )
    .unwrap();
    let s = serve(cfg).await;
    let get = |p: &str, key: Option<&str>| {
        let mut r = s.http.get(format!("{}{p}", s.base));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    assert_eq!(get("/health", None).await.unwrap().status().as_u16(), 200);
    for key in [None, Some("sk-a-0123456789"), Some("ops-wrong-key-00000")] {
        let r = get("/metrics", key).await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{key:?}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "invalid_detail_key");
        let r = get("/ready", key).await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(r.json::<Value>().await.unwrap(), json!({"ready": true}));
    }
    let r = get("/metrics", Some("ops-0123456789abcdef")).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = get("/ready", Some("ops-0123456789abcdef")).await.unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["kv_blocks"]["total"], 100, "{v}");
    s.fake.ready.store(false, Ordering::SeqCst);
    let r = get("/ready", None).await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
}

#[tokio::test]
async fn health_ready_metrics_models() {
    let s = serve(ClusterConfig::open()).await;
    let get = |p: &str| s.http.get(format!("{}{p}", s.base)).send();
    let r = get("/health").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"status": "ok"}));

    let r = get("/ready").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["ready"], true);
    assert_eq!(v["model"], MODEL);
    assert_eq!(
        (v["steps"].as_u64(), v["running"].as_u64()),
        (Some(42), Some(1))
    );
    assert_eq!(v["queue"], json!({"default": 3}));
    assert_eq!(
        v["tiers"],
        json!([{"name": "default", "queued": 3, "running": 1}])
    );
    assert_eq!(
        v["kv_blocks"],
        json!({"total": 100, "used": 30, "free": 60, "cached": 10,
               "held_for_transfer": 4, "reserved_for_import": 2})
    );
    assert_eq!(v["preemptions"], 2);
    s.fake.ready.store(false, Ordering::SeqCst);
    let r = get("/ready").await.unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["ready"], false);

    let r = get("/metrics").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["content-type"], "text/plain; version=0.0.4");

    let r = get("/v1/models").await.unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["owned_by"], "flotilla");
    assert_eq!(v["data"][0]["max_model_len"], MAX_MODEL_LEN as u64);

    let keyed = serve(ClusterConfig::parse(KEYED, "t").unwrap()).await;
    let r = keyed
        .http
        .get(format!("{}/v1/models", keyed.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = keyed
        .http
        .get(format!("{}/v1/models", keyed.base))
        .bearer_auth("sk-acme-0001")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

const ADMIN: &str = "admin-key-0123456789";

/// A Router's config with an admin key.
fn with_admin(keys: &str) -> ClusterConfig {
    let toml = format!(
        r#"
[[tiers]]
name = "paid"

[cluster]
admin_keys = [{keys}]

[[nodes]]
name = "router"
role = "router"
addr = "127.0.0.1:7400"
http = "127.0.0.1:8000"

[[nodes]]
name = "worker-1"
role = "worker"
addr = "127.0.0.1:7401"
"#
    );
    ClusterConfig::parse(&toml, "t").unwrap()
}

#[tokio::test]
async fn the_drain_endpoint_wants_an_admin_key_and_a_node() {
    let post = |s: &Server, key: Option<&str>, body: Value| {
        let mut r = s.http.post(format!("{}/admin/drain", s.base)).json(&body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        async move {
            let r = r.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let body = json!({"node": "worker-1", "grace_s": 5});
    // No admin keys: the endpoint is off, even with a tenant's key.
    let open = serve(ClusterConfig::parse(KEYED, "t").unwrap()).await;
    let (st, v) = post(&open, Some("sk-acme-0001"), body.clone()).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (403, Some("admin_disabled")),
        "{v}"
    );
    let s = serve(with_admin(&format!("{ADMIN:?}"))).await;
    for key in [None, Some("admin-key-0123456788"), Some("admin-key")] {
        let (st, v) = post(&s, key, body.clone()).await;
        assert_eq!(
            (st, v["error"]["code"].as_str()),
            (401, Some("invalid_admin_key")),
            "{v}"
        );
    }
    for (bad, param) in [
        (json!({"grace_s": 5}), "node"),
        (json!({"node": "worker-1", "grace_s": -1}), "grace_s"),
        (json!({"node": "worker-1", "grace_s": "soon"}), "grace_s"),
    ] {
        let (st, v) = post(&s, Some(ADMIN), bad).await;
        assert_eq!(
            (st, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
    // Authorized and well-formed, but this engine has no nodes.
    let (st, v) = post(&s, Some(ADMIN), body).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (404, Some("node_not_found")),
        "{v}"
    );
    assert!(
        v["error"]["message"].as_str().unwrap().contains("SIGTERM"),
        "{v}"
    );
    assert_eq!(s.fake.count(), 0);
}
