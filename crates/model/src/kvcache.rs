//! The CPU backend's paged KV cache: storage in each [`KvDtype`], writing a
//! token's K and V into its slot, and attention of one token's query heads
//! over a sequence's blocks.
//!
//! Storage is block-major, so that one block's bytes (every layer, K and V)
//! are contiguous for export, import and copy: runs of
//! `[block][layer][k|v][kv_head]`, each run `block_size` rows of `head_dim`
//! values. An int8 run holds its values (`[slot][head_dim]` bytes) and then
//! their scales (`[slot][head_dim / 32]` f16), as [`KvDtype`] describes; the
//! attention kernels read the bytes directly, eight values at a time
//! (sixteen with AVX-512), with each run's scales widened once per block
//! (no dequantised copy).

use std::ops::Range;

use half::f16;

use crate::arch::ModelConfig;
use crate::kernels::Resolved;
use crate::quant::quantize_q8_0_group;
use flotilla_exec::executor::{ExecError, KvDtype};

#[cfg(target_arch = "x86_64")]
use crate::kernels::avx2;

/// Values that share one int8 scale.
const G: usize = KvDtype::INT8_GROUP;

enum KvData {
    F32(Zeroed<f32>),
    F16(Zeroed<f16>),
    Int8(Zeroed<i8>),
}

/// Zero-filled storage taken from the system, not the allocator: its pages
/// are mapped at their first write, so a cache sized for the worst case
/// holds resident memory only for the blocks sequences have used (a
/// `vec![0; n]` of the same size came from memory the allocator had used
/// before and was cleared, every page, at once: `serve` on a 1.5B model
/// showed its whole 2.3 GiB cache in RSS from the start).
pub(crate) struct Zeroed<T> {
    map: memmap2::MmapMut,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

/// Element types whose all-zero bytes are the value zero.
pub(crate) trait ZeroBytes: Copy {}
impl ZeroBytes for f32 {}
impl ZeroBytes for f16 {}
impl ZeroBytes for i8 {}

impl<T: ZeroBytes> Zeroed<T> {
    /// `len` zeros, or why the system would not map them.
    pub(crate) fn new(len: usize) -> Result<Zeroed<T>, String> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| format!("{len} values do not fit in memory"))?;
        let map = memmap2::MmapMut::map_anon(bytes.max(1))
            .map_err(|e| format!("cannot map {bytes} bytes for the KV cache: {e}"))?;
        Ok(Zeroed {
            map,
            len,
            _t: std::marker::PhantomData,
        })
    }
}

impl<T: ZeroBytes> std::ops::Deref for Zeroed<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the map holds `len * size_of::<T>()` bytes, page-aligned
        // (so aligned for T); every byte pattern is a valid f32, f16 or i8.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr() as *const T, self.len) }
    }
}

impl<T: ZeroBytes> std::ops::DerefMut for Zeroed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and the map is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr() as *mut T, self.len) }
    }
}

/// Where each (block, layer, K/V, head) run starts, in values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KvLayout {
    pub block_size: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    /// Values in one block.
    pub block_elems: usize,
}

impl KvLayout {
    /// Value offset of (block, layer, k=0/v=1, head, slot 0). For int8 the
    /// run's first byte is at `offset + offset / 16` (each 32 values carry
    /// two bytes of scale).
    #[inline(always)]
    pub fn offset(&self, block: usize, layer: usize, kv: usize, head: usize) -> usize {
        block * self.block_elems
            + ((layer * 2 + kv) * self.n_kv + head) * self.block_size * self.head_dim
    }
}

/// Byte offset of the int8 run whose value offset is `off`, and of its scales.
#[inline(always)]
fn int8_run(off: usize, bs: usize, hd: usize) -> (usize, usize) {
    let start = off + off / 16;
    (start, start + bs * hd)
}

/// Paged KV storage.
pub(crate) struct KvStore {
    data: KvData,
    pub block_size: usize,
    pub num_blocks: usize,
    pub layout: KvLayout,
}

impl KvStore {
    /// Zeroed storage for `num_blocks` blocks, or why it cannot be held.
    pub fn new(
        cfg: &ModelConfig,
        block_size: usize,
        num_blocks: usize,
        dtype: KvDtype,
    ) -> Result<KvStore, String> {
        dtype.check_head_dim(cfg.head_dim)?;
        let block_elems = cfg.n_layer * 2 * cfg.n_head_kv * block_size * cfg.head_dim;
        let bytes = dtype.bytes_per_block(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, block_size);
        let fits = block_elems
            .checked_mul(num_blocks)
            .and(bytes.checked_mul(num_blocks))
            .is_some_and(|b| b <= isize::MAX as usize);
        if !fits {
            return Err(format!(
                "a KV cache of {num_blocks} blocks of {block_size} tokens does not fit in memory"
            ));
        }
        let data = match dtype {
            KvDtype::F32 => KvData::F32(Zeroed::new(block_elems * num_blocks)?),
            KvDtype::F16 => KvData::F16(Zeroed::new(block_elems * num_blocks)?),
            KvDtype::Int8 => KvData::Int8(Zeroed::new(bytes * num_blocks)?),
        };
        Ok(KvStore {
            data,
            block_size,
            num_blocks,
            layout: KvLayout {
                block_size,
                n_kv: cfg.n_head_kv,
                head_dim: cfg.head_dim,
                block_elems,
            },
        })
    }

    pub fn dtype(&self) -> KvDtype {
        match self.data {
            KvData::F32(_) => KvDtype::F32,
            KvData::F16(_) => KvDtype::F16,
            KvData::Int8(_) => KvDtype::Int8,
        }
    }

    pub fn bytes_per_block(&self) -> usize {
        self.layout.block_elems / self.layout.head_dim
            * self.dtype().row_bytes(self.layout.head_dim)
    }

    pub fn block_byte_range(&self, block: u32) -> Result<Range<usize>, ExecError> {
        if block as usize >= self.num_blocks {
            return Err(ExecError::BadBlock {
                block,
                num_blocks: self.num_blocks,
            });
        }
        let b = self.bytes_per_block();
        Ok(block as usize * b..(block as usize + 1) * b)
    }

