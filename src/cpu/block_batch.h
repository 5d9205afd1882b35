// The block-wise low-bit drivers' shared part (adam8bit.cpp, adam4bit.cpp): the argument checks,
// a tensor's job fields, and a call's tensors as one range of blocks shared among the pool's threads.
#pragma once
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_types.h"
#include "thread_pool.h"

namespace mfa {

// Throws std::invalid_argument, its message starting with `which`, for arguments no job of
// `rule` ("adam8bit", "adam4bit": both take Adam8bitScalars) can take.
inline void check_lowbit_args(const std::string& which, const char* rule, int64_t n, int param_dtype,
                              const nanobind::bytes& scalars) {
  if (n < 0) throw std::invalid_argument(which + "negative element count");
  if (scalars.size() != sizeof(Adam8bitScalars))
    throw std::invalid_argument(which + rule + " takes a " + std::to_string(sizeof(Adam8bitScalars)) +
                                "-byte scalar struct; got " + std::to_string(scalars.size()));
  if (param_dtype < 0 || param_dtype > 2)
    throw std::invalid_argument(which + "param dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16)");
}

// One tensor of a driver call: host addresses, element count, param dtype code, scalars, key.
struct LowbitTensor {
  uintptr_t param, grad, codes1, absmax1, codes2, absmax2;
  int64_t n;
  int param_dtype;
  const nanobind::bytes* scalars;
  uint32_t sr_key;
  bool sr;
};

// A job's fields that both formats' jobs (Q8Job, Q4Job) have, from a checked tensor.
template <class Job>
Job lowbit_job(const LowbitTensor& t) {
  Job q{};
  q.param = reinterpret_cast<void*>(t.param);
  q.grad = reinterpret_cast<const void*>(t.grad);
  q.codes1 = reinterpret_cast<uint8_t*>(t.codes1);
  q.absmax1 = reinterpret_cast<float*>(t.absmax1);
  q.codes2 = reinterpret_cast<uint8_t*>(t.codes2);
  q.absmax2 = reinterpret_cast<float*>(t.absmax2);
  q.n = t.n;
  std::memcpy(&q.s, t.scalars->c_str(), sizeof q.s);
  q.sr_key = t.sr_key;
  return q;
}

// The `<rule>_step_many` lists (one entry per tensor), checked whole before anything runs: every
// list of one length, every tensor's arguments as check_lowbit_args takes them. The tensors, or
// none when they hold no element.
inline std::vector<LowbitTensor> lowbit_tensors(
    const char* rule, const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
    const std::vector<uintptr_t>& codes1, const std::vector<uintptr_t>& absmax1, const std::vector<uintptr_t>& codes2,
    const std::vector<uintptr_t>& absmax2, const std::vector<int64_t>& numels, const std::vector<int>& param_dtypes,
    const std::vector<nanobind::bytes>& scalars, const std::vector<uint32_t>& sr_keys, const std::vector<int>& sr) {
  const size_t count = params.size();
  for (size_t len : {grads.size(), codes1.size(), absmax1.size(), codes2.size(), absmax2.size(), numels.size(),
                     param_dtypes.size(), scalars.size(), sr_keys.size(), sr.size()})
    if (len != count)
      throw std::invalid_argument(std::string(rule) + "_step_many: every list has one entry per tensor (" +
                                  std::to_string(count) + "); got one of " + std::to_string(len));
  int64_t total = 0;
  std::vector<LowbitTensor> out;
  out.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    check_lowbit_args("tensor " + std::to_string(i) + ": ", rule, numels[i], param_dtypes[i], scalars[i]);
    total += numels[i];
    out.push_back({params[i], grads[i], codes1[i], absmax1[i], codes2[i], absmax2[i], numels[i], param_dtypes[i],
                   &scalars[i], sr_keys[i], sr[i] != 0});
  }
  if (total == 0) out.clear();
  return out;
}

// The param storage of a checked dtype code (0 float32, 1 float16, 2 bfloat16) and sr switch.
inline Q8Param lowbit_param(int param_dtype, bool sr) {
  return param_dtype == 0 ? Q8Param::F32 : param_dtype == 1 ? Q8Param::F16 : sr ? Q8Param::BF16SR : Q8Param::BF16;
}

// A batch of tensors as one range of blocks: thread t takes blocks [total * t / T, total * (t + 1) / T)
// of the concatenation, so small tensors share the threads instead of running one after another.
template <class Job>
struct BlockBatch {
  using Fn = void (*)(const Job&, int64_t b0, int64_t b1);
  explicit BlockBatch(int64_t block) : block(block) {}
  std::vector<Job> jobs;
  std::vector<Fn> fns;
  std::vector<int64_t> starts;  // starts[i]: index of job i's first block in the concatenation
  int64_t block;                // elements per block
  int64_t total = 0;
  int threads = 1;

  void add(const Job& job, Fn fn) {
    starts.push_back(total);
    total += (job.n + block - 1) / block;
    jobs.push_back(job);
    fns.push_back(fn);
  }
  static void run_range(void* ctx, int t) {
    const BlockBatch& b = *static_cast<const BlockBatch*>(ctx);
    const int64_t lo = b.total * t / b.threads, hi = b.total * (t + 1) / b.threads;
    size_t i = std::upper_bound(b.starts.begin(), b.starts.end(), lo) - b.starts.begin() - 1;
    for (; i < b.jobs.size() && b.starts[i] < hi; ++i) {
      const int64_t blocks = (b.jobs[i].n + b.block - 1) / b.block;
      const int64_t b0 = std::max<int64_t>(lo - b.starts[i], 0), b1 = std::min<int64_t>(hi - b.starts[i], blocks);
      if (b0 < b1) b.fns[i](b.jobs[i], b0, b1);
    }
  }
  // Runs every job with the GIL released.
  void run(int num_threads) {
    if (total == 0) return;
    // Below 32K elements per thread, waking another costs more than it saves.
    const int64_t per_thread = std::max<int64_t>(1, 32768 / block);
    threads = int(std::max<int64_t>(1, std::min<int64_t>(std::max(num_threads, 1), total / per_thread)));
    nanobind::gil_scoped_release release;
    ThreadPool::instance().run(threads, run_range, this);
  }
};

}  // namespace mfa
