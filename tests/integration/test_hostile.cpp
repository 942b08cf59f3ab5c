// Hostile local clients: garbage, oversize frames, fds sent to the daemon, connection floods,
// early closes, attempts to resize the slot, corrupt queue indices and descriptors, a client
// that never consumes completions. ringd must survive all of it, drop only the offender, and
// an honest group working alongside must not notice.
#include <catch2/catch.hpp>

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "bench/bench_data.h"
#include "common/status_client.h"
#include "common/shm_mapping.h"
#include "proto/frame.h"
#include "proto/slot.h"
#include "ringd/ringd.hpp"
#include "tests/support/harness.h"

using namespace ringd;
using namespace ringd::test;

namespace {

constexpr auto kDeadline = std::chrono::seconds(5);

// An honest 2-rank group that checks its results: every value, and the guard bytes around each
// rank's range (the ranks' ranges sit at different offsets that move from op to op).
struct HonestGroup {
    Client a, b;
    int ops = 0;
    HonestGroup(const std::string &sock, const std::string &name)
        : a(sock, name, 0, 2, 1 << 20), b(sock, name, 1, 2, 1 << 20) {}
    void step() {
        const size_t k = static_cast<size_t>(ops++);
        const size_t count = 1000 + 17 * k;
        const bench::GuardedRange ga{bench::kGuardBytes + 8 * k, count, a.slot().size(), DType::F32, 2 * k + 1};
        const bench::GuardedRange gb{3 * bench::kGuardBytes + 4 * count + 24 * k, count, b.slot().size(), DType::F32, 2 * k + 2};
        ga.prepare(a.slot().data(), 0);
        gb.prepare(b.slot().data(), 1);
        const auto ta = a.submit(ga.offset, count, RINGD_F32, RINGD_SUM);
        const auto tb = b.submit(gb.offset, count, RINGD_F32, RINGD_SUM);
        a.wait(ta, 5000);
        b.wait(tb, 5000);
        const auto va = ga.check(a.slot().data(), ReduceOp::Sum, 2);
        const auto vb = gb.check(b.slot().data(), ReduceOp::Sum, 2);
        INFO("honest op " << k);
        CHECK(va.wrong == 0);
        CHECK(va.guard == 0);
        CHECK(vb.wrong == 0);
        CHECK(vb.guard == 0);
    }
};

// A client speaking the protocol by hand.
struct RawClient {
    UniqueFd sock;
    std::vector<UniqueFd> fds;
    proto::Welcome w;
    SharedMapping map;
    proto::SlotHeader *hdr = nullptr;
    proto::SubmitDesc *sq = nullptr;
    proto::CompletionDesc *cq = nullptr;

