//! The actor shells on a real multi-thread runtime, driven by a fake
//! executor whose steps the test holds open (`gate`) to put a step in flight.

use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use flotilla_engine::{Engine, KvMigration, RequestStream};
use flotilla_exec::{
    ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, Sampled, SamplingParams, SeqInput,
    SeqOutput, StepOutputs,
};
use flotilla_proto::{EngineEvent, EngineFailure, EngineRequest, Rejection, TenantId, TierId};
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

/// Samples token 42 for every item that asks (token 7 if a position before
/// the item's chunk holds no KV); says when a step starts, then waits for a
/// permit (or for the gate to be dropped) before running it. Its KV cache
/// is one byte per position: the token computed there.
struct FakeExec {
    spec: ModelSpec,
    entered: mpsc::UnboundedSender<()>,
    gate: std_mpsc::Receiver<()>,
    panic: bool,
    kv: Vec<u8>,
    /// Set once a step has been entered.
    in_step: Arc<std::sync::atomic::AtomicBool>,
}

pub(crate) const BLOCK: usize = 4;

pub(crate) fn slot(table: &[u32], pos: usize) -> usize {
    table[pos / BLOCK] as usize * BLOCK + pos % BLOCK
}

/// The fake executors' step over their one-byte-a-position cache: writes
/// each token where it goes and samples 42 where every earlier position
/// holds one (7 where one does not).
fn fake_step(kv: &mut [u8], batch: &[SeqInput<'_>]) -> Vec<SeqOutput> {
    let mut outs = Vec::with_capacity(batch.len());
    for s in batch {
        let table = s.block_table;
        let kv_ok = (0..s.start_pos).all(|p| kv[slot(table, p)] != 0);
        for (i, &t) in s.tokens.iter().enumerate() {
            kv[slot(table, s.start_pos + i)] = t as u8;
        }
        // A constrained sample reads its mask when it samples, as the
        // real executors do.
        if let Some(m) = s.allow {
            assert!(flotilla_exec::constraint::allowed(&m.words(), 42));
        }
        outs.push(SeqOutput {
            logits_row: None,
            sampled: matches!(s.output, OutputKind::Sample(_)).then(|| Sampled {
                token: if kv_ok { 42 } else { 7 },
                logprob: 0.0,
                top: Vec::new(),
            }),
            accepted: Vec::new(),
        });
    }
    outs
}

impl Executor for FakeExec {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> KvSpec {
        KvSpec {
            block_size: BLOCK,
            num_blocks: 64,
            dtype: KvDtype::F32,
            bytes_per_block: BLOCK,
        }
    }

    fn max_batch_tokens(&self) -> usize {
        256
    }

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        self.in_step
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = self.entered.send(());
        // Err once the test drops the sender: every later step runs at once.
        let _ = self.gate.recv();
        assert!(!self.panic, "injected executor panic");
        out.seqs = fake_step(&mut self.kv, batch);
        Ok(())
    }

    fn copy_block(&mut self, _src: u32, _dst: u32) -> Result<(), ExecError> {
        Ok(())
    }

    fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        let s = block as usize * BLOCK;
        out.copy_from_slice(&self.kv[s..s + BLOCK]);
        Ok(())
    }

    fn write_block(&mut self, block: u32, data: &[u8]) -> Result<(), ExecError> {
        let s = block as usize * BLOCK;
        self.kv[s..s + BLOCK].copy_from_slice(data);
        Ok(())
    }
}

/// One engine with one seat, and the handles that drive its executor.
struct Rig {
    engine: LocalEngine,
    entered: mpsc::UnboundedReceiver<()>,
    gate: Option<std_mpsc::Sender<()>>,
    /// A scheduler invariant that broke during the test (checked after
    /// every message the Scheduler handled).
    broken: Arc<std::sync::Mutex<Option<String>>>,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let broken = self.broken.lock().unwrap().take();
        if !std::thread::panicking() {
            assert_eq!(broken, None, "a scheduler invariant broke");
        }
    }
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
                logit_bias: Vec::new(),
                generated: 0,
                constraint: None,
                ignore_eos: true,
                stop_token_ids: Vec::new(),
                speculative: true,
                trace: None,
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
    rig_seats(queue_timeout, panic, 1).await
}

