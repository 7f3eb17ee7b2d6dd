#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "io/safetensors.h"
#include "test_support.h"

namespace gemma4::io {
namespace {

std::vector<std::byte> file_bytes(uint64_t header_length, const std::string& header,
                                  size_t data_bytes) {
  std::vector<std::byte> bytes(8 + header.size() + data_bytes, std::byte{0});
  std::memcpy(bytes.data(), &header_length, 8);
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}

std::vector<std::byte> file_bytes(const std::string& header, size_t data_bytes) {
  return file_bytes(header.size(), header, data_bytes);
}

void write_file(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

using testing::expect_error;

void expect_parse_error(const std::vector<std::byte>& bytes, ErrorCode code,
                        std::initializer_list<std::string_view> fragments) {
  expect_error(SafetensorsFile::parse(bytes, "test.safetensors"), code, fragments);
}

template <typename T>
std::span<const std::byte> as_bytes(const std::vector<T>& values) {
  return std::as_bytes(std::span(values));
}

template <typename T>
std::vector<T> values_of(const TensorView& tensor) {
  std::vector<T> values(tensor.nbytes / sizeof(T));
  std::memcpy(values.data(), tensor.data, tensor.nbytes);
  return values;
}

// A file written by the reference (Rust) writer: tests/io/make_reference_files.py.
TEST(Safetensors, ReadsReferenceWriterFile) {
  const auto path =
      std::filesystem::path(GEMMA4_SOURCE_DIR) / "tests" / "io" / "data" / "reference.safetensors";
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.error().to_string();
  EXPECT_EQ(file->tensors().size(), 8u);
  EXPECT_EQ(file->metadata().at("format"), "pt");

  const TensorView* a = file->find("a.f32");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(values_of<float>(*a), (std::vector<float>{0, 0.5f, 1, 1.5f, 2, 2.5f}));

  const TensorView* b = file->find("b.bf16");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kBF16);
  std::vector<float> b_values;
  for (uint16_t bits : values_of<uint16_t>(*b)) b_values.push_back(bf16_to_float(bits));
  EXPECT_EQ(b_values, (std::vector<float>{-1.5f, -0.5f, 0.5f, 1.5f}));

  EXPECT_EQ(values_of<int64_t>(*file->find("c.i64")), (std::vector<int64_t>{7, -3}));
  EXPECT_EQ(values_of<uint8_t>(*file->find("d.u8")), (std::vector<uint8_t>{0, 1, 2, 3, 4}));

  const TensorView* scalar = file->find("e.scalar");
  ASSERT_NE(scalar, nullptr);
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(scalar->numel(), 1);
  EXPECT_EQ(values_of<float>(*scalar), std::vector<float>{2.25f});

  const TensorView* e4m3 = file->find("f.e4m3");
  ASSERT_NE(e4m3, nullptr);
  EXPECT_EQ(e4m3->dtype, DType::kF8E4M3);
  std::vector<float> e4m3_values;
  for (uint8_t bits : values_of<uint8_t>(*e4m3)) e4m3_values.push_back(e4m3_to_float(bits));
  EXPECT_EQ(e4m3_values, (std::vector<float>{1.0f, -0.5f, 448.0f}));

  const TensorView* empty = file->find("g.empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->dtype, DType::kF16);
  EXPECT_EQ(empty->numel(), 0);
  EXPECT_EQ(empty->nbytes, 0u);

  EXPECT_EQ(values_of<int32_t>(*file->find("h.i32")),
            (std::vector<int32_t>{1, -1, std::numeric_limits<int32_t>::max(),
                                  std::numeric_limits<int32_t>::min()}));
  EXPECT_EQ(file->find("missing"), nullptr);
}

TEST(Safetensors, WriterRoundTrip) {
  const auto dir = testing::scratch_dir("safetensors_round_trip");
  const std::vector<float> weights = {1.0f, -2.0f, 3.5f, 0.25f, 8.0f, -0.125f};
  const std::vector<int32_t> packed = {0x12345678, -1};
  const std::vector<uint16_t> bf16 = {float_to_bf16(1.5f)};
  const std::vector<TensorData> tensors = {
      {{"w", DType::kF32, {2, 3}}, as_bytes(weights)},
      {{"packed", DType::kI32, {1, 2}}, as_bytes(packed)},
      {{"scalar", DType::kBF16, {}}, as_bytes(bf16)},
      {{"nothing", DType::kU8, {0}}, {}},
  };
  ASSERT_TRUE(write_safetensors(dir / "x.safetensors", tensors).ok());
  EXPECT_FALSE(std::filesystem::exists(dir / "x.safetensors.partial"));

  auto file = SafetensorsFile::open(dir / "x.safetensors");
  ASSERT_TRUE(file.ok()) << file.error().to_string();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  ASSERT_EQ(file->tensors().size(), 4u);
  EXPECT_EQ(values_of<float>(*file->find("w")), weights);
  EXPECT_EQ(values_of<int32_t>(*file->find("packed")), packed);
  EXPECT_EQ(values_of<uint16_t>(*file->find("scalar")), bf16);
  EXPECT_EQ(file->find("nothing")->nbytes, 0u);

  // Header padded to a multiple of 8 (reference writer layout, spec 1.3).
  uint64_t header_length = 0;
  std::ifstream in(dir / "x.safetensors", std::ios::binary);
  in.read(reinterpret_cast<char*>(&header_length), 8);
  EXPECT_EQ(header_length % 8, 0u);
}

TEST(Safetensors, WriterStreamsPiecesAndChecksByteCounts) {
  const auto dir = testing::scratch_dir("safetensors_writer_counts");
  auto writer = SafetensorsWriter::create(dir / "s.safetensors",
                                          {{"a", DType::kU8, {3}}, {"b", DType::kU8, {2}}});
  ASSERT_TRUE(writer.ok());
  const std::vector<uint8_t> first = {1, 2}, second = {3, 4, 5}, extra = {6};
  ASSERT_TRUE(writer->append(as_bytes(first)).ok());
  EXPECT_EQ(writer->remaining_bytes(), 3u);
  ASSERT_TRUE(writer->append(as_bytes(second)).ok());
  const Status too_much = writer->append(as_bytes(extra));
  ASSERT_FALSE(too_much.ok());
  EXPECT_NE(too_much.error().message.find("more bytes"), std::string::npos);
  ASSERT_TRUE(writer->finish().ok());
  auto file = SafetensorsFile::open(dir / "s.safetensors");
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(values_of<uint8_t>(*file->find("a")), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(values_of<uint8_t>(*file->find("b")), (std::vector<uint8_t>{4, 5}));

  {
    auto short_writer =
        SafetensorsWriter::create(dir / "short.safetensors", {{"a", DType::kU8, {3}}});
    ASSERT_TRUE(short_writer.ok());
    ASSERT_TRUE(short_writer->append(as_bytes(first)).ok());
    const Status missing = short_writer->finish();
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.error().message.find("1 bytes of tensor data missing"), std::string::npos);
  }
  // An unfinished writer leaves nothing behind.
  EXPECT_FALSE(std::filesystem::exists(dir / "short.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir / "short.safetensors.partial"));
}

TEST(Safetensors, WriterRejectsBadSpecs) {
  const auto dir = testing::scratch_dir("safetensors_writer_specs");
  expect_error(SafetensorsWriter::create(dir / "d.safetensors",
                                         {{"a", DType::kU8, {1}}, {"a", DType::kU8, {1}}}),
               ErrorCode::kInvalidArgument, {"tensor 'a'", "duplicate"});
  expect_error(SafetensorsWriter::create(dir / "n.safetensors", {{"neg", DType::kU8, {2, -1}}}),
               ErrorCode::kInvalidArgument, {"tensor 'neg'", "negative"});
  expect_error(
      SafetensorsWriter::create(dir / "m.safetensors", {{"__metadata__", DType::kU8, {1}}}),
      ErrorCode::kInvalidArgument, {"reserved"});
  expect_error(
      SafetensorsWriter::create(dir / "o.safetensors",
                                {{"big", DType::kF32, {int64_t{1} << 40, int64_t{1} << 40}}}),
      ErrorCode::kInvalidArgument, {"tensor 'big'", "overflows"});
}

// --- malformed files (issue 2 acceptance) ---------------------------------------------------

TEST(SafetensorsMalformed, TruncatedBeforeHeaderLength) {
  expect_parse_error(std::vector<std::byte>(5), ErrorCode::kOutOfRange,
                     {"test.safetensors", "5 bytes", "8-byte header length"});
}

TEST(SafetensorsMalformed, HeaderRunsPastEndOfFile) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  auto bytes = file_bytes(header, 1);
  bytes.resize(8 + header.size() / 2);  // truncated in the middle of the header
  expect_parse_error(bytes, ErrorCode::kOutOfRange, {"test.safetensors", "runs past the end"});
}

TEST(SafetensorsMalformed, OversizedHeaderLength) {
  expect_parse_error(file_bytes(200'000'000, "{}", 0), ErrorCode::kInvalidArgument,
                     {"header length 200000000 exceeds"});
  expect_parse_error(file_bytes(std::numeric_limits<uint64_t>::max(), "{}", 0),
                     ErrorCode::kInvalidArgument, {"exceeds"});
}

TEST(SafetensorsMalformed, OffsetsPastEndOfFile) {
  expect_parse_error(file_bytes(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                     ErrorCode::kOutOfRange,
                     {"test.safetensors", "cover 16 bytes", "holds 8", "'w'"});
  expect_parse_error(
      file_bytes(
          R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})",
          0),
      ErrorCode::kInvalidArgument, {"'w'", "leave a hole"});
}

TEST(SafetensorsMalformed, TrailingBytesAfterLastTensor) {
  expect_parse_error(file_bytes(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 3),
                     ErrorCode::kInvalidArgument, {"cover 2 bytes", "holds 3"});
}

TEST(SafetensorsMalformed, HoleBetweenTensors) {
  expect_parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                12),
                     ErrorCode::kInvalidArgument, {"tensor 'b'", "[8, 12]", "hole"});
  expect_parse_error(file_bytes(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                     ErrorCode::kInvalidArgument, {"tensor 'b'", "hole"});
}

TEST(SafetensorsMalformed, OverlappingTensors) {
  expect_parse_error(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                8),
                     ErrorCode::kInvalidArgument, {"tensor 'b'", "overlap"});
}

TEST(SafetensorsMalformed, ShapeDtypeSizeMismatch) {
  expect_parse_error(file_bytes(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "needs 12 bytes", "hold 8"});
  expect_parse_error(file_bytes(R"({"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,4]}})", 4),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "needs 8 bytes"});
}

