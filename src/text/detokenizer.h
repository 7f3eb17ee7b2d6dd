// Streaming ids -> text for generated tokens: returns only complete UTF-8 text, never half a
// character, and the concatenation of everything it returns equals Tokenizer::decode of all
// ids pushed (HF semantics, including U+FFFD for invalid byte-fallback runs).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "text/tokenizer.h"

namespace gemma4::text {

class IncrementalDetokenizer {
 public:
  // `tokenizer` must outlive this object.
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(&tokenizer), skip_special_(skip_special) {}

  // Adds one id; returns the text it completes (often empty), valid until the next call.
  // A run of byte-fallback tokens (<0xNN>) is held until the run ends, because HF decides
  // between the bytes and U+FFFDs only once it sees the whole run.
  std::string_view push(int32_t id);

  // Ends the stream: returns whatever is still held (a finished byte run).
  std::string_view flush();

  // True while bytes of an unfinished byte run are held back.
  bool has_pending() const { return !byte_run_.empty(); }

 private:
  void finish_byte_run();

  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string byte_run_;  // bytes of the current run of byte-fallback tokens
  std::string ready_;     // text returned by the last call
};

}  // namespace gemma4::text
