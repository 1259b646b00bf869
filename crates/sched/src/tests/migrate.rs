//! Held, reserved and imported KV: the engine halves of disaggregated
//! prefill and decode, checked against the harness's model of the cache.

use std::time::Duration;

use flotilla_proto::{
    EngineFailure, EngineRequest, FinishReason, Rejection, RequestId, Sampled, TenantId,
};

use super::{End, Sim, tok};
use crate::config::tests::two_tiers;

const HOLD: Duration = Duration::from_secs(5);
const TTL: Duration = Duration::from_secs(3);

impl Sim {
    /// Submits a request whose blocks stay held once it finishes.
    fn submit_held(&mut self, req: EngineRequest) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.s
            .submit_held(self.now, id, req.clone(), HOLD)
            .expect("admitted");
        self.track(id, &req);
        self.check();
        id
    }

    /// The KV-slot contents of `blocks` (what `read_block` would export).
    fn read_blocks(&mut self, blocks: &[u32]) -> Vec<u64> {
        self.perform_moves();
        blocks
            .iter()
            .flat_map(|&b| {
                let s = b as usize * self.bs;
                self.kv[s..s + self.bs].iter().copied()
            })
            .collect()
    }

    /// Writes exported slots into `blocks` (what `write_block` does).
    fn write_blocks(&mut self, blocks: &[u32], data: &[u64]) {
        self.perform_moves();
        assert_eq!(data.len(), blocks.len() * self.bs);
        for (&b, chunk) in blocks.iter().zip(data.chunks(self.bs)) {
            let s = b as usize * self.bs;
            self.kv[s..s + self.bs].copy_from_slice(chunk);
        }
    }

    /// The decode half: writes `data` into reservation `id` and continues
    /// `req` from `first`.
    fn import(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        data: &[u64],
        first: u32,
    ) -> Result<(), Rejection> {
        let (blocks, tokens) = self.s.start_import(id).expect("reserved");
        assert_eq!(tokens, req.prompt.len());
        self.write_blocks(&blocks, data);
        self.track(id, &req);
        let first = Sampled {
            token: first,
            logprob: 0.0,
            top: Vec::new(),
        };
        let r = self.s.submit_imported(self.now, id, req, first);
        if r.is_err() {
            self.reqs.remove(&id);
        }
        self.collect();
        self.check();
        r
    }

    fn used(&mut self) -> u32 {
        self.s.kv_usage().used
    }
}

/// A prefill node's half: runs `req` with one output token and returns its
/// id, the first token, and its exported KV slots.
fn prefill(p: &mut Sim, req: EngineRequest) -> (RequestId, u32, Vec<u64>) {
    let req = EngineRequest {
        max_tokens: 1,
        ..req
    };
    let n = req.prompt.len();
    let id = p.submit_held(req);
    p.run_until_idle_but_held(100);
    let t = &p.reqs[&id];
    assert!(matches!(
        t.end,
        Some(End::Finished(FinishReason::Length, ..))
    ));
    let first = t.out[0];
    assert_eq!(first, tok(id, n));
    let (blocks, tokens) = p.s.held_kv(id).expect("held after it finished");
    assert_eq!(tokens, n);
    assert_eq!(blocks.len(), n.div_ceil(p.bs));
    (id, first, p.read_blocks(&blocks))
}

impl Sim {
    /// Steps until no request is queued or running (held blocks may remain).
    fn run_until_idle_but_held(&mut self, max_steps: usize) {
        for _ in 0..max_steps {
            if self.reqs.values().all(|t| t.end.is_some() || t.cancelled) {
                return;
            }
            self.step();
        }
        panic!("requests still live after {max_steps} steps");
    }
}

#[test]
fn held_blocks_outlive_the_request_until_released() {
    let mut p = Sim::new(two_tiers(64, 16));
    let prompt = p.unique_prompt(40);
    let (id, _, _) = prefill(&mut p, Sim::request(0, prompt, 9));
    assert_eq!(p.used(), 3, "40 tokens in blocks of 16");
    assert!(!p.s.is_idle());
    // The stream's cancel after the end must not take the held blocks.
    assert!(!p.s.cancel(p.now, id));
    assert_eq!(p.used(), 3);
    assert!(p.s.release_held(id));
    assert!(!p.s.release_held(id), "released twice");
    assert_eq!(p.s.held_kv(id), None);
    p.assert_all_done();
}

