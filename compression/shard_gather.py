"""All-gather of one bucket's parameter shards through ShardCodecs (variable-size payloads).

The bucket is a 1-D buffer split evenly over the group: rank r owns ``buffer[r*n:(r+1)*n]``. Before a
gather, the own slice holds this rank's NEW values and every other slice holds that rank's PREVIOUS
values (from the last gather); afterwards every slice holds the new values on every rank.

Wire scheme: (1) one all_gather of a small message per rank: each chunk's payload size and fixed header
(``codec.header_nbytes``); (2) per chunk, an all_gather_into_tensor of the payloads zero-padded to the
largest size. Padding costs the imbalance between ranks but keeps one NCCL/gloo collective of
equal-size pieces (variable-size all-gather is not a single NCCL call; a send/recv ring would cost W-1
latencies). The host must see the sizes, so ``start`` synchronises with the device once (``encode``
had to as well, to size its payload); the headers ride along so that no decode reads its own header
back from the device, and every decode's kernels are queued while the payload gathers run.

Chunks: with several codecs, the shard is cut into that many contiguous pieces, each with its own codec
(its own state) and its own payload collective, so that decoding chunk k overlaps the transfer of chunk
k + 1 (the codec's output is unchanged, the wire carries one header and one padding per chunk more).

Telemetry (class ``comm_class``): raw = this rank's shard bytes; sent = its padded payloads plus the
size message, i.e. what it hands to the collectives. A codec may declare extra integer stats with
``stat_names`` (a tuple) and fill ``last_stats`` (dict name -> int) on every ``encode``; they are
declared at construction and added (over chunks) as counters ``<comm_class>/<name>``.
"""

import torch
import torch.distributed as dist

from compression.codec import ShardCodec
from compression.telemetry import TELEMETRY

SIZE_BYTES = 8
ALIGN = 16  # payload pieces start 16-byte aligned: the decoders' vector loads stay aligned


