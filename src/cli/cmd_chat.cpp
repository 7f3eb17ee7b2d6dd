// gemma4 chat: a terminal client for a running `gemma4 serve` (or any OpenAI-compatible server):
// streams replies, keeps the multi-turn history, shows thinking dimmed and prints tool calls.
// Commands: /reset (new conversation), /think on|off, /exit.
#include <httplib.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/status.h"

namespace gemma4::cli {
namespace {

using nlohmann::json;

struct ChatArgs {
  std::string url = "http://127.0.0.1:8080";
  std::string api_key;
  std::string model;
  std::string system;
  bool think = false;
  double temperature = 1.0;
  int max_tokens = 2048;
};

// Terminal styling, only when stdout is a terminal.
struct Style {
  bool enabled = isatty(STDOUT_FILENO) != 0;
  const char* dim() const { return enabled ? "\x1b[2m" : ""; }
  const char* bold() const { return enabled ? "\x1b[1m" : ""; }
  const char* reset() const { return enabled ? "\x1b[0m" : ""; }
};

// One streamed reply: prints deltas as they come and collects the assistant message.
class ReplyPrinter {
 public:
  explicit ReplyPrinter(const Style& style) : style_(style) {}

  // Feeds raw SSE bytes; returns false to abort on a malformed stream.
  bool feed(std::string_view bytes) {
    buffer_.append(bytes);
    size_t end;
    while ((end = buffer_.find('\n')) != std::string::npos) {
      std::string line = buffer_.substr(0, end);
      buffer_.erase(0, end + 1);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.rfind("event:", 0) == 0) event_ = line.substr(6);
      if (line.rfind("data:", 0) != 0) continue;
      std::string data = line.substr(5);
      if (data.find_first_not_of(' ') == std::string::npos || data == " [DONE]") continue;
      json chunk = json::parse(data, nullptr, false);
      if (chunk.is_discarded()) return false;
      if (chunk.contains("error")) {
        error_ = chunk["error"].value("message", std::string("unknown error"));
        continue;
      }
      handle(chunk);
    }
    return true;
  }

  // Ends the reply: closes styles, prints tool calls, returns the assistant message.
  json finish() {
    if (in_reasoning_) std::printf("%s\n", style_.reset());
    json message = {{"role", "assistant"}, {"content", content_}};
    if (!calls_.empty()) {
      json calls = json::array();
      for (auto& [index, call] : calls_) {
        std::printf("\n%s[tool call]%s %s(%s)", style_.bold(), style_.reset(),
                    call["function"]["name"].get<std::string>().c_str(),
                    call["function"]["arguments"].get<std::string>().c_str());
        calls.push_back(call);
      }
      message["tool_calls"] = calls;
    }
    if (!finish_reason_.empty() && finish_reason_ == "length")
      std::printf("\n%s[cut off: max tokens]%s", style_.dim(), style_.reset());
    std::printf("\n");
    if (!error_.empty()) std::fprintf(stderr, "error: %s\n", error_.c_str());
    std::fflush(stdout);
    return message;
  }

  bool failed() const { return !error_.empty(); }

 private:
  void handle(const json& chunk) {
    if (!chunk.contains("choices") || !chunk["choices"].is_array() || chunk["choices"].empty())
      return;
    const json& choice = chunk["choices"][0];
    if (choice.contains("finish_reason") && choice["finish_reason"].is_string())
      finish_reason_ = choice["finish_reason"];
    const json& delta = choice.value("delta", json::object());
    if (delta.contains("reasoning_content") && delta["reasoning_content"].is_string()) {
      if (!in_reasoning_) std::printf("%s", style_.dim());
      in_reasoning_ = true;
      std::printf("%s", delta["reasoning_content"].get<std::string>().c_str());
    }
    if (delta.contains("content") && delta["content"].is_string() &&
        !delta["content"].get<std::string>().empty()) {
      if (in_reasoning_) std::printf("%s\n\n", style_.reset());
      in_reasoning_ = false;
      const std::string text = delta["content"];
      content_ += text;
      std::printf("%s", text.c_str());
    }
    if (delta.contains("tool_calls") && delta["tool_calls"].is_array()) {
      for (const auto& call : delta["tool_calls"]) {
        const int index = call.value("index", 0);
        json& slot = calls_[index];
        if (slot.is_null())
          slot = {{"id", call.value("id", "")},
                  {"type", "function"},
                  {"function", {{"name", ""}, {"arguments", ""}}}};
        const json& function = call.value("function", json::object());
        if (function.contains("name") && function["name"].is_string())
          slot["function"]["name"] =
              slot["function"]["name"].get<std::string>() + function["name"].get<std::string>();
        if (function.contains("arguments") && function["arguments"].is_string())
          slot["function"]["arguments"] = slot["function"]["arguments"].get<std::string>() +
                                          function["arguments"].get<std::string>();
      }
    }
    std::fflush(stdout);
  }

