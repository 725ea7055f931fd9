"""Where the host's time per TACO kernel call goes (GPU diagnostic).

Times the host cost of each layer of ``TacoCodec.encode`` / ``decode`` on a small tensor (the device is kept
busy by a sleep kernel, so the host runs ahead as in training; ``compression.timing.queued_seconds``): the codec
call; the kernel launch through Triton's JIT entry (``kernel[grid](...)`` with the arguments prepared); the same
launch through the cached compiled kernel (``CompiledKernel[grid](...)``, no argument binding or
specialization); and the torch allocations and views around it. A ``clone()`` of the input is the reference.

    python benchmarks/diag_launch_cost.py --out launch_cost.json
"""

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compression.taco import TacoCodec, TacoConfig  # noqa: E402
from compression.timing import queued_seconds  # noqa: E402
from kernels import taco as K  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    x = torch.randn(args.numel, device=device, dtype=torch.bfloat16)
    codec = TacoCodec(TacoConfig(256, "int8", "ash", "dual"))
    wire = codec.encode(x)
    c = codec.config
    flat = x.reshape(-1)
    grid, geometry, meta = K._launch(0, flat.numel(), flat.numel(), 1, c.block_size, c.format, c.transform)
    meta.update(GAIN=K._gain(c.block_size, c.transform), SOURCES=0, RESCALE=False, SCALE_MODE=K._DUAL, SKIP=False)
    out = torch.empty_like(wire)
    qmax, inv_sqrt_b = K.QMAX[c.format], K._inv_sqrt_b(c.block_size, c.transform)
    kernel_args = (flat, out, out.view(torch.float32), out, out, out, out.view(torch.float32), 0, -1, *geometry,
                   qmax / math.sqrt(c.block_size), qmax, 1.0 / qmax, inv_sqrt_b, K.EPS)
    compiled = K._taco_encode_kernel[grid](*kernel_args, **meta)
    names = K._taco_encode_kernel.arg_names  # the compiled launcher takes every parameter, constexprs included
    bound = list(kernel_args) + [meta[name] for name in names[len(kernel_args):]]
    launcher = compiled[(grid[0], 1, 1)]

    cases = {
        "clone": lambda: x.clone(),
        "codec.encode": lambda: codec.encode(x),
        "codec.decode": lambda: codec.decode(wire, args.numel, torch.bfloat16),
        "jit launch (encode kernel)": lambda: K._taco_encode_kernel[grid](*kernel_args, **meta),
        "compiled launch (encode kernel)": lambda: launcher(*bound),
        "torch.empty + 2 views": lambda: torch.empty(wire.numel(), dtype=torch.uint8, device=device).view(torch.float32),
    }
    result = dict(numel=args.numel, torch=torch.__version__, triton=K.triton.__version__,
                  device=torch.cuda.get_device_name(), host_us={})
    for name, fn in cases.items():
        result["host_us"][name] = queued_seconds(fn, device, args.calls)[1] * 1e6
        print(f"{name:>34}: {result['host_us'][name]:7.1f} us host per call", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
