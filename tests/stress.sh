#!/usr/bin/env bash
# Stress proof: run the default test suite RUNS times in a row (default 3) while a CPU hog holds one core.
#
# usage: tests/stress.sh [RUNS] [-- extra pytest args]
#   e.g. tests/stress.sh 3
#        tests/stress.sh 1 -- tests/integration/test_swarm.py
#
# Every run must be green and no single test may take over LIMIT seconds (default 120, env STRESS_TEST_LIMIT).
# Each run's wall time and its 10 slowest tests go to stdout and to $STRESS_DIR/summary.txt
# (default: stress-results/ in the repository, git-ignored), with each run's full pytest log beside it.
# Exit status: 0 when every run passed within the limits, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:-3}
shift || true
[ "${1:-}" = "--" ] && shift
limit=${STRESS_TEST_LIMIT:-120}
out=${STRESS_DIR:-stress-results}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"

# The hog: one busy process pinned to core 0 (all of it when taskset is missing), at normal priority, so the
# suite shares a 2-core machine with a neighbour that never sleeps.
if command -v taskset > /dev/null; then
  taskset -c 0 "$python" -c 'while True: pass' &
else
  "$python" -c 'while True: pass' &
fi
hog=$!
suite=
# Stopping the script (SIGTERM, Ctrl+C) stops the suite too: pytest runs in a session of its own, killed whole
# (its nodes, ranks and DHT daemons with it), so nothing of a stopped stress run trains on unseen.
trap 'kill $hog 2> /dev/null; [ -z "$suite" ] || kill -KILL -- -"$suite" 2> /dev/null' EXIT
trap 'exit 130' INT TERM

say() { echo "$*" | tee -a "$summary"; }
say "stress: $runs run(s) of the default suite, a CPU hog (pid $hog) on one core, per-test limit ${limit}s"
say "machine: $(nproc) cores, load before start: $(cut -d' ' -f1-3 /proc/loadavg)"

failed=0
for i in $(seq 1 "$runs"); do
  log="$out/run-$i.log"
  start=$(date +%s)
  setsid "$python" -m pytest -q --durations=10 --durations-min=1 "$@" > "$log" 2>&1 &
  suite=$!
  wait "$suite"
  code=$?
  suite=
  seconds=$(( $(date +%s) - start ))
  result=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$log" | tail -n 1)
  say ""
  say "run $i: exit $code in ${seconds}s, load $(cut -d' ' -f1-3 /proc/loadavg): ${result:-no summary line}"
  say "  slowest:"
  # pytest's durations table: "12.34s call     tests/unit/test_x.py::test_y"
  grep -E '^[0-9.]+s (setup|call|teardown) ' "$log" | head -n 10 | sed 's/^/    /' | tee -a "$summary"
  over=$(grep -E '^[0-9.]+s (setup|call|teardown) ' "$log" | awk -v limit="$limit" '$1 + 0 > limit')
  if [ -n "$over" ]; then
    say "  over the ${limit}s limit:"
    echo "$over" | sed 's/^/    /' | tee -a "$summary"
    failed=1
  fi
  if [ "$code" -ne 0 ]; then
    say "  failures:"
    grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /' | tee -a "$summary"
    failed=1
  fi
done
say ""
if [ "$failed" -eq 0 ]; then say "stress: all $runs run(s) green"; else say "stress: FAILED (see $out)"; fi
exit "$failed"
