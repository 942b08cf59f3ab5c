// RingDomain (ring_domain.h): the op's way across the hosts of a domain.
#include <systemd/sd-daemon.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "daemon/ring/ring_domain.h"

#include <nlohmann/json.hpp>

#include "daemon/gateway/client_gateway.h"
#include "daemon/engine/reduce.h"
#include "daemon/engine/tuner.h"
#include "daemon/ipc/slot.h"

namespace ringd {
namespace {

constexpr uint32_t kCoordinator = 0;  // the first host in ring order
// OpFails for ops this host has not reached yet, kept at most this many.
constexpr size_t kMaxFailedAhead = 4096;

}  // namespace

Result<std::unique_ptr<RingDomain>> RingDomain::create(Shared &shared, std::vector<uint32_t> members, UniqueFd listener) {
    std::unique_ptr<RingDomain> d(new RingDomain(shared));
    d->members_ = std::move(members);
    d->config_ = *shared.config;
    d->config_.hosts.clear();
    const bool whole = d->members_.size() == shared.config->hosts.size();
    for (uint32_t m : d->members_) {
        const HostEntry &h = shared.config->hosts.at(m);
        if (h.name == shared.host) d->self_index_ = static_cast<uint32_t>(d->config_.hosts.size());
        d->config_.hosts.push_back(h);
        if (!whole) d->key_ += (d->key_.empty() ? "" : ",") + h.name;
    }
    if (d->key_.size() > proto::kMaxDomainBytes)
        return make_error(-E2BIG, "the names of these hosts take " + std::to_string(d->key_.size()) +
                                      " bytes, more than a ring domain's " + std::to_string(proto::kMaxDomainBytes));
    if (auto s = d->setup(std::move(listener)); !s) return s.error();
    return d;
}

RingDomain::~RingDomain() {
    for (auto &l : lanes_)
        if (l->engine) l->engine->stop();
    if (owns_transport_) sh_.transport_taken = false;
}

Status RingDomain::setup(UniqueFd listener) {
    RingOptions ring_options;
    ring_options.chunk_bytes = config_.tuning.chunk_bytes;
    ring_options.depth = config_.tuning.depth;
    ring_options.spin_us = config_.poll == PollMode::Busy ? -1 : config_.poll == PollMode::Event ? 0 : 50;
    const uint64_t staging_bytes = RingEngine::staging_bytes(ring_options);
    for (uint32_t k = 0; k < std::max<uint32_t>(1, config_.tuning.lanes); ++k) {
        auto l = std::make_unique<Lane>();
        if (whole_ring() && k == 0 && !sh_.transport_taken) {
            l->transport = sh_.transport;
            owns_transport_ = sh_.transport_taken = true;
        } else {
            auto t = sh_.transport->sibling();
            if (!t) return t.error();
            l->own_transport = std::move(*t);
            l->transport = l->own_transport.get();
        }
        // Receive staging for the ring and its f32 work area (f16/bf16 sums and averages),
        // registered once for the domain's lifetime.
        l->staging_mem.reset(new (std::nothrow) std::byte[staging_bytes]);
        if (!l->staging_mem) return make_error(-ENOMEM, "cannot set up the ring's staging memory");
        auto reg = l->transport->register_region(l->staging_mem.get(), staging_bytes);
        if (!reg) return reg.error();
        l->staging = RegisteredRegion(l->transport, *reg);
        auto e = ProgressEngine::start(l->transport, l->staging.handle(), ring_options, config_.timeouts.op);
        if (!e) return e.error();
        l->engine = std::move(*e);
        l->engine->set_name("ringd-ring" + std::to_string(lanes_.size()));
        lanes_.push_back(std::move(l));
    }

    ControlPlane::Callbacks cb;
    cb.ring_up = [this](uint64_t g, DataSockets to_next, DataSockets from_prev) {
        on_ring_up(g, std::move(to_next), std::move(from_prev));
    };
    cb.ring_down = [this](const std::string &why) { on_ring_down(why); };
    cb.message = [this](uint32_t host, Frame &f) { on_peer_message(host, f); };
    cb.prepare_socket = [t = sh_.transport](int fd) { t->prepare_socket(fd); };
    if (whole_ring()) {
        cb.foreign_check = sh_.foreign_check;
        cb.adopt = sh_.adopt;
    }
    auto cp = ControlPlane::create(config_, self_index_, sh_.secret, std::move(cb), key_, whole_ring(), std::move(listener));
    if (!cp) return cp.error();
    control_ = std::move(*cp);
    if (sh_.generation_floor) control_->seed_generation(*sh_.generation_floor);
    control_->set_identity(hosts_digest(sh_.config->hosts), sh_.config_version, sh_.instance);
    std::vector<std::string> names;
    for (const auto &h : config_.hosts) names.push_back(h.name);
    if (self_index_ == kCoordinator)
        coordinator_.emplace(names, config_.timeouts.op_max, lanes(),
                             [groups = sh_.groups](const std::string &g) { return groups->op_timeout(g); });
    exchange_ = std::make_unique<DirectExchange>(
        self_index_, std::move(names),
        [this](uint32_t h, const proto::Bytes &f) {
            ++frames_.data_sent;
            (void)control_->send(h, f);
        },
        [this](uint32_t h) { return control_->queued_bytes(h); });
    if (!whole_ring()) spdlog::info("ring domain {}: made (this host is {} of {})", key_, self_index_, members_.size());
    return Ok{};
}

void RingDomain::on_ring_up(uint64_t generation, DataSockets to_next, DataSockets from_prev) {
    local_generation_ = generation;
    if (sh_.generation_seen) sh_.generation_seen(generation);
    const uint32_t n = static_cast<uint32_t>(config_.hosts.size());
    // The data connections lane by lane (ControlPlane: streams x lanes, in stream order).
    const size_t per = to_next.fds.size() / lanes_.size();
    for (size_t k = 0; k < lanes_.size(); ++k) {
        RingLinks l;
        l.generation = generation;
        l.rank = self_index_;
        l.size = n;
        l.next_name = config_.hosts[(self_index_ + 1) % n].name;
        l.prev_name = config_.hosts[(self_index_ + n - 1) % n].name;
        for (size_t i = k * per; i < (k + 1) * per && i < to_next.fds.size(); ++i) {
            l.to_next.push_back(std::move(to_next.fds[i]));
            l.to_next_keys.push_back(to_next.keys.at(i));
        }
        for (size_t i = k * per; i < (k + 1) * per && i < from_prev.fds.size(); ++i) {
            l.from_prev.push_back(std::move(from_prev.fds[i]));
            l.from_prev_keys.push_back(from_prev.keys.at(i));
        }
        lanes_[k]->engine->ring_up(std::move(l));
    }
    // The generation is agreed: every host reports ops in it from now on, at the one protocol the
    // coordinator chose for all of its hosts, so every host chooses algorithms alike.
    generation_protocol_ = control_->generation_protocol();
    coord_generation_ = generation;
    coord_known_ = true;
    if (coordinator_) coordinator_->reset(generation, control_->instances(), solo_lanes());
    control_->heartbeat_now(generation);
    if (!whole_ring()) {
        spdlog::info("ring domain {}: generation {} is up ({} hosts)", key_, generation, n);
        return;
    }
    spdlog::info("ring generation {} is up ({} hosts)", generation, n);
    // For `systemctl status ringd` (and tests, which wait for it on their NOTIFY_SOCKET).
    ::sd_notifyf(0, "STATUS=ring generation %llu up (%u hosts)", static_cast<unsigned long long>(generation), n);
}

void RingDomain::on_ring_down(const std::string &why) {
    for (auto &l : lanes_) l->engine->ring_down(local_generation_);
    ring_down_reason_ = (whole_ring() ? "" : "ring domain " + key_ + ": ") + "ring generation " +
                        std::to_string(local_generation_) + " aborted: " + why;
    record_error(ring_down_reason_);
    last_abort_ = ring_down_reason_;
    if (whole_ring()) ::sd_notifyf(0, "STATUS=%s", ring_down_reason_.c_str());
    coord_known_ = false;
    coord_generation_used_ = coord_generation_;
    self_inbox_.clear();  // frames of the generation that ended
    ops_.generation_ended(ring_down_reason_);
    failed_ahead_.clear();
    for (auto &[group, run] : runs_) {  // agreed again in the next generation
        if (run.agreed) run.previous = run.agreed;
        run.agreed = 0;
        run.join_sent = false;
        run.solo_epoch = 0;  // the next generation's links and grants
    }
    exchange_->drop_before(coord_generation_used_ + 1);
}

// This host's local failures and the ops every local rank submitted, queued for reporting in
// local order.
void RingDomain::take_failure(const LocalFailure &f) {
    if (f.seq == proto::kIncarnationEnds) {
        // A rank left: this local incarnation is over, whatever its other ranks still do. Asked
        // for but not agreed yet, it is withdrawn at once (and never asks again: join_groups),
        // so that the coordinator does not agree on it with the others' next run, whose first op
        // its end would fail. (The gateway hands failures over before it welcomes a new trainer,
        // so this goes out before a new run of the group here can be agreed.)
        auto run = runs_.find(f.group);
        if (run != runs_.end() && run->second.local_id == f.local_id && run->second.join_sent && !run->second.agreed &&
            coord_known_) {
            run->second.join_sent = false;
            send_to_coordinator(proto::encode_group_join({coord_generation_, f.group, f.local_id, proto::kIncarnationEnds}));
        }
    }
    HostOp op;
    op.run.group = f.group;
    op.run.local_id = f.local_id;
    op.run.seq = f.seq;
    op.run.submitted = Clock::now();  // its age in status: since it failed here
    op.status = f.code;
    op.message = "host " + sh_.host + ": " + f.message;
    op.deadline = Clock::now() + config_.timeouts.op;
    ops_.queue(std::move(op));
}

void RingDomain::take_ready(OpRun run) {
    HostOp op;
    if (!sh_.gateway->slots_of(run, op.slots)) {
        sh_.groups->finished(run.op_id, -ECONNRESET, run_left(run), *sh_.done);
        return;
    }
    op.deadline = run.deadline;  // from the first local submission, whatever comes next
    op.run = std::move(run);
    ops_.queue(std::move(op));
}

std::string RingDomain::run_left(const OpRun &run) const {
    return "group " + run.group + " op " + std::to_string(run.seq) + ": a local rank left";
}

bool RingDomain::has_group_state(const std::string &group) const {
    return runs_.count(group) != 0 || ops_.has_queued(group);
}

// To the coordinator; on the coordinating host itself, through the inbox that settle() empties
// (deliver_self_frames), like a frame from a peer.
void RingDomain::send_to_coordinator(const proto::Bytes &frame) {
    if (self_index_ != kCoordinator) {
        send_control(kCoordinator, frame);
        return;
    }
    Frame f;
    f.type = static_cast<proto::FrameType>(frame[6] | (frame[7] << 8));
    f.payload.assign(frame.begin() + proto::kFrameHeaderBytes, frame.end());
    self_inbox_.push_back({std::move(f), std::nullopt});
}

bool RingDomain::deliver_self_frames() {
    if (self_inbox_.empty()) return false;
    for (auto &m : std::exchange(self_inbox_, {})) {
        if (m.direct_report) on_report(self_index_, *m.direct_report);
        else on_peer_message(self_index_, m.frame);
    }
    return true;
}

// Every group there is here asks the coordinator to agree on its incarnation as soon as it
// exists (and again in each ring generation), before its first op. Returns whether it sent any.
// A run agreed in an earlier ring generation, not agreed again in this one, and over here (its
// ranks left, or one did): the coordinator hears it once, which ends it for the other hosts, whose
// ranks then fail at once naming this host instead of waiting for it to join. Kept until then
// (forget_gone_runs), also while the ring is down.
bool RingDomain::tell_ended_runs() {
    bool sent = false;
    for (auto &[group, run] : runs_) {
        if (run.agreed || run.previous == 0 || run.end_told || run.refused_code != 0) continue;
        if (sh_.groups->local_id(group) == run.local_id && !sh_.groups->broken(group)) continue;  // goes on
        run.end_told = true;
        run.join_sent = true;  // it never asks again
        sent = true;
        send_to_coordinator(proto::encode_group_join({coord_generation_, group, run.local_id, proto::kIncarnationEnds}));
    }
    return sent;
}

bool RingDomain::join_groups() {
    bool sent = tell_ended_runs();
    sh_.groups->for_each_local_id([&](const std::string &group, uint64_t local_id) {
        if (sh_.domain_of(group) != this) return;  // another domain's group
        const HostOp *next = ops_.next_queued(group);
        if (next && next->run.local_id != local_id) return;  // an earlier incarnation's reports first
        GroupRun &run = runs_[group];
        if (run.local_id != local_id) {
            run = GroupRun{};
            run.local_id = local_id;
        }
        // A local incarnation a rank left never asks: it is over here (take_failure).
        if (run.agreed || run.join_sent || run.refused_code != 0 || sh_.groups->broken(group)) return;
        run.join_sent = true;
        sent = true;
        send_to_coordinator(proto::encode_group_join(
            {coord_generation_, group, run.local_id, run.previous,
             generation_protocol_ >= kLogAlgorithmsProtocol ? sh_.groups->local_size(group) : 0}));
    });
    return sent;
}

// Reports what is ready or failed here, in local order per group, once the group's incarnation
// is agreed; asks for the agreement first. Returns whether anything moved.
bool RingDomain::flush_reports_now() {
    bool moved = join_groups();
    if (!ops_.any_queued()) {  // the usual case between ops: nothing to report
        forget_gone_runs();
        return moved;
    }
    for (const std::string &group : ops_.queued_groups()) {
        while (const HostOp *next = ops_.next_queued(group)) {
            GroupRun &run = runs_[group];
            if (run.local_id != next->run.local_id) {  // a new local incarnation
                run = GroupRun{};
                run.local_id = next->run.local_id;
            }
            // Every local rank of it is gone (none is there, or a newer local incarnation), or one
            // left: it never asks for an agreement again.
            const uint64_t now_local = sh_.groups->local_id(group);
            const bool over = now_local != run.local_id || sh_.groups->broken(group);
            if (run.refused_code != 0 || (!run.agreed && (over || (!run.join_sent && next->run.seq == proto::kIncarnationEnds)))) {
                // Refused by the coordinator: its ops fail here. Not agreed in this generation and
                // over here: nobody else runs any of it in this generation (agreed in an earlier
                // one, the coordinator was told it ended: tell_ended_runs).
                HostOp op = ops_.take_queued(group);
                moved = true;
                if (op.status != 0) continue;
                sh_.groups->finished(op.run.op_id, run.refused_code != 0 ? run.refused_code : -ECONNABORTED,
                                 "group " + group + " op " + std::to_string(op.run.seq) + ": " +
                                     (run.refused_code != 0 ? run.refused : "its local ranks left"),
                                 *sh_.done);
                continue;
            }
            if (!run.agreed) {
                if (!run.join_sent) {
                    run.join_sent = true;
                    moved = true;
                    send_to_coordinator(proto::encode_group_join(
                        {coord_generation_, group, run.local_id, run.previous,
                         generation_protocol_ >= kLogAlgorithmsProtocol ? sh_.groups->local_size(group) : 0}));
                }
                break;  // until GroupIncarnation comes
            }
            HostOp op = ops_.take_queued(group);
            moved = true;
            if (op.run.seq != proto::kIncarnationEnds) run.last_seq = std::max(run.last_seq, op.run.seq);
            // A solo lane's op that does not run here is skipped there in its order, so that the
            // previous host's messages of it are dropped; the end of the incarnation here skips
            // the rest of its grant.
            auto skip_solo = [&] {
                if (!run.solo_epoch) return;
                lanes_[run.lane % lanes_.size()]->engine->skip_to(
                    op.run.seq == proto::kIncarnationEnds ? kSoloTag | (((run.solo_epoch + 1) & 0x7f) << 24)
                                                          : solo_tag_next(solo_op_tag(run.solo_epoch, op.run.seq, nullptr)));
            };
            if (auto ahead = failed_ahead_.find(OpKey{group, run.agreed, op.run.seq}); ahead != failed_ahead_.end()) {
                // The coordinator failed it already: no report is needed.
                if (op.status == 0) sh_.groups->finished(op.run.op_id, ahead->second.first, ahead->second.second, *sh_.done);
                failed_ahead_.erase(ahead);
                skip_solo();
                continue;
            }
            if (run.solo_epoch && op.status == 0 && op.run.seq != proto::kIncarnationEnds && op.run.seq <= run.skipped) {
                // Its lane is past it already (failed by the coordinator; the failure was forgotten).
                sh_.groups->finished(op.run.op_id, -ECONNABORTED,
                                     "group " + group + " op " + std::to_string(op.run.seq) + ": the coordinator failed it before this host got to it",
                                     *sh_.done);
                continue;
            }
            if (run.solo_epoch && op.status == 0 && op.run.seq != proto::kIncarnationEnds &&
                choose_algorithm(op.run.count * dtype_size(op.run.dtype), static_cast<uint32_t>(config_.hosts.size()),
                                 config_.tuning, generation_protocol_) == Algorithm::Ring) {
                start_solo(run, std::move(op));
                continue;
            }
            if (op.status != 0) skip_solo();
            proto::OpReport r;
            r.generation = coord_generation_;
            r.group = group;
            r.incarnation = run.agreed;
            r.seq = op.run.seq;
            r.count = op.run.count;
            r.dtype = static_cast<uint32_t>(op.run.dtype);
            r.op = static_cast<uint32_t>(op.run.op);
            r.local_size = static_cast<uint32_t>(op.run.members.size());
            r.status = op.status;
            r.message = op.message;
            r.remaining_ms = static_cast<uint32_t>(std::clamp<int64_t>(
                std::chrono::duration_cast<std::chrono::milliseconds>(op.deadline - Clock::now()).count(), 0, UINT32_MAX));
            const uint64_t bytes = op.run.count * dtype_size(op.run.dtype);
            const Algorithm algorithm =
                choose_algorithm(bytes, static_cast<uint32_t>(config_.hosts.size()), config_.tuning, generation_protocol_);
            if (op.status == 0) sh_.groups->set_algorithm(op.run.op_id, algorithm_name(algorithm));
            if (op.status == 0 && algorithm != Algorithm::Ring) {
                // Peers' data of the op is here already and their deadline has passed: this host
                // got there too late. It fails here and is reported as this host's failure, without
                // its data, so that no host completes the op (the coordinator fails it everywhere,
                // if it has not already, rather than waiting for a decision that crosses the data
                // still queued to this host).
                const auto late = exchange_->earliest_deadline(coord_generation_, OpKey{group, r.incarnation, r.seq});
                if (late && late->first <= Clock::now()) {
                    const std::string why = "group " + group + " op " + std::to_string(op.run.seq) + " timed out after " +
                                            std::to_string(sh_.groups->op_timeout(group).count()) + " ms: host(s) " +
                                            config_.hosts[self_index_].name + " did not submit it by host " +
                                            config_.hosts[late->second].name + "'s deadline (it got there later)";
                    sh_.groups->finished(op.run.op_id, -ETIMEDOUT, why, *sh_.done);
                    exchange_->drop(coord_generation_, OpKey{group, r.incarnation, r.seq});
                    r.status = -ETIMEDOUT;
                    r.message = why;
                    send_to_coordinator(proto::encode_op_report(r));
                    continue;
                }
                if (std::string why = exchange_->send_over_bound(r, op.run.dtype, op.run.op, algorithm); !why.empty()) {
                    // Reported as this host's failure: it fails on every host, named.
                    sh_.groups->finished(op.run.op_id, -ENOBUFS, why, *sh_.done);
                    r.status = -ENOBUFS;
                    r.message = why;
                    send_to_coordinator(proto::encode_op_report(r));
                    continue;
                }
                report_direct(std::move(op), std::move(r), algorithm);
                continue;
            }
            if (op.status == 0) ops_.reported(OpKey{group, r.incarnation, r.seq}, std::move(op));
            send_to_coordinator(proto::encode_op_report(r));
        }
    }
    forget_gone_runs();
    return moved;
}

// A group gone here with nothing left to report is forgotten.
void RingDomain::forget_gone_runs() {
    for (auto run = runs_.begin(); run != runs_.end();) {
        const GroupRun &r = run->second;
        const bool untold = !r.agreed && r.previous != 0 && !r.end_told && r.refused_code == 0;  // tell_ended_runs
        if (!ops_.has_queued(run->first) && sh_.groups->local_id(run->first) != r.local_id && !untold) run = runs_.erase(run);
        else ++run;
    }
}

bool RingDomain::solo_lanes() const {
    return generation_protocol_ >= kLogAlgorithmsProtocol && lanes_.size() >= 2 && lanes_[0]->transport &&
           lanes_[0]->transport->name() == "tcp";
}

uint32_t RingDomain::solo_op_tag(uint32_t epoch, uint64_t seq, const OpRun *op) {
    uint32_t digest = 0;
    if (op) {
        // count, dtype and op, folded to a byte: hosts whose ops differ send messages that no
        // receive of the others matches.
        uint64_t h = op->count * 0x9e3779b97f4a7c15ull ^ (uint64_t{static_cast<uint32_t>(op->dtype)} << 8 | static_cast<uint32_t>(op->op));
        h ^= h >> 29;
        h *= 0xbf58476d1ce4e5b9ull;
        h ^= h >> 32;
        digest = static_cast<uint32_t>(h & 0xff);
    }
    return kSoloTag | ((epoch & 0x7f) << 24) | (digest << 16) | static_cast<uint32_t>(seq & 0xffff);
}

// A ring op for the progress thread (its slots move into it).
EngineWork RingDomain::ring_work(HostOp &op, uint32_t total_ranks, uint32_t op_tag) const {
    EngineWork w;
    w.op_id = op.run.op_id;
    w.dtype = op.run.dtype;
    w.op = op.run.op;
    w.count = op.run.count;
    w.avg_divisor = total_ranks;
    w.offsets = op.run.offsets;
    w.slots = std::move(op.slots);
    w.ring = true;
    w.generation = local_generation_;
    w.op_tag = op_tag;
    return w;
}

// A solo lane's ring op goes to its lane's progress thread at once: every host starts it by
// itself, in the group's order, and the coordinator hears of it only if it stalls here.
void RingDomain::start_solo(GroupRun &run, HostOp op) {
    const OpKey key{op.run.group, run.agreed, op.run.seq};
    ++ops_ring_;
    ++ops_solo_;
    sh_.groups->set_algorithm(op.run.op_id, algorithm_name(Algorithm::Ring));
    SoloOp so;
    so.key = key;
    so.lane = run.lane % static_cast<uint32_t>(lanes_.size());
    so.op_tag = solo_op_tag(run.solo_epoch, op.run.seq, &op.run);
    so.count = op.run.count;
    so.dtype = op.run.dtype;
    so.op = op.run.op;
    so.local_size = static_cast<uint32_t>(op.run.members.size());
    so.deadline = op.deadline;
    so.posted = Clock::now();
    EngineWork w = ring_work(op, run.total_ranks, so.op_tag);
    // The coordinator's decision (at the earliest deadline of the hosts that reported it) comes
    // before the ring's own timeout, which would end the generation.
    w.deadline = op.deadline + HostOps::kDecisionGrace;
    ops_.running(w.op_id, local_generation_, w.deadline, key, op.run.submitted);
    solo_ops_[w.op_id] = std::move(so);
    lanes_[run.lane % lanes_.size()]->engine->post(std::move(w));
}

void RingDomain::tell_solo(SoloOp &s, uint32_t flags) {
    if (s.told && !(flags & proto::kReportDone)) return;
    s.told = true;
    ++deferred_reports_;
    proto::OpReport r;
    r.generation = coord_generation_;
    r.group = std::get<0>(s.key);
    r.incarnation = std::get<1>(s.key);
    r.seq = std::get<2>(s.key);
    r.count = s.count;
    r.dtype = static_cast<uint32_t>(s.dtype);
    r.op = static_cast<uint32_t>(s.op);
    r.local_size = s.local_size;
    r.algorithm = 0;
    r.remaining_ms = static_cast<uint32_t>(std::clamp<int64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(s.deadline - Clock::now()).count(), 0, UINT32_MAX));
    r.flags = proto::kReportDeferred | flags;
    send_to_coordinator(proto::encode_op_report(r));
}

