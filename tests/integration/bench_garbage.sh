#!/usr/bin/env bash
# ringd-bench grades itself outside ringd: a library preloaded into it that damages the slot after
# every successful op (as a ringd that "succeeds" with garbage would) must make every rank report
# it in its verdict line and exit non-zero; without it, every rank reports 0 and 0.
#   bench_garbage.sh PRELOAD   PRELOAD: the sabotage library (tests/support/zero_results_preload.cpp)
# One ringd (bench/cluster --loopback --hosts 1, its config in a temp dir it removes) and 2 local
# ranks per run.
set -euo pipefail
preload=${1:?usage: bench_garbage.sh PRELOAD}
src=${RINGD_SOURCE_DIR:?}
build=$(dirname "$(dirname "${RINGD_BIN:?}")")
failed=0
fail() { echo "FAIL: $*" >&2; failed=1; }

# run SABOTAGE: ringd-bench on 1 host x 2 ranks, float sum 4 B..64 KiB; sets out and rc.
run() {
    local env=()
    [ "$1" = none ] || env=(env "LD_PRELOAD=$preload" "RINGD_SABOTAGE=$1")
    rc=0
    out=$("$src/bench/cluster" --loopback --hosts 1 --ranks-per-host 2 --build "$build" --op-timeout 10s -- \
          "${env[@]}" "$build/bench/ringd-bench" --socket {socket} --group g --local-rank {rank} --local-size {size} \
          -b 4 -e 64K -f 16 -d float -o sum -n 2 -w 1 2>&1) || rc=$?
    echo "== sabotage: $1 (exit $rc)"
    echo "$out"
}

# verdict G WRONG GUARD: rank G's verdict line, with WRONG and GUARD each "0" or "+" (non-zero).
verdict() {
    local line w d
    line=$(grep -E "^# rank $1 of 2: wrong values [0-9]+, guard bytes damaged [0-9]+$" <<<"$out" || true)
    [ "$(grep -c . <<<"$line")" = 1 ] || { fail "$sabotage: rank $1 printed $(grep -c . <<<"$line") verdict lines"; return; }
    w=$(sed -E 's/.*wrong values ([0-9]+),.*/\1/' <<<"$line")
    d=$(sed -E 's/.*damaged ([0-9]+)$/\1/' <<<"$line")
    case "$2" in 0) [ "$w" = 0 ] ;; +) [ "$w" != 0 ] ;; esac || fail "$sabotage: rank $1: wrong values $w, expected ${2/+/some}"
    case "$3" in 0) [ "$d" = 0 ] ;; +) [ "$d" != 0 ] ;; esac || fail "$sabotage: rank $1: guard bytes damaged $d, expected ${3/+/some}"
}

# Both ranks failed, each on its own count (bench/cluster's exit status is a rank's).
both_failed() {
    [ "$rc" != 0 ] || fail "$sabotage: bench/cluster exited with 0"
    grep -q "^bench/cluster: host0 rank 0 exited with 1$" <<<"$out" || fail "$sabotage: rank 0 did not exit with 1"
    grep -q "^# bench/cluster: output of host0 rank 1 (exit 1)$" <<<"$out" || fail "$sabotage: rank 1 did not exit with 1"
}

sabotage=none
run none
[ "$rc" = 0 ] || fail "clean run: bench/cluster exited with $rc"
verdict 0 0 0
verdict 1 0 0

sabotage=zero  # every result zeroed: wrong values, the guards intact
run zero
both_failed
verdict 0 + 0
verdict 1 + 0

sabotage=past  # 8 bytes past every op's range: the values right, the guard after damaged
run past
both_failed
verdict 0 0 +
verdict 1 0 +

sabotage=before  # 8 bytes before every op's range: the guard before damaged
run before
both_failed
verdict 0 0 +
verdict 1 0 +

[ $failed = 0 ] || { echo "bench_garbage.sh: FAILED" >&2; exit 1; }
echo "bench_garbage.sh: every sabotage was reported by both ranks, and the clean run by none"
