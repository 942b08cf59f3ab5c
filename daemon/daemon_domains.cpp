// The Daemon's ring domains (daemon/ring/ring_domain.h): the whole ring's, made at start, and one
// per host set of the groups over part of it, made when such a group first joins here or a host
// of it dials in for it.
#include <spdlog/spdlog.h>

#include <set>

#include "daemon/daemon.h"

namespace ringd {
namespace {

// A domain without groups here is let go after kForgetIdle, or after kLetGoIdle when a new one
// needs its place (limits.ring_domains).
constexpr auto kLetGoIdle = std::chrono::seconds(10);
constexpr auto kForgetIdle = std::chrono::seconds(60);

}  // namespace

Status Daemon::setup_ring() {
    if (!config_.secret_file.empty()) {
        auto s = PeerSecret::load(config_.secret_file);
        if (!s) return s.error();
        secret_ = std::move(*s);
    } else {
        spdlog::warn("auth.insecure: daemons of this ring do not authenticate each other; anyone who reaches "
                     "a ring port can join the ring and read or change gradients (set auth.secret_file)");
    }
    shared_.config = &config_;
    shared_.host = host_;
    shared_.groups = &groups_;
    shared_.done = &done_;
    shared_.secret = &secret_;
    shared_.transport = transport_.get();
    shared_.record_error = [this](const std::string &m) { record_error(m); };
    shared_.domain_of = [this](const std::string &group) -> const RingDomain * { return domain_of(group); };
    shared_.foreign_check = [this](const proto::PeerHello &h) { return foreign_check(h); };
    shared_.adopt = [this](UniqueFd fd, const proto::PeerHello &h, const std::string &ip) { adopt(std::move(fd), h, ip); };
    std::vector<uint32_t> all(config_.hosts.size());
    for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
    auto d = domain_for(all);
    if (!d) return d.error();
    return Ok{};
}

Result<RingDomain *> Daemon::domain_for(const std::vector<uint32_t> &hosts) {
    size_t live = 0;
    for (auto &d : domains_) {
        if (!d) continue;
        ++live;
        if (d->members() == hosts) return d.get();
    }
    if (live >= config_.limits.ring_domains && !let_go_idle_domain(kLetGoIdle, false))
        return make_error(-EBUSY, "this host runs rings for " + std::to_string(live) +
                                      " host sets (limits.ring_domains), each with groups here");
    auto d = RingDomain::create(shared_, hosts);
    if (!d) return d.error();
    // The first free place (one let go), else a new one; [0] is the whole ring's.
    size_t at = 1;
    while (at < domains_.size() && domains_[at]) ++at;
    if (domains_.empty()) at = 0;
    if (auto s = watch_domain(**d, static_cast<uint32_t>(at)); !s) return s.error();
    if (at == domains_.size()) domains_.emplace_back();
    domains_[at] = std::move(*d);
    domains_.front()->control().set_domains(live + 1);
    return domains_[at].get();
}

// Over limits.ring_domains: the domain (not the whole ring's) whose last op is the oldest, among
// those without a group here for kLetGoIdle, is let go. Its peers see its connections close and end its
// generation; they keep dialing while they have groups in it, and it is made again if it is
// needed here again.
bool Daemon::let_go_idle_domain(Clock::duration idle_for, bool all) {
    std::set<const RingDomain *> used;
    for (const auto &[group, d] : group_domain_) used.insert(d);
    groups_.for_each_local_id([&](const std::string &group, uint64_t) {  // joined, no op yet
        for (size_t i = 1; i < domains_.size(); ++i) {
            const auto *h = groups_.hosts_of(group);
            if (domains_[i] && h && *h == domains_[i]->members()) used.insert(domains_[i].get());
        }
    });
    bool any = false;
    for (;;) {
        size_t victim = 0;
        for (size_t i = 1; i < domains_.size(); ++i) {
            const RingDomain *d = domains_[i].get();
            // Idle a while: peers that still dial for domains this host has no groups in cannot
            // make it swap them back and forth.
            if (!d || used.count(d) || !d->idle() || Clock::now() - d->last_op() < idle_for) continue;
            if (!victim || d->last_op() < domains_[victim]->last_op()) victim = i;
        }
        if (!victim) return any;
        spdlog::info("ring domain {}: let go (no groups here for {} s)", domains_[victim]->key(),
                     std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - domains_[victim]->last_op()).count());
        unwatch_domain(*domains_[victim]);
        domains_[victim]->shutdown();
        domains_[victim].reset();
        any = true;
        if (!all) return true;
    }
}

