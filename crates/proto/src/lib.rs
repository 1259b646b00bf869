//! Types that cross actor boundaries: ids, engine requests and events, and
//! the `Engine` trait the Router drives.
//!
//! One family of messages: inside one process these travel as Rust values,
//! between nodes the same types travel as rkyv archives ([`wire`]), so a
//! remote engine and a local one get and give the same request, events,
//! rejections, failures and status. Nothing here may hold a pointer into
//! another actor's state.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

pub use flotilla_exec::{KvDtype, Sampled, SamplingParams};
use rkyv::{Archive, Deserialize, Serialize};
use tokio::sync::mpsc;

pub mod role;
pub mod wire;

pub use role::Role;

/// Index of a tenant in the validated config (`[[tenants]]` order).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Archive, Serialize, Deserialize,
)]
pub struct TenantId(pub u32);

/// Index of a tier in the validated config (`[[tiers]]` order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TierId(pub u8);

/// One request inside one engine; unique for the engine's lifetime.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Archive, Serialize, Deserialize,
)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// A validated, tokenized request, as the Router hands it to an engine.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Archive, Serialize, Deserialize)]
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
    /// Moving the prompt's KV from the prefill node to the decode node
    /// failed before any token was sent; the Router runs it again.
    #[error("KV transfer failed: {0}")]
    KvTransfer(String),
    /// The engine node heard nothing from the Router past the down bound
    /// and dropped the request (and its blocks). Sent back in case only
    /// the Router's direction of the link was cut: the Router runs the
    /// request again if no token reached the client, else ends it.
    #[error("the engine node lost contact with the Router: {0}")]
    RouterLost(String),
}

/// Why an engine refused a request at admission (nothing was queued).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Archive, Serialize, Deserialize)]
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct KvUsage {
    /// Blocks in the pool.
    pub total: u32,
    /// Blocks no one holds and no prefix is cached in.
    pub free: u32,
    /// Blocks held by at least one sequence.
    pub used: u32,
    /// Blocks no one holds that keep a cached prefix (evictable).
    pub cached: u32,
    /// Of `used`: blocks of finished prefills kept for a decode node's
    /// transfer (until its ack, a cancel or the hold deadline).
    pub held: u32,
    /// Of `used`: blocks reserved for KV a prefill node will send (until
    /// the import, a cancel or the reservation deadline).
    pub reserved: u32,
    /// Element type of the blocks (the Router pairs nodes for a KV
    /// transfer only when theirs agree).
    pub dtype: KvDtype,
}

/// Per-tier queue figures.
#[derive(Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub struct TierStatus {
    /// Tier name.
    pub name: String,
    /// Requests waiting.
    pub queued: usize,
    /// Requests running.
    pub running: usize,
}

/// What `/ready` reports about an engine; an engine node sends it with
/// every heartbeat, and the Router routes by it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize)]
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
    /// Leases the engine's node gave back as orphans since it started
    /// (held for requests no longer alive anywhere; a leak it found and
    /// healed, so it should stay 0). 0 for an engine with no node.
    pub orphans: u64,
    /// The engine (or its node) is draining: it takes no new requests and
    /// stops once those it runs have finished.
    pub draining: bool,
    /// Engine nodes behind a cluster Router (empty for an engine in this process).
    pub nodes: Vec<NodeStatus>,
}

/// One engine node as a cluster Router sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Archive, Serialize, Deserialize)]
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
    /// Streaming requests moved from it to another node (it was lost
    /// while they ran; they continued from the tokens their clients had).
    pub moved_away: u64,
    /// Of those, the ones that continued from its KV (it drained), not
    /// by recomputing their tokens.
    pub moved_by_kv: u64,
    /// Requests whose leases it gave back as orphans (held for requests
    /// no longer alive anywhere); should stay 0.
    pub kv_orphans: u64,
    /// Its KV blocks' element type (as it last reported).
    pub kv_dtype: KvDtype,
    /// Blocks in its KV pool (as it last reported).
    pub kv_blocks: u32,
}

/// The events of one accepted request. Dropping it cancels the request: the
/// engine drops it from its queue or batch at the next step and its blocks
/// go back to the pool. A stream the Router ended at a stop string is marked
/// first ([`RequestStream::ended_by_stop_string`]), so the engine finishes
/// the request (counted as finished, with its latencies) instead.
pub struct RequestStream {
    /// The engine's id for the request.
    pub id: RequestId,
    /// `None` for a request whose events go to an [`EventSink`].
    rx: Option<mpsc::UnboundedReceiver<EngineEvent>>,
    on_drop: Option<Box<dyn FnOnce(bool) + Send>>,
    stop_string: bool,
}

