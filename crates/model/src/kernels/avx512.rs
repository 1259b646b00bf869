//! AVX-512 VNNI kernels (`vpdpbusd` on 512-bit registers):
//! unsigned byte times signed byte, four products summed straight into an
//! i32 lane, so no `maddubs` saturation to work around and no `madd` to
//! widen. Both weight layouts hold unsigned bytes: Q4_1's nibbles, and Q8_0
//! stored as `q + 128` (`quant::repack_q8_0_x8`) with the offset `-128 d`
//! folded in through the activations' scaled sums, as Q4_1's `m`.
//!
//! Each 256-bit chunk of weights holds eight rows (one 4-byte group of
//! each); two groups' chunks go into one 512-bit register, so the matching
//! 4 activation bytes, broadcast to all 16 lanes, feed 16 rows at once.
//! Tiles of 16 rows x 4 tokens (a last odd group of a thread's rows
//! paired with itself); tokens in passes of 64, as the AVX2 kernels.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Acts, OutPtr};
use crate::quant::{BlockQ8A, Q4_1X8_BYTES, Q4_KX8_BYTES, Q6_KX8_BYTES, Q8_0X8_BYTES, QK, QK_K};

const TILE: usize = 4;
const TOKENS_PER_PASS: usize = 64;

/// The 8 f16 values at byte offset `off` of blocks `b0` and `b1` (two
/// groups' blocks), as 16 f32 lanes, `b0`'s low.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn halves16(b0: *const u8, b1: *const u8, off: usize) -> __m512 {
    // SAFETY: the caller's blocks hold 16 bytes at `off`.
    unsafe {
        _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(b0.add(off) as *const __m128i)),
            _mm_loadu_si128(b1.add(off) as *const __m128i),
            1,
        ))
    }
}

/// The 32-byte chunks at byte offset `off` of blocks `b0` and `b1`, in one
/// 512-bit register, `b0`'s low.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn chunk16(b0: *const u8, b1: *const u8, off: usize) -> __m512i {
    // SAFETY: the caller's blocks hold 32 bytes at `off`.
    unsafe {
        _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(b0.add(off) as *const __m256i)),
            _mm256_loadu_si256(b1.add(off) as *const __m256i),
            1,
        )
    }
}

/// Adds one block's integer sums to the 16-row accumulators of N tokens:
/// `acc += isum * (dw * d_a) + mw * s_a`, where `a[(t0 + c) * nb]` is token
/// `t0 + c`'s block (the caller passes the slice starting at the block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn fold_block<const N: usize>(
    acc: &mut [__m512; N],
    i32s: &[__m512i; N],
    dw: __m512,
    mw: __m512,
    a: &[BlockQ8A],
    t0: usize,
    nb: usize,
) {
    for c in 0..N {
        let ab = &a[(t0 + c) * nb];
        acc[c] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(i32s[c]),
            _mm512_mul_ps(dw, _mm512_set1_ps(ab.d)),
            acc[c],
        );
        acc[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ab.s), acc[c]);
    }
}

/// The 4 activation bytes `qs[at..at + 4]` of token block `ab`, in all 16
/// lanes.
#[inline(always)]
unsafe fn bcast4(ab: &BlockQ8A, at: usize) -> __m512i {
    // SAFETY: at + 4 <= 32 at every call site.
    unsafe {
        _mm512_set1_epi32(std::ptr::read_unaligned(
            ab.qs.as_ptr().add(at) as *const i32
        ))
    }
}

/// The integer sums of one 32-weight block of Q4_1x8 nibbles (four
/// 32-byte chunks at byte offset `off` of `b0` and `b1`: a byte holds
/// weight `i` low and `i + 16` high) with block `b` of N tokens from
/// `t0` (`nb` blocks a token): Q4_1x8's and Q4Kx8's inner loop.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn nibble_sums<const N: usize>(
    b0: *const u8,
    b1: *const u8,
    off: usize,
    a: &[BlockQ8A],
    t0: usize,
    nb: usize,
    b: usize,
) -> [__m512i; N] {
    let mask = _mm512_set1_epi8(0x0F);
    let mut i32s = [_mm512_setzero_si512(); N];
    for j in 0..4 {
        // SAFETY: the caller's blocks hold 128 bytes at `off`.
        let v = unsafe { chunk16(b0, b1, off + 32 * j) };
        let lo = _mm512_and_si512(v, mask);
        let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        for (c, acc) in i32s.iter_mut().enumerate() {
            let ab = &a[(t0 + c) * nb + b];
            // SAFETY: offsets 4j and 16 + 4j leave 4 bytes inside qs.
            let (alo, ahi) = unsafe { (bcast4(ab, 4 * j), bcast4(ab, 16 + 4 * j)) };
            *acc = _mm512_dpbusd_epi32(*acc, lo, alo);
            *acc = _mm512_dpbusd_epi32(*acc, hi, ahi);
        }
    }
    i32s
}

