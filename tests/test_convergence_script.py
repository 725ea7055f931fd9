"""scripts/convergence.py's metrics files: kept gzipped once the runs finish, and the committed ones
(tests/fixtures/taco_cpu_2k_seeds/) still give the committed summaries (results/convergence/taco_cpu_2k_seeds.md)."""

import gzip
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import compare_runs  # noqa: E402
import convergence  # noqa: E402

SEEDS_2K = os.path.join(ROOT, "tests", "fixtures", "taco_cpu_2k_seeds")
SUMMARY_2K = os.path.join(ROOT, "results", "convergence", "taco_cpu_2k_seeds.md")


def test_archive_is_lossless_and_reproducible(tmp_path):
    records = [{"iteration": i, "loss": 1.0 / i, "eval_loss": 2.0 / 3} for i in range(1, 50)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    archived = []
    for folder, name in (("a", "run"), ("b", "other_run")):
        path = tmp_path / folder / f"{name}.jsonl"
        path.parent.mkdir()
        path.write_text(text)
        convergence.archive_metrics(str(path))
        assert not path.exists()
        assert gzip.decompress((tmp_path / folder / f"{name}.jsonl.gz").read_bytes()).decode() == text
        assert convergence.read_metrics(str(path)) == records
        archived.append((tmp_path / folder / f"{name}.jsonl.gz").read_bytes())
    assert archived[0] == archived[1]  # neither time stamp nor file name: the same records give the same bytes
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
    # the summary that results/ keeps, below its command line (which named the run's own output folder)
    with open(SUMMARY_2K) as committed_md, open(tmp_path / "summary.md") as recomputed_md:
        assert recomputed_md.read().splitlines()[1:] == committed_md.read().splitlines()[1:]
    # nothing left unarchived
    assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(SEEDS_2K) + ["loss_curves.png", "summary.md"])


def test_paper_presets_print_one_emulated_tp8_command_per_run(capsys):
    """gpu-125m-tp8: the paper's rows, each compressed one at TP=8 numerics on one process, the baseline
    plain and twice more for the noise band: with a second seed, and with the learning rate moved by 1e-6."""
    convergence.main(["--family", "taco", "--preset", "gpu-125m-tp8", "--out-dir", "OUT", "--print"])
    commands = capsys.readouterr().out.strip().splitlines()
    names = [c.split("--metrics-file OUT/")[1].removesuffix(".jsonl") for c in commands]
    assert names == ["baseline", "taco", "int8", "naive_fp8", "ds_only", "e5m2", "tahquant", "baseline_seed2",
                     "baseline_lr_jitter"]
    for name, command in zip(names, commands):
        assert "--nproc-per-node=1" in command and "--builtin-corpus python-site-packages" in command
        assert "--train-iters 3000" in command and "--config configs/gpt_125m.yaml" in command
        compressed = not name.startswith("baseline")
        assert ("--tp-comm-emulate 8" in command) == compressed == ("--tp-comm-compression " in command)
    assert all("--num-attention-heads 16" in c for c in commands)  # 2 heads per emulated rank
    assert commands[-2].endswith("--seed 2 --metrics-file OUT/baseline_seed2.jsonl")
    assert commands[-1].endswith("--lr 3.000003e-4 --metrics-file OUT/baseline_lr_jitter.jsonl")
    assert "--taco-format e4m3 --taco-transform none --taco-scaling single" in commands[3]  # naive FP8
    assert "--tp-comm-compression tahquant" in commands[6]


