#!/usr/bin/env bash
# Launch the HDET reference trainer with the `deepspeed` launcher and a hostfile
# (passwordless ssh + pdsh to every host by default; see DeepSpeed's launcher docs).
#
# Usage (from the repository root, with hdet_scale importable on every host):
#   HOSTFILE=launchers/hostfile launchers/deepspeed_hostfile.sh [CONFIG.yaml] [key=value ...]
#   NNODES=2 GPUS=8 MASTER_ADDR=worker-1 launchers/deepspeed_hostfile.sh configs/x.yaml
#
# Environment:
#   HOSTFILE     hostfile with lines `<host> slots=<gpus>` (default: launchers/hostfile
#                next to this script).
#   NNODES       use the first NNODES hosts (default: all hosts in HOSTFILE).
#   GPUS         GPUs per node, 1..4096 (default: the slots of the first host in HOSTFILE).
#   MASTER_ADDR  address of the first node (default: inferred by deepspeed).
#   MASTER_PORT  port (default 29500).
#   MAX_RESTARTS reruns after a failure (default 3; 0: none). The deepspeed launcher has no
#                restart of its own (no --max-restarts, unlike torchrun), so this script
#                reruns it with train.resume=true: the run continues from its newest
#                checkpoint (set train.checkpoint_every). A failure before the first
#                checkpoint is then refused (exit 2: run_dir holds the failed attempt's
#                metrics; replace them with train.overwrite=true). At most 1000000.
#                Exit codes 2 (bad config, a refused run_dir, a host ssh cannot reach, no
#                pdsh) and 3 (a stale DeepSpeed op build lock: README, Troubleshooting)
#                are never retried, nor a stop: SIGINT / SIGTERM / SIGHUP to this script
#                are passed to the launcher's process group, and the script exits with
#                the run's code (130 / 143 / 129) once it has ended. A train.resume=...
#                of yours is replaced by train.resume=true on a restart.
# Env vars needed on remote hosts (NCCL_*, PYTHONPATH, ...) go in ~/.deepspeed_env or
# ./.deepspeed_env as KEY=VALUE lines (DeepSpeed exports them via pdsh).
#
# `--no_local_rank` stops the launcher from appending `--local_rank=N` to the
# trainer's arguments (it reads LOCAL_RANK/RANK/WORLD_SIZE from the environment), so
# the arguments are exactly: [CONFIG.yaml] [key=value ...].
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOSTFILE="${HOSTFILE:-${SCRIPT_DIR}/hostfile}"
[[ -f "${HOSTFILE}" ]] || { echo "hostfile not found: ${HOSTFILE}" >&2; exit 2; }

if [[ -z "${NNODES:-}" ]]; then
  NNODES=$(grep -cEv '^[[:space:]]*(#|$)' "${HOSTFILE}" || true)
fi
if [[ -z "${GPUS:-}" ]]; then
  GPUS=$(awk '!/^[[:space:]]*(#|$)/ { for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { sub(/^slots=/, "", $i); print $i; exit } }' "${HOSTFILE}")
fi
MASTER_PORT="${MASTER_PORT:-29500}"
# Checked here, not inside the deepspeed launcher (tester round 20: a host line without
# slots= gave "--num_gpus: invalid int value: ''"): exit 2 naming the variable. The same
# check and bounds as the torchrun scripts (need_int.sh: GPUS=08 is 8, 10^20 is refused).
source "${SCRIPT_DIR}/need_int.sh"
need_int GPUS "${GPUS}" 1 "set GPUS, or give the first host of ${HOSTFILE} slots=<gpus>" 4096
need_int NNODES "${NNODES}" 1 "hosts in ${HOSTFILE}"
need_int MASTER_PORT "${MASTER_PORT}" 1 "" 65535
MAX_RESTARTS="${MAX_RESTARTS:-3}"
need_int MAX_RESTARTS "${MAX_RESTARTS}" 0 "" "${MAX_RESTARTS_LIMIT}"

