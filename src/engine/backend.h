// The operations the Gemma 4 forward pass (engine/gemma4_engine.cpp) is written in. Each backend
// (backend/cpu: the float32 reference; backend/cuda later) implements them over its own memory,
// so the model math is expressed once and every backend is checked against the same sequence
// of operations.
//
// All activations are float32 row matrices ("one row per token") that live in the backend's
// memory: host RAM for the CPU backend, device memory for CUDA. Integer side inputs (token ids,
// positions, expert ids) also live in backend memory; the engine copies them in with upload().
// Weight matrices are quant::QMatrix views and norm weights plain float vectors, both resident
// where the backend can read them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/weights.h"
#include "quant/qmatrix.h"

namespace gemma4::engine {

// A block of backend memory, freed on destruction.
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* data, size_t bytes, std::function<void(void*)> release)
      : data_(data), bytes_(bytes), release_(std::move(release)) {}
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      release_ = std::move(other.release_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  float* floats() const { return static_cast<float*>(data_); }
  int32_t* ints() const { return static_cast<int32_t*>(data_); }

 private:
  void reset() {
    if (data_ && release_) release_(data_);
    data_ = nullptr;
  }
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> release_;
};

// `count` rows of `width` floats, row r starting at data + r * stride (stride >= width). Views
// never own memory. A [T, heads * head_dim] matrix is viewed per head as T * heads rows of
// head_dim with heads(): that is how per-head norms are expressed.
struct Rows {
  float* data = nullptr;
  int64_t count = 0;
  int64_t width = 0;
  int64_t stride = 0;

  static Rows dense(float* data, int64_t count, int64_t width) {
    return {data, count, width, width};
  }
  float* row(int64_t r) const { return data + r * stride; }
  // Rows [first, first + n).
  Rows slice(int64_t first, int64_t n) const { return {row(first), n, width, stride}; }
  // Columns [first, first + n) of every row.
  Rows columns(int64_t first, int64_t n) const { return {data + first, count, n, stride}; }
  // A dense matrix re-viewed as rows of `head_width` (width must be a multiple of it).
  Rows heads(int64_t head_width) const {
    return {data, count * (width / head_width), head_width, head_width};
  }
};

// The element type of a KV cache's K and V. kF32 is exact (the CPU reference keeps nothing
// else); kBF16 rounds to nearest even, what a bf16 transformers model caches; kFP8 is e4m3
// (round to nearest even, saturating at ±448) without scales: every Gemma 4 layer that owns K/V
// RMS-normalises k (k_norm) and v (weightless v_norm) per head right before storing them, so V
// has RMS 1 (|v| <= sqrt(head_dim) <= 23) and K is that times the k_norm weight; both sit well
// inside e4m3's normal range (2^-6 .. 448), where the relative rounding error is at most 2^-4,
// and elements below 2^-6 keep an absolute error of at most 2^-10.
enum class KvType : uint8_t { kF32, kBF16, kFP8 };

// Bytes per K or V element: 4, 2, 1.
int64_t kv_element_bytes(KvType type);
// "f32", "bf16", "fp8" (the --kv-cache values).
const char* kv_type_name(KvType type);
// The inverse of kv_type_name; a clear error for anything else.
Expected<KvType> parse_kv_type(std::string_view name);

// One sequence's K/V store for one layer: `slots` entries of [kv_heads, head_dim] elements of
// `type` for K and for V, plus the absolute position each slot holds (-1 = empty). Position p
// lives in slot p % slots: full-attention layers have one slot per position of the context,
// sliding layers a ring of window + history slots. Attention reads the recorded positions, so
// masking never depends on how the slots were filled.
struct KvView {
  void* keys = nullptr;
  void* values = nullptr;
  int32_t* slot_positions = nullptr;
  int64_t slots = 0;
  int kv_heads = 0;
  int head_dim = 0;
  KvType type = KvType::kF32;
  // A k_eq_v layer's cache with v_norm (arch spec 2.4): K and V made from one raw row (V its
  // weightless norm, K normed with k_norm and rotated), so K's unrotated dims are k_norm's scales
  // times V up to the rounding, and a reader may take them from V.
  bool k_eq_v = false;
};

// inv_freq[i] of the head_dim / 2 pairs of rope() below, in float32 as transformers computes it
// (1 / theta^(2i / exponent_denominator), 0 past rotated_pairs). Every backend rotates by these
// exact values, so their angles agree bit for bit even at large positions.
std::vector<float> rope_inverse_frequencies(const model::RopeParams& rope, int head_dim);

