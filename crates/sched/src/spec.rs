//! Speculative decoding's part of planning: after every decode, prefill
//! chunk and admission of a step is planned, some decodes get draft tokens
//! guessed from their own text (n-gram prompt lookup), which the step
//! verifies ([`flotilla_exec::OutputKind::Verify`]); `complete` keeps what
//! was accepted and gives the rest of the positions back.
//!
//! A draft never costs anyone else anything: it takes only the step's
//! leftover token budget and free KV blocks (never a cached prefix block,
//! never a preemption), only in steps with few decodes (where a step's time
//! is reading the weights, and extra positions are nearly free), and a
//! sequence whose drafts keep failing waits longer and longer before its
//! next one. A draft model's drafts are the exception to "few decodes":
//! their length comes from the cost sum ([`crate::best_draft`]), which
//! turns them down as the step grows.

use crate::Scheduler;
use crate::plan::Draft;
use crate::seq::Seq;

/// The continuation of the latest earlier occurrence of the sequence's last
/// `n` tokens, for the longest `n` in `min..=max` that occurs earlier, at
/// most `k` tokens, into `out` (empty when nothing matches).
pub(crate) fn ngram_draft(tokens: &[u32], min: usize, max: usize, k: usize, out: &mut Vec<u32>) {
    out.clear();
    let n = tokens.len();
    if k == 0 || n < 2 {
        return;
    }
    for m in (min.max(1)..=max.min(n - 1)).rev() {
        let key = &tokens[n - m..];
        let last = key[m - 1];
        // Occurrences ending before the last token, latest first: the
        // continuation starts at `i + m`, which is before `n`.
        for i in (0..n - m).rev() {
            if tokens[i + m - 1] == last && tokens[i..i + m] == *key {
                let from = i + m;
                out.extend_from_slice(&tokens[from..(from + k).min(n)]);
                return;
            }
        }
    }
}

impl Scheduler {
    /// Whether a sequence's next token may be drafted: it allows it and
    /// its KV does not leave for another node. Penalties and a grammar
    /// do not forbid it: each verify position gets its own bias
    /// (`Seq::draft_bias`) and mask (`MaskCell::pending_draft`).
    pub(crate) fn may_speculate(seq: &Seq) -> bool {
        seq.spec.allowed && seq.hold_for.is_none()
    }

