#include "kernels/tensor_actions.h"

namespace lockstep::kernels {

void apply_tensor_values_cpu(const TensorTarget* targets, int n, const float* values,
                             TensorOp op) {
  for (int t = 0; t < n; ++t) {
    const float v = values[targets[t].index];
    float* x = targets[t].data;
    if (op == kScaleBy && v != 1.0f)
      for (int64_t i = 0; i < targets[t].numel; ++i) x[i] = x[i] * v;
    if (op == kZeroIf && v == 1.0f)
      for (int64_t i = 0; i < targets[t].numel; ++i) x[i] = 0.0f;
  }
}

}  // namespace lockstep::kernels
