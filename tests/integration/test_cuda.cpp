// Device buffers through CUDA IPC, on ringd's software CUDA device (cuda.provider: emulated, the
// client with RINGD_CUDA_PROVIDER=emulated): real daemons on 127.0.0.1, real processes, device
// memory shared between them as the driver shares it (VMM fds over the socket, legacy IPC
// handles). Every result is read back from the device and checked here, value by value, with the
// guard bytes around each rank's range. With RINGD_TEST_CUDA_PROVIDER=hardware the same cases run
// on a real GPU (tests/device/cuda-check).
#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "common/cuda/cuda_api.h"
#include "common/status_client.h"
#include "tests/support/cluster.h"
#include "tests/support/matrix.h"
#include "tests/support/ranked.h"
#include "tests/support/skip.h"

using namespace ringd;
using namespace ringd::test;

namespace {

std::string provider() { return env_or("RINGD_TEST_CUDA_PROVIDER", "emulated"); }

// The client library and this test load the same provider (the same library in this process).
const cuda::CudaApi *api() {
    static const cuda::CudaApi *a = [] {
        ::setenv("RINGD_CUDA_PROVIDER", provider().c_str(), 1);
        auto r = cuda::load_cuda(*cuda::parse_provider(provider()));
        if (!r) WARN("no CUDA: " << r.error().message);
        return r ? *r : nullptr;
    }();
    return a;
}

// This thread's current context: device 0's primary context.
void use_device() {
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    REQUIRE(api()->cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
    REQUIRE(api()->cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS);
    REQUIRE(api()->cuCtxSetCurrent(ctx) == CUDA_SUCCESS);
}

// A kernel that holds its stream `us` microseconds, like a long backward pass: PTX the driver
// compiles (sm_70 and newer), or the software device's own.
constexpr char kSpinPtx[] = R"(.version 7.0
.target sm_70
.address_size 64
.visible .entry ringd_spin(.param .u64 ringd_spin_us)
{
	.reg .pred %p<2>;
	.reg .b64 %rd<7>;
	ld.param.u64 %rd4, [ringd_spin_us];
	mov.u64 %rd3, %globaltimer;
	mul.lo.s64 %rd2, %rd4, 1000;
$L_spin:
	mov.u64 %rd5, %globaltimer;
	sub.s64 %rd6, %rd5, %rd3;
	setp.lt.u64 %p1, %rd6, %rd2;
	@%p1 bra $L_spin;
	ret;
}
)";
constexpr char kSpinEmulated[] = "RINGDEMU" "ringd_spin\0";

void spin(CUstream stream, unsigned long long us) {
    static CUfunction f = [] {
        CUmodule m = nullptr;
        CUfunction fn = nullptr;
        const void *image = provider() == "emulated" ? static_cast<const void *>(kSpinEmulated) : kSpinPtx;
        REQUIRE(api()->cuModuleLoadData(&m, image) == CUDA_SUCCESS);
        REQUIRE(api()->cuModuleGetFunction(&fn, m, "ringd_spin") == CUDA_SUCCESS);
        return fn;
    }();
    void *params[] = {&us};
    REQUIRE(api()->cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, params, nullptr) == CUDA_SUCCESS);
}

std::string cuda_yaml() { return "cuda: {provider: " + provider() + "}\n"; }

ClusterOptions cuda_cluster(const std::string &op_timeout, const std::string &yaml) {
    ClusterOptions o;
    o.op_timeout = op_timeout;
    o.extra_yaml = yaml;
    return o;
}

// A device buffer of one trainer: from ringd_cuda_alloc (vmm) or cuMemAlloc + ringd_register_cuda.
struct DeviceBuf {
    ringd_client *c = nullptr;
    CUdeviceptr base = 0;
    size_t bytes = 0;
    bool vmm = false;
    uint64_t reg = 0;
    DeviceBuf(ringd_client *client, size_t n, bool use_vmm) : c(client), bytes(n), vmm(use_vmm) {
        if (vmm) {
            void *p = nullptr;
            INFO(ringd_last_error(c));
            REQUIRE(ringd_cuda_alloc(c, n, &p) == 0);
            base = reinterpret_cast<CUdeviceptr>(p);
        } else {
            REQUIRE(api()->cuMemAlloc(&base, n) == CUDA_SUCCESS);
            INFO(ringd_last_error(c));
            REQUIRE(ringd_register_cuda(c, reinterpret_cast<void *>(base), n, &reg) == 0);
        }
    }
    ~DeviceBuf() {
        if (vmm) {
            ringd_cuda_free(c, reinterpret_cast<void *>(base));
        } else {
            if (reg) ringd_unregister_cuda(c, reg);
            if (base) api()->cuMemFree(base);
        }
    }
    void *at(size_t offset) const { return reinterpret_cast<void *>(base + offset); }
};

// One op on every rank's device buffer: inputs written to the device, results read back.
struct DeviceOp {
    DType t;
    ReduceOp op;
    size_t count;
    std::vector<bench::GuardedRange> range;
    std::vector<std::vector<unsigned char>> image;  // host copies of each rank's whole buffer
    std::vector<uint64_t> tickets;
};

DeviceOp prepare(std::vector<std::unique_ptr<DeviceBuf>> &bufs, DType t, ReduceOp op, size_t count, uint64_t seed) {
    const size_t n = bufs.size();
    DeviceOp o{t, op, count, std::vector<bench::GuardedRange>(n), std::vector<std::vector<unsigned char>>(n),
               std::vector<uint64_t>(n)};
    for (size_t g = 0; g < n; ++g) {
        const size_t offset = bench::kGuardBytes + ((seed + g * 7) % 64) * 8;
        o.range[g] = bench::GuardedRange{offset, count, bufs[g]->bytes, t, seed * 1000003 + g};
        REQUIRE(offset + o.range[g].bytes() + bench::kGuardBytes <= bufs[g]->bytes);
        o.image[g].assign(bufs[g]->bytes, 0);
        o.range[g].prepare(o.image[g].data(), g);
    }
    return o;
}

void submit(std::vector<std::unique_ptr<DeviceBuf>> &bufs, DeviceOp &o, CUstream stream = nullptr) {
    for (size_t g = 0; g < bufs.size(); ++g) {
        INFO("rank " << g << ": " << ringd_last_error(bufs[g]->c));
        REQUIRE(ringd_submit_cuda(bufs[g]->c, bufs[g]->at(o.range[g].offset), o.count, static_cast<ringd_dtype>(o.t),
                                  static_cast<ringd_op>(o.op), stream, &o.tickets[g]) == 0);
    }
}

void wait_and_check(std::vector<std::unique_ptr<DeviceBuf>> &bufs, DeviceOp &o) {
    const size_t n = bufs.size();
    for (size_t g = 0; g < n; ++g) {
        const int rc = ringd_wait(bufs[g]->c, o.tickets[g], 20000);
        INFO("rank " << g << " " << dtype_name(o.t) << " " << reduce_op_name(o.op) << " count " << o.count << ": "
                     << (rc == 0 ? "" : ringd_last_error(bufs[g]->c)));
        REQUIRE(rc == 0);
    }
    for (size_t g = 0; g < n; ++g) {
        REQUIRE(api()->cuMemcpyDtoH(o.image[g].data(), bufs[g]->base, bufs[g]->bytes) == CUDA_SUCCESS);
        INFO("rank " << g << " (" << (bufs[g]->vmm ? "ringd_cuda_alloc" : "ringd_register_cuda") << ") "
                     << dtype_name(o.t) << " " << reduce_op_name(o.op) << " count " << o.count);
        const auto v = o.range[g].check(o.image[g].data(), o.op, n);
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
    }
}

void upload(std::vector<std::unique_ptr<DeviceBuf>> &bufs, DeviceOp &o) {
    for (size_t g = 0; g < bufs.size(); ++g)
        REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, o.image[g].data(), bufs[g]->bytes) == CUDA_SUCCESS);
}

json status_of(const Daemon &d) {
    auto s = fetch_status(d.socket());
    REQUIRE(s.ok());
    return json::parse(*s)["cuda"];
}

// What a daemon's CUDA service copied off and onto devices so far (status: staged_in_bytes,
// staged_out_bytes).
std::pair<uint64_t, uint64_t> staged_bytes(const Daemon &d) {
    const json j = status_of(d);
    return {j["staged_in_bytes"].get<uint64_t>(), j["staged_out_bytes"].get<uint64_t>()};
}

// Until the daemon has `n` device ops in flight (their stage-in queued): what a test waits for
// before it acts on an op that must be inside ringd.
bool ops_in_flight(const Daemon &d, uint64_t n, std::chrono::milliseconds limit = 10s) {
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
        if (status_of(d)["ops_in_flight"].get<uint64_t>() >= n) return true;
        std::this_thread::sleep_for(2ms);
    }
    return false;
}

// Until every daemon's CUDA mappings are closed (a client's stream drains before they go).
bool all_closed(TestCluster &c, std::chrono::milliseconds limit = 10s) {
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
        bool closed = true;
        for (auto &d : c.d) {
            const json j = status_of(*d);
            closed &= j["mapped_bytes"].get<uint64_t>() == 0 && j["clients"].get<uint64_t>() == 0;
        }
        if (closed) return true;
        std::this_thread::sleep_for(20ms);
    }
    return false;
}

#define NEED_CUDA()                                           \
    do {                                                      \
        if (!api()) RINGD_SKIP("no CUDA provider here");      \
    } while (0)

}  // namespace

