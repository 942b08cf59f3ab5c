#include "daemon/cuda/cuda_service.h"

#ifdef RINGD_HAVE_CUDA
#include "common/cuda/cuda_api.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/ipc/slot.h"

namespace ringd {
namespace {

std::string uuid_string(const uint8_t u[16]) {
    char s[64];
    std::snprintf(s, sizeof s, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                  u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    return s;
}

constexpr size_t kReadyOffset = offsetof(proto::SlotHeader, cuda_ready);
constexpr size_t kDoneOffset = offsetof(proto::SlotHeader, cuda_done);

}  // namespace

struct CudaService::Device {
    int ordinal = 0;
    CUdevice dev = 0;
    CUcontext ctx = nullptr;  // the primary context, retained on first use
    uint8_t uuid[16] = {};
    std::string name;
};

// One open of a trainer's allocation in this process. Registrations and ops in flight hold it;
// it closes when the last of them lets go (or earlier, idle, for room: then it opens again).
struct CudaService::Mapping {
    CudaService *owner = nullptr;
    proto::CudaMemoryKind kind{};
    Device *device = nullptr;
    uint64_t bytes = 0;
    std::array<uint8_t, proto::kCudaIpcHandleBytes> handle{};  // LegacyIpc
    CUmemGenericAllocationHandle vmm = 0;                      // Vmm: imported once, kept to map again
    CUdeviceptr base = 0;                                      // 0 while closed
    size_t ops = 0;                                            // ops in flight on it
    uint64_t last_use = 0;
    ~Mapping() {
        owner->close(*this);
        if (vmm) owner->api_.cuMemRelease(vmm);
    }
};

struct CudaService::Registration {
    std::shared_ptr<Mapping> mapping;
    uint64_t offset = 0;  // into the allocation
    uint64_t bytes = 0;
    uint64_t client_ptr = 0;
};

struct CudaService::Op {
    enum Phase : uint8_t { StagingIn, Staged, StagingOut } phase = StagingIn;
    uint32_t entry = 0;  // its done word's index
    uint32_t word = 0;   // the seq's low 32 bits
    // The ready word it waits for: its own, or (a part of a larger device op) the op's last part's.
    uint32_t ready_entry = 0, ready_word = 0;
    // Its copies: device->host to stage in, host->device to stage out (an allreduce: one range
    // each way; a reduce_scatter or allgather: a range of every block on the side with one per rank).
    struct Copy {  // `n` ranges of `bytes`, each `dev_stride` / `host_stride` after the one before
        CUdeviceptr dev = 0;
        std::byte *host = nullptr;
        uint64_t bytes = 0, n = 1, dev_stride = 0, host_stride = 0;
    };
    Copy in, out;
    // The registrations' mappings it uses (the output's, when another: out_mapping); held (ops)
    // until it ends.
    std::shared_ptr<Mapping> mapping, out_mapping;
    Error error{0, {}};  // part of the stage-in could not be queued: the op fails when it is staged

