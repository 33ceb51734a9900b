// CUDA's execution model on the CPU, for tests. The project's .cu files
// compile unchanged as host C++ against this file (include/ holds the
// stand-ins for CUDA's headers) and their kernels run here: each block's
// threads are fibers on one OS thread, switched at every warp collective and
// __syncthreads, so a warp's lanes meet in lockstep there. What would be
// undefined behaviour on a GPU (a full-mask collective that not every lane
// of the warp reaches, a __syncthreads not every thread of the block
// reaches, a mask other than the full warp) stops the program with a message
// naming the function and line. Built with -D__CUDACC__ -D__CUDA_ARCH__ so
// the shared headers take their device branches (__fdiv_rn and friends,
// defined below as the IEEE operations they are).
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct uint4 {
  unsigned x, y, z, w;
};

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
using cudaStream_t = struct CUstream_st*;

// One device whose multiprocessor count is PT2E_FQ_SIM_SMS (default 1), so
// the kernels' grids are small and their grid-stride loops iterate. With
// PT2E_FQ_SIM_LAST_BLOCKS=k a launch runs only the last k blocks of its grid.
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError();
// Runs at once: launches run at once too, in stream order.
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream);

namespace cuda_sim {

struct ThreadIndex {
  dim3 thread, block, block_dim, grid_dim;
};

// The indices of the simulated thread that is running.
const ThreadIndex& current();

// Stops the program: `what` went wrong in function fn at line.
[[noreturn]] void fail(const char* what, const char* fn, int line);

uint32_t ballot(uint32_t mask, bool pred, const char* fn, int line);
uint32_t shfl_xor(uint32_t mask, uint32_t value, int lane_mask, const char* fn, int line);
void sync_threads(const char* fn, int line);

// Runs body() once per thread of a grid of `grid` blocks of `block` threads.
void run_grid(dim3 grid, dim3 block, const std::function<void()>& body);

// A launch converts its arguments to the kernel's parameters once, as the
// CUDA runtime copies them; every thread then gets its own copy.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t, Args... args) {
  const std::tuple<Params...> params(static_cast<Params>(args)...);
  run_grid(grid, block, [&] { std::apply(kernel, params); });
}

}  // namespace cuda_sim

#define threadIdx (::cuda_sim::current().thread)
#define blockIdx (::cuda_sim::current().block)
#define blockDim (::cuda_sim::current().block_dim)
#define gridDim (::cuda_sim::current().grid_dim)

inline uint32_t __ballot_sync(uint32_t mask, int pred, const char* fn = __builtin_FUNCTION(),
                              int line = __builtin_LINE()) {
  return cuda_sim::ballot(mask, pred != 0, fn, line);
}

template <typename T>
T __shfl_xor_sync(uint32_t mask, T value, int lane_mask, int width = 32,
                  const char* fn = __builtin_FUNCTION(), int line = __builtin_LINE()) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  if (width != 32) cuda_sim::fail("__shfl_xor_sync with a width other than 32 (not simulated)", fn, line);
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits = cuda_sim::shfl_xor(mask, bits, lane_mask, fn, line);
  std::memcpy(&value, &bits, 4);
  return value;
}

inline void __syncthreads_at(const char* fn = __builtin_FUNCTION(), int line = __builtin_LINE()) {
  cuda_sim::sync_threads(fn, line);
}
#define __syncthreads() __syncthreads_at()

// Fibers never run at the same time, so a read-modify-write is atomic.
inline uint32_t atomicOr(uint32_t* p, uint32_t v) {
  const uint32_t old = *p;
  *p = old | v;
  return old;
}
inline uint32_t atomicMax(uint32_t* p, uint32_t v) {
  const uint32_t old = *p;
  *p = old > v ? old : v;
  return old;
}
inline uint32_t atomicMin(uint32_t* p, uint32_t v) {
  const uint32_t old = *p;
  *p = old < v ? old : v;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}

// Device-code min and max of two values of one type.
template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

// The correctly rounded intrinsics are the IEEE operations (the harness is
// built with -ffp-contract=off, so nothing fuses them).
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
