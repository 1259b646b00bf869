//! Portable kernels: the reference that the SIMD versions are tested against.

use std::cell::RefCell;
use std::ops::Range;

use super::{Acts, OutPtr, QMatrix};
use crate::quant::{
    BlockQ8A, Q4_1X8_BYTES, Q4_KX8_BYTES, Q6_KX8_BYTES, Q8_0_BYTES, Q8_0X8_BYTES, QK, QK_K, f16_at,
    q4_kx8_scale_min, q6_kx8_value,
};

/// Integer dot of row `lane` of an interleaved Q4_1 group with one quantised activation row.
pub fn dot_q4_1x8_q8a(group: &[u8], lane: usize, a: &[BlockQ8A]) -> f32 {
    let mut sum = 0f32;
    for (o, ab) in group.chunks_exact(Q4_1X8_BYTES).zip(a) {
        let (d, m) = (f16_at(o, 2 * lane), f16_at(o, 16 + 2 * lane));
        let mut isum = 0i32;
        for j in 0..4 {
            for k in 0..4 {
                let q = o[32 + 32 * j + 4 * lane + k];
                isum += (q & 0xF) as i32 * ab.qs[4 * j + k] as i32;
                isum += (q >> 4) as i32 * ab.qs[16 + 4 * j + k] as i32;
            }
        }
        sum += d * ab.d * isum as f32 + m * ab.s;
    }
    sum
}

/// Integer dot of row `lane` of an interleaved Q8_0 group with one quantised
/// activation row: `d da sum((q + 128) a) - 128 d s`, as the VNNI kernel.
pub fn dot_q8_0x8_q8a(group: &[u8], lane: usize, a: &[BlockQ8A]) -> f32 {
    let mut sum = 0f32;
    for (o, ab) in group.chunks_exact(Q8_0X8_BYTES).zip(a) {
        let d = f16_at(o, 2 * lane);
        let mut isum = 0i32;
        for j in 0..8 {
            for k in 0..4 {
                isum += o[16 + 32 * j + 4 * lane + k] as i32 * ab.qs[4 * j + k] as i32;
            }
        }
        sum += d * ab.d * isum as f32 + (-128.0 * d) * ab.s;
    }
    sum
}

/// Integer dot of row `lane` of an interleaved Q4_K group (all its
/// super-blocks) with one quantised activation row: per 32-block
/// `d sc da isum - dmin m s`, the scale and min as the file's, as the VNNI
/// kernel folds them.
pub fn dot_q4_kx8_q8a(group: &[u8], lane: usize, a: &[BlockQ8A]) -> f32 {
    let mut sum = 0f32;
    for (o, ab8) in group.chunks_exact(Q4_KX8_BYTES).zip(a.chunks_exact(8)) {
        let (d, dmin) = (f16_at(o, 2 * lane), f16_at(o, 16 + 2 * lane));
        for (j, ab) in ab8.iter().enumerate() {
            let (sc, mn) = q4_kx8_scale_min(o, lane, j);
            let mut isum = 0i32;
            for c in 0..4 {
                for k in 0..4 {
                    let q = o[128 + 128 * j + 32 * c + 4 * lane + k];
                    isum += (q & 0xF) as i32 * ab.qs[4 * c + k] as i32;
                    isum += (q >> 4) as i32 * ab.qs[16 + 4 * c + k] as i32;
                }
            }
            sum += isum as f32 * (d * sc as f32 * ab.d) - dmin * mn as f32 * ab.s;
        }
    }
    sum
}

/// The scaled sums of an activation block's two halves:
/// `(d * sum(qs[..16]), d * sum(qs[16..]))`, which Q6_K's `- 32` offset
/// meets (its scales change every 16 weights).
#[inline]
pub fn half_sums(ab: &BlockQ8A) -> [f32; 2] {
    let lo: i32 = ab.qs[..16].iter().map(|&v| v as i32).sum();
    let hi: i32 = ab.qs[16..].iter().map(|&v| v as i32).sum();
    [ab.d * lo as f32, ab.d * hi as f32]
}