void RingDomain::on_group_incarnation(const proto::GroupIncarnation &g) {
    if (!coord_known_ || g.generation != coord_generation_) return;
    auto it = runs_.find(g.group);
    if (it == runs_.end() || it->second.local_id != g.local_id) return;  // an incarnation that ended here
    GroupRun &run = it->second;
    if (g.code != 0) {
        spdlog::warn("{}", g.message);
        record_error(g.message);
        run.refused_code = g.code;
        run.refused = g.message;
    } else {
        run.agreed = g.incarnation;
        run.lane = g.lane;
        run.solo_epoch = solo_lanes() && g.lane < lanes_.size() ? g.solo_epoch : 0;
        run.total_ranks = g.total_ranks;
    }
}

// One-/two-shot (DirectExchange): this host's data goes to the others with its report; the
// coordinator gets the report (on its own host, through the inbox).
// Doubling and halving-doubling: nobody hears of the op but this host's partners, unless it has
// not completed within kStallReport, or a partner's data does not match (tell_coordinator).
void RingDomain::report_direct(HostOp op, proto::OpReport r, Algorithm algorithm) {
    r.algorithm = static_cast<uint32_t>(algorithm);
    op.algorithm = algorithm;
    const OpKey key{r.group, r.incarnation, r.seq};
    const bool deferred = this->deferred(algorithm);
    if (deferred) op.stall_at = Clock::now() + std::min<Clock::duration>(kStallReport, (op.deadline - Clock::now()) / 4);
    exchange_->contribute(ops_.reported(key, std::move(op)), r);
    if (!deferred && self_index_ == kCoordinator) self_inbox_.push_back({Frame{}, r});  // in order with the other frames
    try_progress_direct(key);
}

