// model::tokenizer_from_gguf / chat_template_from_gguf on small GGUF files written here. Expected
// ids follow SentencePiece's BPE rule (highest-scoring merge first) and merge-rank BPE by hand;
// the real-vocabulary check against SentencePiece is tests/text/test_gguf_tokenizer_diff.py.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "io/gguf.h"
#include "model/gguf_text.h"
#include "test_support.h"

namespace gemma4::model {
namespace {

using io::GgufValue;
using io::GgufValueType;
using Metadata = std::vector<std::pair<std::string, GgufValue>>;
using Ids = std::vector<int32_t>;

std::filesystem::path write_gguf(const std::string& name, Metadata metadata) {
  const auto path = testing::scratch_dir("gguf_text_" + name) / "model.gguf";
  auto writer = io::GgufWriter::create(path, std::move(metadata), {});
  EXPECT_TRUE(writer.ok()) << writer.error().to_string();
  EXPECT_TRUE(writer->finish().ok());
  return path;
}

GgufValue strings(std::vector<std::string> values) {
  return GgufValue::array(GgufValueType::kString, std::move(values));
}

// <unk> <bos> <start_of_turn> <end_of_turn> ▁ a b ab ▁ab, scored like a SentencePiece model.
Metadata llama_vocab(std::string architecture) {
  return {
      {"general.architecture", GgufValue::string(std::move(architecture))},
      {"tokenizer.ggml.model", GgufValue::string("llama")},
      {"tokenizer.ggml.tokens", strings({"<unk>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                                         "\xE2\x96\x81", "a", "b", "ab",
                                         "\xE2\x96\x81"
                                         "ab"})},
      {"tokenizer.ggml.scores",
       GgufValue::array(GgufValueType::kF32, std::vector<double>{0, 0, 0, 0, -5, -5, -5, -1, -2})},
      {"tokenizer.ggml.token_type",
       GgufValue::array(GgufValueType::kI32, std::vector<int64_t>{2, 3, 3, 3, 1, 1, 1, 1, 1})}};
}

TEST(GgufText, SentencePieceTokenizerFromScores) {
  const auto path = write_gguf("llama", llama_vocab("gemma3"));
  auto tokenizer = tokenizer_from_gguf(path);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.error().to_string();
  // "ab ab": a+b (-1) first, then ▁+ab (-2).
  EXPECT_EQ(tokenizer->encode("ab ab"), (Ids{7, 8}));
  EXPECT_EQ(tokenizer->encode("<start_of_turn>ab<end_of_turn>", true), (Ids{2, 7, 3}));
  EXPECT_TRUE(tokenizer->is_special(3));

  auto chat_template = chat_template_from_gguf(path);
  ASSERT_TRUE(chat_template.ok()) << chat_template.error().to_string();
  EXPECT_EQ(chat_template->variant(), text::ChatTemplate::Variant::kGemma3);
  EXPECT_EQ(chat_template->stop_token_ids(*tokenizer), (Ids{3}));
}

TEST(GgufText, MergesTokenizer) {
  auto metadata = llama_vocab("gemma4");
  metadata[1].second = GgufValue::string("gemma4");
  metadata.emplace_back("tokenizer.ggml.merges", strings({"\xE2\x96\x81 ab", "a b"}));
  const auto path = write_gguf("gemma4", std::move(metadata));
  auto tokenizer = tokenizer_from_gguf(path);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.error().to_string();
  EXPECT_EQ(tokenizer->encode("ab ab"), (Ids{7, 8}));
  auto chat_template = chat_template_from_gguf(path);
  ASSERT_TRUE(chat_template.ok()) << chat_template.error().to_string();
  EXPECT_EQ(chat_template->variant(), text::ChatTemplate::Variant::kCompact);
}

TEST(GgufText, ClearErrors) {
  auto gpt2 = llama_vocab("gemma3");
  gpt2[1].second = GgufValue::string("gpt2");
  auto unsupported = tokenizer_from_gguf(write_gguf("gpt2", std::move(gpt2)));
  ASSERT_FALSE(unsupported.ok());
  EXPECT_EQ(unsupported.error().code, ErrorCode::kUnsupported);
  EXPECT_NE(unsupported.error().message.find("gpt2"), std::string::npos);

  auto no_scores = llama_vocab("gemma3");
  no_scores.erase(no_scores.begin() + 3);
  auto missing = tokenizer_from_gguf(write_gguf("no_scores", std::move(no_scores)));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("tokenizer.ggml.scores"), std::string::npos);

  auto bad_type = llama_vocab("gemma3");
  bad_type[4].second =
      GgufValue::array(GgufValueType::kI32, std::vector<int64_t>{2, 3, 3, 3, 1, 1, 1, 1, 9});
  EXPECT_FALSE(tokenizer_from_gguf(write_gguf("bad_type", std::move(bad_type))).ok());

  auto other_arch = chat_template_from_gguf(write_gguf("llama_arch", llama_vocab("llama")));
  ASSERT_FALSE(other_arch.ok());
  EXPECT_EQ(other_arch.error().code, ErrorCode::kUnsupported);

  auto with_template = llama_vocab("gemma3");
  with_template.emplace_back("tokenizer.chat_template",
                             GgufValue::string("<|im_start|>{{ m }}<|im_end|>"));
  EXPECT_FALSE(chat_template_from_gguf(write_gguf("chatml", std::move(with_template))).ok());
}

}  // namespace
}  // namespace gemma4::model
