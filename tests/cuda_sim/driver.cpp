// Runs the CUDA kernels' launchers (kernels.h) in the simulation harness on
// cases written by tests/test_cuda_sim.py: one directory per case, holding
// case.txt (key=value lines) and the inputs as raw little-endian arrays; the
// outputs are written beside them. Every buffer is its own allocation of
// exactly the bytes the binding allocates, so AddressSanitizer stops an
// access past either end. `offset` (bytes) shifts x / dy and y / dx off
// malloc's 16-byte alignment, as a tensor view at an odd offset would.
//
//   cuda_sim_driver CASE_DIR...        exit 0, or a message and exit != 0
//   cuda_sim_driver --selftest NAME    a kernel with undefined behaviour
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

// A heap buffer of exactly `bytes` (plus `offset` in front), filled from a file or zeroed.
struct Buffer {
  char* base = nullptr;
  char* data = nullptr;
  size_t bytes = 0;
  Buffer(size_t n, size_t offset = 0) : bytes(n) {
    base = static_cast<char*>(std::malloc(n + offset + 1));  // +1: malloc(0) may return null
    data = base + offset;
    std::memset(base, 0, n + offset + 1);
  }
  Buffer(const Buffer&) = delete;
  ~Buffer() { std::free(base); }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data);
  }
};

void load(Buffer& b, const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) die(file + ": cannot read");
  in.read(b.data, static_cast<std::streamsize>(b.bytes));
  if (static_cast<size_t>(in.gcount()) != b.bytes) die(file + ": shorter than " + std::to_string(b.bytes) + " bytes");
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

  if (op == "ste") {
    Buffer dy(data_bytes, offset), mask(static_cast<size_t>(packed_mask_bytes(numel))),
        dx(data_bytes, offset);
    load(dy, c.path("dy.bin"));
    load(mask, c.path("mask.bin"));
    check(cuda::launch_ste_grad(type, dy.data, mask.as<uint8_t>(), dx.data, numel, nullptr), c);
    save(dx.data, data_bytes, c.path("dx.bin"));
    return;
  }

  Buffer x(data_bytes, offset), y(data_bytes, offset), mask(mask_word_bytes);
  load(x, c.path("x.bin"));
  if (op == "affine" || op == "float") {
    const std::vector<int64_t> block = c.list("block");
    BlockLayout layout;
    if (!make_block_layout(shape.data(), block.data(), ndim, layout)) die(c.dir + ": block layout");
    int64_t nblocks = 1;
    for (int d = 0; d < layout.ndim; ++d) nblocks *= (layout.size[d] + layout.block[d] - 1) / layout.block[d];
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
  save(y.data, data_bytes, c.path("y.bin"));
  save(mask.data, static_cast<size_t>(packed_mask_bytes(numel)), c.path("mask.bin"));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--selftest") return run_selftest(argv[2]);
  if (argc < 2) die("usage: cuda_sim_driver CASE_DIR... | --selftest NAME");
  for (int i = 1; i < argc; ++i) run_case(read_case(argv[i]));
  return 0;
}
