// kvmesh CUDA kernels: what every program shares. Prepended to each .cu file
// by the host (`kvmesh_cuda::source`), so NVRTC needs no include path and no
// CUDA headers at all: the half-precision conversions are PTX `cvt`
// instructions and bf16 is bit arithmetic.
//
// Conventions (the host side relies on every one):
// - Activations, the residual stream, norms and softmax are f32.
// - Every `extern "C"` kernel takes plain pointers and 32-bit sizes; a grid
//   never exceeds what the host computed from the same sizes.
// - A block-table entry is `(generation << 32) | page` (u64): the
//   generation the sequence was granted the page at (low 32 bits).
// - Per page the pool keeps `gens[page]` (u32, odd while allocated) and
//   `wm[page * n_layers + layer]` (u32, slots written from slot 0).
// - A check that fails is recorded in the sequence's `Violation` (the first
//   one wins, atomicCAS on `kind`), and nothing of the failing page is read.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
typedef signed char i8;
typedef unsigned char u8;

#define KV_F32 0
#define KV_F16 1

// Violation kinds (host: `kvmesh_cuda::table::ViolationKind`).
#define V_NONE 0u
#define V_PAGE_OUT_OF_RANGE 1u
#define V_STALE_GENERATION 2u
#define V_UNWRITTEN 3u
#define V_TABLE_TOO_SHORT 4u
#define V_WRITE_GAP 5u
// Set by the host before the step (a write into the sequence's shared,
// prefix-cached head); no kernel writes it, every kernel honours it.
#define V_SHARED_PAGE 6u

struct Violation {
    u32 kind;
    u32 page;
    u32 layer;
    u32 expected;   // generation in the table, or slots requested
    u32 actual;     // generation on the device, or the watermark
    u32 position;   // the token position whose read or write failed
    u32 pad0;
    u32 pad1;
};

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, saturating at +-65504 like the CPU pool's write
// (`cvt.rn.satfinite` keeps NaN a NaN).
__device__ __forceinline__ u16 f32_to_f16_sat(float f) {
    u16 h;
    float c = fminf(fmaxf(f, -65504.0f), 65504.0f);
    if (f != f) c = f;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(c));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// Round to nearest even; NaN stays a quiet NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u32 round = 0x7fffu + ((u >> 16) & 1u);
    return (u16)((u + round) >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; every thread gets the total.
// `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

// Record the first violation of a sequence.
__device__ __forceinline__ void report(Violation* v, u32 kind, u32 page, u32 layer,
                                       u32 expected, u32 actual, u32 position) {
    if (atomicCAS(&v->kind, V_NONE, kind) == V_NONE) {
        v->page = page;
        v->layer = layer;
        v->expected = expected;
        v->actual = actual;
        v->position = position;
    }
}

__device__ __forceinline__ u32 entry_page(u64 e) { return (u32)(e & 0xffffffffull); }
__device__ __forceinline__ u32 entry_gen(u64 e) { return (u32)(e >> 32); }

#define NEG_INF __int_as_float(0xff800000)
