// The decode depth buckets (decode_position_bound) and the bounded store of recordings
// (DecodeRecordings): which bucket a depth falls in, what a list of sequences counts as warmed up
// by, and which recording a full store drops.
#include "engine/decode_recordings.h"

#include <gtest/gtest.h>

#include <memory>

namespace gemma4::engine {
namespace {

TEST(DecodePositionBound, BucketsGrowEightfoldFrom512AndStopAtTheContext) {
  // Positions 0..511 scan at most 512 keys; 512 is the first query of the next bucket.
  EXPECT_EQ(decode_position_bound(0, 131072), 512);
  EXPECT_EQ(decode_position_bound(511, 131072), 512);
  EXPECT_EQ(decode_position_bound(512, 131072), 4096);
  EXPECT_EQ(decode_position_bound(4095, 131072), 4096);
  EXPECT_EQ(decode_position_bound(4096, 131072), 32768);
  EXPECT_EQ(decode_position_bound(32768, 131072), 131072);
  EXPECT_EQ(decode_position_bound(131071, 131072), 131072);
  // The last bucket ends at the context, which no query reaches.
  EXPECT_EQ(decode_position_bound(600, 640), 640);
  EXPECT_EQ(decode_position_bound(639, 640), 640);
  EXPECT_EQ(decode_position_bound(5, 48), 48);
  // Every bound lies above its position.
  for (int64_t position = 0; position < 5000; ++position) {
    const int64_t bound = decode_position_bound(position, 5000);
    ASSERT_GT(bound, position);
    ASSERT_LE(bound, 5000);
  }
}

// A recording that says which one it is.
struct Tagged final : RecordedWork {
  explicit Tagged(int tag) : tag(tag) {}
  int tag;
};

int tag_of(RecordedWork* work) {
  return work == nullptr ? -1 : static_cast<Tagged*>(work)->tag;
}

TEST(DecodeRecordings, ListsWarmUpOnceAndBucketsRecordApart) {
  DecodeRecordings recordings(8);
  const std::vector<SequenceId> pair = {0, 2}, single = {0};
  EXPECT_FALSE(recordings.warmed_up(pair));
  EXPECT_EQ(recordings.find({pair, 512}), nullptr);
  // The first pass of a list: held without a recording, which warms up every bucket of it.
  EXPECT_EQ(recordings.hold({pair, 512}, nullptr), nullptr);
  EXPECT_TRUE(recordings.warmed_up(pair));
  EXPECT_FALSE(recordings.warmed_up(single));
  EXPECT_FALSE(recordings.warmed_up({2, 0}));  // the order of the rows matters
  EXPECT_EQ(recordings.find({pair, 512}), nullptr);
  EXPECT_EQ(tag_of(recordings.hold({pair, 512}, std::make_unique<Tagged>(1))), 1);
  EXPECT_EQ(tag_of(recordings.hold({pair, 4096}, std::make_unique<Tagged>(2))), 2);
  EXPECT_EQ(tag_of(recordings.find({pair, 512})), 1);
  EXPECT_EQ(tag_of(recordings.find({pair, 4096})), 2);
  EXPECT_EQ(recordings.find({pair, 32768}), nullptr);
  EXPECT_EQ(recordings.size(), 2u);
}

TEST(DecodeRecordings, AFullStoreDropsTheLeastRecentlyUsed) {
  DecodeRecordings recordings(3);
  recordings.hold({{0}, 512}, std::make_unique<Tagged>(1));
  recordings.hold({{0}, 4096}, std::make_unique<Tagged>(2));
  recordings.hold({{1}, 512}, std::make_unique<Tagged>(3));
  EXPECT_EQ(tag_of(recordings.find({{0}, 512})), 1);  // now {0}/4096 is the least recently used
  recordings.hold({{1}, 4096}, std::make_unique<Tagged>(4));
  EXPECT_EQ(recordings.size(), 3u);
  EXPECT_EQ(recordings.find({{0}, 4096}), nullptr);
  EXPECT_EQ(tag_of(recordings.find({{0}, 512})), 1);
  EXPECT_EQ(tag_of(recordings.find({{1}, 512})), 3);
  EXPECT_EQ(tag_of(recordings.find({{1}, 4096})), 4);
  // Replacing a held key drops nothing else.
  recordings.hold({{1}, 512}, std::make_unique<Tagged>(5));
  EXPECT_EQ(recordings.size(), 3u);
  EXPECT_EQ(tag_of(recordings.find({{1}, 512})), 5);
  EXPECT_EQ(tag_of(recordings.find({{0}, 512})), 1);
  // A list whose last entry was dropped is no longer warmed up.
  recordings.hold({{2}, 512}, nullptr);  // drops {1}/4096, the least recently used
  recordings.hold({{3}, 512}, nullptr);  // drops {1}/512
  EXPECT_FALSE(recordings.warmed_up({1}));
  EXPECT_TRUE(recordings.warmed_up({0}));
  EXPECT_TRUE(recordings.warmed_up({2}));
}

}  // namespace
}  // namespace gemma4::engine
