// CUDA kernel of pt2e_fq::ste_grad: dx = packed mask bit ? dy : 0 (a select,
// so NaN in dy at a clamped position gives 0). Plain CUDA C++: no torch.
#include "elementwise.cuh"

namespace pt2e_fq::cuda {
namespace {

// VEC divides 8, and vector v starts at element v * VEC, so its bits sit in
// one mask byte.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    ste_kernel(const T* __restrict__ dy, const uint8_t* __restrict__ mask, T* __restrict__ dx,
               int64_t numel) {
  const T zero = from_f32<T>(0.0f);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t num_full = numel / VEC;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < num_full;
       v += stride) {
    const int64_t i0 = v * VEC;
    const uint32_t bits = mask[i0 >> 3] >> (i0 & 7);
    T g[VEC], out[VEC];
    load_vec<T, VEC>(dy + i0, g);
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = ((bits >> k) & 1u) ? g[k] : zero;
    store_vec<T, VEC>(dx + i0, out);
  }
  // The last numel % VEC elements.
  for (int64_t i = num_full * VEC + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < numel; i += stride) {
    dx[i] = ((mask[i >> 3] >> (i & 7)) & 1u) ? dy[i] : zero;
  }
}

template <typename T>
void launch_typed(const void* dy, const uint8_t* mask, void* dx, int64_t numel,
                  cudaStream_t stream) {
  constexpr int V = kVec<T>;
  if (aligned16(dy) && aligned16(dx)) {
    launch(ste_kernel<T, V>, grid_size((numel + V - 1) / V), kThreads, stream,
           static_cast<const T*>(dy), mask, static_cast<T*>(dx), numel);
  } else {
    launch(ste_kernel<T, 1>, grid_size(numel), kThreads, stream, static_cast<const T*>(dy), mask,
           static_cast<T*>(dx), numel);
  }
}

}  // namespace

cudaError_t launch_ste_grad(ElemType type, const void* dy, const uint8_t* mask, void* dx,
                            int64_t numel, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  dispatch_elem_type(type, [&](auto tag) {
    launch_typed<decltype(tag)>(dy, mask, dx, numel, stream);
  });
  return cudaGetLastError();
}

}  // namespace pt2e_fq::cuda
