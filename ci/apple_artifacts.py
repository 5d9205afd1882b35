#!/usr/bin/env python3
"""Check the Metal path against the real Apple-side artifacts that reach Linux.

    python ci/apple_artifacts.py                      # torch 2.13.0 (what CI checks)
    python ci/apple_artifacts.py --torch 2.9.0 2.10.0 # named releases
    python ci/apple_artifacts.py --since 2.8          # every torch release from 2.8 on
                                                      # (one without a downloadable wheel: "not checked")
    python ci/apple_artifacts.py --tier1              # every release from TIER1_MIN_TORCH to PyPI's
                                                      # newest (what CI checks; a missing wheel fails)

Nothing is installed: wheels are fetched with ``pip download`` for macOS arm64 and kept in a
cache directory (``$MFA_ARTIFACT_CACHE``, else ``~/.cache/mps-fused-adam-artifacts``), and single
members are unzipped from them once. pip runs with the machine's configuration files left out
(``PIP_CONFIG_FILE`` set to the null device, ``PIP_CONSTRAINT`` and ``PIP_FIND_LINKS`` cleared) for
those downloads only: a machine-wide constraint capping torch (this project's Linux machines cap it
at 2.14.1) must not hide the newest macOS release. What each torch check reads from a wheel is
kept as a small JSON (``facts/torch-VERSION-KEY.json``, KEY a hash of what is read), after which
that wheel and its unzipped members are deleted, except torch ``TORCH_CI``'s, which the
Objective-C check reads in full; a later run reads the JSON and downloads nothing. Binaries are read with LLVM's Mach-O tools from Debian's
``llvm-19`` package (``llvm-nm-19``, ``llvm-objdump-19``); the Objective-C stubs are compiled with
clang for ``arm64-apple-macos14`` to get Apple's type encodings. Prints one line per problem and
exits 1 if there is any.

Checks, each a function of plain text or bytes so the tests can feed it a doctored copy:

torch wheel (``check_torch_wheel``)
  - ``torch/lib/libtorch_cpu.dylib`` exports the ``torch::mps`` functions under exactly the
    names ``src/metal/metal_adam.mm`` passes to ``dlsym`` (Mach-O adds one leading underscore);
  - that dylib's install name ends with the image-name suffix the ``.mm`` searches for;
  - ``torch/mps/__init__.py`` has ``compile_shader(source)`` (and ``load_metallib(source)``,
    accepting a path, where the release has it) as ``backends/mps.py`` calls them;
  - ``at::mps::MPSHooks::getCommandBuffer`` calls ``MPSStream::endKernelCoalescing`` before
    ``commandBuffer`` exactly in the releases that ``backends.mps.TIER1_MIN_TORCH`` admits to tier 1;
  - the three hooks behind ``torch::mps`` (``getCommandBuffer``, ``getDispatchQueue``,
    ``commitStream``) take their stream from ``at::mps::getCurrentMPSStream`` exactly in the
    releases from ``backends.mps.HOOKS_CURRENT_STREAM_MIN_TORCH`` on, and from
    ``getDefaultMPSStream`` before; which of them call ``dispatch_assert_queue`` (must be called on
    the stream's queue) is reported (``hook_facts``).

Objective-C API (``check_objc_api``): every selector and C function that the ``.mm`` uses, as
declared in ``tests/support/objc_stubs`` (the ``.mm`` is parsed against them with -Werror, so it can use
nothing else), against the pyobjc metadata (``_metadata.py``) of the ``pyobjc-framework-Metal``,
``-Cocoa`` (Foundation) and ``-libdispatch`` macOS wheels: the name, the argument count and every
type encoding the metadata gives. Selectors and functions that pyobjc has no metadata for (their
types are all objects, or they are libSystem's) must at least appear among the selector names or
imported symbols of the torch wheel's ``libtorch_cpu.dylib``, which Apple's toolchain built.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MM = REPO / "src" / "metal" / "metal_adam.mm"
STUBS = REPO / "tests" / "support" / "objc_stubs"
BACKENDS = REPO / "python" / "mps_fused_adam" / "backends" / "mps.py"
TENSOR_HANDLES = REPO / "src" / "cpu" / "tensor_handles.cpp"
LIBTORCH_PYTHON = "torch/lib/libtorch_python.dylib"

PLATFORM = "macosx_14_0_arm64"
PYTHON_VERSION = "3.11"
TORCH_CI = "2.13.0"
# Pinned so that a run is reproducible; bump deliberately.
PYOBJC = {"Metal": "pyobjc-framework-Metal==12.2.2", "Foundation": "pyobjc-framework-Cocoa==13.0",
          "dispatch": "pyobjc-framework-libdispatch==13.0"}
LIBTORCH = "torch/lib/libtorch_cpu.dylib"
MPS_INIT = "torch/mps/__init__.py"
GET_COMMAND_BUFFER = "__ZNK2at3mps8MPSHooks16getCommandBufferEv"
# The MPSHooks methods behind torch::mps::get_command_buffer(), get_dispatch_queue() and commit().
HOOKS = {"getCommandBuffer": GET_COMMAND_BUFFER,
         "getDispatchQueue": "__ZNK2at3mps8MPSHooks16getDispatchQueueEv",
         "commitStream": "__ZNK2at3mps8MPSHooks12commitStreamEv"}


class Unavailable(RuntimeError):
    """An artifact or tool this check needs cannot be had here (no network, tool missing)."""


# --------------------------------------------------------------------------- fetching

def cache_dir() -> Path:
    return Path(os.environ.get("MFA_ARTIFACT_CACHE") or Path.home() / ".cache" / "mps-fused-adam-artifacts")


def find_tool(name: str) -> str:
    """``name``-19 (Debian's llvm-19) or plain ``name``."""
    for candidate in (f"{name}-19", name):
        path = shutil.which(candidate)
        if path:
            return path
    raise Unavailable(f"{name}-19 not on PATH (Debian: apt-get install llvm-19)")


def uncapped_pip_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for pip's index and download calls: no configuration file (where a
    machine-wide constraint such as ``torch<=2.14.1`` lives), no constraint or local wheel folder
    from the environment. Only these calls get it: nothing is installed with it."""
    env = dict(os.environ if environ is None else environ)
    env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no configuration file at all then
    for name in ("PIP_CONSTRAINT", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        env.pop(name, None)
    return env


def download_wheel(requirement: str, cache: Path | None = None) -> Path:
    """The macOS arm64 wheel of ``requirement`` (``name==version``), downloaded once into the cache."""
    name, _, version = requirement.partition("==")
    dest = (cache or cache_dir()) / "wheels" / f"{name.lower()}-{version}"
    prefix = name.lower().replace("-", "_") + f"-{version}-"
    found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(prefix)] if dest.is_dir() else []
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--platform", PLATFORM, "--python-version", PYTHON_VERSION, "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=uncapped_pip_env())
    found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(prefix)]
    if proc.returncode != 0 or not found:
        errors = [l for l in proc.stderr.splitlines() if l.startswith("ERROR")] or proc.stderr.splitlines()[-1:]
        raise Unavailable(f"pip download {requirement} for {PLATFORM} failed: {' '.join(errors)[:400]}")
    return found[0]


def extract(wheel: Path, member: str) -> Path:
    """``member`` of ``wheel``, unzipped once next to it."""
    out = wheel.parent / "extracted" / member
    if not out.is_file():
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise FileNotFoundError(f"{wheel.name} has no {member}") from None
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(out.suffix + ".part")
            with zf.open(info) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            tmp.replace(out)
    return out


def torch_releases_since(minimum: tuple[int, int]) -> list[str]:
    """Every final torch release from ``minimum`` on that has a macOS arm64 wheel (pip index)."""
    # Short timeout, one retry: the tests ask at collection time, and a machine without network
    # should hear "unavailable" in seconds, not after pip's default retries.
    cmd = [sys.executable, "-m", "pip", "index", "versions", "torch", "--only-binary=:all:",
           "--platform", PLATFORM, "--python-version", PYTHON_VERSION, "--timeout", "20", "--retries", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=uncapped_pip_env())
    m = re.search(r"Available versions:\s*(.+)", proc.stdout)
    if proc.returncode != 0 or not m:
        raise Unavailable(f"pip index versions torch failed: {proc.stderr.strip()[-400:]}")
    versions = [v.strip() for v in m.group(1).split(",")]
    finals = [v for v in versions if re.fullmatch(r"\d+\.\d+\.\d+", v)]
    return sorted((v for v in finals if tuple(map(int, v.split(".")[:2])) >= minimum),
                  key=lambda v: tuple(map(int, v.split("."))))


# --------------------------------------------------------------------------- what the sources expect

def mm_torch_symbols(mm_text: str) -> list[str]:
    """The C++ names the .mm passes to dlsym."""
    return sorted(re.findall(r'"(_ZN5torch3mps\w+)"', mm_text))


def shim_symbols(handles_text: str) -> list[str]:
    """The functions of torch's C shim that src/cpu/tensor_handles.cpp passes to dlsym."""
    return sorted(re.findall(r'lookup\(lib, "(aoti_torch_\w+)"', handles_text))


