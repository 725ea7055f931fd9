"""The register caps the codec kernels launch with (kernels.taco.LAUNCH, kernels.delta.MAX_REGISTERS) do not
make them spill: every capped configuration compiled for sm_90 on the CPU (Triton's bundled ptxas, as
benchmarks/sass_count.py does) stores at most a few registers to local memory, and the launches leave the
configurations that would spill uncapped."""

import math

import pytest

pytest.importorskip("triton")

from benchmarks import sass_count as sc  # noqa: E402
from kernels import delta, taco  # noqa: E402

# the delta encoder at 256-512-value blocks spills 4 registers under its cap of 80 and is 10-12% faster
# (results/gpu/README.md, session 8); heavy spilling stores hundreds
MAX_SPILL_STORES = 8
TACO_DECODE = sc._sig("src_u8 src_f32 src_stride skip out_ptr x_ptr x_start numel row_len blocks_per_row n_blocks "
                      "inv_sqrt_b", dict(src_u8="*u8", src_f32="*fp32", out_ptr="*bf16", x_ptr="*bf16",
                                         inv_sqrt_b="fp32"))


def _spill_stores(kernel, signature, constexprs, warps, cap) -> int:
    ops, registers = sc.sass_opcodes(kernel, signature, constexprs, warps, specialize=True, max_registers=cap)
    assert registers <= cap
    return ops.get("STL", 0)


def _launch_cap(kernel, block_size, sources):
    return taco._launch(kernel, 0, 1 << 20, 1 << 20, 1, block_size, "int8", "ash", sources)[2]["maxnreg"]


@pytest.mark.parametrize("block_size", taco.CAPPED_BLOCK_SIZES)
@pytest.mark.parametrize("fmt", ["int8", "e4m3", "e5m2"])
def test_taco_caps_do_not_spill(block_size, fmt):
    kernel, signature, constexprs, warps, _, _ = sc.KERNELS["TACO encode, INT8"]
    mantissa_bits, min_ulp = taco._GRID[fmt]
    shape = dict(B=block_size, LOG_B=int(math.log2(block_size)), ROWS=taco.LAUNCH["encode"][0] // block_size,
                 FORMAT=taco._FORMAT_ID[fmt])
    encode = dict(constexprs, **shape, MANTISSA_STEP=2.0**-mantissa_bits, MIN_ULP=min_ulp)
    assert _spill_stores(kernel, signature, encode, warps, _launch_cap("encode", block_size, 0)) <= MAX_SPILL_STORES
    for add_own in (False, True):
        decode = dict(shape, HADAMARD=True, SOURCES=1, ADD_OWN=add_own, EVEN=True)
        cap = _launch_cap("decode", block_size, 1)
        assert _spill_stores(taco._taco_decode_kernel, TACO_DECODE, decode, 1, cap) <= MAX_SPILL_STORES


def test_taco_fused_steps_and_other_block_sizes_run_uncapped():
    assert _launch_cap("encode", 256, 0) == taco.LAUNCH["encode"][2]
    assert _launch_cap("decode", 256, 1) == taco.LAUNCH["decode"][2]
    for kernel in ("encode", "decode"):
        assert _launch_cap(kernel, 256, 2) is None  # received rows folded in: they spill hundreds
        assert _launch_cap(kernel, 32, 1) is None and _launch_cap(kernel, 1024, 1) is None


@pytest.mark.parametrize("block_size", [32, 64, 128, 256, 512, 1024, 4096])
def test_delta_caps_do_not_spill(block_size):
    for name, kernel in (("delta encode", "encode"), ("delta decode", "decode")):
        fn, signature, constexprs, _, _, _ = sc.KERNELS[name]
        cap = delta._max_registers(kernel, block_size)
        if block_size > delta.CAPPED_MAX_BLOCK:
            assert cap is None
            continue
        shape = dict(constexprs, BLOCK=block_size)
        if "RECORD_WORDS" in shape:
            shape["RECORD_WORDS"] = block_size // 32 + delta._stream_words(block_size)
        assert _spill_stores(fn, signature, shape, delta._num_warps(block_size), cap) <= MAX_SPILL_STORES, name
