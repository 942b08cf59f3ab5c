// reduce_scatter, allgather, broadcast, reduce, barrier and all_to_all through real daemons: trainers that say their rank in the group
// (ringd_options.rank, .ranks), ranks numbered unlike the ring's order and uneven per host, every
// dtype x op, in place and apart, every value and the guard bytes around every range checked here
// from the inputs (never through ringd); the errors a job meets (no ranks said, a rank said twice,
// group sizes that differ, hosts whose ops differ), each named.
#include <catch2/catch.hpp>

#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "ringd/ringd.h"
#include "tests/support/cluster.h"
#include "tests/support/ranked.h"

using namespace ringd;
using namespace ringd::test;

namespace {

// One reduce_scatter or allgather on every trainer's slot, waited and checked (ranked.h).
Verdict run_checked(std::vector<Trainer> &tr, Collective coll, DType t, ReduceOp op, size_t count, bool in_place,
                    uint64_t seed) {
    const auto ranks = static_cast<uint32_t>(tr.size());
    std::vector<Placement> pl;
    std::vector<uint64_t> tickets(tr.size());
    for (auto &x : tr) {
        const Placement p = place(coll, t, count, ranks, x.rank, in_place, seed);
        REQUIRE(p.span_end + bench::kGuardBytes <= x.bytes);
        fill_ranked(x.slot, p, coll, t, count, x.rank, in_place, seed);
        pl.push_back(p);
    }
    for (size_t g = 0; g < tr.size(); ++g) {
        const ringd_coll d{sizeof(ringd_coll), static_cast<ringd_collective>(coll), static_cast<ringd_dtype>(t),
                           static_cast<ringd_op>(op), count, pl[g].in, pl[g].out, 0, nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
        const int rc = ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]);
        INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
        REQUIRE(rc == 0);
    }
    Verdict v;
    for (size_t g = 0; g < tr.size(); ++g) {
        const int rc = ringd_wait(tr[g].c.get(), tickets[g], 20000);
        INFO("rank " << tr[g].rank << " " << collective_name(coll) << " " << dtype_name(t) << " " << reduce_op_name(op)
                     << " count " << count << (in_place ? " in place" : "") << ": " << ringd_last_error(tr[g].c.get()));
        REQUIRE(rc == 0);
    }
    for (size_t g = 0; g < tr.size(); ++g) v += check_ranked(tr[g].slot, pl[g], coll, t, op, count, ranks, tr[g].rank, in_place, seed);
    return v;
}

// Every dtype x op of reduce_scatter and every dtype of allgather, at these counts, in place and apart.
uint64_t sweep(std::vector<Trainer> &tr, const std::vector<size_t> &counts, uint64_t seed = 1) {
    uint64_t ops = 0;
    for (uint32_t ti = 0; ti < kDTypeCount; ++ti) {
        const auto t = static_cast<DType>(ti);
        for (uint32_t oi = 0; oi <= kReduceOpCount; ++oi) {
            // oi == kReduceOpCount: the allgather of the dtype.
            const bool gather = oi == kReduceOpCount;
            const auto op = gather ? ReduceOp::Sum : static_cast<ReduceOp>(oi);
            if (op == ReduceOp::Avg && dtype_is_integer(t)) continue;
            for (size_t count : counts)
                for (bool in_place : {false, true}) {
                    const Collective coll = gather ? Collective::Allgather : Collective::ReduceScatter;
                    INFO(collective_name(coll) << " " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                               << (in_place ? " in place" : " apart"));
                    const Verdict v = run_checked(tr, coll, t, op, count, in_place, seed++);
                    CHECK(v.wrong == 0);
                    CHECK(v.guard == 0);
                    CHECK(v.input_changed == 0);
                    ++ops;
                }
        }
    }
    return ops;
}

// One broadcast or reduce from `root` on every trainer's slot, in place, waited and checked.
Verdict run_rooted(std::vector<Trainer> &tr, Collective coll, DType t, ReduceOp op, size_t count, uint32_t root,
                   uint64_t seed) {
    const auto ranks = static_cast<uint32_t>(tr.size());
    std::vector<Placement> pl;
    std::vector<uint64_t> tickets(tr.size());
    for (auto &x : tr) {
        const Placement p = place_rooted(t, count, x.rank, seed);
        REQUIRE(p.span_end + bench::kGuardBytes <= x.bytes);
        bench::guard_fill(x.slot, p.span_begin - bench::kGuardBytes, p.span_end + bench::kGuardBytes, seed);
        for (size_t i = 0; i < count; ++i) bench::store(x.slot + p.in, i, t, static_cast<double>(bench::value(x.rank, i)));
        pl.push_back(p);
    }
    for (size_t g = 0; g < tr.size(); ++g) {
        const ringd_coll d{sizeof(ringd_coll), static_cast<ringd_collective>(coll), static_cast<ringd_dtype>(t),
                           static_cast<ringd_op>(op), count, pl[g].in, 0, static_cast<int>(root), nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
        const int rc = ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]);
        INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
        REQUIRE(rc == 0);
    }
    Verdict v;
    for (size_t g = 0; g < tr.size(); ++g) {
        const int rc = ringd_wait(tr[g].c.get(), tickets[g], 20000);
        INFO("rank " << tr[g].rank << " " << collective_name(coll) << " " << dtype_name(t) << " " << reduce_op_name(op)
                     << " count " << count << " root " << root << ": " << ringd_last_error(tr[g].c.get()));
        REQUIRE(rc == 0);
    }
    for (size_t g = 0; g < tr.size(); ++g) v += check_rooted(tr[g].slot, pl[g], coll, t, op, count, ranks, tr[g].rank, root, seed);
    return v;
}

// Every dtype x op of reduce and every dtype of broadcast at these counts, the root going round
// every rank.
uint64_t sweep_rooted(std::vector<Trainer> &tr, const std::vector<size_t> &counts, uint64_t seed = 1) {
    uint64_t ops = 0;
    uint32_t root = 0;
    for (uint32_t ti = 0; ti < kDTypeCount; ++ti) {
        const auto t = static_cast<DType>(ti);
        for (uint32_t oi = 0; oi <= kReduceOpCount; ++oi) {
            const bool bcast = oi == kReduceOpCount;  // the broadcast of the dtype
            const auto op = bcast ? ReduceOp::Sum : static_cast<ReduceOp>(oi);
            if (op == ReduceOp::Avg && dtype_is_integer(t)) continue;
            const Collective coll = bcast ? Collective::Broadcast : Collective::Reduce;
            for (size_t count : counts) {
                root = (root + 1) % static_cast<uint32_t>(tr.size());
                INFO(collective_name(coll) << " " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                           << " root " << root);
                const Verdict v = run_rooted(tr, coll, t, op, count, root, seed++);
                CHECK(v.wrong == 0);
                CHECK(v.guard == 0);
                ++ops;
            }
        }
    }
    return ops;
}

