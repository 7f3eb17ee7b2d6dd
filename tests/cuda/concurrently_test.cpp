// CudaBackend::concurrently (the first branch on a second stream, forked from the main stream and
// joined back into it) against the CPU backend running the same operations in order: eagerly and
// recorded into a graph that is replayed with fresh inputs. The first branch is a chain of GEMVs
// much longer than the second, and the work after the join reads both branches' outputs, so a
// missing fork (the first branch reading its input before it is made) or join (the last step
// reading the first branch's output before it is done) shows as wrong values.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "packed_matrix.h"

namespace gemma4::cuda {
namespace {

using engine::Rows;
using quant::WeightFormat;
using testing::DeviceMatrix;
using testing::HostMatrix;
using testing::random_matrix;

constexpr int64_t kWidth = 1024;
constexpr int kChainSteps = 6;  // GEMVs of the first branch

// The buffers of the test's work on one backend (host memory for the CPU one).
struct Operands {
  Rows x, normed, first_a, first_b, second;
};

// normed = w2 · w1 · w2 · w1 · norm(x) (a chain, so that a branch starting early reads the old
// normed); then concurrently: first = a chain of GEMVs through w1 / w2 ending normed, second =
// w3 · normed halved; then first += second (the chain ends in first_b after an even number of
// steps, else in first_a).
void enqueue(engine::Backend& backend, const Operands& o, const quant::QMatrix& w1,
             const quant::QMatrix& w2, const quant::QMatrix& w3, const float* norm_weight) {
  backend.rms_norm(o.x, norm_weight, 0.0f, 1e-6f, o.normed);
  for (int step = 0; step < 2; ++step) {
    backend.matmul(w1, o.normed, o.first_a);
    backend.matmul(w2, o.first_a, o.normed);
  }
  backend.rms_norm(o.normed, norm_weight, 0.0f, 1e-6f, o.normed);
  backend.concurrently(
      o.x.count,
      [&] {
        backend.matmul(w1, o.normed, o.first_a);
        for (int step = 1; step < kChainSteps; ++step) {
          const bool odd = step % 2 == 1;
          backend.matmul(odd ? w2 : w1, odd ? o.first_a : o.first_b, odd ? o.first_b : o.first_a);
        }
        const Rows last = kChainSteps % 2 == 0 ? o.first_b : o.first_a;
        backend.rms_norm(last, norm_weight, 0.0f, 1e-6f, last);
      },
      [&] {
        backend.matmul(w3, o.normed, o.second);
        backend.scale(o.second, nullptr, 0.5f);
      });
  backend.add(kChainSteps % 2 == 0 ? o.first_b : o.first_a, o.second);
}

// got within `tolerance` of expected: element-wise (relative to 1 + |expected|) when exact, else
// in relative L2 norm over the rows (bf16 products differ from the CPU's fp32 ones by ~2^-8 per
// value; a branch missing its fork or join gives values of the wrong pass: errors of order 1).
void expect_close(const std::vector<float>& got, const std::vector<float>& expected,
                  double tolerance, bool elementwise, const char* what) {
  ASSERT_EQ(got.size(), expected.size());
  double error = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (elementwise) {
      ASSERT_NEAR(got[i], expected[i], tolerance * (1.0 + std::fabs(expected[i])))
          << what << " " << i;
    }
    error += (got[i] - expected[i]) * (got[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  EXPECT_LE(std::sqrt(error / norm), tolerance) << what;
}

struct BranchCase {
  ActivationMode mode;
  int64_t rows;
  // The first branch's w1: at batched rows in bf16 mode a bf16 matrix goes to cuBLAS, which moves
  // the rest of that branch onto the main stream (CudaBackend::join_side_branch).
  WeightFormat first_format;
  double tolerance;
};

void check_branches(const BranchCase& c) {
  SCOPED_TRACE("rows=" + std::to_string(c.rows) +
               " mode=" + std::to_string(static_cast<int>(c.mode)) +
               " w1=" + quant::weight_format_name(c.first_format));
  const auto gpu = testing::make_gpu_in_mode(c.mode);
  ASSERT_NE(gpu, nullptr);
  backend::cpu::CpuBackend cpu(2);
  const HostMatrix w1 = random_matrix(c.first_format, kWidth, kWidth, 11);
  const HostMatrix w2 = random_matrix(WeightFormat::kW4G32, kWidth, kWidth, 12);
  const HostMatrix w3 = random_matrix(WeightFormat::kNVFP4, kWidth, kWidth, 13);
  const DeviceMatrix d1(w1), d2(w2), d3(w3);
  const auto norm_weight = testing::random_floats(kWidth, 0.5f, 1.5f, 14);
  const testing::DeviceArray<float> d_norm_weight(norm_weight);

  const int64_t elements = c.rows * kWidth;
  std::vector<std::vector<float>> host(5, std::vector<float>(elements, 0.0f));
  auto host_rows = [&](int i) { return Rows::dense(host[i].data(), c.rows, kWidth); };
  const Operands on_cpu = {host_rows(0), host_rows(1), host_rows(2), host_rows(3), host_rows(4)};
  std::vector<testing::BackendRows> device;
  device.reserve(5);
  for (int i = 0; i < 5; ++i) device.emplace_back(*gpu, c.rows, kWidth);
  const Operands on_gpu = {device[0].rows, device[1].rows, device[2].rows, device[3].rows,
                           device[4].rows};
  const bool exact = c.mode == ActivationMode::kF32;

  // Fresh x on both sides, and the CPU's results for it.
  auto set_input = [&](uint32_t seed) {
    // Copied into host[0]'s storage: on_cpu.x points there.
    const std::vector<float> x = testing::random_floats(elements, -2.0f, 2.0f, seed);
    std::copy(x.begin(), x.end(), host[0].begin());
    device[0].set(*gpu, host[0]);
    enqueue(cpu, on_cpu, w1.view(), w2.view(), w3.view(), norm_weight.data());
  };
  // Eager.
  set_input(20);
  enqueue(*gpu, on_gpu, d1.view, d2.view, d3.view, d_norm_weight.get());
  ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
  const int result = kChainSteps % 2 == 0 ? 3 : 2;
  expect_close(device[result].get(*gpu), host[result], c.tolerance, exact, "eager");
  expect_close(device[4].get(*gpu), host[4], c.tolerance, exact, "eager second branch");

  // Recorded once, replayed with fresh inputs.
  const auto graph =
      gpu->record([&] { enqueue(*gpu, on_gpu, d1.view, d2.view, d3.view, d_norm_weight.get()); });
  ASSERT_NE(graph, nullptr) << gpu->status().error().to_string();
  for (uint32_t seed = 30; seed < 33; ++seed) {
    set_input(seed);
    gpu->replay(*graph);
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    expect_close(device[result].get(*gpu), host[result], c.tolerance, exact, "replay");
  }
}

TEST(Concurrently, BranchesMatchTheCpuOrderEagerAndRecorded) {
  // Exact fp32 activations: the GEMVs then differ from the CPU by fp32 rounding only.
  for (const int64_t rows : {int64_t{1}, int64_t{3}, int64_t{32}}) {
    check_branches({ActivationMode::kF32, rows, WeightFormat::kNVFP4, 1e-3});
  }
}

// Batched decode rows (tensor-core GEMVs, bf16 products): in order at 32 rows, both branches at
// once at 48 and 64, and a first branch that leaves its stream half-way for cuBLAS.
TEST(Concurrently, BatchedRowsMatchTheCpuOrder) {
  for (const int64_t rows : {int64_t{32}, int64_t{48}, int64_t{64}}) {
    for (const WeightFormat first : {WeightFormat::kNVFP4, WeightFormat::kBF16}) {
      check_branches({ActivationMode::kBF16, rows, first, 2e-2});
    }
  }
}

}  // namespace
}  // namespace gemma4::cuda
