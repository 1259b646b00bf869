//! Types that cross actor boundaries: ids, engine requests and events, and
//! the `Engine` trait the Router drives.
//!
//! Inside one process these travel as Rust values. Issue 4 (QUIC transport)
//! gives the ones that cross nodes an rkyv archive form; nothing here may hold
//! a pointer into another actor's state.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

pub use flotilla_model::{Sampled, SamplingParams};
use tokio::sync::mpsc;

pub mod role;
pub mod wire;

pub use role::Role;

/// Index of a tenant in the validated config (`[[tenants]]` order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u32);

/// Index of a tier in the validated config (`[[tiers]]` order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TierId(pub u8);

/// One request inside one engine; unique for the engine's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// A validated, tokenized request, as the Router hands it to an engine.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineRequest {
    /// Who asked (resolved from the API key).
    pub tenant: TenantId,
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Most tokens to generate (at least one).
    pub max_tokens: u32,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Token ids that end the request besides the model's own stop tokens.
    pub stop_token_ids: Vec<u32>,
}

/// Why a request ended normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token (or, at the Router, a stop string).
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
}

impl FinishReason {
    /// The name OpenAI's API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts of one finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens, stop token included.
    pub completion_tokens: u32,
    /// Prompt tokens whose KV came from the prefix cache at first admission.
    pub cached_tokens: u32,
}

/// What an engine sends back about one request, in order: tokens, then
/// exactly one `Finished` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// One generated token (with log-probabilities when asked).
    Token(Sampled),
    /// The request ended normally.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
    /// The request was ended by the engine before finishing.
    Failed(EngineFailure),
}

/// Why an accepted request failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineFailure {
    /// It waited in the queue longer than `--queue-timeout`.
    #[error("request waited {waited_ms} ms in the queue, the limit is {limit_ms} ms")]
    QueueTimeout {
        /// Time spent waiting, milliseconds.
        waited_ms: u64,
        /// The configured limit, milliseconds.
        limit_ms: u64,
    },
    /// It can never fit: the KV cache (or the tenant's KV quota) is smaller
    /// than the request.
    #[error("request needs {need_blocks} KV blocks, at most {max_blocks} are available to it")]
    TooLargeForCache {
        /// Blocks the request needs.
        need_blocks: u32,
        /// Blocks it could ever get.
        max_blocks: u32,
    },
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The executor failed a step this request was in.
    #[error("engine error: {0}")]
    Internal(String),
}

/// Why an engine refused a request at admission (nothing was queued).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The tenant is at its concurrency or rate limit (HTTP 429).
    #[error("tenant '{tenant}' is over its limit: {reason}")]
    TenantLimit {
        /// Tenant name.
        tenant: String,
        /// Which limit.
        reason: String,
        /// When a retry may succeed, seconds.
        retry_after_s: u32,
    },
    /// The queue of the tenant's tier is full (HTTP 503).
    #[error("the '{tier}' queue is full ({queue_len_max} waiting)")]
    QueueFull {
        /// Tier name.
        tier: String,
        /// The tier's queue cap.
        queue_len_max: usize,
        /// When a retry may succeed, seconds.
        retry_after_s: u32,
    },
    /// Prompt plus `max_tokens` exceed the model length (HTTP 400).
    #[error(
        "this model's maximum context length is {max_model_len} tokens; the request has \
         {prompt_tokens} prompt tokens and asks for {max_tokens} more"
    )]
    TooLong {
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Requested completion tokens.
        max_tokens: u32,
        /// `--max-model-len`.
        max_model_len: u32,
    },
    /// The request is malformed in a way only the engine can see (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// The engine is not accepting work (starting or stopping; HTTP 503).
    #[error("the engine is not accepting requests")]
    Unavailable,
}

/// KV cache occupancy in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvUsage {
    /// Blocks in the pool.
    pub total: u32,
    /// Blocks no one holds and no prefix is cached in.
    pub free: u32,
    /// Blocks held by at least one sequence.
    pub used: u32,
    /// Blocks no one holds that keep a cached prefix (evictable).
    pub cached: u32,
}

/// Per-tier queue figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierStatus {
    /// Tier name.
    pub name: String,
    /// Requests waiting.
    pub queued: usize,
    /// Requests running.
    pub running: usize,
}

/// What `/ready` reports about an engine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStatus {
    /// Model loaded and the step loop alive.
    pub ready: bool,
    /// Steps run since start.
    pub steps: u64,
    /// Sequences in the running batch.
    pub running: usize,
    /// Queue length and running count per tier.
    pub tiers: Vec<TierStatus>,
    /// KV occupancy.
    pub kv: KvUsage,
    /// Preemptions since start.
    pub preemptions: u64,
    /// Engine nodes behind a cluster Router (empty for an engine in this process).
    pub nodes: Vec<NodeStatus>,
}

/// One engine node as a cluster Router sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeStatus {
    /// Node name.
    pub name: String,
    /// Heard from within the down-after bound.
    pub up: bool,
    /// The epoch it last spoke with (0 before it was heard).
    pub epoch: u64,
    /// Requests in flight on it now.
    pub in_flight: u32,
    /// Requests routed to it since the Router started.
    pub routed: u64,
    /// Times it was marked down.
    pub downs: u64,
}

/// The events of one accepted request. Dropping it cancels the request: the
/// engine drops it from its queue or batch at the next step and its blocks
/// go back to the pool. A stream the Router ended at a stop string is marked
/// first ([`RequestStream::ended_by_stop_string`]), so the engine finishes
/// the request (counted as finished, with its latencies) instead.
pub struct RequestStream {
    /// The engine's id for the request.
    pub id: RequestId,
    rx: mpsc::UnboundedReceiver<EngineEvent>,
    on_drop: Option<Box<dyn FnOnce(bool) + Send>>,
    stop_string: bool,
}

impl RequestStream {
    /// A stream fed by `rx`; `on_drop` runs once when the stream is dropped,
    /// with `true` if the Router ended it at a stop string (it tells the
    /// engine to cancel or finish; harmless after the end).
    pub fn new(
        id: RequestId,
        rx: mpsc::UnboundedReceiver<EngineEvent>,
        on_drop: Box<dyn FnOnce(bool) + Send>,
    ) -> Self {
        RequestStream {
            id,
            rx,
            on_drop: Some(on_drop),
            stop_string: false,
        }
    }

    /// The Router found a stop string: when this stream is dropped, the
    /// engine finishes the request with reason `Stop` rather than counting
    /// a cancellation.
    pub fn ended_by_stop_string(&mut self) {
        self.stop_string = true;
    }

    /// The next event; `None` once the engine has dropped its side (after
    /// the terminal event, or if the engine died).
    pub async fn recv(&mut self) -> Option<EngineEvent> {
        self.rx.recv().await
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f(self.stop_string);
        }
    }
}

impl fmt::Debug for RequestStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestStream")
            .field("id", &self.id)
            .finish()
    }
}

/// A boxed future, so `dyn Engine` works.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// An engine as the Router sees it: one Scheduler + KvBlockPool + GpuWorker
/// in this process today, a remote worker node later.
pub trait Engine: Send + Sync + 'static {
    /// Admits a request or refuses it at once; never waits for capacity.
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>>;
    /// Current figures for `/ready`.
    fn status(&self) -> BoxFuture<EngineStatus>;
}
