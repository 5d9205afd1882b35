#!/usr/bin/env python3
"""Check the contents of built mps-fused-adam distributions before anyone installs them.

    python ci/check_wheel.py [--repaired] [--metal-dir metal] dist/*.whl [dist/*.tar.gz]

Prints one line per problem and exits 1 if there is any; exits 0 otherwise. Standard library
only, so it runs in cibuildwheel's bare test environment and before anything is installed.

Wheels (``check_wheel``):
  - file name, ``WHEEL`` tags, ``METADATA`` version and the packaged ``_version.py`` agree;
  - ``RECORD`` lists every file with a correct hash (a wheel edited after repair fails here);
  - ``mps_fused_adam/_cpu`` is present, built for this wheel's Python and CPU architecture;
  - macOS: ``_metal`` and exactly one metallib, ``mps_fused_adam/fused_adam.metallib`` (the one
    name the loader loads), next to it; no metallib in other wheels; extension
    binaries declare a minimum macOS no newer than the tag claims;
  - every platform: ``.metal`` sources under ``mps_fused_adam/metal/`` (tier 3 compiles them at
    run time); with ``--metal-dir``, every ``*.metal`` file of that source directory;
  - a non-empty license file in ``.dist-info``;
  - no tests, no bundled torch or OpenMP runtime, and no extension that links one
    (torch bundles its own libomp on macOS; a second copy in the process aborts with
    ``OMP: Error #15``, and a bundled libtorch would shadow the user's torch).

Tag rule: macOS wheels must be exactly ``macosx_14_0_arm64`` (the deployment target;
anything newer means the target was not honoured, anything else is the wrong architecture).
Linux wheels may carry ``manylinux_X_Y_<arch>`` (or legacy manylinux) tags up to glibc 2.28.
A raw ``linux_<arch>`` tag, as ``python -m build`` produces before ``auditwheel repair``,
is accepted unless ``--repaired`` is given; CI passes ``--repaired`` for what it uploads.

Sdists (``check_sdist``): one top-level directory ``mps_fused_adam-<version>/`` holding
pyproject.toml, CMakeLists.txt, every ``cmake/*.cmake`` that CMakeLists.txt includes, src/,
metal/*.metal, python/mps_fused_adam/, a non-empty LICENSE, README.md and PKG-INFO with
the same version; no build products (a stray ``.so`` would shadow the one pip builds), no
virtual environment (the README's set-up makes ``.venv`` inside the checkout), no benchmark
results (run logs and plots: not needed to build or test), and at most 1 MB in all.
"""
from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import re
import struct
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

PACKAGE = "mps_fused_adam"
MACOS_TAG = "macosx_14_0_arm64"
MACOS_MIN = (14, 0)
MAX_GLIBC = (2, 28)

# Never inside a wheel, under any directory: torch must come from the user's own install,
# and an OpenMP runtime must not be loaded twice.
FORBIDDEN_LIBS = ("libtorch*", "libc10*", "libomp*", "libgomp*", "libiomp*", "libtorch_python*")

WHEEL_NAME = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)
SDIST_NAME = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)\.tar\.gz$")
MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}

ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
MACHO_CPUS = {0x0100000C: "arm64", 0x01000007: "x86_64"}


# --------------------------------------------------------------------------- binaries

