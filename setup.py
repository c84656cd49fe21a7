"""Builds flash_attn2's CUDA extension (flash_attn2_cuda) with torch.utils.cpp_extension and ninja.

Knobs (environment variables, see README): FLASH_ATTN2_CUDA_ARCHS, FLASH_ATTN2_HEAD_DIMS,
FLASH_ATTN2_DTYPES, FLASH_ATTN2_SM80, FLASH_ATTN2_COMPACT_TILES, MAX_JOBS, CUTLASS_DIR, CUDA_HOME; for debugging,
FLASH_ATTN2_DEBUG_HANG (tools/build_config.py: debug_flags).
"""

import importlib.util
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"


def _load_build_config():
    spec = importlib.util.spec_from_file_location("build_config", os.path.join(ROOT, "tools", "build_config.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cfg = _load_build_config()


def _extension_and_cmdclass():
    import torch
    from torch.utils import cpp_extension

    try:
        cfg.preflight(cpp_extension.CUDA_HOME, torch.version.cuda)
        cutlass_include = cfg.cutlass_include_dir(os.environ, ROOT)
        head_dims = cfg.selected_head_dims()
        dtypes = cfg.selected_dtypes()
        pairs = cfg.selected_head_dim_pairs(head_dims)
        visible = []
        if torch.cuda.is_available():
            visible = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        archs = cfg.selected_archs(os.environ, visible)
        debug = cfg.debug_flags()
        paths = cfg.kernel_paths(archs)
        # torch has libstdc++ loaded by now; cpp_extension links with CXX (else c++).
        link_args = cfg.libstdcxx_link_args(cfg.toolchain_libstdcxx_so(os.environ.get("CXX", "c++")),
                                            cfg.loaded_library("libstdc++.so.6"))
    except (cfg.PreflightError, ValueError) as e:
        sys.exit(f"flash_attn2 build: {e}")

    os.environ["MAX_JOBS"] = str(cfg.max_jobs())
    built = ";".join(cfg.built_arch_names(archs))
    compact_tiles = cfg.compact_tiles(archs)
    compact = f"-DFLASH_ATTN2_COMPACT_TILES={int(compact_tiles)}"
    print(f"flash_attn2 build: archs {built}; paths {'+'.join(paths)}; compact tiles {compact_tiles}; "
          f"head dims {head_dims}; head-dim pairs {[f'{d}x{dv}' for d, dv in pairs] if 'sm90' in paths else []}; "
          f"dtypes {dtypes}; "
          f"MAX_JOBS={os.environ['MAX_JOBS']}; CuTe from {cutlass_include}"
          + (f"; debug {' '.join(debug)}" if debug else "")
          + (f"; libstdc++ from {link_args[0]} (the compiler has only a static one)" if link_args else ""))

    ext = cpp_extension.CUDAExtension(
        name="flash_attn2_cuda",
        sources=[os.path.join(CSRC, "flash_api.cpp"), os.path.join(CSRC, "dispatch.cpp")]
        + [os.path.relpath(p, ROOT) for p in cfg.kernel_sources(os.path.join(ROOT, CSRC), head_dims, dtypes, paths,
                                                                        pairs)],
        include_dirs=[os.path.join(ROOT, CSRC, "include"), os.path.join(ROOT, CSRC, "kernels"), cutlass_include],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", f'-DFLASH_ATTN2_BUILT_ARCHS="{built}"', compact]
            + cfg.kernel_definitions(head_dims, dtypes, paths, pairs),
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG", "-Xptxas=-warn-spills", compact]
            + debug + cfg.gencode_flags(archs),
        },
        extra_link_args=link_args,
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


# Metadata-only invocations (egg_info, dist_info, sdist) need no compiler.
_BUILDS = {"build_ext", "build", "bdist_wheel", "install", "develop", "editable_wheel", "build_py"}
ext_modules, cmdclass = _extension_and_cmdclass() if _BUILDS & set(sys.argv) else ([], {})

setup(ext_modules=ext_modules, cmdclass=cmdclass)
