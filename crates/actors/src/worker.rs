//! The GpuWorker actor: owns one executor (CPU today, CUDA or the
//! simulator's cost model through the same trait) and runs the steps the
//! Scheduler sends, one at a time.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use flotilla_model::{Executor, SeqInput, StepOutputs};
use flotilla_proto::Sampled;
use flotilla_sched::Plan;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::Clock;
use crate::engine::SchedMsg;

/// What the worker is asked to do.
pub(crate) enum WorkerMsg {
    /// Run one step and send `SchedMsg::StepDone` back.
    Step {
        plan: Plan,
        reply: ActorRef<SchedMsg>,
    },
}

/// The result of one step, sent back with its plan.
pub(crate) struct StepResult {
    pub plan: Plan,
    /// One entry per plan item: the sampled token where the item asked.
    pub sampled: Result<Vec<Option<Sampled>>, String>,
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
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        st: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        let WorkerMsg::Step { plan, reply } = msg;
        let t0 = st.clock.now();
        // The step is seconds of CPU work at worst: run it on this thread
        // but let tokio move its other tasks (HTTP, the scheduler) elsewhere.
        let sampled = tokio::task::block_in_place(|| run_step(st, &plan));
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

fn run_step(st: &mut WorkerState, plan: &Plan) -> Result<Vec<Option<Sampled>>, String> {
    if let Some(why) = &st.broken {
        return Err(why.clone());
    }
    let inputs: Vec<SeqInput<'_>> = plan.items.iter().map(|it| it.seq_input()).collect();
    let exec = &mut st.exec;
    let out = &mut st.out;
    match catch_unwind(AssertUnwindSafe(|| exec.step(&inputs, out))) {
        Ok(Ok(())) => Ok(out.seqs.iter_mut().map(|s| s.sampled.take()).collect()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => {
            let why = "the executor panicked; the engine needs a restart".to_string();
            st.broken = Some(why.clone());
            Err(why)
        }
    }
}
