// libringd-client: the trainer's side of the slot protocol (proto/slot.h). No exception leaves
// this file: every entry point catches and turns failures into -errno + ringd_last_error().
#include "ringd/ringd.h"

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "client/lib/client_internal.h"
#include "common/status_client.h"

void ringd_client::drain_completions() {
    const uint64_t tail = header->cq_tail.value.load(std::memory_order_acquire);
    for (; cq_head != tail && tail - cq_head <= welcome.cq_depth; ++cq_head) {
        const proto::CompletionDesc &c = cq[cq_head % welcome.cq_depth];
        std::string message(c.message, std::min<size_t>(c.message_len, proto::kCompletionMessageBytes));
        if (cuda && cuda_part_ended(*this, c.seq, c.status, message)) continue;
        Ticket &t = tickets[c.seq % tickets.size()];
        if (t.seq != c.seq || t.own_done || (t.state != TicketState::InFlight && t.state != TicketState::Abandoned))
            continue;
        t.status = c.status;
        t.message = std::move(message);
        t.own_done = true;
        if (t.parts_left == 0) settle(t);
    }
    header->cq_head.value.store(cq_head, std::memory_order_release);
    if (cuda && !dead) cuda_pump(*this);  // staging ranges freed above take the next parts
}

void ringd_client::settle(Ticket &t) {
    if (t.status == 0 && t.part_status != 0) {
        t.status = t.part_status;
        t.message = t.part_message;
    }
    if (t.cuda) cuda_ticket_ended(*this, t.seq, t.status);
    t.state = t.state == TicketState::Abandoned ? TicketState::Free : TicketState::Done;
}

// The socket is readable only when ringd sends an error or goes away.
int ringd_client::check_socket() {
    uint8_t hdr[proto::kFrameHeaderBytes];
    std::vector<UniqueFd> fds;
    const ssize_t n = ::recv(sock.get(), hdr, sizeof hdr, MSG_DONTWAIT | MSG_PEEK);
    if (n == -1 && (errno == EAGAIN || errno == EINTR)) return 0;
    std::string msg = "ringd closed the connection";
    int code = -ECONNRESET;
    if (n == static_cast<ssize_t>(sizeof hdr)) {
        auto h = proto::decode_frame_header(std::span(hdr, sizeof hdr), proto::kMaxDaemonPayload);
        if (h && h->type == proto::FrameType::Error) {
            std::vector<uint8_t> frame(sizeof hdr + h->length);
            if (recv_exact(sock.get(), frame.data(), frame.size(), Clock::now() + std::chrono::seconds(1), fds)) {
                auto e = proto::decode_error(std::span(frame).subspan(sizeof hdr));
                if (e) {
                    msg = "ringd: " + e->message;
                    code = e->code;
                }
            }
        }
    }
    return die(code, msg);
}

// `t` has no completion past contract_deadline(t). Its slot would stay taken and its wait would
// time out again and again: a client wedged without a word. Unless the socket says what happened
// (an error from ringd, or ringd gone), declare the connection dead with the reason.
int ringd_client::breach(const Ticket &t) {
    if (int rc = check_socket(); rc != 0) return rc;
    return die(-EPROTO, "ringd did not complete op " + std::to_string(t.seq) + " within its op timeout + margin (" +
                            std::to_string(welcome.op_timeout_ms) + " + " + std::to_string(wait_margin.count()) +
                            " ms after its submission); this connection is unusable, reconnect");
}

