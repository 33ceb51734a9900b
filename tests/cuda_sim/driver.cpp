// Runs the CUDA kernels' launchers (kernels.h) in the simulation harness on
// cases written by tests/cuda_sim/test_cuda_sim.py: one directory per case, holding
// case.txt (key=value lines) and the inputs as raw little-endian arrays; the
// outputs are written beside them. Every buffer is its own allocation of
// exactly the bytes the binding allocates, so AddressSanitizer stops an
// access past either end. `offset` (bytes) shifts x / dy and y / dx off
// malloc's 16-byte alignment, as a tensor view at an odd offset would.
// `op=observe` runs a fused observe op on a running range, qparams and a
// non-finite count read from files, and writes them back updated.
// `tail` (elements, affine and ste only): x / dy hold only the tensor's last
// `tail` elements and only those of y / dx and the mask are written back;
// with PT2E_FQ_SIM_LAST_BLOCKS that tests 64-bit indexing past 2^31
// elements without computing or allocating the rest.
//
//   cuda_sim_driver CASE_DIR...        exit 0, or a message and exit != 0
//   cuda_sim_driver --selftest NAME    a kernel with undefined behaviour
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kernels.h"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/mask_bits.h"
#include "pt2e_fq/observe.h"
#include "selftest_kernels.h"

namespace {

using namespace pt2e_fq;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "cuda_sim_driver: %s\n", what.c_str());
  std::exit(2);
}

struct Case {
  std::string dir;
  std::map<std::string, std::string> kv;

  const std::string& get(const std::string& key) const {
    const auto it = kv.find(key);
    if (it == kv.end()) die(dir + ": case.txt has no " + key);
    return it->second;
  }
  int64_t num(const std::string& key) const { return std::stoll(get(key)); }
  std::vector<int64_t> list(const std::string& key) const {
    std::vector<int64_t> out;
    std::stringstream ss(get(key));
    for (std::string item; std::getline(ss, item, ',');) {
      if (!item.empty()) out.push_back(std::stoll(item));
    }
    return out;
  }
  std::string path(const std::string& name) const { return dir + "/" + name; }
};

Case read_case(const std::string& dir) {
  Case c{dir, {}};
  std::ifstream in(dir + "/case.txt");
  if (!in) die(dir + "/case.txt: cannot read");
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) c.kv[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return c;
}

// A zeroed heap buffer of exactly `bytes` (plus `offset` in front). Sparse:
// reserved address space instead (pages appear when touched), for tensors of
// over 2^31 elements of which only the end is computed; AddressSanitizer
// does not check such memory.
struct Buffer {
  char* base = nullptr;
  char* data = nullptr;
  size_t bytes = 0, mapped = 0;
  Buffer(size_t n, size_t offset = 0, bool sparse = false) : bytes(n) {
    if (sparse) {
      mapped = n + offset;
      void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) die("cannot reserve " + std::to_string(mapped) + " bytes");
      base = static_cast<char*>(p);
    } else {
      base = static_cast<char*>(std::malloc(n + offset + 1));  // +1: malloc(0) may return null
      std::memset(base, 0, n + offset + 1);
    }
    data = base + offset;
  }
  Buffer(const Buffer&) = delete;
  ~Buffer() {
    if (mapped) {
      munmap(base, mapped);
    } else {
      std::free(base);
    }
  }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data);
  }
};

// Fills the last `bytes` of b (all of it by default) from a file of that size.
void load(Buffer& b, const std::string& file, size_t bytes = SIZE_MAX) {
  if (bytes == SIZE_MAX) bytes = b.bytes;
  std::ifstream in(file, std::ios::binary);
  if (!in) die(file + ": cannot read");
  in.read(b.data + (b.bytes - bytes), static_cast<std::streamsize>(bytes));
  if (static_cast<size_t>(in.gcount()) != bytes) die(file + ": shorter than " + std::to_string(bytes) + " bytes");
}

void save(const char* data, size_t bytes, const std::string& file) {
  std::ofstream out(file, std::ios::binary);
  out.write(data, static_cast<std::streamsize>(bytes));
  if (!out) die(file + ": cannot write");
}

cuda::ElemType elem_type(const std::string& name, size_t& size) {
  size = name == "f32" ? 4 : 2;
  if (name == "f32") return cuda::ElemType::kFloat32;
  if (name == "bf16") return cuda::ElemType::kBFloat16;
  if (name == "f16") return cuda::ElemType::kFloat16;
  die("dtype must be f32, bf16 or f16, got " + name);
}

ElemFormat elem_format(const std::string& name) {
  if (name == "e4m3") return ElemFormat::kE4M3;
  if (name == "e5m2") return ElemFormat::kE5M2;
  if (name == "e2m1") return ElemFormat::kE2M1;
  die("fmt must be e4m3, e5m2 or e2m1, got " + name);
}

void check(cudaError_t e, const Case& c) {
  if (e != cudaSuccess) die(c.dir + ": launcher returned error " + std::to_string(e));
}

