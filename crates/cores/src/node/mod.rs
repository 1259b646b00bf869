//! NodeCore: an engine node's protocol as a state machine, in the style of
//! the Scheduler and [`crate::RouterCore`]. It owns every decision the node
//! makes for remote Routers and for its prefill/decode peers: which Router
//! epoch a request belongs to, duplicates and re-runs (`Submit::attempt`),
//! reservations and imports on a decode node, prefills, transfer slots by
//! tier and acks on a prefill node, event order and stream indices, the
//! orphan hunt, and what a silent or restarted Router leaves behind.
//!
//! It does no I/O and reads no clock: [`NodeCore::handle`] takes the time
//! and one [`NodeInput`] and appends [`NodeOutput`]s: messages to send,
//! engine calls to make ([`EngineCall`]), engine handles to drop. The
//! actor around it (`flotilla_cluster::run_worker`) carries those out and feeds the answers back
//! as [`NodeInput::Answer`]. Calls for which [`EngineCall::answer_now`]
//! holds are answered before the next input that is not an answer (the
//! engine admits or refuses at once); the others (KV import, export, a
//! bulk send) are answered whenever they finish, and the core keeps their
//! state until then. Tests drive it with inputs and a clock, no runtime.
//!
//! Its parts, by role: [`link`] (each Router's link: epochs, the requests
//! run for it and their events, the orphan hunt, what a silent or
//! restarted Router leaves behind), [`import`] (a decode node's
//! reservations and the KV that comes for them, checked here), [`export`]
//! (a prefill node's prefills, transfer slots by tier, holds until the
//! ack) and [`drain`] (no new work, then leave). This file holds the
//! state, the inputs and outputs, and the dispatch.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Duration;

use bytes::Bytes;
use flotilla_proto::NodeId;
use flotilla_proto::wire::{Held, KvTransferHeader, Message, PrefillMsg, ReqEvents, Submit};
use flotilla_proto::{
    EngineEvent, EngineFailure, EngineRequest, EngineStatus, KvExport, KvLayout, PrefixChanges,
    Rejection, RequestId, Role, Sampled, StepEvents, TenantId, TraceContext,
};

mod drain;
mod export;
mod import;
mod link;

use export::{PfState, Prefill, Slots};
#[cfg(test)]
use import::check_header;
use import::{Importing, drop_import, fail, fail_import};
use link::{Active, Orphans, Outbox};

/// Abandon notices kept for prefills not (yet) seen: a bound on what a
/// Router's messages can make this node remember.
const ABANDONED_MAX: usize = 4096;

/// How an engine node serves remote Routers: plain data (the shell's hooks,
/// its drain signal and its exporter stay in the shell).
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSettings {
    /// Router nodes to report load to.
    pub routers: Vec<NodeId>,
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// A Router silent this long is gone: its requests are cancelled.
    pub down_after: Duration,
    /// Tenants in the config; a Submit naming another is refused.
    pub num_tenants: u32,
    /// Cap on one frame's payload; event batches are split below it.
    pub frame_len_max_bytes: u32,
    /// `Worker` runs whole requests; `Prefill` computes prompts for decode
    /// nodes; `Decode` continues them (and runs whole requests sent
    /// without a prefill node).
    pub role: Role,
    /// Served model name; KV from another model is refused.
    pub model: String,
    /// Decode side: how long reserved blocks wait for their KV.
    pub reservation_ttl: Duration,
    /// Prefill side: how long a finished prefill's blocks wait for the
    /// decode side's ack.
    pub hold_ttl: Duration,
    /// Priority of each tenant's tier (higher goes first): the order of
    /// waiting KV transfers.
    pub tenant_priority: Vec<u8>,
    /// KV transfers a prefill node sends at once.
    pub transfers_max: usize,
    /// How often the node looks for orphaned leases: engine leases that
    /// none of its requests own, and requests the Router no longer has
    /// here (asked with `Holding`). A lease is given back as an orphan
    /// only when found twice in a row, so it is at least this old.
    pub reconcile_interval: Duration,
}

impl NodeSettings {
    /// The priority of `tenant`'s tier (0 for a tenant not in the list).
    pub fn priority(&self, tenant: u32) -> u8 {
        self.tenant_priority
            .get(tenant as usize)
            .copied()
            .unwrap_or(0)
    }
}

