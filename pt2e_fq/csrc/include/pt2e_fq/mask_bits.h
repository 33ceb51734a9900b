// The clamp mask is stored bit-packed: element i is bit (i % 8) of byte i / 8
// (least significant bit first), ceil(numel / 8) bytes in all. A 32-bit word
// written little-endian holds elements 32w .. 32w+31 in the same order.
#pragma once

#include <cstdint>

namespace pt2e_fq {

constexpr int64_t packed_mask_bytes(int64_t numel) { return (numel + 7) / 8; }

}  // namespace pt2e_fq
