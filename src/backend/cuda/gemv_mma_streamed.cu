// The streamed tensor-core batched GEMV (gemv_mma_kernels.h, MmaGemvTiling::streamed): NVFP4
// weights, bf16 activations. The same products, decode and cluster reduction as gemv_mma_kernel
// (gemv_mma_kernel.cuh), but a block stages nothing up front: its K range goes through a ring of
// kStages shared-memory stages, one quad of groups (128 elements of K) each, that cp.async fills
// with the stage's weights, their block scales and the activations of the same K, kStages - 1
// stages always in flight. Why: the register kernel stages a block's whole K range of
// activations (at 32 rows as many bytes as its weights, from L2) before its first product, then
// keeps 2-4 quads of weights a warp in flight; at the 26B-A4B shapes at 32 rows it reached
// 0.5-0.9 TB/s (kernel_bench, H200: qkv 8192x2816 14.6 µs, gate+up 12.9, down 9.0, o_proj 10.7).
// Measured (session 12, H200): faster at the shapes and row counts gemv_mma.cpp's
// kStreamedTilings lists (gate+up 10.5, down 8.1, o_proj 9.9 µs at 32 rows), slower at the 26B
// QKV at 17-32 rows (17.7 µs at best) and equal at 2-8; the 26B at 32 streams 3,183.5 -> 3,249.9
// tok/s (+2.1 %), 8 streams and one row unchanged. Activations put in the pairs order once by the
// copying thread instead of by every reading warp (fewer PRMT): slower (gate+up 11.0 µs).
#include "backend/cuda/gemv_mma_kernel.cuh"
#include "backend/cuda/launch.cuh"

