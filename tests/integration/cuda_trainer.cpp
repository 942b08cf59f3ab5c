// A trainer process for the device-buffer tests (tests/integration/test_cuda.cpp): joins a group,
// registers device memory of its own (it is the exporter), and then, as told:
//   exit    registers and exits without closing (an exporter that goes)
//   hang    submits an op on the buffer and waits to be killed (a trainer killed mid-op)
// It prints "ready <reg>" once it got there, and "error <message>" when it could not.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/cuda/cuda_api.h"
#include "ringd/ringd.h"

int main(int argc, char **argv) {
    if (argc != 7) {
        std::fprintf(stderr, "usage: cuda-trainer SOCKET GROUP RANK SIZE alloc|register exit|hang\n");
        return 2;
    }
    const std::string kind = argv[5], mode = argv[6];
    auto fail = [](const std::string &m) {
        std::printf("error %s\n", m.c_str());
        std::fflush(stdout);
        return 1;
    };
    char err[512] = "";
    ringd_client *c = ringd_connect(argv[1], argv[2], std::atoi(argv[3]), std::atoi(argv[4]), 16 << 20, err, sizeof err);
    if (!c) return fail(err);
    auto api = ringd::cuda::load_cuda(ringd::cuda::Provider::Emulated);
    if (!api) return fail(api.error().message);
    const ringd::cuda::CudaApi &cu = **api;
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    if (cu.cuDeviceGet(&dev, 0) != CUDA_SUCCESS || cu.cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
        cu.cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        return fail("no emulated device");
    constexpr size_t kCount = 1 << 16;
    void *buf = nullptr;
    uint64_t reg = 0;
    if (kind == "alloc") {
        if (ringd_cuda_alloc(c, kCount * 4, &buf) != 0) return fail(ringd_last_error(c));
    } else {
        CUdeviceptr p = 0;
        if (cu.cuMemAlloc(&p, kCount * 4) != CUDA_SUCCESS) return fail("cuMemAlloc");
        buf = reinterpret_cast<void *>(p);
        if (ringd_register_cuda(c, buf, kCount * 4, &reg) != 0) return fail(ringd_last_error(c));
    }
    if (mode == "hang") {
        uint64_t ticket = 0;
        if (ringd_submit_cuda(c, buf, kCount, RINGD_F32, RINGD_SUM, nullptr, &ticket) != 0) return fail(ringd_last_error(c));
    }
    std::printf("ready %llu\n", static_cast<unsigned long long>(reg));
    std::fflush(stdout);
    if (mode == "exit") std::_Exit(0);  // no ringd_close, no cuMemFree: the exporter just goes
    for (;;) ::pause();
}
