// The Daemon's ring domains (daemon/ring/ring_domain.h): the whole ring's, made at start, and one
// per host set of the groups over part of it, made when such a group first joins here (its
// peers' connections for it are refused until then: a host never keeps a domain for its peers'
// sake alone) and let go once it has had no group here for a while.
#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include <spdlog/spdlog.h>

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
    shared_.adopt = [this](UniqueFd fd, const proto::PeerHello &h, const std::string &ip, const SessionKeys &keys) {
        adopt(std::move(fd), h, ip, keys);
    };
    load_generation();
    shared_.generation_floor = &generation_kept_;
    shared_.config_version = &config_version_;
    {
        std::random_device rd;
        do shared_.instance = uint64_t{rd()} << 32 | rd();
        while (shared_.instance == 0);
    }
    shared_.hosts_down = [this](Clock::time_point now) {
        return domains_.empty() || !domains_.front() ? std::vector<std::pair<std::string, std::string>>{}
                                                     : domains_.front()->control().hosts_down(now);
    };
    shared_.generation_seen = [this](uint64_t g) { keep_generation(g); };
    std::vector<uint32_t> all(config_.hosts.size());
    for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
    auto d = domain_for(all);
    if (!d) return d.error();
    return Ok{};
}

// Generations only grow, also when every host of the ring restarts (incarnations of groups are
// numbered from them, and operators follow a ring's story by them): the newest one a ring here
// ran is kept in $STATE_DIRECTORY/generation (the unit's StateDirectory=ringd, /var/lib/ringd) and
// announced again after a restart. Without a state directory (ringd started by hand) a ring whose
// every host restarted counts from 1 again.
void Daemon::load_generation() {
    const char *dirs = std::getenv("STATE_DIRECTORY");  // systemd: colon-separated, ours first
    if (!dirs || !*dirs) return;
    const std::string dir(dirs, std::strcspn(dirs, ":"));
    generation_file_ = dir + "/generation";
    std::string text(32, '\0');
    UniqueFd fd(::open(generation_file_.c_str(), O_RDONLY | O_CLOEXEC));
    const ssize_t got = fd ? ::read(fd.get(), text.data(), text.size() - 1) : -1;
    if (got <= 0) return;  // none yet (a first start), or unreadable: a new ring counts from 1
    text.resize(static_cast<size_t>(got));
    char *end = nullptr;
    errno = 0;
    const unsigned long long g = std::strtoull(text.c_str(), &end, 10);
    if (!std::isdigit(static_cast<unsigned char>(text[0])) || errno != 0 || (*end != '\n' && *end != '\0') ||
        g > proto::kMaxGeneration) {
        spdlog::warn("{}: not a generation number (0 to 2^40); ring generations start afresh", generation_file_);
        return;
    }
    generation_kept_ = g;
    spdlog::info("the newest ring generation before this start was {} ({})", g, generation_file_);
}

void Daemon::keep_generation(uint64_t g) {
    if (g <= generation_kept_) return;
    generation_kept_ = g;
    if (generation_file_.empty()) return;
    // A whole new file, then renamed over the old one: a crash leaves the old number or the new.
    const std::string tmp = generation_file_ + ".new";
    const std::string text = std::to_string(g) + "\n";
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    const bool ok = fd && ::write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                    ::fsync(fd.get()) == 0 && ::rename(tmp.c_str(), generation_file_.c_str()) == 0;
    if (!ok && !generation_write_failed_) {
        generation_write_failed_ = true;  // said once: ringd runs on, a restart may count from an older one
        spdlog::warn("cannot keep ring generation {} in {}: {}", g, generation_file_, errno_string(errno));
    }
}

