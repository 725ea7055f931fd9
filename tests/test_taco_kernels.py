"""Fused TACO kernels (Gluon) against the plain-PyTorch reference.

The kernels are written in Gluon, which Triton's interpreter does not run: on the CPU they are compiled for sm_90
(every format, block size and fused step; no register spills, and the plain encode and decode within 64
registers, so that 32 one-warp programs fit an SM), and on the GPU their wires and decoded values are compared
with the reference bit for bit (the reference runs on CUDA there too, so torch's CUDA arithmetic is checked
against the kernels). No tolerance: both run the same IEEE operations in the same order (kernels/taco.py).
"""

import json
import math

import pytest
import torch

from benchmarks.taco_codec_ablation import activation_like

CASES = [  # (block_size, format, transform, scaling, rows)
    (32, "e4m3", "ash", "dual", 1), (256, "e4m3", "ash", "dual", 3), (1024, "e4m3", "ash", "dual", 1),
    (64, "int8", "hadamard", "dual", 2), (128, "e5m2", "ash", "dual", 1), (64, "e4m3", "none", "single", 1),
    (256, "e4m3", "hadamard", "single", 2), (32, "int8", "ash", "single", 1), (512, "e4m3", "none", "dual", 1),
]


def _test_input(numel, dtype):
    x = activation_like(tokens=numel // 1000 + 1, hidden=1000).reshape(-1)[:numel].clone()
    x[:64] = 0  # all-zero blocks at every block size
    x[5000] = float("nan")
    x[7000] = -float("inf")
    x[8000:8100] = 1e-42  # fp32 subnormals (flush to 0 in bf16/fp16)
    x[9000] = -0.0
    return x.to(dtype).cuda()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _compare(numel):
    """Run every case through both implementations; return the failures as strings."""
    from kernels import taco as K

    failures = []
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for i, (block_size, fmt, transform, scaling, rows) in enumerate(CASES):
        dtype = dtypes[i % 3]  # every input dtype meets several cases
        x = _test_input(numel, dtype)
        args = (block_size, fmt, transform, scaling, rows)
        reference = K.taco_encode_reference(x, *args)
        fused = K.taco_encode_triton(x, *args)
        if not _same_bits(reference, fused):
            failures.append(f"encode {args} {dtype}: wires differ")
        for out_dtype in (torch.float32, dtype):
            dec_args = (reference, numel, out_dtype, block_size, fmt, transform, rows)
            ref_out = K.taco_decode_reference(*dec_args)
            fused_out = K.taco_decode_triton(*dec_args)
            if not _decoded_match(ref_out, fused_out):
                failures.append(f"decode {args} {dtype}->{out_dtype}: values differ")
        failures += _compare_reductions(x, i, args)
    return failures + _compare_full_blocks()


def _compare_full_blocks():
    """bf16 inputs of whole programs' worth of full blocks: the unmasked (EVEN) launch, INT8 and E4M3."""
    from kernels import taco as K

    failures = []
    x = _test_input(16_384, torch.bfloat16)
    for args in ((256, "int8", "ash", "dual", 1), (256, "e4m3", "ash", "dual", 2), (128, "int8", "hadamard", "single", 2)):
        if not _same_bits(K.taco_encode_reference(x, *args), K.taco_encode_triton(x, *args)):
            failures.append(f"encode {args} bf16 full blocks: wires differ")
    world, args = 2, (256, "int8", "ash", "dual")
    recv = K.taco_encode_reference(x.flip(0), *args, world)
    reference = K.taco_reduce_encode_reference(x, recv, 1, world, *args)
    if not _same_bits(reference, K.taco_reduce_encode_triton(x, recv, 1, world, *args)):
        failures.append(f"reduce_encode {args} bf16 full blocks: wires differ")
    return failures


def _compare_reductions(x, case, args):
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
    if not _decoded_match(reference, fused):
        failures.append(f"reduce_decode {args} world {world}: values differ")
    failures += _compare_group_steps(others, args, world)
    wires = torch.cat([K.taco_encode_reference(o, *args[:4]) for o in others])  # the one-shot all-reduce
    reference = K.taco_decode_sum_reference(wires, world, n, own.dtype, block_size, fmt, transform)
    fused = K.taco_decode_sum_triton(wires, world, n, own.dtype, block_size, fmt, transform)
    if not _decoded_match(reference, fused):
        failures.append(f"decode_sum {args} world {world}: values differ")
    return failures


def _compare_group_steps(parts, args, world):
    """Every rank's encode and fused step in one launch (the TP emulation's) against the reference and against
    the ranks' own launches, bit for bit (one scale per rank's tensor under "single")."""
    from compression.tp_collectives import _own_rows
    from kernels import taco as K

    block_size, fmt, transform, scaling, _ = args
    own = _own_rows(parts, world)
    wires = torch.cat([K.taco_encode_reference(p, block_size, fmt, transform, scaling, world) for p in parts])
    recv = wires.view(world, world, -1)
    failures = []
    for rows in (1, world):
        ranks = torch.cat([K.taco_encode_triton(p, block_size, fmt, transform, scaling, rows) for p in parts])
        reference = K.taco_encode_reference(parts, block_size, fmt, transform, scaling, world * rows, world)
        fused = K.taco_encode_triton(parts, block_size, fmt, transform, scaling, world * rows, world)
        if not (_same_bits(reference, fused) and _same_bits(ranks, fused)):
            failures.append(f"encode of {world} ranks' {rows} row(s) {args}: wires differ")
    reference = K.taco_reduce_encode_rows_reference(own, wires, block_size, fmt, transform, scaling)
    ranks = torch.cat([K.taco_reduce_encode_triton(parts[r], recv[:, r].reshape(-1), r, world, block_size, fmt,
                                                   transform, scaling) for r in range(world)])
    fused = K.taco_reduce_encode_rows_triton(own, wires, block_size, fmt, transform, scaling)
    if not (_same_bits(reference, fused) and _same_bits(ranks, fused)):
        failures.append(f"reduce_encode_rows {args} world {world}: wires differ")
    reference = K.taco_reduce_decode_rows_reference(own, wires, block_size, fmt, transform)
    ranks = torch.cat([K.taco_reduce_decode_triton(parts[r], recv[:, r].reshape(-1), r, world, block_size, fmt,
                                                   transform) for r in range(world)])
    fused = K.taco_reduce_decode_rows_triton(own, wires, block_size, fmt, transform)
    if not (_decoded_match(reference, fused) and _decoded_match(ranks, fused)):
        failures.append(f"reduce_decode_rows {args} world {world}: values differ")
    return failures


def _decoded_match(ref, fused):
    nan = ref.isnan()
    return torch.equal(nan, fused.isnan()) and _same_bits(ref[~nan], fused[~nan])


COMPILED = [  # (format, block size, encode SOURCES / decode SOURCES, EVEN, each row skipping its own source row):
    # plain, uneven, fused steps, the emulated group's fused steps
    ("int8", 256, 0, True, False), ("e4m3", 256, 0, False, False), ("e5m2", 32, 0, True, False),
    ("int8", 1024, 0, False, False), ("e4m3", 64, 2, True, False), ("int8", 512, 4, False, False),
    ("e5m2", 128, 8, True, False), ("e4m3", 256, 8, True, True), ("int8", 64, 4, False, True),
]


@pytest.mark.parametrize("fmt,block_size,sources,even,own_row", COMPILED)
def test_kernels_compile_for_sm90_without_spills(fmt, block_size, sources, even, own_row):
    pytest.importorskip("triton")
    from benchmarks import sass_count as sc
    from kernels import taco as K

    shape = dict(B=block_size, LOG_B=int(math.log2(block_size)), R=K.PROGRAM_VALUES // block_size,
                 FORMAT=K._FORMAT_ID[fmt], HADAMARD=True, EVEN=even, SKIP=sources > 0, SKIP_OWN_ROW=own_row)
    builds = [(K._taco_encode_kernel, sc.TACO_ENCODE_SIGNATURE,
               dict(shape, GAIN=float(block_size), SOURCES=sources, RESCALE=sources == 0, SCALE_MODE=K._SINGLE_QUANT
                    if sources == 0 else K._DUAL)),
              (K._taco_decode_kernel, sc.TACO_DECODE_SIGNATURE,
               dict(shape, SOURCES=max(sources, 1), ADD_OWN=sources > 0))]
    for kernel, signature, constexprs in builds:
        ops, registers = sc.sass_opcodes(kernel, signature, constexprs, 1, specialize=even)
        assert ops.get("STL", 0) == 0, (kernel, constexprs)
        if sources == 0 and even:
            assert registers <= 64, (kernel, registers)


@pytest.mark.gpu
def test_fused_kernels_match_reference_on_gpu():
    assert _compare(1_000_003) == []


@pytest.mark.gpu
def test_fused_steps_benchmark_checks_and_times_every_step(tmp_path):
    from benchmarks import bench_taco_fused_steps

    bench_taco_fused_steps.main(["--mib", "1", "--worlds", "2,4", "--out", str(tmp_path / "steps.json")])
    result = json.loads((tmp_path / "steps.json").read_text())
    assert not result["problems"] and len(result["rows"]) == 6 and all(r["device_us"] > 0 for r in result["rows"])


def test_cuda_tensors_without_the_kernels_use_the_reference_with_a_warning(monkeypatch):
    from types import SimpleNamespace

    from kernels import taco as K

    monkeypatch.setattr(K, "gl", None)  # as with no Triton, or one whose Gluon predates 3.6
    K._warn_without_kernels.cache_clear()
    with pytest.warns(UserWarning, match="need Triton 3.6"):
        assert not K._use_kernels(SimpleNamespace(is_cuda=True))
    assert not K._use_kernels(SimpleNamespace(is_cuda=False))


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

    from kernels.taco import _quantize_reference, _wire_order

    m = torch.tensor(100.3)  # each block's max|h|: c = 127 / m (fp32, IEEE-rounded), not a power of two
    c = torch.tensor(127.0) / m
    targets = (torch.arange(-126, 126, dtype=torch.float32)[:252] + 0.5) / c  # h * c within rounding of k + 1/2
    rows = [targets, targets.nextafter(targets + 1), targets.nextafter(targets - 1),
            torch.randn(252, generator=torch.Generator().manual_seed(0)).clamp(-3, 3) * 30]
    h = torch.stack([torch.cat([m.view(1), r, torch.tensor([-0.0, 0.0, 1e-42])]) for r in rows])
    wire = _quantize_reference(h, "int8", "hadamard", "dual").view(4, 264)
    q = _wire_order(wire[:, :256], inverse=True).view(torch.int8)
    exact_c = Fraction(c.item())
    expected = [[round(Fraction(v) * exact_c) for v in row.tolist()] for row in h]
    assert q.tolist() == expected
    fp32_first = torch.round(h * c).to(torch.int8)  # the cases where rounding twice differs are in the input
    assert (fp32_first != q).any()
