// The streaming single-row GEMV (gemv_stream_kernels.h describes the method).
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/gemv_kernel.cuh"
#include "backend/cuda/gemv_stream_kernels.h"
#include "backend/cuda/kernel_table.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/occupancy.cuh"

namespace gemma4::cuda {
namespace gemv_stream_detail {

constexpr int kTileRows = kGemvStreamTileRows;

// The pairs (128 + u_s, 128 + u_{s+4}), s = 0..3, of the nibbles of a packed word as exact bf16
// (u ORed into the low mantissa bits of bf16 128.0, 0x4300): the A slots of two mma steps.
__device__ __forceinline__ void biased_nibble_pairs(uint32_t word, uint32_t (&pairs)[4]) {
  const uint32_t magic = 0x43004300u;
  pairs[0] = and_or<0x000F000Fu>(word, magic);
  pairs[1] = and_or<0x000F000Fu>(word >> 4, magic);
  pairs[2] = and_or<0x000F000Fu>(word >> 8, magic);
  pairs[3] = and_or<0x000F000Fu>(word >> 12, magic);
}

// Activations 8p .. 8p + 7 as bf16 (kF32: rounded, ties to even) in the B order, pairs
// (v0, v4), (v1, v5), (v2, v6), (v3, v7); `sum` gets Σ of the 8 bf16 values in fp32.
template <ActType XT>
__device__ __forceinline__ uint4 staged_piece(const void* x, int64_t p, float& sum) {
  uint4 word;
  if constexpr (XT == ActType::kBF16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(x) + p);
    word = make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                      __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
  } else {
    const float4* source = reinterpret_cast<const float4*>(x) + 2 * p;
    const float4 lo = __ldg(source), hi = __ldg(source + 1);
    word = make_uint4(pack_bf16x2(lo.x, hi.x), pack_bf16x2(lo.y, hi.y), pack_bf16x2(lo.z, hi.z),
                      pack_bf16x2(lo.w, hi.w));
  }
  float values[8];
  unpack_bf16x8(word, values);
  sum = ((values[0] + values[1]) + (values[2] + values[3])) +
        ((values[4] + values[5]) + (values[6] + values[7]));
  return word;
}

// Stages `chunks` chunks of the activation row from chunk `first` on (kF32: rounded to bf16) in
// the B order of staged_piece, 64 bytes a chunk, with each chunk's bias −136 · Σx, and zeroes
// zero_chunk (64 bytes), by threads thread = 0 .. threads − 1 (whole warps, so that a chunk's 4
// pieces are a lane quad's). The caller synchronizes the threads.
template <ActType XT>
__device__ __forceinline__ void stage_activations(const void* x, int64_t first, int64_t chunks,
                                                  uint4* staged_x, float* x_biases,
                                                  uint4* zero_chunk, int thread, int threads) {
  const int64_t pieces = 4 * chunks;
  const int64_t rounds = (pieces + threads - 1) / threads;
#pragma unroll 8
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t p = round * threads + thread;
    float sum = 0.0f;
    if (p < pieces) staged_x[p] = staged_piece<XT>(x, 4 * first + p, sum);
    // pieces and threads are multiples of 4, so a quad of lanes is valid or not as a whole.
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
    if (p < pieces && (p & 3) == 0) x_biases[p / 4] = -136.0f * sum;
  }
  if (thread < 4) zero_chunk[thread] = make_uint4(0, 0, 0, 0);
}

// Two adjacent bf16 or fp16 scales (quant::ScaleType 0 or 1), the low half first, as fp32.
__device__ __forceinline__ float2 scale_pair(uint32_t bits, int scale_type) {
  if (scale_type == kScaleF16) return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xFFFF0000u));
}

// Adds the products of `steps` quads of a 16-row slice in shared memory (the weights of row r at
// weights + r · pitch, its scales at scales + r · scale_pitch, both from the slice's first chunk)
// to lane (g, t)'s partial sums of rows g and g + 8 (the quad's lanes t = 0, 1 hold them; t = 2,
// 3 hold discarded values). x_slice: the staged activations of the slice's first chunk (64 bytes
// a chunk), bias_slice its first chunk's bias. KC: the steps a whole slice has (unrolled).
template <int KC>
__device__ __forceinline__ void multiply_slice(const uint8_t* weights, int pitch,
                                               const uint8_t* scales, int scale_pitch, int steps,
                                               const uint4* x_slice, const uint4* zero_chunk,
                                               const float* bias_slice, int scale_type, int g,
                                               int t, float& acc_g, float& acc_g8) {
  // Step `step` of the slice: chunks 4·step .. 4·step + 3 of the 16 rows.
  auto multiply_step = [&](int step) {
    const int chunk = 4 * step + t;  // in the stage
    const uint4 w_g = *reinterpret_cast<const uint4*>(weights + g * pitch + chunk * 16);
    const uint4 w_g8 = *reinterpret_cast<const uint4*>(weights + (g + 8) * pitch + chunk * 16);
    const uint4* x_words = g == t ? x_slice + 4 * chunk : zero_chunk;
    const uint32_t row_g[4] = {w_g.x, w_g.y, w_g.z, w_g.w};
    const uint32_t row_g8[4] = {w_g8.x, w_g8.y, w_g8.z, w_g8.w};
    // Column n = 2t + h of the product holds quad lane n's chunk 4·step + n; lanes t >= 2
    // hold the zero columns 4..7 and read lane t − 2's scales and biases (discarded).
    const int column_chunk = 4 * step + 2 * (t & 1);
    const float2 bias = *reinterpret_cast<const float2*>(bias_slice + column_chunk);
    // Two accumulator chains (packed words 0-1 and 2-3) halve the dependent mma latency; the
    // first starts from the bias, so each column ends as Σ(u − 8)·x over its chunk.
    float c[2][4] = {{bias.x, bias.y, bias.x, bias.y}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 xw = x_words[i];
      uint32_t pg[4], pg8[4];
      biased_nibble_pairs(row_g[i], pg);
      biased_nibble_pairs(row_g8[i], pg8);
      mma_bf16(c[i / 2], {pg[0], pg8[0], pg[1], pg8[1]}, xw.x, xw.y);
      mma_bf16(c[i / 2], {pg[2], pg8[2], pg[3], pg8[3]}, xw.z, xw.w);
    }
    const uint8_t* scales_g = scales + g * scale_pitch + column_chunk * 2;
    const float2 scale_g = scale_pair(*reinterpret_cast<const uint32_t*>(scales_g), scale_type);
    const float2 scale_g8 =
        scale_pair(*reinterpret_cast<const uint32_t*>(scales_g + 8 * scale_pitch), scale_type);
    acc_g = fmaf(scale_g.x, c[0][0] + c[1][0], acc_g);
    acc_g = fmaf(scale_g.y, c[0][1] + c[1][1], acc_g);
    acc_g8 = fmaf(scale_g8.x, c[0][2] + c[1][2], acc_g8);
    acc_g8 = fmaf(scale_g8.y, c[0][3] + c[1][3], acc_g8);
  };
  if (steps == KC / 4) {  // a whole slice: unrolled, so that steps overlap
#pragma unroll
    for (int step = 0; step < KC / 4; ++step) multiply_step(step);
  } else {
    for (int step = 0; step < steps; ++step) multiply_step(step);
  }
}

