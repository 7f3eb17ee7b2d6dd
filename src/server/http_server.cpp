#include "server/http_server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include "server/connection_probe.h"
#include "server/generation.h"
#include "server/openai_request.h"
#include "server/web_ui.h"

namespace gemma4::server {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

std::string dump(const json& value) {
  // Generated text is valid UTF-8 by construction; `replace` keeps a bug from becoming a crash.
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

void send_error(httplib::Response& res, const ApiError& error) {
  if (error.http_status == 429) res.set_header("Retry-After", "1");
  send_json(res, error.http_status, error.to_json());
}

std::string sse(const json& data) {
  return "data: " + dump(data) + "\n\n";
}
std::string sse_error(const ApiError& error) {
  return "event: error\ndata: " + dump(error.to_json()) + "\n\n";
}

std::string random_id(std::string_view prefix) {
  static const char kAlphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id(prefix);
  for (int i = 0; i < 24; ++i) id += kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return id;
}

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Whether the model's chat format can express tool calls (and thinking): Gemma 4's can,
// Gemma 3's cannot.
bool has_tool_syntax(const ServingModel& model) {
  return model.chat_template.output_format() == text::OutputFormat::kGemma4;
}

bool needs_auth(const std::string& path) {
  return path.starts_with("/v1/") || path == "/tokenize" || path == "/detokenize";
}

json tool_call_json(const text::ToolCall& call, bool with_index) {
  json out = call.to_json();
  if (!with_index) out.erase("index");
  return out;
}

// Chat logprobs entries → the legacy completions shape.
json completion_logprobs(const json& entries, size_t text_offset) {
  json out = {{"tokens", json::array()},
              {"token_logprobs", json::array()},
              {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
  for (const auto& entry : entries) {
    out["tokens"].push_back(entry["token"]);
    out["token_logprobs"].push_back(entry["logprob"]);
    json top = json::object();
    for (const auto& alternative : entry["top_logprobs"])
      top[alternative["token"].get<std::string>()] = alternative["logprob"];
    out["top_logprobs"].push_back(top);
    out["text_offset"].push_back(text_offset);
    text_offset += entry["token"].get_ref<const std::string&>().size();
  }
  return out;
}

// Accumulates a non-streamed chat answer.
struct ChatAccumulator {
  std::string content;
  std::string reasoning;
  json tool_calls = json::array();
  json logprobs = json::array();

  bool add(const OutputDelta& delta) {
    content += delta.content;
    reasoning += delta.reasoning;
    for (const auto& call : delta.tool_calls) tool_calls.push_back(tool_call_json(call, false));
    for (const auto& entry : delta.logprobs) logprobs.push_back(entry);
    return true;
  }
};

}  // namespace

struct HttpServer::Routes {
  HttpServer& self;

  ModelNames names(const ServingModel& model) const { return {model.id, self.options_.alias}; }

  // For answers sent whole at the end: asks the request's socket whether the client is still
  // there (a stream finds out from its failing writes instead).
  static std::function<bool()> connected(const httplib::Request& req) {
    auto probe = ConnectionProbe::find(req.remote_addr, req.remote_port, req.local_port);
    if (!probe.found()) return {};
    return [probe] { return !probe.peer_closed(); };
  }

  // The model, or an answer saying why there is none yet.
  std::shared_ptr<ServingModel> require_model(httplib::Response& res) const {
    auto model = self.model();
    if (model) return model;
    std::lock_guard lock(self.model_mutex_);
    send_error(res,
               ApiError{503,
                        self.load_error_.empty() ? "the model is still loading"
                                                 : "the model failed to load: " + self.load_error_,
                        "unavailable_error", "", "model_loading"});
    return nullptr;
  }

  void health(httplib::Response& res) const {
    if (self.model()) return send_json(res, 200, {{"status", "ok"}});
    std::lock_guard lock(self.model_mutex_);
    if (!self.load_error_.empty())
      return send_json(res, 503, {{"status", "error"}, {"error", self.load_error_}});
    send_json(res, 503, {{"status", "loading"}});
  }

  void models(httplib::Response& res) const {
    auto model = self.model();
    json entry = {{"object", "model"}, {"created", unix_seconds()}, {"owned_by", "gemma4"}};
    if (model) {
      const int64_t context = model->scheduler->max_context();
      entry.update({{"id", model->id},
                    {"status", "ready"},
                    {"context_length", context},
                    {"max_model_len", context},
                    {"synthetic", model->synthetic},
                    {"description", model->description},
                    {"capabilities", has_tool_syntax(*model)
                                         ? json{"chat", "completion", "tools", "reasoning"}
                                         : json{"chat", "completion"}}});
    } else {
      entry.update({{"id", self.options_.model_id}, {"status", "loading"}});
    }
    json data = json::array({entry});
    if (!self.options_.alias.empty() && model && self.options_.alias != model->id) {
      json alias = entry;
      alias["id"] = self.options_.alias;
      data.push_back(alias);
    }
    send_json(res, 200, {{"object", "list"}, {"data", data}});
  }

  void tokenize(const httplib::Request& req, httplib::Response& res) const {
    auto model = require_model(res);
    if (!model) return;
    ordered_json body;
    if (auto error = parse_json_body(req.body, body)) return send_error(res, *error);
    auto content = body.find("content");
    if (content == body.end() || !content->is_string())
      return send_error(res, invalid_request("'content' must be a string", "content"));
    for (const char* flag : {"add_special", "parse_special", "with_pieces"}) {
      if (body.contains(flag) && !body[flag].is_boolean())
        return send_error(res, invalid_request(fmt::format("'{}' must be a boolean", flag), flag));
    }
    std::vector<int32_t> ids =
        model->tokenizer.encode(content->get<std::string>(), body.value("parse_special", true));
    if (body.value("add_special", false) && model->bos_token >= 0)
      ids.insert(ids.begin(), model->bos_token);
    json tokens = json::array();
    for (int32_t id : ids) {
      if (body.value("with_pieces", false)) {
        tokens.push_back(
            {{"id", id}, {"piece", model->tokenizer.decode(std::span<const int32_t>(&id, 1))}});
      } else {
        tokens.push_back(id);
      }
    }
    send_json(res, 200, {{"tokens", tokens}});
  }

  void detokenize(const httplib::Request& req, httplib::Response& res) const {
    auto model = require_model(res);
    if (!model) return;
    ordered_json body;
    if (auto error = parse_json_body(req.body, body)) return send_error(res, *error);
    auto tokens = body.find("tokens");
    if (tokens == body.end() || !tokens->is_array())
      return send_error(res, invalid_request("'tokens' must be an array of token ids", "tokens"));
    std::vector<int32_t> ids;
    for (const auto& id : *tokens) {
      if (!id.is_number_integer() || !model->tokenizer.has_id(static_cast<int32_t>(
                                         std::clamp<int64_t>(id.get<int64_t>(), -1, INT32_MAX)))) {
        return send_error(res, invalid_request(fmt::format("'tokens' must hold token ids below {}",
                                                           model->tokenizer.vocab_size()),
                                               "tokens"));
      }
      ids.push_back(id.get<int32_t>());
    }
    send_json(res, 200, {{"content", model->tokenizer.decode(ids)}});
  }

  void chat_completions(const httplib::Request& req, httplib::Response& res) {
    auto model = require_model(res);
    if (!model) return;
    ordered_json body;
    if (auto error = parse_json_body(req.body, body)) return send_error(res, *error);
    ChatRequest request;
    if (auto error =
            parse_chat_request(body, names(*model), model->scheduler->vocab_size(), request)) {
      return send_error(res, *error);
    }
    if (!has_tool_syntax(*model) && (request.tool_choice == ToolChoice::kRequired ||
                                     request.tool_choice == ToolChoice::kNamed)) {
      // The chat format has no tool-call syntax (Gemma 3): a forced call cannot be honoured.
      return send_error(res, invalid_request(fmt::format("model '{}' has no tool-call syntax: "
                                                         "tool_choice must be \"auto\" or \"none\"",
                                                         model->id),
                                             "tool_choice"));
    }
    auto prompt = model->chat_template.render_with_spans(request.messages, request.tools,
                                                         request.template_options);
    if (!prompt.ok()) return send_error(res, invalid_request(prompt.error().message, "messages"));
    // Control tokens come only from the template: caller text that looks like one stays text.
    std::vector<int32_t> ids = model->tokenizer.encode_protected(prompt->text, prompt->untrusted);
    ToolChoiceControl tool_control =
        tool_choice_control(model->tokenizer, request.tool_choice, request.named_tool);
    if (!tool_control.forced_output.empty()) {
      const auto forced = model->tokenizer.encode(tool_control.forced_output, true);
      ids.insert(ids.end(), forced.begin(), forced.end());
    }
    auto& bias = request.settings.sampling.logit_bias;
    bias.insert(bias.end(), tool_control.banned_token_biases.begin(),
                tool_control.banned_token_biases.end());
    const bool stream = request.settings.stream;
    const bool include_usage = request.settings.include_usage;
    const bool logprobs = request.settings.logprobs;
    auto started = start_generation(model, std::move(ids), std::move(request.settings), true,
                                    std::move(prompt->text), self.options_.request_timeout);
    if (auto* error = std::get_if<ApiError>(&started)) return send_error(res, *error);
    auto job = std::get<std::shared_ptr<GenerationJob>>(started);
    job->parallel_tool_calls = request.parallel_tool_calls;
    job->forced_output = std::move(tool_control.forced_output);
    job->tool_calls_allowed = tool_control.tool_calls_allowed;
    const std::string id = random_id("chatcmpl-");
    const int64_t created = unix_seconds();

    if (!stream) {
      ChatAccumulator answer;
      GenerationResult result = drive_generation(
          *job, [&](const OutputDelta& delta) { return answer.add(delta); }, connected(req));
      self.metrics_.record_generation(result.metrics, result.client_disconnected);
      if (result.error) return send_error(res, *result.error);
      json message = {
          {"role", "assistant"},
          {"content",
           answer.content.empty() && !answer.tool_calls.empty() ? json() : json(answer.content)}};
      if (!answer.reasoning.empty()) {
        message["reasoning_content"] = answer.reasoning;
        message["reasoning"] = answer.reasoning;
      }
      if (!answer.tool_calls.empty()) message["tool_calls"] = answer.tool_calls;
      json choice = {{"index", 0},
                     {"message", message},
                     {"finish_reason", result.finish_reason},
                     {"logprobs", logprobs ? json{{"content", answer.logprobs}} : json()}};
      return send_json(res, 200,
                       {{"id", id},
                        {"object", "chat.completion"},
                        {"created", created},
                        {"model", model->id},
                        {"choices", json::array({choice})},
                        {"usage", usage_json(result.metrics)},
                        {"timings", timings_json(result.metrics)}});
    }

    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, job, id, created, include_usage, logprobs](size_t, httplib::DataSink& sink) {
          auto chunk = [&](json delta, json finish_reason, json logprob_entries) {
            json choice = {
                {"index", 0},
                {"delta", std::move(delta)},
                {"finish_reason", std::move(finish_reason)},
                {"logprobs", logprobs ? json{{"content", std::move(logprob_entries)}} : json()}};
            return json{{"id", id},
                        {"object", "chat.completion.chunk"},
                        {"created", created},
                        {"model", job->model->id},
                        {"choices", json::array({std::move(choice)})}};
          };
          auto write = [&](const std::string& text) {
            return sink.write(text.data(), text.size());
          };
          bool alive =
              write(sse(chunk({{"role", "assistant"}, {"content", ""}}, nullptr, json::array())));
          GenerationResult result;
          if (!alive) {
            job->stream->cancel();
            result = drive_generation(*job, [](const OutputDelta&) { return false; });
          } else {
            result = drive_generation(*job, [&](const OutputDelta& out) {
              json delta = json::object();
              if (!out.content.empty()) delta["content"] = out.content;
              if (!out.reasoning.empty()) {
                delta["reasoning_content"] = out.reasoning;
                delta["reasoning"] = out.reasoning;
              }
              if (!out.tool_calls.empty()) {
                json calls = json::array();
                for (const auto& call : out.tool_calls) calls.push_back(tool_call_json(call, true));
                delta["tool_calls"] = calls;
              }
              return write(sse(chunk(delta, nullptr, out.logprobs)));
            });
          }
          self.metrics_.record_generation(result.metrics, result.client_disconnected);
          if (result.error) {
            write(sse_error(*result.error));
          } else if (!result.finish_reason.empty()) {
            json last = chunk(json::object(), result.finish_reason, json::array());
            last["timings"] = timings_json(result.metrics);
            write(sse(last));
            if (include_usage) {
              write(sse({{"id", id},
                         {"object", "chat.completion.chunk"},
                         {"created", created},
                         {"model", job->model->id},
                         {"choices", json::array()},
                         {"usage", usage_json(result.metrics)}}));
            }
            write("data: [DONE]\n\n");
          }
          sink.done();
          return true;
        },
        [job](bool) { job->stream->cancel(); });
  }

  void completions(const httplib::Request& req, httplib::Response& res) {
    auto model = require_model(res);
    if (!model) return;
    ordered_json body;
    if (auto error = parse_json_body(req.body, body)) return send_error(res, *error);
    CompletionRequest request;
    if (auto error = parse_completion_request(body, names(*model), model->scheduler->vocab_size(),
                                              request)) {
      return send_error(res, *error);
    }
    std::vector<int32_t> ids = request.prompt_ids;
    std::string prompt_text = request.prompt_text;
    if (ids.empty()) {
      ids = model->tokenizer.encode(request.prompt_text, /*parse_special=*/true);
      if (model->bos_token >= 0 && (ids.empty() || ids.front() != model->bos_token))
        ids.insert(ids.begin(), model->bos_token);
    } else {
      prompt_text = model->tokenizer.decode(ids);
    }
    const std::string echo = request.echo ? prompt_text : std::string();
    const bool stream = request.settings.stream;
    const bool include_usage = request.settings.include_usage;
    const bool logprobs = request.settings.logprobs;
    auto started = start_generation(model, std::move(ids), std::move(request.settings), false, {},
                                    self.options_.request_timeout);
    if (auto* error = std::get_if<ApiError>(&started)) return send_error(res, *error);
    auto job = std::get<std::shared_ptr<GenerationJob>>(started);
    const std::string id = random_id("cmpl-");
    const int64_t created = unix_seconds();
    auto response = [job, id, created](json choices) {
      return json{{"id", id},
                  {"object", "text_completion"},
                  {"created", created},
                  {"model", job->model->id},
                  {"choices", std::move(choices)}};
    };

    if (!stream) {
      std::string text = echo;
      json entries = json::array();
      GenerationResult result = drive_generation(
          *job,
          [&](const OutputDelta& delta) {
            text += delta.content;
            for (const auto& entry : delta.logprobs) entries.push_back(entry);
            return true;
          },
          connected(req));
      self.metrics_.record_generation(result.metrics, result.client_disconnected);
      if (result.error) return send_error(res, *result.error);
      json choice = {{"index", 0},
                     {"text", text},
                     {"finish_reason", result.finish_reason},
                     {"logprobs", logprobs ? completion_logprobs(entries, echo.size()) : json()}};
      json out = response(json::array({choice}));
      out["usage"] = usage_json(result.metrics);
      out["timings"] = timings_json(result.metrics);
      return send_json(res, 200, out);
    }

    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, job, response, echo, include_usage, logprobs](size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& text) {
            return sink.write(text.data(), text.size());
          };
          size_t offset = echo.size();
          auto choice = [&](const std::string& text, json finish_reason, const json& entries) {
            json c = {{"index", 0},
                      {"text", text},
                      {"finish_reason", std::move(finish_reason)},
                      {"logprobs", logprobs ? completion_logprobs(entries, offset) : json()}};
            return response(json::array({std::move(c)}));
          };
          bool alive = echo.empty() || write(sse(choice(echo, nullptr, json::array())));
          GenerationResult result = drive_generation(*job, [&](const OutputDelta& delta) {
            if (!alive) return false;
            alive = write(sse(choice(delta.content, nullptr, delta.logprobs)));
            offset += delta.content.size();
            return alive;
          });
          self.metrics_.record_generation(result.metrics, result.client_disconnected);
          if (result.error) {
            write(sse_error(*result.error));
          } else if (!result.finish_reason.empty()) {
            json last = choice("", result.finish_reason, json::array());
            last["timings"] = timings_json(result.metrics);
            write(sse(last));
            if (include_usage) {
              json usage = response(json::array());
              usage["usage"] = usage_json(result.metrics);
              write(sse(usage));
            }
            write("data: [DONE]\n\n");
          }
          sink.done();
          return true;
        },
        [job](bool) { job->stream->cancel(); });
  }
};

