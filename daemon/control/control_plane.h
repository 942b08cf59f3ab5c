// ControlPlane: ringd's connections to the other hosts of its ring, on the control thread.
//
// Every pair of hosts keeps one authenticated control connection (the host earlier in ring
// order dials), carrying heartbeats and the control messages of the engine; each host dials
// `tcp.streams` data connections to its next host and accepts as many from its previous host.
// When all of them are up the ring is up: the generation counter advances and the data sockets
// are handed over (ring_up) to the progress thread's transport. Generations are agreed
// cluster-wide (proto/peer.h, RingReady / RingStart): a host whose links are up tells the
// coordinator (the first host), which starts the ring on every host as one generation once all
// are ready. Any failure — EOF, a link error reported back by the engine, missed heartbeats (a
// hung host), a peer that reconnects — takes the ring down (ring_down, with a reason naming the
// host; RingAbort carries it to the others) and everything re-forms by itself as the next
// generation once the hosts are back.
//
// Link states per peer, logged on change: connecting -> handshaking -> up -> failed.
// Connections from addresses not in `hosts`, with the wrong cluster/secret/version or bad
// frames are closed and logged with the reason.
#pragma once

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/fd_io.h"
#include "common/frame_reader.h"
#include "common/unique_fd.h"
#include "daemon/config.h"
#include "daemon/control/peer_handshake.h"

namespace ringd {

// A ring link's data connections, authenticated, with the keys of each (tagging their frames).
struct DataSockets {
    std::vector<UniqueFd> fds;
    std::vector<SessionKeys> keys;  // one per fd
    std::vector<uint32_t> rails;    // each fd's rail (HostEntry::rails)
    uint32_t peer = 0;              // mesh streams: the host (ring position) they go to
};

class ControlPlane {
public:
    // The callbacks run only from dispatch(), which the owner calls between its own steps, in
    // the order their events happened — never from inside on_ready(), tick(), send() or
    // data_link_failed(): a send that fails takes the ring down at once (ring_up() is false from
    // then on), but the owner hears of it only when it dispatches.
    struct Callbacks {
        // The ring is up as `generation`: sockets to the next host, and from the previous one,
        // with each one's frame keys (daemon/transport/frame_mac.h).
        // `mesh`: in a generation of protocol 12 on TCP, the data streams to each host that is not a
        // ring neighbour (ring order; none with 3 hosts or fewer), in the same stream order.
        std::function<void(uint64_t generation, DataSockets to_next, DataSockets from_prev, std::vector<DataSockets> mesh)> ring_up;
        // The ring generation is over; `why` names the host.
        std::function<void(const std::string &why)> ring_down;
        // A control frame from peer `host_index` (heartbeats included: they carry the sender's
        // idea of the generation, see heartbeat_now).
        // The callee may take the payload.
        std::function<void(uint32_t host_index, Frame &frame)> message;
        // The listening plane only (the whole ring's): whether a hello for another ring domain
        // may go on (the domain exists here or may be made: this host is among its hosts), and
        // the connection once its handshake is up, for that domain's plane (adopt()).
        std::function<Status(const proto::PeerHello &hello)> foreign_check;
        std::function<void(UniqueFd fd, const proto::PeerHello &hello, const std::string &ip, const SessionKeys &keys)> adopt;
        // Settings a data connection must have from its first packet (the transport's
        // NetworkTransport::prepare_socket): called on every data socket before it connects, and
        // on the listener before it listens, whose accepted connections inherit them.
        std::function<void(int fd)> prepare_socket;
        // Several rails: new connections for rail `rail` of lane `lane`'s link of `generation` to
        // the next host (to_next: this host dialed them) or from the previous one, replacing
        // those of a rail that failed (redial_rail).
        std::function<void(uint64_t generation, uint32_t lane, uint32_t rail, bool to_next, DataSockets sockets)> rail_streams;
    };

    struct PeerStatus {
        std::string name, address;
        uint16_t port = 0;
        bool self = false;
        std::string control;  // connecting | handshaking | up | failed | idle
        std::string last_error;
        double last_heard_s = -1;  // seconds ago, -1: never
        // Of its control connection (once up): the protocol version it runs at, the peer's config
        // version (from a ringd of 7 on), and whether the peer's host list differs from this host's.
        uint16_t protocol = 0;
        std::string config_version;
        bool hosts_differ = false;
    };

