"""The Metal path against the real macOS artifacts that reach Linux (ci/apple_artifacts.py).

The torch macOS arm64 wheels of every release from TIER1_MIN_TORCH to the newest that PyPI's
index lists now (pip's machine-wide configuration left out for that look-up and the downloads:
apple_artifacts.uncapped_pip_env; MFA_ARTIFACT_TORCH="2.8.0 2.9.0 ..." names releases instead)
and the pyobjc Metal/Foundation/libdispatch wheels are downloaded once into a cache (never
installed) and read with llvm-nm-19 / llvm-objdump-19 and clang; what is read from each torch
wheel is kept as JSON and the wheel deleted (apple_artifacts.torch_facts). Without network or
tools these tests skip with the reason, and fail where MFA_REQUIRE_TOOLS=1 (CI). Each check is
also run on a doctored copy of its input, to show that it finds exactly what was removed or changed.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import cannot_run, require_tool
from mps_fused_adam.backends import mps as mps_backends
from mps_fused_adam.backends.mps import HOOKS_CURRENT_STREAM_MIN_TORCH, TIER1_MIN_TORCH

REPO = Path(__file__).resolve().parents[1]
CHECKER = REPO / "ci" / "apple_artifacts.py"
if not CHECKER.is_file():
    pytest.skip("needs ci/apple_artifacts.py (copied by cibuildwheel's test-sources and present in a checkout)",
                allow_module_level=True)
_spec = importlib.util.spec_from_file_location("apple_artifacts", CHECKER)
aa = importlib.util.module_from_spec(_spec)
sys.modules["apple_artifacts"] = aa
_spec.loader.exec_module(aa)

pytestmark = pytest.mark.skipif(not aa.MM.is_file(), reason="needs the source tree (src/, ci/)")

MM_TEXT = aa.MM.read_text() if aa.MM.is_file() else ""


def _torch_versions() -> list[str]:
    """The releases to read: MFA_ARTIFACT_TORCH, else every release from TIER1_MIN_TORCH to PyPI's
    newest (one index look-up at collection; without an index, one placeholder whose fixture
    says why)."""
    named = os.environ.get("MFA_ARTIFACT_TORCH", "").split()
    if named:
        return named
    try:
        found = aa.torch_releases_since(TIER1_MIN_TORCH)
    except aa.Unavailable as exc:
        return [f"unavailable: {exc}"]
    return found if aa.TORCH_CI in found else sorted({*found, aa.TORCH_CI})


TORCH_VERSIONS = _torch_versions()


def _fetch(fn, *args):
    try:
        return fn(*args)
    except aa.Unavailable as exc:
        cannot_run(str(exc))


class TorchWheel:
    """What the checks read from one torch release's wheel (apple_artifacts.torch_facts)."""

    def __init__(self, version: str) -> None:
        if version.startswith("unavailable: "):
            cannot_run(f"cannot list torch's macOS arm64 releases: {version}")
        require_tool("llvm-nm-19", "llvm-objdump-19")
        self.version = version
        facts = _fetch(aa.torch_facts, version)
        self.nm = facts["nm"]
        self.dylib_id = facts["dylib_id"]
        self.mps_init = facts["mps_init"]
        self.disasm = facts["disasm"]
        self.stubs = facts["stubs"]
        self.aoti_binding = facts["aoti_binding"]
        self.get_command_buffer = aa.disassembly_by_symbol(self.disasm)[aa.GET_COMMAND_BUFFER]
        self.hooks = aa.hook_facts(self.disasm, self.stubs)


_wheels: dict[str, TorchWheel] = {}


@pytest.fixture(scope="module", params=TORCH_VERSIONS)
def torch_wheel(request) -> TorchWheel:
    if request.param not in _wheels:
        _wheels[request.param] = TorchWheel(request.param)
    return _wheels[request.param]


