"""Little-endian bit packing of small unsigned codes, shared by the low-bit codecs' references (TahQuant, SDP4Bit).

Along the last dimension, code i of ``bits`` bits occupies bits [i * bits, (i + 1) * bits) of the byte
stream, and bit k of the stream is bit k % 8 of byte k // 8. So 4-bit codes put code 2j in the low and
code 2j + 1 in the high nibble of byte j; 1-bit codes are a little-endian bitmap. Codes are packed
eight at a time (eight codes of b bits are b whole bytes), so the last dimension must be a multiple of
eight (any length for 8 bits, which is the identity).
"""

import torch


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., m], each < 2**bits (1 <= bits <= 8), as uint8 [..., m * bits / 8]."""
    if bits == 8:
        return codes
    groups = codes.unflatten(-1, (-1, 8)).to(torch.int64)
    shifts = torch.arange(8, device=codes.device) * bits
    words = (groups << shifts).sum(dim=-1)  # disjoint bit fields: the sum is their OR
    byte_shifts = torch.arange(bits, device=codes.device) * 8
    return ((words[..., None] >> byte_shifts) & 0xFF).to(torch.uint8).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: uint8 codes [..., m] from [..., m * bits / 8]."""
    if bits == 8:
        return packed
    groups = packed.unflatten(-1, (-1, bits)).to(torch.int64)
    words = (groups << (torch.arange(bits, device=packed.device) * 8)).sum(dim=-1)
    shifts = torch.arange(8, device=packed.device) * bits
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).flatten(-2)
