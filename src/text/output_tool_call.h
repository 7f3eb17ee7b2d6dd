// Gemma 4 tool-call syntax -> OpenAI JSON (spec gemma4-chat-format.md section 4, strict policy).
// Used by OutputParser once a call is closed; exposed for its unit tests.
#pragma once

#include <string>
#include <string_view>

#include "core/status.h"

namespace gemma4::text {

struct GemmaToolCall {
  std::string name;
  std::string arguments_json;  // compact JSON object, keys in emission order
};

// Parses the text between `<|tool_call>call:` and `<tool_call|>`: NAME (1+ of [A-Za-z0-9_.-])
// optionally followed by an argument object `{key:value,…}`; no object means `{}`.
// Values: `<|"|>`-delimited strings (verbatim, no escapes; JSON-escaped on output), JSON-style
// numbers (copied verbatim when they are JSON numbers, else normalized: +5 -> 5, .5 -> 0.5,
// 5. -> 5.0, 007 -> 7), true/false/null, objects, arrays. Keys are bare (any text up to `:`
// without structural characters, trimmed) or `<|"|>`-quoted. Duplicate keys keep the first value.
// Whitespace between tokens is ignored. Rejected (kInvalidArgument, message says where): bare
// words, trailing commas, JSON/Python quoted strings, unbalanced brackets, trailing text.
// Invalid UTF-8 inside strings becomes U+FFFD so the result is always valid JSON.
Expected<GemmaToolCall> parse_gemma_tool_call(std::string_view body);

}  // namespace gemma4::text
