#!/usr/bin/env bash
# The newcomer's path: the README's set-up commands, taken from the README itself
# (ci/readme_setup.py), run as written in a copy of the checkout's files, in a fresh virtual
# environment with nothing else in it (no DeepSpeed, no extras the README does not name), without
# MFA_REQUIRE_TOOLS (a newcomer's missing tools skip). Then the pytest summary must show no
# failure, at least MIN_PASSED tests passed, and skips only for what the README names as optional.
#
#   MIN_PASSED=N bash ci/test_readme_setup.sh        (from .ci/run; PYTHON picks the interpreter)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
MIN_PASSED="${MIN_PASSED:?set MIN_PASSED, the floor of tests that must pass}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mfa-readme.XXXXXX")"
# A virtual environment with torch (over a gigabyte): removed when the script ends, pass or fail
# (everything worth reading is printed); MFA_KEEP_WORK=1 keeps it.
[ "${MFA_KEEP_WORK:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
echo "README set-up check in $WORK"

# A fresh clone's files: what git tracks, as they are in the working tree (no build/, no _site/).
mkdir "$WORK/checkout"
(cd "$REPO" && git ls-files -z | tar --null -T - -cf -) | tar -xf - -C "$WORK/checkout"

"$PY" "$REPO/ci/readme_setup.py" commands "$REPO/README.md" > "$WORK/setup.sh"
echo "--- the README's set-up commands ---"
cat "$WORK/setup.sh"
echo "------------------------------------"

# -ra (through the environment, so the command stays the README's) lists every skip's reason.
# Skip lines are checked below; the log is the run's whole output.
(
  cd "$WORK/checkout"
  unset MFA_REQUIRE_TOOLS MFA_REQUIRE_DEEPSPEED MFA_REQUIRE_BITSANDBYTES MFA_REQUIRE_INTEGRATION MFA_REQUIRE_TORCHAO MFA_WHEEL MFA_DS_CPU_ADAM_SO VIRTUAL_ENV PYTHONPATH
  export PYTEST_ADDOPTS="-ra -p no:cacheprovider"
  # The block's --extra-index-url (PyTorch's CPU index) cannot be reached from CI: its name does
  # not resolve, and with no retries pip moves on at once (pip's default, 5 retries with
  # back-off, costs about 30 s per package). The same 2.13.0+cpu wheel comes from the machine's
  # on-disk wheels (PIP_FIND_LINKS, kept from the caller's environment or pip configuration);
  # the check below the run makes sure the CPU build is what was installed.
  export PIP_RETRIES=0
  PATH="$(dirname "$(command -v "$PY")"):$PATH" bash -euo pipefail "$WORK/setup.sh"
) 2>&1 | tee "$WORK/setup.log"

"$PY" "$REPO/ci/readme_setup.py" check "$REPO/README.md" "$WORK/setup.log" --min-passed "$MIN_PASSED"
# The block's own environment holds the CPU build of torch (a CUDA build would be 2.13.0 without +cpu).
"$WORK/checkout/.venv/bin/python" -c "import torch; v = torch.__version__; assert v == '2.13.0+cpu', v; print('torch', v)"
echo "README set-up check passed: $(grep -E '^=+ .* in [0-9.]+s' "$WORK/setup.log" | tail -n 1)"