TEST(SafetensorsMalformed, BadJson) {
  expect_parse_error(file_bytes(R"({"a": {"dtype": )", 0), ErrorCode::kInvalidArgument,
                     {"test.safetensors", "invalid JSON"});
  expect_parse_error(file_bytes(R"({} trailing)", 0), ErrorCode::kInvalidArgument,
                     {"invalid JSON"});
  expect_parse_error(file_bytes(R"([1, 2])", 0), ErrorCode::kInvalidArgument,
                     {"does not start with '{'"});
  expect_parse_error(file_bytes("", 0), ErrorCode::kInvalidArgument, {"does not start"});
  expect_parse_error(file_bytes("{\"\xff\": 1}", 0), ErrorCode::kInvalidArgument, {"invalid JSON"});
  expect_parse_error(file_bytes(R"({"w": [1]})", 0), ErrorCode::kInvalidArgument,
                     {"tensor 'w'", "not a JSON object"});
}

TEST(SafetensorsMalformed, DuplicateKeys) {
  expect_parse_error(file_bytes(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                                2),
                     ErrorCode::kInvalidArgument, {"duplicate key 'a'"});
  expect_parse_error(
      file_bytes(R"({"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}})", 1),
      ErrorCode::kInvalidArgument, {"duplicate key 'dtype'"});
}

