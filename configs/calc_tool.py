"""CPU tool demo: GRPO teaches a tiny character-level model to use a calculator for 3-digit products.

    python -m launch.train --config configs/calc_tool.py

Episodes are multi-turn (rl/envs/calculator.py): the prompt is "123*456="; the model either
answers directly ("56088" <eos>) or calls the calculator, "<123*456>", a turn that ends on the
stop id of ">"; the environment appends the observation "56088;" as token ids, prefilled onto the
episode's own KV pages, and decoding resumes for the answer. Observation tokens are masked out of
the loss. The warm start (configs/assets/calc_sft, made by
`python -m launch.sft --task calc --out configs/assets/calc_sft`) calls the tool on some of
the problems when sampling (about a quarter) and guesses on the others; a tiny model cannot multiply 3-digit numbers,
so its guesses are nearly always wrong and its greedy answers (mostly guesses) score low. The exact
answer reward makes GRPO raise the tool-call rate, and with it held-out greedy accuracy: the run
prints both before GRPO and at the end (eval/tool_call_rate, eval/accuracy in metrics.jsonl).
"""

import os

from configs import default


def get_config():
    c = default.get_config()
    c.num_steps = 40  # GRPO steps
    c.checkpoint_every = 20
    c.eval_every = (
        20  # held-out greedy accuracy and tool-call rate (also before step 0 and at the end)
    )

    c.model.hf_checkpoint = os.path.join(default.ASSETS, "calc_sft")  # the tool-calling warm start

    for split in (c.data.train, c.data.eval):
        split.digits = 3  # 3-digit operands ...
        split.ops = "*"  # ... multiplied: too hard to guess, easy with the calculator
    c.data.eval.num = 200  # held-out prompts per evaluation

    c.env.name = "calculator"  # rl/envs/calculator.py; the reward is the episode's exact answer
    c.env.max_turns = 3  # a call, the answer, and one more try
    c.env.max_turn_tokens = 10  # "<123*456>" is 9 tokens; an answer at most 7
    c.rl.rewards = {}  # the environment scores the episodes

    c.sampling.max_prompt_len = 8  # "123*456="
    c.sampling.max_new_tokens = 28  # episode budget: call + observation + answer, with room
    c.sampling.num_slots = 128  # B * G episodes decode together
    c.sampling.num_pages = 640  # 16 groups x 8 episodes x 4 pages of 8 tokens, + the null page
    c.sampling.steps_per_call = 5  # decode steps between polls of the tool workers

    c.eval.pass_k = 0  # greedy accuracy only: pass@k would run 8 episodes per held-out prompt
    return c
