// What operators do to a running ring (docs/operations.md): rotate the secret host by host with a
// job running, and a host whose host list differs from the others'. Every op's values are
// checked locally (tests/support/cluster.h).
#include <catch2/catch.hpp>

#include <csignal>
#include <fstream>
#include <thread>

#include <sys/stat.h>

#include "tests/support/cluster.h"
#include "proto/frame.h"

using namespace ringd;
using namespace ringd::test;
using namespace std::chrono_literals;

namespace {

constexpr size_t kSlot = 4 << 20;

void write_secret(const std::string &path, const std::string &text) {
    std::ofstream(path, std::ios::trunc) << text << "\n";
    ::chmod(path.c_str(), 0600);
}

// A few ops of the job that runs through the whole rotation: the ring (a large op) and direct
// exchange (small ones), every value checked.
void steps(Clients &cl, uint64_t seed) {
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 600000, seed);
    allreduce_checked(cl, DType::I32, ReduceOp::Max, 1000, seed + 1);
}

// Namespace hosts where this machine allows them (root), else 127.0.0.1 with a port each.
std::unique_ptr<NetnsHosts> namespace_hosts(uint32_t n) {
    if (NetnsHosts::available()) return std::make_unique<NetnsHosts>(n);
    WARN("no network namespaces here (not root?): hosts on 127.0.0.1");
    return nullptr;
}

bool log_has(TestCluster &c, uint32_t h, const std::string &text, std::chrono::milliseconds limit = 5s) {
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
        if (c.d[h]->log().find(text) != std::string::npos) return true;
        std::this_thread::sleep_for(20ms);
    }
    return false;
}

}  // namespace

TEST_CASE("the secret rotates host by host while a job runs: no op fails, groups formed meanwhile authenticate, "
          "the previous secret ends with its grace",
          "[operations][auth]") {
    const std::string dir = make_temp_dir(), secret = dir + "/secret";
    const std::string old_secret = "0123456789abcdef-old-secret", new_secret = "fedcba9876543210-new-secret";
    write_secret(secret, old_secret);
    const auto hosts = namespace_hosts(3);
    ClusterOptions o{"10s", "", "auth: {secret_file: " + secret + ", rotation_grace: 6s}\n", "64MiB"};
    o.netns = hosts.get();
    TestCluster c(3, o);
    REQUIRE(c.wait_up());
    for (uint32_t h = 0; h < c.n; ++h) CHECK(c.status(h)["ring"]["protocol"] == proto::kPeerProtocolVersion);  // this build's peer protocol
    const std::string old_id = c.status(0)["secret"]["key_id"].get<std::string>();
    // The job over every host loops on its own thread through the whole rotation.
    LoopingJob job(connect_all(c, "steady", 1, kSlot));
    REQUIRE(job_moves(job));

    // The new secret is written on every host (one file here), then the hosts reload one by one.
    write_secret(secret, new_secret);
    const std::vector<std::pair<uint32_t, std::string>> order = {{0, "node0,node1"}, {1, "node1,node2"}, {2, "node0,node2"}};
    uint64_t seed = 10;
    for (const auto &[h, pair] : order) {
        INFO("reloaded host " << h);
        ::kill(c.d[h]->pid(), SIGHUP);
        REQUIRE(log_has(c, h, "reload: a new secret"));
        const json st = c.status(h);
        CHECK(st["secret"]["previous_key_id"] == old_id);
        CHECK(st["secret"]["key_id"] != old_id);
        // The job's connections stay; a group over two hosts makes new ones, whose handshakes
        // need a secret both hosts accept (until the last reload, the old one).
        REQUIRE(job_moves(job));
        const uint32_t a = pair == "node1,node2" ? 1 : 0, b = pair == "node0,node1" ? 1 : 2;
        auto pairwise = connect_on(c, "pair" + std::to_string(h), {a, b}, {1, 1}, pair, kSlot);
        allreduce_checked(pairwise, DType::F64, ReduceOp::Sum, 300000, seed + 5);
        allreduce_checked(pairwise, DType::BF16, ReduceOp::Avg, 333, seed + 6);
    }
    const std::string new_id = c.status(0)["secret"]["key_id"].get<std::string>();
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const json st = c.status(h);
        CHECK(st["secret"]["key_id"] == new_id);
        CHECK(st["ops"]["failed"] == 0);  // not one op of any group failed through the rotation
        CHECK(st["ring"]["frames_rejected"] == 0);
        CHECK_THAT(st["config"]["last_reload"].get<std::string>(), Catch::Contains("auth.secret_file (a new secret"));
        CHECK_FALSE(c.d[h]->log().find("authentication failed") != std::string::npos);
    }

    // The grace ends (6 s from the first reload): only the new secret is accepted. A host that
    // comes back with the old one is refused by both others, named with the key ids.
    std::this_thread::sleep_for(6500ms);
    for (uint32_t h = 0; h < c.n; ++h) CHECK(c.status(h)["secret"]["previous_key_id"] == "");
    REQUIRE(job_moves(job));
    check_clean(job.stop());
    REQUIRE(c.d[2]->stop() == 0);
    write_secret(secret, old_secret);
    c.d[2]->start();
    REQUIRE(c.d[2]->ready());
    CHECK(log_has(c, 0, "authentication failed: node2 has another secret (its key id " + old_id + ", this host's " + new_id));
    CHECK(log_has(c, 2, "has another secret (key id " + new_id + ")"));
    CHECK(c.status(0)["ring"]["state"] == "forming");
    // With the new secret it is back in the ring.
    REQUIRE(c.d[2]->stop() == 0);
    write_secret(secret, new_secret);
    c.d[2]->start();
    REQUIRE(c.d[2]->ready());
    REQUIRE(c.wait_up({1, 1, 1}));
    auto after = connect_all(c, "after", 1, kSlot);
    steps(after, 200);
}

