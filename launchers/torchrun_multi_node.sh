#!/usr/bin/env bash
# Launch the HDET reference trainer on SEVERAL nodes with torchrun + c10d rendezvous.
# Run this same command on every node (e.g. via your scheduler / pdsh / ssh).
#
# Usage (from the repository root, or with hdet_scale installed), on each node:
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=node-0 MASTER_PORT=29500 GPUS=8 \
#     launchers/torchrun_multi_node.sh [CONFIG.yaml] [key=value ...]
#
# Environment:
#   NNODES       number of nodes (required).
#   NODE_RANK    this node's index in [0, NNODES) (required; with c10d rendezvous the
#                global ranks are assigned by the rendezvous, NODE_RANK is passed for
#                logging/consistency).
#   MASTER_ADDR  hostname/IP of the node that hosts the rendezvous store (required;
#                must be reachable from all nodes; normally node 0).
#   MASTER_PORT  free TCP port on MASTER_ADDR (default 29500).
#   GPUS         processes per node (default: GPUs listed by `nvidia-smi -L`, else 1).
#   RDZV_ID      rendezvous/job id shared by all nodes (default: hdet-$MASTER_ADDR-$MASTER_PORT).
#                It also tells a restarted hdet-train that run_dir holds this job's run:
#                give every job its own (e.g. a scheduler's job id).
#   MAX_RESTARTS when a rank fails, torchrun restarts every rank up to this many times
#                (default 3); hdet-train then resumes from the newest checkpoint by itself
#                (set train.checkpoint_every), without train.resume. 0: no restarts.
#                A stop (SIGINT, SIGTERM, SIGHUP to this script or its process group) is
#                not restarted: the script exits 130 / 143 / 129 once every rank has ended.
#                Nor is a refusal (exit 2: bad input; 3: a stale op build lock): the
#                script exits with that code after the one message (torchrun_quiet.py).
#
# Checked before torchrun starts (exit 2, one line naming the variable): NNODES >= 1,
# 0 <= NODE_RANK < NNODES, GPUS in [1, 4096], MASTER_PORT in [1, 65535], MAX_RESTARTS in
# [0, 1000000], MASTER_ADDR set.
#
# All arguments are forwarded unchanged to `python -m hdet_scale.train.cli`
# (console script `hdet-train`): an optional YAML config, then key=value overrides.
set -euo pipefail

# Checked here, not inside torchrun (tester round 20: GPUS=abc, GPUS=0 or MAX_RESTARTS=-1
# were torchrun's tracebacks; tester round 26: MASTER_PORT=abc / 99999 too, and NODE_RANK=5
# with NNODES=1 was accepted silently): exit 2 naming the variable, as hdet-train's own errors.
source "$(dirname "${BASH_SOURCE[0]}")/need_int.sh"
need_int NNODES "${NNODES:-}" 1 "number of nodes; required"
need_int NODE_RANK "${NODE_RANK:-}" 0 "this node's index, 0..NNODES-1; required"
if (( 10#${NODE_RANK} >= 10#${NNODES} )); then
  echo "$(basename "$0"): NODE_RANK=${NODE_RANK}: expected an integer < NNODES=${NNODES} (this node's index, 0..NNODES-1)" >&2
  exit 2
fi
[[ -n "${MASTER_ADDR:-}" ]] || {
  echo "$(basename "$0"): MASTER_ADDR is not set (rendezvous host, usually node 0)" >&2; exit 2; }
MASTER_PORT="${MASTER_PORT:-29500}"
need_int MASTER_PORT "${MASTER_PORT}" 1 "TCP port on MASTER_ADDR" 65535
RDZV_ID="${RDZV_ID:-hdet-${MASTER_ADDR}-${MASTER_PORT}}"

if [[ -z "${GPUS:-}" ]]; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "${GPUS}" =~ ^[0-9]+$ && "${GPUS}" -gt 0 ]] || GPUS=1
fi
need_int GPUS "${GPUS}" 1 "processes on this node" 4096
need_int MAX_RESTARTS "${MAX_RESTARTS:-3}" 0 "" "${MAX_RESTARTS_LIMIT}"  # the same bound in every launcher
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torch's shared rendezvous store breaks restarts (a restarted rank reads the dead
# attempt's addresses: pytorch issue 135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# A stop (Ctrl-C, a scheduler's SIGTERM, a closed terminal) ends the job with 130 / 143 /
# 129 and the trainer's one line, without a restart or torchrun's traceback: torchrun_stop.sh.
source "$(dirname "${BASH_SOURCE[0]}")/torchrun_stop.sh"
# tester round 55: node 0 waiting for the others printed nothing at all
echo "$(basename "$0"): node ${NODE_RANK} of ${NNODES}: torchrun starts ${GPUS} rank(s) here once all ${NNODES} nodes" \
  "have joined the rendezvous at ${MASTER_ADDR}:${MASTER_PORT} (id ${RDZV_ID}); until then it waits" >&2
run_torchrun \
  --nnodes="${NNODES}" \
  --node_rank="${NODE_RANK}" \
  --nproc_per_node="${GPUS}" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
  --rdzv_id="${RDZV_ID}" \
  -m hdet_scale.train.cli "$@"
