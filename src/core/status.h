// Errors as values at module boundaries (DESIGN.md engine rule 6).
#pragma once

#include <fmt/format.h>

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace gemma4 {

enum class ErrorCode {
  kInvalidArgument,  // the caller (a user, a file, a request) gave something wrong
  kNotFound,         // a file, tensor, key or model that does not exist
  kUnsupported,      // valid, but not something gemma4 handles (names what)
  kOutOfRange,       // an offset, length or count beyond what the input holds
  kIo,               // the operating system refused (open, read, mmap, socket)
  kResourceExhausted,  // memory, queue or context capacity
  kCancelled,
  kInternal,         // a bug in gemma4
};

const char* error_code_name(ErrorCode code);

// An error: a code plus a message written for a person ("what, where, why").
struct Error {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;

  std::string to_string() const;
  // Prefixes context ("loading model.safetensors: ") to the message.
  Error with_context(std::string_view context) const;
};

template <typename... Args>
Error make_error(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  return Error{code, fmt::format(format, std::forward<Args>(args)...)};
}

// Status: success or an Error.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error error) : error_(std::move(error)) {}  // NOLINT: implicit by design
  static Status ok_status() { return {}; }

  bool ok() const { return !error_.has_value(); }
  explicit operator bool() const { return ok(); }
  const Error& error() const { return *error_; }

 private:
  std::optional<Error> error_;
};

// Expected<T>: a T or an Error (std::expected is C++23).
template <typename T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}      // NOLINT: implicit by design
  Expected(Error error) : v_(std::move(error)) {}  // NOLINT: implicit by design

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  const Error& error() const { return std::get<1>(v_); }
  Status status() const { return ok() ? Status() : Status(error()); }

  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Error> v_;
};

}  // namespace gemma4

// Propagate an error from an expression yielding Status or Expected<T>.
#define GEMMA4_CONCAT_INNER(a, b) a##b
#define GEMMA4_CONCAT(a, b) GEMMA4_CONCAT_INNER(a, b)

#define GEMMA4_RETURN_IF_ERROR(expr)                   \
  do {                                                 \
    auto gemma4_status_ = (expr);                      \
    if (!gemma4_status_.ok()) return gemma4_status_.error(); \
  } while (0)

// GEMMA4_ASSIGN_OR_RETURN(auto x, expr): x = value of expr, or return its error.
#define GEMMA4_ASSIGN_OR_RETURN(lhs, expr) \
  GEMMA4_ASSIGN_OR_RETURN_IMPL(GEMMA4_CONCAT(gemma4_expected_, __LINE__), lhs, expr)
#define GEMMA4_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.error();                 \
  lhs = std::move(tmp).value()
