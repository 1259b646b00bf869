//! The actor shells on a real multi-thread runtime, driven by a fake
//! executor whose steps the test holds open (`gate`) to put a step in flight.

use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use flotilla_model::{
    ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, Sampled, SamplingParams, SeqInput,
    SeqOutput, StepOutputs,
};
use flotilla_proto::{
    Engine, EngineEvent, EngineFailure, EngineRequest, Rejection, RequestStream, TenantId, TierId,
};
use flotilla_sched::{Batching, SchedConfig, TenantConfig, TierConfig};
use flotilla_telemetry::Metrics;
use tokio::sync::mpsc;

use crate::{Clock, EngineOptions, LocalEngine, spawn_engine};

struct TestClock(Instant);

impl Clock for TestClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// Samples token 42 for every item that asks; says when a step starts, then
/// waits for a permit (or for the gate to be dropped) before running it.
struct FakeExec {
    spec: ModelSpec,
    entered: mpsc::UnboundedSender<()>,
    gate: std_mpsc::Receiver<()>,
    panic: bool,
}

impl Executor for FakeExec {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> KvSpec {
        KvSpec {
            block_size: 4,
            num_blocks: 64,
            dtype: KvDtype::F32,
            bytes_per_block: 0,
        }
    }

    fn max_batch_tokens(&self) -> usize {
        256
    }

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        let _ = self.entered.send(());
        // Err once the test drops the sender: every later step runs at once.
        let _ = self.gate.recv();
        assert!(!self.panic, "injected executor panic");
        out.seqs.clear();
        out.seqs.extend(batch.iter().map(|s| SeqOutput {
            logits_row: None,
            sampled: matches!(s.output, OutputKind::Sample(_)).then(|| Sampled {
                token: 42,
                logprob: 0.0,
                top: Vec::new(),
            }),
        }));
        Ok(())
    }

    fn copy_block(&mut self, _src: u32, _dst: u32) -> Result<(), ExecError> {
        Ok(())
    }

    fn read_block(&self, _block: u32, _out: &mut [u8]) -> Result<(), ExecError> {
        Ok(())
    }

    fn write_block(&mut self, _block: u32, _data: &[u8]) -> Result<(), ExecError> {
        Ok(())
    }
}

/// One engine with one seat, and the handles that drive its executor.
struct Rig {
    engine: LocalEngine,
    entered: mpsc::UnboundedReceiver<()>,
    gate: Option<std_mpsc::Sender<()>>,
}

impl Rig {
    /// Waits until the executor is inside a step.
    async fn step_started(&mut self) {
        let started = tokio::time::timeout(WAIT, self.entered.recv()).await;
        assert!(matches!(started, Ok(Some(()))), "no step started");
    }

    /// Lets every step run from now on.
    fn open_gate(&mut self) {
        self.gate = None;
    }

    async fn submit(&self, max_tokens: u32) -> Result<RequestStream, Rejection> {
        self.engine
            .submit(EngineRequest {
                tenant: TenantId(0),
                prompt: vec![1, 2, 3],
                max_tokens,
                sampling: SamplingParams::greedy(),
                ignore_eos: true,
                stop_token_ids: Vec::new(),
            })
            .await
    }
}

/// Long enough that only a request that never gets an answer reaches it.
const WAIT: Duration = Duration::from_secs(10);

