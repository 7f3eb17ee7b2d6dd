// gemma4 bench -m MODEL [--device D] [--depths ...] [--prefill ...] [--batches ...] [--json FILE]:
// engine throughput of greedy decoding: decode steps through Engine::decode_greedy (each step's
// greedy token stays on the device as the next step's input, the next step enqueued before the
// host reads it), or with --no-chain as a serving loop sees it (Engine::step_sampled asking for
// the greedy candidate of every row, as the server does for greedy requests: only token ids and
// the log-normaliser come back, not rows of logits); prefill through step_sampled. Measures
//  * decode tok/s of one stream at several context depths (each depth reached by prefill),
//  * prefill tok/s of one prompt of several lengths (each after an untimed one of its length),
//  * aggregate decode tok/s of several concurrent streams (one batched step per token),
// and reports the weights read per decoded token, the effective GB/s that implies and its share
// of --bandwidth-gbs, peak GPU memory and kernels per token. Prints a table; --json FILE writes
// the same figures (model, format, gpu, commit, decode[], prefill[], peak_gpu_mib,
// kernels_per_token, sampling, ...). Chained steps feed back the greedy tokens; --no-chain feeds
// a fixed pseudo-random sequence instead (the same work per step). --timeline FILE records the GPU
// timeline of the profiled measurements' steps with CUPTI (cli/cupti_timeline.h): a summary per
// kernel name is printed, every kernel goes to FILE.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/build_info.h"
#include "cli/command.h"
#include "cli/cupti_timeline.h"
#include "cli/engine_flags.h"
#include "cli/gpu_info.h"
#include "cli/model_loader.h"

namespace gemma4::cli {
namespace {

using Clock = std::chrono::steady_clock;

// What every timed step returns (report and JSON "sampling"): with --no-chain (or --timeline),
// else through Engine::decode_greedy.
constexpr const char* kGreedySampling = "greedy candidates (1 per row; no logits rows copied)";
constexpr const char* kChainedSampling =
    "greedy tokens chained in backend memory (Engine::decode_greedy; only token ids copied)";

struct BenchArgs {
  std::string model;
  EngineFlags engine;
  bool no_chain = false;
  bool step_times = false;
  std::vector<int64_t> depths = {0, 4096, 32768, 131072};
  std::vector<int64_t> prefill = {512, 4096, 32768};
  std::vector<int> batches = {1, 8, 32, 64};
  int parallel = 64;
  int64_t ctx_size = 0;  // 0: what the depths and prefill lengths need
  int decode_tokens = 128;
  double bandwidth_gbs = 4250;
  std::string json_file;
  bool quick = false;
  std::vector<std::string> profile_last;  // measurement kinds (kProfiledKinds) to profile
  std::string timeline_file;
};

// --quick: a short run that still touches every measurement. Options given explicitly win.
void apply_quick(BenchArgs& args, const CLI::App& cmd) {
  if (cmd.count("--depths") == 0) args.depths = {0, 4096};
  if (cmd.count("--prefill") == 0) args.prefill = {512};
  if (cmd.count("--batches") == 0) args.batches = {1, 8};
  if (cmd.count("--decode-tokens") == 0) args.decode_tokens = 16;
}

// What --profile-last can name: the batch-1 decode series, the prefill series, the batched
// decode series. Each kind's last measurement (deepest, longest, most streams) is profiled.
const std::vector<std::string> kProfiledKinds = {"decode", "prefill", "batched"};

constexpr const char* kProfileLastHelp =
    "run the timed steps of the last measurement of each KIND (decode: the deepest batch-1 "
    "decode, prefill: the last --prefill length run, batched: the most streams) in a CUDA "
    "profiler range, so profilers that wait for it record only those steps. One 64-stream "
    "decode step: gemma4 bench -m M --depths 0 --prefill 8 --batches 64 --decode-tokens 1 "
    "--profile-last batched, run under `ncu --profile-from-start off` or `nsys profile "
    "--capture-range=cudaProfilerApi` (several kinds: nsys needs --capture-range-end=repeat). "
    "No effect on the CPU";

constexpr const char* kTimelineHelp =
    "record with CUPTI (libcupti.so.13 of the CUDA toolkit, loaded at run time; GEMMA4_CUPTI=PATH "
    "names it) every kernel, memcpy and memset of the timed steps of the measurements "
    "--profile-last names (decode when it names none): print per kernel name its launches per "
    "step, mean duration and critical-path cost (how far its end moves the step's latest end: "
    "in a PDL chain, the previous kernel's end to its own) against the step's wall time, and "
    "write every launch (name, grid, block, start/end from the step's first kernel) to FILE as "
    "tab-separated values. Tracing adds some cost per kernel: the traced measurement's tok/s is "
    "lower than an untraced run's. E2B batch 1: gemma4 bench -m M --depths 0 --prefill 8 "
    "--batches 1 --decode-tokens 32 --timeline t.tsv";

// The timed steps of one measurement, bracketed by the backend's profiler range when `backend`
// is given (ends on every path out, errors included), and recorded by `timeline` as range
// `label` when both are given (mark_step before each step).
class ProfilerRange {
 public:
  ProfilerRange(const engine::Backend* backend, CuptiTimeline* timeline, std::string label)
      : backend_(backend), timeline_(backend ? timeline : nullptr), label_(std::move(label)) {
    if (backend_) backend_->begin_profiler_range();
    if (timeline_) timeline_->begin_range();
  }
  ~ProfilerRange() {
    if (backend_) backend_->end_profiler_range();
    if (timeline_) timeline_->end_range(std::move(label_));
  }
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