// Rank i sends rank j split(i, j) elements: 0 to 3 times `k`, zeros included; `even`: k each.
uint64_t split(uint32_t i, uint32_t j, uint64_t k, uint64_t seed, bool even) {
    return even ? k : (i * 31 + j * 17 + seed) % 4 * k + (i + j) % 2;
}

// Waits for ticket t[g] of trainer g, for each g of t from `first` on: each must fail with `code`, its message
// containing `text`, within `limit` of `since` (not at an op timeout).
void expect_all_failed(std::vector<Trainer> &tr, const std::vector<uint64_t> &t, int code, const std::string &text,
                       Clock::time_point since, std::chrono::milliseconds limit, size_t first = 0) {
    REQUIRE(t.size() <= tr.size());
    for (size_t g = first; g < t.size(); ++g) {
        const int rc = ringd_wait(tr[g].c.get(), t[g], 20000);
        const std::string why = ringd_last_error(tr[g].c.get());
        INFO("trainer " << g << ": " << why);
        CHECK(rc == code);
        CHECK_THAT(why, Catch::Contains(text));
    }
    CHECK(Clock::now() - since < limit);
}

// One all_to_all on every trainer's slot: rank i's input is value(i, e) over its whole input; after
// it, block i of rank j's output must be rank i's block j. Guard bytes around the input and the
// output; the input left as it was.
Verdict run_a2a(std::vector<Trainer> &tr, DType t, uint64_t k, uint64_t seed, bool even) {
    const auto ranks = static_cast<uint32_t>(tr.size());
    const size_t es = dtype_size(t);
    struct At {
        size_t in, out, table;
        std::vector<uint64_t> send, recv;
        uint64_t in_n = 0, out_n = 0;
    };
    std::vector<At> at(tr.size());
    std::vector<uint64_t> tickets(tr.size());
    for (size_t g = 0; g < tr.size(); ++g) {
        At &a = at[g];
        const uint32_t me = tr[g].rank;
        for (uint32_t j = 0; j < ranks; ++j) {
            a.send.push_back(split(me, j, k, seed, even));
            a.recv.push_back(split(j, me, k, seed, even));
            a.in_n += a.send.back();
            a.out_n += a.recv.back();
        }
        a.in = bench::kGuardBytes + (seed + me * 5) % 16 * 8;
        a.out = (a.in + a.in_n * es + 2 * bench::kGuardBytes + 63) / 64 * 64;
        a.table = (a.out + a.out_n * es + 2 * bench::kGuardBytes + 63) / 64 * 64;
        REQUIRE(a.table + 16 * ranks <= tr[g].bytes);
        bench::guard_fill(tr[g].slot, a.in - bench::kGuardBytes, a.out + a.out_n * es + bench::kGuardBytes, seed);
        for (uint64_t e = 0; e < a.in_n; ++e) bench::store(tr[g].slot + a.in, e, t, static_cast<double>(bench::value(me, e)));
        ringd_coll d{};
        d.struct_size = sizeof d;
        d.collective = RINGD_ALL_TO_ALL;
        d.dtype = static_cast<ringd_dtype>(t);
        d.count = even ? k : 0;
        d.in_offset = a.in;
        d.out_offset = a.out;
        if (!even) {
            d.send_counts = a.send.data();
            d.recv_counts = a.recv.data();
            d.splits_offset = a.table;
        }
        const int rc = ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]);
        INFO("rank " << me << ": " << ringd_last_error(tr[g].c.get()));
        REQUIRE(rc == 0);
    }
    for (size_t g = 0; g < tr.size(); ++g) {
        const int rc = ringd_wait(tr[g].c.get(), tickets[g], 20000);
        INFO("rank " << tr[g].rank << " all_to_all " << dtype_name(t) << " k " << k << (even ? " even" : " split") << ": "
                     << ringd_last_error(tr[g].c.get()));
        REQUIRE(rc == 0);
    }
    Verdict v;
    for (size_t g = 0; g < tr.size(); ++g) {
        const At &a = at[g];
        const uint32_t me = tr[g].rank;
        uint64_t o = 0;
        for (uint32_t i = 0; i < ranks; ++i) {
            // Rank i's block for `me` starts where its blocks for ranks 0..me-1 end.
            uint64_t from = 0;
            for (uint32_t j = 0; j < me; ++j) from += split(i, j, k, seed, even);
            for (uint64_t e = 0; e < a.recv[i]; ++e)
                if (bench::load(tr[g].slot + a.out, o + e, t) != bench::round_to(t, static_cast<double>(bench::value(i, from + e))))
                    ++v.wrong;
            o += a.recv[i];
        }
        for (uint64_t e = 0; e < a.in_n; ++e)
            if (bench::load(tr[g].slot + a.in, e, t) != bench::round_to(t, static_cast<double>(bench::value(me, e)))) ++v.input_changed;
        v.guard += bench::guard_damage(tr[g].slot, a.in - bench::kGuardBytes, a.in, seed) +
                   bench::guard_damage(tr[g].slot, a.in + a.in_n * es, a.out, seed) +
                   bench::guard_damage(tr[g].slot, a.out + a.out_n * es, a.out + a.out_n * es + bench::kGuardBytes, seed);
    }
    return v;
}

}  // namespace