template <ActType XT, int W, int KC, int S, int P, bool B, bool L2>
__global__ void __launch_bounds__(W * 32) gemv_stream_kernel(GemvArgs a) {
  static_assert(KC % 4 == 0 && KC <= 32, "slices of whole quads, at most 32 chunks");
  static_assert(S >= 2, "a ring needs a stage in flight");
  static_assert(P >= 1 && P <= 8, "a portable cluster");
  constexpr GemvStreamTiling kTiling = {W, KC, S, P, B, L2};
  constexpr int kPitch = static_cast<int>(gemv_stream_row_pitch(kTiling));
  constexpr int kStageBytes = static_cast<int>(gemv_stream_stage_bytes(kTiling));
  constexpr int kScalesOffset = kTileRows * kPitch;  // within a stage
  pdl_trigger_dependents();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t cpr = a.chunks_per_row;
  const int64_t tiles = (a.rows + kTileRows - 1) / kTileRows;
  const int my_tiles = static_cast<int>((tiles - blockIdx.x + gridDim.x - 1) / gridDim.x);
  // This block's part of K (split = its rank in the cluster, blockIdx.y) and this warp's run of
  // it: whole quads, the parts and the runs differing by at most one quad.
  namespace cg = cooperative_groups;
  const int split = P > 1 ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int64_t quads = cpr / 4;
  const int64_t part_begin = quads * split / P;
  const int64_t part_quads = quads * (split + 1) / P - part_begin;
  const int64_t block_k = 4 * part_begin;  // the block's first chunk
  const int64_t block_chunks = 4 * part_quads;
  const int64_t k_begin = block_k + 4 * (part_quads * warp / W);
  const int64_t k_end = block_k + 4 * (part_quads * (warp + 1) / W);
  const int slices = static_cast<int>((k_end - k_begin + KC - 1) / KC);
  const int items = my_tiles * slices;

  extern __shared__ uint4 stream_shared[];
  float* partial = reinterpret_cast<float*>(stream_shared);  // [2][W][16]
  // (block_chunks + 1) · 4 words: the block's chunk c at 4 · (c − block_k), then zeros.
  uint4* staged_x = stream_shared + 2 * W * kTileRows / 4;
  uint4* zero_chunk = staged_x + 4 * block_chunks;
  // −136 · Σx per chunk: a biased chunk sum Σ(128 + u)·x plus this is Σ(u − 8)·x.
  float* x_biases = reinterpret_cast<float*>(zero_chunk + 4);
  uint8_t* rings = reinterpret_cast<uint8_t*>(x_biases + (block_chunks + 3) / 4 * 4);
  uint8_t* ring = rings + static_cast<int64_t>(warp) * S * kStageBytes;
  // Bulk copies: the warp's S stage barriers; phase i / S of stage i % S is item i's.
  uint64_t* barriers = reinterpret_cast<uint64_t*>(rings + int64_t{W} * S * kStageBytes) + warp * S;
  if constexpr (B) {
    if (lane == 0) {
      for (int stage = 0; stage < S; ++stage) init_barrier(barriers + stage);
      fence_barrier_init();
    }
    __syncwarp();
  }

  // Slice `item` of this warp's sequence (tile item / slices, slice item % slices) into its stage:
  // lane l copies the 16-byte chunks l, l + 32, ... of the 16 × KC (row-major) and the 8-byte
  // scale pieces (4 chunks) l, l + 32, ... of the 16 × KC / 4. Rows past a.rows are not copied
  // (their sums are never stored).
  const uint8_t* weights = static_cast<const uint8_t*>(a.weights);
  const uint8_t* scales = static_cast<const uint8_t*>(a.scales);
  auto issue = [&](int item) {
    if (item < items) {
      const int64_t row0 =
          (blockIdx.x + static_cast<int64_t>(item / slices) * gridDim.x) * kTileRows;
      const int64_t kc0 = k_begin + static_cast<int64_t>(item % slices) * KC;
      const int kc = static_cast<int>(min(static_cast<int64_t>(KC), k_end - kc0));
      uint8_t* stage = ring + (item % S) * kStageBytes;
      if constexpr (B) {
        // Lane r < 16 copies row r's piece; lane 0 first announces the bytes of them all.
        uint64_t* barrier = barriers + item % S;
        const int valid_rows = static_cast<int>(min(int64_t{kTileRows}, a.rows - row0));
        if (lane == 0) arrive_expect_bytes(barrier, static_cast<uint32_t>(valid_rows * kc * 16));
        __syncwarp();
        if (lane < valid_rows) {
          fence_proxy_async();  // after the warp's reads of this stage (the __syncwarp before)
          copy_bulk(stage + lane * kPitch, weights + ((row0 + lane) * cpr + kc0) * 16,
                    static_cast<uint32_t>(kc * 16), barrier);
        }
      } else {
        constexpr int kCopies = kTileRows * KC;
#pragma unroll
        for (int pass = 0; pass < (kCopies + 31) / 32; ++pass) {
          const int index = 32 * pass + lane;
          const int r = index / KC, c = index % KC;
          if (index < kCopies && c < kc && row0 + r < a.rows) {
            uint8_t* to = stage + r * kPitch + c * 16;
            const uint8_t* from = weights + ((row0 + r) * cpr + kc0 + c) * 16;
            if constexpr (L2) {
              copy_async16_l2_256(to, from);
            } else {
              copy_async16(to, from);
            }
          }
        }
      }
      constexpr int kPieces = kTileRows * KC / 4;
#pragma unroll
      for (int pass = 0; pass < (kPieces + 31) / 32; ++pass) {
        const int index = 32 * pass + lane;
        const int r = index / (KC / 4), c = 4 * (index % (KC / 4));
        if (index < kPieces && c < kc && row0 + r < a.rows) {
          copy_async8(stage + kScalesOffset + (r * KC + c) * 2,
                      scales + ((row0 + r) * cpr + kc0 + c) * 2);
        }
      }
    }
    commit_copies();  // one group per item, empty past the end: the waits count items
  };

  // Weights never depend on the previous kernel: the first slices go out before the wait.
#pragma unroll
  for (int item = 0; item < S - 1; ++item) issue(item);
  pdl_wait_for_predecessors();

  stage_activations<XT>(a.x, block_k, block_chunks, staged_x, x_biases, zero_chunk, threadIdx.x,
                        W * 32);
  __syncthreads();

  int item = 0;
  for (int j = 0; j < my_tiles; ++j) {
    const int64_t row0 = (blockIdx.x + static_cast<int64_t>(j) * gridDim.x) * kTileRows;
    // Lanes t = 0, 1: rows g and g + 8 over the chunks of columns 2t, 2t + 1.
    float acc_g = 0.0f, acc_g8 = 0.0f;
    for (int slice = 0; slice < slices; ++slice, ++item) {
      wait_copies<S - 2>();  // this lane's copies of `item` have landed
      if constexpr (B) wait_barrier(barriers + item % S, (item / S) & 1);  // and the bulk ones
      __syncwarp();  // and every lane's; the stage read last is free
      issue(item + S - 1);
      const int64_t kc0 = k_begin + static_cast<int64_t>(slice) * KC;
      const int steps = static_cast<int>(min(static_cast<int64_t>(KC), k_end - kc0)) / 4;
      const uint8_t* stage = ring + (item % S) * kStageBytes;
      multiply_slice<KC>(stage, kPitch, stage + kScalesOffset, 2 * KC, steps,
                         staged_x + 4 * (kc0 - block_k), zero_chunk, x_biases + (kc0 - block_k),
                         a.scale_type, g, t, acc_g, acc_g8);
    }
    // The tile's end: rows g, g + 8 of this warp's run in lane (g, 0), the runs of the block's
    // warps (and of the cluster's blocks) added in shared memory by warp 0 of rank 0. Two
    // buffers by tile parity: a warp writes this buffer again only after the next tile's barrier,
    // which the reader passes after reading it.
    acc_g += __shfl_xor_sync(0xFFFFFFFFu, acc_g, 1);
    acc_g8 += __shfl_xor_sync(0xFFFFFFFFu, acc_g8, 1);
    float* tile_partial = partial + (j & 1) * W * kTileRows;
    if (t == 0) {
      tile_partial[warp * kTileRows + g] = acc_g;
      tile_partial[warp * kTileRows + g + 8] = acc_g8;
    }
    if constexpr (P > 1) {
      cg::this_cluster().sync();
    } else {
      __syncthreads();
    }
    if (split == 0 && warp == 0 && lane < kTileRows / 2) {
      float pair[2] = {0.0f, 0.0f};
#pragma unroll
      for (int rank = 0; rank < P; ++rank) {
        const float* source =
            P > 1 ? cg::this_cluster().map_shared_rank(tile_partial, rank) : tile_partial;
#pragma unroll
        for (int w = 0; w < W; ++w) {
          pair[0] += source[w * kTileRows + 2 * lane];
          pair[1] += source[w * kTileRows + 2 * lane + 1];
        }
      }
      gemv_detail::store_rows<2>(a, 0, row0 + 2 * lane, pair);
    }
  }
  // No block leaves while rank 0 may still read its shared memory.
  if constexpr (P > 1) cg::this_cluster().sync();
  wait_copies<0>();  // no copy outlives the block
}

