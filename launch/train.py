"""GRPO training: `python -m launch.train [--config configs/X.py] [--workdir DIR] [--config.a.b=v]`.

One SPMD program holds the policy (and, when the KL term is on, a frozen reference) sharded over
one mesh, and alternates two phases on the same parameter arrays. One iteration:

    rollout   rollouts(step, state.params, data): sample G completions per prompt with the paged
              sampler on the learner's own arrays, score them, group advantages  (rl/rollout.py)
    learn     learner.learn(state, ref_params, batch): μ passes of minibatch steps, params and
              optimizer state donated and updated in place                        (rl/learner.py)
    log, evaluate, checkpoint

The parts come from `launch/build.py`; config checks from `launch/validate.py`; metrics, samples
and summary.json go through `launch/logger.py`. Checkpoints hold the train state, the step and the
data-iterator state (orbax), so a resumed run is bitwise equal to an uninterrupted one: the
rollout key of step s is fold_in(seed, s) and needs nothing else.
With partial rollouts (`rl/partial.py`) episodes in flight are carried from one step to the
next; a step that saves (a checkpoint step, the last, or one during which SIGTERM came) drains
them first, so no checkpoint holds any.
`--dry_run` lowers both phases with abstract shapes and prints XLA's memory estimate instead.
A run prints its config file, the fields set on the command line and the path of config.json
(every field with `--print_config`), then a progress bar where stderr is a terminal, or a line
every `log.progress_every` steps where it is a file or a pipe (nohup): no carriage-return frames.

Evaluation splits the held-out records over the batch shards as a rollout splits its prompts:
each process runs its own shards' share, and the processes agree on the per-record results
(`rl/evaluation.py`).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

import jax
import tqdm
from jax.experimental import multihost_utils

from launch.build import Run, base_checksums, prepare, restore_latest, seed_key
from launch.cli import UsageError, config_json, fail, load_config, split_args, workdir_for
from launch.distributed import init_distributed, peer_failed
from launch.dry_run import dry_run
from launch.logger import RunLogger
from launch.pin import (
    agreed,
    check_wandb_login,
    fetch_weights,
    pin_data,
    pin_model,
    pinned_commits,
)
from launch.preemption import Preemption
from launch.validate import check_isolation, check_sources, prepare_workdir, validate
from launch.workdir_lock import WorkdirLock
from models.sharding import run_devices
from rl.checkpoint import Checkpointer, CheckpointError, SaveError, fingerprint
from rl.learner import rollout_metrics

FLAGS = {"workdir": "", "dry_run": False, "print_config": False}
USAGE = """\
usage: python -m launch.train [--config FILE] [--workdir DIR] [--config.<field>=<value> ...]
                              [--dry_run] [--print_config]

  --config FILE             the config file (default: configs/default.py); its docstring
                            gives the command it is meant for
  --workdir DIR             the run's directory (default: runs/<config>-<timestamp>); one
                            that holds a checkpoint is resumed
  --config.<field>=<value>  sets a config field, e.g. --config.rl.num_generations=16 (a
                            python literal, else a string); a typo'd field is named
  --dry_run                 lowers both phases with abstract shapes, prints the memory each
                            device needs and exits: nothing is trained
  --print_config            prints every config field at start-up (without it: the config
                            file, the fields set on the command line and the saved config.json)
  --help                    this text