/// Interleaved Q4_1 groups `g0` and `g1` (rows in the low and the high
/// eight lanes; `g1 == g0` for a last odd group) times N tokens: each
/// activation broadcast feeds 16 rows. Integer sums are exact and the
/// fold is per lane, so a row's bits do not depend on its partner.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_1x8_tile<const N: usize>(
    g0: *const u8,
    g1: *const u8,
    nb: usize,
    a: &[BlockQ8A],
    t0: usize,
) -> [__m512; N] {
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY: b < nb; both groups hold nb blocks.
        let (b0, b1) = unsafe { (g0.add(b * Q4_1X8_BYTES), g1.add(b * Q4_1X8_BYTES)) };
        let (dw, mw) = unsafe { (halves16(b0, b1, 0), halves16(b0, b1, 16)) };
        // SAFETY: the nibbles lie at 32..160 of both blocks.
        let i32s = unsafe { nibble_sums::<N>(b0, b1, 32, a, t0, nb, b) };
        // SAFETY: same features as this function.
        unsafe { fold_block(&mut acc, &i32s, dw, mw, &a[b..], t0, nb) };
    }
    acc
}

/// Interleaved Q8_0 (`q + 128`) groups `g0` and `g1` times N tokens, as
/// [`q4_1x8_tile`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0x8_tile<const N: usize>(
    g0: *const u8,
    g1: *const u8,
    nb: usize,
    a: &[BlockQ8A],
    t0: usize,
) -> [__m512; N] {
    let mut acc = [_mm512_setzero_ps(); N];
    let m128 = _mm512_set1_ps(-128.0);
    for b in 0..nb {
        // SAFETY: b < nb; both groups hold nb blocks.
        let (b0, b1) = unsafe { (g0.add(b * Q8_0X8_BYTES), g1.add(b * Q8_0X8_BYTES)) };
        let dw = unsafe { halves16(b0, b1, 0) };
        let mut i32s = [_mm512_setzero_si512(); N];
        for j in 0..8 {
            // SAFETY: chunk j lies inside both blocks.
            let v = unsafe { chunk16(b0, b1, 16 + 32 * j) };
            for c in 0..N {
                // SAFETY: 4j + 4 <= 32.
                let av = unsafe { bcast4(&a[(t0 + c) * nb + b], 4 * j) };
                i32s[c] = _mm512_dpbusd_epi32(i32s[c], v, av);
            }
        }
        let mw = _mm512_mul_ps(dw, m128);
        // SAFETY: same features as this function.
        unsafe { fold_block(&mut acc, &i32s, dw, mw, &a[b..], t0, nb) };
    }
    acc
}

/// Stores the results of the `n` rows from `r0` (16, or 8 for a group
/// paired with itself), keeping only rows inside `rows`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
pub(super) unsafe fn store_rows(
    v: __m512,
    out: OutPtr,
    t: usize,
    r0: usize,
    n: usize,
    rows: &Range<usize>,
) {
    let mut buf = [0f32; 16];
    // SAFETY: buf has 16 floats.
    unsafe { _mm512_storeu_ps(buf.as_mut_ptr(), v) };
    let lo = rows.start.max(r0);
    let hi = rows.end.min(r0 + n);
    out.put_run(t, lo, &buf[lo - r0..hi - r0]);
}

/// One interleaved layout's rows `rows` times all tokens, through `tile`,
/// two groups at a time (a last odd group paired with itself, its copy
/// in the high lanes not stored).
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
                let mut g = g_first;
                while g < g_end {
                    let g1 = (g + 1).min(g_end - 1);
                    let n = 8 * (g1 - g + 1);
                    // SAFETY: g <= g1 < g_end, asserted in bounds above.
                    let (gp0, gp1) = unsafe { (w.as_ptr().add(g * gb), w.as_ptr().add(g1 * gb)) };
                    let mut t = p0;
                    unsafe {
                        while t + TILE <= p1 {
                            let r = $tile::<TILE>(gp0, gp1, nb, x.q, t);
                            for (c, v) in r.iter().enumerate() {
                                store_rows(*v, out, t + c, g * 8, n, &rows);
                            }
                            t += TILE;
                        }
                        while t < p1 {
                            let [v] = $tile::<1>(gp0, gp1, nb, x.q, t);
                            store_rows(v, out, t, g * 8, n, &rows);
                            t += 1;
                        }
                    }
                    g += 2;
                }
                p0 = p1;
            }
        }
    };
}

grouped_rows!(q4_1x8_rows, q4_1x8_tile, Q4_1X8_BYTES);
grouped_rows!(q8_0x8_rows, q8_0x8_tile, Q8_0X8_BYTES);

/// Sub-block scales of groups `g0`/`g1` (16 lanes), computed once per
/// group pair and pass, so the token tiles only load them.
const K_PRE: usize = 16;

