//! Matrix products and attention primitives, with a portable scalar version
//! that the tests hold the SIMD versions against.
//!
//! Quantised weights multiply 8-bit activations ([`BlockQ8A`]) in integer
//! SIMD, as llama.cpp does; [`Kernel::Exact`] instead dequantises each weight
//! row to f32 and multiplies f32 activations, the reference path the golden
//! tests check tightly.

use std::ops::Range;
use std::sync::OnceLock;

use crate::quant::{
    self, BlockQ8A, Q4_1X8_BYTES, Q4_KX8_BYTES, Q6_KX8_BYTES, Q8_0_BYTES, Q8_0X8_BYTES, QK, QK_K,
};

#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod peak;
pub mod scalar;

/// Which implementation the matrix products use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Best SIMD for this CPU, chosen at run time: AMX, else AVX-512
    /// VNNI, else AVX2.
    Auto,
    /// AVX-512 VNNI, with AMX tiles for the products of many tokens
    /// (the same results to the bit).
    Amx,
    /// AVX-512 F/BW/VL + VNNI for the quantised products (AVX2 elsewhere).
    Avx512,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Portable scalar integer kernels (same arithmetic as the SIMD ones).
    Scalar,
    /// Weights dequantised to f32, activations kept f32: slow and exact.
    Exact,
}

