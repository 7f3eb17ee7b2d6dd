#include "server/generation.h"

#include <fmt/format.h>

#include <limits>

#include "server/stop_matcher.h"
#include "text/detokenizer.h"

namespace gemma4::server {

using nlohmann::json;

namespace {

json bytes_of(std::string_view text) {
  json bytes = json::array();
  for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
  return bytes;
}

json logprob_entry(const text::Tokenizer& tokenizer, const runtime::SampledToken& token) {
  auto piece = [&](int32_t id) { return tokenizer.decode(std::span<const int32_t>(&id, 1)); };
  const std::string text = piece(token.id);
  json top = json::array();
  for (const auto& [id, logprob] : token.top_logprobs) {
    const std::string alternative = piece(id);
    top.push_back({{"token", alternative}, {"logprob", logprob}, {"bytes", bytes_of(alternative)}});
  }
  return {{"token", text},
          {"logprob", token.logprob},
          {"bytes", bytes_of(text)},
          {"top_logprobs", top}};
}

double per_second(int64_t tokens, double ms) {
  return ms > 0 ? 1000.0 * static_cast<double>(tokens) / ms : 0.0;
}

}  // namespace

json usage_json(const runtime::RequestMetrics& metrics) {
  return {{"prompt_tokens", metrics.prompt_tokens},
          {"completion_tokens", metrics.completion_tokens},
          {"total_tokens", metrics.prompt_tokens + metrics.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", metrics.cached_tokens}}}};
}

json timings_json(const runtime::RequestMetrics& metrics) {
  const int64_t prompt_n = metrics.prompt_tokens - metrics.cached_tokens;
  const int64_t predicted_n = metrics.completion_tokens;
  return {{"cache_n", metrics.cached_tokens},
          {"prompt_n", prompt_n},
          {"prompt_ms", metrics.prompt_ms},
          {"prompt_per_token_ms",
           prompt_n > 0 ? metrics.prompt_ms / static_cast<double>(prompt_n) : 0.0},
          {"prompt_per_second", per_second(prompt_n, metrics.prompt_ms)},
          {"predicted_n", predicted_n},
          {"predicted_ms", metrics.decode_ms},
          {"predicted_per_token_ms",
           predicted_n > 0 ? metrics.decode_ms / static_cast<double>(predicted_n) : 0.0},
          {"predicted_per_second", per_second(predicted_n, metrics.decode_ms)},
          {"queue_ms", metrics.queue_ms}};
}

ToolChoiceControl tool_choice_control(const text::Tokenizer& tokenizer, ToolChoice choice,
                                      const std::string& named_tool) {
  ToolChoiceControl control;
  constexpr std::string_view kCallOpener = "<|tool_call>call:";
  switch (choice) {
    case ToolChoice::kAuto:
      break;
    case ToolChoice::kRequired:
      control.forced_output = kCallOpener;
      break;
    case ToolChoice::kNamed:
      // The name passed the request's check (letters, digits, _ - .): no markup can hide in it.
      control.forced_output = fmt::format("{}{}{{", kCallOpener, named_tool);
      break;
    case ToolChoice::kNone:
      control.tool_calls_allowed = false;
      if (const int32_t opener = tokenizer.token_to_id("<|tool_call>"); opener >= 0) {
        control.banned_token_biases.emplace_back(opener, -std::numeric_limits<float>::infinity());
      }
      break;
  }
  return control;
}

std::variant<std::shared_ptr<GenerationJob>, ApiError> start_generation(
    std::shared_ptr<ServingModel> model, std::vector<int32_t> prompt_ids,
    GenerationSettings settings, bool chat, std::string prompt_text, std::chrono::seconds timeout) {
  const int64_t context = model->scheduler->max_context();
  const auto prompt_tokens = static_cast<int64_t>(prompt_ids.size());
  const int64_t room = context - prompt_tokens;
  if (room <= 0 || (settings.max_tokens && *settings.max_tokens > room)) {
    std::string message = fmt::format(
        "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in "
        "the {}",
        context, prompt_tokens + settings.max_tokens.value_or(0), prompt_tokens,
        chat ? "messages" : "prompt");
    message +=
        settings.max_tokens ? fmt::format(", {} in the completion).", *settings.max_tokens) : ").";
    message += " Please reduce the length of the input or of max_tokens.";
    return ApiError{400, message, "invalid_request_error", chat ? "messages" : "prompt",
                    "context_length_exceeded"};
  }
  runtime::GenerationRequest request;
  request.sampler = std::make_unique<runtime::Sampler>(settings.sampling, prompt_ids);
  request.prompt = std::move(prompt_ids);
  request.max_new_tokens = settings.max_tokens.value_or(room);
  request.stop_tokens = model->stop_tokens;
  if (timeout.count() > 0) request.deadline = runtime::Clock::now() + timeout;
  auto stream = model->scheduler->submit(std::move(request));
  if (!stream.ok()) return api_error_from(stream.error());

  auto job = std::make_shared<GenerationJob>();
  job->chat = chat;
  job->prompt_text = std::move(prompt_text);
  job->settings = std::move(settings);
  job->model = std::move(model);
  job->stream = *stream;
  return job;
}

GenerationResult drive_generation(GenerationJob& job,
                                  const std::function<bool(const OutputDelta&)>& emit,
                                  const std::function<bool()>& client_connected) {
  const text::Tokenizer& tokenizer = job.model->tokenizer;
  text::IncrementalDetokenizer detokenizer(tokenizer);
  StopMatcher stop_matcher(job.settings.stop);
  auto parser =
      text::OutputParser::for_prompt(job.prompt_text, job.model->chat_template.output_format());
  // The forced opener only starts a call: the parser cannot emit anything for it yet.
  if (job.chat && !job.forced_output.empty()) parser.push(job.forced_output);
  bool client_gone = false;
  int tool_calls_sent = 0;
  size_t call_segments_seen = 0;  // transcript position of the last call turned back into text

  // The raw text of the parser's next complete call, for when calls are not allowed.
  auto next_call_text = [&] {
    const auto& transcript = parser.transcript();
    while (call_segments_seen < transcript.size() &&
           transcript[call_segments_seen].kind != text::SegmentKind::kToolCall) {
      ++call_segments_seen;
    }
    if (call_segments_seen == transcript.size()) return std::string();
    return transcript[call_segments_seen++].text;
  };

  // Routes visible text through the parser (chat) and sends the delta.
  auto send = [&](std::string_view text, OutputDelta& delta, bool at_end, bool hit_limit) {
    if (job.chat) {
      text::ParserDelta parsed = parser.push(text);
      if (at_end) {
        text::ParserDelta last = parser.finish(hit_limit);
        parsed.content += last.content;
        parsed.reasoning_content += last.reasoning_content;
        for (auto& call : last.tool_calls) parsed.tool_calls.push_back(std::move(call));
      }
      delta.content = std::move(parsed.content);
      delta.reasoning = std::move(parsed.reasoning_content);
      for (auto& call : parsed.tool_calls) {
        if (!job.tool_calls_allowed) {
          delta.content += next_call_text();
          continue;
        }
        if (!job.parallel_tool_calls && tool_calls_sent > 0) continue;
        ++tool_calls_sent;
        delta.tool_calls.push_back(std::move(call));
      }
    } else {
      delta.content = std::string(text);
    }
    if (!delta.empty() && !client_gone && !emit(delta)) {
      client_gone = true;
      job.stream->cancel();
    }
  };

  constexpr std::chrono::milliseconds kConnectionCheckInterval{100};
  auto last_connection_check = runtime::Clock::now();
  auto check_connection = [&] {
    const auto now = runtime::Clock::now();
    if (!client_connected || client_gone || now - last_connection_check < kConnectionCheckInterval)
      return;
    last_connection_check = now;
    if (!client_connected()) {
      client_gone = true;
      job.stream->cancel();
    }
  };

  GenerationResult result;
  bool stop_string_hit = false;
  while (true) {
    auto event = job.stream->next(client_connected ? kConnectionCheckInterval
                                                   : std::chrono::milliseconds(1000));
    check_connection();
    if (!event) continue;  // the scheduler always ends a request with kFinished
    if (event->kind == runtime::GenerationEvent::Kind::kToken) {
      if (stop_string_hit || client_gone) continue;
      OutputDelta delta;
      if (job.settings.logprobs) delta.logprobs.push_back(logprob_entry(tokenizer, event->token));
      std::string visible = stop_matcher.push(detokenizer.push(event->token.id));
      if (stop_matcher.matched()) {
        stop_string_hit = true;
        job.stream->cancel();  // generation ends here; the finish event follows
      }
      send(visible, delta, false, false);
      continue;
    }
    result.metrics = event->metrics;
    if (event->reason == runtime::FinishReason::kError) {
      result.error = event->error ? api_error_from(*event->error)
                                  : ApiError{500, "generation failed", "server_error", "", ""};
      if (result.error->http_status == 400) result.error->http_status = 500;  // not the client's
      return result;
    }
    result.client_disconnected = client_gone;
    if (client_gone) return result;
    const bool hit_limit = !stop_string_hit && (event->reason == runtime::FinishReason::kLength ||
                                                event->reason == runtime::FinishReason::kDeadline);
    OutputDelta delta;
    std::string tail = stop_string_hit ? std::string() : stop_matcher.push(detokenizer.flush());
    if (!stop_string_hit) tail += stop_matcher.flush();
    send(tail, delta, true, hit_limit);
    if (job.chat) {
      result.finish_reason = parser.message().finish_reason;
      if (!job.tool_calls_allowed && result.finish_reason == "tool_calls")
        result.finish_reason = "stop";
    } else {
      result.finish_reason = hit_limit ? "length" : "stop";
    }
    if (event->reason == runtime::FinishReason::kCancelled && !stop_string_hit) {
      result.finish_reason.clear();  // cancelled by the server shutting down
      result.error = ApiError{503, "the server is shutting down", "unavailable_error", "", ""};
    }
    return result;
  }
}

}  // namespace gemma4::server
