// `gemma4 parse`: turns raw generated text into an OpenAI assistant message with the Gemma 4
// output parser, JSON in on stdin, JSON out.
//
//   {"prompt_tail": "...", "raw_output": "..." [, "token_limit_reached": false]}
//     -> {"content", "reasoning_content", "tool_calls": [{id, type, function: {name, arguments}}],
//         "finish_reason"}
//
// raw_output is the detokenized text with special tokens kept (`<|tool_call>`, `<turn|>`, ...);
// token_limit_reached says the generation stopped at max_tokens (finish_reason "length").
// --chunk N feeds the text to the streaming parser N bytes at a time (same result by design).
#include <nlohmann/json.hpp>

#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "cli/command.h"
#include "core/status.h"
#include "text/output_parser.h"

namespace gemma4::cli {
namespace {

using json = nlohmann::json;

struct ParseOptions {
  size_t chunk_bytes = 0;  // 0: all at once
};

Expected<std::string> string_field(const json& request, const char* key) {
  if (!request.contains(key) || !request[key].is_string()) {
    return make_error(ErrorCode::kInvalidArgument, "\"{}\" must be a string", key);
  }
  return request[key].get<std::string>();
}

Expected<json> handle_request(std::string_view input, const ParseOptions& options) {
  const json request = json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (request.is_discarded()) return make_error(ErrorCode::kInvalidArgument, "invalid JSON");
  if (!request.is_object()) return make_error(ErrorCode::kInvalidArgument, "expected an object");
  for (const auto& [key, value] : request.items()) {
    if (key != "prompt_tail" && key != "raw_output" && key != "token_limit_reached") {
      return make_error(
          ErrorCode::kInvalidArgument,
          "unknown key \"{}\" (expected prompt_tail, raw_output, token_limit_reached)", key);
    }
  }
  GEMMA4_ASSIGN_OR_RETURN(const std::string prompt_tail, string_field(request, "prompt_tail"));
  GEMMA4_ASSIGN_OR_RETURN(const std::string raw_output, string_field(request, "raw_output"));
  auto parser = text::OutputParser::for_prompt(prompt_tail);
  const size_t chunk = options.chunk_bytes == 0 ? raw_output.size() : options.chunk_bytes;
  for (size_t pos = 0; pos < raw_output.size(); pos += chunk) {
    parser.push(std::string_view(raw_output).substr(pos, chunk));
  }
  const json limit = request.value("token_limit_reached", json(false));
  if (!limit.is_boolean()) {
    return make_error(ErrorCode::kInvalidArgument, "\"token_limit_reached\" must be true or false");
  }
  parser.finish(limit.get<bool>());
  const text::ParsedMessage& message = parser.message();
  json response = message.to_json();
  response.erase("role");
  response["tool_calls"] = json::array();
  for (const text::ToolCall& call : message.tool_calls) {
    json entry = call.to_json();
    entry.erase("index");
    response["tool_calls"].push_back(std::move(entry));
  }
  response["finish_reason"] = message.finish_reason;
  return response;
}

int run_parse(const ParseOptions& options) {
  std::ios::sync_with_stdio(false);
  const std::string input{std::istreambuf_iterator<char>(std::cin), {}};
  auto response = handle_request(input, options);
  if (!response.ok()) {
    std::cerr << "gemma4 parse: " << response.error().to_string() << "\n";
    return 1;
  }
  std::cout << response->dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  return 0;
}

void register_parse(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<ParseOptions>();
  CLI::App* command = app.add_subcommand(
      "parse",
      "Parse generated Gemma 4 text into content / reasoning_content / tool_calls. Reads JSON on "
      "stdin: {\"prompt_tail\": ..., \"raw_output\": ...}");
  command->add_option("--chunk", options->chunk_bytes,
                      "feed the streaming parser this many bytes at a time (default: all)");
  command->callback([options, &exit_code] { exit_code = run_parse(*options); });
}

}  // namespace

GEMMA4_COMMAND(parse, register_parse);

}  // namespace gemma4::cli
