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
//! actor around it (`super`) carries those out and feeds the answers back
//! as [`NodeInput::Answer`]. Calls for which [`EngineCall::answer_now`]
//! holds are answered before the next input that is not an answer (the
//! engine admits or refuses at once); the others (KV import, export, a
//! bulk send) are answered whenever they finish, and the core keeps their
//! state until then. Tests drive it with inputs and a clock, no runtime.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Duration;

use bytes::Bytes;
use flotilla_proto::wire::{Held, KvTransferHeader, Message, PrefillMsg, ReqEvents, Submit};
use flotilla_proto::{
    EngineEvent, EngineFailure, EngineRequest, EngineStatus, KvExport, KvLayout, Rejection,
    RequestId, Role, Sampled, StepEvents, TenantId, TraceContext,
};
use flotilla_telemetry::{EventRec, SpanRec};
use flotilla_transport::NodeId;

use super::WorkerOptions;

/// Abandon notices kept for prefills not (yet) seen: a bound on what a
/// Router's messages can make this node remember.
const ABANDONED_MAX: usize = 4096;

/// Names an engine call whose answer carries context.
pub type Ticket = u64;

/// (router, router epoch, router's request id)
type Key = (NodeId, u64, u64);

/// A prefill served for a decode node: (decode node, its epoch, router,
/// request). A decode node's later life is another key.
type PfKey = (NodeId, u64, u32, u64);

/// What happens to the node.
#[derive(Debug)]
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
#[derive(Debug)]
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
    /// Every id that holds KV. Answer now: [`EngineAnswer::Holders`].
    KvHolders,
    /// Give back what an orphan holds. Answer now:
    /// [`EngineAnswer::OrphanDropped`].
    DropOrphan(RequestId),
    /// Check a transfer and write it into its reservation. Answered when
    /// done: [`EngineAnswer::Imported`].
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
                | EngineCall::KvHolders
                | EngineCall::DropOrphan(_)
        )
    }
}

/// The engine's answers.
#[derive(Debug)]
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
#[derive(Debug)]
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
    /// A traced request's span measured here (a KV transfer), in the
    /// core's clock: the shell exports it if it traces.
    Span {
        /// What it is a child of.
        parent: TraceContext,
        /// The span.
        span: SpanRec,
    },
}

/// Decode side: a request whose blocks are reserved and whose KV has not
/// been imported yet.
struct Importing {
    /// The Router's epoch.
    epoch: u64,
    reservation: RequestId,
    prefill: NodeId,
    deadline: Duration,
    submit: Submit,
    /// Its bytes arrived and are being written: the import owns the
    /// reservation now and acks the prefill node when it is done.
    writing: bool,
    /// A move by KV migration: `submit` is in its resumed form (the last
    /// prompt token is the import's first token, which the client has).
    resumed: bool,
}

/// Where a prefill for a decode node stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PfState {
    /// The engine computes it.
    Running,
    /// Finished, waiting for a transfer slot.
    WaitSlot,
    /// Holds a slot; its KV is being read.
    Exporting,
    /// Holds a slot; its KV is on the way.
    Sending,
    /// Sent; its blocks wait for the ack until then.
    Sent { until: Duration },
}

/// A prefill served for a decode node. Its blocks go back on every path:
/// cancel, failure, ack, or no ack within `hold_ttl`.
struct Prefill {
    id: RequestId,
    attempt: u32,
    priority: u8,
    first: Option<Sampled>,
    state: PfState,
    /// A running request detached for a move: only this many tokens'
    /// KV are sent (the mover asked for that many).
    kv_tokens: Option<u32>,
    /// A traced request's transfer, timed for its span.
    xfer: Option<Box<Xfer>>,
}

/// The times of a traced prefill's KV transfer: from the prefill's end
/// (waiting for a slot) to the decode node's ack (or the end).
#[derive(Debug)]
struct Xfer {
    parent: TraceContext,
    ready: Duration,
    export: Option<Duration>,
    send: Option<Duration>,
    sent: Option<Duration>,
    bytes: u64,
    blocks: u32,
    tokens: u32,
    acked: bool,
    /// A running request's KV moving with it off a draining node, not a
    /// prefill's.
    moving: bool,
}

impl Xfer {
    fn new(parent: TraceContext, moving: bool) -> Xfer {
        Xfer {
            moving,
            parent,
            ready: Duration::ZERO,
            export: None,
            send: None,
            sent: None,
            bytes: 0,
            blocks: 0,
            tokens: 0,
            acked: false,
        }
    }

    /// Its span, ending at `now`.
    fn span(self, decode: NodeId, failure: Option<&str>, now: Duration) -> SpanRec {
        let mut s = SpanRec::new("kv.transfer", self.ready, now)
            .attr("flotilla.kv.decode_node", i64::from(decode))
            .attr("flotilla.kv.bytes", self.bytes as i64)
            .attr("flotilla.kv.blocks", i64::from(self.blocks))
            .attr("flotilla.kv.tokens", i64::from(self.tokens))
            .attr("flotilla.kv.acked", self.acked)
            .attr(
                "flotilla.kv.purpose",
                if self.moving { "move" } else { "prefill" },
            );
        for (name, at) in [
            ("export", self.export),
            ("send", self.send),
            ("sent", self.sent),
        ] {
            if let Some(at) = at {
                s.events.push(EventRec {
                    name: name.into(),
                    at,
                    attrs: Vec::new(),
                });
            }
        }
        s.error = failure.map(str::to_owned);
        s
    }
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

/// The engine node's protocol state.
pub struct NodeCore {
    opts: WorkerOptions,
    me: NodeId,
    epoch: u64,
    /// The engine's block shape; `None` on a node that migrates no KV.
    layout: Option<KvLayout>,
    /// Per Router: its epoch and when it was last heard.
    routers: BTreeMap<NodeId, (u64, Duration)>,
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
        opts: WorkerOptions,
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

