"""Architecture description of the decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3,
Qwen3-MoE).

One frozen dataclass covers the four families; they differ only in a few switches:

| family    | qkv_bias | qk_norm | rope scaling | tied embeddings | feed-forward              |
|-----------|----------|---------|--------------|-----------------|---------------------------|
| llama     | no       | no      | llama3       | model-dependent | dense                     |
| qwen2     | yes      | no      | none         | model-dependent | dense                     |
| qwen3     | no       | yes     | none         | model-dependent | dense                     |
| qwen3_moe | no       | yes     | none         | model-dependent | experts in `moe_layers`   |

A mixture-of-experts model (`num_experts` > 0) replaces the feed-forward block of the layers in
`moe_layers` by a router and `num_experts` experts of width `expert_d_ff`, each token sent to
`experts_per_token` of them (models/moe.py); the other layers keep a dense block of width `d_ff`.

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
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_FAMILIES = ("qwen3_moe",)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (rope_type "llama3" in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe"
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
    # Mixture of experts (models/moe.py; MOE_FAMILIES only): 0 experts = a dense model.
    num_experts: int = 0  # E: routed experts of each MoE layer
    experts_per_token: int = 0  # k: experts each token goes to (top-k of the router)
    expert_d_ff: int = 0  # the width of each expert's feed-forward block (HF moe_intermediate_size)
    norm_topk_prob: bool = False  # the k gate weights renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose feed-forward block is the experts
    # config.json's load-balancing loss coefficient (a training setting, not the architecture):
    # the learner's when rl.router_aux_loss_coef is None (rl/router.py)
    router_aux_loss_coef: float = 0.0

    @property
    def num_moe_layers(self) -> int:  # L_moe
        return len(self.moe_layers)

    def __post_init__(self):
        if self.family not in ARCHITECTURES.values():
            raise ValueError(
                f"ModelConfig.family={self.family!r}: expected one of {sorted(ARCHITECTURES.values())}"
            )
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
        self._check_experts()

    def _check_experts(self):
        if self.family not in MOE_FAMILIES:
            if self.num_experts or self.moe_layers:
                raise ValueError(
                    f"ModelConfig.num_experts={self.num_experts}: family {self.family!r} has no "
                    f"experts (mixture-of-experts families: {MOE_FAMILIES})"
                )
            return
        e, k = self.num_experts, self.experts_per_token
        if e < 1:
            raise ValueError(f"ModelConfig.num_experts={e}: {self.family} needs >= 1 expert")
        if not 1 <= k <= e:
            raise ValueError(
                f"ModelConfig.experts_per_token={k}: must be in [1, num_experts = {e}]"
            )
        if self.expert_d_ff < 1:
            raise ValueError(f"ModelConfig.expert_d_ff={self.expert_d_ff}: must be >= 1")
        layers = self.moe_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers):
            raise ValueError(
                f"ModelConfig.moe_layers={layers}: expected increasing layer indices in "
                f"[0, num_layers = {self.num_layers})"
            )
