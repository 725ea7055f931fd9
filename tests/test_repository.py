"""The repository stays small enough to travel to the lent GPUs: a device call carries the tracked files plus the
megatron-core wheels (~2-3 MiB each, scripts/gpu/setup_device.sh) and refuses more than 64 MiB."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACKED_LIMIT_MIB = 48  # room for two wheels and the results of a few more sessions


def test_tracked_files_fit_a_device_call():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [p.decode() for p in listed.split(b"\0") if p]
    sizes = {p: os.path.getsize(os.path.join(ROOT, p)) for p in paths if os.path.isfile(os.path.join(ROOT, p))}
    total_mib = sum(sizes.values()) / 2**20
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total_mib < TRACKED_LIMIT_MIB, (
        f"tracked files take {total_mib:.1f} MiB (limit {TRACKED_LIMIT_MIB}); largest: {largest}. Keep large "
        "results gzipped (scripts/convergence.py archive_metrics) or out of the repository")