@pytest.fixture(scope="module")
def ci_wheel() -> TorchWheel:
    if aa.TORCH_CI not in _wheels:
        _wheels[aa.TORCH_CI] = TorchWheel(aa.TORCH_CI)
    return _wheels[aa.TORCH_CI]


def test_releases_run_from_the_tier1_minimum_to_the_newest():
    """The default list is every final release from TIER1_MIN_TORCH on, and reaches past the
    machine's pip cap (2.14.1 here): 2.15.0 is PyPI's newest macOS arm64 release (2026-12)."""
    if os.environ.get("MFA_ARTIFACT_TORCH"):
        pytest.skip("MFA_ARTIFACT_TORCH names the releases")
    if TORCH_VERSIONS[0].startswith("unavailable: "):
        cannot_run(TORCH_VERSIONS[0])
    keys = [tuple(map(int, v.split("."))) for v in TORCH_VERSIONS]
    assert keys == sorted(keys) and keys[0][:2] == TIER1_MIN_TORCH
    assert {"2.9.0", "2.13.0", "2.14.1", "2.15.0"} <= set(TORCH_VERSIONS)


def test_pip_cap_is_left_out_for_the_downloads_only():
    """pip's index look-up and downloads run without any configuration file (where this machine's
    ``torch<=2.14.1`` constraint lives: /etc/xdg/pip), constraint or local wheel folder; the rest of
    the environment is kept, and this process's own is not changed. That it works is shown by the
    2.15.0 case of the tests below, which a capped pip cannot download."""
    env = aa.uncapped_pip_env({"PIP_CONSTRAINT": "/etc/c.txt", "PIP_FIND_LINKS": "/opt/wheels", "HOME": "/h",
                               "PIP_CONFIG_FILE": "/etc/xdg/pip/pip.conf", "PIP_DEFAULT_TIMEOUT": "180"})
    assert env == {"PIP_CONFIG_FILE": os.devnull, "HOME": "/h", "PIP_DEFAULT_TIMEOUT": "180"}
    assert os.environ.get("PIP_CONFIG_FILE") != os.devnull


# ----------------------------------------------------------------------------- torch wheel

def test_libtorch_exports_the_names_metal_looks_up(torch_wheel):
    names = aa.mm_torch_symbols(MM_TEXT)
    # torch::mps::commit() is not among them: tier 1 leaves committing to PyTorch
    # (test_metal_sources.py::test_step_encodes_on_the_callers_stream_without_committing).
    assert names == ["_ZN5torch3mps18get_command_bufferEv", "_ZN5torch3mps18get_dispatch_queueEv"]
    assert aa.check_exports(torch_wheel.nm, names) == []
    # Doctored: each symbol removed in turn, or its signature changed, is reported by name.
    for name in names:
        doctored = "\n".join(l for l in torch_wheel.nm.splitlines() if not l.endswith(" _" + name))
        assert aa.check_exports(doctored, names) == [
            f"libtorch_cpu.dylib does not export {name} (dlsym name {name}; Mach-O symbol _{name})"]
    renamed = torch_wheel.nm.replace("_ZN5torch3mps18get_dispatch_queueEv", "_ZN5torch3mps18get_dispatch_queueEb")
    assert len(aa.check_exports(renamed, names)) == 1
    # An undefined reference is not an export.
    undefined = re.sub(r"\S+ T (__ZN5torch3mps18get_dispatch_queueEv)", r"U \1", torch_wheel.nm)
    assert len(aa.check_exports(undefined, names)) == 1


