#include "cli/run_prompt.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "cli/model_loader.h"
#include "text/chat_template.h"

namespace gemma4::cli {
namespace {

using nlohmann::ordered_json;

// --messages FILE: a JSON array of chat messages, or {"messages": [...], "tools": [...]}.
Expected<std::pair<ordered_json, ordered_json>> read_messages(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return make_error(ErrorCode::kNotFound, "--messages: cannot open {}", file);
  ordered_json document = ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (document.is_array()) return std::pair{std::move(document), ordered_json()};
  if (document.is_object() && document.contains("messages")) {
    return std::pair{document["messages"], document.value("tools", ordered_json())};
  }
  return make_error(ErrorCode::kInvalidArgument,
                    "--messages {}: expected a JSON array of chat messages or an object with "
                    "\"messages\"",
                    file);
}

}  // namespace

Expected<TextPromptRun> TextPromptRun::open(const std::filesystem::path& checkpoint,
                                            const TextPromptOptions& options,
                                            std::vector<int32_t> eos_ids) {
  if (!options.prompt.empty() && !options.messages_file.empty())
    return make_error(ErrorCode::kInvalidArgument, "give either -p or --messages, not both");
  if (options.raw && (options.prompt.empty() || options.think))
    return make_error(ErrorCode::kInvalidArgument,
                      "--raw takes the prompt from -p and cannot be combined with --think");

  GEMMA4_ASSIGN_OR_RETURN(text::Tokenizer tokenizer, load_tokenizer(checkpoint));
  auto shared_tokenizer = std::make_unique<text::Tokenizer>(std::move(tokenizer));

  std::vector<int32_t> ids;
  if (options.raw) {
    // The caller wrote the whole prompt: control-token text in it is meant as control tokens.
    const int32_t bos = shared_tokenizer->token_to_id("<bos>");
    if (bos >= 0) ids.push_back(bos);
    for (const int32_t id : shared_tokenizer->encode(options.prompt, /*parse_special=*/true))
      ids.push_back(id);
  } else {
    GEMMA4_ASSIGN_OR_RETURN(auto chat_template, load_chat_template(checkpoint));
    ordered_json messages = ordered_json::array(), tools;
    if (options.messages_file.empty()) {
      messages.push_back({{"role", "user"}, {"content", options.prompt}});
    } else {
      GEMMA4_ASSIGN_OR_RETURN(auto conversation, read_messages(options.messages_file));
      messages = std::move(conversation.first);
      tools = std::move(conversation.second);
    }
    text::ChatTemplateOptions template_options;
    template_options.add_generation_prompt = true;
    template_options.enable_thinking = options.think;
    auto prompt = chat_template.render_with_spans(messages, tools, template_options);
    if (!prompt.ok()) return prompt.error().with_context("chat messages");
    // As the server does: only the template's own text becomes control tokens.
    ids = shared_tokenizer->encode_protected(prompt->text, prompt->untrusted);
  }

  // The chat format's end-of-turn tokens (also for --raw prompts, which follow the format; a
  // checkpoint without a template gets Gemma 4's).
  std::vector<int32_t> stop_ids = std::move(eos_ids);
  const auto chat_template = load_chat_template(checkpoint);
  const auto format = chat_template.ok()
                          ? *chat_template
                          : text::ChatTemplate::of_variant(text::ChatTemplate::Variant::kCompact);
  for (const int32_t id : format.stop_token_ids(*shared_tokenizer)) stop_ids.push_back(id);
  return TextPromptRun(std::move(shared_tokenizer), std::move(ids), std::move(stop_ids));
}

bool TextPromptRun::is_stop(int32_t id) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
}

void TextPromptRun::print_token(int32_t id) {
  if (is_stop(id)) return;
  const std::string_view text = detokenizer_.push(id);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

void TextPromptRun::finish() {
  const std::string_view text = detokenizer_.flush();
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

}  // namespace gemma4::cli
