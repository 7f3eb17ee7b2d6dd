#include "backend/cuda/cuda_backend.h"

#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <tuple>

#include "backend/cuda/attention.h"
#include "backend/cuda/backend_kernels.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/fused_ops.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/gemv_mma.h"
#include "backend/cuda/greedy_chain.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/ple_step.h"
#include "backend/cuda/prefill_kernels.h"
#include "backend/cuda/prefill_matmul.h"
#include "backend/cuda/replay_timer.h"
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
static_assert(static_cast<int>(engine::KvType::kF32) == static_cast<int>(KvType::kF32) &&
              static_cast<int>(engine::KvType::kBF16) == static_cast<int>(KvType::kBF16) &&
              static_cast<int>(engine::KvType::kFP8) == static_cast<int>(KvType::kFP8));

namespace {

// The packed GEMV handles up to this many activation rows per launch.
constexpr int64_t kMaxGemvRows = 64;

// Batched decode passes on tensor cores run concurrently()'s branches side by side from this many
// rows (26B-A4B, H200, session 11 MID: 64 streams 4,952.7 -> 5,137.0 tok/s, +3.7 %); at 32 rows
// the dense MLP's blocks beside the MoE's cost more than they hide (3,647.0 -> 3,418.1, -6.3 %).
constexpr int64_t kConcurrentBatchedMinRows = 33;

// Batched decode passes the GEMV multiplies on tensor cores from the packed weights (gemv_mma.h):
// they skip the prefill path, whose bf16 copy of each weight tile costs more than the whole
// GEMV at these row counts.
bool tensor_core_gemv_rows(const quant::QMatrix& w, int64_t rows) {
  return rows <= kMaxGemvRows &&
         gemv_mma_takes(w, {nullptr, ActType::kF32, static_cast<int>(rows), 0, true});
}

// Decode attention's split-merge counters: one per (sequence of a launch, q head).
constexpr int kAttentionMergeCounters = kMaxBatchedSequences * 64;

// Splits for launches that scan up to `keys` keys (the cache's slots, or fewer where the pass
// and every replay of its recording stay shallower: SequenceRows::position_bound), each of at
// least kMinKeysPerSplit keys (the kernel leaves the splits a shallower query does not need after
// reading its position); one for what the kernel takes in one split, so that no merge runs.
// Fewer, larger splits lose in the engine although they cut the split merge's work (H200, b1 at
// depth 32K, session 12): 26B's sliding layers in 64-key splits (16 per kv head, merged inside
// the attention kernel instead of by the merge kernel) 398.2 -> 385.5 tok/s, the same with one
// block of both q heads per split 388.7, its 32-key splits merged inside the kernel (66 KB of
// records a block) 394.0; E2B's sliding layers in 64-key splits 669.6 -> 657.0, its full layers
// in 198 splits instead of 264 667.4. A block's extra tiles (and an in-kernel merge's extra
// records) cost more on the dependent chain than the merge work they save.
int attention_splits(int64_t keys, int window, int64_t sequences, int kv_heads) {
  // decode_attention scans at most `window` keys of a sliding ring.
  if (window > 0) keys = std::min<int64_t>(keys, window);
  if (keys <= kOneSplitKeys) return 1;
  // A launch's (sequence, kv head, split) blocks stop at one wave (kDecodeAttentionBlocks), so a
  // batch takes fewer splits each and the partials stay small.
  const int64_t budget = std::max<int64_t>(1, kDecodeAttentionBlocks / (sequences * kv_heads));
  return static_cast<int>(
      std::clamp<int64_t>((keys + kMinKeysPerSplit - 1) / kMinKeysPerSplit, 1, budget));
}

RowsView view(const Rows& r) {
  return {r.data, r.count, r.width, r.stride};
}

KvType kv_type(const engine::KvView& kv) {
  return static_cast<KvType>(kv.type);
}

KvSlots slots(const engine::KvView& kv) {
  return {kv.keys, kv.values, kv.slot_positions, kv.slots, kv.kv_heads, kv.head_dim, kv_type(kv)};
}

// The residual step's norm parameters (add_rms_norm, add_rms_norm_branch), no companions.
AddNormSpec add_norm_spec(const float* weight, float scalar, const float* next_weight,
                          const engine::NormParams& norm) {
  AddNormSpec spec;
  spec.weight = weight;
  spec.next_weight = next_weight;
  spec.weight_offset = norm.weight_offset;
  spec.eps = norm.eps;
  spec.scalar = scalar;
  return spec;
}

// One sequence's cache as the attention kernels take it (uniform, batch of one).
KvCacheView cache_view(const engine::KvView& kv) {
  KvCacheView cache;
  cache.keys = kv.keys;
  cache.values = kv.values;
  cache.slot_positions = kv.slot_positions;
  cache.type = kv_type(kv);
  cache.slots = kv.slots;
  cache.kv_heads = kv.kv_heads;
  cache.head_dim = kv.head_dim;
  return cache;
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace

CudaBackend::CudaBackend(int device, bool pdl) : device_(device), pdl_(pdl) {
  check(cudaSetDevice(device_), "selecting the GPU");
  // The main stream at the highest priority: where both branches of concurrently() compete for
  // SMs, the main one is the critical path.
  int lowest_priority = 0, highest_priority = 0;
  if (status_.ok()) {
    check(cudaDeviceGetStreamPriorityRange(&lowest_priority, &highest_priority),
          "stream priorities");
  }
  if (status_.ok()) {
    check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, highest_priority),
          "stream");
  }
  if (status_.ok()) {
    check(cudaStreamCreateWithPriority(&side_stream_, cudaStreamNonBlocking, lowest_priority),
          "second stream");
  }
  for (cudaEvent_t* event : {&fork_event_, &join_event_}) {
    if (status_.ok()) check(cudaEventCreateWithFlags(event, cudaEventDisableTiming), "event");
  }
  if (status_.ok()) {
    const size_t bytes = sizeof(int) * kAttentionMergeCounters;
    check(cudaMalloc(&attention_merge_counters_, bytes), "attention merge counters");
    if (status_.ok())
      check(cudaMemsetAsync(attention_merge_counters_, 0, bytes, stream_),
            "attention merge counters");
  }
  if (status_.ok()) {
    check(cudaMalloc(&ple_step_acc_readers_, sizeof(unsigned)), "ple_step counter");
    if (status_.ok()) {
      check(cudaMemsetAsync(ple_step_acc_readers_, 0, sizeof(unsigned), stream_),
            "ple_step counter");
    }
  }
  active_stream_ = stream_;
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  greedy_chain_.reset();  // its copies may read ranking_
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (side_stream_ != nullptr) cudaStreamSynchronize(side_stream_);
  for (Scratch* s : {&attention_partials_, &expert_workspace_, &pair_products_}) {
    cudaFree(s->data);
  }
  cudaFree(attention_merge_counters_);
  cudaFree(ple_step_acc_readers_);
  for (auto& [data, storage] : companion_storage_) {
    cudaFree(storage.bf16.data);
    cudaFree(storage.q8.data);
  }
  for (const Scratch& s : retired_scratch_) cudaFree(s.data);
  cublas_.reset();  // before its stream goes
  for (Scratch* s : {&prefill_activations_, &prefill_weights_, &ranking_}) cudaFree(s->data);
  for (cudaEvent_t event : {fork_event_, join_event_}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
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
  // Work enqueued outside an operation that reports its writes may have written any rows.
  if (reporting_writes_ == 0) live_companions_.clear();
  return {active_stream_, pdl_};
}

void* CudaBackend::scratch(Scratch& s, size_t bytes) {
  if (bytes <= s.bytes) return s.data;
  launch();
  // Either stream may still read it (concurrently()).
  check(cudaStreamSynchronize(stream_), "scratch resize");
  check(cudaStreamSynchronize(side_stream_), "scratch resize");
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
  const ReportingWrites reporting(*this);
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
  wrote(data, bytes);  // memory freed before may have had companions
  return engine::Buffer(data, bytes, [](void* p) { cudaFree(p); });
}

void CudaBackend::upload(void* dst, const void* src, size_t bytes) {
  const ReportingWrites reporting(*this);
  // From pageable memory the copy returns once `src` is staged: the caller may reuse it.
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, launch().stream), "upload");
  wrote(dst, bytes);
}