"""
# a full disk, a file system turned read-only, a quota: the run stops in one line (exit code 4)
DISK_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
TOTALS = ("rollout_seconds", "learn_seconds", "rollout_tokens", "learn_tokens", "nonfinite_steps")


def train(
    config,
    run: Run,
    data,
    eval_records,
    workdir: str,
    resume: bool,
    config_path: str = "",
    overrides=(),
    print_config: bool = False,
) -> int:
    main_process = jax.process_index() == 0
    # Every process has checked the workdir (main) before the first one writes to it.
    multihost_utils.sync_global_devices("workdir checked")
    os.makedirs(workdir, exist_ok=True)
    learner, state = run.learner, run.state
    ckpt = Checkpointer(workdir, keep=config.keep_checkpoints)
    base = base_checksums(run)  # LoRA: the frozen base weights the adapters belong to
    start, summary = 0, {}
    if resume:
        try:  # a refused resume leaves the workdir as it was, its config.json too
            state, start, summary = restore_latest(run, ckpt, base, data)
        except (CheckpointError, UsageError) as e:  # one line, the files left to inspect
            ckpt.close()
            return fail(str(e))
        print(f"resumed from step {start} in {workdir}", file=sys.stderr)
    if main_process:
        try:  # whole or not at all: a full disk here must not leave a config.json cut short
            _write_atomically(os.path.join(workdir, "config.json"), config_json(config))
        except OSError as e:
            if e.errno not in DISK_ERRORS:
                raise
            ckpt.close()
            fail(_disk_message(e, workdir, ckpt))
            return 4
        print(config if print_config else config_lines(config_path, overrides, workdir))
    summary.update(pinned_commits(config))  # the Hub snapshots of its weights and prompts
    try:
        log = RunLogger(workdir, enabled=main_process, config=config)
    except UsageError as e:  # wandb.init failed (launch.pin.check_wandb_login passed)
        if jax.process_count() > 1:
            raise  # process 0 alone: peer_failed exits it, the others stop in the next collective
        ckpt.close()
        return fail(str(e))
    if start == 0:
        summary["accuracy_before"] = _evaluate(run, state, eval_records, log, 0)["accuracy"]
        print(
            f"held-out greedy accuracy before GRPO: {summary['accuracy_before']:.3f}",
            file=sys.stderr,
        )
    totals = {k: summary.get(k, 0.0) for k in TOTALS}
    wall0 = time.perf_counter() - summary.get("wall_seconds", 0.0)
    rollouts = run.rollouts()
    # A bar on a terminal; in a file or a pipe (nohup, a notebook) a line every
    # log.progress_every steps instead of the bar's carriage-return frames.
    on_terminal = main_process and _terminal()
    bar = tqdm.tqdm(
        range(start, config.num_steps),
        initial=start,
        total=config.num_steps,
        desc="grpo",
        file=sys.stderr,
        disable=not on_terminal,
    )
    progress = Progress(
        start, config.num_steps, config.log.progress_every, enabled=main_process and not on_terminal
    )
    nonfinite = 0  # GRPO steps in a row with a skipped optimizer step
    masked = 0  # steps in a row whose episodes were (mostly) masked
    preemption = Preemption()  # SIGTERM / SIGINT: stop after the current step, saved
    # A checkpoint that cannot be written stops the run within a step (rl/checkpoint.py), and
    # so does a log file on a full or read-only disk: one line, exit code 4.
    try:
        for step in preemption.catching(bar):
            t0 = time.perf_counter()
            last = step + 1 == config.num_steps
            saving = last or (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0)
            # Partial rollouts: a step that saves ends with no episode in flight (rl/partial.py), and
            # so does one during which a stop is requested.
            rollout = rollouts(
                step, state.params, data, drain=bool(saving), stop=preemption.requested
            )  # on the learner's own arrays
            t1 = time.perf_counter()
            state, history = learner.learn(state, run.ref_params, rollout.batch)
            t2 = time.perf_counter()
            ckpt.check()  # the previous step's save, if any, is complete (or the run stops)
            new_tokens = rollout.tokens  # every process's completion tokens
            for k, v in zip(
                TOTALS, (t1 - t0, t2 - t1, new_tokens, sum(h["tokens"] for h in history))
            ):
                totals[k] += float(v)
            metrics = rollout_metrics(history)  # mean over the optimizer steps, maxima max
            metrics.update(
                rollout.stats,
                rollout_seconds=t1 - t0,
                learn_seconds=t2 - t1,
                rollout_tokens_per_s=new_tokens / (t1 - t0),
            )
            if config.log_every and (step + 1) % config.log_every == 0:
                log.scalars(step + 1, metrics)
                log.completions(
                    step + 1, rollout, config.data.train.prompt_field, config.num_samples_logged
                )
            # Non-finite optimizer steps were skipped (the learner left the state as it was); after
            # max_nonfinite_steps GRPO steps with one in a row, stop before anything else is saved.
            skipped = int(sum(h["skipped"] for h in history))
            totals["nonfinite_steps"] += skipped
            nonfinite = nonfinite + 1 if skipped else 0
            if skipped:
                bar.write(
                    f"step {step + 1}: {skipped} optimizer step(s) with a non-finite loss or "
                    f"gradient skipped ({nonfinite} GRPO step(s) in a row)"
                )
            if nonfinite >= config.max_nonfinite_steps:
                _close(bar, rollouts, ckpt)
                fail(
                    f"step {step + 1}: loss or gradient not finite in {nonfinite} steps in a row "
                    f"(max_nonfinite_steps={config.max_nonfinite_steps}); stopped (last checkpoint: "
                    f"step {ckpt.manager.latest_step() or 'none'} in {workdir})"
                )
                log.close()  # the event files and W&B run end here too (an in-process run goes on)
                return 3
            # Episodes masked by infrastructure errors train nothing: after env.max_masked_steps
            # steps in a row that masked env.max_masked_fraction of them, stop, nothing saved.
            masked = masked + 1 if _mostly_masked(rollout.stats, config.env) else 0
            if masked >= config.env.max_masked_steps:
                _close(bar, rollouts, ckpt)
                fail(
                    _masked_message(step + 1, masked, rollout.stats, config.env)
                    + f"; stopped (last checkpoint: step {ckpt.latest_step() or 'none'} in "
                    f"{workdir})"
                )
                log.close()
                return 3
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss']:.4f}")
            progress.step(step + 1, metrics)
            if config.eval_every and (step + 1) % config.eval_every == 0 and not last:
                ev = _evaluate(run, state, eval_records, log, step + 1)
                if main_process:
                    bar.write(f"step {step + 1}: held-out greedy accuracy {ev['accuracy']:.3f}")
            # A stop requested after this step's batch was complete waits for the next (drained) one.
            preempted = not last and preemption.requested() and not rollouts.carried
            if saving or preempted:
                summary.update(totals, wall_seconds=time.perf_counter() - wall0)
                meta = {
                    "step": step + 1,
                    "data": data.get_state(),
                    "summary": summary,
                    "key": seed_key(config.seed),
                    "base": base,
                }
                ckpt.save(step + 1, learner.checkpointed(state), meta)
            if preempted:  # SIGTERM / SIGINT: this step is saved; the same command resumes it
                _close(bar, rollouts, ckpt, log)  # the checkpointer waits for the save
                print(
                    f"{preemption.signal_name or 'signal'} received: stopped after step {step + 1} "
                    f"and saved it in {workdir}; run the same command to resume",
                    file=sys.stderr,
                )
                return 0
        _close(bar, rollouts, ckpt)
    except (SaveError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in DISK_ERRORS:
            raise
        _close(bar, rollouts)
        _close_quietly(log)  # (its files may be what cannot be written)
        fail(str(e) if isinstance(e, SaveError) else _disk_message(e, workdir, ckpt))
        if jax.process_count() > 1:  # not the others' shutdown barrier: they stop on its
            sys.stderr.flush()  # missing heartbeat (launch/distributed.py)
            os._exit(4)
        return 4
    try:  # (the last checkpoint is saved: the same command evaluates and summarises again)
        after = _evaluate(run, state, eval_records, log, config.num_steps)
        wall = time.perf_counter() - wall0
        log.finish(config, summary, totals, after, wall, fingerprint(state.params))
        log.close()
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            raise
        _close_quietly(log)
        fail(_disk_message(e, workdir, ckpt))
        return 4
    return 0


def _mostly_masked(stats: dict, env) -> bool:
    """Whether a step's episodes were masked (rl.summary.masked_stats) as env.max_masked_*
    say; a step without environment episodes never is."""
    count = stats.get("episode/count", 0)
    return count > 0 and stats["episode/masked_frac"] >= env.max_masked_fraction


def _masked_message(step: int, steps: int, stats: dict, env) -> str:
    text, n = stats["episode/top_infra_error"]
    masked, count = int(stats["episode/masked"]), int(stats["episode/count"])
    return (
        f"step {step}: {masked} of {count} episodes masked by infrastructure errors, "
        f"{steps} step(s) in a row (env.max_masked_fraction={env.max_masked_fraction}, "
        f"env.max_masked_steps={env.max_masked_steps}): the run trains on nothing; the most "
        f"frequent error ({n} episodes): {text}"
    )


def config_lines(config_path: str, overrides, workdir: str, max_lines: int = 16) -> str:
    """The config as a run prints it: the file, the fields set on the command line (their
    values as given; past `max_lines` lines, how many more), and where every field is saved."""
    items = [f"{k}={v}" for k, v in overrides] or ["none"]
    lines, shown = [f"config {config_path}; set on the command line:"], 0
    for item in items:
        if len(lines[-1]) + 1 + len(item) > 100:
            if len(lines) == max_lines:
                break
            lines.append("   ")
        lines[-1] += " " + item
        shown += 1
    more = f"{len(items) - shown} more set; " if shown < len(items) else ""
    saved = os.path.join(workdir, "config.json")
    return "\n".join([*lines, f"{more}every field: {saved} (--print_config prints them here)"])


def _terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


class Progress:
    """Progress where stderr is no terminal (a file, a pipe): one line every `every` steps and
    at the last one, `step 10/60: reward 0.430 loss 0.0700 (1.2 s/step)`, the seconds per step
    over those steps, everything included (evaluation, checkpoints)."""

    def __init__(self, start: int, total: int, every: int, enabled: bool):
        self.total, self.every, self.enabled = total, every, enabled
        self.last, self.t = start, time.perf_counter()

    def step(self, step: int, metrics: dict) -> None:
        if not self.enabled or (step % self.every and step != self.total):
            return
        now = time.perf_counter()
        per_step = (now - self.t) / max(step - self.last, 1)
        self.last, self.t = step, now
        line = (
            f"step {step}/{self.total}: reward {metrics['reward_mean']:.3f} loss "
            f"{metrics['loss']:.4f} ({per_step:.1f} s/step)"
        )
        print(line, file=sys.stderr, flush=True)


def _write_atomically(path: str, value) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=2)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _disk_message(e: OSError, workdir: str, ckpt: Checkpointer) -> str:
    return f"cannot write {e.filename or workdir}: {e.strerror} ({ckpt.resume_hint()})"


def _close_quietly(part) -> None:
    try:
        part.close()
    except OSError:
        pass


def _close(*parts) -> None:
    """The progress bar, then the rollouts' workers, then the checkpointer (it waits for a save)."""
    for part in parts:
        part.close()


