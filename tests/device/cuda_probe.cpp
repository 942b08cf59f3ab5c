// cuda-probe: what a GPU offers ringd's CUDA path, as JSON on stdout: each device's UUID and the
// attributes the path uses (VMM, POSIX fd handles, stream memory ops, dmabuf), and copy bandwidth
// between the device and a memfd slot pinned as ringd pins it (cuMemHostRegister) next to the
// driver's own pinned memory (cuMemAllocHost). Usage: cuda-probe [hardware|emulated] [MiB]
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "common/cuda/cuda_api.h"

using namespace ringd;
using nlohmann::json;

namespace {

const cuda::CudaApi *cu = nullptr;

int attr(CUdevice d, CUdevice_attribute a) {
    int v = -1;
    return cu->cuDeviceGetAttribute(&v, a, d) == CUDA_SUCCESS ? v : -1;
}

// GB/s of `reps` copies of `bytes` in one direction on one stream.
double bandwidth(void *host, CUdeviceptr dev, size_t bytes, bool to_device, CUstream s, int reps = 10) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) {
        const CUresult r = to_device ? cu->cuMemcpyHtoDAsync(dev, host, bytes, s) : cu->cuMemcpyDtoHAsync(host, dev, bytes, s);
        if (r != CUDA_SUCCESS) return -1;
    }
    if (cu->cuStreamSynchronize(s) != CUDA_SUCCESS) return -1;
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return static_cast<double>(bytes) * reps / sec / 1e9;
}

}  // namespace

int main(int argc, char **argv) {
    const std::string which = argc > 1 ? argv[1] : "hardware";
    const size_t mib = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 256;
    json out;
    auto p = cuda::parse_provider(which);
    auto api = p ? cuda::load_cuda(*p) : Result<const cuda::CudaApi *>(p.error());
    if (!api) {
        out["error"] = api.error().message;
        std::printf("%s\n", out.dump(2).c_str());
        return 1;
    }
    cu = *api;
    out["provider"] = which;
    out["driver_version"] = cu->driver_version;
    int n = 0;
    cu->cuDeviceGetCount(&n);
    out["devices"] = json::array();
    for (int i = 0; i < n; ++i) {
        CUdevice d = 0;
        cu->cuDeviceGet(&d, i);
        char name[256] = {};
        cu->cuDeviceGetName(name, sizeof name - 1, d);
        CUuuid u{};
        cu->cuDeviceGetUuid(&u, d);
        char uuid[64];
        const auto *b = reinterpret_cast<const unsigned char *>(u.bytes);
        std::snprintf(uuid, sizeof uuid, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                      b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
        out["devices"].push_back(
            {{"ordinal", i},
             {"name", name},
             {"uuid", uuid},
             {"compute_capability", std::to_string(attr(d, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)) + "." +
                                        std::to_string(attr(d, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))},
             {"vmm", attr(d, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)},
             {"posix_fd_handles", attr(d, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)},
             {"stream_mem_ops", attr(d, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1)},
             {"dmabuf", attr(d, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)},
             {"unified_addressing", attr(d, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)}});
    }
    if (n > 0) {
        CUdevice d = 0;
        CUcontext ctx = nullptr;
        cu->cuDeviceGet(&d, 0);
        cu->cuDevicePrimaryCtxRetain(&ctx, d);
        cu->cuCtxSetCurrent(ctx);
        const size_t bytes = mib << 20;
        CUdeviceptr dev = 0;
        CUstream s = nullptr;
        void *pinned = nullptr;
        const int fd = ::memfd_create("ringd-probe-slot", MFD_CLOEXEC);
        void *slot = MAP_FAILED;
        if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(bytes)) == 0)
            slot = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        json bw;
        bw["bytes"] = bytes;
        if (slot != MAP_FAILED && cu->cuMemAlloc(&dev, bytes) == CUDA_SUCCESS &&
            cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS &&
            cu->cuMemHostRegister(slot, bytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP) == CUDA_SUCCESS &&
            cu->cuMemAllocHost(&pinned, bytes) == CUDA_SUCCESS) {
            bandwidth(slot, dev, bytes, false, s, 1);  // warm-up
            bw["slot_dtoh_GBps"] = bandwidth(slot, dev, bytes, false, s);
            bw["slot_htod_GBps"] = bandwidth(slot, dev, bytes, true, s);
            bw["allochost_dtoh_GBps"] = bandwidth(pinned, dev, bytes, false, s);
            bw["allochost_htod_GBps"] = bandwidth(pinned, dev, bytes, true, s);
        } else {
            bw["error"] = "could not set up the copies";
        }
        out["bandwidth"] = bw;
    }
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
}