TEST(SafetensorsMalformed, UnknownDtype) {
  expect_parse_error(file_bytes(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", 1),
                     ErrorCode::kUnsupported, {"tensor 'w'", "dtype 'F4'"});
  expect_parse_error(file_bytes(R"({"w":{"dtype":7,"shape":[2],"data_offsets":[0,1]}})", 1),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "dtype"});
}

TEST(SafetensorsMalformed, BadShapes) {
  expect_parse_error(file_bytes(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", 0),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "-1", "non-negative"});
  expect_parse_error(file_bytes(R"({"w":{"dtype":"U8","shape":[2.5],"data_offsets":[0,0]}})", 0),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "non-negative integer"});
  expect_parse_error(
      file_bytes(R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})",
                 0),
      ErrorCode::kInvalidArgument, {"tensor 'w'", "overflows"});
  expect_parse_error(
      file_bytes(R"({"w":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,0]}})", 0),
      ErrorCode::kInvalidArgument, {"tensor 'w'"});
  expect_parse_error(file_bytes(R"({"w":{"dtype":"U8","data_offsets":[0,0]}})", 0),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "'shape'"});
}

TEST(SafetensorsMalformed, BadOffsetsAndMetadata) {
  expect_parse_error(file_bytes(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", 4),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "end before they begin"});
  expect_parse_error(file_bytes(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[0]}})", 0),
                     ErrorCode::kInvalidArgument, {"tensor 'w'", "data_offsets"});
  expect_parse_error(file_bytes(R"({"__metadata__":{"format":1}})", 0), ErrorCode::kInvalidArgument,
                     {"__metadata__", "'format'"});
}

