// pdserve's CPU kernels (torch.ops.pdserve; engine/weights/int4_tiles.py and
// engine/model/fused_cpu.py choose):
// * int4_mm, amx = false: a few rows, AVX-512 BF16 pair-dots (below);
// * int4_mm, amx = true: a few rows on the AMX tile unit, the same sums;
// * int4_gemm: many rows on AMX, on weights de-quantized to bfloat16 once per call;
// * int4_gemm_a8: many rows on AVX-512 VNNI, inputs quantized to int8 (an opt-in: not the
//   same numbers as the others);
// * around the GEMMs (further down): silu_mul, the MLP's SiLU(gate) * up in one pass;
//   rope_store, rotary + K/V store; decode_attention and prefill_attention over the
//   paged KV pool in place.
//
// int4_mm: y = x W^T with W[n, k] = c[n, k] * s[n, g] + m[n, g], c in [0, 15], groups g of 32 inputs.
// Each group's product is taken on the codes, and scaled once:
//     y[r, n] = sum_g  s[n, g] * (sum_{k in g} x[r, k] c[n, k])  +  m[n, g] * X[r, g]
// with X[r, g] the sum of row r's inputs in group g. A code is exact in bfloat16, and so is
// its product with a bfloat16 input, so the only roundings are the float32 sums.
//
// Why not torch's int4 kernel: it de-quantizes the weights once per block of rows, so its
// cost grows with every row. Here a weight is decoded once per 8 rows (vector path) or 16
// (AMX path, below); on the vector path each row then costs one bfloat16 pair-dot
// (vdpbf16ps) per 2 inputs x 16 outputs, on the AMX path one tile product per 16 rows.
//
// A row's result does not depend on the rows beside it or on the threads: every row runs the
// same instructions in the same order whatever the block it falls in (no reassociation:
// built without -ffast-math), and threads split the outputs, never the inputs. So a decode
// step and a speculative verification of several rows per sequence agree bit for bit.
//
// Packed layout (``pack`` in engine/weights/int4_tiles.py), uint8 (T, G, 320), T = N / 16:
// tile t holds outputs 16t..16t+15; per group, 256 bytes of codes then s and m as float16
// (16 each). Code bytes come in 8 chunks of 32: byte 2i + j of chunk q holds output i's
// code for input 2q + j in its low nibble and for input 16 + 2q + j in its high nibble, so
// one chunk widened to 16-bit lanes gives, nibble by nibble, two (16 outputs x 2 inputs)
// operands of vdpbf16ps.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <array>
#include <atomic>
#include <utility>
#include <vector>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kCodeBytes = kGroup * kTile / 2;      // 256
constexpr int64_t kGroupBytes = kCodeBytes + 4 * kTile;  // + s and m, float16: 320
constexpr int kMaxRows = 8;                             // rows per pass over a tile

// Groups read ahead of the one decoded: a tile's groups are contiguous, but a step streams
// 120 layers' weights once each, and at one row the hardware prefetcher alone leaves the
// kernel waiting on memory (one A/B here: 7.3 against 5.9 ms for a one-row step).
constexpr int64_t kAhead = 4;

inline void prefetch_group(const uint8_t* p) {
  for (int64_t line = 0; line < kGroupBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

#define PDSERVE_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,f16c,fma")))

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

// RB rows x NT tiles of outputs over every group. x: bfloat16 (RB, K), row stride ldx;
// xsum: float32 (RB, G), row stride G; y: float32 (RB, N), row stride ldy.
template <int RB, int NT>
PDSERVE_TARGET void tiles_kernel(const uint16_t* x, int64_t ldx, const float* xsum,
                                 const uint8_t* w, int64_t groups, int64_t tile0, float* y,
                                 int64_t ldy, int64_t n) {
  const __m512i lut = _mm512_load_si512(kCodeValues);
  const __m512i low4 = _mm512_set1_epi16(0x000F);

  __m512 acc[RB][NT];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();

  const int64_t tile_bytes = groups * kGroupBytes;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo[RB][NT], hi[RB][NT];  // inputs 0..15 and 16..31 of the group, apart
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NT; ++t) lo[r][t] = hi[r][t] = _mm512_setzero_ps();
    if (g + kAhead < groups)
      for (int t = 0; t < NT; ++t)
        prefetch_group(w + (tile0 + t) * tile_bytes + (g + kAhead) * kGroupBytes);
    for (int q = 0; q < 8; ++q) {
      __m512i w_lo[NT], w_hi[NT];
      for (int t = 0; t < NT; ++t) {
        const uint8_t* chunk = w + (tile0 + t) * tile_bytes + g * kGroupBytes + q * 32;
        const __m512i wide =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
        w_lo[t] = _mm512_permutexvar_epi16(_mm512_and_si512(wide, low4), lut);
        w_hi[t] = _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), lut);
      }
      for (int r = 0; r < RB; ++r) {
        uint32_t pair_lo, pair_hi;  // x[r, 32g + 2q .. +1] and x[r, 32g + 16 + 2q .. +1]
        std::memcpy(&pair_lo, x + r * ldx + g * kGroup + 2 * q, 4);
        std::memcpy(&pair_hi, x + r * ldx + g * kGroup + 16 + 2 * q, 4);
        const __m512bh b_lo = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_lo));
        const __m512bh b_hi = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_hi));
        for (int t = 0; t < NT; ++t) {
          lo[r][t] = _mm512_dpbf16_ps(lo[r][t], (__m512bh)w_lo[t], b_lo);
          hi[r][t] = _mm512_dpbf16_ps(hi[r][t], (__m512bh)w_hi[t], b_hi);
        }
      }
    }
    __m512 dot[RB][NT];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NT; ++t) dot[r][t] = _mm512_add_ps(lo[r][t], hi[r][t]);
    scale_group<RB, NT>(acc, dot, w, tile0, g, groups, xsum);
  }
  store_rows<RB, NT>(acc, tile0, y, ldy, n);
}

// Every row of one block of at most kMaxRows rows, over tiles [t0, t1).
template <int RB>
PDSERVE_TARGET void rows_block(const uint16_t* x, int64_t ldx, const float* xsum,
                               const uint8_t* w, int64_t groups, int64_t t0, int64_t t1,
                               float* y, int64_t ldy, int64_t n) {
  // More tiles at once for few rows: enough independent sums to hide vdpbf16ps's latency.
  constexpr int NT = RB <= 2 ? 4 : (RB <= 4 ? 2 : 1);
  int64_t t = t0;
  for (; t + NT <= t1; t += NT) tiles_kernel<RB, NT>(x, ldx, xsum, w, groups, t, y, ldy, n);
  for (; t < t1; ++t) tiles_kernel<RB, 1>(x, ldx, xsum, w, groups, t, y, ldy, n);
}

using BlockFn = void (*)(const uint16_t*, int64_t, const float*, const uint8_t*, int64_t, int64_t,
                         int64_t, float*, int64_t, int64_t);
constexpr BlockFn kBlocks[kMaxRows + 1] = {nullptr,        rows_block<1>, rows_block<2>,
                                            rows_block<3>, rows_block<4>, rows_block<5>,
                                            rows_block<6>, rows_block<7>, rows_block<8>};

// ---- AMX: the same sums on tiles -------------------------------------------------------
//
// Per group and tile of 16 outputs, the codes are decoded as above into a (16 pairs x 16
// outputs x 2) bfloat16 B tile, the group's inputs of up to 16 rows are the A tile, and one
// tdpbf16ps gives the (rows x 16) code products; the same float32 epilogue as the vector
// path scales them. The tile unit does each row's 32 products in the same order whatever
// the rows beside it, so a row's bits still do not depend on its batch.

#define PDSERVE_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512bf16,f16c,fma,amx-tile,amx-bf16")))

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kAmxRows = 16;

// Tiles: 0, 1 = C for two output tiles; 2 = A; 3, 4 = B for the two output tiles.
template <int RB, int NT>
PDSERVE_AMX_TARGET void amx_tiles(const uint16_t* x, int64_t ldx, const float* xsum,
                                  const uint8_t* w, int64_t groups, int64_t tile0, float* y,
                                  int64_t ldy, int64_t n) {
  const __m512i lut = _mm512_load_si512(kCodeValues);
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  alignas(64) uint16_t b[NT][16 * 32];    // B tiles: row p = inputs 2p, 2p + 1 of 16 outputs
  alignas(64) float c[NT][kAmxRows * 16];  // C tiles, read back for the epilogue

  __m512 acc[RB][NT];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t tile_bytes = groups * kGroupBytes;
  for (int64_t g = 0; g < groups; ++g) {
    for (int t = 0; t < NT; ++t) {
      const uint8_t* codes = w + (tile0 + t) * tile_bytes + g * kGroupBytes;
      if (g + kAhead < groups) prefetch_group(codes + kAhead * kGroupBytes);
      for (int q = 0; q < 8; ++q) {
        const __m512i wide = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 32)));
        _mm512_store_si512(b[t] + q * 32,
                           _mm512_permutexvar_epi16(_mm512_and_si512(wide, low4), lut));
        _mm512_store_si512(b[t] + (8 + q) * 32,
                           _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), lut));
      }
    }
    _tile_loadd(2, x + g * kGroup, ldx * 2);
    _tile_zero(0);
    _tile_loadd(3, b[0], 64);
    _tile_dpbf16ps(0, 2, 3);
    if constexpr (NT == 2) {
      _tile_zero(1);
      _tile_loadd(4, b[1], 64);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, c[0], 64);
    if constexpr (NT == 2) _tile_stored(1, c[1], 64);
    __m512 dot[RB][NT];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NT; ++t) dot[r][t] = _mm512_load_ps(c[t] + r * 16);
    scale_group<RB, NT>(acc, dot, w, tile0, g, groups, xsum);
  }
  store_rows<RB, NT>(acc, tile0, y, ldy, n);
}

