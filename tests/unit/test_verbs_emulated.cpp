// The software RDMA device driven directly through its verbs table, as a NIC would be: the GID
// table and its auto-selection, RC QP state checks, WRITE and WRITE_WITH_IMM into another
// context's registered memory (also across processes), receives consumed by immediates,
// signalled and unsignalled completions, inline data, completion channels, and every error the
// transport must turn into a link error: bad rkey, out of bounds, no remote access, bad lkey, a
// missing receive, a peer that is gone, a QP in the wrong state.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "daemon/transport/ibverbs/emulated_device.h"
#include "daemon/transport/ibverbs/verbs.h"

using namespace ringd;
using namespace ringd::verbs;
using namespace std::chrono_literals;

namespace {

const VerbsApi &api = emulated_verbs();

// One end: a device context with PD, channel, CQ, one RC QP and a registered buffer.
struct End {
    DeviceContext ctx;
    PortInfo port;
    ProtectionDomain pd;
    CompletionChannel channel;
    CompletionQueue cq;
    QueuePair qp;
    std::vector<uint8_t> buf = std::vector<uint8_t>(1 << 20);
    MemoryRegion mr;

    explicit End(int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) {
        std::string name;
        auto c = open_device(api, "auto", name);
        REQUIRE(c.ok());
        CHECK(name == kEmulatedDeviceName);
        ctx = std::move(*c);
        auto p = query_port(api, ctx.get(), 1, "auto");
        REQUIRE(p.ok());
        port = *p;
        pd = ProtectionDomain(&api, api.alloc_pd(ctx.get()));
        channel = CompletionChannel(&api, api.create_comp_channel(ctx.get()));
        cq = CompletionQueue(&api, api.create_cq(ctx.get(), 256, nullptr, channel.get(), 0));
        REQUIRE((pd && channel && cq));
        ibv_qp_init_attr a = {};
        a.send_cq = a.recv_cq = cq.get();
        a.qp_type = IBV_QPT_RC;
        a.cap.max_send_wr = 64;
        a.cap.max_recv_wr = 64;
        a.cap.max_send_sge = a.cap.max_recv_sge = 2;
        a.cap.max_inline_data = 64;
        qp = QueuePair(&api, api.create_qp(pd.get(), &a));
        REQUIRE(qp);
        mr = MemoryRegion(&api, api.reg_mr(pd.get(), buf.data(), buf.size(), access));
        REQUIRE(mr);
    }
    QpPath path_to(const End &o, uint8_t rnr_retry = 7, uint8_t min_rnr_timer = 1) const {
        QpPath p;
        p.sgid_index = static_cast<uint8_t>(port.gid_index);
        p.dgid = o.port.gid;
        p.dlid = o.port.attr.lid;
        p.mtu = IBV_MTU_4096;
        p.dest_qpn = o.qp->qp_num;
        p.rnr_retry = rnr_retry;
        p.min_rnr_timer = min_rnr_timer;
        return p;
    }
    // The status of the one completion that comes next (waited for as by wait()).
    ibv_wc_status next_status() {
        auto wc = wait(1);
        REQUIRE(wc.size() == 1);
        return wc[0].status;
    }
    // Waits (on the completion channel) for n completions.
    std::vector<ibv_wc> wait(size_t n, std::chrono::milliseconds limit = 5s) {
        std::vector<ibv_wc> out;
        const auto deadline = std::chrono::steady_clock::now() + limit;
        while (out.size() < n && std::chrono::steady_clock::now() < deadline) {
            ibv_wc wc[8];
            const int got = api.poll_cq(cq.get(), 8, wc);
            REQUIRE(got >= 0);
            out.insert(out.end(), wc, wc + got);
            if (got > 0) continue;
            REQUIRE(api.req_notify_cq(cq.get(), 0) == 0);
            if (api.poll_cq(cq.get(), 0, wc) == 0) {
                pollfd pf{channel->fd, POLLIN, 0};
                if (::poll(&pf, 1, 50) == 1) {
                    ibv_cq *ev;
                    void *ctxp;
                    REQUIRE(api.get_cq_event(channel.get(), &ev, &ctxp) == 0);
                    CHECK(ev == cq.get());
                    api.ack_cq_events(ev, 1);
                }
            }
        }
        return out;
    }
    void post_recvs(int n) {
        for (int i = 0; i < n; ++i) {
            ibv_recv_wr wr = {};
            wr.wr_id = 1000 + static_cast<uint64_t>(i);
            ibv_recv_wr *bad;
            REQUIRE(api.post_recv(qp.get(), &wr, &bad) == 0);
        }
    }
    int write(const End &to, uint64_t wr_id, size_t off, size_t len, size_t roff, bool imm, uint32_t imm_value = 0,
              unsigned flags = IBV_SEND_SIGNALED, uint32_t rkey = 0, uint32_t lkey = 0) {
        ibv_sge sge = {reinterpret_cast<uint64_t>(buf.data() + off), static_cast<uint32_t>(len), lkey ? lkey : mr->lkey};
        ibv_send_wr wr = {};
        wr.wr_id = wr_id;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
        wr.imm_data = htonl(imm_value);
        wr.send_flags = flags;
        wr.wr.rdma.remote_addr = reinterpret_cast<uint64_t>(to.buf.data() + roff);
        wr.wr.rdma.rkey = rkey ? rkey : to.mr->rkey;
        ibv_send_wr *bad;
        return api.post_send(qp.get(), &wr, &bad);
    }
};

void connect(End &a, End &b, uint8_t rnr_retry = 7) {
    for (End *e : {&a, &b}) REQUIRE(qp_to_init(api, e->qp.get(), 1).ok());
    REQUIRE(qp_to_rtr(api, a.qp.get(), a.path_to(b, rnr_retry)).ok());
    REQUIRE(qp_to_rtr(api, b.qp.get(), b.path_to(a, rnr_retry)).ok());
    REQUIRE(qp_to_rts(api, a.qp.get(), a.path_to(b, rnr_retry)).ok());
    REQUIRE(qp_to_rts(api, b.qp.get(), b.path_to(a, rnr_retry)).ok());
}

}  // namespace

