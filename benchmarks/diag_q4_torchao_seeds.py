"""4-bit states on tests/test_lowbit_training.py's task, by variant (plain-torch re-statement of the rule; docs/lowbit.md, 4-bit states)."""
import sys, torch
sys.path.insert(0, __import__('os').path.join(__import__('os').path.dirname(__file__), '..', 'tests')); sys.path.insert(0, __import__('os').path.dirname(__file__))
from diag_q4_training import run, final, M4S, M4U, M8S, M8U
from test_lowbit_training import make_task, make_student, LR, STEPS
torch.set_num_threads(1)

def run_torchao(steps=STEPS, seed=1, min_size=1024):
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_4bit import OptimState4bit
    torch.manual_seed(seed)
    x, y = make_task(); model = make_student(seed); params = list(model.parameters())
    st = []
    for p in params:
        if p.numel() >= min_size:
            st.append([OptimState4bit.zeros(p.shape, True, 128), OptimState4bit.zeros(p.shape, False, 128)])
        else:
            st.append([torch.zeros_like(p), torch.zeros_like(p)])
    lr = torch.tensor(LR); step = torch.tensor(0.0); losses = []
    for t in range(steps):
        model.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); step += 1
        with torch.no_grad():
            for p, (m, v) in zip(params, st):
                single_param_adam(p.detach(), p.grad, step, m, v, None, lr, 0.9, 0.999, 0.0, 1e-8, True, False)
            losses.append(torch.nn.functional.mse_loss(model(x), y).item())
    return losses

mode = sys.argv[1]
if mode == 'torchao':
    b = final(run(None)); f = final(run_torchao())
    print(f"torchao 4-bit rule (eager, its quantizer, no clamp): {f:.4f} {f/b-1:+.1%}  (fp32 {b:.4f})")
elif mode == 'seeds':
    for steps in (300, 1000):
        for seed in range(1, 6):
            b = final(run(None, steps, seed)); e = final(run(dict(m=M8S, v=M8U, block=256, floor=True), steps, seed))
            q = final(run(dict(m=M4S, v=M4U), steps, seed))
            print(f"steps {steps} seed {seed}: fp32 {b:9.3f}  8bit {e/b-1:+7.1%}  4bit {q/b-1:+7.1%}", flush=True)
elif mode == 'maps':
    b = final(run(None))
    lin = torch.linspace(-1, 1, 16)
    lin15 = torch.cat([torch.linspace(-1, 0, 8)[:-1], torch.linspace(0, 1, 9)])
    for name, cfg in {'m signed linear 16 (no exact zero)': dict(m=lin, v=M4U),
                      'm signed linear with zero (7 neg, 0, 8 pos)': dict(m=lin15, v=M4U),
                      'm 4-bit block 16': dict(m=M4S, v=M4U, block=16),
                      'm 8-bit map + v 4-bit': dict(m=M8S, v=M4U)}.items():
        f = final(run(cfg)); print(f"{name:50s} {f:10.4f} {f/b-1:+.1%}", flush=True)