template <int RB>
PDSERVE_AMX_TARGET void amx_block(const uint16_t* x, int64_t ldx, const float* xsum,
                                  const uint8_t* w, int64_t groups, int64_t t0, int64_t t1,
                                  float* y, int64_t ldy, int64_t n) {
  TileConfig cfg;
  for (int i : {0, 1, 2}) cfg.rows[i] = RB, cfg.colsb[i] = 64;
  for (int i : {3, 4}) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2) amx_tiles<RB, 2>(x, ldx, xsum, w, groups, t, y, ldy, n);
  for (; t < t1; ++t) amx_tiles<RB, 1>(x, ldx, xsum, w, groups, t, y, ldy, n);
  _tile_release();
}

template <int... R>
constexpr std::array<BlockFn, sizeof...(R) + 1> amx_blocks(std::integer_sequence<int, R...>) {
  return {nullptr, amx_block<R + 1>...};
}
constexpr auto kAmxBlocks = amx_blocks(std::make_integer_sequence<int, kAmxRows>{});

// Linux hands out the tile registers' state only on request, once per process.
bool amx_enabled() {
  static const bool enabled = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return __builtin_cpu_supports("amx-bf16") &&
           syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return enabled;
}

// x's M rows rounded to bfloat16 into xb (M, K) and X[r, g] into xsum (M, G): the float32
// sum of each group's 32 bfloat16 values, in one fixed order (so independent of M). One pass
// here, because at 1-8 rows the ATen cast, widening and sum it replaces (four dispatches,
// ~120 calls a step) cost more than a tile's products. x: float32 or bfloat16, unit stride
// along K.
PDSERVE_TARGET void prepare_rows(const at::Tensor& x, int64_t groups, uint16_t* xb, float* xsum) {
  const int64_t m_rows = x.size(0), k = groups * kGroup, ldx = x.stride(0);
  const bool wide = x.scalar_type() == at::kFloat;
  const float* xf = wide ? x.data_ptr<float>() : nullptr;
  const uint16_t* xh = wide ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m_rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * ldx + g * kGroup;
      __m512i v;  // the group's 32 bfloat16 values
      if (wide) {  // rounded to nearest even, as torch's cast
        v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xf + at + 16), _mm512_loadu_ps(xf + at));
      } else {
        v = _mm512_loadu_si512(xh + at);
      }
      _mm512_storeu_si512(xb + r * k + g * kGroup, v);
      const __m512 lo = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 0)), 16));
      const __m512 hi = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      xsum[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
}

// The int4 products' arguments: x (M, K), w uint8 (T, G, 320), n outputs in T tiles.
void check_gemm(const char* name, const at::Tensor& x, const at::Tensor& w, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3, name, ": x must be (M, K), w (T, G, 320)");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == kGroupBytes,
              name, ": w must be contiguous uint8 (T, G, ", kGroupBytes, ")");
  const int64_t k = x.size(1), tiles = w.size(0), groups = w.size(1);
  TORCH_CHECK(k == groups * kGroup, name, ": x has ", k, " inputs, w ", groups * kGroup);
  TORCH_CHECK(n > 0 && n <= tiles * kTile && n > (tiles - 1) * kTile,
              name, ": ", n, " outputs do not fit ", tiles, " tiles");
}

// x: (M, K) float32 or bfloat16; w: uint8 (T, G, 320); n <= 16 T outputs. -> (M, n) float32.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& w, int64_t n, bool use_amx) {
  check_gemm("int4_mm", x, w, n);
  const int64_t m_rows = x.size(0), k = x.size(1), tiles = w.size(0), groups = w.size(1);
  at::Tensor y = at::empty({m_rows, n}, x.options().dtype(at::kFloat));
  if (m_rows == 0) return y;
  const bool direct = (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                      x.stride(1) == 1;
  // Per calling thread, kept between calls: no allocation on the decode path.
  thread_local std::vector<uint16_t> xb;
  thread_local std::vector<float> xsum;
  xb.resize(size_t(m_rows * k));
  xsum.resize(size_t(m_rows * groups));
  prepare_rows(direct ? x : x.to(at::kFloat).contiguous(), groups, xb.data(), xsum.data());
  const uint16_t* xp = xb.data();
  const float* sp = xsum.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Threads split the tiles; a grain keeps each thread's slice long enough to stream.
  TORCH_CHECK(!use_amx || amx_enabled(), "int4_mm: AMX asked for, and this process cannot use it");
  const bool amx = use_amx;
  const int64_t block = amx ? kAmxRows : kMaxRows;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t r0 = 0; r0 < m_rows; r0 += block) {
      const int64_t rb = std::min<int64_t>(block, m_rows - r0);
      (amx ? kAmxBlocks[rb] : kBlocks[rb])(xp + r0 * k, k, sp + r0 * groups, wp, groups, t0, t1,
                                           yp + r0 * n, n, n);
    }
  });
  return y;
}

// ---- AMX, many rows: weights de-quantized to bfloat16 once per call ---------------------
//
// For prefills and large decode batches: each tile's weights are de-quantized once into
// bfloat16 B tiles (c s + m in float32, rounded to nearest even: the values a bfloat16 copy
// of the de-quantized weights holds) and every block of 16 rows is multiplied by them,
// accumulating over the groups in the C tiles. So M rows decode each weight once instead of
// M / 16 times and scale nothing per group, and no bfloat16 copy of the weights is kept.
// Numerically this is a bfloat16 GEMM (bfloat16 weights and inputs, float32 sums), not the
// kernel above: the two differ in the last bits, as the packed kernels and their GEMMs did.
// A row's bits still do not depend on the rows beside it.

// One tile's weights, (G, 16 pairs, 16 outputs x 2) bfloat16: B tiles, group by group.
PDSERVE_AMX_TARGET void dequantize_tile(const uint8_t* wt, int64_t groups, uint16_t* b) {
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  // Lane l of an operand's float32 half holds output l / 2 (of 8): its scale and offset.
  const __m512i half0 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i half1 = _mm512_add_epi32(half0, _mm512_set1_epi32(8));
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* grp = wt + g * kGroupBytes;
    if (g + kAhead < groups) prefetch_group(grp + kAhead * kGroupBytes);
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + kCodeBytes)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + kCodeBytes + 32)));
    const __m512 s0 = _mm512_permutexvar_ps(half0, s), s1 = _mm512_permutexvar_ps(half1, s);
    const __m512 m0 = _mm512_permutexvar_ps(half0, m), m1 = _mm512_permutexvar_ps(half1, m);
    uint16_t* bg = b + g * 16 * 32;
    for (int q = 0; q < 8; ++q) {
      const __m512i wide = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + q * 32)));
      const __m512i nibbles[2] = {_mm512_and_si512(wide, low4), _mm512_srli_epi16(wide, 4)};
      for (int h = 0; h < 2; ++h) {  // h = 0: inputs 2q, 2q + 1 (pair q); 1: pair 8 + q
        const __m512 f0 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(nibbles[h], 0))),
            s0, m0);
        const __m512 f1 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(nibbles[h], 1))),
            s1, m1);
        _mm512_store_si512(bg + (8 * h + q) * 32, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
      }
    }
  }
}

// Rows [0, M) times one or two de-quantized tiles (b1 null: one), into y's columns from col.
PDSERVE_AMX_TARGET void gemm_rows(const uint16_t* x, int64_t ldx, int64_t m_rows,
                                  const uint16_t* b0, const uint16_t* b1, int64_t groups,
                                  float* y, int64_t ldy, int64_t col, int64_t n) {
  alignas(64) float c[kAmxRows * 16];
  int64_t r0 = 0;
  if (b1 != nullptr && col + 2 * kTile <= n && m_rows >= 2 * kAmxRows) {
    // 32 rows x 2 tiles at a time: 4 C tiles fed by 2 A and 2 B loads a group (one load a
    // product, where 16 rows x 2 tiles take one and a half).
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
    for (; r0 + 2 * kAmxRows <= m_rows; r0 += 2 * kAmxRows) {
      const uint16_t* xr = x + r0 * ldx;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t g = 0; g < groups; ++g) {
        _tile_loadd(4, xr + g * kGroup, ldx * 2);
        _tile_loadd(5, xr + kAmxRows * ldx + g * kGroup, ldx * 2);
        _tile_loadd(6, b0 + g * 512, 64);
        _tile_loadd(7, b1 + g * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* out = y + r0 * ldy + col;
      _tile_stored(0, out, ldy * 4);
      _tile_stored(1, out + kTile, ldy * 4);
      _tile_stored(2, out + kAmxRows * ldy, ldy * 4);
      _tile_stored(3, out + kAmxRows * ldy + kTile, ldy * 4);
    }
  }
  int64_t configured = 0;
  for (; r0 < m_rows; r0 += kAmxRows) {
    const int64_t rb = std::min<int64_t>(kAmxRows, m_rows - r0);
    if (rb != configured) {
      TileConfig cfg;
      for (int i : {0, 1, 2}) cfg.rows[i] = uint8_t(rb), cfg.colsb[i] = 64;
      for (int i : {3, 4}) cfg.rows[i] = 16, cfg.colsb[i] = 64;
      _tile_loadconfig(&cfg);
      configured = rb;
    }
    const uint16_t* xr = x + r0 * ldx;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t g = 0; g < groups; ++g) {
      _tile_loadd(2, xr + g * kGroup, ldx * 2);
      _tile_loadd(3, b0 + g * 512, 64);
      _tile_dpbf16ps(0, 2, 3);
      if (b1 != nullptr) {
        _tile_loadd(4, b1 + g * 512, 64);
        _tile_dpbf16ps(1, 2, 4);
      }
    }
    for (int t = 0; t < (b1 != nullptr ? 2 : 1); ++t) {
      const int64_t at = col + t * kTile, left = std::min<int64_t>(kTile, n - at);
      float* out = y + r0 * ldy + at;
      if (left == kTile) {
        if (t == 0) _tile_stored(0, out, ldy * 4);
        else _tile_stored(1, out, ldy * 4);
        continue;
      }
      if (t == 0) _tile_stored(0, c, 64);
      else _tile_stored(1, c, 64);
      for (int64_t r = 0; r < rb; ++r) std::memcpy(out + r * ldy, c + r * 16, left * 4);
    }
  }
  _tile_release();
}

