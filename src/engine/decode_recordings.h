// The engine's recorded decode passes (EngineOptions::record_decode): one recording per ordered
// list of sequences and depth bucket. A backend sizes a decode pass's attention for the deepest
// query its recording may replay at (SequenceRows::position_bound), so a recording made for
// the whole cache replays at every depth but pays at shallow depths for keys nobody scans (on
// CUDA: split blocks that start and exit, a split merge kernel with nothing to merge); one made
// for a bucket pays only for that bucket's depth, and a sequence crossing into the next bucket
// costs one more recording.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "engine/backend.h"
#include "engine/engine.h"

namespace gemma4::engine {

// The first bucket's bound. On CUDA, 512 keys are 16 splits of kMinKeysPerSplit, few enough that
// every E2B and 26B-A4B layer merges their records inside the attention kernel at batch 1 with a
// bf16 cache (attention.h: kMaxMergedInKernelBytes), so no split merge kernel runs below it; a
// query of up to 64 keys still takes one split, the kernel's choice at run time. A bucket of its
// own for those would save only split blocks that start and exit idle, less than its re-record
// costs: measured on the H200 with buckets of 64, 256, ..., E2B b1 decoding 128 tokens from depth
// 0 lost 1.5-2 % to the re-record at 64.
inline constexpr int64_t kFirstDecodeBucket = 512;
// Each later bucket holds this many times the keys of the one before: a deeper bucket's launches
// differ from the whole cache's in little more than how many split blocks start and exit idle
// (the splits of a batch-1 E2B or 26B-A4B layer reach their one-wave cap by 8,448 keys), so they
// stay few: a batch-1 decode from an empty cache to 32K records three (512, 4096, 32768).
inline constexpr int64_t kDecodeBucketGrowth = 8;

// The position bound of the bucket of a decode pass whose deepest query is at `deepest_position`
// (< max_context): the smallest kFirstDecodeBucket · kDecodeBucketGrowth^k above it, capped at
// max_context (no query goes deeper).
int64_t decode_position_bound(int64_t deepest_position, int64_t max_context);

// At most `capacity` recordings, the least recently used one dropped for a new one (its replay
// may still run: Backend::record). A sequence list's first decode pass runs unrecorded (lazily
// made backend resources are made then, outside any recording), and that list counts as warmed
// up while any entry of it is held.
class DecodeRecordings {
 public:
  struct Key {
    std::vector<SequenceId> order;
    int64_t position_bound = 0;
    auto operator<=>(const Key&) const = default;
  };

  explicit DecodeRecordings(size_t capacity) : capacity_(capacity) {}

  // The recording of `key`, marked used; nullptr when none was made.
  RecordedWork* find(const Key& key);
  // Whether a pass of `order` ran before (an entry of it is held, recorded or not).
  bool warmed_up(const std::vector<SequenceId>& order) const;
  // Holds `work` (nullptr: only that the key's list ran unrecorded) for `key`, replacing what the
  // key held; returns it.
  RecordedWork* hold(const Key& key, std::unique_ptr<RecordedWork> work);
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::unique_ptr<RecordedWork> work;
    uint64_t last_use = 0;
  };
  size_t capacity_;
  uint64_t uses_ = 0;
  std::map<Key, Entry> entries_;
};

}  // namespace gemma4::engine
