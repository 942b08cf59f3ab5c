// The client's state, shared by the library's sources (client.cpp: connection, slot queues,
// tickets; client_cuda.cpp: device buffers). Not part of the ABI.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/fd_io.h"
#include "common/shm_mapping.h"
#include "proto/frame.h"
#include "proto/slot.h"
#include "ringd/ringd.h"

using namespace ringd;

namespace ringd_client_detail {

constexpr auto kConnectTimeout = std::chrono::seconds(10);
// A wait looks at the completion queue again, yielding the core between looks, this long
// before it blocks on the eventfd: a result within it costs no wake-up.
constexpr auto kSpin = std::chrono::microseconds(100);
// After a wait that looked in vain (ops take longer than that: several hosts, big buffers; or a
// yield that lost the core for a time slice), this many waits block at once, leaving the core to
// the daemon and other trainers; then looking again is tried, so the client follows the op
// latency both ways.
constexpr int kSpinBackoff = 15;
// ringd ends every accepted op within timeouts.op of its submission plus a little: its
// end-to-end deadline, then up to 1 s of grace for the coordinator's decision and a 100 ms tick,
// then the bounded release of a ring op by the progress thread (docs/design.md, Failure
// contract). The client gives it timeouts.op + kWaitMargin from the op's submission, clearly
// longer than that, so that this deadline never fires on a daemon that keeps its contract: past
// it, the daemon broke the contract and the connection is declared dead (see breach()).
// RINGD_WAIT_MARGIN_MS overrides the margin at connect, never below kMinWaitMargin.
constexpr auto kWaitMargin = std::chrono::milliseconds(10000);
constexpr auto kMinWaitMargin = std::chrono::milliseconds(2000);

enum class TicketState : uint8_t { Free, InFlight, Done, Abandoned };

struct Ticket {
    uint64_t seq = 0;
    TicketState state = TicketState::Free;
    int32_t status = 0;
    std::string message;
    Clock::time_point submitted;  // the contract's deadline counts from here, not from a wait
    bool held = false;  // still in the client, behind a device op's parts (no contract yet)
    bool cuda = false;  // a device-buffer op (client_cuda.cpp)
    uint64_t offset = 0, bytes = 0;  // its slot range (device ops: where they are staged)
    // A device op cut into parts (ringd ops of consecutive seqs, pipelined through ringd): the
    // caller's ticket is the last part's; the other parts have no ticket (client_cuda.cpp routes
    // their completions here). The op is done when all have ended; the first failure among them
    // is its error.
    uint64_t parts_left = 0;   // its other parts not ended yet (published or not)
    bool own_done = false;     // its own completion came (status/message hold it)
    int32_t part_status = 0;   // a part's failure
    std::string part_message;
};

// Device buffers (client_cuda.cpp): registrations, the staging ranges of device ops in the slot,
// the sync words.
struct CudaClient;
struct CudaClientDelete {
    void operator()(CudaClient *c) const;
};

}  // namespace ringd_client_detail
using namespace ringd_client_detail;

// The connection died: every device op's done word is released (client_cuda.cpp).
void cuda_client_dead(ringd_client &c);

struct ringd_client {
    // Held by every entry point: the library's own thread (client_cuda.cpp's watcher, which hands
    // the later parts of a large device op to ringd while the caller is elsewhere) takes it too.
    // Callers still use a client from one thread at a time (ringd.h).
    std::recursive_mutex mu;
    UniqueFd sock;
    UniqueFd doorbell;
    UniqueFd completion;
    UniqueFd pollable;  // ringd_fd(): epoll over the completion eventfd and the socket, made on first use
    std::shared_ptr<SharedMapping> map;       // the slot's memfd: header, queues (and data area when its own)
    std::shared_ptr<SharedMapping> data_map;  // the mapping that holds `data` (map, or a shared one's)
    proto::Welcome welcome;
    proto::SlotHeader *header = nullptr;
    proto::SubmitDesc *sq = nullptr;
    const proto::CompletionDesc *cq = nullptr;
    std::byte *data = nullptr;
    uint32_t ranks = 0;     // the group's ranks this client said (ringd_options.ranks; 0: not said)
    uint32_t wire = 0;      // ringd_set_wire: SubmitDesc::wire of ops that name none (0: ringd's default)
    uint32_t rank = 0;      // and its own (ringd_options.rank)
    uint64_t next_seq = 1;  // the next seq to give out (device ops' parts take theirs at submission)
    uint64_t sq_tail = 0;
    uint64_t cq_head = 0;
    std::vector<Ticket> tickets;  // index = seq % depth
    std::string last_error;
    int dead = 0;  // non-zero errno once the daemon connection is gone
    std::string dead_error;  // why: every later call says it again
    int spin_skip = 0;  // waits left that block without spinning
    std::chrono::milliseconds wait_margin = kWaitMargin;
    uint64_t cuda_part_bytes = 0;  // ringd_set_cuda_part_bytes (0: RINGD_CUDA_PART_BYTES or the default)
    uint64_t cuda_staging_offset = 0, cuda_staging_bytes = 0;  // ringd_set_cuda_staging (0 bytes: the whole slot)
    uint64_t staging_end() const { return cuda_staging_bytes ? cuda_staging_offset + cuda_staging_bytes : welcome.data_bytes; }
    // Last: goes first when the client closes (it releases sync words in the slot mapped above).
    std::unique_ptr<CudaClient, CudaClientDelete> cuda;

