#!/usr/bin/env bash
# ringd's log in a real journal: a private systemd-journald (its sockets and files on tmpfs in a
# mount namespace of this test, so the machine's journal, if any, is untouched), a ringd with
# log.journal: on, and a storm of one error (40 ops whose two local ranks disagree on the count).
# Checks, in `journalctl -o json`: the fields (PRIORITY, SYSLOG_IDENTIFIER, RINGD_HOST,
# RINGD_CLUSTER, RINGD_GROUP, RINGD_OP, RINGD_KIND), that the storm was rate-limited (5 lines, then
# one with RINGD_REPEATS=35 once its 10 s window ended), and that `ringctl status` counts the
# kind 40 times in recent_errors. Before journald starts: log.journal: on without a journal logs
# to stderr (and says so) instead of losing every line. Skips (77) without root, unshare or
# systemd-journald.
set -euo pipefail
src=${RINGD_SOURCE_DIR:?}
ringd=${RINGD_BIN:?}
ringctl=${RINGCTL_BIN:?}
journald=/lib/systemd/systemd-journald
[ "$(id -u)" = 0 ] || { echo "not root: skipped"; exit 77; }
[ -x "$journald" ] || { echo "no systemd-journald: skipped"; exit 77; }
command -v journalctl >/dev/null || { echo "no journalctl: skipped"; exit 77; }
if [ "${1:-}" != --inside ]; then
    unshare -m --propagation private true 2>/dev/null || { echo "mount namespaces unavailable: skipped"; exit 77; }
    exec unshare -m --propagation private "$0" --inside
fi

work=$(mktemp -d /tmp/ringd-journal.XXXXXX)
jpid="" rpid=""
cleanup() {
    [ -z "$rpid" ] || kill "$rpid" 2>/dev/null || true
    [ -z "$jpid" ] || kill "$jpid" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
mkdir -p /run/systemd /run/log
mount -t tmpfs tmpfs /run/systemd
mount -t tmpfs tmpfs /run/log
mkdir -p /run/systemd/journal

# start_ringd NAME: a ringd with log.journal: on, its config, socket and stderr named NAME in
# $work; rpid is its pid once its socket is there.
start_ringd() {
    cat >"$work/$1.yaml" <<EOF
cluster: journaled
hosts:
  - {name: a, address: 127.0.0.1, port: 7400}
socket: $work/$1.sock
memory: {slot_bytes: 1MiB, max_slots: 4}
log: {level: info, journal: on}
EOF
    "$ringd" --config "$work/$1.yaml" --host a >"$work/$1.stderr" 2>&1 &
    rpid=$!
    for _ in $(seq 100); do [ -S "$work/$1.sock" ] && break; sleep 0.05; done
    [ -S "$work/$1.sock" ] || { echo "FAIL: ringd did not start"; cat "$work/$1.stderr"; exit 1; }
}

# First no journal at all: log.journal: on must not lose ringd's lines (they go to stderr, after
# one warning saying why).
start_ringd nojournal
"$ringctl" --socket "$work/nojournal.sock" status >/dev/null
kill "$rpid"; wait "$rpid" 2>/dev/null || true; rpid=""
grep -q "log.journal is on, but no journal listens at /run/systemd/journal/socket: logging to stderr" "$work/nojournal.stderr" ||
    { echo "FAIL: no warning that the journal is missing"; cat "$work/nojournal.stderr"; exit 1; }
grep -q "listening on" "$work/nojournal.stderr" ||
    { echo "FAIL: without a journal, ringd's lines were lost"; cat "$work/nojournal.stderr"; exit 1; }
echo "PASS  without a journal: the warning and ringd's lines on stderr"

"$journald" >"$work/journald.log" 2>&1 &
jpid=$!
for _ in $(seq 100); do [ -S /run/systemd/journal/socket ] && break; sleep 0.05; done
[ -S /run/systemd/journal/socket ] || { echo "FAIL: systemd-journald did not start"; cat "$work/journald.log"; exit 1; }

start_ringd ringd

# The storm: op k of group "storm" is 16 floats on local rank 0 and 17 on local rank 1.
"${RINGD_STORM_BIN:?}" "$work/ringd.sock" 40
# The repeat window (10 s) ends, ringd's timer writes the count; then the log is read.
sleep 11
"$ringctl" --socket "$work/ringd.sock" status --json >"$work/status.json"
journalctl -D /run/log/journal -o json --no-pager SYSLOG_IDENTIFIER=ringd >"$work/journal.json"
/usr/bin/python3 - "$work/journal.json" "$work/status.json" <<'PY'
import json, sys
entries = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
status = json.load(open(sys.argv[2]))
failed = []
def check(ok, what):
    print(("PASS  " if ok else "FAIL  ") + what)
    if not ok:
        failed.append(what)
check(len(entries) > 0, f"ringd wrote {len(entries)} entries to the journal")
check(all(e.get("RINGD_HOST") == "a" and e.get("RINGD_CLUSTER") == "journaled" and "RINGD_KIND" in e for e in entries),
      "every entry has RINGD_HOST=a, RINGD_CLUSTER=journaled and RINGD_KIND")
check(any(e["PRIORITY"] == "6" and "listening on" in e["MESSAGE"] for e in entries), "the start line at PRIORITY 6 (info)")
storm = [e for e in entries if "mismatch" in e["MESSAGE"] and "RINGD_REPEATS" not in e]
check(len(storm) == 5, f"the storm's first 5 lines and no more ({len(storm)})")
check(all(e["PRIORITY"] == "4" and e.get("RINGD_GROUP") == "storm" and e.get("RINGD_OP", "").isdigit() for e in storm),
      "each at PRIORITY 4 (warning) with RINGD_GROUP=storm and RINGD_OP")
check(sorted(int(e["RINGD_OP"]) for e in storm) == [1, 2, 3, 4, 5], "RINGD_OP 1..5 (the ops' seqs)")
check(len({e["RINGD_KIND"] for e in storm}) == 1, "one RINGD_KIND for all of them")
rep = [e for e in entries if "RINGD_REPEATS" in e]
check(len(rep) == 1 and rep[0]["RINGD_REPEATS"] == "35", f"one line counts the 35 left out: {[e.get('RINGD_REPEATS') for e in rep]}")
check(len(rep) == 1 and "op 40" in rep[0]["MESSAGE"] and rep[0].get("RINGD_GROUP") == "storm",
      "it shows the last of them (op 40) with its group")
kinds = [e for e in status["recent_errors"] if "mismatch" in e["message"]]
check(len(kinds) == 1 and kinds[0]["count"] == 40, f"ringctl status: one recent_errors entry of the kind, count 40 ({kinds})")
if failed:
    for e in entries[-20:]:
        print("  ", {k: v for k, v in e.items() if not k.startswith("_") and not k.startswith("__")})
    sys.exit(f"journal_check: {len(failed)} check(s) failed")
PY