    /// Adds draft tokens to the planned decodes that can have them.
    pub(crate) fn add_drafts(&mut self, draft: &mut Draft) {
        let spec = self.cfg.speculation;
        if !spec.is_on() || draft.budget == 0 {
            return;
        }
        // Under a latency budget the protected tiers' decodes decide: the
        // less protected ones are held to a few tokens beside them and get
        // no drafts, so the step stays as small as the protected work
        // alone would make it, drafts included.
        let decodes = draft
            .chunks
            .iter()
            .filter(|c| c.2 == 1 && self.seqs[&c.0].to_compute() == 1)
            .filter(|c| !draft.is_lower(self.seqs[&c.0].tier))
            .count();
        // N-gram and self-drafts only in small steps; a draft model's
        // length is the cost sum's answer for a step of this many decodes
        // (its full length until both costs are measured, so they are).
        let small = decodes <= spec.max_batch;
        if decodes == 0 || (!small && !spec.draft_model) {
            return;
        }
        let engine_alpha = self.draft_acceptance();
        let bs = self.cfg.block_size as usize;
        let mut step_left = spec.max_step;
        let mut guess = Vec::new();
        for c in 0..draft.chunks.len() {
            if draft.budget == 0 || step_left == 0 {
                break;
            }
            let (id, start, len, _) = draft.chunks[c];
            let seq = &self.seqs[&id];
            if len != 1
                || draft.is_lower(seq.tier)
                || seq.to_compute() != 1
                || seq.tokens.len() < seq.spec.skip_until
                || !Self::may_speculate(seq)
            {
                continue;
            }
            // The step's budget, the output left after the token this step
            // samples anyway, the context.
            let room = spec
                .max_draft
                .min(draft.room(seq.tier))
                .min(draft.chunk_room(false))
                .min(step_left)
                .min(seq.max_tokens.saturating_sub(seq.generated() + 1))
                .min(self.cfg.max_model_len.saturating_sub(seq.tokens.len() + 1));
            if room == 0 {
                continue;
            }
            // A grammar's forced tokens first (accepted whenever they are
            // the model's tokenization of them), else the text's n-grams.
            guess.clear();
            if let Some(c) = seq.constraint.as_ref().filter(|_| small) {
                flotilla_exec::constraint::forced(c, room, &mut guess);
            }
            if guess.is_empty() && small {
                ngram_draft(
                    &seq.tokens,
                    spec.ngram_min,
                    spec.ngram_max,
                    room,
                    &mut guess,
                );
            }
            // Else the model's own guess, where its bias and mask do not
            // change with the draft (the GpuWorker fills placeholders
            // before the step, when neither is known to the plan).
            let mut self_drafted = false;
            if guess.is_empty()
                && small
                && spec.self_layers > 0
                && seq.constraint.is_none()
                && !seq.penalised()
            {
                let last = *seq.tokens.last().expect("a decode has tokens");
                guess.resize(room, last);
                self_drafted = true;
            }
            // Else the draft model's, as long as the cost sum says, under
            // the same bias (a constant one: not under penalties, which
            // change with every token, nor a grammar's mask).
            // Its length: the cost sum's at this sequence's own acceptance
            // (the engine's as a prior), the most it may until the costs
            // are measured.
            let mut model_drafted = false;
            if guess.is_empty() && spec.draft_model && seq.constraint.is_none() && !seq.penalised()
            {
                // Each guess proposed is a trial (accepted, or the one
                // rejected); the engine's acceptance is the prior, worth
                // a few trials.
                let s = &seq.spec;
                let prior = crate::DRAFT_PRIOR_TRIALS;
                let alpha = (s.model_accepted + prior * engine_alpha)
                    / (s.model_accepted + s.model_cut + prior);
                let k = self
                    .draft_plan_at(alpha, decodes)
                    .map_or(spec.max_draft, |(k, _)| k);
                if k > 0 {
                    let last = *seq.tokens.last().expect("a decode has tokens");
                    guess.resize(room.min(k), last);
                    model_drafted = true;
                }
            }
            if guess.is_empty() {
                continue;
            }
            // Free blocks only: a draft never evicts a cached prefix.
            let have = seq
                .lease
                .as_ref()
                .expect("planned sequence is running")
                .capacity_tokens();
            let free = self.pool.usage().free as usize;
            guess.truncate((have + free * bs).saturating_sub(start + 1));
            if guess.is_empty() {
                continue;
            }
            let seq = self.seqs.get_mut(&id).expect("planned sequence exists");
            let lease = seq.lease.as_mut().expect("planned sequence is running");
            // Quota and other tiers' reservations still apply.
            if self.pool.grow(lease, start + 1 + guess.len()).is_err() {
                continue;
            }
            draft.budget -= guess.len();
            step_left -= guess.len();
            if self_drafted {
                draft.self_drafted.push(id);
            }
            if model_drafted {
                draft.model_drafted.push(id);
            }
            draft.guesses.push((id, std::mem::take(&mut guess)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ngram_draft;

    fn draft(tokens: &[u32], k: usize) -> Vec<u32> {
        let mut out = vec![99];
        ngram_draft(tokens, 2, 4, k, &mut out);
        out
    }

    #[test]
    fn the_latest_longest_match_gives_the_continuation() {
        // "1 2 3" occurred before, followed by 4 5 6.
        assert_eq!(draft(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3), vec![4, 5, 6]);
        // At most k tokens, and never past the end.
        assert_eq!(draft(&[1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 2), vec![4, 5]);
        assert_eq!(draft(&[7, 8, 1, 2, 7, 8], 5), vec![1, 2, 7, 8]);
        // The latest occurrence wins: "7 8" was followed by 1, later by 3.
        assert_eq!(draft(&[7, 8, 1, 7, 8, 3, 0, 7, 8], 1), vec![3]);
        // A longer n-gram beats a later shorter one: "5 7 8" matched
        // at the start (followed by 1), "7 8" later (followed by 3).
        assert_eq!(draft(&[5, 7, 8, 1, 7, 8, 3, 5, 7, 8], 1), vec![1]);
        // A repeating token: its own run continues.
        assert_eq!(draft(&[4, 4, 4], 3), vec![4]);
    }

    #[test]
    fn no_match_or_no_room_gives_nothing() {
        // Nothing repeats: no 2-gram occurs twice.
        assert!(draft(&[1, 2, 3, 4, 5], 4).is_empty());
        // Only a 1-gram would match, below the minimum of 2.
        assert!(draft(&[1, 2, 3, 1], 4).is_empty());
        assert!(draft(&[1, 2, 1, 2], 0).is_empty());
        assert!(draft(&[1], 4).is_empty());
        assert!(draft(&[], 4).is_empty());
    }
}
