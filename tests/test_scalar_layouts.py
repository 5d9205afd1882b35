"""Each rule's scalar struct, field by field, in every place it is written: contract.py's
``NamedTuple`` (names, types) and ``struct_format``, the C++ struct of ``src/cpu/adam_types.h``
(the one ``MFA_RULES`` names for the rule) and the Metal ``Params`` struct of the rule struct that
``metal/fused_adam.metal`` instantiates for the rule's kernels. The bytes are only ever packed
and read by position, so the kernels' size checks cannot see two same-typed fields swapped; the
names can. Text only: nothing is compiled but the .metal source's preprocessing. The C++ and
Metal structs are written from contract.py by ci/scalar_structs.py
(test_structs_are_written_from_the_contract); these tests hold the result to the contract anyway."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from emulated_mps import METAL_SOURCE, find_compiler
from mps_fused_adam.numerics import lowbit
from mps_fused_adam.numerics.contract import RULES, AdamScalars, element_rules
from mps_fused_adam.backends.mps import KERNELS, METAL_RULES

REPO = Path(__file__).resolve().parent.parent
ADAM_TYPES = REPO / "src" / "cpu" / "adam_types.h"
SCALAR_STRUCTS = REPO / "ci" / "scalar_structs.py"

# struct format letter of each field type, per language.
CPP_TYPES = {"float": "f", "uint32_t": "I"}
METAL_TYPES = {"float": "f", "uint": "I"}
PY_TYPES = {float: "f", int: "I"}

# The two Metal-only rules of lowbit.py return plain tuples; their docstrings give the order:
# Adam's scalars then the key; the 8-bit scalars then the stochastic-rounding switch and key
# (the 4-bit rule of lowbit4.py shares the 8-bit rule's).
TUPLE_FIELDS = {"adam_sr": AdamScalars._fields + ("sr_key",),
                "adam8bit": lowbit.Adam8bitScalars._fields + ("sr", "sr_key"),
                "adam4bit": lowbit.Adam8bitScalars._fields + ("sr", "sr_key")}


def _code(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def _body(text: str, name: str) -> str:
    """The text between the braces of ``struct name { ... };`` (nested braces matched)."""
    m = re.search(rf"\bstruct\s+{name}\s*\{{", text)
    assert m, f"no struct {name}"
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1]


def struct_fields(text: str, name: str, types: dict[str, str]) -> list[tuple[str, str]]:
    """(field name, format letter) of a struct of plain fields, in declaration order; a field
    whose type is another struct of the file contributes that struct's fields in its place."""
    fields: list[tuple[str, str]] = []
    for decl in _body(text, name).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"(\w+) (\w+(?:\s*,\s*\w+)*)", decl)
        assert m, f"struct {name}: not a plain field declaration: {decl!r}"
        typ, names = m.group(1), [n.strip() for n in m.group(2).split(",")]
        for n in names:
            if typ in types:
                fields.append((n, types[typ]))
            else:
                fields.extend(struct_fields(text, typ, types))
    return fields


def format_letters(fmt: str) -> list[str]:
    assert fmt[0] == "<", fmt
    return [c for count, c in re.findall(r"(\d*)([a-zA-Z])", fmt[1:]) for _ in range(int(count or 1))]


def contract_fields(name: str) -> list[tuple[str, str]]:
    """The rule's scalars as contract.py states them: the names and types of the NamedTuple its
    scalars function returns (or TUPLE_FIELDS), held against its struct format letter by letter."""
    spec = METAL_RULES[name]
    ret = typing.get_type_hints(spec.scalars)["return"]
    letters = format_letters(spec.struct_format)
    if hasattr(ret, "_fields"):
        hints = typing.get_type_hints(ret)
        fields = [(f, PY_TYPES[hints[f]]) for f in ret._fields]
        assert [c for _, c in fields] == letters, f"{name}: {ret.__name__} is not {spec.struct_format}"
        return fields
    assert name in TUPLE_FIELDS, (f"{name}: {spec.scalars.__name__} should return a NamedTuple (names in the "
                                  f"order of the kernels' structs)")
    assert len(TUPLE_FIELDS[name]) == len(letters), name
    return list(zip(TUPLE_FIELDS[name], letters))


def cpp_rules() -> dict[str, tuple[str, int]]:
    """MFA_RULES: Python name -> (scalar struct, states)."""
    text = _code(ADAM_TYPES.read_text())
    entries = re.findall(r'X\(\s*\w+\s*,\s*"(\w+)"\s*,\s*\w+\s*,\s*(\w+)\s*,\s*(\d+)\s*\)', text)
    assert entries, "no MFA_RULES entries in adam_types.h"
    return {name: (scalars, int(states)) for name, scalars, states in entries}


