#include "text/detokenizer.h"

#include "text/tokenizer_utf8.h"

namespace gemma4::text {

void IncrementalDetokenizer::finish_byte_run() {
  if (byte_run_.empty()) return;
  const size_t run_start = ready_.size();
  ready_ += byte_run_;
  utf8::finish_byte_run(ready_, run_start);
  byte_run_.clear();
}

std::string_view IncrementalDetokenizer::push(int32_t id) {
  ready_.clear();
  // Ids decode() drops are invisible here too: they neither emit text nor end a byte run.
  if (!tokenizer_->has_id(id) || (skip_special_ && tokenizer_->is_special(id))) return ready_;
  if (const int32_t byte = tokenizer_->byte_value(id); byte >= 0) {
    byte_run_ += static_cast<char>(byte);
    return ready_;
  }
  finish_byte_run();
  ready_ += tokenizer_->decoded_piece(id);
  return ready_;
}

std::string_view IncrementalDetokenizer::flush() {
  ready_.clear();
  finish_byte_run();
  return ready_;
}

}  // namespace gemma4::text
