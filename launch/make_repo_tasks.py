r"""Generates small Python repositories with a planted bug, for the `repo` environment: one jsonl row each.

    python -m launch.make_repo_tasks --out DIR [--num 64 --seed 0 --tar]
    python -m launch.make_repo_tasks --out DIR --from_rows swe_gym.jsonl --repos CHECKOUTS
    python -m launch.make_repo_tasks --out DIR --from_rows swe_gym.jsonl --images_dir IMAGES \
        --image_template 'swebench/sweb.eval.x86_64.{docker_id}:latest'   # image tasks
    python -m launch.make_repo_tasks --validate DIR [--isolation auto --workers 4 --images_dir D]
    python -m launch.make_repo_tasks --reference_episode DIR [--index 0]

The second form converts SWE-Gym / SWE-smith / R2E-Gym rows whose repositories are checked out
locally (CHECKOUTS/<instance_id>) into DIR/tasks.jsonl (`rl.envs.repo.tasks`), each with the
row's gold `patch` when it has one; no row converting is an error (one line, nothing written). The rows are a
jsonl file or a `datasets` dataset: a Hub dataset id read as rl/sources.py reads an "hf" source
(`--from_rows SWE-Gym/SWE-Gym --split train [--name SUBSET --revision COMMIT]`; HF_HUB_OFFLINE=1
reads the Hub cache), a save_to_disk directory, a directory of data files or a parquet file. A
bad id, subset, split or revision stops with one line naming the flag.

The first form writes generated tasks (rl/envs/repo/templates.py: a package of two modules and
their tests with a planted bug, the reference fix in the row) under DIR/repos and DIR/tasks.jsonl.

`--validate DIR` checks DIR/tasks.jsonl (or a jsonl file) as SWE-bench validates gold patches, in
the repo environment's own sandbox or image (`rl.envs.repo.reference`): per record, the tests of
the repository as it is, and after its reference fix (`patch` or `fix`) applied with the tools;
FAIL_TO_PASS must go from failing to passing, PASS_TO_PASS pass both times. The records that
validate go to valid.jsonl beside the tasks (train on that file); each other one is printed with
why (`refused <id>: <reason>`); none validating is an error. `--reference_episode DIR --index N`
runs one episode of record N with its fix applied through the tools, then submit, and prints the
reward (exit status 0 iff it is 1.0): a smoke test of the sandbox and grading without a model.
"""

from __future__ import annotations

import json
import os
import sys

from launch.cli import ArgumentParser
from rl.envs.repo.templates import KINDS, make_tasks


def _records(path: str, flag: str) -> tuple[str, list[dict]]:
    """(the jsonl file, its records) of `flag`'s DIR (DIR/tasks.jsonl) or jsonl file; raises
    ValueError (one line naming the flag)."""
    from rl.sources import read_jsonl

    file = path if os.path.isfile(path) else os.path.join(path, "tasks.jsonl")
    if not os.path.isfile(file):
        raise ValueError(f"{flag}={path!r}: no such file or directory with a tasks.jsonl")
    try:
        records = [r for _, r in read_jsonl(file)]
    except ValueError as e:  # path:line: not valid JSON / not UTF-8
        raise ValueError(f"{flag}: {e}") from None
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if not records or bad is not None:
        raise ValueError(
            f"{flag}={path!r}: {file} has no records"
            if not records
            else f"{flag}: {file}: record {bad} is not a JSON object"
        )
    return file, records


def _name(record: dict, index: int) -> str:
    return str(record.get("instance_id") or f"record {index}")


def validate_main(a) -> int:
    """--validate: each record's reference fix checked (rl/envs/repo/reference.py); the records
    that validate written to valid.jsonl beside the tasks, every other one named with why."""
    from concurrent.futures import ThreadPoolExecutor

    from launch.cli import fail
    from rl.envs.repo import check_record
    from rl.envs.repo.reference import make_env, validate

    try:
        file, records = _records(a.validate, "--validate")
        env = make_env(a.isolation, a.images_dir or "", a.workers)
    except (ValueError, RuntimeError) as e:  # (RuntimeError: a sandbox that cannot run here)
        return fail(str(e))

    def check(i: int) -> str:
        try:
            return validate(env, check_record(records[i]))
        except (ValueError, KeyError, OSError) as e:  # a record the environment refuses
            return f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)

    kept = []
    try:
        with ThreadPoolExecutor(max(1, a.workers)) as pool:
            for i, why in enumerate(pool.map(check, range(len(records)))):
                print(
                    f"refused {_name(records[i], i)}: {why}"
                    if why
                    else f"valid {_name(records[i], i)}",
                    flush=True,
                )
                kept += [records[i]] if not why else []
    finally:
        env.shutdown()
    if not kept:
        return fail(
            f"--validate={a.validate!r}: none of the {len(records)} records in {file} "
            "validates (the reasons above)"
        )
    out = os.path.join(os.path.dirname(file), "valid.jsonl")
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    print(f"kept {len(kept)} of {len(records)} records in {out}")
    return 0


