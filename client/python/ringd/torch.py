"""ringd.torch: ringd as a torch.distributed backend.

    import ringd.torch                      # registers the backend "ringd"
    dist.init_process_group("ringd")        # torchrun's environment, as for "gloo"
    model = DistributedDataParallel(model)  # gradients are allreduced by the host's ringd
    model.register_comm_hook(None, ringd.torch.allreduce_hook)   # optional: fewer copies

allreduce of float32/float64/float16/bfloat16/int32/int64 tensors with SUM, AVG, MIN and MAX goes
through ringd: the tensor is copied into this process's shared-memory slot, reduced there with
every rank's (the local ranks on the host, then across hosts), and copied back. Everything else
(broadcast, allgather, barrier, reduce_scatter, other dtypes and ops) goes through a Gloo group
built from the same store, which gives the same result. Every process group (the default one and
each new_group) is a ringd group over the hosts of its ranks (all of the ring's, or part of them),
its ranks on a host ordered by LOCAL_RANK (torchrun sets it; default 0).
RINGD_SOCKET (default /run/ringd/ringd.sock) and RINGD_SLOT_BYTES (default 256 MiB, at most
ringd's memory.slot_bytes) configure the client.
Any ringd error is a RuntimeError with ringd's message. The process group's timeout
(init_process_group(timeout=...), new_group(timeout=...)) is its ringd group's op timeout: every op
ends within it of its first submission on a host (clamped to ringd's timeouts.op_max); a dead or
hung host is found by ringd's heartbeats within seconds whatever it is.
"""
import collections
import datetime
import errno
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
from ringd import _compat


__all__ = ["ProcessGroupRingd", "allreduce_hook", "BACKEND", "DeviceBuffer"]

BACKEND = "ringd"
_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
           torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"}
_ALIGN = 64
_POLL_MS = 200  # the completion thread looks at least this often (ringd's contract deadlines)
# The bytes of a group's ops in flight at once (at least one op): enough for the next op to be in
# the slot when the ring finishes one, not so much that every rank copies all its buckets into
# its slot at once and takes the CPUs from the ring (bench/ddp --allreduce-only --timeline).
_WINDOW_BYTES = 64 << 20
# A tensor's first ringd op: the ring starts once every local rank has copied this much, not the
# whole bucket (8 ranks copying 25 MiB each at once on 2 cores held it back ~30 ms).
_FIRST_CHUNK_BYTES = 4 << 20
# Device allocations a group keeps registered with ringd (ringd allows 4096 per client).
_MAX_DEVICE_REGISTRATIONS = 1024


def _premul_factor(op):
    """PREMUL_SUM's factor (a float or a 0-d tensor: FSDP2's gradient divide factor), or None for
    any other op (torch 1.13 has no factor to read)."""
    inner = getattr(op, "op", op)
    if inner != getattr(dist.ReduceOp, "PREMUL_SUM", None) and not (
            hasattr(dist.ReduceOp, "RedOpType") and inner == getattr(dist.ReduceOp.RedOpType, "PREMUL_SUM", None)):
        return None
    try:
        return op.factor
    except (AttributeError, RuntimeError):
        raise RuntimeError("ringd: PREMUL_SUM without a factor; make it with dist.ReduceOp.PREMUL_SUM(factor), or use "
                           "SUM or AVG") from None


def _premultiply(tensor, op):
    """PREMUL_SUM(f) as SUM of f x each input (NCCL's meaning): `tensor` scaled in place; the op
    to run."""
    factor = _premul_factor(op)
    if factor is None:
        return op
    if not tensor.dtype.is_floating_point:
        raise RuntimeError(f"ringd: PREMUL_SUM of {tensor.dtype} is not defined (a float factor); use SUM")
    with torch.no_grad():
        tensor.mul_(factor.to(tensor.device) if isinstance(factor, torch.Tensor) else factor)
    return dist.ReduceOp.SUM


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


def _chunk_bytes(slot_bytes):
    """The largest ringd op of a group whose smallest slot is `slot_bytes`: a quarter of it, so that
    several ops are in flight at once (DDP's buckets), 64-byte aligned."""
    return max(_ALIGN, slot_bytes // 4 // _ALIGN * _ALIGN)


def _chunks(count, esize, max_chunk):
    """The element counts of the ringd ops of a tensor of `count` elements (the same on every
    rank: a function of the count and the group's max_chunk): the first one small, so that the
    ring starts after a short copy, each next one twice as big, up to max_chunk bytes."""
    first = _FIRST_CHUNK_BYTES
    n = max(1, min(first, max_chunk) // esize)
    while count > 0:
        take = min(n, count)
        yield take
        count -= take
        n = max(1, min(n * 2 * esize, max_chunk) // esize)


def _distinct_elements(t):
    """A view of `t` with each of its memory locations once: an expanded (stride-0) dimension
    becomes one element, so that an expanded tensor is reduced as the memory it refers to, and
    every element of it reads that location's result. Elements that overlap otherwise
    (as_strided) have no defined result: a RuntimeError, the same on every rank."""
    if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        t = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]
    overlap = torch._debug_has_internal_overlap(t)  # 0 no, 1 yes, 2 cannot tell from the strides
    if overlap == 2 and t.numel() > 1:
        # Dimensions by stride: none overlaps when each stride passes the farthest element the
        # smaller ones reach (slices with steps, narrowed dimensions: every non-dense view).
        reach, overlap = 0, 0
        for st, n in sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1):
            if st <= reach:
                overlap = 2
                break
            reach += (n - 1) * st
        if overlap == 2:  # strides that interleave (as_strided): count the distinct locations
            where = torch.arange(1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())))
            overlap = int(where.as_strided(t.shape, [abs(st) for st in t.stride()]).unique().numel() != t.numel())
    if overlap == 1:
        raise RuntimeError(f"ringd: the tensor's elements overlap in memory (shape {tuple(t.shape)}, strides "
                           f"{t.stride()}): an allreduce of it has no defined result; reduce a clone()")
    return t


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
    """One tensor's allreduce: chunks of at most max_chunk bytes, each a ringd op over a range of
    the slot (its own, or the comm hook's kept range)."""

    def __init__(self, tensor, flat, copy_back, future, result, op, dtype):
        self.tensor, self.flat, self.copy_back = tensor, flat, copy_back
        self.future, self.result = future, result
        self.op, self.dtype = op, dtype
        self.chunks_left = 0  # submitted and not yet completed
        self.error = None
        self.submitted_all = False
        self.several = False  # more than one ringd op
        self.reported = False  # its future is completed (or queued to be): later pieces only clean up
        self.resident = None  # the comm hook's range record, busy until the op ends
        self.view = None  # the resident op's whole range (its input is copied there)
        self.keep = None  # a device op's own buffer (a contiguous copy), alive until it ends
        self.stream = None  # a device op whose result is copied back on this stream
        self.deferred = False  # its caller still queues work after it: finishing waits for release_finish
        self.finish_due = False  # it ended while deferred


