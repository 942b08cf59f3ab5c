#!/usr/bin/env bash
# bench/cluster end to end: ringd-bench on a ring of test hosts, every value checked.
#   cluster_bench.sh netns          3 namespace hosts x 2 ranks (exit 77 without root/namespaces)
#   cluster_bench.sh netns-ibverbs  the same with transport: ibverbs on the software RDMA device
#   cluster_bench.sh loopback       3 hosts on 127.0.0.1 x 2 ranks
set -euo pipefail
mode=$1
src=${RINGD_SOURCE_DIR:?}
build=$(dirname "$(dirname "${RINGD_BIN:?}")")
args=(--hosts 3 --ranks-per-host 2 --build "$build" --op-timeout 20s)
if [ "$mode" = netns-ibverbs ]; then
    args+=(--yaml $'transport: ibverbs\nibverbs: {provider: emulated}')
fi
if [ "$mode" != loopback ]; then
    [ "$(id -u)" = 0 ] || { echo "not root: skipped"; exit 77; }
    ip netns add "ringd-probe-$$" 2>/dev/null || { echo "network namespaces unavailable: skipped"; exit 77; }
    ip netns del "ringd-probe-$$"
else
    args+=(--loopback)
fi
# Several dtype x op pairs, sizes from 1 element to 4 MiB; ringd-bench checks every value.
for pair in float:sum half:max bfloat16:avg int64:min double:avg; do
    out=$("$src/bench/cluster" "${args[@]}" -- "$build/bench/ringd-bench" --socket {socket} --group g \
          --local-rank {rank} --local-size {size} -b 8 -e 4M -f 16 -d "${pair%:*}" -o "${pair#*:}" -n 3 -w 1 2>&1)
    echo "$out"
    grep -q "^# ringd-bench: 3 host(s) x 2 local rank(s) = 6 ranks" <<<"$out"
    grep -q "^# Wrong values : 0$" <<<"$out"
done
if [ "$mode" = netns ]; then
    # Rate-limited links (tbf, a bucket of at least 125 KB) and ringd's data streams on the congestion
    # control given: ringd starts (tuning.link_mbit comes from the rate), reports it, and the op is exact.
    out=$("$src/bench/cluster" --hosts 2 --build "$build" --rate 500mbit --congestion reno -- sh -c \
          'tc qdisc show dev eth0 && "$0" --socket {socket} status --json && "$1" --socket {socket} --group r -b 1M -e 1M -n 2 -w 0' \
          "$build/client/ringctl" "$build/bench/ringd-bench" 2>&1)
    echo "$out"
    grep -Eq "tbf .* rate 500Mbit burst (12[5-9]|1[3-9][0-9]|[2-9][0-9][0-9])Kb" <<<"$out"
    grep -q '"transport_detail": *"congestion control reno"' <<<"$out"
    grep -q "^# Wrong values : 0$" <<<"$out"
fi
if [ "$mode" = netns-ibverbs ]; then
    # The same config with the hardware provider fails fast here (no RDMA device), saying why.
    if [ ! -d /sys/class/infiniband ] || [ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
        if out=$("$src/bench/cluster" "${args[@]/provider: emulated/provider: hardware}" -- true 2>&1); then
            echo "ringd started with transport: ibverbs on a machine without RDMA devices" >&2
            exit 1
        fi
        echo "$out" | grep -m1 "no RDMA device found"
    fi
fi