/// A traced request's KV transfer as a prefill (or draining) node timed
/// it, in the core's clock: from the moment its KV was ready (waiting for a
/// slot) to the decode node's ack or the end.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferSpan {
    /// The node the KV went to.
    pub decode: NodeId,
    /// Ready to leave (the prefill finished, or the request detached).
    pub start: Duration,
    /// Acked, failed, or ended.
    pub end: Duration,
    /// The export began (a slot was granted).
    pub export: Option<Duration>,
    /// The bytes began to leave.
    pub send: Option<Duration>,
    /// The peer had read them all.
    pub sent: Option<Duration>,
    /// Bytes, blocks and tokens of KV sent.
    pub bytes: u64,
    /// Blocks sent.
    pub blocks: u32,
    /// Tokens of KV sent.
    pub tokens: u32,
    /// The decode node acked it.
    pub acked: bool,
    /// A running request's KV moving off a draining node, not a prefill's.
    pub moving: bool,
    /// Why it failed, if it did.
    pub failure: Option<String>,
}

/// Names an engine call whose answer carries context.
pub type Ticket = u64;

/// (router, router epoch, router's request id)
type Key = (NodeId, u64, u64);

/// A prefill served for a decode node: (decode node, its epoch, router,
/// request). A decode node's later life is another key.
type PfKey = (NodeId, u64, u32, u64);

/// What happens to the node.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeInput {
    /// A control message from a peer (sender's epoch).
    Message {
        /// Sender.
        from: NodeId,
        /// Sender's epoch.
        epoch: u64,
        /// The message.
        msg: Message,
    },
    /// A whole KV transfer from a prefill node.
    Bulk {
        /// Sender.
        from: NodeId,
        /// What the bytes are.
        header: KvTransferHeader,
        /// The bytes, in the pieces they came in.
        data: Vec<Bytes>,
    },
    /// One engine step's events for requests of this node.
    Step(StepEvents),
    /// The engine's answer to an [`EngineCall`].
    Answer(EngineAnswer),
    /// The transport refused a message the core sent.
    Undelivered {
        /// Where it was going.
        to: NodeId,
        /// The message, handed back.
        msg: Message,
        /// Why.
        reason: String,
    },
    /// Time passed (at [`NodeCore::next_deadline`] or later).
    Tick,
    /// Drain (SIGTERM, or a Router's `Drain`): take no new work, let what
    /// runs finish within `grace`, then leave ([`NodeOutput::Left`]).
    Drain {
        /// How long running work may take; what runs then is moved by the
        /// Routers.
        grace: Duration,
    },
}

/// What the core asks of the engine.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineCall {
    /// Admit a whole request, its events to the node's sink. Answer now:
    /// [`EngineAnswer::Submitted`].
    Submit {
        /// Names the answer.
        ticket: Ticket,
        /// The request.
        request: EngineRequest,
    },
    /// Reserve blocks for an import. Answer now: [`EngineAnswer::Reserved`].
    Reserve {
        /// Names the answer.
        ticket: Ticket,
        /// Whose blocks.
        tenant: TenantId,
        /// Tokens of KV to come.
        tokens: u32,
        /// The engine gives them back by itself after this.
        ttl: Duration,
    },
    /// Run a prefill whose blocks stay held, its events to the node's
    /// sink. Answer now: [`EngineAnswer::ExportSubmitted`].
    SubmitForExport {
        /// Names the answer.
        ticket: Ticket,
        /// The request (`max_tokens` 1).
        request: EngineRequest,
        /// How long the engine holds the blocks at most.
        hold: Duration,
    },
    /// Stop a running request and hold its KV for a move to another
    /// node. Answer now: [`EngineAnswer::Detached`].
    Detach {
        /// Names the answer.
        ticket: Ticket,
        /// The running request.
        id: RequestId,
        /// How long the engine holds the blocks at most.
        hold: Duration,
    },
    /// Figures for the heartbeat. Answer now: [`EngineAnswer::Status`].
    Status,
    /// The prefix cache's changes since the last such call, or
    /// (`snapshot`) its contents. Answer now: [`EngineAnswer::Prefix`].
    PrefixChanges {
        /// The contents, not the changes (the change log is left alone).
        snapshot: bool,
    },
    /// Every id that holds KV. Answer now: [`EngineAnswer::Holders`].
    KvHolders,
    /// Give back what an orphan holds. Answer now:
    /// [`EngineAnswer::OrphanDropped`].
    DropOrphan(RequestId),
    /// Write a transfer (its header and bytes checked here) into its
    /// reservation and continue the request. Answered when done:
    /// [`EngineAnswer::Imported`].
    Import {
        /// The reservation (the request keeps its id).
        reservation: RequestId,
        /// What the bytes are.
        header: KvTransferHeader,
        /// The bytes.
        data: Vec<Bytes>,
        /// The request to continue.
        request: EngineRequest,
    },
    /// Read a finished prefill's held KV. Answered when done:
    /// [`EngineAnswer::Exported`].
    Export(RequestId),
    /// Give back a reservation not imported. No answer.
    CancelReservation(RequestId),
    /// Give back a finished prefill's held blocks. No answer.
    Release(RequestId),
}

