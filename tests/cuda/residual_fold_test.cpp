// CudaBackend::matmul_add_rms_norm, the residual step folded into the last block of the one-row
// GEMV (gemv.h: GemvResidualNorm), against the same backend's two operations (matmul, then
// add_rms_norm): y bit for bit (the same GEMV reads the same input), the residual and the next
// norm within fp32 rounding (the folded step sums the squares in another order than the
// add_rms_norm kernel), and the companions it leaves live equal to the rounding of what it stored.
// Then a recording of two folds into one output buffer (o_proj's and the PLE projection's share
// theirs) replayed several times in a row with new inputs: the block counter is back at 0 after
// every launch. E2B's shapes: o_proj 1536 x 2048, down 1536 x 6144, PLE projection 1536 x 256.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "engine/backend.h"
#include "packed_matrix.h"

namespace gemma4::cuda {
namespace {

using engine::Rows;
using testing::random_floats;

constexpr int64_t kHidden = 1536;
constexpr double kTolerance = 1e-5;  // relative to 1 + |reference|: fp32 sums in another order

std::unique_ptr<CudaBackend> make_backend(ActivationMode mode) {
  auto made = make_cuda_backend(0, {true, mode});
  EXPECT_TRUE(made.ok()) << made.error().to_string();
  if (!made.ok()) return nullptr;
  return std::unique_ptr<CudaBackend>(static_cast<CudaBackend*>(made->release()));
}

// One row of `width` floats in a backend buffer.
struct BackendRow {
  BackendRow(engine::Backend& gpu, int64_t width)
      : buffer(gpu.allocate(sizeof(float) * width)), row(Rows::dense(buffer.floats(), 1, width)) {}
  void set(engine::Backend& gpu, const std::vector<float>& values) {
    gpu.upload(buffer.data(), values.data(), sizeof(float) * values.size());
  }
  std::vector<float> get(engine::Backend& gpu) const {
    std::vector<float> out(row.width);
    gpu.download(out.data(), buffer.data(), sizeof(float) * out.size());
    return out;
  }
  engine::Buffer buffer;
  Rows row;
};

void expect_near_rows(const std::vector<float>& got, const std::vector<float>& expected,
                      const std::string& what) {
  std::vector<double> reference(expected.begin(), expected.end()), magnitude(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) magnitude[i] = 1.0 + std::fabs(reference[i]);
  testing::expect_close(got, reference, magnitude, kTolerance, what.c_str());
}

// The bf16 companion the backend holds for `rows` rounds what they hold now (ties to even); kF32
// mode keeps none.
void expect_live_bf16_of(CudaBackend& gpu, const BackendRow& rows, const std::string& what) {
  const ActivationCompanions* live = gpu.live_companions(rows.row);
  if (gpu.activation_mode() == ActivationMode::kF32) {
    EXPECT_EQ(live, nullptr) << what;
    return;
  }
  ASSERT_NE(live, nullptr) << what;
  ASSERT_NE(live->bf16, nullptr) << what;
  EXPECT_EQ(live->q8 != nullptr, gpu.activation_mode() == ActivationMode::kQ8) << what;
  std::vector<uint16_t> bf16(rows.row.width);
  ASSERT_EQ(cudaMemcpy(bf16.data(), live->bf16, 2 * bf16.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  const std::vector<float> stored = rows.get(gpu);
  int64_t wrong = 0;
  for (size_t j = 0; j < stored.size(); ++j) wrong += bf16[j] != float_to_bf16(stored[j]);
  EXPECT_EQ(wrong, 0) << what << ": bf16 companion";
}

// The operands of one residual step: x (the projection's input), y, the residual and next, with
// the norm weights; `folded` and `composed` get the same values.
struct StepRows {
  StepRows(engine::Backend& gpu, int64_t k)
      : x(gpu, k), y(gpu, kHidden), residual(gpu, kHidden), next(gpu, kHidden) {}
  BackendRow x, y, residual, next;
};

class ResidualFold : public ::testing::TestWithParam<ActivationMode> {};

TEST_P(ResidualFold, MatchesTheGemvThenAddRmsNorm) {
  auto gpu = make_backend(GetParam());
  ASSERT_TRUE(gpu);
  const engine::NormParams norm{1.0f, 1e-6f};
  BackendRow weight(*gpu, kHidden), next_weight(*gpu, kHidden);
  weight.set(*gpu, random_floats(kHidden, -0.5f, 0.5f, 1));
  next_weight.set(*gpu, random_floats(kHidden, -0.5f, 0.5f, 2));
  uint32_t seed = 10;
  for (const int64_t k : {int64_t{2048}, int64_t{6144}, int64_t{256}}) {
    const testing::HostMatrix host =
        testing::random_matrix(quant::WeightFormat::kW4G32, kHidden, k, seed++);
    const testing::DeviceMatrix w(host);
    for (const bool with_next : {true, false}) {
      const std::string what = "K " + std::to_string(k) + (with_next ? " next" : " no next");
      SCOPED_TRACE(what);
      const float scalar = with_next ? 1.0f : 0.625f;
      const std::vector<float> x = random_floats(k, -2.0f, 2.0f, seed++);
      const std::vector<float> residual = random_floats(kHidden, -4.0f, 4.0f, seed++);
      StepRows folded(*gpu, k), composed(*gpu, k);
      for (StepRows* rows : {&folded, &composed}) {
        rows->x.set(*gpu, x);
        rows->residual.set(*gpu, residual);
      }
      const int64_t kernels_before = *gpu->kernels_launched();
      gpu->matmul_add_rms_norm(w.view, folded.x.row, folded.y.row, folded.residual.row,
                               weight.buffer.floats(), scalar,
                               with_next ? next_weight.buffer.floats() : nullptr,
                               with_next ? folded.next.row : Rows{}, norm);
      const int64_t folded_kernels = *gpu->kernels_launched() - kernels_before;
      // Checked before anything else writes: the companions the next GEMV would read.
      expect_live_bf16_of(*gpu, with_next ? folded.next : folded.residual, what);
      gpu->matmul(w.view, composed.x.row, composed.y.row);
      gpu->add_rms_norm(composed.residual.row, composed.y.row, weight.buffer.floats(), scalar,
                        with_next ? next_weight.buffer.floats() : nullptr,
                        with_next ? composed.next.row : Rows{}, norm);
      ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
      // x's companions (bf16/q8 modes) are made by one kernel on the first read only.
      EXPECT_EQ(folded_kernels, GetParam() == ActivationMode::kF32 ? 1 : 2) << "one GEMV launch";
      const std::vector<float> folded_y = folded.y.get(*gpu), composed_y = composed.y.get(*gpu);
      EXPECT_EQ(0, std::memcmp(folded_y.data(), composed_y.data(), sizeof(float) * kHidden))
          << "y differs";
      expect_near_rows(folded.residual.get(*gpu), composed.residual.get(*gpu), "residual");
      if (with_next) expect_near_rows(folded.next.get(*gpu), composed.next.get(*gpu), "next");
    }
  }
}

TEST_P(ResidualFold, RecordedFoldsReplayWithFreshCounters) {
  auto gpu = make_backend(GetParam());
  ASSERT_TRUE(gpu);
  const engine::NormParams norm{0.0f, 1e-6f};
  const testing::HostMatrix o_host =
      testing::random_matrix(quant::WeightFormat::kW4G32, kHidden, 2048, 30);
  const testing::HostMatrix ple_host =
      testing::random_matrix(quant::WeightFormat::kW4G32, kHidden, 256, 31);
  const testing::DeviceMatrix o_proj(o_host), ple_projection(ple_host);
  BackendRow weight(*gpu, kHidden), next_weight(*gpu, kHidden);
  weight.set(*gpu, random_floats(kHidden, 0.5f, 1.5f, 32));
  next_weight.set(*gpu, random_floats(kHidden, 0.5f, 1.5f, 33));
  // Two folds writing the same y (one counter), as the engine's o_proj and PLE projection do.
  StepRows folded(*gpu, 2048), composed(*gpu, 2048);
  BackendRow ple_x(*gpu, 256), composed_ple_x(*gpu, 256);
  auto fold_both = [&] {
    gpu->matmul_add_rms_norm(o_proj.view, folded.x.row, folded.y.row, folded.residual.row,
                             weight.buffer.floats(), 1.0f, next_weight.buffer.floats(),
                             folded.next.row, norm);
    gpu->matmul_add_rms_norm(ple_projection.view, ple_x.row, folded.y.row, folded.residual.row,
                             weight.buffer.floats(), 0.75f, next_weight.buffer.floats(),
                             folded.next.row, norm);
  };
  auto compose_both = [&] {
    gpu->matmul(o_proj.view, composed.x.row, composed.y.row);
    gpu->add_rms_norm(composed.residual.row, composed.y.row, weight.buffer.floats(), 1.0f,
                      next_weight.buffer.floats(), composed.next.row, norm);
    gpu->matmul(ple_projection.view, composed_ple_x.row, composed.y.row);
    gpu->add_rms_norm(composed.residual.row, composed.y.row, weight.buffer.floats(), 0.75f,
                      next_weight.buffer.floats(), composed.next.row, norm);
  };
  uint32_t seed = 40;
  auto fresh_inputs = [&] {
    const std::vector<float> x = random_floats(2048, -2.0f, 2.0f, seed++);
    const std::vector<float> p = random_floats(256, -2.0f, 2.0f, seed++);
    const std::vector<float> residual = random_floats(kHidden, -4.0f, 4.0f, seed++);
    folded.x.set(*gpu, x);
    composed.x.set(*gpu, x);
    ple_x.set(*gpu, p);
    composed_ple_x.set(*gpu, p);
    folded.residual.set(*gpu, residual);
    composed.residual.set(*gpu, residual);
  };
  // Once plainly (the counter and companion storage exist before the recording).
  fresh_inputs();
  fold_both();
  // Inputs converted inside the recording read companions the graph itself writes.
  const auto work = gpu->record([&] { fold_both(); });
  ASSERT_NE(work, nullptr) << gpu->status().error().to_string();
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    fresh_inputs();
    gpu->replay(*work);
    compose_both();
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    expect_near_rows(folded.residual.get(*gpu), composed.residual.get(*gpu), "residual");
    expect_near_rows(folded.next.get(*gpu), composed.next.get(*gpu), "next");
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ResidualFold,
                         ::testing::Values(ActivationMode::kF32, ActivationMode::kBF16,
                                           ActivationMode::kQ8),
                         [](const auto& info) { return activation_mode_name(info.param); });

}  // namespace
}  // namespace gemma4::cuda
