// The software RDMA device's verbs (emulated_device.h); the NIC threads are in emulated_nic.cpp.
#include "daemon/transport/ibverbs/emulated_device.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include <spdlog/spdlog.h>

#include "daemon/transport/ibverbs/emulated_internal.h"

namespace ringd::verbs::emu {

EmuQp::~EmuQp() {
    if (out_fd >= 0) ::close(out_fd);
}

void push_cqe(EmuCq *cq, const ibv_wc &wc) {
    std::lock_guard lock(cq->mu);
    if (cq->entries.size() >= cq->capacity) {
        cq->overrun = true;
        return;
    }
    cq->entries.push_back(wc);
    if (cq->armed && cq->channel) {
        cq->armed = false;
        std::lock_guard cl(cq->channel->mu);
        cq->channel->events.push_back(cq);
        const uint64_t one = 1;
        (void)!::write(cq->channel->efd.get(), &one, sizeof one);
    }
}

void complete_send(EmuQp *qp, const SendWqe &w, ibv_wc_status status) {
    // A destroyed QP completes nothing: its CQ may be gone already (ibv_destroy_cq after
    // ibv_destroy_qp), while a NIC thread that held the QP still finishes a transmit.
    if (qp->dead) return;
    if (status == IBV_WC_SUCCESS && !w.signaled) {
        ++qp->unsignaled_done;
        return;
    }
    if (status == IBV_WC_SUCCESS) qp->unsignaled_done = 0;
    push_cqe(qp->scq, make_wc(qp, w.wr_id, status, IBV_WC_RDMA_WRITE));
}

void complete_send_after_read(EmuQp *qp, const SendWqe &w, ibv_wc_status status) {
    if (qp->in_transmit && qp->in_transmit_seq == w.seq) qp->after_transmit.emplace(w, status);
    else complete_send(qp, w, status);
}

void qp_to_error(EmuQp *qp) {
    qp->qp.state = IBV_QPS_ERR;
    {
        std::unique_lock dma(qp->dma_mu);  // waits out a read into our memory under way
        qp->dma_off = true;
    }
    for (const SendWqe &w : qp->inflight) complete_send_after_read(qp, w, IBV_WC_WR_FLUSH_ERR);
    qp->inflight.clear();
    for (const SendWqe &w : qp->sq) push_cqe(qp->scq, make_wc(qp, w.wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RDMA_WRITE));
    qp->sq.clear();
    for (uint64_t id : qp->rq) push_cqe(qp->rcq, make_wc(qp, id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV));
    qp->rq.clear();
    qp->unsignaled_done = 0;
    if (qp->out_fd >= 0) ::shutdown(qp->out_fd, SHUT_RDWR);  // the TX thread stops writing to it
}

namespace {

ibv_device g_device = [] {
    ibv_device d{};
    d.node_type = IBV_NODE_CA;
    d.transport_type = IBV_TRANSPORT_IB;
    std::snprintf(d.name, sizeof d.name, "%s", kEmulatedDeviceName);
    std::snprintf(d.dev_name, sizeof d.dev_name, "uverbs-emulated");
    return d;
}();

template <typename T>
T *fail(int e) {
    errno = e;
    return nullptr;
}

EmuContext *ctx_of(ibv_context *c) { return reinterpret_cast<EmuContext *>(c); }
EmuQp *qp_of(ibv_qp *q) { return reinterpret_cast<EmuQp *>(q); }
EmuCq *cq_of(ibv_cq *q) { return reinterpret_cast<EmuCq *>(q); }

// CAP_IPC_LOCK in the effective set: the kernel's memlock limit does not apply.
bool can_lock_without_limit() {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line))
        if (line.rfind("CapEff:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> 14) & 1;
    return false;
}

// A RoCE NIC's GID table: link-local first, then one IPv4-mapped GID per address (loopback
// last), each as RoCE v1 and v2.
std::vector<GidEntry> build_gids(std::mt19937_64 &rng) {
    std::vector<GidEntry> out;
    GidEntry ll;
    ll.gid.raw[0] = 0xfe;
    ll.gid.raw[1] = 0x80;
    const uint64_t eui = rng();
    std::memcpy(ll.gid.raw + 8, &eui, 8);
    for (uint32_t t : {IBV_GID_TYPE_ROCE_V1, IBV_GID_TYPE_ROCE_V2}) {
        ll.type = t;
        out.push_back(ll);
    }
    ifaddrs *ifs = nullptr;
    if (::getifaddrs(&ifs) != 0) return out;
    for (bool loopback : {false, true}) {
        for (ifaddrs *i = ifs; i; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
            if (((i->ifa_flags & IFF_LOOPBACK) != 0) != loopback) continue;
            GidEntry e;
            e.gid.raw[10] = e.gid.raw[11] = 0xff;
            std::memcpy(e.gid.raw + 12, &reinterpret_cast<sockaddr_in *>(i->ifa_addr)->sin_addr, 4);
            e.ifindex = ::if_nametoindex(i->ifa_name);
            for (uint32_t t : {IBV_GID_TYPE_ROCE_V1, IBV_GID_TYPE_ROCE_V2}) {
                e.type = t;
                out.push_back(e);
            }
        }
    }
    ::freeifaddrs(ifs);
    return out;
}

ibv_device **get_device_list(int *num) {
    auto **list = static_cast<ibv_device **>(std::calloc(2, sizeof(ibv_device *)));
    if (!list) return fail<ibv_device *>(ENOMEM);
    list[0] = &g_device;
    if (num) *num = 1;
    return list;
}

void free_device_list(ibv_device **list) { std::free(list); }

const char *get_device_name(ibv_device *d) { return d ? d->name : nullptr; }

ibv_context *open_device(ibv_device *d) {
    if (d != &g_device) return fail<ibv_context>(ENODEV);
    auto c = std::make_unique<EmuContext>();
    c->ctx.device = d;
    c->ctx.cmd_fd = -1;
    c->ctx.async_fd = -1;
    c->ctx.num_comp_vectors = 1;
    std::mt19937_64 rng(std::random_device{}() ^ static_cast<uint64_t>(::getpid()) << 32);
    c->next_qpn = 0x100 + static_cast<uint32_t>(rng() % 0x10000);
    c->next_key = static_cast<uint32_t>(rng() % 0x10000) + 1;
    c->gids = build_gids(rng);
    c->listener = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    c->rx_epoll = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
    c->rx_wake = UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!c->listener || !c->rx_epoll || !c->rx_wake) return fail<ibv_context>(errno);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    socklen_t len = sizeof a;
    if (::bind(c->listener.get(), reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 ||
        ::listen(c->listener.get(), 64) != 0 ||
        ::getsockname(c->listener.get(), reinterpret_cast<sockaddr *>(&a), &len) != 0)
        return fail<ibv_context>(errno);
    c->lid = ntohs(a.sin_port);
    for (int fd : {c->listener.get(), c->rx_wake.get()}) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = fd;
        if (::epoll_ctl(c->rx_epoll.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return fail<ibv_context>(errno);
    }
    try {
        c->rx = std::thread(rx_main, c.get());
        c->tx = std::thread(tx_main, c.get());
    } catch (const std::system_error &) {
        if (c->rx.joinable()) {
            {
                std::lock_guard lock(c->mu);
                c->stopping = true;
            }
            wake_rx(c.get());
            c->rx.join();
        }
        return fail<ibv_context>(EAGAIN);
    }
    spdlog::warn("ibverbs: {} is ringd's software RDMA device, for tests and development only: its NIC runs on this "
                 "machine's CPUs over TCP (LID {} = its port)",
                 kEmulatedDeviceName, c->lid);
    return &c.release()->ctx;
}

int close_device(ibv_context *ctx) {
    EmuContext *c = ctx_of(ctx);
    {
        std::lock_guard lock(c->mu);
        c->stopping = true;
        for (auto &[n, qp] : c->qps)
            if (qp->out_fd >= 0) ::shutdown(qp->out_fd, SHUT_RDWR);
    }
    c->tx_cv.notify_all();
    wake_rx(c);
    if (c->tx.joinable()) c->tx.join();
    if (c->rx.joinable()) c->rx.join();
    delete c;
    return 0;
}

int query_port(ibv_context *ctx, uint8_t port, ibv_port_attr *attr) {
    if (port != 1 || !attr) return EINVAL;
    EmuContext *c = ctx_of(ctx);
    *attr = ibv_port_attr{};
    attr->state = IBV_PORT_ACTIVE;
    attr->max_mtu = IBV_MTU_4096;
    attr->active_mtu = IBV_MTU_4096;
    attr->gid_tbl_len = static_cast<int>(c->gids.size());
    attr->max_msg_sz = static_cast<uint32_t>(kMaxMessage);
    attr->lid = c->lid;
    attr->link_layer = IBV_LINK_LAYER_ETHERNET;
    attr->active_width = 1;
    attr->active_speed = 1;
    attr->phys_state = 5;  // LinkUp
    return 0;
}

int query_gid(ibv_context *ctx, uint8_t port, int index, ibv_gid *gid) {
    EmuContext *c = ctx_of(ctx);
    if (port != 1 || index < 0 || static_cast<size_t>(index) >= c->gids.size()) {
        errno = EINVAL;
        return -1;
    }
    *gid = c->gids[static_cast<size_t>(index)].gid;
    return 0;
}

int query_gid_ex(ibv_context *ctx, uint32_t port, uint32_t index, ibv_gid_entry *e) {
    EmuContext *c = ctx_of(ctx);
    if (port != 1 || index >= c->gids.size()) return EINVAL;
    *e = ibv_gid_entry{};
    e->gid = c->gids[index].gid;
    e->gid_index = index;
    e->port_num = port;
    e->gid_type = c->gids[index].type;
    e->ndev_ifindex = c->gids[index].ifindex;
    return 0;
}

ibv_pd *alloc_pd(ibv_context *ctx) {
    auto *p = new (std::nothrow) EmuPd;
    if (!p) return fail<ibv_pd>(ENOMEM);
    p->pd.context = ctx;
    p->ctx = ctx_of(ctx);
    return &p->pd;
}

int dealloc_pd(ibv_pd *pd) {
    EmuContext *c = ctx_of(pd->context);
    std::lock_guard lock(c->mu);
    for (auto &[k, mr] : c->mrs)
        if (mr->mr.pd == pd) return EBUSY;
    for (auto &[n, qp] : c->qps)
        if (qp->qp.pd == pd) return EBUSY;
    delete reinterpret_cast<EmuPd *>(pd);
    return 0;
}

ibv_mr *reg_mr(ibv_pd *pd, void *addr, size_t length, int access) {
    if (!pd || (!addr && length)) return fail<ibv_mr>(EINVAL);
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) && !(access & IBV_ACCESS_LOCAL_WRITE))
        return fail<ibv_mr>(EINVAL);
    EmuContext *c = ctx_of(pd->context);
    std::lock_guard lock(c->mu);
    // Registration pins the pages; the kernel counts them against RLIMIT_MEMLOCK.
    rlimit lim{};
    if (::getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
        c->locked_bytes + length > lim.rlim_cur && !can_lock_without_limit())
        return fail<ibv_mr>(ENOMEM);
    auto mr = std::make_shared<EmuMr>();
    mr->pd = reinterpret_cast<EmuPd *>(pd);
    mr->access = access;
    mr->mr.context = pd->context;
    mr->mr.pd = pd;
    mr->mr.addr = addr;
    mr->mr.length = length;
    uint32_t key;
    do {
        key = (c->next_key++ & 0xffffff) << 8 | 0x5a;
    } while (key == 0 || c->mrs.count(key));
    mr->mr.lkey = mr->mr.rkey = key;
    mr->mr.handle = key;
    c->locked_bytes += length;
    ibv_mr *out = &mr->mr;
    c->mrs.emplace(key, std::move(mr));
    return out;
}

int dereg_mr(ibv_mr *m) {
    EmuContext *c = ctx_of(m->context);
    std::shared_ptr<EmuMr> mr;
    {
        std::lock_guard lock(c->mu);
        auto it = c->mrs.find(m->lkey);
        if (it == c->mrs.end() || &it->second->mr != m) return EINVAL;
        mr = std::move(it->second);
        c->mrs.erase(it);
        c->locked_bytes -= m->length;
    }
    std::unique_lock dma(mr->mu);  // waits out a socket call into or out of the region
    mr->dead = true;
    return 0;
}

ibv_comp_channel *create_comp_channel(ibv_context *ctx) {
    auto ch = std::make_unique<EmuChannel>();
    ch->efd = UniqueFd(::eventfd(0, EFD_SEMAPHORE | EFD_CLOEXEC));
    if (!ch->efd) return fail<ibv_comp_channel>(errno);
    ch->ch.context = ctx;
    ch->ch.fd = ch->efd.get();
    return &ch.release()->ch;
}

int destroy_comp_channel(ibv_comp_channel *ch) {
    delete reinterpret_cast<EmuChannel *>(ch);
    return 0;
}

ibv_cq *create_cq(ibv_context *ctx, int cqe, void *cq_context, ibv_comp_channel *channel, int comp_vector) {
    if (cqe < 1 || cqe > (1 << 22) || comp_vector != 0) return fail<ibv_cq>(EINVAL);
    auto *q = new (std::nothrow) EmuCq;
    if (!q) return fail<ibv_cq>(ENOMEM);
    q->cq.context = ctx;
    q->cq.channel = channel;
    q->cq.cq_context = cq_context;
    q->cq.cqe = cqe;
    q->capacity = static_cast<size_t>(cqe);
    q->channel = reinterpret_cast<EmuChannel *>(channel);
    return &q->cq;
}

int destroy_cq(ibv_cq *cq) {
    EmuCq *q = cq_of(cq);
    if (q->users.load() > 0) return EBUSY;
    if (q->channel) {
        std::lock_guard lock(q->channel->mu);
        for (auto it = q->channel->events.begin(); it != q->channel->events.end();)
            it = *it == q ? q->channel->events.erase(it) : it + 1;
    }
    delete q;
    return 0;
}

int req_notify_cq(ibv_cq *cq, int) {
    EmuCq *q = cq_of(cq);
    if (!q->channel) return EINVAL;
    std::lock_guard lock(q->mu);
    q->armed = true;
    return 0;
}

int get_cq_event(ibv_comp_channel *ch, ibv_cq **cq, void **cq_context) {
    auto *c = reinterpret_cast<EmuChannel *>(ch);
    uint64_t v;
    if (::read(c->efd.get(), &v, sizeof v) != sizeof v) return -1;  // errno from read (EAGAIN if O_NONBLOCK)
    std::lock_guard lock(c->mu);
    if (c->events.empty()) {  // the CQ was destroyed meanwhile
        errno = EAGAIN;
        return -1;
    }
    EmuCq *q = c->events.front();
    c->events.pop_front();
    ++q->events_delivered;
    *cq = &q->cq;
    *cq_context = q->cq.cq_context;
    return 0;
}

void ack_cq_events(ibv_cq *cq, unsigned n) { cq_of(cq)->events_acked += n; }

int poll_cq(ibv_cq *cq, int n, ibv_wc *wc) {
    EmuCq *q = cq_of(cq);
    std::lock_guard lock(q->mu);
    if (q->overrun) return -EOVERFLOW;
    int got = 0;
    while (got < n && !q->entries.empty()) {
        wc[got++] = q->entries.front();
        q->entries.pop_front();
    }
    return got;
}

ibv_qp *create_qp(ibv_pd *pd, ibv_qp_init_attr *a) {
    if (!pd || !a) return fail<ibv_qp>(EINVAL);
    if (a->qp_type != IBV_QPT_RC || a->srq) return fail<ibv_qp>(EOPNOTSUPP);
    if (!a->send_cq || !a->recv_cq || a->cap.max_send_wr > kMaxWr || a->cap.max_recv_wr > kMaxWr ||
        a->cap.max_send_sge > kMaxSge || a->cap.max_recv_sge > kMaxSge || a->cap.max_inline_data > kMaxInline)
        return fail<ibv_qp>(EINVAL);
    EmuContext *c = ctx_of(pd->context);
    auto qp = std::make_shared<EmuQp>();
    qp->ctx = c;
    qp->scq = cq_of(a->send_cq);
    qp->rcq = cq_of(a->recv_cq);
    qp->cap = a->cap;
    qp->cap.max_send_wr = std::max(1u, a->cap.max_send_wr);
    qp->cap.max_recv_wr = std::max(1u, a->cap.max_recv_wr);
    qp->sq_sig_all = a->sq_sig_all != 0;
    qp->qp.context = pd->context;
    qp->qp.qp_context = a->qp_context;
    qp->qp.pd = pd;
    qp->qp.send_cq = a->send_cq;
    qp->qp.recv_cq = a->recv_cq;
    qp->qp.qp_type = IBV_QPT_RC;
    qp->qp.state = IBV_QPS_RESET;
    a->cap = qp->cap;
    ++qp->scq->users;
    ++qp->rcq->users;
    std::lock_guard lock(c->mu);
    qp->qp.qp_num = c->next_qpn++ & 0xffffff;
    qp->qp.handle = qp->qp.qp_num;
    ibv_qp *out = &qp->qp;
    c->qps.emplace(qp->qp.qp_num, std::move(qp));
    return out;
}

// The attribute masks libibverbs requires per RC transition.
constexpr int kInitMask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
constexpr int kRtrMask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                         IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
constexpr int kRtsMask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                         IBV_QP_MAX_QP_RD_ATOMIC;

int modify_qp(ibv_qp *q, ibv_qp_attr *a, int mask) {
    EmuQp *qp = qp_of(q);
    EmuContext *c = qp->ctx;
    if (!(mask & IBV_QP_STATE)) return EINVAL;
    std::lock_guard lock(c->mu);
    const ibv_qp_state from = qp->qp.state, to = a->qp_state;
    if (to == IBV_QPS_ERR) {
        qp_to_error(qp);
        return 0;
    }
    if (to == IBV_QPS_RESET) {
        qp->sq.clear();
        qp->inflight.clear();
        qp->rq.clear();
        qp->unsignaled_done = 0;
        qp->qp.state = IBV_QPS_RESET;
        return 0;
    }
    if (from == IBV_QPS_RESET && to == IBV_QPS_INIT) {
        if ((mask & kInitMask) != kInitMask || a->port_num != 1) return EINVAL;
        qp->port = a->port_num;
        qp->access = static_cast<int>(a->qp_access_flags);
    } else if (from == IBV_QPS_INIT && to == IBV_QPS_RTR) {
        if ((mask & kRtrMask) != kRtrMask || a->path_mtu > IBV_MTU_4096 || a->dest_qp_num > 0xffffff) return EINVAL;
        // An Ethernet (RoCE) port needs a GRH: a global address with a valid source GID.
        if (!a->ah_attr.is_global || a->ah_attr.grh.sgid_index >= c->gids.size() ||
            (a->ah_attr.port_num && a->ah_attr.port_num != qp->port))
            return EINVAL;
        {
            std::unique_lock dma(qp->dma_mu);
            qp->dma_off = false;
        }
        qp->dest_qpn = a->dest_qp_num;
        qp->dgid = a->ah_attr.grh.dgid;
        qp->dlid = a->ah_attr.dlid;
        qp->min_rnr_timer = a->min_rnr_timer;
    } else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS) {
        if ((mask & kRtsMask) != kRtsMask || a->retry_cnt > 7 || a->rnr_retry > 7) return EINVAL;
        qp->timeout = a->timeout;
        qp->retry_cnt = a->retry_cnt;
        qp->rnr_retry = a->rnr_retry;
    } else if (!(from == to && from != IBV_QPS_RESET)) {
        return EINVAL;
    }
    qp->qp.state = to;
    return 0;
}

