// DirectExchange: the bounds on one-/two-shot data, checked without a daemon.
#include <catch2/catch.hpp>

#include "daemon/exchange/direct_exchange.h"

using namespace ringd;

namespace {

constexpr uint64_t kCount = uint64_t{4} << 20;  // 16 MiB of float per one-shot contribution

// Host 0's one-shot contribution of group g's op seq, as its OpData payload (what the control
// connection hands over: the frame without its header).
proto::Bytes one_shot_payload(const std::string &g, uint64_t seq, uint64_t count = kCount) {
    proto::OpReport r{7, g, seq, count, static_cast<uint32_t>(DType::F32), static_cast<uint32_t>(ReduceOp::Sum), 1, 0, "", 0, 5, 1000};
    proto::Bytes f = proto::encode_op_data(r, proto::OpDataKind::OneShot, count * 4);
    return proto::Bytes(f.begin() + proto::kFrameHeaderBytes, f.end());
}

struct Fixture {
    uint64_t queued = 0;
    DirectExchange x{1, {"a", "b"}, [](uint32_t, const proto::Bytes &) {}, [this](uint32_t) { return queued; }};

    // Offers host 0's part of op seq; returns whether it was kept, and the bound's message.
    bool offer(const std::string &g, uint64_t seq, std::string &why) {
        proto::Bytes p = one_shot_payload(g, seq);
        auto d = proto::decode_op_data(p);
        REQUIRE(d.ok());
        const proto::OpData data = *d;
        return x.take_part(0, data, std::move(p), why);
    }
};

}  // namespace

TEST_CASE_METHOD(Fixture, "peers' data of ops not reached is kept up to the bound per group, then named; dropping "
                          "it frees the room",
                 "[exchange]") {
    std::string why;
    uint64_t kept = 0;
    for (uint64_t seq = 1; seq <= 32 && why.empty(); ++seq)
        if (offer("g", seq, why)) ++kept;
    // 16 MiB + header each: 15 fit under 256 MiB, the 16th would cross it.
    CHECK(kept == 15);
    CHECK(why == "group g op 16: host b holds more one-/two-shot data of ops it has not reached than its bound of "
                 "256 MiB per group (host a is that far ahead)");
    CHECK(x.backlog(0) == 15 * (kCount * 4 + proto::kOpDataHeaderBytes));
    // Another group still has room: the bound is per group.
    why.clear();
    CHECK(offer("h", 1, why));
    CHECK(why.empty());
    // An op decided elsewhere drops its data, and the group has room again.
    x.drop(7, OpKey{"g", 5, 1});
    CHECK(offer("g", 16, why));
    CHECK(why.empty());
    x.drop_before(8);
    CHECK(x.backlog(0) == 0);
}

TEST_CASE_METHOD(Fixture, "past the bound per peer the op fails naming it, whatever the group", "[exchange]") {
    std::string why;
    int kept = 0;
    // 14 ops of 16 MiB in each of three groups: under 256 MiB per group, but 512 MiB per peer is
    // crossed on the way.
    for (const char *g : {"g1", "g2", "g3"})
        for (uint64_t seq = 1; seq <= 14 && why.empty(); ++seq)
            if (offer(g, seq, why)) ++kept;
    CHECK(kept == 31);  // 31 x (16 MiB + header) <= 512 MiB < 32 x
    CHECK_THAT(why, Catch::Contains("than its bound of 512 MiB per peer (host a is that far ahead)"));
}

TEST_CASE_METHOD(Fixture, "this host sends an op's data only while its queue to each peer stays under its bound",
                 "[exchange]") {
    proto::OpReport r{7, "g", 3, kCount, static_cast<uint32_t>(DType::F32), static_cast<uint32_t>(ReduceOp::Sum), 1, 0, "", 0, 5, 1000};
    queued = DirectExchange::kMaxSendBacklog - kCount * 4;
    CHECK(x.send_over_bound(r, DType::F32, ReduceOp::Sum, Algorithm::OneShot).empty());
    queued += 1;
    CHECK(x.send_over_bound(r, DType::F32, ReduceOp::Sum, Algorithm::OneShot) ==
          "group g op 3: host b's queue to host a holds 112 MiB, over its bound of 128 MiB (host a is not taking "
          "one-/two-shot data as fast as it comes)");
    // Two-shot sends a peer only its segment (half of it with two hosts).
    CHECK(x.send_over_bound(r, DType::F32, ReduceOp::Sum, Algorithm::TwoShot).empty());
}