impl Kernel {
    /// Every choice, by the name `--kernel` takes.
    pub const ALL: [(&'static str, Kernel); 6] = [
        ("auto", Kernel::Auto),
        ("amx", Kernel::Amx),
        ("avx512", Kernel::Avx512),
        ("avx2", Kernel::Avx2),
        ("scalar", Kernel::Scalar),
        ("exact", Kernel::Exact),
    ];

    /// Parses a `--kernel` name; the error lists the choices and says which
    /// ones this CPU cannot run.
    pub fn parse(name: &str) -> Result<Kernel, String> {
        let list = || {
            Kernel::ALL
                .iter()
                .map(|(n, k)| {
                    if k.supported() {
                        n.to_string()
                    } else {
                        format!("{n} (not on this CPU)")
                    }
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        match Kernel::ALL.iter().find(|(n, _)| *n == name) {
            Some((_, k)) if k.supported() => Ok(*k),
            Some(_) => Err(format!(
                "--kernel {name}: this CPU lacks the instructions; choose one of {}",
                list()
            )),
            None => Err(format!(
                "unknown --kernel '{name}': choose one of {}",
                list()
            )),
        }
    }

    /// Whether this CPU can run the choice.
    pub fn supported(self) -> bool {
        match self {
            Kernel::Amx => has_amx(),
            Kernel::Avx512 => has_avx512_vnni(),
            Kernel::Avx2 => has_avx2(),
            Kernel::Auto | Kernel::Scalar | Kernel::Exact => true,
        }
    }

    /// Resolves `Auto` to the best this CPU supports; a forced variant the
    /// CPU lacks falls back the same way (`supported` says so beforehand).
    pub fn resolve(self) -> Resolved {
        match self {
            Kernel::Exact => Resolved::Exact,
            Kernel::Scalar => Resolved::Scalar,
            Kernel::Amx | Kernel::Auto if has_amx() => Resolved::Amx,
            Kernel::Amx | Kernel::Avx512 | Kernel::Auto if has_avx512_vnni() => {
                Resolved::Avx512Vnni
            }
            Kernel::Amx | Kernel::Avx512 | Kernel::Avx2 | Kernel::Auto if has_avx2() => {
                Resolved::Avx2
            }
            Kernel::Amx | Kernel::Avx512 | Kernel::Avx2 | Kernel::Auto => Resolved::Scalar,
        }
    }
}

/// A concrete kernel choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolved {
    /// [`Resolved::Avx512Vnni`], with the products of at least
    /// [`amx::MIN_TOKENS`] tokens on AMX tiles (the same bits).
    Amx,
    /// AVX-512 VNNI for the quantised products, AVX2 for the rest.
    Avx512Vnni,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// Portable scalar.
    Scalar,
    /// Dequantise-to-f32 reference.
    Exact,
}

impl Resolved {
    /// Whether the AVX2 kernels (attention, norms, activations) may run.
    #[inline(always)]
    pub fn avx2(self) -> bool {
        matches!(self, Resolved::Avx2 | Resolved::Amx | Resolved::Avx512Vnni)
    }

    /// Whether the AVX-512 VNNI kernels (and their weight layouts) run.
    #[inline(always)]
    pub fn vnni(self) -> bool {
        matches!(self, Resolved::Amx | Resolved::Avx512Vnni)
    }

    /// Whether this kernel reads Q4_K and Q6_K at the file's size (the
    /// `Q4Kx8`/`Q6Kx8` layouts) at speed, so `CpuConfig::compact_k_quants`
    /// applies: AVX2, AVX-512 VNNI and AMX (which reads VNNI's layouts).
    #[inline(always)]
    pub fn reads_compact_k(self) -> bool {
        matches!(self, Resolved::Amx | Resolved::Avx512Vnni | Resolved::Avx2)
    }

    /// The kernel whose weight layouts this one reads (AMX reads the
    /// VNNI kernels'), which names a layout cache.
    pub fn layout(self) -> Resolved {
        match self {
            Resolved::Amx => Resolved::Avx512Vnni,
            k => k,
        }
    }
}

/// Whether this CPU and OS give this process AMX tiles (see [`amx::has_amx`]).
pub fn has_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        amx::has_amx()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this CPU has AVX-512 F, BW, VL and VNNI besides AVX2 (checked once).
pub fn has_avx512_vnni() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            has_avx2()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Whether this CPU has AVX2, FMA and F16C (checked once).
pub fn has_avx2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Weight bytes in a kernel layout.
pub enum WData {
    /// Q4_1 weights interleaved by groups of 8 rows (`quant::repack_q4_1_x8`).
    Q4_1x8(Bytes),
    /// Q8_0 blocks (34 bytes per 32 weights).
    Q8_0(Bytes),
    /// Q8_0 weights interleaved by groups of 8 rows as `q + 128`
    /// (`quant::repack_q8_0_x8`), for the VNNI kernels.
    Q8_0x8(Bytes),
    /// Q4_K super-blocks interleaved by groups of 8 rows at the file's
    /// size (`quant::repack_q4_k_x8`), for the VNNI kernels.
    Q4Kx8(Bytes),
    /// Q6_K super-blocks interleaved by groups of 8 rows at the file's
    /// size (`quant::repack_q6_k_x8`), for the VNNI kernels.
    Q6Kx8(Bytes),
    /// Plain f32, row-major.
    F32(Vec<f32>),
}

/// Either a view into the mapped model file or an owned buffer.
pub enum Bytes {
    /// Bytes `[start, start + len)` of a shared read-only map.
    Mapped {
        /// The map.
        map: std::sync::Arc<memmap2::Mmap>,
        /// First byte.
        start: usize,
        /// Length.
        len: usize,
    },
    /// Repacked bytes owned by the model.
    Owned(Vec<u8>),
}

impl Bytes {
    /// The bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, start, len } => &map[*start..*start + *len],
            Bytes::Owned(v) => v,
        }
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    #[inline]
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(v: Vec<u8>) -> Bytes {
        Bytes::Owned(v)
    }
}

/// A weight matrix: `rows` outputs by `cols` inputs, each row a run of blocks.
pub struct QMatrix {
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32 for quantised data).
    pub cols: usize,
    /// The weights.
    pub data: WData,
}

impl QMatrix {
    /// A copy of its first `n` rows (a multiple of 8, as the kernels'
    /// row groups are): a head that computes the logits of the first `n`
    /// tokens only. `None` where `n` or the layout does not allow it.
    pub fn first_rows(&self, n: usize) -> Option<QMatrix> {
        if n == 0 || n > self.rows || !n.is_multiple_of(8) || !self.rows.is_multiple_of(8) {
            return None;
        }
        // Every layout keeps each group of 8 rows contiguous, groups in
        // order: the first n rows are a prefix of the bytes.
        let prefix = |b: &Bytes| -> Option<Bytes> {
            let s = b.as_slice();
            s.len()
                .is_multiple_of(self.rows)
                .then(|| Bytes::Owned(s[..s.len() / self.rows * n].to_vec()))
        };
        let data = match &self.data {
            WData::F32(v) => WData::F32(v[..n * self.cols].to_vec()),
            WData::Q4_1x8(b) => WData::Q4_1x8(prefix(b)?),
            WData::Q8_0(b) => WData::Q8_0(prefix(b)?),
            WData::Q8_0x8(b) => WData::Q8_0x8(prefix(b)?),
            WData::Q4Kx8(b) => WData::Q4Kx8(prefix(b)?),
            WData::Q6Kx8(b) => WData::Q6Kx8(prefix(b)?),
        };
        QMatrix::try_new(n, self.cols, data)
    }

