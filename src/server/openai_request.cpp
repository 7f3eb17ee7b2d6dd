#include "server/openai_request.h"

#include <fmt/format.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <random>
#include <set>

namespace gemma4::server {

using nlohmann::ordered_json;

namespace {

// Validation failures inside this file unwind to the parse_* entry points, which turn them back
// into values; nothing escapes this translation unit.
struct RequestError {
  ApiError error;
};

[[noreturn]] void fail(const std::string& param, const std::string& message) {
  throw RequestError{invalid_request(message, param)};
}

const char* type_name(const ordered_json& value) {
  if (value.is_null()) return "null";
  if (value.is_boolean()) return "a boolean";
  if (value.is_number()) return "a number";
  if (value.is_string()) return "a string";
  if (value.is_array()) return "an array";
  return "an object";
}

// Typed access to optional fields of one JSON object; null counts as absent (as OpenAI does).
class Fields {
 public:
  Fields(const ordered_json& object, std::string prefix)
      : object_(object), prefix_(std::move(prefix)) {}

  const ordered_json* find(const char* key) const {
    auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  std::string name(const char* key) const { return prefix_ + key; }

  std::optional<bool> boolean(const char* key) const {
    const ordered_json* value = find(key);
    if (!value) return std::nullopt;
    if (!value->is_boolean())
      fail(name(key), fmt::format("'{}' must be a boolean, not {}", name(key), type_name(*value)));
    return value->get<bool>();
  }
  std::optional<double> number(const char* key, double low, double high) const {
    const ordered_json* value = find(key);
    if (!value) return std::nullopt;
    if (!value->is_number())
      fail(name(key), fmt::format("'{}' must be a number, not {}", name(key), type_name(*value)));
    const double x = value->get<double>();
    if (!std::isfinite(x) || x < low || x > high) {
      fail(name(key),
           fmt::format("'{}' is {}, but must be between {} and {}", name(key), x, low, high));
    }
    return x;
  }
  std::optional<int64_t> integer(const char* key, int64_t low, int64_t high) const {
    const ordered_json* value = find(key);
    if (!value) return std::nullopt;
    if (!value->is_number_integer()) {
      fail(name(key), fmt::format("'{}' must be an integer, not {}", name(key), type_name(*value)));
    }
    if (value->is_number_unsigned() && value->get<uint64_t>() > static_cast<uint64_t>(high)) {
      fail(name(key), fmt::format("'{}' must be at most {}", name(key), high));
    }
    const int64_t x = value->get<int64_t>();
    if (x < low || x > high) {
      fail(name(key),
           fmt::format("'{}' is {}, but must be between {} and {}", name(key), x, low, high));
    }
    return x;
  }
  std::optional<std::string> string(const char* key) const {
    const ordered_json* value = find(key);
    if (!value) return std::nullopt;
    if (!value->is_string())
      fail(name(key), fmt::format("'{}' must be a string, not {}", name(key), type_name(*value)));
    return value->get<std::string>();
  }
  const ordered_json* object(const char* key) const {
    const ordered_json* value = find(key);
    if (value && !value->is_object())
      fail(name(key), fmt::format("'{}' must be an object, not {}", name(key), type_name(*value)));
    return value;
  }
  const ordered_json* array(const char* key) const {
    const ordered_json* value = find(key);
    if (value && !value->is_array())
      fail(name(key), fmt::format("'{}' must be an array, not {}", name(key), type_name(*value)));
    return value;
  }

 private:
  const ordered_json& object_;
  std::string prefix_;
};

// Top-level fields we understand: OpenAI's own plus the common server extensions (vLLM,
// llama-server). Anything else is refused like OpenAI does, so typos do not pass silently.
// Both endpoints take the model, streaming, sampling and output fields, plus `own`.
std::set<std::string> known_fields(std::initializer_list<std::string> own) {
  std::set<std::string> fields = {
      "model", "stream", "stream_options",   "temperature",       "top_p",
      "top_k", "min_p",  "presence_penalty", "frequency_penalty", "repetition_penalty",
      "seed",  "stop",   "max_tokens",       "logit_bias",        "logprobs",
      "n",     "user",   "cache_prompt"};
  fields.insert(own);
  return fields;
}

const std::set<std::string>& chat_fields() {
  static const std::set<std::string> fields =
      known_fields({"messages", "tools", "tool_choice", "parallel_tool_calls",
                    "max_completion_tokens", "top_logprobs", "metadata", "store", "service_tier",
                    "modalities", "response_format", "reasoning_effort", "chat_template_kwargs",
                    "enable_thinking", "prompt_cache_key", "safety_identifier", "verbosity"});
  return fields;
}

const std::set<std::string>& completion_fields() {
  static const std::set<std::string> fields = known_fields({"prompt", "best_of", "echo", "suffix"});
  return fields;
}

void check_known_fields(const ordered_json& body, const std::set<std::string>& known) {
  for (const auto& [key, value] : body.items()) {
    if (!known.contains(key))
      fail(key, fmt::format("Unrecognized request argument supplied: {}", key));
  }
}

void check_model(const Fields& fields, const ModelNames& names) {
  if (auto model = fields.string("model"); model && !names.accepts(*model)) {
    throw RequestError{ApiError{
        400,
        fmt::format("The model '{}' does not exist; this server serves '{}'", *model, names.id),
        "invalid_request_error", "model", "model_not_found"}};
  }
}

// Gemma's recommended sampling defaults (generation_config.json of the IT checkpoints) apply
// where the request says nothing.
void parse_settings(const ordered_json& body, int32_t vocab_size, bool chat,
                    GenerationSettings& out) {
  Fields fields(body, "");
  if (auto n = fields.integer("n", 1, std::numeric_limits<int32_t>::max()); n && *n != 1) {
    fail("n", "only n=1 is supported");
  }
  out.stream = fields.boolean("stream").value_or(false);
  if (const ordered_json* options = fields.object("stream_options")) {
    if (!out.stream)
      fail("stream_options", "'stream_options' is only allowed when 'stream' is true");
    out.include_usage =
        Fields(*options, "stream_options.").boolean("include_usage").value_or(false);
  }
  auto& s = out.sampling;
  s.temperature = static_cast<float>(fields.number("temperature", 0.0, 2.0).value_or(1.0));
  s.top_p = static_cast<float>(fields.number("top_p", 0.0, 1.0).value_or(0.95));
  if (s.top_p <= 0.0f) fail("top_p", "'top_p' must be greater than 0");
  // -1 means "off" in vLLM and llama-server.
  const int64_t top_k = fields.integer("top_k", -1, vocab_size).value_or(64);
  s.top_k = top_k < 0 ? 0 : static_cast<int>(top_k);
  s.min_p = static_cast<float>(fields.number("min_p", 0.0, 1.0).value_or(0.0));
  s.presence_penalty =
      static_cast<float>(fields.number("presence_penalty", -2.0, 2.0).value_or(0.0));
  s.frequency_penalty =
      static_cast<float>(fields.number("frequency_penalty", -2.0, 2.0).value_or(0.0));
  s.repetition_penalty =
      static_cast<float>(fields.number("repetition_penalty", 0.01, 10.0).value_or(1.0));
  if (auto seed = fields.integer("seed", std::numeric_limits<int64_t>::min(),
                                 std::numeric_limits<int64_t>::max())) {
    s.seed = static_cast<uint64_t>(*seed);
  } else {
    s.seed = std::random_device{}() * 0x9E3779B97F4A7C15ull + std::random_device{}();
  }
  if (const ordered_json* bias = fields.object("logit_bias")) {
    for (const auto& [key, value] : bias->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != key.size() || id < 0 || id >= vocab_size) {
        fail("logit_bias",
             fmt::format("logit_bias key '{}' is not a token id below {}", key, vocab_size));
      }
      if (!value.is_number() || !std::isfinite(value.get<double>()) ||
          std::abs(value.get<double>()) > 100.0) {
        fail("logit_bias",
             fmt::format("logit_bias['{}'] must be a number between -100 and 100", key));
      }
      s.logit_bias.emplace_back(static_cast<int32_t>(id), value.get<float>());
    }
  }
  if (chat) {
    out.logprobs = fields.boolean("logprobs").value_or(false);
    if (auto top = fields.integer("top_logprobs", 0, 20)) {
      if (!out.logprobs) fail("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
      s.top_logprobs = static_cast<int>(*top);
    }
  } else if (auto top = fields.integer("logprobs", 0, 5)) {
    out.logprobs = true;
    s.top_logprobs = static_cast<int>(*top);
  }
  // max_completion_tokens is the newer name; it wins when both are present.
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (!chat && std::string_view(key) == "max_completion_tokens") continue;
    if (auto max = fields.integer(key, 1, std::numeric_limits<int32_t>::max()))
      out.max_tokens = *max;
  }
  if (const ordered_json* stop = fields.find("stop")) {
    auto add = [&](const ordered_json& item) {
      if (!item.is_string()) fail("stop", "'stop' must be a string or an array of strings");
      if (item.get_ref<const std::string&>().empty())
        fail("stop", "stop sequences must not be empty");
      out.stop.push_back(item.get<std::string>());
    };
    if (stop->is_array()) {
      if (stop->size() > 16) fail("stop", "at most 16 stop sequences are supported");
      for (const auto& item : *stop) add(item);
    } else {
      add(*stop);
    }
  }
  if (Status status = s.validate(vocab_size); !status.ok()) fail("", status.error().message);
}

bool valid_function_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.'))
      return false;
  }
  return true;
}

