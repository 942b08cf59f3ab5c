"""ringd.torch: ringd as a torch.distributed backend.

    import ringd.torch                      # registers the backend "ringd"
    dist.init_process_group("ringd")        # torchrun's environment, as for "gloo"
    model = DistributedDataParallel(model)  # gradients are allreduced by the host's ringd
    model.register_comm_hook(None, ringd.torch.allreduce_hook)   # optional: fewer copies

allreduce, reduce_scatter (reduce_scatter_tensor and the list form) and allgather
(all_gather_into_tensor and the list form), and their coalesced forms, of
float32/float64/float16/bfloat16/int32/int64 tensors with SUM, AVG, MIN, MAX and PREMUL_SUM go
through ringd: the tensor is copied into this process's shared-memory slot, reduced or gathered
there with every rank's (the local ranks on the host, then across hosts), and copied back;
reduce_scatter's and allgather's blocks are in the process group's rank order, whatever the
hosts' order. broadcast, reduce, barrier and all_to_all (splits too) of CPU tensors go through
ringd as well, and CUDA tensors' allreduce, reduce_scatter, allgather, broadcast, reduce and
all_to_all_single without split sizes through ringd's CUDA path (docs/pytorch.md). With a ringd or library of an older release anywhere in the
group, a collective it lacks takes the earlier path (reduce_scatter as an allreduce, the others
Gloo). Everything else (gather, scatter, send/recv, object collectives, other dtypes and ops) goes
through a Gloo group built from the same store, which gives the same result. Every process group (the default one and
each new_group) is a ringd group over the hosts of its ranks (all of the ring's, or part of them),
its ranks on a host ordered by LOCAL_RANK (torchrun sets it; default 0).
RINGD_SOCKET (default /run/ringd/ringd.sock) and RINGD_SLOT_BYTES (default 256 MiB, at most
ringd's memory.slot_bytes) configure the client; RINGD_WIRE (exact, bf16, fp16, int8) the wire of
every ringd process group's sums and averages of float32 and bfloat16 (allreduce, reduce_scatter,
reduce; see set_wire and compressed_hook, and docs/wire.md for what each format costs in accuracy).
Any ringd error is a RuntimeError with ringd's message. The process group's timeout
(init_process_group(timeout=...), new_group(timeout=...)) is its ringd group's op timeout: every op
ends within it of its first submission on a host (clamped to ringd's timeouts.op_max); a dead or
hung host is found by ringd's heartbeats within seconds whatever it is.
"""
import datetime
import os
import socket as _socket
import uuid
import weakref

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

import ringd as _ringd
from ringd import _compat
from ringd._device import DeviceBuffer, all_to_all_cuda, allreduce_cuda, collective_cuda
from ringd._engine import _Engine
from ringd._slot import _DTYPES, _chunk_bytes, _env_bytes, _env_int, _process_slots, _process_slots_lock


__all__ = ["ProcessGroupRingd", "allreduce_hook", "compressed_hook", "set_wire", "BACKEND", "DeviceBuffer"]

BACKEND = "ringd"


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


