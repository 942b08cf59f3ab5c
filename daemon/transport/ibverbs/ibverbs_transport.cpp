#include "daemon/transport/ibverbs/ibverbs_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cstring>
#include <random>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "common/units.h"

namespace ringd {
namespace {

constexpr uint64_t kWrData = 1ull << 63;  // wr_id: a data write (low bits: message number)
constexpr uint64_t kWrCts = 1ull << 62;   // wr_id: a ClearToSend write
constexpr uint32_t kImmMask = proto::kRdmaImmCts - 1;
constexpr uint32_t kCtsSignalEvery = 32;
constexpr int kCqEntries = 1 << 16;
constexpr uint64_t kMaxMessage = 1ull << 30;

Error verbs_error(int err, const std::string &what) {
    if (err == 0) err = EIO;
    return make_error(-err, what + ": " + errno_string(err));
}

ibv_mtu mtu_code(uint32_t bytes) {
    switch (bytes) {
    case 256: return IBV_MTU_256;
    case 512: return IBV_MTU_512;
    case 1024: return IBV_MTU_1024;
    case 2048: return IBV_MTU_2048;
    default: return IBV_MTU_4096;
    }
}

uint32_t mtu_bytes(ibv_mtu m) { return 128u << static_cast<int>(m); }

std::string memlock_hint(size_t bytes) {
    rlimit lim{};
    ::getrlimit(RLIMIT_MEMLOCK, &lim);
    const std::string cur = lim.rlim_cur == RLIM_INFINITY ? "unlimited" : format_bytes(lim.rlim_cur);
    return "cannot register " + format_bytes(bytes) + " for RDMA: the memory-lock limit is too low (RLIMIT_MEMLOCK " +
           cur + "). Set LimitMEMLOCK=infinity in ringd.service (or `ulimit -l unlimited` when run by hand)";
}

// [offset, +bytes) lies inside the registered region. Reads the handle only (see Threading in
// the header): the control thread may be registering other regions meanwhile.
bool inside(const RegionHandle &region, uint64_t offset, uint64_t bytes) {
    return region.id != 0 && offset <= region.bytes && bytes <= region.bytes - offset;
}

}  // namespace

// ---- transport ----

Result<std::unique_ptr<IbverbsTransport>> IbverbsTransport::create(const verbs::VerbsApi &api,
                                                                   const IbverbsOptions &options) {
    std::unique_ptr<IbverbsTransport> t(new IbverbsTransport());
    t->api_ = &api;
    t->opt_ = options;
    std::string dev_name;
    auto ctx = verbs::open_device(api, options.device, dev_name);
    if (!ctx) return ctx.error();
    t->ctx_ = std::move(*ctx);
    auto port = verbs::query_port(api, t->ctx_.get(), options.port, options.gid_index);
    if (!port) return make_error(port.error().code, dev_name + ": " + port.error().message);
    t->port_ = *port;
    t->mtu_ = t->port_.attr.active_mtu;
    if (options.mtu != 0 && mtu_code(options.mtu) < t->mtu_) t->mtu_ = mtu_code(options.mtu);
    ibv_pd *pd = api.alloc_pd(t->ctx_.get());
    if (!pd) return verbs_error(errno, "ibv_alloc_pd on " + dev_name);
    t->pd_ = verbs::ProtectionDomain(&api, pd);
    if (auto s = t->create_cq(dev_name); !s) return s.error();
    t->description_ = dev_name + " port " + std::to_string(options.port) + ", GID " +
                      std::to_string(t->port_.gid_index) + " " + t->port_.gid_text + ", MTU " +
                      std::to_string(mtu_bytes(t->mtu_)) + ", " + std::to_string(options.qps_per_link) +
                      " QP(s) per link (" + api.provider + " provider)";
    return t;
}

// The completion channel, the CQ (every link's QPs share it) and the epoll set poll() waits on.
Status IbverbsTransport::create_cq(const std::string &dev_name) {
    ibv_comp_channel *ch = api_->create_comp_channel(ctx());
    if (!ch) return verbs_error(errno, "ibv_create_comp_channel on " + dev_name);
    channel_ = verbs::CompletionChannel(api_, ch);
    ::fcntl(ch->fd, F_SETFL, ::fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
    // As many entries as the device allows, up to kCqEntries.
    ibv_cq *cq = nullptr;
    for (int entries = kCqEntries; !cq && entries >= 4096; entries /= 4) cq = api_->create_cq(ctx(), entries, this, ch, 0);
    if (!cq) return verbs_error(errno, "ibv_create_cq on " + dev_name);
    cq_ = verbs::CompletionQueue(api_, cq);
    epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_) return verbs_error(errno, "epoll_create1");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;  // the completion channel
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, ch->fd, &ev) != 0) return verbs_error(errno, "epoll_ctl");
    return Ok{};
}