class DeviceBuffer:
    """What ringd's CUDA path needs of a device tensor: its address, element count, ringd dtype
    name ("float32", ...), CUDA device index and the stream (cudaStream_t as an int, 0: the legacy
    default stream) whose queued work produces it. The backend makes one of each CUDA tensor;
    tests make them of memory of ringd's software CUDA device."""

    __slots__ = ("ptr", "count", "dtype", "device", "stream")

    def __init__(self, ptr, count, dtype, device, stream):
        self.ptr, self.count, self.dtype, self.device, self.stream = int(ptr), int(count), dtype, device, int(stream)


class _Resident:
    """A comm hook bucket's slot range, kept from one step to the next."""

    def __init__(self, rng):
        self.rng = rng
        self.busy = False
        self.last_use = 0


class _ProcessSlot:
    """The shared memory of this process on one host's ringd, for all its process groups: the
    first group's client has the slot, and every other group's client joins with that slot's data
    area (ringd_options.share_slot_of), so that a process takes one of the host's slots however
    many groups it is in (new_group, hybrid sharding). Its ranges, the comm hook's kept ranges
    and one lock (with `room`, the condition of every wait for a range or a ticket) are the
    process's, for all groups."""

    def __init__(self, client):
        import ctypes
        self.clients = [client]
        self.bytes = client.slot_bytes
        # Tensors over the slot come from this view, not from a client's own: a group's client can
        # then close while others use the memory; the last one stays open while they are alive.
        self.view = memoryview((ctypes.c_char * self.bytes).from_address(client.slot_address)).cast("B")
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)
        self.space = _SlotSpace(self.bytes)
        self.resident_bytes = 0
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)
        # The mapping outlives the clients: ranges are released only once ringd is done with them,
        # and the comm hook hands out tensors over the slot (set when it does), which may outlive
        # the process groups: then the memory stays mapped for the process's life.
        self.hold, self.unhold = client.hold_slot(), client.unhold_slot
        self.handed_out = False


_process_slots = {}  # socket path -> _ProcessSlot
_process_slots_lock = threading.Lock()


def _timeout_ms(timeout):
    """A process group's timeout (a timedelta, or None) as a ringd op timeout in ms (0: ringd's)."""
    if timeout is None:
        return 0
    return max(1, min(int(timeout.total_seconds() * 1000), 0xFFFFFFFF))


def _connect(group, local_rank, local_size, slot_bytes, socket, hosts, timeout=None):
    """A client of `group` on this process's slot of that ringd (made by the first group); its
    ops bounded by the process group's `timeout`."""
    with _process_slots_lock:
        ps = _process_slots.get(socket)
        if ps is not None:
            try:
                client = _ringd.Client(group, local_rank, local_size, slot_bytes, socket, hosts=hosts,
                                       share_slot_of=ps.clients[0], op_timeout_ms=_timeout_ms(timeout))
                if client.slot_address != ps.clients[0].slot_address or client.slot_bytes != ps.bytes:
                    # A client library that does not know share_slot_of gave it a slot of its own.
                    client.close()
                    raise _ringd.RingdError(-errno.EPROTO, "this libringd-client does not share slots")
                ps.clients.append(client)
                return client, ps
            except _ringd.RingdError as e:
                if "slot" not in str(e) and "frame type" not in str(e):
                    raise
                # A ringd that does not share slots (older), or whose sharing refused: a slot of its own.
        client = _ringd.Client(group, local_rank, local_size, slot_bytes, socket, hosts=hosts,
                               op_timeout_ms=_timeout_ms(timeout))
        ps = _ProcessSlot(client)
        if socket not in _process_slots:
            _process_slots[socket] = ps
        return client, ps


def _disconnect(client, ps, socket):
    """Closes a group's client (it leaves its ringd group). The process's slot stays mapped while
    another group uses it; after the last one, until the process ends if the comm hook handed out
    tensors over it (they may still be referenced), else it is unmapped."""
    with _process_slots_lock:
        if client in ps.clients:
            ps.clients.remove(client)
        last = not ps.clients
        if last and _process_slots.get(socket) is ps:
            del _process_slots[socket]
    client.close()
    if last and not ps.handed_out and ps.hold:
        ps.tensor = None
        ps.unhold(ps.hold)
        ps.hold = None


