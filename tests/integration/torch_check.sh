#!/usr/bin/env bash
# The PyTorch backend end to end: tests/python/torch_ranks.py SCENARIO on 2 namespace hosts x 2
# ranks (bench/cluster), for each scenario; every rank checks its own results and must print
# "torch_ranks: rank R: SCENARIO ok". Skips (77) without root/namespaces, without torch for the
# Python it runs, or (torch 1.13) when ringd._torch_work was not built.
#   torch_check.sh [--python PYTHON] [SCENARIO...]
# PYTHON: /usr/bin/python3 (Debian's torch 1.13) by default, or the project's venv (torch 2.13).
# Default scenarios on 1.13: ops+async+ddp+tensors+collectives+rooted+a2a+wire groups slots,refused spawn part
# die,restart; on torch 2 what differs there (the Work, futures and errors, the process-group
# contract, sharded training): ops+async+ddp+tensors+collectives+rooted+a2a+contract+sharded+wire die,restart. "a+b" runs a and b in
# one process per rank (one torch import), "a,b" one after the other in new processes on the
# same daemons; "part" runs two jobs at once on 4 hosts, each on 2 of them; "spawn" is one process
# on one host that spawns its ranks; "groups" runs with two slots per host (memory.max_slots: 2),
# which the groups of each of the host's two processes share.
set -euo pipefail
py=/usr/bin/python3
if [ "${1:-}" = --python ]; then py=$2; shift 2; fi
src=${RINGD_SOURCE_DIR:?}
build=$(dirname "$(dirname "${RINGD_BIN:?}")")
[ "$(id -u)" = 0 ] || { echo "not root: skipped"; exit 77; }
ip netns add "ringd-probe-$$" 2>/dev/null || { echo "network namespaces unavailable: skipped"; exit 77; }
ip netns del "ringd-probe-$$"
[ -x "$py" ] || { echo "no $py (./dev build makes the project's venv): skipped"; exit 77; }
version=$("$py" -c "import torch.distributed, torch; print(torch.__version__)" 2>/dev/null) ||
    { echo "no torch for $py: skipped"; exit 77; }
if [ "${version%%.*}" -lt 2 ]; then
    ls "$build"/client/python/ringd/_torch_work*.so >/dev/null 2>&1 || { echo "ringd._torch_work not built: skipped"; exit 77; }
fi
echo "torch $version ($py)"

# Each item runs its scenarios one after the other in every rank (new processes, the same
# daemons): "die,restart" is a job that loses a rank and is restarted.
scenarios=("$@")
if [ ${#scenarios[@]} -eq 0 ]; then
    if [ "${version%%.*}" -lt 2 ]; then
        scenarios=(ops+async+ddp+tensors+collectives+rooted+a2a+wire groups slots,refused spawn part die,restart)
    else
        scenarios=(ops+async+ddp+tensors+collectives+rooted+a2a+contract+sharded+wire die,restart)
    fi
fi
op_timeout=5
failed=0
for s in "${scenarios[@]}"; do
    start=$(date +%s)
    # A fresh port per scenario: a store of the one before may still be closing.
    port=$((29500 + RANDOM % 2000 * 2))
    env="RANK={grank} WORLD_SIZE={world} LOCAL_RANK={rank} LOCAL_WORLD_SIZE={size} GLOO_SOCKET_IFNAME=eth0"
    env+=" RINGD_SLOT_BYTES=4194304 RINGD_OP_TIMEOUT_S=$op_timeout RINGD_BUILD_DIR=$build TORCH_RANKS_DEADLINE_S=150"
    if [ "$s" = part ]; then
        # Two jobs at once on 4 hosts, each on 2 of them (2 ranks per host): 8 ranks say ok.
        want=8
        out=$("$src/bench/cluster" --hosts 4 --build "$build" --op-timeout "${op_timeout}s" \
            --job "1,3:2:env $env MASTER_ADDR=10.250.0.2 MASTER_PORT_BASE=$port $py $src/tests/python/torch_ranks.py part" \
            --job "0,2:2:env $env MASTER_ADDR=10.250.0.1 MASTER_PORT_BASE=$((port + 1000)) $py $src/tests/python/torch_ranks.py part" \
            2>&1) || true
    elif [ "$s" = spawn ]; then
        want=1
        out=$("$src/bench/cluster" --hosts 1 --build "$build" --op-timeout "${op_timeout}s" -- \
            env RANK=0 WORLD_SIZE=1 RINGD_SLOT_BYTES=4194304 RINGD_OP_TIMEOUT_S=$op_timeout RINGD_BUILD_DIR=$build \
            TORCH_RANKS_DEADLINE_S=150 MASTER_PORT_BASE=$port "$py" "$src/tests/python/torch_ranks.py" spawn 2>&1) || true
    else
        want=4
        yaml=()
        [ "$s" != groups ] || yaml=(--yaml "memory: {slot_bytes: 64MiB, max_slots: 2}")
        out=$("$src/bench/cluster" --hosts 2 --ranks-per-host 2 --build "$build" --op-timeout "${op_timeout}s" "${yaml[@]}" -- \
            env $env MASTER_ADDR=10.250.0.1 MASTER_PORT_BASE=$port \
            sh -c "for s in ${s//,/ }; do $py $src/tests/python/torch_ranks.py \$s || exit; done" 2>&1) || true
    fi
    bad=""
    for each in ${s//[,+]/ }; do
        oks=$(grep -c "^torch_ranks: rank [0-9]: $each ok" <<<"$out" || true)
        [ "$oks" = "$want" ] || bad+=" $each: $oks of $want ranks ok;"
    done
    if [ -n "$bad" ]; then
        printf '%s\n' "$out" | grep -v -i "warning" | tail -60
        echo "FAIL:$bad" >&2
        failed=1
    else
        grep "^torch_ranks: rank 0: \(losses\|after\)" <<<"$out" || true
        echo "ok: $s ($(($(date +%s) - start)) s)"
    fi
done
exit $failed
