// Compressed wires on the ring engine (ring_engine.h, wire.h): allreduce, reduce_scatter and reduce
// of f32 and bf16 sums and averages over bf16, fp16 and int8 wires, 1..5 hosts (each a thread with
// its own transport), one or several local ranks per host, f32 partials in the data region and
// bf16's (or a piece of one value's) in the work area, in windows and in one; every value
// of every rank checked against the f64 sum of the inputs (computed here, never through ringd)
// within the documented bound, every rank of an allreduce with the same values, guard bytes
// intact; and error feedback: over repeated ops the results' mean converges to the exact sum.
#include <catch2/catch.hpp>

#include <cmath>
#include <numeric>

#include "bench/bench_data.h"
#include "daemon/engine/exchange_engine.h"
#include "tests/support/matrix.h"
#include "tests/support/ring_links.h"

using namespace ringd;
using ringd::test::full_matrix;
using ringd::test::Ring;

namespace {

constexpr size_t kG = bench::kGuardBytes;

// The per-encoding error of each format, relative (bf16, fp16: to the value; int8: to its block's
// largest magnitude), as wire.h documents it.
double unit_error(WireFormat f) {
    switch (f) {
    case WireFormat::BF16: return std::ldexp(1.0, -8);
    case WireFormat::FP16: return std::ldexp(1.0, -11);
    case WireFormat::Int8: return (1.0 + std::ldexp(1.0, -14)) / 254;
    case WireFormat::Exact: return 0;
    }
    return 0;
}

// Inputs: values of mixed sign and magnitude (each block of 64 its own exponent, -8..8), so that
// every format rounds and int8's block scales differ; rounded to the dtype.
double input(uint32_t rank, uint64_t i, uint32_t seed) {
    uint64_t h = (uint64_t{rank} * 0x9e3779b97f4a7c15ull) ^ (i * 0xbf58476d1ce4e5b9ull) ^ (uint64_t{seed} << 40);
    h ^= h >> 31;  // (splitmix64's finaliser)
    h *= 0x94d049bb133111ebull;
    h ^= h >> 29;
    const int e = static_cast<int>((i / 64 + rank + seed) % 17) - 8;
    return std::ldexp(static_cast<double>(static_cast<int64_t>(h)) * 0x1p-63, e);
}

struct Case {
    Collective coll;
    DType dtype;
    ReduceOp op;
    WireFormat wire;
    uint64_t count;  // allreduce, reduce: the buffer; reduce_scatter: one rank's block
    std::vector<uint32_t> per_host;
    uint32_t root = 0;  // reduce
    bool in_place = false;  // reduce_scatter: each rank's output is its own block of its input
};

struct Rank {
    uint32_t g;
    uint64_t in_at, out_at;
    std::vector<std::byte> buf;
};

struct Host {
    std::vector<Rank> ranks;
    std::vector<std::byte> staging;
    RegisteredRegion data_reg, staging_reg;
    std::vector<std::byte *> locals, outs;
    std::vector<float> residual;
};

// The group's ranks, host by host in rank order (ring position r: the next per_host[r] ranks).
std::vector<std::vector<uint32_t>> deal(const std::vector<uint32_t> &per_host) {
    std::vector<std::vector<uint32_t>> v(per_host.size());
    uint32_t g = 0;
    for (size_t h = 0; h < per_host.size(); ++h)
        for (uint32_t l = 0; l < per_host[h]; ++l) v[h].push_back(g++);
    return v;
}

// Links between every pair of hosts of the ring, by ring position (the ring's own between
// neighbours, a new TCP link between the others), as the daemon's mesh links: each host's by the
// position of the host it leads to (its own: null).
using Mesh = std::vector<std::vector<Link *>>;
Mesh full_mesh(Ring &ring) {
    const uint32_t n = ring.n;
    Mesh m(n, std::vector<Link *>(n, nullptr));
    for (uint32_t r = 0; r < n && n > 1; ++r) {
        m[r][(r + 1) % n] = ring.pos[r].next;
        m[r][(r + n - 1) % n] = ring.pos[r].prev;
    }
    for (uint32_t a = 0; a < n; ++a)
        for (uint32_t b = a + 2; b < n; ++b) {
            if (a == 0 && b == n - 1) continue;  // (neighbours round the ring)
            std::vector<UniqueFd> sa, sb;
            for (int i = 0; i < 2; ++i) {
                auto [x, y] = ringd::test::tcp_pair();
                sa.push_back(std::move(x));
                sb.push_back(std::move(y));
            }
            auto &ta = static_cast<NetworkTransport &>(*ring.transports[a]);
            auto &tb = static_cast<NetworkTransport &>(*ring.transports[b]);
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
            Result<std::vector<Link *>> la = make_error(-1, ""), lb = make_error(-1, "");
            std::vector<LinkSetup> ua(1), ub(1);
            ua[0] = {ringd::test::host(b), std::move(sa)};
            ub[0] = {ringd::test::host(a), std::move(sb)};
            std::thread other([&] { lb = tb.add_links(std::move(ub), deadline); });
            la = ta.add_links(std::move(ua), deadline);
            other.join();
            REQUIRE((la.ok() && lb.ok()));
            m[a][b] = la->front();
            m[b][a] = lb->front();
        }
    return m;
}

// Runs the op on every host (each rank's input `seed`'s), and checks every rank's result: within
// the bound of the f64 result, allreduce's identical on every rank, guards intact. With `feedback`
// each host keeps its residual in `hosts` across calls. With `mesh`, an f32 allreduce runs as the
// exchange of shards (ExchangeEngine: two encodings per value, whatever the hosts). Returns each
// result element's value at local rank 0 of host 0 (allreduce) for the caller's sums over calls.
std::vector<double> run_and_check(Ring &ring, std::vector<Host> &hosts, const Case &c, RingOptions opt, uint32_t op_tag,
                                  uint32_t seed, bool feedback, bool check_bound = true, const Mesh *mesh = nullptr,
                                  uint64_t acc_values = ExchangeEngine::kAccValues) {
    const uint32_t n = ring.n;
    const size_t es = dtype_size(c.dtype);
    const auto host_ranks = deal(c.per_host);
    const uint32_t ranks = std::accumulate(c.per_host.begin(), c.per_host.end(), 0u);
    const bool blocked = c.coll == Collective::ReduceScatter;
    const uint64_t full = blocked ? c.count * ranks : c.count;
    const uint64_t in_bytes = full * es, out_bytes = blocked ? c.count * es : 0;
    auto salt = [&](uint32_t g) { return (uint64_t{op_tag} << 20) | g; };
    if (hosts.size() != n) {
        hosts.clear();
        hosts.resize(n);
    }
    for (uint32_t r = 0; r < n; ++r) {
        Host &h = hosts[r];
        h.ranks.clear();
        h.locals.clear();
        h.outs.clear();
        for (uint32_t g : host_ranks[r]) {
            const bool apart = blocked && !c.in_place;
            Rank k{g, kG, apart ? kG + in_bytes + kG : blocked ? kG + g * c.count * es : kG, {}};
            k.buf.resize(kG + in_bytes + kG + (apart ? out_bytes + kG : 0));
            bench::guard_fill(k.buf.data(), 0, k.buf.size(), salt(g));
            for (uint64_t i = 0; i < full; ++i) bench::store(k.buf.data() + k.in_at, i, c.dtype, input(g, i, seed));
            h.ranks.push_back(std::move(k));
        }
        h.staging.resize(mesh ? 16 * ExchangeEngine::staging_needed(c.wire, full, n) : RingEngine::staging_bytes(opt));
        h.data_reg = RegisteredRegion(ring.transports[r].get(),
                                      *ring.transports[r]->register_region(h.ranks[0].buf.data(), h.ranks[0].buf.size()));
        h.staging_reg =
            RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(h.staging.data(), h.staging.size()));
        for (size_t l = 1; l < h.ranks.size(); ++l) {
            h.locals.push_back(h.ranks[l].buf.data() + h.ranks[l].in_at);
            h.outs.push_back(h.ranks[l].buf.data() + h.ranks[l].out_at);
        }
        if (feedback && h.residual.size() != full) h.residual.assign(full, 0.0f);
    }
    auto make_op = [&](uint32_t r) {
            RingOp o;
            o.collective = c.coll;
            o.dtype = c.dtype;
            o.op = c.op;
            o.wire = c.wire;
            o.count = c.count;
            o.avg_divisor = ranks;
            o.root = c.root;
            o.data = hosts[r].data_reg.handle();
            o.data_offset = hosts[r].ranks[0].in_at;
            o.out_offset = hosts[r].ranks[0].out_at;
            o.staging = hosts[r].staging_reg.handle();
            o.locals = hosts[r].locals;
            o.local_outputs = hosts[r].outs;
            o.host_ranks = host_ranks;
            o.op_tag = op_tag;
            o.residual = feedback ? hosts[r].residual.data() : nullptr;
            return o;
        };
    std::vector<Status> results;
    if (mesh) {
        results.assign(n, Ok{});
        std::vector<std::thread> threads;
        for (uint32_t r = 0; r < n; ++r)
            threads.emplace_back([&, r] {
                const RingOp o = make_op(r);
                ExchangeOp x;
                x.collective = o.collective;
                x.host_ranks = o.host_ranks;
                x.out_offset = o.out_offset;
                x.local_outputs = o.local_outputs;
                x.op = o.op;
                x.dtype = o.dtype;
                x.wire = o.wire;
                x.count = o.count;
                x.avg_divisor = o.avg_divisor;
                x.residual = o.residual;
                x.data = o.data;
                x.data_offset = o.data_offset;
                x.locals = o.locals;
                x.staging = o.staging;
                x.self = r;
                x.links = (*mesh)[r];
                x.op_tag = op_tag;
                ExchangeEngine e(*ring.transports[r], 50, acc_values);
                results[r] = e.run(x, std::chrono::steady_clock::now() + std::chrono::seconds(30));
            });
        for (auto &t : threads) t.join();
    } else {
        results = ringd::test::run_on_every_host(ring, opt, make_op);
    }

