"""Tokenizers for the training driver, picked by ``--tokenizer-type``.

Every tokenizer returned by ``build_tokenizer`` has ``vocab_size`` (int), ``eod`` (int, the
end-of-document id appended between documents), ``tokenize(text) -> list[int]``,
``detokenize(ids) -> str`` and ``unique_identifiers`` (megatron-core's dataset cache key uses it).

- ``ByteTokenizer`` (default, built in): ids 0..255 are the UTF-8 bytes, 256 is end-of-document.
- ``NullTokenizer``: megatron-core's null tokenizer (text is space-separated ids), ``--vocab-size``.
- ``HuggingFaceTokenizer``: a ``tokenizer.json`` (file, or a folder holding it) from
  ``--tokenizer-model``, through the ``tokenizers`` package.
- ``GPT2BPETokenizer``: byte-level BPE from ``--vocab-file``/``--merge-file``, through ``tokenizers``.
  (megatron-core 0.16.1's own GPT-2 path passes the vocab file as the merges file, so it is not used.)
"""

import json
import os
from collections import OrderedDict

TOKENIZER_TYPES = ("ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer")

# Names tried, in order, for the end-of-document token of a HuggingFace tokenizer without a config.
_EOD_TOKEN_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus one end-of-document id (256)."""

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls="ByteTokenizer", vocab_size=self.vocab_size)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the interface above (no special tokens added on encode)."""

    def __init__(self, tokenizer, eod: int, source: str):
        self._tokenizer = tokenizer
        self.eod = eod
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._source = source

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls="HFTokenizer", source=self._source, vocab_size=self.vocab_size)


def _import_tokenizers(tokenizer_type: str):
    try:
        import tokenizers
    except ImportError as error:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} needs the `tokenizers` package: "
            "pip install '.[data]' (or pip install tokenizers)"
        ) from error
    return tokenizers


def _find_eod(tokenizer, config_dir: str | None) -> int:
    """The eos token named in ``tokenizer_config.json`` if there is one, else a usual name."""
    names = list(_EOD_TOKEN_NAMES)
    config_path = os.path.join(config_dir, "tokenizer_config.json") if config_dir else None
    if config_path and os.path.isfile(config_path):
        with open(config_path) as f:
            eos = json.load(f).get("eos_token")
        if isinstance(eos, dict):  # AddedToken serialized as a dict
            eos = eos.get("content")
        if eos:
            names.insert(0, eos)
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    raise ValueError(
        f"--tokenizer-model: no end-of-document token found (tried {names}); "
        "use a tokenizer with an eos token"
    )


def _build_huggingface(args) -> HFTokenizer:
    tokenizers = _import_tokenizers("HuggingFaceTokenizer")
    path = args.tokenizer_model
    if path and os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not path or not os.path.isfile(path):
        raise ValueError(
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model pointing to a tokenizer.json "
            f"file or a folder holding one, got {args.tokenizer_model!r}"
        )
    tokenizer = tokenizers.Tokenizer.from_file(path)
    return HFTokenizer(tokenizer, _find_eod(tokenizer, os.path.dirname(path)), source=os.path.abspath(path))


def _build_gpt2_bpe(args) -> HFTokenizer:
    tokenizers = _import_tokenizers("GPT2BPETokenizer")
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if not path or not os.path.isfile(path):
            raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (an existing file), got {path!r}")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(args.vocab_file, args.merge_file))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return HFTokenizer(tokenizer, _find_eod(tokenizer, None), source=os.path.abspath(args.vocab_file))


def _build_null(args):
    from megatron.core.tokenizers import MegatronTokenizer

    from megatron.hooks.version import mcore_at_least

    if not getattr(args, "vocab_size", None):
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size (ids 0..N-1; N is end-of-document)")
    # Ids 0..N-1 are text and N is end-of-document on every release: megatron-core 0.16.1's "null" library (0.17's
    # "null-text") puts eod just past vocab_size; from 0.18 "null-text" makes it the last of vocab_size ids.
    library = "null-text" if mcore_at_least("0.17") else "null"
    vocab_size = args.vocab_size + 1 if mcore_at_least("0.18") else args.vocab_size
    return MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=vocab_size)


def build_tokenizer(args):
    """The tokenizer named by ``args.tokenizer_type`` (see the module docstring)."""
    tokenizer_type = getattr(args, "tokenizer_type", None) or "ByteTokenizer"
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        return _build_null(args)
    if tokenizer_type == "HuggingFaceTokenizer":
        return _build_huggingface(args)
    if tokenizer_type == "GPT2BPETokenizer":
        return _build_gpt2_bpe(args)
    raise ValueError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}, got {tokenizer_type!r}")