// A doubling or halving-doubling op's report, sent when it is needed: the op stalls here, a
// partner's data does not match it, or (kReportDone) it completed after this host reported it.
void RingDomain::tell_coordinator(const OpKey &key, HostOp &op, uint32_t flags) {
    // (Below protocol 8, one-/two-shot ops were reported with their data: the coordinator sees
    // any difference.)
    if (!deferred(op.algorithm) || (op.told_coordinator && !(flags & proto::kReportDone))) return;
    op.told_coordinator = true;
    ++deferred_reports_;
    proto::OpReport r;
    r.generation = coord_generation_;
    r.group = std::get<0>(key);
    r.incarnation = std::get<1>(key);
    r.seq = std::get<2>(key);
    r.count = op.run.count;
    r.dtype = static_cast<uint32_t>(op.run.dtype);
    r.op = static_cast<uint32_t>(op.run.op);
    r.local_size = static_cast<uint32_t>(op.run.members.size());
    r.algorithm = static_cast<uint32_t>(op.algorithm);
    r.remaining_ms = static_cast<uint32_t>(std::clamp<int64_t>(
        std::chrono::duration_cast<std::chrono::milliseconds>(op.deadline - Clock::now()).count(), 0, UINT32_MAX));
    r.flags = proto::kReportDeferred | flags;
    send_to_coordinator(proto::encode_op_report(r));
}