TEST_CASE("a reload that cannot read the new secret changes nothing and says why; a third secret during a "
          "rotation's grace is refused, going back to the previous one is not",
          "[operations][auth]") {
    const std::string dir = make_temp_dir(), secret = dir + "/secret";
    write_secret(secret, "0123456789abcdef-the-secret");
    TestCluster c(2, ClusterOptions{"10s", "", "auth: {secret_file: " + secret + "}\n", "64MiB"});
    REQUIRE(c.wait_up());
    const std::string id = c.status(0)["secret"]["key_id"].get<std::string>();
    write_secret(secret, "short");
    ::kill(c.d[0]->pid(), SIGHUP);
    REQUIRE(log_has(c, 0, "reload: "));
    const json st = c.status(0);
    CHECK_THAT(st["config"]["last_reload"].get<std::string>(),
               Catch::Contains("refused: auth.secret_file: " + secret + " holds 5 bytes") && Catch::Contains("stays"));
    CHECK(st["secret"]["key_id"] == id);
    CHECK(st["secret"]["previous_key_id"] == "");
    auto cl = connect_all(c, "g", 1, kSlot);
    steps(cl, 1);

    const std::string ringctl = env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + c.d[0]->socket();
    write_secret(secret, "0123456789abcdef-the-second-one");
    REQUIRE(run_command(ringctl + " reload").exit_code == 0);
    const std::string second = c.status(0)["secret"]["key_id"].get<std::string>();
    CHECK(c.status(0)["secret"]["previous_key_id"] == id);
    write_secret(secret, "0123456789abcdef-a-third-one");
    auto r = run_command(ringctl + " reload 2>&1");
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.output, Catch::Contains("holds a third secret") && Catch::Contains("is in its grace"));
    CHECK(c.status(0)["secret"]["key_id"] == second);
    write_secret(secret, "0123456789abcdef-the-secret");  // back to the first: allowed
    CHECK(run_command(ringctl + " reload").exit_code == 0);
    CHECK(c.status(0)["secret"]["key_id"] == id);
    CHECK(c.status(0)["secret"]["previous_key_id"] == second);
    steps(cl, 5);
}

