//! This CPU's int8 multiply-add peak, measured: what the matrix kernels'
//! instruction (AMX `tdpbsud` on full tiles, VNNI `vpdpbusd` on 512-bit
//! registers, AVX2 `vpmaddubsw` + `vpmaddwd` on 256-bit ones) sustains when nothing but it runs, on every
//! thread at once. `bench-model` puts a prefill's multiply-adds beside it.

use super::Resolved;

/// Peak int8 operations per second (a multiply-add is two), in units of
/// 1e9, on `threads` threads with `kernel`'s instruction; `None` for the
/// scalar and exact kernels (they have no such instruction).
pub fn int8_peak_gops(kernel: Resolved, threads: usize) -> Option<f64> {
    let per_call: fn() -> (u64, f64) = match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY (of the calls below): resolved only where the CPU has it.
        Resolved::Avx512Vnni => || unsafe { vnni_loop() },
        #[cfg(target_arch = "x86_64")]
        Resolved::Amx => || unsafe { super::amx::peak_loop(ITERS / 64) },
        #[cfg(target_arch = "x86_64")]
        Resolved::Avx2 => || unsafe { avx2_loop() },
        _ => return None,
    };
    // One warm-up, then the best of three timed passes of every thread.
    let mut best = 0f64;
    for pass in 0..4 {
        let t = std::time::Instant::now();
        let ops: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads.max(1)).map(|_| s.spawn(per_call)).collect();
            hs.into_iter()
                .map(|h| {
                    h.join().map_or(0, |(ops, keep)| {
                        std::hint::black_box(keep);
                        ops
                    })
                })
                .sum()
        });
        let secs = t.elapsed().as_secs_f64();
        if pass > 0 {
            best = best.max(ops as f64 / secs / 1e9);
        }
    }
    Some(best)
}

const ITERS: u64 = 1 << 20;

/// 12 independent accumulators, one `vpdpbusd` each per iteration: 64
/// multiply-adds (128 operations) per instruction. Returns the operations
/// and a value derived from the sums (so they are kept).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn vnni_loop() -> (u64, f64) {
    use std::arch::x86_64::*;
    let a = _mm512_set1_epi8(3);
    let b = _mm512_set1_epi8(-2);
    let mut acc = [_mm512_setzero_si512(); 12];
    for _ in 0..ITERS {
        for x in acc.iter_mut() {
            *x = _mm512_dpbusd_epi32(*x, a, b);
        }
        std::hint::black_box(&mut acc);
    }
    let mut s = _mm512_setzero_si512();
    for x in acc {
        s = _mm512_add_epi32(s, x);
    }
    (ITERS * 12 * 128, _mm512_reduce_add_epi32(s) as f64)
}

/// 12 independent chains of `vpmaddubsw` (32 multiply-adds into i16) and
/// `vpmaddwd` (to i32) and an add, as the AVX2 kernels do: 64 operations
/// per pair.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_loop() -> (u64, f64) {
    use std::arch::x86_64::*;
    let a = _mm256_set1_epi8(3);
    let b = _mm256_set1_epi8(-2);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_si256(); 12];
    for _ in 0..ITERS {
        for x in acc.iter_mut() {
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones);
            *x = _mm256_add_epi32(*x, p);
        }
        std::hint::black_box(&mut acc);
    }
    let mut s = _mm256_setzero_si256();
    for x in acc {
        s = _mm256_add_epi32(s, x);
    }
    let mut out = [0i32; 8];
    // SAFETY: `out` holds the 32 bytes written.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, s) };
    (ITERS * 12 * 64, out.iter().map(|&v| v as f64).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the CPU has an int8 instruction the measure is a positive,
    /// finite rate; the scalar kernel has none.
    #[test]
    fn the_peak_is_measured_where_the_cpu_has_the_instruction() {
        assert_eq!(int8_peak_gops(Resolved::Scalar, 1), None);
        let k = super::super::Kernel::Auto.resolve();
        if k.avx2() {
            let g = int8_peak_gops(k, 1).unwrap();
            assert!(g.is_finite() && g > 1.0, "{g}");
        }
    }
}