    fn on_drain(&mut self, now: Duration, grace: Duration, out: &mut Vec<NodeOutput>) {
        let until = now + grace;
        if self.drain_until.is_none_or(|d| until < d) {
            if self.drain_until.is_none() {
                tracing::info!(
                    "draining: no new work; leaving when idle or in {} ms",
                    grace.as_millis()
                );
            }
            self.drain_until = Some(until);
        }
        // A heartbeat now, so the Routers stop placing work here at once.
        if !self.left {
            self.call_now(EngineCall::Status, out);
        }
    }

    /// Nothing of a Router's runs or waits here: no request, reservation,
    /// import, prefill, or engine answer it waits for.
    fn idle(&self) -> bool {
        self.active.map.is_empty()
            && self.importing.is_empty()
            && self.import_tasks.is_empty()
            && self.prefills.is_empty()
            && self.pending.is_empty()
    }

    fn leave_if_drained(&mut self, now: Duration, out: &mut Vec<NodeOutput>) {
        let Some(until) = self.drain_until else {
            return;
        };
        if self.gone || self.answers_due > 0 {
            return;
        }
        if !self.left {
            if !(self.idle() || now >= until) {
                return;
            }
            self.left = true;
            if !self.idle() {
                tracing::warn!(
                    running = self.active.map.len(),
                    prefills = self.prefills.len(),
                    "drain deadline passed: leaving; the Routers move what still runs"
                );
                // The nodes the Routers move it to ask for its KV within
                // a round trip or two; a reservation waits this long.
                if self.layout.is_some() {
                    self.leave_by = Some(now + self.opts.reservation_ttl);
                }
            }
            for &r in &self.opts.routers {
                Self::send(out, r, 0, Message::Leaving);
            }
        }
        if self.idle() || self.leave_by.is_none_or(|t| now >= t) {
            if !self.idle() {
                tracing::warn!(
                    running = self.active.map.len(),
                    prefills = self.prefills.len(),
                    "left: stopping what nobody took over"
                );
            }
            self.gone = true;
            out.push(NodeOutput::Left);
        }
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

    /// Tells node `to` that the KV it asked for (the Router's request
    /// `req`) will not come, and why.
    fn prefill_failed(
        out: &mut Vec<NodeOutput>,
        to: NodeId,
        router: u32,
        req: u64,
        reason: String,
    ) {
        Self::send(
            out,
            to,
            req,
            Message::PrefillFailed {
                router,
                req,
                reason,
            },
        );
    }

    fn send(out: &mut Vec<NodeOutput>, to: NodeId, correlation: u64, msg: Message) {
        out.push(NodeOutput::Send {
            to,
            correlation,
            msg,
        });
    }

    /// Any message proves a Router alive; a new epoch means it restarted
    /// and everything from its old life is orphaned.
    fn heard(&mut self, now: Duration, from: NodeId, epoch: u64, out: &mut Vec<NodeOutput>) {
        if !self.opts.routers.contains(&from) {
            return;
        }
        let known = self.routers.get(&from).map(|r| r.0);
        if known.is_some_and(|e| epoch > e) {
            out.push(NodeOutput::Reconnect(from));
            self.active
                .stop_where(|k| k.0 == from && k.1 < epoch, &Stop::Cancel, out);
            let old: Vec<(NodeId, u64)> = self
                .importing
                .iter()
                .filter(|(k, e)| k.0 == from && e.epoch < epoch)
                .map(|(k, _)| *k)
                .collect();
            for k in old {
                let e = self.importing.remove(&k).expect("listed above");
                drop_import(k, &e, out);
            }
        }
        let e = known.map_or(epoch, |e| e.max(epoch));
        self.routers.insert(from, (e, now));
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
            _ => {}
        }
    }

    fn on_submit(&mut self, from: NodeId, epoch: u64, mut s: Submit, out: &mut Vec<NodeOutput>) {
        let req = s.req;
        let tenant = s.request.tenant;
        if self.drain_until.is_some() {
            // The Router places it elsewhere.
            let rejection = Rejection::Unavailable;
            Self::send(out, from, req, Message::Refused { req, rejection });
            return;
        }
        if tenant.0 >= self.opts.num_tenants {
            let rejection = Rejection::Invalid(format!(
                "unknown tenant {} (the config has {})",
                tenant.0, self.opts.num_tenants
            ));
            Self::send(out, from, req, Message::Refused { req, rejection });
            return;
        }
        if let Some(&(cancelled, _)) = self.cancelled.get(&(from, epoch, req))
            && cancelled >= s.attempt
        {
            // Its Cancel came first: the Router runs it elsewhere, or
            // nowhere.
            tracing::debug!(req, attempt = s.attempt, "submit after its cancel: dropped");
            self.cancelled.remove(&(from, epoch, req));
            return;
        }
        let here = self
            .active
            .attempt(&(from, epoch, req))
            .or_else(|| self.importing.get(&(from, req)).map(|e| e.submit.attempt));
        if let Some(a) = here {
            if a >= s.attempt {
                // A duplicate (a resend after a reconnect), or a late
                // copy of an earlier placement.
                return;
            }
            // A re-run placed here again that overtook the Cancel of the
            // earlier placement: end that one.
            self.end_placement((from, epoch, req), s.attempt - 1, Stop::Cancel, out);
        }
        let kv_move = s.kv_move
            && self.layout.is_some()
            && self.opts.role != Role::Prefill
            && s.request.prompt.len() >= 2;
        if s.kv_move && !kv_move {
            // Not by its KV: the whole request (prompt and the tokens its
            // client has) is computed here, as after a node loss.
            s.kv_move = false;
            s.prefill = None;
        }
        let disaggregated = self.layout.is_some() && self.opts.role == Role::Decode;
        if let Some(prefill) = s.prefill.filter(|_| kv_move || disaggregated) {
            // Disaggregated (or moved with its KV): blocks first, then ask
            // for the prefill (or the KV).
            let ticket = self.ticket();
            let ttl = self.opts.reservation_ttl + self.opts.heartbeat_interval * 4;
            // A move's last prompt token is fed, not imported.
            let tokens = (s.request.prompt.len() - usize::from(kv_move)) as u32;
            self.pending.insert(
                ticket,
                Pending::Reserve {
                    router: from,
                    epoch,
                    submit: s,
                    prefill,
                },
            );
            let call = EngineCall::Reserve {
                ticket,
                tenant,
                tokens,
                ttl,
            };
            self.call_now(call, out);
            return;
        }
        tracing::debug!(req, "submit (whole request)");
        let ticket = self.ticket();
        let key = (from, epoch, req);
        let attempt = s.attempt;
        self.pending
            .insert(ticket, Pending::Submit { key, attempt });
        let call = EngineCall::Submit {
            ticket,
            request: s.request,
        };
        self.call_now(call, out);
    }

