// gemma4 run -m DIR --prompt-ids 2,100,200 -n 16 [--temperature T --seed S ...]: generates
// from one prompt (on --device auto|cpu|cuda) and prints the generated ids as one
// comma-separated line. With a text prompt (-p TEXT [--think | --raw] or --messages FILE,
// run_prompt.h) it prints the generated text instead. --dump-logits FILE writes the logits every
// step returned (float32 .npy, one row per step) for comparison against a reference;
// --router-trace FILE (MoE models, debugging) writes every layer's router logits and picks
// (tools/reference/router_trace.py reads them).
#include <algorithm>
#include <climits>
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/engine_flags.h"
#include "cli/model_loader.h"
#include "cli/run_prompt.h"
#include "runtime/sampler.h"

namespace gemma4::cli {
namespace {

Expected<std::vector<int32_t>> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    size_t used = 0;
    long long value = -1;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || value < 0 || value > INT32_MAX)
      return make_error(ErrorCode::kInvalidArgument, "--prompt-ids: '{}' is not a token id", item);
    ids.push_back(static_cast<int32_t>(value));
  }
  if (ids.empty()) return make_error(ErrorCode::kInvalidArgument, "--prompt-ids is empty");
  return ids;
}

// A float32 .npy file of rows of `width`, written as they come. The header has a fixed size and
// is rewritten with the final row count by finish().
class NpyRowWriter {
 public:
  // `flag` names the option the file was asked for, in error messages.
  static Expected<NpyRowWriter> create(const std::string& flag, const std::string& path,
                                       int64_t width) {
    std::FILE* file = std::fopen(path.c_str(), "wb");
    if (!file) return make_error(ErrorCode::kIo, "{}: cannot create {}", flag, path);
    NpyRowWriter writer(file, flag, path, width);
    GEMMA4_RETURN_IF_ERROR(writer.write_header());
    return writer;
  }

  Status append(std::span<const float> row) {
    if (std::fwrite(row.data(), sizeof(float), row.size(), file_.get()) != row.size())
      return make_error(ErrorCode::kIo, "{}: writing {} failed", flag_, path_);
    ++rows_;
    return Status::ok_status();
  }

  Status finish() {
    if (std::fseek(file_.get(), 0, SEEK_SET) != 0)
      return make_error(ErrorCode::kIo, "{}: cannot rewrite {}", flag_, path_);
    GEMMA4_RETURN_IF_ERROR(write_header());
    if (std::fclose(file_.release()) != 0)
      return make_error(ErrorCode::kIo, "{}: closing {} failed", flag_, path_);
    return Status::ok_status();
  }

 private:
  // Magic, version 1.0, header length, header: 128 bytes in all keeps the data 64-byte aligned.
  static constexpr size_t kHeaderBytes = 128;

  NpyRowWriter(std::FILE* file, std::string flag, std::string path, int64_t width)
      : file_(file, &std::fclose), flag_(std::move(flag)), path_(std::move(path)), width_(width) {}

  Status write_header() {
    std::string dict = fmt::format(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}", rows_, width_);
    const size_t dict_bytes = kHeaderBytes - 10;
    dict.resize(dict_bytes - 1, ' ');
    dict += '\n';
    std::string header = "\x93NUMPY";
    header += '\x01';
    header += '\x00';
    header += static_cast<char>(dict_bytes & 0xff);
    header += static_cast<char>(dict_bytes >> 8);
    header += dict;
    if (std::fwrite(header.data(), 1, header.size(), file_.get()) != header.size())
      return make_error(ErrorCode::kIo, "{}: writing {} failed", flag_, path_);
    return Status::ok_status();
  }

  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_;
  std::string flag_;
  std::string path_;
  int64_t width_ = 0;
  int64_t rows_ = 0;
};

struct RunArgs {
  std::string model;
  TextPromptOptions text;
  bool print_ids = false;
  std::string prompt_ids;
  int max_tokens = 16;
  bool ignore_eos = false;
  EngineFlags engine;
  int prompt_chunk = 0;
  std::string dump_logits;
  std::string router_trace;
  runtime::SamplingParams sampling;
};

// --router-trace: one float32 row per (forward pass, MoE layer, token) of [layer, position,
// num_experts router logits, top_k expert ids, top_k routing weights] (ids and positions are
// exact in float32), in the order the engine computed them.
class RouterTraceFile {
 public:
  static Expected<std::unique_ptr<RouterTraceFile>> create(const std::string& path,
                                                           const model::ModelConfig& config) {
    if (!config.moe)
      return make_error(ErrorCode::kInvalidArgument, "--router-trace: the model has no experts");
    const auto& p = config.moe_params;
    GEMMA4_ASSIGN_OR_RETURN(
        auto writer,
        NpyRowWriter::create("--router-trace", path, 2 + p.num_experts + 2 * int64_t{p.top_k}));
    return std::unique_ptr<RouterTraceFile>(new RouterTraceFile(std::move(writer)));
  }

