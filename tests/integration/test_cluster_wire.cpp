// Compressed wires through real daemons (docs/wire.md): allreduce, reduce_scatter and reduce over
// bf16, fp16 and int8 wires on 3 hosts with uneven ranks per host, the group's default and an
// op's own format, every value within the wire's bound of the exact result (computed here from
// the inputs, never through ringd), every rank of an allreduce with the same values, guard bytes
// intact, the ops counted in status; what is refused, each named (an op's own format where it
// cannot apply, formats that differ between hosts and between local ranks), and what runs exact
// instead (a max under a group's compressed default); error feedback's residuals in status.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ringd/ringd.h"
#include "tests/support/cluster.h"
#include "tests/support/ranked.h"

using namespace ringd;
using namespace ringd::test;

namespace {

constexpr size_t kG = bench::kGuardBytes;

struct Checked {
    uint64_t wrong = 0, guard = 0, differ = 0;
};

// One op on every trainer: rank g's input is bench::value(g, i) at kG in its slot (reduce_scatter:
// a block per rank, the output after it), guards around; `wire` is the op's own format (0: the
// client's). Checks every rank's result within the wire's bound (`checked`: the format the op
// must have run with), allreduce's ranks identical. Returns -errno of the first failed op, else 0.
int run(std::vector<Trainer> &tr, Collective coll, DType t, ReduceOp op, size_t count, int wire, WireFormat checked,
        uint32_t hosts, Checked &res, uint32_t root = 0) {
    const uint64_t n = tr.size();
    const size_t es = dtype_size(t);
    const size_t full = coll == Collective::ReduceScatter ? count * n : count;
    const size_t out_at = coll == Collective::ReduceScatter ? kG + full * es + kG : kG;
    const size_t end = coll == Collective::ReduceScatter ? out_at + count * es : kG + full * es;
    std::vector<uint64_t> tickets(n);
    for (auto &x : tr) {
        REQUIRE(end + kG <= x.bytes);
        bench::guard_fill(x.slot, 0, end + kG, x.rank + 1);
        for (size_t i = 0; i < full; ++i) bench::store(x.slot + kG, i, t, static_cast<double>(bench::value(x.rank, i)));
    }
    for (size_t g = 0; g < n; ++g) {
        ringd_coll d{sizeof(ringd_coll), static_cast<ringd_collective>(coll), static_cast<ringd_dtype>(t),
                     static_cast<ringd_op>(op), count, kG, coll == Collective::ReduceScatter ? out_at : 0,
                     static_cast<int>(root), nullptr, nullptr, 0, static_cast<ringd_wire>(wire), 0, 0};
        if (coll == Collective::Reduce) d.out_offset = kG;
        if (const int rc = ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]); rc != 0) return rc;
    }
    int failed = 0;
    for (size_t g = 0; g < n; ++g) {
        const int rc = ringd_wait(tr[g].c.get(), tickets[g], 20000);
        if (rc != 0 && failed == 0) failed = rc;
    }
    if (failed) return failed;
    const double tol = bench::wire_tolerance(checked, hosts, n, t, op);
    for (auto &x : tr) {
        const std::byte *out = x.slot + out_at;
        if (coll == Collective::Allreduce) {
            res.wrong += bench::count_wrong(out, count, t, op, n, tol);
            res.differ += std::memcmp(out, tr[0].slot + out_at, count * es) != 0;
        } else if (coll == Collective::ReduceScatter) {
            res.wrong += bench::count_wrong_at(out, count, t, op, n, x.rank * count, tol);
        } else if (x.rank == root) {
            res.wrong += bench::count_wrong(out, count, t, op, n, tol);
        }
        const size_t lo = coll == Collective::ReduceScatter ? kG + full * es : end;
        res.guard += bench::guard_damage(x.slot, 0, kG, x.rank + 1) + bench::guard_damage(x.slot, end, end + kG, x.rank + 1);
        if (coll == Collective::ReduceScatter) res.guard += bench::guard_damage(x.slot, lo, out_at, x.rank + 1);
    }
    return 0;
}

