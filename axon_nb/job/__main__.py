"""``python -m axon_nb.job JOB_DIR``: run a submitted job (``axon_nb/job/supervisor.py``)."""

import sys

from axon_nb.job.supervisor import main

sys.exit(main(sys.argv[1:]))
