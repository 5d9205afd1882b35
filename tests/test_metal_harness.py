"""The raw-Metal harness (tests/support/metal_harness.py): on the host emulator here, on a real Metal device
where pyobjc and one are present (the hosted macOS job), and its pyobjc calls against pyobjc's metadata.

On Linux the harness's cases, layout, reference and comparison run against the host emulator
(bit for bit, as the emulator must match the reference), its judgement is checked on doctored
devices, and the ``.mm``'s call shape (``_metal.step`` lists of (handle, offset, numel)) runs
through the ``_metal`` stand-in. The Apple tests skip off a Mac; ``MFA_REQUIRE_METAL=1`` (set by
the hosted job) turns every skip into a failure except the two the device's limits explain: a
bfloat kernel without documented Metal 3.1 support, and torch's MPS stream not starting.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import metal_harness as mh
from emulated_mps import FakeMetalExt
import mps_fused_adam
from mps_fused_adam.backends.mps import KERNELS, METALLIB_NAME

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DRIVER = TESTS / "support" / "metal_pyobjc.py"


def require_metal() -> bool:
    return os.environ.get(mh.REQUIRE_ENV) == "1"


def skip_or_fail(reason: str, documented: bool = False) -> None:
    """Skip; where MFA_REQUIRE_METAL=1, fail unless ``documented`` (a limit of the device)."""
    if require_metal() and not documented:
        pytest.fail(f"{reason} ({mh.REQUIRE_ENV}=1)")
    pytest.skip(reason)


# --------------------------------------------------------------------------- the host emulator

def test_cases_cover_every_kernel_and_layout():
    cases = mh.cases()
    by_kernel = {k: [c for c in cases if c.kernel == k] for k in KERNELS.values()}
    for k, cs in by_kernel.items():
        assert cs, f"no case runs {k}"
        assert any(c.n % 4 for c in cs), f"{k}: no size with a tail"
        assert any(any(c.offsets) for c in cs), f"{k}: every tensor at offset 0"
        assert any(len(mh.dispatch_plan(c.n, c.chunk_threads)) > 1 for c in cs), f"{k}: never several dispatches"
        assert any(c.specials for c in cs), f"{k}: no NaN/Inf case"
    for c in cases:
        if c.rule in mh.LOWBIT:  # a dispatch must start on a block (256 or 128 elements)
            assert (4 * c.chunk_threads) % mh.LOWBIT[c.rule] == 0
    assert any(c.rule == "adam4bit" and c.n % 2 and c.n > 128 for c in cases)  # a padding nibble, blocks
    adam_modes = {c.mode for c in cases if c.rule == "adam" and c.kernel == "fused_adam_float_float"}
    assert len(adam_modes) == 8  # adamw/l2 x bias correction x maximize


# The most threads one threadgroup may hold on any Apple GPU (maxTotalThreadsPerThreadgroup).
THREADGROUP_LIMIT = 1024


def grid_shapes(case: mh.Case) -> list[tuple[int, int]]:
    """(threads, threadgroup width) of each dispatch DirectSubmit makes for ``case``."""
    return [(threads, min(case.group, threads)) for _, threads in mh.dispatch_plan(case.n, case.chunk_threads)]


def test_cases_dispatch_real_grids():
    """Every kernel runs dispatches of several threadgroups, ending in a partial one, with more
    threads than one threadgroup may hold, and one at the threadgroup limit itself."""
    for k in KERNELS.values():
        shapes = [s for c in mh.cases() if c.kernel == k for s in grid_shapes(c)]
        assert any(t > g and t % g for t, g in shapes), f"{k}: no dispatch ends in a partial threadgroup"
        assert any(t > THREADGROUP_LIMIT for t, _ in shapes), f"{k}: no dispatch above one threadgroup's limit"
        assert any(g == THREADGROUP_LIMIT and t > g for t, g in shapes), f"{k}: no threadgroup at the limit"
        assert any(-(-t // g) >= 5 for t, g in shapes), f"{k}: never five threadgroups or more"


def test_the_emulator_and_fake_metal_ran_those_grids(emu, fake_driver):
    """The grids reach the device as dispatched: the host emulator (which launches threadgroup
    by threadgroup, leaving out the threads past the grid) and the pyobjc driver over fake Metal
    record each dispatch's threads and threadgroup width; the results are bit-identical."""
    grid = [c for c in mh.cases() if c.n == mh.GRID_N and c.kernel in ("fused_adam_half_float",
                                                                     "fused_adam8bit_bfloat_uchar",
                                                                     "fused_adam4bit_half_uchar")]
    want = sorted((c.kernel, *s) for c in grid for s in grid_shapes(c) for _ in range(mh.STEPS))
    driver, lib = fake_driver
    for dev in (mh.EmulatorDevice(emu), driver.MetalDevice(str(lib))):
        before = len(emu.dispatches)
        reports = mh.run_all(dev, selected=grid, kernels={c.kernel for c in grid})
        assert mh.failures(reports, require=True) == []
        assert all(r.stats.identical == r.stats.elements and r.cases == 3 for r in reports.values())
        ran = sorted((d["name"], d["threads"], d["group"]) for d in emu.dispatches[before:])
        assert ran == want, dev.name
    assert (("fused_adam_half_float", 1501, 256) in want and ("fused_adam_half_float", 477, 96) in want
            and ("fused_adam8bit_bfloat_uchar", 1501, 1024) in want
            and ("fused_adam4bit_half_uchar", 477, 96) in want)