Result<std::unique_ptr<NetworkTransport>> IbverbsTransport::sibling() {
    std::unique_ptr<IbverbsTransport> t(new IbverbsTransport());
    t->api_ = api_;
    t->opt_ = opt_;
    t->parent_ = parent_ ? parent_ : this;
    t->port_ = port_;
    t->mtu_ = mtu_;
    t->description_ = description_;
    if (auto s = t->create_cq(description_); !s) return s.error();
    return std::unique_ptr<NetworkTransport>(std::move(t));
}

IbverbsTransport::~IbverbsTransport() {
    links_.clear();  // QPs and link regions before the CQ and PD
    regions_.clear();
    if (cq_ && unacked_events_) api_->ack_cq_events(cq_.get(), unacked_events_);
}

Result<RegionHandle> IbverbsTransport::do_register(std::byte *base, size_t bytes) {
    if (!base || bytes == 0) return make_error(-EINVAL, "cannot register an empty region");
    ibv_mr *mr = api_->reg_mr(pd(), base, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!mr) {
        const int err = errno;
        if (err == ENOMEM || err == EPERM) return make_error(-err, memlock_hint(bytes));
        return verbs_error(err, "ibv_reg_mr of " + format_bytes(bytes));
    }
    const uint64_t id = next_region_++;
    const RegionHandle h{id, base, bytes, mr->lkey, mr->rkey};
    regions_.emplace(id, verbs::MemoryRegion(api_, mr));
    return h;
}

void IbverbsTransport::do_deregister(RegionHandle h) { regions_.erase(h.id); }