TEST_CASE("the emulated device looks like a RoCE NIC and auto-selects a routable RoCE v2 GID", "[verbs]") {
    int n = 0;
    ibv_device **list = api.get_device_list(&n);
    REQUIRE(n == 1);
    CHECK(std::string(api.get_device_name(list[0])) == kEmulatedDeviceName);
    api.free_device_list(list);
    End e;
    CHECK(e.port.attr.state == IBV_PORT_ACTIVE);
    CHECK(e.port.attr.link_layer == IBV_LINK_LAYER_ETHERNET);
    CHECK(e.port.attr.lid != 0);
    // Index 0/1: link-local (not routable, never chosen); the choice is an IPv4-mapped RoCE v2 GID.
    ibv_gid_entry ll{};
    REQUIRE(api.query_gid_ex(e.ctx.get(), 1, 0, &ll) == 0);
    CHECK((ll.gid.raw[0] == 0xfe && ll.gid.raw[1] == 0x80));
    ibv_gid_entry chosen{};
    REQUIRE(api.query_gid_ex(e.ctx.get(), 1, e.port.gid_index, &chosen) == 0);
    CHECK(chosen.gid_type == IBV_GID_TYPE_ROCE_V2);
    CHECK((chosen.gid.raw[10] == 0xff && chosen.gid.raw[11] == 0xff));
    CHECK_THAT(e.port.gid_text, Catch::Contains("::ffff:") && Catch::Contains("RoCE v2"));
    CHECK_FALSE(query_port(api, e.ctx.get(), 1, "999").ok());
    CHECK_FALSE(query_port(api, e.ctx.get(), 2, "auto").ok());
}

TEST_CASE("RC QPs move only through RESET, INIT, RTR, RTS with the required attributes", "[verbs]") {
    End a, b;
    ibv_recv_wr rwr = {};
    ibv_recv_wr *rbad;
    CHECK(api.post_recv(a.qp.get(), &rwr, &rbad) == EINVAL);  // RESET: no receives
    ibv_qp_attr attr = {};
    attr.qp_state = IBV_QPS_RTS;
    CHECK(api.modify_qp(a.qp.get(), &attr, IBV_QP_STATE) == EINVAL);  // RESET -> RTS
    REQUIRE(qp_to_init(api, a.qp.get(), 1).ok());
    CHECK(a.write(b, 1, 0, 8, 0, false) == EINVAL);  // INIT: no sends
    CHECK(api.post_recv(a.qp.get(), &rwr, &rbad) == 0);
    attr = {};
    attr.qp_state = IBV_QPS_RTR;
    CHECK(api.modify_qp(a.qp.get(), &attr, IBV_QP_STATE | IBV_QP_PATH_MTU) == EINVAL);  // mask incomplete
    QpPath p = a.path_to(b);
    p.sgid_index = 200;
    CHECK_FALSE(qp_to_rtr(api, a.qp.get(), p).ok());  // no such source GID
    REQUIRE(qp_to_rtr(api, a.qp.get(), a.path_to(b)).ok());
    CHECK(a.write(b, 1, 0, 8, 0, false) == EINVAL);  // RTR: still no sends
    REQUIRE(qp_to_rts(api, a.qp.get(), a.path_to(b)).ok());
}