def _elf_info(data: bytes) -> tuple[str, list[str]] | None:
    """(architecture, DT_NEEDED entries) of a 64-bit little-endian ELF, or None if not one."""
    if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
        return None
    (machine,) = struct.unpack_from("<H", data, 18)
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = []
    for i in range(shnum):
        off = shoff + i * shentsize
        if off + 64 > len(data):
            return ELF_MACHINES.get(machine, f"elf-machine-{machine}"), []
        sh_type, = struct.unpack_from("<I", data, off + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, off + 24)
        sh_link, = struct.unpack_from("<I", data, off + 40)
        sections.append((sh_type, sh_offset, sh_size, sh_link))
    needed = []
    for sh_type, sh_offset, sh_size, sh_link in sections:
        if sh_type != 6 or sh_link >= len(sections):  # SHT_DYNAMIC
            continue
        str_off = sections[sh_link][1]
        for pos in range(sh_offset, sh_offset + sh_size - 15, 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.find(b"\0", str_off + val)
                needed.append(data[str_off + val:end].decode("utf-8", "replace"))
    return ELF_MACHINES.get(machine, f"elf-machine-{machine}"), needed


def _macho_slices(data: bytes) -> list[bytes]:
    magic = data[:4]
    if magic == b"\xca\xfe\xba\xbe":  # fat (universal) binary, big-endian header
        (n,) = struct.unpack_from(">I", data, 4)
        out = []
        for i in range(n):
            _, _, off, size, _ = struct.unpack_from(">iiIII", data, 8 + 20 * i)
            out.append(data[off:off + size])
        return out
    if magic == b"\xcf\xfa\xed\xfe":  # MH_MAGIC_64, little-endian
        return [data]
    return []


def _macho_info(data: bytes) -> list[tuple[str, list[str], tuple[int, int] | None]] | None:
    """Per slice: (architecture, linked dylibs, minimum macOS), or None if not Mach-O 64."""
    slices = _macho_slices(data)
    if not slices:
        return None
    out = []
    for sl in slices:
        if sl[:4] != b"\xcf\xfa\xed\xfe" or len(sl) < 32:
            out.append(("unknown", [], None))
            continue
        cputype, _, _, ncmds, _, _ = struct.unpack_from("<iiIIII", sl, 4)
        arch = MACHO_CPUS.get(cputype & 0xFFFFFFFF, f"macho-cpu-{cputype:#x}")
        pos, libs, minos = 32, [], None
        for _ in range(ncmds):
            if pos + 8 > len(sl):
                break
            cmd, size = struct.unpack_from("<II", sl, pos)
            if cmd in (0xC, 0x80000018, 0x8000001F, 0x20, 0x80000023):  # LC_*LOAD*_DYLIB
                (name_off,) = struct.unpack_from("<I", sl, pos + 8)
                end = sl.find(b"\0", pos + name_off, pos + size)
                libs.append(sl[pos + name_off:end].decode("utf-8", "replace"))
            elif cmd == 0x32:  # LC_BUILD_VERSION: platform, minos (xxxx.yy.zz nibbles)
                (ver,) = struct.unpack_from("<I", sl, pos + 12)
                minos = (ver >> 16, (ver >> 8) & 0xFF)
            elif cmd == 0x24:  # LC_VERSION_MIN_MACOSX
                (ver,) = struct.unpack_from("<I", sl, pos + 8)
                minos = (ver >> 16, (ver >> 8) & 0xFF)
            if size < 8:
                break
            pos += size
        out.append((arch, libs, minos))
    return out


def _forbidden(name: str) -> bool:
    base = PurePosixPath(name).name
    return any(fnmatch.fnmatch(base, pat) for pat in FORBIDDEN_LIBS)


# --------------------------------------------------------------------------- wheels

def _record_problems(zf: zipfile.ZipFile, dist_info: str) -> list[str]:
    record_name = f"{dist_info}/RECORD"
    try:
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode("utf-8"))))
    except KeyError:
        return [f"{record_name} is missing"]
    problems = []
    recorded = {}
    for row in rows:
        if row:
            recorded[row[0]] = row[1] if len(row) > 1 else ""
    names = {n for n in zf.namelist() if not n.endswith("/")}
    for name in sorted(names - set(recorded)):
        problems.append(f"{name} is in the archive but not in RECORD")
    for name in sorted(set(recorded) - names):
        problems.append(f"RECORD lists {name}, which is not in the archive")
    for name in sorted(names & set(recorded)):
        spec = recorded[name]
        if name == record_name or name.endswith((".jws", ".p7s")):
            continue
        if not spec.startswith("sha256="):
            problems.append(f"RECORD has no sha256 hash for {name}")
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(zf.read(name)).digest()).rstrip(b"=").decode()
        if digest != spec[len("sha256="):]:
            problems.append(f"RECORD hash mismatch for {name} (edited after the wheel was built?)")
    return problems


