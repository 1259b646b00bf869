// Flotilla CUDA kernels: writing into and copying the paged KV cache.
//
// The cache is f16 (unsigned short bit patterns) or int8, block-major; one
// block holds every layer's K and V for block_size positions. Element offset of
// (block b, layer l, kv 0=K/1=V, kv head h, slot s, dim d):
//   b*block_elems + (((l*2 + kv)*n_head_kv + h)*block_size + s)*head_dim + d,
//   block_elems = n_layer*2*n_head_kv*block_size*head_dim.
// Position p of sequence i lives in block block_tables[i*max_blocks + p/block_size],
// slot p % block_size. Token rows of qkv (f32) are [q | k | v], as in rope.cu.
//
// int8 (KvDtype::Int8, as llama.cpp's q8_0): every run of block_size rows of
// one (block, layer, K|V, kv head), whose element offset `run` is given by the
// formula above at slot 0, starts at byte run + run/16 and holds the rows'
// values (block_size*head_dim signed bytes, [slot][d]) and then their scales
// (block_size*head_dim/32 f16, [slot][group]): value = scale * q, scale =
// max|x| / 127 over each 32 values, q = round(x / scale) in [-127, 127].
// head_dim must be a multiple of 32. The CPU backend (crates/model/src/kvcache.rs)
// stores exactly these bytes. Where head_dim is a multiple of 64, the rows an
// int8 cache holds are rotated first (hadamard_rows below): each head's K by
// the Hadamard matrix of the largest power of two dividing head_dim (and each
// query head by the same, so q.k is unchanged), each V by that of size 64 (and
// the attention output back by it), so that a few large key channels do not
// set the scale of every value beside them (kvcache.rs, int8_rotations).

__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Stores this layer's K and V of every token into the token's cache slot.
// Launch: grid = (n_tokens), block = (128 or 256).
extern "C" __global__ void kv_append(const float* qkv, unsigned short* kv, const int* tok_seq,
                                     const int* tok_pos, const int* block_tables,
                                     int max_blocks, int n_tokens, int layer, int n_layer,
                                     int n_head, int n_head_kv, int head_dim,
                                     int block_size) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int kv_dim = n_head_kv * head_dim;
    const size_t qkv_w = (size_t)(n_head + 2 * n_head_kv) * head_dim;
    const float* k_src = qkv + (size_t)t * qkv_w + (size_t)n_head * head_dim;
    const float* v_src = k_src + kv_dim;

    const int p = tok_pos[t];
    const int block = block_tables[(size_t)tok_seq[t] * max_blocks + p / block_size];
    const int slot = p % block_size;
    const size_t block_elems = (size_t)n_layer * 2 * n_head_kv * block_size * head_dim;
    const size_t head_stride = (size_t)block_size * head_dim;  // one kv head's slots
    unsigned short* k_dst = kv + (size_t)block * block_elems +
                            (size_t)(layer * 2 + 0) * n_head_kv * head_stride +
                            (size_t)slot * head_dim;
    unsigned short* v_dst = k_dst + (size_t)n_head_kv * head_stride;

    for (int e = threadIdx.x; e < kv_dim; e += blockDim.x) {
        const int h = e / head_dim, d = e - h * head_dim;
        const size_t o = (size_t)h * head_stride + d;
        k_dst[o] = f32_to_f16_bits(k_src[e]);
        v_dst[o] = f32_to_f16_bits(v_src[e]);
    }
}

