// Groups over part of the ring (ring domains, daemon/ring/ring_domain.h): several at once on
// 4 real ringd processes, every value checked here; what a host's failure does to the groups it
// is in, and to those it is not in.
#include <signal.h>

#include "tests/support/cluster.h"

using namespace ringd;
using namespace ringd::test;

namespace {

struct Group {
    std::string name;
    std::vector<uint32_t> on;     // hosts (config indices), in the order the trainers list them
    std::vector<uint32_t> ranks;  // local ranks on each
    std::string hosts;            // what the trainers declare
    Clients cl;
};

Group make_group(TestCluster &c, std::string name, std::vector<uint32_t> on, std::vector<uint32_t> ranks) {
    std::string hosts;
    if (on.size() < c.n)
        for (uint32_t h : on) hosts += (hosts.empty() ? "" : ",") + std::string("node") + std::to_string(h);
    Group g{std::move(name), std::move(on), std::move(ranks), hosts, {}};
    g.cl = connect_on(c, g.name, g.on, g.ranks, g.hosts);
    return g;
}

// One op on every group at once (submitted on all of them, then waited on), checked.
void round_checked(std::vector<Group *> groups, DType t, ReduceOp op, size_t count, uint64_t seed) {
    std::vector<CheckedOp> ops;
    for (Group *g : groups) ops.push_back(submit_checked(g->cl, t, op, count, seed));
    for (size_t k = 0; k < groups.size(); ++k) {
        INFO("group " << groups[k]->name);
        wait_checked(groups[k]->cl, ops[k]);
    }
}

// The status object of daemon i's ring domain over `hosts` (names), or null.
json domain_status(TestCluster &c, uint32_t i, const std::vector<std::string> &hosts) {
    const json st = c.status(i);
    for (const auto &d : st["domains"])
        if (d["hosts"] == json(hosts)) return d;
    return {};
}

// Submits an op on every client of `cl`, which must fail; returns the first rank's message.
std::string wait_fails(Clients &cl, size_t count, uint64_t seed) {
    std::vector<uint64_t> t;
    for (size_t g = 0; g < cl.size(); ++g) {
        const auto r = rank_range(*cl[g], g, DType::F32, count, seed);
        t.push_back(cl[g]->submit(r.offset, count, RINGD_F32, RINGD_SUM));
    }
    std::string first;
    for (size_t g = 0; g < cl.size(); ++g) {
        const int rc = ringd_wait(cl[g]->get(), t[g], 20000);
        INFO("rank " << g);
        CHECK(rc != 0);  // at once, or (a ring that is down) within the op timeout
        if (g == 0) first = ringd_last_error(cl[g]->get());
    }
    return first;
}

}  // namespace

// (No ": " late in a test name: Catch2 indents a wrapped name after it, and asserts past the width.)
TEST_CASE("five groups at once on 4 hosts, each over its own hosts with its own local sizes, every value exact",
          "[cluster][domains]") {
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    TestCluster c(4, ClusterOptions{"10s", "", transport, "64MiB"});
    REQUIRE(c.wait_up());
    std::vector<Group> g;
    g.push_back(make_group(c, "a01", {0, 1}, {2, 2}));
    g.push_back(make_group(c, "b23", {2, 3}, {1, 1}));
    g.push_back(make_group(c, "c13", {1, 3}, {2, 2}));
    g.push_back(make_group(c, "d302", {3, 0, 2}, {1, 1, 1}));
    g.push_back(make_group(c, "e_all", {0, 1, 2, 3}, {1, 1, 1, 1}));
    std::vector<Group *> all;
    for (auto &x : g) all.push_back(&x);
    uint64_t seed = 1;
    for (int round = 0; round < 3; ++round) {
        round_checked(all, DType::F32, ReduceOp::Sum, 1000, seed++);        // direct exchange
        round_checked(all, DType::F32, ReduceOp::Avg, 700001, seed++);      // the ring, concurrently
        round_checked(all, DType::BF16, ReduceOp::Avg, 300001, seed++);
        round_checked(all, DType::I64, ReduceOp::Max, 77777, seed++);
    }
    // A group of unequal local sizes: avg divides by its 4 ranks.
    Group u = make_group(c, "u02", {0, 2}, {3, 1});
    round_checked({&u, &g[1]}, DType::F32, ReduceOp::Avg, 900001, seed++);
    round_checked({&u}, DType::F16, ReduceOp::Avg, 5003, seed++);

    // Each host is in the domains of its groups only; each domain ran ring ops of its own.
    const json d01 = domain_status(c, 1, {"node0", "node1"});
    REQUIRE_FALSE(d01.is_null());
    CHECK(d01["state"] == "up");
    CHECK(d01["ops_ring"].get<int>() >= 3);
    CHECK_FALSE(domain_status(c, 1, {"node1", "node3"}).is_null());
    CHECK(domain_status(c, 1, {"node2", "node3"}).is_null());
    CHECK(domain_status(c, 1, {"node0", "node2", "node3"}).is_null());
    CHECK(c.status(1)["domains"].size() == 2);
    CHECK(c.status(0)["domains"].size() == 3);  // {0,1}, {0,2,3}, {0,2}
    CHECK(domain_status(c, 3, {"node0", "node2", "node3"})["ops_ring"].get<int>() >= 3);
    CHECK(c.status(2)["ring"]["ops_ring"].get<int>() >= 3);  // the whole ring's group
    CHECK(c.group(3, "d302")["hosts"] == json::array({"node0", "node2", "node3"}));
    // ringctl shows each domain like the ring.
    const auto out = run_command(env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + c.d[1]->socket() + " status");
    REQUIRE(out.exit_code == 0);
    CHECK_THAT(out.output, Catch::Contains("ring domain node0,node1: up, generation") &&
                               Catch::Contains("ring domain node1,node3: up, generation") &&
                               !Catch::Contains("ring domain node2,node3"));
}