def one_per_kernel() -> list[mh.Case]:
    """The largest case of each kernel (a tail, offsets, several dispatches, NaN/Inf), for the
    tests of the call paths, which the cases of one kernel exercise alike."""
    return list({c.kernel: c for c in sorted(mh.cases(), key=lambda c: c.n)}.values())


def test_every_kernel_on_the_emulator_is_bit_identical(emu, capsys):
    dev = mh.EmulatorDevice(emu)
    reports = mh.run_all(dev)
    with capsys.disabled():
        print("\n" + mh.report_text(dev, reports))
    assert mh.failures(reports, require=True) == []
    for rep in reports.values():
        assert rep.ok and rep.cases > 0 and rep.stats.identical == rep.stats.elements, rep.line()
    assert dev.runs == sum(mh.STEPS for _ in mh.cases())  # one command buffer per step


def test_the_mm_call_shape_on_the_emulator(emu, tmp_path):
    """_metal.step's (handle, byte offset, numel) lists over the harness's buffers, through the
    stand-in of the .mm (which adds the offset to the handle, as setBuffer:offset: does)."""
    lib = tmp_path / METALLIB_NAME
    lib.write_bytes(b"MTLB placeholder")
    ext = FakeMetalExt(emu)
    ext.load(str(lib), sorted(KERNELS.values()))
    dev = mh.EmulatorDevice(emu)
    reports = mh.run_all(dev, mh.ExtSubmit(ext, lambda: None), selected=one_per_kernel())
    assert mh.failures(reports, require=True) == []
    assert all(r.cases == 1 and r.stats.identical == r.stats.elements for r in reports.values())
    assert len(ext.calls) == mh.STEPS * len(KERNELS)
    kernel, lists, scalars = ext.calls[0]
    assert all(isinstance(x, int) for lst in lists for triple in lst for x in triple)


class Doctored(mh.EmulatorDevice):
    """The emulator, then ``spoil(kernel, dispatch)`` on the result of each run."""

    def __init__(self, emu, spoil):
        super().__init__(emu)
        self.spoil = spoil

    def run(self, kernel, dispatches):
        super().run(kernel, dispatches)
        self.spoil(kernel, dispatches[0])


ONE = [c for c in mh.cases() if c.kernel == "fused_adam_float_float" and c.n == 67][:2]


