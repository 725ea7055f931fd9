"""scripts/convergence.py's metrics files: kept gzipped once the runs finish, and the committed ones still give the
committed summaries."""

import gzip
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import compare_runs  # noqa: E402
import convergence  # noqa: E402

SEEDS_2K = os.path.join(ROOT, "results", "convergence", "taco_cpu_2k_seeds")


def test_archive_is_lossless_and_reproducible(tmp_path):
    records = [{"iteration": i, "loss": 1.0 / i, "eval_loss": 2.0 / 3} for i in range(1, 50)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    archived = []
    for name in ("a", "b"):
        path = tmp_path / name / "run.jsonl"
        path.parent.mkdir()
        path.write_text(text)
        convergence.archive_metrics(str(path))
        assert not path.exists()
        assert gzip.decompress((tmp_path / name / "run.jsonl.gz").read_bytes()).decode() == text
        assert convergence.read_metrics(str(path)) == records
        archived.append((tmp_path / name / "run.jsonl.gz").read_bytes())
    assert archived[0] == archived[1]  # no time stamp: the same records give the same bytes
    convergence.archive_metrics(str(tmp_path / "a" / "run.jsonl"))  # already archived: left as it is
    assert (tmp_path / "a" / "run.jsonl.gz").read_bytes() == archived[0]
    # compare_runs reads either form
    plain = tmp_path / "plain.jsonl"
    plain.write_text(text)
    assert compare_runs.main([str(plain), str(tmp_path / "a" / "run.jsonl.gz")]) == 0


def test_committed_metrics_give_the_committed_summary(tmp_path):
    # TACO vs INT8 vs baseline, 3 seeds, 2000 iterations: --reuse trains nothing and recomputes the summary
    for name in os.listdir(SEEDS_2K):
        if name.endswith(".jsonl.gz"):
            shutil.copy(os.path.join(SEEDS_2K, name), tmp_path)
    convergence.main(["--family", "taco", "--preset", "cpu-tiny-2k", "--variants", "baseline", "taco", "int8",
                      "--seeds", "1", "2", "3", "--reuse", "--out-dir", str(tmp_path)])
    with open(os.path.join(SEEDS_2K, "summary.json")) as f:
        committed = json.load(f)
    with open(tmp_path / "summary.json") as f:
        recomputed = json.load(f)
    assert recomputed["iteration"] == committed["iteration"] == 2000
    assert recomputed["runs"] == committed["runs"] and recomputed["results"] == committed["results"]
    assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(SEEDS_2K))  # nothing left unarchived
