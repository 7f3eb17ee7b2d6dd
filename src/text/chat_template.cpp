// The canonical template's logic, macro by macro (gemma4-full.jinja / gemma4-compact.jinja), with
// the Python/Jinja value semantics from chat_template_values.h. Comments quote the template where
// its behaviour is surprising.
#include "text/chat_template.h"

#include <array>
#include <optional>

#include "text/chat_template_values.h"
#include "text/output_parser.h"

namespace gemma4::text {
namespace {

using chat_values::dictsort;
using chat_values::Json;
using chat_values::member;
using chat_values::py_iterate;
using chat_values::py_str;
using chat_values::py_strip;
using chat_values::py_truthy;
using chat_values::py_upper;

constexpr std::string_view kQuote = "<|\"|>";

Error invalid(std::string message) {
  return Error{ErrorCode::kInvalidArgument, std::move(message)};
}

bool is_one_of(const Json* value, std::initializer_list<std::string_view> names) {
  if (value == nullptr || !value->is_string()) return false;
  const auto& text = value->get_ref<const std::string&>();
  for (std::string_view name : names) {
    if (text == name) return true;
  }
  return false;
}

// The prompt under construction. Template literals are appended with +=; text that comes from the
// caller (message content, names, arguments, schemas, ...) with value(), which also records its
// byte range so that the tokenizer can keep it from becoming control tokens.
class PromptWriter {
 public:
  PromptWriter& operator+=(std::string_view literal) {
    text_.append(literal);
    return *this;
  }
  PromptWriter& operator+=(char literal) {
    text_ += literal;
    return *this;
  }
  void value(std::string_view caller_text) {
    if (caller_text.empty()) return;
    const size_t begin = text_.size();
    text_.append(caller_text);
    if (!untrusted_.empty() && untrusted_.back().second == begin) {
      untrusted_.back().second = text_.size();  // adjacent values form one range
    } else {
      untrusted_.emplace_back(begin, text_.size());
    }
  }
  size_t size() const { return text_.size(); }
  std::string_view text_since(size_t offset) const {
    return std::string_view(text_).substr(offset);
  }
  RenderedPrompt finish() && { return RenderedPrompt{std::move(text_), std::move(untrusted_)}; }

 private:
  std::string text_;
  std::vector<std::pair<size_t, size_t>> untrusted_;
};

// `<|"|>{{ text }}<|"|>`: the delimiters are the template's, the text the caller's.
void quoted(std::string_view text, PromptWriter& out) {
  out += kQuote;
  out.value(text);
  out += kQuote;
}

// Appends `,` unless this is the first field; the template's add_comma / found_first flags.
class FieldSeparator {
 public:
  void next(PromptWriter& out) {
    if (written_) out += ',';
    written_ = true;
  }

