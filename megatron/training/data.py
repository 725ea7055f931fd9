"""Training data: indexed-dataset writing, the built-in corpus, GPT datasets and per-rank iterators.

Iterators yield dicts of CPU tensors of shape [micro_batch_size, seq_length]: ``tokens``, ``labels``
(int64), ``loss_mask`` (float32) and ``position_ids`` (int64); the causal mask is left to the model.

Order (Megatron's MegatronPretrainingSampler): sample indices are consumed in steps of
``micro_batch_size * dp`` from ``consumed_samples`` on; in each step data-parallel rank r takes the
contiguous slice ``[r * mbs, (r + 1) * mbs)``. So a run resumed at ``consumed_train_samples = N``
(N a multiple of mbs * dp) serves exactly the batches an uninterrupted run serves after N samples.
Every TP/PP rank of one DP rank builds the same datasets and so gets identical batches. Multi-node
runs need ``--data-cache-path`` on a shared filesystem (rank 0 writes the caches, as in Megatron-LM).

Built-in corpus (``--builtin-corpus python-stdlib``): the ``.py`` sources of the running Python's
standard library (no download), sorted by relative path, the first ``--builtin-corpus-max-bytes``
of them (default 4 MiB; the whole of it, ~12 MiB, with a larger value). Each top-level block of a
file (PEP 8 puts two blank lines between them) is one document, which gives enough documents (~1300
at 4 MiB) for every split of the default ``--split 969,30,1``. It is tokenized with the run's
tokenizer, written once to ``--data-cache-path`` (keyed by Python version, size and tokenizer) and
reused.

``--builtin-corpus python-site-packages``: the ``.py`` sources of the standard library and of every
installed site-/dist-packages folder on ``sys.path`` (~150 MB with this project's dependencies: enough for
a few hundred million byte tokens without many repeats, on every machine, offline). Files are ordered by
path relative to their root, deduplicated by content (SHA-256: vendored copies appear once) and cut at
``--builtin-corpus-max-bytes``; each file goes whole to one split by its content hash (1% validation, 1%
test), so validation and test text is held out by file. The three splits are written as three indexed
datasets (``--split`` does not apply), cached under a key that includes the hash of the file list and contents
(the corpus follows what is installed), and the size and hash are logged on every use.
"""

import hashlib
import itertools
import json
import logging
import os
import sys
import sysconfig

import numpy
import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron.core.datasets.utils import get_blend_from_list

BUILTIN_CORPORA = ("python-stdlib", "python-site-packages")
HELD_OUT_PER_MILLE = 10  # python-site-packages: of the files, per mille for validation, and as many for test
logger = logging.getLogger(__name__)
DEFAULT_DATA_CACHE_PATH = "~/.cache/megatron-compressed-comm"
# Folders of the stdlib tree that are not the stdlib's own code (or are mostly test fixtures).
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


# ---------------------------------------------------------------- indexed-dataset writing


def write_documents(output_prefix: str, documents, vocab_size: int, eod: int | None = None) -> int:
    """Write token-id documents as a Megatron indexed dataset ``output_prefix.{bin,idx}``.

    Empty documents are skipped (a zero-length document makes GPTDataset loop forever); ``eod`` is
    appended to each kept document when given. Files appear atomically: both are written under
    temporary names, then renamed, ``.idx`` last. Returns the number of documents written.
    """
    tmp_prefix = f"{output_prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=DType.optimal_dtype(vocab_size))
    count = 0
    for tokens in documents:
        if len(tokens) == 0:
            continue
        if eod is not None:
            tokens = list(tokens) + [eod]
        builder.add_document(numpy.asarray(tokens), [len(tokens)])
        count += 1
    builder.finalize(get_idx_path(tmp_prefix))
    os.replace(get_bin_path(tmp_prefix), get_bin_path(output_prefix))
    os.replace(get_idx_path(tmp_prefix), get_idx_path(output_prefix))
    return count


# ---------------------------------------------------------------- built-in corpus


def stdlib_source_files(max_bytes: int) -> list[str]:
    """Paths of the stdlib's ``.py`` files in sorted relative-path order, up to ``max_bytes`` in total."""
    root = sysconfig.get_paths()["stdlib"]
    relative_paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS]
        relative_paths += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    chosen, total = [], 0
    for relative_path in sorted(relative_paths, key=lambda p: p.replace(os.sep, "/")):
        path = os.path.join(root, relative_path)
        size = os.path.getsize(path)
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def _tokenizer_key(tokenizer) -> str:
    description = json.dumps(tokenizer.unique_identifiers, sort_keys=True, default=str)
    return hashlib.md5(description.encode(), usedforsecurity=False).hexdigest()[:12]


