"""The CPU repository demo's environment (`rl.envs.repo_fix`) and tasks (`rl.envs.repo_fix_tasks`):
scoring on the final file, a failure output that names the right fix, str_replace's refusals and
malformed calls, the call limit, the per-episode metrics, the records and the warm start's
scripted episodes."""

import ml_collections
import numpy as np
import pytest

from configs import repo_fix as repo_fix_config
from launch.sft_repo_fix import SEQ_LEN, encode
from models.tokenizer import CharTokenizer
from rl.environment import Turn
from rl.envs import make_env
from rl.envs.repo_fix_tasks import (
    REPO_FIX_ALPHABET,
    parse_module,
    repo_fix_records,
    run_tests,
    scripted_episode,
    str_replace,
)

TOK = CharTokenizer(REPO_FIX_ALPHABET)
EOS = TOK.eos_ids[0]
RECORD = {
    "prompt": "m.py:k=3\nfix:5|7|9|2\n", "files": {"m.py": "k=3"},
    "fail_to_pass": ["assert m.k==9"], "pass_to_pass": ["import m"], "answer": "9",
}  # fmt: skip


def _env(max_tool_calls=2):
    c = ml_collections.ConfigDict({"data": {"use_chat_template": False, "system_prompt": ""},
                                   "env": {"max_tool_calls": max_tool_calls}})  # fmt: skip
    return make_env("repo_fix", TOK, c)


def _turn(text, eos=False):
    ids = TOK.encode(text) + ([EOS] if eos else [])
    return Turn(ids, text, "stop")


def _play(env, record, turns):
    """Runs model turns through the env; returns (episode, observations, reward)."""
    ep, obs = env.start(record), []
    for text in turns:
        turn = _turn(text, eos=not text.endswith(">"))
        ep.turns.append(turn)
        out = env.step(ep, turn)
        if out is None:
            break
        obs.append(TOK.decode(out))
    return ep, obs, env.reward(ep)


def test_right_first_edit_scores_one():
    ep, obs, reward = _play(_env(), RECORD, ["<k=3/k=9>", ""])
    assert obs == ["passed;"] and reward == 1.0
    assert ep.metrics == {
        "fail_to_pass_frac": 1.0,
        "pass_to_pass_frac": 1.0,
        "first_try_fix_rate": 1.0,
    }


@pytest.mark.parametrize("wrong", ["5", "7", "2"])
def test_failure_output_identifies_the_right_fix(wrong):
    """The failing assertion shows the file's value, then the one the test wants: the fix."""
    ep, obs, reward = _play(_env(), RECORD, [f"<k=3/k={wrong}>", ""])
    assert obs == [f"assert {wrong}==9;"] and reward == 0.0
    want = obs[0].removesuffix(";").split("==")[1]
    assert want == RECORD["answer"]
    assert ep.metrics["second_try_fix_rate"] == 0.0 and ep.metrics["first_try_fix_rate"] == 0.0


def test_second_try_reading_the_failure_fixes():
    ep, obs, reward = _play(_env(), RECORD, ["<k=3/k=5>", "<k=5/k=9>", ""])
    assert obs == ["assert 5==9;", "passed;"] and reward == 1.0
    assert ep.metrics["second_try_fix_rate"] == 1.0 and ep.metrics["first_try_fix_rate"] == 0.0
    assert ep.tool_calls == 2 and ep.tool_errors == 0


@pytest.mark.parametrize(
    "first, noop, after_wrong",
    [("<k=3/k=3>", 1.0, None), ("<k=3/k=5>", 0.0, 1.0), ("<k=3/k=4>", 0.0, None)],
)
def test_first_edit_kinds(first, noop, after_wrong):
    """A no-op first edit only runs the tests; a wrong candidate is a genuine failed attempt."""
    value = first[-2]
    ep, obs, reward = _play(_env(), RECORD, [first, f"<k={value}/k=9>", ""])
    assert obs == [f"assert {value}==9;", "passed;"] and reward == 1.0
    assert ep.metrics["second_try_fix_rate"] == 1.0
    assert ep.metrics["first_edit_noop_rate"] == noop
    assert ep.metrics.get("fix_after_wrong_candidate_rate") == after_wrong


def test_no_edit_scores_zero_and_reports_no_second_try():
    ep, obs, reward = _play(_env(), RECORD, [""])
    assert obs == [] and reward == 0.0
    assert "second_try_fix_rate" not in ep.metrics and ep.metrics["fail_to_pass_frac"] == 0.0


