// What the CPU FFI kernels (cpu_gmm.cc, cpu_attention.cc) share: numpy's OpenBLAS SGEMM
// (its address handed in by olmo_jax/kernels/cpu_ffi.py through olmo_cpu_set_blas,
// cpu_blas.cc), OpenBLAS held single-threaded while the kernels spread their items over
// XLA's own intra-op thread pool, and that spreading.
//
// Threads: each item's GEMMs run single-threaded: OpenBLAS's own threads, woken per GEMM,
// fight XLA's for the cores (measured 3-10x slower on a loaded 2-core machine). OpenBLAS
// is set to one thread (openblas_set_num_threads, process-wide: numpy's BLAS in other
// Python threads runs single-threaded meanwhile) while any of these calls runs, and
// restored when the last one ends.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace olmo_cpu {

namespace ffi = xla::ffi;

// OpenBLAS cblas_sgemm with 64-bit integers (numpy's scipy_openblas64_).
using Sgemm = void (*)(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                       float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                       float beta, float* c, int64_t ldc);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
using GetThreads = int (*)();
using SetThreads = void (*)(int);
inline Sgemm g_sgemm = nullptr;
inline GetThreads g_get_threads = nullptr;
inline SetThreads g_set_threads = nullptr;

// OpenBLAS single-threaded while at least one kernel call runs (a counted scope).
inline std::mutex g_threads_mu;
inline int g_inside = 0, g_saved_threads = 1;

struct SingleThreadedBlas {
  SingleThreadedBlas() {
    std::lock_guard<std::mutex> lock(g_threads_mu);
    if (g_inside++ == 0) {
      g_saved_threads = g_get_threads();
      if (g_saved_threads != 1) g_set_threads(1);
    }
  }
  ~SingleThreadedBlas() {
    std::lock_guard<std::mutex> lock(g_threads_mu);
    if (--g_inside == 0 && g_saved_threads != 1) g_set_threads(g_saved_threads);
  }
};

// C[m, n] = alpha op(A) op(B) + beta C, row-major.
inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc,
                 float alpha = 1.0f) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS leaves C alone for k = 0 only when beta = 1
    if (beta == 0.0f)
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, n * sizeof(float));
    return;
  }
  g_sgemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, m, n, k, alpha, a, lda,
          b, ldb, beta, c, ldc);
}

// Runs item(i) for i in `order` (a permutation of 0..n-1) on the calling thread and up to
// pool.num_threads() - 1 pool tasks, each pulling the next index; returns when all are
// done. Deadlock-free whether or not the pool ever runs the tasks: the caller pulls too,
// and waits only for items already taken.
struct Work {
  std::vector<int64_t> order;
  std::atomic<int64_t> next{0};
  int64_t done = 0;
  std::mutex mu;
  std::condition_variable cv;
};

template <typename Item>
void parallel_items(ffi::ThreadPool& pool, std::vector<int64_t> order, const Item& item) {
  const int64_t n = order.size();
  const int64_t threads = std::min<int64_t>(pool.num_threads(), n);
  if (threads <= 1) {  // one item, or no pool: OpenBLAS threads each GEMM itself
    for (int64_t i : order) item(i);
    return;
  }
  SingleThreadedBlas single;
  auto work = std::make_shared<Work>();
  work->order = std::move(order);
  auto drain = [work, n, &item]() {
    int64_t mine = 0;
    for (int64_t k; (k = work->next.fetch_add(1)) < n; ++mine) item(work->order[k]);
    if (mine == 0) return;
    std::lock_guard<std::mutex> lock(work->mu);
    work->done += mine;
    if (work->done == n) work->cv.notify_all();
  };
  // the pool's tasks may outlive this call only when they find no item left, so they
  // touch `item` (a reference into this frame) only while an item is still unfinished
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([drain] { drain(); });
  drain();
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done == n; });
}

// item(i) for i = 0 .. n - 1, spread as parallel_items spreads them.
template <typename Item>
void parallel_range(ffi::ThreadPool& pool, int64_t n, const Item& item) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  parallel_items(pool, std::move(order), item);
}

// rows(r0, r1, sums) for the blocks [r0, r1) of kRowBlock of R rows, spread over the pool;
// each block adds what it sums (e.g. a weight gradient, W floats) into its own partial
// sums, and out[0, W) is their total added in block order: deterministic whichever thread
// ran which block. W = 0 (out unused) when the rows sum nothing.
constexpr int64_t kRowBlock = 64;

template <typename Rows>
void parallel_rows(ffi::ThreadPool& pool, int64_t R, int64_t W, float* out, const Rows& rows) {
  const int64_t n = (R + kRowBlock - 1) / kRowBlock;
  std::vector<float> parts(n * W, 0.0f);
  parallel_range(pool, n, [&](int64_t b) {
    rows(b * kRowBlock, std::min(R, (b + 1) * kRowBlock), parts.data() + b * W);
  });
  if (W == 0) return;
  std::fill(out, out + W, 0.0f);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t j = 0; j < W; ++j) out[j] += parts[b * W + j];
}

inline ffi::Error no_blas(const char* kernel) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string(kernel) + ": the BLAS sgemm was not set (olmo_jax.kernels.cpu_ffi "
                    "loads it)");
}

}  // namespace olmo_cpu
