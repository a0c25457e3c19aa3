"""Contracts both sides share, free of torch and of the kernel's packages (ipyparallel,
widgets): a rank, the launcher and the reaper import these without loading either side."""