class _Engine:
    """The process's ringd client for one process group. allreduce() (any thread) queues the op
    and returns its future at once; a submitting thread copies each op's chunks into the slot and
    submits them, in the order they were queued (the same on every rank), while at most
    `window` bytes are in flight, so that the copies are spread over the ring's work instead of
    all taking the CPUs at once; a completing thread polls ringd_fd, tests the tickets in flight
    and copies results back; futures are completed (and their callbacks run) on a fourth thread,
    so a callback may submit again."""

    def __init__(self, group, local_rank, local_size, slot_bytes, socket, timeout, hosts=None, max_chunk=None):
        self.client, self.ps = _connect(group, local_rank, local_size, slot_bytes, socket, hosts, timeout)
        self.socket = socket
        self.group = group
        self.timeout = timeout
        self.slot = self.ps.tensor
        # The most bytes of one ringd op: the group's ranks split a tensor the same way whatever
        # their slots (the smallest rank's, ProcessGroupRingd), a quarter of it (several in flight).
        self.max_chunk = max_chunk or _chunk_bytes(self.ps.bytes)
        self.window = max(self.max_chunk, _WINDOW_BYTES)
        # The client, the slot's ranges, the queue, the ops in flight: the process's lock, for all
        # its groups (their ranges are of the same memory); `room`: a range, a ticket or window
        # came free, an op was queued.
        self.lock, self.room, self.space = self.ps.lock, self.ps.room, self.ps.space
        self.pending = collections.deque()  # ops queued, not yet wholly submitted (the first one in progress)
        self.inflight = collections.OrderedDict()  # ticket -> (op, flat slice, slot view, (off, n), bytes)
        self.inflight_bytes = 0
        self.resident = {}  # comm hook: (bucket buffer's address, bytes, dtype) -> _Resident
        self.hook_calls = 0
        # Device ops: the GPU, part size and staging range (set by the first), registrations by
        # allocation base (size, driver buffer id, registration), least recently used first.
        self.device = None
        self.device_part = self.staging_bytes = 0
        self.staging = None
        self.device_regs = collections.OrderedDict()
        self.device_ops = self.device_registrations = self.device_last_reg = 0
        self.closed = False  # the submitting and completing threads stop
        self.closing = False
        self.finisher_stop = False  # the finishing thread stops once nothing is left to finish
        self.dead = None  # why this group cannot be used any more (nothing new is submitted)
        # Why the connection to ringd is gone: then no ticket in flight can complete, and they fail
        # at once. Only then are their slot ranges given back without their results: while ringd
        # runs an op it may still write its range, which another group of this process could have
        # taken by then.
        self.lost = None
        self.fd = self.client.fileno()
        self.finished = collections.deque()
        self.defer_lock = threading.Lock()  # deferred ops' finishing (allreduce_device, release_finish)
        self.finish_ready = threading.Condition(threading.Lock())
        self.threads = [threading.Thread(target=self._submit_loop, name=f"ringd-{group}-in", daemon=True),
                        threading.Thread(target=self._complete_loop, name=f"ringd-{group}", daemon=True),
                        threading.Thread(target=self._finish_loop, name=f"ringd-{group}-done", daemon=True)]
        for t in self.threads:
            t.start()

    # -- queueing (any thread) --

    def allreduce(self, tensor, op):
        """Allreduce `tensor` in place; returns a torch Future of [tensor]. The tensor must stay
        as it is until the future completes (as with every backend's async ops)."""
        dtype = _DTYPES[tensor.dtype]
        given = tensor.detach()  # ringd's result is not part of any graph (as with every backend)
        tensor = _distinct_elements(given)  # each memory location once (expanded tensors)
        contiguous = tensor.is_contiguous()
        flat = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
        opf = _compat.OpFuture()
        rec = _Op(tensor, flat, not contiguous, opf, [given], op, dtype)
        if flat.numel() == 0:
            opf.set_result([given])
            return opf.future
        self._queue(rec)
        return opf.future

    def allreduce_resident(self, buffer, op):
        """The comm hook's path: the bucket (DDP's buffer, the same storage every step) has its
        own slot range from one step to the next, and the result is that range itself (no copy
        back: DDP copies out of it before the bucket's next step). None: the copying path (the
        range is still busy, or the ranges kept would pass half the slot). Its ringd ops are
        those of the copying path (max_chunk bytes each), so either path pairs with the other."""
        nbytes = buffer.numel() * buffer.element_size()
        key = (buffer.data_ptr(), nbytes, buffer.dtype)
        with self.lock:
            self.hook_calls += 1
            res = self.resident.get(key)
            if res is None:
                self._evict_stale()
                if self.ps.resident_bytes + nbytes > self.ps.bytes // 2:
                    return None
                rng = self.space.alloc(nbytes)
                if rng is None:
                    return None
                res = self.resident[key] = _Resident(rng)
                self.ps.resident_bytes += rng[1]
            if res.busy:
                return None
            res.busy = True
            res.last_use = self.hook_calls
        off = res.rng[0]
        # A tensor of its own over the range (storage offset 0): DDP takes views of the result
        # with as_strided at offsets from the start of its storage.
        view = torch.frombuffer(self.ps.view[off:off + nbytes], dtype=buffer.dtype).view(buffer.shape)
        self.ps.handed_out = True
        opf = _compat.OpFuture()
        rec = _Op(view, buffer.detach().view(-1), False, opf, view, op, _DTYPES[buffer.dtype])
        rec.resident, rec.view = res, view.view(-1)
        try:
            self._queue(rec)
        except BaseException:
            with self.lock:
                res.busy = False
            raise
        return opf.future

    # -- device buffers (CUDA; any thread) --

    def allreduce_device(self, buf, op, opf, result, keep=None, stream=None, deferred=False):
        """Submits the allreduce of a DeviceBuffer now, in the caller's thread (so that ringd reads
        it after what buf.stream queued so far); returns (ticket, op record). `opf` (an OpFuture)
        completes with `result` once the result is in the buffer. The ops queued before it on
        the copying path go first (one order on every rank). `keep`: kept alive until the op ends.
        `deferred`: the caller queues more work for the result (on `stream`, a torch stream, where
        the future's event is then recorded): the future completes only after
        release_finish(record)."""
        rec = _Op(None, None, False, opf, result, op, buf.dtype)
        rec.keep = keep
        rec.stream = stream
        rec.deferred = deferred
        with self.lock:
            self._wait_locked(lambda: not self.pending, f"ringd: the ops queued before did not go within {self.timeout}")
            try:
                self._device_setup_locked(buf.device)
                reg = self._device_registration_locked(buf)
                ticket = self._submit_device_locked(buf, op)
            except BaseException as e:
                if not self.dead:
                    self.dead = (f"ringd: a device op of group {self.group} could not be submitted ({e}); this "
                                 "process group cannot be used any more: restart the job")
                raise RuntimeError(str(e) if str(e).startswith("ringd") else f"ringd: {e}") from None
            rec.chunks_left, rec.submitted_all = 1, True
            self.device_ops += 1
            self.device_last_reg = reg
            self.inflight[ticket] = (rec, None, None, None, 0)
            self.room.notify_all()  # the completion thread waits for work when nothing is in flight
        return ticket, rec

    def release_finish(self, rec):
        """The caller queued what follows a deferred op (allreduce_device's `stream`): its future
        may complete now, or as soon as the op ends."""
        with self.defer_lock:
            rec.deferred = False
            due, rec.finish_due = rec.finish_due, False
        if due:
            self._finish(rec)

    def stream_wait(self, ticket, stream):
        """Makes `stream` wait (without blocking the host) until device op `ticket`'s result is in
        its buffer, or it failed; never for longer than ringd's op deadline."""
        with self.lock:
            try:
                self.client.stream_wait(ticket, stream)
            except _ringd.RingdError as e:
                raise RuntimeError(f"ringd: {e}") from None

    def _device_setup_locked(self, device):
        """The first device op: the group's part size (the same on every rank: a function of the
        group's smallest slot) and its own staging range of the process's slot, four parts, so
        that a part is copied in while one is on the ring and one is copied out."""
        if self.device is not None:
            if device != self.device:
                raise RuntimeError(f"ringd: this process group's ops are on cuda:{self.device}; a process drives "
                                   f"one GPU per process group (not cuda:{device})")
            return
        part = max(64 << 10, self.max_chunk // 4 // 4096 * 4096)
        # Four parts (one copied in, one on the ring, one copied out, one spare) when the process's
        # slot has room beside its other groups' ranges; else fewer, at least one (waited for).
        for staging in (4 * part, 2 * part):
            rng = self.space.alloc(staging + 256)
            if rng is not None:
                break
        else:
            staging = part
            rng = self._alloc_locked(staging + 256)
        offset = (rng[0] + 255) // 256 * 256
        try:
            self.client.set_cuda_part_bytes(part)
            self.client.set_cuda_staging(offset, staging)
        except BaseException:
            self.space.release(*rng)
            raise
        self.device, self.device_part, self.staging, self.staging_bytes = device, part, rng, staging

    def _device_registration_locked(self, buf):
        """The ringd registration of the driver allocation holding the buffer: made once per
        allocation (torch's caching allocator hands out blocks of a few large ones) and made again
        only when the allocation at that address is another one (the allocator gave the memory back
        and got new memory there: the driver's buffer id differs)."""
        base, size, ident = self.client.cuda_allocation(buf.ptr)
        hit = self.device_regs.get(base)
        if hit is not None and hit[0] == size and hit[1] == ident:
            self.device_regs.move_to_end(base)
            return hit[2]
        # Registrations that overlap this allocation are of memory given back: gone too (ringd
        # would otherwise find the stale one for this pointer).
        for b, (n, _, reg) in list(self.device_regs.items()):
            if b < base + size and base < b + n:
                del self.device_regs[b]
                self._device_unregister_locked(reg)
        for b in list(self.device_regs)[:max(0, len(self.device_regs) + 1 - _MAX_DEVICE_REGISTRATIONS)]:
            if self._device_unregister_locked(self.device_regs[b][2]):
                del self.device_regs[b]
        reg = self.client.register_cuda(base, size)
        self.device_regs[base] = (size, ident, reg)
        self.device_registrations += 1
        return reg

    def _device_unregister_locked(self, reg):
        """False while an op with parts still to go uses it (kept for now)."""
        try:
            self.client.unregister_cuda(reg)
        except _ringd.RingdError as e:
            if e.code == -errno.EBUSY:
                return False
            # Otherwise ringd let go of it already (the connection is gone).
        return True

    def _submit_device_locked(self, buf, op):
        end = datetime.datetime.now() + self.timeout
        while True:
            if self.dead:
                raise RuntimeError(self.dead)
            try:
                return self.client.submit_cuda(buf.ptr, buf.count, buf.dtype, op, buf.stream)
            except _ringd.RingdError as e:
                if e.code != -errno.EAGAIN:  # EAGAIN: too many ops in flight; wait for one to finish
                    raise
            if datetime.datetime.now() >= end:
                raise RuntimeError(f"ringd: too many ops in flight for {self.timeout}")
            self.room.wait(0.05)

    def _queue(self, rec):
        with self.lock:
            if self.dead:
                raise RuntimeError(self.dead)
            self.pending.append(rec)
            self.room.notify_all()

    def _evict_stale(self):
        """Ranges of buckets DDP no longer has (it rebuilds them after the first step): unused for
        many hook calls and not busy. Their last result was consumed long ago."""
        horizon = max(16, 4 * len(self.resident))
        for key, res in list(self.resident.items()):
            if not res.busy and self.hook_calls - res.last_use > horizon:
                self.space.release(*res.rng)
                self.ps.resident_bytes -= res.rng[1]
                del self.resident[key]

    # -- submission (its own thread) --

    def _wait_locked(self, ready, what):
        """Waits (holding the lock, on `room`) until ready() or the group is dead, within the
        process group's timeout."""
        end = datetime.datetime.now() + self.timeout
        while not self.dead and not ready():
            left = (end - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise RuntimeError(what)
            self.room.wait(min(left, 1.0))
        if self.dead:
            raise RuntimeError(self.dead)

    def _submit_loop(self):
        while True:
            with self.lock:
                while not self.pending and not self.closed:
                    self.room.wait(1.0)
                if self.closed:
                    return
                rec = self.pending[0]
            self._submit(rec)
            with self.lock:
                self.pending.popleft()
                self.room.notify_all()

    def _submit(self, rec):
        esize, total = rec.flat.element_size(), rec.flat.numel()
        start = 0
        try:
            for n in _chunks(total, esize, self.max_chunk):
                nbytes = n * esize
                rng = None
                with self.lock:
                    self._wait_locked(lambda: not self.inflight_bytes or self.inflight_bytes + nbytes <= self.window,
                                      f"ringd: the ops in flight did not end within {self.timeout}")
                    if rec.resident is None:
                        rng = self._alloc_locked(nbytes)
                part = rec.flat[start:start + n]
                try:
                    if rec.resident is None:
                        view = self.slot[rng[0]:rng[0] + nbytes].view(rec.flat.dtype)
                        offset = rng[0]
                    else:
                        view = rec.view[start:start + n]
                        offset = rec.resident.rng[0] + start * esize
                    with torch.no_grad():
                        view.copy_(part)
                    with self.lock:
                        ticket = self._submit_locked(offset, n, rec.dtype, rec.op)
                        rec.chunks_left += 1
                        rec.several = rec.several or n < total
                        rec.submitted_all = start + n >= total
                        self.inflight_bytes += nbytes
                        self.inflight[ticket] = (rec, part if rec.resident is None else None, view, rng, nbytes)
                        self.room.notify_all()  # the completion thread waits for work when nothing is in flight
                except BaseException:
                    if rng is not None:
                        with self.lock:
                            self.space.release(*rng)
                    raise
                start += n
        except BaseException as e:
            with self.lock:
                self.room.notify_all()
                rec.submitted_all = True
                rec.error = rec.error or str(e)
                if not self.dead:
                    # This rank skipped the op (or part of it), which the others submitted: its
                    # next ops would pair with their earlier ones. The group is unusable.
                    self.dead = (f"ringd: an op of group {self.group} could not be {'wholly ' if start else ''}"
                                 f"submitted ({e}); this process group cannot be used any more: restart the job")
                done = rec.chunks_left == 0 and not rec.reported
                if done:
                    rec.reported = True
                    if rec.resident is not None:
                        rec.resident.busy = False
            if done:
                self._finish(rec)

    def _alloc_locked(self, nbytes):
        """A slot range, waiting for earlier ops to give theirs back (within the timeout)."""
        got = []
        self._wait_locked(lambda: got.append(self.space.alloc(nbytes)) or got[-1] is not None,
                          f"ringd: no room for {nbytes} bytes in the {self.ps.bytes}-byte slot "
                          f"within {self.timeout} (set RINGD_SLOT_BYTES higher)")
        return got[-1]

    def _submit_locked(self, offset, count, dtype, op):
        end = datetime.datetime.now() + self.timeout
        while True:
            if self.dead:
                raise RuntimeError(self.dead)
            try:
                return self.client.submit(offset, count, dtype, op)
            except _ringd.RingdError as e:
                if e.code != -errno.EAGAIN:  # EAGAIN: too many ops in flight; wait for one to finish
                    raise RuntimeError(f"ringd: {e}") from None
            if datetime.datetime.now() >= end:
                raise RuntimeError(f"ringd: too many ops in flight for {self.timeout}")
            self.room.wait(0.05)

    # -- completion (its own thread) --

    def _complete_loop(self):
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while True:
            with self.lock:
                # Nothing to wait for (or nothing more will come): sleep until an op is submitted,
                # not on the fd (it stays readable after a late signal or once ringd is gone).
                while not self.closed and (not self.inflight or self.lost):
                    if self.lost and self.inflight:
                        break
                    self.room.wait(1.0)
                if self.closed:
                    return
            if not self.lost:
                try:
                    poller.poll(_POLL_MS)
                except InterruptedError:
                    pass
            while True:  # until a pass finds nothing done: a test drains every result that is in
                done = []
                with self.lock:
                    for ticket in list(self.inflight):
                        err = self.lost
                        if not err:
                            try:
                                if not self.client.test(ticket):
                                    continue
                            except _ringd.RingdError as e:
                                err = str(e)
                                if e.code in (-errno.EPROTO, -errno.ECONNRESET, -errno.EPIPE, -errno.EBADF):
                                    self.lost = self.dead = f"ringd: {e}"
                        done.append((self.inflight.pop(ticket), err))
                if not done:
                    break
                for (rec, part, view, rng, nbytes), err in done:
                    try:
                        if err is None and part is not None:
                            with torch.no_grad():
                                part.copy_(view)
                    except BaseException as e:  # never lose an op: its future fails instead
                        err = f"copying the result out of the slot: {e}"
                    if err is not None and rec.error is None:
                        rec.error = err
                    with self.lock:
                        if rng is not None:
                            self.space.release(*rng)
                        self.inflight_bytes -= nbytes
                        rec.chunks_left -= 1
                        all_done = rec.chunks_left == 0 and rec.submitted_all
                        if all_done and rec.resident is not None:
                            rec.resident.busy = False  # its result stays until the bucket's next step
                        finished = not rec.reported and (all_done or (err is not None and rec.several))
                        if err is not None and rec.several:
                            # A piece of a tensor in several ops failed: the op fails now, not
                            # once its other pieces have waited out ringd's op timeout, and since
                            # the ranks' pieces may no longer pair (a rank that split the tensor
                            # otherwise: its other pieces are still to come), the group takes no
                            # more ops. Also when the piece was this rank's last: the others may
                            # have more.
                            self.dead = self.dead or (
                                f"ringd: a piece of an op of group {self.group} failed ({err}); its ranks' ops "
                                "may no longer pair: this process group cannot be used any more")
                        if finished:
                            rec.reported = True
                        self.room.notify_all()
                    if finished:
                        self._finish(rec)

    def _finish(self, rec):
        with self.defer_lock:  # not the engine's lock: close() finishes ops holding it
            if rec.deferred:
                rec.finish_due = True  # release_finish() queues it
                return
        with self.finish_ready:
            self.finished.append(rec)
            self.finish_ready.notify()

    def _finish_loop(self):
        while True:
            with self.finish_ready:
                while not self.finished:
                    if self.finisher_stop:
                        return
                    self.finish_ready.wait(1.0)
                rec = self.finished.popleft()
            try:
                if rec.error is not None:
                    rec.future.set_error(rec.error if rec.error.startswith("ringd") else f"ringd: {rec.error}")
                    continue
                if rec.copy_back:
                    with torch.no_grad():
                        rec.tensor.copy_(rec.flat.view(rec.tensor.shape))
                if rec.stream is not None:
                    # A CUDA result copied back on the caller's stream: the future's waiters are
                    # ordered after that stream's work (torch records its event there).
                    with torch.cuda.stream(rec.stream):
                        rec.future.set_result(rec.result)
                else:
                    rec.future.set_result(rec.result)
            except BaseException as e:  # a callback's error stays with its future; the thread goes on
                if not rec.future.done():
                    rec.future.set_error(f"ringd: completing the op: {e}")

    def close(self, wait=True):
        """Fails what is queued or in flight, stops the threads, then lets the client (and its
        slot) go. wait: ops in flight get up to 5 s to end in ringd first (destroy_process_group);
        else they fail at once (abort)."""
        with self.lock:
            if self.closed or self.closing:
                return
            self.closing = True
            self.dead = self.dead or (f"ringd: the process group of group {self.group} was "
                                      f"{'destroyed' if wait else 'aborted'}")
            self.room.notify_all()
        # The submitting thread fails the ops queued; those in flight end in ringd (within its op
        # timeout) or are failed below after 5 s (at once when aborted).
        end = datetime.datetime.now() + datetime.timedelta(seconds=5 if wait else 0)
        while datetime.datetime.now() < end:
            with self.lock:
                if not self.inflight and not self.pending:
                    break
            with self.finish_ready:
                self.finish_ready.wait(0.05)
        with self.lock:
            self.closed = True
            self.room.notify_all()
        for t in self.threads[:2]:  # submitting and completing: whatever they hold is queued to finish
            t.join()
        with self.lock:
            # Still queued, or still in ringd: failed, their ranges kept (ringd may still write
            # them until the connection closes; they go with the slot).
            left = list(self.pending) + [entry[0] for entry in self.inflight.values()]
            self.pending.clear()
            self.inflight.clear()
            for rec in left:
                if not rec.reported:
                    rec.reported = True
                    rec.error = rec.error or self.dead
                    self._finish(rec)
        with self.finish_ready:
            self.finisher_stop = True  # once every completed op's future is completed
            self.finish_ready.notify_all()
        self.threads[2].join()
        del self.slot
        with self.lock:
            for res in self.resident.values():
                if not res.busy:
                    self.space.release(*res.rng)
                    self.ps.resident_bytes -= res.rng[1]
            if self.staging is not None and not self.lost and not left:
                # No device op of this group is in ringd any more (none was left in flight).
                self.space.release(*self.staging)
                self.staging = None
        self.resident.clear()
        _disconnect(self.client, self.ps, self.socket)


def _local_address_toward(host):
    """This host's address on the route to `host` (no packet is sent)."""
    try:
        with _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return ""


def _gloo_group(store, rank, size, timeout):
    """The internal Gloo group. Its interface: GLOO_SOCKET_IFNAME's when set; else the one on the
    route to MASTER_ADDR (torchrun, env://); else Gloo's own default (the address the host name
    resolves to, or loopback), as init_process_group("gloo") finds it for tcp:// and file://."""
    prefixed = dist.PrefixStore("ringd-gloo/", store)
    addr = ""
    if not os.environ.get("GLOO_SOCKET_IFNAME") and os.environ.get("MASTER_ADDR"):
        addr = _local_address_toward(os.environ["MASTER_ADDR"])
    if not addr:
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


class ProcessGroupRingd(ProcessGroup):
    """allreduce through ringd; the other collectives through an internal Gloo group."""

    def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
        super().__init__(rank, size)
        socket = os.environ.get("RINGD_SOCKET") or _ringd.DEFAULT_SOCKET
        try:
            slot_bytes = _env_bytes("RINGD_SLOT_BYTES", 256 << 20)
            try:
                st = _ringd.status(socket)
            except _ringd.RingdError as e:
                raise RuntimeError(f"ringd: {e}") from None
        except RuntimeError as e:
            # The other ranks wait for this one's entry: they get the reason instead.
            store.set(f"ringd/member/{rank}", f"!{e}")
            raise
        limit = st.get("memory", {}).get("slot_bytes_limit")
        if limit and "RINGD_SLOT_BYTES" not in os.environ:
            slot_bytes = min(slot_bytes, int(limit))
        with _process_slots_lock:
            existing = _process_slots.get(socket)
            if existing is not None:
                slot_bytes = existing.bytes  # this process's slot, which this group will use too
        # The ringd group of this process group spans the hosts of its ranks: each rank says
        # which ringd host it is on (through the group's own store, so new_group's ranks only),
        # and its trainers on a host are that group's local ranks there, in LOCAL_RANK order.
        # Each rank's slot size too: a tensor larger than one op is split the same way on every
        # rank (by the smallest slot of the group), whatever RINGD_SLOT_BYTES or memory.slot_bytes
        # each has, or the ranks' ops would not pair.
        me = (st.get("host", ""), _env_int("LOCAL_RANK", 0))
        store.set(f"ringd/member/{rank}", f"{me[0]}:{me[1]}:{slot_bytes}")
        members, smallest_slot = [], slot_bytes
        for r in range(size):
            entry = store.get(f"ringd/member/{r}").decode()
            if entry.startswith("!"):
                raise RuntimeError(f"ringd: rank {r} of this process group could not reach its ringd: {entry[1:]}")
            host, local, slot = entry.rsplit(":", 2)
            members.append((host, int(local), r))
            smallest_slot = min(smallest_slot, int(slot))
        on_my_host = sorted(m for m in members if m[0] == me[0])
        local_rank = [m[2] for m in on_my_host].index(rank)
        local_size = len(on_my_host)
        hosts = sorted({m[0] for m in members})
        ring_hosts = [m.get("name") for m in st.get("ring", {}).get("members", [])]
        # A fresh ringd group per process group: every job, and every restart, starts clean.
        key = "ringd/group"
        if rank == 0:
            store.set(key, f"torch-{uuid.uuid4().hex[:20]}")
        group = store.get(key).decode()
        self._engine = None
        self._coalesced = None  # the Works since _start_coalescing
        self._gloo = _gloo_group(store, rank, size, timeout)
        _compat.attach(self, self._gloo)
        self.ringd_group = group
        self.ringd_hosts = hosts
        why = ""
        try:
            # Every host of the ring: no list (the same group, and what older ringds understand);
            # part of it: those hosts, a group of ringd's over part of the ring.
            self._engine = _Engine(group, local_rank, local_size, slot_bytes, socket, timeout,
                                   hosts=None if set(hosts) == set(ring_hosts) else ",".join(hosts),
                                   max_chunk=_chunk_bytes(smallest_slot))
        except _ringd.RingdError as e:
            why = f"ringd: {e}"
        # Every rank learns whether every other one joined: a group refused on one rank fails on
        # all of them (with that rank's reason), instead of leaving the others waiting for it.
        store.set(f"ringd/joined/{rank}", why or "ok")
        failed = [(r, store.get(f"ringd/joined/{r}").decode()) for r in range(size)]
        failed = [(r, w) for r, w in failed if w != "ok"]
        if failed:
            if self._engine is not None:
                self._engine.close()
            r, w = failed[0]
            raise RuntimeError(w if r == rank else f"ringd: rank {r} of this process group could not join its ringd "
                                                   f"group {group}: {w}")
        weakref.finalize(self, _Engine.close, self._engine)

    def getBackendName(self):
        return BACKEND

    def _ringd_op(self, tensors, op):
        """The ringd op name when ringd can do this allreduce, else None (Gloo does it)."""
        if len(tensors) != 1:
            return None
        t = tensors[0]
        if t.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"ringd: {t.device.type} tensors are not supported (CPU and CUDA tensors are); move "
                               "the tensor to the CPU or a GPU")
        if t.is_sparse or t.dtype not in _DTYPES:
            return None
        name = _op_name(op)
        if name == "avg" and not t.dtype.is_floating_point:
            raise RuntimeError(f"ringd: AVG of {t.dtype} is not defined (an integer mean); use SUM")
        return name

    def _track(self, work):
        """`work`, also kept for _end_coalescing while the group coalesces."""
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def allreduce(self, tensors, opts=None):
        if opts is None or isinstance(opts, (dist.ReduceOp, getattr(dist.ReduceOp, "RedOpType", dist.ReduceOp))):
            op = dist.ReduceOp.SUM if opts is None else opts
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
        if _premul_factor(opts.reduceOp) is not None:
            op = opts.reduceOp
            opts = dist.AllreduceOptions()
            for t in tensors:
                opts.reduceOp = _premultiply(t, op)
        name = self._ringd_op(tensors, opts.reduceOp)
        if name is None:
            if _op_name(opts.reduceOp) == "avg":
                raise RuntimeError("ringd: AVG needs one float32/float64/float16/bfloat16/int tensor")
            return self._track(self._gloo.allreduce(tensors, opts))
        if tensors[0].is_cuda:
            return self._track(self._allreduce_cuda(tensors[0], name, [tensors[0]], tensors))
        fut = self._engine.allreduce(tensors[0], name)
        return self._track(_compat.work(fut, tensors))

    def _allreduce_cuda(self, tensor, name, result, tensors):
        """A CUDA tensor's allreduce through ringd's CUDA path, in the order of the current
        stream: ringd reads the tensor after what the stream queued so far, Work.wait() makes the
        current stream wait for the result (the host does not block), and the future completes
        once the result is in the tensor."""
        given = tensor.detach()
        dense = _distinct_elements(given)
        stream = torch.cuda.current_stream(tensor.device)
        flat = dense if dense.is_contiguous() else dense.contiguous()  # a copy on the current stream
        opf = _compat.OpFuture(devices=[tensor.device])
        buf = DeviceBuffer(flat.data_ptr(), flat.numel(), _DTYPES[tensor.dtype], tensor.device.index, stream.cuda_stream)
        if buf.count == 0:
            opf.set_result(result)
            return _compat.work(opf.future, tensors)
        engine = self._engine
        if flat is dense:
            ticket, _ = engine.allreduce_device(buf, name, opf, result)
            return _compat.work(opf.future, tensors,
                                on_wait=lambda: engine.stream_wait(ticket, torch.cuda.current_stream(tensor.device).cuda_stream))
        # Through a contiguous copy: the result goes back into the tensor on the current stream,
        # after ringd's; the future completes after that copy (its event is recorded on this
        # stream), and Work.wait() orders the caller's stream after it too.
        ticket, rec = engine.allreduce_device(buf, name, opf, result, keep=flat, stream=stream, deferred=True)
        try:
            engine.stream_wait(ticket, stream.cuda_stream)
            with torch.no_grad():
                dense.copy_(flat.view(dense.shape))
            copied = torch.cuda.Event()
            copied.record(stream)
        finally:
            engine.release_finish(rec)
        return _compat.work(opf.future, tensors,
                            on_wait=lambda: torch.cuda.current_stream(tensor.device).wait_event(copied))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._coalesce(lambda: [self.allreduce([t], self._coalesced_opts(opts)) for t in tensors], tensors)

    def _coalesce(self, start, result):
        """One Work for the Works that start() makes (not kept for _end_coalescing one by one): done
        when all are, failed with the first one's error."""
        held, self._coalesced = self._coalesced, None
        try:
            works = start()
        finally:
            self._coalesced = held
        return self._track(self._joined(works, result))

    @staticmethod
    def _joined(works, result):
        fut = torch.futures.collect_all([w.get_future() for w in works])
        devices = sorted({t.device for t in result if isinstance(t, torch.Tensor) and t.is_cuda}, key=str)
        out = _compat.OpFuture(devices=devices or None)

        def done(f):
            try:
                for each in f.value():
                    each.value()
                out.set_result(result)
            except RuntimeError as e:
                out.set_error(_compat.ringd_message(e))
        fut.add_done_callback(done)
        return _compat.work(out.future, result)

    @staticmethod
    def _coalesced_opts(opts):
        o = dist.AllreduceOptions()
        if opts is not None:
            o.reduceOp = opts.reduceOp
        return o

    # torch 2's coalescing manager (_coalescing_manager(group, device)): the collectives between
    # the two calls run as they are made; _end_coalescing's Work is done once all of them are.
    def _start_coalescing(self, device=None):
        if self._coalesced is not None:
            raise RuntimeError("ringd: this process group is already coalescing (_start_coalescing twice)")
        self._coalesced = []

    def _end_coalescing(self, device=None):
        if self._coalesced is None:
            raise RuntimeError("ringd: _end_coalescing without _start_coalescing")
        works, self._coalesced = self._coalesced, None
        return self._joined(works, [])

    def shutdown(self):
        """destroy_process_group: the group's ringd connection closes (its ops in flight end
        within 5 s, then fail), then its Gloo group."""
        self._close(wait=True)

    def abort(self):
        """The group's ringd connection closes at once: every op queued or in flight fails with
        ringd's message; then its Gloo group is aborted."""
        self._close(wait=False)

    def _close(self, wait):
        if self._engine is not None:
            self._engine.close(wait=wait)
        gloo_end = getattr(self._gloo, "shutdown" if wait else "abort", None)
        if gloo_end is not None:
            try:
                gloo_end()
            except RuntimeError:
                pass  # a Gloo group that ended already

    def hook_allreduce(self, index, buffer):
        """The comm hook: averages bucket `index` in its own slot range; a Future of the result
        (None: not through ringd, the hook then averages through Gloo)."""
        name = self._ringd_op([buffer], dist.ReduceOp.AVG)
        if name is None or self._engine is None:
            return None
        if buffer.is_cuda:
            # DDP's bucket buffer itself: the same allocation every step, registered with ringd
            # once (the first step), averaged in place, no copy.
            return self._allreduce_cuda(buffer, name, buffer, [buffer]).get_future()
        fut = self._engine.allreduce_resident(buffer, name)
        if fut is None:
            fut = self._engine.allreduce(buffer, name)
            out = _compat.OpFuture()
            fut.add_done_callback(lambda f: _chain_first(f, out))
            return out.future
        return fut

    def _all_gather_single(self, output, input, opts=None):
        """all_gather_into_tensor: Gloo's allgather into the output's n parts (torch 1.13's Gloo
        has no _allgather_base). Defined under this torch's name (_compat.ALL_GATHER_SINGLE)."""
        n = self.size()
        if input.numel() == 0 and output.numel() == 0:
            return self._track(self._gloo.barrier())  # nothing to gather; the ranks still meet, as for any collective
        if output.numel() != input.numel() * n or output.dtype != input.dtype or not output.is_contiguous():
            raise RuntimeError(f"ringd: all_gather_into_tensor needs a contiguous output of {n} x the input's "
                               f"{input.numel()} {input.dtype} elements, not {output.numel()} {output.dtype} "
                               f"({'contiguous' if output.is_contiguous() else 'not contiguous'})")
        parts = list(output.view(-1).view(n, -1).unbind(0))
        return self._track(self._gloo.allgather([[p.view(input.shape) for p in parts]], [input]))

    def _all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._coalesce(lambda: [self._all_gather_single(o, i) for o, i in zip(outputs, inputs)], outputs)

    def _reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._coalesce(lambda: [self._reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)],
                              outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """reduce_scatter (torch 1.13's Gloo has none): an allreduce of the inputs one after the
        other (through ringd where allreduce goes through ringd), then this rank's part."""
        n = self.size()
        if len(output_tensors) != 1 or len(input_tensors) != 1 or len(input_tensors[0]) != n:
            raise RuntimeError(f"ringd: reduce_scatter takes one output and a list of {n} inputs")
        out, ins = output_tensors[0], input_tensors[0]
        if any(t.numel() != out.numel() or t.dtype != out.dtype for t in ins):
            raise RuntimeError(f"ringd: reduce_scatter's inputs must each have the output's {out.numel()} "
                               f"{out.dtype} elements")
        return self._reduce_into(out, torch.cat([t.detach().reshape(-1) for t in ins]), opts, output_tensors)

    def _reduce_scatter_single(self, output, input, opts=None):
        """reduce_scatter_tensor: as reduce_scatter, from one input of n x the output's elements.
        Defined under this torch's name (_compat.REDUCE_SCATTER_SINGLE)."""
        if input.numel() != output.numel() * self.size() or input.dtype != output.dtype:
            raise RuntimeError(f"ringd: reduce_scatter_tensor needs an input of {self.size()} x the output's "
                               f"{output.numel()} {output.dtype} elements, not {input.numel()} {input.dtype}")
        return self._reduce_into(output, input.detach().reshape(-1).clone(), opts, [output])

    def _reduce_into(self, out, flat, opts, result):
        """An allreduce of `flat` (the group's own copy: PREMUL_SUM scales it), then this rank's
        part of it into `out`."""
        all_opts = dist.AllreduceOptions()
        if opts is not None:
            all_opts.reduceOp = _premultiply(flat, opts.reduceOp)
        k, r = out.numel(), self.rank()
        held, self._coalesced = self._coalesced, None  # the one Work below is what coalescing keeps
        try:
            inner = self.allreduce([flat], all_opts)
        finally:
            self._coalesced = held

        def done(f):
            f.value()  # raises the allreduce's error
            with torch.no_grad():
                out.copy_(flat[r * k:(r + 1) * k].view(out.shape))
            return result
        return self._track(_compat.work(inner.get_future().then(done), result))


# The rest through the internal Gloo group (identical results), each under the names this torch has
# (of a renamed pair only the one its Python API calls: alltoall_base before all_to_all_single).
_VIA_GLOO = ("broadcast", "allgather", "allgather_coalesced", "gather", "scatter", "reduce", "alltoall",
             "all_to_all_single", "alltoall_base", "barrier", "monitored_barrier", "send", "recv", "recv_anysource")


def _via_gloo(name, gloo_name):
    def collective(self, *args, **kwargs):
        return self._track(getattr(self._gloo, gloo_name)(*args, **kwargs))
    collective.__name__ = name
    collective.__doc__ = f"{name} through the group's internal Gloo group."
    return collective


for _name in _VIA_GLOO:
    if _name == "alltoall_base" and hasattr(ProcessGroup, "all_to_all_single"):
        continue
    # Gloo's name of it (its backend may still have only the older name of a renamed pair).
    _gloo_name = _name if hasattr(dist.ProcessGroupGloo, _name) else {"all_to_all_single": "alltoall_base"}.get(_name)
    if hasattr(ProcessGroup, _name) and _gloo_name and hasattr(dist.ProcessGroupGloo, _gloo_name):
        setattr(ProcessGroupRingd, _name, _via_gloo(_name, _gloo_name))
_compat.install_contract(ProcessGroupRingd)


def _chain_first(f, out):
    try:
        out.set_result(f.value()[0])
    except RuntimeError as e:
        out.set_error(str(e))


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
    _compat.register_backend(BACKEND, _create)
