"""What SIGKILLed MPI jobs leave in /dev/shm is removed before ranks launch, and nothing a
live job maps or a starting job just made."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from axon_nb.cluster import mpi_leftovers

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm here")


def _file(name: str, age_s: float) -> Path:
    path = Path("/dev/shm") / f"mpich_shm_axontest{name}_{os.getpid()}"
    path.write_bytes(bytes(4096))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_old_files_no_process_maps_are_removed() -> None:
    stale, fresh, mapped = _file("stale", 600), _file("fresh", 1), _file("mapped", 600)
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096) as held:
        try:
            removed = mpi_leftovers.remove_stale()
            assert str(stale) in removed and not stale.exists()
            assert fresh.exists() and mapped.exists()  # a starting job's, a live job's
            assert held[0] == 0
        finally:
            for path in (stale, fresh, mapped):
                path.unlink(missing_ok=True)


def test_a_file_unmapped_since_the_last_start_is_removed_at_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A start asks the process seen mapping a file last time first (a pooled cluster's file
    is a candidate at every start); once that process lets go, the file goes. (The file is
    new, and old only to these calls: another worker's starts leave it alone. These calls
    look at this test's files only: to a clock minutes ahead, a file another worker's new
    cluster made between them would be a candidate no pid explains.)"""
    monkeypatch.setattr(mpi_leftovers, "PATTERN", f"/dev/shm/mpich_shm_axontest*_{os.getpid()}")
    mapped = _file("later", 0)
    later = time.time() + mpi_leftovers.STALE_S + 60
    try:
        with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096):
            assert str(mapped) not in mpi_leftovers.remove_stale(now=later)
            assert mpi_leftovers._MAPPED_BY[str(mapped)] == os.getpid()
            with monkeypatch.context() as m:  # this pid explains it: no read of every maps
                m.setattr(mpi_leftovers, "_mapped_paths", lambda: pytest.fail("read all maps"))
                assert str(mapped) not in mpi_leftovers.remove_stale(now=later)
            assert mapped.exists()
        assert str(mapped) in mpi_leftovers.remove_stale(now=later)
        assert not mapped.exists()
    finally:
        mapped.unlink(missing_ok=True)


@pytest.mark.timeout(120)
def test_a_clean_stop_leaves_no_shared_memory_file_of_its_own() -> None:
    """Forked engines end without MPI_Finalize, which would unlink the job's file: the stop
    does (it was left for the next start more than STALE_S later to sweep)."""
    import axon_nb

    with axon_nb.Cluster(n=2, timeout=60) as cluster:
        assert cluster.options.engines == "mpi"
        files = mpi_leftovers.mapped_by(r["pid"] for r in cluster.ranks)
        assert files, "the ranks map no /dev/shm/mpich_shm_* file"
    assert [f for f in files if os.path.exists(f)] == []
