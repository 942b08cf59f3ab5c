// ClientGateway: the daemon's face to the trainers on this host (control thread). It owns the
// Unix socket and every client connection: it checks who connects (SO_PEERCRED against the
// allowlists), joins a trainer to its group (hello -> a slot registered with the transport and two
// eventfds), takes descriptors from a client's submission queue while the client has credits
// (its ops in ringd stay below its completion-queue depth), validates them and hands them to the
// group table, and writes completions back. Everything a client sends is checked here; one that
// misbehaves is answered with an error and dropped, and nothing of the others is lost.
//
// Its results go to the owner's queues (done: completions, ready: ops every local rank
// submitted), which the owner applies between events (Daemon::settle); it never calls back.
#pragma once

#include <deque>
#include <functional>
#include <sys/types.h>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/config.h"
#include "daemon/engine/group_table.h"
#include "daemon/ipc/client_conn.h"
#include "daemon/transport/transport.h"

namespace ringd {

class Slot;
class CudaService;

class ClientGateway {
public:
    // ringctl drain: the host takes no new groups (joins that would start one are refused, naming
    // the drain); groups running here go on.
    bool drained() const { return drained_; }
    // This host's index in the config's host list (a reload may move it).
    void set_self(uint32_t self) { self_ = self; }
    struct Hooks {
        // Watch fd for input; `doorbell` tells a client's doorbell from its socket.
        std::function<Status(int fd, MemberId id, bool doorbell)> watch;
        std::function<void(int fd)> unwatch;
        std::function<std::string(uint32_t viewer_uid)> status_json;  // the document ringctl asks for
        std::function<void(const std::string &by)> reload;            // ringctl reload (as SIGHUP)
        std::function<void(const std::string &)> record_error;
        // Before a group's first join here: its hosts' ring domain exists, or why it cannot.
        std::function<Status(const std::vector<uint32_t> &hosts)> open_domain;
        // Before a trainer is welcomed: the local failures so far go to the ring domains (a run
        // of its group that ended here is withdrawn before a new one can be agreed).
        std::function<void()> before_welcome;
        // The NUMA node for a trainer's slot (process `pid`), and why; -1: no placement.
        std::function<int(pid_t pid, std::string &why)> slot_node;
    };

    // `cuda`: the trainers' device memory, or null with `no_cuda` saying why there is none.
    ClientGateway(const Config &config, uint32_t self_index, NetworkTransport &transport, GroupTable &groups,
                  CudaService *cuda, std::string no_cuda, Hooks hooks, std::vector<Completion> &done,
                  std::vector<OpRun> &ready);

    Status listen();
    int listener_fd() const { return listener_.get(); }
    void on_accept();
    void on_readable(MemberId id);
    void on_doorbell(MemberId id);
    // Hellos that did not come in time.
    void expire(Clock::time_point now);
    // Completions to their clients. Returns whether there were any. A device-buffer op that
    // succeeded is held until its result is back in the device buffer (stage-out).
    bool complete(const std::vector<Completion> &completions);
    // Stage events of device-buffer ops (CudaService::event_fd readable).
    void on_cuda_events();
    // Submissions that waited for credits, taken now that completions freed them. Returns
    // whether there were any.
    bool take_held_submissions();
    // The slots of an op's local ranks; false if one of them left after the op was matched (its
    // group fails the op then, GroupTable::leave, whatever status finished() is given).
    bool slots_of(const OpRun &run, std::vector<std::shared_ptr<Slot>> &slots) const;
    // Shutdown: submissions not taken yet are answered (ESHUTDOWN), the socket goes away.
    void begin_shutdown();
    void close_all() { clients_.clear(); }

    size_t connected() const { return clients_.size(); }
    // The bytes the clients say they copied into and out of their slots for ops (SlotHeader's
    // copy counters: those connected now, and those gone).
    std::pair<uint64_t, uint64_t> copies() const;
    // Where each joined client's slot lies (Hooks::slot_node), for `ringctl topology`.
    struct SlotPlace {
        std::string group;
        uint32_t local_rank = 0;
        pid_t pid = 0;
        int node = -1;
        std::string why;
    };
    std::vector<SlotPlace> slot_places() const;
    size_t joined() const { return *live_slots_; }

private:
    void handle_hello(ClientConn &c, const proto::Hello &h);
    void handle_cuda_frame(ClientConn &c, Frame &frame);
    void take_submissions(MemberId id);
    // A client's submissions behind a device-buffer op still in stage-in go on in order: ops
    // whose stage-in is done (and every later slot op) to the group table, failed ones rejected.
    void pump(MemberId id);
    // Answers to unregistrations that waited for their mapping to close.
    void send_late_replies();
    void drop(MemberId id, const Error &why, bool tell_client);
    // Connections (joined_only: slots) of clients with this uid.
    size_t count_of(uint32_t uid, bool slots) const;

    const Config &config_;
    uint32_t self_;  // this host's index in config_.hosts
    Clock::time_point last_limit_log_{};
    NetworkTransport &transport_;
    GroupTable &groups_;
    CudaService *cuda_;
    const std::string no_cuda_;
    // Per client, its submissions from the first one still in stage-in on (absent: none).
    struct Staged {
        proto::Submission s;
        Clock::time_point accepted;
        enum State : uint8_t { Waiting, Ready, Failed } state = Ready;
        bool timed_out = false;  // its buffer was never marked ready: it fails once staged
        Error error{};
        bool refused = false;  // Failed: the rank refused the op (proto::refusal), error says why
    };
    std::map<MemberId, std::deque<Staged>> staging_;
    Hooks hooks_;
    std::vector<Completion> &done_;
    std::vector<OpRun> &ready_;
    UniqueFd listener_;
    UniqueFd spare_fd_;  // released to accept-and-close when the fd limit is hit
    std::map<MemberId, std::unique_ptr<ClientConn>> clients_;
    MemberId next_id_ = 1;
    // Slots (data areas) held: each joined client's own, counted until the last client using it
    // (HelloShared) is gone (ClientConn::slot_lease).
    std::shared_ptr<size_t> live_slots_ = std::make_shared<size_t>(0);
    uint64_t copied_in_gone_ = 0, copied_out_gone_ = 0;  // counters of clients that left
    bool shutting_down_ = false;
    bool drained_ = false;  // ringctl drain: no new groups here
    std::set<MemberId> credit_waiters_;  // clients whose submissions wait for credits freed by completions
    std::set<std::string> clamp_told_;  // group/timeout pairs whose clamp to timeouts.op_max was logged
};

}  // namespace ringd
