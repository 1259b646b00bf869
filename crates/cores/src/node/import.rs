//! A decode node's side of disaggregated prefill (and of a request moved
//! here with its KV): blocks reserved for the request, the prefill node
//! asked, the transfer checked (header against this node's cache, length
//! and checksum against the header) before it is written, and the
//! request placed under the reservation's id, or failed at its Router.

use super::*;

/// Decode side: a request whose blocks are reserved and whose KV has not
/// been imported yet.
pub(super) struct Importing {
    /// The Router's epoch.
    pub(super) epoch: u64,
    pub(super) reservation: RequestId,
    pub(super) prefill: NodeId,
    pub(super) deadline: Duration,
    pub(super) submit: Submit,
    /// Its bytes arrived and are being written: the import owns the
    /// reservation now and acks the prefill node when it is done.
    pub(super) writing: bool,
    /// A move by KV migration: `submit` is in its resumed form (the last
    /// prompt token is the import's first token, which the client has).
    pub(super) resumed: bool,
}

impl NodeCore {
    /// KV blocks were reserved (or refused) for a request whose prompt
    /// another node computes: admit it and ask that node for the KV.
    pub(super) fn on_reserved(
        &mut self,
        now: Duration,
        ticket: Ticket,
        result: Result<RequestId, Rejection>,
        out: &mut Vec<NodeOutput>,
    ) {
        self.answered();
        let Some(Pending::Reserve {
            router,
            epoch,
            submit,
            prefill,
        }) = self.pending.remove(&ticket)
        else {
            self.broken
                .get_or_insert_with(|| format!("reserve answer {ticket} unasked"));
            return;
        };
        let req = submit.req;
        let reservation = match result {
            Ok(r) => r,
            Err(rejection) => {
                Self::send(out, router, req, Message::Refused { req, rejection });
                return;
            }
        };
        Self::send(out, router, req, Message::Admitted { req });
        let ask = Message::Prefill(PrefillMsg {
            router,
            submit: Submit {
                prefill: None,
                ..submit.clone()
            },
            priority: self.opts.priority(submit.request.tenant.0),
        });
        Self::send(out, prefill, req, ask);
        let resumed = submit.kv_move;
        let mut submit = submit;
        if resumed {
            // Continued from its last prompt token, which the
            // import feeds as its first (and does not send: the
            // client has it), so one more token is allowed.
            submit.request.prompt.pop();
            submit.request.max_tokens += 1;
            tracing::debug!(
                req,
                from = prefill,
                "KV reserved, asked for the moving request's KV"
            );
        } else {
            tracing::debug!(req, prefill, "KV reserved, prefill asked");
        }
        let e = Importing {
            epoch,
            reservation,
            prefill,
            deadline: now + self.opts.reservation_ttl,
            submit,
            writing: false,
            resumed,
        };
        self.importing.insert((router, req), e);
    }

    pub(super) fn on_bulk(
        &mut self,
        from: NodeId,
        header: KvTransferHeader,
        data: Vec<Bytes>,
        out: &mut Vec<NodeOutput>,
    ) {
        let key = (header.router, header.req);
        let ack_no = |out: &mut Vec<NodeOutput>, why: &str| {
            tracing::warn!(req = header.req, "KV from node {from} discarded: {why}");
            let ack = Message::KvAck {
                router: header.router,
                req: header.req,
                ok: false,
            };
            Self::send(out, from, header.req, ack);
        };
        let Some(layout) = &self.layout else {
            ack_no(out, "this node imports no KV");
            return;
        };
        let Some(e) = self
            .importing
            .get_mut(&key)
            .filter(|e| e.prefill == from && !e.writing)
        else {
            // Cancelled or expired meanwhile: the sender may free its blocks.
            ack_no(out, "no request waits for it");
            return;
        };
        if let Err(why) = check_header(
            &header,
            layout,
            &self.opts.model,
            e.submit.request.prompt.len(),
        ) {
            ack_no(out, &why);
            let e = self.importing.remove(&key).expect("looked up above");
            drop_import(key, &e, out);
            fail(&mut self.active.outbox, key, &e, why);
            return;
        }
        // The bytes are the header's: a transfer cut short or changed on
        // the way is refused before anything is written.
        if let Err(why) = check_payload(&header, &data) {
            ack_no(out, &why);
            let e = self.importing.remove(&key).expect("looked up above");
            out.push(NodeOutput::Call(EngineCall::CancelReservation(
                e.reservation,
            )));
            fail(&mut self.active.outbox, key, &e, why);
            return;
        }
        let e = self.importing.get_mut(&key).expect("looked up above");
        e.writing = true;
        self.import_tasks.insert(e.reservation, (key, from));
        out.push(NodeOutput::Call(EngineCall::Import {
            reservation: e.reservation,
            header,
            data,
            request: e.submit.request.clone(),
        }));
    }