// Stores this layer's K and V of every token into the token's int8 cache slot,
// one thread per 32-value group (amax, scale, 32 values).
// Launch: grid = (n_tokens), block = (64 or 128).
extern "C" __global__ void kv_append_q8(const float* qkv, unsigned char* kv, const int* tok_seq,
                                        const int* tok_pos, const int* block_tables,
                                        int max_blocks, int n_tokens, int layer, int n_layer,
                                        int n_head, int n_head_kv, int head_dim,
                                        int block_size) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int kv_dim = n_head_kv * head_dim;
    const size_t qkv_w = (size_t)(n_head + 2 * n_head_kv) * head_dim;
    const float* k_src = qkv + (size_t)t * qkv_w + (size_t)n_head * head_dim;

    const int p = tok_pos[t];
    const int block = block_tables[(size_t)tok_seq[t] * max_blocks + p / block_size];
    const int slot = p % block_size;
    const size_t block_elems = (size_t)n_layer * 2 * n_head_kv * block_size * head_dim;
    const size_t head_stride = (size_t)block_size * head_dim;
    const int groups = head_dim / 32;
    // Groups of K (kv = 0) then V (kv = 1), every head.
    for (int e = threadIdx.x; e < 2 * kv_dim / 32; e += blockDim.x) {
        const int kvi = e / (kv_dim / 32);
        const int r = e - kvi * (kv_dim / 32);
        const int h = r / groups, g = r - h * groups;
        const float* src = k_src + (size_t)kvi * kv_dim + (size_t)h * head_dim + 32 * g;
        const size_t run = (size_t)block * block_elems +
                           ((size_t)(layer * 2 + kvi) * n_head_kv + h) * head_stride;
        unsigned char* base = kv + run + run / 16;
        signed char* q = (signed char*)(base + (size_t)slot * head_dim + 32 * g);
        unsigned short* d = (unsigned short*)(base + head_stride) + (size_t)slot * groups + g;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(src[i]));
        const float scale = amax / 127.0f;
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        *d = f32_to_f16_bits(scale);
        for (int i = 0; i < 32; ++i) {
            q[i] = (signed char)fminf(127.0f, fmaxf(-127.0f, roundf(src[i] * inv)));
        }
    }
}

// Copies a whole block (all layers, K and V) from block src to block dst;
// block_elems counts 2-byte units (the block's bytes / 2, for every dtype).
// Launch: grid-stride; e.g. grid = (min(ceil(block_elems/8/256), 1024)), block = (256).
extern "C" __global__ void copy_block(unsigned short* kv, int src, int dst,
                                      long long block_elems) {
    const unsigned short* s = kv + (size_t)src * (size_t)block_elems;
    unsigned short* d = kv + (size_t)dst * (size_t)block_elems;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if ((block_elems & 7) == 0) {
        // 16-byte copies: every block starts 16-byte aligned when block_elems % 8 == 0
        // (device allocations are at least 256-byte aligned).
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)d;
        const size_t n4 = (size_t)block_elems / 8;
        for (size_t i = first; i < n4; i += stride) d4[i] = s4[i];
    } else {
        for (size_t i = first; i < (size_t)block_elems; i += stride) d[i] = s[i];
    }
}

// Rotates, in place, each n values of columns [col0, col0 + n_cols) of every
// row of x (rows of row_w floats) by the orthonormal Sylvester Hadamard matrix
// of size n (a power of two, 2 to 256): the CPU backend's butterflies
// (kvcache.rs, hadamard) stage by stage from stride 1 up, then one multiply by
// `scale` (1/sqrt(n), computed by the host as the CPU does), so both give the
// same bits.
// Launch: grid = (n_rows, n_cols / n), block = (n / 2).
extern "C" __global__ void hadamard_rows(float* x, int n_rows, int row_w, int col0, int n,
                                         float scale) {
    __shared__ float s[256];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    float* p = x + (size_t)r * row_w + col0 + (size_t)blockIdx.y * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = p[i];
    __syncthreads();
    for (int h = 1; h < n; h *= 2) {
        for (int k = threadIdx.x; k < n / 2; k += blockDim.x) {
            const int j = (k / h) * 2 * h + (k % h);
            const float a = s[j], b = s[j + h];
            s[j] = a + b;
            s[j + h] = a - b;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = s[i] * scale;
}
