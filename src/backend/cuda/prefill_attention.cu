// Prefill attention (prefill_kernels.h): flash attention on bf16 tensor cores.
//
// The rows of one kv head's work are the pairs (query t, q head g of the group), flattened as
// t · group + g; block (b, kv head) takes kRows of them, so each K/V tile it loads serves every
// q head of the group and several queries. Per tile of kKeys slots:
//   1. the slots' positions; a tile no row can see (all empty, in every row's future or before
//      every row's window) is skipped;
//   2. K and V (the cache's element type, attention_kv.cuh) converted to bf16 in shared memory;
//      empty slots as zeros (a stale or never-written slot must not reach the sums even with
//      weight 0: 0 · NaN = NaN);
//   3. S = Q · Kᵀ with WMMA (bf16 16x16x16, fp32 accumulate) into shared memory;
//   4. the online softmax per row in fp32: scale, mask, running max; the weights rounded to
//      bf16 for the tensor cores, and the running sum adds those rounded weights, so the
//      normalisation matches what was multiplied;
//   5. O = O · rescale + P · V with WMMA; O lives in shared memory (fp32), where each warp
//      rescales its own 16x16 tiles before loading them as accumulators (a WMMA accumulator's
//      element order is unspecified, so it cannot be rescaled per row in registers).
// Finally out = O / sum (zeros where nothing was visible, as the CPU reference).
#include <cuda_bf16.h>
#include <mma.h>

#include <climits>

#include "backend/cuda/attention_kv.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/prefill_kernels.h"

