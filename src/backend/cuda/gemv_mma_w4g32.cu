// The w4g32 instantiations of the tensor-core batched GEMV kernel (gemv_mma_kernel.cuh).
#include "backend/cuda/gemv_mma_kernel.cuh"

namespace gemma4::cuda::gemv_mma_detail {

template MmaKernel select_mma_kernel<PackedFormat::kW4G32>(ActType, int);

}  // namespace gemma4::cuda::gemv_mma_detail
