// Mixture-of-experts kernels (see moe.h): the router, the expert grouping, the grouped expert
// GEMVs and the weighted sum. Weights are dequantized in registers by device_math.cuh's chunk
// dot products, exactly as the dense GEMV does; accumulation is fp32 throughout.
//
// launch_moe for T tokens with top_k experts each ("pairs" p = t · top_k + k) is four launches:
//   1. plan (T > 1 only): one block counts the pairs per expert, numbers the experts in use in
//      ascending id ("slots") and lists each slot's pairs. With T = 1 every pair is its own slot
//      (a token's experts are distinct), so decode skips it.
//   2. gate/up: grid (inner-row tiles, slots). A block loads its rows of the slot's gate and up
//      matrices into registers once and runs every pair of the slot through them, writing
//      gelu_tanh(gate · x) ⊙ (up · x) to activations[p]. Only the selected experts are read, each
//      once per call.
//   3. down: grid (hidden-row tiles, slots), activations[p] → expert_outputs[p], the same way.
//   4. combine: out[t] = Σ_k weights[t][k] · expert_outputs[t · top_k + k], summed in ascending
//      expert id (the CPU reference's order): deterministic, no atomics.
// Decode (T = 1) fuses 3 and 4 (down_combine_kernel): three launches with the router.
// The grouping within a slot is made with shared-memory atomics, so the order of a slot's pairs
// may vary between runs; it never changes a value, because every pair is accumulated on its
// own.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "backend/cuda/device_math.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe_kernels.h"

namespace gemma4::cuda {
namespace {

constexpr int kRouterWarps = 4;
constexpr int kExpertsPerLane = kMaxRouterExperts / 32;

// One warp per token: softmax over the logits (fp32, as transformers), the top_k largest
// probabilities (ties: lower expert id first), renormalised, times per_expert_scale.
__global__ void __launch_bounds__(kRouterWarps * 32) router_kernel(RouterArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int lane = threadIdx.x & 31;
  const int token = blockIdx.x * kRouterWarps + static_cast<int>(threadIdx.x >> 5);
  if (token >= a.tokens) return;
  const float* logits = a.logits + token * a.logits_stride;

  // Lane l holds experts l, l + 32, ...: ascending id with the slot index i.
  float p[kExpertsPerLane];
  float max_logit = -INFINITY;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < a.num_experts ? logits[e] : -INFINITY;
    max_logit = fmaxf(max_logit, p[i]);
  }
  // Butterfly reductions: every lane ends with the same bits (a + b == b + a).
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    max_logit = fmaxf(max_logit, __shfl_xor_sync(0xFFFFFFFFu, max_logit, offset));
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    p[i] = lane + 32 * i < a.num_experts ? expf(p[i] - max_logit) : 0.0f;
    sum += p[i];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
    // Probabilities are >= 0; taken or absent experts get -1 so they never win again.
#pragma unroll
  for (int i = 0; i < kExpertsPerLane; ++i) {
    p[i] = lane + 32 * i < a.num_experts ? p[i] / sum : -1.0f;
  }

  float kept = 0.0f;
  int my_expert = -1;
  float my_probability = 0.0f;
  for (int k = 0; k < a.top_k; ++k) {
    // The lane's best (strict > keeps the lowest id among equals), then the warp's.
    float best = -1.0f;
    int best_expert = INT_MAX;
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      if (p[i] > best) {
        best = p[i];
        best_expert = lane + 32 * i;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xFFFFFFFFu, best, offset);
      const int other_expert = __shfl_xor_sync(0xFFFFFFFFu, best_expert, offset);
      if (other > best || (other == best && other_expert < best_expert)) {
        best = other;
        best_expert = other_expert;
      }
    }
#pragma unroll
    for (int i = 0; i < kExpertsPerLane; ++i) {
      if (lane + 32 * i == best_expert) p[i] = -1.0f;
    }
    // NaN logits leave no winner: that pick is marked invalid (it then contributes nothing).
    const bool valid = best_expert < a.num_experts;
    kept += valid ? best : 0.0f;
    if (lane == k) {
      my_expert = valid ? best_expert : -1;
      my_probability = best;
    }
  }
  if (lane < a.top_k) {
    const int64_t i = static_cast<int64_t>(token) * a.top_k + lane;
    a.expert_ids[i] = my_expert;
    a.weights[i] = my_expert >= 0 ? my_probability / kept * a.per_expert_scale[my_expert] : 0.0f;
  }
}

