// Ranking rows of logits on the device (engine::Backend::summarize_logits): the sparse logit
// edits of each row, then its top-C tokens and log-normaliser, so only a few candidates per row
// cross to the host. Plain parameter blocks (nvcc-friendly); all pointers are device pointers.
//
// A token is ranked by a 64-bit key: the order-preserving bits of its logit (-0 taken as +0, as
// the host's comparison does) above the complement of its id, so larger keys are more likely
// and equal logits put the lower id first; 0 marks "no candidate". Two launches per batch: each
// block takes a chunk of kRankChunk tokens of one row and writes the chunk's C best keys, its
// max and Σ exp(logit - max) (double); one block per row then merges the chunks.
#pragma once

#include <cstdint>

#include "backend/cuda/launch.h"

namespace gemma4::cuda {

inline constexpr int kRankThreads = 256;
inline constexpr int kRankChunk = kRankThreads * 8;  // tokens per block of the first launch
inline constexpr int kRankMaxChunks = 128;           // so the largest vocabulary is 262,144
inline constexpr int kRankMaxCandidates = 64;

// One engine::LogitEdit of row `row` (an index into RankRows::rows).
struct RankEdit {
  int32_t row = 0;
  int32_t token = 0;
  float bias = 0.0f;
  float repetition_penalty = 1.0f;
  float subtract = 0.0f;
};

struct RankRows {
  float* logits = nullptr;        // row r of the batch starts at logits + rows[r] * stride
  const int64_t* rows = nullptr;  // [count]; null: rows[r] = r
  int count = 0;
  int64_t stride = 0;
  int vocab = 0;       // at most kRankChunk * kRankMaxChunks
  int candidates = 0;  // 1 .. kRankMaxCandidates, the same for every row
};

// Chained greedy decoding (CudaBackend::enqueue_greedy): what rank_logits' last launch also
// writes per row r: token_ids[r] = the token of the row's best key, and positions[r] += 1. Both
// null: nothing.
struct GreedyFeed {
  int32_t* token_ids = nullptr;
  int32_t* positions = nullptr;
};

// Device scratch of rank_logits for `rows` rows of `vocab` tokens with `candidates` candidates.
int64_t rank_scratch_bytes(int rows, int vocab, int candidates);

// Applies `edits` (edit_count of them, at most one per token of a row) to the rows, then writes
// per row r: top_keys[r * candidates + c] (the c-th best key, 0 past the vocabulary) and
// log_normalisers[r] = max + log Σ exp(logit - max). `scratch`: rank_scratch_bytes of device
// memory. Three launches (two without edits).
cudaError_t rank_logits(const RankRows& rows, const RankEdit* edits, int edit_count, void* scratch,
                        uint64_t* top_keys, double* log_normalisers, const Launch& launch,
                        const GreedyFeed& feed = {});

#ifdef __CUDACC__
#define GEMMA4_RANK_HOST_DEVICE __host__ __device__
#else
#define GEMMA4_RANK_HOST_DEVICE
#endif

// A key's token id and the bits of its logit (host and device).
GEMMA4_RANK_HOST_DEVICE inline int32_t rank_key_token(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}
GEMMA4_RANK_HOST_DEVICE inline uint32_t rank_key_logit_bits(uint64_t key) {
  const auto ordered = static_cast<uint32_t>(key >> 32);
  return (ordered & 0x80000000u) ? (ordered & 0x7FFFFFFFu) : ~ordered;
}

#undef GEMMA4_RANK_HOST_DEVICE

// Page-locked host memory that grows on demand (what rank_logits' inputs are staged in and its
// results copied to, so the copies are true async DMA).
class PinnedStaging {
 public:
  PinnedStaging() = default;
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;
  ~PinnedStaging();
  // At least `bytes` (contents not kept), or null when page-locked memory ran out.
  void* reserve(size_t bytes);

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace gemma4::cuda