def test_libtorch_exports_the_c_shim_the_step_plans_use(torch_wheel):
    """On macOS the step plans look torch's AOTInductor C shim up in the loaded libtorch_cpu.dylib
    (src/cpu/tensor_handles.cpp) and make handles with torch._C._aoti's binding: both must be in
    the macOS wheel, or the plans fall back to reading Python attributes there."""
    names = aa.shim_symbols(aa.TENSOR_HANDLES.read_text())
    assert names == sorted(["aoti_torch_get_data_ptr", "aoti_torch_get_dtype", "aoti_torch_get_device_type",
                            "aoti_torch_get_device_index", "aoti_torch_get_dim", "aoti_torch_get_sizes",
                            "aoti_torch_is_contiguous", "aoti_torch_delete_tensor_object", "aoti_torch_get_layout",
                            "aoti_torch_layout_strided"])
    assert aa.check_exports(torch_wheel.nm, names) == []
    doctored = "\n".join(l for l in torch_wheel.nm.splitlines() if not l.endswith(" _aoti_torch_is_contiguous"))
    assert aa.check_exports(doctored, names) == [
        "libtorch_cpu.dylib does not export aoti_torch_is_contiguous (dlsym name aoti_torch_is_contiguous; "
        "Mach-O symbol _aoti_torch_is_contiguous)"]
    # The path step_plan.py builds: torch/lib/libtorch_cpu.dylib (what was read); the binding's name
    # is a string in libtorch_python.dylib.
    assert aa.LIBTORCH == "torch/lib/libtorch_cpu.dylib"
    assert torch_wheel.aoti_binding


def test_libtorch_image_name_is_what_metal_searches_for(torch_wheel):
    suffix = aa.mm_image_suffix(MM_TEXT)
    assert suffix == "/libtorch_cpu.dylib"
    assert torch_wheel.dylib_id == "@rpath/libtorch_cpu.dylib"
    assert aa.check_image_name(torch_wheel.dylib_id, suffix) == []
    assert aa.check_image_name("@rpath/libtorch_cpu.2.13.dylib", suffix) != []
    assert aa.check_image_name("@rpath/libtorch.dylib", suffix) != []


def test_torch_mps_python_api_is_what_tiers_2_and_3_call(torch_wheel):
    need = torch_wheel.version == aa.TORCH_CI
    problems, have = aa.check_mps_api(torch_wheel.mps_init, need_load_metallib=need)
    assert problems == []
    assert have["compile_shader"]
    if need:
        assert have["load_metallib"]
    # Doctored copies of the wheel's file.
    text = torch_wheel.mps_init
    renamed = text.replace("def compile_shader(", "def compile_shaders(")
    assert aa.check_mps_api(renamed, need)[0] == ["torch/mps/__init__.py has no compile_shader()"]
    extra = text.replace("def compile_shader(source: str)", "def compile_shader(source: str, options)")
    assert aa.check_mps_api(extra, need)[0] == [
        "torch.mps.compile_shader takes ['source', 'options'], backends/mps.py passes one positional argument"]
    if have["load_metallib"]:
        no_paths = text.replace("os.PathLike", "bytes")
        assert aa.check_mps_api(no_paths, need)[0] == [
            "torch.mps.load_metallib does not accept an os.PathLike (backends/mps.py passes a Path)"]
        gone = text.replace("def load_metallib(", "def _load_metallib(")
        assert aa.check_mps_api(gone, need_load_metallib=True)[0] == ["torch/mps/__init__.py has no load_metallib()"]


def test_tier1_gate_agrees_with_get_command_buffer(torch_wheel):
    disasm = torch_wheel.get_command_buffer
    admitted = tuple(map(int, torch_wheel.version.split(".")[:2])) >= TIER1_MIN_TORCH
    assert aa.coalesces_before_command_buffer(disasm) == admitted
    assert aa.check_gate(torch_wheel.version, disasm, TIER1_MIN_TORCH) == []
    # The command-line checker reads the gate from the source text the same way.
    assert aa.tier1_min_torch(Path(mps_backends.__file__).read_text()) == TIER1_MIN_TORCH
    if admitted:
        # Doctored: without the endKernelCoalescing call (as in torch 2.8.0) the gate is wrong.
        doctored = "\n".join(l for l in disasm.splitlines() if "endKernelCoalescing" not in l)
        assert len(aa.check_gate(torch_wheel.version, doctored, TIER1_MIN_TORCH)) == 1
        # A gate above this release would leave a safe release out.
        too_high = (int(torch_wheel.version.split(".")[0]), int(torch_wheel.version.split(".")[1]) + 1)
        assert len(aa.check_gate(torch_wheel.version, disasm, too_high)) == 1


