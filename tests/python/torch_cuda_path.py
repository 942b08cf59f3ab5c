"""ringd.torch's CUDA path on ringd's software CUDA device: the code the backend runs for a CUDA
tensor (_Engine.allreduce_device, stream_wait, the registration cache, the staging range and part
size), driven with DeviceBuffers over device memory of the software device (what a CUDA tensor
becomes in ProcessGroupRingd._allreduce_cuda), on 2 ringds on 127.0.0.1 as two hosts x 2 trainer
processes. Memory comes from cuMemAlloc, as torch's caching allocator gets it (a block inside a
larger allocation, registered by the allocation). Every value is checked here, with the guard bytes
on both sides of each op's range:
  - every dtype x op, default stream and a stream whose producer runs 60 ms late (ringd reads after it);
  - stream_wait: a copy queued after it sees the result without waiting on the future first;
  - 100 ops on one allocation register it once; memory given back and allocated again at the same
    address is registered again (its driver buffer id differs), with exact results;
  - an op 16 x the slot (parts through the group's staging range);
  - reduce_scatter and allgather (a ranked group, ranks numbered unlike the hosts): every dtype x op,
    apart and in place, in one part and in several, every byte of the buffer checked;
  - broadcast and reduce (the same group): roots on every rank, every dtype x op, in one part and in
    several; what the op only reads (the root's broadcast, the others' reduce) unchanged; all_to_all
    of equal blocks, every dtype, in one part and in several; all_to_all with split sizes, every
    dtype, uneven with zeros, a rank that sends nothing and one that neither sends nor receives;
    one too large for a rank's staging range (through host memory there, exact everywhere) and
    one too large for its slot, refused in its place (every rank fails at once);
  - a rank that dies before an op: the others get RuntimeError within timeouts.op + margin, and a
    stream waiting on the op moves on.
Usage: torch_cuda_path.py RINGD_BIN LIBRINGD_CLIENT EMULATED_CUDA_LIB. Exit 0 when every check held,
77 when torch is missing."""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HOSTS, LOCAL = 2, 2
WORLD = HOSTS * LOCAL
SLOT = 1 << 20
OP_TIMEOUT_S = 4


