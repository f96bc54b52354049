"""torchrun, except that a stop signal (SIGINT, SIGTERM, SIGHUP: Ctrl-C, a scheduler's
SIGTERM, scancel, a closed terminal) ends it with exit code 128 + the signal's number and
no traceback (torchrun's console script prints its SignalException traceback after the
trainer's own stop line and exits 1). Run as ``python3 launchers/torchrun_quiet.py ARGS``
with torchrun's arguments; everything else is torchrun's (its agent still ends the ranks
on the signal; their output is untouched), but for the agent's warning lines about ending
them, which a stop silences.

Used by torchrun_stop.sh (sourced by torchrun_single_node.sh and torchrun_multi_node.sh)
and slurm.sbatch.
"""
import logging
import os
import signal
import sys

del sys.path[0]  # as the torchrun command: nothing from the folder of this file


def stop(signum, frame):  # a signal before torchrun's own handlers are set
    sys.exit(128 + signum)


for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, stop)

import torch.distributed.elastic.multiprocessing.api as elastic_api  # noqa: E402
from torch.distributed.elastic.multiprocessing import SignalException  # noqa: E402


def agent_stop(signum, frame):  # torchrun's handler, whose agent then ends the ranks
    # The agent's warnings about ending the ranks ("Received 15 death signal", "Sending
    # process N closing signal SIGTERM") repeat the trainer's stop line three times over:
    # silenced from the stop on; its errors still show. Its loggers carry their own level.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, agent_stop)
# torchrun sets its handler again when it starts the ranks: this one in its place
elastic_api._terminate_process_handler = agent_stop

from torch.distributed.run import main  # noqa: E402

sys.argv[0] = "torchrun"
try:
    sys.exit(main())
except SignalException as e:
    sys.exit(128 + int(e.sigval))
