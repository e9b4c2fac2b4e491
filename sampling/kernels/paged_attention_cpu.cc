// Decode paged attention for XLA:CPU, called through the XLA FFI (see sampling/cpu_attention.py).
//
// One query token per sequence against its cached tokens, read straight from the page pool:
//   q        f32[B, N, H]
//   k, v     f32[L, K, P, page_size, H]  (the engine's stacked pool; attribute `layer` picks L)
//   lengths  s32[B]                      tokens to attend to per sequence (0: output zeros)
//   table    s32[B, pages_per_seq]       token t of sequence b is in page table[b, t / page_size]
//   out      f32[B, N, H]
// Scores are scaled by H^-0.5 and the softmax runs in f32, as in models.attention.dense_attention.
//
// Nothing is gathered: each (sequence, kv head) walks its pages in place, computes the scores of
// its N / K query heads, then accumulates the values. Sequences are split over the XLA CPU
// thread pool in contiguous ranges, so the G samples of a prompt, which sit in neighbouring
// slots and share the prompt's pages, find those pages in cache.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shapes {
  int64_t b, n, h, kh, pages, page_size, pages_per_seq, layer;
};

// A page index from the table, clamped into the pool (as XLA clamps gather indices), so that a
// bad table reads wrong pages instead of crashing the process.
inline int64_t Page(int32_t page, int64_t pages) {
  return std::min<int64_t>(std::max<int32_t>(page, 0), pages - 1);
}

// All kv heads of sequence b; HD is the head size H when known at compile time (0: runtime).
// `buf` is per-thread scratch.
template <int64_t HD>
void AttendSequence(const Shapes& s, const float* __restrict__ q, const float* __restrict__ k,
                    const float* __restrict__ v, const int32_t* lengths, const int32_t* table,
                    float* __restrict__ out, int64_t b, std::vector<float>& buf) {
  const int64_t h = HD ? HD : s.h;
  const int64_t r = s.n / s.kh, ps = s.page_size;
  const int64_t t_len = std::min<int64_t>(lengths[b], s.pages_per_seq * ps);
  const int64_t t_pad = (t_len + ps - 1) / ps * ps;
  const float scale = 1.0f / std::sqrt(static_cast<float>(h));
  const int32_t* row = table + b * s.pages_per_seq;
  buf.resize(r * t_pad + r * h);
  float* __restrict__ scores = buf.data();  // [R, t_pad]
  float* __restrict__ qs = scores + r * t_pad;  // scaled queries [R, H]
  for (int64_t kv = 0; kv < s.kh; ++kv) {
    const float* qk = q + (b * s.n + kv * r) * h;  // the R query heads of this kv head
    float* __restrict__ o = out + (b * s.n + kv * r) * h;
    for (int64_t i = 0; i < r * h; ++i) o[i] = 0.0f;
    if (t_len <= 0) continue;
    for (int64_t i = 0; i < r * h; ++i) qs[i] = qk[i] * scale;
    const int64_t head = (s.layer * s.kh + kv) * s.pages;  // first page of this (layer, head)
    // Scores [R, T]: one dot product over H per (query head, token).
    for (int64_t t0 = 0; t0 < t_len; t0 += ps) {
      const float* __restrict__ kp = k + (head + Page(row[t0 / ps], s.pages)) * ps * h;
      const int64_t n_tok = std::min(ps, t_len - t0);
      for (int64_t j = 0; j < n_tok; ++j) {
        const float* __restrict__ kj = kp + j * h;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        // Four query heads at a time: the key is loaded once and the four sums are reduced
        // together (three hadds) instead of one horizontal reduction per head.
        if constexpr (HD % 8 == 0 && HD > 0) {
          for (; i + 4 <= r; i += 4) {
            const float* __restrict__ q0 = qs + i * HD;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < HD; d += 8) {
              const __m256 kd = _mm256_loadu_ps(kj + d);
              a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kd, a0);
              a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + HD + d), kd, a1);
              a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * HD + d), kd, a2);
              a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * HD + d), kd, a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            alignas(16) float four[4];
            _mm_store_ps(four, sum);
            for (int64_t u = 0; u < 4; ++u) scores[(i + u) * t_pad + t0 + j] = four[u];
          }
        }
