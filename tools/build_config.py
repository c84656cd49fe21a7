"""Build knobs and preflight checks for setup.py (and the rules CMakeLists.txt mirrors).

Not part of the installed package: setup.py and the tests load this file by path, without torch or the
extension, so the CPU tests can exercise every rule here.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = ("fp16", "bf16")
MIN_ARCH = 80  # the kernels use SM80 tensor-core MMA (mma.sync), valid on sm_80 and newer
DEFAULT_ARCHS = ("80", "90")  # with PTX for the newest, when no GPU is visible at build time
HOPPER = "90"  # the arch of the sm_90a forward (csrc/kernels/sm90/)
# The head dims the Hopper backward has kernels for (csrc/instantiations/bwd_hdim*_sm90.cu): the one list, which
# CMakeLists.txt reads from this line and dispatch.cpp gets as FLASH_ATTN2_SM90_BWD_HEAD_DIMS.
BWD_SM90_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# The (Q / K, V / O) head-dim pairs the Hopper forward has kernels for (csrc/instantiations/fwd_hdim*x*_sm90.cu;
# MLA: DeepSeek-V3's (192, 128)); CMakeLists.txt reads this line too, dispatch.cpp's table lists the same pairs.
PAIRS = ((192, 128),)
GB = 1 << 30
# Peak resident memory of one nvcc job, nvcc 13.0 (benchmarks/dev/nvcc_mem.py): the SM80 backward files
# compiled for sm_90 (FLASH_ATTN2_SM80=1) 4.7-5.0 GiB at head dim 96-128, the Hopper backward's at head dim 256
# 4.0 GiB, the Hopper forward's 2.1-2.8 GiB (TUNING 91, 93); an SM80 backward file with its compact tiles (sm_80)
# 4.8 GiB. Rounded up for headroom.
MEM_PER_JOB = 6 * GB


def _parse_list(value: str) -> list[str]:
    return [item for item in re.split(r"[,;\s]+", value.strip()) if item]


def selected_head_dims(env=os.environ) -> list[int]:
    """FLASH_ATTN2_HEAD_DIMS, e.g. "64,128"; default: every bucket."""
    value = env.get("FLASH_ATTN2_HEAD_DIMS", "")
    if not value.strip():
        return list(HEAD_DIMS)
    dims = []
    for item in _parse_list(value):
        if not item.isdigit() or int(item) not in HEAD_DIMS:
            raise ValueError(f"FLASH_ATTN2_HEAD_DIMS: {item!r} is not one of {', '.join(map(str, HEAD_DIMS))}")
        dims.append(int(item))
    return sorted(set(dims))


def selected_head_dim_pairs(head_dims: list[int], env=os.environ) -> list[tuple[int, int]]:
    """FLASH_ATTN2_HEAD_DIM_PAIRS, e.g. "192x128", or "none"; default: every pair of PAIRS whose Q / K head dim is
    compiled (a pair's call falls back to that head dim's kernels, v padded, where its own kernel cannot run)."""
    value = env.get("FLASH_ATTN2_HEAD_DIM_PAIRS", "").strip().lower()
    if not value:
        return [pair for pair in PAIRS if pair[0] in head_dims]
    if value == "none":
        return []
    names = {f"{d}x{dv}": (d, dv) for d, dv in PAIRS}
    pairs = []
    for item in _parse_list(value):
        if item not in names:
            raise ValueError(f"FLASH_ATTN2_HEAD_DIM_PAIRS: {item!r} is not one of {', '.join(names)} (or none)")
        if names[item][0] not in head_dims:
            raise ValueError(f"FLASH_ATTN2_HEAD_DIM_PAIRS: {item} needs head dim {names[item][0]} in "
                             f"FLASH_ATTN2_HEAD_DIMS (its calls fall back to it)")
        pairs.append(names[item])
    return [pair for pair in PAIRS if pair in pairs]


def selected_dtypes(env=os.environ) -> list[str]:
    """FLASH_ATTN2_DTYPES, e.g. "bf16"; default: fp16 and bf16."""
    value = env.get("FLASH_ATTN2_DTYPES", "")
    if not value.strip():
        return list(DTYPES)
    dtypes = []
    for item in _parse_list(value.lower()):
        if item not in DTYPES:
            raise ValueError(f"FLASH_ATTN2_DTYPES: {item!r} is not one of {', '.join(DTYPES)}")
        dtypes.append(item)
    return [d for d in DTYPES if d in dtypes]


def selected_archs(env=os.environ, visible_capabilities=()) -> list[str]:
    """Targets as "80", "90", ...; "+PTX" on the last one embeds PTX too.

    FLASH_ATTN2_CUDA_ARCHS (e.g. "80;90+PTX" or "8.0 9.0") wins; else the visible GPUs' archs; else
    sm_80 and sm_90 plus PTX.
    """
    value = env.get("FLASH_ATTN2_CUDA_ARCHS", "")
    if value.strip():
        archs = []
        for item in _parse_list(value):
            m = re.fullmatch(r"(?:sm_)?(\d+)\.?(\d)?(\+PTX)?", item, flags=re.IGNORECASE)
            if not m:
                raise ValueError(f"FLASH_ATTN2_CUDA_ARCHS: cannot read {item!r}; write e.g. 80;90 or 9.0+PTX")
            arch = m.group(1) + (m.group(2) or "")
            if int(arch) < MIN_ARCH:
                raise ValueError(f"FLASH_ATTN2_CUDA_ARCHS: sm_{arch} is older than sm_{MIN_ARCH}, which the kernels need")
            archs.append(arch + ("+PTX" if m.group(3) else ""))
        return archs
    visible = sorted({f"{major}{minor}" for major, minor in visible_capabilities if major * 10 + minor >= MIN_ARCH})
    if visible:
        return visible
    return [DEFAULT_ARCHS[0], DEFAULT_ARCHS[1] + "+PTX"]


def built_arch_names(archs: list[str]) -> list[str]:
    """What the binary holds: sm_XY for machine code (sm_90a for 90: the Hopper kernels need its wgmma and
    TMA, and sm_90a code runs on sm_90 GPUs only), compute_XY for PTX."""
    names = []
    for arch in archs:
        num = arch.replace("+PTX", "")
        names.append(f"sm_{num}a" if num == HOPPER else f"sm_{num}")
        if arch.endswith("+PTX"):
            names.append(f"compute_{num}")
    return names


def gencode_flags(archs: list[str]) -> list[str]:
    """nvcc flags embedding each of built_arch_names(archs)."""
    flags = []
    for name in built_arch_names(archs):
        virtual = name.replace("sm_", "compute_")
        flags.append(f"-gencode=arch={virtual},code={name}")
    return flags


def max_jobs(env=os.environ, cpus: int | None = None, available_bytes: int | None = None) -> int:
    """MAX_JOBS if set; else as many parallel nvcc jobs as both the cores and the free memory allow."""
    if env.get("MAX_JOBS", "").strip():
        return max(1, int(env["MAX_JOBS"]))
    cpus = cpus if cpus is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if available_bytes is None:
        available_bytes = _available_memory()
    by_memory = available_bytes // MEM_PER_JOB if available_bytes else cpus
    return int(max(1, min(cpus, by_memory)))


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kernel_paths(archs: list[str], env=os.environ) -> list[str]:
    """Which kernel paths to build, forward and backward alike: "sm90" (TMA + wgmma) for an sm_90 target,
    "sm80" (mma.sync) for every other target, and on an sm_90-only build too when FLASH_ATTN2_SM80=1
    (comparison, fallback)."""
    nums = [a.replace("+PTX", "") for a in archs]
    paths = []
    if any(n != HOPPER for n in nums) or env.get("FLASH_ATTN2_SM80", "0") not in ("", "0"):
        paths.append("sm80")
    if HOPPER in nums:
        paths.append("sm90")
    return paths


def bwd_sm90_kernel_dim(head_dim: int) -> int:
    """The Hopper backward kernel serving a head dim: its own, or for 160 and 224 the 192 / 256 one
    (dispatch.cpp: bwd_sm90_kernel_dim)."""
    return next(d for d in BWD_SM90_HEAD_DIMS if d >= head_dim)


def compact_tiles(archs: list[str], env=os.environ) -> bool:
    """Whether the SM80 kernels also compile their compact tiles (backward: one Q / dO buffer), which GPUs
    with less shared memory per block than the full tiles need (A100 at head dims 224/256, sm_86/89 at all).
    By default wherever the binary may meet such a GPU: any target but sm_90 machine code (an sm_80-89 one,
    or PTX, which a newer GPU with 99 KB per block would JIT); FLASH_ATTN2_COMPACT_TILES=0 / 1 decides instead."""
    value = env.get("FLASH_ATTN2_COMPACT_TILES", "").strip()
    if value:
        return value != "0"
    return any(arch != HOPPER for arch in archs)


def debug_flags(env=os.environ) -> list[str]:
    """FLASH_ATTN2_DEBUG_HANG=<cycles> (a positive integer): the Hopper kernels' barrier waits print where they wait
    and trap once a wait passes that many cycles (csrc/kernels/sm90/wgmma.h), so a hang ends as a launch failure
    that says where it waited. Unset or 0: a normal build."""
    value = env.get("FLASH_ATTN2_DEBUG_HANG", "").strip()
    if value in ("", "0"):
        return []
    if not value.isdigit():
        raise ValueError(f"FLASH_ATTN2_DEBUG_HANG: {value!r} is not a cycle count (e.g. 2000000000, about a second)")
    return [f"-DFLASH_ATTN2_DEBUG_HANG={int(value)}"]


def kernel_sources(csrc: str, head_dims: list[int], dtypes: list[str], paths=("sm80",), pairs=()) -> list[str]:
    """One file per (direction, head dim, dtype[, arch]) of each path, the Hopper backward's for the kernels
    that serve the head dims, the Hopper forward's for each head-dim pair, the split-KV forward's for every path;
    the dtype-generic helpers of the backward and of the split-KV forward are always built."""
    def file(direction, d, t, suffix=""):
        return os.path.join(csrc, "instantiations", f"{direction}_hdim{d}_{t}{suffix}.cu")
    files = []
    if "sm80" in paths:
        files += [file(direction, d, t) for direction in ("fwd", "bwd") for d in head_dims for t in dtypes]
    if "sm90" in paths:
        files += [file("fwd", d, t, "_sm90") for d in head_dims for t in dtypes]
        files += [file("bwd", d, t, "_sm90") for d in sorted({bwd_sm90_kernel_dim(d) for d in head_dims})
                  for t in dtypes]
        files += [file("fwd", f"{d}x{dv}", t, "_sm90") for d, dv in pairs for t in dtypes]
    # The split-KV forward (SM80 tensor cores) serves decode and KV-cache calls on every path.
    files += [file("fwd_split", d, t) for d in head_dims for t in dtypes]
    return files + [os.path.join(csrc, "bwd_aux.cu"), os.path.join(csrc, "fwd_aux.cu")]


def kernel_definitions(head_dims: list[int], dtypes: list[str], paths=("sm80",), pairs=()) -> list[str]:
    """Compile definitions naming the instantiated kernels for dispatch.cpp's table (CMakeLists.txt mirrors it);
    the pairs flattened, each number followed by a comma ("192,128,"; empty for none or without the Hopper path)."""
    pair_list = "".join(f"{d},{dv}," for d, dv in pairs) if "sm90" in paths else ""
    return [f"-DFLASH_ATTN2_COMPILED_HEAD_DIMS={','.join(map(str, head_dims))}",
            f"-DFLASH_ATTN2_COMPILED_FP16={int('fp16' in dtypes)}",
            f"-DFLASH_ATTN2_COMPILED_BF16={int('bf16' in dtypes)}",
            f"-DFLASH_ATTN2_COMPILED_SM80={int('sm80' in paths)}",
            f"-DFLASH_ATTN2_COMPILED_SM90={int('sm90' in paths)}",
            f"-DFLASH_ATTN2_SM90_BWD_HEAD_DIMS={','.join(map(str, BWD_SM90_HEAD_DIMS))}",
            f"-DFLASH_ATTN2_FWD_SM90_PAIRS={pair_list}"]


class PreflightError(RuntimeError):
    pass


def nvcc_version(nvcc: str) -> tuple[int, int]:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise PreflightError(f"could not read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def preflight(cuda_home: str | None, torch_cuda: str | None) -> str:
    """Fails fast, saying what to do, when nvcc is missing or its CUDA major differs from torch's."""
    if torch_cuda is None:
        raise PreflightError(
            "this torch is a CPU-only build (torch.version.cuda is None); install a CUDA build of torch "
            "(e.g. pip install torch==2.11.0) before building flash_attn2")
    if not cuda_home:
        raise PreflightError("CUDA_HOME is not set and no nvcc was found; install the CUDA toolkit and set "
                             "CUDA_HOME=/usr/local/cuda (the directory holding bin/nvcc)")
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if not os.path.isfile(nvcc):
        raise PreflightError(f"no nvcc at {nvcc}; set CUDA_HOME to the CUDA toolkit's directory (holding bin/nvcc)")
    major, minor = nvcc_version(nvcc)
    torch_major = int(torch_cuda.split(".")[0])
    if major != torch_major:
        raise PreflightError(
            f"nvcc at {nvcc} is CUDA {major}.{minor} but torch was built with CUDA {torch_cuda}; the major "
            f"versions must match: point CUDA_HOME at a CUDA {torch_major}.x toolkit or install a torch built for CUDA {major}")
    return nvcc


