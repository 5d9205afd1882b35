"""The host-scalar structs of the C++ kernel (``src/cpu/adam_types.h``) and of the Metal source
(``metal/fused_adam.metal``), written from one source: ``numerics/contract.py``'s ``NamedTuple`` of
each rule's scalars (field names, types, order and trailing comments).

Both files hold this script's output between its BEGIN and END marker lines, checked in: the
``.metal`` file stays one self-contained text, which every Metal path needs as it is (the metallib
build compiles the file, tier 3 hands its text to ``torch.mps.compile_shader``, where no
``#include`` of ours resolves, the tests compile and read it as C++), and no build step runs
Python. ``tests/test_scalar_layouts.py`` fails when a block is not what this script writes.

    python ci/scalar_structs.py          # rewrite the blocks from contract.py
    python ci/scalar_structs.py --check  # exit 1, naming each stale file

Adding a rule's struct: one line in :data:`STRUCTS`.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import NamedTuple, Optional

REPO = Path(__file__).resolve().parent.parent


def _load_contract():
    """The checkout's contract.py alone (torch-free: neither the package nor a build of it is
    needed), or the installed package's where there is no checkout (the wheels' test runs copy
    the tests without python/)."""
    path = REPO / "python" / "mps_fused_adam" / "numerics" / "contract.py"
    if not path.is_file():
        return importlib.import_module("mps_fused_adam.numerics.contract")
    spec = importlib.util.spec_from_file_location("_mfa_contract", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # typing.get_type_hints resolves the annotations there
    spec.loader.exec_module(module)
    return module


contract = _load_contract()

CPP_FILE = REPO / "src" / "cpu" / "adam_types.h"
METAL_FILE = REPO / "metal" / "fused_adam.metal"
BEGIN = "// BEGIN scalar structs: written by ci/scalar_structs.py from numerics/contract.py; do not edit"
END = "// END scalar structs"
# A field's type per language: contract's float and int (fp32, uint32) or a struct of this table.
CPP_TYPES = {float: "float", int: "uint32_t"}
METAL_TYPES = {float: "float", int: "uint"}


class Field(NamedTuple):
    name: str
    type: object  # float, int or the Metal name of a struct of STRUCTS
    comment: str = ""


def fields_of(scalars: type) -> list[Field]:
    """A contract ``NamedTuple``'s fields with their types and trailing comments, in order."""
    hints = typing.get_type_hints(scalars)
    comments = dict(re.findall(r"^\s+(\w+):\s*\w+\s*#\s*(.*?)\s*$", inspect.getsource(scalars), flags=re.M))
    return [Field(f, hints[f], comments.get(f, "")) for f in scalars._fields]


class Struct(NamedTuple):
    cpp: Optional[str]  # its C++ name (None: Metal only)
    metal: Optional[str]  # its Metal name (None: C++ only)
    fields: list[Field]
    what: str  # the comment above it


# Every rule's struct, in declaration order. The Metal-only forms of Adam (lowbit.py) add to their
# NamedTuple what the host passes per tensor (contract.adam_sr_scalars, adam8bit_tensor_scalars).
STRUCTS = [
    Struct("AdamScalars", "AdamParams", fields_of(contract.AdamScalars), "Adam (contract.AdamScalars)"),
    Struct("LionScalars", "LionParams", fields_of(contract.LionScalars), "Lion (contract.LionScalars)"),
    Struct("AdagradScalars", "AdagradParams", fields_of(contract.AdagradScalars),
           "Adagrad (contract.AdagradScalars)"),
    Struct("Adam8bitScalars", None, fields_of(contract.Adam8bitScalars),
           "8-bit Adam on the CPU (contract.Adam8bitScalars)"),
    Struct(None, "AdamSRParams", [Field("adam", "AdamParams"),
                                  Field("sr_key", int, "lowbit.sr_key(seed, step) of the tensor")],
           "Adam storing a bf16 param by stochastic rounding (contract.adam_sr_scalars)"),
    Struct(None, "Adam8bitParams", fields_of(contract.Adam8bitScalars) + [
        Field("sr", int, "bf16 params only: store by stochastic rounding with sr_key"), Field("sr_key", int)],
           "8-bit Adam on Metal (contract.adam8bit_tensor_scalars)"),
]


def _size(struct: Struct) -> int:
    by_name = {s.metal: s for s in STRUCTS}
    return sum(4 if f.type in (float, int) else _size(by_name[f.type]) for f in struct.fields)


def _struct(name: str, struct: Struct, types: dict, cpp: bool) -> list[str]:
    by_metal = {s.metal: s for s in STRUCTS}
    lines = [f"// {struct.what}.", f"struct {name} {{"]
    for f in struct.fields:
        typ = types.get(f.type) or (by_metal[f.type].cpp if cpp else f.type)
        lines.append(f"  {typ} {f.name};" + (f"  // {f.comment}" if f.comment else ""))
    lines.append("};")
    if cpp:
        lines.append(f'static_assert(sizeof({name}) == {_size(struct)}, "{name}: see {struct.what}");')
    return lines


def block(cpp: bool) -> str:
    """The lines between (and with) the markers, for ``adam_types.h`` (``cpp``) or the .metal file."""
    lines = [BEGIN]
    for s in STRUCTS:
        name = s.cpp if cpp else s.metal
        if name is not None:
            lines += _struct(name, s, CPP_TYPES if cpp else METAL_TYPES, cpp)
    return "\n".join(lines + [END])


def rewrite(text: str, cpp: bool) -> str:
    """``text`` with its block replaced by :func:`block` (a file without both markers is refused)."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), flags=re.S)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected one block from {BEGIN!r} to {END!r}")
    return pattern.sub(lambda _: block(cpp), text)


def stale() -> list[Path]:
    """The files whose block is not what :func:`block` writes."""
    return [path for path, cpp in ((CPP_FILE, True), (METAL_FILE, False))
            if rewrite(path.read_text(encoding="utf-8"), cpp) != path.read_text(encoding="utf-8")]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report stale files (exit 1)")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for path in bad:
            print(f"{path.relative_to(REPO)}: scalar structs out of date; run python ci/scalar_structs.py",
                  file=sys.stderr)
        return 1 if bad else 0
    for path, cpp in ((CPP_FILE, True), (METAL_FILE, False)):
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, cpp)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
