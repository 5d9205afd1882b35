"""Hugging Face ``Trainer`` with our optimizers, as a user passes them: a tiny Llama built from a
config (nothing downloaded), a few steps on CPU, each run beside ``torch.optim.AdamW`` (or the
class ours stands in for) under the same seed.

What is checked: the losses and the final weights against torch's optimizer; a resume from a
checkpoint bit for bit equal to the run that was not interrupted; Trainer's own param groups
(``optimizer_cls_and_kwargs``: no decay on norms and biases) reaching our optimizer; and
``step_in_backward=True``: bit for bit the plain step with ``max_grad_norm=0`` (the logged
``grad_norm`` the true one), a clear error with ``max_grad_norm > 0`` and with gradient
accumulation. The Trainer + DeepSpeed path runs in a subprocess without a compiler
(``test_trainer_deepspeed_install``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import integration_support as integration

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = integration.require("transformers")
integration.require("accelerate")

import mps_fused_adam as mfa  # noqa: E402
from mps_fused_adam.optimizers import consumed_grads  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "support" / "deepspeed_support"))
import dsenv  # noqa: E402

STEPS, BATCH, SEQ, VOCAB = 6, 4, 16, 96


def tiny_llama(seed: int = 0, bias: bool = True) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_bias=bias, mlp_bias=bias, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences; the label is the input (causal LM)."""

    def __init__(self, n: int = BATCH * STEPS * 2, seed: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def args(out: Path, **kw) -> "transformers.TrainingArguments":
    base = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3,
                lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, weight_decay=0.0,
                max_grad_norm=1.0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def fit(out: Path, make_opt=None, resume: str | None = None, model: torch.nn.Module | None = None, **kw):
    """Train and return (model, trainer, losses, grad_norms logged by Trainer)."""
    model = tiny_llama() if model is None else model
    extra = {}
    if make_opt is not None:
        extra["optimizers"] = (make_opt(model), None)
    trainer = transformers.Trainer(model=model, args=args(out, **kw), train_dataset=Tokens(), **extra)
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return model, trainer, [h["loss"] for h in logs], [h.get("grad_norm") for h in logs]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps process-wide state (the gradient accumulation flag among it)."""
    from accelerate.state import AcceleratorState, GradientState
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# Ours and the reference, each a callable model -> optimizer, with the tolerance of the run.
def _ours_adamw(m):
    return mfa.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)


def _torch_adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)


def assert_close_run(model, ref, lr: float) -> None:
    """Two runs that differ by rounding only. The numeric contract bounds one step against a
    reference at 8 eps x max|p|; over a run, where each step's gradients follow the weights and
    Adam divides by sqrt(v) + eps (large for the tiniest gradients), rounding differences grow.
    The bound: a thousandth of one step's movement (lr) per step; a wrong update, a lost step or
    a sign flip of Lion moves a weight by about lr or more."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        diff = (p - q).abs().max().item()
        assert diff <= STEPS * 1e-3 * lr, (name, diff)


def test_trainer_adamw_against_torch_adamw(tmp_path):
    """Six steps with Trainer's default clipping: ours and torch's AdamW differ by rounding only."""
    mine, _, loss_a, norm_a = fit(tmp_path / "a", _ours_adamw)
    ref, _, loss_b, norm_b = fit(tmp_path / "b", _torch_adamw)
    assert len(loss_a) == STEPS and loss_a[-1] < loss_a[0]
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    assert norm_a == pytest.approx(norm_b, rel=1e-4)
    assert_close_run(mine, ref, 3e-3)


def test_trainer_lion_against_lion_pytorch(tmp_path):
    lion_pytorch = pytest.importorskip("lion_pytorch")
    mine, _, loss_a, _ = fit(tmp_path / "a", lambda m: mfa.Lion(m.parameters(), lr=3e-4, weight_decay=0.1))
    ref, _, loss_b, _ = fit(tmp_path / "b", lambda m: lion_pytorch.Lion(m.parameters(), lr=3e-4, weight_decay=0.1))
    assert loss_a[-1] < loss_a[0]
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    assert_close_run(mine, ref, 3e-4)


def test_trainer_adamw8bit_tracks_torch_adamw(tmp_path):
    """8-bit moments: not bit-identical to fp32 AdamW by design. The loss curve follows it (within
    1% per step over six steps) and the weights move the same way."""
    start = weights(tiny_llama())
    mine, trainer, loss_a, _ = fit(tmp_path / "a", lambda m: mfa.AdamW8bit(m.parameters(), lr=3e-3,
                                                                            weight_decay=0.01, min_8bit_size=256))
    ref, _, loss_b, _ = fit(tmp_path / "b", _torch_adamw)
    opt = trainer.optimizer.optimizer
    assert any(st["state1"].dtype == torch.uint8 for st in opt.state.values() if "state1" in st) or \
        any(t.dtype == torch.uint8 for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    assert loss_a == pytest.approx(loss_b, rel=1e-2)
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
        moved_a, moved_b = p.detach() - start[name], q.detach() - start[name]
        cos = torch.nn.functional.cosine_similarity(moved_a.flatten(), moved_b.flatten(), dim=0).item()
        assert cos > 0.95, (name, cos)


@pytest.mark.parametrize("make_opt", [_ours_adamw,
                                      lambda m: mfa.AdamW8bit(m.parameters(), lr=3e-3, min_8bit_size=256),
                                      lambda m: mfa.Lion(m.parameters(), lr=3e-4, weight_decay=0.1)],
                         ids=["AdamW", "AdamW8bit", "Lion"])
def test_trainer_resume_is_bit_identical(tmp_path, make_opt):
    """resume_from_checkpoint at step 3 of 6 ends on the weights of the uninterrupted run, bit for
    bit: the optimizer state Trainer saved (torch.save, loaded with weights_only=True) and the
    scheduler come back exactly."""
    whole, _, losses, _ = fit(tmp_path / "whole", make_opt)
    fit(tmp_path / "part", make_opt, save_strategy="steps", save_steps=3, max_steps=3)
    # The second half: a fresh model (its weights come from the checkpoint) and a fresh optimizer.
    resumed, trainer, losses_b, _ = fit(tmp_path / "part", make_opt, resume=str(tmp_path / "part" / "checkpoint-3"))
    assert trainer.state.global_step == STEPS
    assert losses_b == losses  # the first three come back with the checkpoint's trainer state
    assert_bit_identical(weights(whole), weights(resumed))


def test_trainer_param_groups_no_decay_on_norms_and_biases(tmp_path):
    """optimizer_cls_and_kwargs: Trainer builds its two groups (weight decay on matrices, none on
    norms and biases) and our class; the run matches torch's AdamW built the same way."""
    model = tiny_llama()
    trainer = transformers.Trainer(model=model, args=args(tmp_path / "a", weight_decay=0.1),
                                   train_dataset=Tokens(), optimizer_cls_and_kwargs=(mfa.AdamW, {"lr": 3e-3}))
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert type(opt) is mfa.AdamW
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}
    assert set(decay) == {0.1, 0.0}
    assert decay[0.0] and all(("norm" in n or n.endswith(".bias")) for n in decay[0.0]), decay[0.0]
    assert all("norm" not in n and not n.endswith(".bias") for n in decay[0.1])
    assert any(n.endswith(".bias") for n in decay[0.0]) and any("norm" in n for n in decay[0.0])
    ref = tiny_llama()
    ref_trainer = transformers.Trainer(model=ref, args=args(tmp_path / "b", weight_decay=0.1),
                                       train_dataset=Tokens(), optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 3e-3}))
    ref_trainer.train()
    assert_close_run(model, ref, 3e-3)


