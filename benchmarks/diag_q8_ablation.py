"""Diagnostic (issue 12): where the CPU 8-bit kernel's time goes, by taking parts out.

Builds ``diag_q8_ablation.cpp`` (with g++, AVX-512 and VBMI: the avx512bf16 path's 8-bit kernel)
once per variant from copies of ``src/cpu/adam_kernel.h`` and ``adam8bit_kernel.h`` with one part
replaced: ``noquant`` requantizes by truncation (no table gathers), ``nodeq`` skips the block's
dequantization, ``nodiv`` replaces the division and square root by multiplies, ``none`` does all
three; ``full`` is the kernel as shipped. The replacements are timing probes, not the contract.
Each binary runs AdamW8bit's blocks (fp32 params) on its own threads, alternating with the
kernel's 8-bit memory floor on the same buffers, round by round; the variants run in turn, in
rotating order, ``--repeats`` times. Cases: every ``--threads`` count from memory (``--size``
elements), and 1 thread on 65536 elements (L2-resident: the arithmetic alone).

``python benchmarks/diag_q8_ablation.py [--threads 1 2] [--size N] [--repeats R]``"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src", "cpu")
sys.path.insert(0, os.path.join(HERE, "..", "python"))

VARIANTS = ("full", "noquant", "nodeq", "nodiv", "none")
FLAGS = ["-O3", "-std=c++20", "-ffp-contract=off", "-fno-math-errno", "-mavx512f", "-mavx512bw", "-mavx512dq",
         "-mavx512vl", "-mavx512bf16", "-mavx512vbmi", "-mavx2", "-mfma", "-mf16c", "-pthread"]

# (text in adam8bit_kernel.h, its replacement when the probe is on); each must match once.
PROBES = {
    "noquant": ("inline float from_bits(", "inline void quantize_probe(uint8_t* out, F x, const Q8Map&, bool) {\n"
                "  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(x)));\n"
                "}\n#define quantize quantize_probe\ninline float from_bits("),
    "nodeq": ("inline float from_bits(", "#define dequant_block(c, map, s, out) ((void)0)\ninline float from_bits("),
    "nodiv": ("const F denom = Vec::sqrt(v) * d2 + eps;\n    const F u = clamp(m / denom, nclip, clip);",
              "const F denom = v * d2 + eps;\n    const F u = clamp(m * denom, nclip, clip);"),
}


def patched_kernel(variant: str) -> str:
    with open(os.path.join(SRC, "adam8bit_kernel.h")) as f:
        text = f.read()
    on = VARIANTS[1:4] if variant == "none" else ((variant,) if variant != "full" else ())
    for probe in on:
        old, new = PROBES[probe]
        if text.count(old) != 1:
            raise SystemExit(f"{probe}: the kernel no longer has exactly one {old!r}; update the probe")
        text = text.replace(old, new)
    return text


def build(workdir: str) -> dict[str, str]:
    with open(os.path.join(SRC, "adam_kernel.h")) as f:
        outer = f.read()
    binaries = {}
    for v in VARIANTS:
        d = os.path.join(workdir, v)
        os.makedirs(d)
        with open(os.path.join(d, "adam8bit_kernel.h"), "w") as f:
            f.write(patched_kernel(v))
        with open(os.path.join(d, "adam_kernel.h"), "w") as f:  # its include then finds the copy
            f.write(outer)
        exe = os.path.join(d, "diag")
        subprocess.run(["g++", *FLAGS, f'-DDIAG_VARIANT="{v}"', f"-I{d}", f"-I{SRC}",
                        os.path.join(HERE, "diag_q8_ablation.cpp"), "-o", exe], check=True)
        binaries[v] = exe
    return binaries


def write_maps(path: str) -> None:
    from mps_fused_adam.numerics import lowbit
    with open(path, "wb") as f:
        for signed in (True, False):
            f.write(lowbit.dynamic_map(signed).numpy().tobytes())
            f.write(lowbit.code_midpoints(signed).numpy().tobytes())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="*", default=[1, os.cpu_count() or 1])
    ap.add_argument("--size", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=9, help="step/floor rounds inside each run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        maps = os.path.join(work, "maps.bin")
        write_maps(maps)
        exe = build(work)
        cases = [(t, args.size, args.rounds) for t in args.threads] + [(1, 65536, 2001)]
        print(f"# {platform.machine()}, {os.cpu_count()} CPUs; AdamW8bit blocks, fp32 params; median over "
              f"{args.repeats} runs per variant (rotating order) of each run's median; ns per element")
        print("| threads | elements | variant | step | 8-bit floor | speed vs floor | step minus full's |")
        print("|---|---|---|---|---|---|---|")
        for threads, n, rounds in cases:
            got: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
            for r in range(args.repeats):
                for v in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
                    out = subprocess.run([exe[v], maps, str(n), str(rounds), str(threads)], check=True,
                                         capture_output=True, text=True).stdout.split()
                    got[v].append(tuple(float(x) for x in out[1:]))
            med = {v: [statistics.median(x[i] for x in got[v]) for i in range(3)] for v in VARIANTS}
            for v in VARIANTS:
                step, floor, speed = med[v]
                print(f"| {threads} | {n} | {v} | {step:.3f} | {floor:.3f} | {speed:.2f} | "
                      f"{step - med['full'][0]:+.3f} |", flush=True)


if __name__ == "__main__":
    main()