// This host cannot keep a peer's data of an op it has not reached: the op fails on every host
// with `why`, through the coordinator, which takes the report as one for an op ahead (it says
// nothing of how far this host got).
void RingDomain::fail_ahead(const proto::OpReport &data, int32_t code, const std::string &why) {
    spdlog::warn("{}", why);
    record_error(why);
    proto::OpReport r;
    r.generation = data.generation;
    r.group = data.group;
    r.incarnation = data.incarnation;
    r.seq = data.seq;
    r.status = code;
    r.message = why;
    r.flags = proto::kReportAhead;
    send_to_coordinator(proto::encode_op_report(r));
}

// A partner runs a doubling/halving-doubling op that ended here already (this host's trainers
// failed it in an earlier ring generation, say, and went on): nobody will send it this host's
// part, so it fails on every host now, through the coordinator, naming this host (the deferred
// reports of the others say nothing of how far this host got).
void RingDomain::past_it(uint32_t host, const proto::OpReport &data) {
    const OpKey key{data.group, data.incarnation, data.seq};
    if (!past_told_.insert(key).second) return;
    if (past_told_.size() > kMaxFailedAhead) past_told_.erase(past_told_.begin());
    proto::OpReport r;
    r.generation = data.generation;
    r.group = data.group;
    r.incarnation = data.incarnation;
    r.seq = data.seq;
    r.status = -ECONNABORTED;
    r.message = "group " + data.group + " op " + std::to_string(data.seq) + ": host " + config_.hosts[self_index_].name +
                " is past it (the op ended there before host " + config_.hosts[host].name + " got to it)";
    send_to_coordinator(proto::encode_op_report(r));
}

