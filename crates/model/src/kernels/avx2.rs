//! x86-64 AVX2 + FMA + F16C kernels. Every function here is `unsafe` and
//! `#[target_feature]`: call only after `has_avx2()`.
//!
//! Products are tiled one weight row by up to four tokens: a weight block is
//! loaded and unpacked once and multiplied with four activation blocks, so
//! batched decode and prefill reuse each weight byte four times from
//! registers and many more from L1.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Acts, OutPtr};
use crate::quant::{BlockQ8A, Q4_1X8_BYTES, Q4_KX8_BYTES, Q6_KX8_BYTES, Q8_0_BYTES, QK, QK_K};

/// Tokens per register tile.
const TILE: usize = 4;
/// Tokens per cache tile: activations of this many tokens stay in L2 while a
/// thread sweeps its weight rows.
const TOKENS_PER_PASS: usize = 64;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_load(p: *const u8) -> f32 {
    // SAFETY: caller guarantees p..p+2 is readable.
    let bits = unsafe { std::ptr::read_unaligned(p as *const u16) };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Eight interleaved Q4_1 rows times N tokens starting at `t0`; returns one
/// vector of 8 row results per token.
///
/// Per block, the four 32-byte chunks give 8 rows x 4 bytes each; the
/// matching 4 activation bytes are broadcast to all eight lanes, so every
/// lane accumulates its own row. Eight `maddubs` results (each lane at most
/// 2 x 15 x 127) are summed in i16 (at most 30480, no overflow) before one
/// `madd` widens them: half the multiply-port work of a row-at-a-time kernel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1x8_tile<const N: usize>(
    g: *const u8,
    nb: usize,
    a: &[BlockQ8A],
    t0: usize,
) -> [__m256; N] {
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY: b < nb; the group holds nb blocks of 160 bytes.
        let blk = unsafe { g.add(b * Q4_1X8_BYTES) };
        let (dw, mw) = unsafe {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i)),
            )
        };
        let mut s16 = [_mm256_setzero_si256(); N];
        for j in 0..4 {
            // SAFETY: chunk j lies inside the 160-byte block.
            let v = unsafe { _mm256_loadu_si256(blk.add(32 + 32 * j) as *const __m256i) };
            let lo = _mm256_and_si256(v, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            for c in 0..N {
                let q = a[(t0 + c) * nb + b].qs.as_ptr();
                // SAFETY: qs has 32 bytes; 4j + 16 + 4 <= 32.
                let (alo, ahi) = unsafe {
                    (
                        _mm256_set1_epi32(std::ptr::read_unaligned(q.add(4 * j) as *const i32)),
                        _mm256_set1_epi32(
                            std::ptr::read_unaligned(q.add(16 + 4 * j) as *const i32),
                        ),
                    )
                };
                s16[c] = _mm256_add_epi16(
                    s16[c],
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi)),
                );
            }
        }
        for c in 0..N {
            let ab = &a[(t0 + c) * nb + b];
            let isum = _mm256_madd_epi16(s16[c], ones);
            acc[c] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(isum),
                _mm256_mul_ps(dw, _mm256_set1_ps(ab.d)),
                acc[c],
            );
            acc[c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(ab.s), acc[c]);
        }
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

/// Interleaved Q4_1 rows `rows` times all tokens of `x`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`); slices must
/// have the lengths the shapes imply (asserted where cheap).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_1x8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    let nb = x.k / QK;
    let gb = nb * Q4_1X8_BYTES;
    let (g_first, g_end) = (rows.start / 8, rows.end.div_ceil(8));
    assert!(g_end * gb <= w.len());
    let mut p0 = 0;
    while p0 < x.t {
        let p1 = (p0 + TOKENS_PER_PASS).min(x.t);
        for g in g_first..g_end {
            // SAFETY: g < g_end, asserted in bounds above.
            let gp = unsafe { w.as_ptr().add(g * gb) };
            let mut t = p0;
            unsafe {
                while t + TILE <= p1 {
                    let r = q4_1x8_tile::<TILE>(gp, nb, x.q, t);
                    for (c, v) in r.iter().enumerate() {
                        store_group(*v, out, t + c, g * 8, &rows);
                    }
                    t += TILE;
                }
                while t < p1 {
                    let [v] = q4_1x8_tile::<1>(gp, nb, x.q, t);
                    store_group(v, out, t, g * 8, &rows);
                    t += 1;
                }
            }
        }
        p0 = p1;
    }
}

