"""Tokenizers and text corpora.

The default corpus is the Python standard library's own source code: real text that exists on
every machine with Python, so a run, a test or a benchmark never needs to download anything.
Hugging Face datasets and tokenizers (`hf:<name>`) are an optional extra for real runs.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from swarm.manifest import Manifest

BUILTIN_STDLIB = "builtin:stdlib"
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".html", ".c", ".h", ".csv", ".tex"}
DEFAULT_LIMIT_BYTES = 16 << 20
VALIDATION_FRACTION = 0.05


class DataError(ValueError):
    pass


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no training, no files."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, name: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - optional extra
            raise DataError("tokenizer 'hf:...' needs the optional extra: pip install 'protocol-swarm[hf]'") from None
        self._tokenizer = Tokenizer.from_pretrained(name)
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def make_tokenizer(spec: str):
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    raise DataError(f"unknown tokenizer {spec!r}")


def _text_files(root: Path, skip_dirs: frozenset[str] = frozenset()) -> list[Path]:
    """Text files under `root`, sorted; directories named in `skip_dirs` are not even entered."""
    found = []
    for folder, subfolders, names in os.walk(root):  # like rglob: symlinked folders are not followed
        subfolders[:] = [name for name in subfolders if name not in skip_dirs]
        found.extend(Path(folder) / name for name in names if Path(name).suffix in TEXT_SUFFIXES)
    return sorted(p for p in found if p.is_file())


def read_corpus(spec: str, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> str:
    """Text of a corpus: `builtin:stdlib`, a file, or a directory of text files (sorted, capped)."""
    if spec == BUILTIN_STDLIB:
        # third-party packages live under the stdlib folder; skipping them while walking saves seconds
        files = _text_files(Path(sysconfig.get_paths()["stdlib"]), frozenset({"site-packages"}))
    else:
        path = Path(spec)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = _text_files(path)
        else:
            raise DataError(f"dataset {spec!r} is neither {BUILTIN_STDLIB!r}, a file nor a directory")
    parts, total = [], 0
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    corpus = "\n".join(parts)[:limit_bytes]
    if len(corpus) < 4096:
        raise DataError(f"dataset {spec!r} holds only {len(corpus)} characters of text; need at least 4096")
    return corpus


def _hf_text(name: str, limit_bytes: int) -> str:  # pragma: no cover - optional extra, needs the network
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError("dataset 'hf:...' needs the optional extra: pip install 'protocol-swarm[hf]'") from None
    parts, total = [], 0
    for row in load_dataset(name, split="train", streaming=True):
        parts.append(row["text"])
        total += len(row["text"])
        if total >= limit_bytes:
            break
    return "\n".join(parts)


class TokenStream:
    """Random windows of `seq_len` tokens from a train or a held-out split."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        if len(tokens) <= seq_len:
            raise DataError(f"split has {len(tokens)} tokens, fewer than one sequence of {seq_len}")
        self.tokens = torch.from_numpy(tokens)
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (batch_size,), generator=self.generator)
        return torch.stack([self.tokens[s : s + self.seq_len] for s in starts.tolist()])

    def fixed_batches(self, batch_size: int, count: int) -> list[torch.Tensor]:
        """Deterministic evenly spaced windows: the same validation set for every run."""
        span = len(self.tokens) - self.seq_len
        starts = np.linspace(0, span, batch_size * count, dtype=np.int64)
        windows = torch.stack([self.tokens[s : s + self.seq_len] for s in starts.tolist()])
        return list(windows.split(batch_size))


def load_splits(
    manifest: Manifest, data: str | None = None, seed: int = 0, limit_bytes: int = DEFAULT_LIMIT_BYTES
) -> tuple[TokenStream, TokenStream]:
    """Train and held-out token streams (the last 5% of the corpus is held out)."""
    spec = data or manifest.dataset
    tokenizer = make_tokenizer(manifest.tokenizer)
    text = _hf_text(spec[3:], limit_bytes) if spec.startswith("hf:") else read_corpus(spec, limit_bytes)
    tokens = tokenizer.encode(text)
    if tokens.max(initial=0) >= manifest.model.vocab_size:
        raise DataError(f"tokenizer produced ids up to {tokens.max()}, beyond vocab_size {manifest.model.vocab_size}")
    split = int(len(tokens) * (1 - VALIDATION_FRACTION))
    seq = manifest.batch.seq_len
    return TokenStream(tokens[:split], seq, seed), TokenStream(tokens[split:], seq, seed + 1)