struct RouterParams {
  int top_k = 0;
  const float* per_expert_scale = nullptr;  // [num_experts], multiplies the renormalised weight
};

// One sequence's rows of a pass and that sequence's K/V of the layer. position_bound: every
// query of the rows sits at a position below it, in this pass and in every replay of a recording
// of it (the engine's decode depth bucket, engine/decode_recordings.h), so a backend may size the
// attention's work for min(kv.slots, window, position_bound) keys instead of the whole cache.
// Scratch a backend sizes for the pass must not depend on it: the engine records a deeper bucket
// of a sequence list without running it unrecorded first.
struct SequenceRows {
  KvView kv;
  int64_t first_row = 0;
  int64_t count = 0;
  int64_t position_bound = std::numeric_limits<int64_t>::max();
};

// How every RMSNorm of the model scales: y = x · rsqrt(mean(x²) + eps) · (weight_offset + w).
struct NormParams {
  float weight_offset = 0.0f;
  float eps = 1e-6f;
};

// The router's and the experts' inputs of a MoE layer (Backend::add_rms_norm_moe).
struct MoeInputs {
  const float* router_scale = nullptr;   // [width]
  float router_factor = 1.0f;            // hidden_size^-1/2
  const float* expert_weight = nullptr;  // [width]: pre_feedforward_layernorm_2
  Rows router_in;
  Rows expert_in;
};

// A sequence of operations a backend recorded once (record()) to enqueue again cheaply
// (replay()): on CUDA, an instantiated graph. Each backend defines what it holds.
class RecordedWork {
 public:
  virtual ~RecordedWork() = default;
};

// Device time around replayed recordings (Backend::time_replays), summed over the replays that
// followed a synchronising read (download, summarize_logits): idle is the device's time from that
// read's end to the replay's start (host work, uploads, the launch call: the host's gap between
// steps), replay from its start to its end, tail from its end to the next synchronising read's
// end (work enqueued after it: the logits summary and its copy).
struct ReplayTimes {
  int64_t replays = 0;
  double idle_us = 0;
  double replay_us = 0;
  double tail_us = 0;
};

// One row of Backend::summarize_logits: row `row` of the logits, summarised as `request` asks
// (request.candidates > 0).
struct LogitRowRequest {
  int64_t row = 0;
  LogitRequest request;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;

  // Whether kernels can read host memory (the checkpoint mapping, std::vector norm weights)
  // directly. If not, the engine copies every weight into backend buffers when it is created
  // (engine/resident_weights.h).
  virtual bool reads_host_memory() const = 0;

  // The first failure since the backend was created (a failed allocation, a kernel fault, an
  // operation the backend cannot run), or ok. Operations return nothing and are asynchronous on
  // a device, so the engine checks this after each pass; once failed, it stays failed.
  virtual Status status() const { return Status::ok_status(); }

  // Whether write_kv / prepare_attention / attention take caches of `type` (Gemma4Engine::create
  // refuses an EngineOptions::kv_type the backend does not). The CPU reference: kF32 only.
  virtual bool supports_kv_type(KvType type) const { return type == KvType::kF32; }

  // Kernels launched so far (a replayed graph counts each of its kernels), for `gemma4 bench`'s
  // kernels per token; nullopt when the backend does not count them.
  virtual std::optional<int64_t> kernels_launched() const { return std::nullopt; }

  // A profiler range around work worth profiling alone (`gemma4 bench --profile-last`): profilers
  // told to wait for it (ncu --profile-from-start off, nsys --capture-range=cudaProfilerApi)
  // record only what is enqueued between begin and end. Both wait for the work enqueued before
  // them, so the range holds exactly the work in between. Const like kernels_launched: a
  // diagnostic that leaves the computation alone. No-op on backends no such profiler sees.
  virtual void begin_profiler_range() const {}
  virtual void end_profiler_range() const {}

  // Diagnostic (`gemma4 bench --step-times`): time_replays(true) starts (from zero) timing
  // replays with device events, time_replays(false) stops; replay_times() is what was timed, or
  // nullopt where the backend cannot time them. Const like kernels_launched: the computation
  // stays the same (each timed step records a few events).
  virtual void time_replays(bool on) const { (void)on; }
  virtual std::optional<ReplayTimes> replay_times() const { return std::nullopt; }