    pub fn bytes(&self) -> &[u8] {
        let (p, n) = match &self.data {
            KvData::F32(v) => (v.as_ptr() as *const u8, v.len() * 4),
            KvData::F16(v) => (v.as_ptr() as *const u8, v.len() * 2),
            KvData::Int8(v) => (v.as_ptr() as *const u8, v.len()),
        };
        // SAFETY: every element type here is plain initialised bytes; u8
        // has alignment 1.
        unsafe { std::slice::from_raw_parts(p, n) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let (p, n) = match &mut self.data {
            KvData::F32(v) => (v.as_mut_ptr() as *mut u8, v.len() * 4),
            KvData::F16(v) => (v.as_mut_ptr() as *mut u8, v.len() * 2),
            KvData::Int8(v) => (v.as_mut_ptr() as *mut u8, v.len()),
        };
        // SAFETY: as in `bytes`; any byte pattern is a valid f32, f16 or i8.
        unsafe { std::slice::from_raw_parts_mut(p, n) }
    }

    /// A handle through which the threads of one region write distinct slots.
    pub fn writer(&mut self) -> KvWriter {
        let (dtype, layout) = (self.dtype(), self.layout);
        let bytes = self.bytes_mut();
        KvWriter {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
            dtype,
            layout,
        }
    }
}

/// Writes K or V rows into their slots from several threads at once.
#[derive(Clone, Copy)]
pub(crate) struct KvWriter {
    ptr: *mut u8,
    len: usize,
    dtype: KvDtype,
    layout: KvLayout,
}
// SAFETY: callers write disjoint slots (the batch's slots are distinct,
// checked by validate_batch), and the store outlives the region.
unsafe impl Send for KvWriter {}
// SAFETY: as above.
unsafe impl Sync for KvWriter {}

impl KvWriter {
    /// Stores `src` (`head_dim` values) as row `slot` of the run (block,
    /// layer, kv, head).
    ///
    /// # Safety
    /// No other thread may touch that row meanwhile, and the store this
    /// writer came from must be alive and not otherwise borrowed.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn store(
        &self,
        kernel: Resolved,
        block: usize,
        layer: usize,
        kv: usize,
        head: usize,
        slot: usize,
        src: &[f32],
    ) {
        let (bs, hd) = (self.layout.block_size, self.layout.head_dim);
        assert_eq!(src.len(), hd);
        let off = self.layout.offset(block, layer, kv, head);
        match self.dtype {
            KvDtype::F32 => {
                let r = (off + slot * hd) * 4;
                assert!(r + hd * 4 <= self.len);
                // SAFETY: in bounds (asserted), aligned (f32 storage), row
                // exclusive by the caller's promise.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r) as *mut f32, hd) };
                dst.copy_from_slice(src);
            }
            KvDtype::F16 => {
                let r = (off + slot * hd) * 2;
                assert!(r + hd * 2 <= self.len);
                // SAFETY: as above, f16 storage.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r) as *mut f16, hd) };
                store_f16(kernel, dst, src);
            }
            KvDtype::Int8 => {
                let (vals, scales) = int8_run(off, bs, hd);
                let (v0, s0) = (vals + slot * hd, scales + slot * (hd / G) * 2);
                assert!(v0 + hd <= scales && s0 + hd / G * 2 <= self.len);
                // SAFETY: in bounds (asserted); byte storage; the row's values
                // and scales are exclusive by the caller's promise.
                let (q, d) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(self.ptr.add(v0) as *mut i8, hd),
                        std::slice::from_raw_parts_mut(self.ptr.add(s0), hd / G * 2),
                    )
                };
                quantize_int8_row(src, q, d);
            }
        }
    }
}

fn store_f16(kernel: Resolved, dst: &mut [f16], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() {
        // SAFETY: AVX2 resolved only when present; lengths equal, multiple of 8.
        unsafe { avx2::store_kv(dst, src) };
        return;
    }
    let _ = kernel;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(s);
    }
}

/// Quantises one row to int8, 32 values per scale (stored as little-endian
/// f16 bytes in `d`), as Q8_0 weights are (`quant::quantize_q8_0_group`).
/// One scalar routine for every kernel variant, so that all store
/// identical bytes.
pub(crate) fn quantize_int8_row(src: &[f32], q: &mut [i8], d: &mut [u8]) {
    for ((x, q), d) in src
        .chunks_exact(G)
        .zip(q.chunks_exact_mut(G))
        .zip(d.chunks_exact_mut(2))
    {
        d.copy_from_slice(&quantize_q8_0_group(x, q).to_bits().to_le_bytes());
    }
}

/// The orthonormal Walsh-Hadamard rotations an int8 cache applies before it
/// quantises, as `(k, v)` sizes, or `None` where `head_dim` is not a
/// multiple of 64 (the rows are then stored as they are).
///
/// A model whose keys carry a few large channels (Qwen2's K bias puts
/// values of 100-200 beside values of 1-10 in some layers) loses the small
/// channels to a per-32 scale set by the large one. Rotating each head's
/// key, blockwise by `k`, spreads every channel over the block, so one
/// scale fits them all; the query is rotated by the same matrix, so
/// `q . k` is unchanged up to rounding. Values are rotated blockwise by
/// `v` and the attention output rotated back (the matrix is its own
/// inverse). `k` is the largest power of two that divides `head_dim`, `v`
/// is 64: the choice llama.cpp makes for its quantised caches. The CUDA
/// backend (kernels/kv.cu, `hadamard_rows`) applies the same butterflies
/// in the same order, so both store the same bytes.
pub fn int8_rotations(head_dim: usize) -> Option<(usize, usize)> {
    if head_dim == 0 || !head_dim.is_multiple_of(64) {
        return None;
    }
    Some((1 << head_dim.trailing_zeros(), 64))
}

/// Rotates each `n` values of `x` in place by the orthonormal Sylvester
/// Hadamard matrix of size `n` (a power of two): the butterflies of the
/// fast transform, stage by stage from stride 1 up, then one multiply by
/// `1 / sqrt(n)` (as f32).
pub fn hadamard(x: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two() && x.len().is_multiple_of(n));
    let scale = hadamard_scale(n);
    for c in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (c[j], c[j + h]);
                    c[j] = a + b;
                    c[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for v in c.iter_mut() {
            *v *= scale;
        }
    }
}

/// `1 / sqrt(n)` as [`hadamard`] multiplies by it (the CUDA backend is
/// handed this value, so both round alike).
pub fn hadamard_scale(n: usize) -> f32 {
    (1.0 / (n as f64).sqrt()) as f32
}

