//! The GpuWorker actor: owns one executor (CPU today, CUDA or the
//! simulator's cost model through the same trait) and runs the steps the
//! Scheduler sends, one at a time.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flotilla_exec::{ExecError, Executor, OffloadTier, SeqInput, SeqOutput, StepOutputs};
use flotilla_kv::BlockMove;
use flotilla_proto::KvExport;
use flotilla_sched::Plan;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::Clock;
use crate::msg::{SchedMsg, StepResult, WorkerMsg};

pub(crate) struct GpuWorker;

pub(crate) struct WorkerState {
    exec: Box<dyn Executor>,
    out: StepOutputs,
    clock: Arc<dyn Clock>,
    /// Set when a step panicked: the executor's state can no longer be
    /// trusted, so every later step fails and `/ready` says so.
    broken: Option<String>,
    /// Modelled time not yet slept: tokio's timer counts whole
    /// milliseconds, so each step sleeps the whole milliseconds it owes
    /// and carries the rest, rather than rounding every step up.
    owed: std::time::Duration,
    /// The KV offload tier, if the pool has a tier.
    offload: Option<Offload>,
    /// Moves performed since the last step result, and their time.
    moved: u32,
    move_time: Duration,
    /// Shared with the Scheduler actor: the steps of the multi-step plan in
    /// flight begun, and its cut (begin no more after the step in progress).
    gate: Arc<PlanGate>,
    /// The executor's pipeline depth: above 1, steps are begun and
    /// finished apart, up to this many at once.
    depth: usize,
    /// Steps begun and not finished, oldest first.
    pending: std::collections::VecDeque<Begun>,
    /// The break was a part of the backend lost (`ExecError::Lost`).
    lost: bool,
    /// The draft model (speculative decoding with one), if any.
    draft: Option<crate::draft::DraftModel>,
}

/// A step begun on a pipelined executor, waiting to be finished.
struct Begun {
    plan: Plan,
    reply: ActorRef<SchedMsg>,
    t0: Duration,
}

pub(crate) struct WorkerArgs {
    pub exec: Box<dyn Executor>,
    pub clock: Arc<dyn Clock>,
    pub offload: Option<Offload>,
    pub gate: Arc<PlanGate>,
    pub draft: Option<crate::draft::DraftModel>,
}

/// What the Scheduler actor and its worker share about a multi-step plan
/// in flight, in one word so that a cut reads the final count: how many of
/// its steps the worker has begun, and whether the Scheduler cut it (then
/// the worker begins no more after the step in progress).
#[derive(Debug, Default)]
pub(crate) struct PlanGate(AtomicU64);

impl PlanGate {
    const CUT: u64 = 1 << 63;

    /// A new plan: nothing begun, not cut.
    pub(crate) fn reset(&self) {
        self.0.store(0, Ordering::SeqCst);
    }

    /// The worker begins a step; false (and no step) if the plan was cut
    /// after one began. The first step always runs.
    fn begin(&self) -> bool {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| {
                (s & Self::CUT == 0 || s & !Self::CUT == 0).then_some(s + 1)
            })
            .is_ok()
    }

    /// Cuts the plan: the steps begun, which are all it runs (at least
    /// one: the first always runs).
    pub(crate) fn cut(&self) -> usize {
        ((self.0.fetch_or(Self::CUT, Ordering::SeqCst) & !Self::CUT) as usize).max(1)
    }

    /// Steps begun so far (at least one).
    pub(crate) fn begun(&self) -> usize {
        ((self.0.load(Ordering::SeqCst) & !Self::CUT) as usize).max(1)
    }
}

/// Where the KV offload tier's bytes are.
pub(crate) enum Offload {
    /// Here, beside the executor (RAM or a mapped file).
    Host(OffloadTier),
    /// In the executor (`Executor::attach_offload` kept them).
    Executor,
}

