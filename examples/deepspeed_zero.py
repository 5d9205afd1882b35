"""Train a small model with DeepSpeed ZeRO on mps_fused_adam's prebuilt AdamW, Lion or Adagrad kernels.

    python examples/deepspeed_zero.py --stage 2 --offload-optimizer
    python examples/deepspeed_zero.py --stage 3 --offload-optimizer --offload-param --bf16
    python examples/deepspeed_zero.py --optimizer lion --stage 1
    python examples/deepspeed_zero.py --optimizer adagrad --stage 2 --offload-optimizer

Runs on MPS when present, else on the CPU. As one process without a launcher,
``mps_fused_adam.deepspeed.install()`` sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT for a single process (none of them was set); under a launcher it uses theirs:

    deepspeed --num_gpus 1 examples/deepspeed_zero.py --stage 2
    torchrun --nproc_per_node 2 examples/deepspeed_zero.py --stage 3   # two ranks, one Mac GPU

On a Mac every local rank runs on the one MPS device (``mps:0``), and the ranks talk over gloo
with MPS tensors staged through the CPU. (Launcher and MPS runs are untested on Apple hardware.)
DeepSpeed builds its own optimizer from the config (``FusedAdam``/``FusedLion``, or
``DeepSpeedCPUAdam``/``DeepSpeedCPULion``/``DeepSpeedCPUAdagrad`` with optimizer offload; Adagrad
without offload is ``torch.optim.Adagrad``, which needs no kernel); after
``mps_fused_adam.deepspeed.install()`` their kernels are ours and nothing is JIT-compiled. The
script prints the loss per step and, at the end, which optimizer class DeepSpeed built and which
of our kernels ran how often.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings


# --optimizer -> (DeepSpeed config type, default learning rate, other params)
OPTIMIZERS = {
    "adamw": ("AdamW", 1e-2, {"weight_decay": 0.01}),
    # Lion moves every element by +-lr per step: its learning rates are 3-10x below AdamW's.
    "lion": ("Lion", 1e-3, {"betas": [0.9, 0.99], "weight_decay": 0.01}),
    "adagrad": ("Adagrad", 1e-2, {"weight_decay": 0.0}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                        help="the config's optimizer type (default adamw)")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    parser.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: optimizer states on the CPU")
    parser.add_argument("--offload-param", action="store_true", help="stage 3 only: parameters on the CPU")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: 1e-2 for adamw and adagrad, 1e-3 for lion)")
    parser.add_argument("--hidden", type=int, default=256, help="width of the model's two hidden layers (default 256)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args()
    if args.offload_param and args.stage != 3:
        parser.error("--offload-param needs --stage 3")
    if args.offload_optimizer and args.stage == 0:
        parser.error("--offload-optimizer needs ZeRO stage 1, 2 or 3")

    # ZeRO calls torch.distributed's all_gather_into_tensor and reduce_scatter_tensor, which torch
    # 2.13 marks deprecated with a FutureWarning at every step; harmless here, and DeepSpeed's to
    # change. Only these two messages are silenced, and only in this script.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")

    import torch

    import mps_fused_adam.deepspeed as mfd

    # Before deepspeed.initialize; safe whether or not deepspeed was imported. Without a launcher
    # it sets the single-process rendezvous variables (report["env_set"]).
    report = mfd.install()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if report["env_set"]:
        print("no launcher: install() set " + ", ".join(f"{k}={v}" for k, v in sorted(report["env_set"].items())))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, 10))
    opt_type, default_lr, opt_params = OPTIMIZERS[args.optimizer]
    lr = default_lr if args.lr is None else args.lr
    zero = {"stage": args.stage}
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if args.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 32,
        "optimizer": {"type": opt_type, "params": {"lr": lr, **opt_params}},
        "zero_optimization": zero,
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10**9,
    }
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    print(f"rank {rank} of {world}, accelerator: {report['accelerator']}, device: {engine.device}, "
          f"optimizer {opt_type} (lr {lr}), ZeRO stage {args.stage}, "
          f"offload optimizer: {args.offload_optimizer}, offload params: {args.offload_param}, "
          f"{'bf16' if args.bf16 else 'fp32'}")

    # A fixed random classification task, so the loss visibly falls.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    x, y = x.to(engine.device), y.to(engine.device)
    if args.bf16:
        x = x.to(torch.bfloat16)
    for step in range(1, args.steps + 1):
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}")
    seconds = time.perf_counter() - t0

    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    basic = engine.optimizer
    classes = (FusedAdam, DeepSpeedCPUAdam, FusedLion, DeepSpeedCPULion, DeepSpeedCPUAdagrad, torch.optim.Adagrad)
    while not isinstance(basic, classes) and hasattr(basic, "optimizer"):
        basic = basic.optimizer
    import mps_fused_adam.backends as backends

    if rank == 0:
        print(f"DeepSpeed optimizer: {type(basic).__module__}.{type(basic).__name__}")
        print("mps_fused_adam kernels that ran (facade:backend -> calls): "
              + (", ".join(f"{k} -> {n}" for k, n in sorted(mfd.kernel_calls().items()))
                 or "none (torch's own optimizer)"))
        print(f"backends: {backends.backend_info()}")
        print(f"{seconds:.2f} s from deepspeed.initialize to step {args.steps}")
    engine.destroy()
    # Every rank leaves the process group together: a rank that exits while gloo's threads still
    # serve the group can abort ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Then leave without interpreter finalization. DeepSpeed keeps its process groups referenced,
    # so their gloo worker threads outlive destroy_process_group(), and one that drops a tensor
    # while the interpreter is being torn down aborts the process (the same message; seen under
    # load in about 1 run in 4 on the 2-core machine with torch 2.13, the worker thread in
    # ProcessGroupGloo::runLoop; pytorch/pytorch#190489 and #179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