  void mark_step() {
    if (timeline_) timeline_->mark_step();
  }

 private:
  const engine::Backend* backend_;
  CuptiTimeline* timeline_;
  std::string label_;
};

struct DecodeResult {
  int batch = 0;
  int64_t depth = 0;
  double tok_per_s = 0;                           // all streams together
  std::optional<engine::ReplayTimes> step_times;  // --step-times, where the backend times them
};

struct PrefillResult {
  int64_t tokens = 0;
  double tok_per_s = 0;
};

// Token ids spread over the ordinary-text part of the vocabulary, from a fixed LCG (the golden
// prompts' generator), so every run feeds the same tokens.
class TokenStream {
 public:
  explicit TokenStream(int32_t vocab_size) : vocab_size_(vocab_size) {}

  std::vector<int32_t> take(int64_t count) {
    std::vector<int32_t> ids(count);
    for (auto& id : ids) {
      state_ = (state_ * 1103515245u + 12345u) % (1u << 31);
      const int32_t first = std::min<int32_t>(300, vocab_size_ - 1);
      id = first + static_cast<int32_t>(state_ % static_cast<uint64_t>(vocab_size_ - first));
    }
    return ids;
  }

 private:
  int32_t vocab_size_;
  uint64_t state_ = 20260415;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Weights a decode step reads once for every token of the batch: every matrix except the
// embedding tables (one row each per token), plus the logits matrix as the backend reads it
// (`lm_head`: engine::resident_lm_head_layout — a 4-bit copy, the 8-bit one of --lm-head q8, or
// the checkpoint's) — and for MoE layers only top_k / num_experts of the expert matrices (the
// share routing picks on average). with_lm_head false: the same without the logits matrix.
double weight_bytes_per_token(const model::LoadedModel& model, const quant::QMatrix& lm_head,
                              bool with_lm_head = true) {
  const auto& config = model.config;
  const auto& weights = model.weights;
  double bytes = with_lm_head ? static_cast<double>(lm_head.bytes()) : 0.0;
  model::for_each_matrix(weights, [&](const std::string& name, const quant::QMatrix& m) {
    if (name == "embed_tokens" || name == "embed_tokens_per_layer" || name == "lm_head") return;
    const bool expert = name.find(".experts.") != std::string::npos;
    const double share =
        expert && config.moe && config.moe_params.num_experts > 0
            ? static_cast<double>(config.moe_params.top_k) / config.moe_params.num_experts
            : 1.0;
    bytes += share * static_cast<double>(m.bytes());
  });
  return bytes;
}

// The commit the binary was built from; GEMMA4_COMMIT overrides it (a binary copied elsewhere and
// rebuilt from a tree git does not see, say).
std::string current_commit() {
  if (const char* env = std::getenv("GEMMA4_COMMIT"); env && *env) return env;
  return build_commit();
}

// Runs the measurements on engines of one opened model and tracks peak GPU memory between them.
class Bench {
 public:
  // `timeline`: records the profiled measurements when given.
  Bench(const BenchArgs& args, std::filesystem::path path,
        std::shared_ptr<model::LoadedModel> model, EngineLoadOptions load, CuptiTimeline* timeline)
      : args_(args),
        path_(std::move(path)),
        model_(std::move(model)),
        load_(load),
        timeline_(timeline) {}

