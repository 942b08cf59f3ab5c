// RingDomain (ring_domain.h): the op's way across the hosts of a domain — set-up, the ring
// generations, peers' frames and the coordinator's decisions, deadlines, the progress threads'
// results. Reports and incarnations are in ring_reports.cpp, the direct algorithms' data in
// ring_direct.cpp, solo lanes in ring_solo.cpp, status in ring_status.cpp.
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
    // (and over TCP an all_to_all's: a piece to drop into and every peer's counts, both ways; and
    // the exchange of shards' slots)
    const uint64_t staging_bytes =
        std::max({RingEngine::staging_bytes(ring_options),
                  config_.transport == "tcp" ? AllToAllEngine::staging_bound(static_cast<uint32_t>(config_.hosts.size())) : 0,
                  config_.transport == "tcp" ? ExchangeEngine::staging_bound() : 0});
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
        // registered once for the domain's lifetime, on the NIC's node; the progress thread on
        // its CPUs.
        const topology::Plan *plan = sh_.topology;
        auto mem = topology::NodeMemory::allocate(staging_bytes, plan ? plan->lane_memory_node() : -1);
        if (!mem) return make_error(mem.error().code, "cannot set up the ring's staging memory: " + mem.error().message);
        l->staging_mem = std::move(*mem);
        auto reg = l->transport->register_region(l->staging_mem.get(), staging_bytes);
        if (!reg) return reg.error();
        l->staging = RegisteredRegion(l->transport, *reg);
        auto e = ProgressEngine::start(l->transport, l->staging.handle(), ring_options, config_.timeouts.op);
        if (!e) return e.error();
        l->engine = std::move(*e);
        l->engine->set_name("ringd-ring" + std::to_string(lanes_.size()));
        if (plan)
            if (auto ok = l->engine->pin(plan->lane_cpus()); !ok) spdlog::warn("ring lane {}: {}", lanes_.size(), ok.error().message);
        lanes_.push_back(std::move(l));
    }

    ControlPlane::Callbacks cb;
    cb.ring_up = [this](uint64_t g, DataSockets to_next, DataSockets from_prev, std::vector<DataSockets> mesh) {
        on_ring_up(g, std::move(to_next), std::move(from_prev), std::move(mesh));
    };
    cb.ring_down = [this](const std::string &why) { on_ring_down(why); };
    cb.message = [this](uint32_t host, Frame &f) { on_peer_message(host, f); };
    cb.prepare_socket = [t = sh_.transport](int fd) { t->prepare_socket(fd); };
    cb.rail_streams = [this](uint64_t g, uint32_t lane, uint32_t rail, bool to_next, DataSockets d) {
        if (lane >= lanes_.size()) return;
        if (auto ok = lanes_[lane]->engine->offer_rail_streams(g, to_next, rail, std::move(d.fds), std::move(d.keys)); !ok)
            spdlog::warn("ring lane {}: new connections for rail {}: {}", lane, rail, ok.error().message);
    };
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
        [this](uint32_t h, proto::Bytes f) {
            ++frames_.data_sent;
            (void)control_->send(h, std::move(f));
        },
        [this](uint32_t h) { return control_->queued_bytes(h); });
    if (!whole_ring()) spdlog::info("ring domain {}: made (this host is {} of {})", key_, self_index_, members_.size());
    return Ok{};
}

