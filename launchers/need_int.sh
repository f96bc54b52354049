# Sourced by torchrun_single_node.sh, torchrun_multi_node.sh and deepspeed_hostfile.sh:
# need_int NAME VALUE MIN [WHERE] [MAX] checks an environment value before any launcher
# starts (tester round 20: GPUS=abc, GPUS=0 or MAX_RESTARTS=-1 were the launchers'
# tracebacks) and exits 2 naming the variable, as hdet-train's own errors; on success it
# sets NAME to VALUE in decimal. One copy for the three scripts (a tester: the hostfile
# script's own copy read GPUS=08 as bad octal, a bash error, and let 10^20 wrap past its
# check). slurm.sbatch keeps its own copy: sbatch runs a spooled copy of it, with no
# launchers/ folder beside it when it checks its values.
need_int() {  # NAME VALUE MIN [WHERE] [MAX]
  local ok=0 expected=">= $3"
  # 10#: 08 is 8, not bad octal; at most 18 digits: 10^20 would wrap around in bash's
  # arithmetic and pass the bounds (tester round 30: GPUS=99999999999999999999 made
  # torchrun build its worker list for 98 % CPU and a growing GB, silently)
  if [[ "$2" =~ ^[0-9]{1,18}$ ]] && (( 10#$2 >= $3 )); then
    ok=1
    [[ -z "${5:-}" ]] || (( 10#$2 <= $5 )) || ok=0
  fi
  if (( ok )); then
    printf -v "$1" '%d' "$((10#$2))"  # later arithmetic (the hostfile script's restarts) reads 08 as 8 too
    return 0
  fi
  [[ -z "${5:-}" ]] || expected="in [$3, $5]"
  echo "$(basename "$0"): $1=${2:-<empty>}: expected an integer ${expected}${4:+ ($4)}" >&2
  exit 2
}
# The bound on MAX_RESTARTS in all three scripts: more restarts than this are a typo, and
# a value past bash's integers would wrap around (a tester: MAX_RESTARTS=10^20 passed
# the hostfile script's check).
MAX_RESTARTS_LIMIT=1000000
