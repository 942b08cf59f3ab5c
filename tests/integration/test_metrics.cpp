// metrics.listen: two real daemons on 127.0.0.1, a known number of ops (ring, direct, and one
// that fails), then each daemon's /metrics scraped over HTTP and parsed by Prometheus's own text
// parser (python3-prometheus-client, tests/python/scrape_metrics.py): every family's name and
// type, and the values against the ops this test ran and checked here. Also: the endpoint off by
// default, a bad address refused at start, idle and garbage HTTP connections, and what
// `ringctl status` says of a stalled op.
#include <catch2/catch.hpp>

#include <cctype>
#include <map>
#include <set>

#include "daemon/status/op_metrics.h"
#include "tests/support/cluster.h"
#include "tests/support/net.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;

namespace {

struct Sample {
    std::map<std::string, std::string> labels;
    double value = 0;
};
struct Scrape {
    std::string content_type;
    std::map<std::string, std::string> types;               // family (as the parser names it) -> type
    std::map<std::string, std::vector<Sample>> samples;     // sample name -> samples
    // The one sample of `name` whose labels include `match`; fails the test when there is not exactly one.
    double value(const std::string &name, const std::map<std::string, std::string> &match = {}) const {
        std::vector<double> found;
        auto it = samples.find(name);
        if (it != samples.end())
            for (const auto &s : it->second) {
                bool all = true;
                for (const auto &[k, v] : match) all = all && s.labels.count(k) && s.labels.at(k) == v;
                if (all) found.push_back(s.value);
            }
        INFO("sample " << name << " with " << match.size() << " label(s) given");
        REQUIRE(found.size() == 1);
        return found[0];
    }
    // The sum over every sample of `name` whose labels include `match`.
    double sum(const std::string &name, const std::map<std::string, std::string> &match = {}) const {
        double total = 0;
        auto it = samples.find(name);
        if (it == samples.end()) return 0;
        for (const auto &s : it->second) {
            bool all = true;
            for (const auto &[k, v] : match) all = all && s.labels.count(k) && s.labels.at(k) == v;
            if (all) total += s.value;
        }
        return total;
    }
};

Scrape scrape(int port) {
    const std::string script = env_or("RINGD_SOURCE_DIR", ".") + "/tests/python/scrape_metrics.py";
    const auto r = run_command("/usr/bin/python3 " + script + " http://127.0.0.1:" + std::to_string(port) + "/metrics 2>&1");
    INFO(r.output.substr(0, 3000));
    REQUIRE(r.exit_code == 0);
    const json j = json::parse(r.output);
    Scrape s;
    s.content_type = j["content_type"];
    for (const auto &f : j["families"]) {
        s.types[f["name"]] = f["type"];
        for (const auto &x : f["samples"]) {
            Sample sm;
            for (const auto &[k, v] : x["labels"].items()) sm.labels[k] = v.get<std::string>();
            sm.value = x["value"].get<double>();
            s.samples[x["name"].get<std::string>()].push_back(sm);
        }
    }
    return s;
}

int metrics_port(TestCluster &c, uint32_t i) {
    const json st = c.status(i);
    REQUIRE(st.contains("metrics"));
    REQUIRE(st["metrics"].contains("port"));
    return st["metrics"]["port"].get<int>();
}

}  // namespace

