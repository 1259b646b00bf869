//! The GpuWorker actor: owns one executor (CPU today, CUDA or the
//! simulator's cost model through the same trait) and runs the steps the
//! Scheduler sends, one at a time.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use flotilla_exec::{ExecError, Executor, SeqInput, SeqOutput, StepOutputs};
use flotilla_proto::KvExport;
use flotilla_sched::Plan;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::Clock;
use crate::engine::{PendingImport, SchedMsg};

/// What the worker is asked to do. Messages run in the order sent, so a
/// block read or write sent before a step happens before it.
pub(crate) enum WorkerMsg {
    /// Run one step and send `SchedMsg::StepDone` back.
    Step {
        plan: Plan,
        reply: ActorRef<SchedMsg>,
    },
    /// Read held blocks out for export (`tokens` tokens of KV).
    ReadBlocks {
        blocks: Vec<u32>,
        tokens: u32,
        reply: RpcReplyPort<Result<KvExport, String>>,
    },
    /// Write imported KV into reserved blocks and send
    /// `SchedMsg::Imported` back.
    WriteBlocks {
        blocks: Vec<u32>,
        data: Vec<u8>,
        pending: Box<PendingImport>,
        reply: ActorRef<SchedMsg>,
    },
}

/// The result of one step, sent back with its plan.
pub(crate) struct StepResult {
    pub plan: Plan,
    /// One entry per plan item: its sampled token (after the draft tokens
    /// it accepted) where the item asked.
    pub sampled: Result<Vec<SeqOutput>, String>,
    pub elapsed: Duration,
    /// False once the executor can no longer be trusted.
    pub worker_ok: bool,
}

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
}

pub(crate) struct WorkerArgs {
    pub exec: Box<dyn Executor>,
    pub clock: Arc<dyn Clock>,
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
        Ok(WorkerState {
            exec: args.exec,
            out: StepOutputs::default(),
            clock: args.clock,
            broken: None,
            owed: std::time::Duration::ZERO,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        st: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        let (plan, reply) = match msg {
            WorkerMsg::Step { plan, reply } => (plan, reply),
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
        };
        let t0 = st.clock.now();
        // The step is seconds of CPU work at worst: run it on this thread
        // but let tokio move its other tasks (HTTP, the scheduler) elsewhere.
        // A current-thread runtime (the simulator) has nowhere to move them.
        let multi = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread;
        let sampled = if multi {
            tokio::task::block_in_place(|| run_step(st, &plan))
        } else {
            run_step(st, &plan)
        };
        // A modelled backend's step takes its modelled time on the clock.
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
        let elapsed = st.clock.now().saturating_sub(t0);
        // A scheduler that is gone has nobody left to serve.
        let _ = reply.cast(SchedMsg::StepDone(Box::new(StepResult {
            plan,
            sampled,
            elapsed,
            worker_ok: st.broken.is_none(),
        })));
        Ok(())
    }
}

fn run_step(st: &mut WorkerState, plan: &Plan) -> Result<Vec<SeqOutput>, String> {
    if let Some(why) = &st.broken {
        return Err(why.clone());
    }
    let inputs: Vec<SeqInput<'_>> = plan.items.iter().map(|it| it.seq_input()).collect();
    let exec = &mut st.exec;
    let out = &mut st.out;
    match catch_unwind(AssertUnwindSafe(|| exec.step(&inputs, out))) {
        Ok(Ok(())) => Ok(std::mem::take(&mut out.seqs)),
        // A device error leaves the backend untrusted, as a panic does.
        Ok(Err(e @ ExecError::Backend(_))) => {
            let why = format!("{e}; the engine needs a restart");
            st.broken = Some(why.clone());
            Err(why)
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => {
            let why = "the executor panicked; the engine needs a restart".to_string();
            st.broken = Some(why.clone());
            Err(why)
        }
    }
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
