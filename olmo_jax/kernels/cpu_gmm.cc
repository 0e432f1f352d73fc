// The routed SwiGLU over expert runs on a CPU: one SGEMM per expert over its contiguous
// rows, through the OpenBLAS that numpy ships (its cblas_sgemm address is handed in by
// olmo_jax/kernels/cpu_gmm.py), as XLA FFI handlers. Built by cpu_gmm.py on first use.
//
// Layout: x_RD rows; expert e owns rows [starts_E[e], starts_E[e] + sizes_E[e]), the
// runs in ascending order and disjoint; rows outside every run come out zero.
//   forward:  gu = x [w_gate | w_up] (saved), y = (silu(g) * u) w_down
//   backward: dh = dy w_down^T; dg = dh u silu'(g); du = dh silu(g);
//             dx = dg w_gate^T + du w_up^T; dw_gate = x^T dg; dw_up = x^T du;
//             dw_down = (silu(g) u)^T dy  (per expert, over its rows only)
// float32 only; every GEMM reads its operands in place (leading dimensions, no copies).
//
// Threads: the experts are spread over XLA's own intra-op thread pool, largest first,
// each expert's GEMMs single-threaded: OpenBLAS's own threads, woken per GEMM, fight XLA's
// for the cores (measured 3-10x slower on a loaded 2-core machine). OpenBLAS is set to
// one thread (openblas_set_num_threads, process-wide: numpy's BLAS in other Python
// threads runs single-threaded meanwhile) while any of these calls runs, and restored
// when the last one ends.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <numeric>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// OpenBLAS cblas_sgemm with 64-bit integers (numpy's scipy_openblas64_).
using Sgemm = void (*)(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                       float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                       float beta, float* c, int64_t ldc);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
Sgemm g_sgemm = nullptr;
using GetThreads = int (*)();
using SetThreads = void (*)(int);
GetThreads g_get_threads = nullptr;
SetThreads g_set_threads = nullptr;

// OpenBLAS single-threaded while at least one kernel call runs (a counted scope).
std::mutex g_threads_mu;
int g_inside = 0, g_saved_threads = 1;

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
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS leaves C alone for k = 0 only when beta = 1
    if (beta == 0.0f)
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, n * sizeof(float));
    return;
  }
  g_sgemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, m, n, k, 1.0f, a, lda,
          b, ldb, beta, c, ldc);
}

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

struct Runs {
  const int32_t* starts;
  const int32_t* sizes;
  int64_t E, R;
};

// Checks that the runs ascend, are disjoint and lie inside the buffer.
ffi::Error check(const Runs& r) {
  int64_t end = 0;
  for (int64_t e = 0; e < r.E; ++e) {
    int64_t s = r.starts[e], n = r.sizes[e];
    if (n == 0) continue;
    if (n < 0 || s < end || s + n > r.R)
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "cpu_gmm: expert runs must ascend, be disjoint and fit the buffer");
    end = s + n;
  }
  return ffi::Error::Success();
}

// Zeroes the rows (of `width` floats) outside every run.
void zero_gaps(const Runs& r, float* a, int64_t width) {
  int64_t end = 0;
  for (int64_t e = 0; e <= r.E; ++e) {
    int64_t s = e < r.E ? r.starts[e] : r.R;
    if (e < r.E && r.sizes[e] == 0) continue;
    if (s > end) std::memset(a + end * width, 0, (s - end) * width * sizeof(float));
    if (e < r.E) end = s + r.sizes[e];
  }
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
  if (threads <= 1) {  // one expert, or no pool: OpenBLAS threads each GEMM itself
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

// The experts, most rows first (the longest items start first).
std::vector<int64_t> by_size(const Runs& r) {
  std::vector<int64_t> order(r.E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return r.sizes[a] > r.sizes[b]; });
  return order;
}

ffi::Error no_blas() {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "cpu_gmm: the BLAS sgemm was not set (olmo_jax.kernels.cpu_gmm loads it)");
}

ffi::Error SwigluFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> starts,
                     ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> wg,
                     ffi::Buffer<ffi::F32> wu, ffi::Buffer<ffi::F32> wd,
                     ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> gu) {
  if (!g_sgemm) return no_blas();
  const int64_t R = x.dimensions()[0], D = x.dimensions()[1];
  const int64_t E = wg.dimensions()[0], F = wg.dimensions()[2], J = 2 * F;
  Runs runs{starts.typed_data(), sizes.typed_data(), E, R};
  if (auto err = check(runs); err.failure()) return err;
  const float *x_p = x.typed_data(), *wg_p = wg.typed_data(), *wu_p = wu.typed_data(),
              *wd_p = wd.typed_data();
  float *y_p = y->typed_data(), *gu_p = gu->typed_data();
  zero_gaps(runs, y_p, D);
  zero_gaps(runs, gu_p, J);
  parallel_items(pool, by_size(runs), [&](int64_t e) {
    const int64_t r0 = runs.starts[e], n = runs.sizes[e];
    if (n == 0) return;
    const float* x_e = x_p + r0 * D;
    float* gu_e = gu_p + r0 * J;
    gemm(false, false, n, F, D, x_e, D, wg_p + e * D * F, F, 0.0f, gu_e, J);
    gemm(false, false, n, F, D, x_e, D, wu_p + e * D * F, F, 0.0f, gu_e + F, J);
    thread_local std::vector<float> h;
    h.resize(n * F);
    for (int64_t i = 0; i < n; ++i) {
      const float *g = gu_e + i * J, *u = g + F;
      float* h_i = h.data() + i * F;
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) h_i[j] = g[j] * sigmoid(g[j]) * u[j];
    }
    gemm(false, false, n, D, F, h.data(), F, wd_p + e * F * D, D, 0.0f, y_p + r0 * D, D);
  });
  return ffi::Error::Success();
}