// A reload's host list, applied while ringd runs. Ring domains whose hosts are all still there,
// at the same addresses and ports and in the same order, keep running (their groups' ops never
// notice), the whole ring's included: a list that only adds hosts leaves the old whole ring running
// as a domain over part of the new one, named by its hosts, for the groups whose runs were agreed
// over it (every group keeps the hosts it joined with; a group over every host runs over the new
// list from its ranks' next start), while the whole ring is made anew over the new list, on the
// listening socket handed over. A list that removes hosts may make a domain over part of the
// ring the whole of it: that one goes on as the whole ring. A domain with a host that left or
// moved ends, and its groups' ops fail once, naming the change (their ranks reconnect to start
// them again). What cannot change this way waits for a restart: this host's own address or port,
// and a change between one host and several.
std::string Daemon::apply_hosts(const std::vector<HostEntry> &next) {
    const std::vector<HostEntry> old = config_.hosts;
    auto same = [](const HostEntry &a, const HostEntry &b) { return a.name == b.name && a.address == b.address && a.port == b.port; };
    if (std::equal(old.begin(), old.end(), next.begin(), next.end(), same)) return {};
    if (old.size() <= 1 && next.size() <= 1) return "a ring of one host takes its host list at a restart";
    if (old.size() <= 1 || next.size() <= 1) return "a change between one host and several";
    uint32_t self_new = 0;
    for (uint32_t j = 0; j < next.size(); ++j)
        if (next[j].name == host_) self_new = j;
    if (next[self_new].address != old[self_index_].address || next[self_new].port != old[self_index_].port)
        return "this host's own address or port";
    // Old index -> new index for the hosts still there as they were; why each other one is not.
    std::vector<std::optional<uint32_t>> to(old.size());
    std::vector<std::string> gone(old.size());
    for (uint32_t i = 0; i < old.size(); ++i) {
        gone[i] = "host " + old[i].name + " left the host list";
        for (uint32_t j = 0; j < next.size(); ++j) {
            if (next[j].name != old[i].name) continue;
            if (next[j].address == old[i].address && next[j].port == old[i].port) to[i] = j;
            else gone[i] = "host " + old[i].name + " moved to " + next[j].address + ":" + std::to_string(next[j].port);
        }
    }
    // Whether a host set (old indices, ring order) is still there, in the same order; why not.
    auto kept = [&](const std::vector<uint32_t> &hosts, std::vector<uint32_t> &out) -> std::string {
        out.clear();
        for (uint32_t i : hosts) {
            if (!to[i]) return gone[i];
            if (!out.empty() && *to[i] < out.back()) return "the order of its hosts changed";
            out.push_back(*to[i]);
        }
        return {};
    };
    const std::string head = "the host list changed (a reload on host " + host_ + ", config version " + config_version_ + ")";
    // The listening socket goes from the old whole ring to the new one: it never closes.
    UniqueFd listener = domains_.empty() || !domains_.front() ? UniqueFd{} : domains_.front()->release_listener();
    // Every domain, the whole ring's first: kept (indices remapped below) or ended. A kept one
    // over every host of the new list is the new whole ring.
    std::vector<std::pair<RingDomain *, std::vector<uint32_t>>> keep;
    std::map<RingDomain *, std::string> ended;
    RingDomain *whole = nullptr, *old_whole = nullptr;
    for (size_t k = 0; k < domains_.size(); ++k) {
        if (!domains_[k]) continue;
        std::vector<uint32_t> m;
        std::string why = kept(domains_[k]->members(), m);
        if (why.empty() && k == 0) {
            size_t bytes = m.size() - 1;
            for (uint32_t j : m) bytes += next[j].name.size();
            if (bytes > proto::kMaxDomainBytes) why = "the names of its hosts are too long for a ring domain's";
        }
        if (!why.empty()) {
            ended[domains_[k].get()] = head + ": " + why;
            continue;
        }
        if (k == 0) old_whole = domains_[k].get();
        else if (m.size() == next.size()) whole = domains_[k].get();
        keep.emplace_back(domains_[k].get(), std::move(m));
    }
    // Their progress threads stop before their groups' ops are failed (nothing writes a slot after).
    for (auto &[d, why] : ended) {
        spdlog::warn("ring domain {}: ended: {}", d->key().empty() ? "(every host)" : d->key(), why);
        unwatch_domain(*d);
        d->shutdown();
    }
    for (const auto &[group, hosts] : groups_.group_hosts()) {
        auto e = ended.find(domain_of(group));
        if (e != ended.end()) groups_.end_group(group, e->second, done_);
    }
    for (auto it = group_domain_.begin(); it != group_domain_.end();)
        it = ended.count(it->second) ? group_domain_.erase(it) : std::next(it);
    // The new list, and every index into it.
    std::vector<uint32_t> map(old.size(), UINT32_MAX);
    for (uint32_t i = 0; i < old.size(); ++i)
        if (to[i]) map[i] = *to[i];
    groups_.remap_hosts(map);
    config_.hosts = next;
    self_index_ = self_new;
    gateway_->set_self(self_index_);
    // The domains' places (their fds are watched by place): the others keep theirs; [0] is the
    // whole ring's (a kept domain that is the whole ring now moves there); the old whole ring, if
    // it goes on, moves to the first free one.
    std::vector<std::unique_ptr<RingDomain>> places(std::max<size_t>(1, domains_.size()));
    std::unique_ptr<RingDomain> moving_old, moving_whole;
    for (size_t k = 0; k < domains_.size(); ++k) {
        auto &x = domains_[k];
        if (!x) continue;
        if (ended.count(x.get())) x.reset();  // its thread stopped above
        else if (x.get() == old_whole) moving_old = std::move(x);
        else if (x.get() == whole) moving_whole = std::move(x);
        else places[k] = std::move(x);
    }
    domains_ = std::move(places);
    for (auto &[d, m] : keep) {
        if (d == old_whole) d->to_part_of_ring(std::move(m));
        else if (d == whole) {
            if (auto s = d->to_whole_ring(std::move(m), std::move(listener)); !s)
                spdlog::critical("reload: ring domain {} as the whole ring: {}", d->key(), s.error().message);
        } else {
            d->hosts_changed(std::move(m));
        }
    }
    if (moving_whole) {
        unwatch_domain(*moving_whole);
        if (auto s = watch_domain(*moving_whole, 0); !s) spdlog::critical("reload: {}", s.error().message);
        domains_[0] = std::move(moving_whole);
    }
    if (moving_old) {
        size_t at = 1;
        while (at < domains_.size() && domains_[at]) ++at;
        if (at == domains_.size()) domains_.emplace_back();
        unwatch_domain(*moving_old);
        if (auto s = watch_domain(*moving_old, static_cast<uint32_t>(at)); !s) spdlog::critical("reload: {}", s.error().message);
        domains_[at] = std::move(moving_old);
    }
    if (!whole) {
        // The whole ring over the new list, in its place ([0]), on the listening socket.
        std::vector<uint32_t> all(next.size());
        for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
        auto d = RingDomain::create(shared_, all, std::move(listener));
        if (!d) {
            spdlog::critical("reload: cannot make the ring over the new host list: {}", d.error().message);
            return {};  // the host list is applied; the ring is what failed (status and log say why)
        }
        if (auto s = watch_domain(**d, 0); !s) spdlog::critical("reload: {}", s.error().message);
        domains_[0] = std::move(*d);
    }
    size_t live = 0;
    for (auto &x : domains_) live += x != nullptr;
    domains_.front()->control().set_domains(live);
    spdlog::warn("reload: the host list is now {} host(s) ({} kept ring domain(s){}, {} ended)", next.size(), keep.size(),
                 old_whole ? ", the whole ring's before among them" : "", ended.size());
    return {};
}