    // The exact result of element i (f64), and docs/wire.md's bound: one encoding's error per
    // host that encodes the value's partial sum (every host but the one that ends with it: n - 1)
    // and, for allreduce, the finished sum's (n in all), over the sum of the inputs' magnitudes
    // (int8: of their block maxima, over any 256 values around i), the f32 accumulation's
    // roundings, and bf16's rounding of the result.
    const double u = unit_error(c.wire);
    const uint32_t encodings = n == 1                            ? 0
                               : mesh                              ? (c.coll == Collective::Allreduce ? 2 : 1)
                               : c.coll == Collective::Allreduce ? n
                                                                   : n - 1;
    std::vector<std::vector<double>> x(ranks, std::vector<double>(full));
    std::vector<std::vector<double>> blockmax(ranks, std::vector<double>(full / 256 + 1, 0.0));
    for (uint32_t g = 0; g < ranks; ++g)
        for (uint64_t i = 0; i < full; ++i) {
            x[g][i] = bench::round_to(c.dtype, input(g, i, seed));
            blockmax[g][i / 256] = std::max(blockmax[g][i / 256], std::fabs(x[g][i]));
        }
    std::vector<double> want(full), bound(full);
    for (uint64_t i = 0; i < full; ++i) {
        double sum = 0, mag = 0, most = 0;
        const uint64_t k = i / 256;
        for (uint32_t g = 0; g < ranks; ++g) {
            sum += x[g][i];
            mag += std::fabs(x[g][i]);
            // (any 256 values around i lie in its aligned block and the two beside it)
            most += std::max({blockmax[g][k], k > 0 ? blockmax[g][k - 1] : 0.0, k + 1 < blockmax[g].size() ? blockmax[g][k + 1] : 0.0});
        }
        const double div = c.op == ReduceOp::Avg ? ranks : 1;
        want[i] = sum / div;
        double b = encodings * u * (c.wire == WireFormat::Int8 ? most : mag) + (2 + n + ranks) * std::ldexp(mag, -24);
        if (c.wire == WireFormat::FP16) b += encodings * std::ldexp(most, -39);
        if (c.dtype == DType::BF16) b += std::ldexp(mag + b, -8);
        bound[i] = b / div;
    }
    std::vector<double> at0;
    for (uint32_t r = 0; r < n; ++r) {
        INFO(collective_name(c.coll) << " " << dtype_name(c.dtype) << " " << reduce_op_name(c.op) << " over "
                                     << wire_format_name(c.wire) << ", " << c.count << ", host " << r << " of " << n << ", "
                                     << ranks << " ranks" << (feedback ? ", feedback" : ""));
        INFO((results[r].ok() ? std::string() : results[r].error().message));
        REQUIRE(results[r].ok());
        for (const Rank &k : hosts[r].ranks) {
            INFO("rank " << k.g);
            const std::byte *out = k.buf.data() + k.out_at;
            uint64_t wrong = 0, differ = 0;
            std::string first;
            auto check = [&](uint64_t i, uint64_t at) {
                const double got = bench::load(out, at, c.dtype);
                if (check_bound && !(std::fabs(got - want[i]) <= bound[i]) && !wrong++)
                    first = "element " + std::to_string(i) + ": " + std::to_string(got) + ", not " + std::to_string(want[i]) +
                            " within " + std::to_string(bound[i]);
                return got;
            };
            if (c.coll == Collective::Allreduce) {
                const std::byte *ref = hosts[0].ranks[0].buf.data() + hosts[0].ranks[0].out_at;
                for (uint64_t i = 0; i < c.count; ++i) {
                    check(i, i);
                    differ += std::memcmp(out + i * es, ref + i * es, es) != 0;
                    if (r == 0 && k.g == hosts[0].ranks[0].g) at0.push_back(bench::load(out, i, c.dtype));
                }
            } else if (c.coll == Collective::ReduceScatter) {
                for (uint64_t i = 0; i < c.count; ++i) {
                    const double got = check(k.g * c.count + i, i);
                    if (r == 0 && k.g == hosts[0].ranks[0].g) at0.push_back(got);  // (rank 0's block)
                }
            } else if (k.g == c.root) {
                for (uint64_t i = 0; i < c.count; ++i) check(i, i);
            }
            INFO(first);
            CHECK(wrong == 0);
            CHECK(differ == 0);
            const uint64_t end = blocked && !c.in_place ? k.out_at + out_bytes : k.in_at + in_bytes;
            uint64_t damage = bench::guard_damage(k.buf.data(), 0, k.in_at, salt(k.g)) +
                              bench::guard_damage(k.buf.data(), end, k.buf.size(), salt(k.g));
            if (blocked && !c.in_place) damage += bench::guard_damage(k.buf.data(), k.in_at + in_bytes, k.out_at, salt(k.g));
            CHECK(damage == 0);
        }
    }
    return at0;
}

