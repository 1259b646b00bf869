//! `flotilla serve` end to end: the real binary on the default model, driven
//! over HTTP: the `openai` Python client, cancellation storms, tiers under a
//! flood, bad input.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{client, get_json, openai_python, ready, run_client_script};
use flotilla_bench::SpecCounts;
use futures_util::StreamExt;
use serde_json::{Value, json};

const PAID_KEY: &str = "sk-test-paid-000001";
const FREE_KEY: &str = "sk-test-free-000001";

struct Server {
    child: Child,
    base: String,
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(free_concurrent: u32, free_queue: usize) -> String {
    format!(
        r#"
[[tiers]]
name = "paid"
weight = 8
priority = 2
queue_len_max = 256

[[tiers]]
name = "free"
weight = 1
priority = 0
queue_len_max = {free_queue}

[[tenants]]
name = "paid-co"
tier = "paid"
api_keys = ["{PAID_KEY}"]

[[tenants]]
name = "free-user"
tier = "free"
api_keys = ["{FREE_KEY}"]
max_concurrent = {free_concurrent}
"#
    )
}

/// Starts the binary on the default model, on an ephemeral port, and waits
/// for its ready line.
fn start(config_text: &str, extra: &[&str]) -> Server {
    start_model(&flotilla_hub::test_model_path(), config_text, extra)
}

/// As [`start`], on the model file at `model`.
fn start_model(model: &std::path::Path, config_text: &str, extra: &[&str]) -> Server {
    start_env(model, config_text, extra, &[])
}

/// As [`start_model`], with `env` set in the server's environment.
fn start_env(
    model: &std::path::Path,
    config_text: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Server {
    let dir = std::env::temp_dir().join(format!(
        "flotilla-serve-test-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("cluster.toml");
    std::fs::write(&cfg, config_text).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("serve")
        .arg("--model")
        .arg(model)
        .arg("--config")
        .arg(&cfg)
        .args(["--port", "0"])
        .args(if extra.contains(&"--kv-cache-bytes") {
            &[][..]
        } else {
            &["--kv-cache-bytes", "200000000"][..]
        })
        .args(extra)
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn flotilla serve");
    let base = common::server_url(
        child.stderr.take().unwrap(),
        "server",
        Duration::from_secs(120),
    )
    .expect("server did not print its URL");
    Server {
        child,
        base,
        _dir: TempDir(dir),
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(0u8)
}

/// The server's draft totals, read as `flotilla bench` reads them; none
/// before anything was drafted.
async fn spec_counts(base: &str) -> SpecCounts {
    let m = metrics_text(&client(), base).await;
    SpecCounts::from_metrics(&m).unwrap_or(SpecCounts {
        drafted: 0,
        accepted: 0,
    })
}

/// `GET /config` with the paid key: the settings the server runs.
async fn settings(base: &str) -> Value {
    get_json(base, "/config", Some(PAID_KEY)).await
}

/// Polls /ready until nothing runs or waits (cancels are applied at the
/// next step boundary).
async fn settle(base: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let r = ready(base).await;
        let queued: u64 = r["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["queued"].as_u64().unwrap())
            .sum();
        if r["running"] == 0 && queued == 0 {
            return r;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "engine never settled: {r}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The server's `/metrics` page.
async fn metrics_text(c: &reqwest::Client, base: &str) -> String {
    let r = c.get(format!("{base}/metrics")).send().await.unwrap();
    r.text().await.unwrap()
}

/// `body` with `extra`'s fields over it, sent to `/v1/completions` as the
/// paid tenant; the answer of a 200.
async fn paid_completion(c: &reqwest::Client, base: &str, mut body: Value, extra: &Value) -> Value {
    let fields = body.as_object_mut().unwrap();
    fields.extend(extra.as_object().unwrap().clone());
    let r = c
        .post(format!("{base}/v1/completions"))
        .header("authorization", format!("Bearer {PAID_KEY}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "stream": stream,
           "temperature": 0, "ignore_eos": true})
}

/// Runs tests/openai_client.py, tests/structured_outputs.py and
/// tests/tool_calls.py against `srv`.
fn run_openai_client(python: &str, srv: &Server) {
    for script in ["openai_client.py", "structured_outputs.py", "tool_calls.py"] {
        run_client_script(python, &srv.base, PAID_KEY, script);
    }
}

/// The same client against Gemma 3 270M: SentencePiece detokenization in
/// the stream, the built-in Gemma turn format on the chat endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_against_gemma3() {
    let python = openai_python();
    let srv = start_model(
        &flotilla_hub::test_gemma3_path(),
        &config(4, 8),
        &["--max-model-len", "4096"],
    );
    run_openai_client(&python, &srv);
}

/// The same client against Qwen2.5-Coder (0.5B here; the 1.5B with
/// `FLOTILLA_TEST_QWEN`): byte-level BPE of a 151k vocabulary, the file's
/// ChatML template, and its native tool-call format (`<tool_call>` JSON)
/// on the chat endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_against_qwen25_coder() {
    let python = openai_python();
    let srv = start_model(
        &flotilla_hub::test_qwen_path(),
        &config(4, 8),
        &["--max-model-len", "4096"],
    );
    run_openai_client(&python, &srv);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_chat_and_completions() {
    let python = openai_python();
    let srv = start(&config(4, 8), &[]);
    run_openai_client(&python, &srv);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_streams_give_back_every_block() {
    let srv = start(&config(64, 64), &["--max-num-seqs", "32"]);
    let base = srv.base.clone();
    let before = settle(&base).await;
    let c = client();
    // 200 streamed requests, 32 at a time; a seeded 30% are dropped after
    // a few tokens.
    let mut seed = 0x5eed_u64;
    let plan: Vec<(usize, bool, usize)> = (0..200)
        .map(|i| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let drop_it = (seed >> 33) % 100 < 30;
            let after = 1 + ((seed >> 20) % 6) as usize;
            (i, drop_it, after)
        })
        .collect();
    let dropped = plan.iter().filter(|p| p.1).count();
    assert!((40..=80).contains(&dropped), "{dropped}");
    let results = futures_util::stream::iter(plan)
        .map(|(i, drop_it, after)| {
            let c = c.clone();
            let base = base.clone();
            async move {
                let body = completion(
                    &format!("Request {i}: tell me a story about the number {i}."),
                    24,
                    true,
                );
                let resp = c
                    .post(format!("{base}/v1/completions"))
                    .bearer_auth(PAID_KEY)
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let mut s = resp.bytes_stream();
                let mut chunks = 0;
                let mut done = false;
                while let Some(b) = s.next().await {
                    let b = b.unwrap();
                    let text = String::from_utf8_lossy(&b);
                    chunks += text.matches("data: {").count();
                    if text.contains("data: [DONE]") {
                        done = true;
                    }
                    if drop_it && chunks >= after {
                        return (true, done);
                    }
                }
                (false, done)
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    let completed = results.iter().filter(|r| !r.0 && r.1).count();
    assert_eq!(completed + results.iter().filter(|r| r.0).count(), 200);
    let after = settle(&base).await;
    assert_eq!(after["running"], 0, "{after}");
    assert_eq!(
        after["kv_blocks"]["used"], 0,
        "blocks still leased: before {before}, after {after}"
    );
    let total = after["kv_blocks"]["total"].as_u64().unwrap();
    let free = after["kv_blocks"]["free"].as_u64().unwrap();
    let cached = after["kv_blocks"]["cached"].as_u64().unwrap();
    assert_eq!(free + cached, total, "{after}");
    let metrics = metrics_text(&c, &base).await;
    assert!(
        metrics.contains("flotilla_requests_total{state=\"cancelled\",tier=\"paid\"}"),
        "cancellations not counted:\n{metrics}"
    );
    // The pool's shape: its dtype (the default, f16) and blocks of
    // SmolLM2-135M (30 layers x K and V x 3 heads x 16 rows x 64 x 2 bytes).
    assert_eq!(after["kv_cache_dtype"], "f16", "{after}");
    let shape =
        format!("flotilla_kv_cache_blocks{{bytes_per_block=\"368640\",dtype=\"f16\"}} {total}");
    assert!(metrics.contains(&shape), "no {shape}:\n{metrics}");
    // The scheduler's fit of what a step costs on this machine, positive.
    let per_token: f64 = metrics
        .lines()
        .find(|l| l.starts_with("flotilla_step_cost_seconds{part=\"per_token\""))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no fitted step cost:\n{metrics}"));
    assert!(per_token > 0.0 && per_token < 1.0, "{per_token}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paid_trickle_survives_a_free_flood() {
    // The free tenant may hold 4 requests and its tier queues 4 more: the
    // rest of a 48-wide flood must be refused at once with 429/503.
    let srv = start(&config(4, 4), &["--max-num-seqs", "8"]);
    let base = srv.base.clone();
    let c = client();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut flood = Vec::new();
    for w in 0..48 {
        let c = c.clone();
        let base = base.clone();
        let stop = stop.clone();
        flood.push(tokio::spawn(async move {
            let mut codes: Vec<u16> = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = c
                    .post(format!("{base}/v1/completions"))
                    .bearer_auth(FREE_KEY)
                    .json(&completion(&format!("free flood {w}"), 16, false))
                    .send()
                    .await
                    .unwrap();
                let code = r.status().as_u16();
                if code == 429 || code == 503 {
                    assert!(
                        r.headers().contains_key("retry-after"),
                        "{code} without Retry-After"
                    );
                    let _ = r.bytes().await;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                } else {
                    let _ = r.bytes().await;
                }
                codes.push(code);
            }
            codes
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut paid_ok = 0;
    for i in 0..8 {
        let t0 = Instant::now();
        let r = c
            .post(format!("{base}/v1/completions"))
            .bearer_auth(PAID_KEY)
            .json(&completion(&format!("paid request {i}"), 16, false))
            .send()
            .await
            .unwrap();
        let code = r.status();
        let body: Value = r.json().await.unwrap();
        assert_eq!(code, 200, "paid request {i} failed: {body}");
        assert_eq!(body["usage"]["completion_tokens"], 16);
        eprintln!("paid {i}: {:?}", t0.elapsed());
        paid_ok += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut codes = Vec::new();
    for f in flood {
        codes.extend(f.await.unwrap());
    }
    let refused = codes.iter().filter(|&&c| c == 429 || c == 503).count();
    let ok = codes.iter().filter(|&&c| c == 200).count();
    let other: Vec<u16> = codes
        .iter()
        .copied()
        .filter(|&c| c != 200 && c != 429 && c != 503)
        .collect();
    eprintln!("paid ok {paid_ok}/8; free: {ok} served, {refused} refused, other {other:?}");
    assert_eq!(paid_ok, 8);
    assert!(refused > 0, "the flood was never refused");
    assert!(ok > 0, "free work starved completely");
    assert!(
        other.is_empty(),
        "free flood saw {other:?} (timeouts or errors)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_4xx_and_the_server_keeps_serving() {
    let srv = start(&config(4, 8), &["--max-model-len", "256"]);
    let base = srv.base.clone();
    let c = client();
    let url = format!("{base}/v1/chat/completions");
    let cases: Vec<(&str, Vec<u8>, Option<&str>, u16)> = vec![
        (
            "malformed json",
            b"{\"messages\": [".to_vec(),
            Some(PAID_KEY),
            400,
        ),
        (
            "invalid utf-8",
            b"{\"messages\": \"\xff\xfe\"}".to_vec(),
            Some(PAID_KEY),
            400,
        ),
        (
            "wrong type",
            br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":"x"}"#.to_vec(),
            Some(PAID_KEY),
            400,
        ),
        (
            "unknown role",
            br#"{"messages":[{"role":"wizard","content":"hi"}]}"#.to_vec(),
            Some(PAID_KEY),
            400,
        ),
        (
            "temperature out of range",
            br#"{"messages":[{"role":"user","content":"hi"}],"temperature":9}"#.to_vec(),
            Some(PAID_KEY),
            400,
        ),
        (
            "context overflow",
            br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":5000}"#.to_vec(),
            Some(PAID_KEY),
            400,
        ),
        (
            "unknown model",
            br#"{"model":"gpt-9","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            Some(PAID_KEY),
            400,
        ),
        (
            "unknown key",
            br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            Some("sk-not-a-real-key"),
            401,
        ),
        (
            "no key",
            br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            None,
            401,
        ),
        (
            "oversized body",
            vec![b' '; (1 << 20) + 4096],
            Some(PAID_KEY),
            413,
        ),
    ];
    for (name, body, key, want) in cases {
        let mut rq = c
            .post(&url)
            .body(body)
            .header("content-type", "application/json");
        if let Some(k) = key {
            rq = rq.bearer_auth(k);
        }
        let r = rq.send().await.unwrap();
        let code = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(code, want, "{name}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}: not OpenAI's error shape: {v}"
        );
        if name == "context overflow" {
            let m = v["error"]["message"].as_str().unwrap();
            assert!(m.contains("256") && m.contains("5000"), "{m}");
        }
    }
    let r = c
        .post(&url)
        .bearer_auth(PAID_KEY)
        .json(&json!({"messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":8}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["choices"][0]["message"]["content"].as_str().is_some(),
        "{v}"
    );
    let r = ready(&base).await;
    assert_eq!(r["ready"], true, "{r}");
}

/// `logit_bias` and `frequency_penalty` reach the sampler of the real
/// engine: +100 on one token makes every greedy token that one; +30 with a
/// frequency penalty of 2 makes it first, until its count has taken the
/// bias away (each use costs 2), so the output no longer repeats it only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_and_frequency_penalty_steer_the_real_engine() {
    let srv = start(&config(4, 8), &["--max-model-len", "256"]);
    let c = client();
    let tokens = |extra: Value| {
        let (c, base) = (c.clone(), srv.base.clone());
        async move {
            let body = json!({"prompt": [1, 504, 3458, 282, 4649, 314], "max_tokens": 24,
                              "temperature": 0, "ignore_eos": true, "logprobs": 0});
            let v = paid_completion(&c, &base, body, &extra).await;
            let t: Vec<String> = v["choices"][0]["logprobs"]["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_owned())
                .collect();
            assert_eq!(t.len(), 24, "{v}");
            t
        }
    };
    let plain = tokens(json!({})).await;
    let forced = tokens(json!({"logit_bias": {"28": 100}})).await;
    assert!(forced.iter().all(|t| t == &forced[0]), "{forced:?}");
    assert_ne!(plain, forced);
    let biased = tokens(json!({"logit_bias": {"28": 30}})).await;
    assert!(biased.iter().all(|t| t == &forced[0]), "{biased:?}");
    let penalised = tokens(json!({"logit_bias": {"28": 30}, "frequency_penalty": 2})).await;
    assert_eq!(penalised[0], forced[0], "{penalised:?}");
    assert!(
        penalised.iter().any(|t| t != &forced[0]),
        "the penalty never took the bias away: {penalised:?}"
    );
}

/// Speculative decoding through the whole server: a prompt that repeats
/// itself gets drafts accepted (the server's /metrics says so), and the text
/// is the same token for token as with speculation off for the request
/// (`"speculative": false`), greedy, sampled with a seed, with presence
/// and frequency penalties, and under a JSON Schema (whose forced keys are
/// drafted too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_decoding_changes_speed_not_text() {
    let srv = start(&config(4, 8), &["--max-model-len", "1024"]);
    let c = client();
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(12);
    let run = |speculative: bool, sampling: Value| {
        let (c, base, text) = (c.clone(), srv.base.clone(), text.clone());
        async move {
            let body = json!({"prompt": text, "max_tokens": 96, "ignore_eos": true,
                              "logprobs": 0, "speculative": speculative});
            let v = paid_completion(&c, &base, body, &sampling).await;
            assert_eq!(v["usage"]["completion_tokens"], 96, "{v}");
            (
                v["choices"][0]["text"].clone(),
                v["choices"][0]["logprobs"]["tokens"].clone(),
            )
        }
    };
    let counts = || spec_counts(&srv.base);
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 0.8, "top_p": 0.95, "seed": 5}),
        // Penalties: each verify position's bias counts the draft before it.
        json!({"temperature": 0, "presence_penalty": 0.2, "frequency_penalty": 0.1}),
    ] {
        let before = counts().await;
        let off = run(false, sampling.clone()).await;
        assert_eq!(counts().await, before, "an opted-out request drafted");
        let on = run(true, sampling.clone()).await;
        let after = counts().await;
        assert_eq!(on, off, "{sampling}: speculation changed the text");
        let SpecCounts { drafted, accepted } = SpecCounts::between(before, after);
        assert!(
            accepted > 0 && accepted <= drafted,
            "{sampling}: {accepted} of {drafted} draft tokens accepted"
        );
    }
    // A constrained output: each verify position has the grammar's mask
    // after the draft before it, and the schema's forced keys are drafts.
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "city": {"type": "string"},
        "occupation": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "city", "occupation", "age"], "additionalProperties": false});
    let structured = |speculative: bool, sampling: Value| {
        let (c, base, schema) = (c.clone(), srv.base.clone(), schema.clone());
        async move {
            let body = json!({"prompt": "A person, as JSON: ", "max_tokens": 80,
                "speculative": speculative,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": schema}}});
            let v = paid_completion(&c, &base, body, &sampling).await;
            v["choices"][0]["text"].as_str().unwrap().to_string()
        }
    };
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 0.7, "seed": 3}),
    ] {
        let before = counts().await;
        let off = structured(false, sampling.clone()).await;
        let on = structured(true, sampling.clone()).await;
        let SpecCounts { drafted, accepted } = SpecCounts::between(before, counts().await);
        assert_eq!(
            on, off,
            "{sampling}: speculation changed the structured text"
        );
        assert!(off.contains("\"occupation\":"), "{off}");
        assert!(
            accepted > 0 && accepted <= drafted,
            "{sampling}: {accepted} of {drafted} draft tokens accepted"
        );
    }
    let r = settle(&srv.base).await;
    assert_eq!(r["kv_blocks"]["used"], 0, "{r}");
}

/// `--speculative self`: where the text gives the lookup nothing, the
/// model's own first layers guess the draft (the GpuWorker's draft passes
/// before the step), and the text is still the same token for token as
/// without speculation, greedy and sampled; every block comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_draft_changes_speed_not_text() {
    let srv = start(
        &config(4, 8),
        &["--speculative", "self", "--speculative-draft-layers", "26"],
    );
    let c = client();
    let cfg = settings(&srv.base).await;
    assert_eq!(cfg["speculative"], "self", "{cfg}");
    let counts = || spec_counts(&srv.base);
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 0.8, "top_p": 0.95, "seed": 9}),
    ] {
        let run = |speculative: bool| {
            let (c, base, sampling) = (c.clone(), srv.base.clone(), sampling.clone());
            async move {
                let body = json!({"prompt": "Write a short story about a lighthouse keeper.",
                                  "max_tokens": 64, "ignore_eos": true,
                                  "speculative": speculative});
                let v = paid_completion(&c, &base, body, &sampling).await;
                assert_eq!(v["usage"]["completion_tokens"], 64, "{v}");
                v["choices"][0]["text"].as_str().unwrap().to_string()
            }
        };
        let before = counts().await;
        let off = run(false).await;
        let on = run(true).await;
        let SpecCounts { drafted, accepted } = SpecCounts::between(before, counts().await);
        assert_eq!(on, off, "{sampling}: a self-draft changed the text");
        assert!(
            drafted > 0 && accepted <= drafted,
            "{sampling}: {accepted} of {drafted} draft tokens accepted"
        );
        if sampling["temperature"] == 0 {
            assert!(
                accepted > 0,
                "greedy: none of {drafted} draft tokens accepted"
            );
        }
    }
    let r = settle(&srv.base).await;
    assert_eq!(r["kv_blocks"]["used"], 0, "{r}");
}

/// `--speculative draft`: a draft model beside the model in the worker
/// guesses where the text gives the lookup nothing. The draft here is the
/// test model itself with its logits cut to the first 4,096 token ids
/// (`--draft-vocab`): another output shape, guesses often right and
/// sometimes not. The text is the same token for token as without
/// speculation, greedy, sampled with a seed and under a logit bias (which
/// the draft proposes under); `/config` and `/metrics` show the draft and
/// its passes; every block (both halves) comes back. A draft of another
/// vocabulary is refused at start with both sizes named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_model_changes_speed_not_text() {
    let model = flotilla_hub::test_model_path();
    let draft = model.to_string_lossy().into_owned();
    let c = client();
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 0.8, "top_p": 0.95, "seed": 9}),
        json!({"temperature": 0, "logit_bias": {"28": 4}}),
    ] {
        // A server of its own each: here the draft costs nearly what the
        // model does, so once the cost sum has measured both it turns the
        // draft off; until then it drafts all it may.
        let srv = start(
            &config(4, 8),
            &[
                "--speculative",
                "draft",
                "--draft-model",
                &draft,
                "--draft-vocab",
                "4096",
                "--max-model-len",
                "1024",
            ],
        );
        let cfg = settings(&srv.base).await;
        assert_eq!(cfg["speculative"], "draft", "{cfg}");
        assert_eq!(cfg["draft_model"]["vocab"], 4096, "{cfg}");
        // The draft's KV shares the model's blocks: a block's bytes are both.
        let per_block =
            cfg["kv_cache_bytes"].as_u64().unwrap() / cfg["kv_cache_blocks"].as_u64().unwrap();
        assert_eq!(
            per_block,
            2 * cfg["draft_model"]["kv_bytes_per_block"].as_u64().unwrap(),
            "{cfg}"
        );
        let run = |speculative: bool| {
            let (c, base, sampling) = (c.clone(), srv.base.clone(), sampling.clone());
            async move {
                let body = json!({"prompt": "Write a short story about a lighthouse keeper.",
                                  "max_tokens": 48, "ignore_eos": true,
                                  "speculative": speculative});
                let v = paid_completion(&c, &base, body, &sampling).await;
                assert_eq!(v["usage"]["completion_tokens"], 48, "{v}");
                v["choices"][0]["text"].as_str().unwrap().to_string()
            }
        };
        let on = run(true).await;
        let m = metrics_text(&c, &srv.base).await;
        let passes: f64 = m
            .lines()
            .filter(|l| l.starts_with("flotilla_spec_draft_model_passes_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        let SpecCounts { drafted, accepted } = SpecCounts::from_metrics(&m).unwrap();
        let off = run(false).await;
        assert_eq!(on, off, "{sampling}: a draft model changed the text");
        assert!(passes > 0.0, "{sampling}: the draft model never ran");
        assert!(
            drafted > 0 && accepted <= drafted,
            "{sampling}: {accepted} of {drafted} draft tokens accepted"
        );
        if sampling["temperature"] == 0 {
            assert!(
                accepted > 0,
                "greedy: none of {drafted} draft tokens accepted"
            );
        }
        let r = settle(&srv.base).await;
        assert_eq!(r["kv_blocks"]["used"], 0, "{r}");
        assert_eq!(r["draft_model"], cfg["draft_model"], "{r}");
    }
}

/// A draft model whose vocabulary differs from the model's is refused
/// before anything loads, with both sizes named; `--speculative draft`
/// without one names the flag it needs.
#[test]
fn a_draft_model_must_share_the_vocabulary() {
    let model = flotilla_hub::test_model_path();
    // Gemma 3's vocabulary (262,144 tokens) against SmolLM2's (49,152).
    let other = flotilla_hub::test_gemma3_path();
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("serve")
        .arg("--model")
        .arg(&model)
        .arg("--draft-model")
        .arg(&other)
        .args(["--port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("49152 tokens") && err.contains("262144 tokens"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("serve")
        .arg("--model")
        .arg(&model)
        .args(["--speculative", "draft", "--port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--draft-model NAME|PATH"), "{err}");
}

/// The KV offload tier through the whole server, on a KV cache of 40
/// blocks (640 tokens) with a tier of 200. A second long prompt evicts the
/// first's cached blocks into the tier; the first prompt's next turn
/// restores them (`/ready` and `/metrics` count them) and its greedy text
/// is the one computed the first time. Then three long streams at once
/// preempt one another over the small cache; the preempted ones come back
/// through the tier, each with the text it gets alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_offload_tier_restores_evicted_prefixes_with_the_same_text() {
    // f16 KV of SmolLM2-135M: 368,640 bytes a block of 16 tokens.
    let block = 368_640u64;
    let (cache, tier) = ((40 * block).to_string(), (200 * block).to_string());
    let srv = start(
        &config(4, 8),
        &[
            "--max-model-len",
            "512",
            "--kv-cache-bytes",
            &cache,
            "--kv-offload-bytes",
            &tier,
            "--speculative",
            "off",
        ],
    );
    let c = client();
    let r = ready(&srv.base).await;
    assert_eq!(r["kv_blocks"]["total"], 40, "{r}");
    assert_eq!(r["kv_offload"]["total"], 200, "{r}");
    let greedy = json!({"temperature": 0});
    let complete = |prompt: String, max_tokens: u32| {
        let (c, base, greedy) = (c.clone(), srv.base.clone(), greedy.clone());
        async move {
            let body = json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true});
            let v = paid_completion(&c, &base, body, &greedy).await;
            assert_eq!(v["usage"]["completion_tokens"], max_tokens, "{v}");
            v["choices"][0]["text"].as_str().unwrap().to_string()
        }
    };
    let chat = (0..34)
        .map(|i| format!("Turn {i}: the harbour master logs ship {i}."))
        .collect::<Vec<_>>()
        .join(" ");
    let other = (0..34)
        .map(|i| format!("Line {i}: a gardener plants row {i} of beans."))
        .collect::<Vec<_>>()
        .join(" ");
    let first = complete(chat.clone(), 8).await;
    let offload = |r: &Value, k: &str| r["kv_offload"][k].as_u64().unwrap();
    let before = settle(&srv.base).await;
    assert_eq!(offload(&before, "spilled"), 0, "{before}");
    complete(other, 8).await;
    let between = settle(&srv.base).await;
    assert!(
        offload(&between, "spilled") > 0,
        "nothing spilled: {between}"
    );
    let again = complete(chat, 8).await;
    let after = settle(&srv.base).await;
    assert!(offload(&after, "restored") > 0, "nothing restored: {after}");
    assert_eq!(again, first, "a restored prefix changed the text");
    let m = metrics_text(&c, &srv.base).await;
    assert!(
        m.lines()
            .any(|l| l.starts_with("flotilla_kv_offload_blocks_total{")
                && l.contains("move=\"restored\"")
                && !l.ends_with(" 0")),
        "{m}"
    );

    // Preemption: three streams of 150 + 200 tokens (22 blocks each) on
    // 40 blocks.
    let prompts: Vec<String> = (0..3)
        .map(|k| {
            (0..12)
                .map(|i| format!("Story {k}, part {i}: a lantern is lit on hill {i}."))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(complete(p.clone(), 200).await);
    }
    let preempted = settle(&srv.base).await["preemptions"].as_u64().unwrap();
    let restored = offload(&settle(&srv.base).await, "restored");
    let together =
        futures_util::future::join_all(prompts.iter().map(|p| complete(p.clone(), 200))).await;
    let end = settle(&srv.base).await;
    assert!(
        end["preemptions"].as_u64().unwrap() > preempted,
        "no stream was preempted: {end}"
    );
    assert!(
        offload(&end, "restored") > restored,
        "no preempted stream came back through the tier: {end}"
    );
    assert_eq!(
        together, alone,
        "preemption through the tier changed a text"
    );
    assert_eq!(end["kv_blocks"]["used"], 0, "{end}");
}

/// Without `--otlp-endpoint`, the standard OpenTelemetry variables turn
/// tracing on: the endpoint, the exporter's headers (an auth token a
/// collector would check) and the service name reach the receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_follows_the_standard_otel_environment() {
    let rx = common::OtlpReceiver::start().await;
    let srv = start_env(
        &flotilla_hub::test_model_path(),
        &config(4, 16),
        &["--speculative", "off"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &rx.endpoint),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "x-collector-token=t%20ok,x-team=serving",
            ),
            ("OTEL_SERVICE_NAME", "flotilla-eu-west"),
            ("OTEL_TRACES_SAMPLER", "parentbased_always_on"),
        ],
    );
    let v = paid_completion(
        &client(),
        &srv.base,
        completion("Hello", 4, false),
        &json!({}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let spans = rx
        .wait_for("the request's HTTP span", |s| {
            s.iter().any(|g| g.name == "POST /v1/completions")
        })
        .await;
    assert!(
        spans.iter().all(|g| g.service == "flotilla-eu-west"),
        "{spans:?}"
    );
    let headers = rx.headers.lock().unwrap().clone();
    for (k, v) in [("x-collector-token", "t ok"), ("x-team", "serving")] {
        assert!(
            headers.iter().any(|(hk, hv)| hk == k && hv == v),
            "{k}: {v} not in {headers:?}"
        );
    }
    // A sampler the variables cannot mean is refused at start, by name.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["serve", "--port", "0", "--model"])
        .arg(flotilla_hub::test_model_path())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &rx.endpoint)
        .env("OTEL_TRACES_SAMPLER", "sometimes")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("OTEL_TRACES_SAMPLER sometimes"), "{e}");
}

