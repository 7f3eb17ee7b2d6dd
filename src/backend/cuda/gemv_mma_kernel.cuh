// The tensor-core batched GEMV kernel template (gemv_mma_kernels.h describes the method) and the
// table of its instantiations for one weight format: each format's in its own translation unit
// (gemv_mma_<format>.cu), so that nvcc compiles them in parallel.
//
// Fragment order. mma.sync m16n8k16 gives lane (g = lane / 4, t = lane % 4) the A elements of
// rows g and g + 8 at k slots {2t, 2t + 1} (registers 0, 1) and {2t + 8, 2t + 9} (registers 2, 3),
// and the B elements of column g at the same k slots. The sum over k does not care which K
// element sits in which slot as long as A and B agree, so the 4 lanes of a quad take 4
// consecutive groups (a "quad" of groups), lane t group t whole: one 16-byte load per weight row,
// 4 packed words, word j elements 8j .. 8j + 7 (nibble i = element 8j + i). Word j feeds two mma
// steps, in which lane t's slots hold
//   step 2j:     slots {2t, 2t + 1} = elements {8j, 8j + 4}, {2t + 8, 2t + 9} = {8j + 1, 8j + 5}
//   step 2j + 1: slots {2t, 2t + 1} = elements {8j + 2, 8j + 6}, {2t + 8, 2t + 9} = {8j + 3, 8j +
//   7}
// exactly the nibble pairs (s, s + 4) one mask of (word >> 4s) extracts. One mma then sums over
// 4 groups of different scales, so the scale is applied to the weights before it (bf16, see
// gemv_mma_kernels.h). The staged activations hold the same pairs: 16 bytes per (row, group, j) =
// bf16 pairs (v0, v4), (v1, v5), (v2, v6), (v3, v7) of elements 8j .. 8j + 7, one shared-memory
// load per n tile and word.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <iterator>

#include "backend/cuda/gemv_kernel.cuh"
#include "backend/cuda/gemv_mma_kernels.h"
#include "backend/cuda/kernel_table.cuh"
#include "backend/cuda/mma.cuh"

namespace gemma4::cuda::gemv_mma_detail {

namespace cg = cooperative_groups;

// Groups per quad: the 4 lanes of an mma quad load consecutive groups (module comment).
inline constexpr int kQuadGroups = 4;
// Quads whose weights (16 bytes a row and lane) and scales a warp has in flight ahead of the one
// it multiplies: at 4+ n tiles 2 (2 · 4 rows · 16 bytes · 32 lanes = 4 KB per warp, 32 KB per SM
// at 8 warps: about what the read bandwidth times the load latency needs; 40 registers); at 1-2
// n tiles 1 (two blocks per SM: the same bytes per SM, within 128 registers without spills).
// Warps of one 16-row tile (16 warps an SM within 128 registers): 1 at 8 n tiles (16 KB an SM),
// 2 at 4, and 4 at 1-2 (64 KB an SM: the rows whose time is the weights' reading).
template <int NT, int TW>
constexpr int prefetch_quads() {
  if (TW == 1) return NT == 8 ? 1 : NT == 4 ? 2 : 4;
  return NT >= 4 ? 2 : 1;
}
// Blocks per SM a kernel is compiled for (its register bound): two at 1-2 n tiles; 16 warps an SM
// with one 16-row tile per warp (128 registers); else one.
template <int NT, int TW, int WARPS>
constexpr int min_blocks_per_sm() {
  if (TW == 1) return WARPS >= 16 ? 1 : 16 / WARPS;
  return NT <= 2 ? 2 : 1;
}
// u − 8 as exact bf16 pairs for nibbles (s, s + 4), s = 0..3, of a packed word: the nibble is
// OR-ed into the low mantissa bits of bf16 128.0 (0x4300: 128 + u exactly), then 136 subtracted.
__device__ __forceinline__ void centered_nibble_pairs(uint32_t word, uint32_t (&pairs)[4]) {
  const uint32_t magic = 0x43004300u;
  const __nv_bfloat162 bias = __floats2bfloat162_rn(136.0f, 136.0f);
  const uint32_t biased[4] = {
      and_or<0x000F000Fu>(word, magic), and_or<0x000F000Fu>(word >> 4, magic),
      and_or<0x000F000Fu>(word >> 8, magic), and_or<0x000F000Fu>(word >> 12, magic)};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const __nv_bfloat162 centered =
        __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased[s]), bias);
    pairs[s] = *reinterpret_cast<const uint32_t*>(&centered);
  }
}

