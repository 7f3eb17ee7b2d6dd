#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <tuple>

#include "backend/cuda/attention.h"
#include "backend/cuda/backend_kernels.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/fused_ops.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/prefill_kernels.h"
#include "backend/cuda/prefill_matmul.h"
#include "quant/qmatrix.h"

namespace gemma4::cuda {

using engine::Rows;
using quant::WeightFormat;

static_assert(static_cast<int>(WeightFormat::kF32) == static_cast<int>(MatrixFormat::kF32) &&
              static_cast<int>(WeightFormat::kBF16) == static_cast<int>(MatrixFormat::kBF16) &&
              static_cast<int>(WeightFormat::kW4G32) == static_cast<int>(MatrixFormat::kW4G32) &&
              static_cast<int>(WeightFormat::kNVFP4) == static_cast<int>(MatrixFormat::kNVFP4) &&
              static_cast<int>(WeightFormat::kW4G32A) == static_cast<int>(MatrixFormat::kW4G32A) &&
              static_cast<int>(WeightFormat::kW8) == static_cast<int>(MatrixFormat::kW8) &&
              static_cast<int>(WeightFormat::kF16) == static_cast<int>(MatrixFormat::kF16) &&
              static_cast<int>(WeightFormat::kW8A) == static_cast<int>(MatrixFormat::kW8A));

namespace {

// The packed GEMV handles up to this many activation rows per launch.
constexpr int64_t kMaxGemvRows = 64;
// decode_attention runs two blocks per SM: a launch's (sequence, kv head, split) blocks stop at
// about two per SM of the H200's 132, one wave, so a batch takes fewer splits each and the
// partials stay small.
constexpr int64_t kMaxAttentionBlocks = 2 * 132;

// Splits for caches of up to `slots` slots, each of at least kMinKeysPerSplit keys: chosen by
// capacity, since one recording replays at every depth (the kernel leaves the splits a shallow
// cache does not need after reading the query position).
int attention_splits(int64_t slots, int64_t sequences, int kv_heads) {
  const int64_t budget = std::max<int64_t>(1, kMaxAttentionBlocks / (sequences * kv_heads));
  return static_cast<int>(
      std::clamp<int64_t>((slots + kMinKeysPerSplit - 1) / kMinKeysPerSplit, 1, budget));
}

RowsView view(const Rows& r) {
  return {r.data, r.count, r.width, r.stride};
}

KvSlots slots(const engine::KvView& kv) {
  return {kv.keys, kv.values, kv.slot_positions, kv.slots, kv.kv_heads, kv.head_dim};
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace

CudaBackend::CudaBackend(int device, bool pdl) : device_(device), pdl_(pdl) {
  check(cudaSetDevice(device_), "selecting the GPU");
  if (status_.ok()) check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (Scratch* s : {&attention_partials_, &expert_workspace_, &pair_products_}) {
    cudaFree(s->data);
  }
  for (const Scratch& s : retired_scratch_) cudaFree(s.data);
  cublas_.reset();  // before its stream goes
  for (Scratch* s : {&prefill_activations_, &prefill_weights_}) cudaFree(s->data);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CudaBackend::fail(ErrorCode code, std::string message) {
  if (status_.ok()) status_ = Error{code, std::move(message)};
}

void CudaBackend::check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  if (status == cudaErrorInvalidValue) {
    // Our own kernels' argument checks: a shape, format or alignment they do not take.
    fail(ErrorCode::kInternal,
         fmt::format("CUDA backend: {}: arguments rejected (shape, format or alignment)", what));
  } else {
    fail(ErrorCode::kInternal, fmt::format("CUDA backend: {} on GPU {}: {} ({})", what, device_,
                                           cudaGetErrorString(status), cudaGetErrorName(status)));
  }
}

void CudaBackend::launched(cudaError_t status, const char* what, int kernels) {
  check(status, what);
  if (status == cudaSuccess) kernels_ += kernels;
}

Launch CudaBackend::launch() {
  cudaSetDevice(device_);
  return {stream_, pdl_};
}

void* CudaBackend::scratch(Scratch& s, size_t bytes) {
  if (bytes <= s.bytes) return s.data;
  launch();
  check(cudaStreamSynchronize(stream_), "scratch resize");
  if (recorded_) {
    retired_scratch_.push_back(s);
  } else {
    cudaFree(s.data);
  }
  s = {};
  const cudaError_t status = cudaMalloc(&s.data, bytes);
  if (status != cudaSuccess) {
    s.data = nullptr;
    fail(ErrorCode::kResourceExhausted,
         fmt::format("CUDA backend: no {} bytes of scratch on GPU {}: {}", bytes, device_,
                     cudaGetErrorString(status)));
    return nullptr;
  }
  s.bytes = bytes;
  return s.data;
}

engine::Buffer CudaBackend::allocate(size_t bytes) {
  launch();
  void* data = nullptr;
  const cudaError_t status = cudaMalloc(&data, std::max<size_t>(bytes, 1));
  if (status != cudaSuccess) {
    cudaGetLastError();  // the failed allocation leaves nothing sticky behind
    fail(ErrorCode::kResourceExhausted,
         fmt::format("out of GPU memory: cudaMalloc of {} bytes on GPU {} failed ({})", bytes,
                     device_, cudaGetErrorString(status)));
    return {};
  }
  check(cudaMemsetAsync(data, 0, bytes, stream_), "allocate (zero fill)");
  return engine::Buffer(data, bytes, [](void* p) { cudaFree(p); });
}

void CudaBackend::upload(void* dst, const void* src, size_t bytes) {
  // From pageable memory the copy returns once `src` is staged: the caller may reuse it.
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, launch().stream), "upload");
}

void CudaBackend::download(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, launch().stream), "download");
  check(cudaStreamSynchronize(stream_), "download (synchronize)");
}

