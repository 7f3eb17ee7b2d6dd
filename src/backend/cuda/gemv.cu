// Decode GEMV dispatch (see gemv.h) and the activation quantizer. The kernel template is in
// gemv_kernel.cuh: one template covers every weight format, activation type and tiling; a format
// only defines how a 16-byte chunk of weights and its scale turn into a dot product with 32 (or 8)
// activations (device_math.cuh). Design and measurements: spec/h200-decode-notes.md.
#include "backend/cuda/gemv_kernel.cuh"

namespace gemma4::cuda {
namespace {

// One warp per 32-element chunk: lane l converts element l.
__global__ void write_companions_kernel(CompanionArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int64_t chunks = a.cols / 32;
  const int64_t chunk = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int64_t row = blockIdx.y;
  if (chunk >= chunks) return;  // whole warps
  const float value[1] = {a.x[row * a.x_stride + chunk * 32 + (threadIdx.x & 31)]};
  store_companions<1>(a.out, row, chunk * 32 + (threadIdx.x & 31), value);
}

// One thread per pair of product rows (blockIdx.y = activation row): the GEMV's own store.
__global__ void gemv_epilogue_kernel(EpilogueArgs a) {
  pdl_trigger_dependents();
  pdl_wait_for_predecessors();
  const int m = blockIdx.y;
  const int64_t row = 2 * (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x);
  if (row >= a.rows) return;
  const float* products = a.products + m * a.products_stride;
  const float pair[2] = {products[row], row + 1 < a.rows ? products[row + 1] : 0.0f};
  gemv_detail::store_rows<2>(a, m, row, pair);
}

}  // namespace

cudaError_t launch_gemv_kernel(PackedFormat format, ActType x_type, int tiling,
                               const GemvArgs& args, const Launch& launch) {
  gemv_detail::KernelFn kernel = nullptr;
  switch (format) {
    case PackedFormat::kW4G32:
      kernel = gemv_detail::select_kernel<PackedFormat::kW4G32>(x_type, tiling);
      break;
    case PackedFormat::kNVFP4:
      kernel = gemv_detail::select_kernel<PackedFormat::kNVFP4>(x_type, tiling);
      break;
    case PackedFormat::kBF16:
      kernel = gemv_detail::select_kernel<PackedFormat::kBF16>(x_type, tiling);
      break;
    case PackedFormat::kW4G32A:
      kernel = gemv_detail::select_kernel<PackedFormat::kW4G32A>(x_type, tiling);
      break;
    case PackedFormat::kW8:
      kernel = gemv_detail::select_kernel<PackedFormat::kW8>(x_type, tiling);
      break;
    case PackedFormat::kF16:
      kernel = gemv_detail::select_kernel<PackedFormat::kF16>(x_type, tiling);
      break;
  }
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const GemvTiling& t = kGemvTilings[tiling];
  const int rows_per_block = (32 / t.lanes_per_row) * t.rows_per_thread;
  const dim3 grid(static_cast<unsigned>((args.rows + rows_per_block - 1) / rows_per_block));
  const bool staged = x_type == ActType::kF32 && args.f32_products == F32Products::kBF16Staged;
  const int64_t cols = args.chunks_per_row * packed_chunk_elements(format);
  const auto shared =
      static_cast<size_t>(gemv_shared_bytes(t, staged ? args.staged_rows : 0, cols));
  return launch_kernel(kernel, grid, dim3(t.warps * 32), shared, launch, args);
}

cudaError_t launch_write_companions(const CompanionArgs& args, int rows, const Launch& launch) {
  constexpr int kWarpsPerBlock = 8;
  const int64_t chunks = args.cols / 32;
  const dim3 grid(static_cast<unsigned>((chunks + kWarpsPerBlock - 1) / kWarpsPerBlock),
                  static_cast<unsigned>(rows));
  return launch_kernel(write_companions_kernel, grid, dim3(kWarpsPerBlock * 32), 0, launch, args);
}

cudaError_t launch_gemv_epilogue(const EpilogueArgs& args, const Launch& launch) {
  constexpr int kThreads = 256;
  const int64_t pairs = (args.rows + 1) / 2;
  const dim3 grid(static_cast<unsigned>((pairs + kThreads - 1) / kThreads),
                  static_cast<unsigned>(args.m));
  return launch_kernel(gemv_epilogue_kernel, grid, dim3(kThreads), 0, launch, args);
}

}  // namespace gemma4::cuda
