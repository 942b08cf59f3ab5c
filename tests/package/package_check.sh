#!/usr/bin/env bash
# Installs ringd's four Debian packages on this machine, runs ringd the way the installed unit
# would, a C trainer built against the installed headers, the Python package and ringd.torch
# against it, upgrades, removes and purges them, and checks what each step leaves. Run by
# `./dev package` (docs/operations.md, "Debian packages").
#
# Usage (root): package_check.sh ringd_V_A.deb libringd-client0_V_A.deb libringd-client-dev_V_A.deb python3-ringd_V_A.deb
#
# systemd is not PID 1 here, so the unit is applied by hand: ExecStart= (%H = the host name),
# User=, Group= (with the user's supplementary groups), CapabilityBoundingSet=, AmbientCapabilities=,
# NoNewPrivileges=, LimitMEMLOCK=, LimitNOFILE=, RuntimeDirectory= and StateDirectory= (with their
# modes and $RUNTIME_DIRECTORY / $STATE_DIRECTORY), Type=notify (a NOTIFY_SOCKET that must get
# READY=1 and STOPPING=1), WatchdogSec= (WATCHDOG_USEC; a WATCHDOG=1 must come), KillSignal= and
# TimeoutStopSec=. The file-system, device and address-family sandboxing lines only take away and
# are not applied; any other directive in [Service] fails the test until it is taught here.
#
# It refuses to run where any of the packages is known to dpkg or any file they hold (or /run/ringd,
# /var/lib/ringd) exists, and leaves the machine as it found it, also on failure: packages purged
# (with any dependency apt pulled in), the user and group ringd removed if it made them, temp files
# gone. Every wait has a deadline.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/../.." && pwd)
PACKAGES=(ringd libringd-client0 libringd-client-dev python3-ringd)
export DEBIAN_FRONTEND=noninteractive
PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH

fail() {
    echo "FAIL: $*" >&2
    exit 1
}
ok() { echo "ok: $*"; }

