//! What the scheduler tells its actor shell: per-request events and counters.

use std::time::Duration;

use flotilla_proto::{EngineFailure, FinishReason, RequestId, Sampled, TierId, Usage};

/// One thing that happened to one request, in the order it happened.
#[derive(Clone, Debug, PartialEq)]
pub enum SchedEvent {
    /// A generated token (stop token included), in order, never duplicated or lost.
    Token {
        /// The request.
        id: RequestId,
        /// The token and its log-probabilities.
        token: Sampled,
    },
    /// Terminal: the request ended normally.
    Finished {
        /// The request.
        id: RequestId,
        /// Stop token or length.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
        /// Where its time went (boxed: a token event, the common one,
        /// stays small).
        timings: Box<Timings>,
    },
    /// Terminal: the engine ended the request (queue timeout, too large, step failure).
    Failed {
        /// The request.
        id: RequestId,
        /// Why.
        failure: EngineFailure,
        /// Where its time went until then (boxed, as for `Finished`).
        timings: Box<Timings>,
    },
    /// The request lost its KV blocks and went back to its queue to be recomputed (metrics only).
    Preempted {
        /// The request.
        id: RequestId,
        /// Its tier.
        tier: TierId,
    },
}

impl SchedEvent {
    /// The request the event is about.
    pub fn id(&self) -> RequestId {
        match self {
            SchedEvent::Token { id, .. }
            | SchedEvent::Finished { id, .. }
            | SchedEvent::Failed { id, .. }
            | SchedEvent::Preempted { id, .. } => *id,
        }
    }

    /// Whether this is the request's last event.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            SchedEvent::Finished { .. } | SchedEvent::Failed { .. }
        )
    }
}

/// Where one request's time went (all spans measured with the caller's `now`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timings {
    /// Its tier.
    pub tier: TierId,
    /// Arrival to first scheduled (to the end if it never was).
    pub queue: Duration,
    /// Arrival to first token, if one came.
    pub ttft: Option<Duration>,
    /// First scheduled to prompt fully computed (to the end if it never was).
    pub prefill: Duration,
    /// First token to the end.
    pub decode: Duration,
    /// Mean time per output token after the first: `decode / (output_tokens - 1)`.
    pub tpot: Option<Duration>,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub output_tokens: u32,
    /// Draft tokens verified for it (speculative decoding).
    pub drafted: u32,
    /// Draft tokens accepted: output tokens that cost no step of their own.
    pub accepted: u32,
}

/// Totals since start, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Non-empty steps planned.
    pub steps: u64,
    /// Requests accepted by `submit`.
    pub accepted: u64,
    /// Requests refused by `submit`.
    pub rejected: u64,
    /// Requests that ended with `Finished`.
    pub finished: u64,
    /// Requests that ended with `Failed`.
    pub failed: u64,
    /// Requests cancelled by the client.
    pub cancelled: u64,
    /// Preemptions (a request preempted twice counts twice).
    pub preemptions: u64,
    /// Prompt tokens served from the prefix cache at admission (re-admissions included).
    pub cached_tokens: u64,
    /// Tokens computed by the executor (prefill chunks, recompute and decodes).
    pub computed_tokens: u64,
    /// Held blocks and reservations given back by their deadline (an
    /// export never acked, an import that never came).
    pub kv_expired: u64,
    /// Running requests stopped here with their KV held for a move to
    /// another node ([`crate::Scheduler::detach`]).
    pub detached: u64,
    /// Draft tokens verified (speculative decoding).
    pub drafted_tokens: u64,
    /// Draft tokens accepted.
    pub accepted_tokens: u64,
    /// Sequences' steps that verified a draft (tokens per verify step:
    /// `(accepted_tokens + verify_items) / verify_items`).
    pub verify_items: u64,
    /// Of those, the drafts a draft model guessed.
    pub model_drafts: u64,
}