impl EngineCall {
    /// Whether the answer comes before the next input that is not an
    /// answer.
    pub fn answer_now(&self) -> bool {
        matches!(
            self,
            EngineCall::Submit { .. }
                | EngineCall::Reserve { .. }
                | EngineCall::SubmitForExport { .. }
                | EngineCall::Detach { .. }
                | EngineCall::Status
                | EngineCall::PrefixChanges { .. }
                | EngineCall::KvHolders
                | EngineCall::DropOrphan(_)
        )
    }
}

/// The engine's answers.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineAnswer {
    /// To [`EngineCall::Submit`]: the engine's id of the request.
    Submitted {
        /// The call's ticket.
        ticket: Ticket,
        /// Its id, or why it was refused.
        result: Result<RequestId, Rejection>,
    },
    /// To [`EngineCall::Reserve`]: the reservation.
    Reserved {
        /// The call's ticket.
        ticket: Ticket,
        /// The reservation, or why there is none.
        result: Result<RequestId, Rejection>,
    },
    /// To [`EngineCall::SubmitForExport`].
    ExportSubmitted {
        /// The call's ticket.
        ticket: Ticket,
        /// The prefill's id, or why it was refused.
        result: Result<RequestId, Rejection>,
    },
    /// To [`EngineCall::Detach`]: the request's tokens (prompt, then
    /// generated; its held KV is that of all but the last), or why not.
    Detached {
        /// The call's ticket.
        ticket: Ticket,
        /// Its tokens, or why it was not detached.
        result: Result<Vec<u32>, String>,
    },
    /// To [`EngineCall::Status`].
    Status(EngineStatus),
    /// To [`EngineCall::PrefixChanges`].
    Prefix {
        /// The call's `snapshot`.
        snapshot: bool,
        /// The changes, or the contents; None: the engine reports no
        /// prefix cache (nothing is sent).
        changes: Option<PrefixChanges>,
    },
    /// To [`EngineCall::KvHolders`].
    Holders(Vec<RequestId>),
    /// To [`EngineCall::DropOrphan`].
    OrphanDropped {
        /// The lease.
        id: RequestId,
        /// It held something.
        dropped: bool,
    },
    /// To [`EngineCall::Import`]: the request runs (under the
    /// reservation's id), or why not (its reservation is given back).
    Imported {
        /// The call's reservation.
        reservation: RequestId,
        /// The running request's id, or why it failed.
        result: Result<RequestId, String>,
    },
    /// To [`EngineCall::Export`].
    Exported {
        /// The prefill.
        id: RequestId,
        /// Its KV, or why not.
        result: Result<KvExport, String>,
    },
    /// To [`NodeOutput::SendBulk`]: the peer read all of it, or not.
    BulkSent {
        /// The prefill.
        id: RequestId,
        /// Done, or why not.
        result: Result<(), String>,
    },
}

