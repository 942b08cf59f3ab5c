// libringd-client, device buffers: registration of GPU memory with ringd (VMM allocations as
// POSIX fds, cudaMalloc-family buffers as legacy IPC handles), ops on them staged through the slot,
// and stream order through the slot's sync words (proto/slot.h). The CUDA driver is loaded on
// first use (RINGD_CUDA_PROVIDER: hardware, the default, or emulated); without one these entry
// points fail with -ENODEV and the rest of the library works as ever.
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <deque>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "client/lib/client_internal.h"

#ifdef RINGD_HAVE_CUDA
#include "common/cuda/cuda_api.h"

namespace {

constexpr uint64_t kStagingAlign = 256;
constexpr size_t kReadyOffset = offsetof(proto::SlotHeader, cuda_ready);
constexpr size_t kDoneOffset = offsetof(proto::SlotHeader, cuda_done);
constexpr size_t kProbeOffset = offsetof(proto::SlotHeader, cuda_probe);
constexpr auto kCloseBound = std::chrono::seconds(10);  // ringd_close waits this long for queued GPU work
constexpr uint64_t kPartBytes = 16 << 20;  // device ops larger than this go as parts (pipelined)
constexpr uint64_t kMinDefaultPart = 64 << 10;
constexpr uint64_t kMaxRanges = 16;         // staging ranges of one device op (its parts cycle through them)
// While parts wait for a staging range and the caller holds the client (a call that may return
// and leave the client to the watcher), the watcher looks again this often: not a spin while the
// caller waits in ringd_wait, which hands parts over itself.
constexpr int kPumpRetryMs = 5;

// The part size when none was set: a quarter of the staging room, in whole pages (one part copied
// in, one on the ring, one copied out, one spare, as ringd.torch sizes them), at least 64 KiB and
// at most 16 MiB. A function of the slot alone, so ranks with slots of one size cut alike.
uint64_t default_part_bytes(uint64_t room) {
    return std::min(kPartBytes, std::max(kMinDefaultPart, room / 4 / 4096 * 4096));
}

std::string hex(uint64_t v) {
    char b[32];
    std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
    return b;
}

}  // namespace

struct ringd_client_detail::CudaClient {
    const cuda::CudaApi *api = nullptr;
    CUdevice device = 0;
    CUcontext ctx = nullptr;  // the device's primary context (retained)
    uint8_t uuid[16] = {};
    bool memops = true;       // stream write/wait value ops (else host functions)
    // RINGD_CUDA_PART_BYTES or ringd_set_cuda_part_bytes: a device op is cut into parts of this;
    // 0: default_part_bytes of the staging room.
    uint64_t part_bytes = 0;
    CUdeviceptr sync = 0;     // the slot header, registered with the driver in this process
    bool host_registered = false;
    // Per queue entry: the seq of the device op that last used it (ringd_stream_wait checks).
    uint64_t device_seq[proto::kQueueDepth] = {};
    // Per trainer stream this library queued work on: an event recorded after its latest work
    // there (ringd_close waits for these, not for the whole context).
    std::vector<std::pair<CUstream, CUevent>> marks;

    struct Alloc {  // ringd_cuda_alloc
        size_t bytes = 0;
        CUmemGenericAllocationHandle handle = 0;
        uint64_t reg = 0;
    };
    std::map<CUdeviceptr, Alloc> allocs;  // by address
    struct Reg {  // ringd_register_cuda
        CUdeviceptr ptr = 0;
        size_t bytes = 0;
    };
    std::map<uint64_t, Reg> regs;  // by registration id
    struct Op {
        uint64_t offset = 0, bytes = 0;  // staging range in the slot
    };
    std::map<uint64_t, Op> ops;  // device ops in flight, by seq (the last part's): their staging windows

    // A device op in parts: its seqs first..last were taken at submission (ready word written for
    // `last`, on which every part's stage-in waits); part k is staged in range k % ranges of its
    // window and goes to ringd once the part before it in that range has ended.
    struct Stream {
        proto::SubmitDesc desc;  // dtype, op, registration: what every part shares
        uint64_t first = 0, last = 0, next = 0;  // next: the next part to hand to ringd
        uint64_t count = 0, per = 0, esize = 0;  // elements in all, per part, element size
        uint64_t reg_offset = 0, staging = 0;
        // part_bytes: a part's staging (a reduce_scatter's or allgather's: its input and output,
        // mult = ranks + 1 times its elements' bytes; an allreduce's: mult = 1).
        uint64_t part_bytes = 0, max_ranges = 0, mult = 1;
        // An all_to_all with split sizes (one part): its sizes, written beside its output in the
        // staging range, and its input's bytes.
        std::vector<uint64_t> splits;
        uint64_t in_bytes = 0;
        std::vector<uint64_t> range_seq;  // per staging range: the part in it (0: free); empty: no window yet
    };
    std::map<uint64_t, Stream> streams;  // by last seq, until the op's ticket settles
    // What waits in the client, in seq order: a stream with parts to go (stream != 0, its last
    // seq), or an op submitted behind one (desc).
    struct Held {
        uint64_t stream = 0;
        proto::SubmitDesc desc{};
    };
    std::deque<Held> backlog;
    std::atomic<bool> pending{false};  // backlog not empty (the watcher reads it unlocked)
    bool closing = false;

    // The watcher: while device ops are in flight it releases their done words if ringd goes
    // away or lets their deadline pass, so that a stream waiting on one never hangs, even when
    // the trainer does not call into the library then.
    std::thread watcher;
    UniqueFd wake{::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)};
    std::mutex mu;
    bool stop = false;
    std::atomic<bool> ringd_gone{false};  // the watcher saw the connection end
    struct Watched {
        uint32_t entry = 0, word = 0;
        Clock::time_point deadline;
    };
    std::map<uint64_t, Watched> watched;  // by seq; under mu
};

namespace {

// Makes the client's context current for the duration, and restores the caller's.
class ContextScope {
public:
    ContextScope(const cuda::CudaApi &api, CUcontext ctx) : api_(api) {
        api_.cuCtxGetCurrent(&saved_);
        if (saved_ != ctx) api_.cuCtxSetCurrent(ctx);
    }
    ~ContextScope() {
        CUcontext now = nullptr;
        api_.cuCtxGetCurrent(&now);
        if (now != saved_) api_.cuCtxSetCurrent(saved_);
    }

private:
    const cuda::CudaApi &api_;
    CUcontext saved_ = nullptr;
};

int driver_fail(ringd_client &c, const std::string &what, CUresult r) {
    return c.fail(r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO, what + ": " + cuda::error_string(*c.cuda->api, r));
}

void release_word(std::atomic<uint32_t> &w, uint32_t value) { w.store(value, std::memory_order_release); }

void watch(ringd_client *c) {
    CudaClient &cc = *c->cuda;
    auto &h = *c->header;
    // The completion eventfd edge-triggered: each of ringd's signals wakes the watcher once, and
    // it never reads the count (that is the caller's, for ringd_wait and ringd_fd).
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    auto add = [&](int fd, uint32_t events) {
        epoll_event ev{};
        ev.events = events;
        ev.data.fd = fd;
        return ep && ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, fd, &ev) == 0;
    };
    const bool watching = add(c->sock.get(), EPOLLRDHUP) && add(cc.wake.get(), EPOLLIN) &&
                          add(c->completion.get(), EPOLLIN | EPOLLET);
    bool retry = false;  // parts wait and the caller held the client at the last look
    for (;;) {
        int timeout = 1000;
        {
            std::lock_guard lock(cc.mu);
            if (cc.stop) return;
            const auto now = Clock::now();
            for (auto it = cc.watched.begin(); it != cc.watched.end();) {
                if (now >= it->second.deadline) {  // ringd owed the result by now
                    release_word(h.cuda_done[it->second.entry], it->second.word);
                    it = cc.watched.erase(it);
                    continue;
                }
                timeout = std::min(timeout, ms_until(it->second.deadline) + 1);
                ++it;
            }
        }
        if (retry || !watching) timeout = std::min(timeout, retry ? kPumpRetryMs : 50);
        epoll_event evs[3];
        const int n = watching ? ::epoll_wait(ep.get(), evs, 3, timeout) : (::poll(nullptr, 0, timeout), 0);
        bool gone = false, completions = !watching || retry;
        for (int i = 0; i < n; ++i) {
            if (evs[i].data.fd == c->sock.get() && (evs[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))) gone = true;
            if (evs[i].data.fd == c->completion.get()) completions = true;
            if (evs[i].data.fd == cc.wake.get()) {
                uint64_t v;
                (void)!::read(cc.wake.get(), &v, sizeof v);
            }
        }
        if (gone) {
            // ringd's going away, seen without taking any bytes off the socket.
            std::lock_guard lock(cc.mu);
            cc.ringd_gone = true;  // later device ops are refused (ringd_submit_cuda checks)
            for (auto &[seq, w] : cc.watched) release_word(h.cuda_done[w.entry], w.word);
            cc.watched.clear();
            return;  // the connection is over: nothing more will be watched
        }
        retry = false;
        if (completions && cc.pending.load(std::memory_order_acquire)) {
            // Parts wait for ranges that completions may have freed: hand them over unless the
            // caller is in the library (its own look at the completions does it).
            std::unique_lock lock(c->mu, std::try_to_lock);
            if (lock.owns_lock()) {
                if (!c->dead && !cc.closing) c->drain_completions();
            } else {
                retry = true;
            }
        }
    }
}

