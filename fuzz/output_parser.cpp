// libFuzzer target for the Gemma 4 output parser: arbitrary text, split into arbitrary chunks.
//
// Input layout: byte 0 picks the prompt tail (content or open reasoning channel) and whether the
// run ends at the token limit; byte 1 seeds the chunk sizes; the rest is the generated text.
// Checked on every input:
//   * no crash, no sanitizer report;
//   * nothing lost: the transcript's segments concatenate to the exact input, and content /
//     reasoning_content are the trimmed concatenations of the content / reasoning segments;
//   * the concatenated deltas equal the final message;
//   * streaming in chunks gives the same message and transcript as one push;
//   * every tool call's arguments are a JSON object.
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "text/output_parser.h"

namespace {

using gemma4::text::OutputParser;
using gemma4::text::ParserDelta;
using gemma4::text::Segment;
using gemma4::text::SegmentKind;

void require(bool condition) {
  if (!condition) std::abort();
}

std::string trimmed(const std::string& text) {
  const char* space = " \t\n\v\f\r";
  const size_t begin = text.find_first_not_of(space);
  if (begin == std::string::npos) return {};
  return text.substr(begin, text.find_last_not_of(space) - begin + 1);
}

struct Run {
  std::string content_deltas, reasoning_deltas, call_deltas;
  OutputParser parser = OutputParser::for_prompt("");

  void collect(const ParserDelta& delta) {
    content_deltas += delta.content;
    reasoning_deltas += delta.reasoning_content;
    for (const auto& call : delta.tool_calls) call_deltas += call.name + call.arguments + "|";
  }
};

void check_run(const Run& run, std::string_view raw) {
  std::string all, content, reasoning;
  for (const Segment& segment : run.parser.transcript()) {
    all += segment.text;
    if (segment.kind == SegmentKind::kContent) content += segment.text;
    if (segment.kind == SegmentKind::kReasoning) reasoning += segment.text;
  }
  require(all == raw);
  const auto& message = run.parser.message();
  require(message.content.value_or("") == trimmed(content));
  require(message.reasoning_content.value_or("") == trimmed(reasoning));
  require(run.content_deltas == message.content.value_or(""));
  require(run.reasoning_deltas == message.reasoning_content.value_or(""));
  for (const auto& call : message.tool_calls) {
    const auto arguments = nlohmann::json::parse(call.arguments, nullptr, false);
    require(arguments.is_object());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t mode = data[0];
  uint32_t chunk_state = data[1] | 0x100u;
  const std::string_view raw(reinterpret_cast<const char*>(data + 2), size - 2);
  const std::string_view prompt_tail = (mode & 1) ? "<|channel>thought\n" : "<|turn>model\n";
  const bool token_limit = (mode & 2) != 0;

  Run whole;
  whole.parser = OutputParser::for_prompt(prompt_tail);
  whole.collect(whole.parser.push(raw));
  whole.collect(whole.parser.finish(token_limit));
  check_run(whole, raw);

  Run chunked;
  chunked.parser = OutputParser::for_prompt(prompt_tail);
  for (size_t pos = 0; pos < raw.size();) {
    chunk_state = chunk_state * 1103515245u + 12345u;  // chunk sizes 0..7 from the seed byte
    const size_t length = (chunk_state >> 16) % 8;
    chunked.collect(chunked.parser.push(raw.substr(pos, length)));
    pos += length;
  }
  chunked.collect(chunked.parser.finish(token_limit));
  check_run(chunked, raw);

  require(whole.content_deltas == chunked.content_deltas);
  require(whole.reasoning_deltas == chunked.reasoning_deltas);
  require(whole.call_deltas == chunked.call_deltas);
  require(whole.parser.message().finish_reason == chunked.parser.message().finish_reason);
  const auto& a = whole.parser.transcript();
  const auto& b = chunked.parser.transcript();
  require(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) require(a[i].kind == b[i].kind && a[i].text == b[i].text);
  return 0;
}