def metal_rule_structs() -> dict[str, str]:
    """Kernel host name -> the rule struct it is instantiated with, read from the preprocessed
    source (Metal 3.1: the bfloat kernels included), so the instantiation macros are expanded."""
    proc = subprocess.run([find_compiler(), "-E", "-P", "-x", "c++", "-D__METAL_VERSION__=310",
                           "-DFUSED_ADAM_HOST_EMULATOR", "-"], input=METAL_SOURCE.read_text(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    found = re.findall(r'host_name\(\s*((?:"\w*"\s*)+)\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*decltype\(\s*\w+\s*<\s*(\w+)',
                       proc.stdout)
    return {"".join(re.findall(r'"(\w*)"', lit)): rule for lit, rule in found}


def test_parsers_read_what_they_should():
    text = "struct In { float a; uint b; };\nstruct Out {\n  float x, y;  // c\n  In in;\n  uint z;\n};"
    assert struct_fields(_code(text), "Out", METAL_TYPES) == [("x", "f"), ("y", "f"), ("a", "f"), ("b", "I"),
                                                              ("z", "I")]
    assert format_letters("<9f2I") == ["f"] * 9 + ["I"] * 2
    with pytest.raises(AssertionError):
        struct_fields("struct S { float a[2]; };", "S", METAL_TYPES)


@pytest.mark.parametrize("name", element_rules())
def test_cpp_scalar_struct_matches_contract(name):
    rules = cpp_rules()
    assert name in rules, f"contract rule {name!r} is not in MFA_RULES (src/cpu/adam_types.h)"
    scalars, states = rules[name]
    assert states == len(RULES[name].states), name
    assert struct_fields(_code(ADAM_TYPES.read_text()), scalars, CPP_TYPES) == contract_fields(name)


def test_cpp_8bit_scalars_match_lowbit():
    fields = struct_fields(_code(ADAM_TYPES.read_text()), "Adam8bitScalars", CPP_TYPES)
    hints = typing.get_type_hints(lowbit.Adam8bitScalars)
    assert fields == [(f, PY_TYPES[hints[f]]) for f in lowbit.Adam8bitScalars._fields]
    assert [c for _, c in fields] == format_letters(lowbit.ADAM8BIT_STRUCT)


@pytest.mark.parametrize("name", list(METAL_RULES))
def test_metal_params_struct_matches_contract(name):
    text = _code(METAL_SOURCE.read_text())
    instantiated = metal_rule_structs()
    kernels = sorted(k for (r, _, _), k in KERNELS.items() if r == name)
    assert kernels and all(k in instantiated for k in kernels), name
    [rule_struct] = {instantiated[k] for k in kernels}  # one rule struct serves all its dtype pairs
    # A rule that is a specialization of a rule template (the block-wise ones: one template over
    # their code formats) is read from the template's body.
    alias = re.search(rf"typedef\s+(\w+)\s*<\s*\w+\s*>\s*{rule_struct}\s*;", text)
    body = _body(text, alias.group(1) if alias else rule_struct)
    params = re.search(r"typedef\s+(\w+)\s+Params\s*;", body)
    assert params, f"{rule_struct} has no Params typedef"
    assert struct_fields(text, params.group(1), METAL_TYPES) == contract_fields(name)
    states = re.search(r"kStates\s*=\s*(\d+)", body)
    assert states and int(states.group(1)) == len(METAL_RULES[name].states), rule_struct



def test_structs_are_written_from_the_contract():
    """The C++ and Metal scalar structs are ci/scalar_structs.py's output for the contract as it is
    (run ``python ci/scalar_structs.py`` after changing a NamedTuple of contract.py)."""
    proc = subprocess.run([sys.executable, str(SCALAR_STRUCTS), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_struct_writer_refuses_a_file_without_its_block():
    spec = importlib.util.spec_from_file_location("scalar_structs_under_test", SCALAR_STRUCTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError, match="expected one block"):
        module.rewrite("struct AdamParams { float beta1; };", cpp=False)
    text = module.rewrite(f"a\n{module.BEGIN}\nstale\n{module.END}\nb", cpp=True)
    assert text.startswith("a\n" + module.BEGIN) and text.endswith(module.END + "\nb") and "stale" not in text
    assert "struct AdamScalars {" in text and "uint32_t maximize;" in text
