// int4_gemm_a8, the int8-input product: any rows on AVX-512 VNNI, int8 inputs times the int4
// codes. Each row's inputs are rounded to bfloat16 (as the bfloat16 paths read them) and
// quantized per group of 32, as llama.cpp quantizes activations for its Q4 dot products
// (Q8_1): d = max |x| / 127, q = round(x / d) in [-127, 127]. Then
//     y[r, n] = sum_g  s[n, g] d[r, g] (sum_{k in g} q[r, k] c[n, k])  +  m[n, g] X[r, g]
// with X[r, g] = d[r, g] * sum_{k in g} q[r, k], the sum of the quantized inputs (see
// quantize_rows for why not the exact sum). The code products are exact int32 sums
// (vpdpbusd: 4 unsigned codes x 4 signed inputs a lane), 64 products an instruction where
// vdpbf16ps takes 32.
//
// Up to kA8StreamMaxRows rows (decode steps, verifications) read the tiles straight from
// memory, widening each chunk of codes in registers (a8_stream_tile). More rows (prefills,
// large decode batches): each thread widens the codes of its two tiles once per call into
// a scratch of whole bytes (the layout vpdpbusd reads) and multiplies every row block by
// them. A row's quantization and sums do not depend on the rows beside it, the path or the
// threads (integer sums are exact in any order; the float scaling is the same operations
// in the same order on both paths), so a row's bits do not depend on its batch.

#define PDSERVE_VNNI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,f16c,fma")))

#include "int4_layout.h"

namespace pdserve {
namespace {

constexpr int64_t kA8Tiles = 2;  // tiles (of 16 outputs) a thread widens and multiplies at once
constexpr int kA8Rows = 4;       // rows a pass over the widened tiles

// Row r's group g: 32 int8 inputs in the codes' order (chunk q: inputs 2q, 2q + 1, 16 + 2q,
// 17 + 2q, see int4_layout.h), then d and X go to their own arrays.
PDSERVE_VNNI_TARGET void quantize_rows(const at::Tensor& x, int64_t groups, int8_t* xq,
                                       float* xd, float* xs, int64_t r0, int64_t r1) {
  const int64_t ldx = x.stride(0);
  const bool wide = x.scalar_type() == at::kFloat;
  const float* xf = wide ? x.data_ptr<float>() : nullptr;
  const uint16_t* xh = wide ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * ldx + g * kGroup;
      // The group's 32 bfloat16 values: float32 rounded to nearest even, as torch's cast.
      const __m512i v = wide ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xf + at + 16),
                                                           _mm512_loadu_ps(xf + at))
                             : _mm512_loadu_si512(xh + at);
      const __m512 lo = _mm512_castsi512_ps(  // inputs 0..15 and 16..31
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 0)), 16));
      const __m512 hi = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
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

// a8_kernel's rows, straight from one packed tile: its codes widened in registers, its s and
// m converted where they are read; no scratch. For a few rows (a decode step, a
// verification), where widening a tile into memory costs more than its products: the tiles
// then stream from memory once, one after another (see int4_mm.cpp ``rows_block``). The
// scaling takes the values and the order of a8_kernel's, and the code sums are exact
// integers, so a row gets the same bits on either path.
template <int RB>
PDSERVE_VNNI_TARGET void a8_stream_tile(const int8_t* xq, const float* xd, const float* xs,
                                        int64_t groups, const uint8_t* wt, float* y,
                                        int64_t ldy, int64_t col, int64_t n) {
  const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F);
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* src = wt + g * kGroupBytes;
    __m512i dot[RB];
    for (int r = 0; r < RB; ++r) dot[r] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
      const __m512i v = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + q * 32)));
      const __m512i w = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), nibbles, 0xA8);
      for (int r = 0; r < RB; ++r) {
        int32_t four;
        std::memcpy(&four, xq + (r * groups + g) * kGroup + q * 4, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(four));
      }
    }
    const __m512 s16 =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kCodeBytes)));
    const __m512 m16 = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kCodeBytes + 32)));
    for (int r = 0; r < RB; ++r) {
      const __m512 s = _mm512_mul_ps(s16, _mm512_set1_ps(xd[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), s, acc[r]);
      acc[r] = _mm512_fmadd_ps(m16, _mm512_set1_ps(xs[r * groups + g]), acc[r]);
    }
  }
  const int64_t left = std::min<int64_t>(kTile, n - col);
  const __mmask16 mask = left >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy + col, mask, acc[r]);
}

