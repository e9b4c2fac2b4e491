"""Qwen3-MoE (models/moe.py) against transformers' Qwen3MoeForCausalLM (issue 52, must-show 1).

Random tiny checkpoints made by transformers (several expert counts and top-k, mlp_only_layers
and decoder_sparse_step mixes, both norm_topk_prob values, tied and untied embeddings), saved in
the Hub's per-expert layout: the forward logits, greedy tokens and log-probs of launch.generate,
the learner's log-probs (rl.logprobs) against transformers' in f32, export -> transformers reload,
and a load by Hub id from a cache laid out as huggingface_hub lays it out.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.hf import load_hf, save_hf
from models.sharding import make_mesh

pytestmark = [pytest.mark.hf, pytest.mark.slow]  # transformers-made checkpoints: ~2 min

# (name, experts, top-k, norm_topk_prob, tied, layers, mlp_only_layers, decoder_sparse_step)
VARIANTS = [
    ("e4k2_norm_untied", 4, 2, True, False, 3, [1], 1),
    ("e8k3_step2_tied", 8, 3, False, True, 4, [], 2),
    ("e6k1_mix_norm_tied", 6, 1, True, True, 4, [0], 2),
    ("e5k5_all_untied", 5, 5, False, False, 2, [], 1),
]
PROMPTS = [[3, 17, 42, 8, 5], [11, 2, 9, 30, 44, 12, 7, 19, 25], [50, 1, 33]]
NEW = 16  # greedy tokens compared
VOCAB = 64


def _make(torch, transformers, directory, e, k, norm, tied, layers, dense, step, seed):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=e,
        num_experts_per_tok=k,
        norm_topk_prob=norm,
        mlp_only_layers=dense,
        decoder_sparse_step=step,
        tie_word_embeddings=tied,
        eos_token_id=VOCAB - 1,
        pad_token_id=0,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # spread logits and routes: no near-ties for greedy or top-k
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_((0.5 if "mlp.gate.weight" in name else 0.1) * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def _hf_reference(torch, model):
    """Per prompt: logits [T,V] of the prompt, the greedy continuation (model.generate) and the
    log-softmax of the full sequence's logits at its next tokens."""
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            logits = model(input_ids=ids).logits[0].numpy()
            gen = model.generate(
                ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0]
            full = model(input_ids=gen[None]).logits[0].float()
            lp = torch.log_softmax(full, -1)[:-1].gather(-1, gen[1:, None])[:, 0].numpy()
            out.append((logits, gen[len(p) :].tolist(), lp, gen.tolist()))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    top = tmp_path_factory.mktemp("moe")
    made = {}
    for i, (name, *shape) in enumerate(VARIANTS):
        d = str(top / name)
        model = _make(torch, transformers, d, *shape, seed=i)
        model.config._attn_implementation = "eager"
        made[name] = (d, _hf_reference(torch, model))
    return made


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 1}, devices=jax.devices()[:1])


@jax.jit
def _logits(graphdef, params, tokens):
    t = tokens.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    return nnx.merge(graphdef, params)(tokens, pos)[0]


