// reduce_scatter, allgather, broadcast and reduce on the ring engine, over loopback and TCP links (ibverbs where
// built), each host a thread with its own transport: 1..5 hosts, one or several local ranks and
// uneven ranks per host, the group's ranks in an order unlike the ring's, every dtype x op,
// counts 0, 1 and many chunks, f16/bf16 sums in several windows, in place and out of place.
// Every value of every rank is checked against what it must be (computed here from the inputs,
// never through ringd), and the guard bytes around each rank's input and output.
#include <catch2/catch.hpp>

#include <numeric>
#include <thread>

#include "bench/bench_data.h"
#include "tests/support/matrix.h"
#include "tests/support/ring_links.h"

using namespace ringd;
using ringd::test::full_matrix;
using ringd::test::Ring;
using namespace std::chrono_literals;

namespace {

constexpr size_t kG = bench::kGuardBytes;

// Where a local rank's input and output are in its buffer: out of place, the input, a guard, the
// output; in place, the output with the input inside it (allgather: the rank's block) or the input
// with the output inside it (reduce_scatter: the rank's block).
struct Layout {
    uint64_t in_at, out_at, bytes;
};

Layout layout(Collective c, bool in_place, uint64_t count, uint64_t ranks, uint64_t rank, size_t es) {
    if (collective_is_rooted(c)) return {kG, kG, kG + count * es + kG};  // in place, one buffer
    const uint64_t full = count * ranks * es, block = count * es;
    const uint64_t in_bytes = c == Collective::Allgather ? block : full;
    const uint64_t out_bytes = c == Collective::ReduceScatter ? block : full;
    if (!in_place) return {kG, kG + in_bytes + kG, kG + in_bytes + kG + out_bytes + kG};
    if (c == Collective::ReduceScatter) return {kG, kG + rank * block, kG + full + kG};
    return {kG + rank * block, kG, kG + full + kG};
}

// The host-major list of the group's ranks (ring position -> its local ranks' ranks): ranks are
// dealt out in an order unlike the ring's when `shuffle` (rank g on host (g * 7 + 3) % n, where
// it fits).
std::vector<std::vector<uint32_t>> deal(const std::vector<uint32_t> &per_host, bool shuffle) {
    const uint32_t n = static_cast<uint32_t>(per_host.size());
    const uint32_t total = std::accumulate(per_host.begin(), per_host.end(), 0u);
    std::vector<std::vector<uint32_t>> v(n);
    for (uint32_t g = 0; g < total; ++g) {
        uint32_t h = shuffle ? (g * 7 + 3) % n : 0;
        while (v[h].size() == per_host[h]) h = (h + 1) % n;
        v[h].push_back(g);
    }
    if (shuffle)
        for (auto &h : v) std::reverse(h.begin(), h.end());  // local rank order unlike the rank order
    return v;
}

struct Case {
    Collective coll;
    DType dtype;
    ReduceOp op;
    uint64_t count;  // per rank block
    std::vector<uint32_t> per_host;
    bool shuffle = true;
    bool in_place = false;
    uint32_t root = 0;  // broadcast, reduce
};

void run_and_check(Ring &ring, const Case &c, RingOptions opt, uint32_t op_tag) {
    const uint32_t n = ring.n;
    const size_t es = dtype_size(c.dtype);
    const auto host_ranks = deal(c.per_host, c.shuffle);
    const uint64_t ranks = std::accumulate(c.per_host.begin(), c.per_host.end(), uint64_t{0});
    const bool rooted = collective_is_rooted(c.coll);
    const uint64_t full = rooted ? c.count : c.count * ranks;
    struct Rank {
        uint32_t g;
        Layout at;
        std::vector<std::byte> buf;
    };
    struct Host {
        std::vector<Rank> ranks;
        std::vector<std::byte> staging;
        RegisteredRegion data_reg, staging_reg;
        std::vector<std::byte *> locals, outs;
    };
    std::vector<Host> hosts(n);
    auto salt = [&](uint32_t g) { return (uint64_t{op_tag} << 20) | g; };
    for (uint32_t r = 0; r < n; ++r) {
        Host &h = hosts[r];
        for (uint32_t g : host_ranks[r]) {
            Rank k{g, layout(c.coll, c.in_place, c.count, ranks, g, es), {}};
            k.buf.resize(k.at.bytes);
            bench::guard_fill(k.buf.data(), 0, k.buf.size(), salt(g));
            // Rank g's input: value(g, j) at element j of the buffer with a block per rank
            // (reduce_scatter), or of its block (allgather: value(g, i)).
            const uint64_t in_count = c.coll == Collective::Allgather || rooted ? c.count : full;
            bench::fill(k.buf.data() + k.at.in_at, in_count, c.dtype, g);
            h.ranks.push_back(std::move(k));
        }
        h.staging.resize(RingEngine::staging_bytes(opt));
        h.data_reg = RegisteredRegion(ring.transports[r].get(),
                                      *ring.transports[r]->register_region(h.ranks[0].buf.data(), h.ranks[0].buf.size()));
        h.staging_reg =
            RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(h.staging.data(), h.staging.size()));
        for (size_t l = 1; l < h.ranks.size(); ++l) {
            h.locals.push_back(h.ranks[l].buf.data() + h.ranks[l].at.in_at);
            h.outs.push_back(h.ranks[l].buf.data() + h.ranks[l].at.out_at);
        }
    }
    const auto results = ringd::test::run_on_every_host(ring, opt, [&](uint32_t r) {
            RingOp o;
            o.collective = c.coll;
            o.dtype = c.dtype;
            o.op = c.op;
            o.count = c.count;
            o.avg_divisor = static_cast<uint32_t>(ranks);
            o.data = hosts[r].data_reg.handle();
            o.data_offset = hosts[r].ranks[0].at.in_at;
            o.out_offset = hosts[r].ranks[0].at.out_at;
            o.staging = hosts[r].staging_reg.handle();
            o.locals = hosts[r].locals;
            o.local_outputs = hosts[r].outs;
            o.host_ranks = host_ranks;
            o.root = c.root;
            o.op_tag = op_tag;
            return o;
        });
    for (uint32_t r = 0; r < n; ++r) {
        INFO(collective_name(c.coll) << " " << dtype_name(c.dtype) << " " << reduce_op_name(c.op) << ", " << c.count
                                     << " per rank, host " << r << " of " << n << ", " << ranks << " ranks"
                                     << (c.in_place ? ", in place" : "") << (c.shuffle ? ", shuffled ranks" : "")
                                     << (rooted ? ", root " + std::to_string(c.root) : std::string()));
        REQUIRE(results[r].ok());
        for (const Rank &k : hosts[r].ranks) {
            INFO("rank " << k.g);
            const std::byte *out = k.buf.data() + k.at.out_at;
            uint64_t wrong = 0;
            std::string first;
            if (rooted) {
                // broadcast: the root's input on every rank; reduce: the reduction on the root
                // (the others may hold partial results).
                const double tol = bench::tolerance(c.dtype, c.op);
                for (uint64_t i = 0; i < c.count && (c.coll == Collective::Broadcast || k.g == c.root); ++i) {
                    const double want = c.coll == Collective::Broadcast
                                            ? bench::round_to(c.dtype, static_cast<double>(bench::value(c.root, i)))
                                            : bench::want(ranks, i, c.dtype, c.op);
                    const double got = bench::load(out, i, c.dtype);
                    if (!(std::fabs(got - want) <= tol * std::fabs(want)) && !wrong++)
                        first = "element " + std::to_string(i) + ": " + std::to_string(got) + ", not " + std::to_string(want);
                }
            } else if (c.coll == Collective::ReduceScatter) {
                // Block g of the reduction of every rank's input.
                const double tol = bench::tolerance(c.dtype, c.op);
                for (uint64_t i = 0; i < c.count; ++i) {
                    const double want = bench::want(ranks, k.g * c.count + i, c.dtype, c.op);
                    const double got = bench::load(out, i, c.dtype);
                    if (!(std::fabs(got - want) <= tol * std::fabs(want)) && !wrong++)
                        first = "element " + std::to_string(i) + ": " + std::to_string(got) + ", not " + std::to_string(want);
                }
            } else {
                // Block b is rank b's input.
                for (uint64_t b = 0; b < ranks; ++b)
                    for (uint64_t i = 0; i < c.count; ++i) {
                        const double want = bench::round_to(c.dtype, static_cast<double>(bench::value(b, i)));
                        const double got = bench::load(out, b * c.count + i, c.dtype);
                        if (got != want && !wrong++)
                            first = "block " + std::to_string(b) + " element " + std::to_string(i) + ": " + std::to_string(got) +
                                    ", not " + std::to_string(want);
                    }
            }
            INFO(first);
            CHECK(wrong == 0);
            // Guards: everything outside the input and the output (a reduce_scatter's input may
            // hold partial results afterwards; an allgather's input is only read).
            const uint64_t in_bytes = c.coll == Collective::Allgather ? c.count * es : full * es;
            const uint64_t out_bytes = c.coll == Collective::ReduceScatter ? c.count * es : full * es;
            if (rooted && c.coll == Collective::Broadcast && k.g == c.root) CHECK(wrong == 0);  // (its input, unchanged)
            const uint64_t lo = std::min(k.at.in_at, k.at.out_at);
            const uint64_t hi = std::max(k.at.in_at + in_bytes, k.at.out_at + out_bytes);
            uint64_t damage = bench::guard_damage(k.buf.data(), 0, lo, salt(k.g)) +
                              bench::guard_damage(k.buf.data(), hi, k.buf.size(), salt(k.g));
            if (!c.in_place)  // the guard between input and output
                damage += bench::guard_damage(k.buf.data(), k.at.in_at + in_bytes, k.at.out_at, salt(k.g));
            CHECK(damage == 0);
            if (c.coll == Collective::Allgather && !c.in_place) {
                uint64_t changed = 0;
                for (uint64_t i = 0; i < c.count; ++i)
                    changed += bench::load(k.buf.data() + k.at.in_at, i, c.dtype) !=
                               bench::round_to(c.dtype, static_cast<double>(bench::value(k.g, i)));
                CHECK(changed == 0);
            }
        }
    }
}

