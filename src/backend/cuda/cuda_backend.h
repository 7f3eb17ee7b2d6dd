// engine::Backend on one NVIDIA GPU: every operation enqueued on one stream over device memory,
// the same math as the CPU reference (fp32 activations; KV caches of any engine::KvType). This
// first version is about being correct; it keeps the way open for CUDA graphs (no host sync inside
// operations except download(); per-step values are read from device memory).
//
// Which kernel serves what:
//  * matmul: the packed GEMV (gemv.h) for every format but fp32 (w4g32, nvfp4, bf16 and the
//    GGUF repacks w4g32a, w8, f16), prefill chunks in slices of 64 rows (correct, not fast: a
//    tensor-core GEMM comes later); anything else (fp32 weights, K % 32 != 0, unaligned rows) a
//    generic element-wise kernel. matmul_gelu_mul / matmul_gelu_pairs: the same GEMV with the
//    GELU gating in its epilogue (interleaved gate/up rows: fuses_gate_up);
//  * rms_norm, gelu_tanh_mul: elementwise.h; attention: decode_attention (attention.h) for one
//    query of head_dim 256/512, else a generic kernel (prefill chunks, other head dims);
//  * route_experts / run_experts: the MoE kernels (moe.h), expert ids never leave the device.
//  * prefill passes (more than kTensorCoreMaxGemvRows = 16 rows): matmul and attention on bf16
//    tensor cores (prefill_matmul.h, prefill_kernels.h), unless set_fp32_activations(true);
//    passes of up to 64 rows over w4g32 / NVFP4 weights (batched decode) keep the GEMV, which
//    multiplies 2..64 rows on tensor cores from the packed weights (gemv_mma.h);
//  * the decode GEMVs take their activations as the ActivationMode says: exact fp32, bf16
//    (fp32 sums, as the tensor-core passes and a bf16 model) or q8 (int8 per 32 + dp4a for w4g32
//    weights, bf16 for the other formats with a bf16 kernel). In bf16/q8 mode the kernels that
//    produce GEMV inputs (rms_norm, add_rms_norm's next and residual, the GELU epilogues, the
//    decode attention) also write bf16/q8 "companions" of their fp32 rows (gemv_kernels.h:
//    ActivationCompanions), which the GEMV reading those rows loads directly; any other input (an
//    embedding, a prefill chunk's attention output) is converted by one small kernel first. In q8
//    mode the GELU epilogues write bf16 only, except the one-row w4g32 gate+up (its 64-row tiling
//    quantizes whole chunks); a w4g32 GEMV reading bf16-only rows takes them as bf16. The backend
//    tracks which fp32 rows have live companions and drops a row's companions whenever an operation
//    (or upload, or a new allocation) writes those rows; operations that do not report what they
//    write (attention, the MoE kernels, graph replays) drop them all (the decode attention then
//    adds its output's own). So a GEMV never reads a stale one: at worst it converts again.
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv_kernels.h"
#include "backend/cuda/launch.h"
#include "backend/cuda/ple_step.h"
#include "backend/cuda/sample_logits.h"
#include "core/status.h"
#include "engine/backend.h"

namespace gemma4::cuda {

struct DecodePrepare;  // attention.h
struct GemvInput;      // gemv.h
struct GemvOutput;     // gemv.h

// How decode GEMVs take their activations (the CLI's --activations; see above).
enum class ActivationMode : uint8_t { kF32, kBF16, kQ8 };
// The mode of a backend made without one (and of the CLI without --activations).
inline constexpr ActivationMode kDefaultActivationMode = ActivationMode::kBF16;

class CublasContext;  // prefill_matmul.h
struct GreedyChain;   // greedy_chain.h
class ReplayTimer;    // replay_timer.h
struct MatrixView;    // backend_kernels.h
struct RowsView;      // elementwise.h

class CudaBackend final : public engine::Backend {
 public:
  // Use make_cuda_backend: it checks the device first.
  // pdl: launch every kernel with programmatic dependent launch (launch.h).
  CudaBackend(int device, bool pdl);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const char* name() const override { return "cuda"; }
  bool reads_host_memory() const override { return false; }
  Status status() const override { return status_; }
  // Every KvType: fp32, bf16 and e4m3 caches (attention_kv.cuh).
  bool supports_kv_type(engine::KvType) const override { return true; }
  std::optional<int64_t> kernels_launched() const override { return kernels_; }
  // cudaProfilerStart / cudaProfilerStop, each after a stream synchronisation.
  void begin_profiler_range() const override;
  void end_profiler_range() const override;

