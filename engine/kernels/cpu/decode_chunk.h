// decode_attention's arithmetic on one 16-token chunk of one KV head: the scores of a query
// row's G heads, its online softmax, and V's rows weighted into its running sums
// (decode_attention.cpp plans the rows, the chunks and the threads around it).
//
// Per block and KV head the pool holds K as (D, block_size) and V as (block_size, D)
// (``vec16``, rope_store in elementwise.cpp). In a bfloat16 pool a chunk's K is first
// turned into D / 2 vectors of dimension pairs, 16 tokens' (K[2i][t], K[2i + 1][t]) a
// vector, once for every row that reads the chunk; each row's scores are then pair-dots
// (vdpbf16ps) against q's pairs broadcast: products of two bfloat16 values are exact in
// float32, so a score is q . k summed in float32 and then scaled. P V likewise: V re-laid
// once as token pairs, times the probabilities rounded to bfloat16. A float32 pool takes
// q scaled, each K row and V row widened, four partial sums a head.
//
// Every caller (a decode row alone, or among a verification's rows) runs this same code on
// the same inputs in the same order, so a row's bits never depend on the rows beside it.

#pragma once

#include "common.h"

namespace pdserve {
namespace {

// One block's K and V chunks of one head (``bytes`` each, from ``at`` past each base), into
// L1 (``l1``) or L2. Which reads the context faster depends on the core:
// * the 2-core Zen 4 (AMD family 25): into L2. A step's attention at 2,500 tokens, one row,
//   one thread: 4.5 ms with T1 against 8.0 ms with T0 in alternating runs (a core has few
//   L1 miss buffers, and two blocks' lines asked into L1 at once waited on them);
// * the 2-core Zen 5 (family 26): into L1. The attention alone over a cold context (1-8 rows,
//   300-2,048 tokens, alternating in one process): 0.80-0.93x the time of L2; a decode
//   step of the default model at 1-8 rows: 0.97-0.99x (benchmarks/results/kv_prefetch.md).
// NOTE: always inlined: GCC takes an out-of-line function of prefetches alone for one with no
// effect, and deletes its calls (a build that did not inline it had no prefetch left).
__attribute__((always_inline)) inline void prefetch_kv(const char* k, const char* v,
                                                       int64_t at, int64_t bytes, bool l1) {
  for (int64_t line = 0; line < bytes; line += 64) {
    if (l1) {
      _mm_prefetch(k + at + line, _MM_HINT_T0);
      _mm_prefetch(v + at + line, _MM_HINT_T0);
    } else {
      _mm_prefetch(k + at + line, _MM_HINT_T1);
      _mm_prefetch(v + at + line, _MM_HINT_T1);
    }
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

// fp-contract=off keeps the compiler from fusing the scalar steps one way in one caller and
// another in the next. Callers carry the same attribute: GCC does not inline a function
// whose optimize options differ from its caller's, and a call a chunk costs ~10 %.
#define PDSERVE_EXACT_FP __attribute__((optimize("fp-contract=off")))

// A float32 chunk's scores: q (G, D) already scaled, K rows widened to 16 tokens a load.
// Four partial sums a head (dimensions d = j mod 4), so that no chain of D dependent
// multiply-adds sets the pace; lanes past ``mask`` are zero.
template <int G, int DV>
PDSERVE_VL_TARGET PDSERVE_EXACT_FP inline void scores_f32(const float (&q)[G][DV * 16],
                                                          const char* kb, int64_t bs, int64_t off,
                                                          __mmask16 mask, __m512 (&s)[G]) {
  constexpr int64_t D = DV * 16;
  __m512 part[G][4];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < 4; ++j) part[h][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 4) {
    for (int j = 0; j < 4; ++j) {
      const __m512 k = _mm512_maskz_loadu_ps(mask, kb + ((d + j) * bs + off) * 4);
      for (int h = 0; h < G; ++h)
        part[h][j] = _mm512_fmadd_ps(_mm512_set1_ps(q[h][d + j]), k, part[h][j]);
    }
  }
  for (int h = 0; h < G; ++h)
    s[h] = _mm512_add_ps(_mm512_add_ps(part[h][0], part[h][1]),
                         _mm512_add_ps(part[h][2], part[h][3]));
}

// A bfloat16 chunk's K, 16 tokens from ``off`` of a (D, bs) block chunk, as D / 2 vectors:
// vector i holds (K[2i][t], K[2i + 1][t]) in 32-bit lane t. All 16 tokens are read (a
// block holds a multiple of 16): lanes past a row's end carry whatever the pool holds
// there, and the softmax masks their scores.
template <int DV>
PDSERVE_VL_TARGET inline void k_pairs(const char* kb, int64_t bs, int64_t off, __m512i* out) {
  const __m512i idx = pair_index();
  const uint16_t* k = reinterpret_cast<const uint16_t*>(kb) + off;
  for (int64_t i = 0; i < DV * 8; ++i)
    out[i] = interleave16(idx, k + 2 * i * bs, k + (2 * i + 1) * bs);
}

// A bfloat16 chunk's scores from its K pairs (k_pairs): q (G, D / 2) as bfloat16 pairs,
// unscaled; per head A partial sums of pair-dots (pairs i = j mod A), summed, then scaled.
template <int G, int DV>
PDSERVE_VL_TARGET PDSERVE_EXACT_FP inline void scores_pairs(const uint32_t (&q)[G][DV * 8],
                                                            const __m512i* kx, float scale,
                                                            __m512 (&s)[G]) {
  constexpr int P = DV * 8, A = G <= 4 ? 4 : 2;  // A chains a head hide vdpbf16ps's latency
  __m512 part[G][A];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < A; ++j) part[h][j] = _mm512_setzero_ps();
  for (int i = 0; i < P; i += A) {
    for (int j = 0; j < A; ++j) {
      const __m512bh k = (__m512bh)_mm512_load_si512(kx + i + j);
      for (int h = 0; h < G; ++h)
        part[h][j] = _mm512_dpbf16_ps(part[h][j], k,
                                      (__m512bh)_mm512_set1_epi32(static_cast<int>(q[h][i + j])));
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int h = 0; h < G; ++h) {
    __m512 sum = _mm512_add_ps(part[h][0], part[h][1]);
    if constexpr (A == 4) sum = _mm512_add_ps(sum, _mm512_add_ps(part[h][2], part[h][3]));
    s[h] = _mm512_mul_ps(sum, sc);
  }
}

// A bfloat16 chunk's V, its first ``valid`` tokens from ``off`` of a (bs, D) block chunk, as
// 8 x DV vectors: [u][v] holds (V[2u][j], V[2u + 1][j]) in 32-bit lane j - 16 v. Tokens past
// ``valid`` are zero: their probability is 0, and 0 times a stale value must stay 0.
template <int DV>
PDSERVE_VL_TARGET inline void v_pairs(const char* vb, int64_t off, int64_t valid, __m512i* out) {
  constexpr int64_t D = DV * 16;
  const __m512i idx = pair_index();
  alignas(64) static constexpr uint16_t kZero[16] = {};
  const uint16_t* chunk = reinterpret_cast<const uint16_t*>(vb) + off * D;
  for (int64_t u = 0; u < 8; ++u) {
    const uint16_t* t0 = 2 * u < valid ? chunk + 2 * u * D : nullptr;
    const uint16_t* t1 = 2 * u + 1 < valid ? chunk + (2 * u + 1) * D : nullptr;
    for (int v = 0; v < DV; ++v)
      out[u * DV + v] = interleave16(idx, t0 ? t0 + v * 16 : kZero, t1 ? t1 + v * 16 : kZero);
  }
}

// One row's G heads take a bfloat16 chunk's scores ``s`` (lanes past ``valid`` ignored) into
// their online softmax, and its V pairs (v_pairs) weighted into their running sums by the
// probabilities rounded to bfloat16 (as the prefill kernel and GPU flash attention do; the
// sums of exponentials stay float32). The G heads' rescales are one vector exp.
template <int G, int DV>
PDSERVE_VL_TARGET PDSERVE_EXACT_FP inline void softmax_pairs(const __m512 (&s)[G],
                                                             const __m512i* vx, int64_t valid,
                                                             RowState<G, DV>& st) {
  const __mmask16 mask = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  alignas(64) float shift[16] = {};  // per head m_old - m_new: 0 when the max holds
  float m_new[G];
  __m512 sm[G];
  for (int h = 0; h < G; ++h) {
    sm[h] = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), s[h]);
    m_new[h] = std::max(st.m[h], _mm512_reduce_max_ps(sm[h]));
    if (m_new[h] != st.m[h]) shift[h] = st.m[h] - m_new[h];  // -inf on a row's first chunk
  }
  alignas(64) float corr[16];
  // A first chunk's shift is -inf: its corr is tiny, and the sums it scales are 0.
  _mm512_store_ps(corr, exp_ps(_mm512_load_ps(shift)));
  alignas(64) uint32_t p[G][8];  // per head the 16 probabilities, bfloat16, paired as V
  for (int h = 0; h < G; ++h) {
    const __m512 x = _mm512_sub_ps(sm[h], _mm512_set1_ps(m_new[h]));
    const __m512 e = _mm512_maskz_mov_ps(mask, exp_ps(x));
    st.l[h] = st.l[h] * corr[h] + _mm512_reduce_add_ps(e);
    st.m[h] = m_new[h];
    _mm256_store_si256(reinterpret_cast<__m256i*>(p[h]), (__m256i)_mm512_cvtneps_pbh(e));
  }
  const int64_t pairs = (valid + 1) / 2;
  // Heads in blocks whose sums fit the registers (at most 16 of them); a head's sums run
  // over the same pairs in the same order whatever its block.
  constexpr int HB = G * DV <= 16 ? G : std::max(1, 16 / DV);
  for (int h0 = 0; h0 < G; h0 += HB) {
    __m512 acc[HB][DV];
    for (int h = 0; h < HB && h0 + h < G; ++h) {
      const __m512 c = _mm512_set1_ps(corr[h0 + h]);
      for (int v = 0; v < DV; ++v)
        acc[h][v] = shift[h0 + h] == 0.0f ? st.acc[h0 + h][v] : _mm512_mul_ps(st.acc[h0 + h][v], c);
    }
    for (int64_t u = 0; u < pairs; ++u) {
      __m512bh vv[DV];
      for (int v = 0; v < DV; ++v) vv[v] = (__m512bh)_mm512_load_si512(vx + u * DV + v);
      for (int h = 0; h < HB && h0 + h < G; ++h) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[h0 + h][u]));
        for (int v = 0; v < DV; ++v) acc[h][v] = _mm512_dpbf16_ps(acc[h][v], w, vv[v]);
      }
    }
    for (int h = 0; h < HB && h0 + h < G; ++h)
      for (int v = 0; v < DV; ++v) st.acc[h0 + h][v] = acc[h][v];
  }
}