    /// Builds a matrix from row-major Q4_1 blocks, repacking them for the kernels.
    pub fn from_q4_1(rows: usize, cols: usize, blocks: &[u8]) -> QMatrix {
        QMatrix::new(
            rows,
            cols,
            WData::Q4_1x8(quant::repack_q4_1_x8(blocks, rows, cols).into()),
        )
    }

    /// [`QMatrix::new`], or `None` where the data's size does not match
    /// the shape (data read from a file).
    pub fn try_new(rows: usize, cols: usize, data: WData) -> Option<QMatrix> {
        let quantised = !matches!(data, WData::F32(_));
        let k_quant = matches!(data, WData::Q4Kx8(_) | WData::Q6Kx8(_));
        if (quantised && !cols.is_multiple_of(QK)) || (k_quant && !cols.is_multiple_of(QK_K)) {
            return None;
        }
        let (have, want) = match &data {
            WData::Q4_1x8(b) => (b.len(), rows.div_ceil(8) * (cols / QK) * Q4_1X8_BYTES),
            WData::Q8_0(b) => (b.len(), rows * (cols / QK) * Q8_0_BYTES),
            WData::Q8_0x8(b) => (b.len(), rows.div_ceil(8) * (cols / QK) * Q8_0X8_BYTES),
            WData::Q4Kx8(b) => (b.len(), rows.div_ceil(8) * (cols / QK_K) * Q4_KX8_BYTES),
            WData::Q6Kx8(b) => (b.len(), rows.div_ceil(8) * (cols / QK_K) * Q6_KX8_BYTES),
            WData::F32(v) => (v.len(), rows * cols),
        };
        (have == want).then(|| QMatrix::new(rows, cols, data))
    }

    /// Builds a matrix and checks that the byte size matches the shape.
    pub fn new(rows: usize, cols: usize, data: WData) -> QMatrix {
        let expect = match &data {
            WData::Q4_1x8(b) => (b.len(), rows.div_ceil(8) * cols / QK * Q4_1X8_BYTES),
            WData::Q8_0(b) => (b.as_slice().len(), rows * cols / QK * Q8_0_BYTES),
            WData::Q8_0x8(b) => (b.len(), rows.div_ceil(8) * cols / QK * Q8_0X8_BYTES),
            WData::Q4Kx8(b) => (b.len(), rows.div_ceil(8) * cols / QK_K * Q4_KX8_BYTES),
            WData::Q6Kx8(b) => (b.len(), rows.div_ceil(8) * cols / QK_K * Q6_KX8_BYTES),
            WData::F32(v) => (v.len(), rows * cols),
        };
        assert_eq!(
            expect.0, expect.1,
            "QMatrix {rows}x{cols}: data size does not match the shape"
        );
        if !matches!(data, WData::F32(_)) {
            assert_eq!(
                cols % QK,
                0,
                "quantised matrix width must be a multiple of 32"
            );
        }
        if matches!(data, WData::Q4Kx8(_) | WData::Q6Kx8(_)) {
            assert_eq!(
                cols % QK_K,
                0,
                "K-quant matrix width must be a multiple of 256"
            );
        }
        QMatrix { rows, cols, data }
    }

    /// Bytes the weights occupy.
    pub fn bytes(&self) -> usize {
        match &self.data {
            WData::Q4_1x8(b) => b.len(),
            WData::Q8_0(b) => b.as_slice().len(),
            WData::Q8_0x8(b) | WData::Q4Kx8(b) | WData::Q6Kx8(b) => b.len(),
            WData::F32(v) => v.len() * 4,
        }
    }

    /// Dequantises row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match &self.data {
            WData::Q4_1x8(b) => quant::dequantize_q4_1_x8_row(b, self.cols, r, out),
            WData::Q8_0(b) => {
                let rb = self.cols / QK * Q8_0_BYTES;
                quant::dequantize(
                    flotilla_gguf::GgmlType::Q8_0,
                    &b.as_slice()[r * rb..(r + 1) * rb],
                    out,
                )
            }
            WData::Q8_0x8(b) => quant::dequantize_q8_0_x8_row(b, self.cols, r, out),
            WData::Q4Kx8(b) => quant::dequantize_q4_kx8_row(b, self.cols, r, out),
            WData::Q6Kx8(b) => quant::dequantize_q6_kx8_row(b, self.cols, r, out),
            WData::F32(v) => out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]),
        }
    }
}