  const Style& style_;
  std::string buffer_;
  std::string event_;
  std::string content_;
  std::string error_;
  std::string finish_reason_;
  bool in_reasoning_ = false;
  std::map<int, json> calls_;
};

Status chat(const ChatArgs& args) {
  httplib::Client client(args.url);
  client.set_read_timeout(std::chrono::minutes(10));
  httplib::Headers headers;
  if (!args.api_key.empty()) headers.emplace("Authorization", "Bearer " + args.api_key);

  auto models = client.Get("/v1/models", headers);
  if (!models)
    return make_error(ErrorCode::kIo, "cannot reach {} ({})", args.url,
                      httplib::to_string(models.error()));
  std::string model = args.model;
  if (model.empty()) {
    json list = json::parse(models->body, nullptr, false);
    if (models->status == 200 && !list.is_discarded() && list.contains("data") &&
        list["data"].is_array() && !list["data"].empty()) {
      model = list["data"][0].value("id", "");
    }
  }
  const Style style;
  std::printf("%sgemma4 chat%s with %s at %s. /reset, /think on|off, /exit\n", style.bold(),
              style.reset(), model.empty() ? "(unknown model)" : model.c_str(), args.url.c_str());

  auto fresh_history = [&] {
    json history = json::array();
    if (!args.system.empty()) history.push_back({{"role", "system"}, {"content", args.system}});
    return history;
  };
  json history = fresh_history();
  bool think = args.think;
  std::string line;
  while (true) {
    std::printf("%s> %s", style.bold(), style.reset());
    std::fflush(stdout);
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) continue;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      history = fresh_history();
      std::printf("(new conversation)\n");
      continue;
    }
    if (line == "/think on" || line == "/think off") {
      think = line == "/think on";
      std::printf("(thinking %s)\n", think ? "on" : "off");
      continue;
    }
    history.push_back({{"role", "user"}, {"content", line}});
    json body = {{"messages", history},
                 {"stream", true},
                 {"temperature", args.temperature},
                 {"max_tokens", args.max_tokens},
                 {"chat_template_kwargs", {{"enable_thinking", think}}}};
    if (!model.empty()) body["model"] = model;

    ReplyPrinter printer(style);
    std::string error_body;
    httplib::Request request;
    request.method = "POST";
    request.path = "/v1/chat/completions";
    request.headers = headers;
    request.headers.emplace("Content-Type", "application/json");
    request.body = body.dump();
    int status = 0;
    request.response_handler = [&](const httplib::Response& response) {
      status = response.status;
      return true;
    };
    request.content_receiver = [&](const char* data, size_t length, uint64_t, uint64_t) {
      if (status != 200) {
        error_body.append(data, length);
        return true;
      }
      return printer.feed(std::string_view(data, length));
    };
    auto result = client.send(request);
    if (!result) {
      std::fprintf(stderr, "error: request failed (%s)\n",
                   httplib::to_string(result.error()).c_str());
      history.erase(history.end() - 1);
      continue;
    }
    if (status != 200) {
      json error = json::parse(error_body, nullptr, false);
      std::string message = error_body;
      if (!error.is_discarded() && error.contains("error") && error["error"].is_object())
        message = error["error"].value("message", error_body);
      std::fprintf(stderr, "error (HTTP %d): %s\n", status, message.c_str());
      history.erase(history.end() - 1);
      continue;
    }
    json reply = printer.finish();
    if (printer.failed()) {
      history.erase(history.end() - 1);
      continue;
    }
    history.push_back(reply);
  }
  return Status::ok_status();
}

void register_chat(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<ChatArgs>();
  auto* cmd = app.add_subcommand("chat", "Terminal chat client for a running `gemma4 serve`");
  cmd->add_option("--url", args->url, "server address")->capture_default_str();
  cmd->add_option("--api-key", args->api_key, "bearer key, if the server wants one");
  cmd->add_option("--model", args->model, "model name (default: the server's first model)");
  cmd->add_option("--system", args->system, "system prompt");
  cmd->add_flag("--think", args->think, "start with thinking on");
  cmd->add_option("--temperature", args->temperature)->capture_default_str();
  cmd->add_option("--max-tokens", args->max_tokens)->capture_default_str();
  cmd->callback([args, &exit_code] {
    if (Status status = chat(*args); !status.ok()) {
      std::fprintf(stderr, "gemma4 chat: %s\n", status.error().message.c_str());
      exit_code = 1;
    }
  });
}

GEMMA4_COMMAND(chat, register_chat);

}  // namespace
}  // namespace gemma4::cli