void set_wire(std::vector<Trainer> &tr, ringd_wire w) {
    for (auto &x : tr) REQUIRE(ringd_set_wire(x.c.get(), w) == 0);
}

}  // namespace

TEST_CASE("compressed wires through the daemons: every format and collective within its bound, ranks identical",
          "[cluster][wire]") {
    TestCluster c(3, "10s");
    REQUIRE(c.wait_up());
    // Host 0 has rank 3; host 1 ranks 0 and 4; host 2 rank 1 and 2.
    auto tr = join_ranked(c, "wire", {1, 2, 2}, {3, 0, 4, 1, 2}, 8 << 20);
    REQUIRE(tr.size() == 5);
    uint64_t ops = 0;
    for (ringd_wire w : {RINGD_WIRE_BF16, RINGD_WIRE_FP16, RINGD_WIRE_INT8}) {
        const auto f = static_cast<WireFormat>(w - 1);
        INFO(wire_format_name(f));
        set_wire(tr, w);
        // Large enough for the ring (past tuning.direct_max_bytes); primes, so that chunks and
        // blocks of 256 fall unevenly.
        Checked r;
        REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Avg, 300007, 0, f, 3, r) == 0);
        REQUIRE(run(tr, Collective::Allreduce, DType::BF16, ReduceOp::Sum, 200003, 0, f, 3, r) == 0);
        REQUIRE(run(tr, Collective::ReduceScatter, DType::F32, ReduceOp::Sum, 70001, 0, f, 3, r) == 0);
        REQUIRE(run(tr, Collective::ReduceScatter, DType::BF16, ReduceOp::Avg, 70001, 0, f, 3, r) == 0);
        REQUIRE(run(tr, Collective::Reduce, DType::F32, ReduceOp::Sum, 300007, 0, f, 3, r, 4) == 0);
        ops += 5;
        CHECK(r.wrong == 0);
        CHECK(r.guard == 0);
        CHECK(r.differ == 0);
    }
    // An op's own format over the client's exact.
    set_wire(tr, RINGD_WIRE_EXACT);
    Checked r;
    REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Sum, 300007, RINGD_WIRE_INT8, WireFormat::Int8, 3, r) == 0);
    REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Sum, 300007, 0, WireFormat::Exact, 3, r) == 0);
    CHECK(r.wrong == 0);
    CHECK(r.guard == 0);
    CHECK(r.differ == 0);
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const auto j = c.status(h);
        CHECK(j["ops"]["failed"] == 0);
        const auto &by = j["ring"]["wire"]["ops_ring"];
        CHECK(by["bf16"] == 5);
        CHECK(by["fp16"] == 5);
        CHECK(by["int8"] == 6);
        CHECK(by["exact"] == 1);
        // The allreduces and reduce_scatters over compressed wires, f32 (4 and 3) and bf16 (3 and
        // 3: a generation of 14), ran as the exchange of shards (reduce on the ring).
        CHECK(j["ring"]["wire"]["schedule"] == "exchange");
        CHECK(j["ring"]["wire"]["exchange_ops"] == 13);
        CHECK(j["ring"]["wire"]["exchange_bytes_out"].get<uint64_t>() > 0);
    }
    (void)ops;
}

TEST_CASE("the exchange of shards over the mesh links: 4 hosts, ranks numbered unlike the ring, within the bound",
          "[cluster][wire]") {
    TestCluster c(4, "10s");
    REQUIRE(c.wait_up());
    // Host 0 has ranks 5 and 0; host 1 rank 3; host 2 rank 1; host 3 ranks 4 and 2. Hosts 0 and 2,
    // 1 and 3 are joined by mesh links.
    auto tr = join_ranked(c, "wire-mesh", {2, 1, 1, 2}, {5, 0, 3, 1, 4, 2}, 8 << 20);
    REQUIRE(tr.size() == 6);
    Checked r;
    REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Avg, 300007, RINGD_WIRE_INT8, WireFormat::Int8, 4, r) == 0);
    REQUIRE(run(tr, Collective::ReduceScatter, DType::F32, ReduceOp::Sum, 70001, RINGD_WIRE_BF16, WireFormat::BF16, 4, r) == 0);
    REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Sum, 300007, RINGD_WIRE_FP16, WireFormat::FP16, 4, r) == 0);
    CHECK(r.wrong == 0);
    CHECK(r.guard == 0);
    CHECK(r.differ == 0);
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const auto j = c.status(h);
        CHECK(j["ops"]["failed"] == 0);
        CHECK(j["ring"]["all_to_all"]["mesh_links"] == 1);
        CHECK(j["ring"]["wire"]["schedule"] == "exchange");
        CHECK(j["ring"]["wire"]["exchange_ops"] == 3);
    }
}

