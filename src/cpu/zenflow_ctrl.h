// ZenFlow's cross-process control block (DeepSpeed 0.19.8, csrc/adam/cpu_adam_impl.cpp): the
// training process and ZenFlow's optimizer process share one buffer (a shared-memory torch
// tensor) holding two process-shared semaphores and the hyperparameters of the next step. The
// training process writes a command and posts `cmd_ready`; the optimizer process runs the step
// and posts `done`, a counting semaphore, so a completion nobody waited for is consumed later.
//
// Linux only, as in DeepSpeed: macOS does not implement unnamed process-shared semaphores
// (sem_init fails with ENOSYS). Elsewhere every function throws std::runtime_error saying so.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mfa {
namespace zenflow {

constexpr int kMaxGroups = 1024;  // DeepSpeed's ZEN_MAX_GROUPS
constexpr int kHpPerGroup = 5;    // lr, beta1, beta2, eps, weight_decay
enum Cmd : int { kCmdStep = 0, kCmdExit = 1 };

// Whether this platform has the control block (Linux).
bool supported();
// Bytes the shared buffer must hold.
int64_t ctrl_size();
// Training process, once, before starting the optimizer process: sets up the semaphores.
void ctrl_init(uintptr_t ctrl, int num_groups);
// Training process: hand one step to the optimizer process (returns at once).
void submit(uintptr_t ctrl, int now_state, int64_t step, const std::vector<double>& lr,
            const std::vector<double>& beta1, const std::vector<double>& beta2, const std::vector<double>& eps,
            const std::vector<double>& weight_decay, const std::vector<uint8_t>& bias_correction);
// Training process: consume one completion, waiting up to timeout_s; false on time-out.
bool wait_done(uintptr_t ctrl, double timeout_s);
// Training process: ask the optimizer process's worker loop to return.
void ctrl_exit(uintptr_t ctrl);

// What the optimizer process reads for one command.
struct Command {
  int cmd;
  int now_state;
  int64_t step;
  int num_groups;
  std::vector<double> hp;               // num_groups * kHpPerGroup
  std::vector<uint8_t> bias_correction;  // num_groups
};
// Optimizer process: block until the next command.
Command wait_command(uintptr_t ctrl);
// Optimizer process: signal that the step of the last command is done, counting it and
// recording which backend ran it (so the training process can tell whose kernel did the work).
void post_done(uintptr_t ctrl, const std::string& backend);
// Steps the optimizer process has completed, and the backend name it last recorded.
int64_t steps_done(uintptr_t ctrl);
std::string backend_name(uintptr_t ctrl);

}  // namespace zenflow
}  // namespace mfa