void check_tools(const ordered_json& tools) {
  std::set<std::string> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string where = fmt::format("tools[{}]", i);
    const ordered_json& tool = tools[i];
    if (!tool.is_object()) fail(where, fmt::format("'{}' must be an object", where));
    Fields fields(tool, where + ".");
    if (fields.string("type").value_or("") != "function") {
      fail(where + ".type", fmt::format("'{}.type' must be \"function\"", where));
    }
    const ordered_json* function = fields.object("function");
    if (!function) fail(where + ".function", fmt::format("'{}.function' is required", where));
    Fields function_fields(*function, where + ".function.");
    auto name = function_fields.string("name");
    if (!name || !valid_function_name(*name)) {
      fail(where + ".function.name",
           "function names must be 1-64 characters of a-z, A-Z, 0-9, _, - or .");
    }
    if (!names.insert(*name).second)
      fail(where + ".function.name", fmt::format("duplicate tool name '{}'", *name));
    function_fields.string("description");
    if (const ordered_json* parameters = function_fields.object("parameters")) {
      if (auto it = parameters->find("properties"); it != parameters->end() && !it->is_object()) {
        fail(where + ".function.parameters", "'parameters.properties' must be an object");
      }
    }
  }
}

void parse_tool_choice(const Fields& fields, ChatRequest& out) {
  const ordered_json* choice = fields.find("tool_choice");
  if (!choice) return;
  if (choice->is_string()) {
    const std::string& value = choice->get_ref<const std::string&>();
    if (value == "auto")
      out.tool_choice = ToolChoice::kAuto;
    else if (value == "none")
      out.tool_choice = ToolChoice::kNone;
    else if (value == "required")
      out.tool_choice = ToolChoice::kRequired;
    else
      fail("tool_choice",
           "'tool_choice' must be \"auto\", \"none\", \"required\" or a named function");
    return;
  }
  if (!choice->is_object()) fail("tool_choice", "'tool_choice' must be a string or an object");
  const ordered_json* function = Fields(*choice, "tool_choice.").object("function");
  auto name = function ? Fields(*function, "tool_choice.function.").string("name") : std::nullopt;
  if (!name) fail("tool_choice", "a named 'tool_choice' needs function.name");
  out.tool_choice = ToolChoice::kNamed;
  out.named_tool = *name;
}