std::vector<std::pair<DType, ReduceOp>> all_pairs() {
    std::vector<std::pair<DType, ReduceOp>> v;
    for (uint32_t t = 0; t < kDTypeCount; ++t)
        for (uint32_t o = 0; o < kReduceOpCount; ++o) {
            const auto dt = static_cast<DType>(t);
            const auto op = static_cast<ReduceOp>(o);
            if (op == ReduceOp::Avg && dtype_is_integer(dt)) continue;
            v.push_back({dt, op});
        }
    return v;
}

std::vector<uint32_t> spread(uint32_t n, std::vector<uint32_t> pattern) {
    std::vector<uint32_t> v(n);
    for (uint32_t r = 0; r < n; ++r) v[r] = pattern[r % pattern.size()];
    return v;
}

}  // namespace

TEST_CASE("reduce_scatter and allgather are exact for every transport, host count, rank layout, dtype, op and size; "
          "guards intact",
          "[ring][collectives]") {
    const auto [kind, streams] = GENERATE(std::pair<std::string, int>{"loopback", 1}, std::pair<std::string, int>{"tcp", 2}
#ifdef RINGD_HAVE_IBVERBS
                                          , std::pair<std::string, int>{"ibverbs", 1}
#endif
    );
    INFO(kind << " x " << streams);
    const RingOptions opt{4096, 3};
    const std::vector<uint32_t> host_counts = full_matrix() ? std::vector<uint32_t>{1, 2, 3, 4, 5} : std::vector<uint32_t>{1, 2, 3};
    for (uint32_t n : host_counts) {
        Ring ring(n, kind, streams);
        uint32_t tag = 1;
        for (Collective coll : {Collective::ReduceScatter, Collective::Allgather}) {
            run_and_check(ring, {coll, DType::F32, ReduceOp::Sum, 0, spread(n, {1})}, opt, tag++);
            for (const auto &per : {spread(n, {1}), spread(n, {2}), spread(n, {1, 3, 2})})
                for (const auto &[t, op] : all_pairs()) {
                    // Allgather has no op: every dtype once.
                    if (coll == Collective::Allgather && op != ReduceOp::Sum) continue;
                    for (uint64_t count : {uint64_t{1}, uint64_t{37}})
                        run_and_check(ring, {coll, t, op, count, per, true, false}, opt, tag++);
                }
            // Many chunks per block (the last one short), in and out of place, ranks in ring
            // order and shuffled, for every dtype.
            for (uint32_t d = 0; d < kDTypeCount; ++d) {
                const auto t = static_cast<DType>(d);
                auto op = static_cast<ReduceOp>((d + n) % kReduceOpCount);
                if (op == ReduceOp::Avg && dtype_is_integer(t)) op = ReduceOp::Sum;
                const uint64_t count = 3 * opt.chunk_bytes / dtype_size(t) + 5;
                for (bool in_place : {false, true})
                    run_and_check(ring, {coll, t, op, count, spread(n, {2, 1}), d % 2 == 0, in_place}, opt, tag++);
            }
        }
    }
}

