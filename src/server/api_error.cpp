#include "server/api_error.h"

namespace gemma4::server {

nlohmann::json ApiError::to_json() const {
  nlohmann::json body = {{"message", message},
                         {"type", type},
                         {"param", param.empty() ? nlohmann::json() : nlohmann::json(param)},
                         {"code", code.empty() ? nlohmann::json() : nlohmann::json(code)}};
  return {{"error", std::move(body)}};
}

ApiError invalid_request(std::string message, std::string param) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), ""};
}

ApiError api_error_from(const Error& error) {
  switch (error.code) {
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kUnsupported:
    case ErrorCode::kNotFound:
      return invalid_request(error.message);
    case ErrorCode::kOutOfRange:
      return ApiError{400, error.message, "invalid_request_error", "messages",
                      "context_length_exceeded"};
    case ErrorCode::kResourceExhausted:
      return ApiError{429, error.message, "rate_limit_error", "", "queue_full"};
    case ErrorCode::kCancelled:
      return ApiError{503, error.message, "unavailable_error", "", ""};
    case ErrorCode::kIo:
    case ErrorCode::kInternal:
      break;
  }
  return ApiError{500, error.message, "server_error", "", ""};
}

}  // namespace gemma4::server
