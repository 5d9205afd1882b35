"""Run DeepSpeed ZeRO configurations on our kernels and on a plain-torch reference; print JSON.

Used by tests/test_deepspeed_zero.py in a subprocess (importing DeepSpeed is slow, so one
process runs many configurations; the process environment carries no compiler and no ninja,
which proves nothing is JIT-built). Also usable by hand:

    PYTHONPATH=python python tests/support/deepspeed_support/zero_runner.py s2-off:fp32 s3:bf16

Each argument is ``<config>:<dtype>[:<optimizer>]`` with config one of CONFIGS and optimizer one of
OPTIMIZERS (default ``adamw``), or ``grads-<config>:<dtype>`` (GRAD_STEPS AdamW steps on a fixed
global batch of GLOBAL_BATCH samples split over the ranks; reports the full reduced gradient of
every parameter after each backward and the full parameters at the end, for comparison with one
process on the whole batch). World size and rank come from the usual RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT variables (1 process when unset). The last line of stdout is one JSON
object: per configuration, the losses of DeepSpeed and of the reference, a control run with half
the learning rate, the optimizer class DeepSpeed built, which kernels ran, and the seconds from
``deepspeed.initialize`` to the end of the fifth step.

With MFA_PSEUDO_MPS=1 the runner enters pseudo-MPS mode (pseudo_mps.py) before importing
DeepSpeed, imports DeepSpeed before ``install()`` (as most users do), and also reports the
accelerator, the engine's device and the order of synchronisations and kernel calls.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

STEPS = 5
MICRO_BATCH = 8
GRAD_STEPS = 3
GLOBAL_BATCH = 16
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01

# optimizer -> (DeepSpeed config type, its params, the reference's factory(params, lr)).
# Lion moves every element by +-lr, a larger step than Adam at the same learning rate, but a smaller
# one would leave its half-learning-rate control too close for the bf16 tolerance; the betas are the
# lion_pytorch defaults. Adagrad's eps is DeepSpeedCPUAdagrad's and torch's default.
LION_LR, LION_BETAS = 1e-2, (0.9, 0.99)
ADAGRAD_LR, ADAGRAD_EPS = 1e-2, 1e-10


class ReferenceLion(torch.optim.Optimizer):
    """Lion as the package's reference states it (mps_fused_adam.numerics.reference.reference_lion_)."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        from mps_fused_adam.numerics.contract import LionHyper
        from mps_fused_adam.numerics.reference import reference_lion_
        for group in self.param_groups:
            hp = LionHyper(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                           weight_decay=group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                reference_lion_(p, p.grad, state["exp_avg"], hp)


OPTIMIZERS = {
    "adamw": ("AdamW", {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
              lambda params, lr: torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD)),
    "lion": ("Lion", {"lr": LION_LR, "betas": list(LION_BETAS), "weight_decay": WD},
             lambda params, lr: ReferenceLion(params, lr=lr, betas=LION_BETAS, weight_decay=WD)),
    "adagrad": ("Adagrad", {"lr": ADAGRAD_LR, "eps": ADAGRAD_EPS, "weight_decay": WD},
                lambda params, lr: torch.optim.Adagrad(params, lr=lr, eps=ADAGRAD_EPS, weight_decay=WD)),
}

# name -> (ZeRO stage, offload_optimizer to CPU, offload_param to CPU)
CONFIGS = {
    "s0": (0, False, False),
    "s1": (1, False, False),
    "s1-off": (1, True, False),
    "s2": (2, False, False),
    "s2-off": (2, True, False),
    "s3": (3, False, False),
    "s3-off": (3, True, False),
    "s3-off-param": (3, True, True),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def make_data(world_size: int, steps: int = STEPS):
    """``steps`` global batches of world_size * MICRO_BATCH samples; rank r trains on slice r."""
    g = torch.Generator().manual_seed(99)
    xs = torch.randn(steps, world_size * MICRO_BATCH, 16, generator=g)
    ys = torch.randn(steps, world_size * MICRO_BATCH, 4, generator=g)
    return xs, ys


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def ds_config(stage: int, off_opt: bool, off_param: bool, dtype: str, optimizer: str = "adamw") -> dict:
    zero = {"stage": stage}
    if stage == 3:
        # Partition even these tiny tensors, so stage 3 really gathers and scatters them.
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0,
                    stage3_prefetch_bucket_size=0)
    if off_opt:
        zero["offload_optimizer"] = {"device": "cpu"}
    if off_param:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": OPTIMIZERS[optimizer][0], "params": dict(OPTIMIZERS[optimizer][1])},
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def reference_losses(dtype: str, rank: int, world_size: int, lr: float | None = None, initial_zero_step: bool = False,
                     optimizer: str = "adamw") -> list:
    """The same model and data with the reference optimizer (torch.optim.AdamW, the package's
    reference Lion, torch.optim.Adagrad); bf16 keeps fp32 master weights as ZeRO does.

    In bf16, DeepSpeed casts the model to bf16 before it creates the fp32 master weights, so the
    masters start from bf16-rounded values; so do the reference's. ``initial_zero_step`` mimics
    DeepSpeed's ``FP16_Optimizer`` (ZeRO stage 0 with bf16), which initializes the optimizer
    states by a real ``step()`` on all-zero gradients: weight decay is applied once and the step
    count advances before training starts.

    Data parallelism averages the ranks' gradients, which equals one process on the global batch
    (equal slices); the loss reported is this rank's slice, as DeepSpeed's engine reports it.
    """
    master = make_model()
    if dtype == "bf16":
        with torch.no_grad():
            for m in master.parameters():
                m.copy_(m.to(torch.bfloat16))
    if lr is None:
        lr = OPTIMIZERS[optimizer][1]["lr"]
    opt = OPTIMIZERS[optimizer][2](master.parameters(), lr)
    if initial_zero_step:
        for m in master.parameters():
            m.grad = torch.zeros_like(m)
        opt.step()
    xs, ys = make_data(world_size)
    losses = []
    for step in range(STEPS):
        work = make_model().to(torch.bfloat16) if dtype == "bf16" else master
        if dtype == "bf16":
            with torch.no_grad():
                for w, m in zip(work.parameters(), master.parameters()):
                    w.copy_(m)
        x = xs[step].to(torch.bfloat16) if dtype == "bf16" else xs[step]
        out = work(x)
        sl = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
        losses.append(loss_fn(out[sl], ys[step][sl]).item())
        opt.zero_grad()
        loss_fn(out, ys[step]).backward()
        if dtype == "bf16":
            for w, m in zip(work.parameters(), master.parameters()):
                m.grad = w.grad.float()
        opt.step()
    return losses


def _flat(t) -> list:
    return t.detach().float().reshape(-1).tolist()


def run_grads(name: str, dtype: str, rank: int, world_size: int) -> dict:
    """GRAD_STEPS steps on GLOBAL_BATCH samples per step, this rank's share of each; the full
    reduced gradients after every backward and the full parameters after the last step."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    stage, off_opt, off_param = CONFIGS[name]
    model = make_model()
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(GRAD_STEPS, GLOBAL_BATCH, 16, generator=g)
    ys = torch.randn(GRAD_STEPS, GLOBAL_BATCH, 4, generator=g)
    share = GLOBAL_BATCH // world_size
    sl = slice(rank * share, (rank + 1) * share)
    config = ds_config(stage, off_opt, off_param, dtype)
    config["train_micro_batch_size_per_gpu"] = share
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    names = [n for n, _ in engine.module.named_parameters()]
    grads = []
    for step in range(GRAD_STEPS):
        x = xs[step][sl].to(engine.device)
        if dtype == "bf16":
            x = x.to(torch.bfloat16)
        engine.backward(loss_fn(engine(x), ys[step][sl].to(engine.device)))
        grads.append({n: _flat(safe_get_full_grad(p)) for n, p in engine.module.named_parameters()})
        engine.step()
    params = {n: _flat(safe_get_full_fp32_param(p)) for n, p in engine.module.named_parameters()}
    device = str(engine.device)
    engine.destroy()
    return {"config": "grads-" + name, "dtype": dtype, "rank": rank, "world_size": world_size, "device": device,
            "names": names, "grads": grads, "params": params}


def _pseudo_mps_logging() -> None:
    """Pseudo-MPS mode: log the kernel calls next to the synchronisations (pseudo_mps.LOG)."""
    import pseudo_mps
    from mps_fused_adam.deepspeed.ops import CPU_ADAM_OP, FUSED_ADAM_OP

    def logged(fn, tag):
        def call(*args, **kwargs):
            pseudo_mps.LOG.append(tag)
            return fn(*args, **kwargs)
        return call

    if not getattr(CPU_ADAM_OP, "_logged", False):
        CPU_ADAM_OP.adam_update = logged(CPU_ADAM_OP.adam_update, "adam")
        FUSED_ADAM_OP.multi_tensor_adam = logged(FUSED_ADAM_OP.multi_tensor_adam, "adam")
        CPU_ADAM_OP._logged = True


def kernel_owner(basic) -> bool:
    """Whether DeepSpeed's optimizer object calls our facade (and not a DeepSpeed kernel)."""
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    from mps_fused_adam.deepspeed.ops import CPU_ADAM_OP, FUSED_ADAM_OP
    from mps_fused_adam.deepspeed.rule_ops import CPU_ADAGRAD_OP, CPU_LION_OP, FUSED_LION_OP
    if type(basic) is DeepSpeedCPUAdam:
        return basic.ds_opt_adam is CPU_ADAM_OP
    if type(basic) is FusedAdam:
        return basic.multi_tensor_adam == FUSED_ADAM_OP.multi_tensor_adam
    if type(basic) is DeepSpeedCPULion:
        return basic.ds_opt_lion is CPU_LION_OP
    if type(basic) is FusedLion:
        return basic.multi_tensor_lion == FUSED_LION_OP.multi_tensor_lion
    if type(basic) is DeepSpeedCPUAdagrad:
        return basic.ds_opt_adagrad is CPU_ADAGRAD_OP
    return False


def basic_optimizer_classes() -> tuple:
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    return (FusedAdam, DeepSpeedCPUAdam, FusedLion, DeepSpeedCPULion, DeepSpeedCPUAdagrad)


def run_one(name: str, dtype: str, rank: int, world_size: int, opt_name: str = "adamw") -> dict:
    import deepspeed

    import mps_fused_adam.deepspeed as mfd

    stage, off_opt, off_param = CONFIGS[name]
    model = make_model()
    xs, ys = make_data(world_size)
    sl = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    mfd.reset_kernel_calls()
    pseudo = os.environ.get("MFA_PSEUDO_MPS") == "1"
    if pseudo:
        import pseudo_mps
        _pseudo_mps_logging()
        del pseudo_mps.LOG[:]
    t0 = time.perf_counter()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config(stage, off_opt, off_param, dtype, opt_name))
    losses = []
    for step in range(STEPS):
        x = xs[step][sl].to(engine.device)
        if dtype == "bf16":
            x = x.to(torch.bfloat16)
        loss = loss_fn(engine(x), ys[step][sl].to(engine.device))
        if pseudo:
            pseudo_mps.LOG.append("backward")
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    # See reference_losses. DeepSpeed 0.19 runs stage 0 + bf16 through FP16_Optimizer; 0.14 to
    # 0.18 through BF16_Optimizer, which takes no initial step.
    wrapper = type(engine.optimizer).__name__
    zero_step = stage == 0 and dtype == "bf16" and wrapper == "FP16_Optimizer"

    # The optimizer DeepSpeed built from the config, under whatever ZeRO / bf16 wrapper holds it.
    classes = basic_optimizer_classes()
    basic = engine.optimizer
    while not isinstance(basic, classes) and hasattr(basic, "optimizer"):
        basic = basic.optimizer
    lr = OPTIMIZERS[opt_name][1]["lr"]
    result = {
        "config": name, "dtype": dtype, "optimizer": opt_name, "rank": rank, "world_size": world_size,
        "losses": losses,
        "reference": reference_losses(dtype, rank, world_size, initial_zero_step=zero_step, optimizer=opt_name),
        # A negative control: the reference with half the learning rate. The test checks that its
        # tolerance would catch this, so a loose tolerance cannot pass a wrong optimizer.
        "control": reference_losses(dtype, rank, world_size, lr=lr / 2, initial_zero_step=zero_step,
                                    optimizer=opt_name),
        "optimizer_class": f"{type(basic).__module__}.{type(basic).__qualname__}",
        "optimizer_exact_type": type(basic) in classes,
        "kernel_is_ours": kernel_owner(basic), "kernel_calls": mfd.kernel_calls(), "seconds": seconds,
        "device": str(engine.device), "wrapper": wrapper,
    }
    if pseudo:
        result["order"] = list(pseudo_mps.LOG)
    engine.destroy()
    del engine, optimizer, basic
    return result


