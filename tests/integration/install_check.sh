#!/usr/bin/env bash
# `meson install` into a temporary DESTDIR, then a C trainer compiled only against what was
# installed (the header, ringd-client.pc, libringd-client.so) allreduces with 2 local ranks
# against the installed ringd, checking every value and the guard bytes around its range.
# Usage: install_check.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=$(cd "${1:?build dir}" && pwd)
SRC=$(cd "${2:?source dir}" && pwd)

TMP=$(mktemp -d /tmp/ringd-test.XXXXXX)
RINGD_PID=
cleanup() {
    if [ -n "$RINGD_PID" ]; then
        kill -KILL "$RINGD_PID" 2>/dev/null || true
        wait "$RINGD_PID" 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
    echo "FAIL: $*" >&2
    exit 1
}

DEST=$TMP/dest
meson install -C "$BUILD" --no-rebuild --destdir "$DEST" >"$TMP/install.log" 2>&1 || {
    cat "$TMP/install.log" >&2
    fail "meson install"
}

# What the README says is installed.
find_one() {
    local f
    f=$(find "$DEST" -path "$1" | head -n 1)
    [ -n "$f" ] || fail "meson install did not install $1"
    echo "$f"
}
RINGD=$(find_one '*/sbin/ringd')
RINGCTL=$(find_one '*/bin/ringctl')
find_one '*/bin/ringd-bench' >/dev/null
HEADER=$(find_one '*/include/ringd/ringd.h')
find_one '*/include/ringd/ringd.hpp' >/dev/null
PC=$(find_one '*/pkgconfig/ringd-client.pc')
LIB=$(find_one '*/libringd-client.so')
find_one '*/lib/systemd/system/ringd.service' >/dev/null
find_one '*/lib/sysusers.d/ringd.conf' >/dev/null
CONF=$(find_one '*/ringd/ringd.yaml')
find_one '*/ringd/ringd.yaml.example' >/dev/null
UNIT=$(find_one '*/lib/systemd/system/ringd.service')
# The unit names the config and the docs where this build put them, whatever the prefix.
unit_conf=$(sed -n 's|^ExecStart=.* --config \([^ ]*\) .*|\1|p' "$UNIT")
[ -f "$DEST$unit_conf" ] || fail "ringd.service reads $unit_conf, which the install did not put there"
unit_doc=$(sed -n 's|^Documentation=file://||p' "$UNIT")
[ -f "$DEST$unit_doc" ] || fail "ringd.service's Documentation= $unit_doc is not installed"
# Installing again keeps the operator's config; the new example goes beside it.
echo "# the operator's edit" >>"$CONF"
meson install -C "$BUILD" --no-rebuild --destdir "$DEST" >"$TMP/install2.log" 2>&1 || fail "meson install (again)"
grep -q "the operator's edit" "$CONF" || fail "installing again replaced the operator's $CONF"
cmp -s "$SRC/config/ringd.yaml" "$(dirname "$CONF")/ringd.yaml.example" || fail "the example was not updated"
echo "installed: $RINGD $HEADER $PC $LIB"
echo "unit: config $unit_conf, docs $unit_doc; a second install kept the edited config"

# Only the installed .pc is visible to pkg-config; its paths are rebased into DEST.
export PKG_CONFIG_LIBDIR=$(dirname "$PC") PKG_CONFIG_PATH= PKG_CONFIG_SYSROOT_DIR=$DEST
CFLAGS=$(pkg-config --cflags ringd-client) || fail "pkg-config --cflags ringd-client"
LIBS=$(pkg-config --libs ringd-client) || fail "pkg-config --libs ringd-client"
echo "pkg-config: $CFLAGS $LIBS"
case " $CFLAGS " in *" -I$DEST/"*) ;; *) fail "pkg-config --cflags does not point into the install: $CFLAGS" ;; esac
case " $LIBS " in *" -L$DEST/"*) ;; *) fail "pkg-config --libs does not point into the install: $LIBS" ;; esac
# shellcheck disable=SC2086  # word splitting of the flags is wanted
cc -std=c11 -Wall -Wextra -Werror $CFLAGS "$SRC/tests/integration/install_trainer.c" $LIBS -o "$TMP/trainer" ||
    fail "the trainer does not build against the installed header and ringd-client.pc"