namespace {

// An instantiated graph and how many kernels it launches (kernels_launched counts replays).
class CudaGraph final : public engine::RecordedWork {
 public:
  CudaGraph(cudaGraphExec_t exec, int64_t kernels) : exec_(exec), kernels_(kernels) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  cudaGraphExec_t exec() const { return exec_; }
  int64_t kernels() const { return kernels_; }

 private:
  cudaGraphExec_t exec_;
  int64_t kernels_;
};

}  // namespace

std::unique_ptr<engine::RecordedWork> CudaBackend::record(const std::function<void()>& enqueue) {
  if (!status_.ok()) return nullptr;
  launch();
  check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin graph capture");
  if (!status_.ok()) return nullptr;
  const int64_t kernels_before = kernels_;
  enqueue();
  // Captured kernels did not run: replays count them.
  const int64_t captured_kernels = kernels_ - kernels_before;
  kernels_ = kernels_before;
  cudaGraph_t graph = nullptr;
  check(cudaStreamEndCapture(stream_, &graph), "end graph capture");
  cudaGraphExec_t exec = nullptr;
  if (status_.ok()) check(cudaGraphInstantiate(&exec, graph, 0), "graph instantiation");
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!status_.ok()) {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    return nullptr;
  }
  recorded_ = true;
  return std::make_unique<CudaGraph>(exec, captured_kernels);
}

void CudaBackend::replay(engine::RecordedWork& work) {
  auto& graph = static_cast<CudaGraph&>(work);
  launched(cudaGraphLaunch(graph.exec(), launch().stream), "graph replay",
           static_cast<int>(graph.kernels()));
}

namespace {

// quant::QMatrix → the generic kernels' view (embedding, the fallback matmul); false for a
// format with no CUDA kernel.
bool matrix_view(const quant::QMatrix& m, MatrixView& out) {
  switch (m.format) {
    case WeightFormat::kF32:
    case WeightFormat::kBF16:
    case WeightFormat::kW4G32:
    case WeightFormat::kNVFP4:
    case WeightFormat::kW4G32A:
    case WeightFormat::kW8:
    case WeightFormat::kF16:
    case WeightFormat::kW8A:
      out = {static_cast<MatrixFormat>(m.format),
             m.rows,
             m.cols,
             m.data,
             m.scales,
             static_cast<int>(m.scale_type),
             m.nv_global.value,
             m.nv_global.is_divisor ? 1 : 0,
             m.group_size};
      return true;
  }
  return false;
}

}  // namespace

void CudaBackend::embed(const quant::QMatrix& table, const int32_t* ids, float scale, Rows out) {
  if (out.count == 0) return;
  MatrixView view_of_table;
  if (!matrix_view(table, view_of_table)) {
    fail(ErrorCode::kUnsupported, fmt::format("CUDA backend: no embedding kernel for {} tables",
                                              quant::weight_format_name(table.format)));
    return;
  }
  launched(embed_rows(view_of_table, ids, scale, view(out), launch()), "embed");
}

