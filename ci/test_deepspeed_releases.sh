#!/usr/bin/env bash
# Issue 13: the pseudo-MPS ZeRO matrix (tests/test_deepspeed_pseudo_mps.py) against older DeepSpeed
# releases, so that "complete the stub" is tested against the real stubs (DeepSpeed 0.14 to
# 0.19.5 ship an incomplete MPS accelerator). 0.19.8 runs in the main suite.
#
#   bash ci/test_deepspeed_releases.sh BASE_PYTHON [RELEASE...]
#
# BASE_PYTHON: the python of an environment holding torch==2.13.0, the installed mps_fused_adam
# wheel, pytest, setuptools and wheel (ci/test_installed_wheel.sh's; .ci/run passes it). Each
# release gets its own virtual environment that sees BASE's packages behind its own (a .pth
# file), so torch is not installed again and the release's DeepSpeed shadows BASE's. DeepSpeed is
# built with DS_BUILD_OPS=0, no build isolation and torch pinned, as ci/test_installed_wheel.sh
# does for 0.19.8.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_PY="$1"; shift
RELEASES=("$@")
if [ "${#RELEASES[@]}" -eq 0 ]; then
  RELEASES=(0.14.4 0.16.9 0.18.9)
fi
BASE_SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mfa-ds-releases.XXXXXX")"
# One DeepSpeed environment per release: removed when the script ends, pass or fail;
# MFA_KEEP_WORK=1 keeps them.
[ "${MFA_KEEP_WORK:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
printf 'torch==2.13.0\n' > "$WORK/constraints.txt"

for v in "${RELEASES[@]}"; do
  echo "=== DeepSpeed $v (pseudo-MPS; not Apple hardware)"
  start=$SECONDS
  "$BASE_PY" -m venv "$WORK/ds-$v"
  VPY="$WORK/ds-$v/bin/python"
  echo "$BASE_SITE" > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_mfa_base.pth"
  DS_BUILD_OPS=0 "$VPY" -m pip install -q --no-build-isolation -c "$WORK/constraints.txt" "deepspeed==$v"
  "$VPY" - "$v" <<'PY'
import sys, torch, deepspeed, mps_fused_adam
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert deepspeed.__version__ == sys.argv[1], (deepspeed.__version__, deepspeed.__file__)
print(f"DeepSpeed {deepspeed.__version__} from {deepspeed.__file__}; torch {torch.__version__}; "
      f"mps_fused_adam from {mps_fused_adam.__file__}")
PY
  (cd "$REPO" && MFA_REQUIRE_DEEPSPEED=1 "$VPY" -m pytest -q -p no:cacheprovider \
      tests/test_deepspeed_pseudo_mps.py \
      tests/test_deepspeed_install.py::test_accelerator_methods_bound_at_import_are_rebound)
  echo "=== DeepSpeed $v: $((SECONDS - start)) s"
done