  Status run() {
    GEMMA4_RETURN_IF_ERROR(run_single_stream());
    GEMMA4_RETURN_IF_ERROR(run_batched());
    if (timeline_ && !on_gpu_)
      return make_error(ErrorCode::kInvalidArgument,
                        "--timeline records CUDA kernels: the engine ran on the CPU");
    return Status::ok_status();
  }

  Status write_report() const;
  std::string lm_head_description() const;
  // Whether decode steps chain through Engine::decode_greedy. --timeline splits steps at host
  // marks, which chained steps overlap: it takes the one-call-per-step path.
  bool chained_decode() const { return !args_.no_chain && timeline_ == nullptr; }
  const char* sampling() const { return chained_decode() ? kChainedSampling : kGreedySampling; }
  Status write_timeline() const;

 private:
  Expected<LoadedEngine> make_engine(int32_t sequences, int64_t context) {
    EngineLoadOptions options = load_;
    options.engine.max_sequences = sequences;
    options.engine.max_context = context;
    GEMMA4_ASSIGN_OR_RETURN(LoadedEngine loaded, create_engine(path_, model_, options));
    backend_description_ = loaded.backend_description;
    activations_ = loaded.activations;
    on_gpu_ = loaded.device == Device::kCuda;
    sample_memory();
    return loaded;
  }

  void sample_memory() {
    if (!on_gpu_) return;
    if (auto used = cuda_memory_used_bytes(0))
      peak_gpu_bytes_ = std::max(peak_gpu_bytes_.value_or(0), *used);
  }

  void progress(const std::string& what) const {
    std::fprintf(stderr, "gemma4 bench: %s\n", what.c_str());
  }

  // Batch-1 decode at each depth, then prefill at each length, on one engine sized for both.
  Status run_single_stream() {
    const int64_t model_context = model_->config.max_position_embeddings > 0
                                      ? model_->config.max_position_embeddings
                                      : INT64_MAX;
    int64_t wanted = 1 + args_.decode_tokens + 2;
    for (int64_t depth : args_.depths) wanted = std::max(wanted, depth + args_.decode_tokens + 2);
    for (int64_t tokens : args_.prefill) wanted = std::max(wanted, tokens);
    const int64_t context = std::min(args_.ctx_size > 0 ? args_.ctx_size : wanted, model_context);
    if (context < args_.decode_tokens + 3)
      return make_error(ErrorCode::kInvalidArgument, "context {} is too short for {} decode tokens",
                        context, args_.decode_tokens);
    GEMMA4_ASSIGN_OR_RETURN(LoadedEngine loaded, make_engine(1, context));
    auto& engine = *loaded.engine;
    context_ = engine.max_context();
    memory_plan_ = loaded.memory_plan;
    lm_head_ =
        engine::resident_lm_head_layout(model_->weights, *loaded.backend, load_.engine.lm_head);

    // A depth that does not fit with its decode tokens is clipped to the deepest one that does.
    std::vector<int64_t> depths;
    for (int64_t depth : args_.depths)
      depths.push_back(std::min(depth, context_ - args_.decode_tokens - 2));
    std::sort(depths.begin(), depths.end());
    depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
    for (int64_t depth : depths) {
      progress(fmt::format("decode at depth {} (prefill first)", depth));
      const auto* profiled = profiled_backend("decode", depth == depths.back(), loaded);
      std::optional<engine::ReplayTimes> step_times;
      GEMMA4_ASSIGN_OR_RETURN(
          double rate, decode_rate(engine, 1, depth, profiled, *loaded.backend, &step_times));
      decode_.push_back({1, depth, rate, step_times});
      sample_memory();  // backend scratch grows with the depth
    }
    std::vector<int64_t> lengths;
    for (int64_t tokens : args_.prefill) {
      if (tokens > context_) {
        progress(fmt::format("prefill {} skipped: beyond the context {}", tokens, context_));
        continue;
      }
      lengths.push_back(tokens);
    }
    for (size_t i = 0; i < lengths.size(); ++i) {
      const int64_t tokens = lengths[i];
      progress(fmt::format("prefill {}", tokens));
      const auto* profiled = profiled_backend("prefill", i + 1 == lengths.size(), loaded);
      GEMMA4_ASSIGN_OR_RETURN(double rate, prefill_rate(engine, tokens, profiled));
      prefill_.push_back({tokens, rate});
      sample_memory();
    }
    kernels_per_token_ = kernels_per_token(engine, *loaded.backend);
    return Status::ok_status();
  }

