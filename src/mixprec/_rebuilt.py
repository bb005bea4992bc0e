"""Containers a cast rebuilt for a model, and writing back what the model set in them.

A dict, list or dataclass holding a float tensor reaches a 16-bit region as a copy with
the tensor cast (``casting.cast_linked`` with a ``Casts`` to note them in). What the
model sets in the copy (a KV cache it fills, a state it carries across batches) went to
the copy, unsaid, and the caller's stayed empty: ``write_back`` puts it in the caller's
after the forward. Imports nothing of mixprec: ``casting`` builds on it.
"""

from __future__ import annotations

import dataclasses
from collections import UserDict
from typing import Any

__all__ = ["Casts", "Copied", "write_back"]


@dataclasses.dataclass
class Copied:
    """A mutable container the cast rebuilt (``copy``, for the model), the caller's
    (``original``), and what the cast placed in the copy: by index, by key or by field."""

    original: Any
    copy: Any
    placed: Any


@dataclasses.dataclass
class Casts:
    """The containers one forward's cast rebuilt, innermost first, and each object the cast
    made (a tensor's copy, a rebuilt container) beside the caller's it stands for."""

    copies: list[Copied] = dataclasses.field(default_factory=list)
    made: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)

    def given(self, obj: Any) -> Any:
        """The caller's object that ``obj`` (made by the cast) stands for, else ``obj``."""
        for made, original in self.made:
            if made is obj:
                return original
        return obj

    def copy_of(self, value: Any) -> Any:
        """The copy already made of the container ``value`` (one passed twice), else None."""
        for c in self.copies:
            if c.original is value:
                return c.copy
        return None

    def note(self, original: Any, copy: Any, placed: Any) -> None:
        self.copies.append(Copied(original, copy, placed))
        self.made.append((copy, original))


def write_back(casts: Casts) -> None:
    """After the forward (or its exception): what the model set in a rebuilt container
    goes into the caller's: an entry added, replaced or removed, items appended, inserted
    or reordered, a field set. Objects the cast made stand for the caller's own wherever
    they now sit, so the caller's container holds its own tensors, not their 16-bit
    copies. Keys the model never saw in the copy (set in the caller's by another route)
    stay. Inner containers first, so that an outer entry keeps the caller's inner one."""
    for c in casts.copies:
        if isinstance(c.copy, list):
            if len(c.copy) != len(c.placed) or any(
                a is not b for a, b in zip(c.copy, c.placed, strict=False)
            ):
                c.original[:] = [casts.given(item) for item in c.copy]
        elif isinstance(c.copy, (dict, UserDict)) and not dataclasses.is_dataclass(c.copy):
            for key in [k for k in c.placed if k not in c.copy and k in c.original]:
                del c.original[key]
            for key, now in c.copy.items():
                if key not in c.placed or now is not c.placed[key]:
                    c.original[key] = casts.given(now)
        else:  # a dataclass: its fields
            for name, placed in c.placed.items():
                now = getattr(c.copy, name, None)
                if now is not placed:
                    setattr(c.original, name, casts.given(now))
