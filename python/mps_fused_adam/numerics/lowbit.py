"""The numeric contract of the low-bit rules: 8-bit block-wise Adam states and bf16 stochastic
rounding (host side: constants, quantization maps, per-call scalars, the random-bit hash).

Everything a kernel needs beyond the Adam contract (docs/numerics.md, version 2) is defined
here once; ``reference_lowbit.py`` states the per-element and per-block math in plain torch.

8-bit states (``AdamW8bit``/``Adam8bit``), after Dettmers et al. 2021 and bitsandbytes 0.50:

- A moment tensor of ``n`` elements is stored as ``n`` uint8 codes and ``ceil(n / 256)`` fp32
  scales (``absmax``), one per block of :data:`BLOCK` consecutive elements (the last block may be
  short). The first moment uses the signed dynamic map, the second the unsigned one
  (:func:`dynamic_map`): a code ``c`` of a block with scale ``a`` stands for ``map[c] * a``
  (one fp32 multiply). The maps and code indices are bitsandbytes' own, so states convert both ways.
- One step, per block: dequantize both moments, run the Adam v2 element math in fp32 with one
  change (the normalized step is clamped, below), compute each moment's new scale
  (``max |m|`` and ``max v`` over the block, NaN if any element is NaN), then quantize each
  element to a code with :func:`quantize` rules:
  ``x = value * inv`` with ``inv = 1 / absmax`` (one fp32 division per block; ``inv = 0`` when
  ``absmax == 0``), code = the number of code midpoints strictly below ``x`` (midpoint
  ``k`` = ``(map[k] + map[k+1]) / 2`` in fp32): the nearest code, ties to the lower code, NaN to
  code 0. For the second moment a positive ``x`` never maps to the zero code (code 1 instead), so
  a non-zero second moment is never stored as zero.
- The known hazard (checked against bitsandbytes 0.50 and an emulation of its CUDA rule): a dequantized second moment far
  below the true one makes ``m / (sqrt(v) * d2 + eps)`` explode (up to ``m / eps``). Exact Adam
  cannot exceed the Cauchy-Schwarz bound
  ``|m| * sqrt(bc2) / sqrt(v) <= (1 - beta1) * sqrt(bc2 * S_t / (1 - beta2))`` with
  ``S_t = sum_{j<t} (beta1^2 / beta2)^j``, so the 8-bit rule clamps the normalized step
  ``u = m / denom`` to ``[-clip, clip]`` with that bound times :data:`CLIP_MARGIN`
  (:func:`adam8bit_scalars`: host, double, rounded up to fp32). For fp32 Adam on exact moments the
  clamp never binds; for quantized moments it bounds every parameter change by
  ``step_size * clip`` (``clip`` is 0.1 at step 1 and tends to 7.27 for the default betas).
- Tensors of fewer than ``min_8bit_size`` (default :data:`MIN_8BIT_SIZE`) elements keep fp32
  moments and the plain Adam rule, as bitsandbytes does.

bf16 stochastic rounding (``bf16_stochastic_round=True``): the new parameter, computed in fp32,
is stored to bf16 as ``(bits(x) + r) >> 16`` with ``r`` 16 random bits (a NaN stores torch's
0x7FC0): rounded away from zero with probability (low 16 bits of x) / 65536, so the expected
stored value is x (unbiased). ``r`` is :func:`sr_bits` of the call's key (:func:`sr_key` of the
parameter's seed and the step count) and the element's index in the tensor, so results are
reproducible and independent of threads, threadgroups and backend.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from .contract import (  # noqa: F401  (the host scalars of this contract live with the others')
    ADAM8BIT_STRUCT, CLIP_MARGIN, RULES, Adam8bitScalars, Adam8bitTensorHyper, AdamHyper, AdamSRHyper,
    _f32_up, adam8bit_scalars, adam8bit_tensor_scalars, adam_sr_scalars, normalized_step_bound, pack_adam8bit,
)

BLOCK = 256
MIN_8BIT_SIZE = 4096
SIGNED_ZERO_CODE = 127  # index of 0.0 in the signed map
UNSIGNED_ZERO_CODE = 0  # index of 0.0 in the unsigned map
_M32 = 0xFFFFFFFF
BF16_NAN = 0x7FC0


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@lru_cache(maxsize=None)
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    # Dettmers' dynamic data type with 7 exponent bits in 8 bits (bitsandbytes'
    # create_dynamic_map(signed, 7, 8)): for decade i = 0..6 the fractions are the midpoints of
    # 2^i (signed) or 2^(i+1) (unsigned) equal fp32 steps of linspace(0.1, 1), scaled by 10^(i-6);
    # plus 0 and 1. The fp32 arithmetic is bitsandbytes' (torch.linspace, midpoints, scale), so the
    # 256 values equal its qmap1/qmap2 bit for bit (tests/test_lowbit.py checks against it).
    values: list[float] = []
    for i in range(7):
        count = (2 ** i if signed else 2 ** (i + 1)) + 1
        bounds = torch.linspace(0.1, 1, count, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10.0 ** (i - 6)
        values += (scale * means).tolist()
        if signed:
            values += (-scale * means).tolist()
    values += [0.0, 1.0]
    assert len(values) == 256
    values.sort()
    return torch.tensor(values, dtype=torch.float32)


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256 sorted fp32 code values: signed (first moment) or unsigned (second moment)."""
    m = _dynamic_map_cpu(bool(signed))
    return m if torch.device(device).type == "cpu" else m.to(device)


