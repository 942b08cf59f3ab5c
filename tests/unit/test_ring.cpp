// RingEngine over every transport that runs here (in-process loopback; TCP over real
// 127.0.0.1 sockets, 1 and 3 streams per link; ibverbs on the software RDMA device, 1 and 2 QPs
// per link), each host a thread with its own transport: on each, 1..5 hosts with 1 and 3 local
// ranks, every dtype x op, counts 0, 1, fewer than hosts, not divisible by the host count, several
// and many chunks per segment. Every value of every rank is checked, and the guard bytes around
// every rank's range (data region, local ranks' buffers, staging area). Faults: a peer that
// disappears mid-op, a peer that never comes.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <fstream>
#include <thread>

#include "bench/bench_data.h"
#include "common/fd_io.h"
#include "proto/le.h"
#include "daemon/config.h"
#include "daemon/engine/ring_engine.h"
#include "daemon/transport/loopback/loopback_transport.h"
#include "daemon/transport/tcp/tcp_transport.h"
#ifdef RINGD_HAVE_IBVERBS
#include "daemon/transport/ibverbs/emulated_device.h"
#include "daemon/transport/ibverbs/ibverbs_transport.h"
#endif
#include "tests/support/net.h"
#include "tests/support/ring_links.h"
#include "tests/support/matrix.h"
#include "tests/support/skip.h"
#include "tests/support/unprivileged.h"

using namespace ringd;
using ringd::test::full_matrix;
using ringd::test::tcp_pair;
using ringd::test::Ring;
using namespace std::chrono_literals;

namespace {

// ThreadSanitizer runs every access of the data slowly (the TSan suites take minutes on a few
// large buffers): there, the cases about sizes and values (chunk choice, numerics, staging) run
// their smaller sizes only; their threads do the same at every size, and the plain and ASan +
// UBSan suites run them whole.
#if defined(__SANITIZE_THREAD__)
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif

struct HostBuffers {
    std::vector<std::byte> data, staging;
    RegisteredRegion data_reg, staging_reg;
    bench::GuardedRange range;                   // the op's range in `data`
    std::vector<std::vector<std::byte>> locals;  // local ranks 1.. of the host, guarded the same way
    std::vector<bench::GuardedRange> local_ranges;
    std::vector<std::byte *> local_ptrs;
};

constexpr size_t kG = bench::kGuardBytes;

// Runs one allreduce on every host (a thread each), with `local` ranks per host or per_host[r] on
// host r (rank 0's buffer is the data region, the others go in as RingOp::locals), and checks every value of every rank
// and the guard bytes on both sides of every rank's range: the data region's (each host's op at
// its own offset), every local rank's buffer's and the staging area's.
// progress: host 0's op stores the time of its messages' progress there (RingOp::progress_ns).
void allreduce_and_check(Ring &ring, DType t, ReduceOp op, uint64_t count, RingOptions opt, uint32_t op_tag,
                         uint32_t local = 1, std::vector<uint32_t> per_host = {}, std::atomic<int64_t> *progress = nullptr) {
    const size_t es = dtype_size(t);
    std::vector<HostBuffers> bufs(ring.n);
    std::vector<Status> results(ring.n, Ok{});
    // Host r's local ranks, and its first rank's number among all ranks.
    per_host.resize(ring.n, local);
    std::vector<uint64_t> first(ring.n, 0);
    for (uint32_t r = 1; r < ring.n; ++r) first[r] = first[r - 1] + per_host[r - 1];
    const uint64_t total = first[ring.n - 1] + per_host[ring.n - 1];
    for (uint32_t r = 0; r < ring.n; ++r) {
        auto &b = bufs[r];
        const uint64_t salt = (uint64_t{op_tag} << 24) | (uint64_t{r} << 8);
        const size_t offset = kG + 8 * (r % 3);  // each host's op at its own offset
        b.range = bench::GuardedRange{offset, count, offset + count * es + kG, t, salt};
        b.data.resize(b.range.buf_bytes);
        b.range.prepare(b.data.data(), first[r]);
        // The staging area (the chunk slots and the f32 work area) with guards around it (outside
        // its registration).
        const uint64_t staging_bytes = RingEngine::staging_bytes(opt);
        b.staging.resize(kG + staging_bytes + kG);
        bench::guard_fill(b.staging.data(), 0, kG, salt | 0xff);
        bench::guard_fill(b.staging.data(), b.staging.size() - kG, b.staging.size(), salt | 0xff);
        b.data_reg = RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(b.data.data(), b.data.size()));
        b.staging_reg = RegisteredRegion(ring.transports[r].get(),
                                         *ring.transports[r]->register_region(b.staging.data() + kG, staging_bytes));
        b.locals.resize(per_host[r] - 1);
        for (uint32_t l = 1; l < per_host[r]; ++l) {
            const bench::GuardedRange lr{kG, count, kG + count * es + kG, t, salt | l};
            b.locals[l - 1].resize(lr.buf_bytes);
            lr.prepare(b.locals[l - 1].data(), first[r] + l);
            b.local_ranges.push_back(lr);
            b.local_ptrs.push_back(b.locals[l - 1].data() + kG);
        }
    }
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < ring.n; ++r) {
        threads.emplace_back([&, r] {
            RingEngine ar(*ring.transports[r], opt);
            RingOp o;
            o.dtype = t;
            o.op = op;
            o.count = count;
            o.avg_divisor = static_cast<uint32_t>(total);
            o.data = bufs[r].data_reg.handle();
            o.data_offset = bufs[r].range.offset;
            o.staging = bufs[r].staging_reg.handle();
            o.op_tag = op_tag;
            o.locals = bufs[r].local_ptrs;
            if (r == 0) o.progress_ns = progress;
            results[r] = ar.run(ring.pos[r], o, std::chrono::steady_clock::now() + 20s);
        });
    }
    for (auto &th : threads) th.join();
    for (uint32_t r = 0; r < ring.n; ++r) {
        const auto &b = bufs[r];
        INFO("host " << r << " of " << ring.n << ", " << per_host[r] << " local rank(s) of " << total << ", " << dtype_name(t) << " "
                     << reduce_op_name(op) << " count " << count << ", chunk " << opt.chunk_bytes);
        INFO((results[r].ok() ? std::string() : results[r].error().message));
        REQUIRE(results[r].ok());
        const auto v = b.range.check(b.data.data(), op, total);
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
        CHECK(bench::guard_damage(b.staging.data(), 0, kG, b.range.salt | 0xff) == 0);
        CHECK(bench::guard_damage(b.staging.data(), b.staging.size() - kG, b.staging.size(), b.range.salt | 0xff) == 0);
        for (uint32_t l = 1; l < per_host[r]; ++l) {
            INFO("local rank " << l);
            const auto lv = b.local_ranges[l - 1].check(b.locals[l - 1].data(), op, total);
            CHECK(lv.wrong == 0);
            CHECK(lv.guard == 0);
        }
    }
}

// Every dtype x op pair (avg only for the float types), in a fixed order.
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

// Inputs of one op and what its result must be: value(rank, i) of every rank (of `total`), and
// want(i) = {the value, the largest deviation allowed}; a NaN value: element i is not checked.
struct Values {
    std::function<double(uint64_t total, uint64_t rank, uint64_t i)> value;
    std::function<std::pair<double, double>(uint64_t total, uint64_t i)> want;
};

// One op of `values` on every host of `ring`, `local` ranks per host; every element of every rank
// checked, and the guard bytes around every range. Returns the largest deviation seen, in units
// of `ulp`.
double values_allreduce_and_check(Ring &ring, DType t, ReduceOp op, uint64_t count, uint32_t local, RingOptions opt,
                                  uint32_t op_tag, const Values &values, double ulp = 1) {
    const size_t es = dtype_size(t);
    const uint64_t total = uint64_t{ring.n} * local;
    struct Bufs {
        std::vector<std::byte> data, staging;
        RegisteredRegion data_reg, staging_reg;
        std::vector<std::vector<std::byte>> locals;
        std::vector<std::byte *> local_ptrs;
    };
    std::vector<Bufs> bufs(ring.n);
    std::vector<Status> results(ring.n, Ok{});
    auto fill = [&](std::byte *buf, uint64_t g, uint64_t salt) {
        bench::guard_fill(buf, 0, kG, salt);
        for (uint64_t i = 0; i < count; ++i) bench::store(buf + kG, i, t, values.value(total, g, i));
        bench::guard_fill(buf, kG + count * es, 2 * kG + count * es, salt);
    };
    for (uint32_t r = 0; r < ring.n; ++r) {
        auto &b = bufs[r];
        b.data.resize(2 * kG + count * es);
        fill(b.data.data(), uint64_t{r} * local, op_tag * 64 + r);
        b.staging.resize(RingEngine(*ring.transports[r], opt).staging_bytes());
        b.data_reg = RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(b.data.data(), b.data.size()));
        b.staging_reg =
            RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(b.staging.data(), b.staging.size()));
        b.locals.resize(local - 1);
        for (uint32_t l = 1; l < local; ++l) {
            b.locals[l - 1].resize(2 * kG + count * es);
            fill(b.locals[l - 1].data(), uint64_t{r} * local + l, op_tag * 64 + r * 8 + l);
            b.local_ptrs.push_back(b.locals[l - 1].data() + kG);
        }
    }
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < ring.n; ++r) {
        threads.emplace_back([&, r] {
            RingEngine ar(*ring.transports[r], opt);
            RingOp o;
            o.dtype = t;
            o.op = op;
            o.count = count;
            o.avg_divisor = static_cast<uint32_t>(total);
            o.data = bufs[r].data_reg.handle();
            o.data_offset = kG;
            o.staging = bufs[r].staging_reg.handle();
            o.op_tag = op_tag;
            o.locals = bufs[r].local_ptrs;
            results[r] = ar.run(ring.pos[r], o, std::chrono::steady_clock::now() + 60s);
        });
    }
    for (auto &th : threads) th.join();
    double worst_ulps = 0;
    for (uint32_t r = 0; r < ring.n; ++r) {
        INFO("host " << r << " of " << ring.n << ", " << local << " local rank(s), " << dtype_name(t) << " "
                     << reduce_op_name(op) << " of " << count);
        REQUIRE(results[r].ok());
        for (uint32_t l = 0; l < local; ++l) {
            INFO("local rank " << l);
            const std::byte *buf = l == 0 ? bufs[r].data.data() : bufs[r].locals[l - 1].data();
            const uint64_t salt = l == 0 ? op_tag * 64 + r : op_tag * 64 + r * 8 + l;
            uint64_t wrong = 0, nonfinite = 0;
            std::string first;
            for (uint64_t i = 0; i < count; ++i) {
                const auto [want, tol] = values.want(total, i);
                if (std::isnan(want)) continue;
                const double got = bench::load(buf + kG, i, t);
                if (!std::isfinite(got)) ++nonfinite;
                const double dev = std::fabs(got - want);
                if (!(dev <= tol)) {
                    if (!wrong++) first = "element " + std::to_string(i) + ": " + std::to_string(got) + ", not " + std::to_string(want);
                }
                if (std::isfinite(dev)) worst_ulps = std::max(worst_ulps, dev / ulp);
            }
            INFO(first);
            CHECK(nonfinite == 0);
            CHECK(wrong == 0);
            CHECK(bench::guard_damage(buf, 0, kG, salt) == 0);
            CHECK(bench::guard_damage(buf, kG + count * es, 2 * kG + count * es, salt) == 0);
        }
    }
    return worst_ulps;
}