def main(argv: list) -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    t0 = time.perf_counter()
    if os.environ.get("MFA_PSEUDO_MPS") == "1":
        import pseudo_mps
        pseudo_mps.activate()
        import deepspeed  # before install(), as most users do: DeepSpeed auto-detects "MPS"
    import mps_fused_adam.deepspeed as mfd
    report = mfd.install()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed(dist_backend="gloo")
    setup_seconds = time.perf_counter() - t0

    results = []
    for arg in argv:
        name, dtype, *rest = arg.split(":")
        if name.startswith("grads-"):
            results.append(run_grads(name[len("grads-"):], dtype, rank, world_size))
        else:
            results.append(run_one(name, dtype, rank, world_size, *rest))
    import deepspeed.ops
    accel = get_accelerator()
    out = {"install": report, "setup_seconds": setup_seconds, "results": results,
           "compatible_ops": dict(deepspeed.ops.__compatible_ops__),
           "deepspeed": deepspeed.__version__, "accelerator_class": type(accel).__name__,
           "complete_base": getattr(accel, "mps_fused_adam_complete_base", None)}
    print("\nMFA-RESULT " + json.dumps(out), flush=True)
    # The result is out: leave without interpreter finalization, where gloo's threads can abort
    # the process ("terminate called without an active exception", pytorch/pytorch#190489; seen
    # once in CI). A barrier and destroy_process_group() here hung under pseudo-MPS.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
