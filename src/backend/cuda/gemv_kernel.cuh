// The decode GEMV kernel template (gemv.h) and the table of its instantiations for one weight
// format. Each format's instantiations live in their own translation unit (gemv_<format>.cu) so
// that nvcc compiles them in parallel; only the tilings that gemv_tiling_compiled() admits are
// instantiated (all of them with GEMMA4_GEMV_ALL_TILINGS, the kernel benchmark's build), and the
// GGUF formats only with fp32 activations, which keeps the CI compile time in check. The
// epilogue (GemvEpilogue) is a runtime switch at the store: it costs no extra instantiations.
#pragma once

#include <array>
#include <utility>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/gemv_residual_norm.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/q8.cuh"

namespace gemma4::cuda::gemv_detail {

using WeightFormat = PackedFormat;
using KernelFn = void (*)(GemvArgs);

// gelu_tanh(gate) · up: the kGeluPairs output, one expression for y and its companions.
__device__ __forceinline__ float gelu_pair(float gate, float up) {
  return gelu_tanh(gate) * up;
}

// Stores the dot products acc[0..R) of rows first_row .. first_row + R − 1 (first_row even) for
// activation row m through the epilogue, and the bf16 companion of what it stores when
// a.y_companions.bf16 is set (kQ8 companions: the reduction path of gemv_kernel). Rows at or past
// a.rows are skipped; a.rows is even for kGeluPairs, so a pair is stored whole or not at all.
// Params: GemvArgs, EpilogueArgs or another block with the same output fields (y_companions
// optional).
template <int R, typename Params>
__device__ __forceinline__ void store_rows(const Params& a, int m, int64_t first_row,
                                           const float (&acc)[R]) {
  static_assert(R % 2 == 0, "a thread stores whole gate/up pairs");
  float* y = a.y + m * a.y_stride;
  __nv_bfloat16* y_bf16 = nullptr;
  if constexpr (requires { a.y_companions; }) {  // parameter blocks without companions: none
    if (a.y_companions.bf16 != nullptr) {
      y_bf16 = reinterpret_cast<__nv_bfloat16*>(a.y_companions.bf16) + m * a.y_companions.stride;
    }
  }
  auto store = [&](int64_t index, float value) {
    y[index] = value;
    if (y_bf16 != nullptr) y_bf16[index] = __float2bfloat16_rn(value);
  };
  switch (a.epilogue) {
    case GemvEpilogue::kNone:
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (first_row + r < a.rows) store(first_row + r, acc[r]);
      }
      break;
    case GemvEpilogue::kGeluMul: {
      const float* multiplier = a.multiplier + m * a.multiplier_stride;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (first_row + r < a.rows) {
          store(first_row + r, gelu_tanh(acc[r]) * multiplier[first_row + r]);
        }
      }
      break;
    }
    case GemvEpilogue::kGeluPairs:
#pragma unroll
      for (int r = 0; r < R; r += 2) {
        if (first_row + r < a.rows) store((first_row + r) / 2, gelu_pair(acc[r], acc[r + 1]));
      }
      break;
  }
}

