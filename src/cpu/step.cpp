#include "step.h"

#include <algorithm>

#include "thread_pool.h"

namespace mfa {
namespace {

// Below this many elements per thread, waking another thread costs more than it saves.
constexpr int64_t kMinElementsPerThread = 1 << 15;
// Thread boundaries fall on multiples of 64 elements: whole cache lines for every dtype.
constexpr int64_t kAlign = 64;

struct StepJob {
  const std::vector<Span>* spans;
  const std::vector<int64_t>* starts;  // starts[i]: global index of spans[i]'s first element
  int64_t total;
  int threads;
  SpanFn fn;
  const void* scalars;
};

int64_t boundary(const StepJob& job, int t) {
  if (t >= job.threads) return job.total;
  // Multiply in long double: total * t may exceed 2^63 for huge totals.
  int64_t b = static_cast<int64_t>(static_cast<long double>(job.total) * t / job.threads);
  return std::min(job.total, b / kAlign * kAlign);
}

void run_range(void* ctx, int t) {
  const StepJob& job = *static_cast<const StepJob*>(ctx);
  int64_t lo = boundary(job, t), hi = boundary(job, t + 1);
  if (lo >= hi) return;
  const auto& starts = *job.starts;
  size_t i = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
  for (; i < job.spans->size() && starts[i] < hi; ++i) {
    const Span& sp = (*job.spans)[i];
    int64_t b = std::max<int64_t>(lo - starts[i], 0);
    int64_t e = std::min<int64_t>(hi - starts[i], sp.n);
    if (b < e) job.fn(sp, b, e, job.scalars);
  }
}

}  // namespace

void run_step(const std::vector<Span>& spans, SpanFn fn, const void* scalars, int threads) {
  thread_local std::vector<int64_t> starts;  // reused: no allocation once warmed up
  starts.resize(spans.size());
  int64_t total = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    starts[i] = total;
    total += spans[i].n;
  }
  if (total == 0) return;
  int64_t useful = std::max<int64_t>(1, total / kMinElementsPerThread);
  int n = static_cast<int>(std::min<int64_t>(std::max(threads, 1), useful));
  StepJob job{&spans, &starts, total, n, fn, scalars};
  ThreadPool::instance().run(n, run_range, &job);
}

}  // namespace mfa