    RawClient(const std::string &path, const std::string &group, uint32_t rank, uint32_t size) {
        sock = raw_connect(path);
        REQUIRE(sock.valid());
        REQUIRE(send_all(sock.get(), proto::encode_hello({group, rank, size, 1 << 16, ""})).ok());
        uint8_t h[proto::kFrameHeaderBytes];
        REQUIRE(recv_exact(sock.get(), h, sizeof h, Clock::now() + kDeadline, fds).ok());
        auto fh = proto::decode_frame_header(std::span(h, sizeof h), proto::kMaxDaemonPayload);
        REQUIRE(fh.ok());
        REQUIRE(fh->type == proto::FrameType::Welcome);
        std::vector<uint8_t> p(fh->length);
        REQUIRE(recv_exact(sock.get(), p.data(), p.size(), Clock::now() + kDeadline, fds).ok());
        auto dw = proto::decode_welcome(p);
        REQUIRE(dw.ok());
        REQUIRE(fds.size() == 3);
        w = *dw;
        auto m = SharedMapping::map(fds[0].get(), w.map_bytes);
        REQUIRE(m.ok());
        map = std::move(*m);
        auto g = proto::slot_geometry(w.data_bytes);
        hdr = reinterpret_cast<proto::SlotHeader *>(map.data());
        sq = reinterpret_cast<proto::SubmitDesc *>(map.data() + g->sq_offset);
        cq = reinterpret_cast<proto::CompletionDesc *>(map.data() + g->cq_offset);
    }
    void ring() {
        const uint64_t one = 1;
        (void)!::write(fds[1].get(), &one, 8);
    }
    void submit(const proto::SubmitDesc &d) {
        const uint64_t t = hdr->sq_tail.value.load();
        sq[t % w.sq_depth] = d;
        hdr->sq_tail.value.store(t + 1);
        ring();
    }
    // Next completion within the deadline.
    std::optional<proto::CompletionDesc> next_completion() {
        const auto deadline = Clock::now() + kDeadline;
        while (Clock::now() < deadline) {
            const uint64_t head = hdr->cq_head.value.load();
            if (hdr->cq_tail.value.load() != head) {
                proto::CompletionDesc c = cq[head % w.cq_depth];
                hdr->cq_head.value.store(head + 1);
                return c;
            }
            pollfd p{fds[2].get(), POLLIN, 0};
            ::poll(&p, 1, ms_until(deadline));
            uint64_t v;
            (void)!::read(fds[2].get(), &v, 8);
        }
        return std::nullopt;
    }
};

proto::SubmitDesc desc(uint64_t seq, uint64_t count, uint64_t offset = 0) {
    proto::SubmitDesc d{};
    d.seq = seq;
    d.count = count;
    d.dtype = static_cast<uint32_t>(DType::F32);
    d.op = static_cast<uint32_t>(ReduceOp::Sum);
    d.offset = offset;
    return d;
}

}  // namespace

TEST_CASE("garbage, oversize and truncated frames drop only that client", "[hostile]") {
    Daemon d;
    REQUIRE(d.ready());
    HonestGroup honest(d.socket(), "honest");
    honest.step();

    SECTION("random garbage") {
        UniqueFd s = raw_connect(d.socket());
        std::vector<uint8_t> junk(4096);
        for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<uint8_t>(i * 7919 + 13);
        (void)send_all(s.get(), junk);
        CHECK(closed_by_peer(s.get(), kDeadline));
    }
    SECTION("a 4 GiB length is refused with an error frame before allocation") {
        UniqueFd s = raw_connect(d.socket());
        auto f = proto::encode_frame(proto::FrameType::Hello, {});
        f[8] = f[9] = f[10] = f[11] = 0xFF;
        REQUIRE(send_all(s.get(), f).ok());
        std::vector<UniqueFd> fds;
        uint8_t h[proto::kFrameHeaderBytes];
        REQUIRE(recv_exact(s.get(), h, sizeof h, Clock::now() + kDeadline, fds).ok());
        auto fh = proto::decode_frame_header(std::span(h, sizeof h), proto::kMaxDaemonPayload);
        REQUIRE(fh.ok());
        CHECK(fh->type == proto::FrameType::Error);
        std::vector<uint8_t> p(fh->length);
        REQUIRE(recv_exact(s.get(), p.data(), p.size(), Clock::now() + kDeadline, fds).ok());
        CHECK_THAT(proto::decode_error(p)->message, Catch::Contains("exceeds the limit"));
        CHECK(closed_by_peer(s.get(), kDeadline));
    }
    SECTION("a valid header with a hello payload of the wrong size") {
        UniqueFd s = raw_connect(d.socket());
        std::vector<uint8_t> p(100, 0);
        (void)send_all(s.get(), proto::encode_frame(proto::FrameType::Hello, p));
        CHECK(closed_by_peer(s.get(), kDeadline));
    }
    SECTION("a welcome frame sent to the daemon") {
        UniqueFd s = raw_connect(d.socket());
        (void)send_all(s.get(), proto::encode_welcome({1, 64, 64, 1, 0x20000, 0x9000, 16}));
        CHECK(closed_by_peer(s.get(), kDeadline));
    }
    SECTION("half a header, then close; a hello, then close before the welcome") {
        for (int i = 0; i < 20; ++i) {
            UniqueFd s = raw_connect(d.socket());
            auto f = proto::encode_hello({"early", 0, 1, 4096, ""});
            (void)send_all(s.get(), std::span(f).first(i % 2 ? 7 : f.size()));
        }
        UniqueFd idle = raw_connect(d.socket());  // says nothing: dropped after the hello timeout
        CHECK(closed_by_peer(idle.get(), std::chrono::seconds(8)));
    }
    SECTION("a client that sends file descriptors") {
        UniqueFd s = raw_connect(d.socket());
        UniqueFd e1(::eventfd(0, 0)), e2(::eventfd(0, 0));
        const int fds[2] = {e1.get(), e2.get()};
        (void)send_all(s.get(), proto::encode_hello({"fds", 0, 1, 4096, ""}), fds);
        CHECK(closed_by_peer(s.get(), kDeadline));
    }
    honest.step();
    CHECK(d.alive());
}

