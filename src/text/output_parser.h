// Gemma 4 output parser: a streaming state machine from generated TEXT (the detokenizer's output
// with special tokens rendered as their text, e.g. `<|tool_call>`, `<channel|>`) to an OpenAI
// assistant message: content, reasoning_content and tool_calls (spec gemma4-chat-format.md
// sections 3 and 4, strict policy).
//
// Usage (server):
//   auto parser = OutputParser::for_prompt(rendered_prompt);    // initial state from the tail
//   for each detokenized chunk: ParserDelta d = parser.push(chunk); send d unless d.empty();
//                                if (parser.stopped()) stop generating;
//   ParserDelta last = parser.finish(hit_max_tokens);             // flushes held-back text
//   const ParsedMessage& m = parser.message();                    // m.finish_reason
//
// Guarantees:
// * Streaming == non-streaming: for any split of the same text into chunks, the concatenated
//   deltas and message() are identical (tests/text/output_parser_test.cpp checks every 2-way split
//   of every spec vector, fuzz/output_parser.cpp random splits).
// * Nothing is lost: every input byte lands, in order, in exactly one transcript() segment, and
//   content / reasoning_content are the (whitespace-trimmed) concatenations of the content /
//   reasoning segments. A `<|tool_call>call:…` that does not parse as a valid call is returned as
//   content, verbatim, markers included. The only text that is not surfaced is: the recognized
//   markers themselves, the `thought\n` channel label, a call cut off by the token limit (spec
//   vector truncated_call_length: no call, finish_reason "length"), and text after a stop marker.
// * Tool calls are emitted whole (name + complete JSON arguments in one delta) once the call is
//   closed, so a client never sees a call that later turns out to be invalid; content and
//   reasoning stream as they arrive, except that text which may be the start of a marker and
//   trailing whitespace are held back until disambiguated.
// * Content and reasoning are trimmed of ASCII whitespace (space, \t, \n, \v, \f, \r) at both ends.
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gemma4::text {

// Special-token texts and ids that end a Gemma 4 IT generation (eos_token_id [1, 106, 50]).
inline constexpr std::array<std::string_view, 3> kStopTokenTexts = {"<turn|>", "<eos>",
                                                                    "<|tool_response>"};
inline constexpr std::array<int32_t, 3> kStopTokenIds = {106, 1, 50};
// Gemma 3's (its ids come from the vocabulary: ChatTemplate::stop_token_ids).
inline constexpr std::array<std::string_view, 2> kGemma3StopTokenTexts = {"<end_of_turn>", "<eos>"};

// What generated text can hold: Gemma 4's thinking channel and tool-call markers, or (Gemma 3)
// plain content up to a stop marker.
enum class OutputFormat { kGemma4, kGemma3 };

struct ToolCall {
  int index = 0;          // position among this message's calls (OpenAI tool_calls[].index)
  std::string id;         // "call_" + 24 random alphanumerics, unique per call
  std::string name;       // function name as generated
  std::string arguments;  // JSON object text, compact, keys in the order the model wrote them

  // {"index", "id", "type": "function", "function": {"name", "arguments"}}
  nlohmann::json to_json() const;
};

// What one push()/finish() adds. Concatenating all deltas' content (reasoning_content) gives
// message().content (reasoning_content); tool_calls arrive complete, in index order.
struct ParserDelta {
  std::string content;
  std::string reasoning_content;
  std::vector<ToolCall> tool_calls;

  bool empty() const { return content.empty() && reasoning_content.empty() && tool_calls.empty(); }
};

struct ParsedMessage {
  std::optional<std::string> content;            // nullopt when empty
  std::optional<std::string> reasoning_content;  // nullopt when empty
  std::vector<ToolCall> tool_calls;
  // Set by finish(): "length" when the generation hit the token limit (finish(true)) or the text
  // ended inside an unclosed call; otherwise "tool_calls" when >= 1 call was parsed, else "stop".
  // Empty before finish().
  std::string finish_reason;

  // OpenAI assistant message: {"role":"assistant","content","reasoning_content","tool_calls"}
  // (null for absent content/reasoning; tool_calls omitted when there are none).
  nlohmann::json to_json() const;
};

// The parser's lossless account of its input; see "Nothing is lost" above.
enum class SegmentKind {
  kContent,            // surfaced (trimmed at the ends) as content
  kReasoning,          // surfaced (trimmed at the ends) as reasoning_content
  kMarker,             // a recognized control text: <|channel>, <channel|>, the thought\n label,
                       // a dropped stray <tool_call|>, the stop marker
  kToolCall,           // one complete call, `<|tool_call>call:` through its closer
  kTruncatedToolCall,  // a call still open when the text ended without a stop marker
  kAfterStop,          // text pushed after the stop marker
};
struct Segment {
  SegmentKind kind;
  std::string text;
};

class OutputParser {
 public:
  // Starts in REASONING when the prompt ends with `<|channel>thought\n` (thinking on, after a
  // tool result: spec 3.2), otherwise in CONTENT. Passing the whole prompt is fine.
  // With OutputFormat::kGemma3 all text is content and only kGemma3StopTokenTexts are markers.
  static OutputParser for_prompt(std::string_view prompt_tail,
                                 OutputFormat format = OutputFormat::kGemma4);

  // Consumes the next chunk of generated text (any split, even mid-UTF-8 or mid-marker).
  ParserDelta push(std::string_view text);
  // Ends the output: flushes held-back text, drops a call left open, sets finish_reason.
  // `token_limit_reached`: the generation stopped at max_tokens rather than at a stop token.
  // push() after finish() is ignored (counted as kAfterStop).
  ParserDelta finish(bool token_limit_reached = false);

  // True once a stop marker (kStopTokenTexts / kGemma3StopTokenTexts) was consumed: the
  // generation is over.
  bool stopped() const { return stopped_; }
  // The message so far (final after finish()).
  const ParsedMessage& message() const { return message_; }
  const std::vector<Segment>& transcript() const { return transcript_; }

  // Non-streaming convenience: for_prompt(prompt_tail), push(raw_output), finish().
  static ParsedMessage parse(std::string_view prompt_tail, std::string_view raw_output,
                             OutputFormat format = OutputFormat::kGemma4);

 private:
  enum class State { kContent, kReasoning, kCall, kStopped };

  // Content or reasoning text trimmed at both ends while streaming: leading whitespace is
  // dropped, trailing whitespace held until non-whitespace follows (and dropped at the end).
  struct TrimmedStream {
    bool started = false;
    std::string held_whitespace;
    std::string append(std::string_view text);  // what can be emitted now
  };

  OutputParser(State initial_state, bool expect_channel_label, OutputFormat format);
  std::optional<std::string_view> stop_marker_at(std::string_view text) const;
  bool could_become_stop_marker(std::string_view text) const;

  // Assigns as much of pending_ as can be decided; with `at_end` everything is decided.
  void drain(bool at_end, ParserDelta& delta);
  bool step_text(bool at_end, ParserDelta& delta);
  bool step_call(bool at_end, ParserDelta& delta);
  void begin_call(size_t marker_length);
  void end_call(bool closed, ParserDelta& delta);
  void emit_text(SegmentKind kind, std::string_view text, ParserDelta& delta);
  void consume(SegmentKind kind, size_t length);
  void record(SegmentKind kind, std::string_view text);
  std::string next_call_id();

  State state_;
  OutputFormat format_;
  bool expect_channel_label_;  // right after <|channel>: a `thought\n` label may follow
  bool stopped_ = false;
  bool finished_ = false;
  std::string pending_;       // input not yet assigned to a segment, from pending_begin_ on
  size_t pending_begin_ = 0;  // (drain() erases the assigned prefix once at its end)
  std::string_view unprocessed() const { return std::string_view(pending_).substr(pending_begin_); }
  // The open call: raw text from `<|tool_call>call:` on, and the scanner's context at its end.
  std::string call_text_;
  bool call_in_string_ = false;
  int call_depth_ = 0;
  TrimmedStream content_stream_;
  TrimmedStream reasoning_stream_;
  ParsedMessage message_;
  std::vector<Segment> transcript_;
  uint64_t id_state_;
};

}  // namespace gemma4::text
