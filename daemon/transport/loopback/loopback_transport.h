// Loopback transport: links between transports in one process (each usually driven by its own
// thread), for unit tests of the engine without sockets. Same semantics as the network
// transports: registered regions, tag-matched messages delivered straight into the posted
// receive, completions from poll(), sticky errors naming the peer. A pair of links shares a
// Wire; messages are copied when both the send and its receive are posted.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>

#include "common/unique_fd.h"
#include "daemon/transport/transport.h"

namespace ringd {

class LoopbackTransport;

class LoopbackLink final : public Link {
public:
    Status post_send(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) override;
    Status post_recv(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) override;
    // Breaks the wire: both ends fail everything pending (a peer that died). Called by the
    // thread that owns this end.
    void cut(const std::string &why);

private:
    friend class LoopbackTransport;
    struct Wire;
    LoopbackLink(LoopbackTransport &t, std::string peer, std::shared_ptr<Wire> wire, int side);
    LoopbackTransport &t_;
    std::shared_ptr<Wire> wire_;
    int side_;  // 0 or 1: which end of the wire
};

class LoopbackTransport final : public Transport {
public:
    LoopbackTransport();
    std::string_view name() const override { return "loopback"; }
    Status poll(std::vector<LinkEvent> &out, int timeout_ms) override;

    // Connects a (named `a_name` as seen from b) and b (named `b_name` as seen from a).
    static std::pair<LoopbackLink *, LoopbackLink *> connect(LoopbackTransport &a, const std::string &a_name,
                                                             LoopbackTransport &b, const std::string &b_name);

protected:
    Result<RegionHandle> do_register(std::byte *base, size_t bytes) override;
    void do_deregister(RegionHandle) override {}

private:
    friend class LoopbackLink;
    void push(LinkEvent e);  // any thread

    uint64_t next_region_ = 1;
    std::vector<std::unique_ptr<LoopbackLink>> links_;
    std::mutex mu_;
    std::vector<LinkEvent> events_;
    UniqueFd wake_;  // eventfd: readable while events_ is non-empty
};

}  // namespace ringd