/// What the core has done.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeOutput {
    /// Send a control message.
    Send {
        /// To.
        to: NodeId,
        /// Envelope correlation id.
        correlation: u64,
        /// The message.
        msg: Message,
    },
    /// Send a prefill's KV; answered with [`EngineAnswer::BulkSent`].
    SendBulk {
        /// The prefill.
        id: RequestId,
        /// The decode node.
        to: NodeId,
        /// What the bytes are.
        header: KvTransferHeader,
        /// The bytes.
        data: Bytes,
    },
    /// `to` restarted: drop the connection to its old life.
    Reconnect(NodeId),
    /// Call the engine.
    Call(EngineCall),
    /// Drop the engine's handle of a request: this cancels it, or, with
    /// `stop_string`, finishes it (harmless once it has ended).
    EndStream {
        /// The engine's id.
        id: RequestId,
        /// The Router ended it at a stop string.
        stop_string: bool,
    },
    /// An orphaned lease was given back (what it was).
    Orphan(String),
    /// The node drained (or its drain deadline passed) and told its
    /// Routers it is leaving: stop this life once the messages are out.
    Left,
    /// A traced request's KV transfer as timed here, in the core's
    /// clock: the shell exports it as a span if it traces.
    Span {
        /// What it is a child of.
        parent: TraceContext,
        /// The transfer's times.
        span: TransferSpan,
    },
}

/// Answers the core waits for, by ticket.
enum Pending {
    Submit {
        key: Key,
        attempt: u32,
    },
    Reserve {
        router: NodeId,
        epoch: u64,
        submit: Submit,
        prefill: NodeId,
    },
    Export {
        key: PfKey,
        attempt: u32,
        priority: u8,
        trace: Option<TraceContext>,
    },
    Detach {
        key: PfKey,
        attempt: u32,
        priority: u8,
        id: RequestId,
        /// The mover's prompt: the request's tokens here must start with it.
        prompt: Vec<u32>,
        /// The request's trace, if it is traced: the move's KV transfer is
        /// a span of it.
        trace: Option<TraceContext>,
    },
}

/// Why a running request is stopped on this node.
#[derive(Clone, Debug)]
enum Stop {
    /// Its Router cancelled it (or is gone for good).
    Cancel,
    /// Its Router matched a stop string: it finished.
    Finished,
    /// Its Router is silent past the down bound: dropped here, and the
    /// Router is told (its messages may still reach it).
    RouterSilent(String),
}

/// A Router's place in this node's stream of prefix-cache changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PrefixLink {
    /// The number of the last `Prefix` sent to it (0: none yet).
    seq: u64,
    /// It waits for the whole cache (new, restarted, or it saw a gap).
    want_snapshot: bool,
}

/// The engine node's protocol state.
pub struct NodeCore {
    opts: NodeSettings,
    me: NodeId,
    epoch: u64,
    /// The engine's block shape; `None` on a node that migrates no KV.
    layout: Option<KvLayout>,
    /// Per Router: its epoch and when it was last heard.
    routers: BTreeMap<NodeId, (u64, Duration)>,
    /// Per Router ever heard: its last epoch (kept when a silence drops it
    /// from `routers`).
    router_epochs: BTreeMap<NodeId, u64>,
    /// Per Router heard in its current life: the number of the last
    /// `Prefix` sent to it, and whether it waits for the whole cache.
    prefix: BTreeMap<NodeId, PrefixLink>,
    active: Active,
    importing: BTreeMap<(NodeId, u64), Importing>,
    /// Reservations an import owns (its bytes are being written): the
    /// Router's key and the prefill node.
    import_tasks: BTreeMap<RequestId, ((NodeId, u64), NodeId)>,
    prefills: BTreeMap<PfKey, Prefill>,
    pf_by_id: BTreeMap<RequestId, PfKey>,
    /// Prefills sent and waiting for their ack, by deadline.
    holds: BTreeSet<(Duration, PfKey)>,
    slots: Slots,
    /// Prefills a Router abandoned (their decode node is lost), until the
    /// hold deadline: an ask from that decode node that comes after the
    /// abandon (it was in flight) is refused instead of run for nobody.
    abandoned: BTreeMap<PfKey, Duration>,
    /// Placements cancelled before their Submit came (the Submit was held
    /// on a cut link, or overtaken), until a deadline: the Submit that
    /// comes after its Cancel is dropped instead of run for nobody.
    cancelled: BTreeMap<Key, (u32, Duration)>,
    orphans: Orphans,
    pending: BTreeMap<Ticket, Pending>,
    next_ticket: Ticket,
    /// Answer-now calls not answered yet.
    answers_due: usize,
    next_heartbeat: Duration,
    /// Draining until then: no new work; leave when empty or then.
    drain_until: Option<Duration>,
    /// `Leaving` was sent.
    left: bool,
    /// After `Leaving`, until then at most, what ran here may still be
    /// asked for by the nodes it moves to (its KV, once).
    leave_by: Option<Duration>,
    /// [`NodeOutput::Left`] was given: this life is over.
    gone: bool,
    /// A broken calling contract, for `check_invariants`.
    broken: Option<String>,
    /// The time of the input being handled.
    now: Duration,
}