TEST_CASE("every family of /metrics parses with its type, and the values are the ops this test ran", "[metrics]") {
    // The prometheus_client parser is a package of the system's Python (./dev installs it).
    REQUIRE(run_command("/usr/bin/python3 -c 'import prometheus_client' 2>&1").exit_code == 0);
    TestCluster c(2, "5s", "metrics: {listen: 127.0.0.1:0}\n");
    REQUIRE(c.wait_up());
    Clients cl = connect_all(c, "metered", 1, 40 << 20);

    // 3 ring ops of 512 Ki floats (2 MiB, over tuning.direct_max_bytes) and one of 32 MiB and a
    // bit (sent by reference over TCP), 4 direct ops of 1 Ki floats (4 KiB), each checked here;
    // then one op the two hosts submit with different counts.
    constexpr size_t kRingCount = 512 << 10, kBigCount = (32 << 20) / 4 + 7, kDirectCount = 1024;
    for (uint64_t k = 0; k < 3; ++k) allreduce_checked(cl, DType::F32, ReduceOp::Sum, kRingCount, 10 + k);
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, kBigCount, 13);
    constexpr double kRingBytes = (3.0 * kRingCount + kBigCount) * 4;
    for (uint64_t k = 0; k < 4; ++k) allreduce_checked(cl, DType::F32, ReduceOp::Avg, kDirectCount, 20 + k);
    {
        const uint64_t t0 = cl[0]->submit(0, 100, RINGD_F32, RINGD_SUM);
        const uint64_t t1 = cl[1]->submit(0, 200, RINGD_F32, RINGD_SUM);
        CHECK(ringd_wait(cl[0]->get(), t0, 20000) != 0);
        CHECK(ringd_wait(cl[1]->get(), t1, 20000) != 0);
    }

    const std::set<std::string> direct = {"one-shot", "two-shot"};
    std::vector<double> generations;
    for (uint32_t h = 0; h < 2; ++h) {
        INFO("host node" << h);
        const Scrape s = scrape(metrics_port(c, h));
        CHECK(s.content_type.rfind("text/plain; version=0.0.4", 0) == 0);

        // Names and types (the parser names a counter's family without _total).
        const std::map<std::string, std::string> want = {
            {"ringd_ops_completed", "counter"},    {"ringd_ops_failed", "counter"},
            {"ringd_bytes_reduced", "counter"},    {"ringd_op_duration_seconds", "histogram"},
            {"ringd_ring_generation", "gauge"},    {"ringd_ring_up", "gauge"},
            {"ringd_link_bytes", "counter"},       {"ringd_clients_connected", "gauge"},
            {"ringd_link_bytes_by_reference", "counter"},
            {"ringd_memory_registered_bytes", "gauge"}, {"ringd_ops_in_state", "gauge"},
            {"ringd_peer_backlog_bytes", "gauge"}, {"ringd_auth_enabled", "gauge"},
            {"ringd_cuda_mapped_bytes", "gauge"},  {"ringd_build_info", "gauge"},
            {"ringd_errors_recorded", "counter"},  {"ringd_frames_rejected", "counter"}};
        for (const auto &[name, type] : want) {
            INFO("family " << name);
            REQUIRE(s.types.count(name));
            CHECK(s.types.at(name) == type);
        }

        // Ops: 4 by the ring, 4 direct (one- or two-shot, as the cost model picks for 4 KiB on
        // two hosts), the mismatch failed, and nothing else.
        CHECK(s.value("ringd_ops_completed_total", {{"group", "metered"}, {"algorithm", "ring"}}) == 4);
        double direct_done = 0, direct_bytes = 0;
        for (const auto &a : direct) {
            direct_done += s.sum("ringd_ops_completed_total", {{"group", "metered"}, {"algorithm", a}});
            direct_bytes += s.sum("ringd_bytes_reduced_total", {{"group", "metered"}, {"algorithm", a}});
        }
        CHECK(direct_done == 4);
        CHECK(s.sum("ringd_ops_completed_total", {{"group", "metered"}}) == 8);
        CHECK(s.sum("ringd_ops_failed_total", {{"group", "metered"}}) == 1);
        CHECK(s.value("ringd_bytes_reduced_total", {{"group", "metered"}, {"algorithm", "ring"}}) == kRingBytes);
        CHECK(direct_bytes == 4.0 * kDirectCount * 4);
        CHECK(s.sum("ringd_ops_completed_all_total") == 8);

        // The ring ops' durations: 4 observations, cumulative buckets that never fall, +Inf = count.
        CHECK(s.value("ringd_op_duration_seconds_count", {{"algorithm", "ring"}}) == 4);
        CHECK(s.value("ringd_op_duration_seconds_sum", {{"algorithm", "ring"}}) > 0);
        double last = 0;
        size_t buckets = 0;
        for (const auto &b : s.samples.at("ringd_op_duration_seconds_bucket")) {
            if (b.labels.at("algorithm") != "ring") continue;
            ++buckets;
            if (b.labels.at("le") == "+Inf") CHECK(b.value == 4);
            CHECK(b.value >= last);
            last = b.value;
        }
        CHECK(buckets == OpMetrics::kBuckets.size() + 1);

        // The ring: up, generation 1 or later, and its data link to the other host carried the
        // ring ops' bytes: with 2 hosts each sends (n-1)/n of the buffer in each of the two phases.
        CHECK(s.value("ringd_ring_up", {{"hosts", "node0,node1"}}) == 1);
        CHECK(s.value("ringd_ring_generation", {{"hosts", "node0,node1"}}) >= 1);
        generations.push_back(s.value("ringd_ring_generation", {{"hosts", "node0,node1"}}));
        const std::string other = h == 0 ? "node1" : "node0";
        const double out = s.value("ringd_link_bytes_total", {{"peer", other}, {"direction", "out"}});
        const double in = s.value("ringd_link_bytes_total", {{"peer", other}, {"direction", "in"}});
        CHECK(out >= kRingBytes);
        CHECK(out <= kRingBytes * 1.05);  // framing at most
        // The 32 MiB op's sends all come from the trainer's slot (both phases, with 2 hosts) and
        // go by reference but for messages under 64 KiB (each segment's last chunk here: 14
        // bytes); the 2 MiB ops' go by copy.
        const double by_ref = s.value("ringd_link_bytes_by_reference_total", {{"peer", other}});
        CHECK(by_ref >= kBigCount * 4.0 - 2 * (64 << 10));
        CHECK(by_ref <= kBigCount * 4.0);
        CHECK(in == Approx(out).epsilon(0.01));
        CHECK(s.value("ringd_peer_up", {{"peer", other}}) == 1);
        CHECK(s.value("ringd_peer_backlog_bytes", {{"peer", other}}) >= 0);

        CHECK(s.value("ringd_clients_joined") == 1);
        CHECK(s.value("ringd_clients_connected") >= 1);
        CHECK(s.value("ringd_groups") == 1);
        CHECK(s.value("ringd_memory_registered_bytes") >= double(4 << 20));  // the trainer's slot at least
        CHECK(s.value("ringd_auth_enabled") == 1);  // the test cluster has a secret
        CHECK(s.value("ringd_auth_data_mac") == 0);
        CHECK(s.value("ringd_frames_rejected_total") == 0);
        for (const char *state : {"matching", "queued", "reported", "running", "releasing", "local"})
            CHECK(s.value("ringd_ops_in_state", {{"state", state}}) == 0);
        CHECK(s.value("ringd_errors_recorded_total") >= 1);  // the mismatch
        CHECK(s.value("ringd_build_info", {{"host", "node" + std::to_string(h)}}) == 1);
    }

    // The coordinator numbers the ring's generations: one id on every host.
    CHECK(generations[0] == generations[1]);

    // Every series the example Grafana dashboard queries is one ringd serves.
    {
        const std::string dash = read_file(env_or("RINGD_SOURCE_DIR", ".") + "/docs/grafana/ringd-dashboard.json");
        REQUIRE_FALSE(dash.empty());
        const Scrape s = scrape(metrics_port(c, 0));
        size_t names = 0;
        for (size_t at = dash.find("ringd_"); at != std::string::npos; at = dash.find("ringd_", at + 1)) {
            size_t end = at;
            while (end < dash.size() && (std::isalnum(static_cast<unsigned char>(dash[end])) || dash[end] == '_')) ++end;
            const std::string name = dash.substr(at, end - at);
            if (at > 0 && (std::isalnum(static_cast<unsigned char>(dash[at - 1])) || dash[at - 1] == '-')) continue;  // "ringd-overview"
            INFO("the dashboard queries " << name);
            CHECK(s.samples.count(name) == 1);
            ++names;
        }
        CHECK(names >= 14);
    }

    // The status document says where it serves and counts the scrapes.
    const json st = c.status(0);
    CHECK(st["metrics"]["scrapes"].get<int>() == 2);
    CHECK(st["metrics"]["unanswered"].get<int>() == 0);
}