TEST_CASE("hosts whose host lists differ say so and name each other", "[operations]") {
    // node0 and node1 list node2 at a port where nothing listens (the others reach "node2"
    // through a relay port that is not there); node2 lists itself right. node2 still dials its
    // data streams to node0, and the two compare their lists' digests in that handshake.
    ClusterOptions o{"5s", "", "", "64MiB"};
    o.relayed = 2;
    o.relay_port = 10000 + static_cast<int>((::getpid() * 17) % 20000) + 50;  // TestCluster's ports + 50: nothing there
    TestCluster c(3, o);
    REQUIRE(log_has(c, 0, "host node2's host list differs from this host's", 10s));
    REQUIRE(log_has(c, 2, "host node0's host list differs from this host's", 10s));
    const json s0 = c.status(0), s2 = c.status(2);
    CHECK(s0["ring"]["state"] == "forming");
    CHECK(s0["ring"]["hosts_differ"] == json::array({"node2"}));
    CHECK(s2["ring"]["hosts_differ"].size() >= 1);
    CHECK(s2["ring"]["hosts_differ"][0] == "node0");
    CHECK(s0["ring"]["members"][2]["config_version"] == s2["config"]["version"]);
    CHECK(s0["ring"]["members"][2]["hosts_differ"] == true);
    CHECK(s0["ring"]["members"][1]["hosts_differ"] == false);
    // ringctl says it in words.
    const std::string human =
        run_command(env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + c.d[0]->socket() + " status").output;
    CHECK_THAT(human, Catch::Contains("HOST LISTS DIFFER: the hosts: of node2 differ from this host's"));
}

namespace {

// A host of a list: name, address, port (TestCluster's host i, also one it does not run).
struct Entry {
    std::string name, address;
    int port = 0;
};
Entry entry(const TestCluster &c, uint32_t i) {
    return {"node" + std::to_string(i), c.netns ? c.netns->address(i) : "127.0.0.1", c.netns ? 7400 : c.base_port + static_cast<int>(i)};
}
std::string hosts_block(const std::vector<Entry> &hosts) {
    std::string block = "hosts:\n";
    for (const auto &h : hosts)
        block += "  - {name: " + h.name + ", address: " + h.address + ", port: " + std::to_string(h.port) + "}\n";
    return block;
}

// The `hosts:` block of a config file replaced by `hosts`.
void set_hosts(const std::string &config, const std::vector<Entry> &hosts) {
    std::string text = read_file(config), block = hosts_block(hosts);
    const size_t at = text.find("hosts:\n");
    size_t end = at + 7;
    while (text.compare(end, 4, "  - ") == 0) end = text.find('\n', end) + 1;
    std::ofstream(config, std::ios::trunc) << text.replace(at, end - at, block);
}

json reload_host(Daemon &d) {
    const auto r = run_command(env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + d.socket() + " reload 2>&1");
    INFO(r.output);
    CHECK(r.exit_code == 0);
    return json::parse(*fetch_status(d.socket()));
}

}  // namespace