# Disassemblies of at::mps::MPSHooks::getCommandBuffer from the macOS arm64 wheels (llvm-objdump-19
# -d --no-show-raw-insn), kept here so the gate's boundary is tested without two more downloads.
GET_COMMAND_BUFFER_2_8_0 = """
00000000051d3d64 <__ZNK2at3mps8MPSHooks16getCommandBufferEv>:
 51d3d64:      	stp	x29, x30, [sp, #-0x10]!
 51d3d68:      	mov	x29, sp
 51d3d6c:      	bl	0x51e1444 <__ZN2at3mps19getDefaultMPSStreamEv>
 51d3d70:      	ldp	x29, x30, [sp], #0x10
 51d3d74:      	b	0x51e09d4 <__ZN2at3mps9MPSStream13commandBufferEv>
"""
GET_COMMAND_BUFFER_2_9_0 = """
0000000005260f54 <__ZNK2at3mps8MPSHooks16getCommandBufferEv>:
 5260f54:      	stp	x20, x19, [sp, #-0x20]!
 5260f58:      	stp	x29, x30, [sp, #0x10]
 5260f5c:      	add	x29, sp, #0x10
 5260f60:      	bl	0x526e69c <__ZN2at3mps19getDefaultMPSStreamEv>
 5260f64:      	mov	x19, x0
 5260f68:      	bl	0x526ddcc <__ZN2at3mps9MPSStream19endKernelCoalescingEv>
 5260f6c:      	mov	x0, x19
 5260f70:      	ldp	x29, x30, [sp, #0x10]
 5260f74:      	ldp	x20, x19, [sp], #0x20
 5260f78:      	b	0x526dbd8 <__ZN2at3mps9MPSStream13commandBufferEv>
"""


def test_tier1_gate_boundary_from_recorded_disassembly():
    """2.8.0 does not end kernel coalescing, 2.9.0 does: the gate must sit exactly at 2.9
    (MFA_ARTIFACT_TORCH="2.8.0 2.9.0" re-reads both from the wheels)."""
    assert TIER1_MIN_TORCH == (2, 9)
    assert not aa.coalesces_before_command_buffer(GET_COMMAND_BUFFER_2_8_0)
    assert aa.coalesces_before_command_buffer(GET_COMMAND_BUFFER_2_9_0)
    assert aa.check_gate("2.8.0", GET_COMMAND_BUFFER_2_8_0, TIER1_MIN_TORCH) == []
    assert aa.check_gate("2.9.0", GET_COMMAND_BUFFER_2_9_0, TIER1_MIN_TORCH) == []
    assert len(aa.check_gate("2.8.0", GET_COMMAND_BUFFER_2_8_0, (2, 8))) == 1
    assert len(aa.check_gate("2.9.0", GET_COMMAND_BUFFER_2_9_0, (2, 10))) == 1