/// Query rows (tokens x query heads of one KV head) one call of
/// [`attend_run`] takes at most: a prompt's tokens go through attention in
/// runs of up to `QUERY_ROWS / group` consecutive positions, so that each
/// K/V block is read from memory once for the whole run, not once per token.
pub(crate) const QUERY_ROWS: usize = 48;

/// Tokens per run for `group` query heads per KV head (at least 1).
pub(crate) fn query_run(group: usize) -> usize {
    (QUERY_ROWS / group.max(1)).max(1)
}

/// Floats of per-thread scratch that [`attend_run`] needs for runs of up
/// to [`query_run`]`(group)` tokens (and so [`attend`] for one).
pub(crate) fn attend_scratch(group: usize, head_dim: usize, block_size: usize) -> usize {
    let rows = query_run(group) * group;
    // The lanes kernel's tiles of 16 rows: queries and accumulators
    // transposed, maxima and sums; a block's K and V widened to f32.
    let lanes = rows.div_ceil(16) * 16 * (2 * head_dim + 2) + 2 * block_size * head_dim;
    rows * (head_dim + 2 + block_size.next_multiple_of(8))
        + 2 * block_size * head_dim.div_ceil(G)
        + lanes
}

/// Rows `start..start + n` of one K or V run, as attention reads them.
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    /// Values and each row's scales widened to f32 (`hd / 32` per row).
    Int8 {
        q: &'a [i8],
        d: &'a [f32],
    },
}

impl Rows<'_> {
    /// `q . row j` (scalar).
    #[inline(always)]
    fn dot(&self, j: usize, q: &[f32]) -> f32 {
        let hd = q.len();
        match *self {
            Rows::F32(r) => q.iter().zip(&r[j * hd..]).map(|(a, b)| a * b).sum(),
            Rows::F16(r) => q
                .iter()
                .zip(&r[j * hd..])
                .map(|(a, b)| a * b.to_f32())
                .sum(),
            Rows::Int8 { q: v, d } => {
                let ng = hd / G;
                let mut s = 0f32;
                for g in 0..ng {
                    let part: f32 = q[g * G..(g + 1) * G]
                        .iter()
                        .zip(&v[j * hd + g * G..])
                        .map(|(a, &b)| a * b as f32)
                        .sum();
                    s += part * d[j * ng + g];
                }
                s
            }
        }
    }

    /// `acc = acc * corr + p * row j` (scalar).
    #[inline(always)]
    fn axpy(&self, j: usize, acc: &mut [f32], corr: f32, p: f32) {
        let hd = acc.len();
        match *self {
            Rows::F32(r) => {
                for (a, b) in acc.iter_mut().zip(&r[j * hd..]) {
                    *a = *a * corr + p * b;
                }
            }
            Rows::F16(r) => {
                for (a, b) in acc.iter_mut().zip(&r[j * hd..]) {
                    *a = *a * corr + p * b.to_f32();
                }
            }
            Rows::Int8 { q, d } => {
                let ng = hd / G;
                for g in 0..ng {
                    let pd = p * d[j * ng + g];
                    for (a, &b) in acc[g * G..(g + 1) * G].iter_mut().zip(&q[j * hd + g * G..]) {
                        *a = *a * corr + pd * b as f32;
                    }
                }
            }
        }
    }
}

/// The K and V rows `start..start + n` of (block, layer, kv head); int8
/// scales are widened into `dk` and `dv`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn block_rows<'a>(
    data: &'a KvData,
    kv: &KvLayout,
    block: usize,
    layer: usize,
    kh: usize,
    start: usize,
    n: usize,
    dk: &'a mut [f32],
    dv: &'a mut [f32],
) -> (Rows<'a>, Rows<'a>) {
    let hd = kv.head_dim;
    let ko = kv.offset(block, layer, 0, kh);
    let vo = kv.offset(block, layer, 1, kh);
    match data {
        KvData::F32(x) => (
            Rows::F32(&x[ko + start * hd..ko + (start + n) * hd]),
            Rows::F32(&x[vo + start * hd..vo + (start + n) * hd]),
        ),
        KvData::F16(x) => (
            Rows::F16(&x[ko + start * hd..ko + (start + n) * hd]),
            Rows::F16(&x[vo + start * hd..vo + (start + n) * hd]),
        ),
        KvData::Int8(x) => (
            int8_rows(x, kv, ko, start, n, dk),
            int8_rows(x, kv, vo, start, n, dv),
        ),
    }
}

/// Asks the CPU to start loading block `block`'s K and V runs of
/// (`layer`, `kh`) into cache: attention calls it for the next block of a
/// table while it computes the current one, so that a scattered block's
/// first lines are not each a wait on memory (the hardware prefetcher
/// learns a stream only after a few misses, and every block starts one).
#[inline(always)]
fn prefetch_block(store: &KvStore, block: usize, layer: usize, kh: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let kv = &store.layout;
        // A run's rows, values and (int8) scales, as they lie in the store.
        let row = store.dtype().row_bytes(kv.head_dim);
        let bytes = store.bytes();
        for which in 0..2 {
            let start = kv.offset(block, layer, which, kh) / kv.head_dim * row;
            for line in bytes[start..start + kv.block_size * row].chunks(64) {
                // SAFETY: a prefetch is only a hint: it never faults and
                // reads nothing into the program.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (store, block, layer, kh);
}

/// Rows `start..start + n` of the int8 run at value offset `off`, its
/// scales widened into `d`.
#[inline(always)]
fn int8_rows<'a>(
    x: &'a [i8],
    kv: &KvLayout,
    off: usize,
    start: usize,
    n: usize,
    d: &'a mut [f32],
) -> Rows<'a> {
    let hd = kv.head_dim;
    let ng = hd / G;
    let (vals, scales) = int8_run(off, kv.block_size, hd);
    let sb = &x[scales + start * ng * 2..scales + (start + n) * ng * 2];
    widen_scales(sb, &mut d[..n * ng]);
    let d: &'a [f32] = d;
    Rows::Int8 {
        q: &x[vals + start * hd..vals + (start + n) * hd],
        d: &d[..n * ng],
    }
}

