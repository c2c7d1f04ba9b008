// prefill_attention: causal attention, bfloat16, of a step's prompt rows (prefill, chunked
// prefill, a prefix-cache hit's remainder) over each sequence's whole context in the pool, in
// place, in the same ``vec16`` order. Unlike a decode row, a prompt's rows share every K and V
// token, so the work is bound by arithmetic, not by reading the pool: both products run as
// bfloat16 pair-dots (vdpbf16ps, 32 products an instruction where a float32 FMA takes 16), on K
// and V re-laid as pairs once per 32 tokens for all the rows of a task.
//
// A task is (sequence, KV head, up to kPrefillRows query positions): its G x rows "q-rows"
// (position-major) walk the context in chunks of 32 tokens up to the last position; per
// chunk, per block of q-rows: the scores (QK, float32 sums), the causal mask, an online
// softmax (running max and sum per q-row, float32), the probabilities rounded to bfloat16
// and the weighted sum of V rows (float32 sums). The online softmax and the chunking start
// at token 0 and depend on a row's position alone, so a row's bits do not depend on the rows
// beside it, on how its prompt was split into chunks, or on the threads.
//
// The probabilities enter P V in bfloat16 (as GPU flash attention does); the row's output is
// rounded to the cache's bfloat16 after. Measured against float64 attention in
// tests/engine/test_fused_cpu.py.

#include "common.h"

namespace pdserve {
namespace {

constexpr int64_t kPrefillRows = 16;  // query positions a task
constexpr int kQkRows = 8;            // q-rows whose scores are summed at once (16 chains)

struct PrefillChunk {
  // One chunk of 32 tokens re-laid for pair-dots. kp[dp][half]: the 16 tokens of that half,
  // dimensions 2 dp and 2 dp + 1 interleaved; vp[tp][dv]: tokens 2 tp and 2 tp + 1 of the
  // chunk interleaved, for dimensions 16 dv..16 dv + 15.
  __m512i kp[64][2];
  __m512i vp[16][8];
};

// Tokens [t0, t0 + 32) of one KV head into ``c``; tokens past ``last`` (the task's last
// position) are not read: their K is left as it was (their scores are masked) and their V
// is zero (a masked probability is 0, and 0 times a stale value must stay 0).
template <int DV>
PDSERVE_VL_TARGET void pack_chunk(const uint16_t* k_head0, const uint16_t* v_head0,
                                  int64_t block_stride, const int32_t* table, int64_t bs,
                                  int64_t t0, int64_t last, __m512i idx, PrefillChunk& c) {
  constexpr int64_t D = DV * 16;
  for (int half = 0; half < 2; ++half) {
    const int64_t t = t0 + 16 * half;
    if (t > last) {
      for (int tp = 8 * half; tp < 8 * half + 8; ++tp)
        for (int v = 0; v < DV; ++v) c.vp[tp][v] = _mm512_setzero_si512();
      continue;
    }
    const int64_t block = table[t / bs], off = t % bs;
    const uint16_t* kb = k_head0 + block * block_stride + off;        // K: (D, bs)
    const uint16_t* vb = v_head0 + block * block_stride + off * D;    // V: (bs, D)
    for (int64_t dp = 0; dp < D / 2; ++dp)
      c.kp[dp][half] = interleave16(idx, kb + 2 * dp * bs, kb + (2 * dp + 1) * bs);
    for (int tp = 0; tp < 8; ++tp) {
      if (t + 2 * tp > last) {
        for (int v = 0; v < DV; ++v) c.vp[8 * half + tp][v] = _mm512_setzero_si512();
        continue;
      }
      const uint16_t* v0 = vb + 2 * tp * D;
      // The pair's second token may be past ``last`` (and past the context): zero it.
      alignas(64) uint16_t zero[16] = {};
      const uint16_t* v1 = t + 2 * tp + 1 > last ? nullptr : v0 + D;
      for (int v = 0; v < DV; ++v)
        c.vp[8 * half + tp][v] = interleave16(idx, v0 + v * 16, v1 ? v1 + v * 16 : zero);
    }
  }
}

// exp(x) for x <= 0 (a score minus its row's maximum), where the result is rounded to
// bfloat16 next (8 bits): 2^(x log2 e) = 2^n 2^f, |f| <= 1/2, 2^f by its degree-5 Taylor
// polynomial (relative error < 5e-6, far below bfloat16's 2^-9); 10 instructions where
// exp_ps takes 15. Below -100 it gives at most 2^-144, nothing against the maximum's 1.
PDSERVE_VL_TARGET inline __m512 exp_probability(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The raw scores (q . k, float32) of R q-rows against the chunk's 32 tokens. Its own
// function, its sums in locals: inlined into the softmax below, GCC kept a copy of every
// sum on the stack, stored after each pair-dot (twice the time).
template <int R, int DV>
PDSERVE_VL_TARGET __attribute__((noinline)) void chunk_dots(const uint16_t* const* q,
                                                            const PrefillChunk& c,
                                                            __m512 (&out)[R][2]) {
  constexpr int64_t D = DV * 16;
  __m512 s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    const __m512bh k0 = (__m512bh)c.kp[dp][0], k1 = (__m512bh)c.kp[dp][1];
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, q[r] + 2 * dp, 4);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r][0] = s[r][0];
    out[r][1] = s[r][1];
  }
}