 private:
  bool written_ = false;
};

// macro format_argument(argument, escape_keys)
void format_argument(const Json* argument, bool escape_keys, PromptWriter& out) {
  if (argument == nullptr) {
    out += "[]";  // Undefined passes Jinja's `is sequence` test and iterates as empty
  } else if (argument->is_null()) {
    out += "null";
  } else if (argument->is_string()) {
    quoted(argument->get_ref<const std::string&>(), out);
  } else if (argument->is_boolean()) {
    out += argument->get<bool>() ? "true" : "false";
  } else if (argument->is_object()) {
    out += '{';
    FieldSeparator separator;
    for (const auto& [key, value] : dictsort(*argument)) {
      separator.next(out);
      if (escape_keys) {
        quoted(*key, out);
      } else {
        out.value(*key);
      }
      out += ':';
      format_argument(value, escape_keys, out);
    }
    out += '}';
  } else if (argument->is_array()) {
    out += '[';
    FieldSeparator separator;
    for (const Json& item : *argument) {
      separator.next(out);
      format_argument(&item, escape_keys, out);
    }
    out += ']';
  } else {
    out.value(py_str(argument));
  }
}

// `for item in list` + `<|"|>{{ item }}<|"|>` comma-joined (required lists).
Status format_quoted_list(const Json& list, std::string_view what, PromptWriter& out) {
  auto items = py_iterate(list);
  if (!items.ok()) return invalid(fmt::format("{}: {}", what, items.error().message));
  FieldSeparator separator;
  for (const Json& item : *items) {
    separator.next(out);
    quoted(py_str(&item), out);
  }
  return {};
}

// macro format_parameters(properties, required, filter_keys): one `name:{…}` per property.
// `path` names the schema location for error messages.
Status format_parameters(const Json& properties, bool filter_keys, const std::string& path,
                         PromptWriter& out) {
  if (!properties.is_object()) {
    return invalid(fmt::format("{} must be an object mapping property names to schemas", path));
  }
  static constexpr std::array<std::string_view, 5> kStandardKeys = {
      "description", "type", "properties", "required", "nullable"};
  FieldSeparator property_separator;
  for (const auto& [key, value] : dictsort(properties)) {
    if (filter_keys &&
        std::find(kStandardKeys.begin(), kStandardKeys.end(), *key) != kStandardKeys.end()) {
      continue;
    }
    const std::string property_path = fmt::format("{}.{}", path, *key);
    property_separator.next(out);
    out.value(*key);
    out += ":{";
    FieldSeparator field;
    if (const Json* description = member(value, "description"); py_truthy(description)) {
      field.next(out);
      out += "description:";
      quoted(py_str(description), out);
    }
    const std::string type = py_upper(py_str(member(value, "type")));
    if (type == "STRING") {
      if (const Json* enum_values = member(value, "enum"); py_truthy(enum_values)) {
        field.next(out);
        out += "enum:";
        format_argument(enum_values, /*escape_keys=*/true, out);
      }
    } else if (type == "ARRAY") {
      const Json* items = member(value, "items");
      if (items != nullptr && items->is_object() && !items->empty()) {
        field.next(out);
        out += "items:{";
        FieldSeparator item_separator;
        for (const auto& [item_key, item_value] : dictsort(*items)) {
          if (item_value->is_null()) continue;
          item_separator.next(out);
          if (*item_key == "properties") {
            out += "properties:{";
            if (item_value->is_object()) {
              GEMMA4_RETURN_IF_ERROR(format_parameters(*item_value, /*filter_keys=*/false,
                                                       property_path + ".items.properties", out));
            }
            out += '}';
          } else if (*item_key == "required") {
            out += "required:[";
            GEMMA4_RETURN_IF_ERROR(
                format_quoted_list(*item_value, property_path + ".items.required", out));
            out += ']';
          } else if (*item_key == "type") {
            out += "type:";
            if (item_value->is_string()) {
              quoted(py_upper(item_value->get_ref<const std::string&>()), out);
            } else {  // `item_value | map('upper') | list`
              auto types = py_iterate(*item_value);
              if (!types.ok()) {
                return invalid(
                    fmt::format("{}.items.type: {}", property_path, types.error().message));
              }
              Json upper_types = Json::array();
              for (const Json& t : *types) upper_types.push_back(py_upper(py_str(&t)));
              format_argument(&upper_types, /*escape_keys=*/true, out);
            }
          } else {
            out.value(*item_key);
            out += ':';
            format_argument(item_value, /*escape_keys=*/true, out);
          }
        }
        out += '}';
      }
    }
    if (py_truthy(member(value, "nullable"))) {
      field.next(out);
      out += "nullable:true";
    }
    if (type == "OBJECT") {
      const Json* nested = member(value, "properties");
      if (nested != nullptr && nested->is_object()) {
        field.next(out);
        out += "properties:{";
        GEMMA4_RETURN_IF_ERROR(
            format_parameters(*nested, /*filter_keys=*/false, property_path + ".properties", out));
        out += '}';
      } else if (value->is_object()) {
        // Without a properties mapping the template lists the schema's own non-standard keys
        // (additionalProperties, …) as if they were properties; usually none: `properties:{}`.
        field.next(out);
        out += "properties:{";
        GEMMA4_RETURN_IF_ERROR(format_parameters(*value, /*filter_keys=*/true, property_path, out));
        out += '}';
      }
      if (const Json* required = member(value, "required"); py_truthy(required)) {
        field.next(out);
        out += "required:[";
        GEMMA4_RETURN_IF_ERROR(format_quoted_list(*required, property_path + ".required", out));
        out += ']';
      }
    }
    field.next(out);
    out += "type:";
    quoted(type, out);
    out += '}';
  }
  return {};
}

// macro format_function_declaration(tool_data), wrapped in <|tool>…<tool|>. (The template trims
// the declaration; it starts with "declaration:" and ends with '}', so trimming changes nothing.)
Status format_tool_declaration(const Json& tool, size_t index, PromptWriter& out) {
  const std::string path = fmt::format("tools[{}]", index);
  const Json* function = member(&tool, "function");
  if (function == nullptr || !function->is_object()) {
    return invalid(fmt::format("{} must be an object with a \"function\" object", path));
  }
  out += "<|tool>declaration:";
  out.value(py_str(member(function, "name")));
  out += "{description:";
  quoted(py_str(member(function, "description")), out);
  const Json* params = member(function, "parameters");
  if (py_truthy(params)) {
    out += ",parameters:{";
    if (const Json* properties = member(params, "properties"); py_truthy(properties)) {
      out += "properties:{";
      GEMMA4_RETURN_IF_ERROR(format_parameters(*properties, /*filter_keys=*/false,
                                               path + ".function.parameters.properties", out));
      out += "},";
    }
    if (const Json* required = member(params, "required"); py_truthy(required)) {
      out += "required:[";
      GEMMA4_RETURN_IF_ERROR(
          format_quoted_list(*required, path + ".function.parameters.required", out));
      out += "],";
    }
    // The closing brace of `parameters` is only written here: a schema without a type leaves it
    // unbalanced, exactly like the official template.
    if (const Json* type = member(params, "type"); py_truthy(type)) {
      out += "type:";
      quoted(py_upper(py_str(type)), out);
      out += '}';
    }
  }
  if (const Json* response = member(function, "response"); response != nullptr) {
    out += ",response:{";
    if (const Json* description = member(response, "description"); py_truthy(description)) {
      out += "description:";
      quoted(py_str(description), out);
      out += ',';
    }
    if (py_upper(py_str(member(response, "type"))) == "OBJECT") {
      out += "type:";
      out += kQuote;
      out += "OBJECT";
      out += kQuote;
      out += '}';
    }
  }
  out += "}<tool|>";
  return {};
}

// macro strip_thinking(text): drops <|channel>…<channel|> spans (and an unterminated trailing
// <|channel>…), removes stray <channel|>, then trims.
std::string strip_thinking(std::string_view text) {
  static constexpr std::string_view kOpen = "<|channel>";
  static constexpr std::string_view kClose = "<channel|>";
  std::string result;
  size_t start = 0;
  while (true) {
    const size_t close = text.find(kClose, start);
    const std::string_view part = text.substr(
        start, close == std::string_view::npos ? std::string_view::npos : close - start);
    result.append(part.substr(0, part.find(kOpen)));
    if (close == std::string_view::npos) break;
    start = close + kClose.size();
  }
  return std::string(py_strip(result));
}

// macro format_tool_response_block(tool_name, response)
void format_tool_response(std::string_view name, const Json* response, PromptWriter& out) {
  out += "<|tool_response>response:";
  out.value(name);
  if (response != nullptr && response->is_object()) {
    out += '{';
    FieldSeparator separator;
    for (const auto& [key, value] : dictsort(*response)) {
      separator.next(out);
      out.value(*key);
      out += ':';
      format_argument(value, /*escape_keys=*/false, out);
    }
    out += '}';
  } else {
    out += "{value:";
    format_argument(response, /*escape_keys=*/false, out);
    out += '}';
  }
  out += "<tool_response|>";
}

const char* media_placeholder(const Json* type) {
  if (is_one_of(type, {"image", "image_url"})) return "<|image|>";
  if (is_one_of(type, {"audio", "input_audio"})) return "<|audio|>";
  if (is_one_of(type, {"video"})) return "<|video|>";
  return "";
}

// A message's tool calls with their arguments as objects (a JSON string is decoded, the way the
// server must do it before rendering; null stays null and renders as `{}`).
struct ToolCallView {
  const Json* call;
  std::string name;
  const Json* raw_arguments;              // as given: object, null or a JSON string
  std::optional<Json> decoded_arguments;  // set when arguments came as a JSON string

