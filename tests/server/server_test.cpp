#include <gtest/gtest.h>

#include "server/metrics.h"
#include "server/openai_request.h"
#include "server/stop_matcher.h"

namespace gemma4::server {
namespace {

using nlohmann::ordered_json;

TEST(StopMatcher, HoldsBackPossibleStartAndCutsAtMatch) {
  StopMatcher matcher({"THE END"});
  EXPECT_EQ(matcher.push("Once upon a time TH"), "Once upon a time ");  // "TH" may start the stop
  EXPECT_EQ(matcher.push("E E"), "");
  EXPECT_EQ(matcher.push("ND and more"), "");
  EXPECT_TRUE(matcher.matched());
  EXPECT_EQ(matcher.push("ignored"), "");
}

TEST(StopMatcher, ReleasesHeldTextWhenItDiverges) {
  StopMatcher matcher({"abc", "xyz"});
  EXPECT_EQ(matcher.push("1ab"), "1");
  EXPECT_EQ(matcher.push("d"), "abd");
  EXPECT_EQ(matcher.push("x"), "");
  EXPECT_EQ(matcher.flush(), "x");
  EXPECT_FALSE(matcher.matched());
}

TEST(StopMatcher, EarliestOfSeveralStopsWins) {
  StopMatcher matcher({"world", "lo"});
  EXPECT_EQ(matcher.push("hello world"), "hel");
}

TEST(ParseJsonBody, RejectsDeepNestingBadJsonAndNonObjects) {
  ordered_json out;
  EXPECT_FALSE(parse_json_body(R"({"a": [1, {"b": "}}}}"}]})", out).has_value());
  EXPECT_TRUE(parse_json_body(
      std::string(kMaxJsonDepth + 1, '[') + std::string(kMaxJsonDepth + 1, ']'), out));
  EXPECT_TRUE(parse_json_body("{\"a\": 1", out));
  EXPECT_TRUE(parse_json_body("[1]", out));
  EXPECT_TRUE(parse_json_body("{\"a\": \"\xff\"}", out));
}

ChatRequest parse_ok(const std::string& body) {
  ordered_json json = ordered_json::parse(body);
  ChatRequest request;
  auto error = parse_chat_request(json, {"gemma", "alias"}, 1000, request);
  EXPECT_FALSE(error.has_value()) << error->message;
  return request;
}

ApiError parse_error(const std::string& body) {
  ordered_json json = ordered_json::parse(body);
  ChatRequest request;
  auto error = parse_chat_request(json, {"gemma", "alias"}, 1000, request);
  EXPECT_TRUE(error.has_value()) << body;
  return error.value_or(ApiError{});
}

TEST(ParseChatRequest, ReadsSamplingStopsAndThinking) {
  ChatRequest request =
      parse_ok(R"({"model": "alias", "messages": [{"role": "user", "content": "hi"}],
      "temperature": 0, "top_k": -1, "seed": 5, "stop": "x", "max_tokens": 9,
      "max_completion_tokens": 7, "logit_bias": {"12": -100}, "reasoning_effort": "high"})");
  EXPECT_EQ(request.settings.sampling.temperature, 0.0f);
  EXPECT_EQ(request.settings.sampling.top_k, 0);
  EXPECT_EQ(request.settings.sampling.seed, 5u);
  EXPECT_EQ(request.settings.stop, std::vector<std::string>{"x"});
  EXPECT_EQ(request.settings.max_tokens, 7);
  ASSERT_EQ(request.settings.sampling.logit_bias.size(), 1u);
  EXPECT_EQ(request.settings.sampling.logit_bias[0].first, 12);
  EXPECT_TRUE(request.template_options.enable_thinking);
  EXPECT_TRUE(request.template_options.add_generation_prompt);
}

TEST(ParseChatRequest, TemplateKwargsOverrideTopLevelThinking) {
  ChatRequest request = parse_ok(R"({"messages": [{"role": "user", "content": "hi"}],
      "enable_thinking": true, "chat_template_kwargs": {"enable_thinking": false}})");
  EXPECT_FALSE(request.template_options.enable_thinking);
}

TEST(ParseChatRequest, ToolChoiceNamedKeepsOnlyThatTool) {
  ChatRequest request = parse_ok(R"({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}],
      "tool_choice": {"type": "function", "function": {"name": "b"}}})");
  ASSERT_EQ(request.tools.size(), 1u);
  EXPECT_EQ(request.tools[0]["function"]["name"], "b");
  ChatRequest none = parse_ok(R"({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "a"}}], "tool_choice": "none"})");
  EXPECT_TRUE(none.tools.is_null());
}

TEST(ParseChatRequest, UserMistakesAre400WithTheField) {
  EXPECT_EQ(
      parse_error(R"({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"})").code,
      "model_not_found");
  EXPECT_EQ(parse_error(R"({"messages": [{"role": "user", "content": "hi"}], "n": 2})").param, "n");
  EXPECT_EQ(
      parse_error(R"({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"})")
          .param,
      "temperature");
  EXPECT_EQ(
      parse_error(R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1})").param,
      "max_tokens");
  EXPECT_EQ(
      parse_error(R"({"messages": [{"role": "user", "content": "hi"}], "typo_field": 1})").param,
      "typo_field");
  EXPECT_EQ(
      parse_error(R"({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5000": 1}})")
          .param,
      "logit_bias");
  EXPECT_EQ(parse_error(R"({"messages": []})").param, "messages");
  EXPECT_EQ(parse_error(R"({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "has space"}}]})")
                .param,
            "tools[0].function.name");
  for (const auto& error :
       {parse_error(R"({"messages": "hi"})"), parse_error(R"({"stream": 1, "messages": []})")}) {
    EXPECT_EQ(error.http_status, 400);
  }
}

TEST(Metrics, RendersCountersHistogramsAndGauges) {
  Metrics metrics;
  runtime::RequestMetrics request;
  request.prompt_tokens = 10;
  request.cached_tokens = 4;
  request.completion_tokens = 5;
  request.prompt_ms = 20;
  request.decode_ms = 40;
  metrics.record_generation(request, false);
  metrics.record_request(200);
  metrics.record_request(429);
  runtime::SchedulerStats stats;
  stats.running = 2;
  stats.max_sequences = 4;
  stats.max_context = 100;
  stats.kv_tokens = 100;
  const std::string text = metrics.render(&stats);
  EXPECT_NE(text.find("gemma4_prompt_tokens_total 10\n"), std::string::npos);
  EXPECT_NE(text.find("gemma4_prompt_tokens_cached_total 4\n"), std::string::npos);
  EXPECT_NE(text.find("gemma4_requests_total{outcome=\"rejected\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("gemma4_time_to_first_token_seconds_bucket{le=\"0.025\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("gemma4_time_per_output_token_seconds_count 1\n"), std::string::npos);
  EXPECT_NE(text.find("gemma4_requests_running 2\n"), std::string::npos);
  EXPECT_NE(text.find("gemma4_kv_cache_usage_ratio 0.25\n"), std::string::npos);
  EXPECT_EQ(metrics.render(nullptr).find("gemma4_requests_running"), std::string::npos);
  EXPECT_NE(text.find("gemma4_requests_disconnected_total 0\n"), std::string::npos);
  metrics.record_generation(request, true);
  EXPECT_NE(metrics.render(nullptr).find("gemma4_requests_disconnected_total 1\n"),
            std::string::npos);
}

}  // namespace
}  // namespace gemma4::server
