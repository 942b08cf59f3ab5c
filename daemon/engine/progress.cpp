#include "daemon/engine/progress.h"

#include <sys/eventfd.h>

#include <array>

#include "common/fd_io.h"
#include "daemon/engine/reduce.h"
#include "daemon/ipc/slot.h"
#include "proto/frame.h"

namespace ringd {

Result<std::unique_ptr<ProgressEngine>> ProgressEngine::start() {
    std::unique_ptr<ProgressEngine> e(new ProgressEngine());
    e->result_fd_ = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!e->result_fd_) return make_error(-errno, "eventfd: " + errno_string(errno));
    try {
        e->thread_ = std::thread([p = e.get()] { p->run(); });
    } catch (const std::system_error &err) {
        return make_error(-EAGAIN, std::string("cannot start the progress thread: ") + err.what());
    }
    return e;
}

ProgressEngine::~ProgressEngine() { stop(); }

void ProgressEngine::post(EngineWork work) {
    ++in_flight_;
    {
        std::lock_guard lock(mu_);
        work_.push_back(std::move(work));
    }
    cv_.notify_one();
}

std::vector<EngineResult> ProgressEngine::take_results() {
    uint64_t drained;
    (void)!::read(result_fd_.get(), &drained, sizeof drained);
    std::lock_guard lock(mu_);
    std::vector<EngineResult> out(std::make_move_iterator(results_.begin()), std::make_move_iterator(results_.end()));
    results_.clear();
    in_flight_ -= out.size();
    return out;
}

void ProgressEngine::stop() {
    {
        std::lock_guard lock(mu_);
        stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
}

void ProgressEngine::run() {
    for (;;) {
        EngineWork w;
        {
            std::unique_lock lock(mu_);
            cv_.wait(lock, [&] { return stopping_ || !work_.empty(); });
            if (stopping_) return;
            w = std::move(work_.front());
            work_.pop_front();
        }
        EngineResult r = execute(w);
        {
            std::lock_guard lock(mu_);
            results_.push_back(std::move(r));
        }
        const uint64_t one = 1;
        (void)!::write(result_fd_.get(), &one, sizeof one);
    }
}

EngineResult ProgressEngine::execute(EngineWork &w) {
    const size_t n = w.slots.size();
    // One local rank: the input already is the result (avg over one contribution included).
    if (n > 1 && w.count > 0) {
        std::array<void *, proto::kMaxLocalSize> bufs;
        for (size_t r = 0; r < n; ++r) bufs[r] = w.slots[r]->data() + w.offsets[r];
        ReduceArgs a;
        a.dtype = w.dtype;
        a.op = w.op;
        a.srcs = bufs.data();
        a.nsrc = n;
        a.dsts = bufs.data();
        a.ndst = n;
        a.count = w.count;
        a.avg_divisor = w.avg_divisor;
        reduce(a);
    }
    return EngineResult{w.op_id, 0, {}, std::move(w.slots)};
}

}  // namespace ringd