std::vector<uint32_t> spread(uint32_t n, std::vector<uint32_t> pattern) {
    std::vector<uint32_t> v(n);
    for (uint32_t r = 0; r < n; ++r) v[r] = pattern[r % pattern.size()];
    return v;
}

}  // namespace

TEST_CASE("compressed wires: every format, dtype, op and host count within the bound; guards intact", "[ring][wire]") {
    const auto [kind, streams] = GENERATE(std::pair<std::string, int>{"tcp", 2}
#ifdef RINGD_HAVE_IBVERBS
                                          , std::pair<std::string, int>{"ibverbs", 1}
#endif
    );
    INFO(kind << " x " << streams);
    RingOptions opt{4096, 3};
    opt.work_bytes = 32 << 10;  // 8 Ki partials: the larger ops run in windows
    const std::vector<uint32_t> host_counts = full_matrix() ? std::vector<uint32_t>{1, 2, 3, 4, 5} : std::vector<uint32_t>{1, 2, 3, 5};
    for (uint32_t n : host_counts) {
        Ring ring(n, kind, streams);
        std::vector<Host> hosts;
        uint32_t tag = 1;
        for (WireFormat f : {WireFormat::BF16, WireFormat::FP16, WireFormat::Int8})
            for (Collective coll : {Collective::Allreduce, Collective::ReduceScatter, Collective::Reduce})
                for (DType t : {DType::F32, DType::BF16})
                    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
                        const auto per = spread(n, tag % 2 ? std::vector<uint32_t>{1} : std::vector<uint32_t>{2, 1, 3});
                        const uint32_t ranks = std::accumulate(per.begin(), per.end(), 0u);
                        const uint32_t root = tag % ranks;
                        const uint64_t large = 3 * opt.work_bytes / 4 / (coll == Collective::ReduceScatter ? ranks : 1) + 77;
                        // (1025 per segment or block: a chunk and one value, which joins it)
                        const uint64_t tail = 1025 * (coll == Collective::Allreduce ? n : 1);
                        for (uint64_t count : {uint64_t{1}, uint64_t{300}, tail, large}) {
                            const uint32_t op_tag = tag++;
                            run_and_check(ring, hosts, {coll, t, op, f, count, per, root}, opt, op_tag, op_tag, false);
                        }
                    }
    }
}

