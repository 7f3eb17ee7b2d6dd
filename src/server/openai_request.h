// Parsing and validation of OpenAI-style request bodies into what the generation code needs.
// Every user mistake (wrong type, out-of-range value, unknown field, unknown model, bad tool
// schema, unsupported option) becomes an ApiError with status 400 naming the field.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "runtime/sampler.h"
#include "server/api_error.h"
#include "text/chat_template.h"

namespace gemma4::server {

// Limits on the raw body that a JSON parser should never have to meet.
inline constexpr int kMaxJsonDepth = 64;

// Parses a request body: valid UTF-8 JSON object, nesting at most kMaxJsonDepth.
std::optional<ApiError> parse_json_body(const std::string& body, nlohmann::ordered_json& out);

// Names a request's "model" field may use.
struct ModelNames {
  std::string id;
  std::string alias;
  bool accepts(const std::string& name) const {
    return name == id || (!alias.empty() && name == alias);
  }
};

// Fields shared by /v1/chat/completions and /v1/completions.
struct GenerationSettings {
  runtime::SamplingParams sampling;
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;       // report per-token log-probabilities
};

enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

struct ChatRequest {
  GenerationSettings settings;
  nlohmann::ordered_json messages;
  nlohmann::ordered_json tools;  // null when none are offered (also for tool_choice "none")
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string named_tool;  // for kNamed
  bool parallel_tool_calls = true;
  text::ChatTemplateOptions template_options;
};

struct CompletionRequest {
  GenerationSettings settings;
  std::string prompt_text;          // when the prompt is text
  std::vector<int32_t> prompt_ids;  // when the prompt is token ids
  bool echo = false;
};

std::optional<ApiError> parse_chat_request(const nlohmann::ordered_json& body,
                                           const ModelNames& names, int32_t vocab_size,
                                           ChatRequest& out);
std::optional<ApiError> parse_completion_request(const nlohmann::ordered_json& body,
                                                 const ModelNames& names, int32_t vocab_size,
                                                 CompletionRequest& out);

}  // namespace gemma4::server
