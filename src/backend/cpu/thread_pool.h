// A fixed set of worker threads that split index ranges between them (the calling thread works
// too). The CPU backend's only source of parallelism: rows of a matmul, heads of attention.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace gemma4::backend::cpu {

class ThreadPool {
 public:
  // `threads` = total threads including the caller; 0 = one per hardware thread.
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls body(begin, end) on disjoint ranges covering [0, n), in parallel when n is at least
  // `min_per_thread` per thread. Returns when all are done. Not re-entrant.
  void parallel_for(int64_t n, int64_t min_per_thread,
                    const std::function<void(int64_t begin, int64_t end)>& body);

 private:
  void worker_loop(int index);
  void run_share(int index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
  // The current job.
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t n_ = 0;
  int shares_ = 0;
};

}  // namespace gemma4::backend::cpu