// avg of bench::near_max_value()s: every element the mean, within the documented bound.
double near_max_avg_and_check(Ring &ring, DType t, uint64_t count, uint32_t local, RingOptions opt, uint32_t op_tag) {
    const Values v{[t](uint64_t total, uint64_t g, uint64_t i) { return bench::near_max_value(t, total, g, i); },
                   [t](uint64_t total, uint64_t i) {
                       const double mean = bench::near_max_mean(t, total, i);
                       return std::pair{mean, bench::near_max_bound(t, total, mean)};
                   }};
    return values_allreduce_and_check(ring, t, ReduceOp::Avg, count, local, opt, op_tag, v, bench::near_max_ulp(t));
}

// v rounded once, to nearest even, to `bits` significant bits (11: f16, 8: bf16); v normal.
double round_bits(double v, int bits) {
    if (v == 0) return 0;
    int e;
    const double m = std::frexp(v, &e);  // v = m * 2^e, 0.5 <= |m| < 1
    return std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits);
}

// f16/bf16 sum or avg whose exact result is known and fits f32, but whose partial sums mostly do
// not fit the dtype: rank g's element i uses every significant bit of the dtype, signs mixed,
// magnitudes 1/4..64. The result must be the exact one rounded once; results within f32 error of
// a tie of the dtype are not checked (the f32 reciprocal of avg could decide them).
Values rounded_once_values(DType t, ReduceOp op) {
    const int bits = t == DType::F16 ? 11 : 8;
    auto value = [bits](uint64_t g, uint64_t i) {
        const uint64_t h = bench::mix64(i * 0x9e3779b97f4a7c15ull + g * 0x632be59bd9b4e019ull + 5);
        const double mant = 1 + std::ldexp(static_cast<double>(h % (1u << (bits - 1))), 1 - bits);  // [1, 2)
        return std::ldexp(mant, static_cast<int>((h >> 20) % 9) - 2) * ((h >> 40) & 1 ? -1 : 1);
    };
    return {[value](uint64_t, uint64_t g, uint64_t i) { return value(g, i); },
            [value, bits, op](uint64_t total, uint64_t i) {
                double exact = 0;
                for (uint64_t g = 0; g < total; ++g) exact += value(g, i);  // exact in double
                const double mean = op == ReduceOp::Avg ? exact / static_cast<double>(total) : exact;
                const double nan = std::nan("");
                if (std::fabs(mean) < 0x1p-12) return std::pair{nan, 0.0};  // f16 normals only
                const double once = round_bits(mean, bits);
                const double half_ulp = std::ldexp(1.0, std::ilogb(mean) - bits);
                if (std::fabs(std::fabs(mean - once) - half_ulp) < std::fabs(mean) * 0x1p-18) return std::pair{nan, 0.0};
                return std::pair{once, 0.0};
            }};
}

}  // namespace

TEST_CASE("ring allreduce is exact for every transport, host count, local ranks, dtype, op and size; guards intact",
          "[ring]") {
    const auto [kind, streams] = GENERATE(std::pair<std::string, int>{"loopback", 1}, std::pair<std::string, int>{"tcp", 1},
                                          std::pair<std::string, int>{"tcp", 3}
#ifdef RINGD_HAVE_IBVERBS
                                          , std::pair<std::string, int>{"ibverbs", 1}, std::pair<std::string, int>{"ibverbs", 2}
#endif
    );
    INFO(kind << " x " << streams);
    // Small chunks and a shallow staging area: many chunks per segment, slots reused.
    const RingOptions opt{4096, 3};
    const auto pairs = all_pairs();
    REQUIRE(pairs.size() == 22);
    // Reduced: 1 host (no ring), 2 (next and previous the same host) and 3 (the general ring, counts
    // 3 does not divide); the full matrix adds 4 and 5 hosts.
    const std::vector<uint32_t> host_counts = full_matrix() ? std::vector<uint32_t>{1, 2, 3, 4, 5} : std::vector<uint32_t>{1, 2, 3};
    for (uint32_t n : host_counts) {
        Ring ring(n, kind, streams);
        uint32_t op_tag = 1;
        allreduce_and_check(ring, DType::F32, ReduceOp::Sum, 0, opt, op_tag++);
        for (uint32_t local : {1u, 3u}) {
            for (size_t p = 0; p < pairs.size(); ++p) {
                const auto [t, op] = pairs[p];
                // Fewer elements than hosts (empty segments), counts that n does not divide.
                std::vector<uint64_t> counts{1, n + 1, 5 * n + 2};
                if (n > 2) counts.push_back(n - 1);
                for (uint64_t count : counts) allreduce_and_check(ring, t, op, count, opt, op_tag++, local);
            }
            // Several chunks per segment (the last one short), for every dtype; the op goes round.
            for (uint32_t d = 0; d < kDTypeCount; ++d) {
                const auto t = static_cast<DType>(d);
                auto op = static_cast<ReduceOp>((d + n + local) % kReduceOpCount);
                if (op == ReduceOp::Avg && dtype_is_integer(t)) op = ReduceOp::Sum;
                const uint64_t chunk_elems = opt.chunk_bytes / dtype_size(t);
                allreduce_and_check(ring, t, op, 3 * n * chunk_elems + 2 * n + 1, opt, op_tag++, local);
            }
        }
        // Many chunks: every staging slot reused many times.
        allreduce_and_check(ring, DType::F32, ReduceOp::Avg, 65537, opt, op_tag++, 2);
    }
}

#ifndef RINGD_HAVE_IBVERBS
TEST_CASE("ring allreduce over ibverbs", "[ring]") {
    RINGD_SKIP("built without ibverbs (libibverbs-dev, librdmacm-dev): the ring ran over loopback and TCP only");
}
#endif

TEST_CASE("every dtype x op across 3 hosts, in every polling mode", "[ring]") {
    Ring ring(3, "tcp", 2);
    uint32_t op_tag = 1;
    for (int spin_us : {-1, 0, 50})
        allreduce_and_check(ring, DType::F32, ReduceOp::Sum, 100000, RingOptions{8192, 4, spin_us}, op_tag++);
    for (const auto &[t, op] : all_pairs()) allreduce_and_check(ring, t, op, 12345, RingOptions{8192, 4}, op_tag++);
}

TEST_CASE("a peer that disappears mid-op fails its neighbours with an error naming it", "[ring]") {
    const std::string kind = GENERATE(std::string("loopback"), std::string("tcp")
#ifdef RINGD_HAVE_IBVERBS
                                          , std::string("ibverbs")
#endif
    );
    INFO("transport " << kind);
    Ring ring(3, kind);
    const uint64_t count = 1 << 20;
    std::vector<HostBuffers> bufs(3);
    std::vector<Status> results(3, Ok{});
    for (uint32_t r = 0; r < 3; ++r) {
        bufs[r].data.resize(count * 4);
        bufs[r].staging.resize(4096 * 2);
        bufs[r].data_reg = RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(bufs[r].data.data(), bufs[r].data.size()));
        bufs[r].staging_reg = RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(bufs[r].staging.data(), bufs[r].staging.size()));
    }
    std::vector<std::thread> threads;
    const auto start = std::chrono::steady_clock::now();
    for (uint32_t r = 0; r < 2; ++r) {
        threads.emplace_back([&, r] {
            RingEngine ar(*ring.transports[r], RingOptions{4096, 2});
            RingOp o;
            o.count = count;
            o.data = bufs[r].data_reg.handle();
            o.staging = bufs[r].staging_reg.handle();
            o.op_tag = 1;
            results[r] = ar.run(ring.pos[r], o, start + 20s);
        });
    }
    // Host 2 never takes part and then goes away: its links break.
    if (kind == "loopback") {
        for (Link *l : ring.links_of[2]) static_cast<LoopbackLink *>(l)->cut("node2 died");
    } else {
        auto &t2 = static_cast<NetworkTransport &>(*ring.transports[2]);
        for (Link *l : ring.links_of[2]) t2.remove_link(l);  // closes its connections (ibverbs: and QPs)
    }
    for (auto &th : threads) th.join();
    CHECK(std::chrono::steady_clock::now() - start < 10s);
    for (uint32_t r = 0; r < 2; ++r) {
        REQUIRE_FALSE(results[r].ok());
        CHECK_THAT(results[r].error().message, Catch::Contains("link to node2"));
    }
}