  // ReplayTimer (replay_timer.h) around every replay and synchronising read while on.
  void time_replays(bool on) const override;
  std::optional<engine::ReplayTimes> replay_times() const override;

  // Stream capture into a CUDA graph (thread-local mode: another thread's allocations stay
  // legal while this one captures), replayed with one cudaGraphLaunch.
  bool can_record() const override { return true; }
  std::unique_ptr<engine::RecordedWork> record(const std::function<void()>& enqueue) override;
  void replay(engine::RecordedWork& work) override;
  // A decode pass (up to 16 rows, or a batched decode step of 33 to kMaxGemvRows rows): `second` on
  // the main stream (the higher priority, enqueued first: the MoE layer's router and experts, the
  // longer branch), `first` on a second stream forked from the main stream's work so far, then the
  // main stream waits for the second stream (an event pair; inside record() the graph gets both
  // branches). An operation of `first` that needs cuBLAS or the shared prefill scratch (a matrix
  // no GEMV takes at these rows) moves the rest of `first` behind `second` on the main stream
  // (join_side_branch). Batched decode steps of 17-32 rows, prefill passes on tensor cores (more
  // rows) and nested calls: the default order.
  void concurrently(int64_t rows, const std::function<void()>& first,
                    const std::function<void()>& second) override;

  engine::Buffer allocate(size_t bytes) override;
  void upload(void* dst, const void* src, size_t bytes) override;
  // Waits for everything enqueued before it.
  void download(void* dst, const void* src, size_t bytes) override;

  void embed(const quant::QMatrix& table, const int32_t* ids, float scale,
             engine::Rows out) override;
  void matmul(const quant::QMatrix& w, engine::Rows x, engine::Rows y) override;
  void rms_norm(engine::Rows x, const float* weight, float weight_offset, float eps,
                engine::Rows y) override;
  void rope(engine::Rows x, int head_dim, const int32_t* positions,
            const model::RopeParams& rope) override;
  void gelu_tanh_mul(engine::Rows gate, engine::Rows multiplier, engine::Rows out) override;
  void add(engine::Rows acc, engine::Rows x) override;
  void scale(engine::Rows x, const float* column_scale, float scalar) override;
  void softcap(engine::Rows x, float cap) override;
  void copy(engine::Rows src, engine::Rows dst) override;

  void write_kv(const engine::KvView& kv, engine::Rows k, engine::Rows v,
                const int32_t* positions) override;
  void forget_kv(const engine::KvView& kv, int64_t from_position) override;
  void attention(engine::Rows q, const int32_t* positions, const engine::KvView& kv, int window,
                 float scale, engine::Rows out) override;

  void route_experts(engine::Rows logits, const engine::RouterParams& router, int32_t* expert_ids,
                     float* weights) override;
  void run_experts(std::span<const model::ExpertMatrices> experts, engine::Rows x,
                   const int32_t* expert_ids, const float* weights, int top_k,
                   engine::Rows out) override;

