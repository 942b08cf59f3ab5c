"""ringd.torch: ringd as a torch.distributed backend.

    import ringd.torch                      # registers the backend "ringd"
    dist.init_process_group("ringd")        # torchrun's environment, as for "gloo"
    model = DistributedDataParallel(model)  # gradients are allreduced by the host's ringd
    model.register_comm_hook(None, ringd.torch.allreduce_hook)   # optional: fewer copies

allreduce of float32/float64/float16/bfloat16/int32/int64 tensors with SUM, AVG, MIN and MAX goes
through ringd: the tensor is copied into this process's shared-memory slot, reduced there with
every rank's (the local ranks on the host, then across hosts), and copied back. Everything else
(broadcast, allgather, barrier, reduce_scatter, other dtypes and ops) goes through a Gloo group
built from the same store, which gives the same result. Identity comes from the environment
torchrun sets: LOCAL_RANK and LOCAL_WORLD_SIZE (default 0 and 1), RINGD_SOCKET (default
/run/ringd/ringd.sock) and RINGD_SLOT_BYTES (default 256 MiB, at most ringd's memory.slot_bytes).
Any ringd error is a RuntimeError with ringd's message; ringd bounds every op by its own
timeouts.op, not by the process group's timeout.
"""
import collections
import datetime
import os
import select
import socket as _socket
import threading
import uuid
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

import ringd as _ringd


def _load_work_module():
    """ringd._torch_work (C++, built against this torch): installed next to this file, or in the
    build tree when running from the source tree."""
    try:
        from ringd import _torch_work
        return _torch_work
    except ImportError as first:
        import importlib.machinery
        import importlib.util
        here = os.path.dirname(os.path.abspath(__file__))
        root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
        build = os.environ.get("RINGD_BUILD_DIR") or os.path.join(root, "build")
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(build, "client", "python", "ringd", "_torch_work" + suffix)
            if os.path.exists(path):
                spec = importlib.util.spec_from_file_location("ringd._torch_work", path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                return mod
        raise ImportError(f"ringd.torch needs ringd._torch_work, built with ringd against this torch: {first}")


_tw = _load_work_module()

__all__ = ["ProcessGroupRingd", "allreduce_hook", "BACKEND"]

BACKEND = "ringd"
_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
           torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"}
_ALIGN = 64
_POLL_MS = 200  # the completion thread looks at least this often (ringd's contract deadlines)


def _op_name(op):
    for name, ref in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("min", dist.ReduceOp.MIN),
                      ("max", dist.ReduceOp.MAX)):
        if op == ref:
            return name
    return None


def _env_int(name, default):
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"ringd: {name}={text!r} is not an integer") from None


def _env_bytes(name, default):
    text = os.environ.get(name)
    if not text:
        return default
    units = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    if not num.isdigit() or unit not in units:
        raise RuntimeError(f"ringd: {name}={text!r} is not a size (e.g. 268435456 or 256MiB)")
    return int(num) * units[unit]


class _SlotSpace:
    """First-fit ranges of the slot, 64-byte aligned."""

    def __init__(self, size):
        self.size = size
        self.free = [(0, size)]  # sorted (offset, length)

    def alloc(self, n):
        n = (n + _ALIGN - 1) // _ALIGN * _ALIGN or _ALIGN
        for i, (off, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = (off + n, length - n)
                return off, n
        return None

    def release(self, off, n):
        self.free.append((off, n))
        self.free.sort()
        merged = []
        for o, l in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + l)
            else:
                merged.append((o, l))
        self.free = merged


class _Op:
    """One tensor's allreduce: one or more chunks, each a ringd op over its own slot range."""

    def __init__(self, tensor, flat, copy_back, future, result):
        self.tensor, self.flat, self.copy_back = tensor, flat, copy_back
        self.future, self.result = future, result
        self.chunks_left = 0
        self.error = None
        self.submitted_all = False


