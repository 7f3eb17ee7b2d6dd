// Tokenizer::from_json_file: reads a Hugging Face tokenizer.json.
//
// The file is ~15 MB, almost all of it model.vocab (262k entries) and model.merges (515k
// pairs). A SAX reader streams those two straight into vectors and builds an ordinary JSON
// document only for the small rest, which is ~4x faster than parsing the whole file into a DOM.
#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>
#include <sstream>

#include "text/tokenizer.h"

namespace gemma4::text {
namespace {

using json = nlohmann::json;

class TokenizerJsonReader final : public nlohmann::json_sax<json> {
 public:
  json document;  // the file without model.vocab and model.merges
  std::vector<std::pair<std::string, int64_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
  std::string error;

  bool null() override { return add_scalar(json(nullptr)); }
  bool boolean(bool value) override { return add_scalar(json(value)); }
  bool number_integer(number_integer_t value) override { return add_integer(value); }
  bool number_unsigned(number_unsigned_t value) override {
    if (value > static_cast<number_unsigned_t>(std::numeric_limits<int64_t>::max())) {
      return fail("number out of range");
    }
    return add_integer(static_cast<int64_t>(value));
  }
  bool number_float(number_float_t value, const string_t&) override {
    return add_scalar(json(value));
  }
  bool binary(binary_t&) override { return fail("unexpected binary value"); }

  bool string(string_t& value) override {
    if (stack_.empty()) return add_scalar(json(std::move(value)));
    switch (stack_.back().kind) {
      case Kind::kMerges: {  // the older "left right" form
        const size_t space = value.find(' ', 1);
        if (space == std::string::npos)
          return fail("model.merges entry \"" + value + "\" has no space");
        merges.emplace_back(value.substr(0, space), value.substr(space + 1));
        return true;
      }
      case Kind::kMergePair:
        merge_pair_.push_back(std::move(value));
        return true;
      case Kind::kVocab:
        return fail("model.vocab values must be integer ids");
      case Kind::kDom:
        return add_scalar(json(std::move(value)));
    }
    return false;
  }

  bool key(string_t& value) override {
    key_ = std::move(value);
    return true;
  }

  bool start_object(std::size_t) override {
    if (!stack_.empty() && stack_.back().kind != Kind::kDom) {
      return fail("unexpected object in model.vocab or model.merges");
    }
    if (!stack_.empty() && stack_.back().is_model && key_ == "vocab") {
      stack_.push_back(Frame{Kind::kVocab, nullptr, false});
      return true;
    }
    const bool is_model = stack_.size() == 1 && key_ == "model";
    stack_.push_back(Frame{Kind::kDom, place(json::object()), is_model});
    return true;
  }

  bool start_array(std::size_t) override {
    if (!stack_.empty()) {
      const Frame& top = stack_.back();
      if (top.kind == Kind::kMerges) {
        merge_pair_.clear();
        stack_.push_back(Frame{Kind::kMergePair, nullptr, false});
        return true;
      }
      if (top.kind != Kind::kDom) return fail("unexpected array in model.vocab or model.merges");
      if (top.is_model && key_ == "merges") {
        stack_.push_back(Frame{Kind::kMerges, nullptr, false});
        return true;
      }
    }
    stack_.push_back(Frame{Kind::kDom, place(json::array()), false});
    return true;
  }

  bool end_object() override {
    stack_.pop_back();
    return true;
  }

  bool end_array() override {
    if (stack_.back().kind == Kind::kMergePair) {
      if (merge_pair_.size() != 2) return fail("model.merges entry is not a pair of strings");
      merges.emplace_back(std::move(merge_pair_[0]), std::move(merge_pair_[1]));
    }
    stack_.pop_back();
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    return fail(e.what());
  }

 private:
  enum class Kind { kDom, kVocab, kMerges, kMergePair };
  struct Frame {
    Kind kind;
    json* node;     // the open container, for kDom
    bool is_model;  // the top-level "model" object
  };

  bool fail(std::string message) {
    if (error.empty()) error = std::move(message);
    return false;
  }

  // Puts a new value where the innermost open DOM container expects it. The returned pointer
  // stays valid while the value is open: nothing else is added to its parent meanwhile.
  json* place(json value) {
    if (stack_.empty()) {
      document = std::move(value);
      return &document;
    }
    json& parent = *stack_.back().node;
    if (parent.is_object()) {
      json& slot = parent[key_];
      slot = std::move(value);
      return &slot;
    }
    parent.push_back(std::move(value));
    return &parent.back();
  }

  bool add_scalar(json value) {
    if (!stack_.empty() && stack_.back().kind != Kind::kDom) {
      return fail("unexpected value in model.vocab or model.merges");
    }
    place(std::move(value));
    return true;
  }

  bool add_integer(int64_t value) {
    if (!stack_.empty() && stack_.back().kind == Kind::kVocab) {
      vocab.emplace_back(std::move(key_), value);
      return true;
    }
    return add_scalar(json(value));
  }

