"""The numeric contract of 4-bit block-wise Adam states (``AdamW4bit``/``Adam4bit``): constants,
the two quantization maps, the packing of codes and the kernels' tables.

After Li et al. 2023 ("Memory Efficient Optimizers with 4-bit States") as torchao ships it
(``torchao/optim/subclass_4bit.py``, identical from torchao 0.4 to 0.18: block size 128, the maps
below, high nibble first). Everything else is the 8-bit rule of ``lowbit.py`` unchanged: the same
per-call scalars (``lowbit.Adam8bitScalars``, clamp included: ``lowbit.adam8bit_scalars``,
``pack_adam8bit``, ``Adam8bitTensorHyper``), the same element math
(``reference.adam_elements(..., clip=s.clip)``), the same quantizer rule and stochastic rounding;
``reference_lowbit.reference_adam4bit_`` states one step in plain torch.

- **Blocks.** A moment tensor of ``n`` elements has ``ceil(n / 128)`` fp32 scales (:data:`BLOCK4`
  consecutive elements of the flattened tensor per block; the last block may be short), one per
  block per moment. No rank-1 normalization (torchao's choice too; Li et al.'s best variant):
  the training evidence (docs/lowbit.md) is what decides whether it is needed.
- **Maps** (16 sorted fp32 values each; a code ``c`` of a block with scale ``a`` stands for
  ``map[c] * a``, one fp32 multiply):

  - first moment, signed: ``create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)``
    with bitsandbytes'/torchao's fp32 arithmetic (:func:`map4`): 7 negative values, 0.0 at code
    :data:`SIGNED_ZERO_CODE4` = 7, 7 positive values and 1.0 at code 15 (no -1.0);
  - second moment, unsigned and **zero-free**: ``torch.linspace(0, 1, 17)[1:]`` = ``k / 16`` for
    ``k = 1..16``. Code 0 stands for ``absmax / 16``, not 0. Why: a dequantized second moment of 0
    (which a linear 4-bit map with a zero code gives every element below ``absmax / 32`` of its
    block) turns ``m / (sqrt(v) * d2 + eps)`` into ``m / eps``, the zero-point problem Li et al.
    show to diverge; without a zero code a small ``v`` is over-estimated instead (that element's
    step is smaller than exact Adam's, the safe direction). The 8-bit rule's clamp still bounds
    every step (the scalars are shared), it rarely binds here.
- **Quantize one block** (both moments, after the step): ``absmax`` = ``max |x|`` over the block
  (NaN if any element is NaN: the whole block then dequantizes to NaN, a NaN is never dropped);
  ``inv = 0 if absmax == 0 else 1 / absmax`` (one fp32 division per block); ``xn = x * inv``
  (fp32); code = the number of the map's 15 midpoints strictly below ``xn``: the nearest code,
  **ties to the lower code**; NaN to code 0. Midpoint ``k`` = ``(map[k] + map[k + 1]) / 2`` in fp32
  (:func:`midpoints4`). No positive floor: the unsigned map has no zero. (torchao divides each
  element by ``max(absmax, 1e-12)`` and rounds ties up; its codes can differ from ours only for
  values within an ulp of a midpoint, and the codes mean the same values, so states convert.)
  The second moment's scale is then stored by :func:`stored_scale2`: ``+inf`` (a gradient above
  about 1.8e19 squared into it) is stored as NaN, so the block dequantizes to NaN at the next step
  and the run fails visibly, as an 8-bit block does (its zero code times ``inf``). Kept as ``inf``,
  the zero-free map would dequantize every element of the block to ``inf`` and their updates to 0
  for good: 127 healthy elements frozen silently.
- **Packing.** The codes of elements ``2i`` and ``2i + 1`` share byte ``i``:
  ``byte = (code[2i] << 4) | code[2i + 1]`` (high nibble = even element; torchao's order). A
  tensor of ``n`` elements has ``ceil(n / 2)`` code bytes, a 1-D uint8 tensor whatever the
  param's shape. For odd ``n`` the last byte's low nibble is padding: always 0 (fresh state and
  every kernel's store), never read as a value.
- **Fresh state.** First-moment bytes 0x77 (code 7 = 0.0 twice; 0x70 for the last byte of an odd
  ``n``), second-moment bytes 0x00 (any code, the scale is 0), both scales 0.
- **Small tensors.** Params of fewer than ``min_4bit_size`` (default :data:`MIN_4BIT_SIZE`)
  elements keep fp32 moments and the plain Adam rule, as the 8-bit classes do with
  ``min_8bit_size``.
- **Kernels** read both maps from :func:`kernel_table4` (values and midpoints), not from constants
  of their own, so this file is the one source of the numbers.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from .contract import RULES
from .lowbit import (Adam8bitScalars, Adam8bitTensorHyper, adam8bit_scalars, adam8bit_tensor_scalars,  # noqa: F401
                     pack_adam8bit)

BLOCK4 = 128
MIN_4BIT_SIZE = 4096
SIGNED_ZERO_CODE4 = 7  # index of 0.0 in the signed map
CODES4 = 16
FRESH_BYTE_SIGNED = (SIGNED_ZERO_CODE4 << 4) | SIGNED_ZERO_CODE4  # 0x77
FRESH_BYTE_UNSIGNED = 0x00
KT4_VALUES, KT4_MIDS, KT4_SIZE = 0, 16, 32  # kernel_table4: 16 values, 15 midpoints, one 0 pad


@lru_cache(maxsize=None)
def _map4_cpu(signed: bool) -> torch.Tensor:
    if not signed:
        return torch.linspace(0, 1, 17, dtype=torch.float32)[1:].contiguous()
    # create_dynamic_map(True, 3, 4): for decade i = 0..2, the midpoints of 2^i equal fp32 steps of
    # linspace(0.1, 1), scaled by 10^(i-2), both signs; plus 0 and 1. torchao's and bitsandbytes'
    # fp32 arithmetic (torch.linspace, the midpoints, the scale), so the values are theirs bit for bit.
    values: list[float] = []
    for i in range(3):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10.0 ** (i - 2)
        values += (scale * means).tolist()
        values += (-scale * means).tolist()
    values += [0.0, 1.0]
    assert len(values) == CODES4
    values.sort()
    return torch.tensor(values, dtype=torch.float32)


def map4(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 sorted fp32 code values: signed (first moment) or unsigned zero-free (second)."""
    m = _map4_cpu(bool(signed))
    return m if torch.device(device).type == "cpu" else m.to(device)


