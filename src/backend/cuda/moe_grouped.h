// The grouped path of launch_moe (moe_grouped.cu): prefill passes, the (token, expert) pairs
// grouped by expert and run as tensor-core tiles.
#pragma once

#include <cstddef>

#include "backend/cuda/launch.h"
#include "backend/cuda/moe_kernels.h"

namespace gemma4::cuda {

// Where the grouped path keeps its intermediates for `tokens` tokens (moe_workspace_layout).
MoeWorkspaceLayout grouped_workspace_layout(const MoeShape& shape, int tokens, int top_k);

// Enqueues the grouped path's four kernels for args (args.path == MoePath::kGrouped).
cudaError_t launch_grouped(const MoeRunArgs& args, const Launch& launch);

}  // namespace gemma4::cuda
