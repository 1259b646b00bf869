//! End to end: the load generator against a tiny hand-written OpenAI-style
//! server on a local socket, streaming with small delays, answering some
//! requests with errors.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use flotilla_bench::{BenchArgs, Report, load_report, run, run_and_report};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Gap between streamed tokens.
const GAP: Duration = Duration::from_millis(2);
/// Model id the mock lists; its name carries a GGUF quantisation tag.
const MODEL: &str = "mock-1b-Q4_K_M.gguf";

/// How the mock answers one POST.
#[derive(Clone, Copy, Debug)]
enum Reply {
    /// `tokens` content chunks `GAP` apart, then a usage-only chunk if
    /// `usage`, then `[DONE]`.
    Stream { tokens: usize, usage: bool },
    /// This status and a JSON error body.
    Status(u16),
    /// Headers, then nothing for a long time.
    Hang,
    /// Two tokens, then the connection closes without `[DONE]`.
    Cut,
}

/// One POST as the mock saw it.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    authorization: Option<String>,
    body: Value,
}

struct Mock {
    url: String,
    posts: Arc<Mutex<Vec<Seen>>>,
    /// Connections accepted.
    connections: Arc<AtomicUsize>,
}

/// Starts a mock answering POST number `i` (in arrival order) with `plan(i)`.
async fn start(plan: fn(usize) -> Reply) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let posts = Arc::new(Mutex::new(Vec::new()));
    let counter = Arc::new(AtomicUsize::new(0));
    let connections = Arc::new(AtomicUsize::new(0));
    let (seen, accepted) = (Arc::clone(&posts), Arc::clone(&connections));
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            accepted.fetch_add(1, Ordering::SeqCst);
            let (seen, counter) = (Arc::clone(&seen), Arc::clone(&counter));
            tokio::spawn(async move {
                let _ = serve(sock, plan, seen, counter).await;
            });
        }
    });
    Mock {
        url,
        posts,
        connections,
    }
}