void RingDomain::on_op_data(uint32_t host, Frame &frame) {
    auto d = proto::decode_op_data(frame.payload);
    if (!d) {
        spdlog::warn("host {}: bad op data: {}", config_.hosts[host].name, d.error().message);
        return;
    }
    const proto::OpReport report = d->report;
    const OpKey key{report.group, report.incarnation, report.seq};
    if (d->kind == proto::OpDataKind::TwoShotResult) {
        // Host `host`'s reduced segment of a two-shot op: straight into every local slot.
        if (!coord_known_ || report.generation != coord_generation_) return;
        const HostOp *op = ops_.find_reported(key);
        if (!op || op->algorithm != Algorithm::TwoShot) return;  // ended here
        exchange_->take_result(host, report.generation, key, *op, report, d->data);
        try_progress_direct(key);
        return;
    }
    // Kept unless stale (a generation that is over here), decided already, not this host's part
    // or over a bound (the op fails everywhere, named).
    auto run = runs_.find(report.group);
    const bool ended_here = run != runs_.end() && run->second.agreed == report.incarnation &&
                            report.seq <= run->second.last_seq && !ops_.find_reported(key) && !solo_running(key);
    bool keep = !((coord_known_ && report.generation < coord_generation_) ||
                  (!coord_known_ && report.generation <= coord_generation_used_)) &&
                !failed_ahead_.count(key) && !ended_here;
    // (Deferred ops' data is no report: the coordinator would not hear that this host is past it.)
    const bool data_deferred = d->kind >= proto::OpDataKind::Doubling || generation_protocol_ >= kLogAlgorithmsProtocol;
    if (ended_here && data_deferred && coord_known_ && report.generation == coord_generation_) past_it(host, report);
    if (keep) {
        std::string over_bound;
        keep = exchange_->take_part(host, *d, std::move(frame.payload), over_bound);
        if (!over_bound.empty()) fail_ahead(report, -ENOBUFS, over_bound);
    }
    // Below protocol 8, one-/two-shot data is the sender's report, checked like any (an OpFail
    // drops the data again).
    if (coordinator_ && !data_deferred) on_report(host, report);
    if (coord_known_ && report.generation == coord_generation_) try_progress_direct(key);
}

// Completes a one- or two-shot op here once this host reported it and every part it needs is in.
void RingDomain::try_progress_direct(const OpKey &key) {
    HostOp *op = ops_.find_reported(key);
    if (!op || op->algorithm == Algorithm::Ring) return;
    if (!exchange_->progress(coord_generation_, key, *op)) {
        // A partner's data does not match: the coordinator decides (a mismatch naming both hosts).
        if (exchange_->mismatched(coord_generation_, key)) tell_coordinator(key, *op, 0);
        return;
    }
    switch (op->algorithm) {
    case Algorithm::OneShot: ++ops_one_shot_; break;
    case Algorithm::TwoShot: ++ops_two_shot_; break;
    case Algorithm::Doubling: ++ops_doubling_; break;
    default: ++ops_halving_doubling_; break;
    }
    if (op->told_coordinator) tell_coordinator(key, *op, proto::kReportDone);  // it may forget the op
    sh_.groups->finished(op->run.op_id, 0, {}, *sh_.done);
    (void)ops_.take_reported(key);
    exchange_->drop(coord_generation_, key);
}

void RingDomain::on_peer_message(uint32_t host, Frame &frame) {
    if (host != self_index_ && frame.type != proto::FrameType::Heartbeat)
        ++(frame.type == proto::FrameType::OpData ? frames_.data_received : frames_.control_received);
    switch (frame.type) {
    case proto::FrameType::Heartbeat: return;
    case proto::FrameType::OpReport: {
        auto r = proto::decode_op_report(frame.payload);
        if (!r || !coordinator_) {
            spdlog::warn("host {}: bad op report: {}", config_.hosts[host].name, r ? "this host is not the coordinator" : r.error().message);
            return;
        }
        on_report(host, *r);
        return;
    }
    case proto::FrameType::GroupJoin: {
        auto j = proto::decode_group_join(frame.payload);
        if (!j || !coordinator_) {
            spdlog::warn("host {}: bad group join: {}", config_.hosts[host].name, j ? "this host is not the coordinator" : j.error().message);
            return;
        }
        Coordinator::Decisions d;
        coordinator_->join(host, *j, d);
        broadcast(d);
        return;
    }
    case proto::FrameType::GroupIncarnation:
        if (host != kCoordinator) break;
        if (auto g = proto::decode_group_incarnation(frame.payload)) on_group_incarnation(*g);
        return;
    case proto::FrameType::OpStart:
        if (host != kCoordinator) break;
        if (auto s = proto::decode_op_start(frame.payload)) on_start(*s);
        return;
    case proto::FrameType::OpData:
        on_op_data(host, frame);
        return;
    case proto::FrameType::OpFail:
        if (host != kCoordinator) break;
        if (auto f = proto::decode_op_fail(frame.payload)) on_fail(*f);
        return;
    default: break;
    }
    spdlog::warn("host {}: unexpected control frame type {}", config_.hosts[host].name, static_cast<int>(frame.type));
}

void RingDomain::on_report(uint32_t host, const proto::OpReport &r) {
    ++coordinator_reports_;
    Coordinator::Decisions d;
    coordinator_->report(host, r, Clock::now(), d);
    broadcast(d);
}

// A coordination frame (report, join, decision) to another host, counted.
void RingDomain::send_control(uint32_t host, const proto::Bytes &frame) {
    ++frames_.control_sent;
    (void)control_->send(host, frame);
}

void RingDomain::broadcast(const Coordinator::Decisions &d) {
    for (const auto &s : d.starts) {
        const proto::Bytes frame = proto::encode_op_start(s);
        for (uint32_t h = 0; h < config_.hosts.size(); ++h)
            if (h != self_index_) send_control(h, frame);
        on_start(s);
    }
    for (const auto &[h, f] : d.fails) {
        if (h == self_index_) on_fail(f);
        else send_control(h, proto::encode_op_fail(f));
    }
    for (const auto &[h, g] : d.groups) {
        if (h == self_index_) on_group_incarnation(g);
        else send_control(h, proto::encode_group_incarnation(g));
    }
}

void RingDomain::on_start(const proto::OpStart &s) {
    if (!coord_known_ || s.generation != coord_generation_) return;
    const OpKey key{s.group, s.incarnation, s.seq};
    const HostOp *rep = ops_.find_reported(key);
    if (!rep) {
        spdlog::warn("op start for group {} op {} that this host did not report", s.group, s.seq);
        return;
    }
    if (rep->algorithm != Algorithm::Ring) {
        spdlog::warn("op start for group {} op {}, which goes by {}", s.group, s.seq, algorithm_name(rep->algorithm));
        return;
    }
    HostOp op = std::move(*ops_.take_reported(key));
    ++ops_ring_;
    EngineWork w = ring_work(op, s.total_ranks, static_cast<uint32_t>(s.op_id));
    w.deadline = op.deadline;
    ops_.running(w.op_id, local_generation_, w.deadline, key, op.run.submitted);
    lanes_[s.lane % lanes_.size()]->engine->post(std::move(w));
}

