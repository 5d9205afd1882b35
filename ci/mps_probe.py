"""Does torch's MPS backend work on this machine? A small tensor on ``mps``, a matmul, a copy back,
compared with the CPU's result (small integers: every product and sum is exact in fp32, so the
two must be equal).

    python ci/mps_probe.py [--github-output FILE]

Prints one line, "torch MPS works: ..." or "torch MPS does not work: <the exact error>"; with
``--github-output`` (the hosted macOS job passes ``$GITHUB_OUTPUT``) it also writes
``works=true|false`` and ``error=...`` there, which the job's next steps read. Exits 0 either way:
the answer is the output, not the status. Stdlib and torch only.
"""
from __future__ import annotations

import argparse
import platform
from typing import Optional


def probe() -> Optional[str]:
    """None when MPS works, else what failed, verbatim."""
    try:
        import torch
        if not torch.backends.mps.is_available():
            return f"torch.backends.mps.is_available() is False (is_built() is {torch.backends.mps.is_built()})"
        a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        b = torch.arange(8, dtype=torch.float32).reshape(4, 2)
        got = (a.to("mps") @ b.to("mps")).cpu()
        want = a @ b
        if not torch.equal(got, want):
            return f"an mps matmul gave {got.tolist()} where the CPU gives {want.tolist()}"
        return None
    except Exception as exc:  # noqa: BLE001 - the error is the report
        return f"{type(exc).__name__}: {exc}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--github-output", metavar="FILE", help="append works=... and error=... here")
    args = ap.parse_args(argv)
    import torch
    where = f"torch {torch.__version__}, macOS {platform.mac_ver()[0] or '-'}, {platform.machine()}"
    error = probe()
    print(f"torch MPS works: a 3x4 @ 4x2 matmul on mps equals the CPU's ({where})" if error is None
          else f"torch MPS does not work ({where}): {error}", flush=True)
    if args.github_output:
        one_line = " | ".join((error or "").splitlines())
        with open(args.github_output, "a", encoding="utf-8") as f:
            f.write(f"works={'true' if error is None else 'false'}\nerror={one_line}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
