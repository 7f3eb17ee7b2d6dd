// Stop sequences over streamed text: passes text through until one of the stop strings appears,
// holding back any tail that could still become a stop string, and cuts the output right
// before the match (OpenAI semantics: the stop sequence itself is not returned).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace gemma4::server {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Returns the text that is now safe to emit. After a match, returns the text before it and
  // ignores everything pushed later.
  std::string push(std::string_view text);
  // End of output: returns whatever was held back.
  std::string flush();
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
};

}  // namespace gemma4::server
