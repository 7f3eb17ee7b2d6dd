// The host half of the sampled step API (engine.h): the reference LogitSummary and the default
// Engine::step_sampled over step().
#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine/engine.h"

namespace gemma4::engine {

void apply_logit_edits(std::span<float> row, std::span<const LogitEdit> edits) {
  for (const LogitEdit& edit : edits) {
    float& logit = row[static_cast<size_t>(edit.token)];
    logit += edit.bias;
    logit = logit > 0 ? logit / edit.repetition_penalty : logit * edit.repetition_penalty;
    logit -= edit.subtract;
  }
}

void summarize_logits(std::span<float> row, std::span<const LogitEdit> edits, int32_t candidates,
                      LogitSummary& summary) {
  apply_logit_edits(row, edits);
  summary.max_logit = *std::max_element(row.begin(), row.end());
  double sum = 0.0;
  for (float logit : row) sum += std::exp(static_cast<double>(logit) - summary.max_logit);
  summary.log_normaliser = summary.max_logit + std::log(sum);

  const auto vocab = static_cast<int32_t>(row.size());
  const int32_t count = std::min(candidates, vocab);
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  // Higher logit first; equal logits: lower token id first.
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&](int32_t a, int32_t b) {
    return row[a] != row[b] ? row[a] > row[b] : a < b;
  });
  summary.top.clear();
  for (int32_t i = 0; i < count; ++i) summary.top.emplace_back(order[i], row[order[i]]);
}

Status check_logit_requests(size_t inputs, std::span<const LogitRequest> requests,
                            std::span<const LogitSummary> summaries,
                            std::span<const float> full_rows, int32_t vocab_size) {
  if (requests.size() != inputs || summaries.size() != inputs)
    return make_error(ErrorCode::kInvalidArgument,
                      "{} inputs but {} logit requests and {} summaries", inputs, requests.size(),
                      summaries.size());
  size_t full = 0;
  for (const LogitRequest& request : requests) {
    if (request.candidates < 0 || request.candidates > kMaxLogitCandidates)
      return make_error(ErrorCode::kInvalidArgument, "{} logit candidates asked, at most {}",
                        request.candidates, kMaxLogitCandidates);
    if (request.candidates == 0) ++full;
    for (const LogitEdit& edit : request.edits) {
      if (edit.token < 0 || edit.token >= vocab_size)
        return make_error(ErrorCode::kInvalidArgument,
                          "logit edit of token {} outside the vocabulary [0, {})", edit.token,
                          vocab_size);
    }
  }
  if (full_rows.size() < full * static_cast<size_t>(vocab_size))
    return make_error(ErrorCode::kInvalidArgument, "full-row buffer holds {} floats, need {}",
                      full_rows.size(), full * static_cast<size_t>(vocab_size));
  return Status::ok_status();
}

Status Engine::step_sampled(std::span<const StepInput> inputs,
                            std::span<const LogitRequest> requests,
                            std::span<LogitSummary> summaries, std::span<float> full_rows) {
  const int32_t vocab = vocab_size();
  GEMMA4_RETURN_IF_ERROR(
      check_logit_requests(inputs.size(), requests, summaries, full_rows, vocab));
  std::vector<float> logits(inputs.size() * static_cast<size_t>(vocab));
  GEMMA4_RETURN_IF_ERROR(step(inputs, logits));
  size_t full = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto row = std::span(logits).subspan(i * vocab, vocab);
    if (requests[i].candidates == 0) {
      std::copy(row.begin(), row.end(), full_rows.begin() + (full++) * vocab);
    } else {
      summarize_logits(row, requests[i].edits, requests[i].candidates, summaries[i]);
    }
  }
  return Status::ok_status();
}

}  // namespace gemma4::engine