bool CudaBackend::packed_gemv(const quant::QMatrix& w, Rows x, const GemvOutput& out,
                              const char* what) {
  // The GEMV rejects what it has no kernel for (fp32 weights, K % 32 != 0, unaligned rows)
  // before enqueuing anything; every slice has the first one's shape and alignment.
  for (int64_t done = 0; done < x.count; done += kMaxGemvRows) {
    const int64_t rows = std::min(kMaxGemvRows, x.count - done);
    const GemvInput input = {x.row(done), ActType::kF32, static_cast<int>(rows), x.stride,
                             !fp32_activations_};
    GemvOutput slice = out;
    slice.data += done * out.stride;
    if (slice.multiplier != nullptr) slice.multiplier += done * out.multiplier_stride;
    const cudaError_t status = gemv(w, input, slice, launch());
    if (status == cudaErrorInvalidValue && done == 0) return false;
    launched(status, what);
    if (status != cudaSuccess) break;
  }
  return true;
}

void CudaBackend::matmul(const quant::QMatrix& w, Rows x, Rows y) {
  if (x.count == 0) return;
  if (MatrixView weights; tensor_core_rows(x.count) && matrix_view(w, weights) &&
                          tensor_core_matmul_accepts(weights, view(x), view(y))) {
    tensor_core_matmul(weights, view(x), view(y));
    return;
  }
  if (packed_gemv(w, x, {y.data, y.stride}, "matmul (gemv)")) return;
  MatrixView weights;
  if (!matrix_view(w, weights)) {
    fail(ErrorCode::kUnsupported, fmt::format("CUDA backend: no matmul kernel for {} weights",
                                              quant::weight_format_name(w.format)));
    return;
  }
  launched(matmul_rows(weights, view(x), view(y), launch()), "matmul");
}

// Where matmul would take the GEMV (decode passes, fp32 prefill), the gating rides in its
// epilogue. Tensor-core passes, and weights or rows the GEMV does not take: matmul, then the
// gating.
void CudaBackend::matmul_gelu_mul(const quant::QMatrix& w, Rows x, Rows multiplier, Rows y) {
  if (x.count == 0) return;
  const GemvOutput gated = {y.data, y.stride, GemvEpilogue::kGeluMul, multiplier.data,
                            multiplier.stride};
  if (tensor_core_rows(x.count) || !packed_gemv(w, x, gated, "matmul_gelu_mul (gemv)")) {
    Backend::matmul_gelu_mul(w, x, multiplier, y);  // matmul, then gelu_tanh_mul
  }
}

void CudaBackend::matmul_gelu_pairs(const quant::QMatrix& w, Rows x, Rows y) {
  if (x.count == 0) return;
  const GemvOutput pairs = {y.data, y.stride, GemvEpilogue::kGeluPairs};
  if (!tensor_core_rows(x.count) && packed_gemv(w, x, pairs, "matmul_gelu_pairs (gemv)")) return;
  auto* products = static_cast<float*>(
      scratch(pair_products_, sizeof(float) * static_cast<size_t>(x.count * w.rows)));
  if (products == nullptr) return;
  matmul(w, x, {products, x.count, w.rows, w.rows});
  launched(gemv_epilogue(products, x.count, w.rows, w.rows, pairs, launch()),
           "matmul_gelu_pairs (epilogue)");
}

void CudaBackend::rms_norm(Rows x, const float* weight, float weight_offset, float eps, Rows y) {
  if (x.count == 0) return;
  launched(cuda::rms_norm(view(x), weight, weight_offset, eps, view(y), nullptr, launch()),
           "rms_norm");
}

const float* CudaBackend::rope_table(const model::RopeParams& rope, int head_dim) {
  const auto key =
      std::make_tuple(rope.theta, rope.rotated_pairs, rope.exponent_denominator, head_dim);
  auto table = rope_tables_.find(key);
  if (table == rope_tables_.end()) {
    // Once per (rope, head_dim): a static device table, so graphs can capture the kernels.
    const std::vector<float> inv_freq = engine::rope_inverse_frequencies(rope, head_dim);
    engine::Buffer buffer = allocate(sizeof(float) * inv_freq.size());
    if (buffer.data() == nullptr) return nullptr;
    upload(buffer.data(), inv_freq.data(), sizeof(float) * inv_freq.size());
    table = rope_tables_.emplace(key, std::move(buffer)).first;
  }
  return table->second.floats();
}

void CudaBackend::rope(Rows x, int head_dim, const int32_t* positions,
                       const model::RopeParams& rope) {
  if (x.count == 0) return;
  const float* inv_freq = rope_table(rope, head_dim);
  if (inv_freq == nullptr) return;
  launched(rope_rows(view(x), head_dim, positions, inv_freq, launch()), "rope");
}