@pytest.mark.parametrize("what", ["one_ulp", "large", "nan", "outside", "code", "code4"])
def test_the_harness_judges_a_wrong_device(emu, what):
    """A last-bit difference is reported (identity below 100%) but passes the bound; a large
    error, a NaN the reference lacks, a write outside the tensor or a changed 8-bit or 4-bit code
    (one nibble) fail."""
    def spoil(kernel, d):
        buf, off = d.bindings[0]
        p = buf.host[off:off + 16].view(torch.float32)
        if what == "one_ulp":
            p.view(torch.int32)[0] ^= 1
        elif what == "large":
            p[0] += 1.0
        elif what == "nan":
            p[2] = float("nan")
        elif what == "outside":
            buf.host[off - 1] = 0
        elif what.startswith("code") and kernel.startswith(("fused_adam8bit", "fused_adam4bit")):
            c1, c1_off = d.bindings[2]
            c1.host[c1_off] ^= 1
    codes_of = {"code": "fused_adam8bit_float_uchar", "code4": "fused_adam4bit_float_uchar"}
    selected = ONE if what not in codes_of else [c for c in mh.cases() if c.kernel == codes_of[what]][:1]
    reports = mh.run_all(Doctored(emu, spoil), selected=selected, kernels={selected[0].kernel})
    rep = reports[selected[0].kernel]
    assert rep.stats.identical < rep.stats.elements or rep.stats.problems
    if what == "one_ulp":
        assert mh.failures(reports) == [] and 1 <= rep.stats.worst_ulps <= 4  # 1 ulp per step, 3 steps
    else:
        assert mh.failures(reports), rep.line()


def test_skips_under_require_metal(emu):
    """A kernel the device cannot run fails the run under MFA_REQUIRE_METAL unless documented."""
    class Limited(mh.EmulatorDevice):
        def prepare(self, kernel):
            if kernel == "fused_lion_half_half":
                raise mh.KernelUnavailable("pipeline failed", documented=False)
            if kernel == "fused_lion_bfloat_bfloat":
                raise mh.KernelUnavailable("no bfloat", documented=True)

    kernels = {"fused_lion_half_half", "fused_lion_bfloat_bfloat", "fused_lion_float_float"}
    selected = [c for c in mh.cases() if c.kernel in kernels]
    reports = mh.run_all(Limited(emu), selected=selected, kernels=kernels)
    assert mh.failures(reports, require=False) == []
    assert [f.split(":")[0] for f in mh.failures(reports, require=True)] == ["fused_lion_half_half"]
    assert reports["fused_lion_float_float"].ok


# --------------------------------------------------------------------------- the driver on fake pyobjc

@pytest.fixture
def fake_driver(emu, monkeypatch, tmp_path):
    """tests/support/metal_pyobjc.py imported over tests/support/fake_pyobjc.py's Metal, Foundation and objc,
    and a placeholder metallib: (the module, the metallib path)."""
    import fake_pyobjc
    for name, module in fake_pyobjc.modules(emu).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "metal_pyobjc", None)  # restored (or removed) afterwards
    del sys.modules["metal_pyobjc"]
    import platform
    monkeypatch.setattr(platform, "mac_ver", lambda: ("15.5", ("", "", ""), "arm64"))
    import metal_pyobjc
    lib = tmp_path / METALLIB_NAME
    lib.write_bytes(b"MTLB placeholder")
    return metal_pyobjc, lib


def test_the_pyobjc_driver_on_fake_metal(fake_driver, capsys):
    """The Apple-only driver's own logic (buffer indices of the scalars, base and n; shared
    buffers through contents(); one command buffer per step) on Linux, every kernel."""
    driver, lib = fake_driver
    dev = driver.MetalDevice(str(lib))
    reports = mh.run_all(dev, selected=one_per_kernel())
    text = mh.report_text(dev, reports)
    assert "GPU families: Apple5 yes, Apple6 no, Apple7 no, Apple8 no, Apple9 no, Metal3 yes; " \
           "bfloat (Metal 3.1 on a Metal 3 GPU): documented" in text and "macOS 15.5" in text
    assert "from MTLCopyAllDevices()[0]" in text
    assert mh.failures(reports, require=True) == []
    assert all(r.stats.identical == r.stats.elements for r in reports.values())


