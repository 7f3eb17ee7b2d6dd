#include "cli/cupti_timeline.h"

#include <utility>

#if GEMMA4_HAS_CUDA
#include <cupti_activity.h>
#include <cupti_result.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <unordered_map>
#endif

namespace gemma4::cli {

#if GEMMA4_HAS_CUDA

namespace {

// The CUPTI entry points bench uses, looked up in the dlopen'ed library.
struct CuptiApi {
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiActivityGetNumDroppedRecords) dropped_records = nullptr;
  decltype(&cuptiGetTimestamp) timestamp = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
};

// The activities recorded: kernels without serializing them (CONCURRENT_KERNEL; KERNEL would
// serialize), and the copies and fills that are graph nodes too.
constexpr CUpti_ActivityKind kRecordedKinds[] = {
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET};

// Kernel names as a person reads them: demangled, without the return type, the parameter list
// and the project's namespaces (template arguments stay: they tell instantiations apart).
std::string readable_kernel_name(const char* mangled) {
  if (!mangled) return "(unnamed kernel)";
  int demangle_status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &demangle_status);
  std::string name = demangle_status == 0 && demangled ? demangled : mangled;
  std::free(demangled);
  for (const std::string_view noise : {"(anonymous namespace)::", "gemma4::cuda::", "gemma4::"}) {
    for (size_t at = name.find(noise); at != std::string::npos; at = name.find(noise, at))
      name.erase(at, noise.size());
  }
  if (name.ends_with(')')) {
    int depth = 0;
    for (size_t i = name.size(); i-- > 0;) {
      if (name[i] == ')') ++depth;
      if (name[i] == '(' && --depth == 0) {
        name.erase(i);
        break;
      }
    }
  }
  if (name.starts_with("void ")) name.erase(0, 5);
  return name;
}

const char* memcpy_name(uint8_t copy_kind) {
  switch (copy_kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "[memcpy HtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "[memcpy DtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "[memcpy DtoD]";
    default:
      return "[memcpy]";
  }
}

// Where the buffer callbacks (plain functions: CUPTI passes them no user pointer) put records.
struct RecordSink {
  std::mutex mutex;
  bool keep = false;  // inside a range: records are kept, else dropped
  std::vector<KernelLaunch> records;
  size_t dropped = 0;
  // CUPTI shares one name string per kernel among its records: demangle each once.
  std::unordered_map<const char*, std::string> names;
};

// Never destroyed: CUPTI may hand back a buffer while the process exits.
RecordSink& sink() {
  static auto* instance = new RecordSink;
  return *instance;
}

// The entry points while a timeline is alive (null otherwise: buffers are then only freed).
std::atomic<const CuptiApi*> active_api{nullptr};

std::optional<KernelLaunch> to_launch(const CUpti_Activity& record,
                                      std::unordered_map<const char*, std::string>& names) {
  KernelLaunch launch;
  switch (record.kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto& kernel = reinterpret_cast<const CUpti_ActivityKernel10&>(record);
      auto [it, inserted] = names.try_emplace(kernel.name);
      if (inserted) it->second = readable_kernel_name(kernel.name);
      launch.name = it->second;
      launch.grid = {kernel.gridX, kernel.gridY, kernel.gridZ};
      launch.block = {kernel.blockX, kernel.blockY, kernel.blockZ};
      launch.stream = kernel.streamId;
      launch.start_ns = kernel.start;
      launch.end_ns = kernel.end;
      return launch;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto& copy = reinterpret_cast<const CUpti_ActivityMemcpy6&>(record);
      launch.name = memcpy_name(copy.copyKind);
      launch.stream = copy.streamId;
      launch.start_ns = copy.start;
      launch.end_ns = copy.end;
      return launch;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto& fill = reinterpret_cast<const CUpti_ActivityMemset4&>(record);
      launch.name = "[memset]";
      launch.stream = fill.streamId;
      launch.start_ns = fill.start;
      launch.end_ns = fill.end;
      return launch;
    }
    default:
      return std::nullopt;
  }
}

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kRecordAlignment = 8;  // CUPTI's ACTIVITY_RECORD_ALIGNMENT

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kRecordAlignment, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;  // 0: CUPTI drops records (counted as dropped)
  *max_records = 0;                    // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t,
                               size_t valid_size) {
  const CuptiApi* api = active_api.load();
  RecordSink& records = sink();
  {
    const std::lock_guard lock(records.mutex);
    if (api && records.keep) {
      CUpti_Activity* record = nullptr;
      while (api->next_record(buffer, valid_size, &record) == CUPTI_SUCCESS) {
        if (auto launch = to_launch(*record, records.names))
          records.records.push_back(std::move(*launch));
      }
      size_t dropped = 0;
      if (api->dropped_records(context, stream, &dropped) == CUPTI_SUCCESS)
        records.dropped += dropped;
    }
  }
  std::free(buffer);
}

// Where libcupti may be: GEMMA4_CUPTI, the loader's path, beside the executable, the toolkit.
std::vector<std::string> library_candidates() {
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("GEMMA4_CUPTI"); path && *path) return {path};
  candidates = {"libcupti.so.13", "libcupti.so"};
  std::error_code error;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back((exe.parent_path() / "libcupti.so.13").string());
  candidates.push_back("/usr/local/cuda/lib64/libcupti.so.13");
  candidates.push_back("/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13");
  return candidates;
}

template <typename Function>
Status find_symbol(void* handle, const char* symbol, Function& out) {
  out = reinterpret_cast<Function>(dlsym(handle, symbol));
  if (!out)
    return make_error(ErrorCode::kUnsupported, "--timeline: libcupti has no {} (too old?)", symbol);
  return Status::ok_status();
}

}  // namespace