void CudaBackend::gelu_tanh_mul(Rows gate, Rows multiplier, Rows out) {
  if (gate.count == 0) return;
  launched(cuda::gelu_tanh_mul(view(gate), view(multiplier), view(out), launch()), "gelu_tanh_mul");
}

void CudaBackend::add(Rows acc, Rows x) {
  if (acc.count == 0) return;
  launched(map_rows(RowMap::kAdd, view(acc), view(x), nullptr, 0.0f, launch()), "add");
}

void CudaBackend::scale(Rows x, const float* column_scale, float scalar) {
  if (x.count == 0) return;
  launched(map_rows(RowMap::kScale, view(x), view(x), column_scale, scalar, launch()), "scale");
}

void CudaBackend::softcap(Rows x, float cap) {
  if (x.count == 0) return;
  launched(map_rows(RowMap::kSoftcap, view(x), view(x), nullptr, cap, launch()), "softcap");
}

void CudaBackend::copy(Rows src, Rows dst) {
  if (src.count == 0) return;
  launched(map_rows(RowMap::kCopy, view(dst), view(src), nullptr, 0.0f, launch()), "copy");
}

void CudaBackend::write_kv(const engine::KvView& kv, Rows k, Rows v, const int32_t* positions) {
  if (k.count == 0) return;
  launched(cuda::write_kv(slots(kv), view(k), view(v), positions, launch()), "write_kv");
}

void CudaBackend::forget_kv(const engine::KvView& kv, int64_t from_position) {
  launched(cuda::forget_kv(slots(kv), from_position, launch()), "forget_kv");
}

void CudaBackend::attention(Rows q, const int32_t* positions, const engine::KvView& kv, int window,
                            float scale, Rows out) {
  if (q.count == 0) return;
  if (tensor_core_rows(q.count)) {
    const cudaError_t status =
        prefill_attention(view(q), positions, slots(kv), window, scale, view(out), launch());
    if (status != cudaErrorInvalidValue) {  // else a shape it does not take: the kernels below
      launched(status, "attention (prefill)");
      return;
    }
  }
  // One decode query: the split-K decode kernel (head_dim 256/512, aligned rows). It rejects
  // other shapes before enqueuing anything; those, and prefill chunks, take the generic kernel.
  if (q.count == 1 && aligned16(q.data) && kv.head_dim > 0 && q.width % kv.head_dim == 0) {
    const int q_heads = static_cast<int>(q.width / kv.head_dim);
    const int splits = attention_splits(kv.slots, 1, kv.kv_heads);
    float* partials = nullptr;
    if (splits > 1) {
      partials = static_cast<float*>(
          scratch(attention_partials_,
                  sizeof(float) * attention_partials_floats(1, q_heads, kv.head_dim, splits)));
      if (partials == nullptr) return;
    }
    const AttentionQuery query = {q.data, q.stride, q_heads, positions, 1};
    KvCacheView cache;
    cache.keys = kv.keys;
    cache.values = kv.values;
    cache.slot_positions = kv.slot_positions;
    cache.type = KvType::kF32;
    cache.slots = kv.slots;
    cache.kv_heads = kv.kv_heads;
    cache.head_dim = kv.head_dim;
    const cudaError_t status = decode_attention(query, cache, window, scale, out.data, out.stride,
                                                {partials, splits}, splits, launch());
    if (status != cudaErrorInvalidValue) {
      launched(status, "attention (decode)", splits > 1 ? 2 : 1);  // + the split merge
      return;
    }
  }
  launched(cuda::attention_rows(view(q), positions, slots(kv), window, scale, view(out), launch()),
           "attention");
}

void CudaBackend::route_experts(Rows logits, const engine::RouterParams& router,
                                int32_t* expert_ids, float* weights) {
  if (logits.count == 0) return;
  launched(cuda::route_experts(logits.data, logits.stride, static_cast<int>(logits.count),
                               static_cast<int>(logits.width), router.top_k,
                               router.per_expert_scale, expert_ids, weights, launch()),
           "route_experts");
}

