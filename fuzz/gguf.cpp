// libFuzzer target: GgufFile::parse over arbitrary bytes must return a value or an Error,
// never crash, and every tensor it returns must lie inside the input; a file that parses then
// goes through the model loader (config from metadata, tensors mapped and repacked), which must
// fail cleanly too.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>

#include "io/gguf.h"
#include "model/gguf_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  auto file = gemma4::io::GgufFile::parse(bytes, "fuzz-input");
  if (!file.ok()) return 0;
  const std::byte* const end = bytes.data() + bytes.size();
  for (const auto& tensor : file->tensors()) {
    if (tensor.data < bytes.data() || tensor.data > end ||
        tensor.nbytes > static_cast<size_t>(end - tensor.data)) {
      std::abort();
    }
  }
  for (const auto& [key, value] : file->metadata()) {
    (void)value.array_size();
    (void)value.as_int_array();
  }
  (void)gemma4::model::gguf_model(std::make_shared<const gemma4::io::GgufFile>(std::move(*file)));
  return 0;
}
