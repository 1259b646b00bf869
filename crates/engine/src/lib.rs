//! The in-process engine handle the Router drives: the [`Engine`] trait
//! (and [`KvMigration`], its disaggregated half), and the [`RequestStream`]
//! a submitted request's events arrive on. Apart from `flotilla-proto` (the
//! messages, which need no runtime) so that the pure crates (`sched`,
//! `kv`, the cluster cores) build without tokio.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use flotilla_proto::{
    DrainRefusal, EngineEvent, EngineFailure, EngineRequest, EngineStatus, KvExport, KvLayout,
    PrefixChanges, Rejection, RequestId, Sampled, StepEvents, TenantId,
};
use tokio::sync::mpsc;

/// The events of one accepted request. Dropping it cancels the request: the
/// engine drops it from its queue or batch at the next step and its blocks
/// go back to the pool. A stream the Router ended at a stop string is marked
/// first ([`RequestStream::ended_by_stop_string`]), so the engine finishes
/// the request (counted as finished, with its latencies) instead.
pub struct RequestStream {
    /// The engine's id for the request.
    pub id: RequestId,
    /// `None` for a request whose events go to an [`EventSink`].
    rx: Option<StreamRx>,
    on_drop: Option<Box<dyn FnOnce(bool) + Send>>,
    stop_string: bool,
}

/// Where a stream's events come from: one by one, or in chunks (a step's
/// tokens of one request, then possibly its end) with the rest of the
/// chunk being handed out.
enum StreamRx {
    One(mpsc::UnboundedReceiver<EngineEvent>),
    Chunks(
        mpsc::UnboundedReceiver<StreamChunk>,
        std::collections::VecDeque<EngineEvent>,
    ),
}

/// Events of one request that came together, for a stream fed by
/// [`RequestStream::batched`]: one alone travels without a vector.
#[derive(Debug)]
pub enum StreamChunk {
    /// One event.
    One(EngineEvent),
    /// Several, in order.
    Many(Vec<EngineEvent>),
}

impl From<Vec<EngineEvent>> for StreamChunk {
    fn from(mut v: Vec<EngineEvent>) -> Self {
        if v.len() == 1 {
            StreamChunk::One(v.pop().expect("one event"))
        } else {
            StreamChunk::Many(v)
        }
    }
}

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
            rx: Some(StreamRx::One(rx)),
            on_drop: Some(on_drop),
            stop_string: false,
        }
    }

    /// A stream fed in chunks by `rx` (a Router hands on each node
    /// message's events for a request as one); otherwise as
    /// [`RequestStream::new`].
    pub fn batched(
        id: RequestId,
        rx: mpsc::UnboundedReceiver<StreamChunk>,
        on_drop: Box<dyn FnOnce(bool) + Send>,
    ) -> Self {
        RequestStream {
            id,
            rx: Some(StreamRx::Chunks(rx, Default::default())),
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
            Some(StreamRx::One(rx)) => rx.recv().await,
            Some(StreamRx::Chunks(rx, buf)) => {
                if let Some(ev) = buf.pop_front() {
                    return Some(ev);
                }
                loop {
                    match rx.recv().await? {
                        StreamChunk::One(ev) => return Some(ev),
                        StreamChunk::Many(v) => {
                            buf.extend(v);
                            if let Some(ev) = buf.pop_front() {
                                return Some(ev);
                            }
                        }
                    }
                }
            }
            None => None,
        }
    }

    /// The next events, at least one, as many as have come together;
    /// `None` as for [`RequestStream::recv`].
    pub async fn recv_chunk(&mut self) -> Option<StreamChunk> {
        match &mut self.rx {
            Some(StreamRx::One(rx)) => rx.recv().await.map(StreamChunk::One),
            Some(StreamRx::Chunks(rx, buf)) => {
                if !buf.is_empty() {
                    return Some(StreamChunk::Many(buf.drain(..).collect()));
                }
                loop {
                    match rx.recv().await? {
                        StreamChunk::Many(v) if v.is_empty() => continue,
                        chunk => return Some(chunk),
                    }
                }
            }
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
    /// What the prefix cache registered and dropped since the last call,
    /// by block hash (`full`: its whole contents, where more changed than
    /// its log holds), or with `snapshot` its contents, the log left as
    /// it is: the stream the cluster's Routers follow. None: this engine
    /// reports no prefix cache (test doubles); its Routers keep their own
    /// record of what they sent it.
    fn prefix_changes(&self, snapshot: bool) -> BoxFuture<Option<PrefixChanges>> {
        let _ = snapshot;
        Box::pin(async { None })
    }
    /// Gives back what `id` holds because nobody owns it any more; false
    /// if it held nothing (or its import is being written).
    fn drop_orphan(&self, id: RequestId) -> BoxFuture<bool>;
}