void check_messages(const ordered_json& messages) {
  if (messages.empty()) fail("messages", "'messages' must contain at least one message");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string where = fmt::format("messages[{}]", i);
    const ordered_json& message = messages[i];
    if (!message.is_object()) fail(where, fmt::format("'{}' must be an object", where));
    Fields fields(message, where + ".");
    if (!fields.string("role")) fail(where + ".role", fmt::format("'{}.role' is required", where));
    const ordered_json* content = fields.find("content");
    if (!content || !content->is_array()) continue;
    for (const auto& part : *content) {
      if (!part.is_object()) fail(where + ".content", "content parts must be objects");
      auto type = Fields(part, where + ".content[].").string("type");
      if (!type) fail(where + ".content", "every content part needs a 'type'");
      if (*type != "text") {
        fail(where + ".content",
             fmt::format("content parts of type '{}' are not supported by this text-only server",
                         *type));
      }
      if (!Fields(part, where + ".content[].").string("text"))
        fail(where + ".content", "a text part needs a string 'text'");
    }
  }
}

void parse_reasoning(const Fields& fields, ChatRequest& out) {
  const ordered_json* kwargs = fields.object("chat_template_kwargs");
  auto options = text::ChatTemplateOptions::from_kwargs(kwargs ? *kwargs : ordered_json::object());
  if (!options.ok()) fail("chat_template_kwargs", options.error().message);
  out.template_options = *options;
  out.template_options.add_generation_prompt = true;
  if (auto effort = fields.string("reasoning_effort")) {
    static const std::set<std::string> efforts = {"none", "minimal", "low", "medium", "high"};
    if (!efforts.contains(*effort)) {
      fail("reasoning_effort", "'reasoning_effort' must be none, minimal, low, medium or high");
    }
    out.template_options.enable_thinking = *effort != "none" && *effort != "minimal";
  }
  if (auto enable = fields.boolean("enable_thinking"))
    out.template_options.enable_thinking = *enable;
  if (kwargs && kwargs->contains("enable_thinking")) {
    out.template_options.enable_thinking = options->enable_thinking;  // most specific wins
  }
}