  // Aggregate decode of several streams at a short depth, on an engine with one sequence each.
  // Stream counts beyond --parallel are clipped to it.
  Status run_batched() {
    std::vector<int> batches;
    for (int batch : args_.batches)
      if (batch > 1) batches.push_back(std::min(batch, args_.parallel));
    std::sort(batches.begin(), batches.end());
    batches.erase(std::unique(batches.begin(), batches.end()), batches.end());
    if (batches.empty() || batches.back() < 2) return Status::ok_status();
    const int64_t depth = std::min(kBatchDepth, context_ - args_.decode_tokens - 2);
    GEMMA4_ASSIGN_OR_RETURN(LoadedEngine loaded,
                            make_engine(batches.back(), depth + args_.decode_tokens + 2));
    for (int batch : batches) {
      if (batch < 2) continue;
      progress(fmt::format("decode of {} streams", batch));
      const auto* profiled = profiled_backend("batched", batch == batches.back(), loaded);
      std::optional<engine::ReplayTimes> step_times;
      GEMMA4_ASSIGN_OR_RETURN(double rate, decode_rate(*loaded.engine, batch, depth, profiled,
                                                       *loaded.backend, &step_times));
      decode_.push_back({batch, depth, rate, step_times});
    }
    return Status::ok_status();
  }

  // The backend whose profiler range brackets a measurement of `kind`: only the last one, and
  // only when --profile-last names the kind.
  const engine::Backend* profiled_backend(const std::string& kind, bool last,
                                          const LoadedEngine& loaded) const {
    const auto& kinds = args_.profile_last;
    const bool wanted = std::find(kinds.begin(), kinds.end(), kind) != kinds.end();
    return wanted && last ? loaded.backend : nullptr;
  }

  // One step that returns each input's greedy candidate (kGreedySampling).
  static Status greedy_step(engine::Engine& engine, std::span<const engine::StepInput> inputs) {
    const std::vector<engine::LogitRequest> requests(inputs.size(), engine::LogitRequest{1, {}});
    std::vector<engine::LogitSummary> summaries(inputs.size());
    return engine.step_sampled(inputs, requests, summaries, {});
  }

  // Opens `batch` sequences, prefills each to `depth` (at least 1 token), decodes two untimed
  // steps, then times decode_tokens steps of one token per stream (in `profiled`'s profiler range
  // when given).
  // With --step-times, the device's view of those steps (Backend::time_replays) goes to
  // *step_times.
  Expected<double> decode_rate(engine::Engine& engine, int batch, int64_t depth,
                               const engine::Backend* profiled, const engine::Backend& backend,
                               std::optional<engine::ReplayTimes>* step_times) {
    TokenStream tokens(engine.vocab_size());
    std::vector<engine::SequenceId> sequences;
    for (int b = 0; b < batch; ++b) {
      GEMMA4_ASSIGN_OR_RETURN(auto sequence, engine.open_sequence());
      sequences.push_back(sequence);
    }
    for (auto sequence : sequences) {
      const auto prompt = tokens.take(std::max<int64_t>(depth, 1));
      const engine::StepInput input{sequence, prompt};
      GEMMA4_RETURN_IF_ERROR(greedy_step(engine, {&input, 1}));
    }
    const auto step = [&] {
      const auto next = tokens.take(batch);
      std::vector<engine::StepInput> inputs;
      for (int b = 0; b < batch; ++b)
        inputs.push_back({sequences[b], std::span(next).subspan(b, 1)});
      return greedy_step(engine, inputs);
    };
    // Chained (Engine::decode_greedy): `steps` steps, each sequence fed back its greedy token,
    // the last one announced (no step enqueued past it).
    const bool chain = chained_decode();
    const auto chained = [&](int steps) {
      const auto first = tokens.take(batch);
      std::vector<int> seen(sequences.size(), 0);
      return engine.decode_greedy(sequences, first, [&](size_t i, const engine::GreedyToken&) {
        ++seen[i];
        return seen[i] >= steps       ? engine::GreedyNext::kStop
               : seen[i] + 1 == steps ? engine::GreedyNext::kLast
                                      : engine::GreedyNext::kContinue;
      });
    };
    // Step 1 runs unrecorded, step 2 records the graph (EngineOptions::record_decode).
    constexpr int kWarmupSteps = 2;
    if (chain) {
      GEMMA4_RETURN_IF_ERROR(chained(kWarmupSteps));
    } else {
      for (int warmup = 0; warmup < kWarmupSteps; ++warmup) GEMMA4_RETURN_IF_ERROR(step());
    }
    double elapsed = 0;
    {
      ProfilerRange range(profiled, timeline_,
                          batch == 1 ? fmt::format("decode depth {}", depth)
                                     : fmt::format("decode of {} streams at depth {}", batch,
                                                   std::max<int64_t>(depth, 1)));
      if (args_.step_times) backend.time_replays(true);
      const auto start = Clock::now();
      if (chain) {
        GEMMA4_RETURN_IF_ERROR(chained(args_.decode_tokens));
      } else {
        for (int i = 0; i < args_.decode_tokens; ++i) {
          range.mark_step();
          GEMMA4_RETURN_IF_ERROR(step());
        }
      }
      elapsed = seconds_since(start);
      if (args_.step_times) {
        backend.time_replays(false);
        *step_times = backend.replay_times();
      }
    }
    sample_memory();
    for (auto sequence : sequences) engine.close_sequence(sequence);
    return static_cast<double>(batch) * args_.decode_tokens / elapsed;
  }

