"""The CPU tool task: a character-level model multiplies 3-digit numbers with a calculator.

    prompt  "123*456="
    tool    "<123*456>"  -> observation "56088;"  -> "56088" <eos>
    direct  "56000" <eos>                                       (a guess: usually wrong)

A turn that ends on the call-close character ">" is a tool call: the text after its last "<" goes
to `rl.tasks.calculator`, and the result followed by ";" is the observation. A malformed call
(no "<", not `int op int`) gets the observation "?;", which the model can read, and counts as a
tool error. A turn that ends any other way (end token, or its token cap) ends the episode; its
text is the answer, scored like `arithmetic_exact` (the leading integer equals the answer).
The warm start (`python -m launch.sft --task calc`) calls the tool on some problems and guesses
on the others; GRPO learns to call it (configs/calc_tool.py).
"""

from __future__ import annotations

from rl.environment import Environment, Episode, Turn, register_env
from rl.rewards import arithmetic_exact
from rl.tasks import CALL_CLOSE, CALL_OPEN, calc_observation


@register_env("calculator")
class CalculatorEnv(Environment):
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(CALL_CLOSE, special=True))

    def step(self, episode: Episode, turn: Turn) -> list[int] | None:
        if turn.finish_reason != "stop" or not turn.text.endswith(CALL_CLOSE):
            return None  # an answer: the episode ends
        episode.tool_calls += 1
        _, opened, expr = turn.text[:-1].rpartition(CALL_OPEN)
        observation = calc_observation(expr if opened else CALL_OPEN)  # no "<": malformed
        episode.tool_errors += observation == calc_observation(CALL_OPEN)
        episode.observations.append(observation)
        return self.observation_ids(observation, turn)

    def reward(self, episode: Episode) -> float:
        last = episode.turns[-1] if episode.turns else None
        if last is None or last.text.endswith(CALL_CLOSE):
            return 0.0  # ended on a call (turn or token limit): no answer
        return arithmetic_exact([""], [last.text], answer=[episode.record["answer"]])[0]
