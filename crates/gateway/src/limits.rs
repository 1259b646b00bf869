//! A tenant's concurrency and rate limits where requests enter: the HTTP
//! front. A tenant's `max_concurrent` and `requests_per_minute` hold
//! across every engine node, not once per node; each engine's scheduler
//! checks the same limits again (never the first to trip, as it sees a
//! share of the requests). A cluster with several Routers splits each
//! limit between them ([`split`]: the shares sum to the limit), so the
//! limit holds across Routers with no message between them, as a load
//! balancer spreads a tenant's requests; a Router whose share is 0 (a
//! limit below the number of Routers) refuses with a 429 that says so.
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
    /// The tenant's whole limit (0 = none) and this front's share of it.
    max_concurrent: u32,
    concurrent_share: u32,
    /// Requests per minute: the whole limit and this front's share.
    requests_per_minute: Option<u32>,
    rate_share: u32,
    live: u32,
    rate: Option<RateLimit>,
}

/// Front `index`'s share of `limit` split over `fronts`: the first
/// `limit % fronts` fronts hold one more, so the shares sum to `limit`.
pub fn split(limit: u32, index: usize, fronts: usize) -> u32 {
    let n = fronts.max(1) as u32;
    limit / n + u32::from((index as u32) < limit % n)
}

/// Every tenant's live count and rate bucket.
pub struct TenantLimits {
    /// How many fronts share the limits.
    fronts: usize,
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
    /// The limits of `cluster`'s tenants, held by one front.
    pub fn new(cluster: &ClusterConfig) -> TenantLimits {
        TenantLimits::share(cluster, 0, 1)
    }

    /// Front `index` of `fronts`' share of the limits of `cluster`'s
    /// tenants (see [`split`]).
    pub fn share(cluster: &ClusterConfig, index: usize, fronts: usize) -> TenantLimits {
        let fronts = fronts.max(1);
        TenantLimits {
            fronts,
            epoch: Instant::now(),
            tenants: Mutex::new(
                cluster
                    .tenants
                    .iter()
                    .map(|t| {
                        let rate_share =
                            t.requests_per_minute.map_or(0, |r| split(r, index, fronts));
                        Tenant {
                            name: t.name.clone(),
                            max_concurrent: t.max_concurrent,
                            concurrent_share: split(t.max_concurrent, index, fronts),
                            requests_per_minute: t.requests_per_minute,
                            rate_share,
                            live: 0,
                            rate: t
                                .requests_per_minute
                                .filter(|_| rate_share > 0)
                                .map(|_| RateLimit::new(rate_share)),
                        }
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
        let fronts = self.fronts;
        if t.max_concurrent > 0 && t.live >= t.concurrent_share {
            let reason = if fronts == 1 {
                format!(
                    "{} requests in flight, the limit is {}",
                    t.live, t.max_concurrent
                )
            } else {
                format!(
                    "{} requests in flight at this router, its share of the limit of {} over {fronts} routers is {}",
                    t.live, t.max_concurrent, t.concurrent_share
                )
            };
            return Err(refuse(t, reason, Duration::from_secs(1)));
        }
        if let Some(rpm) = t.requests_per_minute {
            let Some(rate) = &mut t.rate else {
                // A limit below the number of Routers: this one holds none.
                let reason = format!(
                    "rate limit of {rpm} requests per minute, split over {fronts} routers: this router's share is 0"
                );
                return Err(refuse(t, reason, Duration::from_secs(60)));
            };
            if let Err(wait) = rate.check(now) {
                let reason = if fronts == 1 {
                    format!("rate limit of {rpm} requests per minute")
                } else {
                    format!(
                        "rate limit of {rpm} requests per minute, this router's share over {fronts} routers is {}",
                        t.rate_share
                    )
                };
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

    #[test]
    fn shares_sum_to_the_limit() {
        for limit in 0..20 {
            for fronts in 1..6 {
                let sum: u32 = (0..fronts).map(|i| split(limit, i, fronts)).sum();
                assert_eq!(sum, limit, "limit {limit} over {fronts}");
                let max = (0..fronts).map(|i| split(limit, i, fronts)).max().unwrap();
                let min = (0..fronts).map(|i| split(limit, i, fronts)).min().unwrap();
                assert!(max - min <= 1, "limit {limit} over {fronts}: even shares");
            }
        }
    }

    /// Two Routers, one tenant at its limit on both: together they hold
    /// exactly the limit, each refusing past its share.
    #[test]
    fn two_routers_hold_one_limit_between_them() {
        let cfg = ClusterConfig::parse(
            "[[tiers]]\nname = \"paid\"\n[[tenants]]\nname = \"a\"\ntier = \"paid\"\n\
             api_keys = [\"sk-a-0000000000000001\"]\nmax_concurrent = 5\nrequests_per_minute = 1\n",
            "t.toml",
        )
        .unwrap();
        let fronts = [
            Arc::new(TenantLimits::share(&cfg, 0, 2)),
            Arc::new(TenantLimits::share(&cfg, 1, 2)),
        ];
        let a = TenantId(0);
        let t0 = Duration::from_secs(100);
        let mut held = Vec::new();
        let mut refused = Vec::new();
        // Each front is offered the whole limit and more, one request per
        // minute apart so the rate (1 a minute, all of it router 0's)
        // only speaks where its share is 0.
        for round in 0..5u64 {
            for (i, f) in fronts.iter().enumerate() {
                match f.acquire_at(a, t0 + Duration::from_secs(60 * round)) {
                    Ok(s) => held.push((i, s)),
                    Err(e) => refused.push((i, e.to_string())),
                }
            }
        }
        // Router 1 holds none of the rate: all its requests are refused,
        // saying why.
        assert!(
            refused.iter().filter(|(i, _)| *i == 1).count() == 5,
            "{refused:?}"
        );
        assert!(
            refused[0]
                .1
                .contains("split over 2 routers: this router's share is 0"),
            "{refused:?}"
        );
        assert_eq!(held.len(), 3, "router 0 holds its share of 3: {refused:?}");
        let at0: Vec<&String> = refused
            .iter()
            .filter(|(i, _)| *i == 0)
            .map(|(_, e)| e)
            .collect();
        assert!(
            at0[0].contains("its share of the limit of 5 over 2 routers is 3"),
            "{at0:?}"
        );
        assert_eq!(fronts[0].live(a) + fronts[1].live(a), 3);
        drop(held);
        assert_eq!(fronts[0].live(a), 0, "slots go back on drop");

        // Without a rate, both fronts fill their shares: 3 + 2 = the limit.
        let cfg = ClusterConfig::parse(
            "[[tiers]]\nname = \"paid\"\n[[tenants]]\nname = \"a\"\ntier = \"paid\"\n\
             api_keys = [\"sk-a-0000000000000001\"]\nmax_concurrent = 5\n",
            "t.toml",
        )
        .unwrap();
        let fronts = [
            Arc::new(TenantLimits::share(&cfg, 0, 2)),
            Arc::new(TenantLimits::share(&cfg, 1, 2)),
        ];
        let mut held = Vec::new();
        for _ in 0..10 {
            for f in &fronts {
                if let Ok(s) = f.acquire(a) {
                    held.push(s);
                }
            }
        }
        assert_eq!(
            held.len(),
            5,
            "the two shares hold the limit of 5 between them"
        );
        assert_eq!((fronts[0].live(a), fronts[1].live(a)), (3, 2));
    }
}