TEST_CASE("a host outside a group SIGKILLed does not disturb it; a host inside fails only its groups, which run "
          "again when it is back",
          "[cluster][domains][faults]") {
    TestCluster c(4, ClusterOptions{"5s", "1s", "", "64MiB"});
    REQUIRE(c.wait_up());
    Group a = make_group(c, "a01", {0, 1}, {1, 1});
    Group b = make_group(c, "b23", {2, 3}, {2, 2});
    Group d = make_group(c, "d023", {0, 2, 3}, {1, 1, 1});
    round_checked({&a, &b, &d}, DType::F32, ReduceOp::Sum, 600001, 1);

    // node1 dies: a01 (and the whole ring) lose a host; b23 and d023 have nothing to do with it.
    ::kill(c.d[1]->pid(), SIGKILL);
    const auto killed = Clock::now();
    // Ring and direct ops of the groups without node1 go on, exact, while it is gone — ring ops
    // included, so their links are their own.
    for (uint64_t seed = 2; seed < 8; ++seed) {
        round_checked({&b, &d}, DType::F32, ReduceOp::Avg, seed % 2 ? 600001 : 999, seed);
    }
    INFO("the others ran for " << seconds_since(killed) << " s after the kill");
    // Its own group fails, naming it, within its op timeout.
    a.cl.erase(a.cl.begin() + 1);  // node1's trainer went with its ringd
    const std::string why = wait_fails(a.cl, 1000, 9);
    CHECK_THAT(why, Catch::Contains("host node1: connection closed"));
    CHECK(domain_status(c, 0, {"node0", "node2", "node3"})["last_abort"] == "");

    // node1 comes back; the job on it restarts everywhere and runs exact ops.
    c.d[1]->start();
    REQUIRE(c.d[1]->ready());
    REQUIRE(c.wait_ring(1, 1));
    a.cl.clear();
    a = make_group(c, "a01", {0, 1}, {1, 1});
    round_checked({&a, &b, &d}, DType::F32, ReduceOp::Sum, 600001, 10);
    round_checked({&a}, DType::BF16, ReduceOp::Avg, 3001, 11);
    // The groups without node1 never saw a failure.
    for (uint32_t h : {2u, 3u}) CHECK(c.group(h, "b23")["ops_failed"] == 0);
    for (uint32_t h : {0u, 2u, 3u}) CHECK(c.group(h, "d023")["ops_failed"] == 0);
}

TEST_CASE("a host outside a group never gets its ring domain; a trainer there naming those hosts is refused",
          "[cluster][domains]") {
    TestCluster c(3);
    REQUIRE(c.wait_up());
    // node2's trainers declare {node0,node2}: its domain dials node0 only; node1 never hears of it.
    Group g = make_group(c, "g02", {0, 2}, {1, 1});
    round_checked({&g}, DType::F32, ReduceOp::Sum, 600001, 1);
    CHECK(c.status(1)["domains"].empty());
    // A trainer on node1 that names the same hosts is refused by its ringd (not one of them).
    std::string err;
    CHECK_FALSE(join_opts(c, 1, "g02", 0, 1, "node0,node2", err));
    CHECK_THAT(err, Catch::Contains("host node1 is not one of them"));
}