def test_the_pyobjc_driver_reports_bfloat_as_a_device_limit(fake_driver, monkeypatch):
    """Without the Metal 3 family a bfloat pipeline that fails is a documented skip; any other
    kernel's failure is not."""
    driver, lib = fake_driver
    dev = driver.MetalDevice(str(lib))
    dev.families["Metal3"] = False
    monkeypatch.setattr(dev.dev, "newComputePipelineStateWithFunction_error_", lambda fn, err: (None, "refused"))
    with pytest.raises(mh.KernelUnavailable) as bf:
        dev.prepare("fused_adam_bfloat_float")
    with pytest.raises(mh.KernelUnavailable) as f32:
        dev.prepare("fused_adam_float_float")
    assert bf.value.documented and not f32.value.documented and "refused" in f32.value.reason


def test_the_mm_child_on_fake_metal(fake_driver, emu, monkeypatch, capsys):
    """mm_main's probe and its run through _metal (here the stand-in of the .mm)."""
    driver, lib = fake_driver
    import mps_fused_adam
    ext = FakeMetalExt(emu)
    monkeypatch.setitem(sys.modules, "mps_fused_adam._metal", ext)
    monkeypatch.setattr(mps_fused_adam, "_metal", ext, raising=False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)

    def broken():
        raise RuntimeError("MPS backend out of memory")
    monkeypatch.setattr(torch.mps, "synchronize", broken)
    driver.mm_main(str(lib))
    out = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert out == [{"stream": "torch.mps.synchronize() raised RuntimeError: MPS backend out of memory"}]
    monkeypatch.setattr(torch.mps, "synchronize", lambda: None)
    driver.mm_main(str(lib), one_per_kernel())
    out = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert out[0] == {"stream": "ok"} and out[1]["failures"] == [], out
    assert len(ext.calls) == mh.STEPS * len(KERNELS) and ext.loaded == [str(lib)]


# --------------------------------------------------------------------------- a real Metal device

def installed_metallib() -> Path:
    import mps_fused_adam
    return Path(mps_fused_adam.__file__).resolve().parent / METALLIB_NAME


def metal_device():
    if sys.platform != "darwin":
        skip_or_fail(f"needs macOS with a Metal device (this is {sys.platform})")
    try:
        import metal_pyobjc
    except ImportError as exc:
        skip_or_fail(f"pyobjc-framework-Metal is not importable: {exc}")
    lib = installed_metallib()
    if not lib.is_file():
        skip_or_fail(f"the installed package has no {lib.name} (a build without the Metal toolchain)")
    return metal_pyobjc.MetalDevice(str(lib))


@pytest.fixture(scope="module")
def device_reports():
    """Every case on this machine's Metal device, run once: (device, per-kernel reports)."""
    dev = metal_device()
    return dev, mh.run_all(dev)


def test_this_metal_device_report(device_reports, capsys):
    """The device's name and GPU families first, then one line per kernel (the job's log)."""
    dev, reports = device_reports
    with capsys.disabled():
        print("\n" + mh.report_text(dev, reports))
    assert set(reports) == set(KERNELS.values())


@pytest.mark.parametrize("kernel", sorted(KERNELS.values()))
def test_kernel_on_this_metal_device(device_reports, kernel):
    rep = device_reports[1][kernel]
    if rep.skipped is not None:
        skip_or_fail(f"{kernel}: {rep.skipped}", documented=rep.documented_skip)
    assert rep.ok, rep.line()


def test_the_mm_on_this_metal_device(capsys):
    """_metal.load/_metal.step on buffers the harness made, on torch's MPS stream, in a child
    process. torch's MPS stream not starting (hosted runners) is a skip with what failed."""
    metal_device()  # the same preconditions (and skips) as the raw-Metal test
    proc = subprocess.run([sys.executable, str(DRIVER), "--mm", str(installed_metallib())],
                          capture_output=True, text=True, timeout=900, cwd=str(TESTS))
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    stream = next((l["stream"] for l in lines if "stream" in l), None)
    tail = (proc.stderr or "").strip()[-2000:]
    if stream is None:
        skip_or_fail(f"torch's MPS stream did not start: the child exited {proc.returncode} before "
                     f"the probe finished; stderr: {tail}", documented=True)
    if stream != "ok":
        skip_or_fail(f"torch's MPS stream cannot start: {stream}", documented=True)
    result = next((l for l in lines if "report" in l), None)
    assert result is not None, f"the .mm run died after the stream started (exit {proc.returncode}): {tail}"
    with capsys.disabled():
        print("\n_metal (the .mm) on torch's MPS stream:\n" + result["report"])
    assert result["failures"] == []