  void append(const engine::RouterTrace& trace) {
    std::vector<float> row;
    for (size_t r = 0; r < trace.positions.size() && status_.ok(); ++r) {
      row.assign({static_cast<float>(trace.layer), static_cast<float>(trace.positions[r])});
      const auto logits = trace.logits.subspan(r * trace.num_experts, trace.num_experts);
      row.insert(row.end(), logits.begin(), logits.end());
      for (const int32_t id : trace.expert_ids.subspan(r * trace.top_k, trace.top_k))
        row.push_back(static_cast<float>(id));
      const auto weights = trace.weights.subspan(r * trace.top_k, trace.top_k);
      row.insert(row.end(), weights.begin(), weights.end());
      status_ = writer_.append(row);
    }
  }

  // The first write error, else the file completed.
  Status finish() {
    GEMMA4_RETURN_IF_ERROR(status_);
    return writer_.finish();
  }

 private:
  explicit RouterTraceFile(NpyRowWriter writer) : writer_(std::move(writer)) {}
  NpyRowWriter writer_;
  Status status_ = Status::ok_status();
};

Status run(const RunArgs& args) {
  if (args.text.given() == !args.prompt_ids.empty())
    return make_error(ErrorCode::kInvalidArgument,
                      "give the prompt as text (-p TEXT or --messages FILE) or as --prompt-ids "
                      "2,100,...");
  if (args.max_tokens < 0) return make_error(ErrorCode::kInvalidArgument, "-n must be >= 0");
  if (args.prompt_chunk < 0)
    return make_error(ErrorCode::kInvalidArgument, "--prompt-chunk must be >= 0");
  GEMMA4_ASSIGN_OR_RETURN(EngineLoadOptions load, engine_load_options(args.engine));
  GEMMA4_ASSIGN_OR_RETURN(auto path, resolve_model(args.model));
  // The model is opened first so that a text prompt's stop ids include its eos ids; the engine
  // is sized for the prompt afterwards.
  GEMMA4_ASSIGN_OR_RETURN(auto model, open_model(path));
  const model::ModelConfig& config = model->config;
  std::optional<TextPromptRun> text_run;
  std::vector<int32_t> prompt;
  if (args.text.given()) {
    GEMMA4_ASSIGN_OR_RETURN(text_run, TextPromptRun::open(path, args.text, config.eos_token_ids));
    prompt = text_run->prompt_ids();
  } else {
    GEMMA4_ASSIGN_OR_RETURN(prompt, parse_ids(args.prompt_ids));
  }
  GEMMA4_RETURN_IF_ERROR(args.sampling.validate(config.vocab_size));

  std::unique_ptr<RouterTraceFile> router_trace;
  if (!args.router_trace.empty()) {
    GEMMA4_ASSIGN_OR_RETURN(router_trace, RouterTraceFile::create(args.router_trace, config));
    load.engine.router_trace = [trace = router_trace.get()](const engine::RouterTrace& t) {
      trace->append(t);
    };
  }
  load.engine.max_sequences = 1;
  load.engine.max_context = static_cast<int64_t>(prompt.size()) + args.max_tokens;
  GEMMA4_ASSIGN_OR_RETURN(auto loaded, create_engine(path, model, load));
  auto& engine = *loaded.engine;
  if (engine.max_context() < load.engine.max_context && load.gpu_memory > 0)
    return make_error(ErrorCode::kResourceExhausted,
                      "--gpu-memory {}: the prompt and -n need {} tokens of context, {} fit",
                      args.engine.gpu_memory, load.engine.max_context, engine.max_context());
  std::optional<NpyRowWriter> dump;
  if (!args.dump_logits.empty()) {
    GEMMA4_ASSIGN_OR_RETURN(
        dump, NpyRowWriter::create("--dump-logits", args.dump_logits, engine.vocab_size()));
  }
  GEMMA4_ASSIGN_OR_RETURN(auto sequence, engine.open_sequence());
  runtime::Sampler sampler(args.sampling, prompt);
  std::vector<float> logits(engine.vocab_size());
  engine::LogitSummary summary;
  // Only the dump, or a sampler that needs the whole row, copies the row of logits to the host;
  // otherwise the engine returns the sampler's candidates (engine.h: step_sampled).
  const auto step = [&](std::span<const int32_t> tokens, engine::LogitRequest request) -> Status {
    const engine::StepInput input{sequence, tokens};
    if (dump) request = {};
    GEMMA4_RETURN_IF_ERROR(engine.step_sampled({&input, 1}, {&request, 1}, {&summary, 1}, logits));
    return dump ? dump->append(logits) : Status::ok_status();
  };
  // Every prompt chunk but the last only fills the cache (and the dump).
  const engine::LogitRequest fill_only{1, {}};
  const size_t chunk = args.prompt_chunk > 0 ? args.prompt_chunk : prompt.size();
  std::span<const int32_t> rest = prompt;
  while (rest.size() > chunk) {
    GEMMA4_RETURN_IF_ERROR(step(rest.first(chunk), fill_only));
    rest = rest.subspan(chunk);
  }
  std::vector<int32_t> next(rest.begin(), rest.end());
  std::string line;
  for (int i = 0; i < args.max_tokens; ++i) {
    const engine::LogitRequest request =
        dump ? engine::LogitRequest{} : sampler.logit_request(engine.vocab_size());
    GEMMA4_RETURN_IF_ERROR(step(next, request));
    const int32_t token =
        request.candidates == 0 ? sampler.sample(logits).id : sampler.sample(summary).id;
    line += (line.empty() ? "" : ",") + std::to_string(token);
    next.assign(1, token);
    if (text_run) text_run->print_token(token);
    const auto& eos = config.eos_token_ids;
    const bool stop =
        text_run ? text_run->is_stop(token) : std::find(eos.begin(), eos.end(), token) != eos.end();
    if (!args.ignore_eos && stop) break;
  }
  if (dump) GEMMA4_RETURN_IF_ERROR(dump->finish());
  if (router_trace) GEMMA4_RETURN_IF_ERROR(router_trace->finish());
  if (!text_run) {
    std::printf("%s\n", line.c_str());
    return Status::ok_status();
  }
  text_run->finish();
  if (args.print_ids) {
    std::string prompt_line;
    for (const int32_t id : prompt)
      prompt_line += (prompt_line.empty() ? "" : ",") + std::to_string(id);
    std::fprintf(stderr, "prompt ids: %s\ngenerated ids: %s\n", prompt_line.c_str(), line.c_str());
  }
  return Status::ok_status();
}

