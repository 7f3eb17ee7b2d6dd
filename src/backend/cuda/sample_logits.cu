#include <cuda_runtime.h>

#include "backend/cuda/launch.cuh"
#include "backend/cuda/sample_logits.h"

namespace gemma4::cuda {
namespace {

constexpr int kWarps = kRankThreads / 32;
constexpr int kKeysPerThread = kRankChunk / kRankThreads;
// Chunk keys one thread of the merge holds: every chunk's candidates of one row.
constexpr int kMergeKeysPerThread = kRankMaxChunks * kRankMaxCandidates / kRankThreads;

__device__ __forceinline__ uint64_t rank_key(float logit, int32_t token) {
  // -0 ranks as +0: the host compares logits with ==, under which they are equal.
  const uint32_t bits = logit == 0.0f ? 0u : __float_as_uint(logit);
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(ordered) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(token));
}

__device__ __forceinline__ float key_logit(uint64_t key) {
  return __uint_as_float(rank_key_logit_bits(key));
}

__device__ __forceinline__ uint64_t warp_max(uint64_t v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint64_t other = __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// The block's `count` largest keys of keys[] (all threads' together), largest first, into
// out[0 .. count) (0 once the keys run out). Round c takes the largest key below round c-1's:
// keys are distinct, so no key is taken twice and none is skipped.
template <int N>
__device__ void block_top_keys(const uint64_t (&keys)[N], int count, uint64_t* out,
                               uint64_t* warp_best) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint64_t below = ~uint64_t{0};
  for (int c = 0; c < count; ++c) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (keys[i] < below && keys[i] > best) best = keys[i];
    }
    best = warp_max(best);
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    best = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    __syncthreads();  // warp_best is written again next round
    if (threadIdx.x == 0) out[c] = best;
    below = best;
  }
}

__device__ double block_sum(double v, double* warp_sums) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  return total;
}

struct ChunkScratch {
  uint64_t* keys;  // [rows][chunks][candidates]
  double* sums;    // [rows][chunks]: Σ exp(logit - chunk max)
  float* maxima;   // [rows][chunks]
};

ChunkScratch chunk_scratch(void* scratch, int rows, int chunks, int candidates) {
  auto* keys = static_cast<uint64_t*>(scratch);
  auto* sums = reinterpret_cast<double*>(keys + int64_t{rows} * chunks * candidates);
  auto* maxima = reinterpret_cast<float*>(sums + int64_t{rows} * chunks);
  return {keys, sums, maxima};
}

__device__ __forceinline__ int64_t row_index(const RankRows& rows, int r) {
  return rows.rows != nullptr ? rows.rows[r] : r;
}

__global__ void apply_edits(RankRows rows, const RankEdit* edits, int count) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const RankEdit e = edits[i];
  float& logit = rows.logits[row_index(rows, e.row) * rows.stride + e.token];
  float l = logit + e.bias;
  l = l > 0 ? l / e.repetition_penalty : l * e.repetition_penalty;
  logit = l - e.subtract;
}

// grid (chunks, rows): one chunk of one row.
__global__ void __launch_bounds__(kRankThreads) rank_chunks(RankRows rows, ChunkScratch out) {
  __shared__ uint64_t warp_best[kWarps];
  __shared__ double warp_sums[kWarps];
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int chunk = blockIdx.x, row = blockIdx.y, chunks = gridDim.x;
  const float* logits = rows.logits + row_index(rows, row) * rows.stride;
  const int first = chunk * kRankChunk + threadIdx.x;
  float values[kKeysPerThread];
  uint64_t keys[kKeysPerThread];
#pragma unroll
  for (int i = 0; i < kKeysPerThread; ++i) {
    const int token = first + i * kRankThreads;
    values[i] = token < rows.vocab ? logits[token] : -INFINITY;
    keys[i] = token < rows.vocab ? rank_key(values[i], token) : 0;
  }
  const int64_t slot = int64_t{row} * chunks + chunk;
  __shared__ uint64_t top[kRankMaxCandidates];
  block_top_keys(keys, rows.candidates, top, warp_best);
  __syncthreads();
  for (int c = threadIdx.x; c < rows.candidates; c += kRankThreads)
    out.keys[slot * rows.candidates + c] = top[c];
  // The chunk's max is its best key's logit; a chunk of -inf (or past the vocabulary) adds 0.
  const float chunk_max = top[0] != 0 ? key_logit(top[0]) : -INFINITY;
  double sum = 0.0;
  if (chunk_max != -INFINITY) {
#pragma unroll
    for (int i = 0; i < kKeysPerThread; ++i) {
      if (keys[i] != 0) sum += exp(static_cast<double>(values[i]) - chunk_max);
    }
  }
  sum = block_sum(sum, warp_sums);
  if (threadIdx.x == 0) {
    out.sums[slot] = sum;
    out.maxima[slot] = chunk_max;
  }
}

