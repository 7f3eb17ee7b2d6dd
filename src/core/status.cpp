#include "core/status.h"

namespace gemma4 {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kNotFound: return "not found";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kOutOfRange: return "out of range";
    case ErrorCode::kIo: return "I/O error";
    case ErrorCode::kResourceExhausted: return "resource exhausted";
    case ErrorCode::kCancelled: return "cancelled";
    case ErrorCode::kInternal: return "internal error";
  }
  return "unknown error";
}

std::string Error::to_string() const { return fmt::format("{}: {}", error_code_name(code), message); }

Error Error::with_context(std::string_view context) const {
  return Error{code, fmt::format("{}: {}", context, message)};
}

}  // namespace gemma4