def builtin_corpus_prefix(args, tokenizer) -> str:
    version = ".".join(map(str, sys.version_info[:3]))
    name = f"{args.builtin_corpus}-py{version}-{args.builtin_corpus_max_bytes}b-tok{_tokenizer_key(tokenizer)}"
    return os.path.join(data_cache_path(args), "corpora", name)


def stdlib_documents(paths: list[str]):
    """The text of each top-level block of each file, in order."""
    for path in paths:
        with open(path, "rb") as f:
            yield from f.read().decode("utf-8", errors="replace").split("\n\n\n")


def python_source_roots() -> list[str]:
    """The stdlib, then each site-/dist-packages folder on ``sys.path`` (real paths, each once, sorted)."""
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    packages = {os.path.realpath(p) for p in sys.path if p.rstrip(os.sep).endswith(("site-packages", "dist-packages"))}
    return [stdlib] + sorted(p for p in packages if os.path.isdir(p) and p != stdlib)


def site_packages_source_files(max_bytes: int) -> list[tuple[str, str, str]]:
    """(relative path, path, content SHA-256) of the ``.py`` files of ``python_source_roots()``, in relative-path
    order (root order on ties), each content once, up to ``max_bytes`` in total."""
    roots = python_source_roots()
    found = []
    for index, root in enumerate(roots):
        skipped = _SKIPPED_DIRS if index == 0 else {"__pycache__"}  # the stdlib's own code; packages whole
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = [d for d in subfolders if d not in skipped]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    found.append((os.path.relpath(path, root).replace(os.sep, "/"), index, path))
    chosen, seen, total = [], set(), 0
    for relative_path, _, path in sorted(found):
        with open(path, "rb") as f:
            content = f.read()
        digest = hashlib.sha256(content).hexdigest()
        if digest in seen or not content:
            continue
        if total + len(content) > max_bytes:
            break
        seen.add(digest)
        chosen.append((relative_path, path, digest))
        total += len(content)
    return chosen


def held_out_splits(files: list[tuple[str, str, str]]) -> dict:
    """{"train" | "valid" | "test": the paths of ``files`` (``site_packages_source_files``' tuples) in it}. A file's
    slot, its content hash mod 1000, puts it in validation below HELD_OUT_PER_MILLE, in test below twice that,
    else in train: the split of a file does not depend on the others, on their order or on the max bytes
    (a corpus too small to have a file in a held-out split lends it the train file of the lowest slot)."""
    ranked = sorted(files, key=lambda f: (int(f[2][:8], 16) % 1000, f[2]))
    slots = [int(sha[:8], 16) % 1000 for _, _, sha in ranked]
    n_valid = max(1, sum(slot < HELD_OUT_PER_MILLE for slot in slots))
    n_test = max(1, sum(HELD_OUT_PER_MILLE <= slot < 2 * HELD_OUT_PER_MILLE for slot in slots))
    split_of = {f[2]: ("valid" if i < n_valid else "test" if i < n_valid + n_test else "train")
                for i, f in enumerate(ranked)}
    return {name: [path for _, path, sha in files if split_of[sha] == name] for name in ("train", "valid", "test")}