/// A parsed request: method, path, headers (lower-case names), body.
struct Req {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// Reads one request from `sock`; `None` at a clean end of connection.
async fn read_request(sock: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Option<Req>> {
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = sock.read(&mut tmp).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or_default().split(' ');
    let method = first.next().unwrap_or_default().to_owned();
    let path = first.next().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map_or(0, |(_, v)| v.parse().unwrap());
    while buf.len() < head_end + len {
        let n = sock.read(&mut tmp).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let body = buf[head_end..head_end + len].to_vec();
    buf.drain(..head_end + len);
    Ok(Some(Req {
        method,
        path,
        headers,
        body,
    }))
}

/// Serves one connection. Chat answers use chunked encoding on a keep-alive
/// connection; completions use `Connection: close` and end the body by
/// closing, so both framings are covered.
async fn serve(
    mut sock: TcpStream,
    plan: fn(usize) -> Reply,
    seen: Arc<Mutex<Vec<Seen>>>,
    counter: Arc<AtomicUsize>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    while let Some(req) = read_request(&mut sock, &mut buf).await? {
        if req.method == "GET" && req.path == "/v1/models" {
            let body =
                json!({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).to_string();
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            sock.write_all((head + &body).as_bytes()).await?;
            continue;
        }
        if req.method == "GET" {
            // A Flotilla-like server's own figures: its settings and metrics.
            let (status, body) = match req.path.as_str() {
                "/config" => (
                    "200 OK",
                    json!({"server": "mock", "quantization": "Q4_1", "kv_cache_dtype": "f16",
                           "max_num_seqs": 8})
                    .to_string(),
                ),
                "/metrics" => (
                    "200 OK",
                    format!(
                        "flotilla_queue_length{{tier=\"paid\"}} {}\n\
                         flotilla_running_sequences{{tier=\"paid\"}} 2\n\
                         flotilla_kv_blocks{{state=\"used\"}} 5\n\
                         flotilla_kv_cache_blocks{{dtype=\"f16\"}} 64\n\
                         process_resident_memory_bytes 1000000\n\
                         process_resident_memory_max_bytes 3000000\n",
                        counter.load(Ordering::SeqCst) % 3
                    ),
                ),
                _ => ("404 Not Found", String::new()),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            sock.write_all((head + &body).as_bytes()).await?;
            continue;
        }
        let body: Value = serde_json::from_slice(&req.body).unwrap();
        let authorization = req
            .headers
            .iter()
            .find(|(k, _)| k == "authorization")
            .map(|(_, v)| v.clone());
        let chat = req.path == "/v1/chat/completions";
        let prompt = if chat {
            body["messages"][0]["content"].as_str()
        } else {
            body["prompt"].as_str()
        };
        let prompt_tokens = prompt.unwrap_or_default().split(' ').count();
        seen.lock().unwrap().push(Seen {
            path: req.path.clone(),
            authorization,
            body,
        });
        let index = counter.fetch_add(1, Ordering::SeqCst);
        let reply = plan(index);
        if let Reply::Status(code) = reply {
            let body = r#"{"error":{"message":"busy"}}"#;
            let head = format!(
                "HTTP/1.1 {code} Error\r\nRetry-After: 1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            sock.write_all((head + body).as_bytes()).await?;
            continue;
        }
        let mut out = Out {
            sock: &mut sock,
            chunked: chat,
        };
        out.head().await?;
        match reply {
            Reply::Status(_) => unreachable!(),
            Reply::Hang => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                return Ok(());
            }
            Reply::Cut => {
                for _ in 0..2 {
                    out.event(&token(chat, "tok ", None)).await?;
                }
                return Ok(());
            }
            Reply::Stream { tokens, usage } => {
                if chat {
                    let role = json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]});
                    out.event(&role.to_string()).await?;
                }
                for i in 0..tokens {
                    tokio::time::sleep(GAP).await;
                    let finish = (i + 1 == tokens).then_some("length");
                    out.event(&token(chat, "tok ", finish)).await?;
                }
                if tokens == 0 {
                    out.event(&token(chat, "", Some("stop"))).await?;
                }
                if usage {
                    let u = json!({"choices": [], "usage": {
                        "prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                        "total_tokens": prompt_tokens + tokens}});
                    out.event(&u.to_string()).await?;
                }
                out.raw(b": keep-alive comment\n\ndata: [DONE]\n\n").await?;
                out.end().await?;
            }
        }
        if !chat {
            return Ok(());
        }
    }
    Ok(())
}

fn token(chat: bool, text: &str, finish: Option<&str>) -> String {
    if chat {
        json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})
    } else {
        json!({"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": null})
    }
    .to_string()
}

/// The response body writer, chunked or close-delimited.
struct Out<'a> {
    sock: &'a mut TcpStream,
    chunked: bool,
}

impl Out<'_> {
    async fn head(&mut self) -> std::io::Result<()> {
        let framing = if self.chunked {
            "Transfer-Encoding: chunked"
        } else {
            "Connection: close"
        };
        let head =
            format!("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{framing}\r\n\r\n");
        self.sock.write_all(head.as_bytes()).await
    }

    async fn raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.chunked {
            self.sock
                .write_all(format!("{:x}\r\n", bytes.len()).as_bytes())
                .await?;
            self.sock.write_all(bytes).await?;
            self.sock.write_all(b"\r\n").await?;
        } else {
            self.sock.write_all(bytes).await?;
        }
        self.sock.flush().await
    }

    /// One SSE event, written in two pieces split mid-JSON with a pause
    /// between, so the client sees an event cut across reads.
    async fn event(&mut self, data: &str) -> std::io::Result<()> {
        let frame = format!("data: {data}\n\n");
        let (a, b) = frame.as_bytes().split_at(frame.len() / 2);
        self.raw(a).await?;
        tokio::time::sleep(Duration::from_micros(300)).await;
        self.raw(b).await
    }

    async fn end(&mut self) -> std::io::Result<()> {
        if self.chunked {
            self.sock.write_all(b"0\r\n\r\n").await?;
        }
        self.sock.flush().await
    }
}

