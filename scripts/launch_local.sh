#!/usr/bin/env bash
# Start N ultrajax.train processes on this host as one multi-process JAX run.
#
#   scripts/launch_local.sh N [train arguments]
#   scripts/launch_local.sh 2 --config configs/tiny.yaml --cpu-devices 4 \
#       mesh.data=2 mesh.fsdp=2 mesh.tensor=2
#
# Each process gets --coordinator 127.0.0.1:<free port> --num-processes N
# --process-id i in front of the given arguments (so --cpu-devices 4 gives every
# process its own 4 simulated CPU devices; they talk through gloo). Logs go to
# <train.run_dir>/logs/process_<i>.log (process 0's is also shown here) and the
# pids to <train.run_dir>/logs/pids. The script waits for all processes; if one
# fails, the others are stopped (SIGTERM, then SIGKILL after $ULTRAJAX_GRACE_S
# seconds, default 2), that process's last lines are printed and the script exits
# with its status (a process that ended with 1, its peers gone, waits up to that grace
# for one that ends with a one-line error, 2: that one is reported). Ctrl-C / SIGTERM are forwarded to every process (a SIGTERM'd
# run saves a checkpoint and stops). No process is left behind.
set -euo pipefail

usage() {
  echo "usage: $0 N [train arguments]   (N >= 1 processes on this host)" >&2
  exit 2
}
[[ $# -ge 1 && $1 =~ ^[0-9]+$ && $1 -ge 1 ]] || usage
if ((BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1))); then
  echo "error: $0 needs bash >= 5.1 (wait -n -p)" >&2
  exit 2
fi
N=$1
shift
PYTHON=${PYTHON:-python}
GRACE=${ULTRAJAX_GRACE_S:-2}

# train.run_dir as the run will see it (config file, then overrides); bad input -> one line, exit 2
RUN_DIR=$("$PYTHON" - "$@" <<'EOF'
import argparse, sys
from ultrajax.config.parse import load
from ultrajax.config.schema import ConfigError
p = argparse.ArgumentParser(add_help=False)
p.add_argument("--config")
known, rest = p.parse_known_args(sys.argv[1:])
overrides = [a for a in rest if "=" in a and not a.startswith("-")]
if known.config is None:  # the train command's own requirement, before any process starts
    print("error: --config FILE is required (python -m ultrajax.train's)", file=sys.stderr)
    sys.exit(2)
try:
    print(load(known.config, overrides).train.run_dir)
except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
EOF
)
LOG_DIR="$RUN_DIR/logs"
mkdir -p "$LOG_DIR"
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

pids=()
tail_pid=""
stop_all() {  # $1: signal for the first round
  local pid
  for pid in "${pids[@]}"; do kill -"$1" -- "-$pid" 2>/dev/null || true; done
  local deadline=$((SECONDS + GRACE))
  for pid in "${pids[@]}"; do
    while kill -0 -- "-$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [[ -n $tail_pid ]]; then kill "$tail_pid" 2>/dev/null || true; wait "$tail_pid" 2>/dev/null || true; fi
}
on_signal() {
  echo "launch_local: $1, stopping all processes" >&2
  GRACE=${ULTRAJAX_SIGNAL_GRACE_S:-120}  # time to save a checkpoint
  stop_all TERM
  exit 130
}
trap 'on_signal interrupted' INT
trap 'on_signal terminated' TERM

: >"$LOG_DIR/pids"
for ((i = 0; i < N; i++)); do
  log="$LOG_DIR/process_$i.log"
  # setsid: each process leads its own process group, so stopping it stops its children too
  PYTHONUNBUFFERED=1 setsid "$PYTHON" -m ultrajax.train \
    --coordinator "127.0.0.1:$PORT" --num-processes "$N" --process-id "$i" "$@" >"$log" 2>&1 &
  pids+=($!)
  echo "$!" >>"$LOG_DIR/pids"
  echo "launch_local: process $i pid $! log $log" >&2
done
tail -n +1 -F "$LOG_DIR/process_0.log" 2>/dev/null &
tail_pid=$!

declare -A running  # pid -> process id
for i in "${!pids[@]}"; do running[${pids[$i]}]=$i; done
while ((${#running[@]} > 0)); do
  finished=""
  status=0
  wait -n -p finished "${!running[@]}" || status=$?
  [[ -n $finished ]] || continue
  i=${running[$finished]}
  unset "running[$finished]"
  if ((status != 0)); then
    if ((status != 2)); then  # a process that lost its peers (a connection reset: 1) can end
      # before the one whose one-line error (2) made them leave: the cause is that one's
      deadline=$((SECONDS + GRACE))
      while ((${#running[@]} > 0 && SECONDS < deadline)); do
        for pid in "${!running[@]}"; do
          kill -0 "$pid" 2>/dev/null && continue
          other=0
          wait "$pid" || other=$?
          j=${running[$pid]}
          unset "running[$pid]"
          if ((other == 2)); then finished=$pid i=$j status=2; break 2; fi
        done
        sleep 0.1
      done
    fi
    sleep 0.2  # let tail show process 0's last words
    echo "launch_local: process $i (pid $finished) exited with status $status; stopping the others" >&2
    stop_all TERM
    echo "---- last lines of $LOG_DIR/process_$i.log ----" >&2
    if [[ -s $LOG_DIR/process_$i.log ]]; then
      tail -n 30 "$LOG_DIR/process_$i.log" >&2
    else
      echo "(no output: killed before it printed anything?)" >&2
    fi
    exit "$status"
  fi
done
sleep 0.2
kill "$tail_pid" 2>/dev/null || true
wait "$tail_pid" 2>/dev/null || true
echo "launch_local: all $N processes finished; logs in $LOG_DIR" >&2
