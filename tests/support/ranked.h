// Ranked groups for the tests of every collective but allreduce: trainers that say their rank in
// the group (ringd_options.rank, .ranks), and where each rank's input and output lie in a buffer
// (apart with guard bytes around each, or in place).
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "ringd/ringd.h"
#include "tests/support/cluster.h"

namespace ringd::test {

// One trainer of a ranked group: its client and slot.
struct Trainer {
    ClientPtr c{nullptr, ringd_close};
    std::byte *slot = nullptr;
    size_t bytes = 0;
    uint32_t rank = 0;
};

// The group's trainers: host h runs locals[h] of them, whose ranks are the next ones of `ranks`
// (the group's rank of each, in host order then local-rank order).
inline std::vector<Trainer> join_ranked(TestCluster &c, const std::string &group, const std::vector<uint32_t> &locals,
                                        const std::vector<uint32_t> &ranks, size_t slot_bytes, std::string *err = nullptr) {
    std::vector<Trainer> v;
    size_t next = 0;
    for (uint32_t h = 0; h < locals.size(); ++h)
        for (uint32_t l = 0; l < locals[h]; ++l) {
            ringd_options o{};
            o.struct_size = sizeof o;
            o.socket_path = c.d[h]->socket().c_str();
            o.group = group.c_str();
            o.local_rank = static_cast<int>(l);
            o.local_size = static_cast<int>(locals[h]);
            o.slot_bytes = slot_bytes;
            o.rank = static_cast<int>(ranks[next]);
            o.ranks = static_cast<int>(ranks.size());
            char e[512] = "";
            Trainer t;
            t.c = ClientPtr(ringd_connect_opts(&o, e, sizeof e), ringd_close);
            if (!t.c) {
                if (err) *err = e;
                else FAIL("host " << h << " local rank " << l << ": " << e);
                return {};
            }
            t.slot = static_cast<std::byte *>(ringd_slot(t.c.get(), &t.bytes));
            t.rank = ranks[next++];
            v.push_back(std::move(t));
        }
    return v;
}

// Where a rank's input and output lie in its slot: apart (each with guard bytes around it), or in
// place (the output the rank's block of the input, or the input its block of the output).
struct Placement {
    size_t in = 0, out = 0;
    size_t in_count = 0, out_count = 0;
    size_t span_begin = 0, span_end = 0;  // the bytes the op may write, guards outside them
};

inline Placement place(Collective coll, DType t, size_t count, uint32_t ranks, uint32_t rank, bool in_place, uint64_t seed) {
    const size_t es = dtype_size(t);
    Placement p;
    p.in_count = coll == Collective::ReduceScatter ? count * ranks : count;
    p.out_count = coll == Collective::Allgather ? count * ranks : count;
    const size_t base = bench::kGuardBytes + ((seed + rank * 7) % 64) * 8;
    if (!in_place) {
        p.in = base;
        p.out = (base + p.in_count * es + 2 * bench::kGuardBytes + 63) / 64 * 64;
        p.span_begin = p.in;
        p.span_end = p.out + p.out_count * es;
    } else if (coll == Collective::ReduceScatter) {
        p.in = base;
        p.out = base + size_t{rank} * count * es;
        p.span_begin = p.in;
        p.span_end = p.in + p.in_count * es;
    } else {
        p.out = base;
        p.in = base + size_t{rank} * count * es;
        p.span_begin = p.out;
        p.span_end = p.out + p.out_count * es;
    }
    return p;
}

struct Verdict {
    uint64_t wrong = 0, guard = 0, input_changed = 0;
    Verdict &operator+=(const Verdict &o) {
        wrong += o.wrong, guard += o.guard, input_changed += o.input_changed;
        return *this;
    }
};

// Rank `rank`'s buffer before a reduce_scatter or allgather placed at `p`: guard bytes around the
// ranges (and between them), then the input, bench::value(rank, i) over the whole input (a
// reduce_scatter's block b of it holds elements b*count.. of that).
inline void fill_ranked(std::byte *buf, const Placement &p, Collective coll, DType t, size_t count, uint32_t rank,
                        bool in_place, uint64_t seed) {
    bench::guard_fill(buf, p.span_begin - bench::kGuardBytes, p.span_end + bench::kGuardBytes, seed);
    const size_t n = coll == Collective::Allgather && in_place ? count : p.in_count;
    for (size_t i = 0; i < n; ++i) bench::store(buf + p.in, i, t, static_cast<double>(bench::value(rank, i)));
}

// The same buffer after the op: rank r's reduce_scatter output is the reduction of element
// r*count + i over every rank; an allgather's block b is rank b's input. Checked here from the
// inputs, with the guard bytes and (allgather, apart) the input left as it was.
inline Verdict check_ranked(const std::byte *buf, const Placement &p, Collective coll, DType t, ReduceOp op, size_t count,
                            uint32_t ranks, uint32_t rank, bool in_place, uint64_t seed) {
    Verdict v;
    const size_t es = dtype_size(t);
    const double tol = bench::tolerance(t, op);
    const std::byte *out = buf + p.out;
    for (size_t i = 0; i < p.out_count; ++i) {
        double want;
        if (coll == Collective::ReduceScatter) {
            want = bench::want(ranks, size_t{rank} * count + i, t, op);
        } else {
            want = bench::round_to(t, static_cast<double>(bench::value(i / std::max<size_t>(count, 1), i % std::max<size_t>(count, 1))));
        }
        const double got = bench::load(out, i, t);
        if (!(std::fabs(got - want) <= tol * std::fabs(want))) ++v.wrong;
    }
    v.guard += bench::guard_damage(buf, p.span_begin - bench::kGuardBytes, p.span_begin, seed) +
               bench::guard_damage(buf, p.span_end, p.span_end + bench::kGuardBytes, seed);
    if (!in_place) {
        // Between the ranges: untouched. An allgather's input is left as it was (a
        // reduce_scatter may leave partial sums in its input: ringd.h).
        v.guard += bench::guard_damage(buf, p.in + p.in_count * es, p.out, seed);
        if (coll == Collective::Allgather)
            for (size_t i = 0; i < count; ++i)
                if (bench::load(buf + p.in, i, t) != bench::round_to(t, static_cast<double>(bench::value(rank, i))))
                    ++v.input_changed;
    }
    return v;
}

// broadcast and reduce run in place: the buffer at `base` with guard bytes around it, holding
// bench::value(rank, i) before the op.
inline Placement place_rooted(DType t, size_t count, uint32_t rank, uint64_t seed) {
    Placement p;
    p.in = p.out = bench::kGuardBytes + ((seed + rank * 7) % 64) * 8;
    p.in_count = p.out_count = count;
    p.span_begin = p.in;
    p.span_end = p.in + count * dtype_size(t);
    return p;
}

// After a broadcast from `root` every rank's buffer is the root's input; after a reduce the root's
// is the reduction of every rank's (the others' may hold partial results: not checked). The guard
// bytes are intact on every rank.
inline Verdict check_rooted(const std::byte *buf, const Placement &p, Collective coll, DType t, ReduceOp op, size_t count,
                            uint32_t ranks, uint32_t rank, uint32_t root, uint64_t seed) {
    Verdict v;
    const double tol = bench::tolerance(t, op);
    if (coll == Collective::Broadcast || rank == root)
        for (size_t i = 0; i < count; ++i) {
            const double want = coll == Collective::Broadcast ? bench::round_to(t, static_cast<double>(bench::value(root, i)))
                                                              : bench::want(ranks, i, t, op);
            const double got = bench::load(buf + p.out, i, t);
            if (!(std::fabs(got - want) <= tol * std::fabs(want))) ++v.wrong;
        }
    v.guard += bench::guard_damage(buf, p.span_begin - bench::kGuardBytes, p.span_begin, seed) +
               bench::guard_damage(buf, p.span_end, p.span_end + bench::kGuardBytes, seed);
    return v;
}

}  // namespace ringd::test
