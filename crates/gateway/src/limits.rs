//! A tenant's concurrency and rate limits where requests enter: the HTTP
//! front. A cluster has one front (the Router), so a tenant's
//! `max_concurrent` and `requests_per_minute` hold across every engine
//! node, not once per node; each engine's scheduler checks the same limits
//! again (never the first to trip, as it sees a share of the requests).
//!
//! A slot is taken before the request is submitted and given back when the
//! response ends, whichever way it ends (finished, refused by the engine,
//! failed, cancelled by a client that went away, its node lost): the slot
//! is a guard owned by the response.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flotilla_config::ClusterConfig;
use flotilla_exec::rate::{RateLimit, retry_after_s};
use flotilla_proto::{Rejection, TenantId};

struct Tenant {
    name: String,
    max_concurrent: u32,
    requests_per_minute: Option<u32>,
    live: u32,
    rate: Option<RateLimit>,
}

/// Every tenant's live count and rate bucket.
pub struct TenantLimits {
    epoch: Instant,
    tenants: Mutex<Vec<Tenant>>,
}

/// A tenant's place among its live requests; dropping it gives it back.
pub struct TenantSlot {
    limits: Arc<TenantLimits>,
    tenant: usize,
}

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut t = self.limits.lock();
        if let Some(t) = t.get_mut(self.tenant) {
            t.live = t.live.saturating_sub(1);
        }
    }
}

impl TenantLimits {
    /// The limits of `cluster`'s tenants.
    pub fn new(cluster: &ClusterConfig) -> TenantLimits {
        TenantLimits {
            epoch: Instant::now(),
            tenants: Mutex::new(
                cluster
                    .tenants
                    .iter()
                    .map(|t| Tenant {
                        name: t.name.clone(),
                        max_concurrent: t.max_concurrent,
                        requests_per_minute: t.requests_per_minute,
                        live: 0,
                        rate: t.requests_per_minute.map(RateLimit::new),
                    })
                    .collect(),
            ),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Tenant>> {
        // A panic while holding it leaves plain counters: still usable.
        self.tenants.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A slot for one more request of `tenant`, or the 429 that says which
    /// limit it meets (as the scheduler words it). Takes a rate token.
    pub fn acquire(self: &Arc<Self>, tenant: TenantId) -> Result<TenantSlot, Rejection> {
        self.acquire_at(tenant, self.epoch.elapsed())
    }

    fn acquire_at(
        self: &Arc<Self>,
        tenant: TenantId,
        now: Duration,
    ) -> Result<TenantSlot, Rejection> {
        let i = tenant.0 as usize;
        let mut all = self.lock();
        let Some(t) = all.get_mut(i) else {
            // Not a configured tenant (an open deployment's default one):
            // no limits.
            drop(all);
            return Ok(TenantSlot {
                limits: self.clone(),
                tenant: usize::MAX,
            });
        };
        let refuse = |t: &Tenant, reason: String, wait: Duration| Rejection::TenantLimit {
            tenant: t.name.clone(),
            reason,
            retry_after_s: retry_after_s(wait),
        };
        if t.max_concurrent > 0 && t.live >= t.max_concurrent {
            let reason = format!(
                "{} requests in flight, the limit is {}",
                t.live, t.max_concurrent
            );
            return Err(refuse(t, reason, Duration::from_secs(1)));
        }
        if let Some(rate) = &mut t.rate {
            if let Err(wait) = rate.check(now) {
                let rpm = t.requests_per_minute.unwrap_or(0);
                let reason = format!("rate limit of {rpm} requests per minute");
                return Err(refuse(t, reason, wait));
            }
            rate.take(now);
        }
        t.live += 1;
        Ok(TenantSlot {
            limits: self.clone(),
            tenant: i,
        })
    }

    /// Requests of `tenant` live now.
    pub fn live(&self, tenant: TenantId) -> u32 {
        self.lock().get(tenant.0 as usize).map_or(0, |t| t.live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Arc<TenantLimits> {
        let cfg = ClusterConfig::parse(
            r#"
[[tiers]]
name = "paid"

[[tenants]]
name = "a"
tier = "paid"
api_keys = ["sk-a-0000000000000001"]
max_concurrent = 2

[[tenants]]
name = "b"
tier = "paid"
api_keys = ["sk-b-0000000000000001"]
requests_per_minute = 3
"#,
            "t.toml",
        )
        .unwrap();
        Arc::new(TenantLimits::new(&cfg))
    }

    #[test]
    fn concurrency_is_held_until_slots_are_dropped() {
        let l = limits();
        let a = TenantId(0);
        let s1 = l.acquire(a).unwrap();
        let s2 = l.acquire(a).unwrap();
        let e = l.acquire(a).err().unwrap().to_string();
        assert!(e.contains("2 requests in flight, the limit is 2"), "{e}");
        assert_eq!(l.live(a), 2);
        drop(s1);
        let s3 = l.acquire(a).unwrap();
        drop((s2, s3));
        assert_eq!(l.live(a), 0);
        // Another tenant is not touched by a's limit.
        assert!(l.acquire(TenantId(1)).is_ok());
    }

    #[test]
    fn the_rate_refuses_past_the_bucket_and_refills() {
        let l = limits();
        let b = TenantId(1);
        let t0 = Duration::from_secs(10);
        for _ in 0..3 {
            drop(l.acquire_at(b, t0).unwrap());
        }
        match l.acquire_at(b, t0) {
            Err(Rejection::TenantLimit {
                tenant,
                reason,
                retry_after_s,
            }) => {
                assert_eq!(tenant, "b");
                assert!(reason.contains("3 requests per minute"), "{reason}");
                assert_eq!(retry_after_s, 20);
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        assert!(l.acquire_at(b, t0 + Duration::from_secs(20)).is_ok());
        // An unknown tenant (open deployments) is not limited.
        assert!(l.acquire(TenantId(7)).is_ok());
    }
}
