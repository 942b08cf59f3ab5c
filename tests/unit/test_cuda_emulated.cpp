// The software CUDA device (libringd-cuda-emulated.so) through the CudaApi table, as ringd uses
// it: devices, UUIDs and CUDA_VISIBLE_DEVICES, primary contexts, legacy IPC and POSIX-fd VMM
// memory shared with another process, stream order, stream memory operations, events, injected
// delays and faults, the ringd_spin kernel, host memory registration, cuGetProcAddress and the
// error strings.
//
// Processes: the library's state is per process and loaded once, so the CUDA_VISIBLE_DEVICES
// check runs a fresh copy of this binary (a hidden probe case); the sharing checks fork a child
// that uses only memory calls (no stream, so it starts no thread after a fork) and _exits.
#include <catch2/catch.hpp>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda/cuda_api.h"

extern char **environ;

using namespace ringd::cuda;
using namespace std::chrono_literals;

namespace {

constexpr int kDevices = 3;
constexpr const char *kProbeEnv = "RINGD_TEST_PROBE_EXPECT";

#define CU_OK(expr) REQUIRE((expr) == CUDA_SUCCESS)

// The emulated table, with kDevices GPUs all visible (a probe keeps the CUDA_VISIBLE_DEVICES it
// was started with). The library comes from $RINGD_CUDA_EMULATED_LIBRARY, else the fallbacks.
const CudaApi &emu() {
    static const ringd::Result<const CudaApi *> loaded = [] {
        ::setenv("RINGD_CUDA_EMULATED_DEVICES", std::to_string(kDevices).c_str(), 1);
        if (!std::getenv(kProbeEnv)) ::unsetenv("CUDA_VISIBLE_DEVICES");
        return load_cuda(Provider::Emulated);
    }();
    INFO((loaded.ok() ? std::string() : loaded.error().message));
    REQUIRE(loaded.ok());
    return **loaded;
}

// Retains GPU `ordinal`'s primary context (kept for the life of the process) and makes it current.
CUcontext use_device(int ordinal) {
    const CudaApi &a = emu();
    CUdevice dev;
    CU_OK(a.cuDeviceGet(&dev, ordinal));
    CUcontext ctx;
    CU_OK(a.cuDevicePrimaryCtxRetain(&ctx, dev));
    CU_OK(a.cuCtxSetCurrent(ctx));
    return ctx;
}

std::string hex(const CUuuid &u) {
    std::string s;
    char b[3];
    for (char c : u.bytes) {
        std::snprintf(b, sizeof b, "%02x", static_cast<unsigned char>(c));
        s += b;
    }
    return s;
}

std::string uuid_string(const CUuuid &u) {
    const std::string h = hex(u);
    return "GPU-" + h.substr(0, 8) + "-" + h.substr(8, 4) + "-" + h.substr(12, 4) + "-" + h.substr(16, 4) + "-" +
           h.substr(20);
}

int exit_code(pid_t pid) {
    int st = 0;
    if (::waitpid(pid, &st, 0) != pid) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Runs `body` in a forked child and returns its exit code: `body`'s result (0: all good).
int in_child(const std::function<int()> &body) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
        int code = 99;
        try {
            code = body();
        } catch (...) {
        }
        ::_exit(code);
    }
    REQUIRE(pid > 0);
    return exit_code(pid);
}

// Runs the probe case in a fresh process of this binary with CUDA_VISIBLE_DEVICES=`visible`; it
// checks that it sees `count` GPUs, ordinal 0 being the GPU with UUID `uuid0`.
int run_probe(const std::string &visible, int count, const CUuuid &uuid0) {
    std::vector<std::string> env;
    for (char **e = environ; *e; ++e)
        if (std::strncmp(*e, "CUDA_VISIBLE_DEVICES=", 21) != 0 && std::strncmp(*e, kProbeEnv, std::strlen(kProbeEnv)) != 0)
            env.emplace_back(*e);
    env.push_back("CUDA_VISIBLE_DEVICES=" + visible);
    env.push_back(std::string(kProbeEnv) + "=" + std::to_string(count) + ":" + hex(uuid0));
    std::vector<char *> envp;
    for (auto &s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    char exe[] = "/proc/self/exe", name[] = "visible devices probe", out[] = "--out", devnull[] = "/dev/null";
    char *argv[] = {exe, name, out, devnull, nullptr};
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
        ::execve(exe, argv, envp.data());
        ::_exit(127);
    }
    REQUIRE(pid > 0);
    return exit_code(pid);
}

uint32_t load_word(CUdeviceptr p) { return __atomic_load_n(reinterpret_cast<uint32_t *>(p), __ATOMIC_ACQUIRE); }
void store_word(CUdeviceptr p, uint32_t v) { __atomic_store_n(reinterpret_cast<uint32_t *>(p), v, __ATOMIC_RELEASE); }

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// Run by "devices and CUDA_VISIBLE_DEVICES" in a fresh process; does nothing otherwise.
TEST_CASE("visible devices probe", "[.][cuda_emulated_probe]") {
    const char *expect = std::getenv(kProbeEnv);
    if (!expect) return;
    const CudaApi &a = emu();
    int n = -1;
    CU_OK(a.cuDeviceGetCount(&n));
    CUuuid u{};
    if (n > 0) CU_OK(a.cuDeviceGetUuid(&u, 0));
    const std::string seen = std::to_string(n) + ":" + hex(u);
    if (seen != expect) std::fprintf(stderr, "visible devices probe: expected %s, saw %s\n", expect, seen.c_str());
    CHECK(seen == expect);
}

