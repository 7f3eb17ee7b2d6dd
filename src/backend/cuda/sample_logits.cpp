// CudaBackend::summarize_logits: the host side of sample_logits.cu.
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/replay_timer.h"

namespace gemma4::cuda {

PinnedStaging::~PinnedStaging() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

void* PinnedStaging::reserve(size_t bytes) {
  if (bytes <= bytes_) return data_;
  if (data_ != nullptr) cudaFreeHost(data_);
  data_ = nullptr;
  bytes_ = 0;
  if (cudaMallocHost(&data_, bytes) != cudaSuccess) {
    cudaGetLastError();
    data_ = nullptr;
    return nullptr;
  }
  bytes_ = bytes;
  return data_;
}

namespace {

// Offsets of one summarize_logits call's pieces in its device buffer (and, for the inputs and
// results, in the pinned staging, which mirrors the same layout up to `scratch`).
struct RankingLayout {
  size_t rows = 0, edits = 0, keys = 0, normalisers = 0, scratch = 0, end = 0;

  RankingLayout(int64_t row_count, int64_t edit_count, int candidates, int vocab) {
    const auto align = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
    edits = align(sizeof(int64_t) * row_count);
    keys = edits + align(sizeof(RankEdit) * edit_count);
    normalisers = keys + align(sizeof(uint64_t) * row_count * candidates);
    scratch = normalisers + align(sizeof(double) * row_count);
    end = scratch + rank_scratch_bytes(static_cast<int>(row_count), vocab, candidates);
  }
};

}  // namespace

void CudaBackend::summarize_logits(engine::Rows logits,
                                   std::span<const engine::LogitRowRequest> rows,
                                   std::span<engine::LogitSummary> summaries) {
  if (rows.empty()) return;
  int candidates = 0;
  size_t edit_count = 0;
  for (const auto& row : rows) {
    candidates = std::max(candidates, row.request.candidates);
    edit_count += row.request.edits.size();
  }
  if (logits.width > int64_t{kRankChunk} * kRankMaxChunks || candidates > kRankMaxCandidates ||
      rows.size() > 65535) {
    Backend::summarize_logits(logits, rows, summaries);
    return;
  }
  const auto count = static_cast<int64_t>(rows.size());
  const RankingLayout layout(count, static_cast<int64_t>(edit_count), candidates,
                             static_cast<int>(logits.width));
  auto* device = static_cast<char*>(scratch(ranking_, layout.end));
  auto* host = static_cast<char*>(ranking_host_.reserve(layout.scratch));
  if (device == nullptr) return;  // scratch() recorded the failure
  if (host == nullptr) {
    fail(ErrorCode::kResourceExhausted,
         fmt::format("CUDA backend: no {} bytes of pinned host memory", layout.scratch));
    return;
  }
  auto* row_index = reinterpret_cast<int64_t*>(host);
  auto* edits = reinterpret_cast<RankEdit*>(host + layout.edits);
  size_t e = 0;
  for (int64_t r = 0; r < count; ++r) {
    row_index[r] = rows[r].row;
    for (const engine::LogitEdit& edit : rows[r].request.edits) {
      edits[e++] = {static_cast<int32_t>(r), edit.token, edit.bias, edit.repetition_penalty,
                    edit.subtract};
    }
  }
  const Launch on = launch();
  check(cudaMemcpyAsync(device, host, layout.keys, cudaMemcpyHostToDevice, on.stream),
        "summarize_logits (upload)");
  RankRows ranked;
  ranked.logits = logits.data;
  ranked.rows = reinterpret_cast<const int64_t*>(device);
  ranked.count = static_cast<int>(count);
  ranked.stride = logits.stride;
  ranked.vocab = static_cast<int>(logits.width);
  ranked.candidates = candidates;
  auto* keys = reinterpret_cast<uint64_t*>(device + layout.keys);
  auto* normalisers = reinterpret_cast<double*>(device + layout.normalisers);
  launched(
      rank_logits(ranked, reinterpret_cast<const RankEdit*>(device + layout.edits),
                  static_cast<int>(edit_count), device + layout.scratch, keys, normalisers, on),
      "summarize_logits", edit_count > 0 ? 3 : 2);
  check(cudaMemcpyAsync(host + layout.keys, keys, layout.scratch - layout.keys,
                        cudaMemcpyDeviceToHost, on.stream),
        "summarize_logits (download)");
  if (timing_replays_) replay_timer_->step_end(on.stream);
  check(cudaStreamSynchronize(on.stream), "summarize_logits (synchronize)");
  if (timing_replays_) replay_timer_->all_steps_done();
  if (!status_.ok()) return;

  const auto* top_keys = reinterpret_cast<const uint64_t*>(host + layout.keys);
  const auto* log_normalisers = reinterpret_cast<const double*>(host + layout.normalisers);
  for (int64_t r = 0; r < count; ++r) {
    engine::LogitSummary& summary = summaries[r];
    summary.top.clear();
    for (int c = 0; c < rows[r].request.candidates; ++c) {
      const uint64_t key = top_keys[r * candidates + c];
      if (key == 0) break;
      summary.top.emplace_back(rank_key_token(key), std::bit_cast<float>(rank_key_logit_bits(key)));
    }
    summary.max_logit = summary.top.empty() ? 0.0f : summary.top.front().second;
    summary.log_normaliser = log_normalisers[r];
  }
}

}  // namespace gemma4::cuda