// One row's G heads take a float32 chunk's scores ``s`` (lanes past ``valid`` ignored) into
// their online softmax, and the chunk's ``valid`` V rows (from ``off`` in the block chunk ``vb``)
// weighted into their running sums.
template <int G, int DV>
PDSERVE_VL_TARGET PDSERVE_EXACT_FP inline void softmax_v(const __m512 (&s)[G], const char* vb,
                                                         int64_t off, int64_t valid,
                                                         RowState<G, DV>& st) {
  constexpr int64_t D = DV * 16;
  const __mmask16 mask = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  alignas(64) float p[G][16];
  // The running sums are held in registers over the chunk and stored once at its end: kept in
  // ``st``, each V load (through a char pointer, which may alias them) made the compiler
  // store all G x DV of them first, every token (a 5-row verification's attention at 2,500
  // tokens: 1.27x faster without, one thread).
  __m512 acc[G][DV];
  for (int h = 0; h < G; ++h) {
    const __m512 sm = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), s[h]);
    const float m_new = std::max(st.m[h], _mm512_reduce_max_ps(sm));
    const __m512 e = _mm512_maskz_mov_ps(mask, exp_ps(_mm512_sub_ps(sm, _mm512_set1_ps(m_new))));
    if (m_new == st.m[h]) {
      // A rescale by exp(0) = 1 changes no bit: skipped, with its call to std::exp (before
      // which every live vector was saved). After a row's first chunks its max seldom moves.
      st.l[h] = st.l[h] + _mm512_reduce_add_ps(e);
      for (int v = 0; v < DV; ++v) acc[h][v] = st.acc[h][v];
    } else {
      const float corr = st.m[h] == -INFINITY ? 0.0f : std::exp(st.m[h] - m_new);
      st.l[h] = st.l[h] * corr + _mm512_reduce_add_ps(e);
      st.m[h] = m_new;
      for (int v = 0; v < DV; ++v) acc[h][v] = _mm512_mul_ps(st.acc[h][v], _mm512_set1_ps(corr));
    }
    _mm512_store_ps(p[h], e);
  }
  for (int64_t t = 0; t < valid; ++t) {
    __m512 vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = _mm512_loadu_ps(vb + ((off + t) * D + v * 16) * 4);
    for (int h = 0; h < G; ++h) {
      const __m512 w = _mm512_set1_ps(p[h][t]);
      for (int v = 0; v < DV; ++v) acc[h][v] = _mm512_fmadd_ps(w, vv[v], acc[h][v]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < DV; ++v) st.acc[h][v] = acc[h][v];
}

}  // namespace
}  // namespace pdserve
