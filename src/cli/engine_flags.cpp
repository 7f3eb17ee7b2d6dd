#include "cli/engine_flags.h"

namespace gemma4::cli {

void add_engine_flags(CLI::App& cmd, EngineFlags& flags) {
  cmd.add_option("--device", flags.device,
                 "auto (CUDA when built with it and a GPU is present, else CPU), cpu or cuda")
      ->capture_default_str();
  cmd.add_flag("--no-graphs", flags.no_graphs,
               "launch decode steps kernel by kernel instead of replaying recorded CUDA graphs");
  cmd.add_flag("--no-pdl", flags.no_pdl,
               "launch CUDA kernels without programmatic dependent launch (for A/B measurements)");
  cmd.add_flag("--fp32", flags.fp32,
               "CUDA: exact fp32 activations everywhere (no bf16 tensor-core prefill or bf16 GEMV "
               "inputs): slower, for comparisons against a float32 reference (= --activations "
               "f32)");
  cmd.add_option("--kv-cache", flags.kv_cache,
                 "KV cache element type: f32, bf16 or fp8 (e4m3); default bf16 on CUDA (f32 with "
                 "--fp32), f32 on the CPU (which keeps nothing else)");
  cmd.add_option("--activations", flags.activations,
                 "CUDA: what decode matmuls read: f32 (exact, = --fp32), bf16 (activations "
                 "rounded to bf16, fp32 sums) or q8 (int8 per 32 values with dp4a for w4g32 "
                 "weights, bf16 for other formats); default: the engine's");
  cmd.add_option("--lm-head", flags.lm_head,
                 "how the logits matrix is held: exact (default: the checkpoint's) or q8 (a "
                 "bf16/f32 one, like the tied embedding of NVFP4 checkpoints, quantized at load to "
                 "int8 per 32 values with fp16 scales: about half the bytes a decode step reads of "
                 "it, logits off by ~0.01 on average, ~0.1 at most; embedding lookups stay exact)");
  cmd.add_option("--gpu-memory", flags.gpu_memory,
                 "GPU memory budget, e.g. 3732MiB or 24GiB: fewer sequences, then a shorter "
                 "context, if the requested ones do not fit (CUDA engine only)");
  cmd.add_option("--threads", flags.threads, "CPU threads (0 = all)");
}

Expected<EngineLoadOptions> engine_load_options(const EngineFlags& flags) {
  EngineLoadOptions load;
  GEMMA4_ASSIGN_OR_RETURN(load.device, parse_device(flags.device));
  load.engine.record_decode = !flags.no_graphs;
  load.pdl = !flags.no_pdl;
  load.kv_cache = flags.kv_cache;
  GEMMA4_ASSIGN_OR_RETURN(load.activations, resolve_activations(flags.activations, flags.fp32));
  GEMMA4_ASSIGN_OR_RETURN(load.engine.lm_head, parse_lm_head(flags.lm_head));
  load.threads = flags.threads;
  GEMMA4_ASSIGN_OR_RETURN(load.gpu_memory, parse_gpu_memory(flags.gpu_memory));
  return load;
}

}  // namespace gemma4::cli
