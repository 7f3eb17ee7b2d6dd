// Several weight matrices stacked into one by rows, so a backend reads them in one pass: q|k|v
// projections one after the other, gate/up projections interleaved row by row (the engine's
// fused QKV and gate-up matmuls, engine/resident_weights.h).
//
// Valid because every internal format stores a row n as its own contiguous bytes at
// n * row_data_bytes() in `data` and n * row_scale_bytes() in `scales`, decoded with nothing but
// those bytes and the matrix-wide fields (format, cols, scale_type, group_size, nv_global): a row
// can move to another matrix whose matrix-wide fields are the same. (GGUF super-blocks do not
// have this property across rows either way: quant/gguf_repack turns them into internal formats
// with one row per block row before anything reads them.)
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "quant/qmatrix.h"

namespace gemma4::quant {

// Whether the rows of `a` and `b` decode the same way: same format and columns, and the same
// scale type (formats with scales), group size (kW8) and global factor (kNVFP4).
bool same_row_encoding(const QMatrix& a, const QMatrix& b);

// A stacked matrix held in host memory.
struct StackedRows {
  QMatrix shape;  // format, rows, cols and encoding fields; data and scales unset
  std::vector<std::byte> data;
  std::vector<std::byte> scales;  // empty for formats without scales

  // `shape` pointing at `data` / `scales`.
  QMatrix view() const;
};

// The rows of parts[0], then those of parts[1], ... (all the same encoding: same_row_encoding).
StackedRows concatenate_rows(std::span<const QMatrix> parts);

// Rows a0, b0, a1, b1, ...: a and b have the same encoding and the same number of rows.
StackedRows interleave_rows(const QMatrix& a, const QMatrix& b);

}  // namespace gemma4::quant
