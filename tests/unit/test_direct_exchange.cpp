// DirectExchange: the bounds on one-/two-shot data, checked without a daemon.
#include <catch2/catch.hpp>

#include <cstring>

#include "daemon/exchange/direct_exchange.h"
#include "daemon/ipc/slot.h"
#include "daemon/transport/loopback/loopback_transport.h"

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
    CHECK(x.send_over_bound(r, OpDesc{Collective::Allreduce, DType::F32, ReduceOp::Sum, kCount, 0}, Algorithm::OneShot, {}).empty());
    queued += 1;
    CHECK(x.send_over_bound(r, OpDesc{Collective::Allreduce, DType::F32, ReduceOp::Sum, kCount, 0}, Algorithm::OneShot, {}) ==
          "group g op 3: host b's queue to host a holds 112 MiB, over its bound of 128 MiB (host a is not taking "
          "one-/two-shot data as fast as it comes)");
    // Two-shot sends a peer only its segment (half of it with two hosts).
    CHECK(x.send_over_bound(r, OpDesc{Collective::Allreduce, DType::F32, ReduceOp::Sum, kCount, 0}, Algorithm::TwoShot, {}).empty());
    // An all_to_all's message goes a window at a time, whatever its size (host b, rank 1, sends
    // rank 0 on host a one block of 40 Mi floats: 160 MiB): it needs room for a window in the
    // queue, and is refused only past the parts a message can have.
    const std::vector<std::vector<uint32_t>> ranks{{0}, {1}};
    const OpDesc a2a{Collective::AllToAll, DType::F32, ReduceOp::Sum, 40u << 20, 2};
    queued = DirectExchange::kMaxSendBacklog - DirectExchange::kAllToAllWindow + 1;
    CHECK_FALSE(x.send_over_bound(r, a2a, Algorithm::OneShot, ranks).empty());
    queued -= 1;
    CHECK(x.send_over_bound(r, a2a, Algorithm::OneShot, ranks).empty());
    queued = 0;
    CHECK(x.send_over_bound(r, OpDesc{Collective::AllToAll, DType::F32, ReduceOp::Sum, DirectExchange::kMaxAllToAllMessage / 4, 2},
                            Algorithm::OneShot, ranks) ==
          "group g op 3: an all_to_all message of 262140 MiB from host b to host a is over the 262140 MiB a pair of hosts "
          "carries in one op (split it into several all_to_alls)");
}

