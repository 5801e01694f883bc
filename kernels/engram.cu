// kernels/engram.cu — Engram row gather: fp8 e4m3 rows with e8m0 block
// scales, from a host-resident table into bf16 rows in HBM.
#include "common.cuh"

namespace kvt {

#ifdef KVT_HOST_EMULATION
__device__ __forceinline__ float bits_to_float(uint32_t u) {
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
__device__ __forceinline__ uint32_t float_to_bits(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return u;
}
#else
__device__ __forceinline__ float bits_to_float(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ uint32_t float_to_bits(float f) { return __float_as_uint(f); }
#endif

// An e4m3fn byte as fp32, exactly: bias 7, no infinities, 0x7F/0xFF NaN,
// exponent 0 subnormal (m * 2^-9).
__device__ __forceinline__ float e4m3_to_f32(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 24;
    const uint32_t e = (b >> 3) & 0xFu;
    const uint32_t m = b & 0x7u;
    if (e == 0xFu && m == 0x7u) return bits_to_float(0x7FC00000u | sign);
    if (e == 0) {
        // m * 2^-9: exact in fp32; the sign kept (so 0x80 is -0)
        return bits_to_float(float_to_bits((float)m * 0.001953125f) | sign);
    }
    return bits_to_float(sign | ((e + 120u) << 23) | (m << 20));
}

// 2^(e - 127) from an e8m0 byte: e == 0 is 2^-127 (a subnormal, no flush),
// e == 255 the bit pattern of +inf.
__device__ __forceinline__ float e8m0_scale(uint32_t e) {
    return bits_to_float(e == 0 ? 0x00400000u : e << 23);
}

// fp32 to bf16 bits, round to nearest even; NaN to the canonical 0x7FFF.
__device__ __forceinline__ uint32_t bf16_rne(float x) {
    const uint32_t u = float_to_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

}  // namespace kvt

// kvt_engram_gather — n ids, one launch (contract: kvt_engram_gather_params
// in abi.h).
// Reads:   ids (device memory); a row's dim weight bytes and dim / block
//          scale bytes (host-mapped or device) only for an id inside the
//          table, checked against row_lo, row_hi and rows.
// Reads:   out_rows[i] (device memory), when given.
// Writes:  out row i (or out_rows[i]) for every id (data or +0); the error
//          word for ids past the table and out_rows entries outside [0, n).
// Assumes: the host launcher validated dim (a power of two, 8..4096), block
//          (divides dim), weights 8-byte and out 16-byte aligned.
// Mapping: one warp per id, grid-stride; each lane converts groups of 8
//          values (8 weight bytes in, 16 bf16 bytes out).
extern "C" __global__ void __launch_bounds__(KVT_BLOCK_THREADS)
    kvt_engram_gather(const kvt_engram_gather_params p) {
    const uint32_t lane = threadIdx.x % KVT_WARP;
    kvt_error_word* err = reinterpret_cast<kvt_error_word*>(p.error);
    const uint32_t groups = p.dim / 8;
    const uint32_t blocks_per_row = p.dim / p.block;
    // row_end = min(row_hi, row_lo + rows), without overflow
    const int64_t i64_max = 0x7FFFFFFFFFFFFFFFll;
    const int64_t room = (int64_t)(p.rows > (uint64_t)i64_max ? (uint64_t)i64_max : p.rows);
    const int64_t row_end = (p.row_hi - p.row_lo > room) ? p.row_lo + room : p.row_hi;

    for (uint32_t i = kvt::global_warp(); i < p.n; i += kvt::grid_warps()) {
        const int64_t id = kvt::load_index(p.ids, i, p.ids_int64 != 0);
        int64_t out_row = i;
        if (p.out_rows != 0) {
            out_row = kvt::load_index(p.out_rows, i, false);
            if (out_row < 0 || out_row >= (int64_t)p.n) {
                if (lane == 0) kvt::report(err, KVT_ERR_GATHER_SLOT, i, out_row);
                continue;  // the whole warp: one id a warp
            }
        }
        const bool owned = id >= p.row_lo && id < row_end;
        if (!owned && id >= row_end && id < p.row_hi && lane == 0) {
            // the id's place in the caller's order (sorted reads: its out row)
            kvt::report(err, KVT_ERR_GATHER_INDEX, (uint32_t)out_row, id);
        }
        const uint64_t row = owned ? (uint64_t)(id - p.row_lo) : 0;
        const uint8_t* w = reinterpret_cast<const uint8_t*>(p.weights) + row * p.dim;
        const uint8_t* s = reinterpret_cast<const uint8_t*>(p.scales) + row * blocks_per_row;
        char* dst = reinterpret_cast<char*>(p.out) + (uint64_t)out_row * p.dim * 2;
        for (uint32_t g = lane; g < groups; g += KVT_WARP) {
            uint4 o = make_uint4(0, 0, 0, 0);
            if (owned) {
                const uint2 v = kvt::load8(w + g * 8);
                // block is a power of two (it divides dim): from 8 on, the
                // group's 8 values share one scale byte
                const float shared = p.block >= 8 ? kvt::e8m0_scale(kvt::ld(s + g * 8 / p.block)) : 0.0f;
                uint32_t h[8];
                for (int k = 0; k < 8; ++k) {
                    const uint32_t j = g * 8 + k;
                    const uint32_t byte = ((k < 4 ? v.x : v.y) >> (8 * (k & 3))) & 0xFFu;
                    const float scale = p.block >= 8 ? shared : kvt::e8m0_scale(kvt::ld(s + j / p.block));
                    h[k] = kvt::bf16_rne(kvt::e4m3_to_f32(byte) * scale);
                }
                o = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16),
                               h[6] | (h[7] << 16));
            }
            KVT_STORE16("cs", dst + g * 16, o);
        }
    }
}
