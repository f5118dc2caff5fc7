// The per-tensor actions as kernels: up to kBatch targets a launch, passed in its arguments (no
// pointer table in device memory to keep current); block row y serves target y, and a target
// its value leaves alone returns at once.
#include <cuda_runtime.h>

#include "kernels/tensor_actions.h"

namespace lockstep::kernels {
namespace {

constexpr int kBatch = 32;
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;  // per target; the rest is a grid-stride loop

struct Batch {
  TensorTarget t[kBatch];
};

__global__ void apply_kernel(Batch b, const float* values, TensorOp op) {
  const TensorTarget& t = b.t[blockIdx.y];
  const float v = values[t.index];
  if (op == kScaleBy ? v == 1.0f : v != 1.0f) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < t.numel;
       i += stride)
    t.data[i] = op == kScaleBy ? t.data[i] * v : 0.0f;
}

}  // namespace

int launch_apply_tensor_values(const TensorTarget* targets, int n, const float* values,
                               TensorOp op, void* stream) {
  for (int first = 0; first < n; first += kBatch) {
    Batch b{};
    const int count = n - first < kBatch ? n - first : kBatch;
    int64_t largest = 1;
    for (int i = 0; i < count; ++i) {
      b.t[i] = targets[first + i];
      largest = b.t[i].numel > largest ? b.t[i].numel : largest;
    }
    const int64_t blocks = (largest + kThreads - 1) / kThreads;
    const dim3 grid(static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks),
                    static_cast<unsigned>(count));
    apply_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b, values, op);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return 0;
}

}  // namespace lockstep::kernels
