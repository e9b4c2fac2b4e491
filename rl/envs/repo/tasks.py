"""SWE-Gym / SWE-smith / R2E-Gym style rows -> records of the `repo` environment (rl/envs/repo/env.py).

SWE-bench's row shape, which SWE-Gym and SWE-smith share: `instance_id`, `repo` (owner/name on
GitHub), `problem_statement`, and `FAIL_TO_PASS` / `PASS_TO_PASS` as lists of test ids or as JSON
strings of lists (SWE-Gym and SWE-bench store strings). R2E-Gym's own rows (`repo_name`,
`commit_hash`, `docker_image`, `expected_output_json`) are not in it: read, they are refused in
one line (no `instance_id` column); rows converted to this shape convert. They expect a Docker image per task; here the
repository must be checked out locally instead, at the task's commit, with its test patch
applied (the tests that define FAIL_TO_PASS must be in the checkout: grading reads them from
there) and the gold patch not applied. The checkout is found as, in order: the row's `repo_path`,
`<repos_dir>/<instance_id>`, `<repos_dir>/<instance_id>.tar.gz`, or `repo` when it is a local
path.

    record = from_swe_row(row, repos_dir)   # {"instance_id", "repo", "problem", "fail_to_pass",
                                            #  "pass_to_pass", "setup", "patch" if the row has one}
    record = from_swe_row(row, images_dir=D, image_template="sweb.eval.x86_64.{instance_id}")
                                            # {"instance_id", "image", ...}: runs in the image

Image rows (rl/envs/repo/images.py): a row that names its image in a column (`image_name`, as
SWE-smith's rows and mini-swe-agent read it; `docker_image`; `image`) uses it, else
`image_template` maps the row to a name: its fields `{instance_id}`, `{repo}` and
`{docker_id}` (the instance id with `__` replaced by `_1776_`, as SWE-bench's own image names
write it), the result lowercased (Docker names are). mini-swe-agent's SWE-bench / SWE-Gym
template is `swebench/sweb.eval.x86_64.{docker_id}:latest`. The image must be unpacked under
`images_dir` (`python -m launch.images unpack`); its `/testbed` (or the row's `workdir`) must hold
the named test files. A row's `workdir` and `python` pass through. A row with no checkout and
no image is refused.

A row is refused (ValueError naming the instance) when no checkout is found, when a test id is not
a pytest node id (SWE-bench's Django and SymPy rows name tests their own way), or when a test file
it names is missing from a checkout directory (the test patch is not applied). `setup` (a shell
command run once per workspace, e.g. `pip install -e . --no-deps`; the sandbox has no network)
passes through when the row has it, and so does `patch` (SWE-bench's gold patch, a unified diff):
the reference fix that `python -m launch.make_repo_tasks --validate` applies
(rl/envs/repo/reference.py); the environment never shows it to the model. A row's `test_cmd` is not
carried over: the environment grades FAIL_TO_PASS / PASS_TO_PASS with pytest and refuses a record
that sets `test_cmd` (rl.envs.repo.check_record).

Where the rows come from (`read_rows`): a jsonl file, read line by line as today; anything else
is an "hf" data source of rl/sources.py, resolved by its code: a Hub dataset id
(`SWE-Gym/SWE-Gym`, with subset `name`, `split` and `revision`; fetched into the Hub cache,
HF_HUB_OFFLINE=1 reading the cache alone), a `save_to_disk` directory, a directory of data
files, or a parquet / json / csv file or glob. A local directory whose path reads like an id
(`./SWE-Gym/SWE-Gym` under the working directory) is read, not the Hub id: rl/sources.py's rule.
A bad id, revision, subset or split, or a dataset without an `instance_id` column, is one line
naming the flag (`HubError` / `RowsError`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence


def _ids(row: dict, key: str, required: bool = False) -> list[str]:
    value = row.get(key, row.get(key.lower()))
    if value is None:  # (a column a dataset's other rows have is None in this one)
        if required:
            raise ValueError(f"{row['instance_id']}: no {key}")
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{row['instance_id']}: {key} is not a JSON list ({e})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{row['instance_id']}: {key} must be a list of test ids")
    return value


def _checkout(row: dict, repos_dir: str | None) -> str:
    iid = row["instance_id"]
    candidates = [row.get("repo_path")]
    if repos_dir:
        candidates += [os.path.join(repos_dir, iid), os.path.join(repos_dir, iid + ".tar.gz")]
    candidates.append(row.get("repo"))
    for path in candidates:
        if path and os.path.exists(os.path.expanduser(path)):
            return os.path.abspath(os.path.expanduser(path))
    raise ValueError(
        f"{iid}: no local checkout (looked for repo_path, {repos_dir}/{iid}[.tar.gz]"
        f" and repo={row.get('repo')!r})"
    )


def image_name(row: dict, template: str | None = None) -> str:
    """The row's image name: its column, else `template` formatted (module docstring); "" if
    neither."""
    for key in ("image_name", "docker_image", "image"):
        if isinstance(row.get(key), str) and row[key]:
            return row[key]
    if not template:
        return ""
    iid = row["instance_id"]
    fields = {
        "instance_id": iid,
        "repo": row.get("repo", ""),
        "docker_id": iid.replace("__", "_1776_"),
    }
    return template.format(**fields).lower()


def _image_record(row, iid, f2p, p2p, name, images_dir) -> dict:
    from rl.envs.repo.images import in_root, resolve

    try:
        rootfs, _ = resolve(name, images_dir)
    except ValueError as err:
        raise ValueError(f"{iid}: no local image: {err}") from None
    workdir = row.get("workdir") or "/testbed"
    tree = in_root(rootfs, workdir)
    missing = sorted(
        {
            n.split("::")[0]
            for n in f2p + p2p
            if not tree or not os.path.isfile(os.path.join(tree, n.split("::")[0]))
        }
    )
    if missing:
        raise ValueError(f"{iid}: test files {missing[:3]} not in image {name}:{workdir}")
    extra = {k: row[k] for k in ("workdir", "python") if row.get(k)}
    return {"image": name, **extra}


def from_swe_row(
    row: dict,
    repos_dir: str | None = None,
    images_dir: str | None = None,
    image_template: str | None = None,
) -> dict:
    """The `repo` environment's record of one SWE-style row (module docstring)."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    iid = row.get("instance_id")
    if not isinstance(iid, str) or not iid:
        raise ValueError(f"no instance_id (got {iid!r})")
    f2p, p2p = _ids(row, "FAIL_TO_PASS", required=True), _ids(row, "PASS_TO_PASS")
    if not f2p:
        raise ValueError(f"{iid}: FAIL_TO_PASS is empty")
    for node in f2p + p2p:
        if "::" not in node or not node.split("::")[0].endswith(".py"):
            raise ValueError(f"{iid}: {node!r} is not a pytest node id (path.py::name)")
    name = image_name(row, image_template) if images_dir or image_template else ""
    where = _image_record(row, iid, f2p, p2p, name, images_dir) if name else None
    repo = _checkout(row, repos_dir) if where is None else ""
    if repo and os.path.isdir(repo):
        missing = sorted(
            {
                n.split("::")[0]
                for n in f2p + p2p
                if not os.path.isfile(os.path.join(repo, n.split("::")[0]))
            }
        )
        if missing:
            raise ValueError(f"{iid}: test files {missing[:3]} not in {repo} (test patch applied?)")
    problem = row.get("problem_statement", row.get("problem"))
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{iid}: no problem_statement")
    where = where or {"repo": repo}
    patch = row.get("patch")  # the gold patch: the reference fix --validate applies
    return {
        "instance_id": iid,
        **where,
        "problem": problem,
        "fail_to_pass": f2p,
        "pass_to_pass": p2p,
        "setup": row.get("setup") or "",
        **({"patch": patch} if isinstance(patch, str) and patch.strip() else {}),
    }