// A trainer's slot as ringd has it: shared memory in a memfd, mapped.
struct MemfdBuffer {
    UniqueFd fd;
    std::byte *p = nullptr;
    size_t bytes = 0;
    explicit MemfdBuffer(size_t n) : fd(::memfd_create("test-slot", MFD_CLOEXEC)), bytes(n) {
        REQUIRE(fd);
        REQUIRE(::ftruncate(fd.get(), static_cast<off_t>(n)) == 0);
        void *m = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
        REQUIRE(m != MAP_FAILED);
        p = static_cast<std::byte *>(m);
    }
    ~MemfdBuffer() {
        if (p) ::munmap(p, bytes);
    }
};

// What the progress thread does with a cancelled solo op (ProgressEngine::drain_cancelled): its
// receives withdrawn, the previous host's messages of it dropped, its own sends let out.
bool drain_cancelled(Transport &t, const RingPosition &pos, uint32_t op_tag, bool by_reference = false) {
    pos.prev->cancel_receives(op_tag);
    pos.prev->set_floor(solo_tag_next(op_tag));
    pos.next->cancel_receives(op_tag);
    pos.next->set_floor(solo_tag_next(op_tag));
    if (by_reference) pos.next->fence(op_tag);
    const auto until = std::chrono::steady_clock::now() + 5s;
    std::vector<LinkEvent> events;
    while (pos.next->sending(op_tag)) {
        if (pos.next->error() || std::chrono::steady_clock::now() >= until) return false;
        events.clear();
        if (!t.poll(events, 10)) return false;
    }
    return !pos.next->error() && !pos.prev->error();
}

TEST_CASE("a solo op that one host never runs is cancelled on the others; the links carry the next op exact",
          "[ring][tcp]") {
    const int streams = GENERATE(1, 3);
    // When the host that skips the op says so: before the others' cancel, or after it (their sends
    // to it wait until then).
    const auto skip_after = GENERATE(0ms, 300ms);
    Ring ring(3, "tcp", streams);
    const uint32_t epoch = 5, seq = 41;
    const uint32_t a_tag = kSoloTag | (epoch << 24) | (0x3cu << 16) | seq;
    const uint64_t count = 1 << 20;  // 4 MiB: more than the socket buffers take
    RingOptions opt{64 << 10, 4};
    std::vector<HostBuffers> bufs(3);
    for (uint32_t r = 0; r < 3; ++r) {
        bufs[r].data.assign(count * 4, std::byte{1});
        bufs[r].staging.resize(RingEngine::staging_bytes(opt));
        bufs[r].data_reg = RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(bufs[r].data.data(), bufs[r].data.size()));
        bufs[r].staging_reg = RegisteredRegion(ring.transports[r].get(), *ring.transports[r]->register_region(bufs[r].staging.data(), bufs[r].staging.size()));
    }
    std::atomic<bool> cancel{false};
    std::vector<Status> results(3, Ok{});
    std::vector<int> drained(3, true);
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < 2; ++r) {
        threads.emplace_back([&, r] {
            RingEngine ar(*ring.transports[r], opt);
            RingOp o;
            o.count = count;
            o.data = bufs[r].data_reg.handle();
            o.staging = bufs[r].staging_reg.handle();
            o.op_tag = a_tag;
            o.cancelled = &cancel;
            ring.pos[r].prev->set_floor(a_tag);
            results[r] = ar.run(ring.pos[r], o, start + 20s);
            if (!results[r].ok() && results[r].error().code == -ECANCELED)
                drained[r] = drain_cancelled(*ring.transports[r], ring.pos[r], a_tag);
        });
    }
    std::this_thread::sleep_for(100ms);
    cancel = true;
    for (auto &th : threads) th.join();
    threads.clear();
    for (uint32_t r = 0; r < 2; ++r) {
        INFO("host " << r);
        REQUIRE_FALSE(results[r].ok());
        CHECK(results[r].error().code == -ECANCELED);
    }
    // Host 2 skips it (this host failed it, say) in its lane order; until then the messages of
    // it that host 1 sent wait in its streams, and host 1's drain waits for them to leave.
    std::this_thread::sleep_for(skip_after);
    ring.pos[2].prev->set_floor(solo_tag_next(a_tag));
    for (uint32_t r = 0; r < 3; ++r) {
        INFO("host " << r);
        CHECK(drained[r]);
    }
    CHECK(std::chrono::steady_clock::now() - start < 5s);
    // The next op of the lane, on the same links: every value exact, guards intact.
    const uint32_t b_tag = kSoloTag | (epoch << 24) | (0x11u << 16) | (seq + 1);
    for (const DType t : {DType::F32, DType::I64})
        allreduce_and_check(ring, t, ReduceOp::Sum, 300001, opt, b_tag);
}

TEST_CASE("a cancelled solo op that sent by reference gives the buffer back only once the next host has read or "
          "dropped what it sent",
          "[ring][tcp]") {
    // Host 1's step-0 sends to host 2 (11 MiB over 3 streams) go by reference; host 2 reads them
    // only once it skips the op, 300 ms after the cancel. Host 1 ends its op after that: its queued
    // sends, then its fences, wait for host 2.
    Ring ring(3, "tcp", 3);
    const uint32_t a_tag = kSoloTag | (9u << 24) | (0x51u << 16) | 7;
    const uint64_t count = RingEngine::kConfirmBytes / 4 + 1024;
    RingOptions opt{1 << 20, 4};
    std::vector<std::unique_ptr<MemfdBuffer>> data(3);
    std::vector<std::vector<std::byte>> staging(3);
    std::vector<RegisteredRegion> data_reg(3), staging_reg(3);
    for (uint32_t r = 0; r < 3; ++r) {
        data[r] = std::make_unique<MemfdBuffer>(count * 4);
        std::memset(data[r]->p, 1, data[r]->bytes);
        staging[r].resize(RingEngine::staging_bytes(opt));
        data_reg[r] = RegisteredRegion(ring.transports[r].get(),
                                       *ring.transports[r]->register_region(data[r]->p, data[r]->bytes, data[r]->fd.get(), 0));
        staging_reg[r] = RegisteredRegion(ring.transports[r].get(),
                                          *ring.transports[r]->register_region(staging[r].data(), staging[r].size()));
    }
    std::atomic<bool> cancel{false};
    std::vector<Status> results(2, Ok{});
    std::vector<int> drained(2, false);
    std::vector<std::chrono::steady_clock::time_point> back(2);
    std::vector<std::thread> threads;
    const auto start = std::chrono::steady_clock::now();
    for (uint32_t r = 0; r < 2; ++r) {
        threads.emplace_back([&, r] {
            RingEngine ar(*ring.transports[r], opt);
            RingOp o;
            o.count = count;
            o.data = data_reg[r].handle();
            o.staging = staging_reg[r].handle();
            o.op_tag = a_tag;
            o.cancelled = &cancel;
            results[r] = ar.run(ring.pos[r], o, start + 20s);
            drained[r] = drain_cancelled(*ring.transports[r], ring.pos[r], a_tag, true);
            back[r] = std::chrono::steady_clock::now();  // the trainer has its buffer back
        });
    }
    std::this_thread::sleep_for(200ms);
    cancel = true;
    std::this_thread::sleep_for(300ms);
    // Host 2 gets to it only now: until its link has read host 1's messages, host 1 keeps its
    // buffer (the kernel may still send those pages).
    const auto skipped = std::chrono::steady_clock::now();
    ring.pos[2].prev->set_floor(solo_tag_next(a_tag));
    std::vector<LinkEvent> events;
    while (ring.pos[2].prev->sending(a_tag) || std::chrono::steady_clock::now() - skipped < 1s) {
        events.clear();
        REQUIRE(ring.transports[2]->poll(events, 10).ok());  // host 2's thread reads (and drops)
    }
    for (auto &th : threads) th.join();
    for (uint32_t r = 0; r < 2; ++r) {
        INFO("host " << r);
        REQUIRE_FALSE(results[r].ok());
        CHECK(results[r].error().code == -ECANCELED);
        CHECK(drained[r]);
    }
    CHECK(ring.pos[1].next->bytes_sent_by_reference() > 0);
    CHECK(back[1] >= skipped);
    // The next op on the same links is exact.
    allreduce_and_check(ring, DType::F32, ReduceOp::Sum, 100003, opt, solo_tag_next(a_tag) | (0x22u << 16));
}

TEST_CASE("solo op tags order by epoch, then seq, across their wrap; the digest does not order", "[ring]") {
    auto tag = [](uint32_t epoch, uint32_t seq, uint32_t digest = 0) {
        return kSoloTag | ((epoch & 0x7f) << 24) | ((digest & 0xff) << 16) | (seq & 0xffff);
    };
    CHECK(solo_tag_before(tag(1, 5), tag(1, 6)));
    CHECK_FALSE(solo_tag_before(tag(1, 6), tag(1, 5)));
    CHECK_FALSE(solo_tag_before(tag(1, 6, 1), tag(1, 6, 2)));
    CHECK(solo_tag_before(tag(1, 60000), tag(2, 1)));
    CHECK(solo_tag_before(tag(1, 0xffff), tag(1, 0)));  // the seq wraps
    CHECK(solo_tag_before(tag(127, 9), tag(0, 1)));     // and the epoch
    CHECK(solo_tag_next(tag(3, 0xffff, 7)) == tag(3, 0));
    CHECK(solo_tag_next(tag(3, 8, 7)) == tag(3, 9));
}

