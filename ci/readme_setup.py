"""The README's set-up commands, taken from the README itself, and the check of a run of them.

    python ci/readme_setup.py commands README.md
        prints the set-up block of the README's "Set-up" section (bash), as a newcomer would paste it
    python ci/readme_setup.py check README.md LOG --min-passed N
        checks pytest's summary in LOG (run with -ra): no failure or error, at least N passed, and
        every skip for one of the things the README's table of optional tools names

Used by .ci/run (the newcomer's path) and by tests/test_readme.py, so that README and CI cannot
drift apart: the commands CI runs are the README's text, not a copy of it.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def setup_section(readme: str) -> str:
    start = readme.index("\n## Set-up\n")
    end = readme.find("\n## ", start + 1)
    return readme[start:end if end >= 0 else None]


def setup_commands(readme: str) -> str:
    """The first ```bash block of the Set-up section: create a venv, install and report, test."""
    block = re.search(r"```bash\n(.*?)```", setup_section(readme), flags=re.S)
    if block is None:
        raise ValueError("the README's Set-up section has no ```bash block")
    return block.group(1)


# pip install options whose next word is their value, not a requirement.
_VALUE_OPTIONS = {"--index-url", "-i", "--extra-index-url", "--find-links", "-f", "-c", "--constraint", "-r",
                  "--requirement", "--target", "-t"}


def pip_installs(commands: str) -> set[str]:
    """The requirement names the commands pass to ``pip install`` (``.`` for the checkout)."""
    names = set()
    for args in re.findall(r"pip install ([^\n&|;#]+)", commands):
        words = args.split()
        for i, word in enumerate(words):
            if not word.startswith("-") and (i == 0 or words[i - 1] not in _VALUE_OPTIONS):
                names.add(re.split(r"[=<>!~\[]", word)[0].lower().replace("_", "-"))
    return names


def index_urls(commands: str) -> list[str]:
    """The package indexes the commands name (``--index-url``, ``--extra-index-url``)."""
    return re.findall(r"--(?:extra-)?index-url[ =](\S+)", commands)


def optional_names(readme: str) -> list[str]:
    """The backticked names in the first column of the Set-up section's "optional" table."""
    section = setup_section(readme)
    table = section[section.index("| optional |"):]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    names: list[str] = []
    for line in rows:
        names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def check_log(log: str, optional: list[str], min_passed: int) -> list[str]:
    """Problems with a pytest run (empty when it is as the README promises)."""
    summary = [line for line in log.splitlines() if re.match(r"^=+ .* in [0-9.]+s", line)]
    if not summary:
        return ["no pytest summary line in the log"]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed)",
                                                     summary[-1])}
    problems = []
    if counts.get("failed") or counts.get("error") or counts.get("errors"):
        problems.append(f"failures: {summary[-1]}")
    if counts.get("passed", 0) < min_passed:
        problems.append(f"{counts.get('passed', 0)} tests passed, fewer than the floor of {min_passed}: {summary[-1]}")
    for line in log.splitlines():
        if line.startswith("SKIPPED") and not any(name in line for name in optional):
            problems.append(f"a skip for something the README does not name as optional: {line}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("commands").add_argument("readme", type=Path)
    check = sub.add_parser("check")
    check.add_argument("readme", type=Path)
    check.add_argument("log", type=Path)
    check.add_argument("--min-passed", type=int, required=True)
    args = ap.parse_args(argv)
    readme = args.readme.read_text(encoding="utf-8")
    if args.cmd == "commands":
        print(setup_commands(readme), end="")
        return 0
    problems = check_log(args.log.read_text(encoding="utf-8", errors="replace"), optional_names(readme),
                         args.min_passed)
    for p in problems:
        print(f"README set-up check: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
