// Flotilla CUDA kernels: causal attention over the paged KV cache.
//
// Reads Q from the fused QKV activations (f32 rows [q | k | v], see rope.cu) and
// K/V from the paged cache, f16 (paged_attention) or int8 with a scale per 32
// values (paged_attention_q8, read directly: no dequantised copy); layouts in
// kv.cu. A token's own K/V and those of
// the earlier positions it sees must already be in the cache. Writes
// out[t][h*head_dim + d] (f32, row width n_head*head_dim, which need not equal
// the model's residual width).
// Query head h reads KV head h / (n_head / n_head_kv) (grouped-query attention).
// The token at position p sees positions max(0, p + 1 - window)..=p when
// window > 0 (a sliding window: p - p0 < window), else 0..=p; only the cache
// blocks holding those positions are read. Scores are q.k * scale (the model's
// attention scale, not necessarily 1/sqrt(head_dim)).
//
// Launch: grid = (n_tokens, n_head), block = (128) — any multiple of 32 up to 256.
// Shared memory: static only (9,280 bytes); no dynamic shared memory.
// Requirements: head_dim even and <= 256 (64 and 128 are the common cases);
// a multiple of 32 for int8.

#define ATT_MAX_HEAD_DIM 256
#define ATT_MAX_WARPS 8
#define ATT_PAIRS_PER_LANE (ATT_MAX_HEAD_DIM / 64)  // dims per lane = 2 * this

__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Dot product of q (f32, shared memory) with one f16 cache row.
__device__ __forceinline__ float dot_row(const float* q, const unsigned short* k, int head_dim) {
    float acc = 0.0f;
    if ((head_dim & 7) == 0) {
        // Rows start at a multiple of head_dim elements, hence 16-byte aligned.
        const uint4* k4 = (const uint4*)k;
        for (int i = 0; i < head_dim / 8; ++i) {
            const uint4 u = k4[i];
            const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc += q[8 * i + 2 * j] * f16_bits_to_f32((unsigned short)(w[j] & 0xffffu));
                acc += q[8 * i + 2 * j + 1] * f16_bits_to_f32((unsigned short)(w[j] >> 16));
            }
        }
    } else {
        const unsigned int* k2 = (const unsigned int*)k;
        for (int i = 0; i < head_dim / 2; ++i) {
            const unsigned int w = k2[i];
            acc += q[2 * i] * f16_bits_to_f32((unsigned short)(w & 0xffffu));
            acc += q[2 * i + 1] * f16_bits_to_f32((unsigned short)(w >> 16));
        }
    }
    return acc;
}

// How the kernel reads one cache: a row's dot product with q, and a pair of
// a row's values. `run` is the element offset of a (block, layer, K|V, head)
// run at slot 0 (kv.cu).
struct F16Cache {
    const unsigned short* kv;
    __device__ __forceinline__ float dot(const float* q, size_t run, int slot, int head_dim,
                                         int) const {
        return dot_row(q, kv + run + (size_t)slot * head_dim, head_dim);
    }
    __device__ __forceinline__ float2 pair(size_t run, int slot, int pair, int head_dim,
                                           int) const {
        const unsigned int w =
            ((const unsigned int*)(kv + run + (size_t)slot * head_dim))[pair];
        return make_float2(f16_bits_to_f32((unsigned short)(w & 0xffffu)),
                           f16_bits_to_f32((unsigned short)(w >> 16)));
    }
};

