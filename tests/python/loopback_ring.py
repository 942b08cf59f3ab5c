"""A ring of ringds on 127.0.0.1, one per "host" (the Python tests' and tests/device's harness):
configs with a shared secret and free ports, the daemons started, waited for until their ring is
up, and stopped (SIGTERM, then SIGKILL past 10 s).

    with LoopbackRing(ringd_bin, workdir, hosts=2, yaml="cuda: {provider: emulated}\\n") as ring:
        ring.sockets[0]   # node0's socket
"""
import os
import signal
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackRing:
    def __init__(self, ringd_bin, workdir, hosts=2, yaml="", log_dir=None, env=None, cluster="loopback"):
        """`yaml`: appended to every host's config (memory, timeouts, cuda, ...); `log_dir`: where
        node<i>.log go (default workdir); `env`: the daemons' environment."""
        self.workdir, self.hosts = workdir, hosts
        self.sockets = [os.path.join(workdir, f"node{h}.sock") for h in range(hosts)]
        self.logs = [os.path.join(log_dir or workdir, f"node{h}.log") for h in range(hosts)]
        secret = os.path.join(workdir, "secret")
        with open(secret, "w") as f:
            f.write(os.urandom(16).hex() + "\n")
        os.chmod(secret, 0o600)
        ports = [free_port() for _ in range(hosts)]
        self.daemons = []
        try:
            for h in range(hosts):
                cfg = os.path.join(workdir, f"node{h}.yaml")
                with open(cfg, "w") as f:
                    f.write(f"cluster: {cluster}\nhosts:\n" +
                            "".join(f"  - {{name: node{i}, address: 127.0.0.1, port: {ports[i]}}}\n" for i in range(hosts)) +
                            f"socket: {self.sockets[h]}\nauth: {{secret_file: {secret}}}\n" + yaml)
                with open(self.logs[h], "w") as log:
                    self.daemons.append(subprocess.Popen([ringd_bin, "--config", cfg, "--host", f"node{h}"], stdout=log,
                                                         stderr=subprocess.STDOUT, env=env))
        except BaseException:
            self.stop()
            raise

    def wait_up(self, timeout=20):
        """True once every host's ring is up (ringd's status), False at the deadline."""
        import ringd
        until = time.time() + timeout
        while time.time() < until:
            try:
                if all(ringd.status(s, 1000).get("ring", {}).get("state") == "up" for s in self.sockets):
                    return True
            except ringd.RingdError:
                pass
            time.sleep(0.1)
        return False

    def log_tail(self, h, lines=20):
        with open(self.logs[h]) as f:
            return "".join(f.readlines()[-lines:])

    def stop(self):
        for d in self.daemons:
            d.send_signal(signal.SIGTERM)
        for d in self.daemons:
            try:
                d.wait(10)
            except subprocess.TimeoutExpired:
                d.kill()
        self.daemons = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


if __name__ == "__main__":
    sys.exit("loopback_ring.py is a module (tests/python/torch_cuda_path.py, tests/device/torch_check.py)")
