// The elementwise ops around the GEMMs: silu_mul and rope_store.

#include "common.h"

namespace pdserve {
namespace {

// silu_mul: SiLU(gate) * up in one pass, between the MLP's two projections. torch runs it
// as a widening cast, silu, then a multiply (three passes; a mixed-dtype multiply when the
// gate_up projection came out in bfloat16), which at 256 prefill rows costs more than a
// tenth of the layer's GEMMs' time.

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

}  // namespace

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

// rope_store: rotary + K/V store in one pass, between a layer's qkv projection and its
// attention. The fused backend otherwise widens qkv to float32 (rotary reads its tables'
// dtype), rotates q and k in place, rounds the whole of qkv to the cache's dtype, then
// scatters K and V into the pool with a fourth op; four passes (four dispatches a layer at
// one decode row), where this is one.
//
// The cache is the attention library's ``vec16`` order (``engine/model/fused_cpu.py``):
// per block and KV head, K as (D, block_size) (a token's values a column apart) and V as
// (block_size, D); ``key_cache`` / ``value_cache`` are one layer's (num_blocks, KVH,
// block_size, D) views of the pool, strides (any, any, D, 1).

namespace {

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

}  // namespace

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

}  // namespace pdserve
