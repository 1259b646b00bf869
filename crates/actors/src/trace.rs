//! A traced request's timeline inside one engine, kept by the Scheduler
//! actor and exported as spans when the request leaves the engine.
//!
//! Kept only for requests that carry a trace context (sampled at the
//! Router) and only when the engine has a [`Tracing`]: otherwise the
//! actor's map stays empty and each step costs one `is_empty` check.
//! Times are the actor's clock (`now`), as the scheduler's are.

use std::collections::HashMap;
use std::time::Duration;

use flotilla_proto::{RequestId, TraceContext};
use flotilla_sched::PlanItem;
use flotilla_telemetry::{EventRec, KeyValue, SpanRec, Tracing};

/// How the request came into this engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    /// A whole request (prompt to end).
    Whole,
    /// A prefill whose KV leaves for a decode node.
    PrefillForDecode,
    /// A request whose prompt's KV was imported from a prefill node.
    Imported,
}

impl Entry {
    fn as_str(self) -> &'static str {
        match self {
            Entry::Whole => "whole",
            Entry::PrefillForDecode => "prefill_for_decode",
            Entry::Imported => "imported",
        }
    }
}

/// One step a traced request rode in.
#[derive(Clone, Copy, Debug)]
struct Ride {
    start: Duration,
    end: Duration,
    /// Its tokens in the step (a prefill chunk, or a decode plus drafts).
    tokens: u32,
    /// Sequences in the step.
    batch: u32,
}

/// One traced request's timeline.
#[derive(Debug)]
pub(crate) struct ReqTrace {
    parent: TraceContext,
    entry: Entry,
    tier: String,
    tenant: u32,
    prompt_tokens: u32,
    max_tokens: u32,
    submitted: Duration,
    scheduled: Option<Duration>,
    first_token: Option<Duration>,
    /// Steps before its first token came (prefill chunks).
    chunks: Vec<Ride>,
    /// Steps after it (decodes, recomputes after a preemption), the
    /// first [`flotilla_telemetry::trace::EVENTS_PER_SPAN_MAX`] of them.
    steps: Vec<Ride>,
    /// Every step after the first token.
    decode_steps: u32,
    preempted: Vec<Duration>,
    /// After each preemption, when it was scheduled again and how many of
    /// its tokens' KV it found (kept in the prefix cache or restored from
    /// the offload tier: the swap); the rest is recomputed.
    resumed: Vec<(Duration, u32)>,
    /// Preempted and not yet scheduled again.
    awaiting_resume: bool,
    /// Prompt tokens whose KV came from the prefix cache at its first step.
    prefix_cached: u32,
    /// Its tokens in the step in flight.
    in_step: Option<u32>,
}

/// How the request left the engine.
pub(crate) enum End<'a> {
    Finished {
        reason: &'static str,
        output_tokens: u32,
        cached_tokens: u32,
    },
    Failed(String),
    Cancelled,
    Moved,
    /// Another end that is not an error, named (`orphan`: its lease was
    /// given back as nobody's).
    Other(&'a str),
}

/// The traced requests of one engine and the step in flight.
#[derive(Default)]
pub(crate) struct Traces {
    live: HashMap<RequestId, ReqTrace>,
    step_start: Duration,
    step_batch: u32,
}

