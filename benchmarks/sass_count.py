"""Static SASS instruction counts of codec Triton kernels (delta, TACO), compiled for sm_90 on the CPU.

Nsight Compute (results/kernels/delta_ncu.md) shows the delta encoder and decoder ALU-bound: their time
follows the instructions they execute. Their programs have no data-dependent loops (one program per
block, loops unrolled), so the static SASS count per program tracks the executed count (encode: 2784
static vs ~2084 executed per 256-value block of an earlier per-value encoder, the difference being skipped store branches) and lets a
kernel change be judged on a machine without a GPU before a GPU times it; memory-side costs do
not show (the atomic-OR packing cut the encoder's count 46% but its time 20%). Compiles with
Triton's bundled ptxas and disassembles with its nvdisasm; prints the count and the top opcodes.

    python benchmarks/sass_count.py            # the codec kernels
    python benchmarks/sass_count.py --specialize

By default every argument is compiled unspecialized (so the counts compare across kernel versions); a real
launch specializes pointers that are 16-byte aligned and integers divisible by 16, which lets loads and
stores vectorize. ``--specialize`` compiles that way: every pointer aligned and the sizes in
``SPECIALIZED_INTS`` divisible by 16, as in the benchmarks' launches (62.5M values, MiB-sized tensors).
"""

import argparse

import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels.delta as delta  # noqa: E402
import kernels.taco as taco  # noqa: E402

