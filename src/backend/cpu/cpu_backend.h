// The float32 reference backend: every Backend operation as a plain loop over host memory, rows
// split over a small thread pool. Simple on purpose: it is the oracle the CUDA kernels are
// checked against, and it is checked against transformers itself.
#pragma once

#include <memory>

#include "backend/cpu/thread_pool.h"
#include "engine/backend.h"

namespace gemma4::backend::cpu {

class CpuBackend final : public engine::Backend {
 public:
  // `threads` = 0: one per hardware thread.
  explicit CpuBackend(int threads = 0);

  const char* name() const override { return "cpu"; }
  bool reads_host_memory() const override { return true; }

  engine::Buffer allocate(size_t bytes) override;
  void upload(void* dst, const void* src, size_t bytes) override;
  void download(void* dst, const void* src, size_t bytes) override;

  void embed(const quant::QMatrix& table, const int32_t* ids, float scale,
             engine::Rows out) override;
  void matmul(const quant::QMatrix& w, engine::Rows x, engine::Rows y) override;
  void rms_norm(engine::Rows x, const float* weight, float weight_offset, float eps,
                engine::Rows y) override;
  void rope(engine::Rows x, int head_dim, const int32_t* positions,
            const model::RopeParams& rope) override;
  void gelu_tanh_mul(engine::Rows gate, engine::Rows multiplier, engine::Rows out) override;
  void add(engine::Rows acc, engine::Rows x) override;
  void scale(engine::Rows x, const float* column_scale, float scalar) override;
  void softcap(engine::Rows x, float cap) override;
  void copy(engine::Rows src, engine::Rows dst) override;

  void write_kv(const engine::KvView& kv, engine::Rows k, engine::Rows v,
                const int32_t* positions) override;
  void forget_kv(const engine::KvView& kv, int64_t from_position) override;
  void attention(engine::Rows q, const int32_t* positions, const engine::KvView& kv, int window,
                 float scale, engine::Rows out) override;

  void route_experts(engine::Rows logits, const engine::RouterParams& router, int32_t* expert_ids,
                     float* weights) override;
  void run_experts(std::span<const model::ExpertMatrices> experts, engine::Rows x,
                   const int32_t* expert_ids, const float* weights, int top_k,
                   engine::Rows out) override;

  void matmul_gelu_pairs(const quant::QMatrix& w, engine::Rows x, engine::Rows y) override;

 private:
  ThreadPool pool_;
};

// PyTorch's gelu(approximate="tanh").
float gelu_tanh(float x);

}  // namespace gemma4::backend::cpu