// The driver and this client's device, on first use. `dev_ptr` (optional) picks the device of that
// memory; else the caller's current context's, else device 0.
int ensure_cuda(ringd_client &c, CUdeviceptr dev_ptr) {
    if (!c.cuda) {
        const char *p = std::getenv("RINGD_CUDA_PROVIDER");
        auto provider = cuda::parse_provider(p && *p ? p : "hardware");
        if (!provider) return c.fail(-EINVAL, "RINGD_CUDA_PROVIDER: " + provider.error().message);
        auto api = cuda::load_cuda(*provider);
        if (!api) return c.fail(api.error().code, api.error().message);
        c.cuda.reset(new CudaClient);
        c.cuda->api = *api;
        if (c.cuda_part_bytes != 0) {
            c.cuda->part_bytes = c.cuda_part_bytes;
        } else if (const char *v = std::getenv("RINGD_CUDA_PART_BYTES"); v && *v) {
            char *end = nullptr;
            const unsigned long long b = std::strtoull(v, &end, 10);
            if (*end != '\0' || b < 4096) {
                c.cuda.reset();
                return c.fail(-EINVAL, std::string("RINGD_CUDA_PART_BYTES=") + v + " is not a byte count of 4096 or more");
            }
            c.cuda->part_bytes = b;
        }
    }
    CudaClient &cc = *c.cuda;
    const cuda::CudaApi &api = *cc.api;
    CUdevice dev = 0;
    if (dev_ptr) {
        int ordinal = 0;
        if (CUresult r = api.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dev_ptr); r != CUDA_SUCCESS)
            return driver_fail(c, "device pointer " + hex(dev_ptr) + " is not device memory (cuPointerGetAttribute)", r);
        if (CUresult r = api.cuDeviceGet(&dev, ordinal); r != CUDA_SUCCESS) return driver_fail(c, "cuDeviceGet", r);
    } else if (cc.ctx) {
        return 0;
    } else {
        CUcontext cur = nullptr;
        if (api.cuCtxGetCurrent(&cur) != CUDA_SUCCESS || !cur || api.cuCtxGetDevice(&dev) != CUDA_SUCCESS)
            if (CUresult r = api.cuDeviceGet(&dev, 0); r != CUDA_SUCCESS) return driver_fail(c, "no CUDA device (cuDeviceGet 0)", r);
    }
    if (cc.ctx) {
        if (dev != cc.device)
            return c.fail(-EINVAL, "this client uses GPU ordinal " + std::to_string(cc.device) + " already; one GPU per "
                                   "client (connect once per GPU)");
        return 0;
    }
    CUuuid uuid{};
    if (CUresult r = api.cuDeviceGetUuid(&uuid, dev); r != CUDA_SUCCESS) return driver_fail(c, "cuDeviceGetUuid", r);
    CUcontext ctx = nullptr;
    if (CUresult r = api.cuDevicePrimaryCtxRetain(&ctx, dev); r != CUDA_SUCCESS)
        return driver_fail(c, "cuDevicePrimaryCtxRetain", r);
    // Kept only once every step worked.
    auto undo = [&](int rc) {
        api.cuDevicePrimaryCtxRelease(dev);
        return rc;
    };
    CUdeviceptr sync = 0;
    bool memops = true;
    {
        ContextScope scope(api, ctx);
        // The slot header (the sync words), reachable by this process's streams.
        if (CUresult r = api.cuMemHostRegister(c.header, proto::kSlotHeaderBytes,
                                               CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
            r != CUDA_SUCCESS)
            return undo(driver_fail(c, "registering the slot's sync words (cuMemHostRegister)", r));
        if (CUresult r = api.cuMemHostGetDevicePointer(&sync, c.header, 0); r != CUDA_SUCCESS) {
            api.cuMemHostUnregister(c.header);
            return undo(driver_fail(c, "cuMemHostGetDevicePointer", r));
        }
        // Stream memory operations, asked of the driver by doing one (an attribute would not
        // tell the v2 operations, on by default since CUDA 12, from the v1 ones).
        CUstream probe = nullptr;
        if (api.cuStreamCreate(&probe, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) {
            memops = api.cuStreamWriteValue32(probe, sync + kProbeOffset, 1, CU_STREAM_WRITE_VALUE_DEFAULT) ==
                     CUDA_SUCCESS;
            api.cuStreamSynchronize(probe);
            api.cuStreamDestroy(probe);
        }
    }
    cc.ctx = ctx;
    cc.device = dev;
    cc.sync = sync;
    cc.memops = memops;
    cc.host_registered = true;
    std::memcpy(cc.uuid, uuid.bytes, 16);
    return 0;
}

// Sends a registration request (with fd for VMM) and waits for ringd's answer.
int request(ringd_client &c, const proto::Bytes &frame, int fd, uint64_t *reg) {
    if (c.dead) return c.still_dead();
    const int fds[1] = {fd};
    if (auto s = send_all(c.sock.get(), frame, fd >= 0 ? std::span<const int>(fds, 1) : std::span<const int>()); !s) {
        if (int rc = c.check_socket(); rc != 0) return rc;
        return c.fail(s.error().code, s.error().message);
    }
    std::vector<UniqueFd> got;
    uint8_t hdr[proto::kFrameHeaderBytes];
    // ringd maps the memory before it answers a registration, and answers an unregistration of
    // memory an op still uses once that op ended: within its op timeout.
    const auto deadline = Clock::now() + std::chrono::milliseconds(c.welcome.op_timeout_ms) + c.wait_margin;
    if (auto s = recv_exact(c.sock.get(), hdr, sizeof hdr, deadline, got); !s)
        return c.die(s.error().code == -ETIMEDOUT ? -EPROTO : s.error().code, "ringd did not answer: " + s.error().message);
    auto h = proto::decode_frame_header(std::span(hdr, sizeof hdr), proto::kMaxDaemonPayload);
    if (!h) return c.die(-EPROTO, "bad frame from ringd: " + h.error().message);
    std::vector<uint8_t> payload(h->length);
    if (auto s = recv_exact(c.sock.get(), payload.data(), payload.size(), deadline, got); !s)
        return c.die(-EPROTO, "ringd did not answer: " + s.error().message);
    if (h->type == proto::FrameType::Error) {
        auto e = proto::decode_error(payload);
        return c.die(e ? e->code : -EPROTO, e ? "ringd: " + e->message : "bad error frame from ringd");
    }
    if (h->type != proto::FrameType::CudaReply) return c.die(-EPROTO, "unexpected frame from ringd");
    auto r = proto::decode_cuda_reply(payload);
    if (!r) return c.die(-EPROTO, "bad reply from ringd: " + r.error().message);
    if (r->status != 0) return c.fail(r->status, "ringd: " + r->message);
    if (reg) *reg = r->reg;
    c.last_error.clear();
    return 0;
}

int unregister_with_ringd(ringd_client &c, uint64_t reg) {
    if (c.dead) return 0;  // ringd let go of everything of this client
    return request(c, proto::encode_cuda_unregister(reg), -1, nullptr);
}

// A staging range of `bytes` in the staging area, clear of every op in ringd (device ops' windows,
// slot ops before seq `before`): false while there is none. Slot ops held behind it in the client
// are not in the way: each waits until no window it overlaps is in use (cuda_pump).
bool find_staging(const ringd_client &c, uint64_t bytes, uint64_t *offset, uint64_t before) {
    std::vector<std::pair<uint64_t, uint64_t>> used;
    for (const auto &[seq, op] : c.cuda->ops) used.emplace_back(op.offset, op.offset + op.bytes);
    for (const Ticket &t : c.tickets)
        if (!t.cuda && !t.held && t.seq < before && (t.state == TicketState::InFlight || t.state == TicketState::Abandoned))
            used.emplace_back(t.offset, t.offset + t.bytes);
    std::sort(used.begin(), used.end());
    uint64_t at = c.cuda_staging_offset;
    for (const auto &[b, e] : used) {
        if (e <= at) continue;
        if (at + bytes <= b) break;
        at = std::max(at, (e + kStagingAlign - 1) / kStagingAlign * kStagingAlign);
    }
    if (at + bytes > c.staging_end()) return false;
    *offset = at;
    return true;
}

struct HostWrite {
    std::atomic<uint32_t> *word;
    uint32_t value;
};
void CUDA_CB host_write(void *p) {
    std::unique_ptr<HostWrite> w(static_cast<HostWrite *>(p));
    w->word->store(w->value, std::memory_order_release);
}
struct HostWait {
    std::atomic<uint32_t> *word;
    uint32_t value;
    Clock::time_point deadline;
};
// Without stream memory ops: the stream's wait as a host function, bounded by the op's deadline.
void CUDA_CB host_wait(void *p) {
    std::unique_ptr<HostWait> w(static_cast<HostWait *>(p));
    while (static_cast<int32_t>(w->word->load(std::memory_order_acquire) - w->value) < 0 && Clock::now() < w->deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
}

}  // namespace

void CudaClientDelete::operator()(CudaClient *cc) const {
    if (!cc) return;
    {
        std::lock_guard lock(cc->mu);
        cc->stop = true;
    }
    if (cc->watcher.joinable()) {
        const uint64_t one = 1;
        (void)!::write(cc->wake.get(), &one, sizeof one);
        cc->watcher.join();
    }
    delete cc;
}

// The client closes: every device op's words released, then the work this library queued on the
// trainer's streams let run out (it reads and writes the sync words, which go away with the slot:
// the events recorded after it say when, within a bound), the allocations freed.
static void cuda_close(ringd_client &c) {
    CudaClient &cc = *c.cuda;
    cc.closing = true;  // nothing more goes to ringd (the watcher's pump included)
    {
        std::lock_guard lock(cc.mu);
        for (auto &[seq, w] : cc.watched) {
            release_word(c.header->cuda_ready[w.entry], w.word);
            release_word(c.header->cuda_done[w.entry], w.word);
        }
        cc.watched.clear();
    }
    if (!cc.ctx) return;
    const cuda::CudaApi &api = *cc.api;
    ContextScope scope(api, cc.ctx);
    const auto until = Clock::now() + kCloseBound;
    bool ran_out = true;
    for (auto &[stream, ev] : cc.marks) {
        while (ran_out && api.cuEventQuery(ev) == CUDA_ERROR_NOT_READY) {
            if (Clock::now() >= until) ran_out = false;
            else std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        if (ran_out) api.cuEventDestroy(ev);
    }
    for (auto &[ptr, a] : cc.allocs) {
        api.cuMemUnmap(ptr, a.bytes);
        api.cuMemAddressFree(ptr, a.bytes);
        api.cuMemRelease(a.handle);
    }
    cc.allocs.clear();
    if (!ran_out) {
        // A stream still has this library's work queued (its earlier kernels run long): the sync
        // words must outlive it, so the slot stays mapped and registered for the process's life.
        new std::shared_ptr<SharedMapping>(c.map);
    } else if (cc.host_registered) {
        api.cuMemHostUnregister(c.header);
    }
    api.cuDevicePrimaryCtxRelease(cc.device);
    cc.ctx = nullptr;
}

void cuda_client_dead(ringd_client &c) {
    CudaClient &cc = *c.cuda;
    std::lock_guard lock(cc.mu);
    for (auto &[seq, w] : cc.watched) release_word(c.header->cuda_done[w.entry], w.word);
    cc.watched.clear();
}

namespace {

// The stream's event, recorded after this library's latest work on it (one event per stream: a
// record replaces the stream's earlier one, which it follows in the stream's order).
void record_after(CudaClient &cc, CUstream stream) {
    const cuda::CudaApi &api = *cc.api;
    for (auto &[s, ev] : cc.marks)
        if (s == stream) {
            api.cuEventRecord(ev, stream);
            return;
        }
    CUevent ev = nullptr;
    if (api.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return;
    api.cuEventRecord(ev, stream);
    cc.marks.emplace_back(stream, ev);
}

}  // namespace

void cuda_client_closing(ringd_client &c) {
    if (c.cuda) cuda_close(c);
}

void cuda_ticket_ended(ringd_client &c, uint64_t seq, int32_t status) {
    if (!c.cuda) return;
    CudaClient &cc = *c.cuda;
    cc.ops.erase(seq);
    cc.streams.erase(seq);
    std::lock_guard lock(cc.mu);
    auto it = cc.watched.find(seq);
    if (it == cc.watched.end()) return;
    // ringd wrote the done word itself after the result (success) or at the failure; writing it
    // again here covers a ringd that could not.
    if (status != 0) release_word(c.header->cuda_done[it->second.entry], it->second.word);
    cc.watched.erase(it);
}

bool cuda_part_ended(ringd_client &c, uint64_t seq, int32_t status, std::string &message) {
    CudaClient &cc = *c.cuda;
    auto it = cc.streams.upper_bound(seq);  // the op whose last seq is above it
    if (it == cc.streams.end() || seq < it->second.first) return false;
    CudaClient::Stream &st = it->second;
    uint64_t &range = st.range_seq[(seq - st.first) % st.range_seq.size()];
    if (range != seq) return true;  // not in flight (a completion twice): nothing to take
    range = 0;
    Ticket &t = c.tickets[st.last % c.tickets.size()];
    if (t.seq != st.last || t.parts_left == 0) return true;
    if (status != 0 && t.part_status == 0) {
        t.part_status = status;
        t.part_message = "part " + std::to_string(seq - st.first + 1) + " of " + std::to_string(st.last - st.first + 1) +
                         ": " + message;
    }
    if (--t.parts_left == 0 && t.own_done) c.settle(t);  // may end the stream: `st` is gone then
    return true;
}

bool cuda_backlog(const ringd_client &c) { return c.cuda && !c.cuda->backlog.empty(); }

void cuda_hold(ringd_client &c, const proto::SubmitDesc &d) {
    c.cuda->backlog.push_back(CudaClient::Held{0, d});
    c.cuda->pending.store(true, std::memory_order_release);
}

void cuda_pump(ringd_client &c) {
    CudaClient &cc = *c.cuda;
    if (cc.backlog.empty() || cc.closing) return;
    std::array<proto::SubmitDesc, kMaxRanges> descs;  // one doorbell for what goes now
    uint64_t n = 0;
    const auto now = Clock::now();
    const auto owed = now + std::chrono::milliseconds(c.welcome.op_timeout_ms) + c.wait_margin;
    auto flush = [&] {
        // Each op's contract (and the watcher's deadline for a device op's done word) counts from
        // its latest part handed to ringd.
        for (uint64_t i = 0; i < n; ++i) {
            auto it = cc.streams.upper_bound(descs[i].seq - 1);
            const uint64_t ticket = it != cc.streams.end() && descs[i].seq >= it->second.first ? it->first : descs[i].seq;
            Ticket &t = c.tickets[ticket % c.tickets.size()];
            if (t.seq == ticket) {
                t.held = false;
                t.submitted = now;
            }
            if (it != cc.streams.end() && ticket == it->first) {
                std::lock_guard lock(cc.mu);
                if (auto w = cc.watched.find(ticket); w != cc.watched.end()) w->second.deadline = owed;
            }
        }
        if (n) c.publish(descs.data(), n);
        n = 0;
    };
    while (!cc.backlog.empty()) {
        CudaClient::Held &h = cc.backlog.front();
        if (h.stream == 0) {  // a slot op: it waits while a device op's window it overlaps is in use
            uint64_t busy = 0;
            auto v = proto::validate_submit(h.desc, c.welcome.data_bytes, true);  // (checked when it was held)
            const uint64_t from = v ? std::min(v->offset, v->out_offset) : h.desc.offset;
            const uint64_t span = v ? std::max(v->offset + v->bytes, v->out_offset + v->out_bytes) - from : 0;
            if (cuda_staging_overlaps(c, from, span, &busy)) break;
            if (n == descs.size()) flush();
            if (!c.queue_room(n + 1)) break;
            descs[n++] = h.desc;
            cc.backlog.pop_front();
            continue;
        }
        CudaClient::Stream &st = cc.streams.at(h.stream);
        if (st.range_seq.empty()) {  // its window, as large as the slot's room now allows
            // (The slot ops taken in this pass go first: until then they count as held, and
            // find_staging would not keep clear of their ranges.)
            flush();
            const uint64_t parts = st.last - st.first + 1;
            uint64_t ranges = st.max_ranges;
            for (; ranges > 0; --ranges) {
                const uint64_t window = !st.splits.empty() ? st.part_bytes
                                        : ranges == parts ? st.part_bytes * (parts - 1) + (st.count - (parts - 1) * st.per) * st.esize * st.mult
                                                          : ranges * st.part_bytes;
                if (find_staging(c, window, &st.staging, st.first)) {
                    cc.ops[st.last] = CudaClient::Op{st.staging, window};
                    break;
                }
            }
            if (ranges == 0) break;  // ops in ringd hold the room: their completions free it
            st.range_seq.assign(ranges, 0);
        }
        while (st.next <= st.last) {
            uint64_t &range = st.range_seq[(st.next - st.first) % st.range_seq.size()];
            if (range != 0) break;  // the part before it in that range is still in ringd
            if (n == descs.size()) flush();
            if (!c.queue_room(n + 1)) break;
            const uint64_t k = st.next - st.first;
            proto::SubmitDesc &d = descs[n++];
            d = st.desc;
            d.seq = st.next;
            d.count = std::min(st.per, st.count - k * st.per);
            d.offset = st.staging + (k % st.range_seq.size()) * st.part_bytes;
            if (!st.splits.empty()) {  // one part: its input, output and sizes as submit_device placed them
                d.count = 0;
                d.out_offset += d.offset;
                d.splits_offset += d.offset;
                std::memcpy(c.data + d.splits_offset, st.splits.data(), st.splits.size() * sizeof(uint64_t));
            } else if (!collective_blocked(static_cast<Collective>(d.collective)) &&
                d.collective != static_cast<uint32_t>(Collective::AllToAll)) {  // in place
                d.cuda_offset = st.reg_offset + k * st.per * st.esize;
                if (d.collective != static_cast<uint32_t>(Collective::Allreduce)) d.out_offset = d.offset;
            } else {
                // The part's input, then its output; the device ranges stay the whole op's, the
                // part says which elements of each block.
                const bool by_rank_in = d.collective == static_cast<uint32_t>(Collective::ReduceScatter) ||
                                        d.collective == static_cast<uint32_t>(Collective::AllToAll);
                d.out_offset = d.offset + (by_rank_in ? d.ranks : 1) * d.count * st.esize;
                d.cuda_part = k * st.per;
            }
            d.cuda_ready_seq = st.first == st.last ? 0 : st.last;  // one part: its own word (any ringd)
            range = st.next++;
        }
        if (st.next <= st.last) break;
        cc.backlog.pop_front();
    }
    flush();
    cc.pending.store(!cc.backlog.empty(), std::memory_order_release);
}

// A device op with parts still to hand to ringd that uses registration `reg` (its later parts
// would name a registration that is gone): its ticket, else 0. Parts already in ringd are fine:
// ringd keeps its mapping until they end.
uint64_t reg_pending(const CudaClient &cc, uint64_t reg) {
    for (const auto &[last, st] : cc.streams)
        if ((st.desc.cuda_reg == reg || st.desc.cuda_out_reg == reg) && st.next <= st.last) return last;
    return 0;
}

bool cuda_staging_overlaps(const ringd_client &c, uint64_t offset, uint64_t bytes, uint64_t *seq) {
    for (const auto &[s, op] : c.cuda->ops)
        if (offset < op.offset + op.bytes && op.offset < offset + bytes) {
            *seq = s;
            return true;
        }
    return false;
}

extern "C" {

int ringd_cuda_alloc(ringd_client *c, size_t bytes, void **dev_ptr) {
    if (!c || !dev_ptr || bytes == 0) return c ? c->fail(-EINVAL, "ringd_cuda_alloc: dev_ptr NULL or bytes 0") : -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        *dev_ptr = nullptr;
        if (c->dead) return c->still_dead();
        if (int rc = ensure_cuda(*c, 0); rc != 0) return rc;
        CudaClient &cc = *c->cuda;
        const cuda::CudaApi &api = *cc.api;
        int vmm = 0, fd_ok = 0;
        api.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cc.device);
        api.cuDeviceGetAttribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cc.device);
        if (!vmm || !fd_ok)
            return c->fail(-ENOTSUP, "this GPU has no virtual memory management with POSIX fd handles: allocate with "
                                     "cudaMalloc and register the buffer with ringd_register_cuda");
        ContextScope scope(api, cc.ctx);
        CUmemAllocationProp prop{};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = cc.device;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        size_t gran = 0;
        if (CUresult r = api.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
            r != CUDA_SUCCESS || gran == 0)
            return driver_fail(*c, "cuMemGetAllocationGranularity", r);
        const size_t size = (bytes + gran - 1) / gran * gran;
        CUmemGenericAllocationHandle handle = 0;
        if (CUresult r = api.cuMemCreate(&handle, size, &prop, 0); r != CUDA_SUCCESS)
            return driver_fail(*c, "cuMemCreate of " + std::to_string(size) + " bytes", r);
        CUdeviceptr ptr = 0;
        auto undo = [&](int rc) {
            if (ptr) {
                api.cuMemUnmap(ptr, size);
                api.cuMemAddressFree(ptr, size);
            }
            api.cuMemRelease(handle);
            return rc;
        };
        if (CUresult r = api.cuMemAddressReserve(&ptr, size, gran, 0, 0); r != CUDA_SUCCESS) {
            ptr = 0;
            return undo(driver_fail(*c, "cuMemAddressReserve", r));
        }
        if (CUresult r = api.cuMemMap(ptr, size, 0, handle, 0); r != CUDA_SUCCESS) {
            api.cuMemAddressFree(ptr, size);
            ptr = 0;
            return undo(driver_fail(*c, "cuMemMap", r));
        }
        CUmemAccessDesc access{};
        access.location = prop.location;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if (CUresult r = api.cuMemSetAccess(ptr, size, &access, 1); r != CUDA_SUCCESS)
            return undo(driver_fail(*c, "cuMemSetAccess", r));
        int fd = -1;
        if (CUresult r = api.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            r != CUDA_SUCCESS)
            return undo(driver_fail(*c, "cuMemExportToShareableHandle", r));
        UniqueFd exported(fd);
        proto::CudaRegister req;
        req.kind = proto::CudaMemoryKind::Vmm;
        std::memcpy(req.device_uuid, cc.uuid, 16);
        req.alloc_bytes = size;
        req.offset = 0;
        req.bytes = size;
        req.client_ptr = ptr;
        uint64_t reg = 0;
        if (int rc = request(*c, proto::encode_cuda_register(req), exported.get(), &reg); rc != 0) return undo(rc);
        cc.allocs[ptr] = CudaClient::Alloc{size, handle, reg};
        *dev_ptr = reinterpret_cast<void *>(ptr);
        return 0;
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

int ringd_cuda_free(ringd_client *c, void *dev_ptr) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        const auto ptr = reinterpret_cast<CUdeviceptr>(dev_ptr);
        if (!c->cuda || !c->cuda->allocs.count(ptr))
            return c->fail(-ENOENT, "ringd_cuda_free: " + hex(ptr) + " did not come from ringd_cuda_alloc on this client");
        CudaClient &cc = *c->cuda;
        const CudaClient::Alloc a = cc.allocs.at(ptr);
        if (uint64_t t = reg_pending(cc, a.reg); t != 0)
            return c->fail(-EBUSY, "ringd_cuda_free: device op " + std::to_string(t) + " on this memory still has parts "
                                   "to hand to ringd; wait for it first");
        cc.allocs.erase(ptr);
        // ringd keeps its own mapping for ops still in flight on it; the memory lives until then.
        const int rc = unregister_with_ringd(*c, a.reg);
        const cuda::CudaApi &api = *cc.api;
        ContextScope scope(api, cc.ctx);
        api.cuMemUnmap(ptr, a.bytes);
        api.cuMemAddressFree(ptr, a.bytes);
        api.cuMemRelease(a.handle);
        return rc;
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

int ringd_register_cuda(ringd_client *c, const void *dev_ptr, size_t bytes, uint64_t *reg) {
    if (!c || !reg || bytes == 0) return c ? c->fail(-EINVAL, "ringd_register_cuda: reg NULL or bytes 0") : -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        *reg = 0;
        if (c->dead) return c->still_dead();
        const auto ptr = reinterpret_cast<CUdeviceptr>(dev_ptr);
        if (int rc = ensure_cuda(*c, ptr); rc != 0) return rc;
        CudaClient &cc = *c->cuda;
        const cuda::CudaApi &api = *cc.api;
        ContextScope scope(api, cc.ctx);
        for (const auto &[p, a] : cc.allocs)
            if (ptr >= p && ptr < p + a.bytes)
                return c->fail(-EINVAL, "memory from ringd_cuda_alloc is registered with ringd already");
        CUdeviceptr base = 0;
        size_t size = 0;
        if (CUresult r = api.cuMemGetAddressRange(&base, &size, ptr); r != CUDA_SUCCESS)
            return driver_fail(*c, "cuMemGetAddressRange of " + hex(ptr), r);
        if (ptr + bytes < ptr || ptr + bytes > base + size)
            return c->fail(-ERANGE, "[" + hex(ptr) + ", +" + std::to_string(bytes) + ") runs past its allocation [" +
                                        hex(base) + ", +" + std::to_string(size) + ")");
        CUipcMemHandle h{};
        if (CUresult r = api.cuIpcGetMemHandle(&h, base); r != CUDA_SUCCESS)
            return driver_fail(*c, "cuIpcGetMemHandle (is this a cudaMalloc-family buffer?)", r);
        proto::CudaRegister req;
        req.kind = proto::CudaMemoryKind::LegacyIpc;
        std::memcpy(req.device_uuid, cc.uuid, 16);
        req.alloc_bytes = size;
        req.offset = ptr - base;
        req.bytes = bytes;
        req.client_ptr = ptr;
        std::memcpy(req.ipc_handle, h.reserved, sizeof req.ipc_handle);
        if (int rc = request(*c, proto::encode_cuda_register(req), -1, reg); rc != 0) return rc;
        cc.regs[*reg] = CudaClient::Reg{ptr, bytes};
        return 0;
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

int ringd_unregister_cuda(ringd_client *c, uint64_t reg) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        if (!c->cuda || !c->cuda->regs.count(reg))
            return c->fail(-ENOENT, "CUDA registration " + std::to_string(reg) + " is not one of this client's");
        if (uint64_t t = reg_pending(*c->cuda, reg); t != 0)
            return c->fail(-EBUSY, "CUDA registration " + std::to_string(reg) + ": device op " + std::to_string(t) +
                                       " on it still has parts to hand to ringd; wait for it first");
        c->cuda->regs.erase(reg);
        return unregister_with_ringd(*c, reg);
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

}  // extern "C"

namespace {

// A device range [ptr, +bytes) inside one of the client's registrations: its id and the offset
// into it.
bool find_registration(const CudaClient &cc, CUdeviceptr ptr, uint64_t bytes, uint64_t *reg, uint64_t *reg_offset) {
    auto inside = [&](CUdeviceptr base, uint64_t size) { return ptr >= base && ptr + bytes >= ptr && ptr + bytes <= base + size; };
    for (const auto &[p, a] : cc.allocs)
        if (inside(p, a.bytes)) {
            *reg = a.reg, *reg_offset = ptr - p;
            return true;
        }
    for (const auto &[id, r] : cc.regs)
        if (inside(r.ptr, r.bytes)) {
            *reg = id, *reg_offset = ptr - r.ptr;
            return true;
        }
    return false;
}

struct DeviceOpArgs {
    Collective collective;
    uint32_t dtype, op;
    uint64_t count;
    CUdeviceptr in, out;  // allreduce, broadcast, reduce: the same
    uint32_t root = 0;    // broadcast, reduce
    // all_to_all with split sizes: ranks elements to send to each rank, to receive from each
    const uint64_t *send_counts = nullptr, *recv_counts = nullptr;
};

// Any collective on device buffers (ringd_submit_cuda, ringd_submit_coll_cuda).
int submit_device(ringd_client *c, const DeviceOpArgs &a, CUstream stream, uint64_t *ticket) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        if (c->dead) return c->still_dead();
        if (!c->cuda || !c->cuda->ctx)
            return c->fail(-ENOENT, "device buffer " + hex(a.in) +
                                        " is in no registration: this client has none yet (ringd_cuda_alloc, "
                                        "ringd_register_cuda)");
        CudaClient &cc = *c->cuda;
        const cuda::CudaApi &api = *cc.api;
        if (cc.ringd_gone) {
            if (int rc = c->check_socket(); rc != 0) return rc;
            return c->die(-ECONNRESET, "ringd closed the connection");
        }
        const uint64_t count = a.count;
        if (a.dtype >= kDTypeCount) return c->fail(-EINVAL, "unknown dtype");
        // coll: by blocks (reduce_scatter, allgather, all_to_all: a block per rank on one side or on
        // both); rooted: in place as an allreduce, with a root.
        const bool a2a = a.collective == Collective::AllToAll;
        const bool coll = collective_blocked(a.collective) || a2a, rs = a.collective == Collective::ReduceScatter;
        const bool rooted = collective_is_rooted(a.collective);
        const std::string what(collective_name(a.collective));
        if (!coll && !rooted && a.collective != Collective::Allreduce)
            return c->fail(-EINVAL, "a " + what + " of device buffers: ringd runs allreduce, reduce_scatter, allgather, "
                                    "broadcast, reduce and all_to_all of them (this one on slot buffers only)");
        if (coll || rooted) {
            const uint16_t feature = a2a    ? proto::kSlotFeatureCudaAllToAll
                                     : coll ? proto::kSlotFeatureCudaCollectives
                                            : proto::kSlotFeatureCudaRooted;
            if (!(c->header->features & feature))
                return c->fail(-ENOTSUP, "this ringd runs no " + what + " of device buffers (an older release)");
            if (c->ranks == 0)
                return c->fail(-EINVAL, "a " + what + " needs this trainer's rank in its group: connect with "
                                        "ringd_options.rank and .ranks");
            if (rooted && a.root >= c->ranks)
                return c->fail(-EINVAL, "a " + what + " with root rank " + std::to_string(a.root) + " in a group of " +
                                            std::to_string(c->ranks) + " ranks");
        }
        const uint64_t ranks = coll ? c->ranks : 1;
        const uint64_t esize = dtype_size(static_cast<DType>(a.dtype));
        // An all_to_all with split sizes: one op of the whole input and output, staged with its sizes.
        const bool splits = a2a && a.send_counts;
        std::vector<uint64_t> table;
        uint64_t bytes = 0, whole = 0;  // a block's, the side with a block per rank's
        if (__builtin_mul_overflow(count, esize, &bytes) || __builtin_mul_overflow(bytes, ranks, &whole))
            return c->fail(-EOVERFLOW, "count " + std::to_string(count) + " overflows");
        uint64_t in_bytes = rs || a2a ? whole : bytes, out_bytes = coll && !rs ? whole : bytes;
        if (splits) {
            if (!(c->header->features & proto::kSlotFeatureCudaAllToAllSplits))
                return c->fail(-ENOTSUP, "this ringd runs no all_to_all of device buffers with split sizes (an older release)");
            if (count != 0) return c->fail(-EINVAL, "an all_to_all with split sizes takes count 0 (not " + std::to_string(count) + ")");
            table.assign(a.send_counts, a.send_counts + ranks);
            table.insert(table.end(), a.recv_counts, a.recv_counts + ranks);
            uint64_t sums[2] = {0, 0};
            for (uint64_t k = 0; k < 2 * ranks; ++k)
                if (__builtin_add_overflow(sums[k / ranks], table[k], &sums[k / ranks]))
                    return c->fail(-EOVERFLOW, "the all_to_all's split sizes overflow");
            if (__builtin_mul_overflow(sums[0], esize, &in_bytes) || __builtin_mul_overflow(sums[1], esize, &out_bytes))
                return c->fail(-EOVERFLOW, "the all_to_all's split sizes overflow");
        }
        // One with split sizes is staged whole: too large for the staging room is said first (the
        // caller may take another way, e.g. through host memory), whatever its registrations.
        const uint64_t room = c->staging_end() - c->cuda_staging_offset;
        if (splits && (in_bytes > room || out_bytes > room || (in_bytes + 63) / 64 * 64 + (out_bytes + 63) / 64 * 64 + 16 * ranks > room))
            return c->fail(-E2BIG, "an all_to_all with split sizes of " + std::to_string(in_bytes) + " bytes in and " +
                                       std::to_string(out_bytes) + " out is staged whole and does not fit the " +
                                       std::to_string(room) + " bytes of the slot it is staged in (connect with a "
                                       "larger slot_bytes / RINGD_SLOT_BYTES)");
        uint64_t reg = 0, reg_offset = 0, out_reg = 0, out_reg_offset = 0;
        // (A side of no elements needs no registration: it takes the other side's, unread.)
        const bool in_empty = splits && in_bytes == 0, out_empty = splits && out_bytes == 0;
        if (in_empty && out_empty)
            return c->fail(-EINVAL, "an all_to_all of device buffers that sends and receives nothing: submit it as a "
                                    "slot all_to_all (ringd_submit_coll), which copies nothing either");
        if (!in_empty && !find_registration(cc, a.in, in_bytes, &reg, &reg_offset))
            return c->fail(-ENOENT, std::string(coll ? "input " : "") + "device buffer [" + hex(a.in) + ", +" + std::to_string(in_bytes) +
                                        ") is in no registration of this client: register it with ringd_register_cuda "
                                        "or allocate it with ringd_cuda_alloc");
        if (coll) {
            if (out_empty) {
                out_reg = reg, out_reg_offset = reg_offset;
            } else if (!find_registration(cc, a.out, out_bytes, &out_reg, &out_reg_offset))
                return c->fail(-ENOENT, "output device buffer [" + hex(a.out) + ", +" + std::to_string(out_bytes) +
                                            ") is in no registration of this client: register it with ringd_register_cuda "
                                            "or allocate it with ringd_cuda_alloc");
            if (in_empty) reg = out_reg, reg_offset = out_reg_offset;
            // Apart, or in place: the rank's own block of the side with a block per rank (an
            // all_to_all: apart only).
            const uint64_t own = uint64_t{c->rank} * bytes;
            const bool apart = in_empty || out_empty || a.in + in_bytes <= a.out || a.out + out_bytes <= a.in;
            const bool in_place = !a2a && (rs ? a.out == a.in + own : a.in == a.out + own);
            if (!apart && !in_place)
                return c->fail(-EINVAL, "the " + what + "'s output [" + hex(a.out) + ", +" + std::to_string(out_bytes) +
                                            ") overlaps its input [" + hex(a.in) + ", +" + std::to_string(in_bytes) + ")" +
                                            (a2a ? std::string() : " other than as rank " + std::to_string(c->rank) + "'s own block"));
        }
        c->drain_completions();  // staging ranges of ops that ended are free again
        proto::SubmitDesc d{};
        d.seq = c->next_seq;
        d.count = count;
        d.dtype = a.dtype;
        d.op = a.op;
        d.buffer_kind = static_cast<uint32_t>(proto::BufferKind::Cuda);
        d.cuda_reg = reg;
        d.cuda_offset = reg_offset;
        if (coll) {
            d.collective = static_cast<uint32_t>(a.collective);
            d.ranks = c->ranks;
            d.cuda_out_reg = out_reg;
            d.cuda_out_offset = out_reg_offset;
            d.cuda_block = count;
        } else if (rooted) {
            d.collective = static_cast<uint32_t>(a.collective);
            d.ranks = c->ranks;
            d.root = a.root;
        }
        // A large op goes as parts of at most cc.part_bytes: consecutive ringd ops, so that ringd
        // copies part k+1 off the device while part k is on the ring, and copies part k's result
        // back while k+1 is (the copies pipelined with the ring). Every rank cuts the same
        // (count, dtype) the same way. The parts cycle through a staging window of at most
        // kMaxRanges part-sized ranges of the slot, so an op of any size streams through it.
        // A reduce_scatter's or allgather's part is the same elements of every block: its input and
        // output are staged apart, (ranks + 1) x its elements; an all_to_all's 2 x ranks x them.
        // An all_to_all with split sizes is one part: its input, output and sizes, each 64-aligned.
        const uint64_t mult = a2a ? 2 * ranks : coll ? ranks + 1 : 1;
        // The window is placed when the op is next to go to ringd (cuda_pump): as many ranges as
        // the slot then has room for beside the ops in flight, at least one.
        const uint64_t per = std::max<uint64_t>(1, (cc.part_bytes ? cc.part_bytes : default_part_bytes(room)) / (esize * mult));
        const uint64_t parts = count == 0 ? 1 : (count + per - 1) / per;
        auto align64 = [](uint64_t b) { return (b + 63) / 64 * 64; };
        uint64_t part_bytes = 0;
        if (splits) {
            part_bytes = align64(in_bytes) + align64(out_bytes) + 16 * ranks;  // (fits the room: checked above)
        } else if (__builtin_mul_overflow(parts == 1 ? count : per, esize * mult, &part_bytes)) {
            return c->fail(-EOVERFLOW, "count " + std::to_string(count) + " overflows");
        }
        const uint64_t ranges = std::min<uint64_t>({parts, kMaxRanges, room / std::max<uint64_t>(part_bytes, 1)});
        if (part_bytes > room || ranges == 0)
            return c->fail(-E2BIG, (parts == 1 ? "a device op of " + std::to_string(part_bytes) + " bytes of staging"
                                               : "a part of " + std::to_string(part_bytes) + " bytes") +
                                       " does not fit the " + std::to_string(room) + " bytes of the slot it is staged in "
                                       "(connect with a larger slot_bytes / RINGD_SLOT_BYTES, or make the parts smaller: "
                                       "RINGD_CUDA_PART_BYTES, ringd_set_cuda_part_bytes)");
        d.count = std::min<uint64_t>(count, per);
        if (coll) d.out_offset = (rs || a2a ? ranks : 1) * d.count * esize;  // (placed in the window by cuda_pump)
        if (splits) {  // (placed alike by cuda_pump; the sizes written there)
            d.flags |= proto::kSubmitSplits;
            d.cuda_block = 0;
            d.out_offset = align64(in_bytes);
            d.splits_offset = align64(in_bytes) + align64(out_bytes);
        }
        if (rooted) d.out_offset = d.offset;                            // (in place; so is its placing)
        d.cuda_ready_seq = d.seq + parts - 1;
        if (parts > 1 && !(c->header->features & proto::kSlotFeatureCudaReadySeq))
            return c->fail(-ENOTSUP, "this ringd is older than this library: a device op larger than a part (" +
                                         std::to_string(part_bytes) + " bytes) needs ringd to wait for the op's one "
                                         "ready word; upgrade ringd, or make the parts larger (RINGD_CUDA_PART_BYTES)");
        // Everything that could refuse the op is checked before the ready word goes on the
        // stream: a word queued for an op that was then refused would let ringd copy a later op's
        // buffer (same seq) before that one is produced.
        if (auto v = proto::validate_submit(d, c->welcome.data_bytes, true); !v) return c->fail(v.error().code, v.error().message);
        const uint64_t first = c->next_seq, last = first + parts - 1;
        // The op's ticket is its last part's; the other parts take none. (The queue's room is
        // the pump's to wait for.)
        if (const Ticket &t = c->tickets[last % c->tickets.size()]; t.state != TicketState::Free) {
            if (t.state != TicketState::Done && Clock::now() >= c->contract_deadline(t)) return c->breach(t);
            return c->fail(-EAGAIN, "too many ops in flight: wait for ticket " + std::to_string(t.seq) + " first");
        }
        // Everything that can fail comes before the ready word; from the word on, nothing can be
        // taken back (a later op of the same seq would find its word written).
        if (!cc.watcher.joinable()) cc.watcher = std::thread(watch, c);
        cc.marks.reserve(cc.marks.size() + 1);
        CudaClient::Stream st;
        st.desc = d;
        st.first = st.next = first;
        st.last = last;
        st.count = count;
        st.per = per;
        st.esize = esize;
        st.reg_offset = reg_offset;
        st.part_bytes = part_bytes;
        st.max_ranges = ranges;
        st.mult = mult;
        st.splits = std::move(table);
        st.in_bytes = in_bytes;
        {
            ContextScope scope(api, cc.ctx);
            // "The buffer is produced" in the stream's order, once for the whole op: every part's
            // stage-in waits for the last part's word.
            const uint32_t entry = static_cast<uint32_t>(last % proto::kQueueDepth);
            const uint32_t word = static_cast<uint32_t>(last);
            CUresult r = cc.memops ? api.cuStreamWriteValue32(stream, cc.sync + kReadyOffset + 4 * entry, word,
                                                              CU_STREAM_WRITE_VALUE_DEFAULT)
                                   : api.cuLaunchHostFunc(stream, host_write, new HostWrite{&c->header->cuda_ready[entry], word});
            if (r != CUDA_SUCCESS) return driver_fail(*c, "marking the buffer ready on the stream", r);
            record_after(cc, stream);
        }
        const auto now = Clock::now();
        Ticket &t = c->tickets[last % c->tickets.size()];
        t = Ticket{};
        t.seq = last;
        t.state = TicketState::InFlight;
        t.submitted = now;  // again as each part goes: the contract counts from the latest
        t.held = true;      // until its first part goes
        t.cuda = true;
        t.bytes = in_bytes;
        t.parts_left = parts - 1;
        cc.device_seq[last % proto::kQueueDepth] = last;
        {
            std::lock_guard lock(cc.mu);
            cc.watched[last] = CudaClient::Watched{static_cast<uint32_t>(last % proto::kQueueDepth), static_cast<uint32_t>(last),
                                                   now + std::chrono::milliseconds(c->welcome.op_timeout_ms) + c->wait_margin};
        }
        c->next_seq = last + 1;
        cc.streams.emplace(last, std::move(st));
        cc.backlog.push_back(CudaClient::Held{last, {}});
        cc.pending.store(true, std::memory_order_release);
        cuda_pump(*c);
        if (ticket) *ticket = last;
        c->last_error.clear();
        const uint64_t one = 1;
        (void)!::write(cc.wake.get(), &one, sizeof one);
        return 0;
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

}  // namespace

extern "C" {

int ringd_submit_cuda(ringd_client *c, void *dev_ptr, size_t count, ringd_dtype dtype, ringd_op op,
                      struct CUstream_st *stream, uint64_t *ticket) {
    const auto ptr = reinterpret_cast<CUdeviceptr>(dev_ptr);
    return submit_device(c, {Collective::Allreduce, static_cast<uint32_t>(dtype), static_cast<uint32_t>(op), count, ptr, ptr},
                         stream, ticket);
}

int ringd_submit_coll_cuda(ringd_client *c, const ringd_coll_cuda *coll, struct CUstream_st *stream, uint64_t *ticket) {
    if (!c) return -EINVAL;
    constexpr size_t kFirstVersion = offsetof(ringd_coll_cuda, output) + sizeof(void *);
    if (!coll || coll->struct_size < kFirstVersion) {
        std::lock_guard lock(c->mu);
        return c->fail(-EINVAL, "ringd_submit_coll_cuda: coll must be a ringd_coll_cuda with struct_size = sizeof(ringd_coll_cuda)");
    }
    if (static_cast<unsigned>(coll->collective) >= kCollectiveCount) {
        std::lock_guard lock(c->mu);
        return c->fail(-EINVAL, "unknown collective " + std::to_string(static_cast<unsigned>(coll->collective)));
    }
    const auto kind = static_cast<Collective>(coll->collective);
    const bool rooted = collective_is_rooted(kind);
    const auto in = reinterpret_cast<CUdeviceptr>(coll->input);
    const auto out = kind == Collective::Allreduce || rooted || !coll->output ? in : reinterpret_cast<CUdeviceptr>(coll->output);
    if (rooted && coll->output && coll->output != coll->input) {
        std::lock_guard lock(c->mu);
        return c->fail(-EINVAL, "ringd_submit_coll_cuda: a " + std::string(collective_name(kind)) +
                                    " runs in place on its input (output NULL or the input)");
    }
    if ((collective_blocked(kind) || kind == Collective::AllToAll) && !coll->output) {
        std::lock_guard lock(c->mu);
        return c->fail(-EINVAL, "ringd_submit_coll_cuda: a " + std::string(collective_name(kind)) + " needs an output");
    }
    // root: in the struct since broadcast and reduce of device buffers. A caller built before it
    // names none: its broadcast or reduce is refused, never run from a root it did not choose.
    const bool has_root = coll->struct_size >= offsetof(ringd_coll_cuda, root) + sizeof(uint32_t);
    if (rooted && !has_root) {
        std::lock_guard lock(c->mu);
        return c->fail(-EINVAL, "ringd_submit_coll_cuda: a " + std::string(collective_name(kind)) + " needs its root: "
                                    "a ringd_coll_cuda with the root field (struct_size " +
                                    std::to_string(sizeof(ringd_coll_cuda)) + ", not " + std::to_string(coll->struct_size) + ")");
    }
    DeviceOpArgs a{kind, static_cast<uint32_t>(coll->dtype), static_cast<uint32_t>(kind == Collective::Broadcast ? RINGD_SUM : coll->op),
                   coll->count, in, out};
    a.root = has_root ? coll->root : 0;
    // send_counts, recv_counts: in the struct since all_to_all with split sizes of device buffers.
    if (coll->struct_size >= offsetof(ringd_coll_cuda, recv_counts) + sizeof(const uint64_t *)) {
        if ((coll->send_counts != nullptr) != (coll->recv_counts != nullptr) ||
            (coll->send_counts && kind != Collective::AllToAll)) {
            std::lock_guard lock(c->mu);
            return c->fail(-EINVAL, "ringd_submit_coll_cuda: send_counts and recv_counts go together, and only with an all_to_all");
        }
        a.send_counts = coll->send_counts;
        a.recv_counts = coll->recv_counts;
    }
    return submit_device(c, a, stream, ticket);
}

int ringd_cuda_all_to_all_splits(void) { return 1; }

unsigned int ringd_cuda_collectives(void) {
    return 1u << RINGD_ALLREDUCE | 1u << RINGD_REDUCE_SCATTER | 1u << RINGD_ALLGATHER | 1u << RINGD_BROADCAST |
           1u << RINGD_REDUCE | 1u << RINGD_ALL_TO_ALL;
}

int ringd_set_cuda_part_bytes(ringd_client *c, size_t bytes) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    if (bytes != 0 && bytes < 4096) return c->fail(-EINVAL, "a part of a device op is 4096 bytes or more");
    c->cuda_part_bytes = bytes;
    if (c->cuda) {
        // 0: back to the value the client started with (RINGD_CUDA_PART_BYTES, checked then).
        const char *v = std::getenv("RINGD_CUDA_PART_BYTES");
        const unsigned long long env = v && *v ? std::strtoull(v, nullptr, 10) : 0;
        c->cuda->part_bytes = bytes ? bytes : env >= 4096 ? env : 0;
    }
    c->last_error.clear();
    return 0;
}

int ringd_set_cuda_staging(ringd_client *c, size_t offset, size_t bytes) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    uint64_t end = 0;
    if (offset % kStagingAlign != 0 || __builtin_add_overflow(uint64_t{offset}, uint64_t{bytes}, &end) ||
        end > c->welcome.data_bytes)
        return c->fail(-EINVAL, "staging range [" + std::to_string(offset) + ", +" + std::to_string(bytes) + ") is not a " +
                                    std::to_string(kStagingAlign) + "-byte aligned range of the " +
                                    std::to_string(c->welcome.data_bytes) + "-byte slot");
    c->cuda_staging_offset = bytes ? offset : 0;
    c->cuda_staging_bytes = bytes;
    c->last_error.clear();
    return 0;
}

int ringd_cuda_allocation(ringd_client *c, const void *dev_ptr, void **base, size_t *bytes, uint64_t *buffer_id) {
    if (!c || !dev_ptr) return c ? c->fail(-EINVAL, "ringd_cuda_allocation: dev_ptr NULL") : -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        const auto ptr = reinterpret_cast<CUdeviceptr>(dev_ptr);
        if (int rc = ensure_cuda(*c, ptr); rc != 0) return rc;
        CudaClient &cc = *c->cuda;
        const cuda::CudaApi &api = *cc.api;
        ContextScope scope(api, cc.ctx);
        CUdeviceptr b = 0;
        size_t n = 0;
        if (CUresult r = api.cuMemGetAddressRange(&b, &n, ptr); r != CUDA_SUCCESS)
            return driver_fail(*c, "device pointer " + hex(ptr) + " is in no allocation (cuMemGetAddressRange)", r);
        unsigned long long id = 0;
        if (CUresult r = api.cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr); r != CUDA_SUCCESS)
            return driver_fail(*c, "cuPointerGetAttribute(BUFFER_ID)", r);
        if (base) *base = reinterpret_cast<void *>(b);
        if (bytes) *bytes = n;
        if (buffer_id) *buffer_id = id;
        c->last_error.clear();
        return 0;
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

int ringd_stream_wait(ringd_client *c, uint64_t ticket, struct CUstream_st *stream) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        const uint32_t entry = static_cast<uint32_t>(ticket % proto::kQueueDepth);
        // Only device ops' done words are written; an older device op of this entry has its word
        // past by now (the words only grow).
        if (!c->cuda || !c->cuda->ctx || ticket == 0 || ticket >= c->next_seq || c->cuda->device_seq[entry] < ticket)
            return c->fail(-EINVAL, "ticket " + std::to_string(ticket) + " is not a device op of this client");
        // A later device op took this entry: the ticket's op (whatever it was) has ended and its
        // result is in place; there is nothing to wait for.
        if (c->cuda->device_seq[entry] != ticket) {
            c->last_error.clear();
            return 0;
        }
        CudaClient &cc = *c->cuda;
        const cuda::CudaApi &api = *cc.api;
        const uint32_t word = static_cast<uint32_t>(ticket);
        if (cc.ringd_gone || c->dead)  // nobody will write the word: it is written now
            release_word(c->header->cuda_done[entry], word);
        ContextScope scope(api, cc.ctx);
        CUresult r;
        if (cc.memops) {
            r = api.cuStreamWaitValue32(stream, cc.sync + kDoneOffset + 4 * entry, word, CU_STREAM_WAIT_VALUE_GEQ);
        } else {
            const auto deadline = Clock::now() + std::chrono::milliseconds(c->welcome.op_timeout_ms) + c->wait_margin;
            r = api.cuLaunchHostFunc(stream, host_wait, new HostWait{&c->header->cuda_done[entry], word, deadline});
        }
        if (r != CUDA_SUCCESS) return driver_fail(*c, "waiting for the op on the stream", r);
        record_after(cc, stream);
        c->last_error.clear();
        return 0;
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

int ringd_allreduce_cuda(ringd_client *c, void *dev_ptr, size_t count, ringd_dtype dtype, ringd_op op,
                         struct CUstream_st *stream, int timeout_ms) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    uint64_t ticket = 0;
    if (int rc = ringd_submit_cuda(c, dev_ptr, count, dtype, op, stream, &ticket); rc != 0) return rc;
    const int rc = ringd_wait(c, ticket, timeout_ms);
    if (rc == -ETIMEDOUT) {
        Ticket &t = c->tickets[ticket % c->tickets.size()];
        if (t.seq == ticket && t.state == TicketState::InFlight) t.state = TicketState::Abandoned;
    }
    return rc;
}

}  // extern "C"

