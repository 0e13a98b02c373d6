"""The study's corpus: the Python standard library's source files, read as bytes.

Every machine that runs Python has them, so the study needs no download and no tokenizer (the
vocabulary is the 256 byte values). The corpus is the `.py` files under the running interpreter's
standard-library folder (`sysconfig.get_paths()["stdlib"]`, CPython's `Lib/`), with
`site-packages`, `dist-packages` and `__pycache__` left out: code and prose written by thousands
of people, about 30 MB where the interpreter ships its test suite.

Split by file, with a fixed rule: a file belongs to the validation set when the CRC-32 of its path
relative to the root (with "/" separators) is divisible by 20 (about 5% of the files), else to the
training set. Files are read in sorted path order and joined with one NUL byte, a byte no source
file holds, so a document boundary is visible to the model.

Another interpreter ships other files: the study prints the root, the counts, the sizes and a
SHA-256 of the corpus, so a run says which corpus it trained on.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch

VALIDATION_MODULUS = 20
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "__pycache__"}
SEPARATOR = b"\x00"


@dataclass
class Corpus:
    root: str
    train: torch.Tensor  # uint8, the training files joined
    validation: torch.Tensor  # uint8, the validation files joined
    train_files: int
    validation_files: int
    sha256: str  # over every file's relative path and bytes, in order

    def describe(self) -> str:
        return (
            f"corpus: {self.root}: {self.train_files + self.validation_files} files, "
            f"{(self.train.numel() + self.validation.numel()) / 1e6:.1f} MB "
            f"(training {self.train_files} files, {self.train.numel() / 1e6:.2f} MB; "
            f"validation {self.validation_files} files, {self.validation.numel() / 1e6:.2f} MB), "
            f"sha256 {self.sha256[:16]}"
        )


def stdlib_root() -> str:
    """The standard-library folder of the interpreter running this code."""
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str) -> list[str]:
    """The `.py` files under `root`, as sorted relative paths with "/" separators."""
    found = []
    for folder, folders, files in os.walk(root):
        folders[:] = [name for name in folders if name not in SKIPPED_FOLDERS]
        for name in files:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/"))
    return sorted(found)


def is_validation(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % VALIDATION_MODULUS == 0


def load_corpus(root: str | None = None) -> Corpus:
    """Read every source file under `root` (default: this interpreter's standard library) and split."""
    root = root or stdlib_root()
    files = source_files(root)
    if not files:
        raise FileNotFoundError(f"No .py files under {root!r}: the study reads a standard library's sources (or --corpus DIR).")
    digest = hashlib.sha256()
    parts = {True: [], False: []}
    for relative in files:
        with open(os.path.join(root, relative), "rb") as file:
            data = file.read()
        digest.update(relative.encode() + SEPARATOR + data + SEPARATOR)
        parts[is_validation(relative)].append(data)
    if not parts[True] or not parts[False]:
        raise ValueError(f"{root!r} has {len(files)} source files: too few to split into training and validation.")

    def joined(pieces: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(SEPARATOR.join(pieces)), dtype=torch.uint8)

    return Corpus(root, joined(parts[False]), joined(parts[True]), len(parts[False]), len(parts[True]), digest.hexdigest())


class Batches:
    """Training batches: `batch` windows of `length + 1` bytes at offsets drawn from a generator
    seeded with `seed`, so every run with the same seed sees the same bytes in the same order."""

    def __init__(self, data: torch.Tensor, batch: int, length: int, seed: int):
        if data.numel() <= length + 1:
            raise ValueError(f"The training data has {data.numel()} bytes, too few for windows of {length + 1}.")
        self.data, self.batch, self.length = data, batch, length
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.data.numel() - self.length - 1, (self.batch,), generator=self.generator)
        return windows(self.data, starts, self.length)


def windows(data: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of `length + 1` bytes of `data` from each start, as int64 token ids."""
    return data[starts[:, None] + torch.arange(length + 1)].long()


def validation_starts(data: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` window starts spread evenly over the validation data: the same windows every time."""
    return torch.linspace(0, data.numel() - length - 1, count).long()
