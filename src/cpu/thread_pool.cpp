#include "thread_pool.h"

#include <pthread.h>
#include <unistd.h>
#if defined(__linux__)
#include <sched.h>
#endif

#include <new>

#include "torch_openmp.h"

namespace mfa {

ThreadPool& ThreadPool::instance() {
  // Leaked on purpose: joining threads from a static destructor at interpreter exit can deadlock.
  static ThreadPool* pool = [] {
    auto* p = new ThreadPool();
    // A forked child (a DataLoader worker, say) inherits the pool's memory but none of its
    // threads, and perhaps a mutex another thread of the parent held at the fork: reset all of it
    // in the child, before it runs anything.
    pthread_atfork(nullptr, nullptr, [] { instance().forget_after_fork(); });
    return p;
  }();
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
  // The dead workers' handles are never touched: the child's thread library recycles their
  // descriptors, so detaching or joining one may hit a live thread of the child. Their
  // std::thread objects are kept, unused, forever (destroying a joinable one terminates).
  static auto* dead = new std::vector<std::thread>();
  for (auto& t : workers_) dead->push_back(std::move(t));
  workers_.clear();
  new (&run_mu_) std::mutex();
  new (&mu_) std::mutex();
  new (&wake_) std::condition_variable();
  new (&done_) std::condition_variable();
  generation_ = 0;
  active_ = remaining_ = 0;
  stopping_ = false;
}

void ThreadPool::grow(int workers) {
  while (static_cast<int>(workers_.size()) < workers) {
    int index = static_cast<int>(workers_.size()) + 1;
    // The worker starts from the current generation, passed in rather than read by the new
    // thread: run() may bump it before the thread first gets scheduled.
    workers_.emplace_back([this, index, gen = generation_] { worker_loop(index, gen); });
    if (!pin_cores_.empty()) apply_pin(workers_.back().native_handle(), index);
  }
}

bool ThreadPool::apply_pin(std::thread::native_handle_type thread, int index) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (pin_one_per_thread_ && index > 0) {
    const int core = pin_cores_[static_cast<size_t>(index) % pin_cores_.size()];
    if (core < 0) return true;  // a negative entry: this thread stays unpinned, as in DeepSpeed
    CPU_SET(core, &set);
  } else {
    // Thread 0 is the caller: any thread it starts later (torch's own) inherits its mask, and one
    // core would confine them all; DeepSpeed's pinned pool does not pin the caller at all.
    for (int core : pin_cores_)
      if (core >= 0) CPU_SET(core, &set);
    if (CPU_COUNT(&set) == 0) return true;
  }
  return pthread_setaffinity_np(thread, sizeof(cpu_set_t), &set) == 0;
#else
  (void)thread;
  (void)index;
  (void)pin_one_per_thread_;
  return false;  // macOS has no thread-to-core pinning (affinity tags are hints, unsupported on arm64)
#endif
}

std::vector<int> current_thread_cores() {
  std::vector<int> cores;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (pthread_getaffinity_np(pthread_self(), sizeof(cpu_set_t), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cores.push_back(c);
#endif
  return cores;
}

bool ThreadPool::pin(const std::vector<int>& cores, bool one_per_thread) {
#if defined(__linux__)
  if (cores.empty()) return true;
  for (int core : cores)
    if (core >= CPU_SETSIZE) return false;  // negative entries mean "leave unpinned" (apply_pin)
  std::lock_guard<std::mutex> serial(run_mu_);  // no run() in flight while threads move
  pin_cores_ = cores;
  pin_one_per_thread_ = one_per_thread;
  bool ok = apply_pin(pthread_self(), 0);
  for (size_t i = 0; i < workers_.size(); ++i) ok = apply_pin(workers_[i].native_handle(), static_cast<int>(i) + 1) && ok;
  return ok;
#else
  (void)cores;
  (void)one_per_thread;
  return false;
#endif
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