TEST_CASE("metrics are off unless metrics.listen is set, and a bad address stops ringd with its name", "[metrics]") {
    {
        Daemon d;
        REQUIRE(d.ready());
        auto s = fetch_status(d.socket());
        REQUIRE(s);
        CHECK(json::parse(*s)["metrics"]["listen"] == "");
    }
    for (const std::string listen : {"127.0.0.1", "localhost:9465", "127.0.0.1:70000", "::1:9465"}) {
        INFO(listen);
        const std::string dir = make_temp_dir();
        std::ofstream(dir + "/c.yaml") << "cluster: c\nhosts:\n  - {name: a, address: 127.0.0.1, port: 7400}\n"
                                       << "socket: " << dir << "/s.sock\nmetrics: {listen: \"" << listen << "\"}\n";
        const auto r = run_command(env_or("RINGD_BIN", "build/daemon/ringd") + " --config " + dir + "/c.yaml --host a 2>&1");
        CHECK(r.exit_code != 0);
        CHECK(r.output.find("metrics.listen") != std::string::npos);
    }
    // An address that is not on this host: refused at start, named.
    const std::string dir = make_temp_dir();
    std::ofstream(dir + "/c.yaml") << "cluster: c\nhosts:\n  - {name: a, address: 127.0.0.1, port: 7400}\n"
                                   << "socket: " << dir << "/s.sock\nmetrics: {listen: \"192.0.2.1:9465\"}\n";
    const auto r = run_command(env_or("RINGD_BIN", "build/daemon/ringd") + " --config " + dir + "/c.yaml --host a 2>&1");
    CHECK(r.exit_code != 0);
    CHECK(r.output.find("metrics.listen 192.0.2.1:9465: cannot bind") != std::string::npos);
}