// The scores of R q-rows against the chunk, masked and scaled, into an online softmax; their
// probabilities go to ``p`` (R x 32 bfloat16) and each row's rescale of its sum to ``corr``.
template <int R, int DV>
PDSERVE_VL_TARGET void chunk_scores(const uint16_t* const* q, const int64_t* pos, int64_t t0,
                                    float scale, const PrefillChunk& c, float* m, float* l,
                                    float* corr, uint32_t (*p)[16]) {
  __m512 s[R][2];
  chunk_dots<R, DV>(q, c, s);
  // No call in here (std::exp would spill every live vector): the rescales of all R rows
  // are one vector exp after their maxima.
  const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
  alignas(64) float shift[16] = {};  // m_old - m_new per row (0 for a row that sees nothing)
  __mmask16 mask[R][2];
  for (int r = 0; r < R; ++r) {
    const int64_t seen = std::min<int64_t>(32, pos[r] - t0 + 1);  // tokens this row sees
    mask[r][0] = seen >= 16 ? __mmask16(0xFFFF) : seen > 0 ? __mmask16((1u << seen) - 1) : 0;
    mask[r][1] = seen >= 32   ? __mmask16(0xFFFF)
                 : seen > 16 ? __mmask16((1u << (seen - 16)) - 1)
                             : __mmask16(0);
    s[r][0] = _mm512_mask_blend_ps(mask[r][0], ninf, _mm512_mul_ps(s[r][0], sc));
    s[r][1] = _mm512_mask_blend_ps(mask[r][1], ninf, _mm512_mul_ps(s[r][1], sc));
    if (seen <= 0) continue;  // the whole chunk is after this row: nothing changes
    const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1])));
    shift[r] = m[r] - m_new;  // -inf on a row's first chunk: its sums start from 0
    m[r] = m_new;
  }
  _mm512_storeu_ps(corr, exp_ps(_mm512_load_ps(shift)));  // corr has room for 16
  for (int r = 0; r < R; ++r) {
    if (shift[r] == -INFINITY) corr[r] = 0.0f;
    if (mask[r][0] == 0) {
      std::memset(p[r], 0, 64);
      continue;
    }
    const __m512 mn = _mm512_set1_ps(m[r]);
    const __m512 ea = _mm512_maskz_mov_ps(mask[r][0], exp_probability(_mm512_sub_ps(s[r][0], mn)));
    const __m512 eb = _mm512_maskz_mov_ps(mask[r][1], exp_probability(_mm512_sub_ps(s[r][1], mn)));
    l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(ea, eb));
    // Tokens 0..15 then 16..31: dword tp holds the pair (2 tp, 2 tp + 1), as vp.
    _mm512_storeu_si512(p[r], (__m512i)_mm512_cvtne2ps_pbh(eb, ea));
  }
}