impl NodeCore {
    /// A node `me` in its life `epoch`, at time `now`; `layout` is the
    /// engine's block shape if it migrates KV.
    pub fn new(
        opts: NodeSettings,
        me: NodeId,
        epoch: u64,
        layout: Option<KvLayout>,
        now: Duration,
    ) -> NodeCore {
        NodeCore {
            active: Active::new(opts.frame_len_max_bytes),
            slots: Slots::new(opts.transfers_max.max(1)),
            orphans: Orphans::new(now + opts.reconcile_interval),
            opts,
            me,
            epoch,
            layout,
            routers: BTreeMap::new(),
            router_epochs: BTreeMap::new(),
            prefix: BTreeMap::new(),
            importing: BTreeMap::new(),
            import_tasks: BTreeMap::new(),
            prefills: BTreeMap::new(),
            pf_by_id: BTreeMap::new(),
            holds: BTreeSet::new(),
            abandoned: BTreeMap::new(),
            cancelled: BTreeMap::new(),
            pending: BTreeMap::new(),
            next_ticket: 1,
            answers_due: 0,
            next_heartbeat: now,
            drain_until: None,
            left: false,
            leave_by: None,
            gone: false,
            broken: None,
            now,
        }
    }

    /// When the core wants a [`NodeInput::Tick`] next.
    pub fn next_deadline(&self) -> Duration {
        let next = match self.holds.first() {
            Some(&(until, _)) => until.min(self.next_heartbeat),
            None => self.next_heartbeat,
        };
        // The first Router to pass the down bound, just past it.
        let next = self
            .routers
            .values()
            .map(|&(_, heard)| heard + self.opts.down_after + Duration::from_micros(1))
            .fold(next, Duration::min);
        match (self.drain_until, self.leave_by) {
            (Some(d), _) if !self.left => next.min(d),
            (_, Some(d)) if !self.gone => next.min(d),
            _ => next,
        }
    }

    /// Whether the node drains (takes no new work).
    pub fn draining(&self) -> bool {
        self.drain_until.is_some()
    }

    /// Whether this life is over: the node told its Routers it is leaving
    /// and nothing of theirs waits here any more (or its time is up).
    pub fn life_over(&self) -> bool {
        self.gone
    }

    /// Requests given back as orphans since start.
    pub fn orphans_found(&self) -> u64 {
        self.orphans.found
    }

    /// Handles one input at `now`; what to do is appended to `out`. The
    /// events it produced leave at the end, one frame per Router.
    pub fn handle(&mut self, now: Duration, input: NodeInput, out: &mut Vec<NodeOutput>) {
        self.now = now;
        if !matches!(input, NodeInput::Answer(_)) && self.answers_due > 0 {
            self.broken.get_or_insert_with(|| {
                format!(
                    "{} engine answers due before the next input",
                    self.answers_due
                )
            });
        }
        match input {
            NodeInput::Message { from, epoch, msg } => self.on_message(now, from, epoch, msg, out),
            NodeInput::Bulk { from, header, data } => self.on_bulk(from, header, data, out),
            NodeInput::Step(events) => self.on_step(events, out),
            NodeInput::Answer(a) => self.on_answer(now, a, out),
            NodeInput::Undelivered { to, msg, reason } => {
                self.on_undelivered(to, msg, &reason, out)
            }
            NodeInput::Tick => self.on_tick(now, out),
            NodeInput::Drain { grace } => self.on_drain(now, grace, out),
        }
        self.active.outbox.flush(out);
        // After the last events, so that they reach the Routers first.
        self.leave_if_drained(now, out);
    }

