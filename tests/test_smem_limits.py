"""The SM80 kernels' tiles for GPUs with less shared memory per block than an H100's 227 KB (A100: 163 KB,
sm_86/89: 99 KB), run on the GPU at hand by lowering FLASH_ATTN2_SMEM_LIMIT, which the SM80 launchers pick
their tiles by (GPU)."""

import pytest

import flash_attn2
from flash_attn2 import _ops
from flash_attn2.testing import attention_ref, reference_grads

from test_backward import check_grads, run_backward
from test_forward import DTYPES, HEAD_DIMS, check_dense_forward, dense_inputs, randn, require_kernel, require_sm80

pytestmark = pytest.mark.gpu

LIMITS = {"a100": 163 * 1024, "sm86": 99 * 1024}
# The largest head dim whose backward fits, with the compact tiles (csrc/kernels/sm80/tile_size.h).
BWD_MAX_HEAD_DIM = {"a100": 256, "sm86": 160}


def require_compact_tiles():
    require_sm80()
    if not _ops.ext.compact_tiles:
        pytest.skip("built without the compact tiles (FLASH_ATTN2_COMPACT_TILES=1 adds them)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("gpu", list(LIMITS))
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_under_smem_limit(causal, gpu, head_dim, dtype, monkeypatch):
    """Gradients right where the compact tiles fit (several query and key blocks, GQA, odd lengths); a
    clear error where nothing does."""
    require_kernel(head_dim, dtype)
    require_compact_tiles()
    q, k, v = dense_inputs(2, 300, 257, 4, 2, head_dim, dtype)
    dout = randn(*q.shape, dtype=dtype)

    def sm80_backward_under_limit():  # the forward as built; the backward on SM80 (sm_90 would take Hopper's)
        monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80")
        monkeypatch.setenv("FLASH_ATTN2_SMEM_LIMIT", str(LIMITS[gpu]))

    if head_dim > BWD_MAX_HEAD_DIM[gpu]:
        with pytest.raises(RuntimeError, match="needs more shared memory per block than .* under FLASH_ATTN2_SMEM_LIMIT"):
            run_backward(q, k, v, dout, None, None, 300, 257, causal, before_backward=sm80_backward_under_limit)
        return
    grads = run_backward(q, k, v, dout, None, None, 300, 257, causal, before_backward=sm80_backward_under_limit)
    ref, ref_pt = reference_grads(lambda q, k, v, up: attention_ref(q, k, v, causal, upcast=up)[0], (q, k, v), dout)
    check_grads(grads, ref[1:], ref_pt[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("gpu", list(LIMITS))
def test_sm80_fwd_under_smem_limit(gpu, head_dim, dtype, monkeypatch):
    """The SM80 forward fits every head dim on both (head dims 224 and 256 through their compact tiles)."""
    require_kernel(head_dim, dtype)
    require_compact_tiles()
    monkeypatch.setenv("FLASH_ATTN2_BACKEND", "sm80")
    monkeypatch.setenv("FLASH_ATTN2_SMEM_LIMIT", str(LIMITS[gpu]))
    for causal in (False, True):
        check_dense_forward(2, 300, 257, 4, 2, head_dim, causal, dtype)