/// Sub-block scales of one 8-row group a super-block: Q4_K's `d * sc` of
/// its 8 sub-blocks then `-(dmin * m)`, or Q6_K's `d * sc` of its 16.
const K_PRE: usize = 16;

thread_local! {
    /// Per-thread scratch of the K-quant kernels: a group's scale vectors
    /// for every super-block, and each token block's half sums (Q6_K).
    static K_SCRATCH: std::cell::RefCell<(Vec<__m256>, Vec<[f32; 2]>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Q4_K: for each of `nsb` super-blocks of group `g`, lanes `d * sc` of its
/// 8 sub-blocks, then `-(dmin * m)` of them: the file's products, exact in
/// f32, and the AVX-512 kernel's lane for lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_kx8_prep(g: *const u8, nsb: usize, pre: &mut [__m256]) {
    let shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    let shifts_m = _mm256_add_epi32(shifts, _mm256_set1_epi32(16));
    let (three, fifteen) = (_mm256_set1_epi32(3), _mm256_set1_epi32(15));
    let sign = _mm256_set1_epi32(i32::MIN);
    assert!(pre.len() >= nsb * K_PRE);
    for sb in 0..nsb {
        // SAFETY: sb < nsb; the group holds nsb super-blocks, each
        // Q4_KX8_BYTES long, and every read below lies inside one.
        unsafe {
            let s = g.add(sb * Q4_KX8_BYTES);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(s as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(s.add(16) as *const __m128i));
            for j in 0..8 {
                let off = 32 + 12 * j;
                let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(s.add(off) as *const __m128i));
                let h = _mm256_set1_epi32(std::ptr::read_unaligned(s.add(off + 8) as *const i32));
                let sc = _mm256_or_si256(
                    _mm256_and_si256(v, fifteen),
                    _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srlv_epi32(h, shifts), three)),
                );
                let m = _mm256_or_si256(
                    _mm256_srli_epi32::<4>(v),
                    _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srlv_epi32(h, shifts_m), three)),
                );
                pre[sb * K_PRE + j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                let dm = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
                pre[sb * K_PRE + 8 + j] =
                    _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(dm), sign));
            }
        }
    }
}

/// Q6_K: for each of `nsb` super-blocks of group `g`, lanes `d * sc` of its
/// 16 sub-blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_kx8_prep(g: *const u8, nsb: usize, pre: &mut [__m256]) {
    assert!(pre.len() >= nsb * K_PRE);
    for sb in 0..nsb {
        // SAFETY: as q4_kx8_prep.
        unsafe {
            let s = g.add(sb * Q6_KX8_BYTES);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(s as *const __m128i));
            for k in 0..16 {
                let sc = _mm_loadl_epi64(s.add(16 + 8 * k) as *const __m128i);
                pre[sb * K_PRE + k] =
                    _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            }
        }
    }
}

/// The 4 activation bytes `qs[at..at + 4]` of token block `ab`, in all
/// eight lanes.
#[inline(always)]
unsafe fn bcast4(ab: &BlockQ8A, at: usize) -> __m256i {
    // SAFETY: at + 4 <= 32 at every call site.
    unsafe {
        _mm256_set1_epi32(std::ptr::read_unaligned(
            ab.qs.as_ptr().add(at) as *const i32
        ))
    }
}