    // `config.hosts` are the hosts of this plane's ring domain (every configured host, or those
    // of a group over part of the ring) and `domain` their names as PeerHello carries them (""
    // for every host). Only the whole ring's plane listens (`listen`): a connection for another
    // domain is handed over, authenticated, through Callbacks::adopt.
    // `listener`: a socket that already listens on this host's port (the previous whole ring's,
    // handed over at a reload: see release_listener), used instead of binding a new one.
    static Result<std::unique_ptr<ControlPlane>> create(const Config &config, size_t self_index, const PeerSecret *secret,
                                                        Callbacks callbacks, std::string domain = {}, bool listen = true,
                                                        UniqueFd listener = {});
    // A reload that changes which hosts the whole ring has (Daemon::apply_hosts): the listening
    // plane gives up its listener for the next whole ring's, closing the connections it accepted
    // that are still in their handshake (their dialers dial again, and the new listener's plane
    // takes them); its up connections stay. take_listener: the other side of it.
    UniqueFd release_listener();
    Status take_listener(UniqueFd listener);
    // The domain's name in the hellos this plane sends from now on (its up connections stay), and
    // whether it hands other domains' connections over (the whole ring's: `foreign_check` and
    // `adopt` set) or not (empty functions). A whole ring that a reload made part of a bigger one
    // goes on under its hosts' names; a domain that a reload made the whole ring goes on as "".
    void rename(std::string domain, std::function<Status(const proto::PeerHello &)> foreign_check,
                std::function<void(UniqueFd, const proto::PeerHello &, const std::string &, const SessionKeys &)> adopt);
    // A connection for this domain that the listening plane accepted and authenticated; refused
    // (closed, logged) unless it is one this plane wants.
    void adopt(UniqueFd fd, const proto::PeerHello &hello, const std::string &ip, const SessionKeys &keys);
    const std::string &domain() const { return domain_; }
    // What handshakes say this host runs (proto/peer.h, version 7): the digest of its whole host
    // list and its config version (read at every handshake: a reload changes it).
    void set_identity(const proto::HostsDigest &hosts, const std::string *config_version, uint64_t instance) {
        hosts_digest_ = hosts;
        config_version_ = config_version;
        instance_ = instance;
    }
    // Every host's ringd instance as its last handshake said (this host's own; 0: unknown, a
    // ringd of 6), by host index.
    std::vector<uint64_t> instances() const;
    // The oldest protocol version of this host's up control connections (its own when none):
    // what this host can run a generation at, and what its RingReady says; and the peers whose
    // host list differs from this host's.
    uint16_t protocol() const;
    // What the running generation runs at: the oldest any of its hosts can, as the coordinator
    // decided it and its RingStart said (a coordinator of 8 says nothing: this host's own
    // protocol()). Algorithms, solo lanes and frame layouts follow it, alike on every host.
    uint16_t generation_protocol() const { return generation_protocol_; }
    // Whether the running generation runs compressed f32 allreduces as the exchange of shards: it
    // runs at protocol 13 or later and no host's wire.schedule says ring (its RingStart's flags).
    bool generation_exchange() const { return generation_exchange_; }
    std::vector<std::string> hosts_differ() const;
    // The hosts of this domain known to be down, each with what was last seen of it: no control
    // connection (since it ended, or since this plane's first tick) for kDownAfter and a dial to
    // it failed since (a host this one dials), or for three heartbeats (a host that dials this
    // one: it redials every half second). A live ringd dials or answers within that time; one that
    // does not cannot take part in an op.
    static constexpr auto kDownAfter = std::chrono::seconds(1);
    std::vector<std::pair<std::string, std::string>> hosts_down(Clock::time_point now) const;
    // Ring domains on this host: the cap on handshakes per source address scales with them.
    void set_domains(size_t n) { domains_ = std::max<size_t>(1, n); }
    ~ControlPlane();