Result<std::vector<Link *>> IbverbsTransport::add_links(std::vector<LinkSetup> setups,
                                                       std::chrono::steady_clock::time_point deadline) {
    std::vector<std::unique_ptr<IbverbsLink>> fresh;
    // The bring-up frames are tagged like control frames when the connection has keys (a
    // secret): the peer's QPs and FIFO key come from the host that proved it.
    std::vector<SessionMac> macs;
    auto seal = [&](size_t i, proto::Bytes frame) {
        return macs[i].enabled() ? seal_frame(macs[i].send, frame) : frame;
    };
    // A frame of `type` with at most `max_payload` bytes, checked against its tag.
    auto receive = [&](size_t i, proto::FrameType type, uint32_t max_payload, const char *what) -> Result<Frame> {
        IbverbsLink &l = *fresh[i];
        std::vector<UniqueFd> no_fds;
        uint8_t hdr[proto::kFrameHeaderBytes];
        auto where = [&](const Error &e) { return make_error(e.code, "link to " + l.peer() + ": " + what + ": " + e.message); };
        if (auto st = recv_exact(l.conn_.get(), hdr, sizeof hdr, deadline, no_fds); !st) return where(st.error());
        const uint32_t tag_bytes = macs[i].enabled() ? kTagBytes : 0;
        auto h = proto::decode_frame_header(hdr, max_payload + tag_bytes);
        if (!h) return where(h.error());
        if (h->type != type)
            return make_error(-EPROTO, "link to " + l.peer() + ": " + what + ": got frame type " +
                                           std::to_string(static_cast<int>(h->type)) +
                                           " (is the peer configured with transport: ibverbs?)");
        Frame f{h->type, proto::Bytes(h->length), {}};
        if (auto st = recv_exact(l.conn_.get(), f.payload.data(), f.payload.size(), deadline, no_fds); !st)
            return where(st.error());
        if (macs[i].enabled())
            if (auto ok = open_frame(macs[i].recv, f); !ok) return where(ok.error());
        return f;
    };
    // 1. Every link: QPs to INIT with receives posted, and our half of the exchange sent.
    for (auto &s : setups) {
        if (s.streams.empty()) return make_error(-EINVAL, "link to " + s.peer + ": no connection");
        macs.emplace_back(s.keys.empty() ? SessionKeys{} : s.keys.front());
        std::unique_ptr<IbverbsLink> l(new IbverbsLink(*this, s.peer, std::move(s.streams.front())));
        if (auto st = l->create_qps(); !st) return make_error(st.error().code, "link to " + s.peer + ": " + st.error().message);
        const auto frame = seal(macs.size() - 1, proto::encode_rdma_link_info(l->local_info()));
        if (auto st = send_all(l->conn_.get(), frame); !st)
            return make_error(st.error().code, "link to " + s.peer + ": sending the QP info: " + st.error().message);
        fresh.push_back(std::move(l));
    }
    // 2. Every link: the peer's info, QPs to RTR and RTS, then "ready".
    for (size_t i = 0; i < fresh.size(); ++i) {
        IbverbsLink &l = *fresh[i];
        auto where = [&](const std::string &what, const Error &e) {
            return make_error(e.code, "link to " + l.peer() + ": " + what + ": " + e.message);
        };
        auto f = receive(i, proto::FrameType::RdmaLinkInfo, proto::kRdmaLinkInfoBytes, "waiting for the peer's QP info");
        if (!f) return f.error();
        auto info = proto::decode_rdma_link_info(f->payload);
        if (!info) return where("QP info", info.error());
        if (auto st = l.connect(*info); !st) return where("bringing the QPs up", st.error());
        if (auto st = send_all(l.conn_.get(), seal(i, proto::encode_rdma_link_ready())); !st) return where("sending ready", st.error());
    }
    // 3. Every peer ready: nothing is written to a QP before its peer can take it.
    for (size_t i = 0; i < fresh.size(); ++i)
        if (auto f = receive(i, proto::FrameType::RdmaLinkReady, 0, "waiting for the peer's QPs"); !f) return f.error();
    std::vector<Link *> out;
    for (auto &l : fresh) {
        const int fd = l->conn_.get();
        ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
        epoll_event ev{};
        ev.events = EPOLLIN | EPOLLRDHUP;
        ev.data.ptr = l.get();
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev);
        for (uint32_t q = 0; q < l->qps_.size(); ++q) by_qpn_[l->qps_[q]->qp_num] = {l.get(), q};
        spdlog::info("ibverbs: link to {} up: {} QP(s), MTU {}, FIFO of {} entries", l->peer(), l->qps_.size(),
                     mtu_bytes(mtu_), l->entries_);
        out.push_back(l.get());
        links_.push_back(std::move(l));
    }
    return out;
}

void IbverbsTransport::remove_link(Link *link) {
    for (auto it = links_.begin(); it != links_.end(); ++it) {
        if (it->get() != link) continue;
        for (auto &qp : (*it)->qps_) by_qpn_.erase(qp->qp_num);
        ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, (*it)->conn_.get(), nullptr);
        links_.erase(it);
        break;
    }
    std::erase_if(ready_, [&](const LinkEvent &e) { return e.link == link; });
    // Completions of the removed QPs still in the CQ are dropped by drain_cq (unknown qp_num).
}

void IbverbsTransport::drain_cq(std::vector<LinkEvent> &out) {
    ibv_wc wc[32];
    for (;;) {
        const int n = api_->poll_cq(cq_.get(), 32, wc);
        if (n < 0) {
            // The CQ overran: completions were lost, so no link can be trusted any more.
            for (auto &l : links_) l->fail(-EIO, "completion queue overrun (ibv_poll_cq " + std::to_string(n) + ")");
            break;
        }
        for (int i = 0; i < n; ++i) {
            auto it = by_qpn_.find(wc[i].qp_num);
            if (it == by_qpn_.end()) continue;  // a removed link's
            it->second.first->on_completion(wc[i], it->second.second);
        }
        if (n < 32) break;
    }
    out.insert(out.end(), std::make_move_iterator(ready_.begin()), std::make_move_iterator(ready_.end()));
    ready_.clear();
}