[ "$(id -u)" = 0 ] || fail "package_check.sh installs packages: run it as root"
[ $# -eq ${#PACKAGES[@]} ] || fail "usage: $0 ${PACKAGES[*]/%/.deb}"
declare -A DEB
for d in "$@"; do
    [ -f "$d" ] || fail "$d: no such file"
    DEB[$(dpkg-deb -f "$d" Package)]=$(realpath "$d")
done
for p in "${PACKAGES[@]}"; do [ -n "${DEB[$p]:-}" ] || fail "no $p package among $*"; done

# dpkg's state of a package: installed, config-files, not-installed (also for one dpkg never knew).
pkg_state() { dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || echo not-installed; }

# Every non-directory path the packages hold, as installed (./usr/bin/x -> /usr/bin/x).
SHIPPED=()
for p in "${PACKAGES[@]}"; do
    while read -r f; do SHIPPED+=("$f"); done < <(dpkg-deb --fsys-tarfile "${DEB[$p]}" | tar -t | grep -v '/$' | sed 's|^\.||')
done

# ---- refuse to touch a machine where ringd is installed in any form ----
for p in "${PACKAGES[@]}"; do
    [ "$(pkg_state "$p")" = not-installed ] || fail "$p is $(pkg_state "$p") here: this test installs and purges it, so it runs only where it is not"
done
for f in "${SHIPPED[@]}" /etc/ringd /run/ringd /var/lib/ringd; do
    if [ -e "$f" ] || [ -L "$f" ]; then
        fail "$f exists (a ringd installed another way?): this test would replace and then remove it"
    fi
done

USER_EXISTED=0 GROUP_EXISTED=0
getent passwd ringd >/dev/null && USER_EXISTED=1
getent group ringd >/dev/null && GROUP_EXISTED=1
# Files named like ours that are here before (a build tree's are not looked at): the purge is
# checked against these.
OURS_BEFORE=$(find /usr /etc /var/lib /lib -xdev \( -name 'ringd*' -o -name 'libringd*' -o -name 'ringctl*' \) 2>/dev/null | sort)
BEFORE=$(dpkg-query -W -f='${db:Status-Status} ${binary:Package}\n' | awk '$1 == "installed" {print $2}' | sort)

TMP=$(mktemp -d /tmp/ringd-pkgcheck.XXXXXX)
chmod 0711 "$TMP"  # ringd's user and the trainers' reach their files here
RINGD_PID="" PULLED=() CHILDREN=()
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    [ -n "$RINGD_PID" ] && kill -KILL "$RINGD_PID" 2>/dev/null && wait "$RINGD_PID" 2>/dev/null
    for c in "${CHILDREN[@]}"; do kill -KILL "$c" 2>/dev/null && wait "$c" 2>/dev/null; done
    [ -n "${NOTIFY_PID:-}" ] && kill "$NOTIFY_PID" 2>/dev/null
    local left=()
    for p in "${PACKAGES[@]}"; do [ "$(pkg_state "$p")" = not-installed ] || left+=("$p"); done
    if [ ${#left[@]} -gt 0 ]; then
        echo "cleanup: purging ${left[*]}"
        timeout 300 dpkg --purge "${left[@]}" >"$TMP/cleanup-purge.log" 2>&1 || cat "$TMP/cleanup-purge.log" >&2
    fi
    if [ ${#PULLED[@]} -gt 0 ]; then
        echo "cleanup: purging what apt installed for them: ${PULLED[*]}"
        timeout 300 apt-get purge -y -qq "${PULLED[@]}" >/dev/null 2>&1 || echo "cleanup: could not purge ${PULLED[*]}" >&2
    fi
    rm -rf /run/ringd /var/lib/ringd  # both absent before the test (checked above)
    if [ $USER_EXISTED = 0 ] && getent passwd ringd >/dev/null; then
        echo "cleanup: removing the system user ringd (the purge leaves it, as Debian does)"
        userdel ringd
    fi
    if [ $GROUP_EXISTED = 0 ] && getent group ringd >/dev/null; then groupdel ringd; fi
    rm -rf "$TMP"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- install ----
echo "installing ${PACKAGES[*]} ($(dpkg-deb -f "${DEB[ringd]}" Version))"
# apt resolves their dependencies from the archive; what it adds is purged again at the end.
timeout 600 apt-get install -y -qq --no-install-recommends "${DEB[@]}" >"$TMP/install.log" 2>&1 </dev/null || {
    cat "$TMP/install.log" >&2
    fail "apt-get install of the packages"
}
while read -r p; do
    case " ${PACKAGES[*]} " in *" ${p%%:*} "*) ;; *) PULLED+=("$p") ;; esac
done < <(comm -13 <(echo "$BEFORE") <(dpkg-query -W -f='${db:Status-Status} ${binary:Package}\n' | awk '$1 == "installed" {print $2}' | sort))
for p in "${PACKAGES[@]}"; do [ "$(pkg_state "$p")" = installed ] || fail "$p is $(pkg_state "$p") after the install"; done
ok "installed${PULLED[*]:+ (apt added ${PULLED[*]})}"

for f in "${SHIPPED[@]}"; do [ -e "$f" ] || fail "$f, in the packages, is not on disk"; done
UNIT=/lib/systemd/system/ringd.service
dpkg -L ringd | grep -qx "$UNIT" || fail "ringd does not install $UNIT"
for f in /usr/sbin/ringd /usr/bin/ringctl /usr/bin/ringd-bench /usr/lib/sysusers.d/ringd.conf /etc/ringd/ringd.yaml \
         /usr/share/doc/ringd/README.md /usr/share/man/man8/ringd.8.gz /usr/share/man/man1/ringctl.1.gz; do
    dpkg -L ringd | grep -qx "$f" || fail "ringd does not install $f"
done
dpkg-query -W -f='${Conffiles}\n' ringd | grep -q '^ /etc/ringd/ringd.yaml ' || fail "/etc/ringd/ringd.yaml is not a conffile of ringd"
MULTIARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
LIB=/usr/lib/$MULTIARCH/libringd-client.so.0
dpkg -L libringd-client0 | grep -qx "$LIB" || fail "libringd-client0 does not install $LIB"
soname=$(objdump -p "$LIB" | awk '$1 == "SONAME" {print $2}')
[ "$soname" = libringd-client.so.0 ] || fail "$LIB's SONAME is '$soname'"
for f in /usr/include/ringd/ringd.h /usr/include/ringd/ringd.hpp /usr/lib/$MULTIARCH/libringd-client.so \
         /usr/lib/$MULTIARCH/pkgconfig/ringd-client.pc; do
    dpkg -L libringd-client-dev | grep -qx "$f" || fail "libringd-client-dev does not install $f"
done
PYDIR=/usr/lib/python3/dist-packages/ringd
for f in __init__.py torch.py _compat.py; do
    dpkg -L python3-ringd | grep -qx "$PYDIR/$f" || fail "python3-ringd does not install $PYDIR/$f"
done
dpkg -L python3-ringd | grep -q "^$PYDIR/_torch_work\..*\.so$" || fail "python3-ringd does not install ringd._torch_work"
doc=$(sed -n 's|^Documentation=file://||p' "$UNIT")
[ -f "$doc" ] || fail "the unit's Documentation= $doc is not installed"
ok "files: the unit, sysusers entry, conffile /etc/ringd/ringd.yaml, manual pages, $LIB (SONAME $soname), headers, ringd-client.pc, the Python package with _torch_work"

# Nothing enabled, nothing started.
for w in /etc/systemd/system/*.wants/ringd.service /etc/systemd/system/ringd.service; do
    if [ -e "$w" ] || [ -L "$w" ]; then fail "the install enabled ringd: $w"; fi
done
enabled=$(systemctl is-enabled ringd.service 2>&1) || true
[ "$enabled" = disabled ] || fail "systemctl is-enabled ringd.service says '$enabled', not disabled"
ringd_running() {
    local e
    for e in /proc/[0-9]*/exe; do [ "$(readlink "$e" 2>/dev/null)" = /usr/sbin/ringd ] && return 0; done
    return 1
}
ringd_running && fail "a ringd from /usr/sbin/ringd runs after the install"
ok "ringd.service is neither enabled (systemctl is-enabled: $enabled) nor started"

# The system user and group (systemd-sysusers, from the postinst).
IFS=: read -r _ _ uid gid _ home shell < <(getent passwd ringd) || fail "no user ringd after the install"
RINGD_GID=$(getent group ringd | cut -d: -f3) || fail "no group ringd after the install"
[ "$gid" = "$RINGD_GID" ] || fail "ringd's primary group is $gid, not ringd ($RINGD_GID)"
[ "$uid" -lt 1000 ] || fail "ringd's uid $uid is not a system uid"
[ "$shell" = /usr/sbin/nologin ] || fail "ringd's shell is $shell"
ok "system user ringd (uid $uid, group ringd $RINGD_GID, home $home, shell $shell)"

/usr/bin/ringctl --help >"$TMP/ringctl-help" 2>&1 || fail "ringctl --help"
grep -q "status" "$TMP/ringctl-help" || fail "ringctl --help does not list status"
version=$(/usr/sbin/ringd --version)
ok "ringctl --help; ringd --version: $version"

# ---- the unit, applied by hand ----
# unit_values KEY: every value KEY= takes in [Service], in order (systemd: the last one counts; an
# empty assignment resets a list).
unit_values() { awk -v k="$1" '/^\[/ {s = ($0 == "[Service]")} s && index($0, k "=") == 1 {print substr($0, length(k) + 2)}' "$UNIT"; }
unit_value() { unit_values "$1" | tail -n 1; }
APPLIED=" Type ExecStart User Group CapabilityBoundingSet AmbientCapabilities NoNewPrivileges LimitMEMLOCK LimitNOFILE
          RuntimeDirectory RuntimeDirectoryMode StateDirectory StateDirectoryMode WatchdogSec KillSignal TimeoutStopSec "
# Manager behaviour and sandboxing that only takes away: not needed for ringd to run as it would.
NOT_APPLIED=" ExecReload Restart RestartSec RestartPreventExitStatus ProtectSystem ProtectHome PrivateTmp PrivateDevices DevicePolicy DeviceAllow
          ProtectKernelTunables ProtectKernelModules ProtectControlGroups RestrictAddressFamilies RestrictNamespaces
          RestrictRealtime LockPersonality "
while read -r key; do
    [[ $APPLIED$NOT_APPLIED == *[[:space:]]${key}[[:space:]]* ]] ||
        fail "$UNIT has $key=, which this test does not apply: teach tests/package/package_check.sh what it means"
done < <(awk '/^\[/ {s = ($0 == "[Service]")} s && /^[A-Za-z]+=/ {sub(/=.*/, ""); print}' "$UNIT" | sort -u)

seconds_of() {  # a systemd time span of seconds: 15s, 15
    [[ $1 =~ ^([0-9]+)s?$ ]] || fail "$UNIT: time span '$1' is not understood here"
    echo "${BASH_REMATCH[1]}"
}
caps_of() {  # CAP_NET_ADMIN CAP_SYS_NICE -> +net_admin,+sys_nice
    local c out=""
    for c in $1; do c=${c#CAP_}; out+="${out:+,}+${c,,}"; done
    echo "$out"
}

TYPE=$(unit_value Type)
[ "$TYPE" = notify ] || fail "$UNIT: Type=$TYPE is not applied here (Type=notify: a NOTIFY_SOCKET)"
USER_=$(unit_value User) GROUP_=$(unit_value Group)
[ -n "$USER_" ] && [ -n "$GROUP_" ] || fail "$UNIT names no User= and Group="
getent passwd "$USER_" >/dev/null || fail "the unit's User=$USER_ does not exist"
PRIV=(setpriv --reuid="$USER_" --regid="$GROUP_" --init-groups)
bset=$(unit_value CapabilityBoundingSet) ambient=$(unit_value AmbientCapabilities)
PRIV+=(--bounding-set="-all${bset:+,$(caps_of "$bset")}" --inh-caps="-all${ambient:+,$(caps_of "$ambient")}")
[ -z "$ambient" ] || PRIV+=(--ambient-caps="$(caps_of "$ambient")")
case "$(unit_value NoNewPrivileges)" in yes | true | 1) PRIV+=(--no-new-privs) ;; esac
LIMITS=()
memlock=$(unit_value LimitMEMLOCK) nofile=$(unit_value LimitNOFILE)
[ "$memlock" = infinity ] && memlock=unlimited
for l in ${memlock:+--memlock=$memlock:$memlock} ${nofile:+--nofile=$nofile:$nofile}; do
    if prlimit "$l" -- true 2>/dev/null; then
        LIMITS+=("$l")
    else  # a container may not let root raise it (bench/cluster --as-unit does the same)
        echo "note: this machine does not let root set prlimit $l: ringd runs with the inherited limit"
    fi
done
[ ${#LIMITS[@]} -eq 0 ] || LIMITS=(prlimit "${LIMITS[@]}" --)
HOSTNAME_=$(hostname)
read -r -a EXEC < <(unit_value ExecStart)
[ ${#EXEC[@]} -gt 0 ] || fail "$UNIT has no ExecStart="
[ "$(unit_values ExecStart | wc -l)" = 1 ] || fail "$UNIT has several ExecStart= lines"
[[ ${EXEC[0]} == /* ]] || fail "ExecStart=${EXEC[0]}: a prefix or a relative path is not applied here"
for i in "${!EXEC[@]}"; do
    w=${EXEC[$i]//%H/$HOSTNAME_}
    w=${w//%%/%}
    [[ $w != *%* ]] || fail "ExecStart= word ${EXEC[$i]}: a specifier other than %H is not applied here"
    EXEC[$i]=$w
done
[ "${EXEC[0]}" = /usr/sbin/ringd ] || fail "ExecStart= runs ${EXEC[0]}, not the packaged /usr/sbin/ringd"
CONFIG=""
for i in "${!EXEC[@]}"; do [ "${EXEC[$i]}" = --config ] && CONFIG=${EXEC[$((i + 1))]}; done
[ "$CONFIG" = /etc/ringd/ringd.yaml ] || fail "ExecStart= reads '$CONFIG', not the conffile /etc/ringd/ringd.yaml"
STOP_S=$(seconds_of "$(unit_value TimeoutStopSec)")
KILL_SIGNAL=$(unit_value KillSignal)
KILL_SIGNAL=${KILL_SIGNAL:-SIGTERM}
ENV=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 HOME="$home" USER="$USER_"
     LOGNAME="$USER_" SHELL="$shell")
# The unit's directories, as systemd makes them before ExecStart (and removes /run's on stop).
DIRS=()
make_dir() {  # BASE NAME MODE VARIABLE
    local d=$1/$2
    install -d -m "${3:-0755}" -o "$USER_" -g "$GROUP_" "$d"
    DIRS+=("$d")
    ENV+=("$4=$d")
}
runtime=$(unit_value RuntimeDirectory) state=$(unit_value StateDirectory)
[[ $runtime != *" "* && $state != *" "* ]] || fail "several RuntimeDirectory=/StateDirectory= names are not applied here"
if [ -n "$runtime" ]; then make_dir /run "$runtime" "$(unit_value RuntimeDirectoryMode)" RUNTIME_DIRECTORY; fi
if [ -n "$state" ]; then make_dir /var/lib "$state" "$(unit_value StateDirectoryMode)" STATE_DIRECTORY; fi
echo "unit: ${LIMITS[*]} ${PRIV[*]} ${EXEC[*]} (${ENV[*]:6})"

# 1. The shipped config, as installed: its hosts list is an example (node0), so the service would stop
# at once naming its host, not run with it.
if [ "$HOSTNAME_" != node0 ]; then
    rc=0
    timeout 10 env -i "${ENV[@]}" "${LIMITS[@]}" "${PRIV[@]}" -- "${EXEC[@]}" >"$TMP/default.log" 2>&1 </dev/null || rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 124 ] || { cat "$TMP/default.log" >&2; fail "ringd with the shipped config did not stop at once (exit $rc)"; }
    grep -q "host '$HOSTNAME_' is not in hosts" "$TMP/default.log" || { cat "$TMP/default.log" >&2; fail "ringd with the shipped config stopped for another reason"; }
    ok "with the shipped config ringd stops at once: $(grep -o "host '$HOSTNAME_' is not in hosts.*" "$TMP/default.log" | head -n 1)"
else
    echo "note: this host is named node0, the shipped config's example host: not checking that it refuses"
fi

# 2. The operator's config: this host on 127.0.0.1, the default socket (/run/ringd/ringd.sock).
port=""
for p in $(shuf -i 20000-29999 -n 50); do
    if [ -z "$(ss -Hltn "sport = :$p")" ]; then port=$p; break; fi
done
[ -n "$port" ] || fail "no free TCP port found"
cp /etc/ringd/ringd.yaml "$TMP/shipped.yaml"
cat >/etc/ringd/ringd.yaml <<YAML
# package_check.sh: this host alone
cluster: package-check
hosts:
  - {name: $HOSTNAME_, address: 127.0.0.1, port: $port}
memory: {slot_bytes: 64MiB, max_slots: 16}
timeouts: {op: 10s}
# No GPU here: the package's software CUDA device stands in for the driver.
cuda: {provider: emulated}
YAML
cp /etc/ringd/ringd.yaml "$TMP/operator.yaml"

# The notify socket: a listener prints every line of every datagram ringd sends.
NOTIFY=$TMP/notify.sock
coproc NOTIFY_READER { exec /usr/bin/python3 -u -c '
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o666)
print("LISTENING", flush=True)
while True:
    for line in s.recv(4096).decode(errors="replace").splitlines():
        print(line, flush=True)
' "$NOTIFY"; }
NOTIFY_PID=$NOTIFY_READER_PID
NOTIFY_LOG=$TMP/notify.log
: >"$NOTIFY_LOG"
# wait_notify PATTERN SECONDS: reads the listener's lines (no polling) until one matches.
wait_notify() {
    local line deadline=$((SECONDS + $2))
    while [ $SECONDS -lt $deadline ]; do
        IFS= read -r -t $((deadline - SECONDS)) line <&"${NOTIFY_READER[0]}" || return 1
        echo "$line" >>"$NOTIFY_LOG"
        [[ $line =~ $1 ]] && return 0
    done
    return 1
}
wait_notify '^LISTENING$' 10 || fail "the notify listener did not start"

NENV=(NOTIFY_SOCKET="$NOTIFY")
watchdog=$(unit_value WatchdogSec)
[ -z "$watchdog" ] || NENV+=(WATCHDOG_USEC="$(($(seconds_of "$watchdog") * 1000000))")
# WATCHDOG_PID is ringd's pid: the shell's, which every exec after it keeps.
env -i "${ENV[@]}" "${NENV[@]}" /bin/sh -c 'WATCHDOG_PID=$$; export WATCHDOG_PID; exec "$@"' sh \
    "${LIMITS[@]}" "${PRIV[@]}" -- "${EXEC[@]}" >"$TMP/ringd.log" 2>&1 </dev/null &
RINGD_PID=$!
wait_notify '^READY=1$' 15 || { cat "$TMP/ringd.log" >&2; fail "ringd sent no READY=1 within 15 s"; }
kill -0 "$RINGD_PID" 2>/dev/null || { cat "$TMP/ringd.log" >&2; fail "ringd ended after READY=1"; }
[ "$(readlink /proc/$RINGD_PID/exe)" = /usr/sbin/ringd ] || fail "pid $RINGD_PID is not /usr/sbin/ringd"
status_line=$(grep -a '^Uid:\|^Gid:\|^Groups:\|^CapEff:\|^CapBnd:\|^NoNewPrivs:' /proc/$RINGD_PID/status | tr -s '\t ' ' ' | tr '\n' ';')
[[ $status_line == *"Uid: $uid $uid $uid $uid"* ]] || fail "ringd does not run as $USER_: $status_line"
[[ $status_line == *"CapEff: 0000000000000000"* ]] || [ -n "$ambient" ] || fail "ringd has capabilities: $status_line"
ok "ringd runs as the unit would (pid $RINGD_PID: $status_line) and sent READY=1"
if [ -n "$watchdog" ]; then
    wait_notify '^WATCHDOG=1$' "$(seconds_of "$watchdog")" || fail "no WATCHDOG=1 within WatchdogSec=$watchdog"
    ok "WATCHDOG=1 within WatchdogSec=$watchdog"
fi
SOCK=/run/ringd/ringd.sock
[ -S "$SOCK" ] || fail "no socket at $SOCK (the shipped config's socket, in the unit's RuntimeDirectory)"
sock_mode=$(stat -c '%a %U:%G' "$SOCK")
/usr/bin/ringctl status >"$TMP/status.txt" 2>&1 || { cat "$TMP/status.txt" >&2; fail "ringctl status (as root, default socket)"; }
grep -q "$HOSTNAME_" "$TMP/status.txt" || fail "ringctl status does not name this host"
ok "ringctl status through $SOCK ($sock_mode)"

completed() {
    /usr/bin/ringctl status --json | /usr/bin/python3 -c 'import json, sys; d = json.load(sys.stdin)["ops"]; print(d["completed"], d["failed"])'
}

# ---- a C trainer against the installed headers, library and ringd-client.pc ----
PC=(env -u PKG_CONFIG_PATH -u PKG_CONFIG_LIBDIR -u PKG_CONFIG_SYSROOT_DIR pkg-config)
CFLAGS=$("${PC[@]}" --cflags ringd-client) || fail "pkg-config --cflags ringd-client"
LIBS=$("${PC[@]}" --libs ringd-client) || fail "pkg-config --libs ringd-client"
# shellcheck disable=SC2086  # the flags are words
cc -std=c11 -Wall -Wextra -Werror $CFLAGS "$SRC/tests/integration/install_trainer.c" $LIBS -o "$TMP/trainer" ||
    fail "the trainer does not build against the installed header and ringd-client.pc ($CFLAGS $LIBS)"
# shellcheck disable=SC2086
printf '#include <ringd/ringd.hpp>\nint main() { return 0; }\n' |
    g++ -std=c++20 -Wall -Wextra -Werror -x c++ - $CFLAGS $LIBS -o "$TMP/hpp" ||
    fail "<ringd/ringd.hpp> does not build against the installed headers"
loaded=$(ldd "$TMP/trainer" | awk '$1 == "libringd-client.so.0" {print $3}')
[ -n "$loaded" ] && [ "$(realpath "$loaded")" = "$(realpath "$LIB")" ] || fail "the trainer loads '$loaded', not $LIB"
chmod 0755 "$TMP/trainer"
ok "a C trainer and <ringd/ringd.hpp> build with pkg-config ringd-client ($("${PC[@]}" --modversion ringd-client): '$CFLAGS $LIBS'); it loads $LIB"

# As a trainer of the group ringd (nobody with ringd as a supplementary group), then as one without it.
AS_TRAINER=(setpriv --reuid=65534 --regid=65534 --groups="$RINGD_GID" --inh-caps=-all --bounding-set=-all --)
AS_STRANGER=(setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all --)
read -r before_ok before_failed < <(completed)
timeout 60 "${AS_TRAINER[@]}" "$TMP/trainer" "$SOCK" >"$TMP/trainer.log" 2>&1 || {
    cat "$TMP/trainer.log" "$TMP/ringd.log" >&2
    fail "the trainer's allreduce (2 local ranks, as nobody in group ringd)"
}
read -r after_ok after_failed < <(completed)
[ $((after_ok - before_ok)) = 2 ] && [ "$after_failed" = "$before_failed" ] ||
    fail "ringd counted $((after_ok - before_ok)) completed and $((after_failed - before_failed)) failed ops for the trainer's 2"
sed 's/^/  /' "$TMP/trainer.log"
ok "the installed trainer allreduced f32 sum and avg with 2 local ranks as a member of group ringd, values and guard bytes checked"
rc=0
timeout 30 "${AS_STRANGER[@]}" "$TMP/trainer" "$SOCK" >"$TMP/stranger.log" 2>&1 || rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "a trainer outside group ringd was not refused (exit $rc)"
grep -qi "permission denied" "$TMP/stranger.log" || { cat "$TMP/stranger.log" >&2; fail "a trainer outside group ringd failed for another reason"; }
ok "a trainer outside group ringd is refused: $(head -n 1 "$TMP/stranger.log")"

# ---- the Python package (ctypes over the installed library), 2 ranks, the default socket ----
py_rank() {
    env -i PATH=/usr/bin:/bin HOME="$TMP" timeout 60 "${AS_TRAINER[@]}" /usr/bin/python3 -c "
import os, ringd, struct, sys
rank = int(sys.argv[1])
c = ringd.Client('pkg-py', rank, 2, 1 << 16)
c.slot[64:80] = struct.pack('4f', *[float(rank + k) for k in range(4)])
c.allreduce(64, 4, 'float32', 'sum', 10000)
got = struct.unpack('4f', bytes(c.slot[64:80]))
assert got == (1.0, 3.0, 5.0, 7.0), got
assert bytes(c.slot[:64]) == bytes(64) and bytes(c.slot[80:144]) == bytes(64), 'bytes around the op changed'
maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libringd-client' in l}
assert {os.path.realpath(m) for m in maps} == {os.path.realpath('$LIB')}, maps
print('python rank', rank, 'ok, library', ringd.library_path(), '=', ' '.join(sorted(maps)))
" "$1"
}
py_rank 0 >"$TMP/py0.log" 2>&1 &
CHILDREN+=($!)
py_rank 1 >"$TMP/py1.log" 2>&1 || { cat "$TMP/py0.log" "$TMP/py1.log" >&2; fail "the Python package's allreduce (rank 1)"; }
wait "${CHILDREN[0]}" || { cat "$TMP/py0.log" >&2; fail "the Python package's allreduce (rank 0)"; }
CHILDREN=()
sed 's/^/  /' "$TMP/py0.log" "$TMP/py1.log"
ok "the installed Python package allreduced with 2 local ranks through the default socket"

# ---- a device op: the packages carry the CUDA path (the software CUDA device they ship stands in
# for a GPU's driver here), 2 ranks, device memory from cuda_alloc, a 4 MiB slot (the op goes as
# parts that fit it) ----
EMU=$(dpkg -L ringd | grep '/ringd/libringd-cuda-emulated\.so\.0$' || true)
[ -n "$EMU" ] || fail "ringd ships no software CUDA device (libringd-cuda-emulated.so.0)"
cuda_rank() {
    env -i PATH=/usr/bin:/bin HOME="$TMP" RINGD_CUDA_PROVIDER=emulated timeout 60 "${AS_TRAINER[@]}" /usr/bin/python3 -c "
import array, ctypes, os, ringd, sys
rank, n = int(sys.argv[1]), 3 << 20  # 12 MiB of f32 through a 4 MiB slot
c = ringd.Client('pkg-cuda', rank, 2, 4 << 20)
p = c.cuda_alloc(n * 4)
src = array.array('f', [float(rank + 1)]) * n
ctypes.memmove(p, src.buffer_info()[0], n * 4)  # the software device's memory is host-addressable
t = c.submit_cuda(p, n, 'float32', 'sum')
c.stream_wait(t)
c.wait(t, 20000)
got = (ctypes.c_float * n).from_address(p)
bad = sum(1 for i in range(0, n, 997) if got[i] != 3.0) + (got[n - 1] != 3.0)
assert not bad, f'{bad} wrong values'
maps = {os.path.realpath(l.split()[-1]) for l in open('/proc/self/maps') if 'libringd' in l}
assert os.path.realpath('$EMU') in maps, maps
c.cuda_free(p)
c.close()
print('device rank', rank, 'ok:', n, 'f32 summed from device memory through a 4 MiB slot, device', '$EMU')
" "$1"
}
read -r before_ok _ < <(completed)
cuda_rank 0 >"$TMP/cuda0.log" 2>&1 &
CHILDREN+=($!)
cuda_rank 1 >"$TMP/cuda1.log" 2>&1 || { cat "$TMP/cuda0.log" "$TMP/cuda1.log" "$TMP/ringd.log" >&2; fail "a device op through the installed packages (rank 1)"; }
wait "${CHILDREN[0]}" || { cat "$TMP/cuda0.log" "$TMP/ringd.log" >&2; fail "a device op through the installed packages (rank 0)"; }
CHILDREN=()
read -r after_ok _ < <(completed)
[ "$after_ok" -ge $((before_ok + 12)) ] || fail "the device op did not go through ringd as 12 parts of 1 MiB (ops completed: $before_ok -> $after_ok)"
sed 's/^/  /' "$TMP/cuda0.log" "$TMP/cuda1.log"
ok "a device op through the installed packages: 12 MiB f32 from device memory of 2 ranks in $((after_ok - before_ok)) parts, exact"

# ---- ringd.torch (python3-torch is a Recommends: checked where it is installed) ----
if [ "$(pkg_state python3-torch)" = installed ]; then
    mkdir -m 0777 "$TMP/torch"
    torch_rank() {
        env -i PATH=/usr/bin:/bin HOME="$TMP/torch" LOCAL_RANK="$1" GLOO_SOCKET_IFNAME=lo RINGD_SLOT_BYTES=16777216 \
            timeout 120 "${AS_TRAINER[@]}" /usr/bin/python3 -c "
import sys, torch, torch.distributed as dist
import ringd.torch, ringd._torch_work
rank = int(sys.argv[1])
dist.init_process_group('ringd', init_method='file://$TMP/torch/store', rank=rank, world_size=2)
t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
dist.all_reduce(t)
assert torch.equal(t, torch.arange(1000, dtype=torch.float32) * 3), t[:8]
dist.destroy_process_group()
print('torch', torch.__version__, 'rank', rank, 'ok')
" "$1"
    }
    read -r before_ok _ < <(completed)
    torch_rank 0 >"$TMP/t0.log" 2>&1 &
    CHILDREN+=($!)
    torch_rank 1 >"$TMP/t1.log" 2>&1 || { cat "$TMP/t0.log" "$TMP/t1.log" >&2; fail "ringd.torch's all_reduce (rank 1)"; }
    wait "${CHILDREN[0]}" || { cat "$TMP/t0.log" >&2; fail "ringd.torch's all_reduce (rank 0)"; }
    CHILDREN=()
    read -r after_ok _ < <(completed)
    [ "$after_ok" -gt "$before_ok" ] || fail "torch's all_reduce did not go through ringd (ops completed: $before_ok -> $after_ok)"
    sed 's/^/  /' "$TMP/t0.log" "$TMP/t1.log"
    ok "ringd.torch (with ringd._torch_work): all_reduce of 2 ranks through ringd"
else
    echo "note: python3-torch is not installed here: ringd.torch not checked"
fi

# ---- stop as systemd would ----
kill -s "${KILL_SIGNAL#SIG}" "$RINGD_PID"
sleep "$STOP_S" &
timer=$!
rc=0
wait -n -p ended "$RINGD_PID" "$timer" || rc=$?
if [ "$ended" = "$timer" ]; then
    cat "$TMP/ringd.log" >&2
    fail "ringd did not stop within TimeoutStopSec=${STOP_S}s of $KILL_SIGNAL (systemd would SIGKILL it)"
fi
kill "$timer" 2>/dev/null || true
wait "$timer" 2>/dev/null || true
RINGD_PID=""
[ $rc = 0 ] || { cat "$TMP/ringd.log" >&2; fail "ringd exited $rc on $KILL_SIGNAL"; }
wait_notify '^STOPPING=1$' 5 || fail "ringd sent no STOPPING=1"
rm -rf "/run/$runtime"  # systemd removes the RuntimeDirectory on stop; the StateDirectory stays
ok "ringd stopped on $KILL_SIGNAL with exit 0 within TimeoutStopSec=${STOP_S}s"

# ---- upgrade (the same version again): the operator's config stays ----
timeout 300 dpkg -i "${DEB[ringd]}" >"$TMP/upgrade.log" 2>&1 </dev/null || { cat "$TMP/upgrade.log" >&2; fail "dpkg -i ringd again"; }
cmp -s /etc/ringd/ringd.yaml "$TMP/operator.yaml" || fail "reinstalling ringd changed the operator's /etc/ringd/ringd.yaml"
if compgen -G '/etc/ringd/ringd.yaml.dpkg-*' >/dev/null; then fail "reinstalling ringd left $(echo /etc/ringd/ringd.yaml.dpkg-*)"; fi
ringd_running && fail "reinstalling ringd started it"
enabled=$(systemctl is-enabled ringd.service 2>&1) || true
[ "$enabled" = disabled ] || fail "after reinstalling ringd, systemctl is-enabled ringd.service says '$enabled'"
ok "reinstalling ringd keeps the edited /etc/ringd/ringd.yaml and neither enables nor starts it"

# ---- remove: the configuration stays ----
timeout 300 dpkg --remove "${PACKAGES[@]}" >"$TMP/remove.log" 2>&1 </dev/null || { cat "$TMP/remove.log" >&2; fail "dpkg --remove"; }
[ "$(pkg_state ringd)" = config-files ] || fail "ringd is $(pkg_state ringd) after dpkg --remove, not config-files"
[ ! -e /usr/sbin/ringd ] || fail "/usr/sbin/ringd is still there after dpkg --remove"
cmp -s /etc/ringd/ringd.yaml "$TMP/operator.yaml" || fail "dpkg --remove did not keep /etc/ringd/ringd.yaml"
ok "dpkg --remove: the programs are gone, /etc/ringd/ringd.yaml stays"

# ---- purge: nothing of them is left ----
timeout 300 dpkg --purge "${PACKAGES[@]}" >"$TMP/purge.log" 2>&1 </dev/null || { cat "$TMP/purge.log" >&2; fail "dpkg --purge"; }
for p in "${PACKAGES[@]}"; do
    [ "$(pkg_state "$p")" = not-installed ] || fail "$p is $(pkg_state "$p") after the purge"
    ! dpkg -L "$p" >/dev/null 2>&1 || fail "dpkg -L $p still lists files after the purge"
done
for f in "${SHIPPED[@]}" /etc/ringd /usr/share/doc/ringd /usr/include/ringd "$PYDIR" /var/lib/ringd /run/ringd \
         /var/lib/systemd/deb-systemd-helper-enabled/ringd.service.dsh-also \
         /var/lib/systemd/deb-systemd-helper-masked/ringd.service; do
    if [ -e "$f" ] || [ -L "$f" ]; then fail "$f is left after the purge"; fi
done
leftover=$(comm -13 <(echo "$OURS_BEFORE") <(find /usr /etc /var/lib /lib -xdev \( -name 'ringd*' -o -name 'libringd*' -o -name 'ringctl*' \) 2>/dev/null | sort) | head -n 5)
[ -z "$leftover" ] || fail "left after the purge: $leftover"
ok "dpkg --purge: no file of the four packages, no /etc/ringd, no /var/lib/ringd, no deb-systemd-helper state"
if getent passwd ringd >/dev/null; then
    echo "note: the system user ringd stays after the purge (Debian leaves system users;$([ $USER_EXISTED = 0 ] && echo " this test made it and removes it now" || echo " it was here before"))"
fi
echo "PASS: ringd's packages install, run as the unit, upgrade, remove and purge cleanly"