TEST_CASE("all_to_all on 3 hosts: ranks 1, 2, 3 per host numbered unlike the ring, uneven split sizes with zeros and "
          "even blocks, every dtype, small and in several parts, every value and guard byte exact; split sizes that "
          "differ are named",
          "[cluster][collectives]") {
    // (Over TCP: an all_to_all's data goes over the control connections whatever the transport.)
    TestCluster c(3, "10s");
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "a2a", {1, 2, 3}, {4, 0, 5, 2, 1, 3}, 64 << 20);
    REQUIRE(tr.size() == 6);
    uint64_t seed = 1, ops = 0;
    for (uint32_t ti = 0; ti < kDTypeCount; ++ti)
        for (bool even : {false, true})
            for (uint64_t k : {uint64_t{1}, uint64_t{1001}}) {
                const Verdict v = run_a2a(tr, static_cast<DType>(ti), k, seed++, even);
                CHECK(v.wrong == 0);
                CHECK(v.guard == 0);
                CHECK(v.input_changed == 0);
                ++ops;
            }
    // Messages of several parts (proto::kAllToAllPartBytes, 4 MiB): about 25 MB from host 2 to host 1.
    const Verdict big = run_a2a(tr, DType::F32, 700001, 77, false);
    CHECK(big.wrong == 0);
    CHECK(big.guard == 0);
    ++ops;
    // Two ranks that disagree on a pair's size: the receiving rank's host fails the op, naming both
    // ranks (the other hosts got what they expected and may complete it); the group goes on.
    std::vector<uint64_t> tickets(tr.size());
    for (size_t g = 0; g < tr.size(); ++g) {
        std::vector<uint64_t> send(6, 2), recv(6, 2);
        if (tr[g].rank == 3) send[4] = 5;  // rank 4 expects 2
        ringd_coll d{};
        d.struct_size = sizeof d;
        d.collective = RINGD_ALL_TO_ALL;
        d.dtype = RINGD_F32;
        d.in_offset = 4096;
        d.out_offset = 8192;
        d.send_counts = send.data();
        d.recv_counts = recv.data();
        d.splits_offset = 16384;
        REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]) == 0);
    }
    for (size_t g = 0; g < tr.size(); ++g) {
        const int rc = ringd_wait(tr[g].c.get(), tickets[g], 10000);
        if (tr[g].rank != 4) continue;
        CHECK(rc == -EPROTO);
        CHECK_THAT(ringd_last_error(tr[g].c.get()), Catch::Contains("all_to_all: rank 3 (host node2) sends rank 4 5 elements, "
                                                                    "and rank 4 (host node0) expects 2"));
    }
    const Verdict after = run_a2a(tr, DType::I64, 333, 91, false);
    CHECK(after.wrong == 0);
    CHECK(c.status(0)["ops"]["completed"] == ops + 1);
    CHECK(c.status(0)["ops"]["failed"] == 1);
    // Over the ring's data links, both ways (three hosts are all neighbours: no mesh links); the
    // generation the ring formed with runs on.
    const auto j = c.status(2);
    CHECK(j["ring"]["generation"] == 1);
    CHECK(j["ring"]["all_to_all"]["path"] == "data links");
    CHECK(j["ring"]["all_to_all"]["mesh_links"] == 0);
    CHECK(j["ring"]["all_to_all"]["bytes_out"].get<uint64_t>() > (20u << 20));
}

TEST_CASE("all_to_all on 5 hosts over the mesh links: every pair of hosts exchanges its ranks' blocks straight "
          "between slots, every value and guard byte exact; counts that differ fail only the op, on the receiving host",
          "[cluster][collectives]") {
    TestCluster c(5, "10s");
    REQUIRE(c.wait_up());
    // 2, 1, 1, 2, 1 ranks, numbered unlike the ring: each host has two hosts it is no neighbour of.
    auto tr = join_ranked(c, "mesh", {2, 1, 1, 2, 1}, {6, 0, 3, 5, 1, 4, 2}, 32 << 20);
    REQUIRE(tr.size() == 7);
    uint64_t seed = 5, ops = 0;
    for (const auto &[t, k, even] : {std::tuple{DType::F32, uint64_t{1}, false}, std::tuple{DType::BF16, uint64_t{1001}, true},
                                     std::tuple{DType::I64, uint64_t{77}, false},
                                     // Blocks of several pieces (1 MiB) each way: 0.5-1.5 MB per pair of ranks.
                                     std::tuple{DType::F32, uint64_t{130001}, false}}) {
        INFO(dtype_name(t) << " k " << k << (even ? " even" : " split"));
        const Verdict v = run_a2a(tr, t, k, seed++, even);
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
        CHECK(v.input_changed == 0);
        ++ops;
    }
    // Rank 0 (node0) sends rank 4 (node3, two hops away: a mesh link) 5 elements where it expects 2.
    std::vector<uint64_t> tickets(tr.size());
    for (size_t g = 0; g < tr.size(); ++g) {
        std::vector<uint64_t> send(7, 2), recv(7, 2);
        if (tr[g].rank == 0) send[4] = 5;
        ringd_coll d{};
        d.struct_size = sizeof d;
        d.collective = RINGD_ALL_TO_ALL;
        d.dtype = RINGD_F32;
        d.in_offset = 4096;
        d.out_offset = 8192;
        d.send_counts = send.data();
        d.recv_counts = recv.data();
        d.splits_offset = 16384;
        REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]) == 0);
    }
    for (size_t g = 0; g < tr.size(); ++g) {
        const int rc = ringd_wait(tr[g].c.get(), tickets[g], 10000);
        if (tr[g].rank != 4) continue;
        CHECK(rc == -EPROTO);
        CHECK_THAT(ringd_last_error(tr[g].c.get()), Catch::Contains("all_to_all: rank 0 (host node0) sends rank 4 5 elements, "
                                                                    "and rank 4 (host node3) expects 2"));
    }
    const Verdict after = run_a2a(tr, DType::F32, 4099, 93, false);
    CHECK(after.wrong == 0);
    CHECK(after.guard == 0);
    for (uint32_t h = 0; h < 5; ++h) {
        const auto j = c.status(h);
        INFO("node" << h);
        CHECK(j["ring"]["generation"] == 1);  // nothing re-formed
        CHECK(j["ring"]["all_to_all"]["path"] == "data links");
        CHECK(j["ring"]["all_to_all"]["mesh_links"] == 2);
        CHECK(j["ring"]["all_to_all"]["bytes_out"].get<uint64_t>() > (1u << 20));
    }
    // ringctl says it in words.
    const auto r = run_command(env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + c.d[3]->socket() + " status 2>&1");
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.output, Catch::Contains("all_to_all over the data links (2 mesh link(s))"));
}