TEST_CASE("a connection flood is capped and does not disturb connected trainers", "[hostile]") {
    DaemonOptions o;
    o.max_slots = 4;
    Daemon d(o);
    REQUIRE(d.ready());
    HonestGroup honest(d.socket(), "honest");
    std::vector<UniqueFd> flood;
    for (int i = 0; i < 300; ++i) {
        UniqueFd s = raw_connect(d.socket());
        if (s) flood.push_back(std::move(s));
    }
    for (int i = 0; i < 10; ++i) honest.step();
    // Beyond the cap (max_slots + 64) connections are answered with an error and closed.
    CHECK(closed_by_peer(flood.back().get(), kDeadline));
    CHECK_FALSE(closed_by_peer(flood.front().get(), std::chrono::milliseconds(0)));
    flood.clear();
    // Once the flood is gone, new trainers get in.
    Client late(d.socket(), "late", 0, 1, 4096);
    late.allreduce(0, 10, RINGD_F32, RINGD_SUM, 5000);
    honest.step();
    CHECK(d.alive());
}

TEST_CASE("running out of file descriptors refuses connections without spinning or crashing", "[hostile]") {
    DaemonOptions o;
    o.nofile = 48;  // a few dozen: the flood below exhausts it
    Daemon d(o);
    REQUIRE(d.ready());
    HonestGroup honest(d.socket(), "honest");
    std::vector<UniqueFd> flood;
    for (int i = 0; i < 80; ++i) {
        UniqueFd s = raw_connect(d.socket());
        if (s) flood.push_back(std::move(s));
    }
    // The last connections found the daemon out of fds: accepted and closed at once.
    CHECK(closed_by_peer(flood.back().get(), kDeadline));
    for (int i = 0; i < 5; ++i) honest.step();
    flood.clear();
    // Once the flood is gone (the daemon sees the EOFs), a new trainer gets its slot.
    std::unique_ptr<Client> late;
    const auto deadline = Clock::now() + kDeadline;
    while (!late && Clock::now() < deadline) {
        try {
            late = std::make_unique<Client>(d.socket(), "late", 0, 1, 4096);
        } catch (const ClientError &) {
        }
    }
    REQUIRE(late);
    late->allreduce(0, 10, RINGD_F32, RINGD_SUM, 5000);
    honest.step();
    CHECK(d.alive());
    CHECK_THAT(d.log(), Catch::Contains("out of file descriptors"));
}

TEST_CASE("the slot cannot be resized or resealed by the client", "[hostile]") {
    Daemon d;
    REQUIRE(d.ready());
    HonestGroup honest(d.socket(), "honest");
    RawClient r(d.socket(), "shrinker", 0, 1);
    const int memfd = r.fds[0].get();
    CHECK(::ftruncate(memfd, 4096) == -1);
    CHECK(errno == EPERM);
    CHECK(::ftruncate(memfd, 1 << 30) == -1);
    CHECK(::fcntl(memfd, F_ADD_SEALS, F_SEAL_WRITE) == -1);
    const int seals = ::fcntl(memfd, F_GET_SEALS);
    CHECK((seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) == (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL));
    struct stat st{};
    REQUIRE(::fstat(memfd, &st) == 0);
    CHECK(static_cast<uint64_t>(st.st_size) == r.w.map_bytes);
    // Punching a hole only zeroes pages; the daemon still reads and writes them without a fault.
    (void)::fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(r.w.map_bytes));
    r.submit(desc(1, 16384, 0));
    auto c = r.next_completion();
    REQUIRE(c.has_value());
    CHECK(c->status == 0);
    honest.step();
    CHECK(d.alive());
}