// The library stays loaded for the life of the process: CUPTI keeps threads and driver hooks.
struct CuptiTimeline::Library {
  CuptiApi api;
};

Expected<std::unique_ptr<CuptiTimeline>> CuptiTimeline::start() {
  if (active_api.load())
    return make_error(ErrorCode::kInvalidArgument, "--timeline: a timeline is already recording");
  void* handle = nullptr;
  std::string tried;
  for (const auto& candidate : library_candidates()) {
    handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle) break;
    const char* why = dlerror();
    tried += fmt::format("\n  {}: {}", candidate, why ? why : "not loadable");
  }
  if (!handle)
    return make_error(ErrorCode::kNotFound,
                      "--timeline needs CUPTI (libcupti.so.13, part of the CUDA toolkit) and none "
                      "loaded; set GEMMA4_CUPTI=/path/to/libcupti.so.13 or add its folder to "
                      "LD_LIBRARY_PATH. Tried:{}",
                      tried);
  auto library = std::make_unique<Library>();
  CuptiApi& api = library->api;
  GEMMA4_RETURN_IF_ERROR(
      find_symbol(handle, "cuptiActivityRegisterCallbacks", api.register_callbacks));
  GEMMA4_RETURN_IF_ERROR(find_symbol(handle, "cuptiActivityEnable", api.enable));
  GEMMA4_RETURN_IF_ERROR(find_symbol(handle, "cuptiActivityDisable", api.disable));
  GEMMA4_RETURN_IF_ERROR(find_symbol(handle, "cuptiActivityFlushAll", api.flush_all));
  GEMMA4_RETURN_IF_ERROR(find_symbol(handle, "cuptiActivityGetNextRecord", api.next_record));
  GEMMA4_RETURN_IF_ERROR(
      find_symbol(handle, "cuptiActivityGetNumDroppedRecords", api.dropped_records));
  GEMMA4_RETURN_IF_ERROR(find_symbol(handle, "cuptiGetTimestamp", api.timestamp));
  GEMMA4_RETURN_IF_ERROR(find_symbol(handle, "cuptiGetResultString", api.result_string));

  const auto check = [&](CUptiResult result, const char* what) -> Status {
    if (result == CUPTI_SUCCESS) return Status::ok_status();
    const char* text = nullptr;
    api.result_string(result, &text);
    return make_error(ErrorCode::kUnsupported, "--timeline: {} failed: {}", what,
                      text ? text : "unknown CUPTI error");
  };
  GEMMA4_RETURN_IF_ERROR(check(api.register_callbacks(buffer_requested, buffer_completed),
                               "cuptiActivityRegisterCallbacks"));
  for (const CUpti_ActivityKind kind : kRecordedKinds)
    GEMMA4_RETURN_IF_ERROR(check(api.enable(kind), "cuptiActivityEnable"));
  active_api.store(&api);
  return std::unique_ptr<CuptiTimeline>(new CuptiTimeline(std::move(library)));
}

CuptiTimeline::CuptiTimeline(std::unique_ptr<Library> library) : library_(std::move(library)) {}

CuptiTimeline::~CuptiTimeline() {
  for (const CUpti_ActivityKind kind : kRecordedKinds) library_->api.disable(kind);
  (void)flush();
  active_api.store(nullptr);
  const std::lock_guard lock(sink().mutex);
  sink().records.clear();
}

// Hands every buffer to buffer_completed, those still filling included.
Status CuptiTimeline::flush() {
  const CUptiResult result = library_->api.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  if (result == CUPTI_SUCCESS) return Status::ok_status();
  const char* text = nullptr;
  library_->api.result_string(result, &text);
  return make_error(ErrorCode::kInternal, "--timeline: cuptiActivityFlushAll failed: {}",
                    text ? text : "unknown CUPTI error");
}

void CuptiTimeline::begin_range() {
  {
    const std::lock_guard lock(sink().mutex);
    sink().keep = false;
  }
  if (Status flushed = flush(); !flushed.ok() && status_.ok()) status_ = flushed;
  const std::lock_guard lock(sink().mutex);
  sink().records.clear();
  sink().keep = true;
  marks_.clear();
}

void CuptiTimeline::mark_step() {
  uint64_t now = 0;
  library_->api.timestamp(&now);
  marks_.push_back(now);
}

void CuptiTimeline::end_range(std::string label) {
  mark_step();  // closes the last step
  if (Status flushed = flush(); !flushed.ok() && status_.ok()) status_ = flushed;
  std::vector<KernelLaunch> records;
  {
    const std::lock_guard lock(sink().mutex);
    sink().keep = false;
    records.swap(sink().records);
  }
  ranges_.push_back({std::move(label), split_into_steps(std::move(records), marks_)});
  marks_.clear();
}

size_t CuptiTimeline::dropped_records() const {
  const std::lock_guard lock(sink().mutex);
  return sink().dropped;
}

#else  // no CUDA: nothing to record

struct CuptiTimeline::Library {};

Expected<std::unique_ptr<CuptiTimeline>> CuptiTimeline::start() {
  return make_error(ErrorCode::kUnsupported,
                    "--timeline records CUDA kernels: this gemma4 was built without CUDA");
}

CuptiTimeline::CuptiTimeline(std::unique_ptr<Library> library) : library_(std::move(library)) {}
CuptiTimeline::~CuptiTimeline() = default;
void CuptiTimeline::begin_range() {}
void CuptiTimeline::mark_step() {}
void CuptiTimeline::end_range(std::string) {}
size_t CuptiTimeline::dropped_records() const {
  return 0;
}

#endif

}  // namespace gemma4::cli