// One block per row: the best of every chunk's candidates, and the row's normaliser.
__global__ void __launch_bounds__(kRankThreads)
    merge_chunks(RankRows rows, ChunkScratch chunks_in, int chunks, uint64_t* top_keys,
                 double* log_normalisers, GreedyFeed feed) {
  __shared__ uint64_t warp_best[kWarps];
  __shared__ double warp_sums[kWarps];
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int row = blockIdx.x;
  const int total = chunks * rows.candidates;
  const uint64_t* keys_in = chunks_in.keys + int64_t{row} * total;
  uint64_t keys[kMergeKeysPerThread];
#pragma unroll
  for (int i = 0; i < kMergeKeysPerThread; ++i) {
    const int k = threadIdx.x + i * kRankThreads;
    keys[i] = k < total ? keys_in[k] : 0;
  }
  __shared__ uint64_t top[kRankMaxCandidates];
  block_top_keys(keys, rows.candidates, top, warp_best);
  __syncthreads();
  for (int c = threadIdx.x; c < rows.candidates; c += kRankThreads)
    top_keys[int64_t{row} * rows.candidates + c] = top[c];
  if (feed.token_ids != nullptr && threadIdx.x == 0) {
    feed.token_ids[row] = rank_key_token(top[0]);
    feed.positions[row] += 1;
  }
  const float row_max = key_logit(top[0]);
  double sum = 0.0;
  for (int c = threadIdx.x; c < chunks; c += kRankThreads) {
    const float chunk_max = chunks_in.maxima[int64_t{row} * chunks + c];
    if (chunk_max != -INFINITY) {
      sum +=
          chunks_in.sums[int64_t{row} * chunks + c] * exp(static_cast<double>(chunk_max) - row_max);
    }
  }
  sum = block_sum(sum, warp_sums);
  if (threadIdx.x == 0) log_normalisers[row] = static_cast<double>(row_max) + log(sum);
}

int chunk_count(int vocab) {
  return (vocab + kRankChunk - 1) / kRankChunk;
}

}  // namespace

int64_t rank_scratch_bytes(int rows, int vocab, int candidates) {
  const int64_t slots = int64_t{rows} * chunk_count(vocab);
  return slots * candidates * sizeof(uint64_t) + slots * (sizeof(double) + sizeof(float));
}

cudaError_t rank_logits(const RankRows& rows, const RankEdit* edits, int edit_count, void* scratch,
                        uint64_t* top_keys, double* log_normalisers, const Launch& launch,
                        const GreedyFeed& feed) {
  const int chunks = chunk_count(rows.vocab);
  if (rows.count < 1 || rows.vocab < 1 || chunks > kRankMaxChunks || rows.candidates < 1 ||
      rows.candidates > kRankMaxCandidates || rows.count > 65535)
    return cudaErrorInvalidValue;
  if ((feed.token_ids == nullptr) != (feed.positions == nullptr)) return cudaErrorInvalidValue;
  if (edit_count > 0) {
    const cudaError_t status =
        launch_kernel(apply_edits, dim3((edit_count + kRankThreads - 1) / kRankThreads),
                      dim3(kRankThreads), 0, launch, rows, edits, edit_count);
    if (status != cudaSuccess) return status;
  }
  const ChunkScratch chunk_out = chunk_scratch(scratch, rows.count, chunks, rows.candidates);
  cudaError_t status = launch_kernel(rank_chunks, dim3(chunks, rows.count), dim3(kRankThreads), 0,
                                     launch, rows, chunk_out);
  if (status != cudaSuccess) return status;
  return launch_kernel(merge_chunks, dim3(rows.count), dim3(kRankThreads), 0, launch, rows,
                       chunk_out, chunks, top_keys, log_normalisers, feed);
}

}  // namespace gemma4::cuda
