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
#include <optional>
#include <string>

#include "common/frame_reader.h"
#include "common/unique_fd.h"
#include "daemon/control/peer_auth.h"

namespace ringd {

struct PeerIdentity {
    std::string cluster;
    std::string self;  // this host's name
    uint64_t generation = 0;
    const PeerSecret *secret = nullptr;
    std::string domain;  // the ring domain a dialer connects for (proto::PeerHello::domain)
};

class PeerHandshake {
public:
    enum class State { WaitChallenge, WaitAccept, WaitHello, WaitAuth, Up, Failed };
    // Listener's check of a hello (configured host? expected address? wanted connection?).
    using HelloCheck = std::function<Status(const proto::PeerHello &)>;

    // Sends the hello at once (the socket is fresh, so this does not block).
    static PeerHandshake dial(UniqueFd fd, const PeerIdentity &me, const std::string &peer, proto::ConnKind kind,
                              uint32_t stream);
    static PeerHandshake listen(UniqueFd fd, const PeerIdentity &me, HelloCheck check);

    // Reads what the socket has and moves on. Returns the state afterwards; Failed comes with
    // error() set.
    State advance();
    State state() const { return state_; }
    const Error &error() const { return error_; }
    int fd() const { return fd_.get(); }
    const proto::PeerHello &hello() const { return hello_; }  // valid once Up (both roles)
    uint64_t peer_generation() const { return peer_generation_; }
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
    HelloCheck check_;
    bool dialer_ = false;
    State state_ = State::Failed;
    Error error_;
    FrameReader reader_;
    proto::PeerHello hello_;
    proto::Bytes hello_payload_;  // exact bytes the MACs cover
    proto::Nonce nonce_l_{};
    uint64_t peer_generation_ = 0;
};

const char *handshake_state_name(PeerHandshake::State s);

}  // namespace ringd
