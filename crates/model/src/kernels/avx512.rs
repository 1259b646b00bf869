//! AVX-512 VNNI kernels (`vpdpbusd` on 256-bit registers, AVX-512 VL):
//! unsigned byte times signed byte, four products summed straight into an
//! i32 lane, so no `maddubs` saturation to work around and no `madd` to
//! widen. Both weight layouts hold unsigned bytes: Q4_1's nibbles, and Q8_0
//! stored as `q + 128` (`quant::repack_q8_0_x8`) with the offset `-128 d`
//! folded in through the activations' scaled sums, as Q4_1's `m`.
//!
//! Each 256-bit load of weights feeds eight rows (one 4-byte group of each);
//! the matching 4 activation bytes are broadcast to all lanes. Tiles of 8
//! rows x 4 tokens; tokens in passes of 64, as the AVX2 kernels.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Acts, OutPtr};
use crate::quant::{BlockQ8A, Q4_1X8_BYTES, Q8_0X8_BYTES, QK};

const TILE: usize = 4;
const TOKENS_PER_PASS: usize = 64;

/// The 4 activation bytes `qs[at..at + 4]` of token block `ab`, in every lane.
#[inline(always)]
unsafe fn bcast4(ab: &BlockQ8A, at: usize) -> __m256i {
    // SAFETY: at + 4 <= 32 at every call site.
    unsafe {
        _mm256_set1_epi32(std::ptr::read_unaligned(
            ab.qs.as_ptr().add(at) as *const i32
        ))
    }
}

/// Adds one block's integer sums to the 8-row accumulators of N tokens:
/// `acc += isum * (dw * d_a) + mw * s_a`, where `a[(t0 + c) * nb]` is token
/// `t0 + c`'s block (the caller passes the slice starting at the block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fold_block<const N: usize>(
    acc: &mut [__m256; N],
    i32s: &[__m256i; N],
    dw: __m256,
    mw: __m256,
    a: &[BlockQ8A],
    t0: usize,
    nb: usize,
) {
    for c in 0..N {
        let ab = &a[(t0 + c) * nb];
        acc[c] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(i32s[c]),
            _mm256_mul_ps(dw, _mm256_set1_ps(ab.d)),
            acc[c],
        );
        acc[c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(ab.s), acc[c]);
    }
}

/// Interleaved Q4_1 group times N tokens: 8 rows per lane set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_1x8_tile<const N: usize>(
    g: *const u8,
    nb: usize,
    a: &[BlockQ8A],
    t0: usize,
) -> [__m256; N] {
    let mask = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY: b < nb; the group holds nb blocks.
        let blk = unsafe { g.add(b * Q4_1X8_BYTES) };
        let (dw, mw) = unsafe {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i)),
            )
        };
        let mut i32s = [_mm256_setzero_si256(); N];
        for j in 0..4 {
            // SAFETY: chunk j lies inside the block.
            let v = unsafe { _mm256_loadu_si256(blk.add(32 + 32 * j) as *const __m256i) };
            let lo = _mm256_and_si256(v, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for c in 0..N {
                let ab = &a[(t0 + c) * nb + b];
                // SAFETY: offsets 4j and 16 + 4j leave 4 bytes inside qs.
                let (alo, ahi) = unsafe { (bcast4(ab, 4 * j), bcast4(ab, 16 + 4 * j)) };
                i32s[c] = _mm256_dpbusd_epi32(i32s[c], lo, alo);
                i32s[c] = _mm256_dpbusd_epi32(i32s[c], hi, ahi);
            }
        }
        // SAFETY: same features as this function.
        unsafe { fold_block(&mut acc, &i32s, dw, mw, &a[b..], t0, nb) };
    }
    acc
}

/// Interleaved Q8_0 (`q + 128`) group times N tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0x8_tile<const N: usize>(
    g: *const u8,
    nb: usize,
    a: &[BlockQ8A],
    t0: usize,
) -> [__m256; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let m128 = _mm256_set1_ps(-128.0);
    for b in 0..nb {
        // SAFETY: b < nb; the group holds nb blocks.
        let blk = unsafe { g.add(b * Q8_0X8_BYTES) };
        let dw = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i)) };
        let mut i32s = [_mm256_setzero_si256(); N];
        for j in 0..8 {
            // SAFETY: chunk j lies inside the block.
            let v = unsafe { _mm256_loadu_si256(blk.add(16 + 32 * j) as *const __m256i) };
            for c in 0..N {
                // SAFETY: 4j + 4 <= 32.
                let av = unsafe { bcast4(&a[(t0 + c) * nb + b], 4 * j) };
                i32s[c] = _mm256_dpbusd_epi32(i32s[c], v, av);
            }
        }
        let mw = _mm256_mul_ps(dw, m128);
        // SAFETY: same features as this function.
        unsafe { fold_block(&mut acc, &i32s, dw, mw, &a[b..], t0, nb) };
    }
    acc
}