def reference_main(a) -> int:
    """--reference_episode: one episode of the repo environment that applies record --index's
    reference fix with the tools and submits; prints its reward (exit 0 when it is 1.0)."""
    import time

    from launch.cli import fail
    from rl.envs.repo import check_record
    from rl.envs.repo.reference import fix_calls, make_env, reference_episode

    try:
        file, records = _records(a.reference_episode, "--reference_episode")
        if not 0 <= a.index < len(records):
            raise ValueError(f"--index={a.index}: {file} has records 0 to {len(records) - 1}")
        record = check_record(records[a.index])
        if not fix_calls(record):
            raise ValueError(
                f"--index={a.index}: {_name(record, a.index)} has no reference fix "
                "(neither a `patch` nor a `fix` field)"
            )
        env = make_env(a.isolation, a.images_dir or "", 2)
    except (ValueError, RuntimeError) as e:
        return fail(str(e))
    t0 = time.perf_counter()
    try:
        reward, ep, failed = reference_episode(env, record)
    except (ValueError, OSError) as e:  # an image record the environment refuses here
        return fail(f"--index={a.index}: {e}")
    finally:
        env.shutdown()
    passed = lambda key: f"{sum(ep.results.get(n, 0) for n in record[key])}/{len(record[key])}"
    print(
        f"{_name(record, a.index)}: reward {reward} (FAIL_TO_PASS {passed('fail_to_pass')} "
        f"passing, PASS_TO_PASS {passed('pass_to_pass')}; {ep.tool_calls} tool calls, "
        f"{ep.tool_errors} tool errors; sandbox {env.tools.mode}"
        f"{', image view ' + env.image_view if env.image_view else ''}; "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    for why in (
        failed and f"the fix did not apply: {failed}",
        ep.infra_error and f"infrastructure error (masked in training): {ep.infra_error}",
        ep.tamper and f"tamper: {ep.tamper}",
    ):
        if why:
            print(why)
    return 0 if reward == 1.0 else 1


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m launch.make_repo_tasks", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output directory (repos/ and tasks.jsonl)")
    p.add_argument("--num", type=int, default=64, help="tasks to generate")
    p.add_argument("--seed", type=int, default=0, help="generator seed")
    p.add_argument("--tar", action="store_true", help="write .tar.gz snapshots, not directories")
    p.add_argument(
        "--from_rows",
        help="convert SWE-Gym/SWE-smith/R2E-Gym rows instead: a jsonl file, a Hub dataset id "
        "(SWE-Gym/SWE-Gym), a save_to_disk directory, a directory of data files or a parquet file",
    )
    p.add_argument("--name", default="", help="with a --from_rows dataset: its subset")
    p.add_argument("--split", default="train", help="with a --from_rows dataset: its split")
    p.add_argument(
        "--revision", default="", help="with a --from_rows Hub id: a commit, branch or tag"
    )
    p.add_argument("--repos", help="with --from_rows: directory of checkouts <instance_id>/")
    p.add_argument(
        "--images_dir",
        help="with --from_rows, --validate, --reference_episode: "
        "unpacked images (launch.images unpack)",
    )
    p.add_argument(
        "--image_template",
        help="with --from_rows: a row's image name, e.g. "
        "swebench/sweb.eval.x86_64.{docker_id}:latest (rl/envs/repo/tasks.py)",
    )
    p.add_argument(
        "--validate",
        metavar="DIR",
        help="check each record of DIR/tasks.jsonl (or of a jsonl file): its tests "
        "before and after its reference fix; writes the valid ones to valid.jsonl "
        "beside it",
    )
    p.add_argument(
        "--reference_episode",
        metavar="DIR",
        help="run one episode of env repo on record --index of DIR/tasks.jsonl: its "
        "reference fix through the tools, then submit; prints the reward",
    )
    p.add_argument("--index", type=int, default=0, help="with --reference_episode: the record")
    p.add_argument(
        "--isolation",
        default="auto",
        choices=("auto", "bwrap", "rlimits"),
        help="with --validate, --reference_episode: the sandbox (config.env.isolation)",
    )
    p.add_argument(
        "--workers", type=int, default=4, help="with --validate: records checked at once"
    )
    a = p.parse_args(argv)
    if a.validate:
        return validate_main(a)
    if a.reference_episode:
        return reference_main(a)
    if not a.out:
        from launch.cli import fail

        return fail(
            "--out: required (the output directory), unless --validate or "
            "--reference_episode is given"
        )
    if a.from_rows:
        from launch.cli import fail
        from rl.envs.repo.tasks import RowsError, convert_rows, read_rows

        try:
            rows, commit = read_rows(
                a.from_rows, name=a.name or None, split=a.split, revision=a.revision
            )
        except RowsError as e:
            return fail(str(e))
        records, skipped = convert_rows(rows, a.repos, a.images_dir, a.image_template)
        if not records:  # nothing to train on: say why, write nothing
            return fail(
                f"--from_rows={a.from_rows!r}: none of its {len(rows)} rows converts "
                f"(the first: {skipped[0]})"
            )
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "tasks.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        for reason in skipped[:10]:
            print(f"skipped {reason}")
        at = f" ({a.from_rows} at commit {commit})" if commit else ""
        print(
            f"wrote {len(records)} of {len(rows)} rows to {os.path.join(a.out, 'tasks.jsonl')}" + at
        )
        return 0
    os.makedirs(a.out, exist_ok=True)
    rows = make_tasks(a.out, a.num, a.seed, a.tar)
    kinds = {k: sum(r["bug"] == k for r in rows) for k in KINDS}
    print(f"wrote {len(rows)} tasks to {os.path.join(a.out, 'tasks.jsonl')}: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