TEST_CASE("wire.schedule: ring on one host keeps every host's compressed f32 allreduces on the ring", "[cluster][wire]") {
    // The generation agrees it (RingReady's and RingStart's flags): no host runs the exchange
    // while another runs the ring. Said by a host (its RingReady) or by the coordinator (node0).
    const uint32_t who = GENERATE(1u, 0u);
    INFO("node" << who << " says ring");
    ClusterOptions o;
    o.op_timeout = "10s";
    o.own_yaml = {"", "", ""};
    o.own_yaml[who] = "wire: {schedule: ring}\n";
    TestCluster c(3, o);
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "wire-ring", {1, 2, 1}, {0, 1, 2, 3}, 4 << 20);
    REQUIRE(tr.size() == 4);
    set_wire(tr, RINGD_WIRE_INT8);
    Checked r;
    REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Sum, 300007, 0, WireFormat::Int8, 3, r) == 0);
    CHECK(r.wrong == 0);
    CHECK(r.guard == 0);
    CHECK(r.differ == 0);
    for (uint32_t h = 0; h < c.n; ++h) {
        const auto j = c.status(h);
        CHECK(j["ring"]["wire"]["schedule"] == "ring");
        CHECK(j["ring"]["wire"]["exchange_ops"] == 0);
        CHECK(j["ring"]["wire"]["ops_ring"]["int8"] == 1);
    }
}

TEST_CASE("compressed wires refused where they cannot apply or differ, each named; a group's default leaves the "
          "rest exact; error feedback's residuals in status",
          "[cluster][wire]") {
    TestCluster c(2, "3s");
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "refuse", {1, 2}, {0, 1, 2}, 4 << 20);
    REQUIRE(tr.size() == 3);
    Checked r;
    // An op's own compressed wire for a max, or an f64 sum: refused at once, naming the op.
    CHECK(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Max, 100000, RINGD_WIRE_INT8, WireFormat::Exact, 2, r) == -EINVAL);
    CHECK_THAT(ringd_last_error(tr[0].c.get()), Catch::Contains("int8 wire carries sums and averages") &&
                                                    Catch::Contains("100000 x float max"));
    CHECK(run(tr, Collective::Allreduce, DType::F64, ReduceOp::Sum, 100000, RINGD_WIRE_BF16, WireFormat::Exact, 2, r) == -EINVAL);
    // The group's default: a max and an f64 sum run exact (every value exact), a float sum compressed.
    set_wire(tr, RINGD_WIRE_INT8);
    REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Max, 100000, 0, WireFormat::Exact, 2, r) == 0);
    REQUIRE(run(tr, Collective::Allreduce, DType::F64, ReduceOp::Sum, 100000, 0, WireFormat::Exact, 2, r) == 0);
    REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Sum, 100000, 0, WireFormat::Int8, 2, r) == 0);
    CHECK(r.wrong == 0);
    CHECK(r.guard == 0);
    // Hosts whose formats differ: the op fails on every rank naming both hosts' ops; the next runs.
    REQUIRE(ringd_set_wire(tr[0].c.get(), RINGD_WIRE_BF16) == 0);
    CHECK(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Sum, 100000, 0, WireFormat::Exact, 2, r) == -EINVAL);
    for (auto &x : tr)
        CHECK_THAT(ringd_last_error(x.c.get()), Catch::Contains("host node0 submitted 100000 x float sum over a bf16 wire") &&
                                                    Catch::Contains("host node1 submitted 100000 x float sum over a int8 wire"));
    // Local ranks whose formats differ: refused on their host, naming both local ranks.
    REQUIRE(ringd_set_wire(tr[0].c.get(), RINGD_WIRE_INT8) == 0);
    REQUIRE(ringd_set_wire(tr[2].c.get(), RINGD_WIRE_FP16) == 0);
    CHECK(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Sum, 100000, 0, WireFormat::Exact, 2, r) == -EINVAL);
    CHECK_THAT(ringd_last_error(tr[1].c.get()), Catch::Contains("mismatch: local rank 0 submitted 100000 x float sum over a int8 "
                                                                "wire, local rank 1 submitted 100000 x float sum over a fp16 wire"));
    set_wire(tr, RINGD_WIRE_INT8);
    REQUIRE(run(tr, Collective::Allreduce, DType::F32, ReduceOp::Sum, 100000, 0, WireFormat::Int8, 2, r) == 0);
    CHECK(r.wrong == 0);
    // Error feedback: a residual per tag, kept in the group's run (one f32 per value).
    std::vector<uint64_t> tickets(tr.size());
    for (uint64_t tag : {7u, 8u, 7u}) {
        for (size_t g = 0; g < tr.size(); ++g) {
            ringd_coll d{sizeof(ringd_coll), RINGD_ALLREDUCE, RINGD_F32, RINGD_AVG, 100000, kG, 0, 0,
                         nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 1, tag};
            REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]) == 0);
        }
        for (size_t g = 0; g < tr.size(); ++g) REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
    }
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const auto w = c.status(h)["ring"]["wire"];
        CHECK(w["feedback_tags"] == 2);
        CHECK(w["feedback_bytes"] == 2 * 100000 * 4);
        CHECK(w["feedback_refused"] == 0);
    }
}