def test_hooks_take_the_stream_the_gate_says(torch_wheel):
    """torch::mps's three hooks take the default stream before HOOKS_CURRENT_STREAM_MIN_TORCH and
    the calling thread's current stream from it on (all three alike, so the queue _metal syncs on
    and the command buffer it encodes into belong to one stream)."""
    hooks = torch_wheel.hooks
    current = tuple(map(int, torch_wheel.version.split(".")[:2])) >= HOOKS_CURRENT_STREAM_MIN_TORCH
    assert set(hooks) == {"getCommandBuffer", "getDispatchQueue", "commitStream"}
    assert {f["stream"] for f in hooks.values()} == {"current" if current else "default"}
    assert aa.check_streams(torch_wheel.version, hooks, HOOKS_CURRENT_STREAM_MIN_TORCH) == []
    assert aa.hooks_current_stream_min_torch(Path(mps_backends.__file__).read_text()) == HOOKS_CURRENT_STREAM_MIN_TORCH
    # getDispatchQueue never asserts (it is called off the queue, to find it).
    assert not hooks["getDispatchQueue"]["asserts_queue"]
    # Doctored: the other stream in every hook is three problems; a gate one release off is too.
    swapped = torch_wheel.disasm.replace("getCurrentMPSStream", "getXMPSStream").replace(
        "getDefaultMPSStream", "getCurrentMPSStream").replace("getXMPSStream", "getDefaultMPSStream")
    assert len(aa.check_streams(torch_wheel.version, aa.hook_facts(swapped, torch_wheel.stubs),
                                HOOKS_CURRENT_STREAM_MIN_TORCH)) == 3
    major, minor = map(int, torch_wheel.version.split(".")[:2])
    off = (major, minor + 1) if current else (major, minor)
    if off != HOOKS_CURRENT_STREAM_MIN_TORCH:
        assert len(aa.check_streams(torch_wheel.version, hooks, off)) == 3


# The three hooks of torch 2.14.1 and 2.15.0 (llvm-objdump-19 -d --no-show-raw-insn), with the
# stub 2.15.0's call (llvm-objdump-19 --macho --indirect-symbols): the boundary without downloads.
HOOKS_2_14_1 = """
00000000049a0c18 <__ZNK2at3mps8MPSHooks12commitStreamEv>:
 49a0c18:      	stp	x29, x30, [sp, #-0x10]!
 49a0c1c:      	mov	x29, sp
 49a0c20:      	bl	0x49ae5ac <__ZN2at3mps19getDefaultMPSStreamEv>
 49a0c24:      	mov	w1, #0x1                ; =1
 49a0c28:      	ldp	x29, x30, [sp], #0x10
 49a0c2c:      	b	0x49ada18 <__ZN2at3mps9MPSStream11synchronizeENS0_8SyncTypeE>

00000000049a0c30 <__ZNK2at3mps8MPSHooks16getCommandBufferEv>:
 49a0c30:      	stp	x20, x19, [sp, #-0x20]!
 49a0c34:      	stp	x29, x30, [sp, #0x10]
 49a0c38:      	add	x29, sp, #0x10
 49a0c3c:      	bl	0x49ae5ac <__ZN2at3mps19getDefaultMPSStreamEv>
 49a0c40:      	mov	x19, x0
 49a0c44:      	bl	0x49adb80 <__ZN2at3mps9MPSStream19endKernelCoalescingEv>
 49a0c48:      	mov	x0, x19
 49a0c4c:      	ldp	x29, x30, [sp, #0x10]
 49a0c50:      	ldp	x20, x19, [sp], #0x20
 49a0c54:      	b	0x49ad958 <__ZN2at3mps9MPSStream13commandBufferEv>

00000000049a0c58 <__ZNK2at3mps8MPSHooks16getDispatchQueueEv>:
 49a0c58:      	stp	x29, x30, [sp, #-0x10]!
 49a0c5c:      	mov	x29, sp
 49a0c60:      	bl	0x49ae5ac <__ZN2at3mps19getDefaultMPSStreamEv>
 49a0c64:      	ldr	x0, [x0, #0x40]
 49a0c68:      	ldp	x29, x30, [sp], #0x10
 49a0c6c:      	ret
"""
HOOKS_2_15_0 = """
0000000004a2f8f4 <__ZNK2at3mps8MPSHooks12commitStreamEv>:
 4a2f8f4:      	stp	x20, x19, [sp, #-0x20]!
 4a2f8f8:      	stp	x29, x30, [sp, #0x10]
 4a2f8fc:      	add	x29, sp, #0x10
 4a2f900:      	bl	0x4a3e008 <__ZN2at3mps19getCurrentMPSStreamEv>
 4a2f904:      	mov	x19, x0
 4a2f908:      	ldr	x0, [x0, #0x40]
 4a2f90c:      	bl	0x5046aa0 <_zunmqr_+0x5046aa0>
 4a2f910:      	mov	x0, x19
 4a2f914:      	mov	w1, #0x1                ; =1
 4a2f918:      	ldp	x29, x30, [sp, #0x10]
 4a2f91c:      	ldp	x20, x19, [sp], #0x20
 4a2f920:      	b	0x4a3cbc4 <__ZN2at3mps9MPSStream11synchronizeENS0_8SyncTypeE>

0000000004a2f924 <__ZNK2at3mps8MPSHooks16getCommandBufferEv>:
 4a2f924:      	stp	x20, x19, [sp, #-0x20]!
 4a2f928:      	stp	x29, x30, [sp, #0x10]
 4a2f92c:      	add	x29, sp, #0x10
 4a2f930:      	bl	0x4a3e008 <__ZN2at3mps19getCurrentMPSStreamEv>
 4a2f934:      	mov	x19, x0
 4a2f938:      	ldr	x0, [x0, #0x40]
 4a2f93c:      	bl	0x5046aa0 <_zunmqr_+0x5046aa0>
 4a2f940:      	mov	x0, x19
 4a2f944:      	bl	0x4a3cccc <__ZN2at3mps9MPSStream19endKernelCoalescingEv>
 4a2f948:      	mov	x0, x19
 4a2f94c:      	ldp	x29, x30, [sp, #0x10]
 4a2f950:      	ldp	x20, x19, [sp], #0x20
 4a2f954:      	b	0x4a3cb04 <__ZN2at3mps9MPSStream13commandBufferEv>

0000000004a2f958 <__ZNK2at3mps8MPSHooks16getDispatchQueueEv>:
 4a2f958:      	stp	x29, x30, [sp, #-0x10]!
 4a2f95c:      	mov	x29, sp
 4a2f960:      	bl	0x4a3e008 <__ZN2at3mps19getCurrentMPSStreamEv>
 4a2f964:      	ldr	x0, [x0, #0x40]
 4a2f968:      	ldp	x29, x30, [sp], #0x10
 4a2f96c:      	ret
"""
STUBS_2_15_0 = """Indirect symbols for (__TEXT,__stubs) 1162 entries
address            index name
0x00000000050445c8 429818 _CFNumberGetValue
0x0000000005046aa0 430675 _dispatch_assert_queue$V2
Indirect symbols for (__DATA_CONST,__got) 1347 entries
address            index name
0x0000000005100000 430675 _dispatch_assert_queue$V2
"""