/// One interleaved Q4_K group (8 rows) times N tokens from `t0`: Q4_1x8's
/// inner loop on each 32-weight sub-block, its scale and min from `pre`
/// (or, where `pre` is empty, unpacked from each super-block as it is
/// reached). The integer sums are exact and folded in the AVX-512
/// kernel's order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_kx8_tile<const N: usize>(
    g: *const u8,
    nsb: usize,
    pre: &[__m256],
    a: &[BlockQ8A],
    t0: usize,
) -> [__m256; N] {
    let nb = nsb * 8;
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut local = [_mm256_setzero_ps(); K_PRE];
    for sb in 0..nsb {
        // SAFETY: sb < nsb; the group holds nsb super-blocks.
        let s = unsafe { g.add(sb * Q4_KX8_BYTES) };
        let p: &[__m256] = if pre.is_empty() {
            // SAFETY: one super-block of the group; same features.
            unsafe { q4_kx8_prep(s, 1, &mut local) };
            &local
        } else {
            &pre[sb * K_PRE..(sb + 1) * K_PRE]
        };
        for j in 0..8 {
            let b = sb * 8 + j;
            // Eight maddubs a token (each lane at most 2 x 15 x 127) sum in
            // i16 to at most 30480: one madd widens them.
            let mut s16 = [_mm256_setzero_si256(); N];
            for c in 0..4 {
                // SAFETY: sub-block j's chunk c lies inside the super-block.
                let v =
                    unsafe { _mm256_loadu_si256(s.add(128 + 128 * j + 32 * c) as *const __m256i) };
                let lo = _mm256_and_si256(v, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                for (t, acc16) in s16.iter_mut().enumerate() {
                    let ab = &a[(t0 + t) * nb + b];
                    // SAFETY: offsets 4c and 16 + 4c leave 4 bytes inside qs.
                    let (alo, ahi) = unsafe { (bcast4(ab, 4 * c), bcast4(ab, 16 + 4 * c)) };
                    *acc16 = _mm256_add_epi16(
                        *acc16,
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, alo),
                            _mm256_maddubs_epi16(hi, ahi),
                        ),
                    );
                }
            }
            let (dw, mw) = (p[j], p[8 + j]);
            for t in 0..N {
                let ab = &a[(t0 + t) * nb + b];
                let isum = _mm256_madd_epi16(s16[t], ones);
                acc[t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(isum),
                    _mm256_mul_ps(dw, _mm256_set1_ps(ab.d)),
                    acc[t],
                );
                acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(ab.s), acc[t]);
            }
        }
    }
    acc
}

/// One interleaved Q6_K group times N tokens: the 6-bit values (nibble |
/// top bits << 4, unsigned) times the activations, each half of a
/// 32-block summed apart (its own scale), `- 32` folded in through the
/// blocks' half sums `hs`, as the AVX-512 kernel folds them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_kx8_tile<const N: usize>(
    g: *const u8,
    nsb: usize,
    pre: &[__m256],
    a: &[BlockQ8A],
    hs: &[[f32; 2]],
    t0: usize,
) -> [__m256; N] {
    let nb = nsb * 8;
    let (m0f, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut local = [_mm256_setzero_ps(); K_PRE];
    for sb in 0..nsb {
        // SAFETY: sb < nsb; the group holds nsb super-blocks.
        let s = unsafe { g.add(sb * Q6_KX8_BYTES) };
        let p: &[__m256] = if pre.is_empty() {
            // SAFETY: one super-block of the group; same features.
            unsafe { q6_kx8_prep(s, 1, &mut local) };
            &local
        } else {
            &pre[sb * K_PRE..(sb + 1) * K_PRE]
        };
        for blk in 0..8 {
            let b = sb * 8 + blk;
            let mut ilo = [_mm256_setzero_si256(); N];
            let mut ihi = [_mm256_setzero_si256(); N];
            for pair in 0..2 {
                // SAFETY: block blk's plane of top bits lies inside the super-block.
                let h = unsafe {
                    _mm256_loadu_si256(s.add(1168 + 64 * blk + 32 * pair) as *const __m256i)
                };
                // Two chunks a pair: two maddubs (each lane at most
                // 2 x 63 x 128) sum in i16 before a madd widens them.
                let mut v = [[_mm256_setzero_si256(); 2]; 2];
                for (p2, vp) in v.iter_mut().enumerate() {
                    let c = 2 * pair + p2;
                    // SAFETY: block blk's chunk c lies inside the super-block.
                    let q = unsafe {
                        _mm256_loadu_si256(s.add(144 + 128 * blk + 32 * c) as *const __m256i)
                    };
                    let (lh, hh) = if p2 == 0 {
                        (_mm256_slli_epi16(h, 4), _mm256_slli_epi16(h, 2))
                    } else {
                        (h, _mm256_srli_epi16(h, 2))
                    };
                    vp[0] = _mm256_or_si256(_mm256_and_si256(q, m0f), _mm256_and_si256(lh, m30));
                    vp[1] = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(q, 4), m0f),
                        _mm256_and_si256(hh, m30),
                    );
                }
                for t in 0..N {
                    let ab = &a[(t0 + t) * nb + b];
                    let (c0, c1) = (4 * (2 * pair), 4 * (2 * pair + 1));
                    // SAFETY: offsets below 16 + 4 * 3 + 4 = 32 stay inside qs.
                    let lo = unsafe {
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(v[0][0], bcast4(ab, c0)),
                            _mm256_maddubs_epi16(v[1][0], bcast4(ab, c1)),
                        )
                    };
                    // SAFETY: as above.
                    let hi = unsafe {
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(v[0][1], bcast4(ab, 16 + c0)),
                            _mm256_maddubs_epi16(v[1][1], bcast4(ab, 16 + c1)),
                        )
                    };
                    ilo[t] = _mm256_add_epi32(ilo[t], _mm256_madd_epi16(lo, ones));
                    ihi[t] = _mm256_add_epi32(ihi[t], _mm256_madd_epi16(hi, ones));
                }
            }
            let (dlo, dhi) = (p[2 * blk], p[2 * blk + 1]);
            for t in 0..N {
                let ab = &a[(t0 + t) * nb + b];
                let [slo, shi] = hs[(t0 + t) * nb + b];
                let da = _mm256_set1_ps(ab.d);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(ilo[t]), _mm256_mul_ps(dlo, da), acc[t]);
                acc[t] = _mm256_fmadd_ps(dlo, _mm256_set1_ps(-32.0 * slo), acc[t]);
                acc[t] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(ihi[t]), _mm256_mul_ps(dhi, da), acc[t]);
                acc[t] = _mm256_fmadd_ps(dhi, _mm256_set1_ps(-32.0 * shi), acc[t]);
            }
        }
    }
    acc
}