// x: (M, K) float32 or bfloat16; w: uint8 (T, G, 320); n <= 16 T outputs. -> (M, n) float32.
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  check_gemm("int4_gemm", x, w, n);
  const int64_t m_rows = x.size(0), k = x.size(1), tiles = w.size(0), groups = w.size(1);
  TORCH_CHECK(amx_enabled(), "int4_gemm: this process cannot use AMX");
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  at::Tensor y = at::empty({m_rows, n}, x.options().dtype(at::kFloat));
  if (m_rows == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = groups * kGroupBytes;
  // Pairs of tiles across threads; each de-quantizes its pair into its own buffer.
  at::parallel_for(0, (tiles + 1) / 2, 4, [&](int64_t p0, int64_t p1) {
    const size_t per_tile = size_t(groups) * 16 * 32;
    uint16_t* b = static_cast<uint16_t*>(std::aligned_alloc(64, 2 * per_tile * 2));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t = 2 * p;
      const bool two = t + 1 < tiles;
      dequantize_tile(wp + t * tile_bytes, groups, b);
      if (two) dequantize_tile(wp + (t + 1) * tile_bytes, groups, b + per_tile);
      gemm_rows(xp, k, m_rows, b, two ? b + per_tile : nullptr, groups, yp, n, t * kTile, n);
    }
    std::free(b);
  });
  return y;
}

// ---- AVX-512 VNNI, many rows: int8 inputs times the int4 codes -------------------------
//
// For prefills and large decode batches on CPUs without AMX. Each row's inputs are quantized
// per group of 32, as llama.cpp quantizes activations for its Q4 dot products (Q8_1):
// d = max |x| / 127, q = round(x / d) in [-127, 127]. Then
//     y[r, n] = sum_g  s[n, g] d[r, g] (sum_{k in g} q[r, k] c[n, k])  +  m[n, g] X[r, g]
// with X[r, g] = d[r, g] * sum_{k in g} q[r, k], the sum of the quantized inputs (see
// quantize_rows for why not the exact sum). The code products are exact int32 sums (vpdpbusd: 4 unsigned codes x
// 4 signed inputs a lane), 64 products an instruction where vdpbf16ps takes 32.
//
// Each thread de-quantizes nothing: it widens the codes of its two tiles once per call into
// a scratch of whole bytes (the layout vpdpbusd reads) and multiplies every row block by
// them. A row's quantization and sums do not depend on the rows beside it or the threads,
// so a row's bits do not depend on its batch.
#define PDSERVE_VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,f16c,fma")))

constexpr int64_t kA8Tiles = 2;  // tiles (of 16 outputs) a thread widens and multiplies at once
constexpr int kA8Rows = 4;       // rows a pass over the widened tiles

// Row r's group g: 32 int8 inputs in the codes' order (chunk q: inputs 2q, 2q + 1, 16 + 2q,
// 17 + 2q, see the layout at the top), then d and X go to their own arrays.
PDSERVE_VNNI_TARGET void quantize_rows(const at::Tensor& x, int64_t groups, int8_t* xq,
                                       float* xd, float* xs, int64_t r0, int64_t r1) {
  const int64_t ldx = x.stride(0);
  const bool wide = x.scalar_type() == at::kFloat;
  const float* xf = wide ? x.data_ptr<float>() : nullptr;
  const uint16_t* xh = wide ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * ldx + g * kGroup;
      __m512 lo, hi;  // inputs 0..15 and 16..31
      if (wide) {
        lo = _mm512_loadu_ps(xf + at);
        hi = _mm512_loadu_ps(xf + at + 16);
      } else {
        const __m512i v = _mm512_loadu_si512(xh + at);
        lo = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 0)), 16));
        hi = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      // Rounded to nearest even (the default rounding mode), as torch.round would.
      const __m512i ilo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
      const __m512i ihi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      const __m128i qlo = _mm512_cvtsepi32_epi8(ilo), qhi = _mm512_cvtsepi32_epi8(ihi);
      int8_t* out = xq + (r * groups + g) * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi16(qlo, qhi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_unpackhi_epi16(qlo, qhi));
      xd[r * groups + g] = d;
      // The offset term takes the quantized inputs too (llama.cpp's Q8_1 keeps d * sum q for
      // it): the codes are all >= 0, so the code products and the offset term are large and
      // cancel; with the exact sum here, the codes' share of the quantization error would be
      // left uncancelled (measured: 3x the error of this on SmolLM2's layers).
      xs[r * groups + g] = d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(ilo, ihi)));
    }
  }
}

// One tile's codes as whole bytes, group by group: (G, 8 chunks, 16 outputs x 4 inputs), and
// its s and m as float32 (G, 2, 16). Chunk q's 32 bytes, widened to one 32-bit lane per
// output, hold (low to high nibble) codes for inputs 2q, 16 + 2q, 2q + 1, 17 + 2q; the lane
// becomes the bytes of inputs 2q, 2q + 1, 16 + 2q, 17 + 2q: (v | v << 12) & 0x0F0F0F0F.
PDSERVE_VNNI_TARGET void widen_tile(const uint8_t* wt, int64_t groups, uint8_t* codes,
                                    float* sm) {
  const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* src = wt + g * kGroupBytes;
    for (int q = 0; q < 8; ++q) {
      const __m512i v =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + q * 32)));
      const __m512i b = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8);
      _mm512_store_si512(codes + (g * 8 + q) * 64, b);
    }
    _mm512_store_ps(sm + g * 32,
                    _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kCodeBytes))));
    _mm512_store_ps(sm + g * 32 + 16, _mm512_cvtph_ps(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(src + kCodeBytes + 32))));
  }
}

// RB rows x NT widened tiles (codes[t], sm[t]) over every group, into y's columns from col.
template <int RB, int NT>
PDSERVE_VNNI_TARGET void a8_kernel(const int8_t* xq, const float* xd, const float* xs,
                                   int64_t groups, const uint8_t* const (&codes)[NT],
                                   const float* const (&sm)[NT], float* y, int64_t ldy,
                                   int64_t col, int64_t n) {
  __m512 acc[RB][NT];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[RB][NT];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NT; ++t) dot[r][t] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
      __m512i w[NT];
      for (int t = 0; t < NT; ++t) w[t] = _mm512_load_si512(codes[t] + (g * 8 + q) * 64);
      for (int r = 0; r < RB; ++r) {
        int32_t four;
        std::memcpy(&four, xq + (r * groups + g) * kGroup + q * 4, 4);
        const __m512i a = _mm512_set1_epi32(four);
        for (int t = 0; t < NT; ++t) dot[r][t] = _mm512_dpbusd_epi32(dot[r][t], w[t], a);
      }
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 d = _mm512_set1_ps(xd[r * groups + g]);
      const __m512 sum = _mm512_set1_ps(xs[r * groups + g]);
      for (int t = 0; t < NT; ++t) {
        const __m512 s = _mm512_mul_ps(_mm512_load_ps(sm[t] + g * 32), d);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][t]), s, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_load_ps(sm[t] + g * 32 + 16), sum, acc[r][t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t at = col + t * kTile;
    const int64_t left = std::min<int64_t>(kTile, n - at);
    const __mmask16 mask = left >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy + at, mask, acc[r][t]);
  }
}

template <int NT>
PDSERVE_VNNI_TARGET void a8_rows(const int8_t* xq, const float* xd, const float* xs,
                                 int64_t m_rows, int64_t groups, const uint8_t* const (&codes)[NT],
                                 const float* const (&sm)[NT], float* y, int64_t ldy, int64_t col,
                                 int64_t n) {
  int64_t r0 = 0;
  for (; r0 + kA8Rows <= m_rows; r0 += kA8Rows) {
    a8_kernel<kA8Rows, NT>(xq + r0 * groups * kGroup, xd + r0 * groups, xs + r0 * groups, groups,
                           codes, sm, y + r0 * ldy, ldy, col, n);
  }
  for (; r0 < m_rows; ++r0) {
    a8_kernel<1, NT>(xq + r0 * groups * kGroup, xd + r0 * groups, xs + r0 * groups, groups, codes,
                     sm, y + r0 * ldy, ldy, col, n);
  }
}

bool vnni_supported() {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return supported;
}

