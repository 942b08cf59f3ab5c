// The ring allreduce's messages, pinned: over a grid of host counts, local ranks per host, dtypes,
// ops, counts and chunk settings, every message each host posts (link, send or receive, by value
// or by reference, tag, bytes, and a hash of what a send carries) is recorded in the order the
// host posts it on each link and digested per host; the digests are compared with
// tests/unit/golden/ring_allreduce.txt. The file was written by the ring allreduce of peer protocol
// 8 before the engine was rewritten as schedules over shared primitives: the allreduce's messages
// are part of the peer protocol, and a ring whose hosts run different releases (a rolling upgrade)
// depends on them staying byte for byte the same. RINGD_GOLDEN_WRITE=1 writes the file instead
// (only when the protocol changes on purpose).
//
// The links are loopback links behind a recording wrapper that can also say that a send's
// completion does not mean delivered, as TCP's does not: the ops of 32 MiB and more then send
// by reference and end with the delivery marker, and those messages are pinned too.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "bench/bench_data.h"
#include "daemon/engine/ring_engine.h"
#include "daemon/transport/loopback/loopback_transport.h"

using namespace ringd;
using namespace std::chrono_literals;

namespace {

uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const auto *b = static_cast<const unsigned char *>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}
template <typename T>
uint64_t fnv(uint64_t h, T v) {
    return fnv(h, &v, sizeof v);
}
constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull;

// What one end of a link was asked to do, in the order it was asked.
struct Record {
    std::vector<uint64_t> entries;  // one digest per post
    uint64_t bytes = 0;
};

class RecordingLink final : public Link {
public:
    RecordingLink(Link *inner, bool delivered) : Link(inner->peer()), inner_(inner), delivered_(delivered) {}
    Status post_send(const RegionHandle &r, uint64_t off, uint64_t bytes, uint64_t tag) override {
        note('s', r, off, bytes, tag);
        return inner_->post_send(r, off, bytes, tag);
    }
    Status post_send_stable(const RegionHandle &r, uint64_t off, uint64_t bytes, uint64_t tag) override {
        note('s', r, off, bytes, tag);  // by reference or not: the peer cannot tell
        return inner_->post_send(r, off, bytes, tag);
    }
    Status post_recv(const RegionHandle &r, uint64_t off, uint64_t bytes, uint64_t tag) override {
        note('r', r, off, bytes, tag);
        return inner_->post_recv(r, off, bytes, tag);
    }
    bool delivered_at_send_done() const override { return delivered_; }
    Link *inner() const { return inner_; }
    Record sends, recvs;

private:
    void note(char kind, const RegionHandle &r, uint64_t off, uint64_t bytes, uint64_t tag) {
        uint64_t h = fnv(fnv(fnv(kFnvBasis, kind), tag), bytes);
        // What a send carries is final when it is posted (the memory stays unchanged until it is
        // done): its bytes are part of the protocol too.
        if (kind != 'r') h = fnv(h, r.base + off, bytes);
        Record &rec = kind == 'r' ? recvs : sends;
        rec.entries.push_back(h);
        rec.bytes += bytes;
    }
    Link *inner_;
    bool delivered_;
};

// A loopback transport whose events name the recording links.
class RecordingTransport final : public Transport {
public:
    std::string_view name() const override { return "recording"; }
    Status poll(std::vector<LinkEvent> &out, int timeout_ms) override {
        const size_t from = out.size();
        auto s = inner.poll(out, timeout_ms);
        for (size_t i = from; i < out.size(); ++i)
            if (auto it = wrap.find(out[i].link); it != wrap.end()) out[i].link = it->second;
        return s;
    }
    LoopbackTransport inner;
    std::map<Link *, Link *> wrap;

protected:
    Result<RegionHandle> do_register(std::byte *base, size_t bytes) override { return inner.register_region(base, bytes); }
    void do_deregister(RegionHandle h) override { inner.deregister_region(h); }
};

struct Case {
    uint32_t hosts;
    std::vector<uint32_t> locals;  // per host
    DType dtype;
    ReduceOp op;
    uint64_t count;
    RingOptions opt;
    bool delivered = true;

    std::string name() const {
        std::ostringstream o;
        o << "hosts=" << hosts << " locals=";
        for (size_t i = 0; i < locals.size(); ++i) o << (i ? "," : "") << locals[i];
        o << " " << dtype_name(dtype) << " " << reduce_op_name(op) << " count=" << count << " chunk=" << opt.chunk_bytes
          << " depth=" << opt.depth << " work=" << opt.work_bytes << " delivered=" << (delivered ? 1 : 0);
        return o.str();
    }
};