/// Interleaved Q4_K rows `rows` times all tokens of `x` at the file's
/// size (`quant::repack_q4_k_x8`): a group at a time, its scales unpacked
/// once a pass.
///
/// # Safety
/// As [`q4_1x8_rows`]; `x.k` a multiple of 256.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_kx8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    // SAFETY: forwarded.
    unsafe { kx8_rows(w, Q4_KX8_BYTES, false, x, rows, out) }
}

/// Interleaved Q6_K rows `rows` times all tokens of `x`, as
/// [`q4_kx8_rows`].
///
/// # Safety
/// As [`q4_1x8_rows`]; `x.k` a multiple of 256.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6_kx8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    // SAFETY: forwarded.
    unsafe { kx8_rows(w, Q6_KX8_BYTES, true, x, rows, out) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
        pre.resize(nsb * K_PRE, _mm256_setzero_ps());
        hs.clear();
        if q6 {
            hs.extend(x.q[..x.t * nb].iter().map(super::scalar::half_sums));
        }
        let mut p0 = 0;
        while p0 < x.t {
            let p1 = (p0 + TOKENS_PER_PASS).min(x.t);
            for g in g_first..g_end {
                // SAFETY: g < g_end, asserted in bounds above; the
                // features are this function's.
                unsafe {
                    let gp = w.as_ptr().add(g * gb);
                    // A pass of a tile or two (a decode) unpacks each
                    // super-block's scales where the tile reads it, in the
                    // stream of its weights; a longer one unpacks them all
                    // first, once for all its tiles.
                    let inline = p1 - p0 <= 2 * TILE;
                    if !inline && q6 {
                        q6_kx8_prep(gp, nsb, pre);
                    } else if !inline {
                        q4_kx8_prep(gp, nsb, pre);
                    }
                    let pre: &[__m256] = if inline { &[] } else { pre };
                    let mut t = p0;
                    while t + TILE <= p1 {
                        let r = if q6 {
                            q6_kx8_tile::<TILE>(gp, nsb, pre, x.q, hs, t)
                        } else {
                            q4_kx8_tile::<TILE>(gp, nsb, pre, x.q, t)
                        };
                        for (c, v) in r.iter().enumerate() {
                            store_group(*v, out, t + c, g * 8, &rows);
                        }
                        t += TILE;
                    }
                    while t < p1 {
                        let [v] = if q6 {
                            q6_kx8_tile::<1>(gp, nsb, pre, x.q, hs, t)
                        } else {
                            q4_kx8_tile::<1>(gp, nsb, pre, x.q, t)
                        };
                        store_group(v, out, t, g * 8, &rows);
                        t += 1;
                    }
                }
            }
            p0 = p1;
        }
    });
}