def mm_image_suffix(mm_text: str) -> str:
    """The image-name suffix the .mm looks for among the loaded images."""
    m = re.search(r'kName\[\]\s*=\s*"([^"]+)"', mm_text)
    if not m:
        raise ValueError("metal_adam.mm: no kName[] image suffix")
    return m.group(1)


def tier1_min_torch(backends_text: str) -> tuple[int, int]:
    m = re.search(r"^TIER1_MIN_TORCH\s*=\s*\((\d+),\s*(\d+)\)", backends_text, re.M)
    if not m:
        raise ValueError("backends/mps.py: no TIER1_MIN_TORCH = (major, minor)")
    return int(m.group(1)), int(m.group(2))


# --------------------------------------------------------------------------- torch wheel checks

def check_exports(nm_text: str, names: list[str]) -> list[str]:
    """``llvm-nm --extern-only --defined-only`` output must list each name (with Mach-O's leading
    underscore) as an exported text symbol."""
    exported = {parts[2] for parts in (line.split() for line in nm_text.splitlines())
                if len(parts) == 3 and parts[1] == "T"}
    return [f"libtorch_cpu.dylib does not export {n} (dlsym name {n}; Mach-O symbol _{n})"
            for n in names if "_" + n not in exported]


def check_image_name(install_name: str, suffix: str) -> list[str]:
    if not ("/" + install_name.lstrip("@")).endswith(suffix):
        return [f"libtorch_cpu's install name {install_name!r} does not end with {suffix!r}, "
                "the image name _metal searches for"]
    return []


