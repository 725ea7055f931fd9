"""Tokenizers, indexed-dataset writing, the built-in corpus and the per-rank data iterators."""

import argparse
import json
import os

import pytest
import torch
from dist_utils import run_on_ranks

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.training import data
from megatron.training.tokenizer import ByteTokenizer, build_tokenizer

UNICODE_TEXT = "def f(x):\n    return 'héllo ∑ 😀'\n\n\nclass A:\n    pass\n"


def make_args(cache_dir, **overrides) -> argparse.Namespace:
    args = dict(
        tokenizer_type="ByteTokenizer", tokenizer_model=None, vocab_file=None, merge_file=None, vocab_size=None,
        micro_batch_size=2, global_batch_size=8, eval_global_batch_size=8, seq_length=32, train_iters=6, train_samples=None,
        eval_interval=3, eval_iters=1, data_path=None, split="969,30,1", mock_data=False,
        builtin_corpus="python-stdlib", builtin_corpus_max_bytes=4 << 20, data_cache_path=str(cache_dir),
        num_workers=0, seed=1234,
        consumed_train_samples=0, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def read_documents(prefix) -> list[list[int]]:
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_byte_tokenizer_round_trip():
    tokenizer = build_tokenizer(make_args(None))
    assert isinstance(tokenizer, ByteTokenizer) and (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    ids = tokenizer.tokenize(UNICODE_TEXT)
    assert ids == list(UNICODE_TEXT.encode("utf-8"))
    assert tokenizer.detokenize(ids + [tokenizer.eod]) == UNICODE_TEXT  # eod is not text


def test_null_tokenizer_and_bad_flags():
    null = build_tokenizer(make_args(None, tokenizer_type="NullTokenizer", vocab_size=100))
    assert (null.vocab_size, null.eod, null.tokenize("3 1 4")) == (101, 100, [3, 1, 4])
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(make_args(None, tokenizer_type="NullTokenizer"))
    with pytest.raises(ValueError, match="--tokenizer-type must be one of"):
        build_tokenizer(make_args(None, tokenizer_type="SentencePiece"))


def test_gpt2_bpe_tokenizer(tmp_path):
    try:
        import tokenizers
    except ImportError:
        with pytest.raises(ValueError, match=r"pip install '\.\[data\]'"):
            build_tokenizer(make_args(None, tokenizer_type="GPT2BPETokenizer"))
        return
    # A GPT-2-format vocabulary of the 256 byte-level symbols plus one merge and <|endoftext|>.
    symbols = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab["he"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n")
    args = make_args(None, tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                     merge_file=str(tmp_path / "merges.txt"))
    tokenizer = build_tokenizer(args)
    assert (tokenizer.vocab_size, tokenizer.eod) == (258, 257)
    ids = tokenizer.tokenize("hello wörld")
    assert ids[0] == vocab["he"] and tokenizer.detokenize(ids) == "hello wörld"
    # The same model saved as a HuggingFace tokenizer.json; tokenizer_config.json names the eos token.
    saved = tmp_path / "hf"
    saved.mkdir()
    model = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(args.vocab_file, args.merge_file))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    model.save(str(saved / "tokenizer.json"))
    (saved / "tokenizer_config.json").write_text(json.dumps({"eos_token": "he"}))
    hf = build_tokenizer(make_args(None, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(saved)))
    assert (hf.vocab_size, hf.eod) == (258, vocab["he"]) and hf.tokenize("hello wörld") == ids


def test_sampler_dp_slices_and_resume():
    mbs, dp, total = 2, 3, 40
    runs = [list(data.PretrainingSampler(total, 0, mbs, rank, dp)) for rank in range(dp)]
    for step, slices in enumerate(zip(*runs)):  # one step: the ranks' slices tile mbs * dp samples
        assert sum(slices, []) == list(range(step * mbs * dp, (step + 1) * mbs * dp))
    for rank in range(dp):
        assert list(data.PretrainingSampler(total, 12, mbs, rank, dp)) == runs[rank][2:]
    with pytest.raises(ValueError, match="consumed samples"):
        data.PretrainingSampler(total, 41, mbs, 0, dp)


def test_preprocess_data_round_trip(tmp_path):
    from scripts.preprocess_data import main as preprocess

    records = [{"text": "first doc", "title": "a"}, {"text": "", "title": "b"}, {"text": UNICODE_TEXT, "title": ""}]
    source = tmp_path / "in"
    source.mkdir()
    (source / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (source / "b.txt").write_text("plain text file")
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"out{workers}" / "corpus"
        preprocess(["--input", str(source), "--output-prefix", str(prefix), "--json-keys", "text", "title",
                    "--append-eod", "--workers", str(workers)])
        outputs[workers] = {key: read_documents(f"{prefix}_{key}_document") for key in ("text", "title")}
    tokenizer = ByteTokenizer()
    expected_text = [tokenizer.tokenize(t) + [256] for t in ("first doc", UNICODE_TEXT, "plain text file")]
    assert outputs[1]["text"] == expected_text  # the empty document is skipped
    assert outputs[1]["title"] == [tokenizer.tokenize(t) + [256] for t in ("a", "b")]
    assert outputs[2] == outputs[1]
    # 3 documents cannot fill the default split: a clear error instead of megatron-core looping forever
    args = make_args(tmp_path, builtin_corpus=None, data_path=[str(tmp_path / "out1" / "corpus_text_document")])
    config = data._dataset_config(args, tokenizer, get_blend_from_list(args.data_path))
    with pytest.raises(ValueError, match="--split 969,30,1: the valid split"):
        data.check_splits_have_documents(config, data.split_sizes(args))


def test_builtin_corpus_is_deterministic_and_cached(tmp_path):
    tokenizer = ByteTokenizer()
    prefixes = [data.ensure_builtin_corpus(make_args(tmp_path / name), tokenizer) for name in ("a", "b")]
    for suffix in (".bin", ".idx"):
        first, second = (open(p + suffix, "rb").read() for p in prefixes)
        assert first == second and len(first) > 0
    modified = os.stat(prefixes[0] + ".bin").st_mtime_ns
    assert data.ensure_builtin_corpus(make_args(tmp_path / "a"), tokenizer) == prefixes[0]
    assert os.stat(prefixes[0] + ".bin").st_mtime_ns == modified  # reused, not rebuilt
    documents = read_documents(prefixes[0])
    paths = data.stdlib_source_files(4 << 20)
    assert paths[0].endswith("__future__.py") and sum(map(os.path.getsize, paths)) <= 4 << 20
    first_block = next(data.stdlib_documents(paths))
    assert documents[0] == tokenizer.tokenize(first_block) + [tokenizer.eod]
    assert len(documents) > 1000 and min(map(len, documents)) >= 2


def test_builtin_corpus_max_bytes_takes_the_first_files(tmp_path):
    """--builtin-corpus-max-bytes: a smaller corpus is the first files of the default one, cached apart."""
    tokenizer = ByteTokenizer()
    small, default = (data.ensure_builtin_corpus(make_args(tmp_path, builtin_corpus_max_bytes=size), tokenizer)
                      for size in (64 << 10, 4 << 20))
    assert small != default and "65536b" in small
    small_paths = data.stdlib_source_files(64 << 10)
    assert small_paths == data.stdlib_source_files(4 << 20)[:len(small_paths)]
    small_documents, default_documents = read_documents(small), read_documents(default)
    assert 0 < len(small_documents) < len(default_documents)
    assert small_documents == default_documents[:len(small_documents)]

def test_site_packages_corpus_is_deduplicated_held_out_by_file_and_cached(tmp_path, caplog):
    """--builtin-corpus python-site-packages on a small max-bytes: stdlib and installed packages' files, each
    content once, every file whole in one split, the same bits on a rebuild, reused from the cache, size and
    hash logged; then the driver's datasets read the three splits."""
    tokenizer, max_bytes = ByteTokenizer(), 3 << 20
    files = data.site_packages_source_files(max_bytes)
    roots = data.python_source_roots()
    assert len(roots) >= 2 and len({root for root in roots for _, path, _ in files if path.startswith(root)}) >= 2
    assert [rel for rel, _, _ in files] == sorted(rel for rel, _, _ in files)
    assert len({sha for _, _, sha in files}) == len(files)  # deduplicated by content
    total = sum(os.path.getsize(path) for _, path, _ in files)
    assert max_bytes - (256 << 10) < total <= max_bytes
    splits = data.held_out_splits(files)
    assert sorted(sum(splits.values(), [])) == sorted(path for _, path, _ in files)
    assert 0 < len(splits["valid"]) < len(files) // 20 and 0 < len(splits["test"]) < len(files) // 20
    # a file's split follows its content alone: a larger corpus keeps the small one's held-out files
    larger = data.held_out_splits(data.site_packages_source_files(2 * max_bytes))
    assert set(splits["valid"]) <= set(larger["valid"]) or len(splits["valid"]) == 1

    with caplog.at_level("INFO", logger="megatron.training.data"):
        manifests = [data.ensure_site_packages_corpus(
            make_args(tmp_path / name, builtin_corpus="python-site-packages", builtin_corpus_max_bytes=max_bytes),
            tokenizer) for name in ("a", "b")]
    assert f"{manifests[0]['bytes']} bytes, sha256 {manifests[0]['sha256']}" in caplog.text
    first, second = manifests
    assert (first["files"], first["bytes"], first["sha256"]) == (len(files), total, second["sha256"])
    for split in ("train", "valid", "test"):
        a, b = first["splits"][split]["prefix"], second["splits"][split]["prefix"]
        assert open(a + ".bin", "rb").read() == open(b + ".bin", "rb").read()
        assert len(read_documents(a)) == first["splits"][split]["documents"] > 0
    modified = os.stat(first["splits"]["train"]["prefix"] + ".bin").st_mtime_ns
    args = make_args(tmp_path / "a", builtin_corpus="python-site-packages", builtin_corpus_max_bytes=max_bytes)
    assert data.ensure_site_packages_corpus(args, tokenizer) == first
    assert os.stat(first["splits"]["train"]["prefix"] + ".bin").st_mtime_ns == modified  # reused, not rebuilt
    valid_text = b"".join(open(path, "rb").read() for path in splits["valid"])
    valid_tokens = [t for doc in read_documents(first["splits"]["valid"]["prefix"]) for t in doc if t != tokenizer.eod]
    assert bytes(valid_tokens) == valid_text.decode("utf-8", errors="replace").replace("\n\n\n", "").encode()
    train, valid, test = data.build_datasets(args, tokenizer)
    assert args.data_path is None and args.valid_data_path == [first["splits"]["valid"]["prefix"]]
    assert len(train) >= 48 and len(valid) >= 8 and len(test) >= 8


def _iterators_on_rank(cache_dir):
    from megatron.core import parallel_state
    from megatron.hooks import cpu

    cpu.apply()
    parallel_state.initialize_model_parallel(1, 1)  # 2 ranks: DP = 2
    tokenizer = ByteTokenizer()
    args = make_args(cache_dir)  # 8 samples per iteration: 2 micro-batches of 2 per DP rank
    train_iter, valid_iter, test_iter = data.build_train_valid_test_data_iterators(args, tokenizer)
    batches = [next(train_iter) for _ in range(6)]
    train_dataset, _, test_dataset = data.build_datasets(args, tokenizer)
    rank, mbs, dp = parallel_state.get_data_parallel_rank(), args.micro_batch_size, 2
    for step, batch in enumerate(batches):  # Megatron's order, read back from the dataset
        start = step * mbs * dp + rank * mbs
        expected = torch.stack([train_dataset[i]["tokens"] for i in range(start, start + mbs)])
        assert torch.equal(batch["tokens"], expected)
    valid_batches = [next(valid_iter) for _ in range(3)]
    steps_per_test_pass = len(test_dataset) // (mbs * dp)
    assert 0 < steps_per_test_pass < 200
    test_batches = [next(test_iter) for _ in range(steps_per_test_pass + 1)]
    assert torch.equal(test_batches[-1]["tokens"], test_batches[0]["tokens"])  # it cycles
    resumed = make_args(cache_dir, consumed_train_samples=args.global_batch_size, consumed_valid_samples=mbs * dp)
    resumed_train, resumed_valid, _ = data.build_train_valid_test_data_iterators(resumed, tokenizer)
    for batch in batches[2:]:
        assert all(torch.equal(batch[k], v) for k, v in next(resumed_train).items())
    assert torch.equal(next(resumed_valid)["tokens"], valid_batches[1]["tokens"])
    mock_iter = data.build_train_valid_test_data_iterators(make_args(cache_dir, mock_data=True), tokenizer)[0]
    mock = next(mock_iter)
    parallel_state.destroy_model_parallel()
    return dict(
        tokens=torch.cat([b["tokens"] for b in batches]),
        batch=batches[0], eval_shapes={tuple(b["tokens"].shape) for b in valid_batches + test_batches}, mock=mock,
    )


@pytest.mark.slow
def test_iterators_on_two_dp_ranks(tmp_path):
    results = run_on_ranks(_iterators_on_rank, 2, str(tmp_path))
    rows = [{tuple(row.tolist()) for row in r["tokens"]} for r in results]
    assert len(rows[0]) == len(rows[1]) == 12 and not rows[0] & rows[1]  # disjoint samples per rank
    for result in results:
        batch = result["batch"]
        assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert all(v.shape == (2, 32) for v in batch.values())
        assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
        assert batch["loss_mask"].dtype == torch.float32
        assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
        assert torch.equal(batch["position_ids"][0], torch.arange(32))
        assert result["eval_shapes"] == {(2, 32)}
        mock = result["mock"]
        assert mock["tokens"].shape == (2, 32) and int(mock["tokens"].max()) < 257


def test_damaged_dataset_files_are_errors_naming_them_before_training(tmp_path):
    """The .idx records the bytes its .bin must hold: a .bin cut short (which failed only when training read its
    last document, naming no file), a missing .bin and a truncated .idx are errors naming the path when the datasets
    are built, before the first iteration."""
    tokenizer = ByteTokenizer()
    prefix = str(tmp_path / "corpus")
    documents = [tokenizer.tokenize(f"document {i} " * (i + 1)) for i in range(40)]
    data.write_documents(prefix, documents, tokenizer.vocab_size, eod=tokenizer.eod)
    args = make_args(tmp_path, builtin_corpus=None, data_path=[prefix], split="100,0,0")
    assert len(data.open_indexed_dataset(prefix, "--data-path")) == 40
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    whole_bin, whole_idx = open(bin_path, "rb").read(), open(idx_path, "rb").read()

    with open(bin_path, "wb") as f:
        f.write(whole_bin[:-3])
    with pytest.raises(ValueError) as error:
        data.build_datasets(args, tokenizer)
    assert f"--data-path {prefix}: {bin_path} holds {len(whole_bin) - 3} bytes, its index {idx_path} records " \
           f"{len(whole_bin)}: the .bin is truncated" in str(error.value)
    with open(bin_path, "wb") as f:
        f.write(whole_bin + b"\0\0")
    with pytest.raises(ValueError, match="the .bin is longer than its index"):
        data.build_datasets(args, tokenizer)
    os.remove(bin_path)
    with pytest.raises(ValueError, match=f"--data-path {prefix}: {bin_path} does not exist"):
        data.build_datasets(args, tokenizer)
    with open(bin_path, "wb") as f:
        f.write(whole_bin)
    with open(idx_path, "wb") as f:
        f.write(whole_idx[:len(whole_idx) // 2])
    with pytest.raises(ValueError, match=f"--data-path {prefix}: {idx_path} does not read as a Megatron index"):
        data.build_datasets(args, tokenizer)
    args = make_args(tmp_path, builtin_corpus=None, train_data_path=[prefix], split=None)
    with pytest.raises(ValueError, match=f"--train-data-path {prefix}: {idx_path} does not read"):
        data.build_datasets(args, tokenizer)
