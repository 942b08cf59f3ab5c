"""ringd: hand buffers to the host's ringd and wait for their allreduce (Python client).

A ctypes binding over libringd-client (client/include/ringd/ringd.h); every call maps to one of
the C library's, with its errors raised as RingdError (a RuntimeError) carrying ringd's message.

    import ringd
    c = ringd.Client("job-42", local_rank=0, local_size=1, slot_bytes=1 << 20)
    buf = c.slot                       # a writable memoryview of the shared-memory slot
    c.allreduce(0, 256, "float32", "avg")

The library is found through RINGD_CLIENT_LIBRARY (a path) if set, else the installed one
(libringd-client.so.0), else the one in the build tree next to this package (build/client/).
PyTorch: import ringd.torch (registers the process-group backend "ringd").
"""
import ctypes
import ctypes.util
import errno
import os
import threading

__all__ = ["Client", "RingdError", "DTYPES", "OPS", "COLLECTIVES", "library_path", "status"]

# ringd_dtype and ringd_op, in the C enum's order.
DTYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "int32": 4, "int64": 5}
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
OPS = {"sum": 0, "avg": 1, "min": 2, "max": 3}
# ringd_collective (ringd_submit_coll).
COLLECTIVES = {"allreduce": 0, "reduce_scatter": 1, "allgather": 2, "broadcast": 3, "reduce": 4, "barrier": 5,
               "all_to_all": 6}
_DTYPE_ALIASES = {"float": "float32", "f32": "float32", "double": "float64", "f64": "float64",
                  "half": "float16", "f16": "float16", "bf16": "bfloat16", "int": "int32",
                  "i32": "int32", "long": "int64", "i64": "int64"}

DEFAULT_SOCKET = "/run/ringd/ringd.sock"


class RingdError(RuntimeError):
    """A failed ringd call: `code` is the negative errno, the text ringd's message."""

    def __init__(self, code, message):
        super().__init__(message or os.strerror(-code) if code else message)
        self.code = code


def _candidates():
    env = os.environ.get("RINGD_CLIENT_LIBRARY")
    if env:
        return [env]
    out = ["libringd-client.so.0"]
    found = ctypes.util.find_library("ringd-client")
    if found:
        out.append(found)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))  # client/python/ringd -> the tree
    build = os.environ.get("RINGD_BUILD_DIR") or os.path.join(root, "build")
    out.append(os.path.join(build, "client", "libringd-client.so"))
    return out


_lib = None
_lib_path = None
_lib_lock = threading.Lock()


def _load():
    global _lib, _lib_path
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path}: {e}")
                continue
            _declare(lib)
            _lib, _lib_path = lib, path
            return lib
        raise RingdError(-errno.ENOENT, "cannot load libringd-client (set RINGD_CLIENT_LIBRARY): " +
                         "; ".join(tried))


def library_path():
    """The path libringd-client was loaded from."""
    _load()
    return _lib_path


class _Options(ctypes.Structure):
    """ringd_options (ringd.h)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("socket_path", ctypes.c_char_p), ("group", ctypes.c_char_p),
                ("local_rank", ctypes.c_int), ("local_size", ctypes.c_int), ("slot_bytes", ctypes.c_size_t),
                ("hosts", ctypes.c_char_p), ("share_slot_of", ctypes.c_void_p), ("op_timeout_ms", ctypes.c_uint),
                ("rank", ctypes.c_int), ("ranks", ctypes.c_int)]


class _Coll(ctypes.Structure):
    """ringd_coll (ringd.h)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("collective", ctypes.c_int), ("dtype", ctypes.c_int),
                ("op", ctypes.c_int), ("count", ctypes.c_size_t), ("in_offset", ctypes.c_size_t),
                ("out_offset", ctypes.c_size_t), ("root", ctypes.c_int),
                ("send_counts", ctypes.POINTER(ctypes.c_uint64)), ("recv_counts", ctypes.POINTER(ctypes.c_uint64)),
                ("splits_offset", ctypes.c_size_t), ("wire", ctypes.c_int), ("feedback", ctypes.c_int),
                ("feedback_tag", ctypes.c_uint64)]


# Wire formats (ringd_wire, docs/wire.md): None / "default" takes the client's, then ringd's.
WIRES = {"default": 0, "exact": 1, "bf16": 2, "fp16": 3, "int8": 4}


