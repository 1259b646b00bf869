//! Each Router's link: its epoch and when it was last heard (a restart
//! or a silence past the down bound ends what it left here), the requests
//! run for it and their events on the way back (one batch per Router per
//! input, in stream order), the engine answers to its submits, the
//! heartbeat, and the orphan hunt (leases nobody owns, requests the Router
//! no longer has here).

use super::*;

impl NodeCore {
    /// Any message proves a Router alive; a new epoch means it restarted
    /// and everything from its old life is orphaned.
    pub(super) fn heard(
        &mut self,
        now: Duration,
        from: NodeId,
        epoch: u64,
        out: &mut Vec<NodeOutput>,
    ) {
        if !self.opts.routers.contains(&from) {
            return;
        }
        let known = self.routers.get(&from).map(|r| r.0);
        // The last life heard of, kept after a silence forgets the
        // Router: one that died and came back after the down bound is a
        // new life all the same, and our link still reaches the old one.
        let last = self.router_epochs.get(&from).copied();
        if last.is_some_and(|e| epoch > e) {
            out.push(NodeOutput::Reconnect(from));
            self.active
                .stop_where(|k| k.0 == from && k.1 < epoch, &Stop::Cancel, out);
            let old: Vec<(NodeId, u64)> = self
                .importing
                .iter()
                .filter(|(k, e)| k.0 == from && e.epoch < epoch)
                .map(|(k, _)| *k)
                .collect();
            for k in old {
                let e = self.importing.remove(&k).expect("listed above");
                drop_import(k, &e, out);
            }
        }
        let e = known.map_or(epoch, |e| e.max(epoch));
        self.routers.insert(from, (e, now));
        self.router_epochs
            .insert(from, last.map_or(epoch, |l| l.max(epoch)));
        if known.is_none_or(|k| epoch > k) {
            // A Router new to this life (or restarted) has none of its
            // prefix cache: the whole first, then the changes.
            self.prefix.insert(
                from,
                PrefixLink {
                    seq: 0,
                    want_snapshot: true,
                },
            );
        }
    }

    /// The prefix cache's changes (or contents) from the engine, to the
    /// Routers: numbered per Router, split to fit the frame cap.
    pub(super) fn on_prefix(
        &mut self,
        snapshot: bool,
        changes: PrefixChanges,
        out: &mut Vec<NodeOutput>,
    ) {
        // Whole contents (asked for, or the engine's log overflowed) go to
        // every Router that waits for them (all of them, for an
        // overflow); changes to those that have had the contents.
        let overflow = !snapshot && changes.full;
        let full = snapshot || overflow;
        let per = (self.opts.frame_len_max_bytes as usize / 8)
            .saturating_sub(512)
            .max(64);
        for (&r, link) in self.prefix.iter_mut() {
            if !overflow && snapshot != link.want_snapshot {
                continue;
            }
            if !full && changes.stored.is_empty() && changes.removed.is_empty() {
                continue;
            }
            link.want_snapshot = false;
            let chunks = prefix_chunks(&changes, full, per);
            for c in chunks {
                link.seq += 1;
                Self::send(
                    out,
                    r,
                    0,
                    Message::Prefix {
                        seq: link.seq,
                        changes: c,
                    },
                );
            }
        }
    }

