"""What differs between the torch versions ringd.torch runs on (1.13 and 2.x), and nothing else.

- The Work object an op returns. torch 1.13's reducer calls Work::getFuture() from C++, which 1.13's
  Python Work trampoline does not forward, so 1.13 needs ringd._torch_work (C++, built against
  that torch). torch 2.x forwards get_future() and wait() to a Python subclass of dist._Work, so
  it needs no C++ piece at all.
- Registering the backend: torch 2.1 and later take the devices it serves (cpu and cuda); a
  creator that returns a ProcessGroup is used as the process group itself in every version.
"""
import os

import torch
import torch.distributed as dist

TORCH_MAJOR = int(torch.__version__.split(".")[0])


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
else:
    class _RingdWork(dist._Work):
        """wait() blocks until the op is done and raises its error (a CUDA op: on_wait orders the
        current stream after the result instead, without blocking); get_future() is the op's
        future."""

        def __init__(self, fut, result, on_wait):
            super().__init__()
            self._fut, self._result, self._on_wait = fut, result, on_wait

        def wait(self, timeout=None):
            if self._on_wait is not None:
                self._on_wait()
                if self._fut.done():
                    self._fut.wait()  # raises the op's error
                return True
            self._fut.wait()
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

    def work(fut, result, on_wait=None):
        return _RingdWork(fut, result, on_wait)

    def register_backend(name, creator):
        import inspect
        if "devices" in inspect.signature(dist.Backend.register_backend).parameters:
            dist.Backend.register_backend(name, creator, devices=["cpu", "cuda"])
        else:  # torch 2.0: no device list; the process group serves every device it gets
            dist.Backend.register_backend(name, creator)
