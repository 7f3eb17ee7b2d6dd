#include "server/stop_matcher.h"

#include <algorithm>

namespace gemma4::server {

std::string StopMatcher::push(std::string_view text) {
  if (matched_) return {};
  held_.append(text);
  size_t first_match = std::string::npos;
  for (const auto& stop : stops_) first_match = std::min(first_match, held_.find(stop));
  if (first_match != std::string::npos) {
    matched_ = true;
    std::string out = held_.substr(0, first_match);
    held_.clear();
    return out;
  }
  // Keep the longest tail that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const auto& stop : stops_) {
    for (size_t length = std::min(stop.size() - 1, held_.size()); length > keep; --length) {
      if (std::string_view(held_).substr(held_.size() - length) ==
          std::string_view(stop).substr(0, length)) {
        keep = length;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace gemma4::server