thread_local! {
    /// Per-thread scratch of the K-quant kernels: each super-block's 16
    /// scale vectors, and each token block's half sums (Q6_K).
    static K_SCRATCH: std::cell::RefCell<(Vec<__m512>, Vec<[f32; 2]>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Q4_K: for each super-block, lanes `d * sc` of its 8 sub-blocks, then
/// `-(dmin * m)` of them (the file's products, exact in f32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_kx8_prep(g0: *const u8, g1: *const u8, nsb: usize, pre: &mut [__m512]) {
    let shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    let shifts_m = _mm512_add_epi32(shifts, _mm512_set1_epi32(16));
    let (three, fifteen) = (_mm512_set1_epi32(3), _mm512_set1_epi32(15));
    let sign = _mm512_set1_epi32(i32::MIN);
    for sb in 0..nsb {
        // SAFETY: sb < nsb; both groups hold nsb super-blocks, each
        // Q4_KX8_BYTES long, and every read below lies inside one.
        unsafe {
            let (s0, s1) = (g0.add(sb * Q4_KX8_BYTES), g1.add(sb * Q4_KX8_BYTES));
            let (d, dmin) = (halves16(s0, s1, 0), halves16(s0, s1, 16));
            for j in 0..8 {
                let off = 32 + 12 * j;
                let lo = _mm_set_epi64x(
                    std::ptr::read_unaligned(s1.add(off) as *const i64),
                    std::ptr::read_unaligned(s0.add(off) as *const i64),
                );
                let v = _mm512_cvtepu8_epi32(lo);
                let h = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_set1_epi32(std::ptr::read_unaligned(
                        s0.add(off + 8) as *const i32,
                    ))),
                    _mm256_set1_epi32(std::ptr::read_unaligned(s1.add(off + 8) as *const i32)),
                    1,
                );
                let sc = _mm512_or_si512(
                    _mm512_and_si512(v, fifteen),
                    _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srlv_epi32(h, shifts), three)),
                );
                let m = _mm512_or_si512(
                    _mm512_srli_epi32::<4>(v),
                    _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srlv_epi32(h, shifts_m), three)),
                );
                pre[sb * K_PRE + j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                let dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
                pre[sb * K_PRE + 8 + j] =
                    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), sign));
            }
        }
    }
}

/// Q6_K: for each super-block, lanes `d * sc` of its 16 sub-blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_kx8_prep(g0: *const u8, g1: *const u8, nsb: usize, pre: &mut [__m512]) {
    for sb in 0..nsb {
        // SAFETY: as q4_kx8_prep.
        unsafe {
            let (s0, s1) = (g0.add(sb * Q6_KX8_BYTES), g1.add(sb * Q6_KX8_BYTES));
            let d = halves16(s0, s1, 0);
            for k in 0..16 {
                let off = 16 + 8 * k;
                let sc = _mm_set_epi64x(
                    std::ptr::read_unaligned(s1.add(off) as *const i64),
                    std::ptr::read_unaligned(s0.add(off) as *const i64),
                );
                pre[sb * K_PRE + k] =
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
            }
        }
    }
}

/// Interleaved Q4_K groups `g0` and `g1` times N tokens: Q4_1's inner
/// loop on each 32-weight sub-block, its scale and min from `pre` (or,
/// where `pre` is empty, unpacked from each super-block as it is reached).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_kx8_tile<const N: usize>(
    g0: *const u8,
    g1: *const u8,
    nsb: usize,
    pre: &[__m512],
    a: &[BlockQ8A],
    t0: usize,
) -> [__m512; N] {
    let nb = nsb * 8;
    let mut acc = [_mm512_setzero_ps(); N];
    let mut local = [_mm512_setzero_ps(); K_PRE];
    for sb in 0..nsb {
        // SAFETY: sb < nsb; both groups hold nsb super-blocks.
        let (s0, s1) = unsafe { (g0.add(sb * Q4_KX8_BYTES), g1.add(sb * Q4_KX8_BYTES)) };
        let p: &[__m512] = if pre.is_empty() {
            // SAFETY: one super-block of each group; same features.
            unsafe { q4_kx8_prep(s0, s1, 1, &mut local) };
            &local
        } else {
            &pre[sb * K_PRE..(sb + 1) * K_PRE]
        };
        for j in 0..8 {
            let b = sb * 8 + j;
            // SAFETY: sub-block j's nibbles lie inside both super-blocks.
            let i32s = unsafe { nibble_sums::<N>(s0, s1, 128 + 128 * j, a, t0, nb, b) };
            let (dw, mw) = (p[j], p[8 + j]);
            // SAFETY: same features as this function.
            unsafe { fold_block(&mut acc, &i32s, dw, mw, &a[b..], t0, nb) };
        }
    }
    acc
}