TEST_CASE("broadcast and reduce chains are exact for every transport, host count, rank layout, root, dtype, op and size; "
          "guards intact",
          "[ring][collectives]") {
    const auto [kind, streams] = GENERATE(std::pair<std::string, int>{"loopback", 1}, std::pair<std::string, int>{"tcp", 2}
#ifdef RINGD_HAVE_IBVERBS
                                          , std::pair<std::string, int>{"ibverbs", 1}
#endif
    );
    INFO(kind << " x " << streams);
    const RingOptions opt{4096, 3};
    const std::vector<uint32_t> host_counts = full_matrix() ? std::vector<uint32_t>{1, 2, 3, 4, 5} : std::vector<uint32_t>{1, 2, 4};
    for (uint32_t n : host_counts) {
        Ring ring(n, kind, streams);
        uint32_t tag = 1;
        const auto per = spread(n, {1, 3, 2});
        const uint32_t ranks = std::accumulate(per.begin(), per.end(), 0u);
        for (Collective coll : {Collective::Broadcast, Collective::Reduce}) {
            run_and_check(ring, {coll, DType::F32, ReduceOp::Sum, 0, per, true, false, ranks - 1}, opt, tag++);
            // Every dtype x op (broadcast: every dtype), the root going round every rank.
            uint32_t root = 0;
            for (const auto &[t, op] : all_pairs()) {
                if (coll == Collective::Broadcast && op != ReduceOp::Sum) continue;
                for (uint64_t count : {uint64_t{1}, uint64_t{37}, 3 * opt.chunk_bytes / dtype_size(t) + 5})
                    run_and_check(ring, {coll, t, op, count, per, true, false, root++ % ranks}, opt, tag++);
            }
            // One local rank per host (the root alone on its host), ranks in ring order.
            for (uint32_t r = 0; r < n; ++r)
                run_and_check(ring, {coll, DType::BF16, coll == Collective::Reduce ? ReduceOp::Avg : ReduceOp::Sum,
                                     5 * opt.chunk_bytes / 2 + 3, spread(n, {1}), false, false, r}, opt, tag++);
        }
    }
}

