#include "daemon/transport/loopback/loopback_transport.h"

#include <poll.h>
#include <sys/eventfd.h>

#include <cstring>

#include "common/fd_io.h"

namespace ringd {

// Per direction d (0: side 0 -> side 1, 1: side 1 -> side 0): unmatched sends and receives.
struct LoopbackLink::Wire {
    struct Msg {
        std::byte *data;
        uint64_t bytes;
    };
    std::mutex mu;
    std::map<uint64_t, Msg> sends[2];
    std::map<uint64_t, Msg> recvs[2];
    LoopbackLink *ends[2] = {nullptr, nullptr};
    std::optional<std::string> broken;
};

LoopbackTransport::LoopbackTransport() : wake_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

Result<RegionHandle> LoopbackTransport::do_register(std::byte *base, size_t bytes) {
    if (!base || bytes == 0) return make_error(-EINVAL, "cannot register an empty region");
    return RegionHandle{next_region_++, base, bytes};
}

void LoopbackTransport::push(LinkEvent e) {
    std::lock_guard lock(mu_);
    events_.push_back(std::move(e));
    const uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof one);
}

Status LoopbackTransport::poll(std::vector<LinkEvent> &out, int timeout_ms) {
    pollfd p{wake_.get(), POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) < 0 && errno != EINTR) return make_error(-errno, "poll: " + errno_string(errno));
    uint64_t v;
    std::lock_guard lock(mu_);
    (void)!::read(wake_.get(), &v, sizeof v);
    out.insert(out.end(), std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
    events_.clear();
    return Ok{};
}

std::pair<LoopbackLink *, LoopbackLink *> LoopbackTransport::connect(LoopbackTransport &a, const std::string &a_name,
                                                                     LoopbackTransport &b, const std::string &b_name) {
    auto wire = std::make_shared<LoopbackLink::Wire>();
    a.links_.push_back(std::unique_ptr<LoopbackLink>(new LoopbackLink(a, b_name, wire, 0)));
    b.links_.push_back(std::unique_ptr<LoopbackLink>(new LoopbackLink(b, a_name, wire, 1)));
    wire->ends[0] = a.links_.back().get();
    wire->ends[1] = b.links_.back().get();
    return {wire->ends[0], wire->ends[1]};
}

LoopbackLink::LoopbackLink(LoopbackTransport &t, std::string peer, std::shared_ptr<Wire> wire, int side)
    : Link(std::move(peer)), t_(t), wire_(std::move(wire)), side_(side) {}

Status LoopbackLink::post_send(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
    if (offset > region.bytes || bytes > region.bytes - offset)
        return make_error(-ERANGE, "send outside its registered region");
    std::lock_guard lock(wire_->mu);
    if (wire_->broken) return set_error(-ECONNRESET, *wire_->broken);
    const int d = side_;
    LoopbackLink *peer = wire_->ends[1 - side_];
    auto it = wire_->recvs[d].find(tag);
    if (it == wire_->recvs[d].end()) {
        wire_->sends[d][tag] = {region.base + offset, bytes};
        return Ok{};
    }
    if (it->second.bytes != bytes) {
        wire_->broken = "message " + std::to_string(tag) + " has " + std::to_string(bytes) +
                        " bytes, the receive expects " + std::to_string(it->second.bytes);
        return set_error(-EPROTO, *wire_->broken);
    }
    std::memcpy(it->second.data, region.base + offset, bytes);
    wire_->recvs[d].erase(it);
    bytes_sent_ += bytes;
    peer->bytes_received_ += bytes;
    t_.push({this, LinkEvent::Kind::SendDone, tag, {}});
    peer->t_.push({peer, LinkEvent::Kind::RecvDone, tag, {}});
    return Ok{};
}

Status LoopbackLink::post_recv(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
    if (offset > region.bytes || bytes > region.bytes - offset)
        return make_error(-ERANGE, "receive outside its registered region");
    std::lock_guard lock(wire_->mu);
    if (wire_->broken) return set_error(-ECONNRESET, *wire_->broken);
    const int d = 1 - side_;
    LoopbackLink *peer = wire_->ends[1 - side_];
    auto it = wire_->sends[d].find(tag);
    if (it == wire_->sends[d].end()) {
        if (!wire_->recvs[d].emplace(tag, Wire::Msg{region.base + offset, bytes}).second)
            return make_error(-EEXIST, "receive " + std::to_string(tag) + " posted twice");
        return Ok{};
    }
    if (it->second.bytes != bytes) {
        wire_->broken = "message " + std::to_string(tag) + " has " + std::to_string(it->second.bytes) +
                        " bytes, the receive expects " + std::to_string(bytes);
        return set_error(-EPROTO, *wire_->broken);
    }
    std::memcpy(region.base + offset, it->second.data, bytes);
    wire_->sends[d].erase(it);
    bytes_received_ += bytes;
    peer->bytes_sent_ += bytes;
    t_.push({this, LinkEvent::Kind::RecvDone, tag, {}});
    peer->t_.push({peer, LinkEvent::Kind::SendDone, tag, {}});
    return Ok{};
}

void LoopbackLink::cut(const std::string &why) {
    std::lock_guard lock(wire_->mu);
    if (!wire_->broken) wire_->broken = why;
    for (int side = 0; side < 2; ++side) {
        LoopbackLink *l = wire_->ends[side];
        // Only this end's error is set here (the other end belongs to another thread); the other
        // end learns from its Failed events and from its next post.
        const Error e = l == this ? set_error(-ECONNRESET, why) : Error{-ECONNRESET, "link to " + l->peer() + ": " + why};
        // Everything this end posted fails: its sends (direction side) and receives (direction 1-side).
        for (const auto &[tag, m] : wire_->sends[side]) l->t_.push({l, LinkEvent::Kind::Failed, tag, e});
        for (const auto &[tag, m] : wire_->recvs[1 - side]) l->t_.push({l, LinkEvent::Kind::Failed, tag, e});
        // A Failed event without a pending op still tells the owner the link broke.
        l->t_.push({l, LinkEvent::Kind::Failed, 0, e});
    }
    for (auto &m : wire_->sends) m.clear();
    for (auto &m : wire_->recvs) m.clear();
}

}  // namespace ringd
