// CudaService: the trainers' device memory on this host (control thread). A trainer hands its GPU
// buffers over once (proto::CudaRegister: a VMM allocation as a POSIX fd, or a cudaMalloc-family
// buffer as the legacy IPC handle of its allocation); ringd maps each allocation once, in the
// primary context of the GPU with that UUID, and checks every op's device range against its own
// registration and mapping. A legacy handle is opened once for every client that presents it
// (a cache keyed by the handle); mappings close when their last registration goes (unregister,
// disconnect). Beyond cuda.max_mapped_bytes the least recently used idle mappings close, and
// open again when an op needs them.
//
// An op on a device buffer runs as a host op on its staging range in the trainer's slot (which
// ringd registers with the driver once). On the client's own ringd stream, in order:
//   stage-in:  wait until the slot's cuda_ready word for the op is >= seq (the trainer's stream
//              wrote it: the buffer is produced) -> device->host copy into the staging range
//   [the host op: local reduction + ring, as for any slot buffer]
//   stage-out: host->device copy of the result -> cuda_done = seq (the trainer's stream waits on it)
// Each stage ends with a host function that queues an event for the control thread (event_fd).
// An op that fails, or whose client goes, gets its words written from the host, so that neither
// ringd's stream nor the trainer's waits for ever.
#pragma once

#include <array>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/unique_fd.h"
#include "daemon/config.h"
#include "daemon/engine/group_table.h"
#include "proto/frame.h"
#include "proto/slot.h"

namespace ringd {
namespace cuda {
struct CudaApi;  // common/cuda/cuda_api.h (a build without CUDA has none)
}

class Slot;

struct CudaStageEvent {
    MemberId member = 0;
    uint64_t seq = 0;
    enum Kind : uint8_t { StagedIn, StagedOut, Drained } kind = StagedIn;
};

class CudaService {
public:
    // The provider's driver, loaded and initialised; an error when there is none (the daemon runs
    // without CUDA then and answers registrations with the reason).
    static Result<std::unique_ptr<CudaService>> start(const Config::Cuda &config);
    ~CudaService();
    CudaService(const CudaService &) = delete;
    CudaService &operator=(const CudaService &) = delete;

    // Readable when stage events are queued (take_events).
    int event_fd() const;
    std::vector<CudaStageEvent> take_events();

    // A registration of the client's device memory; its id for ops, or why not.
    Result<uint64_t> register_memory(MemberId id, const std::shared_ptr<Slot> &slot, const proto::CudaRegister &r,
                                     std::vector<UniqueFd> fds);
    // Ops in flight on it keep its mapping until they end.
    Status unregister(MemberId id, uint64_t reg);

    // Queues the op's stage-in (its StagedIn event follows). An error: the op cannot run (bad
    // registration or range, a driver error); nothing was queued.
    Status stage_in(MemberId id, const proto::Submission &s);
    // The op's host part succeeded: queues its stage-out (StagedOut follows). An error: nothing
    // was queued and the op is over (its done word written).
    Status stage_out(MemberId id, uint64_t seq);
    // The op ends without a stage-out (it failed): its done word is written from the host.
    void finish(MemberId id, uint64_t seq);
    // Whether (id, seq) is a device-buffer op between stage_in and its end.
    bool has_op(MemberId id, uint64_t seq) const;
    // The trainer's stream never marked the op's buffer ready (timeouts.op): ringd writes the
    // ready word itself so that its stream moves on; the op's StagedIn still follows.
    void release_ready(MemberId id, uint64_t seq);
    // The client left: its words are released, its stream drained (Drained follows), then its
    // registrations, mappings and slot registration go.
    void client_gone(MemberId id);

    nlohmann::json status() const;

private:
    struct Device;
    struct Mapping;
    struct Registration;
    struct Op;
    struct Client;
    struct EventQueue;

    explicit CudaService(const cuda::CudaApi &api, const Config::Cuda &config);
    Result<Device *> device_of(const uint8_t uuid[16]);
    Status make_current(const Device &d);
    Status prepare_client(Client &c, Device &d, const std::shared_ptr<Slot> &slot);
    Status open(Mapping &m);
    void close(Mapping &m);
    Status make_room(uint64_t bytes, const Mapping *keep);
    Status enqueue_event(Client &c, MemberId id, uint64_t seq, CudaStageEvent::Kind kind);
    void cleanup(MemberId id);
    Error driver_error(const std::string &what, int cu_result) const;

    const cuda::CudaApi &api_;
    Config::Cuda config_;
    std::vector<std::unique_ptr<Device>> devices_;
    std::shared_ptr<EventQueue> events_;
    std::map<MemberId, std::unique_ptr<Client>> clients_;
    // Legacy handles opened, by handle bytes (a handle presented again maps nothing new).
    std::map<std::array<uint8_t, proto::kCudaIpcHandleBytes>, std::weak_ptr<Mapping>> legacy_;
    uint64_t next_reg_ = 1;
    uint64_t use_clock_ = 0;  // LRU order of mappings
    struct Stats {
        uint64_t opens = 0, closes = 0, mapped_bytes = 0, registrations = 0, evictions = 0;
        uint64_t ops_staged = 0, stage_timeouts = 0;
    } stats_;
};

}  // namespace ringd
