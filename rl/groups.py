"""The rollout driver: G samples of each record on the sampler's loop, each group scored as soon
as its G samples have ended, handed out as a `Group`. Training (synchronous or partial
rollouts, single-turn or multi-turn) and evaluation all run their groups through it.

    records --prompts_of--> prompt ids --add--> sampling.episodes.EpisodeLoop (over the engine)
            --on_finish, once a group's G samples ended--> its score started (a worker thread):
              single-turn, `score(record, prompt, completions)` -> Group (e.g. `score_group`);
              multi-turn, the environment's rewards (`rl.multiturn.EpisodeSampler.score`)
            --group(key): the score waited for--> Group (shard set)  --take(key): and forgotten

`group` is the one place a finished group becomes a scored `Group`. A schedule decides what to
add and when to stop (`GroupSampler.round`: a synchronous round, run until every group has
ended; `rl.partial.Partial`: one loop kept across steps, stopped once a batch is complete), and
what to train (`take`).

Keys: a group's key is its request id (the sampler's PRNG stream), unique over the groups the
driver holds. Scores run behind decoding: a single-turn group on the driver's reward worker, a
multi-turn one on the environment's tool workers.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from rl import summary as S
from rl.data import reward_inputs, tokenize_prompts
from rl.dynamic_sampling import fill_groups
from rl.multiturn import EpisodeSampler
from rl.rewards import combined_rewards
from rl.shaping import overlong_penalty
from sampling.engine import Engine
from sampling.episodes import EpisodeLoop


@dataclasses.dataclass
class Group:
    """One prompt and its G scored completions, on batch shard `shard`."""

    record: dict
    prompt: list[int]
    completions: list  # sampling.requests.Completion, G of them
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


def score_group(record, prompt, completions, tokenizer, rl_cfg, max_new_tokens, prompt_field):
    """A single-turn group scored for training: the weighted rewards of `rl_cfg.rewards`, with
    DAPO's overlong penalty when `rl_cfg.overlong_buffer` is set."""
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


def episode_group(record, prompt, episodes, completions, rewards, tokenizer) -> Group:
    """A scored multi-turn group: the environment's rewards, whole episodes as texts."""
    texts = [tokenizer.decode(c.tokens) for c in completions]
    parts = {"env": rewards}  # an env error is masked (rl.multiturn): episode/env_errors counts it
    masked = np.array([bool(getattr(ep, "masked", False)) for ep in episodes])
    return Group(record, prompt, completions, texts, rewards, parts, episodes, masked)


def env_prompts(env, records, max_prompt_len: int, prompt_field: str) -> list[list[int]]:
    """The environment's prompt ids of records; one longer than max_prompt_len is an error."""
    prompts = [env.prompt(r, prompt_field) for r in records]
    longest = max((len(p) for p in prompts), default=0)
    if longest > max_prompt_len:
        raise ValueError(
            f"a prompt has {longest} tokens > config.sampling.max_prompt_len={max_prompt_len}"
        )
    return prompts


