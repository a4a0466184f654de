// Small threading helpers shared by the native parts of nebula_ckpt.
//
// We use plain std::thread instead of OpenMP or at::parallel_for on purpose:
// the copy engine runs *concurrently* with the training step, and must not
// compete for (or be blocked by) ATen's intra-op pool, which the training
// thread uses at the same time.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <mutex>
#include <thread>
#include <vector>

namespace nebula {

// Clamp a user supplied thread count into a sane range.
inline int clamp_threads(int64_t n) {
  if (n < 1) return 1;
  if (n > 256) return 256;
  return static_cast<int>(n);
}

// A persistent FIFO pool. Threads are created once in the constructor and
// joined in the destructor (after draining every queued task), so enqueueing
// work costs a lock + notify, not a thread spawn.
class ThreadPool {
 public:
  explicit ThreadPool(int num_threads) {
    const int n = clamp_threads(num_threads);
    workers_.reserve(n);
    for (int i = 0; i < n; ++i) {
      workers_.emplace_back([this] { worker_loop(); });
    }
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) {
      if (t.joinable()) t.join();
    }
  }

  int size() const { return static_cast<int>(workers_.size()); }

  // Tasks must not throw: callers wrap their work and record errors
  // themselves (an escaping exception would std::terminate the process).
  // All or nothing: if queueing throws (out of memory), no task was queued.
  void submit_bulk(std::vector<std::function<void()>>&& tasks) {
    if (tasks.empty()) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      // Inserting at the end of a deque has no effect if it throws (the
      // elements' move constructor does not).
      queue_.insert(queue_.end(), std::make_move_iterator(tasks.begin()),
                    std::make_move_iterator(tasks.end()));
    }
    if (tasks.size() == 1) {
      cv_.notify_one();
    } else {
      cv_.notify_all();
    }
  }

 private:
  void worker_loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left to drain
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// Run fn(task_index) for task_index in [0, num_tasks) on up to num_threads
// threads (the calling thread is one of them). Threads pull indices from a
// shared counter, so uneven tasks balance themselves. The first exception
// stops the hand-out of further tasks and is rethrown in the caller after
// every thread has been joined.
//
// Used for one-shot blocking calls (crc32c, file I/O), where spawning a few
// threads is negligible next to the work and keeps the calls stateless.
template <typename Fn>
void parallel_run(int num_threads, size_t num_tasks, Fn&& fn) {
  if (num_tasks == 0) return;
  const size_t n_threads =
      std::min<size_t>(static_cast<size_t>(clamp_threads(num_threads)), num_tasks);
  if (n_threads <= 1) {
    for (size_t i = 0; i < num_tasks; ++i) fn(i);
    return;
  }

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex err_mu;

  auto body = [&]() {
    for (;;) {
      if (failed.load(std::memory_order_relaxed)) return;
      const size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= num_tasks) return;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu);
        if (!first_error) first_error = std::current_exception();
        failed.store(true, std::memory_order_relaxed);
        return;
      }
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(n_threads - 1);
  try {
    for (size_t t = 0; t + 1 < n_threads; ++t) threads.emplace_back(body);
  } catch (...) {
    // Could not spawn (e.g. thread limit): the threads we have plus the
    // caller still finish all the work below.
  }
  body();
  for (auto& t : threads) t.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace nebula
