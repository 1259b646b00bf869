//! RouterCore driven by hand: inputs and a clock, no runtime, no sleep.

use std::time::Duration;

use flotilla_proto::wire::{JoinedPeer, Message, ReqEvents, Submit};
use flotilla_proto::{
    DrainRefusal, EngineEvent, EngineFailure, EngineRequest, EngineStatus, FinishReason, KvDtype,
    KvUsage, Rejection, Role, Sampled, SamplingParams, TenantId, Usage,
};

use super::{Reach, RouterCore, RouterInput, RouterOptions, RouterOutput};

const HB: Duration = Duration::from_millis(100);
const DOWN: Duration = Duration::from_millis(400);

struct H {
    core: RouterCore,
    now: Duration,
    /// Nodes the transport cannot reach.
    unreachable: Vec<u32>,
    /// KV dtype each node reports (node n at n - 1; f16 past the end).
    dtypes: Vec<KvDtype>,
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

impl H {
    /// A Router with engine nodes 1.. of `roles`, all heard at epoch 1.
    fn new(roles: &[Role]) -> H {
        H::with(roles, |_| {})
    }

    fn with(roles: &[Role], f: impl Fn(&mut RouterOptions)) -> H {
        let mut opts = RouterOptions {
            workers: roles
                .iter()
                .enumerate()
                .map(|(i, r)| (i as u32 + 1, format!("{r}-{}", i + 1), *r))
                .collect(),
            heartbeat_interval: HB,
            down_after: DOWN,
            block_size: 4,
            tenant_salts: vec![0],
            reruns_max: 2,
            moves_max: 3,
            prefix_blocks_max: 100,
            forget_after: Duration::from_secs(10),
        };
        f(&mut opts);
        let mut h = H {
            core: RouterCore::new(opts, Duration::ZERO),
            now: Duration::ZERO,
            unreachable: Vec::new(),
            dtypes: Vec::new(),
        };
        for n in 1..=roles.len() as u32 {
            h.heartbeat(n, 1);
        }
        h
    }

    fn input(&mut self, i: RouterInput) -> Vec<RouterOutput> {
        let mut out = Vec::new();
        let reach = Reach::except(self.unreachable.iter().copied());
        self.core.handle(self.now, i, &reach, &mut out);
        self.core.check_invariants().unwrap();
        out
    }

    fn msg(&mut self, from: u32, epoch: u64, msg: Message) -> Vec<RouterOutput> {
        self.input(RouterInput::Message { from, epoch, msg })
    }

    fn heartbeat(&mut self, node: u32, epoch: u64) -> Vec<RouterOutput> {
        let dtype = self
            .dtypes
            .get(node as usize - 1)
            .copied()
            .unwrap_or_default();
        let status = EngineStatus {
            ready: true,
            kv: KvUsage {
                total: 1000,
                free: 1000,
                dtype,
                ..KvUsage::default()
            },
            ..EngineStatus::default()
        };
        self.msg(node, epoch, Message::Heartbeat(status))
    }

    /// Moves the clock to `t`, ticking at every deadline on the way, and
    /// returns everything the ticks put out.
    fn run_to(&mut self, t: Duration) -> Vec<RouterOutput> {
        let mut all = Vec::new();
        loop {
            let d = self.core.next_deadline();
            if d > t {
                break;
            }
            self.now = self.now.max(d);
            all.extend(self.input(RouterInput::Tick));
        }
        self.now = t;
        all
    }

    /// Runs the clock to `t` in heartbeat steps, with `alive` nodes
    /// sending theirs at each.
    fn live_until(&mut self, t: Duration, alive: &[u32]) -> Vec<RouterOutput> {
        let mut out = Vec::new();
        let mut at = self.now;
        while at < t {
            at = (at + HB).min(t);
            out.extend(self.run_to(at));
            for &n in alive {
                self.heartbeat(n, 1);
            }
        }
        out
    }

