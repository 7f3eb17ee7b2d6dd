// `gemma4 tokenize`: JSON in on stdin, JSON out, for checking tokenization by hand and for the
// differential tests against HF `tokenizers` (tests/text/test_tokenizer_diff.py) and, for a GGUF
// file's tokenizer, SentencePiece (tests/text/test_gguf_tokenizer_diff.py).
//
//   encode:   {"text": "..."}  or  {"text_base64": "..."}  [, "parse_special": bool]
//             -> {"ids": [...]}
//   --decode: {"ids": [...]} [, "skip_special": bool]  -> {"text": "..."}
//   --jsonl:  one request per input line, one response per output line; a bad line answers
//             {"error": "..."} and the exit status becomes 1.
//
// "text_base64" carries bytes that are not valid UTF-8 (JSON strings cannot). "parse_special"
// defaults to true here, like HF's encode: the text of a control token such as "<|turn>"
// becomes its id; false tokenizes it as plain characters, as the engine does for user text.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <iostream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>

#include "cli/command.h"
#include "model/gguf_text.h"
#include "text/tokenizer.h"

namespace gemma4::cli {
namespace {

using json = nlohmann::json;

struct TokenizeOptions {
  std::string tokenizer_path;
  bool decode = false;
  bool jsonl = false;
};

Expected<std::string> decode_base64(std::string_view encoded) {
  constexpr std::string_view kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::array<int8_t, 256> value_of{};
  value_of.fill(-1);
  for (size_t i = 0; i < kAlphabet.size(); ++i) {
    value_of[static_cast<uint8_t>(kAlphabet[i])] = static_cast<int8_t>(i);
  }
  while (!encoded.empty() && encoded.back() == '=') encoded.remove_suffix(1);
  std::string bytes;
  uint32_t accumulator = 0;
  int bits = 0;
  for (const char c : encoded) {
    const int8_t value = value_of[static_cast<uint8_t>(c)];
    if (value < 0) return make_error(ErrorCode::kInvalidArgument, "text_base64 is not base64");
    accumulator = (accumulator << 6) | static_cast<uint32_t>(value);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      bytes += static_cast<char>((accumulator >> bits) & 0xFF);
    }
  }
  if (bits >= 6) return make_error(ErrorCode::kInvalidArgument, "text_base64 has a bad length");
  return bytes;
}

Status check_keys(const json& request, std::initializer_list<std::string_view> allowed) {
  for (const auto& [key, value] : request.items()) {
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      return make_error(ErrorCode::kInvalidArgument, "unknown key \"{}\"", key);
    }
  }
  return {};
}

Expected<bool> optional_bool(const json& request, const char* key, bool default_value) {
  if (!request.contains(key)) return default_value;
  if (!request[key].is_boolean()) {
    return make_error(ErrorCode::kInvalidArgument, "\"{}\" must be true or false", key);
  }
  return request[key].get<bool>();
}

Expected<json> encode_request(const text::Tokenizer& tokenizer, const json& request) {
  GEMMA4_RETURN_IF_ERROR(check_keys(request, {"text", "text_base64", "parse_special"}));
  GEMMA4_ASSIGN_OR_RETURN(const bool parse_special, optional_bool(request, "parse_special", true));
  std::string text;
  if (request.contains("text") == request.contains("text_base64")) {
    return make_error(ErrorCode::kInvalidArgument,
                      "expected exactly one of \"text\" and \"text_base64\"");
  }
  if (request.contains("text")) {
    if (!request["text"].is_string()) {
      return make_error(ErrorCode::kInvalidArgument, "\"text\" must be a string");
    }
    text = request["text"].get<std::string>();
  } else {
    if (!request["text_base64"].is_string()) {
      return make_error(ErrorCode::kInvalidArgument, "\"text_base64\" must be a string");
    }
    GEMMA4_ASSIGN_OR_RETURN(text, decode_base64(request["text_base64"].get<std::string>()));
  }
  return json{{"ids", tokenizer.encode(text, parse_special)}};
}

