// The fiber scheduler behind cuda_sim.h. A block runs as blockDim.x fibers
// (ucontext) on the calling thread. The scheduler resumes every runnable
// fiber in turn until each has finished or waits at a collective; then it
// resolves the collectives whose participants have all arrived, and stops
// the program on one that some participant can no longer reach. Blocks run
// one after another. AddressSanitizer is told about every stack switch, so
// it checks the kernels' memory accesses on fiber stacks too.
#include "cuda_sim.h"

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define CUDA_SIM_ASAN 1
#endif

namespace cuda_sim {
namespace {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 256 * 1024;  // AddressSanitizer's frames are large

enum class State { kRunnable, kBallot, kShfl, kBarrier, kDone };

const char* state_name(State s) {
  switch (s) {
    case State::kBallot:
      return "__ballot_sync";
    case State::kShfl:
      return "__shfl_xor_sync";
    case State::kBarrier:
      return "__syncthreads";
    default:
      return "?";
  }
}

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  ThreadIndex index;
  State state = State::kRunnable;
  uint32_t mask = 0, value = 0, arg = 0, result = 0;
  const char* fn = "";
  int line = 0;
  uint64_t collectives = 0;  // collectives this fiber has reached: lanes must agree
  void* fake_stack = nullptr;
};

struct Scheduler {
  ucontext_t context;
  const void* stack_bottom = nullptr;
  size_t stack_size = 0;
  void* fake_stack = nullptr;
};

std::vector<Fiber> g_fibers;
Scheduler g_scheduler;
Fiber* g_running = nullptr;
const std::function<void()>* g_body = nullptr;
ThreadIndex g_host_index;  // current() outside a kernel: host code does not ask

void to_fiber(Fiber& f) {
#ifdef CUDA_SIM_ASAN
  __sanitizer_start_switch_fiber(&g_scheduler.fake_stack, f.stack.get(), kStackBytes);
#endif
  g_running = &f;
  swapcontext(&g_scheduler.context, &f.context);
  g_running = nullptr;
#ifdef CUDA_SIM_ASAN
  __sanitizer_finish_switch_fiber(g_scheduler.fake_stack, nullptr, nullptr);
#endif
}

void to_scheduler(Fiber& f, [[maybe_unused]] bool finished) {
#ifdef CUDA_SIM_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &f.fake_stack, g_scheduler.stack_bottom,
                                 g_scheduler.stack_size);
#endif
  swapcontext(&f.context, &g_scheduler.context);
#ifdef CUDA_SIM_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

void fiber_main(int i) {
  Fiber& f = g_fibers[i];
#ifdef CUDA_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_scheduler.stack_bottom, &g_scheduler.stack_size);
#endif
  (*g_body)();
  f.state = State::kDone;
  to_scheduler(f, true);
}

// The running fiber waits at a collective of kind `s` until the scheduler
// resolves it; returns its result.
uint32_t wait_at(State s, uint32_t mask, uint32_t value, uint32_t arg, const char* fn, int line) {
  Fiber* f = g_running;
  if (f == nullptr) fail(state_name(s), fn, line);
  f->state = s;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->fn = fn;
  f->line = line;
  ++f->collectives;
  to_scheduler(*f, false);
  return f->result;
}

[[noreturn]] void fail_at(const Fiber& waiting, const std::string& why) {
  const std::string what = std::string(state_name(waiting.state)) + " " + why;
  fail(what.c_str(), waiting.fn, waiting.line);
}

// Resolves the collectives of lanes [first, first + n) if all of them wait
// at the same one; true when it released them.
bool resolve_warp(int first, int n) {
  const Fiber* waiting = nullptr;
  int arrived = 0, done = 0;
  for (int l = 0; l < n; ++l) {
    const Fiber& f = g_fibers[first + l];
    if (f.state == State::kDone) {
      ++done;
    } else if (f.state == State::kBallot || f.state == State::kShfl) {
      ++arrived;
      waiting = &f;
    }
  }
  if (waiting == nullptr) return false;
  if (done > 0) {
    fail_at(*waiting, "not reached by every lane of the warp: " + std::to_string(done) +
                          " lane(s) returned from the kernel first");
  }
  if (arrived < n) return false;  // others wait at a __syncthreads: see resolve_block
  const uint32_t full = n == kWarp ? 0xFFFFFFFFu : (1u << n) - 1;
  for (int l = 0; l < n; ++l) {
    const Fiber& f = g_fibers[first + l];
    if (f.state != waiting->state || f.collectives != waiting->collectives || f.line != waiting->line) {
      fail_at(f, "met a different collective in another lane of the warp (line " +
                     std::to_string(waiting->line) + "): divergent warp");
    }
    if (f.mask != full || n != kWarp) {
      fail_at(f, "with a mask that is not the whole warp of 32 existing lanes");
    }
  }
  uint32_t ballot = 0;
  for (int l = 0; l < n; ++l) ballot |= static_cast<uint32_t>(g_fibers[first + l].value != 0) << l;
  for (int l = 0; l < n; ++l) {
    Fiber& f = g_fibers[first + l];
    f.result = f.state == State::kBallot ? ballot : g_fibers[first + ((l ^ f.arg) & 31)].value;
  }
  for (int l = 0; l < n; ++l) g_fibers[first + l].state = State::kRunnable;
  return true;
}

bool resolve_block() {
  const Fiber* waiting = nullptr;
  int done = 0;
  for (const Fiber& f : g_fibers) {
    if (f.state == State::kBarrier) waiting = &f;
    if (f.state == State::kDone) ++done;
    if (f.state == State::kBallot || f.state == State::kShfl) return false;
  }
  if (waiting == nullptr) return false;
  if (done > 0) {
    fail_at(*waiting, "not reached by every thread of the block: " + std::to_string(done) +
                          " thread(s) returned from the kernel first");
  }
  for (Fiber& f : g_fibers) f.state = State::kRunnable;
  return true;
}

void run_block(dim3 block_idx, dim3 grid, dim3 block) {
  const int n = static_cast<int>(block.x);
  g_fibers.resize(n);
  for (int t = 0; t < n; ++t) {
    Fiber& f = g_fibers[t];
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
    f.index = ThreadIndex{dim3(t), block_idx, block, grid};
    f.state = State::kRunnable;
    f.collectives = 0;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, reinterpret_cast<void (*)()>(fiber_main), 1, t);
  }
  for (;;) {
    for (Fiber& f : g_fibers) {
      if (f.state == State::kRunnable) to_fiber(f);
    }
    bool released = false;
    for (int w = 0; w < n; w += kWarp) released |= resolve_warp(w, n - w < kWarp ? n - w : kWarp);
    released |= resolve_block();
    bool all_done = true;
    for (const Fiber& f : g_fibers) all_done &= f.state == State::kDone;
    if (all_done) return;
    if (!released) fail("deadlock: no fiber can run", "run_block", __LINE__);
  }
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  const int n = v ? std::atoi(v) : fallback;
  return n > 0 ? n : fallback;
}

