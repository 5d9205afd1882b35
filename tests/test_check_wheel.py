"""ci/check_wheel.py against doctored wheels and sdists, and against the real wheel when CI names one.

The fake wheels are real zip archives with a correct RECORD and extension modules that are
minimal but well-formed ELF / Mach-O files, so each test changes exactly one thing and the
checker has to find exactly that.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import os
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

CHECKER = Path(__file__).resolve().parents[1] / "ci" / "check_wheel.py"
_spec = importlib.util.spec_from_file_location("check_wheel", CHECKER)
cw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cw)

VERSION = "0.1.0"
DIST_INFO = f"mps_fused_adam-{VERSION}.dist-info"


# ----------------------------------------------------------------------------- fake binaries

def fake_elf(machine: int = 62, needed: tuple[str, ...] = ("libc.so.6",)) -> bytes:
    """An ELF64 shared object holding only .dynstr and .dynamic (enough for DT_NEEDED)."""
    dynstr = b"\0"
    offsets = []
    for lib in needed:
        offsets.append(len(dynstr))
        dynstr += lib.encode() + b"\0"
    dynamic = b"".join(struct.pack("<qQ", 1, o) for o in offsets) + struct.pack("<qQ", 0, 0)
    dynstr_off = 64
    dynamic_off = dynstr_off + len(dynstr)
    shoff = dynamic_off + len(dynamic)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<HHI", header, 16, 3, machine, 1)  # ET_DYN
    struct.pack_into("<Q", header, 40, shoff)
    struct.pack_into("<HHHHHH", header, 52, 64, 0, 0, 64, 3, 0)

    def sh(sh_type, off, size, link=0):
        return struct.pack("<IIQQQQIIQQ", 0, sh_type, 0, 0, off, size, link, 0, 1, 0)

    sections = bytes(64) + sh(3, dynstr_off, len(dynstr)) + sh(6, dynamic_off, len(dynamic), link=1)
    return bytes(header) + dynstr + dynamic + sections


def fake_macho(cpu: int = 0x0100000C, minos=(14, 0), dylibs=("/usr/lib/libc++.1.dylib",)) -> bytes:
    cmds = [struct.pack("<IIIIII", 0x32, 24, 1, (minos[0] << 16) | (minos[1] << 8), 0, 0)]
    for lib in dylibs:
        name = lib.encode() + b"\0"
        size = (24 + len(name) + 7) // 8 * 8
        cmds.append(struct.pack("<IIIIII", 0xC, size, 24, 0, 0, 0) + name.ljust(size - 24, b"\0"))
    body = b"".join(cmds)
    return struct.pack("<IiiIIIII", 0xFEEDFACF, cpu, 0, 8, len(cmds), len(body), 0, 0) + body


# ----------------------------------------------------------------------------- fake wheels

def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_files(kind: str, py: str = "cp311", arch: str | None = None) -> dict[str, bytes]:
    """The files of a well-formed wheel for ``kind`` ('macos' or 'linux'), without dist-info."""
    digits = py[2:]
    files = {
        "mps_fused_adam/__init__.py": b"from ._version import __version__\n",
        "mps_fused_adam/_version.py": f'__version__ = "{VERSION}"\n'.encode(),
        "mps_fused_adam/metal/fused_adam.metal": b"kernel void adam() {}\n",
    }
    if kind == "macos":
        files[f"mps_fused_adam/_cpu.cpython-{digits}-darwin.so"] = fake_macho()
        files[f"mps_fused_adam/_metal.cpython-{digits}-darwin.so"] = fake_macho(
            dylibs=("/System/Library/Frameworks/Metal.framework/Versions/A/Metal",))
        files["mps_fused_adam/fused_adam.metallib"] = b"MTLB" + bytes(60)
    else:
        arch = arch or "x86_64"
        files[f"mps_fused_adam/_cpu.cpython-{digits}-{arch}-linux-gnu.so"] = fake_elf(
            machine={"x86_64": 62, "aarch64": 183}[arch])
    return files


def make_wheel(directory: Path, files: dict[str, bytes], plat: str, py: str = "cp311",
               wheel_tags: list[str] | None = None, license_text: bytes = b"Apache License 2.0\n",
               record: bool = True, name: str | None = None) -> Path:
    files = dict(files)
    tags = wheel_tags if wheel_tags is not None else [f"{py}-{py}-{p}" for p in plat.split(".")]
    files[f"{DIST_INFO}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                   + "".join(f"Tag: {t}\n" for t in tags)).encode()
    files[f"{DIST_INFO}/METADATA"] = f"Metadata-Version: 2.4\nName: mps-fused-adam\nVersion: {VERSION}\n".encode()
    if license_text is not None:
        files[f"{DIST_INFO}/licenses/LICENSE"] = license_text
    path = directory / (name or f"mps_fused_adam-{VERSION}-{py}-{py}-{plat}.whl")
    rows = [f"{n},{_hash(d)},{len(d)}" for n, d in files.items()]
    if record:
        rows.append(f"{DIST_INFO}/RECORD,,")
        files[f"{DIST_INFO}/RECORD"] = ("\n".join(rows) + "\n").encode()
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return path


MAC = "macosx_14_0_arm64"
LINUX_RAW = "linux_x86_64"
LINUX_REPAIRED = "manylinux_2_27_x86_64.manylinux_2_28_x86_64"


def problems_of(tmp_path, kind, plat, repaired=False, edit=None, **kw):
    files = wheel_files(kind, arch=kw.pop("arch", None))
    if edit:
        edit(files)
    return cw.check_wheel(make_wheel(tmp_path, files, plat, **kw), repaired=repaired)


def assert_one_problem(problems: list[str], *words: str) -> None:
    assert len(problems) == 1, problems
    for w in words:
        assert w in problems[0], problems


# ----------------------------------------------------------------------------- accepted

@pytest.mark.parametrize("kind,plat,repaired", [
    ("macos", MAC, True),
    ("linux", LINUX_RAW, False),
    ("linux", LINUX_REPAIRED, True),
    ("linux", "manylinux_2_28_x86_64", True),
])
def test_well_formed_wheel_passes(tmp_path, kind, plat, repaired):
    assert problems_of(tmp_path, kind, plat, repaired=repaired) == []


def test_well_formed_aarch64_wheel_passes(tmp_path):
    assert problems_of(tmp_path, "linux", "manylinux_2_28_aarch64", repaired=True, arch="aarch64") == []


# ----------------------------------------------------------------------------- rejected: contents

def test_missing_metallib(tmp_path):
    p = problems_of(tmp_path, "macos", MAC, edit=lambda f: f.pop("mps_fused_adam/fused_adam.metallib"))
    assert_one_problem(p, ".metallib")


def test_missing_metallib_says_which_name(tmp_path):
    p = problems_of(tmp_path, "macos", MAC, edit=lambda f: f.pop("mps_fused_adam/fused_adam.metallib"))
    assert p == ["no mps_fused_adam/fused_adam.metallib next to _metal (tiers 1 and 2 would be unavailable)"]


@pytest.mark.parametrize("other", ["mps_fused_adam/kernels.metallib", "mps_fused_adam/metal/fused_adam.metallib",
                                   "fused_adam.metallib"])
def test_metallib_under_another_name_is_refused(tmp_path, other):
    """The loader loads exactly mps_fused_adam/fused_adam.metallib: one under another name or
    place is refused, in place of it and beside it."""
    def renamed(f):
        f[other] = f.pop("mps_fused_adam/fused_adam.metallib")
    p = problems_of(tmp_path, "macos", MAC, edit=renamed)
    assert p == [f"{other}: a metallib other than mps_fused_adam/fused_adam.metallib, which is the only one loaded",
                 "no mps_fused_adam/fused_adam.metallib next to _metal (tiers 1 and 2 would be unavailable)"]
    def added(f):
        f[other] = f["mps_fused_adam/fused_adam.metallib"]
    (tmp_path / "beside").mkdir()
    assert problems_of(tmp_path / "beside", "macos", MAC, edit=added) == [
        f"{other}: a metallib other than mps_fused_adam/fused_adam.metallib, which is the only one loaded"]


def test_metallib_in_a_linux_wheel_is_refused(tmp_path):
    def add(f):
        f["mps_fused_adam/fused_adam.metallib"] = b"MTLB" + bytes(60)
    assert problems_of(tmp_path, "linux", "manylinux_2_28_x86_64", edit=add) == [
        "mps_fused_adam/fused_adam.metallib in a linux wheel (Metal runs on macOS only)"]


def test_checker_metallib_name_is_the_loaders():
    from mps_fused_adam.backends.mps import METALLIB_NAME
    assert cw.METALLIB == METALLIB_NAME


def test_missing_metal_extension(tmp_path):
    p = problems_of(tmp_path, "macos", MAC, edit=lambda f: f.pop("mps_fused_adam/_metal.cpython-311-darwin.so"))
    assert_one_problem(p, "_metal")


@pytest.mark.parametrize("kind,plat", [("macos", MAC), ("linux", LINUX_RAW)])
def test_missing_metal_source(tmp_path, kind, plat):
    p = problems_of(tmp_path, kind, plat, edit=lambda f: f.pop("mps_fused_adam/metal/fused_adam.metal"))
    assert_one_problem(p, ".metal sources")


def test_metal_source_missing_against_source_tree(tmp_path):
    # The wheel has one .metal file; the source tree has a second one the build forgot to install.
    path = make_wheel(tmp_path, wheel_files("linux"), LINUX_RAW)
    assert cw.check_wheel(path, metal_sources=["fused_adam.metal"]) == []
    assert_one_problem(cw.check_wheel(path, metal_sources=["fused_adam.metal", "other.metal"]), "other.metal")


@pytest.mark.parametrize("kind", ["macos", "linux"])
def test_missing_cpu_extension(tmp_path, kind):
    plat = MAC if kind == "macos" else LINUX_RAW
    p = problems_of(tmp_path, kind, plat,
                    edit=lambda f: [f.pop(n) for n in list(f) if "/_cpu." in n])
    assert_one_problem(p, "_cpu")


def test_cpu_extension_for_another_python(tmp_path):
    def swap(f):
        f["mps_fused_adam/_cpu.cpython-312-x86_64-linux-gnu.so"] = f.pop("mps_fused_adam/_cpu.cpython-311-x86_64-linux-gnu.so")
    assert_one_problem(problems_of(tmp_path, "linux", LINUX_RAW, edit=swap), "_cpu")


@pytest.mark.parametrize("kind,plat,lib", [
    ("macos", MAC, "mps_fused_adam/.dylibs/libtorch_cpu.dylib"),
    ("macos", MAC, "mps_fused_adam/.dylibs/libc10.dylib"),
    ("linux", LINUX_REPAIRED, "mps_fused_adam.libs/libtorch_cpu-1a2b3c4d.so"),
])
def test_bundled_libtorch(tmp_path, kind, plat, lib):
    p = problems_of(tmp_path, kind, plat, repaired=True, edit=lambda f: f.__setitem__(lib, b"\0" * 16))
    assert_one_problem(p, "bundled", lib)


@pytest.mark.parametrize("kind,plat,lib", [
    ("macos", MAC, "mps_fused_adam/.dylibs/libomp.dylib"),
    ("linux", LINUX_REPAIRED, "mps_fused_adam.libs/libgomp-a34b3233.so.1.0.0"),
    ("linux", LINUX_REPAIRED, "mps_fused_adam.libs/libiomp5-deadbeef.so"),
])
def test_bundled_openmp(tmp_path, kind, plat, lib):
    p = problems_of(tmp_path, kind, plat, repaired=True, edit=lambda f: f.__setitem__(lib, b"\0" * 16))
    assert_one_problem(p, "bundled", lib)


def test_extension_linking_openmp_is_rejected_even_when_not_bundled(tmp_path):
    def link_libomp(f):
        f["mps_fused_adam/_cpu.cpython-311-darwin.so"] = fake_macho(dylibs=("@rpath/libomp.dylib",))
    assert_one_problem(problems_of(tmp_path, "macos", MAC, edit=link_libomp), "links @rpath/libomp.dylib")

    def link_libgomp(f):
        f["mps_fused_adam/_cpu.cpython-311-x86_64-linux-gnu.so"] = fake_elf(needed=("libgomp.so.1", "libc.so.6"))
    assert_one_problem(problems_of(tmp_path, "linux", LINUX_RAW, edit=link_libgomp), "links libgomp.so.1")


@pytest.mark.parametrize("test_file", ["tests/test_optim.py", "mps_fused_adam/tests/helpers.py", "conftest.py"])
def test_tests_inside(tmp_path, test_file):
    p = problems_of(tmp_path, "linux", LINUX_RAW, edit=lambda f: f.__setitem__(test_file, b"def test(): pass\n"))
    assert_one_problem(p, "test file", test_file)


def test_empty_and_missing_license(tmp_path):
    path = make_wheel(tmp_path, wheel_files("linux"), LINUX_RAW, license_text=b"")
    assert_one_problem(cw.check_wheel(path), "empty")
    path.unlink()
    path = make_wheel(tmp_path, wheel_files("linux"), LINUX_RAW, license_text=None)
    assert_one_problem(cw.check_wheel(path), "no license")


def test_file_changed_after_record_written(tmp_path):
    path = make_wheel(tmp_path, wheel_files("linux"), LINUX_RAW)
    doctored = tmp_path / "doctored" / path.name
    doctored.parent.mkdir()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(doctored, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("metal/fused_adam.metal"):
                data += b"// edited\n"
            dst.writestr(item, data)
    assert_one_problem(cw.check_wheel(doctored), "hash mismatch", "fused_adam.metal")


def test_package_version_disagrees_with_wheel(tmp_path):
    p = problems_of(tmp_path, "linux", LINUX_RAW,
                    edit=lambda f: f.__setitem__("mps_fused_adam/_version.py", b'__version__ = "0.0.9"\n'))
    assert_one_problem(p, "_version.py", "0.0.9")


# ----------------------------------------------------------------------------- rejected: tags and binaries

@pytest.mark.parametrize("plat,word", [
    ("macosx_11_0_arm64", "macosx_14_0_arm64"),   # deployment target not honoured
    ("macosx_15_0_arm64", "macosx_14_0_arm64"),   # built against a newer SDK's default
    ("macosx_14_0_universal2", "macosx_14_0_arm64"),
])
def test_wrong_macos_tag(tmp_path, plat, word):
    assert_one_problem(problems_of(tmp_path, "macos", plat), word)


def test_unrepaired_linux_tag_rejected_when_repair_required(tmp_path):
    assert_one_problem(problems_of(tmp_path, "linux", LINUX_RAW, repaired=True), "not repaired")


def test_manylinux_newer_than_2_28(tmp_path):
    assert_one_problem(problems_of(tmp_path, "linux", "manylinux_2_34_x86_64", repaired=True), "glibc 2.34")


def test_unsupported_platform(tmp_path):
    p = problems_of(tmp_path, "linux", "win_amd64")
    assert any("not a supported platform" in x for x in p), p


def test_wheel_metadata_tags_disagree_with_file_name(tmp_path):
    p = problems_of(tmp_path, "linux", LINUX_RAW, wheel_tags=["cp311-cp311-linux_aarch64"])
    assert_one_problem(p, "WHEEL tags")


def test_extension_built_for_the_wrong_architecture(tmp_path):
    def wrong(f):
        f["mps_fused_adam/_cpu.cpython-311-x86_64-linux-gnu.so"] = fake_elf(machine=183)
    assert_one_problem(problems_of(tmp_path, "linux", LINUX_RAW, edit=wrong), "built for aarch64")

    def x86_mac(f):  # what a macOS cross build that ignores CMAKE_OSX_ARCHITECTURES would give
        f["mps_fused_adam/_cpu.cpython-311-darwin.so"] = fake_macho(cpu=0x01000007)
    assert_one_problem(problems_of(tmp_path, "macos", MAC, edit=x86_mac), "no arm64 code")


def test_extension_requiring_newer_macos_than_its_tag(tmp_path):
    def newer(f):
        f["mps_fused_adam/_metal.cpython-311-darwin.so"] = fake_macho(minos=(15, 0))
    assert_one_problem(problems_of(tmp_path, "macos", MAC, edit=newer), "requires macOS 15.0")


def test_extension_that_is_not_a_binary(tmp_path):
    p = problems_of(tmp_path, "linux", LINUX_RAW,
                    edit=lambda f: f.__setitem__("mps_fused_adam/_cpu.cpython-311-x86_64-linux-gnu.so", b"not elf"))
    assert_one_problem(p, "not a 64-bit ELF")


# ----------------------------------------------------------------------------- sdists

SDIST_FILES = {
    "pyproject.toml": b"[project]\nname = 'mps-fused-adam'\n",
    "CMakeLists.txt": b"include(cmake/cpu_adam.cmake)\nif(APPLE)\n  include(cmake/apple_metal.cmake)\nendif()\n",
    "cmake/cpu_adam.cmake": b"# cpu\n",
    "cmake/apple_metal.cmake": b"# apple\ninclude(${CMAKE_CURRENT_LIST_DIR}/metal_toolchain.cmake)\n",
    "cmake/metal_toolchain.cmake": b"# probe\n",
    "src/cpu/step.cpp": b"int x;\n",
    "metal/fused_adam.metal": b"kernel void adam() {}\n",
    "python/mps_fused_adam/__init__.py": b"",
    "LICENSE": b"Apache License 2.0\n",
    "README.md": b"# mps-fused-adam\n",
    "PKG-INFO": f"Metadata-Version: 2.4\nName: mps-fused-adam\nVersion: {VERSION}\n".encode(),
}


def make_sdist(directory: Path, files: dict[str, bytes]) -> Path:
    path = directory / f"mps_fused_adam-{VERSION}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for n, d in files.items():
            info = tarfile.TarInfo(f"mps_fused_adam-{VERSION}/{n}")
            info.size = len(d)
            tf.addfile(info, io.BytesIO(d))
    return path


def test_well_formed_sdist_passes(tmp_path):
    assert cw.check_sdist(make_sdist(tmp_path, SDIST_FILES)) == []


@pytest.mark.parametrize("change,word", [
    (lambda f: f.pop("metal/fused_adam.metal"), "metal/"),
    (lambda f: f.pop("cmake/apple_metal.cmake"), "cmake/apple_metal.cmake"),
    (lambda f: f.pop("cmake/metal_toolchain.cmake"), "cmake/metal_toolchain.cmake, included by cmake/apple_metal.cmake"),
    (lambda f: f.pop("README.md"), "README.md"),
    (lambda f: f.__setitem__("LICENSE", b""), "LICENSE is empty"),
    (lambda f: f.__setitem__("python/mps_fused_adam/_cpu.cpython-311-x86_64-linux-gnu.so", b"\0"), "build product"),
    (lambda f: f.__setitem__("PKG-INFO", b"Version: 9.9\n"), "PKG-INFO version"),
    (lambda f: f.__setitem__(".venv/pyvenv.cfg", b"home = /usr/bin\n"), "virtual environment inside the sdist: .venv"),
    (lambda f: f.__setitem__("benchmarks/results/cpu_2core.txt", b"ours 0.5\n"), "benchmark results"),
    (lambda f: f.__setitem__("big.bin", os.urandom(1_100_000)), "over the limit of 1 MB"),
])
def test_doctored_sdist(tmp_path, change, word):
    files = dict(SDIST_FILES)
    change(files)
    assert_one_problem(cw.check_sdist(make_sdist(tmp_path, files)), word)


def test_sdist_includes_are_the_real_ones():
    """The fixture's include lines are those of the real build files (so the check above follows
    what CMake follows)."""
    repo = Path(__file__).resolve().parents[1]  # CMakeLists.txt and cmake/ are in test-sources too
    assert "include(cmake/apple_metal.cmake)" in (repo / "CMakeLists.txt").read_text()
    assert "include(${CMAKE_CURRENT_LIST_DIR}/metal_toolchain.cmake)" in (repo / "cmake" / "apple_metal.cmake").read_text()


# ----------------------------------------------------------------------------- command line

def test_cli_exit_code_and_one_line_per_problem(tmp_path):
    good = make_wheel(tmp_path, wheel_files("macos"), MAC)
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    files = wheel_files("macos")
    del files["mps_fused_adam/fused_adam.metallib"]
    files["mps_fused_adam/.dylibs/libomp.dylib"] = b"\0"
    bad = make_wheel(bad_dir, files, MAC)

    ok = subprocess.run([sys.executable, str(CHECKER), str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    fail = subprocess.run([sys.executable, str(CHECKER), "--repaired", str(good), str(bad)],
                          capture_output=True, text=True)
    assert fail.returncode == 1
    bad_lines = [line for line in fail.stdout.splitlines() if line.startswith(str(bad))]
    assert len(bad_lines) == 2, fail.stdout
    assert f"{good}: OK" in fail.stdout


# ----------------------------------------------------------------------------- the real wheel

REAL_WHEEL = os.environ.get("MFA_WHEEL")
# Skipping here is acceptable only because every job that builds a wheel sets MFA_WHEEL
# (.ci/run and the cibuildwheel test command); a plain source-tree run has no wheel to check.
needs_wheel = pytest.mark.skipif(not REAL_WHEEL, reason="MFA_WHEEL is not set: no built wheel to check")


@needs_wheel
def test_real_wheel_passes():
    repaired = "linux_" not in Path(REAL_WHEEL).name.split("-")[-1]
    metal_dir = Path(__file__).resolve().parents[1] / "metal"
    sources = sorted(p.name for p in metal_dir.glob("*.metal")) or None
    assert cw.check_wheel(REAL_WHEEL, repaired=repaired, metal_sources=sources) == []


@needs_wheel
def test_tests_run_against_this_wheel_installed():
    """The package these tests import is this wheel's installation, not a source tree."""
    import mps_fused_adam

    installed = Path(mps_fused_adam.__file__).resolve().parent
    with zipfile.ZipFile(REAL_WHEEL) as zf:
        for name in zf.namelist():
            if name.startswith("mps_fused_adam/") and not name.endswith("/"):
                on_disk = installed / name[len("mps_fused_adam/"):]
                assert on_disk.is_file(), f"{name} from the wheel is not in {installed}"
                assert on_disk.read_bytes() == zf.read(name), f"{on_disk} differs from the wheel's {name}"
