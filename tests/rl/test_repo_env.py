"""The `repo` environment (rl/envs/repo/env.py): a scripted policy fixes generated repositories through
the env's step/reward API and through the engine's episode loop; tool semantics and errors;
grading and infrastructure errors: tests/rl/test_repo_grading.py. Isolation against hostile commands:
tests/rl/test_repo_isolation.py; shared fixtures and helpers: tests/rl/repo_env_helpers.py."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.envs.repo import RepoEnv
from rl.envs.repo.tools import cut, parse_calls
from tests.conftest import sandbox_isolation, site_hidden
from tests.rl import repo_env_helpers
from tests.rl import repo_scripted as scripted
from tests.rl.repo_env_helpers import TOK, act, call, make_config
from tests.rl.repo_scripted import fix_script

env, tasks = repo_env_helpers.env, repo_env_helpers.tasks  # the module fixtures


def run_episode(env, task, script):
    ep = env.start(task)
    observations = [act(env, ep, text) for text in script]
    try:
        return env.reward(ep), ep, observations
    finally:
        env.close(ep)


@pytest.mark.repo_sandbox
def test_scripted_fix_gets_1_and_a_wrong_edit_0(env, tasks):
    r, ep, obs = run_episode(env, tasks[0], fix_script(tasks[0], root=scripted.workdir(env)))
    assert r == 1.0 and ep.metrics == {"fail_to_pass_frac": 1.0, "pass_to_pass_frac": 1.0}
    assert "cat -n" in obs[0] and "has been edited" in obs[1] and obs[2] is None
    assert ep.submitted and ep.tool_calls == 3 and ep.tool_errors == 0 and not env.masked(ep)
    assert ep.workspace is None  # deleted on close
    r, ep, _ = run_episode(
        env, tasks[1], fix_script(tasks[1], wrong=True, root=scripted.workdir(env))
    )
    assert r == 0.0 and ep.metrics["fail_to_pass_frac"] < 1 and not env.masked(ep)


@pytest.mark.repo_sandbox
def test_editing_the_tests_does_not_pass_them(env, tasks):
    """The graded run puts the original test files back."""
    t = tasks[2]
    test_file = t["fail_to_pass"][0].split("::")[0]
    hack = call("bash", command=f"printf 'def test_x():\\n    pass\\n' > {test_file}; "
                f"rm -rf {t['fix']['path']}")  # fmt: skip
    r, ep, obs = run_episode(env, t, [hack, call("submit")])
    assert r == 0.0 and ep.metrics["fail_to_pass_frac"] == 0 and not env.masked(ep)


@pytest.mark.repo_sandbox
def test_tool_errors_and_editor_semantics(env, tasks, monkeypatch):
    t, ws_path = tasks[3], scripted.workdir(env)
    ep = env.start(t)
    path = t["fix"]["path"]
    src = open(os.path.join(t["repo"], path)).read()
    ed = lambda **a: act(env, ep, call("str_replace_editor", **a))
    try:
        assert "error: malformed tool call" in act(env, ep, "<tool_call>{not json</tool_call>")
        assert "No tool call found" in act(env, ep, "I think the bug is in line 3.")
        assert "unknown tool 'python'" in act(env, ep, call("python", code="1"))
        assert "non-empty string `command`" in act(env, ep, call("bash"))
        assert "Unrecognized command" in ed(command="delete", path=path)
        assert "did not appear verbatim" in ed(command="str_replace", path=path, old_str="zzz")
        assert "Multiple occurrences" in ed(command="str_replace", path=path, old_str="\n")
        assert "outside the repository" in ed(command="view", path="/etc/passwd")
        assert "outside the repository" in ed(command="view", path="../../etc/passwd")
        act(env, ep, call("bash", command="ln -s /etc/passwd link"))
        assert "outside the repository" in ed(command="view", path="link")
        assert "Cannot overwrite" in ed(command="create", path=path, file_text="x")
        assert "No edit history" in ed(command="undo_edit", path=path)
        assert "first element `99`" in ed(command="view", path=path, view_range=[99, 100])
        errors = ep.tool_errors
        assert errors == 13 and ep.tool_calls == 13  # the turn without a call counts no call
        assert "     2\t" in ed(command="view", path=path, view_range=[2, 3])
        assert "created" in ed(command="create", path="new/mod.py", file_text="A = 1\n")
        assert "A = 1" in act(env, ep, call("bash", command="cat new/mod.py"))
        assert "has been edited" in ed(command="insert", path=path, insert_line=0,
                                       new_str="# top")  # fmt: skip
        assert "has been edited" in ed(command="str_replace", path=path, old_str=t["fix"]["old"],
                                       new_str=t["fix"]["new"])  # fmt: skip
        assert "undone" in ed(command="undo_edit", path=path)
        assert "undone" in ed(command="undo_edit", path=path)
        out = act(env, ep, call("bash", command=f"cat {path}"))
        assert out == src + "[exit code 0]" and ep.tool_errors == errors
        # Several calls in one turn answer in order; a long output keeps its head and tail.
        two = call("bash", command="echo one") + call("bash", command="seq 1 100000; exit 3")
        out = act(env, ep, two)
        assert out.startswith("one\n[exit code 0]\n1\n2\n") and "bytes elided" in out
        assert out.endswith("99999\n100000\n[exit code 3]") and len(out) < 2500
        # env.command_timeout_s (4 s in make_config) made 1 s for the call that waits it out
        monkeypatch.setattr(env, "command_timeout", 1.0)
        out = act(env, ep, call("bash", command="echo start; sleep 30"))
        assert "start" in out and "timed out after 1 s" in out
        monkeypatch.undo()
        assert ws_path in act(env, ep, call("bash", command="pwd"))
    finally:
        env.close(ep)


def test_the_sandbox_probe_passes_where_the_host_lets_it():
    """Where this host lets the workspace uids reach the trainer's site-packages
    (`tests.conftest.site_hidden`), the tests marked repo_sandbox run rather than skip, and the
    start-up probe must pass: a probe broken by a library change fails here, unmarked."""
    from ml_collections import ConfigDict

    for isolation in {sandbox_isolation(), "rlimits"}:
        if not site_hidden(isolation):
            config = ConfigDict({"env": {"isolation": isolation}})
            assert RepoEnv.check_sandbox(config) == "", isolation


def test_call_parsing_and_cut():
    assert parse_calls('{"name": "bash", "parameters": {"command": "ls"}}') == [
        ("bash", {"command": "ls"})
    ]  # Llama 3's JSON call
    assert parse_calls('<tool_call>{"name": "submit", "arguments": "{}"}') == [("submit", {})]
    assert parse_calls("no call here") == []
    assert parse_calls('<tool_call>{"arguments": {}}</tool_call>')[0].startswith("error")
    # Qwen3-Coder's XML calls: strings as written, other types per the tool's schema as JSON
    coder = (
        "<tool_call>\n<function=bash>\n<parameter=command>\nls -a\ncat x\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=str_replace_editor>\n"
        "<parameter=command>\nview\n</parameter>\n<parameter=path>\na.py\n</parameter>\n"
        "<parameter=view_range>\n[1, 20]\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<function=submit>\n</function>\n</tool_call>"
    )
    assert parse_calls(coder) == [
        ("bash", {"command": "ls -a\ncat x"}),
        ("str_replace_editor", {"command": "view", "path": "a.py", "view_range": [1, 20]}),
        ("submit", {}),
    ]
    bad = "<tool_call>\n<function=str_replace_editor>\n<parameter=insert_line>\nten\n</parameter>"
    assert parse_calls(bad) == [
        "error: malformed tool call (parameter 'insert_line' of str_replace_editor must be a "
        "JSON integer)"
    ]
    assert cut("x" * 10, 10) == "x" * 10
    assert cut("a" * 5 + "b" * 10 + "c" * 5, 10) == "aaaaa\n<... 10 characters elided ...>\nccccc"


@pytest.mark.repo_sandbox
def test_a_prompt_without_a_chat_template_describes_the_tools(env, tasks):
    """Plain text (no chat template, e.g. a CharTokenizer): the schemas and the exact call syntax
    are in the prompt, and its example is a call the environment parses."""
    from rl.envs.repo.tools import TOOLS

    text = TOK.decode(env.prompt(tasks[0]))
    assert text.startswith("# Tools") and all(json.dumps(t) in text for t in TOOLS)
    syntax = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    assert syntax in text and not env.tools_in_template
    assert text.endswith(f"<issue>\n{tasks[0]['problem']}\n</issue>")
    example = text.split("e.g. ")[1].split("</tool_call>")[0] + "</tool_call>"
    assert parse_calls(example) == [("bash", {"command": "ls"})]


@pytest.mark.repo_sandbox
@pytest.mark.slow  # moved out of the fast tier (pytest -m 'not slow' < 5 min cold)
def test_harness_timeout_masks_its_episode_and_the_group_still_trains(tasks):
    """Must-show 3, from the environment to the learner batch: four episodes of one task (fix,
    wrong edit, fix, fix) scored by the rollout's own scorer; the third one's workspace `setup`
    passes env.setup_timeout_s (an infrastructure failure: a slow install, a loaded machine), so
    its episode ends there. In the learner batch that episode has no loss token and advantage 0,
    and the others' advantages are those of the group of three without it."""
    from types import SimpleNamespace

    from configs.default import get_config
    from models.sharding import make_mesh
    from rl.advantages import compute_advantages
    from rl.groups import episode_group
    from rl.learner import batch_sharding
    from rl.multiturn import EpisodeSampler
    from rl.packing import build_batch
    from rl.rollout import Rollouts
    from rl.segments import count_sequences
    from sampling.requests import Completion

    t = tasks[0]
    fix = t["fix"]
    edit = lambda new: call("str_replace_editor", command="str_replace", path=fix["path"],
                            old_str=fix["old"], new_str=new)  # fmt: skip
    scripts = [[edit(fix["new"]), call("submit")], [edit(fix["old"]), call("submit")],
               [edit(fix["new"]), call("submit")], [edit(fix["new"]), call("submit")]]  # fmt: skip
    records = [t, t, {**t, "setup": "sleep 60"}, t]
    env = RepoEnv(TOK, make_config(setup_timeout_s=1.0))  # waited out by its "sleep 60"
    engine = SimpleNamespace(cfg=SimpleNamespace(vocab_size=TOK.vocab_size))
    env_cfg = SimpleNamespace(max_turns=4, max_turn_tokens=0, max_tool_seconds=120.0,
                              tool_workers=4)  # fmt: skip
    scorer = EpisodeSampler(env, engine, TOK, env_cfg)
    try:
        episodes = []
        for record, script in zip(records, scripts):
            ep = env.start(record)
            for text in script:
                act(env, ep, text)
            episodes.append(ep)
        rewards = scorer._score(episodes)  # what the rollout runs when a group has ended
    finally:
        scorer.close()
        env.shutdown()
    assert [ep.masked for ep in episodes] == [False, False, True, False]
    assert episodes[2].infra_error.startswith("setup failed"), episodes[2].infra_error
    assert list(rewards) == [1.0, 0.0, 0.0, 1.0] and all(ep.workspace is None for ep in episodes)

    lengths = [5, 3, 6, 4]  # stand-ins for the sampled episode tokens
    completions = [Completion(list(range(3, 3 + n)), [-0.5] * n, "stop", n) for n in lengths]
    group = episode_group(t, [1, 2], episodes, completions, rewards, TOK)
    config = get_config()
    config.rl.num_generations, config.sampling.max_prompt_len = 4, 2
    config.sampling.max_new_tokens = 6
    mesh = make_mesh({"data": 8})
    engine = SimpleNamespace(
        num_shards=1,
        local_shards=[0],
        init_state=lambda: None,
        preemptions=0,
        recomputed_tokens=0,
        prefill_tokens=0,
        slot_steps=[0, 0],
        records_routes=False,  # a dense model's
    )  # one batch shard: all the rollout reads of it
    rollouts = Rollouts(config, engine, TOK, None, None, batch_sharding(mesh, tuple(map(tuple, config.rules))),
                        0)  # fmt: skip
    # a multi-turn rollout's stats, with no tool call of its own
    rollouts.sampler.episodes = SimpleNamespace(close=lambda: None, counters={})
    sample = lambda step, params, state, data, drain, stop: (state, [group], {"counters": {}})
    rollouts.schedule = SimpleNamespace(
        sample=sample, idle=True, carries=False, stats=lambda *a: {}
    )
    rollout = rollouts(0, None, None)
    b = jax.device_get(rollout.batch)
    want, layout = build_batch([group], 2 + 6, 0, multiple=8)
    keep = np.array([True, True, False, True])
    np.testing.assert_array_equal(b.loss_mask, want.loss_mask * layout.spread(keep))
    assert b.loss_mask[layout.row[2]].sum() == 0 and want.loss_mask[layout.row[2]].sum() == 6
    assert int(count_sequences(b.loss_mask, b.segment_ids[:, 1:])) == 3  # the normaliser
    three, _ = compute_advantages(jnp.asarray([1.0, 0.0, 1.0]), 3, "group_std", 1e-6)
    want_adv = np.insert(np.asarray(three), 2, 0.0)
    np.testing.assert_allclose(b.advantages, layout.spread(want_adv), atol=1e-6)
    assert np.abs(want_adv[[0, 1, 3]]).min() > 0.5  # the rest of the group trains
    s = rollout.stats
    assert s["episode/infra_errors"] == 1 and s["masked_samples"] == 1
    # what a run that stops when its episodes are all masked reads (rl.summary.masked_stats)
    assert s["episode/masked"] == 1 and s["episode/count"] == 4 and s["episode/masked_frac"] == 0.25
    assert s["episode/top_infra_error"] == [" ".join(episodes[2].infra_error.split())[:300], 1]
    assert s["episode/fail_to_pass_frac"] == pytest.approx(2 / 3)
    assert s["episode/pass_to_pass_frac"] == 1.0 and s["reward/env"] == pytest.approx(2 / 3)


