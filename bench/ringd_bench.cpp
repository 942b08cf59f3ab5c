// ringd-bench: a trainer that measures a collective through ringd (--coll: allreduce,
// reduce_scatter, allgather, broadcast, reduce, all_to_all), nccl-tests style: size is the larger
// buffer (reduce_scatter's input, allgather's output, broadcast's and reduce's buffer, each rank's
// all_to_all input), algbw = size / time, busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n
// (reduce_scatter, allgather, all_to_all) or 1 (broadcast, reduce), n counting ranks. Since ringd
// reduces a host's ranks before the network, what bounds it is each host's NIC: hostbw is the
// bytes each host sends per second (allreduce 2(H-1)/H x size, reduce_scatter and allgather
// (H-1)/H x size, broadcast and reduce size (the root's host sends, resp. receives, all of it),
// all_to_all (H-1)/H x L x size with L ranks per host, H hosts), and with --link-mbit, xfloor is
// the time over that link's floor for them. broadcast and reduce run from and to --root (default
// rank 1, a host's second rank where hosts have two); all_to_all sends equal blocks, its output
// right after its input. Every local rank runs it; local rank 0 prints the table. Timing covers only the timed loop;
// the correctness check runs afterwards on freshly filled data and is not timed.
//
// Every rank checks its own result (every value, and guard bytes before and after the op's
// range in the slot) and prints its own verdict line; nothing of the check goes through ringd,
// so a ringd that "succeeds" with garbage cannot grade itself. Whoever runs the ranks gathers
// the verdict lines (bench/cluster prints every rank's output) and sums them.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/baselines/baseline_table.h"
#include "bench/bench_data.h"
#include "bench/cluster_cpu.h"
#include "bench/connect.h"
#include "common/fd_io.h"
#include "common/status_client.h"
#include "common/units.h"
#include "ringd/ringd.h"

using namespace ringd;

namespace {

struct Options {
    std::string socket = "/run/ringd/ringd.sock";
    std::string group = "bench";
    std::string group_hosts;  // the group's hosts (names, comma-separated); empty: every host
    int local_rank = 0;
    int local_size = 1;
    std::string min_bytes = "4K", max_bytes = "64M";
    int factor = 2;
    std::string dtype = "float", op = "avg";
    int iters = 20, warmup = 5, check = 1;
    int timeout_ms = -1;
    bool latency = false;
    std::string coll = "allreduce";
    int root = -1;          // broadcast, reduce (-1: rank 1, or 0 with one rank)
    double link_mbit = 0;  // each host's link rate, for xfloor (0: not printed)
    std::string wire = "default";  // the client's wire (ringd_set_wire; default: ringd's)
    bool feedback = false;         // error feedback, keyed by the op's size
};

int fail(const Options &o, const std::string &msg) {
    std::fprintf(stderr, "ringd-bench: local rank %d: %s\n", o.local_rank, msg.c_str());
    return 1;
}

}  // namespace

