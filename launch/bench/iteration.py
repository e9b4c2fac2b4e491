"""The GRPO iteration the loop benchmarks time (`launch.bench loop`, loop.py, and its partial
rollouts, partial.py): bench-small's engine, learner and reference on one device, and one timed
iteration = rollout (`generate_all` on the policy's own arrays) + reference log-probs
(`Learner.logprobs`, full softmax) + one AdamW step (`Learner.step`). Its workloads (fixed and
skewed lengths) are described in loop.py.

A module of its own because both benchmarks build on it and the loop benchmark's command runs
the partial one: loop.py -> partial.py -> this, one way.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from launch.bench.common import SMALL, TINY, random_prompts
from launch.bench.learn import skewed_lengths
from models.config import ModelConfig
from models.sharding import DEFAULT_RULES, init_params, make_mesh, state_shardings
from rl.groups import Group
from rl.learner import Learner, LearnerConfig, batch_sharding
from rl.losses import LossConfig
from rl.packing import build_batch
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all
from sampling.requests import group_pages


class Loop:
    """The engine, learner and reference of the benchmark, and one timed GRPO iteration."""

    def __init__(self, args):
        quick = args.quick
        cfg = ModelConfig(
            family="qwen2", qkv_bias=True, tie_embeddings=True, **(TINY if quick else SMALL)
        )
        mesh = make_mesh({}, devices=jax.devices()[:1])
        graphdef, params = init_params(cfg, mesh, seed=0)
        self.ref_params = jax.tree.map(lambda x: x.copy(), params)
        g, n_prompts, plen = (2, 2, 8) if quick else (8, 8, 64)
        self.prompts = random_prompts(n_prompts, plen, cfg.vocab_size)
        self.g, self.skewed = g, args.lengths == "skewed"
        n = n_prompts * g
        if self.skewed:
            self.lengths = skewed_lengths(n, 2 if quick else 8, 16 if quick else 512, args.seed)
            slots = min(n, 4 if quick else 16)
        else:
            self.lengths = np.full(n, 8 if quick else 128)
            slots = n
        self.max_new = int(self.lengths.max())
        page = 4 if quick else 16
        sampling = SamplingParams(temperature=1.0)
        ecfg = EngineConfig(
            num_slots=slots,
            page_size=page,
            max_prompt_len=plen,
            max_new_tokens=self.max_new,
            num_pages=slots * group_pages(plen, self.max_new, page, 1) + 1,
            steps_per_call=4 if quick else args.steps_per_call,
        )
        self.engine = Engine(cfg, graphdef, ecfg, sampling)
        self.decode_state = self.engine.init_state()
        lcfg = LearnerConfig(learning_rate=1e-6, sampling=sampling, loss=LossConfig(kl_coef=0.04))
        self.learner = Learner(lcfg, graphdef, state_shardings(params, mesh, DEFAULT_RULES))
        self.state = self.learner.init_state(params)
        self.sharding = batch_sharding(mesh, DEFAULT_RULES)
        self.width = plen + self.max_new
        self.adv = np.random.default_rng(0).normal(size=n).astype(np.float32)
        self.times = {
            k: []
            for k in (
                "rollout",
                "reference",
                "learn",
                "iteration",
                "static_rollout",
                "padded_reference",
                "padded_learn",
            )
        }

    def rollout(self) -> list[Group]:
        """The G samples of each prompt, one request (the prompt prefilled once); skewed: each
        sample with its own budget (`lengths`, prompt-major)."""
        budgets = self.lengths.reshape(len(self.prompts), self.g).tolist()
        self.decode_state, completions = generate_all(
            self.engine,
            self.state.params,
            self.decode_state,
            self.prompts,
            self.g,
            budgets if self.skewed else self.max_new,
        )
        for c, n in zip((c for cs in completions for c in cs), self.lengths):
            assert c.length == n, (c.length, n)  # exact lengths: no stop ids
        return [
            Group({}, p, cs, [], np.zeros(self.g, np.float32), {})
            for p, cs in zip(self.prompts, completions)
        ]

    def static_rollout(self) -> None:
        """The same groups in fixed batches of num_slots samples, each decoding to its longest."""
        per = self.engine.ecfg.num_slots // self.g  # groups per batch
        lengths = self.lengths.reshape(len(self.prompts), self.g)
        for s in range(0, len(self.prompts), per):
            self.decode_state, _ = generate_all(
                self.engine,
                self.state.params,
                self.decode_state,
                self.prompts[s : s + per],
                self.g,
                int(lengths[s : s + per].max()),
                request_ids=range(s, min(s + per, len(lengths))),
            )

    def batch(self, groups, pack: bool):
        batch, layout = build_batch(groups, self.width, 0, pack=pack)
        batch = batch.replace(advantages=layout.spread(self.adv))
        return jax.device_put(batch, self.sharding)

    def with_reference(self, batch):
        """The batch with the reference model's log-probs (waited for)."""
        ref = self.learner.logprobs(self.ref_params, batch, "full")
        return batch.replace(ref_logp=jax.block_until_ready(ref))

    def learn(self, batch):
        self.state, metrics = self.learner.step(self.state, batch)
        jax.device_get(metrics["loss"])

    def iteration(self) -> None:
        t0 = time.perf_counter()
        groups = self.rollout()
        t1 = time.perf_counter()
        batch = self.with_reference(self.batch(groups, pack=True))
        t2 = time.perf_counter()
        self.learn(batch)
        t3 = time.perf_counter()
        for key, dt in (
            ("rollout", t1 - t0),
            ("reference", t2 - t1),
            ("learn", t3 - t2),
            ("iteration", t3 - t0),
        ):
            self.times[key].append(dt)
        if self.skewed:
            t4 = time.perf_counter()
            self.static_rollout()
            t5 = time.perf_counter()
            padded = self.with_reference(self.batch(groups, pack=False))
            t6 = time.perf_counter()
            self.learn(padded)
            t7 = time.perf_counter()
            self.times["static_rollout"].append(t5 - t4)
            self.times["padded_reference"].append(t6 - t5)
            self.times["padded_learn"].append(t7 - t6)
