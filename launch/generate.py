r"""Sample completions from an HF checkpoint with the paged sampler: `python -m launch.generate`.

    python -m launch.generate --hf_checkpoint DIR --prompts prompts.jsonl --output out.jsonl \
        --num_samples 4 --temperature 0.7 --max_new_tokens 64
    python -m launch.generate --hf_checkpoint Qwen/Qwen2.5-0.5B-Instruct [--revision REV] ...

--hf_checkpoint is a local directory or a Hub id, fetched into the Hub cache (models/hub.py).

Each input line holds `prompt` (text; needs tokenizer.json or char_tokenizer.json in the
checkpoint directory) or `prompt_ids` (token ids). Prompt text is data: special-token strings in it
such as "<|im_start|>" are encoded as text, not as their ids (`models/tokenizer.py`); give a
prompt with chat markup as `prompt_ids`. Each output line holds `prompt_index`, `sample_index`,
`token_ids`, `logprobs` (the sampler's, under the distribution the token was drawn from),
`finish_reason` ("stop" or "length"), and `text` where a tokenizer is present. Parameters are
sharded over all local devices on the data axis; a progress bar goes to stderr.

--hf_checkpoint may also be a training run's workdir (`launch.train --workdir W`): its latest
checkpoint (or `--step N`) is restored as `launch.eval` restores it, on the devices at hand, and
sampled with the run's tokenizer, mesh and sharding rules; nothing is exported.

    python -m launch.generate --hf_checkpoint runs/default-... [--step N] --prompts p.jsonl \
        --output out.jsonl

`python -m launch.export --workdir W --out DIR` makes an HF checkpoint of it for other tools.

--cache_dtype and --weights_dtype choose the KV pages' dtype and the decode copy of the weights
(float32 / bfloat16 / float16, or quantised: int8 / float8_e4m3fn, `sampling.kv_quant`,
`models.quant`). A training run's default is its own sampler's (`sampling.cache_dtype`,
`sampling.weights_dtype`, `sampling.weights_layout`), so its completions are drawn as its
rollouts were; an HF checkpoint's is float32 KV and its parameters as loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import tqdm

from launch.cli import ArgumentParser, UsageError, fail
from models.hf import load_hf
from models.hf_config import CheckpointError
from models.hub import HubError, resolve
from models.sharding import make_mesh, run_devices
from models.tokenizer import CHAR_TOKENIZER_FILE, load_tokenizer
from rl.sources import read_jsonl
from sampling.distribution import SamplingParams
from sampling.engine import Engine, EngineConfig
from sampling.episodes import generate_all


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """Token ids of every line of a jsonl file; errors name the file and line."""
    prompts = []
    for where, record in read_jsonl(path):
        if "prompt_ids" in record:
            prompts.append([int(t) for t in record["prompt_ids"]])
        elif "prompt" in record:
            if tokenizer is None:
                raise ValueError(f"{where}: 'prompt' text needs a tokenizer in the checkpoint")
            prompts.append(tokenizer.encode(record["prompt"], add_bos=tokenizer.add_bos_token))
        else:
            raise ValueError(f"{where}: expected a 'prompt' or 'prompt_ids' field")
        if not prompts[-1]:
            raise ValueError(f"{where}: empty prompt")
    return prompts


def is_training_run(path: str) -> bool:
    """Whether `path` is a launch.train workdir: its config.json is a run's config (with
    model.hf_checkpoint), not a model's."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            model = json.load(f).get("model")
    except (OSError, ValueError, AttributeError):  # no file, not JSON, not an object
        return False
    return isinstance(model, dict) and "hf_checkpoint" in model


def from_run(workdir: str, step: int | None):
    """(model config, graphdef, params, generation ids, tokenizer, engine layout, sampler
    settings) of a training run's checkpoint at `step` (default: the latest), restored as
    launch.eval restores it: on the devices at hand, without the reference copy; the engine on
    the run's mesh and rules, its KV pages and decode weights as the run's rollouts had them."""
    from launch.build import load_run  # (the RL parts: only for a run)
    from launch.validate import engine_config

    run, step = load_run(workdir, step, runs_code=False, flag="--hf_checkpoint")
    print(f"sampling from step {step} of the run in {workdir}", file=sys.stderr)
    layout = {"mesh": run.mesh, "rules": tuple(tuple(r) for r in run.config.rules)}
    ecfg = engine_config(run.config, run.ids.eos_ids)
    sampler = {k: getattr(ecfg, k) for k in ("cache_dtype", "weights_dtype", "weights_layout")}
    model = (run.model_cfg, run.learner.graphdef, run.state.params)
    return *model, run.ids, run.tokenizer, layout, sampler


