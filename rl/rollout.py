"""Rollout: the sampling half of one GRPO step, from data records to the learner's Batch.

    records --tokenise--> prompts --generate_all(engine, params)--> G completions each
            --rewards (worker thread, as each group finishes)--> [KL folded into rewards]
            --group advantages--> learner Batch (device, sharded over the batch axes)

The sampler reads the policy parameters the learner holds (same arrays, no copy). Rewards are plain
host functions (`rl.rewards`); each group is decoded and scored on a worker thread as soon as its
last completion finishes, while the device keeps decoding the other groups, so reward time hides
behind device time. With DAPO dynamic sampling (`rl.dynamic_sampling`), groups whose G rewards
are all equal are dropped and fresh prompts refill the batch.

Batch shards: a step's B prompts are split over the S batch shards of the mesh
(`sampling.partitioned`), shard i taking the i-th B/S of them, and a group lives on its shard
from its prompt to its learner rows: it is sampled in that shard's slots, scored, refilled (DAPO,
per shard) and packed into that shard's rows of the batch. In a multi-process run each process
does this for the shards on its own devices only (`models.processes`): it reads only their records,
runs only their rewards, tools and sandboxes, and fills only their rows. What needs the whole
batch (`advantage=batch_std`, the logged statistics, the number of rows) it gets from small
agreements, never the data (`rl.summary`). One process runs the same code over all its shards.

Randomness: the sampling seed of step s, round r is drawn from fold_in(fold_in(key(seed), s), r),
and request ids (the sampler's PRNG streams) are unique over steps, refill rounds and shards, so
a resumed run samples exactly what an uninterrupted one does, on any number of processes.

The learner batch packs each shard's sequences into its rows of `max_prompt_len + max_new_tokens`
tokens with segment ids (`rl.packing`; `rl.pack=False`: one sequence per row, padded), with a
bucketed number of rows, the same for every shard (the largest any needs), so the learner
compiles for a few shapes. A completion includes its stop token (the policy must learn to stop);
`loss_mask[b, t]` marks the completion tokens tokens[b, t+1], and `sampler_logp[b, t]` holds the
sampler's log-prob of that same token.

An episode the environment reports as an infrastructure failure (`Group.masked`, from
`env.masked`) is not the model's fault: its sequence stays in the batch (the packing, and so the
compiled shapes, do not depend on failures) but its loss mask is all zero, so it adds no token and
no sequence to the loss normalisers, and its group's advantages are computed over the other
samples only (`compute_advantages(mask=...)`); dynamic sampling judges a group by those too.
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from models.processes import agree, local_values, shard_blocks
from rl import summary as S
from rl.advantages import compute_advantages
from rl.data import reward_inputs, tokenize_prompts
from rl.dynamic_sampling import fill_groups
from rl.learner import Batch
from rl.multiturn import EpisodeSampler
from rl.packing import Layout, build_batch, place
from rl.partial import PartialRollouts
from rl.rewards import combined_rewards
from rl.shaping import kl_reward_penalty, overlong_penalty
from sampling.engine import Engine
from sampling.episodes import generate_all


@dataclasses.dataclass
class Group:
    """One prompt and its G scored completions, on batch shard `shard`."""

    record: dict
    prompt: list[int]
    completions: list  # sampling.engine.Completion, G of them
    texts: list[str]
    rewards: np.ndarray  # f32 [G] total reward (weighted sum, after shaping; before KL)
    parts: dict[str, np.ndarray]  # reward name -> unweighted f32 [G]
    episodes: list | None = None  # multi-turn: the G rl.envs.Episode (turns, tool counters)
    masked: np.ndarray | None = None  # bool [G]: infrastructure failures, out of the loss
    shard: int = 0

    def keep(self) -> np.ndarray:
        """bool [G]: the samples that count (not masked)."""
        g = len(self.completions)
        return np.ones(g, bool) if self.masked is None else ~np.asarray(self.masked, bool)


@dataclasses.dataclass
class Rollout:
    batch: Batch  # the learner batch of the step's sequences (packed rows), on device
    groups: list[Group]  # this process's groups, by shard
    rewards: np.ndarray  # f32 [this process's samples] the rewards the advantages came from
    stats: dict[str, float]  # reward / advantage / length / dynamic-sampling statistics
    layout: Layout | None = None  # where each of `groups`' sequences sits in the batch rows
    tokens: int = 0  # completion tokens of the whole batch (every process's)


def score_group(record, prompt, completions, tokenizer, rl_cfg, max_new_tokens, prompt_field):
    g = len(completions)
    texts = [tokenizer.decode(c.tokens) for c in completions]
    prompts, fields = reward_inputs([record], g, prompt_field)
    total, parts = combined_rewards(
        dict(rl_cfg.rewards),
        prompts,
        texts,
        fields,
        timeout_s=getattr(rl_cfg, "reward_timeout_s", 0) or None,
    )
    if rl_cfg.overlong_buffer:
        lengths = np.array([c.length for c in completions])
        penalty = overlong_penalty(
            lengths, max_new_tokens, rl_cfg.overlong_buffer, rl_cfg.overlong_penalty
        )
        parts["overlong_penalty"] = np.asarray(penalty)
        total = total + parts["overlong_penalty"]
    return Group(record, prompt, completions, texts, np.asarray(total, np.float32), parts)


class Rollouts:
    """Produces one step's Rollout from the data stream with the current policy parameters.

    Holds the rollout engine, the reward worker thread, and (with
    `sampling.release_kv_between_phases=False`) the decode state kept between steps.
    """

    def __init__(
        self,
        config,
        engine: Engine,
        tokenizer,
        learner,
        ref_params,
        batch_sharding,
        pad_id,
        env=None,
    ):
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.learner, self.ref_params = learner, ref_params
        self.batch_sharding, self.pad_id = batch_sharding, pad_id
        self.pool = ThreadPoolExecutor(max_workers=1)  # reward functions overlap decoding
        self.num_shards, self.local = engine.num_shards, engine.local_shards
        self.mine = [i in self.local for i in range(self.num_shards)]
        self.quota = config.data.prompts_per_step // self.num_shards  # groups per shard a step
        # Packed row counts: every shard's the same multiple of this, so that the rows split
        # evenly over the learner's batch shards, the minibatches and the micro-batches.
        mesh, spec = batch_sharding.mesh, batch_sharding.spec
        axes = spec[0] if spec else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        whole = math.prod(mesh.shape[a] for a in axes) * config.rl.minibatches
        whole *= config.rl.micro_batches
        self.row_multiple = math.lcm(self.num_shards, whole) // self.num_shards  # per shard
        self.row_shapes = set()  # packed row counts seen: each is one learner compilation
        self.width = config.sampling.max_prompt_len + config.sampling.max_new_tokens
        self.decode_state = None
        self._carried = 0
        # Multi-turn episodes through an environment (rl.envs), else single-turn completions.
        self.episodes = None if env is None else EpisodeSampler(env, engine, tokenizer, config.env)
        # Partial rollouts (rl.partial): episodes in flight carried across learner steps.
        self.partial = PartialRollouts(self) if config.rl.get("partial_rollouts") else None

    @property
    def carried(self) -> int:
        """Groups sampled but not trained yet (partial rollouts), to be trained by later steps:
        every process's, as of the last step (the same number on each)."""
        return self._carried

    def prompts_of(self, records) -> list[list[int]]:
        """The prompt ids of data records (the environment's prompts, with an environment)."""
        c = self.config
        if self.episodes is None:
            return tokenize_prompts(records, self.tokenizer, c, c.data.train.prompt_field)
        return env_prompts(
            self.episodes.env, records, c.sampling.max_prompt_len, c.data.train.prompt_field
        )

    def score(self, record, prompt, completions):
        """Future of a single-turn group's `Group`, scored on the reward worker."""
        c = self.config
        return self.pool.submit(
            score_group,
            record,
            prompt,
            completions,
            self.tokenizer,
            c.rl,
            c.sampling.max_new_tokens,
            c.data.train.prompt_field,
        )

    def episode_group(self, record, prompt, episodes, completions, rewards) -> Group:
        return episode_group(record, prompt, episodes, completions, rewards, self.tokenizer)

    def _counters(self) -> dict[str, float]:
        """This process's engine counters (the step's change goes into the statistics)."""
        e = self.engine
        out = {
            "preemptions": e.preemptions,
            "recomputed_tokens": e.recomputed_tokens,
            "prefill_tokens": e.prefill_tokens,
            "decoded": e.slot_steps[0],
            "slot_steps": e.slot_steps[1],
        }
        if self.episodes is not None:
            out.update(self.episodes.counters)
        return {k: float(v) for k, v in out.items()}

    def __call__(self, step: int, params, data, drain=False, stop=None) -> Rollout:
        """Step `step`'s Rollout. With partial rollouts `drain` (a checkpoint step) ends the step
        with no episode in flight, and so does `stop` (None, or a callable asked at the start of
        the step and once its batch is complete whether a stop was requested); otherwise both
        are ignored (nothing is ever carried)."""
        c = self.config
        before = self._counters()
        state = self.engine.init_state() if self.decode_state is None else self.decode_state
        self.decode_state = None  # donated below; kept again only once the call has returned
        if self.partial is not None:
            state, groups, extra = self.partial.sample(step, params, state, data, drain, stop)
        else:
            state, groups, extra = self._sample(step, params, state, data)
        counters = {k: v - before.get(k, 0.0) for k, v in self._counters().items()}
        idle = self.partial is None or self.partial.loop.idle
        batch, layouts, rows, idle = self._batch(groups, idle)
        if not (idle and c.sampling.release_kv_between_phases):
            # episodes in flight anywhere (partial), or the pages kept for the next rollout:
            # agreed, so every process makes the same calls (`init_state`) next step
            self.decode_state = state
        completions = batch.loss_mask  # every sampled token: what the KL penalty covers
        keep = {
            i: np.concatenate([grp.keep() for grp in groups if grp.shard == i] + [[]])
            for i in layouts
        }
        mask = batch.loss_mask.copy()
        for i, lay in layouts.items():  # infrastructure failures: no loss on their tokens
            block = slice(i * rows, (i + 1) * rows)
            mask[block] *= lay.spread(keep[i])
            if c.rl.mask_truncated:  # DAPO: completions cut by the length limit get no loss
                stopped = [
                    cp.finish_reason == "stop"
                    for grp in groups
                    if grp.shard == i
                    for cp in grp.completions
                ]
                mask[block] *= lay.spread(stopped)
        device = lambda x: shard_blocks(
            {i: x[i * rows : (i + 1) * rows] for i in layouts}, self.num_shards, self.batch_sharding
        )
        batch = jax.tree.map(device, batch.replace(loss_mask=mask))
        summaries = [
            S.summary(grp, n, step if self.partial else None) for n, grp in enumerate(groups)
        ]
        if c.rl.kl_in == "reward" and c.rl.kl_coef > 0:
            # The KL is data here: beta * sum_t k1 of the rollout policy against the reference,
            # both on the tempered full softmax (rl.logprobs), over every completion token.
            ref = self.learner.reference_logprobs(params, self.ref_params, batch)
            pi = self.learner.logprobs(params, batch, "full")
            penalty = kl_reward_penalty(
                pi, ref, device(completions), c.rl.kl_coef, c.rl.kl_clamp, batch.segment_ids[:, 1:]
            )
            penalty = local_values(penalty)  # this process's rows
            at = {i: 0 for i in layouts}
            for s, grp in zip(summaries, groups):
                i, lay, g = grp.shard, layouts[grp.shard], len(grp.completions)
                mine = lay.gather(penalty[i * rows : (i + 1) * rows])[at[i] : at[i] + g]
                s["penalty"], at[i] = [float(x) for x in mine], at[i] + g
            batch = batch.replace(ref_logp=ref)  # the learner logs the KL, the loss ignores it
        everyone, counts = S.gather(summaries, {**counters, **extra.pop("counters", {})})
        rewards = S.flat(everyone, "rewards")
        keep_all = S.flat(everyone, "keep", bool)
        penalty = S.flat(everyone, "penalty") if everyone[0]["penalty"] is not None else None
        adv, adv_stats = compute_advantages(
            jnp.asarray(rewards),
            c.rl.num_generations,
            c.rl.advantage,
            c.rl.advantage_eps,
            penalty,
            None if keep_all.all() else keep_all,  # None: the unmasked path, bit for bit
        )
        adv, shaped = np.asarray(adv), rewards - (0.0 if penalty is None else penalty)
        # This process's samples: where its groups sit in the shard-ordered list of all.
        g = c.rl.num_generations
        where = {(s["shard"], s["idx"]): n for n, s in enumerate(everyone)}
        mine = [where[grp.shard, n] for n, grp in enumerate(groups)]
        own = lambda x: np.concatenate([x[n * g : (n + 1) * g] for n in mine] + [[]])
        blocks = {
            i: lay.spread(
                np.concatenate(
                    [adv[n * g : (n + 1) * g] for n, grp in zip(mine, groups) if grp.shard == i]
                    + [[]]
                )
            )
            for i, lay in layouts.items()
        }
        batch = batch.replace(advantages=shard_blocks(blocks, self.num_shards, self.batch_sharding))
        partial = self.partial.stats(everyone, counts) if self.partial is not None else {}
        stats = S.step_stats(
            everyone,
            counts,
            rows=rows * self.num_shards,
            width=self.width,
            row_shapes=len(self.row_shapes),
            extra=extra,
            partial=partial,
            episodes=self.episodes is not None,
        )
        stats.update({k: float(v) for k, v in adv_stats.items()})
        if penalty is not None:
            stats["reward/kl_penalty_mean"] = float(penalty.mean())
        self._carried = int(stats.get("rollout/carried_groups", 0))
        layout = _joined(layouts, rows, self.num_shards)
        return Rollout(
            batch,
            groups,
            own(shaped),
            stats,
            layout,
            int(S.flat(everyone, "lengths", np.int64).sum()),
        )

    def _batch(self, groups, idle: bool):
        """(numpy Batch of the S shards' rows, shard -> its Layout, rows per shard, whether every
        process's loop is `idle`): this process's shards packed each into the same agreed number
        of rows, the others zero."""
        c, s = self.config, self.config.sampling
        width, m = self.width, c.rl.minibatches
        by = {i: [grp for grp in groups if grp.shard == i] for i in self.local}
        lengths = {
            i: [len(grp.prompt) + cp.length for grp in gs for cp in grp.completions]
            for i, gs in by.items()
        }
        need = [place(n, width, c.rl.pack, self.row_multiple, m).rows for n in lengths.values()]
        everyone = agree([max(need, default=0), idle])
        rows, idle = int(everyone[:, 0].max()), bool(everyone[:, 1].all())
        parts = {
            i: build_batch(
                gs, width, self.pad_id, s.min_new_tokens, c.rl.pack, self.row_multiple, m, rows=rows
            )
            for i, gs in by.items()
        }
        zero = jax.tree.map(np.zeros_like, next(iter(parts.values()))[0])
        blocks = [parts[i][0] if i in parts else zero for i in range(self.num_shards)]
        batch = jax.tree.map(lambda *xs: np.concatenate(xs), *blocks)
        self.row_shapes.add(rows)
        return batch, {i: lay for i, (_, lay) in parts.items()}, rows, idle

    def _sample(self, step: int, params, state, data):
        """(state, this process's groups, stats) of a synchronous step: B/S groups per shard,
        with dynamic sampling refilled per shard (`rl.dynamic_sampling.fill_groups`)."""
        c = self.config
        root = jax.random.fold_in(jax.random.key(c.seed), step)
        tries, reprefill = [0], [0]

        def sample_round(counts):  # counts: records per shard this round (every shard's)
            records = data.take_shards(counts, self.mine)  # a rl.data.PromptStream
            seed = int(jax.random.randint(jax.random.fold_in(root, tries[0]), (), 0, 2**31 - 1))
            # Request ids unique over steps, refill rounds and shards: shard i's j-th of round r
            # of step s is (s * max_tries + r) * B + i * B/S + j.
            base = (step * c.rl.dynamic_sampling_max_tries + tries[0]) * c.data.prompts_per_step
            tries[0] += 1
            todo = [
                (i, r, base + i * self.quota + j)
                for i in self.local
                for j, r in enumerate(records[i])
            ]
            nonlocal state
            state, groups = self.sample_groups(params, state, todo, seed)
            reprefill[0] += S.reprefill_tokens([S.summary(grp, 0) for grp in groups])
            return groups

        stats, counters = {}, {}
        if not c.rl.dynamic_sampling:
            groups = sample_round([self.quota] * self.num_shards)
        else:
            groups, tried, dropped, short = fill_groups(
                sample_round,
                self.quota,
                self.num_shards,
                self.local,
                c.rl.num_generations,
                c.rl.dynamic_sampling_max_tries,
            )
            stats["dynamic_sampling_tries"] = float(tried)
            counters = {
                "sum/dynamic_sampling_dropped_groups": dropped,
                "sum/dynamic_sampling_shortfall": short,
            }
        stats["counters"] = {"reprefill_tokens": reprefill[0], **counters}
        return state, groups, stats

    def sample_groups(self, params, state, todo, seed):
        """(state, groups): G completions of every (shard, record, request id) in `todo`, each
        group scored on the worker as it finishes, in `todo`'s order."""
        g = self.config.rl.num_generations
        records = [r for _, r, _ in todo]
        prompts = self.prompts_of(records)
        shards, ids = [i for i, _, _ in todo], [n for *_, n in todo]
        if self.episodes is not None:
            state, out = self.episodes.run(params, state, records, prompts, g, seed, ids, shards)
            groups = [
                episode_group(record, prompt, eps, completions, fut.result(), self.tokenizer)
                for record, prompt, (eps, completions, fut) in zip(records, prompts, out)
            ]
        else:
            done, left, futures = [[None] * g for _ in prompts], [g] * len(prompts), {}

            def on_finish(i, k, completion):
                done[i][k] = completion
                left[i] -= 1
                if not left[i]:
                    futures[i] = self.score(records[i], prompts[i], done[i])

            state, _ = generate_all(
                self.engine,
                params,
                state,
                prompts,
                g,
                seed=seed,
                request_ids=ids,
                on_finish=on_finish,
                shards=shards,
            )
            groups = [futures[i].result() for i in range(len(prompts))]
        for grp, i in zip(groups, shards):
            grp.shard = i
        return state, groups

    def close(self) -> None:
        self.pool.shutdown()
        if self.episodes is not None:
            self.episodes.close()