/// Little-endian f16 scales (`2 * out.len()` bytes) as f32: eight at a time
/// with F16C where the CPU has it (a block's scales are widened for every
/// token that reads it, so a software conversion would cost as much as the
/// attention), the same values either way (the conversion is exact).
#[inline]
fn widen_scales(src: &[i8], out: &mut [f32]) {
    assert_eq!(src.len(), 2 * out.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: F16C present; each load reads 16 bytes of src and each
        // store writes 8 floats of out, inside both (done + 8 <= len).
        unsafe { done = widen_scales_f16c(src, out) };
    }
    for (o, b) in out[done..].iter_mut().zip(src[2 * done..].chunks_exact(2)) {
        *o = f16::from_bits(u16::from_le_bytes([b[0] as u8, b[1] as u8])).to_f32();
    }
}

/// [`widen_scales`]' whole groups of eight; returns how many it wrote.
///
/// # Safety
/// The CPU must have F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c,avx")]
unsafe fn widen_scales_f16c(src: &[i8], out: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let whole = out.len() / 8 * 8;
    let mut i = 0;
    while i < whole {
        // SAFETY: i + 8 <= out.len(); src holds 2 * out.len() bytes.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(2 * i) as *const __m128i);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    whole
}

/// Attention of the `group` query heads that share KV head `kh`, for one
/// token at `pos`, over positions `0..=pos` (or the last `window` of them)
/// through the block table: [`attend_run`] of one token.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    kernel: Resolved,
    store: &KvStore,
    layer: usize,
    kh: usize,
    table: &[u32],
    pos: usize,
    window: Option<usize>,
    q: &[f32],
    out: &mut [f32],
    group: usize,
    scale: f32,
    buf: &mut [f32],
) {
    attend_run(
        kernel, store, layer, kh, table, pos, 1, window, q, out, group, scale, buf,
    );
}

/// Attention of `nq` tokens of one sequence at positions `pos0..pos0 +
/// nq` (each over its own positions `0..=pos`, or the last `window` of
/// them: causal), for the `group` query heads that share KV head `kh`,
/// through the block table: online softmax, one KV block at a time, no
/// score matrix. Each block's K and V are read once for every token whose
/// span covers the same rows of it (all of them, but for the run's last
/// blocks and a window's edges), so a prompt chunk streams its context
/// from memory once per run, not once per token. `q` and `out` hold the
/// tokens' rows (`nq x group x head_dim`, token-major); `buf` holds
/// [`attend_scratch`] floats; `nq` is at most [`query_run`]`(group)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_run(
    kernel: Resolved,
    store: &KvStore,
    layer: usize,
    kh: usize,
    table: &[u32],
    pos0: usize,
    nq: usize,
    window: Option<usize>,
    q: &[f32],
    out: &mut [f32],
    group: usize,
    scale: f32,
    buf: &mut [f32],
) {
    let kv = &store.layout;
    let hd = kv.head_dim;
    let bs = kv.block_size;
    assert!(nq >= 1 && nq <= query_run(group), "run of {nq} tokens");
    let rows = nq * group;
    assert!(q.len() >= rows * hd && out.len() >= rows * hd);
    let (acc, rest) = buf.split_at_mut(rows * hd);
    // One row of scores per query row of a kernel call (the SIMD path fills
    // them together).
    let (scores, rest) = rest.split_at_mut(rows * bs.next_multiple_of(8));
    let (mx, rest) = rest.split_at_mut(rows);
    let (sum, rest) = rest.split_at_mut(rows);
    let (dk, rest) = rest.split_at_mut(bs * hd.div_ceil(G));
    let (dv, lanes_buf) = rest.split_at_mut(bs * hd.div_ceil(G));
    acc.fill(0.0);
    mx.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    // Token t sees positions first(t)..=pos0 + t.
    let first = |t: usize| window.map_or(0, |w| (pos0 + t + 1).saturating_sub(w));
    let n_blocks = (pos0 + nq - 1) / bs + 1;
    // Blocks every token of the run sees whole: with enough rows, the
    // lanes kernel takes them first (the online softmax does not care in
    // which order blocks come).
    let shared = first(nq - 1).div_ceil(bs)..(pos0 + 1) / bs;
    let lanes = lanes_kernel(kernel, hd, bs, rows) && shared.len() >= 2;
    if lanes {
        shared_blocks_in_lanes(
            store,
            layer,
            kh,
            &table[shared.clone()],
            q,
            rows,
            scale,
            (&mut *mx, &mut *sum, &mut *acc),
            (&mut *dk, &mut *dv),
            lanes_buf,
        );
    }
    // A sliding window reads only the blocks that hold its positions.
    for (bi, &block) in table[..n_blocks].iter().enumerate().skip(first(0) / bs) {
        if lanes && shared.contains(&bi) {
            continue;
        }
        if let Some(&next) = table[..n_blocks].get(bi + 1) {
            prefetch_block(store, next as usize, layer, kh);
        }
        let lo = bi * bs;
        // Token t's rows of this block, as `start..end` within it.
        let span = |t: usize| {
            let (s, e) = (first(t).max(lo), (pos0 + t + 1).min(lo + bs));
            (s < e).then(|| (s - lo, e - lo))
        };
        let mut t = 0;
        while t < nq {
            let Some((start, end)) = span(t) else {
                t += 1;
                continue;
            };
            // The following tokens that see the same rows share the reads.
            let mut t1 = t + 1;
            while t1 < nq && span(t1) == Some((start, end)) {
                t1 += 1;
            }
            let n = end - start;
            let (k, v) = block_rows(
                &store.data,
                kv,
                block as usize,
                layer,
                kh,
                start,
                n,
                &mut *dk,
                &mut *dv,
            );
            let r = t * group..t1 * group;
            block_step(
                kernel,
                k,
                v,
                n,
                hd,
                scale,
                &q[r.start * hd..r.end * hd],
                &mut *scores,
                &mut mx[r.clone()],
                &mut sum[r.clone()],
                &mut acc[r.start * hd..r.end * hd],
            );
            t = t1;
        }
    }
    for g in 0..rows {
        let inv = 1.0 / sum[g];
        for (o, a) in out[g * hd..(g + 1) * hd]
            .iter_mut()
            .zip(&acc[g * hd..(g + 1) * hd])
        {
            *o = a * inv;
        }
    }
}

