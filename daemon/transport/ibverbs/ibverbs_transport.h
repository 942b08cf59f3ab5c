// ibverbs transport: ringd's links over InfiniBand / RoCE RC queue pairs (rdma-core), or over the
// software RDMA device (`ibverbs.provider: emulated`) where there is no NIC.
//
// Built like DiDi PS's and NCCL's IB transport:
// - One device context, PD, completion channel and CQ per transport; every region (slots, the
//   ring's staging) registered once, LOCAL_WRITE | REMOTE_WRITE; nothing is registered per op
//   (TransportStats::registrations proves it).
// - A link is `ibverbs.qps_per_link` RC QPs to one peer (several QPs give RoCE v2 ECMP different
//   flows) plus a registered FIFO of proto::ClearToSend entries. Bring-up runs once, on the
//   link's authenticated data connection: both ends send proto::RdmaLinkInfo (QPNs, PSNs, GID,
//   LID, MTU, FIFO address and rkey), move their QPs INIT → RTR → RTS, pre-post receives and
//   send RdmaLinkReady. That connection then only tells when the peer is gone (EOF).
// - Receiver-driven flow control: post_recv writes a ClearToSend (address, rkey, length, tag)
//   into the sender's FIFO with RDMA WRITE_WITH_IMM; post_send writes the message with RDMA
//   WRITE_WITH_IMM straight into that address once its ClearToSend is in — the sender can never
//   overrun the receiver, and the receiver's memory (staging or the slot itself) is the
//   destination: no bounce copy. At most fifo_entries receives are announced at a time (the
//   FIFO's credits); the rest wait in order.
// - Many writes in flight on every QP; data writes signalled (their completion is SendDone),
//   ClearToSend writes inline and signalled only every 32nd to free send-queue slots; messages up
//   to the device's inline limit go inline. Receives are re-posted as they are consumed.
// - poll() drains the CQ; when it must wait it arms the CQ and sleeps on the completion channel
//   and the links' connections (config `poll` decides whether the ring waits at all).
// - Any work-completion error fails its link for good with the peer's name and
//   ibv_wc_status_str; the ring engine turns that into the same fault path as TCP's.
//
// Threading: like every transport — registration from one thread at a time (regions_ belongs to
// it); links and poll() from the progress thread. post_send/post_recv take the MR's keys from the
// RegionHandle and never read regions_, which the control thread changes as trainers come and go.
#pragma once

#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include "daemon/transport/ibverbs/verbs.h"
#include "daemon/transport/transport.h"
#include "proto/rdma.h"

namespace ringd {

struct IbverbsOptions {
    std::string provider = "hardware";  // hardware | emulated
    std::string device = "auto";
    uint8_t port = 1;
    std::string gid_index = "auto";
    uint32_t mtu = 0;  // bytes (256..4096); 0: the port's active MTU
    uint32_t qps_per_link = 1;
    uint8_t timeout = 14;   // local ACK timeout 4.096 us x 2^timeout
    uint8_t retry_cnt = 7;
    uint8_t rnr_retry = 7;  // 7: retry forever (a receive is always posted before its ClearToSend)
    uint32_t fifo_entries = 128;
};

class IbverbsTransport;

class IbverbsLink final : public Link {
public:
    ~IbverbsLink() override;
    Status post_send(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) override;
    Status post_recv(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) override;
    uint32_t qp_count() const { return static_cast<uint32_t>(qps_.size()); }

private:
    friend class IbverbsTransport;
    IbverbsLink(IbverbsTransport &t, std::string peer, UniqueFd conn);

    struct PendingSend {
        uint64_t seq;
        uint64_t addr;
        uint32_t lkey;
        uint64_t bytes;
        uint64_t tag;
    };
    struct PostedRecv {
        uint64_t tag;
        uint64_t bytes;
        uint64_t addr;
        uint32_t rkey;
        bool done;
    };
    struct SendQueue {  // one QP's send-queue slots
        uint64_t posted = 0, completed = 0;  // WRs; a signalled completion completes all before it
        uint32_t unsignaled = 0;             // since the last signalled WR
        std::deque<uint64_t> signaled_at;    // posted index of each signalled WR in flight
    };

