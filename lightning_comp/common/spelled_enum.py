"""String enums that users spell in configs, plans and JSON: by their value, or by an alias, in any case."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum, EnumMeta
from typing import Any, TypeVar

import torch

from lightning_comp.errors import CoMPError, ConfigError

__all__ = ["SpelledEnum", "quoted"]

_E = TypeVar("_E", bound="SpelledEnum")


def quoted(values: Iterable[object], last: str = "or") -> str:
    """``values`` quoted for a message, the last joined by ``last``: ``"'min' or 'max'"``, ``"'a', 'b' and 'c'"``."""
    texts = [repr(str(value)) for value in values]
    return texts[0] if len(texts) == 1 else ", ".join(texts[:-1]) + f" {last} " + texts[-1]


class _Spellings(EnumMeta):
    """``Member["memory"]`` finds a member by its value or an alias too, not only by its name (``"MEMORY"``): tools
    that look members up by name, such as LightningCLI's argument parser, take what users write in configs."""

    def __getitem__(cls, name: str) -> Any:
        try:
            return super().__getitem__(name)
        except KeyError:
            found = cls._missing_(name)  # type: ignore[attr-defined]
            if found is None:
                raise
            return found


class SpelledEnum(str, Enum, metaclass=_Spellings):
    """A ``str`` enum whose members are spelled by their value or by an alias (case and surrounding blanks ignored).

    ``Member("BFloat16")`` and ``Member["bf16"]`` find a member by an alias, as :meth:`parse` does (so configs and
    command lines may spell a member by its value; a member's name works too); :meth:`parse` also accepts a member and,
    where members name a torch dtype (a ``dtype`` property), that dtype, and raises the subclass's
    :meth:`error_type` with a message naming the value and every valid spelling. Subclasses override the class methods
    :meth:`aliases`, :meth:`noun`, :meth:`error_type` and, to explain the choices, :meth:`notes`.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __hash__(self) -> int:
        # A member equals its value (``str`` equality); Enum hashes the member's *name*, so ``{Dimension.SAVED: x}``
        # would not find ``"saved"``. Hashing the value keeps hash and equality consistent.
        return hash(self.value)

    @classmethod
    def aliases(cls) -> Mapping[str, str]:
        """Other spellings: alias (lower case) -> a member's value."""
        return {}

    @classmethod
    def noun(cls) -> str:
        """What a member is, for messages (``"precision"``)."""
        return "value"

    @classmethod
    def error_type(cls) -> type[CoMPError]:
        """The exception :meth:`parse` raises."""
        return ConfigError

    @classmethod
    def choices(cls) -> str:
        """The valid spellings, each with its :meth:`notes` entry, for messages (``"'fp32', 'bf16' and 'fp16'"``)."""
        notes = cls.notes()
        texts = [repr(member.value) + (f" ({notes[member.value]})" if member.value in notes else "") for member in cls]
        return texts[0] if len(texts) == 1 else ", ".join(texts[:-1]) + " and " + texts[-1]

    @classmethod
    def notes(cls) -> Mapping[str, str]:
        """What some members mean, shown beside them by :meth:`choices`: value -> a few words."""
        return {}

    @classmethod
    def alternatives(cls) -> str:
        """The valid spellings as a choice, for "use ..." advice (``"'min' or 'max'"``)."""
        return quoted(member.value for member in cls)

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if not isinstance(value, str):
            return None
        key = value.strip().lower()
        key = cls.aliases().get(key, key)
        return next((member for member in cls if member.value == key), None)

    @classmethod
    def parse(cls: type[_E], value: object) -> _E:
        """The member ``value`` spells (a member, its value, an alias or, where members have one, a torch dtype).

        Raises:
            CoMPError: of :meth:`error_type`, naming ``value`` and the valid spellings.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, torch.dtype) and any(hasattr(member, "dtype") for member in cls):
            for member in cls:
                if getattr(member, "dtype", None) == value:
                    return member
            dtypes = ", ".join(dict.fromkeys(str(member.dtype) for member in cls if hasattr(member, "dtype")))
            raise cls.error_type()(f"Unsupported dtype {value!r} for a {cls.noun()}: valid dtypes are {dtypes}.")
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise cls.error_type()(
                f"Unknown {cls.noun()} {value!r}: valid {cls.noun()}s are {cls.choices()}."
            ) from None