/// Q8_0 weights times quantised activations for a tile of N tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_tile<const N: usize>(
    wr: *const u8,
    nb: usize,
    a: &[BlockQ8A],
    t0: usize,
    r: usize,
    out: OutPtr,
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        // SAFETY: b < nb, row holds nb blocks of 34 bytes.
        let blk = unsafe { wr.add(b * Q8_0_BYTES) };
        let d = unsafe { f16_load(blk) };
        let wq = unsafe { _mm256_loadu_si256(blk.add(2) as *const __m256i) };
        // |w| as unsigned times sign(w)*a: maddubs needs one unsigned operand.
        let wabs = _mm256_sign_epi8(wq, wq);
        for c in 0..N {
            let ab = &a[(t0 + c) * nb + b];
            // SAFETY: qs is 32 bytes.
            let av = unsafe { _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i) };
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(av, wq)), ones);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * ab.d), acc[c]);
        }
    }
    for (c, v) in acc.iter().enumerate() {
        out.put(t0 + c, r, unsafe { hsum(*v) });
    }
}

/// Q8_0 rows `rows` of `w` times all tokens of `x`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`); slices must
/// have the lengths the shapes imply (asserted where cheap).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q8_0_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    let nb = x.k / QK;
    let rb = nb * Q8_0_BYTES;
    assert!(rows.end * rb <= w.len());
    let mut p0 = 0;
    while p0 < x.t {
        let p1 = (p0 + TOKENS_PER_PASS).min(x.t);
        for r in rows.clone() {
            // SAFETY: r < rows.end, asserted in bounds above.
            let wr = unsafe { w.as_ptr().add(r * rb) };
            let mut t = p0;
            unsafe {
                while t + TILE <= p1 {
                    q8_0_tile::<TILE>(wr, nb, x.q, t, r, out);
                    t += TILE;
                }
                match p1 - t {
                    3 => q8_0_tile::<3>(wr, nb, x.q, t, r, out),
                    2 => q8_0_tile::<2>(wr, nb, x.q, t, r, out),
                    1 => q8_0_tile::<1>(wr, nb, x.q, t, r, out),
                    _ => {}
                }
            }
        }
        p0 = p1;
    }
}

/// f32 dot product, eight lanes.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`); slices must
/// have the lengths the shapes imply (asserted where cheap).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let n8 = n / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n.
        unsafe {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc,
            );
        }
        i += 8;
    }
    let mut s = unsafe { hsum(acc) };
    for j in n8..n {
        s += a[j] * b[j];
    }
    s
}

/// f32 rows times f32 activations.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`); slices must
/// have the lengths the shapes imply (asserted where cheap).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f32_rows(w: &[f32], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    for r in rows {
        let wr = &w[r * x.k..(r + 1) * x.k];
        for t in 0..x.t {
            out.put(t, r, unsafe { dot_f32(wr, &x.f[t * x.k..(t + 1) * x.k]) });
        }
    }
}

/// Quantises one activation row into 8-bit blocks (ties to even, as the scalar version).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`); slices must
/// have the lengths the shapes imply (asserted where cheap).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_row_q8a(x: &[f32], out: &mut [BlockQ8A]) {
    assert_eq!(x.len(), out.len() * QK);
    let sign = _mm256_set1_ps(-0.0);
    for (xb, ob) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // SAFETY: xb has 32 elements.
        let v = unsafe {
            [
                _mm256_loadu_ps(xb.as_ptr()),
                _mm256_loadu_ps(xb.as_ptr().add(8)),
                _mm256_loadu_ps(xb.as_ptr().add(16)),
                _mm256_loadu_ps(xb.as_ptr().add(24)),
            ]
        };
        let mut mx = _mm256_andnot_ps(sign, v[0]);
        for vi in &v[1..] {
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, *vi));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let amax = _mm_cvtss_f32(m4);
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(v[i], id),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256(sum, 1),
        );
        let s4 = _mm_hadd_epi32(s4, s4);
        let s4 = _mm_hadd_epi32(s4, s4);
        let isum = _mm_cvtsi128_si32(s4);
        let p01 = _mm256_packs_epi32(q[0], q[1]);
        let p23 = _mm256_packs_epi32(q[2], q[3]);
        let p = _mm256_packs_epi16(p01, p23);
        // packs interleaves 128-bit lanes; restore element order.
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: qs is 32 bytes.
        unsafe { _mm256_storeu_si256(ob.qs.as_mut_ptr() as *mut __m256i, p) };
        ob.d = d;
        ob.s = d * isum as f32;
    }
}

/// Loads eight KV elements as f32.
pub trait KvLoad: Copy {
    /// Loads `p[0..8]` as f32.
    ///
    /// # Safety
    /// `p..p+8` must be readable and the CPU must have AVX2/F16C.
    unsafe fn load8(p: *const Self) -> __m256;
    /// Stores eight f32 into `p[0..8]`.
    ///
    /// # Safety
    /// `p..p+8` must be writable and the CPU must have AVX2/F16C.
    unsafe fn store8(p: *mut Self, v: __m256);
}

