"""The real-model configs validate, pass --dry_run and train one step, with tiny stand-ins.

Each stand-in is an HF fixture of the same architecture (tests/fixtures/hf) plus a small
`tokenizers` BPE tokenizer with a chat template, and a few GSM8K-style jsonl lines. The run uses
the config unchanged except for paths, the mesh (the 8 fake devices) and sizes.
"""

import json
import os
import re
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from launch.train import main
from tests.conftest import FIXTURES, ROOT, sandbox_isolation

pytestmark = pytest.mark.slow  # dry runs and one-step runs of every real config

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DATA = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3+4=7\n#### 7"},
    {"question": "A box holds 12 eggs. How many eggs in 2 boxes?", "answer": "12*2=24\n#### 24"},
    {"question": "Sam reads 5 pages a day for 6 days. Pages?", "answer": "5*6=30\n#### 30"},
    {"question": "There are 9 birds and 4 fly away. How many stay?", "answer": "9-4=5\n#### 5"},
]


def local_data(path) -> list[str]:
    """The configs read GSM8K from the Hub (openai/gsm8k); these runs read a local jsonl file."""
    return [f"--config.data.{split}.{k}={v}" for split in ("train", "eval")
            for k, v in (("type", "jsonl"), ("path", path))]  # fmt: skip


def _stand_in(fixture, tmp_path):
    d = tmp_path / f"{fixture}-standin"
    shutil.copytree(os.path.join(FIXTURES, fixture), d)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials)
    corpus = [r["question"] + " " + r["answer"] for r in DATA] + [
        "user assistant system Solve step ####"
    ]
    tok.train_from_iterator(corpus * 20, trainer)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in DATA))
    return d, data


@pytest.mark.parametrize(
    "config, fixture",
    [
        ("qwen2_5_0_5b_gsm8k", "qwen2"),
        ("qwen3_0_6b_gsm8k", "qwen3"),
        ("llama3_2_1b_gsm8k", "llama"),
    ],
)
def test_real_config_dry_run_and_one_step(config, fixture, tmp_path, capsys):
    ckpt, data = _stand_in(fixture, tmp_path)
    args = [
        f"--config={ROOT}/configs/{config}.py", f"--config.model.hf_checkpoint={ckpt}",
        *local_data(data),
        "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
        "--config.data.prompts_per_step=4", "--config.rl.num_generations=2",
        "--config.rl.micro_batches=1", "--config.sampling.max_prompt_len=64",
        "--config.sampling.max_new_tokens=8", "--config.sampling.num_slots=8",
        "--config.sampling.page_size=8", "--config.sampling.num_pages=64",
        "--config.sampling.steps_per_call=4", "--config.rl.overlong_buffer=4",
        "--config.eval.pass_k=1", "--config.eval.pass_n=1",
    ]  # fmt: skip
    # Qwen2.5 with LoRA (rank 8, KL on): --dry_run prints what a full fine-tune would hold, and
    # the LoRA run's resident state is below the full fine-tune's without a reference model.
    lora = ["--config.model.lora.rank=8", "--config.rl.kl_coef=0.04"] if fixture == "qwen2" else []
    assert main(args + lora + ["--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "estimated peak per device" in out
    assert re.search(r"^prefill 64 +args", out, re.M), out  # prompts of 64 fit one chunk
    assert re.search(r"^extend 128 +args", out, re.M), out  # a 64 + 8 token history again
    if lora:
        mine = re.search(r"params \+ optimizer ([\d.]+) MiB, reference ([\d.]+) MiB", out)
        full = re.search(r"a full fine-tune holds params \+ optimizer ([\d.]+) MiB", out)
        assert mine and full, out
        assert float(mine[2]) == 0 and float(mine[1]) < float(full[1])
    workdir = tmp_path / "run"
    assert main(args + ["--config.num_steps=1", f"--workdir={workdir}"]) == 0
    summary = json.load(open(workdir / "summary.json"))
    assert summary["steps"] == 1 and 0.0 <= summary["accuracy_after"] <= 1.0


CODE = [
    {"prompt": "Write add(a, b) returning a + b.", "tests": "assert add(1, 2) == 3",
     "entry_point": "add"},
    {"prompt": "Write neg(x) returning -x.", "tests": "def check(f):\n    assert f(2) == -2\n",
     "entry_point": "neg"},
]  # fmt: skip


@pytest.mark.parametrize(
    "config, fixture", [("qwen2_5_0_5b_code", "qwen2"), ("qwen3_0_6b_code", "qwen3")]
)
def test_code_config_one_step(config, fixture, tmp_path):
    """The multi-turn code configs: episodes whose attempts run in the sandbox, failures fed back."""
    ckpt, _ = _stand_in(fixture, tmp_path)
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CODE))
    args = [
        f"--config={ROOT}/configs/{config}.py", f"--config.model.hf_checkpoint={ckpt}",
        *local_data(data),
        "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
        "--config.data.prompts_per_step=4", "--config.rl.num_generations=2",
        "--config.rl.micro_batches=1", "--config.sampling.max_prompt_len=64", "--config.data.system_prompt=Code.",
        "--config.sampling.max_new_tokens=96", "--config.env.max_turn_tokens=6", "--config.env.max_observation_chars=40",
        "--config.sampling.num_slots=8", "--config.sampling.page_size=8",
        "--config.sampling.num_pages=256", "--config.sampling.steps_per_call=4",
        "--config.eval.pass_k=1", "--config.eval.pass_n=1",
        f"--config.env.isolation={sandbox_isolation()}",  # tests.conftest: rlimits without bwrap
    ]  # fmt: skip
    # No --dry_run here: it does not depend on the environment, and the GSM8K tests above run it
    # for the same architectures.
    workdir = tmp_path / "run"
    assert main(args + ["--config.num_steps=1", f"--workdir={workdir}"]) == 0
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
    step = next(r for r in rows if "loss" in r)
    assert step["episode/turns"] > 1  # failing attempts got test feedback and another turn
    assert step["episode/prefill_tokens"] < step["episode/reprefill_tokens"]


