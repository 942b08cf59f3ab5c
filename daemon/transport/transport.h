// The transport boundary: what the engine sees of a network. Shaped for RDMA (NCCL's net
// plugin regMr/isend/irecv/test, Gloo's pair/buffer): memory is registered once and referred to
// by handle afterwards; nothing on the data path registers, allocates or looks anything up.
//
//   register_region  once per slot / staging buffer -> RegionHandle (carries what a post needs)
//   Link             a connection to one peer, both directions; the control plane establishes and
//                    authenticates it, then hands it to the transport
//   post_send/recv   non-blocking, many in flight, between registered regions; a message is
//                    matched to the receive posted with the same tag and lands straight in it
//   poll             progress + completions (LinkEvent), waiting at most timeout_ms
//   errors           sticky per link, naming the peer; they fail everything pending on the link
//
// Contract for tags: both sides post the messages of one direction of a link in the same order
// (the ring schedule guarantees it); a transport may rely on that for flow control.
//
// Threading: registration from one thread at a time (the control thread: slots come and go with
// trainers); a Link and poll() from one thread (the progress thread) at a time. A post reads
// only its RegionHandle, never the transport's registrations, so registering and deregistering
// other regions while links post is safe; deregistering a region that a pending post uses is
// not (the owner keeps it registered until the op ends).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/transport/frame_mac.h"
#include "proto/result.h"

