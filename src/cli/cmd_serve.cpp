// gemma4 serve: the OpenAI-compatible HTTP server. Flags follow llama-server where users expect
// them (--host, --port, -c/--ctx-size, -np/--parallel, --api-key, --alias). The socket is bound
// first and the model loaded after, so /health and /v1/models answer during loading.
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/engine_flags.h"
#include "cli/model_loader.h"
#include "io/hf_hub.h"
#include "runtime/scripted_engine.h"
#include "server/http_server.h"
#include "text/output_parser.h"

namespace gemma4::cli {
namespace {

struct ServeArgs {
  std::string model;
  std::string host = "127.0.0.1";
  int port = 8080;
  int64_t ctx_size = 4096;
  int parallel = 4;
  int max_queue = 64;
  std::string api_key;
  std::string alias;
  EngineFlags engine;
  EngineLoadOptions load;  // the engine flags, parsed by check_args
  int timeout_s = 600;
  size_t max_body_mib = 16;
  std::string scripted_engine;  // test-only: replay scripted replies instead of a model
  std::string tokenizer;        // for --scripted-engine
  std::string chat_template;    // for --scripted-engine
};

runtime::SchedulerOptions scheduler_options(const ServeArgs& args) {
  runtime::SchedulerOptions options;
  options.max_running = args.parallel;
  options.max_queued = args.max_queue;
  return options;
}

// --scripted-engine FILE: {"replies": [{"when": "text in the prompt", "reply": "generated text
// with <|special|> tokens"}, ...], "step_delay_ms": 0}. A reply without "when" is the fallback.
Expected<std::shared_ptr<server::ServingModel>> load_scripted(const ServeArgs& args) {
  if (args.tokenizer.empty() || args.chat_template.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--scripted-engine needs --tokenizer and --chat-template");
  }
  GEMMA4_ASSIGN_OR_RETURN(auto tokenizer, text::Tokenizer::from_json_file(args.tokenizer));
  GEMMA4_ASSIGN_OR_RETURN(auto chat_template, chat_template_from_file(args.chat_template));
  GEMMA4_ASSIGN_OR_RETURN(std::string script_text, read_text_file(args.scripted_engine));
  auto script = nlohmann::json::parse(script_text, nullptr, false);
  if (script.is_discarded() || !script.is_object() || !script.contains("replies") ||
      !script["replies"].is_array()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: expected {{\"replies\": [{{\"when\", \"reply\"}}, ...]}}",
                      args.scripted_engine);
  }
  std::vector<runtime::ScriptedReply> replies;
  for (const auto& entry : script["replies"]) {
    if (!entry.is_object() || !entry.value("reply", nlohmann::json()).is_string()) {
      return make_error(ErrorCode::kInvalidArgument, "{}: every reply needs a string \"reply\"",
                        args.scripted_engine);
    }
    replies.push_back({tokenizer.encode(entry.value("when", ""), false),
                       tokenizer.encode(entry["reply"].get<std::string>(), true)});
  }
  runtime::ScriptedEngineOptions options;
  options.vocab_size = tokenizer.vocab_size();
  options.max_context = args.ctx_size;
  options.max_sequences = args.parallel + runtime::SchedulerOptions{}.prefix_cache_entries;
  options.end_token = text::kStopTokenIds[0];
  options.step_delay = std::chrono::milliseconds(script.value("step_delay_ms", 0));
  auto model = std::make_shared<server::ServingModel>(std::move(tokenizer), chat_template);
  model->id = args.alias.empty() ? "scripted" : args.alias;
  model->description = "scripted test engine (replays " + args.scripted_engine + ")";
  model->synthetic = true;
  model->stop_tokens.assign(text::kStopTokenIds.begin(), text::kStopTokenIds.end());
  model->bos_token = model->tokenizer.token_to_id("<bos>");
  model->engine = std::make_unique<runtime::ScriptedEngine>(options, std::move(replies));
  model->scheduler = std::make_unique<runtime::Scheduler>(*model->engine, scheduler_options(args));
  return model;
}

Expected<std::shared_ptr<server::ServingModel>> load_checkpoint(const ServeArgs& args) {
  GEMMA4_ASSIGN_OR_RETURN(auto path, resolve_model(args.model));
  EngineLoadOptions load = args.load;
  load.engine.max_sequences = args.parallel + runtime::SchedulerOptions{}.prefix_cache_entries;
  load.engine.max_context = args.ctx_size;
  GEMMA4_ASSIGN_OR_RETURN(auto tokenizer, load_tokenizer(path));
  GEMMA4_ASSIGN_OR_RETURN(auto chat_template, load_chat_template(path));
  GEMMA4_ASSIGN_OR_RETURN(LoadedEngine loaded, load_engine(path, load));

  auto model = std::make_shared<server::ServingModel>(std::move(tokenizer), chat_template);
  model->id = args.alias.empty() ? args.model : args.alias;
  model->description = loaded.description();
  model->synthetic = loaded.synthetic;
  // The chat format's end-of-turn tokens (Gemma 4: <turn|>, <eos>, <|tool_response>; Gemma 3:
  // <end_of_turn>, <eos>) and the config's eos ids.
  model->stop_tokens = model->chat_template.stop_token_ids(model->tokenizer);
  for (int id : loaded.model->config.eos_token_ids) model->stop_tokens.push_back(id);
  model->bos_token = model->tokenizer.token_to_id("<bos>");
  model->engine_resources = loaded.model;
  model->engine = std::move(loaded.engine);
  model->scheduler = std::make_unique<runtime::Scheduler>(*model->engine, scheduler_options(args));
  return model;
}

Status check_args(ServeArgs& args) {
  if (args.model.empty() && args.scripted_engine.empty()) {
    // No -m: $GEMMA4_MODEL, else the demo model that scripts/setup installs.
    GEMMA4_ASSIGN_OR_RETURN(args.model, io::default_model_spec(io::HubOptions::from_environment()));
    std::fprintf(stderr, "gemma4 serve: no -m given, using %s\n", args.model.c_str());
  }
  if (args.parallel < 1)
    return make_error(ErrorCode::kInvalidArgument, "-np/--parallel must be >= 1");
  if (args.ctx_size < 16)
    return make_error(ErrorCode::kInvalidArgument, "-c/--ctx-size must be >= 16");
  if (args.max_queue < 0)
    return make_error(ErrorCode::kInvalidArgument, "--max-queue must be >= 0");
  GEMMA4_ASSIGN_OR_RETURN(args.load, engine_load_options(args.engine));
  return Status::ok_status();
}

Status serve(ServeArgs args) {
  GEMMA4_RETURN_IF_ERROR(check_args(args));
  // SIGINT/SIGTERM are taken by one thread that stops the server; a vanished client never
  // kills the process through SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  server::ServerOptions options;
  options.host = args.host;
  options.port = args.port;
  options.api_key = args.api_key;
  options.alias = args.alias;
  options.model_id =
      !args.alias.empty() ? args.alias : (args.model.empty() ? "scripted" : args.model);
  options.request_timeout = std::chrono::seconds(args.timeout_s);
  options.max_body_bytes = args.max_body_mib << 20;
  options.handler_threads = std::max(64, args.parallel + args.max_queue + 16);
  server::HttpServer http(options);
  GEMMA4_RETURN_IF_ERROR(http.bind());
  std::fprintf(stderr, "gemma4 serve: listening on http://%s:%d\n", args.host.c_str(), http.port());

  std::thread signal_thread([&http, signals] {
    int received = 0;
    sigwait(&signals, &received);
    std::fprintf(stderr, "gemma4 serve: stopping (signal %d)\n", received);
    http.stop();
  });
  Status listened;
  std::thread listen_thread([&] { listened = http.listen(); });

  auto model = args.scripted_engine.empty() ? load_checkpoint(args) : load_scripted(args);
  if (model.ok()) {
    std::fprintf(stderr, "gemma4 serve: serving '%s': %s%s, context %lld, %d parallel\n",
                 (*model)->id.c_str(), (*model)->description.c_str(),
                 (*model)->synthetic ? " [synthetic: output is noise]" : "",
                 static_cast<long long>((*model)->scheduler->max_context()), args.parallel);
    http.set_model(*model);
  } else {
    std::fprintf(stderr, "gemma4 serve: cannot load the model: %s\n",
                 model.error().message.c_str());
    http.set_load_error(model.error().message);
    http.stop();
  }
  listen_thread.join();
  pthread_kill(signal_thread.native_handle(), SIGTERM);
  signal_thread.join();
  if (!model.ok()) return model.error();
  return listened;
}

void register_serve(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<ServeArgs>();
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with a web UI");
  cmd->add_option("-m,--model", args->model,
                  "model directory, .gguf file or HF repo id (default: $GEMMA4_MODEL)");
  cmd->add_option("--host", args->host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", args->port, "port (0 = any free port)")->capture_default_str();
  cmd->add_option("-c,--ctx-size", args->ctx_size, "context length per sequence")
      ->capture_default_str();
  cmd->add_option("--parallel", args->parallel, "requests generated at once (also -np N)")
      ->capture_default_str();
  cmd->add_option("--max-queue", args->max_queue, "requests waiting beyond --parallel before 429")
      ->capture_default_str();
  cmd->add_option("--api-key", args->api_key, "require 'Authorization: Bearer KEY'");
  cmd->add_option("--alias", args->alias, "model name shown to clients");
  add_engine_flags(*cmd, args->engine);
  cmd->add_option("--timeout", args->timeout_s, "seconds a request may run (0 = no limit)")
      ->capture_default_str();
  cmd->add_option("--max-body-mib", args->max_body_mib, "largest request body in MiB")
      ->capture_default_str();
  cmd->add_option("--scripted-engine", args->scripted_engine,
                  "TEST ONLY: replay scripted replies from a JSON file");
  cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json for --scripted-engine");
  cmd->add_option("--chat-template", args->chat_template, "chat template for --scripted-engine");
  // CLI11 has no multi-letter short options; llama-server's "-np N" arrives as extras.
  cmd->allow_extras();
  cmd->callback([cmd, args, &exit_code] {
    auto extras = cmd->remaining();
    for (size_t i = 0; i < extras.size(); ++i) {
      if (extras[i] == "-np" && i + 1 < extras.size()) {
        try {
          args->parallel = std::stoi(extras[++i]);
          continue;
        } catch (const std::exception&) {
        }
      }
      std::fprintf(stderr, "gemma4 serve: unknown argument '%s'\n", extras[i].c_str());
      exit_code = 2;
      return;
    }
    if (Status status = serve(*args); !status.ok()) {
      std::fprintf(stderr, "gemma4 serve: %s\n", status.error().message.c_str());
      exit_code = 1;
    }
  });
}

GEMMA4_COMMAND(serve, register_serve);

}  // namespace
}  // namespace gemma4::cli
