// Tokenizer speed: loading tokenizer.json and encode MB/s on fixed corpora from the shared
// folder (the spec Markdown files and the chat-vector JSON), as one call per corpus and as one
// call per line, with a warm and a cold chunk cache. bench/tokenizer_hf_bench.py measures HF
// `tokenizers` on the same inputs.
//
// Usage: GEMMA4_SHARED_DATA=../shared/data build/bench_tokenizer [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using gemma4::text::Tokenizer;

fs::path shared_data() {
  const char* dir = std::getenv("GEMMA4_SHARED_DATA");
  if (dir == nullptr || *dir == '\0') {
    std::fprintf(stderr, "bench_tokenizer: set GEMMA4_SHARED_DATA to the shared data folder\n");
    std::exit(1);
  }
  return dir;
}

fs::path tokenizer_path() {
  return shared_data() / "tokenizer" / "tokenizer.json";
}

std::string read_file(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    std::fprintf(stderr, "bench_tokenizer: cannot read %s\n", path.c_str());
    std::exit(1);
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

// The corpora, identical to tokenizer_hf_bench.py's.
std::string corpus(const std::string& name) {
  const fs::path spec = shared_data() / ".." / "spec";
  if (name == "prose") {
    std::string text;
    for (const char* file : {"gemma4-architecture.md", "gemma4-chat-format.md", "weight-formats.md",
                             "h200-decode-notes.md"}) {
      text += read_file(spec / file);
    }
    return text;
  }
  return read_file(spec / "gemma4-chat-vectors.json");
}

const Tokenizer& tokenizer() {
  static const Tokenizer loaded = [] {
    auto result = Tokenizer::from_json_file(tokenizer_path());
    if (!result.ok()) {
      std::fprintf(stderr, "bench_tokenizer: %s\n", result.error().to_string().c_str());
      std::exit(1);
    }
    return std::move(result).value();
  }();
  return loaded;
}

void BM_LoadTokenizerJson(benchmark::State& state) {
  for (auto _ : state) {
    auto loaded = Tokenizer::from_json_file(tokenizer_path());
    benchmark::DoNotOptimize(loaded);
  }
}
BENCHMARK(BM_LoadTokenizerJson)->Unit(benchmark::kMillisecond)->Iterations(3);

void BM_EncodeWhole(benchmark::State& state, const std::string& name) {
  const Tokenizer& tok = tokenizer();
  const std::string text = corpus(name);
  size_t tokens = 0;
  for (auto _ : state) {
    const auto ids = tok.encode(text, /*parse_special=*/true);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(tokens);
}
BENCHMARK_CAPTURE(BM_EncodeWhole, prose, std::string("prose"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeWhole, json, std::string("json"))->Unit(benchmark::kMillisecond);

// As BM_EncodeWhole, but with the per-thread chunk cache emptied before each call (encoding with
// another tokenizer does that), i.e. text never seen before.
void BM_EncodeWholeColdCache(benchmark::State& state, const std::string& name) {
  const Tokenizer& tok = tokenizer();
  const std::string text = corpus(name);
  static const Tokenizer other = std::move(Tokenizer::from_vocab({"a"}, {}, {})).value();
  for (auto _ : state) {
    state.PauseTiming();
    benchmark::DoNotOptimize(other.encode("a").data());
    state.ResumeTiming();
    benchmark::DoNotOptimize(tok.encode(text, true).data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}
BENCHMARK_CAPTURE(BM_EncodeWholeColdCache, prose, std::string("prose"))
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeWholeColdCache, json, std::string("json"))
    ->Unit(benchmark::kMillisecond);

void BM_EncodeLines(benchmark::State& state, const std::string& name) {
  const Tokenizer& tok = tokenizer();
  const std::string text = corpus(name);
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  for (auto _ : state) {
    for (const auto& line : lines) benchmark::DoNotOptimize(tok.encode(line, true).data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["lines"] = static_cast<double>(lines.size());
}
BENCHMARK_CAPTURE(BM_EncodeLines, prose, std::string("prose"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_EncodeLines, json, std::string("json"))->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
