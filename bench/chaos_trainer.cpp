// ringd-chaos-trainer: one rank of the job that bench/chaos runs while it injects faults.
//
// One process is one attempt of one rank (as under torchrun): connect (retrying until a deadline
// while this host's ringd is down), then run steps until an op fails or the stop file appears.
// A step is a few ops of mixed size (direct and ring paths), collective (allreduce,
// reduce_scatter, allgather, broadcast, reduce, barrier, all_to_all: the trainer says its rank,
// host-major), dtype and op, drawn from (seed, step) so that every rank of the job submits the
// same sequence; they are submitted together
// (in flight at once, like gradient buckets) and waited for. After the first error the trainer
// submits nothing more, waits for what is in flight and exits 1; the driver then restarts every
// rank of the job with the same group name.
//
// Every result is checked here, against values computed here (bench/bench_data.h), with guard
// bytes around every op's range; nothing of the check goes through ringd. Every op becomes one
// line on stdout for the driver to aggregate (times are CLOCK_MONOTONIC seconds, the clock the
// driver reads too):
//   op step=S idx=I bytes=B count=C dtype=D op=O coll=K submit=T end=T rc=RC wrong=W guard=G msg=TEXT
// (reduce_scatter and allgather run in place over count x ranks elements: bytes is that range's.)
//   step n=S start=T end=T          (every op of step S succeeded and was exact)
//   connected t=T tries=N | connect_failed t=T tries=N msg=TEXT | exit t=T code=C reason=TEXT
#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <time.h>

#include <CLI/CLI.hpp>

#include "bench/bench_data.h"
#include "bench/connect.h"
#include "common/fd_io.h"
#include "ringd/ringd.h"

using namespace ringd;