#else  // built without CUDA

struct ringd_client_detail::CudaClient {};
void CudaClientDelete::operator()(CudaClient *cc) const { delete cc; }
void cuda_client_closing(ringd_client &) {}
void cuda_client_dead(ringd_client &) {}
void cuda_ticket_ended(ringd_client &, uint64_t, int32_t) {}
bool cuda_staging_overlaps(const ringd_client &, uint64_t, uint64_t, uint64_t *) { return false; }
bool cuda_part_ended(ringd_client &, uint64_t, int32_t, std::string &) { return false; }
void cuda_pump(ringd_client &) {}
bool cuda_backlog(const ringd_client &) { return false; }
void cuda_hold(ringd_client &, const proto::SubmitDesc &) {}

extern "C" {
#define RINGD_NO_CUDA(c) ((c) ? (c)->fail(-ENOTSUP, "libringd-client was built without CUDA") : -EINVAL)
int ringd_cuda_alloc(ringd_client *c, size_t, void **) { return RINGD_NO_CUDA(c); }
int ringd_cuda_free(ringd_client *c, void *) { return RINGD_NO_CUDA(c); }
int ringd_register_cuda(ringd_client *c, const void *, size_t, uint64_t *) { return RINGD_NO_CUDA(c); }
int ringd_unregister_cuda(ringd_client *c, uint64_t) { return RINGD_NO_CUDA(c); }
int ringd_submit_cuda(ringd_client *c, void *, size_t, ringd_dtype, ringd_op, struct CUstream_st *, uint64_t *) {
    return RINGD_NO_CUDA(c);
}
int ringd_submit_coll_cuda(ringd_client *c, const ringd_coll_cuda *, struct CUstream_st *, uint64_t *) { return RINGD_NO_CUDA(c); }
unsigned int ringd_cuda_collectives(void) { return 0; }
int ringd_cuda_all_to_all_splits(void) { return 0; }
int ringd_stream_wait(ringd_client *c, uint64_t, struct CUstream_st *) { return RINGD_NO_CUDA(c); }
int ringd_set_cuda_part_bytes(ringd_client *c, size_t) { return RINGD_NO_CUDA(c); }
int ringd_set_cuda_staging(ringd_client *c, size_t, size_t) { return RINGD_NO_CUDA(c); }
int ringd_cuda_allocation(ringd_client *c, const void *, void **, size_t *, uint64_t *) { return RINGD_NO_CUDA(c); }
int ringd_allreduce_cuda(ringd_client *c, void *, size_t, ringd_dtype, ringd_op, struct CUstream_st *, int) {
    return RINGD_NO_CUDA(c);
}
}

#endif
