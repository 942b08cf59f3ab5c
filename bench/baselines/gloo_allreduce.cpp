// Baseline: Gloo (libgloo-dev) ring and ring_chunked allreduce over its TCP transport, float32
// sum then the avg division, the same sweep, data and check as ringd-bench. Every rank is a
// process: --rank R --size N --store DIR (a directory all ranks share, for rendezvous)
// --address IP (this rank's address) --algo ring|ring_chunked.
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier_all_to_one.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
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
        else if (auto n = parse_size(v)) {
            if (k == "-b") s.min_bytes = *n;
            else if (k == "-e") s.max_bytes = *n;
            else if (k == "-f") s.factor = *n;
            else if (k == "-n") s.iters = static_cast<int>(*n);
            else if (k == "-w") s.warmup = static_cast<int>(*n);
            else if (k == "-c") s.check = static_cast<int>(*n);
        }
    }
    if (algo != "ring" && algo != "ring_chunked") {
        std::fprintf(stderr, "gloo-allreduce: --algo ring|ring_chunked\n");
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

        std::vector<float> buf(s.max_bytes / 4 + 1);
        const float inv = 1.0f / static_cast<float>(size);
        std::unique_ptr<gloo::Algorithm> alg;
        size_t alg_count = 0;
        auto allreduce = [&](size_t count) {
            if (count != alg_count) {  // Gloo algorithms are built per buffer size (not timed after warm-up)
                std::vector<float *> ptrs{buf.data()};
                if (algo == "ring") alg = std::make_unique<gloo::AllreduceRing<float>>(context, ptrs, static_cast<int>(count));
                else alg = std::make_unique<gloo::AllreduceRingChunked<float>>(context, ptrs, static_cast<int>(count));
                alg_count = count;
            }
            alg->run();
            for (size_t i = 0; i < count; ++i) buf[i] *= inv;
        };
        gloo::BarrierAllToOne barrier(context);
        const std::string name = "Gloo " + algo;
        if (rank == 0) bench::print_header(name.c_str(), size, s);
        double sum_busbw = 0;
        int rows = 0;
        uint64_t wrong_total = 0;
        for (uint64_t bytes = s.min_bytes; bytes <= s.max_bytes; bytes *= s.factor) {
            const size_t count = bytes / 4;
            bench::fill(buf.data(), count, DType::F32, static_cast<uint64_t>(rank));
            for (int i = 0; i < std::max(1, s.warmup); ++i) allreduce(count);
            barrier.run();
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < s.iters; ++i) allreduce(count);
            const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / s.iters;
            uint64_t wrong = 0;
            if (s.check) {
                bench::fill(buf.data(), count, DType::F32, static_cast<uint64_t>(rank));
                allreduce(count);
                // Every rank's count of wrong values, summed with Gloo itself.
                float mine = static_cast<float>(bench::count_wrong(buf.data(), count, DType::F32, ReduceOp::Avg,
                                                                   static_cast<uint64_t>(size)));
                std::vector<float *> p{&mine};
                gloo::AllreduceRing<float>(context, p, 1).run();
                wrong = static_cast<uint64_t>(mine);
            }
            wrong_total += wrong;
            if (rank == 0) sum_busbw += bench::print_row(count * 4, size, us, wrong, s.check);
            ++rows;
        }
        if (rank == 0) std::printf("# Avg bus bandwidth : %.3f\n# Wrong values : %llu\n", rows ? sum_busbw / rows : 0.0,
                                   static_cast<unsigned long long>(wrong_total));
        return wrong_total ? 1 : 0;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "gloo-allreduce: rank %d: %s\n", rank, e.what());
        return 1;
    }
}
