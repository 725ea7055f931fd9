"""Diagnostic: the delta codec's block kernels in CUDA C++ with warp intrinsics, against the Triton kernels.

Sessions 14 and 20 found every Triton version of the delta kernels bound by integer work (docs/delta.md: 2.1-2.7
warp instructions per value; 50% of copy needs about 0.9) and named what was never tried: "a CUDA kernel with warp
intrinsics (ballot/popc/shuffles, shared-memory word assembly)". ``diag_delta_cuda.cu`` is that, for the wire format
as it is (B = 256; written for format 2 in session 21, its decoder moved to format 3's group entries in session 25):
``delta_encode`` and ``delta_decode`` take and give exactly what ``kernels.delta.encode_blocks`` and
``decode_blocks`` do for a plain shard and one payload, so they are swapped in under the production codec (prefix
sums and record gather unchanged) and the payloads compared byte for byte with the PyTorch reference's
before anything is timed. Then device time (PyTorch profiler) of whole encodes and decodes and of the kernels alone,
production vs CUDA, against a bf16 copy, on the simulated AdamW step of bench_delta_kernels.py.

    python benchmarks/diag_delta_cuda.py --check-only        # CPU: kernels compiled by g++ with the warp emulation
    python benchmarks/diag_delta_cuda.py --out results/gpu/session21/delta_cuda.json   # GPU: NVRTC through CuPy
"""

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import warnings
from unittest import mock

import torch

if not torch.cuda.is_available():  # the production gather kernel runs under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernels.delta as kernels  # noqa: E402
from benchmarks.delta_wire_ratio import simulated_step  # noqa: E402
from compression.delta import DeltaCodec, DeltaConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "diag_delta_cuda.cu")
BLOCK, WARPS = 256, 8
EMU_WRAPPERS = r"""
extern "C" void emu_encode(long long grid, u16* prev, const u16* newv, i64 numel, u8* codes, i64* changed, int* counts,
                           int* n_esc, u8* exc_widths, i64* nbytes, u32* records, i64 n_blocks) {
  emu_launch(grid, WARPS * 32, [&] { delta_encode(prev, newv, numel, codes, changed, counts, n_esc, exc_widths, nbytes,
                                                  records, n_blocks); });
}
extern "C" void emu_decode(long long grid, u16* out, i64 numel, const u8* payload, i64 codes_at,
                           i64 n_changed_at, i64 groups_at, i64 n_blocks) {
  emu_launch(grid, WARPS * 32, [&] { delta_decode(out, numel, payload, codes_at, n_changed_at, groups_at,
                                                  n_blocks); });
}
"""


class CudaKernels:
    """The two kernels, launched on CUDA tensors through CuPy (NVRTC) or on CPU tensors through the g++ emulation."""

    def __init__(self, device: str, defines: dict = None):
        self.device = device
        flags = [f"-D{k}={v}" for k, v in (defines or {}).items()]
        source = open(SOURCE).read()
        if device == "cuda":
            import cupy

            self.cupy = cupy
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            module = cupy.RawModule(code=source, options=("-std=c++17", "-arch=sm_90", *flags))
            self.encode_fn, self.decode_fn = module.get_function("delta_encode"), module.get_function("delta_decode")
        else:
            build = tempfile.mkdtemp()
            src = os.path.join(build, "emu.cpp")
            with open(src, "w") as f:
                f.write(f'#define DELTA_EMULATE\n#include "{os.path.join(HERE, "diag_delta_cuda_emu.h")}"\n')
                f.write(source + EMU_WRAPPERS)
            lib = os.path.join(build, "emu.so")
            subprocess.run(["g++", "-O2", "-std=c++20", "-shared", "-fPIC", "-pthread", *flags, src, "-o", lib],
                           check=True)
            self.lib = ctypes.CDLL(lib)

    def _launch(self, name: str, grid: int, args: list) -> None:
        if self.device == "cuda":
            cp = self.cupy
            args = [cp.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else cp.int64(a) for a in args]
            with self.stream:
                (self.encode_fn if name == "encode" else self.decode_fn)((grid,), (WARPS * 32,), tuple(args))
        else:
            fn = getattr(self.lib, f"emu_{name}")
            fn(ctypes.c_longlong(grid), *[ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
                                          else ctypes.c_longlong(a) for a in args])

    def encode_blocks(self, prev, new, block_size, out=None, table=None, rank=0):
        """kernels.delta.encode_blocks for a plain shard of whole rows of 8 at B = 256."""
        if block_size != BLOCK or table is not None or prev.numel() % 8:
            raise ValueError("the CUDA diagnostic codes plain shards of 8k values at B = 256")
        e = out if out is not None else kernels.empty_blocks(prev.numel(), block_size, prev.device)
        n_blocks = e.codes.numel()
        self._launch("encode", -(-n_blocks // WARPS), [prev, new, prev.numel(), e.codes, e.changed, e.counts, e.n_esc,
                                                       e.exc_widths, e.nbytes, e.records, n_blocks])
        return e

    def decode_blocks(self, out, payloads, block_size, table=None, src_base=0, skip_rank=-1):
        """kernels.delta.decode_blocks for one payload into a plain shard."""
        if block_size != BLOCK or table is not None or payloads.rows != 1 or out.numel() % 8:
            raise ValueError("the CUDA diagnostic decodes one payload into a plain shard of 8k values at B = 256")
        if payloads.base.data_ptr() % 4:
            raise ValueError("the CUDA diagnostic reads payloads as 32-bit words from a 4-byte aligned start")
        if kernels.group_blocks(block_size) != 64:
            raise ValueError("diag_delta_cuda.cu's GROUP is kernels.delta.group_blocks(256) = 64")
        self._launch("decode", -(-payloads.n_blocks // WARPS), [out, out.numel(), payloads.base, payloads.codes_at,
                                                                payloads.n_changed_at, payloads.groups_at,
                                                                payloads.n_blocks])

    def patched(self):
        """Context: the production codec with these kernels in place of the Triton block kernels."""
        return mock.patch.multiple(kernels, encode_blocks=self.encode_blocks, decode_blocks=self.decode_blocks)