// x: (M, K) float32 or bfloat16; w: uint8 (T, G, 320); n <= 16 T outputs. -> (M, n) float32.
at::Tensor int4_gemm_a8(const at::Tensor& x_in, const at::Tensor& w, int64_t n) {
  check_gemm("int4_gemm_a8", x_in, w, n);
  const int64_t m_rows = x_in.size(0), k = x_in.size(1), tiles = w.size(0), groups = w.size(1);
  TORCH_CHECK(vnni_supported(), "int4_gemm_a8: this CPU has no AVX-512 VNNI");
  at::Tensor y = at::empty({m_rows, n}, x_in.options().dtype(at::kFloat));
  if (m_rows == 0) return y;
  const bool direct = (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) &&
                      x_in.stride(1) == 1;
  const at::Tensor x = direct ? x_in : x_in.to(at::kFloat).contiguous();
  std::vector<int8_t> xq(size_t(m_rows * k));
  std::vector<float> xd(size_t(m_rows * groups)), xs(size_t(m_rows * groups));
  at::parallel_for(0, m_rows, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(x, groups, xq.data(), xd.data(), xs.data(), r0, r1);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = groups * kGroupBytes;
  const int64_t blocks = (tiles + kA8Tiles - 1) / kA8Tiles;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const size_t code_bytes = size_t(groups) * 8 * 64, sm_floats = size_t(groups) * 32;
    auto* codes = static_cast<uint8_t*>(std::aligned_alloc(64, kA8Tiles * code_bytes));
    auto* sm = static_cast<float*>(std::aligned_alloc(64, kA8Tiles * sm_floats * 4));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = b * kA8Tiles, nt = std::min<int64_t>(kA8Tiles, tiles - t);
      for (int64_t i = 0; i < nt; ++i)
        widen_tile(wp + (t + i) * tile_bytes, groups, codes + i * code_bytes, sm + i * sm_floats);
      if (nt == 2) {
        const uint8_t* const c[2] = {codes, codes + code_bytes};
        const float* const s[2] = {sm, sm + sm_floats};
        a8_rows<2>(xq.data(), xd.data(), xs.data(), m_rows, groups, c, s, yp, n, t * kTile, n);
      } else {
        const uint8_t* const c[1] = {codes};
        const float* const s[1] = {sm};
        a8_rows<1>(xq.data(), xd.data(), xs.data(), m_rows, groups, c, s, yp, n, t * kTile, n);
      }
    }
    std::free(codes);
    std::free(sm);
  });
  return y;
}

// ---- SiLU(gate) * up in one pass -------------------------------------------------------
//
// Between the MLP's two projections. torch runs it as a widening cast, silu, then a
// multiply (three passes; a mixed-dtype multiply when the gate_up projection came out in
// bfloat16), which at 256 prefill rows costs more than a tenth of the layer's GEMMs' time.

// exp(x) = 2^n p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), p Cephes'
// degree-6 polynomial for expf.
// (AVX-512 VL for the 16-lane bfloat16 loads and stores: every AVX-512 BF16 CPU has it.)
#define PDSERVE_VL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

PDSERVE_VL_TARGET inline __m512 exp_ps(__m512 x) {
  // Below the clamp exp is 0 to float32; above it, 2^n overflows to inf, as expf does.
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365478515625f)), _mm512_set1_ps(100.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 16 lanes (mask: the valid ones) of float32 or bfloat16 values, widened to float32.
PDSERVE_VL_TARGET inline __m512 load_ps(const void* p, bool bf16, __mmask16 mask) {
  if (!bf16) return _mm512_maskz_loadu_ps(mask, p);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

PDSERVE_VL_TARGET void silu_mul_rows(const void* in, bool in_bf16, int64_t ld_in, void* out,
                                  bool out_bf16, int64_t inter, int64_t r0, int64_t r1) {
  const int64_t in_size = in_bf16 ? 2 : 4, out_size = out_bf16 ? 2 : 4;
  for (int64_t r = r0; r < r1; ++r) {
    const char* g = static_cast<const char*>(in) + r * ld_in * in_size;
    const char* u = g + inter * in_size;
    char* o = static_cast<char*>(out) + r * inter * out_size;
    for (int64_t i = 0; i < inter; i += 16) {
      const int64_t left = std::min<int64_t>(16, inter - i);
      const __mmask16 mask = left == 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      const __m512 gv = load_ps(g + i * in_size, in_bf16, mask);
      const __m512 uv = load_ps(u + i * in_size, in_bf16, mask);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      const __m512 y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), uv);
      if (out_bf16) {
        _mm256_mask_storeu_epi16(o + i * 2, mask, (__m256i)_mm512_cvtneps_pbh(y));
      } else {
        _mm512_mask_storeu_ps(o + i * 4, mask, y);
      }
    }
  }
}

// gate_up: (T, 2 I) float32 or bfloat16, gate columns then up columns, unit stride along
// the row. -> silu(gate) * up, (T, I) in dtype (float32 or bfloat16, rounded once).
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType dtype) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be (T, 2 I)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "silu_mul: out dtype must be float32 or bfloat16");
  const bool direct = (gate_up.scalar_type() == at::kFloat ||
                       gate_up.scalar_type() == at::kBFloat16) &&
                      gate_up.stride(1) == 1;
  const at::Tensor x = direct ? gate_up : gate_up.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options().dtype(dtype));
  if (rows == 0 || inter == 0) return out;
  const bool in_bf16 = x.scalar_type() == at::kBFloat16, out_bf16 = dtype == at::kBFloat16;
  const void* in = x.data_ptr();
  void* o = out.data_ptr();
  const int64_t ld = x.stride(0);
  // Rows across threads, enough per thread (~32k values) to outweigh waking it.
  const int64_t grain = std::max<int64_t>(1, 32768 / inter);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    silu_mul_rows(in, in_bf16, ld, o, out_bf16, inter, r0, r1);
  });
  return out;
}

// ---- Rotary + K/V store in one pass ---------------------------------------------------
//
// Between a layer's qkv projection and its attention. The fused backend otherwise widens
// qkv to float32 (rotary reads its tables' dtype), rotates q and k in place, rounds the
// whole of qkv to the cache's dtype, then scatters K and V into the pool with a fourth op;
// four passes (four dispatches a layer at one decode row), where this is one.
//
// The cache is the attention library's ``vec16`` order (``engine/model/fused_cpu.py``):
// per block and KV head, K as (D, block_size) (a token's values a column apart) and V as
// (block_size, D); ``key_cache`` / ``value_cache`` are one layer's (num_blocks, KVH,
// block_size, D) views of the pool, strides (any, any, D, 1).

PDSERVE_VL_TARGET inline void store_ps(void* p, bool bf16, __m512 v) {
  if (bf16) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  } else {
    _mm512_storeu_ps(p, v);
  }
}

// One token. Neox rotation: for i < D / 2, x1 = x[i], x2 = x[i + D / 2]:
//   x1 cos_i - x2 sin_i, x2 cos_i + x1 sin_i (float32, then rounded once to the cache's dtype).
PDSERVE_VL_TARGET __attribute__((optimize("fp-contract=off"))) void rope_store_token(
    const char* row, bool in_bf16, const float* cs, int64_t h, int64_t kvh, int64_t d,
    int64_t bs, char* q_out, char* k_dst, char* v_dst, bool c_bf16) {
  // k_dst, v_dst: the token's place in KV head 0's chunk of its block (null: not stored).
  const int64_t in_size = in_bf16 ? 2 : 4, c_size = c_bf16 ? 2 : 4, half = d / 2;
  const int64_t head_bytes = bs * d * c_size;  // one KV head's chunk of a block
  alignas(64) float k_rot[512];  // one K head, rotated (D <= 512)
  for (int64_t head = 0; head < h + kvh; ++head) {
    const char* x = row + head * d * in_size;
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 c = _mm512_loadu_ps(cs + i), s = _mm512_loadu_ps(cs + half + i);
      const __m512 x1 = load_ps(x + i * in_size, in_bf16, 0xFFFF);
      const __m512 x2 = load_ps(x + (half + i) * in_size, in_bf16, 0xFFFF);
      // The cosine product rounded, the sine product fused into it: the bits of the
      // library's rotary (checked in tests/engine/test_fused_cpu.py), so this path stores
      // what the four-op one did; no other contraction (``fp-contract=off``).
      const __m512 o1 = _mm512_fnmadd_ps(x2, s, _mm512_mul_ps(x1, c));
      const __m512 o2 = _mm512_fmadd_ps(x1, s, _mm512_mul_ps(x2, c));
      if (head < h) {
        char* o = q_out + head * d * c_size;
        store_ps(o + i * c_size, c_bf16, o1);
        store_ps(o + (half + i) * c_size, c_bf16, o2);
      } else {
        _mm512_store_ps(k_rot + i, o1);
        _mm512_store_ps(k_rot + half + i, o2);
      }
    }
    if (head < h || k_dst == nullptr) continue;
    // K's column: value e of this head goes e * block_size elements on.
    char* k = k_dst + (head - h) * head_bytes;
    if (c_bf16) {
      alignas(64) uint16_t rounded[512];
      for (int64_t i = 0; i < d; i += 16)
        _mm256_store_si256(reinterpret_cast<__m256i*>(rounded + i),
                           (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(k_rot + i)));
      uint16_t* kb = reinterpret_cast<uint16_t*>(k);
      for (int64_t e = 0; e < d; ++e) kb[e * bs] = rounded[e];
    } else {
      float* kf = reinterpret_cast<float*>(k);
      for (int64_t e = 0; e < d; ++e) kf[e * bs] = k_rot[e];
    }
  }
  if (v_dst == nullptr) return;
  // V: unrotated, rounded to the cache's dtype, one contiguous row per head.
  const char* v = row + (h + kvh) * d * in_size;
  for (int64_t head = 0; head < kvh; ++head) {
    char* o = v_dst + head * head_bytes;
    for (int64_t i = 0; i < d; i += 16)
      store_ps(o + i * c_size, c_bf16, load_ps(v + (head * d + i) * in_size, in_bf16, 0xFFFF));
  }
}