def ensure_site_packages_corpus(args, tokenizer) -> dict:
    """Build the python-site-packages corpus on rank 0 if it is not cached (others wait); its manifest (files,
    bytes, SHA-256, and per split the prefix, files, bytes and documents), logged by rank 0."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    manifest = [None]
    if rank == 0:
        files = site_packages_source_files(args.builtin_corpus_max_bytes)
        corpus_hash = hashlib.sha256("".join(f"{rel}\0{sha}\n" for rel, _, sha in files).encode()).hexdigest()
        name = (f"{args.builtin_corpus}-{args.builtin_corpus_max_bytes}b-{corpus_hash[:16]}"
                f"-tok{_tokenizer_key(tokenizer)}")
        base = os.path.join(data_cache_path(args), "corpora", name)
        manifest_path = base + ".json"
        if not os.path.isfile(manifest_path):
            os.makedirs(os.path.dirname(base), exist_ok=True)
            splits = {}
            for split, paths in held_out_splits(files).items():
                documents = (tokenizer.tokenize(text) for text in stdlib_documents(paths))
                count = write_documents(f"{base}_{split}", documents, tokenizer.vocab_size, eod=tokenizer.eod)
                splits[split] = dict(prefix=f"{base}_{split}", files=len(paths), documents=count,
                                     bytes=sum(os.path.getsize(path) for path in paths))
            summary = dict(corpus=args.builtin_corpus, files=len(files), bytes=sum(s["bytes"] for s in splits.values()),
                           sha256=corpus_hash, roots=python_source_roots(), splits=splits)
            with open(manifest_path + f".tmp{os.getpid()}", "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(manifest_path + f".tmp{os.getpid()}", manifest_path)
        with open(manifest_path) as f:
            manifest[0] = json.load(f)
        logger.info("--builtin-corpus %s: %d files, %d bytes, sha256 %s; train/valid/test files %s", args.builtin_corpus,
                    manifest[0]["files"], manifest[0]["bytes"], manifest[0]["sha256"],
                    [manifest[0]["splits"][s]["files"] for s in ("train", "valid", "test")])
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(manifest, src=0)
    for split in manifest[0]["splits"].values():
        if not os.path.isfile(get_idx_path(split["prefix"])):
            raise ValueError(f"built-in corpus {split['prefix']}.idx not found: --data-cache-path must be shared by "
                             f"all nodes")
    return manifest[0]


def ensure_builtin_corpus(args, tokenizer) -> str:
    """Build the built-in corpus on rank 0 if it is not cached yet (others wait); return its prefix."""
    if args.builtin_corpus not in BUILTIN_CORPORA:
        raise ValueError(f"--builtin-corpus must be one of {BUILTIN_CORPORA}, got {args.builtin_corpus!r}")
    prefix = builtin_corpus_prefix(args, tokenizer)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0 and not os.path.isfile(get_idx_path(prefix)):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        paths = stdlib_source_files(args.builtin_corpus_max_bytes)
        documents = (tokenizer.tokenize(text) for text in stdlib_documents(paths))
        write_documents(prefix, documents, tokenizer.vocab_size, eod=tokenizer.eod)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if not os.path.isfile(get_idx_path(prefix)):
        raise ValueError(f"built-in corpus {prefix}.idx not found: --data-cache-path must be shared by all nodes")
    return prefix


# ---------------------------------------------------------------- datasets


def data_cache_path(args) -> str:
    return os.path.expanduser(getattr(args, "data_cache_path", None) or DEFAULT_DATA_CACHE_PATH)


def split_sizes(args) -> list[int]:
    """Samples per split: train for every iteration, valid for every evaluation, test for one."""
    train_iters = args.train_iters if args.train_iters is not None else args.train_samples // args.global_batch_size
    train = getattr(args, "train_samples", None) or train_iters * args.global_batch_size
    evaluations = train_iters // args.eval_interval + 1 if args.eval_interval else 0
    valid = evaluations * args.eval_iters * args.eval_global_batch_size
    test = args.eval_iters * args.eval_global_batch_size
    return [train, valid, test]


def _dataset_config(args, tokenizer, blend, blend_per_split=None) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if blend_per_split else args.split,
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=data_cache_path(args),
        tokenizer=tokenizer,
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        create_attention_mask=False,
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
    )


def open_indexed_dataset(prefix: str, flag: str) -> IndexedDataset:
    """``prefix``'s indexed dataset, its files checked: both exist, the ``.idx`` reads, and the ``.bin`` holds the
    bytes the ``.idx`` records (its last document's offset plus length). A truncated ``.bin`` otherwise fails only when
    training reaches its last document, with an error that names no file."""
    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {prefix}: {path} does not exist: fix the path (a prefix, without .bin/.idx)")
    try:
        dataset = IndexedDataset(prefix)
    except (ValueError, OSError, AssertionError) as error:
        raise ValueError(f"{flag} {prefix}: {idx_path} does not read as a Megatron index ({error}): rebuild it "
                         f"(it is truncated or not an indexed dataset's)") from error
    index = dataset.index
    expected = (int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
                if len(index.sequence_lengths) else 0)
    found = os.path.getsize(bin_path)
    if found != expected:
        raise ValueError(f"{flag} {prefix}: {bin_path} holds {found} bytes, its index {idx_path} records {expected}: "
                         f"the .bin is {'truncated' if found < expected else 'longer than its index'} or does not "
                         f"belong to this .idx; rebuild or restore it")
    return dataset


def check_splits_have_documents(config: GPTDatasetConfig, sizes: list[int]) -> None:
    """Each dataset's files are whole (``open_indexed_dataset``), and no split is without documents (megatron-core
    loops forever on one): fail first, naming the path and the fix."""
    if config.blend_per_split:
        for name, size, blend in zip(("train", "valid", "test"), sizes, config.blend_per_split):
            for prefix in (blend[0] if blend and size > 0 else ()):
                if len(open_indexed_dataset(prefix, f"--{name}-data-path").sequence_lengths) == 0:
                    raise ValueError(f"--{name}-data-path {prefix} has no documents: give it a dataset with documents")
        return
    for prefix in config.blend[0]:
        num_documents = len(open_indexed_dataset(prefix, "--data-path").sequence_lengths)
        for name, size, bounds in zip(("train", "valid", "test"), sizes, config.split_matrix):
            if bounds is None or size == 0:  # a split weighted 0 is not built
                continue
            if round(bounds[1] * num_documents) <= round(bounds[0] * num_documents):
                raise ValueError(
                    f"--split {config.split}: the {name} split of {prefix} ({num_documents} documents) gets no "
                    f"document; give it a larger share in --split or use more documents"
                )


def _read_words(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


def blends(args) -> tuple:
    """(blend, blend_per_split) as Megatron-LM reads them: --data-path or the file --data-args-path names, divided
    by --split; or each split's own --train/valid/test-data-path, or the JSON file --per-split-data-args-path names
    (each split a list of words or one string). A split without data gets None (it is not built)."""
    import json

    data_path = _read_words(args.data_args_path) if getattr(args, "data_args_path", None) else args.data_path
    if data_path:
        return get_blend_from_list(data_path), None
    if getattr(args, "per_split_data_args_path", None):
        with open(args.per_split_data_args_path) as f:
            per_split = json.load(f)
        paths = [per_split.get(name) for name in ("train", "valid", "test")]
        paths = [path.split() if isinstance(path, str) else path for path in paths]
    else:
        paths = [getattr(args, f"{name}_data_path", None) for name in ("train", "valid", "test")]
    return None, [get_blend_from_list(path) for path in paths]


def build_datasets(args, tokenizer) -> list:
    """[train, valid, test] GPT datasets (None for an empty split). Sets ``args.data_path`` for the
    built-in corpus. Call on every rank."""
    blend = blend_per_split = None
    if getattr(args, "mock_data", False):
        dataset_class = MockGPTDataset
    else:
        if getattr(args, "builtin_corpus", None) == "python-site-packages":
            splits = ensure_site_packages_corpus(args, tokenizer)["splits"]
            args.data_path = None
            for name in ("train", "valid", "test"):
                setattr(args, f"{name}_data_path", [splits[name]["prefix"]])
        elif getattr(args, "builtin_corpus", None):
            args.data_path = [ensure_builtin_corpus(args, tokenizer)]
        blend, blend_per_split = blends(args)
        if blend is None and blend_per_split[0] is None:
            raise ValueError("no training data: give --data-path PREFIX (or each split's, with --train-data-path "
                             "PREFIX), --builtin-corpus python-stdlib or --mock-data")
        dataset_class = GPTDataset
    sizes = split_sizes(args)
    config = _dataset_config(args, tokenizer, blend, blend_per_split)
    if dataset_class is GPTDataset:
        check_splits_have_documents(config, sizes)
    datasets = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()
    return [dataset if size > 0 else None for dataset, size in zip(datasets, sizes)]


# ---------------------------------------------------------------- sampling and iterators


class PretrainingSampler:
    """Index batches of one DP rank, in Megatron's order (module docstring), from ``consumed_samples``."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed samples {consumed_samples} outside the dataset's {total_samples} samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.step = micro_batch_size * dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.step

    def __iter__(self):
        for first in range(self.consumed_samples, self.total_samples - self.step + 1, self.step):
            start = first + self.dp_rank * self.micro_batch_size
            yield list(range(start, start + self.micro_batch_size))