  // Recording, for decode steps whose launches would otherwise cost more than their kernels.
  // record() captures the operations `enqueue` issues WITHOUT running them; replay() runs them,
  // with the same arguments (pointers and host scalars are fixed at record time: per-step values
  // must come from backend memory, uploaded before replay()). Inside `enqueue` nothing may
  // upload, download, allocate or grow scratch: run the same work once unrecorded first. A
  // backend that cannot record says so with can_record(); record() then returns nullptr, as it
  // does when recording fails (status() says why). A recording may be destroyed while its last
  // replay still runs (the backend releases it once that ends).
  virtual bool can_record() const { return false; }
  virtual std::unique_ptr<RecordedWork> record(const std::function<void()>& enqueue) {
    (void)enqueue;
    return nullptr;
  }
  virtual void replay(RecordedWork& work) { (void)work; }

  // Enqueues the operations of `first` and those of `second` for a pass of `rows` rows. The
  // caller guarantees the two are independent (neither reads or writes what the other writes), so
  // a device backend may run them at the same time, or enqueue them in either order; work
  // enqueued afterwards sees both done. Both may read what was enqueued before. Default: first(),
  // then second().
  virtual void concurrently(int64_t rows, const std::function<void()>& first,
                            const std::function<void()>& second);

  // Memory. allocate() zero-fills. upload/download copy between host memory and a buffer.
  virtual Buffer allocate(size_t bytes) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;

  // out[t] = row ids[t] of `table` (dequantised) times `scale`.
  virtual void embed(const quant::QMatrix& table, const int32_t* ids, float scale, Rows out) = 0;
  // y = x · Wᵀ: y[t][n] = Σ_k x[t][k] w[n][k]. x.width == w.cols, y.width == w.rows.
  virtual void matmul(const quant::QMatrix& w, Rows x, Rows y) = 0;
  // y[t] = x[t] · (Σ x[t]² / width + eps)^-1/2 · (weight_offset + weight), per row; without
  // weight the last factor is omitted. y may alias x.
  virtual void rms_norm(Rows x, const float* weight, float weight_offset, float eps, Rows y) = 0;
  // In place, half-split ("rotate_half") rotation of each head of x[t] (x.width = heads·head_dim)
  // by angles positions[t] · inv_freq[i], inv_freq[i] = theta^(-2i / exponent_denominator) for the
  // first rotated_pairs pairs, 0 for the rest.
  virtual void rope(Rows x, int head_dim, const int32_t* positions,
                    const model::RopeParams& rope) = 0;
  // out = gelu_tanh(gate) ⊙ multiplier. out may alias either input.
  virtual void gelu_tanh_mul(Rows gate, Rows multiplier, Rows out) = 0;
  // acc += x.
  virtual void add(Rows acc, Rows x) = 0;
  // x[t][j] = (x[t][j] · column_scale[j]) · scalar; without column_scale just x · scalar.
  virtual void scale(Rows x, const float* column_scale, float scalar) = 0;
  // x = cap · tanh(x / cap).
  virtual void softcap(Rows x, float cap) = 0;
  // dst = src (same shape).
  virtual void copy(Rows src, Rows dst) = 0;

  // Stores k[t], v[t] (each [kv_heads·head_dim]) at position positions[t] of `kv`.
  virtual void write_kv(const KvView& kv, Rows k, Rows v, const int32_t* positions) = 0;
  // Marks every slot holding a position >= `from_position` empty (sequence roll-back).
  virtual void forget_kv(const KvView& kv, int64_t from_position) = 0;
  // out[t] (q_heads·head_dim) = softmax(q · Kᵀ · scale + mask) · V per q head, against the
  // slots of `kv`. q head h reads kv head h / (q_heads / kv_heads). A slot at position p is
  // visible to the query at position positions[t] = P iff p <= P and (window == 0 or P - p <
  // window).
  virtual void attention(Rows q, const int32_t* positions, const KvView& kv, int window,
                         float scale, Rows out) = 0;

  // Router: softmax over each row of `logits` (one per token, width = num_experts), the top_k
  // largest (ties: lower expert id first), renormalised to sum 1, times per_expert_scale.
  // Writes expert_ids / weights as [tokens, top_k].
  virtual void route_experts(Rows logits, const RouterParams& router, int32_t* expert_ids,
                             float* weights) = 0;
  // out[t] = Σ_k weights[t][k] · expert_{ids[t][k]}(x[t]), where expert e computes
  // down · (gelu_tanh(gate · x) ⊙ (up · x)).
  virtual void run_experts(std::span<const model::ExpertMatrices> experts, Rows x,
                           const int32_t* expert_ids, const float* weights, int top_k,
                           Rows out) = 0;

  // Fused operations. Each has a default composed of the primitives above, in exactly the order
  // the engine ran them before they existed, so a backend that keeps the defaults (the CPU
  // reference) computes bit for bit what it did; a device backend overrides them with one kernel
  // each.

