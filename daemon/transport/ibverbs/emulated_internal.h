// Internals of the software RDMA device (emulated_device.h): its objects and the emulated wire.
// Each object embeds the libibverbs struct it stands for as its first member, so that the
// pointers handed to the caller are libibverbs' own types.
//
// Locking: EmuContext::mu guards the context's tables (QPs, MRs) and each QP's queues and state;
// EmuCq::mu a CQ's entries; EmuMr::mu (shared) is held by the NIC threads around each
// non-blocking socket call that touches the region's memory, so that dereg_mr never returns while
// a DMA into or out of the region is under way.
#pragma once

#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/unique_fd.h"
#include "daemon/transport/ibverbs/emulated_device.h"

namespace ringd::verbs::emu {

using Clock = std::chrono::steady_clock;

// Wire format of the emulated link (little-endian, this machine's; both ends are on one host).
struct WireHello {
    uint32_t magic;  // kWireMagic
    uint32_t src_qpn, dest_qpn;
    uint8_t rnr_retry, pad[3];
};
struct WireRequest {
    uint8_t opcode;  // kWrite | kWriteImm
    uint8_t pad[3];
    uint32_t imm;    // as posted (network order)
    uint32_t seq;    // per QP, from 0
    uint32_t rkey;
    uint64_t remote_addr;
    uint32_t length;
    uint32_t pad2;
};
struct WireResponse {
    uint8_t syndrome;  // kAck or a NAK below
    uint8_t pad[3];
    uint32_t seq;
};
static_assert(sizeof(WireHello) == 16 && sizeof(WireRequest) == 32 && sizeof(WireResponse) == 8);
inline constexpr uint32_t kWireMagic = 0x4d454452;  // "RDEM"
enum : uint8_t { kWrite = 1, kWriteImm = 2 };
enum : uint8_t { kAck = 0, kNakAccess = 1, kNakRnr = 2, kNakInvalid = 3 };

inline constexpr uint32_t kMaxSge = 4;
inline constexpr uint32_t kMaxInline = 256;
inline constexpr uint32_t kMaxWr = 1u << 14;
inline constexpr uint64_t kMaxMessage = 1ull << 31;

struct EmuContext;

struct EmuPd {
    ibv_pd pd{};
    EmuContext *ctx = nullptr;
};

struct EmuMr {
    ibv_mr mr{};
    EmuPd *pd = nullptr;
    int access = 0;
    std::shared_mutex mu;
    bool dead = false;  // deregistered: DMA that was under way is discarded
};

struct EmuChannel {
    ibv_comp_channel ch{};
    UniqueFd efd;  // eventfd (semaphore): one count per pending event
    std::mutex mu;
    std::deque<struct EmuCq *> events;
};

struct EmuCq {
    ibv_cq cq{};
    EmuChannel *channel = nullptr;
    std::mutex mu;
    std::deque<ibv_wc> entries;
    size_t capacity = 0;
    bool armed = false;
    bool overrun = false;
    unsigned events_delivered = 0, events_acked = 0;
    std::atomic<int> users{0};  // QPs using it
};

struct SendWqe {
    uint64_t wr_id = 0;
    uint8_t opcode = kWrite;
    bool signaled = false;
    uint32_t imm = 0;
    uint64_t remote_addr = 0;
    uint32_t rkey = 0;
    uint32_t num_sge = 0;
    ibv_sge sge[kMaxSge]{};
    bool is_inline = false;
    uint32_t length = 0;
    uint8_t inline_data[kMaxInline];
    uint32_t seq = 0;
    Clock::time_point sent_at{};
    // A real NIC completes a send only after its DMA engine has read the source: the TX thread
    // sets on_wire once transmit() returned; a response that arrives before that (the responder
    // can answer before sendmsg returns) waits in `response` until it is.
    bool on_wire = false;
    int response = -1;  // the responder's syndrome, once in
};

struct EmuQp {
    ibv_qp qp{};
    EmuContext *ctx = nullptr;
    EmuCq *scq = nullptr, *rcq = nullptr;
    ibv_qp_cap cap{};
    bool sq_sig_all = false;
    // Guarded by ctx->mu.
    int access = 0;
    uint8_t port = 0;
    uint32_t dest_qpn = 0;
    ibv_gid dgid{};
    uint16_t dlid = 0;
    uint8_t timeout = 14, retry_cnt = 7, rnr_retry = 7, min_rnr_timer = 12;
    std::deque<SendWqe> sq;        // posted, not yet on the wire
    std::deque<SendWqe> inflight;  // on the wire, not yet acknowledged
    // The TX thread is reading the source of request `in_transmit_seq` (in_transmit): an error
    // completion for it (a flush, an acknowledgement timeout, a responder that went away) waits in
    // after_transmit until the read is over, as a real NIC completes nothing whose DMA is under way.
    bool in_transmit = false;
    uint32_t in_transmit_seq = 0;
    std::optional<std::pair<SendWqe, ibv_wc_status>> after_transmit;
    std::deque<uint64_t> rq;       // posted receives (wr_id)
    uint32_t next_seq = 0;
    int out_fd = -1;  // requester connection (owned by the TX thread until closed)
    bool connect_failed = false;
    // The RX thread holds dma_mu (shared) around each socket read into registered memory for
    // this QP; moving the QP to ERROR or destroying it sets dma_off under the exclusive lock, so
    // that once that returns no more incoming data lands in the process's memory.
    std::shared_mutex dma_mu;
    bool dma_off = false;
    bool rnr_waiting = false;      // an inbound WRITE_WITH_IMM waits for a receive
    uint32_t unsignaled_done = 0;  // acknowledged unsignalled WRs still holding SQ slots
    bool dead = false;             // destroyed
    ~EmuQp();
};

// A connection as the RX thread sees it.
struct RxConn {
    UniqueFd fd;
    bool outbound = false;               // our requester connection: responses arrive here
    std::shared_ptr<EmuQp> qp;           // outbound: the requester; inbound: set by the hello
    uint8_t peer_rnr_retry = 7;
    bool have_hello = false;
    // Inbound request being received.
    uint8_t buf[sizeof(WireRequest)];
    size_t got = 0;
    bool in_payload = false;
    WireRequest req{};
    std::shared_ptr<EmuMr> target;       // null: payload is discarded
    uint64_t payload_done = 0;
    uint8_t pending_nak = kAck;          // decided before the payload was read
    Clock::time_point rnr_until{};       // waiting for a receive to be posted
    bool rnr_wait = false;
};

struct GidEntry {
    ibv_gid gid{};
    uint32_t type = IBV_GID_TYPE_ROCE_V2;
    uint32_t ifindex = 0;
};

struct EmuContext {
    ibv_context ctx{};
    std::mutex mu;
    std::condition_variable tx_cv;
    std::unordered_map<uint32_t, std::shared_ptr<EmuQp>> qps;
    std::unordered_map<uint32_t, std::shared_ptr<EmuMr>> mrs;  // by key (lkey == rkey)
    uint32_t next_qpn = 0, next_key = 0;
    uint64_t locked_bytes = 0;
    std::vector<GidEntry> gids;
    UniqueFd listener;
    uint16_t lid = 0;  // the listener's port
    UniqueFd rx_epoll, rx_wake;
    bool stopping = false;
    bool tx_work = false;
    std::vector<std::unique_ptr<RxConn>> new_conns;  // outbound connections for the RX thread
    std::thread tx, rx;
};

// A work completion of `qp` (status, opcode and wr_id; the rest as the caller fills it).
inline ibv_wc make_wc(const EmuQp *qp, uint64_t wr_id, ibv_wc_status status, ibv_wc_opcode opcode) {
    ibv_wc wc{};
    wc.wr_id = wr_id;
    wc.status = status;
    wc.opcode = opcode;
    wc.qp_num = qp->qp.qp_num;
    return wc;
}

// The NIC threads (emulated_nic.cpp).
void tx_main(EmuContext *c);
void rx_main(EmuContext *c);
void wake_rx(EmuContext *c);
// Completions and state changes, with ctx->mu held.
void push_cqe(EmuCq *cq, const ibv_wc &wc);
void complete_send(EmuQp *qp, const SendWqe &w, ibv_wc_status status);
// complete_send, or — while the TX thread still reads w's source — once it is done (EmuQp::after_transmit).
void complete_send_after_read(EmuQp *qp, const SendWqe &w, ibv_wc_status status);
void qp_to_error(EmuQp *qp);  // flushes every outstanding work request

}  // namespace ringd::verbs::emu
