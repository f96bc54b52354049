#!/usr/bin/env bash
# Launch the HDET reference trainer on ONE node with torchrun (one process per GPU).
#
# Usage (from the repository root, or with hdet_scale installed):
#   GPUS=8 launchers/torchrun_single_node.sh [CONFIG.yaml] [key=value ...]
#   launchers/torchrun_single_node.sh configs/llama_1b_cluster.yaml data.path=/data/corpus train.steps=200
#
# Environment:
#   GPUS   processes (GPUs) on this node; default: number of GPUs `nvidia-smi -L`
#          lists, or 1 if none are found.
#   MAX_RESTARTS  when a rank fails, torchrun restarts every rank up to this many times
#          (default 3); hdet-train then resumes from the newest checkpoint by itself
#          (set train.checkpoint_every), without train.resume. 0: no restarts. A stop
#          (SIGINT, SIGTERM, SIGHUP to this script or its process group) is not restarted:
#          the script exits 130 / 143 / 129 once every rank has ended.
#   Any other env (NCCL_*, OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES) is passed through.
#
# All arguments are forwarded unchanged to `python -m hdet_scale.train.cli`
# (console script `hdet-train`): an optional YAML config, then key=value overrides.
# torchrun --standalone runs its own local rendezvous, so no MASTER_ADDR/PORT is needed,
# and gives the job a random id: a restart resumes this job's run, never another's.
set -euo pipefail

if [[ -z "${GPUS:-}" ]]; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "${GPUS}" =~ ^[0-9]+$ && "${GPUS}" -gt 0 ]] || GPUS=1
fi
# Checked here, not inside torchrun (tester round 20: GPUS=abc, GPUS=0 or MAX_RESTARTS=-1
# were torchrun's tracebacks): exit 2 naming the variable, as hdet-train's own errors.
need_int() {  # NAME VALUE MIN
  [[ "$2" =~ ^[0-9]+$ && "$2" -ge "$3" ]] || { echo "$(basename "$0"): $1=$2: expected an integer >= $3" >&2; exit 2; }
}
need_int GPUS "${GPUS}" 1
need_int MAX_RESTARTS "${MAX_RESTARTS:-3}" 0
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torch's shared rendezvous store breaks restarts (a restarted rank reads the dead
# attempt's addresses: pytorch issue 135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

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
set -m
"${python_bin}" -c "${TORCHRUN}" --standalone --nnodes=1 --nproc_per_node="${GPUS}" --max-restarts="${MAX_RESTARTS:-3}" \
  -m hdet_scale.train.cli "$@" &
child=$!
set +m
send  # a signal that came while torchrun was being started
rc=0
wait "${child}" || rc=$?
while kill -0 "${child}" 2>/dev/null; do  # a trapped signal interrupts wait: wait for torchrun itself
  rc=0
  wait "${child}" || rc=$?
done
if (( stopped && rc != 0 )); then
  exit "${stopped}"
fi
exit "${rc}"  # torchrun's own: 0, or its failure (a rank failed after the last restart: 1)
