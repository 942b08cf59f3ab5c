"""ringd.torch's CUDA path: device buffers allreduced by ringd's CUDA support (registered once per
driver allocation, copied through the group's staging range of the slot in parts, ordered on the
caller's stream). DeviceOps is the part of a process group's engine (ringd._engine._Engine) that
submits them; allreduce_cuda is the process group's allreduce (broadcast, reduce) of a CUDA tensor,
collective_cuda its reduce_scatter or allgather."""
import collections
import datetime
import errno

import torch

import ringd as _ringd
from ringd import _compat
from ringd._slot import _DTYPES, _Op, _distinct_elements

_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


# Device allocations a group keeps registered with ringd (ringd allows 4096 per client).
_MAX_DEVICE_REGISTRATIONS = 1024


class DeviceBuffer:
    """What ringd's CUDA path needs of a device tensor: its address, element count, ringd dtype
    name ("float32", ...), CUDA device index and the stream (cudaStream_t as an int, 0: the legacy
    default stream) whose queued work produces it. The backend makes one of each CUDA tensor;
    tests make them of memory of ringd's software CUDA device."""

    __slots__ = ("ptr", "count", "dtype", "device", "stream")

    def __init__(self, ptr, count, dtype, device, stream):
        self.ptr, self.count, self.dtype, self.device, self.stream = int(ptr), int(count), dtype, device, int(stream)



