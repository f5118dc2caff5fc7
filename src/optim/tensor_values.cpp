#include "optim/tensor_values.h"

#include <fmt/format.h>

#include <stdexcept>

#ifdef LOCKSTEP_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace lockstep {

void apply_tensor_values(const std::vector<at::Tensor>& targets,
                         const std::vector<int32_t>& index, const at::Tensor& values,
                         kernels::TensorOp op) {
  if (targets.size() != index.size())
    throw std::invalid_argument(fmt::format("{} targets for {} indices", targets.size(),
                                            index.size()));
  if (op != kernels::kScaleBy && op != kernels::kZeroIf)
    throw std::invalid_argument(fmt::format("per-tensor action {}: expected 0 (scale) or 1 (zero)",
                                            static_cast<int>(op)));
  if (values.scalar_type() != at::kFloat || !values.is_contiguous() || values.dim() != 1)
    throw std::invalid_argument("the per-tensor values: a contiguous 1-d fp32 tensor");
  std::vector<kernels::TensorTarget> t;
  for (size_t i = 0; i < targets.size(); ++i) {
    const at::Tensor& x = targets[i];
    if (index[i] < 0 || index[i] >= values.numel())  // the kernel reads values[index[i]]
      throw std::invalid_argument(fmt::format("per-tensor index {} of target {}: outside the {} "
                                              "values",
                                              index[i], i, values.numel()));
    if (x.scalar_type() != at::kFloat || !x.is_contiguous() || x.device() != values.device())
      throw std::invalid_argument("the per-tensor actions take contiguous fp32 tensors on the "
                                  "values' device");
    t.push_back({x.data_ptr<float>(), x.numel(), index[i]});
  }
  if (t.empty()) return;
  const float* v = values.const_data_ptr<float>();
  const int n = static_cast<int>(t.size());
  if (!values.is_cuda()) return kernels::apply_tensor_values_cpu(t.data(), n, v, op);
#ifdef LOCKSTEP_WITH_CUDA
  const auto stream = c10::cuda::getCurrentCUDAStream(values.device().index());
  const int err = kernels::launch_apply_tensor_values(t.data(), n, v, op, stream.stream());
  if (err != 0)
    throw std::runtime_error(fmt::format("the per-tensor actions: kernel launch failed with "
                                         "CUDA error {}",
                                         err));
#else
  throw std::invalid_argument("the per-tensor actions: values on a GPU, lockstep built without "
                              "CUDA");
#endif
}

}  // namespace lockstep