#[allow(
    clippy::disallowed_methods,
    reason = "the actors run on real timers here, so the clock is the real one"
)]
async fn rig(queue_timeout: Duration, panic: bool) -> Rig {
    let (entered_tx, entered) = mpsc::unbounded_channel();
    let (gate, gate_rx) = std_mpsc::channel();
    let exec = FakeExec {
        spec: ModelSpec {
            name: "fake".into(),
            arch: "llama".into(),
            n_layer: 1,
            n_embd: 8,
            n_head: 1,
            n_head_kv: 1,
            head_dim: 8,
            vocab: 100,
            ctx_len: 64,
            weight_bytes: 0,
        },
        entered: entered_tx,
        gate: gate_rx,
        panic,
    };
    let sched = SchedConfig {
        num_blocks: 64,
        block_size: 4,
        max_num_seqs: 1,
        max_num_batched_tokens: 256,
        max_model_len: 64,
        batching: Batching::Continuous,
        queue_timeout,
        stop_tokens: vec![2],
        tiers: vec![TierConfig {
            name: "t".into(),
            weight: 1,
            priority: 0,
            queue_len_max: 16,
            kv_reserved_blocks: 0,
        }],
        tenants: vec![TenantConfig {
            name: "a".into(),
            tier: TierId(0),
            weight: 1,
            max_concurrent: 0,
            requests_per_minute: None,
            kv_blocks_max: None,
            prefix_salt: 0,
        }],
    };
    let engine = spawn_engine(
        Box::new(exec),
        EngineOptions { sched },
        Arc::new(TestClock(Instant::now())),
        Arc::new(Metrics::new().unwrap()),
    )
    .await
    .unwrap();
    Rig {
        engine,
        entered,
        gate: Some(gate),
    }
}

/// The stream's next event; panics if none comes in time.
async fn next(rs: &mut RequestStream) -> Option<EngineEvent> {
    tokio::time::timeout(WAIT, rs.recv())
        .await
        .expect("the engine never answered")
}

/// Events until the terminal one (or the stream's end).
async fn end_of(rs: &mut RequestStream) -> Option<EngineEvent> {
    loop {
        match next(rs).await {
            Some(EngineEvent::Token(_)) => continue,
            other => return other,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_request_expires_while_a_step_is_in_flight() {
    let mut r = rig(Duration::from_millis(100), false).await;
    let mut a = r.submit(2).await.unwrap();
    r.step_started().await;
    // One seat: B waits, and its deadline passes while A's step is held open.
    let mut b = r.submit(2).await.unwrap();
    match next(&mut b).await {
        Some(EngineEvent::Failed(EngineFailure::QueueTimeout { .. })) => {}
        other => panic!("{other:?}"),
    }
    r.open_gate();
    assert!(matches!(
        end_of(&mut a).await,
        Some(EngineEvent::Finished { .. })
    ));
    r.engine.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn executor_panic_fails_running_and_queued_requests() {
    let mut r = rig(Duration::from_secs(60), true).await;
    let mut a = r.submit(2).await.unwrap();
    r.step_started().await;
    let mut b = r.submit(2).await.unwrap();
    r.open_gate();
    for rs in [&mut a, &mut b] {
        match end_of(rs).await {
            Some(EngineEvent::Failed(EngineFailure::Internal(m))) => {
                assert!(m.contains("panicked"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(r.submit(2).await.err(), Some(Rejection::Unavailable));
    assert!(!r.engine.status().await.ready);
    r.engine.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_worker_fails_running_and_queued_requests() {
    let mut r = rig(Duration::from_secs(60), false).await;
    let mut a = r.submit(4).await.unwrap();
    r.step_started().await;
    let mut b = r.submit(4).await.unwrap();
    let children = r.engine.sched.get_children();
    assert_eq!(children.len(), 1, "the worker is linked to the scheduler");
    // It stops after the step in flight, with A's next step in its mailbox.
    children[0].stop(None);
    r.open_gate();
    for rs in [&mut a, &mut b] {
        match end_of(rs).await {
            Some(EngineEvent::Failed(EngineFailure::Internal(m))) => {
                assert!(m.contains("worker"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(r.submit(2).await.err(), Some(Rejection::Unavailable));
    assert!(!r.engine.status().await.ready);
    r.engine.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stop_fails_live_requests_with_shutting_down() {
    let mut r = rig(Duration::from_secs(60), false).await;
    let mut a = r.submit(4).await.unwrap();
    r.step_started().await;
    let mut b = r.submit(4).await.unwrap();
    r.engine.stop();
    for rs in [&mut a, &mut b] {
        assert_eq!(
            end_of(rs).await,
            Some(EngineEvent::Failed(EngineFailure::ShuttingDown))
        );
    }
    r.open_gate();
}
