// decode_attention: query rows that each attend over their own length of a sequence's context
// in the pool (one a sequence in a decode step; a speculative verification's k + 1, each as its
// decode step would), in the library's ``vec16`` order (see rope_store, elementwise.cpp: per
// block and KV head, K as (D, block_size), V as (block_size, D)). A decode step is bound by
// reading that context; the library's kernel reads it at ~15 GB/s here, where a copy of the
// pool moves ~20 GB/s each way (``benchmarks/results/fused_ops.md``).
//
// A task is (query row, KV head, part of the row's context): its G = H / KVH query heads
// share every K and V load, and so do the rows of one sequence grouped on one core. Per 16
// tokens: the scores of a head are one vector (K's columns are tokens), then an online
// softmax (running max and sum per head) and V's rows accumulated in float32; in a bfloat16
// pool both products are pair-dots on the chunk re-laid once for the group's rows
// (decode_chunk.h). Blocks are prefetched two ahead (a table's blocks are anywhere in the
// pool). A row's result does not depend on the rows beside it or on the threads: each row
// runs the same instructions in the same order whatever the batch.

#include "decode_chunk.h"

namespace pdserve {
namespace {

// Blocks read ahead (a one-row step at 1000 tokens 7.5-8.5 ms, against 8.6-8.8 at 1; 4 slower).
constexpr int64_t kAttnAhead = 2;
constexpr int64_t kSplitTokens = 512;

// One query row of a group: its G heads' q (in the cache's dtype), its tokens [begin, end) of
// the sequence's context, and where its result goes. With ``out`` (the whole context): the
// G heads' attention, normalized, in the cache's dtype. Else the softmax state into
// ``state`` (G, 2 + D): per head its running max, its sum of exponentials and its weighted
// sum of V rows, float32 (an empty range: max -inf, sum 0).
struct GroupRow {
  const void* q_row;
  int64_t begin, end;  // on 16-token boundaries, but for ``end`` at the context's end
  float* state;
  void* out;
};

constexpr int kGroupRows = 8;  // rows of one sequence and KV head that share each chunk's loads

// Up to kGroupRows rows of one sequence (a verification's, or a split row's halves) over
// one KV head's G heads. Each 16-token chunk of the rows' ranges is read once (in a bfloat16
// pool, made into K and V pairs once) and attended by every row whose range holds it, one
// row after the other. Each row runs the same chunk code on the same chunks in the same
// order as it does alone (a decode step, one row), so its bits do not depend on the rows
// grouped with it. (In a bfloat16 pool, a row whose context ends inside a chunk that a
// longer row of the group reads further sees that row's V pairs there, times its own
// probability 0: products of +-0, which leave every sum as it is, bar the sign of a sum
// that is exactly 0.)
template <int G, int DV, bool BF16>
PDSERVE_VL_TARGET PDSERVE_EXACT_FP void decode_attention_rows(
    const GroupRow* rows, int n_rows, const char* k_head0, const char* v_head0,
    int64_t block_stride, const int32_t* table, int64_t bs, float scale, bool l1) {
  constexpr int64_t D = DV * 16, esize = BF16 ? 2 : 4;
  // q per row: a bfloat16 pool's as bfloat16 pairs (scaled after the dots), a float32
  // pool's scaled.
  uint32_t q_pairs[kGroupRows][G][BF16 ? DV * 8 : 1];
  float q_f32[kGroupRows][G][BF16 ? 1 : D];
  RowState<G, DV> st[kGroupRows];
  int64_t t_begin = rows[0].begin, t_end = rows[0].end;
  for (int r = 0; r < n_rows; ++r) {
    t_begin = std::min(t_begin, rows[r].begin);
    t_end = std::max(t_end, rows[r].end);
    for (int h = 0; h < G; ++h) {
      const char* src = static_cast<const char*>(rows[r].q_row) + h * D * esize;
      if constexpr (BF16) {
        std::memcpy(q_pairs[r][h], src, D * 2);
      } else {
        for (int v = 0; v < DV; ++v)
          _mm512_storeu_ps(&q_f32[r][h][v * 16],
                           _mm512_mul_ps(_mm512_loadu_ps(src + v * 64), _mm512_set1_ps(scale)));
      }
      for (int v = 0; v < DV; ++v) st[r].acc[h][v] = _mm512_setzero_ps();
      st[r].m[h] = -INFINITY;
      st[r].l[h] = 0.0f;
    }
  }
  // A bfloat16 chunk's K and V pairs, made once for the rows.
  alignas(64) __m512i k_chunk[BF16 ? DV * 8 : 1], v_chunk[BF16 ? DV * 8 : 1];
  const int64_t chunk_bytes = bs * D * esize, last_block = (t_end - 1) / bs;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += 16) {
    const int64_t block = table[t0 / bs], off = t0 % bs;
    const char* kb = k_head0 + (block * block_stride) * esize;
    const char* vb = v_head0 + (block * block_stride) * esize;
    if constexpr (BF16) {
      k_pairs<DV>(kb, bs, off, k_chunk);
      v_pairs<DV>(vb, off, std::min<int64_t>(16, t_end - t0), v_chunk);
    }
    // A block's first chunk asks for the blocks kAttnAhead on, after the chunk's own loads
    // (the re-layout): issued before them, the prefetches' burst held those loads up behind
    // it (a decode row at 2,048 tokens, attention alone: 1.18x faster after, Zen 5).
    if (off == 0 || t0 == t_begin) {
      for (int64_t a = t0 == t_begin ? 1 : kAttnAhead; a <= kAttnAhead; ++a)
        if (t0 / bs + a <= last_block)
          prefetch_kv(k_head0, v_head0, table[t0 / bs + a] * block_stride * esize, chunk_bytes,
                      l1);
    }
    for (int r = 0; r < n_rows; ++r) {
      if (t0 < rows[r].begin || t0 >= rows[r].end) continue;
      const int64_t valid = std::min<int64_t>(16, rows[r].end - t0);
      __m512 s[G];
      if constexpr (BF16) {
        scores_pairs<G, DV>(q_pairs[r], k_chunk, scale, s);
        softmax_pairs<G, DV>(s, v_chunk, valid, st[r]);
      } else {
        const __mmask16 mask = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
        scores_f32<G, DV>(q_f32[r], kb, bs, off, mask, s);
        softmax_v<G, DV>(s, vb, off, valid, st[r]);
      }
    }
  }
  for (int r = 0; r < n_rows; ++r) {
    for (int h = 0; h < G; ++h) {
      if (rows[r].out != nullptr) {
        const __m512 inv = _mm512_set1_ps(1.0f / st[r].l[h]);
        for (int v = 0; v < DV; ++v)
          store_ps(static_cast<char*>(rows[r].out) + (h * D + v * 16) * esize, BF16,
                   _mm512_mul_ps(st[r].acc[h][v], inv));
        continue;
      }
      float* dst = rows[r].state + h * (2 + D);
      dst[0] = st[r].m[h];
      dst[1] = st[r].l[h];
      for (int v = 0; v < DV; ++v) _mm512_storeu_ps(dst + 2 + v * 16, st[r].acc[h][v]);
    }
  }
}

using DecodeRows = void (*)(const GroupRow*, int, const char*, const char*, int64_t,
                            const int32_t*, int64_t, float, bool);

template <int G, int DV>
DecodeRows decode_rows_fn(bool bf16) {
  return bf16 ? &decode_attention_rows<G, DV, true> : &decode_attention_rows<G, DV, false>;
}

template <int DV>
DecodeRows decode_rows_for(int64_t g, bool bf16) {
  switch (g) {
    case 1: return decode_rows_fn<1, DV>(bf16);
    case 2: return decode_rows_fn<2, DV>(bf16);
    case 3: return decode_rows_fn<3, DV>(bf16);
    case 4: return decode_rows_fn<4, DV>(bf16);
    case 5: return decode_rows_fn<5, DV>(bf16);
    case 6: return decode_rows_fn<6, DV>(bf16);
    case 7: return decode_rows_fn<7, DV>(bf16);
    case 8: return decode_rows_fn<8, DV>(bf16);
    default: return nullptr;
  }
}

// Two states of one head (2 + D floats each) merged, normalized, stored in the cache's dtype.
PDSERVE_VL_TARGET void merge_parts(const float* a, const float* b, int64_t d, bool bf16,
                                   char* out) {
  const float m = std::max(a[0], b[0]);  // a's range is never empty
  const float ea = std::exp(a[0] - m), eb = b[0] == -INFINITY ? 0.0f : std::exp(b[0] - m);
  const __m512 wa = _mm512_set1_ps(ea / (a[1] * ea + b[1] * eb));
  const __m512 wb = _mm512_set1_ps(eb / (a[1] * ea + b[1] * eb));
  for (int64_t v = 0; v < d; v += 16) {
    const __m512 o = _mm512_fmadd_ps(_mm512_loadu_ps(a + 2 + v), wa,
                                     _mm512_mul_ps(_mm512_loadu_ps(b + 2 + v), wb));
    store_ps(out + v * (bf16 ? 2 : 4), bf16, o);
  }
}

// Sequence s's rows are [starts[s], starts[s + 1]): q_starts, checked, or one row a sequence.
std::vector<int32_t> row_starts(const std::optional<at::Tensor>& q_starts, int64_t b_rows) {
  std::vector<int32_t> starts;
  if (q_starts.has_value()) {
    const at::Tensor& qs = *q_starts;
    TORCH_CHECK(qs.scalar_type() == at::kInt && qs.dim() == 1 && qs.numel() >= 1 &&
                    qs.is_contiguous(),
                "decode_attention: q_starts must be int32 (S + 1,)");
    starts.assign(qs.data_ptr<int32_t>(), qs.data_ptr<int32_t>() + qs.numel());
    TORCH_CHECK(starts.front() == 0 && starts.back() == b_rows,
                "decode_attention: q_starts must run from 0 to the ", b_rows, " rows");
    for (size_t s = 1; s < starts.size(); ++s)
      TORCH_CHECK(starts[s] >= starts[s - 1], "decode_attention: q_starts must not decrease");
  } else {
    starts.resize(size_t(b_rows + 1));
    for (int64_t b = 0; b <= b_rows; ++b) starts[size_t(b)] = int32_t(b);
  }
  return starts;
}

// Each row's length fits its sequence's table of ``width`` blocks, and the entries its
// longest row reads name blocks inside the pool of ``nb``.
void check_rows(const std::vector<int32_t>& starts, const int32_t* lens, const int32_t* tables,
                int64_t width, int64_t bs, int64_t nb) {
  const int64_t seqs = int64_t(starts.size()) - 1;
  for (int64_t s = 0; s < seqs; ++s) {
    int32_t longest = 0;
    for (int32_t b = starts[size_t(s)]; b < starts[size_t(s + 1)]; ++b) {
      TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * bs, "decode_attention: row ", b, " has ",
                  lens[b], " tokens for ", width, " blocks");
      longest = std::max(longest, lens[b]);
    }
    check_blocks("decode_attention: sequence ", s, tables + s * width, (longest + bs - 1) / bs, nb);
  }
}

