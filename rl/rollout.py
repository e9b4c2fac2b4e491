"""Rollout: the sampling half of one GRPO step, from data records to the learner's Batch.

    records --tokenise--> prompts --Engine.generate_all(params)--> G completions each
            --rewards (worker thread, as each group finishes)--> [KL folded into rewards]
            --group advantages--> learner Batch (device, sharded over the batch axes)

The sampler reads the policy parameters the learner holds (same arrays, no copy). Rewards are plain
host functions (`rl.rewards`); each group is decoded and scored on a worker thread as soon as its
last completion finishes, while the device keeps decoding the other groups, so reward time hides
behind device time. With DAPO dynamic sampling (`rl.dynamic_sampling`), groups whose G rewards
are all equal are dropped and fresh prompts refill the batch.

Randomness: the sampling seed of step s, round r is drawn from fold_in(fold_in(key(seed), s), r),
and request ids (the sampler's PRNG streams) are unique over steps and refill rounds, so a resumed
run samples exactly what an uninterrupted one does.

The learner batch packs the sequences into rows of `max_prompt_len + max_new_tokens` tokens with
segment ids (`rl.packing`; `rl.pack=False`: one sequence per row, padded), with a bucketed number
of rows, so the learner compiles for a few shapes. A completion includes its stop token (the
policy must learn to stop); `loss_mask[b, t]` marks the completion tokens tokens[b, t+1], and
`sampler_logp[b, t]` holds the sampler's log-prob of that same token.

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

from rl.advantages import compute_advantages
from rl.data import reward_inputs, tokenize_prompts
from rl.dynamic_sampling import check_rewards_agree, fill_groups, selection_rewards
from rl.learner import Batch
from rl.multiturn import EpisodeSampler, episode_stats, reprefill_tokens
from rl.packing import Layout, build_batch
from rl.partial import PartialRollouts
from rl.rewards import combined_rewards
from rl.shaping import kl_reward_penalty, overlong_penalty
from sampling.state import host_values


@dataclasses.dataclass
class Group:
    """One prompt and its G scored completions."""

    record: dict
    prompt: list[int]
    completions: list  # sampling.engine.Completion, G of them
    texts: list[str]
    rewards: np.ndarray  # f32 [G] total reward (weighted sum, after shaping; before KL)
    parts: dict[str, np.ndarray]  # reward name -> unweighted f32 [G]
    episodes: list | None = None  # multi-turn: the G rl.envs.Episode (turns, tool counters)
    masked: np.ndarray | None = None  # bool [G]: infrastructure failures, out of the loss

    def keep(self) -> np.ndarray:
        """bool [G]: the samples that count (not masked)."""
        g = len(self.completions)
        return np.ones(g, bool) if self.masked is None else ~np.asarray(self.masked, bool)


@dataclasses.dataclass
class Rollout:
    batch: Batch  # the learner batch of the B*G sequences (packed rows), on device
    groups: list[Group]
    rewards: np.ndarray  # f32 [B*G] the rewards the advantages were computed from
    stats: dict[str, float]  # reward / advantage / length / dynamic-sampling statistics
    layout: Layout | None = None  # where each sequence sits in the batch rows (rl.packing)


def score_group(record, prompt, completions, tokenizer, rl_cfg, max_new_tokens, prompt_field):
    g = len(completions)
    texts = [tokenizer.decode(c.tokens) for c in completions]
    prompts, fields = reward_inputs([record], g, prompt_field)
    total, parts = combined_rewards(
        dict(rl_cfg.rewards), prompts, texts, fields,
        timeout_s=getattr(rl_cfg, "reward_timeout_s", 0) or None,
    )  # fmt: skip
    if rl_cfg.overlong_buffer:
        lengths = np.array([c.length for c in completions])
        penalty = overlong_penalty(
            lengths, max_new_tokens, rl_cfg.overlong_buffer, rl_cfg.overlong_penalty
        )
        parts["overlong_penalty"] = np.asarray(penalty)
        total = total + parts["overlong_penalty"]
    return Group(record, prompt, completions, texts, np.asarray(total, np.float32), parts)


def length_stats(groups: list[Group]) -> dict[str, float]:
    completions = [c for grp in groups for c in grp.completions]
    lengths = np.array([c.length for c in completions])
    return {
        "rollout/length_mean": float(lengths.mean()),
        "rollout/length_max": float(lengths.max()),
        "rollout/truncated_frac": float(
            np.mean([c.finish_reason == "length" for c in completions])
        ),
    }


class Rollouts:
    """Produces one step's Rollout from the data iterator with the current policy parameters.

    Holds the rollout engine, the reward worker thread, and (with
    `sampling.release_kv_between_phases=False`) the decode state kept between steps.
    """

    def __init__(
        self, config, engine, tokenizer, learner, ref_params, batch_sharding, pad_id, env=None
    ):
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.learner, self.ref_params = learner, ref_params
        self.batch_sharding, self.pad_id = batch_sharding, pad_id
        self.pool = ThreadPoolExecutor(max_workers=1)  # reward functions overlap decoding
        # Packed row counts are multiples of this, so that rows split evenly over the batch
        # shards, the minibatches and the micro-batches.
        mesh, spec = batch_sharding.mesh, batch_sharding.spec
        axes = spec[0] if spec else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        shards = math.prod(mesh.shape[a] for a in axes)
        self.row_multiple = shards * config.rl.minibatches * config.rl.micro_batches
        self.row_shapes = set()  # packed row counts seen: each is one learner compilation
        self.decode_state = None
        # Multi-turn episodes through an environment (rl.envs), else single-turn completions.
        self.episodes = None if env is None else EpisodeSampler(env, engine, tokenizer, config.env)
        # Partial rollouts (rl.partial): episodes in flight carried across learner steps.
        self.partial = PartialRollouts(self) if config.rl.get("partial_rollouts") else None

    @property
    def carried(self) -> int:
        """Groups sampled but not trained yet (partial rollouts), to be trained by later steps."""
        return 0 if self.partial is None else self.partial.carried

    def prompts_of(self, records) -> list[list[int]]:
        """The prompt ids of data records (the environment's prompts, with an environment)."""
        c = self.config
        if self.episodes is None:
            return tokenize_prompts(records, self.tokenizer, c, c.data.train.prompt_field)
        return env_prompts(self.episodes.env, records, c.sampling.max_prompt_len,
                           c.data.train.prompt_field)  # fmt: skip

    def score(self, record, prompt, completions):
        """Future of a single-turn group's `Group`, scored on the reward worker."""
        c = self.config
        return self.pool.submit(
            score_group, record, prompt, completions, self.tokenizer, c.rl,
            c.sampling.max_new_tokens, c.data.train.prompt_field,
        )  # fmt: skip

    def episode_group(self, record, prompt, episodes, completions, rewards) -> Group:
        return episode_group(record, prompt, episodes, completions, rewards, self.tokenizer)

    def _counters(self) -> tuple[int, int]:
        return self.engine.preemptions, self.engine.recomputed_tokens

    def _preemption_stats(self, before) -> dict[str, float]:
        """Sequences preempted since `before` (`_counters`) and the tokens recomputed for them
        (sampling.reserve="demand"; 0 under "budget")."""
        now = self._counters()
        return {"rollout/preemptions": float(now[0] - before[0]),
                "rollout/recomputed_tokens": float(now[1] - before[1])}  # fmt: skip

    def _utilization(self, before) -> float:
        """Tokens decoded over slot-steps of the decode calls since `before` (engine.slot_steps);
        0 without a decode call (partial rollouts: B groups completed in earlier steps)."""
        active, total = (a - b for a, b in zip(self.engine.slot_steps, before))
        return active / max(total, 1)

    def _sample_partial(self, step, params, data, drain, stop):
        prefill_before, slot_steps = self.engine.prefill_tokens, list(self.engine.slot_steps)
        counters = self._counters()
        state = self.engine.init_state() if self.decode_state is None else self.decode_state
        self.decode_state = None  # donated below; kept again only once the call has returned
        state, groups, stats = self.partial.sample(step, params, state, data, drain, stop)
        idle = self.partial.loop.idle
        if not (idle and self.config.sampling.release_kv_between_phases):
            self.decode_state = state  # episodes in flight keep their pages across the step
        stats["prefill_tokens"] = self.engine.prefill_tokens - prefill_before
        stats["reprefill_tokens"] = reprefill_tokens(groups) if self.episodes else 0
        stats["rollout/slot_utilization"] = self._utilization(slot_steps)
        stats.update(self._preemption_stats(counters))
        return groups, stats

    def __call__(self, step: int, params, data, drain=False, stop=None) -> Rollout:
        """Step `step`'s Rollout. With partial rollouts `drain` (a checkpoint step) ends the step
        with no episode in flight, and so does `stop` (None, or a callable asked at the start of
        the step and once its batch is complete whether a stop was requested); otherwise both
        are ignored (nothing is ever carried)."""
        c = self.config
        if self.partial is not None:
            groups, stats = self._sample_partial(step, params, data, drain, stop)
        else:
            groups, stats = self._sample(step, params, data)
        s = c.sampling
        batch, layout = build_batch(groups, s.max_prompt_len + s.max_new_tokens, self.pad_id,
                                    s.min_new_tokens, c.rl.pack, self.row_multiple,
                                    c.rl.minibatches)  # fmt: skip
        keep = np.concatenate([grp.keep() for grp in groups])  # [B*G]
        mask = None if keep.all() else keep  # None: the unmasked path, bit for bit
        if mask is not None:  # infrastructure failures: no loss on their tokens
            batch = batch.replace(loss_mask=batch.loss_mask * layout.spread(keep))
        self.row_shapes.add(layout.rows)
        stats.update({"learn/rows": layout.rows, "learn/row_shapes": len(self.row_shapes),
                      "learn/padding_frac": layout.padding_frac})  # fmt: skip
        completions = batch.loss_mask
        if c.rl.mask_truncated:  # DAPO: completions cut by the length limit get no loss
            stopped = [cp.finish_reason == "stop" for grp in groups for cp in grp.completions]
            batch = batch.replace(loss_mask=completions * layout.spread(stopped))
        batch = jax.device_put(batch, self.batch_sharding)
        rewards = np.concatenate([grp.rewards for grp in groups])
        penalty = None
        if c.rl.kl_in == "reward" and c.rl.kl_coef > 0:
            # The KL is data here: beta * sum_t k1 of the rollout policy against the reference,
            # both on the tempered full softmax (rl.logprobs), over every completion token.
            ref = self.learner.reference_logprobs(params, self.ref_params, batch)
            pi = self.learner.logprobs(params, batch, "full")
            penalty = kl_reward_penalty(pi, ref, jax.device_put(completions, self.batch_sharding),
                                        c.rl.kl_coef, c.rl.kl_clamp, batch.segment_ids[:, 1:])  # fmt: skip
            penalty = layout.gather(host_values(penalty))  # every process gets all rows
            stats["reward/kl_penalty_mean"] = float(penalty.mean())
            batch = batch.replace(ref_logp=ref)  # the learner logs the KL, the loss ignores it
        adv, adv_stats = compute_advantages(
            jnp.asarray(rewards), c.rl.num_generations, c.rl.advantage, c.rl.advantage_eps,
            penalty, mask,
        )  # fmt: skip
        if penalty is not None:
            rewards = rewards - penalty  # the shaped rewards, for the logs
        adv = layout.spread(np.asarray(adv))  # each sequence's advantage on its positions
        batch = batch.replace(advantages=jax.device_put(adv, self.batch_sharding))
        stats.update({k: float(v) for k, v in adv_stats.items()}, **length_stats(groups))
        for name in groups[0].parts:
            part = np.concatenate([grp.parts[name] for grp in groups])
            stats[f"reward/{name}"] = float(np.mean(part[keep])) if keep.any() else 0.0
        if self.episodes is not None:
            stats.update(
                episode_stats(groups, stats.pop("prefill_tokens"), stats.pop("reprefill_tokens"))
            )
        return Rollout(batch, groups, rewards, stats, layout)

    def _sample(self, step: int, params, data) -> tuple[list[Group], dict[str, float]]:
        c = self.config
        b, g, max_tries = (
            c.data.prompts_per_step,
            c.rl.num_generations,
            c.rl.dynamic_sampling_max_tries,
        )
        root = jax.random.fold_in(jax.random.key(c.seed), step)
        rounds = []
        prefill_before, self.reprefill = self.engine.prefill_tokens, 0
        slot_steps, counters = list(self.engine.slot_steps), self._counters()

        def sample_round(n):
            records = data.take(n)  # a rl.data.PromptStream: leftovers carry to the next draw
            prompts = self.prompts_of(records)
            seed = int(jax.random.randint(jax.random.fold_in(root, len(rounds)), (), 0, 2**31 - 1))
            # Request ids unique over steps and refill rounds: at most b prompts a round.
            base = (step * max_tries + len(rounds)) * b
            rounds.append(n)
            groups = self.sample_groups(params, records, prompts, seed, range(base, base + n))
            check_rewards_agree(groups)  # a refill round is decided from them
            return groups, selection_rewards(groups)

        if not c.rl.dynamic_sampling:
            groups, stats = sample_round(b)[0], {}
        else:
            groups, _, stats = fill_groups(sample_round, b, g, max_tries)
        stats["prefill_tokens"] = self.engine.prefill_tokens - prefill_before
        stats["reprefill_tokens"] = self.reprefill
        stats["rollout/slot_utilization"] = self._utilization(slot_steps)
        stats.update(self._preemption_stats(counters))
        return groups, stats

    def sample_groups(self, params, records, prompts, seed, request_ids) -> list[Group]:
        """G completions of every prompt, each group scored on the worker as it finishes."""
        c = self.config
        g = c.rl.num_generations
        done = [[None] * g for _ in prompts]
        left = [g] * len(prompts)
        futures = {}

        def on_finish(i, k, completion):
            done[i][k] = completion
            left[i] -= 1
            if not left[i]:
                futures[i] = self.score(records[i], prompts[i], done[i])

        state = self.engine.init_state() if self.decode_state is None else self.decode_state
        self.decode_state = None  # donated below; kept again only once the call has returned
        if self.episodes is not None:
            state, out = self.episodes.run(params, state, records, prompts, g, seed, request_ids)
        else:
            state, _ = self.engine.generate_all(
                params, state, prompts, g, seed=seed, request_ids=list(request_ids),
                on_finish=on_finish,
            )  # fmt: skip
        if not c.sampling.release_kv_between_phases:
            self.decode_state = state  # keep the pages allocated for the next rollout
        if self.episodes is not None:
            groups = [
                episode_group(record, prompt, eps, completions, fut.result(), self.tokenizer)
                for record, prompt, (eps, completions, fut) in zip(records, prompts, out)
            ]
            self.reprefill += reprefill_tokens(groups)
            return groups
        return [futures[i].result() for i in range(len(prompts))]

    def close(self) -> None:
        self.pool.shutdown()
        if self.episodes is not None:
            self.episodes.close()


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