impl Traces {
    /// Starts the timeline of `id` if it is traced.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        &mut self,
        tracing: &Option<Tracing>,
        id: RequestId,
        trace: Option<&TraceContext>,
        entry: Entry,
        tier: &str,
        tenant: u32,
        prompt_tokens: u32,
        max_tokens: u32,
        now: Duration,
    ) {
        let (Some(_), Some(parent)) = (tracing, trace) else {
            return;
        };
        let t = ReqTrace::new(
            parent.clone(),
            entry,
            tier,
            tenant,
            (prompt_tokens, max_tokens),
            now,
        );
        self.live.insert(id, t);
    }

    /// A step with these items starts now.
    pub(crate) fn step_planned(&mut self, items: &[PlanItem], now: Duration) {
        if self.live.is_empty() {
            return;
        }
        self.step_start = now;
        self.step_batch = items.len() as u32;
        for it in items {
            if let Some(t) = self.live.get_mut(&it.id) {
                if t.scheduled.is_none() {
                    t.scheduled = Some(now);
                    t.prefix_cached = it.start_pos as u32;
                }
                if t.awaiting_resume {
                    t.awaiting_resume = false;
                    t.resumed.push((now, it.start_pos as u32));
                }
                t.in_step = Some(it.tokens.len() as u32);
            }
        }
    }

    /// The step in flight is done (before its tokens are delivered, so the
    /// step that samples a request's first token counts as its last chunk).
    pub(crate) fn step_done(&mut self, items: &[PlanItem], now: Duration) {
        if self.live.is_empty() {
            return;
        }
        for it in items {
            if let Some(t) = self.live.get_mut(&it.id)
                && let Some(tokens) = t.in_step.take()
            {
                let ride = Ride {
                    start: self.step_start,
                    end: now,
                    tokens,
                    batch: self.step_batch,
                };
                if t.first_token.is_none() {
                    t.chunks.push(ride);
                } else {
                    t.decode_steps += 1;
                    if t.steps.len() < flotilla_telemetry::trace::EVENTS_PER_SPAN_MAX {
                        t.steps.push(ride);
                    }
                }
            }
        }
    }

    /// A token of `id` was delivered now.
    pub(crate) fn token(&mut self, id: RequestId, now: Duration) {
        if self.live.is_empty() {
            return;
        }
        if let Some(t) = self.live.get_mut(&id) {
            t.first_token.get_or_insert(now);
        }
    }

    /// `id` lost its KV blocks now.
    pub(crate) fn preempted(&mut self, id: RequestId, now: Duration) {
        if self.live.is_empty() {
            return;
        }
        if let Some(t) = self.live.get_mut(&id) {
            t.preempted.push(now);
            t.awaiting_resume = true;
        }
    }

    /// `id` left the engine now: its spans go out.
    pub(crate) fn end(
        &mut self,
        tracing: &Option<Tracing>,
        id: RequestId,
        end: End,
        now: Duration,
    ) {
        if self.live.is_empty() {
            return;
        }
        let (Some(tr), Some(t)) = (tracing, self.live.remove(&id)) else {
            return;
        };
        let parent = t.parent.clone();
        tr.export(&parent, t.into_spans(end, now));
    }

    /// Whether `id` is traced here (cheap when nothing is).
    pub(crate) fn has(&self, id: RequestId) -> bool {
        !self.live.is_empty() && self.live.contains_key(&id)
    }

    /// Traced requests in the engine (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }
}

impl ReqTrace {
    /// A timeline that starts at `submitted`; `(prompt, max)` tokens.
    fn new(
        parent: TraceContext,
        entry: Entry,
        tier: &str,
        tenant: u32,
        (prompt_tokens, max_tokens): (u32, u32),
        submitted: Duration,
    ) -> ReqTrace {
        ReqTrace {
            parent,
            entry,
            tier: tier.to_owned(),
            tenant,
            prompt_tokens,
            max_tokens,
            submitted,
            scheduled: None,
            first_token: None,
            chunks: Vec::new(),
            steps: Vec::new(),
            decode_steps: 0,
            preempted: Vec::new(),
            resumed: Vec::new(),
            awaiting_resume: false,
            prefix_cached: 0,
            in_step: None,
        }
    }