// A barrier whose phases complete at `arrivals` arrivals (and no transaction bytes pending).
__device__ __forceinline__ void init_barrier_arrivals(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)),
               "r"(arrivals)
               : "memory");
}

// One arrival on a barrier, release semantics: this thread's earlier reads of the stage it guards
// are done.
__device__ __forceinline__ void arrive_barrier(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier))
               : "memory");
}

// The end of a consumer warp's tile (rows row0 .. row0 + 15) in the producer kernel: rows g,
// g + 8 of its part (warp % KS) of K in lane (g, 0) after a quad reduction. KS == 1: lane l < 8
// stores rows 2l, 2l + 1 (whole gate/up pairs). Otherwise the parts meet in round_partial
// ([W][16], this round's buffer of two by round parity: a part writes a buffer again only after
// the next round's barrier, which part 0 passes after reading it) at named barrier 2 + group;
// part 0 adds them in order and stores.
template <int W, int KS>
__device__ __forceinline__ void store_tile(const GemvArgs& a, float acc_g, float acc_g8,
                                           int64_t row0, float* round_partial, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  acc_g += __shfl_xor_sync(0xFFFFFFFFu, acc_g, 1);
  acc_g8 += __shfl_xor_sync(0xFFFFFFFFu, acc_g8, 1);
  if constexpr (KS == 1) {
    // Row q's sum is in lane 4 · (q mod 8), as acc_g for q < 8, as acc_g8 from 8 on.
    const int source = (8 * lane) & 31;  // lane 4 · (2l mod 8); the next row's is 4 on
    const float even_g = __shfl_sync(0xFFFFFFFFu, acc_g, source);
    const float even_g8 = __shfl_sync(0xFFFFFFFFu, acc_g8, source);
    const float odd_g = __shfl_sync(0xFFFFFFFFu, acc_g, source + 4);
    const float odd_g8 = __shfl_sync(0xFFFFFFFFu, acc_g8, source + 4);
    if (lane < kTileRows / 2) {
      const float pair[2] = {lane < 4 ? even_g : even_g8, lane < 4 ? odd_g : odd_g8};
      gemv_detail::store_rows<2>(a, 0, row0 + 2 * lane, pair);
    }
  } else {
    if (t == 0) {
      round_partial[warp * kTileRows + g] = acc_g;
      round_partial[warp * kTileRows + g + 8] = acc_g8;
    }
    asm volatile("bar.sync %0, %1;" ::"r"(2 + warp / KS), "n"(KS * 32) : "memory");
    if (warp % KS == 0 && lane < kTileRows / 2) {
      float pair[2] = {0.0f, 0.0f};
#pragma unroll
      for (int p = 0; p < KS; ++p) {
        pair[0] += round_partial[(warp + p) * kTileRows + 2 * lane];
        pair[1] += round_partial[(warp + p) * kTileRows + 2 * lane + 1];
      }
      gemv_detail::store_rows<2>(a, 0, row0 + 2 * lane, pair);
    }
  }
}

