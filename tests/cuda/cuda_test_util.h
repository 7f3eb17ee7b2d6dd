// Helpers for the CUDA kernel tests: device buffers, host arrays mirrored in backend buffers,
// poisoned outputs, seeded random inputs and a threaded loop for the CPU references (the lm_head
// reference alone is 400 M multiply-adds).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "engine/backend.h"

namespace gemma4::cuda::testing {

#define CUDA_ASSERT_OK(expr)                                                         \
  do {                                                                               \
    const cudaError_t status_ = (expr);                                              \
    ASSERT_EQ(status_, cudaSuccess) << #expr << ": " << cudaGetErrorString(status_); \
  } while (0)

// A CUDA graph of what `enqueue(true)` (its launches with programmatic dependent launch) records
// on `stream`, instantiated; destroyed with this object. status(): the first error of the
// capture, of enqueue's own launches or of the instantiation.
class RecordedGraph {
 public:
  template <typename Enqueue>
  RecordedGraph(cudaStream_t stream, Enqueue&& enqueue) {
    error_ = cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
    if (error_ != cudaSuccess) return;
    const cudaError_t enqueued = enqueue(true);
    error_ = cudaStreamEndCapture(stream, &graph_);
    if (error_ == cudaSuccess) error_ = enqueued;
    if (error_ == cudaSuccess) error_ = cudaGraphInstantiate(&exec_, graph_, 0);
  }
  RecordedGraph(const RecordedGraph&) = delete;
  RecordedGraph& operator=(const RecordedGraph&) = delete;
  ~RecordedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }

  cudaError_t status() const { return error_; }
  cudaError_t launch(cudaStream_t stream) const { return cudaGraphLaunch(exec_, stream); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaError_t error_ = cudaSuccess;
};

// Device memory holding a copy of a host vector (or `count` poisoned elements).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count) {
    if (cudaMalloc(&data_, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) data_ = nullptr;
    poison();
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (data_) cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data_); }

  T* get() const { return data_; }
  bool ok() const { return data_ != nullptr; }
  // All bytes 0xFF: NaN for fp32, so an output element a kernel forgets to write is caught.
  void poison() {
    if (data_) cudaMemset(data_, 0xFF, std::max<size_t>(count_, 1) * sizeof(T));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

// A CUDA backend on device 0, or null after a failed expectation (no usable GPU).
inline std::unique_ptr<engine::Backend> make_gpu() {
  auto made = make_cuda_backend();
  EXPECT_TRUE(made.ok()) << made.error().to_string();
  return made.ok() ? std::move(*made) : nullptr;
}

// A CUDA backend whose decode matmuls read `mode`, as its concrete type (companion bookkeeping).
inline std::unique_ptr<CudaBackend> make_gpu_in_mode(ActivationMode mode) {
  auto made = make_cuda_backend(0, {true, mode});
  EXPECT_TRUE(made.ok()) << made.error().to_string();
  if (!made.ok()) return nullptr;
  return std::unique_ptr<CudaBackend>(static_cast<CudaBackend*>(made->release()));
}

// `count` rows of `width` floats at `stride` in a backend buffer, filled from the host.
struct BackendRows {
  BackendRows(engine::Backend& gpu, int64_t count, int64_t width, int64_t stride = 0)
      : buffer(gpu.allocate(sizeof(float) * count * (stride > 0 ? stride : width))),
        rows{buffer.floats(), count, width, stride > 0 ? stride : width} {}
  // `values` holds count · stride floats.
  void set(engine::Backend& gpu, const std::vector<float>& values) {
    const auto floats = static_cast<size_t>(rows.count * rows.stride);
    EXPECT_EQ(values.size(), floats);
    gpu.upload(buffer.data(), values.data(), sizeof(float) * std::min(values.size(), floats));
  }
  std::vector<float> get(engine::Backend& gpu) const {
    std::vector<float> out(rows.count * rows.stride);
    gpu.download(out.data(), buffer.data(), sizeof(float) * out.size());
    return out;
  }
  engine::Buffer buffer;
  engine::Rows rows;
};

// A host array (the CPU backend's operand) and its copy in a CUDA backend buffer.
template <typename T>
class Mirrored {
 public:
  Mirrored(engine::Backend& gpu, std::vector<T> values) : gpu_(gpu), host_(std::move(values)) {
    device_ = gpu.allocate(sizeof(T) * host_.size());
    gpu.upload(device_.data(), host_.data(), sizeof(T) * host_.size());
  }
  T* cpu(int64_t offset = 0) { return host_.data() + offset; }
  T* gpu(int64_t offset = 0) const { return static_cast<T*>(device_.data()) + offset; }
  const std::vector<T>& cpu_values() const { return host_; }
  std::vector<T> gpu_values() const {
    std::vector<T> out(host_.size());
    gpu_.download(out.data(), device_.data(), sizeof(T) * host_.size());
    return out;
  }

 private:
  engine::Backend& gpu_;
  std::vector<T> host_;
  engine::Buffer device_;
};

// Runs body(i) for i in [0, n) on all hardware threads.
template <typename Body>
void parallel_for(int64_t n, Body body) {
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), n));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < n; i += threads) body(i);
    });
  }
  for (auto& thread : pool) thread.join();
}

inline std::vector<float> random_floats(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// n random e4m3 codes: random sign and mantissa, exponent field at most max_exponent (magnitudes
// below 2^(max_exponent − 6)). Drawn as codes because float_to_e4m3 searches every code per
// value, far too slow for the millions of a test's KV cache.
inline std::vector<uint8_t> random_e4m3(size_t n, int max_exponent, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& x : v) {
    const uint32_t w = rng();
    x = static_cast<uint8_t>((w & 0x80) | ((w >> 8) % (max_exponent + 1)) << 3 | (w & 7));
  }
  return v;
}

inline std::vector<uint32_t> random_words(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> v(n);
  for (auto& x : v) x = rng();
  return v;
}

// Compares a kernel's output with a reference: every element finite and within
// tolerance · magnitude[i] (+ a tiny absolute floor). Reports the first few failures.
inline void expect_close(const std::vector<float>& got, const std::vector<double>& expected,
                         const std::vector<double>& magnitude, double tolerance, const char* what) {
  ASSERT_EQ(got.size(), expected.size());
  int failures = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double bound = tolerance * magnitude[i] + 1e-30;
    const double err = std::fabs(static_cast<double>(got[i]) - expected[i]);
    if (!std::isfinite(got[i]) || !(err <= bound)) {
      if (++failures <= 5) {
        ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " expected "
                      << expected[i] << " (bound " << bound << ")";
      }
    } else {
      worst = std::max(worst, err / (magnitude[i] + 1e-30));
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << got.size() << " elements wrong";
  ::testing::Test::RecordProperty(std::string(what) + "_worst_relative", std::to_string(worst));
}

}  // namespace gemma4::cuda::testing
