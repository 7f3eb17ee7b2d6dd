// Gemma 4 (and Gemma 3) chat template: a native renderer of the 2026-07-09 "Google Gemma 4
// Canonical Chat Template" (spec gemma4-chat-format.md section 2). Not a Jinja interpreter: the
// template's rules are coded here and checked byte-for-byte against Python Jinja2 rendering the
// official files (tests/text/test_chat_template_diff.py).
//
// Fidelity policy: wherever the official template renders something (including its quirks:
// union types printed as Python lists, the tool_call_id name resolution where missing == missing,
// the trailing space after each system content part, content after tool calls), this renderer
// produces the same bytes. Where Jinja2 would raise (a tool call whose arguments are not an
// object, a non-mapping `properties`, a string concatenated with a number) this returns an Error.
// Additionally, and on purpose, it refuses input that Jinja would render silently but that is
// certainly a client mistake: unknown roles, messages that are not objects, content that is
// neither a string, a list of parts nor null.
#pragma once

#include <nlohmann/json.hpp>

#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

namespace gemma4::text {

// The variables the template reads besides `messages` and `tools` (HF apply_chat_template kwargs).
struct ChatTemplateOptions {
  bool add_generation_prompt = false;
  bool enable_thinking = false;
  // Keep the reasoning of earlier tool-calling assistant messages even after a later user turn.
  bool preserve_thinking = false;
  std::string bos_token = "<bos>";

  // Reads HF-style kwargs ({"add_generation_prompt": true, "enable_thinking": true,
  // "bos_token": "<bos>", ...}); flags follow Python truthiness like the template does. Keys the
  // template does not read are ignored.
  static Expected<ChatTemplateOptions> from_kwargs(const nlohmann::ordered_json& kwargs);
};

// A rendered prompt and the byte ranges [begin, end) of it that hold caller-supplied text (message
// content, reasoning, tool names, arguments, results and declarations, system text): everything
// the template does not write itself. Sorted, disjoint, never empty; for
// Tokenizer::encode_protected, so that such text never becomes control tokens.
struct RenderedPrompt {
  std::string text;
  std::vector<std::pair<size_t, size_t>> untrusted;
};

class ChatTemplate {
 public:
  // compact: E2B/E4B. full: 12B/26B-A4B/31B; identical except that with thinking off the
  // generation prompt also pre-fills an empty thought block `<|channel>thought\n<channel|>`.
  // gemma3: Gemma 3's template (google/gemma-3-*-it tokenizer_config.json): `<start_of_turn>`
  // turns, the system message folded into the first user turn, no thinking, no tools.
  enum class Variant { kCompact, kFull, kGemma3 };

  // Identifies the variant from a checkpoint's chat_template.jinja text. Errors (kUnsupported,
  // message says why) for text that is neither a Gemma 4 nor the Gemma 3 template, or is an
  // older, pre-canonical Gemma 4 template (launch / April 2026 revisions); callers who want the
  // canonical rules anyway use of_variant().
  static Expected<ChatTemplate> from_template_source(std::string_view jinja_text);
  static ChatTemplate of_variant(Variant variant) { return ChatTemplate(variant); }

  Variant variant() const { return variant_; }

  // The special-token texts that end a model turn in this format (Gemma 4: <turn|>, <eos>,
  // <|tool_response>; Gemma 3: <end_of_turn>, <eos>).
  std::span<const std::string_view> stop_token_texts() const;
  // Their ids in `tokenizer` (texts the vocabulary lacks are left out).
  std::vector<int32_t> stop_token_ids(const Tokenizer& tokenizer) const;
  // How to parse what the model generates (OutputParser::for_prompt).
  OutputFormat output_format() const {
    return variant_ == Variant::kGemma3 ? OutputFormat::kGemma3 : OutputFormat::kGemma4;
  }

  // Gemma 3 renders roles system (first message only, folded into the first user turn), user
  // and assistant, which must alternate; content as a string or a list of text/image parts;
  // tools, reasoning and the thinking options are not part of its format and are ignored, as
  // the Jinja template ignores them.
  //
  // Gemma 4 renders OpenAI-shaped messages (roles system, developer, user, assistant, tool; content
  // as a string, null, or a list of parts {type:text|image|image_url|audio|input_audio|video};
  // assistant tool_calls whose function.arguments is an object, a JSON string holding an object,
  // or null; tool messages with tool_call_id/name; reasoning / reasoning_content) and tools
  // ([{type:"function", function:{name, description, parameters, response?}}] or null) into the
  // prompt text. The prompt starts with options.bos_token (the text "<bos>", which the tokenizer
  // turns into id 2). Errors are kInvalidArgument with a message meant for an API client.
  //
  // Object key order matters only for keys that compare equal case-insensitively (the template
  // sorts keys case-insensitively and keeps input order for ties): pass ordered_json to keep the
  // client's order there; the nlohmann::json overload sees keys in byte order.
  Expected<std::string> render(const nlohmann::ordered_json& messages,
                               const nlohmann::ordered_json& tools,
                               const ChatTemplateOptions& options) const;
  Expected<std::string> render(const nlohmann::json& messages, const nlohmann::json& tools,
                               const ChatTemplateOptions& options) const;
  // The same text, with the ranges that came from the caller.
  Expected<RenderedPrompt> render_with_spans(const nlohmann::ordered_json& messages,
                                             const nlohmann::ordered_json& tools,
                                             const ChatTemplateOptions& options) const;
  Expected<RenderedPrompt> render_with_spans(const nlohmann::json& messages,
                                             const nlohmann::json& tools,
                                             const ChatTemplateOptions& options) const;

 private:
  explicit ChatTemplate(Variant variant) : variant_(variant) {}
  Variant variant_;
};

const char* chat_template_variant_name(ChatTemplate::Variant variant);

}  // namespace gemma4::text