class PendingGather:
    """Handle of an asynchronous gather: ``wait()`` finishes each chunk's collective, then decodes it."""

    def __init__(self, steps):
        self._steps = steps  # [(work, decode)] per chunk

    def wait(self) -> None:
        steps, self._steps = self._steps, []
        for work, decode in steps:
            work.wait()
            decode()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ShardGather:
    """``codecs``: one ShardCodec, or one per chunk (all of the same kind, each with its own state)."""

    def __init__(self, codecs, group=None, comm_class: str = "dp_param_gather"):
        self.codecs = list(codecs) if isinstance(codecs, (list, tuple)) else [codecs]
        if not self.codecs or not all(isinstance(c, ShardCodec) for c in self.codecs):
            raise ValueError(f"ShardGather needs one or more ShardCodecs, got {codecs!r}")
        self.lossless = self.codecs[0].lossless
        self.header_nbytes = self.codecs[0].header_nbytes
        self.group = group
        self.comm_class = comm_class
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._stat_names = tuple(getattr(self.codecs[0], "stat_names", ()))
        for name in self._stat_names:
            TELEMETRY.declare_counter(f"{comm_class}/{name}")

    def _own_slice(self, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        n = buffer.numel() // self.world_size
        return buffer[rank * n:(rank + 1) * n]

    def _chunks(self, shard: torch.Tensor) -> tuple:
        return torch.tensor_split(shard, len(self.codecs))  # contiguous, sizes differ by at most one

    def _check(self, buffer: torch.Tensor) -> None:
        if buffer.dim() != 1 or buffer.numel() % self.world_size:
            raise ValueError(f"ShardGather needs a 1-D bucket whose numel is divisible by the group size "
                             f"{self.world_size}, got shape {tuple(buffer.shape)}")

    def reset(self) -> None:
        """The next gather is a keyframe (call on every rank together)."""
        for codec in self.codecs:
            codec.reset()

    def observe(self, buffer: torch.Tensor) -> None:
        """This rank's slice of ``buffer`` went out uncompressed: code the next gather against it."""
        for codec, chunk in zip(self.codecs, self._chunks(self._own_slice(buffer, self.rank))):
            codec.observe(chunk)

    @property
    def _message_nbytes(self) -> int:
        return len(self.codecs) * (SIZE_BYTES + _round_up(self.header_nbytes, SIZE_BYTES))

    def _exchange_sizes(self, payloads: list) -> tuple:
        """sizes[r][k] and headers[r][k]: rank r's chunk-k payload size and header, on the host (one sync)."""
        field = SIZE_BYTES + _round_up(self.header_nbytes, SIZE_BYTES)
        device = payloads[0].device
        message = torch.zeros(self._message_nbytes, dtype=torch.uint8, device=device)
        for k, payload in enumerate(payloads):
            at = k * field
            message[at:at + SIZE_BYTES].view(torch.int64).fill_(payload.numel())
            head = min(self.header_nbytes, payload.numel())
            message[at + SIZE_BYTES:at + SIZE_BYTES + head] = payload[:head]
        table = torch.empty(self.world_size * message.numel(), dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(table, message, group=self.group)
        table = table.view(self.world_size, len(payloads), field).cpu()
        sizes = table[:, :, :SIZE_BYTES].contiguous().view(torch.int64).view(self.world_size, -1).tolist()
        headers = [[table[r, k, SIZE_BYTES:SIZE_BYTES + min(self.header_nbytes, sizes[r][k])].numpy().tobytes()
                    for k in range(len(payloads))] for r in range(self.world_size)]
        return sizes, headers

    def _record(self, shard: torch.Tensor, padded_bytes: int) -> None:
        TELEMETRY.record(self.comm_class, shard.numel() * shard.element_size(), padded_bytes + self._message_nbytes)
        for name in self._stat_names:
            total = sum(getattr(codec, "last_stats", {}).get(name, 0) for codec in self.codecs)
            TELEMETRY.add_counter(f"{self.comm_class}/{name}", total)

    def start(self, buffer: torch.Tensor, async_op: bool = False):
        """Gather ``buffer`` in place; returns a handle with ``wait()`` if ``async_op``, else None."""
        self._check(buffer)
        shard = self._own_slice(buffer, self.rank)
        payloads = [codec.encode(chunk) for codec, chunk in zip(self.codecs, self._chunks(shard))]
        sizes, headers = self._exchange_sizes(payloads)
        widths = [_round_up(max(row[k] for row in sizes), ALIGN) for k in range(len(payloads))]
        send = torch.empty(sum(widths), dtype=torch.uint8, device=buffer.device)
        recv = torch.empty(sum(widths) * self.world_size, dtype=torch.uint8, device=buffer.device)
        self._record(shard, sum(widths))
        out_chunks = [self._chunks(self._own_slice(buffer, src)) for src in range(self.world_size)]
        steps, at = [], 0
        for k, (codec, payload, width) in enumerate(zip(self.codecs, payloads, widths)):
            piece = send[at:at + width]
            piece[:payload.numel()] = payload
            piece[payload.numel():] = 0  # the padding (receivers ignore it) is not left uninitialized
            received = recv[at * self.world_size:(at + width) * self.world_size]
            work = dist.all_gather_into_tensor(received, piece, group=self.group, async_op=True)
            at += width

            def decode(codec=codec, k=k, received=received, width=width):
                for src in range(self.world_size):
                    if src != self.rank or not self.lossless:
                        chunk = received[src * width:src * width + sizes[src][k]]
                        codec.decode(src, chunk, out_chunks[src][k], headers[src][k])

            steps.append((work, decode))
        handle = PendingGather(steps)
        if async_op:
            return handle
        # NCCL: wait() only orders the stream, so every decode is queued behind its own chunk's transfer.
        handle.wait()
        return None

    def verify(self, buffer: torch.Tensor) -> None:
        """Uncompressed all-gather of every rank's own slice, compared bit for bit with ``buffer``;
        raises RuntimeError naming the first differing rank and index."""
        self._check(buffer)
        shard = self._own_slice(buffer, self.rank).contiguous()
        reference = torch.empty_like(buffer)
        dist.all_gather_into_tensor(reference, shard, group=self.group)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[buffer.element_size()]
        got, want = buffer.view(bits), reference.view(bits)
        bad = (got != want).nonzero()
        if bad.numel():
            index = int(bad[0])
            n = buffer.numel() // self.world_size
            raise RuntimeError(f"{self.comm_class} verify: bucket differs from an uncompressed gather at "
                               f"rank {index // n} slice index {index % n} (bucket index {index}): "
                               f"bits {int(got[index]):#x}, expected {int(want[index]):#x}")