@lru_cache(maxsize=None)
def _midpoints4_cpu(signed: bool) -> torch.Tensor:
    m = _map4_cpu(signed)
    return ((m[:-1] + m[1:]) / 2.0).contiguous()  # fp32 sum, exact halving


def midpoints4(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 15 fp32 decision thresholds between neighbouring codes."""
    m = _midpoints4_cpu(bool(signed))
    return m if torch.device(device).type == "cpu" else m.to(device)


@lru_cache(maxsize=None)
def _kernel_table4_cpu(signed: bool) -> torch.Tensor:
    return torch.cat([_map4_cpu(signed), _midpoints4_cpu(signed), torch.zeros(1)]).contiguous()


@lru_cache(maxsize=None)
def _kernel_table4_on(signed: bool, device: torch.device) -> torch.Tensor:
    return _kernel_table4_cpu(signed).to(device)  # once per device, not once per step


def kernel_table4(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The kernels' table of one map: :data:`KT4_SIZE` fp32 words, the 16 code values
    (:data:`KT4_VALUES`), the 15 midpoints (:data:`KT4_MIDS`) and one 0 pad."""
    device = torch.device(device)
    return _kernel_table4_cpu(bool(signed)) if device.type == "cpu" else _kernel_table4_on(bool(signed), device)


# The NaN stored_scale2 stores, as fp32 bits (int32): x86's default NaN, which its arithmetic makes
# too, so that on x86 every NaN of such a step is one pattern. Fixed, since the sign of a NaN made
# by arithmetic is the device's (clear on arm64); a NaN param's bits are not part of the contract.
STORED_NAN_BITS = -0x00400000  # 0xFFC00000


def stored_scale2(absmax: torch.Tensor) -> torch.Tensor:
    """The second moment's block scales as stored: ``absmax``, except that ``+inf`` becomes the
    NaN :data:`STORED_NAN_BITS` (a fixed bit pattern, which every implementation stores).
    Applied after the block's codes are taken, which do not depend on it (every element of a
    block with an infinite or NaN scale takes code 0)."""
    nan = torch.tensor(STORED_NAN_BITS, dtype=torch.int32).view(torch.float32).to(absmax.device)
    return torch.where(absmax == float("inf"), nan, absmax)


def shape_tensor(shape: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The state entry ``param_shape4``: the shape of the param a 4-bit state was made for, as a
    1-D int64 CPU tensor. The packed codes and block scales have the same sizes for ``n`` and
    ``n + 1`` elements and for every shape of ``n``, so they cannot tell; a tensor, since
    torch.distributed.checkpoint flattens tensor, int, float and dict states only."""
    if isinstance(shape, torch.Tensor):
        shape = shape.tolist()
    return torch.tensor([int(d) for d in shape], dtype=torch.int64)


def num_blocks4(numel: int) -> int:
    """Block scales per moment of a tensor of ``numel`` elements."""
    return -(-int(numel) // BLOCK4)


def packed_size(numel: int) -> int:
    """Code bytes per moment of a tensor of ``numel`` elements (two codes a byte)."""
    return (int(numel) + 1) // 2


def pack_codes4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (any integer dtype, values 0..15, flattened) packed two a byte, high nibble first;
    the padding nibble of an odd count is 0."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    return ((c[0::2] << 4) | c[1::2]).contiguous()


def unpack_codes4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` codes (uint8, 0..15) of ``packed`` (:func:`pack_codes4`'s inverse)."""
    b = packed.reshape(-1)
    return torch.stack([b >> 4, b & 0x0F], dim=-1).reshape(-1)[:numel]


def fresh_codes4(numel: int, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fresh moment's code bytes (every element 0.0 under a zero scale), padding nibble 0."""
    fill = FRESH_BYTE_SIGNED if signed else FRESH_BYTE_UNSIGNED
    out = torch.full((packed_size(numel),), fill, dtype=torch.uint8, device=device)
    if numel % 2:
        out[-1] = fill & 0xF0
    return out


def new_adam4bit_states(shape: tuple[int, ...] | torch.Size, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """A param's fresh 4-bit states (``contract.RULES["adam4bit"].blocks.names``' order): packed codes
    standing for 0 (1-D, :func:`packed_size` bytes) and one fp32 zero scale per block, for each moment."""
    n = 1
    for d in shape:
        n *= int(d)
    nb = num_blocks4(n)
    return [fresh_codes4(n, True, device), torch.zeros(nb, dtype=torch.float32, device=device),
            fresh_codes4(n, False, device), torch.zeros(nb, dtype=torch.float32, device=device)]


def adam4bit_tables(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit kernels' two read-only tables (:func:`kernel_table4`, signed then unsigned) on ``device``."""
    return kernel_table4(True, device), kernel_table4(False, device)


# The registry's entry of the 4-bit rule (contract.RULES: the 8-bit rule's buffers and struct).
ADAM4BIT = RULES["adam4bit"]