int destroy_qp(ibv_qp *q) {
    EmuQp *qp = qp_of(q);
    EmuContext *c = qp->ctx;
    std::shared_ptr<EmuQp> keep;
    {
        std::lock_guard lock(c->mu);
        auto it = c->qps.find(q->qp_num);
        if (it == c->qps.end() || it->second.get() != qp) return EINVAL;
        keep = std::move(it->second);
        c->qps.erase(it);
        qp->dead = true;
        {
            std::unique_lock dma(qp->dma_mu);
            qp->dma_off = true;
        }
        qp->sq.clear();
        qp->inflight.clear();
        qp->rq.clear();
        qp->after_transmit.reset();  // the TX thread may still be reading its source
        if (qp->out_fd >= 0) ::shutdown(qp->out_fd, SHUT_RDWR);
        --qp->scq->users;
        --qp->rcq->users;
    }
    wake_rx(c);  // drops the QP's connections
    return 0;
}

int post_send(ibv_qp *q, ibv_send_wr *wr, ibv_send_wr **bad) {
    EmuQp *qp = qp_of(q);
    EmuContext *c = qp->ctx;
    int rc = 0;
    {
        std::lock_guard lock(c->mu);
        c->tx_work = true;  // also for the WRs queued before a bad one
        rc = [&] {
        for (; wr; wr = wr->next) {
            *bad = wr;
            if (qp->qp.state != IBV_QPS_RTS && qp->qp.state != IBV_QPS_ERR) return EINVAL;
            if (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) return EINVAL;
            if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp->cap.max_send_sge) return EINVAL;
            if (qp->sq.size() + qp->inflight.size() + qp->unsignaled_done >= qp->cap.max_send_wr) return ENOMEM;
            SendWqe w;
            w.wr_id = wr->wr_id;
            w.opcode = wr->opcode == IBV_WR_RDMA_WRITE ? kWrite : kWriteImm;
            w.signaled = qp->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
            w.imm = wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ? wr->imm_data : 0;
            w.remote_addr = wr->wr.rdma.remote_addr;
            w.rkey = wr->wr.rdma.rkey;
            uint64_t total = 0;
            for (int i = 0; i < wr->num_sge; ++i) total += wr->sg_list[i].length;
            if (total > kMaxMessage) return EINVAL;
            w.length = static_cast<uint32_t>(total);
            if (wr->send_flags & IBV_SEND_INLINE) {
                if (total > qp->cap.max_inline_data) return EINVAL;
                w.is_inline = true;
                uint32_t at = 0;
                for (int i = 0; i < wr->num_sge; ++i) {
                    std::memcpy(w.inline_data + at, reinterpret_cast<const void *>(wr->sg_list[i].addr),
                                wr->sg_list[i].length);
                    at += wr->sg_list[i].length;
                }
            } else {
                w.num_sge = static_cast<uint32_t>(wr->num_sge);
                for (int i = 0; i < wr->num_sge; ++i) w.sge[i] = wr->sg_list[i];
            }
            if (qp->qp.state == IBV_QPS_ERR) {  // accepted and flushed at once
                complete_send(qp, w, IBV_WC_WR_FLUSH_ERR);
                continue;
            }
            qp->sq.push_back(w);
        }
        *bad = nullptr;
        return 0;
        }();
    }
    c->tx_cv.notify_one();
    return rc;
}