TEST_CASE("host lists change by reload: a host added joins the ring while jobs on the others run on; a host "
          "removed ends its groups, named, and nobody else's",
          "[operations][hosts]") {
    const std::string dir = make_temp_dir(), secret = dir + "/secret";
    write_secret(secret, "0123456789abcdef-hosts-secret");
    const std::string auth = "auth: {secret_file: " + secret + "}\n";
    const auto hosts = namespace_hosts(4);  // node3's is there from the start, unused until it runs
    ClusterOptions co{"10s", "", auth, "64MiB"};
    co.netns = hosts.get();
    TestCluster c(3, co);
    REQUIRE(c.wait_up());
    const std::vector<Entry> four = {entry(c, 0), entry(c, 1), entry(c, 2), entry(c, 3)};
    // node3 comes with the list of four; the others learn of it by reload.
    DaemonOptions o3;
    o3.host = "node3";
    o3.hosts_yaml = hosts_block(four);
    o3.op_timeout = "10s";
    if (hosts) o3.netns = hosts->ns(3);
    o3.extra_yaml = "tcp: {streams: 2}\n" + auth;
    auto node3 = std::make_unique<Daemon>(o3);
    REQUIRE(node3->ready());

    // The job over node0 and node1 loops on its own thread through every reload below.
    LoopingJob pair(connect_on(c, "pair01", {0, 1}, {1, 1}, "node0,node1", kSlot));
    auto pair12 = connect_on(c, "pair12", {1, 2}, {1, 1}, "node1,node2", kSlot);
    auto all3 = connect_all(c, "all3", 1, kSlot);
    steps(pair12, 3);
    steps(all3, 5);
    REQUIRE(job_moves(pair));
    uint64_t seed = 10;
    for (uint32_t h = 0; h < 3; ++h) {
        INFO("reload on node" << h);
        set_hosts(c.d[h]->dir() + "/ringd.yaml", four);
        const json st = reload_host(*c.d[h]);
        CHECK_THAT(st["config"]["last_reload"].get<std::string>(), Catch::Contains("applied: hosts"));
        CHECK(st["config"]["pending_restart"].empty());
        REQUIRE(job_moves(pair));
    }
    // The ring of four forms; the group over every host of the old ring runs on over its three.
    Clients four_ranks;
    for (int i = 0; i < 200; ++i) {
        bool up = node3->alive();
        for (uint32_t h = 0; h < 3; ++h) up = up && c.status(h)["ring"]["state"] == "up" && c.status(h)["ring"]["size"] == 4;
        if (up) break;
        std::this_thread::sleep_for(50ms);
    }
    for (uint32_t h = 0; h < 3; ++h) CHECK(c.status(h)["ring"]["size"] == 4);
    steps(all3, 7);
    for (uint32_t h = 0; h < 3; ++h) CHECK(c.group(h, "all3")["ops_failed"] == 0);
    all3.clear();
    for (uint32_t h = 0; h < 3; ++h)
        four_ranks.push_back(std::make_unique<Client>(c.d[h]->socket(), "all4", 0, 1, kSlot, ""));
    four_ranks.push_back(std::make_unique<Client>(node3->socket(), "all4", 0, 1, kSlot, ""));
    steps(four_ranks, 50);
    REQUIRE(job_moves(pair));
    steps(pair12, 70);  // its hosts kept their places
    auto pair03 = connect_on(c, "pair13", {1}, {1}, "node1,node3", kSlot);
    pair03.push_back(std::make_unique<Client>(node3->socket(), "pair13", 0, 1, kSlot, "node1,node3"));
    steps(pair03, 80);

    // node2 leaves the list: its groups end on the others, named; node3 moves from index 3 to 2,
    // and the group over node1 and node3 goes on.
    four_ranks.clear();
    const std::vector<Entry> three = {entry(c, 0), entry(c, 1), entry(c, 3)};
    for (Daemon *d : {c.d[0].get(), c.d[1].get(), node3.get()}) {
        set_hosts(d->dir() + "/ringd.yaml", three);
        reload_host(*d);
        REQUIRE(job_moves(pair));
        steps(pair03, seed += 10);
    }
    // A reload with a bad key changes nothing (the job goes on): refused by name, the running
    // config and its version stay.
    {
        const std::string path = c.d[0]->dir() + "/ringd.yaml", good = read_file(path);
        const std::string version = c.status(0)["config"]["version"].get<std::string>();
        std::ofstream(path, std::ios::trunc) << good << "tuning: {no_such_key: 1}\n";
        const auto r = run_command(env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + c.d[0]->socket() + " reload 2>&1");
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.output, Catch::Contains("refused") && Catch::Contains("no_such_key"));
        CHECK(c.status(0)["config"]["version"] == version);
        CHECK(c.status(0)["ring"]["size"] == 3);
        std::ofstream(path, std::ios::trunc) << good;
        REQUIRE(job_moves(pair));
    }
    const uint64_t t = pair12[0]->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM);
    CHECK(ringd_wait(pair12[0]->get(), t, 10000) != 0);
    CHECK_THAT(std::string(ringd_last_error(pair12[0]->get())), Catch::Contains("host node2 left the host list"));
    check_clean(pair.stop(), 30);  // not one op of the job on the untouched hosts failed
    for (uint32_t h : {0u, 1u}) CHECK(c.group(h, "pair01")["ops_failed"] == 0);
    CHECK(c.group(1, "pair13")["ops_failed"] == 0);
    Clients again;
    for (uint32_t h = 0; h < 2; ++h) again.push_back(std::make_unique<Client>(c.d[h]->socket(), "all-after", 0, 1, kSlot, ""));
    again.push_back(std::make_unique<Client>(node3->socket(), "all-after", 0, 1, kSlot, ""));
    steps(again, 90);
}