// The producer-warp kernel (GemvStreamTiling::producer): a block (one per SM, persistent) owns
// tiles blockIdx.x + gridDim.x · i, i < my_tiles; warp W, the producer, copies each tile's
// weights and scales as they lie in memory (two bulk copies: 16 · K/2 and 16 · K/16 contiguous
// bytes) into a ring stage, completing on the stage's full barrier. The W consumer warps form
// W / KS groups of KS: group q multiplies tiles i ≡ q (mod W / KS) through its ring of S stages,
// each of its warps its 1/KS of K (whole quads) in KC-chunk pieces; every warp of the group
// consumes every stage in order (so a barrier phase it waits on is never two ahead), and the
// stage's empty barrier counts the group's KS arrivals. The row pitch is K/2 bytes (a multiple of
// 128 at K 1536 and 5376: the weight loads of rows g and g + 1 meet in the same banks, two
// wavefronts). Per-row-piece bulk copies (session 8, tilings since removed) were 2x slower: the
// copies' count, not their bytes, limited them.
template <ActType XT, int W, int KC, int S, int KS>
__global__ void __launch_bounds__((W + 1) * 32, 1) gemv_tile_ring_kernel(GemvArgs a) {
  static_assert(KC % 4 == 0 && KC <= 64, "pieces of whole quads, at most 64 chunks");
  static_assert(S >= 2, "a ring needs a stage in flight");
  static_assert(W % KS == 0 && W / KS <= 14, "whole groups, a named barrier each");
  constexpr int kGroups = W / KS;
  pdl_trigger_dependents();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t cpr = a.chunks_per_row;
  const int64_t tiles = (a.rows + kTileRows - 1) / kTileRows;
  const int my_tiles = static_cast<int>((tiles - blockIdx.x + gridDim.x - 1) / gridDim.x);
  const int rounds = (my_tiles + kGroups - 1) / kGroups;
  const int pitch = static_cast<int>(cpr * 16);
  const int scales_offset = kTileRows * pitch;  // within a stage
  const int64_t stage_bytes = gemv_stream_whole_tile_bytes(cpr);

  extern __shared__ uint4 stream_shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(stream_shared);     // [groups][S]
  uint64_t* empty = full + kGroups * S;                            // [groups][S]
  float* partial = reinterpret_cast<float*>(empty + kGroups * S);  // [2][W][16]
  uint8_t* stages = reinterpret_cast<uint8_t*>(stream_shared) +
                    gemv_stream_whole_tile_header_bytes(kGroups * S, W);  // 128-byte aligned
  uint4* staged_x = reinterpret_cast<uint4*>(stages + kGroups * S * stage_bytes);
  uint4* zero_chunk = staged_x + 4 * cpr;
  float* x_biases = reinterpret_cast<float*>(zero_chunk + 4);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kGroups * S; ++i) {
      init_barrier(full + i);
      init_barrier_arrivals(empty + i, KS);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (warp == W) {
    // The producer: round r's tile of each group in turn, into stage r mod S of its ring.
    for (int r = 0; r < rounds; ++r) {
      for (int group = 0; group < kGroups; ++group) {
        const int tile = r * kGroups + group;
        if (tile >= my_tiles) break;
        const int stage = group * S + r % S;
        // The stage's previous tile (round r − S) has been multiplied by all KS warps: their
        // reads precede their release arrivals, which this wait acquires.
        if (r >= S) wait_barrier(empty + stage, (r / S - 1) & 1);
        const int64_t row0 = (blockIdx.x + static_cast<int64_t>(tile) * gridDim.x) * kTileRows;
        const int64_t valid_rows = min(int64_t{kTileRows}, a.rows - row0);
        uint8_t* to = stages + stage * stage_bytes;
        if (lane == 0) {
          arrive_expect_bytes(full + stage, static_cast<uint32_t>(valid_rows * cpr * 18));
          copy_bulk(to, static_cast<const uint8_t*>(a.weights) + row0 * cpr * 16,
                    static_cast<uint32_t>(valid_rows * cpr * 16), full + stage);
          copy_bulk(to + scales_offset, static_cast<const uint8_t*>(a.scales) + row0 * cpr * 2,
                    static_cast<uint32_t>(valid_rows * cpr * 2), full + stage);
        }
      }
    }
    return;  // every copy lands on a barrier that the consumers wait on
  }

  // The consumers: stage all of the activation row (named barrier 1: the producer is not in it).
  pdl_wait_for_predecessors();
  stage_activations<XT>(a.x, 0, cpr, staged_x, x_biases, zero_chunk, threadIdx.x, W * 32);
  asm volatile("bar.sync 1, %0;" ::"n"(W * 32) : "memory");

  const int g = lane >> 2, t = lane & 3;
  const int group = warp / KS, part = warp % KS;
  const int64_t quads = cpr / 4;
  const int k_begin = static_cast<int>(4 * (quads * part / KS));
  const int k_end = static_cast<int>(4 * (quads * (part + 1) / KS));
  for (int r = 0; r < rounds; ++r) {
    const int tile = r * kGroups + group;
    if (tile >= my_tiles) break;  // the group's warps all leave together
    const int stage = group * S + r % S;
    wait_barrier(full + stage, (r / S) & 1);
    const uint8_t* tile_weights = stages + stage * stage_bytes;
    float acc_g = 0.0f, acc_g8 = 0.0f;
    for (int k = k_begin; k < k_end; k += KC) {
      multiply_slice<KC>(tile_weights + k * 16, pitch, tile_weights + scales_offset + k * 2,
                         static_cast<int>(2 * cpr), min(KC, k_end - k) / 4, staged_x + 4 * k,
                         zero_chunk, x_biases + k, a.scale_type, g, t, acc_g, acc_g8);
    }
    __syncwarp();  // every lane's reads of the stage are done
    if (lane == 0) arrive_barrier(empty + stage);
    store_tile<W, KS>(a, acc_g, acc_g8,
                      (blockIdx.x + static_cast<int64_t>(tile) * gridDim.x) * kTileRows,
                      partial + (r & 1) * W * kTileRows, warp, lane);
  }
}

