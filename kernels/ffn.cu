// Flotilla CUDA kernels: elementwise pieces of the forward pass.
//
// Activations are f32, row-major [tokens][width]; matmul inputs and the token
// embedding table are f16 (unsigned short bit patterns).
// Elementwise kernels use grid-stride loops: any grid works, e.g.
// grid = (min(ceil(n/256), 65535)), block = (256). embed: grid = (n_tokens), block = (256).

__device__ __forceinline__ unsigned short f32_to_f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// out = f16(silu(gate) * up), silu(x) = x / (1 + exp(-x)).
extern "C" __global__ void swiglu(const float* gate, const float* up, unsigned short* out,
                                  long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        out[i] = f32_to_f16_bits(g / (1.0f + expf(-g)) * up[i]);
    }
}

// out = f16(gelu_tanh(gate) * up) (GeGLU, Gemma), with GELU's tanh approximation
// gelu_tanh(x) = 0.5 * x * (1 + tanh(sqrt(2/pi) * x * (1 + 0.044715 * x^2))).
extern "C" __global__ void geglu(const float* gate, const float* up, unsigned short* out,
                                 long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        const float gelu = 0.5f * g * (1.0f + tanhf(0.7978846f * g * (1.0f + 0.044715f * g * g)));
        out[i] = f32_to_f16_bits(gelu * up[i]);
    }
}

// x[t] = f32(table[tokens[t]]) * scale, rows of dim elements (scale: the
// model's embedding scale, sqrt(n_embd) for Gemma, else 1).
extern "C" __global__ void embed(const unsigned short* table, const unsigned int* tokens,
                                 float* x, int n_tokens, int dim, float scale) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const unsigned short* src = table + (size_t)tokens[t] * (size_t)dim;
    float* dst = x + (size_t)t * (size_t)dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = f16_bits_to_f32(src[i]) * scale;
}

extern "C" __global__ void f32_to_f16(const float* in, unsigned short* out, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = f32_to_f16_bits(in[i]);
    }
}

// The residual add: x += delta.
extern "C" __global__ void add_rows(float* x, const float* delta, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] += delta[i];
    }
}

// dst[j] = src[rows[j]], rows of width elements: the rows that want logits.
// grid = (n_rows), block = (256).
extern "C" __global__ void gather_rows(const float* src, float* dst, const int* rows, int width) {
    const float* s = src + (size_t)rows[blockIdx.x] * (size_t)width;
    float* d = dst + (size_t)blockIdx.x * (size_t)width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
}
