"""Export a trained policy as an HF checkpoint: `python -m launch.export --workdir W --out DIR`.

    python -m launch.export --workdir runs/default-... [--step N] --out exported/ [--dtype bfloat16]
    python -m launch.export --workdir runs/lora-run --out adapter/ --adapter

Restores the run's checkpoint (latest unless --step) and writes config.json, safetensors and
generation_config.json with `models.hf.save_hf`, in the param dtype unless --dtype is given; a
LoRA run's adapters are folded into the weights (`models.lora.merge`). The tokenizer files of
the run's starting checkpoint (tokenizer.json, tokenizer_config.json, chat_template.jinja,
char_tokenizer.json), where present, are copied along so the directory is self-contained.

`--adapter` (LoRA runs) writes only the adapters, as the `peft` library saves them:
adapter_config.json and adapter_model.safetensors, to load with
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<base>), DIR)`, where
<base> is the run's starting checkpoint (config.model.hf_checkpoint; a Hub id with the commit the
run started from as adapter_config.json's `revision`, which peft's AutoPeftModel loads it at).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from launch.build import load_run
from launch.cli import ArgumentParser, UsageError, fail
from launch.pin import model_dir
from launch.validate import DTYPES, check_writable_dir
from models.hf import save_adapter, save_hf
from models.tokenizer import CHAR_TOKENIZER_FILE

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    CHAR_TOKENIZER_FILE,
)


def adapter_base(config) -> tuple[str, str | None]:
    """The base model of a LoRA run's exported adapter, as adapter_config.json names it: a Hub
    id as it is with the commit the run started from (peft loads the base at that revision, not
    at the default branch, which may have moved), or the absolute path of a local directory."""
    ref, commit = config.model.hf_checkpoint, config.model.get("hf_commit", "")
    return (ref, commit) if commit else (os.path.abspath(ref), None)


def main(argv=None) -> int:
    p = ArgumentParser(
        prog="python -m launch.export",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--workdir", required=True, help="training run directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--out", required=True, help="HF checkpoint directory to write")
    p.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: param dtype)"
    )
    p.add_argument("--adapter", action="store_true", help="LoRA runs: a PEFT adapter directory")
    args = p.parse_args(argv)
    try:  # before the run is loaded, and before anything is written
        if args.dtype not in (None, *DTYPES):
            raise UsageError(f"--dtype {args.dtype}: expected one of {DTYPES}")
        if os.path.realpath(args.out) == os.path.realpath(args.workdir):
            raise UsageError(
                f"--out {args.out}: is the run's workdir (its config.json would be "
                "overwritten); export to a new directory"
            )
        check_writable_dir("--out", args.out)
        if args.adapter and not _lora_rank(args.workdir):  # before the run is restored
            raise UsageError(
                f"--adapter: the run in {args.workdir} has no LoRA adapters "
                "(config.model.lora.rank = 0); export it without --adapter"
            )
        run, step = load_run(args.workdir, args.step, runs_code=False)  # no sandbox probe
    except UsageError as e:
        return fail(str(e))
    if args.adapter:
        base, revision = adapter_base(run.config)
        save_adapter(args.out, run.model_cfg, run.state.params, base, args.dtype, revision)
    else:
        save_hf(args.out, run.model_cfg, run.state.params, run.ids, dtype=args.dtype)
    for name in TOKENIZER_FILES:
        src = os.path.join(model_dir(run.config), name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(args.out, name))
    print(f"exported step {step} of {args.workdir} to {args.out}")
    return 0


def _lora_rank(workdir: str) -> int:
    """config.model.lora.rank of a run (0 when absent or when there is no config.json: then
    load_run says what is wrong)."""
    try:
        with open(os.path.join(workdir, "config.json")) as f:
            return int(json.load(f).get("model", {}).get("lora", {}).get("rank", 0))
    except (OSError, ValueError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
