// TCP transport. A link is `tcp.streams` connected sockets to one peer (the control plane
// connects and authenticates them, then hands them over). Messages are striped over the streams
// in posting order; each is a 24-byte header (magic, flags, tag, length) followed by the payload,
// sent with one scatter/gather sendmsg straight from registered memory and received straight into
// the matching posted receive — no bounce buffer. A stream whose next message has no receive
// posted yet is left unread (TCP flow control backs the sender off) until the receive is posted.
// A stream in the middle of a payload sets SO_RCVLOWAT to what is left of it (at most 256 KiB),
// so that it reports readable once that much is in rather than on every segment: fewer wake-ups
// and larger copies per receive on links slower than the host.
//
// A stable send (post_send_stable) of at least 64 KiB from a region with a file (a trainer's
// memfd slot) goes by reference when tcp.zero_copy is on: the header with MSG_MORE, then the
// payload with sendfile from the file, so the socket buffers hold the slot's pages themselves
// rather than a copy; the receiving host's kernel copies straight out of them. Such a message's
// SendDone only says that it is in the socket buffers: the pages are read when they are
// delivered (delivered_at_send_done() is false), and the ring keeps them unchanged until the
// next host has said it has them. sendfile has no MSG_NOSIGNAL: the process ignores SIGPIPE (ringd
// does, daemon.cpp), so that a peer that is gone fails the link with EPIPE. (MSG_ZEROCOPY is no help here: the kernel copies its pages
// anyway when it delivers them to a socket of the same kernel, as on namespace hosts, and its
// completions come at the same point: docs/perf.md.)
//
// With auth.data: mac (and a secret) every message also carries a 16-byte tag after its payload
// (daemon/transport/frame_mac.h) under its stream's keys from the handshake, made when the send is
// posted and checked when the payload is in; a message that fails fails the link.
//
// Each stream gets the configured TCP congestion control (tcp.congestion, default auto: cubic,
// or reno where the kernel does not let ringd set cubic: pick_congestion), from
// before it connects (prepare_socket, called by the control plane; see there why): a ring
// is a chain of flows that wait on one another, and a congestion control that keeps the queue at
// the bottleneck nearly empty (BBR's pacing and its periodic ProbeRTT drain) lets every short
// stall of one host idle the next link, where a loss-based one keeps a standing queue that rides
// it out (measured in the README's Performance section).
//
// Several rails (LinkSetup::rails): a rail that fails costs no message. Every payload message
// is acknowledged by the receiver (an empty ack frame on the same stream, cumulative per stream,
// one per batch of messages read), and its SendDone waits for that ack, so that its memory stays
// as it was until the peer has it. A stream that fails with an I/O error (the peer's kernel does
// not acknowledge its data for tcp.rail_timeout, TCP_USER_TIMEOUT; the peer closed it; reset)
// takes its rail down, not the link: the rail's streams are closed, and this end tells the peer,
// on a surviving rail, how many messages it read on each of them (a rail notice); the peer, on
// that notice, closes its streams of the rail too and answers with its own. Each end then sends
// again, on the surviving rails, every message of the rail that the other's notice does not
// count, and completes the ones it does, each where the ring would have posted it among those
// still queued, behind a resend mark on every surviving stream. Those already written stay ahead
// of it: from its rail_down until the peer's mark, each stream is read ahead of its receives into
// the link's memory (held), so that nothing can wait on them. A rail comes back when the
// control plane hands the link new connections for it (add_rail_streams); a link fails as before
// only when its last rail is down, or on a protocol error (bad frames, MACs).
//
// Non-blocking sockets driven by one epoll set; poll() is called by the progress thread only.
#pragma once

#include <array>
#include <chrono>
#include <deque>
#include <span>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "daemon/transport/transport.h"