def test_stream_boundary_from_recorded_disassembly():
    """2.14.1's hooks take the default stream, 2.15.0's the current one; 2.15.0's getCommandBuffer
    and commitStream also assert that they run on that stream's queue (dispatch_assert_queue),
    which is why _metal calls both only inside its dispatch_sync on get_dispatch_queue()."""
    assert HOOKS_CURRENT_STREAM_MIN_TORCH == (2, 15)
    stubs = aa.stub_targets(STUBS_2_15_0)
    assert stubs == {"50445c8": "_CFNumberGetValue", "5046aa0": "_dispatch_assert_queue$V2"}
    old, new = aa.hook_facts(HOOKS_2_14_1, {}), aa.hook_facts(HOOKS_2_15_0, stubs)
    assert old == {h: {"stream": "default", "asserts_queue": False} for h in aa.HOOKS}
    assert new == {"getCommandBuffer": {"stream": "current", "asserts_queue": True},
                   "getDispatchQueue": {"stream": "current", "asserts_queue": False},
                   "commitStream": {"stream": "current", "asserts_queue": True}}
    # Without the stub table the assert is not seen: the disassembler names the stub after a
    # LAPACK routine.
    assert not aa.hook_facts(HOOKS_2_15_0, {})["getCommandBuffer"]["asserts_queue"]
    assert "_zunmqr_+0x5046aa0" in aa.call_targets(HOOKS_2_15_0)
    assert aa.check_streams("2.14.1", old, (2, 15)) == aa.check_streams("2.15.0", new, (2, 15)) == []
    assert len(aa.check_streams("2.14.1", old, (2, 14))) == 3
    assert len(aa.check_streams("2.15.0", new, (2, 16))) == 3
    # Both releases keep the coalescing that TIER1_MIN_TORCH rests on.
    for text in (HOOKS_2_14_1, HOOKS_2_15_0):
        assert aa.coalesces_before_command_buffer(aa.disassembly_by_symbol(text)[aa.GET_COMMAND_BUFFER])
    with pytest.raises(ValueError, match="neither"):
        aa.hook_stream(HOOKS_2_14_1.replace("getDefaultMPSStream", "getSomeStream"))