// One allreduce of `c` on a ring of recording loopback links; returns the case's golden line:
// per host, the messages and bytes it posted and a digest of them, link by link.
std::string run_case(const Case &c, uint32_t op_tag) {
    const uint32_t n = c.hosts;
    const size_t es = dtype_size(c.dtype);
    std::vector<std::unique_ptr<RecordingTransport>> ts;
    for (uint32_t r = 0; r < n; ++r) ts.push_back(std::make_unique<RecordingTransport>());
    std::vector<RingPosition> pos(n);
    std::vector<std::unique_ptr<RecordingLink>> links;
    const uint32_t pairs = n == 2 ? 1 : n;
    for (uint32_t r = 0; r < pairs; ++r) {
        const uint32_t q = (r + 1) % n;
        auto [a, b] = LoopbackTransport::connect(ts[r]->inner, "node" + std::to_string(r), ts[q]->inner,
                                                 "node" + std::to_string(q));
        links.push_back(std::make_unique<RecordingLink>(a, c.delivered));
        ts[r]->wrap[a] = links.back().get();
        pos[r].next = links.back().get();
        links.push_back(std::make_unique<RecordingLink>(b, c.delivered));
        ts[q]->wrap[b] = links.back().get();
        pos[q].prev = links.back().get();
    }
    if (n == 2) {
        pos[0].prev = pos[0].next;
        pos[1].next = pos[1].prev;
    }
    std::vector<uint64_t> first(n, 0);
    for (uint32_t r = 1; r < n; ++r) first[r] = first[r - 1] + c.locals[r - 1];
    const uint64_t total = first[n - 1] + c.locals[n - 1];
    struct Bufs {
        std::vector<std::byte> data;
        RegisteredRegion data_reg, staging_reg;
        std::vector<std::vector<std::byte>> locals;
        std::vector<std::byte *> ptrs;
    };
    std::vector<Bufs> bufs(n);
    std::vector<Status> results(n, Ok{});
    for (uint32_t r = 0; r < n; ++r) {
        auto &b = bufs[r];
        pos[r].rank = r;
        pos[r].size = n;
        b.data.resize(std::max<uint64_t>(c.count * es, 1));
        bench::fill(b.data.data(), c.count, c.dtype, first[r]);
        // The staging areas (tens of MiB) are kept from case to case: what a case leaves in them
        // is never read by the next (every receive is written before it is read).
        static std::vector<std::vector<std::byte>> staging;
        if (staging.size() <= r) staging.resize(r + 1);
        if (staging[r].size() < RingEngine::staging_bytes(c.opt)) staging[r].resize(RingEngine::staging_bytes(c.opt));
        b.data_reg = RegisteredRegion(ts[r].get(), *ts[r]->register_region(b.data.data(), b.data.size()));
        b.staging_reg = RegisteredRegion(ts[r].get(), *ts[r]->register_region(staging[r].data(), staging[r].size()));
        for (uint32_t l = 1; l < c.locals[r]; ++l) {
            b.locals.emplace_back(std::max<uint64_t>(c.count * es, 1));
            bench::fill(b.locals.back().data(), c.count, c.dtype, first[r] + l);
        }
        for (auto &l : b.locals) b.ptrs.push_back(l.data());
    }
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < n; ++r)
        threads.emplace_back([&, r] {
            RingEngine ar(*ts[r], c.opt);
            RingOp o;
            o.dtype = c.dtype;
            o.op = c.op;
            o.count = c.count;
            o.avg_divisor = static_cast<uint32_t>(total);
            o.data = bufs[r].data_reg.handle();
            o.staging = bufs[r].staging_reg.handle();
            o.locals = bufs[r].ptrs;
            o.op_tag = op_tag;
            results[r] = ar.run(pos[r], o, std::chrono::steady_clock::now() + 60s);
        });
    for (auto &t : threads) t.join();
    std::ostringstream line;
    line << c.name() << " |";
    for (uint32_t r = 0; r < n; ++r) {
        INFO(c.name() << ", host " << r);
        REQUIRE(results[r].ok());
        // The result is checked too (a golden file of wrong messages pins nothing worth keeping):
        // host 0's value by value, every other rank's the same bytes.
        if (r == 0) CHECK(bench::count_wrong(bufs[0].data.data(), c.count, c.dtype, c.op, total) == 0);
        CHECK(bufs[r].data == bufs[0].data);
        for (const auto &l : bufs[r].locals) CHECK(l == bufs[0].data);
        uint64_t h = kFnvBasis, msgs = 0, bytes = 0;
        // The host's links in a fixed order: to the next host, then from the previous one (the
        // same link on two hosts); each end's sends, then its receives.
        std::vector<RecordingLink *> mine{static_cast<RecordingLink *>(pos[r].next)};
        if (pos[r].prev != pos[r].next) mine.push_back(static_cast<RecordingLink *>(pos[r].prev));
        for (RecordingLink *l : mine)
            for (const Record *rec : {&l->sends, &l->recvs}) {
                h = fnv(h, uint64_t{0x5ec7});
                for (uint64_t e : rec->entries) h = fnv(h, e);
                msgs += rec->entries.size();
                bytes += rec->bytes;
            }
        char hex[17];
        std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
        line << " " << msgs << "/" << bytes << "/" << hex;
    }
    return line.str();
}