TEST_CASE("an all_to_all's message goes a part at a time: a window queued, and more only once the peer's message of "
          "the op comes; the op completes once its last part is out",
          "[exchange]") {
    // Host b (rank 1) and host a (rank 0), a block of 4.5 Mi floats each way: 5 parts a message.
    constexpr uint64_t kBlock = 9ull << 19;
    const std::vector<std::vector<uint32_t>> ranks{{0}, {1}};
    uint64_t queued = 0;
    std::vector<uint32_t> sent;  // each frame's part number
    DirectExchange x{1, {"a", "b"},
                     [&](uint32_t to, proto::Bytes f) {
                         CHECK(to == 0);
                         queued += f.size();
                         auto d = proto::decode_op_data(std::span<const uint8_t>(f).subspan(proto::kFrameHeaderBytes));
                         REQUIRE(d.ok());
                         sent.push_back(d->step & 0xffff);
                     },
                     [&](uint32_t) { return queued; }};
    LoopbackTransport t;
    HostOp op;
    op.algorithm = Algorithm::OneShot;
    op.run.group = "g";
    op.run.seq = 1;
    op.run.desc = OpDesc{Collective::AllToAll, DType::F32, ReduceOp::Sum, kBlock, 2};
    op.run.ranks = {1};
    auto sl = Slot::create("t", 16 * kBlock, t);
    REQUIRE(sl.ok());
    op.slots.push_back(*sl);
    op.run.members.push_back({});
    op.run.offsets.push_back(0);
    op.run.out_offsets.push_back(8 * kBlock);
    float *in = reinterpret_cast<float *>((*sl)->data()), *out = in + 2 * kBlock;
    for (uint64_t i = 0; i < 2 * kBlock; ++i) in[i] = static_cast<float>(i % 1000);
    proto::OpReport r{7, "g", 1, kBlock, static_cast<uint32_t>(DType::F32), static_cast<uint32_t>(ReduceOp::Sum), 1, 0, "",
                      static_cast<uint32_t>(Algorithm::OneShot), 5, 1000};
    r.collective = static_cast<uint32_t>(Collective::AllToAll);
    const OpKey key{"g", 5, 1};
    auto find = [&](const OpKey &k) { return k == key ? &op : nullptr; };
    std::vector<OpKey> finished;

    x.contribute(op, r, ranks);
    CHECK(sent == std::vector<uint32_t>{0, 1});  // a window
    queued = 0;
    CHECK_FALSE(x.pump(7, find, finished));  // host a has not reached the op: nothing more
    CHECK(sent.size() == 2);
    // Host a's message (its counts, then its block of 7s) comes, part by part.
    const uint64_t total = 8 + kBlock * 4;
    std::vector<uint8_t> message(total);
    std::memcpy(message.data(), &kBlock, 8);
    for (uint64_t i = 0; i < kBlock; ++i) {
        const float v = 7;
        std::memcpy(message.data() + 8 + 4 * i, &v, 4);
    }
    auto offer = [&](uint32_t part) {
        const uint64_t at = part * proto::kAllToAllPartBytes, n = std::min<uint64_t>(proto::kAllToAllPartBytes, total - at);
        proto::Bytes f = proto::encode_op_data(r, proto::OpDataKind::OneShot, n, 5u << 16 | part);
        std::memcpy(f.data() + proto::op_data_offset(), message.data() + at, n);
        proto::Bytes payload(f.begin() + proto::kFrameHeaderBytes, f.end());
        auto d = proto::decode_op_data(payload);
        REQUIRE(d.ok());
        std::string why;
        CHECK(x.take_part(0, *d, std::move(payload), why));
        CHECK(why.empty());
    };
    offer(0);
    CHECK(x.pump(7, find, finished));  // a window more, while the queue takes it
    CHECK(sent == std::vector<uint32_t>{0, 1, 2, 3});
    CHECK(finished.empty());
    CHECK_FALSE(x.pump(7, find, finished));
    for (uint32_t k = 1; k < 5; ++k) offer(k);
    CHECK_FALSE(x.progress(7, key, op));  // every part of host a is in, this host's last is not out
    queued = 0;
    CHECK(x.pump(7, find, finished));
    CHECK(sent == std::vector<uint32_t>{0, 1, 2, 3, 4});
    CHECK(finished == std::vector<OpKey>{key});
    CHECK(x.progress(7, key, op));
    uint64_t wrong = 0;
    for (uint64_t i = 0; i < kBlock; ++i) wrong += out[i] != 7 || out[kBlock + i] != static_cast<float>((kBlock + i) % 1000);
    CHECK(wrong == 0);
    CHECK_FALSE(x.sending());
}

// ---------------------------------------------------------------------------------------------
// Doubling and halving-doubling across n in-process hosts: every frame goes through the
// encoder and decoder, delivered in a shuffled order (a partner's step may come before this
// host reached the op or the step), and every value of every host is checked against the exact
// result computed here, with the guard bytes around each op's range and the bits of every host
// compared.

#include <algorithm>
#include <deque>
#include <functional>
#include <random>

#include "bench/bench_data.h"
#include "tests/support/matrix.h"

namespace {

struct Cluster {
    struct Msg {
        uint32_t from, to;
        proto::Bytes frame;
    };
    uint32_t n, local;
    LoopbackTransport transport;
    std::deque<Msg> wire;
    std::vector<std::unique_ptr<DirectExchange>> x;
    std::vector<HostOp> ops;
    size_t frames = 0;

    Cluster(uint32_t hosts, uint32_t local_ranks) : n(hosts), local(local_ranks) {
        std::vector<std::string> names;
        for (uint32_t h = 0; h < n; ++h) names.push_back("h" + std::to_string(h));
        for (uint32_t h = 0; h < n; ++h)
            x.push_back(std::make_unique<DirectExchange>(
                h, names, [this, h](uint32_t to, const proto::Bytes &f) { wire.push_back({h, to, f}); },
                [](uint32_t) { return uint64_t{0}; }));
    }

