// proto/: exact bytes of every frame, and rejection of malformed input.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>

#include "proto/frame.h"
#include "proto/le.h"
#include "proto/peer.h"
#include "proto/rdma.h"
#include "proto/slot.h"

using namespace ringd;
using namespace ringd::proto;

namespace {

// Frames between daemons (type 16 and above) carry the peer protocol's version, 6.
Bytes header_bytes(uint16_t type, uint32_t len) {
    return {0x52, 0x4E, 0x47, 0x44, static_cast<uint8_t>(type >= 16 ? 0x06 : 0x01), 0x00, static_cast<uint8_t>(type), 0x00, static_cast<uint8_t>(len),
            static_cast<uint8_t>(len >> 8), static_cast<uint8_t>(len >> 16), static_cast<uint8_t>(len >> 24), 0, 0, 0, 0};
}

Bytes cat(Bytes a, const Bytes &b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

std::span<const uint8_t> payload_of(const Bytes &frame) { return std::span(frame).subspan(kFrameHeaderBytes); }
Bytes body_of(const Bytes &frame) { return Bytes(frame.begin() + kFrameHeaderBytes, frame.end()); }

RdmaLinkInfo sample_link_info() {
    RdmaLinkInfo i;
    i.qps = 2;
    i.fifo_entries = 128;
    i.lid = 0x1234;
    i.mtu = 5;  // IBV_MTU_4096
    i.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1};
    i.fifo_addr = 0x00007f0011223340;
    i.fifo_rkey = 0xabcd5a;
    i.qpn[0] = 0x101;
    i.psn[0] = 0xfffffe;
    i.qpn[1] = 0x102;
    i.psn[1] = 7;
    return i;
}

}  // namespace

TEST_CASE("hello frame bytes are pinned", "[proto]") {
    const Bytes f = encode_hello({"g1", 1, 2, 4096, ""});
    Bytes payload = {1, 0, 0, 0, 2, 0, 0, 0, 0x00, 0x10, 0, 0, 0, 0, 0, 0, 'g', '1'};
    payload.resize(kHelloBytes, 0);
    CHECK(f == cat(header_bytes(1, 80), payload));
    auto h = decode_hello(payload_of(f));
    REQUIRE(h.ok());
    CHECK(h->group == "g1");
    CHECK(h->local_rank == 1);
    CHECK(h->local_size == 2);
    CHECK(h->slot_bytes == 4096);
}

TEST_CASE("a hello may carry the group's hosts after its fixed part", "[proto]") {
    const Bytes f = encode_hello({"g1", 0, 1, 4096, "node1, node0"});
    Bytes payload = {0, 0, 0, 0, 1, 0, 0, 0, 0x00, 0x10, 0, 0, 0, 0, 0, 0, 'g', '1'};
    payload.resize(kHelloBytes, 0);
    for (char ch : std::string("node1, node0")) payload.push_back(static_cast<uint8_t>(ch));
    CHECK(f == cat(header_bytes(1, static_cast<uint32_t>(kHelloBytes + 12)), payload));
    auto h = decode_hello(payload_of(f));
    REQUIRE(h.ok());
    CHECK(h->hosts == "node1, node0");
    CHECK(decode_hello(payload_of(encode_hello({"g1", 0, 1, 4096, ""}))).value().hosts.empty());
    // HelloShared: the client id first, then a hello (with or without hosts).
    const Bytes shared = encode_hello({"g2", 1, 2, 4096, "node1", 7});
    CHECK(decode_frame_header(std::span(shared).first(kFrameHeaderBytes), kMaxClientPayload)->type == FrameType::HelloShared);
    auto sh = decode_hello_shared(payload_of(shared));
    REQUIRE(sh.ok());
    CHECK((sh->share_with == 7 && sh->group == "g2" && sh->local_rank == 1 && sh->hosts == "node1"));
    CHECK_FALSE(decode_hello_shared(payload_of(encode_hello({"g2", 0, 1, 4096, ""}))).ok());  // client 0 names none
    Bytes bad = payload;
    bad.back() = ';';
    CHECK_THAT(decode_hello(bad).error().message, Catch::Contains("may contain only host names"));
    bad.back() = '\0';
    CHECK_FALSE(decode_hello(bad).ok());
    Bytes big = payload;
    big.resize(kHelloBytes + kMaxHelloHostsBytes + 1, 'a');
    CHECK_THAT(decode_hello(big).error().message, Catch::Contains("hosts list is longer than"));
    big.resize(kHelloBytes + kMaxHelloHostsBytes + kHelloRanksBytes + 1, 'a');
    CHECK_THAT(decode_hello(big).error().message, Catch::Contains("hello has"));
}

TEST_CASE("welcome frame bytes are pinned", "[proto]") {
    Welcome w{7, 64, 64, 30000, 0x12000, 0x9000, 0x9000};
    const Bytes f = encode_welcome(w);
    const Bytes payload = {7, 0, 0, 0,  64, 0, 0, 0,  64, 0, 0, 0,  0x30, 0x75, 0, 0,
                           0, 0x20, 1, 0, 0, 0, 0, 0,  0, 0x90, 0, 0, 0, 0, 0, 0,
                           0, 0x90, 0, 0, 0, 0, 0, 0,  0, 0, 0, 0, 0, 0, 0, 0};
    CHECK(f == cat(header_bytes(2, 48), payload));
    auto d = decode_welcome(payload_of(f));
    REQUIRE(d.ok());
    CHECK(d->client_id == 7);
    CHECK(d->op_timeout_ms == 30000);
    CHECK(d->map_bytes == 0x12000);
    CHECK(d->data_offset == 0x9000);
}

TEST_CASE("error, status request and status reply frame bytes are pinned", "[proto]") {
    const Bytes e = encode_error({-22, "bad"});
    CHECK(e == cat(header_bytes(3, 11), Bytes{0xEA, 0xFF, 0xFF, 0xFF, 3, 0, 0, 0, 'b', 'a', 'd'}));
    auto de = decode_error(payload_of(e));
    REQUIRE(de.ok());
    CHECK(de->code == -22);
    CHECK(de->message == "bad");

    CHECK(encode_status_request({}) == cat(header_bytes(4, 4), Bytes{0, 0, 0, 0}));
    CHECK(encode_status_reply("{}") == cat(header_bytes(5, 2), Bytes{'{', '}'}));
}

CudaRegister sample_cuda_register() {
    CudaRegister r;
    r.kind = CudaMemoryKind::LegacyIpc;
    for (int i = 0; i < 16; ++i) r.device_uuid[i] = static_cast<uint8_t>(0xA0 + i);
    r.alloc_bytes = 0x400000;
    r.offset = 0x1000;
    r.bytes = 0x2000;
    r.client_ptr = 0x7f0000001000;
    for (size_t i = 0; i < kCudaIpcHandleBytes; ++i) r.ipc_handle[i] = static_cast<uint8_t>(i);
    return r;
}

TEST_CASE("CUDA register, unregister and reply frame bytes are pinned", "[proto]") {
    const Bytes f = encode_cuda_register(sample_cuda_register());
    REQUIRE(f.size() == kFrameHeaderBytes + kCudaRegisterBytes);
    CHECK(Bytes(f.begin(), f.begin() + kFrameHeaderBytes) == header_bytes(6, 128));
    const Bytes head = {2, 0, 0, 0, 0, 0, 0, 0, 0xA0, 0xA1, 0xA2, 0xA3, 0xA4, 0xA5, 0xA6, 0xA7,
                        0xA8, 0xA9, 0xAA, 0xAB, 0xAC, 0xAD, 0xAE, 0xAF, 0, 0, 0x40, 0, 0, 0, 0, 0,
                        0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0x20, 0, 0, 0, 0, 0, 0};
    CHECK(Bytes(f.begin() + kFrameHeaderBytes, f.begin() + kFrameHeaderBytes + 48) == head);
    CHECK(f[kFrameHeaderBytes + 56 + 63] == 63);
    auto d = decode_cuda_register(payload_of(f));
    REQUIRE(d.ok());
    CHECK(d->kind == CudaMemoryKind::LegacyIpc);
    CHECK(d->bytes == 0x2000);
    CHECK(d->client_ptr == 0x7f0000001000);

    CHECK(encode_cuda_unregister(5) == cat(header_bytes(7, 8), Bytes{5, 0, 0, 0, 0, 0, 0, 0}));
    CHECK(encode_cuda_reply({-2, 9, "no"}) ==
          cat(header_bytes(8, 18), Bytes{0xFE, 0xFF, 0xFF, 0xFF, 2, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 'n', 'o'}));
}

TEST_CASE("CUDA register payloads are validated", "[proto]") {
    CudaRegister r = sample_cuda_register();
    SECTION("unknown kind") {
        Bytes f = encode_cuda_register(r);
        f[kFrameHeaderBytes] = 3;
        CHECK_THAT(decode_cuda_register(payload_of(f)).error().message, Catch::Contains("unknown memory kind"));
    }
    SECTION("range outside the allocation") {
        r.offset = r.alloc_bytes - 1;
        CHECK_THAT(decode_cuda_register(payload_of(encode_cuda_register(r))).error().message, Catch::Contains("outside"));
        r.offset = UINT64_MAX;
        CHECK_FALSE(decode_cuda_register(payload_of(encode_cuda_register(r))).ok());
    }
    SECTION("empty range") {
        r.bytes = 0;
        CHECK_FALSE(decode_cuda_register(payload_of(encode_cuda_register(r))).ok());
    }
    SECTION("reserved bytes") {
        Bytes f = encode_cuda_register(r);
        f[kFrameHeaderBytes + 127] = 1;
        CHECK_FALSE(decode_cuda_register(payload_of(f)).ok());
    }
    SECTION("replies") {
        Bytes f = encode_cuda_reply({-5, 1, "x"});
        f.pop_back();
        CHECK_FALSE(decode_cuda_reply(payload_of(f)).ok());
        CHECK_FALSE(decode_cuda_reply(payload_of(encode_cuda_reply({5, 1, ""}))).ok());
    }
}