class DeviceOps:
    """The device ops of an _Engine (its lock, room, slot space, client and timeout): submitted in
    the caller's thread, completed by the engine's completing thread like its other ops."""

    def _device_init(self):
        # The GPU, part size and staging range (set by the first op), registrations by allocation
        # base (size, driver buffer id, registration), least recently used first.
        self.device = None
        self.device_part = self.staging_bytes = 0
        self.staging = None
        self.device_regs = collections.OrderedDict()
        self.device_ops = self.device_registrations = self.device_last_reg = 0
        self.device_host_ops = 0  # all_to_alls too large for the staging range: through host memory

    def allreduce_device(self, buf, op, opf, result, keep=None, stream=None, deferred=False):
        """Submits the allreduce of a DeviceBuffer now, in the caller's thread (so that ringd reads
        it after what buf.stream queued so far); returns (ticket, op record). `opf` (an OpFuture)
        completes with `result` once the result is in the buffer. The ops queued before it on
        the copying path go first (one order on every rank). `keep`: kept alive until the op ends.
        `deferred`: the caller queues more work for the result (on `stream`, a torch stream, where
        the future's event is then recorded): the future completes only after
        release_finish(record)."""
        return self._device_op(buf.dtype, [buf], lambda: self.client.submit_cuda(buf.ptr, buf.count, buf.dtype, op, buf.stream),
                               op, opf, result, keep, stream, deferred)

    def collective_device(self, name, src, out, op, opf, result, keep=None, stream=None, deferred=False):
        """Submits a reduce_scatter (`src` has a block per rank, `out` one), allgather (`src` one
        block, `out` one per rank) or all_to_all (both a block per rank, apart) of DeviceBuffers
        now, as allreduce_device does an allreduce; `out.count` and `src.count` are their
        elements. Blocks in the group's rank order (the engine's rank, ranks)."""
        if src.device != out.device:
            raise RuntimeError(f"ringd: a {name}'s input (cuda:{src.device}) and output (cuda:{out.device}) must be "
                               "on one GPU")
        if name == "all_to_all" and (src.count != out.count or src.count % self.ranks):
            raise RuntimeError(f"ringd: an all_to_all of device buffers takes an input and an output of the same "
                               f"size, {self.ranks} equal blocks (not {src.count} and {out.count} elements)")
        block = (out.count if name == "reduce_scatter" else src.count // self.ranks if name == "all_to_all"
                 else src.count)
        return self._device_op(out.dtype, [src, out],
                               lambda: self.client.submit_coll_cuda(name, block, out.dtype, op, src.ptr, out.ptr, src.stream),
                               op, opf, result, keep, stream, deferred)

    def all_to_all_device(self, src, out, send, recv, host, opf, result, keep=None, stream=None, deferred=False):
        """Submits an all_to_all with split sizes of DeviceBuffers now, as collective_device does
        one of equal blocks: `send` (elements to each rank, in rank order) of `src`, `recv` (from
        each) into `out`. One ringd op, staged whole through the group's staging range. Its sizes
        differ from rank to rank, so no rank can cut it as the others do: one that does not fit
        the staging range goes through host memory instead (`host`: read() gives the input as a
        CPU tensor once the device produced it, finish(t, complete) puts the CPU result t where
        `out` goes, in stream order, and calls complete(); empty(n) a CPU tensor of n of its
        elements for the result), as a slot all_to_all, the same ringd op (one larger than the
        slot's room: refused in its place, every rank's op fails naming this one, as for CPU
        tensors); so does one that sends and receives nothing. Then (None, None) is returned and
        `opf` completes after finish()."""
        n = self.ranks
        send, recv = [int(k) for k in send], [int(k) for k in recv]
        if len(send) != n or len(recv) != n or sum(send) != src.count or sum(recv) != out.count or min(send + recv) < 0:
            raise RuntimeError(f"ringd: all_to_all's split sizes must be {n} each, summing to the input's {src.count} "
                               f"and the output's {out.count} elements")
        if src.count and out.count and src.device != out.device:
            raise RuntimeError(f"ringd: an all_to_all's input (cuda:{src.device}) and output (cuda:{out.device}) must be "
                               "on one GPU")
        if src.count or out.count:
            bufs = [b for b in (src, out) if b.count]
            esize = torch.empty((), dtype=_TORCH_DTYPES[out.dtype]).element_size()
            needed = -(-src.count * esize // 64) * 64 + -(-out.count * esize // 64) * 64 + 16 * n
            staged = self._device_op(out.dtype, bufs,
                                     lambda: self.client.submit_coll_cuda("all_to_all", 0, out.dtype, "sum", src.ptr,
                                                                          out.ptr, bufs[0].stream, splits=(send, recv)),
                                     "sum", opf, result, keep, stream, deferred,
                                     fits=lambda: needed <= self.staging_bytes)
            if staged is not None:
                return staged
            with self.lock:
                self.device_host_ops += 1
        dtype = _TORCH_DTYPES[out.dtype]
        try:
            cpu_in = host.read() if src.count else torch.empty(0, dtype=dtype)
            cpu_out = host.empty(out.count) if out.count else torch.empty(0, dtype=dtype)
        except Exception as e:
            # Not submitted: the others submit it, so this rank refuses it in its place (or, with
            # no refusals, the group cannot be used any more), as when a CPU tensor's cannot be.
            self._not_submitted(out.dtype, f"ringd: an all_to_all through host memory: {e}")
            raise RuntimeError(f"ringd: an all_to_all through host memory: {e}") from None
        fut = self.all_to_all(cpu_out, cpu_in, recv, send, [])

        def done(f):
            try:
                f.value()
                if out.count:
                    host.finish(cpu_out, lambda: opf.set_result(result))
                else:
                    opf.set_result(result)
            except Exception as e:
                text = _compat.ringd_message(e)
                opf.set_error(text if text.startswith("ringd") else f"ringd: {text}")
        fut.then(done)
        return None, None

    def rooted_device(self, name, buf, root, op, opf, result, keep=None, stream=None, deferred=False):
        """Submits a broadcast or reduce (`name`) of a DeviceBuffer to or from group rank `root`
        now, in place, as allreduce_device does an allreduce: a broadcast leaves the root's buffer
        in every rank's, a reduce the reduction in the root's (the others' are only read)."""
        return self._device_op(buf.dtype, [buf],
                               lambda: self.client.submit_coll_cuda(name, buf.count, buf.dtype, op, buf.ptr, buf.ptr,
                                                                    buf.stream, root=root),
                               op, opf, result, keep, stream, deferred)

    def _device_op(self, dtype, bufs, submit, op, opf, result, keep, stream, deferred, fits=None):
        """The device op submit() submits, tracked until it ends: (ticket, record). fits: whether
        the op fits the group's staging range (asked once it is set up, before anything is
        registered); one that does not (or that the library finds too large: E2BIG, nothing
        taken) gives None instead of ending the group."""
        rec = _Op(None, None, False, opf, result, op, dtype)
        rec.keep = keep
        rec.stream = stream
        rec.deferred = deferred
        with self.lock:
            self._wait_locked(lambda: not self.pending, f"ringd: the ops queued before did not go within {self.timeout}")
            try:
                self._device_setup_locked(bufs[0].device)
                if fits is not None and not fits():
                    return None
                for buf in bufs:
                    reg = self._device_registration_locked(buf)
                ticket = self._submit_device_locked(submit)
            except BaseException as e:
                if fits is not None and isinstance(e, _ringd.RingdError) and e.code == -errno.E2BIG:
                    return None
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
        self.ps.staging_bytes += rng[1]

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

    def _submit_device_locked(self, submit):
        end = datetime.datetime.now() + self.timeout
        while True:
            if self.dead:
                raise RuntimeError(self.dead)
            try:
                return submit()
            except _ringd.RingdError as e:
                if e.code != -errno.EAGAIN:  # EAGAIN: too many ops in flight; wait for one to finish
                    raise
            if datetime.datetime.now() >= end:
                raise RuntimeError(f"ringd: too many ops in flight for {self.timeout}")
            self.room.wait(0.05)


def allreduce_cuda(engine, tensor, name, result, tensors, root=None, collective="allreduce", read=True, written=True,
                   into=None):
    """A CUDA tensor's allreduce through ringd's CUDA path, in the order of the current
    stream: ringd reads the tensor after what the stream queued so far, Work.wait() makes the
    current stream wait for the result (the host does not block), and the future completes
    once the result is in the tensor. `collective` "broadcast" or "reduce" (with `root`, a group
    rank) runs that instead, in place the same way; `read` / `written` say whether this rank's
    tensor is read (a broadcast's root, every reduce rank) and written (a broadcast's others, a
    reduce's root), so that a copy of a non-contiguous one is made only where it is. `into`: the
    tensor the result goes to where it is not `tensor` (a scaled copy's reduce), written where
    `written`."""
    given = tensor.detach()
    dense = _distinct_elements(given)
    stream = torch.cuda.current_stream(tensor.device)
    if dense.is_contiguous():
        flat = dense
    elif read:
        flat = dense.contiguous()  # a copy on the current stream
    else:
        flat = torch.empty(dense.shape, dtype=dense.dtype, device=dense.device)  # only written
    opf = _compat.OpFuture(devices=[tensor.device])
    buf = DeviceBuffer(flat.data_ptr(), flat.numel(), _DTYPES[tensor.dtype], tensor.device.index, stream.cuda_stream)
    if buf.count == 0:
        opf.set_result(result)
        return _compat.work(opf.future, tensors)
    def submit(**kw):
        if collective == "allreduce":
            return engine.allreduce_device(buf, name, opf, result, **kw)
        return engine.rooted_device(collective, buf, root, name, opf, result, **kw)
    if flat is dense and into is None:
        ticket, _ = submit()
        return _compat.work(opf.future, tensors,
                            on_wait=lambda: engine.stream_wait(ticket, torch.cuda.current_stream(tensor.device).cuda_stream))
    # Through a contiguous copy (or into another tensor): the result goes back on the current
    # stream, after ringd's, where this rank's tensor is written; the future completes after that
    # copy (its event is recorded on this stream), and Work.wait() orders the caller's stream
    # after it too.
    target = dense if into is None else into.detach()
    ticket, rec = submit(keep=flat, stream=stream, deferred=True)

    def copy_back():
        if written:
            target.copy_(flat.view(target.shape))
    return _copied_back(engine, ticket, rec, stream, copy_back, tensor.device, opf, tensors)


def _copied_back(engine, ticket, rec, stream, copy_back, device, opf, tensors):
    """The Work of a deferred device op whose result goes into the caller's tensor by `copy_back`,
    queued on `stream` after ringd's result: the future completes after that copy (its event is
    recorded on this stream), and Work.wait() orders the caller's stream after it too."""
    try:
        engine.stream_wait(ticket, stream.cuda_stream)
        with torch.no_grad():
            copy_back()
        copied = torch.cuda.Event()
        copied.record(stream)
    finally:
        engine.release_finish(rec)
    return _compat.work(opf.future, tensors, on_wait=lambda: torch.cuda.current_stream(device).wait_event(copied))


def collective_cuda(engine, name, src, out, op, result, tensors, copy_back=None):
    """A reduce_scatter, allgather or all_to_all (equal blocks) of CUDA tensors through ringd's
    CUDA path, in the order of the current stream, as allreduce_cuda: `src` (read only) and `out`
    hold the group's blocks in rank order; an output that is not contiguous gets the result
    through a contiguous copy. `copy_back(result)`: where the result goes from there (queued on
    the stream after ringd's result; a list form's outputs), `out` then the caller's scratch."""
    stream = torch.cuda.current_stream(out.device)
    src = src.detach()
    src = src if src.is_contiguous() else src.contiguous()  # a copy on the current stream
    given = out.detach()
    flat = given if given.is_contiguous() else torch.empty(given.shape, dtype=given.dtype, device=given.device)
    opf = _compat.OpFuture(devices=[out.device])
    dtype = _DTYPES[out.dtype]
    sbuf = DeviceBuffer(src.data_ptr(), src.numel(), dtype, src.device.index, stream.cuda_stream)
    obuf = DeviceBuffer(flat.data_ptr(), flat.numel(), dtype, out.device.index, stream.cuda_stream)
    if obuf.count == 0:
        opf.set_result(result)
        return _compat.work(opf.future, tensors)
    if flat is given and copy_back is None:
        ticket, _ = engine.collective_device(name, sbuf, obuf, op, opf, result, keep=src)
        return _compat.work(opf.future, tensors,
                            on_wait=lambda: engine.stream_wait(ticket, torch.cuda.current_stream(out.device).cuda_stream))
    ticket, rec = engine.collective_device(name, sbuf, obuf, op, opf, result, keep=(src, flat), stream=stream,
                                           deferred=True)
    return _copied_back(engine, ticket, rec, stream, lambda: (copy_back or given.copy_)(flat), out.device, opf, tensors)


class _HostStaging:
    """all_to_all_device's way through host memory for CUDA tensors (an op too large for the
    staging range): the input read once the stream produced it, the result written back on the
    stream, after which the op's future completes (its event recorded there)."""

    def __init__(self, src, put, stream, dtype):
        self.src, self.put, self.stream, self.dtype = src, put, stream, dtype

    def read(self):
        with torch.cuda.stream(self.stream):
            return self.src.cpu()  # (waits for what the stream queued so far)

    def empty(self, count):
        # Pinned: the copy back is queued on the stream without waiting for it (torch's host
        # allocator keeps the memory until the copy ran).
        return torch.empty(count, dtype=self.dtype, pin_memory=True)

    def finish(self, result, complete):
        with torch.cuda.stream(self.stream), torch.no_grad():
            self.put(result)
            complete()


def all_to_all_cuda(engine, src, out, send, recv, result, tensors, copy_back=None):
    """An all_to_all with split sizes (elements to send to each rank, to receive from each) of
    CUDA tensors through ringd's CUDA path, in the order of the current stream, as
    collective_cuda: `src` (read only) holds the blocks to send in rank order, `out` gets the
    received ones (`copy_back(result)`: where they go from there, `out` then the caller's
    scratch). One too large for the staging range goes through host memory: the calling thread
    then waits for the stream to produce the input."""
    stream = torch.cuda.current_stream(out.device)
    src = src.detach().contiguous().view(-1)  # (a copy on the current stream where it is not contiguous)
    given = out.detach()
    flat = given.view(-1) if given.is_contiguous() else torch.empty(given.numel(), dtype=given.dtype, device=given.device)
    put = copy_back or (lambda r: given.copy_(r.view(given.shape), non_blocking=True))
    host = _HostStaging(src, put, stream, given.dtype)
    opf = _compat.OpFuture(devices=[out.device])
    dtype = _DTYPES[out.dtype]
    sbuf = DeviceBuffer(src.data_ptr(), src.numel(), dtype, src.device.index, stream.cuda_stream)
    obuf = DeviceBuffer(flat.data_ptr(), flat.numel(), dtype, out.device.index, stream.cuda_stream)
    through_copy = not given.is_contiguous() or copy_back is not None
    ticket, rec = engine.all_to_all_device(sbuf, obuf, send, recv, host, opf, result,
                                           keep=(src, flat) if through_copy else src, stream=stream if through_copy else None,
                                           deferred=through_copy)
    if ticket is None:  # through host memory, or nothing sent or received here
        return _compat.work(opf.future, tensors)
    if not through_copy:
        return _compat.work(opf.future, tensors,
                            on_wait=lambda: engine.stream_wait(ticket, torch.cuda.current_stream(out.device).cuda_stream))
    return _copied_back(engine, ticket, rec, stream, lambda: put(flat), out.device, opf, tensors)
