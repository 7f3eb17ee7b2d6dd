#include "quant/checkpoint_views.h"

#include <cmath>
#include <cstring>
#include <string>

namespace gemma4::quant {
namespace {

using io::TensorView;

Error tensor_error(ErrorCode code, const TensorView& tensor, std::string_view why) {
  return make_error(code, "tensor '{}' ({} {}): {}", tensor.name, dtype_name(tensor.dtype),
                    io::shape_string(tensor.shape), why);
}

// The [rows, cols] matrix of `tensor` (slice `expert` of a 3-D one): checks the rank and the
// expert index, returns {rows, cols, byte offset of the slice}.
struct MatrixShape {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t slice_index = 0;  // 0 without expert
};

Expected<MatrixShape> matrix_shape(const TensorView& tensor, std::optional<int64_t> expert) {
  const size_t want_rank = expert ? 3 : 2;
  if (tensor.shape.size() != want_rank) {
    return tensor_error(
        ErrorCode::kInvalidArgument, tensor,
        expert ? "expected a 3-D [E, N, K] tensor for an expert slice" : "expected a 2-D matrix");
  }
  MatrixShape shape;
  shape.rows = tensor.shape[want_rank - 2];
  shape.cols = tensor.shape[want_rank - 1];
  if (expert) {
    if (*expert < 0 || *expert >= tensor.shape[0]) {
      return tensor_error(ErrorCode::kOutOfRange, tensor,
                          fmt::format("expert {} out of range", *expert));
    }
    shape.slice_index = *expert;
  }
  if (shape.rows <= 0 || shape.cols <= 0) {
    return tensor_error(ErrorCode::kInvalidArgument, tensor, "empty matrix");
  }
  return shape;
}

const std::byte* slice_data(const TensorView& tensor, const MatrixShape& shape) {
  const size_t slice_bytes = tensor.nbytes / (tensor.shape.size() == 3 ? tensor.shape[0] : 1);
  return tensor.data + shape.slice_index * slice_bytes;
}

Status expect_dtype(const TensorView& tensor, DType dtype) {
  if (tensor.dtype == dtype) return {};
  return tensor_error(ErrorCode::kInvalidArgument, tensor,
                      fmt::format("expected dtype {}", dtype_name(dtype)));
}

Status expect_matrix(const TensorView& tensor, const MatrixShape& got, int64_t rows, int64_t cols,
                     std::string_view what) {
  if (got.rows == rows && got.cols == cols) return {};
  return tensor_error(ErrorCode::kInvalidArgument, tensor,
                      fmt::format("{} must be [{}, {}]", what, rows, cols));
}

// A per-tensor fp32 factor: [] or [1], or [E] for stacked experts (one per expert).
Expected<float> per_tensor_factor(const TensorView& tensor, std::optional<int64_t> expert) {
  GEMMA4_RETURN_IF_ERROR(expect_dtype(tensor, DType::kF32));
  int64_t index = 0;
  const int64_t count = tensor.numel();
  const bool single = tensor.shape.size() <= 1 && count == 1;
  if (expert && !single) {
    if (tensor.shape.size() != 1 || *expert >= count) {
      return tensor_error(ErrorCode::kInvalidArgument, tensor,
                          fmt::format("expected [1] or one value per expert (expert {})", *expert));
    }
    index = *expert;
  } else if (!single) {
    return tensor_error(ErrorCode::kInvalidArgument, tensor, "expected a single value");
  }
  float value = 0.0f;
  std::memcpy(&value, tensor.data + index * 4, 4);
  if (!std::isfinite(value) || value <= 0.0f) {
    return tensor_error(ErrorCode::kInvalidArgument, tensor,
                        fmt::format("value {} is not a positive finite number", value));
  }
  return value;
}

// Shared by both NVFP4 flavours: packed U8 [N, K/2] and e4m3 scales [N, K/16].
Expected<QMatrix> nvfp4_view(const TensorView& packed, const TensorView& scale,
                             std::optional<int64_t> expert) {
  GEMMA4_RETURN_IF_ERROR(expect_dtype(packed, DType::kU8));
  GEMMA4_ASSIGN_OR_RETURN(MatrixShape packed_shape, matrix_shape(packed, expert));
  if (scale.dtype == DType::kU8 && scale.shape.size() == 1) {
    return tensor_error(ErrorCode::kUnsupported, scale,
                        "1-D U8 block scales are TensorRT-LLM's swizzled layout");
  }
  GEMMA4_RETURN_IF_ERROR(expect_dtype(scale, DType::kF8E4M3));
  GEMMA4_ASSIGN_OR_RETURN(MatrixShape scale_shape, matrix_shape(scale, expert));
  const int64_t k = packed_shape.cols * 2;
  if (k % 16 != 0) {
    return tensor_error(ErrorCode::kUnsupported, packed,
                        fmt::format("K = {} is not a multiple of the 16-element block", k));
  }
  GEMMA4_RETURN_IF_ERROR(
      expect_matrix(scale, scale_shape, packed_shape.rows, k / 16, "block scales [N, K/16]"));
  if (expert && scale.shape[0] != packed.shape[0]) {
    return tensor_error(ErrorCode::kInvalidArgument, scale,
                        fmt::format("expert count differs from '{}'", packed.name));
  }
  QMatrix m;
  m.format = WeightFormat::kNVFP4;
  m.rows = packed_shape.rows;
  m.cols = k;
  m.data = slice_data(packed, packed_shape);
  m.scales = slice_data(scale, scale_shape);
  return m;
}

}  // namespace

Expected<QMatrix> qmatrix_dense(const TensorView& weight, std::optional<int64_t> expert) {
  GEMMA4_ASSIGN_OR_RETURN(MatrixShape shape, matrix_shape(weight, expert));
  QMatrix m;
  switch (weight.dtype) {
    case DType::kBF16:
      m.format = WeightFormat::kBF16;
      break;
    case DType::kF32:
      m.format = WeightFormat::kF32;
      break;
    default:
      return tensor_error(ErrorCode::kUnsupported, weight, "dense weights must be BF16 or F32");
  }
  m.rows = shape.rows;
  m.cols = shape.cols;
  m.data = slice_data(weight, shape);
  return m;
}

Expected<QMatrix> qmatrix_compressed_int4(const TensorView& weight_packed,
                                          const TensorView& weight_scale,
                                          const TensorView& weight_shape,
                                          std::optional<int64_t> expert) {
  GEMMA4_RETURN_IF_ERROR(expect_dtype(weight_packed, DType::kI32));
  GEMMA4_ASSIGN_OR_RETURN(MatrixShape packed_shape, matrix_shape(weight_packed, expert));

  // weight_shape holds the logical [N, K] ([E, N, K] when stacked).
  GEMMA4_RETURN_IF_ERROR(expect_dtype(weight_shape, DType::kI64));
  const size_t rank = expert ? 3 : 2;
  if (weight_shape.shape.size() != 1 || weight_shape.shape[0] != static_cast<int64_t>(rank)) {
    return tensor_error(ErrorCode::kInvalidArgument, weight_shape,
                        fmt::format("expected [{}] (the logical shape)", rank));
  }
  int64_t logical[3] = {};
  std::memcpy(logical, weight_shape.data, rank * 8);
  const int64_t n = logical[rank - 2];
  const int64_t k = logical[rank - 1];
  if (n != packed_shape.rows || k <= 0 || (k + 7) / 8 != packed_shape.cols ||
      (expert && logical[0] != weight_packed.shape[0])) {
    return tensor_error(ErrorCode::kInvalidArgument, weight_packed,
                        fmt::format("does not hold the logical shape {} from '{}'",
                                    io::shape_string(std::span(logical, rank)), weight_shape.name));
  }
  if (k % 32 != 0) {
    return tensor_error(ErrorCode::kUnsupported, weight_packed,
                        fmt::format("K = {} is not a multiple of the 32-element group", k));
  }

  QMatrix m;
  switch (weight_scale.dtype) {
    case DType::kBF16:
      m.scale_type = ScaleType::kBF16;
      break;
    case DType::kF16:
      m.scale_type = ScaleType::kF16;
      break;
    case DType::kF32:
      m.scale_type = ScaleType::kF32;
      break;
    default:
      return tensor_error(ErrorCode::kUnsupported, weight_scale, "scales must be BF16, F16 or F32");
  }
  GEMMA4_ASSIGN_OR_RETURN(MatrixShape scale_shape, matrix_shape(weight_scale, expert));
  if (scale_shape.rows == n && scale_shape.cols != k / 32 && k % scale_shape.cols == 0) {
    return tensor_error(ErrorCode::kUnsupported, weight_scale,
                        fmt::format("group size {} (only 32 is supported)", k / scale_shape.cols));
  }
  GEMMA4_RETURN_IF_ERROR(
      expect_matrix(weight_scale, scale_shape, n, k / 32, "group scales [N, K/32]"));
  if (expert && weight_scale.shape[0] != weight_packed.shape[0]) {
    return tensor_error(ErrorCode::kInvalidArgument, weight_scale,
                        fmt::format("expert count differs from '{}'", weight_packed.name));
  }
  m.format = WeightFormat::kW4G32;
  m.rows = n;
  m.cols = k;
  m.data = slice_data(weight_packed, packed_shape);
  m.scales = slice_data(weight_scale, scale_shape);
  return m;
}

Expected<QMatrix> qmatrix_compressed_nvfp4(const TensorView& weight_packed,
                                           const TensorView& weight_scale,
                                           const TensorView& weight_global_scale,
                                           std::optional<int64_t> expert) {
  GEMMA4_ASSIGN_OR_RETURN(QMatrix m, nvfp4_view(weight_packed, weight_scale, expert));
  GEMMA4_ASSIGN_OR_RETURN(const float divisor, per_tensor_factor(weight_global_scale, expert));
  m.nv_global = NvGlobalScale{divisor, /*is_divisor=*/true};
  return m;
}

Expected<QMatrix> qmatrix_modelopt_nvfp4(const TensorView& weight, const TensorView& weight_scale,
                                         const TensorView& weight_scale_2,
                                         std::optional<int64_t> expert) {
  GEMMA4_ASSIGN_OR_RETURN(QMatrix m, nvfp4_view(weight, weight_scale, expert));
  GEMMA4_ASSIGN_OR_RETURN(const float multiplier, per_tensor_factor(weight_scale_2, expert));
  m.nv_global = NvGlobalScale{multiplier, /*is_divisor=*/false};
  return m;
}

Expected<QMatrix> qmatrix_from_tensors(const TensorLookup& find, std::string_view base,
                                       std::optional<int64_t> expert) {
  const std::string prefix(base);
  auto lookup = [&](std::string_view suffix) { return find(prefix + std::string(suffix)); };
  auto require = [&](std::string_view suffix) -> Expected<const TensorView*> {
    const TensorView* tensor = lookup(suffix);
    if (tensor == nullptr) {
      return make_error(ErrorCode::kNotFound, "tensor '{}{}' is missing", prefix, suffix);
    }
    return tensor;
  };

  if (const TensorView* packed = lookup(".weight_packed")) {
    for (std::string_view unsupported : {".weight_zero_point", ".weight_g_idx"}) {
      if (lookup(unsupported) != nullptr) {
        return make_error(ErrorCode::kUnsupported,
                          "tensor '{}{}': asymmetric or activation-ordered (actorder/g_idx) "
                          "compressed-tensors weights are not supported",
                          prefix, unsupported);
      }
    }
    GEMMA4_ASSIGN_OR_RETURN(const TensorView* scale, require(".weight_scale"));
    if (packed->dtype == DType::kU8) {
      GEMMA4_ASSIGN_OR_RETURN(const TensorView* global, require(".weight_global_scale"));
      return qmatrix_compressed_nvfp4(*packed, *scale, *global, expert);
    }
    GEMMA4_ASSIGN_OR_RETURN(const TensorView* shape, require(".weight_shape"));
    return qmatrix_compressed_int4(*packed, *scale, *shape, expert);
  }
  if (const TensorView* weight = lookup(".weight")) {
    if (weight->dtype == DType::kU8 && lookup(".weight_scale") != nullptr) {
      GEMMA4_ASSIGN_OR_RETURN(const TensorView* scale_2, require(".weight_scale_2"));
      return qmatrix_modelopt_nvfp4(*weight, *lookup(".weight_scale"), *scale_2, expert);
    }
    return qmatrix_dense(*weight, expert);
  }
  if (const TensorView* fused = lookup("")) return qmatrix_dense(*fused, expert);
  return make_error(ErrorCode::kNotFound,
                    "no weight tensors for '{}' ({}.weight, {}.weight_packed)", prefix, prefix,
                    prefix);
}

}  // namespace gemma4::quant