TEST_CASE("device buffers on 3 hosts x 2 ranks, every dtype and op, both kinds", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(3, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    for (auto &d : c.d) {
        const json j = status_of(*d);
        REQUIRE(j["available"].get<bool>());
        CHECK(j["provider"] == provider());
    }
    Clients cl = connect_all(c, "dev", 2, 8 << 20);
    std::vector<std::unique_ptr<DeviceBuf>> bufs;
    // Local rank 0 of every host allocates through ringd, local rank 1 registers a cudaMalloc buffer.
    for (size_t g = 0; g < cl.size(); ++g) bufs.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), 4 << 20, g % 2 == 0));
    uint64_t seed = 1;
    for (size_t count : {size_t{1000}, size_t{300000}})
        for (DType t : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64})
            for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max}) {
                if (op == ReduceOp::Avg && dtype_is_integer(t)) continue;
                DeviceOp o = prepare(bufs, t, op, count, seed++);
                upload(bufs, o);
                submit(bufs, o);
                wait_and_check(bufs, o);
            }
    // Every registration opened once in each daemon: 2 per host, whatever the number of ops.
    for (auto &d : c.d) {
        const json j = status_of(*d);
        CHECK(j["opens"].get<uint64_t>() == 2);
        CHECK(j["registrations"].get<uint64_t>() == 2);
        CHECK(j["closes"].get<uint64_t>() == 0);
    }
    const auto out = run_command(env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + c.d[1]->socket() + " status");
    CHECK(out.exit_code == 0);
    CHECK_THAT(out.output, Catch::Contains("cuda: " + provider() + " provider") && Catch::Contains("2 open(s), 0 close(s)") &&
                        Catch::Contains("  GPU 0 GPU-"));
    bufs.clear();
    cl.clear();
    CHECK(all_closed(c));
}

TEST_CASE("reduce_scatter and allgather of device buffers: ranks 2 and 1 per host numbered unlike the ring, every "
          "dtype x op, in place, apart and into another registration, in one part and in many, exact with guard bytes",
          "[cuda][collectives]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    // Host 0 has ranks 2 and 0, host 1 rank 1. Each rank's inputs (and in-place outputs) are in
    // one device buffer (rank 2's from ringd_cuda_alloc), its outputs apart in another registration.
    std::vector<Trainer> tr = join_ranked(c, "devcoll", {2, 1}, {2, 0, 1}, 1 << 20);
    REQUIRE(tr.size() == 3);
    constexpr size_t kBuf = 256 << 10;
    std::vector<std::unique_ptr<DeviceBuf>> bufs, outs;
    for (size_t g = 0; g < tr.size(); ++g) {
        bufs.push_back(std::make_unique<DeviceBuf>(tr[g].c.get(), kBuf, g == 0));
        outs.push_back(std::make_unique<DeviceBuf>(tr[g].c.get(), kBuf, false));
    }
    enum Where { Apart, InPlace, OtherRegistration };
    uint64_t seed = 1, ops = 0, parts = 0;
    // 1000 elements in one part; 3001 in 4 KiB parts (each (3 + 1) x its elements: 128 of f64,
    // 24 parts, cycling through the window's 16 ranges).
    for (auto [count, part_bytes] : {std::pair<size_t, size_t>{1000, 0}, std::pair<size_t, size_t>{3001, 4096}}) {
        for (auto &x : tr) REQUIRE(ringd_set_cuda_part_bytes(x.c.get(), part_bytes) == 0);
        for (uint32_t ti = 0; ti < kDTypeCount; ++ti)
            for (uint32_t oi = 0; oi <= kReduceOpCount; ++oi) {
                const auto t = static_cast<DType>(ti);
                const bool gather = oi == kReduceOpCount;  // the allgather of the dtype
                const auto op = gather ? ReduceOp::Sum : static_cast<ReduceOp>(oi);
                if (op == ReduceOp::Avg && dtype_is_integer(t)) continue;
                const Collective coll = gather ? Collective::Allgather : Collective::ReduceScatter;
                for (Where where : {Apart, InPlace, OtherRegistration}) {
                    INFO(collective_name(coll) << " " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                               << (where == Apart ? " apart" : where == InPlace ? " in place" : " into another registration"));
                    std::vector<Placement> pl;
                    std::vector<std::vector<std::byte>> image(tr.size()), out_image(tr.size());
                    std::vector<uint64_t> tickets(tr.size());
                    for (size_t g = 0; g < tr.size(); ++g) {
                        const Placement p = place(coll, t, count, 3, tr[g].rank, where == InPlace, seed);
                        REQUIRE(p.span_end + bench::kGuardBytes <= kBuf);
                        image[g].assign(kBuf, std::byte{0});
                        fill_ranked(image[g].data(), p, coll, t, count, tr[g].rank, where == InPlace, seed);
                        out_image[g] = image[g];  // the same guard bytes where the output goes
                        REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, image[g].data(), kBuf) == CUDA_SUCCESS);
                        REQUIRE(api()->cuMemcpyHtoD(outs[g]->base, out_image[g].data(), kBuf) == CUDA_SUCCESS);
                        const ringd_coll_cuda d{sizeof(ringd_coll_cuda), static_cast<ringd_collective>(coll),
                                                static_cast<ringd_dtype>(t), static_cast<ringd_op>(op), count,
                                                bufs[g]->at(p.in), (where == OtherRegistration ? outs[g] : bufs[g])->at(p.out), 0, nullptr, nullptr};
                        INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
                        REQUIRE(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == 0);
                        pl.push_back(p);
                    }
                    for (size_t g = 0; g < tr.size(); ++g) {
                        INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
                        REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
                    }
                    for (size_t g = 0; g < tr.size(); ++g) {
                        std::vector<std::byte> in_after(kBuf), out_after(kBuf);
                        REQUIRE(api()->cuMemcpyDtoH(in_after.data(), bufs[g]->base, kBuf) == CUDA_SUCCESS);
                        REQUIRE(api()->cuMemcpyDtoH(out_after.data(), outs[g]->base, kBuf) == CUDA_SUCCESS);
                        const Placement &p = pl[g];
                        INFO("rank " << tr[g].rank);
                        if (where == OtherRegistration) {
                            // Nothing written to the input's buffer past the input, nor to the
                            // output's before the output; checked as one image.
                            const size_t in_end = p.in + p.in_count * dtype_size(t);
                            CHECK(std::memcmp(in_after.data() + in_end, image[g].data() + in_end, kBuf - in_end) == 0);
                            CHECK(std::memcmp(out_after.data(), out_image[g].data(), p.out) == 0);
                            std::memcpy(in_after.data() + p.out, out_after.data() + p.out, kBuf - p.out);
                        } else {
                            CHECK(out_after == out_image[g]);  // the other registration untouched
                        }
                        const Verdict v = check_ranked(in_after.data(), p, coll, t, op, count, 3, tr[g].rank, where == InPlace, seed);
                        CHECK(v.wrong == 0);
                        CHECK(v.guard == 0);
                        CHECK(v.input_changed == 0);
                    }
                    ++seed;
                    ++ops;
                    const uint64_t per = part_bytes ? part_bytes / (dtype_size(t) * 4) : count;
                    parts += (count + per - 1) / per;
                }
            }
    }
    CHECK(ops == 2 * 3 * (6 * 4 - 2 + 6));
    // Each part is a ringd op staged on every rank: 2 on host 0, 1 on host 1.
    CHECK(status_of(*c.d[0])["ops_staged"].get<uint64_t>() == 2 * parts);
    CHECK(status_of(*c.d[1])["ops_staged"].get<uint64_t>() == parts);
    // What a caller gets wrong, named to it alone; the group goes on.
    ringd_client *r0 = tr[1].c.get();  // rank 0
    uint64_t ticket = 0;
    ringd_coll_cuda bad{sizeof(ringd_coll_cuda), RINGD_REDUCE_SCATTER, RINGD_F32, RINGD_SUM, 100, bufs[1]->at(0), bufs[1]->at(400), 0, nullptr, nullptr};
    CHECK(ringd_submit_coll_cuda(r0, &bad, nullptr, &ticket) == -EINVAL);  // rank 0's own block is at 0, not 400
    CHECK_THAT(ringd_last_error(r0), Catch::Contains("overlaps its input") && Catch::Contains("rank 0's own block"));
    bad.output = reinterpret_cast<void *>(outs[1]->base + kBuf - 200);
    CHECK(ringd_submit_coll_cuda(r0, &bad, nullptr, &ticket) == -ENOENT);
    CHECK_THAT(ringd_last_error(r0), Catch::Contains("output device buffer") && Catch::Contains("no registration"));
    bad.output = nullptr;
    CHECK(ringd_submit_coll_cuda(r0, &bad, nullptr, &ticket) == -EINVAL);
    Clients unranked = connect_all(c, "unranked", 1, 1 << 20);
    DeviceBuf ub(unranked[0]->get(), 4096, false);
    ringd_coll_cuda ag{sizeof(ringd_coll_cuda), RINGD_ALLGATHER, RINGD_F32, RINGD_SUM, 10, ub.at(0), ub.at(1024), 0, nullptr, nullptr};
    CHECK(ringd_submit_coll_cuda(unranked[0]->get(), &ag, nullptr, &ticket) == -EINVAL);
    CHECK_THAT(ringd_last_error(unranked[0]->get()), Catch::Contains("needs this trainer's rank"));
}

