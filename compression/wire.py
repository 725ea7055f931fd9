"""Checks every wire format runs on what it receives, and the raw-fallback rule of the lossless shard codecs.

Each format's header starts with a magic and a version byte and states (or implies from its fields) the payload's
length; a decoder checks all three before it reads a byte past the header, so a payload cut short, padded or of
another format is a ``WireFormatError`` (a ``ValueError``) naming the format, the source and what differs, never
wrong values. The fixed-size formats with no header (TACO, TahQuant, SDP4Bit's gradient rows) check their length
against the one their shape gives, with the same error.

Raw fallback (delta, CIERA): an encoder whose coded payload would be larger than the raw values sends the raw
values instead, behind its header with ``FLAG_RAW`` set, so a payload never exceeds ``raw + header`` bytes
(``raw_nbytes``). The choice is the encoder's, from the two actual sizes; raw is lossless, and a raw payload needs
no receiver state (it decodes like a keyframe, and the sender's state moves on as after a coded one).
"""


class WireFormatError(ValueError):
    """A payload that does not match its format: wrong magic or version, or a length its header does not give."""


def check_format(fmt: str, source: str, magic: bytes, version: int, want_magic: bytes, want_version: int) -> None:
    if magic != want_magic or version != want_version:
        raise WireFormatError(f"{fmt} payload {source}: magic {magic!r} version {version}, expected {want_magic!r} "
                              f"version {want_version}: not a {fmt} payload of this version (every rank must run the "
                              f"same code and flags)")


def check_length(fmt: str, source: str, got: int, want: int, what: str = "its header gives") -> None:
    if got != want:
        cut = " (cut short in transit?)" if got < want else ""
        raise WireFormatError(f"{fmt} payload {source} has {got} bytes, {what} {want}{cut}")


def raw_nbytes(header_nbytes: int, numel: int, element_size: int = 2) -> int:
    """Size of a raw-fallback payload: the header, then the values' bytes."""
    return header_nbytes + numel * element_size
