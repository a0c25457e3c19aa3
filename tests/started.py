"""A base for test fixtures that start real daemons (sshd hosts, Slurm)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T", bound="Started")


class Started:
    """A context manager: ``_start`` on entry (``close`` first undoes a start that failed
    half-way), ``close`` on exit."""

    def _start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: T) -> T:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
