// Flotilla CUDA kernels: greedy sampling on the device.
//
// Logits are f32, row-major [rows][vocab]. For each row the index of the
// largest logit (lowest index on ties; NaN never wins, as in the CPU sampler;
// a row with no value above -inf gives index 0) and that logit.
// Launch: grid = (n_rows), block = (1024; any multiple of 32 up to 1024).

// True when (v, i) beats (bv, bi): larger value, or equal value and lower index.
__device__ __forceinline__ bool better(float v, unsigned int i, float bv, unsigned int bi) {
    return v > bv || (v == bv && i < bi);
}

extern "C" __global__ void argmax_rows(const float* logits, int vocab, unsigned int* out_token,
                                       float* out_value) {
    __shared__ float val_s[32];
    __shared__ unsigned int idx_s[32];
    const float* row = logits + (size_t)blockIdx.x * (size_t)vocab;
    const float neg_inf = __int_as_float(0xff800000);
    float bv = neg_inf;
    unsigned int bi = 0xffffffffu;
    // Indices ascend within a thread, so a strict > keeps the first maximum;
    // -inf and NaN are never taken, so bi stays unset for a row of only those.
    // Four loads in flight per thread: one at a time, a 49k-entry row took
    // 73 us on an H200 (latency, not bandwidth).
    const int stride = blockDim.x;
    int i = threadIdx.x;
    for (; i + 3 * stride < vocab; i += 4 * stride) {
        const float v0 = row[i], v1 = row[i + stride], v2 = row[i + 2 * stride],
                    v3 = row[i + 3 * stride];
        if (v0 > bv) { bv = v0; bi = (unsigned int)i; }
        if (v1 > bv) { bv = v1; bi = (unsigned int)(i + stride); }
        if (v2 > bv) { bv = v2; bi = (unsigned int)(i + 2 * stride); }
        if (v3 > bv) { bv = v3; bi = (unsigned int)(i + 3 * stride); }
    }
    for (; i < vocab; i += stride) {
        const float v = row[i];
        if (v > bv) {
            bv = v;
            bi = (unsigned int)i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const unsigned int i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        val_s[warp] = bv;
        idx_s[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x >> 5;
        bv = lane < n_warps ? val_s[lane] : neg_inf;
        bi = lane < n_warps ? idx_s[lane] : 0xffffffffu;
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, bv, o);
            const unsigned int i = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        if (lane == 0) {
            out_token[blockIdx.x] = bi == 0xffffffffu ? 0u : bi;
            out_value[blockIdx.x] = bi == 0xffffffffu ? row[0] : bv;
        }
    }
}