_logits = jax.jit(_logits.__wrapped__, static_argnums=0)


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_config_and_logits_match_transformers(name, checkpoints, mesh):
    d, ref = checkpoints[name]
    cfg, graphdef, params, _ = load_hf(d, mesh)
    _, e, k, norm, tied, layers, dense, step = next(v for v in VARIANTS if v[0] == name)
    assert (cfg.family, cfg.num_experts, cfg.experts_per_token) == ("qwen3_moe", e, k)
    assert cfg.norm_topk_prob == norm and cfg.tie_embeddings == tied
    assert cfg.moe_layers == tuple(
        i for i in range(layers) if i not in dense and (i + 1) % step == 0
    )
    assert params["blocks"][cfg.moe_layers[0]]["mlp"]["gate"].shape == (e, 32, 24)  # [E,D,F]
    for p, (logits, *_) in zip(PROMPTS, ref):
        ours = np.asarray(_logits(graphdef, params, jnp.asarray([p])))[0]
        np.testing.assert_allclose(ours, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_generate_and_learner_logprobs_match_transformers(name, checkpoints, tmp_path):
    """launch.generate (the sampler: prefill, paged decode) greedy equals HF generate exactly;
    its log-probs and the learner's teacher-forced ones (rl.logprobs) within 1e-4 of HF's."""
    from launch.generate import main
    from models.sharding import make_mesh as mk
    from rl.logprobs import token_logprobs
    from sampling.distribution import SamplingParams

    d, ref = checkpoints[name]
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS)
    )
    out = tmp_path / "out.jsonl"
    argv = [
        "--hf_checkpoint",
        d,
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--output",
        str(out),
        "--temperature",
        "0",
        "--max_new_tokens",
        str(NEW),
        "--num_slots",
        "4",
        "--page_size",
        "8",
    ]
    assert main(argv) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    for line, (_, greedy, lp, _) in zip(lines, ref):
        assert VOCAB - 1 not in greedy  # HF ran without stopping: no eos in its continuation
        assert line["token_ids"] == greedy
        np.testing.assert_allclose(line["logprobs"], lp[-NEW:], atol=1e-4, rtol=0)
    cfg, graphdef, params, _ = load_hf(d, mk({"data": 1}, devices=jax.devices()[:1]))
    model = nnx.merge(graphdef, params)
    for *_, lp, seq in ref:
        tokens = jnp.asarray([seq])
        pos = jnp.arange(len(seq))[None]
        ours = token_logprobs(model, tokens, pos, jnp.ones_like(tokens, bool), SamplingParams())
        np.testing.assert_allclose(np.asarray(ours.logp)[0], lp, atol=1e-4, rtol=0)


def test_export_reloads_in_transformers_with_the_same_logits(checkpoints, mesh, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in ("e4k2_norm_untied", "e6k1_mix_norm_tied"):
        d, ref = checkpoints[name]
        cfg, graphdef, params, ids = load_hf(d, mesh)
        out = tmp_path / name
        save_hf(str(out), cfg, params, ids, max_shard_bytes=100_000)  # sharded
        assert (out / "model.safetensors.index.json").exists()
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert f"model.layers.{cfg.moe_layers[0]}.mlp.experts.0.gate_proj.weight" in index
        assert f"model.layers.{cfg.moe_layers[0]}.mlp.gate.weight" in index
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            for p, (logits, *_) in zip(PROMPTS, ref):
                reloaded = model(input_ids=torch.tensor([p])).logits[0].numpy()
                np.testing.assert_allclose(reloaded, logits, atol=1e-5, rtol=0)
        # and ours again, bitwise, from the sharded export
        cfg2, _, params2, _ = load_hf(str(out), mesh)
        assert cfg2 == cfg
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_in_bfloat16_and_load_by_hub_id(checkpoints, mesh, tmp_path, monkeypatch):
    from models.hub import resolve
    from tests.hub_cache import add_directory, offline_hub

    d, ref = checkpoints["e8k3_step2_tied"]
    cfg, graphdef, params, ids = load_hf(d, mesh)
    bf = tmp_path / "bf16"
    save_hf(str(bf), cfg, params, ids, dtype="bfloat16")
    assert json.loads((bf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cache = tmp_path / "cache"
    commit = "a" * 40
    add_directory(cache, "org/tiny-moe", d, commit)
    offline_hub(monkeypatch, cache)
    path, got = resolve("org/tiny-moe")
    assert got == commit
    cfg2, graphdef2, params2, _ = load_hf(path, mesh)
    assert cfg2 == cfg
    ours = np.asarray(_logits(graphdef2, params2, jnp.asarray([PROMPTS[0]])))[0]
    np.testing.assert_allclose(ours, ref[0][0], atol=1e-4, rtol=0)
    _, _, params3, _ = load_hf(str(bf), mesh, dtype="bfloat16", param_dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params3)):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a), rtol=2**-8, atol=0)