TEST_CASE("frame headers are validated", "[proto]") {
    Bytes h = header_bytes(1, 80);
    CHECK(decode_frame_header(h, kMaxClientPayload).ok());

    SECTION("short header") { CHECK_FALSE(decode_frame_header(std::span(h).first(15), kMaxClientPayload).ok()); }
    SECTION("bad magic") {
        h[0] = 'X';
        auto r = decode_frame_header(h, kMaxClientPayload);
        REQUIRE_FALSE(r.ok());
        CHECK_THAT(r.error().message, Catch::Contains("magic"));
    }
    SECTION("wrong version") {
        h[4] = 9;
        auto r = decode_frame_header(h, kMaxClientPayload);
        REQUIRE_FALSE(r.ok());
        CHECK(r.error().code == -EPROTONOSUPPORT);
    }
    SECTION("unknown type") {
        h[6] = 0;
        CHECK_FALSE(decode_frame_header(h, kMaxClientPayload).ok());
        h[6] = 99;
        CHECK_FALSE(decode_frame_header(h, kMaxClientPayload).ok());
    }
    SECTION("length over the cap is refused before anything is allocated") {
        h = header_bytes(1, 0xFFFFFFFF);
        auto r = decode_frame_header(h, kMaxClientPayload);
        REQUIRE_FALSE(r.ok());
        CHECK(r.error().code == -EMSGSIZE);
        CHECK_THAT(r.error().message, Catch::Contains("4294967295"));
    }
    SECTION("reserved bytes") {
        h[15] = 1;
        CHECK_FALSE(decode_frame_header(h, kMaxClientPayload).ok());
    }
}

TEST_CASE("hello payloads are validated", "[proto]") {
    Bytes f = encode_hello({"grp", 0, 4, 1 << 20, ""});
    Bytes p(f.begin() + kFrameHeaderBytes, f.end());
    REQUIRE(decode_hello(p).ok());

    SECTION("wrong size") {
        p.pop_back();
        CHECK_FALSE(decode_hello(p).ok());
    }
    SECTION("rank not below size") {
        p[0] = 4;
        CHECK_THAT(decode_hello(p).error().message, Catch::Contains("local_rank 4"));
    }
    SECTION("size zero or too large") {
        p[4] = 0;
        CHECK_FALSE(decode_hello(p).ok());
        p[4] = 0;
        p[5] = 1;  // 256
        CHECK_FALSE(decode_hello(p).ok());
    }
    SECTION("slot size zero") {
        std::memset(&p[8], 0, 8);
        CHECK_FALSE(decode_hello(p).ok());
    }
    SECTION("group without NUL, with junk after NUL, empty, or with bad characters") {
        Bytes q = p;
        std::memset(&q[16], 'a', kGroupNameBytes);
        CHECK_FALSE(decode_hello(q).ok());
        q = p;
        q[16 + 10] = 'x';
        CHECK_FALSE(decode_hello(q).ok());
        q = p;
        q[16] = 0;
        CHECK_FALSE(decode_hello(q).ok());
        q = p;
        q[16] = '/';
        CHECK_FALSE(decode_hello(q).ok());
    }
}

TEST_CASE("error and welcome payloads are validated", "[proto]") {
    CHECK_FALSE(decode_error(Bytes{1, 2, 3}).ok());
    CHECK_FALSE(decode_error(Bytes{0xEA, 0xFF, 0xFF, 0xFF, 5, 0, 0, 0, 'a'}).ok());        // length mismatch
    CHECK_FALSE(decode_error(Bytes{0xEA, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0}).ok());       // over 1024
    CHECK_FALSE(decode_error(Bytes{1, 0, 0, 0, 0, 0, 0, 0}).ok());                         // positive code
    Bytes w = encode_welcome({1, 64, 64, 1, 0x2000, 0x3000, 0x10});
    CHECK_FALSE(decode_welcome(payload_of(w)).ok());  // data offset beyond the mapping
    w = encode_welcome({1, 0, 64, 1, 0x20000, 0x9000, 0x10});
    CHECK_FALSE(decode_welcome(payload_of(w)).ok());  // empty queue
    // flags: 0 (status), 1 (drain), 2 (undrain), 4 (reload); anything else is refused.
    CHECK(decode_status_request(Bytes{0, 0, 0, 0})->flags == 0);
    CHECK(decode_status_request(Bytes{1, 0, 0, 0})->flags == kStatusDrain);
    CHECK(decode_status_request(Bytes{2, 0, 0, 0})->flags == kStatusUndrain);
    CHECK(decode_status_request(Bytes{4, 0, 0, 0})->flags == kStatusReload);
    CHECK_FALSE(decode_status_request(Bytes{3, 0, 0, 0}).ok());
    CHECK_FALSE(decode_status_request(Bytes{5, 0, 0, 0}).ok());
    CHECK_FALSE(decode_status_request(Bytes{0, 0, 0, 1}).ok());
}

TEST_CASE("slot geometry", "[proto]") {
    auto g = slot_geometry(1000);
    REQUIRE(g.ok());
    CHECK(g->sq_offset == 4096);
    CHECK(g->cq_offset == 4096 + 64 * 256);
    CHECK(g->data_offset % 4096 == 0);
    CHECK(g->data_offset >= g->cq_offset + 64 * 256);
    CHECK(g->map_bytes == g->data_offset + 4096);
    CHECK_FALSE(slot_geometry(0).ok());
    CHECK_FALSE(slot_geometry(UINT64_MAX - 100).ok());
}

