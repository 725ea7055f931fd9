"""The typed compression config: built once from the flags, checked in one place per flag, and driven by one
``Compression`` object that imports no hook while every compression is off."""

import dataclasses
import subprocess
import sys

import pytest

from megatron.hooks.config import CompressionConfig, GradReduceConfig, ParamGatherConfig, TpCommConfig
from megatron.hooks.gather_methods import PARAM_GATHER_METHODS
from tests.test_arguments import make


def test_default_flags_give_the_default_configs():
    config = make().compression
    assert not config.enabled and not config.data_parallel
    assert config.param_gather == ParamGatherConfig() and config.grad_reduce == GradReduceConfig()
    assert dataclasses.replace(config.pp, hidden_size=None) == CompressionConfig().pp
    assert config.tp.largest_message_bytes == 32 * 2 * 64 * 4  # [seq, micro batch, hidden] in fp32


def test_flags_reach_their_components():
    config = make("--bf16 --use-distributed-optimizer --param-gather-compression delta --delta-block-size 512 "
                  "--tp-comm-compression taco --taco-format e4m3 --tp-comm-compression-min-bytes 0 "
                  "--grad-reduce-compression hadamard-int4", world_size=2).compression
    assert config.param_gather.method == "delta" and config.param_gather.delta.block_size == 512
    assert config.tp.taco.format == "e4m3" and config.tp.min_bytes == "0" and not config.tp.auto_min_bytes
    assert config.grad_reduce.quant().bits == 4 and config.param_gather.benefit_selection


def test_the_gather_methods_are_the_flags_choices():
    from megatron.training.arguments import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "param_gather_compression")
    assert action.choices == ["none", *PARAM_GATHER_METHODS]
    with pytest.raises(ValueError, match="--param-gather-compression must be one of"):
        ParamGatherConfig(method="zstd")


@pytest.mark.parametrize("config, message", [
    (lambda: TpCommConfig(method="taco", transformer_impl="transformer_engine"), "--transformer-impl local"),
    (lambda: TpCommConfig(min_bytes="-1"), "--tp-comm-compression-min-bytes"),
    (lambda: TpCommConfig(method="tahquant"), "--tp-comm-compression-min-bytes as a number"),
    (lambda: TpCommConfig(emulate=2, method="taco"), "--tp-comm-emulate needs"),
    (lambda: ParamGatherConfig(method="ciera", selection="all", ciera_cache_budget_mb=8.0), "--ciera-cache-budget-mb"),
    (lambda: ParamGatherConfig(trial_iters=3), "--param-gather-trial-iters"),
    (lambda: GradReduceConfig(method="int2"), "--grad-reduce-compression"),
])
def test_each_check_names_its_flag(config, message):
    with pytest.raises(ValueError, match=message):
        config()


def test_compression_off_imports_no_hook():
    script = (
        "import sys\n"
        "from megatron.hooks.config import CompressionConfig\n"
        "from megatron.hooks.lifecycle import Compression\n"
        "c = Compression(CompressionConfig())\n"
        "c.install_model([], None); c.install_data_parallel([], None); c.after_load()\n"
        "c.before_iteration(1); assert c.after_iteration(1, 0.1) == {}; c.close()\n"
        "hooks = ('tp', 'tp_emulation', 'pp', 'param_gather', 'param_gather_selection', 'fused_cast')\n"
        "print([h for h in hooks if 'megatron.hooks.' + h in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