/// Interleaved Q6_K groups `g0` and `g1` times N tokens: the 6-bit values
/// (nibble | top bits << 4, unsigned) times the activations, each half of
/// a 32-block summed apart (its own scale), `- 32` folded in through the
/// blocks' half sums `hs`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_kx8_tile<const N: usize>(
    g0: *const u8,
    g1: *const u8,
    nsb: usize,
    pre: &[__m512],
    a: &[BlockQ8A],
    hs: &[[f32; 2]],
    t0: usize,
) -> [__m512; N] {
    let nb = nsb * 8;
    let (m0f, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    let mut acc = [_mm512_setzero_ps(); N];
    let mut local = [_mm512_setzero_ps(); K_PRE];
    for sb in 0..nsb {
        // SAFETY: sb < nsb; both groups hold nsb super-blocks.
        let (s0, s1) = unsafe { (g0.add(sb * Q6_KX8_BYTES), g1.add(sb * Q6_KX8_BYTES)) };
        let p: &[__m512] = if pre.is_empty() {
            // SAFETY: one super-block of each group; same features.
            unsafe { q6_kx8_prep(s0, s1, 1, &mut local) };
            &local
        } else {
            &pre[sb * K_PRE..(sb + 1) * K_PRE]
        };
        for s in 0..8 {
            let b = sb * 8 + s;
            let mut ilo = [_mm512_setzero_si512(); N];
            let mut ihi = [_mm512_setzero_si512(); N];
            // SAFETY: block s's two planes of top bits lie inside both.
            let planes = unsafe {
                [
                    chunk16(s0, s1, 1168 + 64 * s),
                    chunk16(s0, s1, 1168 + 64 * s + 32),
                ]
            };
            for c in 0..4 {
                // SAFETY: block s's chunk c lies inside both super-blocks.
                let v = unsafe { chunk16(s0, s1, 144 + 128 * s + 32 * c) };
                let h = planes[c / 2];
                let (lh, hh) = if c % 2 == 0 {
                    (_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2))
                } else {
                    (h, _mm512_srli_epi16(h, 2))
                };
                let lo = _mm512_or_si512(_mm512_and_si512(v, m0f), _mm512_and_si512(lh, m30));
                let hi = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f),
                    _mm512_and_si512(hh, m30),
                );
                for t in 0..N {
                    let ab = &a[(t0 + t) * nb + b];
                    // SAFETY: offsets 4c and 16 + 4c leave 4 bytes inside qs.
                    let (alo, ahi) = unsafe { (bcast4(ab, 4 * c), bcast4(ab, 16 + 4 * c)) };
                    ilo[t] = _mm512_dpbusd_epi32(ilo[t], lo, alo);
                    ihi[t] = _mm512_dpbusd_epi32(ihi[t], hi, ahi);
                }
            }
            let (dlo, dhi) = (p[2 * s], p[2 * s + 1]);
            for t in 0..N {
                let ab = &a[(t0 + t) * nb + b];
                let [slo, shi] = hs[(t0 + t) * nb + b];
                let da = _mm512_set1_ps(ab.d);
                acc[t] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo[t]), _mm512_mul_ps(dlo, da), acc[t]);
                acc[t] = _mm512_fmadd_ps(dlo, _mm512_set1_ps(-32.0 * slo), acc[t]);
                acc[t] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi[t]), _mm512_mul_ps(dhi, da), acc[t]);
                acc[t] = _mm512_fmadd_ps(dhi, _mm512_set1_ps(-32.0 * shi), acc[t]);
            }
        }
    }
    acc
}

/// Interleaved Q4_K rows `rows` times all tokens of `x`, two groups at a
/// time as [`q4_1x8_rows`], each pair's scales unpacked once a pass.
///
/// # Safety
/// As [`q4_1x8_rows`]; `x.k` a multiple of 256.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q4_kx8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    // SAFETY: forwarded.
    unsafe { kx8_rows(w, Q4_KX8_BYTES, false, x, rows, out) }
}