    void unhold() const;
    void forget_mappings() const;  // abandoned: never unmapped under the stream
};

struct CudaService::Client {
    MemberId id = 0;
    Device *device = nullptr;
    std::shared_ptr<Slot> slot;
    bool host_registered = false;
    CUdeviceptr sync = 0;        // the slot header's device address
    CUstream in = nullptr;       // stage-in: waits for ready words, device->host copies
    CUstream out = nullptr;      // stage-out: host->device copies, done words
    std::map<uint64_t, Registration> regs;
    std::map<uint64_t, Op> ops;  // by seq
    bool gone = false;
    int drains = 0;              // Drained events still to come
    Clock::time_point gone_at{};
    bool stuck = false;          // a stream of it did not drain: no more device ops for it
    // Done words of ops that ended without their stage-out, written from the host in seq order:
    // an op's word only once no op of a lower seq is still in ringd (a large op's parts are
    // consecutive ops, and the trainer's stream waits for the last part's word only).
    std::map<uint64_t, uint32_t> done_due;  // seq -> entry
};

// Stage events from the driver's callback thread to the control thread.
struct CudaService::EventQueue {
    UniqueFd fd{::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)};
    std::mutex mu;
    std::vector<CudaStageEvent> events;
};

namespace {

constexpr size_t kMaxRegistrationsPerClient = 4096;
constexpr auto kDrainBound = std::chrono::seconds(10);  // a departed client's streams, at most

struct HostFuncArg {
    std::shared_ptr<void> queue;  // CudaService::EventQueue, kept alive past the service
    void (*push)(void *queue, const CudaStageEvent &e);
    CudaStageEvent event;
};

// Runs on the driver's callback thread: it may not call CUDA; it only queues the event.
void CUDA_CB on_host_func(void *p) {
    std::unique_ptr<HostFuncArg> a(static_cast<HostFuncArg *>(p));
    a->push(a->queue.get(), a->event);
}

}  // namespace

Result<std::unique_ptr<CudaService>> CudaService::start(const Config::Cuda &config) {
    auto provider = cuda::parse_provider(config.provider);
    if (!provider) return provider.error();
    auto api = cuda::load_cuda(*provider);
    if (!api) return api.error();
    std::unique_ptr<CudaService> s(new CudaService(**api, config));
    if (!s->events_->fd) return make_error(-errno, "eventfd: " + errno_string(errno));
    int n = 0;
    if (CUresult r = s->api_.cuDeviceGetCount(&n); r != CUDA_SUCCESS) return s->driver_error("cuDeviceGetCount", r);
    for (int i = 0; i < n; ++i) {
        auto d = std::make_unique<Device>();
        d->ordinal = i;
        char name[256] = {};
        CUuuid uuid{};
        if (CUresult r = s->api_.cuDeviceGet(&d->dev, i); r != CUDA_SUCCESS) return s->driver_error("cuDeviceGet", r);
        if (CUresult r = s->api_.cuDeviceGetUuid(&uuid, d->dev); r != CUDA_SUCCESS)
            return s->driver_error("cuDeviceGetUuid", r);
        std::memcpy(d->uuid, uuid.bytes, 16);
        if (s->api_.cuDeviceGetName(name, sizeof name - 1, d->dev) == CUDA_SUCCESS) d->name = name;
        s->devices_.push_back(std::move(d));
    }
    return s;
}

CudaService::CudaService(const cuda::CudaApi &api, const Config::Cuda &config)
    : api_(api), config_(config), events_(std::make_shared<EventQueue>()) {}

CudaService::~CudaService() {
    // Shutdown: every word released so that the streams run dry (each waited for a bounded
    // time), then mappings closed and slots unpinned. A client whose streams do not drain keeps
    // its memory: the process is ending anyway.
    std::vector<MemberId> ids;
    for (auto &[id, c] : clients_) release_words(*c);
    const auto until = Clock::now() + std::chrono::seconds(3);  // for all of them together
    for (auto &[id, c] : clients_) {
        (void)make_current(*c->device);
        const auto left = [&] {
            return std::max(std::chrono::milliseconds(0),
                            std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()));
        };
        if (drained(c->in, left()) && drained(c->out, left())) ids.push_back(id);
        else abandoned_.push_back(std::move(c));
    }
    for (MemberId id : ids) cleanup(id);
    clients_.clear();
    for (auto &c : abandoned_) {  // their mappings stay open, their pins stay
        for (auto &[reg, r] : c->regs) r.mapping->base = 0;
        for (auto &[seq, op] : c->ops) op.forget_mappings();
        c->regs.clear();
        c->ops.clear();
    }
    for (auto &d : devices_)
        if (d->ctx) api_.cuDevicePrimaryCtxRelease(d->dev);
}

int CudaService::event_fd() const { return events_->fd.get(); }

Error CudaService::driver_error(const std::string &what, int cu_result) const {
    const auto r = static_cast<CUresult>(cu_result);
    const int code = r == CUDA_ERROR_OUT_OF_MEMORY         ? -ENOMEM
                     : r == CUDA_ERROR_INVALID_HANDLE      ? -EBADF
                     : r == CUDA_ERROR_NOT_SUPPORTED       ? -ENOTSUP
                                                           : -EIO;
    return make_error(code, what + ": " + cuda::error_string(api_, r));
}

Result<CudaService::Device *> CudaService::device_of(const uint8_t uuid[16]) {
    for (auto &d : devices_)
        if (std::memcmp(d->uuid, uuid, 16) == 0) {
            if (!d->ctx)
                if (CUresult r = api_.cuDevicePrimaryCtxRetain(&d->ctx, d->dev); r != CUDA_SUCCESS) {
                    d->ctx = nullptr;
                    return driver_error("GPU " + uuid_string(uuid) + ": cuDevicePrimaryCtxRetain", r);
                }
            return d.get();
        }
    std::string seen;
    for (auto &d : devices_) seen += (seen.empty() ? "" : ", ") + uuid_string(d->uuid);
    return make_error(-ENODEV, "GPU " + uuid_string(uuid) + " is not visible to ringd (it sees " +
                                   (seen.empty() ? std::string("no GPU") : seen) + ")");
}

Status CudaService::make_current(const Device &d) {
    if (CUresult r = api_.cuCtxSetCurrent(d.ctx); r != CUDA_SUCCESS) return driver_error("cuCtxSetCurrent", r);
    return Ok{};
}