Expected<json> decode_request(const text::Tokenizer& tokenizer, const json& request) {
  GEMMA4_RETURN_IF_ERROR(check_keys(request, {"ids", "skip_special"}));
  GEMMA4_ASSIGN_OR_RETURN(const bool skip_special, optional_bool(request, "skip_special", false));
  if (!request.contains("ids") || !request["ids"].is_array()) {
    return make_error(ErrorCode::kInvalidArgument, "expected \"ids\": a list of token ids");
  }
  std::vector<int32_t> ids;
  ids.reserve(request["ids"].size());
  for (const json& id : request["ids"]) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() >= tokenizer.vocab_size() ||
        !tokenizer.has_id(static_cast<int32_t>(id.get<int64_t>()))) {
      return make_error(ErrorCode::kInvalidArgument, "{} is not a token id (vocabulary size {})",
                        id.dump(), tokenizer.vocab_size());
    }
    ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return json{{"text", tokenizer.decode(ids, skip_special)}};
}

Expected<json> handle_request(const text::Tokenizer& tokenizer, std::string_view input,
                              bool decode) {
  json request = json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (request.is_discarded()) return make_error(ErrorCode::kInvalidArgument, "invalid JSON");
  if (!request.is_object()) return make_error(ErrorCode::kInvalidArgument, "expected an object");
  return decode ? decode_request(tokenizer, request) : encode_request(tokenizer, request);
}

int run_tokenize(const TokenizeOptions& options) {
  auto tokenizer = options.tokenizer_path.ends_with(".gguf")
                       ? model::tokenizer_from_gguf(options.tokenizer_path)
                       : text::Tokenizer::from_json_file(options.tokenizer_path);
  if (!tokenizer.ok()) {
    std::cerr << "gemma4 tokenize: " << tokenizer.error().to_string() << "\n";
    return 1;
  }
  std::ios::sync_with_stdio(false);
  if (!options.jsonl) {
    const std::string input{std::istreambuf_iterator<char>(std::cin), {}};
    auto response = handle_request(*tokenizer, input, options.decode);
    if (!response.ok()) {
      std::cerr << "gemma4 tokenize: " << response.error().to_string() << "\n";
      return 1;
    }
    std::cout << response->dump() << "\n";
    return 0;
  }
  int exit_code = 0;
  std::string line;
  for (size_t line_number = 1; std::getline(std::cin, line); ++line_number) {
    auto response = handle_request(*tokenizer, line, options.decode);
    if (response.ok()) {
      std::cout << response->dump() << "\n";
    } else {
      const std::string message =
          fmt::format("line {}: {}", line_number, response.error().to_string());
      std::cerr << "gemma4 tokenize: " << message << "\n";
      std::cout << json{{"error", message}}.dump() << "\n";
      exit_code = 1;
    }
  }
  std::cout.flush();
  return exit_code;
}

void register_tokenize(CLI::App& app, int& exit_code) {
  auto options = std::make_shared<TokenizeOptions>();
  CLI::App* command = app.add_subcommand(
      "tokenize",
      "Text <-> token ids with a tokenizer.json. Reads JSON on stdin: {\"text\": ...} or "
      "{\"text_base64\": ...} [\"parse_special\": true] -> {\"ids\": [...]}; with --decode "
      "{\"ids\": [...]} [\"skip_special\": false] -> {\"text\": ...}");
  command
      ->add_option("--tokenizer", options->tokenizer_path,
                   "tokenizer.json file, or a .gguf file (its tokenizer metadata)")
      ->required();
  command->add_flag("--decode", options->decode, "ids -> text instead of text -> ids");
  command->add_flag("--jsonl", options->jsonl,
                    "one JSON request per input line, one response per output line");
  command->callback([options, &exit_code] { exit_code = run_tokenize(*options); });
}

}  // namespace

GEMMA4_COMMAND(tokenize, register_tokenize);

}  // namespace gemma4::cli
