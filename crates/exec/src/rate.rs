//! A per-tenant requests-per-minute limit, checked where requests enter
//! (the HTTP front, across a cluster) and where they are admitted (an
//! engine's scheduler). Pure: the caller gives the time.

use std::time::Duration;

/// A tenant's requests-per-minute limit as a generic cell rate algorithm:
/// the token bucket refilled continuously, kept as one "theoretical arrival
/// time" so it needs no refill timer and exact integer math.
#[derive(Clone, Debug)]
pub struct RateLimit {
    /// Time one request's token takes to refill, nanoseconds.
    interval_ns: u128,
    /// How far ahead of `now` the arrival time may run: a full bucket of
    /// `rpm` requests is a burst of `rpm - 1` intervals beyond the first.
    tolerance_ns: u128,
    /// When the bucket would be full again, nanoseconds.
    tat_ns: u128,
}

impl RateLimit {
    /// A full bucket of `rpm` (> 0) requests, refilling at `rpm` per minute.
    pub fn new(rpm: u32) -> Self {
        assert!(rpm > 0);
        let interval_ns = 60_000_000_000u128 / u128::from(rpm);
        RateLimit {
            interval_ns,
            tolerance_ns: interval_ns * u128::from(rpm - 1),
            tat_ns: 0,
        }
    }

    /// `Err(wait)` if the bucket is empty at `now`: `wait` until it holds one.
    pub fn check(&self, now: Duration) -> Result<(), Duration> {
        let now = now.as_nanos();
        let ahead = self.tat_ns.max(now) - now;
        if ahead > self.tolerance_ns {
            let wait = ahead - self.tolerance_ns;
            return Err(Duration::from_nanos(
                u64::try_from(wait).unwrap_or(u64::MAX),
            ));
        }
        Ok(())
    }

    /// Takes one token (after a successful `check`).
    pub fn take(&mut self, now: Duration) {
        debug_assert!(self.check(now).is_ok());
        self.tat_ns = self.tat_ns.max(now.as_nanos()) + self.interval_ns;
    }
}

/// Whole seconds to wait, rounded up, at least one (HTTP `Retry-After`).
pub fn retry_after_s(wait: Duration) -> u32 {
    let s = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    u32::try_from(s.max(1)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_bursts_then_refills_continuously() {
        let mut r = RateLimit::new(60);
        let t0 = Duration::from_secs(100);
        for _ in 0..60 {
            assert!(r.check(t0).is_ok());
            r.take(t0);
        }
        assert_eq!(r.check(t0), Err(Duration::from_secs(1)));
        assert_eq!(
            r.check(t0 + Duration::from_millis(400)),
            Err(Duration::from_millis(600))
        );
        assert!(r.check(t0 + Duration::from_secs(1)).is_ok());
        assert_eq!(retry_after_s(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_s(Duration::from_millis(1500)), 2);
    }
}
