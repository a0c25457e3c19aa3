"""This user's list of jobs submitted from this host (``axon_nb.jobs()``): one file per job id
in the user's private runtime directory, naming the job's directory.

Example::

    index_job("4242", Path("/home/me/axon_jobs/model-20261129-0612-ab12"))
"""

from __future__ import annotations

import json
from pathlib import Path

from axon_nb.cluster.detached import private_runtime_dir
from axon_nb.spec.kept_runs import write_atomically


def index_job(job_id: str, directory: Path) -> None:
    """Note the job ``job_id`` (its directory) in this user's list."""
    index = private_runtime_dir("axon-jobs")
    write_atomically(index / f"{job_id}.json", json.dumps({"dir": str(directory)}).encode())
