// Backend::begin/end_profiler_range on the CUDA backend (bench --profile-last): without a
// profiler attached the range is empty bookkeeping; work enqueued inside it runs as usual and
// the backend stays healthy.
#include <gtest/gtest.h>

#include <vector>

#include "cuda_test_util.h"

namespace gemma4::cuda::testing {
namespace {

TEST(CudaProfilerRange, WorkInsideTheRangeRunsAndStatusStaysOk) {
  auto gpu = make_gpu();
  ASSERT_TRUE(gpu);
  BackendRows acc(*gpu, 2, 3), x(*gpu, 2, 3);
  acc.set(*gpu, {1, 2, 3, 4, 5, 6});
  x.set(*gpu, {10, 20, 30, 40, 50, 60});
  const auto before = gpu->kernels_launched();
  gpu->begin_profiler_range();
  gpu->add(acc.rows, x.rows);
  gpu->end_profiler_range();
  ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
  EXPECT_GT(*gpu->kernels_launched(), *before);
  EXPECT_EQ(acc.get(*gpu), (std::vector<float>{11, 22, 33, 44, 55, 66}));
}

}  // namespace
}  // namespace gemma4::cuda::testing