def _function_args(tree: ast.Module, name: str) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return [a.arg for a in node.args.posonlyargs + node.args.args]
    return None


def check_mps_api(init_text: str, need_load_metallib: bool) -> tuple[list[str], dict[str, bool]]:
    """torch/mps/__init__.py against backends/mps.py's calls: compile_shader(source_text) and
    load_metallib(path). Returns (problems, which of the two exist)."""
    tree = ast.parse(init_text)
    problems, have = [], {}
    for fn in ("compile_shader", "load_metallib"):
        args = _function_args(tree, fn)
        have[fn] = args is not None
        if args is None:
            if fn == "compile_shader" or need_load_metallib:
                problems.append(f"torch/mps/__init__.py has no {fn}()")
        elif args != ["source"]:
            problems.append(f"torch.mps.{fn} takes {args}, backends/mps.py passes one positional argument")
    if have["load_metallib"]:
        body = ast.get_source_segment(init_text, next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                                                      and n.name == "load_metallib")) or ""
        if "os.PathLike" not in body:
            problems.append("torch.mps.load_metallib does not accept an os.PathLike (backends/mps.py passes a Path)")
    return problems, have


def coalesces_before_command_buffer(disasm: str) -> bool:
    """Whether a disassembly of MPSHooks::getCommandBuffer calls MPSStream::endKernelCoalescing
    before it reaches MPSStream::commandBuffer."""
    calls = re.findall(r"\b(?:bl|b)\s+0x[0-9a-f]+\s+<(\S+)>", disasm)
    coalesce = [i for i, c in enumerate(calls) if "endKernelCoalescing" in c]
    buffer = [i for i, c in enumerate(calls) if "MPSStream13commandBuffer" in c]
    if not buffer:
        raise ValueError("getCommandBuffer's disassembly reaches no MPSStream::commandBuffer")
    return bool(coalesce) and coalesce[0] < buffer[0]


def check_gate(version: str, disasm: str, gate: tuple[int, int]) -> list[str]:
    admitted = tuple(map(int, version.split(".")[:2])) >= gate
    safe = coalesces_before_command_buffer(disasm)
    if admitted and not safe:
        return [f"torch {version}: tier 1 admitted (TIER1_MIN_TORCH {gate}) but getCommandBuffer "
                "does not end kernel coalescing first"]
    if safe and not admitted:
        return [f"torch {version}: getCommandBuffer ends kernel coalescing, but TIER1_MIN_TORCH "
                f"{gate} keeps this release out of tier 1"]
    return []