  // Fused decode operations (fused_ops.h, elementwise.h, attention.h): one kernel each, the
  // sequences of a pass passed in the kernel parameters (attention.h: SequenceKvTable).
  void add_rms_norm(engine::Rows acc, engine::Rows x, const float* weight, float scalar,
                    const float* next_weight, engine::Rows next,
                    const engine::NormParams& norm) override;
  void add_rms_norm_branch(engine::Rows acc, engine::Rows branch, engine::Rows x,
                           const float* branch_weight, const float* weight, float scalar,
                           const float* next_weight, engine::Rows next,
                           const engine::NormParams& norm) override;
  void matmul_route_experts(const quant::QMatrix& router_proj, engine::Rows x, engine::Rows logits,
                            const engine::RouterParams& router, int32_t* expert_ids,
                            float* weights) override;
  void add_rms_norm_moe(engine::Rows acc, engine::Rows x, const float* weight, float scalar,
                        const float* next_weight, engine::Rows next, const engine::MoeInputs& moe,
                        const engine::NormParams& norm) override;
  // Every prepare kernel reads k and v rows and writes only the cache (and q in place).
  bool values_may_alias_keys() const override { return true; }
  void prepare_attention(engine::Rows q, engine::Rows k, engine::Rows v, const float* q_norm,
                         const float* k_norm, bool norm_v, int head_dim, const int32_t* positions,
                         const model::RopeParams& rope,
                         std::span<const engine::SequenceRows> sequences,
                         const engine::NormParams& norm) override;
  // A decode batch (every sequence one row) in one decode_attention launch (+ the split merge)
  // per kMaxBatchedSequences sequences; anything else as the default, per sequence.
  void attention_rows(engine::Rows q, const int32_t* positions,
                      std::span<const engine::SequenceRows> sequences, int window, float scale,
                      engine::Rows out) override;

  // A decode batch in one decode_attention launch per kMaxBatchedSequences sequences with the
  // prologue that prepares q and stores k/v (attention.h: DecodePrepare), saving the
  // prepare_attention kernel; anything else as the default (prepare_attention, attention_rows).
  void prepare_and_attend(engine::Rows q, engine::Rows k, engine::Rows v, const float* q_norm,
                          const float* k_norm, bool norm_v, int head_dim, const int32_t* positions,
                          const model::RopeParams& rope,
                          std::span<const engine::SequenceRows> sequences,
                          const engine::NormParams& norm, int window, float scale,
                          engine::Rows out) override;

  // Per sequence: rows that fit as prepare_and_attend; longer tensor-core passes (a sliding ring
  // shorter than window - 1 + rows) in one go: the rows' K/V stored into scratch instead of the
  // ring, attended together with the ring (prefill_chunk_attention), then the ring updated
  // (store_staged_kv): a memset and three launches (+ a split merge) instead of two or three per
  // piece of chunk_limit rows. Anything else (fp32 activations, shapes the prefill kernel does not
  // take) as the default pieces.
  void prepare_and_attend_pieces(engine::Rows q, engine::Rows k, engine::Rows v,
                                 const float* q_norm, const float* k_norm, bool norm_v,
                                 int head_dim, const int32_t* positions,
                                 const model::RopeParams& rope,
                                 std::span<const engine::SequenceRows> sequences,
                                 const engine::NormParams& norm, int window, float scale,
                                 engine::Rows out, int64_t chunk_limit) override;