/// Activations of `t` tokens with `k` features: f32 rows and, for quantised
/// weights, their 8-bit blocks.
#[derive(Clone, Copy)]
pub struct Acts<'a> {
    /// Tokens (columns of the product).
    pub t: usize,
    /// Features per token.
    pub k: usize,
    /// `t * k` f32 values.
    pub f: &'a [f32],
    /// `t * k / 32` quantised blocks (may be empty when only F32/Exact kernels run).
    pub q: &'a [BlockQ8A],
}

/// A raw output pointer shared by the threads of one product; each thread
/// writes a disjoint set of (token, row) cells.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    /// First element.
    pub(crate) ptr: *mut f32,
    /// Elements in the buffer.
    pub(crate) len: usize,
    /// Distance between tokens, in elements.
    pub(crate) ld: usize,
    /// Column of row 0 within each token's run.
    pub(crate) off: usize,
}

// SAFETY: `OutPtr` is only used by `matmul_rows` callers that give each thread
// a disjoint row range; no two threads write the same element.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Points at `buf`, with tokens `ld` apart and rows starting at `off`.
    pub(crate) fn new(buf: &mut [f32], ld: usize, off: usize) -> OutPtr {
        OutPtr {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            ld,
            off,
        }
    }

    /// Writes `v[..n]` to token `t`, rows `r..r + n`.
    #[inline(always)]
    pub(crate) fn put_run(&self, t: usize, r: usize, v: &[f32]) {
        let i = t * self.ld + self.off + r;
        assert!(i + v.len() <= self.len);
        // SAFETY: in bounds (asserted); rows of one thread are disjoint from others'.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr.add(i), v.len()) };
    }

    /// Writes token `t`, row `r`.
    #[inline(always)]
    pub(crate) fn put(&self, t: usize, r: usize, v: f32) {
        let i = t * self.ld + self.off + r;
        debug_assert!(i < self.len);
        // SAFETY: i < len checked by the caller's shape assertion in
        // `matmul_rows` (t < acts.t, r < w.rows, off + rows <= ld).
        unsafe { *self.ptr.add(i) = v };
    }
}