namespace ringd {

struct Config;

// Everything a post needs about a region, by value: the data path never looks a registration up
// in a table that the registering thread changes (a trainer joins or leaves while ops run).
struct RegionHandle {
    uint64_t id = 0;           // 0 = not registered
    std::byte *base = nullptr;
    uint64_t bytes = 0;
    uint32_t lkey = 0;         // ibverbs: the memory region's local key (0 for other transports)
    uint32_t rkey = 0;         // ibverbs: its remote key, announced to the peer by a receive
    // A file that holds the region's bytes from fd_offset on (a trainer's memfd slot), or -1: a
    // transport may send from it by reference (post_send_stable). The owner keeps it open.
    int fd = -1;
    uint64_t fd_offset = 0;
};

struct TransportStats {
    uint64_t registrations = 0;     // regions registered since start (never per op)
    uint64_t registered_bytes = 0;  // bytes registered now
    uint64_t live_regions = 0;
};

class Link;

constexpr uint32_t kMaxRailsPerLink = 16;  // (config: kMaxRails)

struct LinkEvent {
    enum class Kind { SendDone, RecvDone, Failed };
    Link *link = nullptr;
    Kind kind = Kind::SendDone;
    uint64_t tag = 0;
    Error error;  // Failed only
};

class Link {
public:
    virtual ~Link() = default;
    const std::string &peer() const { return peer_; }
    // Sends [region.base + offset, +bytes) as the message `tag`. The memory must stay unchanged
    // until SendDone.
    virtual Status post_send(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) = 0;
    // The same, for memory that the caller keeps unchanged until the peer has received the
    // message, not only until SendDone: the transport may then send it by reference instead of
    // copying it (TCP: sendfile from the region's file, so the kernel's socket buffers hold the
    // pages themselves and the receiving host copies straight out of them). The caller learns
    // that the peer has it from the peer (the ring's delivery marker, ring_engine.h).
    virtual Status post_send_stable(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
        return post_send(region, offset, bytes, tag);
    }
    // Whether SendDone means that the peer has the message (its memory holds it): true for the
    // transports that copy at the send or complete only once the peer has it (RDMA); false for
    // TCP, where the bytes of a stable send may still sit in socket buffers, by reference. Every
    // host of a ring runs the same transport, so both ends of a link agree on it.
    virtual bool delivered_at_send_done() const { return true; }
    // Receives the message `tag` (exactly `bytes` long) into [region.base + offset, +bytes).
    virtual Status post_recv(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) = 0;
    // Ending one op on a live link (lanes whose ops start without the coordinator, solo op tags
    // below). Transports that cannot keep a link usable after an op that not every host ran say
    // false, and such a lane's ops then wait for the coordinator's start.
    virtual bool can_cancel() const { return false; }
    // Messages of solo op tags before `op_tag` (solo_tag_before) are read and dropped, now and
    // whenever they arrive: ops this host ran, cancelled or skipped. Both ends run a lane's ops in
    // the same order, so such a message can only be left over from an op that ended here.
    virtual void set_floor(uint32_t op_tag) { (void)op_tag; }
    // The op is cancelled on the receiving side: its posted receives are withdrawn, and one that
    // is being filled has the rest of its message dropped (its memory is not written again).
    virtual void cancel_receives(uint32_t op_tag) { (void)op_tag; }
    // Whether sends of the op are still queued: their memory must stay as it is until they are
    // out (TCP sends every queued message: one being written cannot be cut short); or, after
    // fence(), until the peer has read (or dropped) every message of the op sent before it.
    virtual bool sending(uint32_t op_tag) const { (void)op_tag; return false; }
    // For an op that sent by reference (post_send_stable), cancelled: the peer answers once it has
    // read everything of the op this link sent (sending() stays true until then).
    virtual void fence(uint32_t op_tag) { (void)op_tag; }
    // What the link holds and waits on now (its queues, posted receives, streams), one line for
    // the log of an op that timed out on it; empty where the transport says nothing.
    virtual std::string describe() const { return {}; }
    // The first error on this link; once set, every post fails and every pending op has failed.
    const std::optional<Error> &error() const { return error_; }
    uint64_t bytes_sent() const { return bytes_sent_; }
    uint64_t bytes_sent_by_reference() const { return bytes_by_reference_; }  // of bytes_sent(): not copied
    // Of bytes_sent(): on rail r (LinkSetup::rails; a link of one rail sends everything on rail 0).
    uint64_t bytes_sent_on_rail(uint32_t r) const { return r < kMaxRailsPerLink ? bytes_by_rail_[r] : 0; }
    uint64_t bytes_received() const { return bytes_received_; }
    // Several rails: whether rail r carries messages now (a link of one rail: always), and the
    // messages (and their bytes) sent again on other rails because theirs went down before the
    // peer had them.
    bool rail_up(uint32_t r) const { return r >= kMaxRailsPerLink || !((rails_down_ >> r) & 1u); }
    uint32_t rails_down() const { return rails_down_; }
    uint64_t messages_resent() const { return resent_messages_; }
    uint64_t bytes_resent() const { return resent_bytes_; }
    // Messages read ahead of their receive into the link's memory (several rails), and copied
    // from there when it was posted.
    uint64_t messages_held() const { return held_messages_; }

protected:
    explicit Link(std::string peer) : peer_(std::move(peer)) {}
    // Records the first error (prefixed with the peer's name) and returns it.
    const Error &set_error(int code, const std::string &why) {
        if (!error_) error_ = Error{code, "link to " + peer_ + ": " + why};
        return *error_;
    }
    uint64_t bytes_sent_ = 0;
    uint64_t bytes_by_reference_ = 0;
    std::array<uint64_t, kMaxRailsPerLink> bytes_by_rail_{};  // (a transport of rails counts them)
    uint64_t bytes_received_ = 0;
    uint32_t rails_down_ = 0;  // bit r: rail r is down
    uint64_t resent_messages_ = 0, resent_bytes_ = 0, held_messages_ = 0;

private:
    std::string peer_;
    std::optional<Error> error_;
};

// Op tags of a solo lane (a lane one group incarnation has alone, whose ops every host starts by
// itself in the group's order): bit 31 set, the lane's grant epoch in bits 24-30, a digest of the
// op's count, dtype and op in bits 16-23 (a host whose op differs sends messages no receive of
// the others matches: the op stalls and the coordinator names the difference), its seq in bits
// 0-15. They are ordered by (epoch, seq), each modulo its width, within half of it.
inline constexpr uint32_t kSoloTag = 1u << 31;
inline bool solo_tag(uint32_t op_tag) { return (op_tag & kSoloTag) != 0; }
inline bool solo_tag_before(uint32_t a, uint32_t b) {
    const uint32_t ea = (a >> 24) & 0x7f, eb = (b >> 24) & 0x7f;
    if (ea != eb) return ((eb - ea) & 0x7f) < 64;
    const uint32_t sa = a & 0xffff, sb = b & 0xffff;
    return sa != sb && ((sb - sa) & 0xffff) < 0x8000;
}
// The tag of the op after `op_tag` in its lane (digest 0: the order ignores it).
inline uint32_t solo_tag_next(uint32_t op_tag) { return (op_tag & 0xff000000u) | ((op_tag + 1) & 0xffff); }

class Transport {
public:
    virtual ~Transport() = default;
    virtual std::string_view name() const = 0;

    // fd/fd_offset: a file that holds [base, +bytes) from fd_offset on (RegionHandle::fd), or -1.
    Result<RegionHandle> register_region(std::byte *base, size_t bytes, int fd = -1, uint64_t fd_offset = 0);
    void deregister_region(RegionHandle h);
    const TransportStats &stats() const { return stats_; }