TEST_CASE("all_to_all on 2 hosts x 4 ranks: a MiB of blocks or more to the other host go by reference, confirmed "
          "before the op ends; less is copied; every value and guard byte exact; a rank that refuses an op fails it "
          "on every rank at once, named",
          "[cluster][collectives]") {
    TestCluster c(2, "10s");
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "a2a-ref", {4, 4}, {7, 2, 4, 1, 0, 6, 3, 5}, 40 << 20);
    REQUIRE(tr.size() == 8);
    // 16 blocks of 2 MiB each way: by reference (the flags ask for the done message).
    Verdict v = run_a2a(tr, DType::F32, 1 << 19, 11, true);
    CHECK(v.wrong == 0);
    CHECK(v.guard == 0);
    CHECK(v.input_changed == 0);
    const uint64_t ref = c.status(0)["ring"]["all_to_all"]["by_reference_bytes"].get<uint64_t>();
    CHECK(ref >= (32u << 20));
    // The same slots again at once, then split sizes of less than a MiB to the other host in all
    // (16 blocks of at most 3 x 10007 + 1 bf16): copied, the count stays.
    v = run_a2a(tr, DType::F32, 1 << 19, 12, true);
    CHECK(v.wrong == 0);
    CHECK(v.guard == 0);
    const uint64_t out = c.status(0)["ring"]["all_to_all"]["bytes_out"].get<uint64_t>();
    v = run_a2a(tr, DType::BF16, 10007, 13, false);
    CHECK(v.wrong == 0);
    CHECK(v.guard == 0);
    CHECK(c.status(0)["ring"]["all_to_all"]["bytes_out"].get<uint64_t>() > out);
    CHECK(c.status(0)["ring"]["all_to_all"]["by_reference_bytes"].get<uint64_t>() == 2 * ref);
    // Just over a MiB to the other host (16 blocks of 16385 f32): by reference.
    v = run_a2a(tr, DType::F32, 16385, 14, true);
    CHECK(v.wrong == 0);
    CHECK(v.guard == 0);
    CHECK(c.status(0)["ring"]["all_to_all"]["by_reference_bytes"].get<uint64_t>() == 2 * ref + 16 * 16385 * 4);
    // node1's local rank 1 cannot run the next one (ringd_refuse: it would not fit its slot):
    // every rank fails it at once, the refusing rank's local peers and the other host's, naming
    // it; the group goes on.
    const uint64_t k = 1 << 16;
    std::vector<uint64_t> t(tr.size());
    const auto s = Clock::now();
    for (size_t g = 0; g < tr.size(); ++g) {
        if (g == 5) {
            REQUIRE(ringd_refuse(tr[g].c.get(), RINGD_ALL_TO_ALL, 987654321, &t[g]) == 0);
            continue;
        }
        ringd_coll d{};
        d.struct_size = sizeof d;
        d.collective = RINGD_ALL_TO_ALL;
        d.dtype = RINGD_F32;
        d.count = k;
        d.out_offset = 8 * 4 * k;
        REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &t[g]) == 0);
    }
    expect_all_failed(tr, t, -E2BIG, "node1 local rank 1 refused it: its all_to_all needs 987654321 bytes of its slot", s,
                      3s);  // not the op timeout (10 s)
    v = run_a2a(tr, DType::F32, 1 << 16, 15, false);
    CHECK(v.wrong == 0);
    CHECK(v.guard == 0);
    CHECK(c.status(1)["ring"]["generation"] == 1);
}

TEST_CASE("a rank refuses the op after one its local peer has not submitted yet: the earlier op runs exact "
          "everywhere, the refused one fails on every rank at once, and the group goes on",
          "[cluster][collectives]") {
    // lanes 1: every ring op on the shared lane, through the coordinator's start; 2: the group's
    // own solo lane, whose hosts start it in order by themselves.
    const int lanes = GENERATE(1, 2);
    INFO("tuning.lanes " << lanes);
    TestCluster c(2, "10s", "tuning:\n  lanes: " + std::to_string(lanes) + "\n");
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "late", {2, 2}, {0, 1, 2, 3}, 8 << 20);
    REQUIRE(tr.size() == 4);
    const uint64_t n = 1 << 18;  // 1 MiB of f32: a ring op
    auto fill = [&](size_t g, float v) {
        auto *f = reinterpret_cast<float *>(tr[g].slot);
        for (uint64_t e = 0; e < n; ++e) f[e] = v;
    };
    auto wrong = [&](size_t g, float want) {
        const auto *f = reinterpret_cast<const float *>(tr[g].slot);
        uint64_t bad = 0;
        for (uint64_t e = 0; e < n; ++e) bad += f[e] != want;
        return bad;
    };
    for (int round = 0; round < 2; ++round) {  // (the second: the same again, after a refused op)
        INFO("round " << round);
        for (size_t g = 0; g < 4; ++g) fill(g, static_cast<float>(g + 1));
        std::vector<uint64_t> first(4), second(4);
        // node0's local rank 0 submits op 1 and refuses op 2 at once; its local rank 1 submits
        // op 1 (and op 2) only 300 ms later; node1's ranks submit both at once.
        REQUIRE(ringd_submit(tr[0].c.get(), 0, n, RINGD_F32, RINGD_SUM, &first[0]) == 0);
        REQUIRE(ringd_refuse(tr[0].c.get(), RINGD_ALLREDUCE, 12345, &second[0]) == 0);
        for (size_t g : {2, 3}) {
            REQUIRE(ringd_submit(tr[g].c.get(), 0, n, RINGD_F32, RINGD_SUM, &first[g]) == 0);
            REQUIRE(ringd_submit(tr[g].c.get(), 0, 16, RINGD_F32, RINGD_SUM, &second[g]) == 0);
        }
        // Node0's ringd has taken the refusal (its own rank's op 2 ended) and node1 runs op 1,
        // waiting for node0: then node0's local rank 1 comes to op 1.
        const auto s = Clock::now();
        const std::string refused = "node0 local rank 0 refused it: its allreduce needs 12345 bytes";
        expect_all_failed(tr, {second[0]}, -E2BIG, refused, s, 3s, 0);
        const auto deadline = Clock::now() + 10s;
        while (c.group(1, "late")["running_ops"].get<int>() == 0 && Clock::now() < deadline)
            std::this_thread::sleep_for(5ms);  // (status has no fd to wait on)
        REQUIRE(c.group(1, "late")["running_ops"].get<int>() > 0);
        REQUIRE(ringd_submit(tr[1].c.get(), 0, n, RINGD_F32, RINGD_SUM, &first[1]) == 0);
        REQUIRE(ringd_submit(tr[1].c.get(), 0, 16, RINGD_F32, RINGD_SUM, &second[1]) == 0);
        for (size_t g = 0; g < 4; ++g) {
            const int rc = ringd_wait(tr[g].c.get(), first[g], 20000);
            INFO("trainer " << g << ": " << ringd_last_error(tr[g].c.get()));
            CHECK(rc == 0);
        }
        expect_all_failed(tr, second, -E2BIG, refused, s, 3s, 1);  // (node0 rank 0's: above)
        for (size_t g = 0; g < 4; ++g) CHECK(wrong(g, 10.0f) == 0);  // op 1: 1 + 2 + 3 + 4
    }
    // The next ops pair: a ring op and a small one, exact.
    std::vector<uint64_t> t(4);
    for (size_t g = 0; g < 4; ++g) {
        fill(g, 0.5f);
        REQUIRE(ringd_submit(tr[g].c.get(), 0, n, RINGD_F32, RINGD_SUM, &t[g]) == 0);
    }
    for (size_t g = 0; g < 4; ++g) REQUIRE(ringd_wait(tr[g].c.get(), t[g], 20000) == 0);
    for (size_t g = 0; g < 4; ++g) CHECK(wrong(g, 2.0f) == 0);
    if (lanes == 2) CHECK(c.status(0)["ring"]["ops_ring_solo"].get<uint64_t>() >= 3);
    CHECK(c.status(1)["ring"]["generation"] == 1);
}

