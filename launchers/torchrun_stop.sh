# Sourced by torchrun_single_node.sh and torchrun_multi_node.sh: run_torchrun ARGS...
# starts torchrun with ARGS and exits with its code, or 130 / 143 / 129 after a stop.
#
# A stop (Ctrl-C, a scheduler's SIGTERM, a closed terminal) ends the job with 130 / 143 /
# 129, without a restart or a traceback (a tester: torchrun's SignalException traceback
# came after the trainer's stop line, exit 1). torchrun runs in its own process group
# (set -m): this script gets the signal, passes it to torchrun once (torchrun must get it,
# or it counts the ranks' stop as a failure and restarts them), waits for it, and exits
# 128 + the signal's number. torchrun is started through torchrun_quiet.py beside this file,
# which differs from its console script in one thing: a stop signal (also one during its
# start, before its own handlers are set) ends it with that code and no traceback. The
# ranks' output is untouched.
torchrun_bin=$(command -v torchrun) || {
  echo "$(basename "$0"): torchrun is not on PATH (install torch, or activate its environment)" >&2; exit 127; }
python_bin="$(dirname "${torchrun_bin}")/python3"  # torchrun's own environment (venv, conda, /usr/local)
[[ -x "${python_bin}" ]] || python_bin=python3
quiet_torchrun="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/torchrun_quiet.py"
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
  # HDET_LAUNCHER_PID: torchrun_quiet.py ends torchrun (and so the ranks) when this script
  # dies without passing a signal on (kill -9): its own process group outlives the script
  HDET_LAUNCHER_PID=$$ "${python_bin}" "${quiet_torchrun}" "$@" &
  child=$!
  set +m
  send  # a signal that came while torchrun was being started
  local rc=0
  wait "${child}" || rc=$?
  while kill -0 "${child}" 2>/dev/null; do  # a trapped signal interrupts wait: wait for torchrun itself
    if (( stopped )); then
      # tester round 55: torchrun blocked in its rendezvous (a MASTER_ADDR that does not
      # answer) sees the signal only when its connect attempt gives up, 47 s later. With no
      # rank started there is nothing to save and no op build lock to leave: end it.
      local waited=0
      while kill -0 "${child}" 2>/dev/null && (( waited < 100 )); do sleep 0.1; waited=$((waited + 1)); done
      if kill -0 "${child}" 2>/dev/null && ! pgrep -P "${child}" >/dev/null 2>&1; then
        echo "$(basename "$0"): torchrun had started no rank 10 s after the SIG${sig} (still in its rendezvous):" \
          "ended at once (SIGKILL)" >&2
        kill -s KILL -- "-${child}" 2>/dev/null || true
      fi
    fi
    rc=0
    { wait "${child}" || rc=$?; } 2>/dev/null  # not bash's "Killed" job notice after that SIGKILL
  done
  if (( stopped && rc != 0 )); then
    exit "${stopped}"
  fi
  exit "${rc}"  # torchrun's own: 0, or its failure (a rank failed after the last restart: 1), or a refusal's 2 / 3
}