    // Host `to` takes `bytes` of data of `kind` (step `step`) that host `from` sent with report
    // `rr`, through the encoder and decoder: whether it kept them.
    bool offer(uint32_t to, uint32_t from, const proto::OpReport &rr, proto::OpDataKind kind, uint64_t bytes, uint32_t step = 0) {
        proto::Bytes f = proto::encode_op_data(rr, kind, bytes, step);
        proto::Bytes payload(f.begin() + proto::kFrameHeaderBytes, f.end());
        auto d = proto::decode_op_data(payload);
        REQUIRE(d.ok());
        const proto::OpData data = *d;
        std::string why;
        return x[to]->take_part(from, data, std::move(payload), why);
    }

    // Hosts reach op `key` in a shuffled order (reach(h) contributes host h's data), between
    // deliveries of the frames on the wire in a shuffled order; returns which hosts completed it.
    std::vector<bool> deliver(const OpKey &key, std::mt19937 &rng, const std::function<void(uint32_t)> &reach) {
        std::vector<uint32_t> order(n);
        for (uint32_t h = 0; h < n; ++h) order[h] = h;
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<bool> done(n, false);
        size_t next = 0;
        while (true) {
            if (next < n && (wire.empty() || rng() % 3 == 0)) {
                const uint32_t h = order[next++];
                reach(h);
                done[h] = x[h]->progress(7, key, ops[h]);
                continue;
            }
            if (wire.empty()) break;
            const size_t i = rng() % wire.size();
            Msg m = std::move(wire[i]);
            wire.erase(wire.begin() + static_cast<long>(i));
            ++frames;
            proto::Bytes payload(m.frame.begin() + proto::kFrameHeaderBytes, m.frame.end());
            auto d = proto::decode_op_data(payload);
            REQUIRE(d.ok());
            const proto::OpData data = *d;
            std::string why;
            REQUIRE(x[m.to]->take_part(m.from, data, std::move(payload), why));
            REQUIRE(why.empty());
            if (std::find(order.begin(), order.begin() + static_cast<long>(next), m.to) != order.begin() + static_cast<long>(next))
                done[m.to] = done[m.to] || x[m.to]->progress(7, key, ops[m.to]);
        }
        return done;
    }

    // Runs one op on every host (host h's ranks filled as global ranks h * local + r); returns
    // the wrong values and damaged guard bytes over every host and rank.
    uint64_t run(Algorithm algo, DType t, ReduceOp rop, uint64_t count, uint64_t seq, std::mt19937 &rng,
                 bool &same_bits) {
        const size_t es = dtype_size(t), pad = 64;
        ops.assign(n, {});
        for (uint32_t h = 0; h < n; ++h) {
            HostOp &op = ops[h];
            op.algorithm = algo;
            op.run.group = "g";
            op.run.seq = seq;
            op.run.desc = OpDesc{Collective::Allreduce, t, rop, count, 0};
            for (uint32_t r = 0; r < local; ++r) {
                auto s = Slot::create("t", count * es + 2 * pad, transport);
                REQUIRE(s.ok());
                op.slots.push_back(*s);
                op.run.members.push_back({});
                op.run.offsets.push_back(pad);
                std::byte *base = (*s)->data();
                bench::guard_fill(base, 0, pad, seq);
                bench::fill(base + pad, count, t, h * local + r);
                bench::guard_fill(base, pad + count * es, count * es + 2 * pad, seq);
            }
        }
        const OpKey key{"g", 5, seq};
        std::vector<bool> done = deliver(key, rng, [&](uint32_t h) {
            proto::OpReport r{7, "g", seq, count, static_cast<uint32_t>(t), static_cast<uint32_t>(rop), local, 0, "",
                              static_cast<uint32_t>(algo), 5, 1000};
            x[h]->contribute(ops[h], r);
        });
        uint64_t wrong = 0;
        same_bits = true;
        for (uint32_t h = 0; h < n; ++h) {
            CHECK(done[h]);
            x[h]->drop(7, key);
            for (uint32_t r = 0; r < local; ++r) {
                const std::byte *base = ops[h].slots[r]->data();
                wrong += bench::count_wrong(base + pad, count, t, rop, uint64_t{n} * local);
                wrong += bench::guard_damage(base, 0, pad, seq) + bench::guard_damage(base, pad + count * es, count * es + 2 * pad, seq);
                same_bits &= std::memcmp(base + pad, ops[0].slots[0]->data() + pad, count * es) == 0;
            }
        }
        for (uint32_t h = 0; h < n; ++h) CHECK(x[h]->backlog(h == 0 ? 1 : 0) == 0);
        return wrong;
    }

