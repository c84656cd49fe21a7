"""setup.py's knobs and preflight checks (CPU)."""

import os
import stat

import build_config as cfg  # tools/build_config.py (conftest.py puts tools/ on the path)
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_head_dims_and_dtypes():
    assert cfg.selected_head_dims({}) == [32, 64, 96, 128, 160, 192, 224, 256]
    assert cfg.selected_head_dims({"FLASH_ATTN2_HEAD_DIMS": "128, 64;64"}) == [64, 128]
    with pytest.raises(ValueError, match="FLASH_ATTN2_HEAD_DIMS: '48'"):
        cfg.selected_head_dims({"FLASH_ATTN2_HEAD_DIMS": "64,48"})
    assert cfg.selected_dtypes({}) == ["fp16", "bf16"]
    assert cfg.selected_dtypes({"FLASH_ATTN2_DTYPES": "BF16"}) == ["bf16"]
    with pytest.raises(ValueError, match="FLASH_ATTN2_DTYPES: 'fp32'"):
        cfg.selected_dtypes({"FLASH_ATTN2_DTYPES": "fp32"})


def test_archs():
    assert cfg.selected_archs({}, []) == ["80", "90+PTX"]
    assert cfg.selected_archs({}, [(9, 0), (9, 0), (7, 5)]) == ["90"]
    assert cfg.selected_archs({"FLASH_ATTN2_CUDA_ARCHS": "8.0;9.0+PTX"}, [(9, 0)]) == ["80", "90+PTX"]
    assert cfg.selected_archs({"FLASH_ATTN2_CUDA_ARCHS": "sm_90"}) == ["90"]
    with pytest.raises(ValueError, match="older than sm_80"):
        cfg.selected_archs({"FLASH_ATTN2_CUDA_ARCHS": "75"})
    with pytest.raises(ValueError, match="cannot read 'hopper'"):
        cfg.selected_archs({"FLASH_ATTN2_CUDA_ARCHS": "hopper"})
    assert cfg.gencode_flags(["80", "90+PTX"]) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90,code=compute_90"]
    assert cfg.built_arch_names(["80", "90+PTX"]) == ["sm_80", "sm_90a", "compute_90"]


def test_max_jobs_respects_cores_and_memory():
    assert cfg.max_jobs({"MAX_JOBS": "3"}, cpus=64, available_bytes=1) == 3
    assert cfg.max_jobs({}, cpus=16, available_bytes=1000 * cfg.GB) == 16
    assert cfg.max_jobs({}, cpus=16, available_bytes=2 * cfg.MEM_PER_JOB + cfg.GB) == 2
    assert cfg.max_jobs({}, cpus=16, available_bytes=1 * cfg.GB) == 1


def test_kernel_sources_exist():
    sources = cfg.kernel_sources(os.path.join(ROOT, "csrc"), cfg.selected_head_dims({}), cfg.selected_dtypes({}),
                                 ("sm80", "sm90"))
    # SM80 forward and backward, Hopper forward and split-KV forward per (head dim, dtype), the Hopper backward at
    # its head dims, and the two dtype-generic files (bwd_aux.cu, fwd_aux.cu).
    assert len(sources) == 4 * 16 + 2 * len(cfg.BWD_SM90_HEAD_DIMS) + 2 and all(os.path.isfile(s) for s in sources)