def cuda_driver(path):
    """The software device's driver entry points, by cuGetProcAddress as libringd-client takes them."""
    lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    gpa = lib.cuGetProcAddress_v2
    gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int)]
    fns = {}
    for name, args in (("cuInit", [ctypes.c_uint]),
                       ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                       ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]),
                       ("cuCtxSetCurrent", [ctypes.c_void_p]),
                       ("cuMemAlloc", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]),
                       ("cuMemFree", [ctypes.c_uint64]),
                       ("cuStreamCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
                       ("cuStreamSynchronize", [ctypes.c_void_p]),
                       ("cuMemcpyHtoDAsync", [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
                       ("cuMemcpyDtoHAsync", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p])):
        p, status = ctypes.c_void_p(), ctypes.c_int()
        rc = gpa(name.encode(), ctypes.byref(p), 12000, 0, ctypes.byref(status))
        assert rc == 0 and p.value, f"{name}: {rc}"
        fns[name] = ctypes.CFUNCTYPE(ctypes.c_int, *args)(p.value)
    fns["delay"] = lib.ringd_emu_stream_delay
    fns["delay"].argtypes = [ctypes.c_void_p, ctypes.c_uint]
    fns["delay"].restype = None
    return fns


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def worker(rank, sock, group, out):
    import torch
    import datetime
    import ringd.torch  # noqa: F401  (the backend the engine serves)
    from ringd import _compat
    from ringd._device import DeviceBuffer
    from ringd._engine import _Engine
    cu = cuda_driver(os.environ["RINGD_CUDA_EMULATED_LIBRARY"])
    check(cu["cuInit"](0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(cu["cuDeviceGet"](ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu["cuDevicePrimaryCtxRetain"](ctypes.byref(ctx), dev), "retain")
    check(cu["cuCtxSetCurrent"](ctx), "set current")
    host, local = divmod(rank, LOCAL)
    engine = _Engine(group, local, LOCAL, SLOT, sock, datetime.timedelta(seconds=30))
    report = {"rank": rank, "checks": 0, "failures": []}

    def fail(msg):
        report["failures"].append(msg)

    def alloc(nbytes):
        p = ctypes.c_uint64()
        check(cu["cuMemAlloc"](ctypes.byref(p), nbytes), "cuMemAlloc")
        return p.value

    def tensor_at(ptr, nbytes):  # the software device's memory is host memory at the same address
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8)

    tdtypes = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
               "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
    GUARD = 4096

    def values(dtype, count, r, salt):
        # Small integers (exact in every dtype, their sums and means over WORLD ranks too).
        i = torch.arange(count, dtype=torch.int64)
        return ((i * 7 + salt) % 61 + r * 3).to(tdtypes[dtype])

    def expect(dtype, op, count, salt):
        stack = torch.stack([values(dtype, count, r, salt).to(torch.float64) for r in range(WORLD)])
        ref = {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0).values, "max": stack.max(0).values}[op]
        return ref.to(tdtypes[dtype])

    def run_op(base, nbytes, dtype, op, count, salt, stream=0, producer=None, wait_future=True):
        """One allreduce of `count` elements at base + GUARD; the guard bytes around it checked."""
        esize = torch.tensor([], dtype=tdtypes[dtype]).element_size()
        mem = tensor_at(base, nbytes)
        pattern = torch.full((nbytes,), (rank * 31 + salt) % 251, dtype=torch.uint8)
        mine = values(dtype, count, rank, salt)
        if producer is None:
            mem.copy_(pattern)
            mem[GUARD:GUARD + count * esize].copy_(mine.view(torch.uint8))
        else:  # the buffer is written on `stream` after a delay: ringd must read after it
            mem.copy_(pattern)
            staged = pattern.clone()
            staged[GUARD:GUARD + count * esize].copy_(mine.view(torch.uint8))
            producer["keep"] = staged
            cu["delay"](ctypes.c_void_p(stream), producer.get("delay_us", 60000))
            check(cu["cuMemcpyHtoDAsync"](base, ctypes.c_void_p(staged.data_ptr()), nbytes, ctypes.c_void_p(stream)), "h2d")
        opf = _compat.OpFuture()
        buf = DeviceBuffer(base + GUARD, count, dtype, 0, stream)
        ticket, _ = engine.allreduce_device(buf, op, opf, "done")
        return ticket, opf, mem, pattern, esize

    def verify(what, mem, pattern, esize, dtype, op, count, salt):
        got = mem[GUARD:GUARD + count * esize].clone().view(tdtypes[dtype])
        want = expect(dtype, op, count, salt)
        wrong = int((got != want).sum())
        guard = int((mem[:GUARD] != pattern[:GUARD]).sum() + (mem[GUARD + count * esize:] != pattern[GUARD + count * esize:]).sum())
        report["checks"] += count
        if wrong or guard:
            fail(f"{what}: {wrong} wrong values, {guard} guard bytes changed")

    block = alloc(8 << 20)  # one allocation, ops on blocks inside it (the caching allocator's way)
    salt = 0
    # 1. every dtype x op, on the default stream and on a stream whose producer runs late
    s = ctypes.c_void_p()
    check(cu["cuStreamCreate"](ctypes.byref(s), 1), "stream")
    for dtype in tdtypes:
        for op in ("sum", "avg", "min", "max"):
            if op == "avg" and dtype.startswith("int"):
                continue
            for stream in (0, s.value):
                salt += 1
                count = 1000 + salt * 37
                producer = {} if stream else None
                ticket, opf, mem, pattern, esize = run_op(block + salt * 64, 1 << 20, dtype, op, count, salt,
                                                         stream or 0, producer)
                try:
                    opf.future.wait()
                except RuntimeError as e:
                    fail(f"{dtype} {op}: {e}")
                    continue
                verify(f"{dtype} {op} stream {bool(stream)}", mem, pattern, esize, dtype, op, count, salt)
    # 2. stream_wait: a copy queued after it sees the result; the future is not waited on first
    salt += 1
    count = 50000
    # Holds the host buffer the late copy reads. The other ranks' producers are 340 ms later than
    # rank 0's, so rank 0's result comes that long after its own data is in: a copy that did not
    # wait would read rank 0's input.
    producer = {"delay_us": 60000 if rank == 0 else 400000}
    ticket, opf, mem, pattern, esize = run_op(block, 2 << 20, "float32", "sum", count, salt, s.value, producer)
    engine.stream_wait(ticket, s.value)
    host_copy = torch.empty(2 << 20, dtype=torch.uint8)
    check(cu["cuMemcpyDtoHAsync"](ctypes.c_void_p(host_copy.data_ptr()), block, 2 << 20, s), "d2h")
    check(cu["cuStreamSynchronize"](s), "sync")
    got = host_copy[GUARD:GUARD + count * 4].view(torch.float32)
    if not torch.equal(got, expect("float32", "sum", count, salt)):
        fail("stream_wait: the copy queued after it did not see the result")
    report["checks"] += count
    opf.future.wait()
    # 2b. a deferred op (the backend's path for a non-contiguous tensor, whose copy back the caller
    # queues after the op): its future completes only once the caller released it
    salt += 1
    opf = _compat.OpFuture()
    mem = tensor_at(block, 1 << 20)
    mem[GUARD:GUARD + 4000].copy_(values("float32", 1000, rank, salt).view(torch.uint8))
    ticket, rec = engine.allreduce_device(DeviceBuffer(block + GUARD, 1000, "float32", 0, 0), "sum", opf, "done",
                                          deferred=True)
    until = time.monotonic() + 10
    while time.monotonic() < until:
        with engine.lock:
            if ticket not in engine.inflight:
                break
        time.sleep(0.01)
    time.sleep(0.2)  # the finishing thread had its chance
    if opf.done():
        fail("a deferred op's future completed before it was released")
    engine.release_finish(rec)
    opf.future.wait()
    if not torch.equal(mem[GUARD:GUARD + 4000].clone().view(torch.float32), expect("float32", "sum", 1000, salt)):
        fail("deferred op: wrong result")
    report["checks"] += 1000
    # 3. many ops on one allocation: registered once
    regs_before = engine.device_registrations
    for k in range(100):
        ticket, opf, mem, pattern, esize = run_op(block + (k % 8) * 4096, 1 << 20, "int32", "sum", 256, 500 + k)
        opf.future.wait()
        verify(f"op {k} on one allocation", mem, pattern, esize, "int32", "sum", 256, 500 + k)
    if engine.device_registrations != regs_before:
        fail(f"100 ops on one allocation registered it {engine.device_registrations - regs_before} more times")
    # memory given back, allocated again (the same size: likely the same address) -> registered again
    check(cu["cuMemFree"](block), "free")
    block2 = alloc(8 << 20)
    report["same_address_again"] = block2 == block
    ticket, opf, mem, pattern, esize = run_op(block2, 1 << 20, "float64", "max", 3000, 777)
    opf.future.wait()
    verify("after the allocation was given back", mem, pattern, esize, "float64", "max", 3000, 777)
    if engine.device_registrations != regs_before + 1:
        fail(f"new memory at the address: {engine.device_registrations - regs_before} registrations, not 1")
    # 4. an op 16 x the slot: parts stream through the group's staging range
    big = alloc(16 * SLOT + 2 * GUARD)
    count = 16 * SLOT // 4
    ticket, opf, mem, pattern, esize = run_op(big, 16 * SLOT + 2 * GUARD, "float32", "sum", count, 4242)
    opf.future.wait()
    verify("16 x the slot", mem, pattern, esize, "float32", "sum", count, 4242)
    report["part_bytes"], report["staging_bytes"] = engine.device_part, engine.staging_bytes
    report["registrations"] = engine.device_registrations
    # 4b. reduce_scatter and allgather through the CUDA path: a ranked group (group rank g of this
    # process unlike its place on the hosts), every dtype x op, apart and in place, in one part and
    # in several (a part is the same elements of every block: (WORLD + 1) x its bytes of staging)
    g = (rank * 3 + 1) % WORLD
    ceng = _Engine(group + "-coll", local, LOCAL, SLOT, sock, datetime.timedelta(seconds=30), rank=g, ranks=WORLD)
    cbase, cbytes = alloc(512 << 10), 512 << 10
    coll_ops = 0
    for name in ("reduce_scatter", "allgather"):
        rs = name == "reduce_scatter"
        for dtype in tdtypes:
            for op in (("sum", "avg", "min", "max") if rs else ("sum",)):
                if op == "avg" and dtype.startswith("int"):
                    continue
                # (9000 elements: 2 to 3 parts; for two dtypes, which is where parts differ)
                for count in ((700, 9000) if dtype in ("float32", "bfloat16") else (700,)):
                    for in_place in (False, True):
                        salt += 1
                        esize = torch.tensor([], dtype=tdtypes[dtype]).element_size()
                        n_in, n_out = (WORLD * count, count) if rs else (count, WORLD * count)
                        if not in_place:
                            in_off = GUARD
                            out_off = (GUARD + n_in * esize + GUARD + 255) // 256 * 256
                        elif rs:
                            in_off = GUARD
                            out_off = in_off + g * count * esize
                        else:
                            out_off = GUARD
                            in_off = out_off + g * count * esize
                        mem = tensor_at(cbase, cbytes)
                        image = torch.full((cbytes,), (rank * 31 + salt) % 251, dtype=torch.uint8)
                        image[in_off:in_off + n_in * esize].copy_(values(dtype, n_in, g, salt).view(torch.uint8))
                        mem.copy_(image)
                        opf = _compat.OpFuture()
                        what = f"{name} {dtype} {op} count {count} {'in place' if in_place else 'apart'}"
                        try:
                            ceng.collective_device(name, DeviceBuffer(cbase + in_off, n_in, dtype, 0, 0),
                                                   DeviceBuffer(cbase + out_off, n_out, dtype, 0, 0), op, opf, "done")
                            opf.future.wait()
                        except RuntimeError as e:
                            fail(f"{what}: {e}")
                            continue
                        if rs:
                            stack = torch.stack([values(dtype, WORLD * count, q, salt)[g * count:(g + 1) * count]
                                                 .to(torch.float64) for q in range(WORLD)])
                            want = {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0).values,
                                    "max": stack.max(0).values}[op].to(tdtypes[dtype])
                        else:
                            want = torch.cat([values(dtype, count, q, salt) for q in range(WORLD)])
                        got = mem[out_off:out_off + n_out * esize].clone().view(tdtypes[dtype])
                        expected = image.clone()
                        expected[out_off:out_off + n_out * esize].copy_(want.view(torch.uint8))
                        wrong = int((got != want).sum())
                        elsewhere = int((mem != expected).sum()) - int((mem[out_off:out_off + n_out * esize] !=
                                                                        expected[out_off:out_off + n_out * esize]).sum())
                        report["checks"] += n_out
                        coll_ops += 1
                        if wrong or elsewhere:
                            fail(f"{what}: {wrong} wrong values, {elsewhere} bytes changed outside the output")
    # 4c. broadcast and reduce through the CUDA path (the same ranked group): roots on every rank,
    # every dtype x op, in one part and in several; the root's (broadcast) and the others'
    # (reduce) buffers only read, every byte checked
    rooted_ops = 0
    for name in ("broadcast", "reduce"):
        for dtype in tdtypes:
            for op in (("sum", "avg", "min", "max") if name == "reduce" else ("sum",)):
                if op == "avg" and dtype.startswith("int"):
                    continue
                for count in ((700, 40000) if dtype in ("float32", "bfloat16") else (700,)):
                    salt += 1
                    root = salt % WORLD
                    esize = torch.tensor([], dtype=tdtypes[dtype]).element_size()
                    at = GUARD + (salt % 8) * 64
                    mem = tensor_at(cbase, cbytes)
                    image = torch.full((cbytes,), (rank * 31 + salt) % 251, dtype=torch.uint8)
                    image[at:at + count * esize].copy_(values(dtype, count, g, salt).view(torch.uint8))
                    mem.copy_(image)
                    opf = _compat.OpFuture()
                    what = f"{name} {dtype} {op} count {count} root {root}"
                    try:
                        ceng.rooted_device(name, DeviceBuffer(cbase + at, count, dtype, 0, 0), root, op, opf, "done")
                        opf.future.wait()
                    except RuntimeError as e:
                        fail(f"{what}: {e}")
                        continue
                    expected = image.clone()
                    if name == "broadcast" and g != root:
                        expected[at:at + count * esize].copy_(values(dtype, count, root, salt).view(torch.uint8))
                    elif name == "reduce" and g == root:
                        stack = torch.stack([values(dtype, count, q, salt).to(torch.float64) for q in range(WORLD)])
                        want = {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0).values,
                                "max": stack.max(0).values}[op].to(tdtypes[dtype])
                        expected[at:at + count * esize].copy_(want.view(torch.uint8))
                    changed = int((mem != expected).sum())
                    report["checks"] += count
                    rooted_ops += 1
                    if changed:
                        fail(f"{what}: {changed} bytes differ from what the op must leave")
    # all_to_all of equal blocks through the CUDA path: every dtype, in one part and in several;
    # block q of the output is rank q's block for this rank, the input and the bytes around kept
    for dtype in tdtypes:
        for count in ((700, 9000) if dtype in ("float32", "bfloat16") else (700,)):
            salt += 1
            esize = torch.tensor([], dtype=tdtypes[dtype]).element_size()
            n = WORLD * count
            in_off = GUARD + (salt % 8) * 64
            out_off = (in_off + n * esize + GUARD + 255) // 256 * 256
            mem = tensor_at(cbase, cbytes)
            image = torch.full((cbytes,), (rank * 31 + salt) % 251, dtype=torch.uint8)
            image[in_off:in_off + n * esize].copy_(values(dtype, n, g, salt).view(torch.uint8))
            mem.copy_(image)
            opf = _compat.OpFuture()
            what = f"all_to_all {dtype} count {count}"
            try:
                ceng.collective_device("all_to_all", DeviceBuffer(cbase + in_off, n, dtype, 0, 0),
                                       DeviceBuffer(cbase + out_off, n, dtype, 0, 0), "sum", opf, "done")
                opf.future.wait()
            except RuntimeError as e:
                fail(f"{what}: {e}")
                continue
            want = torch.cat([values(dtype, n, q, salt)[g * count:(g + 1) * count] for q in range(WORLD)])
            expected = image.clone()
            expected[out_off:out_off + n * esize].copy_(want.view(torch.uint8))
            changed = int((mem != expected).sum())
            report["checks"] += n
            rooted_ops += 1
            if changed:
                fail(f"{what}: {changed} bytes differ from what the op must leave")
    class Host:
        """all_to_all_device's way through host memory, over the software device's memory (host
        memory at the same address), as ringd.torch's does it with tensor copies."""

        def __init__(self, ptr, count, dtype, out_ptr):
            self.ptr, self.count, self.dtype, self.out_ptr = ptr, count, dtype, out_ptr
            self.used = 0

        def read(self):
            self.used += 1
            esize = torch.tensor([], dtype=tdtypes[self.dtype]).element_size()
            return tensor_at(self.ptr, self.count * esize).view(tdtypes[self.dtype]).clone()

        def empty(self, count):
            return torch.empty(count, dtype=tdtypes[self.dtype])

        def finish(self, t, complete):
            tensor_at(self.out_ptr, t.numel() * t.element_size()).copy_(t.view(torch.uint8))
            complete()

    # all_to_all with split sizes through the CUDA path (one op, staged whole): every dtype, uneven
    # blocks with zeros; in the second round rank 1 sends nothing and rank 2 neither sends nor
    # receives anything (its place in the group's order: a slot op of nothing); the input, and
    # every byte around the output, kept
    a2av_ops = 0
    for dtype in tdtypes:
        for round_ in (0, 1):
            salt += 1
            esize = torch.tensor([], dtype=tdtypes[dtype]).element_size()

            def size(q, r):  # what rank q sends rank r
                if round_ and (q == 1 or 2 in (q, r)):
                    return 0
                return 0 if (q + 2 * r + salt) % 4 == 0 else 1 + (q * 301 + r * 97 + salt * 13) % 1500
            send = [size(g, r) for r in range(WORLD)]
            recv = [size(q, g) for q in range(WORLD)]
            in_off = GUARD + (salt % 8) * 64
            out_off = (in_off + sum(send) * esize + GUARD + 255) // 256 * 256
            mem = tensor_at(cbase, cbytes)
            image = torch.full((cbytes,), (rank * 31 + salt) % 251, dtype=torch.uint8)
            sent = values(dtype, sum(send), g, salt)
            image[in_off:in_off + sum(send) * esize].copy_(sent.view(torch.uint8))
            mem.copy_(image)
            opf = _compat.OpFuture()
            what = f"all_to_all with split sizes {dtype} round {round_} (sends {sum(send)}, receives {sum(recv)})"
            try:
                ceng.all_to_all_device(DeviceBuffer(cbase + in_off, sum(send), dtype, 0, 0),
                                       DeviceBuffer(cbase + out_off, sum(recv), dtype, 0, 0), send, recv,
                                       Host(cbase + in_off, sum(send), dtype, cbase + out_off), opf, "done")
                opf.future.wait()
            except RuntimeError as e:
                fail(f"{what}: {e}")
                continue
            want = torch.cat([values(dtype, sum(size(q, r) for r in range(WORLD)), q, salt)
                              [sum(size(q, r) for r in range(g)):][:size(q, g)] for q in range(WORLD)])
            expected = image.clone()
            expected[out_off:out_off + sum(recv) * esize].copy_(want.view(torch.uint8))
            changed = int((mem != expected).sum())
            report["checks"] += sum(recv)
            a2av_ops += 1
            if changed:
                fail(f"{what}: {changed} bytes differ from what the op must leave")
    if a2av_ops != 2 * len(tdtypes):
        fail(f"{a2av_ops} all_to_alls with split sizes checked, not {2 * len(tdtypes)}")
    # One too large for rank 3's staging range (256 KiB) goes through host memory there, the same
    # ringd op, exact on every rank; one too large for its slot (1 MiB), and one within the slot
    # but larger than what its staging range leaves of it, are refused in its place, every rank's
    # op failing at once naming it; then the group goes on, exact.
    for case, big_n in (("host", 10000), ("refused", 40000), ("refused", 26000), ("after", 40)):
        def size(q, r):
            return big_n if 3 in (q, r) else 40
        send, recv = [size(g, r) for r in range(WORLD)], [size(q, g) for q in range(WORLD)]
        in_off, out_off = GUARD, GUARD + (256 << 10)
        mem = tensor_at(cbase, cbytes)
        image = torch.full((cbytes,), 5, dtype=torch.uint8)
        if sum(send) * 4 <= (256 << 10) - GUARD and out_off + sum(recv) * 4 <= cbytes:
            image[in_off:in_off + sum(send) * 4].copy_(values("float32", sum(send), g, 77 + big_n).view(torch.uint8))
        mem.copy_(image)
        opf = _compat.OpFuture()
        host = Host(cbase + in_off, sum(send), "float32", cbase + out_off)
        t0 = time.monotonic()
        try:
            if case == "refused" and g == 3:  # (its buffers are not that large: what it reads is not used)
                host.read = lambda: torch.zeros(sum(send))
            ceng.all_to_all_device(DeviceBuffer(cbase + in_off, sum(send), "float32", 0, 0),
                                   DeviceBuffer(cbase + out_off, sum(recv), "float32", 0, 0), send, recv, host, opf, "done")
            opf.future.wait()
            if case == "refused":
                fail("an all_to_all larger than rank 3's slot succeeded")
                continue
            got = tensor_at(cbase + out_off, sum(recv) * 4).view(torch.float32)
            want = torch.cat([values("float32", sum(size(q, r) for r in range(WORLD)), q, 77 + big_n)
                              [sum(size(q, r) for r in range(g)):][:size(q, g)] for q in range(WORLD)])
            if not torch.equal(got, want):
                fail(f"all_to_all with split sizes ({case}): wrong values")
            elif host.used != (1 if case == "host" and g == 3 else 0):
                fail(f"all_to_all with split sizes ({case}): read through host memory {host.used} times on rank {g}")
            else:
                a2av_ops += 1
        except RuntimeError as e:
            if case != "refused":
                fail(f"all_to_all with split sizes ({case}): {e}")
            elif ("does not fit" if g == 3 else "refused it") not in str(e) or time.monotonic() - t0 > 3:
                fail(f"the refused all_to_all failed with {e} after {time.monotonic() - t0:.1f} s")
            else:
                a2av_ops += 1
    report["host_staged"] = ceng.device_host_ops
    report["a2av_ops"] = a2av_ops
    if a2av_ops != 2 * len(tdtypes) + 4:
        fail(f"{a2av_ops} all_to_alls with split sizes ran as they must, not {2 * len(tdtypes) + 4}")
    report["rooted_ops"] = rooted_ops
    planned = 8 + 30 + 8  # broadcast, reduce, all_to_all: the loops above (two counts for float32 and bfloat16)
    if rooted_ops != planned:
        fail(f"{rooted_ops} broadcast, reduce and all_to_all ops checked, not {planned}")
    report["collective_ops"] = coll_ops
    # 5. the last rank dies before the next op: the others fail within the op timeout, no stream hangs
    if rank == WORLD - 1:
        with open(out, "w") as f:
            json.dump(report, f)
        os._exit(0)
    time.sleep(0.5)
    t0 = time.monotonic()
    ticket, opf, mem, pattern, esize = run_op(block2, 1 << 20, "float32", "sum", 1000, 9)
    engine.stream_wait(ticket, s.value)
    check(cu["cuStreamSynchronize"](s), "sync after a failed op")
    try:
        opf.future.wait()
        fail("an op with a dead rank succeeded")
    except RuntimeError as e:
        report["dead_rank_error"] = str(e)[:200]
    report["dead_rank_seconds"] = round(time.monotonic() - t0, 2)
    if report["dead_rank_seconds"] > OP_TIMEOUT_S + 12:
        fail(f"the op with a dead rank failed only after {report['dead_rank_seconds']} s")
    with open(out, "w") as f:
        json.dump(report, f)
    os._exit(0)  # the engine's threads are daemons; the group is dead by now


