"""The SLURM launchers (scripts/slurm_{gpt,moe}.sbatch) under a stand-in srun and scontrol: the torchrun
command each node runs, and that the trainer accepts the flags it passes (parsed and validated)."""

import os
import re
import subprocess

import pytest

from megatron.training.arguments import parse_args, validate_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def srun_command(tmp_path, script, extra_env, *flags):
    """Run ``script`` as sbatch would (bash, from the repository root) with srun and scontrol stand-ins on PATH;
    return the arguments srun received."""
    record = tmp_path / "srun_args"
    (tmp_path / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\n')
    # more hostnames than a pipe holds: a launcher that pipes them into `head` dies of SIGPIPE under pipefail
    (tmp_path / "scontrol").write_text('#!/bin/bash\necho node1\nseq -f "node%g" 2 20000\n')
    for tool in ("srun", "scontrol"):
        os.chmod(tmp_path / tool, 0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=ROOT, **extra_env)
    subprocess.run(["bash", os.path.join(ROOT, "scripts", script), *flags], env=env, cwd=ROOT, check=True,
                   capture_output=True)
    return record.read_text().splitlines()


@pytest.mark.parametrize("script, extra_env, expected", [
    ("slurm_gpt.sbatch", {"CONFIG": "configs/gpt_1.3b.yaml", "TP": "2", "PP": "2"},
     ["pretrain_gpt.py", "--config", "configs/gpt_1.3b.yaml", "--tensor-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "2", "--exit-signal-handler", "--param-gather-compression", "delta"]),
    ("slurm_moe.sbatch", {"EP": "4"},
     ["pretrain_moe.py", "--config", "configs/olmoe_1b_7b.yaml", "--tensor-model-parallel-size", "1",
      "--pipeline-model-parallel-size", "1", "--exit-signal-handler", "--expert-model-parallel-size", "4",
      "--param-gather-compression", "delta"]),
])
def test_slurm_launchers(tmp_path, script, extra_env, expected):
    args = srun_command(tmp_path, script, extra_env, "--param-gather-compression", "delta")
    torchrun = args.index("torch.distributed.run")
    assert args[:2] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    launcher = " ".join(args[torchrun:torchrun + 11])
    assert launcher == ("torch.distributed.run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "
                        "node1:29500 --rdzv-id 42")
    trainer = args[torchrun + 11:]
    assert trainer == expected
    # What the nodes would run parses and validates (16 GPUs), --exit-signal-handler included.
    trainer_args = validate_args(parse_args(trainer[1:] + ["--mock-data", "--transformer-impl", "local"]),
                                 world_size=16, rank=0)
    assert trainer_args.exit_signal_handler and trainer_args.exit_signal == "SIGTERM"
    # The time-limit warning that --exit-signal-handler acts on must be in the submitted script itself.
    directives = re.findall(r"^#SBATCH (\S+)", open(os.path.join(ROOT, "scripts", script)).read(), re.M)
    assert "--signal=TERM@300" in directives
