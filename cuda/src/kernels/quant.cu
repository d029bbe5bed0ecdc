// GGUF block formats on the device (the bytes as stored, see
// `kvmesh_kernels::quant`): Q4_1 blocks are 20 bytes (d: f16, m: f16,
// qs[16]; value i = fma(q_i, d, m), q_i the low nibble of qs[i] for i < 16,
// the high nibble of qs[i - 16] after), Q8_0 blocks 34 bytes (d: f16,
// qs: i8[32]; value i = qs[i] * d).

#define Q4_1 0
#define Q8_0 1
#define OUT_F32 0
#define OUT_F16 1
#define OUT_BF16 2
#define MV_MAX_ROWS 8
#define MV_WARPS 8

__device__ __forceinline__ u16 ld_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

__device__ __forceinline__ float block_value(const u8* b, u32 format, u32 i) {
    if (format == Q4_1) {
        float d = f16_to_f32(ld_u16(b)), m = f16_to_f32(ld_u16(b + 2));
        u8 byte = b[4 + (i & 15)];
        float qv = (float)(i < 16 ? (byte & 15) : (byte >> 4));
        return fmaf(qv, d, m);
    }
    float d = f16_to_f32(ld_u16(b));
    return (float)((const i8*)(b + 2))[i] * d;
}

__device__ __forceinline__ u32 block_bytes(u32 format) { return format == Q4_1 ? 20u : 34u; }

// Every value of `n_blocks` blocks into out (f32, f16 or bf16): a quantized
// matrix dequantized once at load for the cuBLAS path, and embeddings.
extern "C" __global__ void dequantize(const u8* blocks, u32 format, u64 n_blocks, u32 out_dtype,
                                      void* out) {
    u64 n = n_blocks * 32;
    u32 bb = block_bytes(format);
    for (u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (u64)gridDim.x * blockDim.x) {
        float v = block_value(blocks + (k / 32) * bb, format, (u32)(k % 32));
        if (out_dtype == OUT_F16) ((u16*)out)[k] = f32_to_f16_sat(v);
        else if (out_dtype == OUT_BF16) ((u16*)out)[k] = f32_to_bf16(v);
        else ((float*)out)[k] = v;
    }
}

// out[t, r] = sum_k x[t, k] * w[r, k] for t < n_rows <= MV_MAX_ROWS: the
// decode-step product, which reads each weight block once, dequantized in
// registers, f32 activations. One warp per weight row; lane l takes blocks
// l, l + 32, ...
extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)
qmatvec(const u8* w, u32 format, u32 out_rows, u32 cols, const float* x, u32 n_rows, float* out) {
    u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u32 r = blockIdx.x * MV_WARPS + warp;
    if (r >= out_rows) return;
    u32 nb = cols / 32, bb = block_bytes(format);
    const u8* row = w + (u64)r * nb * bb;
    float acc[MV_MAX_ROWS];
    for (u32 t = 0; t < MV_MAX_ROWS; ++t) acc[t] = 0.0f;
    for (u32 b = lane; b < nb; b += 32) {
        const u8* blk = row + (u64)b * bb;
        for (u32 i = 0; i < 32; ++i) {
            float wv = block_value(blk, format, i);
            for (u32 t = 0; t < MV_MAX_ROWS; ++t)
                if (t < n_rows) acc[t] = fmaf(wv, x[(u64)t * cols + b * 32 + i], acc[t]);
        }
    }
    for (u32 t = 0; t < MV_MAX_ROWS; ++t) {
        if (t >= n_rows) break;
        float s = warp_sum(acc[t]);
        if (lane == 0) out[(u64)t * out_rows + r] = s;
    }
}