// The grid. Every allreduce path of the ring: one and several chunks per segment, the halving of
// chunks for mid-sized ops, partials forwarded from their slot or through the data region (depth
// 1 and 2), f16/bf16 widened to f32 in one and in several windows, avg with one and with several
// local ranks, uneven local ranks, counts below the host count, and ops of 32 MiB and more on links
// whose SendDone does not mean delivered (by reference, delivery marker).
std::vector<Case> grid() {
    std::vector<Case> v;
    auto opt = [](uint64_t chunk, uint32_t depth, uint64_t work = 0) {
        RingOptions o;
        o.chunk_bytes = chunk;
        o.depth = depth;
        o.work_bytes = work;
        return o;
    };
    const std::vector<RingOptions> opts{opt(2 << 20, 4), opt(64 << 10, 2), opt(16 << 10, 1, 64 << 10)};
    for (uint32_t hosts : {2u, 3u, 4u, 5u})
        for (const auto &locals : std::vector<std::vector<uint32_t>>{{1}, {3}, {1, 2, 3}})
            for (uint32_t t = 0; t < kDTypeCount; ++t)
                for (uint32_t o = 0; o < kReduceOpCount; ++o) {
                    const auto dt = static_cast<DType>(t);
                    const auto op = static_cast<ReduceOp>(o);
                    if (op == ReduceOp::Avg && dtype_is_integer(dt)) continue;
                    std::vector<uint32_t> per(hosts);
                    for (uint32_t r = 0; r < hosts; ++r) per[r] = locals[r % locals.size()];
                    for (uint64_t count : {uint64_t{0}, uint64_t{1}, uint64_t{hosts + 1}, uint64_t{1000}, uint64_t{100003}})
                        for (const auto &o2 : opts) {
                            // The large counts with every chunk setting; the small ones need one.
                            if (count < 1000 && o2.chunk_bytes != (2u << 20)) continue;
                            v.push_back({hosts, per, dt, op, count, o2});
                        }
                }
    // Mid-sized (chunks halved to 512 KiB) and large ops, by value and by reference.
    for (bool delivered : {true, false}) v.push_back({3, {1, 1, 1}, DType::F32, ReduceOp::Sum, 3 << 20, opt(2 << 20, 4), delivered});
    v.push_back({3, {2, 1, 1}, DType::F32, ReduceOp::Avg, 9 << 20, opt(2 << 20, 4), false});
    v.push_back({4, {1, 1, 1, 1}, DType::BF16, ReduceOp::Sum, 17 << 20, opt(2 << 20, 4), false});
    v.push_back({2, {1, 1}, DType::I64, ReduceOp::Max, 5 << 20, opt(2 << 20, 2), false});
    return v;
}

}  // namespace

TEST_CASE("the ring allreduce's messages are byte for byte those of the golden file", "[ring][golden]") {
    const char *src = std::getenv("RINGD_SOURCE_DIR");
    REQUIRE(src != nullptr);
    const std::string path = std::string(src) + "/tests/unit/golden/ring_allreduce.txt";
    const bool write = std::getenv("RINGD_GOLDEN_WRITE") != nullptr;
    std::vector<std::string> lines;
    uint32_t tag = 1;
    for (const Case &c : grid()) lines.push_back(run_case(c, tag++ % 4096));
    if (write) {
        std::ofstream out(path);
        out << "# tests/unit/test_ring_golden.cpp: per case, per host: messages/bytes/digest\n";
        for (const auto &l : lines) out << l << "\n";
        REQUIRE(out.good());
        WARN("wrote " << path);
        return;
    }
    std::ifstream in(path);
    REQUIRE(in.good());
    std::vector<std::string> want;
    for (std::string l; std::getline(in, l);)
        if (!l.empty() && l[0] != '#') want.push_back(l);
    REQUIRE(want.size() == lines.size());
    uint32_t differ = 0;
    for (size_t i = 0; i < lines.size(); ++i) {
        if (lines[i] == want[i]) continue;
        if (differ++ < 5) {
            INFO("golden: " << want[i]);
            INFO("now:    " << lines[i]);
            CHECK(lines[i] == want[i]);
        }
    }
    CHECK(differ == 0);
}
