// The turns of an op's wait on its links, the same in every engine that runs one on the progress
// thread (RingEngine, AllToAllEngine, ExchangeEngine).
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "daemon/transport/transport.h"

namespace ringd {

inline int64_t steady_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Every turn of a wait: an aborted generation or a cancelled op ends it; else the progress
// thread's heartbeat. Op: any engine's op (its aborted_generation, generation, cancelled, beat_ns).
template <typename Op>
Status wait_turn(const Op &op) {
    if (op.aborted_generation && op.aborted_generation->load(std::memory_order_acquire) >= op.generation)
        return make_error(-ECONNABORTED, "ring generation " + std::to_string(op.generation) + " was aborted");
    if (op.cancelled && op.cancelled->load(std::memory_order_acquire)) return make_error(-ECANCELED, "the op was cancelled");
    if (op.beat_ns) op.beat_ns->store(steady_now_ns(), std::memory_order_relaxed);
    return Ok{};
}

// How an op waits for its links' events. spin_us < 0 (busy): never block; 0 (event): block at
// once; > 0 (adaptive): spin for that long after the last progress, then block. Blocking is
// bounded (100 ms) so that aborts and cancels are seen promptly. Adaptive spins only while it
// pays: a spin that ran out without an event stops the spinning, and a block that an event ended
// within the spin time starts it again. An op whose events are further apart than that (a link
// slower than the host) blocks between them rather than burning a core on every gap; one whose
// events come close together (latency-bound, or links faster than the host) spins.
class LinkPoll {
public:
    explicit LinkPoll(int spin_us) : spin_us_(spin_us) {}

    // Clears `events` and polls `t` into them, for at most wait_ms (> 0) unless spinning;
    // `busy_now`: the caller has other work this turn (never block).
    Status poll(Transport &t, std::vector<LinkEvent> &events, int wait_ms, bool busy_now = false) {
        const auto now = std::chrono::steady_clock::now();
        const auto spin_for = std::chrono::microseconds(spin_us_);
        bool spin = spin_us_ < 0 || busy_now;
        if (!spin && spin_us_ > 0 && spin_pays_) {
            spin = now - last_progress_ < spin_for;
            if (!spin) spin_pays_ = false;  // ran out: block, and until a block ends quickly
        }
        events.clear();
        if (auto s = t.poll(events, spin ? 0 : std::min(wait_ms, 100)); !s) return s;
        if (!events.empty()) {
            last_progress_ = std::chrono::steady_clock::now();
            if (!spin && last_progress_ - now < spin_for) spin_pays_ = true;
        }
        return Ok{};
    }

    // When the last poll that returned events ended (steady clock, ns).
    int64_t last_progress_ns() const {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(last_progress_.time_since_epoch()).count();
    }

private:
    int spin_us_;
    std::chrono::steady_clock::time_point last_progress_ = std::chrono::steady_clock::now();
    bool spin_pays_ = true;
};

}  // namespace ringd
