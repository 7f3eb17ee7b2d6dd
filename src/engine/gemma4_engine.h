// The Gemma 4 text decoder (gemma4-architecture.md sections 2.2-2.7 and 3) written once over a
// Backend, as an engine::Engine: batched prefill chunks and decode steps over sequences whose
// KV caches the engine owns.
//
// KV cache, per open sequence and per layer that owns K/V (KV-shared layers store nothing and
// read their source layer's cache):
//  * full-attention layers: one slot per position of the context (max_context slots);
//  * sliding layers: a ring of window + ring_history slots; position p lives in slot p % slots
//    and each slot records the position it holds.
// The ring_history extra slots serve two purposes. A forward pass writes a chunk's K/V before
// attending, so attending a chunk of C tokens needs window - 1 + C live slots: a sliding layer
// attends a longer chunk as if in pieces of ring_history + 1 tokens (each piece written, then
// read: Backend::prepare_and_attend_pieces; the CUDA backend stages the chunk's K/V instead and
// attends it in one go).
// And truncate_sequence can roll a sequence back as long as the ring still holds the window
// before the new end (up to ring_history tokens behind the furthest point written).
//
// A KV-shared sliding layer reads its source layer's ring after the source has written the whole
// chunk, so in models with one (E2B, E4B) a chunk must fit the ring: prefill goes in passes of at
// most ring_history + 1 tokens per sequence, and every pass reads every weight. Their default
// ring_history is therefore max_pass_tokens - 1 (long passes), which costs ring memory: E2B (12
// sliding layers with their own K/V, window 512, one kv head of 256, float32) holds
// 12 * (512 + 511) * 2 KiB = 25.1 MB of rings per sequence instead of 13.4 MB with a history of
// 32, beside 12 KiB per context position for its 3 full-attention layers (50 MB at 4K, 1.6 GB at
// 128K). Models without KV sharing (26B-A4B, 31B, whose rings are large: 16-32 KiB per slot and
// layer) keep a history of 32 and still prefill in passes of max_pass_tokens per sequence.
// Writing K/V after attending would not lift the limit for shared layers: a chunk longer than
// the ring overwrites its own first positions before its last queries (or a later layer's) read
// them, so attention would have to read the chunk's keys from the projection scratch and only
// older positions from the ring (a different attention operation).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "engine/backend.h"
#include "engine/engine.h"
#include "engine/lm_head.h"
#include "model/config.h"
#include "model/weights.h"

namespace gemma4::engine {

// One MoE layer's routing in one forward pass (EngineOptions::router_trace): the router's logits
// (router_proj's output, before the softmax) and the picks route_experts made from them, one row
// per token of the pass.
struct RouterTrace {
  int layer = 0;
  int num_experts = 0;
  int top_k = 0;
  std::span<const int32_t> positions;   // [rows]
  std::span<const float> logits;        // [rows, num_experts]
  std::span<const int32_t> expert_ids;  // [rows, top_k], in pick order
  std::span<const float> weights;       // [rows, top_k]
};

struct EngineOptions {
  int32_t max_sequences = 4;
  // Clipped to the model's max_position_embeddings.
  int64_t max_context = 4096;
  // Most tokens one forward pass processes over all sequences (workspace size).
  int max_pass_tokens = 512;
  // Sliding-ring slots beyond the window (see above); 0 picks ring_history_for()'s default.
  int ring_history = 0;
  // Record decode steps (every input appends one token) on backends that can (Backend::record)
  // and replay them: one recording per ordered list of sequences and depth bucket
  // (engine/decode_recordings.h), the first made on the second step with that list (the first
  // runs unrecorded so every lazily made backend resource exists), a deeper bucket's on the
  // step that reaches it.
  bool record_decode = true;
  // The element type of every KV cache (the backend must support it: supports_kv_type). The CLI
  // picks bf16 on CUDA unless activations are exact fp32 (cli/model_loader.h).
  KvType kv_type = KvType::kF32;
  // How the logits matrix is held (engine/lm_head.h): exact by default.
  LmHeadFormat lm_head = LmHeadFormat::kExact;
  // Debugging only (`gemma4 run --router-trace`): called after every MoE layer's routing with
  // what the backend computed. Each call downloads (a device sync per layer), so decode steps are
  // not recorded while it is set.
  std::function<void(const RouterTrace&)> router_trace;
};

// The pass a GPU backend gets unless asked otherwise (cli::create_engine; a --gpu-memory budget
// still halves it to fit): every pass reads and dequantizes every weight once and launches every
// kernel once, so a 4,096-token prompt costs ~13 ms less of that in passes of 2048 than of 512
// on an H200 (session 4 profile: ~2.2 ms of bf16 weight tiles per E2B pass), and attention gets
// more rows per launch. The price: models with KV-shared sliding layers (E2B, E4B) keep a ring
// of window + pass - 1 slots (E2B: 12 layers x 2559 slots, 1 KiB per slot in bf16) and the
// workspace grows with the pass (E2B ~0.7 GB at 2048 rows).
inline constexpr int kDevicePassTokens = 2048;

// options.ring_history, or when it is 0 the default for `config` (see above): max_pass_tokens - 1
// if a KV-shared layer reads a sliding ring, else 32.
int ring_history_for(const model::ModelConfig& config, const EngineOptions& options);

class Gemma4Engine final : public Engine {
 public:
  // `weights` must stay alive as long as the engine. A backend that cannot read host memory gets
  // its own copy of them (engine/resident_weights.h).
  static Expected<std::unique_ptr<Gemma4Engine>> create(const model::ModelConfig& config,
                                                        const model::ModelWeights& weights,
                                                        std::unique_ptr<Backend> backend,
                                                        const EngineOptions& options = {});
  ~Gemma4Engine() override;

  int32_t vocab_size() const override;
  int64_t max_context() const override;
  int32_t max_sequences() const override;

  Expected<SequenceId> open_sequence() override;
  void close_sequence(SequenceId sequence) override;
  int64_t sequence_length(SequenceId sequence) const override;
  Status truncate_sequence(SequenceId sequence, int64_t length) override;
  Status step(std::span<const StepInput> inputs, std::span<float> logits) override;
  // Summaries are ranked by the backend (Backend::summarize_logits) where the logits are.
  Status step_sampled(std::span<const StepInput> inputs, std::span<const LogitRequest> requests,
                      std::span<LogitSummary> summaries, std::span<float> full_rows) override;
  // Chained on the backend: each step's greedy tokens stay in backend memory as the next step's
  // input (Backend::enqueue_greedy) and the next step is enqueued before the host reads them, on
  // the guess that every sequence continues (not past a GreedyNext::kLast step). A sequence that
  // stops instead rolls that step's token back (its KV write past the end is forgotten, as
  // truncate_sequence does); the others finish that step, then go on in a new chain whose first
  // step's tokens are uploaded. That step still held the stopped row, so the others' rows come
  // from a batch one row larger than host-fed steps would have run: kernels whose rounding
  // depends on the batch size (the CUDA MoE ones) can make their logits differ in the last bits.
  // Batches larger than a pass: greedy_decode_by_steps.
  Status decode_greedy(std::span<const SequenceId> sequences, std::span<const int32_t> first_tokens,
                       const GreedyTokenCallback& on_token) override;

 private:
  struct Impl;
  explicit Gemma4Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gemma4::engine