/// Interleaved Q6_K rows `rows` times all tokens of `x`, as
/// [`q4_kx8_rows`].
///
/// # Safety
/// As [`q4_1x8_rows`]; `x.k` a multiple of 256.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q6_kx8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    // SAFETY: forwarded.
    unsafe { kx8_rows(w, Q6_KX8_BYTES, true, x, rows, out) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn kx8_rows(
    w: &[u8],
    bytes: usize,
    q6: bool,
    x: &Acts<'_>,
    rows: Range<usize>,
    out: OutPtr,
) {
    assert_eq!(x.k % QK_K, 0);
    let (nb, nsb) = (x.k / QK, x.k / QK_K);
    let gb = nsb * bytes;
    let (g_first, g_end) = (rows.start / 8, rows.end.div_ceil(8));
    assert!(g_end * gb <= w.len());
    assert!(x.q.len() >= x.t * nb);
    K_SCRATCH.with(|scratch| {
        let (pre, hs) = &mut *scratch.borrow_mut();
        pre.clear();
        pre.resize(nsb * K_PRE, _mm512_setzero_ps());
        hs.clear();
        if q6 {
            hs.extend(x.q[..x.t * nb].iter().map(super::scalar::half_sums));
        }
        let mut p0 = 0;
        while p0 < x.t {
            let p1 = (p0 + TOKENS_PER_PASS).min(x.t);
            let mut g = g_first;
            while g < g_end {
                let g1 = (g + 1).min(g_end - 1);
                let n = 8 * (g1 - g + 1);
                // SAFETY: g <= g1 < g_end, asserted in bounds above; the
                // features are this function's.
                unsafe {
                    let (gp0, gp1) = (w.as_ptr().add(g * gb), w.as_ptr().add(g1 * gb));
                    // A pass of a tile or two (a decode) unpacks each
                    // super-block's scales where the tile reads it, in
                    // the stream of its weights; a longer one unpacks
                    // them all first, once for all its tiles.
                    let inline = p1 - p0 <= 2 * TILE;
                    if !inline && q6 {
                        q6_kx8_prep(gp0, gp1, nsb, pre);
                    } else if !inline {
                        q4_kx8_prep(gp0, gp1, nsb, pre);
                    }
                    let pre: &[__m512] = if inline { &[] } else { pre };
                    let mut t = p0;
                    while t < p1 {
                        let r: ([__m512; TILE], usize) = if t + TILE <= p1 {
                            if q6 {
                                (q6_kx8_tile::<TILE>(gp0, gp1, nsb, pre, x.q, hs, t), TILE)
                            } else {
                                (q4_kx8_tile::<TILE>(gp0, gp1, nsb, pre, x.q, t), TILE)
                            }
                        } else {
                            let [v] = if q6 {
                                q6_kx8_tile::<1>(gp0, gp1, nsb, pre, x.q, hs, t)
                            } else {
                                q4_kx8_tile::<1>(gp0, gp1, nsb, pre, x.q, t)
                            };
                            ([v; TILE], 1)
                        };
                        for (c, v) in r.0[..r.1].iter().enumerate() {
                            store_rows(*v, out, t + c, g * 8, n, &rows);
                        }
                        t += r.1;
                    }
                }
                g += 2;
            }
            p0 = p1;
        }
    });
}

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

/// e^x for sixteen lanes: [`super::avx2::exp8`]'s reduction and
/// polynomial (its constants), 512 bits wide; lane for lane the same
/// result.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(x, _mm512_set1_ps(88.0));
    let underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0), _CMP_LT_OQ);
    let fx = _mm512_roundscale_ps(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    use super::avx2::{EXP_LN2, EXP_POLY};
    let r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2[0]), x);
    let r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2[1]), r);
    let mut y = _mm512_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
    }
    y = _mm512_fmadd_ps(
        y,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    let pow2 = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(fx),
        _mm512_set1_epi32(127),
    ));
    let res = _mm512_mul_ps(y, _mm512_castsi512_ps(pow2));
    _mm512_maskz_mov_ps(!underflow, res)
}

/// [`super::avx2::softmax_block`] sixteen lanes wide, with masked loads:
/// the G heads' block maxima first, then their rescale factors in one
/// `exp16`, then each row's probabilities (over its scores) and sum.
///
/// # Safety
/// AVX-512 F and the AVX2 set; `scores` holds `(g0 + G) * stride` floats
/// (`stride` = `n` rounded up to 8), `mx` and `sum` `g0 + G`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn softmax_block<const G: usize>(
    g0: usize,
    n: usize,
    scores: &mut [f32],
    mx: &mut [f32],
    sum: &mut [f32],
) -> [f32; G] {
    let stride = n.next_multiple_of(8);
    assert!(
        G <= 16 && scores.len() >= (g0 + G) * stride && mx.len() >= g0 + G && sum.len() >= g0 + G
    );
    let live = |j0: usize| -> __mmask16 {
        let left = n - j0;
        if left >= 16 {
            0xFFFF
        } else {
            (1u16 << left) - 1
        }
    };
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut old = [f32::NEG_INFINITY; 16];
    let mut new = [f32::NEG_INFINITY; 16];
    for g in 0..G {
        let sc = scores[(g0 + g) * stride..].as_ptr();
        let mut vmax = ninf;
        let mut j0 = 0;
        while j0 < n {
            // SAFETY: masked lanes are not read; the live ones lie in the row.
            vmax = _mm512_max_ps(vmax, unsafe {
                _mm512_mask_loadu_ps(ninf, live(j0), sc.add(j0))
            });
            j0 += 16;
        }
        old[g] = mx[g0 + g];
        new[g] = old[g].max(_mm512_reduce_max_ps(vmax));
    }
    // SAFETY: 16 floats each.
    let corr16 = unsafe {
        exp16(_mm512_sub_ps(
            _mm512_loadu_ps(old.as_ptr()),
            // Lanes past G hold -inf in both: the new one raised to the
            // lowest finite value keeps their difference -inf (factor 0),
            // not NaN. A real row's new maximum is finite.
            _mm512_max_ps(_mm512_loadu_ps(new.as_ptr()), _mm512_set1_ps(f32::MIN)),
        ))
    };
    let mut c16 = [0f32; 16];
    // SAFETY: 16 floats.
    unsafe { _mm512_storeu_ps(c16.as_mut_ptr(), corr16) };
    let mut corr = [0f32; G];
    for g in 0..G {
        let h = g0 + g;
        corr[g] = c16[g];
        mx[h] = new[g];
        let sc = scores[h * stride..].as_mut_ptr();
        let vm = _mm512_set1_ps(new[g]);
        let mut vs = _mm512_setzero_ps();
        let mut j0 = 0;
        while j0 < n {
            let m = live(j0);
            // SAFETY: masked lanes are neither read nor written.
            unsafe {
                let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc.add(j0)), vm));
                _mm512_mask_storeu_ps(sc.add(j0), m, e);
                vs = _mm512_mask_add_ps(vs, m, vs, e);
            }
            j0 += 16;
        }
        sum[h] = sum[h] * corr[g] + unsafe { tree16(vs) };
    }
    corr
}