// qkv: (T, (H + 2 KVH) D) float32 or bfloat16, unit stride along the row: q, k, v of each
// token. positions: (T,) int64; cos_sin: (P, D) float32, a position's D / 2 cosines then
// sines; slots: (T,) int64, block * block_size + offset (negative: not stored).
// -> q (T, H, D) rotated, in the cache's dtype; K and V written into the caches.
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& positions,
                      const at::Tensor& cos_sin, at::Tensor key_cache, at::Tensor value_cache,
                      const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_store: qkv must be (T, N), unit stride");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "rope_store: qkv must be float32 or bfloat16");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.strides() == key_cache.strides() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "rope_store: key and value caches must be alike (num_blocks, KVH, bs, D) views");
  TORCH_CHECK(key_cache.scalar_type() == at::kFloat || key_cache.scalar_type() == at::kBFloat16,
              "rope_store: the caches must be float32 or bfloat16");
  const int64_t t = qkv.size(0), kvh = key_cache.size(1), bs = key_cache.size(2),
                d = key_cache.size(3);
  TORCH_CHECK(num_kv_heads == kvh && d % 32 == 0 && d <= 512 && key_cache.stride(3) == 1 &&
                  key_cache.stride(2) == d && key_cache.stride(1) == bs * d,
              "rope_store: unsupported cache view or head size");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * kvh) * d, "rope_store: qkv width mismatch");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                  cos_sin.size(1) == d,
              "rope_store: cos_sin must be contiguous float32 (P, D)");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.numel() == t && slots.numel() == t && positions.is_contiguous() &&
                  slots.is_contiguous(),
              "rope_store: positions and slots must be (T,) contiguous int64");
  const bool c_bf16 = key_cache.scalar_type() == at::kBFloat16;
  at::Tensor q = at::empty({t, num_heads, d}, qkv.options().dtype(key_cache.scalar_type()));
  if (t == 0) return q;
  const bool in_bf16 = qkv.scalar_type() == at::kBFloat16;
  const int64_t in_size = in_bf16 ? 2 : 4, c_size = c_bf16 ? 2 : 4;
  const int64_t ld = qkv.stride(0) * in_size, block_stride = key_cache.stride(0) * c_size;
  const int64_t max_pos = cos_sin.size(0), num_blocks = key_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "rope_store: position out of range");
    TORCH_CHECK(slot[i] < num_blocks * bs, "rope_store: slot out of range");
  }
  const char* in = static_cast<const char*>(qkv.data_ptr());
  const float* table = cos_sin.data_ptr<float>();
  char* q_out = static_cast<char*>(q.data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t h = num_heads;
  // Tokens across threads, enough per thread (~32k values) to outweigh waking it.
  const int64_t grain = std::max<int64_t>(1, 32768 / qkv.size(1));
  at::parallel_for(0, t, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      char* k_dst = nullptr;
      char* v_dst = nullptr;
      if (slot[i] >= 0) {
        const int64_t block = slot[i] / bs, off = slot[i] % bs;
        k_dst = kc + block * block_stride + off * c_size;
        v_dst = vc + block * block_stride + off * d * c_size;
      }
      rope_store_token(in + i * ld, in_bf16, table + pos[i] * d, h, kvh, d, bs,
                       q_out + i * h * d * c_size, k_dst, v_dst, c_bf16);
    }
  });
  return q;
}

// ---- Decode attention over the paged pool ------------------------------------------------
//
// Query rows that each attend over their own length of a sequence's context in the pool
// (one a sequence in a decode step; a speculative verification's k + 1, each as its decode
// step would), in the library's ``vec16`` order (see rope_store above: per block and KV
// head, K as (D, block_size), V as (block_size, D)). A decode step is bound by reading that
// context; the library's kernel reads it at ~15 GB/s here, where a copy of the pool moves
// ~20 GB/s each way (``benchmarks/results/fused_ops.md``).
//
// A task is (query row, KV head, part of the row's context): its G = H / KVH query heads
// share every K and V load. Per 16 tokens: the scores of a head are one vector (K's columns
// are tokens), then an online softmax (running max and sum per head) and V's rows
// accumulated in float32. Blocks are prefetched one ahead (a table's blocks are anywhere in
// the pool). A row's result does not depend on the rows beside it or on the threads: each
// row runs the same instructions in the same order whatever the batch.

// Argument checks the two attentions share. key_cache / value_cache: one layer's
// (num_blocks, KVH, block_size, D) views of the pool, a block's head chunk contiguous.
void check_kv_views(const char* name, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    int64_t d) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 &&
                  key_cache.strides() == value_cache.strides() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              name, ": K and V must be (num_blocks, KVH, block_size, D) views alike");
  const int64_t bs = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == d && key_cache.stride(3) == 1 && key_cache.stride(2) == d &&
                  key_cache.stride(1) == bs * d,
              name, ": each block's head chunk must be (block_size, D) contiguous");
}

void check_block_tables(const char* name, const at::Tensor& block_tables, int64_t b_rows) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == b_rows && block_tables.is_contiguous(),
              name, ": block_tables must be contiguous int32 (B, W)");
}

// The first ``used`` entries of one table name blocks inside the pool of ``nb``.
void check_blocks(const char* what, int64_t b, const int32_t* table, int64_t used, int64_t nb) {
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < nb, what, b, " names block ", table[j]);
}

constexpr int64_t kAttnAhead = 1;  // blocks read ahead
constexpr int64_t kSplitTokens = 512;

// One block's K and V chunks of one head (``bytes`` each, from ``at`` past each base).
inline void prefetch_kv(const char* k, const char* v, int64_t at, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(k + at + line, _MM_HINT_T0);
    _mm_prefetch(v + at + line, _MM_HINT_T0);
  }
}

// The running softmax of one query row's G heads over the tokens it has seen so far: per head
// its max, its sum of exponentials and its weighted sum of V rows, float32 (none seen yet:
// max -inf, sum 0).
template <int G, int DV>
struct RowState {
  __m512 acc[G][DV];
  float m[G], l[G];
};

// One row's G heads over one 16-token chunk of a block: ``valid`` tokens from ``off``.
// Every caller (a decode row alone, or among a verification's rows) runs this same code
// on the same inputs in the same order, so a row's bits never depend on the rows beside
// it; fp-contract=off keeps the compiler from fusing the scalar steps one way here and
// another there. Its caller carries the same attribute: GCC does not inline a function
// whose optimize options differ from its caller's, and a call a chunk costs ~10 %.
#define PDSERVE_EXACT_FP __attribute__((optimize("fp-contract=off")))
template <int G, int DV, bool BF16>
PDSERVE_VL_TARGET PDSERVE_EXACT_FP inline void attend_chunk(
    const float (&q)[G][DV * 16], const char* kb, const char* vb, int64_t bs, int64_t off,
    int64_t valid, RowState<G, DV>& st) {
  constexpr int64_t D = DV * 16, esize = BF16 ? 2 : 4;
  const __mmask16 mask = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  // Four partial sums a head (dimensions d = j mod 4), so that no chain of D dependent
  // multiply-adds sets the pace.
  __m512 part[G][4];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < 4; ++j) part[h][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 4) {
    for (int j = 0; j < 4; ++j) {
      const __m512 k = load_ps(kb + ((d + j) * bs + off) * esize, BF16, mask);
      for (int h = 0; h < G; ++h)
        part[h][j] = _mm512_fmadd_ps(_mm512_set1_ps(q[h][d + j]), k, part[h][j]);
    }
  }
  alignas(64) float p[G][16];
  for (int h = 0; h < G; ++h) {
    const __m512 s = _mm512_add_ps(_mm512_add_ps(part[h][0], part[h][1]),
                                   _mm512_add_ps(part[h][2], part[h][3]));
    const __m512 sm = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), s);
    const float m_new = std::max(st.m[h], _mm512_reduce_max_ps(sm));
    const __m512 e = _mm512_maskz_mov_ps(mask, exp_ps(_mm512_sub_ps(sm, _mm512_set1_ps(m_new))));
    const float corr = st.m[h] == -INFINITY ? 0.0f : std::exp(st.m[h] - m_new);
    st.l[h] = st.l[h] * corr + _mm512_reduce_add_ps(e);
    st.m[h] = m_new;
    for (int v = 0; v < DV; ++v) st.acc[h][v] = _mm512_mul_ps(st.acc[h][v], _mm512_set1_ps(corr));
    _mm512_store_ps(p[h], e);
  }
  for (int64_t t = 0; t < valid; ++t) {
    __m512 vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = load_ps(vb + ((off + t) * D + v * 16) * esize, BF16, 0xFFFF);
    for (int h = 0; h < G; ++h) {
      const __m512 w = _mm512_set1_ps(p[h][t]);
      for (int v = 0; v < DV; ++v) st.acc[h][v] = _mm512_fmadd_ps(w, vv[v], st.acc[h][v]);
    }
  }
}