    fn on_prefill_ask(
        &mut self,
        from: NodeId,
        epoch: u64,
        pm: PrefillMsg,
        out: &mut Vec<NodeOutput>,
    ) {
        let (router, req) = (pm.router, pm.submit.req);
        let key = (from, epoch, router, req);
        let attempt = pm.submit.attempt;
        if pm.submit.kv_move && !self.prefills.contains_key(&key) {
            return self.on_move_ask(key, pm, out);
        }
        if let Some(p) = self.prefills.get(&key) {
            if p.attempt >= attempt {
                // A duplicate, or a late ask of an earlier placement.
                return;
            }
            // The decode node asks again for a re-run placed on it, ahead
            // of its cancel of the earlier ask.
            self.end_prefill(key, None, out);
        }
        let refuse = |out: &mut Vec<NodeOutput>, reason: String| {
            Self::prefill_failed(out, from, router, req, reason);
        };
        if self.abandoned.contains_key(&key) {
            refuse(
                out,
                "the Router abandoned this request on this decode node".into(),
            );
            return;
        }
        if self.layout.is_none() || self.opts.role != Role::Prefill {
            refuse(out, format!("node {} is not a prefill node", self.me));
            return;
        }
        if self.drain_until.is_some() {
            refuse(out, format!("prefill node {} is draining", self.me));
            return;
        }
        if pm.submit.request.tenant.0 >= self.opts.num_tenants {
            refuse(
                out,
                format!("unknown tenant {}", pm.submit.request.tenant.0),
            );
            return;
        }
        let mut request = pm.submit.request;
        // Only the first token is sampled here; the decode node samples
        // the rest.
        request.max_tokens = 1;
        let ticket = self.ticket();
        self.pending.insert(
            ticket,
            Pending::Export {
                key,
                attempt,
                priority: pm.priority,
                trace: request.trace.clone(),
            },
        );
        let call = EngineCall::SubmitForExport {
            ticket,
            request,
            hold: self.opts.hold_ttl,
        };
        self.call_now(call, out);
    }

    /// A node a Router moves one of our running requests to (we drain)
    /// asks for its KV: the request stops here, its blocks are held, and
    /// they leave as a finished prefill's do (slot, transfer, ack).
    fn on_move_ask(&mut self, key: PfKey, pm: PrefillMsg, out: &mut Vec<NodeOutput>) {
        let (decode, _, router, req) = key;
        let attempt = pm.submit.attempt;
        let running = self
            .active
            .map
            .iter()
            .find(|(k, r)| k.0 == router && k.2 == req && r.attempt < attempt)
            .map(|(k, r)| (*k, r.id));
        let found = match running {
            Some(r) if self.layout.is_some() => Ok(r),
            Some(_) => Err(format!("node {} exports no KV", self.me)),
            None => Err(format!("request {req} does not run on node {}", self.me)),
        };
        let (akey, id) = match found {
            Ok(r) => r,
            Err(reason) => {
                tracing::debug!(req, "KV move to node {decode} refused: {reason}");
                Self::prefill_failed(out, decode, router, req, reason);
                return;
            }
        };
        // Its Router has moved it: nothing more of it goes there.
        self.active.forget(&akey);
        let ticket = self.ticket();
        self.pending.insert(
            ticket,
            Pending::Detach {
                key,
                attempt,
                priority: pm.priority,
                id,
                trace: pm.submit.request.trace,
                prompt: pm.submit.request.prompt,
            },
        );
        let call = EngineCall::Detach {
            ticket,
            id,
            hold: self.opts.hold_ttl,
        };
        self.call_now(call, out);
    }

    /// The engine stopped a request for a move (or could not): its KV
    /// waits for a transfer slot, or the mover hears why not (and the
    /// request ends here either way).
    fn on_detached(
        &mut self,
        ticket: Ticket,
        result: Result<Vec<u32>, String>,
        out: &mut Vec<NodeOutput>,
    ) {
        let Some(Pending::Detach {
            key,
            attempt,
            priority,
            id,
            prompt,
            trace,
        }) = self.pending.remove(&ticket)
        else {
            self.broken
                .get_or_insert_with(|| format!("detach answer {ticket} unasked"));
            return;
        };
        let n = prompt.len();
        let failure = match result {
            Ok(tokens) if n >= 2 && tokens.len() >= n && tokens[..n] == prompt[..] => None,
            Ok(tokens) => Some(format!(
                "the {} tokens asked for are not the first of the {} it has here",
                n,
                tokens.len()
            )),
            Err(why) => Some(why),
        };
        if let Some(reason) = failure {
            let (decode, _, router, req) = key;
            tracing::debug!(req, "KV move to node {decode} failed: {reason}");
            out.push(NodeOutput::EndStream {
                id,
                stop_string: false,
            });
            out.push(NodeOutput::Call(EngineCall::Release(id)));
            Self::prefill_failed(out, decode, router, req, reason);
            return;
        }
        let first = Sampled {
            token: prompt[n - 1],
            logprob: f32::NAN,
            top: Vec::new(),
        };
        let p = Prefill {
            id,
            attempt,
            priority,
            first: Some(first),
            state: PfState::Running,
            kv_tokens: Some((n - 1) as u32),
            xfer: trace.map(|parent| Box::new(Xfer::new(parent, true))),
        };
        self.prefills.insert(key, p);
        self.pf_by_id.insert(id, key);
        self.wait_slot(key, out);
    }