# What the deepspeed launcher needs before it starts a rank, checked here once (tester
# round 22: without passwordless ssh its RuntimeError traceback came back at every one of
# the restarts below, exit 1 each time). DeepSpeed itself asks the first host the same way.
first_host=$(awk '!/^[[:space:]]*(#|$)/ { print $1; exit }' "${HOSTFILE}")
if ! ssh -o PasswordAuthentication=no -o BatchMode=yes -o ConnectTimeout=10 "${first_host}" hostname \
    >/dev/null 2>&1; then
  echo "$(basename "$0"): host ${first_host} (first in ${HOSTFILE}) cannot be reached by passwordless ssh," \
       "which the deepspeed launcher needs (ssh -o PasswordAuthentication=no ${first_host} hostname failed):" \
       "set up ssh keys, or on one node use launchers/torchrun_single_node.sh" >&2
  exit 2
fi
command -v pdsh >/dev/null || {
  echo "$(basename "$0"): pdsh is not installed; the deepspeed launcher starts the ranks of a hostfile with it" \
       "(install pdsh, or on one node use launchers/torchrun_single_node.sh)" >&2
  exit 2; }

args=(--hostfile="${HOSTFILE}" --num_nodes "${NNODES}" --num_gpus "${GPUS}"
      --master_port "${MASTER_PORT}")
if [[ -n "${MASTER_ADDR:-}" ]]; then
  args+=(--master_addr "${MASTER_ADDR}")
fi

# A stop (Ctrl-C, a scheduler's SIGTERM, a closed terminal) ends the job and is never
# retried (tester round 25: Ctrl-C restarted the run, and a SIGTERM to this script left
# the training running). The launcher runs in its own process group (set -m) so that this
# script, which must stay for its loop, hands it the signal it got, and waits for it.
stopped=0
child=
forward() {  # SIGNAL EXIT_CODE
  stopped=$2
  if [[ -n "${child}" ]]; then kill -s "$1" -- "-${child}" 2>/dev/null || true; fi
}
trap 'forward INT 130' INT
trap 'forward TERM 143' TERM
trap 'forward HUP 129' HUP
set -m
attempt=0
user_args=("$@")
while true; do
  rc=0
  deepspeed "${args[@]}" --no_local_rank --module hdet_scale.train.cli ${user_args[@]+"${user_args[@]}"} &
  child=$!
  wait "${child}" || rc=$?
  while kill -0 "${child}" 2>/dev/null; do  # a trapped signal interrupts wait: wait for the launcher itself
    rc=0
    wait "${child}" || rc=$?
  done
  child=
  if (( stopped && rc != 0 )); then
    exit "${stopped}"  # the multi-node launcher ends by sys.exit(1) after killing the ranks: say why
  fi
  # 2 (bad input) and 3 (a stale DeepSpeed op build lock, cleared only by removing it):
  # hdet-train's exit codes that every attempt would repeat, so no retry (a tester: 3 was
  # retried). torchrun cannot be told a code; there a restart repeats a 2 at once (refusals.py).
  if (( rc == 0 || rc == 2 || rc == 3 || rc == 129 || rc == 130 || rc == 143 || attempt >= MAX_RESTARTS )); then
    exit "${rc}"  # done, refused, or a rank stopped by a signal sent to it (not a failure): no retry
  fi
  attempt=$((attempt + 1))
  # train.resume=true replaces the user's own train.resume=... (tester round 25: both were
  # passed and refused as "multiple values for train.resume")
  kept=()
  for a in "$@"; do
    [[ "${a}" == train.resume=* ]] || kept+=("${a}")
  done
  user_args=(${kept[@]+"${kept[@]}"} train.resume=true)
  echo "deepspeed_hostfile.sh: the run failed (exit ${rc}); restart ${attempt}/${MAX_RESTARTS} with train.resume=true" >&2
done
