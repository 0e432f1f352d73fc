// The routed SwiGLU over expert runs on a CPU: one SGEMM per expert over its contiguous
// rows, through the OpenBLAS that numpy ships (its cblas_sgemm address is handed in by
// olmo_jax/kernels/cpu_ffi.py), as XLA FFI handlers. Built by cpu_ffi.py on first use.
//
// Layout: x_RD rows; expert e owns rows [starts_E[e], starts_E[e] + sizes_E[e]), the
// runs in ascending order and disjoint; rows outside every run come out zero.
//   forward:  gu = x [w_gate | w_up] (saved), y = (silu(g) * u) w_down
//   backward: dh = dy w_down^T; dg = dh u silu'(g); du = dh silu(g);
//             dx = dg w_gate^T + du w_up^T; dw_gate = x^T dg; dw_up = x^T du;
//             dw_down = (silu(g) u)^T dy  (per expert, over its rows only)
// float32 only. Each expert's gate and up weights are first copied side by side into a
// per-thread [D, 2F] panel (2 D F floats, small next to the GEMMs over its rows), so the
// forward's x [w_gate | w_up] and the backward's dx = [dg | du] [w_gate | w_up]^T and
// [dw_gate | dw_up] = x^T [dg | du] are one GEMM each instead of two (measured with
// OpenBLAS on 256-row experts: ~6% faster); the other operands are read in place.
//
// Threads: the experts are spread over XLA's own intra-op thread pool, largest first,
// each expert's GEMMs single-threaded (cpu_blas.h).

#include <cmath>
#include <numeric>

#include "cpu_blas.h"

namespace ffi = xla::ffi;
using namespace olmo_cpu;

namespace {

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

// [w_gate_e | w_up_e] as one row-major [D, 2F] panel, in a per-thread buffer.
const float* gate_up_panel(const float* wg_e, const float* wu_e, int64_t D, int64_t F) {
  thread_local std::vector<float> panel;
  panel.resize(D * 2 * F);
  for (int64_t d = 0; d < D; ++d) {
    std::memcpy(panel.data() + d * 2 * F, wg_e + d * F, F * sizeof(float));
    std::memcpy(panel.data() + d * 2 * F + F, wu_e + d * F, F * sizeof(float));
  }
  return panel.data();
}

// The experts, most rows first (the longest items start first).
std::vector<int64_t> by_size(const Runs& r) {
  std::vector<int64_t> order(r.E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return r.sizes[a] > r.sizes[b]; });
  return order;
}

ffi::Error SwigluFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> starts,
                     ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::F32> wg,
                     ffi::Buffer<ffi::F32> wu, ffi::Buffer<ffi::F32> wd,
                     ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> gu) {
  if (!g_sgemm) return no_blas("cpu_gmm");
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
    gemm(false, false, n, J, D, x_e, D, gate_up_panel(wg_p + e * D * F, wu_p + e * D * F, D, F),
         J, 0.0f, gu_e, J);
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
  if (!g_sgemm) return no_blas("cpu_gmm");
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
    scratch.resize(4 * n * F + D * J);
    // dgu: [n, 2F] rows of dg | du; dw_gu: [D, 2F] rows of dw_gate | dw_up
    float *dh = scratch.data(), *h = dh + n * F, *dgu = h + n * F, *dw_gu = dgu + n * J;
    gemm(false, true, n, F, D, dy_e, D, wd_p + e * F * D, D, 0.0f, dh, F);
    for (int64_t i = 0; i < n; ++i) {
      const float *g = gu_e + i * J, *u = g + F;
      float *dh_i = dh + i * F, *h_i = h + i * F, *dg_i = dgu + i * J, *du_i = dg_i + F;
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) {
        const float s = sigmoid(g[j]), act = g[j] * s;
        h_i[j] = act * u[j];
        dg_i[j] = dh_i[j] * u[j] * (s * (1.0f + g[j] * (1.0f - s)));
        du_i[j] = dh_i[j] * act;
      }
    }
    gemm(true, false, F, D, n, h, F, dy_e, D, 0.0f, dwd_e, D);
    gemm(true, false, D, J, n, x_e, D, dgu, J, 0.0f, dw_gu, J);
    for (int64_t d = 0; d < D; ++d) {
      std::memcpy(dwg_e + d * F, dw_gu + d * J, F * sizeof(float));
      std::memcpy(dwu_e + d * F, dw_gu + d * J + F, F * sizeof(float));
    }
    gemm(false, true, n, D, J, dgu, J, gate_up_panel(wg_p + e * D * F, wu_p + e * D * F, D, F),
         J, 0.0f, dx_p + r0 * D, D);
  });
  return ffi::Error::Success();
}

}  // namespace

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
