"""The engine of a ringd.torch process group: one ringd client, its ops queued, copied into the
process's slot in chunks, submitted, completed and their futures completed on threads of its own."""
import collections
import datetime
import errno
import os
import select
import threading
import time

import torch

import ringd as _ringd
from ringd import _compat
from ringd._device import DeviceOps
from ringd._slot import (_DTYPES, _FIRST_CHUNK_BYTES, _POLL_MS, _WINDOW_BYTES, _Op, _Resident, _chunk_bytes,
                         _chunks, _connect, _disconnect, _distinct_elements, _lend, _slot_offset)


_ROOTED = ("broadcast", "reduce", "barrier")  # (the ops of _submit_rooted)
# After a group closed with ops in ringd: how long past their op timeout their slot ranges stay
# held (ringd ends an op within its op timeout of the submission plus about a second): the client
# library's wait margin (RINGD_WAIT_MARGIN_MS, default 10 s, at least 2 s; ringd.h, Deadlines).
def _hold_margin_s():
    try:
        return max(2.0, int(os.environ.get("RINGD_WAIT_MARGIN_MS", "10000")) / 1000)
    except ValueError:
        return 10.0


def _copied(to, view):
    """A result's copy out of the slot: its bytes."""
    to.copy_(view)
    return view.numel() * view.element_size()