# --------------------------------------------------------------------------- pyobjc's metadata

# Methods the driver calls that are pyobjc's or Python's, not Objective-C selectors.
PYTHON_SIDE = {"as_buffer": "pyobjc's varlist: a writable memoryview of a void* result",
               "items": "dict", "join": "str", "split": "str", "pyobjc_id": "objc: the object's address",
               "mac_ver": "platform", "machine": "platform", "pack": "struct", "frombuffer": "torch",
               "dumps": "json", "is_available": "torch", "synchronize": "torch", "load": "_metal",
               "exit": "sys", "isdigit": "str"}
# Enum values the driver relies on (Apple's MTLGPUFamily, MTLResourceOptions, MTLCommandBufferStatus).
CONSTANTS = {"MTLGPUFamilyApple5": 1005, "MTLGPUFamilyApple6": 1006, "MTLGPUFamilyApple7": 1007,
             "MTLGPUFamilyApple8": 1008, "MTLGPUFamilyApple9": 1009, "MTLGPUFamilyMetal3": 5001,
             "MTLResourceStorageModeShared": 0, "MTLCommandBufferStatusCompleted": 4}


def pyobjc_calls(text: str) -> tuple[list[tuple[str, ast.Call, ast.AST | None]], set[str]]:
    """(every ``x.name(...)`` call with the node it is assigned to, every ``Metal.X`` name)."""
    tree = ast.parse(text)
    parent = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    calls, metal_names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Metal":
            metal_names.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            calls.append((node.func.attr, node, parent.get(id(node))))
    return calls, metal_names


def check_driver(text: str, metadata: str, mm_text: str) -> list[str]:
    """The driver's selectors, functions and constants against pyobjc-framework-Metal's
    ``_metadata.py``: name, argument count, out-arguments (passed None, result unpacked as a
    pair), MTLSize arguments; a selector absent there must be one metal_adam.mm sends (whose
    selectors ci/apple_artifacts.py checks)."""
    import apple_artifacts as aa
    selectors, functions = aa.parse_pyobjc_metadata(metadata)
    problems = []
    calls, metal_names = pyobjc_calls(text)
    own = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
    for name in sorted(metal_names):
        if name in functions:
            continue
        if name == "MTLSize":
            if '"Metal.MTLSize", b"{MTLSize=QQQ}"' not in metadata:
                problems.append("Metal.MTLSize: not the {MTLSize=QQQ} struct type in the metadata")
            continue
        found = re.findall(rf"\${name}@(-?\d+)\$", metadata)
        if not found:
            problems.append(f"Metal.{name}: neither a function nor an enum constant in the metadata")
        elif CONSTANTS.get(name) is not None and int(found[0]) != CONSTANTS[name]:
            problems.append(f"Metal.{name} = {found[0]}, the driver expects {CONSTANTS[name]}")
    for fn in ("MTLCreateSystemDefaultDevice", "MTLCopyAllDevices"):
        if fn in metal_names and functions[fn][0] != b"@":
            problems.append(f"{fn}: returns {functions[fn][0]!r}, not an object")
    for attr, call, parent in calls:
        if isinstance(call.func.value, ast.Name) and call.func.value.id in ("Metal", "objc", "torch", "struct",
                                                                          "platform", "json", "sys"):
            continue
        if attr in PYTHON_SIDE or (attr in own and ast.unparse(call.func.value) == "self"):
            continue
        sel = attr.replace("_", ":")
        nargs = sel.count(":")
        if len(call.args) != nargs or call.keywords:
            problems.append(f"{attr}: {len(call.args)} arguments for the selector {sel} ({nargs})")
        entries = selectors.get(sel)
        if not entries:
            if f"{sel.split(':')[0]}" not in mm_text:
                problems.append(f"{sel}: not in pyobjc's Metal metadata and not sent by metal_adam.mm")
            continue
        meta = entries[0][1]
        for idx, arg in meta.get("arguments", {}).items():
            pos = idx - 2  # pyobjc numbers self and _cmd as 0 and 1
            if pos >= len(call.args):
                continue
            given = call.args[pos]
            if arg.get("type_modifier") == b"o":
                if not (isinstance(given, ast.Constant) and given.value is None):
                    problems.append(f"{sel}: out-argument {pos} must be passed as None")
                if not (isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Tuple)
                        and len(parent.targets[0].elts) == 2) and not isinstance(parent, ast.IfExp):
                    problems.append(f"{sel}: returns (result, error); the call must unpack a pair")
            if arg.get("type", b"").startswith(b"{MTLSize"):
                if not (isinstance(given, ast.Call) and ast.unparse(given.func) == "Metal.MTLSize"
                        and len(given.args) == 3):
                    problems.append(f"{sel}: argument {pos} must be Metal.MTLSize(w, h, d)")
            if arg.get("c_array_length_in_arg") is not None:
                length = call.args[arg["c_array_length_in_arg"] - 2]
                if ast.unparse(length) != f"len({ast.unparse(given)})":
                    problems.append(f"{sel}: the length argument must be len() of the bytes passed")
    return problems