// A stream's work is done within `bound` (false: it is not, and may never be).
bool CudaService::drained(CUstream stream, std::chrono::milliseconds bound) {
    if (!stream) return true;
    const auto until = Clock::now() + bound;
    for (;;) {
        const CUresult r = api_.cuStreamQuery(stream);
        if (r != CUDA_ERROR_NOT_READY) return true;  // done, or the stream is broken: nothing runs on it
        if (Clock::now() >= until) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
}

// The client's slot registered with the driver (so copies into it run at full speed and the
// streams can reach its sync words), and its streams: once, at its first registration. State is
// kept only once every step worked.
Status CudaService::prepare_client(Client &c, Device &d, const std::shared_ptr<Slot> &slot) {
    if (c.device && c.device != &d)
        return make_error(-EINVAL, "this client registered memory of GPU " + uuid_string(c.device->uuid) +
                                       " already; one GPU per client (connect once per GPU)");
    if (auto s = make_current(d); !s) return s;
    if (!c.host_registered) {
        void *base = &slot->header();
        const size_t bytes = slot->geometry().map_bytes;
        if (CUresult r = api_.cuMemHostRegister(base, bytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
            r != CUDA_SUCCESS)
            return driver_error("registering the slot with the driver (cuMemHostRegister of " + std::to_string(bytes) +
                                    " bytes; is the memlock limit high enough?)",
                                r);
        CUdeviceptr sync = 0;
        if (CUresult r = api_.cuMemHostGetDevicePointer(&sync, base, 0); r != CUDA_SUCCESS) {
            api_.cuMemHostUnregister(base);
            return driver_error("cuMemHostGetDevicePointer", r);
        }
        c.host_registered = true;
        c.sync = sync;
        c.slot = slot;
    }
    c.device = &d;
    for (CUstream *s : {&c.in, &c.out})
        if (!*s)
            if (CUresult r = api_.cuStreamCreate(s, CU_STREAM_NON_BLOCKING); r != CUDA_SUCCESS) {
                *s = nullptr;
                return driver_error("cuStreamCreate", r);
            }
    return Ok{};
}

// Closes idle mappings, least recently used first, until `bytes` more fit under the cap.
Status CudaService::make_room(uint64_t bytes, const Mapping *keep) {
    while (stats_.mapped_bytes + bytes > config_.max_mapped_bytes) {
        Mapping *victim = nullptr;
        for (auto &[id, c] : clients_)
            for (auto &[reg, r] : c->regs) {
                Mapping *m = r.mapping.get();
                if (m != keep && m->base && m->ops == 0 && (!victim || m->last_use < victim->last_use)) victim = m;
            }
        if (!victim)
            return make_error(-ENOMEM, std::to_string(bytes) + " more bytes of device memory would exceed "
                                       "cuda.max_mapped_bytes (" + std::to_string(config_.max_mapped_bytes) +
                                       ", " + std::to_string(stats_.mapped_bytes) + " mapped and in use)");
        close(*victim);
        ++stats_.evictions;
    }
    return Ok{};
}

Status CudaService::open(Mapping &m) {
    m.last_use = ++use_clock_;
    if (m.base) return Ok{};
    if (auto s = make_room(m.bytes, &m); !s) return s;
    if (auto s = make_current(*m.device); !s) return s;
    if (m.kind == proto::CudaMemoryKind::LegacyIpc) {
        CUipcMemHandle h{};
        std::memcpy(h.reserved, m.handle.data(), sizeof h.reserved);
        CUdeviceptr base = 0;
        if (CUresult r = api_.cuIpcOpenMemHandle(&base, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS); r != CUDA_SUCCESS)
            return driver_error("opening the trainer's IPC handle (cuIpcOpenMemHandle; did the trainer free the memory "
                                "or exit?)", r);
        // The whole declared allocation must be inside what the driver mapped.
        CUdeviceptr range = 0;
        size_t size = 0;
        if (CUresult r = api_.cuMemGetAddressRange(&range, &size, base); r != CUDA_SUCCESS || range != base ||
                                                                        size < m.bytes) {
            api_.cuIpcCloseMemHandle(base);
            return make_error(-EINVAL, "the IPC handle maps " + std::to_string(size) + " bytes, not the declared " +
                                           std::to_string(m.bytes));
        }
        m.base = base;
    } else {
        CUdeviceptr va = 0;
        if (CUresult r = api_.cuMemAddressReserve(&va, m.bytes, 0, 0, 0); r != CUDA_SUCCESS)
            return driver_error("cuMemAddressReserve", r);
        if (CUresult r = api_.cuMemMap(va, m.bytes, 0, m.vmm, 0); r != CUDA_SUCCESS) {
            api_.cuMemAddressFree(va, m.bytes);
            return driver_error("mapping the trainer's allocation (cuMemMap of " + std::to_string(m.bytes) + " bytes)", r);
        }
        CUmemAccessDesc access{};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = m.device->ordinal;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if (CUresult r = api_.cuMemSetAccess(va, m.bytes, &access, 1); r != CUDA_SUCCESS) {
            api_.cuMemUnmap(va, m.bytes);
            api_.cuMemAddressFree(va, m.bytes);
            return driver_error("cuMemSetAccess", r);
        }
        m.base = va;
    }
    stats_.mapped_bytes += m.bytes;
    ++stats_.opens;
    return Ok{};
}

void CudaService::close(Mapping &m) {
    if (!m.base) return;
    (void)make_current(*m.device);
    if (m.kind == proto::CudaMemoryKind::LegacyIpc) {
        api_.cuIpcCloseMemHandle(m.base);
    } else {
        api_.cuMemUnmap(m.base, m.bytes);
        api_.cuMemAddressFree(m.base, m.bytes);
    }
    m.base = 0;
    stats_.mapped_bytes -= m.bytes;
    ++stats_.closes;
}

Result<uint64_t> CudaService::register_memory(MemberId id, const std::shared_ptr<Slot> &slot,
                                              const proto::CudaRegister &r, std::vector<UniqueFd> fds) {
    const bool vmm = r.kind == proto::CudaMemoryKind::Vmm;
    if (fds.size() != (vmm ? 1u : 0u))
        return make_error(-EINVAL, std::string(vmm ? "a VMM registration comes with exactly one fd"
                                                   : "a legacy IPC registration comes with no fd") +
                                       " (got " + std::to_string(fds.size()) + ")");
    auto d = device_of(r.device_uuid);
    if (!d) return d.error();
    auto &c = clients_[id];
    if (!c) {
        c = std::make_unique<Client>();
        c->id = id;
    }
    if (c->gone) return make_error(-ECONNRESET, "client is leaving");
    if (c->regs.size() >= kMaxRegistrationsPerClient)
        return make_error(-ENOSPC, "this client holds " + std::to_string(c->regs.size()) +
                                       " CUDA registrations, the most one client may (unregister some)");
    if (auto s = prepare_client(*c, **d, slot); !s) return s.error();

    std::shared_ptr<Mapping> m;
    std::array<uint8_t, proto::kCudaIpcHandleBytes> key{};
    std::memcpy(key.data(), r.ipc_handle, key.size());
    if (!vmm) {
        auto it = legacy_.find({id, key});
        if (it != legacy_.end()) m = it->second.lock();
        if (m && (m->device != *d || m->bytes != r.alloc_bytes))
            return make_error(-EINVAL, "this client registered this IPC handle already as " + std::to_string(m->bytes) +
                                           " bytes of GPU " + uuid_string(m->device->uuid));
    }
    if (!m) {
        m = std::make_shared<Mapping>();
        m->owner = this;
        m->kind = r.kind;
        m->device = *d;
        m->bytes = r.alloc_bytes;
        m->handle = key;
        if (vmm) {
            if (auto s = make_current(**d); !s) return s.error();
            void *os = reinterpret_cast<void *>(static_cast<uintptr_t>(fds[0].get()));
            if (CUresult e = api_.cuMemImportFromShareableHandle(&m->vmm, os, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
                e != CUDA_SUCCESS) {
                m->vmm = 0;
                return driver_error("importing the trainer's allocation (cuMemImportFromShareableHandle)", e);
            }
        }
        if (auto s = open(*m); !s) return s.error();
        if (!vmm) legacy_[{id, key}] = m;
    } else if (auto s = open(*m); !s) {
        return s.error();
    }
    const uint64_t reg = next_reg_++;
    c->regs[reg] = Registration{m, r.offset, r.bytes, r.client_ptr};
    ++stats_.registrations;
    return reg;
}

Result<bool> CudaService::unregister(MemberId id, uint64_t reg) {
    auto it = clients_.find(id);
    if (it == clients_.end() || !it->second->regs.count(reg))
        return make_error(-ENOENT, "CUDA registration " + std::to_string(reg) + " is not one of this client's");
    std::shared_ptr<Mapping> m = it->second->regs.at(reg).mapping;
    it->second->regs.erase(reg);
    bool now = true;
    // A legacy allocation may be freed by its exporter only once no importer has it open: while
    // an op still uses the mapping, the answer waits for it to close.
    if (m->kind == proto::CudaMemoryKind::LegacyIpc && m->ops > 0) {
        bool other = false;  // another registration of the client keeps it: it will not be freed now
        for (auto &[r, rr] : it->second->regs) other |= rr.mapping == m;
        if (!other) {
            pending_unregister_.push_back({id, reg, m});
            now = false;
        }
    }
    m.reset();
    for (auto l = legacy_.begin(); l != legacy_.end();) l = l->second.expired() ? legacy_.erase(l) : std::next(l);
    return now;
}

void CudaService::check_unregistered() {
    for (auto p = pending_unregister_.begin(); p != pending_unregister_.end();) {
        auto m = p->mapping.lock();
        if (!m || !m->base) {
            unregistered_.emplace_back(p->member, p->reg);
            p = pending_unregister_.erase(p);
        } else {
            ++p;
        }
    }
}

std::vector<std::pair<MemberId, uint64_t>> CudaService::take_unregistered() {
    check_unregistered();
    return std::exchange(unregistered_, {});
}

Status CudaService::enqueue_event(CUstream stream, MemberId id, uint64_t seq, CudaStageEvent::Kind kind) {
    auto *a = new HostFuncArg{events_, [](void *q, const CudaStageEvent &e) {
                                  auto *eq = static_cast<EventQueue *>(q);
                                  {
                                      std::lock_guard lock(eq->mu);
                                      eq->events.push_back(e);
                                  }
                                  const uint64_t one = 1;
                                  (void)!::write(eq->fd.get(), &one, sizeof one);
                              },
                              CudaStageEvent{id, seq, kind, Error{0, {}}}};
    if (CUresult r = api_.cuLaunchHostFunc(stream, on_host_func, a); r != CUDA_SUCCESS) {
        delete a;
        return driver_error("cuLaunchHostFunc", r);
    }
    return Ok{};
}

Status CudaService::stage_in(MemberId id, const proto::Submission &s, uint32_t rank) {
    const std::string at = "op " + std::to_string(s.seq) + ": ";
    auto it = clients_.find(id);
    Client *c = it == clients_.end() ? nullptr : it->second.get();
    if (!c) return make_error(-ENOENT, at + "CUDA registration " + std::to_string(s.cuda_reg) + " is not one of this client's");
    // The device ranges, whole (a reduce_scatter's or allgather's part reads and writes a range of
    // each block of them): the input in cuda_reg, the output in cuda_out_reg.
    const OpDesc &d = s.desc;
    // coll: by blocks (reduce_scatter, allgather, all_to_all: a block per rank on one side or both)
    const bool a2a = d.collective == Collective::AllToAll;
    const bool coll = collective_blocked(d.collective) || a2a, rs = d.collective == Collective::ReduceScatter;
    // An all_to_all with split sizes runs whole: its input and output as the table says (s.bytes,
    // s.out_bytes, from take_splits).
    const bool splits = a2a && s.splits != nullptr;
    if (a2a && s.splits_pending) return make_error(-EINVAL, at + "split sizes not taken");
    const uint64_t es = dtype_size(d.dtype), block = s.cuda_block * es, part = d.count * es;
    auto in = device_range(c->regs, at, coll ? "input" : "", s.cuda_reg, s.cuda_offset,
                           splits ? s.bytes : coll ? (rs || a2a ? d.ranks * block : block) : s.bytes);
    if (!in) return in.error();
    const Registration *out_reg = *in;
    if (coll) {
        auto out = device_range(c->regs, at, "output", s.cuda_out_reg, s.cuda_out_offset,
                                splits ? s.out_bytes : rs ? block : d.ranks * block);
        if (!out) return out.error();
        out_reg = *out;
    }
    if (c->ops.count(s.seq)) return make_error(-EINVAL, at + "already in flight");
    if (c->stuck)
        return make_error(-EIO, at + "ringd's CUDA stream for this client is stuck (a driver error); reconnect");
    // Both mappings open, each held while the other opens (opening one may close idle ones).
    Mapping &m = *(*in)->mapping;
    const std::shared_ptr<Mapping> om = out_reg->mapping != (*in)->mapping ? out_reg->mapping : nullptr;
    if (auto o = open(m); !o) return make_error(o.error().code, at + o.error().message);
    ++m.ops;
    if (om) {
        if (auto o = open(*om); !o) {
            --m.ops;
            return make_error(o.error().code, at + o.error().message);
        }
        ++om->ops;
    }
    Op op;
    op.mapping = (*in)->mapping;
    op.out_mapping = om;
    if (auto o = make_current(*c->device); !o) {
        op.unhold();
        return o;
    }
    op.entry = static_cast<uint32_t>(s.seq % proto::kQueueDepth);
    op.word = static_cast<uint32_t>(s.seq);
    op.ready_entry = static_cast<uint32_t>(s.ready_seq % proto::kQueueDepth);
    op.ready_word = static_cast<uint32_t>(s.ready_seq);
    const CUdeviceptr dev_in = m.base + (*in)->offset + s.cuda_offset;
    std::byte *host_in = c->slot->data() + s.offset;
    if (!coll) {
        op.in = op.out = Op::Copy{dev_in, host_in, s.bytes};
        // A broadcast's root and a reduce's other ranks get nothing back; a broadcast's other
        // ranks send nothing (their buffers are overwritten). The wait for the trainer's stream
        // stays: what the stage-out writes comes after what the trainer queued before the op.
        const bool root = collective_is_rooted(d.collective) && rank == d.root;
        if ((d.collective == Collective::Broadcast && root) || (d.collective == Collective::Reduce && !root)) op.out.bytes = 0;
        if (d.collective == Collective::Broadcast && !root) op.in.bytes = 0;
    } else {
        // reduce_scatter: every block's part in, one out; allgather: one in, every block's out.
        const CUdeviceptr dev_out = (om ? om->base : m.base) + out_reg->offset + s.cuda_out_offset;
        std::byte *host_out = c->slot->data() + s.out_offset;
        const uint64_t at_part = s.cuda_part * es;
        if (splits) {  // the whole of each side
            op.in = Op::Copy{dev_in, host_in, s.bytes};
            op.out = Op::Copy{dev_out, host_out, s.out_bytes};
        } else if (a2a) {  // a piece of every block each way
            op.in = Op::Copy{dev_in + at_part, host_in, part, d.ranks, block, part};
            op.out = Op::Copy{dev_out + at_part, host_out, part, d.ranks, block, part};
        } else if (rs) {
            op.in = Op::Copy{dev_in + at_part, host_in, part, d.ranks, block, part};
            op.out = Op::Copy{dev_out + at_part, host_out, part};
        } else {
            op.in = Op::Copy{dev_in + at_part, host_in, part};
            op.out = Op::Copy{dev_out + at_part, host_out, part, d.ranks, block, part};
        }
    }
    if (CUresult e = api_.cuStreamWaitValue32(c->in, c->sync + kReadyOffset + 4 * op.ready_entry, op.ready_word,
                                              CU_STREAM_WAIT_VALUE_GEQ);
        e != CUDA_SUCCESS) {
        op.unhold();
        return driver_error(at + "waiting for the trainer's stream (cuStreamWaitValue32: this GPU and driver need "
                                 "stream memory operations)", e);
    }
    // From here on work is queued: the op is tracked (its mappings and staging held) until its
    // StagedIn event, whatever else fails.
    for (uint64_t k = 0; k < op.in.n && op.in.bytes > 0; ++k)
        if (CUresult e = api_.cuMemcpyDtoHAsync(op.in.host + k * op.in.host_stride, op.in.dev + k * op.in.dev_stride,
                                                op.in.bytes, c->in);
            e != CUDA_SUCCESS) {
            op.error = driver_error(at + "device->host copy (cuMemcpyDtoHAsync)", e);
            break;
        }
    ++stats_.ops_staged;
    if (op.error.code == 0) stats_.staged_in_bytes += op.in.n * op.in.bytes;
    auto &placed = c->ops.emplace(s.seq, std::move(op)).first->second;
    if (auto o = enqueue_event(c->in, id, s.seq, CudaStageEvent::StagedIn); !o) {
        // No event will come: let the stream pass the wait and see it drain, within a bound.
        c->slot->header().cuda_ready[placed.ready_entry].store(placed.ready_word, std::memory_order_release);
        if (!drained(c->in, std::chrono::seconds(1))) {
            spdlog::error("client {}: its CUDA stage-in stream does not drain; no more device ops for it", id);
            c->stuck = true;
            return make_error(o.error().code, at + o.error().message);  // op and mappings stay held
        }
        placed.unhold();
        c->ops.erase(s.seq);
        return make_error(o.error().code, at + o.error().message);
    }
    return Ok{};
}

// A registration of the client's with [offset, offset + bytes) inside it, or why not.
Result<const CudaService::Registration *> CudaService::device_range(const std::map<uint64_t, Registration> &regs,
                                                                    const std::string &at, const char *what, uint64_t reg,
                                                                    uint64_t offset, uint64_t bytes) {
    auto r = regs.find(reg);
    const std::string side = *what ? std::string(what) + " " : "";
    if (r == regs.end())
        return make_error(-ENOENT, at + side + "CUDA registration " + std::to_string(reg) + " is not one of this client's");
    uint64_t end = 0;
    if (__builtin_add_overflow(offset, bytes, &end) || end > r->second.bytes)
        return make_error(-ERANGE, at + side + "device range [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                                       ") lies outside registration " + std::to_string(reg) + " (" +
                                       std::to_string(r->second.bytes) + " bytes)");
    return &r->second;
}

void CudaService::Op::unhold() const {
    if (mapping) --mapping->ops;
    if (out_mapping) --out_mapping->ops;
}

void CudaService::Op::forget_mappings() const {
    if (mapping) mapping->base = 0;
    if (out_mapping) out_mapping->base = 0;
}

bool CudaService::owns_completion(MemberId id, uint64_t seq) const {
    auto it = clients_.find(id);
    if (it == clients_.end()) return false;
    auto o = it->second->ops.find(seq);
    return o != it->second->ops.end() && o->second.phase == Op::Staged;
}

Status CudaService::stage_out(MemberId id, uint64_t seq) {
    auto it = clients_.find(id);
    if (it == clients_.end() || !it->second->ops.count(seq) || it->second->ops.at(seq).phase != Op::Staged)
        return make_error(-ENOENT, "op " + std::to_string(seq) + " is not a staged device-buffer op");
    Client &c = *it->second;
    Op &op = c.ops.at(seq);
    if (c.gone) {  // its streams are draining: nothing more goes on them
        finish(id, seq);
        return make_error(-ECONNRESET, "op " + std::to_string(seq) + ": the client left");
    }
    if (auto s = make_current(*c.device); !s) {
        finish(id, seq);
        return s;
    }
    op.phase = Op::StagingOut;
    auto queued_fail = [&](const std::string &what, CUresult e) -> Status {
        // A copy may be queued: the op stays until the stream passed it (the event below).
        op.error = driver_error("op " + std::to_string(seq) + ": " + what, e);
        return Ok{};
    };
    Status st = Ok{};
    for (uint64_t k = 0; k < op.out.n && op.out.bytes > 0; ++k)
        if (CUresult e = api_.cuMemcpyHtoDAsync(op.out.dev + k * op.out.dev_stride, op.out.host + k * op.out.host_stride,
                                                op.out.bytes, c.out);
            e != CUDA_SUCCESS) {
            if (k > 0) {  // copies are queued: the op stays until the stream passed them
                st = queued_fail("host->device copy of the result (cuMemcpyHtoDAsync)", e);
                break;
            }
            op.phase = Op::Staged;
            finish(id, seq);
            return driver_error("op " + std::to_string(seq) + ": host->device copy of the result (cuMemcpyHtoDAsync)", e);
        }
    if (st.ok()) stats_.staged_out_bytes += op.out.n * op.out.bytes;
    if (CUresult e = api_.cuStreamWriteValue32(c.out, c.sync + kDoneOffset + 4 * op.entry, op.word,
                                               CU_STREAM_WRITE_VALUE_DEFAULT);
        e != CUDA_SUCCESS)
        st = queued_fail("cuStreamWriteValue32", e);
    if (auto s = enqueue_event(c.out, id, seq, CudaStageEvent::StagedOut); !s) {
        if (!drained(c.out, std::chrono::seconds(1))) {
            spdlog::error("client {}: its CUDA stage-out stream does not drain; no more device ops for it", id);
            c.stuck = true;
            return s;  // the op keeps its mapping: nothing is unmapped under a pending copy
        }
        finish(id, seq);
        return s;
    }
    return st;
}

void CudaService::finish(MemberId id, uint64_t seq) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    Client &c = *it->second;
    auto o = c.ops.find(seq);
    if (o == c.ops.end() || o->second.phase == Op::StagingIn) return;  // its stream work may still run
    c.done_due[seq] = o->second.entry;
    o->second.unhold();
    c.ops.erase(o);
    write_done_words(c);
    check_unregistered();
}

void CudaService::write_done_words(Client &c) {
    const uint64_t lowest = c.ops.empty() ? UINT64_MAX : c.ops.begin()->first;
    auto &h = c.slot->header();
    while (!c.done_due.empty() && c.done_due.begin()->first < lowest) {
        const auto [seq, entry] = *c.done_due.begin();
        h.cuda_done[entry].store(static_cast<uint32_t>(seq), std::memory_order_release);
        c.done_due.erase(c.done_due.begin());
    }
}

void CudaService::release_done(MemberId id, Slot &slot, uint64_t seq) {
    auto it = clients_.find(id);
    if (it == clients_.end() || !it->second->slot) {  // no device op of it in ringd: nothing comes before
        slot.header().cuda_done[seq % proto::kQueueDepth].store(static_cast<uint32_t>(seq), std::memory_order_release);
        return;
    }
    it->second->done_due[seq] = static_cast<uint32_t>(seq % proto::kQueueDepth);
    write_done_words(*it->second);
}

void CudaService::release_ready(MemberId id, uint64_t seq) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    auto o = it->second->ops.find(seq);
    if (o == it->second->ops.end() || o->second.phase != Op::StagingIn) return;
    ++stats_.stage_timeouts;
    it->second->slot->header().cuda_ready[o->second.ready_entry].store(o->second.ready_word, std::memory_order_release);
}

void CudaService::release_words(Client &c) {
    if (!c.slot) return;
    auto &h = c.slot->header();
    for (auto &[seq, op] : c.ops) {
        h.cuda_ready[op.ready_entry].store(op.ready_word, std::memory_order_release);
        h.cuda_done[op.entry].store(op.word, std::memory_order_release);
    }
}

void CudaService::client_gone(MemberId id) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    Client &c = *it->second;
    c.gone = true;
    c.gone_at = Clock::now();
    release_words(c);
    c.regs.clear();  // mappings held by ops in flight stay until the streams have passed them
    (void)make_current(*c.device);
    bool all = true;
    for (CUstream s : {c.in, c.out})
        if (s) {
            if (enqueue_event(s, id, 0, CudaStageEvent::Drained)) ++c.drains;
            else all = false;
        }
    if (!all || c.drains == 0) {
        // Without an event from each stream: see them drain here, within a bound.
        if (drained(c.in, std::chrono::seconds(1)) && drained(c.out, std::chrono::seconds(1))) cleanup(id);
        else c.drains = -1;  // tick() gives it up after the bound
    }
}