namespace gemma4::cuda {
namespace {

using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMma = 16;  // WMMA tile edge

// Rows per block and keys per tile: shared memory holds Q, K, V (bf16), S (fp32), P (bf16) and
// O (fp32); these sizes keep it under the 227 KB a Hopper block may use.
template <int HD>
struct Tiling;
template <>
struct Tiling<256> {
  static constexpr int kRows = 64, kKeys = 64;
};
template <>
struct Tiling<512> {
  static constexpr int kRows = 32, kKeys = 32;
};

// Shared memory layout of the kernel for head_dim HD (leading dimensions padded by 16 bytes
// against bank conflicts; every array starts 32-byte aligned, as WMMA loads want).
template <int HD>
struct Layout {
  static constexpr int kRows = Tiling<HD>::kRows, kKeys = Tiling<HD>::kKeys;
  static constexpr int kLdQ = HD + 8;     // Q, K, V rows (bf16)
  static constexpr int kLdS = kKeys + 4;  // S (fp32)
  static constexpr int kLdP = kKeys + 8;  // P (bf16)
  static constexpr int kLdO = HD + 4;     // O (fp32)
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(bf16) * kRows * kLdQ;
  static constexpr size_t kV = kK + sizeof(bf16) * kKeys * kLdQ;
  static constexpr size_t kS = kV + sizeof(bf16) * kKeys * kLdQ;
  static constexpr size_t kP = kS + sizeof(float) * kRows * kLdS;
  static constexpr size_t kO = kP + sizeof(bf16) * kRows * kLdP;
  static constexpr size_t kRowMax = kO + sizeof(float) * kRows * kLdO;
  static constexpr size_t kRowSum = kRowMax + sizeof(float) * kRows;
  static constexpr size_t kRowRescale = kRowSum + sizeof(float) * kRows;
  static constexpr size_t kRowPosition = kRowRescale + sizeof(float) * kRows;
  static constexpr size_t kKeyPosition = kRowPosition + sizeof(int32_t) * kRows;
  static constexpr size_t kBytes = kKeyPosition + sizeof(int32_t) * kKeys;
  static_assert(kK % 32 == 0 && kV % 32 == 0 && kS % 32 == 0 && kP % 32 == 0 && kO % 32 == 0);
  static_assert(kRows % kMma == 0 && kKeys % kMma == 0 && kThreads % kRows == 0);
  static_assert(kBytes <= 227 * 1024);
};

struct PrefillArgs {
  const float* q;
  int64_t q_stride;
  const int32_t* positions;
  int64_t queries;
  int group;  // q heads per kv head
  KvSlots kv;
  int window;
  float scale;
  float* out;
  int64_t out_stride;
};

__device__ __forceinline__ bool visible(int32_t key_position, int32_t query_position, int window) {
  return key_position >= 0 && key_position <= query_position &&
         (window == 0 || query_position - key_position < window);
}

template <int HD, typename KvT>
__global__ void __launch_bounds__(kThreads) prefill_attention_kernel(PrefillArgs a) {
  using L = Layout<HD>;
  constexpr int kRows = L::kRows, kKeys = L::kKeys;
  constexpr int kVectorsPerThread = kKeys * (HD / 4) / kThreads;  // float4s of a K (V) tile
  constexpr int kLoadBatch = 8;
  static_assert(kKeys * (HD / 4) % kThreads == 0 && kVectorsPerThread % kLoadBatch == 0);
  pdl_trigger_dependents();
  extern __shared__ __align__(128) unsigned char shared[];
  bf16* q_tile = reinterpret_cast<bf16*>(shared + L::kQ);
  bf16* k_tile = reinterpret_cast<bf16*>(shared + L::kK);
  bf16* v_tile = reinterpret_cast<bf16*>(shared + L::kV);
  float* scores = reinterpret_cast<float*>(shared + L::kS);
  bf16* weights = reinterpret_cast<bf16*>(shared + L::kP);
  float* o_acc = reinterpret_cast<float*>(shared + L::kO);
  float* row_max = reinterpret_cast<float*>(shared + L::kRowMax);
  float* row_sum = reinterpret_cast<float*>(shared + L::kRowSum);
  float* row_rescale = reinterpret_cast<float*>(shared + L::kRowRescale);
  int32_t* row_position = reinterpret_cast<int32_t*>(shared + L::kRowPosition);
  int32_t* key_position = reinterpret_cast<int32_t*>(shared + L::kKeyPosition);
  pdl_wait_for_predecessors();

  const int kv_head = blockIdx.y;
  const int64_t first_row = int64_t{blockIdx.x} * kRows;
  const int64_t total_rows = a.queries * a.group;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // Q rows (zeros past the last query), their positions (-1: sees nothing), empty stats and O.
  for (int r = warp; r < kRows; r += kWarps) {
    const int64_t row = first_row + r;
    const bool live = row < total_rows;
    const int64_t t = live ? row / a.group : 0;
    const int64_t head = int64_t{kv_head} * a.group + (live ? row % a.group : 0);
    const float* q = a.q + t * a.q_stride + head * HD;
    for (int d = lane; d < HD; d += 32) {
      q_tile[r * L::kLdQ + d] = __float2bfloat16(live ? q[d] : 0.0f);
    }
    if (lane == 0) {
      row_position[r] = live ? a.positions[t] : -1;
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
    }
  }
  for (int i = threadIdx.x; i < kRows * L::kLdO; i += kThreads) o_acc[i] = 0.0f;
  __syncthreads();

  // The rows' position range: a slot is worth loading only if some row may see it.
  int32_t max_position = -1, min_position = INT_MAX;
  for (int r = 0; r < kRows; ++r) {
    const int32_t p = row_position[r];
    if (p >= 0) {
      max_position = max(max_position, p);
      min_position = min(min_position, p);
    }
  }
  // Position p lives in slot p % slots: slots past the largest query position hold none of
  // the visible ones when the cache has more slots than that.
  const int64_t scanned = min(a.kv.slots, int64_t{max_position} + 1);
  const int64_t kv_width = int64_t{a.kv.kv_heads} * HD;
  const KvT* keys = static_cast<const KvT*>(a.kv.keys) + int64_t{kv_head} * HD;
  const KvT* values = static_cast<const KvT*>(a.kv.values) + int64_t{kv_head} * HD;

  for (int64_t first_slot = 0; first_slot < scanned; first_slot += kKeys) {
    // 1. Positions; skip the tile if no row can see any of it (a superset test: each row's
    // own mask is applied in step 4).
    bool wanted = false;
    if (threadIdx.x < kKeys) {
      const int64_t slot = first_slot + threadIdx.x;
      const int32_t p = slot < scanned ? a.kv.slot_positions[slot] : -1;
      key_position[threadIdx.x] = p;
      wanted = p >= 0 && p <= max_position && (a.window == 0 || min_position - p < a.window);
    }
    if (!__syncthreads_or(wanted)) continue;

    // 2. K and V → bf16 (4 elements per load: a head's row is HD contiguous ones). Each thread
    // issues kLoadBatch loads of K and of V before converting any, so a tile costs a few memory
    // round trips, not one per vector.
    for (int first = 0; first < kVectorsPerThread; first += kLoadBatch) {
      float4 k[kLoadBatch], v[kLoadBatch];
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        const int i = threadIdx.x + (first + j) * kThreads;
        const int key = i / (HD / 4);
        k[j] = v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (key_position[key] >= 0) {
          const int64_t offset = (first_slot + key) * kv_width + (i % (HD / 4)) * 4;
          k[j] = load_kv4(keys + offset);
          v[j] = load_kv4(values + offset);
        }
      }
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        const int i = threadIdx.x + (first + j) * kThreads;
        const int at = i / (HD / 4) * L::kLdQ + (i % (HD / 4)) * 4;
        __nv_bfloat162* k_out = reinterpret_cast<__nv_bfloat162*>(k_tile + at);
        __nv_bfloat162* v_out = reinterpret_cast<__nv_bfloat162*>(v_tile + at);
        k_out[0] = __floats2bfloat162_rn(k[j].x, k[j].y);
        k_out[1] = __floats2bfloat162_rn(k[j].z, k[j].w);
        v_out[0] = __floats2bfloat162_rn(v[j].x, v[j].y);
        v_out[1] = __floats2bfloat162_rn(v[j].z, v[j].w);
      }
    }
    __syncthreads();