  // The arguments to render: an object or null.
  const Json& arguments() const { return decoded_arguments ? *decoded_arguments : *raw_arguments; }
};

Expected<std::vector<ToolCallView>> read_tool_calls(const Json& calls, const std::string& path) {
  if (!calls.is_array()) return invalid(fmt::format("{} must be an array", path));
  std::vector<ToolCallView> views;
  views.reserve(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string call_path = fmt::format("{}[{}]", path, i);
    const Json* function = member(&calls[i], "function");
    if (function == nullptr || !function->is_object()) {
      return invalid(fmt::format("{}.function must be an object", call_path));
    }
    const Json* name = member(function, "name");
    if (name == nullptr || !name->is_string()) {
      return invalid(fmt::format("{}.function.name must be a string", call_path));
    }
    const Json* arguments = member(function, "arguments");
    ToolCallView view{&calls[i], name->get<std::string>(), arguments, std::nullopt};
    if (arguments != nullptr && arguments->is_string()) {
      view.decoded_arguments = Json::parse(arguments->get_ref<const std::string&>(), nullptr,
                                           /*allow_exceptions=*/false);
      if (!view.decoded_arguments->is_object()) {
        return invalid(fmt::format(
            "{}.function.arguments is a string that does not hold a JSON object", call_path));
      }
    } else if (arguments == nullptr || !(arguments->is_object() || arguments->is_null())) {
      return invalid(fmt::format(
          "{}.function.arguments must be a JSON object (or a string holding one)", call_path));
    }
    views.push_back(std::move(view));
  }
  return views;
}

// `thinking_text = message.get('reasoning') or message.get('reasoning_content')`
const Json* reasoning_of(const Json& message) {
  const Json* reasoning = member(&message, "reasoning");
  return py_truthy(reasoning) ? reasoning : member(&message, "reasoning_content");
}

// A tool result's `name`: the function name of the last call whose id equals its tool_call_id
// (missing ids compare equal: the template's quirk), else its own name, else "unknown".
Expected<std::string> tool_result_name(const Json& result, const std::vector<ToolCallView>& calls,
                                       const std::string& path) {
  const ToolCallView* matched = nullptr;
  const Json* call_id = member(&result, "tool_call_id");
  for (const ToolCallView& call : calls) {
    if (chat_values::py_equal(member(call.call, "id"), call_id)) matched = &call;
  }
  if (matched != nullptr) return matched->name;
  const Json* own = member(&result, "name");  // `follow.get('name') or 'unknown'`
  if (!py_truthy(own)) return std::string("unknown");
  if (!own->is_string()) return invalid(fmt::format("{}.name must be a string", path));
  return own->get<std::string>();
}

Status format_tool_result(const Json& result, const std::vector<ToolCallView>& calls,
                          const std::string& path, PromptWriter& out) {
  GEMMA4_ASSIGN_OR_RETURN(const std::string name, tool_result_name(result, calls, path));
  const Json* body = member(&result, "content");
  if (body != nullptr && body->is_array()) {
    std::string text;
    for (size_t i = 0; i < body->size(); ++i) {
      const Json& part = (*body)[i];
      if (!part.is_object()) {
        return invalid(fmt::format("{}.content[{}] must be an object", path, i));
      }
      if (is_one_of(member(&part, "type"), {"text"})) {
        const Json* part_text = member(&part, "text");
        if (part_text == nullptr || !part_text->is_string()) {
          return invalid(fmt::format("{}.content[{}].text must be a string", path, i));
        }
        text += part_text->get_ref<const std::string&>();
      }
    }
    const Json text_value = text;
    format_tool_response(name, &text_value, out);
    for (const Json& part : *body) out += media_placeholder(member(&part, "type"));
    return {};
  }
  if (body != nullptr && body->is_object()) {
    return invalid(fmt::format("{}.content must be a string, an array of parts or null", path));
  }
  static const Json kNone;
  format_tool_response(name, body ? body : &kNone, out);
  return {};
}

// Legacy Gemma form: tool_responses [{name, response}] on the assistant message.
Status format_legacy_tool_responses(const Json& responses, const std::string& path,
                                    PromptWriter& out) {
  if (!responses.is_array()) return invalid(fmt::format("{} must be an array", path));
  for (size_t i = 0; i < responses.size(); ++i) {
    const Json& response = responses[i];
    if (!response.is_object()) return invalid(fmt::format("{}[{}] must be an object", path, i));
    std::string name = "unknown";  // `| default('unknown', true)`
    if (const Json* own = member(&response, "name"); py_truthy(own)) {
      if (!own->is_string()) return invalid(fmt::format("{}[{}].name must be a string", path, i));
      name = own->get<std::string>();
    }
    format_tool_response(name, member(&response, "response"), out);
  }
  return {};
}

// The captured_content block: content after calls and results.
Status format_content(const Json& message, bool is_model, const std::string& path,
                      PromptWriter& out) {
  const Json* content = member(&message, "content");
  if (content == nullptr || content->is_null()) return {};
  if (content->is_string()) {
    const auto& text = content->get_ref<const std::string&>();
    out.value(is_model ? strip_thinking(text) : std::string(py_strip(text)));
    return {};
  }
  if (!content->is_array()) {
    return invalid(fmt::format("{}.content must be a string, an array of parts or null", path));
  }
  for (size_t i = 0; i < content->size(); ++i) {
    const Json& part = (*content)[i];
    if (!part.is_object()) return invalid(fmt::format("{}.content[{}] must be an object", path, i));
    const Json* type = member(&part, "type");
    if (is_one_of(type, {"text"})) {
      const Json* text = member(&part, "text");
      if (is_model) {
        if (text == nullptr || !text->is_string()) {
          return invalid(fmt::format("{}.content[{}].text must be a string", path, i));
        }
        out.value(strip_thinking(text->get_ref<const std::string&>()));
      } else {
        out.value(py_strip(py_str(text)));
      }
    } else {
      out += media_placeholder(type);
    }
  }
  return {};
}

enum class LastOutput { kNone, kToolCall, kToolResponse };  // ns.prev_message_type, as it matters

class Renderer {
 public:
  Renderer(const ChatTemplateOptions& options, bool full_variant)
      : options_(options), full_variant_(full_variant) {}

