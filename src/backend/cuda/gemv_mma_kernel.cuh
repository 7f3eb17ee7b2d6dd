// The tensor-core batched GEMV kernel template (gemv_mma_kernels.h describes the method) and the
// table of its instantiations for one weight format: each format's in its own translation unit
// (gemv_mma_<format>.cu), so that nvcc compiles them in parallel.
//
// Fragment order. mma.sync m16n8k16 gives lane (g = lane / 4, t = lane % 4) the A elements of
// rows g and g + 8 at k slots {2t, 2t + 1} (registers 0, 1) and {2t + 8, 2t + 9} (registers 2, 3),
// and the B elements of column g at the same k slots. The sum over k does not care which K
// element sits in which slot as long as A and B agree, so lane t takes packed word t of a group
// (elements 8t .. 8t + 7, nibble i = element 8t + i) for both of the group's mma steps:
//   step 0: slots {2t, 2t + 1} = elements {8t, 8t + 4}, slots {2t + 8, 2t + 9} = {8t + 1, 8t + 5}
//   step 1: slots {2t, 2t + 1} = elements {8t + 2, 8t + 6}, {2t + 8, 2t + 9} = {8t + 3, 8t + 7}
// which are exactly the nibble pairs (s, s + 4) one mask of (word >> 4s) extracts. The staged
// activations hold the same pairs: 16 bytes per (row, group, t) = bf16 pairs (v0, v4), (v1, v5),
// (v2, v6), (v3, v7) of elements 8t .. 8t + 7, one shared-memory load per n tile and group.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <array>
#include <utility>

#include "backend/cuda/gemv_kernel.cuh"
#include "backend/cuda/gemv_mma_kernels.h"

