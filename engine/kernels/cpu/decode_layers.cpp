// decode_layers: a decode step's decoder layers in one call, for a float32 model whose linear
// layers are all on pdserve's int4 kernel (int4 weights, or int8 as two nibble planes) and
// whose attention is pdserve's (the fused CPU
// backend's decode path, engine/model/fused_cpu.py ``FusedCpuBackend.decode_layers``).
//
// At one to a few rows a layer's arithmetic takes ~130 us, and the Python around its nine
// kernels (the modules' forwards, the kernel choice per call, the dispatcher) ~55 us more:
// ~1.7 ms of a ~7.7 ms one-row step on the default model (0.77x with this op). Here the same
// kernels run in the same order on the same inputs, so a row gets the bits the Python loop
// gives it (tests/engine/test_decode_layers.py compares them): per layer
//     qkv = int4_mm(h); q = rope_store(qkv, ...) (K and V into their slots);
//     a = decode_attention(q, ...); o = int4_mm(a); add + RMSNorm(o, residual);
//     gu = int4_mm(h); d = int4_mm(silu_mul(gu)); add + RMSNorm(d, residual)
// with the add + RMSNorm the kernel library's (``_C::fused_add_rms_norm``, which the fused
// backend runs; looked up once, so this file does not link against the library).

#include "common.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace pdserve {

namespace {

using AddNorm = void(at::Tensor&, at::Tensor&, std::optional<at::Tensor>, double);

const c10::TypedOperatorHandle<AddNorm>& add_norm_op() {
  static const c10::TypedOperatorHandle<AddNorm> op =
      c10::Dispatcher::singleton().findSchemaOrThrow("_C::fused_add_rms_norm", "").typed<AddNorm>();
  return op;
}

}  // namespace

// h: (T, hidden) float32, the first layer's normed input; residual: (T, hidden) float32, the
// residual stream, updated in place. Per layer l: tiles[4l .. 4l + 3] the packed qkv, o,
// gate_up and down weights (outs: their output widths; planes: 1 where that kind is int8,
// held as two nibble planes, else 0), norms[2l] its post-attention norm's
// weight and norms[2l + 1] the next layer's input norm's (the last: the final norm's);
// caches[2l], caches[2l + 1] its K and V views (rope_store's). a8: the products take int8
// inputs (int4_gemm_a8: the avx512_vnni kernel), else int4_mm. positions, cos_sin, slots:
// rope_store's; block_tables, seq_lens, q_starts: decode_attention's (one row a sequence).
// -> (T, hidden) float32: the final norm of the last layer's output (the head's input).
at::Tensor decode_layers(const at::Tensor& h, at::Tensor residual, at::TensorList tiles,
                         at::IntArrayRef outs, at::TensorList norms, double eps,
                         const at::Tensor& positions, const at::Tensor& cos_sin,
                         at::TensorList caches, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& q_starts, int64_t num_heads, int64_t num_kv_heads,
                         double scale, bool amx, at::IntArrayRef planes, bool a8) {
  const int64_t layers = int64_t(tiles.size()) / 4;
  TORCH_CHECK(layers >= 1 && int64_t(tiles.size()) == 4 * layers,
              "decode_layers: four packed weights a layer");
  TORCH_CHECK(int64_t(norms.size()) == 2 * layers && int64_t(caches.size()) == 2 * layers,
              "decode_layers: two norms and two cache views a layer");
  TORCH_CHECK(outs.size() == 4 && planes.size() == 4,
              "decode_layers: the output widths of qkv, o, gate_up, down, and their layouts");
  TORCH_CHECK(h.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat &&
                  h.dim() == 2 && h.sizes() == residual.sizes(),
              "decode_layers: h and residual must be float32 (T, hidden)");
  const int64_t rows = h.size(0), d = caches[0].size(3);
  const auto& add_norm = add_norm_op();
  // Layer l's product of kind k (0 qkv, 1 o, 2 gate_up, 3 down) with x, as its Python kernel
  // computes it: an int8 weight's two nibble planes take the input rounded to bfloat16 twice
  // over (``Int8Kernel``).
  const auto product = [&](const at::Tensor& in, int64_t l, size_t k) {
    const at::Tensor& w = tiles[size_t(4 * l) + k];
    at::Tensor x = in;
    if (planes[k] != 0) {
      const at::Tensor xb = in.to(at::kBFloat16);
      x = at::cat({xb, xb}, 1);
    }
    return a8 ? int4_gemm_a8(x, w, outs[k]) : int4_mm(x, w, outs[k], amx);
  };
  at::Tensor x = h;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& kc = caches[size_t(2 * l)];
    const at::Tensor& vc = caches[size_t(2 * l + 1)];
    const at::Tensor qkv = product(x, l, 0);
    const at::Tensor q =
        rope_store(qkv, positions, cos_sin, kc, vc, slots, num_heads, num_kv_heads)
            .to(kc.scalar_type())
            .contiguous();
    const at::Tensor a =
        decode_attention(q, kc, vc, block_tables, seq_lens, scale, q_starts, -1);
    at::Tensor o = product(a.view({rows, num_heads * d}), l, 1);
    add_norm.call(o, residual, norms[size_t(2 * l)], eps);
    const at::Tensor gate_up = product(o, l, 2);
    at::Tensor down = product(silu_mul(gate_up, at::kBFloat16), l, 3);
    add_norm.call(down, residual, norms[size_t(2 * l + 1)], eps);
    x = down;
  }
  return x;
}

}  // namespace pdserve