// Waits for `t` (InFlight or Done) until timeout_ms (< 0: until the contract's deadline). Never
// past contract_deadline(t): there, the connection is dead (breach()).
int ringd_client::wait(Ticket &t, int timeout_ms) {
    const auto start = Clock::now();
    const auto caller_end = timeout_ms < 0 ? Clock::time_point::max() : start + std::chrono::milliseconds(timeout_ms);
    // The wait ends at the caller's timeout or at the contract's deadline, whichever comes first.
    // The contract moves while the wait runs: a device op's parts each restart it as they go to
    // ringd, and an op held in the client behind them has none until it goes (both happen in the
    // drains below).
    auto deadline_now = [&] { return std::min(contract_deadline(t), caller_end); };
    const bool spin = spin_skip == 0;
    if (!spin) --spin_skip;
    const auto spin_until = spin ? std::min(start + kSpin, deadline_now()) : Clock::time_point{};
    bool blocked = false;
    for (;;) {
        // Once dead, only results that arrived before count (a late one is not trusted).
        if (!dead) drain_completions();
        if (t.state == TicketState::Done) {
            // A yield that gave the core away for a whole time slice (another thread of the
            // trainer computing on it) overshoots the window: in vain too, though it never blocked.
            if (spin) spin_skip = blocked || Clock::now() > spin_until + kSpin ? kSpinBackoff : 0;
            return finish(t);
        }
        if (dead) return still_dead();
        if (Clock::now() < spin_until) {
            ::sched_yield();  // whatever else is runnable goes first (docs/design.md, Threads)
            continue;
        }
        pollfd p[2] = {{completion.get(), POLLIN, 0}, {sock.get(), POLLIN, 0}};
        blocked = true;
        const auto deadline = deadline_now();
        const int r = ::poll(p, 2, ms_until(deadline));
        if (r < 0 && errno != EINTR) return fail(-errno, "poll: " + errno_string(errno));
        if (r == 0) {
            drain_completions();  // one that came at the deadline still counts
            if (t.state == TicketState::Done || Clock::now() < deadline_now()) continue;  // poll rounds down to ms
            if (contract_deadline(t) <= caller_end) return breach(t);
            return fail(-ETIMEDOUT, "op " + std::to_string(t.seq) + " did not complete within " +
                                        std::to_string(timeout_ms) + " ms");
        }
        if (p[0].revents & POLLIN) {
            uint64_t v;
            (void)!::read(completion.get(), &v, sizeof v);
        }
        if (p[1].revents) {
            drain_completions();  // results that arrived before an error still count
            if (t.state != TicketState::Done) {
                if (int rc = check_socket(); rc != 0) return rc;
            }
        }
    }
}

// One look, no waiting: whoever polls ringd_fd() calls this when it turns readable (or on its
// own deadline). The eventfd is reset before the queue is read, so a completion that lands after
// the read signals again.
int ringd_client::test(Ticket &t) {
    uint64_t v;
    (void)!::read(completion.get(), &v, sizeof v);
    if (!dead) drain_completions();
    // Other tickets' results that this look drained keep the fd readable until they are looked
    // at too: a loop that tests ticket by ticket never sleeps on a result that is already in.
    for (const Ticket &o : tickets)
        if (&o != &t && o.state == TicketState::Done) {
            const uint64_t one = 1;
            (void)!::write(completion.get(), &one, sizeof one);
            break;
        }
    if (t.state == TicketState::Done) return finish(t);
    if (dead) return still_dead();
    pollfd p{sock.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) > 0 && p.revents) {
        drain_completions();  // results that arrived before an error still count
        if (t.state == TicketState::Done) return finish(t);
        if (int rc = check_socket(); rc != 0) return rc;
    }
    if (Clock::now() >= contract_deadline(t)) return breach(t);
    return -EINPROGRESS;
}

