"""Rollout: the sampling half of one GRPO step, from data records to the learner's Batch.

    sample and score: the step's schedule (`rl.groups.Synchronous`, or `rl.partial.Partial`)
            draws records and runs them through the rollout driver (`rl.groups.GroupSampler`:
            the sampler's loop, G completions or episodes each, each group scored as it ends)
    batch:  the groups packed into the learner's rows (`rl.packing`), the masks applied
    [KL in the reward: the rollout policy against the reference, folded into the rewards]
    advantages: per group (`rl.advantages`), over every process's samples
            --> learner Batch (device, sharded over the batch axes)

`Rollouts.__call__` is these steps in this order. The sampler reads the policy parameters the
learner holds (same arrays, no copy). Rewards are plain host functions (`rl.rewards`); each group
is decoded and scored on a worker thread as soon as its last completion finishes, while the
device keeps decoding the other groups, so reward time hides behind device time. With DAPO
dynamic sampling (`rl.dynamic_sampling`), groups whose G rewards are all equal are dropped and
fresh prompts refill the batch.

Batch shards: a step's B prompts are split over the S batch shards of the mesh
(`sampling.partitioned`), shard i taking the i-th B/S of them, and a group lives on its shard
from its prompt to its learner rows: it is sampled in that shard's slots, scored, refilled (DAPO,
per shard) and packed into that shard's rows of the batch. In a multi-process run each process
does this for the shards on its own devices only (`models.processes`): it reads only their
records, runs only their rewards, tools and sandboxes, and fills only their rows. What needs the whole
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
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.moe import route_dtype
from models.processes import agree, local_values, shard_blocks
from models.sharding import spec_axes
from rl import summary as S
from rl.advantages import compute_advantages
from rl.groups import Group, GroupSampler, Synchronous, score_group
from rl.learner import Batch
from rl.multiturn import EpisodeSampler
from rl.packing import Layout, build_batch, place
from rl.partial import Partial
from rl.shaping import kl_reward_penalty
from sampling.engine import Engine


@dataclasses.dataclass
class Rollout:
    batch: Batch  # the learner batch of the step's sequences (packed rows), on device
    groups: list[Group]  # this process's groups, by shard
    rewards: np.ndarray  # f32 [this process's samples] the rewards the advantages came from
    stats: dict[str, float]  # reward / advantage / length / dynamic-sampling statistics
    layout: Layout | None = None  # where each of `groups`' sequences sits in the batch rows
    tokens: int = 0  # completion tokens of the whole batch (every process's)


class Rollouts:
    """Produces one step's Rollout from the data stream with the current policy parameters.

    Holds the rollout driver (`rl.groups.GroupSampler`: the engine's loop, the reward worker, the
    environment's episodes), the step's schedule (`rl.groups.Synchronous`, or
    `rl.partial.Partial` with `rl.partial_rollouts`) and, with
    `sampling.release_kv_between_phases=False` or groups carried, the decode state kept between
    steps.
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
        self.num_shards, self.local = engine.num_shards, engine.local_shards
        c, partial = config, bool(config.rl.get("partial_rollouts"))
        # Packed row counts: every shard's the same multiple of this, so that the rows split
        # evenly over the learner's batch shards, the minibatches and the micro-batches.
        mesh, spec = batch_sharding.mesh, batch_sharding.spec
        axes = spec_axes(spec[0] if spec else None)
        whole = math.prod(mesh.shape[a] for a in axes) * c.rl.minibatches
        whole *= c.rl.micro_batches
        self.row_multiple = math.lcm(self.num_shards, whole) // self.num_shards  # per shard
        self.row_shapes = set()  # packed row counts seen: each is one learner compilation
        self.width = c.sampling.max_prompt_len + c.sampling.max_new_tokens
        self.decode_state = None
        self._carried = 0
        # Multi-turn episodes through an environment (rl.envs), else single-turn completions;
        # under partial rollouts tool answers are taken on the loop's clock (0: when done).
        episodes = None if env is None else EpisodeSampler(env, engine, tokenizer, c.env)
        answer_calls = (c.env.get("tool_answer_calls", 0) or None) if episodes and partial else None
        score = functools.partial(
            score_group,
            tokenizer=tokenizer,
            rl_cfg=c.rl,
            max_new_tokens=c.sampling.max_new_tokens,
            prompt_field=c.data.train.prompt_field,
        )
        self.sampler = GroupSampler(
            engine,
            tokenizer,
            c.rl.num_generations,
            c,
            c.data.train.prompt_field,
            score,
            episodes,
            answer_calls,
        )
        # Partial rollouts (rl.partial): episodes in flight carried across learner steps.
        schedule = Partial if partial else Synchronous
        self.schedule = schedule(self.sampler, c, self.num_shards, self.local)

    @property
    def carried(self) -> int:
        """Groups sampled but not trained yet (partial rollouts), to be trained by later steps:
        every process's, as of the last step (the same number on each)."""
        return self._carried

    def __call__(self, step: int, params, data, drain=False, stop=None) -> Rollout:
        """Step `step`'s Rollout: sample and score the step's groups, batch them, (KL in the
        reward), advantages. With partial rollouts `drain` (a checkpoint step) ends the step
        with no episode in flight, and so does `stop` (None, or a callable asked at the start of
        the step and once its batch is complete whether a stop was requested); otherwise both
        are ignored (nothing is ever carried)."""
        before = self.sampler.counters()
        state = self.engine.init_state() if self.decode_state is None else self.decode_state
        self.decode_state = None  # donated below; kept again only once the call has returned
        state, groups, extra = self.schedule.sample(step, params, state, data, drain, stop)
        counters = {k: v - before.get(k, 0.0) for k, v in self.sampler.counters().items()}
        batch, sampled, layouts, rows, idle = self._batch(groups, self.schedule.idle)
        if not (idle and self.config.sampling.release_kv_between_phases):
            # episodes in flight anywhere (partial), or the pages kept for the next rollout:
            # agreed, so every process makes the same calls (`init_state`) next step
            self.decode_state = state
        summaries = [
            S.summary(grp, n, step if self.schedule.carries else None)
            for n, grp in enumerate(groups)
        ]
        batch = self._kl_in_reward(params, batch, sampled, groups, layouts, rows, summaries)
        everyone, counts = S.gather(summaries, {**counters, **extra.pop("counters", {})})
        batch, shaped, penalty, adv_stats = self._advantages(batch, groups, layouts, everyone)
        stats = S.step_stats(
            everyone,
            counts,
            rows=rows * self.num_shards,
            width=self.width,
            row_shapes=len(self.row_shapes),
            extra=extra,
            partial=self.schedule.stats(everyone, counts),
            episodes=self.sampler.episodes is not None,
        )
        stats.update(adv_stats)
        if penalty is not None:
            stats["reward/kl_penalty_mean"] = float(penalty.mean())
        self._carried = int(stats.get("rollout/carried_groups", 0))
        layout = _joined(layouts, rows, self.num_shards)
        tokens = int(S.flat(everyone, "lengths", np.int64).sum())
        return Rollout(batch, groups, shaped, stats, layout, tokens)

    def _device(self, x, layouts, rows):
        """The [S*rows, ...] device array of this process's shards' rows of host array x."""
        blocks = {i: x[i * rows : (i + 1) * rows] for i in layouts}
        return shard_blocks(blocks, self.num_shards, self.batch_sharding)

    def _batch(self, groups, idle: bool):
        """(device Batch, f32 [S*rows, T-1] host mask of every sampled token, shard -> its
        Layout, rows per shard, whether every process's loop is `idle`): this process's shards
        packed each into the same agreed number of rows, the others zero; the Batch's loss mask
        without infrastructure failures (and with rl.mask_truncated truncated completions)."""
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
        # An MoE run's sampler records every sequence's experts: replayed, or compared
        routes = "compare" if self.engine.records_routes else None
        routes = "replay" if c.rl.get("routing_replay", "none") == "rollout" else routes
        parts = {
            i: build_batch(
                gs,
                width,
                self.pad_id,
                s.min_new_tokens,
                c.rl.pack,
                self.row_multiple,
                m,
                rows=rows,
                routes=routes,
            )
            for i, gs in by.items()
        }
        parts = {i: (self._no_sequences(b, rows, routes), lay) for i, (b, lay) in parts.items()}
        zero = jax.tree.map(np.zeros_like, next(iter(parts.values()))[0])
        blocks = [parts[i][0] if i in parts else zero for i in range(self.num_shards)]
        batch = jax.tree.map(lambda *xs: np.concatenate(xs), *blocks)
        self.row_shapes.add(rows)
        layouts = {i: lay for i, (_, lay) in parts.items()}
        mask = batch.loss_mask.copy()
        for i, lay in layouts.items():  # infrastructure failures: no loss on their tokens
            block = slice(i * rows, (i + 1) * rows)
            mask[block] *= lay.spread(np.concatenate([grp.keep() for grp in by[i]] + [[]]))
            if c.rl.mask_truncated:  # DAPO: completions cut by the length limit get no loss
                stopped = [cp.finish_reason == "stop" for grp in by[i] for cp in grp.completions]
                mask[block] *= lay.spread(stopped)
        device = lambda x: self._device(x, layouts, rows)
        # batch.loss_mask before the masks: every sampled token, what a KL penalty covers
        return (
            jax.tree.map(device, batch.replace(loss_mask=mask)),
            batch.loss_mask,
            layouts,
            rows,
            idle,
        )

    def _no_sequences(self, batch: Batch, rows: int, routes: str | None) -> Batch:
        """A shard's packed batch, with zero routes (`build_batch`'s `routes`) where it packed
        no sequence, as the shards that did have them (the learner's batch has one structure)."""
        if routes is None or batch.routes is not None or batch.route_digest is not None:
            return batch
        cfg = self.engine.cfg
        shape = (rows, self.width, cfg.num_moe_layers)
        if routes == "replay":
            ids = (cfg.experts_per_token,)
            return batch.replace(routes=np.zeros(shape + ids, route_dtype(cfg.num_experts)))
        return batch.replace(route_digest=np.zeros(shape, np.uint16))

    def _kl_in_reward(self, params, batch, sampled, groups, layouts, rows, summaries):
        """With rl.kl_in="reward" (and kl_coef > 0): each sample's KL penalty put into its
        group's summary ("penalty"), the reference log-probs into the batch (the learner logs
        the KL, the loss ignores it); else the batch as it is."""
        c = self.config
        if not (c.rl.kl_in == "reward" and c.rl.kl_coef > 0):
            return batch
        # The KL is data here: beta * sum_t k1 of the rollout policy against the reference,
        # both on the tempered full softmax (rl.logprobs), over every completion token.
        ref = self.learner.reference_logprobs(params, self.ref_params, batch)
        pi = self.learner.logprobs(params, batch, "full")
        penalty = kl_reward_penalty(
            pi,
            ref,
            self._device(sampled, layouts, rows),
            c.rl.kl_coef,
            c.rl.kl_clamp,
            batch.segment_ids[:, 1:],
        )
        penalty = local_values(penalty)  # this process's rows
        at = {i: 0 for i in layouts}
        for s, grp in zip(summaries, groups):
            i, lay, g = grp.shard, layouts[grp.shard], len(grp.completions)
            mine = lay.gather(penalty[i * rows : (i + 1) * rows])[at[i] : at[i] + g]
            s["penalty"], at[i] = [float(x) for x in mine], at[i] + g
        return batch.replace(ref_logp=ref)

    def _advantages(self, batch, groups, layouts, everyone):
        """(batch with its advantages, f32 [this process's samples] shaped rewards, f32 [all
        samples] KL penalties or None, advantage statistics): the advantages of every process's
        samples (`everyone`: the summaries in shard order), this process's put in its rows."""
        c, g = self.config, self.config.rl.num_generations
        rewards = S.flat(everyone, "rewards")
        keep_all = S.flat(everyone, "keep", bool)
        penalty = S.flat(everyone, "penalty") if everyone[0]["penalty"] is not None else None
        adv, adv_stats = compute_advantages(
            jnp.asarray(rewards),
            g,
            c.rl.advantage,
            c.rl.advantage_eps,
            penalty,
            None if keep_all.all() else keep_all,  # None: the unmasked path, bit for bit
        )
        adv, shaped = np.asarray(adv), rewards - (0.0 if penalty is None else penalty)
        # This process's samples: where its groups sit in the shard-ordered list of all.
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
        return batch, own(shaped), penalty, {k: float(v) for k, v in adv_stats.items()}

    def close(self) -> None:
        self.sampler.close()


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