@lru_cache(maxsize=None)
def _midpoints_cpu(signed: bool) -> torch.Tensor:
    m = _dynamic_map_cpu(signed)
    return (m[:-1] + m[1:]) / 2.0  # fp32 sum, exact halving: 255 decision thresholds


def code_midpoints(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 255 fp32 thresholds between neighbouring codes (the quantizer's decision points)."""
    m = _midpoints_cpu(bool(signed))
    return m if torch.device(device).type == "cpu" else m.to(device)


def num_blocks(numel: int) -> int:
    return -(-int(numel) // BLOCK)


# The kernels' quantizer (the nearest-code search, without a search): a map's positive half is
# seven decades of equally spaced codes (DECADE_SIZES), so inside a decade the count of midpoints
# below x is an affine function of x, up to a few ulps. A kernel finds x's region (which decade,
# or below the first / above the last positive midpoint) from x's binary exponent and one
# comparison with the one region boundary (a midpoint) in that binade, evaluates the region's
# affine estimate ``f = x * a - c`` (fp32, two roundings) and corrects it against one midpoint:
# code count = ``j + (x > mid[j])`` with ``j = clamp(rint(f) - 1, jlo, jhi)``. The result is the
# contract's count of midpoints below x exactly, whatever the estimate's rounding, as long as it
# is within half a code of the truth (the CPU builder measures it: under 2e-5 for both maps).
KT_VALUES, KT_MIDS = 0, 256  # offsets in kernel_table: 256 code values, 255 midpoints, a pad
KT_A, KT_C, KT_JHI, KT_JLO = 512, 528, 544, 560  # per region (0..8, padded to 16): a, c, jhi, jlo
KT_REGION, KT_BOUNDARY = 576, 608  # per binade index (0..31): regions below it, its boundary's bits
KT_SIZE = 640
BINADE_BIAS = 96  # binade index = min(max(biased exponent, 96), 127) - 96


def decade_sizes(signed: bool) -> list[int]:
    """Codes per decade of the positive half (:func:`_dynamic_map_cpu`'s construction)."""
    return [2 ** i if signed else 2 ** (i + 1) for i in range(7)]


def _quantizer_constants(signed: bool) -> torch.Tensor:
    """The region tables of :data:`KT_A` onwards as fp32 bits (int32), for the positive half of
    the map: midpoints ``M_j`` (``j = 0..N``), the code count of x > 0 is ``#{M_j < x}``."""
    values = _dynamic_map_cpu(signed).double()
    mids = _midpoints_cpu(signed)
    zero = SIGNED_ZERO_CODE if signed else UNSIGNED_ZERO_CODE
    pos, m = values[zero + 1:255], mids[zero:]
    n_top = m.numel() - 1
    sizes = decade_sizes(signed)
    starts = [sum(sizes[:d]) for d in range(7)]
    bounds = [0] + starts[1:] + [n_top]  # region r (1..7, decade r - 1) lies in (M[bounds[r-1]], M[bounds[r]]]
    a, c = [0.0] * 16, [-(n_top + 1.5)] * 16  # regions 8..15: above the last midpoint
    jlo, jhi = [float(n_top)] * 16, [float(n_top + 1)] * 16
    c[0], jlo[0], jhi[0] = -0.5, 0.0, 0.0  # region 0: at or below the first midpoint
    for d, (s, n) in enumerate(zip(starts, sizes)):
        r = d + 1
        jlo[r], jhi[r] = float(bounds[r - 1]), float(bounds[r])
        if n == 1:
            c[r] = -(bounds[r] + 0.5)  # no midpoint inside: the count is constant
            continue
        step = float(pos[s + n - 1] - pos[s]) / (n - 1)
        low = float(pos[s]) - step / 2  # where the decade's first inner midpoint's count starts
        a[r], c[r] = 1.0 / step, low / step - s - 1
    bits = lambda t: torch.tensor(t, dtype=torch.float32).view(torch.int32)  # noqa: E731
    boundary = [int(b) for b in m[bounds].view(torch.int32)]
    region, above = [0] * 32, [0x7FFFFFFF] * 32
    for k in range(32):
        low_bits = (k + BINADE_BIAS) << 23  # the binade's smallest fp32
        region[k] = sum(b < low_bits for b in boundary) if k else 0
        inside = [b for b in boundary if low_bits <= b < low_bits + (1 << 23)]
        if k == 31:
            region[k], inside = len(boundary), []  # 1.0 and above, inf included
        assert len(inside) <= 1, "two region boundaries in one binade"
        if inside:
            above[k] = inside[0]
    ints = lambda t: torch.tensor(t, dtype=torch.int32)  # noqa: E731
    return torch.cat([bits(a), bits(c), bits(jhi), bits(jlo), ints(region), ints(above)])


@lru_cache(maxsize=None)
def _kernel_table_cpu(signed: bool) -> torch.Tensor:
    head = torch.cat([_dynamic_map_cpu(signed), _midpoints_cpu(signed), torch.zeros(1)]).view(torch.int32)
    return torch.cat([head, _quantizer_constants(signed)]).view(torch.float32).contiguous()


def kernel_table(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The kernels' table of one map (:data:`KT_SIZE` fp32 words): its 256 code values, its 255
    midpoints, one pad entry, then the quantizer's region constants (:data:`KT_A` to
    :data:`KT_BOUNDARY`; the last two as int32 words: region counts, boundaries' fp32 bits)."""
    device = torch.device(device)
    return _kernel_table_cpu(bool(signed)) if device.type == "cpu" else _kernel_table_on(bool(signed), device)


@lru_cache(maxsize=None)
def _kernel_table_on(signed: bool, device: torch.device) -> torch.Tensor:
    return _kernel_table_cpu(signed).to(device)  # once per device, not once per step


# ---- stochastic rounding: a counter-based hash -------------------------------------------------

def fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finalizer (a bijection with full avalanche)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    x ^= x >> 16
    return x


def sr_key(seed: int, step: int) -> int:
    """The 32-bit key of one call: the parameter's 64-bit seed and the step count, hashed on the host."""
    k = fmix32((seed & _M32) ^ 0x9E3779B9)
    k = fmix32(k ^ ((seed >> 32) & _M32))
    k = fmix32(k ^ (step & _M32))
    return fmix32(k ^ ((step >> 32) & _M32))


SR_MUL_LO = 0x9E3779B9  # odd: multiplying by it permutes the 32-bit index words
SR_MUL_HI = 0x85EBCA77


def sr_bits_int(key: int, index: int) -> int:
    """The 16 random bits of element ``index`` (Python ints; the scalar statement of the rule)."""
    x = key ^ ((index & _M32) * SR_MUL_LO & _M32) ^ (((index >> 32) & _M32) * SR_MUL_HI & _M32)
    return fmix32(x) >> 16


def sr_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """:func:`sr_bits_int` over an int64 tensor of element indices (int64 results in [0, 65536))."""
    lo = index & _M32
    hi = (index >> 32) & _M32
    x = (key ^ ((lo * SR_MUL_LO) & _M32) ^ ((hi * SR_MUL_HI) & _M32)) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    x = x ^ (x >> 16)
    return x >> 16


def stochastic_round_bf16(x: torch.Tensor, key: int) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 by the contract's rule, element ``i`` of the flattened tensor
    using the random bits of index ``i``."""
    x = x.contiguous()
    u = x.view(torch.int32).to(torch.int64) & _M32
    r = sr_bits(key, torch.arange(x.numel(), dtype=torch.int64, device=x.device).view(x.shape))
    out = ((u + r) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(x), torch.full_like(out, BF16_NAN), out)
    # int64 -> int16 keeps the low 16 bits (two's complement), which are the bf16 bits.
    return out.to(torch.int16).view(torch.bfloat16)


def new_sr_seed(generator: torch.Generator | None = None) -> int:
    """A fresh 64-bit seed for one parameter, drawn from torch's RNG (so torch.manual_seed makes
    runs reproducible)."""
    hi = int(torch.randint(0, 2 ** 32, (1,), generator=generator, dtype=torch.int64))
    lo = int(torch.randint(0, 2 ** 32, (1,), generator=generator, dtype=torch.int64))
    return (hi << 32) | lo


def new_adam8bit_states(shape: tuple[int, ...] | torch.Size, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """A param's fresh 8-bit states (``contract.RULES["adam8bit"].blocks.names``' order): codes of
    the param's shape standing for 0 and one fp32 zero scale per block, for each moment."""
    n = math.prod(shape)
    nb = num_blocks(n)
    return [torch.full(tuple(shape), SIGNED_ZERO_CODE, dtype=torch.uint8, device=device),
            torch.zeros(nb, dtype=torch.float32, device=device),
            torch.full(tuple(shape), UNSIGNED_ZERO_CODE, dtype=torch.uint8, device=device),
            torch.zeros(nb, dtype=torch.float32, device=device)]


def adam8bit_tables(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit kernels' two read-only tables (:func:`kernel_table`, signed then unsigned) on ``device``."""
    return kernel_table(True, device), kernel_table(False, device)


# The registry's entries of these rules (kept under their old names).
ADAM_SR = RULES["adam_sr"]
ADAM8BIT = RULES["adam8bit"]