// The split-K producer kernel's tensor maps (kernel parameters: a tensor copy reads its map from
// parameter space): the weights as [rows][2 · chunks_per_row] 8-byte elements, the scales as
// [rows][chunks_per_row] 16-bit ones, each box a tile's part (16 rows).
struct SplitMaps {
  CUtensorMap weights;
  CUtensorMap scales;
};

// A 2-D tensor copy of `map`'s box at (column, row) into shared memory (128-byte aligned),
// completing as transaction bytes (the whole box, zeros past the tensor's edges) on `barrier`.
__device__ __forceinline__ void copy_box(void* shared, const CUtensorMap* map, int column, int row,
                                         uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(shared_address(shared)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(shared_address(barrier))
      : "memory");
}

// The shared::cluster address of `p`'s counterpart in block `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_address(const void* p, int rank) {
  uint32_t address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(address)
               : "r"(shared_address(p)), "r"(rank));
  return address;
}

// Stores the pair {first, second} at `address` (8-byte aligned) in a block of the cluster and
// completes 8 transaction bytes on that block's `barrier_address`: no fence, the barrier's phase
// completion makes the pair visible to its waiters (as a tensor copy's bytes).
__device__ __forceinline__ void store_pair_cluster(uint32_t address, float first, float second,
                                                   uint32_t barrier_address) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(
          address),
      "f"(first), "f"(second), "r"(barrier_address)
      : "memory");
}

// One arrival on a barrier of any block of the cluster, with mbarrier.arrive's default semantics
// (release at CTA scope, as CUTLASS's cluster pipelines free a stage of another block): a
// .release.cluster arrival costs a GPU-scope fence in the SASS, which under the weight stream took
// ~2 µs (EARLY test of session 9, a tile at once: 40 µs at the 31B o_proj).
__device__ __forceinline__ void arrive_cluster(uint32_t barrier_address) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(barrier_address) : "memory");
}

