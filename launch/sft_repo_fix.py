"""The `repo_fix` task of `launch.sft`: the CPU repository demo's warm start (configs/repo_fix.py).

    python -m launch.sft --task repo_fix --out configs/assets/repo_fix_sft

Trains on `rl.envs.repo_fix_tasks.scripted_episode`s: an edit to a random candidate fix, the test
output (not trained on), after a failure an edit to a random other candidate, then the end token
(submit). The warm start thus edits well-formed calls and retries after a failure, but its choices
ignore the failure output; reading it is left to GRPO. `report` runs held-out episodes through the
environment itself (`rl.envs.repo_fix`, the engine's episode loop, the demo's config): greedy and
sampled (T=1) reward, first-try fix rate and the fix rate after a failed first attempt. The shipped
warm start (600 steps, 398 s on a shared 2-core CPU): greedy reward 0.485, first-try 0.280, after a
failed first attempt 0.285 (chance: 1 in 3); sampled 0.349 / 0.170 / 0.220 (some sampled edits
pick a value that is not a candidate).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from configs import repo_fix
from launch.validate import engine_config
from rl.envs import make_env
from rl.envs.repo_fix_tasks import repo_fix_records, scripted_episode
from rl.groups import GroupSampler
from rl.multiturn import EpisodeSampler, env_metrics
from sampling.distribution import SamplingParams
from sampling.engine import Engine

SEQ_LEN = 72  # the longest scripted episode: prompt 21 + 2 edits (9) + 2 outputs (<= 14) + eos
MAX_POSITIONS = 128  # the model's positions: the demo's episodes are up to 21 + 48 tokens


def records(seed: int, num: int, split: str) -> list[dict]:
    return repo_fix_records(seed, num, split=split)


def encode(records, tok, seq_len: int, seed: int):
    """tokens/valid [N,T], loss_mask [N,T-1]: scripted episodes, the loss on the model's tokens
    (edits and the end token); loss_mask[:, t] scores token t+1."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(records), seq_len), np.int32)
    mask = np.zeros((len(records), seq_len - 1), np.float32)
    for i, r in enumerate(records):
        ids, m = [], []
        for text, trained in scripted_episode(r, rng):
            ids += tok.encode(text)
            m += [int(trained)] * len(text)
        ids, m = ids + [tok.eos_ids[0]], m + [1]
        if len(ids) > seq_len:
            raise ValueError(f"episode of {len(ids)} tokens > seq_len={seq_len}: {r}")
        tokens[i, : len(ids)] = ids
        mask[i, : len(ids) - 1] = m[1:]
    return tokens, tokens != 0, mask


def report(graphdef, params, held_out, tok, samples: int, seed: int) -> dict:
    """Held-out episodes of the warm start under the demo's config (configs/repo_fix.py)."""
    c = repo_fix.get_config()
    cfg = nnx.merge(graphdef, params).cfg
    env = make_env(c.env.name, tok, c)
    ecfg = engine_config(c, tuple(tok.eos_ids) + env.stop_ids())
    out = {}
    for name, temp, g in (("greedy", 0.0, 1), ("sampled", 1.0, samples)):
        engine = Engine(cfg, graphdef, ecfg, SamplingParams(temperature=temp))
        episodes = EpisodeSampler(env, engine, tok, c.env)
        sampler = GroupSampler(engine, tok, g, c, "prompt", episodes=episodes)
        try:
            keys = list(range(len(held_out)))
            _, groups = sampler.round(params, engine.init_state(), held_out, keys, None, seed)
            rewards = np.concatenate([grp.rewards for grp in groups])
        finally:
            sampler.close()
        res = [grp.episodes for grp in groups]
        metrics = env_metrics([ep for eps in res for ep in eps])
        out[f"{name}_reward"] = float(rewards.mean())
        for m in ("first_try_fix_rate", "second_try_fix_rate"):
            out[f"{name}_{m}"] = metrics.get(f"episode/{m}", float("nan"))
        out[f"{name}_tool_errors"] = float(np.mean([ep.tool_errors for eps in res for ep in eps]))
    return out
