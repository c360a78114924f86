"""Launch a Triton kernel from JAX: jax-triton on a GPU, Triton's interpreter elsewhere.

Both launchers take the same arguments as `jax_triton.triton_call` (arrays and Python
scalars in the kernel's order, then one pointer per output of `out_shape`, then the
`constexpr` metaparameters), so a kernel's JAX wrapper is the same code on both: the
CPU tests exercise it whole, and only the compiled launch differs on a GPU.

- GPU: `jax_triton.triton_call`, imported here and only here (`import jax_triton`
  raises on a jaxlib without GPU support).
- Interpreter (`interpret=True`): a `jax.pure_callback` that hands the arrays to the
  kernel as torch CPU tensors (what Triton's interpreter reads) and runs it one program
  at a time in numpy. It needs `TRITON_INTERPRET=1` in the environment before triton
  is first imported (tests/conftest.py sets it off a GPU). For tests: slow.
"""

from __future__ import annotations

import functools
import threading

import jax
import numpy as np

from ultrajax.kernels.varying import vary_like

SCALARS = (bool, int, float, np.generic)  # kernel arguments passed by value, not pointer


def call(kernel, *args, out_shape, grid, interpret: bool, num_warps=None, **meta):
    """Run Python function `kernel` (Triton source, undecorated) on `args`; returns one
    array per entry of `out_shape` (a list of ShapeDtypeStructs). Inside `shard_map`
    the outputs vary over the manual axes the inputs vary over."""
    if interpret:
        outs = _interpreted(kernel, args, out_shape, grid, meta)
    else:
        import jax_triton  # GPU only

        outs = jax_triton.triton_call(
            *args,
            kernel=_jit(kernel),
            out_shape=out_shape,
            grid=grid,
            num_warps=num_warps,
            **meta,
        )
    arrays = [a for a in args if not isinstance(a, SCALARS)]
    return [vary_like(out, *arrays) for out in outs]


# Triton's interpreter patches triton.language for the length of a launch: the devices of
# a shard_map call their callbacks from several threads, so launches take turns.
_INTERPRETER_LOCK = threading.Lock()


@functools.cache
def _jit(kernel):
    import triton

    return triton.jit(kernel)


def _torch(array):
    """A numpy array as a torch CPU tensor (bf16 through its bits: numpy has no bf16)."""
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _numpy(tensor, dtype):
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(dtype)
    return tensor.numpy().astype(dtype, copy=False)


def _interpreted(kernel, args, out_shape, grid, meta):
    import triton

    if not triton.knobs.runtime.interpret:
        raise RuntimeError(
            "Triton kernels run interpreted only when TRITON_INTERPRET=1 was set before "
            "triton was first imported (its own library functions are compiled or "
            "interpreted at import); tests/conftest.py sets it off a GPU"
        )
    arrays = [i for i, a in enumerate(args) if not isinstance(a, SCALARS)]

    def host(*values):
        import torch

        # numpy scalars (jax-triton's fp32) as Python numbers, which the interpreter takes
        inputs = [a.item() if isinstance(a, np.generic) else a for a in args]
        for i, value in zip(arrays, values, strict=True):
            inputs[i] = _torch(np.asarray(value))
        outs = [torch.zeros(s.shape, dtype=_torch(np.zeros((), s.dtype)).dtype) for s in out_shape]
        with _INTERPRETER_LOCK:
            _jit(kernel)[tuple(grid)](*inputs, *outs, **meta)
        return tuple(_numpy(t, s.dtype) for t, s in zip(outs, out_shape, strict=True))

    return list(jax.pure_callback(host, tuple(out_shape), *[args[i] for i in arrays]))
