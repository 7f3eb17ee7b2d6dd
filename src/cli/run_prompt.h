// Text prompts for `gemma4 run`: builds the prompt ids from -p TEXT (rendered with the
// checkpoint's chat template), --messages FILE (OpenAI messages JSON) or --raw text, and streams
// the generated ids back as text until one of the template's stop tokens.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"

namespace gemma4::cli {

struct TextPromptOptions {
  std::string prompt;         // -p: one user message, or the whole prompt with `raw`
  std::string messages_file;  // --messages: a JSON array of OpenAI chat messages
  bool raw = false;           // -p text is the prompt itself (after <bos>): no template
  bool think = false;         // enable_thinking for the chat template

  bool given() const { return !prompt.empty() || !messages_file.empty(); }
};

// The tokenizer of a checkpoint, the prompt ids for a text prompt, and the ids that end
// generation. Streams generated text to stdout.
class TextPromptRun {
 public:
  // Loads the tokenizer and (unless raw) the chat template of the model at `checkpoint`
  // (model_loader.h). Errors name the missing file or the bad option.
  static Expected<TextPromptRun> open(const std::filesystem::path& checkpoint,
                                      const TextPromptOptions& options,
                                      std::vector<int32_t> eos_ids);

  const std::vector<int32_t>& prompt_ids() const { return prompt_ids_; }
  bool is_stop(int32_t id) const;
  // Writes the text `id` completes to stdout (a stop id writes nothing).
  void print_token(int32_t id);
  // Writes whatever the detokenizer still holds, and a final newline.
  void finish();

 private:
  TextPromptRun(std::unique_ptr<text::Tokenizer> tokenizer, std::vector<int32_t> prompt_ids,
                std::vector<int32_t> stop_ids)
      : tokenizer_(std::move(tokenizer)),
        prompt_ids_(std::move(prompt_ids)),
        stop_ids_(std::move(stop_ids)),
        detokenizer_(*tokenizer_) {}

  // On the heap so that detokenizer_'s pointer to it survives moves of this object.
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::vector<int32_t> prompt_ids_;
  std::vector<int32_t> stop_ids_;
  text::IncrementalDetokenizer detokenizer_;
};

}  // namespace gemma4::cli
