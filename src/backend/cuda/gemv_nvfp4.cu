// The nvfp4 instantiations of the decode GEMV kernel (gemv_kernel.cuh).
#include "backend/cuda/gemv_kernel.cuh"

namespace gemma4::cuda::gemv_detail {

template KernelFn select_kernel<WeightFormat::kNVFP4>(ActType, int);

}  // namespace gemma4::cuda::gemv_detail