# ---- step_in_backward under Trainer ------------------------------------------------------------

@pytest.mark.parametrize("cls,kw", [(mfa.AdamW, {"weight_decay": 0.01}), (mfa.AdamW8bit, {"min_8bit_size": 256})],
                         ids=["AdamW", "AdamW8bit"])
def test_trainer_step_in_backward_is_the_plain_step(tmp_path, cls, kw):
    """With max_grad_norm=0 (no clipping) step_in_backward is bit for bit the plain step, and the
    grad_norm Trainer logs (it calls clip_grad_norm_(params, inf) for it) is the true one, not 0."""
    plain, _, loss_a, norm_a = fit(tmp_path / "a", lambda m: cls(m.parameters(), lr=3e-3, **kw), max_grad_norm=0.0)
    hooked, trainer, loss_b, norm_b = fit(
        tmp_path / "b", lambda m: cls(m.parameters(), lr=3e-3, step_in_backward=True, **kw), max_grad_norm=0.0)
    assert loss_a == loss_b
    assert norm_b == pytest.approx(norm_a, rel=1e-6) and min(norm_b) > 0
    assert_bit_identical(weights(plain), weights(hooked))
    opt = trainer.optimizer.optimizer
    assert consumed_grads.grad_norm(opt).item() == pytest.approx(norm_a[-1], rel=1e-6)