  // One prompt of `count` tokens in one step, timed after an untimed prefill of the same length
  // on a sequence of its own (warm-up). The first pass of a row count the engine has not run yet
  // pays one-time costs that are not prefill throughput: cuBLAS picks and loads kernels for the
  // new GEMM shapes, and scratch sized by the rows (split attention partials) grows with a device
  // synchronisation. The decode depths before this reach their depth in full passes, so a
  // prompt shorter than a pass is such a first (a warm-up of a few rows takes the GEMV path and
  // warms none of it).
  // `profiled`: the backend whose profiler range brackets the timed pass, if any.
  Expected<double> prefill_rate(engine::Engine& engine, int64_t count,
                                const engine::Backend* profiled) {
    TokenStream tokens(engine.vocab_size());
    for (const bool timed : {false, true}) {
      GEMMA4_ASSIGN_OR_RETURN(auto sequence, engine.open_sequence());
      const auto prompt = tokens.take(count);
      const engine::StepInput input{sequence, prompt};
      ProfilerRange range(timed ? profiled : nullptr, timeline_, fmt::format("prefill {}", count));
      const auto start = Clock::now();
      range.mark_step();
      const Status status = greedy_step(engine, {&input, 1});
      const double elapsed = seconds_since(start);
      engine.close_sequence(sequence);
      GEMMA4_RETURN_IF_ERROR(status);
      sample_memory();
      if (timed) return static_cast<double>(count) / elapsed;
    }
    return make_error(ErrorCode::kInternal, "prefill of {} tokens was not measured", count);
  }

  // Kernel launches of a few single-stream decode steps, per token, when the backend counts
  // them.
  std::optional<double> kernels_per_token(engine::Engine& engine, const engine::Backend& backend) {
    const auto before = backend.kernels_launched();
    if (!before) return std::nullopt;
    TokenStream tokens(engine.vocab_size());
    auto sequence = engine.open_sequence();
    if (!sequence.ok()) return std::nullopt;
    constexpr int kSteps = 4;
    const auto first = tokens.take(1);
    engine::StepInput input{*sequence, first};
    bool ok = greedy_step(engine, {&input, 1}).ok();
    const auto counted_from = backend.kernels_launched();
    for (int i = 0; ok && i < kSteps; ++i) {
      const auto next = tokens.take(1);
      input.tokens = next;
      ok = greedy_step(engine, {&input, 1}).ok();
    }
    const auto after = backend.kernels_launched();
    engine.close_sequence(*sequence);
    if (!ok || !counted_from || !after) return std::nullopt;
    return static_cast<double>(*after - *counted_from) / kSteps;
  }

  // Depth of the streams in the batched measurement (less when the context is shorter).
  static constexpr int64_t kBatchDepth = 32;