    int fd() const { return epoll_.get(); }  // readable when on_ready() has work
    // Reads what came in; true when it queued an event for the owner (a heartbeat queues none).
    bool on_ready();
    // Runs the callbacks of the events queued since the last call, in order (including those of
    // events the callbacks cause). Returns whether there were any.
    bool dispatch();
    // Dials, retries, heartbeats and deadlines; call every ~100 ms.
    void tick(Clock::time_point now);
    // The engine found a data link broken: the generation is over. The abort waits a moment
    // for a peer's RingAbort, whose reason names the host that caused it.
    // `seen_here`: the failure's cause was found on this host (bad bytes received): the ring
    // ends at once with this reason.
    void data_link_failed(const std::string &why, bool seen_here = false);
    // Several rails: rail `rail` of lane `lane`'s link to the next host failed and both ends have
    // said what they had of it: its connections are dialed anew (at most one dial at a time per
    // stream, again kRedial after one fails) and handed over through Callbacks::rail_streams.
    void redial_rail(uint32_t lane, uint32_t rail, Clock::time_point now);
    uint32_t rails() const { return rails_; }
    // Queues what the socket does not take at once (small ops carry data); a peer that lets
    // more than kMaxBacklog pile up is not keeping up and fails. The frame is sealed (MAC) and
    // queued as it is, not copied: hand a large one over with std::move.
    Status send(uint32_t host_index, proto::Bytes frame);
    static constexpr uint64_t kMaxBacklog = 256ull << 20;
    // Bytes queued for `host_index` that its socket has not taken yet.
    uint64_t queued_bytes(uint32_t host_index) const;
    // The control connection's socket to `host_index`, or -1 (what it runs: tests).
    int control_fd(uint32_t host_index) const;
    // Sends a heartbeat carrying `generation` to every peer now, and in every later heartbeat
    // (the coordinator announces the generation the hosts report ops in).
    void heartbeat_now(uint64_t generation);
    void set_heartbeat_generation(uint64_t generation) { heartbeat_generation_ = generation; }

    bool ring_up() const { return ring_up_; }
    uint64_t generation() const { return generation_; }
    // Handshakes and RingReady announce the newest generation a host has seen (its own, a
    // peer's, an aborted one), and the coordinator starts the next ring past every one announced,
    // so that a coordinator that restarts (counting from 0 again) forms a ring newer than any
    // generation the others have used.
    uint64_t announced_generation() const { return std::max({generation_, peer_generation_max_, aborted_max_}); }
    // The newest generation this host saw before it started (kept across restarts, Daemon): it
    // is announced as a peer's would be, so that a ring whose every host restarted still forms
    // past every generation it ran before.
    void seed_generation(uint64_t g) { peer_generation_max_ = std::max(peer_generation_max_, g); }
    uint32_t self_index() const { return self_; }
    std::vector<PeerStatus> status() const;
    uint64_t handshakes_refused() const { return handshakes_refused_; }
    uint64_t frames_rejected() const { return frames_rejected_; }

private:
    enum class ConnState { Connecting, Handshaking, Up };
    struct Conn {
        uint64_t id = 0;
        bool dialer = false;
        uint32_t peer = 0;  // known from the start when dialing, from the hello when accepting
        proto::ConnKind kind = proto::ConnKind::Control;
        uint32_t stream = 0;
        bool rejoin = false;  // a data stream replacing one of a failed rail (proto::kRejoinStream)
        ConnState state = ConnState::Connecting;
        UniqueFd fd;                         // Connecting, Up
        std::optional<PeerHandshake> hs;     // Handshaking (owns the socket)
        FrameReader reader;                  // Up control connections
        SessionKeys keys;                    // from the handshake (Up)
        SessionMac mac;                      // Up control connections: every frame tagged
        std::deque<proto::Bytes> outq;       // frames the socket did not take yet (Up control)
        size_t out_off = 0;                  // of outq.front()
        uint64_t out_bytes = 0;
        Clock::time_point deadline;
        std::string remote;                  // address:port, for logs
        // Several rails (control): every frame sent (unsealed, its number on the connection and
        // where it ends in the bytes written), kept until the peer's kernel has acknowledged it
        // (SIOCOUTQ): what may go again on the next connection when this one's rail fails; and
        // the frames read on it.
        struct Logged {
            uint64_t index = 0, end = 0;
            proto::Bytes frame;
        };
        std::deque<Logged> sent_log;
        uint64_t frames_out = 0, frames_in = 0;
        uint64_t logged_bytes = 0;   // sealed bytes of the frames logged
        uint64_t written_bytes = 0;  // bytes written to the socket (Up)
    };
    struct Peer {
        HostEntry host;
        uint64_t control = 0;  // conn id when up
        bool dialing = false;
        std::string state = "idle";
        std::string last_error;
        Clock::time_point last_heard{}, next_dial{};
        uint64_t heartbeat_seq = 0;
        // The version to dial it at: the newest, until it refused a hello of it in an Error frame
        // (an older ringd); the newest again once a connection to it failed or its control
        // connection ended (it may come back upgraded or restarted).
        uint16_t speaks = proto::kPeerProtocolVersion;
        uint16_t protocol = 0;  // its control connection's, once up
        std::string config_version;
        bool hosts_differ = false;
        Clock::time_point down_since{};  // without a control connection since ({}: not yet looked)
        uint64_t instance = 0;
        // Several rails: the rail its control connection runs on, and while that connection is
        // being moved to another rail (it failed with the ring up): until when the ring waits
        // for it, why it failed, and the frames sent meanwhile (unsealed, in order).
        uint32_t control_rail = 0;
        Clock::time_point failover_until{};
        std::string failover_why;
        std::deque<proto::Bytes> held;
        uint64_t held_bytes = 0;
        // The connection it replaced: the frames read from it, and those sent on it the peer's
        // kernel may not have had (its log), until the peer's ControlResume says what it read;
        // frames sent meanwhile wait in `held` (resume_pending, at most until resume_deadline).
        uint64_t prev_frames_in = 0;
        std::deque<Conn::Logged> prev_log;
        bool resume_pending = false;
        Clock::time_point resume_deadline{};
    };
    // What the peer said it runs, from its handshake.
    struct PeerRuns {
        uint16_t version = 0;
        proto::HostsDigest hosts{};
        std::string config_version;
        uint64_t instance = 0;
    };
    PeerIdentity identity() const;