class _CollCuda(ctypes.Structure):
    """ringd_coll_cuda (ringd.h)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("collective", ctypes.c_int), ("dtype", ctypes.c_int),
                ("op", ctypes.c_int), ("count", ctypes.c_size_t), ("input", ctypes.c_void_p),
                ("output", ctypes.c_void_p), ("root", ctypes.c_uint32),
                ("send_counts", ctypes.POINTER(ctypes.c_uint64)), ("recv_counts", ctypes.POINTER(ctypes.c_uint64))]


def _declare(lib):
    c_client = ctypes.c_void_p
    lib.ringd_connect_opts.restype = c_client
    lib.ringd_connect_opts.argtypes = [ctypes.POINTER(_Options), ctypes.c_char_p, ctypes.c_size_t]
    lib.ringd_slot.restype = ctypes.c_void_p
    lib.ringd_slot.argtypes = [c_client, ctypes.POINTER(ctypes.c_size_t)]
    lib.ringd_allreduce.restype = ctypes.c_int
    lib.ringd_allreduce.argtypes = [c_client, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.ringd_submit.restype = ctypes.c_int
    lib.ringd_submit.argtypes = [c_client, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.POINTER(ctypes.c_uint64)]
    lib.ringd_wait.restype = ctypes.c_int
    lib.ringd_wait.argtypes = [c_client, ctypes.c_uint64, ctypes.c_int]
    if hasattr(lib, "ringd_submit_coll"):  # (a library of an older release has allreduce only)
        lib.ringd_submit_coll.restype = ctypes.c_int
        lib.ringd_submit_coll.argtypes = [c_client, ctypes.POINTER(_Coll), ctypes.POINTER(ctypes.c_uint64)]
    if hasattr(lib, "ringd_set_wire"):
        lib.ringd_set_wire.restype = ctypes.c_int
        lib.ringd_set_wire.argtypes = [c_client, ctypes.c_int]
    if hasattr(lib, "ringd_refuse"):
        lib.ringd_refuse.restype = ctypes.c_int
        lib.ringd_refuse.argtypes = [c_client, ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)]
    if hasattr(lib, "ringd_note_copies"):
        lib.ringd_note_copies.restype = None
        lib.ringd_note_copies.argtypes = [c_client, ctypes.c_uint64, ctypes.c_uint64]
    if hasattr(lib, "ringd_collectives"):
        lib.ringd_collectives.restype = ctypes.c_uint
        lib.ringd_collectives.argtypes = []
    if hasattr(lib, "ringd_cuda_collectives"):
        lib.ringd_cuda_collectives.restype = ctypes.c_uint
        lib.ringd_cuda_collectives.argtypes = []
    if hasattr(lib, "ringd_cuda_all_to_all_splits"):
        lib.ringd_cuda_all_to_all_splits.restype = ctypes.c_int
        lib.ringd_cuda_all_to_all_splits.argtypes = []
    if hasattr(lib, "ringd_submit_coll_cuda"):  # (device buffers' reduce_scatter and allgather)
        lib.ringd_submit_coll_cuda.restype = ctypes.c_int
        lib.ringd_submit_coll_cuda.argtypes = [c_client, ctypes.POINTER(_CollCuda), ctypes.c_void_p,
                                               ctypes.POINTER(ctypes.c_uint64)]
    lib.ringd_test.restype = ctypes.c_int
    lib.ringd_test.argtypes = [c_client, ctypes.c_uint64]
    lib.ringd_fd.restype = ctypes.c_int
    lib.ringd_fd.argtypes = [c_client]
    lib.ringd_last_error.restype = ctypes.c_char_p
    lib.ringd_last_error.argtypes = [c_client]
    lib.ringd_status.restype = ctypes.c_long
    lib.ringd_status.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    lib.ringd_close.restype = None
    lib.ringd_close.argtypes = [c_client]
    lib.ringd_slot_hold.restype = ctypes.c_void_p
    lib.ringd_slot_hold.argtypes = [c_client]
    lib.ringd_slot_unhold.restype = None
    lib.ringd_slot_unhold.argtypes = [ctypes.c_void_p]
    # Device buffers (CUDA): pointers and streams travel as integers.
    p, u64 = ctypes.c_void_p, ctypes.c_uint64
    for name, args in (("ringd_cuda_alloc", [c_client, ctypes.c_size_t, ctypes.POINTER(p)]),
                       ("ringd_cuda_free", [c_client, p]),
                       ("ringd_register_cuda", [c_client, p, ctypes.c_size_t, ctypes.POINTER(u64)]),
                       ("ringd_unregister_cuda", [c_client, u64]),
                       ("ringd_submit_cuda", [c_client, p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, p,
                                              ctypes.POINTER(u64)]),
                       ("ringd_stream_wait", [c_client, u64, p]),
                       ("ringd_set_cuda_part_bytes", [c_client, ctypes.c_size_t]),
                       ("ringd_set_cuda_staging", [c_client, ctypes.c_size_t, ctypes.c_size_t]),
                       ("ringd_cuda_allocation", [c_client, p, ctypes.POINTER(p), ctypes.POINTER(ctypes.c_size_t),
                                                  ctypes.POINTER(u64)]),
                       ("ringd_allreduce_cuda", [c_client, p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, p,
                                                 ctypes.c_int])):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = args


def status(socket=None, timeout_ms=10000):
    """ringd's status document (what `ringctl status --json` prints), as a dict."""
    import json
    lib = _load()
    path = (socket or os.environ.get("RINGD_SOCKET") or DEFAULT_SOCKET).encode()
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.ringd_status(path, buf, size, int(timeout_ms))
        if n < 0:
            raise RingdError(n, buf.value.decode(errors="replace"))
        if n < size:
            return json.loads(buf.value.decode())
        size = n + 1


