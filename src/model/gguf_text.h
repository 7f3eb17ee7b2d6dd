// The text side of a GGUF checkpoint: its tokenizer (weight-formats.md 4.4) and chat template,
// read from the file's metadata. The text layer takes plain vectors; this is the glue that reads
// the GGUF keys for it.
#pragma once

#include <filesystem>
#include <vector>

#include "core/status.h"
#include "io/gguf.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace gemma4::model {

// tokenizer.ggml.model "llama" (SentencePiece BPE from tokens + scores, e.g. Gemma 3) or "gemma4"
// (BPE from tokens + merges); any other model (e.g. "gpt2"'s byte-level BPE) is kUnsupported.
Expected<text::Tokenizer> tokenizer_from_gguf(const io::GgufFile& file);
Expected<text::Tokenizer> tokenizer_from_gguf(const std::filesystem::path& path);

// The chat template: tokenizer.chat_template when the file has one, else the template of
// general.architecture (gemma3 -> Gemma 3's, gemma4 -> Gemma 4's compact one).
Expected<text::ChatTemplate> chat_template_from_gguf(const io::GgufFile& file);
Expected<text::ChatTemplate> chat_template_from_gguf(const std::filesystem::path& path);

}  // namespace gemma4::model