def _overlaps(a, b):
    """Whether the memory two tensors span overlaps (from their first element to their last)."""
    def span(t):
        lo = t.data_ptr()
        if t.numel() == 0:
            return lo, lo
        return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _op_name(op):
    for name, ref in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("min", dist.ReduceOp.MIN),
                      ("max", dist.ReduceOp.MAX)):
        if op == ref:
            return name
    return None

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
    """allreduce, reduce_scatter, allgather, broadcast, reduce, barrier and all_to_all through ringd;
    the other collectives (gather, scatter, send/recv, object collectives) through an internal Gloo
    group."""

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
        # And whether its ringd runs reduce_scatter and allgather: the group runs them through
        # ringd only if every rank's does (the ranks must all take the same path).
        mine = int("reduce_scatter" in st.get("collectives", ()) and _ringd.Client.has_collectives())
        # And of CUDA tensors (device buffers), under a key of its own, written before the member
        # entry (so it is there once that is): a rank of an earlier release writes none.
        device = int(mine and "reduce_scatter" in st.get("device_collectives", ()) and
                     _ringd.Client.has_device_collectives())
        store.set(f"ringd/device/{rank}", str(device))
        # And whether it runs broadcast and reduce, and all_to_all, of CUDA tensors (its ringd and
        # library both; a key each).
        def runs_device(*colls):
            return int(device and set(colls) <= set(st.get("device_collectives", ())) and
                       all(_ringd.Client.cuda_collectives() & (1 << _ringd.COLLECTIVES[c]) for c in colls))
        store.set(f"ringd/device-rooted/{rank}", str(runs_device("broadcast", "reduce")))
        store.set(f"ringd/device-a2a/{rank}", str(runs_device("all_to_all")))
        # And all_to_all of CUDA tensors with split sizes (the list forms ride on it).
        store.set(f"ringd/device-a2av/{rank}", str(int(runs_device("all_to_all") and bool(st.get("device_all_to_all_splits")) and
                                                       _ringd.Client.cuda_all_to_all_splits())))
        # And whether it runs broadcast, reduce, barrier and all_to_all (a key of its own, as above).
        rooted = int(mine and {"broadcast", "all_to_all"} <= set(st.get("collectives", ())) and
                     _ringd.Client.has_rooted_collectives() and _ringd.Client.has_all_to_all())
        store.set(f"ringd/rooted/{rank}", str(rooted))
        # And that it cuts a large tensor into ops tapering at the end (_chunks): the ranks of a
        # group must cut alike, so the group tapers only if every rank does (an earlier release
        # writes no key).
        store.set(f"ringd/taper/{rank}", "1")
        # And that an all_to_all given split sizes is one op whatever their values (an earlier
        # release cuts all-equal ones into parts, as equal blocks): the group does so only if every
        # rank does.
        store.set(f"ringd/a2a-splits-whole/{rank}", "1")
        store.set(f"ringd/member/{rank}", f"{me[0]}:{me[1]}:{slot_bytes}:{mine}")
        members, smallest_slot, collectives, device_collectives, rooted_collectives = [], slot_bytes, True, True, True
        device_rooted_collectives = device_a2a = device_a2av = True
        taper = splits_whole = True
        for r in range(size):
            entry = store.get(f"ringd/member/{r}").decode()
            if entry.startswith("!"):
                raise RuntimeError(f"ringd: rank {r} of this process group could not reach its ringd: {entry[1:]}")
            host, local, slot, theirs = entry.rsplit(":", 3)
            members.append((host, int(local), r))
            smallest_slot = min(smallest_slot, int(slot))
            collectives = collectives and theirs == "1"
            # (compare_set with a value no rank writes: the key's value, or that value when it is
            # absent, without waiting for it and without writing it; torch 1.13's store has no check)
            device_collectives = device_collectives and store.compare_set(f"ringd/device/{r}", "?", "?") == b"1"
            rooted_collectives = rooted_collectives and store.compare_set(f"ringd/rooted/{r}", "?", "?") == b"1"
            device_rooted_collectives = (device_rooted_collectives and
                                         store.compare_set(f"ringd/device-rooted/{r}", "?", "?") == b"1")
            device_a2a = device_a2a and store.compare_set(f"ringd/device-a2a/{r}", "?", "?") == b"1"
            device_a2av = device_a2av and store.compare_set(f"ringd/device-a2av/{r}", "?", "?") == b"1"
            taper = taper and store.compare_set(f"ringd/taper/{r}", "?", "?") == b"1"
            splits_whole = splits_whole and store.compare_set(f"ringd/a2a-splits-whole/{r}", "?", "?") == b"1"
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
        self._device_collectives = collectives and device_collectives
        self._rooted = collectives and rooted_collectives  # broadcast, reduce, barrier, all_to_all through ringd
        # broadcast and reduce, and all_to_all (no split sizes), of CUDA tensors through ringd's CUDA path
        self._device_rooted = self._rooted and self._device_collectives and device_rooted_collectives
        self._device_a2a = self._rooted and self._device_collectives and device_a2a
        # and all_to_all of CUDA tensors with split sizes, and the list forms of all_to_all and allgather
        self._device_a2av = self._device_a2a and device_a2av
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
                                   max_chunk=_chunk_bytes(smallest_slot),
                                   rank=rank if collectives else None, ranks=size if collectives else None,
                                   taper=taper, splits_whole=splits_whole)
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
        wire = os.environ.get("RINGD_WIRE")
        if wire:
            set_wire(self, wire)

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
            return self._track(allreduce_cuda(self._engine, tensors[0], name, [tensors[0]], tensors))
        fut = self._engine.allreduce(tensors[0], name)
        return self._track(_compat.work(fut, tensors))

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

    def hook_allreduce(self, index, buffer, wire=None, feedback=False):
        """The comm hook: averages bucket `index` in its own slot range; a Future of the result
        (None: not through ringd, the hook then averages through Gloo). wire: the bucket's own
        wire format where it applies (float32 and bfloat16 buckets; others exact), with error
        feedback keyed by the bucket's index if `feedback`."""
        name = self._ringd_op([buffer], dist.ReduceOp.AVG)
        if name is None or self._engine is None:
            return None
        tag = None
        if wire is not None and buffer.dtype not in (torch.float32, torch.bfloat16):
            wire = None  # (a compressed wire carries float32 and bfloat16 only)
        if wire is not None and wire != "exact" and feedback:
            tag = int(index)
        if wire is not None and buffer.is_cuda and not getattr(self, "_warned_cuda_wire", False):
            import warnings
            self._warned_cuda_wire = True
            warnings.warn("ringd.torch.compressed_hook: CUDA buckets take the group's wire (ringd.torch.set_wire), "
                          "without error feedback; this hook's own wire is for CPU buckets")
        if wire is not None and not buffer.is_cuda:
            fut = self._engine.allreduce_resident(buffer, name, wire, tag)
            if fut is None:
                fut = self._engine.allreduce(buffer, name, wire, tag)
                out = _compat.OpFuture()
                fut.add_done_callback(lambda f: _chain_first(f, out))
                return out.future
            return fut
        if buffer.is_cuda:
            # DDP's bucket buffer itself: the same allocation every step, registered with ringd
            # once (the first step), averaged in place, no copy.
            return allreduce_cuda(self._engine, buffer, name, buffer, [buffer]).get_future()
        fut = self._engine.allreduce_resident(buffer, name)
        if fut is None:
            fut = self._engine.allreduce(buffer, name)
            out = _compat.OpFuture()
            fut.add_done_callback(lambda f: _chain_first(f, out))
            return out.future
        return fut

    def _supports_alloc(self, device):
        """Whether this group hands out tensors over the slot for collectives' buffers: CPU
        tensors, in a group whose reduce_scatter and allgather go through ringd."""
        return device.type == "cpu" and self._engine is not None and self._engine.ranks is not None

    def _allocate_tensor(self, numel, dtype, device):
        """A 1-D tensor of `numel` elements for a collective's buffer (FSDP2's all-gather output
        and reduce-scatter input and output): over the slot where it has room (then a collective
        on it copies nothing into or out of ringd), else ordinary memory. Any rank may get either:
        the ringd ops are the same."""
        if not self._supports_alloc(device):
            return torch.empty(numel, dtype=dtype, device=device)
        return self._engine.allocate(int(numel), dtype)

    def _through_ringd(self, *tensors):
        """Whether a reduce_scatter or allgather of these tensors goes through ringd: CPU tensors,
        or CUDA tensors on one GPU, of a ringd dtype, in a group whose every rank's ringd runs them
        (for CUDA tensors: of device buffers)."""
        if self._engine is None or self._engine.ranks is None:
            return False
        for t in tensors:
            if t.device.type not in ("cpu", "cuda"):
                raise RuntimeError(f"ringd: {t.device.type} tensors are not supported (CPU and CUDA tensors are)")
            if t.is_sparse or t.dtype not in _DTYPES:
                return False
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            return False
        return not tensors[0].is_cuda or self._device_collectives

    def _ringd_collective(self, name, src, out, op, result):
        """reduce_scatter or allgather through ringd; a Work of `result`. CPU tensors through the
        engine's threads, CUDA tensors through ringd's CUDA path in the current stream's order."""
        if name == "reduce_scatter" and _op_name(op) == "avg" and not out.dtype.is_floating_point:
            raise RuntimeError(f"ringd: AVG of {out.dtype} is not defined (an integer mean); use SUM")
        if out.is_cuda:
            op_name = _op_name(op) if name == "reduce_scatter" else "sum"
            return self._track(collective_cuda(self._engine, name, src, out, op_name, result, result))
        return self._track(_compat.work(self._ringd_collective_untracked(name, src, out, op, result), result))

    def _all_gather_single(self, output, input, opts=None):
        """all_gather_into_tensor: through ringd (blocks in rank order), else Gloo's allgather into
        the output's n parts (torch 1.13's Gloo has no _allgather_base). Defined under this torch's
        name (_compat.ALL_GATHER_SINGLE)."""
        n = self.size()
        if input.numel() == 0 and output.numel() == 0:
            return self._track(self._gloo.barrier())  # nothing to gather; the ranks still meet, as for any collective
        if output.numel() != input.numel() * n or output.dtype != input.dtype or not output.is_contiguous():
            raise RuntimeError(f"ringd: all_gather_into_tensor needs a contiguous output of {n} x the input's "
                               f"{input.numel()} {input.dtype} elements, not {output.numel()} {output.dtype} "
                               f"({'contiguous' if output.is_contiguous() else 'not contiguous'})")
        if self._through_ringd(output, input):
            return self._ringd_collective("allgather", input, output, None, [output])
        parts = list(output.view(-1).view(n, -1).unbind(0))
        return self._track(self._gloo.allgather([[p.view(input.shape) for p in parts]], [input]))

    def allgather(self, output_tensors, input_tensors, opts=None):
        """allgather's list form: through ringd into one buffer of n blocks, then into each output
        (where ringd can take the tensors: CPU tensors, and CUDA tensors where every rank's ringd
        runs the list forms of them), else through Gloo."""
        n = self.size()
        if (len(input_tensors) == 1 and len(output_tensors) == 1 and len(output_tensors[0]) == n and
                input_tensors[0].is_cuda and input_tensors[0].numel() > 0 and self._device_a2av and
                self._device_collectives and self._a2a_device(input_tensors[0], *output_tensors[0]) and
                all(o.numel() == input_tensors[0].numel() for o in output_tensors[0])):
            inp, outs = input_tensors[0], list(output_tensors[0])

            def copy_back(flat):
                for o, part in zip(outs, flat.view(n, -1).unbind(0)):
                    o.copy_(part.view(o.shape))
            flat = torch.empty(n * inp.numel(), dtype=inp.dtype, device=inp.device)
            return self._track(collective_cuda(self._engine, "allgather", inp.reshape(-1), flat, "sum", outs, outs,
                                               copy_back=copy_back))
        if (len(input_tensors) == 1 and len(output_tensors) == 1 and len(output_tensors[0]) == n and
                all(o.numel() == input_tensors[0].numel() and o.dtype == input_tensors[0].dtype
                    for o in output_tensors[0]) and not input_tensors[0].is_cuda and
                self._through_ringd(input_tensors[0], *output_tensors[0])):
            inp, outs = input_tensors[0], output_tensors[0]
            if inp.numel() == 0:
                return self._track(self._gloo.barrier())
            flat = torch.empty(n * inp.numel(), dtype=inp.dtype)
            fut = self._ringd_collective_untracked("allgather", inp, flat, None, [flat])

            def done(f):
                f.value()  # raises ringd's error
                with torch.no_grad():
                    for o, part in zip(outs, flat.view(n, -1).unbind(0)):
                        o.copy_(part.view(o.shape))
                return list(outs)
            # (The Work's result is the outputs, flat: torch 1.13's Work takes a list of tensors.)
            return self._track(_compat.work(fut.then(done), list(outs)))
        return self._track(self._gloo.allgather(output_tensors, input_tensors, opts or dist.AllgatherOptions()))

    def _ringd_collective_untracked(self, name, src, out, op, result):
        """The Future of a reduce_scatter or allgather through ringd, not kept for coalescing."""
        return self._engine.collective(name, src, out, _op_name(op) if name == "reduce_scatter" else "sum", result)

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
        flat = torch.cat([t.detach().reshape(-1) for t in ins])  # the group's own copy: PREMUL_SUM scales it
        if self._through_ringd(out, *ins):
            op = _premultiply(flat, opts.reduceOp) if opts is not None else dist.ReduceOp.SUM
            return self._ringd_collective("reduce_scatter", flat, out, op, output_tensors)
        return self._reduce_into(out, flat, opts, output_tensors)

    def _reduce_scatter_single(self, output, input, opts=None):
        """reduce_scatter_tensor: as reduce_scatter, from one input of n x the output's elements.
        Defined under this torch's name (_compat.REDUCE_SCATTER_SINGLE)."""
        if input.numel() != output.numel() * self.size() or input.dtype != output.dtype:
            raise RuntimeError(f"ringd: reduce_scatter_tensor needs an input of {self.size()} x the output's "
                               f"{output.numel()} {output.dtype} elements, not {input.numel()} {input.dtype}")
        if self._through_ringd(output, input):
            op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
            src = input
            if _premul_factor(op) is not None:
                src = input.detach().reshape(-1).clone()  # scaled here, never the caller's input
                op = _premultiply(src, op)
            return self._ringd_collective("reduce_scatter", src, output, op, [output])
        return self._reduce_into(output, input.detach().reshape(-1).clone(), opts, [output])

    def _rooted_tensor(self, tensors, root_tensor):
        """The tensor of a broadcast or reduce that goes through ringd (one tensor of a ringd
        dtype in a group whose every rank's ringd runs them: a CPU tensor, or a CUDA tensor where
        they run them of device buffers too), else None (Gloo runs it)."""
        if not self._rooted or self._engine is None or len(tensors) != 1 or root_tensor != 0:
            return None
        t = tensors[0]
        if t.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"ringd: {t.device.type} tensors are not supported (CPU and CUDA tensors are)")
        if (t.is_cuda and not self._device_rooted) or t.is_sparse or t.dtype not in _DTYPES:
            return None
        return t

    def broadcast(self, tensors, opts=None):
        """broadcast from opts.rootRank through ringd (a chain along the ring, or one-shot for a
        small tensor); CUDA tensors through ringd's CUDA path where the group's ringds run it."""
        opts = opts if opts is not None else dist.BroadcastOptions()
        t = self._rooted_tensor(tensors, opts.rootTensor)
        if t is None:
            return self._track(self._gloo.broadcast(tensors, opts))
        if t.is_cuda:
            root = opts.rootRank == self.rank()
            return self._track(allreduce_cuda(self._engine, t, "sum", tensors, tensors, root=opts.rootRank,
                                              collective="broadcast", read=root, written=not root))
        return self._track(_compat.work(self._engine.rooted("broadcast", t, "sum", opts.rootRank, tensors), tensors))

    def reduce(self, tensors, opts=None):
        """reduce to opts.rootRank through ringd: the root's tensor becomes the reduction, the
        others' stay as they are; CUDA tensors through ringd's CUDA path where the group's ringds
        run it (PREMUL_SUM: a scaled copy's sum)."""
        opts = opts if opts is not None else dist.ReduceOptions()
        t = self._rooted_tensor(tensors, opts.rootTensor)
        op = opts.reduceOp
        if t is None or (_premul_factor(op) is None and _op_name(op) is None):  # (PRODUCT, BAND, ...: Gloo's)
            return self._track(self._gloo.reduce(tensors, opts))
        if _op_name(op) == "avg" and not t.dtype.is_floating_point:
            raise RuntimeError(f"ringd: AVG of {t.dtype} is not defined (an integer mean); use SUM")
        if t.is_cuda:
            root = opts.rootRank == self.rank()
            if _premul_factor(op) is None:
                return self._track(allreduce_cuda(self._engine, t, _op_name(op), tensors, tensors, root=opts.rootRank,
                                                  collective="reduce", written=root))
            # PREMUL_SUM: the sum of a scaled copy (on the current stream), into the root's tensor.
            src = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            with torch.no_grad():
                src.copy_(t)
            op = _premultiply(src, op)
            return self._track(allreduce_cuda(self._engine, src, "sum", tensors, tensors, root=opts.rootRank,
                                              collective="reduce", written=root, into=t))
        if _premul_factor(op) is None:
            return self._track(_compat.work(self._engine.rooted("reduce", t, _op_name(op), opts.rootRank, tensors), tensors))
        # PREMUL_SUM: scaled in a copy of its own (the caller's tensor is only written on the root).
        src = t.detach().clone()
        op = _premultiply(src, op)
        fut = self._engine.rooted("reduce", src, _op_name(op), opts.rootRank, [src])
        root = opts.rootRank == self.rank()

        def done(f):
            f.value()  # raises ringd's error
            if root:
                with torch.no_grad():
                    t.copy_(src)
            return tensors
        return self._track(_compat.work(fut.then(done), tensors))

    def _a2a_through_ringd(self, *tensors):
        """Whether an all_to_all of these tensors goes through ringd: CPU tensors of one ringd dtype
        in a group whose every rank's ringd runs it (CUDA tensors: _a2a_device)."""
        if not self._rooted or self._engine is None:
            return False
        for t in tensors:
            if t.device.type not in ("cpu", "cuda"):
                raise RuntimeError(f"ringd: {t.device.type} tensors are not supported (CPU and CUDA tensors are)")
        return all(not t.is_cuda and not t.is_sparse and t.dtype in _DTYPES and t.dtype == tensors[0].dtype for t in tensors)

    def _a2a_device(self, *tensors):
        """Whether an all_to_all of these tensors may go through ringd's CUDA path: CUDA tensors of
        one ringd dtype on one GPU, in a group whose every rank's ringd and library run it."""
        if not (self._device_a2a and self._engine is not None):
            return False
        t0 = tensors[0]
        return t0.dtype in _DTYPES and all(t.is_cuda and not t.is_sparse and t.dtype == t0.dtype and t.device == t0.device
                                           for t in tensors)

    def _a2a_elements(self, output, input, output_split_sizes, input_split_sizes):
        """An all_to_all_single's split sizes in elements, (to receive, to send): torch's count rows
        of dim 0, ringd's elements; a side without them is equal blocks. ([], []): none given."""
        n = self.size()

        def elements(t, splits):
            if not splits:
                return []
            row = t.numel() // t.size(0) if t.dim() > 0 and t.size(0) else 1
            return [int(k) * row for k in splits]
        outs, ins = elements(output, output_split_sizes), elements(input, input_split_sizes)
        if bool(outs) != bool(ins):  # one side's split sizes given: the other side's blocks are equal
            side = input if not ins else output
            if side.numel() % n:
                raise RuntimeError(f"ringd: all_to_all_single's tensor of {side.numel()} elements without split sizes "
                                   f"does not cut into {n} equal blocks")
            equal = [side.numel() // n] * n
            ins, outs = (equal, outs) if not ins else (ins, equal)
        return outs, ins

    def _all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """all_to_all_single (uneven split sizes included) through ringd: one message between each
        pair of hosts carrying every local rank's blocks. Without split sizes (equal blocks) as
        several ops, each the same part of every block; with them (even equal ones) as one op. CUDA
        tensors through ringd's CUDA path the same way (with split sizes where every rank's ringd
        runs them: else Gloo's). Defined under this torch's name (all_to_all_single, or
        alltoall_base before it)."""
        n = self.size()
        given = bool(output_split_sizes or input_split_sizes)
        if (self._a2a_device(output, input) and
                (self._device_a2av or not given) and (given or output.numel() == input.numel() > 0)):
            # (input and output apart: an overlapping output goes through a copy of the input)
            src = input.detach()
            if _overlaps(src, output):
                src = src.clone()
            if not given and input.dim() > 0 and output.dim() > 0 and not input.size(0) % n and not output.size(0) % n:
                return self._track(collective_cuda(self._engine, "all_to_all", src.reshape(-1), output, "sum", [output],
                                                   [output]))
            if given:
                outs, ins = self._a2a_elements(output, input, output_split_sizes, input_split_sizes)
                return self._track(all_to_all_cuda(self._engine, src, output, ins, outs, [output], [output]))
        if not self._a2a_through_ringd(output, input):
            gloo = getattr(self._gloo, "all_to_all_single", None) or self._gloo.alltoall_base
            return self._track(gloo(output, input, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions()))
        outs, ins = self._a2a_elements(output, input, output_split_sizes, input_split_sizes)
        fut = self._engine.all_to_all(output, input, outs, ins, [output])
        return self._track(_compat.work(fut, [output]))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """all_to_all's list form through ringd (one op: the inputs laid end to end, the outputs
        cut from its result; CUDA tensors where every rank's ringd runs split sizes of them), else
        Gloo."""
        n = self.size()
        tensors = [*output_tensors, *input_tensors]
        if len(output_tensors) == n and len(input_tensors) == n and self._device_a2av and self._a2a_device(*tensors):
            flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensors])  # (on the current stream)
            outs = list(output_tensors)

            def copy_back(flat):
                at = 0
                for o in outs:
                    o.copy_(flat[at:at + o.numel()].view(o.shape))
                    at += o.numel()
            flat_out = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype, device=outs[0].device)
            return self._track(all_to_all_cuda(self._engine, flat_in, flat_out, [t.numel() for t in input_tensors],
                                               [t.numel() for t in outs], outs, outs, copy_back=copy_back))
        if len(output_tensors) != n or len(input_tensors) != n or not self._a2a_through_ringd(*tensors):
            return self._track(self._gloo.alltoall(output_tensors, input_tensors, opts or dist.AllToAllOptions()))
        flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=output_tensors[0].dtype)
        fut = self._engine.all_to_all(flat_out, flat_in, [t.numel() for t in output_tensors],
                                      [t.numel() for t in input_tensors], [flat_out])

        def done(f):
            f.value()  # raises ringd's error
            at = 0
            with torch.no_grad():
                for o in output_tensors:
                    o.copy_(flat_out[at:at + o.numel()].view(o.shape))
                    at += o.numel()
            return list(output_tensors)
        return self._track(_compat.work(fut.then(done), list(output_tensors)))

    def barrier(self, opts=None):
        """A barrier through ringd (every rank's, in order with the group's other ops), else Gloo's."""
        if not self._rooted or self._engine is None:
            return self._track(self._gloo.barrier(opts if opts is not None else dist.BarrierOptions()))
        return self._track(_compat.work(self._engine.barrier(), []))

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
_VIA_GLOO = ("allgather_coalesced", "gather", "scatter", "monitored_barrier", "send", "recv", "recv_anysource")


