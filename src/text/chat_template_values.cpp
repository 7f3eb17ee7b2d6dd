#include "text/chat_template_values.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>

namespace gemma4::text::chat_values {
namespace {

constexpr char32_t kReplacementChar = 0xFFFD;

// Decodes one UTF-8 code point at text[pos]; an invalid byte decodes as U+FFFD, length 1, so
// that any byte string is handled (JSON parsed by nlohmann is always valid UTF-8).
char32_t decode_utf8(std::string_view text, size_t pos, size_t& length) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(pos);
  length = 1;
  if (lead < 0x80) return lead;
  size_t extra = 0;
  char32_t cp = 0;
  if ((lead & 0xE0) == 0xC0) {
    extra = 1;
    cp = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    extra = 2;
    cp = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    extra = 3;
    cp = lead & 0x07;
  } else {
    return kReplacementChar;
  }
  if (pos + extra >= text.size()) return kReplacementChar;
  for (size_t i = 1; i <= extra; ++i) {
    if ((byte(pos + i) & 0xC0) != 0x80) return kReplacementChar;
    cp = (cp << 6) | (byte(pos + i) & 0x3F);
  }
  length = extra + 1;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Python's str.isspace() set (Py_UNICODE_ISSPACE).
bool is_py_whitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Assigned code points for which Python's str.isprintable() is false (Python 3.11 tables), so
// repr() escapes them. Unassigned code points are treated as printable.
bool is_py_unprintable(char32_t cp) {
  struct Range {
    char32_t first, last;
  };
  static constexpr std::array<Range, 28> kRanges = {{
      {0x00, 0x1F},       {0x7F, 0xA0},       {0xAD, 0xAD},       {0x600, 0x605},
      {0x61C, 0x61C},     {0x6DD, 0x6DD},     {0x70F, 0x70F},     {0x890, 0x891},
      {0x8E2, 0x8E2},     {0x1680, 0x1680},   {0x180E, 0x180E},   {0x2000, 0x200F},
      {0x2028, 0x202F},   {0x205F, 0x2064},   {0x2066, 0x206F},   {0x3000, 0x3000},
      {0xD800, 0xF8FF},   {0xFEFF, 0xFEFF},   {0xFFF9, 0xFFFB},   {0x110BD, 0x110BD},
      {0x110CD, 0x110CD}, {0x13430, 0x13438}, {0x1BCA0, 0x1BCA3}, {0x1D173, 0x1D17A},
      {0xE0001, 0xE0001}, {0xE0020, 0xE007F}, {0xF0000, 0xFFFFD}, {0x100000, 0x10FFFD},
  }};
  return std::any_of(kRanges.begin(), kRanges.end(),
                     [cp](const Range& r) { return cp >= r.first && cp <= r.last; });
}

// Simple (one-to-one) case pairs: upper -> lower.
char32_t to_lower(char32_t cp) {
  if ((cp >= 'A' && cp <= 'Z') || (cp >= 0xC0 && cp <= 0xDE && cp != 0xD7) ||
      (cp >= 0x391 && cp <= 0x3AB && cp != 0x3A2) || (cp >= 0x410 && cp <= 0x42F)) {
    return cp + 0x20;
  }
  if (cp >= 0x400 && cp <= 0x40F) return cp + 0x50;
  if (cp == 0x178) return 0xFF;
  // Latin Extended-A: alternating upper/lower pairs, with the parity switching at U+0139.
  if ((cp >= 0x100 && cp <= 0x137 && cp % 2 == 0) || (cp >= 0x139 && cp <= 0x148 && cp % 2 == 1) ||
      (cp >= 0x14A && cp <= 0x177 && cp % 2 == 0) || (cp >= 0x179 && cp <= 0x17E && cp % 2 == 1)) {
    return cp + 1;
  }
  return cp;
}

char32_t to_upper(char32_t cp) {
  if ((cp >= 'a' && cp <= 'z') || (cp >= 0xE0 && cp <= 0xFE && cp != 0xF7) ||
      (cp >= 0x3B1 && cp <= 0x3CB && cp != 0x3C2) || (cp >= 0x430 && cp <= 0x44F)) {
    return cp - 0x20;
  }
  if (cp == 0x3C2) return 0x3A3;  // final sigma
  if (cp >= 0x450 && cp <= 0x45F) return cp - 0x50;
  if (cp == 0xFF) return 0x178;
  if (cp == 0xB5) return 0x39C;  // micro sign -> Greek capital mu
  if ((cp >= 0x101 && cp <= 0x137 && cp % 2 == 1) || (cp >= 0x13A && cp <= 0x148 && cp % 2 == 0) ||
      (cp >= 0x14B && cp <= 0x177 && cp % 2 == 1) || (cp >= 0x17A && cp <= 0x17E && cp % 2 == 0)) {
    return cp - 1;
  }
  return cp;
}

std::string change_case(std::string_view text, bool upper) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    size_t length = 0;
    const char32_t cp = decode_utf8(text, pos, length);
    if (cp == kReplacementChar && length == 1 && static_cast<unsigned char>(text[pos]) >= 0x80) {
      out += text[pos];  // keep an invalid byte as it is
    } else if (cp == 0xDF && upper) {
      out += "SS";  // German sharp s upper-cases to two letters
    } else {
      append_utf8(out, upper ? to_upper(cp) : to_lower(cp));
    }
    pos += length;
  }
  return out;
}