    // One-shot reduce_scatter or allgather: host h has host_ranks[h].size() ranks, numbered by
    // host_ranks (any permutation of the group's ranks); rank q's block is block q. `in_place`:
    // each rank's own block inside its buffer with a block per rank (its output, resp. input).
    // Returns the wrong values, damaged guard bytes and (allgather) changed input values.
    uint64_t run_collective(Collective coll, DType t, ReduceOp rop, uint64_t count, uint64_t seq,
                            const std::vector<std::vector<uint32_t>> &host_ranks, bool in_place, std::mt19937 &rng) {
        const bool rs = coll == Collective::ReduceScatter;
        const size_t es = dtype_size(t), pad = 64;
        uint64_t nranks = 0;
        for (const auto &h : host_ranks) nranks += h.size();
        const uint64_t full = count * nranks, in = rs ? full : count, out = rs ? count : full;
        const uint64_t region = (in_place ? full : in + out) * es;
        ops.assign(n, {});
        for (uint32_t h = 0; h < n; ++h) {
            HostOp &op = ops[h];
            op.algorithm = Algorithm::OneShot;
            op.run.group = "g";
            op.run.seq = seq;
            op.run.desc = OpDesc{coll, t, rs ? rop : ReduceOp::Sum, count, static_cast<uint32_t>(nranks)};
            op.run.ranks = host_ranks[h];
            for (uint32_t q : host_ranks[h]) {
                auto sl = Slot::create("t", region + 2 * pad, transport);
                REQUIRE(sl.ok());
                op.slots.push_back(*sl);
                op.run.members.push_back({});
                const uint64_t own = uint64_t{q} * count * es;
                op.run.offsets.push_back(pad + (in_place && !rs ? own : 0));
                op.run.out_offsets.push_back(pad + (in_place ? (rs ? own : 0) : in * es));
                std::byte *base = (*sl)->data();
                bench::guard_fill(base, 0, pad, seq);
                bench::guard_fill(base, pad, pad + region, seq + 1);  // the output's old bytes
                bench::fill(base + op.run.offsets.back(), in, t, q);
                bench::guard_fill(base, pad + region, region + 2 * pad, seq);
            }
        }
        const OpKey key{"g", 5, seq};
        std::vector<bool> done = deliver(key, rng, [&](uint32_t h) {
            proto::OpReport r{7, "g", seq, count, static_cast<uint32_t>(t), static_cast<uint32_t>(ops[h].run.desc.op),
                              static_cast<uint32_t>(host_ranks[h].size()), 0, "", static_cast<uint32_t>(Algorithm::OneShot), 5, 1000};
            r.collective = static_cast<uint32_t>(coll);
            x[h]->contribute(ops[h], r, host_ranks);
        });
        uint64_t wrong = 0;
        std::vector<std::byte> want(count * es);
        for (uint32_t h = 0; h < n; ++h) {
            CHECK(done[h]);
            x[h]->drop(7, key);
            for (size_t j = 0; j < host_ranks[h].size(); ++j) {
                const uint32_t q = host_ranks[h][j];
                const std::byte *base = ops[h].slots[j]->data();
                const std::byte *res = base + ops[h].run.out_offsets[j];
                if (rs) {
                    wrong += bench::count_wrong_at(res, count, t, rop, nranks, uint64_t{q} * count);
                } else {
                    for (uint64_t b = 0; b < nranks; ++b) {
                        bench::fill(want.data(), count, t, b);
                        for (uint64_t i = 0; i < count; ++i)
                            wrong += std::memcmp(res + (b * count + i) * es, want.data() + i * es, es) != 0;
                    }
                }
                wrong += bench::guard_damage(base, 0, pad, seq) + bench::guard_damage(base, pad + region, region + 2 * pad, seq);
                if (!in_place) {
                    // The rest of the region is the other range: reduce_scatter's input may hold
                    // partials; allgather's input is only read.
                    if (!rs) {
                        bench::fill(want.data(), count, t, q);
                        wrong += std::memcmp(base + ops[h].run.offsets[j], want.data(), count * es) != 0;
                    }
                }
            }
        }
        for (uint32_t h = 0; h < n; ++h)
            for (uint32_t p = 0; p < n; ++p) CHECK(x[h]->backlog(p) == 0);
        return wrong;
    }
};

}  // namespace

