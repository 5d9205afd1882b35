#include "thread_pool.h"

#include <unistd.h>

#include <new>

#include "torch_openmp.h"

namespace mfa {

ThreadPool& ThreadPool::instance() {
  // Leaked on purpose: joining threads from a static destructor at interpreter exit can deadlock.
  static ThreadPool* pool = new ThreadPool();
  return *pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::forget_after_fork() {
  // A forked child (a DataLoader worker, say) inherits the pool's memory but not its threads:
  // drop the dead handles (without joining) and start afresh.
  for (auto& t : workers_) t.detach();
  workers_.clear();
  new (&mu_) std::mutex();
  new (&wake_) std::condition_variable();
  new (&done_) std::condition_variable();
  generation_ = 0;
  active_ = remaining_ = 0;
}

void ThreadPool::grow(int workers) {
  while (static_cast<int>(workers_.size()) < workers) {
    int index = static_cast<int>(workers_.size()) + 1;
    // The worker starts from the current generation, passed in rather than read by the new
    // thread: run() may bump it before the thread first gets scheduled.
    workers_.emplace_back([this, index, gen = generation_] { worker_loop(index, gen); });
  }
}

void ThreadPool::worker_loop(int index, uint64_t seen) {
  for (;;) {
    Task task;
    void* ctx;
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (index >= active_) continue;
      task = task_;
      ctx = ctx_;
    }
    task(ctx, index);
    std::lock_guard<std::mutex> lk(mu_);
    if (--remaining_ == 0) done_.notify_one();
  }
}

void ThreadPool::run(int n, Task task, void* ctx) {
  if (n <= 1) {
    task(ctx, 0);
    return;
  }
  // torch's own OpenMP threads where they can be borrowed (torch_openmp.h says why).
  if (run_on_torch_openmp(n, task, ctx)) return;
  std::lock_guard<std::mutex> serial(run_mu_);
  long pid = static_cast<long>(getpid());
  if (owner_pid_ != pid) {
    if (owner_pid_ != 0) forget_after_fork();
    owner_pid_ = pid;
  }
  grow(n - 1);
  {
    std::lock_guard<std::mutex> lk(mu_);
    task_ = task;
    ctx_ = ctx;
    active_ = n;
    remaining_ = n - 1;
    ++generation_;
  }
  wake_.notify_all();
  task(ctx, 0);
  std::unique_lock<std::mutex> lk(mu_);
  done_.wait(lk, [&] { return remaining_ == 0; });
}

}  // namespace mfa
