// The Daemon's ring domains (daemon/ring/ring_domain.h): the whole ring's, made at start, and one
// per host set of the groups over part of it, made when such a group first joins here or a host
// of it dials in for it.
#include <spdlog/spdlog.h>

#include "daemon/daemon.h"

namespace ringd {

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
    for (auto &d : domains_)
        if (d->members() == hosts) return d.get();
    if (domains_.size() >= kMaxDomains)
        return make_error(-EBUSY, "this host is in " + std::to_string(domains_.size()) +
                                      " ring domains (host sets of groups), the most it keeps");
    auto d = RingDomain::create(shared_, hosts);
    if (!d) return d.error();
    if (auto s = watch_domain(**d, static_cast<uint32_t>(domains_.size())); !s) return s.error();
    domains_.push_back(std::move(*d));
    domains_.front()->control().set_domains(domains_.size());
    return domains_.back().get();
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
    for (auto &d : domains_)
        if (d->members() == *hosts) return Ok{};
    if (domains_.size() >= kMaxDomains)
        return make_error(-EBUSY, "ring domain " + hello.domain + ": this host keeps at most " + std::to_string(kMaxDomains));
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