// A split row's halves: [0, mid) and [mid, n), mid on a 16-token boundary.
inline int64_t mid_of(int64_t n) { return std::min<int64_t>(n, ((n + 15) / 16 + 1) / 2 * 16); }

struct DecodeItem {
  int32_t row, seq, kh;
  int32_t begin, end;  // tokens [begin, end) of the row's context
  float* state;        // a split row's half: its softmax state here, else the output
};

// One call's work: its (row, KV head, part) items in the order workers take them, and the
// rows split in two with their halves' softmax states.
// NOTE: items point into ``states``; a plan is moved, never copied (a moved vector keeps its
// buffer).
struct DecodePlan {
  std::vector<DecodeItem> items;
  std::vector<int32_t> split_rows;  // split_rows[i]: the row of split i
  std::vector<float> states;        // per split, KV head and half: G heads of 2 + D floats
};

// Items sequence by sequence, KV head by KV head, and within that row by row (a split row's
// first halves, then its second ones).
DecodePlan plan_items(const std::vector<int32_t>& starts, const int32_t* lens, int64_t b_rows,
                      int64_t kvh, int64_t h, int64_t g, int64_t per_head) {
  DecodePlan plan;
  // split_of[b]: row b's split index (its states' place), -1 if it is not split.
  std::vector<int32_t> split_of(size_t(b_rows), -1);
  for (int32_t b = 0; b < int32_t(b_rows); ++b) {
    if (lens[b] > kSplitTokens) {
      split_of[size_t(b)] = int32_t(plan.split_rows.size());
      plan.split_rows.push_back(b);
    }
  }
  const int64_t splits = int64_t(plan.split_rows.size()), seqs = int64_t(starts.size()) - 1;
  plan.states.resize(size_t(splits * h * 2 * per_head));
  float* st = plan.states.data();
  std::vector<DecodeItem>& items = plan.items;
  items.reserve(size_t((b_rows + splits) * kvh));
  for (int32_t s = 0; s < int32_t(seqs); ++s) {
    for (int32_t kh = 0; kh < int32_t(kvh); ++kh) {
      for (int32_t part = 0; part < 2; ++part) {
        for (int32_t b = starts[size_t(s)]; b < starts[size_t(s + 1)]; ++b) {
          const int32_t split = split_of[size_t(b)], n = lens[b];
          if (split < 0) {
            if (part == 0) items.push_back({b, s, kh, 0, n, nullptr});
            continue;
          }
          float* state = st + ((int64_t(split) * kvh + kh) * 2 + part) * g * per_head;
          items.push_back({b, s, kh, part == 0 ? 0 : int32_t(mid_of(n)),
                           part == 0 ? int32_t(mid_of(n)) : n, state});
        }
      }
    }
  }
  return plan;
}

