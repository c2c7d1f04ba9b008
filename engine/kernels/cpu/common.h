// pdserve's CPU kernels (torch.ops.pdserve): one library, its files by family.
// * int4_mm.cpp: int4_mm, amx = false: any rows, AVX-512 BF16 pair-dots;
// * int4_amx.cpp: int4_mm, amx = true: a few rows on the AMX tile unit, the same sums;
//   int4_gemm: many rows on AMX, on weights de-quantized to bfloat16 once per call;
// * int4_a8.cpp: int4_gemm_a8: any rows on AVX-512 VNNI, inputs quantized to int8 (not the
//   same numbers as the others: the ``avx512_vnni`` kernel of engine/weights/int4_tiles.py);
// * elementwise.cpp: silu_mul, the MLP's SiLU(gate) * up in one pass; rope_store, rotary +
//   K/V store;
// * decode_attention.cpp, prefill_attention.cpp: attention over the paged KV pool in place
//   (decode_chunk.h: decode attention's arithmetic on one chunk of context);
// * decode_layers.cpp: decode_layers, a decode step's decoder layers in one call;
// * near_logits.cpp: refine_near_logits, the LM head's leading logits recomputed exactly;
// * common.cpp: the attentions' shared checks; bind_threads, a core for each OpenMP thread;
// * register.cpp: the ops' schemas (TORCH_LIBRARY).
// engine/kernels/cpu/ops.py loads the library; engine/weights/int4_tiles.py and
// engine/model/fused_cpu.py choose among its ops.
//
// Built without -ffast-math, so nothing is reassociated: each kernel gives a row the same
// bits whatever the rows beside it and the threads (each file says how).
//
// This header: the ops register.cpp registers, the argument checks the two attentions share
// (common.cpp), and the vector helpers the elementwise and attention files share.

#pragma once

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
#include <optional>

// (AVX-512 VL for the 16-lane bfloat16 loads and stores: every AVX-512 BF16 CPU has it.)
#define PDSERVE_VL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

namespace pdserve {

// The ops, by file; their arguments are described where they are defined.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& w, int64_t n, bool use_amx);
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& w, int64_t n);
at::Tensor int4_gemm_a8(const at::Tensor& x_in, const at::Tensor& w, int64_t n);
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType dtype);
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& positions,
                      const at::Tensor& cos_sin, at::Tensor key_cache, at::Tensor value_cache,
                      const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale,
                            const std::optional<at::Tensor>& q_starts, int64_t prefetch);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& q_starts,
                             const at::Tensor& seq_lens, const at::Tensor& block_tables,
                             double scale);
at::Tensor decode_layers(const at::Tensor& h, at::Tensor residual, at::TensorList tiles,
                         at::IntArrayRef outs, at::TensorList norms, double eps,
                         const at::Tensor& positions, const at::Tensor& cos_sin,
                         at::TensorList caches, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& q_starts, int64_t num_heads, int64_t num_kv_heads,
                         double scale, bool amx, at::IntArrayRef planes, bool a8);
at::Tensor refine_near_logits(at::Tensor out, const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                              int64_t margin_steps, int64_t max_refined);

// Argument checks the two attentions share. key_cache / value_cache: one layer's
// (num_blocks, KVH, block_size, D) views of the pool, a block's head chunk contiguous.
void check_kv_views(const char* name, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    int64_t d);
void check_block_tables(const char* name, const at::Tensor& block_tables, int64_t b_rows);
// The first ``used`` entries of one table name blocks inside the pool of ``nb``.
void check_blocks(const char* what, int64_t b, const int32_t* table, int64_t used, int64_t nb);
// Whether decode attention prefetches the context into L1 (else L2) on this CPU: on AMD family
// 26 (Zen 5) and later, where it measured faster (decode_attention.cpp).
bool kv_prefetch_l1();
// Each thread of the OpenMP team onto its own core (common.cpp).
int64_t bind_threads(at::IntArrayRef cores);

// NOTE: the helpers below are local to each file that includes this header (an unnamed
// namespace), as they were when the kernels were one file: each file inlines its own copy
// and compiles it as before. Splitting the library changed no kernel's arithmetic: its
// machine code is the one-file build's, instruction for instruction (one function's vector
// registers renamed), and every op's outputs are the same bits.
namespace {

// exp(x) = 2^n p(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), p Cephes'
// degree-6 polynomial for expf.
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

// idx[2t] = t, idx[2t + 1] = 32 + t: two vectors' first 16 values, interleaved (the
// attentions' bfloat16 pairs: two dimensions of a token, or a dimension of two tokens).
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

// 16 lanes (mask: the valid ones) of float32 or bfloat16 values, widened to float32.
PDSERVE_VL_TARGET inline __m512 load_ps(const void* p, bool bf16, __mmask16 mask) {
  if (!bf16) return _mm512_maskz_loadu_ps(mask, p);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 float32 lanes stored as float32 or rounded to bfloat16.
PDSERVE_VL_TARGET inline void store_ps(void* p, bool bf16, __m512 v) {
  if (bf16) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  } else {
    _mm512_storeu_ps(p, v);
  }
}

}  // namespace
}  // namespace pdserve