TEST_CASE("broadcast and reduce of device buffers: ranks 2 and 1 per host numbered unlike the ring, roots on every "
          "rank, every dtype x op, in one part and in many: exact, the buffers that are only read untouched, guard bytes "
          "intact",
          "[cuda][collectives]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    std::vector<Trainer> tr = join_ranked(c, "devroot", {2, 1}, {2, 0, 1}, 1 << 20);
    REQUIRE(tr.size() == 3);
    constexpr size_t kBuf = 128 << 10;
    std::vector<std::unique_ptr<DeviceBuf>> bufs;
    for (size_t g = 0; g < tr.size(); ++g) bufs.push_back(std::make_unique<DeviceBuf>(tr[g].c.get(), kBuf, g == 1));
    const unsigned have = ringd_cuda_collectives();
    CHECK((have & (1u << RINGD_BROADCAST)) != 0);
    CHECK((have & (1u << RINGD_REDUCE)) != 0);
    CHECK((have & (1u << RINGD_ALL_TO_ALL)) != 0);  // (equal blocks: the next case)
    CHECK((have & (1u << RINGD_BARRIER)) == 0);
    uint64_t seed = 1, ops = 0;
    // What each host's ringd copies off and onto the devices: only what the op reads and writes.
    const std::pair<uint64_t, uint64_t> before[2] = {staged_bytes(*c.d[0]), staged_bytes(*c.d[1])};
    uint64_t want_in[2] = {0, 0}, want_out[2] = {0, 0};
    // 1000 elements in one part; 3001 in 4 KiB parts (up to 1024 elements each).
    for (auto [count, part_bytes] : {std::pair<size_t, size_t>{1000, 0}, std::pair<size_t, size_t>{3001, 4096}}) {
        for (auto &x : tr) REQUIRE(ringd_set_cuda_part_bytes(x.c.get(), part_bytes) == 0);
        for (Collective coll : {Collective::Broadcast, Collective::Reduce})
            for (uint32_t ti = 0; ti < kDTypeCount; ++ti)
                for (uint32_t oi = 0; oi < kReduceOpCount; ++oi) {
                    const auto t = static_cast<DType>(ti);
                    const auto op = static_cast<ReduceOp>(oi);
                    if (op == ReduceOp::Avg && dtype_is_integer(t)) continue;
                    if (coll == Collective::Broadcast && op != ReduceOp::Sum) continue;
                    const uint32_t root = static_cast<uint32_t>(seed % 3);  // every rank in turn
                    INFO(collective_name(coll) << " " << dtype_name(t) << " " << reduce_op_name(op) << " count " << count
                                               << " root " << root);
                    const size_t es = dtype_size(t);
                    std::vector<std::vector<std::byte>> image(tr.size());
                    std::vector<size_t> at(tr.size());
                    std::vector<uint64_t> tickets(tr.size());
                    for (size_t g = 0; g < tr.size(); ++g) {
                        at[g] = bench::kGuardBytes + ((seed + tr[g].rank * 7) % 64) * 8;
                        REQUIRE(at[g] + count * es + bench::kGuardBytes <= kBuf);
                        image[g].assign(kBuf, std::byte{0});
                        bench::guard_fill(image[g].data(), 0, kBuf, seed + g);
                        for (size_t i = 0; i < count; ++i)
                            bench::store(image[g].data() + at[g], i, t, static_cast<double>(bench::value(tr[g].rank, i)));
                        REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, image[g].data(), kBuf) == CUDA_SUCCESS);
                        const ringd_coll_cuda d{sizeof(ringd_coll_cuda), static_cast<ringd_collective>(coll),
                                                static_cast<ringd_dtype>(t), static_cast<ringd_op>(op), count,
                                                bufs[g]->at(at[g]), nullptr, root, nullptr, nullptr};
                        INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
                        REQUIRE(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == 0);
                    }
                    for (size_t g = 0; g < tr.size(); ++g) {
                        INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
                        REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
                    }
                    for (size_t g = 0; g < tr.size(); ++g) {
                        std::vector<std::byte> after(kBuf);
                        REQUIRE(api()->cuMemcpyDtoH(after.data(), bufs[g]->base, kBuf) == CUDA_SUCCESS);
                        const uint32_t rank = tr[g].rank;
                        INFO("rank " << rank);
                        // What must change: a broadcast's buffer on the others, a reduce's on the
                        // root. Everything else (the root's broadcast, the others' reduce, the
                        // bytes around every range) is as it was.
                        const bool written = coll == Collective::Broadcast ? rank != root : rank == root;
                        const bool read = coll == Collective::Reduce || rank == root;
                        want_in[g < 2 ? 0 : 1] += read ? count * es : 0;
                        want_out[g < 2 ? 0 : 1] += written ? count * es : 0;
                        if (written) {
                            CHECK(bench::collective_wrong(coll, after.data() + at[g], count, t, op, 3, rank, root) == 0);
                            CHECK(std::memcmp(after.data(), image[g].data(), at[g]) == 0);
                            const size_t end = at[g] + count * es;
                            CHECK(std::memcmp(after.data() + end, image[g].data() + end, kBuf - end) == 0);
                        } else {
                            CHECK(after == image[g]);
                        }
                    }
                    ++seed;
                    ++ops;
                }
    }
    CHECK(ops == 2 * (6 + (6 * 4 - 2)));
    for (int h = 0; h < 2; ++h) {
        const auto [in, out] = staged_bytes(*c.d[h]);
        INFO("host " << h);
        CHECK(in - before[h].first == want_in[h]);
        CHECK(out - before[h].second == want_out[h]);
    }
    // What a caller gets wrong (a bad root, an output apart, a barrier), named to it alone; the
    // group goes on.
    ringd_client *r0 = tr[1].c.get();  // rank 0
    uint64_t ticket = 0;
    ringd_coll_cuda bad{sizeof(ringd_coll_cuda), RINGD_BROADCAST, RINGD_F32, RINGD_SUM, 100, bufs[1]->at(4096), nullptr, 3, nullptr, nullptr};
    CHECK(ringd_submit_coll_cuda(r0, &bad, nullptr, &ticket) == -EINVAL);
    CHECK_THAT(ringd_last_error(r0), Catch::Contains("root rank 3 in a group of 3"));
    bad.root = 0;
    bad.output = bufs[1]->at(8192);
    CHECK(ringd_submit_coll_cuda(r0, &bad, nullptr, &ticket) == -EINVAL);
    CHECK_THAT(ringd_last_error(r0), Catch::Contains("in place"));
    bad.collective = RINGD_BARRIER;
    bad.output = nullptr;
    CHECK(ringd_submit_coll_cuda(r0, &bad, nullptr, &ticket) == -EINVAL);
    CHECK_THAT(ringd_last_error(r0), Catch::Contains("slot buffers only"));
    // A caller built before the root field (a smaller struct_size) names no root: its broadcast
    // or reduce is refused, not run from rank 0; its reduce_scatter still runs as before.
    bad = ringd_coll_cuda{offsetof(ringd_coll_cuda, root), RINGD_REDUCE, RINGD_F32, RINGD_SUM, 100, bufs[1]->at(4096), nullptr, 0, nullptr, nullptr};
    CHECK(ringd_submit_coll_cuda(r0, &bad, nullptr, &ticket) == -EINVAL);
    CHECK_THAT(ringd_last_error(r0), Catch::Contains("needs its root"));
    // The group still runs: a reduce to rank 0 after the refusals, then a reduce_scatter from
    // callers of the smaller struct.
    std::vector<uint64_t> tickets(tr.size());
    for (size_t g = 0; g < tr.size(); ++g) {
        std::vector<std::byte> image(kBuf);
        for (size_t i = 0; i < 100; ++i) bench::store(image.data() + 4096, i, DType::F32, static_cast<double>(bench::value(tr[g].rank, i)));
        REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, image.data(), kBuf) == CUDA_SUCCESS);
        const ringd_coll_cuda d{sizeof(ringd_coll_cuda), RINGD_REDUCE, RINGD_F32, RINGD_SUM, 100, bufs[g]->at(4096), nullptr, 0, nullptr, nullptr};
        INFO(ringd_last_error(tr[g].c.get()));
        REQUIRE(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == 0);
    }
    for (size_t g = 0; g < tr.size(); ++g) {
        INFO(ringd_last_error(tr[g].c.get()));
        REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
    }
    std::vector<std::byte> after(kBuf);
    REQUIRE(api()->cuMemcpyDtoH(after.data(), bufs[1]->base, kBuf) == CUDA_SUCCESS);  // rank 0's
    CHECK(bench::collective_wrong(Collective::Reduce, after.data() + 4096, 100, DType::F32, ReduceOp::Sum, 3, 0, 0) == 0);
    for (size_t g = 0; g < tr.size(); ++g) {
        std::vector<std::byte> image(kBuf);
        for (size_t i = 0; i < 300; ++i) bench::store(image.data() + 4096, i, DType::F32, static_cast<double>(bench::value(tr[g].rank, i)));
        REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, image.data(), kBuf) == CUDA_SUCCESS);
        const ringd_coll_cuda d{offsetof(ringd_coll_cuda, root), RINGD_REDUCE_SCATTER, RINGD_F32, RINGD_SUM, 100,
                                bufs[g]->at(4096), bufs[g]->at(16384), 0, nullptr, nullptr};
        INFO(ringd_last_error(tr[g].c.get()));
        REQUIRE(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == 0);
    }
    for (size_t g = 0; g < tr.size(); ++g) {
        INFO(ringd_last_error(tr[g].c.get()));
        REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
        REQUIRE(api()->cuMemcpyDtoH(after.data(), bufs[g]->base, kBuf) == CUDA_SUCCESS);
        CHECK(bench::collective_wrong(Collective::ReduceScatter, after.data() + 16384, 300, DType::F32, ReduceOp::Sum, 3,
                                      tr[g].rank, 0) == 0);
    }
}