int main(int argc, char **argv) {
    Options o;
    CLI::App app{"ringd-bench: a collective's bandwidth through ringd (nccl-tests columns)"};
    app.add_option("--socket", o.socket, "ringd's Unix socket")->capture_default_str();
    app.add_option("--group", o.group, "group name")->capture_default_str();
    app.add_option("--group-hosts", o.group_hosts, "the group's hosts, comma-separated (default: every host of the ring)");
    app.add_option("--local-rank", o.local_rank, "this trainer's rank on the host")->capture_default_str();
    app.add_option("--local-size", o.local_size, "trainers of the group on this host")->capture_default_str();
    app.add_option("-b,--minbytes", o.min_bytes, "smallest size")->capture_default_str();
    app.add_option("-e,--maxbytes", o.max_bytes, "largest size")->capture_default_str();
    app.add_option("-f,--stepfactor", o.factor, "size multiplier")->capture_default_str()->check(CLI::Range(2, 1 << 20));
    app.add_option("-d,--datatype", o.dtype, "float double half bfloat16 int32 int64 (or f32 ...)")->capture_default_str();
    app.add_option("-o,--op", o.op, "sum avg min max")->capture_default_str();
    app.add_option("-n,--iters", o.iters, "timed iterations per size")->capture_default_str()->check(CLI::Range(1, 1 << 20));
    app.add_option("-w,--warmup_iters", o.warmup, "untimed iterations first")->capture_default_str()->check(CLI::Range(0, 1 << 20));
    app.add_option("-c,--check", o.check, "check results (0|1)")->capture_default_str()->check(CLI::Range(0, 1));
    app.add_option("--timeout-ms", o.timeout_ms, "per-op deadline (default: ringd's op timeout + 10 s)");
    app.add_option("--coll", o.coll, "allreduce reduce_scatter allgather broadcast reduce all_to_all")->capture_default_str();
    app.add_option("--root", o.root, "broadcast, reduce: the root rank (default 1, or 0 with one rank)");
    app.add_option("--link-mbit", o.link_mbit, "each host's link rate (Mbit/s): print each size's time over its floor")
        ->check(CLI::PositiveNumber);
    app.add_option("--wire", o.wire, "default exact bf16 fp16 int8: the wire of ops it applies to (docs/wire.md)")
        ->capture_default_str();
    app.add_flag("--feedback", o.feedback, "compressed wires: error feedback, one residual per size");
    app.add_flag("--latency", o.latency, "also print each size's op latency percentiles (p50 p90 p99 max, us)");
    CLI11_PARSE(app, argc, argv);

    const auto dtype = parse_dtype(o.dtype);
    const auto op = parse_reduce_op(o.op);
    const auto min_b = parse_size(o.min_bytes), max_b = parse_size(o.max_bytes);
    if (!dtype) return fail(o, "unknown dtype " + o.dtype);
    if (!op) return fail(o, "unknown op " + o.op);
    const bool wire_given = o.wire != "default";
    WireFormat wire = WireFormat::Exact;
    if (wire_given) {
        const auto w = parse_wire_format(o.wire);
        if (!w) return fail(o, "unknown wire " + o.wire + " (default, exact, bf16, fp16, int8)");
        wire = *w;
    }
    const auto coll = parse_collective(o.coll);
    if (!coll || *coll == Collective::Barrier)
        return fail(o, "unknown collective " + o.coll + " (allreduce, reduce_scatter, allgather, broadcast, reduce, all_to_all)");
    const bool a2a = *coll == Collective::AllToAll;
    const bool rooted = *coll == Collective::Broadcast || *coll == Collective::Reduce;
    if (!min_b || !max_b || *min_b > *max_b) return fail(o, "bad size range " + o.min_bytes + ".." + o.max_bytes);
    const size_t esize = dtype_size(*dtype);

    // The ring's size (hosts) comes from the daemon; busbw needs the total rank count.
    auto st = fetch_status(o.socket);
    if (!st) return fail(o, st.error().message);
    uint64_t hosts = 1, host_index = 0, slot_limit = UINT64_MAX;
    try {
        const auto status = nlohmann::json::parse(*st);
        if (status.contains("memory") && status["memory"].contains("slot_bytes_limit"))
            slot_limit = status["memory"]["slot_bytes_limit"].get<uint64_t>();
        const auto ring = status["ring"];
        hosts = ring["size"].get<uint64_t>();
        for (uint64_t i = 0; i < ring["members"].size(); ++i)
            if (ring["members"][i]["self"].get<bool>()) host_index = i;  // this host's place in the ring
        if (!o.group_hosts.empty()) {
            // A group over part of the ring: its hosts, and this host's place among them, in ring order.
            const std::string list = "," + o.group_hosts + ",";
            uint64_t in = 0, self = UINT64_MAX;
            for (const auto &m : ring["members"]) {
                if (list.find("," + m["name"].get<std::string>() + ",") == std::string::npos) continue;
                if (m["self"].get<bool>()) self = in;
                ++in;
            }
            if (self == UINT64_MAX) return fail(o, "this host is not in --group-hosts " + o.group_hosts);
            hosts = in;
            host_index = self;
        }
    } catch (const std::exception &e) {
        return fail(o, std::string("bad status from ringd: ") + e.what());
    }
    // Every host runs the same local_size (a group spans every host alike).
    const uint64_t nranks = hosts * static_cast<uint64_t>(o.local_size);
    const uint64_t global_rank = host_index * static_cast<uint64_t>(o.local_size) + static_cast<uint64_t>(o.local_rank);
    const uint64_t root = o.root >= 0 ? static_cast<uint64_t>(o.root) : (nranks > 1 ? 1 : 0);
    if (rooted && root >= nranks) return fail(o, "--root " + std::to_string(root) + ": the group has " + std::to_string(nranks) + " ranks");

    // The op sits kGuardBytes into the slot, with guard bytes before and after its range (fewer
    // when ringd's memory.slot_bytes leaves less room next to the largest size).
    const size_t largest = std::max<size_t>(*max_b, 64) * (a2a ? 2 : 1);  // (all_to_all: input and output)
    const size_t room = slot_limit > largest ? std::min<uint64_t>(2 * bench::kGuardBytes, slot_limit - largest) : 0;
    const size_t op_offset = room / 2 / 8 * 8;  // a multiple of every element size
    const size_t slot_bytes = largest + room;
    if (room < 2 * bench::kGuardBytes && o.local_rank == 0)
        std::fprintf(stderr, "ringd-bench: only %zu guard bytes around the largest op (memory.slot_bytes %llu, largest "
                             "size %zu): set memory.slot_bytes to at least %zu for full guards\n",
                     room, static_cast<unsigned long long>(slot_limit), largest, largest + 2 * bench::kGuardBytes);
    char err[512] = "";
    // Every collective but allreduce: the group's ranks in ring order, local ranks in order.
    const bool ranked = *coll != Collective::Allreduce;
    const bool blocks = *coll == Collective::ReduceScatter || *coll == Collective::Allgather;
    ringd_client *c = bench::connect_group(o.socket, o.group, o.local_rank, o.local_size, slot_bytes, o.group_hosts, err,
                                           sizeof err, ranked ? static_cast<int>(global_rank) : 0,
                                           ranked ? static_cast<int>(nranks) : 0);
    if (!c) return fail(o, err);
    size_t have = 0;
    void *buf = ringd_slot(c, &have);
    if (!buf || have < slot_bytes) {
        ringd_close(c);
        return fail(o, "the slot has " + std::to_string(have) + " bytes, " + std::to_string(slot_bytes) + " asked");
    }
    if (wire_given)
        if (int rc = ringd_set_wire(c, static_cast<ringd_wire>(static_cast<int>(wire) + 1)); rc != 0) {
            const std::string msg = ringd_last_error(c);
            ringd_close(c);
            return fail(o, msg);
        }
    // The values are checked within the wire's bound where it applies (ringd's default wire is
    // not known here: give --wire to check a compressed one).
    const WireFormat checked = wire_given && wire_applies(*coll, *dtype, *op) ? wire : WireFormat::Exact;
    const double tol = bench::wire_tolerance(checked, hosts, nranks, *dtype, *op);
    const auto cdt = static_cast<ringd_dtype>(*dtype);
    const auto cop = static_cast<ringd_op>(*op);
    // `count`: the larger buffer's elements (a whole number of blocks for reduce_scatter, allgather
    // and all_to_all). In place: a reduce_scatter's output is this rank's block of the input, an
    // allgather's input its block of the output, broadcast and reduce work on the buffer; an
    // all_to_all's output follows its input. So the op's range is the guarded one.
    // With --feedback the checked op has a tag of its own: the timed ops' residual is of their
    // grown sums, not of the checked op's values.
    auto run = [&](size_t count, bool checked_op = false) {
        if (!ranked && !o.feedback) return ringd_allreduce(c, op_offset, count, cdt, cop, o.timeout_ms);
        ringd_coll d{sizeof(ringd_coll), static_cast<ringd_collective>(*coll), cdt, cop, count, op_offset, 0, 0,
                     nullptr, nullptr, 0, RINGD_WIRE_DEFAULT, o.feedback ? 1 : 0, count | (checked_op ? 1ull << 63 : 0)};
        if (blocks) {
            const size_t block = count / nranks;
            const size_t mine = op_offset + global_rank * block * esize;
            d.count = block;
            d.in_offset = *coll == Collective::ReduceScatter ? op_offset : mine;
            d.out_offset = *coll == Collective::ReduceScatter ? mine : op_offset;
        } else if (a2a) {
            d.count = count / nranks;
            d.out_offset = op_offset + count * esize;
        } else {
            d.root = static_cast<int>(root);
        }
        uint64_t t = 0;
        if (int rc = ringd_submit_coll(c, &d, &t); rc != 0) return rc;
        return ringd_wait(c, t, o.timeout_ms);
    };

    const bool printer = o.local_rank == 0;
    if (printer) {
        std::printf("# ringd-bench: %s, %llu host(s) x %d local rank(s) = %llu ranks, group %s, %s %s, %d iters (+%d "
                    "warm-up), wire %s%s\n",
                    o.coll.c_str(), static_cast<unsigned long long>(hosts), o.local_size, static_cast<unsigned long long>(nranks),
                    o.group.c_str(), std::string(dtype_name(*dtype)).c_str(), std::string(reduce_op_name(*op)).c_str(),
                    o.iters, o.warmup, o.wire.c_str(), o.feedback ? " with error feedback" : "");
        std::printf("# hostbw: bytes each host's NIC sends per second; xfloor: time over that at --link-mbit%s\n",
                    o.link_mbit > 0 ? "" : " (not given: N/A)");
        std::printf("# #wrong: rank %llu's own wrong values; every rank checks its own result and prints its verdict\n",
                    static_cast<unsigned long long>(global_rank));
        std::printf("#\n# %12s %12s %8s %6s %11s %12s %12s %8s %13s %7s\n", "size(B)", "count", "type", "redop", "time(us)",
                    "algbw(GB/s)", "busbw(GB/s)", "#wrong", "hostbw(GB/s)", "xfloor");
        std::fflush(stdout);
    }
    // Read around each timed loop by rank 0 of the group (the counter covers every host).
    const bench::ClusterCpu cpu;
    const bool cpu_reader = global_rank == 0;
    double busbw_sum = 0;
    int rows = 0;
    uint64_t wrong_total = 0, guard_total = 0;
    int rc = 0;
    for (uint64_t size = *min_b; size <= *max_b; size *= static_cast<uint64_t>(o.factor)) {
        size_t count = size / esize;
        if (blocks || a2a) count = count / nranks * nranks;  // whole blocks
        if (count == 0) continue;
        // Guards salted per rank and size: bytes copied from another rank's slot or an earlier size
        // do not match. (all_to_all: around its input and output.)
        const bench::GuardedRange range{op_offset, count * (a2a ? 2 : 1), have, *dtype, bench::mix64(global_rank * 0x10001 + size)};
        range.prepare(buf, global_rank);
        for (int i = 0; i < o.warmup && rc == 0; ++i) rc = run(count);
        // As the baselines do (run_sweep): idle links, then a barrier (a one-element op).
        bench::idle_links();
        if (rc == 0) rc = run(a2a ? nranks : 1);
        std::vector<double> lat;
        if (o.latency) lat.reserve(static_cast<size_t>(o.iters));
        const double cpu0 = cpu_reader ? cpu.seconds() : -1;
        const auto t0 = Clock::now();
        for (int i = 0; i < o.iters && rc == 0; ++i) {
            const auto t = o.latency ? Clock::now() : Clock::time_point{};
            rc = run(count);
            if (o.latency) lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t).count());
        }
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / o.iters;
        const double cpu1 = cpu_reader ? cpu.seconds() : -1;
        if (rc != 0) break;
        if (printer && o.latency) {
            std::sort(lat.begin(), lat.end());
            auto at = [&](double q) { return lat[std::min(lat.size() - 1, static_cast<size_t>(q * static_cast<double>(lat.size())))]; };
            std::printf("# latency %llu B: p50 %.1f p90 %.1f p99 %.1f max %.1f us\n", static_cast<unsigned long long>(size),
                        at(0.5), at(0.9), at(0.99), lat.back());
        }
        // The timed ops' values are not checked (repeated sums grow), but their guards are.
        guard_total += bench::guard_damage(buf, range.guard_begin(), op_offset, range.salt) +
                       bench::guard_damage(buf, op_offset + range.bytes(), range.guard_end(), range.salt);
        uint64_t wrong = 0;
        if (o.check) {
            range.prepare(buf, global_rank);
            if ((rc = run(count, true)) != 0) break;
            if (!ranked) {
                const auto v = range.check(buf, *op, nranks, tol);
                wrong = v.wrong;
                guard_total += v.guard;
            } else {
                // Here, from every rank's inputs (bench::collective_wrong); the result lies where
                // the op was given it: a reduce_scatter's in this rank's block of the input, an
                // all_to_all's after its input, the others' over the range.
                const auto *base = static_cast<const unsigned char *>(buf);
                const size_t at = *coll == Collective::ReduceScatter ? op_offset + global_rank * (count / nranks) * esize
                                  : a2a                              ? op_offset + count * esize
                                                                     : op_offset;
                wrong = bench::collective_wrong(*coll, base + at, count, *dtype, *op, nranks, global_rank, root, tol);
                guard_total += bench::guard_damage(buf, range.guard_begin(), op_offset, range.salt) +
                               bench::guard_damage(buf, op_offset + range.bytes(), range.guard_end(), range.salt);
            }
        }
        wrong_total += wrong;
        const double algbw = static_cast<double>(count * esize) / (us * 1e3);
        const double share = rooted ? 1.0 : (ranked ? 1.0 : 2.0) * static_cast<double>(nranks - 1) / static_cast<double>(nranks);
        const double busbw = algbw * share;
        const double host_bytes = bench::host_bytes(*coll, static_cast<double>(count * esize), hosts, o.local_size);
        const double hostbw = host_bytes / (us * 1e3);
        char floor_s[32] = "N/A";
        if (o.link_mbit > 0 && hosts > 1)
            std::snprintf(floor_s, sizeof floor_s, "%.3f", us * 1e-6 / (host_bytes * 8 / (o.link_mbit * 1e6)));
        busbw_sum += busbw;
        ++rows;
        if (printer) {
            char wrong_s[32];
            std::snprintf(wrong_s, sizeof wrong_s, "%llu", static_cast<unsigned long long>(wrong));
            std::printf("  %12llu %12zu %8s %6s %11.2f %12.3f %12.3f %8s %13.3f %7s\n",
                        static_cast<unsigned long long>(count * esize), count, std::string(dtype_name(*dtype)).c_str(),
                        std::string(reduce_op_name(*op)).c_str(), us, algbw, busbw, o.check ? wrong_s : "N/A", hostbw,
                        floor_s);
            std::fflush(stdout);
            bench::ClusterCpu::print(count * esize, o.iters, cpu0, cpu1);
        }
        if (size > UINT64_MAX / static_cast<uint64_t>(o.factor)) break;
    }
    // A last one-element op before leaving, as a job's closing barrier: in a ring with a host
    // older than protocol 11, a rank whose last op ended early (a reduce's or broadcast's off the
    // root's host) would otherwise leave while the others' still run, which ends the group's
    // incarnation there and fails their op (from 11 on the ops that ended on its host go on).
    if (rc == 0) rc = ringd_allreduce(c, op_offset, 1, cdt, RINGD_SUM, o.timeout_ms);
    if (rc != 0) {
        const std::string msg = ringd_last_error(c);
        ringd_close(c);
        return fail(o, msg.empty() ? "allreduce failed: " + errno_string(rc) : msg);
    }
    ringd_close(c);
    if (printer) std::printf("# Avg bus bandwidth : %.3f\n", rows ? busbw_sum / rows : 0.0);
    // This rank's verdict, one line in a fixed format that harnesses gather from every rank.
    if (o.check) {
        bench::print_verdict(global_rank, nranks, wrong_total, guard_total);
    } else {
        std::printf("# rank %llu of %llu: values not checked (-c 0), guard bytes damaged %llu\n",
                    static_cast<unsigned long long>(global_rank), static_cast<unsigned long long>(nranks),
                    static_cast<unsigned long long>(guard_total));
        std::fflush(stdout);
    }
    if (wrong_total || guard_total)
        return fail(o, std::to_string(wrong_total) + " wrong values, " + std::to_string(guard_total) +
                           " guard bytes damaged (rank " + std::to_string(global_rank) + ")");
    return 0;
}
