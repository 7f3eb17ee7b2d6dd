// libFuzzer target: SafetensorsFile::parse over arbitrary bytes must return a value or an
// Error, never crash, and every view it returns must lie inside the input.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  auto file = gemma4::io::SafetensorsFile::parse(bytes, "fuzz-input");
  if (!file.ok()) return 0;
  const std::byte* const end = bytes.data() + bytes.size();
  for (const auto& tensor : file->tensors()) {
    if (tensor.data < bytes.data() || tensor.data > end ||
        tensor.nbytes > static_cast<size_t>(end - tensor.data) ||
        file->find(tensor.name) != &tensor) {
      std::abort();
    }
  }
  return 0;
}
