//! What the multi-process tests share: an HTTP client and a JSON GET, the
//! Python that drives a server with the real `openai` client, and running
//! one of the repository's client scripts against it.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

/// Echoes a server's stderr, tagged, on a thread, and returns the base URL
/// of its first line that has one (`http://...`, `/v1` cut), or `None` if
/// none comes within `wait`.
#[allow(dead_code)]
pub fn server_url(stderr: std::process::ChildStderr, tag: &str, wait: Duration) -> Option<String> {
    use std::io::{BufRead, BufReader};
    let (tx, rx) = std::sync::mpsc::channel();
    let tag = tag.to_string();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if !sent && let Some(i) = line.find("http://") {
                let url = line[i..].split_whitespace().next().unwrap_or_default();
                let _ = tx.send(url.trim_end_matches("/v1").to_string());
                sent = true;
            }
            eprintln!("[{tag}] {line}");
        }
    });
    rx.recv_timeout(wait).ok()
}

/// The tests' HTTP client (a request that outlives two minutes fails).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// `GET {base}{path}` as JSON, with `key` as the bearer token when given.
pub async fn get_json(base: &str, path: &str, key: Option<&str>) -> Value {
    let mut req = client().get(format!("{base}{path}"));
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    req.send().await.unwrap().json().await.unwrap()
}

/// `GET /ready`: the server's (or router's) state.
pub async fn ready(base: &str) -> Value {
    get_json(base, "/ready", None).await
}

/// The Python interpreter with the `openai` package: `FLOTILLA_PYTHON`,
/// else the tests' own environment, made on first use
/// (`flotilla_hub::test_python`). A machine without Python 3 fails here
/// with what to install: the client tests never pass unrun.
pub fn openai_python() -> String {
    match flotilla_hub::test_python() {
        Ok(p) => p.to_string_lossy().into_owned(),
        Err(e) => panic!("the OpenAI-client tests cannot run: {e}"),
    }
}

/// Runs `tests/{script}` with `python` against the server at `base` (its
/// URL without `/v1`) as `key`; the script must pass and print ALL OK.
pub fn run_client_script(python: &str, base: &str, key: &str, script: &str) {
    let script = format!("{}/../../tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python)
        .arg(&script)
        .env("OPENAI_BASE_URL", format!("{base}/v1"))
        .env("OPENAI_API_KEY", key)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script} failed");
    assert!(stdout.contains("ALL OK"), "{stdout}");
}

/// One span as an OTLP receiver got it.
#[derive(Clone, Debug)]
#[allow(dead_code)]
pub struct Got {
    /// `service.instance.id` of the process that sent it.
    pub instance: String,
    /// `service.name` of the process that sent it.
    pub service: String,
    pub name: String,
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    pub parent: Vec<u8>,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Attributes, values as text.
    pub attrs: Vec<(String, String)>,
    /// Event names, in order.
    pub events: Vec<String>,
    /// Status code 2 (error).
    pub error: bool,
}

#[allow(dead_code)]
impl Got {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn dur_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

/// An OTLP/HTTP trace receiver on loopback, built on the protocol's
/// official definitions (`opentelemetry-proto`): it decodes each
/// `POST /v1/traces` (protobuf `ExportTraceServiceRequest`) and keeps the
/// spans.
#[allow(dead_code)]
pub struct OtlpReceiver {
    pub endpoint: String,
    pub spans: std::sync::Arc<std::sync::Mutex<Vec<Got>>>,
    /// Export requests received.
    pub posts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Every export request's headers (name, value).
    pub headers: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

#[allow(dead_code)]
impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
        use opentelemetry_proto::tonic::common::v1::any_value::Value as V;
        use prost::Message as _;
        use std::sync::atomic::Ordering;
        let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let posts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let headers_seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s2, p2, h2) = (spans.clone(), posts.clone(), headers_seen.clone());
        let text = |v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>| match v
            .as_ref()
            .and_then(|v| v.value.clone())
        {
            Some(V::StringValue(s)) => s,
            Some(V::IntValue(i)) => i.to_string(),
            Some(V::DoubleValue(d)) => d.to_string(),
            Some(V::BoolValue(b)) => b.to_string(),
            other => format!("{other:?}"),
        };
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                    let (spans, posts, seen) = (s2.clone(), p2.clone(), h2.clone());
                    async move {
                        seen.lock().unwrap().extend(headers.iter().map(|(k, v)| {
                            (k.to_string(), v.to_str().unwrap_or_default().to_string())
                        }));
                        let ct = headers
                            .get("content-type")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("");
                        assert_eq!(ct, "application/x-protobuf", "OTLP/HTTP protobuf");
                        let req = ExportTraceServiceRequest::decode(body.as_ref())
                            .expect("a valid ExportTraceServiceRequest");
                        posts.fetch_add(1, Ordering::Relaxed);
                        let mut got = spans.lock().unwrap();
                        for rs in req.resource_spans {
                            let instance = rs
                                .resource
                                .as_ref()
                                .and_then(|r| {
                                    r.attributes.iter().find(|a| a.key == "service.instance.id")
                                })
                                .map(|a| text(&a.value))
                                .unwrap_or_default();
                            let service = rs
                                .resource
                                .as_ref()
                                .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                                .map(|a| text(&a.value))
                                .unwrap_or_default();
                            for ss in rs.scope_spans {
                                for s in ss.spans {
                                    got.push(Got {
                                        instance: instance.clone(),
                                        service: service.clone(),
                                        name: s.name,
                                        trace_id: s.trace_id,
                                        span_id: s.span_id,
                                        parent: s.parent_span_id,
                                        start_ns: s.start_time_unix_nano,
                                        end_ns: s.end_time_unix_nano,
                                        attrs: s
                                            .attributes
                                            .iter()
                                            .map(|a| (a.key.clone(), text(&a.value)))
                                            .collect(),
                                        events: s.events.iter().map(|e| e.name.clone()).collect(),
                                        error: s.status.is_some_and(|st| st.code == 2),
                                    });
                                }
                            }
                        }
                        axum::http::StatusCode::OK
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        OtlpReceiver {
            endpoint,
            spans,
            posts,
            headers: headers_seen,
        }
    }

    /// The spans so far.
    pub fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (up to 30 s) until `done` holds for the spans received.
    pub async fn wait_for(&self, what: &str, done: impl Fn(&[Got]) -> bool) -> Vec<Got> {
        let t0 = std::time::Instant::now();
        loop {
            let s = self.spans();
            if done(&s) {
                return s;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(30),
                "no {what} in 30 s; spans: {:#?}",
                s.iter().map(|g| (&g.instance, &g.name)).collect::<Vec<_>>()
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}