TEST_CASE("submit descriptors are validated with overflow-safe bounds", "[proto]") {
    SubmitDesc d{};
    d.seq = 3;
    d.count = 256;
    d.dtype = static_cast<uint32_t>(DType::F32);
    d.op = static_cast<uint32_t>(ReduceOp::Sum);
    d.offset = 0;
    auto s = validate_submit(d, 1024, false);
    REQUIRE(s.ok());
    CHECK(s->bytes == 1024);

    SECTION("past the end") {
        d.offset = 4;
        auto r = validate_submit(d, 1024, false);
        REQUIRE_FALSE(r.ok());
        CHECK(r.error().code == -ERANGE);
    }
    SECTION("count * size overflows") {
        d.count = UINT64_MAX / 2;
        CHECK(validate_submit(d, 1024, false).error().code == -EOVERFLOW);
    }
    SECTION("offset + bytes overflows") {
        d.offset = UINT64_MAX - 3;
        d.count = 2;
        CHECK_FALSE(validate_submit(d, 1024, false).ok());
    }
    SECTION("misaligned offset") {
        d.count = 1;
        d.offset = 2;
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("multiple"));
    }
    SECTION("unknown dtype, op, kind, flags") {
        d.dtype = 6;
        CHECK_FALSE(validate_submit(d, 1024, false).ok());
        d.dtype = 0;
        d.op = 4;
        CHECK_FALSE(validate_submit(d, 1024, false).ok());
        d.op = 0;
        d.buffer_kind = 2;
        CHECK_FALSE(validate_submit(d, 1024, false).ok());
        d.buffer_kind = 0;
        d.flags = 1;
        CHECK_FALSE(validate_submit(d, 1024, false).ok());
    }
    SECTION("avg of integers") {
        d.dtype = static_cast<uint32_t>(DType::I32);
        d.op = static_cast<uint32_t>(ReduceOp::Avg);
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("avg is not defined"));
    }
    SECTION("CUDA buffers without CUDA") {
        d.buffer_kind = static_cast<uint32_t>(BufferKind::Cuda);
        CHECK(validate_submit(d, 1024, false).error().code == -ENOTSUP);
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("no CUDA"));
    }
    SECTION("CUDA buffers: the staging range is checked, the registration kept") {
        d.buffer_kind = static_cast<uint32_t>(BufferKind::Cuda);
        d.cuda_reg = 7;
        d.cuda_offset = 4096;
        auto s = validate_submit(d, 1024, true);
        REQUIRE(s.ok());
        CHECK(s->cuda);
        CHECK(s->cuda_reg == 7);
        CHECK(s->cuda_offset == 4096);
        CHECK(s->ready_seq == d.seq);  // its own ready word
        d.offset = 1024;
        CHECK(validate_submit(d, 1024, true).error().code == -ERANGE);
    }
    SECTION("CUDA buffers: broadcast and reduce in place with a root, all_to_all by blocks or whole with split sizes") {
        d.buffer_kind = static_cast<uint32_t>(BufferKind::Cuda);
        d.cuda_reg = 7;
        d.collective = static_cast<uint32_t>(Collective::Reduce);
        d.ranks = 4;
        d.root = 3;
        d.out_offset = d.offset;
        auto s = validate_submit(d, 1024, true);
        REQUIRE(s.ok());
        CHECK(s->desc.root == 3);
        CHECK(s->out_offset == s->offset);
        d.collective = static_cast<uint32_t>(Collective::Broadcast);
        CHECK(validate_submit(d, 1024, true).ok());
        d.cuda_block = 16;  // (a blocked op's field)
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("device broadcast with cuda_out_reg"));
        d.cuda_block = 0;
        d.root = 4;
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("root rank 4 of 4"));
        d.root = 0;
        d.collective = static_cast<uint32_t>(Collective::AllToAll);
        d.out_offset = 512;
        d.count = 8;
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("outside the device all_to_all's block"));
        d.cuda_block = 8;
        d.cuda_out_reg = 7;
        auto a = validate_submit(d, 1024, true);
        REQUIRE(a.ok());
        CHECK(a->bytes == 4 * 8 * 4);
        CHECK(a->out_bytes == 4 * 8 * 4);
        CHECK(a->cuda_block == 8);
        d.cuda_part = 4;  // 8 elements from 4: past the block
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("outside the device all_to_all's block"));
        d.cuda_part = 0;
        d.count = 0;
        d.flags = kSubmitSplits;
        d.splits_offset = 768;
        // With split sizes: whole, in one part (no block, no part); its sizes taken from the slot.
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("with split sizes and cuda_block"));
        d.cuda_block = 0;
        d.cuda_out_offset = 64;
        auto v = validate_submit(d, 1024, true);
        REQUIRE(v.ok());
        CHECK(v->splits_pending);
        CHECK(v->cuda_out_reg == 7);
        CHECK(v->cuda_out_offset == 64);
        d.cuda_part = 2;
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("it runs whole"));
        d.cuda_part = 0;
        d.cuda_out_offset = 0;
        d.flags = 0;
        d.count = 8;
        d.collective = static_cast<uint32_t>(Collective::Barrier);
        d.count = d.offset = d.out_offset = d.cuda_block = d.cuda_out_reg = 0;
        d.ranks = 4;
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("slot buffers only"));
    }
    SECTION("CUDA parts wait for their op's ready word: at or after their seq, within 2^31") {
        d.buffer_kind = static_cast<uint32_t>(BufferKind::Cuda);
        d.seq = 100;
        d.cuda_ready_seq = 131;
        auto s = validate_submit(d, 1024, true);
        REQUIRE(s.ok());
        CHECK(s->ready_seq == 131);
        d.cuda_ready_seq = 99;
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("cuda_ready_seq"));
        d.cuda_ready_seq = 100 + (uint64_t{1} << 31);
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("cuda_ready_seq"));
        d.cuda_ready_seq = 100 + (uint64_t{1} << 31) - 1;
        CHECK(validate_submit(d, 1024, true).ok());
    }
    SECTION("slot buffers carry no CUDA fields") {
        d.cuda_reg = 1;
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("CUDA fields"));
        d.cuda_reg = 0;
        d.cuda_ready_seq = 5;
        CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("CUDA fields"));
    }
    SECTION("zero count is valid") {
        d.count = 0;
        d.offset = 1024;
        CHECK(validate_submit(d, 1024, false).ok());
    }
    SECTION("all_to_all: count per block apart, or split sizes taken once from the slot") {
        d.collective = static_cast<uint32_t>(Collective::AllToAll);
        d.ranks = 2;
        d.count = 8;
        d.offset = 0;
        d.out_offset = 64;
        auto even = validate_submit(d, 1024, false);
        REQUIRE(even.ok());
        CHECK(even->bytes == 64);
        CHECK(even->out_bytes == 64);
        CHECK(even->out_offset == 64);
        // Split sizes: count 0, the table (2 x ranks uint64) 8-aligned in the slot.
        std::vector<std::byte> slot(1024);
        const uint64_t table[4] = {3, 5, 7, 1};  // send 3 and 5, receive 7 and 1
        std::memcpy(slot.data() + 512, table, sizeof table);
        d.flags = kSubmitSplits;
        d.splits_offset = 512;
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("split sizes and a count"));
        d.count = 0;
        auto sp = validate_submit(d, 1024, false);
        REQUIRE(sp.ok());
        REQUIRE(take_splits(*sp, slot.data(), slot.size(), true).ok());
        CHECK(sp->bytes == 8 * 4);
        CHECK(sp->out_bytes == 8 * 4);
        REQUIRE(sp->splits);
        CHECK(*sp->splits == std::vector<uint64_t>{3, 5, 7, 1});
        d.splits_offset = 1020;
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("8-aligned"));
        d.splits_offset = 512;
        const uint64_t huge[4] = {1ull << 62, 1, 0, 0};
        std::memcpy(slot.data() + 512, huge, sizeof huge);
        auto big = validate_submit(d, 1024, false);
        CHECK(take_splits(*big, slot.data(), slot.size(), true).error().code == -ERANGE);
        d.collective = static_cast<uint32_t>(Collective::Allreduce);
        d.ranks = 0;
        d.out_offset = 0;
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("not an all_to_all"));
    }
    SECTION("broadcast and reduce: a root among the ranks, in place; barrier: no data") {
        d.collective = static_cast<uint32_t>(Collective::Broadcast);
        d.ranks = 4;
        d.root = 3;
        d.out_offset = d.offset;
        d.op = static_cast<uint32_t>(ReduceOp::Max);
        auto b = validate_submit(d, 1024, false);
        REQUIRE(b.ok());
        CHECK(b->desc.root == 3);
        CHECK(b->desc.op == ReduceOp::Sum);  // (a broadcast combines nothing)
        CHECK(b->out_offset == b->offset);
        CHECK(b->out_bytes == b->bytes);
        d.collective = static_cast<uint32_t>(Collective::Reduce);
        CHECK(validate_submit(d, 1024, false).value().desc.op == ReduceOp::Max);
        d.root = 4;
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("root rank 4 of 4 ranks"));
        d.root = 0;
        d.out_offset = d.offset + 4;
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("runs in place"));
        d.out_offset = d.offset;
        d.buffer_kind = 1;
        d.cuda_reg = 1;
        CHECK(validate_submit(d, 1024, true).ok());  // (of device buffers too: below)
        d.buffer_kind = 0;
        d.cuda_reg = 0;
        d.collective = static_cast<uint32_t>(Collective::Allreduce);
        d.ranks = 0;
        d.out_offset = 0;
        d.root = 1;
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("allreduce with a root rank set"));
        d.root = 0;
        d.collective = static_cast<uint32_t>(Collective::Barrier);
        d.ranks = 4;
        CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("a barrier with count"));
        d.count = d.offset = 0;
        d.dtype = static_cast<uint32_t>(DType::I64);
        auto bar = validate_submit(d, 1024, false);
        REQUIRE(bar.ok());
        CHECK(bar->desc.dtype == DType::F32);  // every rank's barrier is the same op
        CHECK(bar->bytes == 0);
    }
}

TEST_CASE("a refusal says the collective and the slot bytes it needed, and nothing else", "[proto]") {
    SubmitDesc d{};
    d.seq = 9;
    d.flags = kSubmitRefused;
    d.collective = static_cast<uint32_t>(Collective::AllToAll);
    d.count = 5000;
    auto r = refusal(d, 4096);
    REQUIRE(r.ok());
    CHECK(*r == "its all_to_all needs 5000 bytes of its slot, which has 4096");
    d.count = 0;
    CHECK(*refusal(d, 4096) == "it could not submit its all_to_all");
    // As a submission it is refused: only a refusal takes the flag (the gateway reads it first).
    CHECK(validate_submit(d, 4096, false).error().code == -EINVAL);
    SECTION("any other field, flag or collective: not a refusal") {
        auto bad = [&](auto set) {
            SubmitDesc e = d;
            set(e);
            auto x = refusal(e, 4096);
            REQUIRE_FALSE(x.ok());
            CHECK(x.error().code == -EINVAL);
        };
        bad([](SubmitDesc &e) { e.offset = 64; });
        bad([](SubmitDesc &e) { e.dtype = 1; });
        bad([](SubmitDesc &e) { e.ranks = 2; });
        bad([](SubmitDesc &e) { e.flags |= kSubmitSplits; });
        bad([](SubmitDesc &e) { e.cuda_part = 1; });
        bad([](SubmitDesc &e) { e.collective = kCollectiveCount; });
    }
}

TEST_CASE("completions truncate long messages", "[proto]") {
    CompletionDesc c;
    fill_completion(c, 9, -5, std::string(1000, 'x'));
    CHECK(c.seq == 9);
    CHECK(c.status == -5);
    CHECK(c.message_len == kCompletionMessageBytes);
}