TEST_CASE("a peer that never answers ends in a timeout naming it, not a hang", "[ring]") {
    Ring ring(2, "tcp");
    std::vector<std::byte> data(1 << 16), staging(4096 * 2);
    auto dr = *ring.transports[0]->register_region(data.data(), data.size());
    auto sr = *ring.transports[0]->register_region(staging.data(), staging.size());
    RingEngine ar(*ring.transports[0], RingOptions{4096, 2});
    RingOp o;
    o.count = data.size() / 4;
    o.data = dr;
    o.staging = sr;
    const auto start = std::chrono::steady_clock::now();
    auto s = ar.run(ring.pos[0], o, start + 500ms);
    REQUIRE_FALSE(s.ok());
    CHECK(s.error().code == -ETIMEDOUT);
    CHECK_THAT(s.error().message, Catch::Contains("node1"));
    CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("large ops take chunk_bytes; smaller ones halve it down to 512 KiB with more slots; all exact", "[ring]") {
    const RingOptions opt{2 << 20, 2};
    CHECK(RingEngine::chunk_for(opt, 64 << 20) == 2u << 20);
    CHECK(RingEngine::chunk_for(opt, 16 << 20) == 2u << 20);
    CHECK(RingEngine::chunk_for(opt, (16 << 20) - 1) == 1u << 20);
    CHECK(RingEngine::chunk_for(opt, 8 << 20) == 1u << 20);
    CHECK(RingEngine::chunk_for(opt, (8 << 20) - 1) == 512u << 10);
    CHECK(RingEngine::chunk_for(opt, 1) == 512u << 10);
    // Configured chunks of at most 512 KiB are taken as they are.
    CHECK(RingEngine::chunk_for(RingOptions{512 << 10, 8}, 1) == 512u << 10);
    CHECK(RingEngine::chunk_for(RingOptions{4096, 3}, 1) == 4096);
    CHECK(RingEngine::chunk_for(RingOptions{3 << 20, 2}, 1) == 768u << 10);
    // f32 segments of 3, 10 and 17 MiB over 3 hosts: chunks of 512 KiB (8 slots of the 2 x 2 MiB
    // staging), 1 MiB (4 slots) and 2 MiB (2 slots), each with a short last chunk. The bf16
    // averages run in windows of the 32 MiB work area, with each window's own chunk.
    Ring ring(3, "tcp", 2);
    uint32_t op_tag = 1;
    for (uint64_t mib : {3u, 10u, 17u}) {
        if (kTsan && mib > 3) break;
        INFO(mib << " MiB segments");
        allreduce_and_check(ring, DType::F32, ReduceOp::Sum, 3 * (mib << 20) / 4 + 5, opt, op_tag++);
        allreduce_and_check(ring, DType::BF16, ReduceOp::Avg, 3 * (mib << 20) / 4 + 7, opt, op_tag++, 2);
    }
}

TEST_CASE("partial results forwarded from their staging slot or from the data region: exact with one, two and "
          "five slots, on every transport",
          "[ring]") {
    // One slot: no partial is ever kept in its slot (the receives need it), so every one goes
    // through the data region; two: they alternate; five: most are forwarded from the slot. Many
    // chunks per segment, so slots are reused while their sends are still on the wire. The
    // ibverbs transport completes a send only once the next host has posted its receive, so a
    // slot policy that could starve the receives would hang here (the op deadline fails it).
    const auto [kind, streams] = GENERATE(std::pair<std::string, int>{"loopback", 1}, std::pair<std::string, int>{"tcp", 2}
#ifdef RINGD_HAVE_IBVERBS
                                          , std::pair<std::string, int>{"ibverbs", 1}
#endif
    );
    INFO(kind << " x " << streams);
    // Reduced: 4 hosts; the full matrix adds 2.
    // ThreadSanitizer: 3 hosts.
    const std::vector<uint32_t> host_counts = full_matrix() ? std::vector<uint32_t>{2, 4}
                                              : kTsan       ? std::vector<uint32_t>{3}
                                                            : std::vector<uint32_t>{4};
    for (uint32_t n : host_counts) {
        Ring ring(n, kind, streams);
        uint32_t op_tag = 1;
        for (uint32_t depth : {1u, 2u, 5u}) {
            INFO(n << " hosts, " << depth << " slots");
            const RingOptions opt{4096, depth};
            allreduce_and_check(ring, DType::F32, ReduceOp::Avg, 40 * n * 1024 + 3, opt, op_tag++);
            allreduce_and_check(ring, DType::F32, ReduceOp::Sum, 40 * n * 1024 + 1, opt, op_tag++, 2);
            allreduce_and_check(ring, DType::I64, ReduceOp::Max, 20 * n * 512 + 5, opt, op_tag++, 3);
            allreduce_and_check(ring, DType::BF16, ReduceOp::Avg, 40 * n * 2048 + 7, opt, op_tag++, 2);
            allreduce_and_check(ring, DType::F16, ReduceOp::Sum, 40 * n * 2048 + 9, opt, op_tag++);
        }
        if (kind != "tcp") continue;
        // Chunks of 256 KiB over TCP (each read by several receives), in every dtype family.
        for (uint32_t depth : {1u, 2u, 4u}) {
            if (kTsan && depth == 2) continue;
            INFO(n << " hosts, " << depth << " slots of 256 KiB");
            const RingOptions opt{256 << 10, depth, 50, 4 << 20};
            allreduce_and_check(ring, DType::F32, ReduceOp::Avg, 3 * n * (64 << 10) + 3, opt, op_tag++);
            allreduce_and_check(ring, DType::F32, ReduceOp::Sum, 3 * n * (64 << 10) + 1, opt, op_tag++, 3);
            allreduce_and_check(ring, DType::I64, ReduceOp::Min, 3 * n * (32 << 10) + 5, opt, op_tag++, 2);
            allreduce_and_check(ring, DType::BF16, ReduceOp::Avg, 3 * n * (128 << 10) + 7, opt, op_tag++, 2);
            allreduce_and_check(ring, DType::F16, ReduceOp::Sum, 3 * n * (128 << 10) + 9, opt, op_tag++);
        }
    }
}


TEST_CASE("ops of 32 MiB and more over TCP send the data region by reference and end once the next host has it; "
          "every host overwrites its buffer as its op ends, and every result is exact",
          "[ring][tcp]") {
    constexpr uint64_t kAt = RingEngine::kConfirmBytes / 4;  // floats
    REQUIRE(kAt == 8u << 20);
    RingOptions opt;
    opt.chunk_bytes = 1 << 20;
    opt.depth = 4;
    // (zero copy, hosts). Reduced: by reference on 2 and 3 hosts, by copy on 3; the full matrix adds 4
    // hosts and by copy on 2. ThreadSanitizer runs every access of these 32 MiB buffers slowly: 3
    // hosts, zero copy on.
    std::vector<std::pair<bool, uint32_t>> cases = {{true, 2}, {true, 3}, {false, 3}};
    if (full_matrix()) cases = {{true, 2}, {true, 3}, {true, 4}, {false, 2}, {false, 3}, {false, 4}};
#if defined(__SANITIZE_THREAD__)
    cases = {{true, 3}};
#endif
    for (const auto &c : cases) {
        const bool zero_copy = c.first;
        const uint32_t n = c.second;
        Ring ring(n, "tcp", 2, zero_copy);
        // Two ops in a row on the same links, the second just above the threshold at an odd
        // offset; an op just below it goes by copy.
        const std::vector<std::pair<uint64_t, ReduceOp>> ops = {{kAt + (1u << 20), ReduceOp::Sum},
                                                                {kAt + 3 * n + 1, ReduceOp::Avg},
                                                                {kAt - 1, ReduceOp::Sum}};
        for (size_t k = 0; k < ops.size(); ++k) {
            const auto [count, rop] = ops[k];
            INFO(n << " hosts, zero_copy " << zero_copy << ", op " << k << ": " << count << " floats");
            std::vector<uint64_t> by_ref0(n);
            for (uint32_t r = 0; r < n; ++r) by_ref0[r] = ring.pos[r].next->bytes_sent_by_reference();
            std::vector<std::unique_ptr<MemfdBuffer>> data(n);
            std::vector<std::vector<std::byte>> staging(n), result(n);
            std::vector<bench::GuardedRange> range(n);
            std::vector<RegisteredRegion> data_reg(n), staging_reg(n);
            std::vector<Status> results(n, Ok{});
            for (uint32_t r = 0; r < n; ++r) {
                const size_t offset = kG + 4 * (r + k);
                range[r] = bench::GuardedRange{offset, count, offset + count * 4 + kG, DType::F32, (k << 24) | (r << 8)};
                data[r] = std::make_unique<MemfdBuffer>(range[r].buf_bytes);
                range[r].prepare(data[r]->p, r);
                staging[r].resize(RingEngine::staging_bytes(opt));
                data_reg[r] = RegisteredRegion(ring.transports[r].get(),
                                               *ring.transports[r]->register_region(data[r]->p, data[r]->bytes, data[r]->fd.get(), 0));
                staging_reg[r] = RegisteredRegion(ring.transports[r].get(),
                                                  *ring.transports[r]->register_region(staging[r].data(), staging[r].size()));
            }
            std::vector<std::thread> threads;
            for (uint32_t r = 0; r < n; ++r) {
                threads.emplace_back([&, r] {
                    RingEngine ar(*ring.transports[r], opt);
                    RingOp o;
                    o.dtype = DType::F32;
                    o.op = rop;
                    o.count = count;
                    o.avg_divisor = n;
                    o.data = data_reg[r].handle();
                    o.data_offset = range[r].offset;
                    o.staging = staging_reg[r].handle();
                    o.op_tag = static_cast<uint32_t>(40 + k);
                    results[r] = ar.run(ring.pos[r], o, std::chrono::steady_clock::now() + 60s);
                    // The trainer has its buffer back: it keeps the result and writes its next
                    // gradients over the buffer at once.
                    result[r].assign(data[r]->p, data[r]->p + data[r]->bytes);
                    std::memset(data[r]->p, 0x5a, data[r]->bytes);
                });
            }
            for (auto &th : threads) th.join();
            for (uint32_t r = 0; r < n; ++r) {
                INFO("host " << r);
                REQUIRE(results[r].ok());
                const auto v = range[r].check(result[r].data(), rop, n);
                CHECK(v.wrong == 0);
                CHECK(v.guard == 0);
                const uint64_t by_ref = ring.pos[r].next->bytes_sent_by_reference() - by_ref0[r];
                if (zero_copy && count * 4 >= RingEngine::kConfirmBytes) {
                    // Every send from the data region: step 0 of the reduce-scatter and the
                    // whole allgather, at least n - 1 segments' worth of n - 1.
                    CHECK(by_ref >= (n - 1) * (count / n) * 4 - (uint64_t{1} << 20));
                } else {
                    CHECK(by_ref == 0);
                }
            }
        }
    }
}

TEST_CASE("a TCP payload that trickles in is received whole: the stream wakes for what is left of it, at most "
          "256 KiB, and for any byte between messages",
          "[ring][tcp]") {
    TcpTransport t;
    auto [x, y] = tcp_pair();
    const int yfd = y.get();  // the link's stream from here on
    std::vector<UniqueFd> streams;
    streams.push_back(std::move(y));
    auto link = t.add_link("node1", std::move(streams));
    REQUIRE(link.ok());
    constexpr size_t kBytes = (1 << 20) + 4321;
    std::vector<std::byte> dst(kBytes + 64, std::byte{0x5a});
    auto rd = t.register_region(dst.data(), dst.size());
    REQUIRE(rd.ok());
    std::vector<uint8_t> msg(24 + kBytes);
    proto::le::put<uint32_t>(&msg[0], 0x4D444752);  // 'RGDM', untagged
    proto::le::put<uint64_t>(&msg[8], 7);
    proto::le::put<uint64_t>(&msg[16], kBytes);
    for (size_t i = 0; i < kBytes; ++i) msg[24 + i] = static_cast<uint8_t>(i * 131 + 7);
    auto lowat = [&] {
        int v = -1;
        socklen_t len = sizeof v;
        REQUIRE(::getsockopt(yfd, SOL_SOCKET, SO_RCVLOWAT, &v, &len) == 0);
        return v;
    };
    std::vector<LinkEvent> ev;
    auto poll_a_while = [&] {
        for (int i = 0; i < 5 && ev.empty(); ++i) REQUIRE(t.poll(ev, 10).ok());
    };
    REQUIRE((*link)->post_recv(*rd, 32, kBytes, 7).ok());
    poll_a_while();
    CHECK(lowat() == 1);  // waiting for a header
    // The header and 100000 bytes, then the rest in pieces of 64 KiB (and a short last one).
    size_t sent = 24 + 100000;
    REQUIRE(send_all(x.get(), std::span(msg.data(), sent)).ok());
    poll_a_while();
    CHECK(ev.empty());
    CHECK(lowat() == 256 << 10);  // over 900 KiB still to come
    while (sent < msg.size()) {
        const size_t n = std::min<size_t>(64 << 10, msg.size() - sent);
        REQUIRE(send_all(x.get(), std::span(msg.data() + sent, n)).ok());
        sent += n;
        // Below the mark nothing wakes; at it, the stream reads and sets the next one. The loop
        // only lets the stream catch up (the checks are on the whole payload below); the kernel
        // does not always wake a reader whose queue has reached the mark exactly, so each piece
        // waits at most 200 ms for it (5 s here cost 15 s per run).
        const auto deadline = std::chrono::steady_clock::now() + 200ms;
        const int want = static_cast<int>(std::min<size_t>(msg.size() - sent, 256 << 10));
        while (ev.empty() && sent < msg.size() && lowat() != std::max(want, 1) &&
               std::chrono::steady_clock::now() < deadline)
            REQUIRE(t.poll(ev, 1).ok());
    }
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (ev.empty() && std::chrono::steady_clock::now() < deadline) REQUIRE(t.poll(ev, 10).ok());
    REQUIRE(ev.size() == 1);
    CHECK(ev[0].kind == LinkEvent::Kind::RecvDone);
    CHECK(ev[0].tag == 7);
    CHECK(std::memcmp(dst.data() + 32, msg.data() + 24, kBytes) == 0);
    for (size_t i : {size_t{0}, size_t{31}, kBytes + 32, dst.size() - 1}) CHECK(dst[i] == std::byte{0x5a});
    ev.clear();
    poll_a_while();
    CHECK(lowat() == 1);  // between messages: any byte of the next header wakes it
}

TEST_CASE("tcp.socket_buffer sets both socket buffers; auto leaves them to the kernel", "[ring][tcp]") {
    auto buffers = [](uint64_t asked) {
        TcpTransport t("", false, asked);
        auto [a, b] = tcp_pair();
        const int fd = a.get();
        std::vector<UniqueFd> streams;
        streams.push_back(std::move(a));
        REQUIRE(t.add_link("node1", std::move(streams)).ok());
        int snd = 0, rcv = 0;
        socklen_t len = sizeof snd;
        REQUIRE(::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &snd, &len) == 0);
        len = sizeof rcv;
        REQUIRE(::getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcv, &len) == 0);
        return std::pair{snd, rcv};
    };
    // Linux doubles what is set (its bookkeeping); 96 KiB is under the default
    // net.core.wmem_max/rmem_max (208 KiB), which caps it.
    const auto [snd, rcv] = buffers(96 << 10);
    CHECK(snd == 192 << 10);
    CHECK(rcv == 192 << 10);
    // auto: what any new TCP socket has (net.ipv4.tcp_wmem/tcp_rmem's middle values), free to grow.
    auto [x, y] = tcp_pair();
    int snd0 = 0, rcv0 = 0;
    socklen_t len = sizeof snd0;
    REQUIRE(::getsockopt(x.get(), SOL_SOCKET, SO_SNDBUF, &snd0, &len) == 0);
    len = sizeof rcv0;
    REQUIRE(::getsockopt(x.get(), SOL_SOCKET, SO_RCVBUF, &rcv0, &len) == 0);
    REQUIRE(snd0 != 192 << 10);
    const auto [asnd, arcv] = buffers(0);
    CHECK(asnd == snd0);
    CHECK(arcv == rcv0);
    // A size the kernel would cut is named with the limit that cuts it (ringd warns at start).
    CHECK(TcpTransport::socket_buffer_cap(4096).empty());
    CHECK_THAT(TcpTransport::socket_buffer_cap(uint64_t{1} << 40), Catch::Contains("net.core.wmem_max is ") &&
                                                                     Catch::Contains("net.core.rmem_max is ") &&
                                                                     Catch::EndsWith("tcp.socket_buffer: auto)"));
}