std::string py_repr_string(std::string_view text) {
  const bool has_single = text.find('\'') != std::string_view::npos;
  const bool has_double = text.find('"') != std::string_view::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (size_t pos = 0; pos < text.size();) {
    size_t length = 0;
    const char32_t cp = decode_utf8(text, pos, length);
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (is_py_unprintable(cp)) {
      out += cp < 0x100     ? fmt::format("\\x{:02x}", static_cast<uint32_t>(cp))
             : cp < 0x10000 ? fmt::format("\\u{:04x}", static_cast<uint32_t>(cp))
                            : fmt::format("\\U{:08x}", static_cast<uint32_t>(cp));
    } else {
      out.append(text.substr(pos, length));
    }
    pos += length;
  }
  out += quote;
  return out;
}

std::string py_repr(const Json& value);

std::string py_repr_container(const Json& value) {
  std::string out(1, value.is_array() ? '[' : '{');
  bool first = true;
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!first) out += ", ";
    first = false;
    if (value.is_object()) out += py_repr_string(it.key()) + ": ";
    out += py_repr(*it);
  }
  out += value.is_array() ? ']' : '}';
  return out;
}

std::string py_repr(const Json& value) {
  if (value.is_string()) return py_repr_string(value.get_ref<const std::string&>());
  if (value.is_array() || value.is_object()) return py_repr_container(value);
  return py_str(&value);
}

// Python numbers as (is_float, value) for comparisons; bools count as ints.
bool as_number(const Json& value, double& number) {
  if (value.is_boolean()) {
    number = value.get<bool>() ? 1.0 : 0.0;
    return true;
  }
  if (value.is_number()) {
    number = value.get<double>();
    return true;
  }
  return false;
}

}  // namespace

const Json* member(const Json* value, std::string_view key) {
  if (value == nullptr || !value->is_object()) return nullptr;
  const auto it = value->find(key);
  return it == value->end() ? nullptr : &*it;
}

bool py_truthy(const Json* value) {
  if (value == nullptr) return false;
  switch (value->type()) {
    case Json::value_t::null:
    case Json::value_t::discarded:
      return false;
    case Json::value_t::boolean:
      return value->get<bool>();
    case Json::value_t::number_integer:
      return value->get<int64_t>() != 0;
    case Json::value_t::number_unsigned:
      return value->get<uint64_t>() != 0;
    case Json::value_t::number_float:
      return value->get<double>() != 0.0;
    case Json::value_t::string:
      return !value->get_ref<const std::string&>().empty();
    case Json::value_t::array:
    case Json::value_t::object:
    case Json::value_t::binary:
      return !value->empty();
  }
  return false;
}

std::string py_float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // Shortest round-trip digits in scientific form, e.g. "1.2345e+02", then Python's layout:
  // positional for decimal exponents -4 <= e < 16, scientific otherwise.
  std::array<char, 64> buffer{};
  const auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value,
                                    std::chars_format::scientific);
  const std::string_view text(buffer.data(), result.ptr - buffer.data());
  const size_t e_pos = text.find('e');
  std::string_view mantissa = text.substr(0, e_pos);
  const int exponent = std::stoi(std::string(text.substr(e_pos + 1)));
  std::string sign;
  if (!mantissa.empty() && mantissa.front() == '-') {
    sign = "-";
    mantissa.remove_prefix(1);
  }
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits += c;
  }
  if (exponent < -4 || exponent >= 16) {
    std::string out = sign + digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    return out + fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  }
  const int point = exponent + 1;  // digits before the decimal point
  std::string out = sign;
  if (point <= 0) {
    out += "0." + std::string(static_cast<size_t>(-point), '0') + digits;
  } else if (static_cast<size_t>(point) >= digits.size()) {
    out += digits + std::string(point - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, point) + "." + digits.substr(point);
  }
  return out;
}