    ControlPlane() = default;
    Status listen();
    Status check_runs_on(const proto::PeerHello &h) const;
    void accept_all();
    void dial(uint32_t peer, proto::ConnKind kind, uint32_t stream, bool rejoin = false);
    // A rejoining stream is up: once every stream of its lane and rail is, they are handed over.
    void maybe_rail_up(uint32_t stream, bool to_next);
    void close_rejoins();
    void on_conn(uint64_t id, uint32_t events);
    void promote(Conn &c);
    void promote_up(Conn &c, const proto::PeerHello &h, uint64_t peer_generation, const PeerRuns &runs);
    // `local`: the address of this host the connection came in on (several rails: it must be the
    // rail's own; "" skips that check).
    Status check_hello(const proto::PeerHello &h, const std::string &ip, const std::string &local = {}) const;
    void close_conn(uint64_t id);
    bool flush(Conn &c);  // false: the connection failed
    // Writes the control connections' queues until they are empty or `deadline` passes, waiting
    // on the sockets (the control thread blocks meanwhile: for an abort only).
    void flush_all(Clock::time_point deadline);
    Status send_bytes(uint32_t host_index, Conn &c, proto::Bytes frame);  // as on the wire
    void conn_failed(uint64_t id, const std::string &why);
    void peer_failed(uint32_t peer, const std::string &why);
    // The control connection to `peer` failed by I/O (closed, reset, unreachable, silent): with
    // several rails and the ring up it moves to another rail and the ring runs on (failover_until);
    // else, or when it cannot, peer_failed.
    void control_lost(uint32_t peer, const std::string &why);
    // Reads the control frames on `c` (draining: a connection being replaced, whose complete
    // frames are taken before the next one's, and whose errors end the reading only).
    void read_control(Conn &c, bool draining);
    // A control connection being replaced by one on another rail: what it received is read, and
    // what it sent that the peer's kernel has not acknowledged goes ahead of the peer's held frames.
    void salvage(Peer &p, Conn &c);
    void trim_sent_log(Conn &c);
    // send() but for the hold of a moving control connection.
    Status send_now(uint32_t host_index, proto::Bytes frame);
    // The peer's ControlResume: what it did not read of the old connection goes again, then
    // what was held.
    void on_control_resume(uint32_t peer, uint64_t frames);
    void end_resume(Peer &p);  // the ring is over: held frames go as they are, the old log is dropped
    void abort_ring(const std::string &why, bool tell_peers = true);
    void maybe_ring_up();
    // `mesh`: the mesh streams count (not for a generation below 12, which does not use them).
    bool links_up(bool mesh = true) const;
    void tell_ready();
    void on_ring_ready(uint32_t peer, const proto::RingReady &r);
    void maybe_start();
    void on_ring_start(uint64_t generation, uint16_t protocol, uint16_t flags);
    void on_ring_abort(const proto::RingAbort &a);
    void send_to_all(const proto::Bytes &frame);
    void set_state(uint32_t peer, const std::string &state);
    Status watch(int fd, uint64_t id, uint32_t events);
    std::string label() const { return domain_.empty() ? std::string() : "ring domain " + domain_ + ": "; }
    uint32_t next() const { return (self_ + 1) % n_; }
    uint32_t prev() const { return (self_ + n_ - 1) % n_; }
    // Whether this host and `peer` keep mesh data streams (protocol 12, TCP): they are not ring
    // neighbours and their control connection runs at 12 or later. The one earlier in ring order dials.
    bool mesh_with(uint32_t peer) const;
    uint64_t &mesh_stream(uint32_t peer, uint32_t stream);  // mesh_'s entry (made on first use)

