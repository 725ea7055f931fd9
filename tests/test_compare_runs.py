"""scripts/compare_runs.py: on metrics files written by the driver (GPU runs kept in results/wire_ratio/ and
tests/fixtures/) and on edge cases."""

import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import compare_runs  # noqa: E402

RUNS = os.path.join(ROOT, "results", "wire_ratio")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _record(iteration, loss, grad_norm=1.0, sent=100, **extra):
    return dict(iteration=iteration, loss=loss, grad_norm=grad_norm, iter_time_s=iteration * 0.1,
                comm={"dp_param_gather": {"raw_bytes": 400, "sent_bytes": sent}}, **extra)


def test_real_runs(capsys):
    # DP=2 GPT-125M on an H200: the fused cast and a repeat equal the sender-copy run under --deterministic-mode ...
    runs = [os.path.join(RUNS, f"deterministic_delta_{name}lr1e-4.jsonl") for name in ("", "fused_cast_", "repeat_")]
    assert compare_runs.main(["--bytes", *runs]) == 0
    assert capsys.readouterr().out.count("identical to") == 2
    # ... while without it the fused-cast run parted at iteration 147's grad norm (nondeterministic kernels)
    fused = os.path.join(FIXTURES, "gpt125m_dp2_delta_fused_cast_lr1e-4.jsonl")
    assert compare_runs.main([os.path.join(RUNS, "gpt125m_dp2_delta_lr1e-4.jsonl"), fused]) == 1
    out = capsys.readouterr().out
    assert "at 4 of 150 common iterations (iterations 1-150), first at iteration 147: grad_norm" in out


def test_fields_bytes_resume_and_missing_iterations(tmp_path, capsys):
    reference = _write(tmp_path / "a.jsonl", [_record(i, 2.0 - i / 10) for i in range(1, 6)])
    # times differ (ignored); a checksum only one run logged is not compared
    same = _write(tmp_path / "b.jsonl", [_record(i, 2.0 - i / 10, params_checksum="x") for i in range(1, 6)])
    assert compare_runs.main([reference, same]) == 0
    # other bytes: equal unless --bytes
    other_bytes = _write(tmp_path / "c.jsonl", [_record(i, 2.0 - i / 10, sent=90) for i in range(1, 6)])
    assert compare_runs.main([reference, other_bytes]) == 0
    assert compare_runs.main(["--bytes", reference, other_bytes]) == 1
    assert "first at iteration 1: sent bytes {'dp_param_gather': 100} vs {'dp_param_gather': 90}" in capsys.readouterr().out
    # a run resumed from iteration 3 into the same file: its records of 3-5 replace the first attempt's
    resumed = [_record(i, 9.0) for i in range(1, 6)] + [_record(i, 2.0 - i / 10) for i in range(1, 6)]
    assert compare_runs.main([reference, _write(tmp_path / "d.jsonl", resumed)]) == 0
    assert "identical to" in capsys.readouterr().out
    # one bit of a loss, two fields at once, fewer iterations
    parted = [_record(i, 2.0 - i / 10) for i in range(1, 4)]
    parted[1] = _record(2, math.nextafter(2.0 - 2 / 10, 2.0), grad_norm=1.5)  # the next float up
    assert compare_runs.main([reference, _write(tmp_path / "e.jsonl", parted)]) == 1
    out = capsys.readouterr().out
    assert "differs from" in out and "at 1 of 3 common iterations (iterations 1-3), first at iteration 2: loss 1.8 vs " \
        "1.8000000000000003; grad_norm 1.0 vs 1.5 (2 iterations only in" in out
    assert compare_runs.main([reference, _write(tmp_path / "f.jsonl", [_record(9, 1.0)])]) == 1
    assert "no iteration in common" in capsys.readouterr().out
