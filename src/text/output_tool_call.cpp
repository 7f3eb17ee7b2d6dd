#include "text/output_tool_call.h"

#include <cmath>
#include <cstdlib>
#include <optional>
#include <unordered_set>

namespace gemma4::text {
namespace {

constexpr std::string_view kQuote = "<|\"|>";
constexpr int kMaxNesting = 512;  // bounds recursion on adversarial input

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}
bool is_name_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || is_digit(c) || c == '_' || c == '.' ||
         c == '-';
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

// Length of a valid UTF-8 sequence at text[pos], or 0 when the bytes there are not one.
size_t utf8_sequence_length(std::string_view text, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(pos);
  size_t length = 0;
  uint32_t cp = 0;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
    cp = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    cp = lead & 0x0F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    cp = lead & 0x07;
  } else {
    return 0;
  }
  if (pos + length > text.size()) return 0;
  for (size_t i = 1; i < length; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(pos + i) & 0x3F);
  }
  const bool overlong = (length == 3 && cp < 0x800) || (length == 4 && cp < 0x10000);
  const bool surrogate = cp >= 0xD800 && cp <= 0xDFFF;
  return (overlong || surrogate || cp > 0x10FFFF) ? 0 : length;
}

void append_json_string(std::string_view text, std::string& out) {
  out += '"';
  for (size_t pos = 0; pos < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[pos]);
    if (c >= 0x80) {
      const size_t length = utf8_sequence_length(text, pos);
      if (length == 0) {
        out += "\xEF\xBF\xBD";  // U+FFFD for a byte that is not UTF-8
        ++pos;
      } else {
        out.append(text.substr(pos, length));
        pos += length;
      }
      continue;
    }
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out += static_cast<char>(c);
        }
    }
    ++pos;
  }
  out += '"';
}

// Normalizes a numeric literal to JSON number text; nullopt when it is not a number.
std::optional<std::string> json_number(std::string_view literal) {
  size_t pos = 0;
  std::string out;
  if (pos < literal.size() && (literal[pos] == '+' || literal[pos] == '-')) {
    if (literal[pos] == '-') out += '-';
    ++pos;
  }
  const size_t int_begin = pos;
  while (pos < literal.size() && is_digit(literal[pos])) ++pos;
  std::string_view int_digits = literal.substr(int_begin, pos - int_begin);
  std::string_view fraction;
  bool has_point = false;
  if (pos < literal.size() && literal[pos] == '.') {
    has_point = true;
    const size_t fraction_begin = ++pos;
    while (pos < literal.size() && is_digit(literal[pos])) ++pos;
    fraction = literal.substr(fraction_begin, pos - fraction_begin);
  }
  if (int_digits.empty() && fraction.empty()) return std::nullopt;
  std::string_view exponent;
  if (pos < literal.size() && (literal[pos] == 'e' || literal[pos] == 'E')) {
    const size_t exponent_begin = pos++;
    if (pos < literal.size() && (literal[pos] == '+' || literal[pos] == '-')) ++pos;
    const size_t digits_begin = pos;
    while (pos < literal.size() && is_digit(literal[pos])) ++pos;
    if (pos == digits_begin) return std::nullopt;
    exponent = literal.substr(exponent_begin, pos - exponent_begin);
  }
  if (pos != literal.size()) return std::nullopt;
  while (int_digits.size() > 1 && int_digits.front() == '0') int_digits.remove_prefix(1);
  out += int_digits.empty() ? "0" : std::string(int_digits);
  if (has_point) {
    out += '.';
    out += fraction.empty() ? std::string_view("0") : fraction;
  }
  out += exponent;
  return out;
}

class ArgumentParser {
 public:
  explicit ArgumentParser(std::string_view text) : text_(text) {}

  Expected<std::string> parse_root_object() {
    std::string out;
    GEMMA4_RETURN_IF_ERROR(parse_object(out, 0));
    skip_space();
    if (pos_ != text_.size()) return fail("text after the argument object");
    return out;
  }

 private:
  Error fail(std::string_view what) const {
    return make_error(ErrorCode::kInvalidArgument, "tool call arguments: {} at offset {}", what,
                      pos_);
  }
  void skip_space() {
    while (pos_ < text_.size() && is_space(text_[pos_])) ++pos_;
  }
  bool at_quote() const { return text_.substr(pos_, kQuote.size()) == kQuote; }
  bool at(char c) const { return pos_ < text_.size() && text_[pos_] == c; }

