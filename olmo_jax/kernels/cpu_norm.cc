// RMSNorm over the last axis of [..., D] rows on a CPU, forward and backward, as XLA FFI
// handlers (cpu_rms.h's math; olmo_jax/model/norm.py's rms_norm with a [D] weight): one
// pass over the rows each way instead of XLA:CPU's broadcast, reduce and element-wise
// fusions. Rows in blocks spread over XLA's intra-op thread pool, the weight gradient
// summed per block and the blocks' sums added in order (cpu_blas.h parallel_rows).
// float32 only. Built by olmo_jax/kernels/cpu_ffi.py on first use.

#include <vector>

#include "cpu_blas.h"
#include "cpu_rms.h"

namespace ffi = xla::ffi;
using namespace olmo_cpu;

namespace {

ffi::Error check(int64_t D, int64_t w) {
  if (D != w)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "cpu_norm: x must be [..., D] and the weight [D]");
  return ffi::Error::Success();
}

ffi::Error RmsNormFwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y, float eps) {
  const auto xd = x.dimensions();
  const int64_t D = xd[xd.size() - 1], R = x.element_count() / D;
  if (auto err = check(D, w.element_count()); err.failure()) return err;
  const float *x_p = x.typed_data(), *w_p = w.typed_data();
  float* y_p = y->typed_data();
  parallel_rows(pool, R, 0, nullptr, [&](int64_t r0, int64_t r1, float*) {
    for (int64_t r = r0; r < r1; ++r) rms_span(x_p + r * D, D, w_p, eps, y_p + r * D, nullptr);
  });
  return ffi::Error::Success();
}

ffi::Error RmsNormBwd(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dx,
                      ffi::ResultBuffer<ffi::F32> dw, float eps) {
  const auto xd = x.dimensions();
  const int64_t D = xd[xd.size() - 1], R = x.element_count() / D;
  if (auto err = check(D, w.element_count()); err.failure()) return err;
  const float *x_p = x.typed_data(), *w_p = w.typed_data(), *dy_p = dy.typed_data();
  float *dx_p = dx->typed_data(), *dw_p = dw->typed_data();
  parallel_rows(pool, R, D, dw_p, [&](int64_t r0, int64_t r1, float* dw_sums) {
    thread_local std::vector<float> buf;
    buf.resize(3 * D);
    float *xhat = buf.data(), *y = xhat + D, *g = y + D;
    for (int64_t r = r0; r < r1; ++r) {
      const float rstd = rms_span(x_p + r * D, D, w_p, eps, y, xhat);
      std::copy(dy_p + r * D, dy_p + (r + 1) * D, g);
      rms_span_t(xhat, rstd, D, w_p, g, dx_p + r * D, dw_sums);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuRmsNormFwd, RmsNormFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // weight [D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [..., D]
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmoCpuRmsNormBwd, RmsNormBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // weight [D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dy [..., D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dx [..., D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // d weight [D]
                                  .Attr<float>("eps"));