struct Int8Cache {
    const unsigned char* kv;
    __device__ __forceinline__ const signed char* vals(size_t run, int slot,
                                                       int head_dim) const {
        return (const signed char*)(kv + run + run / 16 + (size_t)slot * head_dim);
    }
    __device__ __forceinline__ float scale(size_t run, int slot, int g, int head_dim,
                                           int block_size) const {
        const unsigned short* d =
            (const unsigned short*)(kv + run + run / 16 + (size_t)block_size * head_dim);
        return f16_bits_to_f32(d[(size_t)slot * (head_dim / 32) + g]);
    }
    __device__ __forceinline__ float dot(const float* q, size_t run, int slot, int head_dim,
                                         int block_size) const {
        const signed char* v = vals(run, slot, head_dim);
        float acc = 0.0f;
        for (int g = 0; g < head_dim / 32; ++g) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 32; ++i) s += q[32 * g + i] * (float)v[32 * g + i];
            acc += s * scale(run, slot, g, head_dim, block_size);
        }
        return acc;
    }
    __device__ __forceinline__ float2 pair(size_t run, int slot, int pair, int head_dim,
                                           int block_size) const {
        const signed char* v = vals(run, slot, head_dim);
        const float d = scale(run, slot, (2 * pair) / 32, head_dim, block_size);
        return make_float2(d * (float)v[2 * pair], d * (float)v[2 * pair + 1]);
    }
};

// One CTA per (token, query head). Each warp walks chunks of 32 positions from
// the window's first position (warp w takes chunks w, w + n_warps, ...): every
// lane scores one position of the chunk, then the warp accumulates the chunk's
// V rows with each lane owning dim pairs (2*(lane + 32*k), +1). The warps'
// partial (max, sum, acc) are merged at the end. Online softmax, f32 throughout.
template <typename Cache>
__device__ __forceinline__ void paged_attention_impl(
    float* out, const float* qkv, Cache cache, const int* tok_seq, const int* tok_pos,
    const int* block_tables, int max_blocks, int n_tokens, int layer, int n_layer, int n_head,
    int n_head_kv, int head_dim, int block_size, int window, float scale) {
    __shared__ __align__(16) float q_s[ATT_MAX_HEAD_DIM];
    __shared__ float acc_s[ATT_MAX_WARPS][ATT_MAX_HEAD_DIM];
    __shared__ float m_s[ATT_MAX_WARPS];
    __shared__ float l_s[ATT_MAX_WARPS];

    // Outside these limits the shared arrays would overflow: fail the launch.
    if (head_dim > ATT_MAX_HEAD_DIM || (head_dim & 1) || blockDim.x > 32 * ATT_MAX_WARPS ||
        (blockDim.x & 31)) {
        __trap();
    }
    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= n_tokens || h >= n_head) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    const int kvh = h / (n_head / n_head_kv);

    const size_t qkv_w = (size_t)(n_head + 2 * n_head_kv) * head_dim;
    const float* q = qkv + (size_t)t * qkv_w + (size_t)h * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) q_s[i] = q[i];
    __syncthreads();

    const int n_pos = tok_pos[t] + 1;  // causal: positions first..=tok_pos[t]
    const int first = window > 0 ? max(0, n_pos - window) : 0;
    const int* table = block_tables + (size_t)tok_seq[t] * max_blocks;
    const size_t block_elems = (size_t)n_layer * 2 * n_head_kv * block_size * head_dim;
    const size_t head_stride = (size_t)block_size * head_dim;
    const size_t k_head = (size_t)(layer * 2 + 0) * n_head_kv * head_stride + kvh * head_stride;
    const size_t v_head = k_head + (size_t)n_head_kv * head_stride;

    const float neg_inf = __int_as_float(0xff800000);
    float m = neg_inf;  // running max, uniform across the warp
    float l = 0.0f;     // this lane's share of the running sum
    float acc[ATT_PAIRS_PER_LANE][2];
