//! A multi-process cluster on loopback: a Router and two workers, each
//! `flotilla node` its own process, QUIC with mutual TLS between them,
//! certificates made by `flotilla certs`, the default model. Driven over
//! HTTP (the `openai` Python client, raw SSE) while a worker is killed and
//! restarted.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod common;

use common::{client, openai_python, ready, run_client_script};
use futures_util::StreamExt;
use serde_json::{Value, json};

const PAID_KEY: &str = "sk-test-paid-000001";
const HEARTBEAT_MS: u64 = 250;
const DOWN_AFTER_MISSED: u64 = 2;

fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Node {
    name: String,
    child: Child,
}
impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Cluster {
    dir: Dir,
    config: PathBuf,
    base: String,
    nodes: Vec<Node>,
}

fn flotilla() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flotilla"))
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed: {text}");
    text
}

fn config_text(certs: &Path, addrs: &[String], http: String, roles: &[&str]) -> String {
    let mut text = format!(
        r#"
[cluster]
certs_dir = "{certs}"
heartbeat_interval_ms = {HEARTBEAT_MS}
down_after_missed = {DOWN_AFTER_MISSED}
reconnect_backoff_max_ms = 200

[[nodes]]
name = "router"
role = "router"
addr = "{}"
http = "{http}"
"#,
        addrs[0],
        certs = certs.display(),
    );
    for (i, r) in roles.iter().enumerate() {
        text += &format!(
            "\n[[nodes]]\nname = \"worker-{}\"\nrole = \"{r}\"\naddr = \"{}\"\n",
            i + 1,
            addrs[i + 1]
        );
    }
    text += &format!(
        r#"
[[tiers]]
name = "paid"

[[tenants]]
name = "paid-co"
tier = "paid"
api_keys = ["{PAID_KEY}"]
"#
    );
    text
}

/// Starts `flotilla node --name NAME`; returns it and, for the Router, the
/// URL from its ready line.
fn start_node(config: &Path, name: &str) -> (Node, Option<String>) {
    start_node_with(flotilla(), config, name, &[])
}

/// Starts a node with `cmd` (the binary, or `ip netns exec NS <binary>`).
fn start_node_with(
    mut cmd: Command,
    config: &Path,
    name: &str,
    extra: &[&str],
) -> (Node, Option<String>) {
    let mut child = cmd.args(["node", "--name", name, "--config"]).arg(config);
    // The default model unless the caller names one.
    if !extra.contains(&"--model") {
        child = child.arg("--model").arg(flotilla_hub::test_model_path());
    }
    let mut child = child
        .args([
            "--kv-cache-bytes",
            "100000000",
            "--threads",
            "1",
            "--max-model-len",
            "2048",
        ])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn flotilla node");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let tag = name.to_string();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if !sent && line.starts_with("flotilla: ") {
                let url = line
                    .find("http://")
                    .map(|i| line[i..].split_whitespace().next().unwrap().to_string());
                let _ = tx.send(url.map(|u| u.trim_end_matches("/v1").to_string()));
                sent = true;
            }
            eprintln!("[{tag}] {line}");
        }
    });
    let url = rx
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("node {name} did not start"));
    (
        Node {
            name: name.to_string(),
            child,
        },
        url,
    )
}

/// A temporary directory with a cluster CA and certificates for router
/// and worker-1.. (in `roles`), made with `flotilla certs`.
fn certs_dir(roles: &[&str]) -> (Dir, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "flotilla-cluster-test-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let dir = Dir(dir);
    let certs = dir.0.join("certs");
    // The certificate commands a user runs for a real cluster.
    run_ok(flotilla().args(["certs", "init", "--dir"]).arg(&certs));
    let names: Vec<String> = (1..=roles.len()).map(|i| format!("worker-{i}")).collect();
    let nodes = std::iter::once(("router", "router"))
        .chain(names.iter().map(String::as_str).zip(roles.iter().copied()));
    for (n, r) in nodes {
        let out = run_ok(
            flotilla()
                .args(["certs", "issue", "--dir"])
                .arg(&certs)
                .args(["--node", n, "--role", r]),
        );
        assert!(out.contains(n), "{out}");
    }
    (dir, certs)
}

fn start_cluster() -> Cluster {
    start_cluster_with(["worker", "mixed"])
}

/// A Router and two engine nodes of `roles`.
fn start_cluster_with(roles: [&str; 2]) -> Cluster {
    start_cluster_on(roles, &flotilla_hub::test_model_path())
}

/// As [`start_cluster_with`], every node on the model file at `model`.
fn start_cluster_on(roles: [&str; 2], model: &Path) -> Cluster {
    start_cluster_full(&roles, model, &[])
}

/// As [`start_cluster_on`], worker-1 with `w1_extra` flags too; any
/// number of engine nodes (`worker-1`.. of `roles`).
fn start_cluster_full(roles: &[&str], model: &Path, w1_extra: &[&str]) -> Cluster {
    start_cluster_config(roles, model, w1_extra, "")
}

/// As [`start_cluster_full`], with `more` appended to the config file.
fn start_cluster_config(roles: &[&str], model: &Path, w1_extra: &[&str], more: &str) -> Cluster {
    start_cluster_edited(roles, model, w1_extra, &|text| text + more)
}

/// As [`start_cluster_full`], the config's text passed through `edit`.
fn start_cluster_edited(
    roles: &[&str],
    model: &Path,
    w1_extra: &[&str],
    edit: &dyn Fn(String) -> String,
) -> Cluster {
    let (dir, certs) = certs_dir(roles);
    let config = dir.0.join("cluster.toml");
    let addrs: Vec<String> = (0..=roles.len())
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let http = format!("127.0.0.1:{}", free_tcp_port());
    let text = edit(config_text(&certs, &addrs, http, roles));
    std::fs::write(&config, text).unwrap();
    let model = model.to_str().unwrap();
    let on = ["--model", model];
    let w1_on: Vec<&str> = on.iter().chain(w1_extra).copied().collect();
    let mut nodes = Vec::new();
    for i in 1..=roles.len() {
        let flags = if i == 1 { &w1_on[..] } else { &on[..] };
        nodes.push(start_node_with(flotilla(), &config, &format!("worker-{i}"), flags).0);
    }
    let (r, url) = start_node_with(flotilla(), &config, "router", &on);
    nodes.insert(0, r);
    Cluster {
        dir,
        config,
        base: url.expect("the router prints its URL"),
        nodes,
    }
}

fn node<'a>(r: &'a Value, name: &str) -> &'a Value {
    r["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == name)
        .unwrap()
}

async fn wait_for(base: &str, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let r = ready(base).await;
        if f(&r) {
            return r;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "never {what}: {r}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    let mut v = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": stream,
           "temperature": 0, "ignore_eos": true});
    if stream {
        v["stream_options"] = json!({"include_usage": true});
    }
    v
}

