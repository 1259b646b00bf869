// Flotilla CUDA kernels: rotary position embedding, applied in place.
//
// Each token row of the fused QKV activations (f32) is
// [q: n_head*head_dim][k: n_head_kv*head_dim][v: n_head_kv*head_dim], width qkv_w.
// The rotation is the "normal" adjacent-pair form used for LLaMA GGUF models:
// pair (x[2i], x[2i+1]) of every Q and K head is rotated by
// pos * theta_base^(-2i/head_dim). V is left untouched.
// Launch: grid = (n_tokens), block = (any; head_dim/2 rounded up to 32 is ideal).

extern "C" __global__ void rope_qk(float* qkv, const int* pos, int n_tokens, int qkv_w,
                                   int n_head, int n_head_kv, int head_dim,
                                   float theta_base) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    float* row = qkv + (size_t)t * (size_t)qkv_w;
    const int half = head_dim / 2;
    const int n_heads = n_head + n_head_kv;  // K heads follow the Q heads directly.
    const double p = (double)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        // The angle is formed in double: positions reach tens of thousands,
        // where a float angle loses several bits (the CPU backend uses f64 too).
        const double freq = pow((double)theta_base, -2.0 * (double)i / (double)head_dim);
        double sd, cd;
        sincos(p * freq, &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        for (int h = 0; h < n_heads; ++h) {
            float* x = row + (size_t)h * head_dim + 2 * i;
            const float a = x[0], b = x[1];
            x[0] = a * c - b * s;
            x[1] = a * s + b * c;
        }
    }
}