void CudaBackend::download(void* dst, const void* src, size_t bytes) {
  const ReportingWrites reporting(*this);
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, launch().stream), "download");
  if (timing_replays_) replay_timer_->step_end(stream_);
  check(cudaStreamSynchronize(stream_), "download (synchronize)");
  if (timing_replays_) replay_timer_->all_steps_done();
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
  // The captured kernels keep their streams' priorities (concurrently(): the MoE chain above the
  // dense branch beside it); without this flag a replay runs every node at the priority of the
  // stream it is launched into.
  if (status_.ok()) {
    check(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority),
          "graph instantiation");
  }
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
  const cudaStream_t stream = launch().stream;
  if (timing_replays_) replay_timer_->before_replay(stream);
  launched(cudaGraphLaunch(graph.exec(), stream), "graph replay",
           static_cast<int>(graph.kernels()));
  if (timing_replays_) replay_timer_->after_replay(stream);
}

void CudaBackend::time_replays(bool on) const {
  if (on) {
    cudaSetDevice(device_);
    replay_timer_ = std::make_unique<ReplayTimer>();
    if (!replay_timer_->start()) replay_timer_.reset();
  }
  timing_replays_ = on && replay_timer_ != nullptr;
}

std::optional<engine::ReplayTimes> CudaBackend::replay_times() const {
  if (replay_timer_ == nullptr) return std::nullopt;
  return replay_timer_->times();
}

void CudaBackend::concurrently(int64_t rows, const std::function<void()>& first,
                               const std::function<void()>& second) {
  if (!status_.ok() ||
      (tensor_core_rows(rows) && (rows < kConcurrentBatchedMinRows || rows > kMaxGemvRows)) ||
      active_stream_ != stream_) {
    Backend::concurrently(rows, first, second);
    return;
  }
  cudaSetDevice(device_);  // not launch(): the companions live now stay live for both branches
  // The events are recorded and waited for even after a failure inside a branch: a capture
  // must end with the second stream joined.
  check(cudaEventRecord(fork_event_, stream_), "concurrently (fork)");
  check(cudaStreamWaitEvent(side_stream_, fork_event_, 0), "concurrently (fork)");
  // The main stream's branch is enqueued first so that its kernels take the SMs first (a MoE
  // layer's router is a cluster of blocks that each need a whole SM: behind the other branch's
  // GEMV blocks, spread over every SM, it would wait for them to drain).
  const std::vector<LiveCompanions> at_fork = live_companions_;
  second();
  // The first branch reads nothing the second writes: what was live at the fork still holds for
  // what it reads.
  live_companions_ = at_fork;
  active_stream_ = side_stream_;
  first();
  active_stream_ = stream_;
  check(cudaEventRecord(join_event_, side_stream_), "concurrently (join)");
  check(cudaStreamWaitEvent(stream_, join_event_, 0), "concurrently (join)");
  // Each branch's bookkeeping missed the other's writes.
  live_companions_.clear();
}

void CudaBackend::join_side_branch() {
  if (active_stream_ != side_stream_) return;
  // The second branch is wholly enqueued on the main stream by now (concurrently() runs it
  // first), so what follows there sees both branches' work.
  check(cudaEventRecord(join_event_, side_stream_), "concurrently (early join)");
  check(cudaStreamWaitEvent(stream_, join_event_, 0), "concurrently (early join)");
  active_stream_ = stream_;
}

// The synchronisation keeps work enqueued before the range out of it (and work enqueued inside
// it in). Results are not checked: a failed synchronisation is sticky and fails the next
// operation, where status() reports it; a profiler call failing only leaves a profile empty.
void CudaBackend::begin_profiler_range() const {
  cudaSetDevice(device_);
  (void)cudaStreamSynchronize(stream_);
  (void)cudaProfilerStart();
}