// Worker w takes items [cuts[w], cuts[w + 1]): one contiguous run each, cut where their
// tokens balance.
std::vector<int64_t> balance_cuts(const std::vector<DecodeItem>& items, int64_t workers) {
  const int64_t n_items = int64_t(items.size());
  std::vector<int64_t> cuts(size_t(workers + 1), n_items);
  cuts[0] = 0;
  int64_t total = 0, seen = 0;
  for (const DecodeItem& it : items) total += it.end - it.begin;
  for (int64_t i = 0, w = 1; i < n_items && w < workers; ++i) {
    const int64_t before = seen;
    seen += items[size_t(i)].end - items[size_t(i)].begin;
    for (; w < workers && seen * workers >= total * w; ++w) {  // share w ends in item i
      const bool after = seen * workers - total * w <= total * w - before * workers;
      cuts[size_t(w)] = std::max(cuts[size_t(w - 1)], after ? i + 1 : i);  // the nearer
    }
  }
  return cuts;
}

// Each split row's two halves merged into its G heads of output, per (split, KV head).
void merge_splits(const DecodePlan& plan, int64_t kvh, int64_t h, int64_t g, int64_t d,
                  bool bf16, char* op) {
  const int64_t splits = int64_t(plan.split_rows.size()), per_head = 2 + d, esize = bf16 ? 2 : 4;
  const float* st = plan.states.data();
  at::parallel_for(0, splits * kvh, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t kh = i % kvh, head0 = plan.split_rows[size_t(i / kvh)] * h + kh * g;
      const float* halves = st + i * 2 * g * per_head;  // split i / kvh, KV head kh
      for (int64_t j = 0; j < g; ++j)
        merge_parts(halves + j * per_head, halves + (g + j) * per_head, d, bf16,
                    op + (head0 + j) * d * esize);
    }
  });
}

}  // namespace

