"""The register caps the delta kernels launch with (kernels.delta.MAX_REGISTERS) do not make them spill where
it costs: every capped configuration compiled for sm_90 on the CPU (Triton's bundled ptxas, as
benchmarks/sass_count.py does) stores at most a few registers to local memory outside the per-value fallbacks for
rows of more than 64 bits (``_or_bits``, ``_load_bits``: 17-bit widths, crowded exceptions), and the launches leave
the configurations that would spill uncapped, and the hashed encoder and decoder keep ptxas's uniform datapath under
their caps.
(The TACO kernels need no cap: tests/test_taco_kernels.py.)"""

import pytest

pytest.importorskip("triton")

from benchmarks import sass_count as sc  # noqa: E402
from kernels import delta  # noqa: E402

# the delta encoder at 256-512-value blocks spills 4 registers under its cap of 80 and is 10-12% faster
# (H200); heavy spilling stores hundreds. At two rows per thread (B = 512, 1024) the
# encoder's per-value fallback spills ~40 under the cap of 80, which was faster than none
MAX_SPILL_STORES = 8
PER_VALUE_FALLBACKS = (delta._or_bits, delta._load_bits)


@pytest.mark.parametrize("block_size", [32, 64, 128, 256, 512, 1024, 4096])
def test_delta_caps_do_not_spill(block_size):
    for name, kernel in (("delta encode", "encode"), ("delta decode", "decode")):
        fn, signature, constexprs, _, _, _ = sc.KERNELS[name]
        cap = delta._max_registers(kernel, block_size)
        if block_size > delta.CAPPED_MAX_BLOCK:
            assert cap is None
            continue
        shape = dict(constexprs, **delta._launch_shape(kernel, block_size))
        stores, registers = sc.spill_stores(fn, signature, shape, delta._num_warps(block_size), cap,
                                            PER_VALUE_FALLBACKS)
        assert registers <= cap and stores <= MAX_SPILL_STORES, (name, registers, stores)


def _uniform_instructions(name: str, **constexprs) -> int:
    """Uniform-datapath instructions (opcodes U*) of a kernel of ``sass_count.KERNELS`` as it launches (with
    ``constexprs`` changed)."""
    fn, signature, launched, warps, _, cap = sc.KERNELS[name]
    ops, _ = sc.sass_opcodes(fn, signature, dict(launched, **constexprs), warps, True, cap)
    return sum(n for op, n in ops.items() if op.startswith("U"))


def test_hashed_encoder_keeps_the_uniform_datapath():
    """Under its cap the hashed encoder (the integrity check's default) computes the block-wide scalars of its width
    choice on ptxas's uniform datapath, as the plain one does: under a cap of 64 it moves ~80 of them onto the vector
    pipes that bound the kernel and costs 1.07x the plain codec's device time instead of 1.03x (docs/integrity.md,
    "Cost")."""
    plain = _uniform_instructions("delta encode, no integrity hash")
    hashed = _uniform_instructions("delta encode")
    assert plain > 80 and hashed >= 0.8 * plain, (plain, hashed)


@pytest.mark.parametrize("segmented, slot", [(False, False), (True, False), (True, True)],
                         ids=["plain", "gathered", "slots"])
def test_hashed_decoder_keeps_the_uniform_datapath(segmented, slot):
    """The hashed decoder, as a plain decode, a gather's (segmented) and a sync-free gather's (slots) launch it, keeps
    the uniform datapath and does not spill under its cap: with the hash slot's address from the int64 source row it
    ran 7-13 uniform instructions instead of the plain decoder's 21-29, and spilled one register."""
    shape = dict(SEGMENTED=segmented, ALIGNED=segmented, SLOT=slot)
    plain = _uniform_instructions("delta decode, no integrity hash", **shape)
    hashed = _uniform_instructions("delta decode", **shape)
    assert plain > 16 and hashed >= plain, (plain, hashed)
    fn, signature, constexprs, warps, _, cap = sc.KERNELS["delta decode"]
    stores, _ = sc.spill_stores(fn, signature, dict(constexprs, **shape), warps, cap)
    assert stores == 0
