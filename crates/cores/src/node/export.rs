//! A prefill node's side (and a draining node's, for the requests that
//! move off it with their KV): prefills run for decode nodes, transfer
//! slots granted by tier then arrival, the KV exported and sent, and its
//! blocks held until the decode node's ack (or the hold runs out).

use super::*;

/// Where a prefill for a decode node stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PfState {
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
pub(super) struct Prefill {
    pub(super) id: RequestId,
    pub(super) attempt: u32,
    pub(super) priority: u8,
    pub(super) first: Option<Sampled>,
    pub(super) state: PfState,
    /// A running request detached for a move: only this many tokens'
    /// KV are sent (the mover asked for that many).
    pub(super) kv_tokens: Option<u32>,
    /// A traced request's transfer, timed for its span.
    pub(super) xfer: Option<Box<Xfer>>,
}

/// The times of a traced prefill's KV transfer: from the prefill's end
/// (waiting for a slot) to the decode node's ack (or the end).
#[derive(Debug)]
pub(super) struct Xfer {
    pub(super) parent: TraceContext,
    pub(super) ready: Duration,
    pub(super) export: Option<Duration>,
    pub(super) send: Option<Duration>,
    pub(super) sent: Option<Duration>,
    pub(super) bytes: u64,
    pub(super) blocks: u32,
    pub(super) tokens: u32,
    pub(super) acked: bool,
    /// A running request's KV moving with it off a draining node, not a
    /// prefill's.
    pub(super) moving: bool,
}

impl Xfer {
    pub(super) fn new(parent: TraceContext, moving: bool) -> Xfer {
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

    /// Its times, ending at `now`.
    pub(super) fn span(self, decode: NodeId, failure: Option<&str>, now: Duration) -> TransferSpan {
        TransferSpan {
            decode,
            start: self.ready,
            end: now.max(self.ready),
            export: self.export,
            send: self.send,
            sent: self.sent,
            bytes: self.bytes,
            blocks: self.blocks,
            tokens: self.tokens,
            acked: self.acked,
            moving: self.moving,
            failure: failure.map(str::to_owned),
        }
    }
}

/// Transfer slots: a paid tier's KV leaves before a free tier's that
/// waited longer.
pub(super) struct Slots {
    pub(super) free: usize,
    /// (priority, arrival, prefill): the highest priority first, then the
    /// earliest. Entries of prefills ended while waiting are skipped.
    pub(super) waiting: BinaryHeap<(u8, Reverse<u64>, PfKey)>,
    pub(super) seq: u64,
}

impl Slots {
    pub(super) fn new(n: usize) -> Slots {
        Slots {
            free: n,
            waiting: BinaryHeap::new(),
            seq: 0,
        }
    }
}

impl NodeCore {
    /// Tells node `to` that the KV it asked for (the Router's request
    /// `req`) will not come, and why.
    pub(super) fn prefill_failed(
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

    pub(super) fn on_prefill_ask(
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
    pub(super) fn on_move_ask(&mut self, key: PfKey, pm: PrefillMsg, out: &mut Vec<NodeOutput>) {
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
    pub(super) fn on_detached(
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
    pub(super) fn wait_slot(&mut self, key: PfKey, out: &mut Vec<NodeOutput>) {
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

    pub(super) fn prefill_event(&mut self, key: PfKey, ev: EngineEvent, out: &mut Vec<NodeOutput>) {
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
    pub(super) fn grant_slots(&mut self, out: &mut Vec<NodeOutput>) {
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
    pub(super) fn end_prefill(
        &mut self,
        key: PfKey,
        failure: Option<String>,
        out: &mut Vec<NodeOutput>,
    ) {
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

    /// A prefill for a decode node was admitted (or refused) here.
    pub(super) fn on_export_submitted(
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

    /// A prefill's KV was exported: checksum it and send it to its decode
    /// node.
    pub(super) fn on_exported(
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
        let data = Bytes::from(exp.data);
        // What the decode node checks when it lands (`import`), checked
        // where it leaves: a transfer this node would refuse never goes.
        debug_assert_eq!(
            import::check_header(&header, layout, &self.opts.model, exp.tokens as usize),
            Ok(()),
            "a transfer that its own layout refuses"
        );
        debug_assert_eq!(
            import::check_payload(&header, std::slice::from_ref(&data)),
            Ok(())
        );
        out.push(NodeOutput::SendBulk {
            id,
            to: decode,
            header,
            data,
        });
    }

    /// A prefill's KV went out (or could not): hold it for the decode
    /// node's ack, or end the prefill.
    pub(super) fn on_bulk_sent(
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
}