// (u − 8) · scale as bf16 pairs (centered_nibble_pairs' order): one bf16 multiply of the exact
// u − 8, the bf16 weight transformers' dequantization makes.
__device__ __forceinline__ void centered_scaled_nibble_pairs(uint32_t word, __nv_bfloat162 scale,
                                                             uint32_t (&pairs)[4]) {
  centered_nibble_pairs(word, pairs);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const __nv_bfloat162 weight =
        __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pairs[s]), scale);
    pairs[s] = *reinterpret_cast<const uint32_t*>(&weight);
  }
}

// NVFP4: e2m1(u) · block scale as exact bf16 pairs for nibbles (s, s + 4), s = 0..3, of a packed
// word (all 8 in one 16-element block), times 2^-7: code c placed as bf16 bits
// (c & 8) << 12 | (c & 7) << 6 is e2m1(c) · 2^-126 (c = 1 a subnormal, which the bf16 multiply
// keeps), and its product with the scale · 2^119 (e4m3_bf16_pair) is e2m1(c) · scale · 2^-7: at
// most 6 significant bits, in [2^-17, 21], so bf16 holds it exactly. Four logic/shift operations
// and one multiply per pair, no fp16 -> fp32 -> bf16 conversion.
__device__ __forceinline__ void scaled_e2m1_pairs(uint32_t word, __nv_bfloat162 block_scale,
                                                  uint32_t (&pairs)[4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t top = word << (12 - 4 * s);  // nibbles s, s + 4 in bits 12..15, 28..31
    const uint32_t bits = and_or<0x80008000u>(top, (top >> 6) & 0x01C001C0u);
    const __nv_bfloat162 scaled =
        __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), block_scale);
    pairs[s] = *reinterpret_cast<const uint32_t*>(&scaled);
  }
}

// A word's decoded pairs of rows g and g + 8 (rows[h][s]: pair s of row g + 8h) as the A
// fragments of its two mma steps (m16n8k16 registers: row g, row g + 8 at the step's low k pairs,
// then both at its high k pairs).
__device__ __forceinline__ void a_fragments(const uint32_t (&rows)[2][4],
                                            uint32_t (&fragments)[2][4]) {
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    fragments[step][0] = rows[0][2 * step];
    fragments[step][1] = rows[1][2 * step];
    fragments[step][2] = rows[0][2 * step + 1];
    fragments[step][3] = rows[1][2 * step + 1];
  }
}

// An e4m3 scale as an fp16 pair (exact: e4m3 is a subset of fp16).
__device__ __forceinline__ __half2 e4m3_pair(uint32_t bits) {
  const __half_raw h =
      __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(bits & 0xFF), __NV_E4M3);
  return __half2half2(__half(h));
}

// An e4m3 scale times 2^119 as a bf16 pair for scaled_e2m1_pairs: exact (4 significant bits;
// 448 · 2^119 < 2^128, the largest e4m3 below the bf16 maximum).
__device__ __forceinline__ __nv_bfloat162 e4m3_bf16_pair(uint32_t bits) {
  return __float2bfloat162_rn(__low2float(e4m3_pair(bits)) * 0x1p119f);
}

// Start of kQ8 activation row m (gemv_kernels.h).
__device__ __forceinline__ const uint8_t* q8_row(const MmaGemvArgs& a, int m) {
  return static_cast<const uint8_t*>(a.x) + m * (a.x_stride + a.x_stride / 4);
}