def disassembly_by_symbol(disasm: str) -> dict[str, str]:
    """``llvm-objdump -d`` output split into one body per symbol, by the symbol's Mach-O name."""
    parts = re.split(r"^[0-9a-f]+ <(\S+)>:\n", disasm, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def stub_targets(indirect: str) -> dict[str, str]:
    """Hex address -> imported symbol of each ``__TEXT,__stubs`` entry, from ``llvm-objdump
    --macho --indirect-symbols`` (llvm-objdump's disassembly names a call into a stub after the
    nearest exported symbol, ``<_zunmqr_+0x...>``, not after what the stub jumps to)."""
    if "Indirect symbols for (__TEXT,__stubs)" not in indirect:
        raise ValueError("no __TEXT,__stubs section in the indirect symbol table")
    section = indirect.split("Indirect symbols for (__TEXT,__stubs)", 1)[1].split("Indirect symbols for", 1)[0]
    return {a.lstrip("0") or "0": name for a, name in re.findall(r"^0x([0-9a-f]+)\s+\d+\s+(\S+)$", section, re.M)}


def call_targets(body: str, stubs: dict[str, str] | None = None) -> list[str]:
    """The functions one disassembled body calls or tail-calls, in order; a call into a stub is
    named by the symbol the stub imports."""
    out = []
    for addr, name in re.findall(r"\b(?:bl|b)\s+0x([0-9a-f]+)(?:\s+<(\S+)>)?", body):
        out.append((stubs or {}).get(addr.lstrip("0") or "0") or name or f"0x{addr}")
    return out


def hook_stream(body: str) -> str:
    """``"current"`` or ``"default"``: which MPS stream an MPSHooks method takes (the first of
    ``at::mps::getCurrentMPSStream`` / ``getDefaultMPSStream`` it calls)."""
    for target in call_targets(body):
        if "getCurrentMPSStream" in target:
            return "current"
        if "getDefaultMPSStream" in target:
            return "default"
    raise ValueError("calls neither at::mps::getCurrentMPSStream nor at::mps::getDefaultMPSStream")


def hook_facts(disasm: str, stubs: dict[str, str]) -> dict[str, dict[str, object]]:
    """Per hook of :data:`HOOKS`: the stream it takes and whether it calls ``dispatch_assert_queue``
    (then torch aborts unless it is called on that stream's queue)."""
    bodies = disassembly_by_symbol(disasm)
    facts = {}
    for hook, symbol in HOOKS.items():
        if symbol not in bodies:
            raise ValueError(f"no disassembly of {symbol}")
        targets = call_targets(bodies[symbol], stubs)
        facts[hook] = {"stream": hook_stream(bodies[symbol]),
                       "asserts_queue": any(t.startswith("_dispatch_assert_queue") for t in targets)}
    return facts


def check_streams(version: str, facts: dict[str, dict[str, object]], current_from: tuple[int, int]) -> list[str]:
    """Each hook must take the stream ``backends.mps.HOOKS_CURRENT_STREAM_MIN_TORCH`` says for
    ``version``: the current stream from that release on, the default stream before it."""
    want = "current" if tuple(map(int, version.split(".")[:2])) >= current_from else "default"
    gate = ".".join(map(str, current_from))
    return [f"torch {version}: MPSHooks::{hook} takes the {f['stream']} MPS stream, but "
            f"HOOKS_CURRENT_STREAM_MIN_TORCH ({gate}) says the {want} stream"
            for hook, f in facts.items() if f["stream"] != want]


def hooks_current_stream_min_torch(backends_text: str) -> tuple[int, int]:
    m = re.search(r"^HOOKS_CURRENT_STREAM_MIN_TORCH\s*=\s*\((\d+),\s*(\d+)\)", backends_text, re.M)
    if not m:
        raise ValueError("backends/mps.py: no HOOKS_CURRENT_STREAM_MIN_TORCH = (major, minor)")
    return int(m.group(1)), int(m.group(2))


def run_tool(tool: str, *args: str) -> str:
    proc = subprocess.run([find_tool(tool), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)}: {proc.stderr.strip()[-400:]}")
    return proc.stdout


# What torch_facts reads; a change of it changes the cache key, so old facts are never reused.
_NM_KEEP = r"torch3mps|aoti_torch_|MPSHooks|MPSStream"
_FACTS_SPEC = json.dumps({"v": 1, "hooks": HOOKS, "nm": _NM_KEEP, "members": [LIBTORCH, MPS_INIT, LIBTORCH_PYTHON]})


def facts_path(version: str, cache: Path | None = None) -> Path:
    import hashlib
    key = hashlib.sha256(_FACTS_SPEC.encode()).hexdigest()[:12]
    return (cache or cache_dir()) / "facts" / f"torch-{version}-{key}.json"


def torch_facts(version: str, cache: Path | None = None, keep_wheel: bool | None = None) -> dict:
    """What the torch checks read from torch ``version``'s macOS arm64 wheel: ``nm`` (the exported
    symbols of libtorch_cpu.dylib that name torch::mps, the C shim, MPSHooks or MPSStream, as
    ``llvm-nm --extern-only --defined-only`` prints them), ``dylib_id``, ``mps_init`` (the text of
    torch/mps/__init__.py), ``disasm`` (the hooks' disassembly), ``stubs`` (the stubs the hooks
    call), ``aoti_binding`` (libtorch_python names unsafe_alloc_void_ptrs_from_tensors). Read once
    and kept as JSON; the wheel is then deleted unless ``keep_wheel`` (default: for
    :data:`TORCH_CI` only, which the Objective-C check reads)."""
    path = facts_path(version, cache)
    if path.is_file():
        return json.loads(path.read_text())
    wheel = download_wheel(f"torch=={version}", cache)
    dylib = str(extract(wheel, LIBTORCH))
    nm = run_tool("llvm-nm", "--extern-only", "--defined-only", dylib)
    disasm = run_tool("llvm-objdump", "-d", "--no-show-raw-insn",
                      "--disassemble-symbols=" + ",".join(HOOKS.values()), dylib)
    stubs = stub_targets(run_tool("llvm-objdump", "--macho", "--indirect-symbols", dylib))
    called = {a.lstrip("0") for a in re.findall(r"\b(?:bl|b)\s+0x([0-9a-f]+)", disasm)}
    facts = {
        "version": version,
        "nm": "\n".join(l for l in nm.splitlines() if re.search(_NM_KEEP, l)),
        "dylib_id": run_tool("llvm-objdump", "--macho", "--dylib-id", dylib).splitlines()[-1].strip(),
        "mps_init": extract(wheel, MPS_INIT).read_text(encoding="utf-8"),
        "disasm": disasm,
        "stubs": {a: n for a, n in stubs.items() if a in called},
        "aoti_binding": b"unsafe_alloc_void_ptrs_from_tensors" in extract(wheel, LIBTORCH_PYTHON).read_bytes(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(facts))
    tmp.replace(path)
    if not (version == TORCH_CI if keep_wheel is None else keep_wheel):
        shutil.rmtree(wheel.parent, ignore_errors=True)  # about 140 MB of wheel, 600 MB unzipped
    return facts


def check_torch_facts(version: str, facts: dict, mm_text: str, backends_text: str) -> list[str]:
    """Every torch-wheel check above on what :func:`torch_facts` read."""
    problems = check_exports(facts["nm"], mm_torch_symbols(mm_text))
    problems += check_image_name(facts["dylib_id"], mm_image_suffix(mm_text))
    api_problems, _ = check_mps_api(facts["mps_init"], need_load_metallib=version == TORCH_CI)
    problems += api_problems
    bodies = disassembly_by_symbol(facts["disasm"])
    problems += check_gate(version, bodies[GET_COMMAND_BUFFER], tier1_min_torch(backends_text))
    problems += check_streams(version, hook_facts(facts["disasm"], facts["stubs"]),
                              hooks_current_stream_min_torch(backends_text))
    return [f"torch {version}: {p}" if not p.startswith("torch ") else p for p in problems]


def check_torch_wheel(version: str, cache: Path | None = None) -> list[str]:
    """Every torch-wheel check above for torch ``version`` (downloads it once)."""
    return check_torch_facts(version, torch_facts(version, cache), MM.read_text(), BACKENDS.read_text())


def summary(version: str, facts: dict) -> str:
    """One line of what a release's hooks do (for the log)."""
    hooks = hook_facts(facts["disasm"], facts["stubs"])
    streams = sorted({str(f["stream"]) for f in hooks.values()})
    asserting = [h for h, f in hooks.items() if f["asserts_queue"]]
    return (f"hooks take the {'/'.join(streams)} stream; dispatch_assert_queue in "
            f"{', '.join(asserting) if asserting else 'none'}")


# --------------------------------------------------------------------------- Objective-C API checks

def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None  # an entry built by a helper call (sel32or64, ...): not one we use


def parse_pyobjc_metadata(text: str) -> tuple[dict[str, list[tuple[str, dict]]], dict[str, tuple]]:
    """(selectors, functions) from a pyobjc ``_metadata.py``, read without importing it:
    ``r(b"Class", b"selector", {...})`` calls and the ``functions = {...}`` dict."""
    tree = ast.parse(text)
    selectors: dict[str, list[tuple[str, dict]]] = {}
    functions: dict[str, tuple] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "r" \
                and len(node.args) == 3:
            cls, sel, meta = (_literal(a) for a in node.args)
            if isinstance(cls, bytes) and isinstance(sel, bytes) and isinstance(meta, dict):
                selectors.setdefault(sel.decode(), []).append((cls.decode(), meta))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "functions"
                                                  for t in node.targets) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                name, entry = _literal(key), _literal(value)
                if isinstance(name, str) and isinstance(entry, tuple):
                    functions[name] = entry
    return selectors, functions


_QUALIFIERS = "rnNoORVA"


def split_encoding(enc: str) -> list[str]:
    """An Objective-C type encoding string split into one encoding per type."""
    out, i = [], 0
    while i < len(enc):
        start = i
        while i < len(enc) and enc[i] in _QUALIFIERS:
            i += 1
        while i < len(enc) and enc[i] == "^":
            i += 1
        if i >= len(enc):
            raise ValueError(f"truncated encoding {enc!r}")
        opener = enc[i]
        if opener in "{([":
            closer = {"{": "}", "(": ")", "[": "]"}[opener]
            depth = 0
            while True:
                depth += enc[i] == opener
                depth -= enc[i] == closer
                i += 1
                if depth == 0:
                    break
        elif enc.startswith("@?", i):
            i += 2
        else:
            i += 1
        while i < len(enc) and enc[i].isdigit():  # frame offsets of method signatures
            i += 1
        out.append(enc[start:i])
    return out


def normalize_encoding(enc: str | bytes) -> str:
    """Comparable form: qualifiers (const, in/out) dropped, pyobjc's text pointers ``^t`` as C
    strings ``*``, struct names dropped (Apple's MTLSize is an anonymous struct, ``{?=QQQ}``;
    pyobjc names it ``{MTLSize=QQQ}``); the field layout stays."""
    if isinstance(enc, bytes):
        enc = enc.decode()
    enc = enc.lstrip(_QUALIFIERS)
    enc = enc.replace("^t", "*")
    return re.sub(r"\{[^=}]*=", "{=", enc)


def _stub_ast(clang: str, stubs: Path, workdir: Path) -> dict:
    src = workdir / "decls.mm"
    src.write_text("#include <stdint.h>\n#import <Foundation/Foundation.h>\n#import <Metal/Metal.h>\n"
                   "#include <mach-o/dyld.h>\n")
    proc = subprocess.run([clang, "-target", "arm64-apple-macos14", "-ffreestanding", "-x", "objective-c++",
                           "-std=c++17", "-fobjc-arc", "-fblocks", f"-I{stubs}", "-fsyntax-only",
                           "-Xclang", "-ast-dump=json", str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"clang cannot parse the stubs: {proc.stderr[-800:]}")
    return json.loads(proc.stdout)


def declared_api(clang: str, stubs: Path = STUBS) -> list[dict]:
    """Every method (with implicit property getters) and function the stubs declare:
    {"kind": "method"|"function", "owner", "name", "types": [return type, arg types...]},
    each type a C spelling that @encode accepts, plus its Apple encoding under "encodings"."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = _stub_ast(clang, stubs, Path(tmp))
        decls: list[dict] = []

        def spell(t: dict) -> str:
            q = t["qualType"]
            if q == "instancetype":
                return "id"
            return re.sub(r"\b__strong\b", "", q).strip()

        def walk(node: dict, owner: str | None) -> None:
            kind = node.get("kind")
            if kind in ("ObjCProtocolDecl", "ObjCInterfaceDecl"):
                owner = node.get("name")
            if kind == "ObjCMethodDecl":
                params = [p for p in node.get("inner", []) if p.get("kind") == "ParmVarDecl"]
                decls.append({"kind": "method", "owner": owner, "name": node["name"],
                              "types": [spell(node["returnType"])] + [spell(p["type"]) for p in params]})
            elif kind == "FunctionDecl" and not node.get("isImplicit") and not node["name"].startswith("__"):
                params = [p for p in node.get("inner", []) if p.get("kind") == "ParmVarDecl"]
                ret = re.match(r"(.*?)\s*\(", node["type"]["qualType"]).group(1)
                decls.append({"kind": "function", "owner": None, "name": node["name"],
                              "types": [spell({"qualType": ret})] + [spell(p["type"]) for p in params]})
            for child in node.get("inner", []) or []:
                walk(child, owner)

        walk(tree, None)
        # Apple's encodings of those types: @encode under the macOS arm64 target, read from the IR.
        spellings = sorted({t for d in decls for t in d["types"]})
        src = Path(tmp) / "enc.mm"
        src.write_text("#include <stdint.h>\n#import <Foundation/Foundation.h>\n#import <Metal/Metal.h>\n"
                       + "".join(f'extern "C" const char mfa_enc_{i}[] = @encode({t});\n'
                                 for i, t in enumerate(spellings)))
        proc = subprocess.run([clang, "-target", "arm64-apple-macos14", "-ffreestanding", "-x", "objective-c++",
                               "-std=c++17", "-fobjc-arc", "-fblocks", f"-I{stubs}", "-S", "-emit-llvm",
                               "-o", "-", str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"clang cannot encode the stub types: {proc.stderr[-800:]}")
        enc = {int(i): s for i, s in re.findall(r'@mfa_enc_(\d+) = (?:\w+ )*constant \[\d+ x i8\] c"(.*?)\\00"',
                                                 proc.stdout)}
        by_spelling = {t: enc[i] for i, t in enumerate(spellings)}
        for d in decls:
            d["encodings"] = [by_spelling[t] for t in d["types"]]
        return decls


def check_method(decl: dict, selectors: dict[str, list[tuple[str, dict]]], apple_names: set[str]) -> list[str]:
    sel, owner = decl["name"], decl["owner"]
    where = f"-[{owner} {sel}]"
    encodings = decl["encodings"]
    if sel.count(":") != len(encodings) - 1:
        return [f"{where}: {sel.count(':')} colons but {len(encodings) - 1} arguments declared"]
    entries = selectors.get(sel, [])
    meta = next((m for cls, m in entries if cls == owner), None) or next(
        (m for cls, m in entries if cls == "NSObject"), None) or (entries[0][1] if entries else None)
    if meta is None:
        # pyobjc keeps no metadata for selectors whose types the runtime already describes fully
        # (objects only); such a selector must at least be one that Apple-built code sends.
        problems = []
        if any(normalize_encoding(e) != "@" for e in encodings):
            problems.append(f"{where}: not in the pyobjc metadata, and not object-typed ({encodings})")
        if sel not in apple_names:
            problems.append(f"{where}: not in the pyobjc metadata, nor among libtorch_cpu's selector names")
        return problems
    problems = []
    ret = meta.get("retval", {}).get("type")
    if ret is not None and normalize_encoding(ret) != normalize_encoding(encodings[0]):
        problems.append(f"{where}: returns {encodings[0]!r}, the metadata says {ret!r}")
    for index, arg in (meta.get("arguments") or {}).items():
        pos = index - 1  # metadata counts self and _cmd as 0 and 1
        if not 1 <= pos < len(encodings):
            problems.append(f"{where}: the metadata describes argument {index}, the stub has {len(encodings) - 1}")
        elif "type" in arg and normalize_encoding(arg["type"]) != normalize_encoding(encodings[pos]):
            problems.append(f"{where}: argument {pos} is {encodings[pos]!r}, the metadata says {arg['type']!r}")
    return problems


def check_function(decl: dict, functions: dict[str, tuple], apple_imports: set[str]) -> list[str]:
    name, encodings = decl["name"], decl["encodings"]
    entry = functions.get(name)
    if entry is None:
        if "_" + name not in apple_imports:
            return [f"{name}(): neither in the pyobjc metadata nor imported by libtorch_cpu.dylib"]
        return []
    want = [normalize_encoding(e) for e in split_encoding(entry[0].decode() if isinstance(entry[0], bytes) else entry[0])]
    have = [normalize_encoding(e) for e in encodings]
    if len(want) != len(have):
        return [f"{name}(): {len(have) - 1} arguments declared, the metadata has {len(want) - 1}"]
    if want != have:
        return [f"{name}(): encodings {have}, the metadata says {want}"]
    return []


def check_objc_api(decls: list[dict], metadata_texts: list[str], mm_text: str,
                   apple_names: set[str], apple_imports: set[str]) -> list[str]:
    """The stub declarations (= what the .mm can use) against pyobjc's metadata; and every stub
    declaration used by the .mm (so nothing is checked that the .mm does not use)."""
    selectors: dict[str, list[tuple[str, dict]]] = {}
    functions: dict[str, tuple] = {}
    for text in metadata_texts:
        sels, fns = parse_pyobjc_metadata(text)
        for k, v in sels.items():
            selectors.setdefault(k, []).extend(v)
        functions.update(fns)
    problems = []
    code = re.sub(r"//[^\n]*", "", mm_text)
    for d in decls:
        name = re.escape(d["name"].split(":")[0])
        if d["kind"] == "function":
            pattern = rf"\b{name}\s*\("            # a call
        elif ":" in d["name"]:
            pattern = rf"\b{name}:"                 # a keyword message
        else:
            pattern = rf"(?:\.{name}\b|\s{name}\s*\])"  # a property read or a unary message
        used = re.search(pattern, code) is not None
        if not used:
            problems.append(f"{d['name']}: declared in tests/support/objc_stubs but not used by metal_adam.mm")
        elif d["kind"] == "method":
            problems += check_method(d, selectors, apple_names)
        else:
            problems += check_function(d, functions, apple_imports)
    return problems


def apple_symbols(dylib: Path) -> tuple[set[str], set[str]]:
    """(selector names, undefined symbols) of an Apple-built dylib: its __objc_methname strings
    (llvm-objdump prints them one a line) and llvm-nm's undefined symbols."""
    dump = run_tool("llvm-objdump", "--macho", "--section=__TEXT,__objc_methname", str(dylib))
    names = {m.group(1) for m in re.finditer(r"^[0-9a-f]{8,16}\s+(\S+)$", dump, re.M)}
    imports = {parts[-1] for parts in (l.split() for l in run_tool("llvm-nm", "-u", str(dylib)).splitlines()) if parts}
    return names, imports


def objc_problems(cache: Path | None = None, clang: str | None = None) -> list[str]:
    clang = clang or shutil.which("clang++") or shutil.which("clang++-19")
    if clang is None:
        raise Unavailable("clang++ not on PATH")
    texts = []
    for member, req in (("Metal/_metadata.py", PYOBJC["Metal"]), ("Foundation/_metadata.py", PYOBJC["Foundation"]),
                        ("dispatch/_metadata.py", PYOBJC["dispatch"])):
        texts.append(extract(download_wheel(req, cache), member).read_text(encoding="utf-8"))
    dylib = extract(download_wheel(f"torch=={TORCH_CI}", cache), LIBTORCH)
    names, imports = apple_symbols(dylib)
    return check_objc_api(declared_api(clang), texts, MM.read_text(), names, imports)


# --------------------------------------------------------------------------- command line

def tier1_releases() -> list[str]:
    """Every torch release from ``TIER1_MIN_TORCH`` to the newest with a macOS arm64 wheel on
    PyPI, as the index lists them now."""
    return torch_releases_since(tier1_min_torch(BACKENDS.read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", nargs="+", default=None, help=f"torch releases to check (default {TORCH_CI})")
    ap.add_argument("--since", default=None, help="check every torch release from this MAJOR.MINOR on")
    ap.add_argument("--tier1", action="store_true",
                    help="check every release from TIER1_MIN_TORCH to PyPI's newest (a missing wheel fails)")
    ap.add_argument("--no-objc", action="store_true", help="skip the Objective-C API check")
    args = ap.parse_args(argv)
    versions = list(args.torch or [])
    if args.since:
        versions += torch_releases_since(tuple(map(int, args.since.split(".")[:2])))
    if args.tier1:
        versions += tier1_releases()
    versions = list(dict.fromkeys(versions or [TORCH_CI]))
    problems: list[str] = []
    mm_text, backends_text = MM.read_text(), BACKENDS.read_text()
    for v in versions:
        try:
            facts = torch_facts(v)
        except Unavailable as exc:
            if not args.since or args.tier1 or v == TORCH_CI:
                raise
            # --since alone reaches releases before tier 1's: one the index lists without a
            # downloadable macOS arm64 wheel for CPython 3.11 is listed, not counted as a problem.
            print(f"torch {v}: not checked: {exc}")
            continue
        found = check_torch_facts(v, facts, mm_text, backends_text)
        print(f"torch {v}: {'ok' if not found else f'{len(found)} problem(s)'} ({summary(v, facts)})")
        problems += found
    if not args.no_objc:
        found = objc_problems()
        print(f"Objective-C API vs pyobjc metadata: {'ok' if not found else f'{len(found)} problem(s)'}")
        problems += found
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
