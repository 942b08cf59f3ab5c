// RingDomain: the hosts of one host set working as a ring, on the control thread — every
// configured host (the whole ring, always there), or the hosts of a group over part of it
// (made when a group over that set first joins here, or a host of it dials in for it).
//
// A domain has everything a ring needs, for its hosts only: its control plane (connections,
// heartbeats, generations; only the whole ring's plane listens and hands the other domains'
// connections over), its coordinator (its first host in ring order), its ops (HostOps) and their
// reports, incarnations and direct exchange, its own data links and progress threads, one per
// lane (tuning.lanes; each on a sibling of the daemon's transport: one registration of a slot
// serves every domain). So a host outside a
// domain never sees its frames, a member's failure ends that domain's generation only, and the
// ring ops of different domains run at the same time, each on its own links, sharing the network
// as their TCP flows (or QPs) do. Within a domain each group runs in a lane the coordinator gives
// it, so groups of the same hosts run side by side too; within a lane ring ops run one at a time,
// in the coordinator's order (OpStart) on a shared lane, in the group's seq order on a solo lane,
// where every host starts them by itself and the coordinator hears of one only when it stalls
// (start_solo; docs/design.md, Ring domains).
//
// An op of a group goes: ready on this host (all local ranks submitted it) -> once the hosts
// agreed on the group's incarnation in this generation (GroupJoin / GroupIncarnation, see
// proto/peer.h), reported to the coordinator as (group, incarnation, seq) -> OpStart (run it in
// the ring, in the coordinator's order) or OpFail (every rank gets the coordinator's message).
// Ops that fail on this host before they are ready are reported too, and so is the end of a
// local incarnation (its ranks left), so that the other hosts' ranks fail at once. When a
// generation ends, every op that is ready here fails with the reason and the incarnations are
// agreed again in the next one (a job that goes on keeps its incarnation; one that restarted
// everywhere gets a new one; one that restarted on some hosts only is refused).
//
// Small ops (daemon/engine/tuner.h) go by direct exchange instead: the report travels to every
// host with this host's contribution (OpData), and each host completes the op itself once every
// host's contribution is in, reducing them in ring order (so every host gets the same bits). The
// coordinator sees the same reports and fails the op with OpFail when something is wrong.
#pragma once

#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "daemon/config.h"
#include "daemon/control/control_plane.h"
#include "daemon/control/peer_auth.h"
#include "daemon/engine/coordinator.h"
#include "daemon/engine/group_table.h"
#include "daemon/engine/progress.h"
#include "daemon/exchange/direct_exchange.h"
#include "daemon/ops/host_ops.h"
#include "daemon/topology/topology.h"
#include "daemon/transport/transport.h"

namespace ringd {

class ClientGateway;

class RingDomain {
public:
    // The daemon's, shared by every domain (control thread).
    struct Shared {
        const Config *config = nullptr;  // every configured host
        std::string host;
        GroupTable *groups = nullptr;
        std::vector<Completion> *done = nullptr;
        ClientGateway *gateway = nullptr;  // set once it exists, before any op
        const PeerSecret *secret = nullptr;
        NetworkTransport *transport = nullptr;  // the daemon's: the whole ring's links, and slots' registrations
        std::function<void(const std::string &)> record_error;
        // The domain a group's ops go to (nullptr: none, one host).
        std::function<const RingDomain *(const std::string &group)> domain_of;
        // The whole ring's plane hands other domains' connections over (ControlPlane::Callbacks).
        std::function<Status(const proto::PeerHello &)> foreign_check;
        std::function<void(UniqueFd, const proto::PeerHello &, const std::string &, const SessionKeys &)> adopt;
        // The newest ring generation this host has seen, kept across restarts (0: none), and the
        // call that keeps a newer one when a ring comes up.
        const uint64_t *generation_floor = nullptr;
        // The hosts whose ringd is known to be down (the whole ring's plane: ControlPlane::hosts_down).
        // A domain's own connections are no measure: a live host refuses them until a group over
        // the domain's hosts joins there.
        std::function<std::vector<std::pair<std::string, std::string>>(Clock::time_point)> hosts_down;
        // The config file's version (handshakes say it; a reload changes it).
        const std::string *config_version = nullptr;
        uint64_t instance = 0;  // this ringd process's, random at start (handshakes say it)
        std::function<void(uint64_t generation)> generation_seen;
        // Whether a domain's first lane runs on `transport` itself (the whole ring's, made at
        // start); every other lane, and a whole ring made while that one still runs (a reload),
        // runs on a sibling of it: one progress thread per transport.
        bool transport_taken = false;
        // Where the lanes' progress threads run and their staging lies (the rail's choices);
        // nullptr: anywhere.
        const topology::Plan *topology = nullptr;
    };