def adversarial_steps(numel: int, generator) -> list:
    """(previous, new) bf16 pairs: every bit pattern, nothing changed, one ulp everywhere, jumps across zero, and
    blocks of every density."""
    g = generator
    patterns = torch.randint(-2**15, 2**15, (numel,), generator=g, dtype=torch.int32).to(torch.int16)
    every = torch.arange(numel, dtype=torch.int32).remainder(65536).sub(32768).to(torch.int16)
    small = patterns.to(torch.int32) + torch.randint(-3, 4, (numel,), generator=g, dtype=torch.int32)
    small = small.clamp(-32768, 32767).to(torch.int16)
    density = torch.rand(numel // BLOCK + 1, generator=g).repeat_interleave(BLOCK)[:numel]
    sparse = torch.where(torch.rand(numel, generator=g) < density ** 3, small, patterns)
    as_bf16 = lambda t: t.view(torch.bfloat16)  # noqa: E731
    return [(as_bf16(patterns), as_bf16(every)), (as_bf16(patterns), as_bf16(patterns.clone())),
            (as_bf16(patterns), as_bf16(small)), (as_bf16(every ^ -32768), as_bf16(every)),
            (as_bf16(patterns), as_bf16(sparse))]


def check(cuda: CudaKernels, pairs: list, device: str) -> int:
    """Payloads of the production codec with the CUDA kernels equal the PyTorch reference's, byte for byte, and
    decode back to the new values bit for bit. Returns the number of pairs checked."""
    for i, (previous, new) in enumerate(pairs):
        previous, new = previous.to(device), new.to(device)
        reference = DeltaCodec(DeltaConfig(BLOCK), 2, 0, triton=False)
        reference.encode(previous)
        expected = reference.encode(new)
        tested = DeltaCodec(DeltaConfig(BLOCK), 2, 0, triton=True)
        with cuda.patched():
            tested.encode(previous)
            payload = tested.encode(new)
        if not torch.equal(payload.cpu(), expected.cpu()):
            diff = (payload.cpu() != expected.cpu()).nonzero()
            raise AssertionError(f"pair {i}: encode payload differs from the reference ({payload.numel()} vs "
                                 f"{expected.numel()} bytes, first differing byte {diff[:1].tolist()})")
        if not torch.equal(tested._prev.cpu(), new.view(torch.int16).cpu()):
            raise AssertionError(f"pair {i}: the sender copy is not the new shard")
        receiver = DeltaCodec(DeltaConfig(BLOCK), 2, 1, triton=True)
        out = previous.clone()
        with cuda.patched():
            receiver.decode(0, with_slack(expected), out)
        if not torch.equal(out.view(torch.int16).cpu(), new.view(torch.int16).cpu()):
            bad = (out.view(torch.int16) != new.view(torch.int16)).nonzero()
            raise AssertionError(f"pair {i}: decode differs at {bad.numel()} values, first {bad[:1].tolist()}")
    return len(pairs)


def with_slack(payload: torch.Tensor) -> torch.Tensor:
    """``payload`` with readable bytes after it, as a gather's receive buffer leaves (the decoders read words)."""
    return torch.cat([payload, payload.new_zeros(16)])[:payload.numel()]


def timed_step(previous, new):
    """(payload, out, encode, decode) of one step for the timing: the production payload of ``new``, the decode's
    output buffer, and the encode and decode as ``(call, setup)`` pairs whose setups restore the sender's state and the
    receiver's previous values."""
    sender = DeltaCodec(DeltaConfig(BLOCK), 2, 0)
    sender.encode(previous)
    state = sender._prev.clone()
    payload = sender.encode(new)
    padded = with_slack(payload)
    receiver = DeltaCodec(DeltaConfig(BLOCK), 2, 1)
    header = receiver.read_header(padded)
    out = torch.empty_like(new)
    return (payload, out, (lambda: sender.encode(new), lambda: sender._prev.copy_(state)),
            (lambda: receiver.decode(0, padded, out, header), lambda: out.copy_(previous)))


def kernel_us(ops_us: dict, kernel: str) -> float:
    return sum(us for op, us in ops_us.items() if kernel in op)


def time_codecs(cuda: CudaKernels, previous, new, repeats: int) -> dict:
    from compression.timing import device_op_seconds

    payload, out, encode, decode = timed_step(previous, new)
    result = {}
    for impl in ("triton", "cuda"):
        calls = dict(encode=encode, decode=decode) if impl == "cuda" else dict(
            copy=(lambda: out.copy_(new), None), encode=encode, decode=decode)
        with cuda.patched() if impl == "cuda" else contextlib.nullcontext():
            for name, (fn, setup) in calls.items():
                ops = device_op_seconds(fn, repeats, setup=setup)
                key = name if name == "copy" else f"{impl}_{name}"
                result[f"{key}_us"] = 1e6 * sum(ops.values())
                result[f"{key}_ops_us"] = {op: 1e6 * s for op, s in ops.items()}
            if impl == "cuda":  # bit-exact at this size too
                decode[1]()
                decode[0]()
                if not torch.equal(out.view(torch.int16), new.view(torch.int16)):
                    raise AssertionError("CUDA decode not bit-exact on the timed step")
    copy = result["copy_us"]
    for key in [k for k in result if k.endswith("_us") and not k.endswith("_ops_us") and not k.startswith("copy")]:
        result[key.replace("_us", "_of_copy")] = copy / result[key]
    for impl in ("triton", "cuda"):
        for name, kernel in (("encode", "_encode_kernel" if impl == "triton" else "delta_encode"),
                             ("decode", "_decode_kernel" if impl == "triton" else "delta_decode")):
            us = kernel_us(result[f"{impl}_{name}_ops_us"], kernel)
            result[f"{impl}_{name}_kernel_us"] = us
            result[f"{impl}_{name}_kernel_of_copy"] = copy / us if us else None
    result["ratio"] = 2 * new.numel() / payload.numel()
    result["unchanged"] = float((new.view(torch.int16) == previous.view(torch.int16)).float().mean())
    return result


VARIANTS = ({"STAGE": 1}, {"STAGE": 2})


def variant_kernels_us(defines: dict, previous, new, repeats: int) -> dict:
    """Device time of the two kernels compiled with ``defines`` (``STAGE`` < 3: only part of their work, outputs not
    valid), inside the production codec's encode and decode of the same step."""
    from compression.timing import device_op_seconds

    k = CudaKernels("cuda", defines)
    _, _, encode, decode = timed_step(previous, new)  # the payload from the production kernels: valid to decode
    with k.patched():
        enc, dec = (device_op_seconds(fn, repeats, setup=setup) for fn, setup in (encode, decode))
    return dict(defines=defines, encode_kernel_us=1e6 * kernel_us(enc, "delta_encode"),
                decode_kernel_us=1e6 * kernel_us(dec, "delta_decode"))


def summary(row: dict) -> str:
    parts = [f"lr {row['lr']:g}: ratio {row['ratio']:.2f}x, copy {row['copy_us']:.1f} us"]
    for name in ("encode", "decode"):
        for impl in ("triton", "cuda"):
            key = f"{impl}_{name}"
            parts.append(f"{name} {impl} {row[key + '_us']:.1f} us ({row[key + '_of_copy']:.1%} of copy; "
                         f"kernel {row[key + '_kernel_us']:.1f} us)")
    return "; ".join(parts) + f"; variants {row['variants']}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=62_500_000)
    p.add_argument("--lrs", default="1e-4,1e-5")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = CudaKernels(device)
    g = torch.Generator().manual_seed(0)
    # on the CPU 71 blocks: a second, partial group of 64 (kernels.delta.group_blocks)
    sizes = (BLOCK * 70 + 8 * 5, 8 * 3) if device == "cpu" else (BLOCK * 1000 + 8 * 7, 8 * 3, BLOCK * 4096)
    pairs = [pair for n in sizes for pair in adversarial_steps(n, g)]
    pairs += [simulated_step(sizes[0], lr, 3) for lr in (1e-4, 1e-5)]
    n = check(cuda, pairs, device)
    print(f"checked {n} pairs byte for byte against the reference ({device})", flush=True)
    if args.check_only or device == "cpu":
        return
    rows = []
    for lr in (float(x) for x in args.lrs.split(",")):
        previous, new = simulated_step(args.numel, lr, args.steps, device="cuda")
        check(cuda, [(previous[:BLOCK * 8192], new[:BLOCK * 8192])], device)
        row = dict(lr=lr, numel=args.numel, **time_codecs(cuda, previous, new, args.repeats))
        row["variants"] = [variant_kernels_us(d, previous, new, args.repeats) for d in VARIANTS]
        rows.append(row)
        print(summary(row), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(0), torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
