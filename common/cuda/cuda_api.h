// CudaApi: the narrow table of CUDA driver API functions ringd and libringd-client call, loaded at
// run time. Nothing links against libcuda: `load_cuda()` dlopens the driver of the provider asked
// for and takes every entry through the driver's own cuGetProcAddress (for CUDA 12.0 signatures,
// so the `_v2` variants come out right), the way a host without a driver still starts ringd and
// the client library, and finds out only when CUDA is first used.
//
// Providers:
//   hardware  libcuda.so.1, the NVIDIA driver.
//   emulated  libringd-cuda-emulated.so, ringd's software CUDA device (tests/README in
//             cuda/emulated/): the same entry points with the driver's semantics over host memory,
//             for machines without a GPU. It says so on stderr when initialised.
//
// Every entry has the signature and return convention of the driver function it is named after;
// the types are cuda.h's own (the header comes from the toolkit; no library of it is linked).
#pragma once

#include <cuda.h>

#include <string>

#include "proto/result.h"

namespace ringd::cuda {

enum class Provider { Hardware, Emulated };

// The driver version the table is requested at (CUDA 12.0): every entry below exists there with
// the signature cuda.h declares for it.
inline constexpr int kApiVersion = 12000;

struct CudaApi {
    Provider provider = Provider::Hardware;
    int driver_version = 0;  // cuDriverGetVersion

#define RINGD_CUDA_ENTRY(name) decltype(&::name) name = nullptr;
#define RINGD_CUDA_ENTRIES(X)                                                                              \
    X(cuInit) X(cuDriverGetVersion) X(cuGetErrorString) X(cuGetErrorName)                                  \
    X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetUuid) X(cuDeviceGetName) X(cuDeviceGetAttribute)        \
    X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxGetCurrent)         \
    X(cuCtxGetDevice) X(cuCtxSynchronize)                                                                   \
    X(cuPointerGetAttribute) X(cuMemAlloc) X(cuMemFree) X(cuMemGetAddressRange) X(cuMemsetD8)               \
    X(cuMemcpyHtoD) X(cuMemcpyDtoH) X(cuMemcpyHtoDAsync) X(cuMemcpyDtoHAsync)                               \
    X(cuMemHostRegister) X(cuMemHostUnregister) X(cuMemHostGetDevicePointer) X(cuMemAllocHost)              \
    X(cuMemFreeHost)                                                                                        \
    X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle)                                       \
    X(cuMemGetAllocationGranularity) X(cuMemCreate) X(cuMemRelease) X(cuMemExportToShareableHandle)         \
    X(cuMemImportFromShareableHandle) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap)  \
    X(cuMemSetAccess)                                                                                       \
    X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize) X(cuStreamQuery) X(cuStreamWriteValue32)    \
    X(cuStreamWaitValue32) X(cuLaunchHostFunc)                                                              \
    X(cuEventCreate) X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuEventDestroy)               \
    X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction) X(cuLaunchKernel)
    RINGD_CUDA_ENTRIES(RINGD_CUDA_ENTRY)
#undef RINGD_CUDA_ENTRY

    // The software device's own controls (null with the hardware provider), for tests: delay every
    // later operation enqueued on `stream` by `us` microseconds (a slow producer), and fail the
    // next `count` calls of a kind ("ipc_open", "alloc": CUDA_ERROR_OUT_OF_MEMORY, "import").
    void (*emu_stream_delay)(CUstream stream, unsigned us) = nullptr;
    void (*emu_inject_fault)(const char *kind, int count) = nullptr;
};

// The table of `provider`, loaded and cuInit'ed once per process (thread-safe); later calls return
// the same table or the same error (-ENODEV/-ENOSYS with what failed: no driver, too old, a
// missing entry, cuInit's error).
Result<const CudaApi *> load_cuda(Provider provider);

// "hardware" | "emulated"; an error names the accepted values.
Result<Provider> parse_provider(std::string_view name);
const char *provider_name(Provider p);

// "CUDA_ERROR_OUT_OF_MEMORY: out of memory" for a driver result.
std::string error_string(const CudaApi &api, CUresult r);

// The library the emulated provider loads: $RINGD_CUDA_EMULATED_LIBRARY, else the installed one,
// else the build tree's.
std::string emulated_library_path();

}  // namespace ringd::cuda
