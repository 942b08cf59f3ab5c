// ClientConn: the daemon's side of one Unix-socket connection (a trainer, or ringctl asking for
// status). Reads frames without blocking and with a length cap checked before allocation; after
// the join it owns the client's slot and eventfds and moves descriptors between the slot's
// queues and the daemon, trusting nothing the client wrote.
//
// Called by the control thread only.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/frame_reader.h"
#include "common/unique_fd.h"
#include "daemon/engine/group_table.h"
#include "proto/frame.h"
#include "proto/slot.h"

namespace ringd {

class Slot;

class ClientConn {
public:
    enum class State { Handshake, Joined, Closing };

    ClientConn(MemberId id, UniqueFd sock, ucred cred, Clock::time_point hello_deadline);

    MemberId id() const { return id_; }
    int sock() const { return sock_.get(); }
    const ucred &cred() const { return cred_; }
    State state() const { return state_; }
    Clock::time_point hello_deadline() const { return hello_deadline_; }
    std::string describe() const;  // "client 3 (pid 123 uid 0) group g rank 1"

    // Reads what the socket has. Returns a complete frame, nullopt when more bytes are needed
    // (EAGAIN), or an error: EOF, I/O error, fds sent to us, a bad or oversize header.
    Result<std::optional<Frame>> read_frame();

    // Moves to Joined with its slot and eventfds.
    // `lease` counts the slot's data area among the host's slots while any client uses it (it
    // points at the data area's Slot: the same for every client sharing it).
    void joined(std::shared_ptr<Slot> slot, UniqueFd doorbell, UniqueFd completion, std::string group,
                uint32_t local_rank, std::shared_ptr<void> lease);
    void closing() { state_ = State::Closing; }

    const std::shared_ptr<Slot> &slot() const { return slot_; }
    const std::shared_ptr<void> &slot_lease() const { return lease_; }
    int doorbell_fd() const { return doorbell_.get(); }
    int completion_fd() const { return completion_.get(); }
    const std::string &group() const { return group_; }
    uint32_t local_rank() const { return local_rank_; }

    // Copies out the descriptors the client published since the last call, as far as its credits
    // go: it may have at most its completion-queue depth of ops taken and not yet completed, so
    // what a client makes ringd hold is bounded by its queues, not by how fast it writes. The rest
    // stay in the queue (submissions_held()) until completions free credits. An error means the
    // queue indices are corrupt (the client must be dropped).
    Status take_submissions(std::vector<proto::SubmitDesc> &out);
    // Descriptors are waiting in the submission queue for credits.
    bool submissions_held() const { return held_; }
    // Sequence number the next submission must carry; advanced by accept_seq().
    uint64_t expected_seq() const { return next_seq_; }
    void accept_seq() { ++next_seq_; }

    // Writes a completion and rings the completion eventfd. Error: the client stopped consuming
    // its completion queue (it must be dropped).
    Status complete(uint64_t seq, int32_t status, std::string_view message);

private:
    MemberId id_;
    UniqueFd sock_;
    ucred cred_;
    State state_ = State::Handshake;
    Clock::time_point hello_deadline_;
    FrameReader reader_;

    std::shared_ptr<Slot> slot_;
    std::shared_ptr<void> lease_;
    UniqueFd doorbell_;
    UniqueFd completion_;
    std::string group_;
    uint32_t local_rank_ = 0;
    uint64_t sq_head_ = 0;  // authoritative copies; the ones in shared memory are advisory
    uint64_t cq_tail_ = 0;
    uint64_t next_seq_ = 1;
    bool held_ = false;
};

}  // namespace ringd