/// Stores the 8 row results of a group, keeping only rows inside `rows`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_group(v: __m256, out: OutPtr, t: usize, g0: usize, rows: &Range<usize>) {
    let mut buf = [0f32; 8];
    // SAFETY: buf has 8 floats.
    unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), v) };
    let lo = rows.start.max(g0);
    let hi = rows.end.min(g0 + 8);
    out.put_run(t, lo, &buf[lo - g0..hi - g0]);
}

/// One interleaved layout's rows `rows` times all tokens, through `tile`.
macro_rules! grouped_rows {
    ($name:ident, $tile:ident, $bytes:expr) => {
        /// Interleaved rows `rows` times all tokens of `x`.
        ///
        /// # Safety
        /// The CPU must have AVX2, FMA, F16C and AVX-512 F/BW/VL/VNNI
        /// (`kernels::has_avx512_vnni`); slices must have the lengths the
        /// shapes imply (asserted where cheap).
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(crate) unsafe fn $name(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
            let nb = x.k / QK;
            let gb = nb * $bytes;
            let (g_first, g_end) = (rows.start / 8, rows.end.div_ceil(8));
            assert!(g_end * gb <= w.len());
            assert!(x.q.len() >= x.t * nb);
            let mut p0 = 0;
            while p0 < x.t {
                let p1 = (p0 + TOKENS_PER_PASS).min(x.t);
                for g in g_first..g_end {
                    // SAFETY: g < g_end, asserted in bounds above.
                    let gp = unsafe { w.as_ptr().add(g * gb) };
                    let mut t = p0;
                    unsafe {
                        while t + TILE <= p1 {
                            let r = $tile::<TILE>(gp, nb, x.q, t);
                            for (c, v) in r.iter().enumerate() {
                                store_group(*v, out, t + c, g * 8, &rows);
                            }
                            t += TILE;
                        }
                        while t < p1 {
                            let [v] = $tile::<1>(gp, nb, x.q, t);
                            store_group(v, out, t, g * 8, &rows);
                            t += 1;
                        }
                    }
                }
                p0 = p1;
            }
        }
    };
}

grouped_rows!(q4_1x8_rows, q4_1x8_tile, Q4_1X8_BYTES);
grouped_rows!(q8_0x8_rows, q8_0x8_tile, Q8_0X8_BYTES);

/// Rows of one K or V run as the AVX-512 attention reads them: sixteen
/// values of a row at a time, widened to f32.
pub trait KvRows16: Copy {
    /// Rows held.
    fn rows(&self, hd: usize) -> usize;
    /// Values `i..i + 16` of row `j` (rows of `hd` values) as f32.
    ///
    /// # Safety
    /// `j < self.rows(hd)`, `i + 16 <= hd`, and the CPU must have AVX-512 F.
    unsafe fn load16(&self, j: usize, i: usize, hd: usize) -> __m512;
}

impl KvRows16 for super::avx2::Plain<'_, f32> {
    #[inline(always)]
    fn rows(&self, hd: usize) -> usize {
        self.0.len() / hd
    }
    #[inline(always)]
    unsafe fn load16(&self, j: usize, i: usize, hd: usize) -> __m512 {
        // SAFETY: in bounds by the caller's promise.
        unsafe { _mm512_loadu_ps(self.0.as_ptr().add(j * hd + i)) }
    }
}

impl KvRows16 for super::avx2::Plain<'_, half::f16> {
    #[inline(always)]
    fn rows(&self, hd: usize) -> usize {
        self.0.len() / hd
    }
    #[inline(always)]
    unsafe fn load16(&self, j: usize, i: usize, hd: usize) -> __m512 {
        // SAFETY: in bounds by the caller's promise; 32 bytes read.
        unsafe {
            _mm512_cvtph_ps(_mm256_loadu_si256(
                self.0.as_ptr().add(j * hd + i) as *const __m256i
            ))
        }
    }
}

impl KvRows16 for super::avx2::Int8Rows<'_> {
    #[inline(always)]
    fn rows(&self, hd: usize) -> usize {
        (self.q.len() / hd).min(self.d.len() / (hd / 32))
    }
    #[inline(always)]
    unsafe fn load16(&self, j: usize, i: usize, hd: usize) -> __m512 {
        // SAFETY: in bounds by the caller's promise; 16 bytes read, all
        // within one 32-value group (i is a multiple of 16).
        unsafe {
            let b = _mm_loadu_si128(self.q.as_ptr().add(j * hd + i) as *const __m128i);
            let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
            let d = *self.d.get_unchecked(j * (hd / 32) + i / 32);
            _mm512_mul_ps(f, _mm512_set1_ps(d))
        }
    }
}