TEST_CASE("decoders survive random mutations of valid frames", "[proto]") {
    // Every decoder is fed mutated copies of valid frames and random lengths; whatever it
    // accepts must re-encode to a frame that decodes to the same thing.
    std::mt19937_64 rng(7);
    const std::vector<Bytes> seeds = {encode_rdma_link_info(sample_link_info()), encode_hello({"grp", 1, 4, 1 << 20, ""}), encode_hello({"grp", 0, 2, 1 << 20, "a,b", 3}), encode_welcome({1, 64, 64, 1000, 0x20000, 0x9000, 0x100}),
                                      encode_error({-5, "message"}), encode_status_request({}),
                                      encode_cuda_register(sample_cuda_register()), encode_cuda_unregister(3),
                                      encode_cuda_reply({-2, 4, "no such registration"}), encode_status_reply("{}"),
                                      encode_peer_hello({"c", "a", "b", ConnKind::Data, 1, 3, Nonce{}, "a,b"}),
                                      encode_peer_challenge({}), encode_peer_auth(Mac{}), encode_peer_accept(4),
                                      encode_heartbeat({1, 2}),
                                      encode_op_report({1, "g", 2, 100, 0, 1, 2, 0, "", 0, 5}),
                                      encode_op_report({1, "g", 3, 0, 0, 0, 0, -5, "host a: local rank 1 left", 0, 5}),
                                      encode_op_start({1, "g", 2, 7, 8, 5, 1}), encode_op_fail({1, "g", 2, -22, "mismatch", 5}),
                                      encode_group_join({1, "g", 9, 0}), encode_ring_ready({4, true}), encode_ring_start({5, 0}), encode_ring_start({6, 9}), encode_ring_ready({4, true, 8}), encode_group_incarnation({1, "g", 9, 5, 0, ""}),
                                      encode_group_incarnation({1, "g", 9, 0, -103, "host b started it anew"}),
                                      encode_ring_abort({3, "host b: no heartbeat"}),
                                      encode_op_data({1, "g", 2, 3, 0, 1, 2, 0, "", 0, 5}, OpDataKind::OneShot, 12),
                                      encode_op_data({1, "g", 2, 30, 0, 1, 2, 0, ""}, OpDataKind::TwoShotPart, 40)};
    size_t accepted = 0;
    for (int iter = 0; iter < 20000; ++iter) {
        Bytes f = seeds[rng() % seeds.size()];
        const int flips = 1 + static_cast<int>(rng() % 4);
        for (int k = 0; k < flips; ++k) f[rng() % f.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
        if (rng() % 8 == 0) f.resize(rng() % (f.size() + 8));
        if (f.size() < kFrameHeaderBytes) {
            CHECK_FALSE(decode_frame_header(f, kMaxClientPayload).ok());
            continue;
        }
        auto h = decode_frame_header(std::span(f).first(kFrameHeaderBytes), kMaxDaemonPayload);
        if (!h || h->length != f.size() - kFrameHeaderBytes) continue;
        const auto p = std::span(f).subspan(kFrameHeaderBytes);
        switch (h->type) {
        case FrameType::Hello:
            if (auto d = decode_hello(p)) {
                ++accepted;
                CHECK(decode_hello(payload_of(encode_hello(*d)))->group == d->group);
            }
            break;
        case FrameType::HelloShared:
            if (auto d = decode_hello_shared(p)) {
                ++accepted;
                CHECK(decode_hello_shared(payload_of(encode_hello(*d)))->share_with == d->share_with);
            }
            break;
        case FrameType::Welcome:
            if (auto d = decode_welcome(p)) {
                ++accepted;
                CHECK(decode_welcome(payload_of(encode_welcome(*d)))->map_bytes == d->map_bytes);
            }
            break;
        case FrameType::Error:
            if (auto d = decode_error(p)) {
                ++accepted;
                CHECK(decode_error(payload_of(encode_error(*d)))->message == d->message);
            }
            break;
        case FrameType::CudaRegister:
            if (auto d = decode_cuda_register(p)) {
                ++accepted;
                auto again = decode_cuda_register(payload_of(encode_cuda_register(*d)));
                REQUIRE(again.ok());
                CHECK((again->offset == d->offset && again->bytes == d->bytes &&
                       std::memcmp(again->ipc_handle, d->ipc_handle, kCudaIpcHandleBytes) == 0));
            }
            break;
        case FrameType::CudaUnregister: accepted += decode_cuda_unregister(p).ok(); break;
        case FrameType::CudaReply:
            if (auto d = decode_cuda_reply(p)) {
                ++accepted;
                CHECK(decode_cuda_reply(payload_of(encode_cuda_reply(*d)))->message == d->message);
            }
            break;
        case FrameType::StatusRequest: accepted += decode_status_request(p).ok(); break;
        case FrameType::StatusReply: accepted += decode_status_reply(p).ok(); break;
        case FrameType::PeerHello:
            if (auto d = decode_peer_hello(p)) {
                ++accepted;
                CHECK(decode_peer_hello(payload_of(encode_peer_hello(*d)))->from == d->from);
            }
            break;
        case FrameType::PeerChallenge: accepted += decode_peer_challenge(p).ok(); break;
        case FrameType::PeerAuth: accepted += decode_peer_auth(p).ok(); break;
        case FrameType::PeerAccept: accepted += decode_peer_accept(p).ok(); break;
        case FrameType::Heartbeat: accepted += decode_heartbeat(p).ok(); break;
        case FrameType::OpReport:
            if (auto d = decode_op_report(p)) {
                ++accepted;
                auto again = decode_op_report(payload_of(encode_op_report(*d)));
                REQUIRE(again.ok());
                CHECK((again->group == d->group && again->count == d->count && again->message == d->message));
            }
            break;
        case FrameType::OpStart: accepted += decode_op_start(p).ok(); break;
        case FrameType::OpFail: accepted += decode_op_fail(p).ok(); break;
        case FrameType::RingAbort: accepted += decode_ring_abort(p).ok(); break;
        case FrameType::GroupJoin: accepted += decode_group_join(p).ok(); break;
        case FrameType::RingReady: accepted += decode_ring_ready(p).ok(); break;
        case FrameType::RingStart: accepted += decode_ring_start(p).ok(); break;
        case FrameType::ControlResume: accepted += decode_control_resume(p).ok(); break;
        case FrameType::GroupIncarnation:
            if (auto d = decode_group_incarnation(p)) {
                ++accepted;
                CHECK(decode_group_incarnation(payload_of(encode_group_incarnation(*d)))->message == d->message);
            }
            break;
        case FrameType::RdmaLinkInfo:
            if (auto d = decode_rdma_link_info(p)) {
                ++accepted;
                CHECK(decode_rdma_link_info(payload_of(encode_rdma_link_info(*d)))->qpn == d->qpn);
            }
            break;
        case FrameType::RdmaLinkReady: break;
        case FrameType::OpData:
            if (auto d = decode_op_data(p)) {
                ++accepted;
                // Partials of f16/bf16 sums travel as f32 (partial_dtype).
                CHECK(d->data.size() <= d->report.count * dtype_size(partial_dtype(static_cast<DType>(d->report.dtype),
                                                                                   static_cast<ReduceOp>(d->report.op))));
            }
            break;
        }
    }
    CHECK(accepted > 0);
}

TEST_CASE("a mesh data stream's hello (kind 2) is read from protocol 12 on; before it, and kind 3, are refused", "[proto]") {
    PeerHello m{"demo", "node0", "node2", ConnKind::Mesh, 1, 7, Nonce{}, {}};
    m.version = 12;
    const Bytes f = encode_peer_hello(m);
    auto h = decode_peer_hello(payload_of(f), 12);
    REQUIRE(h.ok());
    CHECK(h->kind == ConnKind::Mesh);
    CHECK(h->stream == 1);
    CHECK_THAT(decode_peer_hello(payload_of(f), 11).error().message, Catch::Contains("mesh data stream in a hello of protocol 11"));
    Bytes p(f.begin() + kFrameHeaderBytes, f.end());
    p[192] = 3;
    CHECK_THAT(decode_peer_hello(p, 12).error().message, Catch::Contains("unknown connection kind 3"));
}

TEST_CASE("peer frame bytes are pinned", "[proto]") {
    Nonce n;
    for (size_t i = 0; i < n.size(); ++i) n[i] = static_cast<uint8_t>(i);
    PeerHello v6{"demo", "node0", "node1", ConnKind::Data, 2, 0x0102, n, {}};
    v6.version = 6;
    const Bytes f = encode_peer_hello(v6);
    Bytes p(kPeerHelloBytes, 0);
    std::memcpy(&p[0], "demo", 4);
    std::memcpy(&p[64], "node0", 5);
    std::memcpy(&p[128], "node1", 5);
    p[192] = 1;     // kind: data
    p[196] = 2;     // stream
    p[200] = 0x02;  // generation, little-endian
    p[201] = 0x01;
    for (size_t i = 0; i < 32; ++i) p[208 + i] = static_cast<uint8_t>(i);
    CHECK(f == cat(header_bytes(16, 240), p));  // version 6's hello, byte for byte
    auto h = decode_peer_hello(payload_of(f), 6);
    REQUIRE(h.ok());
    CHECK(h->cluster == "demo");
    CHECK(h->to == "node1");
    CHECK(h->kind == ConnKind::Data);
    CHECK(h->generation == 0x0102);

    PeerChallenge c;
    c.nonce[0] = 0xAA;
    c.mac[31] = 0xBB;
    Bytes cp(64, 0);
    cp[0] = 0xAA;
    cp[63] = 0xBB;
    CHECK(encode_peer_challenge(c) == cat(header_bytes(17, 64), cp));
    CHECK(encode_peer_auth(Mac{}) == cat(header_bytes(18, 32), Bytes(32, 0)));
    CHECK(encode_peer_accept(7) == cat(header_bytes(19, 8), Bytes{7, 0, 0, 0, 0, 0, 0, 0}));
    CHECK(encode_heartbeat({1, 2}) == cat(header_bytes(20, 16), Bytes{1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0}));

    // Version 7: the header says 7, and the digest, config version and key ids come between the
    // fixed part and the domain.
    PeerHello v7 = v6;
    v7.version = 7;
    v7.hosts = {1, 2, 3, 4, 5, 6, 7, 8};
    v7.config_version = "0123456789ab";
    v7.key = {9, 9, 9, 9, 9, 9, 9, 9};
    v7.domain = "a,b";
    v7.instance = 0x0102030405060708;
    const Bytes g = encode_peer_hello(v7);
    Bytes x(kPeerHelloV7Bytes, 0);
    for (int i = 0; i < 8; ++i) x[i] = static_cast<uint8_t>(i + 1);
    std::memcpy(&x[8], "0123456789ab", 12);
    for (int i = 0; i < 8; ++i) x[24 + i] = 9;
    for (int i = 0; i < 8; ++i) x[40 + i] = static_cast<uint8_t>(8 - i);  // the instance, little-endian
    Bytes head = header_bytes(16, 240 + 48 + 3);
    head[4] = 7;
    CHECK(g == cat(cat(cat(head, p), x), Bytes{'a', ',', 'b'}));
    auto h7 = decode_peer_hello(payload_of(g), 7);
    REQUIRE(h7.ok());
    CHECK(h7->hosts == v7.hosts);
    CHECK(h7->config_version == "0123456789ab");
    CHECK(h7->key == v7.key);
    CHECK(h7->previous_key == KeyId{});
    CHECK(h7->domain == "a,b");
    CHECK(h7->instance == 0x0102030405060708);
    // Read as the other version, the bytes are something else: the header's version decides.
    CHECK(decode_peer_hello(payload_of(g), 6).ok() == false);
    CHECK(decode_peer_hello(payload_of(g), 8).ok());  // 8 to 11 keep 7's handshake
    CHECK(decode_peer_hello(payload_of(g), 9).ok());
    CHECK(decode_peer_hello(payload_of(g), 10).ok());
    CHECK(decode_peer_hello(payload_of(g), 11).ok());
    CHECK(decode_peer_hello(payload_of(g), 12).ok());
    CHECK(decode_peer_hello(payload_of(g), 13).ok());
    CHECK(decode_peer_hello(payload_of(g), 14).ok());
    CHECK(decode_peer_hello(payload_of(g), 15).error().code == -EPROTONOSUPPORT);
    // A config version must be printable and end with a NUL.
    Bytes bad(g.begin() + kFrameHeaderBytes, g.end());
    bad[kPeerHelloBytes + 8 + 3] = 0x01;
    CHECK_THAT(decode_peer_hello(bad, 7).error().message, Catch::Contains("not printable"));
    bad.assign(g.begin() + kFrameHeaderBytes, g.end());
    std::memset(&bad[kPeerHelloBytes + 8], 'z', kConfigVersionBytes);
    CHECK_THAT(decode_peer_hello(bad, 7).error().message, Catch::Contains("NUL"));

    PeerAccept a{7, 7, v7.hosts, "0123456789ab", 99, {}};
    a.mac[0] = 0xEE;
    const Bytes af = encode_peer_accept(a);
    REQUIRE(af.size() == kFrameHeaderBytes + 72);
    CHECK(Bytes(af.begin() + kFrameHeaderBytes, af.begin() + kFrameHeaderBytes + 40) == peer_accept_fields(a));
    CHECK(af[4] == 7);
    auto a7 = decode_peer_accept(payload_of(af), 7);
    REQUIRE(a7.ok());
    CHECK(a7->generation == 7);
    CHECK(a7->hosts == v7.hosts);
    CHECK(a7->config_version == "0123456789ab");
    CHECK(a7->instance == 99);
    CHECK(a7->mac == a.mac);
    CHECK(decode_peer_accept(payload_of(encode_peer_accept(7)), 6)->generation == 7);
    CHECK_FALSE(decode_peer_accept(payload_of(af), 6).ok());
}

TEST_CASE("peer frame headers: versions 6 to 14 are read, others refused naming both; a hello of 6 is refused", "[proto]") {
    Bytes h = header_bytes(20, 16);
    CHECK(decode_frame_header(h, 4096).ok());  // 6
    for (uint8_t v : {7, 8, 9, 10, 11, 12, 13, 14}) {
        h[4] = v;
        auto d = decode_frame_header(h, 4096);
        REQUIRE(d.ok());
        CHECK(d->version == v);
    }
    for (uint8_t v : {5, 15}) {
        h[4] = v;
        auto e = decode_frame_header(h, 4096);
        REQUIRE_FALSE(e.ok());
        CHECK(e.error().code == -EPROTONOSUPPORT);
        CHECK_THAT(e.error().message, Catch::Contains("speaks 7 to 14"));
    }
    // A hello says the version its connection runs at: 7 is the oldest spoken (a ringd of 6
    // closed the connection at a newer hello, which a dialer cannot tell from a host that died).
    Bytes hello = header_bytes(16, 16);
    for (uint8_t v : {7, 8, 9, 10, 11, 12, 13, 14}) {
        hello[4] = v;
        CHECK(decode_frame_header(hello, 4096).ok());
    }
    hello[4] = 6;
    auto e = decode_frame_header(hello, 4096);
    REQUIRE_FALSE(e.ok());
    CHECK(e.error().code == -EPROTONOSUPPORT);
}

TEST_CASE("ring ready and ring start: the generation's protocol after version 6's fields, from 9 on", "[proto]") {
    // Without it, version 6's layout byte for byte (what a ringd of 8 sends and reads).
    CHECK(encode_ring_ready({4, true}).size() == kFrameHeaderBytes + 16);
    CHECK(encode_ring_start({5, 0}).size() == kFrameHeaderBytes + 8);
    auto r = decode_ring_ready(payload_of(encode_ring_ready({4, true, 9})));
    REQUIRE(r.ok());
    CHECK(r->generation == 4);
    CHECK(r->ready);
    CHECK(r->protocol == 9);
    CHECK(decode_ring_ready(payload_of(encode_ring_ready({4, false}))).value().protocol == 0);
    auto s = decode_ring_start(payload_of(encode_ring_start({5, 9})));
    REQUIRE(s.ok());
    CHECK(s->generation == 5);
    CHECK(s->protocol == 9);
    CHECK(decode_ring_start(payload_of(encode_ring_start({5, 0}))).value().protocol == 0);
    // A generation of a ring that still has a host of 8 runs at 8 (or 7): said from 9 on too.
    CHECK(decode_ring_start(payload_of(encode_ring_start({5, 7}))).value().protocol == 7);
    CHECK(decode_ring_ready(payload_of(encode_ring_ready({4, true, 8}))).value().protocol == 8);
    // Flags from 13 on: a host's wire.schedule says ring, and the generation runs so.
    CHECK(encode_ring_ready({4, true, 13, kGenerationRingOnly}).size() == kFrameHeaderBytes + 20);
    auto rf = decode_ring_ready(payload_of(encode_ring_ready({4, true, 13, kGenerationRingOnly})));
    REQUIRE(rf.ok());
    CHECK(rf->protocol == 13);
    CHECK(rf->flags == kGenerationRingOnly);
    auto sf = decode_ring_start(payload_of(encode_ring_start({5, 13, kGenerationRingOnly})));
    REQUIRE(sf.ok());
    CHECK(sf->protocol == 13);
    CHECK(sf->flags == kGenerationRingOnly);
    CHECK(decode_ring_start(payload_of(encode_ring_start({5, 13}))).value().flags == 0);
    // Flags below 13, or ones this ringd does not know, are refused.
    for (uint32_t v : {0x10009u, 0x1000cu, 0x2000du, 0x8000000du}) {
        CAPTURE(v);
        Bytes p = body_of(encode_ring_start({5, 9}));
        std::memcpy(&p[8], &v, 4);  // little-endian here
        CHECK_THAT(decode_ring_start(p).error().message, Catch::Contains("says flags"));
        Bytes q = body_of(encode_ring_ready({4, true, 9}));
        std::memcpy(&q[16], &v, 4);
        CHECK_THAT(decode_ring_ready(q).error().message, Catch::Contains("says flags"));
    }
    // A protocol this ringd does not run a generation at, or a field cut short, is refused.
    for (uint32_t v : {1u, 6u, 15u, 0x1000fu}) {
        CAPTURE(v);
        Bytes p = body_of(encode_ring_start({5, 9}));
        std::memcpy(&p[8], &v, 4);  // little-endian here
        CHECK_THAT(decode_ring_start(p).error().message, Catch::Contains("says protocol"));
        Bytes q = body_of(encode_ring_ready({4, true, 9}));
        std::memcpy(&q[16], &v, 4);
        CHECK_THAT(decode_ring_ready(q).error().message, Catch::Contains("says protocol"));
    }
    Bytes p = body_of(encode_ring_start({5, 9}));
    p.pop_back();
    CHECK_FALSE(decode_ring_start(p).ok());
    Bytes q = body_of(encode_ring_ready({4, true, 9}));
    q.push_back(0);
    CHECK_FALSE(decode_ring_ready(q).ok());
}

TEST_CASE("peer hellos are validated", "[proto]") {
    PeerHello v6{"demo", "node0", "node1", ConnKind::Control, 0, 1, Nonce{}, {}};
    v6.version = 6;
    const Bytes f = encode_peer_hello(v6);
    Bytes p(f.begin() + kFrameHeaderBytes, f.end());
    REQUIRE(decode_peer_hello(p, 6).ok());
    Bytes q = p;
    q[192] = 9;
    CHECK_THAT(decode_peer_hello(q, 6).error().message, Catch::Contains("kind"));
    q = p;
    q[196] = 1;
    CHECK(decode_peer_hello(q, 6)->stream == 1);  // a control connection's rail
    q[196] = 16;
    CHECK_THAT(decode_peer_hello(q, 6).error().message, Catch::Contains("control connection on rail 16"));
    q = p;
    q[64] = '/';
    CHECK_FALSE(decode_peer_hello(q, 6).ok());
    q = p;
    std::memset(&q[0], 0, 4);
    CHECK_THAT(decode_peer_hello(q, 6).error().message, Catch::Contains("cluster is empty"));
    q[0] = 'x';
    q[2] = 'y';
    CHECK_THAT(decode_peer_hello(q, 6).error().message, Catch::Contains("after the cluster's NUL"));
    q.pop_back();
    CHECK_FALSE(decode_peer_hello(q, 6).ok());

    // v4: the ring domain follows the fixed part.
    PeerHello dv{"demo", "node0", "node1", ConnKind::Control, 0, 1, Nonce{}, "node0,node1"};
    dv.version = 6;
    const Bytes d = encode_peer_hello(dv);
    REQUIRE(d.size() == kFrameHeaderBytes + kPeerHelloBytes + 11);
    auto h = decode_peer_hello(payload_of(d), 6);
    REQUIRE(h.ok());
    CHECK(h->domain == "node0,node1");
    for (const char *bad : {"node0,", ",node0", "node0,,node1", "node0,no de1", "node0;node1"}) {
        Bytes b(d.begin() + kFrameHeaderBytes, d.begin() + kFrameHeaderBytes + kPeerHelloBytes);
        b.insert(b.end(), bad, bad + std::strlen(bad));
        CAPTURE(bad);
        CHECK_FALSE(decode_peer_hello(b, 6).ok());
    }
    Bytes big(d.begin() + kFrameHeaderBytes, d.begin() + kFrameHeaderBytes + kPeerHelloBytes);
    big.resize(kPeerHelloBytes + kMaxDomainBytes + 1, 'a');
    CHECK_THAT(decode_peer_hello(big, 6).error().message, Catch::Contains("bytes, expected"));
}

TEST_CASE("op negotiation frames round-trip and are validated", "[proto]") {
    const OpReport r{3, "grp", 9, 1000, 1, 3, 2, 0, "", 0, 0x1234};
    const Bytes f = encode_op_report(r);
    CHECK(f.size() == kFrameHeaderBytes + 120 + 4);
    auto d = decode_op_report(payload_of(f));
    REQUIRE(d.ok());
    CHECK(d->generation == 3);
    CHECK(d->seq == 9);
    CHECK(d->incarnation == 0x1234);
    CHECK(d->count == 1000);
    CHECK(d->op == 3);
    Bytes p(f.begin() + kFrameHeaderBytes, f.end());
    Bytes q = p;
    q[88] = 9;  // dtype
    CHECK_FALSE(decode_op_report(q).ok());
    q = p;
    q[100] = 1;  // positive status
    CHECK_FALSE(decode_op_report(q).ok());
    q = p;
    q.push_back('x');  // message length mismatch
    CHECK_FALSE(decode_op_report(q).ok());

    q = p;
    std::fill(q.begin() + 104, q.begin() + 112, 0);  // no incarnation
    CHECK_FALSE(decode_op_report(q).ok());
    q = p;
    q[116] = 1;  // flags: kReportAhead on a report that is not a failure
    CHECK_THAT(decode_op_report(q).error().message, Catch::Contains("must be a failure"));
    q[116] = 8;  // an unknown flag
    CHECK_THAT(decode_op_report(q).error().message, Catch::Contains("unknown flags"));
    // Deferred reports (the direct algorithms: one-/two-shot, doubling, halving-doubling) name
    // their algorithm; a done report is one.
    OpReport deferred = r;
    deferred.flags = kReportDeferred | kReportDone;
    deferred.algorithm = 4;
    auto dd = decode_op_report(payload_of(encode_op_report(deferred)));
    REQUIRE(dd.ok());
    CHECK(dd->flags == (kReportDeferred | kReportDone));
    CHECK(dd->algorithm == 4);
    { const Bytes f = encode_op_report(deferred); q.assign(f.begin() + kFrameHeaderBytes, f.end()); }
    q[117] = 1;  // one-shot
    REQUIRE(decode_op_report(q).ok());
    CHECK(decode_op_report(q)->algorithm == 1);
    q[117] = 0;  // the ring, in a solo lane
    REQUIRE(decode_op_report(q).ok());
    CHECK(decode_op_report(q)->algorithm == 0);
    q[117] = 5;
    CHECK_THAT(decode_op_report(q).error().message, Catch::Contains("names algorithm 5"));
    q[116] = kReportDone;  // done without deferred
    q[117] = 0;
    CHECK_THAT(decode_op_report(q).error().message, Catch::Contains("a done report must be a deferred report"));
    OpReport ahead = r;
    ahead.status = -ENOBUFS;
    ahead.message = "over a bound";
    ahead.flags = kReportAhead;
    const Bytes af = encode_op_report(ahead);
    CHECK(af[kFrameHeaderBytes + 116] == 1);
    auto ad = decode_op_report(payload_of(af));
    REQUIRE(ad.ok());
    CHECK(ad->flags == kReportAhead);
    CHECK(ad->status == -ENOBUFS);
    OpReport timed = r;
    timed.remaining_ms = 12345;
    CHECK(decode_op_report(payload_of(encode_op_report(timed)))->remaining_ms == 12345);

    auto s = decode_op_start(payload_of(encode_op_start({3, "grp", 9, 44, 8, 77, 3})));
    REQUIRE(s.ok());
    CHECK(s->op_id == 44);
    CHECK(s->total_ranks == 8);
    CHECK(s->incarnation == 77);
    CHECK(s->lane == 3);
    CHECK_FALSE(decode_op_start(payload_of(encode_op_start({3, "grp", 9, 44, 0, 77, 0}))).ok());
    CHECK_FALSE(decode_op_start(payload_of(encode_op_start({3, "grp", 9, 44, 8, 0, 0}))).ok());
    auto fl = decode_op_fail(payload_of(encode_op_fail({3, "grp", 9, -5, "host b did not submit it", 77})));
    REQUIRE(fl.ok());
    CHECK(fl->message == "host b did not submit it");
    CHECK(fl->incarnation == 77);
    CHECK_FALSE(decode_op_fail(payload_of(encode_op_fail({3, "grp", 9, 5, "x", 77}))).ok());
    CHECK_FALSE(decode_op_fail(payload_of(encode_op_fail({3, "grp", 9, -5, "x", 0}))).ok());
    CHECK(fl->after == 0);  // (not sent: before protocol 11)
    {
        // An incarnation's end with the seq through which its ops go on (protocol 11): after the
        // message; a frame without it reads as 0, and one with other trailing bytes is refused.
        proto::OpFail end{3, "grp", kIncarnationEnds, -103, "group grp: host b local rank 0 left", 77};
        end.after = 0x1234567890ull;
        auto e = decode_op_fail(payload_of(encode_op_fail(end, true)));
        REQUIRE(e.ok());
        CHECK(e->after == 0x1234567890ull);
        CHECK(e->message == end.message);
        CHECK(decode_op_fail(payload_of(encode_op_fail(end)))->after == 0);
        const Bytes frame = encode_op_fail(end, true);
        const auto whole = payload_of(frame);
        CHECK_FALSE(decode_op_fail(whole.first(whole.size() - 1)).ok());
    }

    auto j = decode_group_join(payload_of(encode_group_join({3, "grp", 0xabc, 77})));
    REQUIRE(j.ok());
    CHECK(j->local_id == 0xabc);
    CHECK(j->previous == 77);
    CHECK_FALSE(decode_group_join(payload_of(encode_group_join({3, "grp", 0, 77}))).ok());
    auto gi = decode_group_incarnation(payload_of(encode_group_incarnation({3, "grp", 0xabc, 0, -103, "refused"})));
    REQUIRE(gi.ok());
    CHECK(gi->code == -103);
    CHECK(gi->message == "refused");
    CHECK_FALSE(decode_group_incarnation(payload_of(encode_group_incarnation({3, "grp", 0xabc, 0, 0, ""}))).ok());
    CHECK_FALSE(decode_group_incarnation(payload_of(encode_group_incarnation({3, "grp", 0xabc, 5, -5, "x"}))).ok());
    // Protocol 8: a join says its local ranks, and an incarnation its solo lane; without them the
    // frames are version 6's, byte for byte.
    CHECK(payload_of(encode_group_join({3, "grp", 0xabc, 77})).size() == 88);
    auto js = decode_group_join(payload_of(encode_group_join({3, "grp", 0xabc, 77, 3})));
    REQUIRE(js.ok());
    CHECK(js->local_size == 3);
    CHECK(js->previous == 77);
    CHECK(payload_of(encode_group_incarnation({3, "grp", 0xabc, 5, 0, ""})).size() == 100);
    for (const std::string m : {"", "a message of some length"}) {
        auto solo = decode_group_incarnation(payload_of(encode_group_incarnation({3, "grp", 0xabc, 5, 0, m, 1, 9, 6})));
        REQUIRE(solo.ok());
        CHECK(solo->message == m);
        CHECK(solo->lane == 1);
        CHECK(solo->solo_epoch == 9);
        CHECK(solo->total_ranks == 6);
    }
    CHECK_FALSE(decode_group_incarnation(payload_of(encode_group_incarnation({3, "grp", 0xabc, 5, 0, "", 1, 200, 6}))).ok());
    CHECK_FALSE(decode_group_incarnation(payload_of(encode_group_incarnation({3, "grp", 0xabc, 5, 0, "", 1, 9, 0}))).ok());
    auto a = decode_ring_abort(payload_of(encode_ring_abort({4, "host c: connection closed"})));
    REQUIRE(a.ok());
    CHECK(a->generation == 4);
    CHECK(a->reason == "host c: connection closed");
}

TEST_CASE("op data frames carry the report and exactly count x dtype bytes (f32 here)", "[proto]") {
    const OpReport r{5, "grp", 7, 3, static_cast<uint32_t>(DType::F32), static_cast<uint32_t>(ReduceOp::Avg), 2, 0, "", 0, 9};
    Bytes f = encode_op_data(r, OpDataKind::OneShot, 12);
    CHECK(f.size() == op_data_offset() + 12);
    const float v[3] = {1.5f, -2.0f, 4.25f};
    std::memcpy(&f[op_data_offset()], v, sizeof v);
    // The same fixed fields as an op report, then the data.
    const Bytes rep = encode_op_report(r);
    CHECK(std::equal(rep.begin() + kFrameHeaderBytes, rep.begin() + kFrameHeaderBytes + 120,
                     f.begin() + kFrameHeaderBytes));
    auto h = decode_frame_header(std::span(f).first(kFrameHeaderBytes), 1 << 20);
    REQUIRE(h.ok());
    CHECK(h->type == FrameType::OpData);
    CHECK(h->length == kOpDataHeaderBytes + 12);
    auto d = decode_op_data(payload_of(f));
    REQUIRE(d.ok());
    CHECK(d->report.algorithm == 1);
    CHECK(d->kind == OpDataKind::OneShot);
    CHECK(d->report.local_size == 2);
    CHECK(d->report.seq == 7);
    CHECK(d->report.incarnation == 9);
    REQUIRE(d->data.size() == 12);
    float back[3];
    std::memcpy(back, d->data.data(), 12);
    CHECK(back[2] == 4.25f);

    const Bytes p(f.begin() + kFrameHeaderBytes, f.end());
    Bytes q = p;
    q.pop_back();  // one byte short of 3 floats
    CHECK_FALSE(decode_op_data(q).ok());
    q = p;
    q[100] = 0xfb;  // a failure status: failures travel as op reports
    q[101] = q[102] = q[103] = 0xff;
    CHECK_FALSE(decode_op_data(q).ok());
    q = p;
    q[80] = 0xff;  // a count that does not match the data
    CHECK_FALSE(decode_op_data(q).ok());
    CHECK_FALSE(decode_op_data(Bytes(50, 0)).ok());
    q = p;
    q[120] = 4;  // an unknown kind
    CHECK_FALSE(decode_op_data(q).ok());
    q = p;
    q[124] = 1;  // reserved
    CHECK_FALSE(decode_op_data(q).ok());

    // Two-shot frames carry a segment: at most count x dtype bytes, the receiver checks which.
    const Bytes part = encode_op_data(r, OpDataKind::TwoShotPart, 4);
    auto dp = decode_op_data(payload_of(part));
    REQUIRE(dp.ok());
    CHECK(dp->kind == OpDataKind::TwoShotPart);
    CHECK(dp->report.algorithm == 2);
    CHECK(dp->data.size() == 4);
    CHECK(decode_op_data(payload_of(encode_op_data(r, OpDataKind::TwoShotResult, 0))).ok());
    CHECK_FALSE(decode_op_data(payload_of(encode_op_data(r, OpDataKind::TwoShotResult, 16))).ok());
}

TEST_CASE("f16/bf16 sum and avg op data carry f32 contributions and parts, results in the dtype; min/max the dtype",
          "[proto]") {
    CHECK(partial_dtype(DType::F16, ReduceOp::Avg) == DType::F32);
    CHECK(partial_dtype(DType::BF16, ReduceOp::Sum) == DType::F32);
    CHECK(partial_dtype(DType::F16, ReduceOp::Max) == DType::F16);
    CHECK(partial_dtype(DType::F32, ReduceOp::Avg) == DType::F32);
    CHECK(partial_dtype(DType::F64, ReduceOp::Avg) == DType::F64);
    CHECK(partial_dtype(DType::I32, ReduceOp::Sum) == DType::I32);
    for (DType t : {DType::F16, DType::BF16}) {
        const OpReport avg{5, "grp", 7, 3, static_cast<uint32_t>(t), static_cast<uint32_t>(ReduceOp::Avg), 1, 0, "", 0, 9};
        CHECK(decode_op_data(payload_of(encode_op_data(avg, OpDataKind::OneShot, 12))).ok());
        CHECK_FALSE(decode_op_data(payload_of(encode_op_data(avg, OpDataKind::OneShot, 6))).ok());
        CHECK(decode_op_data(payload_of(encode_op_data(avg, OpDataKind::TwoShotPart, 8))).ok());
        CHECK(decode_op_data(payload_of(encode_op_data(avg, OpDataKind::TwoShotResult, 6))).ok());
        CHECK_FALSE(decode_op_data(payload_of(encode_op_data(avg, OpDataKind::TwoShotResult, 8))).ok());
        const OpReport max{5, "grp", 7, 3, static_cast<uint32_t>(t), static_cast<uint32_t>(ReduceOp::Max), 1, 0, "", 0, 9};
        CHECK(decode_op_data(payload_of(encode_op_data(max, OpDataKind::OneShot, 6))).ok());
        CHECK_FALSE(decode_op_data(payload_of(encode_op_data(max, OpDataKind::OneShot, 12))).ok());
    }
}

TEST_CASE("RDMA link info bytes are pinned", "[proto]") {
    const Bytes f = encode_rdma_link_info(sample_link_info());
    Bytes p(kRdmaLinkInfoBytes, 0);
    p[0] = 1;                                  // version
    p[4] = 2;                                  // QPs
    p[8] = 128;                                // FIFO entries
    p[12] = 0x34, p[13] = 0x12;                // LID
    p[14] = 5;                                 // MTU code
    p[26] = p[27] = 0xff, p[28] = 10, p[31] = 1;  // GID ::ffff:10.0.0.1
    const uint8_t addr[8] = {0x40, 0x33, 0x22, 0x11, 0x00, 0x7f, 0, 0};
    std::memcpy(&p[32], addr, 8);
    p[40] = 0x5a, p[41] = 0xcd, p[42] = 0xab;  // FIFO rkey
    p[48] = 0x01, p[49] = 0x01;                // QP 0: qpn 0x101
    p[52] = 0xfe, p[53] = 0xff, p[54] = 0xff;  //       psn 0xfffffe
    p[56] = 0x02, p[57] = 0x01;                // QP 1: qpn 0x102
    p[60] = 7;                                 //       psn 7
    CHECK(f == cat(header_bytes(26, static_cast<uint32_t>(kRdmaLinkInfoBytes)), p));
    auto d = decode_rdma_link_info(payload_of(f));
    REQUIRE(d.ok());
    CHECK(d->qpn == sample_link_info().qpn);
    CHECK(d->fifo_addr == 0x00007f0011223340);
    CHECK(encode_rdma_link_ready() == header_bytes(27, 0));
}

TEST_CASE("RDMA link info is validated", "[proto]") {
    const Bytes good = encode_rdma_link_info(sample_link_info());
    auto broken = [&](size_t at, uint8_t v) {
        Bytes f = good;
        f[kFrameHeaderBytes + at] = v;
        auto d = decode_rdma_link_info(payload_of(f));
        return d.ok() ? std::string() : d.error().message;
    };
    CHECK_THAT(broken(0, 2), Catch::Contains("version 2"));
    CHECK_THAT(broken(4, 0), Catch::Contains("0 QPs"));
    CHECK_THAT(broken(4, 9), Catch::Contains("9 QPs"));
    CHECK_THAT(broken(14, 6), Catch::Contains("MTU"));
    CHECK_THAT(broken(51, 1), Catch::Contains("24-bit"));   // qpn beyond 24 bits
    CHECK_THAT(broken(64, 1), Catch::Contains("unused"));   // QP 2 set while 2 QPs are in use
    Bytes no_fifo = good;
    std::memset(&no_fifo[kFrameHeaderBytes + 32], 0, 8);
    CHECK_FALSE(decode_rdma_link_info(payload_of(no_fifo)).ok());
    CHECK_FALSE(decode_rdma_link_info(std::span(payload_of(good)).first(kRdmaLinkInfoBytes - 1)).ok());
}

TEST_CASE("a hello may say the trainer's rank in its group: a 13-byte trailer after the hosts", "[proto]") {
    Hello h{"g1", 1, 2, 4096, "a,b", 0, 0, 5, 8};
    const Bytes f = encode_hello(h);
    Bytes payload = {1, 0, 0, 0, 2, 0, 0, 0, 0x00, 0x10, 0, 0, 0, 0, 0, 0, 'g', '1'};
    payload.resize(kHelloBytes, 0);
    for (char ch : std::string("a,b")) payload.push_back(static_cast<uint8_t>(ch));
    for (uint8_t b : {0, 0, 0, 0, 0, 5, 0, 0, 0, 8, 0, 0, 0}) payload.push_back(b);  // NUL, timeout 0, rank, ranks
    CHECK(f == cat(header_bytes(1, static_cast<uint32_t>(payload.size())), payload));
    auto d = decode_hello(payload_of(f));
    REQUIRE(d.ok());
    CHECK(d->hosts == "a,b");
    CHECK(d->op_timeout_ms == 0);
    CHECK(d->rank == 5);
    CHECK(d->ranks == 8);
    // With a timeout and no hosts; a hello without ranks stays the layout before, byte for byte.
    auto t = decode_hello(payload_of(encode_hello({"g1", 0, 1, 4096, "", 0, 2500, 0, 1})));
    REQUIRE(t.ok());
    CHECK(t->op_timeout_ms == 2500);
    CHECK(t->ranks == 1);
    CHECK(encode_hello({"g1", 0, 1, 4096, "", 0, 2500}).size() == kFrameHeaderBytes + kHelloBytes + kHelloTimeoutBytes);
    // A rank outside the group, a group of none, or a trailer of another length is refused.
    for (auto [rank, ranks] : {std::pair{8u, 8u}, {0u, 0u}, {0u, kMaxGroupRanks + 1}}) {
        Bytes p = body_of(encode_hello({"g1", 0, 1, 4096, "", 0, 0, 0, 1}));
        std::memcpy(&p[p.size() - 8], &rank, 4);
        std::memcpy(&p[p.size() - 4], &ranks, 4);
        CHECK_THAT(decode_hello(p).error().message, Catch::Contains("is not a rank of a group"));
    }
    Bytes p = body_of(f);
    p.push_back(0);
    CHECK_THAT(decode_hello(p).error().message, Catch::Contains("trailer"));
}

TEST_CASE("reduce_scatter and allgather descriptors: both ranges checked, ranks said, a device buffer's part inside "
          "its blocks",
          "[proto]") {
    SubmitDesc d{};
    d.seq = 4;
    d.collective = static_cast<uint32_t>(Collective::ReduceScatter);
    d.count = 16;  // the output's elements; the input has 4 blocks of them
    d.ranks = 4;
    d.dtype = static_cast<uint32_t>(DType::F32);
    d.offset = 0;
    d.out_offset = 256;
    auto s = validate_submit(d, 1024, false);
    REQUIRE(s.ok());
    CHECK(s->desc == OpDesc{Collective::ReduceScatter, DType::F32, ReduceOp::Sum, 16, 4});
    CHECK(s->bytes == 256);
    CHECK(s->out_bytes == 64);
    CHECK(s->out_offset == 256);
    d.offset = 1024 - 255;  // the input past the end (and misaligned)
    CHECK_FALSE(validate_submit(d, 1024, false).ok());
    d.offset = 1024 - 256 + 4;
    CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("input buffer"));
    d.offset = 0;
    d.out_offset = 1024 - 60;
    CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("output buffer"));
    d.out_offset = 2;
    CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("output offset"));
    d.out_offset = 256;
    d.count = UINT64_MAX / 2;  // count x ranks overflows
    CHECK(validate_submit(d, 1024, false).error().code == -EOVERFLOW);
    d.count = 16;
    d.ranks = 0;
    CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("over 0 ranks"));
    d.ranks = 4;
    // An allgather's output has the blocks; its op is not used (any is taken as sum).
    d.collective = static_cast<uint32_t>(Collective::Allgather);
    d.op = static_cast<uint32_t>(ReduceOp::Max);
    d.out_offset = 512;
    auto g = validate_submit(d, 1024, false);
    REQUIRE(g.ok());
    CHECK(g->desc.op == ReduceOp::Sum);
    CHECK(g->bytes == 64);
    CHECK(g->out_bytes == 256);
    d.collective = kCollectiveCount;
    CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("unknown collective"));
    // An allreduce has no ranks or output of its own.
    d.collective = static_cast<uint32_t>(Collective::Allreduce);
    CHECK_THAT(validate_submit(d, 1024, false).error().message, Catch::Contains("allreduce (in place)"));
    // A device buffer's reduce_scatter: part [cuda_part, +count) of blocks of cuda_block elements.
    d.collective = static_cast<uint32_t>(Collective::ReduceScatter);
    d.buffer_kind = static_cast<uint32_t>(BufferKind::Cuda);
    d.out_offset = 256;
    CHECK(validate_submit(d, 1024, false).error().code == -ENOTSUP);  // a ringd without CUDA
    CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("block of 0 elements"));
    d.cuda_block = 40;
    d.cuda_part = 24;
    d.cuda_out_reg = 3;
    d.cuda_out_offset = 64;
    auto dev = validate_submit(d, 1024, true);
    REQUIRE(dev.ok());
    CHECK(dev->cuda);
    CHECK((dev->cuda_block == 40 && dev->cuda_part == 24 && dev->cuda_out_reg == 3 && dev->cuda_out_offset == 64));
    d.cuda_part = 25;  // [25, 41) is past the block
    CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("part [25, +16) lies outside"));
    d.cuda_part = UINT64_MAX - 8;
    CHECK(validate_submit(d, 1024, true).error().code == -EINVAL);
    d.cuda_part = 0;
    d.cuda_block = UINT64_MAX / 8;  // x 4 ranks x 4 bytes overflows
    CHECK(validate_submit(d, 1024, true).error().code == -EOVERFLOW);
    d.cuda_block = 40;
    // None of them on a device allreduce, nor on a slot buffer.
    SubmitDesc ar{};
    ar.count = 16;
    ar.buffer_kind = static_cast<uint32_t>(BufferKind::Cuda);
    ar.cuda_block = 16;
    CHECK_THAT(validate_submit(ar, 1024, true).error().message, Catch::Contains("device allreduce with"));
    d.buffer_kind = static_cast<uint32_t>(BufferKind::Slot);
    d.cuda_reg = 0;
    CHECK_THAT(validate_submit(d, 1024, true).error().message, Catch::Contains("a slot buffer with CUDA fields set"));
}

