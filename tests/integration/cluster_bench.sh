#!/usr/bin/env bash
# bench/cluster end to end: ringd-bench on a ring of test hosts, every value checked by each rank.
#   cluster_bench.sh netns          3 namespace hosts x 2 ranks (exit 77 without root/namespaces)
#   cluster_bench.sh netns-ibverbs  the same with transport: ibverbs on the software RDMA device
#   cluster_bench.sh loopback       3 hosts on 127.0.0.1 x 2 ranks
# The verdict is gathered here, never through ringd: each rank of ringd-bench checks its own
# result and prints "# rank G of N: wrong values W, guard bytes damaged D"; bench/cluster prints
# every rank's output; this script needs exactly one such line from each of the N ranks and sums
# them itself. RINGD_BENCH_PRELOAD=LIB runs ringd-bench with LD_PRELOAD=LIB (a sabotage library:
# the script must then fail).
set -euo pipefail
mode=$1
src=${RINGD_SOURCE_DIR:?}
build=$(dirname "$(dirname "${RINGD_BIN:?}")")
args=(--hosts 3 --ranks-per-host 2 --build "$build" --op-timeout 20s)
bench=("$build/bench/ringd-bench")
[ -z "${RINGD_BENCH_PRELOAD:-}" ] || bench=(env "LD_PRELOAD=$RINGD_BENCH_PRELOAD" "${bench[@]}")
# Each mode runs every dtype and every op; the three modes together 18 of the 22 dtype x op pairs
# (avg is not defined for integers).
case "$mode" in
    loopback) pairs="float:sum double:avg half:max bfloat16:min int32:sum int64:max" ;;
    netns) pairs="float:avg double:min half:sum bfloat16:max int32:max int64:min" ;;
    netns-ibverbs) pairs="float:max double:sum half:avg bfloat16:avg int32:min int64:sum" ;;
    *) echo "cluster_bench.sh: unknown mode $mode (loopback, netns, netns-ibverbs)" >&2; exit 2 ;;
esac
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

failed=0
fail() { echo "FAIL: $*" >&2; failed=1; }

# Every one of ranks 0..N-1 printed exactly one verdict line, and they add up to 0 and 0.
check_verdicts() {  # OUTPUT N WHAT
    local summary
    if ! summary=$(awk -v n="$2" '
            /^# rank / {
                if ($0 !~ /^# rank [0-9]+ of [0-9]+: wrong values [0-9]+, guard bytes damaged [0-9]+$/) {
                    print "not a verdict: " $0; bad = 1; next
                }
                split($0, f, /[ :,]+/)  # "#" "rank" G "of" N "wrong" "values" W "guard" "bytes" "damaged" D
                if (f[5] != n) { print "rank " f[3] " counts " f[5] " ranks, not " n; bad = 1 }
                if (f[3] >= n || seen[f[3]]++) { print "rank " f[3] ": unexpected or twice"; bad = 1 }
                wrong += f[8]; guard += f[12]
            }
            END {
                for (g = 0; g < n; ++g) if (!(g in seen)) { print "no verdict from rank " g; bad = 1 }
                printf "verdicts of %d rank(s): wrong values %.0f, guard bytes damaged %.0f\n", length(seen), wrong, guard
                exit bad || wrong || guard
            }' <<<"$1"); then
        fail "$3: $summary"
        return
    fi
    echo "$3: $summary"
}

# Sizes 8 B..2 MiB in steps of 4x: one-shot (<= ~84 KiB at the 2500 Mbit/s link bench/cluster
# gives the cost model; doubling and halving-doubling never win on 3 hosts), two-shot (128 KiB)
# and the ring (512 KiB, 2 MiB; above
# tuning.direct_max_bytes); each host's rank 0 then prints its ringd's status, whose op counts
# show that every algorithm ran.
for pair in $pairs; do
    rc=0
    out=$("$src/bench/cluster" "${args[@]}" -- sh -c \
          '"$@" || exit; [ {rank} != 0 ] || "$0" --socket {socket} status' "$build/client/ringctl" \
          "${bench[@]}" --socket {socket} --group g --local-rank {rank} --local-size {size} \
          -b 8 -e 2M -f 4 -d "${pair%:*}" -o "${pair#*:}" -n 3 -w 1 2>&1) || rc=$?
    echo "$out"
    [ $rc = 0 ] || fail "$pair: bench/cluster exited with $rc"
    grep -q "^# ringd-bench: allreduce, 3 host(s) x 2 local rank(s) = 6 ranks" <<<"$out" || fail "$pair: no ringd-bench header"
    check_verdicts "$out" 6 "$pair"
    algos=$(grep -c "ops by algorithm: ring [1-9][0-9]*, one-shot [1-9][0-9]*, two-shot [1-9][0-9]*, doubling 0, halving-doubling 0$" <<<"$out" || true)
    [ "$algos" = 3 ] || fail "$pair: $algos of 3 hosts ran ring, one-shot and two-shot ops"