TEST_CASE("compressed wires with error feedback: the mean over ops converges to the exact sum", "[ring][wire]") {
    Ring ring(4, "tcp", 2);
    const RingOptions opt{4096, 3};
    uint32_t tag = 1;
    for (WireFormat f : {WireFormat::BF16, WireFormat::Int8}) {
        INFO(wire_format_name(f));
        // The same inputs op after op: with feedback, what each op's encodings lose is sent in the
        // next, so the mean of T results is within one op's bound / T (plus f32's roundings) of
        // the exact sum; without, each op makes the same error and the mean keeps it.
        const Case c{Collective::Allreduce, DType::F32, ReduceOp::Sum, f, 5000, {2, 1, 1, 2}};
        constexpr int kOps = 16;
        double err_fb = 0, err_plain = 0, want_mag = 0;
        for (bool feedback : {false, true}) {
            std::vector<Host> hosts;
            std::vector<double> mean(c.count, 0);
            for (int t = 0; t < kOps; ++t) {
                const auto got = run_and_check(ring, hosts, c, opt, tag++, 7, feedback);
                for (uint64_t i = 0; i < c.count; ++i) mean[i] += got[i] / kOps;
            }
            double err = 0;
            for (uint64_t i = 0; i < c.count; ++i) {
                double sum = 0;
                for (uint32_t g = 0; g < 6; ++g) sum += static_cast<float>(input(g, i, 7));
                err += std::fabs(mean[i] - sum);
                if (!feedback) want_mag += std::fabs(sum);
            }
            (feedback ? err_fb : err_plain) = err;
        }
        INFO("mean |error| over " << kOps << " ops: " << err_fb / c.count << " with feedback, " << err_plain / c.count
                                  << " without (mean |sum| " << want_mag / c.count << ")");
        CHECK(err_fb * 4 < err_plain);
    }
}