def test_head_dim_pairs():
    """FLASH_ATTN2_HEAD_DIM_PAIRS: by default every pair whose Q / K head dim is compiled; "none"; a list; an unknown
    pair, or one whose Q / K head dim is left out (its calls fall back to it), raises naming the knob. The Hopper
    path alone builds them; dispatch.cpp gets them flattened, each number followed by a comma."""
    assert cfg.selected_head_dim_pairs([64, 192], {}) == [(192, 128)]
    assert cfg.selected_head_dim_pairs([64, 128], {}) == []
    assert cfg.selected_head_dim_pairs([192], {"FLASH_ATTN2_HEAD_DIM_PAIRS": "none"}) == []
    assert cfg.selected_head_dim_pairs([192], {"FLASH_ATTN2_HEAD_DIM_PAIRS": "192X128"}) == [(192, 128)]
    with pytest.raises(ValueError, match="FLASH_ATTN2_HEAD_DIM_PAIRS: '96x64' is not one of 192x128"):
        cfg.selected_head_dim_pairs([96, 192], {"FLASH_ATTN2_HEAD_DIM_PAIRS": "96x64"})
    with pytest.raises(ValueError, match="192x128 needs head dim 192 in FLASH_ATTN2_HEAD_DIMS"):
        cfg.selected_head_dim_pairs([128], {"FLASH_ATTN2_HEAD_DIM_PAIRS": "192x128"})
    for paths, built in ((["sm90"], True), (["sm80"], False), (["sm80", "sm90"], True)):
        sources = cfg.kernel_sources(os.path.join(ROOT, "csrc"), [192], ["bf16", "fp16"], paths, [(192, 128)])
        pair_files = [s for s in sources if "x128_" in s]
        assert len(pair_files) == (2 if built else 0) and all(os.path.isfile(s) for s in pair_files)
        defs = cfg.kernel_definitions([192], ["bf16"], paths, [(192, 128)])
        assert f"-DFLASH_ATTN2_FWD_SM90_PAIRS={'192,128,' if built else ''}" in defs
    assert "-DFLASH_ATTN2_FWD_SM90_PAIRS=" in cfg.kernel_definitions([64], ["bf16"], ["sm90"])
    # dispatch.cpp's table lists every pair of PAIRS
    with open(os.path.join(ROOT, "csrc", "dispatch.cpp")) as f:
        dispatch = f.read()
    for d, dv in cfg.PAIRS:
        assert f"pair_kernels_for<{d}, {dv}>()" in dispatch


def fake_nvcc(tmp_path, release):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_preflight(tmp_path):
    with pytest.raises(cfg.PreflightError, match="CPU-only build"):
        cfg.preflight("/usr/local/cuda", None)
    with pytest.raises(cfg.PreflightError, match="CUDA_HOME is not set"):
        cfg.preflight(None, "13.0")
    with pytest.raises(cfg.PreflightError, match="no nvcc at"):
        cfg.preflight(str(tmp_path / "nowhere"), "13.0")
    home = fake_nvcc(tmp_path, "12.4")
    with pytest.raises(cfg.PreflightError, match=r"CUDA 12.4 but torch was built with CUDA 13.0"):
        cfg.preflight(home, "13.0")
    assert cfg.preflight(home, "12.8").endswith("nvcc")


def test_cutlass_include_dir(tmp_path):
    with pytest.raises(cfg.PreflightError, match="CUTLASS_DIR: no cute/tensor.hpp"):
        cfg.cutlass_include_dir({"CUTLASS_DIR": str(tmp_path)}, ROOT)
    (tmp_path / "include" / "cute").mkdir(parents=True)
    (tmp_path / "include" / "cute" / "tensor.hpp").write_text("")
    assert cfg.cutlass_include_dir({"CUTLASS_DIR": str(tmp_path)}, ROOT) == str(tmp_path / "include")