  // acc = (acc + norm(x; weight)) · scalar, row by row; then, if next.data != nullptr,
  // next = norm(acc; next_weight) (next_weight nullptr: weightless). x may be overwritten.
  // Default: rms_norm(x → x), add(acc, x), scale(acc, scalar) when scalar != 1, rms_norm(acc →
  // next).
  virtual void add_rms_norm(Rows acc, Rows x, const float* weight, float scalar,
                            const float* next_weight, Rows next, const NormParams& norm);

  // The router of a MoE layer: logits = x · router_projᵀ (kept: the engine's router trace reads
  // them), then route_experts(logits, router, expert_ids, weights). Default: those two calls.
  virtual void matmul_route_experts(const quant::QMatrix& router_proj, Rows x, Rows logits,
                                    const RouterParams& router, int32_t* expert_ids,
                                    float* weights);

  // The attention block's residual step of a MoE layer and the inputs of the layer's router and
  // experts (arch spec 3), row by row: add_rms_norm(acc, x, weight, scalar, next_weight, next,
  // norm), then from the new acc: moe.router_in = norm(acc) (weightless) · router_scale[j] ·
  // router_factor and moe.expert_in = norm(acc; expert_weight) (pre_feedforward_layernorm_2).
  // router_in may be x; otherwise router_in and expert_in overlap nothing. Default: add_rms_norm,
  // rms_norm(acc → router_in), scale(router_in, router_scale, router_factor), rms_norm(acc →
  // expert_in).
  virtual void add_rms_norm_moe(Rows acc, Rows x, const float* weight, float scalar,
                                const float* next_weight, Rows next, const MoeInputs& moe,
                                const NormParams& norm);
  // A MoE block's end: branch = branch + norm(x; branch_weight) (the expert output joining the
  // dense one), then add_rms_norm(acc, branch, weight, scalar, next_weight, next, norm). x and
  // branch may be overwritten. Default: add_rms_norm(branch, x, branch_weight, 1, none), then that
  // add_rms_norm.
  virtual void add_rms_norm_branch(Rows acc, Rows branch, Rows x, const float* branch_weight,
                                   const float* weight, float scalar, const float* next_weight,
                                   Rows next, const NormParams& norm);

  // Attention inputs of one layer, in place: q per head normed (q_norm) and rotated; if
  // k.data != nullptr (the layer owns its KV): k per head normed (k_norm) and rotated, v per
  // head normed without weight when norm_v, and rows [s.first_row, s.first_row + s.count) of k/v
  // stored into s.kv at positions[s.first_row ...] for every s in `sequences`. k and v are
  // scratch afterwards. Default: the existing rms_norm/rope/write_kv calls.
  virtual void prepare_attention(Rows q, Rows k, Rows v, const float* q_norm, const float* k_norm,
                                 bool norm_v, int head_dim, const int32_t* positions,
                                 const model::RopeParams& rope,
                                 std::span<const SequenceRows> sequences, const NormParams& norm);

  // attention() for every sequence's rows of q / out (one launch on CUDA for a decode batch).
  // Default: attention(q.slice(s.first_row, s.count), positions + s.first_row, s.kv, ...) per s.
  virtual void attention_rows(Rows q, const int32_t* positions,
                              std::span<const SequenceRows> sequences, int window, float scale,
                              Rows out);

  // Whether prepare_attention, prepare_and_attend and prepare_and_attend_pieces may be given v
  // aliasing k (the same rows): a k_eq_v layer's V is its raw K projection, and a backend that
  // reads both whole before writing either needs no copy of it. Default false: the default
  // prepare_attention norms k in place before v.
  virtual bool values_may_alias_keys() const { return false; }

  // prepare_attention(q, k, v, ...), then attention_rows(q, ...) over the same sequences (one
  // launch on CUDA for a decode batch). q, k and v are scratch afterwards. Default: those calls.
  virtual void prepare_and_attend(Rows q, Rows k, Rows v, const float* q_norm, const float* k_norm,
                                  bool norm_v, int head_dim, const int32_t* positions,
                                  const model::RopeParams& rope,
                                  std::span<const SequenceRows> sequences, const NormParams& norm,
                                  int window, float scale, Rows out);

