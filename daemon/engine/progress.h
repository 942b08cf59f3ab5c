// ProgressEngine: the progress thread. It executes ops handed over by the control thread and
// hands results back; the two threads share nothing but these two queues (and the slots the
// work items keep alive).
//
// Contract: post()/take_results()/stop() are called by the control thread only. result_fd() is
// an eventfd that becomes readable when results wait. Slots referenced by a work item travel
// back in its result, so the last reference to a slot is always dropped on the control thread
// (which owns transport registration).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/unique_fd.h"
#include "proto/result.h"
#include "proto/types.h"

namespace ringd {

class Slot;

struct EngineWork {
    uint64_t op_id = 0;
    DType dtype = DType::F32;
    ReduceOp op = ReduceOp::Sum;
    uint64_t count = 0;
    uint32_t avg_divisor = 1;  // all contributions of the op (local ranks x hosts)
    std::vector<std::shared_ptr<Slot>> slots;  // index = local rank
    std::vector<uint64_t> offsets;             // byte offsets into each slot's data area
};

struct EngineResult {
    uint64_t op_id = 0;
    int32_t status = 0;
    std::string message;
    std::vector<std::shared_ptr<Slot>> slots;  // returned for release on the control thread
};

class ProgressEngine {
public:
    static Result<std::unique_ptr<ProgressEngine>> start();
    ~ProgressEngine();

    int result_fd() const { return result_fd_.get(); }
    void post(EngineWork work);
    std::vector<EngineResult> take_results();
    // Finishes the op in progress (if any), drops queued work, joins the thread.
    void stop();
    // Ops posted and not yet taken back with take_results().
    size_t in_flight() const { return in_flight_; }

    // Runs one op on the calling thread (the progress thread, or the control thread for ops so
    // small that a thread hop would cost more than the reduction).
    static EngineResult execute(EngineWork &w);

private:
    ProgressEngine() = default;
    void run();

    UniqueFd result_fd_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<EngineWork> work_;
    std::deque<EngineResult> results_;
    bool stopping_ = false;
    size_t in_flight_ = 0;  // control thread only
    std::thread thread_;  // last: started after everything it uses exists
};

}  // namespace ringd
