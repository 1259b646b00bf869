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

// Sum of v over the whole block; every thread gets the result.
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
    return v;
}

// x[row] += delta[row] (when delta is not null), then
// out[row] = f16(x[row] * rsqrt(mean(x[row]^2) + eps) * w).
extern "C" __global__ void rms_norm_residual(float* x, const float* delta, const float* w,
                                             unsigned short* out, int dim, float eps) {
    const size_t base = (size_t)blockIdx.x * (size_t)dim;
    float* xr = x + base;
    float ss = 0.0f;
    if (delta != nullptr) {
        const float* dr = delta + base;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const float v = xr[i] + dr[i];
            xr[i] = v;
            ss += v * v;
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const float v = xr[i];
            ss += v * v;
        }
    }
    const float inv = rsqrtf(block_sum(ss) / (float)dim + eps);
    // Each thread re-reads only the elements it wrote above.
    unsigned short* orow = out + base;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        orow[i] = f32_to_f16_bits(xr[i] * inv * w[i]);
    }
}
