"""PyTorch Lightning with our optimizers returned from ``configure_optimizers``, on CPU, beside
torch's AdamW: automatic optimization (Lightning calls ``optimizer.step(closure)``), with
gradient clipping, and manual optimization (``manual_backward`` then ``step()``).
``step_in_backward=True`` is refused with a clear error in both modes: Lightning always hands
``step()`` a closure (under manual optimization one that runs its before-step hooks and clipping),
and our ``step(closure)`` refuses closures when the hooks step; clipping after ``manual_backward``
is refused before that (the hooks already stepped)."""
from __future__ import annotations

import pytest
import torch

import integration_support as integration

L = integration.require("lightning.pytorch")

import mps_fused_adam as mfa  # noqa: E402

LR, STEPS = 3e-3, 5


class Net(L.LightningModule):
    def __init__(self, make_opt, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                       torch.nn.Linear(64, 4))
        self.make_opt = make_opt
        self.automatic_optimization = not manual
        self.losses: list[float] = []

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None
        return loss

    def configure_optimizers(self):
        return self.make_opt(self.net)


def data():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * STEPS, 16, generator=gen), torch.randint(0, 4, (8 * STEPS,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def fit(make_opt, manual: bool = False, **trainer_kw) -> Net:
    module = Net(make_opt, manual)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
    trainer.fit(module, data())
    return module


def ours(**kw):
    return lambda m: mfa.AdamW(m.parameters(), lr=LR, weight_decay=0.01, **kw)


def torch_adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def assert_close_run(a: Net, b: Net) -> None:
    """Rounding differences only: a thousandth of one step's movement (lr) per step."""
    assert len(a.losses) == STEPS and a.losses == pytest.approx(b.losses, rel=1e-5)
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p - q).abs().max().item() <= STEPS * 1e-3 * LR


@pytest.mark.parametrize("clip", [None, 0.5])
def test_automatic_optimization_closure_against_torch_adamw(clip):
    kw = {} if clip is None else {"gradient_clip_val": clip}
    assert_close_run(fit(ours(), **kw), fit(torch_adamw, **kw))


def test_manual_optimization_against_torch_adamw():
    assert_close_run(fit(ours(), manual=True), fit(torch_adamw, manual=True))


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_step_in_backward_refused(manual):
    with pytest.raises(RuntimeError, match=r"step_in_backward=True\)\.step\(closure\): refused"):
        fit(ours(step_in_backward=True), manual=manual)


def test_manual_optimization_step_in_backward_refuses_clipping():
    """Lightning's clip_gradients after manual_backward: the hooks already stepped."""
    class Clipping(Net):
        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.manual_backward(loss)
            self.clip_gradients(self.optimizers(), gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            self.optimizers().step()

    module = Clipping(ours(step_in_backward=True), manual=True)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r"already stepped and freed.*gradient_clip_val=None"):
        trainer.fit(module, data())