TEST_CASE("WRITE and WRITE_WITH_IMM land in the peer's registered memory, in order, with completions", "[verbs]") {
    End a, b;
    connect(a, b);
    b.post_recvs(2);
    for (size_t i = 0; i < 4096; ++i) a.buf[i] = static_cast<uint8_t>(i * 7 + 1);
    // Unsignalled WRITE, then signalled WRITE_WITH_IMM: one send completion, one receive.
    REQUIRE(a.write(b, 1, 0, 2048, 100, false, 0, 0) == 0);
    REQUIRE(a.write(b, 2, 2048, 2048, 100 + 2048, true, 0xdead01) == 0);
    auto ra = a.wait(1);
    REQUIRE(ra.size() == 1);
    CHECK(ra[0].status == IBV_WC_SUCCESS);
    CHECK(ra[0].wr_id == 2);
    CHECK(ra[0].opcode == IBV_WC_RDMA_WRITE);
    auto rb = b.wait(1);
    REQUIRE(rb.size() == 1);
    CHECK(rb[0].status == IBV_WC_SUCCESS);
    CHECK(rb[0].opcode == IBV_WC_RECV_RDMA_WITH_IMM);
    CHECK(rb[0].wr_id == 1000);
    CHECK(ntohl(rb[0].imm_data) == 0xdead01);
    CHECK(rb[0].byte_len == 2048);
    CHECK((rb[0].wc_flags & IBV_WC_WITH_IMM));
    CHECK(std::memcmp(b.buf.data() + 100, a.buf.data(), 4096) == 0);  // both writes, before the receive completed
    // Inline: the source may change right after posting.
    std::memcpy(a.buf.data(), "inline!", 8);
    REQUIRE(a.write(b, 3, 0, 8, 0, true, 7, IBV_SEND_SIGNALED | IBV_SEND_INLINE) == 0);
    std::memcpy(a.buf.data(), "changed", 8);
    REQUIRE(a.wait(1).size() == 1);
    REQUIRE(b.wait(1).size() == 1);
    CHECK(std::memcmp(b.buf.data(), "inline!", 8) == 0);
    // Many writes to one place: the last one wins (in-order delivery).
    b.post_recvs(1);
    for (uint8_t k = 0; k < 50; ++k) {
        a.buf[k] = k;
        REQUIRE(a.write(b, 10 + k, k, 1, 5000, k == 49, 0, k == 49 ? IBV_SEND_SIGNALED : 0) == 0);
    }
    REQUIRE(b.wait(1).size() == 1);
    CHECK(b.buf[5000] == 49);
}

TEST_CASE("a write with a bad rkey, out of bounds or to a region without remote access fails as a remote access error",
          "[verbs]") {
    SECTION("bad rkey") {
        End a, b;
        connect(a, b);
        REQUIRE(a.write(b, 1, 0, 64, 0, false, 0, IBV_SEND_SIGNALED, b.mr->rkey ^ 0x100) == 0);
        auto wc = a.wait(1);
        REQUIRE(wc.size() == 1);
        CHECK(wc[0].status == IBV_WC_REM_ACCESS_ERR);
        CHECK(std::string(ibv_wc_status_str(wc[0].status)) == "remote access error");
        // The requester's QP is in ERROR now: what is posted next is flushed.
        REQUIRE(a.write(b, 2, 0, 64, 0, false) == 0);
        auto flushed = a.wait(1);
        REQUIRE(flushed.size() == 1);
        CHECK(flushed[0].status == IBV_WC_WR_FLUSH_ERR);
    }
    SECTION("out of bounds") {
        End a, b;
        connect(a, b);
        REQUIRE(a.write(b, 1, 0, 64, b.buf.size() - 32, false) == 0);
        CHECK(a.next_status() == IBV_WC_REM_ACCESS_ERR);
    }
    SECTION("no REMOTE_WRITE on the region") {
        End a, b(IBV_ACCESS_LOCAL_WRITE);
        connect(a, b);
        REQUIRE(a.write(b, 1, 0, 64, 0, false) == 0);
        CHECK(a.next_status() == IBV_WC_REM_ACCESS_ERR);
    }
    SECTION("deregistered under the peer") {
        End a, b;
        connect(a, b);
        const uint32_t rkey = b.mr->rkey;
        b.mr.reset();
        REQUIRE(a.write(b, 1, 0, 64, 0, false, 0, IBV_SEND_SIGNALED, rkey) == 0);
        CHECK(a.next_status() == IBV_WC_REM_ACCESS_ERR);
    }
    SECTION("bad lkey") {
        End a, b;
        connect(a, b);
        REQUIRE(a.write(b, 1, 0, 64, 0, false, 0, IBV_SEND_SIGNALED, 0, a.mr->lkey ^ 0x100) == 0);
        CHECK(a.next_status() == IBV_WC_LOC_PROT_ERR);
    }
}