class GroupSampler:
    """Groups of G samples on one episode loop over `engine`, scored as they complete.

    config: the run's config (prompts: `sampling.max_prompt_len`, the tokeniser's settings);
    prompt_field: the records' prompt field; score: a single-turn group's scorer
    (record, prompt, completions) -> Group, run on the reward worker (unused with `episodes`);
    episodes: multi-turn, the environment's `EpisodeSampler` (None: single-turn);
    answer_calls: multi-turn, the loop's tool hand-off (`sampling.episodes`, "Logical time").
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        num_samples: int,
        config,
        prompt_field: str,
        score=None,
        episodes: EpisodeSampler | None = None,
        answer_calls: int | None = None,
    ):
        self.engine, self.tokenizer, self.g = engine, tokenizer, num_samples
        self.config, self.prompt_field = config, prompt_field
        self.score, self.episodes, self.answer_calls = score, episodes, answer_calls
        self.pool = ThreadPoolExecutor(max_workers=1)  # reward functions overlap decoding
        self.loop: EpisodeLoop | None = None
        self.groups: dict[int, tuple] = {}  # key -> (record, prompt, shard), until taken
        self.done: dict[int, tuple] = {}  # key -> (completions, score pending), complete
        self.scored: dict[int, Group] = {}  # key -> its Group, once its score was waited for
        self.done_at: dict[int, int] = {}  # key in `done` -> the loop's clock when it completed
        self.generated: list[int] = []  # lengths of the episodes that ended (reset by callers)

    def open(self) -> EpisodeLoop:
        """A fresh episode loop over the engine (the one `add` and `run` use from now on)."""
        if self.episodes is None:
            self.loop = EpisodeLoop(self.engine, self.g, on_finish=self._on_finish)
        else:
            self.loop = EpisodeLoop(
                self.engine,
                self.g,
                on_finish=self._on_finish,
                respond=self.episodes.respond,
                max_turn_tokens=self.episodes.max_turn_tokens,
                answer_calls=self.answer_calls,
            )
        return self.loop

    def prompts_of(self, records) -> list[list[int]]:
        """The prompt ids of data records (the environment's prompts, with an environment)."""
        c = self.config
        if self.episodes is None:
            return tokenize_prompts(records, self.tokenizer, c, self.prompt_field)
        return env_prompts(self.episodes.env, records, c.sampling.max_prompt_len, self.prompt_field)

    def add(self, records, keys, shards) -> None:
        """Queues records as groups under `keys` (their request ids), record j on batch shard
        shards[j] (None: each where there is room)."""
        prompts = self.prompts_of(records)
        shards = [None] * len(keys) if shards is None else list(shards)
        for key, record, prompt, shard in zip(keys, records, prompts, shards):
            self.groups[key] = (record, prompt, shard)
            if self.episodes is not None:
                self.episodes.begin(key, record, self.g)
        shards = None if all(s is None for s in shards) else shards
        self.loop.add(prompts, request_ids=list(keys), keys=list(keys), shards=shards)

    def _on_finish(self, key, k, completion) -> None:
        """The loop's on_finish: once a group's G samples have ended, its score starts."""
        self.generated.append(completion.length)
        results = self.loop.results[key]
        if any(c is None for c in results):
            return
        record, prompt, _ = self.groups[key]
        self.done_at[key] = self.loop.clock
        if self.episodes is None:
            self.done[key] = (results, self.pool.submit(self.score, record, prompt, results))
        else:
            self.done[key] = (results, self.episodes.score(key))

    def graded(self, key) -> bool:
        """Whether a complete group's score is done (waiting for it would not block)."""
        scored = self.done[key][1]
        return (scored if self.episodes is None else scored[1]).done()

    def run(self, params, state, seed, **kwargs):
        """`EpisodeLoop.run` (kwargs: version, until, refresh); after an exception what the
        unscored episodes hold is released (`EpisodeSampler.abandon`)."""
        try:
            return self.loop.run(params, state, seed, **kwargs)
        except BaseException:
            self.abandon()
            raise

    def group(self, key) -> Group:
        """The scored `Group` of a complete group (its score waited for): the one place a
        finished group becomes a scored one."""
        if key not in self.scored:
            completions, scored = self.done[key]
            record, prompt, shard = self.groups[key]
            if self.episodes is None:
                grp = scored.result()
            else:
                episodes, rewards = scored
                grp = episode_group(
                    record, prompt, episodes, completions, rewards.result(), self.tokenizer
                )
            grp.shard = 0 if shard is None else shard
            self.scored[key] = grp
        return self.scored[key]

    def take(self, key) -> Group:
        """A complete group's `Group`, forgotten here and by the loop (trained or dropped)."""
        grp = self.group(key)
        for d in (self.done, self.groups, self.scored):
            d.pop(key)
        self.done_at.pop(key, None)
        self.loop.forget(key)
        return grp

    def of(self, shard: int, keys) -> list:
        """The keys of `keys` on batch shard `shard`."""
        return [k for k in keys if self.groups[k][2] == shard]

    def round(self, params, state, records, keys, shards, seed):
        """(state, groups): a synchronous round on a fresh loop: G samples of every record
        (under its key = request id, on its shard), run until all have ended, their scored
        groups in the records' order."""
        self.open()
        self.add(records, keys, shards)
        state = self.run(params, state, seed)
        return state, [self.take(k) for k in keys]

    def counters(self) -> dict[str, float]:
        """This process's engine counters, and with an environment its tool counters."""
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

    def abandon(self) -> None:
        """Releases what every unscored episode holds (after an exception)."""
        if self.episodes is not None:
            self.episodes.abandon()

    def close(self) -> None:
        self.pool.shutdown()
        if self.episodes is not None:
            self.episodes.close()


class Synchronous:
    """The synchronous step: B/S groups per batch shard sampled in rounds, each on a fresh loop
    run until every group has ended (`GroupSampler.round`); with dynamic sampling the shards
    refilled round by round (`rl.dynamic_sampling.fill_groups`). Nothing is carried.

    Randomness: round r of step s samples with the seed drawn from
    fold_in(fold_in(key(seed), s), r), and shard i's j-th record of it is request
    (s * max_tries + r) * B + i * B/S + j: unique over steps, refill rounds and shards."""

    carries = False  # every group trains in the step that sampled it
    idle = True  # nothing in flight between steps
    carried = 0

    def __init__(self, sampler: GroupSampler, config, num_shards: int, local):
        self.sampler, self.config = sampler, config
        self.num_shards, self.local = num_shards, list(local)
        self.mine = [i in self.local for i in range(num_shards)]
        self.quota = config.data.prompts_per_step // num_shards  # groups per shard a step

    def sample(self, step: int, params, state, data, drain=False, stop=None):
        """(state, this process's groups, stats) of step `step` (`drain` and `stop` ignored:
        a synchronous step ends with nothing in flight)."""
        c = self.config
        root = jax.random.fold_in(jax.random.key(c.seed), step)
        tries, reprefill = [0], [0]
        self.sampler.generated = []

        def sample_round(counts):  # counts: records per shard this round (every shard's)
            records = data.take_shards(counts, self.mine)  # a rl.data.PromptStream
            seed = int(jax.random.randint(jax.random.fold_in(root, tries[0]), (), 0, 2**31 - 1))
            base = (step * c.rl.dynamic_sampling_max_tries + tries[0]) * c.data.prompts_per_step
            tries[0] += 1
            todo = [
                (i, r, base + i * self.quota + j)
                for i in self.local
                for j, r in enumerate(records[i])
            ]
            nonlocal state
            state, groups = self.sampler.round(
                params,
                state,
                [r for _, r, _ in todo],
                [n for *_, n in todo],
                [i for i, _, _ in todo],
                seed,
            )
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

    def stats(self, groups: list[dict], counts: list[dict]) -> dict[str, float]:
        """No statistic of its own (`rl.partial.Partial.stats`: token ages)."""
        return {}
