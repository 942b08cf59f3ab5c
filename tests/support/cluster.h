// Rings of real ringd processes on 127.0.0.1 (one port each) for the multi-host tests: the
// cluster, its trainers, an allreduce checked locally (every value and the guard bytes around
// every rank's range), and what the fault tests need to see an op under way.
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_data.h"
#include "common/status_client.h"
#include "ringd/ringd.hpp"
#include "tests/support/harness.h"
#include "tests/support/netns.h"

namespace ringd::test {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr const char *kIbverbsYaml = "transport: ibverbs\nibverbs: {provider: emulated}\n";

struct ClusterOptions {
    std::string op_timeout = "5s";  // timeouts.op
    std::string heartbeat;          // timeouts.heartbeat; empty: ringd's default (1 s)
    std::string extra_yaml;         // appended to every host's config
    std::string slot_bytes = "64MiB";
    uid_t uid = 0;  // run the daemons as this uid/gid; 0: as the test
    gid_t gid = 0;
    // The other hosts reach this host through a relay on 127.0.0.1:relay_port (a man in the
    // middle); none when out of range.
    uint32_t relayed = UINT32_MAX;
    int relay_port = 0;
    std::string bin{};  // the ringd every host runs; empty: $RINGD_BIN
    // Hosts as network namespaces (its first n hosts), each ringd at its own address, port 7400;
    // null: 127.0.0.1, a port each.
    const NetnsHosts *netns = nullptr;
    std::string host_yaml{};  // appended to every host's entry in hosts: (e.g. ", weights: [3, 1]")
    std::vector<std::string> own_yaml{};  // appended to host i's config alone (i < size)
};

struct TestCluster {
    uint32_t n;
    int base_port;
    std::vector<std::unique_ptr<Daemon>> d;

    explicit TestCluster(uint32_t hosts, ClusterOptions o = {}) : n(hosts) {
        base_port = 10000 + static_cast<int>((::getpid() * 17) % 20000);  // below the ephemeral range
        // One secret for the cluster (multi-host daemons need one), unless the test sets auth itself.
        const std::string auth = o.extra_yaml.find("auth:") == std::string::npos ? secret_yaml(o.uid, o.gid) : "";
        netns = o.netns;
        if (netns) REQUIRE(netns->size() >= n);
        auto hosts_yaml = [&](uint32_t self) {
            std::string yaml = "hosts:\n";
            for (uint32_t i = 0; i < n; ++i)
                yaml += "  - {name: node" + std::to_string(i) + ", address: " + (netns ? netns->addresses_yaml(i) : address(i)) +
                        ", port: " + std::to_string(i == o.relayed && i != self ? o.relay_port : port(i)) + o.host_yaml + "}\n";
            return yaml;
        };
        for (uint32_t i = 0; i < n; ++i) {
            DaemonOptions opt;
            opt.host = "node" + std::to_string(i);
            opt.hosts_yaml = hosts_yaml(i);
            // The harness writes `timeouts: {op: <this>}`.
            opt.op_timeout = o.op_timeout + (o.heartbeat.empty() ? "" : ", heartbeat: " + o.heartbeat);
            opt.slot_bytes = o.slot_bytes;
            opt.uid = o.uid;
            opt.gid = o.gid;
            opt.bin = o.bin;
            if (netns) opt.netns = netns->ns(i);
            opt.extra_yaml = "tcp: {streams: 2}\n" + auth + o.extra_yaml + (i < o.own_yaml.size() ? o.own_yaml[i] : "");
            d.push_back(std::make_unique<Daemon>(opt));
            REQUIRE(d.back()->ready());
        }
    }
    TestCluster(uint32_t hosts, const std::string &op_timeout, const std::string &extra_yaml = "")
        : TestCluster(hosts, ClusterOptions{op_timeout, "", extra_yaml, "64MiB"}) {}

    const NetnsHosts *netns = nullptr;
    // Where host i listens: its namespace's address and port 7400, or 127.0.0.1 and a port of its own.
    int port(uint32_t i) const { return netns ? 7400 : base_port + static_cast<int>(i); }
    std::string address(uint32_t i) const { return netns ? netns->address(i) : "127.0.0.1"; }