void CudaService::tick(Clock::time_point now) {
    std::vector<MemberId> give_up;
    for (auto &[id, c] : clients_) {
        if (!c->gone) continue;
        // A departed trainer's process may still write its words back: write them again.
        release_words(*c);
        if (now - c->gone_at > kDrainBound) give_up.push_back(id);
    }
    for (MemberId id : give_up) {
        auto node = clients_.extract(id);
        spdlog::error("client {}: its CUDA streams did not drain within {} s of its departure; its slot pin and "
                      "mappings are kept for the life of ringd",
                      id, std::chrono::duration_cast<std::chrono::seconds>(kDrainBound).count());
        for (auto &[seq, op] : node.mapped()->ops) op.forget_mappings();  // never unmapped under the stream
        node.mapped()->ops.clear();
        abandoned_.push_back(std::move(node.mapped()));
    }
}

// The client's streams have run dry: nothing of the driver touches its slot or mappings any more.
void CudaService::cleanup(MemberId id) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    Client &c = *it->second;
    if (c.device) (void)make_current(*c.device);
    for (CUstream s : {c.in, c.out})
        if (s) api_.cuStreamDestroy(s);
    for (auto &[seq, op] : c.ops) op.unhold();
    c.ops.clear();
    c.regs.clear();
    if (c.host_registered) api_.cuMemHostUnregister(&c.slot->header());
    clients_.erase(it);
    for (auto l = legacy_.begin(); l != legacy_.end();) l = l->second.expired() ? legacy_.erase(l) : std::next(l);
    check_unregistered();
}

