// Decode GEMV activations in the GEMV's own input type (cuda_backend.h: ActivationMode):
//  * every producer's companions (rms_norm, add_rms_norm's residual and next, the GEMV epilogues,
//    the stand-alone converter) equal, bit for bit, the reference rounding (bf16, ties to even) and
//    quantization (kQ8: scale = max|chunk| / 127, q = round(v / scale) ties to even, permuted
//    bytes, Σq) of the fp32 values the same kernel stored;
//  * the backend drops a row's companions whenever anything writes those rows, and a GEMV that
//    reads rows whose companions went stale multiplies the new values;
//  * whole decode steps in each mode against the CPU reference engine, and replayed CUDA graphs
//    identical to plain launches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/gemv.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "engine/gemma4_engine.h"
#include "model/synth.h"
#include "model/weights.h"
#include "packed_matrix.h"
#include "synth_support.h"
#include "test_support.h"

namespace gemma4::cuda {
namespace {

using testing::DeviceArray;
using testing::random_floats;

// The companion arrays of `rows` rows of `width` values at stride `stride` (poisoned).
struct DeviceCompanions {
  DeviceCompanions(int64_t rows, int64_t stride)
      : rows(rows), stride(stride), bf16(rows * stride), q8(rows * q8_row_bytes(stride)) {}
  ActivationCompanions view(bool with_bf16 = true, bool with_q8 = true) const {
    return {with_bf16 ? bf16.get() : nullptr, with_q8 ? q8.get() : nullptr, stride};
  }
  int64_t rows, stride;
  DeviceArray<uint16_t> bf16;
  DeviceArray<uint8_t> q8;
};

// The reference kQ8 row of `width` values (gemv_kernels.h), in a row of `stride`: the bytes a
// producer writes (value bytes [0, width), scales and sums of width / 32 chunks), others 0.
std::vector<uint8_t> reference_q8_row(const float* values, int64_t width, int64_t stride) {
  std::vector<uint8_t> row(q8_row_bytes(stride), 0);
  for (int64_t c = 0; c < width / 32; ++c) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(values[c * 32 + i]));
    const float scale = amax / 127.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      // nearbyint in the default rounding mode: to nearest, ties to even (as __float2int_rn).
      const int q = scale > 0.0f ? static_cast<int>(std::nearbyint(values[c * 32 + i] / scale)) : 0;
      sum += q;
      const int e = i % 8;
      row[c * 32 + (i / 8) * 8 + (e % 2 ? 4 : 0) + e / 2] =
          static_cast<uint8_t>(static_cast<int8_t>(q));
    }
    std::memcpy(row.data() + stride + 4 * c, &scale, 4);
    std::memcpy(row.data() + stride + stride / 8 + 4 * c, &sum, 4);
  }
  return row;
}

// The written part of a q8 row: value bytes [0, width), then the scales and sums of its chunks.
void expect_q8_row_equal(const uint8_t* got, const std::vector<uint8_t>& expected, int64_t width,
                         int64_t stride, const std::string& what) {
  const int64_t chunks = width / 32;
  EXPECT_EQ(0, std::memcmp(got, expected.data(), width)) << what << ": q8 values";
  EXPECT_EQ(0, std::memcmp(got + stride, expected.data() + stride, 4 * chunks))
      << what << ": q8 scales";
  EXPECT_EQ(
      0, std::memcmp(got + stride + stride / 8, expected.data() + stride + stride / 8, 4 * chunks))
      << what << ": q8 sums";
}

// Companions (either may be absent) against the reference of `values` (rows of `width` at
// values_stride).
void expect_companions_of(const std::vector<float>& values, int64_t rows, int64_t width,
                          int64_t values_stride, const std::vector<uint16_t>* bf16,
                          const std::vector<uint8_t>* q8, int64_t stride, const std::string& what) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = values.data() + r * values_stride;
    if (bf16 != nullptr) {
      int64_t wrong = 0;
      for (int64_t j = 0; j < width; ++j) {
        if ((*bf16)[r * stride + j] != float_to_bf16(row[j])) ++wrong;
      }
      EXPECT_EQ(wrong, 0) << what << ": bf16 row " << r;
    }
    if (q8 != nullptr) {
      expect_q8_row_equal(q8->data() + r * q8_row_bytes(stride),
                          reference_q8_row(row, width, stride), width, stride,
                          what + " row " + std::to_string(r));
    }
  }
}