void RingDomain::on_ring_up(uint64_t generation, DataSockets to_next, DataSockets from_prev, std::vector<DataSockets> mesh) {
    local_generation_ = generation;
    if (sh_.generation_seen) sh_.generation_seen(generation);
    const uint32_t n = static_cast<uint32_t>(config_.hosts.size());
    // The data connections lane by lane (ControlPlane: streams x rails x lanes, in stream order).
    const size_t per = to_next.fds.size() / lanes_.size();
    for (size_t k = 0; k < lanes_.size(); ++k) {
        RingLinks l;
        l.generation = generation;
        l.rank = self_index_;
        l.size = n;
        l.next_name = config_.hosts[(self_index_ + 1) % n].name;
        l.prev_name = config_.hosts[(self_index_ + n - 1) % n].name;
        l.self_name = config_.hosts[self_index_].name;
        const HostEntry &me = config_.hosts[self_index_];
        for (size_t i = k * per; i < (k + 1) * per && i < to_next.fds.size(); ++i) {
            l.to_next.push_back(std::move(to_next.fds[i]));
            l.to_next_keys.push_back(to_next.keys.at(i));
            if (me.rail_count() > 1) {
                l.to_next_rails.push_back(to_next.rails.at(i));
                l.to_next_weights.push_back(me.rail_weight(to_next.rails.at(i)));
            }
        }
        for (size_t i = k * per; i < (k + 1) * per && i < from_prev.fds.size(); ++i) {
            l.from_prev.push_back(std::move(from_prev.fds[i]));
            l.from_prev_keys.push_back(from_prev.keys.at(i));
            if (me.rail_count() > 1) {
                l.from_prev_rails.push_back(from_prev.rails.at(i));
                l.from_prev_weights.push_back(me.rail_weight(from_prev.rails.at(i)));
            }
        }
        for (DataSockets &d : mesh) {
            RingLinks::Mesh &m = l.mesh.emplace_back();
            m.peer = d.peer;
            m.name = config_.hosts.at(d.peer).name;
            const size_t per_mesh = d.fds.size() / lanes_.size();
            for (size_t i = k * per_mesh; i < (k + 1) * per_mesh && i < d.fds.size(); ++i) {
                m.fds.push_back(std::move(d.fds[i]));
                m.keys.push_back(d.keys.at(i));
                if (me.rail_count() > 1) {
                    m.rails.push_back(d.rails.at(i));
                    m.weights.push_back(me.rail_weight(d.rails.at(i)));
                }
            }
        }
        lanes_[k]->engine->ring_up(std::move(l));
    }
    // The generation is agreed: every host reports ops in it from now on, at the one protocol the
    // coordinator chose for all of its hosts, so every host chooses algorithms alike.
    generation_protocol_ = control_->generation_protocol();
    generation_exchange_ = control_->generation_exchange();
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
        else send_control(h, proto::encode_op_fail(f, f.seq == proto::kIncarnationEnds && generation_protocol_ >= proto::kRootedProtocol));
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
    static const GroupRun kNoRun;
    auto run = runs_.find(s.group);
    const bool agreed = run != runs_.end() && run->second.agreed == s.incarnation;
    EngineWork w = ring_work(op, agreed ? run->second : kNoRun, s.total_ranks, static_cast<uint32_t>(s.op_id));
    if (agreed) w.residual = feedback_for(run->second, op.run);
    else ++wire_ops_[static_cast<size_t>(op.run.desc.wire) % kWireFormatCount];
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

// The coordinator ended an incarnation with a solo lane (its ranks left on a host, it started
// anew there): its ops after `f.after` fail here (those up to it ended on the host that ended it,
// and go on), and the lane skips the rest of its grant once this host has posted them (at once if
// it has; else flush_reports_now, when it gets past them or ends too). What runs of the later ones
// here may be an op every host ran (the host that ended it ran it before its ranks left; the end
// can overtake its last messages): it is cancelled with the reason only once its lane stops
// moving (tick). A later end may spare fewer.
void RingDomain::on_incarnation_ended(const proto::OpFail &f) {
    for (auto &[id, so] : solo_ops_) {
        if (std::get<0>(so.key) != f.group || std::get<1>(so.key) != f.incarnation || so.fail_code || so.ended_code ||
            std::get<2>(so.key) <= f.after)
            continue;
        so.ended_code = f.code;
        so.ended_message = "group " + f.group + " op " + std::to_string(std::get<2>(so.key)) + ": " + f.message;
    }
    auto run = runs_.find(f.group);
    if (run == runs_.end() || run->second.agreed != f.incarnation) return;
    GroupRun &r = run->second;
    if (r.refused_code == 0 || f.after < r.end_after) {
        // (A later end that spares fewer names its host: the ops it fails here fail because of it.)
        r.refused_code = f.code;
        r.refused = f.message;
        r.end_after = f.after;
    }
    end_solo_lane(r);
}

// A solo lane whose incarnation ended (on_incarnation_ended): once this host has posted every op
// of it that goes on (up to end_after), or will post no more of it (`now`), the lane skips the
// rest of its grant, and the run's later ops fail here.
void RingDomain::end_solo_lane(GroupRun &r, bool now) {
    if (!r.solo_epoch || r.refused_code == 0 || (!now && r.last_seq < r.end_after)) return;
    lanes_[r.lane % lanes_.size()]->engine->skip_to(kSoloTag | (((r.solo_epoch + 1) & 0x7f) << 24));
    r.solo_epoch = 0;  // (its ops fail here from now on)
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
    moved |= pump_all_to_all();
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
    // seen here: the reason is this host's to tell, as is a peer that no rail of the link reaches
    // (several rails: every one timed out). A closed or reset link is the other end's.
    if (!link_failure.empty())
        control_->data_link_failed(link_failure, link_code == -EACCES || link_code == -EPROTO || link_code == -EHOSTUNREACH);
}

void RingDomain::tick(Clock::time_point now) {
    control_->tick(now);
    // Rails of the links to the next host that failed and are settled: dialed anew.
    if (control_->rails() > 1 && control_->ring_up())
        for (uint32_t k = 0; k < lanes_.size(); ++k) {
            const ProgressEngine &e = *lanes_[k]->engine;
            if (e.links_generation() != control_->generation()) continue;
            const uint32_t resynced = rails_resynced_of(e.next_rails());
            for (uint32_t r = 0; r < control_->rails(); ++r)
                if (resynced & (1u << r)) control_->redial_rail(k, r, now);
        }
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
        for (uint32_t r = 0; r < config_.hosts[self_index_].rail_count() && r < kMaxRailsPerLink; ++r) {
            const uint64_t b = bytes_to_next_on_rail(r);
            rate_rail_[r] = static_cast<double>(b - rate_bytes_rail_[r]) / dt;
            rate_bytes_rail_[r] = b;
        }
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

}  // namespace ringd