    fn into_spans(self, end: End, now: Duration) -> SpanRec {
        let mut root = SpanRec::new("engine.request", self.submitted, now)
            .attr("flotilla.engine.entry", self.entry.as_str())
            .attr("flotilla.tier", self.tier)
            .attr("flotilla.tenant", i64::from(self.tenant))
            .attr("gen_ai.request.max_tokens", i64::from(self.max_tokens))
            .attr("gen_ai.usage.input_tokens", i64::from(self.prompt_tokens))
            .attr("flotilla.preemptions", self.preempted.len() as i64);
        match end {
            End::Finished {
                reason,
                output_tokens,
                cached_tokens,
            } => {
                root = root
                    .attr("gen_ai.response.finish_reasons", reason)
                    .attr("gen_ai.usage.output_tokens", i64::from(output_tokens))
                    .attr("flotilla.cached_tokens", i64::from(cached_tokens))
                    .attr("flotilla.end", "finished");
            }
            End::Failed(why) => {
                root = root.attr("flotilla.end", "failed");
                root.error = Some(why);
            }
            End::Cancelled => root = root.attr("flotilla.end", "cancelled"),
            End::Moved => root = root.attr("flotilla.end", "moved"),
            End::Other(s) => root = root.attr("flotilla.end", s.to_owned()),
        }
        if let Some(f) = self.first_token {
            let ttft = f.saturating_sub(self.submitted).as_secs_f64() * 1e3;
            root = root.attr("flotilla.engine.ttft_ms", ttft);
        }
        let queued_until = self.scheduled.unwrap_or(now);
        root.children
            .push(SpanRec::new("engine.queue", self.submitted, queued_until));
        if let (Some(s), false) = (self.scheduled, self.chunks.is_empty()) {
            let until = self.first_token.unwrap_or(now);
            let computed: u32 = self.chunks.iter().map(|r| r.tokens).sum();
            let mut prefill = SpanRec::new("engine.prefill", s, until)
                .attr(
                    "flotilla.prefill.cached_tokens",
                    i64::from(self.prefix_cached),
                )
                .attr("flotilla.prefill.chunks", self.chunks.len() as i64)
                .attr("flotilla.prefill.computed_tokens", i64::from(computed));
            for r in &self.chunks {
                prefill.children.push(
                    SpanRec::new("engine.prefill.chunk", r.start, r.end)
                        .attr("flotilla.step.tokens", i64::from(r.tokens))
                        .attr("flotilla.step.batch", i64::from(r.batch)),
                );
            }
            root.children.push(prefill);
        }
        if let Some(f) = self.first_token {
            // An imported request's first token came with its KV, before
            // it was first scheduled here.
            let from = f.max(queued_until);
            if from < now || !self.steps.is_empty() {
                let mut decode = SpanRec::new("engine.decode", from, now)
                    .attr("flotilla.decode.steps", i64::from(self.decode_steps));
                decode.events = self
                    .steps
                    .iter()
                    .map(|r| EventRec {
                        name: "step".into(),
                        at: r.end,
                        attrs: vec![
                            KeyValue::new("flotilla.step.tokens", i64::from(r.tokens)),
                            KeyValue::new("flotilla.step.batch", i64::from(r.batch)),
                            KeyValue::new(
                                "flotilla.step.ms",
                                r.end.saturating_sub(r.start).as_secs_f64() * 1e3,
                            ),
                        ],
                    })
                    .collect();
                root.children.push(decode);
            }
        }
        for &p in &self.preempted {
            root.events.push(EventRec {
                name: "preempted".into(),
                at: p,
                attrs: Vec::new(),
            });
        }
        for &(at, reused) in &self.resumed {
            root.events.push(EventRec {
                name: "resumed".into(),
                at,
                attrs: vec![KeyValue::new(
                    "flotilla.kv.reused_tokens",
                    i64::from(reused),
                )],
            });
        }
        root.events.sort_by_key(|e| e.at);
        root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: u64, tokens: usize) -> PlanItem {
        PlanItem {
            id: RequestId(id),
            tokens: vec![1; tokens],
            start_pos: 0,
            block_table: Vec::new(),
            sample: None,
            bias: Vec::new(),
            draft_bias: Vec::new(),
            allow: None,
            draft: 0,
            self_draft: 0,
            model_draft: None,
            draft_planned: 0,
        }
    }

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// A paid tenant's request of 300 prompt tokens, submitted at `at`.
    fn fresh(parent: TraceContext, entry: Entry, at: Duration) -> ReqTrace {
        ReqTrace::new(parent, entry, "paid", 3, (300, 3), at)
    }

