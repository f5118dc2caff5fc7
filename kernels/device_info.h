// CUDA runtime, driver and NCCL versions. Framework-free: no LibTorch types.
#pragma once

namespace lockstep::kernels {

struct DeviceInfo {
  int runtime_version = 0;           // cudaRuntimeGetVersion, e.g. 13000
  int compiled_runtime_version = 0;  // CUDART_VERSION this file was compiled with
  int driver_version = 0;            // 0 when no driver is installed
  int device_count = 0;
  int nccl_version = 0;              // ncclGetVersion, e.g. 23007
  char device_name[256] = {};       // device 0, when there is one
};

DeviceInfo query_device_info();

}  // namespace lockstep::kernels
