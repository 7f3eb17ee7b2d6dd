// The w4g32a instantiations of the decode GEMV kernel (gemv_kernel.cuh).
#include "backend/cuda/gemv_kernel.cuh"

namespace gemma4::cuda::gemv_detail {

template KernelFn select_kernel<WeightFormat::kW4G32A>(ActType, int);

}  // namespace gemma4::cuda::gemv_detail