  // Where matmul takes the GEMV: the GEMV with GELU gating in its epilogue (gemv.h), one kernel
  // per 64 rows. Tensor-core passes, and weights or rows the GEMV does not take: matmul, then the
  // gating (one more kernel).
  void matmul_gelu_mul(const quant::QMatrix& w, engine::Rows x, engine::Rows multiplier,
                       engine::Rows y) override;
  // One decode row: at E2B's widths the whole step in one cluster launch (ple_step.h), three
  // kernels fewer than the default; at others the feed-forward residual step rides in the PLE
  // gate GEMV (each block stages acc + norm(x) itself, writing nothing) and in the closing norm
  // kernel (add_rms_norm_deferred), one kernel fewer.
  void add_rms_norm_ple(engine::Rows acc, engine::Rows x, const float* weight,
                        const quant::QMatrix& gate, engine::Rows multiplier, engine::Rows gated,
                        const quant::QMatrix& projection, engine::Rows projected,
                        const float* projected_weight, float scalar, const float* next_weight,
                        engine::Rows next, const engine::NormParams& norm) override;
  // One decode row in kBF16 mode at E2B's widths, with a w4g32 matmul of at most ple_step.h's
  // rows: the step and the matmul in one launch (ple_step_matmul), one kernel fewer.
  void add_rms_norm_ple_matmul(engine::Rows acc, engine::Rows x, const float* weight,
                               const quant::QMatrix& gate, engine::Rows multiplier,
                               engine::Rows gated, const quant::QMatrix& projection,
                               engine::Rows projected, const float* projected_weight, float scalar,
                               const float* next_weight, engine::Rows next,
                               const engine::NormParams& norm, const quant::QMatrix& matmul_weights,
                               engine::Rows matmul_out) override;
  bool fuses_gate_up() const override { return true; }
  void matmul_gelu_pairs(const quant::QMatrix& w, engine::Rows x, engine::Rows y) override;

  // Edits and top-C ranking on the device (sample_logits.h, three launches), then one copy of
  // the candidates into pinned memory. Vocabularies past the kernels' limit: the default.
  void summarize_logits(engine::Rows logits, std::span<const engine::LogitRowRequest> rows,
                        std::span<engine::LogitSummary> summaries) override;

  // Chained greedy decoding (greedy_chain.cpp): the ranking with its GreedyFeed (two launches:
  // sample_logits.h) on the stream, the tokens' copy into pinned memory on a stream of its own.
  // Vocabularies past the ranking kernels' limit: the default.
  void enqueue_greedy(engine::Rows logits, int32_t* token_ids, int32_t* positions,
                      std::span<engine::GreedyToken> tokens, int slot) override;
  void wait_greedy(int slot) override;

  cudaStream_t stream() const { return stream_; }

  // Outside kF32 mode, passes of more than kTensorCoreMaxGemvRows rows (prefill) run matmul and
  // attention on bf16 tensor cores, and the GEMVs take bf16 or q8 activations (above). kF32
  // multiplies the exact fp32 activations everywhere (fp32 kernels, much slower), for tests that
  // compare whole passes with the fp32 CPU reference at fp32 tolerance and for the CLI's --fp32.
  void set_activation_mode(ActivationMode mode) {
    activation_mode_ = mode;
    fp32_activations_ = mode == ActivationMode::kF32;
  }
  ActivationMode activation_mode() const { return activation_mode_; }
  // kF32, or back to kDefaultActivationMode.
  void set_fp32_activations(bool fp32) {
    set_activation_mode(fp32 ? ActivationMode::kF32 : kDefaultActivationMode);
  }
  // The companions the backend holds now for exactly these rows (same start, width and stride,
  // at least as many rows), or null: what the next GEMV reading x would load (tests).
  const ActivationCompanions* live_companions(engine::Rows x) const;