# ----------------------------------------------------------------------------- Objective-C API

@pytest.fixture(scope="module")
def objc(ci_wheel):
    clang = shutil.which("clang++") or require_tool("clang++")[0]
    texts = [aa.extract(_fetch(aa.download_wheel, aa.PYOBJC[key]), member).read_text(encoding="utf-8")
             for key, member in (("Metal", "Metal/_metadata.py"), ("Foundation", "Foundation/_metadata.py"),
                                 ("dispatch", "dispatch/_metadata.py"))]
    dylib = aa.extract(_fetch(aa.download_wheel, f"torch=={aa.TORCH_CI}"), aa.LIBTORCH)  # kept whole
    names, imports = aa.apple_symbols(dylib)
    return aa.declared_api(clang), texts, names, imports


def test_every_selector_and_function_matches_pyobjc_metadata(objc):
    decls, texts, names, imports = objc
    # What the .mm uses, as the stubs declare it (the .mm is parsed against them with -Werror).
    methods = {d["name"] for d in decls if d["kind"] == "method"}
    functions = {d["name"] for d in decls if d["kind"] == "function"}
    assert {"device", "computeCommandEncoder", "setBytes:length:atIndex:", "setBuffer:offset:atIndex:",
            "dispatchThreads:threadsPerThreadgroup:", "newLibraryWithURL:error:",
            "newComputePipelineStateWithFunction:error:", "newFunctionWithName:", "endEncoding",
            "setComputePipelineState:", "maxTotalThreadsPerThreadgroup", "stringWithUTF8String:",
            "UTF8String", "localizedDescription", "fileURLWithPath:"} == methods
    assert functions == {"dispatch_sync", "MTLSizeMake", "_dyld_image_count", "_dyld_get_image_name"}
    assert "MTLCreateSystemDefaultDevice" not in re.sub(r"//[^\n]*", "", MM_TEXT)
    assert aa.check_objc_api(decls, texts, MM_TEXT, names, imports) == []
    # The encodings really come from clang for arm64 macOS.
    enc = {d["name"]: d["encodings"] for d in decls}
    assert enc["setBytes:length:atIndex:"] == ["v", "r^v", "Q", "Q"]
    assert enc["dispatchThreads:threadsPerThreadgroup:"] == ["v", "{?=QQQ}", "{?=QQQ}"]
    assert enc["dispatch_sync"] == ["v", "@", "@?"]


