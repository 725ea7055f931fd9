"""Checks run under Triton's interpreter (``TRITON_INTERPRET=1``, on the CPU), each group in a fresh Python: Triton
picks the interpreter when it is imported."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(*groups: str, timeout: float) -> None:
    """Run each group (Python statements, e.g. ``"import test_delta; test_delta._check_scan_tiles()"``, with the
    repository and tests/ importable) in its own Python under the interpreter, all groups at once (the interpreter
    keeps one core busy), and fail with a failed group's stderr. ``timeout`` (s) only catches a hang."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for code in groups]
    try:
        for proc in procs:
            _, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, stderr[-3000:]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