 private:
  // Device scratch that grows on demand (synchronizing first: kernels may still read it; and
  // never freed while recorded graphs may read it, see retired_scratch_).
  struct Scratch {
    void* data = nullptr;
    size_t bytes = 0;
  };
  void* scratch(Scratch& s, size_t bytes);
  // The Launch of the next operation; makes the device current for the calling thread (the
  // engine may run on another thread than the one that created the backend).
  Launch launch();
  // Records the first failure (`what` names the operation).
  void check(cudaError_t status, const char* what);
  // check() for a kernel wrapper that enqueued `kernels` kernels when it succeeded.
  void launched(cudaError_t status, const char* what, int kernels = 1);
  void fail(ErrorCode code, std::string message);
  // A decode batch (every sequence one row, one cache shape and type) through decode_attention,
  // kMaxBatchedSequences sequences per launch (+ the split merge), with `prepare` as
  // AttentionQuery::prepare and `keys_from_values` as every cache's KvCacheView::keys_from_values.
  // What it does not take goes, from sequence `first` on (nothing enqueued for those), to
  // otherwise(first).
  void decode_rows(engine::Rows q, const int32_t* positions,
                   std::span<const engine::SequenceRows> sequences, int window, float scale,
                   engine::Rows out, const DecodePrepare* prepare,
                   const KeysFromValues& keys_from_values,
                   const std::function<void(size_t)>& otherwise);
  // Whether a pass of `rows` rows takes the tensor-core paths (prefill_matmul.h).
  bool tensor_core_rows(int64_t rows) const;
  // y = x · Wᵀ on tensor cores (prefill_matmul.cpp); the operands as
  // tensor_core_matmul_accepts takes them. With gelu_pairs, y[t][i] = gelu_tanh(p[t][2i]) ·
  // p[t][2i + 1] of those products p instead (W.rows / 2 columns, gemv.h kGeluPairs), applied
  // to each weight tile's products while they are still in L2.
  // Inside concurrently()'s first branch: the branch's work so far joined into the main stream,
  // the rest of it enqueued there (after the second branch). Elsewhere nothing.
  void join_side_branch();
  void tensor_core_matmul(const MatrixView& w, const RowsView& x, const RowsView& y,
                          bool gelu_pairs = false);
  // y = epilogue(x · Wᵀ) through the packed GEMV, 64 rows per launch (out: row 0's output).
  // False, with nothing enqueued, when the GEMV does not take these weights or rows.
  bool packed_gemv(const quant::QMatrix& w, engine::Rows x, const GemvOutput& out,
                   const char* what);
  // The residual step kernels' parameters with the companions they write (next's, else acc's),
  // and the bookkeeping of what they wrote.
  AddNormSpec residual_step_spec(engine::Rows acc, const float* weight, float scalar,
                                 const float* next_weight, engine::Rows next,
                                 const engine::NormParams& norm);
  void residual_step_wrote(engine::Rows acc, engine::Rows next, const AddNormSpec& spec);
  // ple_step's parameters (add_rms_norm_ple's, with the gate and projection as views) and the
  // bookkeeping of what it wrote: shared by ple_step and ple_step_matmul.
  PleStepArgs ple_step_args(engine::Rows acc, engine::Rows x, const float* weight,
                            const MatrixView& gate, engine::Rows multiplier, engine::Rows gated,
                            const MatrixView& projection, engine::Rows projected,
                            const float* projected_weight, float scalar, const float* next_weight,
                            engine::Rows next, const engine::NormParams& norm);
  void ple_step_wrote(engine::Rows acc, engine::Rows gated, engine::Rows projected,
                      engine::Rows next, const AddNormSpec& spec);
  // Held by the operations that report every row they write (wrote / produced): launch() outside
  // them drops every live companion, since other work (a graph replay, an operation that does not
  // report its writes) may have written any rows.
  struct ReportingWrites {
    explicit ReportingWrites(CudaBackend& backend) : backend(backend) {
      ++backend.reporting_writes_;
    }
    ~ReportingWrites() { --backend.reporting_writes_; }
    ReportingWrites(const ReportingWrites&) = delete;
    ReportingWrites& operator=(const ReportingWrites&) = delete;
    CudaBackend& backend;
  };
  // Companion bookkeeping (see the top of this file). Storage for the companions of rows `out`
  // (bf16 and/or q8 as asked), kept per fp32 start address; nothing (null pointers) when `out`
  // gets none: kF32 mode, passes of more than the GEMV's 64 rows (prefill on cuBLAS), a width
  // that is not a multiple of 32.
  ActivationCompanions companion_storage(engine::Rows out, bool bf16, bool q8);
  // The companions the producers of rows `out` write in this mode (companion_storage).
  ActivationCompanions produced_companions(engine::Rows out);
  // An operation wrote [data, data + bytes) / the rows `rows`: their companions are stale.
  void wrote(const void* data, size_t bytes);
  void wrote(engine::Rows rows);
  // A kernel that succeeded wrote `rows` and their companions `c` (wrote(rows) first).
  void produced(engine::Rows rows, const ActivationCompanions& c);
  // What a GEMV with weights w reads for x: a companion (made now by one kernel if x has none),
  // or the fp32 rows (kF32 mode, formats without bf16/q8 kernels, widths not a multiple of 32).
  GemvInput gemv_input(const quant::QMatrix& w, engine::Rows x);
  // The device inv_freq table of (rope, head_dim), uploaded on first use; null on failure.
  const float* rope_table(const model::RopeParams& rope, int head_dim);

