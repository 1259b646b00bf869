//! NodeCore driven by hand: inputs and a clock, a fake engine that
//! answers at once, no runtime, no sleep.

use std::time::Duration;

use bytes::Bytes;
use flotilla_proto::wire::{Held, KvTransferHeader, Message, PrefillMsg, Submit};
use flotilla_proto::{
    EngineEvent, EngineFailure, EngineRequest, EngineStatus, FinishReason, KvExport, KvLayout,
    PrefixChanges, Rejection, RequestId, Role, Sampled, SamplingParams, TenantId, TraceContext,
    Usage,
};

use super::{
    EngineAnswer, EngineCall, NodeCore, NodeInput, NodeOutput, NodeSettings, TransferSpan,
};
use crate::testrig;

const HB: Duration = Duration::from_millis(100);
const DOWN: Duration = Duration::from_millis(400);
const TTL: Duration = Duration::from_millis(1000);
const ROUTER: u32 = 0;
const ME: u32 = 1;
const PREFILL: u32 = 2;
const DECODE: u32 = 3;

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn layout() -> KvLayout {
    KvLayout {
        block_size: 4,
        dtype: flotilla_proto::KvDtype::F16,
        layout: 1,
        layers: 2,
        bytes_per_block: 64,
    }
}

/// A node and a fake engine that answers every call at once.
struct H {
    core: NodeCore,
    now: Duration,
    next_id: u64,
    /// What the engine refuses with, if anything.
    refuse: Option<Rejection>,
    /// Leases the engine reports.
    holders: Vec<RequestId>,
    sent: Vec<(u32, Message)>,
    /// Engine handles dropped: (id, at a stop string).
    ended: Vec<(RequestId, bool)>,
    /// Calls that take time, not answered yet.
    later: Vec<EngineCall>,
    /// Calls with no answer (cancel a reservation, release a prefill).
    given_back: Vec<EngineCall>,
    bulks: Vec<(RequestId, u32, KvTransferHeader)>,
    orphans: Vec<String>,
    reconnects: Vec<u32>,
    /// `NodeOutput::Left` came.
    left: bool,
    /// What the engine answers to a detach.
    detach: Result<Vec<u32>, String>,
    /// Spans the core measured.
    spans: Vec<(TraceContext, TransferSpan)>,
    /// The engine's prefix cache, and its changes since the last look.
    cache: std::collections::BTreeSet<u64>,
    cache_delta: PrefixChanges,
}

impl H {
    fn new(role: Role, kv: bool, f: impl Fn(NodeSettings) -> NodeSettings) -> H {
        let opts = f(NodeSettings {
            model: "m".into(),
            reservation_ttl: TTL,
            hold_ttl: TTL,
            tenant_priority: vec![0, 2, 1],
            num_tenants: 3,
            transfers_max: 1,
            reconcile_interval: DOWN,
            ..testrig::node_opts(HB, DOWN, role)
        });
        let mut h = H {
            core: NodeCore::new(opts, ME, 7, kv.then(layout), Duration::ZERO),
            now: Duration::ZERO,
            next_id: 100,
            refuse: None,
            holders: Vec::new(),
            sent: Vec::new(),
            ended: Vec::new(),
            later: Vec::new(),
            given_back: Vec::new(),
            bulks: Vec::new(),
            orphans: Vec::new(),
            reconnects: Vec::new(),
            left: false,
            detach: Err("not decoding".into()),
            spans: Vec::new(),
            cache: Default::default(),
            cache_delta: PrefixChanges::default(),
        };
        h.input(NodeInput::Tick);
        h.sent.clear();
        h
    }

    fn id(&mut self) -> RequestId {
        self.next_id += 1;
        RequestId(self.next_id)
    }

    /// One input, and the fake engine's answers to what it asked.
    fn input(&mut self, i: NodeInput) {
        let mut queue = vec![i];
        while let Some(i) = queue.pop() {
            let mut out = Vec::new();
            self.core.handle(self.now, i, &mut out);
            self.core.check_invariants().unwrap();
            let mut answers = Vec::new();
            for o in out {
                match o {
                    NodeOutput::Send { to, msg, .. } => self.sent.push((to, msg)),
                    NodeOutput::SendBulk { id, to, header, .. } => {
                        self.bulks.push((id, to, header))
                    }
                    NodeOutput::Reconnect(n) => self.reconnects.push(n),
                    NodeOutput::EndStream { id, stop_string } => self.ended.push((id, stop_string)),
                    NodeOutput::Orphan(what) => self.orphans.push(what),
                    NodeOutput::Span { parent, span } => self.spans.push((parent, span)),
                    NodeOutput::Left => {
                        assert!(!self.left, "left twice");
                        self.left = true;
                    }
                    NodeOutput::Call(c) if c.answer_now() => answers.push(self.answer(c)),
                    NodeOutput::Call(
                        c @ (EngineCall::CancelReservation(_) | EngineCall::Release(_)),
                    ) => self.given_back.push(c),
                    NodeOutput::Call(c) => self.later.push(c),
                }
            }
            // In order: the queue pops from the back.
            queue.extend(answers.into_iter().rev().map(NodeInput::Answer));
        }
    }

    fn answer(&mut self, c: EngineCall) -> EngineAnswer {
        let result = match self.refuse.clone() {
            Some(r) => Err(r),
            None => Ok(self.id()),
        };
        match c {
            EngineCall::Submit { ticket, .. } => EngineAnswer::Submitted { ticket, result },
            EngineCall::Reserve { ticket, .. } => EngineAnswer::Reserved { ticket, result },
            EngineCall::SubmitForExport { ticket, .. } => {
                EngineAnswer::ExportSubmitted { ticket, result }
            }
            EngineCall::Detach { ticket, .. } => EngineAnswer::Detached {
                ticket,
                result: self.detach.clone(),
            },
            EngineCall::Status => EngineAnswer::Status(EngineStatus::default()),
            EngineCall::PrefixChanges { snapshot } => EngineAnswer::Prefix {
                snapshot,
                changes: Some(if snapshot {
                    PrefixChanges {
                        full: true,
                        stored: self.cache.iter().copied().collect(),
                        removed: Vec::new(),
                    }
                } else {
                    std::mem::take(&mut self.cache_delta)
                }),
            },
            EngineCall::KvHolders => EngineAnswer::Holders(self.holders.clone()),
            EngineCall::DropOrphan(id) => {
                let dropped = self.holders.contains(&id);
                self.holders.retain(|h| *h != id);
                EngineAnswer::OrphanDropped { id, dropped }
            }
            c => unreachable!("{c:?} is answered later"),
        }
    }

    fn msg(&mut self, from: u32, epoch: u64, msg: Message) {
        self.input(NodeInput::Message { from, epoch, msg });
    }

    fn step(&mut self, events: Vec<(RequestId, EngineEvent)>) {
        self.input(NodeInput::Step(events));
    }