    // 3. S = Q · Kᵀ: K's rows [key][d] are Kᵀ in column-major order.
    for (int tile = warp; tile < (kRows / kMma) * (kKeys / kMma); tile += kWarps) {
      const int r0 = tile / (kKeys / kMma) * kMma;
      const int c0 = tile % (kKeys / kMma) * kMma;
      wmma::fragment<wmma::accumulator, kMma, kMma, kMma, float> s;
      wmma::fill_fragment(s, 0.0f);
      for (int d0 = 0; d0 < HD; d0 += kMma) {
        wmma::fragment<wmma::matrix_a, kMma, kMma, kMma, bf16, wmma::row_major> q;
        wmma::fragment<wmma::matrix_b, kMma, kMma, kMma, bf16, wmma::col_major> k;
        wmma::load_matrix_sync(q, q_tile + r0 * L::kLdQ + d0, L::kLdQ);
        wmma::load_matrix_sync(k, k_tile + c0 * L::kLdQ + d0, L::kLdQ);
        wmma::mma_sync(s, q, k, s);
      }
      wmma::store_matrix_sync(scores + r0 * L::kLdS + c0, s, L::kLdS, wmma::mem_row_major);
    }
    __syncthreads();

    // 4. Online softmax: kLanesPerRow consecutive lanes share a row, each taking every
    // kLanesPerRow-th key of the tile.
    {
      constexpr int kLanesPerRow = kThreads / kRows;
      constexpr int kKeysPerLane = kKeys / kLanesPerRow;
      const int r = threadIdx.x / kLanesPerRow;
      const int part = threadIdx.x % kLanesPerRow;
      const int32_t query_position = row_position[r];
      float s[kKeysPerLane];
      float tile_max = -INFINITY;
#pragma unroll
      for (int i = 0; i < kKeysPerLane; ++i) {
        const int c = part + i * kLanesPerRow;
        s[i] = visible(key_position[c], query_position, a.window)
                   ? scores[r * L::kLdS + c] * a.scale
                   : -INFINITY;
        tile_max = fmaxf(tile_max, s[i]);
      }
#pragma unroll
      for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, offset));
      }
      const float old_max = row_max[r];
      const float new_max = fmaxf(old_max, tile_max);
      // Nothing visible yet: the max stays −∞, every weight 0, O untouched.
      const float rescale = new_max == -INFINITY ? 1.0f : expf(old_max - new_max);
      float tile_sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kKeysPerLane; ++i) {
        const int c = part + i * kLanesPerRow;
        const bf16 w = __float2bfloat16(s[i] == -INFINITY ? 0.0f : expf(s[i] - new_max));
        weights[r * L::kLdP + c] = w;
        tile_sum += __bfloat162float(w);
      }
