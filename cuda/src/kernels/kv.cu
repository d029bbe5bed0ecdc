// The device KV pool: page events from the host pool, and the KV write.
//
// Pool layout, as the CPU pool's storage (so a page is the same bytes on
// both sides of a staging copy): page-major, then layer, then K and V, each
// block `[page_size][kv_dim]` values of the pool's dtype (f32 or f16).

#define POISON_F32 0x7FDEADEDu
#define POISON_F16 0x7DADu

#define FILL_NONE 0u
#define FILL_ZERO 1u
#define FILL_CANARY 2u
// A holder change that keeps contents and watermarks (a page entering the
// prefix cache): only the generation moves.
#define EVENT_RETAG 3u

// Apply the host pool's page events in order (one block each, one launch,
// on the stream every later kernel runs on): the page's new generation,
// its watermarks cleared, and the scrub (zeros) or poison (canary) fill;
// or, for EVENT_RETAG, the new generation alone.
// events: u32 triples (page, generation, fill or EVENT_RETAG).
extern "C" __global__ void page_events(const u32* events, u32 n_events, u32* gens, u32* wm,
                                       void* kv, u32 kv_dtype, u32 n_pages, u32 n_layers,
                                       u64 page_values) {
    for (u32 e = 0; e < n_events; ++e) {
        // Every block walks the list so a page named twice ends in its last
        // state; each applies only the events whose page it owns.
        u32 page = events[3 * e];
        if (page >= n_pages || page % gridDim.x != blockIdx.x) continue;
        u32 gen = events[3 * e + 1], fill = events[3 * e + 2];
        if (threadIdx.x == 0) gens[page] = gen;
        if (fill == EVENT_RETAG) {
            __syncthreads();
            continue;
        }
        for (u32 l = threadIdx.x; l < n_layers; l += blockDim.x) wm[(u64)page * n_layers + l] = 0;
        if (fill != FILL_NONE) {
            u64 base = (u64)page * page_values;
            if (kv_dtype == KV_F16) {
                u16 v = fill == FILL_CANARY ? (u16)POISON_F16 : (u16)0;
                u16* p = (u16*)kv + base;
                for (u64 i = threadIdx.x; i < page_values; i += blockDim.x) p[i] = v;
            } else {
                u32 v = fill == FILL_CANARY ? POISON_F32 : 0u;
                u32* p = (u32*)kv + base;
                for (u64 i = threadIdx.x; i < page_values; i += blockDim.x) p[i] = v;
            }
        }
        __syncthreads();
    }
}

// Write each chunk's K/V rows of `layer` into its pages; one block per chunk.
// Chunk c owns rows row0[c] .. row0[c] + rows[c] of k and v ([*, kv_dim] f32,
// after RoPE) at positions start[c] .. start[c] + rows[c], and the table
// entries table[toff[c] .. toff[c] + tlen[c]].
//
// Before any value is written, every entry the chunk touches is checked:
// in the table (else TABLE_TOO_SHORT), a page of the pool (else
// PAGE_OUT_OF_RANGE), of the granted generation (else STALE_GENERATION);
// and the first slot must not lie above its layer's watermark (else
// WRITE_GAP, the CPU pool's rule). A chunk that failed (now, at an
// earlier layer, or on the host before the step: a write into the
// sequence's shared head, V_SHARED_PAGE) writes nothing. After the writes,
// each page's watermark rises to the end of what was written in it
// (atomicMax): never past a slot that was not written.
extern "C" __global__ void kv_write(const float* k, const float* v, void* kv, u32 kv_dtype,
                                    const u32* gens, u32* wm, const u64* table, const u32* row0,
                                    const u32* rows, const u32* start, const u32* toff,
                                    const u32* tlen, Violation* viol, u32 n_chunks, u32 layer,
                                    u32 n_pages, u32 n_layers, u32 page_size, u32 kv_dim) {
    __shared__ int ok;
    u32 c = blockIdx.x;
    if (c >= n_chunks || rows[c] == 0) return;
    Violation* vc = viol + c;
    u32 s0 = start[c], n = rows[c];
    u32 first = s0 / page_size, last = (s0 + n - 1) / page_size;
    if (threadIdx.x == 0) {
        ok = vc->kind == V_NONE;
        for (u32 i = first; ok && i <= last; ++i) {
            if (i >= tlen[c]) {
                report(vc, V_TABLE_TOO_SHORT, i, layer, 0, tlen[c], s0 + n - 1);
                ok = 0;
                break;
            }
            u64 e = table[toff[c] + i];
            u32 page = entry_page(e);
            if (page >= n_pages) {
                report(vc, V_PAGE_OUT_OF_RANGE, page, layer, 0, n_pages, i * page_size);
                ok = 0;
            } else if (gens[page] != entry_gen(e)) {
                report(vc, V_STALE_GENERATION, page, layer, entry_gen(e), gens[page], i * page_size);
                ok = 0;
            } else if (i == first && s0 % page_size > wm[(u64)page * n_layers + layer]) {
                report(vc, V_WRITE_GAP, page, layer, s0 % page_size,
                       wm[(u64)page * n_layers + layer], s0);
                ok = 0;
            }
        }
    }
    __syncthreads();
    if (!ok) return;
    u64 block = (u64)page_size * kv_dim;
    u64 page_values = (u64)n_layers * 2 * block;
    u64 total = (u64)n * kv_dim;
    for (u64 x = threadIdx.x; x < total; x += blockDim.x) {
        u32 t = (u32)(x / kv_dim), j = (u32)(x % kv_dim);
        u32 pos = s0 + t;
        u32 page = entry_page(table[toff[c] + pos / page_size]);
        u64 at = (u64)page * page_values + (u64)layer * 2 * block + (u64)(pos % page_size) * kv_dim + j;
        float kx = k[(u64)(row0[c] + t) * kv_dim + j], vx = v[(u64)(row0[c] + t) * kv_dim + j];
        if (kv_dtype == KV_F16) {
            ((u16*)kv)[at] = f32_to_f16_sat(kx);
            ((u16*)kv)[at + block] = f32_to_f16_sat(vx);
        } else {
            ((float*)kv)[at] = kx;
            ((float*)kv)[at + block] = vx;
        }
    }
    __syncthreads();
    for (u32 i = first + threadIdx.x; i <= last; i += blockDim.x) {
        u32 page = entry_page(table[toff[c] + i]);
        u32 end = min(s0 + n, (i + 1) * page_size) - i * page_size;
        atomicMax(&wm[(u64)page * n_layers + layer], end);
    }
}
