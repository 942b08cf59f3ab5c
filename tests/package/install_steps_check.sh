#!/usr/bin/env bash
# Runs the README's "Installing as a service" steps as written on two namespace hosts (node0,
# node1: a network namespace each, and a mount and UTS namespace each so that every host has its
# own /etc/ringd, /run/ringd, /var/lib/ringd and host name), from the packages `./dev package`
# left in build-deb/. What cannot run here as written is said so and done the way it does it:
# `scp`/`ssh` to node1 is a copy into node1's /etc/ringd, and `systemctl enable --now ringd` (no
# systemd as PID 1 here) is the unit's ExecStart as its User=/Group= with its RuntimeDirectory= and
# StateDirectory=. Prints every command's output; exits non-zero at the first step that fails.
# Leaves nothing behind: the packages purged, the namespaces and temp dirs removed.
#
# Usage (root): tests/package/install_steps_check.sh [BUILD_DEB_DIR]
set -euo pipefail
DEBS=$(realpath "${1:-$(dirname "$0")/../../build-deb}")
PACKAGES=(ringd libringd-client0 libringd-client-dev python3-ringd)
TAG=ringd-steps-$$
TMP=$(mktemp -d /tmp/ringd-steps.XXXXXX)
chmod 0755 "$TMP"
PIDS=()

fail() { echo "FAIL: $*" >&2; exit 1; }
step() { printf '\n== %s\n' "$*"; }
[ "$(id -u)" = 0 ] || fail "run as root"
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -q installed && fail "$p is installed here already"
done

cleanup() {
    set +e
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    for i in 0 1; do ip netns pids "$TAG-$i" 2>/dev/null | xargs -r kill -9; ip netns del "$TAG-$i" 2>/dev/null; done
    ip netns del "$TAG-sw" 2>/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${PACKAGES[@]}" >/dev/null 2>&1
    getent passwd ringd >/dev/null && userdel ringd
    getent group ringd >/dev/null && groupdel ringd
    rm -rf "$TMP" /run/ringd /var/lib/ringd
}
trap cleanup EXIT

# Two hosts on a bridge, addresses only inside them.
ip netns add "$TAG-sw"
ip -n "$TAG-sw" link add br0 type bridge
ip -n "$TAG-sw" link set br0 up
for i in 0 1; do
    ip netns add "$TAG-$i"
    ip link add "rs$$h$i" type veth peer name "rs$$s$i"
    ip link set "rs$$h$i" netns "$TAG-$i" name eth0
    ip link set "rs$$s$i" netns "$TAG-sw"
    ip -n "$TAG-sw" link set "rs$$s$i" master br0 up
    ip -n "$TAG-$i" addr add "10.252.$(($$ % 250)).$((i + 1))/24" dev eth0
    ip -n "$TAG-$i" link set eth0 up
    ip -n "$TAG-$i" link set lo up
    mkdir -p "$TMP/node$i/etc" "$TMP/node$i/run" "$TMP/node$i/lib"
done
addr() { echo "10.252.$(($$ % 250)).$(($1 + 1))"; }

# on HOST COMMAND: runs COMMAND (bash) as root on node HOST: its network namespace, its own
# /etc/ringd, /run/ringd, /var/lib/ringd and host name.
on() {
    local i=$1
    shift
    ip netns exec "$TAG-$i" unshare -mu bash -c "
        set -euo pipefail
        hostname node$i
        mount --bind $TMP/node$i/etc /etc/ringd
        mount --bind $TMP/node$i/run /run/ringd
        mount --bind $TMP/node$i/lib /var/lib/ringd
        $*"
}

step "1. apt-get install ./ringd_*.deb ./libringd-client0_*.deb ./libringd-client-dev_*.deb ./python3-ringd_*.deb"
(cd "$DEBS" && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ./ringd_*.deb ./libringd-client0_*.deb \
    ./libringd-client-dev_*.deb ./python3-ringd_*.deb >"$TMP/install.log" 2>&1) || { cat "$TMP/install.log"; fail "install"; }
echo "installed: $(dpkg-query -W -f='${binary:Package} ${Version}\n' "${PACKAGES[@]}" | tr '\n' ' ')"
mkdir -p /run/ringd /var/lib/ringd
for i in 0 1; do cp -a /etc/ringd/. "$TMP/node$i/etc/"; done  # what the package put in /etc/ringd, per host

step "2. the ring's config, on every host (the README's, with these hosts' addresses)"
for i in 0 1; do
    on $i "cat >/etc/ringd/ringd.yaml <<'YAML'
cluster: prod
hosts:
  - {name: node0, address: $(addr 0), port: 7400}
  - {name: node1, address: $(addr 1), port: 7400}
auth:
  secret_file: /etc/ringd/secret
YAML
cat /etc/ringd/ringd.yaml | sed 's/^/  node$i: /'"
done

step "3. the secret, made once on node0 and copied to node1 (scp/ssh here: a copy into node1's /etc/ringd)"
on 0 "(umask 027 && openssl rand -hex 32 > /etc/ringd/secret) && chown root:ringd /etc/ringd/secret && ls -l /etc/ringd/secret"
cp -p "$TMP/node0/etc/secret" "$TMP/node1/etc/secret"
on 1 "chown root:ringd /etc/ringd/secret && ls -l /etc/ringd/secret"
cmp "$TMP/node0/etc/secret" "$TMP/node1/etc/secret" || fail "the hosts' secrets differ"

step "4. systemctl enable --now ringd (here: the unit's ExecStart as User=ringd, Group=ringd, with its RuntimeDirectory and StateDirectory)"
UNIT=/lib/systemd/system/ringd.service
exec_start=$(sed -n 's/^ExecStart=//p' "$UNIT")
echo "  $UNIT: ExecStart=$exec_start"
for i in 0 1; do
    cmd=${exec_start//%H/node$i}
    on $i "install -d -o ringd -g ringd -m 0750 /run/ringd /var/lib/ringd
           RUNTIME_DIRECTORY=/run/ringd STATE_DIRECTORY=/var/lib/ringd exec setpriv --reuid ringd --regid ringd --init-groups $cmd" \
        >"$TMP/ringd-node$i.log" 2>&1 &
    PIDS+=($!)
done
for i in 0 1; do
    for _ in $(seq 100); do
        on $i "ringctl status --json 2>/dev/null" | grep -q '"state": "up"' && break
        sleep 0.1
    done
done

step "5. ringctl status on node0"
on 0 "ringctl status" | tee "$TMP/status.txt" | sed -n '1,12p'
grep -q "ring: up" "$TMP/status.txt" || { cat "$TMP"/ringd-node*.log; fail "the ring is not up on node0"; }
step "5. ringd-bench --group check -b 1M -e 1M -n 3, on node0 and node1 at once"
on 1 "ringd-bench --group check -b 1M -e 1M -n 3" >"$TMP/bench1.log" 2>&1 &
b1=$!
on 0 "ringd-bench --group check -b 1M -e 1M -n 3" | tee "$TMP/bench0.log"
wait $b1 || { cat "$TMP/bench1.log"; fail "ringd-bench on node1"; }
grep '^# rank' "$TMP/bench1.log"
grep -q "wrong values 0" "$TMP/bench0.log" && grep -q "wrong values 0" "$TMP/bench1.log" || fail "ringd-bench's values"
echo
echo "PASS: the README's install steps on two namespace hosts"
