//! Output constraints in the Scheduler: each sampled item carries its
//! matcher's mask, every sampled token is committed, a complete output
//! ends with `Stop` before `max_tokens`, a token outside the mask fails the
//! request, a request the engine cannot constrain is refused, and a moved
//! request's matcher is advanced over what it generated before.

use std::sync::Arc;
use std::time::Duration;

use flotilla_exec::{Constraint, ConstraintCompiler, TokenConstraint};
use flotilla_proto::{EngineFailure, FinishReason, Rejection, RequestId, Sampled};

use super::Sim;
use crate::config::tests::two_tiers;
use crate::{SchedEvent, Scheduler};

/// The "grammar" `Regex(s)` of this fake: exactly the tokens named by the
/// comma-separated numbers of `s`, in order.
#[derive(Debug)]
struct Seq(Vec<u32>, usize);

impl TokenConstraint for Seq {
    fn allowed(&mut self, words: &mut Vec<u32>) {
        words.clear();
        words.resize(4, 0);
        let t = self.0.get(self.1).copied().unwrap_or(0); // 0: end of sequence
        words[t as usize / 32] |= 1 << (t % 32);
    }
    fn commit(&mut self, token: u32) -> Result<bool, String> {
        if self.0.get(self.1) != Some(&token) {
            return Err(format!("token {token} is not allowed"));
        }
        self.1 += 1;
        Ok(self.1 == self.0.len())
    }
    fn draft_allowed(&mut self, draft: &[u32], rows: &mut Vec<Vec<u32>>) {
        rows.clear();
        let at = self.1;
        for r in 0..=draft.len() {
            let mut w = Vec::new();
            self.allowed(&mut w);
            rows.push(w);
            if r == draft.len() || self.commit(draft[r]) != Ok(false) {
                break;
            }
        }
        self.1 = at;
    }
    fn forced(&mut self, max: usize, out: &mut Vec<u32>) {
        // Everything is forced but the last token, so a draft can also miss.
        out.clear();
        let end = self.0.len().saturating_sub(1);
        out.extend(self.0.iter().take(end).skip(self.1).take(max));
    }
}

#[derive(Debug)]
struct Fake;

impl ConstraintCompiler for Fake {
    fn compile(&self, c: &Constraint) -> Result<Box<dyn TokenConstraint>, String> {
        match c {
            Constraint::Regex(s) => s
                .split(',')
                .map(|x| x.parse::<u32>().map_err(|e| e.to_string()))
                .collect::<Result<Vec<_>, _>>()
                .map(|v| Box::new(Seq(v, 0)) as Box<dyn TokenConstraint>),
            _ => Err("only regexes here".into()),
        }
    }
}

fn sched(with: bool) -> Scheduler {
    sched_with(with, crate::Speculation::OFF)
}

fn sched_with(with: bool, spec: crate::Speculation) -> Scheduler {
    let mut cfg = two_tiers(64, 4);
    cfg.speculation = spec;
    let mut s = Scheduler::new(cfg).unwrap();
    if with {
        s.set_constraints(Arc::new(Fake));
    }
    s
}

fn sampled(token: u32) -> Option<Sampled> {
    Some(Sampled {
        token,
        logprob: 0.0,
        top: Vec::new(),
    })
}

/// Runs `id` to its end, sampling the lowest token each position's mask
/// allows (or `pick` where given, by step), verifying drafts as the
/// executors do; returns the tokens and how it ended.
fn run(
    s: &mut Scheduler,
    id: RequestId,
    pick: &dyn Fn(usize) -> Option<u32>,
) -> (Vec<u32>, Option<Result<FinishReason, EngineFailure>>) {
    run_steps(s, id, pick).0
}

type Ran = (Vec<u32>, Option<Result<FinishReason, EngineFailure>>);

/// [`run`], and the steps it took.
fn run_steps(
    s: &mut Scheduler,
    id: RequestId,
    pick: &dyn Fn(usize) -> Option<u32>,
) -> (Ran, usize) {
    let mut now = Duration::from_secs(1);
    let (mut toks, mut end) = (Vec::new(), None);
    let mut steps = 0;
    for step in 0..20 {
        now += Duration::from_millis(10);
        let plan = s.schedule(now);
        steps += usize::from(!plan.items.is_empty());
        let outs: Vec<flotilla_exec::SeqOutput> = plan
            .items
            .iter()
            .map(|it| {
                let mut out = flotilla_exec::SeqOutput::default();
                let q = it.seq_input();
                if it.sample.is_some() {
                    assert!(it.allow.is_some(), "a constrained sample has a mask");
                }
                flotilla_exec::sample_outputs(&q, &mut out, |d| {
                    let words = d.allow.expect("every sampled position has a mask");
                    let lowest = (0..128u32)
                        .find(|&t| words[t as usize / 32] >> (t % 32) & 1 == 1)
                        .expect("the mask allows something");
                    sampled(pick(step).unwrap_or(lowest)).unwrap()
                });
                out
            })
            .collect();
        s.complete(now, &plan, &outs);
        for ev in s.drain_events() {
            match ev {
                SchedEvent::Token { id: i, token } if i == id => toks.push(token.token),
                SchedEvent::Finished { id: i, reason, .. } if i == id => end = Some(Ok(reason)),
                SchedEvent::Failed { id: i, failure, .. } if i == id => end = Some(Err(failure)),
                _ => {}
            }
        }
        if end.is_some() {
            break;
        }
    }
    ((toks, end), steps)
}