TEST_CASE("all_to_all of device buffers, equal blocks: ranks 2 and 1 per host numbered unlike the ring, every dtype, "
          "into the same registration and another, in one part and in many: exact, the input and the bytes around "
          "untouched",
          "[cuda][collectives]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    std::vector<Trainer> tr = join_ranked(c, "deva2a", {2, 1}, {2, 0, 1}, 1 << 20);
    REQUIRE(tr.size() == 3);
    constexpr size_t kBuf = 128 << 10;
    std::vector<std::unique_ptr<DeviceBuf>> bufs, outs;
    for (size_t g = 0; g < tr.size(); ++g) {
        bufs.push_back(std::make_unique<DeviceBuf>(tr[g].c.get(), kBuf, g == 2));
        outs.push_back(std::make_unique<DeviceBuf>(tr[g].c.get(), kBuf, false));
    }
    const std::pair<uint64_t, uint64_t> before[2] = {staged_bytes(*c.d[0]), staged_bytes(*c.d[1])};
    uint64_t want[2] = {0, 0};
    uint64_t seed = 1, ops = 0;
    // 1000 elements a block in one part; 1501 in 4 KiB parts (each 2 x 3 x its elements).
    for (auto [count, part_bytes] : {std::pair<size_t, size_t>{1000, 0}, std::pair<size_t, size_t>{1501, 4096}}) {
        for (auto &x : tr) REQUIRE(ringd_set_cuda_part_bytes(x.c.get(), part_bytes) == 0);
        for (uint32_t ti = 0; ti < kDTypeCount; ++ti)
            for (bool other : {false, true}) {
                const auto t = static_cast<DType>(ti);
                const size_t es = dtype_size(t), n = 3 * count;
                INFO("all_to_all " << dtype_name(t) << " count " << count << (other ? " into another registration" : ""));
                std::vector<std::vector<std::byte>> image(tr.size()), out_image(tr.size());
                std::vector<size_t> in_at(tr.size()), out_at(tr.size());
                std::vector<uint64_t> tickets(tr.size());
                for (size_t g = 0; g < tr.size(); ++g) {
                    in_at[g] = bench::kGuardBytes + ((seed + tr[g].rank * 7) % 64) * 8;
                    out_at[g] = other ? bench::kGuardBytes + 512 : (in_at[g] + n * es + bench::kGuardBytes + 255) / 256 * 256;
                    REQUIRE(out_at[g] + n * es + bench::kGuardBytes <= kBuf);
                    image[g].assign(kBuf, std::byte{0});
                    bench::guard_fill(image[g].data(), 0, kBuf, seed + g);
                    out_image[g].assign(kBuf, std::byte{0});
                    bench::guard_fill(out_image[g].data(), 0, kBuf, seed + 7 + g);
                    for (size_t i = 0; i < n; ++i)
                        bench::store(image[g].data() + in_at[g], i, t, static_cast<double>(bench::value(tr[g].rank, i)));
                    REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, image[g].data(), kBuf) == CUDA_SUCCESS);
                    REQUIRE(api()->cuMemcpyHtoD(outs[g]->base, out_image[g].data(), kBuf) == CUDA_SUCCESS);
                    const ringd_coll_cuda d{sizeof(ringd_coll_cuda), RINGD_ALL_TO_ALL, static_cast<ringd_dtype>(t), RINGD_SUM,
                                            count, bufs[g]->at(in_at[g]), (other ? outs[g] : bufs[g])->at(out_at[g]), 0, nullptr, nullptr};
                    INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
                    REQUIRE(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == 0);
                    want[g < 2 ? 0 : 1] += n * es;
                }
                for (size_t g = 0; g < tr.size(); ++g) {
                    INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
                    REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
                }
                for (size_t g = 0; g < tr.size(); ++g) {
                    std::vector<std::byte> in_after(kBuf), out_after(kBuf);
                    REQUIRE(api()->cuMemcpyDtoH(in_after.data(), bufs[g]->base, kBuf) == CUDA_SUCCESS);
                    REQUIRE(api()->cuMemcpyDtoH(out_after.data(), outs[g]->base, kBuf) == CUDA_SUCCESS);
                    INFO("rank " << tr[g].rank);
                    std::vector<std::byte> &got = other ? out_after : in_after;
                    std::vector<std::byte> &was = other ? out_image[g] : image[g];
                    CHECK(bench::collective_wrong(Collective::AllToAll, got.data() + out_at[g], n, t, ReduceOp::Sum, 3, tr[g].rank, 0) == 0);
                    // Everything but the output as it was: the guards, the input, the other buffer.
                    std::memcpy(got.data() + out_at[g], was.data() + out_at[g], n * es);
                    CHECK(in_after == image[g]);
                    CHECK(out_after == out_image[g]);
                }
                ++seed;
                ++ops;
            }
    }
    CHECK(ops == 2 * 6 * 2);
    for (int h = 0; h < 2; ++h) {
        const auto [in, out] = staged_bytes(*c.d[h]);
        INFO("host " << h);
        CHECK(in - before[h].first == want[h]);
        CHECK(out - before[h].second == want[h]);
    }
    // An output that overlaps the input is refused, named to its caller; the group goes on.
    ringd_client *r0 = tr[1].c.get();
    uint64_t ticket = 0;
    const ringd_coll_cuda bad{sizeof(ringd_coll_cuda), RINGD_ALL_TO_ALL, RINGD_F32, RINGD_SUM, 100, bufs[1]->at(4096),
                              bufs[1]->at(4096 + 400), 0, nullptr, nullptr};
    CHECK(ringd_submit_coll_cuda(r0, &bad, nullptr, &ticket) == -EINVAL);
    CHECK_THAT(ringd_last_error(r0), Catch::Contains("overlaps its input"));
}

TEST_CASE("all_to_all of device buffers with split sizes: ranks 2 and 1 per host numbered unlike the ring, uneven "
          "blocks with zeros (a rank that sends nothing), every dtype, into the same registration and another: exact, the "
          "input and the bytes around untouched; one that does not fit the staging is refused in its place",
          "[cuda][collectives]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    std::vector<Trainer> tr = join_ranked(c, "deva2av", {2, 1}, {2, 0, 1}, 1 << 20);
    REQUIRE(tr.size() == 3);
    REQUIRE(ringd_cuda_all_to_all_splits() != 0);
    {
        auto st = fetch_status(c.d[0]->socket());
        REQUIRE(st.ok());
        CHECK(json::parse(*st)["device_all_to_all_splits"] == true);
    }
    constexpr size_t kBuf = 128 << 10;
    constexpr uint32_t n = 3;
    std::vector<std::unique_ptr<DeviceBuf>> bufs, outs;
    for (size_t g = 0; g < tr.size(); ++g) {
        bufs.push_back(std::make_unique<DeviceBuf>(tr[g].c.get(), kBuf, g == 2));
        outs.push_back(std::make_unique<DeviceBuf>(tr[g].c.get(), kBuf, false));
    }
    const std::pair<uint64_t, uint64_t> before[2] = {staged_bytes(*c.d[0]), staged_bytes(*c.d[1])};
    uint64_t want_in[2] = {0, 0}, want_out[2] = {0, 0};
    uint64_t ops = 0;
    for (uint64_t seed = 1; seed <= 2; ++seed)
        for (uint32_t ti = 0; ti < kDTypeCount; ++ti)
            for (bool other : {false, true}) {
                const auto t = static_cast<DType>(ti);
                const size_t es = dtype_size(t);
                // sizes[q][r]: what rank q sends rank r; a quarter of them 0, and in the second
                // round rank 1 sends nothing at all.
                uint64_t sizes[n][n];
                for (uint32_t q = 0; q < n; ++q)
                    for (uint32_t r = 0; r < n; ++r)
                        sizes[q][r] = (q + 2 * r + seed + ti) % 4 == 0 || (seed == 2 && q == 1) ? 0 : 1 + (q * 301 + r * 97 + seed * 13 + ti * 7) % 2000;
                auto sent_before = [&](uint32_t q, uint32_t r) {  // rank q's input elements before its block for r
                    uint64_t a = 0;
                    for (uint32_t k = 0; k < r; ++k) a += sizes[q][k];
                    return a;
                };
                INFO("all_to_all with split sizes " << dtype_name(t) << " round " << seed << (other ? " into another registration" : ""));
                std::vector<std::vector<std::byte>> image(tr.size()), out_image(tr.size());
                std::vector<size_t> in_at(tr.size()), out_at(tr.size()), in_n(tr.size()), out_n(tr.size());
                std::vector<uint64_t> tickets(tr.size());
                for (size_t g = 0; g < tr.size(); ++g) {
                    const uint32_t me = tr[g].rank;
                    uint64_t send[n], recv[n];
                    in_n[g] = out_n[g] = 0;
                    for (uint32_t r = 0; r < n; ++r) {
                        send[r] = sizes[me][r], recv[r] = sizes[r][me];
                        in_n[g] += send[r], out_n[g] += recv[r];
                    }
                    in_at[g] = bench::kGuardBytes + ((seed + me * 7) % 64) * 8;
                    out_at[g] = other ? bench::kGuardBytes + 512 : (in_at[g] + in_n[g] * es + bench::kGuardBytes + 255) / 256 * 256;
                    REQUIRE(out_at[g] + out_n[g] * es + bench::kGuardBytes <= kBuf);
                    image[g].assign(kBuf, std::byte{0});
                    bench::guard_fill(image[g].data(), 0, kBuf, seed + g + ti);
                    out_image[g].assign(kBuf, std::byte{0});
                    bench::guard_fill(out_image[g].data(), 0, kBuf, seed + 7 + g + ti);
                    for (size_t i = 0; i < in_n[g]; ++i)
                        bench::store(image[g].data() + in_at[g], i, t, static_cast<double>(bench::value(me, i)));
                    REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, image[g].data(), kBuf) == CUDA_SUCCESS);
                    REQUIRE(api()->cuMemcpyHtoD(outs[g]->base, out_image[g].data(), kBuf) == CUDA_SUCCESS);
                    const ringd_coll_cuda d{sizeof(ringd_coll_cuda), RINGD_ALL_TO_ALL, static_cast<ringd_dtype>(t), RINGD_SUM, 0,
                                            bufs[g]->at(in_at[g]), (other ? outs[g] : bufs[g])->at(out_at[g]), 0, send, recv};
                    INFO("rank " << me << ": " << ringd_last_error(tr[g].c.get()));
                    REQUIRE(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == 0);
                    want_in[g < 2 ? 0 : 1] += in_n[g] * es;
                    want_out[g < 2 ? 0 : 1] += out_n[g] * es;
                }
                for (size_t g = 0; g < tr.size(); ++g) {
                    INFO("rank " << tr[g].rank << ": " << ringd_last_error(tr[g].c.get()));
                    REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
                }
                for (size_t g = 0; g < tr.size(); ++g) {
                    const uint32_t me = tr[g].rank;
                    std::vector<std::byte> in_after(kBuf), out_after(kBuf);
                    REQUIRE(api()->cuMemcpyDtoH(in_after.data(), bufs[g]->base, kBuf) == CUDA_SUCCESS);
                    REQUIRE(api()->cuMemcpyDtoH(out_after.data(), outs[g]->base, kBuf) == CUDA_SUCCESS);
                    INFO("rank " << me);
                    // The output: rank q's block for this rank, in rank order, every byte; everything
                    // else (the guards, the input, the other buffer) as it was.
                    std::vector<std::byte> &was = other ? out_image[g] : image[g];
                    std::vector<std::byte> want = was;
                    uint64_t at = 0;
                    for (uint32_t q = 0; q < n; ++q)
                        for (uint64_t i = 0; i < sizes[q][me]; ++i, ++at)
                            bench::store(want.data() + out_at[g], at, t, static_cast<double>(bench::value(q, sent_before(q, me) + i)));
                    REQUIRE(at == out_n[g]);
                    CHECK((other ? out_after : in_after) == want);
                    CHECK((other ? in_after : out_after) == (other ? image[g] : out_image[g]));
                }
                ++ops;
            }
    CHECK(ops == 2 * kDTypeCount * 2);
    for (int h = 0; h < 2; ++h) {
        const auto [in, out] = staged_bytes(*c.d[h]);
        INFO("host " << h);
        CHECK(in - before[h].first == want_in[h]);
        CHECK(out - before[h].second == want_out[h]);
    }
    // Sizes that do not fit rank 0's staging (the 1 MiB slot): refused on it before anything is
    // taken; it refuses the op in its place, and the others' op fails at once naming it.
    {
        uint64_t big_send[n] = {0, 100000, 100000}, big_recv[n] = {0, 100000, 100000};  // 800 KB each way
        size_t g0 = 0;
        while (tr[g0].rank != 0) ++g0;
        uint64_t send[n] = {0, 10, 10}, recv[n] = {0, 10, 10};
        std::vector<uint64_t> tickets(tr.size());
        for (size_t g = 0; g < tr.size(); ++g) {
            const uint32_t me = tr[g].rank;
            if (me == 0) {
                DeviceBuf large(tr[g].c.get(), 2 << 20, false);
                const ringd_coll_cuda d{sizeof(ringd_coll_cuda), RINGD_ALL_TO_ALL, RINGD_F32, RINGD_SUM, 0,
                                        large.at(0), large.at(1 << 20), 0, big_send, big_recv};
                CHECK(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == -E2BIG);
                CHECK_THAT(ringd_last_error(tr[g].c.get()), Catch::Contains("staged whole and does not fit"));
                REQUIRE(ringd_refuse(tr[g].c.get(), RINGD_ALL_TO_ALL, 1600128, &tickets[g]) == 0);
                continue;
            }
            send[0] = recv[0] = 0;
            const ringd_coll_cuda d{sizeof(ringd_coll_cuda), RINGD_ALL_TO_ALL, RINGD_F32, RINGD_SUM, 0,
                                    bufs[g]->at(0), outs[g]->at(0), 0, send, recv};
            REQUIRE(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == 0);
        }
        for (size_t g = 0; g < tr.size(); ++g) {
            INFO("rank " << tr[g].rank);
            CHECK(ringd_wait(tr[g].c.get(), tickets[g], 20000) == -E2BIG);
            CHECK_THAT(ringd_last_error(tr[g].c.get()), Catch::Contains("host node0 local rank " + std::to_string(g0) + " refused it") &&
                                                            Catch::Contains("1600128"));
        }
    }
    // The group goes on: the same op that fits, exact on every rank.
    {
        uint64_t send[n] = {5, 6, 7};
        std::vector<uint64_t> tickets(tr.size());
        for (size_t g = 0; g < tr.size(); ++g) {
            uint64_t recv[n] = {send[tr[g].rank], send[tr[g].rank], send[tr[g].rank]};
            std::vector<std::byte> img(kBuf);
            for (size_t i = 0; i < 18; ++i) bench::store(img.data(), i, DType::F32, static_cast<double>(bench::value(tr[g].rank, i)));
            REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, img.data(), kBuf) == CUDA_SUCCESS);
            const ringd_coll_cuda d{sizeof(ringd_coll_cuda), RINGD_ALL_TO_ALL, RINGD_F32, RINGD_SUM, 0,
                                    bufs[g]->at(0), outs[g]->at(0), 0, send, recv};
            INFO(ringd_last_error(tr[g].c.get()));
            REQUIRE(ringd_submit_coll_cuda(tr[g].c.get(), &d, nullptr, &tickets[g]) == 0);
        }
        for (size_t g = 0; g < tr.size(); ++g) {
            const uint32_t me = tr[g].rank;
            INFO("rank " << me << ": " << ringd_last_error(tr[g].c.get()));
            REQUIRE(ringd_wait(tr[g].c.get(), tickets[g], 20000) == 0);
            std::vector<std::byte> got(3 * send[me] * 4), want(got.size());
            REQUIRE(api()->cuMemcpyDtoH(got.data(), outs[g]->base, got.size()) == CUDA_SUCCESS);
            uint64_t at = 0;
            for (uint32_t q = 0; q < n; ++q) {
                const uint64_t from = (me >= 1 ? send[0] : 0) + (me >= 2 ? send[1] : 0);
                for (uint64_t i = 0; i < send[me]; ++i, ++at)
                    bench::store(want.data(), at, DType::F32, static_cast<double>(bench::value(q, from + i)));
            }
            CHECK(got == want);
        }
    }
    // What a caller gets wrong is named to it alone: sizes without their other half, sizes of
    // another collective, a count beside sizes.
    ringd_client *r1 = tr[1].c.get();
    uint64_t ticket = 0, some[n] = {1, 1, 1};
    ringd_coll_cuda bad{sizeof(ringd_coll_cuda), RINGD_ALL_TO_ALL, RINGD_F32, RINGD_SUM, 0, bufs[1]->at(0), outs[1]->at(0), 0, some, nullptr};
    CHECK(ringd_submit_coll_cuda(r1, &bad, nullptr, &ticket) == -EINVAL);
    CHECK_THAT(ringd_last_error(r1), Catch::Contains("go together"));
    bad.recv_counts = some;
    bad.collective = RINGD_ALLGATHER;
    CHECK(ringd_submit_coll_cuda(r1, &bad, nullptr, &ticket) == -EINVAL);
    bad.collective = RINGD_ALL_TO_ALL;
    bad.count = 3;
    CHECK(ringd_submit_coll_cuda(r1, &bad, nullptr, &ticket) == -EINVAL);
    CHECK_THAT(ringd_last_error(r1), Catch::Contains("count 0"));
}

