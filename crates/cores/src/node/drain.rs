//! Draining: no new work; a heartbeat at once so the Routers stop placing
//! work here; leave (tell the Routers, then end this life) when nothing of
//! theirs runs here, or at the grace's end.

use super::*;

impl NodeCore {
    pub(super) fn on_drain(&mut self, now: Duration, grace: Duration, out: &mut Vec<NodeOutput>) {
        let until = now + grace;
        if self.drain_until.is_none_or(|d| until < d) {
            if self.drain_until.is_none() {
                tracing::info!(
                    "draining: no new work; leaving when idle or in {} ms",
                    grace.as_millis()
                );
            }
            self.drain_until = Some(until);
        }
        // A heartbeat now, so the Routers stop placing work here at once.
        if !self.left {
            self.call_now(EngineCall::Status, out);
        }
    }

    /// Nothing of a Router's runs or waits here: no request, reservation,
    /// import, prefill, or engine answer it waits for.
    pub(super) fn idle(&self) -> bool {
        self.active.map.is_empty()
            && self.importing.is_empty()
            && self.import_tasks.is_empty()
            && self.prefills.is_empty()
            && self.pending.is_empty()
    }

    pub(super) fn leave_if_drained(&mut self, now: Duration, out: &mut Vec<NodeOutput>) {
        let Some(until) = self.drain_until else {
            return;
        };
        if self.gone || self.answers_due > 0 {
            return;
        }
        if !self.left {
            if !(self.idle() || now >= until) {
                return;
            }
            self.left = true;
            if !self.idle() {
                tracing::warn!(
                    running = self.active.map.len(),
                    prefills = self.prefills.len(),
                    "drain deadline passed: leaving; the Routers move what still runs"
                );
                // The nodes the Routers move it to ask for its KV within
                // a round trip or two; a reservation waits this long.
                if self.layout.is_some() {
                    self.leave_by = Some(now + self.opts.reservation_ttl);
                }
            }
            for &r in &self.opts.routers {
                Self::send(out, r, 0, Message::Leaving);
            }
        }
        if self.idle() || self.leave_by.is_none_or(|t| now >= t) {
            if !self.idle() {
                tracing::warn!(
                    running = self.active.map.len(),
                    prefills = self.prefills.len(),
                    "left: stopping what nobody took over"
                );
            }
            self.gone = true;
            out.push(NodeOutput::Left);
        }
    }
}
