"""What the native kernels take: the Python face of the C core's type and layout facts.

The engine, the .blm reader and writer and the converter ask this module, and only this module, which
layout a weight matrix is stored in for the matmul kernels and which activation precision they feed it.
"""

from __future__ import annotations

from barellm import _native as nat

LAYOUT_ROWS, LAYOUT_INTERLEAVE8 = 0, 1
ACT_Q8, ACT_Q8X2 = 0, 1
# The activation precisions of the quantized matmuls (kernels.h): "q8x2" keeps ~15 bits per value (two int8
# planes, twice the integer multiplies), "q8" ~8 bits (the int8 blocks llama.cpp also uses).
ACTIVATIONS = {"q8x2": ACT_Q8X2, "q8": ACT_Q8}


def matrix_bytes(type_id: int, layout: int, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] matrix of a type in a layout; 0 if the kernels do not take that combination."""
    try:
        return nat.matrix_bytes(type_id, layout, rows, cols)
    except ValueError:  # a type or layout the kernels do not have
        return 0


def matrix_layout(type_id: int, rows: int, cols: int) -> int:
    """The layout the matmul kernels want for a matrix (the weights' storage decision, in one place).

    A repacked layout where the kernels have one for the type, else GGUF's rows. A .blm file stores
    matrices already in the layout this returns, tagged, so loading it needs no repacking.
    """
    if matrix_bytes(type_id, LAYOUT_INTERLEAVE8, rows, cols) > 0:
        return LAYOUT_INTERLEAVE8
    return LAYOUT_ROWS


def matrix_act(type_id: int, activations: str) -> int:
    """The activation type a matrix's kernel takes (the precision choice, in one place).

    "q8x2" wherever the kernels have it (Q4_0, Q4_1, Q8_0), else 8-bit blocks. Why it is the default: with
    8-bit activations SmolLM2's teacher-forced logits differ from the float reference by a mean top-10 KL
    of 0.0027 (top-1 196/199); with q8x2 by under 1e-5 (199/199). With the output matrix left at 8 bits
    the KL is 0.0002 but a top-2 margin of 0.005 flips (198/199), so it takes q8x2 too. Decoding reads each
    weight once, so the extra multiplies mostly hide behind the memory reads; prefill pays for them
    (docs/engine.md, docs/benchmarks.md).
    """
    act = ACTIVATIONS[activations]
    return act if act == ACT_Q8 or nat.act_supported(type_id, act) else ACT_Q8


def matmul_supported(type_id: int, rows: int, cols: int) -> bool:
    return matrix_bytes(type_id, LAYOUT_ROWS, rows, cols) > 0