namespace gemma4::cuda::gemv_mma_detail {

namespace cg = cooperative_groups;

// Groups whose packed words and scales a warp has in flight ahead of the mma: 8 at 4 n tiles
// (32 · 8 lanes · 8 groups · 4 rows · 4 bytes = 32 KB per SM at one block of 8 warps, about what
// the read bandwidth times the load latency needs; registers 191-231, the same blocks per SM as
// with 4), else 4 (8 n tiles: 168-255 registers at 4, the 255 cap at 8).
template <int NT>
constexpr int prefetch_groups() {
  return NT == 4 ? 8 : 4;
}
// 16-row mma tiles per warp: each activation fragment loaded from shared memory feeds both.
constexpr int kTilesPerWarp = 2;

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

// c += A · B over one m16n8k16 step, bf16 operands, fp32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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
    // Stored as q0 q2 q4 q6 | q1 q3 q5 q7; bf16 holds every int8 exactly.
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(q8_row(a, m) + k));
    auto value = [](uint32_t word, int byte) {
      return static_cast<float>(static_cast<int8_t>((word >> (8 * byte)) & 0xFF));
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

// F: kW4G32 or kNVFP4 weights; NT n tiles of 8 activation rows; WR · WK warps: WR along the rows
// (32 · WR weight rows per row tile), WK along the block's K range (every WK-th group); gridDim.y
// blocks along K form one cluster; a block multiplies the row tiles blockIdx.x + gridDim.x · i.
// Up to 2 n tiles, two blocks per SM (at most 128 registers a thread at 8 warps; a few bytes
// spill): the 16 warps per SM hide the load latency the short mma loop leaves exposed.
template <PackedFormat F, ActType XT, int NT, int WR, int WK>
__global__ void __launch_bounds__(WR* WK * 32, NT <= 2 ? 2 : 1) gemv_mma_kernel(MmaGemvArgs a) {
  static_assert(F == PackedFormat::kW4G32 || F == PackedFormat::kNVFP4);
  constexpr bool kNvfp4 = F == PackedFormat::kNVFP4;
  pdl_trigger_dependents();
  constexpr int kRowsPerBlock = 32 * WR;
  constexpr int kPaddedRows = 8 * NT;
  constexpr int kThreads = 32 * WR * WK;
  constexpr int kPrefetchGroups = prefetch_groups<NT>();
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
  // Word t of a group and (NVFP4) the e4m3 scale of its 16-element block; w4g32 scales are 2 or 4
  // bytes (both loads are emitted at the same address, one predicated off: no branch per group).
  const uint8_t* const lane_words = static_cast<const uint8_t*>(a.weights) + 4 * t;
  const uint8_t* const lane_scales = static_cast<const uint8_t*>(a.scales) + (kNvfp4 ? t / 2 : 0);
  const bool scales_f32 = a.scale_type == kScaleF32;
  const uint32_t scale_bytes = kNvfp4 ? 2 : scales_f32 ? 4 : 2;
  uint32_t packed[kPrefetchGroups][2 * kTilesPerWarp];
  uint32_t scale_bits[kPrefetchGroups][2 * kTilesPerWarp];
  // This warp's groups of every tile: block groups k_warp + WK · j for j < warp_groups. The
  // loads run as one stream over (tile, j), each tile padded to whole prefetch rounds, so that
  // slot s always holds the groups j ≡ s and the next tile's first groups load during this
  // tile's last ones and its reduction. A round's groups all lie in one tile: its rows' element
  // indices (row · groups + the round's first group) are computed once per round, and group s of
  // the round is at a constant offset from them (an immediate of the load).
  const int warp_groups = group_count > k_warp ? (group_count - k_warp + WK - 1) / WK : 0;
  const int tile_stream =
      kPrefetchGroups * max(1, (warp_groups + kPrefetchGroups - 1) / kPrefetchGroups);
  int load_tile = 0;  // the round the loads of slot s fetch next: its tile and first j
  int load_j0 = 0;
  // Each row's first group of the round: as pointers with registers to spare (4+ n tiles), as a
  // 32-bit element index under the 128-register bound of 1-2 n tiles (an address per load).
  constexpr bool kRoundPointers = NT >= 4;
  constexpr int kRoundRows = 2 * kTilesPerWarp;
  uint32_t round_index[kRoundPointers ? 1 : kRoundRows];
  const uint8_t* round_words[kRoundPointers ? kRoundRows : 1];
  const uint8_t* round_scales[kRoundPointers ? kRoundRows : 1];
  const auto groups = static_cast<uint32_t>(a.groups);
  auto begin_load_round = [&] {
    const int first_row = static_cast<int>(min(tile_row(load_tile), a.rows));
    const int last_row = static_cast<int>(a.rows) - 1;
    const auto group = static_cast<uint32_t>(group_begin + k_warp + WK * load_j0);
#pragma unroll
    for (int r = 0; r < kRoundRows; ++r) {
      // Unsigned: a padded round's groups pass the row's end (never loaded).
      const uint32_t index =
          static_cast<uint32_t>(min(first_row + row_offsets[r], last_row)) * groups + group;
      if constexpr (kRoundPointers) {
        round_words[r] = lane_words + uint64_t{index} * 16u;
        round_scales[r] = lane_scales + uint64_t{index} * scale_bytes;
      } else {
        round_index[r] = index;
      }
    }
  };
  auto words_of = [&](int r) {
    if constexpr (kRoundPointers) {
      return round_words[r];
    } else {
      return lane_words + uint64_t{round_index[r]} * 16u;
    }
  };
  auto scales_of = [&](int r) {
    if constexpr (kRoundPointers) {
      return round_scales[r];
    } else {
      return lane_scales + uint64_t{round_index[r]} * scale_bytes;
    }
  };
  // Group s of the round: WK · s groups past the round's first (immediate load offsets).
  auto load_group = [&](int slot) {
    if (load_tile >= block_tiles || load_j0 + slot >= warp_groups) return;
#pragma unroll
    for (int r = 0; r < kRoundRows; ++r) {
      packed[slot][r] = __ldg(reinterpret_cast<const uint32_t*>(words_of(r) + 16 * WK * slot));
      const uint8_t* scale = scales_of(r);
      if constexpr (kNvfp4) {
        scale_bits[slot][r] = __ldg(scale + 2 * WK * slot);
      } else if (scales_f32) {
        scale_bits[slot][r] = __ldg(reinterpret_cast<const uint32_t*>(scale) + WK * slot);
      } else {
        scale_bits[slot][r] = __ldg(reinterpret_cast<const uint16_t*>(scale) + WK * slot);
      }
    }
  };
  auto next_load_round = [&] {
    load_j0 += kPrefetchGroups;
    if (load_j0 == tile_stream) {
      load_j0 = 0;
      ++load_tile;
    }
    begin_load_round();
  };
  // Weights never depend on the previous kernel: their loads go out before the wait.
  begin_load_round();
#pragma unroll
  for (int s = 0; s < kPrefetchGroups; ++s) load_group(s);
  next_load_round();
  pdl_wait_for_predecessors();

  // The block's K range of every activation row (rows m >= a.m as zeros), in fragment order,
  // group-major: word (group, m, t) at 4 · (kPaddedRows · group + m) + t, so that a warp's load
  // of one n tile is 512 consecutive bytes (no bank conflicts) at a constant offset per n tile.
  extern __shared__ uint4 shared_words[];
  constexpr int kGroupWords = 4 * kPaddedRows;
  const int staged_words = kGroupWords * group_count;
  // Eight words in flight per thread: the staging is a few L2 round trips, not one per word.
#pragma unroll 8
  for (int i = threadIdx.x; i < staged_words; i += kThreads) {
    const int group = i / kGroupWords;
    const int m = (i / 4) % kPaddedRows;
    shared_words[i] = m < a.m ? staged_word<XT>(a, m, 32 * (group_begin + group) + 8 * (i % 4))
                              : make_uint4(0, 0, 0, 0);
  }
  // kQ8: the activation scales [group][row], after the staged rows.
  float* x_scales =
      reinterpret_cast<float*>(shared_words + kGroupWords * static_cast<int>(groups_per_split));
  if constexpr (XT == ActType::kQ8) {
    for (int i = threadIdx.x; i < kPaddedRows * group_count; i += kThreads) {
      const int group = i / kPaddedRows;
      const int m = i % kPaddedRows;
      x_scales[i] = m < a.m ? __ldg(reinterpret_cast<const float*>(q8_row(a, m) + a.x_stride) +
                                    group_begin + group)
                            : 0.0f;
    }
  }
  __syncthreads();

  constexpr int64_t kStride = mma_gemv_partial_stride(WR);
  constexpr int64_t kSlice = kPaddedRows * kStride;
  constexpr int64_t kBufferFloats = WK * kSlice;
  const bool looping = a.partial_offset != 0;
  float* const partial_base =
      reinterpret_cast<float*>(reinterpret_cast<char*>(shared_words) + a.partial_offset);
  // NVFP4: 2^7 (the e2m1 decode's 2^-7) and the global factor in the checkpoint's convention.
  const float sum_scale =
      kNvfp4 ? (a.nv_global_is_divisor ? 128.0f / a.nv_global : 128.0f * a.nv_global) : 1.0f;
  // w4g32 scale bits as fp32: bf16 shifted up, f32 as is, f16 converted.
  const int scale_shift = a.scale_type == kScaleBF16 ? 16 : 0;
  const bool scales_f16 = a.scale_type == kScaleF16;
  auto scale_value = [&](uint32_t bits) {
    const float f16 = __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    return scales_f16 ? f16 : __uint_as_float(bits << scale_shift);
  };
  cg::cluster_group cluster = cg::this_cluster();
  // This lane's activation words: row g of n tile 0, word t, of the warp's first group.
  const uint4* const lane_activations = shared_words + 4 * (kPaddedRows * k_warp + g) + t;

  for (int tile = 0; tile < block_tiles; ++tile) {
    float acc[kTilesPerWarp][NT][4] = {};
    for (int j0 = 0; j0 < tile_stream; j0 += kPrefetchGroups) {
      const uint4* const round_activations = lane_activations + kGroupWords * WK * j0;
#pragma unroll
      for (int s = 0; s < kPrefetchGroups; ++s) {
        const int j = j0 + s;
        const bool active = j < warp_groups;
        const int i = k_warp + WK * j;            // the group within the block's range
        uint32_t fragments[kTilesPerWarp][2][4];  // [tile][step][register]
        float scales[2 * kTilesPerWarp];
        if (active) {
#pragma unroll
          for (int w = 0; w < kTilesPerWarp; ++w) {
            uint32_t top[4], bottom[4];  // rows g and g + 8
            if constexpr (kNvfp4) {
              scaled_e2m1_pairs(packed[s][2 * w], e4m3_bf16_pair(scale_bits[s][2 * w]), top);
              scaled_e2m1_pairs(packed[s][2 * w + 1], e4m3_bf16_pair(scale_bits[s][2 * w + 1]),
                                bottom);
            } else {
              centered_nibble_pairs(packed[s][2 * w], top);
              centered_nibble_pairs(packed[s][2 * w + 1], bottom);
            }
#pragma unroll
            for (int step = 0; step < 2; ++step) {
              fragments[w][step][0] = top[2 * step];
              fragments[w][step][1] = bottom[2 * step];
              fragments[w][step][2] = top[2 * step + 1];
              fragments[w][step][3] = bottom[2 * step + 1];
            }
            if constexpr (!kNvfp4) {
              scales[2 * w] = scale_value(scale_bits[s][2 * w]);
              scales[2 * w + 1] = scale_value(scale_bits[s][2 * w + 1]);
            }
          }
        }
        load_group(s);
        if (!active) continue;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 b = round_activations[kGroupWords * WK * s + 32 * nt];
          // kQ8: the scales of activation rows 2t, 2t + 1 of the n tile (columns of c0/c2,
          // c1/c3).
          float2 x_scale = make_float2(1.0f, 1.0f);
          if constexpr (XT == ActType::kQ8) {
            x_scale = *reinterpret_cast<const float2*>(x_scales + i * kPaddedRows + 8 * nt + 2 * t);
          }
#pragma unroll
          for (int w = 0; w < kTilesPerWarp; ++w) {
            if constexpr (kNvfp4) {
              // The block scales are in the weights: the mma accumulates across groups.
              mma_bf16(acc[w][nt], fragments[w][0], b.x, b.y);
              mma_bf16(acc[w][nt], fragments[w][1], b.z, b.w);
            } else {
              float group_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              mma_bf16(group_sum, fragments[w][0], b.x, b.y);
              mma_bf16(group_sum, fragments[w][1], b.z, b.w);
              // The weight scales of rows g, g + 8 times (kQ8) the activation scales of rows
              // 2t, 2t + 1 (1 otherwise: folded away).
              const float top = scales[2 * w], bottom = scales[2 * w + 1];
              const float factors[4] = {top * x_scale.x, top * x_scale.y, bottom * x_scale.x,
                                        bottom * x_scale.y};
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                acc[w][nt][e] = fmaf(factors[e], group_sum[e], acc[w][nt][e]);
              }
            }
          }
        }
      }
      next_load_round();
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

    // Every block of the cluster sums the K splits for its share of the outputs, in (rank, k
    // warp) order (the same sums every run), and stores them through the epilogue: one thread
    // per row pair, so the pairs epilogue sees both rows.
    if (splits > 1) {
      cluster.sync();
    } else {
      __syncthreads();
    }
    const int64_t block_row = tile_row(tile);
    constexpr int kPairs = kRowsPerBlock / 2;
    for (int i = split * kThreads + static_cast<int>(threadIdx.x); i < a.m * kPairs;
         i += splits * kThreads) {
      const int m = i / kPairs;
      const int row = 2 * (i % kPairs);
      // Unrolled over the largest cluster, so that the loads of every rank are in flight at once.
      float2 parts[kMmaGemvMaxSplits][WK];
#pragma unroll
      for (int rank = 0; rank < kMmaGemvMaxSplits; ++rank) {
        if (rank < splits) {
          const float* source = splits > 1 ? cluster.map_shared_rank(partial, rank) : partial;
#pragma unroll
          for (int k = 0; k < WK; ++k) {
            parts[rank][k] =
                *reinterpret_cast<const float2*>(source + k * kSlice + m * kStride + row);
          }
        }
      }
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
      gemv_detail::store_rows<2>(a, m, block_row + row, sums);  // y and its bf16 companion
      if (a.y_companions.q8 != nullptr) {
        // kGeluPairs: consecutive threads store consecutive outputs and a block's outputs are
        // whole chunks of 32, so the lanes of a warp hold one chunk (lane l its element l):
        // quantized together, or skipped together past the matrix.
        const int64_t output = (block_row + row) / 2;
        if (output - lane < a.rows / 2) {
          const float value[1] = {gemv_detail::gelu_pair(sums[0], sums[1])};
          store_chunk_q8<1>(value, lane, q8_row(a.y_companions, m), a.y_companions.stride,
                            output / 32);
        }
      }
    }
  }
  // No block may leave while another still reads its shared memory.
  if (splits > 1) cluster.sync();
}