// The split-K producer kernel (gemv_stream_split_producer): a cluster of P blocks (one per SM)
// owns tiles c + clusters · i, i < my_tiles (c: the cluster's index); block `rank` multiplies
// their part `rank` of K. As in gemv_tile_ring_kernel, warp W copies (here two tensor boxes a
// tile part) into the rings of W / KS groups of KS consumer warps, group q taking tiles i ≡ q
// (mod W / KS), each warp 1/KS of the part's quads. A warp's 16 row sums go to rank 0's buffer
// (round r of the group: buffer r mod kBuffers) by asynchronous remote stores that complete
// transaction bytes on that buffer's full barrier (rank 0 announces all P · KS · 64 bytes); rank
// 0's warp 0 of the group adds them in (rank, warp) order a round later (after multiplying the
// next tile, so that the other blocks' sums need not be waited for), frees the buffer with an
// arrival on every rank's empty barrier for it (which a group's warps wait on before they fill it
// again) and stores.
template <ActType XT, int W, int KC, int S, int KS, int P>
__global__ void __launch_bounds__((W + 1) * 32, 1)
    gemv_split_ring_kernel(GemvArgs a, const __grid_constant__ SplitMaps maps) {
  static_assert(KC % 4 == 0 && KC <= 96, "pieces of whole quads, at most 96 chunks");
  static_assert(S >= 2, "a ring needs a stage in flight");
  static_assert(W % KS == 0, "whole groups");
  static_assert(P >= 2 && P <= 8 && P * KS * 8 <= 32 * 32, "a portable cluster");
  constexpr int kGroups = W / KS;
  constexpr int kBuffers = kGemvStreamSplitBuffers;
  constexpr GemvStreamTiling kTiling = gemv_stream_split_producer(W, KC, S, KS, P);
  pdl_trigger_dependents();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // The cluster spans the grid's P blocks along y, as gemv_stream_kernel's.
  const int rank = static_cast<int>(blockIdx.y);
  const int cluster = static_cast<int>(blockIdx.x);
  const int clusters = static_cast<int>(gridDim.x);
  const int64_t cpr = a.chunks_per_row;
  const int64_t tiles = (a.rows + kTileRows - 1) / kTileRows;
  const int my_tiles = static_cast<int>((tiles - cluster + clusters - 1) / clusters);
  const int rounds = (my_tiles + kGroups - 1) / kGroups;
  const int part_chunks = static_cast<int>(gemv_stream_split_part_chunks(kTiling, cpr));
  const int part_begin = rank * part_chunks;  // the block's first chunk
  const int part_length =
      static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(part_chunks), cpr - part_begin)));
  const int pitch = 16 * part_chunks;
  const int scale_pitch = static_cast<int>(gemv_stream_split_scale_row_bytes(part_chunks));
  // Every box lies within the rows (the EARLY test of session 9 trapped with boxes partly past a
  // row's end or starting between two 16-byte granules; whole boxes past the end worked): the
  // last parts' boxes end at the row's end, the scale box starts at a multiple of 8 chunks
  // (gemv_stream_split_scale_row_bytes). The part then begins weight_shift / scale_shift chunks
  // into a box row (past the end for an empty part, which reads nothing).
  const int weight_column =
      static_cast<int>(min(static_cast<int64_t>(part_begin), cpr - part_chunks));
  const int weight_shift = part_begin - weight_column;
  const int scale_column =
      static_cast<int>(min(static_cast<int64_t>(part_begin & ~7), cpr - scale_pitch / 2));
  const int scale_shift = part_begin - scale_column;
  const int scales_offset = kTileRows * pitch;  // within a stage
  const int64_t stage_bytes = gemv_stream_split_stage_bytes(part_chunks);

  extern __shared__ __align__(128) uint4 split_shared[];
  uint64_t* full = reinterpret_cast<uint64_t*>(split_shared);  // [groups][S]
  uint64_t* empty = full + kGroups * S;                        // [groups][S]
  uint64_t* sums_full = empty + kGroups * S;                   // [groups][kBuffers]
  uint64_t* sums_empty = sums_full + kGroups * kBuffers;       // [groups][kBuffers]
  // [groups][kBuffers][P][KS][16]: read in rank 0 only.
  float* sums = reinterpret_cast<float*>(sums_empty + kGroups * kBuffers);
  uint8_t* stages =
      reinterpret_cast<uint8_t*>(split_shared) + gemv_stream_split_header_bytes(kTiling);
  uint4* staged_x = reinterpret_cast<uint4*>(stages + kGroups * S * stage_bytes);
  uint4* zero_chunk = staged_x + 4 * part_chunks;
  float* x_biases = reinterpret_cast<float*>(zero_chunk + 4);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kGroups * S; ++i) {
      init_barrier(full + i);
      init_barrier_arrivals(empty + i, KS);
    }
    for (int i = 0; i < kGroups * kBuffers; ++i) {
      init_barrier(sums_full + i);
      init_barrier(sums_empty + i);
    }
    fence_barrier_init();
  }
  __syncthreads();
  // The other blocks' barriers are initialized once this phase completes; every thread waits for
  // it before its first access of another block (the producer only at its end).
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");

  if (warp == W) {
    // The producer: round r's tile of each group in turn, into stage r mod S of its ring.
    if (lane == 0) {
      const uint32_t box_bytes = kTileRows * (pitch + scale_pitch);
      for (int r = 0; r < rounds; ++r) {
        for (int group = 0; group < kGroups; ++group) {
          const int tile = r * kGroups + group;
          if (tile >= my_tiles) break;
          const int stage = group * S + r % S;
          if (r >= S) wait_barrier(empty + stage, (r / S - 1) & 1);
          const int row0 = (cluster + tile * clusters) * kTileRows;
          uint8_t* to = stages + stage * stage_bytes;
          arrive_expect_bytes(full + stage, box_bytes);
          copy_box(to, &maps.weights, 2 * weight_column, row0, full + stage);
          copy_box(to + scales_offset, &maps.scales, scale_column, row0, full + stage);
        }
      }
    }
    __syncwarp();
  } else {
    // The consumers: stage the block's part of the activation row (named barrier 1: the
    // producer is not in it).
    pdl_wait_for_predecessors();
    stage_activations<XT>(a.x, part_begin, part_length, staged_x, x_biases, zero_chunk, threadIdx.x,
                          W * 32);
    asm volatile("bar.sync 1, %0;" ::"n"(W * 32) : "memory");
    asm volatile("barrier.cluster.wait;" ::: "memory");

    const int g = lane >> 2, t = lane & 3;
    const int group = warp / KS, part = warp % KS;
    const int quads = part_length / 4;
    const int k_begin = 4 * (quads * part / KS);
    const int k_end = 4 * (quads * (part + 1) / KS);
    // Rank 0's warp 0 of the group adds round `round`'s sums and stores them, a round late: the
    // other blocks' sums arrive while it multiplies the next tile.
    auto add_and_store = [&](int round) {
      const int buffer = group * kBuffers + round % kBuffers;
      if (lane == 0) {
        arrive_expect_bytes(sums_full + buffer,
                            static_cast<uint32_t>(P * KS * kTileRows * sizeof(float)));
      }
      wait_barrier(sums_full + buffer, (round / kBuffers) & 1);
      // Lane l < 8: rows 2l, 2l + 1, at 2 · (row mod 8) + row / 8 of each warp's 16.
      float pair[2] = {0.0f, 0.0f};
      if (lane < kTileRows / 2) {
        const float* buffer_sums = sums + buffer * P * KS * kTileRows;
        const int first = 4 * (lane % 4) + lane / 4;
#pragma unroll
        for (int i = 0; i < P * KS; ++i) {
          pair[0] += buffer_sums[i * kTileRows + first];
          pair[1] += buffer_sums[i * kTileRows + first + 2];
        }
      }
      __syncwarp();  // every lane's reads of the buffer are done
      if (lane < P) arrive_cluster(cluster_address(sums_empty + buffer, lane));
      if (lane < kTileRows / 2) {
        const int64_t tile = round * kGroups + group;
        const int64_t row0 = (cluster + tile * clusters) * kTileRows;
        gemv_detail::store_rows<2>(a, 0, row0 + 2 * lane, pair);
      }
    };
    const bool adds = rank == 0 && part == 0;
    int r = 0;
    for (; r < rounds; ++r) {
      const int tile = r * kGroups + group;
      if (tile >= my_tiles) break;  // the group's warps all leave together
      const int stage = group * S + r % S;
      wait_barrier(full + stage, (r / S) & 1);
      const uint8_t* stage_start = stages + stage * stage_bytes;
      const uint8_t* tile_weights = stage_start + 16 * weight_shift;
      const uint8_t* tile_scales = stage_start + scales_offset + 2 * scale_shift;
      float acc_g = 0.0f, acc_g8 = 0.0f;
      for (int k = k_begin; k < k_end; k += KC) {
        multiply_slice<KC>(tile_weights + k * 16, pitch, tile_scales + k * 2, scale_pitch,
                           min(KC, k_end - k) / 4, staged_x + 4 * k, zero_chunk, x_biases + k,
                           a.scale_type, g, t, acc_g, acc_g8);
      }
      __syncwarp();  // every lane's reads of the stage are done
      if (lane == 0) arrive_barrier(empty + stage);
      acc_g += __shfl_xor_sync(0xFFFFFFFFu, acc_g, 1);
      acc_g8 += __shfl_xor_sync(0xFFFFFFFFu, acc_g8, 1);

      // Rows g, g + 8 (lane (g, 0)) into rank 0's buffer (the pair at 2g), once rank 0 has read
      // the buffer's last round.
      const int buffer = group * kBuffers + r % kBuffers;
      if (r >= kBuffers) wait_barrier(sums_empty + buffer, (r / kBuffers - 1) & 1);
      if (t == 0) {
        float* slot = sums + ((buffer * P + rank) * KS + part) * kTileRows + 2 * g;
        store_pair_cluster(cluster_address(slot, 0), acc_g, acc_g8,
                           cluster_address(sums_full + buffer, 0));
      }
      if (adds && r > 0) add_and_store(r - 1);
    }
    if (adds && r > 0) add_and_store(r - 1);
  }
  // No block leaves while another may still access its shared memory.
  if (warp == W) asm volatile("barrier.cluster.wait;" ::: "memory");
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

