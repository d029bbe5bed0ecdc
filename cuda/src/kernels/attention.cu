// Paged attention over the device pool, with the page checks inside.
//
// One block per (query row, head); each warp takes every W-th key of the
// row's window with an online softmax, and the warps' partial results are
// merged at the end. Lane `l` holds dimensions l, l + 32, ... of the head
// (head_dim at most 256: the host refuses larger heads).
//
// The checked build (`paged_attention`) first checks every page the row
// reads: in the table, in the pool, of the granted generation, and written
// at this layer at least up to the slots read (the layer's watermark). If
// one fails, the first failure of the chunk is recorded, the row's output
// is zeros, and no byte of K/V is read. A chunk whose record is already set
// (a failure at an earlier layer, or in this layer's KV write) is skipped
// the same way. `paged_attention_unchecked` is the same kernel without the
// checks: only the benchmark that prices them calls it.

#define ATT_WARPS 4
#define MAX_R 8

__device__ __forceinline__ float kv_load(const void* kv, u32 dtype, u64 at) {
    return dtype == KV_F16 ? f16_to_f32(((const u16*)kv)[at]) : ((const float*)kv)[at];
}

template <bool CHECKED>
__device__ void attention_row(const float* q, float* out, const u32* tok_chunk, const u32* tok_pos,
                              const u64* table, const u32* toff, const u32* tlen,
                              Violation* viol, const void* kv, u32 kv_dtype, const u32* gens,
                              const u32* wm, u32 n_pages, u32 n_layers, u32 layer, u32 page_size,
                              u32 n_heads, u32 n_kv_heads, u32 head_dim, float scale,
                              u32 window) {
    __shared__ int bad;
    __shared__ float part_m[ATT_WARPS], part_l[ATT_WARPS];
    __shared__ float part_acc[ATT_WARPS][256];
    u32 t = blockIdx.x, h = blockIdx.y;
    u32 c = tok_chunk[t], pos = tok_pos[t];
    Violation* vc = viol + c;
    const u64* tab = table + toff[c];
    u32 context = pos + 1;
    u32 lo = (window != 0 && context > window) ? context - window : 0;
    u32 need = (context + page_size - 1) / page_size;
    float* o = out + ((u64)t * n_heads + h) * head_dim;

    if (threadIdx.x == 0) bad = CHECKED && vc->kind != V_NONE;
    __syncthreads();
    if (CHECKED && !bad) {
        if (need > tlen[c]) {
            if (threadIdx.x == 0) report(vc, V_TABLE_TOO_SHORT, need - 1, layer, need, tlen[c], pos);
            bad = 1;
        } else {
            for (u32 i = lo / page_size + threadIdx.x; i < need; i += blockDim.x) {
                u64 e = tab[i];
                u32 page = entry_page(e);
                u32 slots = min(page_size, context - i * page_size);
                if (page >= n_pages) {
                    report(vc, V_PAGE_OUT_OF_RANGE, page, layer, 0, n_pages, pos);
                    bad = 1;
                } else if (gens[page] != entry_gen(e)) {
                    report(vc, V_STALE_GENERATION, page, layer, entry_gen(e), gens[page], pos);
                    bad = 1;
                } else if (wm[(u64)page * n_layers + layer] < slots) {
                    report(vc, V_UNWRITTEN, page, layer, slots, wm[(u64)page * n_layers + layer], pos);
                    bad = 1;
                }
            }
        }
    }
    __syncthreads();
    if (bad) {
        for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = 0.0f;
        return;
    }

    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Each lane holds dims lane, lane + 32, ...: R registers; a head that
    // is not a multiple of 32 leaves the last register of some lanes idle.
    u32 R = (head_dim + 31) / 32;
    u32 kvh = h / (n_heads / n_kv_heads);
    u32 kv_dim = n_kv_heads * head_dim;
    u64 block = (u64)page_size * kv_dim;
    u64 page_values = (u64)n_layers * 2 * block;
    const float* qh = q + ((u64)t * n_heads + h) * head_dim;
    float qr[MAX_R], acc[MAX_R];
    for (u32 r = 0; r < MAX_R; ++r) {
        qr[r] = (r < R && lane + 32 * r < head_dim) ? qh[lane + 32 * r] : 0.0f;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (u32 j = lo + warp; j < context; j += ATT_WARPS) {
        u32 page = entry_page(tab[j / page_size]);
        u64 at = (u64)page * page_values + (u64)layer * 2 * block +
                 (u64)(j % page_size) * kv_dim + (u64)kvh * head_dim + lane;
        float s = 0.0f;
        for (u32 r = 0; r < R; ++r)
            if (lane + 32 * r < head_dim) s = fmaf(qr[r], kv_load(kv, kv_dtype, at + 32 * r), s);
        s = warp_sum(s) * scale;
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new), p = expf(s - m_new);
        l = l * corr + p;
        for (u32 r = 0; r < R; ++r)
            if (lane + 32 * r < head_dim)
                acc[r] = fmaf(p, kv_load(kv, kv_dtype, at + block + 32 * r), acc[r] * corr);
        m = m_new;
    }
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
    for (u32 r = 0; r < R; ++r)
        if (lane + 32 * r < head_dim) part_acc[warp][lane + 32 * r] = acc[r];
    __syncthreads();
    float M = NEG_INF;
    for (u32 w = 0; w < ATT_WARPS; ++w) M = fmaxf(M, part_m[w]);
    float L = 0.0f;
    for (u32 w = 0; w < ATT_WARPS; ++w)
        if (part_m[w] != NEG_INF) L += part_l[w] * expf(part_m[w] - M);
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (u32 w = 0; w < ATT_WARPS; ++w)
            if (part_m[w] != NEG_INF) a += part_acc[w][d] * expf(part_m[w] - M);
        o[d] = a / L;
    }
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
paged_attention(const float* q, float* out, const u32* tok_chunk, const u32* tok_pos,
                const u64* table, const u32* toff, const u32* tlen, Violation* viol,
                const void* kv, u32 kv_dtype, const u32* gens, const u32* wm, u32 n_pages,
                u32 n_layers, u32 layer, u32 page_size, u32 n_heads, u32 n_kv_heads,
                u32 head_dim, float scale, u32 window) {
    attention_row<true>(q, out, tok_chunk, tok_pos, table, toff, tlen, viol, kv, kv_dtype, gens,
                        wm, n_pages, n_layers, layer, page_size, n_heads, n_kv_heads, head_dim,
                        scale, window);
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
paged_attention_unchecked(const float* q, float* out, const u32* tok_chunk, const u32* tok_pos,
                          const u64* table, const u32* toff, const u32* tlen, Violation* viol,
                          const void* kv, u32 kv_dtype, const u32* gens, const u32* wm,
                          u32 n_pages, u32 n_layers, u32 layer, u32 page_size, u32 n_heads,
                          u32 n_kv_heads, u32 head_dim, float scale, u32 window) {
    attention_row<false>(q, out, tok_chunk, tok_pos, table, toff, tlen, viol, kv, kv_dtype, gens,
                         wm, n_pages, n_layers, layer, page_size, n_heads, n_kv_heads, head_dim,
                         scale, window);
}
