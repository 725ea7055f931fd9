"""Tokenize text into Megatron indexed datasets (``.bin``/``.idx``), like Megatron-LM's preprocess_data.

Input (``--input``): a ``.jsonl`` file (one JSON object per line; each ``--json-keys`` field is one
document), a ``.txt`` file (the whole file is one document, under the first key), or a folder (every
``.jsonl``/``.json``/``.txt`` file below it, in sorted path order).
Output: ``{output_prefix}_{key}_document.{bin,idx}`` for each key, ready for ``--data-path``.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 8
"""

import argparse
import json
import multiprocessing
import os

from megatron.training.data import write_documents
from megatron.training.tokenizer import TOKENIZER_TYPES, build_tokenizer

_JSON_SUFFIXES = (".jsonl", ".json")
_TEXT_SUFFIXES = (".txt",)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="a .jsonl or .txt file, or a folder of them")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to write, one dataset each")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-type", default="ByteTokenizer", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", default=None, help="tokenizer.json (HuggingFaceTokenizer)")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    return args


def input_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ValueError(f"--input {path!r} is neither a file nor a folder")
    found = [
        os.path.join(folder, name)
        for folder, _, names in os.walk(path)
        for name in names
        if name.endswith(_JSON_SUFFIXES + _TEXT_SUFFIXES)
    ]
    return sorted(found)


def texts(files: list[str], key: str, first_key: str):
    """The documents of one key, in input order."""
    for path in files:
        if not path.endswith(_JSON_SUFFIXES):
            if key == first_key:
                with open(path, encoding="utf-8") as f:
                    yield f.read()
            continue
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if key not in record:
                    raise ValueError(f"{path}:{line_number} has no field {key!r} (--json-keys)")
                yield record[key]


_worker_tokenizer = None


def _init_worker(args) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(args)


def _tokenize(text: str) -> list[int]:
    return _worker_tokenizer.tokenize(text)


def main(argv=None) -> None:
    args = parse_args(argv)
    files = input_files(args.input)
    tokenizer = build_tokenizer(args)
    eod = tokenizer.eod if args.append_eod else None
    if os.path.dirname(args.output_prefix):
        os.makedirs(os.path.dirname(args.output_prefix), exist_ok=True)
    pool = multiprocessing.Pool(args.workers, _init_worker, (args,)) if args.workers > 1 else None
    try:
        for key in args.json_keys:
            documents = texts(files, key, args.json_keys[0])
            token_lists = pool.imap(_tokenize, documents, chunksize=32) if pool else map(tokenizer.tokenize, documents)
            prefix = f"{args.output_prefix}_{key}_document"
            count = write_documents(prefix, token_lists, tokenizer.vocab_size, eod=eod)
            print(f"wrote {count} documents to {prefix}.bin/.idx")
    finally:
        if pool:
            pool.close()
            pool.join()


if __name__ == "__main__":
    main()