class _Engine:
    """The process's ringd client for one process group: submits from any thread, completes from
    its own thread, which polls ringd_fd and tests the tickets in flight."""

    def __init__(self, group, local_rank, local_size, slot_bytes, socket, timeout):
        self.client = _ringd.Client(group, local_rank, local_size, slot_bytes, socket)
        self.group = group
        self.timeout = timeout
        self.slot = torch.frombuffer(self.client.slot, dtype=torch.uint8)
        self.max_chunk = max(_ALIGN, self.client.slot_bytes // 4 // _ALIGN * _ALIGN)
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)
        self.space = _SlotSpace(self.client.slot_bytes)
        self.inflight = collections.OrderedDict()  # ticket -> (op, flat slice, slot view, (off, n))
        self.resident = {}  # comm hook bucket index -> (offset, length)
        self.closed = False
        self.dead = None  # ringd's message once the connection is unusable
        self.fd = self.client.fileno()
        self.thread = threading.Thread(target=self._complete_loop, name=f"ringd-{group}", daemon=True)
        self.thread.start()

    # -- submission (any thread) --

    def _deadline(self):
        return datetime.datetime.now() + self.timeout

    def _alloc(self, nbytes):
        """A slot range, waiting for earlier ops to give theirs back (within the timeout)."""
        end = self._deadline()
        while True:
            if self.dead:
                raise RuntimeError(self.dead)
            got = self.space.alloc(nbytes)
            if got:
                return got
            left = (end - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise RuntimeError(f"ringd: no room for {nbytes} bytes in the {self.client.slot_bytes}-byte slot "
                                   f"within {self.timeout} (set RINGD_SLOT_BYTES higher)")
            self.room.wait(min(left, 1.0))

    def _submit_locked(self, offset, count, dtype, op):
        end = self._deadline()
        while True:
            if self.dead:
                raise RuntimeError(self.dead)
            try:
                return self.client.submit(offset, count, dtype, op)
            except _ringd.RingdError as e:
                if e.code != -11:  # EAGAIN: too many ops in flight; wait for one to finish
                    raise RuntimeError(f"ringd: {e}") from None
            if datetime.datetime.now() >= end:
                raise RuntimeError(f"ringd: too many ops in flight for {self.timeout}")
            self.room.wait(0.05)

    def allreduce(self, tensor, op):
        """Allreduce `tensor` in place; returns a torch Future of [tensor]."""
        dtype = _DTYPES[tensor.dtype]
        contiguous = tensor.is_contiguous()
        flat = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
        fut = torch.futures.Future()
        rec = _Op(tensor, flat, not contiguous, fut, [tensor])
        esize = tensor.element_size()
        total = flat.numel()
        per_chunk = max(1, self.max_chunk // esize)
        if total == 0:
            fut.set_result([tensor])
            return fut
        start = 0
        while start < total:
            n = min(per_chunk, total - start)
            part = flat[start:start + n]
            with self.lock:
                off, length = self._alloc(n * esize)
            view = self.slot[off:off + n * esize].view(tensor.dtype)
            view.copy_(part)
            with self.lock:
                try:
                    ticket = self._submit_locked(off, n, dtype, op)
                except BaseException as e:
                    self.space.release(off, length)
                    self.room.notify_all()
                    # The chunks already in flight finish the future (with this error).
                    rec.submitted_all = True
                    rec.error = rec.error or str(e)
                    if rec.chunks_left == 0:
                        _tw.set_error(fut, rec.error)
                    raise
                rec.chunks_left += 1
                if start + n >= total:
                    rec.submitted_all = True
                self.inflight[ticket] = (rec, part, view, (off, length))
            start += n
        return fut

    def allreduce_resident(self, index, buffer, op):
        """The comm hook's path: bucket `index` lives in its own slot range from one step to the
        next, and the result is that range itself (no copy back: DDP copies out of it)."""
        nbytes = buffer.numel() * buffer.element_size()
        with self.lock:
            have = self.resident.get(index)
            if have is None or have[1] < nbytes or have[1] > 2 * nbytes + _ALIGN:
                if have is not None:
                    self.space.release(*have)
                    del self.resident[index]
                got = self.space.alloc(nbytes) if nbytes <= self.client.slot_bytes // 2 else None
                if got is None:
                    return None  # does not fit beside the others: the copying path
                self.resident[index] = have = got
        off = have[0]
        view = self.slot[off:off + nbytes].view(buffer.dtype).view(buffer.shape)
        view.copy_(buffer)
        fut = torch.futures.Future()
        rec = _Op(view, None, False, fut, view)
        with self.lock:
            ticket = self._submit_locked(off, buffer.numel(), _DTYPES[buffer.dtype], op)
            rec.chunks_left = 1
            rec.submitted_all = True
            self.inflight[ticket] = (rec, None, None, None)
        return fut

    # -- completion (its own thread) --

    def _complete_loop(self):
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while not self.closed:
            try:
                poller.poll(_POLL_MS)
            except InterruptedError:
                continue
            if self.closed:
                return
            done = []
            with self.lock:
                for ticket in list(self.inflight):
                    try:
                        if not self.client.test(ticket):
                            continue
                        err = None
                    except _ringd.RingdError as e:
                        err = str(e)
                        if e.code in (-71, -104, -32):  # EPROTO, ECONNRESET, EPIPE: the connection is gone
                            self.dead = f"ringd: {e}"
                    done.append((ticket, self.inflight.pop(ticket), err))
            for ticket, (rec, part, view, rng), err in done:
                if err is None and part is not None:
                    part.copy_(view)
                if err is not None and rec.error is None:
                    rec.error = err
                with self.lock:
                    if rng is not None:
                        self.space.release(*rng)
                    rec.chunks_left -= 1
                    finished = rec.chunks_left == 0 and rec.submitted_all
                    self.room.notify_all()
                if finished:
                    self._finish(rec)
            if self.dead:
                with self.lock:
                    self.room.notify_all()

    def _finish(self, rec):
        if rec.error is not None:
            _tw.set_error(rec.future, f"ringd: {rec.error}")
            return
        if rec.copy_back:
            rec.tensor.copy_(rec.flat.view(rec.tensor.shape))
        rec.future.set_result(rec.result)

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.thread.join(timeout=2 * _POLL_MS / 1000)
        del self.slot
        self.client.close()


def _local_address_toward(host):
    """This host's address on the route to `host` (no packet is sent)."""
    try:
        with _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return ""


def _gloo_group(store, rank, size, timeout):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface)]
    else:
        addr = _local_address_toward(os.environ.get("MASTER_ADDR", "")) if os.environ.get("MASTER_ADDR") else ""
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr) if addr
                         else dist.ProcessGroupGloo.create_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore("ringd-gloo/", store), rank, size, opts)