    pub(super) fn on_submit(
        &mut self,
        from: NodeId,
        epoch: u64,
        mut s: Submit,
        out: &mut Vec<NodeOutput>,
    ) {
        let req = s.req;
        let tenant = s.request.tenant;
        if self.drain_until.is_some() {
            // The Router places it elsewhere.
            let rejection = Rejection::Unavailable;
            Self::send(out, from, req, Message::Refused { req, rejection });
            return;
        }
        if tenant.0 >= self.opts.num_tenants {
            let rejection = Rejection::Invalid(format!(
                "unknown tenant {} (the config has {})",
                tenant.0, self.opts.num_tenants
            ));
            Self::send(out, from, req, Message::Refused { req, rejection });
            return;
        }
        if let Some(&(cancelled, _)) = self.cancelled.get(&(from, epoch, req))
            && cancelled >= s.attempt
        {
            // Its Cancel came first: the Router runs it elsewhere, or
            // nowhere.
            tracing::debug!(req, attempt = s.attempt, "submit after its cancel: dropped");
            self.cancelled.remove(&(from, epoch, req));
            return;
        }
        let here = self
            .active
            .attempt(&(from, epoch, req))
            .or_else(|| self.importing.get(&(from, req)).map(|e| e.submit.attempt));
        if let Some(a) = here {
            if a >= s.attempt {
                // A duplicate (a resend after a reconnect), or a late
                // copy of an earlier placement.
                return;
            }
            // A re-run placed here again that overtook the Cancel of the
            // earlier placement: end that one.
            self.end_placement((from, epoch, req), s.attempt - 1, Stop::Cancel, out);
        }
        let kv_move = s.kv_move
            && self.layout.is_some()
            && self.opts.role != Role::Prefill
            && s.request.prompt.len() >= 2;
        if s.kv_move && !kv_move {
            // Not by its KV: the whole request (prompt and the tokens its
            // client has) is computed here, as after a node loss.
            s.kv_move = false;
            s.prefill = None;
        }
        let disaggregated = self.layout.is_some() && self.opts.role == Role::Decode;
        if let Some(prefill) = s.prefill.filter(|_| kv_move || disaggregated) {
            // Disaggregated (or moved with its KV): blocks first, then ask
            // for the prefill (or the KV).
            let ticket = self.ticket();
            let ttl = self.opts.reservation_ttl + self.opts.heartbeat_interval * 4;
            // A move's last prompt token is fed, not imported.
            let tokens = (s.request.prompt.len() - usize::from(kv_move)) as u32;
            self.pending.insert(
                ticket,
                Pending::Reserve {
                    router: from,
                    epoch,
                    submit: s,
                    prefill,
                },
            );
            let call = EngineCall::Reserve {
                ticket,
                tenant,
                tokens,
                ttl,
            };
            self.call_now(call, out);
            return;
        }
        tracing::debug!(req, "submit (whole request)");
        let ticket = self.ticket();
        let key = (from, epoch, req);
        let attempt = s.attempt;
        self.pending
            .insert(ticket, Pending::Submit { key, attempt });
        let call = EngineCall::Submit {
            ticket,
            request: s.request,
        };
        self.call_now(call, out);
    }

    /// A Router's request was admitted or refused by the engine.
    pub(super) fn on_submitted(
        &mut self,
        ticket: Ticket,
        result: Result<RequestId, Rejection>,
        out: &mut Vec<NodeOutput>,
    ) {
        self.answered();
        let Some(Pending::Submit { key, attempt }) = self.pending.remove(&ticket) else {
            self.broken
                .get_or_insert_with(|| format!("submit answer {ticket} unasked"));
            return;
        };
        let (router, _, req) = key;
        let reply = match result {
            Ok(id) => {
                self.active.insert(key, id, attempt, false, out);
                Message::Admitted { req }
            }
            Err(rejection) => Message::Refused { req, rejection },
        };
        Self::send(out, router, req, reply);
    }

    /// The engine's status, sent to every Router as this node's heartbeat.
    pub(super) fn on_status(&mut self, mut report: EngineStatus, out: &mut Vec<NodeOutput>) {
        self.answered();
        report.orphans = self.orphans.found;
        report.draining = self.drain_until.is_some();
        for &r in &self.opts.routers {
            // Unreachable Routers are noticed by their silence.
            Self::send(out, r, 0, Message::Heartbeat(report.clone()));
        }
    }

    /// A Router named leases it does not know: those it named twice in a
    /// row nobody will end but us.
    pub(super) fn on_unknown(
        &mut self,
        from: NodeId,
        epoch: u64,
        held: Vec<Held>,
        out: &mut Vec<NodeOutput>,
    ) {
        let before = self.orphans.unknown.remove(&from).unwrap_or_default();
        let mut named = BTreeSet::new();
        for h in held {
            if !before.contains(&h) {
                named.insert(h);
                continue;
            }
            let req = h.req;
            let gave_back = if let Some(d) = h.for_decode {
                let keys: Vec<PfKey> = self
                    .prefills
                    .keys()
                    .filter(|k| k.0 == d && k.2 == from && k.3 == req)
                    .copied()
                    .collect();
                for k in &keys {
                    self.end_prefill(*k, None, out);
                }
                !keys.is_empty()
            } else {
                // That placement or an earlier one, never a later one
                // made after the Router answered.
                self.end_placement((from, epoch, req), h.attempt, Stop::Cancel, out)
            };
            if gave_back {
                self.orphan(
                    format!(
                        "node {}: {h:?} of router {from}, which the Router no longer has here",
                        self.me
                    ),
                    out,
                );
            }
        }
        self.orphans.unknown.insert(from, named);
    }

    pub(super) fn orphan(&mut self, what: String, out: &mut Vec<NodeOutput>) {
        self.orphans.found += 1;
        out.push(NodeOutput::Orphan(what));
    }