def _platform_kind(plat_tags: list[str]) -> tuple[str | None, str | None]:
    """('macos'|'linux', architecture) from the platform tags, or (None, None)."""
    if all(t.startswith("macosx_") for t in plat_tags):
        return "macos", plat_tags[0].rsplit("_", 1)[-1] if len(plat_tags) == 1 else None
    if all(t.startswith(("manylinux", "linux_")) for t in plat_tags):
        arches = set()
        for t in plat_tags:
            m = MANYLINUX.match(t)
            if m:
                arches.add(m.group(3))
            else:
                arches.add(t.split("_", 1)[1])
        return "linux", arches.pop() if len(arches) == 1 else None
    return None, None


def _tag_problems(kind: str | None, arch: str | None, plat_tags: list[str], repaired: bool) -> list[str]:
    tags = ".".join(plat_tags)
    if kind is None:
        return [f"platform tag {tags} is not a supported platform (macOS arm64, Linux x86_64/aarch64)"]
    if kind == "macos":
        if plat_tags != [MACOS_TAG]:
            return [f"macOS platform tag is {tags}, expected {MACOS_TAG} (deployment target 14.0, arm64 only)"]
        return []
    if arch not in ("x86_64", "aarch64"):
        return [f"Linux platform tags {tags} do not name one architecture among x86_64, aarch64"]
    problems = []
    for t in plat_tags:
        m = MANYLINUX.match(t)
        if m:
            glibc = (int(m.group(1)), int(m.group(2)))
        elif t.split("_", 1)[0] in LEGACY_MANYLINUX:
            glibc = LEGACY_MANYLINUX[t.split("_", 1)[0]]
        elif t == f"linux_{arch}":
            if repaired:
                problems.append(f"platform tag {t} is not manylinux: the wheel was not repaired (auditwheel repair)")
            continue
        else:
            problems.append(f"unrecognised Linux platform tag {t}")
            continue
        if glibc > MAX_GLIBC:
            problems.append(f"platform tag {t} needs glibc {glibc[0]}.{glibc[1]}, newer than manylinux_2_28")
    return problems


def _extension_problems(name: str, data: bytes, kind: str, arch: str | None) -> list[str]:
    problems = []
    if kind == "linux":
        info = _elf_info(data)
        if info is None:
            return [f"{name} is not a 64-bit ELF shared object"]
        elf_arch, needed = info
        if arch and elf_arch != arch:
            problems.append(f"{name} is built for {elf_arch}, but the wheel is tagged {arch}")
        problems += [f"{name} links {lib} (torch and OpenMP must not be linked)" for lib in needed if _forbidden(lib)]
        return problems
    slices = _macho_info(data)
    if slices is None:
        return [f"{name} is not a Mach-O binary"]
    arches = [s[0] for s in slices]
    if "arm64" not in arches:
        problems.append(f"{name} has no arm64 code (architectures: {', '.join(arches)})")
    for s_arch, libs, minos in slices:
        problems += [f"{name} ({s_arch}) links {lib} (torch and OpenMP must not be linked)"
                     for lib in libs if _forbidden(PurePosixPath(lib).name)]
        if minos is not None and minos > MACOS_MIN:
            problems.append(f"{name} ({s_arch}) requires macOS {minos[0]}.{minos[1]}, newer than its 14.0 tag")
    return problems