using KernelFn = void (*)(GemvArgs);
using SplitKernelFn = void (*)(GemvArgs, SplitMaps);

// Whether tiling `index` is a split-K producer's: its kernel also takes the tensor maps
// (SplitKernelFn).
constexpr bool is_split_ring(int index) {
  return kGemvStreamTilings[index].producer && kGemvStreamTilings[index].splits > 1;
}

// The kernels of XT by tiling index (cuda::kernel_table): the split-K producers' in
// split_kernels, the others' in kernels.
template <ActType XT>
constexpr auto kernels() {
  return kernel_table<kNumGemvStreamTilings>([](auto index) -> KernelFn {
    constexpr int i = decltype(index)::value;
    if constexpr (!gemv_stream_tiling_compiled(kGemvStreamTilingBase + i) || is_split_ring(i)) {
      return nullptr;
    } else if constexpr (constexpr GemvStreamTiling t = kGemvStreamTilings[i]; t.producer) {
      return gemv_tile_ring_kernel<XT, t.warps, t.stage_chunks, t.stages, t.tile_warps>;
    } else {
      return gemv_stream_kernel<XT, t.warps, t.stage_chunks, t.stages, t.splits, t.bulk,
                                t.l2_prefetch>;
    }
  });
}

template <ActType XT>
constexpr auto split_kernels() {
  return kernel_table<kNumGemvStreamTilings>([](auto index) -> SplitKernelFn {
    constexpr int i = decltype(index)::value;
    if constexpr (gemv_stream_tiling_compiled(kGemvStreamTilingBase + i) && is_split_ring(i)) {
      constexpr GemvStreamTiling t = kGemvStreamTilings[i];
      return gemv_split_ring_kernel<XT, t.warps, t.stage_chunks, t.stages, t.tile_warps, t.splits>;
    } else {
      return nullptr;
    }
  });
}

