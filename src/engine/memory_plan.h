// Memory planned at load (DESIGN.md engine rule 5): what an engine will hold on its backend —
// weights as resident, every sequence's KV cache, the per-pass workspace, the backend's own
// scratch — and, against a budget (--gpu-memory), the largest sequences/context that fit, or a
// clear error naming the numbers before anything is allocated.
//
// KV and workspace mirror Gemma4Engine::create's allocations exactly (tests/engine check the
// plan against the bytes a backend is asked for). Backend scratch is the CUDA backend's
// (attention split partials, MoE workspace, RoPE tables) at its largest. The runtime reserve
// stands for what the driver takes beside our allocations: the CUDA context with its per-SM
// local memory, lazily loaded kernel images, allocation rounding, a cuBLAS workspace if one is
// ever used; it is a stated constant (kCudaRuntimeReserveBytes), sized for a small GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "engine/backend.h"
#include "engine/gemma4_engine.h"
#include "model/config.h"
#include "model/weights.h"
#include "quant/quantize.h"

namespace gemma4::engine {

// CUDA context (per-SM local memory, printf FIFO, device heap), kernel images loaded on first
// use, cudaMalloc rounding and a cuBLAS workspace: 256 MiB, what a 4 GB laptop GPU's context
// and our kernels take with room to spare. A large GPU's context is bigger (an H200 has 132
// SMs of local memory); `gemma4` logs the device memory in use before loading next to the plan.
inline constexpr int64_t kCudaRuntimeReserveBytes = int64_t{256} << 20;

// Contexts chosen to fit a budget are multiples of this (or the requested context when smaller).
inline constexpr int64_t kContextGranularity = 256;
// Fitting a budget halves max_pass_tokens down to no less than this.
inline constexpr int kMinPassTokens = 64;

struct MemoryPlan {
  EngineOptions options;  // what the plan is for; max_context clipped to the model's
  int64_t weight_bytes = 0;
  int64_t kv_bytes = 0;                 // every sequence's K, V and slot positions
  int64_t kv_full_bytes_per_token = 0;  // per sequence, the part that grows with the context
  int64_t workspace_bytes = 0;          // the engine's activation rows, ids, logits
  int64_t scratch_bytes = 0;            // the backend's own (CUDA) scratch at its largest
  int64_t reserve_bytes = 0;            // kCudaRuntimeReserveBytes on a device, 0 on the CPU
  int64_t total() const {
    return weight_bytes + kv_bytes + workspace_bytes + scratch_bytes + reserve_bytes;
  }
  // "weights 3056 MiB + KV 329 MiB (1 x 26880 tokens, passes of 64, f32) + workspace 15 MiB +
  //  scratch 73 MiB + runtime reserve 256 MiB = 3729 MiB" ("read in place": nothing copied)
  std::string summary() const;
};

// The plan of an engine with `options` over weights of `weight_bytes` as resident; `on_device`
// adds the CUDA backend's scratch and kCudaRuntimeReserveBytes.
MemoryPlan plan_memory(const model::ModelConfig& config, int64_t weight_bytes,
                       const EngineOptions& options, bool on_device);

// plan_memory within `budget_bytes`: the requested options if they fit; else the requested
// context with as many sequences as fit; else one sequence of the requested context in prefill
// passes halved down to kMinPassTokens (a smaller workspace); else one sequence in those passes
// with the longest context that fits (a multiple of kContextGranularity). Fails with
// kResourceExhausted naming the budget and the parts when not even one sequence of
// min(requested context, kContextGranularity) tokens fits.
Expected<MemoryPlan> fit_memory_plan(const model::ModelConfig& config, int64_t weight_bytes,
                                     const EngineOptions& requested, bool on_device,
                                     int64_t budget_bytes);

// The 4-bit copy a device backend keeps of a bf16 table on the int4 grid (the embedding / tied
// lm_head or per-layer embedding table of a QAT checkpoint: quant/pack_w4g32.h), or nullopt: not
// bf16, not on the grid, or `backend` reads host memory (the CPU reads the mapping in place,
// copying nothing).
std::optional<quant::PackedMatrix> pack_table_for_device(const quant::QMatrix& table,
                                                         const Backend& backend);
// Whether pack_table_for_device would pack `table` (the same scan, nothing written).
bool table_packs_on_device(const quant::QMatrix& table, const Backend& backend);

// The logits matrix as `backend` reads it under `lm_head` (ResidentWeights::create), without
// data: quantize_w8g32's layout when lm_head_quantizes, the 4-bit copy's when
// table_packs_on_device, else the checkpoint's matrix itself. Its bytes() is what a decode step
// reads of it.
quant::QMatrix resident_lm_head_layout(const model::ModelWeights& weights, const Backend& backend,
                                       LmHeadFormat lm_head);

// What `weights` take where `backend` reads them (ResidentWeights).
struct ResidentWeightBytes {
  // 0 when the backend reads host memory; else every matrix once (a tied lm_head is the
  // embedding), the tables in `packed_tables` in 4 bits, the 8-bit logits matrix when
  // `lm_head_q8` (beside a tied embedding, which embedding lookups still read), and the float32
  // norm vectors.
  int64_t bytes = 0;
  // The tables (embed_tokens, lm_head, embed_tokens_per_layer) that table_packs_on_device.
  std::vector<std::string> packed_tables;
  bool lm_head_q8 = false;  // lm_head_quantizes (on any backend)
};
// Scans the tables for the int4 grid, as ResidentWeights::create does.
ResidentWeightBytes resident_weight_bytes(const model::ModelWeights& weights,
                                          const Backend& backend,
                                          LmHeadFormat lm_head = LmHeadFormat::kExact);

// "3732MiB", "24GiB", "4GB", "512M", "1.5G", "1000000" (bytes): binary units (KiB/MiB/GiB/TiB,
// and K/M/G/T), decimal kB/MB/GB/TB. A clear error for anything else.
Expected<int64_t> parse_memory_size(std::string_view text);

}  // namespace gemma4::engine