void CudaBackend::end_profiler_range() const {
  cudaSetDevice(device_);
  (void)cudaStreamSynchronize(stream_);
  (void)cudaProfilerStop();
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
  const ReportingWrites reporting(*this);
  if (out.count == 0) return;
  MatrixView view_of_table;
  if (!matrix_view(table, view_of_table)) {
    fail(ErrorCode::kUnsupported, fmt::format("CUDA backend: no embedding kernel for {} tables",
                                              quant::weight_format_name(table.format)));
    return;
  }
  launched(embed_rows(view_of_table, ids, scale, view(out), launch()), "embed");
  wrote(out);
}

namespace {

// Bytes of rows `r`: from the first element to one past the last.
size_t rows_bytes(const Rows& r) {
  return r.count > 0 ? sizeof(float) * static_cast<size_t>((r.count - 1) * r.stride + r.width) : 0;
}

bool has_bf16_gemv(WeightFormat format) {
  return format == WeightFormat::kW4G32 || format == WeightFormat::kNVFP4 ||
         format == WeightFormat::kBF16;
}

}  // namespace

const char* activation_mode_name(ActivationMode mode) {
  switch (mode) {
    case ActivationMode::kF32:
      return "f32";
    case ActivationMode::kBF16:
      return "bf16";
    case ActivationMode::kQ8:
      return "q8";
  }
  return "?";
}

void CudaBackend::wrote(const void* data, size_t bytes) {
  const auto* begin = static_cast<const char*>(data);
  std::erase_if(live_companions_, [&](const LiveCompanions& live) {
    const auto* live_begin = reinterpret_cast<const char*>(live.rows.data);
    return live_begin < begin + bytes && begin < live_begin + rows_bytes(live.rows);
  });
}

void CudaBackend::wrote(Rows rows) {
  wrote(rows.data, rows_bytes(rows));
}

void CudaBackend::produced(Rows rows, const ActivationCompanions& c) {
  wrote(rows);
  if (status_.ok() && has_companions(c)) live_companions_.push_back({rows, c});
}

const ActivationCompanions* CudaBackend::live_companions(Rows x) const {
  for (const LiveCompanions& live : live_companions_) {
    if (live.rows.data == x.data && live.rows.width == x.width && live.rows.stride == x.stride &&
        live.rows.count >= x.count) {
      return &live.companions;
    }
  }
  return nullptr;
}

// Passes of up to kMaxGemvRows rows (decode batches) get companions: their GEMVs read them, the
// tensor-core one past kTensorCoreMaxGemvRows too (bf16 rows stage from half the bytes of fp32
// ones: E2B 64 streams 14,086 -> 15,508 tok/s, 26B 32 streams 3,388 -> 3,436, session 10 EARLY).
// Longer passes (prefill) multiply on cuBLAS, which converts its own input.
ActivationCompanions CudaBackend::companion_storage(Rows out, bool bf16, bool q8) {
  if (activation_mode_ == ActivationMode::kF32 || out.count == 0 || out.width % 32 != 0 ||
      out.count > kMaxGemvRows) {
    return {};
  }
  const int64_t stride = out.width;  // a multiple of 32
  // Room for the most rows of a GEMV pass of its kind (kTensorCoreMaxGemvRows for the CUDA-core
  // GEMV's, kMaxGemvRows past them), so that decode batches of any size share one allocation per
  // address (recorded graphs keep outgrown ones alive).
  const int64_t rows = out.count <= kTensorCoreMaxGemvRows ? kTensorCoreMaxGemvRows : kMaxGemvRows;
  const auto bf16_bytes = static_cast<size_t>(2 * rows * stride);
  const auto q8_bytes = static_cast<size_t>(rows * q8_row_bytes(stride));
  CompanionStorage& storage = companion_storage_[out.data];
  // Growing storage moves it: companions still live in the old one are dropped.
  if ((bf16 && storage.bf16.bytes < bf16_bytes) || (q8 && storage.q8.bytes < q8_bytes)) {
    std::erase_if(live_companions_,
                  [&](const LiveCompanions& live) { return live.rows.data == out.data; });
  }
  ActivationCompanions c;
  c.stride = stride;
  if (bf16) c.bf16 = static_cast<uint16_t*>(scratch(storage.bf16, bf16_bytes));
  if (q8) c.q8 = scratch(storage.q8, q8_bytes);
  if (!status_.ok()) return {};
  return c;
}

ActivationCompanions CudaBackend::produced_companions(Rows out) {
  // q8 mode writes both: q8 for the w4g32 GEMVs, bf16 for the formats without a q8 kernel.
  return companion_storage(out, activation_mode_ != ActivationMode::kF32,
                           activation_mode_ == ActivationMode::kQ8);
}

GemvInput CudaBackend::gemv_input(const quant::QMatrix& w, Rows x) {
  const GemvInput fp32 = {x.data, ActType::kF32, static_cast<int>(x.count), x.stride,
                          activation_mode_ != ActivationMode::kF32};
  if (activation_mode_ == ActivationMode::kF32 || !has_bf16_gemv(w.format)) return fp32;
  ActivationCompanions have;
  if (const ActivationCompanions* live = live_companions(x)) have = *live;
  // q8 where the weights have a dp4a kernel, unless the producer wrote bf16 only (the GELU
  // epilogues but the 64-row gate+up one): then bf16 rather than one more kernel.
  const bool q8 = activation_mode_ == ActivationMode::kQ8 && w.format == WeightFormat::kW4G32 &&
                  (have.q8 != nullptr || have.bf16 == nullptr);
  if ((q8 ? have.q8 : have.bf16) == nullptr) {
    // Batched rows: the GEMV rounds fp32 rows itself (the tensor-core GEMV stages them anyway).
    if (x.count > 1) return fp32;
    // No producer wrote this input's type (the attention output, an embedding): one kernel
    // converts it, and the result stays live for later readers of x.
    ActivationCompanions made = companion_storage(x, !q8, q8);
    if (!has_companions(made)) return fp32;
    launched(write_activation_companions(x.data, static_cast<int>(x.count), x.width, x.stride, made,
                                         launch()),
             "activation companions");
    if (!status_.ok()) return fp32;
    // Keep the other type where it is still live (growing the storage drops it).
    if (const ActivationCompanions* live = live_companions(x)) {
      if (made.bf16 == nullptr) made.bf16 = live->bf16;
      if (made.q8 == nullptr) made.q8 = live->q8;
    }
    produced(x, made);
    have = made;
  }
  if (q8) return {have.q8, ActType::kQ8, static_cast<int>(x.count), have.stride};
  return {have.bf16, ActType::kBF16, static_cast<int>(x.count), have.stride};
}

