# The PyTorch package: `pip install --no-build-isolation .` builds lockstep._C from the same
# sources as the harness (cmake/package_sources.txt, the list CMake builds them from: the check,
# the decision, the config reader, the events) with torch's own extension build, against the
# torch already installed. CUDA when that torch has it and nvcc is found (LOCKSTEP_CUDA=0 forces
# the CPU build, =1 requires CUDA). What the build needs is checked first, each missing piece
# named in one line with the command that installs it.
import os
import shutil
import sys
import sysconfig

ROOT = os.path.dirname(os.path.abspath(__file__))


def need(what, fix):
    raise SystemExit(f"lockstep: cannot build the PyTorch package: {what}; {fix}")


def preflight():
    """torch, a wheel builder, ninja, Python.h and a C++ compiler, before anything compiles."""
    pip = f"{sys.executable} -m pip install"
    try:
        import torch  # noqa: F401
    except ImportError:
        need(f"{sys.executable} has no torch", f"install torch first ({pip} torch), then run "
             "`pip install --no-build-isolation .` again (the package builds against that torch)")
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
    except ImportError:
        try:
            import wheel  # noqa: F401
        except ImportError:
            need("setuptools is older than 70.1 and the wheel package is missing (pip's "
                 "`bdist_wheel`)", f"run `{pip} wheel` (or `{pip} -U setuptools`)")
    if shutil.which("ninja") is None:
        need("ninja is not on PATH (torch's extension build compiles in parallel with it; "
             "without it one file at a time, several times slower)",
             f"run `{pip} ninja` (or apt-get install ninja-build)")
    include = sysconfig.get_paths()["include"]
    found = [d for d in [include] + os.environ.get("CPATH", "").split(":")
             if d and os.path.exists(os.path.join(d, "Python.h"))]
    if not found:
        need(f"{include}/Python.h is missing (this Python's C headers)",
             f"install them: apt-get install python{sys.version_info[0]}-dev (Debian, Ubuntu) or "
             f"python{sys.version_info[0]}{sys.version_info[1]}-devel")
    compiler = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(compiler) is None:
        need(f"no C++ compiler ({compiler} is not on PATH)",
             "install g++ 11 or newer (apt-get install g++), or set CXX")


def package_sources(cuda):
    """cmake/package_sources.txt's files (cuda ones only for a CUDA build)."""
    sources = ["python/csrc/ext.cpp"]
    with open(os.path.join(ROOT, "cmake", "package_sources.txt"), encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0].startswith("lockstep_"):
                if len(fields) == 2 or (cuda and fields[2] == "cuda"):
                    sources.append(fields[1])
    return sources


def with_cuda(torch, cuda_home):
    wanted = os.environ.get("LOCKSTEP_CUDA", "auto")
    available = torch.version.cuda is not None and cuda_home is not None
    if wanted == "1" and not available:
        need("LOCKSTEP_CUDA=1 but torch has no CUDA or nvcc was not found",
             "set CUDA_HOME to the CUDA toolkit, or LOCKSTEP_CUDA=0 for the CPU package")
    return available and wanted != "0"


# The harness's flags (CMakeLists.txt): C++20, no FMA contraction (the decision's bits), fmt and
# toml++ header-only (fmt from torch's include folder, so one fmt in the process).
# OpenMP as ATen's at::parallel_for needs it (the gomp torch ships is the one loaded).
CXX = ["-O2", "-std=c++20", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden",
       "-DFMT_HEADER_ONLY=1", "-DTOML_HEADER_ONLY=1", "-Wno-unused-parameter"]
NVCC = ["-O2", "--fmad=false", "-lineinfo", "-DFMT_HEADER_ONLY=1"]


def extension():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))  # ninja: every core
    cuda = with_cuda(torch, CUDA_HOME)
    kind = CUDAExtension if cuda else CppExtension
    return kind(
        name="lockstep._C",
        sources=package_sources(cuda),
        include_dirs=[os.path.join(ROOT, p) for p in ("include", "src", ".")],
        define_macros=[("LOCKSTEP_WITH_CUDA", "1")] if cuda else [],
        extra_compile_args={"cxx": CXX, "nvcc": NVCC} if cuda else {"cxx": CXX},
        extra_link_args=["-fopenmp"],
    )


if __name__ == "__main__":
    try:
        from setuptools import setup
    except ImportError:
        need(f"{sys.executable} has no setuptools", f"run `{sys.executable} -m pip install setuptools`")
    building = not any(a in sys.argv for a in ("egg_info", "dist_info", "--version", "--name"))
    cmdclass = {}
    if building:
        preflight()
        from torch.utils.cpp_extension import BuildExtension
        cmdclass["build_ext"] = BuildExtension
    setup(
        name="lockstep",
        version="0.1.0",
        description="Agreed, explained skipping of bad gradient updates for PyTorch trainers",
        package_dir={"": "python"},
        packages=["lockstep"],
        ext_modules=[extension()] if building else [],
        cmdclass=cmdclass,
        options={"build": {"build_base": "build-python"}},
        python_requires=">=3.10",
    )