/// The sum of sixteen lanes in a fixed pairwise order, lane l with l + 8,
/// then l + 4, l + 2, l + 1: the order [`lanes_block`] repeats across
/// vectors, so that both give a row the same sum to the bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn tree16(v: __m512) -> f32 {
    let t = _mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
    );
    let u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    let w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)))
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
    // At 64 dimensions (four chunks) the G heads' queries stay in
    // registers for the whole block; the same FMA chains either way.
    const QC: usize = 4;
    // SAFETY: hd == 64 means each head's row holds QC chunks of 16.
    let qreg: [[__m512; QC]; G] = if hd == 16 * QC {
        std::array::from_fn(|g| {
            std::array::from_fn(|c| unsafe { _mm512_loadu_ps(qp.add((g0 + g) * hd + 16 * c)) })
        })
    } else {
        [[_mm512_setzero_ps(); QC]; G]
    };
    // Scores, eight rows at a time, each K row loaded once for the G heads,
    // folded to eight lanes and reduced with one hadd tree per head.
    let mut j0 = 0;
    while j0 < n {
        let m = (n - j0).min(8);
        let mut parts = [[_mm256_setzero_ps(); 8]; G];
        for jj in 0..m {
            let mut s = [_mm512_setzero_ps(); G];
            // SAFETY: i + 16 <= hd on every load, rows < n; heads g0 + g < group.
            unsafe {
                if hd == 16 * QC {
                    for c in 0..QC {
                        let kv = k.load16(j0 + jj, 16 * c, hd);
                        for (sg, qg) in s.iter_mut().zip(&qreg) {
                            *sg = _mm512_fmadd_ps(qg[c], kv, *sg);
                        }
                    }
                } else {
                    let mut i = 0;
                    while i < hd {
                        let kv = k.load16(j0 + jj, i, hd);
                        for (g, sg) in s.iter_mut().enumerate() {
                            *sg = _mm512_fmadd_ps(
                                _mm512_loadu_ps(qp.add((g0 + g) * hd + i)),
                                kv,
                                *sg,
                            );
                        }
                        i += 16;
                    }
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
    let corr = unsafe { softmax_block::<G>(g0, n, scores, mx, sum) };
    // V, each row loaded once for the G heads, four 16-value chunks of a
    // row at a time (4 x G independent sums for the FMA pipes).
    let mut i = 0;
    // SAFETY: i + 16 * C <= hd on every pass; j < n rows of v; heads < group.
    unsafe {
        while i + 64 <= hd {
            v_chunks::<T, G, 4>(v, n, hd, i, g0, stride, scores, &corr, acc);
            i += 64;
        }
        while i < hd {
            v_chunks::<T, G, 1>(v, n, hd, i, g0, stride, scores, &corr, acc);
            i += 16;
        }
    }
}

/// `acc[h][i..i + 16 C] = acc * corr + sum_j p[h][j] v[j][i..i + 16 C]`
/// for the G heads `g0..g0 + G`.
///
/// # Safety
/// AVX-512 F; `i + 16 * C <= hd`; `v` holds `n` rows; `scores` and `acc`
/// hold the heads' rows.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn v_chunks<T: KvRows16, const G: usize, const C: usize>(
    v: T,
    n: usize,
    hd: usize,
    i: usize,
    g0: usize,
    stride: usize,
    scores: &[f32],
    corr: &[f32; G],
    acc: &mut [f32],
) {
    // SAFETY: in bounds by the caller's promise.
    unsafe {
        let mut s = [[_mm512_setzero_ps(); C]; G];
        for (g, sg) in s.iter_mut().enumerate() {
            for (c, sc) in sg.iter_mut().enumerate() {
                *sc = _mm512_mul_ps(
                    _mm512_loadu_ps(acc.as_ptr().add((g0 + g) * hd + i + 16 * c)),
                    _mm512_set1_ps(corr[g]),
                );
            }
        }
        for j in 0..n {
            let mut vv = [_mm512_setzero_ps(); C];
            for (c, x) in vv.iter_mut().enumerate() {
                *x = v.load16(j, i + 16 * c, hd);
            }
            for (g, sg) in s.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*scores.get_unchecked((g0 + g) * stride + j));
                for (sc, x) in sg.iter_mut().zip(&vv) {
                    *sc = _mm512_fmadd_ps(p, *x, *sc);
                }
            }
        }
        for (g, sg) in s.iter().enumerate() {
            for (c, sc) in sg.iter().enumerate() {
                _mm512_storeu_ps(acc.as_mut_ptr().add((g0 + g) * hd + i + 16 * c), *sc);
            }
        }
    }
}

