// What CUDA this ringd can use: whether it was built with CUDA, and the devices the driver
// reports. The probe never fails the daemon: no driver or no GPU is a normal state.
#pragma once

#include <string>

namespace ringd {

struct CudaInfo {
    bool built = false;
    int devices = 0;
    std::string error;  // why there are no devices, when there are none
    int runtime_version = 0;
};

CudaInfo probe_cuda();

}  // namespace ringd