impl KvLoad for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store8(p: *mut f32, v: __m256) {
        unsafe { _mm256_storeu_ps(p, v) }
    }
}

impl KvLoad for half::f16 {
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn store8(p: *mut half::f16, v: __m256) {
        unsafe {
            _mm_storeu_si128(
                p as *mut __m128i,
                _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT),
            )
        }
    }
}

/// Rows of one K or V run of a KV block, as the attention kernel reads them:
/// eight values of a row at a time, widened to f32.
pub trait KvRows: Copy {
    /// Rows held.
    fn rows(&self, hd: usize) -> usize;
    /// Values `i..i + 8` of row `j` (rows of `hd` values) as f32.
    ///
    /// # Safety
    /// `j < self.rows(hd)`, `i + 8 <= hd`, and the CPU must have AVX2/F16C.
    unsafe fn load8(&self, j: usize, i: usize, hd: usize) -> __m256;
}

/// Rows stored as plain f32 or f16 values.
#[derive(Clone, Copy)]
pub struct Plain<'a, T>(pub &'a [T]);

impl<T: KvLoad> KvRows for Plain<'_, T> {
    #[inline(always)]
    fn rows(&self, hd: usize) -> usize {
        self.0.len() / hd
    }
    #[inline(always)]
    unsafe fn load8(&self, j: usize, i: usize, hd: usize) -> __m256 {
        // SAFETY: in bounds by the caller's promise.
        unsafe { T::load8(self.0.as_ptr().add(j * hd + i)) }
    }
}

/// Rows stored as int8 values with one scale per 32 (`KvDtype::Int8`); the
/// scales already widened to f32, `hd / 32` per row.
#[derive(Clone, Copy)]
pub struct Int8Rows<'a> {
    /// Values, `[row][hd]`.
    pub q: &'a [i8],
    /// Scales, `[row][hd / 32]`.
    pub d: &'a [f32],
}

impl KvRows for Int8Rows<'_> {
    #[inline(always)]
    fn rows(&self, hd: usize) -> usize {
        (self.q.len() / hd).min(self.d.len() / (hd / 32))
    }
    #[inline(always)]
    unsafe fn load8(&self, j: usize, i: usize, hd: usize) -> __m256 {
        // SAFETY: in bounds by the caller's promise; 8 bytes read.
        unsafe {
            let b = _mm_loadl_epi64(self.q.as_ptr().add(j * hd + i) as *const __m128i);
            let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            let d = *self.d.get_unchecked(j * (hd / 32) + i / 32);
            _mm256_mul_ps(f, _mm256_set1_ps(d))
        }
    }
}

/// Writes f32 values into KV storage (length a multiple of 8).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`); slices must
/// have the lengths the shapes imply (asserted where cheap).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn store_kv<T: KvLoad>(dst: &mut [T], src: &[f32]) {
    debug_assert!(src.len().is_multiple_of(8) && dst.len() >= src.len());
    let mut i = 0;
    // SAFETY: i + 8 <= len on every access.
    unsafe {
        while i < src.len() {
            T::store8(
                dst.as_mut_ptr().add(i),
                _mm256_loadu_ps(src.as_ptr().add(i)),
            );
            i += 8;
        }
    }
}

/// `ln 2` split in two for the range reduction of [`exp8`] and
/// `avx512::exp16`: `x - k ln 2` as `x - k hi - k lo`.
pub(crate) const EXP_LN2: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
/// Their degree-5 polynomial's coefficients, highest first.
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_66,
    0.5,
];