def dtype_name(dtype):
    """'float32', 'bfloat16', ... from a name or alias."""
    name = _DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name not in DTYPES:
        raise ValueError(f"ringd has no dtype {dtype!r} (it reduces {', '.join(DTYPES)})")
    return name


def op_name(op):
    name = str(op).lower()
    if name not in OPS:
        raise ValueError(f"ringd has no reduce op {op!r} (it has {', '.join(OPS)})")
    return name


class Client:
    """One trainer's connection to ringd: `local_rank` of `local_size` trainers of `group` on this
    host, with a shared-memory slot of `slot_bytes`. `hosts`: the group's hosts (names as in ringd's
    config, a list or a comma-separated string); None = every host of the ring. `share_slot_of`:
    another Client of this process whose slot this one uses too (the same memory at the same
    address; slot_bytes is not used; ringd counts one slot for all of them). `op_timeout_ms`: the
    group's op timeout (every op ends within it of its first submission on a host; None: ringd's
    timeouts.op; above timeouts.op_max it is clamped). `rank` of `ranks`: this trainer's rank in the
    group as the job numbers them, the order of reduce_scatter's and allgather's blocks (None: not
    said; the group then runs allreduce only; needs a ringd of this release). Not for two threads
    at once, except that fileno() may be polled by one thread while another calls in (see ringd.h)."""

    def __init__(self, group, local_rank=0, local_size=1, slot_bytes=1 << 20, socket=None, hosts=None,
                 share_slot_of=None, op_timeout_ms=None, rank=None, ranks=None):
        lib = _load()
        socket = socket or os.environ.get("RINGD_SOCKET") or DEFAULT_SOCKET
        if hosts is not None and not isinstance(hosts, str):
            hosts = ",".join(str(h) for h in hosts)
        err = ctypes.create_string_buffer(512)
        opts = _Options(ctypes.sizeof(_Options), socket.encode(), str(group).encode(), int(local_rank),
                        int(local_size), int(slot_bytes), hosts.encode() if hosts else None,
                        share_slot_of._handle() if share_slot_of is not None else None,
                        max(0, min(int(op_timeout_ms or 0), 0xFFFFFFFF)),
                        int(rank or 0) if ranks else 0, int(ranks or 0))
        handle = lib.ringd_connect_opts(ctypes.byref(opts), err, len(err))
        if not handle:
            raise RingdError(-errno.ECONNREFUSED, err.value.decode(errors="replace"))
        self._lib, self._c = lib, ctypes.c_void_p(handle)
        self.group, self.local_rank, self.local_size = str(group), int(local_rank), int(local_size)
        size = ctypes.c_size_t(0)
        self.slot_address = lib.ringd_slot(self._c, ctypes.byref(size))
        self.slot_bytes = size.value
        self.slot = memoryview((ctypes.c_char * self.slot_bytes).from_address(self.slot_address)).cast("B")

    @staticmethod
    def has_collectives():
        """Whether this libringd-client has ringd_submit_coll (reduce_scatter, allgather)."""
        return hasattr(_load(), "ringd_submit_coll")

    @staticmethod
    def has_rooted_collectives():
        """Whether this libringd-client submits broadcast, reduce and barrier (ringd_collectives)."""
        lib = _load()
        return hasattr(lib, "ringd_collectives") and bool(lib.ringd_collectives() & (1 << COLLECTIVES["broadcast"]))

    @staticmethod
    def has_all_to_all():
        """Whether this libringd-client submits all_to_all (ringd_collectives)."""
        lib = _load()
        return hasattr(lib, "ringd_collectives") and bool(lib.ringd_collectives() & (1 << COLLECTIVES["all_to_all"]))

    @staticmethod
    def cuda_collectives():
        """The collectives this libringd-client submits of device buffers: bit (1 << COLLECTIVES[x])
        each (ringd_cuda_collectives; a library without it: allreduce, reduce_scatter, allgather
        where it has ringd_submit_coll_cuda)."""
        lib = _load()
        if hasattr(lib, "ringd_cuda_collectives"):
            return int(lib.ringd_cuda_collectives())
        if hasattr(lib, "ringd_submit_coll_cuda"):
            return sum(1 << COLLECTIVES[c] for c in ("allreduce", "reduce_scatter", "allgather"))
        return 1 << COLLECTIVES["allreduce"]

    @staticmethod
    def cuda_all_to_all_splits():
        """Whether this libringd-client submits all_to_all of device buffers with split sizes
        (ringd_cuda_all_to_all_splits)."""
        lib = _load()
        return hasattr(lib, "ringd_cuda_all_to_all_splits") and bool(lib.ringd_cuda_all_to_all_splits())

    @staticmethod
    def has_device_collectives():
        """Whether this libringd-client has ringd_submit_coll_cuda (reduce_scatter, allgather of
        device buffers)."""
        return hasattr(_load(), "ringd_submit_coll_cuda")

    def _check(self, rc):
        if rc != 0:
            raise RingdError(rc, self.last_error())
        return rc

    def _handle(self):
        if self._c is None:
            raise RingdError(-errno.EBADF, "the ringd client is closed")
        return self._c

    def last_error(self):
        if self._c is None:
            return "the ringd client is closed"
        return (self._lib.ringd_last_error(self._c) or b"").decode(errors="replace")

    def note_copies(self, in_bytes, out_bytes):
        """Adds to the bytes copied into and out of the slot for ops (ringd's status: copies)."""
        if self._c is not None and hasattr(self._lib, "ringd_note_copies"):
            self._lib.ringd_note_copies(self._c, int(in_bytes), int(out_bytes))

    def submit(self, offset, count, dtype, op):
        """Queues an allreduce of `count` elements at byte `offset` of the slot; returns its ticket."""
        t = ctypes.c_uint64(0)
        self._check(self._lib.ringd_submit(self._handle(), int(offset), int(count), DTYPES[dtype_name(dtype)],
                                           OPS[op_name(op)], ctypes.byref(t)))
        return t.value

    def set_wire(self, wire):
        """This client's wire for ops that name none (ringd_set_wire): "exact", "bf16", "fp16",
        "int8", or "default" (ringd's config); only where it applies (sums and averages of f32 and
        bf16 by allreduce, reduce_scatter and reduce), other ops stay exact."""
        if wire not in WIRES:
            raise ValueError("wire must be one of " + ", ".join(WIRES) + ", not " + repr(wire))
        if not hasattr(self._lib, "ringd_set_wire"):
            raise RingdError(-errno.ENOTSUP, "this libringd-client has no compressed wires (an older release)")
        self._check(self._lib.ringd_set_wire(self._handle(), WIRES[wire]))

    def submit_coll(self, collective, count, dtype, op, in_offset, out_offset=0, root=0, send_counts=None,
                    recv_counts=None, splits_offset=0, wire=None, feedback_tag=None):
        """Queues any collective (ringd_submit_coll) on slot bytes: `count` elements of the buffer
        (allreduce, broadcast and reduce, in place at in_offset; the latter two from and to rank
        `root`), of the output block (reduce_scatter: the input has a block per rank) or of the
        input block (allgather: the output has a block per rank); a barrier has no data. Returns
        its ticket. all_to_all: `count` elements per block, or send_counts and recv_counts (one per
        rank; count 0), which the library writes at splits_offset in the slot (16 x ranks bytes,
        kept free until the op completes). wire: this op's own format (refused where it cannot
        apply; None: the client's default); feedback_tag: error feedback under that key."""
        d = _Coll(ctypes.sizeof(_Coll), COLLECTIVES[collective], DTYPES[dtype_name(dtype)], OPS[op_name(op)], int(count),
                  int(in_offset), int(out_offset), int(root))
        if send_counts is not None:
            n = len(send_counts)
            sends, recvs = (ctypes.c_uint64 * n)(*send_counts), (ctypes.c_uint64 * n)(*recv_counts)
            d.send_counts = ctypes.cast(sends, ctypes.POINTER(ctypes.c_uint64))
            d.recv_counts = ctypes.cast(recvs, ctypes.POINTER(ctypes.c_uint64))
            d.splits_offset = int(splits_offset)
        if wire is not None:
            if wire not in WIRES:
                raise ValueError("wire must be one of " + ", ".join(WIRES) + ", not " + repr(wire))
            d.wire = WIRES[wire]
        if feedback_tag is not None:
            d.feedback, d.feedback_tag = 1, int(feedback_tag) & 0xFFFFFFFFFFFFFFFF
        t = ctypes.c_uint64(0)
        self._check(self._lib.ringd_submit_coll(self._handle(), ctypes.byref(d), ctypes.byref(t)))
        return t.value

    def refuses(self):
        """Whether this library has refusals (refuse; the ringd it talks to may still not)."""
        return hasattr(self._lib, "ringd_refuse")

    def refuse(self, collective, needed_bytes=0):
        """Refuses this rank's next op (ringd_refuse): ringd fails it on every rank of the group,
        naming this one and the slot bytes it needed, and the group goes on. Returns its ticket
        (its wait raises E2BIG); RingdError ENOTSUP where this library or ringd has no refusals."""
        if not hasattr(self._lib, "ringd_refuse"):
            raise RingdError(-errno.ENOTSUP, "this libringd-client has no ringd_refuse")
        t = ctypes.c_uint64(0)
        self._check(self._lib.ringd_refuse(self._handle(), COLLECTIVES[collective], int(needed_bytes), ctypes.byref(t)))
        return t.value

    def wait(self, ticket, timeout_ms=-1):
        """Until the op is done (raises RingdError if it failed or timeout_ms passed)."""
        self._check(self._lib.ringd_wait(self._handle(), int(ticket), int(timeout_ms)))

    def test(self, ticket):
        """True when the op succeeded, False while it runs; raises RingdError if it failed."""
        rc = self._lib.ringd_test(self._handle(), int(ticket))
        if rc == -errno.EINPROGRESS:
            return False
        self._check(rc)
        return True

    def allreduce(self, offset, count, dtype, op, timeout_ms=-1):
        self._check(self._lib.ringd_allreduce(self._handle(), int(offset), int(count), DTYPES[dtype_name(dtype)],
                                              OPS[op_name(op)], int(timeout_ms)))

    # -- device buffers (CUDA; ringd.h): addresses and streams (CUstream / cudaStream_t) as ints,
    # 0 = the legacy default stream. The driver comes from RINGD_CUDA_PROVIDER (hardware|emulated).

    def cuda_alloc(self, nbytes):
        """Device memory ringd maps once (a VMM allocation); its address."""
        ptr = ctypes.c_void_p(0)
        self._check(self._lib.ringd_cuda_alloc(self._handle(), int(nbytes), ctypes.byref(ptr)))
        return ptr.value

    def cuda_free(self, ptr):
        self._check(self._lib.ringd_cuda_free(self._handle(), ctypes.c_void_p(int(ptr))))

    def register_cuda(self, ptr, nbytes):
        """Registers a cudaMalloc-family buffer once; returns the registration id."""
        reg = ctypes.c_uint64(0)
        self._check(self._lib.ringd_register_cuda(self._handle(), ctypes.c_void_p(int(ptr)), int(nbytes),
                                                  ctypes.byref(reg)))
        return reg.value

    def unregister_cuda(self, reg):
        self._check(self._lib.ringd_unregister_cuda(self._handle(), int(reg)))

    def submit_cuda(self, ptr, count, dtype, op, stream=0):
        """Queues an allreduce of `count` elements of device memory at `ptr`, after what `stream`
        queued so far; returns its ticket (wait() or test() it, stream_wait() to order a stream)."""
        t = ctypes.c_uint64(0)
        self._check(self._lib.ringd_submit_cuda(self._handle(), ctypes.c_void_p(int(ptr)), int(count),
                                                DTYPES[dtype_name(dtype)], OPS[op_name(op)],
                                                ctypes.c_void_p(int(stream)), ctypes.byref(t)))
        return t.value

    def submit_coll_cuda(self, collective, count, dtype, op, in_ptr, out_ptr, stream=0, root=0, splits=None):
        """Queues any collective of device memory (ringd_submit_coll_cuda): `count` elements as for
        submit_coll, the input at `in_ptr` and the output at `out_ptr` (allreduce, broadcast and
        reduce: in place, out_ptr the input), after what `stream` queued so far; `root` a
        broadcast's or reduce's root rank; `splits` an all_to_all's (elements to send to each rank,
        elements to receive from each), count 0. Returns its ticket."""
        if not hasattr(self._lib, "ringd_submit_coll_cuda"):
            raise RingdError(-errno.ENOTSUP, "this libringd-client has no reduce_scatter or allgather of device buffers")
        if not self.cuda_collectives() & (1 << COLLECTIVES[collective]):
            raise RingdError(-errno.ENOTSUP, f"this libringd-client has no {collective} of device buffers")
        d = _CollCuda(ctypes.sizeof(_CollCuda), COLLECTIVES[collective], DTYPES[dtype_name(dtype)], OPS[op_name(op)],
                      int(count), ctypes.c_void_p(int(in_ptr)), ctypes.c_void_p(int(out_ptr)), int(root))
        if splits is not None:
            if not self.cuda_all_to_all_splits():
                raise RingdError(-errno.ENOTSUP, "this libringd-client has no all_to_all of device buffers with split sizes")
            send = (ctypes.c_uint64 * len(splits[0]))(*map(int, splits[0]))
            recv = (ctypes.c_uint64 * len(splits[1]))(*map(int, splits[1]))
            d.send_counts, d.recv_counts = send, recv
        t = ctypes.c_uint64(0)
        self._check(self._lib.ringd_submit_coll_cuda(self._handle(), ctypes.byref(d), ctypes.c_void_p(int(stream)),
                                                     ctypes.byref(t)))
        return t.value

    def stream_wait(self, ticket, stream=0):
        """Makes `stream` wait until the op's result is in its buffer."""
        self._check(self._lib.ringd_stream_wait(self._handle(), int(ticket), ctypes.c_void_p(int(stream))))

    def set_cuda_part_bytes(self, nbytes):
        """Device ops larger than this go to ringd in parts of it (every rank of a group the same)."""
        self._check(self._lib.ringd_set_cuda_part_bytes(self._handle(), int(nbytes)))

    def set_cuda_staging(self, offset, nbytes):
        """Device ops are staged in [offset, offset + nbytes) of the slot only (0 bytes: all of it)."""
        self._check(self._lib.ringd_set_cuda_staging(self._handle(), int(offset), int(nbytes)))

    def cuda_allocation(self, ptr):
        """(base, size, buffer id) of the driver's allocation holding `ptr`; the id is never reused."""
        base, size, ident = ctypes.c_void_p(0), ctypes.c_size_t(0), ctypes.c_uint64(0)
        self._check(self._lib.ringd_cuda_allocation(self._handle(), ctypes.c_void_p(int(ptr)), ctypes.byref(base),
                                                    ctypes.byref(size), ctypes.byref(ident)))
        return base.value or 0, size.value, ident.value

    def allreduce_cuda(self, ptr, count, dtype, op, stream=0, timeout_ms=-1):
        """submit_cuda + wait: returns with the result in the buffer."""
        self._check(self._lib.ringd_allreduce_cuda(self._handle(), ctypes.c_void_p(int(ptr)), int(count),
                                                   DTYPES[dtype_name(dtype)], OPS[op_name(op)],
                                                   ctypes.c_void_p(int(stream)), int(timeout_ms)))

    def hold_slot(self):
        """A handle that keeps the slot's memory mapped in this process after this client (and
        every client sharing it) is closed, until unhold_slot(handle) (ringd_slot_hold)."""
        return self._lib.ringd_slot_hold(self._handle())

    def unhold_slot(self, handle):
        self._lib.ringd_slot_unhold(handle)

    def fileno(self):
        """An fd that polls readable when a result may have arrived (then test() the tickets)."""
        fd = self._lib.ringd_fd(self._handle())
        if fd < 0:
            raise RingdError(fd, self.last_error())
        return fd

    def close(self):
        """Disconnects and unmaps the slot; BufferError (and nothing closed) while objects made
        from `slot` (numpy arrays, tensors) still use it."""
        if self._c is not None:
            self.slot.release()
            self._lib.ringd_close(self._c)
            self._c = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
