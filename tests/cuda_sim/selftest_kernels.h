// Kernels that show the harness at work: one correct (its collectives'
// results are checked), and one for each kind of undefined behaviour the
// harness must stop, which tests/cuda_sim/test_cuda_sim.py expects to fail with the
// harness's message.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda_sim.h"

namespace selftest {

// Lane l ballots (l odd) and reads lane l ^ 1's value; one thread per block writes.
__global__ void collectives(uint32_t* out) {
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t odd = __ballot_sync(0xFFFFFFFFu, lane & 1);
  const uint32_t neighbour = __shfl_xor_sync(0xFFFFFFFFu, lane * 10, 1);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = (odd == 0xAAAAAAAAu) && (neighbour == (lane ^ 1) * 10);
}

__global__ void early_exit_before_ballot(uint32_t* out) {
  if ((threadIdx.x & 31) == 5) return;
  out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, 1);
}

__global__ void divergent_ballots(uint32_t* out) {
  if (threadIdx.x & 1) {
    out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, 1);
  } else {
    out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, 0);
  }
}

__global__ void early_exit_before_syncthreads(uint32_t* out) {
  if (threadIdx.x == 40) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void write_past_the_end(uint32_t* out) { out[threadIdx.x + 1] = 1; }

inline int run_selftest(const std::string& name) {
  const int threads = 64, blocks = 3;
  auto* out = static_cast<uint32_t*>(std::calloc(threads * blocks, sizeof(uint32_t)));
  if (name == "collectives") {
    cuda_sim::launch(collectives, blocks, threads, nullptr, out);
    for (int i = 0; i < threads * blocks; ++i) {
      if (out[i] != 1) {
        std::fprintf(stderr, "selftest collectives: thread %d got a wrong ballot or shuffle\n", i);
        return 1;
      }
    }
  } else if (name == "early_exit_before_ballot") {
    cuda_sim::launch(early_exit_before_ballot, 1, threads, nullptr, out);
  } else if (name == "divergent_ballots") {
    cuda_sim::launch(divergent_ballots, 1, threads, nullptr, out);
  } else if (name == "early_exit_before_syncthreads") {
    cuda_sim::launch(early_exit_before_syncthreads, 1, threads, nullptr, out);
  } else if (name == "write_past_the_end") {
    cuda_sim::launch(write_past_the_end, 1, threads * blocks, nullptr, out);
  } else {
    std::fprintf(stderr, "unknown selftest %s\n", name.c_str());
    return 2;
  }
  std::free(out);
  return 0;
}

}  // namespace selftest

using selftest::run_selftest;
