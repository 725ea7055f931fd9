"""The 4-/8-GPU benchmark suites of issue 6 run end to end with 8 CPU processes (tiny models), so the
GPU runs on the larger machines start from code that already works. Checks the speed script's
records and that the lossless param-gather variants stay bit-identical to the baseline."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--train-iters", "3", "--warmup", "1", "--lr-warmup-iters", "1", "--links", "nvlink",
        "--tp-comm-compression-min-bytes", "0", "--params-checksum-interval", "1"]


def _suite(tmp_path, suite, model, *extra):
    out = tmp_path / f"{suite}.json"
    cmd = [sys.executable, "benchmarks/e2e_throughput.py", "--suite", suite, "--model", model, *TINY,
           "--log-dir", str(tmp_path / "logs"), "--out", str(out), "--data-cache-path", str(tmp_path / "cache"), *extra]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def _metrics(tmp_path, suite, variant):
    path = tmp_path / "logs" / f"{suite}_nvlink_{variant}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_tp8_taco_suite_on_8_cpu_processes(tmp_path):
    # one compressed variant: the others differ only in codec options, which the codec tests cover; one micro-batch
    # per iteration (8 ranks on a few cores make every TP collective slow) (suite time)
    report = _suite(tmp_path, "tp8_sp_taco", "configs/tiny_cpu_gpt.yaml", "--num-attention-heads", "8",
                    "--global-batch-size", "2", "--variants", "taco")
    assert [r["variant"] for r in report["runs"]] == ["baseline", "taco"]
    tp = _metrics(tmp_path, "tp8_sp_taco", "taco")[-1]["comm"]["tp"]
    assert 0 < tp["sent_bytes"] < tp["raw_bytes"]


@pytest.mark.slow
def test_dp8_moe_param_gather_suite_on_8_cpu_processes(tmp_path):
    # one lossless variant: CIERA's differs in its codec only, which the codec and two-process driver tests cover,
    # CIERA's with MoE among them (suite time: each variant is 8 processes' start-up)
    report = _suite(tmp_path, "dp8_moe_param_gather", "configs/tiny_cpu_moe.yaml",
                    "--expert-model-parallel-size", "2", "--global-batch-size", "16", "--variants", "delta")
    assert [r["variant"] for r in report["runs"]] == ["baseline", "delta"]
    baseline = _metrics(tmp_path, "dp8_moe_param_gather", "baseline")
    run = _metrics(tmp_path, "dp8_moe_param_gather", "delta")
    assert [(r["loss"], r["params_checksum"]) for r in run] == [(r["loss"], r["params_checksum"]) for r in baseline]