/// Computes `out[t][off + r] = W[r] . x[t]` for rows `rows` and all tokens.
///
/// Crate-internal: `OutPtr` carries no lifetime, and callers guarantee that
/// concurrent calls write disjoint rows of a live buffer.
pub(crate) fn matmul_rows(
    kernel: Resolved,
    w: &QMatrix,
    x: &Acts<'_>,
    rows: Range<usize>,
    out: OutPtr,
) {
    assert_eq!(
        w.cols, x.k,
        "matmul: weight width {} != activation width {}",
        w.cols, x.k
    );
    assert!(rows.end <= w.rows && out.off + w.rows <= out.ld);
    assert!(
        x.t == 0 || (x.t - 1) * out.ld + out.off + w.rows <= out.len,
        "matmul: output too small"
    );
    if rows.is_empty() || x.t == 0 {
        return;
    }
    match (&w.data, kernel) {
        (_, Resolved::Exact) => scalar::exact_rows(w, x, rows, out),
        (WData::F32(v), Resolved::Scalar) => scalar::f32_rows(v, x, rows, out),
        (WData::Q4_1x8(b), Resolved::Scalar) => scalar::q4_1x8_rows(b, x, rows, out),
        (WData::Q8_0(b), Resolved::Scalar) => scalar::q8_0_rows(b.as_slice(), x, rows, out),
        // Only the VNNI kernels read this layout at speed (`maddubs` would
        // saturate on unsigned bytes up to 255); others get it only in tests.
        (WData::Q8_0x8(b), Resolved::Scalar | Resolved::Avx2) => {
            scalar::q8_0x8_rows(b, x, rows, out)
        }
        (WData::Q4Kx8(b), Resolved::Scalar) => {
            scalar::kx8_rows(b, Q4_KX8_BYTES, scalar::dot_q4_kx8_q8a, x, rows, out)
        }
        (WData::Q6Kx8(b), Resolved::Scalar) => {
            scalar::kx8_rows(b, Q6_KX8_BYTES, scalar::dot_q6_kx8_q8a, x, rows, out)
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q4Kx8(b), Resolved::Avx2) => {
            // SAFETY: Avx2 is only resolved when the CPU has AVX2, FMA and
            // F16C; shapes asserted inside.
            unsafe { avx2::q4_kx8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q6Kx8(b), Resolved::Avx2) => {
            // SAFETY: as above.
            unsafe { avx2::q6_kx8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q8_0x8(b), Resolved::Amx) if x.t >= amx::MIN_TOKENS && has_amx() => {
            // SAFETY: `has_amx` (asked here too, as `Resolved` is public: it
            // is what grants the process the tiles) implies AVX-512 VNNI;
            // shapes asserted inside.
            unsafe { amx::q8_0x8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q4_1x8(b), Resolved::Amx) if x.t >= amx::MIN_TOKENS && has_amx() => {
            // SAFETY: as above.
            unsafe { amx::q4_1x8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q4Kx8(b), Resolved::Avx512Vnni | Resolved::Amx) => {
            // SAFETY: as the other VNNI layouts.
            unsafe { avx512::q4_kx8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q6Kx8(b), Resolved::Avx512Vnni | Resolved::Amx) => {
            // SAFETY: as the other VNNI layouts.
            unsafe { avx512::q6_kx8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q8_0x8(b), Resolved::Avx512Vnni | Resolved::Amx) => {
            // SAFETY: Avx512Vnni is only resolved when the CPU has AVX-512
            // F/BW/VL/VNNI and AVX2; shapes asserted inside.
            unsafe { avx512::q8_0x8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q4_1x8(b), Resolved::Avx512Vnni | Resolved::Amx) => {
            // SAFETY: as above.
            unsafe { avx512::q4_1x8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::F32(v), Resolved::Avx2 | Resolved::Avx512Vnni | Resolved::Amx) => {
            // SAFETY: Avx2 is only resolved when the CPU has AVX2, FMA and F16C.
            unsafe { avx2::f32_rows(v, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q4_1x8(b), Resolved::Avx2) => {
            assert!(x.q.len() >= x.t * x.k / QK);
            // SAFETY: as above; shapes asserted.
            unsafe { avx2::q4_1x8_rows(b, x, rows, out) }
        }
        #[cfg(target_arch = "x86_64")]
        (WData::Q8_0(b), Resolved::Avx2 | Resolved::Avx512Vnni | Resolved::Amx) => {
            assert!(x.q.len() >= x.t * x.k / QK);
            // SAFETY: as above; shapes asserted.
            unsafe { avx2::q8_0_rows(b.as_slice(), x, rows, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        (_, Resolved::Avx2 | Resolved::Avx512Vnni | Resolved::Amx) => {
            unreachable!("x86 SIMD is never resolved off x86-64")
        }
    }
}

/// Dot product of two f32 vectors.
#[inline]
pub fn dot_f32(kernel: Resolved, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() && has_avx2() {
        // SAFETY: Avx2 resolved only with AVX2+FMA present.
        return unsafe { avx2::dot_f32(a, b) };
    }
    let _ = kernel;
    scalar::dot_f32(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_q8_0, quantize_row_q8a_scalar};

    use crate::testutil::rnd;

    fn q4_1_matrix(rows: usize, cols: usize, seed: &mut u64) -> QMatrix {
        let mut b = Vec::new();
        for _ in 0..rows * cols / 32 {
            let d = half::f16::from_f32(0.01 + rnd(seed).abs() * 0.05);
            let m = half::f16::from_f32(rnd(seed) * 0.2);
            b.extend_from_slice(&d.to_bits().to_le_bytes());
            b.extend_from_slice(&m.to_bits().to_le_bytes());
            for _ in 0..16 {
                b.push((rnd(seed).to_bits() >> 7) as u8);
            }
        }
        QMatrix::from_q4_1(rows, cols, &b)
    }

    /// `q8` (row-major Q8_0 blocks) in the VNNI kernels' interleaved layout.
    fn q8_0x8_matrix(q8: &[u8], rows: usize, cols: usize) -> QMatrix {
        QMatrix::new(
            rows,
            cols,
            WData::Q8_0x8(quant::repack_q8_0_x8(q8, rows, cols).into()),
        )
    }

    fn acts(t: usize, k: usize, seed: &mut u64) -> (Vec<f32>, Vec<BlockQ8A>) {
        let f: Vec<f32> = (0..t * k).map(|_| rnd(seed) * 3.0).collect();
        let mut q = vec![BlockQ8A::default(); t * k / 32];
        for (row, qrow) in f.chunks(k).zip(q.chunks_mut(k / 32)) {
            quantize_row_q8a_scalar(row, qrow);
        }
        (f, q)
    }

    fn run(kernel: Resolved, w: &QMatrix, x: &Acts<'_>) -> Vec<f32> {
        let mut out = vec![f32::NAN; x.t * (w.rows + 3)];
        let o = OutPtr::new(&mut out, w.rows + 3, 2);
        // two uneven row ranges, as two threads would take them
        let mid = w.rows / 3;
        matmul_rows(kernel, w, x, 0..mid, o);
        matmul_rows(kernel, w, x, mid..w.rows, o);
        out
    }

    fn check_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            if x.is_nan() && y.is_nan() {
                continue;
            }
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "{what}: element {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn simd_q4_1_matches_scalar_and_exact() {
        let mut s = 1;
        for &(rows, cols, t) in &[
            (7, 64, 1),
            (33, 96, 5),
            (64, 576, 9),
            (5, 32, 4),
            (16, 64, 70),
        ] {
            let w = q4_1_matrix(rows, cols, &mut s);
            let (f, q) = acts(t, cols, &mut s);
            let x = Acts {
                t,
                k: cols,
                f: &f,
                q: &q,
            };
            let sc = run(Resolved::Scalar, &w, &x);
            let ex = run(Resolved::Exact, &w, &x);
            // 8-bit activations: within a couple of percent of the f32 product's scale.
            let scale = ex
                .iter()
                .filter(|v| !v.is_nan())
                .fold(0f32, |a, v| a.max(v.abs()));
            for (a, b) in sc.iter().zip(&ex) {
                if !a.is_nan() {
                    assert!((a - b).abs() <= 0.02 * scale, "scalar {a} vs exact {b}");
                }
            }
            if has_avx2() {
                let av = run(Resolved::Avx2, &w, &x);
                check_close(&av, &sc, 1e-5, "avx2 q4_1 vs scalar");
            }
            if has_avx512_vnni() {
                let av = run(Resolved::Avx512Vnni, &w, &x);
                check_close(&av, &sc, 1e-5, "avx512 vnni q4_1 vs scalar");
            }
        }
    }

    #[test]
    fn simd_q8_0_and_f32_match_scalar() {
        let mut s = 2;
        for &(rows, cols, t) in &[(9, 64, 1), (17, 192, 6), (8, 32, 3), (24, 640, 70)] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| rnd(&mut s)).collect();
            let q8 = quantize_q8_0(&wf);
            let w8x8 = q8_0x8_matrix(&q8, rows, cols);
            let w8 = QMatrix::new(rows, cols, WData::Q8_0(Bytes::Owned(q8)));
            // The interleaved layout holds the same values.
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                w8.dequantize_row(r, &mut a);
                w8x8.dequantize_row(r, &mut b);
                assert_eq!(a, b, "row {r}");
            }
            let w32 = QMatrix::new(rows, cols, WData::F32(wf.clone()));
            let (f, q) = acts(t, cols, &mut s);
            let x = Acts {
                t,
                k: cols,
                f: &f,
                q: &q,
            };
            let sc8 = run(Resolved::Scalar, &w8, &x);
            check_close(
                &run(Resolved::Scalar, &w8x8, &x),
                &sc8,
                1e-5,
                "scalar q8_0x8 vs q8_0",
            );
            if has_avx512_vnni() {
                check_close(
                    &run(Resolved::Avx512Vnni, &w8x8, &x),
                    &sc8,
                    1e-5,
                    "avx512 vnni q8_0x8 vs scalar",
                );
            }
            let sc32 = run(Resolved::Scalar, &w32, &x);
            let ex32 = run(Resolved::Exact, &w32, &x);
            check_close(&sc32, &ex32, 1e-5, "scalar f32 vs exact");
            if has_avx2() {
                check_close(
                    &run(Resolved::Avx2, &w8, &x),
                    &sc8,
                    1e-5,
                    "avx2 q8_0 vs scalar",
                );
                check_close(
                    &run(Resolved::Avx2, &w32, &x),
                    &sc32,
                    1e-5,
                    "avx2 f32 vs scalar",
                );
            }
        }
    }

    /// The AVX-512 kernels take two 8-row groups per register, a last odd
    /// group paired with itself: a row gets the same bits whether its
    /// group is paired with the one before, the one after, or itself (so
    /// how threads split the rows never changes a result).
    #[test]
    fn avx512_rows_are_the_same_bits_however_groups_pair() {
        if !has_avx512_vnni() {
            return;
        }
        let mut s = 5;
        let (rows, cols, t) = (40, 128, 6);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd(&mut s)).collect();
        let q8 = quantize_q8_0(&wf);
        let matrices = [
            q4_1_matrix(rows, cols, &mut s),
            q8_0x8_matrix(&q8, rows, cols),
        ];
        let (f, q) = acts(t, cols, &mut s);
        let x = Acts {
            t,
            k: cols,
            f: &f,
            q: &q,
        };
        let k_cols = 2 * QK_K;
        let k_matrices = [
            k_matrix(false, rows, k_cols, &mut s),
            k_matrix(true, rows, k_cols, &mut s),
        ];
        let (kf, kq) = acts(t, k_cols, &mut s);
        let kx = Acts {
            t,
            k: k_cols,
            f: &kf,
            q: &kq,
        };
        let all = matrices
            .iter()
            .map(|w| (w, &x))
            .chain(k_matrices.iter().map(|w| (w, &kx)));
        for (w, x) in all {
            let x = *x;
            let mut pairs = vec![f32::NAN; t * rows];
            matmul_rows(
                Resolved::Avx512Vnni,
                w,
                &x,
                0..rows,
                OutPtr::new(&mut pairs, rows, 0),
            );
            // Groups 1+2, 3+4 (pairs shifted by one), group 0 with itself,
            // and every group with itself.
            let mut shifted = vec![f32::NAN; t * rows];
            let o = OutPtr::new(&mut shifted, rows, 0);
            matmul_rows(Resolved::Avx512Vnni, w, &x, 0..8, o);
            matmul_rows(Resolved::Avx512Vnni, w, &x, 8..rows, o);
            let mut single = vec![f32::NAN; t * rows];
            let o = OutPtr::new(&mut single, rows, 0);
            for g in 0..rows / 8 {
                matmul_rows(Resolved::Avx512Vnni, w, &x, g * 8..g * 8 + 8, o);
            }
            assert!(pairs.iter().all(|v| v.is_finite()));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&pairs), bits(&shifted));
            assert_eq!(bits(&pairs), bits(&single));
        }
    }

    /// A `rows` x `cols` Q4_K (`q6` false) or Q6_K matrix of random
    /// super-blocks with small finite f16 scales, in the VNNI layout.
    fn k_matrix(q6: bool, rows: usize, cols: usize, seed: &mut u64) -> QMatrix {
        let (bb, d_at): (usize, &[usize]) = if q6 { (210, &[208]) } else { (144, &[0, 2]) };
        let mut src: Vec<u8> = (0..rows * cols / QK_K * bb)
            .map(|_| (rnd(seed).to_bits() >> 9) as u8)
            .collect();
        for b in src.chunks_exact_mut(bb) {
            for &at in d_at {
                let d = half::f16::from_f32(0.002 + rnd(seed).abs() * 0.01);
                b[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
            }
        }
        let data = if q6 {
            WData::Q6Kx8(quant::repack_q6_k_x8(&src, rows, cols).into())
        } else {
            WData::Q4Kx8(quant::repack_q4_k_x8(&src, rows, cols).into())
        };
        QMatrix::new(rows, cols, data)
    }

    /// The K-quant layouts at the file's size: the scalar kernel is the
    /// f32 product within 8-bit activations' error, and the VNNI kernel
    /// is the scalar one within f32 rounding (its sums fold in another
    /// order), rows in groups that do not fill 16, tokens in and out of
    /// whole tiles.
    #[test]
    fn simd_k_quants_match_scalar_and_exact() {
        let mut s = 9;
        for q6 in [false, true] {
            for &(rows, cols, t) in &[(7, 256, 1), (40, 512, 5), (24, 768, 70)] {
                let w = k_matrix(q6, rows, cols, &mut s);
                let (f, q) = acts(t, cols, &mut s);
                let x = Acts {
                    t,
                    k: cols,
                    f: &f,
                    q: &q,
                };
                let sc = run(Resolved::Scalar, &w, &x);
                let ex = run(Resolved::Exact, &w, &x);
                let scale = ex
                    .iter()
                    .filter(|v| !v.is_nan())
                    .fold(0f32, |a, v| a.max(v.abs()));
                assert!(scale > 0.0);
                for (a, b) in sc.iter().zip(&ex) {
                    assert_eq!(a.is_nan(), b.is_nan());
                    if !a.is_nan() {
                        assert!(
                            (a - b).abs() <= 0.02 * scale,
                            "q6 {q6}: scalar {a} vs exact {b}"
                        );
                    }
                }
                for k in [Resolved::Avx2, Resolved::Avx512Vnni] {
                    if (k == Resolved::Avx2 && !has_avx2())
                        || (k == Resolved::Avx512Vnni && !has_avx512_vnni())
                    {
                        continue;
                    }
                    let v = run(k, &w, &x);
                    for (a, b) in v.iter().zip(&sc) {
                        assert_eq!(a.is_nan(), b.is_nan());
                        if !a.is_nan() {
                            assert!(
                                (a - b).abs() <= 1e-5 * scale,
                                "q6 {q6} {k:?}: {a} vs scalar {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The AMX kernels give the VNNI kernels' results to the bit: both
    /// layouts they read, token counts in and out of whole tiles (a last
    /// tile of 1 to 16 rows) and passes, row ranges that split a group
    /// pair and groups that do not fill one. Where CI names `amx` in
    /// `FLOTILLA_REQUIRE_KERNELS`, a CPU without it fails here.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn amx_is_vnni_to_the_bit() {
        let required = std::env::var("FLOTILLA_REQUIRE_KERNELS").unwrap_or_default();
        if !has_amx() {
            assert!(
                !required.split(',').any(|r| r.trim() == "amx"),
                "FLOTILLA_REQUIRE_KERNELS names amx, which this CPU or OS does not give"
            );
            eprintln!("no AMX on this CPU: not checked here");
            return;
        }
        assert_eq!(Kernel::Auto.resolve(), Resolved::Amx);
        let mut s = 11;
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for &(rows, cols) in &[(40, 64), (33, 576), (8, 1536), (24, 96)] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| rnd(&mut s)).collect();
            let q8 = quantize_q8_0(&wf);
            let matrices = [
                q4_1_matrix(rows, cols, &mut s),
                q8_0x8_matrix(&q8, rows, cols),
            ];
            for t in [1, 3, 4, 15, 16, 17, 40, 129, 300] {
                let (f, q) = acts(t, cols, &mut s);
                let x = Acts {
                    t,
                    k: cols,
                    f: &f,
                    q: &q,
                };
                for w in &matrices {
                    let vnni = run(Resolved::Avx512Vnni, w, &x);
                    assert!(vnni.iter().any(|v| v.is_finite()));
                    // Through the dispatch (AMX from MIN_TOKENS on) and
                    // straight into the tiles at every count.
                    assert_eq!(
                        bits(&run(Resolved::Amx, w, &x)),
                        bits(&vnni),
                        "{rows}x{cols} t {t}"
                    );
                    let mut out = vec![f32::NAN; t * (w.rows + 3)];
                    let o = OutPtr::new(&mut out, w.rows + 3, 2);
                    let mid = w.rows / 3;
                    for r in [0..mid, mid..w.rows] {
                        // SAFETY: has_amx checked above; shapes as matmul_rows asserts.
                        unsafe {
                            match &w.data {
                                WData::Q4_1x8(b) => amx::q4_1x8_rows(b, &x, r, o),
                                WData::Q8_0x8(b) => amx::q8_0x8_rows(b, &x, r, o),
                                _ => unreachable!(),
                            }
                        }
                    }
                    assert_eq!(bits(&out), bits(&vnni), "tiles: {rows}x{cols} t {t}");
                }
            }
        }
    }

    #[test]
    fn output_cells_outside_the_rows_are_untouched() {
        let mut s = 3;
        let w = q4_1_matrix(8, 64, &mut s);
        let (f, q) = acts(3, 64, &mut s);
        let x = Acts {
            t: 3,
            k: 64,
            f: &f,
            q: &q,
        };
        let out = run(Resolved::Scalar, &w, &x);
        for t in 0..3 {
            let row = &out[t * 11..t * 11 + 11];
            assert!(row[0].is_nan() && row[1].is_nan() && row[10].is_nan());
            assert!(row[2..10].iter().all(|v| v.is_finite()));
        }
    }
}