void CudaBackend::run_experts(std::span<const model::ExpertMatrices> experts, Rows x,
                              const int32_t* expert_ids, const float* weights, int top_k,
                              Rows out) {
  if (out.count == 0) return;
  const Launch on_stream = launch();  // the device is current before the table is made
  // The grouped MoE kernels (moe.h): no host round-trip; the layer's descriptor table is
  // uploaded on its first call and reused after.
  std::string why;
  const MoeExpertTable* table = cached_expert_table(experts, &why);
  if (table == nullptr) {
    fail(ErrorCode::kUnsupported, fmt::format("CUDA backend: run_experts: {}", why));
    return;
  }
  const auto tokens = static_cast<int>(out.count);
  void* workspace = scratch(expert_workspace_, moe_workspace_bytes(*table, tokens, top_k));
  if (!status_.ok()) return;
  launched(cuda::run_experts(*table, x.data, x.stride, tokens, top_k, expert_ids, weights, out.data,
                             out.stride, workspace, on_stream),
           "run_experts", run_experts_kernel_count(tokens));
}

void CudaBackend::add_rms_norm(Rows acc, Rows x, const float* weight, float scalar,
                               const float* next_weight, Rows next,
                               const engine::NormParams& norm) {
  if (acc.count == 0) return;
  AddNormSpec spec;
  spec.weight = weight;
  spec.next_weight = next_weight;
  spec.weight_offset = norm.weight_offset;
  spec.eps = norm.eps;
  spec.scalar = scalar;
  launched(cuda::add_rms_norm(view(x), view(acc), view(next), spec, launch()), "add_rms_norm");
}

void CudaBackend::add_rms_norm_branch(Rows acc, Rows branch, Rows x, const float* branch_weight,
                                      const float* weight, float scalar, const float* next_weight,
                                      Rows next, const engine::NormParams& norm) {
  if (acc.count == 0) return;
  AddNormSpec spec;
  spec.weight = weight;
  spec.next_weight = next_weight;
  spec.weight_offset = norm.weight_offset;
  spec.eps = norm.eps;
  spec.scalar = scalar;
  launched(cuda::add_rms_norm_branch(view(x), view(branch), branch_weight, view(acc), view(next),
                                     spec, launch()),
           "add_rms_norm_branch");
}

void CudaBackend::matmul_route_experts(const quant::QMatrix& router_proj, Rows x, Rows logits,
                                       const engine::RouterParams& router, int32_t* expert_ids,
                                       float* weights) {
  // One token (decode): the GEMV and the routing in one launch (moe.h); else the two operations.
  if (x.count == 1) {
    const cudaError_t status =
        route_token(router_proj, x.data, !fp32_activations_, router.top_k, router.per_expert_scale,
                    logits.data, expert_ids, weights, launch());
    if (status != cudaErrorInvalidValue) {
      launched(status, "matmul_route_experts");
      return;
    }
  }
  Backend::matmul_route_experts(router_proj, x, logits, router, expert_ids, weights);
}

void CudaBackend::moe_norms(Rows hidden, Rows dense, const float* dense_weight,
                            const float* router_scale, float router_factor,
                            const float* expert_weight, Rows router_in, Rows expert_in,
                            const engine::NormParams& norm) {
  if (hidden.count == 0) return;
  MoeNormSpec spec;
  spec.dense_weight = dense_weight;
  spec.router_scale = router_scale;
  spec.router_factor = router_factor;
  spec.expert_weight = expert_weight;
  spec.weight_offset = norm.weight_offset;
  spec.eps = norm.eps;
  launched(
      cuda::moe_norms(view(hidden), view(dense), view(router_in), view(expert_in), spec, launch()),
      "moe_norms");
}

void CudaBackend::prepare_attention(Rows q, Rows k, Rows v, const float* q_norm,
                                    const float* k_norm, bool norm_v, int head_dim,
                                    const int32_t* positions, const model::RopeParams& rope,
                                    std::span<const engine::SequenceRows> sequences,
                                    const engine::NormParams& norm) {
  if (q.count == 0) return;
  const float* inv_freq = rope_table(rope, head_dim);
  if (inv_freq == nullptr) return;
  std::vector<SequenceKv> stored;
  if (k.data != nullptr) {
    stored.reserve(sequences.size());
    for (const engine::SequenceRows& s : sequences) {
      if (s.kv.head_dim != head_dim || int64_t{s.kv.kv_heads} * s.kv.head_dim != k.width) {
        fail(ErrorCode::kInvalidArgument,
             fmt::format("CUDA backend: prepare_attention: a KV cache of {} x {} for k rows of {}",
                         s.kv.kv_heads, s.kv.head_dim, k.width));
        return;
      }
      stored.push_back({s.kv.keys, s.kv.values, s.kv.slot_positions, s.kv.slots,
                        static_cast<int32_t>(s.first_row), static_cast<int32_t>(s.count)});
    }
  }
  AttentionInputs inputs;
  inputs.q = view(q);
  if (k.data != nullptr) {
    inputs.k = view(k);
    inputs.v = view(v);
  }
  inputs.q_norm = q_norm;
  inputs.k_norm = k_norm;
  inputs.norm_v = norm_v;
  inputs.head_dim = head_dim;
  inputs.weight_offset = norm.weight_offset;
  inputs.eps = norm.eps;
  inputs.positions = positions;
  inputs.inv_freq = inv_freq;
  launched(cuda::prepare_attention(inputs, stored, launch()), "prepare_attention",
           prepare_attention_launches(static_cast<int>(stored.size())));
}

