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
// ringd registers with the driver once). Each client has two ringd streams:
//   stage-in stream:  wait until the slot's cuda_ready word for the op is >= seq (the trainer's
//                     stream wrote it: the buffer is produced) -> device->host copy into staging
//   [the host op: local reduction + ring, as for any slot buffer]
//   stage-out stream: host->device copy of the result -> cuda_done = seq (the trainer's stream
//                     may wait on it)
// Two streams, because a trainer that runs ahead queues op k+1's ready word behind its wait for
// op k's done word: one ringd stream would hold k's stage-out behind k+1's stage-in. The host
// orders each op's stage-out after its stage-in. Each stage ends with a host function that queues
// an event for the control thread (event_fd). Nothing is released (staging range, mapping, slot
// pin) while stream work that uses it may still run: an op ends only after its last stage's event.
// An op that fails, or whose client goes, gets its words written from the host, so that neither
// ringd's streams nor the trainer's wait for ever; a stream that still does not drain (a client
// that keeps writing the words back) is abandoned with its memory after a bound, never waited for
// without one.
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

struct CUstream_st;  // CUstream (cuda.h), declared alike there

namespace ringd {
namespace cuda {
struct CudaApi;  // common/cuda/cuda_api.h (a build without CUDA has none)
}

class Slot;

struct CudaStageEvent {
    MemberId member = 0;
    uint64_t seq = 0;
    enum Kind : uint8_t { StagedIn, StagedOut, Drained } kind = StagedIn;
    Error error{0, {}};  // StagedIn: the stage failed after work was queued (code != 0)
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
    // Ops in flight on it keep its mapping until they end. Returns whether the answer is due now
    // (false: take_unregistered() gives it once the mapping is closed).
    Result<bool> unregister(MemberId id, uint64_t reg);

    // Queues the op's stage-in (its StagedIn event follows, with an error if part of it could not
    // be queued). An error here: the op cannot run and nothing was queued. `rank`: the client's
    // rank in its group, which decides what a broadcast or reduce copies (a broadcast's root only
    // in, the others only out; a reduce's root in and out, the others only in: their buffers are
    // only read).
    Status stage_in(MemberId id, const proto::Submission &s, uint32_t rank);
    // Whether the op's result is this service's to complete: a device op whose stage-in ended
    // (its StagedIn event came) and whose stage-out has not begun. A completion of anything
    // else (e.g. a seq a client made up) never ends a device op.
    bool owns_completion(MemberId id, uint64_t seq) const;
    // The op's host part succeeded: queues its stage-out (StagedOut follows). An error: nothing
    // was queued and the op is over (its done word written).
    Status stage_out(MemberId id, uint64_t seq);
    // The op ends without a stage-out (it failed) or after it: its done word is written from the
    // host and it lets go of its mapping. Only for ops with no stream work left.
    void finish(MemberId id, uint64_t seq);
    // An op that ended before ringd queued anything for it (its stage-in refused): its done word,
    // written once no earlier op of the client is in ringd.
    void release_done(MemberId id, Slot &slot, uint64_t seq);
    // The trainer's stream never marked the op's buffer ready (timeouts.op): ringd writes the
    // ready word itself so that its stream moves on; the op's StagedIn still follows.
    void release_ready(MemberId id, uint64_t seq);
    // The client left: its words are released, its streams drained (Drained follows), then its
    // registrations, mappings and slot registration go.
    void client_gone(MemberId id);
    // Every tick: the words of departed clients written again until their streams drain; a
    // stream not drained within a bound is abandoned (logged), its memory kept mapped.
    void tick(Clock::time_point now);
    // Unregistrations answered late: a legacy IPC registration whose mapping an op still used is
    // answered once ringd closed it (the exporter may free the memory only then).
    std::vector<std::pair<MemberId, uint64_t>> take_unregistered();

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
    static Result<const Registration *> device_range(const std::map<uint64_t, Registration> &regs, const std::string &at,
                                                     const char *what, uint64_t reg, uint64_t offset, uint64_t bytes);
    Status enqueue_event(CUstream_st *stream, MemberId id, uint64_t seq, CudaStageEvent::Kind kind);
    bool drained(CUstream_st *stream, std::chrono::milliseconds bound);
    void release_words(Client &c);
    void write_done_words(Client &c);
    void check_unregistered();
    void cleanup(MemberId id);
    Error driver_error(const std::string &what, int cu_result) const;

    const cuda::CudaApi &api_;
    Config::Cuda config_;
    std::vector<std::unique_ptr<Device>> devices_;
    std::shared_ptr<EventQueue> events_;
    std::map<MemberId, std::unique_ptr<Client>> clients_;
    // Legacy handles opened, per client (a handle presented again by that client maps nothing
    // new; another client's open of the same handle is its own).
    std::map<std::pair<MemberId, std::array<uint8_t, proto::kCudaIpcHandleBytes>>, std::weak_ptr<Mapping>> legacy_;
    struct PendingUnregister {
        MemberId member;
        uint64_t reg;
        std::weak_ptr<Mapping> mapping;
    };
    std::vector<PendingUnregister> pending_unregister_;
    std::vector<std::pair<MemberId, uint64_t>> unregistered_;
    std::vector<std::unique_ptr<Client>> abandoned_;  // streams that would not drain: never freed
    uint64_t next_reg_ = 1;
    uint64_t use_clock_ = 0;  // LRU order of mappings
    struct Stats {
        uint64_t opens = 0, closes = 0, mapped_bytes = 0, registrations = 0, evictions = 0;
        uint64_t ops_staged = 0, stage_timeouts = 0;
        uint64_t staged_in_bytes = 0, staged_out_bytes = 0;  // copied device->host, host->device (queued)
    } stats_;
};

}  // namespace ringd