TEST_CASE("a scraper that connects and sends nothing, or garbage, costs ringd nothing", "[metrics]") {
    DaemonOptions o;
    o.extra_yaml = "metrics: {listen: 127.0.0.1:0}\n";
    Daemon d(o);
    REQUIRE(d.ready());
    auto st = fetch_status(d.socket());
    REQUIRE(st);
    const int port = json::parse(*st)["metrics"]["port"].get<int>();
    // Idle connections and a request line of garbage, then an op and a real scrape.
    std::vector<UniqueFd> idle;
    for (int i = 0; i < 4; ++i) idle.push_back(connect_from("127.0.0.1", static_cast<uint16_t>(port)));
    {
        UniqueFd g = connect_from("127.0.0.1", static_cast<uint16_t>(port));
        const std::string junk = "\x16\x03\x01 not http at all\r\n\r\n";
        (void)!::write(g.get(), junk.data(), junk.size());
    }
    // While they are open, ringd serves its trainers as ever.
    Client cl(d.socket(), "solo", 0, 1, 1 << 20);
    Clients one;
    one.push_back(std::make_unique<Client>(d.socket(), "solo2", 0, 1, 1 << 20));
    allreduce_checked(one, DType::F32, ReduceOp::Sum, 4096, 7);
    // The idle ones hold the two HTTP workers until their 2 s to send a request end; a scrape is
    // served once one is free.
    const auto t0 = Clock::now();
    const Scrape s = scrape(port);
    CHECK(Clock::now() - t0 < 8s);
    idle.clear();
    CHECK(s.value("ringd_ops_completed_total", {{"group", "solo2"}, {"algorithm", "local"}}) == 1);
    CHECK(s.value("ringd_clients_joined") == 2);
}