// G heads over tokens [t_begin, t_end) of one sequence. With ``out`` (the whole context):
// their attention, normalized, in the cache's dtype. Else the softmax state into ``state``
// (G, 2 + D): per head its running max, its sum of exponentials and its weighted sum of V
// rows, float32 (an empty range: max -inf, sum 0).
template <int G, int DV, bool BF16>
PDSERVE_VL_TARGET PDSERVE_EXACT_FP void decode_attention_part(
    const void* q_row, const char* k_head0, const char* v_head0, int64_t block_stride,
    const int32_t* table, int64_t bs, int64_t t_begin, int64_t t_end, float scale,
    float* state, void* out) {
  constexpr int64_t D = DV * 16, esize = BF16 ? 2 : 4;
  float q[G][D];
  RowState<G, DV> st;
  for (int h = 0; h < G; ++h) {
    for (int v = 0; v < DV; ++v) {
      _mm512_storeu_ps(&q[h][v * 16],
                       _mm512_mul_ps(load_ps(static_cast<const char*>(q_row) + (h * D + v * 16) * esize,
                                             BF16, 0xFFFF),
                                     _mm512_set1_ps(scale)));
      st.acc[h][v] = _mm512_setzero_ps();
    }
    st.m[h] = -INFINITY;
    st.l[h] = 0.0f;
  }
  const int64_t chunk_bytes = bs * D * esize, last_block = (t_end - 1) / bs;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
    const int64_t block = table[t0 / bs], off = t0 % bs;
    const char* kb = k_head0 + (block * block_stride) * esize;
    const char* vb = v_head0 + (block * block_stride) * esize;
    if ((off == 0 || t0 == t_begin) && t0 / bs + kAttnAhead <= last_block)
      prefetch_kv(k_head0, v_head0, table[t0 / bs + kAttnAhead] * block_stride * esize, chunk_bytes);
    attend_chunk<G, DV, BF16>(q, kb, vb, bs, off, std::min<int64_t>(16, t_end - t0), st);
  }
  for (int h = 0; h < G; ++h) {
    if (out != nullptr) {
      const __m512 inv = _mm512_set1_ps(1.0f / st.l[h]);
      for (int v = 0; v < DV; ++v)
        store_ps(static_cast<char*>(out) + (h * D + v * 16) * esize, BF16,
                 _mm512_mul_ps(st.acc[h][v], inv));
      continue;
    }
    float* dst = state + h * (2 + D);
    dst[0] = st.m[h];
    dst[1] = st.l[h];
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(dst + 2 + v * 16, st.acc[h][v]);
  }
}

using DecodePart = void (*)(const void*, const char*, const char*, int64_t, const int32_t*,
                            int64_t, int64_t, int64_t, float, float*, void*);

template <int G, int DV>
DecodePart decode_part(bool bf16) {
  return bf16 ? &decode_attention_part<G, DV, true> : &decode_attention_part<G, DV, false>;
}

template <int DV>
DecodePart decode_part_for(int64_t g, bool bf16) {
  switch (g) {
    case 1: return decode_part<1, DV>(bf16);
    case 2: return decode_part<2, DV>(bf16);
    case 3: return decode_part<3, DV>(bf16);
    case 4: return decode_part<4, DV>(bf16);
    case 5: return decode_part<5, DV>(bf16);
    case 6: return decode_part<6, DV>(bf16);
    case 7: return decode_part<7, DV>(bf16);
    case 8: return decode_part<8, DV>(bf16);
    default: return nullptr;
  }
}

// Two states of one head (2 + D floats each) merged, normalized, stored in the cache's dtype.
PDSERVE_VL_TARGET void merge_parts(const float* a, const float* b, int64_t d, bool bf16,
                                   char* out) {
  const float m = std::max(a[0], b[0]);  // a's range is never empty
  const float ea = std::exp(a[0] - m), eb = b[0] == -INFINITY ? 0.0f : std::exp(b[0] - m);
  const __m512 wa = _mm512_set1_ps(ea / (a[1] * ea + b[1] * eb));
  const __m512 wb = _mm512_set1_ps(eb / (a[1] * ea + b[1] * eb));
  for (int64_t v = 0; v < d; v += 16) {
    const __m512 o = _mm512_fmadd_ps(_mm512_loadu_ps(a + 2 + v), wa,
                                     _mm512_mul_ps(_mm512_loadu_ps(b + 2 + v), wb));
    store_ps(out + v * (bf16 ? 2 : 4), bf16, o);
  }
}

// q: (B, H, D) in the cache's dtype, contiguous; key_cache / value_cache: one layer's
// (num_blocks, KVH, block_size, D) views (rope_store's); block_tables: int32 (S, W), one a
// sequence; seq_lens: int32 (B,), each row's context length (>= 1); q_starts: int32
// (S + 1,), sequence s's rows are [q_starts[s], q_starts[s + 1]) (None: one row a sequence,
// S = B). -> (B, H, D) in the cache's dtype.
//
// A decode step has one row a sequence; a speculative verification has k + 1, each a query
// over its own length of the same context, each row's result bit for bit what a decode step
// of that length gives (the same decode_attention_part on the same range). A row longer than
// kSplitTokens is split in two halves (by 16-token chunks), their states merged after, so
// that a few long sequences still fill the cores. Whether and where a row is split depends
// on its length alone, never on the batch, the rows beside it or the threads.
//
// The (row, KV head, part) items are ordered sequence by sequence, KV head by KV head, and
// within that row by row, so that a verification's rows read one head's context one after
// the other on one core: the first from memory, the next from L2. Each worker takes one
// contiguous run of items, the runs cut where their tokens balance.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale,
                            const std::optional<at::Tensor>& q_starts) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "decode_attention: q must be contiguous (B, H, D)");
  check_kv_views("decode_attention", key_cache, value_cache, q.size(2));
  const int64_t b_rows = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t kvh = key_cache.size(1), bs = key_cache.size(2);
  const bool bf16 = key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || key_cache.scalar_type() == at::kFloat,
              "decode_attention: the cache must be float32 or bfloat16");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type(),
              "decode_attention: q must be in the cache's dtype");
  TORCH_CHECK(bs % 16 == 0 && kvh > 0 && h % kvh == 0,
              "decode_attention: block size ", bs, ", heads ", h, " over ", kvh);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == b_rows &&
                  seq_lens.is_contiguous(),
              "decode_attention: seq_lens must be int32 (B,)");
  std::vector<int32_t> starts;
  if (q_starts.has_value()) {
    const at::Tensor& qs = *q_starts;
    TORCH_CHECK(qs.scalar_type() == at::kInt && qs.dim() == 1 && qs.numel() >= 1 &&
                    qs.is_contiguous(),
                "decode_attention: q_starts must be int32 (S + 1,)");
    starts.assign(qs.data_ptr<int32_t>(), qs.data_ptr<int32_t>() + qs.numel());
    TORCH_CHECK(starts.front() == 0 && starts.back() == b_rows,
                "decode_attention: q_starts must run from 0 to the ", b_rows, " rows");
    for (size_t s = 1; s < starts.size(); ++s)
      TORCH_CHECK(starts[s] >= starts[s - 1], "decode_attention: q_starts must not decrease");
  } else {
    starts.resize(size_t(b_rows + 1));
    for (int64_t b = 0; b <= b_rows; ++b) starts[size_t(b)] = int32_t(b);
  }
  const int64_t seqs = int64_t(starts.size()) - 1;
  check_block_tables("decode_attention", block_tables, seqs);
  const int64_t g = h / kvh, width = block_tables.size(1);
  const DecodePart run = d == 64 ? decode_part_for<4>(g, bf16)
                         : d == 128 ? decode_part_for<8>(g, bf16) : nullptr;
  TORCH_CHECK(run != nullptr, "decode_attention: head size ", d, " with ", g,
              " heads a KV head is not built");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t nb = key_cache.size(0);
  for (int64_t s = 0; s < seqs; ++s) {
    int32_t longest = 0;
    for (int32_t b = starts[size_t(s)]; b < starts[size_t(s + 1)]; ++b) {
      TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * bs, "decode_attention: row ", b, " has ",
                  lens[b], " tokens for ", width, " blocks");
      longest = std::max(longest, lens[b]);
    }
    check_blocks("decode_attention: sequence ", s, tables + s * width, (longest + bs - 1) / bs, nb);
  }
  at::Tensor out = at::empty_like(q);
  const int64_t esize = bf16 ? 2 : 4, per_head = 2 + d;
  // A split row's halves: [0, mid) and [mid, n), mid on a 16-token boundary.
  auto mid_of = [](int64_t n) { return std::min<int64_t>(n, ((n + 15) / 16 + 1) / 2 * 16); };
  // split_of[b]: row b's split index (its states' place), -1 if it is not split;
  // split_rows[i]: the row of split i.
  struct DecodeItem {
    int32_t row, seq, kh;
    int32_t begin, end;  // tokens [begin, end) of the row's context
    float* state;        // a split row's half: its softmax state here, else the output
  };
  std::vector<int32_t> split_of(size_t(b_rows), -1), split_rows;
  for (int32_t b = 0; b < int32_t(b_rows); ++b) {
    if (lens[b] > kSplitTokens) {
      split_of[size_t(b)] = int32_t(split_rows.size());
      split_rows.push_back(b);
    }
  }
  const int64_t splits = int64_t(split_rows.size());
  std::vector<float> states(size_t(splits * h * 2 * per_head));
  float* st = states.data();
  std::vector<DecodeItem> items;
  items.reserve(size_t((b_rows + splits) * kvh));
  for (int32_t s = 0; s < int32_t(seqs); ++s) {
    for (int32_t kh = 0; kh < int32_t(kvh); ++kh) {
      for (int32_t part = 0; part < 2; ++part) {
        for (int32_t b = starts[size_t(s)]; b < starts[size_t(s + 1)]; ++b) {
          const int32_t split = split_of[size_t(b)], n = lens[b];
          if (split < 0) {
            if (part == 0) items.push_back({b, s, kh, 0, n, nullptr});
            continue;
          }
          float* state = st + ((int64_t(split) * kvh + kh) * 2 + part) * g * per_head;
          items.push_back({b, s, kh, part == 0 ? 0 : int32_t(mid_of(n)),
                           part == 0 ? int32_t(mid_of(n)) : n, state});
        }
      }
    }
  }
  const int64_t n_items = int64_t(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  std::vector<int64_t> cuts(size_t(workers + 1), n_items);
  cuts[0] = 0;
  {
    int64_t total = 0, seen = 0;
    for (const DecodeItem& it : items) total += it.end - it.begin;
    for (int64_t i = 0, w = 1; i < n_items && w < workers; ++i) {
      const int64_t before = seen;
      seen += items[size_t(i)].end - items[size_t(i)].begin;
      for (; w < workers && seen * workers >= total * w; ++w) {  // share w ends in item i
        const bool after = seen * workers - total * w <= total * w - before * workers;
        cuts[size_t(w)] = std::max(cuts[size_t(w - 1)], after ? i + 1 : i);  // the nearer
      }
    }
  }
  const char* kbase = static_cast<const char*>(key_cache.data_ptr());
  const char* vbase = static_cast<const char*>(value_cache.data_ptr());
  const char* qp = static_cast<const char*>(q.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t block_stride = key_cache.stride(0), head_stride = key_cache.stride(1);
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t i = cuts[size_t(w0)]; i < cuts[size_t(w1)]; ++i) {
      const DecodeItem& it = items[size_t(i)];
      const int64_t head0 = int64_t(it.row) * h + int64_t(it.kh) * g;
      run(qp + head0 * d * esize, kbase + it.kh * head_stride * esize,
          vbase + it.kh * head_stride * esize, block_stride, tables + int64_t(it.seq) * width,
          bs, it.begin, it.end, float(scale), it.state,
          it.state == nullptr ? op + head0 * d * esize : nullptr);
    }
  });
  if (splits > 0) {
    at::parallel_for(0, splits * kvh, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t kh = i % kvh, head0 = split_rows[size_t(i / kvh)] * h + kh * g;
        const float* halves = st + i * 2 * g * per_head;  // split i / kvh, KV head kh
        for (int64_t j = 0; j < g; ++j)
          merge_parts(halves + j * per_head, halves + (g + j) * per_head, d, bf16,
                      op + (head0 + j) * d * esize);
      }
    });
  }
  return out;
}