def flags(args) -> dict:
    """The EngineConfig fields set on the command line (--cache_dtype, --weights_dtype)."""
    names = ("cache_dtype", "weights_dtype")
    return {k: getattr(args, k) for k in names if getattr(args, k) is not None}


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m launch.generate",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--hf_checkpoint",
        required=True,
        help="HF checkpoint directory, Hub id or training run's workdir",
    )
    p.add_argument("--revision", default="", help="Hub id: commit, branch or tag")
    p.add_argument(
        "--step", type=int, default=None, help="a training run's checkpoint step (default: latest)"
    )
    p.add_argument("--prompts", required=True, help="jsonl with 'prompt' or 'prompt_ids' per line")
    p.add_argument("--output", required=True, help="jsonl to write")
    p.add_argument("--num_samples", type=int, default=1, help="completions per prompt (G)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--min_new_tokens", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_slots", type=int, default=32, help="sequences decoded together")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--num_pages", type=int, default=1024, help="KV pages in the pool")
    p.add_argument(
        "--cache_dtype",
        default=None,
        help="KV pages: float32, bfloat16, float16, int8, float8_e4m3fn "
        "(default: a run's sampling.cache_dtype, else float32)",
    )
    p.add_argument(
        "--weights_dtype",
        default=None,
        help="decode copy of the weights: '' (none), float32, bfloat16, float16, int8, "
        "float8_e4m3fn (default: a run's sampling.weights_dtype, else '')",
    )
    args = p.parse_args(argv)
    if not os.path.exists(args.prompts):
        return fail(f"--prompts: {args.prompts} does not exist")
    layout = {}  # the engine's mesh and rules: a training run's own
    sampler = {"cache_dtype": "float32"}  # the KV and decode-copy settings: a run's own
    if is_training_run(args.hf_checkpoint):  # its checkpoint, restored as launch.eval does
        try:
            if args.revision:
                raise UsageError("--revision: a Hub id's; --hf_checkpoint is a training run")
            cfg, graphdef, params, ids, tokenizer, layout, sampler = from_run(
                args.hf_checkpoint, args.step
            )
            prompts = read_prompts(args.prompts, tokenizer)
        except (UsageError, ValueError) as e:
            return fail(str(e))
    else:
        if args.step is not None:
            return fail("--step: only with a training run's workdir as --hf_checkpoint")
        try:  # a directory as it is, a Hub id from the Hub cache (HF_HOME; HF_HUB_OFFLINE=1)
            ref, rev = args.hf_checkpoint, args.revision
            args.hf_checkpoint = resolve(
                ref, rev, field="--hf_checkpoint", revision_field="--revision"
            )[0]
        except HubError as e:
            return fail(str(e))
        try:
            files = ("tokenizer.json", CHAR_TOKENIZER_FILE)
            has_tok = any(os.path.exists(os.path.join(args.hf_checkpoint, f)) for f in files)
            tokenizer = load_tokenizer(args.hf_checkpoint) if has_tok else None
            prompts = read_prompts(args.prompts, tokenizer)
            cfg, graphdef, params, ids = load_hf(
                args.hf_checkpoint, make_mesh({"data": len(run_devices())})
            )
        except (ValueError, CheckpointError) as e:
            return fail(str(e))
    try:  # the sampler's flags, as the engine checks them
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
        ecfg = EngineConfig(
            num_slots=max(args.num_slots, args.num_samples),
            page_size=args.page_size,
            num_pages=args.num_pages,
            max_prompt_len=max(len(x) for x in prompts),
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.min_new_tokens,
            steps_per_call=min(16, args.max_new_tokens),
            stop_ids=ids.eos_ids,
            **{**sampler, **flags(args)},
        )
        engine = Engine(cfg, graphdef, ecfg, sampling, **layout)
    except ValueError as e:
        return fail(str(e))
    total = len(prompts) * args.num_samples
    with tqdm.tqdm(total=total, desc="sequences", file=sys.stderr) as bar:
        _, results = generate_all(
            engine,
            params,
            engine.init_state(),
            prompts,
            args.num_samples,
            seed=args.seed,
            on_finish=lambda *_: bar.update(1),
        )
    with open(args.output, "w") as f:
        for i, group in enumerate(results):
            for g, c in enumerate(group):
                record = {
                    "prompt_index": i,
                    "sample_index": g,
                    "token_ids": c.tokens,
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                }
                if tokenizer is not None:
                    record["text"] = tokenizer.decode(c.tokens)
                f.write(json.dumps(record) + "\n")
    print(f"wrote {total} completions to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