/// Parses bench flags as the binary would.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn args(url: &str, extra: &[&str]) -> BenchArgs {
    let base = ["bench", "--url", url, "--quiet"];
    Cli::parse_from(base.iter().chain(extra)).args
}

fn assert_ordered(r: &Report) {
    for s in [r.ttft_ms, r.tpot_ms, r.itl_ms, r.e2e_ms] {
        let s = s.expect("latency summary");
        assert!(s.p50 <= s.p90 && s.p90 <= s.p99 && s.p99 <= s.max, "{s:?}");
    }
    let (ttft, tpot, e2e) = (r.ttft_ms.unwrap(), r.tpot_ms.unwrap(), r.e2e_ms.unwrap());
    assert!(
        ttft.p50 > 0.0 && tpot.p50 > 0.0,
        "ttft {ttft:?} tpot {tpot:?}"
    );
    assert!(e2e.p50 >= ttft.p50);
}

#[test]
fn flags_parse_with_defaults() {
    let a = args("http://h:1", &[]);
    assert_eq!(
        (a.concurrency, a.requests, a.max_tokens),
        (vec![8], 64, 128)
    );
    assert_eq!(
        args("http://h:1", &["--concurrency", "1,4,8"]).concurrency,
        [1, 4, 8]
    );
    for bad in [
        &["--concurrency", "0,4"][..],
        &["--repeat", "0"],
        &["--threshold", "20"],
        &["--sample-ms", "1"],
    ] {
        assert!(args("http://h:1", bad).validate().is_err(), "{bad:?}");
    }
    assert_eq!((a.prompt_len_min, a.prompt_len_max, a.seed), (16, 256, 0));
    assert!(a.ignore_eos && !a.chat);
    assert_eq!((a.timeout_s, a.duration_s), (300, None));
    assert!(!args("http://h:1", &["--ignore-eos", "false"]).ignore_eos);
    assert!(args("http://h:1", &["--ignore-eos"]).ignore_eos);
    assert!(args("https://h:1", &[]).validate().is_err());
    assert!(
        args(
            "http://h:1",
            &["--prompt-len-min", "9", "--prompt-len-max", "8"]
        )
        .validate()
        .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_with_usage_and_one_429() {
    const K: usize = 8;
    let mock = start(|i| {
        if i == 2 {
            Reply::Status(429)
        } else {
            Reply::Stream {
                tokens: K,
                usage: true,
            }
        }
    })
    .await;
    let a = args(
        &mock.url,
        &[
            "--requests",
            "10",
            "--concurrency",
            "3",
            "--max-tokens",
            "8",
            "--seed",
            "5",
        ],
    );
    let r = run(&a).await.unwrap();

    assert_eq!(
        (r.requests_ok, r.requests_failed, r.requests_cancelled),
        (9, 1, 0)
    );
    assert_eq!(r.errors.len(), 1);
    assert_eq!(r.errors["http_429"], 1);
    assert_eq!(r.output_tokens, 9 * K as u64);
    assert_eq!(r.model, MODEL);
    assert_eq!(r.quantisation, "Q4_K_M");
    assert_eq!(r.endpoint, "/v1/completions");
    assert_eq!(r.tpot_ms.unwrap().count, 9);
    assert_eq!(r.itl_ms.unwrap().count, 9 * (K as u64 - 1));
    assert!(r.output_tokens_per_s > 0.0 && r.requests_per_s > 0.0);
    assert_ordered(&r);

    let posts = mock.posts.lock().unwrap().clone();
    assert_eq!(posts.len(), 10);
    let mut prompt_words = 0;
    for p in &posts {
        assert_eq!(p.path, "/v1/completions");
        assert_eq!(p.authorization, None);
        let b = &p.body;
        assert_eq!(b["stream"], true);
        assert_eq!(b["max_tokens"], 8);
        assert_eq!(b["temperature"], 0.0);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["model"], MODEL);
        let words = b["prompt"].as_str().unwrap().split(' ').count();
        assert!((16..=256).contains(&words));
        prompt_words += words as u64;
    }
    // Usage is counted for successful requests only; the mock reports words.
    assert!(r.prompt_tokens > 0 && r.prompt_tokens < prompt_words);

    // Prompts are a pure function of the seed: a second run sends the same set.
    let mock2 = start(|_| Reply::Stream {
        tokens: 1,
        usage: false,
    })
    .await;
    let a2 = args(
        &mock2.url,
        &["--requests", "10", "--concurrency", "3", "--seed", "5"],
    );
    run(&a2).await.unwrap();
    let prompts = |posts: &[Seen]| {
        let mut v: Vec<String> = posts
            .iter()
            .map(|p| p.body["prompt"].as_str().unwrap().to_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(prompts(&posts), prompts(&mock2.posts.lock().unwrap()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_chunked_keep_alive_without_usage() {
    const K: usize = 6;
    let mock = start(|_| Reply::Stream {
        tokens: K,
        usage: false,
    })
    .await;
    let a = args(
        &mock.url,
        &[
            "--chat",
            "--requests",
            "5",
            "--concurrency",
            "2",
            "--api-key",
            "sk-test",
            "--model",
            "chosen",
            "--ignore-eos",
            "false",
        ],
    );
    let r = run(&a).await.unwrap();
    assert_eq!((r.requests_ok, r.requests_failed), (5, 0));
    assert!(r.errors.is_empty());
    // No usage: tokens are counted as content chunks (the empty role chunk is not one).
    assert_eq!(r.output_tokens, 5 * K as u64);
    assert_eq!(r.prompt_tokens, 0);
    assert_eq!(r.model, "chosen");
    assert_eq!(r.endpoint, "/v1/chat/completions");
    assert_ordered(&r);
    // One connection per request (plus the model listing): a stale
    // keep-alive connection can never fail a POST.
    let connections = mock.connections.load(Ordering::SeqCst);
    assert!(connections >= 5, "{connections} connections for 5 requests");
    for p in mock.posts.lock().unwrap().iter() {
        assert_eq!(p.path, "/v1/chat/completions");
        assert_eq!(p.authorization.as_deref(), Some("Bearer sk-test"));
        assert_eq!(p.body["model"], "chosen");
        assert_eq!(p.body["ignore_eos"], false);
        assert_eq!(p.body["messages"][0]["role"], "user");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_counted_by_kind() {
    let mock = start(|i| match i {
        0 => Reply::Cut,
        1 => Reply::Hang,
        2 => Reply::Status(503),
        3 => Reply::Stream {
            tokens: 0,
            usage: true,
        },
        _ => Reply::Stream {
            tokens: 3,
            usage: true,
        },
    })
    .await;
    // One worker, so the mock sees the requests in index order.
    let a = args(
        &mock.url,
        &["--requests", "5", "--concurrency", "1", "--timeout-s", "1"],
    );
    let r = run(&a).await.unwrap();
    assert_eq!((r.requests_ok, r.requests_failed), (1, 4), "{:?}", r.errors);
    for kind in ["stream_error", "timeout", "http_503", "empty"] {
        assert_eq!(r.errors.get(kind), Some(&1), "{kind} in {:?}", r.errors);
    }

    // Nothing listening: every request fails to connect.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let r = run(&args(&url, &["--requests", "3", "--concurrency", "2"]))
        .await
        .unwrap();
    assert_eq!((r.requests_ok, r.requests_failed), (0, 3));
    assert_eq!(r.errors["connect"], 3);
    assert_eq!(
        (r.model.as_str(), r.quantisation.as_str()),
        ("default", "unknown")
    );
    assert_eq!(r.ttft_ms, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_cap_cancels_requests_in_flight() {
    let mock = start(|_| Reply::Hang).await;
    let a = args(
        &mock.url,
        &[
            "--requests",
            "10",
            "--concurrency",
            "2",
            "--duration-s",
            "1",
        ],
    );
    let t = Instant::now();
    let r = run(&a).await.unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "the cap did not stop the run"
    );
    assert_eq!(
        (r.requests_ok, r.requests_failed, r.requests_cancelled),
        (0, 0, 2)
    );
    assert!(r.wall_s >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_report_is_written_and_compared() {
    let mock = start(|_| Reply::Stream {
        tokens: 4,
        usage: true,
    })
    .await;
    let dir = std::env::temp_dir().join(format!("flotilla-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let first: PathBuf = dir.join("first.json");
    let second = dir.join("second.json");
    let f = first.to_str().unwrap();
    let a = args(
        &mock.url,
        &[
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--label",
            "one",
            "--json",
            f,
        ],
    );
    let r1 = run_and_report(&a)
        .await
        .unwrap()
        .levels
        .remove(0)
        .runs
        .remove(0);
    assert_eq!(load_report(&first).unwrap(), r1);
    assert_eq!(r1.label, "one");
    // The server's own figures came with it.
    let cfg = r1.server.config.as_ref().expect("the server's /config");
    assert_eq!(cfg["quantization"], "Q4_1");
    assert_eq!(r1.server.peak_rss_bytes, Some(3_000_000));
    assert_eq!(r1.server.kv_used_peak_blocks, Some(5));
    assert_eq!(r1.server.kv_total_blocks, Some(64));
    assert!(!r1.timeline.is_empty());
    assert!(r1.timeline.iter().all(|s| s.tiers["paid"].running == 2));
    let cdf = r1.cdf.as_ref().expect("latency CDFs");
    assert_eq!(cdf.ttft_ms.len(), 101);
    assert!(cdf.ttft_ms.windows(2).all(|w| w[0] <= w[1]));

    let s = second.to_str().unwrap();
    let b = args(
        &mock.url,
        &[
            "--requests",
            "4",
            "--concurrency",
            "1",
            "--compare",
            f,
            "--json",
            s,
        ],
    );
    let r2 = run_and_report(&b)
        .await
        .unwrap()
        .levels
        .remove(0)
        .runs
        .remove(0);
    let ratios = flotilla_bench::compare(&r2, &r1);
    assert!(
        ratios.iter().all(|c| c.ratio.is_some_and(|x| x > 0.0)),
        "{ratios:?}"
    );

    let missing = args(&mock.url, &["--compare", "/nonexistent/report.json"]);
    assert!(run_and_report(&missing).await.is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_fraction_drops_a_seeded_share_mid_stream() {
    let mock = start(|_| Reply::Stream {
        tokens: 12,
        usage: true,
    })
    .await;
    let a = args(
        &mock.url,
        &[
            "--requests",
            "40",
            "--concurrency",
            "4",
            "--cancel-fraction",
            "0.5",
        ],
    );
    let r = run(&a).await.unwrap();
    let dropped = r.errors.get("dropped").copied().unwrap_or(0);
    assert_eq!(
        (0..40u64)
            .filter(|&i| flotilla_bench::prompt::cancel_after(0, i, 0.5).is_some())
            .count() as u64,
        dropped,
        "the seeded choice decides which requests drop"
    );
    assert!(dropped > 5 && dropped < 35, "{dropped}");
    assert_eq!(r.requests_ok + dropped, 40);
    assert_eq!(r.output_tokens, r.requests_ok * 12);
    assert_eq!(r.flags.cancel_fraction, 0.5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_followed_by_the_retry_after_wait_unless_disabled() {
    for (extra, min_s, max_s) in [(&[][..], 0.95, 5.0), (&["--no-backoff"][..], 0.0, 0.9)] {
        let mock = start(|i| {
            if i == 0 {
                Reply::Status(503)
            } else {
                Reply::Stream {
                    tokens: 2,
                    usage: true,
                }
            }
        })
        .await;
        let mut flags = vec!["--requests", "2", "--concurrency", "1", "--max-tokens", "2"];
        flags.extend_from_slice(extra);
        let r = run(&args(&mock.url, &flags)).await.unwrap();
        assert_eq!((r.requests_ok, r.errors["http_503"]), (1, 1));
        assert!(
            (min_s..max_s).contains(&r.wall_s),
            "{extra:?}: wall {} s, expected {min_s}..{max_s}",
            r.wall_s
        );
    }
}

/// `--concurrency 1,2 --repeat 2`: one sweep of two levels of two runs
/// each, with their spread, written as JSON and as an HTML page whose
/// plots are inline SVG; `gather` puts saved reports together the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_with_repeats_reports_each_level_its_spread_and_plots() {
    let mock = start(|_| Reply::Stream {
        tokens: 3,
        usage: true,
    })
    .await;
    let dir = std::env::temp_dir().join(format!("flotilla-bench-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json_path, html_path) = (dir.join("sweep.json"), dir.join("sweep.html"));
    let a = args(
        &mock.url,
        &[
            "--requests",
            "4",
            "--concurrency",
            "1,2",
            "--repeat",
            "2",
            "--sample-ms",
            "50",
            "--label",
            "sweep",
            "--json",
            json_path.to_str().unwrap(),
            "--html",
            html_path.to_str().unwrap(),
        ],
    );
    let sweep = run_and_report(&a).await.unwrap();
    let names: Vec<&str> = sweep.levels.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["concurrency 1", "concurrency 2"]);
    for (l, c) in sweep.levels.iter().zip([1, 2]) {
        assert_eq!(l.runs.len(), 2);
        assert!(
            l.runs
                .iter()
                .all(|r| r.flags.concurrency == c && r.requests_ok == 4)
        );
        let s = l.spread.expect("two runs have a spread");
        let tp = s.output_tokens_per_s.unwrap();
        assert!(tp.min <= tp.mean && tp.mean <= tp.max && tp.spread_pct >= 0.0);
    }
    let text = std::fs::read_to_string(&json_path).unwrap();
    let back: flotilla_bench::Sweep = serde_json::from_str(&text).unwrap();
    assert_eq!(back, sweep);
    let page = std::fs::read_to_string(&html_path).unwrap();
    for want in [
        "<svg",
        "TTFT CDF",
        "TPOT p99 against output tok/s",
        "Queue length per tier",
        "Stability",
        "Q4_1",
    ] {
        assert!(page.contains(want), "the page has {want}");
    }
    assert!(!page.contains("no data in this run"), "every plot drawn");
    // Saved runs gathered into one report, a level per file.
    let one = dir.join("one.json");
    flotilla_bench::save_report(&one, &sweep.levels[0].runs[0]).unwrap();
    let g = flotilla_bench::gather(&[one.clone(), json_path.clone()]).unwrap();
    assert_eq!(g.levels.len(), 3);
    assert_eq!(g.levels[0].name, "sweep");
    assert!(flotilla_bench::gather(&[dir.join("missing.json")]).is_err());
    // A saved sweep is a baseline too: each run against the same level.
    let base = flotilla_bench::load_baseline(&json_path).unwrap();
    assert_eq!(base.len(), 4);
    let again = args(
        &mock.url,
        &[
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--compare",
            json_path.to_str().unwrap(),
        ],
    );
    assert_eq!(run_and_report(&again).await.unwrap().levels.len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Figures that moved beyond `--threshold` against the baseline are
/// flagged, each the right way round (throughput down, latency up: worse).
#[test]
fn compare_flags_figures_beyond_the_threshold() {
    let text = std::fs::read_to_string(format!(
        "{}/tests/data/report.json",
        env!("CARGO_MANIFEST_DIR")
    ));
    let Ok(text) = text else {
        panic!("tests/data/report.json");
    };
    let old: Report = serde_json::from_str(&text).unwrap();
    let mut new = old.clone();
    new.output_tokens_per_s *= 0.9;
    if let Some(t) = &mut new.ttft_ms {
        t.p50 *= 0.5;
        t.p99 *= 1.02;
    }
    let c = flotilla_bench::compare(&new, &old);
    let v = |f: &str| {
        c.iter()
            .find(|r| r.figure == f)
            .and_then(|r| r.verdict(0.05))
    };
    use flotilla_bench::Verdict::*;
    assert_eq!(v("output tok/s"), Some(Worse));
    assert_eq!(v("TTFT p50 ms"), Some(Better));
    assert_eq!(v("TTFT p99 ms"), Some(Same));
    let out = flotilla_bench::render_with(&new, Some(&old), 0.05);
    assert!(out.contains("WORSE"), "{out}");
    assert!(out.contains("1 figure(s) worse"), "{out}");
}

/// `--warmup N`: N requests go first, one at a time, and are in no figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_requests_are_sent_first_and_left_out() {
    let mock = start(|_| Reply::Stream {
        tokens: 3,
        usage: true,
    })
    .await;
    let a = args(&mock.url, &["--requests", "4", "--warmup", "2"]);
    let r = run(&a).await.unwrap();
    assert_eq!((r.requests_ok, r.output_tokens), (4, 12));
    let completions = mock
        .posts
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.path == "/v1/completions")
        .count();
    assert_eq!(completions, 6);
    // Output chunks over time count the run's tokens only.
    assert_eq!(r.timeline.last().map(|s| s.output_chunks), Some(12));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_loop_sends_at_its_poisson_times_and_a_run_is_judged_against_its_slo() {
    // Request 3 is refused: 1 in 10 lost.
    fn plan(i: usize) -> Reply {
        if i == 3 {
            Reply::Status(429)
        } else {
            Reply::Stream {
                tokens: 6,
                usage: true,
            }
        }
    }
    let mock = start(plan).await;
    let run_at = |url: &str, extra: &[&str]| {
        let mut v = vec!["--requests", "10", "--rate", "20", "--seed", "4"];
        v.extend_from_slice(extra);
        args(url, &v)
    };
    let a = run_at(
        &mock.url,
        &["--slo", "ttft_p99=5s,tpot_p50=1ms", "--max-lost", "0.2"],
    );
    let r = run(&a).await.unwrap();
    assert_eq!((r.requests_ok, r.requests_failed), (9, 1));
    assert_eq!(r.flags.rate, Some(20.0));
    // The last request went at its Poisson time, not before: the run lasts
    // at least the sum of the seeded gaps (~0.5 s at 20/s), and a closed
    // pool of 8 would have finished 10 short requests in ~0.05 s.
    let mut rng = flotilla_exec::rng::SplitMix64(4 ^ 0x6f70_656e_6c6f_6f70);
    let span: f64 = (0..10).map(|_| -(1.0 - rng.f64()).ln() / 20.0).sum();
    assert!(span > 0.1, "{span}");
    assert!(
        r.wall_s >= span && r.wall_s < span + 5.0,
        "wall {} s, arrivals over {span} s",
        r.wall_s
    );
    // TTFT holds, TPOT (2 ms a token) misses 1 ms; 10% lost is within 20%.
    let v = r.slo.clone().expect("judged");
    assert!(!v.met);
    assert_eq!(v.lost, 0.1);
    assert!(v.objectives[0].met && !v.objectives[1].met, "{v:?}");
    assert!(v.objectives[1].measured_ms.unwrap() >= 1.0);
    assert!(flotilla_bench::render(&r, None).contains("SLO         missed"));
    // Every objective held, but 10% lost is beyond the default 1%.
    let again = start(plan).await;
    let r = run(&run_at(&again.url, &["--slo", "ttft_p99=5s,tpot_p99=1s"]))
        .await
        .unwrap();
    let v = r.slo.unwrap();
    assert!(v.objectives.iter().all(|c| c.met) && !v.met, "{v:?}");
    // Bad objectives and rates are refused before anything is sent.
    for bad in [
        &["--rate", "0"][..],
        &["--rate", "1", "--concurrency", "1,2"],
        &["--slo", "ttft_p99=soon"],
        &["--slo", "itl_p50=1s"],
        &["--max-lost", "1"],
    ] {
        assert!(args(&mock.url, bad).validate().is_err(), "{bad:?}");
    }
}