def cutlass_include_dir(env=os.environ, repo_root: str = ".") -> str:
    """CUTLASS_DIR (a CUTLASS checkout), else third_party/cutlass, else the nvidia-cutlass package."""
    candidates = []
    if env.get("CUTLASS_DIR", "").strip():
        candidates.append(("CUTLASS_DIR", os.path.join(env["CUTLASS_DIR"], "include")))
    else:
        checkout = os.path.join(repo_root, "third_party", "cutlass", "include")
        if os.path.isdir(checkout):
            candidates.append(("third_party/cutlass", checkout))
        else:
            try:
                import cutlass_library
                candidates.append(("nvidia-cutlass", os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")))
            except ImportError:
                raise PreflightError("CuTe/CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0, or set "
                                     "CUTLASS_DIR to a CUTLASS checkout, or clone one into third_party/cutlass") from None
    origin, include = candidates[0]
    if not os.path.isfile(os.path.join(include, "cute", "tensor.hpp")):
        raise PreflightError(f"{origin}: no cute/tensor.hpp under {include}")
    return include


def loaded_library(soname: str, maps: str = "/proc/self/maps") -> str | None:
    """The file this process has the library `soname` (e.g. libstdc++.so.6) mapped from, if any (Linux):
    the soname itself or a versioned name behind it (libstdc++.so.6.0.33)."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                name = os.path.basename(path)
                if name == soname or name.startswith(soname + "."):
                    return path
    except OSError:
        pass
    return None


def libstdcxx_link_args(toolchain_libstdcxx_so: str, torch_libstdcxx: str | None) -> list[str]:
    """Keeps libstdc++ shared. A toolchain with only libstdc++.a (its `-print-file-name=libstdc++.so`
    answers the bare name) copies it into the extension, where -Bsymbolic-functions binds the copy's
    functions locally but its data (the locale facets' ids) to the libstdc++.so.6 torch already loaded:
    every C++ error that formats a number then crashes the process. Naming that libstdc++.so.6 ahead of
    the driver's -lstdc++ leaves the archive nothing to supply."""
    if os.path.isabs(toolchain_libstdcxx_so) or torch_libstdcxx is None:
        return []
    return [torch_libstdcxx]


def toolchain_libstdcxx_so(cxx: str) -> str:
    """What `cxx -print-file-name=libstdc++.so` answers: a path where the toolchain has the shared library."""
    try:
        out = subprocess.run([*shlex.split(cxx), "-print-file-name=libstdc++.so"], capture_output=True, text=True, timeout=60)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "/"  # not a GCC-style driver: leave its linking alone