extern "C" {

namespace {

ringd_client *connect_client(const char *socket_path, const char *group, int local_rank, int local_size,
                             size_t slot_bytes, const char *hosts, const ringd_client *share, char *err, size_t err_len,
                             uint32_t op_timeout_ms, int rank = 0, int ranks = 0) {
    auto report = [&](const std::string &m) -> ringd_client * {
        if (err && err_len) std::snprintf(err, err_len, "%s", m.c_str());
        return nullptr;
    };
    try {
        if (!socket_path || !group) return report("socket_path and group must not be NULL");
        if (hosts && std::strlen(hosts) > proto::kMaxHelloHostsBytes)
            return report("the hosts list is longer than " + std::to_string(proto::kMaxHelloHostsBytes) + " bytes");
        if (std::strlen(socket_path) >= sizeof(sockaddr_un::sun_path)) return report("socket path is too long");
        if (local_rank < 0 || local_size <= 0) return report("local_rank and local_size must be non-negative/positive");
        if (auto why = proto::check_group_name(group); !why.empty()) return report(why);
        if (ranks < 0 || static_cast<uint64_t>(ranks) > kMaxGroupRanks || (ranks > 0 && (rank < 0 || rank >= ranks)) ||
            (ranks == 0 && rank != 0) || (ranks > 0 && local_size > ranks))
            return report("rank " + std::to_string(rank) + " of " + std::to_string(ranks) + " ranks (local_size " +
                          std::to_string(local_size) + ") is not a rank of a group of 1 to " +
                          std::to_string(kMaxGroupRanks) + " (ranks 0: not said)");
        auto margin = kWaitMargin;
        if (const char *v = std::getenv("RINGD_WAIT_MARGIN_MS"); v && *v) {
            uint32_t ms = 0;
            const char *end = v + std::strlen(v);
            const auto [p, ec] = std::from_chars(v, end, ms);
            if (ec != std::errc{} || p != end)
                return report(std::string("RINGD_WAIT_MARGIN_MS=") + v + " is not a number of milliseconds");
            margin = std::max<std::chrono::milliseconds>(std::chrono::milliseconds(ms), kMinWaitMargin);
        }
        auto c = std::make_unique<ringd_client>();
        c->sock = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (!c->sock) return report("socket: " + errno_string(errno));
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strcpy(addr.sun_path, socket_path);
        if (::connect(c->sock.get(), reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0)
            return report(std::string("cannot connect to ringd at ") + socket_path + ": " + errno_string(errno) +
                          " (is ringd running?)");
        // Only what connect set and nothing changes after (another thread may be using `share`).
        if (share && !share->data_map) return report("share_slot_of: that client has no slot");
        proto::Hello hello{group, static_cast<uint32_t>(local_rank), static_cast<uint32_t>(local_size),
                           share ? share->welcome.data_bytes : slot_bytes, hosts ? hosts : "",
                           share ? share->welcome.client_id : 0, op_timeout_ms, static_cast<uint32_t>(rank),
                           static_cast<uint32_t>(ranks)};
        // ringd refuses a connection (allow_uids/allow_gids, too many connections) with an error
        // frame and closes at once, so the hello may meet a closed socket (EPIPE) while the
        // reason waits unread: read the reply before reporting the failed send.
        const Status sent = send_all(c->sock.get(), proto::encode_hello(hello));

        const auto deadline = Clock::now() + kConnectTimeout;
        std::vector<UniqueFd> fds;
        uint8_t hdr[proto::kFrameHeaderBytes];
        if (auto s = recv_exact(c->sock.get(), hdr, sizeof hdr, deadline, fds); !s)
            return report(sent ? s.error().message : sent.error().message);
        auto h = proto::decode_frame_header(std::span(hdr, sizeof hdr), proto::kMaxDaemonPayload);
        if (!h) return report("bad reply from ringd: " + h.error().message);
        std::vector<uint8_t> payload(h->length);
        if (auto s = recv_exact(c->sock.get(), payload.data(), payload.size(), deadline, fds); !s)
            return report(s.error().message);
        if (h->type == proto::FrameType::Error) {
            auto e = proto::decode_error(payload);
            return report(e ? "ringd refused: " + e->message : "bad error frame from ringd: " + e.error().message);
        }
        if (h->type != proto::FrameType::Welcome) return report("unexpected reply from ringd");
        auto w = proto::decode_welcome(payload);
        if (!w) return report("bad welcome from ringd: " + w.error().message);
        if (fds.size() != proto::kWelcomeFds) return report("ringd passed " + std::to_string(fds.size()) + " fds, expected 3");
        c->welcome = *w;
        struct stat st{};
        if (::fstat(fds[0].get(), &st) != 0 || static_cast<uint64_t>(st.st_size) != w->map_bytes)
            return report("slot memfd does not have the announced size");
        auto m = SharedMapping::map(fds[0].get(), w->map_bytes);
        if (!m) return report(m.error().message);
        c->map = std::make_shared<SharedMapping>(std::move(*m));
        c->doorbell = std::move(fds[1]);
        c->completion = std::move(fds[2]);
        // A shared slot's memfd has the header and queues only; its data area is `share`'s.
        auto geo = proto::slot_geometry(share ? proto::kSlotDataAlign : w->data_bytes, w->sq_depth, w->cq_depth);
        c->header = reinterpret_cast<proto::SlotHeader *>(c->map->data());
        c->ranks = static_cast<uint32_t>(ranks);
        c->rank = static_cast<uint32_t>(rank);
        if (!geo || geo->data_offset != w->data_offset || c->header->magic != proto::kSlotMagic ||
            c->header->version != proto::kSlotVersion ||
            (share && (w->map_bytes != geo->data_offset || w->data_bytes != 0)))
            return report("slot layout does not match this library (version skew?)");
        if (share) c->welcome.data_bytes = share->welcome.data_bytes;
        c->sq = reinterpret_cast<proto::SubmitDesc *>(c->map->data() + geo->sq_offset);
        c->cq = reinterpret_cast<const proto::CompletionDesc *>(c->map->data() + geo->cq_offset);
        c->data_map = share ? share->data_map : c->map;
        c->data = share ? share->data : c->map->data() + geo->data_offset;
        c->tickets.resize(std::min(w->sq_depth, w->cq_depth));
        c->wait_margin = margin;
        return c.release();
    } catch (const std::exception &e) {
        return report(std::string("ringd_connect: ") + e.what());
    }
}

}  // namespace

ringd_client *ringd_connect(const char *socket_path, const char *group, int local_rank, int local_size,
                            size_t slot_bytes, char *err, size_t err_len) {
    return connect_client(socket_path, group, local_rank, local_size, slot_bytes, nullptr, nullptr, err, err_len, 0);
}

ringd_client *ringd_connect_opts(const ringd_options *opts, char *err, size_t err_len) {
    auto report = [&](const char *m) -> ringd_client * {  // allocates nothing: nothing to throw
        if (err && err_len) std::snprintf(err, err_len, "%s", m);
        return nullptr;
    };
    if (!opts) return report("ringd_connect_opts: opts must not be NULL");
    // Fields past what the caller's struct holds are taken as unset.
    constexpr size_t kFirstVersion = offsetof(ringd_options, hosts) + sizeof(const char *);
    if (opts->struct_size < kFirstVersion) {
        char m[160];
        std::snprintf(m, sizeof m, "ringd_connect_opts: struct_size %zu is smaller than the first ringd_options (%zu); "
                                   "set it to sizeof(ringd_options)", opts->struct_size, kFirstVersion);
        return report(m);
    }
    const char *socket_path = opts->socket_path;
    if (!socket_path) {
        const char *env = std::getenv("RINGD_SOCKET");
        socket_path = env && *env ? env : "/run/ringd/ringd.sock";
    }
    // share_slot_of came after the first version.
    const ringd_client *share = opts->struct_size >= offsetof(ringd_options, share_slot_of) + sizeof(opts->share_slot_of)
                                    ? opts->share_slot_of
                                    : nullptr;
    // op_timeout_ms came after share_slot_of.
    const uint32_t op_timeout_ms =
        opts->struct_size >= offsetof(ringd_options, op_timeout_ms) + sizeof(opts->op_timeout_ms) ? opts->op_timeout_ms : 0;
    // rank and ranks came after op_timeout_ms.
    const bool ranked = opts->struct_size >= offsetof(ringd_options, ranks) + sizeof(opts->ranks);
    return connect_client(socket_path, opts->group, opts->local_rank, opts->local_size, opts->slot_bytes,
                          opts->hosts && *opts->hosts ? opts->hosts : nullptr, share, err, err_len, op_timeout_ms,
                          ranked ? opts->rank : 0, ranked ? opts->ranks : 0);
}

void *ringd_slot(ringd_client *c, size_t *bytes) {
    if (!c) {
        if (bytes) *bytes = 0;
        return nullptr;
    }
    if (bytes) *bytes = c->welcome.data_bytes;
    return c->data;
}

int ringd_client::check_room(uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) {
        const Ticket &t = tickets[(next_seq + i) % tickets.size()];
        if (t.state != TicketState::Free) {
            // A Done ticket waits for its caller; one still without its completion past the
            // contract would hold its slot for ever.
            if (t.state != TicketState::Done && Clock::now() >= contract_deadline(t)) return breach(t);
            return fail(-EAGAIN, "too many ops in flight: wait for ticket " + std::to_string(t.seq) + " first");
        }
    }
    // Ops held behind a device op's parts go to the queue as it drains.
    if (!(cuda && cuda_backlog(*this)) && !queue_room(n)) return fail(-EAGAIN, "submission queue is full");
    return 0;
}

bool ringd_client::queue_room(uint64_t n) const {
    // Room in the submission queue, and for every op handed over (each gets one completion) in the
    // completion queue until this client reads it: ringd drops a client whose completions it has
    // no room for. (Tickets bound ops with one; a device op's parts have none.)
    return sq_tail + n - header->sq_head.value.load(std::memory_order_acquire) <= welcome.sq_depth &&
           sq_tail + n - cq_head <= welcome.cq_depth;
}

int ringd_client::submit_desc(proto::SubmitDesc &d, uint64_t *ticket, bool cuda_op) {
    d.seq = next_seq;
    if (d.wire == 0) d.wire = wire;  // (this client's default: only where it applies)
    if ((d.wire != 0 || (d.flags & proto::kSubmitFeedback)) && !(header->features & proto::kSlotFeatureWire))
        return fail(-ENOTSUP, "this ringd has no compressed wires (an older release)");
    // The daemon validates again; checking here gives the caller the error without a round trip.
    auto s = proto::validate_submit(d, welcome.data_bytes, true);
    if (!s) return fail(s.error().code, s.error().message);
    if (auto t = proto::take_splits(*s, data, welcome.data_bytes, data != nullptr); !t)
        return fail(t.error().code, t.error().message);
    drain_completions();
    // The slot bytes the op uses: its input and output (apart or one inside the other).
    const uint64_t from = std::min(s->offset, s->out_offset);
    const uint64_t bytes = std::max(s->offset + s->bytes, s->out_offset + s->out_bytes) - from;
    if (uint64_t busy = 0; !cuda_op && cuda && cuda_staging_overlaps(*this, from, bytes, &busy))
        return fail(-EBUSY, "slot bytes [" + std::to_string(from) + ", +" + std::to_string(bytes) +
                                ") are the staging area of device op " + std::to_string(busy) +
                                " in flight: wait for it or use other bytes");
    return enqueue(d, ticket, cuda_op, from, bytes);
}

int ringd_client::enqueue(proto::SubmitDesc &d, uint64_t *ticket, bool cuda_op, uint64_t from, uint64_t bytes) {
    d.seq = next_seq;
    if (int rc = check_room(); rc != 0) return rc;
    Ticket &t = tickets[d.seq % tickets.size()];
    t = Ticket{};
    t.seq = d.seq;
    t.state = TicketState::InFlight;
    t.submitted = Clock::now();
    t.cuda = cuda_op;
    t.offset = from;
    t.bytes = bytes;
    ++next_seq;
    if (cuda && cuda_backlog(*this)) {  // behind a device op's parts still to go
        t.held = true;
        cuda_hold(*this, d);
    } else {
        publish(&d, 1);
    }
    if (ticket) *ticket = d.seq;
    last_error.clear();
    return 0;
}

void ringd_client::publish(const proto::SubmitDesc *descs, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) std::memcpy(&sq[(sq_tail + i) % welcome.sq_depth], &descs[i], sizeof descs[i]);
    sq_tail += n;
    header->sq_tail.value.store(sq_tail, std::memory_order_release);
    // ringd takes the whole queue at each ring; a failed write (an eventfd at its limit) still
    // leaves the descriptors for the next ring or ringd's next look.
    const uint64_t one = 1;
    (void)!::write(doorbell.get(), &one, sizeof one);
}