namespace {

struct Options {
    std::string socket, group = "chaos", stop_file;
    int host = 0, hosts = 1, local_rank = 0, local_size = 1;
    std::string group_hosts;
    uint64_t seed = 1;
    int op_timeout_ms = 10000;     // ringd's timeouts.op
    double connect_deadline_s = 30;
    int pause_ms = 20;             // "compute" between steps
    int ops_per_step = 4;
    std::string wire = "default";  // ringd_set_wire: the trainer's wire (docs/wire.md)
};

double now_s() {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The ops a step draws from: small ones take the direct (one-/two-shot) path, large ones (above
// tuning.direct_max_bytes, 256 KiB) the ring. Counts are odd or off a power of two on purpose.
struct OpSpec {
    size_t count;  // allreduce: the buffer's elements; reduce_scatter, allgather: one rank's block
    DType dtype;
    ReduceOp op;
    bool large;
    Collective coll = Collective::Allreduce;
    bool split = false;  // all_to_all with split sizes: a rank sends about 3/4 x count in all (split_of)
};

// An all_to_all's split sizes (the same on every rank): rank i sends rank j 0 to 1.5 x count / ranks
// elements (zeros among them), whatever the number of ranks.
uint64_t split_of(uint64_t i, uint64_t j, const OpSpec &s, uint64_t nranks) {
    return s.count / nranks * ((i * 7 + j * 3) % 4) / 2 + (i + j) % 3;
}
const std::array kSpecs{
    OpSpec{63, DType::F32, ReduceOp::Sum, false},
    OpSpec{1021, DType::I32, ReduceOp::Max, false},
    OpSpec{12289, DType::F16, ReduceOp::Avg, false},
    OpSpec{40000, DType::BF16, ReduceOp::Min, false},
    OpSpec{25601, DType::F64, ReduceOp::Avg, false},
    OpSpec{5, DType::I64, ReduceOp::Min, false},
    OpSpec{196613, DType::F32, ReduceOp::Avg, true},
    OpSpec{196608, DType::I64, ReduceOp::Sum, true},
    OpSpec{524291, DType::F32, ReduceOp::Max, true},
    OpSpec{786432, DType::F16, ReduceOp::Sum, true},
    OpSpec{300007, DType::BF16, ReduceOp::Avg, true},
    OpSpec{131101, DType::F64, ReduceOp::Min, true},
    // 32 MiB and more: over TCP the ring sends the slot by reference and ends with the delivery
    // marker (daemon/engine/ring_engine.h); the next step's inputs overwrite the slot at once.
    OpSpec{8388623, DType::F32, ReduceOp::Sum, true},
    // reduce_scatter and allgather, blocks of a rank: one-shot while the range (a block per rank)
    // is at most tuning.direct_max_bytes (the first three at 3 hosts x 2), else the ring; at 16
    // ranks (8 hosts x 2) every range together (67 MiB with the split all_to_alls below) stays
    // inside the 80 MiB slot bench/chaos gives.
    OpSpec{4099, DType::F32, ReduceOp::Sum, false, Collective::ReduceScatter},
    OpSpec{777, DType::BF16, ReduceOp::Avg, false, Collective::ReduceScatter},
    OpSpec{3001, DType::I32, ReduceOp::Max, false, Collective::Allgather},
    OpSpec{49157, DType::F32, ReduceOp::Avg, true, Collective::ReduceScatter},
    OpSpec{65537, DType::F16, ReduceOp::Sum, true, Collective::Allgather},
    OpSpec{65539, DType::F64, ReduceOp::Min, true, Collective::ReduceScatter},
    // broadcast and reduce (the root changes from step to step: InFlight::root), one-shot and the
    // chain; a barrier (no data).
    OpSpec{5003, DType::F32, ReduceOp::Sum, false, Collective::Broadcast},
    OpSpec{2049, DType::F64, ReduceOp::Avg, false, Collective::Reduce},
    OpSpec{0, DType::F32, ReduceOp::Sum, false, Collective::Barrier},
    OpSpec{300007, DType::BF16, ReduceOp::Sum, true, Collective::Broadcast},
    OpSpec{262147, DType::F32, ReduceOp::Max, true, Collective::Reduce},
    // all_to_all, equal blocks of a rank (its input, then its output, in one range).
    OpSpec{1031, DType::BF16, ReduceOp::Sum, false, Collective::AllToAll},
    OpSpec{40009, DType::I32, ReduceOp::Sum, true, Collective::AllToAll},
    // all_to_all with split sizes (mixture-of-experts): over the data links on TCP; the larger one
    // sends a host's blocks for another host by reference where they are a MiB or more (every pair
    // at 3 hosts x 2, some at 8 x 2), and the next step's inputs overwrite the slot at once.
    OpSpec{2003, DType::F16, ReduceOp::Sum, false, Collective::AllToAll, true},
    OpSpec{1200007, DType::F32, ReduceOp::Sum, true, Collective::AllToAll, true},
};

// Per spec: its range in the slot, its precomputed input for this rank and the exact result.
struct Prepared {
    OpSpec spec;
    size_t offset = 0;
    std::vector<unsigned char> input;
    std::vector<double> want;
    double tol = 0;
    double abs_tol = 0;  // a compressed wire's bound (bench::wire_tolerance)
    // all_to_all with split sizes: what this rank sends each rank and receives from each, and
    // where the input, the output and the sizes table (written by the library) lie in the range.
    std::vector<uint64_t> send, recv;
    size_t out_at = 0, out_end = 0, table_at = 0;  // elements into the range
};

struct InFlight {
    size_t spec = 0;
    uint64_t ticket = 0;
    bench::GuardedRange range;
    double submit = 0;
    bool done = false;
    uint32_t root = 0;  // broadcast, reduce
};

void print_op(int step, size_t idx, const Prepared &p, const InFlight &f, double end, int rc, uint64_t wrong,
              uint64_t guard, const std::string &msg) {
    std::string m = msg;
    std::replace(m.begin(), m.end(), '\n', ' ');
    std::printf("op step=%d idx=%zu bytes=%zu count=%zu dtype=%s op=%s coll=%s submit=%.6f end=%.6f rc=%d wrong=%llu "
                "guard=%llu msg=%s\n",
                step, idx, f.range.bytes(), p.spec.count, std::string(dtype_name(p.spec.dtype)).c_str(),
                std::string(reduce_op_name(p.spec.op)).c_str(), std::string(collective_name(p.spec.coll)).c_str(), f.submit,
                end, rc, static_cast<unsigned long long>(wrong), static_cast<unsigned long long>(guard), m.c_str());
}

bool exists(const std::string &path) {
    struct stat st{};
    return !path.empty() && ::stat(path.c_str(), &st) == 0;
}

int finish(int code, const std::string &reason) {
    std::printf("exit t=%.6f code=%d reason=%s\n", now_s(), code, reason.c_str());
    std::fflush(stdout);
    return code;
}

}  // namespace

int main(int argc, char **argv) {
    Options o;
    CLI::App app{"ringd-chaos-trainer: one rank of bench/chaos's job"};
    app.add_option("--socket", o.socket, "ringd's Unix socket")->required();
    app.add_option("--group", o.group, "group name")->capture_default_str();
    app.add_option("--host", o.host, "this host's index among the job's hosts (ring order)")->required();
    app.add_option("--hosts", o.hosts, "the job's hosts")->required();
    app.add_option("--group-hosts", o.group_hosts, "the group's hosts (names, comma-separated; default: every host)");
    app.add_option("--local-rank", o.local_rank, "this trainer's rank on the host")->required();
    app.add_option("--local-size", o.local_size, "trainers of the job on each host")->required();
    app.add_option("--seed", o.seed, "the job's op sequence")->capture_default_str();
    app.add_option("--op-timeout-ms", o.op_timeout_ms, "ringd's timeouts.op")->capture_default_str();
    app.add_option("--connect-deadline", o.connect_deadline_s, "seconds to keep retrying ringd_connect")->capture_default_str();
    app.add_option("--pause-ms", o.pause_ms, "pause between steps")->capture_default_str();
    app.add_option("--ops-per-step", o.ops_per_step, "ops per step (half small, half large)")->capture_default_str()
        ->check(CLI::Range(2, 12));
    app.add_option("--wire", o.wire, "default exact bf16 fp16 int8: this trainer's wire; results checked within its bound")
        ->capture_default_str();
    app.add_option("--stop-file", o.stop_file, "finish the current step and exit 0 once this exists");
    CLI11_PARSE(app, argc, argv);
    std::setvbuf(stdout, nullptr, _IOLBF, 0);

    const uint64_t nranks = static_cast<uint64_t>(o.hosts) * static_cast<uint64_t>(o.local_size);
    // The trainer's wire (--wire; "default": ringd's, whose sums are then checked exact).
    WireFormat wire = WireFormat::Exact;
    bool wire_given = false;
    if (o.wire != "default") {
        const auto w = parse_wire_format(o.wire);
        if (!w) return finish(2, "unknown wire " + o.wire);
        wire = *w;
        wire_given = true;
    }
    const uint64_t grank = static_cast<uint64_t>(o.host) * static_cast<uint64_t>(o.local_size) +
                           static_cast<uint64_t>(o.local_rank);

    // Ranges laid out one after the other with full guards between them; each rank's layout is
    // shifted by 64 bytes per local rank (ranks' offsets may differ).
    std::vector<Prepared> prep;
    size_t pos = bench::kGuardBytes + 64 * static_cast<size_t>(o.local_rank);
    for (const OpSpec &s : kSpecs) {
        Prepared p;
        p.spec = s;
        p.offset = pos;
        // reduce_scatter and allgather, in place: a range of a block per rank, filled with
        // value(rank, i) over the whole range; a reduce_scatter's result (this rank's block) is
        // the reduction of those elements over every rank, an allgather's block b is rank b's
        // own block, value(b, b x count + i).
        size_t elems = collective_blocked(s.coll) ? s.count * nranks
                       : s.coll == Collective::AllToAll ? 2 * s.count * nranks  // input, then output
                                                        : s.count;
        const size_t es = dtype_size(s.dtype);
        if (s.split) {
            // The input (this rank's blocks for each rank in rank order), the output (each rank's
            // block for this one), then the sizes table, 8-aligned, 2 x ranks uint64.
            uint64_t in = 0, out = 0;
            for (uint64_t r = 0; r < nranks; ++r) {
                p.send.push_back(split_of(grank, r, s, nranks));
                p.recv.push_back(split_of(r, grank, s, nranks));
                in += p.send.back();
                out += p.recv.back();
            }
            p.out_at = in;
            p.out_end = in + out;
            p.table_at = ((in + out) * es + 7) / 8 * 8 / es;
            elems = p.table_at + 16 * nranks / es;
        }
        const size_t bytes = elems * es;
        p.input.resize(bytes);
        bench::fill(p.input.data(), elems, s.dtype, grank);
        p.want.resize(elems);
        for (size_t i = 0; i < elems && s.split; ++i) p.want[i] = 0.0;  // (the output's below)
        for (uint64_t r = 0, at = p.out_at; r < nranks && s.split; ++r) {
            // Rank r's block for this rank: its input's elements from the sum of its blocks before.
            uint64_t before = 0;
            for (uint64_t j = 0; j < grank; ++j) before += split_of(r, j, s, nranks);
            for (uint64_t e = 0; e < p.recv[r]; ++e)
                p.want[at++] = bench::round_to(s.dtype, static_cast<double>(bench::value(r, before + e)));
        }
        for (size_t i = 0; i < elems && !s.split; ++i)
            p.want[i] = s.coll == Collective::Allgather
                            ? bench::round_to(s.dtype, static_cast<double>(bench::value(i / s.count, i)))
                        : s.coll == Collective::AllToAll
                            // output block b: rank b's block for this rank (the input half is not checked)
                            ? (i < s.count * nranks ? 0.0
                                                    : bench::round_to(s.dtype, static_cast<double>(bench::value(
                                                                                   (i - s.count * nranks) / s.count,
                                                                                   grank * s.count + i % s.count))))
                            : bench::want(nranks, i, s.dtype, s.op);
        p.tol = bench::tolerance(s.dtype, s.op);
        if (wire_given && wire_applies(s.coll, s.dtype, s.op))
            p.abs_tol = bench::wire_tolerance(wire, static_cast<uint64_t>(o.hosts), nranks, s.dtype, s.op);
        prep.push_back(std::move(p));
        pos = (pos + bytes + 2 * bench::kGuardBytes + 63) / 64 * 64;
    }
    const size_t slot_bytes = pos + bench::kGuardBytes;

    // Connect, retrying while this host's ringd is down or restarting.
    char err[512] = "";
    ringd_client *c = nullptr;
    const double t_start = now_s();
    int tries = 0;
    for (;;) {
        ++tries;
        c = bench::connect_group(o.socket, o.group, o.local_rank, o.local_size, slot_bytes, o.group_hosts, err, sizeof err,
                                 static_cast<int>(grank), static_cast<int>(nranks));
        if (c) break;
        if (now_s() - t_start > o.connect_deadline_s || exists(o.stop_file)) {
            std::printf("connect_failed t=%.6f tries=%d msg=%s\n", now_s(), tries, err);
            return finish(2, "connect");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // ringd is not there yet: nothing to wait on
    }
    std::printf("connected t=%.6f tries=%d\n", now_s(), tries);
    if (wire_given && ringd_set_wire(c, static_cast<ringd_wire>(static_cast<int>(wire) + 1)) != 0) {
        const std::string msg = ringd_last_error(c);
        ringd_close(c);
        return finish(2, "ringd_set_wire: " + msg);
    }
    size_t have = 0;
    auto *base = static_cast<unsigned char *>(ringd_slot(c, &have));
    if (!base || have < slot_bytes) {
        ringd_close(c);
        return finish(2, "slot of " + std::to_string(have) + " bytes, " + std::to_string(slot_bytes) + " asked");
    }

    // A trainer's own deadline per op: ringd owes an end within timeouts.op; past op + 10 s the op
    // is given up (reported as hung) and the trainer exits, as ringd_wait(-1) would.
    const double hard_deadline = o.op_timeout_ms / 1000.0 + 10.0;
    std::vector<size_t> small, large;
    for (size_t i = 0; i < kSpecs.size(); ++i) (kSpecs[i].large ? large : small).push_back(i);
    bool failed = false;
    std::string first_error;
    uint64_t steps = 0;
    for (int step = 0; !failed && !exists(o.stop_file); ++step) {
        // The same draw on every rank: a function of (seed, step) only.
        std::mt19937_64 rng(bench::mix64(o.seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(step)));
        std::shuffle(small.begin(), small.end(), rng);
        std::shuffle(large.begin(), large.end(), rng);
        std::vector<size_t> pick;
        for (int k = 0; k < o.ops_per_step; ++k)
            pick.push_back(k % 2 ? large[static_cast<size_t>(k / 2) % large.size()] : small[static_cast<size_t>(k / 2) % small.size()]);
        std::shuffle(pick.begin(), pick.end(), rng);

        std::vector<InFlight> fl;
        const double step_start = now_s();
        for (size_t k = 0; k < pick.size(); ++k) {
            const Prepared &p = prep[pick[k]];
            InFlight f;
            f.spec = pick[k];
            // Guards salted per rank, spec and step: stale bytes of another rank or step do not match.
            f.range = bench::GuardedRange{p.offset, p.input.size() / dtype_size(p.spec.dtype), have, p.spec.dtype,
                                          bench::mix64(grank * 0x10001 + pick[k] * 0x101 + static_cast<uint64_t>(step) * 0x1000193)};
            bench::guard_fill(base, f.range.guard_begin(), p.offset, f.range.salt);
            bench::guard_fill(base, p.offset + f.range.bytes(), f.range.guard_end(), f.range.salt);
            if (!p.input.empty()) std::memcpy(base + p.offset, p.input.data(), p.input.size());  // a barrier has none
            f.submit = now_s();
            f.root = static_cast<uint32_t>((static_cast<uint64_t>(step) * 7 + pick[k]) % nranks);  // the same on every rank
            const size_t mine = p.offset + grank * p.spec.count * dtype_size(p.spec.dtype);
            const bool blocked = collective_blocked(p.spec.coll);
            ringd_coll d{sizeof(ringd_coll), static_cast<ringd_collective>(p.spec.coll),
                         static_cast<ringd_dtype>(p.spec.dtype), static_cast<ringd_op>(p.spec.op), p.spec.count,
                         p.spec.coll == Collective::Allgather ? mine : p.offset,
                         p.spec.coll == Collective::ReduceScatter ? mine
                         : p.spec.coll == Collective::AllToAll    ? p.offset + p.input.size() / 2
                         : blocked                                ? p.offset
                                                                  : 0,
                         collective_is_rooted(p.spec.coll) ? static_cast<int>(f.root) : 0, nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, 0, 0};
            if (p.spec.split) {
                const size_t es = dtype_size(p.spec.dtype);
                d.count = 0;
                d.out_offset = p.offset + p.out_at * es;
                d.send_counts = p.send.data();
                d.recv_counts = p.recv.data();
                d.splits_offset = p.offset + p.table_at * es;
            }
            const int rc = ringd_submit_coll(c, &d, &f.ticket);
            if (rc != 0) {
                const std::string msg = std::string("submit: ") + ringd_last_error(c);
                print_op(step, k, p, f, now_s(), rc, 0, 0, msg);
                failed = true;
                if (first_error.empty()) first_error = msg;
                break;
            }
            fl.push_back(f);
        }
        // Wait for all of them, noting each one's end as it comes (not in submission order).
        size_t left = fl.size();
        bool step_ok = !failed;
        // One wait on fl[k]; returns whether the op ended (success or error) or was given up.
        auto wait_one = [&](size_t k, int timeout_ms) {
            InFlight &f = fl[k];
            const int rc = ringd_wait(c, f.ticket, timeout_ms);
            const double end = now_s();
            const std::string last = ringd_last_error(c);
            const bool wait_timed_out = rc == -ETIMEDOUT && last.find("did not complete within") != std::string::npos;
            if (wait_timed_out && end - f.submit <= hard_deadline) return false;
            std::string msg = rc == 0 ? "" : last;
            if (wait_timed_out) msg = "trainer deadline: no end within timeouts.op + 10 s";
            f.done = true;
            --left;
            const Prepared &p = prep[f.spec];
            // Guards are checked after every op, failed or not; values only after a success.
            uint64_t wrong = 0;
            const uint64_t guard = bench::guard_damage(base, f.range.guard_begin(), p.offset, f.range.salt) +
                                   bench::guard_damage(base, p.offset + f.range.bytes(), f.range.guard_end(), f.range.salt);
            if (rc == 0) {
                // reduce_scatter: this rank's block only (the others may hold partial sums); reduce:
                // the root's buffer only; broadcast: the root's input everywhere.
                const size_t first = p.spec.coll == Collective::ReduceScatter ? grank * p.spec.count
                                     : p.spec.split                           ? p.out_at
                                     : p.spec.coll == Collective::AllToAll    ? p.spec.count * nranks
                                                                              : 0;
                size_t last = p.spec.coll == Collective::ReduceScatter ? first + p.spec.count
                              : p.spec.split                           ? p.out_end
                                                                       : p.want.size();
                if (p.spec.coll == Collective::Reduce && grank != f.root) last = 0;
                for (size_t i = first; i < last; ++i) {
                    const double want = p.spec.coll == Collective::Broadcast
                                            ? bench::round_to(p.spec.dtype, static_cast<double>(bench::value(f.root, i)))
                                            : p.want[i];
                    const double got = bench::load(base + p.offset, i, p.spec.dtype);
                    if (!(std::fabs(got - want) <= p.tol * std::fabs(want) + p.abs_tol)) ++wrong;
                }
            } else {
                step_ok = false;
                if (!failed) first_error = msg;
                failed = true;
            }
            print_op(step, k, p, f, end, rc, wrong, guard, msg);
            return true;
        };
        while (left > 0) {
            bool progressed = false;
            for (size_t k = 0; k < fl.size(); ++k)
                if (!fl[k].done && wait_one(k, 0)) progressed = true;
            if (left > 0 && !progressed) {
                // Block briefly on the oldest unfinished op, then poll the others again.
                for (size_t k = 0; k < fl.size(); ++k)
                    if (!fl[k].done) {
                        wait_one(k, 2);
                        break;
                    }
            }
        }
        if (step_ok && !failed) {
            std::printf("step n=%d start=%.6f end=%.6f\n", step, step_start, now_s());
            ++steps;
        }
        if (!failed && o.pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.pause_ms));
    }
    ringd_close(c);
    if (failed) return finish(1, first_error);
    return finish(0, "stop file after " + std::to_string(steps) + " steps");
}
