#!/usr/bin/env bash
# Build the sdist and a wheel with `python -m build`, check both with ci/check_wheel.py, show
# auditwheel's view of the wheel, install the wheel into a fresh virtual environment and run the
# whole test suite against the installed package from a scratch directory holding only
# pyproject.toml's test-sources, as cibuildwheel does.
#
#   bash ci/test_installed_wheel.sh            (from .ci/run; PYTHON picks the interpreter)
#
# MFA_DEEPSPEED=VERSION also installs DeepSpeed into the test environment (for the ZeRO tests);
# MFA_INTEGRATION="pkg==X ..." the training libraries of the integration tests.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mfa-wheel.XXXXXX")"
# The build and a virtual environment with torch (over a gigabyte) are removed when the script
# ends, pass or fail, unless MFA_VENV_LINK hands the environment on (the caller then removes it:
# .ci/run) or MFA_KEEP_WORK=1 keeps it.
if [ "${MFA_KEEP_WORK:-0}" != 1 ] && [ -z "${MFA_VENV_LINK:-}" ]; then trap 'rm -rf "$WORK"' EXIT; fi
echo "release check in $WORK"

"$PY" -m pip install -q build auditwheel

# With build isolation the build environment gets only the build requirements (scikit-build-core,
# nanobind, and cmake/ninja if the machine lacks them). torch must never be among them: the
# package does not need it to build, and pulling it would cost gigabytes.
"$PY" -m build --outdir "$WORK/dist" "$REPO" 2>&1 | tee "$WORK/build.log"
if grep -E '^  - ' "$WORK/build.log" | grep -qi torch; then
  echo "torch was installed into the build environment" >&2
  exit 1
fi