TEST_CASE("ringctl status explains a stalled op: the missing local rank on its host, the missing host on the coordinator's", "[status]") {
    TestCluster c(2, "20s");
    REQUIRE(c.wait_up());
    Clients cl = connect_all(c, "stall", 2, 4 << 20);  // index = host * 2 + local rank
    // Every rank but host node1's local rank 1 submits a 1 MiB op (a ring op).
    CheckedOp o = prepare_checked(cl, DType::F32, ReduceOp::Sum, 256 << 10, 31);
    for (size_t g : {0, 1, 2})
        o.tickets[g] = cl[g]->submit(o.range[g].offset, o.count, RINGD_F32, RINGD_SUM);
    const std::string ringctl = env_or("RINGCTL_BIN", "build/client/ringctl");
    auto ctl = [&](uint32_t h, const std::string &args) {
        return run_command(ringctl + " --socket " + c.d[h]->socket() + " " + args + " 2>&1");
    };
    // node0 (the coordinator) runs the op (a solo lane: it started it by itself), which stalls and
    // is reported, and waits for node1; node1 waits for its rank 1.
    auto pending_of = [&](uint32_t h) {
        const auto r = ctl(h, "status --json");
        REQUIRE(r.exit_code == 0);
        return json::parse(r.output)["pending_ops"];
    };
    const auto deadline = Clock::now() + 10s;
    json p0, p1;
    while (Clock::now() < deadline) {
        p0 = pending_of(0);
        p1 = pending_of(1);
        if (p0.size() == 1 && p0[0]["state"] == "running" && !p0[0]["missing_hosts"].empty() && p1.size() == 1) break;
        std::this_thread::sleep_for(50ms);
    }
    INFO("node0 " << p0.dump() << "\nnode1 " << p1.dump());
    REQUIRE(p0.size() == 1);
    CHECK(p0[0]["group"] == "stall");
    CHECK(p0[0]["seq"] == o.tickets[0]);
    CHECK(p0[0]["state"] == "running");
    CHECK(p0[0]["algorithm"] == "ring");
    CHECK(p0[0]["missing_hosts"] == json::array({"node1"}));
    CHECK(p0[0]["fails_in_s"].get<double>() > 0);
    REQUIRE(p1.size() == 1);
    CHECK(p1[0]["state"] == "matching");
    CHECK(p1[0]["missing_ranks"] == json::array({1}));

    const auto t0 = ctl(0, "status"), t1 = ctl(1, "status");
    INFO(t0.output << "\n" << t1.output);

    CHECK(t0.output.find("coordinator: node0 (this host)") != std::string::npos);
    CHECK(t0.output.find("host(s) node1 to submit it (reported by node0)") != std::string::npos);
    CHECK(t1.output.find("local rank(s) 1 of 2 on host node1 (this host) to submit it") != std::string::npos);
    CHECK(t1.output.find("coordinator: node0\n") != std::string::npos);
    std::this_thread::sleep_for(1100ms);  // the age grows
    CHECK(pending_of(1)[0]["age_s"].get<double>() >= 1.0);

    // watch: two looks, one document per line.
    const auto w = ctl(1, "watch --json --count 2 --interval 0.2");
    CHECK(w.exit_code == 0);
    size_t lines = 0;
    for (size_t at = 0, nl; (nl = w.output.find('\n', at)) != std::string::npos; at = nl + 1, ++lines)
        CHECK(json::parse(w.output.substr(at, nl - at))["pending_ops"].size() == 1);
    CHECK(lines == 2);

    // The late rank submits: the op completes with the right values and nothing is pending.
    o.tickets[3] = cl[3]->submit(o.range[3].offset, o.count, RINGD_F32, RINGD_SUM);
    wait_checked(cl, o);
    CHECK(pending_of(0).empty());
    CHECK(pending_of(1).empty());
}