TEST_CASE("devices and CUDA_VISIBLE_DEVICES", "[cuda_emulated]") {
    const CudaApi &a = emu();
    CHECK(a.provider == Provider::Emulated);
    CHECK(a.driver_version == 13000);
    REQUIRE(a.emu_stream_delay);
    REQUIRE(a.emu_inject_fault);

    int n = 0;
    CU_OK(a.cuDeviceGetCount(&n));
    REQUIRE(n == kDevices);
    std::vector<CUuuid> uuids(kDevices);
    for (int i = 0; i < n; ++i) {
        CUdevice dev;
        CU_OK(a.cuDeviceGet(&dev, i));
        CU_OK(a.cuDeviceGetUuid(&uuids[i], dev));
        CHECK(static_cast<unsigned char>(uuids[i].bytes[15]) == i);
        for (int j = 0; j < i; ++j) CHECK(std::memcmp(uuids[i].bytes, uuids[j].bytes, 16) != 0);
        char name[64];
        CU_OK(a.cuDeviceGetName(name, sizeof name, dev));
        CHECK(std::string(name) == "ringd emulated GPU " + std::to_string(i));
        int v = -1;
        CU_OK(a.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev));
        CHECK(v == 0x10 + i);
    }
    CUdevice dev;
    CHECK(a.cuDeviceGet(&dev, kDevices) == CUDA_ERROR_INVALID_DEVICE);
    CHECK(a.cuDeviceGet(&dev, -1) == CUDA_ERROR_INVALID_DEVICE);

    const std::pair<CUdevice_attribute, int> attrs[] = {
        {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, 1},
        {CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, 1},
        {CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, 1},
        {CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0},
    };
    for (auto [attr, want] : attrs) {
        int v = -1;
        CU_OK(a.cuDeviceGetAttribute(&v, attr, 0));
        CHECK(v == want);
    }
    int v = 0;
    CU_OK(a.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0));
    CHECK(v > 0);
    CHECK(a.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX_PITCH, 0) == CUDA_ERROR_INVALID_VALUE);

    // Another process sees the same GPU (same UUID) under the ordinal its list gives it; an
    // invalid entry ends the list.
    CHECK(run_probe("1", 1, uuids[1]) == 0);
    CHECK(run_probe("2,0", 2, uuids[2]) == 0);
    CHECK(run_probe(uuid_string(uuids[2]) + ",7,0", 1, uuids[2]) == 0);
    CHECK(run_probe(uuid_string(uuids[1]).substr(0, 40) + ",0", 2, uuids[1]) == 0);  // a unique prefix
    CHECK(run_probe("0,0,1", 1, uuids[0]) == 0);  // a repeat ends the list
}

