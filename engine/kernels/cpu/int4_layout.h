// The int4 GEMMs' packed weights, and the helpers the files that multiply them share
// (int4_mm.cpp, int4_amx.cpp, int4_a8.cpp).
//
// Packed layout (``pack`` in engine/weights/int4_tiles.py), uint8 (T, G, 320), T = N / 16:
// tile t holds outputs 16t..16t+15; per group, 256 bytes of codes then s and m as float16
// (16 each). Code bytes come in 8 chunks of 32: byte 2i + j of chunk q holds output i's
// code for input 2q + j in its low nibble and for input 16 + 2q + j in its high nibble, so
// one chunk widened to 16-bit lanes gives, nibble by nibble, two (16 outputs x 2 inputs)
// operands of vdpbf16ps.

#pragma once

#include "common.h"

#define PDSERVE_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,f16c,fma")))

namespace pdserve {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kCodeBytes = kGroup * kTile / 2;      // 256
constexpr int64_t kGroupBytes = kCodeBytes + 4 * kTile;  // + s and m, float16: 320
constexpr int kAmxRows = 16;  // rows per pass over a tile on AMX (int4_amx.cpp)

// Groups read ahead of the one decoded, on the AMX paths (int4_amx.cpp), which read two
// tiles at once. The vector path (int4_mm.cpp) reads one tile at a time and prefetches
// nothing: a thread's tiles are then one sequential stream, which the hardware prefetcher
// follows at the copy rate (see rows_block there).
constexpr int64_t kAhead = 4;

// The product of one block of rows over a range of tiles: int4_mm's vector and AMX paths.
using BlockFn = void (*)(const uint16_t*, int64_t, const float*, const uint8_t*, int64_t, int64_t,
                         int64_t, float*, int64_t, int64_t);

// The int4 products' arguments: x (M, K), w uint8 (T, G, 320), n outputs in T tiles.
void check_gemm(const char* name, const at::Tensor& x, const at::Tensor& w, int64_t n);
// Whether this process may use the AMX tiles (int4_amx.cpp).
bool amx_enabled();
// int4_mm's AMX blocks by rows, 1..kAmxRows (int4_amx.cpp).
extern const std::array<BlockFn, kAmxRows + 1> kAmxBlocks;

// NOTE: local to each file, as in common.h.
namespace {

inline void prefetch_group(const uint8_t* p) {
  for (int64_t line = 0; line < kGroupBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// bfloat16 of 0..15, by code (vpermw reads the low 5 bits of each 16-bit lane).
alignas(64) constexpr uint16_t kCodeValues[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0,      0,      0,      0,      0,      0,      0,      0,
    0,      0,      0,      0,      0,      0,      0,      0};

// acc[r][t] += s * dot[r][t] + m * X[r, g]: group g's scaling, for the small-rows paths.
template <int RB, int NT>
PDSERVE_TARGET inline void scale_group(__m512 (&acc)[RB][NT], const __m512 (&dot)[RB][NT],
                                       const uint8_t* w, int64_t tile0, int64_t g,
                                       int64_t groups, const float* xsum) {
  for (int t = 0; t < NT; ++t) {
    const uint8_t* sm = w + ((tile0 + t) * groups + g) * kGroupBytes + kCodeBytes;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
    const __m512 m =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + 32)));
    for (int r = 0; r < RB; ++r) {
      acc[r][t] = _mm512_fmadd_ps(s, dot[r][t], acc[r][t]);
      acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), acc[r][t]);
    }
  }
}

// y's rows [0, RB) at the NT tiles from tile0 (the last one may be partial: n outputs).
template <int RB, int NT>
PDSERVE_TARGET inline void store_rows(const __m512 (&acc)[RB][NT], int64_t tile0, float* y,
                                      int64_t ldy, int64_t n) {
  for (int t = 0; t < NT; ++t) {
    const int64_t col = (tile0 + t) * kTile;
    const int64_t left = std::min<int64_t>(kTile, n - col);
    const __mmask16 mask = left >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy + col, mask, acc[r][t]);
  }
}

}  // namespace
}  // namespace pdserve