namespace gemma4::cuda {
namespace gemv_mma_detail {
namespace {

// Stages of the ring: 5 in flight (at 32 activation rows 85 KB a 128-row block, two blocks an
// SM; 130 KB a 256-row one).
constexpr int kStages = 6;

// Eight bf16 activations as the pairs (v0, v4), (v1, v5), (v2, v6), (v3, v7) (staged_word's
// order).
__device__ __forceinline__ uint4 pairs_order(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                    __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}

// Bytes of one stage: weights (16 a row and group), e4m3 block-scale pairs (2 a row and group),
// the activations in fragment order (64 a padded row and group).
constexpr int stage_bytes(int rows, int padded_rows) {
  return kQuadGroups * (16 * rows + 2 * rows + 64 * padded_rows);
}

// NT n tiles of 8 activation rows; WR warps of TW 16-row tiles each (16 · TW · WR weight rows per
// block); gridDim.y blocks along K form one cluster, gridDim.x the row tiles, gridDim.z the
// blocks along the activation rows. Registers: one-tile warps at 128 (two blocks of 8 an SM),
// two-tile warps at up to 255 (8 warps an SM: the shared memory of two 128-row blocks or one
// 256-row block).
template <int NT, int WR, int TW>
__global__ void __launch_bounds__(WR * 32, (TW == 1 ? 16 : 8) / WR)
    gemv_mma_streamed_kernel(MmaGemvArgs a) {
  if (a.trigger == MmaGemvTrigger::kAtStart) pdl_trigger_dependents();
  constexpr int kRows = 16 * TW * WR;
  constexpr int kPaddedRows = 8 * NT;
  constexpr int kThreads = 32 * WR;
  constexpr int kStageBytes = stage_bytes(kRows, kPaddedRows);
  constexpr int kWeightChunks = kRows * kQuadGroups;     // 16 bytes each
  constexpr int kScaleChunks = kRows * kQuadGroups / 2;  // 4 bytes each: two groups' pairs
  constexpr int kActivationChunks = kPaddedRows * kQuadGroups * 4;  // 16 bytes: 8 elements
  const int m_begin = static_cast<int>(blockIdx.z) * kPaddedRows;
  const int m_count = min(a.m - m_begin, kPaddedRows);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int t = lane & 3;
  const int64_t groups_per_split = mma_gemv_groups_per_split(a.groups, gridDim.y);
  const int64_t group_begin = blockIdx.y * groups_per_split;
  const int64_t group_end = min(a.groups, group_begin + groups_per_split);
  const int quad_count =
      static_cast<int>(max(int64_t{0}, (group_end - group_begin + kQuadGroups - 1) / kQuadGroups));
  const int64_t block_row = static_cast<int64_t>(blockIdx.x) * kRows;

  extern __shared__ uint4 shared_words[];
  auto stage_base = [&](int quad) {
    return reinterpret_cast<uint8_t*>(shared_words) + (quad % kStages) * kStageBytes;
  };
  // Stage layout: weights [row][t] (a warp's load of rows g, g + 8 and groups t: 512 consecutive
  // bytes), activations [j][row][t] (gemv_mma_kernel's staging order, raw bf16), scales [row][t].
  constexpr int kActivationOffset = 16 * kWeightChunks;
  constexpr int kScaleOffset = kActivationOffset + 16 * kActivationChunks;
  const auto* const weights = static_cast<const uint8_t*>(a.weights);
  const auto* const scales = static_cast<const uint8_t*>(a.scales);
  const auto* const x = static_cast<const __nv_bfloat16*>(a.x);
  // Each thread's copies: the same chunks of every stage, their sources one quad (64 bytes of a
  // weight row, 8 of its scales, 128 activations) further per stage. Rows past the matrix, rows
  // past the block's activation rows and groups past the block's range are zeros (products never
  // stored, or zero times zero).
  const int group_count = static_cast<int>(group_end - group_begin);
  constexpr int kWeightCopies = kWeightChunks / kThreads;
  constexpr int kScaleCopies = kScaleChunks / kThreads;
  constexpr int kActivationCopies = (kActivationChunks + kThreads - 1) / kThreads;
  const uint8_t* weight_sources[kWeightCopies];
  bool weight_rows_in[kWeightCopies];
#pragma unroll
  for (int i = 0; i < kWeightCopies; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads;
    const int64_t row = block_row + c / kQuadGroups;
    weight_rows_in[i] = row < a.rows;
    weight_sources[i] = weights + 16 * (row * a.groups + group_begin + c % kQuadGroups);
  }
  const uint8_t* scale_sources[kScaleCopies];
  bool scale_rows_in[kScaleCopies];
#pragma unroll
  for (int i = 0; i < kScaleCopies; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads;
    const int64_t row = block_row + c / 2;
    scale_rows_in[i] = row < a.rows;
    scale_sources[i] = scales + 2 * (row * a.groups + group_begin + 2 * (c % 2));
  }
  // Consecutive threads read consecutive 16 bytes of a row: c = (m · 4 + t) · 4 + j.
  const __nv_bfloat16* activation_sources[kActivationCopies];
  bool activation_rows_in[kActivationCopies];
#pragma unroll
  for (int i = 0; i < kActivationCopies; ++i) {
    const int c = static_cast<int>(threadIdx.x) + i * kThreads;
    const int m = c / 16;
    activation_rows_in[i] = c < kActivationChunks && m < m_count;
    activation_sources[i] =
        x + (m_begin + m) * a.x_stride + 32 * (group_begin + (c / 4) % kQuadGroups) + 8 * (c % 4);
  }
  auto copy_weights = [&](int quad) {
    if (quad >= quad_count) return;
    uint8_t* stage = stage_base(quad);
#pragma unroll
    for (int i = 0; i < kWeightCopies; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      const bool valid = weight_rows_in[i] && kQuadGroups * quad + c % kQuadGroups < group_count;
      copy_async16_or_zeros(stage + 16 * c, valid ? weight_sources[i] + 64 * quad : weights, valid);
    }
#pragma unroll
    for (int i = 0; i < kScaleCopies; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      // The pair's first group even: the pair lies in the range or past it.
      const bool valid = scale_rows_in[i] && kQuadGroups * quad + 2 * (c % 2) < group_count;
      copy_async4_or_zeros(stage + kScaleOffset + 4 * c,
                           valid ? scale_sources[i] + 8 * quad : scales, valid);
    }
  };
  auto copy_activations = [&](int quad) {
    if (quad >= quad_count) return;
    uint8_t* stage = stage_base(quad) + kActivationOffset;
#pragma unroll
    for (int i = 0; i < kActivationCopies; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      if (c >= kActivationChunks) break;
      const int j = c % 4;
      const int t_of = (c / 4) % kQuadGroups;
      const int m = c / 16;
      const bool valid = activation_rows_in[i] && kQuadGroups * quad + t_of < group_count;
      copy_async16_or_zeros(stage + 16 * ((j * kPaddedRows + m) * 4 + t_of),
                            valid ? activation_sources[i] + 128 * quad : x, valid);
    }
  };

  // Weights never depend on the previous kernel: the first stages' go out before the wait, one
  // commit group each; then the activations' groups. Stage q's copies are complete when all but
  // the kStages - 2 newest groups are (one group committed per stage in the loop).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    copy_weights(s);
    commit_copies();
  }
  pdl_wait_for_predecessors();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    copy_activations(s);
    commit_copies();
  }