HttpServer::HttpServer(ServerOptions options)
    : options_(std::move(options)), server_(std::make_unique<httplib::Server>()) {
  const int threads = std::max(options_.handler_threads, 4);
  server_->new_task_queue = [threads] {
    return new httplib::ThreadPool(static_cast<size_t>(threads));
  };
  server_->set_payload_max_length(options_.max_body_bytes);
  server_->set_read_timeout(options_.read_timeout);
  server_->set_write_timeout(std::chrono::seconds(60));
  server_->set_default_headers({{"Access-Control-Allow-Origin", "*"}});

  server_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (options_.api_key.empty() || req.method == "OPTIONS" || !needs_auth(req.path)) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    if (req.get_header_value("Authorization") == "Bearer " + options_.api_key) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    send_json(res, 401,
              ApiError{401, "Invalid API key: pass it as 'Authorization: Bearer <key>'",
                       "authentication_error", "", "invalid_api_key"}
                  .to_json());
    return httplib::Server::HandlerResponse::Handled;
  });
  // Statuses httplib sets itself (unknown route, oversized or unreadable body) get an
  // OpenAI-shaped body too.
  server_->set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message;
    switch (res.status) {
      case 404:
        message = fmt::format("no route {} {}", req.method, req.path);
        break;
      case 405:
        message = fmt::format("method {} is not allowed on {}", req.method, req.path);
        break;
      case 413:
        message = "the request body is too large";
        break;
      default:
        message = fmt::format("the request could not be read (HTTP {})", res.status);
        break;
    }
    const std::string type = res.status == 404 ? "not_found_error" : "invalid_request_error";
    send_json(res, res.status, ApiError{res.status, message, type, "", ""}.to_json());
  });
  server_->set_exception_handler([](const httplib::Request& req, httplib::Response& res,
                                    std::exception_ptr error) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    std::fprintf(stderr, "gemma4 serve: internal error on %s %s: %s\n", req.method.c_str(),
                 req.path.c_str(), what.c_str());
    send_json(res, 500,
              ApiError{500, "internal server error: " + what, "server_error", "", ""}.to_json());
  });
  server_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    if (req.method == "POST") metrics_.record_request(res.status);
  });

  auto routes = std::make_shared<Routes>(Routes{*this});
  server_->Get("/health",
               [routes](const httplib::Request&, httplib::Response& res) { routes->health(res); });
  server_->Get("/v1/models",
               [routes](const httplib::Request&, httplib::Response& res) { routes->models(res); });
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    auto model = this->model();
    std::optional<runtime::SchedulerStats> stats;
    if (model) stats = model->scheduler->stats();
    res.set_content(metrics_.render(stats ? &*stats : nullptr), "text/plain; version=0.0.4");
  });
  server_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    const std::string_view page = web_ui_html();
    res.set_content(page.data(), page.size(), "text/html; charset=utf-8");
  });
  server_->Post("/v1/chat/completions",
                [routes](const httplib::Request& req, httplib::Response& res) {
                  routes->chat_completions(req, res);
                });
  server_->Post("/v1/completions", [routes](const httplib::Request& req, httplib::Response& res) {
    routes->completions(req, res);
  });
  server_->Post("/tokenize", [routes](const httplib::Request& req, httplib::Response& res) {
    routes->tokenize(req, res);
  });
  server_->Post("/detokenize", [routes](const httplib::Request& req, httplib::Response& res) {
    routes->detokenize(req, res);
  });
  server_->Options(R"(/.*)", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
    res.set_header("Access-Control-Max-Age", "86400");
    res.status = 204;
  });
}