TEST_CASE("all_to_all on a solo lane over the mesh: a rank that leaves before it fails the others' at once, named; "
          "a host whose op differs fails it on every host; the lane's links carry the next ops exact",
          "[cluster][collectives][solo]") {
    TestCluster c(4, "5s");
    REQUIRE(c.wait_up());
    const std::vector<uint32_t> locals{1, 1, 1, 1}, ranks{2, 0, 3, 1};
    auto tr = join_ranked(c, "solo-a2a", locals, ranks, 40 << 20);
    REQUIRE(tr.size() == 4);
    const Verdict first = run_a2a(tr, DType::F32, 1000, 1, false);  // agreed first: the solo lane
    CHECK(first.wrong == 0);
    for (uint32_t h = 0; h < 4; ++h) CHECK(c.status(h)["ring"]["ops_ring_solo"].get<uint64_t>() == 1);
    // Another group over the same hosts loops on the shared lane all along.
    LoopingJob job(connect_all(c, "b", 1, 8 << 20));
    REQUIRE(job_moves(job));
    const uint64_t generation = c.status(0)["ring"]["generation"].get<uint64_t>();
    const uint64_t k = 1 << 20;  // 4 MiB blocks: more than the links' socket buffers hold
    auto submit = [&](size_t g, uint64_t count) {
        ringd_coll d{};
        d.struct_size = sizeof d;
        d.collective = RINGD_ALL_TO_ALL;
        d.dtype = RINGD_F32;
        d.count = count;
        d.in_offset = 0;
        d.out_offset = 4 * 4 * k;
        uint64_t t = 0;
        REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &t) == 0);
        return t;
    };
    SECTION("node1's rank leaves while the others' op runs: it fails at once, naming it; the job restarts exact") {
        const auto s = Clock::now();
        std::vector<std::pair<size_t, uint64_t>> t;
        for (size_t g : {0, 2, 3}) t.emplace_back(g, submit(g, k));
        for (uint32_t h : {0, 2, 3}) REQUIRE(c.wait_taken(h, "solo-a2a"));
        tr[1].c.reset();
        for (auto [g, ticket] : t) {
            const int rc = ringd_wait(tr[g].c.get(), ticket, 20000);
            const std::string why = ringd_last_error(tr[g].c.get());
            INFO("node" << g << ": " << why);
            CHECK(rc == -ECONNABORTED);
            CHECK_THAT(why, Catch::Contains("node1") && Catch::Contains("left"));
        }
        CHECK(Clock::now() - s < 3s);  // not the op timeout (5 s)
        tr.clear();
        tr = join_ranked(c, "solo-a2a", locals, ranks, 40 << 20);
        REQUIRE(tr.size() == 4);
    }
    SECTION("node1 refuses the op (ringd_refuse) while the others' run: every host fails it at once, naming it; "
            "the group goes on") {
        const auto s = Clock::now();
        std::vector<uint64_t> t(4);
        for (size_t g : {0, 2, 3}) t[g] = submit(g, k);
        for (uint32_t h : {0, 2, 3}) REQUIRE(c.wait_taken(h, "solo-a2a"));
        REQUIRE(ringd_refuse(tr[1].c.get(), RINGD_ALL_TO_ALL, 0, &t[1]) == 0);
        expect_all_failed(tr, t, -ECANCELED, "node1 local rank 0 refused it: it could not submit its all_to_all", s,
                          3s);  // not the op timeout (5 s)
    }
    SECTION("node1 submits blocks half the size: every host fails it as a mismatch; the group goes on") {
        std::vector<uint64_t> t;
        for (size_t g = 0; g < 4; ++g) t.push_back(submit(g, g == 1 ? k / 2 : k));
        for (size_t g = 0; g < 4; ++g) {
            const int rc = ringd_wait(tr[g].c.get(), t[g], 20000);
            const std::string why = ringd_last_error(tr[g].c.get());
            INFO("node" << g << ": " << why);
            CHECK(rc == -EINVAL);
            CHECK_THAT(why, Catch::Contains("mismatch") && Catch::Contains("node1"));
        }
    }
    for (uint64_t seed = 20; seed < 23; ++seed) {
        const Verdict v = run_a2a(tr, seed % 2 ? DType::F64 : DType::I32, 200001, seed, seed == 21);
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
    }
    CHECK(c.status(0)["ring"]["generation"].get<uint64_t>() == generation);  // no ring generation ended
    REQUIRE(job_moves(job));
    check_clean(job.stop());
}

TEST_CASE("a host SIGKILLed while the others wait in an all_to_all: they fail within a second naming it; the "
          "restarted job's all_to_all is exact",
          "[cluster][collectives][faults]") {
    TestCluster c(3, ClusterOptions{"30s", "1s", "", "64MiB"});
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "kill-a2a", {1, 1, 1}, {2, 0, 1}, 32 << 20);
    REQUIRE(tr.size() == 3);
    // node0 and node1 submit (their messages go out); node2's trainer never does.
    std::vector<uint64_t> t(2);
    for (size_t g = 0; g < 2; ++g) {
        ringd_coll d{};
        d.struct_size = sizeof d;
        d.collective = RINGD_ALL_TO_ALL;
        d.dtype = RINGD_F32;
        d.count = 1 << 20;
        d.in_offset = 0;
        d.out_offset = 12 << 20;
        REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &t[g]) == 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (size_t g = 0; g < 2; ++g) CHECK(ringd_test(tr[g].c.get(), t[g]) == -EINPROGRESS);
    const auto fault = Clock::now();
    ::kill(c.d[2]->pid(), SIGKILL);
    for (size_t g = 0; g < 2; ++g) {
        const int rc = ringd_wait(tr[g].c.get(), t[g], 15000);
        const double after = seconds_since(fault);
        const std::string why = ringd_last_error(tr[g].c.get());
        INFO("node" << g << ": " << why << " after " << after << " s");
        CHECK(rc == -ECONNABORTED);
        CHECK_THAT(why, Catch::Contains("host node2"));
        CHECK(after < 1.0);
    }
    c.d[2]->start();
    REQUIRE(c.d[2]->ready());
    REQUIRE(c.wait_up({2, 2, 1}));
    tr.clear();
    tr = join_ranked(c, "kill-a2a", {1, 1, 1}, {2, 0, 1}, 32 << 20);
    REQUIRE(tr.size() == 3);
    const Verdict v = run_a2a(tr, DType::F32, 100003, 3, false);
    CHECK(v.wrong == 0);
    CHECK(v.guard == 0);
}