  const float sum_scale = a.nv_global_is_divisor ? 128.0f / a.nv_global : 128.0f * a.nv_global;
  float acc[TW][NT][4] = {};
  for (int quad = 0; quad < quad_count; ++quad) {
    wait_copies<kStages - 2>();
    __syncthreads();  // stage `quad` visible; every warp done with the one refilled below
    copy_weights(quad + kStages - 1);
    copy_activations(quad + kStages - 1);
    commit_copies();
    const uint8_t* stage = stage_base(quad);
    const auto* stage_words = reinterpret_cast<const uint4*>(stage);
    const auto* stage_activations = reinterpret_cast<const uint4*>(stage + kActivationOffset);
    const auto* stage_scales = reinterpret_cast<const uint16_t*>(stage + kScaleOffset);
    uint4 words[2 * TW];
    // The e4m3 scales of each row's two 16-element blocks (words 0, 1 and 2, 3), converted once.
    __nv_bfloat162 block_scales[2 * TW][2];
#pragma unroll
    for (int r = 0; r < 2 * TW; ++r) {
      // Tile r / 2, rows g + 8 · (r % 2): lane (g, t) at row · 4 + t.
      const int index = 4 * (16 * (TW * warp + r / 2) + 8 * (r % 2)) + lane;
      words[r] = stage_words[index];
      const uint32_t bits = stage_scales[index];
      block_scales[r][0] = e4m3_bf16_pair(bits);
      block_scales[r][1] = e4m3_bf16_pair(bits >> 8);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t fragments[TW][2][4];  // [tile][step][register]
#pragma unroll
      for (int w = 0; w < TW; ++w) {
        uint32_t rows[2][4];  // rows g and g + 8
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4& word4 = words[2 * w + h];
          const uint32_t word = j == 0 ? word4.x : j == 1 ? word4.y : j == 2 ? word4.z : word4.w;
          // Words 0, 1 are the group's first 16-element block, 2, 3 its second.
          scaled_e2m1_pairs(word, block_scales[2 * w + h][j / 2], rows[h]);
        }
        a_fragments(rows, fragments[w]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        // Elements 8j .. 8j + 7 of group t of activation row 8 · nt + g, as the pairs (v0, v4),
        // (v1, v5), (v2, v6), (v3, v7) (staged_word's order).
        const uint4 v = stage_activations[4 * kPaddedRows * j + 32 * nt + lane];
        const uint4 pairs = pairs_order(v);
        const uint32_t b[4] = {pairs.x, pairs.y, pairs.z, pairs.w};
#pragma unroll
        for (int w = 0; w < TW; ++w) {
          mma_bf16(acc[w][nt], fragments[w][0], b[0], b[1]);
          mma_bf16(acc[w][nt], fragments[w][1], b[2], b[3]);
        }
      }
    }
  }
  if (a.trigger == MmaGemvTrigger::kAfterProducts) pdl_trigger_dependents();