#endif
        for (; i < r; ++i) {
          const float* __restrict__ qi = qs + i * h;
          float acc = 0.0f;
          for (int64_t d = 0; d < h; ++d) acc += qi[d] * kj[d];
          scores[i * t_pad + t0 + j] = acc;
        }
      }
    }
    // Softmax per query head over the t_len valid scores.
    for (int64_t i = 0; i < r; ++i) {
      float* __restrict__ si = scores + i * t_pad;
      float m = si[0];
      for (int64_t t = 1; t < t_len; ++t) m = std::max(m, si[t]);
      float sum = 0.0f;
      for (int64_t t = 0; t < t_len; ++t) {
        si[t] = std::exp(si[t] - m);
        sum += si[t];
      }
      const float inv = 1.0f / sum;
      for (int64_t t = 0; t < t_len; ++t) si[t] *= inv;
    }
    // Weighted sum of values, one query head at a time so its output row stays in registers.
    for (int64_t i = 0; i < r; ++i) {
      const float* __restrict__ si = scores + i * t_pad;
      float* __restrict__ oi = o + i * h;
      for (int64_t t0 = 0; t0 < t_len; t0 += ps) {
        const float* __restrict__ vp = v + (head + Page(row[t0 / ps], s.pages)) * ps * h;
        const int64_t n_tok = std::min(ps, t_len - t0);
        for (int64_t j = 0; j < n_tok; ++j) {
          const float p = si[t0 + j];
          const float* __restrict__ vt = vp + j * h;
          for (int64_t d = 0; d < h; ++d) oi[d] += p * vt[d];
        }
      }
    }
  }
}

// Work shared by the caller and the pool tasks: sequences are handed out in chunks from an
// atomic counter. The caller waits only for chunks that have started, never for a task still
// queued, so a busy pool cannot deadlock the call; late tasks find nothing left and return.
struct Work {
  Shapes s;
  const float *q, *k, *v;
  const int32_t *lengths, *table;
  float* out;
  int64_t chunk;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    std::vector<float> buf;
    for (;;) {
      const int64_t b0 = next.fetch_add(chunk);
      if (b0 >= s.b) return;
      const int64_t b1 = std::min(s.b, b0 + chunk);
      for (int64_t b = b0; b < b1; ++b) {
        switch (s.h) {  // compile-time head sizes unroll and vectorise the inner loops
          case 32: AttendSequence<32>(s, q, k, v, lengths, table, out, b, buf); break;
          case 64: AttendSequence<64>(s, q, k, v, lengths, table, out, b, buf); break;
          case 128: AttendSequence<128>(s, q, k, v, lengths, table, out, b, buf); break;
          default: AttendSequence<0>(s, q, k, v, lengths, table, out, b, buf);
        }
      }
      done.fetch_add(b1 - b0);
    }
  }
};

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                              ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> table,
                              ffi::ResultBuffer<ffi::F32> out, int64_t layer) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: need q [B,N,H], pages [L,K,P,ps,H]");
  }
  auto work = std::make_shared<Work>();
  work->s = Shapes{qd[0], qd[1], qd[2], kd[1], kd[2], kd[3], td[1], layer};
  if (kd[4] != qd[2] || qd[1] % kd[1] != 0 || layer < 0 || layer >= kd[0]) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: inconsistent shapes or layer");
  }
  work->q = q.typed_data();
  work->k = k.typed_data();
  work->v = v.typed_data();
  work->lengths = lengths.typed_data();
  work->table = table.typed_data();
  work->out = out->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->chunk = std::max<int64_t>(1, work->s.b / (4 * threads));
  for (int64_t i = 1; i < threads; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load() < work->s.b) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer"));