void CudaBackend::attention_rows(Rows q, const int32_t* positions,
                                 std::span<const engine::SequenceRows> sequences, int window,
                                 float scale, Rows out) {
  const bool decode =
      !sequences.empty() &&
      std::all_of(sequences.begin(), sequences.end(), [&](const engine::SequenceRows& s) {
        return s.count == 1 && s.kv.head_dim == sequences[0].kv.head_dim &&
               s.kv.kv_heads == sequences[0].kv.kv_heads;
      });
  const int head_dim = decode ? sequences[0].kv.head_dim : 0;
  if (!decode || head_dim <= 0 || q.width % head_dim != 0) {
    Backend::attention_rows(q, positions, sequences, window, scale, out);
    return;
  }
  const int kv_heads = sequences[0].kv.kv_heads;
  const int q_heads = static_cast<int>(q.width / head_dim);
  const int64_t batch =
      std::min<int64_t>(std::ssize(sequences), int64_t{kMaxBatchedSequences});  // per launch
  int64_t max_slots = 1;
  for (const engine::SequenceRows& s : sequences) max_slots = std::max(max_slots, s.kv.slots);
  const int splits = attention_splits(max_slots, batch, kv_heads);
  float* partials = nullptr;
  if (splits > 1) {
    partials = static_cast<float*>(scratch(
        attention_partials_, sizeof(float) * attention_partials_floats(static_cast<int>(batch),
                                                                       q_heads, head_dim, splits)));
    if (partials == nullptr) return;
  }
  // Chunks run in stream order, so they share the partials.
  for (size_t first = 0; first < sequences.size(); first += kMaxBatchedSequences) {
    const auto chunk =
        sequences.subspan(first, std::min<size_t>(kMaxBatchedSequences, sequences.size() - first));
    SequenceKvTable table;
    table.count = static_cast<int>(chunk.size());
    for (size_t b = 0; b < chunk.size(); ++b) {
      const engine::SequenceRows& s = chunk[b];
      table.entries[b] = {s.kv.keys,
                          s.kv.values,
                          s.kv.slot_positions,
                          s.kv.slots,
                          static_cast<int32_t>(s.first_row),
                          1};
    }
    KvCacheView cache;
    cache.type = KvType::kF32;
    cache.kv_heads = kv_heads;
    cache.head_dim = head_dim;
    cache.sequences = &table;
    const AttentionQuery query = {q.data, q.stride, q_heads, positions, table.count};
    const cudaError_t status = decode_attention(query, cache, window, scale, out.data, out.stride,
                                                {partials, splits}, splits, launch());
    if (status == cudaErrorInvalidValue) {
      // A shape the decode kernel does not take (checked before anything is enqueued).
      Backend::attention_rows(q, positions, sequences.subspan(first), window, scale, out);
      return;
    }
    launched(status, "attention_rows (decode)", splits > 1 ? 2 : 1);  // + the split merge
  }
}

Expected<std::unique_ptr<engine::Backend>> make_cuda_backend(int device,
                                                             const CudaOptions& options) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();
    return make_error(ErrorCode::kUnsupported, "no usable CUDA GPU: {}",
                      status != cudaSuccess ? cudaGetErrorString(status) : "none found");
  }
  if (device < 0 || device >= count) {
    return make_error(ErrorCode::kInvalidArgument, "GPU {} does not exist ({} found)", device,
                      count);
  }
  auto backend = std::make_unique<CudaBackend>(device, options.pdl);
  backend->set_fp32_activations(options.fp32);
  if (Status created = backend->status(); !created.ok()) return created.error();
  return std::unique_ptr<engine::Backend>(std::move(backend));
}

}  // namespace gemma4::cuda