/// Widens `n` rows of one K or V run (`hd` values each) into `out` as f32,
/// row-major.
///
/// # Safety
/// AVX-512 F; `hd` a multiple of 16; `src` holds `n` rows; `out` holds
/// `n * hd` floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub unsafe fn widen_rows<T: KvRows16>(src: T, n: usize, hd: usize, out: &mut [f32]) {
    assert!(out.len() >= n * hd && src.rows(hd) >= n && hd.is_multiple_of(16));
    for j in 0..n {
        let mut i = 0;
        while i < hd {
            // SAFETY: row j < n, i + 16 <= hd; out holds n * hd floats.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(j * hd + i), src.load16(j, i, hd)) };
            i += 16;
        }
    }
}

/// One KV block for sixteen query rows held in lanes (`lanes_block`'s
/// state): the rows' transposed queries `qt` (`hd x 16`), the scale,
/// their running maxima and sums, and their transposed accumulators `acct`
/// (`hd x 16`).
pub struct Lanes16<'a> {
    /// Queries, dimension-major: `qt[i * 16 + r]` is row r's value i.
    pub qt: &'a [f32],
    /// Score scale (applied after the dot product, as the row-major
    /// kernel does).
    pub scale: f32,
    /// Running maximum of each row's scores.
    pub mx: &'a mut [f32; 16],
    /// Running sum of each row's probabilities.
    pub sum: &'a mut [f32; 16],
    /// Accumulators, dimension-major like `qt`.
    pub acct: &'a mut [f32],
}

/// Attention of sixteen query rows over one KV block with the rows in the
/// vector lanes: scores for sixteen positions are sixteen vectors (one per
/// position, a lane per row), so the online softmax's maxima, rescale
/// factors, exponentials and sums are plain vector operations across rows,
/// with no horizontal reduction and no per-row pass; each K and V value is
/// broadcast once for the sixteen rows. `kf` and `vf` are the block's K and
/// V rows widened to f32 ([`widen_rows`]), `n` rows of `hd`, all visible
/// to every row (a block shared by a run's tokens).
///
/// # Safety
/// AVX-512 F; `hd` a multiple of 8, `n` of 16; `kf`, `vf` hold `n * hd`
/// floats, `qt` and `acct` `hd * 16`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub unsafe fn lanes_block(st: &mut Lanes16<'_>, kf: &[f32], vf: &[f32], n: usize, hd: usize) {
    assert!(kf.len() >= n * hd && vf.len() >= n * hd && hd.is_multiple_of(8));
    assert!(st.qt.len() >= hd * 16 && st.acct.len() >= hd * 16 && n.is_multiple_of(16));
    let mut j0 = 0;
    while j0 < n {
        // SAFETY: positions j0..j0 + 16 are rows of kf and vf.
        unsafe { lanes_positions(st, &kf[j0 * hd..], &vf[j0 * hd..], hd) };
        j0 += 16;
    }
}