/// The sum of a 512-bit vector's halves, as eight lanes.
#[inline(always)]
unsafe fn fold256(v: __m512) -> __m256 {
    // SAFETY: register operations only (AVX-512 F by the callers' features).
    unsafe {
        _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
        )
    }
}

/// [`super::avx2::attend_block`] with 512-bit K and V reads: the same
/// online softmax over one KV block for the `group` query heads that share
/// a KV head (in chunks of up to four that share every K and V load), each
/// load sixteen values wide. `hd` must be a multiple of 16.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL and AVX2/FMA/F16C
/// (`kernels::has_avx512_vnni`); slices must have the lengths the shapes
/// imply (asserted).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub unsafe fn attend_block<T: KvRows16>(
    q: &[f32],
    k: T,
    v: T,
    n: usize,
    hd: usize,
    scale: f32,
    scores: &mut [f32],
    mx: &mut [f32],
    sum: &mut [f32],
    acc: &mut [f32],
) {
    let group = mx.len();
    let stride = n.next_multiple_of(8);
    assert!(q.len() >= group * hd && k.rows(hd) >= n && v.rows(hd) >= n && acc.len() >= group * hd);
    assert!(hd.is_multiple_of(16) && scores.len() >= group * stride && sum.len() >= group);
    let mut g0 = 0;
    while g0 < group {
        let h = (group - g0).min(4);
        // SAFETY: shapes asserted above; heads g0..g0 + h exist.
        unsafe {
            match h {
                1 => heads::<T, 1>(q, k, v, n, hd, scale, g0, scores, mx, sum, acc),
                2 => heads::<T, 2>(q, k, v, n, hd, scale, g0, scores, mx, sum, acc),
                3 => heads::<T, 3>(q, k, v, n, hd, scale, g0, scores, mx, sum, acc),
                _ => heads::<T, 4>(q, k, v, n, hd, scale, g0, scores, mx, sum, acc),
            }
        }
        g0 += h;
    }
}

#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn heads<T: KvRows16, const G: usize>(
    q: &[f32],
    k: T,
    v: T,
    n: usize,
    hd: usize,
    scale: f32,
    g0: usize,
    scores: &mut [f32],
    mx: &mut [f32],
    sum: &mut [f32],
    acc: &mut [f32],
) {
    let stride = n.next_multiple_of(8);
    let qp = q.as_ptr();
    // Scores, eight rows at a time, each K row loaded once for the G heads,
    // folded to eight lanes and reduced with one hadd tree per head.
    let mut j0 = 0;
    while j0 < n {
        let m = (n - j0).min(8);
        let mut parts = [[_mm256_setzero_ps(); 8]; G];
        for jj in 0..m {
            let mut s = [_mm512_setzero_ps(); G];
            let mut i = 0;
            // SAFETY: i + 16 <= hd on every load, rows < n; heads g0 + g < group.
            unsafe {
                while i < hd {
                    let kv = k.load16(j0 + jj, i, hd);
                    for (g, sg) in s.iter_mut().enumerate() {
                        *sg = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add((g0 + g) * hd + i)), kv, *sg);
                    }
                    i += 16;
                }
            }
            for (p, sg) in parts.iter_mut().zip(s) {
                // SAFETY: register operations only.
                p[jj] = unsafe { fold256(sg) };
            }
        }
        for (g, p) in parts.iter().enumerate() {
            // SAFETY: AVX2 present; scores hold group * stride floats.
            unsafe {
                let sc = _mm256_mul_ps(super::avx2::hsum8x8(p), _mm256_set1_ps(scale));
                _mm256_storeu_ps(scores.as_mut_ptr().add((g0 + g) * stride + j0), sc);
            }
        }
        j0 += 8;
    }
    // SAFETY: scores hold the G heads' rows of `stride` floats.
    let corr = unsafe { super::avx2::softmax_block::<G>(g0, n, scores, mx, sum) };
    // V, each row loaded once for the G heads.
    let mut i = 0;
    // SAFETY: i + 16 <= hd on every access; j < n rows of v; heads < group.
    unsafe {
        while i < hd {
            let mut s = [_mm512_setzero_ps(); G];
            for (g, sg) in s.iter_mut().enumerate() {
                *sg = _mm512_mul_ps(
                    _mm512_loadu_ps(acc.as_ptr().add((g0 + g) * hd + i)),
                    _mm512_set1_ps(corr[g]),
                );
            }
            for j in 0..n {
                let vv = v.load16(j, i, hd);
                for (g, sg) in s.iter_mut().enumerate() {
                    let p = *scores.get_unchecked((g0 + g) * stride + j);
                    *sg = _mm512_fmadd_ps(_mm512_set1_ps(p), vv, *sg);
                }
            }
            for (g, sg) in s.iter().enumerate() {
                _mm512_storeu_ps(acc.as_mut_ptr().add((g0 + g) * hd + i), *sg);
            }
            i += 16;
        }
    }
}