TEST_CASE("a WRITE_WITH_IMM without a posted receive: RNR retries, then an error; a late receive completes it",
          "[verbs]") {
    SECTION("rnr_retry 1: the retries run out") {
        End a, b;
        connect(a, b, 1);
        REQUIRE(a.write(b, 1, 0, 64, 0, true, 5) == 0);
        CHECK(a.next_status() == IBV_WC_RNR_RETRY_EXC_ERR);
        CHECK(b.wait(1, 100ms).empty());
    }
    SECTION("rnr_retry 7 (forever): a receive posted later takes it") {
        End a, b;
        connect(a, b, 7);
        REQUIRE(a.write(b, 1, 0, 64, 0, true, 5) == 0);
        CHECK(a.wait(1, 200ms).empty());
        b.post_recvs(1);
        CHECK(a.next_status() == IBV_WC_SUCCESS);
        REQUIRE(b.wait(1).size() == 1);
    }
}

TEST_CASE("a peer that is gone fails the requests in flight with a retry error, not a hang", "[verbs]") {
    End a;
    auto b = std::make_unique<End>();
    connect(a, *b);
    b->post_recvs(1);
    REQUIRE(a.write(*b, 1, 0, 64, 0, true, 1) == 0);
    REQUIRE(a.wait(1).size() == 1);
    // The peer's context goes away (its process died): its NIC stops answering.
    End &bb = *b;
    bb.qp.reset();
    const uint32_t rkey = bb.mr->rkey;
    const uint64_t raddr = reinterpret_cast<uint64_t>(bb.buf.data());
    bb.mr.reset();
    bb.cq.reset();
    bb.channel.reset();
    bb.pd.reset();
    bb.ctx.reset();
    ibv_sge sge = {reinterpret_cast<uint64_t>(a.buf.data()), 64, a.mr->lkey};
    ibv_send_wr wr = {};
    wr.wr_id = 9;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    ibv_send_wr *bad;
    REQUIRE(api.post_send(a.qp.get(), &wr, &bad) == 0);
    auto wc = a.wait(1, 10s);
    REQUIRE(wc.size() == 1);
    CHECK(wc[0].status == IBV_WC_RETRY_EXC_ERR);
}

TEST_CASE("completion channels signal once per armed CQ and honour O_NONBLOCK", "[verbs]") {
    End a, b;
    connect(a, b);
    ::fcntl(b.channel->fd, F_SETFL, ::fcntl(b.channel->fd, F_GETFL) | O_NONBLOCK);
    ibv_cq *cq;
    void *ctxp;
    CHECK(api.get_cq_event(b.channel.get(), &cq, &ctxp) == -1);
    CHECK(errno == EAGAIN);
    b.post_recvs(2);
    REQUIRE(api.req_notify_cq(b.cq.get(), 0) == 0);
    REQUIRE(a.write(b, 1, 0, 8, 0, true, 1) == 0);
    REQUIRE(a.write(b, 2, 0, 8, 0, true, 2) == 0);
    pollfd pf{b.channel->fd, POLLIN, 0};
    REQUIRE(::poll(&pf, 1, 5000) == 1);
    REQUIRE(api.get_cq_event(b.channel.get(), &cq, &ctxp) == 0);
    CHECK(cq == b.cq.get());
    api.ack_cq_events(cq, 1);
    // Both writes acknowledged: the responder completed both receives before it answered. The
    // second completion came to an unarmed CQ: no second event.
    REQUIRE(a.wait(2).size() == 2);
    CHECK(::poll(&pf, 1, 0) == 0);
    CHECK(api.get_cq_event(b.channel.get(), &cq, &ctxp) == -1);
    ibv_wc wc[4];
    CHECK(api.poll_cq(b.cq.get(), 4, wc) == 2);
}