fn constrained(spec: &str, max_tokens: u32) -> flotilla_proto::EngineRequest {
    let mut r = Sim::request(2, vec![100, 101, 102, 103, 104], max_tokens);
    r.constraint = Some(Constraint::Regex(spec.into()));
    r
}

#[test]
fn a_complete_output_stops_before_max_tokens() {
    let mut s = sched(true);
    let id = RequestId(1);
    s.submit(Duration::from_secs(1), id, constrained("41,42,43", 10))
        .unwrap();
    let (toks, end) = run(&mut s, id, &|_| None);
    assert_eq!(toks, vec![41, 42, 43]);
    assert_eq!(end, Some(Ok(FinishReason::Stop)));
    assert_eq!(s.kv_usage().used, 0, "every block given back");
}

#[test]
fn a_token_outside_the_mask_fails_the_request_and_frees_its_blocks() {
    let mut s = sched(true);
    let id = RequestId(1);
    s.submit(Duration::from_secs(1), id, constrained("41,42,43", 10))
        .unwrap();
    let (toks, end) = run(&mut s, id, &|step| (step >= 1).then_some(77));
    assert_eq!(toks, vec![41], "the bad token is not sent");
    match end {
        Some(Err(EngineFailure::Internal(m))) => assert!(m.contains("not allowed"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.kv_usage().used, 0);
}

#[test]
fn an_engine_without_a_compiler_or_a_bad_constraint_is_refused() {
    let mut s = sched(false);
    let r = s.submit(Duration::from_secs(1), RequestId(1), constrained("41", 4));
    assert!(matches!(r, Err(Rejection::Invalid(m)) if m.contains("structured output")));
    let mut s = sched(true);
    let r = s.submit(Duration::from_secs(1), RequestId(1), constrained("x", 4));
    assert!(matches!(r, Err(Rejection::Invalid(m)) if m.starts_with("regex:")));
    let mut r = constrained("41", 4);
    r.constraint = Some(Constraint::JsonObject);
    assert!(s.submit(Duration::from_secs(1), RequestId(2), r).is_err());
    assert_eq!(s.kv_usage().used, 0);
}

#[test]
fn a_moved_request_continues_its_constraint_from_what_it_generated() {
    let mut s = sched(true);
    // It generated 41 and 42 on the node it left: they end its prompt now.
    let mut r = constrained("41,42,43", 8);
    r.prompt.extend([41, 42]);
    r.generated = 2;
    s.submit(Duration::from_secs(1), RequestId(1), r).unwrap();
    let (toks, end) = run(&mut s, RequestId(1), &|_| None);
    assert_eq!(toks, vec![43]);
    assert_eq!(end, Some(Ok(FinishReason::Stop)));
    // What it generated before must fit the constraint.
    let mut r = constrained("41,42,43", 8);
    r.prompt.extend([41, 99]);
    r.generated = 2;
    let e = s.submit(Duration::from_secs(1), RequestId(2), r);
    assert!(matches!(e, Err(Rejection::Invalid(m)) if m.contains("generated before")));
}

#[test]
fn a_constrained_request_speculates_with_the_grammar_s_forced_tokens() {
    let want: Vec<u32> = (41..53).collect();
    let spec = want
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut plain = sched(true);
    plain
        .submit(Duration::from_secs(1), RequestId(1), constrained(&spec, 20))
        .unwrap();
    let ((toks, end), steps_off) = run_steps(&mut plain, RequestId(1), &|_| None);
    assert_eq!(toks, want);
    assert_eq!(end, Some(Ok(FinishReason::Stop)));
    assert_eq!(plain.counters().drafted_tokens, 0);

    let mut s = sched_with(true, crate::Speculation::ngram(4));
    s.submit(Duration::from_secs(1), RequestId(1), constrained(&spec, 20))
        .unwrap();
    let ((toks, end), steps_on) = run_steps(&mut s, RequestId(1), &|_| None);
    assert_eq!(toks, want, "the same tokens");
    assert_eq!(end, Some(Ok(FinishReason::Stop)));
    let c = s.counters();
    assert!(c.accepted_tokens > 0, "{c:?}");
    assert!(
        steps_on < steps_off,
        "{steps_on} steps with drafts, {steps_off} without"
    );
    assert_eq!(s.kv_usage().used, 0, "every block given back");

    // A sample outside the grammar (77, from the second step on) still
    // fails the request as without drafts: the tokens before it sent,
    // every block back.
    let mut s = sched_with(true, crate::Speculation::ngram(4));
    s.submit(Duration::from_secs(1), RequestId(1), constrained(&spec, 20))
        .unwrap();
    let (toks, end) = run(&mut s, RequestId(1), &|step| (step >= 1).then_some(77));
    assert!(toks.iter().zip(&want).all(|(a, b)| a == b), "{toks:?}");
    assert!(matches!(end, Some(Err(EngineFailure::Internal(m))) if m.contains("not allowed")));
    assert_eq!(s.kv_usage().used, 0, "every block given back");
}
