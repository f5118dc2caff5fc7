# The PyTorch package: `pip install --no-build-isolation .` builds lockstep._C from the same
# sources as the harness (kernels/ and src/: the check, the decision, the config reader, the
# events) with torch's own extension build, against the torch already installed. CUDA when that
# torch has it and nvcc is found (LOCKSTEP_CUDA=0 forces the CPU build, =1 requires CUDA).
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

SOURCES = [
    "python/csrc/ext.cpp",
    "kernels/gradcheck_cpu.cpp",
    "kernels/tensor_actions_cpu.cpp",
    "src/check/gradcheck.cpp",
    "src/decide/detector.cpp",
    "src/decide/scope.cpp",
    "src/decide/device_decision.cpp",
    "src/decide/tensor_policies.cpp",
    "src/optim/tensor_values.cpp",
    "src/diag/explain.cpp",
    "src/diag/event.cpp",
    "src/diag/fault.cpp",
    "src/run_state.cpp",
    "src/config.cpp",
    "src/text.cpp",
    "src/fsutil.cpp",
    "src/model/size.cpp",
]
CUDA_SOURCES = ["kernels/gradcheck.cu", "kernels/decision.cu", "kernels/tensor_actions.cu",
                "src/check/gradcheck_cuda.cpp"]


def with_cuda():
    wanted = os.environ.get("LOCKSTEP_CUDA", "auto")
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if wanted == "1" and not available:
        raise SystemExit("LOCKSTEP_CUDA=1 but torch has no CUDA or nvcc was not found "
                         "(set CUDA_HOME); LOCKSTEP_CUDA=0 builds the CPU package")
    return available and wanted != "0"


# The harness's flags (CMakeLists.txt): C++20, no FMA contraction (the decision's bits), fmt and
# toml++ header-only (fmt from torch's include folder, so one fmt in the process).
# OpenMP as ATen's at::parallel_for needs it (the gomp torch ships is the one loaded).
CXX = ["-O2", "-std=c++20", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden", "-DFMT_HEADER_ONLY=1", "-DTOML_HEADER_ONLY=1",
       "-Wno-unused-parameter"]
NVCC = ["-O2", "--fmad=false", "-lineinfo", "-DFMT_HEADER_ONLY=1"]

cuda = with_cuda()
kind = CUDAExtension if cuda else CppExtension
ext = kind(
    name="lockstep._C",
    sources=SOURCES + (CUDA_SOURCES if cuda else []),
    include_dirs=[os.path.abspath(p) for p in ("include", "src", ".")],
    define_macros=[("LOCKSTEP_WITH_CUDA", "1")] if cuda else [],
    extra_compile_args={"cxx": CXX, "nvcc": NVCC} if cuda else {"cxx": CXX},
    extra_link_args=["-fopenmp"],
)

setup(
    name="lockstep",
    version="0.1.0",
    description="Agreed, explained skipping of bad gradient updates for PyTorch trainers",
    package_dir={"": "python"},
    packages=["lockstep"],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
    options={"build": {"build_base": "build-python"}},
    python_requires=">=3.10",
)
