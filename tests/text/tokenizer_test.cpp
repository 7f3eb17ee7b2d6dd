// Tokenizer and IncrementalDetokenizer units. Expected ids come from the spec's vectors
// (gemma4-chat-vectors.json, produced by HF `tokenizers`) or, where noted, from HF `tokenizers`
// run on the shared tokenizer.json. The large differential test is test_tokenizer_diff.py.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_support.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"
#include "text/tokenizer_utf8.h"

namespace gemma4::text {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;

std::filesystem::path tokenizer_path() {
  return testing::shared_data_dir() / "tokenizer" / "tokenizer.json";
}

const Tokenizer& shared_tokenizer() {
  static const Tokenizer tokenizer = [] {
    auto loaded = Tokenizer::from_json_file(tokenizer_path());
    if (!loaded.ok()) throw std::runtime_error(loaded.error().to_string());
    return std::move(loaded).value();
  }();
  return tokenizer;
}

json read_json(const std::filesystem::path& path) {
  std::ifstream file(path);
  return json::parse(file);
}

json spec_tokenize_vectors() {
  return read_json(testing::shared_data_dir() / ".." / "spec" / "gemma4-chat-vectors.json")
      .at("tokenize");
}

// The byte-fallback token of `byte` (spec §0: id = 238 + byte).
int32_t byte_id(uint8_t byte) {
  return 238 + byte;
}

TEST(Tokenizer, SpecVectors) {
  const Tokenizer& tok = shared_tokenizer();
  const json vectors = spec_tokenize_vectors();
  ASSERT_GE(vectors.size(), 20u);
  for (const json& vector : vectors) {
    const std::string text = vector.at("text");
    EXPECT_EQ(tok.encode(text, /*parse_special=*/true),
              vector.at("ids_add_special_tokens_false").get<Ids>())
        << text;
  }
}

TEST(Tokenizer, Vocabulary) {
  const Tokenizer& tok = shared_tokenizer();
  EXPECT_EQ(tok.vocab_size(), 262144);
  EXPECT_EQ(tok.token_to_id("<|turn>"), 105);
  EXPECT_EQ(tok.token_to_id("<turn|>"), 106);
  EXPECT_EQ(tok.token_to_id("\xE2\x96\x81"), 236743);  // '▁'
  EXPECT_EQ(tok.token_to_id("<0x41>"), byte_id(0x41));
  EXPECT_EQ(tok.token_to_id("no such piece anywhere"), -1);
  EXPECT_EQ(tok.id_to_token(105), "<|turn>");
  EXPECT_EQ(tok.id_to_token(107), "\n");
  EXPECT_EQ(tok.id_to_token(-1), "");
  EXPECT_EQ(tok.id_to_token(262144), "");
  EXPECT_TRUE(tok.is_special(2));
  EXPECT_TRUE(tok.is_special(258884));
  EXPECT_FALSE(tok.is_special(107));
  EXPECT_FALSE(tok.is_special(262144));
  EXPECT_EQ(tok.byte_value(byte_id(0xFF)), 0xFF);
  EXPECT_EQ(tok.byte_value(107), -1);
}

TEST(Tokenizer, SpecialTokenTextInUserContentStaysText) {
  const Tokenizer& tok = shared_tokenizer();
  // Expected ids: HF tokenizers with encode_special_tokens = True.
  EXPECT_EQ(tok.encode("<|turn>user\nHi<turn|>"),
            (Ids{236820, 236909, 887, 236813, 2364, 107, 10979, 236820, 887, 111038}));
  EXPECT_EQ(tok.encode("<bos>"), (Ids{236820, 46757, 236813}));
  EXPECT_EQ(tok.encode("<|\"|>"), (Ids{236820, 153857, 111038}));
  // With parse_special the same text is control tokens.
  EXPECT_EQ(tok.encode("<|turn>user\nHi<turn|>", true), (Ids{105, 2364, 107, 10979, 106}));
  // Whatever the user types, no special id appears and the text comes back.
  for (const std::string text : {"<|turn>", "<<|turn>>", "<|tool_call>call:x{}<tool_call|>",
                                 "<eos><pad><mask><unk>", "<|image|><|audio|><|video|>"}) {
    const Ids ids = tok.encode(text);
    for (const int32_t id : ids) EXPECT_FALSE(tok.is_special(id)) << text;
    EXPECT_EQ(tok.decode(ids), text);
  }
}

TEST(Tokenizer, RoundTripsValidUtf8) {
  const Tokenizer& tok = shared_tokenizer();
  for (const json& vector : spec_tokenize_vectors()) {
    const std::string text = vector.at("text");
    if (text.find("\xE2\x96\x81") != std::string::npos) continue;  // '▁' decodes to ' '
    EXPECT_EQ(tok.decode(tok.encode(text, true)), text);
    EXPECT_EQ(tok.decode(tok.encode(text, false)), text);
  }
  EXPECT_EQ(tok.decode(tok.encode("")), "");
  EXPECT_TRUE(tok.encode("").empty());
  // '▁' typed by a user decodes to a space, exactly as HF does.
  EXPECT_EQ(tok.decode(tok.encode("a\xE2\x96\x81"
                                  "b")),
            "a b");
}

// Words are cut into cached chunks before '▁' and around '\n', except where a merge joins the
// two sides ('>' + '▁' in the piece ">▁</"). Expected ids: HF tokenizers.
TEST(Tokenizer, ChunkBoundariesAndCacheKeepHfIds) {
  const Tokenizer& tok = shared_tokenizer();
  for (int repeat = 0; repeat < 2; ++repeat) {  // the second pass reads the chunk cache
    EXPECT_EQ(tok.encode("<td> </td>"), (Ids{236820, 2004, 107068, 2004, 236813}));
    EXPECT_EQ(tok.encode("Hello world hello world\n\nHello"),
              (Ids{9259, 1902, 29104, 1902, 108, 9259}));
  }
}

TEST(Tokenizer, InvalidUtf8BecomesByteTokens) {
  const Tokenizer& tok = shared_tokenizer();
  EXPECT_EQ(tok.encode("\xFF"), (Ids{byte_id(0xFF)}));
  // A truncated 3-byte sequence, a lone continuation byte, an encoded surrogate, an overlong.
  EXPECT_EQ(tok.encode("a\xE4\xBD"), (Ids{236746, byte_id(0xE4), byte_id(0xBD)}));
  EXPECT_EQ(tok.encode("\x80"), (Ids{byte_id(0x80)}));
  EXPECT_EQ(tok.encode("\xED\xA0\x80"), (Ids{byte_id(0xED), byte_id(0xA0), byte_id(0x80)}));
  EXPECT_EQ(tok.encode("\xC0\xAF"), (Ids{byte_id(0xC0), byte_id(0xAF)}));
  // HF's ByteFallback decoder: a run of bytes that is not valid UTF-8 gives one U+FFFD per byte.
  EXPECT_EQ(tok.decode(tok.encode("a\xE4\xBD")), "a\uFFFD\uFFFD");
  EXPECT_EQ(tok.decode(Ids{byte_id(0xF0), byte_id(0xA0), byte_id(0x80), byte_id(0x80)}),
            "\U00020000");
  EXPECT_EQ(
      tok.decode(Ids{byte_id(0xF0), byte_id(0xA0), byte_id(0x80), byte_id(0x80), byte_id(0xFF)}),
      "\uFFFD\uFFFD\uFFFD\uFFFD\uFFFD");
}

TEST(Tokenizer, DecodeSkipsSpecialAndUnknownIds) {
  const Tokenizer& tok = shared_tokenizer();
  const Ids ids{2, 105, 2364, 107, 9259, 106, -5, 262144};
  EXPECT_EQ(tok.decode(ids), "<bos><|turn>user\nHello<turn|>");
  EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), "user\nHello");
}