#pragma unroll
      for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) {
        tile_sum += __shfl_xor_sync(0xFFFFFFFFu, tile_sum, offset);
      }
      __syncwarp();  // every lane of the row has read row_max
      if (part == 0) {
        row_max[r] = new_max;
        row_sum[r] = row_sum[r] * rescale + tile_sum;
        row_rescale[r] = rescale;
      }
    }
    __syncthreads();

    // 5. O = O · rescale + P · V, one 16x16 tile of O at a time per warp.
    for (int tile = warp; tile < (kRows / kMma) * (HD / kMma); tile += kWarps) {
      const int r0 = tile / (HD / kMma) * kMma;
      const int c0 = tile % (HD / kMma) * kMma;
      float* o = o_acc + r0 * L::kLdO + c0;
      for (int i = lane; i < kMma * kMma; i += 32) {
        const float rescale = row_rescale[r0 + i / kMma];
        if (rescale != 1.0f) o[(i / kMma) * L::kLdO + i % kMma] *= rescale;
      }
      __syncwarp();
      wmma::fragment<wmma::accumulator, kMma, kMma, kMma, float> acc;
      wmma::load_matrix_sync(acc, o, L::kLdO, wmma::mem_row_major);
      for (int k0 = 0; k0 < kKeys; k0 += kMma) {
        wmma::fragment<wmma::matrix_a, kMma, kMma, kMma, bf16, wmma::row_major> p;
        wmma::fragment<wmma::matrix_b, kMma, kMma, kMma, bf16, wmma::row_major> v;
        wmma::load_matrix_sync(p, weights + r0 * L::kLdP + k0, L::kLdP);
        wmma::load_matrix_sync(v, v_tile + k0 * L::kLdQ + c0, L::kLdQ);
        wmma::mma_sync(acc, p, v, acc);
      }
      wmma::store_matrix_sync(o, acc, L::kLdO, wmma::mem_row_major);
    }
    __syncthreads();  // K, V and P are overwritten by the next tile
  }

  for (int r = warp; r < kRows; r += kWarps) {
    const int64_t row = first_row + r;
    if (row >= total_rows) break;
    const int64_t t = row / a.group;
    const int64_t head = int64_t{kv_head} * a.group + row % a.group;
    const float sum = row_sum[r];
    float* out = a.out + t * a.out_stride + head * HD;
    for (int d = lane; d < HD; d += 32) {
      out[d] = sum > 0.0f ? o_acc[r * L::kLdO + d] / sum : 0.0f;
    }
  }
}

template <int HD, typename KvT>
cudaError_t launch_prefill_attention(const PrefillArgs& args, int kv_heads, const Launch& launch) {
  using L = Layout<HD>;
  const int64_t blocks = (args.queries * args.group + L::kRows - 1) / L::kRows;
  if (blocks > INT_MAX || kv_heads > 65535) return cudaErrorInvalidValue;
  // Above 48 KB a kernel must opt in (a function attribute, not a stream operation: allowed
  // while a graph is captured).
  const cudaError_t status = cudaFuncSetAttribute(
      prefill_attention_kernel<HD, KvT>, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (status != cudaSuccess) return status;
  return launch_kernel(prefill_attention_kernel<HD, KvT>,
                       dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(kv_heads)),
                       dim3(kThreads), L::kBytes, launch, args);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

cudaError_t prefill_attention(const RowsView& q, const int32_t* positions, const KvSlots& kv,
                              int window, float scale, const RowsView& out, const Launch& launch) {
  const int head_dim = kv.head_dim;
  if (q.data == nullptr || out.data == nullptr || q.rows < 1 || out.rows != q.rows ||
      out.width != q.width || q.stride < q.width || out.stride < out.width ||
      positions == nullptr || kv.keys == nullptr || kv.values == nullptr ||
      kv.slot_positions == nullptr || kv.slots < 1 || kv.kv_heads < 1 ||
      (head_dim != 256 && head_dim != 512) || q.width % head_dim != 0 ||
      (q.width / head_dim) % kv.kv_heads != 0 || q.width / head_dim > INT_MAX ||
      !aligned16(kv.keys) || !aligned16(kv.values)) {
    return cudaErrorInvalidValue;
  }
  PrefillArgs args = {};
  args.q = q.data;
  args.q_stride = q.stride;
  args.positions = positions;
  args.queries = q.rows;
  args.group = static_cast<int>(q.width / head_dim / kv.kv_heads);
  args.kv = kv;
  args.window = window;
  args.scale = scale;
  args.out = out.data;
  args.out_stride = out.stride;
  return with_kv_type(kv.type, [&](auto element) {
    using KvT = decltype(element);
    return head_dim == 256 ? launch_prefill_attention<256, KvT>(args, kv.kv_heads, launch)
                           : launch_prefill_attention<512, KvT>(args, kv.kv_heads, launch);
  });
}

}  // namespace gemma4::cuda
