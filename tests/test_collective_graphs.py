"""CUDA-graph replay of the compressed TP collectives (compression/collective_graphs.py,
``--tp-comm-cuda-graphs``): the refusals on CPU, and on two GPUs (NCCL) that replayed all-reduces
(one-shot and two-shot), all-gathers and reduce-scatters are bit-identical to the eager calls and
count the same telemetry bytes; on one GPU, a codec's round trip replayed as graphs (several keys, one memory pool)."""

import os

import pytest
import torch

from compression.collective_graphs import CollectiveGraphs, _telemetry_delta, release_all_graphs
from compression.telemetry import COMM_CLASSES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_refusals_and_telemetry_delta():
    with pytest.raises(ValueError, match="--tp-comm-cuda-graphs needs GPUs"):
        CollectiveGraphs().run("all_reduce", lambda t: t, torch.zeros(4))
    with pytest.raises(ValueError, match="warm-up"):
        CollectiveGraphs(warmup=0)
    before = [0] * (2 * len(COMM_CLASSES))
    after = list(before)
    after[0], after[1] = 100, 52  # tp: raw, sent
    assert _telemetry_delta(before, after) == [("tp", 100, 52)]
    assert _telemetry_delta(before, before) == []


def test_flag_needs_taco():
    from megatron.training.arguments import parse_args, validate_args

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--global-batch-size 8 --lr 1e-3 --train-iters 2 --mock-data --transformer-impl local "
            "--tensor-model-parallel-size 2").split()
    with pytest.raises(ValueError, match="--tp-comm-cuda-graphs"):
        validate_args(parse_args(base + ["--tp-comm-cuda-graphs"]), world_size=2, rank=0)
    args = validate_args(parse_args(base + ["--tp-comm-cuda-graphs", "--tp-comm-compression", "taco"]),
                         world_size=2, rank=0)
    assert args.tp_comm_cuda_graphs


def _graphs_match_eager(rank, world, port, queue):
    import torch.distributed as dist

    from compression.taco import TacoCodec, TacoConfig
    from compression.telemetry import TELEMETRY
    from compression.tp_collectives import compressed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        codec = TacoCodec(TacoConfig(256, "int8", "ash", "dual"))
        graphs = CollectiveGraphs(warmup=2)
        problems = []
        for numel in (4096 * 256 + 256, 3 * 1024 * 1024):  # odd rows, and a training-sized message
            for op, algorithm in (("all_reduce", "one-shot"), ("all_reduce", "two-shot"), ("all_gather", "auto"),
                                  ("reduce_scatter", "auto")):
                g = torch.Generator(device="cuda").manual_seed(rank * 7 + numel)
                x = (torch.randn(numel, generator=g, device="cuda") * 0.02).bfloat16()
                fn = lambda t, op=op, algorithm=algorithm: compressed(op, t, codec, all_reduce_algorithm=algorithm)  # noqa: E731
                TELEMETRY.reset()
                eager = fn(x)
                eager_bytes = TELEMETRY.counters()
                for call in range(5):  # 2 eager warm-up calls, the capture, 2 replays
                    TELEMETRY.reset()
                    out = graphs.run((op, algorithm), fn, x)
                    if not torch.equal(out.view(torch.int16), eager.view(torch.int16)):
                        problems.append(f"{op} {algorithm} {numel}: call {call} differs from the eager result")
                    if TELEMETRY.counters() != eager_bytes:
                        problems.append(f"{op} {algorithm} {numel}: call {call} telemetry {TELEMETRY.counters()} "
                                        f"!= {eager_bytes}")
        torch.cuda.synchronize()
        release_all_graphs()  # else destroy_process_group hangs in ncclCommDestroy
        queue.put((rank, problems))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_replayed_codec_equals_eager_and_keeps_the_cache():
    """TACO's encode and decode (the compressed collectives' kernels) replayed for two shapes (two graphs of one
    pool): bit-identical to the eager calls, and the allocator's cache not emptied by the captures."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from compression.taco import TacoCodec, TacoConfig

    codec = TacoCodec(TacoConfig(256, "int8", "ash", "dual"))
    graphs = CollectiveGraphs(warmup=2)
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # freed at once: 64 MiB more in the allocator's cache
    cached = torch.cuda.memory_reserved()
    try:
        for numel in (4096 * 256 + 256, 3 * 1024 * 1024):
            x = (torch.randn(numel, device="cuda", generator=torch.Generator("cuda").manual_seed(numel)) * 0.02)
            x = x.bfloat16()
            fn = lambda t: codec.decode(codec.encode(t), t.numel(), t.dtype)  # noqa: E731
            eager = fn(x)
            for call in range(5):  # 2 eager warm-up calls, the capture, 2 replays
                assert torch.equal(graphs.run("round trip", fn, x).view(torch.int16), eager.view(torch.int16)), call
        assert len(graphs._graphs) == 2 and torch.cuda.memory_reserved() >= cached
    finally:
        graphs.release_graphs()


@pytest.mark.gpu
def test_replayed_collectives_equal_eager_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import torch.multiprocessing as mp

    from dist_utils import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_graphs_match_eager, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():  # teardown hung (graphs not released before destroy_process_group)
            p.kill()
    assert results == {0: [], 1: []}
    assert [p.exitcode for p in procs] == [0, 0]
