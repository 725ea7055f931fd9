"""The parameter gathers' integrity check (docs/integrity.md): the delta encode and decode kernels' hashes of a
shard's change equal the PyTorch reference's (TRITON_INTERPRET=1, in a subprocess) for every pattern class, block size,
cast and gathered decodes; payloads corrupted on purpose (a bit flipped on the wire, a bit of the sender's codec state,
a payload cut short) decode to a hash other than the sender's whenever they decode to other values; through
``ShardGather`` over gloo (size exchange and slots, buckets coded as one) a corrupted gather is detected, re-gathered
uncompressed to the uncompressed gather's bits, counted, logged with its bucket and iteration, and the
``max_mismatches``-th stops with an error naming the flag; megatron-core training with corrupted gathers keeps every
loss and parameter bit of the uncompressed run."""

import logging
import os

import pytest
import torch
import torch.distributed as dist

from compression.codec import CastShard, Segments
from compression.delta import FLAG_KEYFRAME, FLAG_RAW, HEADER, DeltaCodec, DeltaConfig, _Layout
from compression.wire import WireFormatError
from dist_utils import run_on_ranks
from interpreted import run_interpreted
from kernels import delta as kernels
from test_delta import SPECIAL, heavy_tail, nudge, patterns, random_bits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _steps(n: int, g: torch.Generator) -> list:
    """Shards of a run: a start, small and heavy-tailed moves, every pattern class, all values changed, no change."""
    first = nudge(random_bits(n, g) & 0x3FFF, 0.0, 0, g)
    shards = [first, nudge(first, 0.3, 2, g)]
    shards.append(heavy_tail(shards[-1], g))
    special = shards[-1].clone()
    special[:len(SPECIAL)] = patterns(SPECIAL)[:n]
    shards += [special, random_bits(n, g), None]
    shards[-1] = shards[-2].clone()  # unchanged: hash 0
    return shards


def _encode(codec, shard):
    start = codec.begin_encode(shard)
    payload = torch.empty(int(start.nbytes) + codec.read_slack_bytes, dtype=torch.uint8,
                          device=start.header.device)[:int(start.nbytes)]
    codec.finish_encode(start, payload)
    return payload, start.hash


def _check_hashes_match_reference(triton: bool = True) -> None:
    """Sender's hash = the reference hash of the change = every decoder's (Triton and reference), bits exact."""
    g = torch.Generator().manual_seed(3)
    for block_size, n, dtype in ((32, 997, torch.bfloat16), (256, 5000, torch.float16), (512, 3001, torch.bfloat16)):
        _check_shard_hashes(block_size, n, dtype, triton, g)
    _check_cast_hashes(triton)
    for world, segmented in ((3, False), (2, False), (2, True)):
        _check_gathered_hashes(triton, world, segmented)
    _check_hash_sums(triton)


def _check_shard_hashes(block_size: int, n: int, dtype, triton: bool, g: torch.Generator) -> None:
    config = DeltaConfig(block_size)
    encoder = DeltaCodec(config, 2, 0, triton=triton)
    decoders = [DeltaCodec(config, 2, 1, triton=t) for t in (triton, False)]
    outs = [torch.zeros(n, dtype=dtype) for _ in decoders]
    prev = None
    for step, bits in enumerate(_steps(n, g)):
        want = kernels.change_hash_reference(prev, bits, block_size)
        payload, sent = _encode(encoder, bits.clone().view(dtype))
        assert torch.equal(sent, want), (block_size, step, sent, want)
        for decoder, out in zip(decoders, outs):
            decoder.decode(0, payload, out)
            assert torch.equal(out.view(torch.int16), bits), (block_size, step)
            assert torch.equal(decoder.decoded_hashes[0:1], want), (block_size, step, decoder.triton)
        assert step < 5 or int(sent) == 0  # the last step changes nothing
        prev = bits


def _check_cast_hashes(triton: bool) -> None:
    """``CastShard`` encodes (--delta-fused-cast): the hash of the change from the buffer's old values to the rounded
    fp32 source."""
    g = torch.Generator().manual_seed(5)
    n = 2100
    master = torch.randn(n, generator=g) * 0.02
    target = master.to(torch.bfloat16)
    codec = DeltaCodec(DeltaConfig(256), 2, 0, triton=triton, cast=True)
    codec.observe(target)  # every rank holds the buffer's values
    for step in range(3):
        master -= 1e-3 * torch.randn(n, generator=g)
        old = target.view(torch.int16).clone()
        start = codec.begin_encode(CastShard(target, master))
        # (the Triton interpreter rounds by truncation: the buffer's new values are what the encode wrote)
        assert not torch.equal(target.view(torch.int16), old), step
        assert torch.equal(start.hash, kernels.change_hash_reference(old, target.view(torch.int16), 256)), step


