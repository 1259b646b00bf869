//! The KV offload tier's bytes: one slot per block, in host memory or in a
//! file mapped into memory (so that the tier may exceed RAM). The KV pool
//! decides which slot holds which block; the GpuWorker performs the moves
//! through the executor's block copies ([`crate::Executor::spill_block`],
//! [`crate::Executor::restore_block`]).

use std::fs::OpenOptions;
use std::path::Path;

/// The tier's slots: one mapping, anonymous (RAM, faulted in when made)
/// or of a file (its pages come and go with the page cache).
pub struct OffloadTier {
    map: memmap2::MmapMut,
    slots: u32,
    bytes_per_slot: usize,
}

impl OffloadTier {
    /// `slots` slots of `bytes_per_slot` bytes: in memory, or in a file at
    /// `path` (created or truncated to size, on local disk). A backend that
    /// moves no bytes (the simulator) asks for 0 bytes per slot. A size the
    /// system cannot map is an error naming the flag, not an abort.
    pub fn new(
        slots: u32,
        bytes_per_slot: usize,
        path: Option<&Path>,
    ) -> Result<OffloadTier, String> {
        let len = (slots as usize)
            .checked_mul(bytes_per_slot)
            .ok_or_else(|| {
                format!("--kv-offload-bytes: {slots} slots of {bytes_per_slot} bytes overflow")
            })?;
        let map = match path {
            // Populated (MAP_POPULATE on Linux): every page is faulted in
            // and zeroed here, ~0.3 s a GiB, not in the first move into it,
            // where a fresh page makes a block's copy ~4x slower (measured:
            // 207 vs 56 us for 360 KiB), and the memory is committed at
            // start, not found missing later.
            None => memmap2::MmapOptions::new()
                .len(len)
                .populate()
                .map_anon()
                .map_err(|e| {
                    format!(
                        "--kv-offload-bytes: cannot map {len} bytes of host memory for \
                         {slots} KV blocks: {e}"
                    )
                })?,
            Some(p) => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(p)
                    .map_err(|e| format!("--kv-offload-path {}: {e}", p.display()))?;
                file.set_len(len as u64).map_err(|e| {
                    format!(
                        "--kv-offload-path {}: sizing to {len} bytes: {e}",
                        p.display()
                    )
                })?;
                // SAFETY: the file was just created (truncated) by this
                // process for its own use; nothing else maps or writes it.
                unsafe { memmap2::MmapMut::map_mut(&file) }
                    .map_err(|e| format!("--kv-offload-path {}: mapping: {e}", p.display()))?
            }
        };
        Ok(OffloadTier {
            map,
            slots,
            bytes_per_slot,
        })
    }

    fn range(&self, slot: u32) -> Result<std::ops::Range<usize>, String> {
        if slot >= self.slots {
            return Err(format!("offload slot {slot} of {}", self.slots));
        }
        let start = slot as usize * self.bytes_per_slot;
        Ok(start..start + self.bytes_per_slot)
    }

    /// One slot's bytes.
    pub fn slot(&self, slot: u32) -> Result<&[u8], String> {
        let r = self.range(slot)?;
        Ok(&self.map[r])
    }

    /// One slot's bytes, to fill.
    pub fn slot_mut(&mut self, slot: u32) -> Result<&mut [u8], String> {
        let r = self.range(slot)?;
        Ok(&mut self.map[r])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_hold_what_was_written_in_memory_and_in_a_file() {
        let dir = std::env::temp_dir().join(format!("flotilla-offload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tier.bin");
        for path in [None, Some(path.as_path())] {
            let mut t = OffloadTier::new(3, 8, path).unwrap();
            t.slot_mut(1).unwrap().copy_from_slice(&[7; 8]);
            t.slot_mut(2).unwrap().copy_from_slice(&[9; 8]);
            assert_eq!(t.slot(0).unwrap(), &[0; 8]);
            assert_eq!(t.slot(1).unwrap(), &[7; 8]);
            assert_eq!(t.slot(2).unwrap(), &[9; 8]);
            assert!(t.slot(3).is_err());
        }
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 24);
        std::fs::remove_dir_all(&dir).unwrap();
        let bad = Path::new("/nonexistent-dir/tier.bin");
        let err = OffloadTier::new(1, 8, Some(bad)).err().unwrap();
        assert!(err.contains("/nonexistent-dir/tier.bin"), "{err}");
        // No bytes (the simulator's backend), and more than any machine maps.
        let mut none = OffloadTier::new(4, 0, None).unwrap();
        assert!(none.slot_mut(3).unwrap().is_empty());
        let err = OffloadTier::new(1 << 20, 1 << 30, None).err().unwrap();
        assert!(err.starts_with("--kv-offload-bytes: cannot map"), "{err}");
    }
}