// The grouping, int32 words in the workspace: [0] = number of slots S, [1 + s] = expert of slot
// s (ascending), [1 + E + s] = first entry of slot s in the pair list ([1 + E + S] = the end),
// [2 + 2E + i] = the pair list (pair indices grouped by slot).
struct Plan {
  const int32_t* words;
  int num_experts;
  __device__ int slots() const { return words[0]; }
  __device__ int expert(int slot) const { return words[1 + slot]; }
  __device__ int begin(int slot) const { return words[1 + num_experts + slot]; }
  __device__ int pair(int entry) const { return words[2 + 2 * num_experts + entry]; }
};

constexpr int kPlanThreads = 1024;
constexpr int kPlanExpertsPerLane = kMaxRouterExperts / 32;

struct PlanArgs {
  const int32_t* expert_ids;
  int pairs;
  int num_experts;
  int32_t* words;
};

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  __shared__ int counts[kMaxRouterExperts];
  __shared__ int cursor[kMaxRouterExperts];
  for (int e = threadIdx.x; e < kMaxRouterExperts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < a.pairs; i += blockDim.x) {
    const int e = a.expert_ids[i];
    if (e >= 0 && e < a.num_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  int32_t* slot_expert = a.words + 1;
  int32_t* slot_begin = a.words + 1 + a.num_experts;
  if (threadIdx.x < 32) {
    // Lane l numbers experts 8l .. 8l+7: a warp scan of (experts in use, pairs) gives each
    // expert its slot and its first list entry.
    const int lane = threadIdx.x;
    int used = 0, listed = 0;
#pragma unroll
    for (int j = 0; j < kPlanExpertsPerLane; ++j) {
      const int c = counts[lane * kPlanExpertsPerLane + j];
      used += c > 0;
      listed += c;
    }
    int used_before = used, listed_before = listed;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int u = __shfl_up_sync(0xFFFFFFFFu, used_before, offset);
      const int l = __shfl_up_sync(0xFFFFFFFFu, listed_before, offset);
      if (lane >= offset) {
        used_before += u;
        listed_before += l;
      }
    }
    used_before -= used;
    listed_before -= listed;
#pragma unroll
    for (int j = 0; j < kPlanExpertsPerLane; ++j) {
      const int e = lane * kPlanExpertsPerLane + j;
      const int c = counts[e];
      if (c > 0) {
        slot_expert[used_before] = e;
        slot_begin[used_before] = listed_before;
        cursor[e] = listed_before;
        ++used_before;
        listed_before += c;
      }
    }
    if (lane == 31) {
      a.words[0] = used_before;
      slot_begin[used_before] = listed_before;
    }
  }
  __syncthreads();
  int32_t* list = a.words + 2 + 2 * a.num_experts;
  for (int i = threadIdx.x; i < a.pairs; i += blockDim.x) {
    const int e = a.expert_ids[i];
    if (e >= 0 && e < a.num_experts) list[atomicAdd(&cursor[e], 1)] = i;
  }
}

struct ExpertGemvArgs {
  const MoeExpert* experts;
  int num_experts;
  const int32_t* expert_ids;
  const int32_t* plan;  // nullptr: pair p is slot p (one token)
  int top_k;
  int64_t rows;  // output rows: inner (gate/up) or hidden (down)
  int64_t chunks_per_row;
  const float* x;  // gate/up: the token rows; down: the activation rows (one per pair)
  int64_t x_stride;
  float* y;  // one row per pair
  int64_t y_stride;
};

