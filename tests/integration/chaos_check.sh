#!/usr/bin/env bash
# The chaos test: bench/chaos on 3 namespace hosts x 2 ranks, with a second job on hosts 0 and 2 only
# (a group over part of the ring, in its own ring domain), random faults (ringd killed and restarted,
# stopped, a trainer killed, a link down or slowed) while both jobs loop and restart; then a quiet
# phase in which both must run clean. 60 s of faults with the full matrix (RINGD_TEST_MATRIX=full:
# .ci/run's plain suite), 20 s otherwise (./dev test, the sanitizer suites). Needs root (namespaces);
# bench/chaos exits 77 without.
#   chaos_check.sh BUILD_DIR LOG_DIR
set -euo pipefail
duration=20
[ "${RINGD_TEST_MATRIX:-}" = full ] && duration=60
exec "${RINGD_SOURCE_DIR:?}/bench/chaos" --hosts 3 --ranks-per-host 2 --part-job 0,2:1 --duration "$duration" \
    --build "$1" --logs "$2"