void RingDomain::on_fail(const proto::OpFail &f) {
    if (!coord_known_ || f.generation != coord_generation_) return;
    if (f.seq == proto::kIncarnationEnds) return on_incarnation_ended(f);
    const OpKey fkey{f.group, f.incarnation, f.seq};
    for (auto &[id, so] : solo_ops_) {
        if (so.key != fkey) continue;
        // Running here (or queued for its lane): the lane cancels it and goes on; its trainers
        // get the coordinator's reason.
        if (!so.fail_code) {
            so.fail_code = f.code;
            so.fail_message = f.message;
            lanes_[so.lane]->engine->cancel(id);
        }
        return;
    }
    exchange_->drop(f.generation, OpKey{f.group, f.incarnation, f.seq});
    auto op = ops_.take_reported(OpKey{f.group, f.incarnation, f.seq});
    auto solo_run = runs_.find(f.group);
    if (solo_run != runs_.end() && (solo_run->second.agreed != f.incarnation || !solo_run->second.solo_epoch))
        solo_run = runs_.end();
    if (op && solo_run != runs_.end())  // it went another way here (a mismatch): past it in the lane too
        lanes_[solo_run->second.lane % lanes_.size()]->engine->skip_to(
            solo_tag_next(solo_op_tag(solo_run->second.solo_epoch, f.seq, nullptr)));
    if (!op) {
        // Decided before this host got that far (a mismatch between two other hosts, say):
        // kept for when its ranks get there. Ops it reported already ended here.
        auto run = runs_.find(f.group);
        // Past it here (it went another way here: a mismatch), in a solo lane: the previous
        // host's messages of it are dropped. Every op of the lane up to it is there already.
        if (run != runs_.end() && run->second.agreed == f.incarnation && run->second.solo_epoch && f.seq <= run->second.last_seq)
            lanes_[run->second.lane % lanes_.size()]->engine->skip_to(
                solo_tag_next(solo_op_tag(run->second.solo_epoch, f.seq, nullptr)));
        if (run != runs_.end() && run->second.agreed == f.incarnation && f.seq > run->second.last_seq) {
            if (failed_ahead_.size() >= kMaxFailedAhead) failed_ahead_.erase(failed_ahead_.begin());
            failed_ahead_[OpKey{f.group, f.incarnation, f.seq}] = {f.code, f.message};
        }
        // The next ops of a solo lane, not here yet (its ranks are late, or never submit them),
        // that the coordinator failed, in a row: the lane skips them now, so that the previous
        // host, which cancelled them, can let out what it sent of them.
        if (solo_run != runs_.end()) {
            GroupRun &r = solo_run->second;
            uint64_t frontier = std::max(r.last_seq, r.skipped);
            while (failed_ahead_.count(OpKey{f.group, f.incarnation, frontier + 1})) ++frontier;
            if (frontier > std::max(r.last_seq, r.skipped)) {
                r.skipped = frontier;
                lanes_[r.lane % lanes_.size()]->engine->skip_to(solo_tag_next(solo_op_tag(r.solo_epoch, frontier, nullptr)));
            }
        }
        return;
    }
    sh_.groups->finished(op->run.op_id, f.code, f.message, *sh_.done);
}

// The coordinator ended a solo lane's incarnation (its ranks left on a host, it started anew
// there): its ops still to come fail here at once, and the lane skips the rest of its grant. What
// runs of it here may be an op every host ran (the host that ended it ran it before its ranks
// left; the end can overtake its last messages): it is cancelled with the reason only once its
// lane stops moving (tick).
void RingDomain::on_incarnation_ended(const proto::OpFail &f) {
    for (auto &[id, so] : solo_ops_) {
        if (std::get<0>(so.key) != f.group || std::get<1>(so.key) != f.incarnation || so.fail_code || so.ended_code) continue;
        so.ended_code = f.code;
        so.ended_message = "group " + f.group + " op " + std::to_string(std::get<2>(so.key)) + ": " + f.message;
    }
    auto run = runs_.find(f.group);
    if (run == runs_.end() || run->second.agreed != f.incarnation) return;
    GroupRun &r = run->second;
    if (r.refused_code == 0) {
        r.refused_code = f.code;
        r.refused = f.message;
    }
    if (r.solo_epoch) {
        lanes_[r.lane % lanes_.size()]->engine->skip_to(kSoloTag | (((r.solo_epoch + 1) & 0x7f) << 24));
        r.solo_epoch = 0;  // (its ops fail here from now on)
    }
}

void RingDomain::expire_host_ops(Clock::time_point now) {
    // An op that needs the ring while it is down, with a host of it known to be down, cannot
    // run before that host is back, and its ranks there are gone with their ringd: it fails now,
    // naming the host, rather than at its deadline.
    if (!coord_known_ && ops_.any_queued()) {
        std::vector<std::pair<std::string, std::string>> down;
        for (auto &h : sh_.hosts_down ? sh_.hosts_down(now) : control_->hosts_down(now))
            for (const auto &m : config_.hosts)
                if (m.name == h.first) down.push_back(std::move(h));
        if (!down.empty()) {
            std::string hosts;
            for (const auto &[name, why] : down) hosts += (hosts.empty() ? "" : "; ") + ("host " + name + " is down (" + why + ")");
            const size_t n = ops_.fail_queued(-ECONNABORTED, [&](const HostOp &op) {
                return "group " + op.run.group + " op " + std::to_string(op.run.seq) + ": the ring is not up: " + hosts +
                       (ring_down_reason_.empty() ? "" : "; " + ring_down_reason_);
            });
            if (n) spdlog::warn("{}{} op(s) failed at once: the ring is not up: {}", whole_ring() ? "" : "ring domain " + key_ + ": ", n, hosts);
        }
    }
    if (coordinator_ && coord_known_) {
        Coordinator::Decisions d;
        coordinator_->expire(now, d);
        broadcast(d);
    }
    // Every op of this host past its state's deadline (daemon/ops/host_ops.h).
    const auto e = ops_.expire(now, [&](const HostOp &op) {
        const std::string head = "group " + op.run.group + " op " + std::to_string(op.run.seq) + " timed out after " +
                                 std::to_string(sh_.groups->op_timeout(op.run.group).count()) + " ms: ";
        if (op.state == OpState::Reported)
            return head + "no decision from the coordinating host " + config_.hosts[kCoordinator].name;
        return head + (coord_known_ ? "not every host joined this incarnation of the group (a job must start or "
                                      "restart on every host of the group)"
                                    : "the ring is not up (" + ring_down_reason_ + ")");
    });
    for (const OpKey &k : e.reported) exchange_->drop(coord_generation_, k);
    if (!e.overdue_running.empty() && control_->ring_up()) {
        // The progress thread did not give a ring op back by its deadline: the links it may
        // still write through are torn down (the generation ends; the op fails once it is back).
        control_->data_link_failed("ring op " + std::to_string(e.overdue_running.front()) + " of this host did not end within " +
                                   std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(HostOps::kReleaseGrace).count()) +
                                   " ms of its deadline");
    }
}

// A step of the daemon's settle(): what the peers sent, then this host's reports, then the
// frames it sent itself. Peers first: a decision that is here already (the coordinator's OpFail
// for an op whose deadline passed) must be known before this host's ranks' late op is reported,
// or the op would complete here on the data the other hosts sent before it failed there. The
// coordinator sends its decisions before its own host's ranks hear of them, so a late op that
// follows from them finds them here.
bool RingDomain::settle_step() {
    bool moved = control_->dispatch();
    moved |= coord_known_ && flush_reports_now();
    moved |= deliver_self_frames();
    return moved;
}