int simulated_sms() { return env_int("PT2E_FQ_SIM_SMS", 1); }

}  // namespace

void fail(const char* what, const char* fn, int line) {
  std::fprintf(stderr, "cuda_sim: %s, in %s at line %d\n", what, fn, line);
  std::exit(3);
}

const ThreadIndex& current() { return g_running ? g_running->index : g_host_index; }

uint32_t ballot(uint32_t mask, bool pred, const char* fn, int line) {
  return wait_at(State::kBallot, mask, pred, 0, fn, line);
}

uint32_t shfl_xor(uint32_t mask, uint32_t value, int lane_mask, const char* fn, int line) {
  return wait_at(State::kShfl, mask, value, static_cast<uint32_t>(lane_mask), fn, line);
}

void sync_threads(const char* fn, int line) { wait_at(State::kBarrier, 0, 0, 0, fn, line); }

void run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1 || block.x == 0 ||
      block.x > 1024 || grid.x == 0) {
    fail("launch with a grid or block shape the kernels do not use", "launch", __LINE__);
  }
  // PT2E_FQ_SIM_LAST_BLOCKS=k runs only the last k blocks: with a grid
  // large enough to need no grid-stride step, they compute the end of a
  // tensor of over 2^31 elements whose memory is never otherwise touched.
  const unsigned last = static_cast<unsigned>(env_int("PT2E_FQ_SIM_LAST_BLOCKS", 0));
  g_body = &body;
  for (unsigned b = last > 0 && last < grid.x ? grid.x - last : 0; b < grid.x; ++b) {
    run_block(dim3(b), grid, block);
  }
  g_body = nullptr;
}

}  // namespace cuda_sim

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount ? cuda_sim::simulated_sms() : 0;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() { return cudaSuccess; }

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
