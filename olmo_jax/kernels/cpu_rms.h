// RMSNorm of one span of floats, forward and backward (float32 arithmetic), shared by the
// CPU FFI kernels that normalize: cpu_norm.cc (the residual stream's norms) and
// cpu_attention.cc (QK-norm). The math of olmo_jax/model/norm.py:
//   forward:  rstd = 1 / sqrt(mean(x^2) + eps); xhat = x rstd; y = w xhat
//   backward: dw += dy xhat; g = dy w; dx = rstd (g - xhat mean(g xhat))

#pragma once

#include <cmath>
#include <cstdint>

namespace olmo_cpu {

// y = w * x * rstd over x[0, S); xhat (when not null) keeps x * rstd. Returns rstd.
inline float rms_span(const float* x, int64_t S, const float* w, float eps, float* y,
                      float* xhat) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < S; ++j) ss += x[j] * x[j];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(S) + eps);
#pragma omp simd
  for (int64_t j = 0; j < S; ++j) {
    const float xh = x[j] * r;
    if (xhat) xhat[j] = xh;
    y[j] = w[j] * xh;
  }
  return r;
}

// dx of rms_span from dy (overwritten with dy * w) and xhat, rstd; adds dy * xhat to dw.
inline void rms_span_t(const float* xhat, float r, int64_t S, const float* w, float* dy,
                       float* dx, float* dw) {
  float m = 0.0f;
#pragma omp simd reduction(+ : m)
  for (int64_t j = 0; j < S; ++j) {
    const float g = dy[j] * w[j];
    dw[j] += dy[j] * xhat[j];
    dy[j] = g;
    m += g * xhat[j];
  }
  m /= static_cast<float>(S);
#pragma omp simd
  for (int64_t j = 0; j < S; ++j) dx[j] = r * (dy[j] - xhat[j] * m);
}

}  // namespace olmo_cpu
