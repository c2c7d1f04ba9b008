// The ops' schemas and their CPU implementations (common.h names the file of each).

#include "common.h"

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
      "Tensor seq_lens, float scale, Tensor? q_starts=None, int prefetch=-1) -> Tensor");
  m.def(
      "prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor q_starts, "
      "Tensor seq_lens, Tensor block_tables, float scale) -> Tensor");
  m.def(
      "decode_layers(Tensor h, Tensor(a!) residual, Tensor[] tiles, int[] outs, Tensor[] norms, "
      "float eps, Tensor positions, Tensor cos_sin, Tensor(b!)[] caches, Tensor slots, "
      "Tensor block_tables, Tensor seq_lens, Tensor q_starts, int num_heads, "
      "int num_kv_heads, float scale, bool amx, int[] planes, bool a8=False) -> Tensor");
  m.def(
      "refine_near_logits(Tensor(a!) out, Tensor x, Tensor codes, Tensor scale, Tensor? bias, "
      "int margin_steps, int max_refined) -> Tensor(a!)");
  m.def("bind_threads(int[] cores) -> int");
}
TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("int4_mm", &pdserve::int4_mm);
  m.impl("int4_gemm", &pdserve::int4_gemm);
  m.impl("int4_gemm_a8", &pdserve::int4_gemm_a8);
  m.impl("silu_mul", &pdserve::silu_mul);
  m.impl("rope_store", &pdserve::rope_store);
  m.impl("decode_attention", &pdserve::decode_attention);
  m.impl("prefill_attention", &pdserve::prefill_attention);
  m.impl("decode_layers", &pdserve::decode_layers);
  m.impl("refine_near_logits", &pdserve::refine_near_logits);
}
// No tensor argument to dispatch on: the one implementation serves every key.
TORCH_LIBRARY_IMPL(pdserve, CatchAll, m) { m.impl("bind_threads", &pdserve::bind_threads); }
