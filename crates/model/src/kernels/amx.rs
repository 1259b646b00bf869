//! AMX tiles for the products of many tokens (prefill, batched decode):
//! `tdpbsud` multiplies a tile of 16 tokens' 8-bit activations (signed) by
//! a tile of 16 weight rows (unsigned bytes, as the VNNI kernels read them)
//! over one 32-weight block, 8,192 multiply-adds in one instruction.
//!
//! A block's integer sums are exact, the same numbers `vpdpbusd` makes;
//! the tile is stored and each token's 16 sums are folded with the block's
//! scales by the very expression of `avx512::fold_block`, in the same
//! order. So a result is the VNNI kernel's to the bit (tested), whichever
//! kernel a product runs on, and how many tokens a call has never changes
//! a number.
//!
//! Tiles (palette 1): `tmm0`-`tmm3` sums (16 tokens x 16 rows of i32),
//! `tmm4`/`tmm5` activations (16 tokens x 32 bytes, read in place from
//! the [`BlockQ8A`] blocks at a token's stride), `tmm6`/`tmm7` weights
//! (8 rows of 4 weights x 16 rows, the interleaved layouts' 4-byte groups
//! of two 8-row groups side by side). Four blocks are in flight: three
//! multiply while the sums of the fourth are folded. A group
//! pair's weights are unpacked once a pass of [`TOKENS_PER_PASS`] tokens
//! and read by every token tile of the pass.
//!
//! Linux gives a process the tiles' state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), made once by
//! [`has_amx`]; a CPU or kernel without it resolves to the VNNI kernels.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

use super::avx512::{chunk16, halves16, store_rows};
use super::{Acts, OutPtr};
use crate::quant::{BlockQ8A, Q4_1X8_BYTES, Q8_0X8_BYTES, QK};

/// Fewest tokens for which a product runs on the tiles (below it, the
/// VNNI kernels: the same bits, and cheaper where a tile would be mostly
/// empty).
pub const MIN_TOKENS: usize = 16;

/// Tokens whose activations a group pair's unpacked weights serve before
/// the next pair is unpacked.
const TOKENS_PER_PASS: usize = 128;

/// Whether this CPU has AMX-TILE and AMX-INT8 (besides AVX-512 VNNI), the
/// OS saves the tiles' state, and this process was granted it (asked once).
pub fn has_amx() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| super::has_avx512_vnni() && cpu_has_amx_int8() && request_tile_data())
}

/// CPUID leaf 7 (AMX-TILE, AMX-INT8) and XCR0's tile bits (17, 18).
fn cpu_has_amx_int8() -> bool {
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only when
    // the maximum leaf says it exists, XGETBV only when OSXSAVE says so.
    unsafe {
        if __cpuid(0).eax < 7 {
            return false;
        }
        let l7 = __cpuid_count(7, 0);
        let (tile, int8) = (l7.edx & (1 << 24) != 0, l7.edx & (1 << 25) != 0);
        if !(tile && int8) || __cpuid(1).ecx & (1 << 27) == 0 {
            return false;
        }
        let (lo, _hi): (u32, u32);
        asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi,
             options(nomem, nostack, preserves_flags));
        (lo >> 17) & 3 == 3
    }
}

/// Asks Linux for the tile data state (granted to the whole process).
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl with these arguments only changes the process's
    // permitted xsave features; the syscall clobbers rcx and r11.
    unsafe {
        asm!("syscall",
             inlateout("rax") SYS_ARCH_PRCTL => ret,
             in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA,
             lateout("rcx") _, lateout("r11") _,
             options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// A tile configuration (palette 1) for token tiles of `m` rows.
#[repr(C, align(64))]
struct TileCfg([u8; 64]);

impl TileCfg {
    fn new(m: usize) -> TileCfg {
        debug_assert!((1..=16).contains(&m));
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut set = |t: usize, rows: usize, colsb: u16| {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t] = rows as u8;
        };
        for t in 0..4 {
            // Sums: m tokens x 16 rows of i32.
            set(t, m, 64);
        }
        for t in 4..6 {
            // Activations: m tokens x one block's 32 bytes.
            set(t, m, 32);
            // Weights: 8 rows of 4-byte groups x 16 weight rows.
            set(t + 2, 8, 64);
        }
        TileCfg(c)
    }

    /// Loads this configuration on the calling thread.
    ///
    /// # Safety
    /// [`has_amx`] must be true.
    unsafe fn load(&self) {
        // SAFETY: a valid palette-1 configuration, 64 bytes, aligned.
        unsafe { asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly)) };
    }
}