    /// Moves the clock to `t`, ticking at every deadline on the way.
    fn run_to(&mut self, t: Duration) {
        loop {
            let d = self.core.next_deadline();
            if d > t {
                break;
            }
            self.now = self.now.max(d);
            self.input(NodeInput::Tick);
        }
        self.now = t;
    }

    /// Runs the clock to `t` with the Router sending a heartbeat's worth
    /// of traffic at every interval.
    fn live_until(&mut self, t: Duration, epoch: u64) {
        while self.now < t {
            let at = (self.now + HB).min(t);
            self.run_to(at);
            self.msg(
                ROUTER,
                epoch,
                Message::Ping {
                    seq: 0,
                    pad: vec![],
                },
            );
        }
    }

    fn take_sent(&mut self) -> Vec<(u32, Message)> {
        std::mem::take(&mut self.sent)
            .into_iter()
            .filter(|(_, m)| !matches!(m, Message::Heartbeat(_) | Message::Pong { .. }))
            .collect()
    }

    /// The events sent to the Router since the last look, per request:
    /// (req, attempt, first index, events).
    fn events(&mut self) -> Vec<(u64, u32, u32, Vec<EngineEvent>)> {
        let mut all = Vec::new();
        self.sent.retain(|(to, m)| match m {
            Message::Events(batch) => {
                assert_eq!(*to, ROUTER);
                for r in batch {
                    all.push((r.req, r.attempt, r.first, r.events.clone()));
                }
                false
            }
            _ => true,
        });
        all
    }

    fn last_id(&self) -> RequestId {
        RequestId(self.next_id)
    }
}

fn request(tenant: u32, prompt_len: u32) -> EngineRequest {
    EngineRequest {
        tenant: TenantId(tenant),
        prompt: (0..prompt_len).collect(),
        max_tokens: 8,
        sampling: SamplingParams::greedy(),
        logit_bias: Vec::new(),
        generated: 0,
        constraint: None,
        ignore_eos: false,
        stop_token_ids: vec![],
        speculative: true,
        trace: None,
    }
}

fn submit(req: u64, attempt: u32, prefill: Option<u32>) -> Message {
    Message::Submit(Submit {
        req,
        attempt,
        prefill,
        kv_move: false,
        request: request(0, 6),
    })
}

/// The Router's answer that it does not run placement `attempt` of `req`
/// on this node.
fn unknown_placement(req: u64, attempt: u32) -> Message {
    Message::Unknown {
        held: vec![Held {
            req,
            for_decode: None,
            attempt,
        }],
    }
}

fn sampled(t: u32) -> Sampled {
    Sampled {
        token: t,
        logprob: -0.5,
        top: vec![],
    }
}

fn tok(t: u32) -> EngineEvent {
    EngineEvent::Token(sampled(t))
}

fn finished() -> EngineEvent {
    EngineEvent::Finished {
        reason: FinishReason::Length,
        usage: Usage {
            prompt_tokens: 6,
            completion_tokens: 1,
            cached_tokens: 0,
        },
    }
}

fn header(req: u64, model: &str) -> KvTransferHeader {
    KvTransferHeader {
        router: ROUTER,
        req,
        epoch: 1,
        model: model.into(),
        block_size: 4,
        dtype: flotilla_proto::KvDtype::F16,
        layout: 1,
        layer_start: 0,
        layer_end: 2,
        token_count: 6,
        block_count: 2,
        bytes: 128,
        // The bytes the tests send: 128 zeros.
        checksum: u64::from(crc32fast::hash(&[0u8; 128])),
        first: sampled(9),
    }
}

#[test]
fn a_whole_request_is_admitted_streamed_per_step_and_forgotten() {
    let mut h = H::new(Role::Worker, false, |o| o);
    h.msg(ROUTER, 1, submit(7, 0, None));
    assert!(matches!(
        h.take_sent()[..],
        [(ROUTER, Message::Admitted { req: 7 })]
    ));
    let id = h.last_id();
    h.step(vec![(id, tok(1)), (id, tok(2))]);
    // One step, one frame, one run of events.
    assert_eq!(h.sent.len(), 1);
    assert_eq!(h.events(), vec![(7, 0, 0, vec![tok(1), tok(2)])]);
    h.step(vec![(id, tok(3)), (id, finished())]);
    assert_eq!(h.events(), vec![(7, 0, 2, vec![tok(3), finished()])]);
    assert_eq!(h.ended, vec![(id, false)]);
    // Forgotten: a late event goes nowhere, a Cancel ends nothing.
    h.step(vec![(id, tok(4))]);
    h.msg(
        ROUTER,
        1,
        Message::Cancel {
            req: 7,
            stop_string: false,
            attempt: 0,
        },
    );
    assert!(h.events().is_empty());
    assert_eq!(h.ended.len(), 1);
}

#[test]
fn duplicates_are_dropped_and_a_rerun_replaces_the_earlier_placement() {
    let mut h = H::new(Role::Worker, false, |o| o);
    h.msg(ROUTER, 1, submit(7, 0, None));
    let first = h.last_id();
    // A resend after a reconnect: nothing new runs.
    h.msg(ROUTER, 1, submit(7, 0, None));
    assert_eq!(h.last_id(), first);
    assert_eq!(h.take_sent().len(), 1);
    // A re-run that overtook the Cancel of the first placement.
    h.msg(ROUTER, 1, submit(7, 1, None));
    let second = h.last_id();
    assert_ne!(first, second);
    assert_eq!(h.ended, vec![(first, false)]);
    // The late Cancel of placement 0 leaves placement 1 running.
    h.msg(
        ROUTER,
        1,
        Message::Cancel {
            req: 7,
            stop_string: false,
            attempt: 0,
        },
    );
    assert_eq!(h.ended.len(), 1);
    h.step(vec![(first, tok(5)), (second, tok(6))]);
    assert_eq!(h.events(), vec![(7, 1, 0, vec![tok(6)])]);
    // Ended at a stop string: the engine finishes it.
    h.msg(
        ROUTER,
        1,
        Message::Cancel {
            req: 7,
            stop_string: true,
            attempt: 1,
        },
    );
    assert_eq!(h.ended, vec![(first, false), (second, true)]);
}