using MmaKernel = void (*)(MmaGemvArgs);

inline constexpr int kNTileOptions[] = {1, 2, 4, 8};
inline constexpr int kNumKernels = 4 * kNumMmaGemvWarpLayouts;

template <PackedFormat F, ActType XT, size_t... I>
constexpr std::array<MmaKernel, kNumKernels> kernel_table(std::index_sequence<I...>) {
  return {gemv_mma_kernel<F, XT, kNTileOptions[I / kNumMmaGemvWarpLayouts],
                          kMmaGemvWarpLayouts[I % kNumMmaGemvWarpLayouts].warps,
                          kMmaGemvWarpLayouts[I % kNumMmaGemvWarpLayouts].k_warps>...};
}

// The kernel of format F for x_type and index = kNumMmaGemvWarpLayouts · (index of the n tiles
// in kNTileOptions) + (index of the warp layout in kMmaGemvWarpLayouts); nullptr for NVFP4 with
// kQ8 activations (none compiled).
// Explicitly instantiated once per format in gemv_mma_<format>.cu.
template <PackedFormat F>
MmaKernel select_mma_kernel(ActType x_type, int index) {
  if (x_type == ActType::kQ8) {
    if constexpr (F == PackedFormat::kW4G32) {
      static constexpr auto kQ8 =
          kernel_table<F, ActType::kQ8>(std::make_index_sequence<kNumKernels>());
      return kQ8[index];
    }
    return nullptr;
  }
  static constexpr auto kBF16 =
      kernel_table<F, ActType::kBF16>(std::make_index_sequence<kNumKernels>());
  static constexpr auto kF32 =
      kernel_table<F, ActType::kF32>(std::make_index_sequence<kNumKernels>());
  return x_type == ActType::kBF16 ? kBF16[index] : kF32[index];
}

extern template MmaKernel select_mma_kernel<PackedFormat::kW4G32>(ActType, int);
extern template MmaKernel select_mma_kernel<PackedFormat::kNVFP4>(ActType, int);

}  // namespace gemma4::cuda::gemv_mma_detail