  // <|"|>…<|"|>, verbatim between the delimiters.
  Expected<std::string_view> parse_quoted() {
    pos_ += kQuote.size();
    const size_t end = text_.find(kQuote, pos_);
    if (end == std::string_view::npos) return fail("unterminated <|\"|> string");
    const std::string_view content = text_.substr(pos_, end - pos_);
    pos_ = end + kQuote.size();
    return content;
  }

  Expected<std::string> parse_key() {
    skip_space();
    if (at_quote()) {
      GEMMA4_ASSIGN_OR_RETURN(std::string_view key, parse_quoted());
      return std::string(key);
    }
    const size_t begin = pos_;
    while (pos_ < text_.size() && text_[pos_] != ':' && !at_quote() &&
           std::string_view("{}[],").find(text_[pos_]) == std::string_view::npos) {
      ++pos_;
    }
    const std::string_view key = trim(text_.substr(begin, pos_ - begin));
    if (key.empty()) return fail("expected a key");
    return std::string(key);
  }

  Status parse_object(std::string& out, int depth) {
    if (depth > kMaxNesting) return fail("nesting too deep");
    ++pos_;  // '{'
    out += '{';
    std::unordered_set<std::string> seen_keys;
    skip_space();
    if (at('}')) {
      ++pos_;
      out += '}';
      return {};
    }
    while (true) {
      GEMMA4_ASSIGN_OR_RETURN(std::string key, parse_key());
      skip_space();
      if (!at(':')) return fail("expected ':' after a key");
      ++pos_;
      std::string value;
      GEMMA4_RETURN_IF_ERROR(parse_value(value, depth + 1));
      if (seen_keys.insert(key).second) {  // duplicate keys: the first one wins
        if (seen_keys.size() > 1) out += ',';
        append_json_string(key, out);
        out += ':';
        out += value;
      }
      skip_space();
      if (at(',')) {
        ++pos_;
        continue;
      }
      if (at('}')) {
        ++pos_;
        out += '}';
        return {};
      }
      return fail("expected ',' or '}' in an object");
    }
  }

  Status parse_array(std::string& out, int depth) {
    if (depth > kMaxNesting) return fail("nesting too deep");
    ++pos_;  // '['
    out += '[';
    skip_space();
    if (at(']')) {
      ++pos_;
      out += ']';
      return {};
    }
    while (true) {
      GEMMA4_RETURN_IF_ERROR(parse_value(out, depth + 1));
      skip_space();
      if (at(',')) {
        ++pos_;
        out += ',';
        continue;
      }
      if (at(']')) {
        ++pos_;
        out += ']';
        return {};
      }
      return fail("expected ',' or ']' in an array");
    }
  }

  Status parse_value(std::string& out, int depth) {
    skip_space();
    if (pos_ >= text_.size()) return fail("expected a value");
    if (at_quote()) {
      GEMMA4_ASSIGN_OR_RETURN(std::string_view content, parse_quoted());
      append_json_string(content, out);
      return {};
    }
    if (at('{')) return parse_object(out, depth);
    if (at('[')) return parse_array(out, depth);
    const size_t begin = pos_;
    while (pos_ < text_.size() && !is_space(text_[pos_]) &&
           std::string_view(",}]{[<").find(text_[pos_]) == std::string_view::npos) {
      ++pos_;
    }
    const std::string_view scalar = text_.substr(begin, pos_ - begin);
    if (scalar == "true" || scalar == "false" || scalar == "null") {
      out += scalar;
      return {};
    }
    if (auto number = json_number(scalar)) {
      // A number beyond double's range (1e+320) is valid JSON text that JSON libraries reject
      // (nlohmann) or turn into infinity: it is passed on as a string, digits intact.
      if (std::isinf(std::strtod(number->c_str(), nullptr))) {
        append_json_string(scalar, out);
      } else {
        out += *number;
      }
      return {};
    }
    pos_ = begin;
    return fail(scalar.empty() ? "expected a value"
                               : "a bare word is not a value (strings need <|\"|>)");
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

Expected<GemmaToolCall> parse_gemma_tool_call(std::string_view body) {
  const size_t brace = body.find('{');
  const std::string_view name = trim(body.substr(0, brace));
  if (name.empty()) {
    return make_error(ErrorCode::kInvalidArgument, "tool call without a function name");
  }
  for (char c : name) {
    if (!is_name_char(c)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "tool call name may only hold A-Z a-z 0-9 _ . - characters");
    }
  }
  GemmaToolCall call{std::string(name), "{}"};
  if (brace != std::string_view::npos) {
    GEMMA4_ASSIGN_OR_RETURN(call.arguments_json,
                            ArgumentParser(body.substr(brace)).parse_root_object());
  }
  return call;
}

}  // namespace gemma4::text
