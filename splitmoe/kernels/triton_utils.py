"""What every Triton wrapper needs before a launch: triton itself, a device it can run on, and a
few shape helpers. Nothing here imports triton at module level, so the package imports without it.
"""

from __future__ import annotations

import functools

import torch


def require_triton(option: str, device: torch.device) -> None:
    """Raises a clear error when ``option="triton"`` was asked for but cannot run here: triton
    is missing, or the tensors are not on CUDA (on CPU only Triton's interpreter runs kernels)."""
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(
            f"{option}='triton' needs the `triton` package, which is not installed: "
            f"`pip install triton` (CUDA), or use {option}='torch'"
        ) from e
    if device.type != "cuda" and not _interpreting(triton):
        raise RuntimeError(
            f"{option}='triton' runs on CUDA tensors, got {device.type} tensors; use "
            f"{option}='torch' on CPU (or set TRITON_INTERPRET=1 before triton is first imported "
            "to run the kernels in Triton's slow interpreter, as the tests do)"
        )


def _interpreting(triton) -> bool:
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs are multiplied exactly ("ieee"), not in TF32: float32 runs are the ones
    compared token for token with the reference. 16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
