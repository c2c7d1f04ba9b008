// The int4 GEMMs on the AMX tile unit: int4_mm, amx = true (a few rows) and int4_gemm (many).
//
// int4_mm on tiles: the same sums as its vector path (int4_mm.cpp). Per group and tile of 16
// outputs, the codes are decoded as there into a (16 pairs x 16
// outputs x 2) bfloat16 B tile, the group's inputs of up to 16 rows are the A tile, and one
// tdpbf16ps gives the (rows x 16) code products; the same float32 epilogue as the vector
// path scales them. The tile unit does each row's 32 products in the same order whatever
// the rows beside it, so a row's bits still do not depend on its batch.

#define PDSERVE_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512bf16,f16c,fma,amx-tile,amx-bf16")))

#include "int4_layout.h"

namespace pdserve {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

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

}  // namespace

constexpr std::array<BlockFn, kAmxRows + 1> kAmxBlocks =
    amx_blocks(std::make_integer_sequence<int, kAmxRows>{});

// Linux hands out the tile registers' state only on request, once per process.
bool amx_enabled() {
  static const bool enabled = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return __builtin_cpu_supports("amx-bf16") &&
           syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return enabled;
}

// int4_gemm, many rows: weights de-quantized to bfloat16 once per call. For prefills and large
// decode batches: each tile's weights are de-quantized once into bfloat16 B tiles (c s + m in
// float32, rounded to nearest even: the values a bfloat16 copy of the de-quantized weights
// holds) and every block of 16 rows is multiplied by them, accumulating over the groups in the
// C tiles. So M rows decode each weight once instead of M / 16 times and scale nothing per
// group, and no bfloat16 copy of the weights is kept. Numerically this is a bfloat16 GEMM
// (bfloat16 weights and inputs, float32 sums), not int4_mm: the two differ in the last
// bits, as the packed kernels and their GEMMs did. A row's bits still do not depend on the rows
// beside it.

namespace {

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

}  // namespace

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

}  // namespace pdserve
