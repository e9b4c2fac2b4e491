"""CPU demo on a mixture of experts: configs/default.py's arithmetic task with a tiny Qwen3-MoE.

    python -m launch.train --config configs/moe_tiny.py --workdir runs/moe_tiny

The policy is configs/default.py's adder built as a Qwen3-MoE (`Qwen3MoeForCausalLM`, the model
code of Qwen3-30B-A3B: 4 layers of width 128, each with 8 experts of width 96 and 2 experts per
token, Qwen3's q/k-normed attention), warm-started by this project in
configs/assets/arithmetic_moe_sft (made by `python -m launch.sft --moe --steps 1000`, then 600
more steps with `--init` at learning rate 2e-3: README "Mixtures of experts" has both commands):
it learned 2-digit addition and the same habit of a spurious trailing "0", which GRPO removes
(held-out greedy accuracy 0.240 -> 0.745 in 60 steps, 207 s on a 2-core CPU, with
`--config.rl.routing_replay=rollout` too). Everything
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