def build_data_loader(dataset, consumed_samples: int, args) -> torch.utils.data.DataLoader:
    sampler = PretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=args.micro_batch_size,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )
    num_workers = getattr(args, "num_workers", 0)
    # A loader without its own generator draws a seed from the global torch RNG at every iter(), which
    # on CPU also drives dropout: a resumed run would then see different dropout masks.
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers, persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(args.seed),
    )


def cycling_iterator(dataset, consumed_samples: int, args):
    """Batches from ``consumed_samples`` on, then from the start again, forever (evaluation splits)."""
    full_pass = build_data_loader(dataset, 0, args)
    if len(full_pass) == 0:
        raise ValueError(
            f"an evaluation split has {len(dataset)} samples, fewer than one step of --micro-batch-size x "
            f"data-parallel size = {full_pass.batch_sampler.step}: give it a larger share in --split"
        )
    samples_per_pass = len(full_pass) * full_pass.batch_sampler.step
    first_pass = build_data_loader(dataset, consumed_samples % samples_per_pass, args)
    return itertools.chain(first_pass, itertools.chain.from_iterable(itertools.repeat(full_pass)))


def build_train_valid_test_data_iterators(args, tokenizer):
    """(train_iter, valid_iter, test_iter) for this rank; an iterator is None when its split is empty.
    Train starts at ``args.consumed_train_samples`` and valid at ``args.consumed_valid_samples``
    (exact resume); test starts at 0. Valid and test cycle."""
    train, valid, test = build_datasets(args, tokenizer)
    train_consumed = getattr(args, "consumed_train_samples", 0) or 0
    valid_consumed = getattr(args, "consumed_valid_samples", 0) or 0
    train_iter = iter(build_data_loader(train, train_consumed, args)) if train is not None else None
    valid_iter = cycling_iterator(valid, valid_consumed, args) if valid is not None else None
    test_iter = cycling_iterator(test, 0, args) if test is not None else None
    return train_iter, valid_iter, test_iter