TEST_CASE("TCP links carry the configured congestion control; one the kernel lacks is refused by name", "[ring][tcp]") {
    // reno is built into every kernel and always allowed.
    REQUIRE(TcpTransport::check_congestion("reno").ok());
    TcpTransport t("reno");
    auto [a, b] = tcp_pair();
    const int fd = a.get();
    std::vector<UniqueFd> streams;
    streams.push_back(std::move(a));
    auto link = t.add_link("node1", std::move(streams));
    REQUIRE(link.ok());
    CHECK(TcpTransport::congestion_of(fd) == "reno");
    CHECK(TcpTransport::congestion_of(b.get()) != "");  // TCP
    int pair[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair) == 0);
    CHECK(TcpTransport::congestion_of(pair[0]).empty());  // not TCP
    ::close(pair[0]);
    ::close(pair[1]);
    CHECK(t.detail() == "congestion control reno, zero-copy sends");

    const auto missing = TcpTransport::check_congestion("nosuchcc");
    REQUIRE_FALSE(missing.ok());
    CHECK(missing.error().code == -ENOENT);
    CHECK_THAT(missing.error().message, Catch::StartsWith("TCP congestion control 'nosuchcc' is not in this kernel (available: "));
    CHECK_THAT(TcpTransport("").detail(), Catch::StartsWith("congestion control: the system's"));
}

TEST_CASE("a congestion control the daemon may not set: the default falls back to the kernel's, a configured one is refused",
          "[ring][tcp]") {
    // One the kernel has but does not allow without CAP_NET_ADMIN (available minus allowed).
    auto words = [](const char *path) {
        std::vector<std::string> w;
        std::ifstream f(path);
        for (std::string x; f >> x;) w.push_back(x);
        return w;
    };
    const auto allowed = words("/proc/sys/net/ipv4/tcp_allowed_congestion_control");
    std::string name;
    for (const auto &a : words("/proc/sys/net/ipv4/tcp_available_congestion_control"))
        if (std::find(allowed.begin(), allowed.end(), a) == allowed.end()) name = a;
    // A kernel that allows every congestion control it has to everyone has nothing to refuse
    // (this project's test machines load cubic without allowing it).
    if (name.empty()) RINGD_SKIP("every congestion control of this kernel is allowed to everyone: nothing to refuse");
    INFO(name);
    const auto msg = test::run_as_nobody([&] {
        Config c;
        c.tcp.congestion = name;  // as the default would be
        auto fallback = make_transport(c);
        c.tcp.congestion_set = true;  // as if written in the file
        auto refused = make_transport(c);
        return (fallback ? (*fallback)->detail() : "error: " + fallback.error().message) + "\n" +
               (refused ? "started" : refused.error().message);
    });
    if (!msg) RINGD_SKIP("not root: cannot drop to a user without CAP_NET_ADMIN");
    CHECK_THAT(*msg, Catch::StartsWith("congestion control: the system's"));
    CHECK_THAT(*msg, Catch::Contains("\ntcp.congestion: TCP congestion control '" + name + "' needs CAP_NET_ADMIN") &&
                         Catch::Contains("or set tcp.congestion: system"));
}