ffi::Error SwigluBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> gu,
                     ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::S32> starts,
                     ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> wg,
                     ffi::Buffer<ffi::F32> wu, ffi::Buffer<ffi::F32> wd,
                     ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dwg,
                     ffi::ResultBuffer<ffi::F32> dwu, ffi::ResultBuffer<ffi::F32> dwd) {
  if (!g_sgemm) return no_blas();
  const int64_t R = x.dimensions()[0], D = x.dimensions()[1];
  const int64_t E = wg.dimensions()[0], F = wg.dimensions()[2], J = 2 * F;
  Runs runs{starts.typed_data(), sizes.typed_data(), E, R};
  if (auto err = check(runs); err.failure()) return err;
  const float *x_p = x.typed_data(), *gu_p = gu.typed_data(), *dy_p = dy.typed_data(),
              *wg_p = wg.typed_data(), *wu_p = wu.typed_data(), *wd_p = wd.typed_data();
  float *dx_p = dx->typed_data(), *dwg_p = dwg->typed_data(), *dwu_p = dwu->typed_data(),
        *dwd_p = dwd->typed_data();
  zero_gaps(runs, dx_p, D);
  parallel_items(pool, by_size(runs), [&](int64_t e) {
    const int64_t r0 = runs.starts[e], n = runs.sizes[e];
    float *dwg_e = dwg_p + e * D * F, *dwu_e = dwu_p + e * D * F, *dwd_e = dwd_p + e * F * D;
    if (n == 0) {
      std::memset(dwg_e, 0, D * F * sizeof(float));
      std::memset(dwu_e, 0, D * F * sizeof(float));
      std::memset(dwd_e, 0, F * D * sizeof(float));
      return;
    }
    const float *x_e = x_p + r0 * D, *gu_e = gu_p + r0 * J, *dy_e = dy_p + r0 * D;
    thread_local std::vector<float> scratch;
    scratch.resize(3 * n * F);
    float *dh = scratch.data(), *h = dh + n * F, *dg = h + n * F;  // du overwrites dh
    gemm(false, true, n, F, D, dy_e, D, wd_p + e * F * D, D, 0.0f, dh, F);
    for (int64_t i = 0; i < n; ++i) {
      const float *g = gu_e + i * J, *u = g + F;
      float *dh_i = dh + i * F, *h_i = h + i * F, *dg_i = dg + i * F;
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) {
        const float s = sigmoid(g[j]), act = g[j] * s;
        h_i[j] = act * u[j];
        dg_i[j] = dh_i[j] * u[j] * (s * (1.0f + g[j] * (1.0f - s)));
        dh_i[j] = dh_i[j] * act;  // du
      }
    }
    const float* du = dh;
    gemm(true, false, F, D, n, h, F, dy_e, D, 0.0f, dwd_e, D);
    gemm(true, false, D, F, n, x_e, D, dg, F, 0.0f, dwg_e, F);
    gemm(true, false, D, F, n, x_e, D, du, F, 0.0f, dwu_e, F);
    float* dx_e = dx_p + r0 * D;
    gemm(false, true, n, D, F, dg, F, wg_p + e * D * F, F, 0.0f, dx_e, D);
    gemm(false, true, n, D, F, du, F, wu_p + e * D * F, F, 1.0f, dx_e, D);
  });
  return ffi::Error::Success();
}

}  // namespace

// cblas_sgemm (64-bit integers), openblas_get_num_threads, openblas_set_num_threads.
extern "C" void olmo_cpu_gmm_set_blas(void* sgemm, void* get_threads, void* set_threads) {
  g_get_threads = reinterpret_cast<GetThreads>(get_threads);
  g_set_threads = reinterpret_cast<SetThreads>(set_threads);
  g_sgemm = reinterpret_cast<Sgemm>(sgemm);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuSwigluFwd, SwigluFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x_RD
                                  .Arg<ffi::Buffer<ffi::S32>>()   // starts_E
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sizes_E
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_gate_EDF
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_up_EDF
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_down_EFD
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y_RD
                                  .Ret<ffi::Buffer<ffi::F32>>()); // gu_RJ

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuSwigluBwd, SwigluBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x_RD
                                  .Arg<ffi::Buffer<ffi::F32>>()   // gu_RJ
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dy_RD
                                  .Arg<ffi::Buffer<ffi::S32>>()   // starts_E
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sizes_E
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_gate_EDF
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_up_EDF
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_down_EFD
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dx_RD
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dw_gate_EDF
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dw_up_EDF
                                  .Ret<ffi::Buffer<ffi::F32>>()); // dw_down_EFD
