// The transport boundary: what the engine sees of a network. Shaped for RDMA (NCCL's net
// plugin regMr/isend/irecv/test, Gloo's pair/buffer): memory is registered once and referred to
// by handle afterwards; nothing on the data path registers, allocates or looks anything up.
//
// This file holds the part every transport needs from the first host on: registration of the
// memory the engine moves data in and out of (client slots, staging). Links to peers (connect,
// non-blocking sends/receives or writes-with-immediate between registered regions, completion
// polling, sticky per-link errors naming the peer) join the interface with the ring.
//
// Threading: register/deregister are called by the control thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "proto/result.h"

namespace ringd {

struct Config;

struct RegionHandle {
    uint64_t id = 0;  // 0 = not registered
};

struct TransportStats {
    uint64_t registrations = 0;       // regions registered since start (never per op)
    uint64_t registered_bytes = 0;    // bytes registered now
    uint64_t live_regions = 0;
};

class Transport {
public:
    virtual ~Transport() = default;
    virtual std::string_view name() const = 0;

    // Registers [base, base + bytes) for the lifetime of the returned handle's owner.
    Result<RegionHandle> register_region(std::byte *base, size_t bytes);
    void deregister_region(RegionHandle h, size_t bytes);

    const TransportStats &stats() const { return stats_; }

protected:
    virtual Result<RegionHandle> do_register(std::byte *base, size_t bytes) = 0;
    virtual void do_deregister(RegionHandle h) = 0;

private:
    TransportStats stats_;
};

// A registration that undoes itself. Move-only.
class RegisteredRegion {
public:
    RegisteredRegion() = default;
    RegisteredRegion(Transport *t, RegionHandle h, size_t bytes) : t_(t), h_(h), bytes_(bytes) {}
    RegisteredRegion(RegisteredRegion &&o) noexcept : t_(o.t_), h_(o.h_), bytes_(o.bytes_) { o.t_ = nullptr; }
    RegisteredRegion &operator=(RegisteredRegion &&o) noexcept {
        if (this != &o) {
            reset();
            t_ = o.t_;
            h_ = o.h_;
            bytes_ = o.bytes_;
            o.t_ = nullptr;
        }
        return *this;
    }
    RegisteredRegion(const RegisteredRegion &) = delete;
    RegisteredRegion &operator=(const RegisteredRegion &) = delete;
    ~RegisteredRegion() { reset(); }
    RegionHandle handle() const { return h_; }
    void reset() {
        if (t_) t_->deregister_region(h_, bytes_);
        t_ = nullptr;
    }

private:
    Transport *t_ = nullptr;
    RegionHandle h_;
    size_t bytes_ = 0;
};

// The transport named by config.transport, or an error saying why it cannot be used here.
Result<std::unique_ptr<Transport>> make_transport(const Config &config);

}  // namespace ringd
