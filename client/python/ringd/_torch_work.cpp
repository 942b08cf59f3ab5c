// ringd._torch_work: the Work object ringd's process group hands to torch (torch 1.13).
//
// A Python subclass of torch.distributed.Work cannot serve DDP in torch 1.13: its reducer calls
// Work::getFuture() from C++, which 1.13's Python trampoline does not forward. torch's own
// future-wrapping Work does forward it, but its wait() returns true when the op failed, so a
// failed ringd op would look like a success to dist.all_reduce. This Work does both: getFuture()
// is the op's future, and wait() blocks until the op is done (without the GIL) and throws the
// op's error. Python completes the future (ringd/torch.py); nothing else lives here.
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

namespace {

class RingdWork : public c10d::Work {
public:
    RingdWork(c10::intrusive_ptr<c10::ivalue::Future> fut, std::vector<at::Tensor> result)
        : Work(-1, c10d::OpType::ALLREDUCE), fut_(std::move(fut)), result_(std::move(result)) {}

    bool isCompleted() override { return fut_->completed(); }
    bool isSuccess() const override { return fut_->completed() && !fut_->hasError(); }
    std::exception_ptr exception() const override { return fut_->completed() ? fut_->exception_ptr() : nullptr; }
    std::vector<at::Tensor> result() override { return result_; }
    // ringd bounds every op by its group's op timeout (the process group's): the wait always ends; `timeout` adds nothing.
    bool wait(std::chrono::milliseconds) override {
        fut_->wait();
        if (fut_->hasError()) std::rethrow_exception(fut_->exception_ptr());
        return true;
    }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return fut_; }

protected:
    c10::intrusive_ptr<c10::ivalue::Future> fut_;
    std::vector<at::Tensor> result_;
};

// A CUDA op's Work: wait() orders the caller's current stream after the op's result (the Python
// `on_wait`, ringd_stream_wait) without blocking the host, then raises the op's error if it is
// already known (as NCCL's Work does).
class RingdCudaWork : public RingdWork {
public:
    RingdCudaWork(c10::intrusive_ptr<c10::ivalue::Future> fut, std::vector<at::Tensor> result, pybind11::function on_wait)
        : RingdWork(std::move(fut), std::move(result)),
          on_wait_(new pybind11::function(std::move(on_wait)), [](pybind11::function *f) {
              if (!Py_IsInitialized()) {  // after the interpreter ended: nothing to give back to it
                  f->release();
                  delete f;
                  return;
              }
              pybind11::gil_scoped_acquire gil;  // a Python object goes with the GIL held
              delete f;
          }) {}

    bool wait(std::chrono::milliseconds) override {
        {
            pybind11::gil_scoped_acquire gil;
            try {
                (*on_wait_)();
            } catch (pybind11::error_already_set &e) {
                throw std::runtime_error(e.what());
            }
        }
        if (fut_->completed() && fut_->hasError()) std::rethrow_exception(fut_->exception_ptr());
        return true;
    }

private:
    std::shared_ptr<pybind11::function> on_wait_;
};

}  // namespace

PYBIND11_MODULE(_torch_work, m) {
    m.doc() = "The Work object of ringd's torch process group (see ringd/torch.py)";
    m.def(
        "work",
        [](const std::shared_ptr<torch::jit::PythonFutureWrapper> &fut, std::vector<at::Tensor> result) {
            return c10::intrusive_ptr<c10d::Work>(c10::make_intrusive<RingdWork>(fut->fut, std::move(result)));
        },
        pybind11::arg("future"), pybind11::arg("result"),
        "A torch.distributed.Work for `future` (a torch.futures.Future that completes with `result` or an error)");
    m.def(
        "cuda_work",
        [](const std::shared_ptr<torch::jit::PythonFutureWrapper> &fut, std::vector<at::Tensor> result,
           pybind11::function on_wait) {
            return c10::intrusive_ptr<c10d::Work>(
                c10::make_intrusive<RingdCudaWork>(fut->fut, std::move(result), std::move(on_wait)));
        },
        pybind11::arg("future"), pybind11::arg("result"), pybind11::arg("on_wait"),
        "A torch.distributed.Work for a CUDA op: wait() calls on_wait() (the current stream waits for the "
        "result) and raises the op's error if it is known");
    // torch.futures.Future.set_exception (1.13) stores the exception as the future's value, which
    // C++ (DDP's reducer, Work::wait) takes for a result: this marks the future failed instead.
    m.def(
        "set_error",
        [](const std::shared_ptr<torch::jit::PythonFutureWrapper> &fut, const std::string &message) {
            fut->fut->setError(std::make_exception_ptr(std::runtime_error(message)));
        },
        pybind11::arg("future"), pybind11::arg("message"),
        "Completes `future` with a RuntimeError(message), seen alike by Python and C++ waiters");
}