  // Partial sums [activation row][block row] over the ring (every warp past its last stage).
  constexpr int64_t kStride = mma_gemv_partial_stride(kRows);
  wait_copies<0>();
  __syncthreads();
  auto* const partial = reinterpret_cast<float*>(shared_words);
  const int g = lane >> 2;
#pragma unroll
  for (int w = 0; w < TW; ++w) {
    const int row = 16 * (TW * warp + w) + g;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int m = 8 * nt + 2 * t;
      partial[m * kStride + row] = acc[w][nt][0] * sum_scale;
      partial[(m + 1) * kStride + row] = acc[w][nt][1] * sum_scale;
      partial[m * kStride + row + 8] = acc[w][nt][2] * sum_scale;
      partial[(m + 1) * kStride + row + 8] = acc[w][nt][3] * sum_scale;
    }
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (gridDim.y > 1) {
    cluster.sync();
  } else {
    __syncthreads();
  }
  store_cluster_sums<1, kThreads, kRows, kPaddedRows>(a, cluster, partial, m_begin, m_count,
                                                      block_row);
  // No block may leave while another still reads its shared memory.
  if (gridDim.y > 1) cluster.sync();
}

// The kernels by n tiles (the first kStreamedNTileOptions of kNTileOptions: 1, 2, 4) and layout
// (kMmaGemvStreamedLayouts' order).
constexpr int kStreamedNTileOptions = 3;
constexpr auto kStreamedKernels =
    kernel_table<kStreamedNTileOptions * kNumMmaGemvStreamedLayouts>([](auto index) {
      constexpr int i = decltype(index)::value;
      constexpr MmaGemvWarpLayout layout = kMmaGemvStreamedLayouts[i % kNumMmaGemvStreamedLayouts];
      return &gemv_mma_streamed_kernel<kNTileOptions[i / kNumMmaGemvStreamedLayouts], layout.warps,
                                       layout.tiles_per_warp>;
    });

}  // namespace
}  // namespace gemv_mma_detail

int64_t mma_gemv_streamed_shared_bytes(const MmaGemvTiling& tiling, int m) {
  const int rows = mma_gemv_tile_rows(tiling);
  const int padded_rows = 8 * mma_gemv_n_tiles(mma_gemv_block_m(tiling, m));
  const int64_t ring =
      int64_t{gemv_mma_detail::kStages} * gemv_mma_detail::stage_bytes(rows, padded_rows);
  const int64_t partial = int64_t{padded_rows} * mma_gemv_partial_stride(rows) * 4;
  return ring > partial ? ring : partial;
}

cudaError_t launch_gemv_mma_streamed(const MmaGemvArgs& given, const MmaGemvTiling& tiling,
                                     const Launch& launch) {
  MmaGemvArgs args = given;
  const int block_m = mma_gemv_block_m(tiling, args.m);
  const int block_n_tiles = mma_gemv_n_tiles(block_m);
  const int n_tiles = gemv_mma_detail::mma_gemv_n_tile_index(block_n_tiles);
  int layout = -1;
  for (int i = 0; i < kNumMmaGemvStreamedLayouts; ++i) {
    if (kMmaGemvStreamedLayouts[i].warps == tiling.warps &&
        kMmaGemvStreamedLayouts[i].tiles_per_warp == tiling.tiles_per_warp && tiling.k_warps == 1) {
      layout = i;
    }
  }
  if (n_tiles < 0 || n_tiles >= gemv_mma_detail::kStreamedNTileOptions || layout < 0 ||
      tiling.row_blocks != 0) {
    return cudaErrorInvalidValue;
  }
  const auto kernel =
      gemv_mma_detail::kStreamedKernels[kNumMmaGemvStreamedLayouts * n_tiles + layout];
  const int64_t shared = mma_gemv_streamed_shared_bytes(tiling, args.m);
  const cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kMmaGemvMaxSharedBytes));
  if (status != cudaSuccess) return status;
  cudaLaunchConfig_t config = {};
  const int64_t rows_per_tile = mma_gemv_tile_rows(tiling);
  const int activation_blocks = (args.m + 8 * block_n_tiles - 1) / (8 * block_n_tiles);
  config.gridDim =
      dim3(static_cast<unsigned>((args.rows + rows_per_tile - 1) / rows_per_tile),
           static_cast<unsigned>(tiling.splits), static_cast<unsigned>(activation_blocks));
  config.blockDim = dim3(32 * tiling.warps);
  config.dynamicSmemBytes = static_cast<size_t>(shared);
  config.stream = launch.stream;
  LaunchAttributes attributes(tiling.splits, launch.pdl);
  attributes.apply(config);
  args.partial_offset = 0;
  args.trigger = tiling.trigger;
  return cudaLaunchKernelEx(&config, kernel, args);
}

}  // namespace gemma4::cuda
