// Gemma 4 chat template: a native renderer of the 2026-07-09 "Google Gemma 4 Canonical Chat
// Template" (spec gemma4-chat-format.md section 2). Not a Jinja interpreter: the template's rules
// are coded here and checked byte-for-byte against Python Jinja2 rendering the official files
// (tests/text/test_chat_template_diff.py).
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

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

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
  enum class Variant { kCompact, kFull };

  // Identifies the variant from a checkpoint's chat_template.jinja text. Errors (kUnsupported,
  // message says why) for text that is not a Gemma 4 template or is an older, pre-canonical
  // Gemma 4 template (launch / April 2026 revisions); callers who want the canonical rules anyway
  // use of_variant().
  static Expected<ChatTemplate> from_template_source(std::string_view jinja_text);
  static ChatTemplate of_variant(Variant variant) { return ChatTemplate(variant); }

  Variant variant() const { return variant_; }

  // Renders OpenAI-shaped messages (roles system, developer, user, assistant, tool; content as a
  // string, null, or a list of parts {type:text|image|image_url|audio|input_audio|video};
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