    /// An engine lease owned by no request here was dropped (or was gone).
    pub(super) fn on_orphan_dropped(
        &mut self,
        id: RequestId,
        dropped: bool,
        out: &mut Vec<NodeOutput>,
    ) {
        self.answered();
        if dropped {
            let what = format!(
                "node {}: engine lease {id} owned by no request here",
                self.me
            );
            self.orphan(what, out);
        } else {
            self.orphans.unowned.insert(id);
        }
    }

    /// Engine leases that none of this node's entries owns: suspect at
    /// this look, given back if suspect at the last one as well.
    pub(super) fn on_holders(&mut self, holders: Vec<RequestId>, out: &mut Vec<NodeOutput>) {
        let owned: BTreeSet<RequestId> = self
            .active
            .by_id
            .keys()
            .copied()
            .chain(self.importing.values().map(|e| e.reservation))
            .chain(self.pf_by_id.keys().copied())
            .chain(self.import_tasks.keys().copied())
            .collect();
        let before = std::mem::take(&mut self.orphans.unowned);
        for id in holders.into_iter().filter(|id| !owned.contains(id)) {
            if before.contains(&id) {
                self.call_now(EngineCall::DropOrphan(id), out);
            } else {
                self.orphans.unowned.insert(id);
            }
        }
    }

    pub(super) fn on_undelivered(
        &mut self,
        to: NodeId,
        msg: Message,
        reason: &str,
        out: &mut Vec<NodeOutput>,
    ) {
        match msg {
            Message::Admitted { req } => {
                // The Router will not hear of it: do not run it.
                if let Some(e) = self.importing.remove(&(to, req)) {
                    drop_import((to, req), &e, out);
                }
                let keys: Vec<Key> = self
                    .active
                    .map
                    .keys()
                    .filter(|k| k.0 == to && k.2 == req)
                    .copied()
                    .collect();
                for k in keys {
                    self.active.stop(&k, &Stop::Cancel, out);
                }
            }
            Message::Prefill(pm) => {
                let key = (pm.router, pm.submit.req);
                let ours = self.importing.get(&key).is_some_and(|e| {
                    e.prefill == to && !e.writing && e.submit.attempt == pm.submit.attempt
                });
                if ours {
                    let e = self.importing.remove(&key).expect("checked above");
                    out.push(NodeOutput::Call(EngineCall::CancelReservation(
                        e.reservation,
                    )));
                    let why = format!("cannot reach prefill node {to}: {reason}");
                    fail(&mut self.active.outbox, key, &e, why);
                }
            }
            // A lost report: the Router gets the whole at the next
            // heartbeat (changes after a lost one would be a gap).
            Message::Prefix { .. } => {
                if let Some(l) = self.prefix.get_mut(&to) {
                    l.want_snapshot = true;
                }
            }
            // The rest is noticed by silence (a Router's requests are
            // cancelled when it is found silent) or by timeouts.
            m => tracing::debug!(to, "not delivered: {:?} ({reason})", m.kind()),
        }
    }

    /// Ends request `key` of a Router on this node, running or being
    /// imported, if its placement is `attempt` or earlier (a later re-run
    /// stays). True if something was ended.
    pub(super) fn end_placement(
        &mut self,
        key: Key,
        attempt: u32,
        stop: Stop,
        out: &mut Vec<NodeOutput>,
    ) -> bool {
        let (router, _, req) = key;
        let mut ended = false;
        if self.active.attempt(&key).is_some_and(|a| a <= attempt) {
            ended = self.active.stop(&key, &stop, out);
        }
        if self
            .importing
            .get(&(router, req))
            .is_some_and(|e| e.submit.attempt <= attempt)
            && let Some(e) = self.importing.remove(&(router, req))
        {
            drop_import((router, req), &e, out);
            ended = true;
        }
        ended
    }
}

/// Orphan hunting state: what was suspect at the last look. A lease is
/// an orphan only if it is suspect at two looks in a row, a reconcile
/// interval apart, so requests in the middle of being set up or torn
/// down (a reply in flight, an ack on its way) are never taken for one.
pub(super) struct Orphans {
    pub(super) next: Duration,
    /// Engine ids that none of this node's entries owned at the last look.
    pub(super) unowned: BTreeSet<RequestId>,
    /// Per Router: what was held at the last look (only those are sent
    /// in `Holding`, so every one named is at least an interval old).
    pub(super) held: BTreeMap<NodeId, BTreeSet<Held>>,
    /// Per Router: what its last `Unknown` named.
    pub(super) unknown: BTreeMap<NodeId, BTreeSet<Held>>,
    /// Requests given back as orphans since start.
    pub(super) found: u64,
}