TEST_CASE("avg of values near the largest finite one never overflows: f16 and bf16 exactly the mean, f32 and f64 within "
          "the documented bound, on every transport, 1 and 3 hosts, 1 and 2 local ranks",
          "[ring][avg]") {
    const auto [kind, streams] = GENERATE(std::pair<std::string, int>{"loopback", 1}, std::pair<std::string, int>{"tcp", 2}
#ifdef RINGD_HAVE_IBVERBS
                                          , std::pair<std::string, int>{"ibverbs", 1}
#endif
    );
    const uint32_t n = GENERATE(1u, 3u);
    INFO(kind << " x " << streams << ", " << n << " hosts");
    Ring ring(n, kind, streams);
    uint32_t op_tag = 1;
    for (uint32_t local : {1u, 2u}) {
        for (DType t : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
            // Several chunks per segment (the last one short); f16 on the ring: a million elements.
            const uint64_t count = t == DType::F16 && n > 1 && kind != "ibverbs" && !kTsan ? 1000003 : 3 * 3 * 4096 + 11;
            const double ulps = near_max_avg_and_check(ring, t, count, local, RingOptions{16384, 4}, op_tag++);
            UNSCOPED_INFO(dtype_name(t) << ", " << local << " local: largest deviation " << ulps << " ulp");
        }
    }
}

TEST_CASE("f16/bf16 sums and averages larger than the work area run in windows; hosts with different numbers of local "
          "ranks; every value and guard exact",
          "[ring][avg]") {
    const auto [kind, streams] = GENERATE(std::pair<std::string, int>{"loopback", 1}, std::pair<std::string, int>{"tcp", 2}
#ifdef RINGD_HAVE_IBVERBS
                                          , std::pair<std::string, int>{"ibverbs", 2}
#endif
    );
    INFO(kind << " x " << streams);
    // A 16 KiB work area: windows of 4096 elements, each a pass of the ring with 1..2 chunks of
    // 4 KiB (1024 f32) per segment.
    const RingOptions opt{4096, 3, 50, 16384};
    for (uint32_t n : {2u, 3u, 4u}) {
        Ring ring(n, kind, streams);
        uint32_t op_tag = 1;
        for (DType t : {DType::F16, DType::BF16})
            for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max})
                for (uint32_t local : {1u, 3u})
                    for (uint64_t count : {uint64_t{4095}, uint64_t{4096}, uint64_t{4097}, uint64_t{5 * 4096 + 77}})
                        allreduce_and_check(ring, t, op, count, opt, op_tag++, local);
        // One rank here, more elsewhere: a host with one rank scales its own segment before its
        // step-0 send; hosts with one rank each (avg over n) send it raw. Every dtype.
        std::vector<uint32_t> mixed(n, 1);
        mixed[1] = 2;
        for (uint32_t d = 0; d < kDTypeCount; ++d) {
            const auto t = static_cast<DType>(d);
            const ReduceOp op = dtype_is_integer(t) ? ReduceOp::Sum : ReduceOp::Avg;
            allreduce_and_check(ring, t, op, 3 * 4096 + 5, opt, op_tag++, 1, mixed);
        }
        INFO("near the largest value, in windows");
        for (DType t : {DType::F16, DType::BF16}) near_max_avg_and_check(ring, t, 5 * 4096 + 77, 2, opt, op_tag++);
    }
}

TEST_CASE("f16/bf16 sums and averages across hosts are the exact result rounded once (partial sums travel in f32)",
          "[ring][avg]") {
    const auto [kind, streams] = GENERATE(std::pair<std::string, int>{"tcp", 2}
#ifdef RINGD_HAVE_IBVERBS
                                          , std::pair<std::string, int>{"ibverbs", 1}
#endif
    );
    INFO(kind << " x " << streams);
    uint32_t op_tag = 1;
    for (uint32_t n : {2u, 3u, 5u}) {
        Ring ring(n, kind, streams);
        for (DType t : {DType::F16, DType::BF16})
            for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg})
                for (uint32_t local : {1u, 2u})
                    values_allreduce_and_check(ring, t, op, 4 * 4096 + 9, local, RingOptions{8192, 3}, op_tag++,
                                               rounded_once_values(t, op));
    }
}

namespace {

// A one-stream TCP link a -> b between two transports, with keys for both ends (or none).
struct MacLinkPair {
    TcpTransport ta, tb;
    Link *a = nullptr, *b = nullptr;
    MacLinkPair(bool mac_a, bool mac_b, bool keys = true) : ta("", mac_a), tb("", mac_b) {
        auto [x, y] = tcp_pair();
        SessionKeys ka, kb;
        ka.enabled = kb.enabled = keys;
        for (size_t i = 0; i < kSessionKeyBytes; ++i) {
            ka.send[i] = kb.recv[i] = static_cast<uint8_t>(i);
            ka.recv[i] = kb.send[i] = static_cast<uint8_t>(100 + i);
        }
        std::vector<UniqueFd> sa, sb;
        sa.push_back(std::move(x));
        sb.push_back(std::move(y));
        auto la = ta.add_link("nodeB", std::move(sa), {ka});
        auto lb = tb.add_link("nodeA", std::move(sb), {kb});
        REQUIRE((la.ok() && lb.ok()));
        a = *la;
        b = *lb;
    }
    // Polls both until `b` has an event for tag 1 (or a failure); returns it.
    LinkEvent receive(std::chrono::milliseconds limit = 5s) {
        const auto deadline = std::chrono::steady_clock::now() + limit;
        std::vector<LinkEvent> ev;
        while (std::chrono::steady_clock::now() < deadline) {
            REQUIRE(ta.poll(ev, 1).ok());
            REQUIRE(tb.poll(ev, 1).ok());
            for (auto &e : ev)
                if (e.link == b) return e;
            ev.clear();
        }
        FAIL("no event on the receiving link");
        return {};
    }
};

}  // namespace

TEST_CASE("auth.data: mac tags every TCP data message; a corrupted payload or a host configured otherwise fails "
          "the link by name",
          "[ring][tcp][mac]") {
    std::vector<std::byte> src(1 << 20), dst(1 << 20);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7);
    SECTION("tagged both ways, sent by reference from a memfd at an odd offset: exact, tag and all") {
        MacLinkPair p(true, true);
        MemfdBuffer m(src.size() + 4096);
        std::memcpy(m.p + 5, src.data(), src.size());
        auto rs = p.ta.register_region(m.p, m.bytes, m.fd.get(), 0);
        auto rd = p.tb.register_region(dst.data(), dst.size());
        REQUIRE((rs.ok() && rd.ok()));
        REQUIRE(p.b->post_recv(*rd, 0, dst.size(), 1).ok());
        REQUIRE(p.a->post_send_stable(*rs, 5, src.size(), 1).ok());
        const LinkEvent e = p.receive();
        REQUIRE(e.kind == LinkEvent::Kind::RecvDone);
        CHECK(std::memcmp(src.data(), dst.data(), src.size()) == 0);
        CHECK(p.a->bytes_sent_by_reference() == src.size());
        CHECK_FALSE(p.a->delivered_at_send_done());
        // A plain send, and a stable one from a region without a file, are copied.
        REQUIRE(p.b->post_recv(*rd, 0, dst.size(), 2).ok());
        REQUIRE(p.a->post_send(*rs, 5, src.size(), 2).ok());
        auto rm = p.ta.register_region(src.data(), src.size());
        REQUIRE(rm.ok());
        REQUIRE(p.b->post_recv(*rd, 0, dst.size(), 3).ok());
        REQUIRE(p.a->post_send_stable(*rm, 0, src.size(), 3).ok());
        std::vector<LinkEvent> ev;
        int in = 0;
        for (int i = 0; i < 5000 && in < 2; ++i) {
            REQUIRE(p.ta.poll(ev, 1).ok());
            REQUIRE(p.tb.poll(ev, 1).ok());
            for (auto &x : ev) in += x.link == p.b && x.kind == LinkEvent::Kind::RecvDone;
            ev.clear();
        }
        REQUIRE(in == 2);
        CHECK(std::memcmp(src.data(), dst.data(), src.size()) == 0);
        CHECK(p.a->bytes_sent_by_reference() == src.size());
    }
    SECTION("tagged both ways: the data arrives exact") {
        MacLinkPair p(true, true);
        CHECK_THAT(p.ta.detail(), Catch::EndsWith(", auth.data: mac, zero-copy sends"));
        auto rs = p.ta.register_region(src.data(), src.size());
        auto rd = p.tb.register_region(dst.data(), dst.size());
        REQUIRE((rs.ok() && rd.ok()));
        for (int k = 0; k < 4; ++k) {
            std::fill(dst.begin(), dst.end(), std::byte{0});
            src[k] = static_cast<std::byte>(0xa0 + k);
            if (k % 2 == 0) {
                REQUIRE(p.b->post_recv(*rd, 0, dst.size(), 1).ok());
                REQUIRE(p.a->post_send(*rs, 0, src.size(), 1).ok());
            } else {
                // The message (header, payload, tag) is there before its receive is posted.
                REQUIRE(p.a->post_send(*rs, 0, src.size(), 1).ok());
                std::vector<LinkEvent> ev;
                for (int i = 0; i < 20; ++i) {
                    REQUIRE(p.ta.poll(ev, 1).ok());
                    REQUIRE(p.tb.poll(ev, 1).ok());
                }
                REQUIRE(p.b->post_recv(*rd, 0, dst.size(), 1).ok());
            }
            const LinkEvent e = p.receive();
            REQUIRE(e.kind == LinkEvent::Kind::RecvDone);
            CHECK(std::memcmp(src.data(), dst.data(), src.size()) == 0);
        }
    }
    SECTION("a message whose tag does not match its bytes fails its MAC check") {
        // What a changed bit on the way looks like to the receiver: a message written here, with
        // the header and payload of a real one and a tag that is not theirs.
        TcpTransport tb("", true);
        auto [x, y] = tcp_pair();
        SessionKeys kb;
        kb.enabled = true;
        std::vector<UniqueFd> sb;
        sb.push_back(std::move(y));
        auto lb = tb.add_link("nodeA", std::move(sb), {kb});
        REQUIRE(lb.ok());
        auto rd = tb.register_region(dst.data(), dst.size());
        REQUIRE(rd.ok());
        REQUIRE((*lb)->post_recv(*rd, 0, 4096, 1).ok());
        std::vector<uint8_t> m(24 + 4096 + 16, 0);
        proto::le::put<uint32_t>(&m[0], 0x4D444752);  // 'RGDM'
        proto::le::put<uint32_t>(&m[4], 1);           // tagged
        proto::le::put<uint64_t>(&m[8], 1);
        proto::le::put<uint64_t>(&m[16], 4096);
        REQUIRE(send_all(x.get(), m).ok());
        std::vector<LinkEvent> ev;
        const auto deadline = std::chrono::steady_clock::now() + 5s;
        while (ev.empty() && std::chrono::steady_clock::now() < deadline) REQUIRE(tb.poll(ev, 10).ok());
        REQUIRE_FALSE(ev.empty());
        REQUIRE(ev[0].kind == LinkEvent::Kind::Failed);
        CHECK(ev[0].error.code == -EACCES);
        CHECK_THAT(ev[0].error.message, Catch::Contains("fails its MAC check"));
    }
    SECTION("one end tags, the other does not: refused, naming auth.data") {
        for (bool a_tags : {true, false}) {
            MacLinkPair p(a_tags, !a_tags);
            auto rs = p.ta.register_region(src.data(), src.size());
            auto rd = p.tb.register_region(dst.data(), dst.size());
            REQUIRE((rs.ok() && rd.ok()));
            REQUIRE(p.b->post_recv(*rd, 0, dst.size(), 1).ok());
            REQUIRE(p.a->post_send(*rs, 0, src.size(), 1).ok());
            const LinkEvent e = p.receive();
            REQUIRE(e.kind == LinkEvent::Kind::Failed);
            CHECK_THAT(e.error.message, Catch::Contains("auth.data must be the same on every host"));
        }
    }
    SECTION("without keys (no secret) nothing is tagged, whatever auth.data says") {
        MacLinkPair p(true, false, false);
        auto rs = p.ta.register_region(src.data(), src.size());
        auto rd = p.tb.register_region(dst.data(), dst.size());
        REQUIRE((rs.ok() && rd.ok()));
        REQUIRE(p.b->post_recv(*rd, 0, dst.size(), 1).ok());
        REQUIRE(p.a->post_send(*rs, 0, src.size(), 1).ok());
        CHECK(p.receive().kind == LinkEvent::Kind::RecvDone);
    }
}