  Expected<RenderedPrompt> render(const Json& messages, const Json& tools) {
    if (!messages.is_array()) return invalid("messages must be an array");
    if (!tools.is_null() && !tools.is_array()) return invalid("tools must be an array or null");
    for (size_t i = 0; i < messages.size(); ++i) {
      const Json* role = member(&messages[i], "role");
      if (!messages[i].is_object())
        return invalid(fmt::format("messages[{}] must be an object", i));
      if (!is_one_of(role, {"system", "developer", "user", "assistant", "tool"})) {
        return invalid(fmt::format(
            "messages[{}].role must be one of system, developer, user, assistant, tool (got {})", i,
            role ? role->dump() : "nothing"));
      }
    }
    out_ += options_.bos_token;
    size_t first = 0;
    const bool leading_system =
        !messages.empty() && is_one_of(member(&messages[0], "role"), {"system", "developer"});
    if (options_.enable_thinking || py_truthy(&tools) || leading_system) {
      out_ += "<|turn>system\n";
      if (options_.enable_thinking) out_ += "<|think|>\n";
      if (leading_system) {
        GEMMA4_RETURN_IF_ERROR(format_leading_system(messages[0]));
        first = 1;
      }
      if (tools.is_array()) {
        for (size_t i = 0; i < tools.size(); ++i) {
          GEMMA4_RETURN_IF_ERROR(format_tool_declaration(tools[i], i, out_));
        }
      }
      out_ += "<turn|>\n";
    }
    GEMMA4_RETURN_IF_ERROR(format_turns(messages, first));
    if (options_.add_generation_prompt) {
      if (last_output_ == LastOutput::kNone) {
        out_ += "<|turn>model\n";
        if (full_variant_ && !options_.enable_thinking) out_ += "<|channel>thought\n<channel|>";
      } else if (last_output_ == LastOutput::kToolResponse && options_.enable_thinking) {
        out_ += "<|channel>thought\n";  // the model continues by reasoning about the results
      }
    }
    return std::move(out_).finish();
  }