done
if [ "$mode" = netns ]; then
    # Rate-limited links (tbf, a bucket of at least 125 KB) and ringd's data streams on the congestion
    # control given: ringd starts (tuning.link_mbit comes from the rate), reports it, and the op is exact.
    rc=0
    out=$("$src/bench/cluster" --hosts 2 --build "$build" --rate 500mbit --congestion reno -- sh -c \
          'tc qdisc show dev eth0 && "$0" --socket {socket} status --json && "$@" --socket {socket} --group r -b 1M -e 1M -n 2 -w 0' \
          "$build/client/ringctl" "${bench[@]}" 2>&1) || rc=$?
    echo "$out"
    [ $rc = 0 ] || fail "rate-limited: bench/cluster exited with $rc"
    grep -Eq "tbf .* rate 500Mbit burst ((12[5-9]|1[3-9][0-9]|[2-9][0-9][0-9])Kb|(12[5-9][0-9]{3}|1[3-9][0-9]{4}|[2-9][0-9]{5}|[0-9]{7,})b)" <<<"$out" ||
        fail "no tbf qdisc"  # tc prints the bucket in Kb or, when not a whole Kb, in bytes
    grep -q '"transport_detail": *"congestion control reno, zero-copy sends"' <<<"$out" || fail "congestion control not reported"
    grep -q "pfifo_fast 10: parent 1:1" <<<"$out" || fail "no pfifo_fast under tbf (the NIC's traffic classes)"
    check_verdicts "$out" 2 "rate-limited"

    # Two jobs at once on the same hosts (bench/cluster --job): their groups' ops interleave on the
    # same ringds and links, one with 2 ranks per host, one with 1; each job's ranks check theirs.
    rc=0
    job() {  # GROUP RANKS
        echo "all:$2:${bench[*]} --socket {socket} --group $1 --local-rank {rank} --local-size {size} -b 8 -e 2M -f 8 -d float -o avg -n 3 -w 1"
    }
    out=$("$src/bench/cluster" --hosts 3 --build "$build" --op-timeout 20s --job "$(job a 2)" --job "$(job b 1)" 2>&1) || rc=$?
    echo "$out"
    [ $rc = 0 ] || fail "two jobs: bench/cluster exited with $rc"
    for k in 0 1; do
        part=$(awk -v k="$k" '/^# bench\/cluster: output of job/ {keep = ($5 == "job" k)} keep' <<<"$out")
        check_verdicts "$part" $((k == 0 ? 6 : 3)) "job $k of two at once"
    done
fi
if [ "$mode" = netns ]; then
    # Every other collective ringd-bench measures (--coll), on one ring: each rank runs them in turn
    # (a line "== COLL" before each) and checks its own results; the verdicts are gathered per
    # collective from every rank's output.
    colls="reduce_scatter allgather broadcast reduce all_to_all"
    rc=0
    out=$("$src/bench/cluster" "${args[@]}" -- sh -c \
          'for c in '"$colls"'; do echo "== $c"; "$@" --coll "$c" --group "$c" || exit; done' sh \
          "${bench[@]}" --socket {socket} --local-rank {rank} --local-size {size} \
          -b 4K -e 1M -f 16 -d float -o sum -n 2 -w 1 2>&1) || rc=$?
    echo "$out"
    [ $rc = 0 ] || fail "collectives: bench/cluster exited with $rc"
    for c in $colls; do
        part=$(awk -v c="$c" '/^# bench\/cluster: output of/ {cur = ""} /^== / {cur = $2} cur == c' <<<"$out")
        grep -q "^# ringd-bench: $c, 3 host(s) x 2 local rank(s) = 6 ranks" <<<"$part" || fail "$c: no ringd-bench header"
        check_verdicts "$part" 6 "$c"
    done
fi
if [ "$mode" = netns-ibverbs ]; then
    # The same config with the hardware provider fails fast here (no RDMA device), saying why.
    if [ ! -d /sys/class/infiniband ] || [ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
        if out=$("$src/bench/cluster" "${args[@]/provider: emulated/provider: hardware}" -- true 2>&1); then
            fail "ringd started with transport: ibverbs on a machine without RDMA devices"
        fi
        grep -m1 "no RDMA device found" <<<"$out" || fail "no 'no RDMA device found' error"
    fi
fi
[ $failed = 0 ] || { echo "cluster_bench.sh $mode: FAILED" >&2; exit 1; }
echo "cluster_bench.sh $mode: every rank of every run reported, no wrong value, no guard byte damaged"