void RingDomain::on_engine_results(uint32_t lane) {
    std::string link_failure;
    int link_code = 0;
    for (auto &r : lanes_.at(lane)->engine->take_results()) {
        const bool ring_ending = r.link_failed && r.generation == local_generation_;
        if (ring_ending) {
            link_failure = r.message;
            link_code = r.status;
        }
        if (r.op_id == 0) continue;
        if (auto so = solo_ops_.find(r.op_id); so != solo_ops_.end()) {
            if (r.status == -ECANCELED && so->second.fail_code) {
                r.status = so->second.fail_code;
                r.message = so->second.fail_message;
            } else if (r.status == 0 && so->second.told && coord_known_) {
                tell_solo(so->second, proto::kReportDone);  // the coordinator may forget it
            }
            solo_ops_.erase(so);
        }
        // A ring op that ended with its link stays until the generation's end fails it with the
        // reason that names the host at fault (HostOps::returned).
        ops_.returned(r.op_id, r.status, r.message, ring_ending && coord_known_);
    }
    // The results (and the slot references they carried back) are released here, on this thread.
    // Bad bytes on a link (a frame or message that fails its MAC, a malformed header) were
    // seen here: the reason is this host's to tell. A closed or reset link is the other end's.
    if (!link_failure.empty()) control_->data_link_failed(link_failure, link_code == -EACCES || link_code == -EPROTO);
}

void RingDomain::tick(Clock::time_point now) {
    control_->tick(now);
    if (coord_known_)  // deferred direct ops that have not completed yet: the coordinator hears of them
        ops_.for_each_reported([&](const OpKey &key, HostOp &op) {
            if (deferred(op.algorithm) && !op.told_coordinator && op.stall_at <= now) tell_coordinator(key, op, 0);
        });
    // Solo lanes' ops whose lane has not moved for a while: the coordinator hears of them (a host
    // that never runs one, or whose op differs, leaves them all waiting).
    if (coord_known_)
        for (auto &[id, so] : solo_ops_) {
            if (so.fail_code) continue;
            const auto quiet = now - std::max(so.posted, lanes_[so.lane]->engine->last_progress());
            if (so.ended_code && quiet >= kStallReport) {  // its incarnation ended, and it does not move
                so.fail_code = so.ended_code;
                so.fail_message = so.ended_message;
                lanes_[so.lane]->engine->cancel(id);
                continue;
            }
            if (so.told) continue;
            if (quiet >= std::min<Clock::duration>(kSoloStallReport, (so.deadline - so.posted) / 4)) tell_solo(so, 0);
        }
    expire_host_ops(now);
    forget_gone_runs();  // also while the ring is down (settle_step reports only while it is up)
    const double dt = std::chrono::duration<double>(now - rate_at_).count();
    if (dt >= 1.0) {
        const uint64_t out = bytes_to_next(), in = bytes_from_prev();
        rate_next_ = static_cast<double>(out - rate_bytes_next_) / dt;
        rate_prev_ = static_cast<double>(in - rate_bytes_prev_) / dt;
        rate_bytes_next_ = out;
        rate_bytes_prev_ = in;
        rate_at_ = now;
    }
}

void RingDomain::hosts_changed(std::vector<uint32_t> members) {
    members_ = std::move(members);
    control_->set_identity(hosts_digest(sh_.config->hosts), sh_.config_version, sh_.instance);
}

void RingDomain::to_part_of_ring(std::vector<uint32_t> members) {
    for (const auto &h : config_.hosts) key_ += (key_.empty() ? "" : ",") + h.name;
    control_->rename(key_, {}, {});
    hosts_changed(std::move(members));
    spdlog::info("ring domain {}: the whole ring before the reload goes on over its hosts (generation {}) for the "
                 "runs of its groups agreed over them; the whole ring is made anew",
                 key_, local_generation_);
}

Status RingDomain::to_whole_ring(std::vector<uint32_t> members, UniqueFd listener) {
    spdlog::info("ring domain {}: its hosts are the whole ring now; it goes on as the ring of every host (generation {})",
                 key_, local_generation_);
    key_.clear();
    control_->rename(key_, sh_.foreign_check, sh_.adopt);
    hosts_changed(std::move(members));
    return control_->take_listener(std::move(listener));
}

void RingDomain::shutdown() {
    for (auto &l : lanes_) {
        l->engine->ring_down(local_generation_);  // a ring op in progress returns at once
        l->engine->stop();
        (void)l->engine->take_results();
    }
}

uint64_t RingDomain::bytes_to_next() const {
    uint64_t b = 0;
    for (const auto &l : lanes_) b += l->engine->bytes_to_next();
    return b;
}

uint64_t RingDomain::bytes_by_reference_to_next() const {
    uint64_t b = 0;
    for (const auto &l : lanes_) b += l->engine->bytes_by_reference_to_next();
    return b;
}

uint64_t RingDomain::bytes_from_prev() const {
    uint64_t b = 0;
    for (const auto &l : lanes_) b += l->engine->bytes_from_prev();
    return b;
}

nlohmann::json RingDomain::status() const {
    using nlohmann::json;
    json members = json::array();
    const uint32_t n = static_cast<uint32_t>(config_.hosts.size());
    const uint32_t next = (self_index_ + 1) % n, prev = (self_index_ + n - 1) % n;
    const auto peers = control_->status();
    for (uint32_t i = 0; i < n; ++i) {
        const auto &p = peers[i];
        json m = {{"name", p.name}, {"address", p.address}, {"port", p.port}, {"self", p.self},
                  {"link", p.self ? "self" : p.control}, {"last_error", p.last_error},
                  {"last_heard_s", p.last_heard_s}, {"next", i == next}, {"prev", i == prev},
                  // Its control connection's protocol version (0: not up), its config version (a
                  // ringd of 7 or later says it), and whether its host list differs from this host's.
                  {"protocol", p.self ? proto::kPeerProtocolVersion : p.protocol},
                  {"config_version", p.self && sh_.config_version ? *sh_.config_version : p.config_version},
                  {"hosts_differ", p.hosts_differ},
                  // Control frames (heartbeats, reports, small ops' data) its socket has not taken yet.
                  {"backlog_bytes", p.self ? 0 : control_->queued_bytes(i)}};
        if (i == next)
            m["data_out"] = {{"bytes", bytes_to_next()}, {"by_reference_bytes", bytes_by_reference_to_next()}, {"rate_Bps", rate_next_}};
        if (i == prev) m["data_in"] = {{"bytes", bytes_from_prev()}, {"rate_Bps", rate_prev_}};
        members.push_back(std::move(m));
    }
    json hosts = json::array();
    for (const auto &h : config_.hosts) hosts.push_back(h.name);
    const HostOps::Counts oc = ops_.counts();
    return {{"generation", control_->generation()},
            {"state", control_->ring_up() ? "up" : "forming"},
            // The version the ring's generation runs at, as its coordinator decided it for every
            // host (the oldest any of them can: a rolling upgrade); while it forms, this host's.
            {"protocol", control_->ring_up() ? control_->generation_protocol() : control_->protocol()},
            // Hosts whose host list differs from this host's: a ring cannot form with them.
            {"hosts_differ", control_->hosts_differ()},
            {"last_abort", last_abort_},
            {"ops_ring", ops_ring_},
            {"ops_ring_solo", ops_solo_},
            {"ops_one_shot", ops_one_shot_},
            {"ops_two_shot", ops_two_shot_},
            {"ops_doubling", ops_doubling_},
            {"ops_halving_doubling", ops_halving_doubling_},
            {"deferred_reports", deferred_reports_},
            // Frames of this ring domain since it was made, heartbeats and ring formation aside:
            // coordination (reports, joins, decisions) and op data (one-/two-shot, doubling,
            // halving-doubling); and the reports this host's coordinator handled (one-/two-shot data
            // counts as its sender's report).
            {"frames",
             {{"control_sent", frames_.control_sent},
              {"control_received", frames_.control_received},
              {"data_sent", frames_.data_sent},
              {"data_received", frames_.data_received}}},
            {"coordinator_reports", coordinator_reports_},
            {"size", n},
            {"lanes", lanes_.size()},
            {"hosts", hosts},
            {"members", members},
            {"op_states", {{"queued", oc.queued}, {"reported", oc.reported}, {"running", oc.running}, {"releasing", oc.releasing}}},
            // Whether the daemons of the ring prove themselves to each other (HMAC-SHA256
            // handshake), and which frames carry MACs afterwards (daemon/transport/frame_mac.h).
            {"auth", !sh_.secret->enabled() ? "none (auth.insecure)"
                     : config_.data_mac     ? "hmac-sha256; control and data frames MACed"
                     : config_.transport == "tcp" ? "hmac-sha256; control frames MACed, data not (auth.data: none)"
                                                  : "hmac-sha256; control frames MACed (RDMA data: not)"},
            // Peer connections closed because too many were still in their handshake (the
            // oldest go first; the whole ring's plane accepts for every domain).
            {"handshakes_refused", control_->handshakes_refused()},
            // Control connections closed for a frame that failed its MAC check.
            {"frames_rejected", control_->frames_rejected()},
            {"coordinator", coordinator_status()}};
}