 private:
  Status format_leading_system(const Json& message) {
    const Json* content = member(&message, "content");
    if (content == nullptr || content->is_null()) return {};
    if (content->is_string()) {
      out_.value(py_strip(content->get_ref<const std::string&>()));
      return {};
    }
    if (!content->is_array()) {
      return invalid("messages[0].content must be a string, an array of parts or null");
    }
    for (size_t i = 0; i < content->size(); ++i) {
      const Json& part = (*content)[i];
      if (!part.is_object())
        return invalid(fmt::format("messages[0].content[{}] must be an object", i));
      // `item['text'] | trim + ' '`: a space after every part, the last one included.
      out_.value(py_strip(py_str(member(&part, "text"))));
      out_ += ' ';
    }
    return {};
  }

  // The main loop over messages[first:]; `i` counts in that slice like the template's loop.index0.
  Status format_turns(const Json& all_messages, size_t first) {
    const auto message_at = [&](size_t i) -> const Json& { return all_messages[first + i]; };
    const auto role_at = [&](size_t i) {
      return member(&message_at(i), "role")->get_ref<const std::string&>();
    };
    const size_t count = all_messages.size() - first;
    std::optional<size_t> last_user;
    for (size_t i = 0; i < count; ++i) {
      if (role_at(i) == "user") last_user = i;
    }
    std::string previous_role;  // ns.prev_non_tool_role
    for (size_t i = 0; i < count; ++i) {
      const Json& message = message_at(i);
      const std::string& role = role_at(i);
      if (role == "tool") continue;  // pulled in by the assistant message that called it
      const std::string path = fmt::format("messages[{}]", first + i);
      last_output_ = LastOutput::kNone;
      const bool is_model = role == "assistant";
      if (!(is_model && previous_role == "assistant")) {
        out_ += "<|turn>" + (is_model ? std::string("model") : role) + "\n";
      }

      const Json* tool_calls_value = member(&message, "tool_calls");
      const bool has_tool_calls = py_truthy(tool_calls_value);
      std::vector<ToolCallView> tool_calls;
      if (has_tool_calls) {
        GEMMA4_ASSIGN_OR_RETURN(tool_calls,
                                read_tool_calls(*tool_calls_value, path + ".tool_calls"));
      }

      const Json* reasoning = reasoning_of(message);
      const bool after_last_user = !last_user.has_value() || i > *last_user;
      if (py_truthy(reasoning) &&
          (after_last_user || (options_.preserve_thinking && has_tool_calls))) {
        if (!reasoning->is_string()) return invalid(path + ".reasoning_content must be a string");
        out_ += "<|channel>thought\n";
        out_.value(reasoning->get_ref<const std::string&>());
        out_ += "\n<channel|>";
      }

      for (const ToolCallView& call : tool_calls) {
        out_ += "<|tool_call>call:";
        out_.value(call.name);
        out_ += '{';
        if (call.arguments().is_object()) {
          FieldSeparator separator;
          for (const auto& [key, value] : dictsort(call.arguments())) {
            separator.next(out_);
            out_.value(*key);
            out_ += ':';
            format_argument(value, /*escape_keys=*/false, out_);
          }
        }
        out_ += "}<tool_call|>";
      }
      if (has_tool_calls) last_output_ = LastOutput::kToolCall;

      bool rendered_results = false;
      if (const Json* legacy = member(&message, "tool_responses"); py_truthy(legacy)) {
        GEMMA4_RETURN_IF_ERROR(
            format_legacy_tool_responses(*legacy, path + ".tool_responses", out_));
        rendered_results = !legacy->empty();
      } else if (has_tool_calls) {
        for (size_t k = i + 1; k < count && role_at(k) == "tool"; ++k) {
          GEMMA4_RETURN_IF_ERROR(format_tool_result(message_at(k), tool_calls,
                                                    fmt::format("messages[{}]", first + k), out_));
          rendered_results = true;
        }
      }
      if (rendered_results) last_output_ = LastOutput::kToolResponse;

      const size_t content_start = out_.size();
      GEMMA4_RETURN_IF_ERROR(format_content(message, is_model, path, out_));
      const bool has_content = !py_strip(out_.text_since(content_start)).empty();

      std::optional<std::string> next_role;
      for (size_t j = i + 1; j < count && !next_role; ++j) {
        if (role_at(j) != "tool") next_role = role_at(j);
      }
      const bool continues_into_next =
          is_model && next_role == "assistant" && (!has_tool_calls || rendered_results);
      if (last_output_ == LastOutput::kToolCall && !rendered_results) {
        out_ += "<|tool_response>";  // calls without results yet: the prompt ends awaiting them
      } else if (continues_into_next) {
        // the next assistant message continues this model turn
      } else if (!(rendered_results && !has_content && !next_role)) {
        out_ += "<turn|>\n";  // (after results with nothing following, the turn stays open)
      }
      previous_role = role;
    }
    return {};
  }

