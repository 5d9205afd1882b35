"""4-bit states on tests/test_lowbit_training.py's task, by variant (plain-torch re-statement of the rule; docs/lowbit.md, 4-bit states)."""
import sys, torch
sys.path.insert(0, __import__('os').path.join(__import__('os').path.dirname(__file__), '..', 'tests')); sys.path.insert(0, __import__('os').path.dirname(__file__))
import diag_q4_training as diag
from diag_q4_training import final, M4S, M4U, M8S, M8U, qdq
from test_lowbit_training import make_task, make_student, LR, STEPS
from mps_fused_adam.numerics import lowbit
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import adam_elements
torch.set_num_threads(1)

def sr_qdq(x, qmap, block, gen):
    n = x.numel(); pad = (-n) % block
    xb = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    a = xb.abs().amax(1, keepdim=True); inv = torch.where(a == 0, torch.zeros_like(a), 1 / a)
    xn = (xb * inv).reshape(-1)
    lo = (torch.searchsorted(qmap, xn.contiguous(), right=True) - 1).clamp(0, len(qmap) - 2)
    vlo, vhi = qmap[lo], qmap[lo + 1]
    pr = ((xn - vlo) / (vhi - vlo)).clamp(0, 1)
    c = lo + (torch.rand(xn.shape, generator=gen) < pr).long()
    return (qmap[c].view(-1, block) * a).reshape(-1)[:n]

def run(cfg, steps=STEPS, seed=1, batch=None):
    torch.manual_seed(seed)
    x, y = make_task(); model = make_student(seed); params = list(model.parameters())
    st = [dict(m=torch.zeros(p.numel()), v=torch.zeros(p.numel())) for p in params]
    gen = torch.Generator().manual_seed(99); bgen = torch.Generator().manual_seed(7)
    losses = []
    for t in range(1, steps + 1):
        model.zero_grad()
        if batch:
            idx = torch.randint(0, 512, (batch,), generator=bgen)
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        s = lowbit.adam8bit_scalars(AdamHyper(LR, 0.9, 0.999, 1e-8, 0.0, t))
        with torch.no_grad():
            for i, p in enumerate(params):
                big = p.numel() >= 1024 and cfg is not None
                pn, m, v = adam_elements(p.detach().reshape(-1).float(), p.grad.reshape(-1), st[i]['m'], st[i]['v'], s,
                                         clip=s.clip if big else None)
                if big:
                    if cfg.get('sr_m'):
                        m = sr_qdq(m, cfg['m'], cfg.get('block', 128), gen)
                    else:
                        m = qdq(m, cfg['m'], cfg.get('block', 128))
                    v = qdq(v, cfg['v'], cfg.get('block', 128), floor=cfg.get('floor', False))
                st[i]['m'], st[i]['v'] = m, v
                p.copy_(pn.view(p.shape))
            losses.append(torch.nn.functional.mse_loss(model(x), y).item())
    return losses

b = final(run(None))
f = final(run(dict(m=M4S, v=M4U, sr_m=True)))
print(f"full batch, 4-bit with the first moment stochastically rounded (not the contract): {f/b-1:+.1%}", flush=True)
for batch in (64, 128):
    for steps in (300, 1000):
        b = final(run(None, steps, batch=batch)); e = final(run(dict(m=M8S, v=M8U, block=256, floor=True), steps, batch=batch))
        q = final(run(dict(m=M4S, v=M4U), steps, batch=batch))
        print(f"minibatch {batch}, {steps} steps: fp32 {b:8.3f}  8bit {e/b-1:+.1%}  4bit {q/b-1:+.1%}", flush=True)
