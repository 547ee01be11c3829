"""Tokenizer and corpora: the built-in corpus is real text, files and directories load, a corpus
too small is refused, and the held-out split shares no text with the training split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.data import (
    BUILTIN_STDLIB,
    VALIDATION_FRACTION,
    ByteTokenizer,
    DataError,
    TokenStream,
    load_splits,
    make_tokenizer,
    read_corpus,
)
from swarm.manifest import BatchSpec
from swarm.presets import preset

LIMIT = 200_000


@pytest.fixture(scope="module")
def stdlib_text() -> str:
    return read_corpus(BUILTIN_STDLIB, limit_bytes=LIMIT)


def _numbered_lines(count: int) -> str:
    return "".join(f"line {i:06d}: the quick brown fox {i * 7919 % 10007:05d}\n" for i in range(count))


def test_builtin_corpus_is_real_text(stdlib_text):
    assert len(stdlib_text) == LIMIT
    for marker in ("def ", "import ", "class ", "return", '"""'):
        assert marker in stdlib_text
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in stdlib_text)
    assert printable / len(stdlib_text) > 0.99
    assert len(set(stdlib_text.split())) > 2000  # many distinct words, not a repeated snippet


def test_builtin_corpus_is_deterministic(stdlib_text):
    assert read_corpus(BUILTIN_STDLIB, limit_bytes=50_000) == stdlib_text[:50_000]


def test_file_corpus(tmp_path):
    text = _numbered_lines(200)
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    assert read_corpus(str(path)) == text
    assert read_corpus(str(path), limit_bytes=5000) == text[:5000]


def test_directory_corpus(tmp_path):
    (tmp_path / "b.md").write_text("B" * 3000)
    (tmp_path / "a.txt").write_text("A" * 3000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("C" * 3000)
    (tmp_path / "image.png").write_bytes(b"\x89PNG" + b"P" * 3000)  # not a text suffix
    (tmp_path / "broken.txt").write_bytes(b"\xff\xfe" * 2000)  # not UTF-8: skipped
    text = read_corpus(str(tmp_path))
    assert text == "\n".join(["A" * 3000, "B" * 3000, "C" * 3000])  # sorted paths


def test_directory_corpus_stops_at_limit(tmp_path):
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text(str(i) * 5000)
    text = read_corpus(str(tmp_path), limit_bytes=12_000)
    assert len(text) == 12_000 and "3" not in text


def test_too_small_corpus_refused(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("too little text")
    with pytest.raises(DataError, match="only 15 characters"):
        read_corpus(str(small))
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(DataError, match="need at least"):
        read_corpus(str(empty))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff" * 10_000)
    with pytest.raises(DataError):
        read_corpus(str(binary))


def test_missing_corpus_refused(tmp_path):
    with pytest.raises(DataError, match="neither"):
        read_corpus(str(tmp_path / "absent"))


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "plain ASCII, héllo, ☃, 日本語\n"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int64 and ids.max() < 256 and len(ids) == len(text.encode())
    assert tokenizer.decode(ids) == text
    assert make_tokenizer("bytes").vocab_size == 256


def test_unknown_tokenizer_refused():
    with pytest.raises(DataError, match="unknown tokenizer"):
        make_tokenizer("words")


def _manifest(seq_len: int = 32):
    return preset("tiny", batch=BatchSpec(microbatch_size=2, seq_len=seq_len, target_batch_size=2))


def test_splits_are_disjoint(tmp_path):
    text = _numbered_lines(3000)
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    train, held_out = load_splits(_manifest(), str(path))
    tokens = ByteTokenizer().encode(text)
    assert len(train.tokens) + len(held_out.tokens) == len(tokens)
    assert len(held_out.tokens) == len(tokens) - int(len(tokens) * (1 - VALIDATION_FRACTION))
    assert torch.equal(torch.cat([train.tokens, held_out.tokens]), torch.from_numpy(tokens))
    train_text = ByteTokenizer().decode(train.tokens.tolist())
    held_text = ByteTokenizer().decode(held_out.tokens.tolist())
    train_lines = set(train_text.splitlines()[:-1])  # the last line may be cut in two by the split
    held_lines = held_text.splitlines()[1:]
    assert len(held_lines) > 100
    assert not train_lines.intersection(held_lines)
    # every validation window comes from the held-out part only
    for batch in held_out.fixed_batches(2, 4):
        for window in batch:
            assert ByteTokenizer().decode(window.tolist()) not in train_text


def test_load_splits_defaults_to_manifest_dataset():
    train, held_out = load_splits(_manifest(), limit_bytes=LIMIT)
    assert len(train.tokens) + len(held_out.tokens) == LIMIT  # the stdlib sources are ASCII here
    assert train.batch(3).shape == (3, 32)


def test_token_stream_batches():
    tokens = np.arange(1000, dtype=np.int64)
    a, b = TokenStream(tokens, 16, seed=0), TokenStream(tokens, 16, seed=0)
    batch = a.batch(4)
    assert batch.shape == (4, 16) and batch.dtype == torch.int64
    assert torch.equal(batch, b.batch(4))  # same seed, same windows
    assert not torch.equal(a.batch(4), batch)  # the stream moves on
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 15, dtype=torch.int64))  # contiguous
    fixed = a.fixed_batches(4, 3)
    assert len(fixed) == 3 and all(f.shape == (4, 16) for f in fixed)
    assert all(torch.equal(x, y) for x, y in zip(fixed, b.fixed_batches(4, 3), strict=True))
    starts = torch.cat(fixed)[:, 0]
    assert starts[0] == 0 and starts[-1] == 1000 - 16


def test_token_stream_too_short():
    with pytest.raises(DataError, match="fewer than one sequence"):
        TokenStream(np.arange(16, dtype=np.int64), 16, seed=0)