// Tiling (gemv_kernels.h's terms). gate/up: K = hidden (2816: 88 chunks of 4-bit weights, one
// pass), one inner row = a gate row and an up row per team; down: K = inner (704: 22 chunks).
// Expert-token tiles of MT pairs reuse the weights held in registers; one token (decode) has a
// tiling with MT = 1, as a larger tile costs registers (occupancy) for nothing.
struct ExpertTiling {
  int rows_per_thread;
  int lanes_per_row;
  int warps;
  int chunks_per_thread;
  int m_tile;
};

enum class Stage { kGateUpOneToken, kGateUpGrouped, kDownGrouped };

template <Stage S>
constexpr ExpertTiling kTilingFor = S == Stage::kGateUpOneToken  ? ExpertTiling{1, 8, 4, 3, 1}
                                    : S == Stage::kGateUpGrouped ? ExpertTiling{1, 8, 4, 3, 4}
                                                                 : ExpertTiling{2, 8, 3, 1, 2};

template <Stage S>
constexpr int rows_per_block() {
  return (32 / kTilingFor<S>.lanes_per_row) * kTilingFor<S>.rows_per_thread;
}

// Grouped GEMV over the slots: block (x, s) computes output rows x · rows_per_block ... of slot
// s's expert for each of the slot's pairs. In the gate/up stages the expert's gate and up rows
// are both read and the output is gelu_tanh(gate · x) ⊙ (up · x).
template <PackedFormat F, Stage S>
__global__ void __launch_bounds__(kTilingFor<S>.warps * 32) expert_gemv_kernel(ExpertGemvArgs a) {
  constexpr bool kGateUp = S != Stage::kDownGrouped;
  constexpr ExpertTiling kTiling = kTilingFor<S>;
  constexpr int R = kTiling.rows_per_thread;
  constexpr int T = kTiling.lanes_per_row;
  constexpr int W = kTiling.warps;
  constexpr int G = kTiling.chunks_per_thread;
  constexpr int MT = kTiling.m_tile;
  constexpr int kMats = kGateUp ? 2 : 1;
  constexpr int kRowsPerBlock = rows_per_block<S>();
  constexpr int kElems = kChunkElems<F>;
  pdl_trigger_dependents();
  // Which expert this block reads is the router's result: nothing can be loaded before it.
  pdl_wait_for_predecessors();

  const int slot = blockIdx.y;
  int expert, first, count;
  if (a.plan != nullptr) {
    const Plan plan{a.plan, a.num_experts};
    if (slot >= plan.slots()) return;
    expert = plan.expert(slot);
    first = plan.begin(slot);
    count = plan.begin(slot + 1) - first;
  } else {
    expert = a.expert_ids[slot];
    first = slot;
    count = 1;
    // The combine step skips invalid ids; nothing to compute.
    if (expert < 0 || expert >= a.num_experts) return;
  }
  auto pair_of = [&](int entry) {
    return a.plan != nullptr ? Plan{a.plan, a.num_experts}.pair(first + entry) : first + entry;
  };

  MoeMatrix mats[kMats];
  if constexpr (kGateUp) {
    mats[0] = a.experts[expert].gate;
    mats[1] = a.experts[expert].up;
  } else {
    mats[0] = a.experts[expert].down;
  }

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int team = lane / T;
  const int lane_in_team = lane % T;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + team * R;
  const int64_t pass_chunks = T * W * G;
  const int passes = static_cast<int>((a.chunks_per_row + pass_chunks - 1) / pass_chunks);

  uint4 weights[G][kMats][R];
  uint32_t scale_bits[G][kMats][R];
  auto chunk_of = [&](int pass, int j) {
    return pass * pass_chunks + (j * W + warp) * T + lane_in_team;
  };
  auto load_pass = [&](int pass) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = chunk_of(pass, j);
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int64_t row = first_row + r;
          if (row < a.rows && chunk < a.chunks_per_row) {
            weights[j][mat][r] = load_weights_nc(static_cast<const uint4*>(mats[mat].weights) +
                                                 row * a.chunks_per_row + chunk);
            scale_bits[j][mat][r] = load_scale_bits<F>(mats[mat], row, chunk);
          } else {
            weights[j][mat][r] = make_uint4(0, 0, 0, 0);
            scale_bits[j][mat][r] = 0;
          }
        }
      }
    }
  };
  load_pass(0);

  // The value of output row `row` for one pair from its fully reduced sums.
  auto output = [](const float(&sums)[kMats]) {
    if constexpr (kGateUp) {
      return gelu_tanh(sums[0]) * sums[1];
    } else {
      return sums[0];
    }
  };

  extern __shared__ float partial[];  // [W][MT][kMats][kRowsPerBlock], only when W > 1
  for (int m0 = 0; m0 < count; m0 += MT) {
    int64_t pair[MT];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) pair[mi] = m0 + mi < count ? pair_of(m0 + mi) : 0;
    float acc[MT][kMats][R];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[mi][mat][r] = 0.0f;
      }
    }
    for (int pass = 0; pass < passes; ++pass) {
      if (pass > 0 || (m0 > 0 && passes > 1)) load_pass(pass);
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int64_t chunk = chunk_of(pass, j);
        if (chunk >= a.chunks_per_row) continue;
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          if (m0 + mi >= count) break;
          const int64_t x_row = kGateUp ? pair[mi] / a.top_k : pair[mi];
          XChunk<kElems> x;
          load_x_chunk<ActType::kF32>(a.x, x_row * a.x_stride + chunk * kElems, x);
#pragma unroll
          for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
              acc[mi][mat][r] +=
                  dot_chunk<F>(weights[j][mat][r], scale_bits[j][mat][r], mats[mat], x);
            }
          }
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int offset = T / 2; offset > 0; offset /= 2) {
            acc[mi][mat][r] += __shfl_xor_sync(0xFFFFFFFFu, acc[mi][mat][r], offset);
          }
        }
      }
    }
    if constexpr (W == 1) {
      if (lane_in_team == 0) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (m0 + mi < count && first_row + r < a.rows) {
              float sums[kMats];
#pragma unroll
              for (int mat = 0; mat < kMats; ++mat) sums[mat] = acc[mi][mat][r];
              a.y[pair[mi] * a.y_stride + first_row + r] = output(sums);
            }
          }
        }
      }
    } else {
      if (lane_in_team == 0) {
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
          for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
              partial[((warp * MT + mi) * kMats + mat) * kRowsPerBlock + team * R + r] =
                  acc[mi][mat][r];
            }
          }
        }
      }
      __syncthreads();
      for (int i = threadIdx.x; i < MT * kRowsPerBlock; i += W * 32) {
        const int mi = i / kRowsPerBlock;
        const int row_in_block = i % kRowsPerBlock;
        const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + row_in_block;
        float sums[kMats];
#pragma unroll
        for (int mat = 0; mat < kMats; ++mat) {
          sums[mat] = 0.0f;
#pragma unroll
          for (int w = 0; w < W; ++w) {
            sums[mat] += partial[((w * MT + mi) * kMats + mat) * kRowsPerBlock + row_in_block];
          }
        }
        if (m0 + mi < count && row < a.rows) {
          a.y[static_cast<int64_t>(pair_of(m0 + mi)) * a.y_stride + row] = output(sums);
        }
      }
      __syncthreads();
    }
  }
}