    /// Checks the core's bookkeeping: every index agrees with what it
    /// indexes, every transfer slot is held by a prefill that uses it or
    /// is free, no free slot while a prefill waits for one.
    pub fn check_invariants(&self) -> Result<(), String> {
        if let Some(b) = &self.broken {
            return Err(b.clone());
        }
        let a = &self.active;
        if a.by_id.len() != a.map.len() {
            return Err(format!(
                "{} running requests, {} engine ids",
                a.map.len(),
                a.by_id.len()
            ));
        }
        for (id, key) in &a.by_id {
            if a.map.get(key).is_none_or(|r| r.id != *id) {
                return Err(format!("engine id {id} names {key:?}, which runs another"));
            }
        }
        if self.pf_by_id.len() != self.prefills.len() {
            return Err(format!(
                "{} prefills, {} prefill ids",
                self.prefills.len(),
                self.pf_by_id.len()
            ));
        }
        let mut busy = 0;
        let mut sent = BTreeSet::new();
        let mut waiting = false;
        for (key, p) in &self.prefills {
            if self.pf_by_id.get(&p.id) != Some(key) {
                return Err(format!("prefill {key:?} is not indexed by its id {}", p.id));
            }
            match p.state {
                PfState::Exporting | PfState::Sending => busy += 1,
                PfState::Sent { until } => {
                    sent.insert((until, *key));
                }
                PfState::WaitSlot => waiting = true,
                PfState::Running => {}
            }
        }
        let slots = self.opts.transfers_max.max(1);
        if busy + self.slots.free != slots {
            return Err(format!(
                "{busy} transfers running and {} slots free of {slots}",
                self.slots.free
            ));
        }
        if waiting && self.slots.free > 0 {
            return Err("a prefill waits while a transfer slot is free".into());
        }
        if sent != self.holds {
            return Err(format!(
                "{} prefills wait for an ack, {} ack deadlines armed",
                sent.len(),
                self.holds.len()
            ));
        }
        for (k, e) in &self.importing {
            if e.writing && self.import_tasks.get(&e.reservation).map(|t| t.0) != Some(*k) {
                return Err(format!("import {k:?} is written with no import under way"));
            }
        }
        if !self.active.outbox.is_empty() {
            return Err("events left unsent after an input".into());
        }
        Ok(())
    }