void register_run(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<RunArgs>();
  auto* cmd = app.add_subcommand("run", "Generate from one prompt");
  cmd->add_option("-m,--model", args->model,
                  "checkpoint directory, .gguf file or HF repo id (default: $GEMMA4_MODEL, else "
                  "the demo model of scripts/setup)");
  add_engine_flags(*cmd, args->engine);
  cmd->add_option("-p,--prompt", args->text.prompt,
                  "text prompt: one user message, rendered with the checkpoint's chat template");
  cmd->add_option("--messages", args->text.messages_file,
                  "JSON file of OpenAI chat messages (or {\"messages\", \"tools\"}) as the prompt");
  cmd->add_flag("--think", args->text.think, "chat prompt with thinking enabled");
  cmd->add_flag("--raw", args->text.raw, "-p is the prompt text itself (after <bos>), no template");
  cmd->add_flag("--print-ids", args->print_ids,
                "text prompts: also print the prompt and generated ids to stderr");
  cmd->add_option("--prompt-ids", args->prompt_ids, "prompt token ids, comma-separated");
  cmd->add_option("-n,--max-tokens", args->max_tokens, "tokens to generate");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "keep generating after an end-of-sequence token");
  cmd->add_option("--prompt-chunk", args->prompt_chunk,
                  "prefill the prompt N tokens per step (0 = all at once; 1 = logits at every "
                  "position with --dump-logits)");
  cmd->add_option("--dump-logits", args->dump_logits,
                  "write every step's last-token logits to FILE (float32 .npy, one row per step)");
  cmd->add_option("--router-trace", args->router_trace,
                  "MoE models, debugging: write every layer's router logits, expert ids and "
                  "weights per token to FILE (float32 .npy rows [layer, position, logits, ids, "
                  "weights]; decode runs without graphs)");
  auto& s = args->sampling;
  cmd->add_option("--temperature", s.temperature, "0 = greedy");
  cmd->add_option("--top-k", s.top_k, "0 = off");
  cmd->add_option("--top-p", s.top_p, "1 = off");
  cmd->add_option("--min-p", s.min_p, "0 = off");
  cmd->add_option("--repetition-penalty", s.repetition_penalty, "1 = off");
  cmd->add_option("--presence-penalty", s.presence_penalty);
  cmd->add_option("--frequency-penalty", s.frequency_penalty);
  cmd->add_option("--seed", s.seed, "sampling seed");
  cmd->callback([args, &exit_code] {
    if (Status status = run(*args); !status.ok()) {
      std::fprintf(stderr, "gemma4 run: %s\n", status.error().message.c_str());
      exit_code = 1;
    }
  });
}

GEMMA4_COMMAND(run, register_run);

}  // namespace
}  // namespace gemma4::cli