/// Gives the tiles' state back (so the thread's context switches stay small).
///
/// # Safety
/// [`has_amx`] must be true.
unsafe fn release() {
    // SAFETY: valid in any state once AMX is permitted.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// One block's sums into slot `S`'s tile and out to `c` (16 rows of 64
/// bytes): zero, load the activations (`a`, rows `stride` apart) and the
/// weights (`w`, 8 rows of 64 bytes), multiply, store. Sums rotate over
/// four tiles, operands over two, so four blocks are in flight.
///
/// # Safety
/// A configuration from [`TileCfg::new`] is loaded; `a` holds the tile's
/// rows, `w` 512 bytes, `c` 1,024.
#[inline(always)]
unsafe fn issue<const S: usize>(a: *const u8, stride: usize, w: *const u8, c: *mut i32) {
    macro_rules! slot {
        ($c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tilezero ", $c),
                concat!("tileloadd ", $a, ", [{a} + {s} * 1]"),
                concat!("tileloadd ", $b, ", [{w} + {r} * 1]"),
                concat!("tdpbsud ", $c, ", ", $a, ", ", $b),
                concat!("tilestored [{c} + {r} * 1], ", $c),
                a = in(reg) a, s = in(reg) stride, w = in(reg) w,
                r = in(reg) 64usize, c = in(reg) c,
                options(nostack),
            )
        };
    }
    // SAFETY: as the function's contract.
    unsafe {
        match S {
            0 => slot!("tmm0", "tmm4", "tmm6"),
            1 => slot!("tmm1", "tmm5", "tmm7"),
            2 => slot!("tmm2", "tmm4", "tmm6"),
            _ => slot!("tmm3", "tmm5", "tmm7"),
        }
    }
}

/// Block `b`'s tile ops into slot `b % 4`.
#[inline(always)]
unsafe fn issue_at(b: usize, a: *const u8, stride: usize, w: *const u8, sums: *mut i32) {
    // SAFETY: forwarded; sums holds four 256-entry slots.
    unsafe {
        let c = sums.add(256 * (b & 3));
        match b & 3 {
            0 => issue::<0>(a, stride, w, c),
            1 => issue::<1>(a, stride, w, c),
            2 => issue::<2>(a, stride, w, c),
            _ => issue::<3>(a, stride, w, c),
        }
    }
}

/// Four slots' stored sums.
#[repr(C, align(64))]
struct Sums([[i32; 256]; 4]);