def test_trainer_step_in_backward_refuses_clipping(tmp_path):
    """Trainer's default max_grad_norm=1.0 would clip gradients the hooks already stepped and
    freed: a clear error at the first step, not a logged grad_norm of 0."""
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm=1.0.*already stepped and freed.*"
                                           r"step_in_backward=True.*max_grad_norm=0"):
        fit(tmp_path, lambda m: mfa.AdamW(m.parameters(), lr=3e-3, step_in_backward=True), max_grad_norm=1.0)


def test_trainer_step_in_backward_refuses_gradient_accumulation(tmp_path):
    with pytest.raises(RuntimeError, match=r"gradient accumulation.*gradient_accumulation_steps=1"):
        fit(tmp_path, lambda m: mfa.AdamW(m.parameters(), lr=3e-3, step_in_backward=True), max_grad_norm=0.0,
            gradient_accumulation_steps=2)


# ---- Trainer + DeepSpeed through install() -----------------------------------------------------

DS_SCRIPT = r"""
import json, os, sys
import mps_fused_adam.deepspeed
mps_fused_adam.deepspeed.install()
import torch, transformers
sys.path[:0] = [os.environ["MFA_TEST_DIR"], os.path.join(os.environ["MFA_TEST_DIR"], "support")]
import test_integration_hf as t
ds_config = {"train_micro_batch_size_per_gpu": t.BATCH, "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "train_batch_size": "auto",
             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
model, trainer, losses, _ = t.fit(sys.argv[1], deepspeed=ds_config, use_cpu=False, max_grad_norm=0.0,
                                  weight_decay=0.01)
print("MFA-RESULT", json.dumps({"losses": losses, "calls": mps_fused_adam.deepspeed.kernel_calls(),
                                "optimizer": type(trainer.optimizer.optimizer).__name__}))
"""


def test_trainer_deepspeed_install(tmp_path):
    """Trainer with a DeepSpeed config (ZeRO-2, optimizer offload) after install(): DeepSpeed's
    CPU Adam runs our kernel, nothing is compiled, and the losses follow the plain Trainer run
    with torch's AdamW."""
    dsenv.require_deepspeed()
    import json
    env = dsenv.no_compiler_env(tmp_path, MFA_TEST_DIR=str(Path(__file__).resolve().parent), HF_HUB_OFFLINE="1",
                                DS_ACCELERATOR="cpu", ACCELERATE_USE_DEEPSPEED="true")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    run = dsenv.run_python(["-c", DS_SCRIPT, str(tmp_path / "ds")], env, timeout=300)
    line = [x for x in run.stdout.splitlines() if x.startswith("MFA-RESULT ")]
    assert line, run.stdout + run.stderr
    got = json.loads(line[-1].split(" ", 1)[1])
    assert got["optimizer"] == "DeepSpeedZeroOptimizer"
    assert got["calls"].get("adam_update:cpu") == STEPS, got["calls"]
    assert dsenv.extensions_built(tmp_path) == []
    _, _, ref, _ = fit(tmp_path / "ref", _torch_adamw, max_grad_norm=0.0)
    assert got["losses"] == pytest.approx(ref, rel=1e-4)
