"""Module-name patterns in plans (tensor- and expert-parallel): which modules one names.

Example::

    names, problem = matching(dict(model.named_modules()), "blocks.*.attn.q")
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping

from torch import nn


def matching(modules: Mapping[str, nn.Module], pattern: str) -> tuple[list[str], str | None]:
    """The names in ``modules`` that ``pattern`` (``fnmatch``) matches, and when there are
    none, a problem saying so with the nearest names."""
    named = [n for n in modules if n]
    names = [n for n in named if fnmatch.fnmatchcase(n, pattern)]
    if names:
        return names, None
    near = difflib.get_close_matches(pattern, named, n=3, cutoff=0.5)
    hint = f"; nearest names: {', '.join(near)}" if near else ""
    return [], f"{pattern!r} matches no module of the model{hint}"