namespace ringd {

class TcpTransport;

constexpr uint32_t kMaxLinkRails = kMaxRailsPerLink;
constexpr uint32_t kMaxLinkStreams = 256;  // of a link of several rails (config: tcp.streams x rails)

class TcpLink final : public Link {
public:
    // A stream's rail, the rail's weight and what waits to go out on it (its queue in ringd and
    // its socket's unsent and unacknowledged bytes).
    struct StreamLoad {
        uint32_t rail = 0;
        double weight = 1;
        uint64_t backlog = 0;
    };
    // The stream a message of `bytes` goes on, of streams with these loads: on the rail whose
    // backlog (all its streams') would be done first at its weight, that rail's least backlogged
    // stream; ties go to the rail, then the stream, met first going round from `first`.
    static size_t choose_stream(std::span<const StreamLoad> streams, uint64_t bytes, size_t first);
    TcpLink(TcpTransport &t, std::string peer);
    ~TcpLink() override;
    Status post_send(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) override;
    Status post_send_stable(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) override;
    bool delivered_at_send_done() const override { return false; }
    Status post_recv(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) override;
    bool can_cancel() const override { return true; }
    void set_floor(uint32_t op_tag) override;
    void cancel_receives(uint32_t op_tag) override;
    bool sending(uint32_t op_tag) const override;
    void fence(uint32_t op_tag) override;
    std::string describe() const override;
    // Several rails: new connections for rail r, once it is down and both ends have exchanged
    // their notices (rail_resynced), in the order of its old streams (the peer's are those of
    // the same indices). The rail carries messages again once it has as many as it had.
    Status add_rail_streams(uint32_t rail, std::vector<UniqueFd> fds, const std::vector<SessionKeys> &keys);
    bool rail_resynced(uint32_t rail) const {
        return rail < kMaxLinkRails && !rail_up(rail) && rail_state_[rail].sent_counts && rail_state_[rail].got_counts;
    }
    uint32_t rail_count() const { return rail_count_; }
    uint64_t held_bytes() const { return held_bytes_; }

private:
    static constexpr uint32_t kFlagTagged = 1;  // the message's tag follows its payload
    // Empty messages of the transport itself (fence()): a fence travels behind a cancelled op's
    // messages on every stream; the peer answers each with a fence ack on the same stream once it
    // has read it, so everything before it.
    static constexpr uint32_t kFlagFence = 2, kFlagFenceAck = 4;
    // Several rails only: an ack (its tag: the payload messages read on the stream so far), and a
    // rail notice (its tag: the rail, and the rail's epoch in the high half; its payload: a u64 per
    // stream of the rail, in order, the payload messages read on it).
    // And a resend mark (empty): sent on every stream that is up when resend() runs, ahead of what
    // goes again and of everything not yet written, so behind only what was written before; the
    // peer reads the stream ahead of its receives from its rail_down() until it has read the mark.
    static constexpr uint32_t kFlagAck = 8, kFlagRail = 16, kFlagMark = 32;
    static constexpr uint32_t kTransportFlags = kFlagFence | kFlagFenceAck | kFlagAck | kFlagRail | kFlagMark;
    friend class TcpTransport;
    static constexpr size_t kHeaderBytes = 24;
    struct SendOp {
        uint64_t tag = 0;
        const std::byte *data = nullptr;
        uint64_t bytes = 0;
        uint64_t done = 0;  // header + payload + tag bytes written
        uint8_t header[kHeaderBytes];
        Tag mac{};
        size_t mac_bytes = 0;  // kTagBytes when tagged
        int fd = -1;           // >= 0: the payload goes by reference, sendfile from fd at fd_offset
        uint64_t fd_offset = 0;
        bool transport_own = false;  // a fence, ack or notice: no SendDone
        // Its first byte is being written: its MAC (which numbers the stream's frames) and its
        // number are given then, not when it is queued, so that messages sent again can go ahead
        // of those queued (resend); a started one keeps its place.
        bool started = false;
        uint64_t seq = 0;            // several rails: the payload message's number on its stream
        std::vector<std::byte> owned;  // a notice's payload (`data` points into it)
    };
    // Stable sends of at least this go by reference (sendfile); smaller ones are not worth the
    // header's own system call.
    static constexpr uint64_t kZeroCopyMinBytes = 64 << 10;
    struct RecvOp {
        std::byte *data = nullptr;
        uint64_t bytes = 0;
    };
    struct Stream {
        TcpLink *link = nullptr;
        UniqueFd fd;
        uint32_t interest = 0;  // epoll events registered
        std::deque<SendOp> sendq;
        uint8_t header[kHeaderBytes];
        size_t header_got = 0;
        bool have_header = false;  // header complete, message not yet matched or not yet read
        uint64_t tag = 0, bytes = 0, got = 0;
        std::optional<RecvOp> cur;  // matched receive being filled
        SessionMac mac;             // enabled: every message is tagged, both ways
        Tag mac_in{};
        size_t mac_got = 0;
        int rcvlowat = 1;           // SO_RCVLOWAT as last set (see wake_at)
        // The message being read is dropped (set_floor, cancel_receives): `cur` points into
        // `scratch`, which holds all of it for the MAC check, and no RecvDone comes of it.
        bool discard = false;
        std::vector<std::byte> scratch;
        uint32_t in_flags = 0;  // the header flags of the message being read (fence, fence ack)
        uint32_t rail = 0;      // several rails (weighted_): its rail, and the rail's weight
        double weight = 1;
        // Several rails: payload messages queued on it so far (the next one's seq), those written
        // and not yet acknowledged (their SendDone waits for the ack), and payload messages read.
        uint64_t sent_seq = 0;
        std::deque<SendOp> inflight;
        uint64_t recvd = 0;
        bool ack_due = false;
        std::deque<uint32_t> fence_ops;  // fences sent on it whose acks are still to come (op tags)
        bool up() const { return static_cast<bool>(fd); }
        // The message being read is held (read before its receive was posted): into `hold`.
        bool holding = false;
        // Resend marks the peer has yet to send on it (one per rail_down() here while it was up):
        // until they are read, what comes before them may be ahead of a message sent again or of
        // the peer's notice.
        int32_t marks_due = 0;
        bool reading_ahead = false;  // held after hold_after, until a message it reads has a receive
        std::vector<std::byte> hold;
        std::chrono::steady_clock::time_point stalled_since{};  // its next message waits for a receive since
        std::chrono::steady_clock::time_point pending_since{};  // it has had something to send since (check_rails)
    };
    struct RailState {
        uint32_t epoch = 0;  // its connections so far, less one: notices name it
        bool sent_counts = false, got_counts = false;  // while down: the notices exchanged
        bool resent = false;                           // resend() ran for this failure
        std::vector<uint64_t> peer_counts;
        // This end's notice for its last failure, as sent (repeated as it was when the stream it
        // went on fails: the counts of the connections that failed, under their epoch).
        std::vector<uint64_t> my_counts;
        uint32_t notice_epoch = 0;
        int32_t notice_rail = -1;  // the rail of the stream it went on (-1: none)
        std::optional<std::vector<uint64_t>> early;  // a notice about its next connections
        std::vector<UniqueFd> pending;  // add_rail_streams before the notices were exchanged
        std::vector<SessionKeys> pending_keys;
        std::string why;  // why it went down
    };
    // A message read before its receive was posted (held).
    struct Held {
        std::vector<std::byte> data;
    };
    // A message sent again (or the peer's notice) may come behind messages already in a
    // surviving stream's socket (resend puts it ahead of those still queued at the peer, not of
    // those written): from a rail_down() until the peer's resend mark, a stream whose next message
    // has no receive is read ahead into the link's memory (held), a message per stream in turn.
    // That is at most what the sockets held when the peer resent: past kMaxHeldBytes it goes on
    // (logged), and past the larger of kMaxWantedBytes and twice the streams' socket buffers the
    // link fails, named, rather than waiting for the op's deadline. Apart from that, a stream
    // stalled for hold_after (200 ms) is read ahead up to kMaxHeldBytes, on a link of several
    // rails, so that a rail notice behind it cannot wait on it.
    static constexpr uint64_t kMaxHeldBytes = 64ull << 20;
    static constexpr uint64_t kMaxWantedBytes = 256ull << 20;
    // Starts holding the message `s` waits with, stalled since `s.stalled_since` (false: not a
    // payload message, neither ahead of a resend mark nor stalled long enough at `now`, or no room).
    bool try_hold(Stream &s, std::chrono::steady_clock::time_point now);
    // The streams' socket buffers, both ways (what they can hold when the peer resends).
    uint64_t socket_bytes() const;
    // Stalled streams that try_hold takes at `now`: held (TcpTransport::poll, rail_down).
    void hold_stalled(std::chrono::steady_clock::time_point now);
    // Streams with data on the wire that the peer's kernel has acknowledged nothing of for
    // tcp.rail_timeout (TCP_INFO): their rail is down (TcpTransport::poll, every 100 ms).
    void check_rails();
    // The stream a message of `bytes` goes on: in turn; with several rails, on the rail whose
    // backlog (its streams' queues here and their sockets' unsent and unacknowledged bytes) would
    // be done first at its weight, so that a slower rail gets fewer messages and every rail stays
    // busy to the end of an op, the stream of that rail with the least backlog.
    Stream &pick_stream(uint64_t bytes);
    bool weighted_ = false;
    // Queues a message on `s` (post(); fences and their acks: empty, with their flag).
    // at: its place in the queue (behind `at` messages; a started one stays first), else last.
    void enqueue(Stream &s, const std::byte *data, uint64_t bytes, uint64_t tag, uint32_t flags, int fd, uint64_t fd_offset,
                 std::vector<std::byte> owned = {}, size_t at = SIZE_MAX);
    // The next message on `s` is about to be written: its number and MAC.
    void start(Stream &s, SendOp &op);
    // Messages of cancelled ops larger than this fail the link instead of being read to drop
    // (a ring message is a chunk: tuning.chunk_bytes at most).
    static constexpr uint64_t kMaxDiscardBytes = 256ull << 20;