TEST_CASE("a delayed producer stream still gives exact results", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    Clients cl = connect_all(c, "order", 2, 8 << 20);
    std::vector<std::unique_ptr<DeviceBuf>> bufs;
    for (size_t g = 0; g < cl.size(); ++g) bufs.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), 4 << 20, g % 2 == 1));
    std::vector<CUstream> streams(cl.size());
    for (auto &s : streams) REQUIRE(api()->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    for (uint64_t round = 0; round < 3; ++round) {
        DeviceOp o = prepare(bufs, DType::F32, ReduceOp::Sum, 200000, 40 + round);
        // What the device holds until the producer's copy runs: other data. Copied too early, it
        // would give a wrong sum.
        DeviceOp stale = prepare(bufs, DType::F32, ReduceOp::Sum, 200000, 40 + round);
        for (size_t g = 0; g < bufs.size(); ++g) stale.range[g].prepare(stale.image[g].data(), g + 17);
        upload(bufs, stale);
        const auto t0 = Clock::now();
        // Pinned host memory: copies from and to it are asynchronous on a real GPU too.
        std::vector<unsigned char *> in(bufs.size()), out(bufs.size());
        for (size_t g = 0; g < bufs.size(); ++g) {
            void *p = nullptr, *q = nullptr;
            REQUIRE(api()->cuMemAllocHost(&p, bufs[g]->bytes) == CUDA_SUCCESS);
            REQUIRE(api()->cuMemAllocHost(&q, bufs[g]->bytes) == CUDA_SUCCESS);
            in[g] = static_cast<unsigned char *>(p);
            out[g] = static_cast<unsigned char *>(q);
            std::memcpy(in[g], o.image[g].data(), bufs[g]->bytes);
        }
        for (size_t g = 0; g < bufs.size(); ++g) {
            // The producer runs 50 ms late: a kernel holds the stream, then the gradient lands.
            spin(streams[g], 50000);
            REQUIRE(api()->cuMemcpyHtoDAsync(bufs[g]->base, in[g], bufs[g]->bytes, streams[g]) == CUDA_SUCCESS);
            INFO(ringd_last_error(bufs[g]->c));
            REQUIRE(ringd_submit_cuda(bufs[g]->c, bufs[g]->at(o.range[g].offset), o.count, RINGD_F32, RINGD_SUM,
                                      streams[g], &o.tickets[g]) == 0);
            // The consumer: after the result, in the stream's order.
            REQUIRE(ringd_stream_wait(bufs[g]->c, o.tickets[g], streams[g]) == 0);
            REQUIRE(api()->cuMemcpyDtoHAsync(out[g], bufs[g]->base, bufs[g]->bytes, streams[g]) == CUDA_SUCCESS);
        }
        for (size_t g = 0; g < bufs.size(); ++g) REQUIRE(api()->cuStreamSynchronize(streams[g]) == CUDA_SUCCESS);
        CHECK(seconds_since(t0) >= 0.045);
        for (size_t g = 0; g < bufs.size(); ++g) {
            CHECK(ringd_wait(bufs[g]->c, o.tickets[g], 20000) == 0);
            const auto v = o.range[g].check(out[g], ReduceOp::Sum, bufs.size());
            INFO("round " << round << " rank " << g);
            CHECK(v.wrong == 0);
            CHECK(v.guard == 0);
            api()->cuMemFreeHost(in[g]);
            api()->cuMemFreeHost(out[g]);
        }
    }
    for (auto &s : streams) api()->cuStreamDestroy(s);
}