class ProcessGroupRingd(ProcessGroup):
    """allreduce through ringd; the other collectives through an internal Gloo group."""

    def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
        super().__init__(rank, size)
        local_rank = _env_int("LOCAL_RANK", 0)
        local_size = _env_int("LOCAL_WORLD_SIZE", 1)
        socket = os.environ.get("RINGD_SOCKET") or _ringd.DEFAULT_SOCKET
        slot_bytes = _env_bytes("RINGD_SLOT_BYTES", 256 << 20)
        try:
            st = _ringd.status(socket)
        except _ringd.RingdError as e:
            raise RuntimeError(f"ringd: {e}") from None
        hosts = int(st.get("ring", {}).get("size", 1))
        if size != hosts * local_size:
            raise RuntimeError(f"ringd: WORLD_SIZE {size} is not the ring's {hosts} host(s) x LOCAL_WORLD_SIZE "
                               f"{local_size} = {hosts * local_size}: every host of the ring runs LOCAL_WORLD_SIZE "
                               f"ranks of the job")
        limit = st.get("memory", {}).get("slot_bytes_limit")
        if limit and "RINGD_SLOT_BYTES" not in os.environ:
            slot_bytes = min(slot_bytes, int(limit))
        # A fresh ringd group per process group: every job, and every restart, starts clean.
        key = "ringd/group"
        if rank == 0:
            store.set(key, f"torch-{uuid.uuid4().hex[:20]}")
        group = store.get(key).decode()
        try:
            self._engine = _Engine(group, local_rank, local_size, slot_bytes, socket, timeout)
        except _ringd.RingdError as e:
            raise RuntimeError(f"ringd: {e}") from None
        weakref.finalize(self, _Engine.close, self._engine)
        self._gloo = _gloo_group(store, rank, size, timeout)
        self.ringd_group = group

    def getBackendName(self):
        return BACKEND

    def _ringd_op(self, tensors, op):
        """The ringd op name when ringd can do this allreduce, else None (Gloo does it)."""
        if len(tensors) != 1:
            return None
        t = tensors[0]
        if t.device.type != "cpu":
            raise RuntimeError(f"ringd: {t.device.type} tensors are not supported yet (CUDA comes with ringd's "
                               "CUDA support); move the tensor to the CPU or use the nccl backend")
        if t.is_sparse or t.dtype not in _DTYPES:
            return None
        name = _op_name(op)
        if name == "avg" and not t.dtype.is_floating_point:
            raise RuntimeError(f"ringd: AVG of {t.dtype} is not defined (an integer mean); use SUM")
        return name

    def allreduce(self, tensors, opts=None):
        if opts is None or isinstance(opts, dist.ReduceOp):
            op = opts if isinstance(opts, dist.ReduceOp) else dist.ReduceOp.SUM
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
        name = self._ringd_op(tensors, opts.reduceOp)
        if name is None:
            if _op_name(opts.reduceOp) == "avg":
                raise RuntimeError("ringd: AVG needs one float32/float64/float16/bfloat16/int tensor")
            return self._gloo.allreduce(tensors, opts)
        fut = self._engine.allreduce(tensors[0], name)
        return _tw.work(fut, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        works = [self.allreduce([t], self._coalesced_opts(opts)) for t in tensors]
        fut = torch.futures.collect_all([w.get_future() for w in works])
        out = torch.futures.Future()

        def done(f):
            try:
                for each in f.value():
                    each.value()
                out.set_result(tensors)
            except RuntimeError as e:
                _tw.set_error(out, str(e))
        fut.add_done_callback(done)
        return _tw.work(out, tensors)

    @staticmethod
    def _coalesced_opts(opts):
        o = dist.AllreduceOptions()
        if opts is not None:
            o.reduceOp = opts.reduceOp
        return o

    def hook_allreduce(self, index, buffer):
        """The comm hook: averages bucket `index` in its own slot range; a Future of the result."""
        name = self._ringd_op([buffer], dist.ReduceOp.AVG)
        if name is None:
            return None
        fut = self._engine.allreduce_resident(index, buffer, name)
        if fut is None:
            fut = self._engine.allreduce(buffer, name)
            out = torch.futures.Future()
            fut.add_done_callback(lambda f: _chain_first(f, out))
            return out
        return fut

    # The rest through Gloo (identical results).
    def broadcast(self, *args, **kwargs):
        return self._gloo.broadcast(*args, **kwargs)

    def allgather(self, *args, **kwargs):
        return self._gloo.allgather(*args, **kwargs)

    def _allgather_base(self, *args, **kwargs):
        return self._gloo._allgather_base(*args, **kwargs)

    def allgather_coalesced(self, *args, **kwargs):
        return self._gloo.allgather_coalesced(*args, **kwargs)

    def gather(self, *args, **kwargs):
        return self._gloo.gather(*args, **kwargs)

    def scatter(self, *args, **kwargs):
        return self._gloo.scatter(*args, **kwargs)

    def reduce(self, *args, **kwargs):
        return self._gloo.reduce(*args, **kwargs)

    def reduce_scatter(self, *args, **kwargs):
        return self._gloo.reduce_scatter(*args, **kwargs)

    def _reduce_scatter_base(self, *args, **kwargs):
        return self._gloo._reduce_scatter_base(*args, **kwargs)

    def alltoall(self, *args, **kwargs):
        return self._gloo.alltoall(*args, **kwargs)

    def alltoall_base(self, *args, **kwargs):
        return self._gloo.alltoall_base(*args, **kwargs)

    def barrier(self, *args, **kwargs):
        return self._gloo.barrier(*args, **kwargs)

    def monitored_barrier(self, *args, **kwargs):
        return self._gloo.monitored_barrier(*args, **kwargs)

    def send(self, *args, **kwargs):
        return self._gloo.send(*args, **kwargs)

    def recv(self, *args, **kwargs):
        return self._gloo.recv(*args, **kwargs)

    def recv_anysource(self, *args, **kwargs):
        return self._gloo.recv_anysource(*args, **kwargs)


def _chain_first(f, out):
    try:
        out.set_result(f.value()[0])
    except RuntimeError as e:
        _tw.set_error(out, str(e))


def allreduce_hook(state, bucket):
    """DDP comm hook (model.register_comm_hook(None, ringd.torch.allreduce_hook)): averages each
    bucket in ringd with the bucket kept in the slot, so that DDP copies the result straight out
    of shared memory. `state` is the ringd process group, or None for the default group."""
    pg = state if state is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupRingd):
        raise RuntimeError("ringd.torch.allreduce_hook needs a ringd process group (init_process_group(\"ringd\"))")
    fut = pg.hook_allreduce(bucket.index(), bucket.buffer())
    if fut is None:  # not a ringd dtype: Gloo's average, as DDP's default hook computes it
        buf = bucket.buffer().div_(pg.size())
        return pg._gloo.allreduce([buf]).get_future().then(lambda f: f.value()[0])
    return fut


def _create(store, rank, size, timeout):
    return ProcessGroupRingd(store, rank, size, timeout)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create)
