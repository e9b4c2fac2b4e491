"""Repository-level coding episodes (SWE-Gym / R2E-Gym style): the model reads a repository, edits
it with tools and submits; the reward is whether the repository's own tests then pass.

A record (jsonl row, e.g. from `python -m launch.make_repo_tasks`):
    repo          a local directory or .tar.gz snapshot of the repository
    problem       the issue text
    fail_to_pass  pytest node ids that must pass after the fix
    pass_to_pass  pytest node ids that must keep passing
    setup         optional: a shell command run once in each fresh workspace (e.g. pip install)
A record that sets `test_cmd` is refused (`check_record`, at load time in launch.train): grading
runs the node ids with pytest, and a command that would replace it is not run.

Each episode gets its own writable copy of the repository as its sandbox workspace
(`rl.envs.repo.sandbox`: at /testbed in bubblewrap mode, a tmpfs of `env.workspace_bytes` when we
may mount), made on its first tool call and deleted when it is scored. Tools, in the chat
template's tool-call format (Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
Qwen3-Coder's `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`,
or a bare JSON object `{"name": ..., "parameters": {...}}` as Llama 3 writes it), several per turn:
    bash {command}               in the workspace, `env.command_timeout_s` each; output longer than
                                 `env.max_observation_chars` is cut to its head and tail
    str_replace_editor {command: view|create|str_replace|insert|undo_edit, path, file_text,
                        old_str, new_str, insert_line, view_range}   OpenHands' semantics
    submit {}                    ends the episode
A malformed call, or a turn without any, gets an error observation and counts in
`episode.tool_errors`. Schemas (`TOOLS`, OpenAI function format) go to the chat template's `tools`
argument, so the prompt is the one the model was tuned on (Qwen's "# Tools ... <tools>" system
block); a template that ignores `tools` (its rendering does not change) or a tokenizer that takes
none gets them described in a system message in Qwen's wording instead, and a prompt without a
chat template (`data.use_chat_template` False) in its plain text (`TOOLS_TEXT`: the schemas and
the call syntax). The schemas, the instructions and the parsing of calls are
`rl/envs/repo/tools.py`.

Reward, after submit or when a limit ends the episode (`rl/envs/repo/grading.py`): the original
test files, every file of their test directories (`tests/`: `__init__.py`, helpers, data; as the
record's `setup` left them), and the conftest.py files and pytest configuration files (HARNESS)
are put back, any other file there or of those names deleted, and FAIL_TO_PASS + PASS_TO_PASS
run in a fresh sandbox process on the final workspace; 1.0 if all pass, else 0.0.
`episode.metrics` holds both pass fractions. Code of the model's that changes the test harness in
that process (unittest's asserts, pytest's report machinery, builtins, a plugin it registers:
`rl/envs/repo/integrity.py`) scores 0, `episode.tamper` naming what changed (counted in
`episode/tamper`). A test that hangs fails on its own alarm (`env.per_test_timeout_s`, the
model's fault), and so does code that hangs at import (importing the root conftest.py and
collecting have the same alarm; a module that fails to import, also
through a conftest.py, scores 0 too, as does a run killed in any phase past its alarm; see
docs/repo_env.md for pytest's exit statuses); the whole run passing `env.test_timeout_s` in a
phase younger than that, a sandbox that does not start (or cannot import pytest), a workspace
that cannot be made or a `setup` that fails are infrastructure errors: `episode.infra_error` says
which, `masked(episode)` is True and the reward is 0.0 only because the caller needs a number:
the rollout leaves such an episode out of the loss and out of its group's advantage statistics,
and counts it in `episode/infra_errors`.

Limits per episode (config `env`, read with defaults): `max_tool_calls` (40), `command_timeout_s`
(30), `max_tool_seconds` (all tool time; also checked by rl.multiturn), `workspace_bytes`
(256 MiB), `test_timeout_s` (300), `per_test_timeout_s` (30), `setup_timeout_s` (300),
`sandbox_memory_bytes` (4 GiB address space per process), `sandbox_processes` (64); tokens:
`sampling.max_new_tokens` and `env.max_turn_tokens`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import posixpath
import time

from models.chat import message_delta_ids
from models.tokenizer import Trusted
from rl.environment import Environment, Episode, Turn, register_env
from rl.envs.repo import images as repo_images
from rl.envs.repo import sandbox as rs
from rl.envs.repo.grading import ERRORS, HARNESS, after_setup, pristine, score, tested_files
from rl.envs.repo.tools import (
    CALL_CLOSE,
    INSTRUCTIONS,
    NO_CALL,
    TOOLS,
    TOOLS_TEXT,
    cut,
    parse_calls,
)
from rl.sandbox import Limits, isolation_of


@dataclasses.dataclass
class RepoEpisode(Episode):
    infra_error: str = ""  # why the infrastructure failed ("" = it did not): the episode is masked
    submitted: bool = False
    over_disk: bool = False  # the workspace passed env.workspace_bytes (measured mode)
    mounted: bool = False  # the workspace is its own tmpfs
    history: dict = dataclasses.field(default_factory=dict)  # path -> [(real path, old text)]
    metrics: dict = dataclasses.field(default_factory=dict)  # fail_to_pass_frac, ...
    results: dict = dataclasses.field(default_factory=dict)  # node id -> passed, once graded
    missing: list = dataclasses.field(default_factory=list)  # node ids the tests do not define
    grade_timeout: str = ""  # the graded run was killed in the model's code: collect | test
    restored: list = dataclasses.field(default_factory=list)  # test files grading put back
    restore: dict | None = None  # what grading puts back, read after `setup` (None: no setup)
    view: object = None  # an image task's view (rl.envs.repo.images.View; its mode: view.mode)


def check_record(record: dict, env=None) -> dict:
    """`record`, or a ValueError naming the field when it sets `test_cmd` (not supported). With
    `env` (config.env, at load time in launch.train): an image record under
    env.isolation=rlimits, whose image is not under env.images_dir, or whose image's python or
    pytest cannot grade (probed once per image: repo_images.check_grading), is refused too,
    before the run starts rather than at its first episode."""
    return check_records([record], env)[0]


def check_records(records: list[dict], env=None) -> list[dict]:
    """check_record of every record, the images probed at once (`env.tool_workers` of them in
    parallel, each image once per process: a data set of a few thousand images takes minutes,
    not hours); the first record (in order) that fails raises."""
    images = []
    for record in records:
        if record.get("test_cmd"):
            raise ValueError(
                f"repo record {record.get('instance_id', '')!r}: test_cmd={record['test_cmd']!r} "
                "is not supported (grading runs fail_to_pass/pass_to_pass with pytest); drop the "
                "field"
            )
        if env is not None and record.get("image"):
            mode = "rlimits" if isolation_of(env) == "rlimits" else "bwrap"  # auto: checked before
            image = repo_images.check(record, mode, env.get("images_dir") or "")
            images.append((record, (image.rootfs, image.python, isolation_of(env)), image))
    todo = {key: image for _, key, image in images if key not in _graded}
    if todo:  # the images' pythons and pytests, probed once per image
        workers = max(1, min(len(todo), int(env.get("tool_workers", 8))))
        lim = Limits(wall_s=120.0, cpu_s=60)  # a cold start is slow, not a failure
        sb = rs.RepoSandbox(workers, lim, rs.site_packages(), isolation_of(env))
        try:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                for key, why in zip(todo, pool.map(lambda im: _grades(im, sb), todo.values())):
                    _graded[key] = why
        finally:
            sb.close()
    for record, key, _ in images:
        if _graded[key]:
            raise ValueError(f"repo record {record.get('instance_id', '')!r}: {_graded[key]}")
    return records


def _grades(image: repo_images.Image, sb) -> str:
    """ "" when `image` can grade, else why not (one line)."""
    try:
        repo_images.check_grading(image, sb)
        return ""
    except RuntimeError as err:
        return f"{err}: it cannot grade (every episode would be masked)"


_graded: dict[tuple, str] = {}  # (rootfs, python, isolation) -> why the image cannot grade


@register_env("repo")
class RepoEnv(Environment):
    runs_code = True

    @classmethod
    def check_sandbox(cls, config) -> str:
        """Why this host cannot run the environment's sandboxes (config.env.isolation, pytest
        importable inside), in one line; "" when it can. Its probes are remembered: the env's
        own sandboxes reuse them."""
        try:
            rs.RepoSandbox(1, Limits(), rs.site_packages(), isolation_of(config.env)).close()
        except RuntimeError as err:
            return str(err)
        return ""

    def __init__(self, tokenizer, config):
        super().__init__(tokenizer, config)
        e = config.env
        self.max_chars = e.get("max_observation_chars", 10000)
        self.command_timeout = float(e.get("command_timeout_s", 30.0))
        self.max_calls = e.get("max_tool_calls", 40)
        self.max_seconds = float(e.get("max_tool_seconds", 600.0))
        self.disk = int(e.get("workspace_bytes", 256 << 20))
        self.test_timeout = float(e.get("test_timeout_s", 300.0))
        self.per_test = int(e.get("per_test_timeout_s", 30))
        self.setup_timeout = float(e.get("setup_timeout_s", 300.0))
        workers, site = e.get("tool_workers", 8), rs.site_packages()
        lim = dict(
            memory_bytes=int(e.get("sandbox_memory_bytes", 4 << 30)),
            file_bytes=self.disk,
            output_bytes=8 << 20,
            processes=int(e.get("sandbox_processes", 64)),
        )
        slowest = max(self.command_timeout, self.setup_timeout) + 10
        iso = isolation_of(e)  # auto (bubblewrap or refuse) | bwrap | rlimits (rl.sandbox)
        tool_limits = Limits(wall_s=slowest, cpu_s=int(slowest), **lim)
        test_limits = Limits(wall_s=self.test_timeout, cpu_s=int(self.test_timeout), **lim)
        self.tools = rs.RepoSandbox(workers, tool_limits, site, iso)
        self.grader = rs.RepoSandbox(workers, test_limits, site, iso)
        # Its bin/ (pip...) on the PATH too.
        self.python_bin = os.path.dirname(self.tools.interpreter)
        self._mounted: set[str] = set()  # tmpfs workspaces not yet unmounted
        self.images_dir = e.get("images_dir") or ""  # where a record's image name is unpacked
        self.image_view = ""  # the view mode of image tasks, once one ran (repo_images.MODES)
        self.tools_in_template = None  # whether the chat template took `tools` (set by prompt)

    # ----- prompt and episode lifecycle -----

    def prompt(self, record: dict, prompt_field: str = "problem") -> list[int]:
        d = self.config.data
        problem = check_record(record)["problem"] if "problem" in record else record[prompt_field]
        root = record.get("workdir") or rs.WORKDIR if record.get("image") else None
        user = INSTRUCTIONS.format(root=root or self.tools.shown_root(), problem=problem)
        if not d.use_chat_template:  # plain text: the tools and the call syntax described
            self.tools_in_template = False
            head = (d.system_prompt + "\n\n" if d.system_prompt else "") + TOOLS_TEXT + "\n\n"
            return self.tokenizer.encode_rendered(
                head + self.tokenizer.escape(user), add_bos=self.tokenizer.add_bos_token
            )
        own = Trusted(d.system_prompt or "")  # the config's text: special-token strings stay
        system = [{"role": "system", "content": own}] if own else []
        msgs, kw = system + [{"role": "user", "content": user}], self._template_kwargs()
        try:
            text = self.tokenizer.apply_chat_template(msgs, True, tools=TOOLS, **kw)
            self.tools_in_template = text != self.tokenizer.apply_chat_template(msgs, True, **kw)
        except TypeError:  # a tokenizer without a `tools` argument
            self.tools_in_template = False
        if not self.tools_in_template:  # describe them in the system message
            sys_text = (d.system_prompt + "\n\n" if d.system_prompt else "") + TOOLS_TEXT
            msgs = [
                {"role": "system", "content": Trusted(sys_text)},
                {"role": "user", "content": user},
            ]
        # The problem is data: its special-token strings stay text (models/tokenizer.py).
        return self.tokenizer.encode_chat(
            msgs, True, **kw, **({"tools": TOOLS} if self.tools_in_template else {})
        )

    def stop_ids(self) -> tuple[int, ...]:
        try:
            ids = self.tokenizer.encode(CALL_CLOSE, special=True)  # the added token, if any
        except ValueError:  # a character-level alphabet without "<"
            return ()
        return tuple(ids) if len(ids) == 1 else ()

    def start(self, record: dict) -> RepoEpisode:
        if check_record(record).get("image"):  # refused under rlimits; the image must be there
            repo_images.check(record, self.tools.mode, self.images_dir)
        return RepoEpisode(record)  # the workspace is made on the first tool call (a worker)

    def masked(self, episode: Episode) -> bool:
        """Whether the episode belongs out of the loss (an infrastructure error)."""
        return bool(getattr(episode, "infra_error", ""))

    def _ready(self, ep: RepoEpisode) -> bool:
        """Makes the episode's workspace (copy, setup) once; False on an infrastructure error."""
        if ep.workspace is not None or ep.infra_error:
            return not ep.infra_error
        try:
            ep.workspace = ws = self.tools.workspace()
            ep.mounted = rs.mount_tmpfs(ws, self.disk)
            if ep.mounted:
                self._mounted.add(ws.path)
            if ep.record.get("image"):  # the image's view, its python's site (repo_images)
                image = repo_images.check(ep.record, self.tools.mode, self.images_dir)
                mode = repo_images.view_mode(self.tools.bwrap, self.tools.as_root, ws.path)
                ep.view = ws.view = repo_images.View(image, ws, mode)
                self.image_view = mode
                ep.view.probe(self.tools)
            else:
                rs.copy_repo(ep.record["repo"], ws)
        except Exception as err:  # noqa: BLE001 - no workspace: not the model's fault
            ep.infra_error = f"workspace: {type(err).__name__}: {err}"
            return False
        if ep.record.get("setup"):
            r = {
                **self._shell(ep, ep.record["setup"], self.setup_timeout),
                "timeout": self.setup_timeout,
            }
            if r.get("rc") != 0:
                ep.infra_error = f"setup failed: {self._bash_text(r)[-500:]}"
                return False
            try:  # the test directories as setup left them are the task's (see after_setup)
                tests = tuple(tested_files(ep.record))
                ep.restore = after_setup(self._host_root(ep), self._pristine(ep), tests)
            except ERRORS as err:
                ep.infra_error = f"test files after setup: {err}"
                return False
        return True

    def _pristine(self, ep: RepoEpisode) -> str:
        """The pristine repository on the host: the checkout, or the image's own workdir."""
        if ep.view is not None:
            return ep.view.image.host(ep.view.workdir)
        return ep.record["repo"]

    def _host_root(self, ep: RepoEpisode) -> str:
        return ep.view.host_workdir if ep.view is not None else ep.workspace.path

    def close(self, episode: Episode) -> None:
        ws, episode.workspace = episode.workspace, None
        if getattr(episode, "view", None) is not None:
            episode.view.close()  # the overlay, before the workspace's tmpfs under it
        if getattr(episode, "restore", None) is not None:
            episode.restore = None  # the test directories' bytes: not kept with the episode
        if ws is not None:
            if getattr(episode, "mounted", False):
                rs.unmount(ws.path)
                self._mounted.discard(ws.path)
            ws.close()

    def shutdown(self) -> None:
        """Unmounts the workspaces of episodes never closed and closes both sandboxes."""
        for path in list(self._mounted):
            rs.unmount(path)
        self._mounted.clear()
        self.tools.close()
        self.grader.close()

    # ----- tools -----

    def _shell(self, ep: RepoEpisode, command: str, timeout: float) -> dict:
        keep = max(1, self.max_chars // 2)
        args = {"command": command, "timeout": timeout, "keep": keep}
        r = self.tools.program(rs.BASH, ep.workspace, args, extra_path=self.python_bin)
        if not r["_started"]:
            ep.infra_error = f"sandbox did not start: {r['_run'].reason}: {r['_run'].stderr[-300:]}"
        return r

    def _bash_text(self, r: dict) -> str:
        if "rc" not in r:
            run = r["_run"]
            return f"[the shell tool was killed ({run.reason}, exit status {run.returncode})]"
        out = r["head"]
        if r["total"] > r["shown"]:
            out += f"\n<... {r['total'] - r['shown']} bytes elided ...>\n"
        out += r["tail"]
        out += "" if not out or out.endswith("\n") else "\n"
        if r["rc"] is None:
            return out + f"[the command timed out after {r['timeout']:g} s and was killed]"
        return out + f"[exit code {r['rc']}]"

    def _bash(self, ep: RepoEpisode, args: dict, seconds_left: float) -> str:
        command = args.get("command")
        if not isinstance(command, str) or not command.strip():
            ep.tool_errors += 1
            return "error: bash needs a non-empty string `command`"
        timeout = max(0.1, min(self.command_timeout, seconds_left))
        r = self._shell(ep, command, timeout)
        r["timeout"] = timeout
        ep.tool_errors += "rc" not in r or r["rc"] is None
        return cut(self._bash_text(r), self.max_chars + 200)

    def _edit(self, ep: RepoEpisode, args: dict) -> str:
        path = args.get("path")
        root = self.tools.root(ep.workspace)
        key = posixpath.normpath(posixpath.join(root, path)) if isinstance(path, str) else None
        if args.get("command") == "undo_edit":
            stack = ep.history.get(key) or []
            args = {**args, "restore": stack[-1] if stack else None}
        r = self.tools.program(rs.EDITOR, ep.workspace, args)
        if not r["_started"]:
            ep.infra_error = f"sandbox did not start: {r['_run'].reason}"
            return ""
        if "ok" not in r:
            ep.tool_errors += 1
            return f"error: the editor failed ({r['_run'].reason}: {r['_run'].stderr[-300:]})"
        if not r["ok"]:
            ep.tool_errors += 1
        elif args.get("command") == "undo_edit":
            ep.history[key].pop()
        elif r.get("undo"):
            ep.history.setdefault(key, []).append(r["undo"])
        return cut(r["output"], self.max_chars)

    def step(self, episode: Episode, turn: Turn) -> list[int] | None:
        ep, t0 = episode, time.perf_counter()
        if not self._ready(ep):
            return None
        calls = parse_calls(turn.text)
        if not calls:
            ep.tool_errors += 1
            return self._observe([NO_CALL], turn, role="user")
        outputs = []
        for call in calls:
            if ep.tool_calls >= self.max_calls:
                return None  # a limit: scored as it stands
            ep.tool_calls += 1
            if isinstance(call, str):
                ep.tool_errors += 1
                outputs.append(call)
                continue
            name, args = call
            left = self.max_seconds - ep.tool_seconds - (time.perf_counter() - t0)
            if name == "submit":
                ep.submitted = True
                return None
            if left <= 0:
                return None
            if name == "bash":
                outputs.append(self._bash(ep, args, left))
            elif name == "str_replace_editor":
                outputs.append(self._edit(ep, args))
            else:
                ep.tool_errors += 1
                outputs.append(
                    f"error: unknown tool {name!r}; the tools are bash, "
                    "str_replace_editor and submit"
                )
            if ep.infra_error:
                return None
            if not ep.mounted and rs.disk_usage(ep.workspace.path) > self.disk:
                ep.over_disk = True
                return None  # measured mode: a workspace over its limit ends the episode
        ep.observations.extend(outputs)
        return self._observe(outputs, turn)

    def _observe(self, texts: list[str], turn: Turn, role: str = "tool") -> list[int]:
        if not self.config.data.use_chat_template:
            return self.tokenizer.encode("\n".join(texts))
        closed = bool(turn.ids) and self._end is not None and turn.ids[-1] == self._end
        msgs = [{"role": role, "content": t} for t in texts]
        return message_delta_ids(
            self.tokenizer, msgs, turn_closed=closed, **self._template_kwargs()
        )

    # ----- reward -----

    def reward(self, episode: Episode) -> float:
        ep, rec = episode, episode.record
        if not self._ready(ep):
            return 0.0  # masked: see masked()
        try:
            restore = ep.restore or pristine(self._pristine(ep), tuple(tested_files(rec)))
        except ERRORS as err:
            ep.infra_error = f"test files: {err}"
            return 0.0
        nodes = list(rec["fail_to_pass"]) + list(rec["pass_to_pass"])
        args = {"nodes": nodes, "per_test": self.per_test, "harness": HARNESS, **restore}
        site = ep.view.site if ep.view is not None else self.grader.site  # the image's own
        sites = {"sites": ep.view.sites} if ep.view is not None else {}  # its .pth files too
        r = self.grader.program(rs.GRADE, ep.workspace, {**args, "site": site, **sites})
        return score(ep, r, self.per_test, time.monotonic())