TEST_CASE("ranks that leave once their ops ended on their host: the others' ops every host ran complete, exact; "
          "the next fails at once, naming a host that left",
          "[cluster][collectives][faults]") {
    // (A reduce off the root's host, a broadcast's root.)
    // A reduce ends on a host off the root's once its data is sent, a broadcast on the root's: a
    // job whose ranks there exit at once ends the incarnation while the other hosts may not have
    // got to the op yet. The end says through which op its host ended them, and only later ops
    // fail; a second host's end that spares fewer fails the rest (the group has a solo lane: each
    // host hears of the first end, runs the ops it spares in the lane, and still tells its own).
    TestCluster c(3, "10s");
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "leave", {1, 1, 1}, {0, 1, 2}, 4 << 20);
    REQUIRE(tr.size() == 3);
    auto coll = Collective::Reduce;
    size_t count = 1001;  // one-shot
    std::vector<std::pair<size_t, int>> leave;  // (rank, its ops), in the order they leave
    std::vector<size_t> stay{0};
    int every = 3;  // the ops every host ran
    std::string named = "left";
    SECTION("reduce: both ranks off the root's host after op 3") { leave = {{1, 3}, {2, 3}}; }
    SECTION("reduce: one after op 3, the other after op 1") {
        leave = {{1, 3}, {2, 1}};
        every = 1;
        named = "host node2 local rank 0 left";  // (whose end fails op 2: node1 ran it)
    }
    SECTION("broadcast in the solo lane's chain: its root after op 2") {
        coll = Collective::Broadcast;
        count = 64 << 10;  // 256 KiB: the chain (a ring op), which the lane runs on the hosts by themselves
        leave = {{0, 2}};
        stay = {1, 2};
        every = 2;
        named = "host node0 local rank 0 left";
    }
    std::vector<Placement> pl;
    for (auto &x : tr) {
        pl.push_back(place_rooted(DType::F32, count, x.rank, 5));
        bench::guard_fill(x.slot, pl.back().span_begin - bench::kGuardBytes, pl.back().span_end + bench::kGuardBytes, 5);
    }
    auto submit = [&](size_t g) {
        for (size_t i = 0; i < count; ++i) bench::store(tr[g].slot + pl[g].in, i, DType::F32, static_cast<double>(bench::value(tr[g].rank, i)));
        const ringd_coll d{sizeof(ringd_coll), static_cast<ringd_collective>(coll), RINGD_F32, RINGD_SUM, count, pl[g].in, 0, 0,
                           nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
        uint64_t t = 0;
        REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &t) == 0);
        return t;
    };
    // The leaving ranks run their ops (root 0) one after another, each ended there, and leave,
    // one after the other (the second once it heard of the first's end).
    for (const auto &[g, ops] : leave) {
        for (int k = 0; k < ops; ++k) {
            const uint64_t t = submit(g);
            const int rc = ringd_wait(tr[g].c.get(), t, 10000);
            INFO("rank " << g << " op " << k + 1 << ": " << ringd_last_error(tr[g].c.get()));
            REQUIRE(rc == 0);
        }
        tr[g].c.reset();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its end reaches every host
    }
    // The others get to them now: those every host ran complete, exact.
    for (int k = 0; k < every; ++k) {
        std::vector<uint64_t> ts;
        for (size_t g : stay) ts.push_back(submit(g));
        for (size_t i = 0; i < stay.size(); ++i) {
            const size_t g = stay[i];
            const int rc = ringd_wait(tr[g].c.get(), ts[i], 10000);
            INFO("rank " << g << " op " << k + 1 << ": " << ringd_last_error(tr[g].c.get()));
            REQUIRE(rc == 0);
            const Verdict v = check_rooted(tr[g].slot, pl[g], coll, DType::F32, ReduceOp::Sum, count, 3, tr[g].rank, 0, 5);
            CHECK(v.wrong == 0);
            CHECK(v.guard == 0);
        }
    }
    // Their next op was not every host's: it fails at once (not at the op timeout), naming a host whose ranks left.
    const auto t0 = Clock::now();
    std::vector<uint64_t> ts;
    for (size_t g : stay) ts.push_back(submit(g));
    for (size_t i = 0; i < stay.size(); ++i) {
        CHECK(ringd_wait(tr[stay[i]].c.get(), ts[i], 10000) == -ECONNABORTED);
        CHECK_THAT(std::string(ringd_last_error(tr[stay[i]].c.get())), Catch::Contains(named));
    }
    CHECK(seconds_since(t0) < 2.0);
}

TEST_CASE("all_to_all on one host: its local ranks, split sizes and even blocks", "[cluster][collectives]") {
    TestCluster c(1, "10s");
    auto tr = join_ranked(c, "local-a2a", {3}, {2, 0, 1}, 8 << 20);
    REQUIRE(tr.size() == 3);
    uint64_t seed = 5;
    for (uint32_t ti = 0; ti < kDTypeCount; ++ti)
        for (bool even : {false, true}) {
            const Verdict v = run_a2a(tr, static_cast<DType>(ti), 1001, seed++, even);
            CHECK(v.wrong == 0);
            CHECK(v.guard == 0);
            CHECK(v.input_changed == 0);
        }
}

TEST_CASE("broadcast, reduce on 3 hosts: ranks 1, 2, 3 per host numbered unlike the ring, every dtype x op, the root "
          "on every rank, one-shot and the chain, every value and guard byte exact; a barrier waits for every rank",
          "[cluster][collectives]") {
    const bool ibverbs = GENERATE(false, true);
    INFO((ibverbs ? "ibverbs" : "tcp"));
    TestCluster c(3, "10s", ibverbs ? kIbverbsYaml : "");
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "rooted", {1, 2, 3}, {4, 0, 5, 2, 1, 3}, 8 << 20);
    REQUIRE(tr.size() == 6);
    // One-shot below tuning.direct_max_bytes (256 KiB), the chain above: primes, the chain's over
    // several chunks.
    const uint64_t ops = sweep_rooted(tr, ibverbs ? std::vector<size_t>{37, 300007} : std::vector<size_t>{1, 5003, 300007});
    // Every root of a large bf16 average (f32 partials in the work area) and broadcast.
    uint64_t more = 0;
    for (uint32_t root = 0; root < 6; ++root) {
        INFO("root " << root);
        for (Collective coll : {Collective::Reduce, Collective::Broadcast}) {
            const Verdict v = run_rooted(tr, coll, DType::BF16, ReduceOp::Avg, 400003, root, 50 + root);
            CHECK(v.wrong == 0);
            CHECK(v.guard == 0);
            ++more;
        }
    }
    // A barrier ends on no rank before every rank submitted it, then on all of them.
    std::vector<uint64_t> tickets(tr.size());
    const ringd_coll b{sizeof(ringd_coll), RINGD_BARRIER, RINGD_F32, RINGD_SUM, 0, 0, 0, 0, nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
    for (size_t g = 0; g + 1 < tr.size(); ++g) REQUIRE(ringd_submit_coll(tr[g].c.get(), &b, &tickets[g]) == 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (size_t g = 0; g + 1 < tr.size(); ++g) CHECK(ringd_test(tr[g].c.get(), tickets[g]) == -EINPROGRESS);
    REQUIRE(ringd_submit_coll(tr.back().c.get(), &b, &tickets.back()) == 0);
    for (size_t g = 0; g < tr.size(); ++g) {
        INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
        CHECK(ringd_wait(tr[g].c.get(), tickets[g], 10000) == 0);
    }
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const auto j = c.status(h);
        CHECK(j["ops"]["failed"] == 0);
        CHECK(j["ops"]["completed"] == ops + more + 1);
        CHECK(j["ring"]["ops_ring"].get<uint64_t>() == ops / (ibverbs ? 2 : 3) + more);
    }
}