#[allow(
    clippy::disallowed_methods,
    reason = "the actors run on real timers here, so the clock is the real one"
)]
async fn rig_seats(queue_timeout: Duration, panic: bool, seats: usize) -> Rig {
    rig_with(queue_timeout, panic, seats, None, Default::default(), 1).await
}

#[allow(
    clippy::disallowed_methods,
    reason = "the actors run on real timers here, so the clock is the real one"
)]
async fn rig_with(
    queue_timeout: Duration,
    panic: bool,
    seats: usize,
    constraints: Option<Arc<dyn flotilla_exec::ConstraintCompiler>>,
    in_step: Arc<std::sync::atomic::AtomicBool>,
    decode_steps: usize,
) -> Rig {
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
        kv: vec![0; 64 * BLOCK],
        in_step,
    };
    let sched = SchedConfig {
        max_num_seqs: seats,
        queue_timeout,
        decode_steps,
        ..r_sched()
    };
    let broken = Arc::new(std::sync::Mutex::new(None));
    let seen = broken.clone();
    let engine = spawn_engine(
        Box::new(exec),
        EngineOptions {
            sched,
            check_invariants: Some(Arc::new(move |what| {
                seen.lock().unwrap().get_or_insert(what);
            })),
            constraints,
            offload_path: None,
            tracing: None,
            draft: None,
        },
        Arc::new(TestClock(Instant::now())),
        Arc::new(Metrics::new().unwrap()),
    )
    .await
    .unwrap();
    Rig {
        engine,
        entered,
        gate: Some(gate),
        broken,
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
    // The step that panicked fails its own request; the engine is lost
    // for the other (the Router would move that one).
    match end_of(&mut a).await {
        Some(EngineEvent::Failed(EngineFailure::Internal(m))) => {
            assert!(m.contains("panicked"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    match end_of(&mut b).await {
        Some(EngineEvent::Failed(EngineFailure::EngineLost(m))) => {
            assert!(m.contains("panicked"), "{m}")
        }
        other => panic!("{other:?}"),
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
            Some(EngineEvent::Failed(EngineFailure::EngineLost(m))) => {
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

pub(crate) fn prompt_of(max_tokens: u32) -> EngineRequest {
    EngineRequest {
        tenant: TenantId(0),
        prompt: (1..=10).collect(),
        max_tokens,
        sampling: SamplingParams::greedy(),
        logit_bias: Vec::new(),
        generated: 0,
        constraint: None,
        ignore_eos: true,
        stop_token_ids: Vec::new(),
        speculative: true,
        trace: None,
    }
}

/// Waits until the engine's KV blocks in use are `used`.
async fn kv_used_becomes(engine: &LocalEngine, used: u32) {
    let mut now = u32::MAX;
    let waited = tokio::time::timeout(WAIT, async {
        loop {
            now = engine.status().await.kv.used;
            if now == used {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "{now} blocks in use, not {used}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kv_exported_from_one_engine_continues_on_another() {
    let (mut p, mut d) = (
        rig(Duration::from_secs(60), false).await,
        rig(Duration::from_secs(60), false).await,
    );
    p.open_gate();
    d.open_gate();
    let hold = Duration::from_secs(60);
    let mut s = p
        .engine
        .submit_for_export(prompt_of(1), hold)
        .await
        .unwrap();
    let id = s.id;
    let Some(EngineEvent::Token(first)) = next(&mut s).await else {
        panic!("no first token");
    };
    assert!(matches!(
        next(&mut s).await,
        Some(EngineEvent::Finished { .. })
    ));
    drop(s);
    // Finished, dropped, and still held: 10 tokens in blocks of 4.
    kv_used_becomes(&p.engine, 3).await;
    let exp = p.engine.export_kv(id).await.unwrap();
    assert_eq!((exp.tokens, exp.blocks, exp.data.len()), (10, 3, 12));
    assert_eq!(exp.data[..10], (1..=10).collect::<Vec<u8>>()[..]);

    let r = d.engine.reserve_kv(TenantId(0), 10, hold).await.unwrap();
    kv_used_becomes(&d.engine, 3).await;
    let mut out = d
        .engine
        .import_kv(r, 10, exp.data, prompt_of(5), first.clone(), None)
        .await
        .unwrap();
    let mut tokens = Vec::new();
    loop {
        match next(&mut out).await {
            Some(EngineEvent::Token(t)) => tokens.push(t.token),
            Some(EngineEvent::Finished { usage, .. }) => {
                assert_eq!((usage.prompt_tokens, usage.completion_tokens), (10, 5));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    // 7 would mean a decode step read a position the import did not write.
    assert_eq!(tokens, [first.token, 42, 42, 42, 42]);
    kv_used_becomes(&d.engine, 0).await;
    assert!(p.engine.release_kv(id).await);
    assert!(!p.engine.release_kv(id).await, "released twice");
    assert!(p.engine.export_kv(id).await.is_err());
    kv_used_becomes(&p.engine, 0).await;
    p.engine.stop();
    d.engine.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_and_reserved_blocks_go_back_by_themselves() {
    let mut r = rig(Duration::from_secs(60), false).await;
    r.open_gate();
    let ttl = Duration::from_millis(200);
    let mut s = r.engine.submit_for_export(prompt_of(1), ttl).await.unwrap();
    assert!(matches!(
        end_of(&mut s).await,
        Some(EngineEvent::Finished { .. })
    ));
    drop(s);
    kv_used_becomes(&r.engine, 0).await;

    let res = r.engine.reserve_kv(TenantId(0), 10, ttl).await.unwrap();
    kv_used_becomes(&r.engine, 3).await;
    kv_used_becomes(&r.engine, 0).await;
    let first = Sampled {
        token: 42,
        logprob: 0.0,
        top: Vec::new(),
    };
    let late = r
        .engine
        .import_kv(res, 10, vec![1; 12], prompt_of(5), first.clone(), None)
        .await;
    assert!(
        matches!(late, Err(Rejection::Invalid(_))),
        "{:?}",
        late.err()
    );
    assert!(!r.engine.cancel_reservation(res).await);

    // A transfer of the wrong size is refused and gives the blocks back.
    let res = r.engine.reserve_kv(TenantId(0), 10, WAIT).await.unwrap();
    let short = r
        .engine
        .import_kv(res, 10, vec![1; 5], prompt_of(5), first, None)
        .await;
    assert!(
        matches!(short, Err(Rejection::Invalid(_))),
        "{:?}",
        short.err()
    );
    kv_used_becomes(&r.engine, 0).await;
    // Past the free blocks: refused, nothing taken (60 of 64 are reserved).
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(r.engine.reserve_kv(TenantId(0), 60, WAIT).await.unwrap());
    }
    assert_eq!(
        r.engine.reserve_kv(TenantId(0), 60, WAIT).await.err(),
        Some(Rejection::Unavailable)
    );
    kv_used_becomes(&r.engine, 60).await;
    for h in held {
        assert!(r.engine.cancel_reservation(h).await);
    }
    kv_used_becomes(&r.engine, 0).await;
    r.engine.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_submitted_to_a_sink_get_one_message_per_step() {
    let mut r = rig_seats(Duration::from_secs(60), false, 4).await;
    let (sink, mut rx) = mpsc::unbounded_channel();
    let mut a = r
        .engine
        .submit_to(prompt_of(4), sink.clone())
        .await
        .unwrap();
    let b = r
        .engine
        .submit_to(prompt_of(4), sink.clone())
        .await
        .unwrap();
    // Detached: the events go to the sink, not to the handle.
    assert_eq!(a.recv().await, None);
    r.open_gate();
    let (ids, mut tokens, mut ended) = ([a.id, b.id], [0u32; 2], [false; 2]);
    let (mut messages, mut events, mut shared) = (0, 0, 0);
    while ended != [true, true] {
        let step = tokio::time::timeout(WAIT, rx.recv())
            .await
            .unwrap()
            .unwrap();
        messages += 1;
        events += step.len();
        let mut seen = [0; 2];
        for (id, ev) in step {
            let i = ids.iter().position(|x| *x == id).expect("an id of ours");
            seen[i] += 1;
            assert!(!ended[i], "an event after the end of {id}");
            match ev {
                EngineEvent::Token(_) => tokens[i] += 1,
                EngineEvent::Finished { usage, .. } => {
                    assert_eq!(usage.completion_tokens, tokens[i]);
                    ended[i] = true;
                }
                other => panic!("{other:?}"),
            }
        }
        // A step samples one token per request: a request's events in one
        // message are that token and, at most, its end.
        assert!(seen.iter().all(|&n| n <= 2), "{seen:?}");
        if seen.iter().all(|&n| n > 0) {
            shared += 1;
        }
    }
    assert_eq!(tokens, [4, 4]);
    assert!(shared > 0, "no step carried both requests' events");
    assert!(messages < events, "{messages} messages for {events} events");
    drop((a, b));
    r.engine.stop();
}

/// Allows only token 42, counting the masks it is asked for; the output is
/// complete once 42 comes. Asked for a mask, it first waits (up to five
/// seconds) for the executor to be inside a step, and counts in `.2` the
/// masks asked for while one was: a mask computed before the step was
/// sent would wait in vain.
#[derive(Clone, Debug)]
struct Only42(
    Arc<std::sync::atomic::AtomicUsize>,
    Arc<std::sync::atomic::AtomicBool>,
    Arc<std::sync::atomic::AtomicUsize>,
);

impl flotilla_exec::TokenConstraint for Only42 {
    #[allow(
        clippy::disallowed_methods,
        reason = "waits on the real executor thread, on the real clock"
    )]
    fn allowed(&mut self, words: &mut Vec<u32>) {
        use std::sync::atomic::Ordering;
        self.0.fetch_add(1, Ordering::SeqCst);
        let t0 = Instant::now();
        while !self.1.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.1.load(Ordering::SeqCst) {
            self.2.fetch_add(1, Ordering::SeqCst);
        }
        words.clear();
        words.resize(4, 0);
        words[1] = 1 << (42 - 32);
    }
    fn commit(&mut self, token: u32) -> Result<bool, String> {
        if token == 42 {
            Ok(true)
        } else {
            Err(format!("token {token} is not allowed"))
        }
    }
}

/// Gives every constrained request a matcher sharing its prototype's counters.
#[derive(Debug)]
struct Only42Compiler(Only42);

impl flotilla_exec::ConstraintCompiler for Only42Compiler {
    fn compile(
        &self,
        _c: &flotilla_exec::Constraint,
    ) -> Result<Box<dyn flotilla_exec::TokenConstraint>, String> {
        Ok(Box::new(self.0.clone()))
    }
}

#[allow(
    clippy::disallowed_methods,
    reason = "the actors run on real timers here, so the clock is the real one"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mask_is_computed_while_its_step_runs() {
    use std::sync::atomic::Ordering;
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let overlapped = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let in_step = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let compiler = Only42Compiler(Only42(asked.clone(), in_step.clone(), overlapped.clone()));
    // The matcher watches the executor's own flag.
    let mut rig = rig_with(WAIT, false, 1, Some(Arc::new(compiler)), in_step, 1).await;
    let mut req = prompt_of(8);
    req.constraint = Some(flotilla_exec::Constraint::JsonObject);
    let mut rs = rig.engine.submit(req).await.unwrap();
    rig.step_started().await;
    // The executor is held inside the step, before it samples: the mask
    // is computed meanwhile, by the Scheduler's actor.
    let t0 = Instant::now();
    while asked.load(Ordering::SeqCst) == 0 {
        assert!(
            t0.elapsed() < WAIT,
            "the mask was not computed while the step ran"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    rig.open_gate();
    assert!(matches!(next(&mut rs).await, Some(EngineEvent::Token(s)) if s.token == 42));
    assert!(matches!(
        end_of(&mut rs).await,
        Some(EngineEvent::Finished {
            reason: flotilla_proto::FinishReason::Stop,
            ..
        })
    ));
    // Asked once, while the step was in flight; the executor read the
    // mask computed ahead instead of asking again.
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    assert_eq!(overlapped.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_multi_step_plan_runs_back_to_back_until_a_request_arrives() {
    let mut r = rig_with(WAIT, false, 4, None, Default::default(), 8).await;
    let permit = |r: &Rig| r.gate.as_ref().expect("gate closed").send(()).unwrap();
    let quiet = Duration::from_millis(100);
    let mut a = r.submit(12).await.unwrap();
    // The prompt: one step, one token.
    r.step_started().await;
    permit(&r);
    assert!(matches!(next(&mut a).await, Some(EngineEvent::Token(_))));
    // A decodes alone with nothing waiting: one plan of up to 8 steps, run
    // back to back; its tokens come when the plan ends.
    for _ in 0..2 {
        r.step_started().await;
        permit(&r);
    }
    r.step_started().await;
    assert!(
        tokio::time::timeout(quiet, a.recv()).await.is_err(),
        "a token before the plan ended"
    );
    // B arrives while the plan's third step runs: the plan ends after it.
    let mut b = r.submit(4).await.unwrap();
    permit(&r);
    for _ in 0..3 {
        assert!(matches!(next(&mut a).await, Some(EngineEvent::Token(_))));
    }
    // The next plan is B's prompt beside A's decode, one step.
    r.step_started().await;
    assert!(
        tokio::time::timeout(quiet, a.recv()).await.is_err(),
        "the cut plan ran more than the step in progress"
    );
    r.open_gate();
    // Every token is the fake model's 42: each step found the KV of every
    // position before it (else 7), so each step ran at its own position.
    let mut tokens = 4;
    loop {
        match next(&mut a).await {
            Some(EngineEvent::Token(t)) => {
                assert_eq!(t.token, 42);
                tokens += 1;
            }
            Some(EngineEvent::Finished { usage, .. }) => {
                assert_eq!(usage.completion_tokens, 12);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(tokens, 12);
    assert!(matches!(
        end_of(&mut b).await,
        Some(EngineEvent::Finished { usage, .. }) if usage.completion_tokens == 4
    ));
    kv_used_becomes(&r.engine, 0).await;
    r.engine.stop();
}

/// A pipelined executor (two stages): a step's results come out of
/// `finish_step` after the next step may have begun. Samples as
/// `FakeExec` does, from its one-byte-a-position cache.
struct PipeExec {
    spec: ModelSpec,
    kv: Vec<u8>,
    begun: std::collections::VecDeque<Vec<SeqOutput>>,
    /// Most steps begun and not finished at once.
    most: Arc<std::sync::atomic::AtomicUsize>,
}

impl Executor for PipeExec {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> KvSpec {
        KvSpec {
            block_size: BLOCK,
            num_blocks: 64,
            dtype: KvDtype::F32,
            bytes_per_block: BLOCK,
        }
    }

    fn max_batch_tokens(&self) -> usize {
        256
    }

    fn pipeline_depth(&self) -> usize {
        2
    }

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        self.begin_step(batch, out)?;
        self.finish_step(batch, out)
    }

    fn begin_step(&mut self, batch: &[SeqInput<'_>], _: &mut StepOutputs) -> Result<(), ExecError> {
        let outs = fake_step(&mut self.kv, batch);
        self.begun.push_back(outs);
        self.most
            .fetch_max(self.begun.len(), std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    fn finish_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<(), ExecError> {
        let outs = self.begun.pop_front().expect("a begun step");
        assert_eq!(
            outs.len(),
            batch.len(),
            "finished with the batch it began with"
        );
        out.seqs = outs;
        Ok(())
    }

    fn copy_block(&mut self, _src: u32, _dst: u32) -> Result<(), ExecError> {
        Ok(())
    }

    fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        let s = block as usize * BLOCK;
        out.copy_from_slice(&self.kv[s..s + BLOCK]);
        Ok(())
    }

    fn write_block(&mut self, block: u32, data: &[u8]) -> Result<(), ExecError> {
        let s = block as usize * BLOCK;
        self.kv[s..s + BLOCK].copy_from_slice(data);
        Ok(())
    }
}

/// An engine over a pipelined executor keeps two steps in flight when it
/// has the sequences for both, and every request gets its tokens, each
/// from a cache its earlier steps wrote; a lone request still finishes
/// (the worker is told to finish what it has).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(
    clippy::disallowed_methods,
    reason = "the actors run on real timers here, so the clock is the real one"
)]
async fn a_pipelined_executor_gets_two_steps_in_flight() {
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let exec = PipeExec {
        spec: ModelSpec {
            name: "fake".into(),
            arch: "llama".into(),
            n_layer: 2,
            n_embd: 8,
            n_head: 1,
            n_head_kv: 1,
            head_dim: 8,
            vocab: 100,
            ctx_len: 64,
            weight_bytes: 0,
        },
        kv: vec![0; 64 * BLOCK],
        begun: Default::default(),
        most: most.clone(),
    };
    let sched = SchedConfig {
        max_num_seqs: 8,
        ..r_sched()
    };
    let broken = Arc::new(std::sync::Mutex::new(None));
    let seen = broken.clone();
    let engine = spawn_engine(
        Box::new(exec),
        EngineOptions {
            sched,
            check_invariants: Some(Arc::new(move |what| {
                seen.lock().unwrap().get_or_insert(what);
            })),
            constraints: None,
            offload_path: None,
            tracing: None,
            draft: None,
        },
        Arc::new(TestClock(Instant::now())),
        Arc::new(Metrics::new().unwrap()),
    )
    .await
    .unwrap();
    // A lone request first: it must finish with nothing to overlap.
    let mut lone = engine.submit(prompt_of(5)).await.unwrap();
    let mut n = 0;
    loop {
        match next(&mut lone).await {
            Some(EngineEvent::Token(t)) => {
                assert_eq!(t.token, 42);
                n += 1;
            }
            Some(EngineEvent::Finished { .. }) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(n, 5);
    let mut streams = Vec::new();
    for _ in 0..8 {
        streams.push(engine.submit(prompt_of(12)).await.unwrap());
    }
    for s in &mut streams {
        let mut n = 0;
        loop {
            match next(s).await {
                Some(EngineEvent::Token(t)) => {
                    assert_eq!(t.token, 42, "sampled from a cache its steps wrote");
                    n += 1;
                }
                Some(EngineEvent::Finished { usage, .. }) => {
                    assert_eq!(usage.completion_tokens, 12);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(n, 12);
    }
    assert_eq!(
        most.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "two steps in flight"
    );
    assert_eq!(
        broken.lock().unwrap().take(),
        None,
        "a scheduler invariant broke"
    );
    engine.stop();
}

/// The scheduler settings of the rigs: one seat, a minute's queue
/// timeout, one tier and tenant, no speculation.
pub(crate) fn r_sched() -> SchedConfig {
    SchedConfig {
        num_blocks: 64,
        block_size: 4,
        max_num_seqs: 1,
        max_num_batched_tokens: 256,
        max_model_len: 64,
        batching: Batching::Continuous,
        queue_timeout: Duration::from_secs(60),
        stop_tokens: vec![2],
        tiers: vec![TierConfig {
            name: "t".into(),
            weight: 1,
            priority: 0,
            queue_len_max: 16,
            kv_reserved_blocks: 0,
            step_tokens_max: None,
            step_time_max: None,
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
        speculation: flotilla_sched::Speculation::OFF,
        offload_blocks: 0,
        step_time_max: None,
        decode_steps: 1,
    }
}