class _Engine(DeviceOps):
    """The process's ringd client for one process group. allreduce() (any thread) queues the op
    and returns its future at once; a submitting thread copies each op's chunks into the slot and
    submits them, in the order they were queued (the same on every rank), while at most
    `window` bytes are in flight, so that the copies are spread over the ring's work instead of
    all taking the CPUs at once; a completing thread polls ringd_fd, tests the tickets in flight
    and copies results back; futures are completed (and their callbacks run) on a fourth thread,
    so a callback may submit again."""

    def __init__(self, group, local_rank, local_size, slot_bytes, socket, timeout, hosts=None, max_chunk=None,
                 rank=None, ranks=None, taper=True, splits_whole=True):
        self.client, self.ps = _connect(group, local_rank, local_size, slot_bytes, socket, hosts, timeout, rank, ranks)
        # This rank in the group (None: its ringd runs allreduce only; see collective()).
        self.rank, self.ranks = (rank, ranks) if ranks else (None, None)
        self.socket = socket
        self.group = group
        self.timeout = timeout
        self.slot = self.ps.tensor
        # The most bytes of one ringd op: the group's ranks split a tensor the same way whatever
        # their slots (the smallest rank's, ProcessGroupRingd), a quarter of it (several in flight).
        self.max_chunk = max_chunk or _chunk_bytes(self.ps.bytes)
        self.window = max(self.max_chunk, _WINDOW_BYTES)
        self.taper = taper  # how a tensor is cut into ops (_chunks): the same on every rank of the group
        # An all_to_all given split sizes is one op whatever their values (False: a group with a
        # rank of an earlier release, which cuts all-equal ones into parts as equal blocks).
        self.splits_whole = splits_whole
        # The client, the slot's ranges, the queue, the ops in flight: the process's lock, for all
        # its groups (their ranges are of the same memory); `room`: a range, a ticket or window
        # came free, an op was queued.
        self.lock, self.room, self.space = self.ps.lock, self.ps.room, self.ps.space
        self.pending = collections.deque()  # ops queued, not yet wholly submitted (the first one in progress)
        self.inflight = collections.OrderedDict()  # ticket -> (op, flat slice, slot view, (off, n), bytes)
        self.inflight_bytes = 0
        self.resident = {}  # comm hook: (bucket buffer's address, bytes, dtype) -> _Resident
        self.hook_calls = 0
        self.lent = self.in_place_ops = 0  # tensors lent over the slot (allocate); ops run on them with no copy
        self.copied_in = self.copied_out = 0  # bytes copied into and out of the slot for ops
        self._device_init()  # device ops (DeviceOps)
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

    def allreduce(self, tensor, op, wire=None, feedback_tag=None):
        """Allreduce `tensor` in place; returns a torch Future of [tensor]. The tensor must stay
        as it is until the future completes (as with every backend's async ops). wire: this op's
        own wire format (None: the group's); feedback_tag: error feedback under that key."""
        dtype = _DTYPES[tensor.dtype]
        given = tensor.detach()  # ringd's result is not part of any graph (as with every backend)
        tensor = _distinct_elements(given)  # each memory location once (expanded tensors)
        contiguous = tensor.is_contiguous()
        flat = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
        opf = _compat.OpFuture()
        rec = _Op(tensor, flat, not contiguous, opf, [given], op, dtype)
        rec.wire, rec.feedback_tag = wire, feedback_tag
        if flat.numel() == 0:
            opf.set_result([given])
            return opf.future
        self._queue(rec)
        return opf.future

    def collective(self, name, src, out, op, result):
        """reduce_scatter (`src` has a block per rank, `out` one) or allgather (`src` one block,
        `out` a block per rank) through ringd, blocks in the group's rank order; `src` is read
        only. Returns a torch Future of `result`. Each ringd op carries the same part of every
        block: the group's ranks cut the op alike (from the block's size, the ranks and the
        group's max_chunk)."""
        dtype = _DTYPES[out.dtype]
        given = out.detach()
        contiguous = given.is_contiguous()
        flat = given.view(-1) if contiguous else given.contiguous().view(-1)
        opf = _compat.OpFuture()
        rec = _Op(given, flat, not contiguous, opf, result, op, dtype)
        rec.collective = name
        rec.src = src.detach().reshape(-1)
        rec.blocks = self.ranks
        rec.block = flat.numel() if name == "reduce_scatter" else rec.src.numel()
        if rec.block == 0:
            opf.set_result(result)
            return opf.future
        self._queue(rec)
        return opf.future

    def rooted(self, name, tensor, op, root, result):
        """broadcast (`root`'s tensor into every rank's) or reduce (every rank's reduced into
        `root`'s; the others' left as they are) of `tensor` in place, through ringd; a torch Future
        of `result`. Cut into ringd ops as an allreduce is (the same on every rank); only the
        ranks whose values matter copy into the slot (broadcast: the root; reduce: all) and out of
        it (broadcast: the others; reduce: the root)."""
        dtype = _DTYPES[tensor.dtype]
        given = tensor.detach()
        contiguous = given.is_contiguous()
        flat = given.view(-1) if contiguous else given.contiguous().view(-1)
        opf = _compat.OpFuture()
        writes = (name == "broadcast") != (root == self.rank)
        rec = _Op(given, flat, not contiguous and writes, opf, result, op, dtype)
        rec.collective, rec.root = name, root
        if flat.numel() == 0:
            opf.set_result(result)
            return opf.future
        self._queue(rec)
        return opf.future

    def all_to_all(self, out, inp, out_splits, in_splits, result):
        """all_to_all through ringd, one ringd op: `inp`'s blocks (in_splits elements each, in rank
        order; empty: equal blocks) to every rank, `out`'s from every rank (out_splits). With split
        sizes the input, the output and the sizes take one range of the slot (more than the slot:
        refused on this rank, which refuses it in ringd too, so the others' op fails at once); equal
        blocks go in parts that fit (_submit_a2a_parts)."""
        dtype = _DTYPES[out.dtype]
        given = out.detach()
        contiguous = given.is_contiguous()
        flat = given.view(-1) if contiguous else given.contiguous().view(-1)
        src = inp.detach().reshape(-1)
        n, esize = self.ranks, flat.element_size()
        if in_splits or out_splits:
            if len(in_splits) != n or len(out_splits) != n or sum(in_splits) != src.numel() or sum(out_splits) != flat.numel():
                raise RuntimeError(f"ringd: all_to_all's split sizes must be {n} each, summing to the input's "
                                   f"{src.numel()} and the output's {flat.numel()} elements")
            if not self.splits_whole and self.taper and len(set(in_splits) | set(out_splits)) == 1:
                in_splits, out_splits = [], []  # (what a rank of the earlier release submits)
        elif src.numel() % n or flat.numel() != src.numel():
            raise RuntimeError(f"ringd: all_to_all without split sizes needs input and output of the same size, "
                               f"a multiple of {n} elements (not {src.numel()} and {flat.numel()})")
        total = (src.numel() + flat.numel()) * esize + 64 + 16 * n
        cut = not (in_splits or out_splits) and self.taper  # in parts of at most max_chunk: they fit
        with self.lock:
            room = self.ps.room_bytes()
        if total > room and not cut:
            # More than the slot has beside what stays taken (device staging ranges, the comm
            # hook's kept ranges, tensors lent out, ranges held for ops of closed groups): it
            # would wait for room that does not come.
            beside = "" if room == self.ps.bytes else f" ({room} of them free of what stays taken)"
            why = (f"ringd: an all_to_all of {src.numel() * esize} bytes in and {flat.numel() * esize} out "
                   f"does not fit the {self.ps.bytes}-byte slot{beside} (set RINGD_SLOT_BYTES higher)")
            self._not_submitted(_DTYPES[out.dtype], why, total)
            raise RuntimeError(why)
        opf = _compat.OpFuture()
        rec = _Op(given, flat, not contiguous, opf, result, "sum", dtype)
        rec.collective, rec.src = "all_to_all", src
        rec.splits = (list(map(int, in_splits)), list(map(int, out_splits))) if (in_splits or out_splits) else None
        self._queue(rec)
        return opf.future

    def barrier(self):
        """A barrier through ringd: a torch Future of [] that completes once every rank of the
        group submitted it (in order with the group's other ops)."""
        opf = _compat.OpFuture()
        rec = _Op(None, None, False, opf, [], "sum", _DTYPES[torch.float32])
        rec.collective = "barrier"
        self._queue(rec)
        return opf.future

    def allocate(self, numel, dtype):
        """A tensor of `numel` elements for a collective's buffer (FSDP2's, through the process
        group's allocate_tensor): over the slot where it has room to lend, so that an op whose
        input and output lie there runs on them with no copy in or out; else ordinary memory."""
        t = None
        if dtype in _DTYPES:
            with self.lock:
                if not self.closing and not self.dead:
                    t = _lend(self.ps, numel, dtype)
        if t is None:
            t = torch.empty(numel, dtype=dtype)
        else:
            self.lent += 1
        return t

    def _in_place_offsets(self, rec, k):
        """A reduce_scatter's or allgather's input and output offsets in the slot when both lie in
        it (tensors from allocate) as ringd takes them in one op — apart, or the output the rank's
        block of the input (reduce_scatter), the input its block of the output (allgather) — else
        None (the copying path)."""
        if rec.copy_back:
            return None
        i, o = _slot_offset(self.ps, rec.src), _slot_offset(self.ps, rec.flat)
        if i is None or o is None:
            return None
        nbytes = rec.blocks * k * rec.flat.element_size()
        own = self.rank * k * rec.flat.element_size()
        if rec.collective == "reduce_scatter":
            in_bytes, out_bytes, in_place = nbytes, nbytes // rec.blocks, o == i + own
        else:
            in_bytes, out_bytes, in_place = nbytes // rec.blocks, nbytes, i == o + own
        if in_place or i + in_bytes <= o or o + out_bytes <= i:
            return i, o
        return None

    def set_wire(self, wire):
        """The client's wire for ops that name none, from the next op queued on: ops queued before
        are submitted first (the submitting thread reads the client's wire as it submits, and
        every rank must submit each op with the same)."""
        with self.lock:
            self._wait_locked(lambda: not self.pending, f"ringd: the ops queued did not go out within {self.timeout}")
            self.client.set_wire(wire)

    def allreduce_resident(self, buffer, op, wire=None, feedback_tag=None):
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
                if self.ps.resident_bytes + self.space.lent_bytes + nbytes > self.ps.bytes // 2:
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
        view = torch.frombuffer(self.ps.hand_out(off, nbytes), dtype=buffer.dtype).view(buffer.shape)
        opf = _compat.OpFuture()
        rec = _Op(view, buffer.detach().view(-1), False, opf, view, op, _DTYPES[buffer.dtype])
        rec.resident, rec.view = res, view.view(-1)
        rec.wire, rec.feedback_tag = wire, feedback_tag
        try:
            self._queue(rec)
        except BaseException:
            with self.lock:
                res.busy = False
            raise
        return opf.future

    def _queue(self, rec):
        with self.lock:
            if self.dead:
                raise RuntimeError(self.dead)
            plan = self._in_place_plan(rec) if not self.pending else None
            if plan is not None:
                # Nothing queued before it and nothing to copy: submitted here, in the caller's
                # thread (no hand-off to the submitting thread). Only if ringd takes it at once:
                # otherwise (too many in flight, or an error) the submitting thread's path decides.
                collective, count, in_off, out_off = plan
                try:
                    if collective == "allreduce":
                        ticket = self._submit_allreduce(rec, in_off, count)
                    else:
                        ticket = self.client.submit_coll(collective, count, rec.dtype, rec.op, in_off, out_off)
                except _ringd.RingdError:
                    ticket = None
                if ticket is not None:
                    rec.chunks_left += 1
                    rec.submitted_all = True
                    self.in_place_ops += 1
                    self.inflight[ticket] = (rec, None, None, None, 0)
                    self.room.notify_all()
                    return
            self.pending.append(rec)
            self.room.notify_all()

    def _in_place_plan(self, rec):
        """(collective, count, input offset, output offset) of the one ringd op that runs `rec`
        where its tensors lie in the slot (lent by allocate), or None (the copying path): an op of
        one chunk — the same ringd op the copying path would submit, so that the ranks pair.
        Holding the lock."""
        if rec.collective in _ROOTED or rec.collective in ("all_to_all", "refuse"):
            return None
        esize = rec.flat.element_size()
        if rec.collective is None:
            total = rec.flat.numel()
            if rec.resident is not None or rec.copy_back or max(1, min(_FIRST_CHUNK_BYTES, self.max_chunk) // esize) < total:
                return None
            at = _slot_offset(self.ps, rec.flat)
            return None if at is None else ("allreduce", total, at, 0)
        k = rec.block
        if max(1, min(_FIRST_CHUNK_BYTES, self.max_chunk) // (esize * rec.blocks)) < k:
            return None
        at = self._in_place_offsets(rec, k)
        return None if at is None else (rec.collective, k, *at)

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
            rec = None  # (its tensors are the caller's again: lent ones free once the caller lets go)

    def _submit(self, rec):
        if rec.collective == "refuse":
            return self._submit_refusal(rec)
        if rec.collective == "all_to_all":
            return self._submit_a2a(rec)
        if rec.collective in _ROOTED:
            return self._submit_rooted(rec)
        if rec.collective is not None:
            return self._submit_blocks(rec)
        esize, total = rec.flat.element_size(), rec.flat.numel()
        start = 0
        with self.lock:
            plan = self._in_place_plan(rec)  # a tensor over the slot (from allocate): reduced where it lies
        if plan is not None:
            return self._submit_in_place(rec, *plan)
        try:
            for n in _chunks(total, esize, self.max_chunk, self.taper):
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
                    self._note_copies(nbytes, 0)
                    with self.lock:
                        ticket = self._submit_locked(offset, n, rec.dtype, rec.op, rec)
                        rec.chunks_left += 1
                        rec.several = rec.several or n < total
                        rec.submitted_all = start + n >= total
                        self.inflight_bytes += nbytes
                        copy_out = (lambda p=part, v=view: _copied(p, v)) if rec.resident is None else None
                        self.inflight[ticket] = (rec, copy_out, view, rng, nbytes)
                        self.room.notify_all()  # the completion thread waits for work when nothing is in flight
                except BaseException:
                    if rng is not None:
                        with self.lock:
                            self.space.release(*rng)
                    raise
                start += n
        except BaseException as e:
            self._submit_failed(rec, start, e)

    def _submit_failed(self, rec, start, e):
        """`rec` could not be wholly submitted: it fails, and so does the group (its ranks' ops no
        longer pair)."""
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

    def _submit_blocks(self, rec):
        """A reduce_scatter's or allgather's ringd ops: each the same part [a, a + m) of every
        block, laid out in the slot as blocks of m (the rank's own block in place: the output of a
        reduce_scatter, the input of an allgather), so that one range holds the op."""
        esize, n, k, r = rec.flat.element_size(), rec.blocks, rec.block, self.rank
        with self.lock:
            plan = self._in_place_plan(rec)
        if plan is not None:  # input and output in the slot (from allocate): no copy
            return self._submit_in_place(rec, *plan)
        src_blocks = rec.src.view(n, k) if rec.collective == "reduce_scatter" else None
        out_blocks = rec.flat.view(n, k) if rec.collective == "allgather" else None

        def fill(rng, start, m):
            view = self.slot[rng[0]:rng[0] + n * m * esize].view(rec.flat.dtype).view(n, m)
            mine = rng[0] + r * m * esize
            with torch.no_grad():
                if rec.collective == "reduce_scatter":
                    view.copy_(src_blocks[:, start:start + m])
                    self._note_copies(n * m * esize, 0)
                    return rng[0], mine, (lambda p=rec.flat[start:start + m], v=view[r]: _copied(p, v)), view
                view[r].copy_(rec.src[start:start + m])
                self._note_copies(m * esize, 0)
                return mine, rng[0], (lambda p=out_blocks[:, start:start + m], v=view: _copied(p, v)), view
        self._submit_parts(rec, rec.collective, _chunks(k, esize * n, self.max_chunk, self.taper), k,
                           lambda m: (n * m * esize, n * m * esize), fill)

    def _submit_rooted(self, rec):
        """A broadcast's or reduce's ringd ops (the allreduce's cut), or a barrier's one."""
        if rec.collective == "barrier":
            try:
                with self.lock:
                    ticket = self._submit_coll_locked("barrier", 0, rec.dtype, "sum", 0, 0)
                    rec.chunks_left += 1
                    rec.submitted_all = True
                    self.inflight[ticket] = (rec, None, None, None, 0)
                    self.room.notify_all()
            except BaseException as e:
                self._submit_failed(rec, 0, e)
            return
        esize, total = rec.flat.element_size(), rec.flat.numel()
        mine = rec.root == self.rank
        copy_in = rec.collective == "reduce" or mine
        copy_out = (rec.collective == "broadcast") != mine

        def fill(rng, start, m):
            part, view = rec.flat[start:start + m], self.slot[rng[0]:rng[0] + m * esize].view(rec.flat.dtype)
            if copy_in:
                with torch.no_grad():
                    view.copy_(part)
                self._note_copies(m * esize, 0)
            return rng[0], rng[0], (lambda p=part, v=view: _copied(p, v)) if copy_out else None, view
        self._submit_parts(rec, rec.collective, _chunks(total, esize, self.max_chunk, self.taper), total,
                           lambda m: (m * esize, m * esize), fill)

    def _submit_a2a(self, rec):
        """An all_to_all's one ringd op: its input, output and split sizes in one slot range.
        Equal blocks (no split sizes: the same sizes on every rank) in a group that cuts alike
        (taper) go as several ops instead, each the same part of every block (_submit_a2a_parts)."""
        esize, n = rec.flat.element_size(), self.ranks
        if rec.splits is None and self.taper and rec.src.numel() >= n:
            parts = list(_chunks(rec.src.numel() // n, esize * n, self.max_chunk, True))
            if len(parts) > 1:
                return self._submit_a2a_parts(rec, parts)
        in_bytes, out_bytes = rec.src.numel() * esize, rec.flat.numel() * esize
        nbytes = (in_bytes + out_bytes + 63) // 64 * 64 + 16 * n
        try:
            with self.lock:
                self._wait_locked(lambda: not self.inflight_bytes or self.inflight_bytes + nbytes <= self.window,
                                  f"ringd: the ops in flight did not end within {self.timeout}")
                rng = self._alloc_locked(nbytes)
            try:
                in_off = rng[0]
                out_off = in_off + in_bytes
                table = rng[0] + (in_bytes + out_bytes + 63) // 64 * 64
                view_in = self.slot[in_off:in_off + in_bytes].view(rec.flat.dtype)
                view_out = self.slot[out_off:out_off + out_bytes].view(rec.flat.dtype)
                with torch.no_grad():
                    view_in.copy_(rec.src)
                self._note_copies(in_bytes, 0)
                with self.lock:
                    if rec.splits is None:
                        ticket = self._submit_coll_locked("all_to_all", rec.src.numel() // n, rec.dtype, "sum", in_off, out_off)
                    else:
                        ticket = self._submit_coll_locked("all_to_all", 0, rec.dtype, "sum", in_off, out_off,
                                                          splits=(rec.splits[0], rec.splits[1], table))
                    rec.chunks_left += 1
                    rec.submitted_all = True
                    self.inflight_bytes += nbytes
                    self.inflight[ticket] = (rec, lambda p=rec.flat, v=view_out: _copied(p, v), view_out, rng, nbytes)
                    self.room.notify_all()
            except BaseException:
                with self.lock:
                    self.space.release(*rng)
                raise
        except Exception as e:
            # Not submitted (no room for it within the timeout, or the window never opened): the
            # others submit it, so this rank refuses it in its place, where ringd takes refusals,
            # and the group goes on; else the group is unusable (_submit_failed).
            if not rec.submitted_all and self._refused_instead(rec, e):
                return
            self._submit_failed(rec, 0, e)
        except BaseException as e:
            self._submit_failed(rec, 0, e)

    def _not_submitted(self, dtype, why, needed=0):
        """This rank cannot submit its next op, an all_to_all the other ranks submit (`needed`: the
        slot bytes it would take, 0: not said). It refuses it in its place in the sequence, so
        that ringd fails it on every rank at once, naming this one, and the group goes on; a
        library or ringd without refusals leaves the others waiting their op timeout, and this
        rank's next ops would pair with their earlier ones: the group is unusable."""
        if not self.client.refuses():
            with self.lock:
                self.dead = self.dead or f"{why}; this process group cannot be used any more: restart the job"
            return
        rec = _Op(None, None, False, _compat.OpFuture(), [], "sum", dtype)
        rec.collective, rec.refused = "refuse", needed
        self._queue(rec)

    def _refused_instead(self, rec, e):
        """Refuses `rec`'s one ringd op (ringd_refuse, no bytes said: "it could not submit its
        all_to_all") after it could not be submitted: `rec` fails with `e`, and the ranks' ops stay
        in step. False where the library or ringd has no refusals."""
        if not self.client.refuses():
            return False
        with self.lock:
            try:
                ticket = self._submit_coll_locked("refuse", 0, rec.dtype, "sum", 0, 0)
            except Exception:
                return False
            rec.error = rec.error or str(e)
            rec.chunks_left += 1
            rec.submitted_all = True
            self.inflight[ticket] = (rec, None, None, None, 0)
            self.room.notify_all()
        return True

    def _submit_refusal(self, rec):
        """An all_to_all this rank cannot run, refused in its place (ringd_refuse: every rank's op
        fails, naming this one). The refusal's completion ends `rec`, which nobody waits for."""
        try:
            with self.lock:
                ticket = self._submit_coll_locked("refuse", rec.refused, rec.dtype, "sum", 0, 0)
                rec.chunks_left += 1
                rec.submitted_all = True
                self.inflight[ticket] = (rec, None, None, None, 0)
                self.room.notify_all()
        except BaseException as e:
            self._submit_failed(rec, 0, e)

    def _submit_a2a_parts(self, rec, parts):
        """An all_to_all of equal blocks of k elements as one ringd op per part [a, a + m) of every
        block (parts: the m's, the allreduce's cut of k, so every rank cuts alike): each op's input
        and output are n blocks of m in one slot range. The first op starts after a short copy in,
        and each op's result is copied out while the next ones are on the wire."""
        esize, n = rec.flat.element_size(), self.ranks
        k = rec.src.numel() // n
        src_blocks, out_blocks = rec.src.view(n, k), rec.flat.view(n, k)

        def fill(rng, start, m):
            half = n * m * esize
            in_off, out_off = rng[0], rng[0] + (half + 63) // 64 * 64
            view_in = self.slot[in_off:in_off + half].view(rec.flat.dtype).view(n, m)
            view_out = self.slot[out_off:out_off + half].view(rec.flat.dtype).view(n, m)
            with torch.no_grad():
                view_in.copy_(src_blocks[:, start:start + m])
            self._note_copies(half, 0)
            return in_off, out_off, (lambda p=out_blocks[:, start:start + m], v=view_out: _copied(p, v)), view_out
        # (The window counts what is copied in, as for the other collectives: the input.)
        self._submit_parts(rec, "all_to_all", parts, k,
                           lambda m: (2 * ((n * m * esize + 63) // 64 * 64), n * m * esize), fill)

    def _submit_parts(self, rec, collective, parts, total, sizes, fill):
        """`rec` as one ringd op per part: for each m of `parts` (summing to `total`), sizes(m) is
        (the slot bytes of its op, what it counts in the window) and fill(range, start, m) copies
        the part into the range and gives (input offset, output offset, its copy out, the view
        it is copied out of). Each op waits for the window and its range; one that cannot be
        submitted fails `rec`, and the group with it (_submit_failed). A broadcast's or reduce's ops go to
        rec.root."""
        start = 0
        try:
            for m in parts:
                nbytes, weight = sizes(m)
                with self.lock:
                    self._wait_locked(lambda: not self.inflight_bytes or self.inflight_bytes + weight <= self.window,
                                      f"ringd: the ops in flight did not end within {self.timeout}")
                    rng = self._alloc_locked(nbytes)
                try:
                    in_off, out_off, copy_out, view = fill(rng, start, m)
                    with self.lock:
                        ticket = self._submit_coll_locked(collective, m, rec.dtype, rec.op, in_off, out_off, rec.root)
                        rec.chunks_left += 1
                        rec.several = rec.several or m < total
                        rec.submitted_all = start + m >= total
                        self.inflight_bytes += weight
                        self.inflight[ticket] = (rec, copy_out, view, rng, weight)
                        self.room.notify_all()
                except BaseException:
                    with self.lock:
                        self.space.release(*rng)
                    raise
                start += m
        except BaseException as e:
            self._submit_failed(rec, start, e)

    def _submit_in_place(self, rec, collective, count, in_off, out_off):
        """One ringd op on tensors that lie in the slot: nothing copied in, nothing out."""
        try:
            with self.lock:
                ticket = self._submit_coll_locked(collective, count, rec.dtype, rec.op, in_off, out_off,
                                                  rec=rec if collective == "allreduce" else None)
                rec.chunks_left += 1
                rec.submitted_all = True
                self.in_place_ops += 1
                self.inflight[ticket] = (rec, None, None, None, 0)
                self.room.notify_all()
        except BaseException as e:
            self._submit_failed(rec, 0, e)

    def _note_copies(self, in_bytes, out_bytes):
        """Bytes copied into or out of the slot: the engine's count, and ringd's status (copies)."""
        self.copied_in += in_bytes
        self.copied_out += out_bytes
        self.client.note_copies(in_bytes, out_bytes)

    def _alloc_locked(self, nbytes):
        """A slot range, waiting for earlier ops to give theirs back (within the timeout)."""
        got = []
        self._wait_locked(lambda: got.append(self.space.alloc(nbytes)) or got[-1] is not None,
                          f"ringd: no room for {nbytes} bytes in the {self.ps.bytes}-byte slot "
                          f"within {self.timeout} (set RINGD_SLOT_BYTES higher)")
        return got[-1]

    def _submit_locked(self, offset, count, dtype, op, rec=None):
        return self._submit_coll_locked("allreduce", count, dtype, op, offset, 0, rec=rec)

    def _submit_allreduce(self, rec, offset, count):
        """One ringd op of `rec`'s allreduce: with its own wire and feedback key where it has them
        (raises RingdError as Client does)."""
        if rec.wire is None and rec.feedback_tag is None:
            return self.client.submit(offset, count, rec.dtype, rec.op)
        tag = None if rec.feedback_tag is None else (int(rec.feedback_tag) << 20) + rec.parts
        ticket = self.client.submit_coll("allreduce", count, rec.dtype, rec.op, offset, 0, wire=rec.wire, feedback_tag=tag)
        rec.parts += 1
        return ticket

    def _submit_coll_locked(self, collective, count, dtype, op, in_offset, out_offset, root=0, splits=None, rec=None):
        end = datetime.datetime.now() + self.timeout
        while True:
            if self.dead:
                raise RuntimeError(self.dead)
            try:
                if collective == "allreduce":
                    return self._submit_allreduce(rec, in_offset, count) if rec is not None else \
                        self.client.submit(in_offset, count, dtype, op)
                if collective == "refuse":  # (count: the slot bytes the all_to_all needed)
                    return self.client.refuse("all_to_all", count)
                if splits is not None:  # all_to_all: (send counts, receive counts, table offset)
                    return self.client.submit_coll(collective, count, dtype, op, in_offset, out_offset, 0, splits[0],
                                                   splits[1], splits[2])
                if collective in _ROOTED:
                    return self.client.submit_coll(collective, count, dtype, op, in_offset, out_offset, root)
                return self.client.submit_coll(collective, count, dtype, op, in_offset, out_offset)
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
                for (rec, copy_out, view, rng, nbytes), err in done:
                    try:
                        if err is None and copy_out is not None:
                            with torch.no_grad():
                                self._note_copies(0, copy_out())
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
                done = rec = copy_out = view = None  # (as in _submit_loop)

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
            finally:
                rec = None  # (as in _submit_loop)

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
            # Still queued, or still in ringd: failed. The ranges of those in ringd are held until
            # ringd is surely done with them: it may write them until the op's deadline (its op
            # timeout from the submission, at most the one this group asked for, plus about a
            # second), and by then it ended every op it took (ringd.h, Deadlines). Ops running
            # where their tensors lie (lent over the slot) hold those tensors alike, so that their
            # ranges are not lent again before. With no timeout asked for (ringd's own), they are
            # held as long as the slot is mapped.
            left = list(self.pending) + [entry[0] for entry in self.inflight.values()]
            held = [rng for rec, copy_out, view, rng, nbytes in self.inflight.values() if rng is not None]
            lent = [(rec.flat, rec.src) for rec, copy_out, view, rng, nbytes in self.inflight.values()
                    if rec.resident is None and copy_out is None and rng is None and rec.flat is not None]
            busy = [res.rng for res in self.resident.values() if res.busy]
            for key in [k for k, res in self.resident.items() if res.busy]:  # (held: no longer the hook's)
                self.ps.resident_bytes -= self.resident.pop(key).rng[1]
            if self.staging is not None and left:
                held.append(self.staging)  # (a device op of this group may still be in ringd)
                self.ps.staging_bytes -= self.staging[1]
                self.staging = None
            # (Their deadline counts from the client's close below: until then the library may
            # still hand ringd parts of a device op.)
            holding = self.space.hold(None, held + busy, lent)
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
            for res in self.resident.values():  # (the busy ones are held above)
                self.space.release(*res.rng)
                self.ps.resident_bytes -= res.rng[1]
            if self.staging is not None:
                # No device op of this group is in ringd any more (none was left in flight).
                self.space.release(*self.staging)
                self.ps.staging_bytes -= self.staging[1]
                self.staging = None
        self.resident.clear()
        _disconnect(self.client, self.ps, self.socket)
        if holding is not None and self.timeout is not None:
            with self.lock:
                holding[0] = time.monotonic() + self.timeout.total_seconds() + _hold_margin_s()
