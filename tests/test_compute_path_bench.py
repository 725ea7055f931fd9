"""benchmarks/compute_path.py: every (model, variant) and the loss-curve runs it launches are valid flag sets, and the
device-time breakdown of a profiler trace classes kernels and measures the idle time between them."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import compute_path  # noqa: E402


def _parse(flags: str):
    from megatron.training.arguments import parse_args, validate_args

    # --log-memory-to-tensorboard reads the CUDA allocator: an error on CPU, and nothing else depends on it
    return validate_args(parse_args(flags.replace("--log-memory-to-tensorboard", "").split()), world_size=1, rank=0)


@pytest.mark.parametrize("model", sorted(compute_path.MODELS))
@pytest.mark.parametrize("variant", sorted(compute_path.VARIANTS))
def test_every_run_is_a_valid_flag_set(model, variant):
    args = _parse(f"{compute_path.COMMON} {compute_path.MODELS[model]} {compute_path.VARIANTS[variant]} "
                  f"--train-iters 12")
    assert args.attention_backend == ("unfused" if variant in ("stock", "unfused") else
                                      "flash" if variant == "sdpa_flash" else "auto")
    assert args.gradient_accumulation_fusion == (variant not in ("stock", "unfused", "sdpa_unfused_wgrad"))


def test_curve_runs_are_valid_flag_sets():
    for variant, seed in compute_path.CURVE_RUNS.values():
        args = _parse(f"{compute_path.CURVES} {compute_path.VARIANTS[variant]} --seed {seed} --train-iters 300")
        assert args.builtin_corpus == "python-stdlib" and args.seed == seed


def test_device_time_breakdown(tmp_path):
    kernels = [("nvjet_sm90_tst_256x128", 0, 4000), ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 4000, 2000),
               ("vectorized_layer_norm_kernel", 8000, 500), ("multi_tensor_apply_kernel_adam", 8500, 1000),
               ("triton_poi_fused_add_mul_tanh_0", 9500, 500)]  # (name, start us, duration us); 6000-8000 idle
    events = [{"cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10000})  # host ops are not device time
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert compute_path.device_time_breakdown(str(path)) == {
        "gemm": 4.0, "attention": 2.0, "optimizer": 1.0, "norm": 0.5, "elementwise/other": 0.5, "idle": 2.0,
        "span": 10.0, "top_other": [["multi_tensor_apply_kernel_adam", 1.0, 1],
                                    ["vectorized_layer_norm_kernel", 0.5, 1],
                                    ["triton_poi_fused_add_mul_tanh_0", 0.5, 1]]}
