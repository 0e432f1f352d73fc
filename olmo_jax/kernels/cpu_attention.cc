// Causal grouped-query attention on a CPU, forward and backward, as XLA FFI handlers:
// flash attention's math in query blocks of `block` rows (an attribute), each block's scores one SGEMM
// through numpy's OpenBLAS (cpu_blas.h) into a per-thread [kBlock, T] buffer, never a
// [T, T] matrix in memory. Built by olmo_jax/kernels/cpu_ffi.py on first use.
//
// Layout: q [B, T, N, H], k and v [B, T, K, H] (the projections' own layout: each head's
// rows are read in place with leading dimension N*H or K*H, no transposes); query head n
// attends with kv head n / (N / K). Query block [r0, r1) attends keys [0, r1): the blocks
// above the diagonal are skipped, the diagonal block is masked.
//   forward:  s = q k^T / sqrt(H); p = softmax(s) over the keys up to the query's own
//             position; o = p v; lse = logsumexp(s) per query, [B, N, T], saved.
//   backward: p recomputed from q, k and lse; dv = p^T do; dp = do v^T;
//             ds = p (dp - rowsum(do o)) / sqrt(H); dq = ds k; dk = ds^T q
//             (dk and dv summed over the N / K query heads of their kv head).
// float32 only. Items: (batch, query head) forward, (batch, kv head) backward (each owns
// the rows of its outputs), spread over XLA's intra-op thread pool.
//
// Document masking and sliding windows (the *_doc handlers): an int32 [B, T] input `start`,
// the first key each query may attend (its document's start, or its window's, whichever
// is later; non-decreasing along a row). Query i attends keys
// [start[i], i]; block [r0, r1) multiplies against keys [start[r0], r1) only, so the
// blocks before the first document of the block are skipped as those above the diagonal
// are. Without it start is 0 everywhere and the arithmetic is the causal handlers'.

#include <cmath>

#include "cpu_blas.h"
#include "cpu_rms.h"

namespace ffi = xla::ffi;
using namespace olmo_cpu;

namespace {


struct Dims {
  int64_t B, T, N, K, H;
  int64_t G() const { return N / K; }
  int64_t qs() const { return N * H; }  // row strides
  int64_t ks() const { return K * H; }
};

ffi::Error check(const Dims& d, ffi::Span<const int64_t> k_dims) {
  if (k_dims.size() != 4 || k_dims[0] != d.B || k_dims[1] != d.T || k_dims[3] != d.H ||
      d.K == 0 || d.N % d.K != 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "cpu_attention: q must be [B, T, N, H], k and v [B, T, K, H], N % K == 0");
  return ffi::Error::Success();
}

ffi::Error check_start(const Dims& d, const int32_t* start, ffi::Span<const int64_t> dims) {
  if (start && (dims.size() != 2 || dims[0] != d.B || dims[1] != d.T))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "cpu_attention: the document starts must be [B, T] int32");
  return ffi::Error::Success();
}

// The first key of query t in row b (0 without document masking).
inline int64_t first_key(const int32_t* start, const Dims& d, int64_t b, int64_t t) {
  return start ? start[b * d.T + t] : 0;
}

