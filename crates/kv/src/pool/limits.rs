//! Quotas and reservations: what each owner is charged and may still take.
//!
//! Charges count lease-table entries, not distinct blocks: a block shared by
//! two leases is charged to both holders (a tenant's quota and a tier's
//! reservation are promises about what its own sequences can hold, whoever
//! else shares the block).

use super::{BlockPool, saturate};
use crate::{AllocError, Owner};

impl BlockPool {
    /// The tenant's quota; none past the end of the table.
    pub(super) fn quota(&self, tenant: u32) -> Option<u32> {
        self.tenant_blocks_max
            .get(tenant as usize)
            .copied()
            .flatten()
    }

    /// Blocks the tenant's leases hold (sum of table lengths).
    pub(super) fn held(&self, tenant: u32) -> u64 {
        self.tenant_held.get(&tenant).copied().unwrap_or(0)
    }

    /// Whether the owner's tenant may hold `extra` more blocks.
    pub(super) fn check_quota(&self, owner: Owner, extra: u64) -> Result<(), AllocError> {
        let Some(max) = self.quota(owner.tenant) else {
            return Ok(());
        };
        let would_hold = self.held(owner.tenant) + extra;
        if would_hold > u64::from(max) {
            return Err(AllocError::Quota {
                tenant: owner.tenant,
                would_hold: saturate(would_hold),
                max,
            });
        }
        Ok(())
    }

    /// Unheld blocks (free + cached) that tiers other than `tier` still have
    /// a claim on.
    pub(super) fn reserved_for_others(&self, tier: u8) -> u64 {
        self.tier_reserved_blocks
            .iter()
            .enumerate()
            .filter(|&(t, _)| t != usize::from(tier))
            .map(|(t, &r)| u64::from(r).saturating_sub(self.tier_held.get(t).copied().unwrap_or(0)))
            .sum()
    }

    /// Unheld blocks a `tier` owner may take, ignoring quotas.
    pub(super) fn physical_available(&self, tier: u8) -> u32 {
        let unheld = self.free.len() as u64 + u64::from(self.lru.len());
        saturate(unheld.saturating_sub(self.reserved_for_others(tier)))
    }

    /// `available` without reclaiming first.
    pub(super) fn available_now(&self, owner: Owner) -> u32 {
        let physical = self.physical_available(owner.tier);
        match self.quota(owner.tenant) {
            Some(max) => physical.min(saturate(
                u64::from(max).saturating_sub(self.held(owner.tenant)),
            )),
            None => physical,
        }
    }

    /// `n` more table entries held by `owner`.
    pub(super) fn charge(&mut self, owner: Owner, n: usize) {
        // No zero entries: the map holds exactly the tenants holding blocks.
        if n == 0 {
            return;
        }
        *self.tenant_held.entry(owner.tenant).or_insert(0) += n as u64;
        self.tier_held[usize::from(owner.tier)] += n as u64;
    }

    /// `n` table entries of `owner` released.
    pub(super) fn uncharge(&mut self, owner: Owner, n: usize) {
        if n == 0 {
            return;
        }
        let n = n as u64;
        let held = self
            .tenant_held
            .get_mut(&owner.tenant)
            .expect("uncharge: tenant holds nothing");
        assert!(
            *held >= n,
            "tenant {} releases {n} blocks, holds {held}",
            owner.tenant
        );
        *held -= n;
        if *held == 0 {
            self.tenant_held.remove(&owner.tenant);
        }
        let tier = &mut self.tier_held[usize::from(owner.tier)];
        assert!(
            *tier >= n,
            "tier {} releases {n} blocks, holds {tier}",
            owner.tier
        );
        *tier -= n;
    }
}