  int device_ = 0;
  bool pdl_ = true;
  cudaStream_t stream_ = nullptr;
  // concurrently(): its first branch's stream, the fork and join events, and the stream launch()
  // hands out now (stream_ outside a first branch).
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t fork_event_ = nullptr;
  cudaEvent_t join_event_ = nullptr;
  cudaStream_t active_stream_ = nullptr;
  Status status_;
  int64_t kernels_ = 0;  // kernels enqueued so far (kernels_launched)
  Scratch attention_partials_;
  // Decode attention's split-merge counters (AttentionWorkspace::merge_counters): zeroed once,
  // left at zero by every launch.
  int* attention_merge_counters_ = nullptr;
  unsigned* ple_step_acc_readers_ = nullptr;  // ple_step_matmul's counter (zero between launches)
  Scratch staged_kv_;         // prepare_and_attend_pieces: a pass's K/V and positions, staged
  Scratch expert_workspace_;  // run_experts (moe_workspace_bytes)
  Scratch pair_products_;     // matmul_gelu_pairs off the fused GEMV: the gate/up products
  // Once a graph is recorded it may hold scratch pointers: outgrown scratch is kept until the
  // backend goes instead of being freed.
  bool recorded_ = false;
  std::vector<Scratch> retired_scratch_;
  // inv_freq tables by (theta, rotated_pairs, exponent_denominator, head_dim).
  std::map<std::tuple<double, int, int, int>, engine::Buffer> rope_tables_;
  ActivationMode activation_mode_ = kDefaultActivationMode;
  bool fp32_activations_ = false;  // activation_mode_ == kF32
  // Companion storage per fp32 start address (never freed while graphs may hold it: like
  // scratch), and the companions live now (fp32 rows [data, data + count · stride)).
  struct CompanionStorage {
    Scratch bf16;
    Scratch q8;
  };
  std::map<const float*, CompanionStorage> companion_storage_;
  struct LiveCompanions {
    engine::Rows rows;
    ActivationCompanions companions;
  };
  std::vector<LiveCompanions> live_companions_;
  int reporting_writes_ = 0;  // ReportingWrites held now
  // time_replays: the timer of the last timing (kept after it stops, for replay_times) and
  // whether it runs now.
  mutable std::unique_ptr<ReplayTimer> replay_timer_;
  mutable bool timing_replays_ = false;
  std::unique_ptr<CublasContext> cublas_;      // made by the first tensor-core matmul
  Scratch prefill_activations_;                // its bf16 activations
  Scratch prefill_weights_;                    // its bf16 weight tile
  Scratch ranking_;                            // summarize_logits: inputs, scratch and results
  PinnedStaging ranking_host_;                 // summarize_logits: staged inputs and results
  std::unique_ptr<GreedyChain> greedy_chain_;  // made by the first enqueue_greedy
};

// A CudaBackend on `device`, or a clear error when there is no usable GPU.
// How make_cuda_backend sets a backend up (the CLI's --no-pdl and --activations / --fp32).
struct CudaOptions {
  bool pdl = true;  // false: kernels launched plainly (for A/B measurements)
  ActivationMode activations = kDefaultActivationMode;  // set_activation_mode
};

// "f32", "bf16", "q8".
const char* activation_mode_name(ActivationMode mode);

Expected<std::unique_ptr<engine::Backend>> make_cuda_backend(int device = 0,
                                                             const CudaOptions& options = {});

}  // namespace gemma4::cuda