TEST_CASE("error-feedback residuals are bounded per group run: the least recently used tag goes, an op past the "
          "bound runs without; both counted",
          "[cluster][wire]") {
    // 1 MiB of residuals per run: two tags of 100,000 floats fit, a third evicts the oldest.
    TestCluster c(2, "5s", "wire: {default: int8, feedback_max_bytes: 1MiB}\n");
    REQUIRE(c.wait_up());
    auto tr = join_ranked(c, "bound", {1, 1}, {0, 1}, 4 << 20);
    REQUIRE(tr.size() == 2);
    auto op = [&](size_t count, uint64_t tag) {
        std::vector<uint64_t> tickets(tr.size());
        for (size_t g = 0; g < tr.size(); ++g) {
            for (size_t i = 0; i < count; ++i)
                bench::store(tr[g].slot + kG, i, DType::F32, static_cast<double>(bench::value(tr[g].rank, i)));
            ringd_coll d{sizeof(ringd_coll), RINGD_ALLREDUCE, RINGD_F32, RINGD_SUM, count, kG, 0, 0,
                         nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 1, tag};
            REQUIRE(ringd_submit_coll(tr[g].c.get(), &d, &tickets[g]) == 0);
        }
        for (size_t g = 0; g < tr.size(); ++g) REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
        // (ringd's default wire, int8, within its bound)
        for (auto &x : tr)
            CHECK(bench::count_wrong(x.slot + kG, count, DType::F32, ReduceOp::Sum, 2,
                                     bench::wire_tolerance(WireFormat::Int8, 2, 2, DType::F32, ReduceOp::Sum)) == 0);
    };
    op(100000, 1);
    op(100000, 2);
    op(100000, 1);  // (tag 1 used last: tag 2 is the least recently used)
    op(100000, 3);
    op(300000, 4);  // 1.2 MB: more than the bound, runs without feedback
    for (uint32_t h = 0; h < c.n; ++h) {
        INFO("host " << h);
        const auto w = c.status(h)["ring"]["wire"];
        CHECK(w["ops_ring"]["int8"] == 5);
        CHECK(w["feedback_tags"] == 2);
        CHECK(w["feedback_bytes"] == 2 * 100000 * 4);
        CHECK(w["feedback_evicted"] == 1);
        CHECK(w["feedback_refused"] == 1);
        CHECK(w["feedback_limit_bytes"] == 1 << 20);
    }
}
