"""Byte-level language modelling on a real English corpus that ships with Python.

The default corpus is ``pydoc_data.topics``: the text of the Python language reference and library topics that
``help()`` shows (about 465 000 characters of English prose with code examples, 79 topics). It is part of every CPython
installation, so nothing is downloaded. Its exact text changes a little between Python releases, so numbers measured on
it are comparable only within one Python version.

Text is modelled as UTF-8 **bytes** (vocabulary of 256), so no vocabulary has to be built or stored; 99.6 % of the
corpus is ASCII, so bits per byte are, to within that, bits per character.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import ClassVar

import torch

from lightning_comp.errors import ConfigError
from lightning_comp.zoo.data import InMemoryDataModule, check_positive_int

__all__ = ["VOCAB_SIZE", "CharTextDataModule", "load_corpus"]

VOCAB_SIZE = 256
BUILTIN_CORPORA: tuple[str, ...] = ("pydoc_topics",)


@functools.lru_cache(maxsize=4)
def load_corpus(corpus: str = "pydoc_topics") -> bytes:
    """Return a corpus as UTF-8 bytes (cached).

    Args:
        corpus: ``"pydoc_topics"`` (the Python reference topics, joined in sorted-key order with blank lines), or the
            path of a UTF-8 text file.

    Raises:
        ConfigError: If ``corpus`` is neither a built-in name nor an existing file, or the text is shorter than 2 bytes.
    """
    if corpus == "pydoc_topics":
        from pydoc_data.topics import topics

        data = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    else:
        path = Path(corpus).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"corpus must be one of {list(BUILTIN_CORPORA)} or the path of a text file, got {corpus!r}"
            )
        data = path.read_text(encoding="utf-8").encode("utf-8")
    if len(data) < 2:
        raise ConfigError(f"corpus {corpus!r} holds {len(data)} bytes; at least 2 are needed")
    return data


class CharTextDataModule(InMemoryDataModule):
    """Next-byte prediction on non-overlapping windows of a text corpus.

    The corpus is cut into ``len(corpus) // seq_len`` consecutive windows; window ``i`` gives
    ``x = text[i*T : (i+1)*T]`` and ``y = text[i*T + 1 : (i+1)*T + 1]``. The last ``val_fraction`` of the windows (the
    end of the corpus) is the validation set, so training and validation text do not overlap.

    A batch is ``(x: int64[B, T], y: int64[B, T])``.

    Args:
        seq_len: Bytes per window (``T``); also the context a model must support.
        num_samples: Windows to use from the start of the corpus; ``None`` uses the whole corpus (about 3600 windows
            of 128 bytes for ``pydoc_topics``).
        batch_size: Windows per batch.
        val_fraction: Held-out part for validation.
        corpus: ``"pydoc_topics"`` or a path to a UTF-8 text file.
        num_workers: ``DataLoader`` workers.
    """

    kind: ClassVar[str] = "tokens"
    vocab_size: ClassVar[int] = VOCAB_SIZE

    def __init__(
        self,
        seq_len: int = 128,
        num_samples: int | None = None,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        corpus: str = "pydoc_topics",
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, val_fraction=val_fraction, num_workers=num_workers)
        self.seq_len = check_positive_int("seq_len", seq_len)
        self.num_samples = None if num_samples is None else check_positive_int("num_samples", num_samples)
        self.corpus = corpus
        self.save_hyperparameters()

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut the corpus into ``(x, y)`` windows."""
        data = load_corpus(self.corpus)
        available = (len(data) - 1) // self.seq_len
        n = available if self.num_samples is None else min(self.num_samples, available)
        if n < 2:
            raise ConfigError(
                f"corpus {self.corpus!r} ({len(data)} bytes) gives {available} windows of seq_len={self.seq_len}; "
                "at least 2 are needed"
            )
        tokens = torch.frombuffer(bytearray(data[: n * self.seq_len + 1]), dtype=torch.uint8).long()
        x = tokens[:-1].view(n, self.seq_len)
        y = tokens[1:].view(n, self.seq_len)
        return x, y
