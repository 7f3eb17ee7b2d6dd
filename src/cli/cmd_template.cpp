// `gemma4 template`: renders a chat with the Gemma 4 chat template, JSON in on stdin, JSON out,
// for checking a prompt by hand and for the differential test against Python Jinja2
// (tests/text/test_chat_template_diff.py).
//
//   {"messages": [...], "tools": [...] | null, "kwargs": {"add_generation_prompt": true, ...}}
//     -> {"prompt": "...", "variant": "compact" | "full"}
//   --jsonl: one request per input line, one response per output line; a bad line answers
//            {"error": "..."} and the exit status becomes 1.
//
// The variant comes from the checkpoint's chat_template.jinja (--template) or is named
// (--variant compact|full).
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>

#include "cli/command.h"
#include "text/chat_template.h"

namespace gemma4::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

struct TemplateOptions {
  std::string template_path;
  std::string variant;
  bool jsonl = false;
};

Expected<text::ChatTemplate> load_template(const TemplateOptions& options) {
  if (options.template_path.empty() == options.variant.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "give exactly one of --template FILE and --variant compact|full");
  }
  if (!options.variant.empty()) {
    if (options.variant == "compact") {
      return text::ChatTemplate::of_variant(text::ChatTemplate::Variant::kCompact);
    }
    if (options.variant == "full") {
      return text::ChatTemplate::of_variant(text::ChatTemplate::Variant::kFull);
    }
    return make_error(ErrorCode::kInvalidArgument, "--variant must be compact or full, not {}",
                      options.variant);
  }
  std::ifstream file(options.template_path, std::ios::binary);
  if (!file) {
    return make_error(ErrorCode::kIo, "cannot read {}", options.template_path);
  }
  std::stringstream source;
  source << file.rdbuf();
  auto chat_template = text::ChatTemplate::from_template_source(source.str());
  if (!chat_template.ok()) return chat_template.error().with_context(options.template_path);
  return chat_template;
}

Expected<ordered_json> handle_request(const text::ChatTemplate& chat_template,
                                      std::string_view input) {
  ordered_json request = ordered_json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (request.is_discarded()) return make_error(ErrorCode::kInvalidArgument, "invalid JSON");
  if (!request.is_object()) return make_error(ErrorCode::kInvalidArgument, "expected an object");
  for (const auto& [key, value] : request.items()) {
    if (key != "messages" && key != "tools" && key != "kwargs") {
      return make_error(ErrorCode::kInvalidArgument,
                        "unknown key \"{}\" (expected messages, tools, kwargs)", key);
    }
  }
  if (!request.contains("messages")) {
    return make_error(ErrorCode::kInvalidArgument, "missing \"messages\"");
  }
  GEMMA4_ASSIGN_OR_RETURN(const auto options, text::ChatTemplateOptions::from_kwargs(
                                                  request.value("kwargs", ordered_json())));
  GEMMA4_ASSIGN_OR_RETURN(
      std::string prompt,
      chat_template.render(request["messages"], request.value("tools", ordered_json()), options));
  return ordered_json{{"prompt", std::move(prompt)},
                      {"variant", text::chat_template_variant_name(chat_template.variant())}};
}

std::string dump(const ordered_json& value) {
  return value.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

int run_template(const TemplateOptions& options) {
  auto chat_template = load_template(options);
  if (!chat_template.ok()) {
    std::cerr << "gemma4 template: " << chat_template.error().to_string() << "\n";
    return 1;
  }
  std::ios::sync_with_stdio(false);
  if (!options.jsonl) {
    const std::string input{std::istreambuf_iterator<char>(std::cin), {}};
    auto response = handle_request(*chat_template, input);
    if (!response.ok()) {
      std::cerr << "gemma4 template: " << response.error().to_string() << "\n";
      return 1;
    }
    std::cout << dump(*response) << "\n";
    return 0;
  }
  int exit_code = 0;
  std::string line;
  for (size_t line_number = 1; std::getline(std::cin, line); ++line_number) {
    auto response = handle_request(*chat_template, line);
    if (response.ok()) {
      std::cout << dump(*response) << "\n";
    } else {
      const std::string message =
          fmt::format("line {}: {}", line_number, response.error().to_string());
      std::cout << dump(ordered_json{{"error", message}}) << "\n";
      exit_code = 1;
    }
  }
  std::cout.flush();
  return exit_code;
}

void register_template(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<TemplateOptions>();
  CLI::App* command = app.add_subcommand(
      "template",
      "Render a chat with the Gemma 4 chat template. Reads JSON on stdin: {\"messages\": [...], "
      "\"tools\": [...], \"kwargs\": {\"add_generation_prompt\": true, \"enable_thinking\": "
      "false}} -> {\"prompt\": ...}");
  command->add_option("--template", options->template_path,
                      "the checkpoint's chat_template.jinja (picks the variant)");
  command->add_option("--variant", options->variant, "compact (E2B/E4B) or full (12B/26B/31B)");
  command->add_flag("--jsonl", options->jsonl,
                    "one JSON request per input line, one response per output line");
  command->callback([options, &exit_code] { exit_code = run_template(*options); });
}

}  // namespace

GEMMA4_COMMAND(template, register_template);

}  // namespace gemma4::cli
