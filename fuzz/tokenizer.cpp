// Fuzzes the tokenizer with arbitrary bytes: encode (with and without special-token parsing),
// decode, and streaming detokenization must not crash, must agree with each other, and must
// round-trip valid UTF-8 that holds no U+2581. Needs GEMMA4_SHARED_DATA (the folder holding
// tokenizer/tokenizer.json).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "text/detokenizer.h"
#include "text/tokenizer.h"
#include "text/tokenizer_utf8.h"

namespace {

const gemma4::text::Tokenizer* tokenizer = nullptr;

void check(bool condition, const char* what) {
  if (condition) return;
  std::fprintf(stderr, "fuzz_tokenizer: %s\n", what);
  std::abort();
}

std::string stream_decode(std::span<const int32_t> ids, bool skip_special) {
  gemma4::text::IncrementalDetokenizer stream(*tokenizer, skip_special);
  std::string text;
  for (const int32_t id : ids) {
    const std::string_view piece = stream.push(id);
    check(gemma4::text::utf8::is_valid(piece), "detokenizer returned invalid UTF-8");
    text += piece;
  }
  text += stream.flush();
  return text;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* shared_data = std::getenv("GEMMA4_SHARED_DATA");
  if (shared_data == nullptr || *shared_data == '\0') {
    std::fprintf(stderr, "fuzz_tokenizer: set GEMMA4_SHARED_DATA to the shared data folder\n");
    std::exit(1);
  }
  auto loaded = gemma4::text::Tokenizer::from_json_file(std::filesystem::path(shared_data) /
                                                        "tokenizer" / "tokenizer.json");
  if (!loaded.ok()) {
    std::fprintf(stderr, "fuzz_tokenizer: %s\n", loaded.error().to_string().c_str());
    std::exit(1);
  }
  tokenizer = new gemma4::text::Tokenizer(std::move(loaded).value());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const bool round_trips =
      gemma4::text::utf8::is_valid(text) && text.find("\xE2\x96\x81") == std::string_view::npos;
  for (const bool parse_special : {false, true}) {
    const std::vector<int32_t> ids = tokenizer->encode(text, parse_special);
    for (const int32_t id : ids) {
      check(tokenizer->has_id(id), "encode produced an id outside the vocabulary");
      check(parse_special || !tokenizer->is_special(id), "user text became a special token");
    }
    const std::string decoded = tokenizer->decode(ids);
    check(gemma4::text::utf8::is_valid(decoded), "decode returned invalid UTF-8");
    check(!round_trips || decoded == text, "decode(encode(x)) != x");
    check(stream_decode(ids, false) == decoded, "streaming decode differs from decode");
  }
  // The same bytes read as arbitrary ids (valid or not).
  std::vector<int32_t> ids(size / sizeof(int32_t));
  for (size_t i = 0; i < ids.size(); ++i) {
    std::memcpy(&ids[i], data + i * sizeof(int32_t), sizeof(int32_t));
    if (i % 2 == 0) ids[i] = static_cast<int32_t>(static_cast<uint32_t>(ids[i]) % 300000);
  }
  for (const bool skip_special : {false, true}) {
    const std::string decoded = tokenizer->decode(ids, skip_special);
    check(gemma4::text::utf8::is_valid(decoded), "decode of arbitrary ids is invalid UTF-8");
    check(stream_decode(ids, skip_special) == decoded, "streaming decode of arbitrary ids differs");
  }
  return 0;
}
