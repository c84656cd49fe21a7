"""Loads the compiled extension and checks that it can run on the current GPU."""

from __future__ import annotations

REBUILD = "pip install --no-build-isolation . (from the flash_attn2 source tree)"


def gpu_supported(built_archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether a binary holding built_archs ("sm_80", "compute_90", ...) runs on a GPU of capability.

    Machine code sm_XY runs on the same major with minor >= Y (sm_90a only on 9.0 exactly); PTX
    compute_XY is compiled by the driver for any GPU of capability >= XY.
    """
    major, minor = capability
    for arch in built_archs:
        kind, _, num = arch.partition("_")
        exact = num.endswith("a")
        num = num.rstrip("af")
        if not num.isdigit():
            continue
        a_major, a_minor = int(num[:-1]), int(num[-1])
        if kind == "sm" and a_major == major and (a_minor == minor if exact else a_minor <= minor):
            return True
        if kind == "compute" and not exact and (a_major, a_minor) <= (major, minor):
            return True
    return False


def arch_error(built_archs: list[str], capability: tuple[int, int], device_name: str) -> str | None:
    if gpu_supported(built_archs, capability):
        return None
    sm = f"{capability[0]}{capability[1]}"
    if int(sm) < 80:
        return (f"flash_attn2 needs an sm_80 (Ampere) or newer GPU; {device_name} is sm_{sm}")
    return (f"flash_attn2 was built for {', '.join(built_archs)}, which cannot run on {device_name} (sm_{sm}). "
            f"Rebuild for it: FLASH_ATTN2_CUDA_ARCHS={sm} {REBUILD}")


def load():
    try:
        import flash_attn2_cuda as ext
    except ImportError as e:
        raise ImportError(
            f"flash_attn2: the CUDA extension flash_attn2_cuda is not built or failed to load ({e}). "
            f"Build it with: {REBUILD}") from e
    import torch

    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        message = arch_error(ext.built_archs.split(";"), torch.cuda.get_device_capability(device),
                             torch.cuda.get_device_name(device))
        if message:
            raise ImportError(message)
    return ext
