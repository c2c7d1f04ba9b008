// The argument checks the two attentions share (decode_attention.cpp,
// prefill_attention.cpp), where decode attention's prefetches go, and which core each
// thread of the OpenMP team runs on.

#include "common.h"

#include <cpuid.h>
#include <sched.h>

#include <atomic>

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

// Team thread t (the caller is thread 0) onto cores[t] alone, for a team of as many
// threads as ``cores`` has entries (torch's thread count must allow them). Later teams of
// this size or smaller reuse these threads (libgomp keeps its pool), so each stays on its
// core (runtime/cpu_affinity.py). -> how many threads took their core: fewer than
// ``cores`` where the runtime gave a smaller team or the kernel refused a core.
int64_t bind_threads(at::IntArrayRef cores) {
  const int64_t n = int64_t(cores.size());
  TORCH_CHECK(n >= 1 && n <= at::get_num_threads(), "bind_threads: ", n,
              " cores for a team of at most ", at::get_num_threads(), " threads");
  for (const int64_t c : cores)
    TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "bind_threads: no core ", c);
  std::atomic<int64_t> bound{0};
  at::parallel_for(0, n, 1, [&](int64_t t0, int64_t t1) {
    // One index a thread when the team is whole; a thread given several binds to none.
    if (t1 - t0 != 1 || at::get_thread_num() != t0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(int(cores[size_t(t0)]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) bound.fetch_add(1);
  });
  return bound.load();
}

}  // namespace pdserve
