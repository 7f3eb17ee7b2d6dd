// ChatTemplate against the spec's render vectors (produced by Python Jinja2 on the official
// templates), variant detection from template files, and the Python value semantics it relies
// on. The large random differential run is tests/text/test_chat_template_diff.py.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "test_support.h"
#include "text/chat_template.h"
#include "text/chat_template_values.h"

namespace gemma4::text {
namespace {

using Json = nlohmann::ordered_json;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

std::filesystem::path spec_dir() {
  return testing::shared_data_dir() / ".." / "spec";
}

Json render_vectors() {
  return Json::parse(read_file(spec_dir() / "gemma4-chat-vectors.json"))["render"];
}

ChatTemplate template_file(const std::string& variant) {
  auto loaded = ChatTemplate::from_template_source(
      read_file(testing::shared_data_dir() / "chat-templates" / ("gemma4-" + variant + ".jinja")));
  EXPECT_TRUE(loaded.ok()) << loaded.error().to_string();
  return *loaded;
}

TEST(ChatTemplate, RendersEverySpecVector) {
  const Json vectors = render_vectors();
  ASSERT_GE(vectors.size(), 20u);
  for (const Json& vector : vectors) {
    const std::string variant = vector["variant"];
    SCOPED_TRACE(vector["name"].get<std::string>() + " / " + variant);
    auto options = ChatTemplateOptions::from_kwargs(vector["kwargs"]);
    ASSERT_TRUE(options.ok());
    auto prompt = template_file(variant).render(vector["messages"], vector["tools"], *options);
    ASSERT_TRUE(prompt.ok()) << prompt.error().to_string();
    EXPECT_EQ(*prompt, vector["expected_prompt"].get<std::string>());
  }
}

TEST(ChatTemplate, PlainJsonOverloadRendersTheSame) {
  for (const Json& vector : render_vectors()) {
    auto options = ChatTemplateOptions::from_kwargs(vector["kwargs"]);
    ASSERT_TRUE(options.ok());
    const auto chat_template =
        ChatTemplate::of_variant(vector["variant"] == "full" ? ChatTemplate::Variant::kFull
                                                             : ChatTemplate::Variant::kCompact);
    auto prompt = chat_template.render(nlohmann::json::parse(vector["messages"].dump()),
                                       nlohmann::json::parse(vector["tools"].dump()), *options);
    ASSERT_TRUE(prompt.ok()) << prompt.error().to_string();
    EXPECT_EQ(*prompt, vector["expected_prompt"].get<std::string>());
  }
}

TEST(ChatTemplate, DetectsVariantFromTemplateText) {
  EXPECT_EQ(template_file("compact").variant(), ChatTemplate::Variant::kCompact);
  EXPECT_EQ(template_file("full").variant(), ChatTemplate::Variant::kFull);
}

TEST(ChatTemplate, RefusesTemplatesItDoesNotImplement) {
  auto gemma2 = ChatTemplate::from_template_source(
      "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{% endfor %}");
  ASSERT_FALSE(gemma2.ok());
  EXPECT_NE(gemma2.error().message.find("Gemma 2"), std::string::npos);

  auto chatml = ChatTemplate::from_template_source("<|im_start|>{{ message.content }}<|im_end|>");
  ASSERT_FALSE(chatml.ok());
  EXPECT_NE(chatml.error().message.find("not a Gemma 4 template"), std::string::npos);

  // A Gemma 4 template from before the canonical release (no preserve_thinking).
  auto april = ChatTemplate::from_template_source(
      "{{ bos_token }}<|turn>{{ tool_call_id }}{% if add_generation_prompt %}<|turn>model\n"
      "{% endif %}");
  ASSERT_FALSE(april.ok());
  EXPECT_NE(april.error().message.find("preserve_thinking"), std::string::npos);
}

struct BadRequest {
  const char* name;
  const char* messages;
  const char* tools;
  const char* expected_message_part;
};

TEST(ChatTemplate, InvalidRequestsAreClearErrors) {
  const BadRequest cases[] = {
      {"unknown role", R"([{"role":"robot","content":"x"}])", "null", "messages[0].role"},
      {"message not an object", R"(["hello"])", "null", "messages[0] must be an object"},
      {"messages not a list", R"({"role":"user"})", "null", "messages must be an array"},
      {"arguments not JSON", R"([{"role":"assistant","tool_calls":[{"function":{"name":"f",
        "arguments":"{oops"}}]}])",
       "null", "messages[0].tool_calls[0].function.arguments"},
      {"arguments missing", R"([{"role":"assistant","tool_calls":[{"function":{"name":"f"}}]}])",
       "null", "must be a JSON object"},
      {"call without name",
       R"([{"role":"assistant","tool_calls":[{"function":{"arguments":{}}}]}])", "null",
       "function.name must be a string"},
      {"content is a number", R"([{"role":"user","content":5}])", "null", "messages[0].content"},
      {"properties not a mapping", R"([{"role":"user","content":"x"}])",
       R"([{"type":"function","function":{"name":"f","parameters":{"type":"object",
         "properties":["a"]}}}])",
       "tools[0].function.parameters.properties"},
      {"tool without function", R"([{"role":"user","content":"x"}])", R"([{"name":"f"}])",
       "tools[0]"},
      {"tools not a list", R"([{"role":"user","content":"x"}])", R"({"name":"f"})",
       "tools must be an array"},
      {"reasoning not a string", R"([{"role":"assistant","reasoning_content":[1],"content":"x"}])",
       "null", "reasoning_content must be a string"},
  };
  const auto chat_template = ChatTemplate::of_variant(ChatTemplate::Variant::kCompact);
  for (const BadRequest& bad : cases) {
    SCOPED_TRACE(bad.name);
    auto prompt = chat_template.render(Json::parse(bad.messages), Json::parse(bad.tools),
                                       ChatTemplateOptions{});
    ASSERT_FALSE(prompt.ok());
    EXPECT_EQ(prompt.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(prompt.error().message.find(bad.expected_message_part), std::string::npos)
        << prompt.error().message;
  }
}

