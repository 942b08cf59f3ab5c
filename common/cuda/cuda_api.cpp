#include "common/cuda/cuda_api.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>

namespace ringd::cuda {
namespace {

using GetProcAddress = CUresult (*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
using GetProcAddressV1 = CUresult (*)(const char *, void **, int, cuuint64_t);

std::string dl_error() {
    const char *e = ::dlerror();
    return e ? e : "unknown dlopen error";
}

Result<const CudaApi *> load(Provider provider, CudaApi &api) {
    api.provider = provider;
    const std::string lib = provider == Provider::Hardware ? "libcuda.so.1" : emulated_library_path();
    // RTLD_LOCAL: the driver's symbols stay out of the global namespace (a process may have both).
    void *h = ::dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return make_error(-ENODEV, std::string(provider_name(provider)) + " CUDA provider: cannot load " + lib + ": " +
                                       dl_error());
    auto get_version = reinterpret_cast<CUresult (*)(int *)>(::dlsym(h, "cuDriverGetVersion"));
    auto gpa = reinterpret_cast<GetProcAddress>(::dlsym(h, "cuGetProcAddress_v2"));
    auto gpa1 = reinterpret_cast<GetProcAddressV1>(::dlsym(h, "cuGetProcAddress"));
    if (!get_version || (!gpa && !gpa1))
        return make_error(-ENOSYS, lib + " has no cuDriverGetVersion/cuGetProcAddress (a driver older than CUDA 11.3)");
    if (CUresult r = get_version(&api.driver_version); r != CUDA_SUCCESS)
        return make_error(-ENODEV, lib + ": cuDriverGetVersion failed (" + std::to_string(r) + ")");
    if (api.driver_version < kApiVersion)
        return make_error(-ENOSYS, lib + " is CUDA " + std::to_string(api.driver_version / 1000) + "." +
                                       std::to_string(api.driver_version % 1000 / 10) + "; ringd needs 12.0 or newer");
    std::string missing;
    auto take = [&](const char *name, auto &entry) {
        void *fn = nullptr;
        CUdriverProcAddressQueryResult status{};
        const CUresult r = gpa ? gpa(name, &fn, kApiVersion, CU_GET_PROC_ADDRESS_DEFAULT, &status)
                               : gpa1(name, &fn, kApiVersion, CU_GET_PROC_ADDRESS_DEFAULT);
        if (r != CUDA_SUCCESS || !fn) {
            missing += missing.empty() ? name : std::string(", ") + name;
            return;
        }
        entry = reinterpret_cast<std::remove_reference_t<decltype(entry)>>(fn);
    };
#define RINGD_CUDA_TAKE(name) take(#name, api.name);
    RINGD_CUDA_ENTRIES(RINGD_CUDA_TAKE)
#undef RINGD_CUDA_TAKE
    if (!missing.empty()) return make_error(-ENOSYS, lib + " lacks " + missing);
    if (provider == Provider::Emulated) {
        api.emu_stream_delay = reinterpret_cast<void (*)(CUstream, unsigned)>(::dlsym(h, "ringd_emu_stream_delay"));
        api.emu_inject_fault = reinterpret_cast<void (*)(const char *, int)>(::dlsym(h, "ringd_emu_inject_fault"));
        if (!api.emu_stream_delay || !api.emu_inject_fault)
            return make_error(-ENOSYS, lib + " is not ringd's software CUDA device (no ringd_emu_* controls)");
    }
    if (CUresult r = api.cuInit(0); r != CUDA_SUCCESS)
        return make_error(-ENODEV, std::string(provider_name(provider)) + " CUDA provider: cuInit: " +
                                       error_string(api, r));
    return &api;  // the library stays loaded for the life of the process
}

}  // namespace

Result<const CudaApi *> load_cuda(Provider provider) {
    struct Loaded {
        std::once_flag once;
        CudaApi api;
        Result<const CudaApi *> result = make_error(-ENODEV, "not loaded");
    };
    static Loaded loaded[2];
    Loaded &l = loaded[provider == Provider::Hardware ? 0 : 1];
    std::call_once(l.once, [&] { l.result = load(provider, l.api); });
    return l.result;
}

Result<Provider> parse_provider(std::string_view name) {
    if (name == "hardware") return Provider::Hardware;
    if (name == "emulated") return Provider::Emulated;
    return make_error(-EINVAL, "CUDA provider '" + std::string(name) + "' is not hardware or emulated");
}

const char *provider_name(Provider p) { return p == Provider::Hardware ? "hardware" : "emulated"; }

std::string error_string(const CudaApi &api, CUresult r) {
    const char *name = nullptr;
    const char *text = nullptr;
    if (api.cuGetErrorName) api.cuGetErrorName(r, &name);
    if (api.cuGetErrorString) api.cuGetErrorString(r, &text);
    std::string s = name ? name : "CUDA error " + std::to_string(static_cast<int>(r));
    if (text) s += std::string(": ") + text;
    return s;
}

std::string emulated_library_path() {
    if (const char *p = std::getenv("RINGD_CUDA_EMULATED_LIBRARY"); p && *p) return p;
    for (const char *candidate : {RINGD_CUDA_EMULATED_INSTALLED, RINGD_CUDA_EMULATED_BUILT})
        if (::access(candidate, R_OK) == 0) return candidate;
    return RINGD_CUDA_EMULATED_INSTALLED;
}

}  // namespace ringd::cuda