Result<RingDomain *> Daemon::domain_for(const std::vector<uint32_t> &hosts) {
    if (RingDomain *d = find_domain(hosts)) return d;
    size_t live = 0;
    for (auto &d : domains_) live += d != nullptr;
    if (live >= config_.limits.ring_domains) {
        const size_t victim = idle_domain(kLetGoIdle);
        if (!victim)
            return make_error(-EBUSY, "this host runs rings for " + std::to_string(live) +
                                          " host sets (limits.ring_domains), each with groups here");
        let_go(victim);
        --live;
    }
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

RingDomain *Daemon::find_domain(const std::vector<uint32_t> &hosts) {
    if (!multi_host() || hosts.size() == 1) return nullptr;  // this host alone: the local path
    const size_t n = hosts.empty() ? config_.hosts.size() : hosts.size();
    for (auto &d : domains_) {
        if (!d || d->members().size() != n) continue;
        if (hosts.empty() || d->members() == hosts) return d.get();
    }
    return nullptr;
}

// Marks the domains that have a group here (joined, or with something of it left) as used now,
// and returns the place of the one (not the whole ring's) unused for the longest, at least
// `idle_for`; 0: none.
size_t Daemon::idle_domain(Clock::duration idle_for) {
    const auto now = Clock::now();
    for (const auto &[group, d] : group_domain_) d->touch(now);
    groups_.for_each_local_id([&](const std::string &group, uint64_t) {
        if (const auto *h = groups_.hosts_of(group))
            if (RingDomain *d = find_domain(*h)) d->touch(now);
    });
    size_t victim = 0;
    for (size_t i = 1; i < domains_.size(); ++i) {
        const RingDomain *d = domains_[i].get();
        if (!d || !d->idle() || now - d->last_used() < idle_for) continue;
        if (!victim || d->last_used() < domains_[victim]->last_used()) victim = i;
    }
    return victim;
}

// Its peers see its connections close and end its generation; it is made again when a group over
// its hosts joins here again.
void Daemon::let_go(size_t at) {
    RingDomain &d = *domains_.at(at);
    spdlog::info("ring domain {}: let go (no groups here for {} s)", d.key(),
                 std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - d.last_used()).count());
    unwatch_domain(d);
    d.shutdown();
    let_go_refused_ += d.control().handshakes_refused();
    let_go_rejected_ += d.control().frames_rejected();
    domains_[at].reset();
    size_t live = 0;
    for (auto &x : domains_) live += x != nullptr;
    domains_.front()->control().set_domains(live);
}