HttpServer::~HttpServer() {
  stop();
}

Status HttpServer::bind() {
  if (options_.port == 0) {
    port_ = server_->bind_to_any_port(options_.host);
  } else {
    port_ = server_->bind_to_port(options_.host, options_.port) ? options_.port : -1;
  }
  if (port_ <= 0) {
    return make_error(ErrorCode::kIo, "cannot listen on {}:{} (address in use or not local?)",
                      options_.host, options_.port);
  }
  return Status::ok_status();
}

Status HttpServer::listen() {
  listen_state_ = ListenState::kListening;
  const bool clean = stop_requested_ || server_->listen_after_bind();
  listen_state_ = ListenState::kReturned;
  if (!clean) return make_error(ErrorCode::kIo, "the HTTP server stopped with an error");
  return Status::ok_status();
}

void HttpServer::stop() {
  stop_requested_ = true;
  // httplib's stop() does nothing until the accept loop runs: wait for it if listen() is about
  // to start it (listen() itself returns at once when it sees stop_requested_ first).
  while (listen_state_ == ListenState::kListening && !server_->is_running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  server_->stop();
}

void HttpServer::set_model(std::shared_ptr<ServingModel> model) {
  std::lock_guard lock(model_mutex_);
  model_ = std::move(model);
}

void HttpServer::set_load_error(std::string message) {
  std::lock_guard lock(model_mutex_);
  load_error_ = std::move(message);
}

std::shared_ptr<ServingModel> HttpServer::model() const {
  std::lock_guard lock(model_mutex_);
  return model_;
}

}  // namespace gemma4::server