ffi::Error Fwd(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
               ffi::Buffer<ffi::F32>& v, const int32_t* start,
               ffi::Span<const int64_t> start_dims, ffi::ResultBuffer<ffi::F32>& o,
               ffi::ResultBuffer<ffi::F32>& lse, int64_t kBlock) {
  if (!g_sgemm) return no_blas("cpu_attention");
  const auto qd = q.dimensions();
  const Dims d{qd[0], qd[1], qd[2], k.dimensions()[2], qd[3]};
  if (auto err = check(d, k.dimensions()); err.failure()) return err;
  if (auto err = check_start(d, start, start_dims); err.failure()) return err;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.H));
  const float *q_p = q.typed_data(), *k_p = k.typed_data(), *v_p = v.typed_data();
  float *o_p = o->typed_data(), *lse_p = lse->typed_data();
  parallel_range(pool, d.B * d.N, [&](int64_t item) {
    const int64_t b = item / d.N, n = item % d.N, kv = n / d.G();
    const float* q_bn = q_p + b * d.T * d.qs() + n * d.H;
    const float* k_b = k_p + b * d.T * d.ks() + kv * d.H;
    const float* v_b = v_p + b * d.T * d.ks() + kv * d.H;
    float* o_bn = o_p + b * d.T * d.qs() + n * d.H;
    float* lse_bn = lse_p + (b * d.N + n) * d.T;
    thread_local std::vector<float> s, inv;
    s.resize(kBlock * d.T);
    inv.resize(kBlock);
    for (int64_t r0 = 0; r0 < d.T; r0 += kBlock) {
      // keys [lo, r1): lo the block's first query's document start (0 when causal only)
      const int64_t r1 = std::min(d.T, r0 + kBlock), m = r1 - r0, lo = first_key(start, d, b, r0),
                    A = r1 - lo;
      gemm(false, true, m, A, d.H, q_bn + r0 * d.qs(), d.qs(), k_b + lo * d.ks(), d.ks(), 0.0f,
           s.data(), A);
      for (int64_t i = 0; i < m; ++i) {
        float* s_i = s.data() + i * A;
        const int64_t first = first_key(start, d, b, r0 + i) - lo;
        const int64_t valid = r0 + i + 1 - lo;  // keys first .. its own position
        float mx = s_i[first];
#pragma omp simd reduction(max : mx)
        for (int64_t j = first; j < valid; ++j) mx = std::max(mx, s_i[j]);
        const float shift = mx * scale;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = first; j < valid; ++j) {
          const float e = std::exp(s_i[j] * scale - shift);
          s_i[j] = e;
          sum += e;
        }
        std::fill(s_i, s_i + first, 0.0f);
        std::fill(s_i + valid, s_i + A, 0.0f);
        inv[i] = 1.0f / sum;
        lse_bn[r0 + i] = shift + std::log(sum);
      }
      // o = (exp(s - max) v) / sum: the normalization on the [m, H] output, not the scores
      float* o_blk = o_bn + r0 * d.qs();
      gemm(false, false, m, d.H, A, s.data(), A, v_b + lo * d.ks(), d.ks(), 0.0f, o_blk, d.qs());
      for (int64_t i = 0; i < m; ++i) {
        float* o_i = o_blk + i * d.qs();
        const float r = inv[i];
#pragma omp simd
        for (int64_t h = 0; h < d.H; ++h) o_i[h] *= r;
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error AttentionFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> o,
                        ffi::ResultBuffer<ffi::F32> lse, int64_t kBlock) {
  return Fwd(pool, q, k, v, nullptr, {}, o, lse, kBlock);
}

ffi::Error AttentionDocFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<ffi::F32> o,
                           ffi::ResultBuffer<ffi::F32> lse, int64_t kBlock) {
  return Fwd(pool, q, k, v, start.typed_data(), start.dimensions(), o, lse, kBlock);
}

ffi::Error Bwd(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
               ffi::Buffer<ffi::F32>& v, const int32_t* start,
               ffi::Span<const int64_t> start_dims, ffi::Buffer<ffi::F32>& o,
               ffi::Buffer<ffi::F32>& lse, ffi::Buffer<ffi::F32>& dout,
               ffi::ResultBuffer<ffi::F32>& dq, ffi::ResultBuffer<ffi::F32>& dk,
               ffi::ResultBuffer<ffi::F32>& dv, int64_t kBlock) {
  if (!g_sgemm) return no_blas("cpu_attention");
  const auto qd = q.dimensions();
  const Dims d{qd[0], qd[1], qd[2], k.dimensions()[2], qd[3]};
  if (auto err = check(d, k.dimensions()); err.failure()) return err;
  if (auto err = check_start(d, start, start_dims); err.failure()) return err;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.H));
  const float *q_p = q.typed_data(), *k_p = k.typed_data(), *v_p = v.typed_data(),
              *o_p = o.typed_data(), *lse_p = lse.typed_data(), *do_p = dout.typed_data();
  float *dq_p = dq->typed_data(), *dk_p = dk->typed_data(), *dv_p = dv->typed_data();
  parallel_range(pool, d.B * d.K, [&](int64_t item) {
    const int64_t b = item / d.K, kv = item % d.K;
    const int64_t kv_off = b * d.T * d.ks() + kv * d.H;
    const float *k_b = k_p + kv_off, *v_b = v_p + kv_off;
    float *dk_b = dk_p + kv_off, *dv_b = dv_p + kv_off;
    for (int64_t t = 0; t < d.T; ++t) {
      std::memset(dk_b + t * d.ks(), 0, d.H * sizeof(float));
      std::memset(dv_b + t * d.ks(), 0, d.H * sizeof(float));
    }
    thread_local std::vector<float> scratch;
    scratch.resize(2 * kBlock * d.T + kBlock);
    float *p = scratch.data(), *dp = p + kBlock * d.T, *delta = dp + kBlock * d.T;
    for (int64_t g = 0; g < d.G(); ++g) {
      const int64_t n = kv * d.G() + g, q_off = b * d.T * d.qs() + n * d.H;
      const float *q_bn = q_p + q_off, *o_bn = o_p + q_off, *do_bn = do_p + q_off;
      float* dq_bn = dq_p + q_off;
      const float* lse_bn = lse_p + (b * d.N + n) * d.T;
      for (int64_t r0 = 0; r0 < d.T; r0 += kBlock) {
        const int64_t r1 = std::min(d.T, r0 + kBlock), m = r1 - r0,
                      lo = first_key(start, d, b, r0), A = r1 - lo;
        const float *q_blk = q_bn + r0 * d.qs(), *do_blk = do_bn + r0 * d.qs();
        const float *k_lo = k_b + lo * d.ks(), *v_lo = v_b + lo * d.ks();
        float *dk_lo = dk_b + lo * d.ks(), *dv_lo = dv_b + lo * d.ks();
        gemm(false, true, m, A, d.H, q_blk, d.qs(), k_lo, d.ks(), 0.0f, p, A);
        for (int64_t i = 0; i < m; ++i) {
          float* p_i = p + i * A;
          const int64_t first = first_key(start, d, b, r0 + i) - lo, valid = r0 + i + 1 - lo;
          const float l = lse_bn[r0 + i];
          for (int64_t j = 0; j < first; ++j) p_i[j] = 0.0f;
#pragma omp simd
          for (int64_t j = first; j < valid; ++j) p_i[j] = std::exp(p_i[j] * scale - l);
          for (int64_t j = valid; j < A; ++j) p_i[j] = 0.0f;
          const float *o_i = o_bn + (r0 + i) * d.qs(), *do_i = do_blk + i * d.qs();
          float dl = 0.0f;
#pragma omp simd reduction(+ : dl)
          for (int64_t h = 0; h < d.H; ++h) dl += o_i[h] * do_i[h];
          delta[i] = dl;
        }
        gemm(true, false, A, d.H, m, p, A, do_blk, d.qs(), 1.0f, dv_lo, d.ks());  // dv += p^T do
        gemm(false, true, m, A, d.H, do_blk, d.qs(), v_lo, d.ks(), 0.0f, dp, A);  // dp = do v^T
        for (int64_t i = 0; i < m; ++i) {
          float *p_i = p + i * A, *dp_i = dp + i * A;
          const float dl = delta[i];
#pragma omp simd
          for (int64_t j = 0; j < A; ++j) p_i[j] = p_i[j] * (dp_i[j] - dl) * scale;  // ds
        }
        gemm(false, false, m, d.H, A, p, A, k_lo, d.ks(), 0.0f, dq_bn + r0 * d.qs(), d.qs());
        gemm(true, false, A, d.H, m, p, A, q_blk, d.qs(), 1.0f, dk_lo, d.ks());  // dk += ds^T q
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error AttentionBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o,
                        ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                        ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv, int64_t kBlock) {
  return Bwd(pool, q, k, v, nullptr, {}, o, lse, dout, dq, dk, dv, kBlock);
}

ffi::Error AttentionDocBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::F32> o,
                           ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                           ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                           ffi::ResultBuffer<ffi::F32> dv, int64_t kBlock) {
  return Bwd(pool, q, k, v, start.typed_data(), start.dimensions(), o, lse, dout, dq, dk, dv,
             kBlock);
}

// ---- QK-norm, clipping and RoPE: the projections' [B, T, (N + 2K) H] output to q, k, v ----
//
// Per row (token t = row % T): q = rope(clip(norm(x_q))), k = rope(clip(norm(x_k))),
// v = clip(x_v). norm (RMSNorm in float32): 0 none, 1 each head over its H (one [H]
// weight), 2 all heads of q (of k) together ([N H] / [K H] weights). clip: 0 none, else
// clamp to [-clip, clip] after the norm (Hugging Face OLMoE's order). RoPE: "rotate half"
// with the cos / sin tables, [T, H] (row r uses table row r % T) or per batch row [B, T, H]
// (row r uses table row r). The backward recomputes the forward from the input row.

struct Prep {
  int64_t N, K, H, norm;
  float eps, clip;
  int64_t J() const { return (N + 2 * K) * H; }
  int64_t seg(int64_t L) const { return norm == 1 ? H : L; }  // one norm's span
};

// y[0, L) = clip(norm(x)); xhat (the normalized x) and rstd per segment kept for the
// backward when asked for.
void norm_clip(const Prep& p, const float* x, int64_t L, const float* w, float* y, float* xhat,
               float* rstd) {
  const int64_t S = p.seg(L);
  if (p.norm) {
    for (int64_t s0 = 0; s0 < L; s0 += S) {
      const float r = rms_span(x + s0, S, w, p.eps, y + s0, xhat ? xhat + s0 : nullptr);
      if (rstd) rstd[s0 / S] = r;
    }
  } else {
    std::memcpy(y, x, L * sizeof(float));
  }
  if (p.clip > 0.0f)
    for (int64_t j = 0; j < L; ++j) y[j] = std::min(std::max(y[j], -p.clip), p.clip);
}

// out = y cos + rotate_half(y) sin, head by head.
void rope(const float* y, int64_t L, int64_t H, const float* cos_t, const float* sin_t,
          float* out) {
  const int64_t h2 = H / 2;
  for (int64_t n0 = 0; n0 < L; n0 += H) {
    const float* yn = y + n0;
    float* on = out + n0;
    for (int64_t h = 0; h < h2; ++h) on[h] = yn[h] * cos_t[h] - yn[h + h2] * sin_t[h];
    for (int64_t h = h2; h < H; ++h) on[h] = yn[h] * cos_t[h] + yn[h - h2] * sin_t[h];
  }
}

// The transpose of `rope`: dy from d out.
void rope_t(const float* g, int64_t L, int64_t H, const float* cos_t, const float* sin_t,
            float* dy) {
  const int64_t h2 = H / 2;
  for (int64_t n0 = 0; n0 < L; n0 += H) {
    const float* gn = g + n0;
    float* dn = dy + n0;
    for (int64_t h = 0; h < h2; ++h) dn[h] = gn[h] * cos_t[h] + gn[h + h2] * sin_t[h + h2];
    for (int64_t h = h2; h < H; ++h) dn[h] = gn[h] * cos_t[h] - gn[h - h2] * sin_t[h - h2];
  }
}

// dx (and += dw) of y = clip(norm(x)) from dy (overwritten).
void norm_clip_t(const Prep& p, const float* x, int64_t L, const float* w, float* dy, float* dx,
                 float* dw, float* scratch) {
  float *xhat = scratch, *y = scratch + L, *rstd = scratch + 2 * L;
  norm_clip(p, x, L, w, y, xhat, rstd);
  if (p.clip > 0.0f)
    for (int64_t j = 0; j < L; ++j)
      if (!(y[j] > -p.clip && y[j] < p.clip)) dy[j] = 0.0f;
  if (!p.norm) {
    std::memcpy(dx, dy, L * sizeof(float));
    return;
  }
  const int64_t S = p.seg(L);
  for (int64_t s0 = 0; s0 < L; s0 += S)
    rms_span_t(xhat + s0, rstd[s0 / S], S, w, dy + s0, dx + s0, dw);
}

// The rows of the cos / sin tables: T for [T, H], R = B * T for [B, T, H].
int64_t table_rows(ffi::Span<const int64_t> cos_dims) {
  return cos_dims.size() == 2 ? cos_dims[0] : cos_dims[0] * cos_dims[1];
}

ffi::Error check_prep(const Prep& p, int64_t J, int64_t T, int64_t R, int64_t wq, int64_t wk,
                      ffi::Span<const int64_t> cos_dims) {
  const int64_t nd = cos_dims.size();
  const bool tables = (nd == 2 && cos_dims[0] == T) ||
                      (nd == 3 && cos_dims[1] == T && cos_dims[0] * T == R);
  const bool ok = J == p.J() && p.H % 2 == 0 && tables && cos_dims[nd - 1] == p.H &&
                  (p.norm == 0 || (wq == p.seg(p.N * p.H) && wk == p.seg(p.K * p.H)));
  if (!ok)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "cpu_attention prep: qkv must be [B, T, (N + 2K) H], cos / sin [T, H] "
                      "or [B, T, H] (H even), the norm weights [H] (norm 1) or [N H] and [K H] (norm 2)");
  return ffi::Error::Success();
}

ffi::Error PrepFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> qw,
                   ffi::Buffer<ffi::F32> kw, ffi::Buffer<ffi::F32> cos,
                   ffi::Buffer<ffi::F32> sin, ffi::ResultBuffer<ffi::F32> q,
                   ffi::ResultBuffer<ffi::F32> k, ffi::ResultBuffer<ffi::F32> v,
                   int64_t n_heads, int64_t kv_heads, int64_t norm, float eps, float clip) {
  const auto xd = qkv.dimensions();
  const int64_t T = xd[xd.size() - 2], J = xd[xd.size() - 1], R = qkv.element_count() / J;
  const Prep p{n_heads, kv_heads, cos.dimensions()[cos.dimensions().size() - 1], norm, eps, clip};
  if (auto err = check_prep(p, J, T, R, qw.element_count(), kw.element_count(), cos.dimensions());
      err.failure())
    return err;
  const int64_t TR = table_rows(cos.dimensions());
  const int64_t LQ = p.N * p.H, LK = p.K * p.H;
  const float *x_p = qkv.typed_data(), *qw_p = qw.typed_data(), *kw_p = kw.typed_data(),
              *cos_p = cos.typed_data(), *sin_p = sin.typed_data();
  float *q_p = q->typed_data(), *k_p = k->typed_data(), *v_p = v->typed_data();
  parallel_rows(pool, R, 0, nullptr, [&](int64_t r0, int64_t r1, float*) {
    thread_local std::vector<float> y;
    y.resize(LQ);
    for (int64_t r = r0; r < r1; ++r) {
      const float *x = x_p + r * J, *c = cos_p + (r % TR) * p.H, *s = sin_p + (r % TR) * p.H;
      norm_clip(p, x, LQ, qw_p, y.data(), nullptr, nullptr);
      rope(y.data(), LQ, p.H, c, s, q_p + r * LQ);
      norm_clip(p, x + LQ, LK, kw_p, y.data(), nullptr, nullptr);
      rope(y.data(), LK, p.H, c, s, k_p + r * LK);
      float* v_r = v_p + r * LK;
      const float* xv = x + LQ + LK;
      if (p.clip > 0.0f)
        for (int64_t j = 0; j < LK; ++j) v_r[j] = std::min(std::max(xv[j], -p.clip), p.clip);
      else
        std::memcpy(v_r, xv, LK * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

ffi::Error PrepBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> qw,
                   ffi::Buffer<ffi::F32> kw, ffi::Buffer<ffi::F32> cos,
                   ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::F32> dq,
                   ffi::Buffer<ffi::F32> dk, ffi::Buffer<ffi::F32> dv,
                   ffi::ResultBuffer<ffi::F32> dqkv, ffi::ResultBuffer<ffi::F32> dqw,
                   ffi::ResultBuffer<ffi::F32> dkw, int64_t n_heads, int64_t kv_heads,
                   int64_t norm, float eps, float clip) {
  const auto xd = qkv.dimensions();
  const int64_t T = xd[xd.size() - 2], J = xd[xd.size() - 1], R = qkv.element_count() / J;
  const Prep p{n_heads, kv_heads, cos.dimensions()[cos.dimensions().size() - 1], norm, eps, clip};
  const int64_t WQ = qw.element_count(), WK = kw.element_count();
  if (auto err = check_prep(p, J, T, R, WQ, WK, cos.dimensions()); err.failure()) return err;
  const int64_t TR = table_rows(cos.dimensions());
  const int64_t LQ = p.N * p.H, LK = p.K * p.H;
  const float *x_p = qkv.typed_data(), *qw_p = qw.typed_data(), *kw_p = kw.typed_data(),
              *cos_p = cos.typed_data(), *sin_p = sin.typed_data(), *dq_p = dq.typed_data(),
              *dk_p = dk.typed_data(), *dv_p = dv.typed_data();
  float* dx_p = dqkv->typed_data();
  std::vector<float> dw(WQ + WK);  // [d q_norm | d k_norm], zero without a norm
  parallel_rows(pool, R, WQ + WK, dw.data(), [&](int64_t r0, int64_t r1, float* dw_sums) {
    thread_local std::vector<float> buf;
    buf.resize(4 * LQ + 1);
    float *g = buf.data(), *scratch = g + LQ;
    for (int64_t r = r0; r < r1; ++r) {
      const float *x = x_p + r * J, *c = cos_p + (r % TR) * p.H, *s = sin_p + (r % TR) * p.H;
      float* dx = dx_p + r * J;
      rope_t(dq_p + r * LQ, LQ, p.H, c, s, g);
      norm_clip_t(p, x, LQ, qw_p, g, dx, dw_sums, scratch);
      rope_t(dk_p + r * LK, LK, p.H, c, s, g);
      norm_clip_t(p, x + LQ, LK, kw_p, g, dx + LQ, dw_sums + WQ, scratch);
      const float *xv = x + LQ + LK, *dv_r = dv_p + r * LK;
      float* dxv = dx + LQ + LK;
      for (int64_t j = 0; j < LK; ++j)
        dxv[j] = (p.clip > 0.0f && !(xv[j] > -p.clip && xv[j] < p.clip)) ? 0.0f : dv_r[j];
    }
  });
  std::copy(dw.begin(), dw.begin() + WQ, dqw->typed_data());
  std::copy(dw.begin() + WQ, dw.end(), dkw->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuAttentionFwd, AttentionFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_BTNH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_BTKH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_BTKH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o_BTNH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse_BNT
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuAttentionBwd, AttentionBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_BTNH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_BTKH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_BTKH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // o_BTNH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lse_BNT
                                  .Arg<ffi::Buffer<ffi::F32>>()   // do_BTNH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dq_BTNH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dk_BTKH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dv_BTKH
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuAttentionDocFwd, AttentionDocFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_BTNH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_BTKH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_BTKH
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start_BT
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o_BTNH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse_BNT
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuAttentionDocBwd, AttentionDocBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_BTNH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_BTKH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_BTKH
                                  .Arg<ffi::Buffer<ffi::S32>>()   // start_BT
                                  .Arg<ffi::Buffer<ffi::F32>>()   // o_BTNH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lse_BNT
                                  .Arg<ffi::Buffer<ffi::F32>>()   // do_BTNH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dq_BTNH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dk_BTKH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dv_BTKH
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuAttentionPrepFwd, PrepFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv_BTJ
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_norm weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_norm weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos_TH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin_TH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // q_BTNH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // k_BTKH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // v_BTKH
                                  .Attr<int64_t>("n_heads")
                                  .Attr<int64_t>("kv_heads")
                                  .Attr<int64_t>("norm")
                                  .Attr<float>("eps")
                                  .Attr<float>("clip"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuAttentionPrepBwd, PrepBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv_BTJ
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_norm weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_norm weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos_TH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin_TH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dq_BTNH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dk_BTKH
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dv_BTKH
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dqkv_BTJ
                                  .Ret<ffi::Buffer<ffi::F32>>()   // d q_norm weight
                                  .Ret<ffi::Buffer<ffi::F32>>()   // d k_norm weight
                                  .Attr<int64_t>("n_heads")
                                  .Attr<int64_t>("kv_heads")
                                  .Attr<int64_t>("norm")
                                  .Attr<float>("eps")
                                  .Attr<float>("clip"));