TEST_CASE("protocol 10: group joins say their ranks, incarnations the rank map, reports the collective", "[proto]") {
    // A join without ranks is 9's layout, byte for byte.
    CHECK(encode_group_join({5, "g", 3, 0, 2}).size() == kFrameHeaderBytes + 8 + kGroupNameBytes + 16 + 4);
    GroupJoin j{5, "g", 3, 0, 2, 8, {6, 1}};
    auto dj = decode_group_join(payload_of(encode_group_join(j)));
    REQUIRE(dj.ok());
    CHECK(dj->group_ranks == 8);
    CHECK(dj->ranks == std::vector<uint32_t>{6, 1});
    j.ranks = {6, 8};  // a rank outside the group
    CHECK_THAT(decode_group_join(payload_of(encode_group_join(j))).error().message, Catch::Contains("rank 8 of a group of 8"));
    j.ranks = {6};  // fewer ranks than local ranks
    CHECK_FALSE(decode_group_join(payload_of(encode_group_join(j))).ok());

    // The rank map follows a solo lane's fields and a message alike.
    for (bool solo : {false, true}) {
        GroupIncarnation g{5, "g", 3, 0x500001, 0, {}, solo ? 1u : 0u, solo ? 2u : 0u, solo ? 3u : 0u, {{2, 0}, {1}}};
        auto d = decode_group_incarnation(payload_of(encode_group_incarnation(g)));
        REQUIRE(d.ok());
        CHECK(d->host_ranks == std::vector<std::vector<uint32_t>>{{2, 0}, {1}});
        CHECK(d->solo_epoch == g.solo_epoch);
        CHECK(d->total_ranks == g.total_ranks);
        CHECK(d->message.empty());
        g.host_ranks = {{2, 0}, {0}};  // not a permutation
        CHECK_THAT(decode_group_incarnation(payload_of(encode_group_incarnation(g))).error().message,
                   Catch::Contains("not a permutation"));
    }
    GroupIncarnation plain{5, "g", 3, 0x500001, 0, {}};
    CHECK(decode_group_incarnation(payload_of(encode_group_incarnation(plain))).value().host_ranks.empty());

    OpReport r{3, "grp", 9, 1000, 1, 0, 2, 0, "", 0, 0x1234};
    const Bytes allreduce = encode_op_report(r);
    r.collective = static_cast<uint32_t>(Collective::Allgather);
    const Bytes allgather = encode_op_report(r);
    CHECK(allreduce.size() == allgather.size());
    CHECK(decode_op_report(payload_of(allgather)).value().collective == 2);
    CHECK(decode_op_report(payload_of(allgather)).value().flags == 0);
    CHECK(decode_op_report(payload_of(allreduce)).value().collective == 0);
    Bytes q = body_of(allgather);
    q[118] = 7;  // collective 7
    CHECK_THAT(decode_op_report(q).error().message, Catch::Contains("names collective 7"));
}

