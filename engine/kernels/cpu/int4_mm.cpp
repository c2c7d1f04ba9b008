// int4_mm, amx = false: any rows (a decode step, a verification, a batch-invariant prefill)
// on AVX-512 BF16 pair-dots; its AMX path, the same sums on tiles, is in int4_amx.cpp.
//
// int4_mm: y = x W^T with W[n, k] = c[n, k] * s[n, g] + m[n, g], c in [0, 15], groups g of 32 inputs.
// Each group's product is taken on the codes, and scaled once:
//     y[r, n] = sum_g  s[n, g] * (sum_{k in g} x[r, k] c[n, k])  +  m[n, g] * X[r, g]
// with X[r, g] the sum of row r's inputs in group g. A code is exact in bfloat16, and so is
// its product with a bfloat16 input, so the only roundings are the float32 sums.
//
// Why not torch's int4 kernel: it de-quantizes the weights once per block of rows, so its
// cost grows with every row. Here a weight is decoded once per 8 rows (vector path) or 16
// (AMX path, int4_amx.cpp); on the vector path each row then costs one bfloat16 pair-dot
// (vdpbf16ps) per 2 inputs x 16 outputs, on the AMX path one tile product per 16 rows.
//
// A row's result does not depend on the rows beside it or on the threads: every row runs the
// same instructions in the same order whatever the block it falls in (no reassociation:
// built without -ffast-math), and threads split the outputs, never the inputs. So a decode
// step and a speculative verification of several rows per sequence agree bit for bit.

#include "int4_layout.h"

namespace pdserve {
namespace {

constexpr int kMaxRows = 8;  // rows per pass over a tile

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
  // One tile at a time, whatever the rows: a thread's tiles lie one after another, so it
  // reads one sequential stream, which the hardware prefetcher follows; several tiles at
  // once (to give vdpbf16ps independent sums) are several streams it follows worse. On the
  // 2-core Zen 4, 120 layers' products at one row: 28-30 GB/s (the copy rate) against
  // 20-22 GB/s for 4 tiles at once with software prefetch, and a one-row step 6.7-7.0 ms
  // against 7.9-9.3. The tiles' order does not change a row's bits.
  for (int64_t t = t0; t < t1; ++t) tiles_kernel<RB, 1>(x, ldx, xsum, w, groups, t, y, ldy, n);
}

constexpr BlockFn kBlocks[kMaxRows + 1] = {nullptr,        rows_block<1>, rows_block<2>,
                                            rows_block<3>, rows_block<4>, rows_block<5>,
                                            rows_block<6>, rows_block<7>, rows_block<8>};

// Many rows: a thread decodes kPanelTiles tiles of codes once into a panel of bfloat16
// operands (L2-resident: 1 kB a tile and group), then every block of rows multiplies them.
// The weights come from memory once a call and are decoded once, where the blocks above
// stream and decode them again for every 8 rows. A row's operations and their order are
// those of tiles_kernel (the same operands, pair-dots, lo/hi split and scaling), so a row
// gets the same bits on either path: the row count only picks the path.
constexpr int64_t kPanelTiles = 4;
constexpr int kPanelRows = 8;  // rows a pass over the panel, as kMaxRows

// panel[(t * groups + g) * 8 + q]: 64 bfloat16, chunk q's low-nibble operand then its
// high-nibble one, for tiles [tile0, tile0 + nt).
PDSERVE_TARGET void decode_panel(const uint8_t* w, int64_t groups, int64_t tile0, int64_t nt,
                                 uint16_t* panel) {
  const __m512i lut = _mm512_load_si512(kCodeValues);
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  for (int64_t t = 0; t < nt; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* codes = w + ((tile0 + t) * groups + g) * kGroupBytes;
      uint16_t* out = panel + (t * groups + g) * 8 * 64;
      for (int q = 0; q < 8; ++q) {
        const __m512i wide = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + q * 32)));
        _mm512_storeu_si512(out + q * 64, _mm512_permutexvar_epi16(_mm512_and_si512(wide, low4), lut));
        _mm512_storeu_si512(out + q * 64 + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), lut));
      }
    }
  }
}