/// Integer dot of row `lane` of an interleaved Q6_K group with one
/// quantised activation row: per 16 weights `d sc (da isum - 32 s16)`
/// with the unsigned 6-bit values, as the VNNI kernel folds them.
pub fn dot_q6_kx8_q8a(group: &[u8], lane: usize, a: &[BlockQ8A]) -> f32 {
    let mut sum = 0f32;
    for (o, ab8) in group.chunks_exact(Q6_KX8_BYTES).zip(a.chunks_exact(8)) {
        let d = f16_at(o, 2 * lane);
        for (s, ab) in ab8.iter().enumerate() {
            let halves = half_sums(ab);
            for (h, hs) in halves.iter().enumerate() {
                let dw = d * (o[16 + 8 * (2 * s + h) + lane] as i8) as f32;
                let isum: i32 = (16 * h..16 * h + 16)
                    .map(|i| q6_kx8_value(o, lane, s, i) as i32 * ab.qs[i] as i32)
                    .sum();
                sum += isum as f32 * (dw * ab.d) + dw * (-32.0 * hs);
            }
        }
    }
    sum
}

/// Integer dot of one Q8_0 row with one quantised activation row.
pub fn dot_q8_0_q8a(w: &[u8], a: &[BlockQ8A]) -> f32 {
    let mut sum = 0f32;
    for (wb, ab) in w.chunks_exact(Q8_0_BYTES).zip(a) {
        let d = f16_at(wb, 0);
        let mut isum = 0i32;
        for j in 0..32 {
            isum += (wb[2 + j] as i8) as i32 * ab.qs[j] as i32;
        }
        sum += d * ab.d * isum as f32;
    }
    sum
}

/// f32 dot product.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: the same association as the AVX2 version, and it vectorises.
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += ca[i] * cb[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

pub(super) fn q4_1x8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    let nb = x.k / QK;
    let gb = nb * Q4_1X8_BYTES;
    for r in rows {
        let g = &w[r / 8 * gb..(r / 8 + 1) * gb];
        for t in 0..x.t {
            out.put(t, r, dot_q4_1x8_q8a(g, r % 8, &x.q[t * nb..(t + 1) * nb]));
        }
    }
}

pub(super) fn q8_0x8_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    let nb = x.k / QK;
    let gb = nb * Q8_0X8_BYTES;
    for r in rows {
        let g = &w[r / 8 * gb..(r / 8 + 1) * gb];
        for t in 0..x.t {
            out.put(t, r, dot_q8_0x8_q8a(g, r % 8, &x.q[t * nb..(t + 1) * nb]));
        }
    }
}

/// Rows of an interleaved K-quant matrix (`bytes` per group super-block)
/// through `dot`, the reference for the VNNI kernels.
pub(super) fn kx8_rows(
    w: &[u8],
    bytes: usize,
    dot: fn(&[u8], usize, &[BlockQ8A]) -> f32,
    x: &Acts<'_>,
    rows: Range<usize>,
    out: OutPtr,
) {
    let nb = x.k / QK;
    let gb = x.k / QK_K * bytes;
    for r in rows {
        let g = &w[r / 8 * gb..(r / 8 + 1) * gb];
        for t in 0..x.t {
            out.put(t, r, dot(g, r % 8, &x.q[t * nb..(t + 1) * nb]));
        }
    }
}

pub(super) fn q8_0_rows(w: &[u8], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    let nb = x.k / QK;
    let rb = nb * Q8_0_BYTES;
    for r in rows {
        let wr = &w[r * rb..(r + 1) * rb];
        for t in 0..x.t {
            out.put(t, r, dot_q8_0_q8a(wr, &x.q[t * nb..(t + 1) * nb]));
        }
    }
}

pub(super) fn f32_rows(w: &[f32], x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    for r in rows {
        let wr = &w[r * x.k..(r + 1) * x.k];
        for t in 0..x.t {
            out.put(t, r, dot_f32(wr, &x.f[t * x.k..(t + 1) * x.k]));
        }
    }
}

thread_local! {
    /// One dequantised weight row per thread, reused across calls.
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn exact_rows(w: &QMatrix, x: &Acts<'_>, rows: Range<usize>, out: OutPtr) {
    ROW.with(|row| {
        let mut row = row.borrow_mut();
        row.resize(w.cols, 0.0);
        for r in rows {
            w.dequantize_row(r, &mut row);
            for t in 0..x.t {
                // f64 accumulation: this path is the tight reference.
                let xr = &x.f[t * x.k..(t + 1) * x.k];
                let s: f64 = row.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                out.put(t, r, s as f32);
            }
        }
    });
}