TEST_CASE("a host added by reload fails no op of the jobs over the whole ring, named or not; removed again, "
          "only the group over it ends, once, named",
          "[operations][hosts]") {
    const std::string dir = make_temp_dir(), secret = dir + "/secret";
    write_secret(secret, "0123456789abcdef-grow-secret");
    const std::string auth = "auth: {secret_file: " + secret + "}\n";
    const auto hosts = namespace_hosts(3);  // node2's is there from the start, unused until it runs
    ClusterOptions co{"10s", "", auth, "64MiB"};
    co.netns = hosts.get();
    TestCluster c(2, co);
    REQUIRE(c.wait_up());
    // Both jobs span the whole ring of two: one names its hosts, one names none (every host).
    LoopingJob named(connect_on(c, "named", {0, 1}, {1, 1}, "node0,node1", kSlot));
    auto every = std::make_unique<LoopingJob>(connect_all(c, "every", 1, kSlot));
    REQUIRE(job_moves(named));
    REQUIRE(job_moves(*every));
    // A group over every host whose second rank on node0 comes after the reloads.
    Clients late;
    late.push_back(std::make_unique<Client>(c.d[0]->socket(), "late", 0, 2, kSlot, ""));
    late.push_back(std::make_unique<Client>(c.d[1]->socket(), "late", 0, 1, kSlot, ""));

    const std::vector<Entry> three = {entry(c, 0), entry(c, 1), entry(c, 2)}, two = {entry(c, 0), entry(c, 1)};
    DaemonOptions o2;
    o2.host = "node2";
    o2.hosts_yaml = hosts_block(three);
    o2.op_timeout = "10s";
    if (hosts) o2.netns = hosts->ns(2);
    o2.extra_yaml = "tcp: {streams: 2}\n" + auth;
    auto node2 = std::make_unique<Daemon>(o2);
    REQUIRE(node2->ready());
    for (uint32_t h = 0; h < 2; ++h) {
        INFO("reload on node" << h);
        set_hosts(c.d[h]->dir() + "/ringd.yaml", three);
        const json st = reload_host(*c.d[h]);
        CHECK_THAT(st["config"]["last_reload"].get<std::string>(), Catch::Contains("applied: hosts"));
        REQUIRE(job_moves(named));
        REQUIRE(job_moves(*every));
    }
    // The ring of three forms while both jobs run on over the two hosts they were agreed on.
    bool up = false;
    for (int i = 0; i < 200 && !up; ++i) {
        up = json::parse(*fetch_status(node2->socket()))["ring"]["size"] == 3;
        for (uint32_t h = 0; h < 2; ++h) up = up && c.status(h)["ring"]["state"] == "up" && c.status(h)["ring"]["size"] == 3;
        if (!up) std::this_thread::sleep_for(50ms);
    }
    REQUIRE(up);
    REQUIRE(job_moves(named));
    REQUIRE(job_moves(*every));
    for (uint32_t h = 0; h < 2; ++h) {
        const json st = c.status(h);
        bool part = false;  // the ring of two goes on as a domain over part of the ring of three
        for (const auto &d : st["domains"]) part = part || d["hosts"] == json::array({"node0", "node1"});
        CHECK(part);
    }
    // The late rank joins its group where it runs (over the two hosts of its first ranks).
    late.insert(late.begin() + 1, std::make_unique<Client>(c.d[0]->socket(), "late", 1, 2, kSlot, ""));
    steps(late, 25);
    late.clear();
    // A new group over the two named hosts runs with them, beside the ring of three.
    {
        auto pair = connect_on(c, "pair-after", {0, 1}, {1, 1}, "node0,node1", kSlot);
        steps(pair, 20);
    }
    check_clean(every->stop(), 8);
    for (uint32_t h = 0; h < 2; ++h) CHECK(c.group(h, "every")["ops_failed"] == 0);
    every.reset();  // its ranks leave
    // The unnamed job's next run is over every host of the new list.
    Clients all3 = connect_all(c, "every", 1, kSlot);
    all3.push_back(std::make_unique<Client>(node2->socket(), "every", 0, 1, kSlot, ""));
    steps(all3, 30);

    // node2 leaves the lists again: the group over it ends, once, naming the reload; the named job
    // runs on (the domain of its two hosts is the whole ring again).
    for (uint32_t h = 0; h < 2; ++h) {
        set_hosts(c.d[h]->dir() + "/ringd.yaml", two);
        const json st = reload_host(*c.d[h]);
        CHECK_THAT(st["config"]["last_reload"].get<std::string>(), Catch::Contains("applied: hosts"));
        REQUIRE(job_moves(named));
    }
    for (size_t r = 0; r < 2; ++r) {
        const uint64_t t = all3[r]->submit(bench::kGuardBytes, 1000, RINGD_F32, RINGD_SUM);
        CHECK(ringd_wait(all3[r]->get(), t, 10000) != 0);
        CHECK_THAT(std::string(ringd_last_error(all3[r]->get())),
                   Catch::Contains("the host list changed (a reload on host node") && Catch::Contains("host node2 left the host list"));
        CHECK(c.group(static_cast<uint32_t>(r), "every")["ops_failed"] == 1);
    }
    all3.clear();
    node2.reset();
    REQUIRE(job_moves(named));
    check_clean(named.stop(), 16);
    for (uint32_t h = 0; h < 2; ++h) CHECK(c.group(h, "named")["ops_failed"] == 0);
    for (uint32_t h = 0; h < 2; ++h) {
        CHECK(c.status(h)["ring"]["size"] == 2);
        CHECK(c.status(h)["ring"]["state"] == "up");
    }
    Clients again = connect_all(c, "every-again", 1, kSlot);
    steps(again, 40);
}

