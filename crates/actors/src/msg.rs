//! The messages between the Scheduler actor (`engine`) and the GpuWorker
//! actor (`worker`), in a module of their own so that neither actor's
//! module imports the other's for them.

use std::time::Duration;

use flotilla_engine::{EventSink, RequestStream};
use flotilla_exec::SeqOutput;
use flotilla_kv::BlockMove;
use flotilla_proto::{
    EngineRequest, EngineStatus, KvExport, Rejection, RequestId, Sampled, TenantId,
};
use flotilla_sched::Plan;
use ractor::{ActorRef, RpcReplyPort};

/// Messages of the Scheduler actor.
pub(crate) enum SchedMsg {
    /// The worker is broken: ask it to recover (again a while later).
    TryRecover,
    /// The worker's answer to `WorkerMsg::Recover`: true when it runs
    /// steps again (every block's contents lost).
    WorkerRecovered(bool),
    /// Admit a request (or refuse it at once); its events go to its own
    /// stream, or with a `sink` there, per step.
    Submit {
        req: EngineRequest,
        sink: Option<EventSink>,
        reply: RpcReplyPort<Result<RequestStream, Rejection>>,
    },
    /// The client went away: drop the request wherever it is.
    Cancel(RequestId),
    /// The Router ended the request at a stop string: finish it now.
    StopString(RequestId),
    /// The worker finished a step.
    StepDone(Box<StepResult>),
    /// A queue deadline may have passed.
    Wake,
    /// Figures for `/ready`.
    Status(RpcReplyPort<EngineStatus>),
    /// Admit a request whose blocks stay held after it finishes.
    SubmitHeld {
        req: EngineRequest,
        hold_for: Duration,
        reply: RpcReplyPort<Result<RequestStream, Rejection>>,
    },
    /// Read a finished request's held blocks (through the worker).
    Export {
        id: RequestId,
        reply: RpcReplyPort<Result<KvExport, String>>,
    },
    /// Stop a running request and hold its KV for a move.
    Detach {
        id: RequestId,
        hold: Duration,
        reply: RpcReplyPort<Result<Vec<u32>, String>>,
    },
    /// Give back held blocks.
    Release {
        id: RequestId,
        reply: RpcReplyPort<bool>,
    },
    /// Reserve blocks for an import.
    Reserve {
        tenant: TenantId,
        tokens: u32,
        ttl: Duration,
        reply: RpcReplyPort<Result<RequestId, Rejection>>,
    },
    /// Write KV into a reservation (through the worker), then continue the request.
    Import(Box<PendingImport>, Vec<u8>),
    /// The worker wrote (or failed to write) an import's blocks.
    Imported(Box<PendingImport>, Result<(), String>),
    /// Give back a reservation.
    CancelReservation {
        id: RequestId,
        reply: RpcReplyPort<bool>,
    },
    /// Ids that hold KV or a seat.
    KvHolders(RpcReplyPort<Vec<RequestId>>),
    /// The prefix cache's changes since the last ask, or (`snapshot`) its
    /// contents.
    PrefixChanges {
        snapshot: bool,
        reply: RpcReplyPort<flotilla_proto::PrefixChanges>,
    },
    /// Give back whatever an orphaned id holds.
    DropOrphan {
        id: RequestId,
        reply: RpcReplyPort<bool>,
    },
}

/// An import on its way through the worker.
pub(crate) struct PendingImport {
    pub reservation: RequestId,
    pub tokens: u32,
    pub req: EngineRequest,
    pub first: Sampled,
    pub sink: Option<EventSink>,
    pub reply: RpcReplyPort<Result<RequestStream, Rejection>>,
}

/// What the worker is asked to do. Messages run in the order sent, so a
/// block read or write sent before a step happens before it.
///
/// The worker is the one owner of the KV bytes: steps, migration reads and
/// writes and the moves between KV tiers all run here, one at a time, in
/// the order the Scheduler actor decided them; none can race another.
pub(crate) enum WorkerMsg {
    /// Try to make a broken executor usable again; answered with
    /// `SchedMsg::WorkerRecovered` when it is.
    Recover(ActorRef<SchedMsg>),
    /// Finish every begun step now (a pipelined executor): the Scheduler
    /// has no other step to overlap them with.
    Flush,
    /// Perform `moves` (between the KV tiers, in order), then run one step
    /// and send `SchedMsg::StepDone` back.
    Step {
        plan: Plan,
        moves: Vec<BlockMove>,
        reply: ActorRef<SchedMsg>,
    },
    /// Perform moves between the KV tiers decided outside a step (before a
    /// block read or write, or when no step follows).
    Moves(Vec<BlockMove>),
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
    /// Steps run: 1, or of a multi-step plan those that ran before the
    /// Scheduler cut it short (each item's samples but the last are in its
    /// output's `accepted`).
    pub ran: usize,
    /// Tier moves performed since the last step's result (this step's
    /// included) and their time (within `elapsed` for this step's).
    pub moved: u32,
    pub move_time: Duration,
    /// False once the executor can no longer be trusted.
    pub worker_ok: bool,
    /// It broke because a part of it was lost (a pipeline stage), not
    /// because of a request: the step's requests may run elsewhere.
    pub lost: bool,
    /// The draft model's passes before this step (and any since the last
    /// result), for its cost fit.
    pub draft: Vec<crate::draft::DraftPass>,
    /// Blocks whose draft half holds KV, where the worker has a draft model.
    pub draft_blocks: Option<usize>,
}