// q: (B, H, D) in the cache's dtype, contiguous; key_cache / value_cache: one layer's
// (num_blocks, KVH, block_size, D) views (rope_store's); block_tables: int32 (S, W), one a
// sequence; seq_lens: int32 (B,), each row's context length (>= 1); q_starts: int32
// (S + 1,), sequence s's rows are [q_starts[s], q_starts[s + 1]) (None: one row a sequence,
// S = B); prefetch: where the context is prefetched, 1 L1, 0 L2, -1 this CPU's choice
// (``kv_prefetch_l1``). -> (B, H, D) in the cache's dtype.
//
// A decode step has one row a sequence; a speculative verification has k + 1, each a query
// over its own length of the same context, each row's result bit for bit what a decode step
// of that length gives (the same attend_chunk calls on the same chunks). A row longer than
// kSplitTokens is split in two halves (by 16-token chunks), their states merged after, so
// that a few long sequences still fill the cores. Whether and where a row is split depends
// on its length alone, never on the batch, the rows beside it or the threads.
//
// The (row, KV head, part) items are ordered sequence by sequence, KV head by KV head, and
// within that row by row. Each worker takes one contiguous run of items, the runs cut where
// their tokens balance, and runs each stretch of it that shares a sequence and KV head (up
// to kGroupRows items: a verification's rows) as one group, each chunk read once for all.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale,
                            const std::optional<at::Tensor>& q_starts, int64_t prefetch) {
  TORCH_CHECK(prefetch >= -1 && prefetch <= 1, "decode_attention: prefetch must be -1, 0 or 1");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "decode_attention: q must be contiguous (B, H, D)");
  check_kv_views("decode_attention", key_cache, value_cache, q.size(2));
  const int64_t b_rows = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t kvh = key_cache.size(1), bs = key_cache.size(2);
  const bool bf16 = key_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || key_cache.scalar_type() == at::kFloat,
              "decode_attention: the cache must be float32 or bfloat16");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type(),
              "decode_attention: q must be in the cache's dtype");
  TORCH_CHECK(bs % 16 == 0 && kvh > 0 && h % kvh == 0,
              "decode_attention: block size ", bs, ", heads ", h, " over ", kvh);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == b_rows &&
                  seq_lens.is_contiguous(),
              "decode_attention: seq_lens must be int32 (B,)");
  const std::vector<int32_t> starts = row_starts(q_starts, b_rows);
  const int64_t seqs = int64_t(starts.size()) - 1;
  check_block_tables("decode_attention", block_tables, seqs);
  const int64_t g = h / kvh, width = block_tables.size(1);
  const DecodeRows run = d == 64 ? decode_rows_for<4>(g, bf16)
                         : d == 128 ? decode_rows_for<8>(g, bf16) : nullptr;
  TORCH_CHECK(run != nullptr, "decode_attention: head size ", d, " with ", g,
              " heads a KV head is not built");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  check_rows(starts, lens, tables, width, bs, key_cache.size(0));
  at::Tensor out = at::empty_like(q);
  const int64_t esize = bf16 ? 2 : 4;
  const DecodePlan plan = plan_items(starts, lens, b_rows, kvh, h, g, 2 + d);
  const std::vector<DecodeItem>& items = plan.items;
  const int64_t n_items = int64_t(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  const std::vector<int64_t> cuts = balance_cuts(items, workers);
  const char* kbase = static_cast<const char*>(key_cache.data_ptr());
  const char* vbase = static_cast<const char*>(value_cache.data_ptr());
  const char* qp = static_cast<const char*>(q.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t block_stride = key_cache.stride(0), head_stride = key_cache.stride(1);
  const bool l1 = prefetch < 0 ? kv_prefetch_l1() : prefetch == 1;
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    GroupRow group[kGroupRows];
    for (int64_t i = cuts[size_t(w0)]; i < cuts[size_t(w1)];) {
      const DecodeItem& first = items[size_t(i)];
      int n = 0;
      for (; i < cuts[size_t(w1)] && n < kGroupRows; ++i, ++n) {
        const DecodeItem& it = items[size_t(i)];
        if (it.seq != first.seq || it.kh != first.kh) break;
        const int64_t head0 = int64_t(it.row) * h + int64_t(it.kh) * g;
        group[n] = {qp + head0 * d * esize, it.begin, it.end, it.state,
                    it.state == nullptr ? op + head0 * d * esize : nullptr};
      }
      run(group, n, kbase + first.kh * head_stride * esize, vbase + first.kh * head_stride * esize,
          block_stride, tables + int64_t(first.seq) * width, bs, float(scale), l1);
    }
  });
  if (!plan.split_rows.empty()) merge_splits(plan, kvh, h, g, d, bf16, op);
  return out;
}

}  // namespace pdserve
