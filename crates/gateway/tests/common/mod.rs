//! Shared by the HTTP tests: the router served on a loopback port, called
//! with reqwest, in front of a scripted fake engine that records what it was
//! given and whether its request streams were dropped.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use flotilla_config::ClusterConfig;
use flotilla_engine::{BoxFuture, Engine, RequestStream};
use flotilla_gateway::{GatewayConfig, router};
use flotilla_proto::{
    EngineEvent, EngineFailure, EngineRequest, EngineStatus, FinishReason, KvUsage, Rejection,
    RequestId, Sampled, TierStatus, Usage,
};
use flotilla_telemetry::Metrics;
use flotilla_text::TextSide;
use serde_json::{Value, json};
use tokio::sync::mpsc;

pub const MODEL: &str = "smollm2-test";
pub const SCRIPT: &str = " Hello world. The end";
pub const MAX_MODEL_LEN: usize = 256;

pub fn text() -> Arc<TextSide> {
    static TEXT: OnceLock<Arc<TextSide>> = OnceLock::new();
    TEXT.get_or_init(|| {
        let g = flotilla_gguf::GgufFile::open(&flotilla_hub::test_model_path())
            .expect("open the test model");
        Arc::new(TextSide::from_gguf(&g).expect("text side"))
    })
    .clone()
}

pub fn script_ids() -> Vec<u32> {
    text().tokenizer.encode(SCRIPT, false).unwrap()
}

/// What the fake engine does with the next submissions.
#[derive(Clone)]
pub enum Mode {
    /// Send these tokens, then `Finished`.
    Script(Vec<u32>, FinishReason),
    /// Send these tokens, then wait until the stream is dropped.
    Hang(Vec<u32>),
    /// Refuse at admission.
    Reject(Rejection),
    /// Send these tokens, then fail.
    Fail(Vec<u32>, EngineFailure),
}

/// What happened to one submitted request.
#[derive(Default)]
pub struct Probe {
    /// The terminal event was sent.
    pub ended: AtomicBool,
    /// The gateway dropped the stream.
    pub dropped: AtomicBool,
    /// ... before the terminal event was sent (a cancel).
    pub cancelled: AtomicBool,
    /// The stream was marked as ended by a stop string.
    pub stop_string: AtomicBool,
}

pub struct Fake {
    pub mode: Mutex<Mode>,
    pub seen: Mutex<Vec<(EngineRequest, Arc<Probe>)>>,
    pub ready: AtomicBool,
}

impl Fake {
    pub fn new() -> Arc<Fake> {
        Arc::new(Fake {
            mode: Mutex::new(Mode::Script(script_ids(), FinishReason::Length)),
            seen: Mutex::new(Vec::new()),
            ready: AtomicBool::new(true),
        })
    }
    pub fn set(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }
    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
    pub fn last(&self) -> (EngineRequest, Arc<Probe>) {
        let s = self.seen.lock().unwrap();
        let (r, p) = s.last().expect("a submission");
        (r.clone(), p.clone())
    }
}

pub fn sampled(id: u32, req: &EngineRequest) -> Sampled {
    if !req.sampling.logprobs {
        return Sampled {
            token: id,
            logprob: f32::NAN,
            top: Vec::new(),
        };
    }
    let top = [(id, -0.25), (id + 1, -1.5), (id + 2, -2.5)];
    Sampled {
        token: id,
        logprob: -0.25,
        top: top[..req.sampling.top_logprobs.min(3) as usize].to_vec(),
    }
}

impl Engine for Fake {
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>> {
        let mode = self.mode.lock().unwrap().clone();
        let probe = Arc::new(Probe::default());
        let mut seen = self.seen.lock().unwrap();
        seen.push((req.clone(), probe.clone()));
        let id = RequestId(seen.len() as u64);
        drop(seen);
        if let Mode::Reject(r) = mode {
            return Box::pin(async move { Err(r) });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let p = probe.clone();
        let on_drop = Box::new(move |stop_string: bool| {
            p.stop_string.store(stop_string, Ordering::SeqCst);
            if !p.ended.load(Ordering::SeqCst) {
                p.cancelled.store(true, Ordering::SeqCst);
            }
            p.dropped.store(true, Ordering::SeqCst);
        });
        let prompt_tokens = req.prompt.len() as u32;
        let usage = move |n: usize| Usage {
            prompt_tokens,
            completion_tokens: n as u32,
            cached_tokens: 0,
        };
        tokio::spawn(async move {
            let (ids, end) = match &mode {
                Mode::Script(ids, r) => (
                    ids.clone(),
                    Some(EngineEvent::Finished {
                        reason: *r,
                        usage: usage(ids.len()),
                    }),
                ),
                Mode::Hang(ids) => (ids.clone(), None),
                Mode::Fail(ids, f) => (ids.clone(), Some(EngineEvent::Failed(f.clone()))),
                Mode::Reject(_) => unreachable!(),
            };
            for id in ids {
                tokio::time::sleep(Duration::from_millis(5)).await;
                if tx.send(EngineEvent::Token(sampled(id, &req))).is_err() {
                    return;
                }
            }
            match end {
                Some(ev) => {
                    probe.ended.store(true, Ordering::SeqCst);
                    let _ = tx.send(ev);
                }
                None => tx.closed().await,
            }
        });
        Box::pin(async move { Ok(RequestStream::new(id, rx, on_drop)) })
    }

    fn status(&self) -> BoxFuture<EngineStatus> {
        let ready = self.ready.load(Ordering::SeqCst);
        Box::pin(async move {
            EngineStatus {
                ready,
                steps: 42,
                running: 1,
                tiers: vec![TierStatus {
                    name: "default".into(),
                    queued: 3,
                    running: 1,
                }],
                kv: KvUsage {
                    total: 100,
                    free: 60,
                    used: 30,
                    cached: 10,
                    held: 4,
                    reserved: 2,
                    dtype: Default::default(),
                    offload: Default::default(),
                },
                preemptions: 2,
                orphans: 0,
                draining: false,
                nodes: vec![],
                routing: Default::default(),
            }
        })
    }
}

pub const KEYED: &str = r#"
[[tiers]]
name = "paid"
[[tiers]]
name = "free"
[[tenants]]
name = "acme"
tier = "paid"
api_keys = ["sk-acme-0001"]
[[tenants]]
name = "hobby"
tier = "free"
api_keys = ["sk-hobby-001"]
"#;

pub struct Server {
    pub base: String,
    pub fake: Arc<Fake>,
    pub metrics: Arc<Metrics>,
    pub http: reqwest::Client,
}

pub async fn serve(cluster: ClusterConfig) -> Server {
    let fake = Fake::new();
    let metrics = Arc::new(Metrics::new().unwrap());
    let cfg = GatewayConfig::new(MODEL, MAX_MODEL_LEN, Arc::new(cluster));
    let app = router(fake.clone(), text(), metrics.clone(), cfg);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server {
        base,
        fake,
        metrics,
        http: reqwest::Client::new(),
    }
}

impl Server {
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// Posts a streaming request; returns the status and the `data:` payloads.
    pub async fn post_sse(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        let data = text
            .split("\n\n")
            .filter_map(|ev| ev.strip_prefix("data: "))
            .map(str::to_owned)
            .collect();
        (status, data)
    }
}

pub fn chat_body(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}]});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

pub fn parse_chunks(data: &[String]) -> Vec<Value> {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

pub async fn wait_dropped(p: &Probe) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(1) {
        if p.dropped.load(Ordering::SeqCst) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}