// Everything the detokenizer returns is valid UTF-8 and adds up to decode() of the same ids.
void expect_streams_like_decode(const Tokenizer& tok, const Ids& ids, bool skip_special) {
  IncrementalDetokenizer stream(tok, skip_special);
  std::string streamed;
  for (const int32_t id : ids) {
    const std::string_view piece = stream.push(id);
    EXPECT_TRUE(utf8::is_valid(piece));
    streamed += piece;
  }
  const std::string_view rest = stream.flush();
  EXPECT_TRUE(utf8::is_valid(rest));
  streamed += rest;
  EXPECT_FALSE(stream.has_pending());
  EXPECT_EQ(streamed, tok.decode(ids, skip_special));
}

TEST(IncrementalDetokenizer, HoldsSplitCharactersUntilComplete) {
  const Tokenizer& tok = shared_tokenizer();
  IncrementalDetokenizer stream(tok);
  EXPECT_EQ(stream.push(9259), "Hello");
  for (const uint8_t byte : {0xF0, 0xA0, 0x80, 0x80}) EXPECT_EQ(stream.push(byte_id(byte)), "");
  EXPECT_TRUE(stream.has_pending());
  EXPECT_EQ(stream.push(107), "\U00020000\n");
  EXPECT_EQ(stream.push(byte_id(0xE4)), "");
  EXPECT_EQ(stream.flush(), "\uFFFD");
  EXPECT_EQ(stream.flush(), "");
}

