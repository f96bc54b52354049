# Sourced by torchrun_single_node.sh and torchrun_multi_node.sh: run_torchrun ARGS...
# starts torchrun with ARGS and exits with its code, or 130 / 143 / 129 after a stop.
#
# A stop (Ctrl-C, a scheduler's SIGTERM, a closed terminal) ends the job with 130 / 143 /
# 129, without a restart or a traceback (a tester: torchrun's SignalException traceback
# came after the trainer's stop line, exit 1). torchrun runs in its own process group
# (set -m): this script gets the signal, passes it to torchrun once (torchrun must get it,
# or it counts the ranks' stop as a failure and restarts them), waits for it, and exits
# 128 + the signal's number. torchrun is started by the lines below, which differ from its
# console script in one thing: a stop signal (also one during its start, before its own
# handlers are set) ends it with that code and no traceback. The ranks' output is untouched.
TORCHRUN='import os, signal, sys
if sys.path[:1] == [""]:  # as the torchrun command: nothing from the current directory
    del sys.path[0]
def stop(signum, frame):
    sys.exit(128 + signum)
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, stop)
from torch.distributed.elastic.multiprocessing import SignalException
def agent_stop(signum, frame):  # as the handlers of torchrun, whose agent then ends the ranks
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, agent_stop)
from torch.distributed.run import main
sys.argv[0] = "torchrun"
try:
    sys.exit(main())
except SignalException as e:
    sys.exit(128 + int(e.sigval))'
torchrun_bin=$(command -v torchrun) || {
  echo "$(basename "$0"): torchrun is not on PATH (install torch, or activate its environment)" >&2; exit 127; }
python_bin="$(dirname "${torchrun_bin}")/python3"  # torchrun's own environment (venv, conda, /usr/local)
[[ -x "${python_bin}" ]] || python_bin=python3
stopped=0 sig= sent=0 child=
send() {  # once: torchrun is then ending the ranks, and a second signal would cut that short
  if (( stopped && !sent )) && [[ -n "${child}" ]]; then
    sent=1
    kill -s "${sig}" -- "-${child}" 2>/dev/null || true
  fi
}
forward() {  # SIGNAL EXIT_CODE
  if (( stopped == 0 )); then sig=$1 stopped=$2; fi
  send
}
trap 'forward INT 130' INT
trap 'forward TERM 143' TERM
trap 'forward HUP 129' HUP
run_torchrun() {  # torchrun's arguments; never returns
  set -m
  "${python_bin}" -c "${TORCHRUN}" "$@" &
  child=$!
  set +m
  send  # a signal that came while torchrun was being started
  local rc=0
  wait "${child}" || rc=$?
  while kill -0 "${child}" 2>/dev/null; do  # a trapped signal interrupts wait: wait for torchrun itself
    rc=0
    wait "${child}" || rc=$?
  done
  if (( stopped && rc != 0 )); then
    exit "${stopped}"
  fi
  exit "${rc}"  # torchrun's own: 0, or its failure (a rank failed after the last restart: 1)
}