TEST_CASE("doubling and halving-doubling: every dtype and op exact on every host, the same bits everywhere, for "
          "host counts that are and are not powers of two",
          "[exchange]") {
    std::mt19937 rng(12345);
    const std::vector<uint32_t> hosts = test::full_matrix() ? std::vector<uint32_t>{2, 3, 4, 5, 6, 7, 8, 11, 16}
                                                            : std::vector<uint32_t>{2, 3, 5, 8, 13};
    for (uint32_t n : hosts) {
        for (uint32_t local : {1u, 2u}) {
            Cluster c(n, local);
            uint64_t seq = 1;
            for (Algorithm algo : {Algorithm::Doubling, Algorithm::HalvingDoubling})
                for (DType t : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64})
                    for (ReduceOp rop : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max})
                        // Counts below, at and above the host count (empty blocks), and odd ones.
                        for (uint64_t count : {uint64_t{1}, uint64_t{n} - 1, uint64_t{n} + 3, uint64_t{1031}}) {
                            const bool integer = t == DType::I32 || t == DType::I64;
                            if (count == 0 || (integer && rop == ReduceOp::Avg)) continue;  // (avg of integers is refused)
                            bool same = false;
                            INFO(n << " hosts x " << local << ", " << algorithm_name(algo) << ", dtype " << static_cast<int>(t)
                                   << ", op " << static_cast<int>(rop) << ", " << count << " elements");
                            CHECK(c.run(algo, t, rop, count, seq++, rng, same) == 0);
                            CHECK(same);
                        }
        }
    }
}

TEST_CASE("doubling sends log2 p frames per host and op, halving-doubling 2 log2 p; the extra hosts of a count "
          "that is not a power of two one each way",
          "[exchange]") {
    std::mt19937 rng(7);
    bool same = false;
    for (uint32_t n : {2u, 4u, 8u, 16u}) {
        Cluster c(n, 1);
        const uint32_t steps = static_cast<uint32_t>(std::log2(n));
        REQUIRE(c.run(Algorithm::Doubling, DType::F32, ReduceOp::Sum, 1024, 1, rng, same) == 0);
        CHECK(c.frames == size_t{n} * steps);
        c.frames = 0;
        REQUIRE(c.run(Algorithm::HalvingDoubling, DType::F32, ReduceOp::Sum, 1024, 2, rng, same) == 0);
        CHECK(c.frames == size_t{n} * 2 * steps);
    }
    Cluster c(6, 1);  // p = 4: hosts 1 and 3 fold into 0 and 2
    REQUIRE(c.run(Algorithm::Doubling, DType::F32, ReduceOp::Sum, 100, 1, rng, same) == 0);
    CHECK(c.frames == 4 * 2 + 2 * 2);
}

TEST_CASE("doubling: data from a host that is not this step's partner, or of the wrong length, is dropped; a "
          "partner's op that differs stops the op here as a mismatch",
          "[exchange]") {
    Cluster c(4, 1);
    LoopbackTransport t;
    // Host 0's partner in step 0 is host 1, in step 1 host 2.
    proto::OpReport r{7, "g", 1, 16, static_cast<uint32_t>(DType::F32), static_cast<uint32_t>(ReduceOp::Sum), 1, 0, "",
                      static_cast<uint32_t>(Algorithm::Doubling), 5, 1000};
    auto offer = [&](uint32_t from, proto::OpDataKind kind, uint32_t step, const proto::OpReport &rr, uint64_t bytes) {
        return c.offer(0, from, rr, kind, bytes, step);
    };
    CHECK_FALSE(offer(2, proto::OpDataKind::Doubling, 0, r, 64));  // step 0 comes from host 1
    CHECK_FALSE(offer(1, proto::OpDataKind::FoldIn, 0, r, 64));    // 4 hosts: nobody folds
    CHECK(offer(1, proto::OpDataKind::Doubling, 0, r, 64));
    CHECK_FALSE(offer(1, proto::OpDataKind::Doubling, 0, r, 64));  // a duplicate
    proto::OpReport other = r;
    other.count = 8;
    CHECK(offer(2, proto::OpDataKind::Doubling, 1, other, 32));  // host 2 runs another op as op 1
    // Host 0 reaches op 1 (16 elements): step 0 combines, step 1 finds host 2's op differs.
    HostOp op;
    op.algorithm = Algorithm::Doubling;
    op.run.group = "g";
    op.run.seq = 1;
    op.run.desc.count = 16;
    auto s = Slot::create("t", 64, t);
    REQUIRE(s.ok());
    op.slots.push_back(*s);
    op.run.members.push_back({});
    op.run.offsets.push_back(0);
    c.x[0]->contribute(op, r);
    CHECK_FALSE(c.x[0]->progress(7, OpKey{"g", 5, 1}, op));
    CHECK(c.x[0]->mismatched(7, OpKey{"g", 5, 1}));
    c.x[0]->drop(7, OpKey{"g", 5, 1});
    CHECK(c.x[0]->backlog(1) == 0);
    CHECK(c.x[0]->backlog(2) == 0);
}

