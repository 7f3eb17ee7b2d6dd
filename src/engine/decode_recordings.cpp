#include "engine/decode_recordings.h"

#include <algorithm>

namespace gemma4::engine {

int64_t decode_position_bound(int64_t deepest_position, int64_t max_context) {
  int64_t bound = kFirstDecodeBucket;
  while (bound <= deepest_position && bound < max_context) bound *= kDecodeBucketGrowth;
  return std::min(bound, max_context);
}

RecordedWork* DecodeRecordings::find(const Key& key) {
  const auto found = entries_.find(key);
  if (found == entries_.end()) return nullptr;
  found->second.last_use = ++uses_;
  return found->second.work.get();
}

bool DecodeRecordings::warmed_up(const std::vector<SequenceId>& order) const {
  // Keys sort by order first: the list's entries, if any, start at its smallest bound.
  const auto first = entries_.lower_bound(Key{order, 0});
  return first != entries_.end() && first->first.order == order;
}

RecordedWork* DecodeRecordings::hold(const Key& key, std::unique_ptr<RecordedWork> work) {
  if (!entries_.contains(key) && entries_.size() >= capacity_ && !entries_.empty()) {
    entries_.erase(std::min_element(
        entries_.begin(), entries_.end(),
        [](const auto& a, const auto& b) { return a.second.last_use < b.second.last_use; }));
  }
  Entry& entry = entries_[key];
  entry.work = std::move(work);
  entry.last_use = ++uses_;
  return entry.work.get();
}

}  // namespace gemma4::engine
