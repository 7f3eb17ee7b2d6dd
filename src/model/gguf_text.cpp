#include "model/gguf_text.h"

#include <string>

namespace gemma4::model {
namespace {

Expected<const io::GgufValue*> required(const io::GgufFile& file, std::string_view key) {
  const io::GgufValue* value = file.find_metadata(key);
  if (value == nullptr) {
    return make_error(ErrorCode::kInvalidArgument, "GGUF metadata has no {}", key);
  }
  return value;
}

Expected<std::vector<int32_t>> token_types(const io::GgufFile& file) {
  const io::GgufValue* value = file.find_metadata("tokenizer.ggml.token_type");
  if (value == nullptr) return std::vector<int32_t>{};  // all normal
  const auto types = value->as_int_array();
  if (!types) {
    return make_error(ErrorCode::kInvalidArgument,
                      "GGUF tokenizer.ggml.token_type is not an integer array");
  }
  std::vector<int32_t> narrowed;
  narrowed.reserve(types->size());
  for (const int64_t type : *types) {
    if (type < 0 || type > static_cast<int64_t>(text::TokenType::kByte)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "GGUF tokenizer.ggml.token_type holds {}, not a token type (0..6)", type);
    }
    narrowed.push_back(static_cast<int32_t>(type));
  }
  return narrowed;
}

Expected<text::Tokenizer> build_tokenizer(const io::GgufFile& file) {
  GEMMA4_ASSIGN_OR_RETURN(const io::GgufValue* model, required(file, "tokenizer.ggml.model"));
  GEMMA4_ASSIGN_OR_RETURN(const io::GgufValue* tokens_value,
                          required(file, "tokenizer.ggml.tokens"));
  const std::string* model_name = model->as_string();
  const std::vector<std::string>* tokens = tokens_value->as_string_array();
  if (model_name == nullptr || tokens == nullptr) {
    return make_error(ErrorCode::kInvalidArgument,
                      "GGUF tokenizer.ggml.model must be a string and tokenizer.ggml.tokens a "
                      "string array");
  }
  GEMMA4_ASSIGN_OR_RETURN(const std::vector<int32_t> types, token_types(file));
  if (*model_name == "llama") {
    GEMMA4_ASSIGN_OR_RETURN(const io::GgufValue* scores_value,
                            required(file, "tokenizer.ggml.scores"));
    const auto scores = scores_value->as_float_array();
    if (!scores) {
      return make_error(ErrorCode::kInvalidArgument,
                        "GGUF tokenizer.ggml.scores is not a float array");
    }
    const std::vector<float> narrowed(scores->begin(), scores->end());
    return text::Tokenizer::from_scored_vocab(*tokens, types, narrowed);
  }
  if (*model_name == "gemma4") {
    GEMMA4_ASSIGN_OR_RETURN(const io::GgufValue* merges_value,
                            required(file, "tokenizer.ggml.merges"));
    const std::vector<std::string>* merges = merges_value->as_string_array();
    if (merges == nullptr) {
      return make_error(ErrorCode::kInvalidArgument,
                        "GGUF tokenizer.ggml.merges is not a string array");
    }
    return text::Tokenizer::from_vocab(*tokens, types, *merges);
  }
  return make_error(ErrorCode::kUnsupported,
                    "GGUF tokenizer.ggml.model \"{}\" is not supported (gemma4 reads \"llama\", "
                    "SentencePiece with scores, and \"gemma4\", BPE with merges)",
                    *model_name);
}

}  // namespace

Expected<text::Tokenizer> tokenizer_from_gguf(const io::GgufFile& file) {
  auto tokenizer = build_tokenizer(file);
  if (!tokenizer.ok()) return tokenizer.error().with_context(file.path().string());
  return tokenizer;
}

Expected<text::Tokenizer> tokenizer_from_gguf(const std::filesystem::path& path) {
  GEMMA4_ASSIGN_OR_RETURN(const io::GgufFile file, io::GgufFile::open(path));
  return tokenizer_from_gguf(file);
}

Expected<text::ChatTemplate> chat_template_from_gguf(const io::GgufFile& file) {
  if (const io::GgufValue* source = file.find_metadata("tokenizer.chat_template")) {
    if (source->as_string() == nullptr) {
      return make_error(ErrorCode::kInvalidArgument,
                        "{}: GGUF tokenizer.chat_template is not a string", file.path().string());
    }
    auto parsed = text::ChatTemplate::from_template_source(*source->as_string());
    if (!parsed.ok()) return parsed.error().with_context(file.path().string());
    return parsed;
  }
  const io::GgufValue* architecture = file.find_metadata("general.architecture");
  const std::string* name = architecture ? architecture->as_string() : nullptr;
  if (name != nullptr && *name == "gemma3") {
    return text::ChatTemplate::of_variant(text::ChatTemplate::Variant::kGemma3);
  }
  if (name != nullptr && *name == "gemma4") {
    return text::ChatTemplate::of_variant(text::ChatTemplate::Variant::kCompact);
  }
  return make_error(ErrorCode::kUnsupported,
                    "{}: no tokenizer.chat_template and general.architecture is {}, not gemma3 "
                    "or gemma4",
                    file.path().string(), name ? *name : std::string("missing"));
}

Expected<text::ChatTemplate> chat_template_from_gguf(const std::filesystem::path& path) {
  GEMMA4_ASSIGN_OR_RETURN(const io::GgufFile file, io::GgufFile::open(path));
  return chat_template_from_gguf(file);
}

}  // namespace gemma4::model