TEST_CASE("broadcast, reduce, barrier on one host: its local ranks, the root on each", "[cluster][collectives]") {
    TestCluster c(1, "10s");
    auto tr = join_ranked(c, "local-rooted", {3}, {2, 0, 1}, 8 << 20);
    REQUIRE(tr.size() == 3);
    sweep_rooted(tr, {1, 1001});
    std::vector<uint64_t> tickets(tr.size());
    const ringd_coll b{sizeof(ringd_coll), RINGD_BARRIER, RINGD_F32, RINGD_SUM, 0, 0, 0, 0, nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
    for (size_t g = 0; g < tr.size(); ++g) REQUIRE(ringd_submit_coll(tr[g].c.get(), &b, &tickets[g]) == 0);
    for (size_t g = 0; g < tr.size(); ++g) CHECK(ringd_wait(tr[g].c.get(), tickets[g], 10000) == 0);
}

TEST_CASE("reduce_scatter, allgather on 3 hosts: ranks 1, 2, 3 per host numbered unlike the ring, every dtype x op, "
          "in place and apart, every value and guard byte exact",
          "[cluster][collectives]") {
    const bool ibverbs = GENERATE(false, true);
    INFO((ibverbs ? "ibverbs" : "tcp"));
    TestCluster c(3, "10s", ibverbs ? kIbverbsYaml : "");
    REQUIRE(c.wait_up());
    // Host 0 has rank 4; host 1 ranks 0 and 5; host 2 ranks 2, 1 and 3.
    auto tr = join_ranked(c, "rs-ag", {1, 2, 3}, {4, 0, 5, 2, 1, 3}, 16 << 20);
    REQUIRE(tr.size() == 6);
    // One-shot (up to tuning.direct_max_bytes, 256 KiB, of the buffer with a block per rank): 1
    // element per block, a prime; the ring: a prime over several of its chunks per segment.
    const uint64_t ops = sweep(tr, ibverbs ? std::vector<size_t>{37, 30011} : std::vector<size_t>{1, 5003, 30011});
    const Verdict big = run_checked(tr, Collective::ReduceScatter, DType::BF16, ReduceOp::Avg, 400003, false, 99);
    CHECK(big.wrong == 0);
    CHECK(big.guard == 0);
    const Verdict big_ag = run_checked(tr, Collective::Allgather, DType::F32, ReduceOp::Sum, 200003, true, 98);
    CHECK(big_ag.wrong == 0);
    CHECK(big_ag.guard == 0);
    // And allreduce still runs in the same group, between them.
    std::vector<uint64_t> tickets;
    for (auto &x : tr) {
        for (size_t i = 0; i < 1000; ++i) bench::store(x.slot, i, DType::F32, static_cast<double>(bench::value(x.rank, i)));
        uint64_t t = 0;
        REQUIRE(ringd_submit(x.c.get(), 0, 1000, RINGD_F32, RINGD_SUM, &t) == 0);
        tickets.push_back(t);
    }
    for (size_t g = 0; g < tr.size(); ++g) {
        REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
        CHECK(bench::count_wrong(tr[g].slot, 1000, DType::F32, ReduceOp::Sum, 6) == 0);
    }
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const auto j = c.status(h);
        CHECK(j["ops"]["failed"] == 0);
        CHECK(j["ops"]["completed"] == ops + 3);
        CHECK(j["ring"]["generation"] == 1);
        // Both algorithms ran: the small ones one-shot, the others (and the allreduce) the ring.
        CHECK(j["ring"]["ops_one_shot"].get<uint64_t>() == ops / (ibverbs ? 2 : 3) * (ibverbs ? 1 : 2) + 1);
        CHECK(j["ring"]["ops_ring"].get<uint64_t>() == ops / (ibverbs ? 2 : 3) + 2);
    }
}

TEST_CASE("reduce_scatter, allgather on one host: its local ranks, numbered as the trainers say",
          "[cluster][collectives]") {
    TestCluster c(1, "10s");
    auto tr = join_ranked(c, "local", {3}, {2, 0, 1}, 8 << 20);
    REQUIRE(tr.size() == 3);
    sweep(tr, {1, 1001});
}

