"""The GPU's train step, lowered on this CPU host: the code paths only a GPU takes (the
flash kernels through Triton instead of interpreted, MoE's native ragged_dot, host
offloading) traced under each kind of parallelism, so an error in them shows here
rather than on a rented GPU. Lowered to StableHLO for cuda, never compiled.

jax.default_backend() answers "gpu" while the step traces (the model asks it which
kernel to run); jax's caches are emptied afterwards, so no trace made that way reaches
a later test's CPU compile."""

import re

import harness
import jax
import pytest

from ultrajax.model import remat
from ultrajax.tools import analyze

# a GPU's tiles fit: head_dim 16, seq 256 (and 64-token chunks of it under context
# parallelism over 2, zig-zag)
GPU = ("model.dtype=bfloat16", "model.seq_len=256", "model.attention=pallas")
TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture
def as_gpu():
    with analyze.traced_as_gpu():
        yield


def lowered(*overrides) -> str:
    cfg, devices = harness.make(*GPU, *overrides)
    return analyze.lower_step(cfg, devices, "cuda").as_text()


def kernels(text: str) -> set[str]:
    """The names of the Triton kernels a lowered module calls."""
    return set(re.findall(r'xla\.gpu\.triton.*?name = "(\w+)"', text))


SPLIT = {"flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"}
FUSED = {"flash_attention_forward", "flash_attention_bwd"}


@pytest.mark.parametrize(
    "layout, want",
    [
        (("data.cross_doc_mask=true", "mesh.tensor=2", "parallel.sequence_parallel=true"), SPLIT),
        (("data.cross_doc_mask=true", "mesh.sequence=2", "model.attention_backward=fused"), FUSED),
        (("mesh.sequence=2", "mesh.fsdp=2", "parallel.zero=3", "parallel.collectives=gspmd"),
         SPLIT),
        (
            ("data.cross_doc_mask=true", "mesh.pipeline=2", "train.grad_accum=4",
             "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2",
             "model.n_layers=4"),
            SPLIT,
        ),
        (("model.fp8=delayed", "mesh.pipeline=2", "train.grad_accum=4"), SPLIT),
    ],
    ids=["packed-tp-sp", "packed-ring-fused", "ring-zero3-gspmd", "packed-interleaved", "fp8-1f1b"],
)  # fmt: skip
def test_the_flash_kernels_lower_to_triton_in_each_layout(as_gpu, layout, want):
    """Each layout's step calls the kernels its backward asks for, compiled by Triton
    (a CPU runs them interpreted: no Triton call at all), and no other."""
    assert kernels(lowered(*layout)) == want


def test_moe_runs_jaxs_ragged_dot_on_a_gpu_under_expert_and_tensor_parallelism(as_gpu):
    """model.moe_grouped=auto is jax's ragged_dot on a GPU (a CPU's: the blocked
    matmuls, model/grouped.py), here beside the flash kernels."""
    text = lowered("model.moe_experts=4", "mesh.expert=2", "mesh.tensor=2")
    assert "ragged_dot" in text
    assert kernels(text) == SPLIT


def test_offload_places_the_saved_set_in_host_memory_beside_the_flash_kernels(as_gpu):
    text = lowered("model.remat=offload", "mesh.data=2", "mesh.sequence=2")
    assert '_xla_buffer_placement = "pinned_host"' in text
    assert kernels(text) == SPLIT


def test_selective_runs_cudnns_forward_once_a_layer():
    """jax.nn's cuDNN attention under selective recomputation: its forward primitive's
    outputs (output and softmax statistics) are kept (model/remat.py CUDNN_FORWARD), so
    the backward pass does not run the forward again, as full recomputation does. jax
    asks for cuDNN while tracing; analyze.traced_as_gpu answers its version and the
    card's compute capability (jax's private module: skipped if it moved)."""
    cudnn = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    wrapper = getattr(cudnn, "_dot_product_attention_fwd_p_wrapper", None)
    if wrapper is None or not hasattr(cudnn, "check_compute_capability"):
        pytest.skip("jax's cuDNN attention module has changed")
    assert wrapper.name == remat.CUDNN_FORWARD
    forwards, original = {}, cudnn.check_compute_capability
    with analyze.traced_as_gpu(cudnn=True):
        for policy in ("none", "selective", "full"):
            text = lowered("model.attention=cudnn", f"model.remat={policy}")
            forwards[policy] = text.count("custom_call @__cudnn$fmhaScaleBiasSoftmax(")
    assert forwards == {"none": 1, "selective": 1, "full": 2}
    assert cudnn.check_compute_capability is original and jax.default_backend() == "cpu"
