#!/usr/bin/env bash
# The GPU checks (BENCHMARKS.md's GPU tables) on one CUDA machine, each stage bounded by its own timeout. Results land in $OUT
# (default ./gpu-results): log.txt (every stage's output and, where one failed, its logs' tails) and one JSON per
# benchmark.
#
#   [BUDGET=SECONDS] benchmarks/gpu_checks.sh [STAGE ...]
#       stages: env throughput-1b throughput-1b-h30 throughput-350m throughput-125m gpu-swarm exchange-threads
#       (the default, in that order), and handoff tests agent-round. On an H100 host (2026-11-27) env to
#       throughput-350m took 8 minutes (each 1B stage about 3, compile included), throughput-125m about 1.5,
#       gpu-swarm up to 5, exchange-threads 2.5: the default set needs two calls of under 10 minutes, e.g.
#       BUDGET=560 ... env throughput-1b throughput-1b-h30 throughput-350m, then the rest.
#
# On a machine with no package registry, the Python packages its image lacks travel in .gpu/ (git-ignored),
# which benchmarks/gpu_deps.sh fills here: .gpu/site (hivemind with its p2pd, pydantic, protobuf, ... copied
# from this project's virtualenv) and .gpu/whl (the compiled ones, as wheels for the machine's Python).
# farloco itself is installed there from this tree (its optional C kernels built there).
set -u
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# The whole run's budget in seconds (a stage gets at most what is left of it).
BUDGET=${BUDGET:-3600}