def test_objc_check_finds_doctored_metadata_and_stubs(objc):
    decls, texts, names, imports = objc
    metal, foundation, dispatch = texts

    def problems(metal=metal, foundation=foundation, dispatch=dispatch, decls=decls, names=names,
                 imports=imports, mm=MM_TEXT):
        return aa.check_objc_api(decls, [metal, foundation, dispatch], mm, names, imports)

    # A selector gone from Metal's metadata (and from what Apple-built code sends).
    gone = metal.replace('b"setBuffer:offset:atIndex:"', 'b"setBuffer:offset:index:"')
    assert problems(metal=gone, names=names - {"setBuffer:offset:atIndex:"}) == [
        "-[MTLComputeCommandEncoder setBuffer:offset:atIndex:]: not in the pyobjc metadata, and not "
        "object-typed (['v', '@', 'Q', 'Q'])",
        "-[MTLComputeCommandEncoder setBuffer:offset:atIndex:]: not in the pyobjc metadata, nor among "
        "libtorch_cpu's selector names"]
    # An argument type changed: setBytes:length:atIndex:'s length as a 32-bit int.
    i = metal.index('b"setBytes:length:atIndex:"')
    changed = metal[:i] + metal[i:].replace('3: {"type": b"Q"}', '3: {"type": b"I"}', 1)
    assert problems(metal=changed) == [
        "-[MTLComputeCommandEncoder setBytes:length:atIndex:]: argument 2 is 'Q', the metadata says b'I'"]
    # A return type changed.
    i = metal.index('b"maxTotalThreadsPerThreadgroup"')
    ret = metal[:i] + metal[i:].replace('b"Q"', 'b"I"', 1)
    assert problems(metal=ret) == [
        "-[MTLComputePipelineState maxTotalThreadsPerThreadgroup]: returns 'Q', the metadata says b'I'"]
    # An extra argument in the metadata (a stub with too few arguments).
    i = metal.index('b"newFunctionWithName:"')
    extra = metal[:i] + metal[i:].replace('"arguments": {2: {"type": b"@"}}',
                                          '"arguments": {2: {"type": b"@"}, 3: {"type": b"Q"}}', 1)
    assert problems(metal=extra) == [
        "-[MTLLibrary newFunctionWithName:]: the metadata describes argument 3, the stub has 1"]
    # A C function's signature changed.
    i = dispatch.index('"dispatch_sync": (')
    sync = dispatch[:i] + dispatch[i:].replace('b"v@@?"', 'b"v@^v@?"', 1)
    assert problems(dispatch=sync) == ["dispatch_sync(): 2 arguments declared, the metadata has 3"]
    size = metal.replace('"MTLSizeMake": (b"{MTLSize=QQQ}QQQ",)', '"MTLSizeMake": (b"{MTLSize=III}III",)')
    assert len(problems(metal=size)) == 1
    # A libSystem function that Apple-built code does not import.
    assert problems(imports=imports - {"__dyld_get_image_name"}) == [
        "_dyld_get_image_name(): neither in the pyobjc metadata nor imported by libtorch_cpu.dylib"]
    # A stub declaration the .mm no longer uses.
    assert problems(mm=MM_TEXT.replace("endEncoding", "endEncodingX")) == [
        "endEncoding: declared in tests/support/objc_stubs but not used by metal_adam.mm"]
    assert problems(mm=MM_TEXT.replace("get_command_buffer().device;", "get_command_buffer();")) == [
        "device: declared in tests/support/objc_stubs but not used by metal_adam.mm"]


def test_encoding_helpers():
    assert aa.split_encoding("{MTLSize=QQQ}QQQ") == ["{MTLSize=QQQ}", "Q", "Q", "Q"]
    assert aa.split_encoding("v@@?") == ["v", "@", "@?"]
    assert aa.split_encoding("r^vQ^@") == ["r^v", "Q", "^@"]
    assert aa.split_encoding("{a={b=ii}[4f]}c") == ["{a={b=ii}[4f]}", "c"]
    assert aa.normalize_encoding("r*") == aa.normalize_encoding("^t") == "*"
    assert aa.normalize_encoding("{?=QQQ}") == aa.normalize_encoding(b"{MTLSize=QQQ}")
    assert aa.normalize_encoding("{?=QQI}") != aa.normalize_encoding(b"{MTLSize=QQQ}")
    assert aa.normalize_encoding("^@") != aa.normalize_encoding("@")
