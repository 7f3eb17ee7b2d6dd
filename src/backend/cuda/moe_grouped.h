// The grouped path of launch_moe (moe_grouped.cu): prefill passes, the (token, expert) pairs
// grouped by expert and run as tensor-core tiles.
#pragma once

#include <cstddef>

#include "backend/cuda/launch.h"
#include "backend/cuda/moe_kernels.h"

namespace gemma4::cuda {

// Where the grouped path keeps its intermediates for `tokens` tokens (moe_workspace_layout):
// activations bf16 in the staged order with rows padded to whole spans (moe_grouped.cu), expert
// outputs, the plan, and then (inside `bytes`) x in bf16, staged.
MoeWorkspaceLayout grouped_workspace_layout(const MoeShape& shape, int tokens, int top_k);

// Enqueues the grouped path's four kernels for args (args.path == MoePath::kGrouped) in the
// workspace laid out as grouped_workspace_layout says.
cudaError_t launch_grouped(const MoeRunArgs& args, const MoeWorkspaceLayout& layout,
                           const Launch& launch);

}  // namespace gemma4::cuda