TEST(IncrementalDetokenizer, MatchesDecodeOnEverything) {
  const Tokenizer& tok = shared_tokenizer();
  for (const json& vector : spec_tokenize_vectors()) {
    const Ids ids = vector.at("ids_add_special_tokens_false").get<Ids>();
    expect_streams_like_decode(tok, ids, false);
    expect_streams_like_decode(tok, ids, true);
  }
  // Random id sequences rich in byte tokens, specials and invalid ids.
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> any_id(-2, 262150), byte(0, 255), kind(0, 3);
  for (int round = 0; round < 300; ++round) {
    Ids ids;
    for (int i = 0; i < 40; ++i) ids.push_back(kind(rng) < 2 ? byte_id(byte(rng)) : any_id(rng));
    expect_streams_like_decode(tok, ids, round % 2 == 0);
  }
}

TEST(Tokenizer, FromVocabSmall) {
  std::vector<std::string> tokens{"<unk>",
                                  "<|turn>",
                                  "<|image|>",
                                  "a",
                                  "b",
                                  "ab",
                                  "\xE2\x96\x81",
                                  "\xE2\x96\x81"
                                  "ab",
                                  "c"};
  std::vector<int32_t> types{2, 3, 4, 1, 1, 1, 1, 1, 1};
  const std::vector<std::string> merges{"a b", "\xE2\x96\x81 ab"};
  auto tok = Tokenizer::from_vocab(tokens, types, merges);
  ASSERT_TRUE(tok.ok()) << tok.error().to_string();
  EXPECT_EQ(tok->encode("ab ab"), (Ids{5, 7}));
  EXPECT_EQ(tok->encode("<|turn>ab", true), (Ids{1, 5}));
  // A control token's text is plain without parse_special; a user-defined token is always
  // matched (HF semantics for special=false added tokens).
  EXPECT_EQ(tok->encode("<|image|>a", false), (Ids{2, 3}));
  EXPECT_TRUE(tok->is_special(1));
  EXPECT_FALSE(tok->is_special(2));
  // No byte tokens: an unknown character becomes <unk>, consecutive ones fused.
  EXPECT_EQ(tok->encode("a\xE4\xBD\xA0\xE5\xA5\xBD"
                        "b"),
            (Ids{3, 0, 4}));
  EXPECT_EQ(tok->decode(Ids{7, 8}), " abc");
}

TEST(Tokenizer, FromVocabRejectsBadInput) {
  const std::vector<std::string> no_space{"ab"};
  EXPECT_FALSE(Tokenizer::from_vocab({"a", "b", "ab"}, {}, no_space).ok());
  const std::vector<std::string> unknown_piece{"a z"};
  EXPECT_FALSE(Tokenizer::from_vocab({"a", "b", "ab"}, {}, unknown_piece).ok());
  const std::vector<int32_t> short_types{1};
  EXPECT_FALSE(Tokenizer::from_vocab({"a", "b"}, short_types, {}).ok());
  EXPECT_FALSE(Tokenizer::from_vocab({}, {}, {}).ok());
}

// SentencePiece BPE from scores (GGUF "llama" model). Expected ids follow SentencePiece's rule by
// hand: merge the adjacent pair whose concatenation is a normal or user-defined piece with the
// highest score, leftmost on ties.
TEST(Tokenizer, FromScoredVocabMergesByScore) {
  //                              0        1   2    3    4     5     6      7       8
  std::vector<std::string> tokens{"<unk>", "a", "b", "c", "ab", "bc", "abc", "<ab>", "ba"};
  std::vector<int32_t> types{2, 1, 1, 1, 1, 1, 1, 3, 1};
  std::vector<float> scores{0, -10, -10, -10, -2, -1, -3, 0, -2};
  auto tok = Tokenizer::from_scored_vocab(tokens, types, scores);
  ASSERT_TRUE(tok.ok()) << tok.error().to_string();
  // "abc": bc (-1) beats ab (-2), then a+bc -> abc.
  EXPECT_EQ(tok->encode("abc"), (Ids{6}));
  // "aba": ab and ba tie at -2: the leftmost pair wins.
  EXPECT_EQ(tok->encode("aba"), (Ids{4, 1}));
  // "bab": ba (-2) is left of ab (-2).
  EXPECT_EQ(tok->encode("bab"), (Ids{8, 2}));
  // A control piece is never a merge result; with parse_special its text is the token.
  EXPECT_EQ(tok->encode("<ab>"), (Ids{0, 4, 0}));
  EXPECT_EQ(tok->encode("<ab>", true), (Ids{7}));
  EXPECT_EQ(tok->decode(Ids{6, 4}), "abcab");
}