/// e^x for eight lanes (Cephes-style range reduction and degree-5
/// polynomial; relative error below 2e-7 over [-87, 88], 0 below -87).
#[inline]
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`); slices must
/// have the lengths the shapes imply (asserted where cheap).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.0));
    let underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_LT_OQ);
    let fx = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2[0]), x);
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2[1]), r);
    let mut y = _mm256_set1_ps(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
    }
    y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let pow2 = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)),
        23,
    );
    let res = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
    _mm256_andnot_ps(underflow, res)
}

/// A gated FFN activation, eight lanes at a time: `h = act(g) * u` with
/// SiLU `g sigmoid(g)` or tanh-GELU, written as `g sigmoid(2 a)` with
/// `a = sqrt(2/pi) (g + 0.044715 g^3)` (equal to `0.5 g (1 + tanh a)`,
/// without its cancellation). Lengths equal, a multiple of 8.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gated_act(g: &[f32], u: &[f32], h: &mut [f32], gelu: bool) {
    assert!(g.len() == u.len() && h.len() == g.len() && g.len().is_multiple_of(8));
    let one = _mm256_set1_ps(1.0);
    let (c1, c3) = (
        _mm256_set1_ps(-2.0 * 0.797_884_6),
        _mm256_set1_ps(-2.0 * 0.797_884_6 * 0.044_715),
    );
    let neg = _mm256_set1_ps(-1.0);
    let mut i = 0;
    // SAFETY: i + 8 <= len on every access.
    unsafe {
        while i < g.len() {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            // -z, with z = x (SiLU) or 2a (GELU).
            let mz = if gelu {
                let x2 = _mm256_mul_ps(x, x);
                _mm256_mul_ps(x, _mm256_fmadd_ps(c3, x2, c1))
            } else {
                _mm256_mul_ps(x, neg)
            };
            let act = _mm256_div_ps(x, _mm256_add_ps(one, exp8(mz)));
            let v = _mm256_mul_ps(act, _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(h.as_mut_ptr().add(i), v);
            i += 8;
        }
    }
}

/// Sums each of eight vectors into one lane of the result (lane i = sum of v[i]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum8x8(v: &[__m256; 8]) -> __m256 {
    let a = _mm256_hadd_ps(v[0], v[1]);
    let b = _mm256_hadd_ps(v[2], v[3]);
    let c = _mm256_hadd_ps(v[4], v[5]);
    let d = _mm256_hadd_ps(v[6], v[7]);
    let ab = _mm256_hadd_ps(a, b);
    let cd = _mm256_hadd_ps(c, d);
    // ab = [s0l s1l s2l s3l | s0h s1h s2h s3h], likewise cd for 4..8
    let lo = _mm256_permute2f128_ps(ab, cd, 0x20);
    let hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    _mm256_add_ps(lo, hi)
}

/// One KV block of the online softmax for the `group` query heads that share
/// a KV head: scores of `n` positions, block max, rescale, accumulate V.
/// Query heads go in chunks of up to four that share every K and V load (and
/// its f16 conversion). `q` is `group * hd`, `k` and `v` are `n * hd`;
/// `scores` holds at least `group * n.next_multiple_of(8)` floats.
#[allow(clippy::too_many_arguments)]
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C (`kernels::has_avx2`); slices must
/// have the lengths the shapes imply (asserted where cheap).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_block<T: KvRows>(
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
    assert!(hd.is_multiple_of(8) && scores.len() >= group * stride && sum.len() >= group);
    let mut g0 = 0;
    while g0 < group {
        let h = (group - g0).min(4);
        let a = Heads {
            q,
            k,
            v,
            n,
            hd,
            scale,
            g0,
        };
        // SAFETY: shapes asserted above; heads g0..g0 + h exist.
        unsafe {
            match h {
                1 => attend_heads::<T, 1>(&a, scores, mx, sum, acc),
                2 => attend_heads::<T, 2>(&a, scores, mx, sum, acc),
                3 => attend_heads::<T, 3>(&a, scores, mx, sum, acc),
                _ => attend_heads::<T, 4>(&a, scores, mx, sum, acc),
            }
        }
        g0 += h;
    }
}

/// Online softmax of one block for heads `g0..g0 + G`: each head's row of
/// `n` scores (rows `n.next_multiple_of(8)` apart) becomes probabilities
/// against the new running max, its running sum is rescaled and grows;
/// returns each head's rescale factor for its accumulator.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `scores` holds `(g0 + G) * stride`
/// floats, `mx` and `sum` `g0 + G`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn softmax_block<const G: usize>(
    g0: usize,
    n: usize,
    scores: &mut [f32],
    mx: &mut [f32],
    sum: &mut [f32],
) -> [f32; G] {
    let stride = n.next_multiple_of(8);
    assert!(scores.len() >= (g0 + G) * stride && mx.len() >= g0 + G && sum.len() >= g0 + G);
    // Lanes of the last vector past n: -inf for the max, 0 for the sum.
    let live = |j0: usize| {
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32((n - j0).min(8) as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    };
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    // Probabilities overwrite the scores.
    let mut corr = [0f32; G];
    for (g, c) in corr.iter_mut().enumerate() {
        let h = g0 + g;
        let sc = scores[h * stride..].as_mut_ptr();
        // SAFETY: sc holds stride = n rounded up to 8 floats.
        unsafe {
            let mut vmax = ninf;
            let mut j0 = 0;
            while j0 < n {
                let v = _mm256_loadu_ps(sc.add(j0));
                vmax = _mm256_max_ps(
                    vmax,
                    _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(live(j0))),
                );
                j0 += 8;
            }
            let m_new = mx[h].max(hmax8(vmax));
            // e^(old max - new max): 0 while the old max is -inf.
            *c = _mm256_cvtss_f32(exp8(_mm256_set1_ps(mx[h] - m_new)));
            mx[h] = m_new;
            let vm = _mm256_set1_ps(m_new);
            let mut vs = _mm256_setzero_ps();
            let mut j0 = 0;
            while j0 < n {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc.add(j0)), vm));
                _mm256_storeu_ps(sc.add(j0), e);
                vs = _mm256_add_ps(vs, _mm256_and_ps(e, _mm256_castsi256_ps(live(j0))));
                j0 += 8;
            }
            sum[h] = sum[h] * *c + hsum8(vs);
        }
    }
    corr
}

/// The largest of eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hmax8(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    _mm_cvtss_f32(m)
}

/// The sum of eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// The inputs of [`attend_heads`]: query heads `g0..g0 + G` over one block.
struct Heads<'a, T> {
    q: &'a [f32],
    k: T,
    v: T,
    n: usize,
    hd: usize,
    scale: f32,
    g0: usize,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_heads<T: KvRows, const G: usize>(
    a: &Heads<'_, T>,
    scores: &mut [f32],
    mx: &mut [f32],
    sum: &mut [f32],
    acc: &mut [f32],
) {
    let (n, hd, g0) = (a.n, a.hd, a.g0);
    let stride = n.next_multiple_of(8);
    let qp = a.q.as_ptr();
    // Scores, eight positions at a time, each K row loaded once for the G
    // heads, reduced with one hadd tree per head.
    let mut j0 = 0;
    while j0 < n {
        let m = (n - j0).min(8);
        let mut parts = [[_mm256_setzero_ps(); 8]; G];
        for jj in 0..m {
            let mut s = [_mm256_setzero_ps(); G];
            let mut i = 0;
            // SAFETY: i + 8 <= hd on every load, rows < n; heads g0 + g < group.
            unsafe {
                while i < hd {
                    let kv = a.k.load8(j0 + jj, i, hd);
                    for (g, sg) in s.iter_mut().enumerate() {
                        *sg = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add((g0 + g) * hd + i)), kv, *sg);
                    }
                    i += 8;
                }
            }
            for (p, sg) in parts.iter_mut().zip(s) {
                p[jj] = sg;
            }
        }
        for (g, p) in parts.iter().enumerate() {
            let sc = _mm256_mul_ps(unsafe { hsum8x8(p) }, _mm256_set1_ps(a.scale));
            // SAFETY: scores holds group * stride floats.
            unsafe { _mm256_storeu_ps(scores.as_mut_ptr().add((g0 + g) * stride + j0), sc) };
        }
        j0 += 8;
    }
    // SAFETY: scores hold the G heads' rows of `stride` floats.
    let corr = unsafe { softmax_block::<G>(g0, n, scores, mx, sum) };
    // V, each row loaded once for the G heads.
    let mut i = 0;
    // SAFETY: i + 8 <= hd on every access; j < n rows of v; heads < group.
    unsafe {
        while i < hd {
            let mut s = [_mm256_setzero_ps(); G];
            for (g, sg) in s.iter_mut().enumerate() {
                *sg = _mm256_mul_ps(
                    _mm256_loadu_ps(acc.as_ptr().add((g0 + g) * hd + i)),
                    _mm256_set1_ps(corr[g]),
                );
            }
            for j in 0..n {
                let vv = a.v.load8(j, i, hd);
                for (g, sg) in s.iter_mut().enumerate() {
                    let p = *scores.get_unchecked((g0 + g) * stride + j);
                    *sg = _mm256_fmadd_ps(_mm256_set1_ps(p), vv, *sg);
                }
            }
            for (g, sg) in s.iter().enumerate() {
                _mm256_storeu_ps(acc.as_mut_ptr().add((g0 + g) * hd + i), *sg);
            }
            i += 8;
        }
    }
}