TEST_CASE("collectives gone wrong: no ranks said, a rank twice, sizes that differ, hosts whose ops differ; each named",
          "[cluster][collectives]") {
    TestCluster c(2, "3s");
    REQUIRE(c.wait_up());

    SECTION("no ranks: a reduce_scatter on a client that did not say its rank is refused") {
        std::string err;
        ClientPtr cl = join_opts(c, 0, "plain", 0, 1, "node0", err);
        REQUIRE(cl);
        const ringd_coll d{sizeof(ringd_coll), RINGD_REDUCE_SCATTER, RINGD_F32, RINGD_SUM, 4, 0, 64, 0, nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
        uint64_t t = 0;
        CHECK(ringd_submit_coll(cl.get(), &d, &t) == -EINVAL);
        CHECK_THAT(ringd_last_error(cl.get()), Catch::Contains("ringd_options.rank"));
    }
    SECTION("overlap: an output over the input other than as the rank's own block is refused") {
        auto tr = join_ranked(c, "overlap", {1, 1}, {1, 0}, 1 << 20);
        REQUIRE(tr.size() == 2);
        // Rank 1's block is [64, 128) of the input; an output at 32 overlaps it elsewhere.
        const ringd_coll d{sizeof(ringd_coll), RINGD_REDUCE_SCATTER, RINGD_F32, RINGD_SUM, 16, 0, 32, 0, nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
        uint64_t t = 0;
        REQUIRE(ringd_submit_coll(tr[0].c.get(), &d, &t) == 0);
        CHECK(ringd_wait(tr[0].c.get(), t, 10000) == -EINVAL);
        CHECK_THAT(ringd_last_error(tr[0].c.get()), Catch::Contains("overlaps the input") && Catch::Contains("rank 1"));
    }
    SECTION("twice: a rank said on two hosts fails the group's ops on both, naming both hosts") {
        auto tr = join_ranked(c, "twice", {1, 1}, {0, 0}, 1 << 20);
        REQUIRE(tr.size() == 2);
        std::vector<uint64_t> tickets(2);
        for (size_t g = 0; g < 2; ++g) REQUIRE(ringd_submit(tr[g].c.get(), 0, 16, RINGD_F32, RINGD_SUM, &tickets[g]) == 0);
        for (size_t g = 0; g < 2; ++g) {
            CHECK(ringd_wait(tr[g].c.get(), tickets[g], 10000) != 0);
            CHECK_THAT(ringd_last_error(tr[g].c.get()),
                       Catch::Contains("rank 0 is said by trainers on host node0 and on host node1"));
        }
    }
    SECTION("sizes: group sizes that differ between hosts are refused, naming both") {
        // (Each host's trainer says a group of its own size: 2 and 3.)
        std::vector<Trainer> tr;
        for (uint32_t h = 0; h < 2; ++h) {
            ringd_options o{};
            o.struct_size = sizeof o;
            o.socket_path = c.d[h]->socket().c_str();
            o.group = "sizes";
            o.local_rank = 0;
            o.local_size = 1;
            o.slot_bytes = 1 << 20;
            o.rank = static_cast<int>(h);
            o.ranks = 2 + static_cast<int>(h);
            char e[256] = "";
            Trainer t;
            t.c = ClientPtr(ringd_connect_opts(&o, e, sizeof e), ringd_close);
            REQUIRE(t.c);
            tr.push_back(std::move(t));
        }
        std::vector<uint64_t> tickets(2);
        for (size_t g = 0; g < 2; ++g) REQUIRE(ringd_submit(tr[g].c.get(), 0, 16, RINGD_F32, RINGD_SUM, &tickets[g]) == 0);
        for (size_t g = 0; g < 2; ++g) {
            CHECK(ringd_wait(tr[g].c.get(), tickets[g], 10000) != 0);
            CHECK_THAT(ringd_last_error(tr[g].c.get()), Catch::Contains("host node0's trainers say a group of 2 ranks, "
                                                                        "host node1's of 3"));
        }
    }
    SECTION("mismatch: a reduce_scatter on one host and an allgather on the other, naming both hosts") {
        auto tr = join_ranked(c, "differ", {1, 1}, {0, 1}, 1 << 20);
        REQUIRE(tr.size() == 2);
        std::vector<uint64_t> tickets(2);
        for (size_t g = 0; g < 2; ++g) {
            const ringd_coll d{sizeof(ringd_coll), g == 0 ? RINGD_REDUCE_SCATTER : RINGD_ALLGATHER, RINGD_F32, RINGD_SUM,
                               16, 0, 4096, 0, nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
            REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]) == 0);
        }
        for (size_t g = 0; g < 2; ++g) {
            CHECK(ringd_wait(tr[g].c.get(), tickets[g], 10000) == -EINVAL);
            CHECK_THAT(ringd_last_error(tr[g].c.get()), Catch::Contains("mismatch: host node0 submitted reduce_scatter of 16 x "
                                                                        "float sum, host node1 submitted allgather of 16 x float"));
        }
        // The group goes on: the next op (the same on both) is exact.
        const Verdict v = run_checked(tr, Collective::ReduceScatter, DType::F32, ReduceOp::Sum, 100, false, 7);
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
    }
}

TEST_CASE("a host SIGKILLed while a large allgather or broadcast moves data: the others fail within a second naming "
          "it; the restarted job runs exact collectives",
          "[cluster][collectives][faults]") {
    const Collective coll = GENERATE(Collective::Allgather, Collective::Broadcast);
    INFO(collective_name(coll));
    // Heartbeats at 1 s (three missed: 3 s) and a 30 s op timeout: only the EOF can be this fast.
    TestCluster c(3, ClusterOptions{"30s", "1s", "", "160MiB"});
    REQUIRE(c.wait_up());
    constexpr size_t kBlock = size_t{10} << 20;  // floats: an output of 120 MiB per rank
    constexpr size_t kSlot = 3 * kBlock * 4 + (64 << 10);
    auto ranked = [&] {
        Clients cl;
        for (uint32_t h = 0; h < 3; ++h)  // torch-like ranks against the ring: node0 has rank 2
            cl.push_back(std::make_unique<Client>(c.d[h]->socket(), "kill-ag", 0, 1, kSlot, "", 0, (h + 2) % 3, 3));
        return cl;
    };
    Clients cl = ranked();
    // allgather: each rank's input is its block of the output (in place), all ones; the others'
    // blocks zero, so that the gather's writes show. broadcast: from rank 0 (node1) along the
    // chain node1 -> node2 -> node0, all ones over zeros.
    for (auto &x : cl) std::memset(x->slot().data(), 0, 3 * kBlock * 4);
    for (uint32_t h = 0; h < 3; ++h)
        if (coll == Collective::Allgather)
            std::fill_n(reinterpret_cast<float *>(cl[h]->slot().data()) + ((h + 2) % 3) * kBlock, kBlock, 1.0f);
    if (coll == Collective::Broadcast) std::fill_n(reinterpret_cast<float *>(cl[1]->slot().data()), 3 * kBlock, 1.0f);
    SlotWatch w(*cl[0], 0, 3 * kBlock);
    std::vector<uint64_t> t;
    for (uint32_t h = 0; h < 3; ++h)
        t.push_back(coll == Collective::Allgather
                        ? cl[h]->submit(RINGD_ALLGATHER, kBlock, RINGD_F32, RINGD_SUM, ((h + 2) % 3) * kBlock * 4, 0)
                        : cl[h]->submit(RINGD_BROADCAST, 3 * kBlock, RINGD_F32, RINGD_SUM, 0, 0, 0));
    const double moved = wait_data_moving(w);
    INFO("fraction of rank 2's samples written when the fault comes: " << moved);
    REQUIRE(moved > 0);
    REQUIRE(moved < 0.5);
    const auto fault = Clock::now();
    ::kill(c.d[2]->pid(), SIGKILL);
    for (uint32_t h : {0u, 1u}) {
        const int rc = ringd_wait(cl[h]->get(), t[h], 15000);
        const double after = seconds_since(fault);
        const std::string why = ringd_last_error(cl[h]->get());
        INFO("node" << h << ": " << why << " after " << after << " s");
        CHECK(rc == -ECONNABORTED);
        CHECK_THAT(why, Catch::Contains("host node2: connection closed"));
        CHECK(after < 1.0);
    }
    c.d[2]->start();
    REQUIRE(c.d[2]->ready());
    REQUIRE(c.wait_up({2, 2, 1}));
    cl.clear();
    auto tr = join_ranked(c, "kill-ag", {1, 1, 1}, {2, 0, 1}, 16 << 20);
    REQUIRE(tr.size() == 3);
    for (Collective after : {Collective::ReduceScatter, Collective::Allgather}) {
        const Verdict v = run_checked(tr, after, DType::F32, ReduceOp::Sum, 300007, false, 11);
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
    }
    for (Collective after : {Collective::Broadcast, Collective::Reduce}) {
        const Verdict v = run_rooted(tr, after, DType::F32, ReduceOp::Sum, 300007, 2, 12);
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
    }
}