#[test]
fn held_blocks_go_back_at_their_deadline() {
    let mut p = Sim::new(two_tiers(64, 16));
    let prompt = p.unique_prompt(20);
    let (id, _, _) = prefill(&mut p, Sim::request(0, prompt, 9));
    let deadline = p.s.next_deadline().expect("the hold deadline");
    p.s.expire(deadline - Duration::from_millis(1));
    assert!(p.s.held_kv(id).is_some());
    p.s.expire(deadline);
    assert_eq!(p.s.held_kv(id), None);
    assert_eq!(p.s.counters().kv_expired, 1);
    assert_eq!(p.s.next_deadline(), None);
    p.assert_all_done();
}

#[test]
fn a_failed_or_cancelled_held_request_holds_nothing() {
    let mut p = Sim::new(two_tiers(64, 16));
    let prompt = p.unique_prompt(40);
    let id = p.submit_held(Sim::request(0, prompt, 1));
    // Cancelled while its prefill step runs.
    let plan = p.plan();
    assert!(p.cancel(id));
    p.execute(&plan);
    assert_eq!(p.s.held_kv(id), None);
    // Its step failed.
    let prompt = p.unique_prompt(40);
    let id = p.submit_held(Sim::request(0, prompt, 1));
    let plan = p.plan();
    p.s.fail_step(p.now, &plan, "the executor failed");
    p.collect();
    assert!(matches!(p.reqs[&id].end, Some(End::Failed(_))));
    assert_eq!(p.s.held_kv(id), None);
    p.assert_all_done();
}

#[test]
fn imported_kv_continues_exactly_where_the_prefill_stopped() {
    let (mut p, mut d) = (Sim::new(two_tiers(64, 16)), Sim::new(two_tiers(64, 16)));
    let prompt = p.unique_prompt(40);
    let req = Sim::request(2, prompt, 6);
    let (id, first, data) = prefill(&mut p, req.clone());
    // The decode node reserves under the same id (ids are per engine).
    d.s.reserve(d.now, id, TenantId(2), 40, TTL).unwrap();
    assert_eq!(d.used(), 3);
    d.import(id, req, &data, first).unwrap();
    assert!(p.s.release_held(id));
    p.assert_all_done();
    assert_eq!(
        d.reqs[&id].out,
        [first],
        "the first token is emitted at once"
    );
    // The first step feeds the first token back at position 40: the harness
    // checks that positions 0..40 hold this prompt's KV.
    let plan = d.step();
    assert_eq!(plan.items.len(), 1);
    assert_eq!(
        (plan.items[0].start_pos, &plan.items[0].tokens[..]),
        (40, &[first][..])
    );
    d.run_until_idle(20);
    let t = &d.reqs[&id];
    assert_eq!(t.out, (40..46).map(|p| tok(id, p)).collect::<Vec<_>>());
    assert_eq!(t.computed, 5, "the prompt is never recomputed");
    let Some(End::Finished(FinishReason::Length, usage, _)) = &t.end else {
        panic!("{:?}", t.end);
    };
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (40, 6));
    d.assert_all_done();
}

#[test]
fn an_imported_request_waits_for_a_seat_with_its_blocks() {
    let mut c = two_tiers(64, 16);
    c.max_num_seqs = 1;
    let (mut p, mut d) = (Sim::new(two_tiers(64, 16)), Sim::new(c));
    let prompt = p.unique_prompt(33);
    let req = Sim::request(0, prompt, 4);
    let (id, first, data) = prefill(&mut p, req.clone());
    // Seat taken on the decode node by a long local request.
    d.next_id = id.0 + 1;
    let busy = d.submit(1, 10, 8).unwrap();
    d.step();
    d.s.reserve(d.now, id, TenantId(0), 33, TTL).unwrap();
    d.import(id, req, &data, first).unwrap();
    let plan = d.step();
    assert!(plan.items.iter().all(|i| i.id == busy), "no seat yet");
    assert_eq!(d.used(), 1 + 3, "the parked blocks stay taken");
    d.run_until_idle(40);
    assert_eq!(
        d.reqs[&id].out,
        (33..37).map(|p| tok(id, p)).collect::<Vec<_>>()
    );
    assert_eq!(d.reqs[&id].computed, 3);
    d.assert_all_done();
}

