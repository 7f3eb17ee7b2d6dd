// Strict UTF-8 (Unicode Table 3-7: no overlongs, no surrogates, nothing above U+10FFFF), shared
// by the tokenizer and the incremental detokenizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace gemma4::text::utf8 {

// Decodes the well-formed sequence at the start of `bytes` into `code_point` and returns its
// length, or 0 when `bytes` does not start with one (then bytes[0] is an invalid byte).
inline size_t decode_one(std::string_view bytes, uint32_t& code_point) {
  if (bytes.empty()) return 0;
  const auto byte_at = [&](size_t i) { return static_cast<uint8_t>(bytes[i]); };
  const uint8_t lead = byte_at(0);
  if (lead < 0x80) {
    code_point = lead;
    return 1;
  }
  size_t length;
  uint8_t second_min = 0x80, second_max = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
    code_point = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    code_point = lead & 0x0F;
    if (lead == 0xE0) second_min = 0xA0;  // overlong
    if (lead == 0xED) second_max = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    code_point = lead & 0x07;
    if (lead == 0xF0) second_min = 0x90;  // overlong
    if (lead == 0xF4) second_max = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (bytes.size() < length) return 0;
  for (size_t i = 1; i < length; ++i) {
    const uint8_t continuation = byte_at(i);
    const uint8_t low = i == 1 ? second_min : 0x80;
    const uint8_t high = i == 1 ? second_max : 0xBF;
    if (continuation < low || continuation > high) return 0;
    code_point = (code_point << 6) | (continuation & 0x3F);
  }
  return length;
}

inline bool is_valid(std::string_view bytes) {
  uint32_t code_point;
  while (!bytes.empty()) {
    if (static_cast<uint8_t>(bytes[0]) < 0x80) {  // ASCII fast path
      bytes.remove_prefix(1);
      continue;
    }
    const size_t length = decode_one(bytes, code_point);
    if (length == 0) return false;
    bytes.remove_prefix(length);
  }
  return true;
}

inline void append(std::string& out, uint32_t code_point) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xC0 | (code_point >> 6));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xE0 | (code_point >> 12));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (code_point >> 18));
    out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (code_point & 0x3F));
  }
}

inline constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// Finishes a run of bytes from byte-fallback tokens, text[run_start..], the way HF's
// ByteFallback decoder does: the bytes stay when the whole run is valid UTF-8, else each byte
// becomes one U+FFFD.
inline void finish_byte_run(std::string& text, size_t run_start) {
  const size_t run_length = text.size() - run_start;
  if (is_valid(std::string_view(text).substr(run_start))) return;
  text.resize(run_start);
  for (size_t i = 0; i < run_length; ++i) text += kReplacementCharacter;
}

}  // namespace gemma4::text::utf8