/// One pass of [`lanes_positions`]' scores for four positions (K rows
/// `kj`): partial sums l and l + 8 for l in {2 pass, 2 pass + 1}, each
/// the FMA chain over the 16-wide chunks, folded as `(f[2 pass] +
/// f[2 pass + 1])` where `f[l] = sum l + sum l + 8`.
///
/// # Safety
/// AVX-512 F; each `kj` row and `qp` (transposed, `hd x 16`) hold `hd`
/// values; `hd` a multiple of 16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn score_quad(kj: [*const f32; 4], qp: *const f32, hd: usize, pass: usize) -> [__m512; 4] {
    let ls = [2 * pass, 2 * pass + 1, 2 * pass + 8, 2 * pass + 9];
    let mut a = [[_mm512_setzero_ps(); 4]; 4];
    let mut c = 0;
    // SAFETY: c + l < hd on every read, by the caller's promise.
    unsafe {
        while c < hd {
            for (x, &l) in ls.iter().enumerate() {
                let qv = _mm512_loadu_ps(qp.add((c + l) * 16));
                for (p, k) in kj.iter().enumerate() {
                    a[x][p] = _mm512_fmadd_ps(_mm512_set1_ps(*k.add(c + l)), qv, a[x][p]);
                }
            }
            c += 16;
        }
    }
    std::array::from_fn(|p| {
        _mm512_add_ps(
            _mm512_add_ps(a[0][p], a[2][p]),
            _mm512_add_ps(a[1][p], a[3][p]),
        )
    })
}

/// [`lanes_block`] for 16 positions (sixteen score vectors in registers).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn lanes_positions(st: &mut Lanes16<'_>, kf: &[f32], vf: &[f32], hd: usize) {
    const M: usize = 16;
    let (kp, vp, qp) = (kf.as_ptr(), vf.as_ptr(), st.qt.as_ptr());
    // SAFETY: every read is of row j < m (of kf, vf) at i < hd, or of qt
    // and acct at i < hd; bounds asserted by the caller.
    unsafe {
        // Scores, in the row-major kernel's order to the bit (`heads`): a
        // row's dimension i lands in partial sum i % 16, each a chain of
        // FMAs over the 16-wide chunks; the partial sums fold as its
        // `fold256` and `hsum8x8` do; the scale multiplies the sum.
        //
        // Four positions at a time share each query load, in four passes
        // over the partial sums that fold together ({0, 1, 8, 9}, then
        // {2, 3, 10, 11}, ...): sixteen accumulators live at once, each
        // the same FMA chain as above, and the folds in the same tree.
        let scale = _mm512_set1_ps(st.scale);
        let mut s = [_mm512_setzero_ps(); M];
        let mut p0 = 0;
        while p0 < M {
            let kj: [*const f32; 4] = std::array::from_fn(|p| kp.add((p0 + p) * hd));
            let (x01, x23) = (score_quad(kj, qp, hd, 0), score_quad(kj, qp, hd, 1));
            let lo: [__m512; 4] = std::array::from_fn(|p| _mm512_add_ps(x01[p], x23[p]));
            let (x45, x67) = (score_quad(kj, qp, hd, 2), score_quad(kj, qp, hd, 3));
            for p in 0..4 {
                let hi = _mm512_add_ps(x45[p], x67[p]);
                s[p0 + p] = _mm512_mul_ps(_mm512_add_ps(lo[p], hi), scale);
            }
            p0 += 4;
        }
        // Online softmax across the rows at once, in `softmax_block`'s
        // arithmetic (its sum in `tree16`'s order).
        let mut bmax = s[0];
        for sj in &s[1..M] {
            bmax = _mm512_max_ps(bmax, *sj);
        }
        let old = _mm512_loadu_ps(st.mx.as_ptr());
        let new = _mm512_max_ps(old, bmax);
        let corr = exp16(_mm512_sub_ps(old, new));
        for sj in s.iter_mut() {
            *sj = exp16(_mm512_sub_ps(*sj, new));
        }
        let t: [__m512; 8] = std::array::from_fn(|l| _mm512_add_ps(s[l], s[l + 8]));
        let u: [__m512; 4] = std::array::from_fn(|l| _mm512_add_ps(t[l], t[l + 4]));
        let w = [_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3])];
        let l = _mm512_add_ps(
            _mm512_mul_ps(_mm512_loadu_ps(st.sum.as_ptr()), corr),
            _mm512_add_ps(w[0], w[1]),
        );
        _mm512_storeu_ps(st.mx.as_mut_ptr(), new);
        _mm512_storeu_ps(st.sum.as_mut_ptr(), l);
        // V: acct[i] = acct[i] * corr + sum_j p[j] * v[j][i], eight
        // dimensions at a time (eight independent chains).
        let ap = st.acct.as_mut_ptr();
        let mut i = 0;
        while i < hd {
            let mut a = [_mm512_setzero_ps(); 8];
            for (c, ac) in a.iter_mut().enumerate() {
                *ac = _mm512_mul_ps(_mm512_loadu_ps(ap.add((i + c) * 16)), corr);
            }
            for (j, p) in s.iter().enumerate() {
                for (c, ac) in a.iter_mut().enumerate() {
                    *ac = _mm512_fmadd_ps(_mm512_set1_ps(*vp.add(j * hd + i + c)), *p, *ac);
                }
            }
            for (c, ac) in a.iter().enumerate() {
                _mm512_storeu_ps(ap.add((i + c) * 16), *ac);
            }
            i += 8;
        }
    }
}