#[test]
fn a_parked_import_cancelled_gives_its_blocks_back() {
    let mut c = two_tiers(64, 16);
    c.max_num_seqs = 1;
    let (mut p, mut d) = (Sim::new(two_tiers(64, 16)), Sim::new(c));
    let prompt = p.unique_prompt(20);
    let req = Sim::request(0, prompt, 4);
    let (id, first, data) = prefill(&mut p, req.clone());
    d.next_id = id.0 + 1;
    d.submit(1, 10, 8).unwrap();
    d.step();
    d.s.reserve(d.now, id, TenantId(0), 20, TTL).unwrap();
    d.import(id, req, &data, first).unwrap();
    assert_eq!(d.used(), 1 + 2);
    assert!(d.cancel(id));
    assert_eq!(d.used(), 1);
    d.run_until_idle(20);
    d.assert_all_done();
}

#[test]
fn a_first_token_that_stops_ends_the_import_at_once() {
    let (mut p, mut d) = (Sim::new(two_tiers(64, 16)), Sim::new(two_tiers(64, 16)));
    let prompt = p.unique_prompt(17);
    let mut req = Sim::request(0, prompt, 10);
    let (id, first, data) = prefill(&mut p, req.clone());
    req.stop_token_ids = vec![first];
    d.s.reserve(d.now, id, TenantId(0), 17, TTL).unwrap();
    d.import(id, req, &data, first).unwrap();
    assert!(matches!(
        d.reqs[&id].end,
        Some(End::Finished(FinishReason::Stop, ..))
    ));
    d.assert_all_done();
}

#[test]
fn reservations_go_back_at_their_deadline_or_on_cancel_but_not_mid_import() {
    let mut d = Sim::new(two_tiers(64, 16));
    let (a, b, c) = (RequestId(100), RequestId(101), RequestId(102));
    d.s.reserve(d.now, a, TenantId(0), 16, TTL).unwrap();
    d.s.reserve(d.now, b, TenantId(0), 17, TTL).unwrap();
    d.s.reserve(d.now + TTL, c, TenantId(1), 40, TTL).unwrap();
    assert_eq!(d.used(), 1 + 2 + 3);
    d.check();
    assert_eq!(
        d.s.reserve(d.now, a, TenantId(0), 16, TTL),
        Err(Rejection::Invalid(format!("id {a} is already in use")))
    );
    assert!(d.s.cancel_reservation(a));
    assert!(!d.s.cancel_reservation(a));
    // A transfer of the wrong size for c is refused, and c goes back.
    let used = d.used();
    let c_blocks = 3u32;
    let short = 64 * u64::from(c_blocks - 1);
    let why = d.s.start_import_sized(c, 40, short, 64).unwrap_err();
    assert!(why.contains("the reservation holds 40 tokens"), "{why}");
    assert_eq!(d.used(), used - c_blocks, "c's blocks back");
    assert!(!d.s.cancel_reservation(c), "c is gone");
    d.s.reserve(d.now + TTL, c, TenantId(1), 40, TTL).unwrap();
    // b is being written: its deadline no longer applies.
    let blocks = d.s.start_import_sized(b, 17, 64 * 2, 64).unwrap();
    assert_eq!(blocks.len(), 2);
    assert!(d.s.start_import(b).is_err(), "imported twice");
    assert!(
        d.s.start_import_sized(b, 17, 64 * 2, 64).is_err(),
        "imported twice"
    );
    assert_eq!(d.s.next_deadline(), Some(d.now + TTL + TTL));
    d.s.expire(d.now + TTL + TTL);
    assert_eq!(d.used(), 2, "c expired, b pinned");
    assert_eq!(d.s.counters().kv_expired, 1);
    let late = Sampled {
        token: 11,
        logprob: 0.0,
        top: Vec::new(),
    };
    let req = Sim::request(1, vec![5; 40], 4);
    assert!(matches!(
        d.s.submit_imported(d.now, c, req, late.clone()),
        Err(Rejection::Invalid(_))
    ));
    // An import of the wrong prompt is refused and gives its blocks back.
    let req = Sim::request(0, vec![5; 3], 4);
    assert!(matches!(
        d.s.submit_imported(d.now, b, req, late),
        Err(Rejection::Invalid(_))
    ));
    d.assert_all_done();
}

#[test]
fn a_reservation_takes_free_blocks_only() {
    let mut d = Sim::new(two_tiers(8, 16));
    let a = d.submit(0, 60, 40).unwrap();
    d.step();
    assert_eq!(d.used(), 4);
    // 5 blocks wanted, 4 free: refused without preempting anyone.
    assert_eq!(
        d.s.reserve(d.now, RequestId(50), TenantId(2), 70, TTL),
        Err(Rejection::Unavailable)
    );
    assert_eq!(d.used(), 4);
    assert_eq!(d.reqs[&a].preempted, 0);
    assert!(matches!(
        d.s.reserve(d.now, RequestId(51), TenantId(7), 10, TTL),
        Err(Rejection::Invalid(_))
    ));
    assert!(matches!(
        d.s.reserve(d.now, RequestId(52), TenantId(0), 4096, TTL),
        Err(Rejection::TooLong { .. })
    ));
    d.run_until_idle(100);
    d.assert_all_done();
}

