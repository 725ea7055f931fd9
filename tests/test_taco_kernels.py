"""Fused Triton TACO kernels against the plain-PyTorch reference.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1) in a spawned process: the
flag is read when ``@triton.jit`` decorates, so it must be set before kernels/taco.py is imported.

Tolerance: none for the wire (payload and scales) and decoded fp32 values: both implementations
run the same IEEE operations in the same order (kernels/taco.py). Decoded bf16 may differ by one
bf16 ulp under the interpreter only: its fp32->bf16 cast truncates instead of rounding to nearest
even (the GPU cast rounds like torch; the GPU test checks every dtype exactly). On the GPU the
reference runs on CUDA too, so torch's CUDA arithmetic is checked against the kernels.
"""

import multiprocessing as mp

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
    x[9000] = -0.0
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
        if not _same_bits(reference, fused):
            failures.append(f"encode {args} {dtype}: wires differ")
        for out_dtype in (torch.float32, dtype):
            dec_args = (reference, numel, out_dtype, block_size, fmt, transform, rows)
            ref_out = K.taco_decode_reference(*dec_args)
            fused_out = K.taco_decode_triton(*dec_args)
            exact = out_dtype == torch.float32 or device != "cpu"
            if not _decoded_match(ref_out, fused_out, exact):
                failures.append(f"decode {args} {dtype}->{out_dtype}: values differ")
        failures += _compare_reductions(x, i, args, device)
    return failures + _compare_full_blocks(device)


def _compare_full_blocks(device):
    """bf16 inputs of whole programs' worth of full blocks: the unmasked (EVEN) launch, INT8 and E4M3."""
    from kernels import taco as K

    failures = []
    x = _test_input(16_384, torch.bfloat16, device)
    for args in ((256, "int8", "ash", "dual", 1), (256, "e4m3", "ash", "dual", 2), (128, "int8", "hadamard", "single", 2)):
        if not _same_bits(K.taco_encode_reference(x, *args), K.taco_encode_triton(x, *args)):
            failures.append(f"encode {args} bf16 full blocks: wires differ")
    world, args = 2, (256, "int8", "ash", "dual")
    recv = K.taco_encode_reference(x.flip(0), *args, world)
    reference = K.taco_reduce_encode_reference(x, recv, 1, world, *args)
    if not _same_bits(reference, K.taco_reduce_encode_triton(x, recv, 1, world, *args)):
        failures.append(f"reduce_encode {args} bf16 full blocks: wires differ")
    return failures


def _compare_reductions(x, case, args, device):
    """The fused all-reduce middle step and reduce-scatter end against their references."""
    from kernels import taco as K

    block_size, fmt, transform, _, _ = args
    world = 2 + case % 3
    n = x.numel() // world * world
    own = x[:n]
    others = torch.stack([x.roll(j)[:n] * (j - 1.5) for j in range(world)])
    row_wires = [K.taco_encode_reference(o, *args[:4], world).view(world, -1) for o in others]
    recv = torch.cat([wires[case % world] for wires in row_wires])
    rank = (case + 1) % world
    failures = []
    reference = K.taco_reduce_encode_reference(own, recv, rank, world, *args[:4])
    if not _same_bits(reference, K.taco_reduce_encode_triton(own, recv, rank, world, *args[:4])):
        failures.append(f"reduce_encode {args} world {world}: wires differ")
    reference = K.taco_reduce_decode_reference(own, recv, rank, world, block_size, fmt, transform)
    fused = K.taco_reduce_decode_triton(own, recv, rank, world, block_size, fmt, transform)
    if not _decoded_match(reference, fused, own.dtype == torch.float32 or device != "cpu"):
        failures.append(f"reduce_decode {args} world {world}: values differ")
    wires = torch.cat([K.taco_encode_reference(o, *args[:4]) for o in others])  # the one-shot all-reduce
    reference = K.taco_decode_sum_reference(wires, world, n, own.dtype, block_size, fmt, transform)
    fused = K.taco_decode_sum_triton(wires, world, n, own.dtype, block_size, fmt, transform)
    if not _decoded_match(reference, fused, own.dtype == torch.float32 or device != "cpu"):
        failures.append(f"decode_sum {args} world {world}: values differ")
    return failures


def _decoded_match(ref, fused, exact):
    nan = ref.isnan()
    if not torch.equal(nan, fused.isnan()):
        return False
    ref, fused = ref[~nan], fused[~nan]
    if exact:
        return _same_bits(ref, fused)
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs() + torch.finfo(ref.dtype).tiny
    return bool(((ref == fused) | ((ref.float() - fused.float()).abs() <= ulp)).all())  # == for +-inf


def _interpret_worker(numel, queue):
    try:
        queue.put(_compare(numel, "cpu"))
    except BaseException:  # report it rather than leave the parent waiting on the queue
        import traceback

        queue.put([traceback.format_exc()])


def test_fused_kernels_match_reference_in_interpreter(monkeypatch):
    pytest.importorskip("triton", reason="the Triton interpreter needs triton (pip install '.[dev]')")
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


def test_int8_reference_rounds_the_exact_product_once():
    """The fused encoder's INT8 byte is the low byte of fma(h, c, 1.5 * 2**23): the exact product h * c rounded
    once to an integer, ties to even. The reference rounds h * c in float64 (exact: 24 x 24 mantissa bits)
    and must agree with exact rational arithmetic, also where the fp32 product alone would round onto a
    tie (x.5) that the exact product is not (there rounding twice can go the other way)."""
    from fractions import Fraction

    from kernels.taco import _quantize_reference

    m = torch.tensor(100.3)  # each block's max|h|: c = 127 / m (fp32, IEEE-rounded), not a power of two
    c = torch.tensor(127.0) / m
    targets = (torch.arange(-126, 126, dtype=torch.float32)[:252] + 0.5) / c  # h * c within rounding of k + 1/2
    rows = [targets, targets.nextafter(targets + 1), targets.nextafter(targets - 1),
            torch.randn(252, generator=torch.Generator().manual_seed(0)).clamp(-3, 3) * 30]
    h = torch.stack([torch.cat([m.view(1), r, torch.tensor([-0.0, 0.0, 1e-42])]) for r in rows])
    wire = _quantize_reference(h, "int8", "hadamard", "dual").view(4, 264)
    q = wire[:, :256].view(torch.int8)
    exact_c = Fraction(c.item())
    expected = [[round(Fraction(v) * exact_c) for v in row.tolist()] for row in h]
    assert q.tolist() == expected
    fp32_first = torch.round(h * c).to(torch.int8)  # the cases where rounding twice differs are in the input
    assert (fp32_first != q).any()