limit() {  # the smaller of $1 and the seconds left of BUDGET (at least 1)
    local left=$((BUDGET - SECONDS))
    [ "$left" -lt 1 ] && left=1
    [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

setup() {
    if [ -d .gpu/site ]; then
        cp -r .gpu/site /tmp/site
        if ls .gpu/whl/*.whl >/dev/null 2>&1; then
            $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl >>"$LOG" 2>&1
        fi
    fi
    if ! $PY -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/farloco . >>"$LOG" 2>&1; then
        say "pip could not install this tree: importing it from the tree instead (no C kernels)"
        mkdir -p /tmp/farloco/farloco
        for part in node protocol optim; do ln -sfn "$PWD/$part" "/tmp/farloco/farloco/$part"; done
    fi
    export PYTHONPATH=/tmp/farloco:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    if [ -d .gpu/iproute ] && ! command -v ip >/dev/null; then  # the namespace WAN's tools (gpu_deps.sh)
        mkdir -p /tmp/iproute/bin
        for tool in ip tc sysctl; do
            printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/.gpu/iproute/lib exec %s/.gpu/iproute/%s "$@"\n' "$PWD" "$PWD" "$tool" \
                >"/tmp/iproute/bin/$tool"
            chmod +x "/tmp/iproute/bin/$tool"
        done
        export PATH=/tmp/iproute/bin:$PATH
    fi
}

cleanup() {  # whatever a stage stopped by its timeout left running (nodes, DHT daemons, ranks)
    pkill -9 -f "farloco.node" 2>/dev/null
    pkill -9 -f p2pd 2>/dev/null
    sleep 1
}

tails() {  # the last lines of every log under $1 (a stage that failed)
    find "$1" -type f \( -name '*.log' -o -name '*.jsonl' -o -name 'std*' -o -name 'error.json' \) 2>/dev/null |
        head -40 | while read -r file; do
            echo "--- $file" >>"$LOG"
            tail -c 3000 "$file" >>"$LOG"
        done
}

stage_env() {
    say env
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
        $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
        nproc
        free -g | head -2
        df -h /dev/shm /tmp | tail -2
        $PY -c "import hivemind, grpc, msgpack, farloco.node.daemon.core, farloco.optim.dense as d; print('hivemind', hivemind.__version__, 'grpc', grpc.__version__, 'C kernels', d.KERNELS is not None)"
        # Whether this host can make the gpu-swarm stage's WAN (namespaces, tc tbf, the netem relay's TUN device).
        timeout 60 $PY -c "
from farloco.node.tools import netns
reason = netns.relay_unavailable()
if reason is None:
    with netns.NamespaceWAN(2, '1gbit', delay_ms=25.0):
        pass
print('network namespaces:', reason or 'a 2-host WAN at 1gbit x 50 ms RTT went up and down')"
    } >>"$LOG" 2>&1
}

stage_handoff() {
    say "handoff: 1b, bf16, batch 8 x 2048"
    timeout -s INT -k 10 $(limit 150) $PY benchmarks/handoff.py --presets 1b --precision bf16 --batch-size 8 --seq-len 2048 \
        --repeats 3 --json "$OUT/handoff.json" >>"$LOG" 2>&1 || say "handoff failed: $?"
}

throughput() {  # NAME TIMEOUT ROUNDS H BARE_STEPS PRESET... (BARE_STEPS 0: the daemon alone)
    local name=$1 limit=$2 rounds=$3 inner=$4 bare=$5
    shift 5
    say "throughput $name: $* (H = $inner, $rounds rounds, bare steps $bare)"
    rm -rf "/tmp/nt-$name"
    if ! timeout -s INT -k 10 "$(limit "$limit")" $PY benchmarks/node_throughput.py --presets "$@" --batch-size 8 --seq-len 2048 \
        --precision bf16 --compile --rounds "$rounds" --inner-steps "$inner" --bare-steps "$bare" \
        --json "$OUT/throughput-$name.json" --work "/tmp/nt-$name" >>"$LOG" 2>&1; then
        say "throughput $name failed"
        tails "/tmp/nt-$name"
    fi
    for events in /tmp/nt-"$name"/daemon-*/node/logs/agent.jsonl; do  # each round's phases, for a closer look
        [ -f "$events" ] && cp "$events" "$OUT/agent-$name-$(basename "$(dirname "$(dirname "$(dirname "$events")")")").jsonl"
    done
}

stage_tests() {
    say "tests marked gpu"
    rm -rf /tmp/pt
    if ! timeout -s INT -k 10 $(limit 220) $PY -m pytest -m gpu tests/integration/test_parallel_ranks.py tests/integration/test_swarm.py tests/integration/test_island.py -v -rs \
        --timeout 200 --basetemp /tmp/pt -p no:cacheprovider >>"$LOG" 2>&1; then
        say "tests failed"
        tails /tmp/pt
    fi
}

stage_agent_round() {  # the agent's round at 1B on this host's cores: one thread against all it may use
    # (theta's digest, DiLoCo's contribution and outer step with and without the C kernels, a whole round)
    local threads=$(($(nproc) - 1))
    say "agent round: theta's digest (4 GiB) and a 1B diloco int8 round, 1 and $threads threads"
    timeout -s INT -k 10 $(limit 60) $PY benchmarks/digest.py --gib 4 --threads 1 "$threads" --repeats 3 \
        >>"$LOG" 2>&1 || say "digest failed: $?"
    timeout -s INT -k 10 $(limit 120) $PY benchmarks/outer_step.py --params 1e9 --threads 1 "$threads" --repeats 3 \
        >>"$LOG" 2>&1 || say "outer_step failed: $?"
    for t in 1 "$threads"; do
        timeout -s INT -k 10 $(limit 200) $PY benchmarks/round_overhead.py --params 1e9 --strategy diloco \
            --codec int8 --threads "$t" --rounds 3 --checkpoint-dir /tmp --markdown >>"$LOG" 2>&1 ||
            say "round_overhead --threads $t failed: $?"
    done
}

stage_gpu_swarm() {  # two nodes on the one GPU, 125m, over a 1 Gbit/s x 50 ms namespace link and on loopback
    say "gpu swarm: 2 nodes x 1 rank on one GPU, 125m, 10 rounds, loopback and 1gbit x 50 ms"
    rm -rf /tmp/gs
    timeout -s INT -k 10 $(limit 300) $PY benchmarks/gpu_swarm.py --preset 125m --rounds 10 --rate 1gbit --rtt-ms 50 \
        --json "$OUT/gpu-swarm.json" --work /tmp/gs >>"$LOG" 2>&1 || { say "gpu swarm failed: $?"; tails /tmp/gs; }
}

stage_exchange_threads() {  # the exchange's codec work on 0, 1 and 8 threads per peer, 2 peers on this host
    say "exchange: 2 peers x 1 GiB (a 268M-value tensor), int8 and fp32, codec threads 0 / 1 / 8, against gloo"
    timeout -s INT -k 10 $(limit 240) $PY benchmarks/exchange.py --impl farloco --impl gloo --peers 2 --mib 1024 \
        --codec int8 --codec fp32 --codec-threads 0 --codec-threads 1 --codec-threads 8 --markdown \
        >>"$LOG" 2>&1 || say "exchange failed: $?"
}

setup
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env throughput-1b throughput-1b-h30 throughput-350m throughput-125m gpu-swarm exchange-threads)
for stage in "${stages[@]}"; do
    case $stage in
        env) stage_env ;;
        handoff) stage_handoff ;;
        throughput-1b) throughput 1b 260 6 10 10 1b ;;
        throughput-1b-h30) throughput 1b-h30 200 5 30 0 1b ;;
        throughput-350m) throughput 350m 150 5 10 10 350m ;;
        throughput-125m) throughput 125m 120 5 10 10 125m ;;
        gpu-swarm) stage_gpu_swarm ;;
        tests) stage_tests ;;
        agent-round) stage_agent_round ;;
        exchange-threads) stage_exchange_threads ;;
        *) say "unknown stage $stage" ;;
    esac
    cleanup
done
say done