def _metal_metadata() -> str:
    sys.path.insert(0, str((REPO / "ci" / "apple_artifacts.py").parent))
    try:
        import apple_artifacts as aa
    except ImportError:
        pytest.skip("needs ci/apple_artifacts.py (a source checkout or cibuildwheel's test-sources)")
    from conftest import cannot_run
    try:
        wheel = aa.download_wheel(aa.PYOBJC["Metal"])
    except aa.Unavailable as exc:
        if require_metal():
            pytest.fail(f"{exc} ({mh.REQUIRE_ENV}=1)")
        cannot_run(str(exc))
    return aa.extract(wheel, "Metal/_metadata.py").read_text()


def test_pyobjc_calls_match_metadata():
    metadata = _metal_metadata()
    mm = (REPO / "src" / "metal" / "metal_adam.mm").read_text()
    text = DRIVER.read_text()
    assert check_driver(text, metadata, mm) == []
    # The check bites: a wrong argument count, an out-argument not passed None, an unknown
    # selector and a wrong constant are each reported.
    for old, new in (("setBuffer_offset_atIndex_(buf.keep, off, i)", "setBuffer_offset_atIndex_(buf.keep, off)"),
                     ("newLibraryWithURL_error_(Foundation.NSURL.fileURLWithPath_(metallib), None)",
                      "newLibraryWithURL_error_(Foundation.NSURL.fileURLWithPath_(metallib), 0)"),
                     ("cb.waitUntilCompleted()", "cb.waitUntilDone()"),
                     ("Metal.MTLGPUFamilyApple9", "Metal.MTLGPUFamilyApple99"),
                     ("Metal.MTLSize(group, 1, 1)", "(group, 1, 1)")):
        assert old in text, old
        assert check_driver(text.replace(old, new), metadata, mm), f"not caught: {new}"


def test_the_driver_is_the_only_pyobjc_code():
    """The Apple-only surface of the harness is tests/support/metal_pyobjc.py alone, and stays small."""
    importers = []
    # The package as installed (a wheel's test run has no python/ folder) and the CI scripts that
    # cibuildwheel's test-sources copy.
    package = Path(mps_fused_adam.__file__).resolve().parent
    ci_scripts = [REPO / "ci" / "apple_artifacts.py", REPO / "ci" / "check_wheel.py", REPO / "ci" / "readme_setup.py"]
    for path in [*TESTS.rglob("*.py"), *package.rglob("*.py"), *[p for p in ci_scripts if p.exists()]]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if names & {"Metal", "Foundation", "objc", "AppKit", "Quartz"}:
            importers.append(path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path))
    assert importers == ["tests/support/metal_pyobjc.py"]
    code = [l for l in DRIVER.read_text().splitlines() if l.strip() and not l.strip().startswith("#")]
    assert len(code) < 150, len(code)
