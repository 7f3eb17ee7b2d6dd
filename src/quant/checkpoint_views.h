// QMatrix views over checkpoint tensors, zero-copy, with every shape and dtype validated
// (weight-formats.md 2.2, 3.2, 3.6). A view points into the checkpoint's mapping: keep the
// io::Checkpoint alive while it is used.
//
// `expert`: for stacked tensors ([E, N, K] and their packed/scale companions) the view of slice
// `expert`; without it the tensors must be 2-D (per-tensor factors may then be [] or [1]).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "core/status.h"
#include "io/safetensors.h"
#include "quant/qmatrix.h"

namespace gemma4::quant {

// Plain BF16 / F32 weight [N, K] (or [E, N, K]).
Expected<QMatrix> qmatrix_dense(const io::TensorView& weight,
                                std::optional<int64_t> expert = std::nullopt);

// compressed-tensors pack-quantized int4, symmetric, group 32: `weight_packed` I32 [N, K/8],
// `weight_scale` BF16/F16/F32 [N, K/32], `weight_shape` I64 [2] = [N, K] (stacked: [E, ...] and
// weight_shape [3] = [E, N, K]). Other group sizes are kUnsupported.
Expected<QMatrix> qmatrix_compressed_int4(const io::TensorView& weight_packed,
                                          const io::TensorView& weight_scale,
                                          const io::TensorView& weight_shape,
                                          std::optional<int64_t> expert = std::nullopt);

// compressed-tensors NVFP4: `weight_packed` U8 [N, K/2], `weight_scale` F8_E4M3 [N, K/16],
// `weight_global_scale` F32 [1] (stacked: [E]), a divisor.
Expected<QMatrix> qmatrix_compressed_nvfp4(const io::TensorView& weight_packed,
                                           const io::TensorView& weight_scale,
                                           const io::TensorView& weight_global_scale,
                                           std::optional<int64_t> expert = std::nullopt);

// ModelOpt NVFP4: `weight` U8 [N, K/2], `weight_scale` F8_E4M3 [N, K/16], `weight_scale_2` F32
// [] or [1] (stacked: [E]), a multiplier.
Expected<QMatrix> qmatrix_modelopt_nvfp4(const io::TensorView& weight,
                                         const io::TensorView& weight_scale,
                                         const io::TensorView& weight_scale_2,
                                         std::optional<int64_t> expert = std::nullopt);

// Finds a tensor by its full name (e.g. bound to io::Checkpoint::find).
using TensorLookup = std::function<const io::TensorView*(std::string_view name)>;

// The view of the linear weight named `base` (e.g. "model.layers.0.mlp.down_proj"), its layout
// chosen by which tensors exist (spec 2.1: never by re-matching the config's regexes):
//   <base>.weight_packed I32        -> compressed-tensors int4 (needs weight_scale, weight_shape;
//                                      weight_zero_point / weight_g_idx -> kUnsupported)
//   <base>.weight_packed U8         -> compressed-tensors NVFP4 (weight_scale, weight_global_scale)
//   <base>.weight U8 + .weight_scale -> ModelOpt NVFP4 (weight_scale_2)
//   <base>.weight                   -> dense
//   <base> itself                   -> dense (fused 3-D expert parameters: experts.down_proj)
// kNotFound when none exists.
Expected<QMatrix> qmatrix_from_tensors(const TensorLookup& find, std::string_view base,
                                       std::optional<int64_t> expert = std::nullopt);

}  // namespace gemma4::quant
