// ringd-reduce-bench: throughput of the reduction kernels next to memcpy, per dtype, and of the
// compressed wire formats' encode (f32 in, the format out), accumulate (the format in, an f32
// accumulator read and written) and encode with error feedback (a residual read and written too).
// GB/s counts bytes read + written, so memcpy and a 2-input reduction compare like for like.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/fd_io.h"
#include "common/units.h"
#include "daemon/engine/reduce.h"
#include "daemon/engine/wire.h"

using namespace ringd;

namespace {

template <typename F>
double best_seconds(int iters, F &&f) {
    double best = 1e30;
    for (int i = 0; i < iters; ++i) {
        const auto t0 = Clock::now();
        f();
        best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return best;
}

}  // namespace

int main(int argc, char **argv) {
    CLI::App app{"ringd-reduce-bench: reduction kernels vs memcpy"};
    std::string size_s = "64M";
    int iters = 10;
    int inputs = 2;
    app.add_option("-s,--size", size_s, "bytes per buffer")->capture_default_str();
    app.add_option("-n,--iters", iters, "repetitions (best is reported)")->capture_default_str()->check(CLI::Range(1, 10000));
    app.add_option("-i,--inputs", inputs, "buffers reduced together (local ranks)")->capture_default_str()->check(CLI::Range(2, 64));
    CLI11_PARSE(app, argc, argv);
    const auto bytes = parse_size(size_s);
    if (!bytes || *bytes < 64) {
        std::fprintf(stderr, "bad size %s\n", size_s.c_str());
        return 1;
    }
    // Every byte 0x3f: a normal value in every float dtype (f32 0.75, f64 4.8e-4, f16 1.8, bf16
    // 0.75). Not bytes of 1: as f32/bf16 those are 2.4e-38, which avg's exact pre-scaling by 2^-K
    // (reduce.h) turns into subnormals, and x86 computes with those through microcode, 10-40x
    // slower; that measures the subnormal penalty, not the kernel.
    std::vector<std::vector<unsigned char>> bufs(static_cast<size_t>(inputs), std::vector<unsigned char>(*bytes, 0x3f));
    std::vector<unsigned char> out(*bytes, 0);

    const double tm = best_seconds(iters, [&] { std::memcpy(out.data(), bufs[0].data(), *bytes); });
    std::printf("# %zu-byte buffers, %d inputs, best of %d; GB/s = (bytes read + written) / time\n",
                static_cast<size_t>(*bytes), inputs, iters);
    std::printf("%-10s %-5s %10s %12s\n", "kernel", "op", "GB/s", "vs memcpy");
    const double mgbs = 2.0 * static_cast<double>(*bytes) / tm / 1e9;
    std::printf("%-10s %-5s %10.2f %12s\n", "memcpy", "-", mgbs, "1.00x");
    std::vector<const void *> srcs;
    for (auto &b : bufs) srcs.push_back(b.data());
    void *dst = out.data();
    for (uint32_t t = 0; t < kDTypeCount; ++t) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
            const auto dt = static_cast<DType>(t);
            if (op == ReduceOp::Avg && dtype_is_integer(dt)) continue;
            ReduceArgs a{dt, op, srcs.data(), srcs.size(), &dst, 1, *bytes / dtype_size(dt), static_cast<uint32_t>(inputs)};
            const double s = best_seconds(iters, [&] { reduce(a); });
            const double gbs = static_cast<double>(inputs + 1) * static_cast<double>(*bytes) / s / 1e9;
            std::printf("%-10s %-5s %10.2f %11.2fx\n", std::string(dtype_name(dt)).c_str(),
                        std::string(reduce_op_name(op)).c_str(), gbs, gbs / mgbs);
        }
    }
    // The wire formats, on f32 values of every magnitude (a smooth ramp, not the constant above,
    // so that blocks differ).
    const size_t n = *bytes / 4;
    std::vector<float> x(n), acc(n, 0.0f), residual(n, 0.0f);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(static_cast<double>(i % 4099) - 2049.0) * 1e-3f;
    std::vector<unsigned char> wire(wire_bytes(WireFormat::Exact, n));
    for (WireFormat f : {WireFormat::BF16, WireFormat::FP16, WireFormat::Int8}) {
        const double w = static_cast<double>(wire_bytes(f, n)), f32 = 4.0 * static_cast<double>(n);
        const std::string name = "wire " + std::string(wire_format_name(f));
        const double se = best_seconds(iters, [&] { wire_encode(f, x.data(), n, wire.data()); });
        const double sa = best_seconds(iters, [&] { wire_accumulate(f, wire.data(), n, acc.data()); });
        const double sf = best_seconds(iters, [&] { wire_encode(f, x.data(), n, wire.data(), residual.data()); });
        for (auto [what, gbs] : {std::pair{"enc", (f32 + w) / se / 1e9}, std::pair{"acc", (w + 2 * f32) / sa / 1e9},
                                 std::pair{"encfb", (3 * f32 + w) / sf / 1e9}})
            std::printf("%-10s %-5s %10.2f %11.2fx\n", name.c_str(), what, gbs, gbs / mgbs);
    }
    return 0;
}