    // `members`: config indices in ring order, this host among them (every host: the whole ring).
    // `listener`: the whole ring's listening socket, handed over from the one before (a reload).
    static Result<std::unique_ptr<RingDomain>> create(Shared &shared, std::vector<uint32_t> members,
                                                      UniqueFd listener = {});
    ~RingDomain();

    const std::string &key() const { return key_; }  // PeerHello::domain: "" for the whole ring
    const std::vector<uint32_t> &members() const { return members_; }
    // A reload changed the host list but not this domain's hosts: their indices in the new list
    // (the same hosts, in the same order), and what the handshakes say this host runs.
    void hosts_changed(std::vector<uint32_t> members);
    // A reload that adds hosts: the whole ring goes on as a domain over part of the new one, named
    // by its hosts (its current generation and links, its groups' runs), and gives its listener up
    // for the new whole ring's (release_listener, first). One that removes hosts may make a domain over part of the ring the
    // whole of it: it takes the listener and goes on as "". `members`: its hosts' new indices.
    void to_part_of_ring(std::vector<uint32_t> members);
    Status to_whole_ring(std::vector<uint32_t> members, UniqueFd listener);
    UniqueFd release_listener() { return control_->release_listener(); }
    bool whole_ring() const { return key_.empty(); }
    int control_fd() const { return control_->fd(); }
    uint32_t lanes() const { return static_cast<uint32_t>(lanes_.size()); }
    int engine_fd(uint32_t lane) const { return lanes_.at(lane)->engine->result_fd(); }
    ControlPlane &control() { return *control_; }