#[test]
fn fail_all_gives_back_held_and_reserved_blocks() {
    let mut p = Sim::new(two_tiers(64, 16));
    let prompt = p.unique_prompt(40);
    let (id, _, _) = prefill(&mut p, Sim::request(0, prompt, 9));
    p.s.reserve(p.now, RequestId(90), TenantId(1), 30, TTL)
        .unwrap();
    assert_eq!(p.used(), 3 + 2);
    p.s.fail_all(p.now, EngineFailure::ShuttingDown);
    assert_eq!(p.s.held_kv(id), None);
    assert!(!p.s.cancel_reservation(RequestId(90)));
    p.assert_all_done();
}

#[test]
fn a_detached_request_continues_exactly_on_another_engine() {
    let (mut a, mut b) = (Sim::new(two_tiers(64, 16)), Sim::new(two_tiers(64, 16)));
    let prompt = a.unique_prompt(30);
    let req = Sim::request(0, prompt.clone(), 10);
    let id = a.submit_req(req.clone()).unwrap();
    // Waiting, then computing its prompt: nothing worth moving yet.
    assert!(a.s.detach(a.now, id, HOLD).is_err());
    while a.reqs[&id].out.len() < 4 {
        a.step();
    }
    // Detached while a step that decodes it is in flight: that step's
    // sample is dropped, its stream gets nothing more.
    let plan = a.plan();
    let tokens = a.s.detach(a.now, id, HOLD).expect("decoding");
    a.execute(&plan);
    assert_eq!(tokens.len(), 30 + 4);
    assert_eq!(&tokens[..30], &prompt[..]);
    assert_eq!(&tokens[30..], &a.reqs[&id].out[..]);
    assert!(a.s.detach(a.now, id, HOLD).is_err(), "detached twice");
    assert_eq!(a.s.counters().detached, 1);
    let (blocks, held) = a.s.held_kv(id).expect("held for export");
    assert_eq!(held, 33, "the last token's KV is not computed yet");
    assert_eq!(blocks.len(), 3);
    let data = a.read_blocks(&blocks);
    let moved = a.reqs.remove(&id).unwrap();
    // The other engine continues from the last token (which the client
    // already has), with one more token allowed for it.
    let first = tokens[33];
    let resumed = EngineRequest {
        prompt: tokens[..33].to_vec(),
        max_tokens: 10 - 4 + 1,
        ..req
    };
    b.s.reserve(b.now, id, TenantId(0), 33, TTL).unwrap();
    b.import(id, resumed, &data, first).unwrap();
    assert!(a.s.release_held(id));
    a.assert_all_done();
    b.run_until_idle(20);
    let t = &b.reqs[&id];
    assert_eq!(t.computed, 6, "nothing is recomputed");
    let whole: Vec<u32> = moved.out.iter().chain(&t.out[1..]).copied().collect();
    assert_eq!(whole, (30..40).map(|p| tok(id, p)).collect::<Vec<_>>());
    b.assert_all_done();
}

/// A request the cache can hold, queued while a reservation holds most of
/// the blocks and nothing runs, waits for them: the reservation turns into
/// a sequence that ends or expires. It used to fail at once as too large
/// for the cache (issue 21: the last decode node of a P/D cluster, running
/// requests whole beside its reservations, failed them).
#[test]
fn a_request_waits_for_blocks_a_reservation_holds_rather_than_failing() {
    let mut d = Sim::new(two_tiers(8, 16));
    let r = RequestId(50);
    // 6 of the 8 blocks reserved; nothing runs.
    d.s.reserve(d.now, r, TenantId(0), 6 * 16, TTL).unwrap();
    // 60 prompt tokens: 4 blocks, only 2 free.
    let a = d.submit(0, 60, 8).unwrap();
    for _ in 0..3 {
        d.step();
    }
    assert_eq!(d.reqs[&a].end, None, "it waits instead of failing");
    assert_eq!(d.reqs[&a].computed, 0);
    // The reservation goes back: it runs and finishes.
    assert!(d.s.cancel_reservation(r));
    d.run_until_idle(50);
    assert!(
        matches!(d.reqs[&a].end, Some(End::Finished(..))),
        "{:?}",
        d.reqs[&a].end
    );
    d.assert_all_done();
}