TEST_CASE("bad descriptors get an error for that client only; it can go on", "[hostile]") {
    Daemon d;
    REQUIRE(d.ready());
    HonestGroup honest(d.socket(), "honest");
    RawClient r(d.socket(), "bad", 0, 1);
    struct Bad {
        proto::SubmitDesc d;
        const char *msg;
    };
    proto::SubmitDesc over = desc(1, 1ull << 62);
    proto::SubmitDesc outside = desc(2, 10, r.w.data_bytes - 8);
    proto::SubmitDesc dtype = desc(3, 1);
    dtype.dtype = 77;
    proto::SubmitDesc op = desc(4, 1);
    op.op = 9;
    proto::SubmitDesc cuda = desc(5, 1);
    cuda.buffer_kind = static_cast<uint32_t>(proto::BufferKind::Cuda);
    proto::SubmitDesc avg = desc(6, 1);
    avg.dtype = static_cast<uint32_t>(DType::I64);
    avg.op = static_cast<uint32_t>(ReduceOp::Avg);
    proto::SubmitDesc seq = desc(99, 1);
    for (const Bad &b : {Bad{over, "overflows"}, Bad{outside, "outside"}, Bad{dtype, "unknown dtype 77"},
                         Bad{op, "unknown reduce op 9"}, Bad{cuda, "CUDA"}, Bad{avg, "avg is not defined"},
                         Bad{seq, "out of sequence"}}) {
        r.submit(b.d);
        auto c = r.next_completion();
        REQUIRE(c.has_value());
        CHECK(c->status < 0);
        CHECK_THAT(std::string(c->message, c->message_len), Catch::Contains(b.msg));
        honest.step();
    }
    r.submit(desc(7, 100));
    auto c = r.next_completion();
    REQUIRE(c.has_value());
    CHECK(c->seq == 7);
    CHECK(c->status == 0);
    CHECK(d.alive());
}

namespace {
uint64_t rss_kib(pid_t pid) {
    const std::string s = read_file("/proc/" + std::to_string(pid) + "/status");
    const auto at = s.find("VmRSS:");
    return at == std::string::npos ? 0 : std::stoull(s.substr(at + 6));
}
}  // namespace

TEST_CASE("a client that floods its submission queue is held to its completion-queue depth; an honest group "
          "goes on",
          "[hostile]") {
    DaemonOptions o;
    o.op_timeout = "20s";  // nothing of the flood completes while it runs
    Daemon d(o);
    REQUIRE(d.ready());
    HonestGroup honest(d.socket(), "honest");
    honest.step();
    // Local rank 1 of its group never joins, so its ops wait; it writes valid descriptors as fast
    // as its queue has room, for a second.
    RawClient r(d.socket(), "flood", 0, 2);
    const uint64_t rss_before = rss_kib(d.pid());
    uint64_t seq = 1;
    for (const auto until = Clock::now() + std::chrono::seconds(1); Clock::now() < until;) {
        if (r.hdr->sq_tail.value.load() - r.hdr->sq_head.value.load() < r.w.sq_depth) r.submit(desc(seq++, 4));
        else ::poll(nullptr, 0, 1);  // the queue is full: ringd stopped taking
    }
    INFO("descriptors written " << seq - 1);
    // ringd took as many as the client has completion slots for, and holds no more.
    CHECK(r.hdr->sq_head.value.load() == r.w.cq_depth);
    CHECK(seq - 1 == r.w.cq_depth + r.w.sq_depth);
    CHECK(rss_kib(d.pid()) < rss_before + 8 * 1024);
    for (int k = 0; k < 3; ++k) honest.step();
    // The flood's ops end at the op timeout like any other; the honest group never noticed.
    const auto j = nlohmann::json::parse(*fetch_status(d.socket()));
    for (const auto &g : j["groups"])
        if (g["name"] == "flood") CHECK(g["pending_ops"].get<uint64_t>() <= r.w.cq_depth);
}