    Status create_qps();
    proto::RdmaLinkInfo local_info() const;
    Status connect(const proto::RdmaLinkInfo &peer);
    Status post_receives(uint32_t q, uint32_t n);
    bool sq_room(uint32_t q) const;
    Status post_write(uint32_t q, uint64_t wr_id, uint64_t addr, uint32_t lkey, uint64_t bytes, uint64_t raddr,
                      uint32_t rkey, uint32_t imm, bool signaled);
    void try_send();
    void flush_cts();
    void on_completion(const ibv_wc &wc, uint32_t q);
    void fail(int code, const std::string &why);

    IbverbsTransport &t_;
    UniqueFd conn_;  // the bring-up connection; its EOF = the peer is gone
    std::vector<verbs::QueuePair> qps_;
    std::vector<SendQueue> sq_;
    std::unique_ptr<proto::ClearToSend[]> fifo_;  // written by the peer
    verbs::MemoryRegion fifo_mr_;
    std::unique_ptr<proto::ClearToSend[]> cts_out_;  // source of our ClearToSend writes
    verbs::MemoryRegion cts_out_mr_;
    uint32_t entries_ = 0;
    uint32_t psn_[proto::kMaxRdmaQps] = {};
    uint64_t peer_fifo_addr_ = 0;
    uint32_t peer_fifo_rkey_ = 0;
    bool failed_reported_ = false;

    // Sending side.
    uint64_t send_seq_ = 0;   // next message number to post
    uint64_t cts_in_ = 0;     // ClearToSend entries arrived
    std::deque<PendingSend> sends_;  // posted, not yet written
    struct Written {
        uint64_t tag, bytes;
        bool done;
    };
    uint64_t written_base_ = 0;      // message number of written_.front()
    std::deque<Written> written_;    // written, completion outstanding (QPs complete out of order)
    // Receiving side.
    uint64_t recv_base_ = 0;  // message number of recvs_.front()
    std::deque<PostedRecv> recvs_;
    uint64_t cts_next_ = 0;   // next message number to announce
};

class IbverbsTransport final : public NetworkTransport {
public:
    static Result<std::unique_ptr<IbverbsTransport>> create(const verbs::VerbsApi &api, const IbverbsOptions &options);
    ~IbverbsTransport() override;
    std::string_view name() const override { return "ibverbs"; }
    // "mlx5_0 port 1, GID 3 ::ffff:10.0.0.1 (RoCE v2), MTU 4096, 2 QPs per link"
    std::string detail() const override { return description_; }

    Result<std::vector<Link *>> add_links(std::vector<LinkSetup> links,
                                          std::chrono::steady_clock::time_point deadline) override;
    void remove_link(Link *link) override;
    Status poll(std::vector<LinkEvent> &out, int timeout_ms) override;
    int fd() const override { return epoll_.get(); }
    // Shares this transport's device context and protection domain (so its memory regions'
    // keys hold), with a completion channel, CQ and links of its own.
    Result<std::unique_ptr<NetworkTransport>> sibling() override;

protected:
    Result<RegionHandle> do_register(std::byte *base, size_t bytes) override;
    void do_deregister(RegionHandle h) override;

private:
    friend class IbverbsLink;
    IbverbsTransport() = default;
    void drain_cq(std::vector<LinkEvent> &out);
    Status create_cq(const std::string &dev_name);
    ibv_context *ctx() const { return parent_ ? parent_->ctx_.get() : ctx_.get(); }
    ibv_pd *pd() const { return parent_ ? parent_->pd_.get() : pd_.get(); }
    void complete(LinkEvent e) { ready_.push_back(std::move(e)); }

    // Declared in creation order.
    const verbs::VerbsApi *api_ = nullptr;
    IbverbsOptions opt_;
    IbverbsTransport *parent_ = nullptr;  // a sibling's: the owner of the context and PD
    verbs::DeviceContext ctx_;
    verbs::PortInfo port_;
    ibv_mtu mtu_ = IBV_MTU_1024;
    uint32_t max_inline_ = 0;
    verbs::ProtectionDomain pd_;
    verbs::CompletionChannel channel_;
    verbs::CompletionQueue cq_;
    bool armed_ = false;
    unsigned unacked_events_ = 0;
    UniqueFd epoll_;
    // Registration thread only (do_register / do_deregister); the data path never reads it.
    uint64_t next_region_ = 1;
    std::unordered_map<uint64_t, verbs::MemoryRegion> regions_;
    std::vector<std::unique_ptr<IbverbsLink>> links_;
    std::unordered_map<uint32_t, std::pair<IbverbsLink *, uint32_t>> by_qpn_;  // qp_num -> link, QP index
    std::vector<LinkEvent> ready_;
    std::string description_;
};

}  // namespace ringd
