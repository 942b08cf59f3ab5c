// Baseline: Gloo (libgloo-dev) over its TCP transport, float32, the same sweep, data and check as
// ringd-bench. Every rank is a process: --rank R --size N --store DIR (a directory all ranks
// share, for rendezvous) --address IP (this rank's address) --coll C (ringd-bench's; --root R for
// broadcast and reduce, rank 1 by default) --algo A. allreduce (sum, then the avg division) by
// --algo:
//   ring, ring_chunked  the legacy algorithm classes AllreduceRing / AllreduceRingChunked
//   allreduce           gloo::allreduce() with its default (ring) algorithm: what torch's
//                       ProcessGroupGloo runs for a CPU tensor (options, reduce function, a tag
//                       per op), the segmented ring
//   bcube               gloo::allreduce() with the BCube algorithm
// The other collectives (sum) as torch's ProcessGroupGloo calls them: gloo::allgather,
// gloo::broadcast, gloo::reduce, gloo::alltoall (options, a tag per op), in place where Gloo
// has it; reduce_scatter, which those functions lack, with the ReduceScatterHalvingDoubling
// algorithm class (--algo is then ignored).
#include <gloo/allreduce.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>
#include <gloo/reduce_scatter.h>
#include <gloo/barrier.h>
#include <gloo/barrier_all_to_one.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <memory>
#include <vector>

#include "bench/baselines/baseline_table.h"

using namespace ringd;