def main(ringd_bin, client_lib, emulated_lib):
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch_cuda_path: no torch for this python: skipped")
        return 77
    tmp = tempfile.mkdtemp(prefix="ringd-torch-cuda-")
    src = os.environ.get("RINGD_SOURCE_DIR", ".")
    sys.path.insert(0, os.path.join(src, "client", "python"))
    sys.path.insert(0, os.path.join(src, "tests", "python"))
    from loopback_ring import LoopbackRing
    os.environ["RINGD_CLIENT_LIBRARY"] = client_lib
    ring = None
    try:
        ring = LoopbackRing(ringd_bin, tmp, HOSTS, cluster="torchcuda",
                            yaml=f"memory: {{slot_bytes: 4MiB, max_slots: 8}}\ncuda: {{provider: emulated}}\n"
                                 f"timeouts: {{op: {OP_TIMEOUT_S}s}}\ntcp: {{streams: 2}}\n")
        env = dict(os.environ, RINGD_CLIENT_LIBRARY=client_lib, RINGD_CUDA_PROVIDER="emulated",
                   RINGD_CUDA_EMULATED_LIBRARY=emulated_lib, PYTHONPATH=os.path.join(src, "client", "python"))
        if not ring.wait_up(15):
            raise RuntimeError(f"the ringds did not form a ring (see {tmp}/node*.log)")
        group = f"torch-cuda-{os.getpid()}"
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), ring.sockets[r // LOCAL], group,
                                   f"{tmp}/rank{r}.json"], env=env) for r in range(WORLD)]
        ok = True
        for r, p in enumerate(procs):
            try:
                rc = p.wait(240)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = "timeout"
            if rc != 0:
                print(f"rank {r}: exit {rc}")
                ok = False
        for r in range(WORLD):
            path = f"{tmp}/rank{r}.json"
            if not os.path.exists(path):
                print(f"rank {r}: no report")
                ok = False
                continue
            rep = json.load(open(path))
            print(json.dumps(rep))
            ok = ok and not rep["failures"]
        if not ok:
            for h in range(HOSTS):
                print(f"--- node{h}.log (tail)")
                print(ring.log_tail(h))
        print("torch_cuda_path: " + ("every value exact; registration cache, stream order, parts and failure held"
                                     if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        if ring is not None:
            ring.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    else:
        sys.exit(main(*sys.argv[1:4]))