shopt -s nullglob
wheels=("$WORK"/dist/*.whl)
sdists=("$WORK"/dist/*.tar.gz)
if [ "${#wheels[@]}" -ne 1 ] || [ "${#sdists[@]}" -ne 1 ]; then
  echo "expected one wheel and one sdist, got: ${wheels[*]} ${sdists[*]}" >&2
  exit 1
fi
WHEEL="${wheels[0]}"

# A wheel from `python -m build` on this machine is tagged linux_<arch> (not repaired), so no
# --repaired here; the cibuildwheel builds check with --repaired.
"$PY" "$REPO/ci/check_wheel.py" --metal-dir "$REPO/metal" "$WHEEL" "${sdists[0]}"

# Reports the manylinux tag the wheel could carry and its external libraries; it must list no
# libtorch, libc10 or OpenMP runtime (check_wheel.py has already failed the run if it did).
auditwheel show "$WHEEL"

# A fresh environment: nothing from the system site-packages or the source tree. torch pinned
# explicitly first, so the wheel's `torch>=2.13` is already met and pip downloads no other build.
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# MFA_VENV_LINK=PATH: a symlink to this environment, for ci/test_deepspeed_releases.sh (.ci/run).
if [ -n "${MFA_VENV_LINK:-}" ]; then ln -sfn "$WORK/venv" "$MFA_VENV_LINK"; fi
"$VPY" -m pip install -q torch==2.13.0
"$VPY" -m pip install -q "${WHEEL}[test]"
if [ -n "${MFA_DEEPSPEED:-}" ]; then
  # DeepSpeed is an sdist whose setup.py imports torch: with build isolation pip would fetch an
  # unpinned torch (gigabytes) into the build environment. Build it against the venv's torch,
  # with the pin as a constraint so nothing can replace it, and prebuild no ops.
  printf 'torch==2.13.0\n' > "$WORK/constraints.txt"
  "$VPY" -m pip install -q -c "$WORK/constraints.txt" setuptools wheel
  DS_BUILD_OPS=0 "$VPY" -m pip install -q --no-build-isolation -c "$WORK/constraints.txt" "deepspeed==${MFA_DEEPSPEED}"
  "$VPY" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  # DeepSpeed's own CPU Adam, Lion and Adagrad, JIT-built once here with the machine's compiler,
  # only so that tests/test_deepspeed_ops.py and tests/test_deepspeed_rule_ops.py can compare our
  # kernels with them (the package never builds them).
  # (The venv's bin first: torch's extension builder looks for ninja, which DeepSpeed installs there.)
  DS_SOS="$(PATH="$WORK/venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$WORK/ds_ext" "$VPY" -c \
    "from deepspeed.ops.op_builder import CPUAdamBuilder, CPULionBuilder, CPUAdagradBuilder
for b in (CPUAdamBuilder, CPULionBuilder, CPUAdagradBuilder): print('MFA-SO', b().load(verbose=False).__file__)" \
    | grep '^MFA-SO ' | cut -d' ' -f2)"
  MFA_DS_CPU_ADAM_SO="$(echo "$DS_SOS" | sed -n 1p)"
  MFA_DS_CPU_LION_SO="$(echo "$DS_SOS" | sed -n 2p)"
  MFA_DS_CPU_ADAGRAD_SO="$(echo "$DS_SOS" | sed -n 3p)"
  export MFA_DS_CPU_ADAM_SO MFA_DS_CPU_LION_SO MFA_DS_CPU_ADAGRAD_SO
  echo "DeepSpeed's ops for the cross-checks: $MFA_DS_CPU_ADAM_SO $MFA_DS_CPU_LION_SO $MFA_DS_CPU_ADAGRAD_SO"
fi

if [ -n "${MFA_BITSANDBYTES:-}" ]; then
  # bitsandbytes, for the state-dict conversion and numerics tests of AdamW8bit; the torch pin as
  # a constraint so it cannot pull another torch.
  printf 'torch==2.13.0\n' > "$WORK/constraints.txt"
  "$VPY" -m pip install -q -c "$WORK/constraints.txt" "bitsandbytes==${MFA_BITSANDBYTES}"
fi

if [ -n "${MFA_TORCHAO:-}" ]; then
  # torchao, for the 4-bit comparisons with its AdamW4bit (its step and its checkpoints converted);
  # the torch pin as a constraint.
  printf 'torch==2.13.0\n' > "$WORK/constraints.txt"
  "$VPY" -m pip install -q -c "$WORK/constraints.txt" "torchao==${MFA_TORCHAO}"
fi

if [ -n "${MFA_INTEGRATION:-}" ]; then
  # The training libraries of the integration tests (tests/test_integration_*.py: Hugging Face
  # Trainer, accelerate, Lightning), pinned by the caller; the torch pin as a constraint.
  printf 'torch==2.13.0\n' > "$WORK/constraints.txt"
  # shellcheck disable=SC2086  # a list of pinned requirements
  "$VPY" -m pip install -q -c "$WORK/constraints.txt" $MFA_INTEGRATION
fi

# The README's commands, run from the checkout with the venv first on PATH: the package is
# importable only from site-packages (the source lives under python/, which nothing puts on
# sys.path), and the import check proves it.
cd "$REPO"
export PATH="$WORK/venv/bin:$PATH"
python - "$REPO" <<'EOF'
import pathlib, sys
import mps_fused_adam
where = pathlib.Path(mps_fused_adam.__file__).resolve()
repo = pathlib.Path(sys.argv[1]).resolve()
assert "site-packages" in where.parts and repo not in where.parents, f"imported from {where}"
print(f"mps_fused_adam {mps_fused_adam.__version__} from {where.parent}")
EOF
python -m mps_fused_adam

# The suite runs as cibuildwheel runs it for each wheel: from a scratch directory holding only the
# paths pyproject.toml's [tool.cibuildwheel] test-sources names (ci/copy_test_sources.py reads that
# list, so it is written in one place). A test that reads a repository file missing from the list
# fails here, not first on GitHub. The MFA_* variables the caller exported (MFA_REQUIRE_*, the
# DeepSpeed op paths above) and MFA_WHEEL apply there as they did in the checkout.
TESTDIR="$WORK/test-sources"
"$PY" "$REPO/ci/copy_test_sources.py" "$TESTDIR"
cd "$TESTDIR"
MFA_WHEEL="$WHEEL" python -m pytest tests -ra -p no:cacheprovider