def _via_gloo(name, gloo_name):
    def collective(self, *args, **kwargs):
        return self._track(getattr(self._gloo, gloo_name)(*args, **kwargs))
    collective.__name__ = name
    collective.__doc__ = f"{name} through the group's internal Gloo group."
    return collective


# all_to_all_single under the name this torch's dist.all_to_all_single calls.
setattr(ProcessGroupRingd, "all_to_all_single" if hasattr(ProcessGroup, "all_to_all_single") else "alltoall_base",
        ProcessGroupRingd._all_to_all_single)
for _name in _VIA_GLOO:
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


def set_wire(group, wire):
    """The wire format of `group`'s (a ringd process group, or None: the default group) sums and
    averages of float32 and bfloat16 tensors — allreduce, reduce_scatter (FSDP2's gradients) and
    reduce — from now on: "exact", "bf16", "fp16" or "int8" (docs/wire.md), or "default" (ringd's
    config wire.default); every rank of the group must set the same. The other collectives, ops and
    dtypes stay exact. RINGD_WIRE sets it for every ringd process group when it is made."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupRingd):
        raise RuntimeError("ringd.torch.set_wire needs a ringd process group (init_process_group(\"ringd\"))")
    try:
        pg._engine.set_wire(wire)
    except (_ringd.RingdError, ValueError) as e:
        raise RuntimeError(f"ringd: {e}") from None


def compressed_hook(wire="bf16", feedback=None):
    """A DDP comm hook that averages each bucket over a compressed wire, accumulated in float32
    (model.register_comm_hook(None, ringd.torch.compressed_hook("int8"))): "bf16", "fp16" (half
    the bytes) or "int8" (about a quarter), with error feedback — what each step's encoding lost
    is added to the bucket's next step, in ringd — keyed by the bucket's index (default: on for
    int8, off for the others). Unlike DDP's bf16_compress_hook, the sum is never rounded to 16 bits
    on its way. float32 and bfloat16 buckets only; others are averaged exact. `state`: the ringd
    process group, or None for the default group."""
    if wire not in ("exact", "bf16", "fp16", "int8"):
        raise ValueError(f"wire must be exact, bf16, fp16 or int8, not {wire!r}")
    if feedback is None:
        feedback = wire == "int8"

    def hook(state, bucket):
        pg = state if state is not None else dist.distributed_c10d._get_default_group()
        if not isinstance(pg, ProcessGroupRingd):
            raise RuntimeError("ringd.torch.compressed_hook needs a ringd process group (init_process_group(\"ringd\"))")
        fut = pg.hook_allreduce(bucket.index(), bucket.buffer(), wire, feedback)
        if fut is None:
            buf = bucket.buffer().div_(pg.size())
            return pg._gloo.allreduce([buf]).get_future().then(lambda f: f.value()[0])
        return fut

    hook.__name__ = f"ringd_{wire}_hook"
    return hook


def _create(store, rank, size, timeout):
    return ProcessGroupRingd(store, rank, size, timeout)


if BACKEND.upper() not in dist.Backend._plugins:
    _compat.register_backend(BACKEND, _create)