TEST_CASE("writes cross process boundaries: a forked responder sees the data and the immediate", "[verbs]") {
    int to_child[2], to_parent[2];
    REQUIRE(::pipe(to_child) == 0);
    REQUIRE(::pipe(to_parent) == 0);
    struct Info {
        uint32_t qpn;
        uint16_t lid;
        ibv_gid gid;
        uint64_t addr;
        uint32_t rkey;
    };
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        // The responder: its own device context, memory and NIC threads.
        int rc = 1;
        {
            End b;
            Info mine{b.qp->qp_num, b.port.attr.lid, b.port.gid, reinterpret_cast<uint64_t>(b.buf.data()), b.mr->rkey};
            Info theirs{};
            if (::write(to_parent[1], &mine, sizeof mine) == sizeof mine &&
                ::read(to_child[0], &theirs, sizeof theirs) == sizeof theirs) {
                QpPath p = b.path_to(b);
                p.dgid = theirs.gid;
                p.dlid = theirs.lid;
                p.dest_qpn = theirs.qpn;
                p.timeout = 18;  // 1.07 s x 8 transmissions: a process under a sanitizer, on a busy machine
                if (qp_to_init(api, b.qp.get(), 1).ok() && (b.post_recvs(1), true) && qp_to_rtr(api, b.qp.get(), p).ok() &&
                    qp_to_rts(api, b.qp.get(), p).ok()) {
                    char go = 1;
                    (void)!::write(to_parent[1], &go, 1);
                    auto wc = b.wait(1, 10s);
                    bool ok = wc.size() == 1 && wc[0].status == IBV_WC_SUCCESS && ntohl(wc[0].imm_data) == 42;
                    for (size_t i = 0; ok && i < 65536; ++i) ok = b.buf[i] == static_cast<uint8_t>(i % 251);
                    rc = ok ? 0 : 2;
                    // Stay until the requester has its acknowledgement: a responder that goes away
                    // right after its receive completed may take the ACK with it (a real HCA's QP
                    // does too when its process exits), and the requester then sees a retry error.
                    pollfd done{to_child[0], POLLIN, 0};
                    (void)::poll(&done, 1, 10000);
                }
            }
        }
        ::_exit(rc);
    }
    ::close(to_parent[1]);  // a child that fails early ends the reads below with EOF
    ::close(to_child[0]);
    End a;
    Info theirs{};
    REQUIRE(::read(to_parent[0], &theirs, sizeof theirs) == sizeof theirs);
    Info mine{a.qp->qp_num, a.port.attr.lid, a.port.gid, 0, 0};
    REQUIRE(::write(to_child[1], &mine, sizeof mine) == sizeof mine);
    QpPath p = a.path_to(a);
    p.dgid = theirs.gid;
    p.dlid = theirs.lid;
    p.dest_qpn = theirs.qpn;
    // The responder is another process, scheduled when the machine gets to it (under ThreadSanitizer
    // next to another suite it once took longer than the 2 s the default allows): 1.07 s x 8.
    p.timeout = 18;
    REQUIRE(qp_to_init(api, a.qp.get(), 1).ok());
    REQUIRE(qp_to_rtr(api, a.qp.get(), p).ok());
    REQUIRE(qp_to_rts(api, a.qp.get(), p).ok());
    char go;
    REQUIRE(::read(to_parent[0], &go, 1) == 1);
    for (size_t i = 0; i < 65536; ++i) a.buf[i] = static_cast<uint8_t>(i % 251);
    ibv_sge sge = {reinterpret_cast<uint64_t>(a.buf.data()), 65536, a.mr->lkey};
    ibv_send_wr wr = {};
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(42);
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = theirs.addr;
    wr.wr.rdma.rkey = theirs.rkey;
    ibv_send_wr *bad;
    REQUIRE(api.post_send(a.qp.get(), &wr, &bad) == 0);
    auto wc = a.wait(1, 10s);
    const char done = 1;
    (void)!::write(to_child[1], &done, 1);  // the responder may go now
    REQUIRE(wc.size() == 1);
    CHECK(wc[0].status == IBV_WC_SUCCESS);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    for (int fd : {to_child[1], to_parent[0]}) ::close(fd);
}