TEST_CASE("rails: a message goes to the rail whose backlog drains first at its weight, so rails share an op by their rates",
          "[ring][tcp][rails]") {
    using Load = TcpLink::StreamLoad;
    // Two rails of two streams each, weights 3 and 1.
    std::vector<Load> s = {{0, 3, 0}, {0, 3, 0}, {1, 1, 0}, {1, 1, 0}};
    CHECK(TcpLink::choose_stream(s, 1000, 0) < 2);  // idle: the heavier rail
    CHECK(TcpLink::choose_stream(s, 1000, 2) < 2);
    s[0].backlog = 2000;
    CHECK(TcpLink::choose_stream(s, 1000, 0) == 1);  // its rail, its emptier stream
    s[0].backlog = s[1].backlog = 1000;  // rail 0: (2000 + 1000) / 3, rail 1: 1000 / 1: a tie goes round from `first`
    CHECK(TcpLink::choose_stream(s, 1000, 0) < 2);
    CHECK(TcpLink::choose_stream(s, 1000, 2) >= 2);
    s[1].backlog = 9000;
    CHECK(TcpLink::choose_stream(s, 1000, 0) >= 2);
    s[3].backlog = 500;
    CHECK(TcpLink::choose_stream(s, 1000, 0) == 2);
    // Streams in any order, a rail of one stream.
    std::vector<Load> t = {{1, 1, 500}, {0, 1, 0}};
    CHECK(TcpLink::choose_stream(t, 1000, 0) == 1);

    // Rails drained at their rates: what each is sent follows them, with weights that say so and
    // also with equal weights (the backlog is the measure), never all on one rail.
    auto share = [](double rate0, double rate1, double w0, double w1) {
        std::vector<Load> l = {{0, w0, 0}, {1, w1, 0}};
        uint64_t sent[2] = {0, 0};
        for (size_t k = 0; k < 20000; ++k) {
            const size_t i = TcpLink::choose_stream(l, 1 << 16, k);
            l[i].backlog += 1 << 16;
            sent[i] += 1 << 16;
            // One message's time at the pair's total rate passes.
            const double dt = (1 << 16) / (rate0 + rate1);
            l[0].backlog -= std::min<uint64_t>(l[0].backlog, static_cast<uint64_t>(rate0 * dt));
            l[1].backlog -= std::min<uint64_t>(l[1].backlog, static_cast<uint64_t>(rate1 * dt));
        }
        return static_cast<double>(sent[0]) / static_cast<double>(sent[1]);
    };
    CHECK(share(3, 1, 3, 1) == Approx(3).epsilon(0.05));
    CHECK(share(1, 1, 1, 1) == Approx(1).epsilon(0.05));
    CHECK(share(3, 1, 1, 1) == Approx(3).epsilon(0.1));
    CHECK(share(1, 2, 1, 2) == Approx(0.5).epsilon(0.05));
}

namespace {

// A TCP link a -> b of `rails` rails x `per_rail` streams between two transports, with a second
// descriptor of every stream's sending end, by which a test takes a rail's connections down.
struct RailLinkPair {
    TcpTransport ta, tb;
    TcpLink *a = nullptr, *b = nullptr;
    uint32_t rails, per_rail;
    std::vector<UniqueFd> a_side;  // dup()s of a's streams, in stream order
    // socket_buffer: every stream's (tcp.socket_buffer; 0: the kernel's autotuning)
    RailLinkPair(uint32_t rails_, uint32_t per_rail_, bool mac = false, uint64_t socket_buffer = 0)
        : ta("", mac, socket_buffer, true, 500), tb("", mac, socket_buffer, true, 500), rails(rails_), per_rail(per_rail_) {
        std::vector<UniqueFd> sa, sb;
        std::vector<uint32_t> r;
        std::vector<double> w;
        std::vector<SessionKeys> ka, kb;
        for (uint32_t i = 0; i < rails * per_rail; ++i) {
            auto [x, y] = tcp_pair();
            a_side.emplace_back(::dup(x.get()));
            sa.push_back(std::move(x));
            sb.push_back(std::move(y));
            r.push_back(i / per_rail);
            w.push_back(1.0);
            auto [k1, k2] = keys(i);
            ka.push_back(k1);
            kb.push_back(k2);
        }
        // Streams stay unread until the test posts their receives (no read-ahead on a stall).
        ta.set_hold_after(std::chrono::hours(1));
        tb.set_hold_after(std::chrono::hours(1));
        auto la = ta.add_link("nodeB", std::move(sa), ka, r, w);
        auto lb = tb.add_link("nodeA", std::move(sb), kb, r, w);
        REQUIRE((la.ok() && lb.ok()));
        a = static_cast<TcpLink *>(*la);
        b = static_cast<TcpLink *>(*lb);
    }
    static std::pair<SessionKeys, SessionKeys> keys(uint32_t salt) {
        SessionKeys x, y;
        x.enabled = y.enabled = true;
        for (size_t i = 0; i < kSessionKeyBytes; ++i) {
            x.send[i] = y.recv[i] = static_cast<uint8_t>(i + salt);
            x.recv[i] = y.send[i] = static_cast<uint8_t>(100 + i + salt);
        }
        return {x, y};
    }
    // Rail r's connections fail at both ends (as when its NIC goes: the kernel's timeout, a reset).
    void take_down(uint32_t r) {
        for (uint32_t i = r * per_rail; i < (r + 1) * per_rail; ++i) ::shutdown(a_side[i].get(), SHUT_RDWR);
    }
    // New connections for rail r, handed to both ends.
    void bring_back(uint32_t r) {
        std::vector<UniqueFd> fa, fb;
        std::vector<SessionKeys> ka, kb;
        for (uint32_t i = r * per_rail; i < (r + 1) * per_rail; ++i) {
            auto [x, y] = tcp_pair();
            a_side[i] = UniqueFd(::dup(x.get()));
            fa.push_back(std::move(x));
            fb.push_back(std::move(y));
            auto [k1, k2] = keys(1000 + i);
            ka.push_back(k1);
            kb.push_back(k2);
        }
        REQUIRE(a->add_rail_streams(r, std::move(fa), ka).ok());
        REQUIRE(b->add_rail_streams(r, std::move(fb), kb).ok());
    }
    // Polls both until `until` holds or `limit` passes; every event is kept.
    std::vector<LinkEvent> events;
    template <class Until> bool poll(Until until, std::chrono::milliseconds limit = 10s) {
        const auto deadline = std::chrono::steady_clock::now() + limit;
        while (!until()) {
            if (std::chrono::steady_clock::now() >= deadline) return false;
            REQUIRE(ta.poll(events, 1).ok());
            REQUIRE(tb.poll(events, 1).ok());
        }
        return true;
    }
    size_t count(Link *l, LinkEvent::Kind k) const {
        return static_cast<size_t>(std::count_if(events.begin(), events.end(), [&](const LinkEvent &e) { return e.link == l && e.kind == k; }));
    }
};

}  // namespace

