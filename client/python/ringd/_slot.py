"""The process's shared-memory slot on its ringd, shared by its process groups: connecting a group's
client to it, its ranges, and what an op of ringd.torch is (its chunks and records). Used by
ringd._engine and ringd._device; nothing here knows about process groups."""
import collections
import errno
import os
import threading
import time

import torch

import ringd as _ringd


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


def _chunks(count, esize, max_chunk, taper=True):
    """The element counts of the ringd ops of a tensor of `count` elements (the same on every
    rank: a function of the count, the group's max_chunk and whether the group tapers): the first
    one small, so that the ring starts after a short copy, each next one twice as big, up to
    max_chunk bytes; with `taper` the last ones shrink again (each a quarter of the one before it,
    from the end: 4 MiB, 16 MiB, ...), so that the copy of a result out of the slot runs while
    the ring still moves the next op, and only a small one is left to copy once the ring is done
    (a last op of max_chunk paid its whole copy-out after the ring: 64 MiB through torch at
    1.19 F, 1.15 F so). Without it (a group with a rank of an earlier ringd.torch): doubling up
    to max_chunk to the end."""
    first = max(1, min(_FIRST_CHUNK_BYTES, max_chunk) // esize)
    cap = max(1, max_chunk // esize)
    head, tail = [], []
    h = t = first
    while count > 0:
        take = min(h, count)
        head.append(take)
        count -= take
        h = min(h * 2, cap)
        if taper and count > 0:
            take = min(t, count)
            tail.append(take)
            count -= take
            t = min(t * 4, cap)
    yield from head
    yield from reversed(tail)


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
    """First-fit ranges of the slot, 64-byte aligned. Ranges lent out as tensors (lend) come back
    when the tensor's memory is freed, in whatever thread that happens: they are queued without a
    lock (`returned`) and taken back by the next alloc, under the process's lock."""

    def __init__(self, size):
        self.size = size
        self.free = [(0, size)]  # sorted (offset, length)
        self.returned = collections.deque()  # lent ranges given back, not yet free again
        self.lent = {}  # offset -> length of the ranges lent out
        self.lent_bytes = 0
        # Ranges (and tensors over ranges) of ops that were still in ringd when their group closed:
        # ringd may write them until the ops' deadline, so they come back only after it
        # ([deadline (time.monotonic()), ranges, tensors]).
        self.held = []

    def hold(self, until, ranges, tensors):
        """`ranges` are free again (and `tensors` dropped) only at time.monotonic() `until` (None:
        not yet; the entry returned, whose [0] may be set later)."""
        if not ranges and not tensors:
            return None
        entry = [until, list(ranges), list(tensors)]
        self.held.append(entry)
        return entry

    def held_bytes(self):
        return sum(n for _, ranges, _ in self.held for _, n in ranges)

    def reclaim(self):
        """The lent ranges given back, and the held ones past their deadline, are free again."""
        if self.held:
            now = time.monotonic()
            for entry in [e for e in self.held if e[0] is not None and e[0] <= now]:
                self.held.remove(entry)
                for rng in entry[1]:
                    self.release(*rng)
                entry[2].clear()  # (a lent tensor's range comes back through `returned` when it goes)
        while self.returned:
            off, length = self.returned.popleft()
            self.lent_bytes -= length
            del self.lent[off]
            self.release(off, length)

    def alloc(self, n):
        self.reclaim()
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


def _lend(ps, numel, dtype):
    """A tensor of `numel` elements of `dtype` over a range of the process's slot (FSDP2's buffers
    for its collectives: ProcessGroupAllocMixin), or None when lending it would take the ranges
    lent out and kept for the comm hook past half the slot. The range is the tensor's until its
    memory is freed (the tensor and every view of it gone), then free again. Call with ps.lock held."""
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * esize
    ps.space.reclaim()
    if numel <= 0 or ps.space.lent_bytes + ps.resident_bytes + nbytes > ps.bytes // 2:
        return None
    rng = ps.space.alloc(nbytes)
    if rng is None:
        return None
    ps.space.lent[rng[0]] = rng[1]
    ps.space.lent_bytes += rng[1]
    import weakref
    memory = ps.hand_out(rng[0], rng[1])  # (the mapping outlives the groups while the tensor lives)
    weakref.finalize(memory, ps.space.returned.append, rng)  # (no lock: any thread, any time)
    return torch.frombuffer(memory, dtype=dtype, count=numel)


def _slot_offset(ps, t):
    """The byte offset in the process's slot of contiguous tensor `t`'s memory when it lies wholly
    inside one range lent out (_lend), else None. Call with ps.lock held."""
    if not t.is_contiguous() or t.device.type != "cpu":
        return None
    off = t.data_ptr() - ps.address
    end = off + t.numel() * t.element_size()
    if off < 0 or end > ps.bytes or off % t.element_size():
        return None
    for start, length in ps.space.lent.items():
        if start <= off and end <= start + length:
            return off
    return None


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
        # reduce_scatter / allgather (None: allreduce): `flat` is then the output, `src` the
        # input (flat, contiguous), `blocks` x `block` elements the larger of them.
        self.collective = None
        self.src = None
        self.blocks = self.block = 0
        self.root = 0  # broadcast, reduce (collective "broadcast", "reduce"; "barrier" has no tensor)
        self.splits = None  # all_to_all: (send counts, receive counts), or None: equal blocks
        self.refused = 0  # collective "refuse": the slot bytes of the all_to_all this rank refuses
        # An allreduce's own wire (None: the group's) and error-feedback key (None: none); its
        # ringd ops' keys are (feedback_tag << 20) + the op's chunk number.
        self.wire = None
        self.feedback_tag = None
        self.parts = 0  # ringd ops submitted for it so far


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
        self.address = client.slot_address
        self.view = memoryview((ctypes.c_char * self.bytes).from_address(client.slot_address)).cast("B")
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)
        self.space = _SlotSpace(self.bytes)
        self.resident_bytes = 0
        self.staging_bytes = 0  # the groups' device staging ranges (DeviceOps), taken for their lives
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)
        # The mapping outlives the clients: ranges are released only once ringd is done with them,
        # and tensors handed out over the slot (lent to FSDP, the comm hook's results) may outlive
        # the process groups. It is unmapped once the last group's client is closed and the last
        # such tensor is gone (hand_out), so that a process that makes and destroys process
        # groups in turn does not keep every slot it had.
        self.hold, self.unhold = client.hold_slot(), client.unhold_slot
        self.out = 0  # memories handed out (hand_out) still alive
        self.orphaned = False  # the last group's client is closed
        self.unmapped = False
        self.out_lock = threading.Lock()  # (taken by finalizers, in any thread: nothing is freed under it)

    def room_bytes(self):
        """What ops can take of the slot at most: all of it but what stays taken (device staging
        ranges, the comm hook's kept ranges, tensors lent out, ranges held for ops of closed
        groups). Call with the lock held."""
        return self.bytes - self.staging_bytes - self.resident_bytes - self.space.lent_bytes - self.space.held_bytes()

    def hand_out(self, off, nbytes):
        """A buffer over [off, off + nbytes) of the slot for a tensor given to the caller
        (torch.frombuffer keeps it alive as long as the tensor's storage): the mapping stays
        while it lives. Not at the interpreter's exit: such a tensor may still be used then."""
        import ctypes
        import weakref
        with self.out_lock:
            if self.unmapped:
                raise RuntimeError("ringd: the process group's slot is gone (its process groups were destroyed)")
            self.out += 1
        memory = (ctypes.c_char * nbytes).from_address(self.address + off)
        weakref.finalize(memory, self._given_back).atexit = False
        return memory

    def _given_back(self):
        with self.out_lock:
            self.out -= 1
            last = self.out == 0 and self.orphaned
        if last:
            self.unmap()

    def orphan(self):
        """The last group's client is closed: the slot's ranges are never lent again, so the
        tensors kept for ops that were in ringd are dropped, and the mapping goes now, or with
        the last tensor handed out."""
        with self.lock:
            self.space.held.clear()
        with self.out_lock:
            self.orphaned = True
            now = self.out == 0
        if now:
            self.unmap()

    def unmap(self):
        with self.out_lock:
            hold, self.hold = self.hold, None
            self.unmapped = True
        if hold:
            self.tensor = self.view = None
            self.unhold(hold)


