// The argument checks the two attentions share (decode_attention.cpp,
// prefill_attention.cpp), and where decode attention's prefetches go.

#include "common.h"

#include <cpuid.h>

namespace pdserve {

void check_kv_views(const char* name, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    int64_t d) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 &&
                  key_cache.strides() == value_cache.strides() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              name, ": K and V must be (num_blocks, KVH, block_size, D) views alike");
  const int64_t bs = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == d && key_cache.stride(3) == 1 && key_cache.stride(2) == d &&
                  key_cache.stride(1) == bs * d,
              name, ": each block's head chunk must be (block_size, D) contiguous");
}

void check_block_tables(const char* name, const at::Tensor& block_tables, int64_t b_rows) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.size(0) == b_rows && block_tables.is_contiguous(),
              name, ": block_tables must be contiguous int32 (B, W)");
}

// The first ``used`` entries of one table name blocks inside the pool of ``nb``.
void check_blocks(const char* what, int64_t b, const int32_t* table, int64_t used, int64_t nb) {
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < nb, what, b, " names block ", table[j]);
}

bool kv_prefetch_l1() {
  static const bool l1 = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __cpuid(0, a, b, c, d);
    const bool amd = b == 0x68747541;  // "Auth" of "AuthenticAMD"
    __cpuid(1, a, b, c, d);
    const unsigned base = (a >> 8) & 0xF, family = base + (base == 0xF ? (a >> 20) & 0xFF : 0);
    return amd && family >= 0x1A;
  }();
  return l1;
}

}  // namespace pdserve