    // This host's failures and ready ops of the domain's groups, in local order.
    void take_failure(const LocalFailure &f);
    void take_ready(OpRun run);
    // One step of the daemon's settle(): reports, frames to this host's own coordinator, the
    // control plane's events. Returns whether anything moved.
    bool settle_step();
    bool on_control_ready() { return control_->on_ready(); }  // true: something for settle_step()
    void on_engine_results(uint32_t lane);
    void tick(Clock::time_point now);
    void shutdown();
    // Whether the domain still has anything of `group` (ops, an incarnation being agreed).
    bool has_group_state(const std::string &group) const;
    HostOps::Counts op_counts() const { return ops_.counts(); }
    // The lane whose progress thread has had work longest without a beat, and for how long
    // (ProgressEngine::stalled_for).
    std::pair<uint32_t, Clock::duration> most_stalled_lane(Clock::time_point now) const;
    // Nothing of any group here (ops, incarnations), so the domain may be let go.
    bool idle() const {
        const HostOps::Counts c = ops_.counts();
        return runs_.empty() && c.queued + c.reported + c.running + c.releasing == 0;
    }
    // When it last had a group here (made, an op, or the daemon's look at its groups).
    Clock::time_point last_used() const { return last_used_; }
    void touch(Clock::time_point now) { last_used_ = now; }
    // The "ring" object of `ringctl status --json` for this domain.
    nlohmann::json status() const;
    // Every op of the domain's groups past local matching, with its state, age and what it waits
    // for (on the coordinator's host: the hosts that have not reported it), for `ringctl status`.
    nlohmann::json pending_ops(Clock::time_point now) const;
    nlohmann::json coordinator_status() const;

private:
    static constexpr uint32_t kCoordinator = 0;  // the first host in ring order
    // OpFails for ops this host has not reached yet, kept at most this many.
    static constexpr size_t kMaxFailedAhead = 4096;
    RingDomain(Shared &shared) : sh_(shared), ops_(*shared.groups, *shared.done) {}
    Status setup(UniqueFd listener);
    void on_ring_up(uint64_t generation, DataSockets to_next, DataSockets from_prev, std::vector<DataSockets> mesh);
    void on_ring_down(const std::string &why);
    void on_peer_message(uint32_t host, Frame &frame);
    void on_op_data(uint32_t host, Frame &frame);
    void report_direct(HostOp op, proto::OpReport r, Algorithm algorithm);
    // The report of op `key` in this coordinator generation (ring_reports.cpp): what the op is (the
    // fields the coordinator compares across hosts) and the time left to its deadline here.
    proto::OpReport op_report(const OpKey &key, const OpDesc &desc, uint32_t local_size,
                              Clock::time_point deadline) const;
    // A failure, reported for an op this host has not reached (or is past) as `data` names it.
    static proto::OpReport failure_report(const proto::OpReport &data, int32_t code, std::string why);
    void tell_coordinator(const OpKey &key, HostOp &op, uint32_t flags);
    void send_control(uint32_t host, const proto::Bytes &frame);
    void past_it(uint32_t host, const proto::OpReport &data);
    std::set<OpKey> past_told_;  // ops this host said it is past (bounded like failed_ahead_)
    // How long a doubling or halving-doubling op may take here before the coordinator hears of it.
    static constexpr auto kStallReport = std::chrono::milliseconds(250);
    bool pump_all_to_all();
    void try_progress_direct(const OpKey &key);
    void fail_ahead(const proto::OpReport &data, int32_t code, const std::string &why);
    bool flush_reports_now();
    void forget_gone_runs();
    bool deliver_self_frames();
    bool join_groups();
    bool tell_ended_runs();
    void send_to_coordinator(const proto::Bytes &frame);
    void on_group_incarnation(const proto::GroupIncarnation &g);
    void on_report(uint32_t host, const proto::OpReport &r);
    void broadcast(const Coordinator::Decisions &d);
    void on_start(const proto::OpStart &s);
    void on_fail(const proto::OpFail &f);
    void expire_host_ops(Clock::time_point now);
    void record_error(const std::string &m) { sh_.record_error(m); }
    std::string run_left(const OpRun &run) const;