TEST_CASE("one-shot reduce_scatter and allgather: every dtype and op exact on every rank, uneven ranks per host "
          "numbered unlike the hosts, in place and apart, the bytes around them untouched",
          "[exchange]") {
    std::mt19937 rng(4242);
    const std::vector<uint32_t> hosts = test::full_matrix() ? std::vector<uint32_t>{2, 3, 4, 5, 8} : std::vector<uint32_t>{2, 3, 5};
    for (uint32_t n : hosts) {
        // Host h has 1 + h % 3 ranks; the group's ranks dealt to the hosts shuffled.
        std::vector<std::vector<uint32_t>> host_ranks(n);
        uint32_t nranks = 0;
        for (uint32_t h = 0; h < n; ++h) nranks += 1 + h % 3;
        std::vector<uint32_t> perm(nranks);
        for (uint32_t q = 0; q < nranks; ++q) perm[q] = q;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (uint32_t h = 0, k = 0; h < n; ++h)
            for (uint32_t r = 0; r <= h % 3; ++r) host_ranks[h].push_back(perm[k++]);
        Cluster c(n, 1);
        uint64_t seq = 1;
        for (Collective coll : {Collective::ReduceScatter, Collective::Allgather})
            for (DType t : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64})
                for (ReduceOp rop : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max}) {
                    const bool integer = t == DType::I32 || t == DType::I64;
                    if ((integer && rop == ReduceOp::Avg) || (coll == Collective::Allgather && rop != ReduceOp::Sum)) continue;
                    for (uint64_t count : {uint64_t{1}, uint64_t{257}})
                        for (bool in_place : {false, true}) {
                            INFO(n << " hosts, " << nranks << " ranks, " << describe(OpDesc{coll, t, rop, count, nranks})
                                   << (in_place ? ", in place" : ", apart"));
                            CHECK(c.run_collective(coll, t, rop, count, seq++, host_ranks, in_place, rng) == 0);
                        }
                }
    }
}

