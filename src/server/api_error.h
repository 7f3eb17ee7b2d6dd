// Errors as the OpenAI API shapes them: an HTTP status plus
// {"error": {"message", "type", "param", "code"}}.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "core/status.h"

namespace gemma4::server {

struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending request field, "" for none
  std::string code;   // machine-readable code, "" for none

  nlohmann::json to_json() const;
};

ApiError invalid_request(std::string message, std::string param = {});
// Maps an error from the lower layers to what the client should see: kInvalidArgument and
// kOutOfRange are the caller's mistake (400), kResourceExhausted is 429, kUnsupported 400,
// anything else 500 (a bug in gemma4 or the machine, never the request).
ApiError api_error_from(const Error& error);

}  // namespace gemma4::server