// Decode (one token): the down projections of all top_k experts and their weighted sum as one
// GEMV whose row n is the concatenation of the experts' rows n (K = top_k · inner), each
// chunk's dot product times its expert's weight. One launch instead of down + combine, no
// expert-output round trip, and a long row (176 chunks at 26B-A4B) instead of 8 short ones.
// Fixed summation order: deterministic.
struct DownCombineArgs {
  const MoeExpert* experts;
  int num_experts;
  const int32_t* expert_ids;  // [top_k]
  const float* weights;       // [top_k]
  int top_k;
  int64_t rows;              // hidden
  int64_t chunks_per_row;    // of one expert's down row
  const float* activations;  // [top_k, activation_stride]
  int64_t activation_stride;
  float* out;
};

constexpr ExpertTiling kDownCombineTiling = {2, 16, 4, 3, 1};  // one pass covers 192 chunks
constexpr int kDownCombineRowsPerBlock =
    (32 / kDownCombineTiling.lanes_per_row) * kDownCombineTiling.rows_per_thread;

template <PackedFormat F>
__global__ void __launch_bounds__(kDownCombineTiling.warps * 32)
    down_combine_kernel(DownCombineArgs a) {
  constexpr int R = kDownCombineTiling.rows_per_thread;
  constexpr int T = kDownCombineTiling.lanes_per_row;
  constexpr int W = kDownCombineTiling.warps;
  constexpr int G = kDownCombineTiling.chunks_per_thread;
  constexpr int kRowsPerBlock = kDownCombineRowsPerBlock;
  constexpr int kElems = kChunkElems<F>;
  // The picked experts' down matrices (weights == nullptr: an invalid pick, skipped).
  __shared__ MoeMatrix downs[kMaxTopK];
  __shared__ float pick_weights[kMaxTopK];
  __shared__ float partial[W][kRowsPerBlock];
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  for (int k = threadIdx.x; k < a.top_k; k += blockDim.x) {
    const int e = a.expert_ids[k];
    const bool valid = e >= 0 && e < a.num_experts;
    downs[k] = valid ? a.experts[e].down : MoeMatrix{};
    pick_weights[k] = valid ? a.weights[k] : 0.0f;
  }
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int team = lane / T;
  const int lane_in_team = lane % T;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + team * R;
  const int64_t total_chunks = a.top_k * a.chunks_per_row;
  const int64_t pass_chunks = T * W * G;
  const int passes = static_cast<int>((total_chunks + pass_chunks - 1) / pass_chunks);

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int pass = 0; pass < passes; ++pass) {
    uint4 weights[G][R];
    uint32_t scale_bits[G][R];
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = pass * pass_chunks + (j * W + warp) * T + lane_in_team;
      const int k = static_cast<int>(chunk / a.chunks_per_row);
      const int64_t in_row = chunk % a.chunks_per_row;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = first_row + r;
        if (chunk < total_chunks && row < a.rows && downs[k].weights != nullptr) {
          weights[j][r] = load_weights_nc(static_cast<const uint4*>(downs[k].weights) +
                                          row * a.chunks_per_row + in_row);
          scale_bits[j][r] = load_scale_bits<F>(downs[k], row, in_row);
        } else {
          weights[j][r] = make_uint4(0, 0, 0, 0);
          scale_bits[j][r] = 0;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int64_t chunk = pass * pass_chunks + (j * W + warp) * T + lane_in_team;
      if (chunk >= total_chunks) continue;
      const int k = static_cast<int>(chunk / a.chunks_per_row);
      const int64_t in_row = chunk % a.chunks_per_row;
      if (downs[k].weights == nullptr) continue;
      XChunk<kElems> x;
      load_x_chunk<ActType::kF32>(a.activations, k * a.activation_stride + in_row * kElems, x);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[r] += pick_weights[k] * dot_chunk<F>(weights[j][r], scale_bits[j][r], downs[k], x);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int offset = T / 2; offset > 0; offset /= 2) {
      acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], offset);
    }
    if (lane_in_team == 0) partial[warp][team * R + r] = acc[r];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRowsPerBlock; i += W * 32) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + i;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) sum += partial[w][i];
    if (row < a.rows) a.out[row] = sum;
  }
}

