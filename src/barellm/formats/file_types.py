"""llama.cpp's names for a model file's type (its `llama_ftype`, which GGUF stores as `general.file_type`):
"Q4_K_M", "Q8_0", "F16", ... What Ollama reports as a model's quantization level, and what people call a
file by. The name cannot be read off the tensors: a Q4_K_M file holds Q4_K, Q5_0, Q6_K and Q8_0 matrices
(the mix is what the suffix names), and the largest share is not always Q4_K."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# llama.cpp's include/llama.h, enum llama_ftype (the gaps are types it removed)
FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE",
}


def file_type_name(metadata: Mapping[str, Any]) -> str | None:
    """The file's type as llama.cpp names it, from general.file_type; None when the file does not say (or
    says a number llama.cpp does not know)."""
    value = metadata.get("general.file_type")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return FILE_TYPES.get(value)