int ringd_submit(ringd_client *c, size_t offset, size_t count, ringd_dtype dtype, ringd_op op, uint64_t *ticket) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        if (c->dead) return c->still_dead();
        proto::SubmitDesc d{};
        d.count = count;
        d.dtype = static_cast<uint32_t>(dtype);
        d.op = static_cast<uint32_t>(op);
        d.buffer_kind = static_cast<uint32_t>(proto::BufferKind::Slot);
        d.offset = offset;
        return c->submit_desc(d, ticket, false);
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

int ringd_set_wire(ringd_client *c, ringd_wire wire) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    if (c->dead) return c->still_dead();
    if (wire < RINGD_WIRE_DEFAULT || wire > RINGD_WIRE_INT8)
        return c->fail(-EINVAL, "ringd_set_wire: " + std::to_string(static_cast<int>(wire)) + " is not a ringd_wire");
    if (wire != RINGD_WIRE_DEFAULT && !(c->header->features & proto::kSlotFeatureWire))
        return c->fail(-ENOTSUP, "this ringd has no compressed wires (an older release)");
    c->wire = static_cast<uint32_t>(wire);
    return 0;
}

void ringd_note_copies(ringd_client *c, uint64_t in_bytes, uint64_t out_bytes) {
    if (!c || !c->header || !(c->header->features & proto::kSlotFeatureCopyCounters)) return;
    c->header->copied_in.fetch_add(in_bytes, std::memory_order_relaxed);
    c->header->copied_out.fetch_add(out_bytes, std::memory_order_relaxed);
}