    #[test]
    fn a_timeline_becomes_queue_prefill_chunks_and_decode_steps_that_tile_the_request() {
        let cx = TraceContext {
            trace_id: [1; 16],
            span_id: [2; 8],
            flags: 1,
            state: String::new(),
        };
        let t = fresh(cx, Entry::Whole, ms(0));
        let mut tr = Traces::default();
        tr.live.insert(RequestId(7), t);
        let id = RequestId(7);
        // Two prefill chunks (the second samples the first token), two decodes.
        for (s, e, n, sampled) in [
            (10, 30, 256, false),
            (31, 40, 44, true),
            (41, 50, 1, true),
            (51, 60, 1, true),
        ] {
            tr.step_planned(&[item(7, n), item(8, 1)], ms(s));
            tr.step_done(&[item(7, n), item(8, 1)], ms(e));
            if sampled {
                tr.token(id, ms(e));
            }
        }
        tr.preempted(id, ms(61));
        // Scheduled again with 288 tokens' KV found (cache or offload tier).
        let mut again = item(7, 16);
        again.start_pos = 288;
        tr.step_planned(&[again.clone()], ms(62));
        tr.step_done(&[again], ms(65));
        let t = tr.live.remove(&id).expect("traced");
        let rec = t.into_spans(
            End::Finished {
                reason: "length",
                output_tokens: 3,
                cached_tokens: 0,
            },
            ms(70),
        );
        let names: Vec<&str> = rec.children.iter().map(|c| c.name.as_ref()).collect();
        assert_eq!(names, ["engine.queue", "engine.prefill", "engine.decode"]);
        let (q, p, d) = (&rec.children[0], &rec.children[1], &rec.children[2]);
        assert_eq!((q.start, q.end), (ms(0), ms(10)));
        assert_eq!((p.start, p.end), (ms(10), ms(40)));
        assert_eq!((d.start, d.end), (ms(40), ms(70)));
        assert_eq!(p.children.len(), 2);
        assert_eq!((p.children[1].start, p.children[1].end), (ms(31), ms(40)));
        assert!(
            p.children[0]
                .attrs
                .contains(&KeyValue::new("flotilla.step.tokens", 256i64))
        );
        assert_eq!(d.events.len(), 3);
        assert!(
            d.events[0]
                .attrs
                .contains(&KeyValue::new("flotilla.step.batch", 2i64))
        );
        let ev: Vec<(&str, Duration)> =
            rec.events.iter().map(|e| (e.name.as_ref(), e.at)).collect();
        assert_eq!(ev, [("preempted", ms(61)), ("resumed", ms(62))]);
        assert!(
            rec.events[1]
                .attrs
                .contains(&KeyValue::new("flotilla.kv.reused_tokens", 288i64))
        );
        assert!(rec.attrs.contains(&KeyValue::new("flotilla.tier", "paid")));
    }

    #[test]
    fn an_imported_request_has_no_prefill_span_and_decodes_from_its_first_seat() {
        let mut tr = Traces::default();
        let tracing = None;
        // No Tracing: nothing is kept.
        let cx = TraceContext {
            trace_id: [1; 16],
            span_id: [2; 8],
            flags: 1,
            state: String::new(),
        };
        tr.start(
            &tracing,
            RequestId(1),
            Some(&cx),
            Entry::Imported,
            "free",
            0,
            10,
            5,
            ms(0),
        );
        assert_eq!(tr.len(), 0);
        let t = fresh(cx, Entry::Imported, ms(100));
        tr.live.insert(RequestId(1), t);
        tr.token(RequestId(1), ms(100));
        tr.step_planned(&[item(1, 1)], ms(105));
        tr.step_done(&[item(1, 1)], ms(110));
        let rec = tr
            .live
            .remove(&RequestId(1))
            .expect("traced")
            .into_spans(End::Cancelled, ms(110));
        let names: Vec<&str> = rec.children.iter().map(|c| c.name.as_ref()).collect();
        assert_eq!(names, ["engine.queue", "engine.decode"]);
        assert_eq!(
            (rec.children[1].start, rec.children[1].end),
            (ms(105), ms(110))
        );
        assert!(
            rec.attrs
                .contains(&KeyValue::new("flotilla.end", "cancelled"))
        );
    }
}