impl Orphans {
    pub(super) fn new(next: Duration) -> Orphans {
        Orphans {
            next,
            unowned: BTreeSet::new(),
            held: BTreeMap::new(),
            unknown: BTreeMap::new(),
            found: 0,
        }
    }
}

/// A request running here for a Router.
pub(super) struct Running {
    /// The engine's id (the shell holds its handle).
    pub(super) id: RequestId,
    /// The placement (`Submit::attempt`).
    pub(super) attempt: u32,
    /// Events sent to the Router so far: the next one's index.
    pub(super) index: u32,
    /// Moved here with its KV: its first token (the import's, which the
    /// client had from the node it left) is not sent, and its usage
    /// counts that token as prompt, as the Router's request does.
    pub(super) resumed: bool,
    /// The first token is still to come (and to be dropped).
    pub(super) skip_first: bool,
}

/// The requests running here for Routers, and their events on the way
/// back.
pub(super) struct Active {
    pub(super) map: BTreeMap<Key, Running>,
    /// The Router's key of each engine request.
    pub(super) by_id: BTreeMap<RequestId, Key>,
    /// Events of imports whose answer has not come yet (the engine
    /// delivers an import's first token as it answers): kept until the
    /// import is placed here, or dropped with it.
    pub(super) early: BTreeMap<RequestId, Vec<EngineEvent>>,
    pub(super) outbox: Outbox,
}

impl Active {
    pub(super) fn new(frame_len_max_bytes: u32) -> Active {
        Active {
            map: BTreeMap::new(),
            by_id: BTreeMap::new(),
            early: BTreeMap::new(),
            outbox: Outbox::new(frame_len_max_bytes),
        }
    }

    /// The placement running under `key`, if any.
    pub(super) fn attempt(&self, key: &Key) -> Option<u32> {
        self.map.get(key).map(|r| r.attempt)
    }

    /// Runs engine request `id` (placement `attempt`) under `key`; one
    /// still there is ended. Events that came for it before are sent now.
    pub(super) fn insert(
        &mut self,
        key: Key,
        id: RequestId,
        attempt: u32,
        resumed: bool,
        out: &mut Vec<NodeOutput>,
    ) {
        let running = Running {
            id,
            attempt,
            index: 0,
            resumed,
            skip_first: resumed,
        };
        if let Some(old) = self.map.insert(key, running) {
            self.by_id.remove(&old.id);
            out.push(NodeOutput::EndStream {
                id: old.id,
                stop_string: false,
            });
        }
        self.by_id.insert(id, key);
        if let Some(early) = self.early.remove(&id) {
            for ev in early {
                if !self.by_id.contains_key(&id) {
                    break;
                }
                self.event(id, ev, out);
            }
        }
    }

    /// Ends the request under `key`; false if none runs.
    pub(super) fn stop(&mut self, key: &Key, why: &Stop, out: &mut Vec<NodeOutput>) -> bool {
        let Some(r) = self.map.remove(key) else {
            return false;
        };
        self.by_id.remove(&r.id);
        if let Stop::RouterSilent(why) = why {
            let ev = EngineEvent::Failed(EngineFailure::RouterLost(why.clone()));
            self.outbox.push(key.0, key.2, r.attempt, r.index, ev);
        }
        // Dropping the handle ends it in the engine.
        out.push(NodeOutput::EndStream {
            id: r.id,
            stop_string: matches!(why, Stop::Finished),
        });
        true
    }

    /// Forgets the request under `key` without ending it in the engine
    /// (it is being detached for a move).
    pub(super) fn forget(&mut self, key: &Key) {
        if let Some(r) = self.map.remove(key) {
            self.by_id.remove(&r.id);
        }
    }

    pub(super) fn stop_where(
        &mut self,
        f: impl Fn(&Key) -> bool,
        why: &Stop,
        out: &mut Vec<NodeOutput>,
    ) {
        let keys: Vec<Key> = self.map.keys().filter(|k| f(k)).copied().collect();
        for k in keys {
            self.stop(&k, why, out);
        }
    }

