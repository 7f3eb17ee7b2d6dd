#include "quant/row_stack.h"

#include <cassert>
#include <cstring>

namespace gemma4::quant {

namespace {

bool has_scales(WeightFormat format) {
  return format == WeightFormat::kW4G32 || format == WeightFormat::kNVFP4 ||
         format == WeightFormat::kW4G32A || format == WeightFormat::kW8 ||
         format == WeightFormat::kW8A;
}

StackedRows empty_stack(const QMatrix& like, int64_t rows) {
  StackedRows out;
  out.shape = like;
  out.shape.rows = rows;
  out.shape.data = nullptr;
  out.shape.scales = nullptr;
  out.data.resize(static_cast<size_t>(rows * row_data_bytes(like)));
  if (like.scales != nullptr) out.scales.resize(static_cast<size_t>(rows * row_scale_bytes(like)));
  return out;
}

// Copies row `row` of `m` to row `to` of `out`.
void copy_row(const QMatrix& m, int64_t row, StackedRows& out, int64_t to) {
  const int64_t data_bytes = row_data_bytes(m);
  std::memcpy(out.data.data() + to * data_bytes,
              static_cast<const std::byte*>(m.data) + row * data_bytes, data_bytes);
  if (m.scales == nullptr) return;
  const int64_t scale_bytes = row_scale_bytes(m);
  std::memcpy(out.scales.data() + to * scale_bytes,
              static_cast<const std::byte*>(m.scales) + row * scale_bytes, scale_bytes);
}

}  // namespace

bool same_row_encoding(const QMatrix& a, const QMatrix& b) {
  if (a.format != b.format || a.cols != b.cols) return false;
  if ((a.scales == nullptr) != (b.scales == nullptr)) return false;
  if (has_scales(a.format) && a.scale_type != b.scale_type) return false;
  if (a.format == WeightFormat::kW8 && a.group_size != b.group_size) return false;
  if (a.format == WeightFormat::kNVFP4 &&
      (a.nv_global.value != b.nv_global.value || a.nv_global.is_divisor != b.nv_global.is_divisor))
    return false;
  return true;
}

QMatrix StackedRows::view() const {
  QMatrix m = shape;
  m.data = data.data();
  m.scales = scales.empty() ? nullptr : scales.data();
  return m;
}

StackedRows concatenate_rows(std::span<const QMatrix> parts) {
  assert(!parts.empty());
  int64_t rows = 0;
  for (const QMatrix& part : parts) {
    assert(same_row_encoding(part, parts.front()));
    rows += part.rows;
  }
  StackedRows out = empty_stack(parts.front(), rows);
  int64_t to = 0;
  for (const QMatrix& part : parts) {
    for (int64_t r = 0; r < part.rows; ++r) copy_row(part, r, out, to++);
  }
  return out;
}

StackedRows interleave_rows(const QMatrix& a, const QMatrix& b) {
  assert(same_row_encoding(a, b) && a.rows == b.rows);
  StackedRows out = empty_stack(a, 2 * a.rows);
  for (int64_t r = 0; r < a.rows; ++r) {
    copy_row(a, r, out, 2 * r);
    copy_row(b, r, out, 2 * r + 1);
  }
  return out;
}

}  // namespace gemma4::quant
