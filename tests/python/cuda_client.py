"""The Python client's device-buffer calls (ringd.Client.cuda_*), against a real ringd with the
software CUDA device: two trainers of one group on one host, device memory from cuda_alloc (VMM,
passed as an fd), every value written into device memory and read back here (the software
device's memory is host-addressable), sum and avg exact, stream_wait on the default stream, and
the errors a misuse gets. Usage: cuda_client.py RINGD_BIN [LIBRINGD_CLIENT]. Exit 0 when every
check held."""
import ctypes
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

if len(sys.argv) > 2:
    os.environ["RINGD_CLIENT_LIBRARY"] = sys.argv[2]  # this build's, never an installed one
sys.path.insert(0, os.path.join(os.environ.get("RINGD_SOURCE_DIR", "."), "client", "python"))
import ringd  # noqa: E402

N = 100_000


def main(ringd_bin):
    os.environ["RINGD_CUDA_PROVIDER"] = "emulated"
    tmp = tempfile.mkdtemp(prefix="ringd-pycuda-")
    sock = os.path.join(tmp, "ringd.sock")
    with open(os.path.join(tmp, "ringd.yaml"), "w") as f:
        f.write("cluster: pycuda\nhosts:\n  - {name: node0, address: 127.0.0.1, port: 7409}\n"
                f"socket: {sock}\nmemory: {{slot_bytes: 8MiB, max_slots: 4}}\ncuda: {{provider: emulated}}\n")
    log = open(os.path.join(tmp, "ringd.log"), "w")
    d = subprocess.Popen([ringd_bin, "--config", os.path.join(tmp, "ringd.yaml"), "--host", "node0"],
                         stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 10
        while True:
            try:
                st = ringd.status(sock, 1000)
                break
            except ringd.RingdError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        assert st["cuda"]["available"], st["cuda"]
        a = ringd.Client("pycuda", 0, 2, 4 << 20, socket=sock)
        b = ringd.Client("pycuda", 1, 2, 4 << 20, socket=sock)
        pa, pb = a.cuda_alloc(N * 4), b.cuda_alloc(N * 4)
        for op, want in (("sum", lambda i: 3.0 * i), ("avg", lambda i: 1.5 * i)):
            ctypes.memmove(pa, (ctypes.c_float * N)(*[float(i) for i in range(N)]), N * 4)
            ctypes.memmove(pb, (ctypes.c_float * N)(*[2.0 * i for i in range(N)]), N * 4)
            ta = a.submit_cuda(pa, N, "float32", op)
            tb = b.submit_cuda(pb, N, "float32", op)
            a.stream_wait(ta)
            a.wait(ta, 10000)
            b.wait(tb, 10000)
            for p in (pa, pb):
                got = (ctypes.c_float * N).from_address(p)
                bad = [i for i in range(N) if got[i] != want(i)]
                assert not bad, f"{op}: {len(bad)} wrong values, first at {bad[0]}: {got[bad[0]]} != {want(bad[0])}"
        try:
            a.submit_cuda(pa + (1 << 30), 16, "float32", "sum")  # past the 2 MiB allocation
            raise AssertionError("a pointer outside every registration was accepted")
        except ringd.RingdError as e:
            assert e.code == -errno.ENOENT and "no registration" in str(e), e
        host = ctypes.create_string_buffer(4096)
        try:
            a.register_cuda(ctypes.addressof(host), 4096)
            raise AssertionError("host memory was registered as device memory")
        except ringd.RingdError as e:
            assert "not device memory" in str(e), e
        st = ringd.status(sock, 1000)["cuda"]
        assert st["opens"] == 2 and st["registrations"] == 2, st
        a.cuda_free(pa)
        b.cuda_free(pb)
        a.close()
        b.close()
        print("cuda_client: sum and avg exact from device memory; errors named")
        return 0
    finally:
        d.send_signal(signal.SIGTERM)
        try:
            d.wait(10)
        except subprocess.TimeoutExpired:
            d.kill()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
