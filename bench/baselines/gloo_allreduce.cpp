// Baseline: Gloo (libgloo-dev) allreduce over its TCP transport, float32 sum then the avg
// division, the same sweep, data and check as ringd-bench. Every rank is a process: --rank R
// --size N --store DIR (a directory all ranks share, for rendezvous) --address IP (this rank's
// address) --algo A:
//   ring, ring_chunked  the legacy algorithm classes AllreduceRing / AllreduceRingChunked
//   allreduce           gloo::allreduce() with its default (ring) algorithm: what torch's
//                       ProcessGroupGloo runs for a CPU tensor (options, reduce function, a tag
//                       per op), the segmented ring
//   bcube               gloo::allreduce() with the BCube algorithm
#include <gloo/allreduce.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
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
            std::fprintf(stderr, "gloo-allreduce: bad argument %s %s\n", k.c_str(), v.c_str());
            return 2;
        }
    }
    if (algo != "ring" && algo != "ring_chunked" && algo != "allreduce" && algo != "bcube") {
        std::fprintf(stderr, "gloo-allreduce: --algo ring|ring_chunked|allreduce|bcube\n");
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
        auto allreduce = [&](size_t count) {
            if (algo == "allreduce" || algo == "bcube") {
                gloo::AllreduceOptions opts(context);
                opts.setOutput(buf, count);  // in place, as torch calls it
                opts.setReduceFunction(
                    static_cast<void (*)(void *, const void *, const void *, size_t)>(&gloo::sum<float>));
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
        gloo::BarrierAllToOne barrier(context);
        const std::string name = "Gloo " + algo;
        // Each rank checks its own result and prints its verdict; nothing is summed through Gloo.
        const uint64_t bad =
            bench::run_sweep(s, name.c_str(), rank, size, mem.data(), allreduce, [&] { barrier.run(); });
        return bad ? 1 : 0;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "gloo-allreduce: rank %d: %s\n", rank, e.what());
        return 1;
    }
}
