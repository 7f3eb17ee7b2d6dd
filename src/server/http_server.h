// The OpenAI-compatible HTTP server (cpp-httplib): routes, SSE streaming, auth, CORS, limits,
// metrics and the web UI. Handler threads only parse, validate, enqueue and stream; the model
// runs on the scheduler's engine thread. The server listens before the model is loaded:
// /health says 503 and /v1/models answers with status "loading" until set_model() is called.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "core/status.h"
#include "server/metrics.h"
#include "server/serving_model.h"

namespace httplib {
class Server;
}

namespace gemma4::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;   // empty: no auth
  std::string model_id;  // shown while loading; set_model() brings the real one
  std::string alias;     // extra name clients may use in "model"
  size_t max_body_bytes = 16u << 20;
  int handler_threads = 64;  // concurrent connections (each stream holds one)
  std::chrono::seconds request_timeout{600};
  std::chrono::seconds read_timeout{10};  // slow or stalled request bodies are cut off
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions options);
  ~HttpServer();

  // Binds the socket (port 0 picks a free one). Call before listen().
  Status bind();
  int port() const { return port_; }
  // Serves until stop(); blocks. Returns at once if stop() came first.
  Status listen();
  // Ends listen() (from any thread, also before listen() started: a model that fails to load
  // at once must still end the server).
  void stop();

  void set_model(std::shared_ptr<ServingModel> model);
  // The model failed to load: /health and generation routes report this error.
  void set_load_error(std::string message);

 private:
  struct Routes;
  std::shared_ptr<ServingModel> model() const;

  ServerOptions options_;
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  enum class ListenState { kNotStarted, kListening, kReturned };
  std::atomic<ListenState> listen_state_{ListenState::kNotStarted};
  std::atomic<bool> stop_requested_{false};
  mutable std::mutex model_mutex_;
  std::shared_ptr<ServingModel> model_;
  std::string load_error_;
  Metrics metrics_;
};

}  // namespace gemma4::server