TEST_CASE("protocol 11: broadcast and reduce reports carry the root in the op word; their op data is one-shot, exactly "
          "the op's data", "[proto]") {
    OpReport r{3, "grp", 9, 1000, static_cast<uint32_t>(DType::BF16), static_cast<uint32_t>(ReduceOp::Max), 2, 0, "", 0, 0x1234};
    const Bytes allreduce = encode_op_report(r);
    r.collective = static_cast<uint32_t>(Collective::Reduce);
    r.root = 0x54321;
    const Bytes reduce = encode_op_report(r);
    CHECK(reduce.size() == allreduce.size());
    Bytes body = body_of(reduce);
    CHECK(le::get<uint32_t>(&body[92]) == (0x54321u << 8 | 3));  // op 3 (max), root above it
    auto d = decode_op_report(payload_of(reduce));
    REQUIRE(d.ok());
    CHECK(d->collective == 4);
    CHECK(d->root == 0x54321);
    CHECK(d->op == 3);
    // An allreduce's op word is the op alone, as before (a root there is not sent).
    r.collective = 0;
    CHECK(encode_op_report(r) == allreduce);
    // A root past the most ranks a group has is refused.
    le::put<uint32_t>(&body[92], (kMaxGroupRanks << 8) | 3);
    CHECK_THAT(decode_op_report(body).error().message, Catch::Contains("root rank"));
    // Op data: a broadcast's the dtype, a reduce's partial results (bf16 max: bf16), a barrier's
    // none; nothing else, and only one-shot.
    r.count = 10;
    r.local_size = 1;
    for (auto [coll, bytes] : {std::pair{Collective::Broadcast, 20u}, {Collective::Reduce, 20u}, {Collective::Barrier, 0u}}) {
        CAPTURE(collective_name(coll));
        r.collective = static_cast<uint32_t>(coll);
        r.count = coll == Collective::Barrier ? 0 : 10;
        CHECK(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, bytes))).ok());
        CHECK_THAT(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, bytes + 2))).error().message,
                   Catch::Contains("data bytes"));
        CHECK_THAT(decode_op_data(payload_of(encode_op_data(r, OpDataKind::TwoShotPart, bytes))).error().message,
                   Catch::Contains("for a " + std::string(collective_name(coll))));
    }
    // all_to_all: one-shot, any length up to a part, its part number in the step word.
    r.collective = static_cast<uint32_t>(Collective::AllToAll);
    r.count = 0;
    auto part = decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, 100, 3u << 16 | 2)));
    REQUIRE(part.ok());
    CHECK(part->step == (3u << 16 | 2));
    CHECK_THAT(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, 100, 2u << 16 | 2))).error().message,
               Catch::Contains("part 2 of 2"));
    CHECK_FALSE(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, 100, 0))).ok());
    CHECK_FALSE(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, kAllToAllPartBytes + 1, 1u << 16))).ok());
    // (Any other collective's one-shot data keeps that word zero.)
    r.collective = static_cast<uint32_t>(Collective::Broadcast);
    r.count = 10;
    Bytes f = encode_op_data(r, OpDataKind::OneShot, 20);
    Bytes b = body_of(f);
    b[kOpDataHeaderBytes - 4] = 1;  // (the word after the kind)
    CHECK_THAT(decode_op_data(b).error().message, Catch::Contains("reserved field"));
    r.collective = static_cast<uint32_t>(Collective::Reduce);
    r.count = 10;
    r.op = static_cast<uint32_t>(ReduceOp::Sum);  // bf16 sums travel in f32
    CHECK(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, 40))).ok());
    CHECK_FALSE(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, 20))).ok());
}