using StreamFn = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*,
                          float*, int64_t, int64_t, int64_t);
constexpr int kA8StreamRows = 8;       // rows a pass of a8_stream_tile
constexpr int kA8StreamMaxRows = 16;   // calls of at most this many rows stream the tiles
constexpr StreamFn kStream[kA8StreamRows + 1] = {
    nullptr,           a8_stream_tile<1>, a8_stream_tile<2>, a8_stream_tile<3>, a8_stream_tile<4>,
    a8_stream_tile<5>, a8_stream_tile<6>, a8_stream_tile<7>, a8_stream_tile<8>};

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

}  // namespace

// x: (M, K) float32 (rounded to bfloat16 first) or bfloat16; w: uint8 (T, G, 320); n <= 16 T
// outputs. -> (M, n) float32.
at::Tensor int4_gemm_a8(const at::Tensor& x_in, const at::Tensor& w, int64_t n) {
  check_gemm("int4_gemm_a8", x_in, w, n);
  const int64_t m_rows = x_in.size(0), k = x_in.size(1), tiles = w.size(0), groups = w.size(1);
  TORCH_CHECK(vnni_supported(), "int4_gemm_a8: this CPU has no AVX-512 VNNI");
  at::Tensor y = at::empty({m_rows, n}, x_in.options().dtype(at::kFloat));
  if (m_rows == 0) return y;
  const bool direct = (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) &&
                      x_in.stride(1) == 1;
  const at::Tensor x = direct ? x_in : x_in.to(at::kFloat).contiguous();
  // Per calling thread, kept between calls: no allocation on the decode path.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  xq.resize(size_t(m_rows * k));
  xd.resize(size_t(m_rows * groups));
  xs.resize(size_t(m_rows * groups));
  // Pointers, not the vectors, into the lambdas: a thread_local named there would be the
  // worker thread's own.
  int8_t* qp = xq.data();
  float* dp = xd.data();
  float* sp = xs.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = groups * kGroupBytes;
  if (m_rows <= kA8StreamMaxRows) {
    quantize_rows(x, groups, qp, dp, sp, 0, m_rows);
    // Threads split the tiles; a grain keeps each thread's slice long enough to stream.
    // Past 8 rows a tile is read again for each block of 8 while it sits in L1 (at most
    // 48 groups x 320 bytes), so memory still sees it once.
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t r0 = 0; r0 < m_rows; r0 += kA8StreamRows) {
          const int64_t rb = std::min<int64_t>(kA8StreamRows, m_rows - r0);
          kStream[rb](qp + r0 * k, dp + r0 * groups, sp + r0 * groups, groups,
                      wp + t * tile_bytes, yp + r0 * n, n, t * kTile, n);
        }
      }
    });
    return y;
  }
  at::parallel_for(0, m_rows, 16,
                   [&](int64_t r0, int64_t r1) { quantize_rows(x, groups, qp, dp, sp, r0, r1); });
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
        a8_rows<2>(qp, dp, sp, m_rows, groups, c, s, yp, n, t * kTile, n);
      } else {
        const uint8_t* const c[1] = {codes};
        const float* const s[1] = {sm};
        a8_rows<1>(qp, dp, sp, m_rows, groups, c, s, yp, n, t * kTile, n);
      }
    }
    std::free(codes);
    std::free(sm);
  });
  return y;
}

}  // namespace pdserve