// The case's block layout (its "block" key over its shape) and the number of
// blocks, which sizes the qparam buffers of every blocked op.
BlockLayout case_block_layout(const Case& c, const std::vector<int64_t>& shape, int64_t& nblocks) {
  const std::vector<int64_t> block = c.list("block");
  BlockLayout layout;
  if (!make_block_layout(shape.data(), block.data(), static_cast<int>(shape.size()), layout))
    die(c.dir + ": block layout");
  nblocks = 1;
  for (int d = 0; d < layout.ndim; ++d) nblocks *= (layout.size[d] + layout.block[d] - 1) / layout.block[d];
  return layout;
}

void run_case(const Case& c) {
  const std::string op = c.get("op");
  size_t esize = 0;
  const cuda::ElemType type = elem_type(c.get("dtype"), esize);
  const std::vector<int64_t> shape = c.list("shape");
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  const size_t offset = static_cast<size_t>(c.num("offset"));
  const size_t data_bytes = static_cast<size_t>(numel) * esize;
  const size_t mask_word_bytes = static_cast<size_t>((numel + 31) / 32) * 4;
  const int ndim = static_cast<int>(shape.size());
  const int64_t tail = c.kv.count("tail") ? c.num("tail") : numel;
  const bool sparse = tail < numel;
  const size_t tail_bytes = static_cast<size_t>(tail) * esize;
  const size_t mask_bytes = static_cast<size_t>(packed_mask_bytes(numel));
  const size_t mask_tail_from = static_cast<size_t>((numel - tail) / 8);  // the byte holding the tail's first bit

  if (op == "ste") {
    Buffer dy(data_bytes, offset, sparse), mask(mask_bytes, 0, sparse), dx(data_bytes, offset, sparse);
    load(dy, c.path("dy.bin"), tail_bytes);
    load(mask, c.path("mask.bin"), mask_bytes - mask_tail_from);
    check(cuda::launch_ste_grad(type, dy.data, mask.as<uint8_t>(), dx.data, numel, nullptr), c);
    save(dx.data + (data_bytes - tail_bytes), tail_bytes, c.path("dx.bin"));
    return;
  }

  if (op == "lsq") {  // the learnable op's backward: dx, d scale, d offset
    int64_t nblocks = 0;
    const BlockLayout layout = case_block_layout(c, shape, nblocks);
    const size_t qbytes = static_cast<size_t>(numel > 0 ? nblocks : 0) * 4;
    const bool has_zp = c.num("zp") != 0, has_minval = c.num("minval") != 0;
    Buffer x(data_bytes, offset), dy(data_bytes, offset), dx(data_bytes, offset);
    Buffer scale(qbytes), zp(has_zp ? qbytes : 0), minval(has_minval ? qbytes : 0);
    Buffer dscale(qbytes), doffset(qbytes);
    Buffer scratch(static_cast<size_t>(cuda::learnable_backward_scratch_floats(layout)) * 4);
    load(x, c.path("x.bin"));
    load(dy, c.path("dy.bin"));
    load(scale, c.path("scale.bin"));
    if (has_zp) load(zp, c.path("zp.bin"));
    if (has_minval) load(minval, c.path("minval.bin"));
    const AffineQparams q = make_affine_qparams(scale.as<float>(), has_zp ? zp.as<float>() : nullptr,
                                                has_minval ? minval.as<float>() : nullptr, c.num("qmin"),
                                                c.num("qmax"));
    // grad_factor "lsq": the default, LSQ's per block.
    const std::string gf = c.get("grad_factor");
    const GradFactor grad_factor = gf == "lsq" ? GradFactor{true, 0.0f, c.num("qmax")}
                                               : GradFactor{false, std::stof(gf), c.num("qmax")};
    check(cuda::launch_fake_quantize_affine_learnable_backward(
              type, x.data, dy.data, dx.data, numel, q, layout, has_minval,
              grad_factor, scratch.as<float>(),
              dscale.as<float>(), doffset.as<float>(), nullptr), c);
    save(dx.data, data_bytes, c.path("dx.bin"));
    save(dscale.data, qbytes, c.path("dscale.bin"));
    save(doffset.data, qbytes, c.path("doffset.bin"));
    return;
  }

  if (op == "observe") {  // the fused observe ops: range update, qparams, then y and the mask
    int64_t nblocks = 0;
    const BlockLayout layout = case_block_layout(c, shape, nblocks);
    const size_t qbytes = static_cast<size_t>(nblocks) * 4;
    const bool moving = c.num("moving") != 0;
    const RangeUpdate update{moving, moving ? std::stof(c.get("c")) : 0.0f};
    Buffer x(data_bytes, offset), y(data_bytes, offset), mask(mask_word_bytes);
    Buffer lo(qbytes), hi(qbytes), scale(qbytes), off(qbytes), ioff(qbytes), count(8);
    Buffer scratch(static_cast<size_t>(cuda::observe_scratch_words(nblocks)) * 4);
    load(x, c.path("x.bin"));
    load(lo, c.path("min_val.bin"));
    load(hi, c.path("max_val.bin"));
    load(count, c.path("nonfinite.bin"));
    const std::string kind = c.get("kind");
    if (kind == "affine") {
      const auto scheme = static_cast<AffineScheme>(c.num("scheme"));
      const bool minval = scheme == AffineScheme::kMinval;
      const AffineRangeParams p{scheme, static_cast<int32_t>(c.num("qmin")), static_cast<int32_t>(c.num("qmax")),
                                std::stof(c.get("range_limit"))};
      load(off, c.path("offset.bin"));
      check(cuda::launch_fake_quantize_affine_observe(
                type, x.data, y.data, mask.as<uint32_t>(), numel, layout, nblocks, update, p, lo.as<float>(),
                hi.as<float>(), scale.as<float>(), minval ? nullptr : off.as<int32_t>(),
                minval ? off.as<float>() : nullptr, ioff.as<float>(), count.as<int64_t>(), scratch.as<uint32_t>(),
                nullptr), c);
      save(off.data, qbytes, c.path("offset_out.bin"));
    } else {
      check(cuda::launch_fake_quantize_float_observe(
                type, elem_format(kind), x.data, y.data, mask.as<uint32_t>(), numel, layout, nblocks, update,
                lo.as<float>(), hi.as<float>(), scale.as<float>(), count.as<int64_t>(), scratch.as<uint32_t>(),
                nullptr), c);
    }
    save(y.data, data_bytes, c.path("y.bin"));
    save(mask.data, mask_bytes, c.path("mask.bin"));
    save(lo.data, qbytes, c.path("min_val_out.bin"));
    save(hi.data, qbytes, c.path("max_val_out.bin"));
    save(scale.data, qbytes, c.path("scale_out.bin"));
    save(count.data, 8, c.path("nonfinite_out.bin"));
    return;
  }

  Buffer x(data_bytes, offset, sparse), y(data_bytes, offset, sparse), mask(mask_word_bytes, 0, sparse);
  load(x, c.path("x.bin"), tail_bytes);
  if (op == "affine" || op == "float") {
    int64_t nblocks = 0;
    const BlockLayout layout = case_block_layout(c, shape, nblocks);
    const size_t qbytes = static_cast<size_t>(nblocks) * 4;
    Buffer scale(qbytes);
    load(scale, c.path("scale.bin"));
    if (op == "affine") {
      const bool has_zp = c.num("zp") != 0, has_minval = c.num("minval") != 0;
      Buffer zp(has_zp ? qbytes : 0), minval(has_minval ? qbytes : 0);
      if (has_zp) load(zp, c.path("zp.bin"));
      if (has_minval) load(minval, c.path("minval.bin"));
      const AffineQparams q = make_affine_qparams(
          scale.as<float>(), has_zp ? zp.as<float>() : nullptr,
          has_minval ? minval.as<float>() : nullptr, c.num("qmin"), c.num("qmax"));
      check(cuda::launch_fake_quantize_affine(type, x.data, y.data, mask.as<uint32_t>(), numel, q,
                                              layout, nullptr), c);
    } else {
      check(cuda::launch_fake_quantize_float(type, elem_format(c.get("fmt")), x.data, y.data,
                                             mask.as<uint32_t>(), numel, scale.as<float>(),
                                             layout, nullptr), c);
    }
  } else if (op == "mx" || op == "nvfp4") {
    const int axis = static_cast<int>(c.num("axis"));
    const AxisBlocks A = make_axis_blocks(shape.data(), ndim, axis, op == "mx" ? c.num("block") : 16);
    const size_t scale_bytes = static_cast<size_t>(A.outer * A.blocks_per_axis() * A.inner) * 4;
    Buffer scales(scale_bytes);
    if (op == "mx") {
      check(cuda::launch_fake_quantize_mx(type, elem_format(c.get("fmt")), x.data, y.data,
                                          mask.as<uint32_t>(), scales.as<float>(), A, nullptr), c);
    } else {
      const bool given = c.num("global") != 0;
      Buffer global(4), amax(4);
      if (given) load(global, c.path("global.bin"));
      check(cuda::launch_fake_quantize_nvfp4(type, x.data, y.data, mask.as<uint32_t>(),
                                             scales.as<float>(), global.as<float>(),
                                             given ? nullptr : amax.as<uint32_t>(), A, nullptr), c);
      save(global.data, 4, c.path("global_out.bin"));
    }
    save(scales.data, scale_bytes, c.path("scales.bin"));
  } else {
    die(c.dir + ": unknown op " + op);
  }
  save(y.data + (data_bytes - tail_bytes), tail_bytes, c.path("y.bin"));
  save(mask.data + mask_tail_from, mask_bytes - mask_tail_from, c.path("mask.bin"));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--selftest") return run_selftest(argv[2]);
  if (argc < 2) die("usage: cuda_sim_driver CASE_DIR... | --selftest NAME");
  for (int i = 1; i < argc; ++i) run_case(read_case(argv[i]));
  return 0;
}