TEST_CASE("protocol 10: a reduce_scatter's or allgather's op data is one-shot, in whole blocks", "[proto]") {
    OpReport r{5, "grp", 7, 3, static_cast<uint32_t>(DType::F16), static_cast<uint32_t>(ReduceOp::Sum), 2, 0, "", 1, 9};
    r.collective = static_cast<uint32_t>(Collective::ReduceScatter);
    // reduce_scatter: partial results (f16 sums in f32), any number of blocks of count elements.
    for (uint64_t blocks : {0, 1, 5}) {
        auto d = decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, blocks * 3 * 4)));
        REQUIRE(d.ok());
        CHECK(d->report.collective == static_cast<uint32_t>(Collective::ReduceScatter));
        CHECK(d->data.size() == blocks * 12);
    }
    CHECK_FALSE(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, 3 * 2))).ok());  // f16, not f32
    CHECK_FALSE(decode_op_data(payload_of(encode_op_data(r, OpDataKind::TwoShotPart, 12))).ok());
    // allgather: blocks in the dtype.
    r.collective = static_cast<uint32_t>(Collective::Allgather);
    CHECK(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, 2 * 3 * 2))).ok());
    CHECK_FALSE(decode_op_data(payload_of(encode_op_data(r, OpDataKind::OneShot, 2 * 3 * 2 + 1))).ok());
    CHECK_FALSE(decode_op_data(payload_of(encode_op_data(r, OpDataKind::TwoShotResult, 6))).ok());
}