struct CombineArgs {
  const int32_t* expert_ids;
  const float* weights;
  int top_k;
  int num_experts;
  const float* expert_outputs;  // [pairs, hidden]
  int64_t hidden;
  float* out;
  int64_t out_stride;
};

constexpr int kCombineThreads = 256;

// out[t][j] = Σ_k weights[t][k] · expert_outputs[t · top_k + k][j], in ascending (expert id, k).
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t t = blockIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kCombineThreads + threadIdx.x;
  if (j >= a.hidden) return;
  const int32_t* ids = a.expert_ids + t * a.top_k;
  float sum = 0.0f;
  // Selection order: the next (id, k) above the previous one; invalid ids never qualify.
  int previous_id = -1, previous_k = -1;
  for (int n = 0; n < a.top_k; ++n) {
    int next_id = INT_MAX, next_k = -1;
    for (int k = 0; k < a.top_k; ++k) {
      const int id = ids[k];
      const bool after = id > previous_id || (id == previous_id && k > previous_k);
      if (id >= 0 && id < a.num_experts && after && id < next_id) {
        next_id = id;
        next_k = k;
      }
    }
    if (next_k < 0) break;
    const int64_t p = t * a.top_k + next_k;
    sum += a.expert_outputs[p * a.hidden + j] * a.weights[p];
    previous_id = next_id;
    previous_k = next_k;
  }
  a.out[t * a.out_stride + j] = sum;
}