std::string py_str(const Json* value) {
  if (value == nullptr) return "";
  switch (value->type()) {
    case Json::value_t::null:
    case Json::value_t::discarded:
      return "None";
    case Json::value_t::boolean:
      return value->get<bool>() ? "True" : "False";
    case Json::value_t::number_integer:
      return std::to_string(value->get<int64_t>());
    case Json::value_t::number_unsigned:
      return std::to_string(value->get<uint64_t>());
    case Json::value_t::number_float:
      return py_float_repr(value->get<double>());
    case Json::value_t::string:
      return value->get<std::string>();
    case Json::value_t::array:
    case Json::value_t::object:
      return py_repr_container(*value);
    case Json::value_t::binary:
      return "";
  }
  return "";
}

bool py_equal(const Json* a, const Json* b) {
  static const Json kNone;
  const Json& x = a ? *a : kNone;
  const Json& y = b ? *b : kNone;
  double nx = 0, ny = 0;
  if (as_number(x, nx) && as_number(y, ny)) {
    if (x.is_number_float() || y.is_number_float()) return nx == ny;
    if (x.is_boolean() || y.is_boolean()) return nx == ny;
    return x == y;  // exact integer comparison (int64 / uint64)
  }
  if (x.type() != y.type()) return false;
  if (x.is_array()) {
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!py_equal(&x[i], &y[i])) return false;
    }
    return true;
  }
  if (x.is_object()) {
    if (x.size() != y.size()) return false;
    for (auto it = x.begin(); it != x.end(); ++it) {
      if (!py_equal(&*it, member(&y, it.key()))) return false;
    }
    return true;
  }
  return x == y;
}

std::string_view py_strip(std::string_view text) {
  size_t begin = 0;
  while (begin < text.size()) {
    size_t length = 0;
    const char32_t cp = decode_utf8(text, begin, length);
    if (!is_py_whitespace(cp)) break;
    begin += length;
  }
  size_t end = text.size();
  while (end > begin) {
    // Step back to the start of the last code point.
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80 &&
           end - start < 4) {
      --start;
    }
    size_t length = 0;
    const char32_t cp = decode_utf8(text, start, length);
    if (start + length != end || !is_py_whitespace(cp)) break;
    end = start;
  }
  return text.substr(begin, end - begin);
}

std::string py_upper(std::string_view text) {
  return change_case(text, true);
}
std::string py_lower(std::string_view text) {
  return change_case(text, false);
}

std::vector<std::pair<const std::string*, const Json*>> dictsort(const Json& object) {
  struct Item {
    std::string sort_key;
    const std::string* key;
    const Json* value;
  };
  std::vector<Item> items;
  items.reserve(object.size());
  for (auto it = object.begin(); it != object.end(); ++it) {
    items.push_back({py_lower(it.key()), &it.key(), &*it});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.sort_key < b.sort_key; });
  std::vector<std::pair<const std::string*, const Json*>> sorted;
  sorted.reserve(items.size());
  for (const Item& item : items) sorted.emplace_back(item.key, item.value);
  return sorted;
}

Expected<std::vector<Json>> py_iterate(const Json& value) {
  std::vector<Json> items;
  if (value.is_array()) {
    items.assign(value.begin(), value.end());
  } else if (value.is_object()) {
    for (auto it = value.begin(); it != value.end(); ++it) items.emplace_back(it.key());
  } else if (value.is_string()) {
    const auto& text = value.get_ref<const std::string&>();
    for (size_t pos = 0; pos < text.size();) {
      size_t length = 0;
      decode_utf8(text, pos, length);
      items.emplace_back(text.substr(pos, length));
      pos += length;
    }
  } else {
    return make_error(ErrorCode::kInvalidArgument, "{} is not a list", value.dump());
  }
  return items;
}

}  // namespace gemma4::text::chat_values
