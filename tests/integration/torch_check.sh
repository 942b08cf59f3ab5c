#!/usr/bin/env bash
# The PyTorch backend end to end: tests/python/torch_ranks.py SCENARIO on 2 namespace hosts x 2
# ranks (bench/cluster), for each scenario; every rank checks its own results and must print
# "torch_ranks: rank R: SCENARIO ok". Skips (77) without root/namespaces, without torch for
# /usr/bin/python3, or when ringd._torch_work was not built.
#   torch_check.sh [SCENARIO...]   (default: ops async ddp groups slots,tensors,refused spawn part
#   die,restart; "part" runs two jobs at once on 4 hosts, each on 2 of them; "spawn" is one
#   process on one host that spawns its ranks; "groups" runs with two slots per host
#   (memory.max_slots: 2), which the groups of each of the host's two processes share)
set -euo pipefail
src=${RINGD_SOURCE_DIR:?}
build=$(dirname "$(dirname "${RINGD_BIN:?}")")
[ "$(id -u)" = 0 ] || { echo "not root: skipped"; exit 77; }
ip netns add "ringd-probe-$$" 2>/dev/null || { echo "network namespaces unavailable: skipped"; exit 77; }
ip netns del "ringd-probe-$$"
/usr/bin/python3 -c "import torch.distributed" 2>/dev/null || { echo "no torch for /usr/bin/python3: skipped"; exit 77; }
ls "$build"/client/python/ringd/_torch_work*.so >/dev/null 2>&1 || { echo "ringd._torch_work not built: skipped"; exit 77; }

# Each item runs its scenarios one after the other in every rank (new processes, the same
# daemons): "die,restart" is a job that loses a rank and is restarted.
scenarios=("$@")
[ ${#scenarios[@]} -gt 0 ] || scenarios=(ops async ddp groups slots,tensors,refused spawn part die,restart)
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
            --job "1,3:2:env $env MASTER_ADDR=10.250.0.2 MASTER_PORT_BASE=$port /usr/bin/python3 $src/tests/python/torch_ranks.py part" \
            --job "0,2:2:env $env MASTER_ADDR=10.250.0.1 MASTER_PORT_BASE=$((port + 1000)) /usr/bin/python3 $src/tests/python/torch_ranks.py part" \
            2>&1) || true
    elif [ "$s" = spawn ]; then
        want=1
        out=$("$src/bench/cluster" --hosts 1 --build "$build" --op-timeout "${op_timeout}s" -- \
            env RANK=0 WORLD_SIZE=1 RINGD_SLOT_BYTES=4194304 RINGD_OP_TIMEOUT_S=$op_timeout RINGD_BUILD_DIR=$build \
            TORCH_RANKS_DEADLINE_S=150 MASTER_PORT_BASE=$port /usr/bin/python3 "$src/tests/python/torch_ranks.py" spawn 2>&1) || true
    else
        want=4
        yaml=()
        [ "$s" != groups ] || yaml=(--yaml "memory: {slot_bytes: 64MiB, max_slots: 2}")
        out=$("$src/bench/cluster" --hosts 2 --ranks-per-host 2 --build "$build" --op-timeout "${op_timeout}s" "${yaml[@]}" -- \
            env $env MASTER_ADDR=10.250.0.1 MASTER_PORT_BASE=$port \
            sh -c "for s in ${s//,/ }; do /usr/bin/python3 $src/tests/python/torch_ranks.py \$s || exit; done" 2>&1) || true
    fi
    bad=""
    for each in ${s//,/ }; do
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