unsigned int ringd_collectives(void) {
    return 1u << RINGD_ALLREDUCE | 1u << RINGD_REDUCE_SCATTER | 1u << RINGD_ALLGATHER | 1u << RINGD_BROADCAST |
           1u << RINGD_REDUCE | 1u << RINGD_BARRIER | 1u << RINGD_ALL_TO_ALL;
}

int ringd_submit_coll(ringd_client *c, const ringd_coll *coll, uint64_t *ticket) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        if (c->dead) return c->still_dead();
        constexpr size_t kFirstVersion = offsetof(ringd_coll, out_offset) + sizeof(size_t);
        if (!coll || coll->struct_size < kFirstVersion)
            return c->fail(-EINVAL, "ringd_submit_coll: coll must be a ringd_coll with struct_size = sizeof(ringd_coll)");
        proto::SubmitDesc d{};
        d.collective = static_cast<uint32_t>(coll->collective);
        d.count = coll->count;
        d.dtype = static_cast<uint32_t>(coll->dtype);
        d.op = static_cast<uint32_t>(coll->op);
        d.buffer_kind = static_cast<uint32_t>(proto::BufferKind::Slot);
        d.offset = coll->in_offset;
        if (coll->collective != RINGD_ALLREDUCE) {
            const std::string what(d.collective < kCollectiveCount ? collective_name(static_cast<Collective>(d.collective))
                                                                   : std::string_view("collective"));
            if (!(c->header->features & proto::kSlotFeatureCollectives))
                return c->fail(-ENOTSUP, "this ringd runs allreduce only (an older release): no " + what);
            if (c->ranks == 0)
                return c->fail(-EINVAL, "a " + what + " needs this trainer's rank in its group: connect with "
                                        "ringd_options.rank and .ranks");
            d.ranks = c->ranks;
            d.out_offset = coll->out_offset;
        }
        if (coll->struct_size >= offsetof(ringd_coll, feedback_tag) + sizeof(uint64_t)) {
            if (coll->wire < RINGD_WIRE_DEFAULT || coll->wire > RINGD_WIRE_INT8)
                return c->fail(-EINVAL, "ringd_coll.wire " + std::to_string(static_cast<int>(coll->wire)) + " is not a ringd_wire");
            if (coll->wire != RINGD_WIRE_DEFAULT) d.wire = static_cast<uint32_t>(coll->wire) | proto::kWireRequired;
            if (coll->feedback) {
                d.flags |= proto::kSubmitFeedback;
                d.feedback_tag = coll->feedback_tag;
            }
        }
        if (coll->collective == RINGD_ALL_TO_ALL) {
            if (!(c->header->features & proto::kSlotFeatureAllToAll))
                return c->fail(-ENOTSUP, "this ringd has no all_to_all (an older release)");
            const bool has_fields = coll->struct_size >= offsetof(ringd_coll, splits_offset) + sizeof(size_t);
            if (has_fields && (coll->send_counts != nullptr) != (coll->recv_counts != nullptr))
                return c->fail(-EINVAL, "an all_to_all needs both send_counts and recv_counts, or neither");
            if (has_fields && coll->send_counts) {
                // The tables into the slot, where ringd takes them (checked as it will check them).
                const uint64_t n = c->ranks, at = coll->splits_offset;
                if (coll->count != 0) return c->fail(-EINVAL, "an all_to_all with split sizes has count 0");
                if (at % 8 != 0 || at > c->welcome.data_bytes || c->welcome.data_bytes - at < 16 * n)
                    return c->fail(-ERANGE, "all_to_all split sizes at " + std::to_string(at) + " (" + std::to_string(16 * n) +
                                                " bytes) do not lie 8-aligned in the " +
                                                std::to_string(c->welcome.data_bytes) + "-byte slot");
                std::memcpy(c->data + at, coll->send_counts, 8 * n);
                std::memcpy(c->data + at + 8 * n, coll->recv_counts, 8 * n);
                d.flags = proto::kSubmitSplits;
                d.splits_offset = at;
            }
        }
        const bool rooted = coll->collective == RINGD_BROADCAST || coll->collective == RINGD_REDUCE;
        if (rooted || coll->collective == RINGD_BARRIER) {
            const std::string what(collective_name(static_cast<Collective>(d.collective)));
            if (!(c->header->features & proto::kSlotFeatureRootedCollectives))
                return c->fail(-ENOTSUP, "this ringd has no " + what + " (an older release)");
            if (rooted && coll->struct_size < offsetof(ringd_coll, root) + sizeof(int))
                return c->fail(-EINVAL, "a " + what + " needs ringd_coll.root: struct_size = sizeof(ringd_coll)");
            if (rooted && (coll->root < 0 || static_cast<uint32_t>(coll->root) >= c->ranks))
                return c->fail(-EINVAL, "a " + what + " with root rank " + std::to_string(coll->root) + " of " +
                                        std::to_string(c->ranks) + " ranks");
            d.root = rooted ? static_cast<uint32_t>(coll->root) : 0;
            d.out_offset = rooted ? d.offset : 0;  // (in place)
            if (!rooted) d.count = d.offset = 0;   // (a barrier has no data)
        }
        return c->submit_desc(d, ticket, false);
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