    fn submit(&mut self, id: u64, prompt_len: u32, max_tokens: u32) -> Vec<RouterOutput> {
        let req = EngineRequest {
            tenant: TenantId(0),
            prompt: (0..prompt_len)
                .map(|i| 100 + i + 1000 * id as u32)
                .collect(),
            max_tokens,
            sampling: SamplingParams::greedy(),
            logit_bias: Vec::new(),
            generated: 0,
            constraint: None,
            ignore_eos: false,
            stop_token_ids: vec![],
            speculative: true,
            trace: None,
        };
        self.input(RouterInput::Submit { id, req })
    }
}

fn tok(t: u32) -> EngineEvent {
    EngineEvent::Token(Sampled {
        token: t,
        logprob: f32::NAN,
        top: vec![],
    })
}

fn finished(n: u32) -> EngineEvent {
    EngineEvent::Finished {
        reason: FinishReason::Length,
        usage: Usage {
            prompt_tokens: 4,
            completion_tokens: n,
            cached_tokens: 0,
        },
    }
}

fn batch(req: u64, attempt: u32, first: u32, events: Vec<EngineEvent>) -> Message {
    Message::Events(vec![ReqEvents {
        req,
        attempt,
        first,
        events,
    }])
}

/// Every Submit in `out`: (node, message).
fn submit_msgs(out: &[RouterOutput]) -> Vec<(u32, Submit)> {
    out.iter()
        .filter_map(|o| match o {
            RouterOutput::Send {
                to,
                msg: Message::Submit(s),
                ..
            } => Some((*to, s.clone())),
            _ => None,
        })
        .collect()
}

/// Every Submit in `out`: (node, request, attempt).
fn submits(out: &[RouterOutput]) -> Vec<(u32, u64, u32)> {
    submit_msgs(out)
        .into_iter()
        .map(|(n, s)| (n, s.req, s.attempt))
        .collect()
}

/// Every Cancel in `out`: (node, request, attempt).
fn cancels(out: &[RouterOutput]) -> Vec<(u32, u64, u32)> {
    out.iter()
        .filter_map(|o| match o {
            RouterOutput::Send {
                to,
                msg: Message::Cancel { req, attempt, .. },
                ..
            } => Some((*to, *req, *attempt)),
            _ => None,
        })
        .collect()
}

/// The tokens and end delivered to client `id`.
fn delivered(out: &[RouterOutput], id: u64) -> (Vec<u32>, Option<EngineEvent>) {
    let mut toks = Vec::new();
    let mut end = None;
    for o in out {
        if let RouterOutput::Events { id: i, events } = o
            && *i == id
        {
            for e in events {
                match e {
                    EngineEvent::Token(s) => toks.push(s.token),
                    e => end = Some(e.clone()),
                }
            }
        }
    }
    (toks, end)
}

fn admitted(out: &[RouterOutput], id: u64) -> Option<Result<(), Rejection>> {
    out.iter().find_map(|o| match o {
        RouterOutput::Admitted { id: i, result } if *i == id => Some(result.clone()),
        _ => None,
    })
}

#[test]
fn a_request_is_placed_admitted_streamed_and_forgotten() {
    let mut h = H::new(&[Role::Worker]);
    let out = h.submit(1, 8, 3);
    assert_eq!(submits(&out), [(1, 1, 0)]);
    assert_eq!(admitted(&out, 1), None, "answered before the node did");
    let out = h.msg(1, 1, Message::Admitted { req: 1 });
    assert_eq!(admitted(&out, 1), Some(Ok(())));
    let out = h.msg(1, 1, batch(1, 0, 0, vec![tok(5), tok(6)]));
    assert_eq!(delivered(&out, 1), (vec![5, 6], None));
    let out = h.msg(1, 1, batch(1, 0, 2, vec![tok(7), finished(3)]));
    assert_eq!(delivered(&out, 1), (vec![7], Some(finished(3))));
    assert_eq!(h.core.in_flight(), 0);
    assert_eq!(h.core.status().nodes[0].in_flight, 0);
}

#[test]
fn duplicates_are_dropped_and_early_batches_wait_for_the_gap() {
    let mut h = H::new(&[Role::Worker]);
    h.submit(1, 8, 6);
    h.msg(1, 1, Message::Admitted { req: 1 });
    // Tokens 2..4 overtake 0..2.
    let out = h.msg(1, 1, batch(1, 0, 2, vec![tok(12), tok(13)]));
    assert_eq!(delivered(&out, 1), (vec![], None));
    let out = h.msg(1, 1, batch(1, 0, 0, vec![tok(10), tok(11)]));
    assert_eq!(delivered(&out, 1), (vec![10, 11, 12, 13], None));
    // A resent copy of what the client has, with one new token after it.
    let out = h.msg(1, 1, batch(1, 0, 3, vec![tok(13), tok(14)]));
    assert_eq!(delivered(&out, 1), (vec![14], None));
    // A batch of another placement is not this one's: its node is told
    // to stop that placement.
    let out = h.msg(1, 1, batch(1, 7, 5, vec![tok(99)]));
    assert_eq!(delivered(&out, 1), (vec![], None));
    assert_eq!(cancels(&out), [(1, 1, 7)]);
}

#[test]
fn a_gap_that_outlasts_the_down_bound_ends_the_request() {
    let mut h = H::new(&[Role::Worker]);
    h.submit(1, 8, 6);
    h.msg(1, 1, batch(1, 0, 0, vec![tok(1)]));
    h.msg(1, 1, batch(1, 0, 3, vec![tok(4)]));
    // Heartbeats keep the node up while the gap stays open.
    let out = h.live_until(ms(300), &[1]);
    assert_eq!(delivered(&out, 1), (vec![], None), "ended within the bound");
    let out = h.live_until(ms(700), &[1]);
    let (toks, end) = delivered(&out, 1);
    assert!(toks.is_empty());
    assert!(
        matches!(&end, Some(EngineEvent::Failed(EngineFailure::Internal(m))) if m.contains("lost between nodes")),
        "{end:?}"
    );
    assert_eq!(cancels(&out), [(1, 1, 0)]);
    assert_eq!(h.core.in_flight(), 0);
}

#[test]
fn a_silent_node_is_marked_down_and_its_requests_rerun_or_move() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    // Both requests go to node 1 (node 2 cannot be reached for now).
    h.unreachable = vec![2];
    assert_eq!(submits(&h.submit(1, 8, 5)), [(1, 1, 0)]);
    assert_eq!(submits(&h.submit(2, 8, 5)), [(1, 2, 0)]);
    h.unreachable.clear();
    // Request 1 streamed a token; request 2 nothing yet.
    h.msg(1, 1, batch(1, 0, 0, vec![tok(1)]));
    let out = h.live_until(ms(300), &[1, 2]);
    assert!(cancels(&out).is_empty());
    // Node 1 goes silent.
    let out = h.live_until(ms(800), &[2]);
    let st = h.core.status();
    assert!(!st.nodes[0].up && st.nodes[0].downs == 1, "{:?}", st.nodes);
    assert!(st.nodes[1].up);
    // Both are stopped on node 1 and run on node 2 as their second
    // placement: the one that streamed nothing from its prompt, the other
    // from its prompt and the token the client has, for one token less.
    let mut c = cancels(&out);
    c.sort();
    assert_eq!(c, [(1, 1, 0), (1, 2, 0)]);
    assert_eq!(submits(&out), [(2, 1, 1), (2, 2, 1)]);
    let moved = &submit_msgs(&out)[0].1;
    let prompt: Vec<u32> = (0..8).map(|i| 100 + i + 1000).chain([1]).collect();
    assert_eq!(moved.request.prompt, prompt);
    assert_eq!(moved.request.max_tokens, 4);
    assert_eq!(delivered(&out, 1), (vec![], None), "a pause, not an error");
    assert_eq!(h.core.status().nodes[0].moved_away, 1);
    // Events of the old placement on node 1, arriving late, are not
    // applied to the new one. Node 1, heard again, is told once more to
    // stop both placements taken from it while it was silent (the Cancels
    // sent then may not have reached it, and their Submits, held on a cut
    // link, may reach it later), then the one whose events came.
    let out = h.msg(1, 1, batch(2, 0, 0, vec![tok(9)]));
    assert_eq!(delivered(&out, 2), (vec![], None));
    assert_eq!(cancels(&out), [(1, 1, 0), (1, 2, 0), (1, 2, 0)]);
    // Once: its heartbeats from now on recall nothing.
    let out = h.live_until(ms(1000), &[1, 2]);
    assert!(cancels(&out).is_empty(), "{:?}", cancels(&out));
    // The moved request's events count from 0 on its new node; the
    // client's stream goes on from token 2, and its usage counts every
    // token it was sent, against its own prompt.
    let out = h.msg(2, 1, batch(1, 1, 0, vec![tok(2), tok(3)]));
    assert_eq!(delivered(&out, 1), (vec![2, 3], None));
    let out = h.msg(
        2,
        1,
        batch(1, 1, 1, vec![tok(3), tok(4), tok(5), finished(4)]),
    );
    let (toks, end) = delivered(&out, 1);
    assert_eq!(toks, [4, 5], "the duplicate token 3 is dropped");
    match end {
        Some(EngineEvent::Finished { usage, .. }) => {
            assert_eq!((usage.prompt_tokens, usage.completion_tokens), (8, 5));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_request_moves_at_most_moves_max_times_then_fails_with_a_reason() {
    let mut h = H::with(&[Role::Worker, Role::Worker, Role::Worker], |o| {
        o.moves_max = 1
    });
    h.unreachable = vec![2, 3];
    assert_eq!(submits(&h.submit(1, 8, 5)), [(1, 1, 0)]);
    h.unreachable.clear();
    h.msg(1, 1, batch(1, 0, 0, vec![tok(1)]));
    // Node 1 goes silent: the request moves, to node 2 or 3.
    let out = h.live_until(ms(800), &[2, 3]);
    let (to, s) = submit_msgs(&out).remove(0);
    assert_eq!((s.attempt, s.request.max_tokens), (1, 4));
    h.msg(to, 1, batch(1, 1, 0, vec![tok(2)]));
    // Its new node goes silent too: the one move allowed is spent.
    let alive: Vec<u32> = [2, 3].into_iter().filter(|&n| n != to).collect();
    let out = h.live_until(ms(1600), &alive);
    assert!(submit_msgs(&out).is_empty());
    match delivered(&out, 1) {
        (t, Some(EngineEvent::Failed(EngineFailure::Internal(m)))) => {
            assert!(t.is_empty());
            assert!(
                m.contains("after 2 tokens") && m.contains("moved 1 times"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_node_that_rejoins_with_a_new_epoch_loses_its_old_requests() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    h.unreachable = vec![2];
    assert_eq!(submits(&h.submit(1, 8, 5)), [(1, 1, 0)]);
    h.unreachable.clear();
    let out = h.heartbeat(1, 2);
    assert!(out.contains(&RouterOutput::Reconnect(1)));
    assert_eq!(cancels(&out), [(1, 1, 0)]);
    // Nothing streamed yet: it runs again, elsewhere.
    assert_eq!(submits(&out), [(2, 1, 1)]);
    assert_eq!(h.core.status().nodes[0].epoch, 2);
}

#[test]
fn a_send_the_transport_refuses_goes_to_another_node_then_is_refused() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    let out = h.submit(1, 8, 5);
    let (to, s) = submit_msgs(&out).remove(0);
    let msg = Message::Submit(s);
    let out = h.input(RouterInput::Undelivered {
        to,
        msg: msg.clone(),
    });
    let (again, s2) = submit_msgs(&out).remove(0);
    assert_ne!(again, to, "tried the same node again");
    assert_eq!(admitted(&out, 1), None);
    // The other node refuses it too, then the first again: the client
    // hears it rather than waiting.
    let out = h.input(RouterInput::Undelivered {
        to: again,
        msg: Message::Submit(s2),
    });
    let (third, s3) = submit_msgs(&out).remove(0);
    let out = h.input(RouterInput::Undelivered {
        to: third,
        msg: Message::Submit(s3),
    });
    assert_eq!(admitted(&out, 1), Some(Err(Rejection::Unavailable)));
    assert_eq!(h.core.in_flight(), 0);
    // A refused message of a placement that is over changes nothing.
    let out = h.input(RouterInput::Undelivered { to, msg });
    assert!(out.is_empty());
}

#[test]
fn a_client_never_answered_is_refused_at_its_deadline() {
    let mut h = H::new(&[Role::Worker]);
    h.submit(1, 8, 5);
    // The node stays up but never answers the submit.
    let out = h.live_until(ms(6000), &[1]);
    assert_eq!(admitted(&out, 1), None);
    let out = h.live_until(ms(7000), &[1]);
    assert_eq!(admitted(&out, 1), Some(Err(Rejection::Unavailable)));
    assert_eq!(cancels(&out), [(1, 1, 0)]);
    assert_eq!(h.core.in_flight(), 0);
}

#[test]
fn heartbeats_go_out_every_interval_and_no_node_up_is_a_refusal() {
    let mut h = H::new(&[Role::Worker, Role::Prefill]);
    let out = h.run_to(ms(1000));
    let beats = out
        .iter()
        .filter(|o| {
            matches!(
                o,
                RouterOutput::Send {
                    msg: Message::Heartbeat(_),
                    ..
                }
            )
        })
        .count();
    // Two nodes, one at start and one per interval after.
    assert_eq!(beats, 2 * 11);
    // Both silent since 0: down, so a request has nowhere to go.
    assert!(h.core.up_nodes().is_empty());
    let out = h.submit(1, 4, 1);
    assert_eq!(admitted(&out, 1), Some(Err(Rejection::Unavailable)));
    assert_eq!(h.core.in_flight(), 0);
}

#[test]
fn a_failed_transfer_reruns_colocated_and_a_lost_decode_node_frees_its_prefill() {
    let mut h = H::new(&[Role::Prefill, Role::Decode, Role::Decode]);
    let (decode, s) = submit_msgs(&h.submit(1, 8, 5)).remove(0);
    assert_eq!(s.prefill, Some(1), "paired with the prefill node");
    h.msg(decode, 1, Message::Admitted { req: 1 });
    let fail = EngineEvent::Failed(EngineFailure::KvTransfer("checksum".into()));
    let out = h.msg(decode, 1, batch(1, 0, 0, vec![fail]));
    let (_, again) = submit_msgs(&out).remove(0);
    assert_eq!(
        again.prefill, None,
        "a re-run after a failed transfer is colocated"
    );
    assert_eq!(again.attempt, 1);
    assert_eq!(delivered(&out, 1), (vec![], None), "the client saw nothing");
    // The second request streams from its decode node, which then dies:
    // its prefill node is told to drop what it holds for it.
    let (d2, s2) = submit_msgs(&h.submit(2, 8, 5)).remove(0);
    assert_eq!(s2.prefill, Some(1));
    h.msg(d2, 1, batch(2, 0, 0, vec![tok(1)]));
    let alive: Vec<u32> = [1, 2, 3].into_iter().filter(|&n| n != d2).collect();
    let out = h.live_until(ms(700), &alive);
    let abandons: Vec<(u32, u32, u64)> = out
        .iter()
        .filter_map(|o| match o {
            RouterOutput::Send {
                to,
                msg: Message::PrefillAbandon { decode, req, .. },
                ..
            } => Some((*to, *decode, *req)),
            _ => None,
        })
        .collect();
    assert!(abandons.contains(&(1, d2, 2)), "{abandons:?}");
    // The request itself moves on, paired with the prefill node again,
    // which computes the prompt and the token the client has.
    assert_eq!(delivered(&out, 2), (vec![], None));
    let (to, moved) = submit_msgs(&out).remove(0);
    assert!(to != d2 && moved.prefill == Some(1), "{to} {moved:?}");
    assert_eq!(
        (
            moved.attempt,
            moved.request.prompt.len(),
            moved.request.max_tokens
        ),
        (1, 9, 4)
    );
}

#[test]
fn a_draining_node_gets_no_new_work_and_what_it_runs_moves_when_it_leaves() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    h.unreachable = vec![2];
    assert_eq!(submits(&h.submit(1, 8, 5)), [(1, 1, 0)]);
    h.unreachable.clear();
    h.msg(1, 1, batch(1, 0, 0, vec![tok(1)]));
    // Node 1 drains: a request that comes now goes to node 2 even though
    // node 1 would be the cheaper pick by load.
    let draining = EngineStatus {
        ready: true,
        draining: true,
        kv: KvUsage {
            total: 1000,
            free: 1000,
            ..KvUsage::default()
        },
        ..EngineStatus::default()
    };
    h.msg(1, 1, Message::Heartbeat(draining.clone()));
    h.heartbeat(2, 1);
    assert_eq!(submits(&h.submit(2, 8, 5)), [(2, 2, 0)]);
    // With the other node out of reach nothing is placed on the draining
    // one: the client is told at once.
    h.unreachable = vec![2];
    let out = h.submit(3, 8, 5);
    h.unreachable.clear();
    assert!(submits(&out).is_empty(), "placed on a draining node");
    assert_eq!(admitted(&out, 3), Some(Err(Rejection::Unavailable)));
    h.heartbeat(2, 1);
    // Node 1 leaves with request 1 still running: it moves at once, from
    // the token its client has; no down bound waited for, no down counted.
    // It continues from node 1's KV (node 1 stops it when asked for it,
    // so no cancel goes there).
    let out = h.msg(1, 1, Message::Leaving);
    assert_eq!(submits(&out), [(2, 1, 1)]);
    let (_, s) = &submit_msgs(&out)[0];
    assert_eq!((s.kv_move, s.prefill), (true, Some(1)));
    assert_eq!(s.request.prompt.len(), 9, "the prompt and the token sent");
    assert_eq!(s.request.prompt[8], 1);
    assert_eq!(s.request.max_tokens, 4);
    assert!(cancels(&out).is_empty(), "{:?}", cancels(&out));
    assert_eq!(delivered(&out, 1), (vec![], None), "a pause, not an error");
    let st = h.core.status();
    assert!(!st.nodes[0].up, "{:?}", st.nodes);
    assert_eq!((st.nodes[0].downs, st.nodes[0].moved_away), (0, 1));
    let out = h.msg(2, 1, batch(1, 1, 0, vec![tok(2)]));
    assert_eq!(delivered(&out, 1), (vec![2], None));
    assert_eq!(h.core.status().nodes[0].moved_by_kv, 1);
    // Its last words (same life) do not bring it back.
    h.msg(1, 1, Message::Heartbeat(draining));
    assert!(!h.core.status().nodes[0].up);
    let out = h.submit(4, 8, 5);
    assert_eq!(submits(&out), [(2, 4, 0)]);
    // A new life is a node again.
    h.heartbeat(1, 2);
    assert!(h.core.status().nodes[0].up);
}

#[test]
fn a_refusal_as_unavailable_is_placed_elsewhere() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    h.unreachable = vec![2];
    assert_eq!(submits(&h.submit(1, 8, 5)), [(1, 1, 0)]);
    h.unreachable.clear();
    let out = h.msg(
        1,
        1,
        Message::Refused {
            req: 1,
            rejection: Rejection::Unavailable,
        },
    );
    assert_eq!(submits(&out), [(2, 1, 1)]);
    assert_eq!(admitted(&out, 1), None, "the client waits, not refused");
}

#[test]
fn a_move_whose_kv_does_not_come_reruns_whole_and_stops_it_where_it_was() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    h.unreachable = vec![2];
    assert_eq!(submits(&h.submit(1, 8, 5)), [(1, 1, 0)]);
    h.unreachable.clear();
    h.msg(1, 1, batch(1, 0, 0, vec![tok(1), tok(2)]));
    let out = h.msg(1, 1, Message::Leaving);
    assert_eq!(submits(&out), [(2, 1, 1)]);
    // Node 1 could not give its KV: node 2 says so before any token.
    let failed = EngineEvent::Failed(EngineFailure::KvTransfer("gone".into()));
    let out = h.msg(2, 1, batch(1, 1, 0, vec![failed]));
    assert_eq!(cancels(&out), [(1, 1, 1)], "stopped where it ran");
    let subs = submit_msgs(&out);
    assert_eq!(subs.len(), 1);
    let (to, s) = &subs[0];
    assert_eq!((*to, s.attempt, s.kv_move, s.prefill), (2, 2, false, None));
    assert_eq!(
        s.request.prompt.len(),
        10,
        "computed whole, with both tokens"
    );
    assert_eq!(delivered(&out, 1), (vec![], None));
    let out = h.msg(
        2,
        1,
        batch(1, 2, 0, vec![tok(3), tok(4), tok(5), finished(3)]),
    );
    assert_eq!(delivered(&out, 1).0, vec![3, 4, 5]);
    let st = h.core.status();
    assert_eq!((st.nodes[0].moved_away, st.nodes[0].moved_by_kv), (1, 0));
}

#[test]
fn an_operator_s_drain_goes_to_an_up_node_by_name() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    assert!(matches!(
        h.core.drain_target("worker-7"),
        Err(DrainRefusal::UnknownNode { .. })
    ));
    assert_eq!(h.core.drain_target("worker-2"), Ok(1));
    let out = h.input(RouterInput::Drain {
        node: "worker-2".into(),
        grace: ms(2_500),
    });
    assert_eq!(
        out,
        vec![RouterOutput::Send {
            to: 2,
            correlation: 0,
            msg: Message::Drain { grace_ms: 2_500 }
        }]
    );
    // Node 2 falls silent: down, and no drain is asked of it.
    h.live_until(ms(1_000), &[1]);
    assert_eq!(
        h.core.drain_target("worker-2"),
        Err(DrainRefusal::NotUp("worker-2".into()))
    );
    let out = h.input(RouterInput::Drain {
        node: "worker-2".into(),
        grace: ms(0),
    });
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn a_stream_whose_node_is_lost_with_no_other_up_waits_for_one() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    h.unreachable = vec![2];
    assert_eq!(submits(&h.submit(1, 8, 6)), [(1, 1, 0)]);
    assert_eq!(submits(&h.submit(2, 8, 6)), [(1, 2, 0)]);
    h.msg(1, 1, batch(1, 0, 0, vec![tok(1), tok(2)]));
    h.msg(1, 1, batch(2, 0, 0, vec![tok(1)]));
    // Both nodes fall silent: nothing can take the streams, and they wait
    // instead of failing.
    let out = h.live_until(ms(600), &[]);
    assert!(submits(&out).is_empty());
    assert_eq!(delivered(&out, 1), (vec![], None));
    assert_eq!(h.core.in_flight(), 2);
    // The client of request 2 leaves while it waits.
    h.input(RouterInput::ClientGone {
        id: 2,
        stop_string: false,
    });
    assert_eq!(h.core.in_flight(), 1);
    // Node 2 comes up: request 1 moves there from the tokens its client has.
    h.unreachable.clear();
    h.heartbeat(2, 1);
    let out = h.live_until(ms(700), &[2]);
    let subs = submit_msgs(&out);
    assert_eq!(subs.len(), 1, "{out:?}");
    let (to, s) = &subs[0];
    assert_eq!((*to, s.req, s.request.prompt.len()), (2, 1, 10));
    let out = h.msg(
        2,
        1,
        batch(
            1,
            s.attempt,
            0,
            vec![tok(3), tok(4), tok(5), tok(6), finished(4)],
        ),
    );
    assert_eq!(delivered(&out, 1).0, vec![3, 4, 5, 6]);
    assert_eq!(h.core.in_flight(), 0);
}

#[test]
fn a_stream_that_waits_too_long_for_a_node_fails_with_the_reason() {
    let mut h = H::new(&[Role::Worker]);
    assert_eq!(submits(&h.submit(1, 8, 6)), [(1, 1, 0)]);
    h.msg(1, 1, batch(1, 0, 0, vec![tok(1)]));
    let out = h.live_until(ms(600), &[]);
    assert_eq!(delivered(&out, 1), (vec![], None), "it waits");
    let out = h.live_until(ms(600) + DOWN * 3 + ms(5_000), &[]);
    match delivered(&out, 1) {
        (t, Some(EngineEvent::Failed(f))) if t.is_empty() => {
            let why = f.to_string();
            assert!(why.contains("none could within"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(h.core.in_flight(), 0);
}

/// KV moves only between nodes whose blocks have one element type: a
/// decode node is paired with a prefill node of its dtype, one with no such
/// prefill node computes the prompt itself, and a drained node's requests
/// move with their KV only to a node of its dtype (else by recomputing).
#[test]
fn kv_moves_only_between_nodes_of_one_kv_dtype() {
    // 1: prefill f16, 2: prefill int8, 3: decode int8, 4: decode f32.
    let mut h = H::new(&[Role::Prefill, Role::Prefill, Role::Decode, Role::Decode]);
    h.dtypes = vec![KvDtype::F16, KvDtype::Int8, KvDtype::Int8, KvDtype::F32];
    for n in 1..=4 {
        h.heartbeat(n, 1);
    }
    let mut pairs = Vec::new();
    for id in 1..=4 {
        let (to, s) = submit_msgs(&h.submit(id, 8, 5)).remove(0);
        pairs.push((to, s.prefill));
    }
    assert!(
        pairs.contains(&(3, Some(2))),
        "int8 decode with the int8 prefill: {pairs:?}"
    );
    assert!(
        pairs.contains(&(4, None)),
        "the f32 decode node runs whole: {pairs:?}"
    );
    assert!(
        !pairs.iter().any(|&(_, p)| p == Some(1)),
        "the f16 prefill node pairs with no one: {pairs:?}"
    );

    // Workers: 1 int8 drains; 2 is f16, 3 int8: the move with KV goes to 3.
    let mut h = H::new(&[Role::Worker, Role::Worker, Role::Worker]);
    h.dtypes = vec![KvDtype::Int8, KvDtype::F16, KvDtype::Int8];
    for n in 1..=3 {
        h.heartbeat(n, 1);
    }
    h.unreachable = vec![2, 3];
    assert_eq!(submits(&h.submit(1, 8, 5)), [(1, 1, 0)]);
    h.unreachable.clear();
    h.msg(1, 1, Message::Admitted { req: 1 });
    h.msg(1, 1, batch(1, 0, 0, vec![tok(7)]));
    let out = h.msg(1, 1, Message::Leaving);
    let (to, moved) = submit_msgs(&out).remove(0);
    assert_eq!(
        (to, moved.kv_move, moved.prefill),
        (3, true, Some(1)),
        "{moved:?}"
    );
    // With only an f16 node left, the move recomputes.
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    h.dtypes = vec![KvDtype::Int8, KvDtype::F16];
    for n in 1..=2 {
        h.heartbeat(n, 1);
    }
    h.unreachable = vec![2];
    assert_eq!(submits(&h.submit(1, 8, 5)), [(1, 1, 0)]);
    h.unreachable.clear();
    h.msg(1, 1, Message::Admitted { req: 1 });
    h.msg(1, 1, batch(1, 0, 0, vec![tok(7)]));
    let out = h.msg(1, 1, Message::Leaving);
    let (to, moved) = submit_msgs(&out).remove(0);
    assert_eq!(
        (to, moved.kv_move, moved.prefill),
        (2, false, None),
        "{moved:?}"
    );
}

/// Issue 21's 503 burst: with two decode nodes, one that has no blocks to
/// reserve for a paired request sends it to the other; once the other is
/// dead, the last decode node short of blocks must still take the request
/// (whole, queued in its engine until blocks free up), not have the Router
/// answer 503 while it is up.
#[test]
fn the_last_decode_node_short_of_blocks_runs_it_whole_not_a_503() {
    // Both decode nodes up: a refused reservation goes to the other one,
    // still paired with the prefill node.
    let mut h = H::new(&[Role::Prefill, Role::Decode, Role::Decode]);
    let (first, s) = submit_msgs(&h.submit(6, 8, 5)).remove(0);
    assert_eq!((s.prefill, s.attempt), (Some(1), 0));
    let refused = Message::Refused {
        req: 6,
        rejection: Rejection::Unavailable,
    };
    let out = h.msg(first, 1, refused);
    let other = if first == 2 { 3 } else { 2 };
    let (to, again) = submit_msgs(&out).remove(0);
    assert_eq!((to, again.prefill, again.attempt), (other, Some(1), 1));
    assert_eq!(admitted(&out, 6), None);

    // Node 2 killed: silent past the down bound, marked down.
    let mut h = H::new(&[Role::Prefill, Role::Decode, Role::Decode]);
    h.live_until(DOWN + ms(200), &[1, 3]);
    assert_eq!(h.core.up_nodes(), ["prefill-1", "decode-3"]);
    let (to, s) = submit_msgs(&h.submit(7, 8, 5)).remove(0);
    assert_eq!((to, s.prefill, s.attempt), (3, Some(1), 0));
    let refused = Message::Refused {
        req: 7,
        rejection: Rejection::Unavailable,
    };
    let out = h.msg(3, 1, refused);
    assert_eq!(
        admitted(&out, 7),
        None,
        "no 503 while the last decode node can queue it whole"
    );
    let (to, whole) = submit_msgs(&out).remove(0);
    assert_eq!((to, whole.prefill, whole.attempt), (3, None, 1));
    let out = h.msg(3, 1, Message::Admitted { req: 7 });
    assert_eq!(admitted(&out, 7), Some(Ok(())));
    let st = h.core.status();
    let short: Vec<u64> = st.nodes.iter().map(|n| n.kv_short).collect();
    assert_eq!(short, [0, 0, 1], "counted where it was short");
}

/// Every PrefixResync in `out`, by node.
fn resyncs(out: &[RouterOutput]) -> Vec<u32> {
    out.iter()
        .filter_map(|o| match o {
            RouterOutput::Send {
                to,
                msg: Message::PrefixResync,
                ..
            } => Some(*to),
            _ => None,
        })
        .collect()
}

fn prefix(seq: u64, full: bool, stored: &[u64], removed: &[u64]) -> Message {
    Message::Prefix {
        seq,
        changes: flotilla_proto::PrefixChanges {
            full,
            stored: stored.to_vec(),
            removed: removed.to_vec(),
        },
    }
}

/// The index follows each node's prefix reports: the whole replaces,
/// changes apply in order, a gap asks for the whole (once a heartbeat),
/// a restart forgets; placements count whether a cache candidate existed.
#[test]
fn the_prefix_index_follows_each_node_s_reports() {
    let mut h = H::new(&[Role::Worker, Role::Worker]);
    // Request 7's prompt, as `submit` makes it: 3 full blocks of 4.
    let prompt: Vec<u32> = (0..12).map(|i| 100 + i + 7000).collect();
    let hashes = crate::prefix::block_hashes(&prompt, 4, 0);
    assert_eq!(hashes.len(), 3);
    // Node 2 holds it (another Router placed it there, or it ran before
    // this Router started): only its report says so.
    h.msg(2, 1, prefix(1, true, &hashes, &[]));
    let out = h.submit(7, 12, 4);
    assert_eq!(submits(&out), [(2, 7, 0)], "placed where its prefix is");
    let r = h.core.status().routing;
    assert_eq!(
        (
            r.placements,
            r.cache_candidate,
            r.prompt_blocks,
            r.matched_blocks
        ),
        (1, 1, 3, 3)
    );
    assert_eq!(r.prefix_snapshots, 1);
    // Node 2 drops the first block: the prefix is gone there.
    h.msg(2, 1, prefix(2, false, &[], &hashes[..1]));
    // A gap: seq 3 never came. Not applied, the whole asked for once.
    let out = h.msg(2, 1, prefix(4, false, &hashes[..1], &[]));
    assert_eq!(resyncs(&out), [2]);
    let out = h.msg(2, 1, prefix(5, false, &hashes[..1], &[]));
    assert!(resyncs(&out).is_empty(), "asked once a heartbeat at most");
    h.run_to(h.now + HB);
    let out = h.msg(2, 1, prefix(6, false, &[], &[]));
    assert_eq!(resyncs(&out), [2], "asked again a heartbeat later");
    // Request 8 (another prompt): no node holds any of it.
    h.submit(8, 12, 4);
    let r = h.core.status().routing;
    assert_eq!((r.placements, r.cache_candidate), (2, 1));
    // The whole comes: applied, and followed from its number.
    let p9: Vec<u32> = (0..12).map(|i| 100 + i + 9000).collect();
    let h9 = crate::prefix::block_hashes(&p9, 4, 0);
    h.msg(1, 1, prefix(1, true, &h9[..2], &[]));
    h.msg(1, 1, prefix(2, false, &h9[2..], &[]));
    let out = h.submit(9, 12, 4);
    assert_eq!(submits(&out), [(1, 9, 0)]);
    let r = h.core.status().routing;
    assert_eq!(
        (r.placements, r.cache_candidate, r.matched_blocks),
        (3, 2, 6)
    );
    // Node 1 restarts: its record is gone (the new life reports afresh).
    h.heartbeat(1, 2);
    h.submit(10, 0, 4);
    let p11 =
        crate::prefix::block_hashes(&(0..12).map(|i| 100 + i + 11000).collect::<Vec<_>>(), 4, 0);
    assert_eq!(p11.len(), 3);
    let out = h.msg(1, 2, prefix(1, false, &p11, &[]));
    assert_eq!(resyncs(&out), [1], "changes before the whole are a gap");
    h.submit(11, 12, 4);
    let r = h.core.status().routing;
    assert_eq!(
        (r.placements, r.cache_candidate),
        (4, 2),
        "an empty prompt is no placement to count; 11 had no candidate"
    );
}

/// A node up for two heartbeats that never reported its prefix cache (the
/// report was lost) is asked for it, once per two heartbeats.
#[test]
fn a_node_with_no_prefix_report_is_asked_for_one() {
    let mut h = H::new(&[Role::Worker]);
    // When each ask goes out, heartbeat by heartbeat.
    let mut asked = Vec::new();
    for k in 1..=8u32 {
        let out = h.live_until(HB * k, &[1]);
        asked.extend(resyncs(&out).into_iter().map(|_| k));
    }
    assert!(
        asked.first().is_some_and(|&k| k >= 2),
        "a grace of two heartbeats: asked at {asked:?}"
    );
    assert!(
        asked.windows(2).all(|w| w[1] - w[0] >= 2) && asked.len() >= 2,
        "asked again, never every heartbeat: {asked:?}"
    );
    // Once the whole came, nothing is asked.
    h.msg(1, 1, prefix(1, true, &[], &[]));
    let out = h.live_until(HB * 12, &[1]);
    assert!(resyncs(&out).is_empty());
}

fn join(h: &mut H, name: &str, role: Role) -> (u32, Vec<RouterOutput>) {
    let node = flotilla_proto::joined_node_id(name);
    let out = h.input(RouterInput::Joined(JoinedPeer {
        node,
        name: name.into(),
        role,
        addr: "10.0.0.9:7400".into(),
    }));
    (node, out)
}

/// A node not in the config is known from its connection, placed on from
/// its first heartbeat, and forgotten once it has been silent for
/// `forget_after` with nothing in flight there; it may come back.
#[test]
fn a_joined_node_takes_work_from_its_first_heartbeat_and_is_forgotten_after_its_silence() {
    let mut h = H::new(&[Role::Worker]);
    let (j, out) = join(&mut h, "worker-9", Role::Worker);
    assert!(out.is_empty(), "{out:?}");
    // Known, not up: nothing goes there before it is heard.
    let names: Vec<String> = h
        .core
        .status()
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    assert_eq!(names, ["worker-1", "worker-9"]);
    for id in 1..=4 {
        assert_eq!(submits(&h.submit(id, 8, 4))[0].0, 1);
    }
    h.heartbeat(j, 7);
    assert_eq!(h.core.up_nodes(), ["worker-1", "worker-9"]);
    // Now the idle joiner gets the next request (worker-1 holds four).
    let (to, _, _) = submits(&h.submit(5, 8, 4))[0];
    assert_eq!(to, j);
    h.msg(j, 7, Message::Admitted { req: 5 });
    h.msg(j, 7, batch(5, 0, 0, vec![tok(1), finished(1)]));

    // It goes quiet: down after the bound, forgotten after forget_after
    // (10 s here), and not before.
    let out = h.live_until(secs(5), &[1]);
    assert!(!out.iter().any(|o| matches!(o, RouterOutput::Forget(_))));
    assert_eq!(h.core.up_nodes(), ["worker-1"]);
    let out = h.live_until(secs(12), &[1]);
    let forgot: Vec<_> = out
        .iter()
        .filter(|o| matches!(o, RouterOutput::Forget(n) if *n == j))
        .collect();
    assert_eq!(forgot.len(), 1, "forgotten once");
    let names: Vec<String> = h
        .core
        .status()
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    assert_eq!(names, ["worker-1"]);
    assert!(h.core.drain_target("worker-9").is_err());
    assert!(h.core.nodes().all(|n| n != j));
    // Its late words change nothing; heartbeats no longer go to it.
    assert!(h.heartbeat(j, 7).is_empty());
    let out = h.live_until(secs(14), &[1]);
    assert!(
        !out.iter()
            .any(|o| matches!(o, RouterOutput::Send { to, .. } if *to == j))
    );
    // It joins again (a new connection) and works as before.
    join(&mut h, "worker-9", Role::Worker);
    h.heartbeat(j, 8);
    assert_eq!(h.core.up_nodes(), ["worker-1", "worker-9"]);
    // A config node is never forgotten, however long it is silent.
    let out = h.live_until(secs(40), &[j]);
    assert!(!out.iter().any(|o| matches!(o, RouterOutput::Forget(1))));
    assert!(h.core.status().nodes.iter().any(|n| n.name == "worker-1"));
}

/// A node told to take a request's KV from a joined node (P/D here) hears
/// where that node is first: it knows only the config's nodes.
#[test]
fn a_node_told_to_reach_a_joined_node_hears_its_address_first() {
    let mut h = H::new(&[Role::Decode]);
    let (p, _) = join(&mut h, "prefill-9", Role::Prefill);
    h.heartbeat(p, 3);
    let out = h.submit(1, 8, 4);
    let sent: Vec<(u32, &Message)> = out
        .iter()
        .filter_map(|o| match o {
            RouterOutput::Send { to, msg, .. } => Some((*to, msg)),
            _ => None,
        })
        .collect();
    let peer = sent
        .iter()
        .position(|(to, m)| *to == 1 && matches!(m, Message::Peer(jp) if jp.node == p && jp.name == "prefill-9" && jp.addr == "10.0.0.9:7400"))
        .expect("the decode node hears where the prefill node is");
    let submit = sent
        .iter()
        .position(|(to, m)| *to == 1 && matches!(m, Message::Submit(s) if s.prefill == Some(p)))
        .expect("paired with the joined prefill node");
    assert!(peer < submit, "{sent:?}");
    // A pairing with a config node needs no word.
    let mut h = H::new(&[Role::Prefill, Role::Decode]);
    let out = h.submit(1, 8, 4);
    assert!(!out.iter().any(|o| matches!(
        o,
        RouterOutput::Send {
            msg: Message::Peer(_),
            ..
        }
    )));
}

fn secs(v: u64) -> Duration {
    Duration::from_secs(v)
}