    json status(uint32_t i) {
        auto s = fetch_status(d[i]->socket());
        return s ? json::parse(*s) : json{};
    }
    // The summary of `group` in daemon i's status, or null.
    json group(uint32_t i, const std::string &name) {
        const json st = status(i);
        for (const auto &g : st["groups"])
            if (g["name"] == name) return g;
        return {};
    }
    // Waits until daemon i took an op of `group` (all its local ranks submitted it): running, or
    // already ended.
    bool wait_taken(uint32_t i, const std::string &group, std::chrono::milliseconds limit = 10s) {
        const auto deadline = Clock::now() + limit;
        while (Clock::now() < deadline) {
            const json g = this->group(i, group);
            if (!g.is_null() &&
                g["running_ops"].get<int>() + g["ops_failed"].get<int>() + g["ops_completed"].get<int>() > 0)
                return true;
            std::this_thread::sleep_for(5ms);
        }
        UNSCOPED_INFO("host " << i << " status: " << status(i).dump());
        return false;
    }
    // Waits until daemon i reports (sd_notify STATUS, on the NOTIFY_SOCKET the harness owns) that
    // its ring is up as generation min_generation or later.
    bool wait_ring(uint32_t i, uint64_t min_generation, std::chrono::milliseconds limit = 15s) {
        const auto deadline = Clock::now() + limit;
        const std::string key = "STATUS=ring generation ";
        while (Clock::now() < deadline) {
            const std::string m = d[i]->notify().next(std::chrono::milliseconds(ms_until(deadline)));
            const auto at = m.find(key);
            if (at == std::string::npos || m.find(" up (", at) == std::string::npos) continue;
            if (std::stoull(m.substr(at + key.size())) >= min_generation) return true;
        }
        return false;
    }
    // Every daemon's ring is up, as generation min_generation[i] (default 1) or later.
    bool wait_up(std::vector<uint64_t> min_generation = {}) {
        min_generation.resize(n, 1);
        for (uint32_t i = 0; i < n; ++i)
            if (!wait_ring(i, min_generation[i])) return false;
        return true;
    }
};

using Clients = std::vector<std::unique_ptr<Client>>;  // index = host * L + local rank

// `hosts`: what every trainer declares as the group's hosts ("" = every host).
inline Clients connect_all(TestCluster &c, const std::string &group, uint32_t local, size_t slot_bytes = 1 << 20,
                           const std::string &hosts = "", unsigned op_timeout_ms = 0) {
    Clients v;
    for (uint32_t h = 0; h < c.n; ++h)
        for (uint32_t r = 0; r < local; ++r)
            v.push_back(std::make_unique<Client>(c.d[h]->socket(), group, static_cast<int>(r), static_cast<int>(local),
                                                 slot_bytes, hosts, op_timeout_ms));
    return v;
}

// A group on some hosts: `ranks[k]` local ranks on host `on[k]` (local sizes may differ), each
// trainer declaring `hosts` as the group's hosts. Index = the hosts in the order given, then
// local rank.
inline Clients connect_on(TestCluster &c, const std::string &group, const std::vector<uint32_t> &on,
                          const std::vector<uint32_t> &ranks, const std::string &hosts, size_t slot_bytes = 4 << 20) {
    Clients v;
    for (size_t k = 0; k < on.size(); ++k)
        for (uint32_t r = 0; r < ranks[k]; ++r)
            v.push_back(std::make_unique<Client>(c.d[on[k]]->socket(), group, static_cast<int>(r), static_cast<int>(ranks[k]),
                                                 slot_bytes, hosts));
    return v;
}

using ClientPtr = std::unique_ptr<ringd_client, void (*)(ringd_client *)>;

// One trainer joining `group` on daemon `host` through ringd_connect_opts with the group's hosts;
// null (and ringd's message in `err`) when ringd refuses the join.
inline ClientPtr join_opts(TestCluster &c, uint32_t host, const char *group, int rank, int size, const char *hosts,
                           std::string &err, size_t slot_bytes = 4096) {
    ringd_options o{};
    o.struct_size = sizeof o;
    o.socket_path = c.d[host]->socket().c_str();
    o.group = group;
    o.local_rank = rank;
    o.local_size = size;
    o.slot_bytes = slot_bytes;
    o.hosts = hosts;
    char e[512] = "";
    ringd_client *cl = ringd_connect_opts(&o, e, sizeof e);
    err = e;
    return ClientPtr(cl, ringd_close);
}

// Rank g's range of an op: a different offset on every rank, guard bytes before and after.
inline bench::GuardedRange rank_range(const Client &cl, size_t g, DType t, size_t count, uint64_t seed) {
    const size_t offset = bench::kGuardBytes + ((seed + g * 7) % 64) * 8;
    return bench::GuardedRange{offset, count, cl.slot().size(), t, seed * 1000003 + g};
}

// An allreduce submitted on every client of a group, to be checked by wait_checked (several
// groups' ops can be in flight at once this way, from one thread).
struct CheckedOp {
    DType t = DType::F32;
    ReduceOp op = ReduceOp::Sum;
    size_t count = 0;
    std::vector<bench::GuardedRange> range;
    std::vector<uint64_t> tickets;
};

// The op's inputs and guard bytes written on every client, not yet submitted (submit_prepared):
// a SlotWatch made in between sees the inputs, however fast the op then runs.
inline CheckedOp prepare_checked(Clients &cl, DType t, ReduceOp op, size_t count, uint64_t seed) {
    const size_t n = cl.size();
    CheckedOp o{t, op, count, std::vector<bench::GuardedRange>(n), std::vector<uint64_t>(n)};
    for (size_t g = 0; g < n; ++g) {
        o.range[g] = rank_range(*cl[g], g, t, count, seed);
        REQUIRE(o.range[g].offset + o.range[g].bytes() + bench::kGuardBytes <= cl[g]->slot().size());
        o.range[g].prepare(cl[g]->slot().data(), g);
    }
    return o;
}

inline void submit_prepared(Clients &cl, CheckedOp &o) {
    for (size_t g = 0; g < cl.size(); ++g)
        o.tickets[g] = cl[g]->submit(o.range[g].offset, o.count, static_cast<ringd_dtype>(o.t), static_cast<ringd_op>(o.op));
}

inline CheckedOp submit_checked(Clients &cl, DType t, ReduceOp op, size_t count, uint64_t seed) {
    CheckedOp o = prepare_checked(cl, t, op, count, seed);
    submit_prepared(cl, o);
    return o;
}

// Waits for the op on every client, which must succeed.
inline void wait_done(Clients &cl, const CheckedOp &o) {
    const size_t n = cl.size();
    for (size_t g = 0; g < n; ++g) {
        const int rc = ringd_wait(cl[g]->get(), o.tickets[g], 20000);
        INFO("rank " << g << " of " << n << " " << dtype_name(o.t) << " " << reduce_op_name(o.op) << " count " << o.count
                     << ": " << (rc == 0 ? "" : ringd_last_error(cl[g]->get())));
        REQUIRE(rc == 0);
    }
}

// Checks every value of every rank of a completed op and the guard bytes around each rank's
// range, here, not through ringd.
inline void check_done(Clients &cl, const CheckedOp &o) {
    const size_t n = cl.size();
    for (size_t g = 0; g < n; ++g) {
        INFO("rank " << g << " of " << n << " " << dtype_name(o.t) << " " << reduce_op_name(o.op) << " count " << o.count
                     << " offset " << o.range[g].offset);
        const auto v = o.range[g].check(cl[g]->slot().data(), o.op, n);
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
    }
}

// Waits for the op on every client and checks it.
inline void wait_checked(Clients &cl, const CheckedOp &o) {
    wait_done(cl, o);
    check_done(cl, o);
}

// One allreduce on every client (submitted on all, then waited on all), checked.
inline void allreduce_checked(Clients &cl, DType t, ReduceOp op, size_t count, uint64_t seed) {
    wait_checked(cl, submit_checked(cl, t, op, count, seed));
}

// A job that loops on a thread of its own while the test changes the ring under it: a ring op
// (600 000 f32) and a direct one (1000 f32) after another, every value and the guard bytes of
// every rank checked here. It counts instead of asserting (Catch is not thread-safe); the test
// checks the counts once it stopped the job.
class LoopingJob {
public:
    struct Counts {
        uint64_t ops = 0, failed = 0, wrong = 0, guard = 0;
        std::string last_error;
    };
    explicit LoopingJob(Clients cl) : cl_(std::move(cl)), thread_([this] { run(); }) {}
    ~LoopingJob() { (void)stop(); }
    LoopingJob(const LoopingJob &) = delete;
    LoopingJob &operator=(const LoopingJob &) = delete;
    // Ends the op under way, then the loop; what it counted.
    Counts stop() {
        stop_ = true;
        if (thread_.joinable()) thread_.join();
        return counts_;
    }
    uint64_t ops() const { return ops_.load(); }

private:
    void run() {
        for (uint64_t seed = 1; !stop_; ++seed)
            for (const size_t count : {size_t{600000}, size_t{1000}}) {
                const size_t n = cl_.size();
                std::vector<bench::GuardedRange> range(n);
                std::vector<uint64_t> tickets(n);
                for (size_t g = 0; g < n; ++g) {
                    range[g] = rank_range(*cl_[g], g, DType::F32, count, seed);
                    range[g].prepare(cl_[g]->slot().data(), g);
                }
                for (size_t g = 0; g < n; ++g) tickets[g] = cl_[g]->submit(range[g].offset, count, RINGD_F32, RINGD_SUM);
                bool ok = true;
                for (size_t g = 0; g < n; ++g)
                    if (ringd_wait(cl_[g]->get(), tickets[g], 20000) != 0) {
                        ok = false;
                        ++counts_.failed;
                        counts_.last_error = ringd_last_error(cl_[g]->get());
                    }
                if (ok)
                    for (size_t g = 0; g < n; ++g) {
                        const auto v = range[g].check(cl_[g]->slot().data(), ReduceOp::Sum, n);
                        counts_.wrong += v.wrong;
                        counts_.guard += v.guard;
                    }
                ++counts_.ops;
                ++ops_;
                if (!ok) return;  // its ranks must reconnect; the test says what it expected
            }
    }
    Clients cl_;
    Counts counts_;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> ops_{0};
    std::thread thread_;
};

// What a looping job that must never have failed counted: ops, none failed, every value and
// guard byte right (at least `min_ops` ops).
inline void check_clean(const LoopingJob::Counts &k, uint64_t min_ops = 1) {
    INFO("the job's last error: " << k.last_error);
    CHECK(k.ops >= min_ops);
    CHECK(k.failed == 0);
    CHECK(k.wrong == 0);
    CHECK(k.guard == 0);
}

// Waits until a looping job ran `more` ops after now (it goes on while the ring changes).
inline bool job_moves(const LoopingJob &job, uint64_t more = 4, std::chrono::milliseconds limit = 20s) {
    const uint64_t target = job.ops() + more;
    const auto deadline = Clock::now() + limit;
    while (job.ops() < target && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
    return job.ops() >= target;
}

// A large op's progress seen from one rank's slot: the input at sample positions, and how many
// of them hold something else (the ring writes partial and final results into the slot as
// chunks arrive). Reads race with the daemon on purpose; only whether a value changed counts.
class SlotWatch {
public:
    SlotWatch(const Client &cl, size_t offset, size_t count, size_t every = 16384)
        : base_(reinterpret_cast<const uint32_t *>(cl.slot().data() + offset)) {
        for (size_t i = 0; i < count; i += every) {
            at_.push_back(i);
            was_.push_back(base_[i]);
        }
    }
    size_t samples() const { return at_.size(); }
    size_t changed() const {
        size_t c = 0;
        for (size_t k = 0; k < at_.size(); ++k)
            c += __atomic_load_n(base_ + at_[k], __ATOMIC_RELAXED) != was_[k];
        return c;
    }

private:
    const uint32_t *base_;
    std::vector<size_t> at_;
    std::vector<uint32_t> was_;
};

// Waits (spinning: a large op on loopback takes a fraction of a second) until at least one
// sample of `watch` changed: the op runs and data reached that rank. A ring op writes into a
// slot only after the coordinator started it, which it does once every host reported it ready.
// Returns the changed fraction then, or -1 when the deadline passed first.
inline double wait_data_moving(const SlotWatch &watch, std::chrono::milliseconds limit = 20s) {
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
        const size_t k = watch.changed();
        if (k > 0) return static_cast<double>(k) / static_cast<double>(watch.samples());
        std::this_thread::yield();
    }
    return -1;
}

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace ringd::test
