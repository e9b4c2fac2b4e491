"""CPU demo on a mixture of experts: configs/default.py's arithmetic task with a tiny Qwen3-MoE.

    python -m launch.train --config configs/moe_tiny.py --workdir runs/moe_tiny

The policy is configs/default.py's adder built as a Qwen3-MoE (`Qwen3MoeForCausalLM`, the model
code of Qwen3-30B-A3B: 4 layers of width 128, each with 8 experts of width 96 and 2 experts per
token, Qwen3's q/k-normed attention), warm-started by this project in
configs/assets/arithmetic_moe_sft (remade by `python -m launch.sft --moe --steps 1000 --out
configs/assets/arithmetic_moe_sft`). That warm start is undertrained: it has not learned the
addition (held-out greedy 0.075), and GRPO does not lift it in 60 steps as it lifts the dense
demo (README "Mixtures of experts"); remaking it with --steps 2000 is the next step. Everything
else is configs/default.py's. XLA:CPU lowers the
experts' grouped matmul (`jax.lax.ragged_dot`) to a dense dot over every expert, E/k = 4 times the
experts' FLOPs, so the model is kept small. Held-out accuracy before and after: README "Mixtures
of experts".
"""

import os

from configs import default


def get_config():
    c = default.get_config()
    c.model.hf_checkpoint = os.path.join(default.ASSETS, "arithmetic_moe_sft")  # HF dir
    return c
