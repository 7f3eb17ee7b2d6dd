// CudaBackend::enqueue_greedy / wait_greedy: the greedy ranking (sample_logits.h, one candidate,
// GreedyFeed) on the main stream, the tokens' copy on GreedyChain's stream.
#include "backend/cuda/greedy_chain.h"

#include <cuda_runtime.h>

#include <bit>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/replay_timer.h"

namespace gemma4::cuda {

GreedyChain::~GreedyChain() {
  if (copy_stream != nullptr) cudaStreamSynchronize(copy_stream);
  for (Slot& slot : slots) {
    for (cudaEvent_t event : {slot.ranked, slot.copied}) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }
  if (copy_stream != nullptr) cudaStreamDestroy(copy_stream);
}

cudaError_t GreedyChain::start() {
  cudaError_t status = cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking);
  for (Slot& slot : slots) {
    for (cudaEvent_t* event : {&slot.ranked, &slot.copied}) {
      if (status == cudaSuccess) status = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
    }
  }
  return status;
}

namespace {

// Offsets of one enqueue_greedy's pieces in the ranking scratch: every slot's ranking (its rows'
// best keys, then their log-normalisers: one copy; a slot's copy may still read them while the
// next step ranks into the other slot), then the ranking's own scratch.
struct GreedyLayout {
  size_t slots[engine::Backend::kGreedySlots] = {};
  size_t slot_bytes = 0;  // keys and normalisers of one slot
  size_t scratch = 0, end = 0;

  GreedyLayout(int64_t rows, int vocab) {
    const auto align = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
    slot_bytes = (sizeof(uint64_t) + sizeof(double)) * static_cast<size_t>(rows);
    size_t at = 0;
    for (size_t& slot : slots) {
      slot = at;
      at += align(slot_bytes);
    }
    scratch = at;
    end = scratch + rank_scratch_bytes(static_cast<int>(rows), vocab, 1);
  }
};

}  // namespace

void CudaBackend::enqueue_greedy(engine::Rows logits, int32_t* token_ids, int32_t* positions,
                                 std::span<engine::GreedyToken> tokens, int slot) {
  if (logits.width > int64_t{kRankChunk} * kRankMaxChunks || logits.count > 65535) {
    Backend::enqueue_greedy(logits, token_ids, positions, tokens, slot);
    return;
  }
  if (logits.count < 1 || slot < 0 || slot >= kGreedySlots || !status_.ok()) return;
  if (greedy_chain_ == nullptr) {
    cudaSetDevice(device_);
    auto chain = std::make_unique<GreedyChain>();
    check(chain->start(), "greedy chain (stream and events)");
    if (!status_.ok()) return;
    greedy_chain_ = std::move(chain);
  }
  GreedyChain::Slot& s = greedy_chain_->slots[slot];
  const int64_t count = logits.count;
  const GreedyLayout layout(count, static_cast<int>(logits.width));
  // Growing the scratch frees it: no copy may still read a slot's ranking.
  if (layout.end > ranking_.bytes) {
    for (int other = 0; other < kGreedySlots; ++other) wait_greedy(other);
  }
  auto* device = static_cast<char*>(scratch(ranking_, layout.end));
  if (s.pending) wait_greedy(slot);
  auto* host = static_cast<char*>(s.host.reserve(layout.slot_bytes));
  if (device == nullptr) return;  // scratch() recorded the failure
  if (host == nullptr) {
    fail(ErrorCode::kResourceExhausted,
         fmt::format("CUDA backend: no {} bytes of pinned host memory", layout.slot_bytes));
    return;
  }
  const Launch on = launch();
  RankRows ranked;
  ranked.logits = logits.data;
  ranked.count = static_cast<int>(count);
  ranked.stride = logits.stride;
  ranked.vocab = static_cast<int>(logits.width);
  ranked.candidates = 1;
  char* ranking = device + layout.slots[slot];
  auto* keys = reinterpret_cast<uint64_t*>(ranking);
  launched(
      rank_logits(ranked, nullptr, 0, device + layout.scratch, keys,
                  reinterpret_cast<double*>(keys + count), on, GreedyFeed{token_ids, positions}),
      "enqueue_greedy", 2);
  if (timing_replays_) replay_timer_->step_end(on.stream);
  const cudaStream_t copy = greedy_chain_->copy_stream;
  check(cudaEventRecord(s.ranked, on.stream), "enqueue_greedy (ranked)");
  check(cudaStreamWaitEvent(copy, s.ranked, 0), "enqueue_greedy (copy waits)");
  check(cudaMemcpyAsync(host, ranking, layout.slot_bytes, cudaMemcpyDeviceToHost, copy),
        "enqueue_greedy (copy)");
  check(cudaEventRecord(s.copied, copy), "enqueue_greedy (copied)");
  s.keys = reinterpret_cast<const uint64_t*>(host);
  s.log_normalisers = reinterpret_cast<const double*>(s.keys + count);
  s.destination = tokens.first(static_cast<size_t>(count));
  s.pending = status_.ok();
}

void CudaBackend::wait_greedy(int slot) {
  if (greedy_chain_ == nullptr || slot < 0 || slot >= kGreedySlots) return;
  GreedyChain::Slot& s = greedy_chain_->slots[slot];
  if (!s.pending) return;
  s.pending = false;
  cudaSetDevice(device_);
  check(cudaEventSynchronize(s.copied), "wait_greedy");
  if (timing_replays_) replay_timer_->step_done();
  if (!status_.ok()) return;
  for (size_t r = 0; r < s.destination.size(); ++r) {
    s.destination[r] = {rank_key_token(s.keys[r]),
                        std::bit_cast<float>(rank_key_logit_bits(s.keys[r])), s.log_normalisers[r]};
  }
}

}  // namespace gemma4::cuda