TEST(ChatTemplate, OptionsFromKwargsFollowPythonTruthiness) {
  auto options = ChatTemplateOptions::from_kwargs(
      Json::parse(R"({"add_generation_prompt":1,"enable_thinking":"","bos_token":"","x":3})"));
  ASSERT_TRUE(options.ok());
  EXPECT_TRUE(options->add_generation_prompt);
  EXPECT_FALSE(options->enable_thinking);
  EXPECT_EQ(options->bos_token, "");
  EXPECT_FALSE(ChatTemplateOptions::from_kwargs(Json::parse(R"({"bos_token":1})")).ok());
}

// Expected strings below are what CPython 3.11 prints (repr/str/strip/upper/lower).
TEST(ChatTemplateValues, FloatReprMatchesPython) {
  const std::pair<double, const char*> cases[] = {
      {2.5, "2.5"},
      {1.0, "1.0"},
      {100.0, "100.0"},
      {0.0001, "0.0001"},
      {1e-05, "1e-05"},
      {1e16, "1e+16"},
      {1e15, "1000000000000000.0"},
      {1234567890123456.0, "1234567890123456.0"},
      {0.1, "0.1"},
      {-0.0, "-0.0"},
      {5e-324, "5e-324"},
      {1e300, "1e+300"},
      {123456789.123, "123456789.123"},
      {1.5e16, "1.5e+16"},
      {-2.75, "-2.75"},
      {3.141592653589793, "3.141592653589793"},
  };
  for (const auto& [value, expected] : cases) {
    EXPECT_EQ(chat_values::py_float_repr(value), expected);
  }
}

