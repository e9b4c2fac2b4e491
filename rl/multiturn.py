"""Multi-turn rollouts: G episodes per record through an environment (`rl.envs`), on the engine's
episode loop (`sampling.episodes`), driven by the rollout driver (`rl.groups.GroupSampler`); this
module is the environment's side of it (`EpisodeSampler`: begin, respond, score).

    record --env.prompt--> prompt ids --engine: model turn (ends on a stop id)-->
           --env.step on a tool worker--> observation ids --engine: prefilled onto the
           episode's own pages, decoding resumes--> ... --env.reward--> episode reward

While an episode's `step` runs (a tool, a sandboxed program), its slot decodes other episodes.
Limits per episode, from the config's `env` section: `max_turns` model turns, the token budget
`sampling.max_new_tokens` after the prompt (model and observation tokens), and `max_tool_seconds`
of `step` wall time, checked after each call (a thread cannot be stopped: a single call is
bounded by the tool itself, e.g. the sandbox's wall-clock limit); the episode ends when one is
reached, and its reward is scored as it stands. An episode the environment reports as an
infrastructure failure (`env.masked`: a harness timeout, a sandbox that did not start) is not the
model's fault, and neither is an exception in `step` or `reward`, a non-finite reward, or
observation ids outside the vocabulary (an environment bug): `episode.masked` is set, and the
rollout zeroes its loss mask and leaves it out of its group's advantage statistics
(`rl.rollout`), as for every masked episode. Counted in `episode/infra_errors` and
`episode/env_errors` (warned about once) respectively; the run goes on. An exception in `close`
is warned about only. `episode/tamper` counts the episodes whose environment caught the model
changing its grading (`episode.tamper`, scored 0 by the environment).

Each finished group is scored on the tool workers as soon as its G episodes end, like single-turn
groups (`rl.rollout`), and `env.close` releases what its episodes held (workspaces).
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rl.environment import Environment, Episode, Turn, process_counters
from sampling.engine import Engine

log = logging.getLogger(__name__)


class EpisodeSampler:
    """Runs an environment's episodes on an engine; holds the tool worker pool."""

    def __init__(self, env: Environment, engine: Engine, tokenizer, env_cfg):
        self.env, self.engine, self.tokenizer = env, engine, tokenizer
        self.vocab_size = engine.cfg.vocab_size
        self.max_turns = env_cfg.max_turns
        self.max_turn_tokens = env_cfg.max_turn_tokens or None
        self.max_tool_seconds = env_cfg.max_tool_seconds
        self.pool = ThreadPoolExecutor(env_cfg.tool_workers, thread_name_prefix="tool")
        self._warned: set[str] = set()
        self.live: dict = {}  # request key -> its G episodes, until scored
        self._lock = threading.Lock()
        self._calls = [0, 0.0]  # tool calls and seconds of this process's scored episodes

    @property
    def counters(self) -> dict[str, float]:
        """This process's tool calls, tool seconds and sandbox runs so far (each process runs
        its own episodes' tools: `rollout/tool_calls_per_process_max` and the like). Calls and
        seconds are counted per episode (`Episode.tool_calls`, `tool_seconds`) once its group
        ends (`score`, on the loop's thread): a step counts the episodes that ended in it,
        whatever tool calls are still running (under partial rollouts, which step a group ends in
        is a function of the loop's logical clock, not of the tools' latency). Sandbox runs are
        counted as they start."""
        with self._lock:
            calls, seconds = self._calls
        return {"tool_calls": calls, "tool_seconds": seconds, **process_counters()}

    def _warn_once(self, what: str, err: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(
                "environment %s raised %s: %s (the episode ends, out of the loss; "
                "counted in episode/env_errors)",
                what,
                type(err).__name__,
                err,
            )

    def _step(self, ep: Episode, turn: Turn):
        start = time.perf_counter()
        try:
            obs = self.env.step(ep, turn)
            if obs is not None:
                obs = [operator.index(t) for t in obs]
                bad = [t for t in obs if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"observation ids {bad[:5]} outside [0, {self.vocab_size})")
        except Exception as err:  # noqa: BLE001 - an environment bug ends the episode only
            self._warn_once("step", err)
            ep.env_errors += 1
            obs = None
        ep.tool_seconds += time.perf_counter() - start
        if ep.tool_seconds > self.max_tool_seconds:
            return None
        return obs

    def _close(self, ep: Episode) -> None:
        try:
            self.env.close(ep)
        except Exception as err:  # noqa: BLE001
            self._warn_once("close", err)

    def _score(self, episodes: list[Episode]) -> np.ndarray:
        rewards = []
        for ep in episodes:
            r, infra = 0.0, False
            try:
                if not ep.env_errors:  # a step that raised: no reward to ask for
                    r = float(self.env.reward(ep))
                    infra = bool(self.env.masked(ep))
                    if not infra and not np.isfinite(r):
                        raise ValueError(f"reward {r}")
            except Exception as err:  # noqa: BLE001
                self._warn_once("reward", err)
                ep.env_errors += 1
            finally:
                self._close(ep)
            # An infrastructure failure or the environment's own error: not the model's doing,
            # so out of the loss and of its group's statistics (rl.rollout reads ep.masked);
            # the reward is a placeholder.
            ep.masked = infra or ep.env_errors > 0
            rewards.append(0.0 if ep.masked else r)
        return np.asarray(rewards, np.float32)

    def begin(self, key, record, g: int) -> None:
        """G fresh episodes of record under `key` (the key of its request in the loop)."""
        self.live[key] = [self.env.start(record) for _ in range(g)]

    def respond(self, key, k, completion, budget_left):
        """`EpisodeLoop`'s respond: the turn goes to its episode; the tool runs on a worker."""
        ep = self.live[key][k]
        text = self.tokenizer.decode(completion.tokens)
        turn = Turn(completion.tokens, text, completion.finish_reason)
        ep.turns.append(turn)
        if ep.num_turns >= self.max_turns or budget_left < 2:
            return None  # a limit: the episode ends with this turn
        return self.pool.submit(self._step, ep, turn)

    def score(self, key):
        """(episodes, future of their f32 [G] rewards) of a group whose G episodes ended."""
        episodes = self.live.pop(key)
        with self._lock:
            self._calls[0] += sum(ep.tool_calls for ep in episodes)
            self._calls[1] += sum(ep.tool_seconds for ep in episodes)
        return episodes, self.pool.submit(self._score, episodes)

    def abandon(self) -> None:
        """Releases what every unscored episode holds (after an exception)."""
        for eps in self.live.values():
            for ep in eps:
                self._close(ep)
        self.live.clear()

    def close(self) -> None:
        """Waits for the tool calls running, then releases what episodes still live hold
        (a run stopped with groups in flight, e.g. after non-finite steps)."""
        self.pool.shutdown()
        self.abandon()


def env_metrics(episodes) -> dict[str, float]:
    """`episode/<name>`: the mean of each of the environment's per-episode metrics (e.g. the repo
    env's pass fractions) over the unmasked episodes that report it (`rl.summary.metric_means`)."""
    from rl.summary import metric_means

    return metric_means(
        [
            {"metrics": {k: float(v) for k, v in getattr(ep, "metrics", {}).items()}}
            for ep in episodes
            if not getattr(ep, "masked", False)
        ]
    )