bool CudaBackend::packed_gemv(const quant::QMatrix& w, Rows x, const GemvOutput& out,
                              const char* what) {
  // The GEMV rejects what it has no kernel for (fp32 weights, K % 32 != 0, unaligned rows)
  // before enqueuing anything; every slice has the first one's shape and alignment.
  const GemvInput whole = gemv_input(w, x);
  const int64_t x_row_bytes = whole.type == ActType::kQ8
                                  ? q8_row_bytes(whole.stride)
                                  : whole.stride * (whole.type == ActType::kBF16 ? 2 : 4);
  for (int64_t done = 0; done < x.count; done += kMaxGemvRows) {
    const int64_t rows = std::min(kMaxGemvRows, x.count - done);
    GemvInput input = whole;
    input.data = static_cast<const char*>(whole.data) + done * x_row_bytes;
    input.rows = static_cast<int>(rows);
    GemvOutput slice = out;
    slice.data += done * out.stride;
    if (slice.multiplier != nullptr) slice.multiplier += done * out.multiplier_stride;
    ActivationCompanions& c = slice.companions;
    if (c.bf16 != nullptr) c.bf16 += done * c.stride;
    if (c.q8 != nullptr) c.q8 = static_cast<char*>(c.q8) + done * q8_row_bytes(c.stride);
    const cudaError_t status = gemv(w, input, slice, launch());
    if (status == cudaErrorInvalidValue && done == 0) return false;
    launched(status, what);
    if (status != cudaSuccess) break;
  }
  return true;
}