impl Actor for GpuWorker {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<WorkerMsg>,
        args: WorkerArgs,
    ) -> Result<WorkerState, ActorProcessingErr> {
        let depth = args.exec.pipeline_depth().max(1);
        Ok(WorkerState {
            depth,
            pending: std::collections::VecDeque::new(),
            lost: false,
            exec: args.exec,
            out: StepOutputs::default(),
            clock: args.clock,
            broken: None,
            owed: std::time::Duration::ZERO,
            offload: args.offload,
            moved: 0,
            move_time: Duration::ZERO,
            gate: args.gate,
            draft: args.draft,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        st: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        let (plan, moves, reply) = match msg {
            WorkerMsg::Step { plan, moves, reply } => (plan, moves, reply),
            WorkerMsg::Moves(moves) => {
                perform_moves(st, &moves);
                return Ok(());
            }
            WorkerMsg::ReadBlocks {
                blocks,
                tokens,
                reply,
            } => {
                let _ = reply.send(read_blocks(st, &blocks, tokens));
                return Ok(());
            }
            WorkerMsg::WriteBlocks {
                blocks,
                data,
                pending,
                reply,
            } => {
                let written = write_blocks(st, &blocks, &data);
                let _ = reply.cast(SchedMsg::Imported(pending, written));
                return Ok(());
            }
            WorkerMsg::Recover(reply) => {
                let mut back = st.broken.is_none();
                // Only a backend that lost a part of itself comes back.
                if st.broken.is_some() && st.lost {
                    // Steps begun before the break were failed with it.
                    st.pending.clear();
                    let exec = &mut st.exec;
                    let mut go =
                        || catch_unwind(AssertUnwindSafe(|| exec.recover())).unwrap_or(false);
                    back = if crate::on_multi_thread_runtime() {
                        tokio::task::block_in_place(go)
                    } else {
                        go()
                    };
                    if back {
                        st.broken = None;
                        st.lost = false;
                    }
                }
                let _ = reply.cast(SchedMsg::WorkerRecovered(back));
                return Ok(());
            }
            WorkerMsg::Flush => {
                while !st.pending.is_empty() {
                    finish_oldest(st).await;
                }
                return Ok(());
            }
        };
        let t0 = st.clock.now();
        perform_moves(st, &moves);
        let mut plan = plan;
        if st.depth > 1 {
            begin(st, plan, reply, t0).await;
            return Ok(());
        }
        let (sampled, ran) = if plan.is_multi_step() {
            run_steps(st, &plan).await
        } else {
            if plan
                .items
                .iter()
                .any(|it| it.self_draft > 0 && it.draft > 0)
            {
                fill_self_drafts(st, &mut plan);
            }
            fill_model_drafts(st, &mut plan);
            let inputs: Vec<SeqInput<'_>> = plan.items.iter().map(|it| it.seq_input()).collect();
            let sampled = run_step(st, &inputs);
            sleep_modelled(st).await;
            (sampled, 1)
        };
        answer(st, plan, &reply, sampled, t0, ran);
        Ok(())
    }
}

/// Begins a step on a pipelined executor (its self-drafts first, on the
/// executor's first stage), finishing the oldest begun one once `depth`
/// are under way. A begin that fails answers at once.
async fn begin(st: &mut WorkerState, mut plan: Plan, reply: ActorRef<SchedMsg>, t0: Duration) {
    if plan
        .items
        .iter()
        .any(|it| it.self_draft > 0 && it.draft > 0)
    {
        fill_self_drafts(st, &mut plan);
    }
    fill_model_drafts(st, &mut plan);
    let begun = {
        let inputs: Vec<SeqInput<'_>> = plan.items.iter().map(|it| it.seq_input()).collect();
        on_executor(st, |exec, out| exec.begin_step(&inputs, out))
    };
    match begun {
        Ok(()) => {
            st.pending.push_back(Begun { plan, reply, t0 });
            if st.pending.len() >= st.depth {
                finish_oldest(st).await;
            }
        }
        Err(e) => {
            // Ends after every step begun before it, as steps must.
            while !st.pending.is_empty() {
                finish_oldest(st).await;
            }
            answer(st, plan, &reply, Err(e), t0, 1);
        }
    }
}

/// Finishes the oldest begun step and answers it (a modelled backend's
/// step first takes what is left of its modelled time on the clock).
async fn finish_oldest(st: &mut WorkerState) {
    if st.pending.is_empty() {
        return;
    }
    if let Some(d) = st.exec.simulated_wait() {
        // Whole milliseconds (the timer's grain), rounded down: the model
        // keeps each stage's exact times, so nothing adds up.
        let whole = Duration::from_millis(d.as_millis() as u64);
        if !whole.is_zero() {
            tokio::time::sleep(whole).await;
        }
    }
    let Some(Begun { plan, reply, t0 }) = st.pending.pop_front() else {
        return;
    };
    let sampled = {
        let inputs: Vec<SeqInput<'_>> = plan.items.iter().map(|it| it.seq_input()).collect();
        on_executor(st, |exec, out| exec.finish_step(&inputs, out))
            .map(|()| std::mem::take(&mut st.out.seqs))
    };
    answer(st, plan, &reply, sampled, t0, 1);
}

/// Sends a step's result to the Scheduler.
fn answer(
    st: &mut WorkerState,
    plan: Plan,
    reply: &ActorRef<SchedMsg>,
    sampled: Result<Vec<SeqOutput>, String>,
    t0: Duration,
    ran: usize,
) {
    let elapsed = st.clock.now().saturating_sub(t0);
    // A scheduler that is gone has nobody left to serve.
    let _ = reply.cast(SchedMsg::StepDone(Box::new(StepResult {
        plan,
        sampled,
        elapsed,
        ran,
        moved: std::mem::take(&mut st.moved),
        move_time: std::mem::take(&mut st.move_time),
        worker_ok: st.broken.is_none(),
        lost: st.lost,
        draft: st
            .draft
            .as_mut()
            .map(|d| std::mem::take(&mut d.passes))
            .unwrap_or_default(),
        draft_blocks: st.draft.as_ref().map(|d| d.blocks_with_kv()),
    })));
}

/// Runs one step (its outputs are taken from the worker's scratch).
fn run_step(st: &mut WorkerState, inputs: &[SeqInput<'_>]) -> Result<Vec<SeqOutput>, String> {
    on_executor(st, |exec, out| exec.step(inputs, out))?;
    Ok(std::mem::take(&mut st.out.seqs))
}

/// Runs `f` on the executor with the worker's scratch outputs: seconds of
/// CPU work at worst, so on this thread but letting tokio move its other
/// tasks (HTTP, the scheduler) elsewhere; a current-thread runtime (the
/// simulator) has nowhere to move them. A panic or a device error leaves
/// the backend untrusted: the worker refuses every later call.
fn on_executor(
    st: &mut WorkerState,
    f: impl FnOnce(&mut dyn Executor, &mut StepOutputs) -> Result<(), ExecError>,
) -> Result<(), String> {
    if let Some(why) = &st.broken {
        return Err(why.clone());
    }
    let (exec, out) = (&mut st.exec, &mut st.out);
    let go = || catch_unwind(AssertUnwindSafe(|| f(exec.as_mut(), out)));
    let r = if crate::on_multi_thread_runtime() {
        tokio::task::block_in_place(go)
    } else {
        go()
    };
    match r {
        Ok(Ok(())) => Ok(()),
        // A device error leaves the backend untrusted, as a panic does.
        Ok(Err(e @ ExecError::Backend(_))) => {
            let why = format!("{e}; the engine needs a restart");
            st.broken = Some(why.clone());
            Err(why)
        }
        // A part of the backend is gone, not this step's fault: its
        // requests may move.
        Ok(Err(ExecError::Lost(e))) => {
            st.broken = Some(e.clone());
            st.lost = true;
            Err(e)
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => {
            let why = "the executor panicked; the engine needs a restart".to_string();
            st.broken = Some(why.clone());
            Err(why)
        }
    }
}

/// Replaces the placeholder draft tokens of a plan's self-drafted items
/// with the model's own greedy guesses through its first layers
/// (`Executor::draft_step`): one pass per draft position, the items still
/// drafting together. A pass that fails leaves the rest as they are: a
/// draft is only a guess, which the step verifies.
fn fill_self_drafts(st: &mut WorkerState, plan: &mut flotilla_sched::Plan) {
    let rows: Vec<usize> = (0..plan.items.len())
        .filter(|&i| plan.items[i].self_draft > 0 && plan.items[i].draft > 0)
        .collect();
    let longest = rows.iter().map(|&i| plan.items[i].draft).max().unwrap_or(0);
    let layers = rows
        .iter()
        .map(|&i| plan.items[i].self_draft)
        .max()
        .unwrap_or(0);
    let greedy = flotilla_exec::SamplingParams::greedy();
    for j in 0..longest {
        let live: Vec<usize> = rows
            .iter()
            .copied()
            .filter(|&i| plan.items[i].draft > j)
            .collect();
        let done = {
            let inputs: Vec<SeqInput<'_>> = live
                .iter()
                .map(|&i| {
                    let it = &plan.items[i];
                    // The token before draft position j, at its position.
                    let at = it.tokens.len() - it.draft - 1 + j;
                    SeqInput {
                        tokens: std::slice::from_ref(&it.tokens[at]),
                        start_pos: it.start_pos + at,
                        block_table: &it.block_table,
                        output: flotilla_exec::OutputKind::Sample(greedy),
                        bias: &[],
                        draft_bias: &[],
                        allow: None,
                    }
                })
                .collect();
            on_executor(st, |exec, out| exec.draft_step(&inputs, out, layers))
        };
        if let Err(e) = done {
            tracing::debug!(error = %e, "a self-draft pass failed; the placeholders stay");
            return;
        }
        for (n, &i) in live.iter().enumerate() {
            let it = &mut plan.items[i];
            let at = it.tokens.len() - it.draft + j;
            if let Some(t) = st.out.seqs.get(n).and_then(|o| o.sampled.as_ref()) {
                it.tokens[at] = t.token;
            }
        }
    }
}

/// Fills a plan's model-drafted placeholders with the draft model's
/// guesses ([`crate::draft::DraftModel::fill`]), where the worker holds one.
fn fill_model_drafts(st: &mut WorkerState, plan: &mut Plan) {
    if let Some(d) = st.draft.as_mut()
        && st.broken.is_none()
        && plan
            .items
            .iter()
            .any(|it| it.model_draft.is_some() && it.draft > 0)
    {
        d.fill(st.clock.as_ref(), plan);
        // A modelled draft's passes take their time with the step's.
        st.owed += std::mem::take(&mut d.modelled);
    }
}

/// A modelled backend's step takes its modelled time on the clock.
async fn sleep_modelled(st: &mut WorkerState) {
    if let Some(d) = st.exec.simulated_step_time() {
        st.owed += d;
        let whole = std::time::Duration::from_millis(st.owed.as_millis() as u64);
        if !whole.is_zero() {
            let before = st.clock.now();
            tokio::time::sleep(whole).await;
            st.owed = st
                .owed
                .saturating_sub(st.clock.now().saturating_sub(before));
        }
    }
}

/// Runs a multi-step plan: each step's samples are the next step's tokens
/// at the next position (the leases cover every step), until the plan's
/// steps are done or the Scheduler cuts it after the step in progress.
/// Each item's samples but the last go to its output's `accepted`.
async fn run_steps(st: &mut WorkerState, plan: &Plan) -> (Result<Vec<SeqOutput>, String>, usize) {
    let mut outs: Vec<SeqOutput> = plan.items.iter().map(|_| SeqOutput::default()).collect();
    let mut last: Vec<u32> = plan.items.iter().map(|it| it.tokens[0]).collect();
    let mut ran = 0;
    while ran < plan.steps && (ran == 0 || !st.exec.simulated_single_steps()) && st.gate.begin() {
        let step = {
            let inputs: Vec<SeqInput<'_>> = plan
                .items
                .iter()
                .zip(&last)
                .map(|(it, tok)| SeqInput {
                    tokens: std::slice::from_ref(tok),
                    start_pos: it.start_pos + ran,
                    ..it.seq_input()
                })
                .collect();
            run_step(st, &inputs)
        };
        let step = match step {
            Ok(s) => s,
            Err(e) => return (Err(e), ran + 1),
        };
        for ((o, s), l) in outs.iter_mut().zip(step).zip(&mut last) {
            let Some(tok) = s.sampled else {
                return (Err("the executor returned no token".into()), ran + 1);
            };
            *l = tok.token;
            if let Some(prev) = o.sampled.replace(tok) {
                o.accepted.push(prev);
            }
        }
        ran += 1;
        sleep_modelled(st).await;
    }
    (Ok(outs), ran)
}

/// Performs moves between the KV tiers, in order, timing them. A move
/// that fails leaves a registered block without its bytes: the executor is
/// no longer trusted, as after a device error.
fn perform_moves(st: &mut WorkerState, moves: &[BlockMove]) {
    if moves.is_empty() || st.broken.is_some() {
        return;
    }
    let t0 = st.clock.now();
    let exec = &mut st.exec;
    let result = match st.offload.as_mut() {
        None => Err("block moves without an offload tier".to_string()),
        Some(Offload::Executor) => moves.iter().try_for_each(|m| {
            match *m {
                BlockMove::Spill { block, slot } => exec.spill_to_slot(block, slot),
                BlockMove::Restore { slot, block } => exec.restore_from_slot(slot, block),
            }
            .map_err(|e| e.to_string())
        }),
        Some(Offload::Host(tier)) => moves.iter().try_for_each(|m| match *m {
            BlockMove::Spill { block, slot } => {
                let dst = tier.slot_mut(slot)?;
                exec.spill_block(block, dst).map_err(|e| e.to_string())
            }
            BlockMove::Restore { slot, block } => {
                let src = tier.slot(slot)?;
                exec.restore_block(src, block).map_err(|e| e.to_string())
            }
        }),
    };
    if let Err(e) = result {
        st.broken = Some(format!(
            "moving KV blocks between tiers: {e}; the engine needs a restart"
        ));
        return;
    }
    let n = moves.len() as u32;
    st.moved += n;
    st.move_time += match st.exec.simulated_offload_time() {
        Some(per_block) => per_block * n,
        None => st.clock.now().saturating_sub(t0),
    };
}

/// Copies `blocks` out of the executor's KV cache, in order.
fn read_blocks(st: &mut WorkerState, blocks: &[u32], tokens: u32) -> Result<KvExport, String> {
    if let Some(why) = &st.broken {
        return Err(why.clone());
    }
    let bpb = st.exec.kv_spec().bytes_per_block;
    let mut data = vec![0u8; blocks.len() * bpb];
    for (&b, out) in blocks.iter().zip(data.chunks_exact_mut(bpb)) {
        st.exec.read_block(b, out).map_err(|e| e.to_string())?;
    }
    Ok(KvExport {
        tokens,
        blocks: blocks.len() as u32,
        data,
    })
}

/// Writes `data` (whole blocks, in order) into `blocks`.
fn write_blocks(st: &mut WorkerState, blocks: &[u32], data: &[u8]) -> Result<(), String> {
    if let Some(why) = &st.broken {
        return Err(why.clone());
    }
    let bpb = st.exec.kv_spec().bytes_per_block;
    if data.len() != blocks.len() * bpb {
        return Err(format!(
            "{} bytes of KV for {} blocks of {bpb} bytes",
            data.len(),
            blocks.len()
        ));
    }
    for (&b, chunk) in blocks.iter().zip(data.chunks_exact(bpb)) {
        st.exec.write_block(b, chunk).map_err(|e| e.to_string())?;
    }
    Ok(())
}