    Status add_stream(UniqueFd fd, const SessionKeys &keys);
    // Makes `fd` the stream's connection (non-blocking, its options, watched).
    Status attach(Stream &s, UniqueFd fd, const SessionKeys &keys);
    Status post(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag, bool by_reference);
    void on_event(Stream &s, uint32_t events);
    void write_some(Stream &s);
    void read_some(Stream &s);
    // One recv of up to `want` bytes at `at`, counted in `got`; false when nothing more can be read
    // now (EAGAIN) or the link failed (EOF, error).
    bool receive_into(Stream &s, void *at, size_t want, size_t &got);
    // Nothing more to read now and `want` bytes still to come that the peer has committed to (the
    // rest of a message): the stream reports readable only once that much, at most
    // kMaxWakeBytes, is in (SO_RCVLOWAT), not on every segment; 1 between messages.
    void wake_at(Stream &s, size_t want);
    static constexpr size_t kMaxWakeBytes = 256 << 10;
    void update_interest(Stream &s);
    void fail(int code, const std::string &why);
    // An I/O error on `s`: its rail goes down (several rails), or the link fails.
    void stream_failed(Stream &s, int code, const std::string &why);
    void rail_down(uint32_t rail, int code, const std::string &why);
    void send_notice(uint32_t rail);
    void on_notice(Stream &s, uint64_t tag, uint64_t bytes);
    // The peer's counts of rail r's messages (its notice): the rail goes down here too, and what
    // the peer does not have goes again.
    void counts_in(uint32_t rail, std::vector<uint64_t> counts);
    void resend(uint32_t rail);
    void maybe_attach(uint32_t rail);
    void on_ack(Stream &s, uint64_t count);
    // read_some's body; read_some sends the stream's ack after it.
    void read_messages(Stream &s);
    // Streams of rail r, in order.
    template <class F> void for_rail(uint32_t r, F f) {
        for (auto &sp : streams_)
            if (sp->rail == r) f(*sp);
    }
    bool dropped(uint64_t tag) const {
        const uint32_t op = static_cast<uint32_t>(tag >> 32);
        return has_floor_ && solo_tag(op) && solo_tag_before(op, floor_);
    }
    // The rest of the message the stream is in goes to its scratch (what came in already is
    // copied there from `cur`, for the MAC); false when it is too large (the link failed).
    bool start_discard(Stream &s);