/// The events one engine step produced for the requests that go to one
/// sink, in order (a request's tokens, then possibly its end).
pub type StepEvents = Vec<(RequestId, EngineEvent)>;

/// Where an engine sends the events of requests submitted with
/// [`Engine::submit_to`]: one message per engine step, holding every event
/// of that step for them, instead of one message per token per request.
/// An engine node's bridge takes all its requests' events through one.
pub type EventSink = mpsc::UnboundedSender<StepEvents>;

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
            rx: Some(rx),
            on_drop: Some(on_drop),
            stop_string: false,
        }
    }

    /// The handle of a request whose events go to a sink: it yields no
    /// events, and dropping it (or ending it at a stop string) ends the
    /// request as for any stream.
    pub fn detached(id: RequestId, on_drop: Box<dyn FnOnce(bool) + Send>) -> Self {
        RequestStream {
            id,
            rx: None,
            on_drop: Some(on_drop),
            stop_string: false,
        }
    }

    /// Sends this stream's events to `sink` (one message per event: for
    /// engines with no step of their own to batch by) and returns the
    /// detached handle that ends it. A stream that ends with no terminal
    /// event gets a `Failed` one, so the sink always sees the end.
    pub fn forward_to(mut self, sink: EventSink) -> RequestStream {
        let id = self.id;
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<bool>();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    // Events first: an end that came is delivered.
                    biased;
                    ev = self.recv() => {
                        let ev = ev.unwrap_or_else(|| {
                            EngineEvent::Failed(EngineFailure::Internal(
                                "the engine dropped the request".into(),
                            ))
                        });
                        let end = !matches!(ev, EngineEvent::Token(_));
                        if sink.send(vec![(id, ev)]).is_err() || end {
                            return;
                        }
                    }
                    stop = &mut stop_rx => {
                        if stop == Ok(true) {
                            self.ended_by_stop_string();
                        }
                        return;
                    }
                }
            }
        });
        RequestStream::detached(
            id,
            Box::new(move |stop_string| {
                let _ = stop_tx.send(stop_string);
            }),
        )
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
        match &mut self.rx {
            Some(rx) => rx.recv().await,
            None => None,
        }
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

/// Why a Router did not ask a node to drain ([`Engine::drain_node`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DrainRefusal {
    /// This engine runs in one process: it has no nodes to drain.
    #[error("this server runs no engine nodes (drain one with SIGTERM to its process)")]
    NoNodes,
    /// No engine node has this name.
    #[error("no engine node is named '{name}'; the engine nodes are: {}", nodes.join(", "))]
    UnknownNode {
        /// The name asked for.
        name: String,
        /// The engine nodes' names.
        nodes: Vec<String>,
    },
    /// The node is not up (down, not heard yet, or left).
    #[error("engine node '{0}' is not up (down, not heard from yet, or it left)")]
    NotUp(String),
}

/// An engine as the Router sees it: one Scheduler + KvBlockPool + GpuWorker
/// in this process, or engine nodes behind a Router.
pub trait Engine: Send + Sync + 'static {
    /// Admits a request or refuses it at once; never waits for capacity.
    fn submit(&self, req: EngineRequest) -> BoxFuture<Result<RequestStream, Rejection>>;
    /// Current figures for `/ready`.
    fn status(&self) -> BoxFuture<EngineStatus>;
    /// Admits a request whose events go to `sink`, batched per engine
    /// step with those of every other request submitted to the same sink;
    /// the returned handle is detached ([`RequestStream::detached`]).
    /// Engines with no steps of their own forward event by event.
    fn submit_to(
        &self,
        req: EngineRequest,
        sink: EventSink,
    ) -> BoxFuture<Result<RequestStream, Rejection>> {
        let submitted = self.submit(req);
        Box::pin(async move { Ok(submitted.await?.forward_to(sink)) })
    }
    /// Asks engine node `node` to drain (as on SIGTERM: no new work, what
    /// runs may finish within `grace`, then it leaves and what still runs
    /// moves). Engines without nodes refuse.
    fn drain_node(
        &self,
        node: &str,
        grace: std::time::Duration,
    ) -> BoxFuture<Result<(), DrainRefusal>> {
        let _ = (node, grace);
        Box::pin(async { Err(DrainRefusal::NoNodes) })
    }
}

