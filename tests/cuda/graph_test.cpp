// The decode kernels captured in a CUDA graph with PDL launches give bit-identical results to
// plain launches, replay after replay, with the query position changed in device memory between
// replays (nothing per-step is baked into the graph).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv.h"
#include "core/numeric.h"
#include "cuda_test_util.h"

namespace gemma4::cuda {
namespace {

using testing::DeviceArray;

TEST(Graph, PdlChainMatchesPlainLaunches) {
  constexpr int64_t kHidden = 1536, kQ = 8 * 256, kSlots = 64;
  // w4g32 q projection, random.
  const auto words = testing::random_words(kQ * kHidden / 8, 1);
  const auto scale_f = testing::random_floats(kQ * kHidden / 32, 0.002f, 0.03f, 2);
  std::vector<uint16_t> scales(scale_f.size());
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = float_to_bf16(scale_f[i]);
  DeviceArray<uint32_t> dwords(words);
  DeviceArray<uint16_t> dscales(scales);
  quant::QMatrix wq;
  wq.format = quant::WeightFormat::kW4G32;
  wq.rows = kQ;
  wq.cols = kHidden;
  wq.data = dwords.get();
  wq.scales = dscales.get();

  DeviceArray<float> x(testing::random_floats(kHidden, -1.0f, 1.0f, 3));
  DeviceArray<float> norm_w(testing::random_floats(kHidden, 0.5f, 1.5f, 4));
  DeviceArray<float> q_norm_w(testing::random_floats(256, 0.5f, 1.5f, 5));
  DeviceArray<float> normed(kHidden), q(kQ), out(kQ);
  std::vector<uint16_t> kv(kSlots * 256);
  const auto kv_f = testing::random_floats(kSlots * 256, -0.2f, 0.2f, 6);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = float_to_bf16(kv_f[i]);
  DeviceArray<uint16_t> keys(kv), values(kv);
  std::vector<int32_t> slot_pos(kSlots);
  for (int s = 0; s < kSlots; ++s) slot_pos[s] = s;
  DeviceArray<int32_t> slots(slot_pos), position(std::vector<int32_t>{10});
  DeviceArray<float> partials(attention_partials_floats(1, 8, 256, 4));

  cudaStream_t stream;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  KvCacheView cache;
  cache.keys = keys.get();
  cache.values = values.get();
  cache.slot_positions = slots.get();
  cache.slots = kSlots;
  cache.kv_heads = 1;
  cache.head_dim = 256;
  cache.sequence_stride = kSlots * 256;
  const RopeSpec rope = {position.get(), 8, 10000.0f, 128, 256};
  auto enqueue = [&](bool pdl) {
    const Launch launch = {stream, pdl};
    cudaError_t s = rms_norm({x.get(), 1, kHidden, kHidden}, norm_w.get(), 0.0f, 1e-6f,
                             {normed.get(), 1, kHidden, kHidden}, nullptr, launch);
    if (s == cudaSuccess) {
      s = gemv(wq, GemvInput{normed.get(), ActType::kF32, 1, kHidden}, GemvOutput{q.get(), kQ},
               launch);
    }
    if (s == cudaSuccess) {
      s = rms_norm({q.get(), 8, 256, 256}, q_norm_w.get(), 0.0f, 1e-6f, {q.get(), 8, 256, 256},
                   &rope, launch);
    }
    if (s == cudaSuccess) {
      s = decode_attention({q.get(), kQ, 8, position.get(), 1}, cache, 0, 1.0f, out.get(), kQ,
                           {partials.get(), 4}, 4, launch);
    }
    return s;
  };

  const testing::RecordedGraph graph(stream, enqueue);
  CUDA_ASSERT_OK(graph.status());
  for (int32_t pos : {10, 40, 63}) {
    CUDA_ASSERT_OK(cudaMemcpy(position.get(), &pos, 4, cudaMemcpyHostToDevice));
    out.poison();
    CUDA_ASSERT_OK(enqueue(false));
    CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
    const auto plain = out.download();
    for (int replay = 0; replay < 2; ++replay) {
      out.poison();
      CUDA_ASSERT_OK(graph.launch(stream));
      CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
      const auto replayed = out.download();
      ASSERT_EQ(replayed.size(), plain.size());
      for (size_t i = 0; i < plain.size(); ++i) {
        ASSERT_TRUE(std::isfinite(plain[i]));
        ASSERT_EQ(replayed[i], plain[i]) << "element " << i << " position " << pos;
      }
    }
  }
  CUDA_ASSERT_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace gemma4::cuda
