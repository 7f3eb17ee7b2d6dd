// A Backend that forwards every operation to the CPU reference. Engine tests derive from it and
// override only what they observe or change (recording, where weights live, ...), so each test
// backend states its difference and nothing else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "backend/cpu/cpu_backend.h"
#include "engine/backend.h"

namespace gemma4::testing {

using engine::Backend;
using engine::Buffer;
using engine::KvView;
using engine::RouterParams;
using engine::Rows;

class CpuForwardingBackend : public Backend {
 public:
  explicit CpuForwardingBackend(int threads = 0) : cpu_(threads) {}

  const char* name() const override { return "cpu-forwarding"; }
  bool reads_host_memory() const override { return cpu_.reads_host_memory(); }
  Buffer allocate(size_t bytes) override { return cpu_.allocate(bytes); }
  void upload(void* dst, const void* src, size_t bytes) override { cpu_.upload(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override {
    cpu_.download(dst, src, bytes);
  }
  void embed(const quant::QMatrix& table, const int32_t* ids, float scale, Rows out) override {
    cpu_.embed(table, ids, scale, out);
  }
  void matmul(const quant::QMatrix& w, Rows x, Rows y) override { cpu_.matmul(w, x, y); }
  void rms_norm(Rows x, const float* weight, float weight_offset, float eps, Rows y) override {
    cpu_.rms_norm(x, weight, weight_offset, eps, y);
  }
  void rope(Rows x, int head_dim, const int32_t* positions,
            const model::RopeParams& rope) override {
    cpu_.rope(x, head_dim, positions, rope);
  }
  void gelu_tanh_mul(Rows gate, Rows multiplier, Rows out) override {
    cpu_.gelu_tanh_mul(gate, multiplier, out);
  }
  void add(Rows acc, Rows x) override { cpu_.add(acc, x); }
  void scale(Rows x, const float* column_scale, float scalar) override {
    cpu_.scale(x, column_scale, scalar);
  }
  void softcap(Rows x, float cap) override { cpu_.softcap(x, cap); }
  void copy(Rows src, Rows dst) override { cpu_.copy(src, dst); }
  void write_kv(const KvView& kv, Rows k, Rows v, const int32_t* positions) override {
    cpu_.write_kv(kv, k, v, positions);
  }
  void forget_kv(const KvView& kv, int64_t from_position) override {
    cpu_.forget_kv(kv, from_position);
  }
  void attention(Rows q, const int32_t* positions, const KvView& kv, int window, float scale,
                 Rows out) override {
    cpu_.attention(q, positions, kv, window, scale, out);
  }
  void route_experts(Rows logits, const RouterParams& router, int32_t* expert_ids,
                     float* weights) override {
    cpu_.route_experts(logits, router, expert_ids, weights);
  }
  void run_experts(std::span<const model::ExpertMatrices> experts, Rows x,
                   const int32_t* expert_ids, const float* weights, int top_k, Rows out) override {
    cpu_.run_experts(experts, x, expert_ids, weights, top_k, out);
  }
  // The fused operations keep Backend's defaults (composed of the forwarded primitives above),
  // except the one the CPU backend implements itself.
  void matmul_gelu_pairs(const quant::QMatrix& w, Rows x, Rows y) override {
    cpu_.matmul_gelu_pairs(w, x, y);
  }

 protected:
  backend::cpu::CpuBackend cpu_;
};

}  // namespace gemma4::testing
