// Host side of the MoE kernels (moe.h): validation, the per-layer descriptor table, translation
// into the kernels' parameter blocks (moe_kernels.h).
#include "backend/cuda/moe.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "backend/cuda/gemv.h"

namespace gemma4::cuda {
namespace {

using quant::QMatrix;
using quant::WeightFormat;

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// The formats the MoE kernels are compiled for (moe.cu's for_format).
bool moe_format(WeightFormat format, PackedFormat& out) {
  return packed_format(format, out) &&
         (out == PackedFormat::kW4G32 || out == PackedFormat::kNVFP4 || out == PackedFormat::kBF16);
}

MoeMatrix describe(const QMatrix& m) {
  MoeMatrix d;
  d.weights = m.data;
  d.scales = m.scales;
  PackedFormat format = PackedFormat::kBF16;
  moe_format(m.format, format);
  d.chunks_per_row = m.cols / packed_chunk_elements(format);
  d.scale_type = static_cast<int>(m.scale_type);
  d.nv_global = m.nv_global.value;
  d.nv_global_is_divisor = m.nv_global.is_divisor ? 1 : 0;
  return d;
}

// "" if `m` is a [rows, cols] matrix of `format` the kernels can read.
std::string check_matrix(const QMatrix& m, WeightFormat format, int64_t rows, int64_t cols) {
  if (m.format != format) {
    return fmt::format("{} where expert 0 has {}", quant::weight_format_name(m.format),
                       quant::weight_format_name(format));
  }
  if (m.rows != rows || m.cols != cols) {
    return fmt::format("shape [{}, {}], expected [{}, {}]", m.rows, m.cols, rows, cols);
  }
  if (m.data == nullptr || !aligned16(m.data)) return "data missing or not 16-byte aligned";
  if (!packed_scales_ok(m)) return "scales missing";
  return "";
}

bool same_matrix(const MoeMatrix& a, const MoeMatrix& b) {
  return a.weights == b.weights && a.scales == b.scales && a.chunks_per_row == b.chunks_per_row &&
         a.scale_type == b.scale_type && a.nv_global == b.nv_global &&
         a.nv_global_is_divisor == b.nv_global_is_divisor;
}

bool same_descriptors(const std::vector<MoeExpert>& a, const std::vector<MoeExpert>& b) {
  if (a.size() != b.size()) return false;
  for (size_t e = 0; e < a.size(); ++e) {
    if (!same_matrix(a[e].gate, b[e].gate) || !same_matrix(a[e].up, b[e].up) ||
        !same_matrix(a[e].down, b[e].down)) {
      return false;
    }
  }
  return true;
}

std::vector<MoeExpert> describe_all(std::span<const model::ExpertMatrices> experts) {
  std::vector<MoeExpert> descriptors(experts.size());
  for (size_t e = 0; e < experts.size(); ++e) {
    descriptors[e] = {describe(experts[e].gate), describe(experts[e].up),
                      describe(experts[e].down)};
  }
  return descriptors;
}

}  // namespace

std::string check_experts(std::span<const model::ExpertMatrices> experts) {
  if (experts.empty()) return "no experts";
  if (experts.size() > static_cast<size_t>(kMaxRouterExperts)) {
    return fmt::format("{} experts (at most {})", experts.size(), kMaxRouterExperts);
  }
  const QMatrix& gate0 = experts[0].gate;
  const QMatrix& down0 = experts[0].down;
  PackedFormat unused;
  if (!moe_format(gate0.format, unused) || !moe_format(down0.format, unused)) {
    return fmt::format("expert weights in {} / {} (the MoE kernels read w4g32, nvfp4, bf16)",
                       quant::weight_format_name(gate0.format),
                       quant::weight_format_name(down0.format));
  }
  const int64_t inner = gate0.rows;
  const int64_t hidden = gate0.cols;
  if (inner <= 0 || hidden <= 0 || inner % 32 != 0 || hidden % 32 != 0) {
    return fmt::format("expert shape [{}, {}] (both must be positive multiples of 32)", inner,
                       hidden);
  }
  for (size_t e = 0; e < experts.size(); ++e) {
    const std::pair<const char*, std::string> problems[] = {
        {"gate", check_matrix(experts[e].gate, gate0.format, inner, hidden)},
        {"up", check_matrix(experts[e].up, gate0.format, inner, hidden)},
        {"down", check_matrix(experts[e].down, down0.format, hidden, inner)},
    };
    for (const auto& [name, problem] : problems) {
      if (!problem.empty()) return fmt::format("expert {} {}: {}", e, name, problem);
    }
  }
  return "";
}

MoeExpertTable::MoeExpertTable(MoeExpertTable&& other) noexcept {
  *this = std::move(other);
}

MoeExpertTable& MoeExpertTable::operator=(MoeExpertTable&& other) noexcept {
  if (this != &other) {
    cudaFree(device_);
    device_ = std::exchange(other.device_, nullptr);
    shape_ = other.shape_;
    host_ = std::move(other.host_);
  }
  return *this;
}

MoeExpertTable::~MoeExpertTable() {
  cudaFree(device_);
}

cudaError_t MoeExpertTable::create(std::span<const model::ExpertMatrices> experts,
                                   MoeExpertTable& out) {
  if (!check_experts(experts).empty()) return cudaErrorInvalidValue;
  MoeExpertTable table;
  moe_format(experts[0].gate.format, table.shape_.gate_up_format);
  moe_format(experts[0].down.format, table.shape_.down_format);
  table.shape_.num_experts = static_cast<int>(experts.size());
  table.shape_.hidden = experts[0].gate.cols;
  table.shape_.inner = experts[0].gate.rows;
  table.host_ = describe_all(experts);
  const size_t bytes = sizeof(MoeExpert) * table.host_.size();
  void* device = nullptr;
  cudaError_t status = cudaMalloc(&device, bytes);
  if (status != cudaSuccess) return status;
  table.device_ = static_cast<MoeExpert*>(device);
  status = cudaMemcpy(table.device_, table.host_.data(), bytes, cudaMemcpyHostToDevice);
  if (status != cudaSuccess) return status;
  out = std::move(table);
  return cudaSuccess;
}

cudaError_t route_experts(const float* logits, int64_t logits_stride, int tokens, int num_experts,
                          int top_k, const float* per_expert_scale, int32_t* expert_ids,
                          float* weights, const Launch& launch) {
  if (logits == nullptr || per_expert_scale == nullptr || expert_ids == nullptr ||
      weights == nullptr || tokens < 1 || num_experts < 1 || num_experts > kMaxRouterExperts ||
      top_k < 1 || top_k > num_experts || top_k > kMaxTopK || logits_stride < num_experts) {
    return cudaErrorInvalidValue;
  }
  const RouterArgs args = {logits, logits_stride,    tokens,     num_experts,
                           top_k,  per_expert_scale, expert_ids, weights};
  return launch_router(args, launch);
}

cudaError_t route_token(const QMatrix& router_proj, const float* x, bool round_x_to_bf16, int top_k,
                        const float* per_expert_scale, float* logits, int32_t* expert_ids,
                        float* weights, const Launch& launch) {
  const int64_t num_experts = router_proj.rows;
  if (router_proj.format != WeightFormat::kBF16 || router_proj.cols <= 0 ||
      router_proj.cols % 8 != 0 || router_proj.cols > kFusedRouterMaxHidden ||
      !aligned16(router_proj.data) || x == nullptr || !aligned16(x) || num_experts < 1 ||
      num_experts > kMaxRouterExperts || top_k < 1 || top_k > num_experts || top_k > kMaxTopK ||
      per_expert_scale == nullptr || logits == nullptr || expert_ids == nullptr ||
      weights == nullptr) {
    return cudaErrorInvalidValue;
  }
  const FusedRouterArgs args = {router_proj.data,
                                x,
                                router_proj.cols,
                                round_x_to_bf16 ? 1 : 0,
                                static_cast<int>(num_experts),
                                top_k,
                                per_expert_scale,
                                logits,
                                expert_ids,
                                weights};
  return launch_fused_router(args, launch);
}

size_t moe_workspace_bytes(const MoeExpertTable& table, int tokens, int top_k,
                           MoePrecision precision) {
  // A pass of fewer tokens (the last) needs less on the same path; a last pass below the grouped
  // threshold takes the decode paths, whose largest pass is the one just below it.
  const MoeShape& shape = table.shape();
  const int pass = std::min(tokens, kMoeTokensPerPass);
  const size_t bytes =
      moe_workspace_layout(shape, pass, top_k, moe_path_for(shape, pass, precision)).bytes;
  const int below_grouped = std::min(pass, moe_grouped_min_tokens(shape) - 1);
  return std::max(bytes, moe_workspace_layout(shape, below_grouped, top_k,
                                              moe_path_for(shape, below_grouped, precision))
                             .bytes);
}

cudaError_t run_experts(const MoeExpertTable& table, const float* x, int64_t x_stride, int tokens,
                        int top_k, const int32_t* expert_ids, const float* weights, float* out,
                        int64_t out_stride, void* workspace, const Launch& launch,
                        MoePrecision precision) {
  const MoeShape& shape = table.shape();
  const bool shape_ok = table.device() != nullptr && tokens >= 1 && top_k >= 1 &&
                        top_k <= shape.num_experts && top_k <= kMaxTopK &&
                        (tokens == 1 || (x_stride >= shape.hidden && out_stride >= shape.hidden));
  const bool pointers_ok = x != nullptr && aligned16(x) && x_stride % 4 == 0 &&
                           expert_ids != nullptr && weights != nullptr && out != nullptr &&
                           workspace != nullptr && aligned16(workspace);
  if (!shape_ok || !pointers_ok) return cudaErrorInvalidValue;
  for (int first = 0; first < tokens; first += kMoeTokensPerPass) {
    const int count = std::min(kMoeTokensPerPass, tokens - first);
    const int64_t pair = static_cast<int64_t>(first) * top_k;
    const MoeRunArgs args = {
        table.device(),    shape,          x + first * x_stride,
        x_stride,          count,          top_k,
        expert_ids + pair, weights + pair, out + first * out_stride,
        out_stride,        workspace,      moe_path_for(shape, count, precision)};
    const cudaError_t status = launch_moe(args, launch);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

int run_experts_kernel_count(const MoeShape& shape, int tokens, MoePrecision precision) {
  // Per pass: decode path gate/up and down; by expert gate/up, down, combine; grouped path plan,
  // gate/up, down, combine.
  int kernels = 0;
  for (int first = 0; first < tokens; first += kMoeTokensPerPass) {
    const int pass = std::min(kMoeTokensPerPass, tokens - first);
    switch (moe_path_for(shape, pass, precision)) {
      case MoePath::kGrouped:
        kernels += 4;
        break;
      case MoePath::kDecodeByExpert:
        kernels += 3;
        break;
      default:
        kernels += 2;
    }
  }
  return kernels;
}

const MoeExpertTable* cached_expert_table(std::span<const model::ExpertMatrices> experts,
                                          std::string* why) {
  static std::mutex mutex;
  // Tables never move once made (unique_ptr), so returned pointers stay valid.
  static std::map<std::pair<const void*, size_t>, std::unique_ptr<MoeExpertTable>> tables;
  const std::lock_guard lock(mutex);
  // Checked before the cache: descriptors do not record every property check_experts refuses
  // (a format the kernels cannot read may describe like one they can).
  const std::string problem = check_experts(experts);
  if (!problem.empty()) {
    if (why != nullptr) *why = problem;
    return nullptr;
  }
  auto& slot = tables[{experts.data(), experts.size()}];
  if (slot != nullptr && same_descriptors(slot->descriptors(), describe_all(experts))) {
    return slot.get();
  }
  auto table = std::make_unique<MoeExpertTable>();
  const cudaError_t status = MoeExpertTable::create(experts, *table);
  if (status != cudaSuccess) {
    if (why != nullptr)
      *why = fmt::format("uploading the expert table: {}", cudaGetErrorString(status));
    return nullptr;
  }
  // A stale table (same address, other model) is replaced; its old pointer dies with it.
  slot = std::move(table);
  return slot.get();
}

}  // namespace gemma4::cuda
