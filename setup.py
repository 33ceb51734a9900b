"""Builds pt2e_fq._C against the torch that is already installed.

PT2E_FQ_CUDA=auto (default) adds the CUDA kernels when torch was built with
CUDA and nvcc is found; 1 requires them; 0 builds the CPU kernels only.
Install with `pip install --no-build-isolation .` so the build uses your torch.
"""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("pt2e_fq", "csrc")


def want_cuda() -> bool:
    mode = os.environ.get("PT2E_FQ_CUDA", "auto")
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"PT2E_FQ_CUDA must be auto, 0 or 1, got {mode!r}")
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if mode == "1" and not available:
        raise SystemExit(
            "PT2E_FQ_CUDA=1 but the CUDA build is not possible: "
            f"torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={CUDA_HOME!r}"
        )
    return mode == "1" or (mode == "auto" and available)


def extension():
    # common/: the schemas, and the argument checks both builds share.
    sources = sorted(glob.glob(os.path.join(CSRC, "common", "*.cpp")))
    sources += sorted(glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    # No FMA contraction: every kernel rounds exactly as the reference does.
    cxx = ["-O3", "-ffp-contract=off", "-fopenmp", "-fno-math-errno"]
    kwargs = dict(
        include_dirs=[os.path.join(HERE, CSRC, "include"), os.path.join(HERE, CSRC, "common")],
        extra_compile_args={"cxx": cxx},
        # _C uses only the stable ABI of CPython 3.10 (no pybind11, no
        # libtorch_python: the ops register through the dispatcher), so one
        # module, _C.abi3.so, serves every CPython from 3.10 on.
        # BuildExtension defines the same Py_LIMITED_API; said here, it stays
        # in step with the cp310 wheel tag below.
        py_limited_api=True,
        define_macros=[("Py_LIMITED_API", "0x030A0000")],
    )
    if not want_cuda():
        return CppExtension("pt2e_fq._C", sources, **kwargs)
    sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cpp")))
    kwargs["extra_compile_args"]["nvcc"] = ["-O3", "--fmad=false"]
    return CUDAExtension("pt2e_fq._C", sources, **kwargs)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