TEST_CASE("compressed allreduce by the exchange of shards: two encodings per value on any number of hosts", "[exchange][wire]") {
    const RingOptions opt{4096, 3};
    for (uint32_t n : {2u, 3u, 4u, 5u}) {
        Ring ring(n, "tcp", 2);
        const Mesh mesh = full_mesh(ring);
        std::vector<Host> hosts;
        uint32_t tag = 1;
        for (DType t : {DType::F32, DType::BF16})
            for (WireFormat f : {WireFormat::BF16, WireFormat::FP16, WireFormat::Int8})
                for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg})
                    for (Collective coll : {Collective::Allreduce, Collective::ReduceScatter}) {
                        const auto per = spread(n, tag % 2 ? std::vector<uint32_t>{1} : std::vector<uint32_t>{2, 1, 3});
                        // Allreduce (300: shards of one block or none; 4097 n: a value past a block;
                        // 40000 n + 77: eight pieces a shard and a short last one); reduce_scatter's
                        // blocks alike (a block of 1, of 300, of a piece (4 Ki here) and a value, of
                        // several pieces), every other op's outputs in place (each rank's own block).
                        // bf16 data is summed a window at a time: 8 Ki values of sums per host make
                        // 40000 n + 77 values five windows (reduce_scatter: five, or sixteen with
                        // 3 ranks on a host), the smaller ones one.
                        const uint64_t k = coll == Collective::Allreduce ? n : 1;
                        for (uint64_t count : {uint64_t{1}, uint64_t{300}, 4097 * k, 40000 * k + 77}) {
                            const uint32_t op_tag = tag++;
                            Case c{coll, t, op, f, count, per};
                            c.in_place = coll == Collective::ReduceScatter && op_tag % 2;
                            run_and_check(ring, hosts, c, opt, op_tag, op_tag, false, true, &mesh,
                                          t == DType::BF16 ? 8192 : ExchangeEngine::kAccValues);
                        }
                    }
    }
}