def _check_gathered_hashes(triton: bool, world: int = 3, segmented: bool = False, device: str = "cpu") -> None:
    """``decode_gathered`` and ``decode_slots`` of ``world - 1`` sources (a bucket buffer, or ``segmented``: its
    ``Segments``) in one launch: one hash per source, 0 for the own; the integrity check sums the decode's hash slots
    itself (no ``take_hash_sums`` launch)."""
    g = torch.Generator().manual_seed(9)
    n, last = 1200, world - 1
    config = DeltaConfig(64)
    encoders = [DeltaCodec(config, world, r, triton=triton) for r in range(world)]
    decoder = DeltaCodec(config, world, 0, triton=triton)
    bucket = torch.zeros(world * n, dtype=torch.bfloat16, device=device)
    target = Segments((bucket,), world) if segmented else bucket
    shards = [random_bits(n, g) for _ in range(world)]
    # what each sender encodes: its shard, or its slices of its own bucket's Segments (padded to whole blocks)
    own = [torch.zeros(world * n, dtype=torch.bfloat16, device=device) for _ in range(world)] if segmented else None
    inputs = [Segments((b,), world).shard(r) for r, b in enumerate(own)] if segmented else None
    taken, take = [], kernels.take_hash_sums
    kernels.take_hash_sums = lambda *args: taken.append(take(*args))
    try:
        for step in range(3):
            shards = [nudge(s, 0.2, 3, g) for s in shards] if step else shards
            values = [s.clone().view(torch.bfloat16).to(device) for s in shards]
            if segmented:
                for r, v in enumerate(values):
                    own[r][r * n:(r + 1) * n] = v
                values = inputs
            sent = [_encode(e, v) for e, v in zip(encoders, values)]
            stride = -(-max(p.numel() for p, _ in sent) // 16) * 16
            gathered = torch.zeros(world * stride + decoder.read_slack_bytes, dtype=torch.uint8, device=device)
            for r, (p, _) in enumerate(sent):
                gathered[r * stride:r * stride + p.numel()] = p
            sizes = [p.numel() for p, _ in sent]
            headers = [bytes(p[:HEADER.size].tolist()) for p, _ in sent]
            bucket[:n] = shards[0].view(torch.bfloat16).to(device)
            # the hashes sent, as a gather's size messages or slot prefixes (strided) deliver them; the last one wrong
            # at step 1
            prefixes = torch.tensor([[size, int(h)] for size, (_, h) in zip(sizes, sent)], device=device)
            prefixes[last, 1] += step == 1
            if step < 2:
                decoder.decode_gathered(target, gathered[:world * stride], stride, sizes, headers, skip=0)
                checks = [decoder.mismatched_sources(prefixes[:, 1], 0) for _ in range(2)]
                wants = [[src == last and step == 1 for src in range(world)]] * 2
            else:  # slots: the payloads' sizes in a device tensor; source 1's hash wrong, the last source taken as
                # too large for its slot by the second check
                decoder.decode_slots(target, gathered[:world * stride], stride, prefixes[:, 0], max(sizes), skip=0)
                prefixes[1, 1] += 1
                capacities = (max(sizes), sizes[last] - 1)
                checks = [decoder.mismatched_sources(prefixes[:, 1], 0, prefixes[:, 0], c) for c in capacities]
                wants = [[src == 1 and sizes[src] <= c for src in range(world)] for c in capacities]
            assert torch.equal(bucket.view(torch.int16).cpu(), torch.cat(shards)), step
            # the first comparison sums the decode kernel's slots on the way, the second reads the sums
            for (mismatched, count), want in zip(checks, wants):
                assert mismatched.tolist() == want and count.tolist() == [sum(want)], (step, mismatched, count)
            assert decoder.decoded_hashes.tolist() == [0] + [int(h) for _, h in sent[1:]], step
    finally:
        kernels.take_hash_sums = take
    assert not taken, f"{len(taken)} take_hash_sums launches"


def _check_hash_sums(triton: bool) -> None:
    """``check_hash_sums`` against its reference: sums of slots or given, strided inputs, more rows than a pass."""
    g = torch.Generator().manual_seed(4)
    check = kernels.check_hash_sums if triton else kernels.check_hash_sums_reference
    for rows, rank in ((1, 0), (5, 3), (16, 15), (40, 17)):
        slots = torch.randint(-2**62, 2**62, (rows, kernels.HASH_SLOTS), generator=g)
        sums = slots.sum(1)
        prefixes = torch.stack([torch.randint(0, 100, (rows,), generator=g), sums], 1)
        flip = torch.rand(rows, generator=g) < 0.3
        prefixes[:, 1] += flip
        for with_slots, with_sizes in ((True, False), (False, True), (True, True)):
            out, kept = torch.full((rows,), 7), slots.clone()
            if not with_slots:
                out.copy_(sums)
            mismatched, count = check(out, prefixes[:, 1], rank, kept if with_slots else None,
                                      prefixes[:, 0] if with_sizes else None, 50)
            want = flip & (torch.arange(rows) != rank) & ((prefixes[:, 0] <= 50) if with_sizes else True)
            assert torch.equal(out, sums) and torch.equal(mismatched, want) and count.tolist() == [int(want.sum())]
            assert not with_slots or not kept.any(), "the slots are zeroed for the next decode"


def first_record(payload: torch.Tensor):
    """The byte offset of the first changed block's record in a delta payload (None: a keyframe or no change)."""
    _, _, flags, _, block_size, n_changed, numel, _ = HEADER.unpack(bytes(payload[:HEADER.size].tolist()))
    if flags & (FLAG_KEYFRAME | FLAG_RAW) or not n_changed:
        return None
    layout = _Layout.of(numel, block_size)
    codes = payload[HEADER.size:HEADER.size + layout.n_blocks]
    first = int(torch.nonzero(codes)[0])
    group = kernels.group_blocks(block_size)
    entry = layout.groups + 4 * (first // group)
    region = layout.regions + int.from_bytes(bytes(payload[entry:entry + 4].tolist()), "little")
    in_group = int((codes[first - first % group:first - first % group + group] != 0).sum())
    return region + 3 * in_group  # the first changed block of its group: record offset 0


def flip_wire_bit(payload: torch.Tensor) -> bool:
    """Clear the lowest set bit of the first changed block's record (its bitmap or row flags): the decoder reads fewer
    values than were sent, all within the payload. False if the payload has no changed block."""
    at = first_record(payload)
    if at is None:
        return False
    while not int(payload[at]):
        at += 1
    payload[at] &= payload[at] - 1
    return True


def _check_corruptions(triton: bool = True) -> None:
    """A bit flipped on the wire, a bit flipped in the sender's copy of its last shard (the codec state), and payloads
    cut short: wherever the decode ends with values other than the sender's, the decoded hash differs from the sent
    one (and it always does for the flips here); an intact payload decodes to the sent hash."""
    g = torch.Generator().manual_seed(11)
    n, config = 4000, DeltaConfig(256)
    encoder = DeltaCodec(config, 2, 0, triton=triton)
    decoder = DeltaCodec(config, 2, 1, triton=triton)
    out = torch.zeros(n, dtype=torch.bfloat16)
    shard = random_bits(n, g) & 0x3FFF
    decoder.decode(0, _encode(encoder, shard.clone().view(torch.bfloat16))[0], out)  # keyframe
    detected = {"wire": 0, "state": 0, "cut": 0}
    for step in range(4):
        shard = nudge(shard, 0.3, 2, g)
        if step == 2:  # the sender's copy drifts: a value it sends no change for is coded against a wrong previous
            encoder._prev[17] ^= 0x0040
        payload, sent = _encode(encoder, shard.clone().view(torch.bfloat16))
        trials = {"wire": payload.clone(), "cut": payload[:payload.numel() - 5].clone()}
        assert flip_wire_bit(trials["wire"])
        with pytest.raises(WireFormatError, match="bytes"):  # a cut payload fails the header's length check
            decoder.decode(0, trials.pop("cut"), out.clone())
        detected["cut"] += 1
        for kind, corrupted in trials.items():
            received = out.clone()
            decoder.decode(0, corrupted, received)
            wrong = not torch.equal(received.view(torch.int16), shard)
            mismatch = not torch.equal(decoder.decoded_hashes[0:1], sent)
            assert mismatch == wrong or (mismatch and kind == "cut"), (step, kind, wrong, mismatch)
            detected[kind] += mismatch
        decoder.decode(0, payload, out)
        intact = torch.equal(out.view(torch.int16), shard)
        assert intact == (step != 2) and torch.equal(decoder.decoded_hashes[0:1], sent) == intact, step
        if step == 2:
            detected["state"] += 1
            out.view(torch.int16).copy_(shard)  # re-gathered uncompressed, as ShardGather does
    assert detected["wire"] == 4 and detected["cut"] >= 3, detected


@pytest.mark.parametrize("triton", [False], ids=["reference"])
def test_hashes_and_corruptions_reference(triton):
    _check_hashes_match_reference(triton)
    _check_corruptions(triton)


def test_kernels_hash_as_reference_interpreted():
    pytest.importorskip("triton")
    run_interpreted("import test_integrity as t; t._check_hashes_match_reference(True)",
                    "import test_integrity as t; t._check_corruptions(True)", timeout=900)


@pytest.mark.gpu
def test_kernels_hash_as_reference_cuda():
    """The compiled kernels (on a GPU: ``use_triton`` picks them for CUDA tensors) against the reference."""
    _check_hashes_match_reference_cuda()


def _check_hashes_match_reference_cuda() -> None:
    g = torch.Generator().manual_seed(3)
    # B < 256: several threads hold a row, and one of them adds the block's hash (kernels.delta._add_once)
    for block_size, n in ((32, 9_999), (64, 20_001), (256, 300_001), (512, 70_000), (1024, 9_999)):
        _check_shard_hashes_cuda(block_size, n, g)
    for world, segmented in ((3, False), (2, False), (2, True)):
        _check_gathered_hashes(None, world, segmented, "cuda")


def _check_shard_hashes_cuda(block_size: int, n: int, g: torch.Generator) -> None:
    config = DeltaConfig(block_size)
    encoder, decoder = DeltaCodec(config, 2, 0), DeltaCodec(config, 2, 1)
    out = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    prev = None
    for step, bits in enumerate(_steps(n, g)):
        bits = bits.cuda()
        start = encoder.begin_encode(bits.clone().view(torch.bfloat16))
        payload = torch.empty(int(start.nbytes) + 64, dtype=torch.uint8, device="cuda")[:int(start.nbytes)]
        encoder.finish_encode(start, payload)
        want = kernels.change_hash_reference(prev, bits, block_size)
        assert torch.equal(start.hash, want), (block_size, step)
        decoder.decode(0, payload, out)
        assert torch.equal(out.view(torch.int16), bits) and torch.equal(decoder.decoded_hashes[0:1], want)
        prev = bits


# --- through ShardGather (gloo, the reference codecs) ------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _corrupt_decodes(due):
    """Patch DeltaCodec's batched decodes on this rank: at each decode for which ``due()`` says so, flip a wire bit of
    the other rank's payload (a keyframe or a payload without change is left alone, and the next decode is due
    instead). Returns the undo and the list of decodes corrupted (numbered from 0)."""
    original = DeltaCodec.decode_gathered, DeltaCodec.decode_slots
    calls, pending, corrupted = [0], [0], []

    def corrupt(gathered, stride, size):
        src = 1 - dist.get_rank()
        pending[0] += due()
        if pending[0] and flip_wire_bit(gathered[src * stride:src * stride + size]):
            pending[0] -= 1
            corrupted.append(calls[0])
        calls[0] += 1

    def decode_gathered(self, target, gathered, stride, sizes, headers, skip):
        corrupt(gathered, stride, sizes[1 - dist.get_rank()])
        return original[0](self, target, gathered, stride, sizes, headers, skip)

    def decode_slots(self, target, gathered, stride, sizes, capacity, skip):
        corrupt(gathered, stride, int(sizes[1 - dist.get_rank()]))
        return original[1](self, target, gathered, stride, sizes, capacity, skip)

    DeltaCodec.decode_gathered, DeltaCodec.decode_slots = decode_gathered, decode_slots

    def undo():
        DeltaCodec.decode_gathered, DeltaCodec.decode_slots = original

    return undo, corrupted


def _corrupted_gathers(capacity_factor: float):
    """Two buckets of one storage coded as one set, 8 gathers; on rank 0 a wire bit of rank 1's payload flipped at the
    4th and 7th decodes, and at step 5 rank 1's sender copy corrupted: every gather's buckets equal the uncompressed
    gather's, the corrupted ones re-gathered (counted on rank 0; the policy's count alike on both ranks, stopping at
    the 3rd with max_mismatches 3)."""
    from compression.shard_gather import GatherFusions, IntegrityCheck, ShardGather
    from compression.telemetry import TELEMETRY
    from test_shard_gather import _gather_and_check, _one_storage, _step

    rank, world = dist.get_rank(), dist.get_world_size()
    TELEMETRY.reset()
    step_now = [0]
    policy = IntegrityCheck(max_mismatches=3, iteration=lambda: step_now[0])
    records = _Records()
    logging.getLogger("compression.shard_gather").addHandler(records)
    sizes = (1500, 26_144)
    masters, buffers = _one_storage(sizes, world, torch.device("cpu"))
    rng = torch.Generator().manual_seed(100 + rank)
    gathers = [ShardGather(DeltaCodec(DeltaConfig(256), world, rank), None, capacity_factor=capacity_factor,
                           integrity=policy, name=f"bucket {k}") for k in range(len(sizes))]
    fusions = GatherFusions()
    undo, _ = _corrupt_decodes(lambda: rank == 0 and step_now[0] in (4, 7))
    error, mismatches = None, []
    try:
        for step in range(8):
            step_now[0] = step + 1
            expected = _step(masters, buffers, sizes, rank, 1e-4, rng)
            if step == 5 and rank == 1:
                gathers[0].codec._prev[3] ^= 0x0100  # (a view of the set's sender copy)
            try:
                _gather_and_check(gathers, buffers, fusions, expected, step)  # bits as the uncompressed gather's
            except RuntimeError as e:
                error = (step, str(e))
                break
            mismatches.append(policy.mismatches)
    finally:
        undo()
    counted = TELEMETRY.extra_counters()["dp_param_gather/integrity_mismatches"]
    return mismatches, counted, error, records.messages, fusions.sets


def _check_corrupted_gathers(results, slots: bool):
    for rank, (mismatches, counted, error, messages, sets) in enumerate(results):
        assert sets == [2]  # coded as one set
        # the 4th decode is step 3's (step 0: keyframes, one bucket each, fused from step 1); step 5: the state
        assert mismatches == [0, 0, 0, 1, 1, 2], (rank, mismatches)
        assert error is not None and error[0] == 6 and "--param-gather-integrity-max-mismatches 3" in error[1], error
        assert counted == (3 if rank == 0 else 0), (rank, counted)
        if rank == 0:
            assert len(messages) == 3 and all("bucket 0+bucket 1" in m for m in messages), messages
            assert "at iteration 4" in messages[0] and "rank(s) [1]" in messages[0], messages[0]
        else:
            assert messages == [], messages


@pytest.mark.slow
def test_corrupted_gathers_size_exchange():
    _check_corrupted_gathers(run_on_ranks(_corrupted_gathers, 2, 0.0), slots=False)


@pytest.mark.slow
def test_corrupted_gathers_slots():
    _check_corrupted_gathers(run_on_ranks(_corrupted_gathers, 2, 2.0), slots=True)


# --- training (megatron-core, gloo): corrupted gathers, the uncompressed run's bits -------------------------------

def _corrupted_training():
    """tests/test_param_gather_hook.py's training of a small GPT (9 bucket groups) uncompressed, then with delta
    (size exchange; slots; --overlap-param-gather) with a wire bit of two of rank 1's payloads flipped on rank 0 (the
    first delta decodes from the 5th and the 15th on): per-step loss bits and parameter hash as uncompressed."""
    from megatron.core import parallel_state
    from megatron.hooks import cpu

    from compression.telemetry import TELEMETRY
    from test_param_gather_hook import _train

    cpu.apply()
    parallel_state.initialize_model_parallel()
    reference = _train("none", overlap=False, verify_interval=0)
    runs = {}
    for method, overlap in (("delta", False), ("delta-slots", False), ("delta", True)):
        calls = [0]

        def due():
            calls[0] += 1
            return dist.get_rank() == 0 and calls[0] in (5, 15)

        undo, corrupted = _corrupt_decodes(due)
        try:
            result = _train(method, overlap=overlap, verify_interval=0)
        finally:
            undo()
        runs[method, overlap] = (result["loss_bits"] == reference["loss_bits"],
                                 result["param_hash"] == reference["param_hash"], len(corrupted),
                                 TELEMETRY.extra_counters()["dp_param_gather/integrity_mismatches"])
    # every parameter rewritten after step 5 (as a checkpoint load does) without resetting the codecs: the next
    # gather's decodes differ on every rank; re-gathered, training goes on as uncompressed (verify: every 2 gathers)
    rewritten = _train("none", overlap=False, rewrite_at=5, verify_interval=0)
    result = _train("delta", overlap=False, rewrite_at=5, reset=False, verify_interval=2)
    runs["rewrite without reset"] = (result["loss_bits"] == rewritten["loss_bits"],
                                     result["param_hash"] == rewritten["param_hash"], 0,
                                     TELEMETRY.extra_counters()["dp_param_gather/integrity_mismatches"])
    # --param-gather-keyframe-interval 4: every 4th gather of each bucket group uncompressed, the rest delta
    plain_delta = _train("delta", overlap=False, verify_interval=0)
    keyframes = _train("delta", overlap=False, verify_interval=2, param_gather_keyframe_interval=4)
    runs["keyframes"] = (keyframes["loss_bits"] == reference["loss_bits"],
                         keyframes["param_hash"] == reference["param_hash"],
                         keyframes["steps_sent_ratio"] > plain_delta["steps_sent_ratio"],
                         keyframes["num_compressed"] == keyframes["num_groups"])
    return runs


@pytest.mark.slow
def test_corrupted_training_keeps_uncompressed_bits():
    for rank, runs in enumerate(run_on_ranks(_corrupted_training, 2)):
        for run, (same_losses, same_params, corrupted, counted) in runs.items():
            assert same_losses and same_params, (rank, run)
            if run == "rewrite without reset":  # every bucket group's gather, once, on both ranks
                assert counted > 0, (rank, counted)
            elif run == "keyframes":  # more bytes than delta alone, every bucket still compressed
                assert corrupted and counted, (rank, corrupted, counted)
            else:
                assert corrupted == (2 if rank == 0 else 0) and counted == corrupted, (rank, run, corrupted, counted)


# --- flags ---------------------------------------------------------------------------------------------------------

def test_integrity_flags():
    """On by default, off with --no-param-gather-integrity-check; bad values are errors naming the flag."""
    from test_arguments import make

    delta = "--use-distributed-optimizer --param-gather-compression delta"
    args = make(delta)
    assert args.param_gather_integrity_check and args.param_gather_integrity_max_mismatches == 3
    assert args.param_gather_keyframe_interval == 0
    args = make(f"{delta} --no-param-gather-integrity-check --param-gather-keyframe-interval 100 "
                f"--param-gather-integrity-max-mismatches 1")
    assert not args.param_gather_integrity_check and args.param_gather_keyframe_interval == 100
    with pytest.raises(ValueError, match="--param-gather-integrity-max-mismatches must be >= 1, got 0"):
        make(f"{delta} --param-gather-integrity-max-mismatches 0")
    with pytest.raises(ValueError, match="--param-gather-keyframe-interval must be at least 0, got -2"):
        make(f"{delta} --param-gather-keyframe-interval -2")
    with pytest.raises(ValueError, match="--param-gather-keyframe-interval sends .* add --param-gather-compression"):
        make("--param-gather-keyframe-interval 10")


def test_one_wrong_value_always_changes_the_hash():
    """The module's claim on H: a value that ends wrong (a wrong change on the wire, or the right change applied to an
    old value that drifted) changes the hash, at every lane and row, with extreme values and the pairs where
    n' + n + L_j comes closest to a multiple of 2^17."""
    g = torch.Generator().manual_seed(5)
    block = 256
    edges = [0, 1, 2, 32767, 32768, 65534, 65535]
    cases = [(o, n, n2) for o in edges for n in edges for n2 in edges if n2 != n]
    cases += [tuple(int(v) for v in torch.randint(0, 2**16, (3,), generator=g)) for _ in range(300)]

    def h(old, new, at):  # H of one value at position ``at`` of a one-block shard moving from ``old`` to ``new``
        return int(kernels.hash_of_changes(torch.tensor([old]), torch.tensor([new]), torch.tensor([at]), block, block))

    for k, (o, n, wrong) in enumerate(cases):
        at = k % block
        if wrong != n:
            assert h(o, n, at) != h(o, wrong, at), (o, n, wrong, at)  # a wrong change
        drift = wrong - o  # the same change applied to an old value moved by drift
        if n != o and drift and 0 <= n + drift < 2**16:
            assert h(o, n, at) != h(o + drift, n + drift, at), (o, n, drift, at)
