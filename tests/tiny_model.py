"""A tiny synthetic llama model in a real GGUF file: random weights, a byte-level BPE vocabulary of the
256 bytes plus a few merges and ChatML special tokens. It loads and runs through every layer of
barellm in milliseconds; its text is gibberish, but deterministic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gguf_writer import write_gguf

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_vocab() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def tiny_llama_metadata(n_layers: int = 2, dim: int = 64, ffn: int = 96, heads: int = 4, kv_heads: int = 2,
                        ctx: int = 256, chat_template: bool = True) -> tuple[dict, int]:
    """The tiny model's metadata; without chat_template, a base model (no template in its file)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a"]
    tokens = specials + byte_vocab() + [m.replace(" ", "") for m in merges]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    md = {
        "general.architecture": "llama",
        "general.name": "tiny-llama",
        "llama.context_length": ctx,
        "llama.embedding_length": dim,
        "llama.block_count": n_layers,
        "llama.feed_forward_length": ffn,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": dim // heads,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    if not chat_template:
        del md["tokenizer.chat_template"]
    return md, len(tokens)


def write_tiny_llama(path: str | Path, seed: int = 0, layer_type: int = 3, embd_type: int = 8, tied: bool = False,
                     biases: bool = False, **kw) -> Path:
    """Writes the tiny model; layer_type/embd_type are ggml type ids (Q4_1 and Q8_0 like SmolLM2).

    An untied output projection keeps its random logits from merely echoing the last token. With biases, it is
    a qwen2 model: Q, K and V projections with biases, the K bias with a few large values as Qwen2's has.
    """
    md, n_vocab = tiny_llama_metadata(**kw)
    dim, ffn = md["llama.embedding_length"], md["llama.feed_forward_length"]
    heads, kv_heads = md["llama.attention.head_count"], md["llama.attention.head_count_kv"]
    hd = dim // heads
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors: list[tuple] = [("token_embd.weight", mat(n_vocab, dim, 2.0), embd_type),
                            ("output_norm.weight", norm(dim), 0)]
    if not tied:
        tensors.append(("output.weight", mat(n_vocab, dim, 4.0), embd_type))
    for i in range(md["llama.block_count"]):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", norm(dim), 0),
            (b + "attn_q.weight", mat(heads * hd, dim, 2.0), layer_type),
            (b + "attn_k.weight", mat(kv_heads * hd, dim, 2.0), layer_type),
            (b + "attn_v.weight", mat(kv_heads * hd, dim), layer_type),
            (b + "attn_output.weight", mat(dim, heads * hd), layer_type),
            (b + "ffn_norm.weight", norm(dim), 0),
            (b + "ffn_gate.weight", mat(ffn, dim), layer_type),
            (b + "ffn_up.weight", mat(ffn, dim), layer_type),
            (b + "ffn_down.weight", mat(dim, ffn), layer_type),
        ]
        if biases:
            k_bias = (0.5 * rng.standard_normal(kv_heads * hd)).astype(np.float32)
            k_bias[rng.choice(kv_heads * hd, 3, replace=False)] = [60.0, -45.0, 30.0]
            tensors += [(b + "attn_q.bias", (0.5 * rng.standard_normal(heads * hd)).astype(np.float32), 0),
                        (b + "attn_k.bias", k_bias, 0),
                        (b + "attn_v.bias", (0.5 * rng.standard_normal(kv_heads * hd)).astype(np.float32), 0)]
    if biases:
        md = {("qwen2." + k[len("llama."):] if k.startswith("llama.") else k): v for k, v in md.items()}
        md["general.architecture"] = "qwen2"
    path = Path(path)
    write_gguf(path, md, tensors)
    return path