@pytest.mark.parametrize(
    "call, error",
    [
        ("<k=3>", "E bad call;"),  # no "/"
        ("</k=9>", "E bad call;"),  # empty old_str
        ("k=3/k=9>", "E bad call;"),  # no "<"
        ("<k=4/k=9>", "E no match;"),  # old_str absent
        ("<x=3/x=9>", "E no match;"),
    ],
)
def test_malformed_calls_get_an_error_observation(call, error):
    ep, obs, reward = _play(_env(), RECORD, [call, ""])
    assert obs == [error] and ep.tool_errors == 1 and ep.tool_calls == 1
    assert reward == 0.0 and ep.source == "k=3"  # nothing applied
    assert "second_try_fix_rate" not in ep.metrics  # no edit was applied: no first attempt


def test_str_replace_refuses_non_unique_old_str():
    assert str_replace("k=3\nj=3", "=3/=9") == (None, "E not unique")
    assert str_replace("k=3\nj=3", "k=3/k=9") == ("k=9\nj=3", "")


def test_edits_that_break_the_module_fail_its_tests():
    for call, output in [("<k=3/k=>", "E SyntaxError;"), ("<k=3/k=x>", "E SyntaxError;"),
                         ("<k=3/j=9>", "E no m.k;")]:  # fmt: skip
        ep, obs, reward = _play(_env(), RECORD, [call, ""])
        assert obs == [output] and reward == 0.0 and ep.tool_errors == 0
    f2p, p2p, _ = run_tests(RECORD, "k=")
    assert (f2p, p2p) == (0.0, 0.0)
    assert run_tests(RECORD, "j=9")[:2] == (0.0, 1.0)  # imports, but k is gone


def test_call_limit_ends_the_episode_unapplied():
    ep, obs, reward = _play(_env(max_tool_calls=1), RECORD, ["<k=3/k=5>", "<k=5/k=9>"])
    assert obs == ["assert 5==9;"] and reward == 0.0 and ep.source == "k=5"


def test_turn_cut_at_its_token_cap_ends_the_episode():
    env = _env()
    ep = env.start(RECORD)
    turn = Turn(TOK.encode("<k=3/k=9"), "<k=3/k=9", "length")
    ep.turns.append(turn)
    assert env.step(ep, turn) is None and env.reward(ep) == 0.0


def test_stop_id_is_the_call_close():
    assert _env().stop_ids() == tuple(TOK.encode(">"))


def test_parse_module():
    assert parse_module("k=3\n\nj=-4") == {"k": 3, "j": -4}
    for bad in ["k=3+1", "k==3", "import os", "k=3;j=4", "k=x"]:
        assert parse_module(bad) is None


def test_records_deterministic_disjoint_and_well_formed():
    train, held = repo_fix_records(0, 300), repo_fix_records(1, 100, split="eval")
    assert train == repo_fix_records(0, 300)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    rights = []
    for r in train:
        cands = r["prompt"].split("fix:")[1].strip().split("|")
        bug = r["files"]["m.py"].split("=")[1]
        assert len(set(cands)) == 4 and bug not in cands and r["answer"] in cands
        assert run_tests(r, r["files"]["m.py"])[:2] == (0.0, 1.0)  # fails before the fix
        name = r["files"]["m.py"].split("=")[0]
        assert run_tests(r, f"{name}={r['answer']}")[2] == "passed"
        rights.append(cands.index(r["answer"]))
    assert np.bincount(rights, minlength=4).min() > 40  # the right one's position is uniform


def test_scripted_episodes_ignore_the_failure_output():
    """The warm start's second edit is a random other candidate: right 1 in 3, not always."""
    rng = np.random.default_rng(0)
    second = []
    for r in repo_fix_records(0, 600):
        parts = scripted_episode(r, rng)
        edits = [t for t, mine in parts if mine]
        assert parts[0] == (r["prompt"], False) and 1 <= len(edits) <= 2
        ep, _, reward = _play(_env(), r, edits + [""])
        assert [o for o in ep.observations] == [t for t, mine in parts[1:] if not mine]
        if len(edits) == 2:
            assert edits[0].split("=")[-1] != edits[1].split("=")[-1]  # another candidate
            second.append(reward)
    assert 0.25 < np.mean(second) < 0.42


def test_encode_masks_observations_and_fits():
    tokens, valid, mask = encode(repo_fix_records(0, 50), TOK, SEQ_LEN, 0)
    for t, m in zip(tokens, mask):
        text = TOK.decode(t)
        trained = "".join(TOK.decode([t[i + 1]], skip_special=False) for i in np.flatnonzero(m))
        assert trained.replace("<eos>", "") == "".join(
            c for part in text.split("<")[1:] for c in "<" + part.split(">")[0] + ">"
        )
        assert trained.endswith("<eos>")


def test_demo_config_fits_the_episodes():
    c = repo_fix_config.get_config()
    prompts = [len(r["prompt"]) for r in repo_fix_records(0, 200)]
    assert max(prompts) <= c.sampling.max_prompt_len
    longest = 2 * 9 + 2 * len("assert 9==9;") + 1
    assert longest <= c.sampling.max_new_tokens and c.env.max_turn_tokens >= 9