TEST_CASE("a large device op goes as pipelined parts, exact", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    // Parts of 64 KiB through a window of at most 16 of them: 300000 elements are 10 parts of
    // f16, 37 of f64 (ranges used again as the parts before them end).
    ::setenv("RINGD_CUDA_PART_BYTES", "65536", 1);
    Clients cl = connect_all(c, "parts", 2, 8 << 20);
    std::vector<std::unique_ptr<DeviceBuf>> bufs;
    for (size_t g = 0; g < cl.size(); ++g) bufs.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), 4 << 20, g % 2 == 0));
    ::unsetenv("RINGD_CUDA_PART_BYTES");
    uint64_t seed = 300, staged = 0;
    for (DType t : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64})
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max}) {
            if (op == ReduceOp::Avg && dtype_is_integer(t)) continue;
            DeviceOp o = prepare(bufs, t, op, 300000, seed++);
            upload(bufs, o);
            submit(bufs, o);
            wait_and_check(bufs, o);
            const uint64_t per = 65536 / dtype_size(t);
            staged += (300000 + per - 1) / per;
        }
    for (auto &d : c.d) CHECK(status_of(*d)["ops_staged"].get<uint64_t>() == staged * 2);
    // In stream order: a late producer, the parts, a wait for the whole op, the consumer's copy.
    CUstream s = nullptr;
    REQUIRE(api()->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    DeviceOp o = prepare(bufs, DType::F32, ReduceOp::Sum, 800000, 77);
    DeviceOp stale = prepare(bufs, DType::F32, ReduceOp::Sum, 800000, 77);
    for (size_t g = 0; g < bufs.size(); ++g) stale.range[g].prepare(stale.image[g].data(), g + 9);
    upload(bufs, stale);
    std::vector<CUstream> streams(bufs.size());
    std::vector<void *> in(bufs.size()), out(bufs.size());
    for (size_t g = 0; g < bufs.size(); ++g) {
        REQUIRE(api()->cuStreamCreate(&streams[g], CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
        REQUIRE(api()->cuMemAllocHost(&in[g], bufs[g]->bytes) == CUDA_SUCCESS);
        REQUIRE(api()->cuMemAllocHost(&out[g], bufs[g]->bytes) == CUDA_SUCCESS);
        std::memcpy(in[g], o.image[g].data(), bufs[g]->bytes);
        spin(streams[g], 30000);
        REQUIRE(api()->cuMemcpyHtoDAsync(bufs[g]->base, in[g], bufs[g]->bytes, streams[g]) == CUDA_SUCCESS);
        REQUIRE(ringd_submit_cuda(bufs[g]->c, bufs[g]->at(o.range[g].offset), o.count, RINGD_F32, RINGD_SUM, streams[g],
                                  &o.tickets[g]) == 0);
        REQUIRE(ringd_stream_wait(bufs[g]->c, o.tickets[g], streams[g]) == 0);
        REQUIRE(api()->cuMemcpyDtoHAsync(out[g], bufs[g]->base, bufs[g]->bytes, streams[g]) == CUDA_SUCCESS);
    }
    for (size_t g = 0; g < bufs.size(); ++g) {
        REQUIRE(api()->cuStreamSynchronize(streams[g]) == CUDA_SUCCESS);
        CHECK(ringd_wait(bufs[g]->c, o.tickets[g], 20000) == 0);
        INFO("rank " << g);
        CHECK(o.range[g].check(out[g], ReduceOp::Sum, bufs.size()).ok());
        api()->cuMemFreeHost(in[g]);
        api()->cuMemFreeHost(out[g]);
        api()->cuStreamDestroy(streams[g]);
    }
    api()->cuStreamDestroy(s);
}

TEST_CASE("a device op 16 times the slot streams through it, the next op behind it", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("30s", cuda_yaml()));
    REQUIRE(c.wait_up());
    // 512 MiB through a 32 MiB slot (the full matrix; else 128 MiB through 8 MiB): 64 parts of
    // a quarter of the slot (the default) cycling through 4 ranges.
    const size_t slot = (full_matrix() ? size_t{32} : size_t{8}) << 20, kCount = 16 * slot / 4;
    Clients cl = connect_all(c, "stream", 1, slot);
    std::vector<std::unique_ptr<DeviceBuf>> big, small;
    for (size_t g = 0; g < cl.size(); ++g) {
        big.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), kCount * 4 + (64 << 10), g % 2 == 0));
        small.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), 1 << 20, g % 2 == 1));
    }
    DeviceOp o = prepare(big, DType::F32, ReduceOp::Sum, kCount, 901);
    DeviceOp next = prepare(small, DType::F64, ReduceOp::Max, 100000, 902);
    upload(big, o);
    upload(small, next);
    // Both submitted at once: the second waits in the client behind the first's parts.
    submit(big, o);
    submit(small, next);
    for (size_t g = 0; g < cl.size(); ++g) {
        const int rc = ringd_wait(big[g]->c, o.tickets[g], -1);
        INFO("rank " << g << ": " << (rc == 0 ? "" : ringd_last_error(big[g]->c)));
        REQUIRE(rc == 0);
    }
    wait_and_check(small, next);
    for (size_t g = 0; g < cl.size(); ++g) {
        REQUIRE(api()->cuMemcpyDtoH(o.image[g].data(), big[g]->base, big[g]->bytes) == CUDA_SUCCESS);
        INFO("rank " << g);
        const auto v = o.range[g].check(o.image[g].data(), ReduceOp::Sum, cl.size());
        CHECK(v.wrong == 0);
        CHECK(v.guard == 0);
    }
    for (auto &d : c.d) CHECK(status_of(*d)["ops_staged"].get<uint64_t>() == 64 + 1);
    // A part larger than the slot is refused before anything is queued.
    Clients one = connect_all(c, "stream-refused", 1, 32 << 20);
    DeviceBuf b(one[0]->get(), (64 << 20) + 4096, true);
    CHECK(ringd_set_cuda_part_bytes(one[0]->get(), 100) == -EINVAL);
    REQUIRE(ringd_set_cuda_part_bytes(one[0]->get(), 64 << 20) == 0);
    uint64_t t = 0;
    CHECK(ringd_submit_cuda(one[0]->get(), b.at(0), (64 << 20) / 4 + 1, RINGD_F32, RINGD_SUM, nullptr, &t) == -E2BIG);
    CHECK(std::string(ringd_last_error(one[0]->get())).find("RINGD_CUDA_PART_BYTES") != std::string::npos);
}

// Many trainers per host connect with small slots: the default part follows the slot (a quarter of
// it), so a device op of any size streams through it; only a part the caller set too large for
// the slot is refused, naming both sizes.
TEST_CASE("a 64 MiB device op through a 4 MiB slot on 2 hosts x 2 ranks goes as parts the slot holds, exact", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("30s", cuda_yaml()));
    REQUIRE(c.wait_up());
    constexpr size_t kCount = size_t{16} << 20;  // 64 MiB of f32
    Clients cl = connect_all(c, "small-slot", 2, 4 << 20);
    std::vector<std::unique_ptr<DeviceBuf>> bufs;
    for (size_t g = 0; g < cl.size(); ++g)
        bufs.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), kCount * 4 + (64 << 10), g % 2 == 0));
    for (uint64_t seed : {1101u, 1102u}) {
        DeviceOp o = prepare(bufs, seed == 1101 ? DType::F32 : DType::BF16, ReduceOp::Sum, seed == 1101 ? kCount : 2 * kCount, seed);
        upload(bufs, o);
        submit(bufs, o);
        wait_and_check(bufs, o);
    }
    // 1 MiB parts: 64 of each op for each of a host's two ranks.
    for (auto &d : c.d) CHECK(status_of(*d)["ops_staged"].get<uint64_t>() == 2 * 2 * 64);
    // A part set larger than the slot holds is refused before anything is queued, naming both.
    REQUIRE(ringd_set_cuda_part_bytes(cl[0]->get(), 16 << 20) == 0);
    uint64_t t = 0;
    CHECK(ringd_submit_cuda(cl[0]->get(), bufs[0]->at(0), kCount, RINGD_F32, RINGD_SUM, nullptr, &t) == -E2BIG);
    const std::string why = ringd_last_error(cl[0]->get());
    CHECK_THAT(why, Catch::Contains("a part of 16777216 bytes does not fit the 4194304 bytes of the slot"));
    // Back to the default: the same op goes again.
    REQUIRE(ringd_set_cuda_part_bytes(cl[0]->get(), 0) == 0);
}

