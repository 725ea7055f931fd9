"""The CPU world harness reports a rank that dies in C code, instead of leaving its peers to time out."""

import os
import time

import pytest

from dist_utils import run_on_ranks


def _abort_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.abort()  # as glibc does on a corrupted heap
    dist.barrier()  # rank 0 waits for a peer that is gone


def test_a_rank_that_aborts_is_reported_with_its_signal():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        run_on_ranks(_abort_on_rank_one, 2, timeout=120)
    assert "rank 1 ended without reporting: died of SIGABRT" in str(error.value), str(error.value)
    assert time.monotonic() - start < 60  # not the timeout
