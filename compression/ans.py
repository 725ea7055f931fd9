"""Static interleaved rANS coder of byte streams (CIERA's changed exponents), bit-exact, in numpy.

Why interleaved: rANS is sequential per state, so the symbols are dealt round-robin to ``lanes``
independent coders (symbol i goes to lane i % lanes) and every step codes one symbol in all lanes
with vector operations; the number of Python-level steps is n / lanes.

Coder: 32-bit states in [2^16, 2^32), 16-bit renormalisation (at most one word per symbol), 15-bit
frequency table built from the byte histogram (every present byte keeps a frequency >= 1).

Wire format (little endian), produced by ``encode`` and read by ``decode``:
  u32 lanes | u32 n_words | u16 freq[256] | u32 state[lanes] | u16 words[n_words]
The symbol count is not stored: the caller knows it. Words are grouped by decoding step, and within
a step ordered by lane, so the decoder reads one contiguous run per step.
"""

import numpy as np
import torch

SCALE_BITS = 15
STATE_LOW = 1 << 16
MAX_LANES = 4096
MIN_SYMBOLS_PER_LANE = 512


def _lane_count(n: int) -> int:
    return int(min(MAX_LANES, max(1, n // MIN_SYMBOLS_PER_LANE)))


def _frequencies(symbols: np.ndarray) -> np.ndarray:
    """Histogram scaled to sum exactly 2^SCALE_BITS, every present symbol >= 1."""
    counts = np.bincount(symbols, minlength=256).astype(np.int64)
    present = counts > 0
    total = 1 << SCALE_BITS
    freq = np.where(present, counts * (total - int(present.sum())) // len(symbols) + 1, 0)
    freq[np.argmax(counts)] += total - int(freq.sum())
    return freq


def encode(data: torch.Tensor) -> torch.Tensor:
    """Code a 1-D uint8 tensor (non-empty); returns a uint8 tensor on the same device."""
    symbols = data.cpu().numpy()
    n = len(symbols)
    lanes = _lane_count(n)
    freq = _frequencies(symbols)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    state = np.full(lanes, STATE_LOW, dtype=np.uint64)
    steps = []
    for start in reversed(range(0, n, lanes)):
        sym = symbols[start:start + lanes]
        x = state[:len(sym)]
        f = freq[sym].astype(np.uint64)
        spill = x >= ((STATE_LOW >> SCALE_BITS) << 16) * f
        steps.append((x[spill] & 0xFFFF).astype(np.uint16))
        x[spill] >>= 16
        x[:] = (x // f << SCALE_BITS) + x % f + cum[sym].astype(np.uint64)
    words = np.concatenate(steps[::-1]) if steps else np.zeros(0, np.uint16)
    head = np.array([lanes, len(words)], dtype=np.uint32).tobytes() + freq.astype(np.uint16).tobytes()
    blob = head + state.astype(np.uint32).tobytes() + words.tobytes()
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(data.device)


def decode(blob: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``encode`` for ``n`` symbols; returns uint8 on ``blob``'s device."""
    raw = blob.cpu().numpy().tobytes()
    lanes, n_words = np.frombuffer(raw, np.uint32, 2)
    freq = np.frombuffer(raw, np.uint16, 256, 8).astype(np.uint64)
    state = np.frombuffer(raw, np.uint32, lanes, 520).astype(np.uint64)
    words = np.frombuffer(raw, np.uint16, n_words, 520 + 4 * int(lanes)).astype(np.uint64)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
    slot_to_symbol = np.repeat(np.arange(256, dtype=np.uint8), freq.astype(np.int64))
    out = np.empty(n, dtype=np.uint8)
    pos = 0
    for start in range(0, n, int(lanes)):
        x = state[:min(int(lanes), n - start)]
        slot = x & ((1 << SCALE_BITS) - 1)
        sym = slot_to_symbol[slot]
        out[start:start + len(x)] = sym
        x[:] = freq[sym] * (x >> SCALE_BITS) + slot - cum[sym]
        refill = x < STATE_LOW
        k = int(refill.sum())
        x[refill] = (x[refill] << 16) | words[pos:pos + k]
        pos += k
    return torch.from_numpy(out).to(blob.device)
