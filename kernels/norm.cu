// Flotilla CUDA kernels: RMSNorm with the residual add fused in front.
//
// Activations are f32, row-major [tokens][dim]; the normalised output is f16
// (stored as unsigned short bit patterns) for the following matmul.
// Launch: grid = (n_rows), block = (256 or 1024; any multiple of 32 up to 1024).

__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Sum of v over the whole block; every thread gets the result. Ends with a
// barrier, so the block may call it again straight away.
// blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_warps = blockDim.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < n_warps ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // every thread has read partial before a next call writes it
    return v;
}

// The residual add, then RMSNorm of the sum:
//   delta != null, delta_w == null: x[row] += delta[row]
//   delta != null, delta_w != null: x[row] += rmsnorm(delta[row]) * delta_w
//     (the block's post norm, e.g. Gemma's post_attention_norm / post_ffw_norm)
//   out != null: out[row] = f16(x[row] * rsqrt(mean(x[row]^2) + eps) * w)
// rmsnorm(v) = v * rsqrt(mean(v^2) + eps). With out == null (and w unused)
// the kernel is only the residual add, as after the last layer.
extern "C" __global__ void rms_norm_residual(float* x, const float* delta, const float* delta_w,
                                             const float* w, unsigned short* out, int dim,
                                             float eps) {
    const size_t base = (size_t)blockIdx.x * (size_t)dim;
    float* xr = x + base;
    float ss = 0.0f;
    if (delta != nullptr) {
        const float* dr = delta + base;
        float dinv = 1.0f;
        if (delta_w != nullptr) {
            float dss = 0.0f;
            for (int i = threadIdx.x; i < dim; i += blockDim.x) dss += dr[i] * dr[i];
            dinv = rsqrtf(block_sum(dss) / (float)dim + eps);
        }
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const float d = delta_w != nullptr ? dr[i] * dinv * delta_w[i] : dr[i];
            const float v = xr[i] + d;
            xr[i] = v;
            ss += v * v;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const float v = xr[i];
            ss += v * v;
        }
    }
    if (out == nullptr) return;
    const float inv = rsqrtf(block_sum(ss) / (float)dim + eps);
    // Each thread re-reads only the elements it wrote above.
    unsigned short* orow = out + base;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        orow[i] = f32_to_f16_bits(xr[i] * inv * w[i]);
    }
}
