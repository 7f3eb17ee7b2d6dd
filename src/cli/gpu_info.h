// What the CLI reports about the GPU (device choice, bench output), answered without a model.
// Built without the CUDA backend, every query says "no GPU".
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace gemma4::cli {

// Visible CUDA devices; 0 without the CUDA backend or without a usable driver.
int cuda_device_count();

// "NVIDIA H200"; empty when `device` does not exist.
std::string cuda_device_name(int device);

// Device memory in use by every process (total - free), for peak tracking; nullopt without a GPU.
std::optional<int64_t> cuda_memory_used_bytes(int device);

}  // namespace gemma4::cli
