#include "daemon/engine/all_to_all_engine.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <spdlog/spdlog.h>

#include "common/fd_io.h"
#include "daemon/engine/op_wait.h"

namespace ringd {
namespace {

// A way's first message: its flags word, then the counts.
uint64_t header_bytes(size_t from, size_t to) { return 8 + 8 * uint64_t{from} * to; }
constexpr uint64_t kByReference = 1;  // flags: the blocks go by reference; answer with the done message

// Pieces of a block list; UINT64_MAX when more than a way's tags can number.
uint64_t pieces_of(const std::vector<uint64_t> &bytes) {
    uint64_t n = 0;
    for (uint64_t b : bytes) n += (b + AllToAllEngine::kPieceBytes - 1) / AllToAllEngine::kPieceBytes;
    return n;
}

}  // namespace

uint64_t AllToAllEngine::staging_bytes(std::span<const std::vector<uint32_t>> host_ranks, uint32_t self) {
    const uint64_t mine = self < host_ranks.size() ? host_ranks[self].size() : 0;
    uint64_t headers = 0;
    for (size_t p = 0; p < host_ranks.size(); ++p)
        if (p != self && !host_ranks[p].empty() && mine) headers += header_bytes(mine, host_ranks[p].size());
    return 2 * headers + kPieceBytes;
}

Status AllToAllEngine::post_pieces(const AllToAllOp &op, Way &w, bool send) {
    while (w.posted - w.done < kWindow && w.block < w.blocks.size()) {
        const Block &b = w.blocks[w.block];
        if (w.at == b.bytes) {
            ++w.block;
            w.at = 0;
            continue;
        }
        const uint64_t n = std::min(kPieceBytes, b.bytes - w.at);
        const uint64_t tag = (uint64_t{op.op_tag} << 32) | w.next_tag;
        // A dropped piece lands at the staging's drop area (after the counts).
        const bool drop = b.region == &op.staging;
        const uint64_t offset = drop ? b.offset : b.offset + w.at;
        Status s = !send ? w.link->post_recv(*b.region, offset, n, tag)
                   : w.by_reference && !drop ? w.link->post_send_stable(*b.region, offset, n, tag)
                                             : w.link->post_send(*b.region, offset, n, tag);
        if (!s) return s;
        w.at += n;
        ++w.next_tag;
        ++w.posted;
    }
    return Ok{};
}

Status AllToAllEngine::run(const AllToAllOp &op, std::chrono::steady_clock::time_point deadline, std::string *op_error) {
    const uint32_t hosts = static_cast<uint32_t>(op.host_ranks.size());
    const size_t es = dtype_size(op.dtype);
    const auto &mine = op.host_ranks[op.self];
    const size_t lm = mine.size();
    std::string mismatch;
    auto refuse = [&](uint32_t from, uint32_t to, const std::string &from_host, uint64_t sends, uint64_t expects) {
        if (!mismatch.empty()) return;
        mismatch = "all_to_all: rank " + std::to_string(from) + " (host " + from_host + ") sends rank " + std::to_string(to) +
                   " " + std::to_string(sends) + " elements, and rank " + std::to_string(to) + " (host " + std::string(op.self_name) +
                   ") expects " + std::to_string(expects);
    };
    if (op.layouts.size() != lm || op.regions.size() != lm || op.in_offsets.size() != lm || op.out_offsets.size() != lm)
        return make_error(-EINVAL, "all_to_all: the op's local ranks and the rank map differ");
    if (staging_bytes(op.host_ranks, op.self) > op.staging.bytes)
        return make_error(-ENOBUFS, "all_to_all: " + std::to_string(staging_bytes(op.host_ranks, op.self)) +
                                        " bytes of staging needed, the lane has " + std::to_string(op.staging.bytes));
    // The staging: each peer's counts out, then in, then the drop area.
    out_.assign(hosts, Way{});
    in_.assign(hosts, Way{});
    std::vector<uint64_t> in_at(hosts, 0);
    uint64_t at = 0;
    const uint64_t in_base = (staging_bytes(op.host_ranks, op.self) - kPieceBytes) / 2, drop_at = 2 * in_base;
    std::vector<uint32_t> peers;
    for (uint32_t p = 0; p < hosts; ++p) {
        const auto &theirs = op.host_ranks[p];
        if (p == op.self || theirs.empty() || lm == 0) continue;
        Link *link = op.links.size() > p ? op.links[p] : nullptr;
        if (!link) return make_error(-ENOTCONN, "all_to_all: no data link to the host at ring position " + std::to_string(p));
        peers.push_back(p);
        Way &o = out_[p];
        Way &i = in_[p];
        o.link = i.link = link;
        // Flags and counts out (the peer checks them against its ranks'), and the blocks in order.
        auto *flags = reinterpret_cast<uint64_t *>(op.staging.base + at);
        uint64_t *counts = flags + 1;
        std::vector<uint64_t> sizes;
        for (size_t a = 0; a < lm; ++a)
            for (size_t b = 0; b < theirs.size(); ++b) {
                const uint64_t k = op.layouts[a].send_count(theirs[b]);
                counts[a * theirs.size() + b] = k;  // (little-endian hosts: proto/le.h)
                o.blocks.push_back({&op.regions[a], op.in_offsets[a] + op.layouts[a].send_at(theirs[b]) * es, k * es});
                sizes.push_back(k * es);
            }
        const uint64_t pieces = pieces_of(sizes);
        if (pieces >= kDone - 1) return make_error(-E2BIG, "all_to_all: too many pieces to one host");
        o.total = static_cast<uint32_t>(pieces);
        // By reference (TCP: the slot's pages into the socket, one copy fewer) where the blocks
        // to the peer are large; the peer then says when it has read them all, and until then the
        // op holds the trainers' slots. Smaller ones are copied into the socket, so that the op
        // ends once its own messages are in and the next op's start without waiting on the peer.
        const uint64_t bytes = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
        o.by_reference = !link->delivered_at_send_done() && bytes >= kByReferenceBytes;
        *flags = o.by_reference ? kByReference : 0;
        const uint64_t tag0 = uint64_t{op.op_tag} << 32;
        const uint64_t hb = header_bytes(lm, theirs.size());
        if (auto s = link->post_send(op.staging, at, hb, tag0); !s) return s;
        in_at[p] = in_base + at;
        at += hb;
        if (auto s = link->post_recv(op.staging, in_at[p], header_bytes(theirs.size(), lm), tag0); !s) return s;
        if (o.by_reference)
            if (auto s = link->post_recv(op.staging, drop_at, 0, tag0 | kDone); !s) return s;
        if (auto s = post_pieces(op, o, true); !s) return s;
    }
    // The local ranks' blocks to each other, a slice per turn while the network runs.
    struct Copy {
        std::byte *dst;
        const std::byte *src;
        uint64_t bytes;
    };
    std::vector<Copy> copies;
    for (size_t a = 0; a < lm; ++a)
        for (size_t b = 0; b < lm; ++b) {
            const uint64_t k = op.layouts[a].send_count(mine[b]);
            if (k != op.layouts[b].recv_count(mine[a])) {
                refuse(mine[a], mine[b], std::string(op.self_name), k, op.layouts[b].recv_count(mine[a]));
                continue;
            }
            if (k)
                copies.push_back({op.regions[b].base + op.out_offsets[b] + op.layouts[b].recv_at(mine[a]) * es,
                                  op.regions[a].base + op.in_offsets[a] + op.layouts[a].send_at(mine[b]) * es, k * es});
        }
    size_t copy = 0;
    uint64_t copied = 0;
    auto complete = [&] {
        if (copy < copies.size()) return false;
        for (uint32_t p : peers) {
            const Way &o = out_[p], &i = in_[p];
            if (!o.header_done || o.done < o.total || (o.by_reference && !o.marker_done)) return false;
            if (!i.header_done || !i.ready || i.done < i.total || (i.by_reference && !i.marker_done)) return false;
        }
        return true;
    };
    LinkPoll poll(spin_us_);
    for (;;) {
        if (copy < copies.size()) {
            const Copy &c = copies[copy];
            const uint64_t n = std::min<uint64_t>(c.bytes - copied, 1 << 20);
            std::memcpy(c.dst + copied, c.src + copied, n);
            if ((copied += n) == c.bytes) ++copy, copied = 0;
        }
        if (complete()) break;
        if (auto st = wait_turn(op); !st) return st;
        const int wait_ms = ms_until(deadline);
        if (wait_ms == 0) {
            std::string waiting;
            for (uint32_t p : peers) {
                const Way &o = out_[p], &i = in_[p];
                if (!i.header_done || i.done < i.total) waiting = "data from " + i.link->peer();
                else if (o.done < o.total || !o.header_done) waiting = "host " + o.link->peer() + " to take data";
                else if (o.by_reference && !o.marker_done) waiting = "host " + o.link->peer() + " to confirm it has the data";
                if (!waiting.empty()) break;
            }
            log_ways(op, "timed out");
            return make_error(-ETIMEDOUT, "all_to_all timed out: waiting for " + (waiting.empty() ? std::string("the links") : waiting));
        }
        if (auto st = poll.poll(t_, events_, wait_ms, copy < copies.size()); !st) return st;
        if (!events_.empty() && op.progress_ns) op.progress_ns->store(poll.last_progress_ns(), std::memory_order_relaxed);
        for (const LinkEvent &e : events_) {
            uint32_t p = hosts;
            for (uint32_t q : peers)
                if (out_[q].link == e.link) p = q;
            if (e.kind == LinkEvent::Kind::Failed) {
                if (p < hosts) return e.error;
                continue;
            }
            if (p == hosts || (e.tag >> 32) != op.op_tag) continue;  // not this op's
            const uint32_t number = static_cast<uint32_t>(e.tag);
            Way &o = out_[p], &i = in_[p];
            if (e.kind == LinkEvent::Kind::SendDone) {
                if (number == 0) {
                    o.header_done = true;
                } else if (number == kDone) {
                    i.marker_done = true;
                } else {
                    ++o.done;
                    if (auto s = post_pieces(op, o, true); !s) return s;
                }
                continue;
            }
            if (number == kDone) {
                o.marker_done = true;
                continue;
            }
            if (number == 0) {
                // The peer's counts: its ranks' (major) to this host's ranks.
                i.header_done = true;
                const auto &theirs = op.host_ranks[p];
                const auto *flags = reinterpret_cast<const uint64_t *>(op.staging.base + in_at[p]);
                const uint64_t *counts = flags + 1;
                if (*flags & ~kByReference)
                    return make_error(-EPROTO, "all_to_all: host " + i.link->peer() + " sent flags " + std::to_string(*flags));
                i.by_reference = *flags & kByReference;
                std::vector<uint64_t> sizes;
                bool drop = false;
                for (size_t a = 0; a < theirs.size(); ++a)
                    for (size_t b = 0; b < lm; ++b) {
                        const uint64_t k = counts[a * lm + b];
                        if (k > (uint64_t{1} << 48) / es)
                            return make_error(-EPROTO, "all_to_all: host " + i.link->peer() + " sent a count of " + std::to_string(k) +
                                                           " elements");
                        sizes.push_back(k * es);
                        if (k != op.layouts[b].recv_count(theirs[a])) {
                            refuse(theirs[a], mine[b], i.link->peer(), k, op.layouts[b].recv_count(theirs[a]));
                            drop = true;
                        }
                    }
                const uint64_t pieces = pieces_of(sizes);
                if (pieces >= kDone - 1)
                    return make_error(-EPROTO, "all_to_all: host " + i.link->peer() + " sends too many pieces");
                size_t k = 0;
                for (size_t a = 0; a < theirs.size(); ++a)
                    for (size_t b = 0; b < lm; ++b, ++k)
                        i.blocks.push_back(drop ? Block{&op.staging, drop_at, sizes[k]}
                                                : Block{&op.regions[b], op.out_offsets[b] + op.layouts[b].recv_at(theirs[a]) * es, sizes[k]});
                i.total = static_cast<uint32_t>(pieces);
                i.ready = true;
            } else {
                ++i.done;
            }
            if (auto s = post_pieces(op, i, false); !s) return s;
            if (i.by_reference && i.ready && i.done == i.total && i.posted == i.total && !i.marker_done && i.next_tag != kDone) {
                // Everything from the peer is in: its slot is read no more.
                if (auto s = i.link->post_send(op.staging, drop_at, 0, (uint64_t{op.op_tag} << 32) | kDone); !s) return s;
                i.next_tag = kDone;  // (sent)
            }
        }
    }
    if (!mismatch.empty() && op_error) *op_error = mismatch;
    return Ok{};
}

void AllToAllEngine::log_ways(const AllToAllOp &op, const std::string &stage) const {
    spdlog::warn("all_to_all op {:#x} {}:", op.op_tag, stage);
    for (size_t p = 0; p < out_.size(); ++p) {
        const Way &o = out_[p], &i = in_[p];
        if (!o.link) continue;
        spdlog::warn("  host {}: sent {}/{} pieces (counts {}, confirmed {}), received {}/{} (counts {}, confirmed {}); link: {}",
                     o.link->peer(), o.done, o.total, o.header_done, o.marker_done, i.done, i.total, i.header_done,
                     i.marker_done, o.link->describe());
    }
}

}  // namespace ringd
