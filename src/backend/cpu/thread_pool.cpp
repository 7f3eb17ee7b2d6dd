#include "backend/cpu/thread_pool.h"

#include <algorithm>

namespace gemma4::backend::cpu {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::run_share(int index) {
  if (index >= shares_) return;
  const int64_t begin = n_ * index / shares_;
  const int64_t end = n_ * (index + 1) / shares_;
  if (begin < end) (*body_)(begin, end);
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    run_share(index);
    {
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) work_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t min_per_thread,
                              const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  const int64_t wanted = std::max<int64_t>(1, n / std::max<int64_t>(1, min_per_thread));
  const int shares = static_cast<int>(std::min<int64_t>(threads(), wanted));
  if (shares == 1) {
    body(0, n);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    body_ = &body;
    n_ = n;
    shares_ = shares;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_ready_.notify_all();
  run_share(0);
  std::unique_lock lock(mutex_);
  work_done_.wait(lock, [&] { return pending_ == 0; });
  body_ = nullptr;
}

}  // namespace gemma4::backend::cpu
