//! Block formats: GGUF dequantisation (the scalar reference for every type),
//! repacking into the two layouts the kernels run on, and 8-bit activations.
//!
//! Kernel layouts (see `kernels`):
//! - `Q4_1` blocks of 32: f16 scale `d`, f16 offset `m`, 16 bytes of nibbles;
//!   byte j holds element j (low nibble) and element j+16 (high nibble);
//!   value = d * q + m. Q4_0 (m = -8d, exact) and Q4_K (d = d*sc, m = -dmin*mn
//!   per 32-element sub-block, rounded once to f16) are repacked into it.
//! - `Q8_0` blocks of 32: f16 scale, 32 x i8; value = d * q. Q6_K is
//!   re-quantised into it (8 bits per weight instead of 6.56, lossy but small).
//! - F32 rows, for F32/F16/BF16 weights.

use half::{bf16, f16};

use flotilla_gguf::GgmlType;

/// Elements in one kernel block.
pub const QK: usize = 32;
/// Bytes in one Q4_1 block.
pub const Q4_1_BYTES: usize = 20;
/// Bytes in one Q8_0 block.
pub const Q8_0_BYTES: usize = 34;

#[inline]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantises `out.len()` elements of type `ty` from `src` (whole blocks).
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert_eq!(
        n as u64 % ty.block_elems(),
        0,
        "dequantize: length not a whole number of blocks"
    );
    let nb = n / ty.block_elems() as usize;
    assert!(
        src.len() >= nb * ty.block_bytes() as usize,
        "dequantize: source too short"
    );
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_at(src, 2 * i);
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (b, o) in src.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    o[j] = d * (b[2 + j] as i8) as f32;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (b, o) in src.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    o[j] = d * ((b[2 + j] & 0xF) as i32 - 8) as f32;
                    o[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, o) in src.chunks_exact(20).zip(out.chunks_exact_mut(32)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    o[j] = d * (b[4 + j] & 0xF) as f32 + m;
                    o[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (b, o) in src.chunks_exact(22).zip(out.chunks_exact_mut(32)) {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for j in 0..16 {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    o[j] = d * (((b[6 + j] & 0xF) as u32 | h0) as i32 - 16) as f32;
                    o[j + 16] = d * (((b[6 + j] >> 4) as u32 | h1) as i32 - 16) as f32;
                }
            }
        }
        GgmlType::Q4_K => {
            for (b, o) in src.chunks_exact(144).zip(out.chunks_exact_mut(256)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for sub in 0..8 {
                    let (sc, mn) = scale_min_k4(sub, scales);
                    let (dd, mm) = (d * sc as f32, dmin * mn as f32);
                    let q = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
                    let shift = 4 * (sub % 2);
                    for l in 0..32 {
                        o[32 * sub + l] = dd * ((q[l] >> shift) & 0xF) as f32 - mm;
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            for (b, o) in src.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
                let d = f16_at(b, 208);
                for half in 0..2 {
                    let ql = &b[64 * half..64 * half + 64];
                    let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                    let sc = &b[192 + 8 * half..192 + 8 * half + 8];
                    let y = &mut o[128 * half..128 * half + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
}

/// 6-bit scale and min of sub-block `j` of a Q4_K super-block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Repacks Q4_0 blocks into Q4_1 blocks (m = -8d; exact unless 8d overflows f16).
pub fn q4_0_to_q4_1(src: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(src.len() / 18 * 20);
    for b in src.chunks_exact(18) {
        let d = f16_at(b, 0);
        out.extend_from_slice(&b[0..2]);
        out.extend_from_slice(&f16::from_f32(-8.0 * d).to_bits().to_le_bytes());
        out.extend_from_slice(&b[2..18]);
    }
    out
}

/// Repacks Q5_0 blocks into Q8_0 blocks: the same scale and `q - 16` as
/// an i8, so the values are exactly the same.
pub fn q5_0_to_q8_0(src: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(src.len() / 22 * Q8_0_BYTES);
    for b in src.chunks_exact(22) {
        out.extend_from_slice(&b[0..2]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let mut q = [0i8; 32];
        for j in 0..16 {
            q[j] = (((b[6 + j] & 0xF) as u32 | (((qh >> j) & 1) << 4)) as i32 - 16) as i8;
            q[j + 16] =
                (((b[6 + j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4)) as i32 - 16) as i8;
        }
        out.extend(q.iter().map(|&v| v as u8));
    }
    out
}

/// Repacks Q4_K super-blocks into Q4_1 blocks (sub-block scale and min rounded to f16).
pub fn q4_k_to_q4_1(src: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(src.len() / 144 * 8 * 20);
    for b in src.chunks_exact(144) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let scales = &b[4..16];
        let qs = &b[16..144];
        for sub in 0..8 {
            let (sc, mn) = scale_min_k4(sub, scales);
            out.extend_from_slice(&f16::from_f32(d * sc as f32).to_bits().to_le_bytes());
            out.extend_from_slice(&f16::from_f32(-dmin * mn as f32).to_bits().to_le_bytes());
            let q = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
            let shift = 4 * (sub % 2);
            for j in 0..16 {
                let lo = (q[j] >> shift) & 0xF;
                let hi = (q[j + 16] >> shift) & 0xF;
                out.push(lo | (hi << 4));
            }
        }
    }
    out
}

/// Bytes of one 8-row group of one 32-column block in the interleaved Q4_1
/// layout: 8 f16 scales, 8 f16 offsets, then 4 x 32 bytes of nibbles.
pub const Q4_1X8_BYTES: usize = 160;

/// Repacks row-major Q4_1 blocks (`rows` x `cols`) into the interleaved layout
/// the kernels read: for each group of 8 rows and each block, the 8 scales,
/// the 8 offsets, then 4 chunks of 32 bytes in which chunk `j` holds bytes
/// `4j..4j+4` of each of the 8 rows (row r in bytes `4r..4r+4`). One 256-bit
/// load then feeds eight rows at once. Missing rows of the last group are zero.
pub fn repack_q4_1_x8(src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let nb = cols / QK;
    assert_eq!(
        src.len(),
        rows * nb * Q4_1_BYTES,
        "repack_q4_1_x8: size does not match the shape"
    );
    let groups = rows.div_ceil(8);
    let mut out = vec![0u8; groups * nb * Q4_1X8_BYTES];
    for r in 0..rows {
        let (g, lane) = (r / 8, r % 8);
        for b in 0..nb {
            let blk = &src[(r * nb + b) * Q4_1_BYTES..(r * nb + b + 1) * Q4_1_BYTES];
            let o = &mut out[(g * nb + b) * Q4_1X8_BYTES..(g * nb + b + 1) * Q4_1X8_BYTES];
            o[2 * lane..2 * lane + 2].copy_from_slice(&blk[0..2]);
            o[16 + 2 * lane..16 + 2 * lane + 2].copy_from_slice(&blk[2..4]);
            for j in 0..4 {
                o[32 + 32 * j + 4 * lane..32 + 32 * j + 4 * lane + 4]
                    .copy_from_slice(&blk[4 + 4 * j..8 + 4 * j]);
            }
        }
    }
    out
}

/// Bytes of one 8-row group of one 32-column block in the interleaved Q8_0
/// layout: 8 f16 scales, then 8 x 32 bytes of `q + 128` (unsigned).
pub const Q8_0X8_BYTES: usize = 272;

/// Repacks row-major Q8_0 blocks (`rows` x `cols`) into the interleaved layout
/// of the VNNI kernels: for each group of 8 rows and each block, the 8
/// scales, then 8 chunks of 32 bytes in which chunk `j` holds bytes
/// `4j..4j+4` of each of the 8 rows, each as `q + 128` (so a row is an
/// unsigned byte times `d` plus the offset `-128 d`, as Q4_1's `d q + m`).
/// Missing rows of the last group are zero (d = 0).
pub fn repack_q8_0_x8(src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let nb = cols / QK;
    assert_eq!(
        src.len(),
        rows * nb * Q8_0_BYTES,
        "repack_q8_0_x8: size does not match the shape"
    );
    let groups = rows.div_ceil(8);
    let mut out = vec![0x80u8; groups * nb * Q8_0X8_BYTES];
    for blk in out.chunks_exact_mut(Q8_0X8_BYTES) {
        blk[..16].fill(0);
    }
    for r in 0..rows {
        let (g, lane) = (r / 8, r % 8);
        for b in 0..nb {
            let blk = &src[(r * nb + b) * Q8_0_BYTES..(r * nb + b + 1) * Q8_0_BYTES];
            let o = &mut out[(g * nb + b) * Q8_0X8_BYTES..(g * nb + b + 1) * Q8_0X8_BYTES];
            o[2 * lane..2 * lane + 2].copy_from_slice(&blk[0..2]);
            for j in 0..8 {
                for k in 0..4 {
                    o[16 + 32 * j + 4 * lane + k] = blk[2 + 4 * j + k] ^ 0x80;
                }
            }
        }
    }
    out
}

/// Dequantises row `r` of an interleaved Q8_0 matrix of width `cols`.
pub fn dequantize_q8_0_x8_row(data: &[u8], cols: usize, r: usize, out: &mut [f32]) {
    let nb = cols / QK;
    let (g, lane) = (r / 8, r % 8);
    for b in 0..nb {
        let o = &data[(g * nb + b) * Q8_0X8_BYTES..(g * nb + b + 1) * Q8_0X8_BYTES];
        let d = f16_at(o, 2 * lane);
        for j in 0..8 {
            for k in 0..4 {
                let q = (o[16 + 32 * j + 4 * lane + k] ^ 0x80) as i8;
                out[b * QK + 4 * j + k] = d * q as f32;
            }
        }
    }
}

/// Dequantises row `r` of an interleaved Q4_1 matrix of width `cols`.
pub fn dequantize_q4_1_x8_row(data: &[u8], cols: usize, r: usize, out: &mut [f32]) {
    let nb = cols / QK;
    let (g, lane) = (r / 8, r % 8);
    for b in 0..nb {
        let o = &data[(g * nb + b) * Q4_1X8_BYTES..(g * nb + b + 1) * Q4_1X8_BYTES];
        let (d, m) = (f16_at(o, 2 * lane), f16_at(o, 16 + 2 * lane));
        let y = &mut out[b * QK..(b + 1) * QK];
        for j in 0..4 {
            for k in 0..4 {
                let q = o[32 + 32 * j + 4 * lane + k];
                y[4 * j + k] = d * (q & 0xF) as f32 + m;
                y[16 + 4 * j + k] = d * (q >> 4) as f32 + m;
            }
        }
    }
}

/// Weights in one K-quant super-block.
pub const QK_K: usize = 256;

/// Bytes of one 8-row group of one 256-column super-block in the
/// interleaved Q4_K layout: exactly the file's 8 x 144 (4.5 bits a weight).
/// `[0, 16)` the rows' f16 `d`, `[16, 32)` their f16 `dmin`; `[32, 128)`
/// sub-block `j`'s 6-bit scales and mins in 12 bytes at `32 + 12j` (byte
/// `r` of the first 8: row r's low 4 bits of the scale, and of the min
/// above them; then a u32 whose bits `2r` hold the scale's top 2 bits and
/// bits `16 + 2r` the min's); `[128, 1152)` sub-block `j`'s nibbles at
/// `128 + 128j` as [`repack_q4_1_x8`]'s four 32-byte chunks (a byte holds
/// weight `i` low and weight `i + 16` high).
pub const Q4_KX8_BYTES: usize = 1152;

/// Bytes of one 8-row group of one 256-column super-block in the
/// interleaved Q6_K layout: exactly the file's 8 x 210 (6.5625 bits a
/// weight). `[0, 16)` the rows' f16 `d`; `[16, 144)` the 16 sub-blocks'
/// i8 scales, 8 bytes (one a row) at `16 + 8k`; `[144, 1168)` the low 4
/// bits of 32-block `s`'s weights at `144 + 128s` as [`repack_q4_1_x8`]'s
/// nibbles; `[1168, 1680)` their top 2 bits at `1168 + 64s`, two 32-byte
/// planes whose byte `4r + m` holds, for row r, chunk `c = 2 * plane + p`:
/// weight `4c + m`'s bits at `4p` and weight `16 + 4c + m`'s at `4p + 2`.
pub const Q6_KX8_BYTES: usize = 1680;

/// Row `r`'s super-block `sb` of a row-major K-quant tensor of `nsb`
/// super-blocks a row, `bb` bytes each.
fn k_block(src: &[u8], r: usize, sb: usize, nsb: usize, bb: usize) -> &[u8] {
    &src[(r * nsb + sb) * bb..(r * nsb + sb + 1) * bb]
}

/// Writes the 32 4-bit values `q` of one row's sub-block as
/// [`repack_q4_1_x8`]'s nibble chunks at `o` (128 bytes, row `lane`).
fn put_nibbles(o: &mut [u8], lane: usize, q: &[u8; 32]) {
    for i in 0..16 {
        let (c, k) = (i / 4, i % 4);
        o[32 * c + 4 * lane + k] = (q[i] & 0xF) | ((q[i + 16] & 0xF) << 4);
    }
}

/// Repacks row-major Q4_K super-blocks (`rows` x `cols`, `cols` a multiple
/// of 256) into [`Q4_KX8_BYTES`] groups: the same bits rearranged, so
/// every weight dequantises to the file's value. Missing rows of the last
/// group are zero.
pub fn repack_q4_k_x8(src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let nsb = cols / QK_K;
    assert!(
        cols.is_multiple_of(QK_K) && src.len() == rows * nsb * 144,
        "repack_q4_k_x8: size does not match the shape"
    );
    let mut out = vec![0u8; rows.div_ceil(8) * nsb * Q4_KX8_BYTES];
    for r in 0..rows {
        let (g, lane) = (r / 8, r % 8);
        for sb in 0..nsb {
            let b = k_block(src, r, sb, nsb, 144);
            let o = &mut out[(g * nsb + sb) * Q4_KX8_BYTES..(g * nsb + sb + 1) * Q4_KX8_BYTES];
            o[2 * lane..2 * lane + 2].copy_from_slice(&b[0..2]);
            o[16 + 2 * lane..16 + 2 * lane + 2].copy_from_slice(&b[2..4]);
            for j in 0..8 {
                let (sc, mn) = scale_min_k4(j, &b[4..16]);
                let s = &mut o[32 + 12 * j..44 + 12 * j];
                s[lane] = (sc & 0xF) | ((mn & 0xF) << 4);
                let mut hi = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
                hi |= ((sc >> 4) as u32) << (2 * lane) | ((mn >> 4) as u32) << (16 + 2 * lane);
                s[8..12].copy_from_slice(&hi.to_le_bytes());
                let qs = &b[16 + 32 * (j / 2)..48 + 32 * (j / 2)];
                let q: [u8; 32] = std::array::from_fn(|l| (qs[l] >> (4 * (j % 2))) & 0xF);
                put_nibbles(&mut o[128 + 128 * j..256 + 128 * j], lane, &q);
            }
        }
    }
    out
}

/// Row `lane`'s 6-bit scale and min of sub-block `j` in one
/// [`Q4_KX8_BYTES`] group super-block.
pub fn q4_kx8_scale_min(o: &[u8], lane: usize, j: usize) -> (u8, u8) {
    let s = &o[32 + 12 * j..44 + 12 * j];
    let hi = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    (
        (s[lane] & 0xF) | ((((hi >> (2 * lane)) & 3) as u8) << 4),
        (s[lane] >> 4) | ((((hi >> (16 + 2 * lane)) & 3) as u8) << 4),
    )
}

/// Dequantises row `r` of an interleaved Q4_K matrix of width `cols`: the
/// file's arithmetic (`d * sc * q - dmin * m` in f32), so the same bits.
pub fn dequantize_q4_kx8_row(data: &[u8], cols: usize, r: usize, out: &mut [f32]) {
    let nsb = cols / QK_K;
    let (g, lane) = (r / 8, r % 8);
    for sb in 0..nsb {
        let o = &data[(g * nsb + sb) * Q4_KX8_BYTES..(g * nsb + sb + 1) * Q4_KX8_BYTES];
        let (d, dmin) = (f16_at(o, 2 * lane), f16_at(o, 16 + 2 * lane));
        for j in 0..8 {
            let (sc, mn) = q4_kx8_scale_min(o, lane, j);
            let (dd, mm) = (d * sc as f32, dmin * mn as f32);
            let y = &mut out[sb * QK_K + 32 * j..sb * QK_K + 32 * j + 32];
            for c in 0..4 {
                for k in 0..4 {
                    let q = o[128 + 128 * j + 32 * c + 4 * lane + k];
                    y[4 * c + k] = dd * (q & 0xF) as f32 - mm;
                    y[16 + 4 * c + k] = dd * (q >> 4) as f32 - mm;
                }
            }
        }
    }
}

/// The 256 unsigned 6-bit values (`q + 32`) of one Q6_K super-block, in
/// weight order.
fn q6_k_values(b: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let y = &mut q[128 * half..128 * half + 128];
        for l in 0..32 {
            y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    q
}

/// Repacks row-major Q6_K super-blocks (`rows` x `cols`, `cols` a multiple
/// of 256) into [`Q6_KX8_BYTES`] groups: the same bits rearranged, so
/// every weight dequantises to the file's value. Missing rows of the last
/// group are zero.
pub fn repack_q6_k_x8(src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let nsb = cols / QK_K;
    assert!(
        cols.is_multiple_of(QK_K) && src.len() == rows * nsb * 210,
        "repack_q6_k_x8: size does not match the shape"
    );
    let mut out = vec![0u8; rows.div_ceil(8) * nsb * Q6_KX8_BYTES];
    for r in 0..rows {
        let (g, lane) = (r / 8, r % 8);
        for sb in 0..nsb {
            let b = k_block(src, r, sb, nsb, 210);
            let o = &mut out[(g * nsb + sb) * Q6_KX8_BYTES..(g * nsb + sb + 1) * Q6_KX8_BYTES];
            o[2 * lane..2 * lane + 2].copy_from_slice(&b[208..210]);
            for k in 0..16 {
                o[16 + 8 * k + lane] = b[192 + k];
            }
            let q = q6_k_values(b);
            for s in 0..8 {
                let qs: &[u8; 32] = q[32 * s..32 * s + 32].try_into().expect("32 values");
                put_nibbles(&mut o[144 + 128 * s..272 + 128 * s], lane, qs);
                for c in 0..4 {
                    let (plane, p) = (c / 2, c % 2);
                    for m in 0..4 {
                        let at = 1168 + 64 * s + 32 * plane + 4 * lane + m;
                        o[at] |= ((qs[4 * c + m] >> 4) << (4 * p))
                            | ((qs[16 + 4 * c + m] >> 4) << (4 * p + 2));
                    }
                }
            }
        }
    }
    out
}

/// Row `lane`'s unsigned 6-bit value (`q + 32`) of weight `i` (0..32) of
/// 32-block `s` in one [`Q6_KX8_BYTES`] group super-block.
pub fn q6_kx8_value(o: &[u8], lane: usize, s: usize, i: usize) -> u8 {
    let (hi, c, m) = (i / 16, (i % 16) / 4, i % 4);
    let nib = o[144 + 128 * s + 32 * c + 4 * lane + m];
    let low = if hi == 0 { nib & 0xF } else { nib >> 4 };
    let h = o[1168 + 64 * s + 32 * (c / 2) + 4 * lane + m] >> (4 * (c % 2) + 2 * hi);
    low | ((h & 3) << 4)
}

/// Dequantises row `r` of an interleaved Q6_K matrix of width `cols`: the
/// file's arithmetic (`d * sc * (q - 32)` in f32), so the same bits.
pub fn dequantize_q6_kx8_row(data: &[u8], cols: usize, r: usize, out: &mut [f32]) {
    let nsb = cols / QK_K;
    let (g, lane) = (r / 8, r % 8);
    for sb in 0..nsb {
        let o = &data[(g * nsb + sb) * Q6_KX8_BYTES..(g * nsb + sb + 1) * Q6_KX8_BYTES];
        let d = f16_at(o, 2 * lane);
        for s in 0..8 {
            for i in 0..32 {
                let sc = o[16 + 8 * (2 * s + i / 16) + lane] as i8;
                let q = q6_kx8_value(o, lane, s, i) as i32 - 32;
                out[sb * QK_K + 32 * s + i] = d * sc as f32 * q as f32;
            }
        }
    }
}

/// Q6_K blocks as Q8_0: each super-block of 256 dequantised and quantised
/// again per 32, one at a time (the same bytes as dequantising the whole
/// tensor and [`quantize_q8_0`], without an f32 copy of it: a 151,936 x
/// 1,536 embedding would take 933 MB).
pub fn q6_k_to_q8_0(src: &[u8]) -> Vec<u8> {
    let bb = GgmlType::Q6_K.block_bytes() as usize;
    let mut out = Vec::with_capacity(src.len() / bb * 8 * 34);
    let (mut f, mut q) = ([0f32; 256], [0i8; 32]);
    for b in src.chunks_exact(bb) {
        dequantize(GgmlType::Q6_K, b, &mut f);
        for x in f.chunks_exact(32) {
            let d = quantize_q8_0_group(x, &mut q);
            out.extend_from_slice(&d.to_bits().to_le_bytes());
            out.extend(q.iter().map(|&v| v as u8));
        }
    }
    out
}

/// Quantises f32 values (a whole number of 32-blocks) into Q8_0 blocks.
pub fn quantize_q8_0(src: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(src.len() / 32 * 34);
    let mut q = [0i8; 32];
    for x in src.chunks_exact(32) {
        let d = quantize_q8_0_group(x, &mut q);
        out.extend_from_slice(&d.to_bits().to_le_bytes());
        out.extend(q.iter().map(|&v| v as u8));
    }
    out
}

/// One Q8_0 group: `x` (32 values) as `q = round(x / d)` in [-127, 127]
/// with `d = max|x| / 127`, returned as the f16 it is stored as. The Q8_0
/// weights and the int8 KV cache quantise with this one routine.
pub fn quantize_q8_0_group(x: &[f32], q: &mut [i8]) -> f16 {
    debug_assert!(x.len() == QK && q.len() == QK);
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
    f16::from_f32(d)
}

/// One block of 32 activations quantised to 8 bits, with its scale and the
/// scaled sum that the Q4_1 offset term needs.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8A {
    /// Scale: value = d * q.
    pub d: f32,
    /// d * sum(q), so that sum(m * x) = m * s.
    pub s: f32,
    /// Quantised values in [-127, 127].
    pub qs: [i8; 32],
}

/// Quantises one row of activations (length a multiple of 32) into `out`.
pub fn quantize_row_q8a(x: &[f32], out: &mut [BlockQ8A]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::has_avx2() {
        // SAFETY: AVX2 and FMA presence checked at run time.
        unsafe { crate::kernels::avx2::quantize_row_q8a(x, out) };
        return;
    }
    quantize_row_q8a_scalar(x, out);
}

/// Portable version of [`quantize_row_q8a`].
pub fn quantize_row_q8a_scalar(x: &[f32], out: &mut [BlockQ8A]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in ob.qs.iter_mut().zip(xb) {
            // Ties to even, as the SIMD path rounds, so both give identical bytes.
            *q = (v * id).round_ties_even() as i8;
            sum += *q as i32;
        }
        ob.d = d;
        ob.s = d * sum as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    /// Random K-quant super-blocks with finite f16 scales at `d_at`.
    fn k_blocks(n: usize, bb: usize, d_at: &[usize], s: &mut u64) -> Vec<u8> {
        let mut src: Vec<u8> = (0..bb * n).map(|_| lcg(s) as u8).collect();
        for b in src.chunks_exact_mut(bb) {
            for &at in d_at {
                let v = (lcg(s) % 1000) as f32 / 1000.0 * 0.05 + 1e-3;
                b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        src
    }

    /// The interleaved K-quant layouts are the file's bits rearranged:
    /// every row dequantises to exactly the file's values (rows that do
    /// not fill the last group of 8 included), and they take the file's
    /// bytes, padding rows aside.
    #[test]
    fn k_quant_repacks_dequantise_to_the_file_s_bits() {
        let mut s = 23;
        for (rows, nsb) in [(13usize, 2usize), (8, 1), (3, 3)] {
            let cols = nsb * QK_K;
            type Repack = fn(&[u8], usize, usize) -> Vec<u8>;
            type Row = fn(&[u8], usize, usize, &mut [f32]);
            type Case<'a> = (GgmlType, usize, &'a [usize], Repack, Row, usize);
            let cases: [Case; 2] = [
                (
                    GgmlType::Q4_K,
                    144,
                    &[0, 2],
                    repack_q4_k_x8,
                    dequantize_q4_kx8_row,
                    Q4_KX8_BYTES,
                ),
                (
                    GgmlType::Q6_K,
                    210,
                    &[208],
                    repack_q6_k_x8,
                    dequantize_q6_kx8_row,
                    Q6_KX8_BYTES,
                ),
            ];
            for (ty, bb, d_at, repack, row, gb) in cases {
                let src = k_blocks(rows * nsb, bb, d_at, &mut s);
                let packed = repack(&src, rows, cols);
                assert_eq!(packed.len(), rows.div_ceil(8) * nsb * gb);
                assert_eq!(gb, 8 * bb, "{ty:?}: the file's size");
                let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
                for r in 0..rows {
                    dequantize(ty, &src[r * nsb * bb..(r + 1) * nsb * bb], &mut want);
                    row(&packed, cols, r, &mut got);
                    assert!(want.iter().any(|&v| v != 0.0));
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{ty:?} {rows}x{cols} row {r}");
                }
                // Padding rows dequantise to zero.
                if rows % 8 != 0 {
                    row(&packed, cols, rows, &mut got);
                    assert!(got.iter().all(|&v| v == 0.0), "{ty:?} padding row");
                }
            }
        }
    }

    /// Super-block by super-block gives the bytes of the whole tensor
    /// dequantised, then quantised.
    #[test]
    fn q6_k_to_q8_0_is_the_whole_tensor_s_requantisation() {
        let mut s = 11;
        let blocks = 5;
        let mut src: Vec<u8> = (0..210 * blocks).map(|_| lcg(&mut s) as u8).collect();
        for b in src.chunks_exact_mut(210) {
            // A finite f16 scale (the last two bytes): 0.01.
            b[208..].copy_from_slice(&f16::from_f32(0.01).to_bits().to_le_bytes());
        }
        let mut f = vec![0f32; 256 * blocks];
        dequantize(GgmlType::Q6_K, &src, &mut f);
        assert!(f.iter().any(|&v| v != 0.0));
        assert_eq!(q6_k_to_q8_0(&src), quantize_q8_0(&f));
    }

    #[test]
    fn q4_0_repack_is_exact() {
        let mut s = 7;
        let src: Vec<u8> = (0..18 * 8)
            .map(|i| {
                if i % 18 < 2 {
                    if i % 18 == 0 { 0x00 } else { 0x30 }
                } else {
                    lcg(&mut s) as u8
                }
            })
            .collect();
        let mut a = vec![0f32; 256];
        let mut b = vec![0f32; 256];
        dequantize(GgmlType::Q4_0, &src, &mut a);
        dequantize(GgmlType::Q4_1, &q4_0_to_q4_1(&src), &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn q5_0_repack_is_exact() {
        let mut s = 5;
        let mut src = vec![0u8; 22 * 3];
        for (i, v) in src.iter_mut().enumerate() {
            *v = lcg(&mut s) as u8;
            if i % 22 == 1 {
                *v = 0x2c;
            }
        }
        let mut a = vec![0f32; 96];
        let mut b = vec![0f32; 96];
        dequantize(GgmlType::Q5_0, &src, &mut a);
        dequantize(GgmlType::Q8_0, &q5_0_to_q8_0(&src), &mut b);
        assert_eq!(a, b);
        // Both ends of the 5-bit range occur.
        let d = f16_at(&src, 0);
        assert!(
            a[..32]
                .iter()
                .all(|v| (v / d).round() >= -16.0 && (v / d).round() <= 15.0)
        );
    }

    #[test]
    fn q4_k_repack_matches_dequantize() {
        let mut s = 11;
        let mut src = vec![0u8; 144 * 2];
        for (i, v) in src.iter_mut().enumerate() {
            *v = lcg(&mut s) as u8;
            // keep d and dmin modest, positive f16 values
            if i % 144 == 1 || i % 144 == 3 {
                *v = 0x2c;
            }
        }
        let mut a = vec![0f32; 512];
        let mut b = vec![0f32; 512];
        dequantize(GgmlType::Q4_K, &src, &mut a);
        dequantize(GgmlType::Q4_1, &q4_k_to_q4_1(&src), &mut b);
        // The sub-block scale and min are rounded once to f16 (relative error
        // <= 2^-11 each), so the error is bounded by the super-block's range.
        for (sa, sb) in a.chunks(256).zip(b.chunks(256)) {
            let range = sa.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (x, y) in sa.iter().zip(sb) {
                assert!((x - y).abs() <= 2e-3 * range, "{x} vs {y} (range {range})");
            }
        }
    }

    #[test]
    fn q8a_roundtrip_is_close() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.37)
            .collect();
        let mut q = vec![BlockQ8A::default(); 2];
        quantize_row_q8a(&x, &mut q);
        let mut r = vec![BlockQ8A::default(); 2];
        quantize_row_q8a_scalar(&x, &mut r);
        for (b, c) in q.iter().zip(&r) {
            assert_eq!(b.qs, c.qs);
            assert_eq!(b.d, c.d);
            assert!((b.s - c.s).abs() < 1e-5);
        }
        for (i, v) in x.iter().enumerate() {
            let b = &q[i / 32];
            assert!((b.d * b.qs[i % 32] as f32 - v).abs() <= b.d * 0.5 + 1e-6);
        }
    }
}
