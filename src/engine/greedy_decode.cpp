// Engine::decode_greedy's default: one step_sampled step per token, the host feeding back each
// step's greedy candidate (greedy_decode_by_steps, also the reference of the chained version).
#include <vector>

#include "engine/engine.h"

namespace gemma4::engine {

Status greedy_decode_by_steps(Engine& engine, std::span<const SequenceId> sequences,
                              std::span<const int32_t> first_tokens,
                              const GreedyTokenCallback& on_token) {
  if (first_tokens.size() != sequences.size())
    return make_error(ErrorCode::kInvalidArgument, "{} sequences but {} first tokens",
                      sequences.size(), first_tokens.size());
  std::vector<int32_t> next(first_tokens.begin(), first_tokens.end());
  std::vector<bool> last(sequences.size(), false);  // the next step is the sequence's last
  std::vector<size_t> live;                         // indices into sequences, in order
  for (size_t i = 0; i < sequences.size(); ++i) live.push_back(i);
  std::vector<StepInput> inputs;
  std::vector<LogitSummary> summaries;
  while (!live.empty()) {
    inputs.clear();
    for (size_t i : live) inputs.push_back({sequences[i], std::span(&next[i], 1)});
    const std::vector<LogitRequest> requests(live.size(), LogitRequest{1, {}});
    summaries.resize(live.size());
    GEMMA4_RETURN_IF_ERROR(engine.step_sampled(inputs, requests, summaries, {}));
    std::vector<size_t> continuing;
    for (size_t k = 0; k < live.size(); ++k) {
      const size_t i = live[k];
      const auto [id, logit] = summaries[k].top.front();
      const GreedyToken token{id, logit, summaries[k].log_normaliser};
      const GreedyNext answer = on_token(i, token);
      if (!last[i] && answer != GreedyNext::kStop &&
          engine.sequence_length(sequences[i]) < engine.max_context()) {
        next[i] = id;
        last[i] = answer == GreedyNext::kLast;
        continuing.push_back(i);
      }
    }
    live = std::move(continuing);
  }
  return Status::ok_status();
}

Status Engine::decode_greedy(std::span<const SequenceId> sequences,
                             std::span<const int32_t> first_tokens,
                             const GreedyTokenCallback& on_token) {
  return greedy_decode_by_steps(*this, sequences, first_tokens, on_token);
}

}  // namespace gemma4::engine
