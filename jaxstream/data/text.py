"""A real text corpus on every machine: the Python standard library's own source files.

The corpus is a fixed list of pure-Python modules of the running interpreter's standard library
(found with ``sysconfig``; no download). The split is by file: :data:`TRAIN_FILES` give the
training text, :data:`TEST_FILES` the test text, so test windows are never seen in training.
A second training text, :data:`FINETUNE_FILES` (``corpus="b"``; other modules, none of them in
the first text or the test files), is there to fine-tune a model pretrained on the first.
Characters are printable ASCII plus newline (tabs become a space; anything else becomes ``?``),
a vocabulary of :data:`VOCAB_SIZE` = 96.

The file list is fixed; their contents follow the interpreter version (3.11 here), so figures
measured on this corpus state the Python version they were measured with.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import numpy as np

from jaxstream.data.digits import Dataset

TRAIN_FILES: tuple[str, ...] = (
    "argparse.py", "calendar.py", "contextlib.py", "csv.py", "dataclasses.py", "difflib.py",
    "fnmatch.py", "fractions.py", "functools.py", "gettext.py", "glob.py", "graphlib.py",
    "heapq.py", "ipaddress.py", "locale.py", "operator.py", "pprint.py", "queue.py",
)
TEST_FILES: tuple[str, ...] = ("random.py", "sched.py", "shlex.py", "statistics.py", "textwrap.py")
FINETUNE_FILES: tuple[str, ...] = (
    "ast.py", "base64.py", "bisect.py", "copy.py", "datetime.py", "enum.py", "inspect.py",
    "numbers.py", "string.py", "tokenize.py", "typing.py", "uuid.py",
)
#: The training texts by name: ``a`` (the default) and ``b`` (another text, to fine-tune on).
CORPORA: dict[str, tuple[str, ...]] = {"a": TRAIN_FILES, "b": FINETUNE_FILES}

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII
VOCAB_SIZE = len(VOCAB)
_UNKNOWN = VOCAB.index("?")
_TABLE = np.full(0x110000, _UNKNOWN, dtype=np.int32)
_TABLE[[ord(c) for c in VOCAB]] = np.arange(VOCAB_SIZE, dtype=np.int32)
_TABLE[ord("\t")] = VOCAB.index(" ")


def stdlib_dir() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def encode(text: str) -> np.ndarray:
    """Character ids (int32) over :data:`VOCAB`."""
    return _TABLE[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]


def decode(ids: np.ndarray) -> str:
    """Inverse of :func:`encode` (up to the characters it maps to ``?`` or a space)."""
    return "".join(VOCAB[i] for i in np.asarray(ids).ravel())


def corpus(files: tuple[str, ...], root: str | Path | None = None) -> np.ndarray:
    """Concatenated ids of ``files`` (in order), read from ``root`` (default :func:`stdlib_dir`)."""
    base = Path(root) if root is not None else stdlib_dir()
    missing = [f for f in files if not (base / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"text corpus: {missing} not found in {base} (Python {sys.version.split()[0]})"
        )
    return np.concatenate([encode((base / f).read_text(encoding="utf-8")) for f in files])


def load_text(seed: int = 0, seq_len: int = 64, num_train: int = 4096, num_test: int = 512,
              root: str | Path | None = None, corpus_name: str = "a") -> Dataset:
    """Random windows of the standard-library corpus: x = ids[t:t+T], y = ids[t+1:t+T+1].

    Train windows come from the files of ``CORPORA[corpus_name]`` (``a``: :data:`TRAIN_FILES`,
    ``b``: :data:`FINETUNE_FILES`), test windows from :data:`TEST_FILES` (held out from both);
    window starts are drawn with ``seed``.

    Example:
      >>> ds = load_text(seq_len=32, num_train=64, num_test=16)
      >>> ds.train["x"].shape, ds.info["vocab_size"]
      ((64, 32), 96)
    """
    for name, value in (("seq_len", seq_len), ("num_train", num_train), ("num_test", num_test)):
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if corpus_name not in CORPORA:
        raise ValueError(f"corpus: {corpus_name!r} is not a text; allowed: {sorted(CORPORA)}")
    rng = np.random.default_rng([seed, 13])

    def windows(ids: np.ndarray, n: int) -> dict[str, np.ndarray]:
        starts = rng.integers(0, len(ids) - seq_len - 1, size=n)
        idx = starts[:, None] + np.arange(seq_len)[None]
        return {"x": ids[idx], "y": ids[idx + 1]}

    train = windows(corpus(CORPORA[corpus_name], root), num_train)
    test = windows(corpus(TEST_FILES, root), num_test)
    info = {"vocab_size": VOCAB_SIZE, "seq_len": seq_len, "num_classes": VOCAB_SIZE,
            "num_train": num_train, "num_test": num_test}
    return Dataset(train, test, info)