    fn ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        self.next_ticket
    }

    /// Asks the engine for something answered before the next input.
    fn call_now(&mut self, call: EngineCall, out: &mut Vec<NodeOutput>) {
        debug_assert!(call.answer_now());
        self.answers_due += 1;
        out.push(NodeOutput::Call(call));
    }

    fn answered(&mut self) {
        if self.answers_due == 0 {
            self.broken
                .get_or_insert_with(|| "an engine answer that was not asked for".into());
        }
        self.answers_due = self.answers_due.saturating_sub(1);
    }

    fn send(out: &mut Vec<NodeOutput>, to: NodeId, correlation: u64, msg: Message) {
        out.push(NodeOutput::Send {
            to,
            correlation,
            msg,
        });
    }

    fn on_message(
        &mut self,
        now: Duration,
        from: NodeId,
        epoch: u64,
        msg: Message,
        out: &mut Vec<NodeOutput>,
    ) {
        self.heard(now, from, epoch, out);
        let is_router = self.opts.routers.contains(&from);
        match msg {
            Message::Submit(s) => self.on_submit(from, epoch, s, out),
            Message::Cancel {
                req,
                stop_string,
                attempt,
            } => {
                // Not a later re-run that overtook this Cancel.
                let stop = if stop_string {
                    Stop::Finished
                } else {
                    Stop::Cancel
                };
                let key = (from, epoch, req);
                if !self.end_placement(key, attempt, stop, out)
                    && is_router
                    && self.cancelled.len() < ABANDONED_MAX
                {
                    self.cancelled
                        .insert(key, (attempt, now + self.opts.hold_ttl));
                }
            }
            Message::Prefill(pm) => self.on_prefill_ask(from, epoch, pm, out),
            Message::PrefillFailed {
                router,
                req,
                reason,
            } => {
                let key = (router, req);
                if self
                    .importing
                    .get(&key)
                    .is_some_and(|e| e.prefill == from && !e.writing)
                {
                    let e = self.importing.remove(&key).expect("checked above");
                    tracing::debug!(req, "prefill failed: reservation cancelled");
                    out.push(NodeOutput::Call(EngineCall::CancelReservation(
                        e.reservation,
                    )));
                    fail(
                        &mut self.active.outbox,
                        key,
                        &e,
                        format!("prefill node {from}: {reason}"),
                    );
                }
            }
            Message::KvAck { router, req, .. } => {
                // An ack (or a refusal) ends the prefill once it is done;
                // one that comes while it still runs is stale.
                let key = (from, epoch, router, req);
                if let Some(p) = self.prefills.get_mut(&key)
                    && p.state != PfState::Running
                {
                    if let Some(x) = &mut p.xfer {
                        x.acked = true;
                    }
                    self.end_prefill(key, None, out);
                }
            }
            Message::PrefillCancel {
                router,
                req,
                attempt,
            } => {
                let key = (from, epoch, router, req);
                if self
                    .prefills
                    .get(&key)
                    .is_some_and(|p| p.attempt <= attempt)
                {
                    self.end_prefill(key, None, out);
                }
            }
            Message::PrefillAbandon {
                decode,
                decode_epoch,
                req,
            } if is_router => {
                let key = (decode, decode_epoch, from, req);
                if self.prefills.contains_key(&key) {
                    tracing::debug!(req, "prefill for node {decode} abandoned by the Router");
                    self.end_prefill(key, None, out);
                } else if self.abandoned.len() < ABANDONED_MAX {
                    self.abandoned.insert(key, now + self.opts.hold_ttl);
                }
            }
            Message::Unknown { held } if is_router => self.on_unknown(from, epoch, held, out),
            Message::Drain { grace_ms } if is_router => {
                self.on_drain(now, Duration::from_millis(grace_ms), out)
            }
            Message::Ping { seq, pad } => Self::send(out, from, seq, Message::Pong { seq, pad }),
            Message::PrefixResync if is_router => {
                if let Some(l) = self.prefix.get_mut(&from) {
                    l.want_snapshot = true;
                }
            }
            _ => {}
        }
    }

    /// One engine step's events: a running request's go onto its
    /// Router's batch, a prefill's move it along, an import's not yet
    /// placed wait for it.
    fn on_step(&mut self, events: StepEvents, out: &mut Vec<NodeOutput>) {
        for (id, ev) in events {
            if self.active.by_id.contains_key(&id) {
                self.active.event(id, ev, out);
            } else if let Some(&key) = self.pf_by_id.get(&id) {
                self.prefill_event(key, ev, out);
            } else if self.import_tasks.contains_key(&id) {
                // The engine delivers an import's first token as it answers.
                self.active.early.entry(id).or_default().push(ev);
            }
            // Else stopped here meanwhile: nobody wants it.
        }
    }

    /// An engine call's answer, to the handler of its kind.
    fn on_answer(&mut self, now: Duration, a: EngineAnswer, out: &mut Vec<NodeOutput>) {
        match a {
            EngineAnswer::Submitted { ticket, result } => self.on_submitted(ticket, result, out),
            EngineAnswer::Reserved { ticket, result } => self.on_reserved(now, ticket, result, out),
            EngineAnswer::ExportSubmitted { ticket, result } => {
                self.on_export_submitted(ticket, result, out)
            }
            EngineAnswer::Detached { ticket, result } => {
                self.answered();
                self.on_detached(ticket, result, out);
            }
            EngineAnswer::Status(report) => self.on_status(report, out),
            EngineAnswer::Prefix { snapshot, changes } => {
                self.answered();
                if let Some(changes) = changes {
                    self.on_prefix(snapshot, changes, out);
                }
            }
            EngineAnswer::Holders(holders) => {
                self.answered();
                self.on_holders(holders, out);
            }
            EngineAnswer::OrphanDropped { id, dropped } => self.on_orphan_dropped(id, dropped, out),
            EngineAnswer::Imported {
                reservation,
                result,
            } => self.on_imported(reservation, result, out),
            EngineAnswer::Exported { id, result } => self.on_exported(now, id, result, out),
            EngineAnswer::BulkSent { id, result } => self.on_bulk_sent(now, id, result, out),
        }
    }

    /// Cancels what runs here for every Router silent past the down bound
    /// and forgets it (a message from it later is a new contact).
    fn drop_silent_routers(&mut self, now: Duration, out: &mut Vec<NodeOutput>) {
        let down_after = self.opts.down_after;
        let silent: Vec<NodeId> = self
            .routers
            .iter()
            .filter(|(_, (_, heard))| now.saturating_sub(*heard) > down_after)
            .map(|(n, _)| *n)
            .collect();
        for n in silent {
            let before = self.active.map.len() + self.importing.len();
            // Told to the Router too, in case only its direction of the
            // link is cut: it runs them again or ends them.
            let why = format!(
                "no message from the Router for over {} ms",
                down_after.as_millis()
            );
            self.active
                .stop_where(|k| k.0 == n, &Stop::RouterSilent(why.clone()), out);
            let gone: Vec<(NodeId, u64)> = self
                .importing
                .keys()
                .filter(|k| k.0 == n)
                .copied()
                .collect();
            for k in gone {
                let e = self.importing.remove(&k).expect("listed above");
                drop_import(k, &e, out);
                let f = EngineFailure::RouterLost(why.clone());
                fail_import(&mut self.active.outbox, k, &e, f);
            }
            let cancelled = before - self.active.map.len() - self.importing.len();
            if cancelled > 0 {
                tracing::warn!(
                    router = n,
                    "router silent for over {down_after:?}: cancelled {cancelled} requests"
                );
            }
            self.routers.remove(&n);
            self.prefix.remove(&n);
        }
    }

    fn on_tick(&mut self, now: Duration, out: &mut Vec<NodeOutput>) {
        // Sent prefills whose ack never came: the decode node is gone.
        while let Some(&(until, key)) = self.holds.first() {
            if until > now {
                break;
            }
            tracing::debug!(req = key.3, "prefill for node {}: no ack", key.0);
            self.end_prefill(key, None, out);
        }
        // A Router silent past the down bound, at the bound (not at the
        // next heartbeat): its requests go at once.
        self.drop_silent_routers(now, out);
        if now < self.next_heartbeat {
            return;
        }
        self.next_heartbeat = now + self.opts.heartbeat_interval;
        self.call_now(EngineCall::Status, out);
        // The prefix cache's changes go to the Routers once a heartbeat
        // (the contents, to a Router that has none of this life).
        if !self.prefix.is_empty() {
            self.call_now(EngineCall::PrefixChanges { snapshot: false }, out);
            if self.prefix.values().any(|l| l.want_snapshot) {
                self.call_now(EngineCall::PrefixChanges { snapshot: true }, out);
            }
        }
        self.abandoned.retain(|_, until| *until > now);
        self.cancelled.retain(|_, (_, until)| *until > now);
        if now >= self.orphans.next {
            self.orphans.next = now + self.opts.reconcile_interval;
            if self.layout.is_some() {
                self.call_now(EngineCall::KvHolders, out);
            }
            // Ask each Router about what this node holds for it (only
            // what it held at the last look as well).
            for i in 0..self.opts.routers.len() {
                let r = self.opts.routers[i];
                let here = |req, attempt| Held {
                    req,
                    for_decode: None,
                    attempt,
                };
                let held: BTreeSet<Held> = self
                    .active
                    .map
                    .iter()
                    .filter(|(k, _)| k.0 == r)
                    .map(|(k, run)| here(k.2, run.attempt))
                    .chain(
                        self.importing
                            .iter()
                            .filter(|(k, _)| k.0 == r)
                            .map(|(k, e)| here(k.1, e.submit.attempt)),
                    )
                    .chain(
                        self.prefills
                            .iter()
                            .filter(|(k, _)| k.2 == r)
                            .map(|(k, p)| Held {
                                req: k.3,
                                for_decode: Some(k.0),
                                attempt: p.attempt,
                            }),
                    )
                    .collect();
                let before = self
                    .orphans
                    .held
                    .insert(r, held.clone())
                    .unwrap_or_default();
                let ask: Vec<Held> = held.intersection(&before).copied().collect();
                if !ask.is_empty() {
                    Self::send(out, r, 0, Message::Holding { held: ask });
                }
            }
        }
        // Reservations whose KV never came.
        let late: Vec<(NodeId, u64)> = self
            .importing
            .iter()
            .filter(|(_, e)| !e.writing && e.deadline <= now)
            .map(|(k, _)| *k)
            .collect();
        for k in late {
            let e = self.importing.remove(&k).expect("listed above");
            drop_import(k, &e, out);
            let ms = self.opts.reservation_ttl.as_millis();
            let why = format!("no KV from prefill node {} within {ms} ms", e.prefill);
            fail(&mut self.active.outbox, k, &e, why);
        }
    }
}

#[cfg(test)]
mod tests;