// Elements k .. k + 7 of activation row m as the staged word: bf16 pairs (v0, v4), (v1, v5),
// (v2, v6), (v3, v7).
template <ActType XT>
__device__ __forceinline__ uint4 staged_word(const MmaGemvArgs& a, int m, int64_t k) {
  if constexpr (XT == ActType::kQ8) {
    // Stored as q0 q2 q4 q6 | q1 q3 q5 q7, the chunk's scale after the row: q · scale rounded to
    // bf16 (one mma mixes groups of different activation scales).
    const uint8_t* row = q8_row(a, m);
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(row + k));
    const float scale = __ldg(reinterpret_cast<const float*>(row + a.x_stride) + k / 32);
    auto value = [scale](uint32_t word, int byte) {
      return static_cast<float>(static_cast<int8_t>((word >> (8 * byte)) & 0xFF)) * scale;
    };
    return make_uint4(
        pack_bf16x2(value(q.x, 0), value(q.x, 2)), pack_bf16x2(value(q.y, 0), value(q.y, 2)),
        pack_bf16x2(value(q.x, 1), value(q.x, 3)), pack_bf16x2(value(q.y, 1), value(q.y, 3)));
  } else if constexpr (XT == ActType::kBF16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) +
                                                         m * a.x_stride + k));
    return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                      __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
  } else {
    const float4* p =
        reinterpret_cast<const float4*>(static_cast<const float*>(a.x) + m * a.x_stride + k);
    const float4 lo = __ldg(p), hi = __ldg(p + 1);
    return make_uint4(pack_bf16x2(lo.x, hi.x), pack_bf16x2(lo.y, hi.y), pack_bf16x2(lo.z, hi.z),
                      pack_bf16x2(lo.w, hi.w));
  }
}

// Every block of the cluster sums the K splits of the row tile at block_row for its share of the
// outputs, in (rank, k warp) order (the same sums every run), and stores them through the
// epilogue: one thread per row pair, so the pairs epilogue sees both rows. partial: the block's
// sums [k warp][activation row][tile row] (mma_gemv_partial_stride), every rank's written and
// visible (after a cluster barrier).
template <int WK, int kThreads, int kRowsPerBlock, int kPaddedRows>
__device__ __forceinline__ void store_cluster_sums(const MmaGemvArgs& a, cg::cluster_group& cluster,
                                                   float* partial, int m_begin, int m_count,
                                                   int64_t block_row) {
  constexpr int64_t kStride = mma_gemv_partial_stride(kRowsPerBlock);
  constexpr int64_t kSlice = kPaddedRows * kStride;
  const int splits = static_cast<int>(gridDim.y);
  const int split = static_cast<int>(blockIdx.y);
  const int lane = threadIdx.x & 31;
  constexpr int kPairs = kRowsPerBlock / 2;
  const int pair_count = m_count * kPairs;
  const int pair_step = splits * kThreads;
  // Pair i's partial sums of every rank and k warp (zeros past the ranks or the pairs).
  // Unrolled over the largest cluster, so that the loads of every rank are in flight at once.
  auto load_parts = [&](int i, float2(&parts)[kMmaGemvMaxSplits][WK]) {
    const int m = i / kPairs;
    const int row = 2 * (i % kPairs);
#pragma unroll
    for (int rank = 0; rank < kMmaGemvMaxSplits; ++rank) {
      const bool loaded = rank < splits && i < pair_count;
      const float* source = loaded && splits > 1 ? cluster.map_shared_rank(partial, rank) : partial;
#pragma unroll
      for (int k = 0; k < WK; ++k) {
        parts[rank][k] =
            loaded ? *reinterpret_cast<const float2*>(source + k * kSlice + m * kStride + row)
                   : make_float2(0.0f, 0.0f);
      }
    }
  };
  float2 parts[kMmaGemvMaxSplits][WK];
  const int first_pair = split * kThreads + static_cast<int>(threadIdx.x);
  load_parts(first_pair, parts);
  for (int i = first_pair; i < pair_count; i += pair_step) {
    // The next pair's loads go out before this pair's sums and stores, so that their round
    // trip to the cluster's shared memory overlaps this pair's epilogue.
    float2 next_parts[kMmaGemvMaxSplits][WK];
    load_parts(i + pair_step, next_parts);
    const int m = i / kPairs;
    const int row = 2 * (i % kPairs);
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int rank = 0; rank < kMmaGemvMaxSplits; ++rank) {
      if (rank < splits) {
#pragma unroll
        for (int k = 0; k < WK; ++k) {
          sums[0] += parts[rank][k].x;
          sums[1] += parts[rank][k].y;
        }
      }
    }
    // y and its bf16 companion
    gemv_detail::store_rows<2>(a, m_begin + m, block_row + row, sums);
    if (a.y_companions.q8 != nullptr) {
      // kGeluPairs: consecutive threads store consecutive outputs and a block's outputs are
      // whole chunks of 32, so the lanes of a warp hold one chunk (lane l its element l):
      // quantized together, or skipped together past the matrix.
      const int64_t output = (block_row + row) / 2;
      if (output - lane < a.rows / 2) {
        const float value[1] = {gemv_detail::gelu_pair(sums[0], sums[1])};
        store_chunk_q8<1>(value, lane, q8_row(a.y_companions, m_begin + m), a.y_companions.stride,
                          output / 32);
      }
    }
#pragma unroll
    for (int rank = 0; rank < kMmaGemvMaxSplits; ++rank) {
#pragma unroll
      for (int k = 0; k < WK; ++k) parts[rank][k] = next_parts[rank][k];
    }
  }
}