Status IbverbsTransport::poll(std::vector<LinkEvent> &out, int timeout_ms) {
    const size_t before = out.size();
    drain_cq(out);
    if (out.size() > before && timeout_ms != 0) return Ok{};
    if (timeout_ms != 0 && !armed_) {
        // Arm, then look again: a completion that came before the arming raises no event.
        if (int rc = api_->req_notify_cq(cq_.get(), 0); rc != 0) return verbs_error(rc, "ibv_req_notify_cq");
        armed_ = true;
        drain_cq(out);
        if (out.size() > before) return Ok{};
    }
    epoll_event evs[16];
    const int n = ::epoll_wait(epoll_.get(), evs, 16, out.size() > before ? 0 : timeout_ms);
    if (n < 0 && errno != EINTR) return make_error(-errno, "epoll_wait: " + errno_string(errno));
    for (int i = 0; i < n; ++i) {
        auto *l = static_cast<IbverbsLink *>(evs[i].data.ptr);
        if (!l) {
            ibv_cq *cq;
            void *cq_ctx;
            while (api_->get_cq_event(channel_.get(), &cq, &cq_ctx) == 0) {
                ++unacked_events_;
                armed_ = false;
            }
            if (unacked_events_ >= 64) {
                api_->ack_cq_events(cq_.get(), unacked_events_);
                unacked_events_ = 0;
            }
            continue;
        }
        uint8_t b;
        const ssize_t r = ::recv(l->conn_.get(), &b, 1, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
            l->fail(-ECONNRESET, "host " + l->peer() + " closed the link (its ringd stopped or died" +
                                     (r < 0 ? ": " + errno_string(errno) : std::string()) + ")");
        else if (r > 0)
            l->fail(-EPROTO, "unexpected bytes on the link's connection after bring-up");
        if (l->error()) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, l->conn_.get(), nullptr);
    }
    drain_cq(out);
    return Ok{};
}

// ---- link ----

IbverbsLink::IbverbsLink(IbverbsTransport &t, std::string peer, UniqueFd conn)
    : Link(std::move(peer)), t_(t), conn_(std::move(conn)) {}

IbverbsLink::~IbverbsLink() = default;

