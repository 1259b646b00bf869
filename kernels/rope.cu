// Flotilla CUDA kernels: what happens to Q, K and V between the QKV matmul and
// the KV cache, in place: biases, per-head RMSNorm of Q and K (QK-norm), and
// rotary position embedding of Q and K.
//
// Each token row of the fused QKV activations (f32) is
// [q: n_head*head_dim][k: n_head_kv*head_dim][v: n_head_kv*head_dim],
// width qkv_w = (n_head + 2*n_head_kv)*head_dim. In order, per head:
//   1. bias (when bias != null; qkv_w floats laid out as the row): x += bias;
//      V heads get only this step;
//   2. QK-norm (when q_norm != null; q_norm and k_norm hold head_dim floats):
//      x = x * rsqrt(mean(x^2) + eps) * w, w = q_norm for Q heads, k_norm for K heads;
//   3. RoPE: pair i of head_dim/2 is rotated by pos * inv_freq[i], the pair being
//      (x[2i], x[2i+1]) ("normal", Llama/Mistral; neox == 0) or
//      (x[i], x[i + head_dim/2]) (NEOX, Qwen2/Gemma; neox != 0).
// inv_freq (f64, head_dim/2 values) is the layer's RoPE base already raised and
// divided by any frequency factors: base^(-2i/head_dim) / factor_i, computed on
// the host exactly as the CPU backend does. The angle is formed in double:
// positions reach tens of thousands, where a float angle loses several bits.
//
// Launch: grid = (n_tokens), block = (32 * n_warps), n_warps in 1..=32. The
// token's cos/sin go to shared memory once; then warp w takes heads
// w, w + n_warps, ... (a warp per head, so QK-norm reduces with shuffles).
// Shared memory: static only (4,096 bytes). Requirements: head_dim even, at
// most 1024.

#define ROPE_MAX_HALF 512

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void rope_qk(float* qkv, const float* bias, const float* q_norm,
                                   const float* k_norm, const double* inv_freq, const int* pos,
                                   int n_tokens, int n_head, int n_head_kv, int head_dim,
                                   int neox, float eps) {
    __shared__ float cos_s[ROPE_MAX_HALF];
    __shared__ float sin_s[ROPE_MAX_HALF];
    // Outside these limits the shared arrays would overflow: fail the launch.
    if (head_dim > 2 * ROPE_MAX_HALF || (head_dim & 1) || (blockDim.x & 31)) {
        __trap();
    }
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int half = head_dim / 2;
    const double p = (double)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double sd, cd;
        sincos(p * inv_freq[i], &sd, &cd);
        cos_s[i] = (float)cd;
        sin_s[i] = (float)sd;
    }
    __syncthreads();

    const size_t qkv_w = (size_t)(n_head + 2 * n_head_kv) * head_dim;
    float* row = qkv + (size_t)t * qkv_w;
    const int n_rot = n_head + n_head_kv;  // K heads follow the Q heads directly.
    const int n_heads = bias != nullptr ? n_rot + n_head_kv : n_rot;
    const int lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    for (int h = threadIdx.x >> 5; h < n_heads; h += n_warps) {
        float* x = row + (size_t)h * head_dim;
        const float* b = bias != nullptr ? bias + (size_t)h * head_dim : nullptr;
        if (h >= n_rot) {  // a V head: the bias only
            for (int j = lane; j < head_dim; j += 32) x[j] += b[j];
            continue;
        }
        const float* nw = q_norm == nullptr ? nullptr : (h < n_head ? q_norm : k_norm);
        // Lane l owns pairs l, l + 32, ...: it reads back only what it wrote.
        float inv = 1.0f;
        if (nw != nullptr) {
            float ss = 0.0f;
            for (int i = lane; i < half; i += 32) {
                const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
                float a = x[ia], c = x[ib];
                if (b != nullptr) {
                    a += b[ia];
                    c += b[ib];
                    x[ia] = a;
                    x[ib] = c;
                }
                ss += a * a + c * c;
            }
            inv = rsqrtf(warp_sum(ss) / (float)head_dim + eps);
        }
        for (int i = lane; i < half; i += 32) {
            const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
            float a = x[ia], c = x[ib];
            if (nw != nullptr) {
                a = a * inv * nw[ia];
                c = c * inv * nw[ib];
            } else if (b != nullptr) {
                a += b[ia];
                c += b[ib];
            }
            const float co = cos_s[i], si = sin_s[i];
            x[ia] = a * co - c * si;
            x[ib] = a * si + c * co;
        }
    }
}