def check_wheel(path: str | Path, repaired: bool = False, metal_sources: list[str] | None = None) -> list[str]:
    """Problems found in the wheel at ``path``; an empty list means it passed.

    ``repaired``: require manylinux tags on Linux (see the module docstring).
    ``metal_sources``: file names (``fused_adam.metal``) that must all be in ``mps_fused_adam/metal/``.
    """
    path = Path(path)
    m = WHEEL_NAME.match(path.name)
    if not m:
        return [f"file name {path.name} is not a wheel name (name-version-python-abi-platform.whl)"]
    if m["name"] != PACKAGE:
        return [f"distribution name in the file name is {m['name']}, expected {PACKAGE}"]
    version = m["version"]
    py_tags, abi_tags, plat_tags = m["py"].split("."), m["abi"].split("."), m["plat"].split(".")
    problems: list[str] = []
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        return [f"cannot open as a zip archive: {exc}"]
    with zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        dist_info = f"{PACKAGE}-{version}.dist-info"

        # Metadata: the wheel's own claims must agree with its file name.
        try:
            wheel_meta = zf.read(f"{dist_info}/WHEEL").decode("utf-8")
        except KeyError:
            return [f"{dist_info}/WHEEL is missing"]
        declared = {line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")}
        expected = {f"{p}-{a}-{pl}" for p in py_tags for a in abi_tags for pl in plat_tags}
        if declared != expected:
            problems.append(f"WHEEL tags {sorted(declared)} do not match the file name's {sorted(expected)}")
        if "Root-Is-Purelib: false" not in wheel_meta:
            problems.append("WHEEL does not say Root-Is-Purelib: false, but the wheel holds extension modules")
        try:
            metadata = zf.read(f"{dist_info}/METADATA").decode("utf-8")
        except KeyError:
            metadata = ""
            problems.append(f"{dist_info}/METADATA is missing")
        meta_version = re.search(r"^Version: (.+)$", metadata, re.M)
        if metadata and (not meta_version or meta_version.group(1).strip() != version):
            problems.append(f"METADATA version {meta_version and meta_version.group(1)!r} differs from the file name's {version}")
        try:
            version_py = zf.read(f"{PACKAGE}/_version.py").decode("utf-8")
            pkg_version = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", version_py)
            if not pkg_version or pkg_version.group(1) != version:
                problems.append(f"{PACKAGE}/_version.py says {pkg_version and pkg_version.group(1)!r}, the wheel is {version}")
        except KeyError:
            problems.append(f"{PACKAGE}/_version.py is missing")
        problems += _record_problems(zf, dist_info)

        licenses = [n for n in names if n.startswith(f"{dist_info}/")
                    and re.match(r"(licenses/.*|LICEN[CS]E.*|COPYING.*)", n[len(dist_info) + 1:])]
        if not licenses:
            problems.append(f"no license file in {dist_info}")
        elif all(zf.getinfo(n).file_size == 0 for n in licenses):
            problems.append(f"license file {licenses[0]} is empty")

        for n in names:
            parts = PurePosixPath(n).parts
            if any(p in ("tests", "test") for p in parts[:-1]) or \
                    fnmatch.fnmatch(parts[-1], "test_*.py") or parts[-1] == "conftest.py":
                problems.append(f"test file inside the wheel: {n}")
            if _forbidden(n):
                problems.append(f"bundled library that must come from elsewhere: {n}")
            if parts[0] == "torch":
                problems.append(f"torch itself is inside the wheel: {n}")

        kind, arch = _platform_kind(plat_tags)
        problems += _tag_problems(kind, arch, plat_tags, repaired)
        if kind is None:
            return problems

        # Extension modules: named for this wheel's interpreter, e.g. _cpu.cpython-311-x86_64-linux-gnu.so.
        cp = [t for t in py_tags if re.fullmatch(r"cp3\d+", t)]
        if len(cp) != 1 or abi_tags != cp:
            problems.append(f"tags {m['py']}-{m['abi']} are not one CPython version with its own ABI")
            suffix_re = r"[^/]+"
        else:
            digits = cp[0][2:]
            suffix_re = (rf"cpython-{digits}-darwin\.so" if kind == "macos"
                         else rf"cpython-{digits}-{arch}-linux-gnu\.so")
        modules = ["_cpu"] + (["_metal"] if kind == "macos" else [])
        for mod in modules:
            found = [n for n in names if re.fullmatch(rf"{PACKAGE}/{mod}\.{suffix_re}", n)]
            if not found:
                problems.append(f"extension module {PACKAGE}/{mod} for this Python and platform is missing")
            for n in found:
                problems += _extension_problems(n, zf.read(n), kind, arch)
        problems += _metallib_problems(names, kind)

        sources = {PurePosixPath(n).name for n in names if re.fullmatch(rf"{PACKAGE}/metal/[^/]+\.metal", n)}
        if not sources:
            problems.append(f"no .metal sources under {PACKAGE}/metal/ (tier 3 would be unavailable)")
        for src in sorted(set(metal_sources or ()) - sources):
            problems.append(f"{PACKAGE}/metal/{src} is missing (present in the source tree)")
    return problems


# The one name mps_backends.METALLIB_NAME loads (a stdlib-only copy: this script imports nothing
# of the package; tests/test_check_wheel.py checks the two agree).
METALLIB = "fused_adam.metallib"


def _metallib_problems(names: list[str], kind: str) -> list[str]:
    """A macOS wheel holds exactly ``mps_fused_adam/fused_adam.metallib``, the file tiers 1 and 2
    load: a metallib under any other name or place is never loaded, so it is a build mistake, and
    a wheel without it would silently run tier 3 (a source build without the Metal toolchain may;
    a wheel may not). Other wheels hold no metallib."""
    want = f"{PACKAGE}/{METALLIB}"
    problems = [f"{n}: a metallib other than {want}, which is the only one loaded"
                for n in names if n.endswith(".metallib") and n != want]
    if kind == "macos" and want not in names:
        problems.append(f"no {want} next to _metal (tiers 1 and 2 would be unavailable)")
    if kind != "macos" and want in names:
        problems.append(f"{want} in a {kind} wheel (Metal runs on macOS only)")
    return problems


# --------------------------------------------------------------------------- sdists

# Issue 30's limit: a clean checkout gave 716 KB, one with the README's .venv inside 158 MB.
SDIST_MAX_BYTES = 1_000_000


def check_sdist(path: str | Path) -> list[str]:
    """Problems found in the sdist at ``path``; an empty list means it passed."""
    path = Path(path)
    m = SDIST_NAME.match(path.name)
    if not m or m["name"] != PACKAGE:
        return [f"file name {path.name} is not {PACKAGE}-<version>.tar.gz"]
    root = f"{PACKAGE}-{m['version']}"
    try:
        tf = tarfile.open(path, "r:gz")
    except (OSError, tarfile.TarError) as exc:
        return [f"cannot open as a gzip tar archive: {exc}"]
    problems = []
    with tf:
        members = {mem.name.rstrip("/"): mem for mem in tf.getmembers()}
    files = {n[len(root) + 1:]: mem for n, mem in members.items() if mem.isfile() and n.startswith(root + "/")}
    outside = [n for n in members if n != root and not n.startswith(root + "/")]
    if outside:
        problems.append(f"entries outside the top-level directory {root}/: {', '.join(sorted(outside)[:3])}")

    def read(rel: str) -> str:
        with tarfile.open(path, "r:gz") as t:
            return t.extractfile(members[f"{root}/{rel}"]).read().decode("utf-8", "replace")

    for req in ("pyproject.toml", "CMakeLists.txt", "README.md", "PKG-INFO", f"python/{PACKAGE}/__init__.py"):
        if req not in files:
            problems.append(f"{req} is missing")
    if "LICENSE" not in files:
        problems.append("LICENSE is missing")
    elif files["LICENSE"].size == 0:
        problems.append("LICENSE is empty")
    if not any(f.startswith("src/") for f in files):
        problems.append("src/ is missing or empty")
    if not any(re.fullmatch(r"metal/[^/]+\.metal", f) for f in files):
        problems.append("metal/ has no .metal sources")
    if "CMakeLists.txt" in files:
        # CMakeLists.txt's includes, and theirs (cmake/apple_metal.cmake includes its toolchain
        # probe as ${CMAKE_CURRENT_LIST_DIR}/metal_toolchain.cmake).
        pending, seen = [("CMakeLists.txt", "")], set()
        while pending:
            includer, folder = pending.pop()
            text = read(includer)
            incs = re.findall(r"include\(\s*(cmake/[^\s)]+\.cmake)\s*\)", text)
            incs += [folder + n for n in re.findall(r"include\(\s*\$\{CMAKE_CURRENT_LIST_DIR\}/([^\s)/]+\.cmake)\s*\)", text)]
            for inc in incs:
                if inc in seen:
                    continue
                seen.add(inc)
                if inc not in files:
                    problems.append(f"{inc}, included by {includer}, is missing")
                else:
                    pending.append((inc, inc.rsplit("/", 1)[0] + "/"))
    if "PKG-INFO" in files:
        v = re.search(r"^Version: (.+)$", read("PKG-INFO"), re.M)
        if not v or v.group(1).strip() != m["version"]:
            problems.append(f"PKG-INFO version {v and v.group(1)!r} differs from the file name's {m['version']}")
    for f in sorted(files):
        if f.endswith((".so", ".dylib", ".metallib", ".pyc")) or f.startswith(("build/", "dist/")):
            problems.append(f"build product inside the sdist: {f}")
    venvs = sorted({f.rsplit("/", 1)[0] or "." for f in files if f == "pyvenv.cfg" or f.endswith("/pyvenv.cfg")})
    if venvs:
        problems.append(f"a virtual environment inside the sdist: {', '.join(venvs)}")
    results = sorted(f for f in files if f.startswith("benchmarks/results/"))
    if results:
        problems.append(f"benchmark results inside the sdist ({len(results)} files, e.g. {results[0]})")
    size = path.stat().st_size
    if size > SDIST_MAX_BYTES:
        problems.append(f"the sdist is {size / 1e6:.2f} MB, over the limit of {SDIST_MAX_BYTES / 1e6:.0f} MB")
    return problems


# --------------------------------------------------------------------------- CLI

def check_file(path: str | Path, repaired: bool = False, metal_sources: list[str] | None = None) -> list[str]:
    name = Path(path).name
    if not Path(path).is_file():
        return ["no such file (did the build produce it? an unmatched shell glob lands here)"]
    if name.endswith(".whl"):
        return check_wheel(path, repaired=repaired, metal_sources=metal_sources)
    if name.endswith(".tar.gz"):
        return check_sdist(path)
    return [f"neither a wheel nor an sdist: {name}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="wheels (.whl) and sdists (.tar.gz)")
    ap.add_argument("--repaired", action="store_true",
                    help="require manylinux tags on Linux wheels (after auditwheel repair)")
    ap.add_argument("--metal-dir", type=Path,
                    help="source directory whose *.metal files must all be in each wheel")
    args = ap.parse_args(argv)
    metal_sources = sorted(p.name for p in args.metal_dir.glob("*.metal")) if args.metal_dir else None
    if args.metal_dir and not metal_sources:
        print(f"--metal-dir {args.metal_dir}: no .metal files there", file=sys.stderr)
        return 2
    failed = 0
    for f in args.files:
        problems = check_file(f, repaired=args.repaired, metal_sources=metal_sources)
        for p in problems:
            print(f"{f}: {p}")
        if problems:
            failed += 1
        else:
            print(f"{f}: OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