    TcpTransport &t_;
    std::vector<std::unique_ptr<Stream>> streams_;
    size_t next_stream_ = 0;
    std::unordered_map<uint64_t, RecvOp> posted_;
    bool has_floor_ = false;
    uint32_t floor_ = 0;  // set_floor
    std::unordered_map<uint32_t, uint32_t> fences_;  // op tag -> fence acks still to come
    uint32_t rail_count_ = 1;
    std::array<RailState, kMaxLinkRails> rail_state_;
    uint64_t key_ = 0;
    std::atomic<uint64_t> *published_ = nullptr;  // LinkSetup::rail_state
    void publish();
    std::unordered_map<uint64_t, Held> held_;  // by tag
    uint64_t held_bytes_ = 0;
    bool hold_ = false;  // since a rail first went down
    bool held_past_ = false;  // held past kMaxHeldBytes (logged once each time)
    std::string late_congestion_;  // a stream connected under another congestion control, and what came of it ("": none)
};

class TcpTransport final : public NetworkTransport {
public:
    // congestion: the TCP congestion control for every stream; empty keeps the kernel's default.
    // data_mac: tag every message of a link whose connections have keys (auth.data: mac).
    // socket_buffer: every stream's SO_SNDBUF/SO_RCVBUF; 0 leaves them to the kernel's autotuning.
    // zero_copy: stable sends from regions with a file go by reference (tcp.zero_copy).
    // rail_timeout_ms: several rails' streams' TCP_USER_TIMEOUT (tcp.rail_timeout).
    explicit TcpTransport(std::string congestion = {}, bool data_mac = false, uint64_t socket_buffer = 0,
                          bool zero_copy = true, uint32_t rail_timeout_ms = 2000);
    std::string_view name() const override { return "tcp"; }
    std::string detail() const override;

