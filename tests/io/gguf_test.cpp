#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "io/gguf.h"
#include "test_support.h"

namespace gemma4::io {
namespace {

std::filesystem::path reference_gguf() {
  return std::filesystem::path(GEMMA4_SOURCE_DIR) / "tests" / "io" / "data" / "reference.gguf";
}

using testing::expect_error;

std::vector<std::byte> read_all(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

// Builds GGUF bytes field by field for malformed cases.
struct Bytes {
  std::vector<std::byte> data;
  template <typename T>
  Bytes& put(T value) {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    data.insert(data.end(), p, p + sizeof(T));
    return *this;
  }
  Bytes& str(std::string_view s) {
    put<uint64_t>(s.size());
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    data.insert(data.end(), p, p + s.size());
    return *this;
  }
  Bytes& header(uint64_t tensors, uint64_t kvs) {
    return put<uint32_t>(kGgufMagic).put<uint32_t>(3).put<uint64_t>(tensors).put<uint64_t>(kvs);
  }
  Bytes& zeros(size_t n) {
    data.resize(data.size() + n, std::byte{0});
    return *this;
  }
};

void expect_parse_error(const Bytes& bytes, ErrorCode code,
                        std::initializer_list<std::string_view> fragments) {
  expect_error(GgufFile::parse(bytes.data, "test.gguf"), code, fragments);
}

// A file written by gguf-py (tests/io/make_reference_files.py).
TEST(Gguf, ReadsReferenceWriterFile) {
  auto file = GgufFile::open(reference_gguf());
  ASSERT_TRUE(file.ok()) << file.error().to_string();
  EXPECT_EQ(file->version(), 3u);
  EXPECT_EQ(file->alignment(), 32u);
  EXPECT_EQ(*file->find_metadata("general.architecture")->as_string(), "gemma4");
  EXPECT_EQ(file->find_metadata("test.u8")->as_uint(), 200u);
  EXPECT_EQ(file->find_metadata("test.i8")->as_int(), -100);
  EXPECT_EQ(file->find_metadata("test.u16")->as_uint(), 60000u);
  EXPECT_EQ(file->find_metadata("test.i16")->as_int(), -30000);
  EXPECT_EQ(file->find_metadata("test.u32")->as_uint(), 4000000000u);
  EXPECT_EQ(file->find_metadata("test.u32")->type, GgufValueType::kU32);
  EXPECT_EQ(file->find_metadata("test.i32")->as_int(), -2000000000);
  EXPECT_EQ(file->find_metadata("test.f32")->as_float(), 0.5);
  EXPECT_EQ(file->find_metadata("test.bool")->as_bool(), true);
  EXPECT_EQ(file->find_metadata("test.u64")->as_uint(), (uint64_t{1} << 63) + 5);
  EXPECT_EQ(file->find_metadata("test.u64")->as_int(), std::nullopt);  // does not fit int64
  EXPECT_EQ(file->find_metadata("test.i64")->as_int(), -(int64_t{1} << 40));
  EXPECT_EQ(file->find_metadata("test.f64")->as_float(), -2.25);
  EXPECT_EQ(*file->find_metadata("test.string")->as_string(), "h\xc3\xa9llo");
  const auto* strings = file->find_metadata("test.strings")->as_string_array();
  ASSERT_NE(strings, nullptr);
  EXPECT_EQ(*strings, (std::vector<std::string>{"a", "",
                                                "\xe2\x96\x81"
                                                "b"}));
  EXPECT_EQ(file->find_metadata("test.ints")->as_int_array(), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(file->find_metadata("test.floats")->as_float_array(),
            (std::vector<double>{0.25, -1.5}));
  EXPECT_EQ(*file->find_metadata("test.bools")->as_bool_array(),
            (std::vector<bool>{true, false, true}));
  EXPECT_EQ(file->find_metadata("test.bools")->array_size(), 3u);
  EXPECT_EQ(file->find_metadata("missing"), nullptr);

  const GgufTensorInfo* f32 = file->find("plain.f32");
  ASSERT_NE(f32, nullptr);
  EXPECT_EQ(f32->type, static_cast<uint32_t>(GgufType::kF32));
  EXPECT_EQ(f32->ne, (std::vector<int64_t>{3, 2}));  // numpy [2, 3], fastest first
  std::vector<float> values(6);
  std::memcpy(values.data(), f32->data, 24);
  EXPECT_EQ(values, (std::vector<float>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(f32->row_bytes(), 12u);
  const GgufTensorInfo* f16 = file->find("plain.f16");
  ASSERT_NE(f16, nullptr);
  uint16_t half = 0;
  std::memcpy(&half, f16->data, 2);
  EXPECT_EQ(fp16_to_float(half), 1.5f);
  const GgufTensorInfo* q4k = file->find("q4_k");
  ASSERT_NE(q4k, nullptr);
  EXPECT_EQ(gguf_type_name(q4k->type), "Q4_K");
  EXPECT_EQ(q4k->ne, (std::vector<int64_t>{256, 2}));
  EXPECT_EQ(q4k->nbytes, 2u * 144u);
  for (const auto& tensor : file->tensors()) {
    EXPECT_EQ(tensor.offset % file->alignment(), 0u) << tensor.name;
  }
}

TEST(Gguf, WriterRoundTrip) {
  const auto path = testing::scratch_dir("gguf_writer") / "w.gguf";
  std::vector<std::pair<std::string, GgufValue>> metadata = {
      {"general.architecture", GgufValue::string("gemma4")},
      {"general.alignment", GgufValue::u32(64)},
      {"gemma4.block_count", GgufValue::u32(2)},
      {"gemma4.rope.freq_base", GgufValue::f32(10000.0f)},
      {"gemma4.attention.sliding_window_pattern",
       GgufValue::array(GgufValueType::kBool, std::vector<bool>{true, false})},
      {"gemma4.feed_forward_length",
       GgufValue::array(GgufValueType::kI32, std::vector<int64_t>{6144, 12288})},
      {"tokenizer.ggml.tokens",
       GgufValue::array(GgufValueType::kString, std::vector<std::string>{"<pad>", "a"})},
  };
  std::vector<GgufTensorSpec> specs = {
      {"a", GgufType::kF32, {3}},
      {"b", GgufType::kQ4_0, {32, 2}},
      {"c", GgufType::kF16, {0}},
  };
  auto writer = GgufWriter::create(path, metadata, specs);
  ASSERT_TRUE(writer.ok()) << writer.error().to_string();
  std::vector<std::byte> data(12 + 36);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i);
  ASSERT_TRUE(writer->append(std::span(data).first(5)).ok());
  ASSERT_TRUE(writer->append(std::span(data).subspan(5)).ok());
  const std::vector<std::byte> extra(1);
  EXPECT_FALSE(writer->append(extra).ok());
  ASSERT_TRUE(writer->finish().ok());

  auto file = GgufFile::open(path);
  ASSERT_TRUE(file.ok()) << file.error().to_string();
  EXPECT_EQ(file->alignment(), 64u);
  ASSERT_EQ(file->metadata().size(), metadata.size());
  for (size_t i = 0; i < metadata.size(); ++i) {
    EXPECT_EQ(file->metadata()[i].first, metadata[i].first);
    EXPECT_EQ(file->metadata()[i].second.type, metadata[i].second.type);
    EXPECT_EQ(file->metadata()[i].second.storage, metadata[i].second.storage) << metadata[i].first;
  }
  ASSERT_EQ(file->tensors().size(), 3u);
  EXPECT_EQ(file->find("b")->offset, 64u);
  EXPECT_EQ(std::memcmp(file->find("a")->data, data.data(), 12), 0);
  EXPECT_EQ(std::memcmp(file->find("b")->data, data.data() + 12, 36), 0);
  EXPECT_EQ(file->find("c")->nbytes, 0u);
}

TEST(Gguf, WriterRejectsBadSpecs) {
  const auto dir = testing::scratch_dir("gguf_writer_bad");
  expect_error(GgufWriter::create(dir / "a.gguf", {}, {{"t", GgufType::kQ4_K, {100}}}),
               ErrorCode::kInvalidArgument, {"tensor 't'", "256-element Q4_K block"});
  expect_error(
      GgufWriter::create(dir / "b.gguf", {}, {{std::string(64, 'x'), GgufType::kF32, {1}}}),
      ErrorCode::kInvalidArgument, {"63 bytes"});
  expect_error(GgufWriter::create(dir / "c.gguf", {{"general.alignment", GgufValue::u32(48)}}, {}),
               ErrorCode::kInvalidArgument, {"power of two"});
  expect_error(GgufWriter::create(dir / "d.gguf",
                                  {{"k", GgufValue{GgufValueType::kU8, {}, uint64_t{300}}}}, {}),
               ErrorCode::kInvalidArgument, {"'k'", "UINT8"});
}

// --- malformed files (issue 6 acceptance) ----------------------------------------------------

TEST(GgufMalformed, TruncatedEverywhere) {
  // Every prefix of a valid file must fail cleanly (and never crash).
  const auto bytes = read_all(reference_gguf());
  ASSERT_GT(bytes.size(), 1000u);
  for (size_t size = 0; size < bytes.size(); size += (size < 600 ? 1 : 97)) {
    auto file = GgufFile::parse(std::span(bytes).first(size), "prefix.gguf");
    EXPECT_FALSE(file.ok()) << size;
  }
  expect_error(GgufFile::parse(std::span(bytes).first(20), "t.gguf"), ErrorCode::kOutOfRange,
               {"t.gguf", "truncated"});
}

TEST(GgufMalformed, BadMagicAndVersion) {
  expect_parse_error(Bytes().put<uint32_t>(0x12345678).put<uint32_t>(3).zeros(16),
                     ErrorCode::kInvalidArgument, {"not a GGUF file"});
  expect_parse_error(Bytes().put<uint32_t>(kGgufMagic).put<uint32_t>(2).zeros(16),
                     ErrorCode::kUnsupported, {"version 2"});
}

TEST(GgufMalformed, LyingCounts) {
  expect_parse_error(Bytes().header(0, uint64_t{1} << 60), ErrorCode::kOutOfRange,
                     {"metadata count"});
  expect_parse_error(Bytes().header(uint64_t{1} << 60, 0), ErrorCode::kOutOfRange,
                     {"tensor count"});
  // Enough bytes for the count check, but the second value's type is cut off.
  expect_parse_error(Bytes().header(0, 2).str("a").put<uint32_t>(4).put<uint32_t>(1).str("bc"),
                     ErrorCode::kOutOfRange, {"truncated", "metadata key 'bc'"});
}

TEST(GgufMalformed, HugeStringAndArrayLengths) {
  expect_parse_error(Bytes().header(0, 1).put<uint64_t>(uint64_t{1} << 62).zeros(16),
                     ErrorCode::kOutOfRange, {"string length", "runs past the end"});
  expect_parse_error(
      Bytes().header(0, 1).str("k").put<uint32_t>(8).put<uint64_t>(~uint64_t{0}).zeros(8),
      ErrorCode::kOutOfRange, {"metadata key 'k'", "string length"});
  expect_parse_error(Bytes()
                         .header(0, 1)
                         .str("arr")
                         .put<uint32_t>(9)
                         .put<uint32_t>(4)
                         .put<uint64_t>(uint64_t{1} << 61)
                         .zeros(16),
                     ErrorCode::kOutOfRange, {"metadata key 'arr'", "array of"});
}

TEST(GgufMalformed, UnknownTypes) {
  expect_parse_error(Bytes().header(0, 1).str("k").put<uint32_t>(13).zeros(8),
                     ErrorCode::kInvalidArgument, {"'k'", "unknown value type 13"});
  expect_parse_error(
      Bytes().header(0, 1).str("k").put<uint32_t>(9).put<uint32_t>(9).put<uint64_t>(0),
      ErrorCode::kInvalidArgument, {"'k'", "nested array"});
  // Tensor of ggml type 99, and one of the removed Q4_2 (id 4).
  for (uint32_t type : {99u, 4u}) {
    expect_parse_error(Bytes()
                           .header(1, 0)
                           .str("w")
                           .put<uint32_t>(1)
                           .put<uint64_t>(32)
                           .put<uint32_t>(type)
                           .put<uint64_t>(0)
                           .zeros(64),
                       ErrorCode::kUnsupported,
                       {"tensor 'w'", fmt::format("unsupported tensor type id {}", type)});
  }
  expect_parse_error(Bytes().header(0, 1).str("b").put<uint32_t>(7).put<uint8_t>(2),
                     ErrorCode::kInvalidArgument, {"'b'", "bool"});
}

Bytes one_tensor(uint32_t n_dims, std::vector<uint64_t> ne, uint32_t type, uint64_t offset,
                 size_t data_bytes) {
  Bytes b;
  b.header(1, 0).str("w").put<uint32_t>(n_dims);
  for (uint64_t dim : ne) b.put<uint64_t>(dim);
  b.put<uint32_t>(type).put<uint64_t>(offset);
  b.zeros((32 - b.data.size() % 32) % 32);
  return b.zeros(data_bytes);
}

TEST(GgufMalformed, LyingTensorInfos) {
  expect_parse_error(one_tensor(2, {4, 2}, 0, 0, 16), ErrorCode::kOutOfRange,
                     {"tensor 'w'", "runs past the end"});
  expect_parse_error(one_tensor(1, {4}, 0, 32, 64), ErrorCode::kInvalidArgument,
                     {"tensor 'w'", "offset 32", "expected 0"});
  expect_parse_error(one_tensor(5, {1, 1, 1, 1, 1}, 0, 0, 4), ErrorCode::kInvalidArgument,
                     {"tensor 'w'", "5 dims"});
  expect_parse_error(one_tensor(1, {33}, 2, 0, 64), ErrorCode::kInvalidArgument,
                     {"tensor 'w'", "32-element Q4_0 block"});
  expect_parse_error(one_tensor(2, {uint64_t{1} << 40, uint64_t{1} << 40}, 0, 0, 0),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "overflows"});
  expect_parse_error(one_tensor(1, {~uint64_t{0}}, 0, 0, 0), ErrorCode::kInvalidArgument,
                     {"tensor 'w'", "too large"});
  Bytes duplicate;
  duplicate.header(2, 0);
  for (uint64_t offset : {0, 32}) {
    duplicate.str("w").put<uint32_t>(1).put<uint64_t>(1).put<uint32_t>(0).put<uint64_t>(offset);
  }
  expect_parse_error(duplicate.zeros(128), ErrorCode::kInvalidArgument,
                     {"tensor 'w'", "duplicate"});
}

TEST(GgufMalformed, BadMetadata) {
  expect_parse_error(Bytes()
                         .header(0, 2)
                         .str("k")
                         .put<uint32_t>(0)
                         .put<uint8_t>(1)
                         .str("k")
                         .put<uint32_t>(0)
                         .put<uint8_t>(1),
                     ErrorCode::kInvalidArgument, {"duplicate metadata key 'k'"});
  expect_parse_error(
      Bytes().header(0, 1).str("general.alignment").put<uint32_t>(4).put<uint32_t>(24),
      ErrorCode::kInvalidArgument, {"general.alignment", "power of two"});
  expect_parse_error(
      Bytes().header(0, 1).str("general.alignment").put<uint32_t>(10).put<uint64_t>(32),
      ErrorCode::kInvalidArgument, {"general.alignment", "UINT32"});
}

}  // namespace
}  // namespace gemma4::io