#[test]
fn an_unknown_tenant_and_an_engine_refusal_are_refused_and_nothing_runs() {
    let mut h = H::new(Role::Worker, false, |o| o);
    let mut s = Submit {
        req: 1,
        attempt: 0,
        prefill: None,
        kv_move: false,
        request: request(9, 4),
    };
    h.msg(ROUTER, 1, Message::Submit(s.clone()));
    match &h.take_sent()[..] {
        [
            (
                ROUTER,
                Message::Refused {
                    req: 1,
                    rejection: Rejection::Invalid(why),
                },
            ),
        ] => {
            assert!(why.contains("unknown tenant 9"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    h.refuse = Some(Rejection::Unavailable);
    s.request.tenant = TenantId(0);
    h.msg(ROUTER, 1, Message::Submit(s));
    assert!(matches!(
        h.take_sent()[..],
        [(
            ROUTER,
            Message::Refused {
                req: 1,
                rejection: Rejection::Unavailable
            }
        )]
    ));
    // Nothing of it is held here: the next look asks about nothing.
    h.live_until(DOWN * 3, 1);
    assert!(
        h.take_sent()
            .iter()
            .all(|(_, m)| !matches!(m, Message::Holding { .. }))
    );
}

#[test]
fn a_silent_router_loses_its_requests_and_a_restarted_one_its_old_life() {
    let mut h = H::new(Role::Worker, false, |o| o);
    h.msg(ROUTER, 1, submit(1, 0, None));
    let old = h.last_id();
    h.take_sent();
    // The Router restarted: its old life's requests end, and the
    // connection to that life is dropped.
    h.msg(ROUTER, 2, submit(1, 0, None));
    let new = h.last_id();
    assert_eq!(h.reconnects, vec![ROUTER]);
    assert_eq!(h.ended, vec![(old, false)]);
    h.step(vec![(new, tok(1))]);
    h.take_sent();
    // Heartbeats go out every interval whether or not the Router talks.
    let before = h.sent.len();
    h.run_to(DOWN);
    let beats = h.sent[before..]
        .iter()
        .filter(|(_, m)| matches!(m, Message::Heartbeat(_)))
        .count();
    assert_eq!(beats, (DOWN.as_millis() / HB.as_millis()) as usize);
    assert_eq!(h.ended.len(), 1, "not silent for over the bound yet");
    h.run_to(DOWN + HB);
    assert_eq!(h.ended, vec![(old, false), (new, false)]);
    match &h.events()[..] {
        [(1, 0, 1, ev)] => assert!(matches!(
            ev[..],
            [EngineEvent::Failed(EngineFailure::RouterLost(_))]
        )),
        other => panic!("{other:?}"),
    }
}

/// A Router's silence is looked at when it passes the down bound, not at
/// the node's next heartbeat: its requests end within a tick of the bound.
#[test]
fn a_silent_router_s_requests_end_at_the_down_bound_not_at_the_next_heartbeat() {
    let mut h = H::new(Role::Worker, false, |o| o);
    // Heard a third of an interval after a heartbeat.
    let heard = HB + HB / 3;
    h.run_to(heard);
    h.msg(ROUTER, 1, submit(1, 0, None));
    h.take_sent();
    h.run_to(heard + DOWN);
    assert!(h.ended.is_empty(), "silent for exactly the bound: not yet");
    h.run_to(heard + DOWN + Duration::from_micros(1));
    // Checked at the node's heartbeat instead, it would end at 6 HB, two
    // thirds of an interval later.
    assert_eq!(h.ended.len(), 1, "ended at the bound");
}

#[test]
fn a_decode_node_reserves_asks_the_prefill_and_checks_what_comes() {
    let mut h = H::new(Role::Decode, true, |o| o);
    h.msg(ROUTER, 1, submit(4, 0, Some(PREFILL)));
    let reservation = h.last_id();
    match &h.take_sent()[..] {
        [
            (ROUTER, Message::Admitted { req: 4 }),
            (PREFILL, Message::Prefill(pm)),
        ] => {
            assert_eq!(
                (pm.router, pm.submit.req, pm.submit.prefill),
                (ROUTER, 4, None)
            );
        }
        other => panic!("{other:?}"),
    }
    // KV of another model: refused, the reservation given back, the
    // prefill node told, the Router told.
    let data = vec![Bytes::from(vec![0u8; 128])];
    h.input(NodeInput::Bulk {
        from: PREFILL,
        header: header(4, "other"),
        data: data.clone(),
    });
    let sent = h.take_sent();
    assert!(
        matches!(
            sent[0],
            (
                PREFILL,
                Message::KvAck {
                    req: 4,
                    ok: false,
                    ..
                }
            )
        ),
        "{sent:?}"
    );
    assert!(matches!(
        sent[1],
        (
            PREFILL,
            Message::PrefillCancel {
                req: 4,
                attempt: 0,
                ..
            }
        )
    ));
    assert!(matches!(h.given_back[..], [EngineCall::CancelReservation(r)] if r == reservation));
    match &sent[2] {
        (ROUTER, Message::Events(b)) => match &b[0].events[..] {
            [EngineEvent::Failed(EngineFailure::KvTransfer(why))] => {
                assert!(why.contains("model 'other'"), "{why}")
            }
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    // The re-run: KV that fits is written; the engine's first events
    // come before its answer and wait for it.
    h.msg(ROUTER, 1, submit(4, 1, Some(PREFILL)));
    let reservation = h.last_id();
    h.take_sent();
    // From the wrong node: not ours.
    h.input(NodeInput::Bulk {
        from: 9,
        header: header(4, "m"),
        data: data.clone(),
    });
    assert!(matches!(
        h.take_sent()[..],
        [(9, Message::KvAck { ok: false, .. })]
    ));
    h.input(NodeInput::Bulk {
        from: PREFILL,
        header: header(4, "m"),
        data,
    });
    assert!(
        matches!(&h.later[..], [EngineCall::Import { reservation: r, .. }] if *r == reservation)
    );
    h.step(vec![(reservation, tok(9)), (reservation, tok(10))]);
    assert!(h.events().is_empty());
    h.later.clear();
    h.input(NodeInput::Answer(EngineAnswer::Imported {
        reservation,
        result: Ok(reservation),
    }));
    assert_eq!(h.events(), vec![(4, 1, 0, vec![tok(9), tok(10)])]);
    assert!(matches!(
        h.take_sent()[..],
        [(
            PREFILL,
            Message::KvAck {
                req: 4,
                ok: true,
                ..
            }
        )]
    ));
    h.step(vec![(reservation, finished())]);
    assert_eq!(h.events(), vec![(4, 1, 2, vec![finished()])]);
    assert_eq!(h.ended, vec![(reservation, false)]);
}

#[test]
fn a_reservation_whose_kv_never_comes_is_given_back_and_the_router_told() {
    let mut h = H::new(Role::Decode, true, |o| o);
    h.msg(ROUTER, 1, submit(4, 0, Some(PREFILL)));
    let reservation = h.last_id();
    h.take_sent();
    h.live_until(TTL - HB, 1);
    assert!(h.given_back.is_empty());
    h.live_until(TTL + HB, 1);
    assert!(matches!(h.given_back[..], [EngineCall::CancelReservation(r)] if r == reservation));
    let events = h.events();
    let sent = h.take_sent();
    assert!(
        sent.iter()
            .any(|m| matches!(m, (PREFILL, Message::PrefillCancel { req: 4, .. })))
    );
    match &events[..] {
        [(4, 0, 0, ev)] => match &ev[..] {
            [EngineEvent::Failed(EngineFailure::KvTransfer(why))] => {
                assert!(why.contains("no KV from prefill node 2"), "{why}")
            }
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
    // Its KV arriving now is refused: the sender may free its blocks.
    h.input(NodeInput::Bulk {
        from: PREFILL,
        header: header(4, "m"),
        data: vec![],
    });
    assert!(matches!(
        h.take_sent()[..],
        [(PREFILL, Message::KvAck { ok: false, .. })]
    ));
}

#[test]
fn a_transfer_whose_bytes_are_not_the_headers_is_refused_before_it_is_written() {
    // One byte changed on the way, then a transfer cut short: each is
    // refused here, with nothing handed to the engine to write.
    let cases: [(&str, Vec<Bytes>); 2] = [
        ("changed", {
            let mut b = vec![0u8; 128];
            b[77] = 1;
            vec![Bytes::from(b)]
        }),
        ("cut short", vec![Bytes::from(vec![0u8; 64])]),
    ];
    for (what, data) in cases {
        let mut h = H::new(Role::Decode, true, |o| o);
        h.msg(ROUTER, 1, submit(4, 0, Some(PREFILL)));
        let reservation = h.last_id();
        h.take_sent();
        h.input(NodeInput::Bulk {
            from: PREFILL,
            header: header(4, "m"),
            data,
        });
        assert!(h.later.is_empty(), "{what}: no import: {:?}", h.later);
        assert!(
            matches!(h.given_back[..], [EngineCall::CancelReservation(r)] if r == reservation),
            "{what}: the reservation given back: {:?}",
            h.given_back
        );
        // The Router hears why; the prefill node may free its blocks.
        match &h.events()[..] {
            [(4, 0, 0, ev)] => match &ev[..] {
                [EngineEvent::Failed(EngineFailure::KvTransfer(why))] => {
                    assert!(why.contains("KV transfer corrupt"), "{what}: {why}")
                }
                other => panic!("{what}: {other:?}"),
            },
            other => panic!("{what}: {other:?}"),
        }
        assert!(
            matches!(
                h.take_sent()[..],
                [(
                    PREFILL,
                    Message::KvAck {
                        req: 4,
                        ok: false,
                        ..
                    }
                )]
            ),
            "{what}"
        );
        // Nothing of it is left: the same KV again finds no request.
        h.input(NodeInput::Bulk {
            from: PREFILL,
            header: header(4, "m"),
            data: vec![Bytes::from(vec![0u8; 128])],
        });
        assert!(h.later.is_empty(), "{what}");
    }
}

fn ask(req: u64, tenant: u32, priority: u8) -> Message {
    Message::Prefill(PrefillMsg {
        router: ROUTER,
        submit: Submit {
            req,
            attempt: 0,
            prefill: None,
            kv_move: false,
            request: request(tenant, 6),
        },
        priority,
    })
}

#[test]
fn a_traced_prefill_reports_its_kv_transfer_as_a_span_from_its_end_to_the_ack() {
    let mut h = H::new(Role::Prefill, true, |o| o);
    let cx = TraceContext {
        trace_id: [3; 16],
        span_id: [4; 8],
        flags: 1,
        state: String::new(),
    };
    let traced = |req: u64| {
        let Message::Prefill(mut pm) = ask(req, 0, 0) else {
            unreachable!()
        };
        pm.submit.request.trace = Some(cx.clone());
        Message::Prefill(pm)
    };
    // One traced and acked, one traced whose send fails, one not traced.
    let mut ids = Vec::new();
    for req in [1, 2] {
        h.msg(DECODE, 1, traced(req));
        ids.push(h.last_id());
    }
    h.msg(DECODE, 1, ask(3, 0, 0));
    ids.push(h.last_id());
    h.now = ms(10);
    h.step(vec![(ids[0], tok(11)), (ids[0], finished())]);
    h.now = ms(20);
    h.input(NodeInput::Answer(EngineAnswer::Exported {
        id: ids[0],
        result: Ok(export()),
    }));
    h.now = ms(30);
    h.input(NodeInput::Answer(EngineAnswer::BulkSent {
        id: ids[0],
        result: Ok(()),
    }));
    assert!(h.spans.is_empty(), "no span before the ack");
    h.now = ms(45);
    h.msg(
        DECODE,
        1,
        Message::KvAck {
            router: ROUTER,
            req: 1,
            ok: true,
        },
    );
    let (parent, s) = h.spans.pop().expect("the transfer's span");
    assert_eq!(parent, cx);
    assert_eq!((s.decode, s.start, s.end), (DECODE, ms(10), ms(45)));
    assert_eq!(
        (s.export, s.send, s.sent),
        (Some(ms(10)), Some(ms(20)), Some(ms(30)))
    );
    assert_eq!((s.bytes, s.acked, s.moving), (128, true, false), "{s:?}");
    assert_eq!(s.failure, None);
    // The second's send fails: its span ends in error.
    h.step(vec![(ids[1], tok(12)), (ids[1], finished())]);
    h.input(NodeInput::Answer(EngineAnswer::Exported {
        id: ids[1],
        result: Ok(export()),
    }));
    h.input(NodeInput::Answer(EngineAnswer::BulkSent {
        id: ids[1],
        result: Err("reset".into()),
    }));
    let (_, s) = h.spans.pop().expect("the failed transfer's span");
    assert!(
        s.failure.as_deref().is_some_and(|e| e.contains("reset")),
        "{s:?}"
    );
    // The untraced one reports nothing.
    h.step(vec![(ids[2], tok(13)), (ids[2], finished())]);
    h.input(NodeInput::Answer(EngineAnswer::Exported {
        id: ids[2],
        result: Ok(export()),
    }));
    h.input(NodeInput::Answer(EngineAnswer::BulkSent {
        id: ids[2],
        result: Ok(()),
    }));
    h.msg(
        DECODE,
        1,
        Message::KvAck {
            router: ROUTER,
            req: 3,
            ok: true,
        },
    );
    assert!(h.spans.is_empty());
}

fn export() -> KvExport {
    KvExport {
        tokens: 6,
        blocks: 2,
        data: vec![7u8; 128],
    }
}

#[test]
fn prefills_leave_by_tier_one_slot_at_a_time_and_are_released_on_ack_or_at_the_deadline() {
    let mut h = H::new(Role::Prefill, true, |o| o);
    let mut ids = Vec::new();
    for (req, prio) in [(1, 0), (2, 2), (3, 1)] {
        h.msg(DECODE, 1, ask(req, 0, prio));
        ids.push(h.last_id());
    }
    let (a, b, c) = (ids[0], ids[1], ids[2]);
    // a finishes first and takes the slot; c then b wait for it.
    h.step(vec![
        (a, tok(11)),
        (a, finished()),
        (c, tok(13)),
        (c, finished()),
        (b, tok(12)),
        (b, finished()),
    ]);
    let exports = |h: &mut H| -> Vec<RequestId> {
        let e = h
            .later
            .iter()
            .filter_map(|c| match c {
                EngineCall::Export(id) => Some(*id),
                _ => None,
            })
            .collect();
        h.later.clear();
        e
    };
    assert_eq!(exports(&mut h), vec![a]);
    h.input(NodeInput::Answer(EngineAnswer::Exported {
        id: a,
        result: Ok(export()),
    }));
    let (id, to, hd) = h.bulks.pop().unwrap();
    assert_eq!(
        (id, to, hd.req, hd.token_count, hd.first.token),
        (a, DECODE, 1, 6, 11)
    );
    assert_eq!(hd.checksum, u64::from(crc32fast::hash(&[7u8; 128])));
    assert_eq!((hd.epoch, hd.model.as_str()), (7, "m"));
    // Sent: the slot goes to the higher tier, b.
    h.input(NodeInput::Answer(EngineAnswer::BulkSent {
        id: a,
        result: Ok(()),
    }));
    assert_eq!(exports(&mut h), vec![b]);
    h.msg(
        DECODE,
        1,
        Message::KvAck {
            router: ROUTER,
            req: 1,
            ok: true,
        },
    );
    assert!(matches!(h.given_back[..], [EngineCall::Release(r)] if r == a));
    // b's send fails: the decode node is told, the slot goes to c.
    h.input(NodeInput::Answer(EngineAnswer::Exported {
        id: b,
        result: Ok(export()),
    }));
    h.input(NodeInput::Answer(EngineAnswer::BulkSent {
        id: b,
        result: Err("reset".into()),
    }));
    assert!(h.take_sent().iter().any(|m| matches!(m, (DECODE, Message::PrefillFailed { req: 2, reason, .. }) if reason.contains("reset"))));
    assert_eq!(exports(&mut h), vec![c]);
    h.input(NodeInput::Answer(EngineAnswer::Exported {
        id: c,
        result: Ok(export()),
    }));
    h.input(NodeInput::Answer(EngineAnswer::BulkSent {
        id: c,
        result: Ok(()),
    }));
    // No ack for c: its blocks go back at the hold deadline.
    let released = |h: &H| {
        h.given_back
            .iter()
            .filter(|g| matches!(g, EngineCall::Release(_)))
            .count()
    };
    assert_eq!(released(&h), 2);
    h.run_to(h.now + TTL - ms(1));
    assert_eq!(released(&h), 2);
    h.run_to(h.now + ms(1));
    assert!(matches!(h.given_back.last(), Some(EngineCall::Release(r)) if *r == c));
    assert_eq!(h.ended.len(), 3);
}

#[test]
fn an_abandoned_prefill_is_refused_and_a_failed_one_reported() {
    let mut h = H::new(Role::Prefill, true, |o| o);
    h.msg(
        ROUTER,
        1,
        Message::PrefillAbandon {
            decode: DECODE,
            decode_epoch: 1,
            req: 9,
        },
    );
    // The ask was in flight when the Router gave the decode node up.
    let before = h.next_id;
    h.msg(DECODE, 1, ask(9, 0, 0));
    assert_eq!(h.next_id, before, "nothing ran");
    assert!(matches!(
        &h.take_sent()[..],
        [(DECODE, Message::PrefillFailed { req: 9, .. })]
    ));
    // The decode node's next life is another key.
    h.msg(DECODE, 2, ask(9, 0, 0));
    let id = h.last_id();
    h.step(vec![(
        id,
        EngineEvent::Failed(EngineFailure::Internal("oom".into())),
    )]);
    assert!(
        matches!(&h.take_sent()[..], [(DECODE, Message::PrefillFailed { req: 9, reason, .. })] if reason.contains("oom"))
    );
    assert!(matches!(h.given_back[..], [EngineCall::Release(r)] if r == id));
    // A node that is not a prefill node says so.
    let mut w = H::new(Role::Decode, true, |o| o);
    w.msg(DECODE, 1, ask(1, 0, 0));
    assert!(
        matches!(&w.take_sent()[..], [(DECODE, Message::PrefillFailed { reason, .. })] if reason.contains("not a prefill node"))
    );
}

#[test]
fn orphans_are_given_back_only_when_found_at_two_looks_in_a_row() {
    let mut h = H::new(Role::Decode, true, |o| o);
    h.msg(ROUTER, 1, submit(5, 0, None));
    let id = h.last_id();
    // A lease no request here owns, and one that is a running request.
    h.holders = vec![RequestId(5000), id];
    h.live_until(DOWN, 1);
    assert!(h.orphans.is_empty(), "one look");
    h.live_until(DOWN * 2, 1);
    assert_eq!(h.orphans.len(), 1, "{:?}", h.orphans);
    assert!(h.orphans[0].contains("engine lease"), "{}", h.orphans[0]);
    assert_eq!(h.holders, vec![id]);
    // The Router is asked about request 5 (held at both looks); it does
    // not know it: named twice, it is given back.
    let asked = h.take_sent().into_iter().any(|(to, m)| {
        to == ROUTER && matches!(&m, Message::Holding { held } if held == &[Held { req: 5, for_decode: None, attempt: 0 }])
    });
    assert!(asked);
    let unknown = || unknown_placement(5, 0);
    h.msg(ROUTER, 1, unknown());
    assert!(h.ended.is_empty());
    h.msg(ROUTER, 1, unknown());
    assert_eq!(h.ended, vec![(id, false)]);
    assert_eq!(h.orphans.len(), 2);
    // The heartbeat carries the count.
    h.sent.clear();
    h.run_to(h.now + HB);
    assert!(
        h.sent
            .iter()
            .any(|(_, m)| matches!(m, Message::Heartbeat(s) if s.orphans == 2))
    );
}

#[test]
fn an_admission_the_router_cannot_hear_of_ends_the_request() {
    let mut h = H::new(Role::Worker, false, |o| o);
    h.msg(ROUTER, 1, submit(3, 0, None));
    let id = h.last_id();
    let why = "unreachable".to_string();
    h.input(NodeInput::Undelivered {
        to: ROUTER,
        msg: Message::Admitted { req: 3 },
        reason: why,
    });
    assert_eq!(h.ended, vec![(id, false)]);
    // A prefill node that cannot be reached fails the import at once.
    let mut d = H::new(Role::Decode, true, |o| o);
    d.msg(ROUTER, 1, submit(4, 0, Some(PREFILL)));
    let res = d.last_id();
    let ask = d.take_sent().pop().unwrap().1;
    d.input(NodeInput::Undelivered {
        to: PREFILL,
        msg: ask,
        reason: "no route".into(),
    });
    assert!(matches!(d.given_back[..], [EngineCall::CancelReservation(r)] if r == res));
    match &d.events()[..] {
        [(4, 0, 0, ev)] => assert!(
            matches!(&ev[..], [EngineEvent::Failed(EngineFailure::KvTransfer(w))] if w.contains("no route"))
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_input_while_an_engine_answer_is_due_breaks_the_contract() {
    let opts = testrig::node_opts(HB, DOWN, Role::Worker);
    let mut core = NodeCore::new(opts, ME, 1, None, Duration::ZERO);
    let mut out = Vec::new();
    core.handle(Duration::ZERO, NodeInput::Tick, &mut out);
    assert!(matches!(out[..], [NodeOutput::Call(EngineCall::Status)]));
    core.check_invariants().unwrap();
    core.handle(ms(1), NodeInput::Step(vec![]), &mut out);
    let e = core.check_invariants().unwrap_err();
    assert!(e.contains("answers due"), "{e}");
}

#[test]
fn a_draining_node_takes_no_new_work_finishes_what_runs_then_leaves() {
    let mut h = H::new(Role::Worker, false, |o| o);
    h.msg(ROUTER, 1, submit(7, 0, None));
    let id = h.last_id();
    h.take_sent();
    h.input(NodeInput::Drain { grace: ms(10_000) });
    // A heartbeat at once says so.
    assert!(
        h.sent
            .iter()
            .any(|(to, m)| *to == ROUTER && matches!(m, Message::Heartbeat(s) if s.draining)),
        "{:?}",
        h.sent
    );
    h.sent.clear();
    h.msg(ROUTER, 1, submit(8, 0, None));
    assert!(matches!(
        h.take_sent()[..],
        [(
            ROUTER,
            Message::Refused {
                req: 8,
                rejection: Rejection::Unavailable
            }
        )]
    ));
    h.live_until(ms(1_000), 1);
    assert!(!h.left, "left with a request running");
    h.sent.clear();
    h.step(vec![(id, tok(1)), (id, finished())]);
    assert!(h.left);
    // Its last events first, then the word that it leaves.
    let kinds: Vec<_> = h
        .sent
        .iter()
        .filter(|(_, m)| !matches!(m, Message::Heartbeat(_) | Message::Pong { .. }))
        .map(|(to, m)| (*to, m.kind()))
        .collect();
    use flotilla_proto::wire::Kind;
    assert_eq!(kinds, vec![(ROUTER, Kind::Events), (ROUTER, Kind::Leaving)]);
    // Heartbeats after the drain said it drains.
    assert!(h.sent.iter().all(|(_, m)| match m {
        Message::Heartbeat(s) => s.draining,
        _ => true,
    }));
}

#[test]
fn a_router_s_drain_ends_at_its_deadline_with_work_still_running() {
    let mut h = H::new(Role::Worker, false, |o| o);
    h.msg(ROUTER, 1, submit(7, 0, None));
    // Another node may not ask for a drain.
    h.msg(DECODE, 1, Message::Drain { grace_ms: 100 });
    assert!(!h.core.draining());
    h.msg(ROUTER, 1, Message::Drain { grace_ms: 500 });
    assert!(h.core.draining());
    // A second, longer drain does not push the deadline out.
    h.msg(ROUTER, 1, Message::Drain { grace_ms: 5_000 });
    h.live_until(ms(499), 1);
    assert!(!h.left);
    h.sent.clear();
    h.live_until(ms(600), 1);
    assert!(h.left, "still here after the deadline");
    assert!(
        h.sent
            .iter()
            .any(|(to, m)| *to == ROUTER && matches!(m, Message::Leaving))
    );
    assert_eq!(
        h.sent
            .iter()
            .filter(|(_, m)| matches!(m, Message::Leaving))
            .count(),
        1
    );
}

fn move_submit(req: u64, attempt: u32, from: u32, prompt: Vec<u32>) -> Submit {
    Submit {
        req,
        attempt,
        prefill: Some(from),
        kv_move: true,
        request: EngineRequest {
            prompt,
            max_tokens: 6,
            ..request(0, 1)
        },
    }
}

#[test]
fn a_leaving_node_hands_a_running_request_s_kv_to_the_node_it_moves_to() {
    let mut h = H::new(Role::Worker, true, |o| o);
    h.msg(ROUTER, 1, submit(7, 0, None));
    let id = h.last_id();
    h.step((50..55).map(|t| (id, tok(t))).collect());
    h.input(NodeInput::Drain { grace: ms(500) });
    h.live_until(ms(600), 1);
    assert!(
        h.sent.iter().any(|(_, m)| matches!(m, Message::Leaving)),
        "{:?}",
        h.sent
    );
    assert!(!h.left, "gone while its request may still be asked for");
    h.sent.clear();
    // The Router had seen two of its five tokens when it moved it.
    let prompt: Vec<u32> = (0..6).chain([50, 51]).collect();
    h.detach = Ok((0..6).chain(50..55).collect());
    let ask = PrefillMsg {
        router: ROUTER,
        submit: move_submit(7, 1, ME, prompt),
        priority: 0,
    };
    h.msg(DECODE, 1, Message::Prefill(ask.clone()));
    // Stopped here: a step already under way sends nothing more of it.
    h.step(vec![(id, tok(55))]);
    assert!(h.events().is_empty());
    assert!(matches!(h.later[..], [EngineCall::Export(e)] if e == id));
    h.later.clear();
    // Its KV holds ten tokens in three blocks; the mover wants seven.
    let held = KvExport {
        tokens: 10,
        blocks: 3,
        data: (0..192u32).map(|b| b as u8).collect(),
    };
    h.input(NodeInput::Answer(EngineAnswer::Exported {
        id,
        result: Ok(held),
    }));
    let (bid, to, hd) = h.bulks.pop().expect("the KV leaves");
    assert_eq!((bid, to), (id, DECODE));
    assert_eq!(
        (hd.req, hd.token_count, hd.block_count, hd.bytes),
        (7, 7, 2, 128)
    );
    assert_eq!(
        hd.first.token, 51,
        "continued from the last token asked for"
    );
    // A duplicate ask changes nothing.
    h.msg(DECODE, 1, Message::Prefill(ask));
    assert!(h.take_sent().is_empty() && h.later.is_empty());
    h.input(NodeInput::Answer(EngineAnswer::BulkSent {
        id,
        result: Ok(()),
    }));
    assert!(!h.left);
    h.msg(
        DECODE,
        1,
        Message::KvAck {
            router: ROUTER,
            req: 7,
            ok: true,
        },
    );
    assert!(matches!(h.given_back[..], [EngineCall::Release(r)] if r == id));
    assert!(h.left, "nothing waits here any more");
}

#[test]
fn a_leaving_node_refuses_a_move_it_cannot_serve_and_leaves_at_its_deadline() {
    let mut h = H::new(Role::Worker, true, |o| o);
    h.msg(ROUTER, 1, submit(7, 0, None));
    let id = h.last_id();
    h.msg(ROUTER, 1, submit(8, 0, None));
    h.step(vec![(id, tok(50))]);
    h.input(NodeInput::Drain { grace: ms(0) });
    h.sent.clear();
    // Not a request of ours.
    let ask = |req, prompt: Vec<u32>| PrefillMsg {
        router: ROUTER,
        submit: move_submit(req, 1, ME, prompt),
        priority: 0,
    };
    h.msg(DECODE, 1, Message::Prefill(ask(9, vec![1, 2])));
    // Still computing its prompt: the engine refuses, the request ends.
    h.msg(
        DECODE,
        1,
        Message::Prefill(ask(7, (0..6).chain([50]).collect())),
    );
    let refused: Vec<u64> = h
        .take_sent()
        .into_iter()
        .filter_map(|(to, m)| match m {
            Message::PrefillFailed { req, .. } if to == DECODE => Some(req),
            _ => None,
        })
        .collect();
    assert_eq!(refused, vec![9, 7]);
    assert!(h.ended.contains(&(id, false)));
    assert!(matches!(h.given_back[..], [EngineCall::Release(r)] if r == id));
    // Request 8 is asked for by nobody: it ends with this life.
    assert!(!h.left);
    h.live_until(TTL - ms(1), 1);
    assert!(!h.left);
    h.live_until(TTL, 1);
    assert!(h.left);
}

#[test]
fn a_request_moved_here_with_its_kv_continues_after_the_token_its_client_has() {
    let mut h = H::new(Role::Worker, true, |o| o);
    // The Router's prompt: the original six tokens and the two its
    // client has.
    let prompt: Vec<u32> = (0..8).collect();
    h.msg(
        ROUTER,
        1,
        Message::Submit(move_submit(5, 1, PREFILL, prompt.clone())),
    );
    let reservation = h.last_id();
    match &h.take_sent()[..] {
        [
            (ROUTER, Message::Admitted { req: 5 }),
            (PREFILL, Message::Prefill(pm)),
        ] => {
            assert!(pm.submit.kv_move);
            assert_eq!(pm.submit.request.prompt, prompt, "asks for all it knows");
        }
        other => panic!("{other:?}"),
    }
    let mut hd = header(5, "m");
    hd.token_count = 7;
    hd.first = sampled(7);
    h.input(NodeInput::Bulk {
        from: PREFILL,
        header: hd,
        data: vec![Bytes::from(vec![0u8; 128])],
    });
    match &h.later[..] {
        [EngineCall::Import { request, .. }] => {
            assert_eq!(request.prompt, prompt[..7]);
            assert_eq!(request.max_tokens, 7, "its first token is one of them");
        }
        other => panic!("{other:?}"),
    }
    h.later.clear();
    h.step(vec![(reservation, tok(7)), (reservation, tok(20))]);
    h.input(NodeInput::Answer(EngineAnswer::Imported {
        reservation,
        result: Ok(reservation),
    }));
    assert_eq!(h.events(), vec![(5, 1, 0, vec![tok(20)])]);
    let end = EngineEvent::Finished {
        reason: FinishReason::Length,
        usage: Usage {
            prompt_tokens: 7,
            completion_tokens: 2,
            cached_tokens: 0,
        },
    };
    h.step(vec![(reservation, end)]);
    let usage = Usage {
        prompt_tokens: 8,
        completion_tokens: 1,
        cached_tokens: 0,
    };
    assert_eq!(
        h.events(),
        vec![(
            5,
            1,
            1,
            vec![EngineEvent::Finished {
                reason: FinishReason::Length,
                usage
            }]
        )]
    );
    // A node that imports no KV computes the whole prompt instead.
    let mut h = H::new(Role::Worker, false, |o| o);
    h.msg(
        ROUTER,
        1,
        Message::Submit(move_submit(5, 1, PREFILL, prompt)),
    );
    assert!(matches!(
        h.take_sent()[..],
        [(ROUTER, Message::Admitted { req: 5 })]
    ));
}

/// A decode node refuses a transfer whose KV dtype (or any other part of
/// the block layout) is not its own, saying both, and takes one that is.
#[test]
fn a_transfer_of_another_kv_dtype_is_refused_with_both_named() {
    let mut ours = layout();
    ours.dtype = flotilla_proto::KvDtype::Int8;
    let header = |dtype| KvTransferHeader {
        router: 0,
        req: 1,
        epoch: 1,
        model: "m".into(),
        block_size: 4,
        dtype,
        layout: 1,
        layer_start: 0,
        layer_end: 2,
        token_count: 6,
        block_count: 2,
        bytes: 2 * ours.bytes_per_block,
        checksum: 0,
        first: Sampled {
            token: 1,
            logprob: f32::NAN,
            top: vec![],
        },
    };
    let why = super::check_header(&header(flotilla_proto::KvDtype::F16), &ours, "m", 6)
        .expect_err("an f16 transfer into an int8 cache");
    assert!(
        why.contains("dtype f16") && why.contains("dtype int8"),
        "{why}"
    );
    super::check_header(&header(flotilla_proto::KvDtype::Int8), &ours, "m", 6)
        .expect("an int8 transfer into an int8 cache");
}

#[test]
fn a_submit_that_comes_after_its_cancel_is_dropped_and_a_later_placement_runs() {
    let mut h = H::new(Role::Worker, false, |o| o);
    let cancel = |attempt| Message::Cancel {
        req: 9,
        stop_string: false,
        attempt,
    };
    // The Cancel of placement 1 overtakes its Submit (the Submit was held
    // on a cut link): the Submit that comes after it runs nothing.
    let before = h.last_id();
    h.msg(ROUTER, 1, cancel(1));
    h.msg(ROUTER, 1, submit(9, 1, None));
    assert_eq!(h.last_id(), before, "a cancelled placement ran");
    assert!(h.take_sent().is_empty());
    // The Router places it here again later: that placement runs.
    h.msg(ROUTER, 1, submit(9, 2, None));
    assert_ne!(h.last_id(), before);
    assert!(
        h.take_sent()
            .iter()
            .any(|(_, m)| matches!(m, Message::Admitted { req: 9 }))
    );
    // A Cancel of an unknown request is forgotten after the hold deadline:
    // the node keeps no record of it for ever.
    h.msg(ROUTER, 1, cancel(0));
    let running = h.last_id();
    h.live_until(TTL * 2, 1);
    h.msg(ROUTER, 1, submit(11, 0, None));
    assert_ne!(h.last_id(), running);
}

#[test]
fn the_router_s_answer_about_an_earlier_placement_never_ends_a_later_one() {
    let mut h = H::new(Role::Worker, false, |o| o);
    h.msg(ROUTER, 1, submit(5, 0, None));
    let first = h.last_id();
    // Held at two looks, so asked about.
    h.live_until(DOWN * 2 + ms(1), 1);
    let asked = h.take_sent().into_iter().any(|(_, m)| {
        matches!(&m, Message::Holding { held } if held == &[Held { req: 5, for_decode: None, attempt: 0 }])
    });
    assert!(asked);
    // The Router had moved placement 0 away and placed the request here
    // again (placement 1) before its answers about placement 0 come.
    h.msg(ROUTER, 1, submit(5, 1, None));
    let second = h.last_id();
    assert_eq!(h.ended, vec![(first, false)]);
    let unknown = || unknown_placement(5, 0);
    h.msg(ROUTER, 1, unknown());
    h.msg(ROUTER, 1, unknown());
    assert_eq!(h.ended, vec![(first, false)], "placement 1 was ended");
    assert!(h.orphans.is_empty(), "{:?}", h.orphans);
    h.step(vec![(second, tok(3))]);
    assert_eq!(h.events(), vec![(5, 1, 0, vec![tok(3)])]);
}

impl H {
    /// The engine's cache gains `stored` and loses `removed`.
    fn cache_change(&mut self, stored: &[u64], removed: &[u64]) {
        for h in stored {
            self.cache.insert(*h);
            self.cache_delta.removed.retain(|x| x != h);
            self.cache_delta.stored.push(*h);
        }
        for h in removed {
            self.cache.remove(h);
            self.cache_delta.stored.retain(|x| x != h);
            self.cache_delta.removed.push(*h);
        }
    }

    /// The `Prefix` messages sent since the last call: (to, seq, changes).
    fn take_prefix(&mut self) -> Vec<(u32, u64, PrefixChanges)> {
        let mut got = Vec::new();
        self.sent.retain(|(to, m)| match m {
            Message::Prefix { seq, changes } => {
                got.push((*to, *seq, changes.clone()));
                false
            }
            _ => true,
        });
        got
    }
}

fn changes(full: bool, stored: &[u64], removed: &[u64]) -> PrefixChanges {
    PrefixChanges {
        full,
        stored: stored.to_vec(),
        removed: removed.to_vec(),
    }
}

/// Each Router gets the whole prefix cache when it is first heard, then
/// the changes once a heartbeat, numbered for it alone; one that asks
/// (it saw a gap) or restarts gets the whole again.
#[test]
fn each_router_gets_the_whole_prefix_cache_then_its_changes() {
    const OTHER: u32 = 5;
    let mut h = H::new(Role::Worker, true, |o| NodeSettings {
        routers: vec![ROUTER, OTHER],
        ..o
    });
    h.cache_change(&[1, 2], &[]);
    h.run_to(HB);
    assert!(h.take_prefix().is_empty(), "no Router heard: nothing sent");
    let ping = || Message::Ping {
        seq: 1,
        pad: Vec::new(),
    };
    h.msg(ROUTER, 5, ping());
    h.run_to(HB * 2);
    // The changes before it was heard are in the whole it gets.
    assert_eq!(
        h.take_prefix(),
        vec![(ROUTER, 1, changes(true, &[1, 2], &[]))]
    );
    h.cache_change(&[3], &[1]);
    h.msg(ROUTER, 5, ping());
    h.msg(OTHER, 9, ping());
    h.run_to(HB * 3);
    assert_eq!(
        h.take_prefix(),
        vec![
            (ROUTER, 2, changes(false, &[3], &[1])),
            (OTHER, 1, changes(true, &[2, 3], &[])),
        ]
    );
    // Nothing changed: nothing sent.
    h.msg(ROUTER, 5, ping());
    h.msg(OTHER, 9, ping());
    h.run_to(HB * 4);
    assert!(h.take_prefix().is_empty());
    // A Router that saw a gap asks; it gets the whole, numbered on.
    h.cache_change(&[4], &[]);
    h.msg(ROUTER, 5, Message::PrefixResync);
    h.msg(OTHER, 9, ping());
    h.run_to(HB * 5);
    assert_eq!(
        h.take_prefix(),
        vec![
            (OTHER, 2, changes(false, &[4], &[])),
            (ROUTER, 3, changes(true, &[2, 3, 4], &[])),
        ]
    );
    // A restarted Router starts again at 1 with the whole.
    h.msg(ROUTER, 6, ping());
    h.msg(OTHER, 9, ping());
    h.run_to(HB * 6);
    assert_eq!(
        h.take_prefix(),
        vec![(ROUTER, 1, changes(true, &[2, 3, 4], &[]))]
    );
    // Routers silent past the down bound are forgotten: one heard again
    // starts with the whole.
    h.msg(ROUTER, 6, ping());
    h.run_to(HB * 6 + DOWN + HB * 2);
    h.cache_change(&[5], &[]);
    h.msg(OTHER, 9, ping());
    h.take_prefix();
    h.run_to(HB * 6 + DOWN + HB * 3);
    assert_eq!(
        h.take_prefix(),
        vec![(OTHER, 1, changes(true, &[2, 3, 4, 5], &[]))]
    );
}

/// A cache bigger than one frame goes in several, the first replacing,
/// each numbered.
#[test]
fn a_large_prefix_cache_is_split_to_fit_frames() {
    let mut h = H::new(Role::Worker, true, |o| NodeSettings {
        frame_len_max_bytes: 4096,
        ..o
    });
    let all: Vec<u64> = (1..=150).collect();
    h.cache_change(&all, &[]);
    h.msg(
        ROUTER,
        5,
        Message::Ping {
            seq: 1,
            pad: Vec::new(),
        },
    );
    h.run_to(HB);
    let got = h.take_prefix();
    let seqs: Vec<u64> = got.iter().map(|g| g.1).collect();
    assert_eq!(seqs, [1, 2, 3]);
    let fulls: Vec<bool> = got.iter().map(|g| g.2.full).collect();
    assert_eq!(fulls, [true, false, false]);
    let joined: Vec<u64> = got.iter().flat_map(|g| g.2.stored.clone()).collect();
    assert_eq!(joined, all);
    for (_, _, c) in &got {
        let f = flotilla_proto::wire::encode_frame(
            &Message::Prefix {
                seq: 1,
                changes: c.clone(),
            },
            0,
            0,
            0,
            4096,
        );
        assert!(f.is_ok(), "a part over the frame cap");
    }
}

/// A report the transport could not deliver (the link was still dialing,
/// or lost) is made good: the whole goes again at the next heartbeat.
#[test]
fn a_lost_prefix_report_is_sent_again_whole() {
    let mut h = H::new(Role::Worker, true, |o| o);
    h.cache_change(&[1, 2], &[]);
    h.msg(
        ROUTER,
        5,
        Message::Ping {
            seq: 1,
            pad: Vec::new(),
        },
    );
    h.run_to(HB);
    let sent = h.take_prefix();
    assert_eq!(sent, vec![(ROUTER, 1, changes(true, &[1, 2], &[]))]);
    let (to, seq, c) = sent[0].clone();
    h.input(NodeInput::Undelivered {
        to,
        msg: Message::Prefix { seq, changes: c },
        reason: "peer is unreachable".into(),
    });
    h.cache_change(&[3], &[]);
    h.msg(
        ROUTER,
        5,
        Message::Ping {
            seq: 2,
            pad: Vec::new(),
        },
    );
    h.run_to(HB * 2);
    assert_eq!(
        h.take_prefix(),
        vec![(ROUTER, 2, changes(true, &[1, 2, 3], &[]))]
    );
}

/// A Router forgotten for its silence that comes back in a new life (it
/// died and restarted past the down bound) gets a fresh link: the old one
/// reaches the dead process. Back in the same life (a healed cut), the
/// link stays.
#[test]
fn a_router_back_in_a_new_life_after_a_silence_gets_a_fresh_link() {
    let mut h = H::new(Role::Worker, true, |o| o);
    let ping = |seq| Message::Ping {
        seq,
        pad: Vec::new(),
    };
    h.msg(ROUTER, 5, ping(1));
    h.run_to(DOWN + HB * 2);
    h.msg(ROUTER, 5, ping(2));
    assert!(h.reconnects.is_empty(), "the same life: {:?}", h.reconnects);
    h.run_to(DOWN * 2 + HB * 4);
    h.msg(ROUTER, 6, ping(3));
    assert_eq!(h.reconnects, [ROUTER], "a new life after a silence");
}