void Daemon::forget_idle_domains() {
    if (domains_.size() > 1) (void)let_go_idle_domain(kForgetIdle, true);
}

bool Daemon::local_group(const std::string &group) const {
    const auto *hosts = groups_.hosts_of(group);
    return hosts && hosts->size() == 1;
}

RingDomain *Daemon::domain_of(const std::string &group) {
    if (!multi_host()) return nullptr;
    if (const auto *hosts = groups_.hosts_of(group)) {
        if (hosts->size() == 1) return nullptr;  // this host alone
        std::vector<uint32_t> members = *hosts;
        if (members.empty()) {
            members.resize(config_.hosts.size());
            for (uint32_t i = 0; i < members.size(); ++i) members[i] = i;
        }
        auto d = domain_for(members);
        if (!d) return nullptr;
        group_domain_[group] = *d;
        return *d;
    }
    auto it = group_domain_.find(group);  // gone here; its last failures still go to its domain
    return it == group_domain_.end() ? nullptr : it->second;
}

// Groups gone here whose domain has nothing of them left.
void Daemon::forget_groups() {
    for (auto it = group_domain_.begin(); it != group_domain_.end();) {
        if (!groups_.hosts_of(it->first) && !it->second->has_group_state(it->first)) it = group_domain_.erase(it);
        else ++it;
    }
}

// A domain's key (PeerHello::domain) as config indices: known hosts, in ring order, this host among
// them, a proper subset of two or more.
Result<std::vector<uint32_t>> Daemon::domain_hosts(const std::string &key) const {
    std::vector<uint32_t> out;
    size_t at = 0;
    while (at <= key.size()) {
        const size_t end = std::min(key.find(',', at), key.size());
        auto i = find_host(config_, key.substr(at, end - at));
        if (!i) return make_error(-EACCES, "ring domain " + key + " names a host that is not in this ring's config");
        if (!out.empty() && *i <= out.back()) return make_error(-EPROTO, "ring domain " + key + " is not in ring order");
        out.push_back(static_cast<uint32_t>(*i));
        at = end + 1;
    }
    if (out.size() < 2 || out.size() >= config_.hosts.size())
        return make_error(-EPROTO, "ring domain " + key + " is not a part of the ring of two or more hosts");
    if (std::find(out.begin(), out.end(), self_index_) == out.end())
        return make_error(-EACCES, "ring domain " + key + " does not include this host (" + host_ + ")");
    return out;
}

Status Daemon::foreign_check(const proto::PeerHello &hello) {
    auto hosts = domain_hosts(hello.domain);
    if (!hosts) return hosts.error();
    auto from = find_host(config_, hello.from);
    if (!from || std::find(hosts->begin(), hosts->end(), static_cast<uint32_t>(*from)) == hosts->end())
        return make_error(-EACCES, "host " + hello.from + " is not in ring domain " + hello.domain);
    size_t live = 0;
    for (auto &d : domains_) {
        if (!d) continue;
        ++live;
        if (d->members() == *hosts) return Ok{};
    }
    // Made when the connection is handed over (letting an idle one go if there is one to spare).
    if (live >= config_.limits.ring_domains) {
        bool spare = false;
        for (size_t i = 1; i < domains_.size(); ++i)
            spare = spare || (domains_[i] && domains_[i]->idle() && Clock::now() - domains_[i]->last_op() >= kLetGoIdle);
        if (!spare)
            return make_error(-EBUSY, "ring domain " + hello.domain + ": this host runs rings for " + std::to_string(live) +
                                          " host sets (limits.ring_domains)");
    }
    return Ok{};
}

void Daemon::adopt(UniqueFd fd, const proto::PeerHello &hello, const std::string &ip) {
    auto hosts = domain_hosts(hello.domain);
    Result<RingDomain *> d = hosts ? domain_for(*hosts) : Result<RingDomain *>(hosts.error());
    if (!d) {
        spdlog::warn("a connection from {} for ring domain {}: {}", hello.from, hello.domain, d.error().message);
        return;
    }
    (*d)->control().adopt(std::move(fd), hello, ip);
}

}  // namespace ringd
