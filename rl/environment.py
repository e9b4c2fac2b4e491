"""The environment interface of multi-turn, tool-using episodes, and the registries that the
built-in environments (rl/envs/, imported by launch's entry points) fill from above: environments by
name (`register_env`) and their infrastructure's process-wide counters (`register_counter`). The
learning modules import this module, never an environment or the sandbox.

An environment turns a data record into the prompt ids of an episode, and each finished model
turn into the next observation ids (tool output, test failures) or the end of the episode; at the
end it gives the episode's reward. Everything is token ids: the model's turns are the ids the
sampler produced, observations are appended as ids (`observation_ids`: for a chat model the
template's rendering of the tool message alone, `models.chat`), and nothing is re-rendered.

    class Echo(Environment):
        def step(self, episode, turn):            # turn.text, turn.ids, turn.finish_reason
            if episode.num_turns == 1:
                episode.tool_calls += 1
                return self.observation_ids("ok", turn)
            return None                           # the episode ends
        def reward(self, episode):
            return float(episode.turns[-1].text.strip() == "done")

`step` runs on a worker thread (`rl.multiturn`), so a slow tool blocks only its own episode. A
malformed tool call should get an error observation the model can read (count it in
`episode.tool_errors`). An infrastructure failure is not the model's fault: `masked(episode)` True
leaves the episode out of the loss (its reward is then ignored). Neither is an exception raised by
`step` or `reward` (an environment bug): it ends that episode, masked the same way and counted in
`episode/env_errors`; it never stops the run. A model caught changing how it is graded scores 0,
with what it changed in `episode.tamper` (counted in `episode/tamper`). Limits per episode (turns,
tokens, tool seconds) are enforced by the caller (`rl.multiturn`), from the config's `env` section.

G episodes of the same record form one GRPO group.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

from models.chat import end_of_turn_id, message_delta_ids
from rl.data import format_prompt


@dataclasses.dataclass
class Turn:
    """One finished model turn."""

    ids: list[int]  # exactly the sampled ids, the stop id included
    text: str  # their decoding (special tokens skipped)
    finish_reason: str  # "stop" (a stop id) | "length" (the turn's token cap)


@dataclasses.dataclass
class Episode:
    """One episode's environment-side state; an environment may subclass it (`start`)."""

    record: dict
    turns: list[Turn] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls and tools that failed (error observations)
    tool_seconds: float = 0.0  # wall time of `step` calls (set by the caller)
    env_errors: int = 0  # exceptions raised by the environment itself (set by the caller)
    masked: bool = False  # out of the loss: env.masked(episode) or env_errors (set by the caller)
    tamper: list = dataclasses.field(default_factory=list)  # what the env caught the model
    # changing in its grading (the repo env's harness): scored 0, counted in episode/tamper
    metrics: dict = dataclasses.field(default_factory=dict)  # name -> float, logged episode/<name>
    workspace: Any = None  # e.g. a sandbox workspace, released by `close`

    @property
    def num_turns(self) -> int:
        return len(self.turns)


class Environment(abc.ABC):
    """Base class; `config` is the training config (data settings, the `env` section)."""

    runs_code = False  # whether it runs model-written code (rl.sandbox): checked at start-up

    @classmethod
    def check_sandbox(cls, config) -> str:
        """For an environment that `runs_code`: why this host cannot run it under
        config.env.isolation, in one line; "" when it can (launch.validate's start-up check)."""
        return ""

    def __init__(self, tokenizer, config):
        self.tokenizer, self.config = tokenizer, config
        self._end = end_of_turn_id(tokenizer, **self._template_kwargs())

    def _template_kwargs(self) -> dict:
        kwargs = self.config.data.get("chat_template_kwargs", {})
        return kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs)

    def prompt(self, record: dict, prompt_field: str = "prompt") -> list[int]:
        """The episode's prompt ids; by default the record's `prompt_field` (the data split's)
        under the config's data settings (chat template, system prompt), as for single-turn."""
        d = self.config.data
        return format_prompt(
            record,
            self.tokenizer,
            d.use_chat_template,
            d.system_prompt or None,
            prompt_field,
            self._template_kwargs(),
        )

    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end a model turn besides the tokenizer's end ids (a tool-call close);
        added to the sampler's stop ids."""
        return ()

    def start(self, record: dict) -> Episode:
        """A fresh episode for `record` (called on the rollout thread)."""
        return Episode(record)

    @abc.abstractmethod
    def step(self, episode: Episode, turn: Turn) -> list[int] | None:
        """The observation ids after `turn` (already in episode.turns), or None to end."""

    @abc.abstractmethod
    def reward(self, episode: Episode) -> float:
        """The episode's reward, once it has ended (by `step` or by a limit)."""

    def masked(self, episode: Episode) -> bool:
        """Whether the scored episode failed for a reason that is not the model's (a sandbox that
        did not start, a harness timeout): it is then left out of the loss and of its group's
        advantage statistics, and counted in `episode/infra_errors`."""
        return False

    def close(self, episode: Episode) -> None:
        """Releases what the episode holds (a workspace); called once it is scored."""
        return None

    def observation_ids(self, text: str, turn: Turn, role: str = "tool") -> list[int]:
        """Ids of an observation message after `turn`: the chat template's rendering of that
        message alone when the data use a chat template (closing the assistant turn first if
        it stopped on a tool-call close rather than its end-of-turn token), else the text."""
        if not self.config.data.use_chat_template:
            return self.tokenizer.encode(text)
        closed = bool(turn.ids) and self._end is not None and turn.ids[-1] == self._end
        return message_delta_ids(
            self.tokenizer,
            {"role": role, "content": text},
            turn_closed=closed,
            **self._template_kwargs(),
        )


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}  # env.name -> class, filled by rl/envs

# Process-wide counters of the environments' infrastructure (name -> its count in this process so
# far), reported per process next to tool calls and seconds (`rl.multiturn`). Filled from above:
# rl/envs registers the sandbox's "sandbox_runs"; the learning modules import no sandbox.
PROCESS_COUNTERS: dict[str, Callable[[], float]] = {}


def register_counter(name: str, read: Callable[[], float]) -> None:
    """Adds a process-wide counter (`read()` gives its value so far) under `name`."""
    if name in PROCESS_COUNTERS:
        raise ValueError(f"counter {name!r} is already registered")
    PROCESS_COUNTERS[name] = read


def process_counters() -> dict[str, float]:
    """Every registered counter's value in this process now."""
    return {name: read() for name, read in PROCESS_COUNTERS.items()}


def register_env(name: str):
    """Class decorator adding an environment to the registry under `name` (config `env.name`)."""

    def wrap(cls):
        if name in ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is already registered")
        ENVIRONMENTS[name] = cls
        return cls

    return wrap


def make_env(name: str, tokenizer, config) -> Environment:
    if name not in ENVIRONMENTS:
        raise ValueError(f"env.name={name!r}: unknown; known environments: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](tokenizer, config)
