"""Build script of nebula_ckpt (the Python package plus the optional native extension).

Environment switches:
  NEBULA_NO_EXTENSION=1   pure-Python install, no nebula_ckpt._C (no C++ compiler needed)
  NEBULA_FORCE_CUDA=1     build the CUDA parts even without a visible GPU (needs CUDA_HOME)
"""

from __future__ import annotations

import ast
import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _read_version() -> str:
    """``__version__`` of nebula_ckpt/_version.py, parsed (importing the package needs torch)."""
    path = os.path.join(ROOT, "nebula_ckpt", "_version.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__version__"):
            return str(ast.literal_eval(node.value))
    raise RuntimeError(f"{path} does not assign __version__")


VERSION = _read_version()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _torch_cxx_runtime() -> list[str]:
    """The shared libstdc++ this process (i.e. torch) runs on, as a link input; [] if none is mapped.

    Call after ``import torch``. The extension passes C++ runtime objects to torch's libraries
    (``std::ostream`` through c10's ``operator<<`` when building an error message, ``std::string``
    in ``c10::Error``), so it must use torch's libstdc++, not a private copy. Toolchains that
    link libstdc++ statically by default (some images wrap g++ with ``-static-libstdc++``) gave
    the extension its own copy: its locale facet ids differ from the shared library's, and the
    first error message that streamed a ``c10::Device`` crashed the process (SIGSEGV in
    ``CopyEngine::enqueue``). Naming the shared library ahead of the driver's implicit
    ``-lstdc++`` makes the linker bind every C++ runtime symbol to it (an archive is only searched
    for symbols still undefined).
    """
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "/libstdc++.so" in line}
    except OSError:  # not Linux
        return []
    return sorted(p for p in paths if os.path.isfile(p))[:1]


NO_COMPILER = """
nebula_ckpt: the C++ extension cannot be built: {why}.
  - install a C++ compiler (Debian/Ubuntu: apt-get install g++; RHEL: dnf install gcc-c++; macOS: xcode-select --install)
    and run the install again, or
  - install without the extension: NEBULA_NO_EXTENSION=1 pip install --no-build-isolation -e .
    (the library then runs its pure-PyTorch path: the same bytes on disk, saves that block longer)
"""


def _compiler() -> str:
    """The C++ compiler the build will call (``CXX``, else ``c++``)."""
    return (os.environ.get("CXX") or "c++").split()[0]


def _check_compiler() -> None:
    """Stop with a message naming the way out when there is no C++ compiler (no traceback)."""
    import shutil

    if shutil.which(_compiler()) is None:
        raise SystemExit(NO_COMPILER.format(why=f"no C++ compiler ({_compiler()!r} is not on PATH)"))


def _friendly(build_ext: type) -> type:
    """``build_ext`` whose compiler failures end in :data:`NO_COMPILER`'s message, not a traceback."""

    class FriendlyBuildExt(build_ext):  # type: ignore[misc, valid-type]
        def run(self) -> None:
            try:
                super().run()
            except Exception as e:  # a compiler error, a missing header, ninja failing
                raise SystemExit(NO_COMPILER.format(why=f"the build failed ({type(e).__name__}: {e})")) from None

    return FriendlyBuildExt


def _extensions_and_cmdclass():
    if _env_flag("NEBULA_NO_EXTENSION"):
        return [], {}

    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        import warnings

        warnings.warn("nebula_ckpt: torch is not importable in this build environment, so the C++ "
                      "extension is not built (the pure-PyTorch path will run). Install torch first and "
                      "build with: pip install --no-build-isolation -e .", stacklevel=1)
        return [], {}

    # Relative paths: setuptools wants sources relative to setup.py.
    sources = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))
    cuda_sources = sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))
    )
    want_cuda = torch.cuda.is_available() or _env_flag("NEBULA_FORCE_CUDA")
    with_cuda = bool(want_cuda and CUDA_HOME and cuda_sources)

    # No -std here: torch's BuildExtension adds the standard its headers need
    # (C++20 for recent torch); the sources themselves are C++17-clean.
    # No -fopenmp: all parallelism is std::thread, independent of ATen's pool.
    # The CRC32C hardware path uses __attribute__((target("sse4.2"))) with
    # runtime CPU detection, so no -msse4.2 (the binary runs on any x86-64).
    # -g0 overrides the -g in Python's CFLAGS (15 MB of debug info otherwise);
    # NEBULA_DEBUG=1 builds an unoptimised, debuggable extension instead.
    if _env_flag("NEBULA_DEBUG"):
        cxx_flags = ["-O0", "-g"]
    else:
        cxx_flags = ["-O3", "-g0"]
    cxx_flags += ["-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    # The extension reports the package version (build_info()), from the same single source.
    define_macros: list[tuple[str, str | None]] = [("NEBULA_VERSION", f'"{VERSION}"')]

    common = dict(
        name="nebula_ckpt._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros,
        extra_link_args=_torch_cxx_runtime() + ["-lpthread"],
    )
    if with_cuda:
        define_macros.append(("NEBULA_WITH_CUDA", None))
        ext = CUDAExtension(
            sources=sources + cuda_sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            **common,
        )
    else:
        ext = CppExtension(sources=sources, extra_compile_args={"cxx": cxx_flags}, **common)

    if any(a.startswith(("build", "bdist", "install", "develop", "editable")) for a in sys.argv[1:]) or not sys.argv[1:]:
        _check_compiler()
    return [ext], {"build_ext": _friendly(BuildExtension.with_options(use_ninja=True))}


ext_modules, cmdclass = _extensions_and_cmdclass()

setup(
    name="nebula_ckpt",
    version=VERSION,
    description="Fast asynchronous checkpointing for PyTorch",
    python_requires=">=3.10",
    packages=find_packages(include=["nebula_ckpt", "nebula_ckpt.*"]),
    package_data={"nebula_ckpt": ["py.typed", "_C.pyi"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.1",
        "safetensors>=0.4",
        "fsspec>=2023.1",
        "numpy",
        "tqdm",
        "crc32c>=2.3",
    ],
    extras_require={
        "azure": ["adlfs", "azure-storage-blob"],
        "s3": ["s3fs"],
        "zstd": ["zstandard"],
        "bench": ["matplotlib", "psutil"],
        "test": ["pytest", "psutil"],
        # framework integrations (nebula_ckpt.integrations.*): versions they are tested with
        "huggingface": ["transformers>=5.0", "accelerate>=1.1.0"],
        "lightning": ["pytorch-lightning>=2.6"],
        "deepspeed": ["deepspeed>=0.19"],
    },
    entry_points={"console_scripts": ["nebula-ckpt = nebula_ckpt.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