// F: kW4G32 or kNVFP4 weights; NT n tiles of 8 activation rows; WR · WK warps: WR along the rows
// (16 · TW · WR weight rows per row tile, TW 16-row tiles per warp), WK along the block's K range
// (every WK-th quad of groups); gridDim.y blocks along K form one cluster; a block multiplies the
// row tiles blockIdx.x + gridDim.x · i. Up to 2 n tiles, two blocks per SM (at most 128 registers
// a thread at 8 warps): the 16 warps per SM hide the load latency the short mma loop leaves
// exposed; one tile per warp gets 16 warps an SM at any n tiles (min_blocks_per_sm).
template <PackedFormat F, ActType XT, int NT, int WR, int WK, int TW>
__global__ void __launch_bounds__(WR* WK * 32, (min_blocks_per_sm<NT, TW, WR * WK>()))
    gemv_mma_kernel(MmaGemvArgs a) {
  static_assert(F == PackedFormat::kW4G32 || F == PackedFormat::kNVFP4);
  constexpr bool kNvfp4 = F == PackedFormat::kNVFP4;
  if (a.trigger == MmaGemvTrigger::kAtStart) pdl_trigger_dependents();
  constexpr int kTilesPerWarp = TW;
  constexpr int kRowsPerBlock = 16 * TW * WR;
  constexpr int kPaddedRows = 8 * NT;
  // This block's activation rows: m_begin .. m_begin + m_count - 1 (MmaGemvTiling's
  // activation_blocks); m below is the block's own row index.
  const int m_begin = static_cast<int>(blockIdx.z) * kPaddedRows;
  const int m_count = min(a.m - m_begin, kPaddedRows);
  constexpr int kThreads = 32 * WR * WK;
  constexpr int kPrefetchQuads = prefetch_quads<NT, TW>();
  const int lane = threadIdx.x & 31;
  const int row_warp = (threadIdx.x >> 5) % WR;
  const int k_warp = (threadIdx.x >> 5) / WR;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int splits = static_cast<int>(gridDim.y);
  const int split = static_cast<int>(blockIdx.y);
  const int64_t groups_per_split = mma_gemv_groups_per_split(a.groups, splits);
  const int64_t group_begin = split * groups_per_split;
  const int group_count =
      static_cast<int>(max(int64_t{0}, min(a.groups - group_begin, groups_per_split)));
  const int quad_count = (group_count + kQuadGroups - 1) / kQuadGroups;
  // The blocks of a cluster share blockIdx.x: the same tiles, the same barriers.
  const int64_t row_tiles = (a.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int block_tiles = static_cast<int>((row_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x);
  auto tile_row = [&](int tile) {
    return (static_cast<int64_t>(blockIdx.x) + static_cast<int64_t>(gridDim.x) * tile) *
           kRowsPerBlock;
  };

  // The weight rows of this lane within a row tile: tile i's rows g and g + 8 (clamped into the
  // matrix when loaded: a clamped row's products land in rows that are never stored).
  int row_offsets[2 * kTilesPerWarp];
#pragma unroll
  for (int i = 0; i < kTilesPerWarp; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_offsets[2 * i + h] = 16 * (kTilesPerWarp * row_warp + i) + g + 8 * h;
    }
  }
  // Group t of a quad, whole (16 bytes), and its scale: w4g32 2 or 4 bytes (both loads are
  // emitted at the same address, one predicated off: no branch per group); NVFP4 the two e4m3
  // scales of its 16-element blocks.
  const bool scales_f32 = a.scale_type == kScaleF32;
  const uint32_t scale_bytes = kNvfp4 ? 2 : scales_f32 ? 4 : 2;
  uint4 packed[kPrefetchQuads][2 * kTilesPerWarp];
  uint32_t scale_bits[kPrefetchQuads][2 * kTilesPerWarp];
  // This warp's quads of every tile: block quads k_warp + WK · j for j < warp_quads. The loads
  // run as one stream over (tile, j), each tile padded to whole prefetch rounds, so that slot s
  // always holds the quads j ≡ s and the next tile's first quads load during this tile's last
  // ones and its reduction. A round's quads all lie in one tile: its rows' element indices
  // (row · groups + the lane's group of the round's first quad) are computed once per round, and
  // quad s of the round is at a constant offset from them (an immediate of the load).
  const int warp_quads = quad_count > k_warp ? (quad_count - k_warp + WK - 1) / WK : 0;
  const int tile_stream =
      kPrefetchQuads * max(1, (warp_quads + kPrefetchQuads - 1) / kPrefetchQuads);
  int load_tile = 0;  // the round the loads of slot s fetch next: its tile and first j
  int load_j0 = 0;
  // Each row's group of the round: as pointers with registers to spare (4+ n tiles), as a 32-bit
  // element index under the 128-register bound of 1-2 n tiles (an address per load).
  constexpr bool kRoundPointers = NT >= 4 && (TW == 2 || WK == 2);
  constexpr int kRoundRows = 2 * kTilesPerWarp;
  uint32_t round_index[kRoundPointers ? 1 : kRoundRows];
  const uint8_t* round_words[kRoundPointers ? kRoundRows : 1];
  const uint8_t* round_scales[kRoundPointers ? kRoundRows : 1];
  const auto groups = static_cast<uint32_t>(a.groups);
  const auto* const weights = static_cast<const uint8_t*>(a.weights);
  const auto* const scales = static_cast<const uint8_t*>(a.scales);
  auto begin_load_round = [&] {
    const int first_row = static_cast<int>(min(tile_row(load_tile), a.rows));
    const int last_row = static_cast<int>(a.rows) - 1;
    const auto group =
        static_cast<uint32_t>(group_begin + kQuadGroups * (k_warp + WK * load_j0) + t);
#pragma unroll
    for (int r = 0; r < kRoundRows; ++r) {
      // Unsigned: a padded round's groups pass the row's end (never loaded).
      const uint32_t index =
          static_cast<uint32_t>(min(first_row + row_offsets[r], last_row)) * groups + group;
      if constexpr (kRoundPointers) {
        round_words[r] = weights + uint64_t{index} * 16u;
        round_scales[r] = scales + uint64_t{index} * scale_bytes;
      } else {
        round_index[r] = index;
      }
    }
  };
  auto words_of = [&](int r) {
    if constexpr (kRoundPointers) {
      return round_words[r];
    } else {
      return weights + uint64_t{round_index[r]} * 16u;
    }
  };
  auto scales_of = [&](int r) {
    if constexpr (kRoundPointers) {
      return round_scales[r];
    } else {
      return scales + uint64_t{round_index[r]} * scale_bytes;
    }
  };
  // Quad s of the round: WK · s quads past the round's first (immediate load offsets). The
  // lane's group past the block's range (the last quad of a range not of whole quads) is zeros:
  // zero codes, zero scale, against zero staged activations.
  constexpr int kQuadStride = kQuadGroups * WK;  // groups from one quad of the warp to the next
  auto load_quad = [&](int slot) {
    if (load_tile >= block_tiles || load_j0 + slot >= warp_quads) return;
    const bool in_range = kQuadGroups * (k_warp + WK * (load_j0 + slot)) + t < group_count;
#pragma unroll
    for (int r = 0; r < kRoundRows; ++r) {
      packed[slot][r] = make_uint4(0, 0, 0, 0);
      scale_bits[slot][r] = 0;
      if (in_range) {
        packed[slot][r] =
            __ldg(reinterpret_cast<const uint4*>(words_of(r) + 16 * kQuadStride * slot));
        const uint8_t* scale = scales_of(r);
        if constexpr (kNvfp4) {
          scale_bits[slot][r] =
              __ldg(reinterpret_cast<const uint16_t*>(scale) + kQuadStride * slot);
        } else if (scales_f32) {
          scale_bits[slot][r] =
              __ldg(reinterpret_cast<const uint32_t*>(scale) + kQuadStride * slot);
        } else {
          scale_bits[slot][r] =
              __ldg(reinterpret_cast<const uint16_t*>(scale) + kQuadStride * slot);
        }
      }
    }
  };
  auto next_load_round = [&] {
    load_j0 += kPrefetchQuads;
    if (load_j0 == tile_stream) {
      load_j0 = 0;
      ++load_tile;
    }
    begin_load_round();
  };
  // Weights never depend on the previous kernel: their loads go out before the wait.
  begin_load_round();
#pragma unroll
  for (int s = 0; s < kPrefetchQuads; ++s) load_quad(s);
  next_load_round();
  pdl_wait_for_predecessors();

  // The block's K range of every activation row (rows m >= m_count and groups past the range as
  // zeros), in fragment order: word (quad, j, m, t) = elements 8j .. 8j + 7 of group 4 · quad + t
  // of row m at 4 · (kPaddedRows · (4 · quad + j) + m) + t, so that a warp's load of one n tile
  // and word is 512 consecutive bytes (no bank conflicts) at a constant offset per n tile.
  extern __shared__ uint4 shared_words[];
  constexpr int kWordRowWords = 4 * kPaddedRows;  // one j of one quad, every row and t
  const int staged_words = kWordRowWords * kQuadGroups * quad_count;
  // Eight words in flight per thread: the staging is a few L2 round trips, not one per word.
#pragma unroll 8
  for (int i = threadIdx.x; i < staged_words; i += kThreads) {
    const int word_row = i / kWordRowWords;  // 4 · quad + j
    const int m = (i / 4) % kPaddedRows;
    const int group = kQuadGroups * (word_row / 4) + i % 4;
    shared_words[i] =
        m < m_count && group < group_count
            ? staged_word<XT>(a, m_begin + m, 32 * (group_begin + group) + 8 * (word_row % 4))
            : make_uint4(0, 0, 0, 0);
  }
  __syncthreads();
  if (a.trigger == MmaGemvTrigger::kAfterStaging) pdl_trigger_dependents();

  constexpr int64_t kStride = mma_gemv_partial_stride(kRowsPerBlock);
  constexpr int64_t kSlice = kPaddedRows * kStride;
  constexpr int64_t kBufferFloats = WK * kSlice;
  const bool looping = a.partial_offset != 0;
  float* const partial_base =
      reinterpret_cast<float*>(reinterpret_cast<char*>(shared_words) + a.partial_offset);
  // NVFP4: 2^7 (the e2m1 decode's 2^-7) and the global factor in the checkpoint's convention.
  const float sum_scale =
      kNvfp4 ? (a.nv_global_is_divisor ? 128.0f / a.nv_global : 128.0f * a.nv_global) : 1.0f;
  // w4g32 scale bits as a bf16 pair: bf16 as is, f32 and f16 rounded to bf16.
  const int scale_shift = a.scale_type == kScaleBF16 ? 16 : 0;
  const bool scales_f16 = a.scale_type == kScaleF16;
  auto scale_pair = [&](uint32_t bits) {
    const float f16 = __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    return __float2bfloat162_rn(scales_f16 ? f16 : __uint_as_float(bits << scale_shift));
  };
  cg::cluster_group cluster = cg::this_cluster();
  // This lane's activation words: n tile 0, word 0 of the warp's first quad.
  const uint4* const lane_activations = shared_words + kQuadGroups * kWordRowWords * k_warp + lane;

  for (int tile = 0; tile < block_tiles; ++tile) {
    float acc[kTilesPerWarp][NT][4] = {};
    for (int j0 = 0; j0 < tile_stream; j0 += kPrefetchQuads) {
      const uint4* const round_activations =
          lane_activations + kQuadGroups * kWordRowWords * WK * j0;
#pragma unroll
      for (int s = 0; s < kPrefetchQuads; ++s) {
        // The slot's words and scales, freed for the next round's loads at once (issued also
        // past the warp's quads: the next tile's first ones).
        const bool active = j0 + s < warp_quads;
        uint4 words[2 * kTilesPerWarp];
        uint32_t bits[2 * kTilesPerWarp];
#pragma unroll
        for (int r = 0; r < kRoundRows; ++r) {
          words[r] = packed[s][r];
          bits[r] = scale_bits[s][r];
        }
        load_quad(s);
        if (!active) continue;
          // Word j of the lane's group: elements 8j .. 8j + 7, two mma steps (module comment).
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t fragments[kTilesPerWarp][2][4];  // [tile][step][register]
#pragma unroll
          for (int w = 0; w < kTilesPerWarp; ++w) {
            uint32_t rows[2][4];  // rows g and g + 8
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint4& word4 = words[2 * w + h];
              const uint32_t word = j == 0   ? word4.x
                                    : j == 1 ? word4.y
                                    : j == 2 ? word4.z
                                             : word4.w;
              if constexpr (kNvfp4) {
                // Words 0, 1 are the group's first 16-element block, 2, 3 its second.
                scaled_e2m1_pairs(word, e4m3_bf16_pair(bits[2 * w + h] >> (j / 2 * 8)), rows[h]);
              } else {
                centered_scaled_nibble_pairs(word, scale_pair(bits[2 * w + h]), rows[h]);
              }
            }
            a_fragments(rows, fragments[w]);
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint4 b = round_activations[kQuadGroups * kWordRowWords * WK * s +
                                              kWordRowWords * j + 32 * nt];
#pragma unroll
            for (int w = 0; w < kTilesPerWarp; ++w) {
              mma_bf16(acc[w][nt], fragments[w][0], b.x, b.y);
              mma_bf16(acc[w][nt], fragments[w][1], b.z, b.w);
            }
          }
        }
      }
      next_load_round();
    }
    if (a.trigger == MmaGemvTrigger::kAfterProducts && tile == block_tiles - 1) {
      pdl_trigger_dependents();
    }

    // Partial sums [k warp][activation row][tile row]: over the staged activations for a block
    // of one tile (every warp is done reading them at the barrier), else in the tile's buffer
    // (the other one's readers of two tiles ago all passed the last tile's barrier). Lane (g, t)
    // holds rows g, g + 8 of a 16-row tile for activation rows 2t, 2t + 1 of each n tile.
    float* partial = partial_base + (looping ? (tile & 1) * kBufferFloats : 0);
    if (!looping) __syncthreads();
    float* own_partial = partial + k_warp * kSlice;
#pragma unroll
    for (int w = 0; w < kTilesPerWarp; ++w) {
      const int row = 16 * (kTilesPerWarp * row_warp + w) + g;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int m = 8 * nt + 2 * t;
        own_partial[m * kStride + row] = acc[w][nt][0] * sum_scale;
        own_partial[(m + 1) * kStride + row] = acc[w][nt][1] * sum_scale;
        own_partial[m * kStride + row + 8] = acc[w][nt][2] * sum_scale;
        own_partial[(m + 1) * kStride + row + 8] = acc[w][nt][3] * sum_scale;
      }
    }

    // Every rank's partial sums written, then added for this block's share of the outputs.
    if (splits > 1) {
      cluster.sync();
    } else {
      __syncthreads();
    }
    store_cluster_sums<WK, kThreads, kRowsPerBlock, kPaddedRows>(a, cluster, partial, m_begin,
                                                                 m_count, tile_row(tile));
  }
  // No block may leave while another still reads its shared memory.
  if (splits > 1) cluster.sync();
}

