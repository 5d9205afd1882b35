"""4-bit states on tests/test_lowbit_training.py's task, by variant (plain-torch re-statement of the rule; docs/lowbit.md, 4-bit states)."""
import sys, math, torch
sys.path.insert(0, __import__('os').path.join(__import__('os').path.dirname(__file__), '..', 'tests'))
from test_lowbit_training import make_task, make_student, LR, STEPS
from mps_fused_adam.numerics import lowbit, lowbit4
from mps_fused_adam.numerics.contract import AdamHyper
from mps_fused_adam.numerics.reference import adam_elements

torch.set_num_threads(1)

def nearest(xn, qmap):
    mids = (qmap[:-1] + qmap[1:]) / 2
    c = torch.searchsorted(mids, xn.contiguous())
    return torch.where(torch.isnan(xn), torch.zeros_like(c), c)

def qdq(x, qmap, block, rank1=False, floor=False):
    """quantize then dequantize x (flat) with block-wise absmax (or rank-1 for 2-D)"""
    if rank1 is not False:
        r, c = rank1
        X = x.view(r, c).abs()
        scale = torch.minimum(X.amax(1, keepdim=True), X.amax(0, keepdim=True))
        scale = scale.clamp(min=1e-30)
        xn = (x.view(r, c) / scale).reshape(-1)
        codes = nearest(xn, qmap)
        return (qmap[codes].view(r, c) * scale).reshape(-1)
    n = x.numel(); pad = (-n) % block
    xb = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    a = xb.abs().amax(1, keepdim=True)
    inv = torch.where(a == 0, torch.zeros_like(a), 1 / a)
    xn = (xb * inv).reshape(-1)
    codes = nearest(xn, qmap)
    if floor:
        codes = torch.where((codes == 0) & (xn > 0), torch.ones_like(codes), codes)
    return (qmap[codes].view(-1, block) * a).reshape(-1)[:n]

M4S, M4U = lowbit4.map4(True), lowbit4.map4(False)
M4U0 = torch.linspace(0, 1, 16)  # linear with zero
M8S, M8U = lowbit.dynamic_map(True), lowbit.dynamic_map(False)
# torchao-like/bnb-like unsigned dynamic 4-bit map (create_dynamic_map(False,3,4))
def dyn4u():
    vals=[]
    for i in range(3):
        b=torch.linspace(0.1,1,2**(i+1)+1); m=(b[:-1]+b[1:])/2; vals+= (10.0**(i-2)*m).tolist()
    vals += [0.0, 1.0]
    return torch.tensor(sorted(vals))
M4UD = dyn4u()

def run(cfg, steps=STEPS, seed=1):
    torch.manual_seed(seed)
    x, y = make_task()
    model = make_student(seed)
    params = list(model.parameters())
    st = [dict(m=torch.zeros(p.numel()), v=torch.zeros(p.numel())) for p in params]
    losses = []
    for t in range(1, steps + 1):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        hp = AdamHyper(LR, 0.9, 0.999, 1e-8, 0.0, t)
        s = lowbit.adam8bit_scalars(hp)
        with torch.no_grad():
            for i, p in enumerate(params):
                big = p.numel() >= 1024 and cfg is not None
                clip = s.clip if (big and cfg.get('clip', True)) else None
                pn, m, v = adam_elements(p.detach().reshape(-1).float(), p.grad.reshape(-1), st[i]['m'], st[i]['v'], s, clip=clip)
                if big:
                    shape = tuple(p.shape)
                    if cfg.get('m') is not None:
                        m = qdq(m, cfg['m'], cfg.get('block', 128), rank1=shape if cfg.get('rank1_m') else False)
                    if cfg.get('v') is not None:
                        v = qdq(v, cfg['v'], cfg.get('block', 128), rank1=shape if cfg.get('rank1_v') else False, floor=cfg.get('floor', False))
                st[i]['m'], st[i]['v'] = m, v
                p.copy_(pn.view(p.shape))
        with torch.no_grad():
            losses.append(torch.nn.functional.mse_loss(model(x), y).item())
    return losses

def final(l): return sum(l[-10:]) / 10

if __name__ == '__main__':
    base = final(run(None))
    cfgs = {
      'ours 4bit (m dyn4 signed, v k/16, block128, clip)': dict(m=M4S, v=M4U),
      'ours 4bit without clip': dict(m=M4S, v=M4U, clip=False),
      'only m 4-bit (v fp32)': dict(m=M4S, v=None),
      'only v 4-bit (m fp32)': dict(m=None, v=M4U),
      'v linear with zero (linspace(0,1,16))': dict(m=M4S, v=M4U0),
      'v unsigned dynamic 4-bit + floor': dict(m=M4S, v=M4UD, floor=True),
      'block 32': dict(m=M4S, v=M4U, block=32),
      'block 64': dict(m=M4S, v=M4U, block=64),
      'rank-1 v (Li et al.)': dict(m=M4S, v=M4U, rank1_v=True),
      'rank-1 m and v': dict(m=M4S, v=M4U, rank1_m=True, rank1_v=True),
      '8-bit maps block 256 (check)': dict(m=M8S, v=M8U, block=256, floor=True),
    }
    print(f"fp32 final {base:.4f}")
    for name, cfg in cfgs.items():
        f = final(run(cfg))
        print(f"{name:50s} {f:10.4f} {f/base-1:+.1%}", flush=True)
