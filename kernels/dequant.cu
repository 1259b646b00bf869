// Flotilla CUDA kernels: GGUF weight formats to f16, run once at load.
//
// Input is the raw tensor data as stored in the GGUF file; blocks are packed
// back to back and only byte-aligned (34, 18 or 20 bytes), so scales are read
// byte by byte. Every block holds 32 weights; output is f16 (unsigned short bit
// patterns), n_blocks*32 elements in file order.
//   Q8_0: f16 d, 32 x int8 q;                 w = q*d
//   Q4_0: f16 d, 16 bytes; j < 16: lo nibble of byte j, j >= 16: hi nibble of byte j-16;
//         w = (q - 8)*d
//   Q4_1: f16 d, f16 m, 16 bytes as Q4_0;      w = q*d + m
// One thread per output element, grid-stride: any grid works, e.g.
// grid = (min(ceil(n/256), 65535)), block = (256).

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

// Little-endian f16 at p, which may be odd-aligned.
__device__ __forceinline__ float load_f16_le(const unsigned char* p) {
    return f16_bits_to_f32((unsigned short)(p[0] | (p[1] << 8)));
}

// The 4-bit value of element j (0..31) of a 16-byte nibble array.
__device__ __forceinline__ int nibble(const unsigned char* qs, int j) {
    return j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4);
}

extern "C" __global__ void dequant_q8_0(const unsigned char* raw, unsigned short* out,
                                        long long n_blocks) {
    const long long n = n_blocks * 32;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned char* b = raw + (i >> 5) * 34;
        const int j = (int)(i & 31);
        out[i] = f32_to_f16_bits((float)(signed char)b[2 + j] * load_f16_le(b));
    }
}

extern "C" __global__ void dequant_q4_0(const unsigned char* raw, unsigned short* out,
                                        long long n_blocks) {
    const long long n = n_blocks * 32;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned char* b = raw + (i >> 5) * 18;
        const int j = (int)(i & 31);
        out[i] = f32_to_f16_bits((float)(nibble(b + 2, j) - 8) * load_f16_le(b));
    }
}

extern "C" __global__ void dequant_q4_1(const unsigned char* raw, unsigned short* out,
                                        long long n_blocks) {
    const long long n = n_blocks * 32;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned char* b = raw + (i >> 5) * 20;
        const int j = (int)(i & 31);
        out[i] = f32_to_f16_bits((float)nibble(b + 4, j) * load_f16_le(b) + load_f16_le(b + 2));
    }
}

// bf16 -> f32 (shift into the high half) -> f16. Magnitudes beyond the f16 range
// (65504) become infinities; tiny ones become f16 subnormals or zero.
extern "C" __global__ void bf16_to_f16(const unsigned short* in, unsigned short* out,
                                       long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = f32_to_f16_bits(__uint_as_float((unsigned int)in[i] << 16));
    }
}