    /// One event of running request `id`: onto its Router's batch, in
    /// order; an ended request is forgotten (its handle dropped).
    pub(super) fn event(&mut self, id: RequestId, mut ev: EngineEvent, out: &mut Vec<NodeOutput>) {
        let key = self.by_id[&id];
        let r = self
            .map
            .get_mut(&key)
            .expect("by_id names running requests");
        if r.skip_first && matches!(ev, EngineEvent::Token(_)) {
            r.skip_first = false;
            return;
        }
        if r.resumed
            && let EngineEvent::Finished { usage, .. } = &mut ev
        {
            usage.prompt_tokens += 1;
            usage.completion_tokens = usage.completion_tokens.saturating_sub(1);
        }
        let end = !matches!(ev, EngineEvent::Token(_));
        self.outbox.push(key.0, key.2, r.attempt, r.index, ev);
        r.index += 1;
        if end {
            self.by_id.remove(&id);
            self.map.remove(&key);
            out.push(NodeOutput::EndStream {
                id,
                stop_string: false,
            });
        }
    }
}

/// Events on their way to the Routers: one batch per Router, sent at the
/// end of each input (a step's events leave as one frame), or earlier
/// once a batch nears the frame cap.
pub(super) struct Outbox {
    /// A conservative size estimate keeps every batch well under the cap.
    pub(super) budget: usize,
    pub(super) per_router: BTreeMap<NodeId, (Vec<ReqEvents>, usize)>,
    pub(super) full: Vec<(NodeId, Vec<ReqEvents>)>,
}

impl Outbox {
    pub(super) fn new(frame_len_max_bytes: u32) -> Outbox {
        Outbox {
            budget: (frame_len_max_bytes / 4) as usize,
            per_router: BTreeMap::new(),
            full: Vec::new(),
        }
    }

    /// Queues event `index` of the Router's request `req` (placement
    /// `attempt`).
    pub(super) fn push(
        &mut self,
        router: NodeId,
        req: u64,
        attempt: u32,
        index: u32,
        event: EngineEvent,
    ) {
        let (batch, size) = self.per_router.entry(router).or_default();
        let reuse = matches!(batch.last(), Some(r) if r.req == req && r.attempt == attempt
            && r.first + r.events.len() as u32 == index && r.end().is_none());
        if !reuse {
            batch.push(ReqEvents {
                req,
                attempt,
                first: index,
                events: Vec::new(),
            });
            *size += 32;
        }
        *size += match &event {
            EngineEvent::Token(s) => 24 + 8 * s.top.len(),
            EngineEvent::Failed(f) => 64 + f.to_string().len(),
            EngineEvent::Finished { .. } => 64,
        };
        batch.last_mut().expect("pushed above").events.push(event);
        if *size >= self.budget {
            let (b, _) = self.per_router.remove(&router).expect("entry exists");
            self.full.push((router, b));
        }
    }

    /// Everything queued, as one message per batch.
    pub(super) fn flush(&mut self, out: &mut Vec<NodeOutput>) {
        if self.is_empty() {
            return;
        }
        let batches = self.full.drain(..).chain(
            std::mem::take(&mut self.per_router)
                .into_iter()
                .map(|(r, (b, _))| (r, b)),
        );
        for (to, batch) in batches {
            // What the Router's reorder buffer relies on when it lands: a
            // run of a request's events is never empty, and only its last
            // may end the request.
            debug_assert!(
                batch
                    .iter()
                    .all(|r| r.events.split_last().is_some_and(|(_, before)| before
                        .iter()
                        .all(|e| matches!(e, EngineEvent::Token(_))))),
                "an empty run, or events after a request's end, for router {to}"
            );
            if !batch.is_empty() {
                out.push(NodeOutput::Send {
                    to,
                    correlation: 0,
                    msg: Message::Events(batch),
                });
            }
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.full.is_empty() && self.per_router.is_empty()
    }
}

/// `changes` split into messages of at most `per` hashes each (stored
/// first, then removed); with `full`, the first says the contents follow
/// (it replaces what the Router had), the rest add to it.
fn prefix_chunks(changes: &PrefixChanges, full: bool, per: usize) -> Vec<PrefixChanges> {
    let mut out = vec![PrefixChanges {
        full,
        ..PrefixChanges::default()
    }];
    let room = |c: &PrefixChanges| c.stored.len() + c.removed.len() < per;
    for &h in &changes.stored {
        if !room(out.last().expect("never empty")) {
            out.push(PrefixChanges::default());
        }
        out.last_mut().expect("never empty").stored.push(h);
    }
    // A full cache has nothing removed: the contents say it all.
    if !full {
        for &h in &changes.removed {
            if !room(out.last().expect("never empty")) {
                out.push(PrefixChanges::default());
            }
            out.last_mut().expect("never empty").removed.push(h);
        }
    }
    out
}