def _evaluate(run: Run, state, records, log: RunLogger, step: int) -> dict:
    result = run.evaluate(state.params, records)
    log.scalars(step, {f"eval/{k}": v for k, v in result.items() if k != "example"})
    return result


def main(argv=None) -> int:
    try:
        args = sys.argv[1:] if argv is None else argv
        config_path, overrides, opts = split_args(args, FLAGS, USAGE + "\n" + __doc__)
        config = load_config(config_path, overrides)
        init_distributed(config)
        # first: whether this machine may run the config at all (before any Hub download)
        check_isolation(config, probe=not opts["dry_run"])
        # a Hub id: resolved once (its config files), its commit in config.model.hf_commit
        pin_model(config, weights=False)
        pin_data(config)  # a Hub dataset id: its commit in config.data.train.hf_commit
        # the sandbox is probed above; a Hub dataset is fetched after the resume check
        validate(config, len(run_devices()), runs_code=False, sources=False)
        if not opts["dry_run"]:
            check_wandb_login(config)  # process 0's W&B key, before the model loads
        workdir = workdir_for(config_path, opts["workdir"])
        resume = prepare_workdir(config, workdir)
    except UsageError as e:
        return fail(str(e))
    if opts["dry_run"]:
        return dry_run(config)
    lock = WorkdirLock(workdir)  # one run per workdir, held by process 0 until it exits
    try:
        agreed(lambda _: lock.acquire() or "", "")
    except UsageError as e:
        return fail(str(e))
    try:  # data and checkpoint problems: one line, and the workdir is left as it was
        check_sources(config)  # (after the resume has checked the data's commit)
        fetch_weights(config)  # (after the resume has checked the commit)
        parts = prepare(config)
    except (UsageError, ValueError, OSError) as e:
        lock.release(undo=True)
        return fail(str(e))
    rc, shown = 1, (config_path, overrides, opts["print_config"])  # the config, as printed
    try:
        if jax.process_count() == 1:
            rc = train(config, *parts, workdir, resume, *shown)
            return rc
        try:
            rc = train(config, *parts, workdir, resume, *shown)
            return rc
        except Exception as e:  # noqa: BLE001 (any failure of one process of several)
            peer_failed(e)
    finally:  # (an in-process run; a process that ends releases it anyway); a refused resume
        lock.release(undo=rc == 2)  # leaves the workdir as it found it


if __name__ == "__main__":
    sys.exit(main())