_process_slots = {}  # socket path -> _ProcessSlot
_process_slots_lock = threading.Lock()


def _timeout_ms(timeout):
    """A process group's timeout (a timedelta, or None) as a ringd op timeout in ms (0: ringd's)."""
    if timeout is None:
        return 0
    return max(1, min(int(timeout.total_seconds() * 1000), 0xFFFFFFFF))


def _connect(group, local_rank, local_size, slot_bytes, socket, hosts, timeout=None, rank=None, ranks=None):
    """A client of `group` on this process's slot of that ringd (made by the first group); its
    ops bounded by the process group's `timeout`; `rank` of `ranks`: its rank in the group (None:
    not said, allreduce only)."""
    with _process_slots_lock:
        ps = _process_slots.get(socket)
        if ps is not None:
            try:
                client = _ringd.Client(group, local_rank, local_size, slot_bytes, socket, hosts=hosts,
                                       share_slot_of=ps.clients[0], op_timeout_ms=_timeout_ms(timeout), rank=rank,
                                       ranks=ranks)
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
                               op_timeout_ms=_timeout_ms(timeout), rank=rank, ranks=ranks)
        ps = _ProcessSlot(client)
        if socket not in _process_slots:
            _process_slots[socket] = ps
        return client, ps


def _disconnect(client, ps, socket):
    """Closes a group's client (it leaves its ringd group). The process's slot stays mapped while
    another group uses it; after the last one, while a tensor handed out over it lives."""
    with _process_slots_lock:
        if client in ps.clients:
            ps.clients.remove(client)
        last = not ps.clients
        if last and _process_slots.get(socket) is ps:
            del _process_slots[socket]
    client.close()
    if last:
        ps.orphan()
