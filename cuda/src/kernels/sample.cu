// Token choice on the device: greedy decoding's argmax, so a greedy step
// copies back one id per row instead of a row of logits.

// out[r] = the first index of the largest value of row r (NaN never wins,
// as in the CPU sampler's `argmax`; a row starting with NaN gives 0).
extern "C" __global__ void argmax_rows(const float* logits, u32 rows, u32 vocab, u32* out) {
    __shared__ float best_v[32];
    __shared__ u32 best_i[32];
    u32 r = blockIdx.x;
    if (r >= rows) return;
    const float* row = logits + (u64)r * vocab;
    float bv = NEG_INF;
    u32 bi = 0xffffffffu;
    for (u32 j = threadIdx.x; j < vocab; j += blockDim.x) {
        float v = row[j];
        if (v > bv || (bi == 0xffffffffu && v == bv)) {
            bv = v;
            bi = j;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 warps = (blockDim.x + 31) >> 5;
        for (u32 w = 1; w < warps; ++w) {
            if (best_v[w] > best_v[0] || (best_v[w] == best_v[0] && best_i[w] < best_i[0])) {
                best_v[0] = best_v[w];
                best_i[0] = best_i[w];
            }
        }
        float first = row[0];
        out[r] = (first != first || best_i[0] == 0xffffffffu) ? 0u : best_i[0];
    }
}