template <PackedFormat F, Stage S>
cudaError_t launch_expert_stage(const ExpertGemvArgs& args, int slots, const Launch& launch) {
  constexpr ExpertTiling kTiling = kTilingFor<S>;
  constexpr int kRowsPerBlock = rows_per_block<S>();
  constexpr int kMats = S == Stage::kDownGrouped ? 1 : 2;
  const dim3 grid(static_cast<unsigned>((args.rows + kRowsPerBlock - 1) / kRowsPerBlock),
                  static_cast<unsigned>(slots));
  const size_t shared = kTiling.warps > 1
                            ? sizeof(float) * kTiling.warps * kTiling.m_tile * kMats * kRowsPerBlock
                            : 0;
  return launch_kernel(expert_gemv_kernel<F, S>, grid, dim3(kTiling.warps * 32), shared, launch,
                       args);
}

template <Stage S>
cudaError_t launch_stage(PackedFormat format, const ExpertGemvArgs& args, int slots,
                         const Launch& launch) {
  switch (format) {
    case PackedFormat::kW4G32:
      return launch_expert_stage<PackedFormat::kW4G32, S>(args, slots, launch);
    case PackedFormat::kNVFP4:
      return launch_expert_stage<PackedFormat::kNVFP4, S>(args, slots, launch);
    case PackedFormat::kBF16:
      return launch_expert_stage<PackedFormat::kBF16, S>(args, slots, launch);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_down_combine(PackedFormat format, const DownCombineArgs& args,
                                const Launch& launch) {
  const dim3 grid(
      static_cast<unsigned>((args.rows + kDownCombineRowsPerBlock - 1) / kDownCombineRowsPerBlock));
  const dim3 block(kDownCombineTiling.warps * 32);
  switch (format) {
    case PackedFormat::kW4G32:
      return launch_kernel(down_combine_kernel<PackedFormat::kW4G32>, grid, block, 0, launch, args);
    case PackedFormat::kNVFP4:
      return launch_kernel(down_combine_kernel<PackedFormat::kNVFP4>, grid, block, 0, launch, args);
    case PackedFormat::kBF16:
      return launch_kernel(down_combine_kernel<PackedFormat::kBF16>, grid, block, 0, launch, args);
  }
  return cudaErrorInvalidValue;
}

int64_t chunk_elements(PackedFormat format) {
  return format == PackedFormat::kBF16 ? 8 : 32;
}

size_t align16(size_t bytes) {
  return (bytes + 15) / 16 * 16;
}

}  // namespace

cudaError_t launch_router(const RouterArgs& args, const Launch& launch) {
  const dim3 grid(static_cast<unsigned>((args.tokens + kRouterWarps - 1) / kRouterWarps));
  return launch_kernel(router_kernel, grid, dim3(kRouterWarps * 32), 0, launch, args);
}

MoeWorkspaceLayout moe_workspace_layout(const MoeShape& shape, int tokens, int top_k) {
  const size_t pairs = static_cast<size_t>(tokens) * top_k;
  MoeWorkspaceLayout layout;
  layout.activations = 0;
  layout.expert_outputs = align16(sizeof(float) * pairs * shape.inner);
  layout.plan = layout.expert_outputs + align16(sizeof(float) * pairs * shape.hidden);
  const size_t plan_words = tokens > 1 ? 2 + 2 * static_cast<size_t>(shape.num_experts) + pairs : 0;
  layout.bytes = layout.plan + align16(sizeof(int32_t) * plan_words);
  return layout;
}

cudaError_t launch_moe(const MoeRunArgs& args, const Launch& launch) {
  const MoeWorkspaceLayout layout = moe_workspace_layout(args.shape, args.tokens, args.top_k);
  auto* workspace = static_cast<char*>(args.workspace);
  auto* activations = reinterpret_cast<float*>(workspace + layout.activations);
  auto* expert_outputs = reinterpret_cast<float*>(workspace + layout.expert_outputs);
  const int pairs = args.tokens * args.top_k;
  const int32_t* plan = nullptr;
  int slots = pairs;
  if (args.tokens > 1) {
    auto* words = reinterpret_cast<int32_t*>(workspace + layout.plan);
    const PlanArgs plan_args = {args.expert_ids, pairs, args.shape.num_experts, words};
    const cudaError_t status =
        launch_kernel(plan_kernel, dim3(1), dim3(kPlanThreads), 0, launch, plan_args);
    if (status != cudaSuccess) return status;
    plan = words;
    slots = pairs < args.shape.num_experts ? pairs : args.shape.num_experts;
  }

  ExpertGemvArgs gate_up = {};
  gate_up.experts = args.experts;
  gate_up.num_experts = args.shape.num_experts;
  gate_up.expert_ids = args.expert_ids;
  gate_up.plan = plan;
  gate_up.top_k = args.top_k;
  gate_up.rows = args.shape.inner;
  gate_up.chunks_per_row = args.shape.hidden / chunk_elements(args.shape.gate_up_format);
  gate_up.x = args.x;
  gate_up.x_stride = args.x_stride;
  gate_up.y = activations;
  gate_up.y_stride = args.shape.inner;
  cudaError_t status =
      plan == nullptr
          ? launch_stage<Stage::kGateUpOneToken>(args.shape.gate_up_format, gate_up, slots, launch)
          : launch_stage<Stage::kGateUpGrouped>(args.shape.gate_up_format, gate_up, slots, launch);
  if (status != cudaSuccess) return status;

  const int64_t down_chunks = args.shape.inner / chunk_elements(args.shape.down_format);
  if (args.tokens == 1) {
    const DownCombineArgs down = {args.experts,     args.shape.num_experts,
                                  args.expert_ids,  args.weights,
                                  args.top_k,       args.shape.hidden,
                                  down_chunks,      activations,
                                  args.shape.inner, args.out};
    return launch_down_combine(args.shape.down_format, down, launch);
  }
  ExpertGemvArgs down = gate_up;
  down.rows = args.shape.hidden;
  down.chunks_per_row = down_chunks;
  down.x = activations;
  down.x_stride = args.shape.inner;
  down.y = expert_outputs;
  down.y_stride = args.shape.hidden;
  status = launch_stage<Stage::kDownGrouped>(args.shape.down_format, down, slots, launch);
  if (status != cudaSuccess) return status;

  const CombineArgs combine = {
      args.expert_ids, args.weights,      args.top_k, args.shape.num_experts,
      expert_outputs,  args.shape.hidden, args.out,   args.out_stride};
  const dim3 grid(
      static_cast<unsigned>((args.shape.hidden + kCombineThreads - 1) / kCombineThreads),
      static_cast<unsigned>(args.tokens));
  return launch_kernel(combine_kernel, grid, dim3(kCombineThreads), 0, launch, combine);
}

}  // namespace gemma4::cuda