@pytest.mark.parametrize("archs, env, paths", [
    (["90"], {}, ["sm90"]),
    (["90"], {"FLASH_ATTN2_SM80": "1"}, ["sm80", "sm90"]),
    (["80", "90+PTX"], {}, ["sm80", "sm90"]),
    (["80"], {}, ["sm80"]),
    (["86", "89"], {"FLASH_ATTN2_SM80": "0"}, ["sm80"]),
    (["100"], {}, ["sm80"]),
])
def test_kernel_paths(archs, env, paths):
    assert cfg.kernel_paths(archs, env) == paths
    sources = cfg.kernel_sources("csrc", [64, 160], ["bf16"], paths)
    for name, path in (("fwd_hdim64_bf16_sm90", "sm90"), ("bwd_hdim64_bf16_sm90", "sm90"), ("fwd_hdim64_bf16", "sm80"),
                       ("bwd_hdim64_bf16", "sm80"), ("bwd_hdim192_bf16_sm90", "sm90")):  # 160 runs the 192 kernel
        assert any(s.endswith(f"/{name}.cu") for s in sources) == (path in paths), name
    # The split-KV forward (SM80 tensor cores) on every path.
    assert any(s.endswith("/fwd_split_hdim160_bf16.cu") for s in sources)
    assert not any(s.endswith("bwd_hdim160_bf16_sm90.cu") for s in sources)
    defs = cfg.kernel_definitions([64], ["bf16"], paths)
    assert f"-DFLASH_ATTN2_COMPILED_SM80={int('sm80' in paths)}" in defs
    assert f"-DFLASH_ATTN2_COMPILED_SM90={int('sm90' in paths)}" in defs
    # dispatch.cpp's one list of Hopper backward kernels, each with its instantiation files
    assert "-DFLASH_ATTN2_SM90_BWD_HEAD_DIMS=32,64,96,128,192,256" in defs
    for d in cfg.BWD_SM90_HEAD_DIMS:
        for t in cfg.DTYPES:
            assert os.path.isfile(os.path.join(ROOT, "csrc", "instantiations", f"bwd_hdim{d}_{t}_sm90.cu"))


@pytest.mark.parametrize("archs,env,compact", [
    (["90"], {}, False),  # an H100 / H200 build: the full tiles fit
    (["80"], {}, True),
    (["86", "90"], {}, True),
    (["90+PTX"], {}, True),  # PTX may meet a GPU with 99 KB per block
    (["80", "90+PTX"], {"FLASH_ATTN2_COMPACT_TILES": "0"}, False),
    (["90"], {"FLASH_ATTN2_COMPACT_TILES": "1"}, True),
])
def test_compact_tiles(archs, env, compact):
    assert cfg.compact_tiles(archs, env) == compact


def test_libstdcxx_stays_shared(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f99 r--p 00000000 fe:00 339903     /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33\n"
                    "7f99-7fa0 r-xp 00000000 fe:00 339904     /usr/lib/x86_64-linux-gnu/libstdc++fs.so.1\n")
    loaded = cfg.loaded_library("libstdc++.so.6", str(maps))
    assert loaded == "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33"
    assert cfg.loaded_library("libc10.so", str(maps)) is None
    # A toolchain with only libstdc++.a links torch's shared copy explicitly; one with libstdc++.so is left alone.
    assert cfg.libstdcxx_link_args("libstdc++.so", loaded) == [loaded]
    assert cfg.libstdcxx_link_args("/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so", loaded) == []
    assert cfg.libstdcxx_link_args("libstdc++.so", None) == []


def test_debug_hang_knob():
    assert cfg.debug_flags({}) == [] and cfg.debug_flags({"FLASH_ATTN2_DEBUG_HANG": "0"}) == []
    assert cfg.debug_flags({"FLASH_ATTN2_DEBUG_HANG": "2000000000"}) == ["-DFLASH_ATTN2_DEBUG_HANG=2000000000"]
    with pytest.raises(ValueError, match="FLASH_ATTN2_DEBUG_HANG: '1s' is not a cycle count"):
        cfg.debug_flags({"FLASH_ATTN2_DEBUG_HANG": "1s"})


def test_every_subpackage_is_packaged():
    """pyproject.toml lists the packages a wheel holds: every directory of flash_attn2 with an __init__.py must be
    among them (flash_attn2.distributed was missing from wheels once, while the tree's tests passed)."""
    import tomllib
    if not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
        pytest.skip("tests copied away from the source tree (no pyproject.toml beside them)")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(d, ROOT).replace(os.sep, ".") for d, _, files in os.walk(os.path.join(ROOT, "flash_attn2"))
             if "__init__.py" in files}
    assert found <= listed, sorted(found - listed)