#pragma unroll
    for (int k = 0; k < ATT_PAIRS_PER_LANE; ++k) acc[k][0] = acc[k][1] = 0.0f;

    for (int base = first + warp * 32; base < n_pos; base += n_warps * 32) {
        const int p = base + lane;
        int phys = 0;
        float s = neg_inf;
        if (p < n_pos) {
            phys = table[p / block_size];
            s = cache.dot(q_s, (size_t)phys * block_elems + k_head, p % block_size, head_dim,
                          block_size) *
                scale;
        }
        const float m_new = fmaxf(m, warp_max(s));  // finite: position base is valid
        const float corr = expf(m - m_new);  // 0 on the first chunk
        const float e = p < n_pos ? expf(s - m_new) : 0.0f;
        l = l * corr + e;
        m = m_new;
#pragma unroll
        for (int k = 0; k < ATT_PAIRS_PER_LANE; ++k) {
            acc[k][0] *= corr;
            acc[k][1] *= corr;
        }
        const int n_here = min(32, n_pos - base);
        for (int j = 0; j < n_here; ++j) {
            const float pj = __shfl_sync(0xffffffffu, e, j);
            const int bj = __shfl_sync(0xffffffffu, phys, j);
            const int pos_j = base + j;
            const size_t vrun = (size_t)bj * block_elems + v_head;
#pragma unroll
            for (int k = 0; k < ATT_PAIRS_PER_LANE; ++k) {
                const int pair = lane + 32 * k;
                if (2 * pair < head_dim) {
                    const float2 w = cache.pair(vrun, pos_j % block_size, pair, head_dim,
                                                block_size);
                    acc[k][0] += pj * w.x;
                    acc[k][1] += pj * w.y;
                }
            }
        }
    }

    // Merge the warps' partial results.
    l = warp_sum(l);
    if (lane == 0) {
        m_s[warp] = m;
        l_s[warp] = l;
    }
#pragma unroll
    for (int k = 0; k < ATT_PAIRS_PER_LANE; ++k) {
        const int pair = lane + 32 * k;
        if (2 * pair < head_dim) {
            acc_s[warp][2 * pair] = acc[k][0];
            acc_s[warp][2 * pair + 1] = acc[k][1];
        }
    }
    __syncthreads();

    float m_all = neg_inf;
    for (int w = 0; w < n_warps; ++w) m_all = fmaxf(m_all, m_s[w]);
    float l_all = 0.0f;
    for (int w = 0; w < n_warps; ++w) {
        // A warp that saw no position has m = -inf and contributes nothing.
        if (m_s[w] != neg_inf) l_all += l_s[w] * expf(m_s[w] - m_all);
    }
    const float inv = 1.0f / l_all;
    float* o = out + (size_t)t * n_head * head_dim + (size_t)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < n_warps; ++w) {
            if (m_s[w] != neg_inf) v += acc_s[w][d] * expf(m_s[w] - m_all);
        }
        o[d] = v * inv;
    }
}

extern "C" __global__ void paged_attention(float* out, const float* qkv, const unsigned short* kv,
                                           const int* tok_seq, const int* tok_pos,
                                           const int* block_tables, int max_blocks,
                                           int n_tokens, int layer, int n_layer, int n_head,
                                           int n_head_kv, int head_dim, int block_size,
                                           int window, float scale) {
    paged_attention_impl(out, qkv, F16Cache{kv}, tok_seq, tok_pos, block_tables, max_blocks,
                         n_tokens, layer, n_layer, n_head, n_head_kv, head_dim, block_size,
                         window, scale);
}

// The same over an int8 cache (head_dim a multiple of 32).
extern "C" __global__ void paged_attention_q8(float* out, const float* qkv,
                                              const unsigned char* kv, const int* tok_seq,
                                              const int* tok_pos, const int* block_tables,
                                              int max_blocks, int n_tokens, int layer,
                                              int n_layer, int n_head, int n_head_kv,
                                              int head_dim, int block_size, int window,
                                              float scale) {
    if (head_dim & 31) __trap();
    paged_attention_impl(out, qkv, Int8Cache{kv}, tok_seq, tok_pos, block_tables, max_blocks,
                         n_tokens, layer, n_layer, n_head, n_head_kv, head_dim, block_size,
                         window, scale);
}