// Thread layout: lane l of warp w belongs to team l / T (rows R·team .. R·team + R−1 of the
// block) and reads, in pass p, the chunks p·(T·W·G) + (j·W + w)·T + l % T for j < G: T
// consecutive lanes read T consecutive 16-byte chunks of a row (coalesced). P: the loads of pass
// p + 1 go out before the products of pass p (GemvTiling::prefetch_next_pass; MT 1).
template <WeightFormat F, ActType XT, int R, int T, int W, int G, int MT, bool P>
__global__ void __launch_bounds__(W * 32) gemv_kernel(GemvArgs a) {
  static_assert(!P || MT == 1, "prefetching tilings are single-row");
  static_assert(W == 1 || gemv_partial_floats({R, T, W, G, MT}) >= W,
                "the residual-step prologue sums across warps in the partials' first W floats");
  pdl_trigger_dependents();
  constexpr int kTeams = 32 / T;
  constexpr int kRowsPerBlock = kTeams * R;
  constexpr int kElems = kChunkElems<F>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int team = lane / T;
  const int lane_in_team = lane % T;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + team * R;
  const int64_t pass_chunks = T * W * G;
  const int passes = static_cast<int>((a.chunks_per_row + pass_chunks - 1) / pass_chunks);

  uint4 weights[G][R];
  ScaleBits<F> scale_bits[G][R];
  // P: the next pass's, moved into weights / scale_bits when its products start.
  [[maybe_unused]] uint4 next_weights[P ? G : 1][R];
  [[maybe_unused]] ScaleBits<F> next_scale_bits[P ? G : 1][R];
  auto chunk_of = [&](int pass, int j) {
    return pass * pass_chunks + (j * W + warp) * T + lane_in_team;
  };
  auto load_pass_into = [&](int pass, auto& to_weights, auto& to_scale_bits) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = chunk_of(pass, j);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = first_row + r;
        if (row < a.rows && chunk < a.chunks_per_row) {
          to_weights[j][r] = load_weights_nc(static_cast<const uint4*>(a.weights) +
                                             row * a.chunks_per_row + chunk);
          to_scale_bits[j][r] = load_scale_bits<F>(a, row, chunk);
        } else {
          to_weights[j][r] = make_uint4(0, 0, 0, 0);
          to_scale_bits[j][r] = {};
        }
      }
    }
  };
  auto load_pass = [&](int pass) { load_pass_into(pass, weights, scale_bits); };

  // Weights never depend on the previous kernel: their loads go out before the wait.
  load_pass(0);
  if constexpr (P) {
    if (passes > 1) load_pass_into(1, next_weights, next_scale_bits);
  }
  // NVFP4: the factor of every e4m3 group-scale code, once per block (in the divisor convention a
  // division each) instead of twice per chunk and activation row; also before the wait.
  const float* nv_factors = nullptr;
  if constexpr (F == WeightFormat::kNVFP4) {
    __shared__ float factor_table[kNvfp4FactorCodes];
    for (int code = threadIdx.x; code < kNvfp4FactorCodes; code += W * 32) {
      factor_table[code] = nvfp4_factor(a, static_cast<uint32_t>(code));
    }
    nv_factors = factor_table;
    __syncthreads();
  }
  if constexpr (XT == ActType::kF32)
    prefetch_residual_norm_weight(a.residual_norm, kElems * a.chunks_per_row);
  pdl_wait_for_predecessors();

  // Dynamic shared memory (gemv_shared_bytes): the split-K partial sums [W][MT][kRowsPerBlock]
  // when W > 1, then for kBF16Staged a.staged_rows activation rows of K bf16 values, each row
  // a.chunks_per_row · kPieces 16-byte words in load_x_chunk_staged's piece-major order.
  extern __shared__ uint4 shared_words[];
  float* partial = reinterpret_cast<float*>(shared_words);
  constexpr int kPieces = kElems / 8;  // 16-byte bf16 words per chunk
  const int64_t staged_row_words = a.chunks_per_row * kPieces;
  constexpr int64_t kPartialWords = gemv_partial_floats({R, T, W, G, MT}) / 4;
  uint4* staged = shared_words + kPartialWords;
  const bool staged_x = XT == ActType::kF32 && a.f32_products == F32Products::kBF16Staged;
  // Exact fp32 activations meet w4g32 / w4g32a nibbles re-centred (NibbleDot::kCentered): the
  // biased products of the bf16 paths would lose ~6 bits to cancellation here.
  constexpr bool kNibbleFormat = F == WeightFormat::kW4G32 || F == WeightFormat::kW4G32A;
  const bool centered_nibbles =
      kNibbleFormat && XT == ActType::kF32 && a.f32_products == F32Products::kExact;
  for (int m0 = 0; m0 < a.m; m0 += MT) {
    if (staged_x) {
      // Rows m0 .. m0 + staged_rows − 1 of x, rounded to bf16; the previous m tile's reads of
      // the staged rows end at the first barrier.
      if (m0 > 0) __syncthreads();
      const int rows_here = min(a.staged_rows, a.m - m0);
      // A residual step stages its own rows (gemv_residual_norm.cuh); else x's.
      const bool residual_step = a.residual_norm.residual != nullptr;
      if (residual_step) stage_residual_norm_rows<kPieces, W>(a, m0, rows_here, staged, partial);
      const int x_rows = residual_step ? 0 : rows_here;
      // Unrolled so that several L2 round trips overlap (a one-warp block stages K = 1536 in
      // six steps). Indices fit int: at most 8 rows of K / 8 words reach shared memory.
      const int row_words = static_cast<int>(staged_row_words);
#pragma unroll 4
      for (int i = threadIdx.x; i < x_rows * row_words; i += W * 32) {
        const int row = i / row_words;
        const int piece = i % row_words;  // elements 8·piece .. 8·piece + 7
        const float4* source = reinterpret_cast<const float4*>(static_cast<const float*>(a.x) +
                                                               (m0 + row) * a.x_stride + 8 * piece);
        const float4 lo = __ldg(source), hi = __ldg(source + 1);
        staged[row * staged_row_words + (piece % kPieces) * a.chunks_per_row + piece / kPieces] =
            make_uint4(pack_bf16x2(lo.x, lo.y), pack_bf16x2(lo.z, lo.w), pack_bf16x2(hi.x, hi.y),
                       pack_bf16x2(hi.z, hi.w));
      }
      __syncthreads();
    }
    float acc[MT][R];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int r = 0; r < R; ++r) acc[mi][r] = 0.0f;
    }
    for (int pass = 0; pass < passes; ++pass) {
      if constexpr (P) {
        if (pass == 0) {
          // Another activation row over the same weights: passes 0 and 1 again.
          if (m0 > 0 && passes > 1) {
            load_pass(0);
            load_pass_into(1, next_weights, next_scale_bits);
          }
        } else {
#pragma unroll
          for (int j = 0; j < G; ++j) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
              weights[j][r] = next_weights[j][r];
              scale_bits[j][r] = next_scale_bits[j][r];
            }
          }
          if (pass + 1 < passes) load_pass_into(pass + 1, next_weights, next_scale_bits);
        }
      } else if (pass > 0 || (m0 > 0 && passes > 1)) {
        load_pass(pass);
      }
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int64_t chunk = chunk_of(pass, j);
        if (chunk >= a.chunks_per_row) continue;
        [[maybe_unused]] float factors[R][2];  // NVFP4: the chunk's two group factors per row
        if constexpr (F == WeightFormat::kNVFP4) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            factors[r][0] = nv_factors[scale_bits[j][r] & 0xFF];
            factors[r][1] = nv_factors[(scale_bits[j][r] >> 8) & 0xFF];
          }
        }
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          if (m0 + mi >= a.m) break;
          typename XChunkFor<XT, kElems>::type x;
          if constexpr (XT == ActType::kQ8) {
            load_x_chunk_q8(a.x, m0 + mi, a.x_stride, chunk, x);
          } else if (staged_x) {
            load_x_chunk_staged(staged + mi * staged_row_words, a.chunks_per_row, chunk, x);
          } else {
            load_x_chunk<XT>(a.x, (m0 + mi) * a.x_stride + chunk * kElems, x,
                             a.f32_products == F32Products::kBF16InRegisters);
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if constexpr (F == WeightFormat::kNVFP4 && XT != ActType::kQ8) {
              acc[mi][r] += dot_nvfp4_factors(weights[j][r], factors[r][0], factors[r][1], x);
            } else if constexpr (kNibbleFormat && XT == ActType::kF32) {
              acc[mi][r] += centered_nibbles ? dot_chunk<F, NibbleDot::kCentered>(
                                                   weights[j][r], scale_bits[j][r], a, x)
                                             : dot_chunk<F>(weights[j][r], scale_bits[j][r], a, x);
            } else {
              acc[mi][r] += dot_chunk<F>(weights[j][r], scale_bits[j][r], a, x);
            }
          }
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int offset = T / 2; offset > 0; offset /= 2) {
          acc[mi][r] += __shfl_xor_sync(0xFFFFFFFFu, acc[mi][r], offset);
        }
      }
    }
    if constexpr (W == 1) {
      if (lane_in_team == 0) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          if (m0 + mi < a.m) store_rows<R>(a, m0 + mi, first_row, acc[mi]);
        }
      }
    } else {
      if (lane_in_team == 0) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            partial[(warp * MT + mi) * kRowsPerBlock + team * R + r] = acc[mi][r];
          }
        }
      }
      __syncthreads();
      // One thread per pair of rows (kRowsPerBlock is even), so the pairs epilogue sees both.
      constexpr int kPairsPerBlock = kRowsPerBlock / 2;
      for (int i = threadIdx.x; i < MT * kPairsPerBlock; i += W * 32) {
        const int mi = i / kPairsPerBlock;
        const int row_in_block = 2 * (i % kPairsPerBlock);
        float sums[2] = {0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < W; ++w) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            sums[h] += partial[(w * MT + mi) * kRowsPerBlock + row_in_block + h];
          }
        }
        const int64_t pair_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + row_in_block;
        if (m0 + mi < a.m) store_rows<2>(a, m0 + mi, pair_row, sums);
        if constexpr (gemv_tiling_emits_q8_pairs({R, T, W, G, MT})) {
          // Warp 0 holds the block's 32 outputs (one kQ8 chunk), lane l output l.
          if (a.y_companions.q8 != nullptr) {
            const float out[1] = {gelu_pair(sums[0], sums[1])};
            store_companions<1>({nullptr, a.y_companions.q8, a.y_companions.stride}, m0 + mi,
                                pair_row / 2, out, pair_row < a.rows);
          }
        }
      }
      __syncthreads();
    }
  }
}

