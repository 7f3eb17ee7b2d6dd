#include "text/output_parser.h"

#include <algorithm>
#include <random>
#include <span>

#include "text/output_tool_call.h"

namespace gemma4::text {
namespace {

constexpr std::string_view kChannelOpen = "<|channel>";
constexpr std::string_view kChannelClose = "<channel|>";
// With text only, a call starts at the full prefix (spec 3.3): a bare `<|tool_call>` written as
// prose stays text.
constexpr std::string_view kCallOpen = "<|tool_call>call:";
constexpr std::string_view kCallOpenToken = "<|tool_call>";
constexpr std::string_view kCallClose = "<tool_call|>";
constexpr std::string_view kStringDelimiter = "<|\"|>";
constexpr std::string_view kThoughtLabel = "thought\n";
constexpr std::string_view kThoughtBeforeClose = "thought<channel|>";  // empty, label without \n
constexpr std::string_view kThoughtWord = "thought";

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

// True when `text` is shorter than `marker` and could still grow into it.
bool is_proper_prefix_of(std::string_view text, std::string_view marker) {
  return text.size() < marker.size() && starts_with(marker, text);
}

std::span<const std::string_view> stop_texts(OutputFormat format) {
  if (format == OutputFormat::kGemma3) return kGemma3StopTokenTexts;
  return kStopTokenTexts;
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

nlohmann::json ToolCall::to_json() const {
  return {{"index", index},
          {"id", id},
          {"type", "function"},
          {"function", {{"name", name}, {"arguments", arguments}}}};
}

nlohmann::json ParsedMessage::to_json() const {
  nlohmann::json message = {
      {"role", "assistant"},
      {"content", content ? nlohmann::json(*content) : nlohmann::json()},
      {"reasoning_content",
       reasoning_content ? nlohmann::json(*reasoning_content) : nlohmann::json()}};
  if (!tool_calls.empty()) {
    nlohmann::json calls = nlohmann::json::array();
    for (const ToolCall& call : tool_calls) {
      nlohmann::json entry = call.to_json();
      entry.erase("index");  // a complete message's calls carry no stream index
      calls.push_back(std::move(entry));
    }
    message["tool_calls"] = std::move(calls);
  }
  return message;
}

std::string OutputParser::TrimmedStream::append(std::string_view text) {
  if (!started) {
    while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
    if (text.empty()) return {};
    started = true;
  }
  size_t keep = text.size();
  while (keep > 0 && is_space(text[keep - 1])) --keep;
  if (keep == 0) {
    held_whitespace.append(text);
    return {};
  }
  std::string out = std::move(held_whitespace);
  out.append(text.substr(0, keep));
  held_whitespace.assign(text.substr(keep));
  return out;
}

std::optional<std::string_view> OutputParser::stop_marker_at(std::string_view text) const {
  for (std::string_view stop : stop_texts(format_)) {
    if (starts_with(text, stop)) return stop;
  }
  return std::nullopt;
}

bool OutputParser::could_become_stop_marker(std::string_view text) const {
  const auto stops = stop_texts(format_);
  return std::any_of(stops.begin(), stops.end(),
                     [&](std::string_view stop) { return is_proper_prefix_of(text, stop); });
}

OutputParser::OutputParser(State initial_state, bool expect_channel_label, OutputFormat format)
    : state_(initial_state),
      format_(format),
      expect_channel_label_(expect_channel_label),
      id_state_((static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}()) {}

OutputParser OutputParser::for_prompt(std::string_view prompt_tail, OutputFormat format) {
  const auto ends_with = [&](std::string_view suffix) {
    return prompt_tail.size() >= suffix.size() &&
           prompt_tail.substr(prompt_tail.size() - suffix.size()) == suffix;
  };
  if (format == OutputFormat::kGemma4) {
    if (ends_with("<|channel>thought\n")) return OutputParser(State::kReasoning, false, format);
    if (ends_with(kChannelOpen)) return OutputParser(State::kReasoning, true, format);
  }
  return OutputParser(State::kContent, false, format);
}

ParsedMessage OutputParser::parse(std::string_view prompt_tail, std::string_view raw_output,
                                  OutputFormat format) {
  OutputParser parser = for_prompt(prompt_tail, format);
  parser.push(raw_output);
  parser.finish();
  return parser.message();
}

ParserDelta OutputParser::push(std::string_view text) {
  ParserDelta delta;
  if (finished_) {
    record(SegmentKind::kAfterStop, text);
    return delta;
  }
  pending_.append(text);
  drain(/*at_end=*/false, delta);
  return delta;
}

ParserDelta OutputParser::finish(bool token_limit_reached) {
  ParserDelta delta;
  if (finished_) return delta;
  drain(/*at_end=*/true, delta);
  bool truncated_call = false;
  if (state_ == State::kCall) {
    // Cut off inside a call: the strict policy reports no call (spec 3.5 #16).
    record(SegmentKind::kTruncatedToolCall, call_text_);
    call_text_.clear();
    state_ = State::kContent;
    truncated_call = true;
  }
  finished_ = true;
  if (token_limit_reached || truncated_call) {
    message_.finish_reason = "length";
  } else {
    message_.finish_reason = message_.tool_calls.empty() ? "stop" : "tool_calls";
  }
  return delta;
}

void OutputParser::drain(bool at_end, ParserDelta& delta) {
  while (pending_begin_ < pending_.size()) {
    bool progressed = false;
    switch (state_) {
      case State::kContent:
      case State::kReasoning:
        progressed = step_text(at_end, delta);
        break;
      case State::kCall:
        progressed = step_call(at_end, delta);
        break;
      case State::kStopped:
        consume(SegmentKind::kAfterStop, unprocessed().size());
        progressed = true;
        break;
    }
    if (!progressed) break;
  }
  pending_.erase(0, pending_begin_);  // one erase per drain keeps long pushes linear
  pending_begin_ = 0;
}

// CONTENT / REASONING: text up to the next marker; returns false when waiting for more input.
bool OutputParser::step_text(bool at_end, ParserDelta& delta) {
  const std::string_view text = unprocessed();
  const SegmentKind text_kind =
      state_ == State::kContent ? SegmentKind::kContent : SegmentKind::kReasoning;

  if (expect_channel_label_) {
    if (starts_with(text, kThoughtLabel)) {
      consume(SegmentKind::kMarker, kThoughtLabel.size());
    } else if (starts_with(text, kThoughtBeforeClose)) {
      consume(SegmentKind::kMarker, kThoughtWord.size());
    } else if (!at_end && (is_proper_prefix_of(text, kThoughtLabel) ||
                           is_proper_prefix_of(text, kThoughtBeforeClose))) {
      return false;
    }
    expect_channel_label_ = false;  // anything else ("thousand…") is reasoning text
    return true;
  }

  const size_t open = text.find('<');
  if (open != 0) {
    const size_t length = open == std::string_view::npos ? text.size() : open;
    emit_text(text_kind, text.substr(0, length), delta);
    pending_begin_ += length;
    return true;
  }

  if (auto stop = stop_marker_at(text)) {
    consume(SegmentKind::kMarker, stop->size());
    state_ = State::kStopped;
    stopped_ = true;
    return true;
  }
  if (format_ == OutputFormat::kGemma3) {  // no other markers: a '<' starting no stop is text
    if (could_become_stop_marker(text) && !at_end) return false;
    emit_text(text_kind, text.substr(0, 1), delta);
    ++pending_begin_;
    return true;
  }
  if (starts_with(text, kCallOpen)) {
    begin_call(kCallOpen.size());
    return true;
  }
  if (state_ == State::kContent && starts_with(text, kChannelOpen)) {
    consume(SegmentKind::kMarker, kChannelOpen.size());
    state_ = State::kReasoning;
    expect_channel_label_ = true;
    return true;
  }
  if (starts_with(text, kChannelClose)) {
    // Closes reasoning; in content it is a stray closer and dropped.
    consume(SegmentKind::kMarker, kChannelClose.size());
    state_ = State::kContent;
    return true;
  }
  if (state_ == State::kContent && starts_with(text, kCallClose)) {
    consume(SegmentKind::kMarker, kCallClose.size());  // stray / duplicated closer: dropped
    return true;
  }
  const bool may_be_marker =
      could_become_stop_marker(text) || is_proper_prefix_of(text, kCallOpen) ||
      is_proper_prefix_of(text, kChannelClose) ||
      (state_ == State::kContent &&
       (is_proper_prefix_of(text, kChannelOpen) || is_proper_prefix_of(text, kCallClose)));
  if (may_be_marker && !at_end) return false;
  emit_text(text_kind, text.substr(0, 1), delta);  // a '<' that starts no marker
  ++pending_begin_;
  return true;
}

void OutputParser::begin_call(size_t marker_length) {
  call_text_.assign(unprocessed().substr(0, marker_length));
  pending_begin_ += marker_length;
  call_in_string_ = false;
  call_depth_ = 0;
  state_ = State::kCall;
}

// CALL: scans to the closer `<tool_call|>` at depth 0 outside strings. A stop marker (anywhere)
// or a new `<|tool_call>` (outside strings) also ends the call, which then counts if it parses.
bool OutputParser::step_call(bool at_end, ParserDelta& delta) {
  const std::string_view text = unprocessed();
  size_t pos = 0;
  const auto take = [&](size_t length) {
    call_text_.append(text.substr(0, length));
    pending_begin_ += length;
  };
  while (pos < text.size()) {
    const char c = text[pos];
    if (c != '<') {
      if (!call_in_string_) {
        if (c == '{' || c == '[') ++call_depth_;
        if (c == '}' || c == ']') --call_depth_;
      }
      ++pos;
      continue;
    }
    const std::string_view rest = text.substr(pos);
    if (stop_marker_at(rest)) {
      take(pos);
      end_call(/*closed=*/false, delta);
      return true;
    }
    if (starts_with(rest, kStringDelimiter)) {
      call_in_string_ = !call_in_string_;
      pos += kStringDelimiter.size();
      continue;
    }
    if (!call_in_string_ && call_depth_ == 0 && starts_with(rest, kCallClose)) {
      take(pos + kCallClose.size());
      end_call(/*closed=*/true, delta);
      return true;
    }
    if (!call_in_string_ && starts_with(rest, kCallOpenToken)) {
      take(pos);
      end_call(/*closed=*/false, delta);
      return true;
    }
    const bool may_be_marker =
        could_become_stop_marker(rest) || is_proper_prefix_of(rest, kStringDelimiter) ||
        is_proper_prefix_of(rest, kCallClose) || is_proper_prefix_of(rest, kCallOpenToken);
    if (may_be_marker && !at_end) {
      take(pos);
      return false;
    }
    ++pos;
  }
  take(pos);
  return false;
}

void OutputParser::end_call(bool closed, ParserDelta& delta) {
  std::string_view body = call_text_;
  body.remove_prefix(kCallOpen.size());
  if (closed) body.remove_suffix(kCallClose.size());
  state_ = State::kContent;
  auto parsed = parse_gemma_tool_call(body);
  if (!parsed.ok()) {
    emit_text(SegmentKind::kContent, call_text_, delta);  // not a valid call: it is content
  } else {
    record(SegmentKind::kToolCall, call_text_);
    ToolCall call{static_cast<int>(message_.tool_calls.size()), next_call_id(),
                  std::move(parsed->name), std::move(parsed->arguments_json)};
    delta.tool_calls.push_back(call);
    message_.tool_calls.push_back(std::move(call));
  }
  call_text_.clear();
}

void OutputParser::emit_text(SegmentKind kind, std::string_view text, ParserDelta& delta) {
  record(kind, text);
  const bool is_content = kind == SegmentKind::kContent;
  std::string emitted = (is_content ? content_stream_ : reasoning_stream_).append(text);
  if (emitted.empty()) return;
  std::optional<std::string>& total = is_content ? message_.content : message_.reasoning_content;
  if (!total) total.emplace();
  total->append(emitted);
  (is_content ? delta.content : delta.reasoning_content).append(emitted);
}

void OutputParser::consume(SegmentKind kind, size_t length) {
  record(kind, unprocessed().substr(0, length));
  pending_begin_ += length;
}

void OutputParser::record(SegmentKind kind, std::string_view text) {
  if (text.empty()) return;
  if (!transcript_.empty() && transcript_.back().kind == kind && kind != SegmentKind::kToolCall) {
    transcript_.back().text.append(text);
  } else {
    transcript_.push_back({kind, std::string(text)});
  }
}

std::string OutputParser::next_call_id() {
  static constexpr std::string_view kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlphabet[splitmix64(id_state_) % kAlphabet.size()];
  return id;
}

}  // namespace gemma4::text