SPECIALIZED_INTS = ("numel", "x_start", "row_len", "blocks_per_row", "n_blocks")
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4}\*/\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def _disassemble(kernel, signature: dict, constexprs: dict, num_warps: int, specialize: bool, max_registers,
                 line_info: bool = False) -> tuple:
    """(SASS text, registers per thread) of ``kernel`` compiled for sm_90 (Hopper), with the launch options the
    codecs use (TACO disables FP contraction for bit-identity with its reference); ``specialize``: pointers and
    ``SPECIALIZED_INTS`` marked divisible by 16, as a launch with such values compiles; ``line_info``: each
    instruction's source line in comments."""
    options = {"num_warps": num_warps, "maxnreg": max_registers,
               "enable_fp_fusion": kernel not in (taco._taco_encode_kernel, taco._taco_decode_kernel)}
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
             if specialize and (kind.startswith("*") or name in SPECIALIZED_INTS)}
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    compiled = triton.compile(source(fn=kernel, signature={**signature, **{k: "constexpr" for k in constexprs}},
                                     constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        text = subprocess.run([os.path.join(tools, "nvdisasm"), "-c"] + ["-g"] * line_info + [f.name],
                              capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    return text, int(re.search(r"REG:(\d+)", usage).group(1))


def sass_opcodes(kernel, signature: dict, constexprs: dict, num_warps: int, specialize: bool = False,
                 max_registers=None):
    """(opcode -> count in the SASS, registers per thread) of ``kernel`` compiled for sm_90 as ``_disassemble``."""
    text, registers = _disassemble(kernel, signature, constexprs, num_warps, specialize, max_registers)
    return collections.Counter(m.group(1) for m in map(_INSTRUCTION.match, text.splitlines()) if m), registers


def spill_stores(kernel, signature: dict, constexprs: dict, num_warps: int, max_registers, outside=()) -> tuple:
    """(local-memory stores, i.e. register spills, registers per thread) of ``kernel`` compiled for sm_90 as
    ``_disassemble`` with the pointers and sizes specialized, leaving out the stores on the source lines of the
    Triton functions ``outside`` (after inlining, each instruction keeps its line)."""
    text, registers = _disassemble(kernel, signature, constexprs, num_warps, True, max_registers, line_info=True)
    def module(path):  # "kernels/delta.py": Triton's cache may hold the binary compiled from another checkout
        return os.path.join(*os.path.normpath(path).split(os.sep)[-2:])

    skipped = set()
    for fn in outside:
        lines, first = inspect.getsourcelines(fn.fn)
        skipped.update((module(inspect.getsourcefile(fn.fn)), first + k) for k in range(len(lines)))
    where, stores = None, 0
    for line in text.splitlines():
        at = re.search(r'File "([^"]+)", line (\d+)', line)
        if at:
            where = (module(at.group(1)), int(at.group(2)))
        elif re.match(r"\s*/\*[0-9a-f]{4}\*/.*\bSTL\b", line) and where not in skipped:
            stores += 1
    return stores, registers


def _sig(names: str, types: dict) -> dict:
    return {n: types.get(n, "i32") for n in names.split()}


B = 256
_TABLE = dict(start_ptr="*i64", stride_ptr="*i64", valid_ptr="*i32")  # the block table of segmented shards
_PLAIN = dict(SEGMENTED=False, ALIGNED=False)  # a plain shard (the table unused); segmented: SEGMENTED=True
TACO_ENCODE_SIGNATURE = _sig(
    "x_ptr wire_u8 wire_f32 amax_ptr scale_ptr scale_blocks src_u8 src_f32 src_stride skip x_start numel row_len "
    "blocks_per_row "
    "n_blocks tau qmax inv_qmax inv_sqrt_b eps",
    dict(x_ptr="*bf16", wire_u8="*u8", wire_f32="*fp32", amax_ptr="*fp32", scale_ptr="*fp32", src_u8="*u8",
         src_f32="*fp32", tau="fp32", qmax="fp32", inv_qmax="fp32", inv_sqrt_b="fp32", eps="fp32"))
TACO_DECODE_SIGNATURE = _sig(
    "src_u8 src_f32 src_stride skip out_ptr x_ptr x_start numel row_len blocks_per_row n_blocks inv_sqrt_b",
    dict(src_u8="*u8", src_f32="*fp32", out_ptr="*bf16", x_ptr="*bf16", inv_sqrt_b="fp32"))
TACO_SHAPE = dict(B=B, LOG_B=8, R=taco.PROGRAM_VALUES // B, FORMAT=taco._FORMAT_ID["int8"], HADAMARD=True, EVEN=True,
                  SKIP=False, SKIP_OWN_ROW=False)
DELTA_ENCODE_SIGNATURE = _sig(
    "prev_ptr new_ptr numel start_ptr stride_ptr valid_ptr shard_rank codes_ptr counts_ptr n_esc_ptr "
    "exc_widths_ptr nbytes_ptr records_ptr tile_sums_ptr hash_slots_ptr",
    dict(prev_ptr="*i16", new_ptr="*i16", codes_ptr="*u8", counts_ptr="*i32", n_esc_ptr="*i32",
         exc_widths_ptr="*u8", nbytes_ptr="*i64", records_ptr="*i32", tile_sums_ptr="*i64", hash_slots_ptr="*i64",
         **_TABLE))
DELTA_DECODE_SIGNATURE = _sig(
    "out_ptr numel start_ptr stride_ptr valid_ptr payload_ptr payload_stride base_misalign codes_at "
    "groups_at regions_at src_base skip_rank n_blocks sizes_ptr sizes_stride capacity hashes_ptr",
    dict(out_ptr="*i16", payload_ptr="*u8", sizes_ptr="*i64", capacity="i64", hashes_ptr="*i64", **_TABLE))
KERNELS = {  # name -> (kernel, signature, constexprs, num_warps, values per program, register cap)
    # with the integrity hash, as they launch by default (--param-gather-integrity-check), then without
    "delta encode": (delta._encode_kernel, DELTA_ENCODE_SIGNATURE,
                     dict(delta._launch_shape("encode", B), HASH=True, **_PLAIN),
                     delta._num_warps(B), B, delta._max_registers("encode", B)),
    "delta decode": (delta._decode_kernel, DELTA_DECODE_SIGNATURE,
                     dict(delta._launch_shape("decode", B), WORDS=True, SLOT=False, HASH=True, **_PLAIN),
                     delta._num_warps(B), B, delta._max_registers("decode", B)),
    "delta encode, no integrity hash": (delta._encode_kernel, DELTA_ENCODE_SIGNATURE,
                                        dict(delta._launch_shape("encode", B), HASH=False, **_PLAIN),
                                        delta._num_warps(B), B, delta._max_registers("encode", B)),
    "delta decode, no integrity hash": (delta._decode_kernel, DELTA_DECODE_SIGNATURE,
                                        dict(delta._launch_shape("decode", B), WORDS=True, SLOT=False, HASH=False,
                                             **_PLAIN), delta._num_warps(B), B, delta._max_registers("decode", B)),
    # TACO INT8 encode and decode at their launch (1024 values = 4 blocks of 256 per one-warp program), ASH + dual
    "TACO encode, INT8": (taco._taco_encode_kernel, TACO_ENCODE_SIGNATURE,
                          dict(TACO_SHAPE, GAIN=taco._gain(B, "ash"), SOURCES=0, RESCALE=taco._rescales("ash", "dual"),
                               SCALE_MODE=taco._DUAL), 1, taco.PROGRAM_VALUES, None),
    "TACO decode, INT8": (taco._taco_decode_kernel, TACO_DECODE_SIGNATURE, dict(TACO_SHAPE, SOURCES=1, ADD_OWN=False),
                          1, taco.PROGRAM_VALUES, None),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specialize", action="store_true", help="aligned pointers, sizes divisible by 16")
    args = p.parse_args()
    print(f"| kernel (B={B}) | SASS instructions per program | per value | registers | top opcodes |")
    print("|---|---|---|---|---|")
    for name, (kernel, signature, constexprs, warps, values, cap) in KERNELS.items():
        ops, registers = sass_opcodes(kernel, signature, constexprs, warps, args.specialize, cap)
        total = sum(ops.values())
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
        print(f"| {name} | {total} | {total * 32 * warps / values:.0f} | {registers} | {top} |", flush=True)


if __name__ == "__main__":
    main()