TEST_CASE("a drained host of a ring refuses new groups naming the drain while the job over it loops on; drain "
          "--wait returns once that job ended; undrain takes new groups again",
          "[operations][drain]") {
    const auto hosts = namespace_hosts(3);
    ClusterOptions o{"10s", "", "", "64MiB"};
    o.netns = hosts.get();
    TestCluster c(3, o);
    REQUIRE(c.wait_up());
    const std::string ringctl = env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + c.d[1]->socket();
    auto job = std::make_unique<LoopingJob>(connect_all(c, "running", 1, kSlot));
    REQUIRE(job_moves(*job));
    REQUIRE(run_command(ringctl + " drain").exit_code == 0);
    CHECK(c.status(1)["drained"] == true);
    // A new group over the drained host is refused there, naming the drain.
    char err[256] = "";
    CHECK(ringd_connect(c.d[1]->socket().c_str(), "new-job", 0, 1, kSlot, err, sizeof err) == nullptr);
    CHECK_THAT(err, Catch::Contains("host node1 is drained (ringctl drain)") && Catch::Contains("new-job"));
    REQUIRE(job_moves(*job));  // the running job goes on
    // drain --wait returns once the job has ended (its ranks leave after a second).
    const auto t0 = Clock::now();
    LoopingJob::Counts k;
    std::thread end_job([&] {
        std::this_thread::sleep_for(1s);
        k = job->stop();
        job.reset();  // its clients disconnect
    });
    const auto w = run_command(ringctl + " drain --wait --timeout 20 2>&1");
    end_job.join();
    check_clean(k);
    CHECK(w.exit_code == 0);
    CHECK_THAT(w.output, Catch::Contains("no group runs here any more"));
    CHECK(Clock::now() - t0 >= 900ms);
    REQUIRE(run_command(ringctl + " undrain").exit_code == 0);
    auto after = connect_all(c, "new-job", 1, kSlot);
    steps(after, 7);
}