template <WeightFormat F, ActType XT, int I>
constexpr KernelFn kernel_for() {
  if constexpr (gemv_tiling_compiled(I)) {
    constexpr GemvTiling t = kGemvTilings[I];
    return gemv_kernel<F, XT, t.rows_per_thread, t.lanes_per_row, t.warps, t.chunks_per_thread,
                       t.m_tile, t.prefetch_next_pass>;
  } else {
    return nullptr;
  }
}

template <WeightFormat F, ActType XT, size_t... I>
constexpr std::array<KernelFn, kNumGemvTilings> kernel_table(std::index_sequence<I...>) {
  return {kernel_for<F, XT, static_cast<int>(I)>()...};
}

// Formats with bf16-activation kernels: the checkpoint formats, whose bf16-activation speed the
// benchmark tracks. The GGUF formats run with the engine's fp32 activations only.
template <WeightFormat F>
constexpr bool kHasBF16Activations =
    F == WeightFormat::kW4G32 || F == WeightFormat::kNVFP4 || F == WeightFormat::kBF16;

// The kernel of (F, x type, tiling), or nullptr where none is compiled (kQ8 activations exist for
// kW4G32 only, bf16 ones for kHasBF16Activations). Explicitly instantiated once per format in
// gemv_<format>.cu.
template <WeightFormat F>
KernelFn select_kernel(ActType x_type, int tiling) {
  constexpr auto kTilings = std::make_index_sequence<kNumGemvTilings>();
  if (x_type == ActType::kQ8) {
    if constexpr (F == WeightFormat::kW4G32) {
      static constexpr auto kQ8 = kernel_table<F, ActType::kQ8>(kTilings);
      return kQ8[tiling];
    }
    return nullptr;
  }
  if (x_type == ActType::kBF16) {
    if constexpr (kHasBF16Activations<F>) {
      static constexpr auto kBF16 = kernel_table<F, ActType::kBF16>(kTilings);
      return kBF16[tiling];
    }
    return nullptr;
  }
  static constexpr auto kF32 = kernel_table<F, ActType::kF32>(kTilings);
  return kF32[tiling];
}

extern template KernelFn select_kernel<WeightFormat::kW4G32>(ActType, int);
extern template KernelFn select_kernel<WeightFormat::kNVFP4>(ActType, int);
extern template KernelFn select_kernel<WeightFormat::kBF16>(ActType, int);
extern template KernelFn select_kernel<WeightFormat::kW4G32A>(ActType, int);
extern template KernelFn select_kernel<WeightFormat::kW8>(ActType, int);
extern template KernelFn select_kernel<WeightFormat::kF16>(ActType, int);

}  // namespace gemma4::cuda::gemv_detail
