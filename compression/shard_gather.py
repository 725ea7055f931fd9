"""All-gather of one bucket's parameter shards through a ShardCodec (variable-size payloads).

The bucket is a 1-D buffer split evenly over the group: rank r owns ``buffer[r*n:(r+1)*n]``. Before a
gather, the own slice holds this rank's NEW values and every other slice holds that rank's PREVIOUS
values (from the last gather); afterwards every slice holds the new values on every rank.

Wire scheme: (1) all_gather of one int64 per rank, the payload sizes; (2) all_gather_into_tensor of
the payloads zero-padded to the largest size. Padding costs the imbalance between ranks but keeps one
NCCL/gloo collective of equal-size chunks (variable-size all-gather is not a single NCCL call; a
send/recv ring would cost W-1 latencies). The size exchange needs the host to see the sizes, so
``start`` synchronises with the device once; ``encode`` already had to, to size its payload.

Telemetry (class ``comm_class``): raw = this rank's shard bytes; sent = its padded payload plus the
8-byte size message, i.e. what it hands to the collectives. A codec may declare extra integer stats
with ``stat_names`` (a tuple) and fill ``last_stats`` (dict name -> int) on every ``encode``; they
are declared at construction and added as counters ``<comm_class>/<name>``.
"""

import torch
import torch.distributed as dist

from compression.codec import ShardCodec
from compression.telemetry import TELEMETRY

SIZE_BYTES = 8


class PendingGather:
    """Handle of an asynchronous gather: ``wait()`` finishes the collective, then decodes."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._finish()


class ShardGather:
    def __init__(self, codec: ShardCodec, group=None, comm_class: str = "dp_param_gather"):
        self.codec = codec
        self.group = group
        self.comm_class = comm_class
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._stat_names = tuple(getattr(codec, "stat_names", ()))
        for name in self._stat_names:
            TELEMETRY.declare_counter(f"{comm_class}/{name}")

    def _own_slice(self, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        n = buffer.numel() // self.world_size
        return buffer[rank * n:(rank + 1) * n]

    def _check(self, buffer: torch.Tensor) -> None:
        if buffer.dim() != 1 or buffer.numel() % self.world_size:
            raise ValueError(f"ShardGather needs a 1-D bucket whose numel is divisible by the group size "
                             f"{self.world_size}, got shape {tuple(buffer.shape)}")

    def _exchange_sizes(self, payload: torch.Tensor) -> list:
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=payload.device)
        dist.all_gather_into_tensor(sizes, size, group=self.group)
        return sizes.tolist()

    def _record(self, shard: torch.Tensor, padded_bytes: int) -> None:
        TELEMETRY.record(self.comm_class, shard.numel() * shard.element_size(), padded_bytes + SIZE_BYTES)
        stats = getattr(self.codec, "last_stats", {})
        for name in self._stat_names:
            TELEMETRY.add_counter(f"{self.comm_class}/{name}", stats.get(name, 0))

    def start(self, buffer: torch.Tensor, async_op: bool = False):
        """Gather ``buffer`` in place; returns a handle with ``wait()`` if ``async_op``, else None."""
        self._check(buffer)
        shard = self._own_slice(buffer, self.rank)
        payload = self.codec.encode(shard)
        sizes = self._exchange_sizes(payload)
        width = -(-max(sizes) // 16) * 16  # 16-byte aligned chunks: the decoders' vector loads stay aligned
        send = torch.empty(width, dtype=torch.uint8, device=buffer.device)
        send[:payload.numel()] = payload
        send[payload.numel():] = 0  # the padding (receivers ignore it) is not left uninitialized
        recv = torch.empty(width * self.world_size, dtype=torch.uint8, device=buffer.device)
        self._record(shard, width)
        work = dist.all_gather_into_tensor(recv, send, group=self.group, async_op=async_op)

        def finish():
            for src in range(self.world_size):
                if src != self.rank or not self.codec.lossless:
                    chunk = recv[src * width:src * width + sizes[src]]
                    self.codec.decode(src, chunk, self._own_slice(buffer, src))

        if async_op:
            return PendingGather(work, finish)
        finish()
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
