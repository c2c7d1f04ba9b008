// decode_layers: a decode step's decoder layers in one call, for a float32 model whose linear
// layers are all on pdserve's int4 kernel and whose attention is pdserve's (the fused CPU
// backend's decode path, engine/model/fused_cpu.py ``FusedCpuBackend.fused_layers``).
//
// At one to a few rows a layer's arithmetic takes ~150 us, and the Python around its nine
// kernels (the modules' forwards, the kernel choice per call, the dispatcher) took ~20 us
// more a layer: ~0.6 ms of a ~7 ms step on the default model. Here the same kernels run in
// the same order on the same inputs, so a row gets the bits the Python loop gives it
// (tests/engine/test_decode_layers.py compares them): per layer
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
// gate_up and down weights (outs: their output widths), norms[2l] its post-attention norm's
// weight and norms[2l + 1] the next layer's input norm's (the last: the final norm's);
// caches[2l], caches[2l + 1] its K and V views (rope_store's). positions, cos_sin, slots:
// rope_store's; block_tables, seq_lens, q_starts: decode_attention's (one row a sequence).
// -> (T, hidden) float32: the final norm of the last layer's output (the head's input).
at::Tensor decode_layers(const at::Tensor& h, at::Tensor residual, at::TensorList tiles,
                         at::IntArrayRef outs, at::TensorList norms, double eps,
                         const at::Tensor& positions, const at::Tensor& cos_sin,
                         at::TensorList caches, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& q_starts, int64_t num_heads, int64_t num_kv_heads,
                         double scale, bool amx) {
  const int64_t layers = int64_t(tiles.size()) / 4;
  TORCH_CHECK(layers >= 1 && int64_t(tiles.size()) == 4 * layers,
              "decode_layers: four packed weights a layer");
  TORCH_CHECK(int64_t(norms.size()) == 2 * layers && int64_t(caches.size()) == 2 * layers,
              "decode_layers: two norms and two cache views a layer");
  TORCH_CHECK(outs.size() == 4, "decode_layers: the output widths of qkv, o, gate_up, down");
  TORCH_CHECK(h.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat &&
                  h.dim() == 2 && h.sizes() == residual.sizes(),
              "decode_layers: h and residual must be float32 (T, hidden)");
  const int64_t rows = h.size(0), d = caches[0].size(3);
  const auto& add_norm = add_norm_op();
  at::Tensor x = h;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& kc = caches[size_t(2 * l)];
    const at::Tensor& vc = caches[size_t(2 * l + 1)];
    const at::Tensor qkv = int4_mm(x, tiles[size_t(4 * l)], outs[0], amx);
    const at::Tensor q =
        rope_store(qkv, positions, cos_sin, kc, vc, slots, num_heads, num_kv_heads)
            .to(kc.scalar_type())
            .contiguous();
    const at::Tensor a =
        decode_attention(q, kc, vc, block_tables, seq_lens, scale, q_starts);
    at::Tensor o = int4_mm(a.view({rows, num_heads * d}), tiles[size_t(4 * l + 1)], outs[1], amx);
    add_norm.call(o, residual, norms[size_t(2 * l)], eps);
    const at::Tensor gate_up = int4_mm(o, tiles[size_t(4 * l + 2)], outs[2], amx);
    at::Tensor down =
        int4_mm(silu_mul(gate_up, at::kBFloat16), tiles[size_t(4 * l + 3)], outs[3], amx);
    add_norm.call(down, residual, norms[size_t(2 * l + 1)], eps);
    x = down;
  }
  return x;
}

}  // namespace pdserve
