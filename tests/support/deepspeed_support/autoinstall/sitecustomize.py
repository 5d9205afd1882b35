"""Test harness only (tests/test_deepspeed_unit_tests.py puts this directory on PYTHONPATH, with
MFA_AUTOINSTALL=1): in every Python process of DeepSpeed's own test run, including the worker
processes its DistributedTest spawns and the optimizer processes its tests start,
``mps_fused_adam.deepspeed.install()`` runs right after ``import deepspeed`` completes, as a
user's training script calls it before using DeepSpeed. Processes that never import DeepSpeed
(py-cpuinfo's probe, which parses its child's stdout) are left alone. Not part of the package."""
import importlib.abc
import importlib.util
import os
import sys


class _InstallAfterDeepSpeed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            import mps_fused_adam.deepspeed
            mps_fused_adam.deepspeed.install()

        spec.loader.exec_module = exec_then_install
        return spec


if os.environ.get("MFA_AUTOINSTALL") == "1":
    sys.meta_path.insert(0, _InstallAfterDeepSpeed())