@pytest.mark.repo_sandbox
def test_tool_schemas_reach_the_prompt_through_the_template_tools_argument(tmp_path, tasks):
    """Qwen2.5's published template renders the schemas from its `tools` argument (its own
    "# Tools" system block); a template that ignores `tools` gets them in a system message."""
    from models.tokenizer import load_tokenizer
    from rl.envs.repo.tools import TOOLS
    from tests.models.test_chat import _write_stand_in

    _write_stand_in("qwen2", str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    config = make_config()
    config.data.use_chat_template = True
    env = RepoEnv(tok, config)
    try:
        ids = env.prompt(tasks[0])
        text = tok.decode(ids, skip_special=False)
        assert env.tools_in_template
        user = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        msgs = [{"role": "user", "content": user}]
        assert ids == tok.encode(tok.apply_chat_template(msgs, True, tools=TOOLS), special=True)
        assert "You may call one or more functions to assist" in text  # Qwen's own wording
        assert json.dumps(TOOLS[1], ensure_ascii=False) in text
        assert "# Tools" not in tok.apply_chat_template(msgs, True)  # default: no tools, as before
        # A template without tools: the schemas are described in a system message.
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
        plain = load_tokenizer(str(tmp_path))
        env.tokenizer = plain
        text = plain.decode(env.prompt(tasks[0]), skip_special=False)
        assert not env.tools_in_template
        assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOLS[1]) in text
        # An HF tokenizer without any template: plain text (data.use_chat_template False), tools
        # and call syntax in it.
        del cfg["chat_template"]
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
        env.tokenizer = load_tokenizer(str(tmp_path))
        env.config.data.use_chat_template = False
        text = env.tokenizer.decode(env.prompt(tasks[0]), skip_special=False)
        assert text.startswith("# Tools") and json.dumps(TOOLS[1]) in text
        assert "For each call, write <tool_call>" in text and "<|im_start|>" not in text
    finally:
        env.shutdown()