int ringd_refuse(ringd_client *c, ringd_collective collective, uint64_t needed_bytes, uint64_t *ticket) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    try {
        if (c->dead) return c->still_dead();
        if (!(c->header->features & proto::kSlotFeatureRefuse))
            return c->fail(-ENOTSUP, "this ringd takes no refusals (an older release)");
        if (collective < RINGD_ALLREDUCE || static_cast<uint32_t>(collective) >= kCollectiveCount)
            return c->fail(-EINVAL, "ringd_refuse: " + std::to_string(static_cast<int>(collective)) + " is not a ringd_collective");
        proto::SubmitDesc d{};
        d.collective = static_cast<uint32_t>(collective);
        d.count = needed_bytes;
        d.flags = proto::kSubmitRefused;
        c->drain_completions();
        return c->enqueue(d, ticket, false, 0, 0);
    } catch (const std::exception &e) {
        return c->fail(-ENOMEM, e.what());
    }
}

}  // extern "C"

namespace {

// ringd_wait and ringd_test: `look` waits for (or looks at) the ticket's op. A ticket that
// ringd_allreduce gave up on is still the caller's: waiting for it again is fine. It stays given
// up (freed when its completion arrives) unless this call consumes it.
template <class Look>
int on_ticket(ringd_client *c, uint64_t ticket, Look look) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    Ticket &t = c->tickets[ticket % c->tickets.size()];
    bool abandoned = false;
    int rc;
    try {
        if (ticket == 0 || t.seq != ticket || t.state == TicketState::Free)
            return c->dead ? c->still_dead()
                           : c->fail(-EINVAL, "ticket " + std::to_string(ticket) + " is not in flight");
        abandoned = t.state == TicketState::Abandoned;
        if (abandoned) t.state = TicketState::InFlight;
        rc = look(t);
    } catch (const std::exception &e) {
        rc = c->fail(-ENOMEM, e.what());
    }
    if (abandoned && t.state == TicketState::InFlight) t.state = TicketState::Abandoned;
    return rc;
}

}  // namespace