    Config config_;
    std::string domain_;
    size_t domains_ = 1;
    uint32_t self_ = 0, n_ = 1;
    uint32_t rails_ = 1;  // TCP: the addresses (NICs) per host
    // Data stream s's rail (ordering: lanes, then rails, then tcp.streams).
    uint32_t per_rail() const { return config_.transport == "tcp" ? config_.tcp.streams : 1; }
    uint32_t rail_of(uint32_t stream) const { return (stream / per_rail()) % rails_; }
    uint32_t lane_of(uint32_t stream) const { return stream / (per_rail() * rails_); }
    const PeerSecret *secret_ = nullptr;
    PeerSecret no_secret_;
    Callbacks cb_;
    struct Event {
        enum class Kind { RingUp, RingDown, Message, Adopt, RailStreams } kind = Kind::Message;
        uint32_t lane = 0, rail = 0;  // RailStreams (to_next: in `to_next`, else in `from_prev`)
        bool outgoing = false;
        uint64_t generation = 0;
        DataSockets to_next, from_prev;
        std::vector<DataSockets> mesh;  // RingUp
        std::string why;
        uint32_t host = 0;
        Frame frame;
        UniqueFd fd;  // Adopt
        proto::PeerHello hello;
        SessionKeys keys;  // Adopt
    };
    std::deque<Event> events_;
    bool dispatching_ = false;
    UniqueFd epoll_;
    UniqueFd listener_;
    std::vector<Peer> peers_;
    std::map<uint64_t, std::unique_ptr<Conn>> conns_;
    uint64_t next_conn_id_ = 1;
    std::vector<uint64_t> data_out_, data_in_;  // conn ids by stream, 0 = none
    // Mesh data streams by peer (ring position), then stream (as data_out_'s), conn ids, 0 = none:
    // dialed to later hosts, accepted from earlier ones.
    std::map<uint32_t, std::vector<uint64_t>> mesh_;
    std::map<uint32_t, uint64_t> rejoin_out_, rejoin_in_;  // rejoining streams' conn ids, by stream
    std::map<uint32_t, Clock::time_point> rejoin_next_dial_;  // by stream, after a failed one
    uint64_t handshakes_refused_ = 0;            // handshaking connections closed by the cap
    uint64_t frames_rejected_ = 0;               // control frames that failed their MAC check
    Clock::time_point last_refusal_log_{};
    Clock::time_point next_data_dial_{};
    bool ring_up_ = false;
    uint64_t generation_ = 0;
    proto::HostsDigest hosts_digest_{};
    const std::string *config_version_ = nullptr;
    uint64_t instance_ = 0;
    uint64_t peer_generation_max_ = 0;  // the highest generation a peer's handshake announced
    uint64_t aborted_max_ = 0;          // the newest generation known to be over
    bool links_ready_ = false;          // the coordinator was told this host's links are up
    Clock::time_point next_ready_{};    // RingReady is repeated while the ring forms
    std::vector<uint8_t> peer_ready_;   // coordinator: which hosts' links are up
    std::vector<uint64_t> peer_seen_;   // coordinator: the newest generation each host saw
    std::vector<uint16_t> peer_protocol_;  // coordinator: the protocol each host can run (RingReady)
    std::vector<uint16_t> peer_flags_;     // coordinator: each host's RingReady flags
    uint16_t generation_protocol_ = 0;     // the running generation's, as its RingStart said
    bool generation_exchange_ = false;     // generation_exchange()
    Clock::time_point next_heartbeat_{};
    uint64_t heartbeat_generation_ = 0;
    std::optional<std::pair<Clock::time_point, std::string>> pending_link_failure_;
    std::map<std::string, Clock::time_point> recent_failures_;  // connection failures last logged
};

}  // namespace ringd
