// gemma4 run -m DIR --prompt-ids 2,100,200 -n 16 [--temperature T --seed S ...]: generates
// from one prompt on the float32 CPU reference engine and prints the generated ids as one
// comma-separated line. With a text prompt (-p TEXT [--think | --raw] or --messages FILE,
// run_prompt.h) it prints the generated text instead.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "cli/command.h"
#include "cli/run_prompt.h"
#include "engine/gemma4_engine.h"
#include "model/weights.h"
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

struct RunArgs {
  std::string model;
  TextPromptOptions text;
  bool print_ids = false;
  std::string prompt_ids;
  int max_tokens = 16;
  bool ignore_eos = false;
  int threads = 0;
  runtime::SamplingParams sampling;
};

Status run(const RunArgs& args) {
  if (args.text.given() == !args.prompt_ids.empty())
    return make_error(ErrorCode::kInvalidArgument,
                      "give the prompt as text (-p TEXT or --messages FILE) or as --prompt-ids "
                      "2,100,...");
  if (args.max_tokens < 0) return make_error(ErrorCode::kInvalidArgument, "-n must be >= 0");
  GEMMA4_ASSIGN_OR_RETURN(auto loaded, model::LoadedModel::open(args.model));
  std::optional<TextPromptRun> text_run;
  std::vector<int32_t> prompt;
  if (args.text.given()) {
    GEMMA4_ASSIGN_OR_RETURN(
        text_run, TextPromptRun::open(args.model, args.text, loaded.config.eos_token_ids));
    prompt = text_run->prompt_ids();
  } else {
    GEMMA4_ASSIGN_OR_RETURN(prompt, parse_ids(args.prompt_ids));
  }
  GEMMA4_RETURN_IF_ERROR(args.sampling.validate(loaded.config.vocab_size));

  engine::EngineOptions options;
  options.max_sequences = 1;
  options.max_context = static_cast<int64_t>(prompt.size()) + args.max_tokens;
  GEMMA4_ASSIGN_OR_RETURN(auto engine,
                          engine::Gemma4Engine::create(
                              loaded.config, loaded.weights,
                              std::make_unique<backend::cpu::CpuBackend>(args.threads), options));
  GEMMA4_ASSIGN_OR_RETURN(auto sequence, engine->open_sequence());
  runtime::Sampler sampler(args.sampling, prompt);
  std::vector<float> logits(engine->vocab_size());
  std::vector<int32_t> next = prompt;
  std::string line;
  for (int i = 0; i < args.max_tokens; ++i) {
    const engine::StepInput input{sequence, next};
    GEMMA4_RETURN_IF_ERROR(engine->step({&input, 1}, logits));
    const int32_t token = sampler.sample(logits).id;
    line += (line.empty() ? "" : ",") + std::to_string(token);
    next.assign(1, token);
    if (text_run) text_run->print_token(token);
    const auto& eos = loaded.config.eos_token_ids;
    const bool stop =
        text_run ? text_run->is_stop(token) : std::find(eos.begin(), eos.end(), token) != eos.end();
    if (!args.ignore_eos && stop) break;
  }
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
  auto* cmd = app.add_subcommand("run", "Generate from one prompt on the CPU reference engine");
  cmd->add_option("-m,--model", args->model, "checkpoint directory")->required();
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
  cmd->add_option("--threads", args->threads, "CPU threads (0 = all)");
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
