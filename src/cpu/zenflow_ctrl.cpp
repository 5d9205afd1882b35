#include "zenflow_ctrl.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#if defined(__linux__)
#include <semaphore.h>

#include <cerrno>
#include <ctime>
#endif

namespace mfa {
namespace zenflow {

#if defined(__linux__)
namespace {

// DeepSpeed's ZenControl with its fields in the same order, except that the hyperparameters are
// doubles (DeepSpeed stores floats): the optimizer process then derives the kernel's fp32 scalars
// from exactly the values adam_update would receive (contract.adam_scalars rounds once, from
// double), so a ZenFlow step equals an adam_update bit for bit. Only this library reads the block,
// in both processes, so its layout is private to it.
struct Control {
  sem_t cmd_ready;
  sem_t done;
  int cmd;
  int now_state;
  int64_t step;
  int num_groups;
  double hp[kMaxGroups * kHpPerGroup];
  uint8_t bias_correction[kMaxGroups];
  // Ours: a mark that ctrl_init ran (a zeroed buffer's semaphores are not initialised), the
  // optimizer process's completed-step count and the backend it ran.
  uint64_t magic;
  int64_t steps_done;
  char backend[32];
};
constexpr uint64_t kMagic = 0x6d66615a656e4631ULL;  // "mfaZenF1"

Control* checked(uintptr_t ptr) {
  if (ptr == 0) throw std::invalid_argument("ZenFlow control block: null address");
  auto* c = reinterpret_cast<Control*>(ptr);
  if (c->magic != kMagic)
    throw std::invalid_argument("ZenFlow control block: not initialised; call zenflow_adam_ctrl_init on a buffer of "
                                "zenflow_adam_ctrl_size() bytes first");
  return c;
}

}  // namespace

bool supported() { return true; }

int64_t ctrl_size() { return static_cast<int64_t>(sizeof(Control)); }

void ctrl_init(uintptr_t ptr, int num_groups) {
  if (ptr == 0) throw std::invalid_argument("ZenFlow control block: null address");
  if (num_groups < 0 || num_groups > kMaxGroups)
    throw std::invalid_argument("ZenFlow: " + std::to_string(num_groups) + " param groups; at most " +
                                std::to_string(kMaxGroups) + " are supported (as in DeepSpeed)");
  auto* c = reinterpret_cast<Control*>(ptr);
  std::memset(static_cast<void*>(c), 0, sizeof(Control));
  c->num_groups = num_groups;
  c->cmd = kCmdStep;
  if (sem_init(&c->cmd_ready, /*pshared=*/1, 0) != 0 || sem_init(&c->done, /*pshared=*/1, 0) != 0)
    throw std::runtime_error(std::string("ZenFlow: sem_init failed: ") + std::strerror(errno));
  c->magic = kMagic;
}

void submit(uintptr_t ptr, int now_state, int64_t step, const std::vector<double>& lr,
            const std::vector<double>& beta1, const std::vector<double>& beta2, const std::vector<double>& eps,
            const std::vector<double>& weight_decay, const std::vector<uint8_t>& bias_correction) {
  Control* c = checked(ptr);
  const size_t ng = lr.size();
  if (beta1.size() != ng || beta2.size() != ng || eps.size() != ng || weight_decay.size() != ng ||
      bias_correction.size() != ng)
    throw std::invalid_argument("zenflow_adam_submit: lr, beta1, beta2, eps, weight_decay and bias_correction must "
                                "have one entry per param group");
  if (static_cast<int>(ng) != c->num_groups)
    throw std::invalid_argument("zenflow_adam_submit: " + std::to_string(ng) + " param groups given, the control "
                                "block was initialised for " + std::to_string(c->num_groups));
  if (now_state != 0 && now_state != 1)
    throw std::invalid_argument("zenflow_adam_submit: now_state selects one of two buffers, 0 or 1; got " +
                                std::to_string(now_state));
  for (size_t g = 0; g < ng; ++g) {
    double* hp = c->hp + g * kHpPerGroup;
    hp[0] = lr[g];
    hp[1] = beta1[g];
    hp[2] = beta2[g];
    hp[3] = eps[g];
    hp[4] = weight_decay[g];
    c->bias_correction[g] = bias_correction[g];
  }
  c->now_state = now_state;
  c->step = step;
  c->cmd = kCmdStep;
  sem_post(&c->cmd_ready);  // release: the writes above are visible to the optimizer process
}

bool wait_done(uintptr_t ptr, double timeout_s) {
  Control* c = checked(ptr);
  // DeepSpeed's semantics: an absolute CLOCK_REALTIME deadline; time-out (or error) -> false so
  // the caller can check that the optimizer process is still alive. Clamped so that NaN, negative
  // and huge time-outs stay defined (0 = poll once).
  if (!(timeout_s > 0)) timeout_s = 0;
  if (timeout_s > 1e9) timeout_s = 1e9;
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  double whole = std::floor(timeout_s);
  deadline.tv_sec += static_cast<time_t>(whole);
  deadline.tv_nsec += static_cast<long>((timeout_s - whole) * 1e9);
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  while (sem_timedwait(&c->done, &deadline) != 0) {
    if (errno == EINTR) continue;  // a signal: keep waiting until the deadline
    return false;
  }
  return true;
}

void ctrl_exit(uintptr_t ptr) {
  Control* c = checked(ptr);
  c->cmd = kCmdExit;
  sem_post(&c->cmd_ready);
}

Command wait_command(uintptr_t ptr) {
  Control* c = checked(ptr);
  while (sem_wait(&c->cmd_ready) != 0) {
    if (errno != EINTR)  // a signal: wait on; anything else (EINVAL: a broken block) is an error
      throw std::runtime_error(std::string("ZenFlow control block: sem_wait failed: ") + std::strerror(errno));
  }
  Command out;
  out.cmd = c->cmd;
  out.now_state = c->now_state;
  out.step = c->step;
  out.num_groups = c->num_groups;
  if (out.cmd == kCmdStep) {
    out.hp.assign(c->hp, c->hp + static_cast<size_t>(out.num_groups) * kHpPerGroup);
    out.bias_correction.assign(c->bias_correction, c->bias_correction + out.num_groups);
  }
  return out;
}

void post_done(uintptr_t ptr, const std::string& backend) {
  Control* c = checked(ptr);
  std::strncpy(c->backend, backend.c_str(), sizeof(c->backend) - 1);
  c->steps_done += 1;
  sem_post(&c->done);
}

int64_t steps_done(uintptr_t ptr) { return checked(ptr)->steps_done; }

std::string backend_name(uintptr_t ptr) {
  Control* c = checked(ptr);
  return std::string(c->backend, strnlen(c->backend, sizeof(c->backend)));
}

#else  // not Linux

[[noreturn]] static void unsupported() {
  throw std::runtime_error(
      "ZenFlow's cross-process optimizer is Linux-only (as in DeepSpeed 0.19.8, whose cpu_adam op defines it "
      "only on Linux): it needs unnamed process-shared POSIX semaphores, which macOS does not implement. Use "
      "ZenFlow without overlap_step, or ZeRO-Offload without ZenFlow.");
}
bool supported() { return false; }
int64_t ctrl_size() { unsupported(); }
void ctrl_init(uintptr_t, int) { unsupported(); }
void submit(uintptr_t, int, int64_t, const std::vector<double>&, const std::vector<double>&,
            const std::vector<double>&, const std::vector<double>&, const std::vector<double>&,
            const std::vector<uint8_t>&) { unsupported(); }
bool wait_done(uintptr_t, double) { unsupported(); }
void ctrl_exit(uintptr_t) { unsupported(); }
Command wait_command(uintptr_t) { unsupported(); }
void post_done(uintptr_t, const std::string&) { unsupported(); }
int64_t steps_done(uintptr_t) { unsupported(); }
std::string backend_name(uintptr_t) { unsupported(); }

#endif

}  // namespace zenflow
}  // namespace mfa