  const ChatTemplateOptions& options_;
  bool full_variant_;
  PromptWriter out_;
  LastOutput last_output_ = LastOutput::kNone;
};

// Gemma 3's template (tests/text/data/gemma3-chat-template.jinja), statement by statement:
//   {{ bos_token }}; a leading system message becomes first_user_prefix (its string content, or
//   the text of its first part, + "\n\n", untrimmed) and is skipped; every other message must
//   alternate user / non-user ("Conversation roles must alternate ..."), is written as
//   `<start_of_turn>{role, assistant -> model}\n`, the prefix in the first one, its content
//   (a string `| trim`, or per part: image -> <start_of_image>, text -> `item['text'] | trim`,
//   other parts nothing; null raises "Invalid content type"; a missing content renders nothing),
//   then `<end_of_turn>\n`; the generation prompt is `<start_of_turn>model\n`.
class Gemma3Renderer {
 public:
  explicit Gemma3Renderer(const ChatTemplateOptions& options) : options_(options) {}

  Expected<RenderedPrompt> render(const Json& messages) {
    if (!messages.is_array()) return invalid("messages must be an array");
    if (messages.empty()) return invalid("messages must not be empty");
    for (size_t i = 0; i < messages.size(); ++i) {
      if (!messages[i].is_object())
        return invalid(fmt::format("messages[{}] must be an object", i));
      if (!is_one_of(member(&messages[i], "role"), {"system", "user", "assistant"})) {
        const Json* role = member(&messages[i], "role");
        return invalid(fmt::format(
            "messages[{}].role must be one of system, user, assistant for this model (got {})", i,
            role ? role->dump() : "nothing"));
      }
    }
    out_ += options_.bos_token;
    size_t first = 0;
    std::optional<std::string_view> first_user_prefix;
    if (is_one_of(member(&messages[0], "role"), {"system"})) {
      const Json* content = member(&messages[0], "content");
      const Json* text = content && content->is_array() && !content->empty()
                             ? member(&(*content)[0], "text")
                             : content;
      if (text == nullptr || !text->is_string()) {
        return invalid(
            "messages[0].content: a system message needs a string or a list starting with a "
            "text part");
      }
      first_user_prefix = text->get_ref<const std::string&>();
      first = 1;
    }
    for (size_t i = first; i < messages.size(); ++i) {
      const Json& message = messages[i];
      const bool is_user = is_one_of(member(&message, "role"), {"user"});
      if (is_user != ((i - first) % 2 == 0)) {
        return invalid("Conversation roles must alternate user/assistant/user/assistant/...");
      }
      const std::string& role = member(&message, "role")->get_ref<const std::string&>();
      out_ += "<start_of_turn>";
      out_ += role == "assistant" ? std::string_view("model") : std::string_view(role);
      out_ += '\n';
      if (i == first && first_user_prefix) {
        out_.value(*first_user_prefix);
        out_ += "\n\n";
      }
      GEMMA4_RETURN_IF_ERROR(format_content(member(&message, "content"), i));
      out_ += "<end_of_turn>\n";
    }
    if (options_.add_generation_prompt) out_ += "<start_of_turn>model\n";
    return std::move(out_).finish();
  }