    int fail(int code, std::string msg) {
        last_error = std::move(msg);
        return code;
    }
    int die(int code, std::string msg) {
        if (cuda) cuda_client_dead(*this);  // streams waiting for its ops go on
        dead = code;
        dead_error = msg;
        return fail(code, std::move(msg));
    }
    int still_dead() { return fail(dead, dead_error); }
    // When ringd owes the ticket's completion at the latest.
    Clock::time_point contract_deadline(const Ticket &t) const {
        if (t.held) return Clock::time_point::max();  // ringd owes nothing for an op it has not got
        return t.submitted + std::chrono::milliseconds(welcome.op_timeout_ms) + wait_margin;
    }
    void drain_completions();
    // 0 when the next `n` ops can be queued now (their tickets free, room in the queue), else the
    // error.
    int check_room(uint64_t n = 1);
    // A ticket whose op ended (and whose parts did): Done, or Free if it was given up.
    void settle(Ticket &t);
    // Queues a descriptor built by an entry point (validated here again); its ticket in *ticket.
    int submit_desc(proto::SubmitDesc &d, uint64_t *ticket, bool cuda_op);
    // Queues `d` (validated, or a refusal: no range) as the next seq over slot bytes [from, +bytes).
    int enqueue(proto::SubmitDesc &d, uint64_t *ticket, bool cuda_op, uint64_t from, uint64_t bytes);
    // Writes `n` descriptors (their tickets set up, room in the queue checked) into the
    // submission queue, publishes them at once and rings the doorbell.
    void publish(const proto::SubmitDesc *descs, uint64_t n);
    // Room for `n` more descriptors in the submission queue now.
    bool queue_room(uint64_t n) const;
    int check_socket();
    int breach(const Ticket &t);
    int wait(Ticket &t, int timeout_ms);
    int test(Ticket &t);
    int finish(Ticket &t) {
        t.state = TicketState::Free;
        if (t.status != 0) return fail(t.status, t.message);
        last_error.clear();
        return 0;
    }
};

// client_cuda.cpp's side of the slot queues.
// The completion of a part of a device op (not its last): taken here (its staging range freed,
// its result given to the op's ticket). False for any other seq.
bool cuda_part_ended(ringd_client &c, uint64_t seq, int32_t status, std::string &message);
// Hands ringd what is due: the next parts of large device ops whose staging ranges are free again,
// and the ops submitted after them, in seq order, as far as the queue has room.
void cuda_pump(ringd_client &c);
// Whether ops wait in the client behind a device op's parts (a new op then waits behind them).
bool cuda_backlog(const ringd_client &c);
// Queues the descriptor (ticket set up) behind them.
void cuda_hold(ringd_client &c, const proto::SubmitDesc &d);
// A device op's ticket ended (done or given up): its staging range is free again; a failed one's
// done word is written here, so that a stream waiting for it moves on.
void cuda_ticket_ended(ringd_client &c, uint64_t seq, int32_t status);
// Whether [offset, +bytes) overlaps the staging range of a device op in flight (the slot op that
// would is refused: ringd writes there).
bool cuda_staging_overlaps(const ringd_client &c, uint64_t offset, uint64_t bytes, uint64_t *seq);
// ringd_close, before the slot goes: words released, queued GPU work run out, allocations freed.
void cuda_client_closing(ringd_client &c);