// tiles_kernel on a decoded panel: RB rows x NT of its tiles, from panel tile p0.
// NOTE: apart from tiles_kernel on purpose: one template for both, the operands' source
// chosen by a flag, measured 1.4x slower here at 256 rows of the down projection (K 1536).
template <int RB, int NT>
PDSERVE_TARGET void panel_kernel(const uint16_t* x, int64_t ldx, const float* xsum,
                                 const uint16_t* panel, int64_t p0, const uint8_t* w,
                                 int64_t groups, int64_t tile0, float* y, int64_t ldy, int64_t n) {
  __m512 acc[RB][NT];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 lo[RB][NT], hi[RB][NT];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < NT; ++t) lo[r][t] = hi[r][t] = _mm512_setzero_ps();
    for (int q = 0; q < 8; ++q) {
      __m512i w_lo[NT], w_hi[NT];
      for (int t = 0; t < NT; ++t) {
        const uint16_t* at = panel + ((p0 + t) * groups + g) * 8 * 64 + q * 64;
        w_lo[t] = _mm512_loadu_si512(at);
        w_hi[t] = _mm512_loadu_si512(at + 32);
      }
      for (int r = 0; r < RB; ++r) {
        uint32_t pair_lo, pair_hi;
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
    scale_group<RB, NT>(acc, dot, w, tile0 + p0, g, groups, xsum);
  }
  store_rows<RB, NT>(acc, tile0 + p0, y, ldy, n);
}

// Rows [0, rb) over the panel's nt tiles, two at a time.
template <int RB>
PDSERVE_TARGET void panel_rows(const uint16_t* x, int64_t ldx, const float* xsum,
                               const uint16_t* panel, int64_t nt, const uint8_t* w,
                               int64_t groups, int64_t tile0, float* y, int64_t ldy, int64_t n) {
  constexpr int NT = RB <= 4 ? 2 : 1;
  int64_t p = 0;
  for (; p + NT <= nt; p += NT)
    panel_kernel<RB, NT>(x, ldx, xsum, panel, p, w, groups, tile0, y, ldy, n);
  for (; p < nt; ++p) panel_kernel<RB, 1>(x, ldx, xsum, panel, p, w, groups, tile0, y, ldy, n);
}

using PanelFn = void (*)(const uint16_t*, int64_t, const float*, const uint16_t*, int64_t,
                         const uint8_t*, int64_t, int64_t, float*, int64_t, int64_t);
constexpr PanelFn kPanelBlocks[kPanelRows + 1] = {nullptr,       panel_rows<1>, panel_rows<2>,
                                                  panel_rows<3>, panel_rows<4>, panel_rows<5>,
                                                  panel_rows<6>, panel_rows<7>, panel_rows<8>};

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

}  // namespace

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
  if (!amx && m_rows > 2 * kMaxRows) {  // where it measured faster: 32 rows and more
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      thread_local std::vector<uint16_t> panel;
      panel.resize(size_t(kPanelTiles * groups * 8 * 64));
      for (int64_t tile0 = t0; tile0 < t1; tile0 += kPanelTiles) {
        const int64_t nt = std::min<int64_t>(kPanelTiles, t1 - tile0);
        decode_panel(wp, groups, tile0, nt, panel.data());
        for (int64_t r0 = 0; r0 < m_rows; r0 += kPanelRows) {
          const int64_t rb = std::min<int64_t>(kPanelRows, m_rows - r0);
          kPanelBlocks[rb](xp + r0 * k, k, sp + r0 * groups, panel.data(), nt, wp, groups, tile0,
                           yp + r0 * n, n, n);
        }
      }
    });
    return y;
  }
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t r0 = 0; r0 < m_rows; r0 += block) {
      const int64_t rb = std::min<int64_t>(block, m_rows - r0);
      (amx ? kAmxBlocks[rb] : kBlocks[rb])(xp + r0 * k, k, sp + r0 * groups, wp, groups, t0, t1,
                                           yp + r0 * n, n, n);
    }
  });
  return y;
}

}  // namespace pdserve
