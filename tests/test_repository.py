"""The repository's documents point only at files it tracks: every relative link and repository path in README.md,
CHANGELOG.md, docs/ and results/README.md names a tracked file or folder, and no tracked text points outside the
repository or to the chronology of its experiments."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# code spans naming files of these folders are checked too (others may name what must not exist, e.g.
# `megatron/__init__.py`)
TOP_DIRS = ("benchmarks", "configs", "docs", "results", "scripts")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")  # [text](target)
OUTSIDE = tuple(prefix + "/" for prefix in ("shared/notes", "shared/papers", "../shared", "/work"))
PATH = re.compile(r"`((?:%s)/[A-Za-z0-9_./-]+)`" % "|".join(TOP_DIRS))  # `results/...` in code spans


def _tracked():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = {p.decode() for p in listed.split(b"\0") if p}
    folders = set()
    for f in files:
        while f:
            f = os.path.dirname(f)
            folders.add(f)
    return files, folders


def _documents(files):
    return sorted(f for f in files if f in ("README.md", "CHANGELOG.md", "results/README.md")
                  or (f.startswith("docs/") and f.endswith(".md")))


def test_document_links_resolve_to_tracked_files():
    files, folders = _tracked()
    missing = []
    for doc in _documents(files):
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        base = os.path.dirname(doc)
        for target in LINK.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = os.path.normpath(os.path.join(base, target))
            if path not in files and path not in folders:
                missing.append(f"{doc}: ({target})")
        for path in PATH.findall(text):
            path = path.rstrip("/.")
            if "*" in path or "{" in path or path not in files | folders:
                if not any(f.startswith(path) for f in files):  # a prefix such as `results/kernels/delta`
                    missing.append(f"{doc}: `{path}`")
    assert not missing, "links to files the repository does not track:\n" + "\n".join(missing)


def test_no_tracked_text_points_outside_the_repository():
    files, _ = _tracked()
    offending = []
    for f in sorted(files):
        full = os.path.join(ROOT, f)
        if not os.path.isfile(full) or f.endswith((".png", ".gz")):
            continue
        try:
            text = open(full, encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        for needle in OUTSIDE:
            if needle in text:
                offending.append(f"{f}: {needle}")
    assert not offending, "\n".join(offending)


def test_the_project_speaks_of_itself():
    """No tracked path or text is named after the working periods that produced it (the word built below): results
    are organized by topic and dated in results/README.md, history is in git."""
    files, _ = _tracked()
    word = "sess" + "ion"
    offending = [f for f in sorted(files) if word in f.lower()]
    for f in sorted(files):
        full = os.path.join(ROOT, f)
        if not os.path.isfile(full) or f.endswith((".png", ".gz")):
            continue
        try:
            lines = open(full, encoding="utf-8").read().lower().splitlines()
        except UnicodeDecodeError:
            continue
        offending += [f"{f}:{i + 1}" for i, line in enumerate(lines) if word in line]
    assert not offending, "\n".join(offending)