TEST_CASE("primary contexts are refcounted", "[cuda_emulated]") {
    const CudaApi &a = emu();
    CU_OK(a.cuCtxSetCurrent(nullptr));
    CUdevice dev;
    CUdeviceptr d;
    CHECK(a.cuCtxGetDevice(&dev) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(a.cuMemAlloc(&d, 64) == CUDA_ERROR_INVALID_CONTEXT);
    CUstream s;
    CHECK(a.cuStreamCreate(&s, CU_STREAM_DEFAULT) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(a.cuStreamSynchronize(nullptr) == CUDA_ERROR_INVALID_CONTEXT);

    CUcontext c1, c2;
    CU_OK(a.cuDevicePrimaryCtxRetain(&c1, 2));
    CU_OK(a.cuDevicePrimaryCtxRetain(&c2, 2));
    CHECK(c1 == c2);
    CU_OK(a.cuCtxSetCurrent(c1));
    CUcontext cur;
    CU_OK(a.cuCtxGetCurrent(&cur));
    CHECK(cur == c1);
    CU_OK(a.cuCtxGetDevice(&dev));
    CHECK(dev == 2);
    CU_OK(a.cuMemAlloc(&d, 64));
    CUcontext owner;
    CU_OK(a.cuPointerGetAttribute(&owner, CU_POINTER_ATTRIBUTE_CONTEXT, d));
    CHECK(owner == c1);
    CU_OK(a.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CU_OK(a.cuCtxSynchronize());

    // Memory freed under queued work: the work faults, and the fault sticks to the context.
    CUdeviceptr word, victim;
    CU_OK(a.cuMemAlloc(&word, 64));
    CU_OK(a.cuMemAlloc(&victim, 64));
    store_word(word, 0);
    CU_OK(a.cuStreamWaitValue32(s, word, 1, CU_STREAM_WAIT_VALUE_GEQ));
    CU_OK(a.cuStreamWriteValue32(s, victim, 5, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU_OK(a.cuMemFree(victim));
    store_word(word, 1);
    CHECK(a.cuStreamSynchronize(s) == CUDA_ERROR_ILLEGAL_ADDRESS);
    CHECK(a.cuCtxSynchronize() == CUDA_ERROR_ILLEGAL_ADDRESS);

    // Waits that never end, one on a destroyed stream: destroying the context stops them.
    CUstream doomed;
    CU_OK(a.cuStreamCreate(&doomed, CU_STREAM_DEFAULT));
    CU_OK(a.cuStreamWaitValue32(doomed, word, 100, CU_STREAM_WAIT_VALUE_EQ));
    CU_OK(a.cuStreamDestroy(doomed));
    CU_OK(a.cuStreamWaitValue32(s, word, 100, CU_STREAM_WAIT_VALUE_EQ));

    CU_OK(a.cuDevicePrimaryCtxRelease(2));
    CHECK(a.cuStreamQuery(s) == CUDA_ERROR_ILLEGAL_ADDRESS);  // still retained once
    // The last release destroys the context with its streams and memory.
    CU_OK(a.cuDevicePrimaryCtxRelease(2));
    CHECK(a.cuMemAlloc(&d, 64) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(a.cuStreamQuery(s) == CUDA_ERROR_INVALID_HANDLE);
    int ordinal;
    CHECK(a.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d) == CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuDevicePrimaryCtxRelease(2) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(a.cuCtxSetCurrent(c1) == CUDA_ERROR_INVALID_CONTEXT);

    // Retained again, it is a fresh context: no fault left.
    CU_OK(a.cuDevicePrimaryCtxRetain(&c2, 2));
    CHECK(c2 == c1);
    CU_OK(a.cuCtxSetCurrent(c2));
    CU_OK(a.cuCtxSynchronize());
    CU_OK(a.cuDevicePrimaryCtxRelease(2));
    CU_OK(a.cuCtxSetCurrent(nullptr));
}

TEST_CASE("legacy IPC handles across processes", "[cuda_emulated]") {
    const CudaApi &a = emu();
    use_device(0);
    constexpr size_t kSize = 1 << 20;
    CUdeviceptr d;
    CU_OK(a.cuMemAlloc(&d, kSize));
    auto *bytes = reinterpret_cast<uint8_t *>(d);  // device memory is host memory at that address
    for (size_t i = 0; i < kSize; ++i) bytes[i] = static_cast<uint8_t>(i * 7);
    CUipcMemHandle h;
    CU_OK(a.cuIpcGetMemHandle(&h, d));
    CUipcMemHandle other;
    CHECK(a.cuIpcGetMemHandle(&other, d + 64) == CUDA_ERROR_INVALID_VALUE);  // not an allocation's base

    CUdeviceptr m;
    CHECK(a.cuIpcOpenMemHandle(&m, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) == CUDA_ERROR_INVALID_CONTEXT);
    CHECK(a.cuIpcOpenMemHandle(&m, h, 2) == CUDA_ERROR_INVALID_VALUE);

    // A forged handle: this allocation's pid and fd with another token (bytes 32..39).
    CUipcMemHandle forged = h;
    forged.reserved[33] ^= 0x5a;
    // A stale handle: freed, the fd number then likely reused by a new allocation.
    CUdeviceptr gone_alloc, reuse;
    CUipcMemHandle stale;
    CU_OK(a.cuMemAlloc(&gone_alloc, 4096));
    CU_OK(a.cuIpcGetMemHandle(&stale, gone_alloc));
    CU_OK(a.cuMemFree(gone_alloc));
    CU_OK(a.cuMemAlloc(&reuse, 4096));

    const int code = in_child([&] {
        CUdeviceptr p, again, base;
        size_t size = 0;
        if (a.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != CUDA_SUCCESS) return 1;
        if (a.cuIpcOpenMemHandle(&again, h, 0) != CUDA_SUCCESS || again != p) return 2;  // counted, same address
        if (a.cuMemGetAddressRange(&base, &size, p + 100) != CUDA_SUCCESS || base != p || size != kSize) return 3;
        int ordinal = -1;
        unsigned type = 0;
        if (a.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p + 5) != CUDA_SUCCESS || ordinal != 0)
            return 4;
        if (a.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) != CUDA_SUCCESS ||
            type != CU_MEMORYTYPE_DEVICE)
            return 5;
        const auto *seen = reinterpret_cast<const uint8_t *>(p);
        for (size_t i = 0; i < kSize; ++i)
            if (seen[i] != static_cast<uint8_t>(i * 7)) return 6;
        std::memset(reinterpret_cast<void *>(p), 0x5a, kSize);
        if (a.cuIpcCloseMemHandle(p) != CUDA_SUCCESS || a.cuIpcCloseMemHandle(p) != CUDA_SUCCESS) return 7;
        if (a.cuIpcCloseMemHandle(p) != CUDA_ERROR_INVALID_VALUE) return 8;
        if (a.cuMemGetAddressRange(&base, &size, p) != CUDA_ERROR_NOT_FOUND) return 9;
        if (a.cuIpcOpenMemHandle(&p, forged, 0) != CUDA_ERROR_INVALID_HANDLE) return 10;
        if (a.cuIpcOpenMemHandle(&p, stale, 0) != CUDA_ERROR_INVALID_HANDLE) return 11;
        return 0;
    });
    CHECK(code == 0);
    size_t wrong = 0;
    for (size_t i = 0; i < kSize; ++i) wrong += bytes[i] != 0x5a;
    CHECK(wrong == 0);

    // The exporter has exited: its handle opens nothing.
    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    const int exporter = in_child([&] {
        CUdeviceptr x;
        CUipcMemHandle hx;
        if (a.cuMemAlloc(&x, 4096) != CUDA_SUCCESS || a.cuIpcGetMemHandle(&hx, x) != CUDA_SUCCESS) return 1;
        return ::write(pipe_fds[1], &hx, sizeof hx) == static_cast<ssize_t>(sizeof hx) ? 0 : 2;
    });
    CHECK(exporter == 0);
    CUipcMemHandle orphan;
    CHECK(::read(pipe_fds[0], &orphan, sizeof orphan) == static_cast<ssize_t>(sizeof orphan));
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    CHECK(a.cuIpcOpenMemHandle(&m, orphan, 0) == CUDA_ERROR_INVALID_HANDLE);

    CU_OK(a.cuMemFree(reuse));
    CU_OK(a.cuMemFree(d));
    CHECK(a.cuMemFree(d) == CUDA_ERROR_INVALID_VALUE);
}

TEST_CASE("VMM memory shared through a POSIX fd", "[cuda_emulated]") {
    const CudaApi &a = emu();
    use_device(1);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 1;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gran = 0;
    CU_OK(a.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(gran == (size_t{2} << 20));
    CU_OK(a.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK(gran == (size_t{2} << 20));
    const size_t size = 2 * gran;

    CUmemGenericAllocationHandle mh;
    CHECK(a.cuMemCreate(&mh, gran + 4096, &prop, 0) == CUDA_ERROR_INVALID_VALUE);
    CU_OK(a.cuMemCreate(&mh, size, &prop, 0));
    CUdeviceptr va;
    CU_OK(a.cuMemAddressReserve(&va, size, 0, 0, 0));
    CHECK(va % gran == 0);
    CU_OK(a.cuMemMap(va, size, 0, mh, 0));
    CUdeviceptr base;
    size_t len;
    CHECK(a.cuMemGetAddressRange(&base, &len, va) == CUDA_ERROR_NOT_FOUND);  // no access set yet
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_OK(a.cuMemSetAccess(va, size, &access, 1));
    CU_OK(a.cuMemGetAddressRange(&base, &len, va + 12345));
    CHECK(base == va);
    CHECK(len == size);
    int ordinal = -1;
    CU_OK(a.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va));
    CHECK(ordinal == 1);
    std::memset(reinterpret_cast<void *>(va), 0x11, size);

    int fd = -1;
    CU_OK(a.cuMemExportToShareableHandle(&fd, mh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    REQUIRE(fd >= 0);
    // The child inherits the fd, as a receiver of it over a unix socket would.
    const int code = in_child([&] {
        CUmemGenericAllocationHandle imported;
        if (a.cuMemImportFromShareableHandle(&imported, reinterpret_cast<void *>(static_cast<uintptr_t>(fd)),
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != CUDA_SUCCESS)
            return 1;
        CUdeviceptr cva;
        if (a.cuMemAddressReserve(&cva, size, 0, 0, 0) != CUDA_SUCCESS) return 2;
        if (a.cuMemMap(cva, size, 0, imported, 0) != CUDA_SUCCESS) return 3;
        if (a.cuMemSetAccess(cva, size, &access, 1) != CUDA_SUCCESS) return 4;
        int ord = -1;
        if (a.cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cva) != CUDA_SUCCESS || ord != 1) return 5;
        const auto *seen = reinterpret_cast<const uint8_t *>(cva);
        for (size_t i = 0; i < size; ++i)
            if (seen[i] != 0x11) return 6;
        std::memset(reinterpret_cast<void *>(cva), 0x22, size);
        if (a.cuMemUnmap(cva, size) != CUDA_SUCCESS || a.cuMemRelease(imported) != CUDA_SUCCESS ||
            a.cuMemAddressFree(cva, size) != CUDA_SUCCESS)
            return 7;
        return 0;
    });
    CHECK(code == 0);
    size_t wrong = 0;
    for (size_t i = 0; i < size; ++i) wrong += reinterpret_cast<const uint8_t *>(va)[i] != 0x22;
    CHECK(wrong == 0);

    // Only this device's memfds import; only POSIX-fd allocations export.
    CUmemGenericAllocationHandle imported;
    const int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    REQUIRE(devnull >= 0);
    CHECK(a.cuMemImportFromShareableHandle(&imported, reinterpret_cast<void *>(static_cast<uintptr_t>(devnull)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == CUDA_ERROR_INVALID_VALUE);
    ::close(devnull);
    CUmemAllocationProp plain = prop;
    plain.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    CUmemGenericAllocationHandle ph;
    CU_OK(a.cuMemCreate(&ph, gran, &plain, 0));
    int pfd = -1;
    CHECK(a.cuMemExportToShareableHandle(&pfd, ph, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) ==
          CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuMemExportToShareableHandle(&pfd, mh, CU_MEM_HANDLE_TYPE_FABRIC, 0) == CUDA_ERROR_NOT_SUPPORTED);
    CU_OK(a.cuMemRelease(ph));
    CUmemAllocationProp fabric = prop;
    fabric.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
    CHECK(a.cuMemCreate(&ph, gran, &fabric, 0) == CUDA_ERROR_NOT_SUPPORTED);

    // Mapping rules: offset 0, inside a reservation, not over a mapping; unmap whole mappings.
    CHECK(a.cuMemMap(va, gran, 0, mh, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuMemUnmap(va, gran) == CUDA_ERROR_INVALID_VALUE);
    CU_OK(a.cuMemRelease(mh));  // the mapping keeps the memory
    CHECK(reinterpret_cast<const uint8_t *>(va)[7] == 0x22);
    CU_OK(a.cuMemUnmap(va, size));
    CHECK(a.cuMemGetAddressRange(&base, &len, va) == CUDA_ERROR_NOT_FOUND);
    CHECK(a.cuMemAddressFree(va, gran) == CUDA_ERROR_INVALID_VALUE);
    CU_OK(a.cuMemAddressFree(va, size));
    ::close(fd);
}

TEST_CASE("stream order, waits, delays and events", "[cuda_emulated]") {
    const CudaApi &a = emu();
    use_device(0);
    CUdeviceptr d;
    CU_OK(a.cuMemAlloc(&d, 8192));
    const CUdeviceptr flag = d, marker = d + 4;
    store_word(flag, 0);
    store_word(marker, 0);

    // A copy, a write and a host function run in the order they were enqueued.
    CUstream s;
    CU_OK(a.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    std::vector<uint8_t> src(1024, 0xab);
    struct Seen {
        CUdeviceptr d;
        uint32_t flag = 0;
        uint8_t last = 0;
    } seen{d};
    CU_OK(a.cuMemcpyHtoDAsync(d + 64, src.data(), src.size(), s));
    CU_OK(a.cuStreamWriteValue32(s, flag, 7, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU_OK(a.cuLaunchHostFunc(
        s,
        [](void *p) {
            auto *v = static_cast<Seen *>(p);
            v->flag = load_word(v->d);
            v->last = reinterpret_cast<const uint8_t *>(v->d)[64 + 1023];
        },
        &seen));
    CU_OK(a.cuStreamSynchronize(s));
    CHECK(seen.flag == 7);
    CHECK(seen.last == 0xab);
    std::vector<uint8_t> back(1024);
    CU_OK(a.cuMemcpyDtoHAsync(back.data(), d + 64, back.size(), s));
    CU_OK(a.cuStreamSynchronize(s));
    CHECK(back == src);

    // Address and flag checks happen at enqueue.
    uint32_t on_stack = 0;
    CHECK(a.cuStreamWriteValue32(s, reinterpret_cast<CUdeviceptr>(&on_stack), 1, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuStreamWriteValue32(s, d + 2, 1, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuStreamWriteValue32(s, d + 8192, 1, 0) == CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuStreamWriteValue32(s, flag, 1, 4) == CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuStreamWaitValue32(s, flag, 1, 7) == CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuMemcpyHtoDAsync(d + 8000, src.data(), src.size(), s) == CUDA_ERROR_INVALID_VALUE);

    // GEQ compares with wrap-around: from 0xFFFFFFF0, 3 is still below 5 and 5 releases the wait.
    store_word(flag, 0xFFFFFFF0u);
    CUstream w;
    CU_OK(a.cuStreamCreate(&w, CU_STREAM_NON_BLOCKING));
    CUevent never, after, first;
    CU_OK(a.cuEventCreate(&never, CU_EVENT_DEFAULT));
    CU_OK(a.cuEventCreate(&first, CU_EVENT_DISABLE_TIMING));
    CU_OK(a.cuEventCreate(&after, CU_EVENT_BLOCKING_SYNC));
    CU_OK(a.cuEventRecord(first, w));
    CU_OK(a.cuStreamWaitValue32(w, flag, 5, CU_STREAM_WAIT_VALUE_GEQ | CU_STREAM_WAIT_VALUE_FLUSH));
    CU_OK(a.cuStreamWriteValue32(w, marker, 1, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU_OK(a.cuEventRecord(after, w));
    CU_OK(a.cuEventQuery(never));  // never recorded: complete
    std::this_thread::sleep_for(20ms);
    CU_OK(a.cuEventQuery(first));  // events complete in stream order
    CHECK(a.cuEventQuery(after) == CUDA_ERROR_NOT_READY);
    CHECK(a.cuStreamQuery(w) == CUDA_ERROR_NOT_READY);
    CHECK(load_word(marker) == 0);
    store_word(flag, 3);
    std::this_thread::sleep_for(10ms);
    CHECK(a.cuStreamQuery(w) == CUDA_ERROR_NOT_READY);
    std::thread writer([&] {
        std::this_thread::sleep_for(5ms);
        store_word(flag, 5);
    });
    CU_OK(a.cuEventSynchronize(after));
    writer.join();
    CHECK(load_word(marker) == 1);
    CU_OK(a.cuStreamQuery(w));

    // EQ, AND and NOR, each blocking until the word satisfies it.
    struct WaitCase {
        unsigned op;
        uint32_t value, blocked_at, released_at;
    };
    for (const WaitCase c : {WaitCase{CU_STREAM_WAIT_VALUE_EQ, 9, 8, 9}, WaitCase{CU_STREAM_WAIT_VALUE_AND, 0x4, 0xb, 0x6},
                             WaitCase{CU_STREAM_WAIT_VALUE_NOR, 0xffff0000u, 0x0000ffffu, 0x0000fffeu}}) {
        store_word(flag, c.blocked_at);
        CU_OK(a.cuStreamWaitValue32(w, flag, c.value, c.op));
        std::this_thread::sleep_for(5ms);
        CHECK(a.cuStreamQuery(w) == CUDA_ERROR_NOT_READY);
        store_word(flag, c.released_at);
        CU_OK(a.cuStreamSynchronize(w));
    }

    // A 50 ms delay on the producer stream delays its write by as much.
    store_word(flag, 0);
    CUstream producer;
    CU_OK(a.cuStreamCreate(&producer, CU_STREAM_NON_BLOCKING));
    a.emu_stream_delay(producer, 50000);
    const auto t0 = std::chrono::steady_clock::now();
    CU_OK(a.cuStreamWriteValue32(producer, flag, 9, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU_OK(a.cuStreamWaitValue32(w, flag, 9, CU_STREAM_WAIT_VALUE_EQ));
    CU_OK(a.cuStreamSynchronize(w));
    CHECK(ms_since(t0) >= 45.0);
    a.emu_stream_delay(producer, 0);
    CU_OK(a.cuStreamDestroy(producer));

    // The legacy default stream: stream 0, synchronous copies and cuCtxSynchronize.
    CU_OK(a.cuStreamWriteValue32(nullptr, marker, 2, 0));
    CU_OK(a.cuStreamSynchronize(nullptr));
    CHECK(load_word(marker) == 2);
    uint32_t word = 77, got = 0;
    CU_OK(a.cuMemcpyHtoD(marker, &word, sizeof word));
    CU_OK(a.cuMemcpyDtoH(&got, marker, sizeof got));
    CHECK(got == 77);
    CU_OK(a.cuMemsetD8(d + 4096, 0xcd, 16));
    CU_OK(a.cuCtxSynchronize());
    CHECK(reinterpret_cast<const uint8_t *>(d)[4096 + 15] == 0xcd);

    // cuStreamDestroy returns at once; the work already queued still runs.
    store_word(flag, 0);
    CUstream doomed;
    CU_OK(a.cuStreamCreate(&doomed, CU_STREAM_DEFAULT));
    std::atomic<bool> ran{false};
    CU_OK(a.cuStreamWaitValue32(doomed, flag, 1, CU_STREAM_WAIT_VALUE_GEQ));
    CU_OK(a.cuLaunchHostFunc(doomed, [](void *p) { static_cast<std::atomic<bool> *>(p)->store(true); }, &ran));
    CU_OK(a.cuStreamDestroy(doomed));
    CHECK(a.cuStreamQuery(doomed) == CUDA_ERROR_INVALID_HANDLE);
    CHECK_FALSE(ran.load());
    store_word(flag, 1);
    const auto t1 = std::chrono::steady_clock::now();
    while (!ran.load() && ms_since(t1) < 2000) std::this_thread::sleep_for(1ms);
    CHECK(ran.load());

    CU_OK(a.cuEventDestroy(never));
    CU_OK(a.cuEventDestroy(first));
    CU_OK(a.cuEventDestroy(after));
    CHECK(a.cuEventDestroy(after) == CUDA_ERROR_INVALID_HANDLE);
    CU_OK(a.cuStreamDestroy(s));
    CU_OK(a.cuStreamDestroy(w));
    CU_OK(a.cuMemFree(d));
}

TEST_CASE("injected faults", "[cuda_emulated]") {
    const CudaApi &a = emu();
    use_device(0);
    CUdeviceptr d;
    a.emu_inject_fault("alloc", 1);
    CHECK(a.cuMemAlloc(&d, 4096) == CUDA_ERROR_OUT_OF_MEMORY);
    CU_OK(a.cuMemAlloc(&d, 4096));
    a.emu_inject_fault("alloc", 3);
    a.emu_inject_fault("alloc", 0);  // cleared
    CUdeviceptr d2;
    CU_OK(a.cuMemAlloc(&d2, 4096));
    CU_OK(a.cuMemFree(d2));

    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle mh;
    a.emu_inject_fault("alloc", 1);
    CHECK(a.cuMemCreate(&mh, size_t{2} << 20, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY);
    CU_OK(a.cuMemCreate(&mh, size_t{2} << 20, &prop, 0));

    CUipcMemHandle h;
    CU_OK(a.cuIpcGetMemHandle(&h, d));
    CUdeviceptr m;
    a.emu_inject_fault("ipc_open", 2);
    CHECK(a.cuIpcOpenMemHandle(&m, h, 0) == CUDA_ERROR_MAP_FAILED);
    CHECK(a.cuIpcOpenMemHandle(&m, h, 0) == CUDA_ERROR_MAP_FAILED);
    CHECK(a.cuIpcOpenMemHandle(&m, h, 0) == CUDA_ERROR_INVALID_CONTEXT);  // no fault left: same process

    int fd = -1;
    CU_OK(a.cuMemExportToShareableHandle(&fd, mh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CUmemGenericAllocationHandle imported;
    void *os_handle = reinterpret_cast<void *>(static_cast<uintptr_t>(fd));
    a.emu_inject_fault("import", 1);
    CHECK(a.cuMemImportFromShareableHandle(&imported, os_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ==
          CUDA_ERROR_INVALID_VALUE);
    CU_OK(a.cuMemImportFromShareableHandle(&imported, os_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CU_OK(a.cuMemRelease(imported));
    CU_OK(a.cuMemRelease(mh));
    ::close(fd);

    std::vector<uint64_t> buf(512);
    a.emu_inject_fault("host_register", 1);
    CHECK(a.cuMemHostRegister(buf.data(), 4096, 0) == CUDA_ERROR_OUT_OF_MEMORY);
    CU_OK(a.cuMemHostRegister(buf.data(), 4096, 0));
    CU_OK(a.cuMemHostUnregister(buf.data()));

    a.emu_inject_fault("no_such_fault", 1);  // a line on stderr, nothing else
    CU_OK(a.cuMemFree(d));
}

TEST_CASE("the ringd_spin kernel occupies its stream", "[cuda_emulated]") {
    const CudaApi &a = emu();
    use_device(0);
    CUmodule mod;
    CHECK(a.cuModuleLoadData(&mod, "\x7f" "ELF not for this device") == CUDA_ERROR_INVALID_IMAGE);
    CHECK(a.cuModuleLoadData(&mod, "RINGDEMU ringd_spin,ringd_reduce") == CUDA_ERROR_NO_BINARY_FOR_GPU);
    CU_OK(a.cuModuleLoadData(&mod, "RINGDEMU"
                                   "ringd_spin"));
    CUfunction f;
    CHECK(a.cuModuleGetFunction(&f, mod, "ringd_reduce") == CUDA_ERROR_NOT_FOUND);
    CU_OK(a.cuModuleGetFunction(&f, mod, "ringd_spin"));

    CUdeviceptr d;
    CU_OK(a.cuMemAlloc(&d, 4096));
    store_word(d, 0);
    CUstream s;
    CU_OK(a.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    unsigned long long us = 40000;
    void *params[] = {&us};
    CHECK(a.cuLaunchKernel(f, 0, 1, 1, 1, 1, 1, 0, s, params, nullptr) == CUDA_ERROR_INVALID_VALUE);
    CHECK(a.cuLaunchKernel(f, 1, 1, 1, 2048, 1, 1, 0, s, params, nullptr) == CUDA_ERROR_INVALID_VALUE);
    void *extra[] = {nullptr};
    CHECK(a.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, nullptr, extra) == CUDA_ERROR_NOT_SUPPORTED);

    const auto t0 = std::chrono::steady_clock::now();
    CU_OK(a.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, params, nullptr));
    us = 0;  // parameters were taken at launch
    CU_OK(a.cuStreamWriteValue32(s, d, 1, CU_STREAM_WRITE_VALUE_DEFAULT));
    CHECK(a.cuStreamQuery(s) == CUDA_ERROR_NOT_READY);
    CHECK(load_word(d) == 0);
    CU_OK(a.cuStreamSynchronize(s));
    CHECK(ms_since(t0) >= 35.0);
    CHECK(load_word(d) == 1);

    CU_OK(a.cuModuleUnload(mod));
    CHECK(a.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr) == CUDA_ERROR_INVALID_HANDLE);
    CHECK(a.cuModuleUnload(mod) == CUDA_ERROR_INVALID_HANDLE);
    CU_OK(a.cuStreamDestroy(s));
    CU_OK(a.cuMemFree(d));
}

TEST_CASE("host memory registration", "[cuda_emulated]") {
    const CudaApi &a = emu();
    use_device(0);
    std::vector<uint32_t> buf(16384);
    std::vector<uint32_t> other(64);
    const size_t bytes = buf.size() * sizeof(uint32_t);
    CU_OK(a.cuMemHostRegister(buf.data(), bytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP));
    CHECK(a.cuMemHostRegister(buf.data() + 100, 64, 0) == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    CHECK(a.cuMemHostRegister(other.data(), 64, CU_MEMHOSTREGISTER_IOMEMORY) == CUDA_ERROR_NOT_SUPPORTED);
    CHECK(a.cuMemHostRegister(other.data(), 64, CU_MEMHOSTREGISTER_READ_ONLY) == CUDA_ERROR_NOT_SUPPORTED);

    CUdeviceptr dp;
    CU_OK(a.cuMemHostGetDevicePointer(&dp, buf.data() + 10, 0));
    CHECK(dp == reinterpret_cast<CUdeviceptr>(buf.data() + 10));
    CHECK(a.cuMemHostGetDevicePointer(&dp, other.data(), 0) == CUDA_ERROR_INVALID_VALUE);
    unsigned type = 0;
    CU_OK(a.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp));
    CHECK(type == CU_MEMORYTYPE_HOST);
    CUdeviceptr start = 0;
    CU_OK(a.cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, dp));
    CHECK(start == reinterpret_cast<CUdeviceptr>(buf.data()));
    CUdeviceptr base;
    size_t size;
    CHECK(a.cuMemGetAddressRange(&base, &size, dp) == CUDA_ERROR_NOT_FOUND);  // not device memory

    // A write value lands in the registered word.
    CU_OK(a.cuStreamWriteValue32(nullptr, dp, 42, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU_OK(a.cuStreamSynchronize(nullptr));
    CHECK(__atomic_load_n(&buf[10], __ATOMIC_ACQUIRE) == 42u);

    CHECK(a.cuMemHostUnregister(buf.data() + 1) == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    CU_OK(a.cuMemHostUnregister(buf.data()));
    CHECK(a.cuMemHostUnregister(buf.data()) == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    CHECK(a.cuStreamWriteValue32(nullptr, dp, 43, 0) == CUDA_ERROR_INVALID_VALUE);

    void *pinned = nullptr;
    CU_OK(a.cuMemAllocHost(&pinned, 1000));
    CHECK(reinterpret_cast<uintptr_t>(pinned) % 4096 == 0);
    CU_OK(a.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(pinned)));
    CHECK(type == CU_MEMORYTYPE_HOST);
    CU_OK(a.cuMemHostGetDevicePointer(&dp, pinned, 0));
    CHECK(a.cuMemHostRegister(pinned, 64, 0) == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    CHECK(a.cuMemHostUnregister(pinned) == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    CU_OK(a.cuMemFreeHost(pinned));
    CHECK(a.cuMemFreeHost(pinned) == CUDA_ERROR_INVALID_VALUE);
}

TEST_CASE("cuGetProcAddress and error strings", "[cuda_emulated]") {
    const CudaApi &a = emu();
    void *h = ::dlopen(emulated_library_path().c_str(), RTLD_NOW | RTLD_NOLOAD);
    REQUIRE(h);
    using GetProcAddress = CUresult (*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    auto gpa = reinterpret_cast<GetProcAddress>(::dlsym(h, "cuGetProcAddress_v2"));
    REQUIRE(gpa);
    void *fn = &fn;
    CUdriverProcAddressQueryResult status{};
    CHECK(gpa("cuNoSuchFunction", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status) == CUDA_ERROR_NOT_FOUND);
    CHECK(fn == nullptr);
    CHECK(status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    CHECK(gpa("cuMemCreate", &fn, 10000, CU_GET_PROC_ADDRESS_DEFAULT, &status) == CUDA_ERROR_NOT_FOUND);
    CHECK(status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    CU_OK(gpa("cuMemAlloc", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status));
    CHECK(status == CU_GET_PROC_ADDRESS_SUCCESS);
    CHECK(fn == reinterpret_cast<void *>(a.cuMemAlloc));
    CU_OK(gpa("cuStreamWriteValue32", &fn, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status));
    CHECK(gpa("cuStreamWriteValue32", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &status) ==
          CUDA_ERROR_NOT_SUPPORTED);
    CHECK(::dlsym(h, "cuMemAlloc_v2") == nullptr);  // reached only through cuGetProcAddress
    ::dlclose(h);

    const char *s = nullptr;
    CU_OK(a.cuGetErrorName(CUDA_ERROR_INVALID_VALUE, &s));
    CHECK(std::string(s) == "CUDA_ERROR_INVALID_VALUE");
    CU_OK(a.cuGetErrorString(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, &s));
    CHECK(s != nullptr);
    CHECK(a.cuGetErrorName(static_cast<CUresult>(12345), &s) == CUDA_ERROR_INVALID_VALUE);
    CHECK(s == nullptr);
    CHECK(error_string(a, CUDA_ERROR_OUT_OF_MEMORY) == "CUDA_ERROR_OUT_OF_MEMORY: out of memory");
    CHECK(error_string(a, CUDA_ERROR_MAP_FAILED).rfind("CUDA_ERROR_MAP_FAILED: ", 0) == 0);
}