extern "C" {

int ringd_wait(ringd_client *c, uint64_t ticket, int timeout_ms) {
    return on_ticket(c, ticket, [&](Ticket &t) { return c->wait(t, timeout_ms); });
}

int ringd_test(ringd_client *c, uint64_t ticket) {
    return on_ticket(c, ticket, [&](Ticket &t) { return c->test(t); });
}

int ringd_fd(ringd_client *c) {
    if (!c) return -EINVAL;
    if (c->pollable) return c->pollable.get();
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    if (!ep) return c->fail(-errno, "epoll_create1: " + errno_string(errno));
    for (int fd : {c->completion.get(), c->sock.get()}) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = fd;
        if (::epoll_ctl(ep.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return c->fail(-errno, "epoll_ctl: " + errno_string(errno));
    }
    c->pollable = std::move(ep);
    return c->pollable.get();
}

int ringd_allreduce(ringd_client *c, size_t offset, size_t count, ringd_dtype dtype, ringd_op op, int timeout_ms) {
    if (!c) return -EINVAL;
    std::lock_guard lock(c->mu);
    uint64_t ticket = 0;
    if (int rc = ringd_submit(c, offset, count, dtype, op, &ticket); rc != 0) return rc;
    const int rc = ringd_wait(c, ticket, timeout_ms);
    if (rc == -ETIMEDOUT) {
        // The caller gets no ticket and may never wait for this op again: free its entry when the
        // result arrives, so that it holds no slot. A caller that counts tickets may still wait
        // for it (ringd_wait takes it back); one that never comes is a breach (breach()).
        Ticket &t = c->tickets[ticket % c->tickets.size()];
        if (t.seq == ticket && t.state == TicketState::InFlight) t.state = TicketState::Abandoned;
    }
    return rc;
}

long ringd_status(const char *socket_path, char *buf, size_t len, int timeout_ms) {
    try {
        const char *env = std::getenv("RINGD_SOCKET");
        const std::string path = socket_path ? socket_path : env && *env ? env : "/run/ringd/ringd.sock";
        auto s = fetch_status(path, timeout_ms < 0 ? 10000 : timeout_ms);
        const std::string &text = s ? *s : s.error().message;
        if (buf && len) std::snprintf(buf, len, "%s", text.c_str());
        return s ? static_cast<long>(text.size()) : s.error().code;
    } catch (const std::exception &e) {
        if (buf && len) std::snprintf(buf, len, "ringd_status: %s", e.what());
        return -ENOMEM;
    }
}

const char *ringd_last_error(const ringd_client *c) { return c ? c->last_error.c_str() : "no client"; }

void *ringd_slot_hold(ringd_client *c) {
    if (!c || !c->data_map) return nullptr;
    return new (std::nothrow) std::shared_ptr<SharedMapping>(c->data_map);
}

void ringd_slot_unhold(void *hold) { delete static_cast<std::shared_ptr<SharedMapping> *>(hold); }

void ringd_close(ringd_client *c) {
    if (!c) return;
    {
        std::lock_guard lock(c->mu);
        cuda_client_closing(*c);
    }
    delete c;
}

}  // extern "C"