    // Whether this process may give a TCP socket the congestion control `name` (it exists in the
    // kernel, and is allowed or the process has CAP_NET_ADMIN); the error says which and how to fix it.
    static Status check_congestion(const std::string &name);
    // tcp.congestion: auto: cubic when this process may set it, else reno (loss-based and unpaced
    // like cubic, and the kernel lets any process set it); `why` says why cubic was not taken.
    struct Pick {
        std::string name;
        std::string why;  // "" when cubic
    };
    static Pick pick_congestion();
    // Said in detail() after the congestion control's name (how auto chose it).
    void set_congestion_note(std::string note) { congestion_note_ = std::move(note); }
    // What the kernel makes of a fixed socket buffer of `bytes`: empty when it grants it, else
    // why it cuts it (net.core.wmem_max / rmem_max below it) and what to do.
    static std::string socket_buffer_cap(uint64_t bytes);
    // The congestion control a socket runs (TCP_CONGESTION), or "" when it has none (not TCP).
    static std::string congestion_of(int fd);
    // TCP posts read only the RegionHandle's address: any TcpTransport takes any other's handles.
    Result<std::unique_ptr<NetworkTransport>> sibling() override {
        auto t = std::make_unique<TcpTransport>(congestion_, data_mac_, socket_buffer_, zero_copy_, rail_timeout_ms_);
        t->set_congestion_note(congestion_note_);
        return std::unique_ptr<NetworkTransport>(std::move(t));
    }

    // Takes over connected sockets to `peer` as one link (>= 1 stream). They are made
    // non-blocking and TCP_NODELAY, with the socket buffers asked for (else the kernel's).
    // `keys`: one per stream, or empty (nothing tagged).
    Result<Link *> add_link(const std::string &peer, std::vector<UniqueFd> streams, const std::vector<SessionKeys> &keys = {},
                            const std::vector<uint32_t> &rails = {}, const std::vector<double> &weights = {},
                            uint64_t key = 0, std::atomic<uint64_t> *rail_state = nullptr);
    Result<std::vector<Link *>> add_links(std::vector<LinkSetup> links,
                                          std::chrono::steady_clock::time_point deadline) override;
    void remove_link(Link *link) override;
    // The congestion control, set before the socket connects or listens: BBR (often the system's
    // default) turns the kernel's internal pacing on when a connection starts, and a later switch
    // to cubic keeps it. A stream add_link finds connected under another one is logged (a
    // warning). Called on the control thread: it reads only what never changes after construction.
    // (An fq qdisc paces every TCP flow whatever its congestion control.)
    void prepare_socket(int fd) const override;

    Status poll(std::vector<LinkEvent> &out, int timeout_ms) override;
    int fd() const override { return epoll_.get(); }
    // How long a stream of a link of several rails waits for its next message's receive before
    // that message is read ahead into the link's memory (tests set it long, to keep a stream
    // unread).
    void set_hold_after(std::chrono::milliseconds d) { hold_after_ = d; }
    Status offer_rail_streams(uint64_t key, uint32_t rail, std::vector<UniqueFd> fds, std::vector<SessionKeys> keys) override;

protected:
    Result<RegionHandle> do_register(std::byte *base, size_t bytes) override;
    void do_deregister(RegionHandle h) override;

private:
    friend class TcpLink;
    void complete(LinkEvent e) { ready_.push_back(std::move(e)); }

    UniqueFd epoll_;
    std::string congestion_;
    std::string congestion_note_;
    bool data_mac_ = false;
    int socket_buffer_ = 0;
    bool zero_copy_ = true;
    uint32_t rail_timeout_ms_ = 2000;
    uint64_t next_region_ = 1;
    std::vector<std::unique_ptr<TcpLink>> links_;
    std::vector<LinkEvent> ready_;  // completions produced outside poll(), handed out by the next poll()
    std::chrono::steady_clock::time_point next_rail_check_{};
    std::chrono::milliseconds hold_after_{200};
    // offer_rail_streams: what other threads handed over, taken by poll() (woken by `offered_`, an
    // eventfd in the epoll set).
    struct Offer {
        uint64_t key = 0;
        uint32_t rail = 0;
        std::vector<UniqueFd> fds;
        std::vector<SessionKeys> keys;
    };
    std::mutex offers_mu_;
    std::vector<Offer> offers_;
    UniqueFd offered_;
    void take_offers();
};

}  // namespace ringd