export LD_LIBRARY_PATH=$(dirname "$LIB")
grep -q "libringd-client.so.* => $DEST/" <<<"$(ldd "$TMP/trainer")" || {
    ldd "$TMP/trainer" >&2
    fail "the trainer does not load the installed libringd-client.so"
}

cat >"$TMP/ringd.yaml" <<YAML
cluster: install-check
hosts:
  - {name: node0, address: 127.0.0.1, port: 7400}
socket: $TMP/ringd.sock
memory: {slot_bytes: 4MiB, max_slots: 4}
timeouts: {op: 5s}
YAML
"$RINGD" --config "$TMP/ringd.yaml" --host node0 >"$TMP/ringd.log" 2>&1 &
RINGD_PID=$!
ready=
for _ in $(seq 200); do  # up to 10 s: the installed ringctl answers once ringd listens
    if "$RINGCTL" --socket "$TMP/ringd.sock" status >/dev/null 2>&1; then
        ready=1
        break
    fi
    kill -0 "$RINGD_PID" 2>/dev/null || break
    sleep 0.05
done
[ -n "$ready" ] || {
    cat "$TMP/ringd.log" >&2
    fail "the installed ringd did not start"
}

timeout 60 "$TMP/trainer" "$TMP/ringd.sock" || {
    cat "$TMP/ringd.log" >&2
    fail "the installed trainer's allreduce"
}
completed=$("$RINGCTL" --socket "$TMP/ringd.sock" status --json |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["ops"]["completed"])')
[ "$completed" = 2 ] || fail "ringd counted $completed completed ops, not 2"
echo "PASS: a C trainer built against the install allreduced with 2 local ranks"

# The Python package, installed into the system Python's tree under DEST: it loads the installed
# library (found through RINGD_CLIENT_LIBRARY, as the README says) and allreduces with 2 ranks.
PKG=$(find "$DEST" -path '*/ringd/__init__.py' | head -n 1)
[ -n "$PKG" ] || fail "meson install did not install the Python package ringd"
for f in "$SRC"/client/python/ringd/*.py; do  # every module of the package (ringd.torch imports _compat)
    [ -f "$(dirname "$PKG")/$(basename "$f")" ] || fail "meson install did not install ringd/$(basename "$f")"
done
if ls "$BUILD"/client/python/ringd/_torch_work*.so >/dev/null 2>&1; then  # built: then installed too
    ls "$(dirname "$PKG")"/_torch_work*.so >/dev/null 2>&1 || fail "meson install did not install ringd._torch_work"
fi
SITE=$(dirname "$(dirname "$PKG")")
py_rank() {
    PYTHONPATH=$SITE RINGD_CLIENT_LIBRARY=$LIB /usr/bin/python3 -c "
import ringd, struct, sys
assert ringd.library_path() == '$LIB', ringd.library_path()
c = ringd.Client('py', int(sys.argv[1]), 2, 1 << 16, socket='$TMP/ringd.sock')
c.slot[64:64 + 16] = struct.pack('4f', *[float(int(sys.argv[1]) + k) for k in range(4)])
c.allreduce(64, 4, 'float32', 'sum', 10000)
got = struct.unpack('4f', bytes(c.slot[64:64 + 16]))
assert got == (1.0, 3.0, 5.0, 7.0), got
assert bytes(c.slot[:64]) == bytes(64) and bytes(c.slot[80:144]) == bytes(64), 'bytes around the op changed'
print('python rank', sys.argv[1], 'ok', ringd.status('$TMP/ringd.sock')['ring']['size'], 'host')
" "$1"
}
py_rank 0 & p0=$!
py_rank 1 || fail "the installed Python package's allreduce (rank 1)"
wait $p0 || fail "the installed Python package's allreduce (rank 0)"
echo "PASS: the installed Python package allreduced with 2 local ranks"
