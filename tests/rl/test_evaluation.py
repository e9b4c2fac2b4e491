"""Held-out scores of multi-turn episodes (`rl.evaluation.episode_scores`): infrastructure
failures (masked episodes) count neither as right nor as wrong; pass@k against its definition."""

import itertools
import math

import numpy as np

from rl.evaluation import episode_scores, pass_at_k


def test_pass_at_k_is_the_chance_that_k_of_n_draws_hold_a_correct_one():
    for n, c, k in [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 5, 2), (4, 4, 4)]:
        draws = list(itertools.combinations([True] * c + [False] * (n - c), k))
        assert math.isclose(pass_at_k(n, c, k), np.mean([any(d) for d in draws]), rel_tol=1e-9)


def test_masked_episodes_are_left_out_of_accuracy_and_pass_at_k():
    correct = np.array([[True], [False], [True], [False]])
    masked = np.array([[False], [False], [False], [True]])  # the 4th: a harness timeout
    assert episode_scores(correct, masked) == {"infra_errors": 1.0, "accuracy": 2 / 3}
    assert episode_scores(correct, np.zeros_like(masked))["accuracy"] == 0.5  # counted wrong
    correct = np.array([[True, False, False], [False, True, True], [True, True, False]])
    masked = np.array([[False, False, True], [False, False, False], [True, True, False]])
    # record 0: 2 kept, 1 right; record 1: 3 kept, 2 right; record 2: 1 kept (< k): left out
    got = episode_scores(correct, masked, k=2)
    assert got["infra_errors"] == 3.0
    assert math.isclose(got["pass@2"], (pass_at_k(2, 1, 2) + pass_at_k(3, 2, 2)) / 2)
    assert math.isnan(episode_scores(correct, np.ones_like(masked), k=1)["pass@1"])  # unknown


def test_evaluation_counts_the_episodes_caught_tampering(monkeypatch):
    """evaluate() with an env returns "tamper" (logged eval/tamper): the episodes of the greedy
    and the sampled runs whose environment caught the model changing its grading."""
    from types import SimpleNamespace as NS

    from rl import evaluation
    from rl.environment import Episode
    from rl.groups import Group

    class Sampler:  # the rollout driver: G episodes per record, the first of each run caught
        def __init__(self, engine, tokenizer, g, *args):
            self.g = g

        def round(self, params, state, records, keys, shards, seed):
            eps = [[Episode({}) for _ in range(self.g)] for _ in records]
            eps[0][0].tamper = ["builtins.__build_class__"]
            groups = [
                Group({}, [1], [NS(tokens=[1])] * self.g, ["1"] * self.g, np.zeros(self.g), {}, e)
                for e in eps
            ]
            return None, groups

        def close(self):
            pass

    monkeypatch.setattr(evaluation, "EpisodeSampler", lambda *a: object())
    monkeypatch.setattr(evaluation, "GroupSampler", Sampler)
    engine = NS(init_state=lambda: None, num_shards=1, local_shards=[0])
    cfg = NS(env=None, sampling=NS(max_prompt_len=8), data=NS(eval=NS(prompt_field="p")),
             eval=NS(pass_n=3, pass_k=2, reward="r"))  # fmt: skip
    out = evaluation.evaluate(engine, engine, None, [{}, {}], NS(decode=str), cfg, 0, env=object())
    assert out["tamper"] == 2 and out["infra_errors"] == 0 and out["accuracy"] == 0


def test_a_process_without_held_out_records_of_its_own_still_evaluates(monkeypatch):
    """One held-out record on 4 batch shards: shard 3 takes it, so the process of shards 0-1 has
    none of its own. It still runs its (empty) share and agrees on the other process's results,
    rather than failing in its reward (which would leave its peer waiting in the agreement)."""
    from types import SimpleNamespace as NS

    from rl import evaluation

    class Sampler:  # the rollout driver, given this process's (empty) share
        def __init__(self, *args):
            pass

        def round(self, params, state, records, keys, shards, seed):
            assert records == [] and list(keys) == [] and list(shards) == []
            return None, []

        def close(self):
            pass

    monkeypatch.setattr(evaluation, "GroupSampler", Sampler)
    engine = NS(init_state=lambda: None, num_shards=4, local_shards=[0, 1])
    theirs = iter([[{"index": 0, "correct": True, "text": "2"}], [{"index": 0, "c": 3}]])
    monkeypatch.setattr(evaluation, "agree_json", lambda rows: [rows, next(theirs)])
    cfg = NS(data=NS(eval=NS(prompt_field="prompt")), sampling=NS(max_prompt_len=8),
             eval=NS(pass_n=4, pass_k=2, reward="arithmetic_exact"))  # fmt: skip
    records = [{"prompt": "1+1=", "answer": "2"}]
    out = evaluation.evaluate(engine, engine, None, records, NS(decode=str), cfg, 0)
    assert out == {"accuracy": 1.0, "example": "2", "pass@2": pass_at_k(4, 3, 2)}