using MmaKernel = void (*)(MmaGemvArgs);

inline constexpr int kNTileOptions[] = {1, 2, 4, 8};

// The index of a block's count of n tiles in kNTileOptions (the kernel tables' major index); -1
// for a count no kernel is compiled for.
constexpr int mma_gemv_n_tile_index(int block_n_tiles) {
  for (int i = 0; i < static_cast<int>(std::size(kNTileOptions)); ++i) {
    if (kNTileOptions[i] == block_n_tiles) return i;
  }
  return -1;
}
inline constexpr int kNumKernels = 4 * kNumMmaGemvWarpLayouts;

// The kernels of format F for XT by index (cuda::kernel_table; select_mma_kernel's order).
template <PackedFormat F, ActType XT>
constexpr auto mma_kernels() {
  return kernel_table<kNumKernels>([](auto index) -> MmaKernel {
    constexpr int i = decltype(index)::value;
    constexpr MmaGemvWarpLayout layout = kMmaGemvWarpLayouts[i % kNumMmaGemvWarpLayouts];
    return gemv_mma_kernel<F, XT, kNTileOptions[i / kNumMmaGemvWarpLayouts], layout.warps,
                           layout.k_warps, layout.tiles_per_warp>;
  });
}

// The kernel of format F for x_type and index = kNumMmaGemvWarpLayouts · (index of the n tiles
// in kNTileOptions) + (index of the warp layout in kMmaGemvWarpLayouts); nullptr for NVFP4 with
// kQ8 activations (none compiled).
// Explicitly instantiated once per format in gemv_mma_<format>.cu.
template <PackedFormat F>
MmaKernel select_mma_kernel(ActType x_type, int index) {
  if (x_type == ActType::kQ8) {
    if constexpr (F == PackedFormat::kW4G32) {
      static constexpr auto kQ8 = mma_kernels<F, ActType::kQ8>();
      return kQ8[index];
    }
    return nullptr;
  }
  static constexpr auto kBF16 = mma_kernels<F, ActType::kBF16>();
  static constexpr auto kF32 = mma_kernels<F, ActType::kF32>();
  return x_type == ActType::kBF16 ? kBF16[index] : kF32[index];
}

extern template MmaKernel select_mma_kernel<PackedFormat::kW4G32>(ActType, int);
extern template MmaKernel select_mma_kernel<PackedFormat::kNVFP4>(ActType, int);

}  // namespace gemma4::cuda::gemv_mma_detail