# ----- through the engine's episode loop (on one of the 8 fake devices: the mesh is not under
# test here, and one device costs about half the CPU of data=8) -----


@pytest.mark.repo_sandbox
@pytest.mark.slow
def test_scripted_policy_through_the_engine_loop(tasks, tmp_path):
    from models.sharding import on_devices

    with on_devices(jax.devices()[:1]):
        _scripted_policy_through_the_engine_loop(tasks, tmp_path)


def _scripted_policy_through_the_engine_loop(tasks, tmp_path):
    from launch.build import build
    from launch.cli import parse_args

    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    # tests.conftest.sandbox_isolation: rlimits without bwrap
    config = parse_args(scripted.args(str(path), sandbox_isolation()), {})[0]
    run = build(config)
    rollout = scripted.rollout(run, config, batch_size=10)[0]
    ids = {grp.record["instance_id"] for grp in rollout.groups}
    assert len(rollout.groups) == 10
    assert sum(grp.rewards[0] for grp in rollout.groups) == 10  # the fix, on every task seen
    s = rollout.stats
    assert s["episode/tool_errors"] == 0.5 and s["episode/env_errors"] == 0
    assert any("error: malformed tool call" in t for t in run.env.seen)
    print(f"{len(ids)} distinct tasks; reward/env {s['reward/env']}")
