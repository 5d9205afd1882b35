"""``python -m mps_fused_adam``: versions, backends (and why the others are not available), the
SIMD path and thread count, a self-check of every available backend, and a short benchmark.
Exits non-zero if a self-check fails."""
from __future__ import annotations

import platform
import sys

import torch

from . import __version__, backend_info
from .selfcheck import all_checks, torch_agreement


def main() -> int:
    print(f"mps_fused_adam {__version__}  torch {torch.__version__}  Python {platform.python_version()}  "
          f"{platform.system()} {platform.machine()}")
    try:  # metadata only: importing deepspeed takes seconds and probes accelerators
        from importlib.metadata import version
        print(f"deepspeed {version('deepspeed')} installed (see mps_fused_adam.deepspeed.install())")
    except Exception:
        print("deepspeed: not installed")
    mps = getattr(torch.backends, "mps", None)
    print(f"MPS device: {'available' if mps is not None and mps.is_available() else 'not available'}")
    print(f"threads: {torch.get_num_threads()} (torch.get_num_threads(), followed by the CPU kernel)")
    print("\nBackends:")
    for device, info in backend_info().items():
        extra = f", SIMD {info['simd']}" if "simd" in info else ""
        print(f"  {device}: {info['backend']}{extra}")
        for reason in info["unavailable"]:
            print(f"    not used: {reason}")
    if not (mps is not None and mps.is_available()):
        print("  mps: no MPS device here; the Metal tiers run on Apple Silicon only")

    print("\nSelf-check against the reference (bound: 8 eps x max|ref|):")
    failed = 0
    for r in all_checks():
        verdict = "ok" if r.passed else "FAIL"
        failed += not r.passed
        print(f"  {verdict:4} {r.backend:18} {r.device:4} {r.dtypes:18} worst {r.worst_in_eps:.3g} eps"
              f"{'  (bit-exact)' if r.bit_exact else ''}")
    if failed:
        print(f"\n{failed} self-check(s) FAILED")
        return 1
    a = torch_agreement()
    print(f"\nThe contract against torch.optim.AdamW (fp32, 100 steps, 100K params): {a['identical']:.1%} "
          f"bit-identical, mean {a['mean_ulps']:.2f} ulps, largest difference {a['max_in_eps']:.3g} eps x max|p|")

    print("\nShort benchmark (python -m mps_fused_adam.bench for the full one):")
    from .bench import main as bench_main
    return bench_main(["--quick", "--threads", str(torch.get_num_threads())])


if __name__ == "__main__":
    sys.exit(main())
