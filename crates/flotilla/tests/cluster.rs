//! A multi-process cluster on loopback: a Router and two workers, each
//! `flotilla node` its own process, QUIC with mutual TLS between them,
//! certificates made by `flotilla certs`, the default model. Driven over
//! HTTP (the `openai` Python client, raw SSE) while a worker is killed and
//! restarted.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

fn config_text(certs: &Path, ports: [u16; 3], http: u16) -> String {
    format!(
        r#"
[cluster]
certs_dir = "{certs}"
heartbeat_interval_ms = {HEARTBEAT_MS}
down_after_missed = {DOWN_AFTER_MISSED}
reconnect_backoff_max_ms = 200

[[nodes]]
name = "router"
role = "router"
addr = "127.0.0.1:{}"
http = "127.0.0.1:{http}"

[[nodes]]
name = "worker-1"
role = "worker"
addr = "127.0.0.1:{}"

[[nodes]]
name = "worker-2"
role = "worker"
addr = "127.0.0.1:{}"

[[tiers]]
name = "paid"

[[tenants]]
name = "paid-co"
tier = "paid"
api_keys = ["{PAID_KEY}"]
"#,
        ports[0],
        ports[1],
        ports[2],
        certs = certs.display(),
    )
}

/// Starts `flotilla node --name NAME`; returns it and, for the Router, the
/// URL from its ready line.
fn start_node(config: &Path, name: &str) -> (Node, Option<String>) {
    let model = flotilla_model::testutil::model_path();
    let mut child = flotilla()
        .args(["node", "--name", name, "--config"])
        .arg(config)
        .arg("--model")
        .arg(&model)
        .args([
            "--kv-cache-bytes",
            "100000000",
            "--threads",
            "1",
            "--max-model-len",
            "2048",
        ])
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

fn start_cluster() -> Cluster {
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
    for (n, r) in [
        ("router", "router"),
        ("worker-1", "worker"),
        ("worker-2", "mixed"),
    ] {
        let out = run_ok(
            flotilla()
                .args(["certs", "issue", "--dir"])
                .arg(&certs)
                .args(["--node", n, "--role", r]),
        );
        assert!(out.contains(n), "{out}");
    }
    let config = dir.0.join("cluster.toml");
    let ports = [free_port(), free_port(), free_port()];
    std::fs::write(&config, config_text(&certs, ports, free_tcp_port())).unwrap();
    let (w1, _) = start_node(&config, "worker-1");
    let (w2, _) = start_node(&config, "worker-2");
    let (r, url) = start_node(&config, "router");
    Cluster {
        dir,
        config,
        base: url.expect("the router prints its URL"),
        nodes: vec![r, w1, w2],
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

async fn ready(base: &str) -> Value {
    client()
        .get(format!("{base}/ready"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
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
    let mut body = resp.bytes_stream();
    let mut buf = String::new();
    let (mut chunks, mut err, mut done) = (0, None, false);
    while let Some(b) = body.next().await {
        buf.push_str(&String::from_utf8_lossy(&b.unwrap()));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
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
            }
        }
    }
    (chunks, err, done)
}

fn python() -> Option<String> {
    if let Ok(p) = std::env::var("FLOTILLA_PYTHON") {
        return Some(p);
    }
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("CI").is_err(),
            "CI must provide the openai client (FLOTILLA_PYTHON)"
        );
        eprintln!("SKIPPED: no python with the openai package (set FLOTILLA_PYTHON)");
        return None;
    }
    Some("python3".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_through_router_and_two_workers() {
    let Some(python) = python() else { return };
    let c = start_cluster();
    wait_for(&c.base, "both workers up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/openai_client.py");
    let out = Command::new(python)
        .arg(script)
        .env("OPENAI_BASE_URL", format!("{}/v1", c.base))
        .env("OPENAI_API_KEY", PAID_KEY)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openai client script failed");
    assert!(stdout.contains("ALL OK"), "{stdout}");
    let r = ready(&c.base).await;
    let routed: u64 = ["worker-1", "worker-2"]
        .iter()
        .map(|n| node(&r, n)["routed"].as_u64().unwrap())
        .sum();
    assert!(routed >= 5, "requests did not go through the workers: {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_marked_down_its_streams_end_and_it_rejoins() {
    let mut c = start_cluster();
    let r0 = wait_for(&c.base, "both workers up", |r| {
        node(r, "worker-1")["up"] == true && node(r, "worker-2")["up"] == true
    })
    .await;
    let epoch_before = node(&r0, "worker-1")["epoch"].as_u64().unwrap();

    // Long streams with distinct prompts spread over both workers.
    let prompts = [
        "Tell me about the sea",
        "A recipe for bread",
        "The history of Rome",
        "Why is the sky blue",
    ];
    let mut streams = Vec::new();
    for p in prompts {
        let resp = post(&c.base, &completion(p, 400, true)).await;
        assert_eq!(resp.status(), 200);
        streams.push(tokio::spawn(read_sse(resp)));
    }
    let r = wait_for(&c.base, "work on both workers", |r| {
        node(r, "worker-1")["in_flight"].as_u64().unwrap() >= 1
            && node(r, "worker-2")["in_flight"].as_u64().unwrap() >= 1
            && r["running"].as_u64().unwrap() >= 4
    })
    .await;
    let on_w1 = node(&r, "worker-1")["in_flight"].as_u64().unwrap() as usize;
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

    // Its streams end with a clear error; the others finish.
    let (mut failed, mut finished) = (0, 0);
    for s in streams {
        let (chunks, err, done) = tokio::time::timeout(Duration::from_secs(120), s)
            .await
            .expect("a stream hung after its worker died")
            .unwrap();
        assert!(done, "stream without [DONE]");
        match err {
            Some(m) => {
                assert!(
                    m.contains("worker-1") && m.contains("stopped responding"),
                    "{m}"
                );
                failed += 1;
            }
            None => {
                assert_eq!(chunks, 400);
                finished += 1;
            }
        }
    }
    assert_eq!((failed, finished), (on_w1, 4 - on_w1), "streams by outcome");

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
    let mut took = false;
    for i in 0..8 {
        let resp = post(&c.base, &completion(&format!("Rejoin test {i}"), 4, false)).await;
        assert_eq!(resp.status(), 200);
        let r = ready(&c.base).await;
        if node(&r, "worker-1")["routed"].as_u64().unwrap() > routed_before {
            took = true;
            break;
        }
    }
    assert!(took, "the restarted worker took no work");
    // Nothing is left holding KV blocks anywhere.
    wait_for(&c.base, "all blocks back", |r| {
        r["kv_blocks"]["used"] == 0 && r["running"] == 0
    })
    .await;
    drop(c.dir);
}