thread_local! {
    /// A group pair's unpacked weights (8 registers a block) and scales
    /// (`dw`, then the offset's `mw`, a block).
    static SCRATCH: RefCell<(Vec<__m512i>, Vec<__m512>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Groups `g0`/`g1`'s `nb` blocks as tiles: the weight bytes in 8 rows of
/// 4-byte groups (Q4_1x8's nibbles split low then high; Q8_0x8's bytes as
/// they lie), and the scales the VNNI kernels fold with.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack(
    g0: *const u8,
    g1: *const u8,
    nb: usize,
    q8: bool,
    w: &mut [__m512i],
    sc: &mut [__m512],
) {
    assert!(w.len() >= nb * 8 && sc.len() >= nb * 2);
    let mask = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        // SAFETY: both groups hold nb blocks of the layout's size.
        unsafe {
            if q8 {
                let (b0, b1) = (g0.add(b * Q8_0X8_BYTES), g1.add(b * Q8_0X8_BYTES));
                let dw = halves16(b0, b1, 0);
                sc[2 * b] = dw;
                sc[2 * b + 1] = _mm512_mul_ps(dw, _mm512_set1_ps(-128.0));
                for j in 0..8 {
                    w[8 * b + j] = chunk16(b0, b1, 16 + 32 * j);
                }
            } else {
                let (b0, b1) = (g0.add(b * Q4_1X8_BYTES), g1.add(b * Q4_1X8_BYTES));
                sc[2 * b] = halves16(b0, b1, 0);
                sc[2 * b + 1] = halves16(b0, b1, 16);
                for j in 0..4 {
                    let v = chunk16(b0, b1, 32 + 32 * j);
                    w[8 * b + j] = _mm512_and_si512(v, mask);
                    w[8 * b + 4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                }
            }
        }
    }
}

/// Tokens `t0..t0 + M` (`M <= 16`, the loaded configuration's rows) times
/// the unpacked group pair: every block's tile sums folded into 16-row
/// accumulators as `avx512::fold_block` folds them.
///
/// # Safety
/// As [`issue`]; `x.q` holds the tokens' blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn token_tile<const M: usize>(
    w: &[__m512i],
    sc: &[__m512],
    x: &Acts<'_>,
    t0: usize,
    sums: &mut Sums,
) -> [__m512; M] {
    let nb = x.k / QK;
    let m = M;
    assert!(M <= 16);
    assert!((t0 + m) * nb <= x.q.len() && w.len() >= nb * 8 && sc.len() >= nb * 2);
    let stride = nb * std::mem::size_of::<BlockQ8A>();
    let qs = std::mem::offset_of!(BlockQ8A, qs);
    let a = x.q[t0 * nb..].as_ptr() as *const u8;
    let mut acc = [_mm512_setzero_ps(); M];
    // SAFETY: block b's activations of the m tokens lie at a + 40b + 8,
    // rows `stride` apart, inside x.q (asserted); w holds 8 registers
    // (512 bytes) a block; sums holds two 1,024-byte slots.
    unsafe {
        let sp = sums.0.as_mut_ptr() as *mut i32;
        let wp = w.as_ptr() as *const u8;
        let blk = std::mem::size_of::<BlockQ8A>();
        let at = |b: usize| (a.add(b * blk + qs), wp.add(b * 512));
        for b in 0..nb.min(3) {
            let (ab, wb) = at(b);
            issue_at(b, ab, stride, wb, sp);
        }
        for b in 0..nb {
            if b + 3 < nb {
                let (ab, wb) = at(b + 3);
                issue_at(b + 3, ab, stride, wb, sp);
            }
            let c = sp.add(256 * (b & 3));
            let (dw, mw) = (sc[2 * b], sc[2 * b + 1]);
            let row = |i: usize| x.q.get_unchecked((t0 + i) * nb + b);
            // Written out token by token (a loop kept the accumulators in
            // memory), heights above M compiled away.
            macro_rules! fold {
                ($($i:literal)*) => {$(
                    if $i < M {
                        let ab = row($i);
                        let v = _mm512_load_si512(c.add(16 * $i) as *const _);
                        acc[$i] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(v),
                            _mm512_mul_ps(dw, _mm512_set1_ps(ab.d)),
                            acc[$i],
                        );
                        acc[$i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ab.s), acc[$i]);
                    }
                )*};
            }
            fold!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        }
    }
    acc
}

