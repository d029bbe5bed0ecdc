// Row-wise kernels of the forward pass: embedding, RMSNorm, RoPE, SwiGLU,
// residual add, bias, and the conversions in front of a cuBLAS GEMM.

#define W_F32 0
#define W_F16 1
#define W_BF16 2

__device__ __forceinline__ float load_w(const void* p, u32 dtype, u64 i) {
    if (dtype == W_F16) return f16_to_f32(((const u16*)p)[i]);
    if (dtype == W_BF16) return bf16_to_f32(((const u16*)p)[i]);
    return ((const float*)p)[i];
}

// out[t, :] = table[ids[t], :]. Grid (rows), block any. An id past the
// vocabulary writes NaN (the host refuses such ids before launching; a NaN
// row cannot pass for a real one).
extern "C" __global__ void embedding(const void* table, u32 dtype, const u32* ids, u32 rows,
                                     u32 vocab, u32 hidden, float* out) {
    u32 t = blockIdx.x;
    if (t >= rows) return;
    u32 id = ids[t];
    for (u32 j = threadIdx.x; j < hidden; j += blockDim.x) {
        out[(u64)t * hidden + j] = id < vocab ? load_w(table, dtype, (u64)id * hidden + j)
                                              : __int_as_float(0x7fc00000);
    }
}

// out = w * (x * 1/sqrt(mean(x^2) + eps)), one block per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, u32 rows, u32 d, float eps,
                                    float* out) {
    __shared__ float scratch[32];
    u32 r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (u64)r * d;
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) s = fmaf(xr[j], xr[j], s);
    s = block_sum(s, scratch);
    float inv = 1.0f / sqrtf(s / (float)d + eps);
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) out[(u64)r * d + j] = w[j] * (xr[j] * inv);
}

// Rotate every head of every row in place. `x` is [rows][n_heads][head_dim],
// `pos[t]` the row's position, `inv_freq` head_dim/2 values (computed on
// the host exactly as the CPU `Rope` does). layout 0: pairs (i, i + d/2)
// (rotate-half); 1: pairs (2i, 2i + 1) (interleaved). One thread per pair.
extern "C" __global__ void rope(float* x, const u32* pos, const float* inv_freq, u32 rows,
                                u32 n_heads, u32 head_dim, u32 layout) {
    u32 half = head_dim / 2;
    u64 n = (u64)rows * n_heads * half;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (u64)gridDim.x * blockDim.x) {
        u32 i = (u32)(k % half);
        u64 head = k / half;
        u32 t = (u32)(head / n_heads);
        float angle = (float)pos[t] * inv_freq[i];
        float s, c;
        sincosf(angle, &s, &c);
        float* h = x + head * head_dim;
        u32 a = layout == 0 ? i : 2 * i;
        u32 b = layout == 0 ? i + half : 2 * i + 1;
        float x0 = h[a], x1 = h[b];
        h[a] = x0 * c - x1 * s;
        h[b] = x1 * c + x0 * s;
    }
}

// out[t, j] = silu(g[t, j]) * u[t, j], with gate_up rows [g | u] of 2*width.
extern "C" __global__ void swiglu(const float* gate_up, u32 rows, u32 width, float* out) {
    u64 n = (u64)rows * width;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (u64)gridDim.x * blockDim.x) {
        u64 t = k / width, j = k % width;
        float g = gate_up[t * 2 * width + j];
        float u = gate_up[t * 2 * width + width + j];
        out[k] = g / (1.0f + expf(-g)) * u;
    }
}

// x += y (the residual stream).
extern "C" __global__ void add_into(float* x, const float* y, u64 n) {
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (u64)gridDim.x * blockDim.x)
        x[k] += y[k];
}

// Each row of width `d` gets `bias` added.
extern "C" __global__ void add_bias(float* x, const float* bias, u32 rows, u32 d) {
    u64 n = (u64)rows * d;
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (u64)gridDim.x * blockDim.x)
        x[k] += bias[k % d];
}

// Activations into the GEMM's input type (bf16 or f16), rounded to nearest.
extern "C" __global__ void f32_to_half(const float* x, u64 n, u32 dtype, u16* out) {
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (u64)gridDim.x * blockDim.x) {
        float f = x[k];
        if (dtype == W_BF16) {
            out[k] = f32_to_bf16(f);
        } else {
            u16 h;
            asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
            out[k] = h;
        }
    }
}

// Rows `sel[i]` of x ([*, d]) into out ([n_sel, d]): the rows whose logits a
// step wants.
extern "C" __global__ void gather_rows(const float* x, const u32* sel, u32 n_sel, u32 d,
                                       float* out) {
    u32 i = blockIdx.x;
    if (i >= n_sel) return;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x)
        out[(u64)i * d + j] = x[(u64)sel[i] * d + j];
}
