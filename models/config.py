"""Architecture description of the decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3).

One frozen dataclass covers the three families; they differ only in a few switches:

| family  | qkv_bias | qk_norm | rope scaling | tied embeddings |
|---------|----------|---------|--------------|-----------------|
| llama   | no       | no      | llama3       | model-dependent |
| qwen2   | yes      | no      | none         | model-dependent |
| qwen3   | no       | yes     | none         | model-dependent |

The config is hashable so that it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses

# Learner attention (models/attention.causal_hook): "dense" is the reference, [B,K,R,T,T] scores;
# "blockwise" is pure-JAX flash attention, memory linear in T (models/flash.py); "splash" (TPU)
# and "pallas_gpu" (GPU) are JAX's Pallas kernels (models/attention_kernels.py); "auto" picks per
# platform and shape (models.attention.resolve_attention).
ATTENTION = ("auto", "dense", "blockwise", "splash", "pallas_gpu")

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (rope_type "llama3" in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int  # V
    d_model: int  # D
    d_ff: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"  # master weights
    dtype: str = "float32"  # compute dtype; bfloat16 on accelerators
    remat: bool = False  # rematerialise each block in the backward pass
    attention: str = "auto"  # learner attention: one of ATTENTION (see there)
    # LoRA adapters (models/lora.py): rank 0 = off. alpha / rank scales the adapters' output.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0  # only 0 is implemented (validated at start-up)
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self):
        if self.family not in ARCHITECTURES.values():
            raise ValueError(f"ModelConfig.family={self.family!r}: expected llama, qwen2 or qwen3")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.attention not in ATTENTION:
            raise ValueError(
                f"ModelConfig.attention={self.attention!r}: expected one of {ATTENTION}"
            )
        if self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank={self.lora_rank}: must be >= 0 (0 = off)")