TEST(Tokenizer, FromScoredVocabRejectsBadInput) {
  const std::vector<float> one_score{0};
  EXPECT_FALSE(Tokenizer::from_scored_vocab({"a", "b"}, {}, one_score).ok());
  const std::vector<float> nan_score{0, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_FALSE(Tokenizer::from_scored_vocab({"a", "b"}, {}, nan_score).ok());
}

// The GGUF path on the real vocabulary (tokens, types and "a b" merges taken from the JSON, as a
// GGUF converter writes them) tokenizes like the JSON path.
TEST(Tokenizer, FromVocabMatchesJson) {
  const json file = read_json(tokenizer_path());
  std::vector<std::string> tokens(262144);
  std::vector<int32_t> types(tokens.size(), static_cast<int32_t>(TokenType::kNormal));
  for (const auto& [piece, id] : file.at("model").at("vocab").items()) {
    tokens[id.get<size_t>()] = piece;
  }
  for (const json& added : file.at("added_tokens")) {
    types[added.at("id").get<size_t>()] = static_cast<int32_t>(TokenType::kControl);
  }
  for (int byte = 0; byte < 256; ++byte)
    types[byte_id(byte)] = static_cast<int32_t>(TokenType::kByte);
  std::vector<std::string> merges;
  for (const json& pair : file.at("model").at("merges")) {
    merges.push_back(pair[0].get<std::string>() + " " + pair[1].get<std::string>());
  }
  auto from_vocab = Tokenizer::from_vocab(tokens, types, merges);
  ASSERT_TRUE(from_vocab.ok()) << from_vocab.error().to_string();
  const Tokenizer& from_json = shared_tokenizer();
  for (const json& vector : spec_tokenize_vectors()) {
    const std::string text = vector.at("text");
    EXPECT_EQ(from_vocab->encode(text, true), from_json.encode(text, true)) << text;
    EXPECT_EQ(from_vocab->encode(text, false), from_json.encode(text, false)) << text;
  }
}

TEST(Tokenizer, JsonErrors) {
  EXPECT_EQ(Tokenizer::from_json_file("/nonexistent/tokenizer.json").error().code,
            ErrorCode::kNotFound);
  EXPECT_EQ(Tokenizer::from_json_text("{").error().code, ErrorCode::kInvalidArgument);
  EXPECT_EQ(Tokenizer::from_json_text("{}").error().code, ErrorCode::kInvalidArgument);
  const std::string decoder =
      R"("decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": )"
      R"({"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]})";
  const std::string good = "{" + decoder +
                           R"(, "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2},
                              "merges": [["a", "b"]]}})";
  auto tok = Tokenizer::from_json_text(good);
  ASSERT_TRUE(tok.ok()) << tok.error().to_string();
  EXPECT_EQ(tok->encode("ab"), (Ids{2}));
  const std::string bad_merge = "{" + decoder +
                                R"(, "model": {"type": "BPE", "vocab": {"a": 0, "b": 1},
                                   "merges": [["a", "b"]]}})";
  EXPECT_EQ(Tokenizer::from_json_text(bad_merge).error().code, ErrorCode::kInvalidArgument);
  const std::string nfkc = "{" + decoder +
                           R"(, "normalizer": {"type": "NFKC"}, "model": {"type": "BPE",
                              "vocab": {"a": 0}, "merges": []}})";
  EXPECT_EQ(Tokenizer::from_json_text(nfkc).error().code, ErrorCode::kUnsupported);
  const std::string wordpiece = "{" + decoder + R"(, "model": {"type": "WordPiece", "vocab": {}}})";
  EXPECT_EQ(Tokenizer::from_json_text(wordpiece).error().code, ErrorCode::kUnsupported);
  const std::string vocab_array = "{" + decoder + R"(, "model": {"vocab": {"a": [0]}}})";
  EXPECT_EQ(Tokenizer::from_json_text(vocab_array).error().code, ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace gemma4::text