async fn post(base: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{base}/v1/completions"))
        .bearer_auth(PAID_KEY)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Reads an SSE stream to its end: (completion tokens from the usage
/// chunk, an error message if the stream ended with one, whether `[DONE]`
/// came).
async fn read_sse(resp: reqwest::Response) -> (usize, Option<String>, bool) {
    let (n, err, done, _) = read_sse_text(resp).await;
    (n, err, done)
}

/// [`read_sse`], with the text streamed.
async fn read_sse_text(resp: reqwest::Response) -> (usize, Option<String>, bool, String) {
    read_sse_counting(resp, Arc::default()).await
}

/// [`read_sse_text`], counting the text chunks in `seen` as they come.
async fn read_sse_counting(
    resp: reqwest::Response,
    seen: Arc<AtomicUsize>,
) -> (usize, Option<String>, bool, String) {
    let mut text = String::new();
    let mut body = resp.bytes_stream();
    let mut buf = String::new();
    let (mut chunks, mut err, mut done) = (0, None, false);
    while let Some(b) = body.next().await {
        buf.push_str(&String::from_utf8_lossy(&b.unwrap()));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            // A comment (the server's keep-alive while a request waits).
            if ev.trim_start().starts_with(':') {
                continue;
            }
            let data = ev.trim().trim_start_matches("data: ");
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            if let Some(e) = v.get("error") {
                err = Some(e["message"].as_str().unwrap_or_default().to_string());
            } else if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                chunks = n as usize;
            } else if let Some(t) = v["choices"][0]["text"].as_str() {
                text.push_str(t);
                seen.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    (chunks, err, done, text)
}

/// Runs tests/openai_client.py (the official client's calls) against the
/// Router at `base`; it must end with ALL OK.
fn run_openai_client(python: &str, base: &str) {
    run_client_script(python, base, PAID_KEY, "openai_client.py");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_through_router_and_two_workers() {
    let python = openai_python();
    let c = start_cluster();
    wait_for(&c.base, "both workers up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    run_openai_client(&python, &c.base);
    let r = ready(&c.base).await;
    let routed: u64 = ["worker-1", "worker-2"]
        .iter()
        .map(|n| node(&r, n)["routed"].as_u64().unwrap())
        .sum();
    assert!(routed >= 5, "requests did not go through the workers: {r}");
}

/// An engine node with a `metrics` address serves its own engine's
/// `/metrics` (steps, TPOT, KV), `/health` and `/ready` there, and no API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_node_is_scrapeable_on_its_metrics_address() {
    let port = free_tcp_port();
    let c = start_cluster_edited(&["worker"], &flotilla_hub::test_model_path(), &[], &|t| {
        let at = t.find("name = \"worker-1\"").unwrap();
        let mut t = t;
        t.insert_str(at, &format!("metrics = \"127.0.0.1:{port}\"\n"));
        t
    });
    let m = format!("http://127.0.0.1:{port}");
    wait_for(&c.base, "the worker up", |r| {
        node(r, "worker-1")["up"] == true
    })
    .await;
    let n = 4;
    for i in 0..n {
        let r = post(&c.base, &completion(&format!("Count to {i}:"), 8, false)).await;
        assert_eq!(r.status(), 200);
    }
    let health = client().get(format!("{m}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let r = client().get(format!("{m}/ready")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r: Value = r.json().await.unwrap();
    assert!(r["kv_blocks"]["total"].as_u64().unwrap() > 0, "{r}");
    assert!(r["steps"].as_u64().unwrap() > 0, "{r}");
    assert!(r["memory"]["budget_bytes"].as_u64().is_some(), "{r}");
    let text = client()
        .get(format!("{m}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let total = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(
        total("flotilla_time_per_output_token_seconds_count") >= n as f64,
        "{text}"
    );
    assert!(total("flotilla_step_time_seconds_count") > 0.0, "{text}");
    assert!(text.contains("flotilla_kv_blocks"), "{text}");
    // No API on the metrics address.
    let api = post(&m, &completion("Hello", 4, false)).await;
    assert_eq!(api.status(), 404);
    let drain = client()
        .post(format!("{m}/admin/drain"))
        .send()
        .await
        .unwrap();
    assert_eq!(drain.status(), 404);
}

/// A tenant's limits hold across the cluster: with two workers up (room
/// for two of its requests on each), a tenant limited to 2 concurrent gets
/// 429 for a third and fourth while two stream, and its rate of 6 a
/// minute refuses the seventh request, whichever worker would take it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_limits_hold_across_the_cluster() {
    const CAPPED: &str = "sk-test-capped-000001";
    let more = format!(
        "\n[[tenants]]\nname = \"capped\"\ntier = \"paid\"\napi_keys = [\"{CAPPED}\"]\n\
         max_concurrent = 2\nrequests_per_minute = 6\n"
    );
    let c = start_cluster_config(
        &["worker", "worker"],
        &flotilla_hub::test_model_path(),
        &[],
        &more,
    );
    wait_for(&c.base, "both workers up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    let send = |body: Value| {
        client()
            .post(format!("{}/v1/completions", c.base))
            .bearer_auth(CAPPED)
            .json(&body)
            .send()
    };
    // Two long streams, each past its first chunk: both live.
    let mut streams = Vec::new();
    for i in 0..2 {
        let r = send(completion(
            &format!("Stream {i}: once upon a time"),
            400,
            true,
        ))
        .await
        .unwrap();
        assert_eq!(r.status(), 200);
        let mut body = r.bytes_stream();
        let first = body.next().await.unwrap().unwrap();
        assert!(!first.is_empty());
        streams.push(body);
    }
    for i in 0..2 {
        let r = send(completion(&format!("Third {i}"), 4, false))
            .await
            .unwrap();
        assert_eq!(r.status(), 429, "request {} of a tenant capped at 2", i + 3);
        assert!(r.headers().contains_key("retry-after"));
        let e: Value = r.json().await.unwrap();
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains("2 requests in flight, the limit is 2"), "{e}");
    }
    // The streams end (the client goes away): their slots come back.
    drop(streams);
    let t0 = Instant::now();
    let mut ok = 0;
    loop {
        let r = send(completion("Short", 2, false)).await.unwrap();
        match r.status().as_u16() {
            200 => ok += 1,
            429 => {
                let e: Value = r.json().await.unwrap();
                let msg = e["error"]["message"].as_str().unwrap().to_string();
                if msg.contains("in flight") && t0.elapsed() < Duration::from_secs(10) {
                    // A dropped stream's slot comes back as its response ends.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                assert!(msg.contains("rate limit of 6 requests per minute"), "{msg}");
                break;
            }
            s => panic!("status {s}"),
        }
        assert!(ok <= 4, "more than the rate allows");
    }
    // Two streams and four short requests: the bucket of 6 is spent.
    assert_eq!(ok, 4);
    // The other tenant is untouched.
    assert_eq!(
        post(&c.base, &completion("Paid", 2, false)).await.status(),
        200
    );
}

/// Long streams with distinct prompts for [`four_streams`].
const STREAM_PROMPTS: [&str; 4] = [
    "Tell me about the sea",
    "A recipe for bread",
    "The history of Rome",
    "Why is the sky blue",
];

type StreamTask = tokio::task::JoinHandle<(usize, Option<String>, bool, String)>;

/// Four 400-token streams spread over both workers, once each has work:
/// their tasks and how many run on worker-1.
async fn four_streams(base: &str) -> (Vec<StreamTask>, u64) {
    let mut streams = Vec::new();
    for p in STREAM_PROMPTS {
        let resp = post(base, &completion(p, 400, true)).await;
        assert_eq!(resp.status(), 200);
        streams.push(tokio::spawn(read_sse_text(resp)));
    }
    let r = wait_for(base, "work on both workers", |r| {
        node(r, "worker-1")["in_flight"].as_u64().unwrap() >= 1
            && node(r, "worker-2")["in_flight"].as_u64().unwrap() >= 1
            && r["running"].as_u64().unwrap() >= 4
    })
    .await;
    let on_w1 = node(&r, "worker-1")["in_flight"].as_u64().unwrap();
    (streams, on_w1)
}

/// Every stream of [`four_streams`] ends whole (400 chunks and `[DONE]`),
/// none with an error, each with the text an undisturbed greedy run of its
/// prompt gives.
async fn assert_streams_whole_and_undisturbed(base: &str, streams: Vec<StreamTask>) {
    let mut texts = Vec::new();
    for s in streams {
        let (chunks, err, done, text) = tokio::time::timeout(Duration::from_secs(120), s)
            .await
            .expect("a stream hung after its worker went away")
            .unwrap();
        assert!(done, "stream without [DONE]");
        assert_eq!(err, None, "a stream ended with an error");
        assert_eq!(chunks, 400);
        texts.push(text);
    }
    for (p, moved) in STREAM_PROMPTS.iter().zip(&texts) {
        let (undisturbed, _) = complete_text(base, &completion(p, 400, false)).await;
        assert_eq!(moved, &undisturbed, "prompt {p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_marked_down_its_streams_move_and_it_rejoins() {
    let mut c = start_cluster();
    let r0 = wait_for(&c.base, "both workers up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    let epoch_before = node(&r0, "worker-1")["epoch"].as_u64().unwrap();

    let (streams, on_w1) = four_streams(&c.base).await;
    // Let tokens flow, then kill worker-1 outright.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let w1 = c.nodes.iter_mut().find(|n| n.name == "worker-1").unwrap();
    w1.child.kill().unwrap();
    let killed = Instant::now();
    w1.child.wait().unwrap();
    let r = wait_for(&c.base, "worker-1 down", |r| {
        node(r, "worker-1")["up"] == false
    })
    .await;
    let down_after = killed.elapsed();
    let bound = Duration::from_millis(HEARTBEAT_MS * DOWN_AFTER_MISSED);
    eprintln!("worker-1 marked down {down_after:?} after the kill (bound {bound:?})");
    // Silence of two intervals, checked each quarter interval, plus the
    // polling of /ready.
    assert!(
        down_after <= bound + Duration::from_millis(HEARTBEAT_MS / 2 + 100),
        "marked down only after {down_after:?}"
    );
    assert_eq!(node(&r, "worker-1")["downs"], 1);

    // Its streams move to worker-2 with the tokens they had sent and
    // finish there: every stream ends whole, none with an error, and its
    // greedy text is the one an undisturbed run gives; the move fired
    // (the Router counts the streams it moved off worker-1).
    assert_streams_whole_and_undisturbed(&c.base, streams).await;
    let r = ready(&c.base).await;
    assert_eq!(
        node(&r, "worker-1")["moved_away"].as_u64(),
        Some(on_w1),
        "{r}"
    );
    // New requests succeed on worker-2.
    for i in 0..3 {
        let resp = post(&c.base, &completion(&format!("Count to {i}"), 8, false)).await;
        assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    }

    // Restart worker-1: a new epoch, and it takes work again.
    let (w1, _) = start_node(&c.config, "worker-1");
    c.nodes.push(w1);
    let r = wait_for(&c.base, "worker-1 back", |r| {
        node(r, "worker-1")["up"] == true
    })
    .await;
    let epoch_after = node(&r, "worker-1")["epoch"].as_u64().unwrap();
    assert!(
        epoch_after > epoch_before,
        "{epoch_before} -> {epoch_after}"
    );
    let routed_before = node(&r, "worker-1")["routed"].as_u64().unwrap();
    // Its heartbeat can arrive before the router's own link to it has
    // redialed; until then the router sends work elsewhere.
    let mut took = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    while Instant::now() < deadline {
        let resp = post(&c.base, &completion(&format!("Rejoin test {i}"), 4, false)).await;
        assert_eq!(resp.status(), 200);
        let r = ready(&c.base).await;
        if node(&r, "worker-1")["routed"].as_u64().unwrap() > routed_before {
            took = true;
            break;
        }
        i += 1;
    }
    assert!(took, "the restarted worker took no work");
    // Nothing is left holding KV blocks anywhere.
    wait_for(&c.base, "all blocks back", |r| {
        r["kv_blocks"]["used"] == 0 && r["running"] == 0
    })
    .await;
    drop(c.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_drains_a_worker_its_streams_move_with_their_kv_and_it_exits() {
    // A short grace, so that streams still run when it ends and move.
    let mut c = start_cluster_full(
        &["worker", "mixed"],
        &flotilla_hub::test_model_path(),
        &["--drain-grace-s", "1"],
    );
    wait_for(&c.base, "both workers up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    let (streams, on_w1) = four_streams(&c.base).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let w1 = c.nodes.iter_mut().find(|n| n.name == "worker-1").unwrap();
    let term = Command::new("kill")
        .args(["-TERM", &w1.child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let t0 = Instant::now();
    // New work goes to worker-2 meanwhile: none is refused.
    for i in 0..3 {
        let resp = post(
            &c.base,
            &completion(&format!("During the drain {i}"), 4, false),
        )
        .await;
        assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    }
    // It exits on its own, cleanly, within its grace and a little more.
    let status = loop {
        if let Some(s) = w1.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the drained worker did not exit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");
    eprintln!("worker-1 exited {:?} after SIGTERM", t0.elapsed());
    // It left rather than dying: no down counted, and what ran there past
    // the grace moved (the streams are long: all of them had).
    let r = ready(&c.base).await;
    let w = node(&r, "worker-1");
    assert_eq!(
        (w["up"].as_bool(), w["downs"].as_u64()),
        (Some(false), Some(0)),
        "{r}"
    );
    assert_eq!(w["moved_away"].as_u64(), Some(on_w1), "{r}");
    // Each continued on worker-2 from worker-1's KV blocks (all were
    // decoding), and its text is the undisturbed one.
    assert_streams_whole_and_undisturbed(&c.base, streams).await;
    let r = ready(&c.base).await;
    assert_eq!(
        node(&r, "worker-1")["moved_by_kv"].as_u64(),
        Some(on_w1),
        "{r}"
    );
    wait_for(&c.base, "all blocks back", |r| {
        r["kv_blocks"]["used"] == 0 && r["running"] == 0
    })
    .await;
    drop(c.dir);
}

/// Sixteen greedy streams of `tokens` tokens, each past its fourth token
/// (so those on a node that dies move rather than run again from the
/// start): their prompts and readers.
async fn sixteen_streams(base: &str, tokens: u32) -> (Vec<String>, Vec<StreamTask>) {
    let prompts: Vec<String> = (0..16)
        .map(|i| format!("Story number {i}, about a lighthouse keeper,"))
        .collect();
    let mut streams = Vec::new();
    let mut seen = Vec::new();
    for p in &prompts {
        let resp = post(base, &completion(p, tokens, true)).await;
        assert_eq!(resp.status(), 200);
        let n = Arc::new(AtomicUsize::new(0));
        streams.push(tokio::spawn(read_sse_counting(resp, n.clone())));
        seen.push(n);
    }
    let t0 = Instant::now();
    while seen.iter().any(|n| n.load(Ordering::Relaxed) < 4) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the streams did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (prompts, streams)
}

/// A cluster of `roles` under 16 streams with node `victim` killed while
/// they run: every stream ends whole, none with an error, each with the
/// text an undisturbed greedy run gives; the killed node's streams moved;
/// no KV block stays used on any node that is up.
async fn kill_one_under_16_streams(roles: &[&str], victim: &str) {
    const TOKENS: u32 = 96;
    let mut c = start_cluster_full(roles, &flotilla_hub::test_model_path(), &[]);
    wait_for(&c.base, "all engine nodes up", |r| {
        (1..=roles.len()).all(|i| node(r, &format!("worker-{i}"))["up"] == true)
    })
    .await;
    let (prompts, streams) = sixteen_streams(&c.base, TOKENS).await;
    let r = ready(&c.base).await;
    assert!(node(&r, victim)["in_flight"].as_u64().unwrap() >= 1, "{r}");
    let v = c.nodes.iter_mut().find(|n| n.name == victim).unwrap();
    v.child.kill().unwrap();
    v.child.wait().unwrap();
    let mut texts = Vec::new();
    for s in streams {
        let (chunks, err, done, text) = tokio::time::timeout(Duration::from_secs(180), s)
            .await
            .expect("a stream hung after a node died")
            .unwrap();
        assert!(done, "stream without [DONE]");
        assert_eq!(err, None, "a stream ended with an error");
        assert_eq!(chunks, TOKENS as usize);
        texts.push(text);
    }
    let r = ready(&c.base).await;
    let w = node(&r, victim);
    assert_eq!(
        (w["up"].as_bool(), w["downs"].as_u64()),
        (Some(false), Some(1)),
        "{r}"
    );
    assert!(
        w["moved_away"].as_u64().unwrap() >= 1,
        "no stream moved: {r}"
    );
    let undisturbed: Vec<_> = prompts
        .iter()
        .map(|p| {
            let base = c.base.clone();
            let body = completion(p, TOKENS, false);
            tokio::spawn(async move { complete_text(&base, &body).await.0 })
        })
        .collect();
    for ((p, moved), u) in prompts.iter().zip(&texts).zip(undisturbed) {
        assert_eq!(moved, &u.await.unwrap(), "prompt {p:?}");
    }
    wait_for(&c.base, "all blocks back", |r| {
        r["kv_blocks"]["used"] == 0 && r["running"] == 0
    })
    .await;
    drop(c.dir);
}

/// The reported setting (two prefill and two decode nodes): a decode node
/// killed under 16 streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_decode_node_of_two_prefill_two_decode_loses_no_stream() {
    kill_one_under_16_streams(&["prefill", "prefill", "decode", "decode"], "worker-3").await;
}

/// Two workers: one killed under 16 streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_of_two_loses_none_of_16_streams() {
    kill_one_under_16_streams(&["worker", "worker"], "worker-1").await;
}

/// Reads an SSE stream that may break off (its front died), counting its
/// chunks in `seen`: whether it ended whole (`[DONE]`).
async fn read_sse_or_broken(resp: reqwest::Response, seen: Arc<AtomicUsize>) -> bool {
    let mut body = resp.bytes_stream();
    let mut buf = String::new();
    while let Some(b) = body.next().await {
        let Ok(b) = b else { return false };
        buf.push_str(&String::from_utf8_lossy(&b));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            if ev.trim() == "data: [DONE]" {
                return true;
            }
            // A keep-alive comment is no chunk.
            if !ev.trim_start().starts_with(':') {
                seen.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    false
}

/// A prompt of several KV blocks that shares nothing with `i`'s others
/// past its first words.
fn shared_prefix_prompt(i: usize) -> String {
    format!(
        "Story number {i}. You are a careful storyteller who writes about the sea, \
         the ships that cross it, the lighthouses on its coasts and the keepers who \
         live in them through the long winters. Tell the story in plain words."
    )
}

/// Two Routers over two workers, 16 streams on each; one Router
/// SIGKILLed: its clients' streams break off, every stream of the other
/// ends whole with no error, and the workers drop the dead Router's
/// requests once it has been silent past the down bound (two heartbeats
/// here). Restarted, it has the workers' prefix caches at once: each
/// prompt the other Router ran finds a cache candidate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_one_killed_under_16_streams_each_then_restarted() {
    let (b_quic, b_http) = (free_port(), free_tcp_port());
    let more = format!(
        "\n[[nodes]]\nname = \"router-b\"\nrole = \"router\"\naddr = \"127.0.0.1:{b_quic}\"\n\
         http = \"127.0.0.1:{b_http}\"\n"
    );
    let mut c = start_cluster_config(
        &["worker", "worker"],
        &flotilla_hub::test_model_path(),
        &[],
        &more,
    );
    let certs = c.dir.0.join("certs");
    run_ok(
        flotilla()
            .args(["certs", "issue", "--dir"])
            .arg(&certs)
            .args(["--node", "router-b", "--role", "router"]),
    );
    let (rb, url) = start_node(&c.config, "router-b");
    c.nodes.push(rb);
    let base_b = url.expect("router-b prints its URL");
    for base in [&c.base, &base_b] {
        wait_for(base, "both workers up", |r| {
            node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
        })
        .await;
    }
    // 16 streams through each Router: A's long (they will break off),
    // B's to run whole.
    let mut a_streams = Vec::new();
    let mut seen = Vec::new();
    for i in 0..16 {
        let resp = post(
            &c.base,
            &completion(&format!("Tale {i} of the old mill"), 400, true),
        )
        .await;
        assert_eq!(resp.status(), 200);
        let n = Arc::new(AtomicUsize::new(0));
        a_streams.push(tokio::spawn(read_sse_or_broken(resp, n.clone())));
        seen.push(n);
    }
    let b_prompts: Vec<String> = (0..16).map(shared_prefix_prompt).collect();
    let mut b_streams = Vec::new();
    for p in &b_prompts {
        let resp = post(&base_b, &completion(p, 48, true)).await;
        assert_eq!(resp.status(), 200);
        let n = Arc::new(AtomicUsize::new(0));
        b_streams.push(tokio::spawn(read_sse_counting(resp, n.clone())));
        seen.push(n);
    }
    let t0 = Instant::now();
    while seen.iter().any(|n| n.load(Ordering::Relaxed) < 2) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the streams did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = ready(&base_b).await;
    let running_before = r["running"].as_u64().unwrap();
    assert!(running_before > 16, "both Routers' requests run: {r}");
    let a = c.nodes.iter_mut().find(|n| n.name == "router").unwrap();
    a.child.kill().unwrap();
    let killed = Instant::now();
    a.child.wait().unwrap();
    // The workers drop A's requests: what runs is B's alone (B's view of
    // the engines, from their heartbeats).
    let a_gone = loop {
        let r = ready(&base_b).await;
        let live_b = b_streams.iter().filter(|s| !s.is_finished()).count() as u64;
        if r["running"].as_u64().unwrap() <= live_b {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the dead Router's requests still run: {r}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    for s in a_streams {
        let whole = tokio::time::timeout(Duration::from_secs(60), s)
            .await
            .expect("a dead Router's stream hung")
            .unwrap();
        assert!(!whole, "a stream of the killed Router ended whole");
    }
    for s in b_streams {
        let (chunks, err, done, _) = tokio::time::timeout(Duration::from_secs(180), s)
            .await
            .expect("a stream of the live Router hung")
            .unwrap();
        assert_eq!(err, None, "a stream of the live Router ended with an error");
        assert!(done, "stream without [DONE]");
        assert_eq!(chunks, 48);
    }
    let r = wait_for(&base_b, "all blocks back", |r| {
        r["kv_blocks"]["used"] == 0 && r["running"] == 0
    })
    .await;
    let bound = Duration::from_millis(HEARTBEAT_MS * DOWN_AFTER_MISSED);
    eprintln!(
        "two routers: router-b's 16 streams whole, 0 errors; the killed router's requests \
         gone from the workers {a_gone:?} after the kill (its down bound {bound:?}, \
         heartbeat {HEARTBEAT_MS} ms); every block back {:?} after it",
        killed.elapsed()
    );
    // Silence past the bound, noticed at a heartbeat, the blocks' release
    // reported at the next: within two more heartbeats (and the polling).
    assert!(
        a_gone <= bound + Duration::from_millis(3 * HEARTBEAT_MS + 500),
        "the dead Router's requests ran {a_gone:?} after its death"
    );
    let b_routing = r["routing"].clone();
    // A again: its view of the workers' caches comes whole from each.
    let (ra, url) = start_node(&c.config, "router");
    c.nodes.push(ra);
    let base_a = url.expect("the router prints its URL");
    let started = Instant::now();
    wait_for(&base_a, "a snapshot from each worker", |r| {
        r["routing"]["prefix_snapshots"].as_u64() >= Some(2)
    })
    .await;
    let view_back = started.elapsed();
    // Within a heartbeat or two of the workers hearing it (a generous
    // bound for a loaded test machine; the figure is printed below).
    assert!(
        view_back < Duration::from_secs(3),
        "the restarted Router waited {view_back:?} for the workers' caches"
    );
    for p in &b_prompts {
        let resp = post(&base_a, &completion(p, 4, false)).await;
        assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    }
    let r = ready(&base_a).await;
    let routing = &r["routing"];
    eprintln!(
        "restarted router: both workers' prefix caches {view_back:?} after it served; \
         its placements {routing}; router-b's before: {b_routing}"
    );
    assert_eq!(routing["placements"], 16, "{r}");
    assert_eq!(
        routing["cache_candidate"], 16,
        "a placement without a cache candidate after the restart: {r}"
    );
    drop(c.dir);
}

/// Three network namespaces on a bridge, one per node; removed on drop.
struct Netns {
    tag: String,
}

impl Netns {
    fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.tag)
    }
    fn ip(&self, i: usize) -> String {
        format!("10.{}.{}.{}", 77, std::process::id() % 200 + 20, i + 2)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for i in 0..3 {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(i)])
                .status();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &format!("{}b", self.tag)])
            .status();
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn make_netns() -> Result<Netns, String> {
    let n = Netns {
        tag: format!("fl{}", std::process::id() % 1_000_000),
    };
    let bridge = format!("{}b", n.tag);
    let gw = format!("10.77.{}.1/24", std::process::id() % 200 + 20);
    ip(&["link", "add", &bridge, "type", "bridge"])?;
    ip(&["addr", "add", &gw, "dev", &bridge])?;
    ip(&["link", "set", &bridge, "up"])?;
    for i in 0..3 {
        let ns = n.ns(i);
        let (v, p) = (format!("{}v{i}", n.tag), format!("{}p{i}", n.tag));
        ip(&["netns", "add", &ns])?;
        ip(&["link", "add", &v, "type", "veth", "peer", "name", &p])?;
        ip(&["link", "set", &v, "netns", &ns])?;
        ip(&["link", "set", &p, "master", &bridge])?;
        ip(&["link", "set", &p, "up"])?;
        let addr = format!("{}/24", n.ip(i));
        ip(&["netns", "exec", &ns, "ip", "addr", "add", &addr, "dev", &v])?;
        ip(&["netns", "exec", &ns, "ip", "link", "set", &v, "up"])?;
        ip(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"])?;
    }
    Ok(n)
}

/// The same cluster with each node in its own network namespace, joined
/// by veth pairs on a bridge; worker-2's link is slowed and lossy. The
/// kernel here has no netem qdisc, so the delay and loss are injected by
/// the transport's own hooks on worker-2's outgoing frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_network_namespaces_with_a_slow_lossy_link() {
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    // `.ci/run` (as root, with iproute2) sets FLOTILLA_REQUIRE_NETNS=1:
    // there a missing namespace is a failure, not a skip.
    let required = std::env::var_os("FLOTILLA_REQUIRE_NETNS").is_some_and(|v| v == "1");
    if !is_root {
        assert!(!required, "FLOTILLA_REQUIRE_NETNS=1 but not root");
        eprintln!(
            "SKIPPED: network namespaces need root (FLOTILLA_REQUIRE_NETNS=1 makes this a failure)"
        );
        return;
    }
    let net = match make_netns() {
        Ok(n) => n,
        Err(e) => {
            assert!(
                !required,
                "FLOTILLA_REQUIRE_NETNS=1 but cannot make network namespaces: {e}"
            );
            eprintln!("SKIPPED: cannot make network namespaces here: {e}");
            return;
        }
    };
    let (dir, certs) = certs_dir(&["worker", "mixed"]);
    let config = dir.0.join("cluster.toml");
    let addrs = [0, 1, 2].map(|i| format!("{}:7400", net.ip(i)));
    let http = format!("{}:8000", net.ip(0));
    std::fs::write(
        &config,
        config_text(&certs, &addrs, http, &["worker", "mixed"]),
    )
    .unwrap();
    let in_ns = |i: usize| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &net.ns(i), env!("CARGO_BIN_EXE_flotilla")]);
        c
    };
    let (_w1, _) = start_node_with(in_ns(1), &config, "worker-1", &[]);
    let lossy = ["--fault-delay-ms", "5", "--fault-loss-one-in", "10"];
    let (_w2, _) = start_node_with(in_ns(2), &config, "worker-2", &lossy);
    let (_r, url) = start_node_with(in_ns(0), &config, "router", &[]);
    let base = url.expect("router URL");
    assert!(base.contains(&net.ip(0)), "{base}");
    wait_for(&base, "both workers up across namespaces", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    // Enough distinct prompts that both workers serve some.
    let mut tasks = Vec::new();
    for i in 0..6 {
        let base = base.clone();
        tasks.push(tokio::spawn(async move {
            let body = completion(&format!("Story number {i} begins"), 24, true);
            read_sse(post(&base, &body).await).await
        }));
    }
    for t in tasks {
        let (tokens, err, done) = t.await.unwrap();
        assert!(done && err.is_none(), "{err:?}");
        assert_eq!(tokens, 24);
    }
    let r = ready(&base).await;
    for w in ["worker-1", "worker-2"] {
        assert!(
            node(&r, w)["routed"].as_u64().unwrap() >= 1,
            "{w} got no work: {r}"
        );
        assert_eq!(
            node(&r, w)["downs"],
            0,
            "{w} flapped under delay and loss: {r}"
        );
    }
    drop(dir);
}

/// The text and usage of a non-streamed completion.
async fn complete_text(base: &str, body: &Value) -> (String, Value) {
    let resp = post(base, body).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["usage"].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_prefill_and_decode_give_the_colocated_tokens() {
    disaggregated_equals_colocated(&flotilla_hub::test_model_path()).await;
}

/// The same on Gemma 3 270M: its KV (one 256-wide KV head per layer,
/// sliding-window layers) migrates between the nodes like SmolLM2's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma3_disaggregated_prefill_and_decode_give_the_colocated_tokens() {
    disaggregated_equals_colocated(&flotilla_hub::test_gemma3_path()).await;
}

/// With an int8 KV cache on both nodes (`[engine] kv_cache_dtype`): the
/// blocks migrate with their scales, `/ready` shows the dtype and block
/// count of each node, and the official OpenAI client's calls all work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_int8_kv_cluster_migrates_its_blocks_and_serves_the_openai_client() {
    let python = openai_python();
    let int8 = "\n[engine]\nkv_cache_dtype = \"int8\"\n";
    let mut c = start_cluster_config(
        &["prefill", "decode"],
        &flotilla_hub::test_model_path(),
        &[],
        int8,
    );
    let r = wait_for(&c.base, "both nodes up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    // 100 MB of int8 KV: 510 blocks of 16 tokens of SmolLM2-135M (30
    // layers, K and V, 3 heads, 16 rows of 64 bytes + 2 scales), 1.88x
    // the 271 of f16.
    for n in ["worker-1", "worker-2"] {
        assert_eq!(node(&r, n)["kv_cache_dtype"], "int8", "{r}");
        let blocks = node(&r, n)["kv_blocks"].as_u64().unwrap();
        assert_eq!(blocks, 100_000_000 / 195_840, "{r}");
    }
    assert_eq!(r["kv_cache_dtype"], "int8", "{r}");
    run_openai_client(&python, &c.base);
    // Structured outputs and required tool calls across the split: the
    // decode node rebuilds each request's matcher from its constraint and
    // the prefill node's token.
    for script in ["structured_outputs.py", "tool_calls.py"] {
        run_client_script(&python, &c.base, PAID_KEY, script);
    }
    disaggregated_equals_colocated_on(&mut c).await;
}

async fn disaggregated_equals_colocated(model: &Path) {
    // worker-1 computes prompts, worker-2 continues them.
    let mut c = start_cluster_on(["prefill", "decode"], model);
    disaggregated_equals_colocated_on(&mut c).await;
}

async fn disaggregated_equals_colocated_on(c: &mut Cluster) {
    wait_for(&c.base, "both nodes up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    let prompts = [
        "The history of the Roman empire begins",
        "Write a short poem about the sea, in the style of a sailor's song, with a chorus",
    ];
    let mut disaggregated = Vec::new();
    for p in prompts {
        disaggregated.push(complete_text(&c.base, &completion(p, 24, false)).await);
    }
    let before = node(&ready(&c.base).await, "worker-1")["routed"]
        .as_u64()
        .unwrap();
    // A stream cut off mid-decode, and streams that run to the end.
    let resp = post(&c.base, &completion("Tell me a long story", 400, true)).await;
    let mut body = resp.bytes_stream();
    let _ = body.next().await;
    drop(body);
    let streams: Vec<_> = (0..3)
        .map(|i| {
            let base = c.base.clone();
            tokio::spawn(async move {
                read_sse(post(&base, &completion(&format!("Story {i}:"), 32, true)).await).await
            })
        })
        .collect();
    for s in streams {
        let (n, err, done) = s.await.unwrap();
        assert_eq!((n, err, done), (32, None, true));
    }
    let r = wait_for(&c.base, "all blocks back on both nodes", |r| {
        r["kv_blocks"]["used"] == 0 && r["running"] == 0
    })
    .await;
    assert!(
        node(&r, "worker-1")["routed"].as_u64().unwrap() >= before + 3,
        "{r}"
    );
    assert!(node(&r, "worker-2")["routed"].as_u64().unwrap() >= 5, "{r}");

    // Without a prefill node the decode node runs requests whole: the same
    // prompts, the same engine build, colocated.
    let p = c.nodes.iter_mut().find(|n| n.name == "worker-1").unwrap();
    p.child.kill().unwrap();
    p.child.wait().unwrap();
    wait_for(&c.base, "the prefill node down", |r| {
        node(r, "worker-1")["up"] == false
    })
    .await;
    for (p, (text, usage)) in prompts.iter().zip(&disaggregated) {
        let (colocated, u) = complete_text(&c.base, &completion(p, 24, false)).await;
        assert_eq!(
            &colocated, text,
            "disaggregated and colocated differ for {p:?}"
        );
        assert_eq!(&u, usage);
    }
    wait_for(&c.base, "blocks back on the decode node", |r| {
        r["kv_blocks"]["used"] == 0
    })
    .await;
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // "pid (comm) S ...": the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

#[test]
fn the_cluster_command_takes_its_nodes_down_on_sigterm() {
    let roles = ["worker", "worker"];
    let (dir, certs) = certs_dir(&roles);
    let config = dir.0.join("cluster.toml");
    let addrs = [0, 1, 2].map(|_| format!("127.0.0.1:{}", free_port()));
    let http = format!("127.0.0.1:{}", free_tcp_port());
    std::fs::write(&config, config_text(&certs, &addrs, http, &roles)).unwrap();
    let model = flotilla_hub::test_model_path();
    let mut parent = flotilla()
        .args(["cluster", "--config"])
        .arg(&config)
        .arg("--")
        .arg("--model")
        .arg(&model)
        .args(["--kv-cache-bytes", "100000000", "--threads", "1"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = parent.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            eprintln!("[cluster] {line}");
            if line.starts_with("flotilla: started node")
                && let Some(pid) = line.rsplit(' ').next().and_then(|p| p.parse::<u32>().ok())
            {
                let _ = tx.send(pid);
            }
        }
    });
    let pids: Vec<u32> = (0..3)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(60))
                .expect("a node started")
        })
        .collect();
    assert!(pids.iter().all(|&p| !process_gone(p)), "{pids:?}");
    let killed = Command::new("kill")
        .args(["-TERM", &parent.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let t0 = Instant::now();
    while parent.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "flotilla cluster ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    while !pids.iter().all(|&p| process_gone(p)) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "nodes left running after SIGTERM: {pids:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Union of the intervals `[s, e)`, in the same unit.
fn covered(mut iv: Vec<(u64, u64)>) -> u64 {
    iv.sort();
    let (mut total, mut cur): (u64, Option<(u64, u64)>) = (0, None);
    for (s, e) in iv {
        cur = match cur {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    total + cur.map_or(0, |(s, e)| e - s)
}

/// One traced request through a Router, a prefill node and a decode node,
/// each exporting to a real OTLP/HTTP receiver (`[telemetry]` in the
/// config): one trace (the client's, from its `traceparent`), the Router's
/// server span with the spans of both nodes under it, the phases in
/// order, the KV transfer with its bytes, and the phase spans covering at
/// least 95 % of the request's wall time. The prompt's text is in no span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_follows_a_request_through_router_prefill_and_decode_nodes() {
    // Wall time against monotonic time from before the processes start:
    // a step of the wall clock while they run shows as a change.
    let (wall0, mono0) = (std::time::SystemTime::now(), std::time::Instant::now());
    let rx = common::OtlpReceiver::start().await;
    let more = format!(
        "\n[telemetry]\notlp_endpoint = \"{}\"\notlp_sample_ratio = 0.0\n",
        rx.endpoint
    );
    let c = start_cluster_config(
        &["prefill", "decode"],
        &flotilla_hub::test_model_path(),
        &[],
        &more,
    );
    wait_for(&c.base, "both nodes up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    // Not sampled (ratio 0, no traceparent): nothing is exported.
    let prompt = "Seventeen quiet harbours listened to the tide";
    let (n, err, done) = read_sse(post(&c.base, &completion(prompt, 8, true)).await).await;
    assert_eq!((n, err, done), (8, None, true));
    // A client's sampled traceparent is followed whatever the ratio.
    let trace_hex = "4bf92f3577b34da6a3ce929d0e0e4736";
    let resp = client()
        .post(format!("{}/v1/completions", c.base))
        .bearer_auth(PAID_KEY)
        .header("traceparent", format!("00-{trace_hex}-00f067aa0ba902b7-01"))
        .header("tracestate", "congo=t61rcWkgMzE")
        .json(&completion(prompt, 24, true))
        .send()
        .await
        .unwrap();
    let (n, err, done) = read_sse(resp).await;
    assert_eq!((n, err, done), (24, None, true));
    let names = |s: &[common::Got], name: &str| s.iter().filter(|g| g.name == name).count();
    let spans = rx
        .wait_for("the request's spans from all three nodes", |s| {
            names(s, "POST /v1/completions") == 1
                && names(s, "engine.request") == 2
                && names(s, "kv.transfer") == 1
                && names(s, "engine.decode") == 1
        })
        .await;
    let trace: Vec<u8> = (0..16)
        .map(|i| u8::from_str_radix(&trace_hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    assert!(
        spans.iter().all(|g| g.trace_id == trace),
        "one trace, the client's: {spans:#?}"
    );
    let one = |name: &str, inst: &str| -> common::Got {
        let v: Vec<_> = spans
            .iter()
            .filter(|g| g.name == name && g.instance == inst)
            .collect();
        assert_eq!(v.len(), 1, "{name} on {inst}: {spans:#?}");
        v[0].clone()
    };
    let root = one("POST /v1/completions", "router");
    assert_eq!(
        root.parent,
        vec![0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
    );
    assert_eq!(root.attr("gen_ai.usage.output_tokens"), Some("24"));
    assert_eq!(root.attr("flotilla.tier"), Some("paid"));
    assert_eq!(root.attr("flotilla.end"), Some("finished"));
    assert_eq!(root.events, ["first_token"]);
    let ttft: f64 = root.attr("flotilla.ttft_ms").unwrap().parse().unwrap();
    assert!(ttft > 0.0 && ttft * 1e6 < root.dur_ns() as f64);
    let prep = one("gateway.prepare", "router");
    let pf = one("engine.request", "worker-1");
    let kv = one("kv.transfer", "worker-1");
    let dec = one("engine.request", "worker-2");
    for g in [&prep, &pf, &kv, &dec] {
        assert_eq!(g.parent, root.span_id, "{} hangs under the request", g.name);
        assert!(!g.error, "{g:?}");
    }
    assert_eq!(pf.attr("flotilla.engine.entry"), Some("prefill_for_decode"));
    assert_eq!(dec.attr("flotilla.engine.entry"), Some("imported"));
    assert!(
        kv.attr("flotilla.kv.bytes")
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 0
    );
    assert_eq!(kv.attr("flotilla.kv.acked"), Some("true"));
    // "sent" (the sender's stream finished) may come after the decode
    // node's ack, which ends the span.
    assert!(
        kv.events
            .starts_with(&["export".to_string(), "send".to_string()]),
        "{:?}",
        kv.events
    );
    // Each node's phases under its request span, in order.
    let child = |parent: &common::Got, name: &str| -> common::Got {
        let v: Vec<_> = spans
            .iter()
            .filter(|g| g.name == name && g.parent == parent.span_id)
            .collect();
        assert_eq!(v.len(), 1, "{name} under {}: {spans:#?}", parent.name);
        v[0].clone()
    };
    let (pq, pp) = (child(&pf, "engine.queue"), child(&pf, "engine.prefill"));
    assert!(pq.end_ns <= pp.start_ns);
    let chunks: Vec<_> = spans
        .iter()
        .filter(|g| g.name == "engine.prefill.chunk" && g.parent == pp.span_id)
        .collect();
    assert!(!chunks.is_empty());
    let dq = child(&dec, "engine.queue");
    let dd = child(&dec, "engine.decode");
    assert!(dq.end_ns <= dd.start_ns);
    assert!(
        dd.events.iter().filter(|e| *e == "step").count() >= 20,
        "a step event per decode step: {dd:?}"
    );
    let ms = |ns: u64| ns as f64 / 1e6;
    // Spans of different processes are compared on different clocks: the
    // Router reads wall time, a node maps its monotonic clock to wall time
    // once, when it starts. They agree but for reading noise unless the
    // wall clock is stepped meanwhile (as the machine's time service may
    // do), which moves the Router's spans and not the nodes'. Orders across
    // processes allow 5 ms, and are checked only if no step happened.
    const SKEW: u64 = 5_000_000;
    let (wall, mono) = (
        std::time::SystemTime::now()
            .duration_since(wall0)
            .map_or(-1.0, |d| d.as_secs_f64()),
        mono0.elapsed().as_secs_f64(),
    );
    if (wall - mono).abs() > 1e-3 {
        eprintln!(
            "the wall clock moved {wall:.6} s in {mono:.6} s of monotonic time: \
             orders across processes not checked"
        );
    } else {
        assert!(
            prep.end_ns <= pf.start_ns + SKEW,
            "prepare, then the prefill: {prep:?} {pf:?}"
        );
        assert!(
            pf.end_ns <= kv.start_ns + SKEW,
            "prefill, then the transfer"
        );
        assert!(
            kv.start_ns <= dec.start_ns + SKEW && dec.start_ns <= kv.end_ns + SKEW,
            "import within the transfer: {kv:?} {dec:?}"
        );
        assert!(dec.end_ns <= root.end_ns + SKEW);
    }
    // The phases account for the request's time.
    let kids: Vec<(u64, u64)> = spans
        .iter()
        .filter(|g| g.parent == root.span_id)
        .map(|g| (g.start_ns.max(root.start_ns), g.end_ns.min(root.end_ns)))
        .filter(|(s, e)| s < e)
        .collect();
    let share = covered(kids) as f64 / root.dur_ns() as f64;
    eprintln!(
        "request {:.1} ms: prepare {:.1}, prefill node {:.1}, KV transfer {:.1} ({} bytes), \
         decode node {:.1}; phases cover {:.1} %",
        ms(root.dur_ns()),
        ms(prep.dur_ns()),
        ms(pf.dur_ns()),
        ms(kv.dur_ns()),
        kv.attr("flotilla.kv.bytes").unwrap(),
        ms(dec.dur_ns()),
        share * 100.0
    );
    assert!(
        share >= 0.95,
        "phases cover {:.1} % of the request",
        share * 100.0
    );
    // Never the prompt or the output text.
    for g in &spans {
        for (k, v) in &g.attrs {
            assert!(!v.contains("harbours"), "{k} carries the prompt");
        }
    }
    // Only the traced request: the unsampled one left nothing.
    assert_eq!(names(&spans, "POST /v1/completions"), 1);
    // The Router's /metrics carries the autoscaling signals for the whole
    // cluster: time to first token at its front, and the nodes' queues.
    let page = client()
        .get(format!("{}/metrics", c.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |prefix: &str| -> f64 {
        let line = page
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("{prefix} in {page}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let ttft_count = page
        .lines()
        .find(|l| {
            l.starts_with("flotilla_http_time_to_first_token_seconds_count")
                && l.contains("tier=\"paid\"")
        })
        .unwrap_or_else(|| panic!("the front's TTFT in {page}"));
    assert!(ttft_count.ends_with(" 2"), "{ttft_count}");
    assert_eq!(value("flotilla_queue_length{"), 0.0);
    assert!(page.contains("flotilla_running_sequences{"), "{page}");
    drop(c);
}

/// Makes worker-1 and worker-2 a pipeline group (stage 0 and stage 1) with
/// rows in f32 (one node's numbers), worker-1 scrapeable at `metrics`.
fn as_group(text: String, metrics: &str) -> String {
    let mut out = String::new();
    let mut node = 0;
    for line in text.lines() {
        out += line;
        out.push('\n');
        if line.starts_with("name = \"worker-") {
            node = line[15..16].parse().unwrap_or(0);
        }
        if line.starts_with("addr = ") && (node == 1 || node == 2) {
            out += "pipeline = \"g\"\n";
            if node == 1 {
                out += &format!("metrics = \"{metrics}\"\n");
            }
        }
    }
    out.replace(
        "reconnect_backoff_max_ms = 200\n",
        "reconnect_backoff_max_ms = 200\npipeline_activations = \"f32\"\n",
    )
}

/// A pipeline group of two nodes (worker-1 stage 0, worker-2 stage 1)
/// beside a whole-model worker-3, its Router seeing two workers: the
/// group's greedy texts are worker-3's (rows in f32), its stage 0 reports
/// the split; killed at stage 1 under 16 streams, no stream errs (each
/// moves to worker-3 and ends with the undisturbed text), and stage 0
/// gives back every block; when stage 1 returns the group forms again
/// and takes requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_group_serves_as_one_node_loses_no_stream_with_a_stage_and_forms_again() {
    const TOKENS: u32 = 64;
    let metrics = format!("127.0.0.1:{}", free_tcp_port());
    let m = metrics.clone();
    let mut c = start_cluster_edited(
        &["worker", "worker", "worker"],
        &flotilla_hub::test_model_path(),
        &[],
        &move |t| as_group(t, &m),
    );
    wait_for(&c.base, "the group and worker-3 up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-3")["up"] == true
    })
    .await;
    // The Router routes to the group once its engine says ready (a node
    // can be up, heartbeating, before that): wait for stage 0's own
    // /ready, then for the Router's next heartbeats from it.
    let stage0 = format!("http://{metrics}");
    let t0 = Instant::now();
    while common::ready(&stage0).await["ready"] != true {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the group's engine never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r = ready(&c.base).await;
    // The Router sees the group as one worker.
    let names: Vec<&str> = r["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["worker-1", "worker-3"], "{r}");
    let cfg = common::get_json(&stage0, "/config", Some(PAID_KEY)).await;
    assert_eq!(
        cfg["pipeline"]["stages"].as_array().unwrap().len(),
        2,
        "{cfg}"
    );
    assert_eq!(cfg["pipeline"]["activations"], "f32");
    let (prompts, streams) = sixteen_streams(&c.base, TOKENS).await;
    let r = ready(&c.base).await;
    assert!(
        node(&r, "worker-1")["in_flight"].as_u64().unwrap() >= 1,
        "{r}"
    );
    let v = c.nodes.iter_mut().find(|n| n.name == "worker-2").unwrap();
    v.child.kill().unwrap();
    v.child.wait().unwrap();
    let mut texts = Vec::new();
    for s in streams {
        let (chunks, err, done, text) = tokio::time::timeout(Duration::from_secs(180), s)
            .await
            .expect("a stream hung after a stage died")
            .unwrap();
        assert!(done, "stream without [DONE]");
        assert_eq!(err, None, "a stream ended with an error");
        assert_eq!(chunks, TOKENS as usize);
        texts.push(text);
    }
    let r = ready(&c.base).await;
    assert!(
        node(&r, "worker-1")["moved_away"].as_u64().unwrap() >= 1,
        "no stream moved: {r}"
    );
    // Every text is what worker-3 alone gives (the group's tokens before
    // the kill were one node's).
    for (p, moved) in prompts.iter().zip(&texts) {
        let (alone, _) = complete_text(&c.base, &completion(p, TOKENS, false)).await;
        assert_eq!(moved, &alone, "prompt {p:?}");
    }
    // Stage 0 is not ready (its group lost a stage) and holds no block.
    let s0 = common::get_json(&stage0, "/ready", None).await;
    assert_eq!(s0["ready"], false, "{s0}");
    assert_eq!(s0["kv_blocks"]["used"], 0, "{s0}");
    assert_eq!(s0["running"], 0, "{s0}");
    // The stage comes back: the group forms again and takes requests.
    let model = flotilla_hub::test_model_path();
    let (s1, _) = start_node_with(
        flotilla(),
        &c.config,
        "worker-2",
        &["--model", model.to_str().unwrap()],
    );
    c.nodes.push(s1);
    let t0 = Instant::now();
    loop {
        let s0 = common::get_json(&stage0, "/ready", None).await;
        if s0["ready"] == true {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the group never formed again: {s0}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = node(&ready(&c.base).await, "worker-1")["routed"]
        .as_u64()
        .unwrap();
    let t0 = Instant::now();
    let mut i = 0;
    loop {
        i += 1;
        let (text, _) = complete_text(
            &c.base,
            &completion(&format!("Poem {i} about rain"), 8, false),
        )
        .await;
        assert!(!text.is_empty());
        if node(&ready(&c.base).await, "worker-1")["routed"]
            .as_u64()
            .unwrap()
            > before
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "nothing routed to the group again"
        );
    }
    let s0 = common::get_json(&stage0, "/ready", None).await;
    assert_eq!(s0["ready"], true, "{s0}");
    drop(c.dir);
}

/// A worker that is not in the config file joins a one-worker cluster
/// under 16 streams (`flotilla certs issue`, then `flotilla node --join`):
/// it is up at the Router within a few heartbeats of starting and takes
/// new requests while the streams run on; the streams all end whole. On
/// SIGTERM it drains and leaves, and the Router forgets it after
/// `forget_after_ms`. A worker whose name is in the revocation list is
/// never admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_joins_under_16_streams_then_leaves_and_is_forgotten() {
    const TOKENS: u32 = 48;
    let mut c = start_cluster_edited(&["worker"], &flotilla_hub::test_model_path(), &[], &|t| {
        t.replace(
            "reconnect_backoff_max_ms = 200",
            "reconnect_backoff_max_ms = 200\nforget_after_ms = 2000\nrevocation_list = \"revoked.txt\"",
        )
    });
    std::fs::write(c.dir.0.join("revoked.txt"), "# revoked\nworker-7\n").unwrap();
    let certs = c.dir.0.join("certs");
    for name in ["worker-9", "worker-7"] {
        let out = run_ok(
            flotilla()
                .args(["certs", "issue", "--dir"])
                .arg(&certs)
                .args(["--node", name, "--role", "worker"]),
        );
        assert!(out.contains("serial "), "{out}");
    }
    wait_for(&c.base, "worker-1 up", |r| {
        node(r, "worker-1")["up"] == true
    })
    .await;
    let (_, streams) = sixteen_streams(&c.base, TOKENS).await;

    let listen = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_tcp_port());
    let model = flotilla_hub::test_model_path();
    let join_flags = |listen: &str, metrics: &str| -> Vec<String> {
        [
            "--join",
            "router",
            "--listen",
            listen,
            "--metrics-addr",
            metrics,
            "--model",
            model.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec()
    };
    let flags = join_flags(&listen, &metrics);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (mut joiner, _) = start_node_with(flotilla(), &c.config, "worker-9", &flags);
    let t0 = Instant::now();
    let r = wait_for(&c.base, "worker-9 up", |r| {
        r["nodes"]
            .as_array()
            .is_some_and(|n| n.iter().any(|n| n["name"] == "worker-9" && n["up"] == true))
    })
    .await;
    eprintln!(
        "worker-9 up at the Router {:?} after it started: {r}",
        t0.elapsed()
    );
    // New requests while worker-1 runs 16 streams: the idle joiner takes
    // them.
    let mut answers = Vec::new();
    for i in 0..4 {
        let base = c.base.clone();
        answers.push(tokio::spawn(async move {
            post(
                &base,
                &completion(&format!("A joined worker, request {i}"), 8, false),
            )
            .await
        }));
    }
    for a in answers {
        let resp = a.await.unwrap();
        assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    }
    let r = ready(&c.base).await;
    assert!(node(&r, "worker-9")["routed"].as_u64().unwrap() >= 1, "{r}");
    // Its own observability address answers too.
    let own: Value = client()
        .get(format!("http://{metrics}/ready"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(own["steps"].as_u64().unwrap() >= 1, "{own}");
    for s in streams {
        let (chunks, err, done, _) = tokio::time::timeout(Duration::from_secs(180), s)
            .await
            .expect("a stream hung while a worker joined")
            .unwrap();
        assert!(done && err.is_none(), "{err:?}");
        assert_eq!(chunks, TOKENS as usize);
    }

    // A revoked certificate: the node starts, and is never admitted.
    let listen7 = format!("127.0.0.1:{}", free_port());
    let metrics7 = format!("127.0.0.1:{}", free_tcp_port());
    let flags7 = join_flags(&listen7, &metrics7);
    let flags7: Vec<&str> = flags7.iter().map(String::as_str).collect();
    let (mut revoked, _) = start_node_with(flotilla(), &c.config, "worker-7", &flags7);

    // SIGTERM: it drains, leaves, and is forgotten within forget_after_ms
    // (2 s) and a few heartbeats.
    let term = Command::new("kill")
        .args(["-TERM", &joiner.child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = joiner.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the joined worker did not exit"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");
    let r = wait_for(&c.base, "worker-9 forgotten", |r| {
        r["nodes"]
            .as_array()
            .is_some_and(|n| n.iter().all(|n| n["name"] != "worker-9"))
    })
    .await;
    let forgot = t0.elapsed();
    assert!(
        forgot >= Duration::from_secs(2),
        "forgotten after {forgot:?}"
    );
    assert!(
        r["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["name"] != "worker-7"),
        "a revoked node was admitted: {r}"
    );
    let _ = revoked.child.kill();
    let _ = revoked.child.wait();
    drop(c.nodes.drain(..));
    drop(c.dir);
}