def _joined(layouts: dict, rows: int, num_shards: int) -> Layout:
    """One Layout of this process's sequences (shard by shard) in the rows of the whole batch."""
    parts = [(i * rows, lay) for i, lay in sorted(layouts.items())]
    cat = lambda f: np.concatenate(
        [getattr(lay, f) + (off if f == "row" else 0) for off, lay in parts]
    )
    return Layout(
        rows * num_shards,
        parts[0][1].width,
        cat("row"),
        cat("segment"),
        cat("start"),
        cat("length"),
    )


def env_prompts(env, records, max_prompt_len: int, prompt_field: str) -> list[list[int]]:
    """The environment's prompt ids of records; one longer than max_prompt_len is an error."""
    prompts = [env.prompt(r, prompt_field) for r in records]
    longest = max((len(p) for p in prompts), default=0)
    if longest > max_prompt_len:
        raise ValueError(
            f"a prompt has {longest} tokens > config.sampling.max_prompt_len={max_prompt_len}"
        )
    return prompts


def episode_group(record, prompt, episodes, completions, rewards, tokenizer) -> Group:
    """A scored multi-turn group: the environment's rewards, whole episodes as texts."""
    texts = [tokenizer.decode(c.tokens) for c in completions]
    parts = {"env": rewards}  # an env error is masked (rl.multiturn): episode/env_errors counts it
    masked = np.array([bool(getattr(ep, "masked", False)) for ep in episodes])
    return Group(record, prompt, completions, texts, rewards, parts, episodes, masked)