template <typename Parse>
std::optional<ApiError> guarded(Parse parse) {
  try {
    parse();
  } catch (const RequestError& e) {
    return e.error;
  } catch (const nlohmann::json::exception& e) {
    return invalid_request(fmt::format("invalid request: {}", e.what()));
  }
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> parse_json_body(const std::string& body, ordered_json& out) {
  // Depth check first: nesting is what a recursive consumer cannot survive.
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (char c : body) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"')
      in_string = true;
    else if (c == '{' || c == '[') {
      if (++depth > kMaxJsonDepth) {
        return invalid_request(
            fmt::format("the request body nests deeper than {} levels", kMaxJsonDepth));
      }
    } else if (c == '}' || c == ']')
      --depth;
  }
  out = ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (out.is_discarded()) {
    return invalid_request("the request body is not valid JSON (or not valid UTF-8)");
  }
  if (!out.is_object()) return invalid_request("the request body must be a JSON object");
  return std::nullopt;
}

std::optional<ApiError> parse_chat_request(const ordered_json& body, const ModelNames& names,
                                           int32_t vocab_size, ChatRequest& out) {
  return guarded([&] {
    check_known_fields(body, chat_fields());
    Fields fields(body, "");
    check_model(fields, names);
    const ordered_json* messages = fields.array("messages");
    if (!messages) fail("messages", "'messages' is required");
    check_messages(*messages);
    out.messages = *messages;
    parse_settings(body, vocab_size, /*chat=*/true, out.settings);
    parse_tool_choice(fields, out);
    out.parallel_tool_calls = fields.boolean("parallel_tool_calls").value_or(true);
    if (const ordered_json* tools = fields.array("tools")) {
      check_tools(*tools);
      if (!tools->empty()) out.tools = *tools;
    }
    if (out.tool_choice == ToolChoice::kRequired && out.tools.is_null()) {
      fail("tool_choice", "'tool_choice' is \"required\" but no tools were given");
    }
    if (out.tool_choice == ToolChoice::kNamed) {
      ordered_json named = ordered_json::array();
      for (const auto& tool : out.tools.is_null() ? ordered_json::array() : out.tools) {
        if (tool["function"]["name"] == out.named_tool) named.push_back(tool);
      }
      if (named.empty())
        fail("tool_choice",
             fmt::format("tool_choice names '{}', which is not in 'tools'", out.named_tool));
      out.tools = std::move(named);  // offer only the named function
    }
    if (out.tool_choice == ToolChoice::kNone) out.tools = nullptr;
    if (const ordered_json* format = fields.object("response_format")) {
      auto type = Fields(*format, "response_format.").string("type");
      if (type.value_or("") != "text") {
        fail("response_format",
             "only response_format {\"type\": \"text\"} is supported (structured output is not "
             "implemented yet)");
      }
    }
    parse_reasoning(fields, out);
  });
}

std::optional<ApiError> parse_completion_request(const ordered_json& body, const ModelNames& names,
                                                 int32_t vocab_size, CompletionRequest& out) {
  return guarded([&] {
    check_known_fields(body, completion_fields());
    Fields fields(body, "");
    check_model(fields, names);
    if (auto best_of = fields.integer("best_of", 1, 1'000'000); best_of && *best_of != 1) {
      fail("best_of", "only best_of=1 is supported");
    }
    if (fields.find("suffix")) fail("suffix", "'suffix' (fill-in-the-middle) is not supported");
    out.echo = fields.boolean("echo").value_or(false);
    const ordered_json* prompt = fields.find("prompt");
    if (!prompt) fail("prompt", "'prompt' is required");
    // A string, an array of token ids, or an array holding exactly one of those.
    const ordered_json* single = prompt;
    if (prompt->is_array() && prompt->size() == 1 &&
        ((*prompt)[0].is_string() || (*prompt)[0].is_array())) {
      single = &(*prompt)[0];
    }
    if (single->is_string()) {
      out.prompt_text = single->get<std::string>();
      if (out.prompt_text.empty()) fail("prompt", "'prompt' must not be empty");
    } else if (single->is_array() && !single->empty()) {
      for (const auto& id : *single) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab_size) {
          fail("prompt", fmt::format("'prompt' must be a string or an array of token ids below {}",
                                     vocab_size));
        }
        out.prompt_ids.push_back(id.get<int32_t>());
      }
    } else {
      fail("prompt",
           "'prompt' must be a non-empty string or array of token ids (one prompt per request)");
    }
    parse_settings(body, vocab_size, /*chat=*/false, out.settings);
  });
}

}  // namespace gemma4::server
