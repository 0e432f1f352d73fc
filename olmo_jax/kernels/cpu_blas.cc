// The one entry point through which olmo_jax/kernels/cpu_ffi.py hands the CPU FFI kernels
// numpy's OpenBLAS (cpu_blas.h).

#include "cpu_blas.h"

// cblas_sgemm (64-bit integers), openblas_get_num_threads, openblas_set_num_threads.
extern "C" void olmo_cpu_set_blas(void* sgemm, void* get_threads, void* set_threads) {
  using namespace olmo_cpu;
  g_get_threads = reinterpret_cast<GetThreads>(get_threads);
  g_set_threads = reinterpret_cast<SetThreads>(set_threads);
  g_sgemm = reinterpret_cast<Sgemm>(sgemm);
}