std::vector<CudaStageEvent> CudaService::take_events() {
    uint64_t v;
    (void)!::read(events_->fd.get(), &v, sizeof v);
    std::vector<CudaStageEvent> out;
    {
        std::lock_guard lock(events_->mu);
        out.swap(events_->events);
    }
    std::vector<CudaStageEvent> live;
    for (auto &e : out) {
        auto it = clients_.find(e.member);
        if (it == clients_.end()) continue;
        Client &c = *it->second;
        if (e.kind == CudaStageEvent::Drained) {
            if (--c.drains == 0) cleanup(e.member);
            continue;
        }
        auto o = c.ops.find(e.seq);
        if (o == c.ops.end()) continue;
        if (e.kind == CudaStageEvent::StagedIn && o->second.phase == Op::StagingIn) {
            o->second.phase = Op::Staged;  // the stream has passed it: a completion may end it now
            e.error = o->second.error;
        } else if (e.kind == CudaStageEvent::StagedOut && o->second.phase == Op::StagingOut) {
            e.error = o->second.error;
            o->second.phase = Op::Staged;
            finish(e.member, e.seq);
        } else {
            continue;
        }
        if (!c.gone) live.push_back(std::move(e));
    }
    return live;
}

nlohmann::json CudaService::status() const {
    nlohmann::json devices = nlohmann::json::array();
    for (const auto &d : devices_)
        devices.push_back({{"ordinal", d->ordinal}, {"uuid", uuid_string(d->uuid)}, {"name", d->name},
                           {"context", d->ctx != nullptr}});
    size_t regs = 0, ops = 0;
    for (const auto &[id, c] : clients_) {
        regs += c->regs.size();
        ops += c->ops.size();
    }
    return {{"provider", cuda::provider_name(api_.provider)},
            {"driver_version", api_.driver_version},
            {"devices", devices},
            {"clients", clients_.size()},
            {"registrations", regs},
            {"registrations_total", stats_.registrations},
            {"opens", stats_.opens},
            {"closes", stats_.closes},
            {"evictions", stats_.evictions},
            {"mapped_bytes", stats_.mapped_bytes},
            {"max_mapped_bytes", config_.max_mapped_bytes},
            {"ops_in_flight", ops},
            {"ops_staged", stats_.ops_staged},
            {"staged_in_bytes", stats_.staged_in_bytes},
            {"staged_out_bytes", stats_.staged_out_bytes},
            {"stage_timeouts", stats_.stage_timeouts},
            {"abandoned_clients", abandoned_.size()}};
}

}  // namespace ringd