    /// A finished prefill (or detached request) waits for a transfer slot.
    fn wait_slot(&mut self, key: PfKey, out: &mut Vec<NodeOutput>) {
        let p = self.prefills.get_mut(&key).expect("a prefill");
        p.state = PfState::WaitSlot;
        if let Some(x) = &mut p.xfer {
            x.ready = self.now;
        }
        self.slots.seq += 1;
        let w = (p.priority, Reverse(self.slots.seq), key);
        self.slots.waiting.push(w);
        self.grant_slots(out);
    }

    /// A Router named leases it does not know: those it named twice in a
    /// row nobody will end but us.
    fn on_unknown(&mut self, from: NodeId, epoch: u64, held: Vec<Held>, out: &mut Vec<NodeOutput>) {
        let before = self.orphans.unknown.remove(&from).unwrap_or_default();
        let mut named = BTreeSet::new();
        for h in held {
            if !before.contains(&h) {
                named.insert(h);
                continue;
            }
            let req = h.req;
            let gave_back = if let Some(d) = h.for_decode {
                let keys: Vec<PfKey> = self
                    .prefills
                    .keys()
                    .filter(|k| k.0 == d && k.2 == from && k.3 == req)
                    .copied()
                    .collect();
                for k in &keys {
                    self.end_prefill(*k, None, out);
                }
                !keys.is_empty()
            } else {
                // That placement or an earlier one, never a later one
                // made after the Router answered.
                self.end_placement((from, epoch, req), h.attempt, Stop::Cancel, out)
            };
            if gave_back {
                self.orphan(
                    format!(
                        "node {}: {h:?} of router {from}, which the Router no longer has here",
                        self.me
                    ),
                    out,
                );
            }
        }
        self.orphans.unknown.insert(from, named);
    }

    fn orphan(&mut self, what: String, out: &mut Vec<NodeOutput>) {
        self.orphans.found += 1;
        out.push(NodeOutput::Orphan(what));
    }

