// refine_near_logits: the LM head's near logits recomputed exactly, in place (RefinedHead,
// engine/weights/refined_head.py). The packed head's logits are bfloat16-accurate; every
// logit of a row within ``margin_steps`` bfloat16 steps of the row's maximum (a step:
// 2^(exponent of the maximum - 7)) is recomputed in float32 from the int8 rows of the head
// (W[n, k] = q[n, k] * scale[n, k / 32]). A row with more than ``max_refined`` such logits
// has only its ``max_refined`` largest recomputed (ties: the lower index first).
//
// The torch ops this replaces (a max, a compare, a nonzero, a gather and de-quantization, a
// product and a sum, an index_put) cost ~0.36 ms of a ~4 ms one-row decode step on two cores,
// most of it in the fork and join of each small op's threads; this is one pass over the row
// for its maximum, one for the near logits, and a dot product each.
//
// A logit's sum runs over k in the same order whatever the batch and the threads (16 lanes
// of k mod 16, then the lanes added in a fixed tree), so a row's bits do not depend on the
// rows beside it.

#include "common.h"

namespace pdserve {
namespace {

constexpr int64_t kGroup = 32;

// 2^(e - 7) for |v| = 1.m x 2^e (|v| below 1e-30 counts as 1e-30): one bfloat16 step at v.
float bf16_step(float v) {
  int e = 0;
  std::frexp(std::max(std::fabs(v), 1e-30f), &e);  // |v| = f x 2^e, f in [0.5, 1)
  return std::ldexp(1.0f, e - 1 - 7);
}

PDSERVE_VL_TARGET float row_max(const float* row, int64_t v) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + i));
  alignas(64) float lanes[16];  // (not _mm512_reduce_max_ps: GCC 12 warns in its header)
  _mm512_store_ps(lanes, m);
  float out = lanes[0];
  for (int j = 1; j < 16; ++j) out = std::max(out, lanes[j]);
  for (; i < v; ++i) out = std::max(out, row[i]);
  return out;
}

// The columns of ``row`` at or above ``threshold``, in column order.
PDSERVE_VL_TARGET void near_columns(const float* row, int64_t v, float threshold,
                                    std::vector<int32_t>& cols) {
  const __m512 t = _mm512_set1_ps(threshold);
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) {
    __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), t, _CMP_GE_OQ);
    while (hit) {
      cols.push_back(int32_t(i + __builtin_ctz(hit)));
      hit = __mmask16(hit & (hit - 1));
    }
  }
  for (; i < v; ++i)
    if (row[i] >= threshold) cols.push_back(int32_t(i));
}

// sum_k x[k] * (q[k] * scale[k / 32]): 16 lanes of partial sums (lane j: k = j mod 16), each
// product rounded to float32 before it is added, then the lanes added pairwise.
PDSERVE_VL_TARGET float exact_logit(const float* x, const int8_t* q, const float* scale,
                                    int64_t k) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 w = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)))),
        _mm512_set1_ps(scale[i / kGroup]));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(x + i), w));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

}  // namespace

// out: (T, V) float32, the packed head's logits, refined in place and returned; x: (T, K)
// float32; codes: (V, K) int8; scale: (V, K / 32) float32; bias: (V,) float32 or None.
at::Tensor refine_near_logits(at::Tensor out, const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                              int64_t margin_steps, int64_t max_refined) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && codes.dim() == 2 && scale.dim() == 2,
              "refine_near_logits: out, x, codes and scale must be 2-D");
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat &&
                  codes.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "refine_near_logits: out and x float32, codes int8, scale float32");
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && codes.is_contiguous() &&
                  scale.is_contiguous(),
              "refine_near_logits: contiguous tensors only");
  const int64_t t_rows = out.size(0), v = out.size(1), k = x.size(1);
  TORCH_CHECK(x.size(0) == t_rows && codes.size(0) == v && codes.size(1) == k &&
                  k % kGroup == 0 && scale.size(0) == v && scale.size(1) == k / kGroup,
              "refine_near_logits: shapes do not agree");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == v &&
                                    bias->is_contiguous()),
              "refine_near_logits: bias must be float32 (V,)");
  TORCH_CHECK(max_refined > 0, "refine_near_logits: max_refined must be positive");
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  // A few rows (a decode step, a verification) run on the calling thread: no fork and join.
  at::parallel_for(0, t_rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<int32_t> cols;
    for (int64_t r = r0; r < r1; ++r) {
      float* row = o + r * v;
      const float top = row_max(row, v);
      cols.clear();
      near_columns(row, v, top - float(margin_steps) * bf16_step(top), cols);
      if (int64_t(cols.size()) > max_refined) {  // only the largest, ties to the lower index
        std::partial_sort(cols.begin(), cols.begin() + max_refined, cols.end(),
                          [row](int32_t a, int32_t b) {
                            return row[a] > row[b] || (row[a] == row[b] && a < b);
                          });
        cols.resize(size_t(max_refined));
      }
      for (const int32_t c : cols) {
        const float exact = exact_logit(xp + r * k, qp + int64_t(c) * k,
                                        sp + int64_t(c) * (k / kGroup), k);
        row[c] = bp != nullptr ? exact + bp[c] : exact;
      }
    }
  });
  return out;
}

}  // namespace pdserve
