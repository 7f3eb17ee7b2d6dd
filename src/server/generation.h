// One generation request between the HTTP layer and the scheduler: starts it (prompt checks,
// queue admission) and then drives it to the end, turning token events into OpenAI-shaped output
// deltas: detokenized text, stop sequences, and for chat the content / reasoning / tool-call
// split of the OutputParser.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "runtime/scheduler.h"
#include "server/api_error.h"
#include "server/openai_request.h"
#include "server/serving_model.h"
#include "text/output_parser.h"

namespace gemma4::server {

struct OutputDelta {
  std::string content;  // chat: content; completions: raw text
  std::string reasoning;
  std::vector<text::ToolCall> tool_calls;
  nlohmann::json logprobs = nlohmann::json::array();  // chat-style entries, one per token

  bool empty() const {
    return content.empty() && reasoning.empty() && tool_calls.empty() && logprobs.empty();
  }
};

struct GenerationResult {
  std::string finish_reason;  // "stop", "length", "tool_calls"; "" if the client went away
  bool client_disconnected = false;
  runtime::RequestMetrics metrics;
  std::optional<ApiError> error;
};

// The usage and llama-server-style timings objects of a finished request.
nlohmann::json usage_json(const runtime::RequestMetrics& metrics);
nlohmann::json timings_json(const runtime::RequestMetrics& metrics);

struct GenerationJob {
  bool chat = false;
  std::string prompt_text;  // chat: the rendered prompt (sets the parser's initial state)
  // Chat: output forced at the end of the prompt (see tool_choice_control) that the parser reads
  // as if the model had generated it.
  std::string forced_output;
  GenerationSettings settings;
  bool parallel_tool_calls = true;
  // tool_choice "none": a call the parser still finds is returned as the plain text it was.
  bool tool_calls_allowed = true;
  std::shared_ptr<ServingModel> model;
  std::shared_ptr<runtime::RequestStream> stream;
};

// How tool_choice steers a chat generation. "required" and a named function start the reply
// inside a tool call: the call opener (`<|tool_call>call:`, plus `NAME{` for a named function,
// spec gemma4-chat-format.md section 4) is appended to the prompt as if the model had written
// it, so the model can only continue with the call. "none" bans the `<|tool_call>` token (the
// tools are also left out of the prompt) and never reports a call.
struct ToolChoiceControl {
  std::string forced_output;                                   // appended to the prompt
  std::vector<std::pair<int32_t, float>> banned_token_biases;  // added to the logit bias
  bool tool_calls_allowed = true;
};
ToolChoiceControl tool_choice_control(const text::Tokenizer& tokenizer, ToolChoice choice,
                                      const std::string& named_tool);

// Checks the prompt against the context and submits it. Errors: 400 context_length_exceeded
// (prompt + max_tokens beyond the context), 429 queue full.
std::variant<std::shared_ptr<GenerationJob>, ApiError> start_generation(
    std::shared_ptr<ServingModel> model, std::vector<int32_t> prompt_ids,
    GenerationSettings settings, bool chat, std::string prompt_text, std::chrono::seconds timeout);

// Runs the job to its end. `emit` gets each non-empty delta and returns false once the client
// is gone, which cancels the request (its KV is freed at once). `client_connected`, if given, is
// asked about every 100 ms and cancels the request the same way when it says false: for
// answers that write nothing until the end.
GenerationResult drive_generation(GenerationJob& job,
                                  const std::function<bool(const OutputDelta&)>& emit,
                                  const std::function<bool()>& client_connected = {});

}  // namespace gemma4::server
