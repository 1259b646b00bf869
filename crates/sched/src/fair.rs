//! Virtual token counters (VTC, "Fairness in Serving Large Language Models",
//! OSDI'24), used twice: between tiers and between the tenants of one tier.
//!
//! Each client's counter grows by the tokens it is served divided by its
//! weight; the scheduler serves the client with the smallest counter. A client
//! that becomes active is lifted to the smallest counter of the active
//! clients of its group, so that idling earns no credit: without the lift a
//! tenant back from an hour away would own the engine until it caught up.

/// Fixed-point scale of counters: integer math keeps runs reproducible and
/// 2^20 keeps the rounding of `tokens / weight` far below one token.
const SCALE: u128 = 1 << 20;

/// Counters of a set of clients, partitioned into groups that compete only
/// among themselves.
#[derive(Clone, Debug)]
pub(crate) struct Vtc {
    /// Served tokens / weight, times `SCALE`.
    counter: Vec<u128>,
    weight: Vec<u32>,
    group: Vec<usize>,
}

impl Vtc {
    /// Clients `i` with `weights[i]` (> 0) in `groups[i]`, all counters zero.
    pub(crate) fn new(weights: Vec<u32>, groups: Vec<usize>) -> Self {
        assert_eq!(weights.len(), groups.len());
        assert!(
            weights.iter().all(|&w| w > 0),
            "VTC weights must be positive"
        );
        Vtc {
            counter: vec![0; weights.len()],
            weight: weights,
            group: groups,
        }
    }

    /// The counter of client `i` (for ordering only).
    #[cfg(test)]
    pub(crate) fn counter(&self, i: usize) -> u128 {
        self.counter[i]
    }

    /// Charges `tokens` served to client `i`.
    pub(crate) fn charge(&mut self, i: usize, tokens: u64) {
        self.counter[i] += u128::from(tokens) * SCALE / u128::from(self.weight[i]);
    }

    /// Client `i` becomes active: lifts it to the smallest counter among the
    /// other active clients of its group (`is_active(j)`), never lowers it.
    pub(crate) fn activate(&mut self, i: usize, is_active: impl Fn(usize) -> bool) {
        let g = self.group[i];
        let floor = (0..self.counter.len())
            .filter(|&j| j != i && self.group[j] == g && is_active(j))
            .map(|j| self.counter[j])
            .min();
        if let Some(floor) = floor {
            self.counter[i] = self.counter[i].max(floor);
        }
    }

    /// Of `candidates`, the one with the smallest counter; ties go to the
    /// smallest `tie` key, then to the first.
    pub(crate) fn pick<K: Ord>(
        &self,
        candidates: impl Iterator<Item = usize>,
        tie: impl Fn(usize) -> K,
    ) -> Option<usize> {
        candidates.min_by(|&a, &b| {
            self.counter[a]
                .cmp(&self.counter[b])
                .then_with(|| tie(a).cmp(&tie(b)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_divide_service() {
        let mut v = Vtc::new(vec![1, 3], vec![0, 0]);
        v.charge(0, 100);
        v.charge(1, 300);
        assert_eq!(v.counter(0), v.counter(1));
        assert_eq!(v.pick([0, 1].into_iter(), |i| i), Some(0));
        v.charge(0, 1);
        assert_eq!(v.pick([0, 1].into_iter(), |i| i), Some(1));
    }

    #[test]
    fn activation_lifts_to_active_minimum_of_group_only() {
        let mut v = Vtc::new(vec![1, 1, 1, 1], vec![0, 0, 0, 1]);
        v.charge(0, 500);
        v.charge(1, 800);
        v.charge(3, 10_000);
        // Client 2 was idle: it is lifted to the smallest active counter of
        // group 0 (client 0), not to group 1's.
        v.activate(2, |j| j != 2);
        assert_eq!(v.counter(2), v.counter(0));
        // Never lowered.
        v.charge(2, 1000);
        let before = v.counter(2);
        v.activate(2, |j| j == 0);
        assert_eq!(v.counter(2), before);
        // Alone in its group: unchanged.
        let mut w = Vtc::new(vec![1, 1], vec![0, 1]);
        w.charge(1, 10);
        w.activate(0, |_| true);
        assert_eq!(w.counter(0), 0);
    }
}
