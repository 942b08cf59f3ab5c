#include "daemon/cuda/cuda_probe.h"

#ifdef RINGD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ringd {

CudaInfo probe_cuda() {
    CudaInfo info;
#ifdef RINGD_HAVE_CUDA
    info.built = true;
    cudaRuntimeGetVersion(&info.runtime_version);
    const cudaError_t e = cudaGetDeviceCount(&info.devices);
    if (e != cudaSuccess) {
        info.devices = 0;
        info.error = cudaGetErrorString(e);
    }
#else
    info.error = "ringd was built without CUDA";
#endif
    return info;
}

}  // namespace ringd