    fn on_bulk(
        &mut self,
        from: NodeId,
        header: KvTransferHeader,
        data: Vec<Bytes>,
        out: &mut Vec<NodeOutput>,
    ) {
        let key = (header.router, header.req);
        let ack_no = |out: &mut Vec<NodeOutput>, why: &str| {
            tracing::warn!(req = header.req, "KV from node {from} discarded: {why}");
            let ack = Message::KvAck {
                router: header.router,
                req: header.req,
                ok: false,
            };
            Self::send(out, from, header.req, ack);
        };
        let Some(layout) = &self.layout else {
            ack_no(out, "this node imports no KV");
            return;
        };
        let Some(e) = self
            .importing
            .get_mut(&key)
            .filter(|e| e.prefill == from && !e.writing)
        else {
            // Cancelled or expired meanwhile: the sender may free its blocks.
            ack_no(out, "no request waits for it");
            return;
        };
        if let Err(why) = check_header(
            &header,
            layout,
            &self.opts.model,
            e.submit.request.prompt.len(),
        ) {
            ack_no(out, &why);
            let e = self.importing.remove(&key).expect("looked up above");
            drop_import(key, &e, out);
            fail(&mut self.active.outbox, key, &e, why);
            return;
        }
        e.writing = true;
        self.import_tasks.insert(e.reservation, (key, from));
        out.push(NodeOutput::Call(EngineCall::Import {
            reservation: e.reservation,
            header,
            data,
            request: e.submit.request.clone(),
        }));
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

    fn prefill_event(&mut self, key: PfKey, ev: EngineEvent, out: &mut Vec<NodeOutput>) {
        let p = self
            .prefills
            .get_mut(&key)
            .expect("pf_by_id names prefills");
        if p.state != PfState::Running {
            return;
        }
        match ev {
            EngineEvent::Token(s) => p.first = Some(s),
            EngineEvent::Finished { .. } if p.first.is_none() => {
                self.end_prefill(key, Some("the prefill sampled no token".into()), out);
            }
            // Its blocks stay held until released.
            EngineEvent::Finished { .. } => self.wait_slot(key, out),
            EngineEvent::Failed(f) => self.end_prefill(key, Some(f.to_string()), out),
        }
    }

    /// Hands free transfer slots to the waiting prefills, higher tiers
    /// first, then in arrival order.
    fn grant_slots(&mut self, out: &mut Vec<NodeOutput>) {
        while self.slots.free > 0 {
            let Some((_, _, key)) = self.slots.waiting.pop() else {
                return;
            };
            // Ended while it waited: its place is gone.
            let Some(p) = self
                .prefills
                .get_mut(&key)
                .filter(|p| p.state == PfState::WaitSlot)
            else {
                continue;
            };
            self.slots.free -= 1;
            p.state = PfState::Exporting;
            if let Some(x) = &mut p.xfer {
                x.export = Some(self.now);
            }
            out.push(NodeOutput::Call(EngineCall::Export(p.id)));
        }
    }

    /// Ends a prefill: its handle dropped, its blocks given back, its slot
    /// to the next; with `failure`, the decode node is told.
    fn end_prefill(&mut self, key: PfKey, failure: Option<String>, out: &mut Vec<NodeOutput>) {
        let Some(mut p) = self.prefills.remove(&key) else {
            return;
        };
        self.pf_by_id.remove(&p.id);
        let (decode, _, router, req) = key;
        // A traced prefill's transfer (if it got as far as one) is a span.
        if let Some(x) = p.xfer.take()
            && p.state != PfState::Running
        {
            let parent = x.parent.clone();
            let span = x.span(decode, failure.as_deref(), self.now);
            out.push(NodeOutput::Span { parent, span });
        }
        match p.state {
            PfState::Exporting | PfState::Sending => {
                self.slots.free += 1;
            }
            PfState::Sent { until } => {
                self.holds.remove(&(until, key));
            }
            PfState::Running | PfState::WaitSlot => {}
        }
        out.push(NodeOutput::EndStream {
            id: p.id,
            stop_string: false,
        });
        out.push(NodeOutput::Call(EngineCall::Release(p.id)));
        match failure {
            Some(reason) => {
                tracing::warn!(req, "prefill for node {decode} failed: {reason}");
                Self::prefill_failed(out, decode, router, req, reason);
            }
            None => tracing::debug!(req, state = ?p.state, "prefill for node {decode} ends"),
        }
        self.grant_slots(out);
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

    /// A Router's request was admitted or refused by the engine.
    fn on_submitted(
        &mut self,
        ticket: Ticket,
        result: Result<RequestId, Rejection>,
        out: &mut Vec<NodeOutput>,
    ) {
        self.answered();
        let Some(Pending::Submit { key, attempt }) = self.pending.remove(&ticket) else {
            self.broken
                .get_or_insert_with(|| format!("submit answer {ticket} unasked"));
            return;
        };
        let (router, _, req) = key;
        let reply = match result {
            Ok(id) => {
                self.active.insert(key, id, attempt, false, out);
                Message::Admitted { req }
            }
            Err(rejection) => Message::Refused { req, rejection },
        };
        Self::send(out, router, req, reply);
    }

    /// KV blocks were reserved (or refused) for a request whose prompt
    /// another node computes: admit it and ask that node for the KV.
    fn on_reserved(
        &mut self,
        now: Duration,
        ticket: Ticket,
        result: Result<RequestId, Rejection>,
        out: &mut Vec<NodeOutput>,
    ) {
        self.answered();
        let Some(Pending::Reserve {
            router,
            epoch,
            submit,
            prefill,
        }) = self.pending.remove(&ticket)
        else {
            self.broken
                .get_or_insert_with(|| format!("reserve answer {ticket} unasked"));
            return;
        };
        let req = submit.req;
        let reservation = match result {
            Ok(r) => r,
            Err(rejection) => {
                Self::send(out, router, req, Message::Refused { req, rejection });
                return;
            }
        };
        Self::send(out, router, req, Message::Admitted { req });
        let ask = Message::Prefill(PrefillMsg {
            router,
            submit: Submit {
                prefill: None,
                ..submit.clone()
            },
            priority: self.opts.priority(submit.request.tenant.0),
        });
        Self::send(out, prefill, req, ask);
        let resumed = submit.kv_move;
        let mut submit = submit;
        if resumed {
            // Continued from its last prompt token, which the
            // import feeds as its first (and does not send: the
            // client has it), so one more token is allowed.
            submit.request.prompt.pop();
            submit.request.max_tokens += 1;
            tracing::debug!(
                req,
                from = prefill,
                "KV reserved, asked for the moving request's KV"
            );
        } else {
            tracing::debug!(req, prefill, "KV reserved, prefill asked");
        }
        let e = Importing {
            epoch,
            reservation,
            prefill,
            deadline: now + self.opts.reservation_ttl,
            submit,
            writing: false,
            resumed,
        };
        self.importing.insert((router, req), e);
    }

    /// A prefill for a decode node was admitted (or refused) here.
    fn on_export_submitted(
        &mut self,
        ticket: Ticket,
        result: Result<RequestId, Rejection>,
        out: &mut Vec<NodeOutput>,
    ) {
        self.answered();
        let Some(Pending::Export {
            key,
            attempt,
            priority,
            trace,
        }) = self.pending.remove(&ticket)
        else {
            self.broken
                .get_or_insert_with(|| format!("prefill answer {ticket} unasked"));
            return;
        };
        match result {
            Ok(id) => {
                let p = Prefill {
                    id,
                    attempt,
                    priority,
                    first: None,
                    state: PfState::Running,
                    kv_tokens: None,
                    xfer: trace.map(|parent| Box::new(Xfer::new(parent, false))),
                };
                self.prefills.insert(key, p);
                self.pf_by_id.insert(id, key);
            }
            Err(r) => {
                let (decode, _, router, req) = key;
                Self::prefill_failed(out, decode, router, req, r.to_string());
            }
        }
    }

    /// The engine's status, sent to every Router as this node's heartbeat.
    fn on_status(&mut self, mut report: EngineStatus, out: &mut Vec<NodeOutput>) {
        self.answered();
        report.orphans = self.orphans.found;
        report.draining = self.drain_until.is_some();
        for &r in &self.opts.routers {
            // Unreachable Routers are noticed by their silence.
            Self::send(out, r, 0, Message::Heartbeat(report.clone()));
        }
    }

    /// An engine lease owned by no request here was dropped (or was gone).
    fn on_orphan_dropped(&mut self, id: RequestId, dropped: bool, out: &mut Vec<NodeOutput>) {
        self.answered();
        if dropped {
            let what = format!(
                "node {}: engine lease {id} owned by no request here",
                self.me
            );
            self.orphan(what, out);
        } else {
            self.orphans.unowned.insert(id);
        }
    }

    /// A prefill's KV was exported: checksum it and send it to its decode
    /// node.
    fn on_exported(
        &mut self,
        now: Duration,
        id: RequestId,
        result: Result<KvExport, String>,
        out: &mut Vec<NodeOutput>,
    ) {
        let Some(&key) = self.pf_by_id.get(&id) else {
            // Ended meanwhile.
            return;
        };
        let p = &self.prefills[&key];
        if p.state != PfState::Exporting {
            return;
        }
        let (mut exp, first) = match (result, p.first.clone()) {
            (Ok(exp), Some(first)) => (exp, first),
            (Err(why), _) => return self.end_prefill(key, Some(why), out),
            (Ok(_), None) => {
                let why = "the prefill sampled no token".to_string();
                return self.end_prefill(key, Some(why), out);
            }
        };
        let Some(layout) = &self.layout else {
            return self.end_prefill(key, Some("this node exports no KV".into()), out);
        };
        if let Some(n) = p.kv_tokens {
            // A moved request's KV: as much as the mover asked for
            // (it may have run ahead of what its Router had seen).
            let blocks = n.div_ceil(layout.block_size.max(1));
            if n > exp.tokens || blocks > exp.blocks {
                let why = format!("{n} tokens asked for, {} held", exp.tokens);
                return self.end_prefill(key, Some(why), out);
            }
            exp.data
                .truncate((u64::from(blocks) * layout.bytes_per_block) as usize);
            exp.tokens = n;
            exp.blocks = blocks;
        }
        let (decode, _, router, req) = key;
        let header = KvTransferHeader {
            router,
            req,
            epoch: self.epoch,
            model: self.opts.model.clone(),
            block_size: layout.block_size,
            dtype: layout.dtype,
            layout: layout.layout,
            layer_start: 0,
            layer_end: layout.layers,
            token_count: exp.tokens,
            block_count: exp.blocks,
            bytes: exp.data.len() as u64,
            checksum: u64::from(crc32fast::hash(&exp.data)),
            first,
        };
        if let Some(p) = self.prefills.get_mut(&key) {
            p.state = PfState::Sending;
            if let Some(x) = &mut p.xfer {
                x.send = Some(now);
                x.bytes = header.bytes;
                x.blocks = header.block_count;
                x.tokens = header.token_count;
            }
        }
        out.push(NodeOutput::SendBulk {
            id,
            to: decode,
            header,
            data: Bytes::from(exp.data),
        });
    }

    /// A prefill's KV went out (or could not): hold it for the decode
    /// node's ack, or end the prefill.
    fn on_bulk_sent(
        &mut self,
        now: Duration,
        id: RequestId,
        result: Result<(), String>,
        out: &mut Vec<NodeOutput>,
    ) {
        let Some(&key) = self.pf_by_id.get(&id) else {
            return;
        };
        let p = self.prefills.get_mut(&key).expect("indexed");
        if p.state != PfState::Sending {
            return;
        }
        match result {
            Ok(()) => {
                // The decode node acks once it has read it all; a
                // dead one never does.
                let until = now + self.opts.hold_ttl;
                p.state = PfState::Sent { until };
                if let Some(x) = &mut p.xfer {
                    x.sent = Some(now);
                }
                self.holds.insert((until, key));
                self.slots.free += 1;
                self.grant_slots(out);
            }
            Err(e) => {
                let why = format!("sending KV to node {}: {e}", key.0);
                self.end_prefill(key, Some(why), out);
            }
        }
    }

    fn on_imported(
        &mut self,
        reservation: RequestId,
        result: Result<RequestId, String>,
        out: &mut Vec<NodeOutput>,
    ) {
        let Some((key, prefill)) = self.import_tasks.remove(&reservation) else {
            self.broken
                .get_or_insert_with(|| format!("import {reservation} answered twice"));
            return;
        };
        // Placed below (the request keeps the reservation's id) or
        // dropped: its early events go with it either way.
        let early = self.active.early.remove(&reservation);
        let ok = result.is_ok();
        tracing::debug!(req = key.1, ok, "import done");
        let ack = Message::KvAck {
            router: key.0,
            req: key.1,
            ok,
        };
        Self::send(out, prefill, key.1, ack);
        // Only the placement this import was for: if the Router cancelled
        // it and placed the request here again, the entry now is the new
        // placement's (its own reservation, its own prefill), which this
        // import must not end.
        let mine = self
            .importing
            .get(&key)
            .is_some_and(|e| e.reservation == reservation && e.writing);
        let entry = if mine {
            self.importing.remove(&key)
        } else {
            None
        };
        match (entry, result) {
            (Some(e), Ok(id)) => {
                if let Some(ev) = early {
                    self.active.early.insert(id, ev);
                }
                let k = (key.0, e.epoch, key.1);
                self.active.insert(k, id, e.submit.attempt, e.resumed, out);
            }
            // Cancelled while its bytes were written: ending the stream
            // frees its blocks.
            (None, Ok(id)) => out.push(NodeOutput::EndStream {
                id,
                stop_string: false,
            }),
            (Some(e), Err(why)) => fail(&mut self.active.outbox, key, &e, why),
            (None, Err(_)) => {}
        }
    }

    /// Engine leases that none of this node's entries owns: suspect at
    /// this look, given back if suspect at the last one as well.
    fn on_holders(&mut self, holders: Vec<RequestId>, out: &mut Vec<NodeOutput>) {
        let owned: BTreeSet<RequestId> = self
            .active
            .by_id
            .keys()
            .copied()
            .chain(self.importing.values().map(|e| e.reservation))
            .chain(self.pf_by_id.keys().copied())
            .chain(self.import_tasks.keys().copied())
            .collect();
        let before = std::mem::take(&mut self.orphans.unowned);
        for id in holders.into_iter().filter(|id| !owned.contains(id)) {
            if before.contains(&id) {
                self.call_now(EngineCall::DropOrphan(id), out);
            } else {
                self.orphans.unowned.insert(id);
            }
        }
    }

    fn on_undelivered(
        &mut self,
        to: NodeId,
        msg: Message,
        reason: &str,
        out: &mut Vec<NodeOutput>,
    ) {
        match msg {
            Message::Admitted { req } => {
                // The Router will not hear of it: do not run it.
                if let Some(e) = self.importing.remove(&(to, req)) {
                    drop_import((to, req), &e, out);
                }
                let keys: Vec<Key> = self
                    .active
                    .map
                    .keys()
                    .filter(|k| k.0 == to && k.2 == req)
                    .copied()
                    .collect();
                for k in keys {
                    self.active.stop(&k, &Stop::Cancel, out);
                }
            }
            Message::Prefill(pm) => {
                let key = (pm.router, pm.submit.req);
                let ours = self.importing.get(&key).is_some_and(|e| {
                    e.prefill == to && !e.writing && e.submit.attempt == pm.submit.attempt
                });
                if ours {
                    let e = self.importing.remove(&key).expect("checked above");
                    out.push(NodeOutput::Call(EngineCall::CancelReservation(
                        e.reservation,
                    )));
                    let why = format!("cannot reach prefill node {to}: {reason}");
                    fail(&mut self.active.outbox, key, &e, why);
                }
            }
            // The rest is noticed by silence (a Router's requests are
            // cancelled when it is found silent) or by timeouts.
            m => tracing::debug!(to, "not delivered: {:?} ({reason})", m.kind()),
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
        if now < self.next_heartbeat {
            return;
        }
        self.next_heartbeat = now + self.opts.heartbeat_interval;
        self.call_now(EngineCall::Status, out);
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

    /// Ends request `key` of a Router on this node, running or being
    /// imported, if its placement is `attempt` or earlier (a later re-run
    /// stays). True if something was ended.
    fn end_placement(
        &mut self,
        key: Key,
        attempt: u32,
        stop: Stop,
        out: &mut Vec<NodeOutput>,
    ) -> bool {
        let (router, _, req) = key;
        let mut ended = false;
        if self.active.attempt(&key).is_some_and(|a| a <= attempt) {
            ended = self.active.stop(&key, &stop, out);
        }
        if self
            .importing
            .get(&(router, req))
            .is_some_and(|e| e.submit.attempt <= attempt)
            && let Some(e) = self.importing.remove(&(router, req))
        {
            drop_import((router, req), &e, out);
            ended = true;
        }
        ended
    }
}

/// Gives back a reservation and tells its prefill node to stop (unless
/// its bytes are being written: the import gives it back and acks).
fn drop_import(key: (NodeId, u64), e: &Importing, out: &mut Vec<NodeOutput>) {
    tracing::debug!(req = key.1, writing = e.writing, "import dropped");
    if e.writing {
        return;
    }
    out.push(NodeOutput::Call(EngineCall::CancelReservation(
        e.reservation,
    )));
    let cancel = Message::PrefillCancel {
        router: key.0,
        req: key.1,
        attempt: e.submit.attempt,
    };
    NodeCore::send(out, e.prefill, key.1, cancel);
}

/// Ends a placement that streamed nothing yet (an import) at the Router.
fn fail_import(out: &mut Outbox, key: (NodeId, u64), e: &Importing, why: EngineFailure) {
    // Before any token: no stream was forwarded for it.
    out.push(key.0, key.1, e.submit.attempt, 0, EngineEvent::Failed(why));
}

fn fail(out: &mut Outbox, key: (NodeId, u64), e: &Importing, why: String) {
    fail_import(out, key, e, EngineFailure::KvTransfer(why));
}

/// Whether a transfer fits this node's cache and the request it is for.
pub(crate) fn check_header(
    h: &KvTransferHeader,
    layout: &KvLayout,
    model: &str,
    prompt_len: usize,
) -> Result<(), String> {
    let blocks = (prompt_len as u64).div_ceil(u64::from(layout.block_size.max(1)));
    if h.model != model {
        return Err(format!(
            "KV of model '{}', this node serves '{model}'",
            h.model
        ));
    }
    if h.block_size != layout.block_size
        || h.dtype != layout.dtype
        || h.layout != layout.layout
        || h.layer_start != 0
        || h.layer_end != layout.layers
    {
        return Err(format!(
            "KV layout differs: blocks of {} tokens, dtype {}, layout {}, layers {}..{}; \
             this node has {} tokens, dtype {}, layout {}, {} layers",
            h.block_size,
            h.dtype,
            h.layout,
            h.layer_start,
            h.layer_end,
            layout.block_size,
            layout.dtype,
            layout.layout,
            layout.layers
        ));
    }
    if h.token_count as usize != prompt_len
        || u64::from(h.block_count) != blocks
        || h.bytes != blocks * layout.bytes_per_block
    {
        return Err(format!(
            "transfer of {} tokens in {} blocks ({} bytes) for a prompt of {prompt_len} tokens \
             ({blocks} blocks of {} bytes)",
            h.token_count, h.block_count, h.bytes, layout.bytes_per_block
        ));
    }
    Ok(())
}

/// Transfer slots: a paid tier's KV leaves before a free tier's that
/// waited longer.
struct Slots {
    free: usize,
    /// (priority, arrival, prefill): the highest priority first, then the
    /// earliest. Entries of prefills ended while waiting are skipped.
    waiting: BinaryHeap<(u8, Reverse<u64>, PfKey)>,
    seq: u64,
}

impl Slots {
    fn new(n: usize) -> Slots {
        Slots {
            free: n,
            waiting: BinaryHeap::new(),
            seq: 0,
        }
    }
}

/// Orphan hunting state: what was suspect at the last look. A lease is
/// an orphan only if it is suspect at two looks in a row, a reconcile
/// interval apart, so requests in the middle of being set up or torn
/// down (a reply in flight, an ack on its way) are never taken for one.
struct Orphans {
    next: Duration,
    /// Engine ids that none of this node's entries owned at the last look.
    unowned: BTreeSet<RequestId>,
    /// Per Router: what was held at the last look (only those are sent
    /// in `Holding`, so every one named is at least an interval old).
    held: BTreeMap<NodeId, BTreeSet<Held>>,
    /// Per Router: what its last `Unknown` named.
    unknown: BTreeMap<NodeId, BTreeSet<Held>>,
    /// Requests given back as orphans since start.
    found: u64,
}

impl Orphans {
    fn new(next: Duration) -> Orphans {
        Orphans {
            next,
            unowned: BTreeSet::new(),
            held: BTreeMap::new(),
            unknown: BTreeMap::new(),
            found: 0,
        }
    }
}

/// A request running here for a Router.
struct Running {
    /// The engine's id (the shell holds its handle).
    id: RequestId,
    /// The placement (`Submit::attempt`).
    attempt: u32,
    /// Events sent to the Router so far: the next one's index.
    index: u32,
    /// Moved here with its KV: its first token (the import's, which the
    /// client had from the node it left) is not sent, and its usage
    /// counts that token as prompt, as the Router's request does.
    resumed: bool,
    /// The first token is still to come (and to be dropped).
    skip_first: bool,
}

/// The requests running here for Routers, and their events on the way
/// back.
struct Active {
    map: BTreeMap<Key, Running>,
    /// The Router's key of each engine request.
    by_id: BTreeMap<RequestId, Key>,
    /// Events of imports whose answer has not come yet (the engine
    /// delivers an import's first token as it answers): kept until the
    /// import is placed here, or dropped with it.
    early: BTreeMap<RequestId, Vec<EngineEvent>>,
    outbox: Outbox,
}

impl Active {
    fn new(frame_len_max_bytes: u32) -> Active {
        Active {
            map: BTreeMap::new(),
            by_id: BTreeMap::new(),
            early: BTreeMap::new(),
            outbox: Outbox::new(frame_len_max_bytes),
        }
    }

    /// The placement running under `key`, if any.
    fn attempt(&self, key: &Key) -> Option<u32> {
        self.map.get(key).map(|r| r.attempt)
    }

    /// Runs engine request `id` (placement `attempt`) under `key`; one
    /// still there is ended. Events that came for it before are sent now.
    fn insert(
        &mut self,
        key: Key,
        id: RequestId,
        attempt: u32,
        resumed: bool,
        out: &mut Vec<NodeOutput>,
    ) {
        let running = Running {
            id,
            attempt,
            index: 0,
            resumed,
            skip_first: resumed,
        };
        if let Some(old) = self.map.insert(key, running) {
            self.by_id.remove(&old.id);
            out.push(NodeOutput::EndStream {
                id: old.id,
                stop_string: false,
            });
        }
        self.by_id.insert(id, key);
        if let Some(early) = self.early.remove(&id) {
            for ev in early {
                if !self.by_id.contains_key(&id) {
                    break;
                }
                self.event(id, ev, out);
            }
        }
    }

    /// Ends the request under `key`; false if none runs.
    fn stop(&mut self, key: &Key, why: &Stop, out: &mut Vec<NodeOutput>) -> bool {
        let Some(r) = self.map.remove(key) else {
            return false;
        };
        self.by_id.remove(&r.id);
        if let Stop::RouterSilent(why) = why {
            let ev = EngineEvent::Failed(EngineFailure::RouterLost(why.clone()));
            self.outbox.push(key.0, key.2, r.attempt, r.index, ev);
        }
        // Dropping the handle ends it in the engine.
        out.push(NodeOutput::EndStream {
            id: r.id,
            stop_string: matches!(why, Stop::Finished),
        });
        true
    }

    /// Forgets the request under `key` without ending it in the engine
    /// (it is being detached for a move).
    fn forget(&mut self, key: &Key) {
        if let Some(r) = self.map.remove(key) {
            self.by_id.remove(&r.id);
        }
    }

    fn stop_where(&mut self, f: impl Fn(&Key) -> bool, why: &Stop, out: &mut Vec<NodeOutput>) {
        let keys: Vec<Key> = self.map.keys().filter(|k| f(k)).copied().collect();
        for k in keys {
            self.stop(&k, why, out);
        }
    }

    /// One event of running request `id`: onto its Router's batch, in
    /// order; an ended request is forgotten (its handle dropped).
    fn event(&mut self, id: RequestId, mut ev: EngineEvent, out: &mut Vec<NodeOutput>) {
        let key = self.by_id[&id];
        let r = self
            .map
            .get_mut(&key)
            .expect("by_id names running requests");
        if r.skip_first && matches!(ev, EngineEvent::Token(_)) {
            r.skip_first = false;
            return;
        }
        if r.resumed
            && let EngineEvent::Finished { usage, .. } = &mut ev
        {
            usage.prompt_tokens += 1;
            usage.completion_tokens = usage.completion_tokens.saturating_sub(1);
        }
        let end = !matches!(ev, EngineEvent::Token(_));
        self.outbox.push(key.0, key.2, r.attempt, r.index, ev);
        r.index += 1;
        if end {
            self.by_id.remove(&id);
            self.map.remove(&key);
            out.push(NodeOutput::EndStream {
                id,
                stop_string: false,
            });
        }
    }
}

/// Events on their way to the Routers: one batch per Router, sent at the
/// end of each input (a step's events leave as one frame), or earlier
/// once a batch nears the frame cap.
struct Outbox {
    /// A conservative size estimate keeps every batch well under the cap.
    budget: usize,
    per_router: BTreeMap<NodeId, (Vec<ReqEvents>, usize)>,
    full: Vec<(NodeId, Vec<ReqEvents>)>,
}

impl Outbox {
    fn new(frame_len_max_bytes: u32) -> Outbox {
        Outbox {
            budget: (frame_len_max_bytes / 4) as usize,
            per_router: BTreeMap::new(),
            full: Vec::new(),
        }
    }

    /// Queues event `index` of the Router's request `req` (placement
    /// `attempt`).
    fn push(&mut self, router: NodeId, req: u64, attempt: u32, index: u32, event: EngineEvent) {
        let (batch, size) = self.per_router.entry(router).or_default();
        let reuse = matches!(batch.last(), Some(r) if r.req == req && r.attempt == attempt
            && r.first + r.events.len() as u32 == index && r.end().is_none());
        if !reuse {
            batch.push(ReqEvents {
                req,
                attempt,
                first: index,
                events: Vec::new(),
            });
            *size += 32;
        }
        *size += match &event {
            EngineEvent::Token(s) => 24 + 8 * s.top.len(),
            EngineEvent::Failed(f) => 64 + f.to_string().len(),
            EngineEvent::Finished { .. } => 64,
        };
        batch.last_mut().expect("pushed above").events.push(event);
        if *size >= self.budget {
            let (b, _) = self.per_router.remove(&router).expect("entry exists");
            self.full.push((router, b));
        }
    }

    /// Everything queued, as one message per batch.
    fn flush(&mut self, out: &mut Vec<NodeOutput>) {
        if self.is_empty() {
            return;
        }
        let batches = self.full.drain(..).chain(
            std::mem::take(&mut self.per_router)
                .into_iter()
                .map(|(r, (b, _))| (r, b)),
        );
        for (to, batch) in batches {
            if !batch.is_empty() {
                out.push(NodeOutput::Send {
                    to,
                    correlation: 0,
                    msg: Message::Events(batch),
                });
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.full.is_empty() && self.per_router.is_empty()
    }
}

#[cfg(test)]
mod tests;