TEST_CASE("f16/bf16 reduce sums larger than the work area run in windows; exact", "[ring][collectives]") {
    Ring ring(3, "tcp", 2);
    RingOptions opt{8192, 2};
    opt.work_bytes = 64 << 10;  // 16 Ki partials a window
    uint32_t tag = 1;
    for (DType t : {DType::F16, DType::BF16})
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg})
            for (uint32_t root : {0u, 4u})
                run_and_check(ring, {Collective::Reduce, t, op, 50007, {3, 1, 2}, true, false, root}, opt, tag++);
}

TEST_CASE("large broadcast and reduce over TCP send by reference and end with the delivery marker; exact",
          "[ring][collectives]") {
    Ring ring(3, "tcp", 2);
    const RingOptions opt{2 << 20, 4};
    const uint64_t count = RingEngine::kConfirmBytes / 4 + 4099;  // 32 MiB and a little
    run_and_check(ring, {Collective::Broadcast, DType::F32, ReduceOp::Sum, count, {2, 1, 1}, true, false, 2}, opt, 1);
    run_and_check(ring, {Collective::Reduce, DType::F32, ReduceOp::Sum, count, {1, 2, 1}, true, false, 3}, opt, 2);
}

TEST_CASE("f16/bf16 reduce_scatter sums larger than the work area run in windows of every block; exact", "[ring][collectives]") {
    Ring ring(3, "tcp", 2);
    RingOptions opt{8192, 2};
    opt.work_bytes = 64 << 10;  // 16 Ki partials: a few thousand elements of each of the 6 blocks per window
    uint32_t tag = 1;
    for (DType t : {DType::F16, DType::BF16})
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg})
            for (bool in_place : {false, true})
                run_and_check(ring, {Collective::ReduceScatter, t, op, 10007, {3, 1, 2}, true, in_place}, opt, tag++);
}

