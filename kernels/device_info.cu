#include <cuda_runtime_api.h>
#include <nccl.h>

#include "kernels/device_info.h"

namespace lockstep::kernels {

DeviceInfo query_device_info() {
  DeviceInfo d;
  d.compiled_runtime_version = CUDART_VERSION;
  cudaRuntimeGetVersion(&d.runtime_version);
  if (cudaDriverGetVersion(&d.driver_version) != cudaSuccess) d.driver_version = 0;
  if (cudaGetDeviceCount(&d.device_count) != cudaSuccess) {
    d.device_count = 0;
    cudaGetLastError();  // clear the sticky "no device" error
  }
  if (d.device_count > 0) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
      for (size_t i = 0; i + 1 < sizeof d.device_name && prop.name[i]; ++i)
        d.device_name[i] = prop.name[i];
  }
  ncclGetVersion(&d.nccl_version);
  return d;
}

}  // namespace lockstep::kernels