#else  // built without CUDA: there is never a service (the gateway answers with the reason)

namespace ringd {
Result<std::unique_ptr<CudaService>> CudaService::start(const Config::Cuda &) {
    return make_error(-ENOTSUP, "ringd was built without CUDA");
}
CudaService::~CudaService() = default;
struct CudaService::Device {};
struct CudaService::Mapping {};
struct CudaService::Client {};
struct CudaService::Op {};
struct CudaService::EventQueue {
    UniqueFd fd;
};
int CudaService::event_fd() const { return -1; }
std::vector<CudaStageEvent> CudaService::take_events() { return {}; }
Result<uint64_t> CudaService::register_memory(MemberId, const std::shared_ptr<Slot> &, const proto::CudaRegister &,
                                              std::vector<UniqueFd>) {
    return make_error(-ENOTSUP, "ringd was built without CUDA");
}
Result<bool> CudaService::unregister(MemberId, uint64_t) { return make_error(-ENOTSUP, "ringd was built without CUDA"); }
Status CudaService::stage_in(MemberId, const proto::Submission &, uint32_t) { return make_error(-ENOTSUP, "ringd was built without CUDA"); }
Status CudaService::stage_out(MemberId, uint64_t) { return make_error(-ENOTSUP, "ringd was built without CUDA"); }
void CudaService::finish(MemberId, uint64_t) {}
bool CudaService::owns_completion(MemberId, uint64_t) const { return false; }
void CudaService::tick(Clock::time_point) {}
std::vector<std::pair<MemberId, uint64_t>> CudaService::take_unregistered() { return {}; }
void CudaService::release_ready(MemberId, uint64_t) {}
void CudaService::release_done(MemberId, Slot &, uint64_t) {}
void CudaService::client_gone(MemberId) {}
nlohmann::json CudaService::status() const { return {}; }
}  // namespace ringd

#endif
