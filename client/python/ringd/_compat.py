"""What differs between the torch versions ringd.torch runs on (1.13 and 2.x), and nothing else.

- The Work object an op returns. torch 1.13's reducer calls Work::getFuture() from C++, which 1.13's
  Python Work trampoline does not forward, so 1.13 needs ringd._torch_work (C++, built against
  that torch). torch 2.x forwards get_future() and wait() to a Python subclass of dist._Work, so
  it needs no C++ piece at all.
- Registering the backend: torch 2.1 and later take the devices it serves (cpu and cuda); a
  creator that returns a ProcessGroup is used as the process group itself in every version.
- torch 2's process-group contract, which a Python ProcessGroup does not get from torch's
  wrapper (it is the process group itself, read from torch 2.13's distributed_c10d.py,
  device_mesh.py and fsdp/_fully_shard): the group's name and description live in a C++ backend
  registered for its devices (ringd's internal Gloo group: what C++ calls that no Python method
  overrides, such as a functional reduce_scatter, then run there), `_get_backend(device)`
  answers ringd's own description (RingdBackend), `_start_coalescing` / `_end_coalescing` give
  one Work for the collectives between them, `shutdown` / `abort` close the ringd connection,
  and the single-tensor collectives are defined under the one name of each renamed pair that
  this torch's Python API calls (`all_gather_single` / `reduce_scatter_single` from about 2.13,
  `_allgather_base` / `_reduce_scatter_base` before).
- Errors: torch 2 completes a future with an error only from a callback that raises, and puts
  "Got the following error when running the callback: " and a traceback around the message
  (twice through two callbacks); ringd_message() takes them off again wherever ringd raises.
"""
import os
import re

import torch
import torch.distributed as dist

TORCH_MAJOR = int(torch.__version__.split(".")[0])
TORCH_VERSION = torch.__version__.split("+")[0]

_CALLBACK_WRAPPER = re.compile(r"^(?:Got the following error when running the callback: (?:RuntimeError: )?)+")


def ringd_message(error):
    """The text of `error` (an exception or a string) without what torch's future callbacks put
    around it: ringd's own message."""
    text = str(error)
    text = _CALLBACK_WRAPPER.sub("", text)
    cut = text.find("\n\nAt:\n")
    return text[:cut] if cut >= 0 else text


def _load_work_module():
    """ringd._torch_work (torch 1.13): installed next to this file, or in the build tree when
    running from the source tree."""
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
        raise ImportError(f"ringd.torch on torch {torch.__version__} needs ringd._torch_work, built with ringd "
                          f"against this torch: {first}")


class OpFuture:
    """An op's future: `future` is what torch gets; set_result()/set_error() complete it, and an
    error is seen alike by Python and C++ waiters (DDP's reducer, Work::wait). devices: the CUDA
    devices of its result (torch then orders its waiters' streams after it)."""

    def __init__(self, devices=None):
        self._src = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        self.future = self._src if TORCH_MAJOR < 2 else self._src.then(_unwrap)

    def set_result(self, value):
        self._src.set_result(value)

    def set_error(self, message):
        if TORCH_MAJOR < 2:
            # Future.set_exception stores the exception as the future's value, which C++ takes for
            # a result: ringd._torch_work marks the future failed instead.
            _tw.set_error(self._src, message)
        else:
            # No C++ piece on torch 2: the source completes with the failure, and the then()
            # callback that hands `future` its value raises it (a callback's exception is a real
            # error of the future it completes).
            self._src.set_result(_Failure(message))

    def done(self):
        return self._src.done()


class _Failure:
    def __init__(self, message):
        self.message = message


def _unwrap(f):
    v = f.value()
    if isinstance(v, _Failure):
        raise RuntimeError(v.message)
    return v


if TORCH_MAJOR < 2:
    _tw = _load_work_module()

    def work(fut, result, on_wait=None):
        """The Work of an op whose future is `fut` (completing with `result`). on_wait: what wait()
        does instead of blocking until the future completes (a CUDA op: the current stream waits
        for the result), after which it raises the op's error if it is already known."""
        if on_wait is None:
            return _tw.work(fut, result)
        return _tw.cuda_work(fut, result, on_wait)

    def register_backend(name, creator):
        dist.Backend.register_backend(name, creator)

    # torch 1.13's names of the single-tensor collectives (all_gather_into_tensor,
    # reduce_scatter_tensor): the ones its Python API calls.
    ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE = "_allgather_base", "_reduce_scatter_base"

    def attach(pg, gloo):
        """Nothing to attach on 1.13: its Python process group is the whole contract."""

    def install_contract(cls):
        """ringd's group under 1.13's names."""
        setattr(cls, ALL_GATHER_SINGLE, cls._all_gather_single)
        setattr(cls, REDUCE_SCATTER_SINGLE, cls._reduce_scatter_single)
        return cls
