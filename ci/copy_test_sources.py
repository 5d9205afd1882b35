#!/usr/bin/env python3
"""Copy the paths named by pyproject.toml's [tool.cibuildwheel] test-sources into a directory,
keeping their paths relative to the checkout, as cibuildwheel does before its per-wheel test run.

    python ci/copy_test_sources.py DEST          (DEST must not exist yet, or be empty)
    python ci/copy_test_sources.py --list        (print the paths, one a line)

pyproject.toml stays the one list: ci/test_installed_wheel.sh runs the suite from such a
directory, so a test that needs a repository file missing from test-sources fails in .ci/run too,
not only in cibuildwheel's runs on GitHub.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load_toml(path: Path) -> dict:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            sys.exit("copy_test_sources.py needs Python 3.11+ (tomllib) or the tomli package")
    with path.open("rb") as f:
        return tomllib.load(f)


def test_sources(repo: Path = REPO) -> list[str]:
    sources = _load_toml(repo / "pyproject.toml")["tool"]["cibuildwheel"]["test-sources"]
    if isinstance(sources, str):  # cibuildwheel also accepts one space-separated string
        sources = sources.split()
    return list(sources)


def copy_test_sources(dest: Path, repo: Path = REPO) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        sys.exit(f"{dest} is not empty")
    copied = []
    for rel in test_sources(repo):
        src, dst = repo / rel, dest / rel
        if not src.exists():
            sys.exit(f"test-sources names {rel}, which is not in {repo}")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            # Build leftovers of a developer's runs are not sources.
            shutil.copytree(src, dst, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
        else:
            shutil.copy2(src, dst)
        copied.append(rel)
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("dest", nargs="?", type=Path, help="directory to copy the test sources into")
    group.add_argument("--list", action="store_true", help="print the test-sources paths and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(test_sources()))
        return 0
    copied = copy_test_sources(args.dest)
    print(f"copied {len(copied)} test-sources paths into {args.dest}: {' '.join(copied)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