 private:
  Status format_content(const Json* content, size_t index) {
    if (content == nullptr) return {};  // Undefined iterates as empty
    if (content->is_string()) {
      out_.value(py_strip(content->get_ref<const std::string&>()));
      return {};
    }
    if (!content->is_array()) {
      return invalid(fmt::format(
          "messages[{}].content must be a string or a list of parts (Invalid content type)",
          index));
    }
    for (size_t part = 0; part < content->size(); ++part) {
      const Json& item = (*content)[part];
      if (!item.is_object()) {
        return invalid(fmt::format("messages[{}].content[{}] must be an object", index, part));
      }
      const Json* type = member(&item, "type");
      if (is_one_of(type, {"image"})) {
        out_ += "<start_of_image>";
      } else if (is_one_of(type, {"text"})) {
        const Json* text = member(&item, "text");
        if (text != nullptr && !text->is_string()) {
          return invalid(
              fmt::format("messages[{}].content[{}].text must be a string", index, part));
        }
        if (text != nullptr) out_.value(py_strip(text->get_ref<const std::string&>()));
      }
    }
    return {};
  }

  const ChatTemplateOptions& options_;
  PromptWriter out_;
};

}  // namespace

Expected<ChatTemplateOptions> ChatTemplateOptions::from_kwargs(
    const nlohmann::ordered_json& kwargs) {
  ChatTemplateOptions options;
  if (kwargs.is_null()) return options;
  if (!kwargs.is_object()) return invalid("kwargs must be an object");
  options.add_generation_prompt = py_truthy(member(&kwargs, "add_generation_prompt"));
  options.enable_thinking = py_truthy(member(&kwargs, "enable_thinking"));
  options.preserve_thinking = py_truthy(member(&kwargs, "preserve_thinking"));
  if (const Json* bos = member(&kwargs, "bos_token"); bos != nullptr) {
    if (!bos->is_string()) return invalid("kwargs.bos_token must be a string");
    options.bos_token = bos->get<std::string>();
  }
  return options;
}

Expected<ChatTemplate> ChatTemplate::from_template_source(std::string_view jinja_text) {
  const auto contains = [&](std::string_view needle) {
    return jinja_text.find(needle) != std::string_view::npos;
  };
  if (!contains("<|turn>")) {
    // Gemma 3's template folds the system message into the first user turn (first_user_prefix);
    // Gemma 2's, which shares <start_of_turn>, refuses system messages instead.
    if (contains("<start_of_turn>") && contains("first_user_prefix")) {
      return ChatTemplate(Variant::kGemma3);
    }
    if (contains("<start_of_turn>")) {
      return make_error(ErrorCode::kUnsupported,
                        "chat template is a Gemma 2 template (<start_of_turn> without system "
                        "messages), not Gemma 3 or 4");
    }
    return make_error(ErrorCode::kUnsupported,
                      "chat template is not a Gemma 4 template: it never writes <|turn>");
  }
  // The 2026-07-09 canonical template is the first with preserve_thinking; tool_call_id arrived
  // with the April revision. Older files render differently (None, tool turns): refuse them.
  for (std::string_view feature : {"tool_call_id", "preserve_thinking"}) {
    if (!contains(feature)) {
      return make_error(ErrorCode::kUnsupported,
                        "chat template is an older, pre-canonical Gemma 4 template (no {}); gemma4 "
                        "renders the 2026-07-09 canonical rules: choose the variant explicitly "
                        "(compact for E2B/E4B, full for 12B/26B/31B) to use them",
                        feature);
    }
  }
  // Variant: does the generation-prompt branch pre-fill an empty thought block?
  const size_t generation_branch = jinja_text.rfind("add_generation_prompt");
  if (generation_branch == std::string_view::npos) {
    return make_error(
        ErrorCode::kUnsupported,
        "chat template has no add_generation_prompt branch: not a Gemma 4 IT template");
  }
  const std::string_view branch = jinja_text.substr(generation_branch);
  const bool prefills_empty_thought =
      branch.find("<|channel>thought\\n<channel|>") != std::string_view::npos ||
      branch.find("<|channel>thought\n<channel|>") != std::string_view::npos;
  return ChatTemplate(prefills_empty_thought ? Variant::kFull : Variant::kCompact);
}

Expected<RenderedPrompt> ChatTemplate::render_with_spans(const nlohmann::ordered_json& messages,
                                                         const nlohmann::ordered_json& tools,
                                                         const ChatTemplateOptions& options) const {
  if (variant_ == Variant::kGemma3) return Gemma3Renderer(options).render(messages);
  return Renderer(options, variant_ == Variant::kFull).render(messages, tools);
}

Expected<RenderedPrompt> ChatTemplate::render_with_spans(const nlohmann::json& messages,
                                                         const nlohmann::json& tools,
                                                         const ChatTemplateOptions& options) const {
  // nlohmann::json keeps keys sorted bytewise; converting keeps that order.
  return render_with_spans(Json(messages), Json(tools), options);
}

Expected<std::string> ChatTemplate::render(const nlohmann::ordered_json& messages,
                                           const nlohmann::ordered_json& tools,
                                           const ChatTemplateOptions& options) const {
  GEMMA4_ASSIGN_OR_RETURN(RenderedPrompt prompt, render_with_spans(messages, tools, options));
  return std::move(prompt.text);
}

Expected<std::string> ChatTemplate::render(const nlohmann::json& messages,
                                           const nlohmann::json& tools,
                                           const ChatTemplateOptions& options) const {
  return render(Json(messages), Json(tools), options);
}

std::span<const std::string_view> ChatTemplate::stop_token_texts() const {
  if (variant_ == Variant::kGemma3) return kGemma3StopTokenTexts;
  return kStopTokenTexts;
}

std::vector<int32_t> ChatTemplate::stop_token_ids(const Tokenizer& tokenizer) const {
  std::vector<int32_t> ids;
  for (const std::string_view text : stop_token_texts()) {
    if (const int32_t id = tokenizer.token_to_id(text); id >= 0) ids.push_back(id);
  }
  return ids;
}

const char* chat_template_variant_name(ChatTemplate::Variant variant) {
  switch (variant) {
    case ChatTemplate::Variant::kCompact:
      return "compact";
    case ChatTemplate::Variant::kFull:
      return "full";
    case ChatTemplate::Variant::kGemma3:
      return "gemma3";
  }
  return "unknown";
}

}  // namespace gemma4::text