/// `serve --otlp-endpoint` against a real OTLP/HTTP receiver: two traced
/// requests that do not both fit in the KV cache. Each is one trace under
/// its HTTP span: prepare and admit at the front, then the engine's queue,
/// prefill in chunks of at most --max-num-batched-tokens, decode with an
/// event per step; the one preempted says so. `GET /config` shows the
/// settings the server runs with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_traces_each_request_through_its_phases_and_preemptions() {
    let rx = common::OtlpReceiver::start().await;
    // 40 blocks of 16 tokens: one sequence of 512 fits, two of ~420 do not.
    let blocks = 40u64;
    let srv = start(
        &config(4, 16),
        &[
            "--otlp-endpoint",
            &rx.endpoint,
            "--max-num-batched-tokens",
            "64",
            "--max-model-len",
            "512",
            "--speculative",
            "off",
            "--kv-cache-bytes",
            &(blocks * 368_640).to_string(),
        ],
    );
    let c = client();
    let cfg = settings(&srv.base).await;
    assert_eq!(cfg["max_num_batched_tokens"], 64);
    assert_eq!(cfg["kv_cache_blocks"], blocks);
    assert_eq!(cfg["quantization"], "Q4_1");
    assert_eq!(cfg["kv_cache_dtype"], "f16");
    // No key, no settings.
    let r = c.get(format!("{}/config", srv.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let prompt =
        "Tell me about the lighthouse keepers of the northern coast and their long winters. "
            .repeat(6);
    let max_tokens = 300;
    // Different from their first token: no prefix is shared.
    let reqs: Vec<_> = ["First", "Second"]
        .into_iter()
        .map(|which| {
            let body = completion(&format!("{which}. {prompt}"), max_tokens, false);
            let (c, base) = (c.clone(), srv.base.clone());
            tokio::spawn(async move { paid_completion(&c, &base, body, &json!({})).await })
        })
        .collect();
    for r in reqs {
        let v = r.await.unwrap();
        assert_eq!(v["usage"]["completion_tokens"], max_tokens);
    }
    let spans = rx
        .wait_for("both requests' engine spans", |s| {
            s.iter().filter(|g| g.name == "engine.request").count() == 2
                && s.iter()
                    .filter(|g| g.name == "POST /v1/completions")
                    .count()
                    == 2
        })
        .await;
    let mut preempted = 0;
    for root in spans.iter().filter(|g| g.name == "POST /v1/completions") {
        assert!(root.parent.is_empty(), "a new trace: {root:?}");
        assert_eq!(root.instance, "serve");
        let kids: Vec<&common::Got> = spans.iter().filter(|g| g.parent == root.span_id).collect();
        assert!(kids.iter().all(|g| g.trace_id == root.trace_id));
        let mut names: Vec<&str> = kids.iter().map(|g| g.name.as_str()).collect();
        names.sort();
        assert_eq!(
            names,
            ["engine.request", "gateway.admit", "gateway.prepare"]
        );
        let eng = kids.iter().find(|g| g.name == "engine.request").unwrap();
        assert_eq!(eng.attr("flotilla.engine.entry"), Some("whole"));
        assert_eq!(eng.attr("gen_ai.usage.output_tokens"), Some("300"));
        assert_eq!(eng.attr("flotilla.end"), Some("finished"));
        let under = |name: &str| -> Vec<&common::Got> {
            spans
                .iter()
                .filter(|g| g.name == name && g.parent == eng.span_id)
                .collect()
        };
        let (q, p, d) = (
            under("engine.queue"),
            under("engine.prefill"),
            under("engine.decode"),
        );
        assert_eq!((q.len(), p.len(), d.len()), (1, 1, 1));
        let chunks: Vec<&common::Got> = spans
            .iter()
            .filter(|g| g.name == "engine.prefill.chunk" && g.parent == p[0].span_id)
            .collect();
        let prompt_tokens: u64 = eng
            .attr("gen_ai.usage.input_tokens")
            .unwrap()
            .parse()
            .unwrap();
        assert!(prompt_tokens > 64 && chunks.len() as u64 >= prompt_tokens.div_ceil(64));
        for ch in &chunks {
            let n: u64 = ch.attr("flotilla.step.tokens").unwrap().parse().unwrap();
            assert!((1..=64).contains(&n), "a chunk of {n} tokens");
        }
        // A step event per decode step; recomputed chunks after a
        // preemption ride in steps too.
        let steps = d[0].events.iter().filter(|e| *e == "step").count();
        assert!(steps >= (max_tokens - 1) as usize, "{steps} steps");
        let n: u32 = eng.attr("flotilla.preemptions").unwrap().parse().unwrap();
        assert_eq!(
            n as usize,
            eng.events.iter().filter(|e| *e == "preempted").count()
        );
        // Each came back (its KV found in the cache, the rest recomputed).
        let resumed = eng.events.iter().filter(|e| *e == "resumed").count();
        assert_eq!(n as usize, resumed);
        preempted += n;
        assert!(q[0].end_ns <= p[0].start_ns && p[0].end_ns <= d[0].start_ns);
    }
    assert!(
        preempted >= 1,
        "the KV cache could not hold both: one was preempted"
    );
}