TEST_CASE("the exchange of shards: error feedback converges; a host that never runs the op is named", "[exchange][wire]") {
    Ring ring(4, "tcp", 2);
    const Mesh mesh = full_mesh(ring);
    const RingOptions opt{4096, 3};
    uint32_t tag = 1;
    for (Collective coll : {Collective::Allreduce, Collective::ReduceScatter}) {
        // (reduce_scatter: rank 0's block, whose values are the allreduce's first 50000; with
        // feedback a result carries the previous op's residuals, so only the mean is checked)
        const bool rs = coll == Collective::ReduceScatter;
        const Case c{coll, DType::F32, ReduceOp::Sum, WireFormat::Int8, 50000, {2, 1, 1, 2}};
        constexpr int kOps = 16;
        double err[2] = {0, 0};
        for (bool feedback : {false, true}) {
            std::vector<Host> hosts;
            std::vector<double> mean(c.count, 0);
            for (int t = 0; t < kOps; ++t) {
                const auto got = run_and_check(ring, hosts, c, opt, tag++, 7, feedback, !(rs && feedback), &mesh);
                REQUIRE(got.size() == c.count);
                for (uint64_t i = 0; i < c.count; ++i) mean[i] += got[i] / kOps;
            }
            for (uint64_t i = 0; i < c.count; ++i) {
                double sum = 0;
                for (uint32_t g = 0; g < 6; ++g) sum += static_cast<float>(input(g, i, 7));
                err[feedback] += std::fabs(mean[i] - sum);
            }
        }
        INFO(collective_name(coll) << ": mean |error| over " << kOps << " ops: " << err[1] / c.count << " with feedback, "
                                   << err[0] / c.count << " without");
        CHECK(err[1] * 4 < err[0]);
    }

    // Host 3 never gets to the op: the others fail by their deadline, naming what they wait for.
    const size_t stage = ExchangeEngine::staging_needed(WireFormat::BF16, 50000, 4);
    std::vector<float> buf(3 * 50000, 1.0f);
    std::vector<std::byte> staging(3 * stage);
    std::vector<RegisteredRegion> regs;
    std::vector<Status> results(3, Ok{});
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < 3; ++r) {
        ExchangeOp x;
        x.wire = WireFormat::BF16;
        x.count = 50000;
        x.avg_divisor = 4;
        regs.emplace_back(ring.transports[r].get(),
                          *ring.transports[r]->register_region(reinterpret_cast<std::byte *>(buf.data() + r * 50000), 50000 * 4));
        x.data = regs.back().handle();
        regs.emplace_back(ring.transports[r].get(),
                          *ring.transports[r]->register_region(staging.data() + r * stage, stage));
        x.staging = regs.back().handle();
        x.self = r;
        x.links = mesh[r];
        x.op_tag = 999;
        threads.emplace_back([&, r, x] {
            ExchangeEngine e(*ring.transports[r], 50);
            results[r] = e.run(x, std::chrono::steady_clock::now() + std::chrono::milliseconds(800));
        });
    }
    for (auto &t : threads) t.join();
    for (uint32_t r = 0; r < 3; ++r) {
        REQUIRE(!results[r].ok());
        CHECK(results[r].error().code == -ETIMEDOUT);
        CHECK_THAT(results[r].error().message, Catch::Contains("node3"));
    }
}