void expect_companions_of(const std::vector<float>& values, int64_t rows, int64_t width,
                          int64_t values_stride, const DeviceCompanions& c, bool with_bf16,
                          bool with_q8, const std::string& what) {
  const std::vector<uint16_t> bf16 = c.bf16.download();
  const std::vector<uint8_t> q8 = c.q8.download();
  expect_companions_of(values, rows, width, values_stride, with_bf16 ? &bf16 : nullptr,
                       with_q8 ? &q8 : nullptr, c.stride, what);
}

// Values of mixed magnitude per chunk (some chunks all zero: scale 0).
std::vector<float> activations(int64_t n, uint32_t seed) {
  std::vector<float> v = random_floats(n, -3.0f, 3.0f, seed);
  for (int64_t i = 0; i < n; ++i) {
    if ((i / 32) % 7 == 3) v[i] *= 1e-3f;
    if ((i / 32) % 11 == 5) v[i] = 0.0f;
  }
  return v;
}

RowsView rows_view(float* data, int64_t rows, int64_t width, int64_t stride) {
  return {data, rows, width, stride};
}

TEST(ActivationCompanions, RmsNormWritesTheCompanionsOfItsOutput) {
  for (const int64_t width : {int64_t{64}, int64_t{1536}, int64_t{8192}}) {
    SCOPED_TRACE(width);
    const int64_t rows = 3, stride = width + 32;
    DeviceArray<float> x(activations(rows * width, 1));
    DeviceArray<float> weight(random_floats(width, -1.0f, 1.0f, 2));
    DeviceArray<float> y(rows * width);
    DeviceCompanions c(rows, stride);
    ASSERT_EQ(rms_norm(rows_view(x.get(), rows, width, width), weight.get(), 1.0f, 1e-6f,
                       rows_view(y.get(), rows, width, width), nullptr, Launch{}, c.view()),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_companions_of(y.download(), rows, width, width, c, true, true, "rms_norm");
    // bf16 alone: the q8 array stays untouched.
    DeviceCompanions bf16_only(rows, stride);
    ASSERT_EQ(rms_norm(rows_view(x.get(), rows, width, width), weight.get(), 1.0f, 1e-6f,
                       rows_view(y.get(), rows, width, width), nullptr, Launch{},
                       bf16_only.view(true, false)),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_companions_of(y.download(), rows, width, width, bf16_only, true, false, "bf16 only");
    const std::vector<uint8_t> untouched = bf16_only.q8.download();
    EXPECT_TRUE(
        std::all_of(untouched.begin(), untouched.end(), [](uint8_t b) { return b == 0xFF; }));
  }
}

TEST(ActivationCompanions, RmsNormRefusesCompanionsItCannotWrite) {
  DeviceArray<float> x(2 * 96), y(2 * 96);
  DeviceCompanions c(2, 96);
  const int32_t position = 0;
  DeviceArray<int32_t> positions(std::vector<int32_t>{position});
  RopeSpec rope;
  rope.positions = positions.get();
  rope.rows_per_position = 2;
  rope.rotated_pairs = 8;
  rope.exponent_denominator = 48;
  EXPECT_EQ(rms_norm(rows_view(x.get(), 2, 96, 96), nullptr, 0.0f, 1e-6f,
                     rows_view(y.get(), 2, 96, 96), &rope, Launch{}, c.view()),
            cudaErrorInvalidValue);  // no companions with RoPE
  EXPECT_EQ(rms_norm(rows_view(x.get(), 2, 80, 96), nullptr, 0.0f, 1e-6f,
                     rows_view(y.get(), 2, 80, 96), nullptr, Launch{}, c.view()),
            cudaErrorInvalidValue);  // width not a multiple of 32
  ActivationCompanions narrow = c.view();
  narrow.stride = 64;
  EXPECT_EQ(rms_norm(rows_view(x.get(), 2, 96, 96), nullptr, 0.0f, 1e-6f,
                     rows_view(y.get(), 2, 96, 96), nullptr, Launch{}, narrow),
            cudaErrorInvalidValue);  // stride below the width
}

TEST(ActivationCompanions, AddRmsNormWritesResidualAndNextCompanions) {
  for (const int64_t width : {int64_t{64}, int64_t{1536}, int64_t{5376}}) {
    SCOPED_TRACE(width);
    const int64_t rows = 2;
    DeviceArray<float> x(activations(rows * width, 3));
    DeviceArray<float> residual(activations(rows * width, 4));
    DeviceArray<float> next(rows * width);
    DeviceArray<float> weight(random_floats(width, -1.0f, 1.0f, 5));
    DeviceArray<float> next_weight(random_floats(width, -1.0f, 1.0f, 6));
    DeviceCompanions residual_c(rows, width), next_c(rows, width);
    AddNormSpec spec;
    spec.weight = weight.get();
    spec.next_weight = next_weight.get();
    spec.weight_offset = 1.0f;
    spec.scalar = 0.75f;
    spec.residual_companions = residual_c.view();
    spec.next_companions = next_c.view();
    ASSERT_EQ(add_rms_norm(rows_view(x.get(), rows, width, width),
                           rows_view(residual.get(), rows, width, width),
                           rows_view(next.get(), rows, width, width), spec, Launch{}),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_companions_of(residual.download(), rows, width, width, residual_c, true, true,
                         "residual");
    expect_companions_of(next.download(), rows, width, width, next_c, true, true, "next");
  }
}

TEST(ActivationCompanions, ConverterWritesTheCompanionsOfStridedRows) {
  const int64_t rows = 5, cols = 1536, x_stride = 1600, stride = 1568;
  const std::vector<float> x = activations(rows * x_stride, 7);
  DeviceArray<float> device_x(x);
  DeviceCompanions c(rows, stride);
  ASSERT_EQ(write_activation_companions(device_x.get(), rows, cols, x_stride, c.view(), Launch{}),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_companions_of(x, rows, cols, x_stride, c, true, true, "converter");
  EXPECT_EQ(write_activation_companions(device_x.get(), rows, cols, x_stride, {}, Launch{}),
            cudaErrorInvalidValue);  // nothing to write
}

// The GEMV epilogues' companions: bf16 from every tiling, q8 from kGeluPairs through the 64-row
// tiling (one row) and the tensor-core batched GEMV (3 and 40 rows; gemv_mma.h), the real
// gate+up shape and a small one.
TEST(ActivationCompanions, GemvEpiloguesWriteTheCompanionsOfWhatTheyStore) {
  struct Shape {
    int64_t rows, cols;
  };
  uint32_t seed = 20;
  for (const Shape shape : {Shape{12288, 1536}, Shape{256, 64}}) {
    SCOPED_TRACE(shape.rows);
    const testing::HostMatrix host =
        testing::random_matrix(quant::WeightFormat::kW4G32, shape.rows, shape.cols, seed++);
    const testing::DeviceMatrix w(host);
    for (const int m : {1, 3, 40}) {
      DeviceArray<float> x(activations(m * shape.cols, seed++));
      DeviceArray<float> multiplier(random_floats(m * shape.rows, -2.0f, 2.0f, seed++));
      for (const GemvEpilogue epilogue :
           {GemvEpilogue::kNone, GemvEpilogue::kGeluMul, GemvEpilogue::kGeluPairs}) {
        const int64_t outputs = epilogue == GemvEpilogue::kGeluPairs ? shape.rows / 2 : shape.rows;
        const bool q8 = epilogue == GemvEpilogue::kGeluPairs;
        DeviceArray<float> y(m * outputs);
        DeviceCompanions c(m, outputs);
        GemvOutput out;
        out.data = y.get();
        out.stride = outputs;
        out.epilogue = epilogue;
        out.multiplier = multiplier.get();
        out.multiplier_stride = shape.rows;
        out.companions = c.view(true, q8);
        const GemvInput input = {x.get(), ActType::kF32, m, shape.cols, true};
        ASSERT_EQ(gemv(w.view, input, out, Launch{}), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        expect_companions_of(
            y.download(), m, outputs, outputs, c, true, q8,
            "epilogue " + std::to_string(static_cast<int>(epilogue)) + " m " + std::to_string(m));
        if (epilogue != GemvEpilogue::kGeluPairs) {
          // q8 companions need kGeluPairs.
          out.companions = c.view(false, true);
          EXPECT_EQ(gemv(w.view, input, out, Launch{}), cudaErrorInvalidValue);
        }
      }
    }
  }
  const testing::HostMatrix host = testing::random_matrix(quant::WeightFormat::kW4G32, 256, 64, 1);
  const testing::DeviceMatrix w(host);
  DeviceArray<float> x(64), y(128);
  DeviceCompanions c(1, 128);
  GemvOutput out = {y.get(), 128, GemvEpilogue::kGeluPairs};
  out.companions = c.view();
  EXPECT_EQ(gemv(w.view, {x.get(), ActType::kF32, 1, 64}, out, Launch{}, 1),
            cudaErrorInvalidValue);  // tiling 1 keeps 16 rows per block: no q8 chunks
  EXPECT_EQ(gemv_epilogue(x.get(), 1, 64, 64, out, Launch{}), cudaErrorInvalidValue);
}

// ---------------------------------------------------------------------------------------------
// The backend's bookkeeping.

using testing::BackendRows;

}  // namespace

// gtest names the mode in parameterized test output.
void PrintTo(ActivationMode mode, std::ostream* os) {
  *os << activation_mode_name(mode);
}

namespace {

class CompanionBookkeeping : public ::testing::TestWithParam<ActivationMode> {};

// A producer's companions are live until anything writes an overlapping part of their rows:
// another operation, an upload, a copy into one row; writes elsewhere leave them live. Work whose
// writes are not reported drops them all.
TEST_P(CompanionBookkeeping, AnyWriteDropsTheCompanions) {
  auto gpu = testing::make_gpu_in_mode(GetParam());
  ASSERT_TRUE(gpu);
  const int64_t n = 2, width = 256;
  BackendRows x(*gpu, n, width), y(*gpu, n, width), other(*gpu, n, width);
  x.set(*gpu, activations(n * width, 30));
  other.set(*gpu, activations(n * width, 31));
  auto produce = [&] {
    gpu->rms_norm(x.rows, nullptr, 0.0f, 1e-6f, y.rows);
    const ActivationCompanions* live = gpu->live_companions(y.rows);
    ASSERT_NE(live, nullptr);
    EXPECT_NE(live->bf16, nullptr);
    EXPECT_EQ(live->q8 != nullptr, GetParam() == ActivationMode::kQ8);
    // Served for the first row alone too, not for other shapes of the same memory.
    EXPECT_NE(gpu->live_companions(y.rows.slice(0, 1)), nullptr);
    EXPECT_EQ(gpu->live_companions(y.rows.slice(1, 1)), nullptr);
    EXPECT_EQ(gpu->live_companions(y.rows.columns(0, 128)), nullptr);
  };
  produce();
  gpu->add(other.rows, x.rows);  // elsewhere
  EXPECT_NE(gpu->live_companions(y.rows), nullptr);
  gpu->add(y.rows, other.rows);
  EXPECT_EQ(gpu->live_companions(y.rows), nullptr) << "add";
  produce();
  y.set(*gpu, activations(n * width, 32));
  EXPECT_EQ(gpu->live_companions(y.rows), nullptr) << "upload";
  produce();
  gpu->copy(other.rows.slice(0, 1).columns(100, 8), y.rows.slice(1, 1).columns(40, 8));
  EXPECT_EQ(gpu->live_companions(y.rows), nullptr) << "copy into a part of the second row";
  produce();
  gpu->scale(y.rows, nullptr, 2.0f);
  EXPECT_EQ(gpu->live_companions(y.rows), nullptr) << "scale";
  // Work whose writes the backend does not track drops every companion: a recording, a replay.
  produce();
  const auto work = gpu->record([&] { gpu->add(other.rows, x.rows); });
  ASSERT_NE(work, nullptr);
  EXPECT_EQ(gpu->live_companions(y.rows), nullptr) << "record";
  produce();
  gpu->replay(*work);
  EXPECT_EQ(gpu->live_companions(y.rows), nullptr) << "replay";
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// add_rms_norm's companions: next's when there is a next norm, else the residual's (the PLE
// gate reads the residual).
TEST_P(CompanionBookkeeping, AddRmsNormCompanionsFollowTheNextReader) {
  auto gpu = testing::make_gpu_in_mode(GetParam());
  ASSERT_TRUE(gpu);
  const int64_t width = 128;
  BackendRows acc(*gpu, 1, width), x(*gpu, 1, width), next(*gpu, 1, width);
  acc.set(*gpu, activations(width, 50));
  x.set(*gpu, activations(width, 51));
  const engine::NormParams norm{1.0f, 1e-6f};
  gpu->add_rms_norm(acc.rows, x.rows, nullptr, 1.0f, nullptr, next.rows, norm);
  EXPECT_NE(gpu->live_companions(next.rows), nullptr);
  EXPECT_EQ(gpu->live_companions(acc.rows), nullptr);
  gpu->add_rms_norm(acc.rows, x.rows, nullptr, 1.0f, nullptr, engine::Rows{}, norm);
  EXPECT_NE(gpu->live_companions(next.rows), nullptr);  // not written
  EXPECT_NE(gpu->live_companions(acc.rows), nullptr);
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// The MoE layer's residual steps report their writes as add_rms_norm does: next's companions are
// live after them (the next layer's first GEMV reads them, no converter kernel), and the MoE
// inputs add_rms_norm_moe writes lose any companions they had.
TEST_P(CompanionBookkeeping, MoeResidualStepsWriteTheCompanionsOfNext) {
  auto gpu = testing::make_gpu_in_mode(GetParam());
  ASSERT_TRUE(gpu);
  const int64_t width = 128;
  BackendRows acc(*gpu, 1, width), x(*gpu, 1, width), branch(*gpu, 1, width), next(*gpu, 1, width),
      router_in(*gpu, 1, width), expert_in(*gpu, 1, width);
  acc.set(*gpu, activations(width, 52));
  x.set(*gpu, activations(width, 53));
  branch.set(*gpu, activations(width, 54));
  const engine::NormParams norm{1.0f, 1e-6f};
  gpu->add_rms_norm_branch(acc.rows, branch.rows, x.rows, nullptr, nullptr, 1.0f, nullptr,
                           next.rows, norm);
  EXPECT_NE(gpu->live_companions(next.rows), nullptr) << "add_rms_norm_branch";
  gpu->rms_norm(x.rows, nullptr, 1.0f, 1e-6f, expert_in.rows);
  ASSERT_NE(gpu->live_companions(expert_in.rows), nullptr);
  gpu->scale(next.rows, nullptr, 2.0f);  // drops next's companions
  ASSERT_EQ(gpu->live_companions(next.rows), nullptr);
  gpu->add_rms_norm_moe(acc.rows, x.rows, nullptr, 1.0f, nullptr, next.rows,
                        {nullptr, 0.5f, nullptr, router_in.rows, expert_in.rows}, norm);
  EXPECT_NE(gpu->live_companions(next.rows), nullptr) << "add_rms_norm_moe";
  EXPECT_EQ(gpu->live_companions(expert_in.rows), nullptr) << "add_rms_norm_moe";
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// The decode attention writes the companions of its output (o_proj's input) with it, for both
// sequences of one launch: a shallow one from the attention kernel (one key range) and a deep one
// from the split merge. They stay live for the output rows, and a later write drops them.
TEST_P(CompanionBookkeeping, PrepareAndAttendWritesTheCompanionsOfItsOutput) {
  auto gpu = testing::make_gpu_in_mode(GetParam());
  ASSERT_TRUE(gpu);
  const int q_heads = 8, head_dim = 512;
  const int64_t slots = 4096, q_width = q_heads * head_dim, kv_width = head_dim;
  const std::vector<int32_t> positions = {5, 3000};
  const auto n = static_cast<int64_t>(positions.size());
  BackendRows q(*gpu, n, q_width), k(*gpu, n, kv_width), v(*gpu, n, kv_width),
      out(*gpu, n, q_width);
  q.set(*gpu, random_floats(n * q_width, -2.0f, 2.0f, 60));
  k.set(*gpu, random_floats(n * kv_width, -2.0f, 2.0f, 61));
  v.set(*gpu, random_floats(n * kv_width, -2.0f, 2.0f, 62));
  engine::Buffer device_positions = gpu->allocate(sizeof(int32_t) * n);
  gpu->upload(device_positions.data(), positions.data(), sizeof(int32_t) * n);
  // Per sequence an fp32 cache holding every position before the query's.
  std::vector<std::unique_ptr<BackendRows>> caches;
  std::vector<engine::Buffer> slot_positions;
  std::vector<engine::SequenceRows> sequences;
  for (int64_t s = 0; s < n; ++s) {
    for (uint32_t seed : {63u, 64u}) {
      caches.push_back(std::make_unique<BackendRows>(*gpu, slots, kv_width));
      caches.back()->set(*gpu, random_floats(slots * kv_width, -1.0f, 1.0f, seed + 2 * s));
    }
    std::vector<int32_t> held(slots, -1);
    for (int32_t p = 0; p < positions[s]; ++p) held[p] = p;
    slot_positions.push_back(gpu->allocate(sizeof(int32_t) * slots));
    gpu->upload(slot_positions.back().data(), held.data(), sizeof(int32_t) * slots);
    const engine::KvView kv = {caches[2 * s]->buffer.data(),
                               caches[2 * s + 1]->buffer.data(),
                               static_cast<int32_t*>(slot_positions.back().data()),
                               slots,
                               1,
                               head_dim};
    sequences.push_back({kv, s, 1});
  }
  const model::RopeParams rope = {1000000.0, 64, 512};
  gpu->prepare_and_attend(q.rows, k.rows, v.rows, nullptr, nullptr, true, head_dim,
                          static_cast<const int32_t*>(device_positions.data()), rope, sequences,
                          {0.0f, 1e-6f}, 0, 1.0f / 16.0f, out.rows);
  ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
  const ActivationCompanions* live = gpu->live_companions(out.rows);
  ASSERT_NE(live, nullptr);
  ASSERT_NE(live->bf16, nullptr);
  EXPECT_EQ(live->q8 != nullptr, GetParam() == ActivationMode::kQ8);
  std::vector<uint16_t> bf16(n * live->stride);
  gpu->download(bf16.data(), live->bf16, sizeof(uint16_t) * bf16.size());
  std::vector<uint8_t> q8(live->q8 != nullptr ? n * q8_row_bytes(live->stride) : 0);
  if (live->q8 != nullptr) gpu->download(q8.data(), live->q8, q8.size());
  const std::vector<float> values = out.get(*gpu);
  for (float x : values) ASSERT_TRUE(std::isfinite(x));
  expect_companions_of(values, n, q_width, q_width, &bf16, live->q8 != nullptr ? &q8 : nullptr,
                       live->stride, "attention output");
  gpu->add(out.rows, q.rows);
  EXPECT_EQ(gpu->live_companions(out.rows), nullptr);
}

// Decode batches past the CUDA-core GEMV's 16 rows, up to the GEMV's 64, get companions too (the
// tensor-core GEMV stages them from half the bytes of fp32 rows); longer passes (prefill, on
// cuBLAS) none. In bf16 mode a GEMV over a 64-row batch's companions multiplies the values it
// rounds the fp32 rows to once a write of the same values has dropped them.
TEST_P(CompanionBookkeeping, DecodeBatchesOfUpTo64RowsGetCompanions) {
  auto gpu = testing::make_gpu_in_mode(GetParam());
  ASSERT_TRUE(gpu);
  const int64_t width = 1536, outputs = 256;
  const testing::HostMatrix host =
      testing::random_matrix(quant::WeightFormat::kW4G32, outputs, width, 71);
  const testing::DeviceMatrix w(host);
  for (const int64_t n : {17, 64, 65}) {
    SCOPED_TRACE(n);
    BackendRows x(*gpu, n, width), y(*gpu, n, width), out(*gpu, n, outputs);
    x.set(*gpu, activations(n * width, static_cast<uint32_t>(72 + n)));
    gpu->rms_norm(x.rows, nullptr, 0.0f, 1e-6f, y.rows);
    const ActivationCompanions* live = gpu->live_companions(y.rows);
    if (n > 64) {
      EXPECT_EQ(live, nullptr);
      continue;
    }
    ASSERT_NE(live, nullptr);
    ASSERT_NE(live->bf16, nullptr);
    ASSERT_EQ(live->q8 != nullptr, GetParam() == ActivationMode::kQ8);
    std::vector<uint16_t> bf16(n * live->stride);
    gpu->download(bf16.data(), live->bf16, sizeof(uint16_t) * bf16.size());
    std::vector<uint8_t> q8(live->q8 != nullptr ? n * q8_row_bytes(live->stride) : 0);
    if (live->q8 != nullptr) gpu->download(q8.data(), live->q8, q8.size());
    const std::vector<float> values = y.get(*gpu);
    expect_companions_of(values, n, width, width, &bf16, live->q8 != nullptr ? &q8 : nullptr,
                         live->stride, "rms_norm of " + std::to_string(n) + " rows");
    if (n != 64 || GetParam() != ActivationMode::kBF16) continue;
    gpu->matmul(w.view, y.rows, out.rows);
    const std::vector<float> from_companions = out.get(*gpu);
    gpu->scale(y.rows, nullptr, 1.0f);  // the same values, the companions dropped
    ASSERT_EQ(gpu->live_companions(y.rows), nullptr);
    gpu->matmul(w.view, y.rows, out.rows);
    const std::vector<float> from_rows = out.get(*gpu);
    ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
    // The same bf16 products; the tilings chosen for bf16 and fp32 rows may add them in another
    // order (fp32 sums of 1,536 terms).
    for (size_t i = 0; i < from_rows.size(); ++i) {
      ASSERT_TRUE(std::isfinite(from_companions[i]));
      EXPECT_NEAR(from_companions[i], from_rows[i], 1e-4f * (1.0f + std::fabs(from_rows[i])))
          << "output " << i;
    }
  }
  EXPECT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();
}

// The stale-companion test proper: a GEMV reading rows whose producer's companions went stale
// multiplies the rows' new values (within the mode's bound of the CPU reference), not the old.
TEST_P(CompanionBookkeeping, GemvAfterAWriteReadsTheNewValues) {
  auto gpu = testing::make_gpu_in_mode(GetParam());
  ASSERT_TRUE(gpu);
  backend::cpu::CpuBackend cpu(1);
  const int64_t width = 256, outputs = 96;
  const testing::HostMatrix host =
      testing::random_matrix(quant::WeightFormat::kW4G32, outputs, width, 40);
  const testing::DeviceMatrix w(host);
  BackendRows x(*gpu, 1, width), y(*gpu, 1, width), delta(*gpu, 1, width), out(*gpu, 1, outputs);
  x.set(*gpu, activations(width, 41));
  const std::vector<float> delta_values = random_floats(width, 5.0f, 9.0f, 42);
  delta.set(*gpu, delta_values);
  gpu->rms_norm(x.rows, nullptr, 0.0f, 1e-6f, y.rows);  // y and its companions
  gpu->add(y.rows, delta.rows);                         // y changes, the companions go stale
  gpu->matmul(w.view, y.rows, out.rows);
  const std::vector<float> new_y = y.get(*gpu);
  const std::vector<float> got = out.get(*gpu);
  ASSERT_TRUE(gpu->status().ok()) << gpu->status().error().to_string();

  std::vector<float> expected(outputs);
  std::vector<float> cpu_y = new_y;
  cpu.matmul(host.view(), engine::Rows::dense(cpu_y.data(), 1, width),
             engine::Rows::dense(expected.data(), 1, outputs));
  // Bound per output: bf16 rounds each x to within 2^-8 relative (8 significant bits); q8 to within
  // scale / 2 of its chunk (scale = max|chunk| / 127); plus fp32 sums on both sides.
  std::vector<double> bound(outputs), reference(expected.begin(), expected.end());
  std::vector<float> row(width);
  for (int64_t o = 0; o < outputs; ++o) {
    quant::dequantize_row(host.view(), o, row.data());
    double sum = 0.0;
    for (int64_t c = 0; c < width / 32; ++c) {
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(new_y[c * 32 + i]));
      for (int i = 0; i < 32; ++i) {
        const int64_t k = c * 32 + i;
        const double x_error = GetParam() == ActivationMode::kQ8
                                   ? amax / 127.0 / 2.0
                                   : std::ldexp(std::fabs(double{new_y[k]}), -8);
        sum += std::fabs(double{row[k]}) *
               (x_error + 2 * width * std::ldexp(std::fabs(double{new_y[k]}), -24));
      }
    }
    bound[o] = sum;
  }
  testing::expect_close(got, reference, bound, 1.0, "gemv after a write");
}

INSTANTIATE_TEST_SUITE_P(Modes, CompanionBookkeeping,
                         ::testing::Values(ActivationMode::kBF16, ActivationMode::kQ8),
                         [](const auto& info) { return activation_mode_name(info.param); });

// ---------------------------------------------------------------------------------------------
// Whole decode steps.

std::unique_ptr<engine::Gemma4Engine> make_engine(const model::LoadedModel& m,
                                                  std::unique_ptr<engine::Backend> backend,
                                                  bool record) {
  engine::EngineOptions options;
  options.max_sequences = 2;
  options.max_context = 96;
  options.ring_history = 8;
  options.record_decode = record;
  auto engine = engine::Gemma4Engine::create(m.config, m.weights, std::move(backend), options);
  EXPECT_TRUE(engine.ok()) << engine.error().to_string();
  return engine.ok() ? std::move(*engine) : nullptr;
}

class DecodeInMode : public ::testing::TestWithParam<ActivationMode> {};

// A prompt, then decode steps of one sequence and of two together, in this mode with and without
// recorded graphs, against the CPU engine fed the same tokens (its own greedy picks). Replays
// equal plain launches bit for bit. Against the CPU: every GEMV input is rounded (bf16: 2^-8
// relative) or quantized (q8: up to max|chunk| / 254 per value) once per GEMV and the tiny model
// chains ~40 of them, so a logit may move by a few percent of the logits' range; a GEMV fed stale
// or wrong activations moves logits by about their whole range. The bound: 0.05 of the range of
// the CPU's logits for bf16, 0.1 for q8; greedy picks agree where the CPU's top two differ by
// more than the bound.
TEST_P(DecodeInMode, StepsMatchTheCpuEngineAndGraphReplaysMatchPlainLaunches) {
  const ActivationMode mode = GetParam();
  const auto dir =
      gemma4::testing::scratch_dir(std::string("decode_in_mode_") + activation_mode_name(mode));
  const gemma4::testing::RemoveOnExit cleanup{dir};
  model::SynthOptions synth;
  synth.config = "tiny";
  synth.seed = 5;
  synth.format = model::SynthFormat::kW4A16;
  synth.grid = model::SynthGrid::kW4G32;
  synth.output = dir;
  ASSERT_TRUE(model::synthesize_checkpoint(synth).ok());
  auto loaded = model::LoadedModel::open(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.error().to_string();
  auto cpu = make_engine(*loaded, std::make_unique<backend::cpu::CpuBackend>(1), false);
  auto plain = make_engine(*loaded, testing::make_gpu_in_mode(mode), false);
  auto recorded = make_engine(*loaded, testing::make_gpu_in_mode(mode), true);
  ASSERT_TRUE(cpu && plain && recorded);
  const int32_t vocab = cpu->vocab_size();
  std::vector<engine::SequenceId> sequences;
  for (int i = 0; i < 2; ++i) {
    auto a = cpu->open_sequence();
    auto b = plain->open_sequence();
    auto c = recorded->open_sequence();
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    ASSERT_TRUE(*a == *b && *b == *c);
    sequences.push_back(*a);
  }
  const double relative_bound = mode == ActivationMode::kQ8 ? 0.1 : 0.05;
  double worst = 0.0;
  auto step = [&](const std::vector<std::vector<int32_t>>& tokens, const std::string& what) {
    std::vector<engine::StepInput> inputs;
    for (size_t i = 0; i < tokens.size(); ++i) inputs.push_back({sequences[i], tokens[i]});
    std::vector<float> expected(inputs.size() * vocab), got(inputs.size() * vocab),
        replayed(inputs.size() * vocab);
    EXPECT_TRUE(cpu->step(inputs, expected).ok());
    Status status = plain->step(inputs, got);
    EXPECT_TRUE(status.ok()) << status.error().to_string();
    status = recorded->step(inputs, replayed);
    EXPECT_TRUE(status.ok()) << status.error().to_string();
    EXPECT_EQ(0, std::memcmp(got.data(), replayed.data(), sizeof(float) * got.size()))
        << what << ": graph replay differs from plain launches";
    std::vector<int32_t> next;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto row = expected.begin() + i * vocab;
      const auto [lo, hi] = std::minmax_element(row, row + vocab);
      const double bound = relative_bound * (*hi - *lo);
      double delta = 0.0;
      for (int32_t v = 0; v < vocab; ++v) {
        EXPECT_TRUE(std::isfinite(got[i * vocab + v]));
        delta = std::max(delta, double{std::fabs(got[i * vocab + v] - row[v])});
      }
      worst = std::max(worst, delta / (*hi - *lo));
      EXPECT_LE(delta, bound) << what << " input " << i;
      const auto best = static_cast<int32_t>(hi - row);
      const auto got_best = static_cast<int32_t>(
          std::max_element(got.begin() + i * vocab, got.begin() + (i + 1) * vocab) -
          (got.begin() + i * vocab));
      if (got_best != best) {
        EXPECT_LE(row[best] - row[got_best], 2 * bound) << what << ": greedy pick far off";
      }
      next.push_back(best);
    }
    return next;
  };
  std::vector<int32_t> prompt{2};
  for (int i = 1; i < 20; ++i) prompt.push_back(100 + (i * 7919) % 100000);
  auto next = step({prompt, {2, 7, 9}}, "prompt");
  for (int i = 0; i < 4; ++i) next = step({{next[0]}}, "decode one");
  for (int i = 0; i < 4; ++i) next = step({{next[0]}, {next[1]}}, "decode two");
  std::printf("[ %s ] worst |delta logit| / logit range: %.3g\n", activation_mode_name(mode),
              worst);
}

INSTANTIATE_TEST_SUITE_P(Modes, DecodeInMode,
                         ::testing::Values(ActivationMode::kF32, ActivationMode::kBF16,
                                           ActivationMode::kQ8),
                         [](const auto& info) { return activation_mode_name(info.param); });

}  // namespace
}  // namespace gemma4::cuda
