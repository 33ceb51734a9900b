// Where each element of x finds its scale, for any block granularity.
//
// x has shape `size` and is cut into blocks of `block` elements per dimension
// (the last block of a dimension may be shorter). Scale, zero point and minval
// are contiguous tensors of shape ceil(size / block). We first canonicalise:
// size-1 dimensions are dropped and neighbours are merged where the merged
// dimension indexes the scale the same way, so per-tensor becomes one
// dimension and per-channel at most three. Kernels then decompose a flat
// element index over few dimensions.
#pragma once

#include <cstdint>

#include "pt2e_fq/float_ops.h"

namespace pt2e_fq {

constexpr int kMaxLayoutDims = 16;

struct BlockLayout {
  int ndim = 0;
  int64_t numel = 1;
  int64_t size[kMaxLayoutDims];
  int64_t block[kMaxLayoutDims];
  int64_t scale_stride[kMaxLayoutDims];  // element stride in the contiguous scale
};

// Returns false when the canonical form needs more than kMaxLayoutDims.
inline bool make_block_layout(const int64_t* shape, const int64_t* block, int ndim,
                              BlockLayout& out) {
  BlockLayout L;
  for (int d = 0; d < ndim; ++d) L.numel *= shape[d];
  for (int d = 0; d < ndim && L.numel > 0; ++d) {
    // An empty x keeps no dimension: a size-0 one would give a block of 0
    // below, and the kernels divide by blocks. It has no blocks either
    // (ceil(0 / block) = 0), which the fallback layout below also says.
    if (shape[d] == 1) continue;
    const int64_t b = block[d] < shape[d] ? block[d] : shape[d];
    if (L.ndim > 0) {
      const int p = L.ndim - 1;
      // Appending a full-block dimension: index along the merged dimension
      // divided by (block_p * shape_d) equals index_p / block_p.
      if (b == shape[d]) {
        L.size[p] *= shape[d];
        L.block[p] *= shape[d];
        continue;
      }
      // Two per-element dimensions merge into one per-element dimension.
      if (b == 1 && L.block[p] == 1) {
        L.size[p] *= shape[d];
        continue;
      }
    }
    if (L.ndim == kMaxLayoutDims) return false;
    L.size[L.ndim] = shape[d];
    L.block[L.ndim] = b;
    ++L.ndim;
  }
  if (L.ndim == 0) {  // a single element, every dimension of size 1, or empty
    L.ndim = 1;
    L.size[0] = L.numel;
    L.block[0] = L.numel > 0 ? L.numel : 1;
  }
  int64_t stride = 1;
  for (int d = L.ndim - 1; d >= 0; --d) {
    L.scale_stride[d] = stride;
    stride *= (L.size[d] + L.block[d] - 1) / L.block[d];
  }
  out = L;
  return true;
}

// Scale offset of the first element of `row`, where a row is one run of the
// last canonical dimension.
PT2E_FQ_HD int64_t row_scale_offset(const BlockLayout& L, int64_t row) {
  int64_t off = 0;
  for (int d = L.ndim - 2; d >= 0; --d) {
    const int64_t idx = row % L.size[d];
    row /= L.size[d];
    off += (idx / L.block[d]) * L.scale_stride[d];
  }
  return off;
}

PT2E_FQ_HD int64_t scale_offset(const BlockLayout& L, int64_t i) {
  const int last = L.ndim - 1;
  const int64_t col = i % L.size[last];
  return row_scale_offset(L, i / L.size[last]) + col / L.block[last];
}

// The number of elements of block b (b: its flat index in the contiguous
// scale): the product of its extents, the last block of a dimension being
// shorter where the block does not divide the size (ragged).
PT2E_FQ_HD int64_t block_numel_at(const BlockLayout& L, int64_t b) {
  int64_t n = 1;
  for (int d = 0; d < L.ndim; ++d) {
    const int64_t nblk = (L.size[d] + L.block[d] - 1) / L.block[d];
    const int64_t left = L.size[d] - (b / L.scale_stride[d]) % nblk * L.block[d];
    n *= left < L.block[d] ? left : L.block[d];
  }
  return n;
}

// The layout of the dynamic block-scaled formats (MX, NVFP4): x seen as
// [outer, len, inner], cut into blocks of `block` consecutive elements along
// len (the quantization axis); the last block of each run may be shorter.
// The block scales are contiguous with shape [outer, ceil(len / block), inner].
struct AxisBlocks {
  int64_t outer, len, inner, block;
  PT2E_FQ_HD int64_t blocks_per_axis() const { return (len + block - 1) / block; }
};

// x of `shape` (ndim dimensions) as blocks of `block` along dimension `axis`
// (0 <= axis < ndim): the dimensions before it are `outer`, after it `inner`.
inline AxisBlocks make_axis_blocks(const int64_t* shape, int ndim, int axis, int64_t block) {
  AxisBlocks A{1, shape[axis], 1, block};
  for (int d = 0; d < axis; ++d) A.outer *= shape[d];
  for (int d = axis + 1; d < ndim; ++d) A.inner *= shape[d];
  return A;
}

}  // namespace pt2e_fq