TEST_CASE("descriptors held back for credits are taken as soon as completions free them", "[hostile]") {
    Daemon d;
    REQUIRE(d.ready());
    RawClient r(d.socket(), "credit", 0, 2);
    Client b(d.socket(), "credit", 1, 2, 1 << 16);
    const uint64_t n = r.w.cq_depth + r.w.sq_depth;  // a full completion queue's worth held back
    const auto deadline = Clock::now() + kDeadline;
    auto wait_until = [&](auto &&done) {
        while (!done() && Clock::now() < deadline) ::poll(nullptr, 0, 1);  // ringd moves sq_head, no fd says so
        return done();
    };
    for (uint64_t seq = 1; seq <= n; ++seq) {
        REQUIRE(wait_until([&] { return r.hdr->sq_tail.value.load() - r.hdr->sq_head.value.load() < r.w.sq_depth; }));
        r.submit(desc(seq, 4));
    }
    REQUIRE(wait_until([&] { return r.hdr->sq_head.value.load() >= r.w.cq_depth; }));
    ::poll(nullptr, 0, 50);  // room for ringd to take more than its credits, if it would
    REQUIRE(r.hdr->sq_head.value.load() == r.w.cq_depth);
    for (uint64_t done = 0; done < n; done += r.w.cq_depth) {
        std::vector<uint64_t> t;
        for (uint64_t k = 0; k < r.w.cq_depth; ++k) t.push_back(b.submit(0, 4, RINGD_F32, RINGD_SUM));
        for (uint64_t ticket : t) b.wait(ticket, 5000);
        for (uint64_t k = 1; k <= r.w.cq_depth; ++k) {
            const auto c = r.next_completion();
            REQUIRE(c.has_value());
            CHECK(c->seq == done + k);
            CHECK(c->status == 0);
        }
    }
    CHECK(r.hdr->sq_head.value.load() == n);
}

TEST_CASE("corrupt queue indices and an unconsumed completion queue drop only that client", "[hostile]") {
    Daemon d;
    REQUIRE(d.ready());
    HonestGroup honest(d.socket(), "honest");
    SECTION("submission tail far ahead of the head") {
        RawClient r(d.socket(), "tail", 0, 1);
        r.hdr->sq_tail.value.store(1000000);
        r.ring();
        CHECK(closed_by_peer(r.sock.get(), kDeadline));
    }
    SECTION("submission tail behind the head") {
        RawClient r(d.socket(), "tail", 0, 1);
        r.submit(desc(1, 1));
        REQUIRE(r.next_completion().has_value());
        r.hdr->sq_tail.value.store(0);
        r.ring();
        CHECK(closed_by_peer(r.sock.get(), kDeadline));
    }
    SECTION("completion head moved backwards / never consumed") {
        RawClient r(d.socket(), "glutton", 0, 1);
        for (uint64_t s = 1; s <= 70; ++s) {
            if (s <= 64) r.submit(desc(s, 1));
            else {
                // Queue is full of unconsumed completions: the daemon must drop, not block.
                const uint64_t t = r.hdr->sq_tail.value.load();
                r.sq[t % r.w.sq_depth] = desc(s, 1);
                r.hdr->sq_tail.value.store(t + 1);
                r.ring();
            }
        }
        CHECK(closed_by_peer(r.sock.get(), kDeadline));
    }
    SECTION("doorbell spam with nothing queued") {
        RawClient r(d.socket(), "spam", 0, 1);
        for (int i = 0; i < 10000; ++i) r.ring();
        r.submit(desc(1, 4));
        auto c = r.next_completion();
        REQUIRE(c.has_value());
        CHECK(c->status == 0);
    }
    honest.step();
    CHECK(d.alive());
}