    // Moves data and appends completions to `out`; blocks at most timeout_ms (0: never) when
    // nothing is ready. An error here is about the transport itself, not one link.
    virtual Status poll(std::vector<LinkEvent> &out, int timeout_ms) = 0;

protected:
    virtual Result<RegionHandle> do_register(std::byte *base, size_t bytes) = 0;
    virtual void do_deregister(RegionHandle h) = 0;

private:
    TransportStats stats_;
};

struct LinkSetup {
    LinkSetup() = default;
    LinkSetup(std::string p, std::vector<UniqueFd> s, std::vector<SessionKeys> k = {})
        : peer(std::move(p)), streams(std::move(s)), keys(std::move(k)) {}
    std::string peer;               // host name, for errors and logs
    std::vector<UniqueFd> streams;  // connected, authenticated data connections to it
    // Each connection's frame keys from its handshake (daemon/transport/frame_mac.h); empty or
    // disabled: nothing is tagged (no auth.secret_file).
    std::vector<SessionKeys> keys;
    // Several rails: each connection's rail and that rail's weight (HostEntry::weights), by which
    // the link's messages are shared out; empty: all connections alike, in turn.
    std::vector<uint32_t> rails;
    std::vector<double> weights;
    // Several rails: the owner's name for the link (offer_rail_streams finds it by it), and where
    // the link publishes its rails' state for other threads (RailState below; may be null).
    uint64_t key = 0;
    std::atomic<uint64_t> *rail_state = nullptr;
};

// A link's rails as it publishes them (LinkSetup::rail_state): bit r of the low half, rail r is
// down; of the high half, rail r is down and both ends have said what they had of it, so new
// connections may replace its old ones (the control plane dials them).
inline uint32_t rails_down_of(uint64_t state) { return static_cast<uint32_t>(state); }
inline uint32_t rails_resynced_of(uint64_t state) { return static_cast<uint32_t>(state >> 32); }

// A transport between hosts (tcp, ibverbs): links are made from data connections that the
// control plane established and authenticated.
class NetworkTransport : public Transport {
public:
    // Takes the connections over and brings every link up, before `deadline`. Both ends of a
    // link call this at about the same time; a transport that exchanges anything first writes on
    // every link, then reads, so that a ring of hosts never waits on itself. On error no link
    // was added.
    virtual Result<std::vector<Link *>> add_links(std::vector<LinkSetup> links,
                                                  std::chrono::steady_clock::time_point deadline) = 0;
    // Drops a link (closing its connections); pending operations on it are abandoned.
    virtual void remove_link(Link *link) = 0;
    // Readable when poll() has something to report (completions, a failed link).
    virtual int fd() const = 0;
    // What the transport runs on, for logs and status ("" when there is nothing to add).
    virtual std::string detail() const { return {}; }
    // A transport for another progress thread (another ring domain's): links and poll() of its
    // own, on the same device, taking this one's RegionHandles (a region registered once serves
    // every domain). This transport must outlive it.
    virtual Result<std::unique_ptr<NetworkTransport>> sibling() = 0;
    // Called on each TCP socket of the data path before it connects (and on the listener, whose
    // accepted connections inherit it) with what must be the socket's from its first packet.
    // TCP: the congestion control (TcpTransport). Called on the control thread while the progress
    // thread runs the links: it must not touch link state.
    virtual void prepare_socket(int fd) const { (void)fd; }
    // New connections for rail `rail` of the link set up with `key` (LinkSetup::key), in the
    // order of its old ones. Any thread: the progress thread takes them in its next poll(), even
    // in the middle of an op; they are closed if no such link exists by then.
    virtual Status offer_rail_streams(uint64_t key, uint32_t rail, std::vector<UniqueFd> fds, std::vector<SessionKeys> keys) {
        (void)key, (void)rail, (void)fds, (void)keys;
        return make_error(-ENOTSUP, std::string(name()) + " links have one rail");
    }
};

// A registration that undoes itself. Move-only.
class RegisteredRegion {
public:
    RegisteredRegion() = default;
    RegisteredRegion(Transport *t, RegionHandle h) : t_(t), h_(h) {}
    RegisteredRegion(RegisteredRegion &&o) noexcept : t_(o.t_), h_(o.h_) { o.t_ = nullptr; }
    RegisteredRegion &operator=(RegisteredRegion &&o) noexcept {
        if (this != &o) {
            reset();
            t_ = o.t_;
            h_ = o.h_;
            o.t_ = nullptr;
        }
        return *this;
    }
    RegisteredRegion(const RegisteredRegion &) = delete;
    RegisteredRegion &operator=(const RegisteredRegion &) = delete;
    ~RegisteredRegion() { reset(); }
    const RegionHandle &handle() const { return h_; }
    void reset() {
        if (t_) t_->deregister_region(h_);
        t_ = nullptr;
    }

private:
    Transport *t_ = nullptr;
    RegionHandle h_;
};

// The transport named by config.transport, or an error saying why it cannot be used here.
Result<std::unique_ptr<NetworkTransport>> make_transport(const Config &config);

}  // namespace ringd