// ---- Prefill attention over the paged pool (bfloat16) ------------------------------------
//
// Causal attention of a step's prompt rows (prefill, chunked prefill, a prefix-cache hit's
// remainder) over each sequence's whole context in the pool, in place, in the same ``vec16``
// order. Unlike a decode row, a prompt's rows share every K and V token, so the work is
// bound by arithmetic, not by reading the pool: both products run as bfloat16 pair-dots
// (vdpbf16ps, 32 products an instruction where a float32 FMA takes 16), on K and V
// re-laid as pairs once per 32 tokens for all the rows of a task.
//
// A task is (sequence, KV head, up to kPrefillRows query positions): its G x rows "q-rows"
// (position-major) walk the context in chunks of 32 tokens up to the last position; per
// chunk, per block of q-rows: the scores (QK, float32 sums), the causal mask, an online
// softmax (running max and sum per q-row, float32), the probabilities rounded to bfloat16
// and the weighted sum of V rows (float32 sums). The online softmax and the chunking start
// at token 0 and depend on a row's position alone, so a row's bits do not depend on the rows
// beside it, on how its prompt was split into chunks, or on the threads.
//
// The probabilities enter P V in bfloat16 (as GPU flash attention does); the row's output is
// rounded to the cache's bfloat16 after. Measured against float64 attention in
// tests/engine/test_fused_cpu.py.

constexpr int64_t kPrefillRows = 16;  // query positions a task
constexpr int kQkRows = 8;            // q-rows whose scores are summed at once (16 chains)

struct PrefillChunk {
  // One chunk of 32 tokens re-laid for pair-dots. kp[dp][half]: the 16 tokens of that half,
  // dimensions 2 dp and 2 dp + 1 interleaved; vp[tp][dv]: tokens 2 tp and 2 tp + 1 of the
  // chunk interleaved, for dimensions 16 dv..16 dv + 15.
  __m512i kp[64][2];
  __m512i vp[16][8];
};

// idx[2t] = t, idx[2t + 1] = 32 + t: two vectors' first 16 values, interleaved.
PDSERVE_VL_TARGET inline __m512i pair_index() {
  alignas(64) int16_t idx[32];
  for (int t = 0; t < 16; ++t) {
    idx[2 * t] = int16_t(t);
    idx[2 * t + 1] = int16_t(32 + t);
  }
  return _mm512_load_si512(idx);
}

PDSERVE_VL_TARGET inline __m512i interleave16(__m512i idx, const uint16_t* a, const uint16_t* b) {
  return _mm512_permutex2var_epi16(
      _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), idx,
      _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))));
}

// Tokens [t0, t0 + 32) of one KV head into ``c``; tokens past ``last`` (the task's last
// position) are not read: their K is left as it was (their scores are masked) and their V
// is zero (a masked probability is 0, and 0 times a stale value must stay 0).
template <int DV>
PDSERVE_VL_TARGET void pack_chunk(const uint16_t* k_head0, const uint16_t* v_head0,
                                  int64_t block_stride, const int32_t* table, int64_t bs,
                                  int64_t t0, int64_t last, __m512i idx, PrefillChunk& c) {
  constexpr int64_t D = DV * 16;
  for (int half = 0; half < 2; ++half) {
    const int64_t t = t0 + 16 * half;
    if (t > last) {
      for (int tp = 8 * half; tp < 8 * half + 8; ++tp)
        for (int v = 0; v < DV; ++v) c.vp[tp][v] = _mm512_setzero_si512();
      continue;
    }
    const int64_t block = table[t / bs], off = t % bs;
    const uint16_t* kb = k_head0 + block * block_stride + off;        // K: (D, bs)
    const uint16_t* vb = v_head0 + block * block_stride + off * D;    // V: (bs, D)
    for (int64_t dp = 0; dp < D / 2; ++dp)
      c.kp[dp][half] = interleave16(idx, kb + 2 * dp * bs, kb + (2 * dp + 1) * bs);
    for (int tp = 0; tp < 8; ++tp) {
      if (t + 2 * tp > last) {
        for (int v = 0; v < DV; ++v) c.vp[8 * half + tp][v] = _mm512_setzero_si512();
        continue;
      }
      const uint16_t* v0 = vb + 2 * tp * D;
      // The pair's second token may be past ``last`` (and past the context): zero it.
      alignas(64) uint16_t zero[16] = {};
      const uint16_t* v1 = t + 2 * tp + 1 > last ? nullptr : v0 + D;
      for (int v = 0; v < DV; ++v)
        c.vp[8 * half + tp][v] = interleave16(idx, v0 + v * 16, v1 ? v1 + v * 16 : zero);
    }
  }
}

// exp(x) for x <= 0 (a score minus its row's maximum), where the result is rounded to
// bfloat16 next (8 bits): 2^(x log2 e) = 2^n 2^f, |f| <= 1/2, 2^f by its degree-5 Taylor
// polynomial (relative error < 5e-6, far below bfloat16's 2^-9); 10 instructions where
// exp_ps takes 15. Below -100 it gives at most 2^-144, nothing against the maximum's 1.
PDSERVE_VL_TARGET inline __m512 exp_probability(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The raw scores (q . k, float32) of R q-rows against the chunk's 32 tokens. Its own
// function, its sums in locals: inlined into the softmax below, GCC kept a copy of every
// sum on the stack, stored after each pair-dot (twice the time).
template <int R, int DV>
PDSERVE_VL_TARGET __attribute__((noinline)) void chunk_dots(const uint16_t* const* q,
                                                            const PrefillChunk& c,
                                                            __m512 (&out)[R][2]) {
  constexpr int64_t D = DV * 16;
  __m512 s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    const __m512bh k0 = (__m512bh)c.kp[dp][0], k1 = (__m512bh)c.kp[dp][1];
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, q[r] + 2 * dp, 4);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r][0] = s[r][0];
    out[r][1] = s[r][1];
  }
}

// The scores of R q-rows against the chunk, masked and scaled, into an online softmax; their
// probabilities go to ``p`` (R x 32 bfloat16) and each row's rescale of its sum to ``corr``.
template <int R, int DV>
PDSERVE_VL_TARGET void chunk_scores(const uint16_t* const* q, const int64_t* pos, int64_t t0,
                                    float scale, const PrefillChunk& c, float* m, float* l,
                                    float* corr, uint32_t (*p)[16]) {
  __m512 s[R][2];
  chunk_dots<R, DV>(q, c, s);
  // No call in here (std::exp would spill every live vector): the rescales of all R rows
  // are one vector exp after their maxima.
  const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
  alignas(64) float shift[16] = {};  // m_old - m_new per row (0 for a row that sees nothing)
  __mmask16 mask[R][2];
  for (int r = 0; r < R; ++r) {
    const int64_t seen = std::min<int64_t>(32, pos[r] - t0 + 1);  // tokens this row sees
    mask[r][0] = seen >= 16 ? __mmask16(0xFFFF) : seen > 0 ? __mmask16((1u << seen) - 1) : 0;
    mask[r][1] = seen >= 32   ? __mmask16(0xFFFF)
                 : seen > 16 ? __mmask16((1u << (seen - 16)) - 1)
                             : __mmask16(0);
    s[r][0] = _mm512_mask_blend_ps(mask[r][0], ninf, _mm512_mul_ps(s[r][0], sc));
    s[r][1] = _mm512_mask_blend_ps(mask[r][1], ninf, _mm512_mul_ps(s[r][1], sc));
    if (seen <= 0) continue;  // the whole chunk is after this row: nothing changes
    const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1])));
    shift[r] = m[r] - m_new;  // -inf on a row's first chunk: its sums start from 0
    m[r] = m_new;
  }
  _mm512_storeu_ps(corr, exp_ps(_mm512_load_ps(shift)));  // corr has room for 16
  for (int r = 0; r < R; ++r) {
    if (shift[r] == -INFINITY) corr[r] = 0.0f;
    if (mask[r][0] == 0) {
      std::memset(p[r], 0, 64);
      continue;
    }
    const __m512 mn = _mm512_set1_ps(m[r]);
    const __m512 ea = _mm512_maskz_mov_ps(mask[r][0], exp_probability(_mm512_sub_ps(s[r][0], mn)));
    const __m512 eb = _mm512_maskz_mov_ps(mask[r][1], exp_probability(_mm512_sub_ps(s[r][1], mn)));
    l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(ea, eb));
    // Tokens 0..15 then 16..31: dword tp holds the pair (2 tp, 2 tp + 1), as vp.
    _mm512_storeu_si512(p[r], (__m512i)_mm512_cvtne2ps_pbh(eb, ea));
  }
}