Status IbverbsLink::create_qps() {
    const auto &api = *t_.api_;
    const IbverbsOptions &o = t_.opt_;
    entries_ = o.fifo_entries;
    fifo_.reset(new (std::nothrow) proto::ClearToSend[entries_]());
    cts_out_.reset(new (std::nothrow) proto::ClearToSend[entries_]());
    if (!fifo_ || !cts_out_) return make_error(-ENOMEM, "cannot allocate the link's FIFO");
    const size_t fifo_bytes = sizeof(proto::ClearToSend) * entries_;
    ibv_mr *mr = api.reg_mr(t_.pd(), fifo_.get(), fifo_bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    if (!mr) return errno == ENOMEM || errno == EPERM ? make_error(-errno, memlock_hint(fifo_bytes))
                                                      : verbs_error(errno, "ibv_reg_mr (FIFO)");
    fifo_mr_ = verbs::MemoryRegion(&api, mr);
    mr = api.reg_mr(t_.pd(), cts_out_.get(), fifo_bytes, IBV_ACCESS_LOCAL_WRITE);
    if (!mr) return verbs_error(errno, "ibv_reg_mr (FIFO source)");
    cts_out_mr_ = verbs::MemoryRegion(&api, mr);
    std::mt19937 rng(std::random_device{}());
    for (uint32_t q = 0; q < o.qps_per_link; ++q) {
        ibv_qp_init_attr a = {};
        a.send_cq = t_.cq_.get();
        a.recv_cq = t_.cq_.get();
        a.qp_type = IBV_QPT_RC;
        // Data and ClearToSend writes in flight, plus room for the unsignalled ones.
        a.cap.max_send_wr = 2 * entries_ + 2 * kCtsSignalEvery;
        a.cap.max_recv_wr = 2 * entries_ + 16;
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = 1;
        a.cap.max_inline_data = 64;
        ibv_qp *qp = api.create_qp(t_.pd(), &a);
        if (!qp) {  // some devices have no inline data at all
            a.cap.max_inline_data = 0;
            qp = api.create_qp(t_.pd(), &a);
        }
        if (!qp) return verbs_error(errno, "ibv_create_qp (RC, " + std::to_string(a.cap.max_send_wr) + " send WRs)");
        qps_.emplace_back(&api, qp);
        sq_.emplace_back();
        t_.max_inline_ = a.cap.max_inline_data;
        psn_[q] = rng() & 0xffffff;
        if (auto s = verbs::qp_to_init(api, qp, o.port); !s) return s;
        if (auto s = post_receives(q, a.cap.max_recv_wr); !s) return s;
    }
    return Ok{};
}

proto::RdmaLinkInfo IbverbsLink::local_info() const {
    proto::RdmaLinkInfo i;
    i.qps = static_cast<uint32_t>(qps_.size());
    i.fifo_entries = entries_;
    i.lid = t_.port_.attr.lid;
    i.mtu = static_cast<uint8_t>(t_.mtu_);
    std::memcpy(i.gid.data(), t_.port_.gid.raw, 16);
    i.fifo_addr = reinterpret_cast<uint64_t>(fifo_.get());
    i.fifo_rkey = fifo_mr_->rkey;
    for (uint32_t q = 0; q < qps_.size(); ++q) {
        i.qpn[q] = qps_[q]->qp_num;
        i.psn[q] = psn_[q];
    }
    return i;
}

Status IbverbsLink::connect(const proto::RdmaLinkInfo &peer) {
    if (peer.qps != qps_.size() || peer.fifo_entries != entries_)
        return make_error(-EPROTO, "the peer has " + std::to_string(peer.qps) + " QP(s) and " +
                                       std::to_string(peer.fifo_entries) + " FIFO entries per link, this host " +
                                       std::to_string(qps_.size()) + " and " + std::to_string(entries_) +
                                       " (ibverbs.qps_per_link must match)");
    peer_fifo_addr_ = peer.fifo_addr;
    peer_fifo_rkey_ = peer.fifo_rkey;
    const IbverbsOptions &o = t_.opt_;
    for (uint32_t q = 0; q < qps_.size(); ++q) {
        verbs::QpPath p;
        p.port = o.port;
        p.sgid_index = static_cast<uint8_t>(t_.port_.gid_index);
        std::memcpy(p.dgid.raw, peer.gid.data(), 16);
        p.dlid = peer.lid;
        p.global = t_.port_.attr.link_layer == IBV_LINK_LAYER_ETHERNET;  // InfiniBand routes by LID
        p.mtu = std::min(t_.mtu_, static_cast<ibv_mtu>(peer.mtu));
        p.dest_qpn = peer.qpn[q];
        p.rq_psn = peer.psn[q];
        p.sq_psn = psn_[q];
        p.timeout = o.timeout;
        p.retry_cnt = o.retry_cnt;
        p.rnr_retry = o.rnr_retry;
        if (auto s = verbs::qp_to_rtr(*t_.api_, qps_[q].get(), p); !s) return s;
        if (auto s = verbs::qp_to_rts(*t_.api_, qps_[q].get(), p); !s) return s;
    }
    return Ok{};
}

Status IbverbsLink::post_receives(uint32_t q, uint32_t n) {
    // WRITE_WITH_IMM needs a receive but no buffer: zero-length work requests.
    for (uint32_t i = 0; i < n; ++i) {
        ibv_recv_wr wr = {};
        wr.wr_id = q;
        ibv_recv_wr *bad = nullptr;
        if (int rc = t_.api_->post_recv(qps_[q].get(), &wr, &bad); rc != 0) return verbs_error(rc, "ibv_post_recv");
    }
    return Ok{};
}

bool IbverbsLink::sq_room(uint32_t q) const {
    const SendQueue &s = sq_[q];
    return s.posted - s.completed < 2 * entries_ + kCtsSignalEvery;
}

Status IbverbsLink::post_write(uint32_t q, uint64_t wr_id, uint64_t addr, uint32_t lkey, uint64_t bytes,
                               uint64_t raddr, uint32_t rkey, uint32_t imm, bool signaled) {
    SendQueue &s = sq_[q];
    signaled = signaled || s.unsignaled + 1 >= kCtsSignalEvery;
    ibv_sge sge = {};
    sge.addr = addr;
    sge.length = static_cast<uint32_t>(bytes);
    sge.lkey = lkey;
    ibv_send_wr wr = {};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = bytes ? 1 : 0;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(imm);
    wr.send_flags = (signaled ? IBV_SEND_SIGNALED : 0) | (bytes <= t_.max_inline_ ? IBV_SEND_INLINE : 0);
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    ibv_send_wr *bad = nullptr;
    if (int rc = t_.api_->post_send(qps_[q].get(), &wr, &bad); rc != 0) return verbs_error(rc, "ibv_post_send");
    ++s.posted;
    if (signaled) {
        s.signaled_at.push_back(s.posted);
        s.unsignaled = 0;
    } else {
        ++s.unsignaled;
    }
    return Ok{};
}

Status IbverbsLink::post_send(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
    if (error()) return *error();
    if (!inside(region, offset, bytes)) return make_error(-EINVAL, "send outside a registered region");
    if (bytes > kMaxMessage) return make_error(-EMSGSIZE, "message of " + format_bytes(bytes) + " (at most 1GiB)");
    sends_.push_back({send_seq_++, reinterpret_cast<uint64_t>(region.base + offset), region.lkey, bytes, tag});
    try_send();
    if (error()) return *error();
    return Ok{};
}

Status IbverbsLink::post_recv(const RegionHandle &region, uint64_t offset, uint64_t bytes, uint64_t tag) {
    if (error()) return *error();
    if (!inside(region, offset, bytes)) return make_error(-EINVAL, "receive outside a registered region");
    recvs_.push_back({tag, bytes, reinterpret_cast<uint64_t>(region.base + offset), region.rkey, false});
    flush_cts();
    if (error()) return *error();
    return Ok{};
}

// Announces receives to the peer, as far as the FIFO has room: entry k's slot is free again once
// message k - entries_ arrived (the peer read the entry before writing it).
void IbverbsLink::flush_cts() {
    const uint64_t posted = recv_base_ + recvs_.size();
    while (!error() && cts_next_ < posted && cts_next_ < recv_base_ + entries_ && sq_room(0)) {
        const PostedRecv &r = recvs_[cts_next_ - recv_base_];
        const uint32_t slot = static_cast<uint32_t>(cts_next_ % entries_);
        proto::ClearToSend &e = cts_out_[slot];
        e.addr = r.addr;
        e.rkey = r.rkey;
        e.bytes = static_cast<uint32_t>(r.bytes);
        e.tag = r.tag;
        e.seq = cts_next_;
        const uint32_t imm = proto::kRdmaImmCts | static_cast<uint32_t>(cts_next_ & kImmMask);
        if (auto s = post_write(0, kWrCts | cts_next_, reinterpret_cast<uint64_t>(&e), cts_out_mr_->lkey, sizeof e,
                                peer_fifo_addr_ + uint64_t{slot} * sizeof e, peer_fifo_rkey_, imm, false);
            !s) {
            fail(s.error().code, "announcing a receive: " + s.error().message);
            return;
        }
        ++cts_next_;
    }
}

// Writes the posted messages whose ClearToSend arrived, in order.
void IbverbsLink::try_send() {
    while (!error() && !sends_.empty() && sends_.front().seq < cts_in_) {
        const PendingSend &m = sends_.front();
        const uint32_t q = static_cast<uint32_t>(m.seq % qps_.size());
        if (!sq_room(q)) return;
        const proto::ClearToSend e = fifo_[m.seq % entries_];
        if (e.seq != m.seq) {
            fail(-EPROTO, "FIFO entry " + std::to_string(m.seq % entries_) + " holds message " + std::to_string(e.seq) +
                              ", expected " + std::to_string(m.seq));
            return;
        }
        if (e.tag != m.tag || e.bytes != m.bytes) {
            fail(-EPROTO, "message " + std::to_string(m.seq) + " is tag " + std::to_string(m.tag) + " of " +
                              std::to_string(m.bytes) + " bytes here, the peer expects tag " + std::to_string(e.tag) +
                              " of " + std::to_string(e.bytes) + " bytes");
            return;
        }
        const uint32_t imm = static_cast<uint32_t>(m.seq & kImmMask);
        if (auto s = post_write(q, kWrData | m.seq, m.addr, m.lkey, m.bytes, e.addr, e.rkey, imm, true); !s) {
            fail(s.error().code, "writing message " + std::to_string(m.seq) + ": " + s.error().message);
            return;
        }
        written_.push_back({m.tag, m.bytes, false});
        sends_.pop_front();
    }
}

void IbverbsLink::on_completion(const ibv_wc &wc, uint32_t q) {
    if (error()) return;
    if (wc.status != IBV_WC_SUCCESS) {
        // Only wr_id, status, vendor_err and qp_num are defined in an error completion.
        const char *what = (wc.wr_id & kWrData) ? "RDMA write of data"
                           : (wc.wr_id & kWrCts) ? "RDMA write of a ClearToSend"
                                                 : "receive";
        fail(-EIO, std::string(what) +
                       " on QP " + std::to_string(wc.qp_num) + " failed: " + ibv_wc_status_str(wc.status) + " (status " +
                       std::to_string(static_cast<int>(wc.status)) + ", vendor error 0x" +
                       fmt::format("{:x}", wc.vendor_err) + ")");
        return;
    }
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        if (auto s = post_receives(q, 1); !s) {
            fail(s.error().code, "re-posting a receive: " + s.error().message);
            return;
        }
        const uint32_t imm = ntohl(wc.imm_data);
        if (imm & proto::kRdmaImmCts) {
            if ((imm & kImmMask) != (cts_in_ & kImmMask)) {
                fail(-EPROTO, "ClearToSend " + std::to_string(imm & kImmMask) + " out of order");
                return;
            }
            ++cts_in_;
            try_send();
            return;
        }
        // Message number: the first announced, not yet arrived one with these low bits.
        const uint64_t seq = recv_base_ + ((imm - static_cast<uint32_t>(recv_base_ & kImmMask)) & kImmMask);
        if (seq >= cts_next_) {
            fail(-EPROTO, "message " + std::to_string(seq) + " arrived before it was announced");
            return;
        }
        PostedRecv &r = recvs_[seq - recv_base_];
        if (r.done || wc.byte_len != r.bytes) {
            fail(-EPROTO, "message " + std::to_string(seq) + " of " + std::to_string(wc.byte_len) + " bytes for a receive of " +
                              std::to_string(r.bytes));
            return;
        }
        r.done = true;
        bytes_received_ += r.bytes;
        t_.complete({this, LinkEvent::Kind::RecvDone, r.tag, {}});
        while (!recvs_.empty() && recvs_.front().done) {
            recvs_.pop_front();
            ++recv_base_;
        }
        flush_cts();
        return;
    }
    // A signalled write: it and every write before it on this QP are done.
    SendQueue &s = sq_[q];
    if (!s.signaled_at.empty()) {
        s.completed = s.signaled_at.front();
        s.signaled_at.pop_front();
    }
    if (wc.wr_id & kWrData) {
        const uint64_t seq = wc.wr_id & ~kWrData;
        if (seq < written_base_ || seq - written_base_ >= written_.size() || written_[seq - written_base_].done) {
            fail(-EPROTO, "completion for message " + std::to_string(seq) + ", which is not in flight");
            return;
        }
        Written &w = written_[seq - written_base_];
        w.done = true;
        bytes_sent_ += w.bytes;
        t_.complete({this, LinkEvent::Kind::SendDone, w.tag, {}});
        while (!written_.empty() && written_.front().done) {
            written_.pop_front();
            ++written_base_;
        }
    }
    try_send();
    flush_cts();
}

void IbverbsLink::fail(int code, const std::string &why) {
    if (error()) return;
    const Error e = set_error(code, why);
    spdlog::warn("ibverbs: {}", e.message);
    // Everything pending fails: queued and written sends, announced and waiting receives; an
    // idle link still reports its failure once.
    size_t told = 0;
    auto tell = [&](uint64_t tag) {
        t_.complete({this, LinkEvent::Kind::Failed, tag, e});
        ++told;
    };
    for (const auto &m : sends_) tell(m.tag);
    for (const auto &w : written_)
        if (!w.done) tell(w.tag);
    for (const auto &r : recvs_)
        if (!r.done) tell(r.tag);
    if (told == 0) tell(0);
    sends_.clear();
    written_.clear();
    recvs_.clear();
    // The QPs go to the error state: the NIC stops touching our memory and flushes the rest.
    for (auto &qp : qps_) {
        ibv_qp_attr a = {};
        a.qp_state = IBV_QPS_ERR;
        (void)t_.api_->modify_qp(qp.get(), &a, IBV_QP_STATE);
    }
}

}  // namespace ringd
