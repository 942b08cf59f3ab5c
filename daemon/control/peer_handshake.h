// PeerHandshake: the authenticated, versioned handshake (proto/peer.h) on one new connection
// between daemons, as a small state machine driven by socket readability — the control thread
// runs many at once and never blocks on one.
//
//   dialer:   SendHello -> WaitChallenge -> WaitAccept -> Up
//   listener: WaitHello -> WaitAuth -> Up
// Any failure ends it with an error that says why (wrong cluster, unknown host, bad secret,
// version, malformed frame); the caller closes the socket and logs the reason.
#pragma once

#include <functional>
#include <vector>
#include <optional>
#include <string>

#include "common/frame_reader.h"
#include "common/unique_fd.h"
#include "daemon/config.h"
#include "daemon/control/peer_auth.h"

namespace ringd {

struct PeerIdentity {
    std::string cluster;
    std::string self;  // this host's name
    uint64_t generation = 0;
    const PeerSecret *secret = nullptr;
    std::string domain;  // the ring domain a dialer connects for (proto::PeerHello::domain)
    // What this host runs (version 7 handshakes carry it): its host list's digest and its config version.
    proto::HostsDigest hosts{};
    std::string config_version{};
    uint64_t instance = 0;  // this ringd process's (random at start)
};

// The digest of a host list as handshakes carry it: SHA-256 of every host's name, address and
// port in ring order, its first 8 bytes. Hosts whose lists differ cannot form one ring.
proto::HostsDigest hosts_digest(const std::vector<HostEntry> &hosts);

class PeerHandshake {
public:
    enum class State { WaitChallenge, WaitAccept, WaitHello, WaitAuth, Up, Failed };
    // Listener's check of a hello (configured host? expected address? wanted connection?).
    using HelloCheck = std::function<Status(const proto::PeerHello &)>;

    // Sends the hello at once (the socket is fresh, so this does not block).
    // `version`: the hello's (the newest this host speaks, or an older one a peer is known to
    // speak at most). A listener that does not speak it refuses it in an Error frame: the
    // handshake fails with -EPROTONOSUPPORT and refused_version().
    static PeerHandshake dial(UniqueFd fd, const PeerIdentity &me, const std::string &peer, proto::ConnKind kind,
                              uint32_t stream, uint16_t version = proto::kPeerProtocolVersion);
    // `check`: whether the hello may go on, before the dialer proves anything; `authenticated`:
    // once it proved the secret (a refusal that depends on what the hello says of the dialer's
    // state: a stranger learns nothing from it, and cannot cause it).
    static PeerHandshake listen(UniqueFd fd, const PeerIdentity &me, HelloCheck check, HelloCheck authenticated = {});

    // Reads what the socket has and moves on. Returns the state afterwards; Failed comes with
    // error() set.
    State advance();
    State state() const { return state_; }
    const Error &error() const { return error_; }
    int fd() const { return fd_.get(); }
    const proto::PeerHello &hello() const { return hello_; }  // valid once Up (both roles)
    uint64_t peer_generation() const { return peer_generation_; }
    // Once Up: the version the connection runs at, and what the peer said it runs (version 7;
    // empty/zero from a ringd of 6).
    uint16_t version() const { return hello_.version; }
    const proto::HostsDigest &peer_hosts() const { return peer_hosts_; }
    const std::string &peer_config_version() const { return peer_config_version_; }
    uint64_t peer_instance() const { return peer_instance_; }
    // Failed because the peer said, in an Error frame, that it does not speak the hello's version:
    // the one answer that tells a dialer to try an older one. A connection closed or reset at
    // the hello says nothing of the peer's version (a host being killed or restarted does that).
    bool refused_version() const { return refused_version_; }
    UniqueFd take_fd() { return std::move(fd_); }
    // What the reader holds beyond the handshake (a listener may send right after its accept):
    // the connection's reader takes it over.
    FrameReader take_reader() { return std::move(reader_); }
    // This end's keys for the frames after the handshake (disabled without a secret); once Up.
    SessionKeys keys() const;

private:
    PeerHandshake(UniqueFd fd, const PeerIdentity &me) : fd_(std::move(fd)), me_(me) {}
    State fail(int code, std::string why);
    State on_frame(const Frame &f);

    UniqueFd fd_;
    PeerIdentity me_;
    HelloCheck check_, authenticated_;
    bool dialer_ = false;
    State state_ = State::Failed;
    Error error_;
    FrameReader reader_;
    proto::PeerHello hello_;
    proto::Bytes hello_payload_;  // exact bytes the MACs cover
    proto::Nonce nonce_l_{};
    uint64_t peer_generation_ = 0;
    int which_ = 0;      // the secret the handshake proved (PeerSecret: 0, or 1 the previous one)
    PeerSecret chosen_;  // that secret alone (none without auth)
    proto::HostsDigest peer_hosts_{};
    std::string peer_config_version_;
    uint64_t peer_instance_ = 0;
    bool refused_version_ = false;
};

const char *handshake_state_name(PeerHandshake::State s);

}  // namespace ringd