    pub(super) fn on_imported(
        &mut self,
        reservation: RequestId,
        result: Result<RequestId, String>,
        out: &mut Vec<NodeOutput>,
    ) {
        let Some((key, prefill)) = self.import_tasks.remove(&reservation) else {
            self.broken
                .get_or_insert_with(|| format!("import {reservation} answered twice"));
            return;
        };
        // Placed below (the request keeps the reservation's id) or
        // dropped: its early events go with it either way.
        let early = self.active.early.remove(&reservation);
        let ok = result.is_ok();
        tracing::debug!(req = key.1, ok, "import done");
        let ack = Message::KvAck {
            router: key.0,
            req: key.1,
            ok,
        };
        Self::send(out, prefill, key.1, ack);
        // Only the placement this import was for: if the Router cancelled
        // it and placed the request here again, the entry now is the new
        // placement's (its own reservation, its own prefill), which this
        // import must not end.
        let mine = self
            .importing
            .get(&key)
            .is_some_and(|e| e.reservation == reservation && e.writing);
        let entry = if mine {
            self.importing.remove(&key)
        } else {
            None
        };
        match (entry, result) {
            (Some(e), Ok(id)) => {
                if let Some(ev) = early {
                    self.active.early.insert(id, ev);
                }
                let k = (key.0, e.epoch, key.1);
                self.active.insert(k, id, e.submit.attempt, e.resumed, out);
            }
            // Cancelled while its bytes were written: ending the stream
            // frees its blocks.
            (None, Ok(id)) => out.push(NodeOutput::EndStream {
                id,
                stop_string: false,
            }),
            (Some(e), Err(why)) => fail(&mut self.active.outbox, key, &e, why),
            (None, Err(_)) => {}
        }
    }
}

/// Gives back a reservation and tells its prefill node to stop (unless
/// its bytes are being written: the import gives it back and acks).
pub(super) fn drop_import(key: (NodeId, u64), e: &Importing, out: &mut Vec<NodeOutput>) {
    tracing::debug!(req = key.1, writing = e.writing, "import dropped");
    if e.writing {
        return;
    }
    out.push(NodeOutput::Call(EngineCall::CancelReservation(
        e.reservation,
    )));
    let cancel = Message::PrefillCancel {
        router: key.0,
        req: key.1,
        attempt: e.submit.attempt,
    };
    NodeCore::send(out, e.prefill, key.1, cancel);
}

/// Ends a placement that streamed nothing yet (an import) at the Router.
pub(super) fn fail_import(out: &mut Outbox, key: (NodeId, u64), e: &Importing, why: EngineFailure) {
    // Before any token: no stream was forwarded for it.
    out.push(key.0, key.1, e.submit.attempt, 0, EngineEvent::Failed(why));
}

pub(super) fn fail(out: &mut Outbox, key: (NodeId, u64), e: &Importing, why: String) {
    fail_import(out, key, e, EngineFailure::KvTransfer(why));
}

/// Whether a transfer fits this node's cache and the request it is for.
pub(super) fn check_header(
    h: &KvTransferHeader,
    layout: &KvLayout,
    model: &str,
    prompt_len: usize,
) -> Result<(), String> {
    let blocks = (prompt_len as u64).div_ceil(u64::from(layout.block_size.max(1)));
    if h.model != model {
        return Err(format!(
            "KV of model '{}', this node serves '{model}'",
            h.model
        ));
    }
    if h.block_size != layout.block_size
        || h.dtype != layout.dtype
        || h.layout != layout.layout
        || h.layer_start != 0
        || h.layer_end != layout.layers
    {
        return Err(format!(
            "KV layout differs: blocks of {} tokens, dtype {}, layout {}, layers {}..{}; \
             this node has {} tokens, dtype {}, layout {}, {} layers",
            h.block_size,
            h.dtype,
            h.layout,
            h.layer_start,
            h.layer_end,
            layout.block_size,
            layout.dtype,
            layout.layout,
            layout.layers
        ));
    }
    if h.token_count as usize != prompt_len
        || u64::from(h.block_count) != blocks
        || h.bytes != blocks * layout.bytes_per_block
    {
        return Err(format!(
            "transfer of {} tokens in {} blocks ({} bytes) for a prompt of {prompt_len} tokens \
             ({blocks} blocks of {} bytes)",
            h.token_count, h.block_count, h.bytes, layout.bytes_per_block
        ));
    }
    Ok(())
}

/// Whether a transfer's bytes are the ones its header names: their
/// length, and their CRC-32 (the prefill node's, over the whole payload).
pub(super) fn check_payload(h: &KvTransferHeader, data: &[Bytes]) -> Result<(), String> {
    let mut crc = crc32fast::Hasher::new();
    let mut len = 0u64;
    for piece in data {
        crc.update(piece);
        len += piece.len() as u64;
    }
    let sum = u64::from(crc.finalize());
    if len != h.bytes || sum != h.checksum {
        return Err(format!(
            "KV transfer corrupt: {len} of {} bytes, checksum {sum:#x}, expected {:#x}",
            h.bytes, h.checksum
        ));
    }
    Ok(())
}