  std::vector<Frame> stack_;
  std::string key_;
  std::vector<std::string> merge_pair_;
};

Error unsupported(std::string_view what, const json& value) {
  return make_error(ErrorCode::kUnsupported, "unsupported {}: {}", what, value.dump());
}

bool is_replace(const json& step, std::string_view from, std::string_view to) {
  return step.is_object() && step.value("type", "") == "Replace" && step.contains("pattern") &&
         step["pattern"].is_object() && step["pattern"].value("String", "") == from &&
         step.value("content", "") == to;
}

bool null_or_empty_string(const json& object, const char* key) {
  if (!object.contains(key)) return true;
  const json& value = object[key];
  return value.is_null() || (value.is_string() && value.get<std::string>().empty());
}

}  // namespace

Expected<Tokenizer> Tokenizer::from_json_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file)
    return make_error(ErrorCode::kNotFound, "cannot open tokenizer file {}", path.string());
  std::ostringstream contents;
  contents << file.rdbuf();
  if (!file && !file.eof()) return make_error(ErrorCode::kIo, "cannot read {}", path.string());
  auto tokenizer = from_json_text(contents.str());
  if (!tokenizer.ok()) return tokenizer.error().with_context(path.string());
  return tokenizer;
}

Expected<Tokenizer> Tokenizer::from_json_text(std::string_view json_text) {
  TokenizerJsonReader reader;
  if (!json::sax_parse(json_text, &reader)) {
    return make_error(ErrorCode::kInvalidArgument, "tokenizer.json: {}",
                      reader.error.empty() ? "invalid JSON" : reader.error);
  }
  const json& doc = reader.document;
  if (!doc.is_object() || !doc.contains("model") || !doc["model"].is_object()) {
    return make_error(ErrorCode::kInvalidArgument, "tokenizer.json has no \"model\" object");
  }
  LoadedVocab vocab;

  const json normalizer = doc.value("normalizer", json());
  if (normalizer.is_null()) {
    vocab.space_to_underline = false;
  } else if (!is_replace(normalizer, " ", "\xE2\x96\x81")) {
    return unsupported("normalizer", normalizer);
  }
  // Splitting on ' ' after the normalizer removed every ' ' is a no-op.
  const json pre_tokenizer = doc.value("pre_tokenizer", json());
  const bool pre_tokenizer_is_noop =
      pre_tokenizer.is_null() ||
      (vocab.space_to_underline && pre_tokenizer.value("type", "") == "Split" &&
       pre_tokenizer.contains("pattern") && pre_tokenizer["pattern"].is_object() &&
       pre_tokenizer["pattern"].value("String", "") == " ");
  if (!pre_tokenizer_is_noop) return unsupported("pre_tokenizer", pre_tokenizer);

  const json decoder = doc.value("decoder", json());
  const json steps = decoder.is_object() ? decoder.value("decoders", json()) : json();
  const bool decoder_ok = decoder.is_object() && decoder.value("type", "") == "Sequence" &&
                          steps.is_array() && (steps.size() == 2 || steps.size() == 3) &&
                          is_replace(steps[0], "\xE2\x96\x81", " ") &&
                          steps[1].value("type", "") == "ByteFallback" &&
                          (steps.size() == 2 || steps[2].value("type", "") == "Fuse");
  if (!decoder_ok) return unsupported("decoder", decoder);

  const json& model = doc["model"];
  const bool model_ok =
      model.value("type", "BPE") == "BPE" && model.value("dropout", json()).is_null() &&
      null_or_empty_string(model, "continuing_subword_prefix") &&
      null_or_empty_string(model, "end_of_word_suffix") && !model.value("ignore_merges", false);
  if (!model_ok) {
    json settings = model;
    return unsupported("model settings", settings);
  }
  vocab.byte_fallback = model.value("byte_fallback", false);
  vocab.fuse_unk = model.value("fuse_unk", false);
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    vocab.unk_token = model["unk_token"].get<std::string>();
  }

  int64_t max_id = -1;
  for (const auto& [piece, id] : reader.vocab) max_id = std::max(max_id, id);
  const json added = doc.value("added_tokens", json::array());
  if (!added.is_array())
    return make_error(ErrorCode::kInvalidArgument, "added_tokens is not a list");
  for (const json& token : added) {
    if (!token.is_object() || !token.contains("id") || !token["id"].is_number_integer() ||
        !token.contains("content") || !token["content"].is_string()) {
      return make_error(ErrorCode::kInvalidArgument, "malformed added token {}", token.dump());
    }
    for (const char* flag : {"lstrip", "rstrip", "single_word", "normalized"}) {
      if (token.value(flag, false)) return unsupported(std::string("added token ") + flag, token);
    }
    vocab.added_tokens.push_back(AddedToken{token["content"].get<std::string>(),
                                            static_cast<int32_t>(token["id"].get<int64_t>()),
                                            token.value("special", false)});
    max_id = std::max(max_id, token["id"].get<int64_t>());
  }
  if (max_id < 0 || max_id >= std::numeric_limits<int32_t>::max()) {
    return make_error(ErrorCode::kInvalidArgument, "tokenizer.json vocabulary ids out of range");
  }
  vocab.pieces.resize(static_cast<size_t>(max_id) + 1);
  vocab.exists.assign(vocab.pieces.size(), 0);
  for (auto& [piece, id] : reader.vocab) {
    if (id < 0) return make_error(ErrorCode::kInvalidArgument, "negative id for \"{}\"", piece);
    if (vocab.exists[id]) {
      return make_error(ErrorCode::kInvalidArgument, "id {} appears twice in model.vocab", id);
    }
    vocab.exists[id] = 1;
    vocab.pieces[id] = std::move(piece);
  }
  for (const AddedToken& token : vocab.added_tokens) {  // added tokens may lie beyond the model
    if (token.id < 0) {
      return make_error(ErrorCode::kInvalidArgument, "negative id for \"{}\"", token.text);
    }
    if (!vocab.exists[token.id]) {
      vocab.exists[token.id] = 1;
      vocab.pieces[token.id] = token.text;
    }
  }
  vocab.merges = std::move(reader.merges);
  return build(std::move(vocab));
}

}  // namespace gemma4::text