@pytest.mark.hf  # transformers / torch / peft: CI's second pass (.ci/run)
def test_export_of_a_trained_run_reads_back_equal(tmp_path, capsys):
    """launch.export of a trained run: our importer reads it back bitwise, and transformers (where
    installed) loads it and gives our logits."""
    import jax
    import numpy as np

    from launch.build import load_run
    from launch.export import main as export
    from models.hf import load_hf
    from models.sharding import flatten

    ckpt, data = _stand_in("qwen3", tmp_path)
    workdir, out = tmp_path / "run", tmp_path / "exported"
    args = [
        f"--config={ROOT}/configs/qwen3_0_6b_gsm8k.py", f"--config.model.hf_checkpoint={ckpt}",
        *local_data(data),
        # the GSM8K test's mesh and sizes: its sampler programs serve this run too
        "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
        "--config.data.prompts_per_step=4", "--config.rl.num_generations=2",
        "--config.rl.micro_batches=1", "--config.sampling.max_prompt_len=64",
        "--config.sampling.max_new_tokens=8", "--config.sampling.num_slots=8",
        "--config.sampling.page_size=8", "--config.sampling.num_pages=64",
        "--config.sampling.steps_per_call=4", "--config.rl.overlong_buffer=4",
        "--config.eval.pass_k=0", "--config.num_steps=2", "--config.optim.learning_rate=1e-2",
        "--config.optim.warmup_steps=0", "--config.rl.entropy_coef=0.01", f"--workdir={workdir}",
    ]  # fmt: skip
    assert main(args) == 0
    assert export(["--workdir", str(workdir), "--out", str(out)]) == 0
    run, step = load_run(str(workdir))
    state = run.state
    assert step == 2
    _, graphdef, params, _ = load_hf(str(out), run.mesh)
    trained, exported = flatten(state.params), flatten(params)
    initial = flatten(load_hf(str(ckpt), run.mesh)[2])
    # it did train (the entropy bonus has a gradient even when every reward is equal)
    assert any(not np.array_equal(trained[k], initial[k]) for k in trained)
    for k in trained:
        np.testing.assert_array_equal(np.asarray(exported[k]), np.asarray(trained[k]), err_msg=k)
    assert (out / "tokenizer.json").exists()

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    tokens = np.array([[5, 17, 42, 7, 99, 3]], np.int32)
    positions = np.arange(6, dtype=np.int32)[None]
    ours = jax.jit(lambda p: nnx_forward(graphdef, p, tokens, positions))(params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)


def nnx_forward(graphdef, params, tokens, positions):
    from flax import nnx

    return nnx.merge(graphdef, params)(tokens, positions)[0]