// Clusters of `config` (blocks, for one-block clusters) that the GPU holds at once, after opting
// the kernel into kGemvStreamMaxSharedBytes; 0 where the runtime refuses. Asked once per (kernel,
// shared bytes, device). one_per_sm: at most one block per SM (the producer kernels: a block
// that leaves half an SM's shared memory free lets the next kernel's block start its copies there
// while this one drains).
template <typename Kernel>
int resident_clusters(Kernel kernel, const cudaLaunchConfig_t& config, int splits,
                      bool one_per_sm) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const auto key = std::make_tuple(kernel, config.dynamicSmemBytes, device);
  static std::mutex mutex;
  static std::map<std::tuple<Kernel, size_t, int>, int> known;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto found = known.find(key); found != known.end()) return found->second;
  int clusters = 0;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kGemvStreamMaxSharedBytes));
  if (status == cudaSuccess) {  // the rings want shared memory, not L1
    status = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  cudaSharedmemCarveoutMaxShared);
  }
  if (status == cudaSuccess) {
    clusters = occupancy_clusters(kernel, config, splits, device);
    int sms = 0;
    if (one_per_sm && clusters > 0 &&
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) {
      clusters = std::min(clusters, sms);
    }
  } else {
    cudaGetLastError();  // the refusal is this answer, not an error left for the caller
  }
  known.emplace(key, clusters);
  return clusters;
}

// The driver's tensor-map encoder, through the runtime (no link to the driver library); null
// where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      function = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

// `map` over a row-major [rows][columns] matrix of `type` elements (element_bytes each) at
// `base`, boxes of 16 rows × box_columns; reads past its edges give zeros.
bool encode_box_map(CUtensorMap& map, CUtensorMapDataType type, int element_bytes, const void* base,
                    int64_t columns, int64_t rows, int64_t box_columns) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t row_stride = static_cast<cuuint64_t>(columns * element_bytes);
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_columns),
                             static_cast<cuuint32_t>(kGemvStreamTileRows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(&map, type, 2, const_cast<void*>(base), dims, &row_stride, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Launches `kernel` of tiling t (its warps, a producer warp, its shared memory, clusters of
// t.splits blocks) over as many clusters as the GPU holds at once, at most one per 16-row tile;
// the producer kernels at most one block an SM (resident_clusters).
template <typename... Extra>
cudaError_t launch_resident(void (*kernel)(GemvArgs, Extra...), const GemvStreamTiling& t,
                            const Launch& launch, const GemvArgs& args, const Extra&... extra) {
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(32 * (t.warps + (t.producer ? 1 : 0)));
  config.dynamicSmemBytes = static_cast<size_t>(gemv_stream_shared_bytes(t, args.chunks_per_row));
  LaunchAttributes attributes(t.splits, launch.pdl);
  // The occupancy query's configuration: one cluster, no stream (a stream being captured is
  // left out of it).
  config.gridDim = dim3(1, static_cast<unsigned>(t.splits));
  attributes.apply_cluster(config);
  const int resident = resident_clusters(kernel, config, t.splits, t.producer);
  if (resident == 0) return cudaErrorInvalidValue;
  const int64_t tiles = (args.rows + kGemvStreamTileRows - 1) / kGemvStreamTileRows;
  config.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(tiles, resident)),
                        static_cast<unsigned>(t.splits));
  config.stream = launch.stream;
  attributes.apply(config);
  return cudaLaunchKernelEx(&config, kernel, args, extra...);
}

// launch_gemv_stream for a split-K producer tiling: the tensor maps of the weights and scales as
// arguments too.
cudaError_t launch_split_ring(ActType x_type, int index, const GemvArgs& args,
                              const Launch& launch) {
  static constexpr auto kBF16 = split_kernels<ActType::kBF16>();
  static constexpr auto kF32 = split_kernels<ActType::kF32>();
  const SplitKernelFn kernel = bf16_or_f32_kernel(kBF16, kF32, x_type, index);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const GemvStreamTiling& t = kGemvStreamTilings[index];
  const int64_t part_chunks = gemv_stream_split_part_chunks(t, args.chunks_per_row);
  SplitMaps maps = {};
  if (!encode_box_map(maps.weights, CU_TENSOR_MAP_DATA_TYPE_UINT64, 8, args.weights,
                      2 * args.chunks_per_row, args.rows, 2 * part_chunks) ||
      !encode_box_map(maps.scales, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, args.scales,
                      args.chunks_per_row, args.rows,
                      gemv_stream_split_scale_row_bytes(part_chunks) / 2)) {
    return cudaErrorInvalidValue;
  }
  return launch_resident(kernel, t, launch, args, maps);
}

}  // namespace gemv_stream_detail

cudaError_t launch_gemv_stream(ActType x_type, int index, const GemvArgs& args,
                               const Launch& launch) {
  if (index >= 0 && index < kNumGemvStreamTilings && gemv_stream_detail::is_split_ring(index)) {
    return gemv_stream_detail::launch_split_ring(x_type, index, args, launch);
  }
  static constexpr auto kBF16 = gemv_stream_detail::kernels<ActType::kBF16>();
  static constexpr auto kF32 = gemv_stream_detail::kernels<ActType::kF32>();
  const gemv_stream_detail::KernelFn kernel = bf16_or_f32_kernel(kBF16, kF32, x_type, index);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  return gemv_stream_detail::launch_resident(kernel, kGemvStreamTilings[index], launch, args);
}

}  // namespace gemma4::cuda
