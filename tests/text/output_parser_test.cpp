// OutputParser against the spec's parse vectors (gemma4-chat-vectors.json), the edge cases of
// spec section 3.5 (expectations taken from the spec's policy column), and the streaming
// guarantee: every 2-way split and random multi-way splits of each output give the same message,
// deltas and transcript as parsing it in one piece.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <random>
#include <sstream>

#include "test_support.h"
#include "text/output_parser.h"
#include "text/output_tool_call.h"

namespace gemma4::text {
namespace {

using nlohmann::json;

json parse_vectors() {
  std::ifstream file(testing::shared_data_dir() / ".." / "spec" / "gemma4-chat-vectors.json");
  return json::parse(file)["parse"];
}

// The message in the vectors' shape: arguments as parsed JSON, ids left out.
json comparable(const ParsedMessage& message) {
  json calls = json::array();
  for (const ToolCall& call : message.tool_calls) {
    calls.push_back({{"name", call.name}, {"arguments", json::parse(call.arguments)}});
  }
  return {
      {"content", message.content ? json(*message.content) : json()},
      {"reasoning_content", message.reasoning_content ? json(*message.reasoning_content) : json()},
      {"tool_calls", calls},
      {"finish_reason", message.finish_reason}};
}

// Everything a streaming client observes, for comparing runs.
struct StreamResult {
  std::string content_deltas;
  std::string reasoning_deltas;
  std::vector<std::pair<std::string, std::string>> call_deltas;  // name, arguments
  ParsedMessage message;
  std::vector<Segment> transcript;
};

StreamResult run_chunks(std::string_view prompt_tail, const std::vector<std::string>& chunks) {
  StreamResult result;
  auto parser = OutputParser::for_prompt(prompt_tail);
  const auto collect = [&](const ParserDelta& delta) {
    result.content_deltas += delta.content;
    result.reasoning_deltas += delta.reasoning_content;
    for (const ToolCall& call : delta.tool_calls) {
      EXPECT_EQ(call.index, static_cast<int>(result.call_deltas.size()));
      result.call_deltas.emplace_back(call.name, call.arguments);
    }
  };
  for (const std::string& chunk : chunks) collect(parser.push(chunk));
  collect(parser.finish());
  result.message = parser.message();
  result.transcript = parser.transcript();
  return result;
}

void expect_same_observations(const StreamResult& a, const StreamResult& b) {
  EXPECT_EQ(a.content_deltas, b.content_deltas);
  EXPECT_EQ(a.reasoning_deltas, b.reasoning_deltas);
  EXPECT_EQ(a.call_deltas, b.call_deltas);
  EXPECT_EQ(comparable(a.message), comparable(b.message));
  ASSERT_EQ(a.transcript.size(), b.transcript.size());
  for (size_t i = 0; i < a.transcript.size(); ++i) {
    EXPECT_EQ(a.transcript[i].kind, b.transcript[i].kind);
    EXPECT_EQ(a.transcript[i].text, b.transcript[i].text);
  }
}

// The documented invariants of one run over `raw`.
void expect_invariants(const StreamResult& result, std::string_view raw) {
  std::string all, content, reasoning;
  for (const Segment& segment : result.transcript) {
    all += segment.text;
    if (segment.kind == SegmentKind::kContent) content += segment.text;
    if (segment.kind == SegmentKind::kReasoning) reasoning += segment.text;
  }
  EXPECT_EQ(all, raw) << "the transcript must account for every input byte, in order";
  const auto trimmed = [](std::string text) {
    const char* space = " \t\n\v\f\r";
    const size_t begin = text.find_first_not_of(space);
    if (begin == std::string::npos) return std::string();
    return text.substr(begin, text.find_last_not_of(space) - begin + 1);
  };
  EXPECT_EQ(result.message.content.value_or(""), trimmed(content));
  EXPECT_EQ(result.message.reasoning_content.value_or(""), trimmed(reasoning));
  EXPECT_EQ(result.content_deltas, result.message.content.value_or(""));
  EXPECT_EQ(result.reasoning_deltas, result.message.reasoning_content.value_or(""));
}

TEST(OutputParser, MatchesEverySpecVector) {
  const json vectors = parse_vectors();
  ASSERT_GE(vectors.size(), 15u);
  for (const json& vector : vectors) {
    SCOPED_TRACE(vector["name"].get<std::string>());
    const ParsedMessage message = OutputParser::parse(vector["prompt_tail"].get<std::string>(),
                                                      vector["raw_output"].get<std::string>());
    EXPECT_EQ(comparable(message), vector["expected"]);
  }
}

TEST(OutputParser, StreamingEqualsOneShotForEverySplitOfEveryVector) {
  std::mt19937 rng(20260709);
  for (const json& vector : parse_vectors()) {
    SCOPED_TRACE(vector["name"].get<std::string>());
    const std::string tail = vector["prompt_tail"];
    const std::string raw = vector["raw_output"];
    const StreamResult whole = run_chunks(tail, {raw});
    expect_invariants(whole, raw);
    for (size_t cut = 0; cut <= raw.size(); ++cut) {
      const StreamResult split = run_chunks(tail, {raw.substr(0, cut), raw.substr(cut)});
      expect_same_observations(whole, split);
    }
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<std::string> chunks;
      for (size_t pos = 0; pos < raw.size();) {
        const size_t length = std::uniform_int_distribution<size_t>(0, 6)(rng);
        chunks.push_back(raw.substr(pos, length));
        pos += length;
      }
      const StreamResult split = run_chunks(tail, chunks);
      expect_same_observations(whole, split);
      expect_invariants(split, raw);
    }
    std::vector<std::string> bytes;
    for (char c : raw) bytes.emplace_back(1, c);
    expect_same_observations(whole, run_chunks(tail, bytes));
  }
}

struct Case {
  const char* name;
  const char* prompt_tail;
  const char* raw_output;
  const char* expected;  // comparable() JSON
};

// Spec 3.5 edge cases and section 4 conversions. Expectations follow the spec's strict policy.
TEST(OutputParser, HandlesTheSpecEdgeCases) {
  const Case cases[] = {
      {"#2 literal marker text without call: stays content", "<|turn>model\n",
       "Use the <|tool_call> token.<turn|>",
       R"({"content":"Use the <|tool_call> token.","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"#4 thousand is not the label", "<|turn>model\n",
       "<|channel>thousand reasons<channel|>Done<turn|>",
       R"({"content":"Done","reasoning_content":"thousand reasons","tool_calls":[],"finish_reason":"stop"})"},
      {"label without newline before the closer", "<|turn>model\n",
       "<|channel>thought<channel|>Hi<turn|>",
       R"({"content":"Hi","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"#5 reasoning never closed", "<|turn>model\n", "<|channel>thought\nStill thinking",
       R"({"content":null,"reasoning_content":"Still thinking","tool_calls":[],"finish_reason":"stop"})"},
      {"#7 text before the channel", "<|turn>model\n",
       "Sure. <|channel>thought\nhmm<channel|> Answer.<turn|>",
       R"({"content":"Sure.  Answer.","reasoning_content":"hmm","tool_calls":[],"finish_reason":"stop"})"},
      {"#9 quoted keys", "<|turn>model\n",
       "<|tool_call>call:edit{record_map:{<|\"|>3<|\"|>:<|\"|>new text<|\"|>}}<tool_call|>",
       R"({"content":null,"reasoning_content":null,"tool_calls":[{"name":"edit","arguments":{"record_map":{"3":"new text"}}}],"finish_reason":"tool_calls"})"},
      {"#10 JSON strings are not Gemma strings: content", "<|turn>model\n",
       "<|tool_call>call:f{a:\"x\"}<tool_call|><turn|>",
       R"({"content":"<|tool_call>call:f{a:\"x\"}<tool_call|>","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"#11 key=value: content", "<|turn>model\n", "<|tool_call>call:f{a=1}<tool_call|>",
       R"({"content":"<|tool_call>call:f{a=1}<tool_call|>","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"#14 missing closer before the next call", "<|turn>model\n",
       "<|tool_call>call:f{a:1}<|tool_call>call:g{}<tool_call|><|tool_response>",
       R"({"content":null,"reasoning_content":null,"tool_calls":[{"name":"f","arguments":{"a":1}},{"name":"g","arguments":{}}],"finish_reason":"tool_calls"})"},
      {"#14 missing closer before the stop token", "<|turn>model\n",
       "<|tool_call>call:f{a:[1,2]}<|tool_response>",
       R"({"content":null,"reasoning_content":null,"tool_calls":[{"name":"f","arguments":{"a":[1,2]}}],"finish_reason":"tool_calls"})"},
      {"#14 missing closer before eos", "<|turn>model\n", "<|tool_call>call:f{}<eos>",
       R"({"content":null,"reasoning_content":null,"tool_calls":[{"name":"f","arguments":{}}],"finish_reason":"tool_calls"})"},
      {"unbalanced call ended by a stop: content", "<|turn>model\n",
       "<|tool_call>call:f{a:<|\"|>x<turn|>",
       R"({"content":"<|tool_call>call:f{a:<|\"|>x","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"#17 trailing comma: content", "<|turn>model\n", "<|tool_call>call:f{x:1,}<tool_call|>",
       R"({"content":"<|tool_call>call:f{x:1,}<tool_call|>","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"#20 names with - and .", "<|turn>model\n",
       "<|tool_call>call:web.search-v2{q:<|\"|>x<|\"|>}<tool_call|>",
       R"({"content":null,"reasoning_content":null,"tool_calls":[{"name":"web.search-v2","arguments":{"q":"x"}}],"finish_reason":"tool_calls"})"},
      {"#22 Python words: content", "<|turn>model\n", "<|tool_call>call:f{a:None}<tool_call|>",
       R"({"content":"<|tool_call>call:f{a:None}<tool_call|>","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"invalid name: content", "<|turn>model\n", "<|tool_call>call:f g{}<tool_call|>",
       R"({"content":"<|tool_call>call:f g{}<tool_call|>","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"closer inside a string is text", "<|turn>model\n",
       "<|tool_call>call:f{s:<|\"|>a<tool_call|>b}<|\"|>}<tool_call|>",
       R"({"content":null,"reasoning_content":null,"tool_calls":[{"name":"f","arguments":{"s":"a<tool_call|>b}"}}],"finish_reason":"tool_calls"})"},
      {"whitespace between tokens", "<|turn>model\n",
       "<|tool_call>call:f{ a : 1 ,\n b : [ true , null ] }<tool_call|>",
       R"({"content":null,"reasoning_content":null,"tool_calls":[{"name":"f","arguments":{"a":1,"b":[true,null]}}],"finish_reason":"tool_calls"})"},
      {"stray channel closer in content is dropped", "<|turn>model\n", "A<channel|>B<turn|>",
       R"({"content":"AB","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"text after the stop token is not surfaced", "<|turn>model\n", "Hi<turn|>ignored",
       R"({"content":"Hi","reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
      {"prompt ends inside the channel, model calls a tool", "<tool_response|><|channel>thought\n",
       "Need more.<channel|><|tool_call>call:f{}<tool_call|><|tool_response>",
       R"({"content":null,"reasoning_content":"Need more.","tool_calls":[{"name":"f","arguments":{}}],"finish_reason":"tool_calls"})"},
      {"empty output", "<|turn>model\n", "",
       R"({"content":null,"reasoning_content":null,"tool_calls":[],"finish_reason":"stop"})"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string raw = c.raw_output;
    const StreamResult whole = run_chunks(c.prompt_tail, {raw});
    EXPECT_EQ(comparable(whole.message), json::parse(c.expected));
    expect_invariants(whole, raw);
    for (size_t cut = 0; cut <= raw.size(); ++cut) {
      expect_same_observations(whole,
                               run_chunks(c.prompt_tail, {raw.substr(0, cut), raw.substr(cut)}));
    }
  }
}

TEST(OutputParser, TokenLimitGivesLength) {
  auto parser = OutputParser::for_prompt("<|turn>model\n");
  parser.push("<|channel>thought\nlong reasoning");
  parser.finish(/*token_limit_reached=*/true);
  EXPECT_EQ(parser.message().finish_reason, "length");
  EXPECT_EQ(parser.message().reasoning_content, "long reasoning");
  EXPECT_FALSE(parser.message().content.has_value());
  EXPECT_FALSE(parser.stopped());
}

TEST(OutputParser, StopsAtStopMarkersAndIgnoresLaterInput) {
  for (std::string_view stop : kStopTokenTexts) {
    auto parser = OutputParser::for_prompt("");
    parser.push("Hello");
    EXPECT_FALSE(parser.stopped());
    parser.push(std::string(stop) + "x");
    EXPECT_TRUE(parser.stopped());
    EXPECT_TRUE(parser.push("more").empty());
    parser.finish();
    EXPECT_EQ(parser.message().content, "Hello");
    EXPECT_EQ(parser.transcript().back().kind, SegmentKind::kAfterStop);
  }
}

// Gemma 3 output is plain content: Gemma 4's markers are text, <end_of_turn> / <eos> stop it.
TEST(OutputParser, Gemma3FormatHasOnlyContentAndItsStopMarkers) {
  const std::string gemma4_markup =
      "<|channel>thought\nx<channel|><|tool_call>call:f{}<tool_call|>";
  for (std::string_view stop : kGemma3StopTokenTexts) {
    const ParsedMessage message = OutputParser::parse(
        "<start_of_turn>model\n", " Paris. " + gemma4_markup + "<turn|>" + std::string(stop) + "x",
        OutputFormat::kGemma3);
    EXPECT_EQ(message.content, "Paris. " + gemma4_markup + "<turn|>");
    EXPECT_FALSE(message.reasoning_content.has_value());
    EXPECT_TRUE(message.tool_calls.empty());
    EXPECT_EQ(message.finish_reason, "stop");
  }
  // A prompt ending like a Gemma 4 thinking prompt changes nothing, and streaming holds back
  // only what may still become a stop marker.
  auto parser = OutputParser::for_prompt("<|channel>thought\n", OutputFormat::kGemma3);
  EXPECT_EQ(parser.push("a <end_of").content, "a");
  EXPECT_EQ(parser.push("_line> b<end_of_turn>").content, " <end_of_line> b");
  EXPECT_TRUE(parser.stopped());
}

TEST(OutputParser, HoldsBackOnlyWhatMayBeAMarkerOrTrailingSpace) {
  auto parser = OutputParser::for_prompt("<|turn>model\n");
  EXPECT_EQ(parser.push("Hello <").content, "Hello");
  EXPECT_EQ(parser.push("b> and <|tool_").content, " <b> and");
  ParserDelta delta = parser.push("call>call:f{}<tool_call|>");
  EXPECT_EQ(delta.content, "");
  ASSERT_EQ(delta.tool_calls.size(), 1u);
  EXPECT_EQ(delta.tool_calls[0].name, "f");
  EXPECT_EQ(delta.tool_calls[0].arguments, "{}");
}

TEST(OutputParser, CallIdsAreUniqueOpenAiStyle) {
  const ParsedMessage message = OutputParser::parse(
      "", "<|tool_call>call:f{}<tool_call|><|tool_call>call:f{}<tool_call|><|tool_response>");
  ASSERT_EQ(message.tool_calls.size(), 2u);
  for (const ToolCall& call : message.tool_calls) {
    ASSERT_EQ(call.id.size(), 5u + 24u);
    EXPECT_EQ(call.id.substr(0, 5), "call_");
    EXPECT_TRUE(std::all_of(call.id.begin() + 5, call.id.end(),
                            [](char c) { return std::isalnum(static_cast<unsigned char>(c)); }));
  }
  EXPECT_NE(message.tool_calls[0].id, message.tool_calls[1].id);
  EXPECT_EQ(message.tool_calls[1].index, 1);
  const json openai = message.to_json();
  EXPECT_EQ(openai["tool_calls"][1]["type"], "function");
  EXPECT_EQ(openai["tool_calls"][1]["function"]["name"], "f");
  EXPECT_TRUE(openai["content"].is_null());
}

// Section 4: Gemma syntax -> JSON text (compared as text where the spec fixes the text).
TEST(GemmaToolCall, ConvertsValuesToJsonText) {
  const std::pair<const char*, const char*> cases[] = {
      {"f{a:1000,b:1000.0,c:-678,d:9007199254740993,e:1e3}",
       R"({"a":1000,"b":1000.0,"c":-678,"d":9007199254740993,"e":1e3})"},
      {"f{a:+5,b:.5,c:5.,d:-.25,e:007}", R"({"a":5,"b":0.5,"c":5.0,"d":-0.25,"e":7})"},
      {"f{p:<|\"|>C:\\temp\\n<|\"|>}", R"({"p":"C:\\temp\\n"})"},
      {"f{s:<|\"|>tab\tnl\ncr\r\x01 \"q\" é<|\"|>}", R"({"s":"tab\tnl\ncr\r\u0001 \"q\" é"})"},
      {"f{z:1,a:2,z:3}", R"({"z":1,"a":2})"},
      {"f{o:{b:{}},l:[],n:null,t:true}", R"({"o":{"b":{}},"l":[],"n":null,"t":true})"},
      {"f{b:[1,{c:-2.5e3,d:{}},{e:2}]}", R"({"b":[1,{"c":-2.5e3,"d":{}},{"e":2}]})"},
      {"get_time", "{}"},
      {"f{my key:1}", R"({"my key":1})"},
      {"f{s:<|\"|>\xff<|\"|>}", R"({"s":"�"})"},
      // Beyond double's range: kept as text (a fuzzer find); underflow is still a number.
      {"f{e:1e+320,g:-1e999,s:1e-400}", R"({"e":"1e+320","g":"-1e999","s":1e-400})"},
  };
  for (const auto& [body, expected] : cases) {
    SCOPED_TRACE(body);
    auto call = parse_gemma_tool_call(body);
    ASSERT_TRUE(call.ok()) << call.error().to_string();
    EXPECT_EQ(call->arguments_json, expected);
    EXPECT_TRUE(json::accept(call->arguments_json));
  }
  for (const char* bad : {"", "{a:1}", "f{a:1", "f{a:1}x", "f{a:NaN}", "f{a:'x'}", "f{:1}",
                          "f{a:[1,]}", "f{a:1 2}", "f{a:<|\"|>x}"}) {
    SCOPED_TRACE(bad);
    EXPECT_FALSE(parse_gemma_tool_call(bad).ok());
  }
}

}  // namespace
}  // namespace gemma4::text