TEST_CASE("large reduce_scatter and allgather over TCP send by reference and end with the delivery marker; exact",
          "[ring][collectives]") {
    Ring ring(3, "tcp", 2);
    const RingOptions opt{2 << 20, 4};
    // 4 ranks x 2.1 Mi floats: 33.6 MiB buffers, over RingEngine::kConfirmBytes.
    const uint64_t count = RingEngine::kConfirmBytes / 4 / 4 + 4099;
    run_and_check(ring, {Collective::ReduceScatter, DType::F32, ReduceOp::Sum, count, {2, 1, 1}}, opt, 1);
    run_and_check(ring, {Collective::Allgather, DType::F32, ReduceOp::Sum, count, {1, 2, 1}}, opt, 2);
}

TEST_CASE("a ring op whose ranks do not match its local ranks is refused", "[ring][collectives]") {
    Ring ring(2, "loopback");
    std::vector<std::byte> buf(4096), staging(RingEngine::staging_bytes(RingOptions{4096, 2}));
    auto data = *ring.transports[0]->register_region(buf.data(), buf.size());
    auto st = *ring.transports[0]->register_region(staging.data(), staging.size());
    RingEngine e(*ring.transports[0], RingOptions{4096, 2});
    const std::vector<std::vector<uint32_t>> ranks{{0, 1}, {2}};  // two local ranks here, one buffer given
    RingOp o;
    o.collective = Collective::ReduceScatter;
    o.count = 16;
    o.data = data;
    o.staging = st;
    o.host_ranks = ranks;
    auto s = e.run(ring.pos[0], o, std::chrono::steady_clock::now() + 1s);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().message.find("local ranks") != std::string::npos);
    // Its output outside the region.
    const std::vector<std::vector<uint32_t>> one{{0}, {1}};
    o.host_ranks = one;
    o.out_offset = buf.size() - 8;
    s = e.run(ring.pos[0], o, std::chrono::steady_clock::now() + 1s);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().message.find("output outside") != std::string::npos);
    ring.transports[0]->deregister_region(data);
    ring.transports[0]->deregister_region(st);
}
