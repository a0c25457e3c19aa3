"""Where this kernel's output goes."""

from __future__ import annotations


def in_notebook() -> bool:
    """True in a Jupyter kernel, where widgets render (not in a terminal or a test).

    Example::

        if in_notebook():
            display(dashboard)
    """
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