/// Whether [`shared_blocks_in_lanes`] runs here: AVX-512 (whose
/// row-major kernel it matches to the bit), heads in sixteens, blocks of
/// 16 (one softmax step per block, as the row-major kernel takes), and at
/// least a full tile of query rows.
fn lanes_kernel(kernel: Resolved, hd: usize, bs: usize, rows: usize) -> bool {
    cfg!(target_arch = "x86_64") && kernel.vnni() && hd.is_multiple_of(16) && bs == 16 && rows >= 16
}

/// The blocks `table` (each seen whole by every one of the `rows` query
/// rows `q`) through the AVX-512 lanes kernel, sixteen rows a tile; the
/// tiles' state is left as the rows' online-softmax state (`mx`, `sum`,
/// `acc`), the same to the bit as if the row-major kernel had read these
/// blocks: a token's attention is the same whether it came in a run of a
/// prompt chunk or alone (a decode), so batching never changes a token.
#[allow(clippy::too_many_arguments)]
fn shared_blocks_in_lanes(
    store: &KvStore,
    layer: usize,
    kh: usize,
    table: &[u32],
    q: &[f32],
    rows: usize,
    scale: f32,
    (mx, sum, acc): (&mut [f32], &mut [f32], &mut [f32]),
    (dk, dv): (&mut [f32], &mut [f32]),
    buf: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::avx512;
        let kv = &store.layout;
        let (hd, bs) = (kv.head_dim, kv.block_size);
        let tiles = rows.div_ceil(16);
        let (qt, rest) = buf.split_at_mut(tiles * 16 * hd);
        let (acct, rest) = rest.split_at_mut(tiles * 16 * hd);
        let (kf, rest) = rest.split_at_mut(bs * hd);
        let vf = &mut rest[..bs * hd];
        const TILES: usize = QUERY_ROWS.div_ceil(16);
        assert!(tiles <= TILES);
        let mut tmx = [[f32::NEG_INFINITY; 16]; TILES];
        let mut tsum = [[0f32; 16]; TILES];
        // Queries transposed; rows past `rows` are zero.
        qt.fill(0.0);
        acct.fill(0.0);
        for r in 0..rows {
            let (tile, lane) = (r / 16, r % 16);
            for i in 0..hd {
                qt[tile * 16 * hd + i * 16 + lane] = q[r * hd + i];
            }
        }
        for &block in table {
            let (k, v) = block_rows(&store.data, kv, block as usize, layer, kh, 0, bs, dk, dv);
            // SAFETY: AVX-512 resolved only when present (`lanes_kernel`);
            // shapes as asserted by the kernels.
            unsafe {
                widen(k, bs, hd, kf);
                widen(v, bs, hd, vf);
                for t in 0..tiles {
                    let span = t * 16 * hd..(t + 1) * 16 * hd;
                    let mut st = avx512::Lanes16 {
                        qt: &qt[span.clone()],
                        scale,
                        mx: &mut tmx[t],
                        sum: &mut tsum[t],
                        acct: &mut acct[span],
                    };
                    avx512::lanes_block(&mut st, kf, vf, bs, hd);
                }
            }
        }
        for r in 0..rows {
            let (tile, lane) = (r / 16, r % 16);
            mx[r] = tmx[tile][lane];
            sum[r] = tsum[tile][lane];
            for i in 0..hd {
                acc[r * hd + i] = acct[tile * 16 * hd + i * 16 + lane];
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (
            store, layer, kh, table, q, rows, scale, mx, sum, acc, dk, dv, buf,
        );
        unreachable!("the lanes kernel is x86-64 only");
    }
}

/// `n` rows of K or V widened to f32 by the AVX-512 loads.
///
/// # Safety
/// AVX-512 F present; `out` holds `n * hd` floats.
#[cfg(target_arch = "x86_64")]
unsafe fn widen(rows: Rows<'_>, n: usize, hd: usize, out: &mut [f32]) {
    use crate::kernels::avx512::widen_rows;
    // SAFETY: by the caller's promise.
    unsafe {
        match rows {
            Rows::F32(r) => widen_rows(avx2::Plain(r), n, hd, out),
            Rows::F16(r) => widen_rows(avx2::Plain(r), n, hd, out),
            Rows::Int8 { q, d } => widen_rows(avx2::Int8Rows { q, d }, n, hd, out),
        }
    }
}

/// One KV block's `n` rows for the query rows `q` (`mx.len()` of them):
/// the online softmax's update of `mx`, `sum` and `acc`, by the SIMD block
/// kernel the CPU has or the scalar one.
#[allow(clippy::too_many_arguments)]
#[inline]
fn block_step(
    kernel: Resolved,
    k: Rows<'_>,
    v: Rows<'_>,
    n: usize,
    hd: usize,
    scale: f32,
    q: &[f32],
    scores: &mut [f32],
    mx: &mut [f32],
    sum: &mut [f32],
    acc: &mut [f32],
) {
    // One SIMD block kernel over the rows of whichever dtype the store holds.
    #[cfg(target_arch = "x86_64")]
    macro_rules! simd_block {
        ($f:path) => {
            match (k, v) {
                (Rows::F32(k), Rows::F32(v)) => $f(
                    q,
                    avx2::Plain(k),
                    avx2::Plain(v),
                    n,
                    hd,
                    scale,
                    scores,
                    mx,
                    sum,
                    acc,
                ),
                (Rows::F16(k), Rows::F16(v)) => $f(
                    q,
                    avx2::Plain(k),
                    avx2::Plain(v),
                    n,
                    hd,
                    scale,
                    scores,
                    mx,
                    sum,
                    acc,
                ),
                (Rows::Int8 { q: kq, d: kd }, Rows::Int8 { q: vq, d: vd }) => $f(
                    q,
                    avx2::Int8Rows { q: kq, d: kd },
                    avx2::Int8Rows { q: vq, d: vd },
                    n,
                    hd,
                    scale,
                    scores,
                    mx,
                    sum,
                    acc,
                ),
                _ => unreachable!("K and V of one store share a dtype"),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if kernel.vnni() && hd.is_multiple_of(16) {
        // SAFETY: AVX-512 resolved only when present; rows sized by the caller.
        unsafe { simd_block!(crate::kernels::avx512::attend_block) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() {
        // SAFETY: AVX2 resolved only when present; rows sized by the caller.
        unsafe { simd_block!(avx2::attend_block) };
        return;
    }
    let _ = kernel;
    for g in 0..mx.len() {
        let qg = &q[g * hd..(g + 1) * hd];
        let mut bmax = f32::NEG_INFINITY;
        for (j, sc) in scores[..n].iter_mut().enumerate() {
            *sc = k.dot(j, qg) * scale;
            bmax = bmax.max(*sc);
        }
        let m_new = mx[g].max(bmax);
        let corr = (mx[g] - m_new).exp();
        mx[g] = m_new;
        let a = &mut acc[g * hd..(g + 1) * hd];
        let mut l = sum[g] * corr;
        for (j, &sc) in scores[..n].iter().enumerate() {
            let p = (sc - m_new).exp();
            l += p;
            v.axpy(j, a, if j == 0 { corr } else { 1.0 }, p);
        }
        sum[g] = l;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::rnd;

    fn rnd_vec(n: usize, mut seed: u64) -> Vec<f32> {
        (0..n).map(|_| rnd(&mut seed)).collect()
    }

    /// The system's zero pages read as zeros of every element type, and
    /// what is written stays; a store far larger than any test touches is
    /// only mapped, not filled.
    #[test]
    fn zeroed_storage_reads_zero_and_keeps_what_is_written() {
        let mut a = Zeroed::<f16>::new(3 << 20).unwrap();
        assert!(a.iter().step_by(4099).all(|&v| v == f16::ZERO));
        a[123_457] = f16::from_f32(1.5);
        assert_eq!(a[123_457].to_f32(), 1.5);
        let b = Zeroed::<i8>::new(1 << 30).unwrap();
        assert_eq!((b.len(), b[0], b[(1 << 30) - 1]), (1 << 30, 0, 0));
        let c = Zeroed::<f32>::new(0).unwrap();
        assert!(c.is_empty());
    }

    /// The fast transform is the orthonormal Sylvester matrix (built by
    /// doubling, as its definition reads), applied blockwise, and its own
    /// inverse.
    #[test]
    fn hadamard_is_the_orthonormal_sylvester_matrix_and_its_own_inverse() {
        assert_eq!(int8_rotations(64), Some((64, 64)));
        assert_eq!(int8_rotations(128), Some((128, 64)));
        assert_eq!(int8_rotations(192), Some((64, 64)));
        assert_eq!(int8_rotations(256), Some((256, 64)));
        assert_eq!(int8_rotations(96), None);
        assert_eq!(int8_rotations(32), None);
        for n in [64usize, 128, 256] {
            let mut m = vec![0f64; n * n];
            m[0] = 1.0;
            let mut s = 1;
            while s < n {
                for i in 0..s {
                    for j in 0..s {
                        let v = m[i * n + j];
                        m[(i + s) * n + j] = v;
                        m[i * n + j + s] = v;
                        m[(i + s) * n + j + s] = -v;
                    }
                }
                s *= 2;
            }
            let x = rnd_vec(2 * n, n as u64);
            let mut y = x.clone();
            hadamard(&mut y, n);
            for (b, (xb, yb)) in x.chunks(n).zip(y.chunks(n)).enumerate() {
                for i in 0..n {
                    let want: f64 = (0..n).map(|j| m[i * n + j] * xb[j] as f64).sum::<f64>()
                        / (n as f64).sqrt();
                    assert!(
                        (yb[i] as f64 - want).abs() < 1e-5,
                        "n {n} block {b} row {i}"
                    );
                }
            }
            let mut z = y.clone();
            hadamard(&mut z, n);
            assert!(
                x.iter().zip(&z).all(|(a, b)| (a - b).abs() < 1e-5),
                "n {n}: not involutive"
            );
        }
    }

    /// Keys with one large channel per head (Qwen2's, from its K bias):
    /// rotated before quantisation, `q . k` from the int8 rows is several
    /// times closer to the f32 product than without the rotation.
    #[test]
    fn rotating_keys_with_a_large_channel_keeps_their_dot_products() {
        let hd = 64;
        let (mut plain, mut turned) = (0f64, 0f64);
        for t in 0..64u64 {
            let mut k: Vec<f32> = rnd_vec(hd, 100 + t).iter().map(|v| v * 6.0).collect();
            k[31] = 210.0;
            k[62] = -110.0;
            let q: Vec<f32> = rnd_vec(hd, 900 + t).iter().map(|v| v * 3.0).collect();
            let exact: f32 = q.iter().zip(&k).map(|(a, b)| a * b).sum();
            let round_trip = |x: &[f32]| -> Vec<f32> {
                let (mut qs, mut d) = (vec![0i8; hd], vec![0u8; hd / G * 2]);
                quantize_int8_row(x, &mut qs, &mut d);
                qs.iter()
                    .enumerate()
                    .map(|(i, &v)| {
                        let s = f16::from_le_bytes([d[i / G * 2], d[i / G * 2 + 1]]);
                        s.to_f32() * v as f32
                    })
                    .collect()
            };
            let kq = round_trip(&k);
            plain += (q.iter().zip(&kq).map(|(a, b)| a * b).sum::<f32>() - exact).abs() as f64;
            let (mut qr, mut kr) = (q.clone(), k.clone());
            hadamard(&mut qr, hd);
            hadamard(&mut kr, hd);
            let kq = round_trip(&kr);
            turned += (qr.iter().zip(&kq).map(|(a, b)| a * b).sum::<f32>() - exact).abs() as f64;
        }
        assert!(
            turned * 3.0 < plain,
            "rotated error {turned:.2} vs plain {plain:.2}"
        );
    }

    fn store(
        dtype: KvDtype,
        bs: usize,
        hd: usize,
        n_kv: usize,
        layers: usize,
        blocks: usize,
    ) -> KvStore {
        let layout = KvLayout {
            block_size: bs,
            n_kv,
            head_dim: hd,
            block_elems: layers * 2 * n_kv * bs * hd,
        };
        let bytes = dtype.bytes_per_block(layers, n_kv, hd, bs) * blocks;
        let data = match dtype {
            KvDtype::F32 => KvData::F32(Zeroed::new(layout.block_elems * blocks).unwrap()),
            KvDtype::F16 => KvData::F16(Zeroed::new(layout.block_elems * blocks).unwrap()),
            KvDtype::Int8 => KvData::Int8(Zeroed::new(bytes).unwrap()),
        };
        KvStore {
            data,
            block_size: bs,
            num_blocks: blocks,
            layout,
        }
    }

    /// Fills every row of `s` with random values through the writer and
    /// returns them as f32 (what each row was meant to hold), by
    /// `[block][layer][kv][head][slot]`.
    fn fill(s: &mut KvStore, layers: usize, seed: &mut u64) -> Vec<Vec<f32>> {
        let (bs, hd, n_kv) = (s.layout.block_size, s.layout.head_dim, s.layout.n_kv);
        let w = s.writer();
        let mut rows = Vec::new();
        for b in 0..s.num_blocks {
            for l in 0..layers {
                for kv in 0..2 {
                    for h in 0..n_kv {
                        for slot in 0..bs {
                            // One outlier channel per row, as real K caches have.
                            let row: Vec<f32> = (0..hd)
                                .map(|i| rnd(seed) * if i == 5 { 20.0 } else { 2.0 })
                                .collect();
                            // SAFETY: single thread; the store is alive.
                            unsafe { w.store(Resolved::Scalar, b, l, kv, h, slot, &row) };
                            rows.push(row);
                        }
                    }
                }
            }
        }
        rows
    }

    /// The value a row holds after storing, read back through `block_rows`.
    fn stored(s: &KvStore, b: usize, l: usize, kv: usize, h: usize, slot: usize) -> Vec<f32> {
        let hd = s.layout.head_dim;
        let mut dk = vec![0f32; s.layout.block_size * hd / G + 1];
        let mut dv = dk.clone();
        let (k, v) = block_rows(&s.data, &s.layout, b, l, h, slot, 1, &mut dk, &mut dv);
        let r = if kv == 0 { k } else { v };
        (0..hd)
            .map(|i| {
                let mut unit = vec![0f32; hd];
                unit[i] = 1.0;
                r.dot(0, &unit)
            })
            .collect()
    }

    /// An int8 row reads back within half a step of its group's scale of
    /// what was stored (and f16 within f16's rounding), and a block's bytes
    /// are exactly the dtype's `bytes_per_block`.
    #[test]
    fn rows_read_back_within_their_rounding() {
        let (bs, hd, n_kv, layers, blocks) = (16, 64, 2, 2, 3);
        for dtype in KvDtype::ALL {
            let mut s = store(dtype, bs, hd, n_kv, layers, blocks);
            assert_eq!(
                s.bytes().len(),
                blocks * dtype.bytes_per_block(layers, n_kv, hd, bs)
            );
            assert_eq!(
                s.bytes_per_block(),
                dtype.bytes_per_block(layers, n_kv, hd, bs)
            );
            let rows = fill(&mut s, layers, &mut 11);
            let mut i = 0;
            for b in 0..blocks {
                for l in 0..layers {
                    for kv in 0..2 {
                        for h in 0..n_kv {
                            for slot in 0..bs {
                                let want = &rows[i];
                                i += 1;
                                let got = stored(&s, b, l, kv, h, slot);
                                for (g, (x, y)) in want.chunks(G).zip(got.chunks(G)).enumerate() {
                                    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                                    for (a, c) in x.iter().zip(y) {
                                        let tol = match dtype {
                                            KvDtype::F32 => 0.0,
                                            KvDtype::F16 => a.abs() * 1e-3,
                                            // Half a step plus the f16 scale's rounding.
                                            KvDtype::Int8 => amax / 127.0 * 0.5 + amax * 1e-3,
                                        };
                                        assert!(
                                            (a - c).abs() <= tol,
                                            "{dtype} group {g}: stored {a}, read {c}"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The SIMD attention (AVX2, and AVX-512 where the CPU has it: eight
    /// scores per hadd tree, vector exp) agrees with the scalar one, and both with a naive softmax over exactly the
    /// window's positions of the values the cache holds, for every dtype,
    /// over shuffled blocks, partial last blocks, GQA groups and sliding
    /// windows that start inside a block, at its edge and at 0.
    #[test]
    fn simd_attention_matches_scalar_and_naive() {
        let (bs, hd, n_kv, layers, blocks) = (16, 64, 2, 2, 8);
        let mut kernels = vec![Resolved::Scalar];
        if crate::kernels::has_avx2() {
            kernels.push(Resolved::Avx2);
        }
        if crate::kernels::has_avx512_vnni() {
            kernels.push(Resolved::Avx512Vnni);
        }
        for dtype in KvDtype::ALL {
            let mut s = store(dtype, bs, hd, n_kv, layers, blocks);
            let mut seed = 5;
            fill(&mut s, layers, &mut seed);
            let table = [5u32, 2, 7, 0];
            // Groups of 1, 3, 5 and 8 query heads per KV head: the SIMD
            // path takes them in chunks of up to four.
            for group in [1usize, 3, 5, 8] {
                let q: Vec<f32> = (0..group * hd).map(|_| rnd(&mut seed) * 3.0).collect();
                let mut buf = vec![0f32; attend_scratch(group, hd, bs)];
                for window in [None, Some(1), Some(5), Some(16), Some(20)] {
                    for pos in [0usize, 7, 15, 16, 33, 63] {
                        let outs: Vec<Vec<f32>> = kernels
                            .iter()
                            .map(|&kernel| {
                                let mut o = vec![0f32; group * hd];
                                attend(
                                    kernel, &s, 1, 1, &table, pos, window, &q, &mut o, group,
                                    0.125, &mut buf,
                                );
                                o
                            })
                            .collect();
                        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                        let at = |p: usize, kv: usize| {
                            stored(&s, table[p / bs] as usize, 1, kv, 1, p % bs)
                        };
                        for g in 0..group {
                            let qg = &q[g * hd..(g + 1) * hd];
                            let sc: Vec<f64> = (lo..=pos)
                                .map(|p| {
                                    let k = at(p, 0);
                                    (0..hd).map(|i| (qg[i] * k[i]) as f64).sum::<f64>() * 0.125
                                })
                                .collect();
                            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                            let vs: Vec<Vec<f32>> = (lo..=pos).map(|p| at(p, 1)).collect();
                            for i in 0..hd {
                                let want: f64 = vs
                                    .iter()
                                    .zip(&sc)
                                    .map(|(v, s)| (s - m).exp() / z * v[i] as f64)
                                    .sum();
                                for o in &outs {
                                    let got = o[g * hd + i] as f64;
                                    assert!(
                                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                                        "{dtype} group {group} window {window:?} pos {pos}: \
                                         {got} vs {want}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The F16C widening of int8 scales gives the software conversion's
    /// values, for every length (whole groups of eight and a tail).
    #[test]
    fn scales_widen_as_the_software_conversion_does() {
        let mut seed = 11;
        for len in [0usize, 1, 7, 8, 9, 16, 31, 64] {
            let vals: Vec<f16> = [f16::MIN_POSITIVE_SUBNORMAL, f16::MAX, f16::ZERO]
                .into_iter()
                .chain(
                    (0..len).map(|i| f16::from_f32(rnd(&mut seed) * 10f32.powi(i as i32 % 7 - 3))),
                )
                .take(len)
                .collect();
            let bytes: Vec<i8> = vals
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .map(|b| b as i8)
                .collect();
            let mut out = vec![f32::NAN; len];
            widen_scales(&bytes, &mut out);
            let want: Vec<f32> = vals.iter().map(|v| v.to_f32()).collect();
            assert_eq!(out, want, "length {len}");
        }
    }

    /// A run of tokens gives each token what attending alone gives it, to
    /// the bit, for every kernel and dtype, run length, start and window:
    /// each row's online softmax sees the same blocks in the same order,
    /// and the AVX-512 lanes kernel (blocks shared by a run of 16 rows or
    /// more) repeats the row-major kernel's arithmetic. Batching a prompt
    /// differently never changes a token.
    #[test]
    fn a_run_of_tokens_attends_as_each_token_alone() {
        let (bs, hd, n_kv, layers, blocks) = (16, 64, 2, 2, 8);
        let mut kernels = vec![Resolved::Scalar];
        if crate::kernels::has_avx2() {
            kernels.push(Resolved::Avx2);
        }
        if crate::kernels::has_avx512_vnni() {
            kernels.push(Resolved::Avx512Vnni);
        }
        assert_eq!((query_run(3), query_run(4), query_run(64)), (16, 12, 1));
        for dtype in KvDtype::ALL {
            let mut s = store(dtype, bs, hd, n_kv, layers, blocks);
            let mut seed = 9;
            fill(&mut s, layers, &mut seed);
            let table = [5u32, 2, 7, 0, 1, 3];
            for group in [1usize, 3, 4] {
                let mut buf = vec![0f32; attend_scratch(group, hd, bs)];
                let max = query_run(group).min(20);
                let q: Vec<f32> = (0..max * group * hd)
                    .map(|_| rnd(&mut seed) * 3.0)
                    .collect();
                for &kernel in &kernels {
                    for window in [None, Some(1), Some(5), Some(16), Some(21)] {
                        for (pos0, nq) in [
                            (0, 1),
                            (0, max),
                            (3, 2),
                            (14, 5),
                            (16, max),
                            (40, 7),
                            (50, max),
                        ] {
                            let rows = nq * group * hd;
                            let mut run = vec![0f32; rows];
                            attend_run(
                                kernel,
                                &s,
                                1,
                                1,
                                &table,
                                pos0,
                                nq,
                                window,
                                &q[..rows],
                                &mut run,
                                group,
                                0.125,
                                &mut buf,
                            );
                            for t in 0..nq {
                                let r = t * group * hd..(t + 1) * group * hd;
                                let mut alone = vec![0f32; group * hd];
                                attend(
                                    kernel,
                                    &s,
                                    1,
                                    1,
                                    &table,
                                    pos0 + t,
                                    window,
                                    &q[r.clone()],
                                    &mut alone,
                                    group,
                                    0.125,
                                    &mut buf,
                                );
                                for (a, b) in run[r].iter().zip(&alone) {
                                    assert!(
                                        a.to_bits() == b.to_bits(),
                                        "{dtype} {kernel:?} group {group} window {window:?} \
                                         run {pos0}+{nq} token {t}: {a} vs {b}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Attention speed per kernel and dtype (not a test: `cargo test -p
    /// flotilla-model --lib attention_speed -- --ignored --nocapture`): one
    /// token's three query heads over 4,096 positions of one KV head,
    /// SmolLM2's shape, on one thread.
    #[test]
    #[ignore]
    fn attention_speed() {
        let (bs, hd, n_kv, layers, blocks, group) = (16, 64, 1, 1, 256, 3);
        let mut kernels = vec![Resolved::Scalar];
        if crate::kernels::has_avx2() {
            kernels.push(Resolved::Avx2);
        }
        if crate::kernels::has_avx512_vnni() {
            kernels.push(Resolved::Avx512Vnni);
        }
        for dtype in KvDtype::ALL {
            let mut s = store(dtype, bs, hd, n_kv, layers, blocks);
            let mut seed = 3;
            fill(&mut s, layers, &mut seed);
            let table: Vec<u32> = (0..blocks as u32).collect();
            let q: Vec<f32> = (0..group * hd).map(|_| rnd(&mut seed)).collect();
            let mut buf = vec![0f32; attend_scratch(group, hd, bs)];
            let mut o = vec![0f32; group * hd];
            for &kernel in &kernels {
                let reps = 200;
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        attend(
                            kernel,
                            &s,
                            0,
                            0,
                            &table,
                            blocks * bs - 1,
                            None,
                            &q,
                            &mut o,
                            group,
                            0.125,
                            &mut buf,
                        );
                    }
                    best = best.min(t.elapsed().as_secs_f64() / reps as f64);
                }
                eprintln!(
                    "{dtype} {kernel:?}: {:.1} us per token and KV head",
                    best * 1e6
                );
                // A prompt chunk's run of tokens at the same depth (the
                // lanes kernel's case on AVX-512), per token.
                let (nq, run_reps) = (query_run(group), reps / 10);
                let pos0 = blocks * bs - nq;
                let qr: Vec<f32> = (0..nq * group * hd).map(|_| rnd(&mut seed)).collect();
                let mut or = vec![0f32; nq * group * hd];
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = std::time::Instant::now();
                    for _ in 0..run_reps {
                        attend_run(
                            kernel, &s, 0, 0, &table, pos0, nq, None, &qr, &mut or, group, 0.125,
                            &mut buf,
                        );
                    }
                    best = best.min(t.elapsed().as_secs_f64() / (run_reps * nq) as f64);
                }
                eprintln!(
                    "{dtype} {kernel:?}: {:.1} us per token and KV head in a run of {nq}",
                    best * 1e6
                );
            }
        }
    }
}
