"""``python -m axon_nb.job JOB_DIR``: run a submitted job (``axon_nb/job/supervisor.py``).
``python -m axon_nb.job --submitted JOB_DIR SLURM_ID``: note that a Slurm job was submitted
again by hand (its ``run.sh`` says so after ``sbatch``)."""

import sys

from axon_nb.job.supervisor import main, note_resubmitted

if sys.argv[1:2] == ["--submitted"]:
    sys.exit(note_resubmitted(sys.argv[2:]))
sys.exit(main(sys.argv[1:]))