/// One interleaved layout's rows `rows` times all tokens of `x` on the
/// tiles, two 8-row groups at a time as the VNNI kernels pair them.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn grouped_rows(w: &[u8], q8: bool, x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    let nb = x.k / QK;
    let gb = nb * if q8 { Q8_0X8_BYTES } else { Q4_1X8_BYTES };
    let (g_first, g_end) = (rows.start / 8, rows.end.div_ceil(8));
    assert!(g_end * gb <= w.len());
    assert!(x.q.len() >= x.t * nb);
    SCRATCH.with(|scratch| {
        let (wt, sc) = &mut *scratch.borrow_mut();
        wt.resize(nb * 8, _mm512_setzero_si512());
        sc.resize(nb * 2, _mm512_setzero_ps());
        let mut sums = Sums([[0; 256]; 4]);
        let mut loaded = 0;
        let mut p0 = 0;
        while p0 < x.t {
            let p1 = (p0 + TOKENS_PER_PASS).min(x.t);
            let mut g = g_first;
            while g < g_end {
                let g1 = (g + 1).min(g_end - 1);
                let n = 8 * (g1 - g + 1);
                // SAFETY: g <= g1 < g_end, in bounds (asserted); the CPU has
                // AMX (the caller's contract) and this function's features.
                unsafe {
                    let (gp0, gp1) = (w.as_ptr().add(g * gb), w.as_ptr().add(g1 * gb));
                    unpack(gp0, gp1, nb, q8, wt, sc);
                    let mut t = p0;
                    while t < p1 {
                        let m = (p1 - t).min(16);
                        if m != loaded {
                            TileCfg::new(m).load();
                            loaded = m;
                        }
                        // Each tile height its own code, so the
                        // accumulators stay in registers.
                        macro_rules! tile {
                            ($($m:literal)*) => {
                                match m {
                                    $($m => {
                                        let acc = token_tile::<$m>(wt, sc, x, t, &mut sums);
                                        for (c, v) in acc.iter().enumerate() {
                                            store_rows(*v, out, t + c, g * 8, n, &rows);
                                        }
                                    })*
                                    _ => unreachable!("a tile holds 1 to 16 tokens"),
                                }
                            };
                        }
                        tile!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
                        t += m;
                    }
                }
                g += 2;
            }
            p0 = p1;
        }
        if loaded != 0 {
            // SAFETY: AMX present (the caller's contract).
            unsafe { release() };
        }
    });
}

/// Interleaved Q4_1 rows `rows` times all tokens of `x` on the tiles.
///
/// # Safety
/// [`has_amx`] must be true; shapes as `avx512::q4_1x8_rows`.
pub(crate) unsafe fn q4_1x8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    // SAFETY: forwarded.
    unsafe { grouped_rows(w, false, x, rows, out) }
}

/// Interleaved Q8_0 (`q + 128`) rows `rows` times all tokens of `x` on
/// the tiles.
///
/// # Safety
/// As [`q4_1x8_rows`].
pub(crate) unsafe fn q8_0x8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    // SAFETY: forwarded.
    unsafe { grouped_rows(w, true, x, rows, out) }
}

/// Peak of the tiles: four independent `tdpbsud` chains over full 16 x 64
/// tiles, 16,384 multiply-adds each. Returns the operations (two a
/// multiply-add) and a value from the sums (so they are kept).
///
/// # Safety
/// [`has_amx`] must be true.
pub(crate) unsafe fn peak_loop(iters: u64) -> (u64, f64) {
    let mut c = [0u8; 64];
    c[0] = 1;
    for t in 0..8 {
        c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
        c[48 + t] = 16;
    }
    let cfg = TileCfg(c);
    let src = [1u8; 1024];
    let mut dst = Sums([[0; 256]; 4]);
    // SAFETY: full tiles of 16 x 64 bytes read from and written to 1 KiB
    // buffers; the CPU has AMX (the contract).
    unsafe {
        cfg.load();
        asm!(
            "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
            "tileloadd tmm4, [{p} + {r} * 1]", "tileloadd tmm5, [{p} + {r} * 1]",
            "tileloadd tmm6, [{p} + {r} * 1]", "tileloadd tmm7, [{p} + {r} * 1]",
            p = in(reg) src.as_ptr(), r = in(reg) 64usize, options(nostack),
        );
        for _ in 0..iters {
            asm!(
                "tdpbsud tmm0, tmm4, tmm6",
                "tdpbsud tmm1, tmm4, tmm7",
                "tdpbsud tmm2, tmm5, tmm6",
                "tdpbsud tmm3, tmm5, tmm7",
                options(nostack, nomem),
            );
        }
        asm!("tilestored [{p} + {r} * 1], tmm0",
             p = in(reg) dst.0[0].as_mut_ptr(), r = in(reg) 64usize, options(nostack));
        release();
    }
    (iters * 4 * 16 * 16 * 64 * 2, dst.0[0][0] as f64)
}