int post_recv(ibv_qp *q, ibv_recv_wr *wr, ibv_recv_wr **bad) {
    EmuQp *qp = qp_of(q);
    EmuContext *c = qp->ctx;
    bool wake = false;
    {
        std::lock_guard lock(c->mu);
        for (; wr; wr = wr->next) {
            *bad = wr;
            if (qp->qp.state == IBV_QPS_RESET) return EINVAL;
            if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp->cap.max_recv_sge) return EINVAL;
            if (qp->rq.size() >= qp->cap.max_recv_wr) return ENOMEM;
            if (qp->qp.state == IBV_QPS_ERR) {
                push_cqe(qp->rcq, make_wc(qp, wr->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV));
                continue;
            }
            qp->rq.push_back(wr->wr_id);
        }
        *bad = nullptr;
        wake = qp->rnr_waiting;
    }
    if (wake) wake_rx(c);
    return 0;
}

const VerbsApi kEmulated = {
    "emulated",
    get_device_list,
    free_device_list,
    get_device_name,
    open_device,
    close_device,
    query_port,
    query_gid,
    query_gid_ex,
    alloc_pd,
    dealloc_pd,
    reg_mr,
    dereg_mr,
    create_comp_channel,
    destroy_comp_channel,
    create_cq,
    destroy_cq,
    req_notify_cq,
    get_cq_event,
    ack_cq_events,
    poll_cq,
    create_qp,
    modify_qp,
    destroy_qp,
    post_send,
    post_recv,
};

}  // namespace
}  // namespace ringd::verbs::emu

namespace ringd::verbs {
const VerbsApi &emulated_verbs() { return emu::kEmulated; }
}  // namespace ringd::verbs