TEST_CASE("limits.ring_domains: a join that needs one more is refused while every domain has groups; an idle "
          "one is let go for it",
          "[cluster][domains]") {
    TestCluster c(3, ClusterOptions{"5s", "", "limits: {ring_domains: 2}\n", "64MiB"});
    REQUIRE(c.wait_up());
    Group a = make_group(c, "g01", {0, 1}, {1, 1});
    round_checked({&a}, DType::F32, ReduceOp::Sum, 600001, 1);
    // node0 has the whole ring and {node0,node1}: a group over {node0,node2} needs a third.
    std::string err;
    CHECK_FALSE(join_opts(c, 0, "g02", 0, 1, "node0,node2", err));
    CHECK_THAT(err, Catch::Contains("limits.ring_domains"));
    // The job on {node0,node1} ends; after a while without groups its domain makes room.
    a.cl.clear();
    std::this_thread::sleep_for(11s);
    Group b = make_group(c, "g02", {0, 2}, {1, 1});
    round_checked({&b}, DType::F32, ReduceOp::Avg, 600001, 2);
    CHECK(domain_status(c, 0, {"node0", "node1"}).is_null());
    CHECK_FALSE(domain_status(c, 0, {"node0", "node2"}).is_null());
    // node1 still has {node0,node1} (no limit pressure there) and dials node0 for it: refused, not
    // made again for node1's sake, and said once, not at every redial.
    std::this_thread::sleep_for(2s);
    CHECK(domain_status(c, 0, {"node0", "node1"}).is_null());
    const std::string log = c.d[0]->log();
    size_t said = 0;
    for (size_t at = 0; (at = log.find("[warning] peer connection from 127.0.0.1: ring domain node0,node1: no group over "
                                       "these hosts has joined", at)) != std::string::npos; ++at)
        ++said;
    CHECK(said >= 1);
    CHECK(said == 1);  // not at every redial
}

TEST_CASE("groups over the same hosts run side by side in lanes: a ring op of one is not held behind a large "
          "one of another (with one lane it is)",
          "[cluster][domains][lanes]") {
    const int lanes = GENERATE(2, 1);
    INFO("tuning.lanes " << lanes);
    // Every op on the ring (no direct exchange, which would not wait for ring ops anyway).
    TestCluster c(3, ClusterOptions{"20s", "", "tuning: {direct_max_bytes: 0, lanes: " + std::to_string(lanes) + "}\n",
                                    "64MiB"});
    REQUIRE(c.wait_up());
    Clients big = connect_all(c, "big", 1, 56 << 20), small = connect_all(c, "small", 1, 4 << 20);
    allreduce_checked(big, DType::F32, ReduceOp::Sum, 1000, 1);  // both incarnations agreed: their lanes given
    allreduce_checked(small, DType::F32, ReduceOp::Sum, 1000, 2);
    const size_t big_count = 12 << 20;  // 48 MiB: a few hundred ms on this ring
    CheckedOp b = submit_checked(big, DType::F32, ReduceOp::Sum, big_count, 3);
    SlotWatch big_moves(*big[0], b.range[0].offset, big_count);
    REQUIRE(wait_data_moving(big_moves) >= 0);  // the large op runs
    const size_t small_count = 600001;
    // The watch takes the inputs before the submission: with its own lane the small op may be over
    // before a watch made after it looked.
    CheckedOp s = prepare_checked(small, DType::F32, ReduceOp::Avg, small_count, 4);  // a ring op
    SlotWatch small_moves(*small[0], s.range[0].offset, small_count, 1024);
    submit_prepared(small, s);
    REQUIRE(wait_data_moving(small_moves) >= 0);
    // The small op moves data: is the large one still running? (This host's ringd gave neither
    // back yet, or only the small one.)
    const json g = c.group(0, "big");
    wait_checked(small, s);
    wait_checked(big, b);
    INFO("the large group when the small op's data moved: " << g.dump());
    if (lanes == 2) CHECK(g["running_ops"] == 1);  // side by side
    else CHECK(g["running_ops"] == 0);             // one lane: the small op waited for the large one
    CHECK(c.status(0)["ring"]["lanes"] == lanes);
}