def convert_rows(
    rows,
    repos_dir: str | None = None,
    images_dir: str | None = None,
    image_template: str | None = None,
) -> tuple[list[dict], list[str]]:
    """(records, reasons): the rows that convert, and why each of the others did not (a row
    without an instance id named by its number, from 1)."""
    records, skipped = [], []
    for n, row in enumerate(rows, 1):
        try:
            records.append(from_swe_row(row, repos_dir, images_dir, image_template))
        except (ValueError, KeyError) as err:
            iid = row.get("instance_id") if isinstance(row, dict) else None
            reason = str(err) if isinstance(err, ValueError) else f"no {err}"
            skipped.append(reason if isinstance(iid, str) and iid else f"row {n}: {reason}")
    return records, skipped


class RowsError(ValueError):
    """Rows that cannot be read at all: one line naming the flag (`read_rows`' `flags`)."""


FLAGS = {"path": "--from_rows", "name": "--name", "split": "--split", "revision": "--revision"}


def read_rows(
    path: str,
    *,
    name: str | None = None,
    split: str = "train",
    revision: str = "",
    flags: dict | None = None,
) -> tuple[Sequence[dict], str]:
    """(rows, commit) of SWE-style rows at `path` (module docstring): a jsonl file's lines as
    dicts (a `.jsonl` path that does not exist is no such file, never a Hub id), or an "hf" source's rows read by rl/sources.py (`HFRecords`, random access, no copy),
    and the Hub commit they were read at ("" for local files). Raises RowsError (one line naming
    `flags`' flag of the bad path, subset, split or revision)."""
    from models.hub import HubError, shadowing
    from rl.sources import SourceError, hub_dataset_dir, load_records, read_jsonl

    flag = {**FLAGS, **(flags or {})}
    path = os.fspath(path)
    if path.endswith(".jsonl") and not os.path.exists(os.path.expanduser(path)):
        if not any(c in path for c in "*?["):  # (a glob of files is an "hf" source's)
            raise RowsError(f"{flag['path']}={path!r}: no such file")
    if path.endswith(".jsonl") and os.path.isfile(os.path.expanduser(path)):
        if name or revision or split != "train":
            raise RowsError(
                f"{flag['path']}={path!r}: a jsonl file has no subset, split or "
                f"revision ({flag['name']}, {flag['split']}, {flag['revision']})"
            )
        try:
            return [row for _, row in read_jsonl(os.path.expanduser(path))], ""
        except ValueError as e:  # path:line: not valid JSON / not UTF-8
            raise RowsError(f"{flag['path']}: {e}") from None
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise RowsError(
            f"{flag['path']}={path!r}: reading rows other than jsonl needs the "
            "datasets library: pip install -e '.[hub]'"
        ) from None
    try:  # the Hub id resolved once, by rl/sources.py's code, its errors naming our flags
        directory = hub_dataset_dir(
            path, revision, name, field=flag["path"], revision_field=flag["revision"]
        )
    except HubError as e:
        raise RowsError(str(e)) from None
    except SourceError as e:  # a subset the card does not hold (before any data file)
        raise RowsError(f"{flag.get(e.field, e.field)}{str(e)[len(e.field) :]}") from None
    hub = directory != os.path.expanduser(path)  # (local paths come back as they are)
    commit = os.path.basename(os.path.normpath(directory)) if hub else ""  # snapshots/<commit>
    source = {
        "type": "hf",
        "path": path,
        "name": name or "",
        "split": split,
        "revision": revision,
        "hf_commit": commit,
        "prompt_field": "instance_id",
    }
    local = "" if hub else shadowing(path)  # an "org/name" that is a local directory here
    try:
        rows = load_records(source)
    except SourceError as e:
        if e.field == "prompt_field":  # the column the rows are checked for
            what = str(e).split(": ", 1)[1].replace("no such column", "no 'instance_id' column")
            raise RowsError(f"{flag['path']}={path!r}: {what}{local}") from None
        raise RowsError(f"{flag.get(e.field, e.field)}{str(e)[len(e.field) :]}{local}") from None
    except (ValueError, OSError) as e:  # no such file, an empty dataset, an unreadable one
        what = " ".join(str(e).split())[:300]
        raise RowsError(f"{flag['path']}={path!r}: {what}{local}") from None
    columns = rows.dataset.column_names
    if not {"FAIL_TO_PASS", "fail_to_pass"} & set(columns):
        raise RowsError(
            f"{flag['path']}={path!r}: no FAIL_TO_PASS column (columns: {sorted(columns)}){local}"
        )
    return rows, commit