void Daemon::forget_idle_domains() {
    while (domains_.size() > 1)
        if (const size_t victim = idle_domain(kForgetIdle)) let_go(victim);
        else return;
}

RingDomain *Daemon::domain_of(const std::string &group) {
    if (const auto *hosts = groups_.hosts_of(group)) {
        RingDomain *d = find_domain(*hosts);  // made when the group joined
        if (d) group_domain_.insert_or_assign(group, d);
        return d;
    }
    auto it = group_domain_.find(group);  // gone here; what is left of it is its domain's
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

// A hello for another ring domain: from one of its hosts, for a domain this host has (a group
// over those hosts joined here). Until then the dialer is refused and dials again.
Status Daemon::foreign_check(const proto::PeerHello &hello) {
    auto hosts = domain_hosts(hello.domain);
    if (!hosts) return hosts.error();
    auto from = find_host(config_, hello.from);
    if (!from || std::find(hosts->begin(), hosts->end(), static_cast<uint32_t>(*from)) == hosts->end())
        return make_error(-EACCES, "host " + hello.from + " is not in ring domain " + hello.domain);
    if (!find_domain(*hosts))
        return make_error(-EAGAIN, "ring domain " + hello.domain + ": no group over these hosts has joined on " + host_ + " yet");
    return Ok{};
}

void Daemon::adopt(UniqueFd fd, const proto::PeerHello &hello, const std::string &ip, const SessionKeys &keys) {
    auto hosts = domain_hosts(hello.domain);
    RingDomain *d = hosts ? find_domain(*hosts) : nullptr;
    if (!d) {  // let go between its handshake and now
        spdlog::debug("a connection from {} for ring domain {}: no such domain here now", hello.from, hello.domain);
        return;
    }
    d->control().adopt(std::move(fd), hello, ip, keys);
}

}  // namespace ringd