def test_a_record_cut_off_mid_write_is_left_out(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    path.write_text('{"iteration": 1, "loss": 3.0}\n{"iteration": 2, "loss": 2.9}\n{"iteration": 3, "lo')
    assert convergence.read_metrics(str(path)) == [{"iteration": 1, "loss": 3.0}, {"iteration": 2, "loss": 2.9}]
    assert "cut off" in capsys.readouterr().err
    path.write_text('{"iteration": 1, "loss": 3.0}\n')
    assert convergence.read_metrics(str(path)) == [{"iteration": 1, "loss": 3.0}]


def test_figure17_preset_emulates_tp4_pp2_dp2(capsys):
    """gpu-125m-tp4pp2dp2: the baseline, SDP4Bit at emulated DP=2 with TahQuant's pipeline messages at emulated PP=2
    ("2D"), and those with TACO at emulated TP=4 ("3D"), all in micro-batches of 4; every command a valid flag set
    of the driver."""
    from megatron.training.arguments import parse_args, validate_args

    convergence.main(["--family", "taco", "--preset", "gpu-125m-tp4pp2dp2", "--out-dir", "OUT", "--print"])
    commands = capsys.readouterr().out.strip().splitlines()
    names = [c.split("--metrics-file OUT/")[1].removesuffix(".jsonl") for c in commands]
    assert names == ["baseline", "sdp4bit_tahquant_pp", "taco_sdp4bit_tahquant_pp", "baseline_seed2",
                     "baseline_lr_jitter"]
    degrees = []
    for command in commands:
        flags = command.split("pretrain_gpt.py ")[1].split()
        args = validate_args(parse_args(flags), world_size=1, rank=0)
        assert (args.micro_batch_size, args.global_batch_size) == (4, 8)
        degrees.append((args.tp_comm_emulate, args.pp_comm_emulate, args.dp_comm_emulate, args.tp_comm_compression,
                        args.pp_comm_compression, args.param_gather_compression, args.grad_reduce_compression))
    plain = (1, 1, 1, "none", "none", "none", "none")
    assert degrees == [plain, (1, 2, 2, "none", "tahquant", "sdp4bit", "hadamard-int8"),
                       (4, 2, 2, "taco", "tahquant", "sdp4bit", "hadamard-int8"), plain, plain]


def _fake_run(out_dir, name, valid_end, test_end, until=20, sqnr=None):
    records = [{"iteration": i, "loss": 3.0 - i / 100} for i in range(1, until + 1)]
    if sqnr is not None:  # the emulated runs' samples: layers 0 and 1, worse late in training
        for i, shift in ((1, 5.0), (11, 0.0), (15, 0.0)):
            records[i - 1]["tp_sqnr_db"] = {f"module.module.decoder.layers.{layer}.mlp.linear_fc2.all_reduce":
                                            sqnr + shift - layer for layer in (0, 1)}
    records += [{"iteration": i, "eval_loss": valid_end + (until - i) / 100} for i in (10, until)]
    with gzip.open(out_dir / f"{name}.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    (out_dir / f"{name}.log").write_text(
        f" validation loss at iteration {until} on validation set | lm loss value: {valid_end:.6E} | \n"
        f" validation loss at iteration {until} on test set | lm loss value: {test_end:.6E} | \n")


# end-of-run (validation, test) losses of fake runs of the gpu-125m-tp8 preset
PAPER_LOSSES = {"baseline": (2.0, 2.1), "taco": (2.01, 2.11), "int8": (2.002, 2.1), "naive_fp8": (2.5, 2.6),
                "ds_only": (2.06, 2.16), "e5m2": (2.2, 2.3), "tahquant": (2.05, 2.15), "baseline_seed2": (2.004, 2.1),
                "baseline_lr_jitter": (2.001, 2.1021)}


def test_paper_table_reports_degradation_and_the_noise_band(tmp_path):
    """--reuse over the runs' metrics and logs (as the device calls leave them): Table 1's columns, the noise band
    from the other two baselines, and the validation-loss plot."""
    for name, (valid, test) in PAPER_LOSSES.items():
        _fake_run(tmp_path, name, valid, test, sqnr={"taco": 30.0, "naive_fp8": 12.0}.get(name))
    convergence.main(["--family", "taco", "--preset", "gpu-125m-tp8", "--reuse", "--out-dir", str(tmp_path)])
    table = (tmp_path / "table1.md").read_text()
    # SQNR per kind of site, layers pooled, from the second half of the samples (iterations 11 and 15)
    assert "| variant | decoder.mlp.linear_fc2.all_reduce |" in table
    assert "| taco | 29.5 / 29.0 |" in table and "| naive_fp8 | 11.5 / 11.0 |" in table
    assert "| taco | 2.0100 | 2.1100 | +0.50% | +0.48% |" in table
    assert "| naive_fp8 | 2.5000 | 2.6000 | +25.00% | +23.81% |" in table
    assert "| baseline_seed2 | 2.0040 | 2.1000 | +0.20% | +0.00% |" in table
    assert "another seed (data order, initialization, validation samples) (baseline_seed2) differs by 0.20%" in table
    assert "the learning rate moved by 1e-6 (the same data) (baseline_lr_jitter) differs by 0.10%" in table
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["table1"]["e5m2"]["valid_degradation_pct"] == pytest.approx(10.0)
    assert (tmp_path / "valid_loss.png").stat().st_size > 0 and (tmp_path / "loss_curves.png").stat().st_size > 0
    # a run without its log (no end-of-run evaluation): every row compares the last in-loop evaluation instead
    (tmp_path / "taco.log").unlink()
    convergence.main(["--family", "taco", "--preset", "gpu-125m-tp8", "--reuse", "--out-dir", str(tmp_path)])
    table = (tmp_path / "table1.md").read_text()
    assert "| taco | 2.0100 | - | +0.50% | - |" in table and "| baseline_seed2 | 2.0040 | - | +0.20% | - |" in table


def test_train_only_needs_no_baseline(capsys):
    convergence.main(["--family", "taco", "--preset", "gpu-125m-tp8", "--variants", "tahquant", "--train-only",
                      "--out-dir", "OUT", "--print"])
    assert capsys.readouterr().out.count("pretrain_gpt.py") == 1
    with pytest.raises(SystemExit):
        convergence.main(["--family", "taco", "--preset", "gpu-125m-tp8", "--variants", "tahquant", "--out-dir", "OUT"])


def test_a_results_folder_gives_its_table_without_the_logs(tmp_path):
    """A run trained by the script keeps its end-of-run losses in its metrics (``record_end_of_run``, from its log's
    final evaluation lines; a run cut short adds nothing), and the table's ``--reuse`` writes every run's records
    into ``metrics.jsonl.gz``: a folder holding only that file gives the same ``table1.md``, both evaluations."""
    runs = tmp_path / "runs"
    runs.mkdir()
    for name, (valid, test) in PAPER_LOSSES.items():
        _fake_run(runs, name, valid, test)
        plain = runs / f"{name}.jsonl"  # as the run leaves it, then what run_variants does once it finished
        with gzip.open(f"{plain}.gz", "rt") as f:
            plain.write_text(f.read())
        os.remove(f"{plain}.gz")
        convergence.record_end_of_run(str(plain), str(runs / f"{name}.log"))
        convergence.archive_metrics(str(plain))
    assert convergence.read_metrics(str(runs / "taco.jsonl"))[-1] == {
        "iteration": 20, "end_of_run": {"validation": 2.01, "test": 2.11}}
    cut_short = tmp_path / "cut.jsonl"
    cut_short.write_text('{"iteration": 1, "loss": 3.0}\n')
    (tmp_path / "cut.log").write_text(" iteration 1/ 20 | lm loss: 3.0 |\n")
    convergence.record_end_of_run(str(cut_short), str(tmp_path / "cut.log"))
    assert cut_short.read_text() == '{"iteration": 1, "loss": 3.0}\n'

    convergence.main(["--family", "taco", "--preset", "gpu-125m-tp8", "--reuse", "--out-dir", str(runs)])
    table = (runs / "table1.md").read_text()
    assert "the last in-loop evaluation" in table and "| taco | 2.0100 | - | +0.50% | - |" in table
    assert "The end-of-run evaluation (iteration 20" in table and "| taco | 2.0100 | 2.1100 | +0.50% | +0.48% |" in table
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(runs / "metrics.jsonl.gz", results)
    convergence.main(["--family", "taco", "--preset", "gpu-125m-tp8", "--reuse", "--out-dir", str(results)])
    assert (results / "table1.md").read_text() == table
    assert (results / "metrics.jsonl.gz").read_bytes() == (runs / "metrics.jsonl.gz").read_bytes()


@pytest.mark.slow
def test_a_run_stopped_at_a_time_limit_continues_from_its_checkpoint(tmp_path, monkeypatch):
    # The first part stops at iteration 3 and saves (--exit-interval here; --exit-duration-in-mins at a job's time
    # limit), the same command again continues from that checkpoint: one run's metrics, each iteration once, the bits
    # of the run trained in one go.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    common = ["--family", "taco", "--preset", "cpu-tiny", "--variants", "baseline", "--train-only", "--train-iters",
              "6", "--lr-warmup-iters", "1", "--eval-interval", "3", "--data-cache-path", str(tmp_path / "cache")]
    convergence.main([*common, "--out-dir", str(tmp_path / "whole")])
    in_parts = [*common, "--out-dir", str(tmp_path / "parts"), "--checkpoint-dir", str(tmp_path / "checkpoints"),
                "--exit-interval", "3"]
    convergence.main(in_parts)
    assert convergence.checkpoint_iteration(str(tmp_path / "checkpoints"), "baseline") == 3
    assert [r["iteration"] for r in convergence.read_metrics(str(tmp_path / "parts" / "baseline.jsonl"))] == [1, 2, 3]
    with gzip.open(tmp_path / "parts" / "baseline.jsonl.gz", "ab") as f:  # as a run killed mid-write leaves it
        f.write(b'{"iteration": 4, "lo')
    convergence.main(in_parts)
    whole, parts = (convergence.read_metrics(str(tmp_path / d / "baseline.jsonl")) for d in ("whole", "parts"))
    assert [r["iteration"] for r in parts] == [1, 2, 3, 4, 5, 6, 6]  # the last: its end-of-run losses
    assert [(r["iteration"], r.get("loss"), r.get("eval_loss"), r.get("end_of_run")) for r in parts] == \
           [(r["iteration"], r.get("loss"), r.get("eval_loss"), r.get("end_of_run")) for r in whole]
    with pytest.raises(RuntimeError, match="finished"):  # a finished run is kept (--reuse) or moved away
        convergence.main(in_parts)


def test_records_that_a_continued_run_repeats_replace_the_first(tmp_path):
    path = tmp_path / "run.jsonl"
    iterations = [1, 2, 3, 4, 3, 4, 5, 5]  # stopped after 4, continued from a checkpoint of 2; then its end of run
    path.write_text("".join(json.dumps({"iteration": i, "loss": float(k)}) + "\n" for k, i in enumerate(iterations[:-1]))
                    + json.dumps({"iteration": 5, "end_of_run": {"validation": 1.0}}) + "\n")
    records = convergence.read_metrics(str(path))
    assert [(r["iteration"], r.get("loss")) for r in records] == [(1, 0.0), (2, 1.0), (3, 4.0), (4, 5.0), (5, 6.0),
                                                                  (5, None)]