TEST_CASE("one-shot reduce_scatter and allgather send one frame to each other host, of only what it needs; a "
          "peer's message of another collective stops the op as a mismatch for the coordinator, one that the rank "
          "map does not account for as malformed, naming the host",
          "[exchange]") {
    std::mt19937 rng(99);
    const std::vector<std::vector<uint32_t>> host_ranks{{3, 0}, {1}, {4, 2, 5}};
    Cluster c(3, 1);
    REQUIRE(c.run_collective(Collective::ReduceScatter, DType::F32, ReduceOp::Sum, 100, 1, host_ranks, false, rng) == 0);
    CHECK(c.frames == 3 * 2);
    c.frames = 0;
    REQUIRE(c.run_collective(Collective::Allgather, DType::BF16, ReduceOp::Sum, 100, 2, host_ranks, true, rng) == 0);
    CHECK(c.frames == 3 * 2);
    c.wire.clear();
    // Host 0 (ranks 3 and 0 of 6) runs op `seq` (reduce_scatter of 10 floats per rank, or an
    // allreduce of 10) and gets its peers' messages of it.
    LoopbackTransport t;
    auto report = [](uint64_t seq, Collective coll, uint32_t local_size) {
        proto::OpReport r{7, "g", seq, 10, static_cast<uint32_t>(DType::F32), static_cast<uint32_t>(ReduceOp::Sum), local_size, 0, "",
                          static_cast<uint32_t>(Algorithm::OneShot), 5, 1000};
        r.collective = static_cast<uint32_t>(coll);
        return r;
    };
    auto offer = [&](uint32_t from, const proto::OpReport &rr, uint64_t bytes) {
        return c.offer(0, from, rr, proto::OpDataKind::OneShot, bytes);
    };
    // What host 0 makes of op `seq`: its mismatch and why; every peer's data dropped after.
    auto run = [&](uint64_t seq, Collective coll, std::span<const std::vector<uint32_t>> ranks) {
        HostOp op;
        op.algorithm = Algorithm::OneShot;
        op.run.group = "g";
        op.run.seq = seq;
        const bool ar = coll == Collective::Allreduce;
        op.run.desc = OpDesc{coll, DType::F32, ReduceOp::Sum, 10, ar ? 0u : 6u};
        op.run.ranks = host_ranks[0];
        for (int i = 0; i < (ar ? 1 : 2); ++i) {
            auto s = Slot::create("t", 4096, t);
            REQUIRE(s.ok());
            op.slots.push_back(*s);
            op.run.members.push_back({});
            op.run.offsets.push_back(0);
            op.run.out_offsets.push_back(ar ? 0 : 2048);
        }
        c.x[0]->contribute(op, report(seq, coll, ar ? 1 : 2), ranks);
        const bool done = c.x[0]->progress(7, OpKey{"g", 5, seq}, op);
        std::pair<bool, std::string> out{c.x[0]->mismatched(7, OpKey{"g", 5, seq}), c.x[0]->malformed(7, OpKey{"g", 5, seq})};
        CHECK_FALSE(done);
        c.x[0]->drop(7, OpKey{"g", 5, seq});
        CHECK(c.x[0]->backlog(1) == 0);
        CHECK(c.x[0]->backlog(2) == 0);
        return out;
    };
    const auto rs = Collective::ReduceScatter;
    // Op 3: host 1's message holds one block where host 0 needs two (kept: its size is checked
    // against the rank map when it is used).
    CHECK(offer(1, report(3, rs, 1), 1 * 10 * 4));
    CHECK(offer(2, report(3, rs, 3), 2 * 10 * 4));
    CHECK(run(3, rs, host_ranks) == std::pair<bool, std::string>{
                                        true, "group g op 3: host h1 sent a reduce_scatter message of 40 bytes, not the 80 the rank map says"});
    // Op 4: host 2 runs an allgather: the reports differ, the coordinator names both.
    CHECK(offer(1, report(4, rs, 1), 2 * 10 * 4));
    CHECK(offer(2, report(4, Collective::Allgather, 3), 3 * 10 * 4));
    CHECK(run(4, rs, host_ranks) == std::pair<bool, std::string>{true, ""});
    // Op 5: host 2 says it has 2 ranks, the rank map 3.
    CHECK(offer(1, report(5, rs, 1), 2 * 10 * 4));
    CHECK(offer(2, report(5, rs, 2), 2 * 10 * 4));
    CHECK(run(5, rs, host_ranks) == std::pair<bool, std::string>{
                                        true, "group g op 5: host h2 says it has 2 rank(s), the group's rank map 3"});
    // Op 6: host 0 runs an allreduce; host 1's data is a reduce_scatter's of no block (an empty
    // message, which allreduce's one-shot must not read 40 bytes of).
    CHECK(offer(1, report(6, rs, 1), 0));
    CHECK(offer(2, report(6, Collective::Allreduce, 3), 10 * 4));
    CHECK(run(6, Collective::Allreduce, {}) == std::pair<bool, std::string>{true, ""});
    // Op 7: host 0 has no rank map of every host: it sends nothing and the op is malformed here.
    c.wire.clear();
    CHECK(run(7, rs, std::span(host_ranks).first(2)) ==
          std::pair<bool, std::string>{true, "group g op 7: host h0 has no rank map of every host of the ring for its reduce_scatter"});
    CHECK(c.wire.empty());
    // all_to_all, 10 floats per block: host 1 (rank 1) owes host 0 (ranks 3, 0) its 2 counts and
    // 2 blocks, 96 bytes, in one part. Op 8: 200 bytes of zeros; op 9: a message of 2 parts; op 10:
    // the right size but counts of 0 (rank 1 sends rank 3 no elements, which expects 10).
    const auto a2a = Collective::AllToAll;
    auto offer_part = [&](uint32_t from, const proto::OpReport &rr, uint64_t bytes, uint32_t parts, uint32_t part) {
        return c.offer(0, from, rr, proto::OpDataKind::OneShot, bytes, parts << 16 | part);
    };
    CHECK(offer_part(1, report(8, a2a, 1), 200, 1, 0));
    CHECK(offer_part(2, report(8, a2a, 3), 3 * 2 * 8 + 3 * 2 * 10 * 4, 1, 0));
    // (Its counts come first, and are checked before anything else of it is read.)
    CHECK(run(8, a2a, host_ranks) ==
          std::pair<bool, std::string>{true, "group g op 8: all_to_all: rank 1 (host h1) sends rank 3 0 elements, and rank 3 (host "
                                             "h0) expects 10"});
    CHECK(offer_part(1, report(9, a2a, 1), 48, 2, 0));
    CHECK(run(9, a2a, host_ranks) == std::pair<bool, std::string>{
                                         true, "group g op 9: host h1 sent an all_to_all message of 2 part(s), not the 96 bytes its "
                                               "ranks' counts say"});
    CHECK(offer_part(1, report(10, a2a, 1), 96, 1, 0));
    CHECK(offer_part(2, report(10, a2a, 3), 3 * 2 * 8 + 3 * 2 * 10 * 4, 1, 0));
    CHECK(run(10, a2a, host_ranks) ==
          std::pair<bool, std::string>{true, "group g op 10: all_to_all: rank 1 (host h1) sends rank 3 0 elements, and rank 3 (host "
                                             "h0) expects 10"});
    // Once host 0 has contributed, a part that its ranks' counts do not expect is not kept.
    HostOp op;
    op.algorithm = Algorithm::OneShot;
    op.run.group = "g";
    op.run.seq = 11;
    op.run.desc = OpDesc{a2a, DType::F32, ReduceOp::Sum, 10, 6u};
    op.run.ranks = host_ranks[0];
    for (int i = 0; i < 2; ++i) {
        auto sl = Slot::create("t", 4096, t);
        REQUIRE(sl.ok());
        op.slots.push_back(*sl);
        op.run.members.push_back({});
        op.run.offsets.push_back(0);
        op.run.out_offsets.push_back(2048);
    }
    c.x[0]->contribute(op, report(11, a2a, 2), host_ranks);
    CHECK_FALSE(offer_part(1, report(11, a2a, 1), 1 << 20, 2, 1));
    CHECK(c.x[0]->backlog(1) == 0);
    CHECK(c.x[0]->malformed(7, OpKey{"g", 5, 11}) ==
          "group g op 11: host h1 sent all_to_all part 1 of 2 with 1048576 bytes of a message this host expects to hold 96 bytes");
    c.x[0]->drop(7, OpKey{"g", 5, 11});
    // Host 0's own ranks disagree on a pair's size (rank 3 sends rank 0 5 elements, rank 0 expects
    // 10): its op fails here, and nothing a peer sends for it after that is kept.
    op.run.seq = 12;
    std::vector<uint64_t> three(12, 10), zero(12, 10);
    three[0] = 5;  // rank 3's send count to rank 0
    op.run.splits = {std::make_shared<const std::vector<uint64_t>>(three), std::make_shared<const std::vector<uint64_t>>(zero)};
    c.x[0]->contribute(op, report(12, a2a, 2), host_ranks);
    CHECK(c.x[0]->malformed(7, OpKey{"g", 5, 12}) ==
          "group g op 12: all_to_all: rank 3 sends rank 0 5 elements, and rank 0 expects 10");
    CHECK_FALSE(offer_part(1, report(12, a2a, 1), 96, 1, 0));
    CHECK_FALSE(offer_part(2, report(12, a2a, 3), 4 << 20, 2, 1));
    CHECK(c.x[0]->backlog(1) == 0);
    CHECK(c.x[0]->backlog(2) == 0);
    c.x[0]->drop(7, OpKey{"g", 5, 12});
}