else:
    from torch._C._distributed_c10d import ProcessGroup as _ProcessGroup

    class _RingdWork(dist._Work):
        """wait() blocks until the op is done and raises its error with ringd's message (a CUDA op:
        on_wait orders the current stream after the result instead, without blocking);
        get_future() is the op's future, which DDP's reducer and FSDP wait on."""

        def __init__(self, fut, result, on_wait):
            super().__init__()
            self._fut, self._result, self._on_wait = fut, result, on_wait

        def _raise(self):
            try:
                self._fut.wait()
            except RuntimeError as e:
                raise RuntimeError(ringd_message(e)) from None

        def wait(self, timeout=None):
            if self._on_wait is not None:
                self._on_wait()
                if self._fut.done():
                    self._raise()
                return True
            self._raise()
            return True

        def get_future(self):
            return self._fut

        def result(self):
            return self._result

        def is_completed(self):
            return self._fut.done()

        def is_success(self):
            if not self._fut.done():
                return False
            try:
                self._fut.wait()
                return True
            except RuntimeError:
                return False

        def exception(self):
            if not self._fut.done():
                return None
            try:
                self._fut.wait()
                return None
            except RuntimeError as e:
                return RuntimeError(ringd_message(e))

    def work(fut, result, on_wait=None):
        return _RingdWork(fut, result, on_wait)

    def register_backend(name, creator):
        import inspect
        if "devices" in inspect.signature(dist.Backend.register_backend).parameters:
            dist.Backend.register_backend(name, creator, devices=["cpu", "cuda"])
        else:  # torch 2.0: no device list; the process group serves every device it gets
            dist.Backend.register_backend(name, creator)

    # Renamed around 2.13 (the _base names became deprecated aliases of the C++ method): the
    # name of each pair that this torch's dist.all_gather_into_tensor / reduce_scatter_tensor
    # call. Only that one is defined on ringd's group.
    if hasattr(_ProcessGroup, "all_gather_single"):
        ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE = "all_gather_single", "reduce_scatter_single"
    else:
        ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE = "_allgather_base", "_reduce_scatter_base"

    def _devices():
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
        return devices

    def attach(pg, gloo):
        """Registers ringd's internal Gloo group as `pg`'s C++ backend for its devices: torch keeps
        the group's name and description there (FSDP2, DeviceMesh and functional collectives find
        groups by name), and what C++ calls on the group without a Python override runs there."""
        kind = _ProcessGroup.BackendType.GLOO
        for device in _devices():
            pg._register_backend(device, kind, gloo)

    class RingdBackend:
        """What `group._get_backend(device)` answers for a ringd group: ringd runs the group on
        every device it serves; no communicator splitting (torch 2.13 allows split_group only
        through an accelerator's backend that splits), no coalescing of point-to-point ops, no
        time estimates. CPU tensors for FSDP2's collectives (supports_tensor_alloc,
        allocate_tensor: set_allocate_memory_from_process_group_for_comm) come from the slot, so
        that its all-gathers and reduce-scatters copy nothing into or out of ringd."""

        supports_splitting = False
        supports_coalescing = False
        supports_time_estimate = False

        def __init__(self, pg, device):
            self._pg, self.device = pg, device

        def name(self):
            return "ringd"

        def rank(self):
            return self._pg.rank()

        def size(self):
            return self._pg.size()

        def supports_tensor_alloc(self, device):
            return self._pg._supports_alloc(torch.device(device))

        def allocate_tensor(self, size, *, dtype, device):
            return self._pg._allocate_tensor(size, dtype, torch.device(device))

        def eager_connect_single_device(self, device):
            pass  # ringd's group is connected when the process group is made

        def shutdown(self):
            self._pg.shutdown()

        def abort(self):
            self._pg.abort()

        def __repr__(self):
            return f"RingdBackend(group {getattr(self._pg, 'ringd_group', '?')}, {self.device})"

    def install_contract(cls):
        """ringd's group under this torch's names."""
        setattr(cls, ALL_GATHER_SINGLE, cls._all_gather_single)
        setattr(cls, REDUCE_SCATTER_SINGLE, cls._reduce_scatter_single)
        cls._get_backend = lambda self, device: RingdBackend(self, torch.device(device))
        for name in ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"):
            if hasattr(_ProcessGroup, name):
                setattr(cls, name, cls._all_gather_single_coalesced)
        for name in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"):
            if hasattr(_ProcessGroup, name):
                setattr(cls, name, cls._reduce_scatter_single_coalesced)
        return cls