int main(int argc, char **argv) {
    bench::Sweep s;
    int rank = 0, size = 1;
    std::string store_dir = "/tmp", address = "127.0.0.1", algo = "ring";
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string k = argv[i], v = argv[i + 1];
        if (k == "--rank") rank = std::atoi(v.c_str());
        else if (k == "--size") size = std::atoi(v.c_str());
        else if (k == "--store") store_dir = v;
        else if (k == "--address") address = v;
        else if (k == "--algo") algo = v;
        else if (!bench::parse_sweep_arg(k, argv[i + 1], s)) {
            std::fprintf(stderr, "gloo-bench: bad argument %s %s\n", k.c_str(), v.c_str());
            return 2;
        }
    }
    if (algo != "ring" && algo != "ring_chunked" && algo != "allreduce" && algo != "bcube") {
        std::fprintf(stderr, "gloo-bench: --algo ring|ring_chunked|allreduce|bcube\n");
        return 2;
    }
    if (s.root_of(size) >= static_cast<uint64_t>(size)) {
        std::fprintf(stderr, "gloo-bench: --root %d: there are %d ranks\n", s.root, size);
        return 2;
    }
    try {
        gloo::transport::tcp::attr attr;
        attr.hostname = address;
        auto device = gloo::transport::tcp::CreateDevice(attr);
        gloo::rendezvous::FileStore file_store(store_dir);
        gloo::rendezvous::PrefixStore store("ringd-baseline", file_store);
        auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
        context->setTimeout(std::chrono::seconds(120));
        context->connectFullMesh(store, device);

        // The op's floats lie kOpOffset into the buffer, with guard bytes before and after them.
        std::vector<float> mem(bench::buffer_bytes(s) / 4 + 1);
        float *buf = mem.data() + bench::kOpOffset / 4;
        const float inv = 1.0f / static_cast<float>(size);
        std::unique_ptr<gloo::Algorithm> alg;
        size_t alg_count = 0;
        uint32_t tag = 0;
        const auto sum = static_cast<void (*)(void *, const void *, const void *, size_t)>(&gloo::sum<float>);
        const int root = static_cast<int>(s.root_of(size));
        std::unique_ptr<gloo::ReduceScatterHalvingDoubling<float>> rs;
        auto allreduce = [&](size_t count) {
            if (algo == "allreduce" || algo == "bcube") {
                gloo::AllreduceOptions opts(context);
                opts.setOutput(buf, count);  // in place, as torch calls it
                opts.setReduceFunction(sum);
                opts.setTag(tag++);
                if (algo == "bcube") opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::BCUBE);
                gloo::allreduce(opts);
                for (size_t i = 0; i < count; ++i) buf[i] *= inv;
                return;
            }
            if (count != alg_count) {  // Gloo algorithms are built per buffer size (not timed after warm-up)
                std::vector<float *> ptrs{buf};
                if (algo == "ring") alg = std::make_unique<gloo::AllreduceRing<float>>(context, ptrs, static_cast<int>(count));
                else alg = std::make_unique<gloo::AllreduceRingChunked<float>>(context, ptrs, static_cast<int>(count));
                alg_count = count;
            }
            alg->run();
            for (size_t i = 0; i < count; ++i) buf[i] *= inv;
        };
        auto run = [&](size_t count) -> const void * {
            const size_t block = count / static_cast<size_t>(size);
            switch (s.coll) {
            case Collective::ReduceScatter: {
                if (count != alg_count) {  // built per buffer size, as the allreduce classes
                    rs = std::make_unique<gloo::ReduceScatterHalvingDoubling<float>>(
                        context, std::vector<float *>{buf}, static_cast<int>(count),
                        std::vector<int>(static_cast<size_t>(size), static_cast<int>(block)));
                    alg_count = count;
                }
                rs->run();
                return buf;  // (Gloo leaves this rank's block at the start of the buffer, as MPI does)
            }
            case Collective::Allgather: {
                gloo::AllgatherOptions opts(context);
                opts.setOutput(buf, count);  // no input: this rank's block of the output is its input
                opts.setTag(tag++);
                gloo::allgather(opts);
                return buf;
            }
            case Collective::Broadcast: {
                gloo::BroadcastOptions opts(context);
                opts.setOutput(buf, count);
                opts.setRoot(root);
                opts.setTag(tag++);
                gloo::broadcast(opts);
                return buf;
            }
            case Collective::Reduce: {
                gloo::ReduceOptions opts(context);
                opts.setOutput(buf, count);
                opts.setRoot(root);
                opts.setReduceFunction(sum);
                opts.setTag(tag++);
                gloo::reduce(opts);
                return buf;
            }
            case Collective::AllToAll: {
                gloo::AlltoallOptions opts(context);
                opts.setInput(buf, count);
                opts.setOutput(buf + count, count);
                opts.setTag(tag++);
                gloo::alltoall(opts);
                return buf + count;
            }
            default: allreduce(count); return buf;
            }
        };
        // The barrier of the system under test: the legacy algorithm classes' own for them; the
        // functions' (gloo::barrier) for the others. A legacy algorithm's buffers on a pair slow
        // the functions' unbound buffers on it down a hundredfold where two ranks share a host
        // (Debian's Gloo, 2022: 0.5 s for a 1 MiB gloo::allreduce of 4 ranks on one host after
        // one BarrierAllToOne, 5 ms without), which no torch job meets: ProcessGroupGloo uses
        // the functions only.
        const bool legacy = s.coll == Collective::Allreduce && (algo == "ring" || algo == "ring_chunked");
        std::unique_ptr<gloo::BarrierAllToOne> legacy_barrier;
        if (legacy) legacy_barrier = std::make_unique<gloo::BarrierAllToOne>(context);
        auto barrier = [&] {
            if (legacy) return legacy_barrier->run();
            gloo::BarrierOptions opts(context);
            opts.setTag(tag++);
            gloo::barrier(opts);
        };
        const std::string name = "Gloo " + (s.coll == Collective::Allreduce ? algo : std::string(collective_name(s.coll)));
        // Each rank checks its own result and prints its verdict; nothing is summed through Gloo.
        const uint64_t bad =
            bench::run_sweep(s, name.c_str(), rank, size, mem.data(), run, barrier);
        return bad ? 1 : 0;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "gloo-bench: rank %d: %s\n", rank, e.what());
        return 1;
    }
}