TEST_CASE("device ops queued in the client: completion room, a slot op behind a window, registrations in use", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    SECTION("120 parts handed over while the trainer only waits on its stream: never more completions than the queue holds") {
        // 4 KiB parts: 8 ops of 60 KiB are 15 parts each, every window placed at once. The
        // trainers read no completion until their streams are done, so only the library's own
        // thread drains: ringd must never have more completions for a client than its queue holds
        // (it drops the client otherwise).
        Clients cl = connect_all(c, "cq-room", 1, 8 << 20);
        std::vector<std::unique_ptr<DeviceBuf>> bufs;
        for (size_t g = 0; g < cl.size(); ++g) {
            bufs.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), 1 << 20, g == 0));
            REQUIRE(ringd_set_cuda_part_bytes(cl[g]->get(), 4096) == 0);
        }
        std::vector<DeviceOp> ops;
        for (int k = 0; k < 8; ++k) {
            ops.push_back(prepare(bufs, DType::F32, ReduceOp::Sum, 15360, 60 + k));
        }
        // prepare() fills each rank's whole buffer image: the ops use disjoint ranges of one image.
        for (size_t g = 0; g < bufs.size(); ++g) {
            std::vector<unsigned char> image(bufs[g]->bytes, 0);
            for (int k = 0; k < 8; ++k) {
                ops[k].range[g] = bench::GuardedRange{bench::kGuardBytes + size_t(k) * (96 << 10), 15360, bufs[g]->bytes,
                                                      DType::F32, uint64_t(60 + k) * 1000003 + g};
                ops[k].range[g].prepare(image.data(), g);
            }
            REQUIRE(api()->cuMemcpyHtoD(bufs[g]->base, image.data(), bufs[g]->bytes) == CUDA_SUCCESS);
        }
        std::vector<CUstream> streams(bufs.size());
        for (size_t g = 0; g < bufs.size(); ++g) {
            REQUIRE(api()->cuStreamCreate(&streams[g], CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
            for (auto &o : ops) {
                INFO(ringd_last_error(bufs[g]->c));
                REQUIRE(ringd_submit_cuda(bufs[g]->c, bufs[g]->at(o.range[g].offset), o.count, RINGD_F32, RINGD_SUM,
                                          streams[g], &o.tickets[g]) == 0);
            }
            REQUIRE(ringd_stream_wait(bufs[g]->c, ops.back().tickets[g], streams[g]) == 0);
        }
        for (size_t g = 0; g < bufs.size(); ++g) REQUIRE(api()->cuStreamSynchronize(streams[g]) == CUDA_SUCCESS);
        for (size_t g = 0; g < bufs.size(); ++g) {
            std::vector<unsigned char> image(bufs[g]->bytes);
            for (auto &o : ops) {
                const int rc = ringd_wait(bufs[g]->c, o.tickets[g], 20000);
                INFO("rank " << g << ": " << (rc == 0 ? "" : ringd_last_error(bufs[g]->c)));
                REQUIRE(rc == 0);
            }
            REQUIRE(api()->cuMemcpyDtoH(image.data(), bufs[g]->base, bufs[g]->bytes) == CUDA_SUCCESS);
            for (auto &o : ops) CHECK(o.range[g].check(image.data(), ReduceOp::Sum, bufs.size()).ok());
            api()->cuStreamDestroy(streams[g]);
        }
        for (auto &d : c.d) CHECK(status_of(*d)["ops_staged"].get<uint64_t>() == 8 * 15);
    }
    SECTION("ops behind a device op's parts wait in the client; its registration stays while parts are to go") {
        // A 96 KiB slot and 64 KiB parts: op A (3 parts, its producer 300 ms late) streams through
        // one range at [0, 64K); op B and a slot op at [80K, 84K) wait in the client behind A's
        // parts, B is placed beside A's range once A's last part went, and the slot op after it.
        Clients cl = connect_all(c, "held-ops", 1, 96 << 10);
        std::vector<std::unique_ptr<DeviceBuf>> abufs, bbufs;
        std::vector<CUstream> streams(cl.size());
        for (size_t g = 0; g < cl.size(); ++g) {
            abufs.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), 1 << 20, g == 1));
            bbufs.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), 1 << 20, g == 0));
            REQUIRE(ringd_set_cuda_part_bytes(cl[g]->get(), 64 << 10) == 0);
            REQUIRE(api()->cuStreamCreate(&streams[g], CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
        }
        DeviceOp a = prepare(abufs, DType::F32, ReduceOp::Max, 40000, 71);  // 160 KB: 3 parts
        DeviceOp b = prepare(bbufs, DType::I32, ReduceOp::Sum, 3000, 72);
        upload(abufs, a);
        upload(bbufs, b);
        for (size_t g = 0; g < cl.size(); ++g) {
            spin(streams[g], 300000);
            REQUIRE(ringd_submit_cuda(abufs[g]->c, abufs[g]->at(a.range[g].offset), a.count, RINGD_F32, RINGD_MAX,
                                      streams[g], &a.tickets[g]) == 0);
        }
        // A's later parts are still to go (its first waits for the late producer): its memory's
        // registration cannot be dropped yet.
        CHECK(ringd_unregister_cuda(abufs[0]->c, abufs[0]->reg) == -EBUSY);
        CHECK(ringd_cuda_free(abufs[1]->c, reinterpret_cast<void *>(abufs[1]->base)) == -EBUSY);
        submit(bbufs, b);
        std::vector<uint64_t> host(cl.size());
        constexpr size_t kHostAt = 80 << 10;
        for (size_t g = 0; g < cl.size(); ++g) {
            auto *p = reinterpret_cast<int64_t *>(cl[g]->slot().data() + kHostAt);
            for (int i = 0; i < 512; ++i) p[i] = int64_t(g + 1) * 1000 + i;
            INFO(ringd_last_error(cl[g]->get()));
            REQUIRE(ringd_submit(cl[g]->get(), kHostAt, 512, RINGD_I64, RINGD_SUM, &host[g]) == 0);
        }
        wait_and_check(abufs, a);
        wait_and_check(bbufs, b);
        for (size_t g = 0; g < cl.size(); ++g) {
            INFO(ringd_last_error(cl[g]->get()));
            REQUIRE(ringd_wait(cl[g]->get(), host[g], 20000) == 0);
            const auto *p = reinterpret_cast<const int64_t *>(cl[g]->slot().data() + kHostAt);
            int wrong = 0;
            for (int i = 0; i < 512; ++i) wrong += p[i] != 3000 + 2 * i;
            CHECK(wrong == 0);
            api()->cuStreamDestroy(streams[g]);
        }
    }
}

TEST_CASE("a thousand ops on one registration open it once", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("10s", cuda_yaml()));
    REQUIRE(c.wait_up());
    Clients cl = connect_all(c, "many", 1, 1 << 20);
    std::vector<std::unique_ptr<DeviceBuf>> bufs;
    bufs.push_back(std::make_unique<DeviceBuf>(cl[0]->get(), 1 << 20, false));
    bufs.push_back(std::make_unique<DeviceBuf>(cl[1]->get(), 1 << 20, true));
    DeviceOp o = prepare(bufs, DType::F32, ReduceOp::Max, 256, 5);  // max: the same result every time
    upload(bufs, o);
    for (int i = 0; i < 1000; ++i) {
        for (size_t g = 0; g < 2; ++g)
            REQUIRE(ringd_submit_cuda(bufs[g]->c, bufs[g]->at(o.range[g].offset), o.count, RINGD_F32, RINGD_MAX, nullptr,
                                      &o.tickets[g]) == 0);
        for (size_t g = 0; g < 2; ++g) {
            INFO("op " << i << ": " << ringd_last_error(bufs[g]->c));
            REQUIRE(ringd_wait(bufs[g]->c, o.tickets[g], 20000) == 0);
        }
    }
    wait_and_check(bufs, (submit(bufs, o), o));
    for (auto &d : c.d) {
        const json j = status_of(*d);
        CHECK(j["opens"].get<uint64_t>() == 1);
        CHECK(j["ops_staged"].get<uint64_t>() == 1001);
    }
}

TEST_CASE("device buffer errors go to their client only", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(1, cuda_cluster("3s", cuda_yaml()));
    Clients cl = connect_all(c, "errs", 1, 1 << 20);
    ringd_client *cc = cl[0]->get();
    CUdeviceptr stray = 0;
    REQUIRE(api()->cuMemAlloc(&stray, 1 << 20) == CUDA_SUCCESS);
    uint64_t t = 0;
    SECTION("a pointer outside every registration") {
        CHECK(ringd_submit_cuda(cc, reinterpret_cast<void *>(stray), 16, RINGD_F32, RINGD_SUM, nullptr, &t) == -ENOENT);
        CHECK_THAT(ringd_last_error(cc), Catch::Contains("no registration"));
    }
    SECTION("a range past its registration, a part set larger than the slot") {
        uint64_t reg = 0;
        REQUIRE(ringd_register_cuda(cc, reinterpret_cast<void *>(stray), 4096, &reg) == 0);
        CHECK(ringd_submit_cuda(cc, reinterpret_cast<void *>(stray + 4000), 100, RINGD_F32, RINGD_SUM, nullptr, &t) == -ENOENT);
        CHECK(ringd_register_cuda(cc, reinterpret_cast<void *>(stray), (1 << 20) + 1, &reg) == -ERANGE);
        void *big = nullptr;
        REQUIRE(ringd_cuda_alloc(cc, 4 << 20, &big) == 0);
        REQUIRE(ringd_set_cuda_part_bytes(cc, 2 << 20) == 0);
        CHECK(ringd_submit_cuda(cc, big, 1 << 19, RINGD_F32, RINGD_SUM, nullptr, &t) == -E2BIG);  // 2 MiB, slot 1 MiB
        CHECK(ringd_cuda_free(cc, big) == 0);
        CHECK(ringd_cuda_free(cc, big) == -ENOENT);
    }
    SECTION("unregistering during an op keeps its mapping until it ends") {
        // Both kinds: a VMM registration is answered at once (the import keeps the memory); a
        // legacy one only once ringd closed the mapping, so that the exporter may free it then.
        Clients two = connect_all(c, "unreg", 2, 1 << 20);
        for (bool vmm : {true, false}) {
            INFO((vmm ? "ringd_cuda_alloc" : "ringd_register_cuda"));
            std::vector<std::unique_ptr<DeviceBuf>> bufs;
            bufs.push_back(std::make_unique<DeviceBuf>(two[0]->get(), 1 << 20, vmm));
            bufs.push_back(std::make_unique<DeviceBuf>(two[1]->get(), 1 << 20, false));
            const uint64_t closes = status_of(*c.d[0])["closes"].get<uint64_t>();
            DeviceOp o = prepare(bufs, DType::F32, ReduceOp::Sum, 50000, 3);
            upload(bufs, o);
            REQUIRE(ringd_submit_cuda(bufs[0]->c, bufs[0]->at(o.range[0].offset), o.count, RINGD_F32, RINGD_SUM,
                                      nullptr, &o.tickets[0]) == 0);
            REQUIRE(ops_in_flight(*c.d[0], 1));  // in ringd, waiting for rank 1
            std::atomic<int> unregistered{1};
            std::thread un([&] {
                unregistered = vmm ? ringd_cuda_free(bufs[0]->c, bufs[0]->at(0))
                                   : ringd_unregister_cuda(bufs[0]->c, bufs[0]->reg);
            });
            if (vmm) {
                un.join();  // answered at once
                CHECK(unregistered == 0);
            } else {
                // Not answered while the op holds the mapping: nothing to wait on but time.
                std::this_thread::sleep_for(100ms);
                CHECK(unregistered == 1);
            }
            CHECK(status_of(*c.d[0])["mapped_bytes"].get<uint64_t>() > 0);
            REQUIRE(ringd_submit_cuda(bufs[1]->c, bufs[1]->at(o.range[1].offset), o.count, RINGD_F32, RINGD_SUM,
                                      nullptr, &o.tickets[1]) == 0);
            REQUIRE(ringd_wait(bufs[1]->c, o.tickets[1], 10000) == 0);
            if (un.joinable()) un.join();
            CHECK(unregistered == 0);
            REQUIRE(ringd_wait(bufs[0]->c, o.tickets[0], 10000) == 0);
            CHECK(status_of(*c.d[0])["closes"].get<uint64_t>() == closes + 1);  // closed once the op let go
            REQUIRE(api()->cuMemcpyDtoH(o.image[1].data(), bufs[1]->base, bufs[1]->bytes) == CUDA_SUCCESS);
            CHECK(o.range[1].check(o.image[1].data(), ReduceOp::Sum, 2).ok());
            if (!vmm) {  // the memory is still the test's: the result is in it
                REQUIRE(api()->cuMemcpyDtoH(o.image[0].data(), bufs[0]->base, bufs[0]->bytes) == CUDA_SUCCESS);
                CHECK(o.range[0].check(o.image[0].data(), ReduceOp::Sum, 2).ok());
                CHECK(ringd_submit_cuda(bufs[0]->c, bufs[0]->at(0), 16, RINGD_F32, RINGD_SUM, nullptr, &t) == -ENOENT);
                bufs[0]->reg = 0;
            } else {
                bufs[0]->base = 0;
                bufs[0]->vmm = false;  // freed above
            }
        }
    }
    if (stray) api()->cuMemFree(stray);
    // The daemon is fine: a new group works.
    Clients after = connect_all(c, "after", 1, 1 << 20);
    allreduce_checked(after, DType::F32, ReduceOp::Sum, 1000, 9);
}