TEST(SafetensorsMalformed, OpenErrorsNameThePath) {
  const auto dir = testing::scratch_dir("safetensors_open_errors");
  expect_error(SafetensorsFile::open(dir / "absent.safetensors"), ErrorCode::kNotFound,
               {"absent.safetensors"});
  expect_error(SafetensorsFile::open(dir), ErrorCode::kInvalidArgument, {"not a regular file"});
  write_file(dir / "empty.safetensors", {});
  expect_error(SafetensorsFile::open(dir / "empty.safetensors"), ErrorCode::kOutOfRange,
               {"empty.safetensors", "0 bytes"});
}

// --- checkpoints ----------------------------------------------------------------------------

std::vector<std::byte> sequence_bytes(size_t count) {
  std::vector<std::byte> bytes(count);
  for (size_t i = 0; i < count; ++i) bytes[i] = static_cast<std::byte>(i * 7 + 1);
  return bytes;
}

TEST(Checkpoint, ShardedWriterRoundTrip) {
  const auto dir = testing::scratch_dir("checkpoint_sharded");
  const std::vector<TensorSpec> specs = {
      {"model.a", DType::kF32, {4, 4}},  // 64 bytes
      {"model.b", DType::kBF16, {8}},    // 16
      {"model.c", DType::kU8, {100}},    // 100: larger than a shard, gets its own
      {"model.d", DType::kI64, {2}},     // 16
      {"model.e", DType::kF8E4M3, {0}},  // 0
  };
  auto writer = ShardedSafetensorsWriter::create(dir, specs, 80);
  ASSERT_TRUE(writer.ok()) << writer.error().to_string();
  EXPECT_EQ(writer->file_names(),
            (std::vector<std::string>{
                "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  const auto data = sequence_bytes(196);
  // Uneven pieces that cross shard boundaries.
  ASSERT_TRUE(writer->append(std::span(data).first(70)).ok());
  ASSERT_TRUE(writer->append(std::span(data).subspan(70, 100)).ok());
  ASSERT_TRUE(writer->append(std::span(data).subspan(170)).ok());
  ASSERT_TRUE(writer->finish().ok());

  auto checkpoint = Checkpoint::open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.error().to_string();
  EXPECT_EQ(checkpoint->shards().size(), 3u);
  EXPECT_EQ(checkpoint->tensors().size(), 5u);
  EXPECT_EQ(checkpoint->total_bytes(), 196u);
  size_t offset = 0;
  for (const TensorSpec& spec : specs) {
    const TensorView* tensor = checkpoint->find(spec.name);
    ASSERT_NE(tensor, nullptr) << spec.name;
    EXPECT_EQ(tensor->shape, spec.shape);
    ASSERT_EQ(tensor->nbytes, spec.nbytes());
    EXPECT_EQ(std::memcmp(tensor->data, data.data() + offset, tensor->nbytes), 0) << spec.name;
    offset += tensor->nbytes;
  }
  // Views stay valid when the checkpoint moves.
  Checkpoint moved = std::move(*checkpoint);
  EXPECT_EQ(moved.find("model.a")->nbytes, 64u);
}

TEST(Checkpoint, SingleFileDirectoryAndFilePath) {
  const auto dir = testing::scratch_dir("checkpoint_single");
  auto writer = ShardedSafetensorsWriter::create(dir, {{"w", DType::kU8, {3}}}, 1 << 20);
  ASSERT_TRUE(writer.ok());
  EXPECT_EQ(writer->file_names(), std::vector<std::string>{"model.safetensors"});
  const auto data = sequence_bytes(3);
  ASSERT_TRUE(writer->append(data).ok());
  ASSERT_TRUE(writer->finish().ok());
  EXPECT_FALSE(std::filesystem::exists(dir / "model.safetensors.index.json"));

  for (const auto& path : {dir, dir / "model.safetensors"}) {
    auto checkpoint = Checkpoint::open(path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.error().to_string();
    EXPECT_EQ(checkpoint->directory(), dir);
    ASSERT_NE(checkpoint->find("w"), nullptr);
    EXPECT_EQ(checkpoint->total_bytes(), 3u);
  }
}

// Writes shard files and an index by hand.
void write_index(const std::filesystem::path& dir, const std::string& weight_map) {
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"metadata": {"total_size": 2, "extra": "ignored"}, "weight_map": )" << weight_map
      << "}";
}

void write_u8_shard(const std::filesystem::path& path, std::initializer_list<std::string> names) {
  static const std::vector<uint8_t> one = {1};
  std::vector<TensorData> tensors;
  for (const auto& name : names) tensors.push_back({{name, DType::kU8, {1}}, as_bytes(one)});
  ASSERT_TRUE(write_safetensors(path, tensors).ok());
}

TEST(Checkpoint, TensorListedInIndexButMissingFromShard) {
  const auto dir = testing::scratch_dir("checkpoint_missing_tensor");
  write_u8_shard(dir / "s1.safetensors", {"a"});
  write_u8_shard(dir / "s2.safetensors", {"b"});
  write_index(dir, R"({"a": "s1.safetensors", "b": "s2.safetensors", "ghost": "s2.safetensors"})");
  expect_error(Checkpoint::open(dir), ErrorCode::kNotFound,
               {"tensor 'ghost'", "missing from s2.safetensors"});
}

TEST(Checkpoint, IndexNamesMissingShard) {
  const auto dir = testing::scratch_dir("checkpoint_missing_shard");
  write_u8_shard(dir / "s1.safetensors", {"a"});
  write_index(dir, R"({"a": "s1.safetensors", "b": "gone.safetensors"})");
  expect_error(Checkpoint::open(dir), ErrorCode::kNotFound, {"gone.safetensors"});
}

TEST(Checkpoint, TensorInTwoShards) {
  const auto dir = testing::scratch_dir("checkpoint_duplicate");
  write_u8_shard(dir / "s1.safetensors", {"a", "x"});
  write_u8_shard(dir / "s2.safetensors", {"b", "x"});
  write_index(dir, R"({"a": "s1.safetensors", "b": "s2.safetensors", "x": "s1.safetensors"})");
  expect_error(Checkpoint::open(dir), ErrorCode::kInvalidArgument,
               {"tensor 'x'", "s1.safetensors", "s2.safetensors"});
}

TEST(Checkpoint, UnlistedShardTensorsAreIgnored) {
  const auto dir = testing::scratch_dir("checkpoint_unlisted");
  write_u8_shard(dir / "s1.safetensors", {"a", "extra"});
  write_index(dir, R"({"a": "s1.safetensors"})");
  auto checkpoint = Checkpoint::open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.error().to_string();
  EXPECT_NE(checkpoint->find("a"), nullptr);
  EXPECT_EQ(checkpoint->find("extra"), nullptr);
}

TEST(Checkpoint, BadIndexes) {
  const auto dir = testing::scratch_dir("checkpoint_bad_index");
  write_u8_shard(dir / "s1.safetensors", {"a"});
  write_index(dir, R"({"a": "../s1.safetensors"})");
  expect_error(Checkpoint::open(dir), ErrorCode::kInvalidArgument,
               {"model.safetensors.index.json", "weight_map['a']", "not a file name"});
  write_index(dir, R"({"a": 3})");
  expect_error(Checkpoint::open(dir), ErrorCode::kInvalidArgument, {"weight_map['a']"});
  std::ofstream(dir / "model.safetensors.index.json") << R"({"weight_map": {"a": )";
  expect_error(Checkpoint::open(dir), ErrorCode::kInvalidArgument,
               {"model.safetensors.index.json", "invalid JSON"});
  std::ofstream(dir / "model.safetensors.index.json") << R"({"metadata": {}})";
  expect_error(Checkpoint::open(dir), ErrorCode::kInvalidArgument, {"'weight_map'"});
}

TEST(Checkpoint, MissingFiles) {
  const auto dir = testing::scratch_dir("checkpoint_empty_dir");
  expect_error(Checkpoint::open(dir), ErrorCode::kNotFound, {"model.safetensors"});
  expect_error(Checkpoint::open(dir / "nope"), ErrorCode::kNotFound, {"nope"});
}

TEST(Checkpoint, ShardErrorsNameTheShard) {
  const auto dir = testing::scratch_dir("checkpoint_bad_shard");
  write_file(dir / "s1.safetensors",
             file_bytes(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 1));
  write_index(dir, R"({"a": "s1.safetensors"})");
  expect_error(Checkpoint::open(dir), ErrorCode::kOutOfRange, {"s1.safetensors", "'a'"});
}

}  // namespace
}  // namespace gemma4::io