    Shared &sh_;
    bool owns_transport_ = false;  // lane 0 runs on sh_.transport (Shared::transport_taken)
    Config config_;  // the daemon's, with hosts = this domain's hosts in ring order
    std::string key_;
    std::vector<uint32_t> members_;
    uint32_t self_index_ = 0;  // in members_
    std::unique_ptr<ControlPlane> control_;
    std::optional<Coordinator> coordinator_;  // on the first host in ring order
    // This host's side of each group's incarnation (proto/peer.h): its local incarnation, and
    // what the coordinator agreed it is in this generation.
    struct GroupRun {
        uint64_t local_id = 0;
        uint64_t agreed = 0;    // 0 until GroupIncarnation came in this generation
        uint64_t previous = 0;  // agreed in an earlier generation (sent with GroupJoin)
        bool join_sent = false;
        uint64_t last_seq = 0;  // the highest seq reported
        bool end_told = false;  // over here: the coordinator was told it ended (tell_ended_runs)
        int32_t refused_code = 0;  // the coordinator refused or ended this local incarnation: its ops fail
        std::string refused;
        uint64_t end_after = 0;  // ... but those up to this seq (ended on the host that ended it: on_incarnation_ended)
        // A solo lane (GroupIncarnation::solo_epoch, 0: none): its ring ops start here without the
        // coordinator, in seq order, on lane `lane`.
        uint32_t lane = 0, solo_epoch = 0, total_ranks = 0;
        // The group's ranks on each host of the domain (ring order), as the coordinator agreed them
        // (protocol 10, every host's trainers said their ranks); empty: reduce_scatter and
        // allgather cannot run.
        std::vector<std::vector<uint32_t>> host_ranks;
        uint64_t skipped = 0;  // the lane is past every seq up to this (ops the coordinator failed ahead)
        // Error-feedback residuals of its compressed ops, by the caller's tag (feedback_for):
        // dropped with the run, at most config wire.feedback_max_bytes, least recently used out.
        struct Feedback {
            std::shared_ptr<WireResidual> residual;
            uint64_t bytes = 0, used = 0;
        };
        std::map<uint64_t, Feedback> feedback;
        uint64_t feedback_bytes = 0, feedback_clock = 0;
    };
    // The residual of a compressed op with error feedback (null: none, or larger than the bound);
    // called for every ring op (it counts them by wire format).
    std::shared_ptr<WireResidual> feedback_for(GroupRun &run, const OpRun &op);
    uint64_t feedback_evicted_ = 0, feedback_refused_ = 0;
    std::array<uint64_t, kWireFormatCount> wire_ops_{};  // ring ops by wire format
    // A solo lane's ring op on the progress thread: what the coordinator is told if it stalls,
    // and the coordinator's reason once it cancels it.
    struct SoloOp {
        OpKey key;
        uint32_t lane = 0, op_tag = 0;
        OpDesc desc;
        uint32_t local_size = 0;
        Clock::time_point deadline, posted;
        bool told = false;
        int32_t fail_code = 0;
        std::string fail_message;
        // Its incarnation ended (on_incarnation_ended): cancelled with this if it stops moving.
        int32_t ended_code = 0;
        std::string ended_message;
    };
    std::map<uint64_t, SoloOp> solo_ops_;  // by local op id
    uint64_t ops_solo_ = 0;                // ring ops started here without the coordinator
    // Whether this generation's ring ops may run in solo lanes (Coordinator::reset).
    bool solo_lanes() const;
    // Whether all_to_all runs over the lanes' data links to every host (AllToAllEngine): a
    // generation of protocol 12 on TCP. On a solo lane it starts without the coordinator like
    // the lane's ring ops, and is cancelled like them (on every link).
    bool mesh_links() const;
    // The generation runs compressed f32 allreduces as the exchange of shards (ring_work).
    bool exchange_schedule() const;
    static uint32_t solo_op_tag(uint32_t epoch, uint64_t seq, const OpRun *op);
    void start_solo(GroupRun &run, HostOp op);
    EngineWork ring_work(HostOp &op, const GroupRun &run, uint32_t total_ranks, uint32_t op_tag) const;
    // This host's GroupJoin of the group's run (its local ranks and, from protocol 10, their ranks).
    proto::Bytes group_join(const std::string &group, const GroupRun &run) const;
    // Why a reduce_scatter or allgather of the run cannot run in this generation ("" when it can):
    // a host of the domain speaks a protocol before 10, or not every host's trainers said their ranks.
    std::string collectives_refused(const GroupRun &run, const OpRun &op) const;
    void tell_solo(SoloOp &s, uint32_t flags);
    void on_incarnation_ended(const proto::OpFail &f);
    void end_solo_lane(GroupRun &r, bool now = false);
    proto::OpReport end_report(const std::string &group, const GroupRun &run, const HostOp &op) const;
    // How long a solo lane's op may wait here without moving before the coordinator hears of it
    // (or a quarter of the time left to it, if less): a host whose trainers lag further than this
    // sends one report. The end of an incarnation comes without it (Coordinator::end); what is
    // left for it is an op that differs between hosts, and one a host never submits.
    static constexpr auto kSoloStallReport = std::chrono::seconds(1);
    uint32_t solo_lane(const OpKey &key) const {
        for (const auto &[id, so] : solo_ops_)
            if (so.key == key) return so.lane;
        return 0;
    }
    bool solo_running(const OpKey &key) const {
        for (const auto &[id, so] : solo_ops_)
            if (so.key == key) return true;
        return false;
    }
    std::map<std::string, GroupRun> runs_;
    std::map<OpKey, std::pair<int32_t, std::string>> failed_ahead_;  // OpFails for ops not reported yet
    // One- and two-shot ops' data (daemon/exchange/direct_exchange.h).
    std::unique_ptr<DirectExchange> exchange_;
    uint64_t ops_one_shot_ = 0, ops_two_shot_ = 0, ops_ring_ = 0, ops_doubling_ = 0, ops_halving_doubling_ = 0;
    uint16_t generation_protocol_ = proto::kPeerBaseVersion;  // the oldest of the generation's hosts
    bool generation_exchange_ = false;  // ControlPlane::generation_exchange(), for the running generation
    // Whether ops of `a` are reported to the coordinator only when they stall or differ (their
    // data checked by the hosts): doubling and halving-doubling; one-/two-shot too from protocol 8
    // on (below it their data is their sender's report, as the previous release expects).
    bool deferred(Algorithm a) const {
        return deferred_reports(a) || (a != Algorithm::Ring && generation_protocol_ >= kLogAlgorithmsProtocol);
    }
    uint64_t deferred_reports_ = 0;  // deferred direct ops this host had to report (stalled, differed)
    struct Frames {
        uint64_t control_sent = 0, control_received = 0, data_sent = 0, data_received = 0;
    } frames_;
    uint64_t coordinator_reports_ = 0;  // reports this host's coordinator handled
    uint64_t local_generation_ = 0;
    uint64_t coord_generation_ = 0;   // the coordinator's generation we report in
    uint64_t coord_generation_used_ = 0;
    bool coord_known_ = false;
    std::string ring_down_reason_ = "the ring has not formed yet";
    std::string last_abort_;  // for status: empty until a generation has been aborted
    // Frames this host (the coordinator) sent itself, in the order sent; a one-/two-shot report
    // travels as the report itself (its algorithm is implied by the OpData the other hosts get).
    struct SelfMessage {
        Frame frame;
        std::optional<proto::OpReport> direct_report;
    };
    std::vector<SelfMessage> self_inbox_;
    // Every op of the domain's groups past local matching, in its state (daemon/ops/host_ops.h).
    HostOps ops_;
    Clock::time_point last_used_ = Clock::now();
    // Per-link throughput, sampled every second by tick().
    Clock::time_point rate_at_{};
    uint64_t rate_bytes_next_ = 0, rate_bytes_prev_ = 0;
    double rate_next_ = 0, rate_prev_ = 0;
    // Several rails: what this host sent to the next on each (lanes summed), and the rate of it.
    uint64_t bytes_to_next_on_rail(uint32_t r) const;
    std::array<uint64_t, kMaxRailsPerLink> rate_bytes_rail_{};
    std::array<double, kMaxRailsPerLink> rate_rail_{};
    // A lane (tuning.lanes): its data links, staging and progress thread; the coordinator puts
    // each group's incarnation in one (OpStart::lane). Lane 0 of the whole ring runs on the
    // daemon's transport, every other lane on a sibling of it.
    struct Lane {
        std::unique_ptr<NetworkTransport> own_transport;
        NetworkTransport *transport = nullptr;
        topology::NodeMemory staging_mem;  // on its NIC's node (Shared::topology)
        RegisteredRegion staging;  // after staging_mem: deregistered before it is freed
        // Last: the progress thread stops (and drops its references to slots and links) before
        // anything above goes away.
        std::unique_ptr<ProgressEngine> engine;
    };
    uint64_t bytes_to_next() const;
    uint64_t bytes_by_reference_to_next() const;
    uint64_t bytes_from_prev() const;
    // Last: every lane's progress thread stops before anything above goes away.
    std::vector<std::unique_ptr<Lane>> lanes_;
};

}  // namespace ringd