// The coordinator's view (on its host): ops some hosts reported and others not, groups waiting
// for hosts to join their next incarnation. Elsewhere: which host it is.
nlohmann::json RingDomain::coordinator_status() const {
    using nlohmann::json;
    json c = {{"host", config_.hosts.at(kCoordinator).name}, {"here", coordinator_.has_value()}};
    if (!coordinator_) return c;
    auto names = [&](const std::vector<uint32_t> &hosts) {
        json v = json::array();
        for (uint32_t h : hosts) v.push_back(config_.hosts.at(h).name);
        return v;
    };
    json pending = json::array(), joins = json::array();
    for (const auto &p : coordinator_->pending_view(Clock::now()))
        pending.push_back({{"group", p.group}, {"incarnation", p.incarnation}, {"seq", p.seq}, {"reported", names(p.reported)},
                           {"missing", names(p.missing)}, {"fails_in_s", p.fails_in_s}});
    for (const auto &j : coordinator_->joins_view())
        joins.push_back({{"group", j.group}, {"joined", names(j.joined)}, {"missing", names(j.missing)}});
    c["pending"] = pending;
    c["joins_waiting"] = joins;
    return c;
}

nlohmann::json RingDomain::pending_ops(Clock::time_point now) const {
    using nlohmann::json;
    auto names = [&](const std::vector<uint32_t> &hosts) {
        json v = json::array();
        for (uint32_t h : hosts) v.push_back(config_.hosts.at(h).name);
        return v;
    };
    auto join = [](const json &v) {
        std::string s;
        for (const auto &x : v) s += (s.empty() ? "" : ", ") + x.get<std::string>();
        return s;
    };
    const std::string coord = config_.hosts.at(kCoordinator).name;
    std::map<OpKey, const Coordinator::PendingView *> waiting;
    std::vector<Coordinator::PendingView> pv;
    std::map<std::string, Coordinator::JoinView> joins;
    if (coordinator_) {
        pv = coordinator_->pending_view(now);
        for (const auto &p : pv) waiting[{p.group, p.incarnation, p.seq}] = &p;
        for (auto &j : coordinator_->joins_view()) joins[j.group] = std::move(j);
    }
    json out = json::array();
    for (const auto &v : ops_.view(now)) {
        json e = {{"group", v.group}, {"seq", v.seq}, {"state", op_state_name(v.state)}, {"age_s", v.age_s},
                  {"algorithm", algorithm_name(v.algorithm)}, {"missing_hosts", json::array()}, {"missing_ranks", json::array()}};
        std::string why;
        switch (v.state) {
        case OpState::Queued: {
            auto run = runs_.find(v.group);
            if (v.failed_here) {
                why = v.seq == proto::kIncarnationEnds ? "its turn to tell the other hosts that this incarnation ended here"
                                                       : "its turn to be reported as this host's failure";
            } else if (run == runs_.end() || run->second.agreed == 0) {
                why = "the group's incarnation to be agreed: every host of the group joins it";
                if (auto j = joins.find(v.group); j != joins.end()) {
                    e["missing_hosts"] = names(j->second.missing);
                    why += "; not joined yet: " + join(e["missing_hosts"]);
                } else if (!coordinator_) {
                    why += " (the coordinator, " + coord + ", knows which have not)";
                }
            } else {
                why = "an earlier op of the group to be reported first";
            }
            break;
        }
        case OpState::Reported:
            if (auto w = waiting.find({v.group, v.incarnation, v.seq}); w != waiting.end()) {
                e["missing_hosts"] = names(w->second->missing);
                e["fails_in_s"] = w->second->fails_in_s;
                why = "host(s) " + join(e["missing_hosts"]) + " to submit it (reported by " + join(names(w->second->reported)) + ")";
            } else if (coordinator_) {
                why = v.algorithm == Algorithm::Ring ? "its start" : "the other hosts' data";
            } else {
                why = std::string(v.algorithm == Algorithm::Ring ? "the coordinator's start" : "the other hosts' data") +
                      " (the coordinator, " + coord + ", names the hosts that have not submitted it)";
            }
            break;
        case OpState::Running:
            if (auto w = waiting.find({v.group, v.incarnation, v.seq}); w != waiting.end()) {
                // A solo lane's op that stalled: the coordinator knows which hosts have not run it.
                e["missing_hosts"] = names(w->second->missing);
                e["fails_in_s"] = w->second->fails_in_s;
                why = "host(s) " + join(e["missing_hosts"]) + " to submit it (reported by " + join(names(w->second->reported)) + ")";
            } else if (solo_running({v.group, v.incarnation, v.seq}) &&
                       now - lanes_.at(solo_lane({v.group, v.incarnation, v.seq}))->engine->last_progress() >= kSoloStallReport) {
                why = "the other hosts to start it (a solo lane; the coordinator, " + coord +
                      ", names the hosts that have not submitted it)";
            } else {
                why = "the ring: its data is moving";
            }
            break;
        case OpState::Releasing: why = "the progress thread to give it back (its ring generation ended)"; break;
        }
        e["waiting_for"] = why;
        out.push_back(std::move(e));
    }
    return out;
}

std::pair<uint32_t, Clock::duration> RingDomain::most_stalled_lane(Clock::time_point now) const {
    std::pair<uint32_t, Clock::duration> worst{0, Clock::duration::zero()};
    for (uint32_t k = 0; k < lanes_.size(); ++k)
        if (const auto d = lanes_[k]->engine->stalled_for(now); d > worst.second) worst = {k, d};
    return worst;
}

}  // namespace ringd