/// The shape of an engine's KV blocks: two engines can exchange blocks
/// only if these agree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Tokens per block.
    pub block_size: u32,
    /// Element type (and with it the scale layout of int8).
    pub dtype: KvDtype,
    /// Version of the in-block layout (`[layer][K|V][kv_head][slot][head_dim]` = 1).
    pub layout: u8,
    /// Layers in a block.
    pub layers: u16,
    /// Bytes of one block.
    pub bytes_per_block: u64,
}

/// A finished prefill's KV, read out of its held blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvExport {
    /// Tokens whose KV the blocks hold (the prompt: the first sampled
    /// token's KV is computed by the decode side when it feeds it back).
    pub tokens: u32,
    /// Blocks, in block-table order.
    pub blocks: u32,
    /// `blocks * bytes_per_block` bytes.
    pub data: Vec<u8>,
}

/// KV blocks leaving and entering an engine: the two halves of
/// disaggregated prefill and decode.
///
/// Prefill side: [`KvMigration::submit_for_export`] runs a request whose
/// blocks stay held after it finishes; [`KvMigration::export_kv`] reads
/// them; [`KvMigration::release_kv`] gives them back (the engine also gives
/// them back by itself once `hold_for` passes).
///
/// Decode side: [`KvMigration::reserve_kv`] takes the blocks first (they go
/// back by themselves once `ttl` passes); [`KvMigration::import_kv`] writes
/// them and continues the request from its first token;
/// [`KvMigration::cancel_reservation`] gives them back early.
pub trait KvMigration: Send + Sync + 'static {
    /// This engine's block shape.
    fn kv_layout(&self) -> KvLayout;
    /// Runs `req` (the caller sets `max_tokens` to 1: only the first token
    /// is sampled here) and holds its KV blocks after it finishes.
    fn submit_for_export(
        &self,
        req: EngineRequest,
        hold_for: std::time::Duration,
    ) -> BoxFuture<Result<RequestStream, Rejection>>;
    /// The held KV of a finished request (`RequestStream::id`).
    fn export_kv(&self, id: RequestId) -> BoxFuture<Result<KvExport, String>>;
    /// Stops running request `id` (its stream gets nothing more) and
    /// holds its KV for [`KvMigration::export_kv`] as a finished
    /// prefill's, for `hold_for` at most: the request moves to another
    /// node. Returns its tokens (prompt, then generated; the held KV is
    /// that of all but the last). Refused unless it is decoding.
    fn detach_kv(
        &self,
        id: RequestId,
        hold_for: std::time::Duration,
    ) -> BoxFuture<Result<Vec<u32>, String>>;
    /// Gives back the blocks held for `id`; false if none were held.
    fn release_kv(&self, id: RequestId) -> BoxFuture<bool>;
    /// Reserves blocks for `tokens` tokens of `tenant`'s KV.
    fn reserve_kv(
        &self,
        tenant: TenantId,
        tokens: u32,
        ttl: std::time::Duration,
    ) -> BoxFuture<Result<RequestId, Rejection>>;
    /// Writes `data` (`tokens` tokens of KV, whole blocks) into the
    /// reservation and continues `req` from `first`, the token sampled by
    /// the prefill side: the stream yields `first`, then the rest (or,
    /// with a `sink`, they go there per step and the stream is detached,
    /// as with [`Engine::submit_to`]; the request keeps the reservation's
    /// id, and its first events may reach the sink before this answers).
    /// On an error the reservation is given back.
    fn import_kv(
        &self,
        reservation: RequestId,
        tokens: u32,
        data: Vec<u8>,
        req: EngineRequest,
        first: Sampled,
        sink: Option<EventSink>,
    ) -> BoxFuture<Result<RequestStream, Rejection>>;
    /// Gives back a reservation not imported; false if there was none.
    fn cancel_reservation(&self, reservation: RequestId) -> BoxFuture<bool>;
    /// Every id that holds KV or a seat here (requests, held prefills,
    /// reservations), for finding orphans.
    fn kv_holders(&self) -> BoxFuture<Vec<RequestId>>;
    /// Gives back what `id` holds because nobody owns it any more; false
    /// if it held nothing (or its import is being written).
    fn drop_orphan(&self, id: RequestId) -> BoxFuture<bool>;
}