TEST_CASE("rails: a rail whose connections fail costs no message: what the peer did not read goes again on the other "
          "rails, exact, with no link error; new connections bring it back; only the last rail down fails the link",
          "[ring][tcp][rails]") {
    const bool mac = GENERATE(false, true);
    INFO("auth.data mac: " << mac);
    RailLinkPair p(2, 2, mac);
    constexpr uint64_t kMsg = 1 << 20;
    constexpr size_t kN = 16;
    std::vector<std::byte> src(kMsg * kN), dst(kMsg * kN + 2 * kG, std::byte{0x5a});
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
    auto rs = p.ta.register_region(src.data(), src.size());
    auto rd = p.tb.register_region(dst.data(), dst.size());
    REQUIRE((rs.ok() && rd.ok()));
    auto sends_done = [&] { return p.count(p.a, LinkEvent::Kind::SendDone); };
    auto recvs_done = [&] { return p.count(p.b, LinkEvent::Kind::RecvDone); };
    auto check_dst = [&](size_t messages) {
        CHECK(std::memcmp(dst.data() + kG, src.data(), messages * kMsg) == 0);
        for (size_t i = 0; i < kG; ++i) {
            CHECK(dst[i] == std::byte{0x5a});
            CHECK(dst[dst.size() - 1 - i] == std::byte{0x5a});
        }
    };

    // Every message sent, only the first half received: the rest wait in the streams, unread.
    for (size_t m = 0; m < kN; ++m) REQUIRE(p.a->post_send(*rs, m * kMsg, kMsg, m).ok());
    for (size_t m = 0; m < kN / 2; ++m) REQUIRE(p.b->post_recv(*rd, kG + m * kMsg, kMsg, m).ok());
    REQUIRE(p.poll([&] { return recvs_done() == kN / 2; }));
    // A SendDone says that the peer has the message (its ack), not that the socket took it.
    CHECK(sends_done() <= kN / 2);
    CHECK(p.a->bytes_sent_on_rail(0) > 0);
    CHECK(p.a->bytes_sent_on_rail(1) > 0);

    p.take_down(1);
    for (size_t m = kN / 2; m < kN; ++m) REQUIRE(p.b->post_recv(*rd, kG + m * kMsg, kMsg, m).ok());
    REQUIRE(p.poll([&] { return recvs_done() == kN && sends_done() == kN; }));
    CHECK(!p.a->error());
    CHECK(!p.b->error());
    CHECK(p.count(p.a, LinkEvent::Kind::Failed) == 0);
    CHECK(p.count(p.b, LinkEvent::Kind::Failed) == 0);
    CHECK(!p.a->rail_up(1));
    CHECK(!p.b->rail_up(1));  // told by a's notice (its own streams saw the close too)
    CHECK(p.a->rail_up(0));
    CHECK(p.a->messages_resent() > 0);
    CHECK(p.a->messages_resent() <= kN / 2);
    CHECK(p.a->rail_resynced(1));
    check_dst(kN);

    // New connections: the rail carries messages again, and the link stays exact.
    p.bring_back(1);
    CHECK(p.a->rail_up(1));
    CHECK(p.b->rail_up(1));
    const uint64_t on_rail1 = p.a->bytes_sent_on_rail(1);
    p.events.clear();
    std::fill(dst.begin() + kG, dst.end() - kG, std::byte{0});
    for (size_t m = 0; m < kN; ++m) {
        REQUIRE(p.b->post_recv(*rd, kG + m * kMsg, kMsg, 100 + m).ok());
        REQUIRE(p.a->post_send(*rs, m * kMsg, kMsg, 100 + m).ok());
    }
    REQUIRE(p.poll([&] { return recvs_done() == kN && sends_done() == kN; }));
    CHECK(p.a->bytes_sent_on_rail(1) > on_rail1);
    check_dst(kN);
    CHECK(p.b->held_bytes() == 0);

    // The last rail: the link fails, naming it, and every pending op with it.
    p.events.clear();
    REQUIRE(p.b->post_recv(*rd, kG, kMsg, 200).ok());
    p.take_down(0);
    p.take_down(1);
    REQUIRE(p.poll([&] { return p.a->error() && p.b->error(); }));
    CHECK_THAT(p.b->error()->message, Catch::Contains("every rail of the link is down"));
    CHECK(p.count(p.b, LinkEvent::Kind::Failed) >= 1);
}

TEST_CASE("rails: a message sent again goes where the ring posted it, not behind the sender's queue: a receiver that "
          "posts a few receives at a time (as the ring does) gets every message, with little read ahead",
          "[ring][tcp][rails]") {
    const bool mac = GENERATE(false, true);
    INFO("auth.data mac: " << mac);
    RailLinkPair p(2, 2, mac, 1 << 20);  // sockets of at most 2 MiB each way (the kernel doubles it)
    constexpr uint64_t kMsg = 1 << 20;
    constexpr size_t kN = kTsan ? 96 : 160;  // more than kMaxHeldBytes queued behind what goes again
    constexpr size_t kWindow = 4;            // receives posted at a time (the ring's staging slots)
    std::vector<std::byte> src(kMsg * kN), dst(kMsg * kN + 2 * kG, std::byte{0x5a});
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 2654435761u) >> 11);
    auto rs = p.ta.register_region(src.data(), src.size());
    auto rd = p.tb.register_region(dst.data(), dst.size());
    REQUIRE((rs.ok() && rd.ok()));
    // Every send posted at once: the sockets hold a few, the rest wait in the sender's queues.
    for (size_t m = 0; m < kN; ++m) REQUIRE(p.a->post_send(*rs, m * kMsg, kMsg, m).ok());
    size_t posted = 0, seen = 0;
    uint64_t most_held = 0;
    bool down = false;
    auto receive = [&] {
        for (; seen < p.events.size(); ++seen)
            if (p.events[seen].link == p.b && p.events[seen].kind == LinkEvent::Kind::RecvDone && posted < kN) {
                REQUIRE(p.b->post_recv(*rd, kG + posted * kMsg, kMsg, posted).ok());
                ++posted;
            }
        most_held = std::max(most_held, p.b->held_bytes());
        const size_t got = p.count(p.b, LinkEvent::Kind::RecvDone);
        if (!down && got >= 16) {
            p.take_down(1);  // with every rail's streams full and most messages still queued
            down = true;
        }
        return got == kN || p.a->error() || p.b->error();
    };
    for (; posted < kWindow; ++posted) REQUIRE(p.b->post_recv(*rd, kG + posted * kMsg, kMsg, posted).ok());
    const bool all_in = p.poll(receive, 60s);
    INFO("receiver: " << p.b->describe() << "\nsender: " << p.a->describe());
    REQUIRE(all_in);
    REQUIRE(p.poll([&] { return p.count(p.a, LinkEvent::Kind::SendDone) == kN; }));
    CHECK(!p.a->error());
    CHECK(!p.b->error());
    CHECK(!p.b->rail_up(1));
    CHECK(p.a->messages_resent() > 0);
    CHECK(std::memcmp(dst.data() + kG, src.data(), src.size()) == 0);
    for (size_t i = 0; i < kG; ++i) {
        CHECK(dst[i] == std::byte{0x5a});
        CHECK(dst[dst.size() - 1 - i] == std::byte{0x5a});
    }
    // Read ahead: what the surviving streams' sockets held when the sender resent (two streams,
    // at most 4 MiB each), and the messages sent again behind them.
    INFO("most held: " << most_held);
    CHECK(most_held < (16u << 20));
    CHECK(p.b->held_bytes() == 0);
}

TEST_CASE("rails: a peer that reads nothing for longer than tcp.rail_timeout (its trainer is late, its buffers full) "
          "takes no rail down; what it then reads is exact",
          "[ring][tcp][rails]") {
    RailLinkPair p(2, 1);  // tcp.rail_timeout 500 ms
    constexpr uint64_t kMsg = 1 << 20;
    constexpr size_t kN = 48;  // far more than the sockets hold: the receiver's window closes
    std::vector<std::byte> src(kMsg * kN), dst(kMsg * kN);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 40503u) >> 7);
    auto rs = p.ta.register_region(src.data(), src.size());
    auto rd = p.tb.register_region(dst.data(), dst.size());
    REQUIRE((rs.ok() && rd.ok()));
    for (size_t m = 0; m < kN; ++m) REQUIRE(p.a->post_send(*rs, m * kMsg, kMsg, m).ok());
    // Three times the timeout without a receive posted (the transports polled all along).
    CHECK_FALSE(p.poll([&] { return p.a->rails_down() != 0 || p.b->rails_down() != 0 || p.a->error(); }, 1500ms));
    for (size_t m = 0; m < kN; ++m) REQUIRE(p.b->post_recv(*rd, m * kMsg, kMsg, m).ok());
    REQUIRE(p.poll([&] { return p.count(p.b, LinkEvent::Kind::RecvDone) == kN && p.count(p.a, LinkEvent::Kind::SendDone) == kN; }));
    CHECK(p.a->rails_down() == 0);
    CHECK(p.a->messages_resent() == 0);
    CHECK(std::memcmp(dst.data(), src.data(), src.size()) == 0);
}

TEST_CASE("rails: the ring's ops stay exact when a rail goes down in the middle of one; no link fails", "[ring][tcp][rails]") {
    // Three hosts, two rails of two streams per link; host 0's rail 1 to host 1 fails mid-op.
    Ring ring(3, "tcp", 2, true, 2);
    RingOptions opt;
    opt.chunk_bytes = 1 << 20;
    const uint64_t count = kTsan ? (4u << 20) : (24u << 20);  // f32 elements
    std::atomic<int64_t> progress{0};
    std::atomic<bool> done{false};
    std::thread killer([&] {
        const auto until = std::chrono::steady_clock::now() + 20s;
        while (progress.load() == 0 && !done && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
        std::this_thread::sleep_for(2ms);
        ring.take_down(0, 1);
    });
    struct Join {  // also when a check below throws
        std::thread &t;
        std::atomic<bool> &done;
        ~Join() {
            done = true;
            if (t.joinable()) t.join();
        }
    } join{killer, done};
    allreduce_and_check(ring, DType::F32, ReduceOp::Sum, count, opt, 7, 1, {}, &progress);
    auto *l = static_cast<TcpLink *>(ring.pos[0].next);
    CHECK(!l->error());
    CHECK(!l->rail_up(1));
    CHECK(!static_cast<TcpLink *>(ring.pos[1].prev)->rail_up(1));
    // The next op, on the rail that is left: exact.
    allreduce_and_check(ring, DType::F32, ReduceOp::Sum, 100003, opt, 8);
}