// o[r] = o[r] * corr[r] + sum over the chunk's tokens of p[r][t] V[t], R q-rows at once.
template <int R, int DV>
PDSERVE_VL_TARGET void chunk_values(const PrefillChunk& c, const uint32_t (*p)[16],
                                    const float* corr, float* const* o) {
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int v = 0; v < DV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o[r] + 16 * v), cr);
  }
  for (int tp = 0; tp < 16; ++tp) {
    __m512bh vv[DV];  // loaded once for the R rows
    for (int v = 0; v < DV; ++v) vv[v] = (__m512bh)_mm512_load_si512(&c.vp[tp][v]);
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(int32_t(p[r][tp]));
      for (int v = 0; v < DV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pb, vv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(o[r] + 16 * v, acc[r][v]);
}

// R q-rows through one chunk (R <= kQkRows), their P V in sub-blocks of PV rows.
template <int R, int DV>
PDSERVE_VL_TARGET void chunk_rows(const uint16_t* const* q, const int64_t* pos, int64_t t0,
                                  float scale, const PrefillChunk& c, float* m, float* l,
                                  float* const* o) {
  constexpr int PV = DV <= 4 ? 4 : 2;  // accumulators: PV x DV = 16 chains
  alignas(64) uint32_t p[R][16];
  alignas(64) float corr[16];
  chunk_scores<R, DV>(q, pos, t0, scale, c, m, l, corr, p);
  int r = 0;
  for (; r + PV <= R; r += PV) chunk_values<PV, DV>(c, p + r, corr + r, o + r);
  for (; r < R; ++r) chunk_values<1, DV>(c, p + r, corr + r, o + r);
}

// A worker's arrays for one task at a time, kept across its tasks: per q-row, its output
// sums (D floats), running max and sum, its q row, output row and position.
struct PrefillScratch {
  std::vector<float> sums;
  std::vector<const uint16_t*> q;
  std::vector<float*> o;
  std::vector<int64_t> pos;
};

struct PrefillTask {
  int32_t seq, kv_head;
  int64_t row0, rows;  // query rows [row0, row0 + rows) of the step (q's first dimension)
  int64_t pos0;        // the position of row0
  int64_t cost;        // ~ rows x the tokens they see: the order tasks are taken in
};

// One task: G heads x ``task.rows`` positions, through chunks up to the last position.
template <int DV>
PDSERVE_VL_TARGET void prefill_task(const PrefillTask& task, const uint16_t* q, int64_t h,
                                    int64_t g, const uint16_t* kbase, const uint16_t* vbase,
                                    int64_t block_stride, int64_t head_stride,
                                    const int32_t* table, int64_t bs, float scale, uint16_t* out,
                                    PrefillChunk& c, PrefillScratch& scratch) {
  constexpr int64_t D = DV * 16;
  const int64_t n = task.rows * g;  // q-rows, position-major: (row i, head j) -> i g + j
  scratch.sums.resize(size_t(n * (D + 2)));
  scratch.q.resize(size_t(n));
  scratch.o.resize(size_t(n));
  scratch.pos.resize(size_t(n));
  float* o = scratch.sums.data();
  float* m = o + n * D;
  float* l = m + n;
  const uint16_t** qr = scratch.q.data();
  float** orow = scratch.o.data();
  int64_t* pos = scratch.pos.data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = task.row0 + i / g, head = task.kv_head * g + i % g;
    qr[i] = q + (row * h + head) * D;
    orow[i] = o + i * D;
    pos[i] = task.pos0 + i / g;
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  std::fill(o, o + n * D, 0.0f);
  const int64_t last = task.pos0 + task.rows - 1;
  const __m512i idx = pair_index();
  const uint16_t* k_head0 = kbase + task.kv_head * head_stride;
  const uint16_t* v_head0 = vbase + task.kv_head * head_stride;
  for (int64_t t0 = 0; t0 <= last; t0 += 32) {
    pack_chunk<DV>(k_head0, v_head0, block_stride, table, bs, t0, last, idx, c);
    // q-rows before this chunk's first token see none of it: start at the first that does.
    int64_t i = std::max<int64_t>(0, (t0 - task.pos0) * g);
    for (; i + kQkRows <= n; i += kQkRows)
      chunk_rows<kQkRows, DV>(qr + i, pos + i, t0, scale, c, m + i, l + i, orow + i);
    for (; i < n; ++i) chunk_rows<1, DV>(qr + i, pos + i, t0, scale, c, m + i, l + i, orow + i);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = task.row0 + i / g, head = task.kv_head * g + i % g;
    const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
    for (int v = 0; v < DV; ++v)
      store_ps(out + (row * h + head) * D + 16 * v, true,
               _mm512_mul_ps(_mm512_loadu_ps(o + i * D + 16 * v), inv));
  }
}

// q: (T, H, D) bfloat16, contiguous; key_cache / value_cache: one layer's bfloat16
// (num_blocks, KVH, block_size, D) views (rope_store's); q_starts: int32 (B + 1,), sequence
// b's query rows [q_starts[b], q_starts[b + 1]) are the last of its seq_lens[b] tokens;
// block_tables: int32 (B, W). -> (T, H, D) bfloat16.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& q_starts,
                             const at::Tensor& seq_lens, const at::Tensor& block_tables,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16,
              "prefill_attention: q must be contiguous bfloat16 (T, H, D)");
  check_kv_views("prefill_attention", key_cache, value_cache, q.size(2));
  TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: K and V must be bfloat16");
  const int64_t t_rows = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t kvh = key_cache.size(1), bs = key_cache.size(2), nb = key_cache.size(0);
  TORCH_CHECK(bs % 16 == 0 && kvh > 0 && h % kvh == 0 && h / kvh <= 8,
              "prefill_attention: block size ", bs, ", heads ", h, " over ", kvh);
  TORCH_CHECK(d == 64 || d == 128, "prefill_attention: head size ", d, " is not built");
  const int64_t b_rows = seq_lens.numel(), width = block_tables.size(1), g = h / kvh;
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous(),
              "prefill_attention: seq_lens must be int32 (B,)");
  TORCH_CHECK(q_starts.scalar_type() == at::kInt && q_starts.numel() == b_rows + 1 &&
                  q_starts.is_contiguous(),
              "prefill_attention: q_starts must be int32 (B + 1,)");
  check_block_tables("prefill_attention", block_tables, b_rows);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[b_rows] == t_rows,
              "prefill_attention: q_starts must run from 0 to the ", t_rows, " rows");
  std::vector<PrefillTask> tasks;
  for (int64_t b = 0; b < b_rows; ++b) {
    const int64_t rows = starts[b + 1] - starts[b], n = lens[b];
    TORCH_CHECK(rows >= 0 && rows <= n && n <= width * bs, "prefill_attention: sequence ", b,
                " has ", rows, " query rows, ", n, " tokens, ", width, " blocks");
    check_blocks("prefill_attention: sequence ", b, tables + b * width, (n + bs - 1) / bs, nb);
    for (int64_t r = 0; r < rows; r += kPrefillRows) {
      const int64_t take = std::min<int64_t>(kPrefillRows, rows - r), pos0 = n - rows + r;
      for (int64_t kh = 0; kh < kvh; ++kh)
        tasks.push_back({int32_t(b), int32_t(kh), starts[b] + r, take, pos0,
                         take * (pos0 + take)});
    }
  }
  // Costliest first, taken one at a time: a causal prompt's last rows see the most tokens.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PrefillTask& a, const PrefillTask& b) { return a.cost > b.cost; });
  at::Tensor out = at::empty_like(q);
  if (tasks.empty()) return out;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kbase = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  const auto* vbase = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_stride = key_cache.stride(0), head_stride = key_cache.stride(1);
  const int64_t n_tasks = int64_t(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto* c = static_cast<PrefillChunk*>(std::aligned_alloc(64, sizeof(PrefillChunk)));
    PrefillScratch scratch;
    for (int64_t i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1)) {
      const PrefillTask& task = tasks[size_t(i)];
      const int32_t* table = tables + int64_t(task.seq) * width;
      if (d == 64)
        prefill_task<4>(task, qp, h, g, kbase, vbase, block_stride, head_stride, table, bs,
                        float(scale), op, *c, scratch);
      else
        prefill_task<8>(task, qp, h, g, kbase, vbase, block_stride, head_stride, table, bs,
                        float(scale), op, *c, scratch);
    }
    std::free(c);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("int4_mm(Tensor x, Tensor w, int n, bool amx) -> Tensor");
  m.def("int4_gemm(Tensor x, Tensor w, int n) -> Tensor");
  m.def("int4_gemm_a8(Tensor x, Tensor w, int n) -> Tensor");
  m.def("silu_mul(Tensor gate_up, ScalarType dtype) -> Tensor");
  m.def(
      "rope_store(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slots, int num_heads, int num_kv_heads) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor? q_starts=None) -> Tensor");
  m.def(
      "prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor q_starts, "
      "Tensor seq_lens, Tensor block_tables, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int4_gemm_a8", &int4_gemm_a8);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_store", &rope_store);
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
}