TEST_CASE("beyond cuda.max_mapped_bytes idle mappings close and open again", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(1, cuda_cluster("3s", "cuda: {provider: " + provider() + ", max_mapped_bytes: 4MiB}\n"));
    Clients cl = connect_all(c, "lru", 1, 4 << 20);
    std::vector<std::unique_ptr<DeviceBuf>> bufs;
    ::setenv("RINGD_CUDA_PART_BYTES", "65536", 1);  // the failing op below goes as 13 parts
    for (int i = 0; i < 3; ++i) bufs.push_back(std::make_unique<DeviceBuf>(cl[0]->get(), 2 << 20, false));
    ::unsetenv("RINGD_CUDA_PART_BYTES");
    json j = status_of(*c.d[0]);
    CHECK(j["evictions"].get<uint64_t>() >= 1);
    CHECK(j["mapped_bytes"].get<uint64_t>() <= (4u << 20));
    for (int round = 0; round < 2; ++round)
        for (int i = 0; i < 3; ++i) {
            std::vector<std::unique_ptr<DeviceBuf>> one;
            one.push_back(std::move(bufs[i]));
            DeviceOp o = prepare(one, DType::F64, ReduceOp::Sum, 100000, 60 + i);
            upload(one, o);
            submit(one, o);
            wait_and_check(one, o);
            bufs[i] = std::move(one[0]);
            CHECK(status_of(*c.d[0])["mapped_bytes"].get<uint64_t>() <= (4u << 20));
        }
    j = status_of(*c.d[0]);
    CHECK(j["opens"].get<uint64_t>() > 3);
    CHECK(j["registrations"].get<uint64_t>() == 3);
    // The exporter frees a buffer while ringd has its mapping closed: the op that needs it fails
    // with the reason, and the others go on.
    DeviceBuf &gone = *bufs[0];
    {
        for (int i : {1, 2}) {  // 1 and 2 mapped: 0, the least recently used, is closed
            uint64_t t = 0;
            REQUIRE(ringd_submit_cuda(bufs[i]->c, bufs[i]->at(4096), 10, RINGD_F32, RINGD_MAX, nullptr, &t) == 0);
            REQUIRE(ringd_wait(bufs[i]->c, t, 10000) == 0);
        }
    }
    REQUIRE(api()->cuMemFree(gone.base) == CUDA_SUCCESS);
    // Every part is refused at once, while the next parts are still being queued: the op's ticket
    // still ends, with the reason, and a stream waiting for it goes on.
    uint64_t t = 0;
    CUstream s = nullptr;
    REQUIRE(api()->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    REQUIRE(ringd_submit_cuda(gone.c, gone.at(4096), 200000, RINGD_F32, RINGD_SUM, s, &t) == 0);
    REQUIRE(ringd_stream_wait(gone.c, t, s) == 0);
    CHECK(ringd_wait(gone.c, t, 10000) < 0);
    CHECK_THAT(ringd_last_error(gone.c), Catch::Contains("IPC handle"));
    CHECK(api()->cuStreamSynchronize(s) == CUDA_SUCCESS);
    api()->cuStreamDestroy(s);
    REQUIRE(ringd_unregister_cuda(gone.c, gone.reg) == 0);
    gone.reg = 0;
    gone.base = 0;
    CHECK(ringd_allreduce_cuda(bufs[1]->c, bufs[1]->at(4096), 10, RINGD_F32, RINGD_MAX, nullptr, 10000) == 0);
}

namespace {

struct Child {
    pid_t pid = -1;
    FILE *out = nullptr;
    std::string line;
};

// tests/integration/cuda_trainer.cpp, started with `args`; returns once it printed its first line.
Child start_trainer(const std::vector<std::string> &args) {
    int p[2];
    REQUIRE(::pipe(p) == 0);
    Child ch;
    ch.pid = ::fork();
    if (ch.pid == 0) {
        ::dup2(p[1], 1);
        ::close(p[0]);
        std::vector<char *> argv;
        const std::string bin = env_or("RINGD_CUDA_TRAINER_BIN", "build/tests/cuda-trainer");
        argv.push_back(const_cast<char *>(bin.c_str()));
        for (const auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
        argv.push_back(nullptr);
        ::execv(bin.c_str(), argv.data());
        ::_exit(127);
    }
    ::close(p[1]);
    ch.out = ::fdopen(p[0], "r");
    char buf[1024] = "";
    if (std::fgets(buf, sizeof buf, ch.out)) ch.line = buf;
    return ch;
}

int reap(Child &ch) {
    int st = 0;
    ::waitpid(ch.pid, &st, 0);
    std::fclose(ch.out);
    return st;
}

}  // namespace

TEST_CASE("exporters that exit or are killed mid-op leave nothing behind", "[cuda]") {
    NEED_CUDA();
    use_device();
    TestCluster c(2, cuda_cluster("5s", cuda_yaml()));
    REQUIRE(c.wait_up());
    for (const char *kind : {"alloc", "register"}) {
        INFO(kind);
        // An exporter that registers and exits without a word.
        Child ex = start_trainer({c.d[0]->socket(), std::string("ex") + kind, "0", "1", kind, "exit"});
        INFO(ex.line);
        REQUIRE(ex.line.rfind("ready", 0) == 0);
        CHECK(WEXITSTATUS(reap(ex)) == 0);
        CHECK(all_closed(c));

        // A trainer killed while its op waits for the others: they get an error naming the rank.
        // Local rank 1 of host 0 is the child; the test holds the other three.
        const std::string group = std::string("kill") + kind;
        Clients others;
        for (auto [host, rank] : {std::pair{0, 0}, {1, 0}, {1, 1}})
            others.push_back(std::make_unique<Client>(c.d[host]->socket(), group, rank, 2, 1 << 20));
        Child victim = start_trainer({c.d[0]->socket(), std::string("kill") + kind, "1", "2", kind, "hang"});
        INFO(victim.line);
        REQUIRE(victim.line.rfind("ready", 0) == 0);
        REQUIRE(ops_in_flight(*c.d[0], 1));  // its op is in ringd
        ::kill(victim.pid, SIGKILL);
        reap(victim);
        std::vector<uint64_t> tickets;
        for (auto &o : others) tickets.push_back(o->submit(0, 1 << 16, RINGD_F32, RINGD_SUM));
        for (size_t k = 0; k < others.size(); ++k) {
            auto &o = others[k];
            const int rc = ringd_wait(o->get(), tickets[k], 20000);
            CHECK(rc < 0);
            CHECK_THAT(ringd_last_error(o->get()), Catch::Contains("left"));
        }
        others.clear();
        CHECK(all_closed(c));
    }
    Clients after = connect_all(c, "after", 2, 1 << 20);
    allreduce_checked(after, DType::F32, ReduceOp::Sum, 100000, 4);
}

// Sizes from one element to 256 MiB, every dtype x op at each size up to 16 MiB. Hidden (run by
// tests/device/cuda-check on a real GPU, or with "[.sweep]" here): its big ops take time.
TEST_CASE("every dtype and op from 4 B to 256 MiB", "[.sweep]") {
    NEED_CUDA();
    use_device();
    ClusterOptions o = cuda_cluster("60s", cuda_yaml());
    o.slot_bytes = "300MiB";
    TestCluster c(2, o);
    REQUIRE(c.wait_up());
    Clients cl = connect_all(c, "sweep", 2, 300u << 20);
    std::vector<std::unique_ptr<DeviceBuf>> bufs;
    for (size_t g = 0; g < cl.size(); ++g) bufs.push_back(std::make_unique<DeviceBuf>(cl[g]->get(), 264u << 20, g % 2 == 0));
    uint64_t seed = 500;
    for (size_t bytes : {size_t{4}, size_t{4096}, size_t{1} << 20, size_t{16} << 20, size_t{256} << 20})
        for (DType t : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64})
            for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max}) {
                if (op == ReduceOp::Avg && dtype_is_integer(t)) continue;
                if (bytes > (16u << 20) && !(t == DType::F32 && op == ReduceOp::Sum)) continue;
                const size_t count = std::max<size_t>(1, bytes / dtype_size(t));
                DeviceOp d = prepare(bufs, t, op, count, seed++);
                upload(bufs, d);
                submit(bufs, d);
                wait_and_check(bufs, d);
            }
}

TEST_CASE("without a driver ringd and the client run and say why there is no CUDA", "[cuda]") {
    if (provider() != "emulated") RINGD_SKIP("runs where the hardware provider is not the one under test");
    if (cuda::load_cuda(cuda::Provider::Hardware)) RINGD_SKIP("this machine has an NVIDIA driver");
    // The default provider (hardware): no libcuda.so.1 here.
    Daemon d;
    REQUIRE(d.ready());
    const json j = status_of(d);
    CHECK_FALSE(j["available"].get<bool>());
    CHECK(j["built"].get<bool>());
    CHECK_THAT(j["error"].get<std::string>(), Catch::Contains("libcuda.so.1"));
    ringd::Client cl(d.socket(), "nodriver", 0, 1, 1 << 20);
    // The client asks for the hardware provider too: refused with the reason, nothing else lost.
    ::setenv("RINGD_CUDA_PROVIDER", "hardware", 1);
    void *p = nullptr;
    CHECK(ringd_cuda_alloc(cl.get(), 4096, &p) == -ENODEV);
    CHECK_THAT(ringd_last_error(cl.get()), Catch::Contains("libcuda.so.1"));
    ::setenv("RINGD_CUDA_PROVIDER", provider().c_str(), 1);
    uint64_t t = cl.submit(0, 100, RINGD_F32, RINGD_SUM);
    CHECK(ringd_wait(cl.get(), t, 5000) == 0);
}