  // prepare_and_attend for sequences with more rows than a sliding ring lets one write and then
  // attend (window - 1 + C live slots for a chunk of C): the result, outputs and caches, of every
  // sequence's rows written and attended in pieces of at most chunk_limit rows, one after the
  // other. Default: exactly those pieces (prepare_attention, then attention_rows, per piece).
  virtual void prepare_and_attend_pieces(Rows q, Rows k, Rows v, const float* q_norm,
                                         const float* k_norm, bool norm_v, int head_dim,
                                         const int32_t* positions, const model::RopeParams& rope,
                                         std::span<const SequenceRows> sequences,
                                         const NormParams& norm, int window, float scale, Rows out,
                                         int64_t chunk_limit);

  // y = gelu_tanh(x · Wᵀ) ⊙ multiplier (the PLE gate). Default: matmul(w, x, y);
  // gelu_tanh_mul(y, multiplier, y).
  virtual void matmul_gelu_mul(const quant::QMatrix& w, Rows x, Rows multiplier, Rows y);

  // The end of a layer with per-layer inputs (arch spec 2.4 steps 6–7), row by row:
  //   acc = acc + norm(x; weight)                            (the feed-forward residual step)
  //   gated = gelu_tanh(acc · gateᵀ) ⊙ multiplier             (the PLE gate)
  //   projected = gated · projectionᵀ
  //   acc = (acc + norm(projected; projected_weight)) · scalar; next = norm(acc; next_weight)
  //   when next.data != nullptr.
  // x, gated and projected may be overwritten. Default: add_rms_norm(acc, x, weight, 1, none),
  // matmul_gelu_mul(gate, acc, multiplier, gated), matmul(projection, gated, projected),
  // add_rms_norm(acc, projected, projected_weight, scalar, next_weight, next).
  virtual void add_rms_norm_ple(Rows acc, Rows x, const float* weight, const quant::QMatrix& gate,
                                Rows multiplier, Rows gated, const quant::QMatrix& projection,
                                Rows projected, const float* projected_weight, float scalar,
                                const float* next_weight, Rows next, const NormParams& norm);
  // add_rms_norm_ple, then matmul(matmul_weights, next, matmul_out): the next layer's first
  // matmul, which reads the step's next (a device backend may run both in one launch). Default:
  // the two calls.
  virtual void add_rms_norm_ple_matmul(Rows acc, Rows x, const float* weight,
                                       const quant::QMatrix& gate, Rows multiplier, Rows gated,
                                       const quant::QMatrix& projection, Rows projected,
                                       const float* projected_weight, float scalar,
                                       const float* next_weight, Rows next, const NormParams& norm,
                                       const quant::QMatrix& matmul_weights, Rows matmul_out);

  // Whether this backend wants row-interleaved gate/up matrices (see matmul_gelu_pairs):
  // ResidentWeights builds them (instead of separate gate_proj/up_proj copies) only then.
  virtual bool fuses_gate_up() const { return false; }
  // y[t][i] = gelu_tanh(a[t][2i]) · a[t][2i + 1] with a = x · Wᵀ, where W's rows alternate
  // gate row i, up row i (y.width = W.rows / 2). Pure virtual: the CPU backend implements it too
  // (so the interleaved path is tested in CI through a test backend that reports
  // fuses_gate_up()).
  virtual void matmul_gelu_pairs(const quant::QMatrix& w, Rows x, Rows y) = 0;

  // summaries[r] = summarize_logits (engine.h) of row rows[r].row of `logits` with that row's
  // edits and candidates (the device rows may be left edited). Results are on the host when it
  // returns (it synchronizes like download). Default: download each row and summarise it on the
  // host; a device backend ranks on the device and copies only the summaries (its log_normaliser
  // may differ from the host's in the last bits: the sum runs in another order).
  virtual void summarize_logits(Rows logits, std::span<const LogitRowRequest> rows,
                                std::span<LogitSummary> summaries);

  // Chained greedy decoding (Gemma4Engine::decode_greedy), at most kGreedySlots steps in flight:
  // enqueue_greedy enqueues, for each row r of `logits`, its greedy token (the largest logit,
  // equal logits: the lower id, as summarize_logits ranks) into token_ids[r] (backend memory: the
  // next decode step's input), one more on positions[r], and a copy of the token, its logit and
  // the row's log-normaliser to tokens[r] on the host, there once wait_greedy(slot) returns
  // (tokens must stay valid until then). A slot is enqueued again only after its wait. Default:
  // summarize_logits and the uploads, done when it returns.
  static constexpr int kGreedySlots = 2;
  virtual void enqueue_greedy(Rows logits, int32_t* token_ids, int32_t* positions,
                              std::span<GreedyToken> tokens, int slot);
  virtual void wait_greedy(int slot) { (void)slot; }
};

}  // namespace gemma4::engine