void CudaBackend::matmul(const quant::QMatrix& w, Rows x, Rows y) {
  const ReportingWrites reporting(*this);
  if (x.count == 0) return;
  wrote(y);
  if (MatrixView weights; tensor_core_rows(x.count) && !tensor_core_gemv_rows(w, x.count) &&
                          matrix_view(w, weights) &&
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
// epilogue, which also writes y's bf16 companion (the next GEMV's input: E2B's PLE projection).
// Tensor-core passes, and weights or rows the GEMV does not take: matmul, then the gating.
void CudaBackend::matmul_gelu_mul(const quant::QMatrix& w, Rows x, Rows multiplier, Rows y) {
  const ReportingWrites reporting(*this);
  if (x.count == 0) return;
  GemvOutput gated = {y.data, y.stride, GemvEpilogue::kGeluMul, multiplier.data, multiplier.stride};
  gated.companions = companion_storage(y, true, false);
  if ((tensor_core_rows(x.count) && !tensor_core_gemv_rows(w, x.count)) ||
      !packed_gemv(w, x, gated, "matmul_gelu_mul (gemv)")) {
    Backend::matmul_gelu_mul(w, x, multiplier, y);  // matmul, then gelu_tanh_mul
    return;
  }
  produced(y, gated.companions);
}

// The fused GEMV writes y's bf16 companion: the down projection's input, which the batched
// tensor-core GEMV then stages from half the bytes of fp32 rows (the same bf16 values: it rounds
// fp32 rows to nearest, as the companion is); for one row of w4g32 weights in q8 mode also its q8
// companion (through the 64-row tiling that quantizes whole chunks).
void CudaBackend::matmul_gelu_pairs(const quant::QMatrix& w, Rows x, Rows y) {
  const ReportingWrites reporting(*this);
  if (x.count == 0) return;
  GemvOutput pairs = {y.data, y.stride, GemvEpilogue::kGeluPairs};
  const bool q8 = x.count == 1 && activation_mode_ == ActivationMode::kQ8 &&
                  w.format == WeightFormat::kW4G32 && w.rows % 64 == 0;
  pairs.companions = companion_storage(y, true, q8);
  if ((!tensor_core_rows(x.count) || tensor_core_gemv_rows(w, x.count)) &&
      packed_gemv(w, x, pairs, "matmul_gelu_pairs (gemv)")) {
    produced(y, pairs.companions);
    return;
  }
  if (MatrixView weights;
      tensor_core_rows(x.count) && w.rows % 2 == 0 && y.count == x.count && y.width == w.rows / 2 &&
      matrix_view(w, weights) &&
      tensor_core_matmul_accepts(weights, view(x), {y.data, x.count, w.rows, w.rows})) {
    wrote(y);
    tensor_core_matmul(weights, view(x), view(y), /*gelu_pairs=*/true);
    return;
  }
  join_side_branch();  // pair_products_ is shared with the main stream's work
  auto* products = static_cast<float*>(
      scratch(pair_products_, sizeof(float) * static_cast<size_t>(x.count * w.rows)));
  if (products == nullptr) return;
  matmul(w, x, {products, x.count, w.rows, w.rows});
  pairs.companions.q8 = nullptr;  // the stand-alone epilogue writes bf16 only
  launched(gemv_epilogue(products, x.count, w.rows, w.rows, pairs, launch()),
           "matmul_gelu_pairs (epilogue)");
  produced(y, pairs.companions);
}

void CudaBackend::rms_norm(Rows x, const float* weight, float weight_offset, float eps, Rows y) {
  const ReportingWrites reporting(*this);
  if (x.count == 0) return;
  // The register-resident kernel writes the companions (rows of at most 8192).
  const ActivationCompanions c = y.width <= 8192 ? produced_companions(y) : ActivationCompanions{};
  launched(cuda::rms_norm(view(x), weight, weight_offset, eps, view(y), nullptr, launch(), c),
           "rms_norm");
  produced(y, c);
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
  const ReportingWrites reporting(*this);
  if (x.count == 0) return;
  const float* inv_freq = rope_table(rope, head_dim);
  if (inv_freq == nullptr) return;
  launched(rope_rows(view(x), head_dim, positions, inv_freq, launch()), "rope");
  wrote(x);
}

void CudaBackend::gelu_tanh_mul(Rows gate, Rows multiplier, Rows out) {
  const ReportingWrites reporting(*this);
  if (gate.count == 0) return;
  launched(cuda::gelu_tanh_mul(view(gate), view(multiplier), view(out), launch()), "gelu_tanh_mul");
  wrote(out);
}

void CudaBackend::add(Rows acc, Rows x) {
  const ReportingWrites reporting(*this);
  if (acc.count == 0) return;
  launched(map_rows(RowMap::kAdd, view(acc), view(x), nullptr, 0.0f, launch()), "add");
  wrote(acc);
}

void CudaBackend::scale(Rows x, const float* column_scale, float scalar) {
  const ReportingWrites reporting(*this);
  if (x.count == 0) return;
  launched(map_rows(RowMap::kScale, view(x), view(x), column_scale, scalar, launch()), "scale");
  wrote(x);
}

void CudaBackend::softcap(Rows x, float cap) {
  const ReportingWrites reporting(*this);
  if (x.count == 0) return;
  launched(map_rows(RowMap::kSoftcap, view(x), view(x), nullptr, cap, launch()), "softcap");
  wrote(x);
}

void CudaBackend::copy(Rows src, Rows dst) {
  const ReportingWrites reporting(*this);
  if (src.count == 0) return;
  launched(map_rows(RowMap::kCopy, view(dst), view(src), nullptr, 0.0f, launch()), "copy");
  wrote(dst);
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
  if (tensor_core_rows(q.count) && kv.head_dim > 0) {
    const KvCacheView cache = cache_view(kv);
    const int q_heads = static_cast<int>(q.width / kv.head_dim);
    const int splits = prefill_attention_splits(q.count, q_heads, cache);
    float* partials = nullptr;
    if (splits > 1) {
      partials = static_cast<float*>(
          scratch(attention_partials_, sizeof(float) * prefill_attention_partials_floats(
                                                           q.count, q_heads, kv.head_dim, splits)));
      if (partials == nullptr) return;
    }
    const cudaError_t status = prefill_attention(view(q), positions, cache, window, scale,
                                                 view(out), partials, splits, launch());
    if (status != cudaErrorInvalidValue) {  // else a shape it does not take: the kernels below
      launched(status, "attention (prefill)");
      return;
    }
  }
  // One decode query: the split-K decode kernel (head_dim 256/512, aligned rows). It rejects
  // other shapes before enqueuing anything; those, and prefill chunks, take the generic kernel.
  if (q.count == 1 && aligned16(q.data) && kv.head_dim > 0 && q.width % kv.head_dim == 0) {
    const int q_heads = static_cast<int>(q.width / kv.head_dim);
    const int splits = attention_splits(kv.slots, window, 1, kv.kv_heads);
    float* partials = nullptr;
    if (splits > 1) {
      partials = static_cast<float*>(
          scratch(attention_partials_,
                  sizeof(float) * attention_partials_floats(1, q_heads, kv.head_dim, splits)));
      if (partials == nullptr) return;
    }
    const AttentionQuery query = {q.data, q.stride, q_heads, positions, 1};
    const KvCacheView cache = cache_view(kv);
    const AttentionWorkspace workspace = {partials, splits, attention_merge_counters_,
                                          kAttentionMergeCounters};
    const cudaError_t status = decode_attention(query, cache, window, scale, out.data, out.stride,
                                                workspace, splits, launch());
    if (status != cudaErrorInvalidValue) {
      launched(status, "attention (decode)",
               decode_attention_launches(query, cache, splits, workspace));
      return;
    }
  }
  // A few queries of one sequence (a short prompt or the tail of a long one): each row as a
  // one-row sequence of a decode batch over the same cache (read only: nothing is prepared),
  // rather than the generic kernel's block per (head, query) scanning every slot (~250 µs per
  // 26B sliding layer at any depth).
  if (q.count > 1 && q.count <= kMaxBatchedSequences) {
    std::vector<engine::SequenceRows> rows;
    rows.reserve(static_cast<size_t>(q.count));
    for (int64_t r = 0; r < q.count; ++r) rows.push_back({kv, r, 1});
    bool taken = true;
    decode_rows(q, positions, rows, window, scale, out, nullptr, {},
                [&](size_t) { taken = false; });
    if (taken) return;
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
  // kF32 mode: the prefill passes too multiply in fp32 (no bf16 tensor-core tiles).
  const MoePrecision precision =
      fp32_activations_ ? MoePrecision::kExactF32 : MoePrecision::kBf16TensorCores;
  void* workspace =
      scratch(expert_workspace_, moe_workspace_bytes(*table, tokens, top_k, precision));
  if (!status_.ok()) return;
  launched(cuda::run_experts(*table, x.data, x.stride, tokens, top_k, expert_ids, weights, out.data,
                             out.stride, workspace, on_stream, precision),
           "run_experts", run_experts_kernel_count(table->shape(), tokens, precision));
}

AddNormSpec CudaBackend::residual_step_spec(Rows acc, const float* weight, float scalar,
                                            const float* next_weight, Rows next,
                                            const engine::NormParams& norm) {
  AddNormSpec spec = add_norm_spec(weight, scalar, next_weight, norm);
  // With a next norm, the next GEMV reads `next`; without, a GEMV may read the residual itself
  // (the PLE gate of the unfused order does): its companions then. (Any other reader converts the
  // rows first.)
  if (next.data != nullptr) {
    spec.next_companions = produced_companions(next);
  } else {
    spec.residual_companions = produced_companions(acc);
  }
  return spec;
}

void CudaBackend::residual_step_wrote(Rows acc, Rows next, const AddNormSpec& spec) {
  wrote(next);
  produced(acc, spec.residual_companions);
  if (next.data != nullptr) produced(next, spec.next_companions);
}

PleStepArgs CudaBackend::ple_step_args(Rows acc, Rows x, const float* weight,
                                       const MatrixView& gate, Rows multiplier, Rows gated,
                                       const MatrixView& projection, Rows projected,
                                       const float* projected_weight, float scalar,
                                       const float* next_weight, Rows next,
                                       const engine::NormParams& norm) {
  return {.acc = view(acc),
          .x = view(x),
          .step_weight = weight,
          .gate = gate,
          .multiplier = multiplier.data,
          .gated = gated.data,
          .projection = projection,
          .projected = projected.data,
          .next = view(next),
          .spec = residual_step_spec(acc, projected_weight, scalar, next_weight, next, norm)};
}

void CudaBackend::ple_step_wrote(Rows acc, Rows gated, Rows projected, Rows next,
                                 const AddNormSpec& spec) {
  wrote(gated);
  wrote(projected);
  residual_step_wrote(acc, next, spec);
}

void CudaBackend::add_rms_norm(Rows acc, Rows x, const float* weight, float scalar,
                               const float* next_weight, Rows next,
                               const engine::NormParams& norm) {
  const ReportingWrites reporting(*this);
  if (acc.count == 0) return;
  const AddNormSpec spec = residual_step_spec(acc, weight, scalar, next_weight, next, norm);
  launched(cuda::add_rms_norm(view(x), view(acc), view(next), spec, launch()), "add_rms_norm");
  residual_step_wrote(acc, next, spec);
}

// One decode row outside kF32 mode: at E2B's widths ple_step does all of it in one launch. Else
// the PLE gate GEMV stages acc + norm(x) itself (GemvResidualNorm) and the closing
// add_rms_norm_deferred performs that step before its own, so the step's stand-alone kernel goes.
// Batched rows keep the default order: their gate runs on tensor cores (gemv_mma.h), which stage
// no residual step. Anything the fused GEMV does not take: the default order too.
void CudaBackend::add_rms_norm_ple(Rows acc, Rows x, const float* weight,
                                   const quant::QMatrix& gate, Rows multiplier, Rows gated,
                                   const quant::QMatrix& projection, Rows projected,
                                   const float* projected_weight, float scalar,
                                   const float* next_weight, Rows next,
                                   const engine::NormParams& norm) {
  const ReportingWrites reporting(*this);
  if (acc.count == 0) return;
  const auto unfused = [&] {
    Backend::add_rms_norm_ple(acc, x, weight, gate, multiplier, gated, projection, projected,
                              projected_weight, scalar, next_weight, next, norm);
  };
  // add_rms_norm_deferred holds a row of at most 8192 in registers: checked before the GEMV goes.
  if (activation_mode_ == ActivationMode::kF32 || acc.count != 1 || acc.width > 8192) {
    unfused();
    return;
  }
  // E2B's widths: the whole step in one cluster launch (ple_step.h).
  if (MatrixView gate_view, projection_view;
      matrix_view(gate, gate_view) && matrix_view(projection, projection_view)) {
    const PleStepArgs step =
        ple_step_args(acc, x, weight, gate_view, multiplier, gated, projection_view, projected,
                      projected_weight, scalar, next_weight, next, norm);
    const cudaError_t status = ple_step(step, launch());
    if (status != cudaErrorInvalidValue) {  // else nothing enqueued: the three kernels below
      launched(status, "add_rms_norm_ple (ple_step)");
      ple_step_wrote(acc, gated, projected, next, step.spec);
      return;
    }
  }
  GemvInput input = {x.data, ActType::kF32, static_cast<int>(x.count), x.stride, true};
  input.residual_norm = {acc.data, acc.stride, weight, norm.weight_offset, norm.eps};
  GemvOutput out = {gated.data, gated.stride, GemvEpilogue::kGeluMul, multiplier.data,
                    multiplier.stride};
  out.companions = companion_storage(gated, true, false);
  const cudaError_t status = gemv(gate, input, out, launch());
  if (status == cudaErrorInvalidValue) {  // nothing enqueued
    unfused();
    return;
  }
  launched(status, "add_rms_norm_ple (gate gemv)");
  produced(gated, out.companions);
  matmul(projection, gated, projected);
  const AddNormSpec spec =
      residual_step_spec(acc, projected_weight, scalar, next_weight, next, norm);
  launched(add_rms_norm_deferred(view(projected), view(x), weight, view(acc), view(next), spec,
                                 launch()),
           "add_rms_norm_ple (norms)");
  residual_step_wrote(acc, next, spec);
}

void CudaBackend::add_rms_norm_ple_matmul(Rows acc, Rows x, const float* weight,
                                          const quant::QMatrix& gate, Rows multiplier, Rows gated,
                                          const quant::QMatrix& projection, Rows projected,
                                          const float* projected_weight, float scalar,
                                          const float* next_weight, Rows next,
                                          const engine::NormParams& norm,
                                          const quant::QMatrix& matmul_weights, Rows matmul_out) {
  const ReportingWrites reporting(*this);
  // kBF16 mode: the matmul would read next's bf16 companion, whose values the launch multiplies.
  if (MatrixView gate_view, projection_view, matmul_view;
      activation_mode_ == ActivationMode::kBF16 && acc.count == 1 && next.data != nullptr &&
      matmul_out.count == 1 && matmul_out.width == matmul_weights.rows &&
      matmul_weights.format == quant::WeightFormat::kW4G32 && matrix_view(gate, gate_view) &&
      matrix_view(projection, projection_view) && matrix_view(matmul_weights, matmul_view)) {
    const PleStepArgs step =
        ple_step_args(acc, x, weight, gate_view, multiplier, gated, projection_view, projected,
                      projected_weight, scalar, next_weight, next, norm);
    const cudaError_t status =
        ple_step_matmul(step, {matmul_view, matmul_out.data, ple_step_acc_readers_}, launch());
    if (status != cudaErrorInvalidValue) {  // else nothing enqueued: the two calls below
      launched(status, "add_rms_norm_ple_matmul (ple_step_matmul)");
      ple_step_wrote(acc, gated, projected, next, step.spec);
      wrote(matmul_out);
      return;
    }
  }
  add_rms_norm_ple(acc, x, weight, gate, multiplier, gated, projection, projected, projected_weight,
                   scalar, next_weight, next, norm);
  matmul(matmul_weights, next, matmul_out);
}

void CudaBackend::add_rms_norm_branch(Rows acc, Rows branch, Rows x, const float* branch_weight,
                                      const float* weight, float scalar, const float* next_weight,
                                      Rows next, const engine::NormParams& norm) {
  // Reports its writes as add_rms_norm does: the next layer's first GEMV then reads the
  // companions of `next` this kernel writes instead of converting it with one more kernel.
  const ReportingWrites reporting(*this);
  if (acc.count == 0) return;
  const AddNormSpec spec = residual_step_spec(acc, weight, scalar, next_weight, next, norm);
  launched(cuda::add_rms_norm_branch(view(x), view(branch), branch_weight, view(acc), view(next),
                                     spec, launch()),
           "add_rms_norm_branch");
  residual_step_wrote(acc, next, spec);
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

void CudaBackend::add_rms_norm_moe(Rows acc, Rows x, const float* weight, float scalar,
                                   const float* next_weight, Rows next,
                                   const engine::MoeInputs& moe, const engine::NormParams& norm) {
  const ReportingWrites reporting(*this);
  if (acc.count == 0) return;
  const AddNormSpec spec = residual_step_spec(acc, weight, scalar, next_weight, next, norm);
  const MoeInputsSpec moe_spec = {moe.router_scale, moe.router_factor, moe.expert_weight,
                                  view(moe.router_in), view(moe.expert_in)};
  launched(cuda::add_rms_norm_moe(view(x), view(acc), view(next), spec, moe_spec, launch()),
           "add_rms_norm_moe");
  wrote(moe.router_in);
  wrote(moe.expert_in);
  residual_step_wrote(acc, next, spec);
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
      if (s.kv.head_dim != head_dim || int64_t{s.kv.kv_heads} * s.kv.head_dim != k.width ||
          s.kv.type != sequences[0].kv.type) {
        fail(ErrorCode::kInvalidArgument,
             fmt::format("CUDA backend: prepare_attention: a {} KV cache of {} x {} for k rows of "
                         "{} (and {} caches)",
                         engine::kv_type_name(s.kv.type), s.kv.kv_heads, s.kv.head_dim, k.width,
                         engine::kv_type_name(sequences[0].kv.type)));
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
  if (!stored.empty()) inputs.kv_type = kv_type(sequences[0].kv);
  launched(cuda::prepare_attention(inputs, stored, launch()), "prepare_attention",
           prepare_attention_launches(static_cast<int>(stored.size())));
}

void CudaBackend::attention_rows(Rows q, const int32_t* positions,
                                 std::span<const engine::SequenceRows> sequences, int window,
                                 float scale, Rows out) {
  decode_rows(q, positions, sequences, window, scale, out, nullptr, {}, [&](size_t first) {
    Backend::attention_rows(q, positions, sequences.subspan(first), window, scale, out);
  });
}

void CudaBackend::prepare_and_attend(Rows q, Rows k, Rows v, const float* q_norm,
                                     const float* k_norm, bool norm_v, int head_dim,
                                     const int32_t* positions, const model::RopeParams& rope,
                                     std::span<const engine::SequenceRows> sequences,
                                     const engine::NormParams& norm, int window, float scale,
                                     Rows out) {
  // The sequences from `first` on as the two operations (q of earlier chunks, already attended,
  // is prepared again in place: scratch by then).
  auto composed = [&](size_t first) {
    Backend::prepare_and_attend(q, k, v, q_norm, k_norm, norm_v, head_dim, positions, rope,
                                sequences.subspan(first), norm, window, scale, out);
  };
  const bool stores_kv = k.data != nullptr;
  if (q.count == 0 || (stores_kv && (k.count != q.count || v.count != q.count))) {
    composed(0);  // the composition's own checks report what is wrong
    return;
  }
  const float* inv_freq = rope_table(rope, head_dim);
  if (inv_freq == nullptr) return;
  DecodePrepare prepare;
  if (stores_kv) {
    prepare.k = k.data;
    prepare.k_stride = k.stride;
    prepare.v = v.data;
    prepare.v_stride = v.stride;
    for (const engine::SequenceRows& s : sequences) {
      if (s.kv.head_dim != head_dim || int64_t{s.kv.kv_heads} * head_dim != k.width ||
          v.width != k.width) {
        composed(0);
        return;
      }
    }
  }
  prepare.q_norm = q_norm;
  prepare.k_norm = k_norm;
  prepare.norm_v = norm_v;
  prepare.weight_offset = norm.weight_offset;
  prepare.eps = norm.eps;
  prepare.inv_freq = inv_freq;
  // A k_eq_v cache whose rows this layer makes (so k_norm is the weight they were made with): the
  // kernel reads K's rotated dims and V (attention.h: KeysFromValues).
  KeysFromValues keys_from_values;
  if (stores_kv && norm_v && !sequences.empty() && sequences[0].kv.k_eq_v) {
    keys_from_values = {k_norm, norm.weight_offset, rope.rotated_pairs};
  }
  decode_rows(q, positions, sequences, window, scale, out, &prepare, keys_from_values, composed);
}

void CudaBackend::prepare_and_attend_pieces(Rows q, Rows k, Rows v, const float* q_norm,
                                            const float* k_norm, bool norm_v, int head_dim,
                                            const int32_t* positions, const model::RopeParams& rope,
                                            std::span<const engine::SequenceRows> sequences,
                                            const engine::NormParams& norm, int window, float scale,
                                            Rows out, int64_t chunk_limit) {
  for (const engine::SequenceRows& s : sequences) {
    const Rows sq = q.slice(s.first_row, s.count), sk = k.slice(s.first_row, s.count),
               sv = v.slice(s.first_row, s.count), so = out.slice(s.first_row, s.count);
    const int32_t* sp = positions + s.first_row;
    const engine::SequenceRows own{s.kv, 0, s.count, s.position_bound};
    const std::span<const engine::SequenceRows> one(&own, 1);
    if (s.count <= chunk_limit) {
      prepare_and_attend(sq, sk, sv, q_norm, k_norm, norm_v, head_dim, sp, rope, one, norm, window,
                         scale, so);
      continue;
    }
    if (k.data == nullptr || !tensor_core_rows(s.count) || (head_dim != 256 && head_dim != 512) ||
        s.kv.head_dim != head_dim || int64_t{s.kv.kv_heads} * head_dim != k.width ||
        v.width != k.width || k.count != q.count || v.count != q.count) {
      Backend::prepare_and_attend_pieces(sq, sk, sv, q_norm, k_norm, norm_v, head_dim, sp, rope,
                                         one, norm, window, scale, so, chunk_limit);
      continue;
    }
    // Staging: the rows' K, V (a ring of s.count slots that holds exactly them) and positions,
    // each 256-byte aligned; positions start empty (-1).
    const int64_t row_bytes = k.width * engine::kv_element_bytes(s.kv.type);
    const auto area = static_cast<size_t>((s.count * row_bytes + 255) / 256 * 256);
    auto* base = static_cast<char*>(
        scratch(staged_kv_, 2 * area + sizeof(int32_t) * static_cast<size_t>(s.count)));
    if (base == nullptr) return;
    const engine::KvView stage{base,     base + area,   reinterpret_cast<int32_t*>(base + 2 * area),
                               s.count,  s.kv.kv_heads, head_dim,
                               s.kv.type};
    launched(
        cudaMemsetAsync(stage.slot_positions, 0xFF, sizeof(int32_t) * s.count, launch().stream),
        "stage K/V (positions)", 0);
    const engine::SequenceRows into_stage{stage, 0, s.count};
    prepare_attention(sq, sk, sv, q_norm, k_norm, norm_v, head_dim, sp, rope,
                      std::span<const engine::SequenceRows>(&into_stage, 1), norm);
    if (!status_.ok()) return;
    const KvCacheView cache = cache_view(s.kv);
    const int q_heads = static_cast<int>(q.width / head_dim);
    const int splits = prefill_attention_splits(s.count, q_heads, cache);
    float* partials = nullptr;
    if (splits > 1) {
      partials = static_cast<float*>(scratch(
          attention_partials_,
          sizeof(float) * prefill_attention_partials_floats(s.count, q_heads, head_dim, splits)));
      if (partials == nullptr) return;
    }
    launched(prefill_chunk_attention(view(sq), sp, cache, cache_view(stage), window, scale,
                                     view(so), partials, splits, launch()),
             "attention (prefill, staged chunk)", splits > 1 ? 2 : 1);
    launched(
        store_staged_kv(cache_view(stage),
                        {s.kv.keys, s.kv.values, s.kv.slot_positions, s.kv.slots, 0, 0}, launch()),
        "store staged K/V");
  }
}

void CudaBackend::decode_rows(Rows q, const int32_t* positions,
                              std::span<const engine::SequenceRows> sequences, int window,
                              float scale, Rows out, const DecodePrepare* prepare,
                              const KeysFromValues& keys_from_values,
                              const std::function<void(size_t)>& otherwise) {
  const bool decode =
      !sequences.empty() &&
      std::all_of(sequences.begin(), sequences.end(), [&](const engine::SequenceRows& s) {
        return s.count == 1 && s.kv.head_dim == sequences[0].kv.head_dim &&
               s.kv.kv_heads == sequences[0].kv.kv_heads && s.kv.type == sequences[0].kv.type;
      });
  const int head_dim = decode ? sequences[0].kv.head_dim : 0;
  if (!decode || head_dim <= 0 || q.width % head_dim != 0) {
    otherwise(0);
    return;
  }
  const int kv_heads = sequences[0].kv.kv_heads;
  const int q_heads = static_cast<int>(q.width / head_dim);
  const int64_t batch =
      std::min<int64_t>(std::ssize(sequences), int64_t{kMaxBatchedSequences});  // per launch
  int64_t max_slots = 1, max_keys = 1;
  for (const engine::SequenceRows& s : sequences) {
    max_slots = std::max(max_slots, s.kv.slots);
    max_keys = std::max(max_keys, std::min(s.kv.slots, s.position_bound));
  }
  const int splits = attention_splits(max_keys, window, batch, kv_heads);
  // The partials are sized for the whole caches: a deeper bound's recording is made without an
  // unrecorded pass first, so it must find them big enough (SequenceRows::position_bound).
  const int capacity_splits = attention_splits(max_slots, window, batch, kv_heads);
  float* partials = nullptr;
  if (capacity_splits > 1) {
    partials = static_cast<float*>(
        scratch(attention_partials_,
                sizeof(float) * attention_partials_floats(static_cast<int>(batch), q_heads,
                                                          head_dim, capacity_splits)));
    if (partials == nullptr) return;
  }
  // The kernels write the companions o_proj's GEMV reads with the output (one row per sequence:
  // all of out when the sequences cover its rows). Taken before anything is launched: a
  // fallback's launches then drop them again (this is no ReportingWrites operation).
  const ActivationCompanions companions =
      std::ssize(sequences) == out.count ? produced_companions(out) : ActivationCompanions{};
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
    cache.type = kv_type(sequences[0].kv);
    cache.kv_heads = kv_heads;
    cache.head_dim = head_dim;
    cache.sequences = &table;
    cache.keys_from_values = keys_from_values;
    AttentionQuery query = {q.data, q.stride, q_heads, positions, table.count};
    query.prepare = prepare;
    const AttentionWorkspace workspace = {partials, splits, attention_merge_counters_,
                                          kAttentionMergeCounters};
    const cudaError_t status = decode_attention(query, cache, window, scale, out.data, out.stride,
                                                workspace, splits, launch(), companions);
    if (status == cudaErrorInvalidValue) {
      // A shape the decode kernel does not take (checked before anything is enqueued).
      otherwise(first);
      return;
    }
    launched(status, "decode attention",
             decode_attention_launches(query, cache, splits, workspace));
  }
  produced(out, companions);
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
  backend->set_activation_mode(options.activations);
  if (Status created = backend->status(); !created.ok()) return created.error();
  return std::unique_ptr<engine::Backend>(std::move(backend));
}

}  // namespace gemma4::cuda