// o[r] = o[r] * corr[r] + sum over the chunk's tokens of p[r][t] V[t], R q-rows at once.
template <int R, int DV>
PDSERVE_VL_TARGET void chunk_values(const PrefillChunk& c, const uint32_t (*p)[16],
                                    const float* corr, float* const* o) {
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int v = 0; v < DV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o[r] + 16 * v), cr);
  }
  for (int tp = 0; tp < 16; ++tp) {
    __m512bh vv[DV];  // loaded once for the R rows
    for (int v = 0; v < DV; ++v) vv[v] = (__m512bh)_mm512_load_si512(&c.vp[tp][v]);
    for (int r = 0; r < R; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(int32_t(p[r][tp]));
      for (int v = 0; v < DV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pb, vv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(o[r] + 16 * v, acc[r][v]);
}

// R q-rows through one chunk (R <= kQkRows), their P V in sub-blocks of PV rows.
template <int R, int DV>
PDSERVE_VL_TARGET void chunk_rows(const uint16_t* const* q, const int64_t* pos, int64_t t0,
                                  float scale, const PrefillChunk& c, float* m, float* l,
                                  float* const* o) {
  constexpr int PV = DV <= 4 ? 4 : 2;  // accumulators: PV x DV = 16 chains
  alignas(64) uint32_t p[R][16];
  alignas(64) float corr[16];
  chunk_scores<R, DV>(q, pos, t0, scale, c, m, l, corr, p);
  int r = 0;
  for (; r + PV <= R; r += PV) chunk_values<PV, DV>(c, p + r, corr + r, o + r);
  for (; r < R; ++r) chunk_values<1, DV>(c, p + r, corr + r, o + r);
}

// A worker's arrays for one task at a time, kept across its tasks: per q-row, its output
// sums (D floats), running max and sum, its q row, output row and position.
struct PrefillScratch {
  std::vector<float> sums;
  std::vector<const uint16_t*> q;
  std::vector<float*> o;
  std::vector<int64_t> pos;
};

struct PrefillTask {
  int32_t seq, kv_head;
  int64_t row0, rows;  // query rows [row0, row0 + rows) of the step (q's first dimension)
  int64_t pos0;        // the position of row0
  int64_t cost;        // ~ rows x the tokens they see: the order tasks are taken in
};

// One task: G heads x ``task.rows`` positions, through chunks up to the last position.
template <int DV>
PDSERVE_VL_TARGET void prefill_task(const PrefillTask& task, const uint16_t* q, int64_t h,
                                    int64_t g, const uint16_t* kbase, const uint16_t* vbase,
                                    int64_t block_stride, int64_t head_stride,
                                    const int32_t* table, int64_t bs, float scale, uint16_t* out,
                                    PrefillChunk& c, PrefillScratch& scratch) {
  constexpr int64_t D = DV * 16;
  const int64_t n = task.rows * g;  // q-rows, position-major: (row i, head j) -> i g + j
  scratch.sums.resize(size_t(n * (D + 2)));
  scratch.q.resize(size_t(n));
  scratch.o.resize(size_t(n));
  scratch.pos.resize(size_t(n));
  float* o = scratch.sums.data();
  float* m = o + n * D;
  float* l = m + n;
  const uint16_t** qr = scratch.q.data();
  float** orow = scratch.o.data();
  int64_t* pos = scratch.pos.data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = task.row0 + i / g, head = task.kv_head * g + i % g;
    qr[i] = q + (row * h + head) * D;
    orow[i] = o + i * D;
    pos[i] = task.pos0 + i / g;
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  std::fill(o, o + n * D, 0.0f);
  const int64_t last = task.pos0 + task.rows - 1;
  const __m512i idx = pair_index();
  const uint16_t* k_head0 = kbase + task.kv_head * head_stride;
  const uint16_t* v_head0 = vbase + task.kv_head * head_stride;
  for (int64_t t0 = 0; t0 <= last; t0 += 32) {
    pack_chunk<DV>(k_head0, v_head0, block_stride, table, bs, t0, last, idx, c);
    // q-rows before this chunk's first token see none of it: start at the first that does.
    int64_t i = std::max<int64_t>(0, (t0 - task.pos0) * g);
    for (; i + kQkRows <= n; i += kQkRows)
      chunk_rows<kQkRows, DV>(qr + i, pos + i, t0, scale, c, m + i, l + i, orow + i);
    for (; i < n; ++i) chunk_rows<1, DV>(qr + i, pos + i, t0, scale, c, m + i, l + i, orow + i);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = task.row0 + i / g, head = task.kv_head * g + i % g;
    const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
    for (int v = 0; v < DV; ++v)
      store_ps(out + (row * h + head) * D + 16 * v, true,
               _mm512_mul_ps(_mm512_loadu_ps(o + i * D + 16 * v), inv));
  }
}

}  // namespace

// q: (T, H, D) bfloat16, contiguous; key_cache / value_cache: one layer's bfloat16
// (num_blocks, KVH, block_size, D) views (rope_store's); q_starts: int32 (B + 1,), sequence
// b's query rows [q_starts[b], q_starts[b + 1]) are the last of its seq_lens[b] tokens;
// block_tables: int32 (B, W). -> (T, H, D) bfloat16.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& q_starts,
                             const at::Tensor& seq_lens, const at::Tensor& block_tables,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16,
              "prefill_attention: q must be contiguous bfloat16 (T, H, D)");
  check_kv_views("prefill_attention", key_cache, value_cache, q.size(2));
  TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: K and V must be bfloat16");
  const int64_t t_rows = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t kvh = key_cache.size(1), bs = key_cache.size(2), nb = key_cache.size(0);
  TORCH_CHECK(bs % 16 == 0 && kvh > 0 && h % kvh == 0 && h / kvh <= 8,
              "prefill_attention: block size ", bs, ", heads ", h, " over ", kvh);
  TORCH_CHECK(d == 64 || d == 128, "prefill_attention: head size ", d, " is not built");
  const int64_t b_rows = seq_lens.numel(), width = block_tables.size(1), g = h / kvh;
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous(),
              "prefill_attention: seq_lens must be int32 (B,)");
  TORCH_CHECK(q_starts.scalar_type() == at::kInt && q_starts.numel() == b_rows + 1 &&
                  q_starts.is_contiguous(),
              "prefill_attention: q_starts must be int32 (B + 1,)");
  check_block_tables("prefill_attention", block_tables, b_rows);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[b_rows] == t_rows,
              "prefill_attention: q_starts must run from 0 to the ", t_rows, " rows");
  std::vector<PrefillTask> tasks;
  for (int64_t b = 0; b < b_rows; ++b) {
    const int64_t rows = starts[b + 1] - starts[b], n = lens[b];
    TORCH_CHECK(rows >= 0 && rows <= n && n <= width * bs, "prefill_attention: sequence ", b,
                " has ", rows, " query rows, ", n, " tokens, ", width, " blocks");
    check_blocks("prefill_attention: sequence ", b, tables + b * width, (n + bs - 1) / bs, nb);
    for (int64_t r = 0; r < rows; r += kPrefillRows) {
      const int64_t take = std::min<int64_t>(kPrefillRows, rows - r), pos0 = n - rows + r;
      for (int64_t kh = 0; kh < kvh; ++kh)
        tasks.push_back({int32_t(b), int32_t(kh), starts[b] + r, take, pos0,
                         take * (pos0 + take)});
    }
  }
  // Costliest first, taken one at a time: a causal prompt's last rows see the most tokens.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PrefillTask& a, const PrefillTask& b) { return a.cost > b.cost; });
  at::Tensor out = at::empty_like(q);
  if (tasks.empty()) return out;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kbase = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  const auto* vbase = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_stride = key_cache.stride(0), head_stride = key_cache.stride(1);
  const int64_t n_tasks = int64_t(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto* c = static_cast<PrefillChunk*>(std::aligned_alloc(64, sizeof(PrefillChunk)));
    PrefillScratch scratch;
    for (int64_t i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1)) {
      const PrefillTask& task = tasks[size_t(i)];
      const int32_t* table = tables + int64_t(task.seq) * width;
      if (d == 64)
        prefill_task<4>(task, qp, h, g, kbase, vbase, block_stride, head_stride, table, bs,
                        float(scale), op, *c, scratch);
      else
        prefill_task<8>(task, qp, h, g, kbase, vbase, block_stride, head_stride, table, bs,
                        float(scale), op, *c, scratch);
    }
    std::free(c);
  });
  return out;
}

}  // namespace pdserve