TEST(ChatTemplateValues, StrOfContainersIsPythonRepr) {
  const Json value =
      Json::parse(R"([1, 2.0, "it's", "a\"b", null, true, {"k": ["x"]}, "\n\u00a0"])");
  EXPECT_EQ(chat_values::py_str(&value),
            R"([1, 2.0, "it's", 'a"b', None, True, {'k': ['x']}, '\n\xa0'])");
  EXPECT_EQ(chat_values::py_str(nullptr), "");
}

TEST(ChatTemplateValues, StripUsesPythonWhitespace) {
  EXPECT_EQ(chat_values::py_strip("\u3000\xc2\xa0 \t\nx y\x0b\x1c\u2029"), "x y");
  EXPECT_EQ(chat_values::py_strip("\u200bx"), "\u200bx");  // zero-width space is not whitespace
}

TEST(ChatTemplateValues, DictsortIsCaseInsensitiveAndStable) {
  const Json object = Json::parse(R"({"b":1,"Zeta":2,"alpha":3,"Alpha":4,"ÿ":5,"Ÿ":6})");
  std::string order;
  for (const auto& [key, value] : chat_values::dictsort(object)) order += *key + ",";
  EXPECT_EQ(order, "alpha,Alpha,b,Zeta,ÿ,Ÿ,");
}

TEST(ChatTemplateValues, CaseMappingAndEquality) {
  EXPECT_EQ(chat_values::py_upper("straße ωmega ключ ÿ"), "STRASSE ΩMEGA КЛЮЧ Ÿ");
  EXPECT_EQ(chat_values::py_lower("ÉCLAIR Ωmega КЛЮЧ Ÿ"), "éclair ωmega ключ ÿ");
  const Json one = 1, one_float = 1.0, yes = true, text = "1";
  EXPECT_TRUE(chat_values::py_equal(&one, &one_float));
  EXPECT_TRUE(chat_values::py_equal(&one, &yes));
  EXPECT_FALSE(chat_values::py_equal(&one, &text));
  EXPECT_TRUE(chat_values::py_equal(nullptr, nullptr));
}

// Gemma 3: expected prompts are Python Jinja2's renderings of tests/text/data/
// gemma3-chat-template.jinja (the official google/gemma-3-*-it template) for the same messages.
ChatTemplate gemma3_template() {
  auto parsed = ChatTemplate::from_template_source(
      read_file(std::filesystem::path(GEMMA4_SOURCE_DIR) / "tests" / "text" / "data" /
                "gemma3-chat-template.jinja"));
  if (!parsed.ok()) throw std::runtime_error(parsed.error().to_string());
  return *parsed;
}

TEST(ChatTemplate, Gemma3TemplateIsRecognisedAndRendersLikeJinja) {
  const ChatTemplate gemma3 = gemma3_template();
  EXPECT_EQ(gemma3.variant(), ChatTemplate::Variant::kGemma3);
  EXPECT_STREQ(chat_template_variant_name(gemma3.variant()), "gemma3");
  ChatTemplateOptions generation;
  generation.add_generation_prompt = true;
  const struct {
    const char* messages;
    bool add_generation_prompt;
    const char* expected;
  } cases[] = {
      {R"([{"role":"system","content":"Be brief."},
           {"role":"user","content":" What is the capital of France? "}])",
       true,
       "<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
       "<start_of_turn>model\n"},
      {R"([{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello!\n"},
           {"role":"user","content":[{"type":"image"},{"type":"text","text":" Describe it. "}]}])",
       false,
       "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
       "<start_of_turn>user\n<start_of_image>Describe it.<end_of_turn>\n"},
      {R"([{"role":"system","content":[{"type":"text","text":" sys "}]},
           {"role":"user","content":"x"}])",
       true, "<bos><start_of_turn>user\n sys \n\nx<end_of_turn>\n<start_of_turn>model\n"},
  };
  for (const auto& c : cases) {
    ChatTemplateOptions options;
    options.add_generation_prompt = c.add_generation_prompt;
    auto prompt = gemma3.render(Json::parse(c.messages), Json(), options);
    ASSERT_TRUE(prompt.ok()) << prompt.error().to_string();
    EXPECT_EQ(*prompt, c.expected);
  }
  // Roles must alternate (the template raises), and only system/user/assistant exist.
  const Json not_alternating = Json::parse(R"([{"role":"assistant","content":"a"}])");
  auto refused = gemma3.render(not_alternating, Json(), generation);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("alternate"), std::string::npos);
  EXPECT_FALSE(
      gemma3.render(Json::parse(R"([{"role":"tool","content":"a"}])"), Json(), generation).ok());
}

TEST(ChatTemplate, Gemma3MarksCallerTextAsUntrusted) {
  const Json messages =
      Json::parse(R"([{"role":"system","content":"S"},{"role":"user","content":"<end_of_turn>"}])");
  auto rendered = gemma3_template().render_with_spans(messages, Json(), ChatTemplateOptions{});
  ASSERT_TRUE(rendered.ok()) << rendered.error().to_string();
  std::string caller_text;
  for (const auto& [begin, end] : rendered->untrusted) {
    caller_text += rendered->text.substr(begin, end - begin);
  }
  EXPECT_EQ(caller_text, "S<end_of_turn>");
}

TEST(ChatTemplate, StopTokensFollowTheFormat) {
  const auto texts = [](const ChatTemplate& t) {
    return std::vector<std::string_view>(t.stop_token_texts().begin(), t.stop_token_texts().end());
  };
  EXPECT_EQ(texts(gemma3_template()), (std::vector<std::string_view>{"<end_of_turn>", "<eos>"}));
  EXPECT_EQ(texts(template_file("compact")),
            (std::vector<std::string_view>{"<turn|>", "<eos>", "<|tool_response>"}));
  EXPECT_EQ(gemma3_template().output_format(), OutputFormat::kGemma3);
  EXPECT_EQ(template_file("full").output_format(), OutputFormat::kGemma4);
  // Ids come from the vocabulary: a toy one where <end_of_turn> is 1 and <eos> missing.
  auto toy = Tokenizer::from_vocab({"<unk>", "<end_of_turn>", "a"}, {}, {});
  ASSERT_TRUE(toy.ok());
  EXPECT_EQ(gemma3_template().stop_token_ids(*toy), (std::vector<int32_t>{1}));
}

}  // namespace
}  // namespace gemma4::text
