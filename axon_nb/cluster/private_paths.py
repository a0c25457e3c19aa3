"""Where a cluster's processes keep what libraries would put in a shared, guessable place.

torch's compile cache defaults to ``/tmp/torchinductor_<user>``: a name any other user can
create first (and then read or plant what the ranks compile). The ranks, and the warm process
their engines are forked from (it imports torch's compiler), use one in the user's own cache
directory instead.

    environment = {**os.environ, **private_cache_environment()}
"""

from __future__ import annotations

import os
from pathlib import Path


def compile_cache() -> Path:
    """``$XDG_CACHE_HOME/axon_nb/torchinductor`` (``~/.cache/...``), its parent made 0700."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    parent = Path(cache) / "axon_nb"
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return parent / "torchinductor"


def private_cache_environment() -> dict[str, str]:
    """The environment variables that move libraries' caches into :func:`compile_cache`."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(compile_cache())}