  const BenchArgs& args_;
  std::filesystem::path path_;
  std::shared_ptr<model::LoadedModel> model_;
  EngineLoadOptions load_;
  CuptiTimeline* timeline_;  // null: no --timeline
  std::string backend_description_;
  std::string activations_;  // what decode matmuls read (LoadedEngine::activations)
  bool on_gpu_ = false;
  int64_t context_ = 0;
  std::vector<DecodeResult> decode_;
  std::vector<PrefillResult> prefill_;
  std::optional<int64_t> peak_gpu_bytes_;
  std::optional<double> kernels_per_token_;
  engine::MemoryPlan memory_plan_;  // of the single-stream engine
  quant::QMatrix lm_head_;          // the logits matrix as the backend reads it (no data)
};

// "bf16", "w4g32, a lossless 4-bit copy", "w8 quantized at load by --lm-head q8": how the
// backend reads the logits matrix.
std::string Bench::lm_head_description() const {
  const std::string format = quant::weight_format_name(lm_head_.format);
  if (lm_head_.format == model_->weights.lm_head.format) return format;
  return format + (lm_head_.format == quant::WeightFormat::kW4G32
                       ? ", a lossless 4-bit copy"
                       : " quantized at load by --lm-head q8");
}

Status Bench::write_report() const {
  const double bytes_per_token = weight_bytes_per_token(*model_, lm_head_);
  const std::string gpu = on_gpu_ ? cuda_device_name(0) : "none";
  const std::string format = quant::weight_format_name(model_->quantization.weight_format);
  const std::string commit = current_commit();
  // Weights are read once per batched step, whatever the number of streams in it.
  const auto weights_gbs = [&](const DecodeResult& d) {
    return bytes_per_token * d.tok_per_s / d.batch / 1e9;
  };

  std::printf("gemma4 bench: %s\n", path_.string().c_str());
  std::printf("engine: %s   format: %s   gpu: %s   commit: %s   context: %lld\n",
              backend_description_.c_str(), format.c_str(), gpu.c_str(), commit.c_str(),
              static_cast<long long>(context_));
  std::printf("cuda graphs: %s   pdl: %s   activations: %s   kv cache: %s\n",
              args_.engine.no_graphs ? "off" : "on", args_.engine.no_pdl ? "off" : "on",
              activations_.c_str(), engine::kv_type_name(memory_plan_.options.kv_type));
  std::printf("sampling: %s\n", sampling());
  std::printf("weights read per decode step: %.3f GB (%.0f GB/s reference bandwidth)\n",
              bytes_per_token / 1e9, args_.bandwidth_gbs);
  // The logits matrix alone (bf16 in NVFP4 checkpoints: embed_tokens is tied and unquantized)
  // bounds a batch-1 step from below by its read time.
  const double lm_head_bytes =
      weight_bytes_per_token(*model_, lm_head_) - weight_bytes_per_token(*model_, lm_head_, false);
  std::printf(
      "of which the logits matrix (%s): %.3f GB, %.0f%%: %.0f us per step at the "
      "reference bandwidth\n\n",
      lm_head_description().c_str(), lm_head_bytes / 1e9, 100 * lm_head_bytes / bytes_per_token,
      lm_head_bytes / (args_.bandwidth_gbs * 1e3));
  std::printf("%-8s %6s %8s %12s %10s %12s %8s\n", "decode", "batch", "depth", "tok/s", "ms/step",
              "weights GB/s", "% bw");
  for (const auto& d : decode_) {
    std::printf("%-8s %6d %8lld %12.1f %10.3f %12.1f %7.1f%%\n", "", d.batch,
                static_cast<long long>(d.depth), d.tok_per_s, 1e3 * d.batch / d.tok_per_s,
                weights_gbs(d), 100 * weights_gbs(d) / args_.bandwidth_gbs);
  }
  for (const auto& d : decode_) {
    if (!d.step_times || d.step_times->replays == 0) continue;
    const engine::ReplayTimes& t = *d.step_times;
    const double n = static_cast<double>(t.replays);
    const double step_us = 1e6 * d.batch / d.tok_per_s;
    std::printf(
        "step times (batch %d, depth %lld, %lld replays): device idle before the graph %.1f us "
        "(%.1f%% of the step), graph %.1f us, after it %.1f us\n",
        d.batch, static_cast<long long>(d.depth), static_cast<long long>(t.replays), t.idle_us / n,
        100 * t.idle_us / n / step_us, t.replay_us / n, t.tail_us / n);
  }
  std::printf("%-8s %6s %8s %12s %10s\n", "prefill", "", "tokens", "tok/s", "ms");
  for (const auto& p : prefill_) {
    std::printf("%-8s %6s %8lld %12.1f %10.2f\n", "", "", static_cast<long long>(p.tokens),
                p.tok_per_s, 1e3 * p.tokens / p.tok_per_s);
  }
  const auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
  std::printf("\npeak GPU memory: %s   kernels per token: %s\n",
              peak_gpu_bytes_
                  ? fmt::format("{:.0f} MiB (whole device)", mib(*peak_gpu_bytes_)).c_str()
                  : "n/a",
              kernels_per_token_ ? fmt::format("{:.1f}", *kernels_per_token_).c_str() : "n/a");
  std::printf("memory plan (single stream): %s%s\n", memory_plan_.summary().c_str(),
              load_.gpu_memory > 0
                  ? fmt::format(" of {:.0f} MiB (--gpu-memory)", mib(load_.gpu_memory)).c_str()
                  : "");

  if (args_.json_file.empty()) return Status::ok_status();
  nlohmann::ordered_json json;
  json["model"] = args_.model;
  json["format"] = format;
  json["gpu"] = gpu;
  json["commit"] = commit;
  json["engine"] = backend_description_;
  json["context"] = context_;
  json["graphs"] = !args_.engine.no_graphs;
  json["pdl"] = !args_.engine.no_pdl;
  json["activations"] = activations_;
  json["lm_head"] = lm_head_description();
  json["kv_cache"] = engine::kv_type_name(memory_plan_.options.kv_type);
  json["decode"] = nlohmann::ordered_json::array();
  for (const auto& d : decode_) {
    json["decode"].push_back({{"batch", d.batch},
                              {"depth", d.depth},
                              {"tok_per_s", d.tok_per_s},
                              {"weights_gbs", weights_gbs(d)},
                              {"bandwidth_pct", 100 * weights_gbs(d) / args_.bandwidth_gbs}});
    if (d.step_times && d.step_times->replays > 0) {
      const engine::ReplayTimes& t = *d.step_times;
      const double n = static_cast<double>(t.replays);
      json["decode"].back()["step_times_us"] = {{"replays", t.replays},
                                                {"idle_before_graph", t.idle_us / n},
                                                {"graph", t.replay_us / n},
                                                {"after_graph", t.tail_us / n}};
    }
  }
  json["prefill"] = nlohmann::ordered_json::array();
  for (const auto& p : prefill_)
    json["prefill"].push_back({{"tokens", p.tokens}, {"tok_per_s", p.tok_per_s}});
  json["peak_gpu_mib"] =
      peak_gpu_bytes_ ? nlohmann::ordered_json(mib(*peak_gpu_bytes_)) : nlohmann::ordered_json();
  json["kernels_per_token"] =
      kernels_per_token_ ? nlohmann::ordered_json(*kernels_per_token_) : nlohmann::ordered_json();
  json["gpu_memory_budget_mib"] = load_.gpu_memory > 0
                                      ? nlohmann::ordered_json(mib(load_.gpu_memory))
                                      : nlohmann::ordered_json();
  json["memory_plan"] = {{"sequences", memory_plan_.options.max_sequences},
                         {"context", memory_plan_.options.max_context},
                         {"weights_mib", mib(memory_plan_.weight_bytes)},
                         {"kv_mib", mib(memory_plan_.kv_bytes)},
                         {"workspace_mib", mib(memory_plan_.workspace_bytes)},
                         {"scratch_mib", mib(memory_plan_.scratch_bytes)},
                         {"reserve_mib", mib(memory_plan_.reserve_bytes)},
                         {"total_mib", mib(memory_plan_.total())}};
  json["weight_bytes_per_token"] = bytes_per_token;
  json["bandwidth_gbs"] = args_.bandwidth_gbs;
  json["decode_tokens"] = args_.decode_tokens;
  json["sampling"] = sampling();
  std::ofstream out(args_.json_file);
  out << json.dump(2) << '\n';
  if (!out) return make_error(ErrorCode::kIo, "--json: cannot write {}", args_.json_file);
  return Status::ok_status();
}

// Per recorded measurement, the summary on stdout (and its kCostliestLaunches launches of largest
// critical cost); every launch of all of them to the file.
constexpr size_t kCostliestLaunches = 25;

Status Bench::write_timeline() const {
  if (!timeline_) return Status::ok_status();
  GEMMA4_RETURN_IF_ERROR(timeline_->status());
  for (const auto& range : timeline_->ranges()) {
    std::printf("\n== %s ==\n%s", range.label.c_str(),
                format_timeline_summary(summarize_timeline(range.steps)).c_str());
    if (const auto launches = summarize_launches(range.steps); !launches.empty()) {
      std::printf("costliest launches of the step (same graph every step; index in the step):\n%s",
                  format_costliest_launches(launches, kCostliestLaunches).c_str());
    }
  }
  if (const size_t dropped = timeline_->dropped_records(); dropped > 0)
    std::printf("warning: CUPTI dropped %zu records: the timeline misses them\n", dropped);
  std::ofstream out(args_.timeline_file);
  write_timeline_tsv(out, timeline_->ranges());
  if (!out) return make_error(ErrorCode::kIo, "--timeline: cannot write {}", args_.timeline_file);
  std::printf("kernel timeline: %s\n", args_.timeline_file.c_str());
  return Status::ok_status();
}

Status bench(BenchArgs args) {
  if (args.decode_tokens < 1)
    return make_error(ErrorCode::kInvalidArgument, "--decode-tokens must be >= 1");
  if (args.parallel < 1) return make_error(ErrorCode::kInvalidArgument, "--parallel must be >= 1");
  if (args.bandwidth_gbs <= 0)
    return make_error(ErrorCode::kInvalidArgument, "--bandwidth-gbs must be > 0");
  for (int64_t depth : args.depths)
    if (depth < 0) return make_error(ErrorCode::kInvalidArgument, "--depths must be >= 0");
  for (int64_t tokens : args.prefill)
    if (tokens < 1) return make_error(ErrorCode::kInvalidArgument, "--prefill must be >= 1");
  for (int batch : args.batches)
    if (batch < 1) return make_error(ErrorCode::kInvalidArgument, "--batches must be >= 1");
  GEMMA4_ASSIGN_OR_RETURN(EngineLoadOptions load, engine_load_options(args.engine));
  GEMMA4_ASSIGN_OR_RETURN(auto path, resolve_model(args.model));
  GEMMA4_ASSIGN_OR_RETURN(auto model, open_model(path));
  // Started before the engine captures its graphs (CuptiTimeline::start).
  std::unique_ptr<CuptiTimeline> timeline;
  if (!args.timeline_file.empty()) {
    if (load.device == Device::kCpu)
      return make_error(ErrorCode::kInvalidArgument,
                        "--timeline records CUDA kernels, not --device cpu");
    if (args.profile_last.empty()) args.profile_last = {"decode"};
    GEMMA4_ASSIGN_OR_RETURN(timeline, CuptiTimeline::start());
  }
  Bench bench(args, path, std::move(model), load, timeline.get());
  GEMMA4_RETURN_IF_ERROR(bench.run());
  GEMMA4_RETURN_IF_ERROR(bench.write_report());
  return bench.write_timeline();
}

void register_bench(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<BenchArgs>();
  auto* cmd = app.add_subcommand("bench", "Decode, prefill and batched throughput of a model");
  cmd->add_option("-m,--model", args->model, "checkpoint directory, .gguf file or HF repo id")
      ->required();
  add_engine_flags(*cmd, args->engine);
  cmd->add_flag("--no-chain", args->no_chain,
                "decode one step_sampled call per token, the host feeding back a token of its own "
                "(the serving loop's path) instead of Engine::decode_greedy's chained steps, whose "
                "greedy tokens stay on the device and whose next step is enqueued before the "
                "host reads them (for A/B measurements; --timeline implies it)");
  cmd->add_flag("--step-times", args->step_times,
                "CUDA: time the timed decode steps with device events and print, per step, how "
                "long the device sat idle before the step's graph (host work between steps), the "
                "graph and what runs after it");
  cmd->add_option("--depths", args->depths,
                  "batch-1 decode depths, reached by prefill (clipped to the context)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--prefill", args->prefill, "prefill lengths (beyond the context: skipped)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--batches", args->batches,
                  "concurrent decode streams (clipped to --parallel; 1 is the depth series)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--parallel", args->parallel, "most concurrent streams")->capture_default_str();
  cmd->add_option("-c,--ctx-size", args->ctx_size,
                  "context of the single-stream engine (0 = what --depths/--prefill need, "
                  "clipped to the model's)")
      ->capture_default_str();
  cmd->add_option("--decode-tokens", args->decode_tokens, "timed decode steps per measurement")
      ->capture_default_str();
  cmd->add_option("--bandwidth-gbs", args->bandwidth_gbs,
                  "memory read bandwidth the GB/s figures are compared with")
      ->capture_default_str();
  cmd->add_option("--json", args->json_file, "also write the results as JSON to FILE");
  cmd->add_option("--profile-last", args->profile_last, kProfileLastHelp)
      ->type_name("KIND,...")
      ->delimiter(',')
      ->check(CLI::IsMember(kProfiledKinds));
  cmd->add_option("--timeline", args->timeline_file, kTimelineHelp)->type_name("FILE");
  cmd->add_flag("--quick", args->quick,
                "short run: depths 0,4096, prefill 512, batches 1,8, 16 decode tokens (unless "
                "given)");
  cmd->callback([cmd, args, &exit_code] {
    if (args->quick) apply_quick(*args, *cmd);
    if (Status status = bench(*args); !status.ok()) {
      std::fprintf(stderr, "gemma4 bench: %s\n", status.error().message.c_str());
      exit_code = 1;
    }
  });
}

GEMMA4_COMMAND(bench, register_bench);

}  // namespace
}  // namespace gemma4::cli
