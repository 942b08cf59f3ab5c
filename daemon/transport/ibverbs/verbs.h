// Move-only owners of verbs objects and the small steps of bringing a device and an RC QP up
// (rdma-core's rc_pingpong, without the cleanup ladder). Every call goes through a VerbsApi, so
// the same code drives a NIC or the software device.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "daemon/transport/ibverbs/verbs_api.h"
#include "proto/result.h"

namespace ringd::verbs {

// Owns one verbs object; destroys it through the API it came from. Member order in users =
// creation order, so that destruction runs backwards (QPs before CQs before the PD ...).
template <typename T, auto Destroy>
class Owned {
public:
    Owned() = default;
    Owned(const VerbsApi *api, T *p) : api_(api), p_(p) {}
    Owned(Owned &&o) noexcept : api_(o.api_), p_(std::exchange(o.p_, nullptr)) {}
    Owned &operator=(Owned &&o) noexcept {
        if (this != &o) {
            reset();
            api_ = o.api_;
            p_ = std::exchange(o.p_, nullptr);
        }
        return *this;
    }
    Owned(const Owned &) = delete;
    Owned &operator=(const Owned &) = delete;
    ~Owned() { reset(); }
    T *get() const { return p_; }
    T *operator->() const { return p_; }
    explicit operator bool() const { return p_ != nullptr; }
    void reset() {
        if (p_) (void)(api_->*Destroy)(p_);
        p_ = nullptr;
    }

private:
    const VerbsApi *api_ = nullptr;
    T *p_ = nullptr;
};

using DeviceContext = Owned<ibv_context, &VerbsApi::close_device>;
using ProtectionDomain = Owned<ibv_pd, &VerbsApi::dealloc_pd>;
using MemoryRegion = Owned<ibv_mr, &VerbsApi::dereg_mr>;
using CompletionChannel = Owned<ibv_comp_channel, &VerbsApi::destroy_comp_channel>;
using CompletionQueue = Owned<ibv_cq, &VerbsApi::destroy_cq>;
using QueuePair = Owned<ibv_qp, &VerbsApi::destroy_qp>;

// Opens `name` ("auto": the first device). No device, or no such device, is an error that says
// what was looked for, what exists and what to do instead.
Result<DeviceContext> open_device(const VerbsApi &api, const std::string &name, std::string &opened_name);

struct PortInfo {
    uint8_t port = 1;
    ibv_port_attr attr{};
    uint32_t gid_index = 0;
    ibv_gid gid{};
    std::string gid_text;  // "::ffff:10.0.0.1 (RoCE v2)"
};

// Queries the port (must be ACTIVE) and picks the GID: `gid_index` "auto" takes, on an Ethernet
// (RoCE) port, the first RoCE v2 GID of an IPv4 address (routable, what RoCE v2 ECMP fabrics
// route), then a global IPv6 RoCE v2 GID, then anything non-link-local; on InfiniBand, index 0.
Result<PortInfo> query_port(const VerbsApi &api, ibv_context *ctx, uint8_t port, const std::string &gid_index);

std::string gid_string(const ibv_gid &gid);

struct QpPath {
    uint8_t port = 1;
    uint8_t sgid_index = 0;
    ibv_gid dgid{};
    uint16_t dlid = 0;
    bool global = true;  // GRH (always on RoCE)
    ibv_mtu mtu = IBV_MTU_1024;
    uint32_t dest_qpn = 0, rq_psn = 0, sq_psn = 0;
    uint8_t timeout = 14, retry_cnt = 7, rnr_retry = 7, min_rnr_timer = 12;
};

// RESET -> INIT with remote-write access; INIT -> RTR -> RTS toward the peer.
Status qp_to_init(const VerbsApi &api, ibv_qp *qp, uint8_t port);
Status qp_to_rtr(const VerbsApi &api, ibv_qp *qp, const QpPath &p);
Status qp_to_rts(const VerbsApi &api, ibv_qp *qp, const QpPath &p);

}  // namespace ringd::verbs
