"""Fused Triton TACO kernels against the plain-PyTorch reference.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in a spawned process: the
flag is read when ``@triton.jit`` decorates, so it must be set before kernels/taco.py is imported.

Tolerance: payload bytes and decoded fp32 values must be bit-identical, since both implementations
run the same IEEE operations in the same order (kernels/taco.py). The scales (alpha, s) must agree up
to one common power of two: alpha is picked from a sum of squares whose order differs, and at an
exact power-of-two boundary both scales double together, leaving s / alpha and the values unchanged. Decoded
bf16 may differ by one bf16 ulp under the interpreter only: its fp32->bf16 cast truncates instead
of rounding to nearest even (the GPU cast rounds like torch; the GPU test checks every dtype exactly).
"""

import multiprocessing as mp
import os

import pytest
import torch

from benchmarks.taco_codec_ablation import activation_like

CASES = [  # (block_size, format, transform, scaling, rows)
    (32, "e4m3", "ash", "dual", 1), (256, "e4m3", "ash", "dual", 3), (1024, "e4m3", "ash", "dual", 1),
    (64, "int8", "hadamard", "dual", 2), (128, "e5m2", "ash", "dual", 1), (64, "e4m3", "none", "single", 1),
    (256, "e4m3", "hadamard", "single", 2), (32, "int8", "ash", "single", 1), (512, "e4m3", "none", "dual", 1),
]


def _test_input(numel, dtype, device="cpu"):
    x = activation_like(tokens=numel // 1000 + 1, hidden=1000).reshape(-1)[:numel].clone()
    x[:64] = 0  # all-zero blocks at every block size
    x[5000] = float("nan")
    x[7000] = -float("inf")
    x[8000:8100] = 1e-42  # fp32 subnormals (flush to 0 in bf16/fp16)
    return x.to(dtype).to(device)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _compare(numel, device):
    """Run every case through both implementations; return the failures as strings."""
    from kernels import taco as K

    failures = []
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for i, (block_size, fmt, transform, scaling, rows) in enumerate(CASES):
        dtype = dtypes[i % 3]  # every input dtype meets several cases; keeps the interpreter run short
        x = _test_input(numel, dtype, device)
        args = (block_size, fmt, transform, scaling, rows)
        reference = K.taco_encode_reference(x, *args)
        fused = K.taco_encode_triton(x, *args)
        if not _wires_match(reference, fused, block_size):
            failures.append(f"encode {args} {dtype}: wires differ")
        for out_dtype in (torch.float32, dtype):
            dec_args = (reference, numel, out_dtype, block_size, fmt, transform, rows)
            ref_out = K.taco_decode_reference(*dec_args)
            fused_out = K.taco_decode_triton(*dec_args)
            exact = out_dtype == torch.float32 or device != "cpu"
            if not _decoded_match(ref_out, fused_out, exact):
                failures.append(f"decode {args} {dtype}->{out_dtype}: values differ")
    return failures


def _wires_match(ref, fused, block_size):
    ref, fused = ref.view(-1, block_size + 8), fused.view(-1, block_size + 8)
    alpha_ref, s_ref = ref[:, block_size:].contiguous().view(torch.float32).unbind(1)
    alpha_fused, s_fused = fused[:, block_size:].contiguous().view(torch.float32).unbind(1)
    return torch.equal(ref[:, :block_size], fused[:, :block_size]) and _decoded_match(
        s_ref / alpha_ref, s_fused / alpha_fused, exact=True)


def _decoded_match(ref, fused, exact):
    nan = ref.isnan()
    if not torch.equal(nan, fused.isnan()):
        return False
    ref, fused = ref[~nan], fused[~nan]
    if exact:
        return _same_bits(ref, fused)
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs() + torch.finfo(ref.dtype).tiny
    return bool(((ref.float() - fused.float()).abs() <= ulp).all())


def _interpret_worker(numel, queue):
    queue.put(_compare(numel, "cpu"))


def test_fused_kernels_match_reference_in_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned process only
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_interpret_worker, args=(10_007, queue))  # not a multiple of any block
    proc.start()
    failures = queue.get(timeout=300)
    proc.join(timeout=30)
    assert failures == []


@pytest.mark.gpu
def test_fused_kernels_match_reference_on_gpu():
    assert _compare(1_000_003, "cuda") == []


def test_kernel_benchmark_dry_run(tmp_path):
    from benchmarks import bench_taco_kernels

    result = bench_taco_kernels.main(["--dry-run", "--out", str(tmp_path / "kernels.json")])
    assert (tmp_path / "kernels.json").exists() and len(result["rows"]) == 2
    assert all(not row["problems"] and row["ratio_vs_bf16"] > 1.9 for row in result["rows"])
