"""HF checkpoint import/export against the committed fixtures (tests/fixtures/make_hf_fixtures.py).

The recorded HF logits and greedy continuations make the parity checks run without transformers;
`test_live_*` repeat them against transformers itself where it is installed.
"""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.hf import load_hf, save_hf
from models.hf_config import CheckpointError
from models.sharding import flatten, make_mesh
from tests.conftest import FIXTURES

NAMES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def _reference(name):
    return dict(np.load(os.path.join(FIXTURES, name, "reference.npz")))


def _forward(graphdef, params, tokens, positions, valid):
    return nnx.merge(graphdef, params)(tokens, positions, valid)[0]


_forward_jit = jax.jit(_forward, static_argnums=0)


def _our_logits(graphdef, params, ref):
    out = _forward_jit(
        graphdef,
        params,
        jnp.asarray(ref["input_ids"]),
        jnp.asarray(ref["position_ids"]),
        jnp.asarray(ref["attention_mask"].astype(bool)),
    )
    return np.asarray(out)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_recorded_hf(name, mesh):
    cfg, graphdef, params, _ = load_hf(os.path.join(FIXTURES, name), mesh)
    ref = _reference(name)
    valid = ref["attention_mask"].astype(bool)
    ours = _our_logits(graphdef, params, ref)
    assert np.abs(ours[valid] - ref["logits"][valid]).max() < 1e-4


def _greedy(graphdef, params, ref, steps):
    """Greedy decoding by full recomputation over a fixed, left-padded buffer (no KV cache)."""
    ids, mask = ref["input_ids"], ref["attention_mask"].astype(bool)
    b, t = ids.shape
    tokens = np.concatenate([ids, np.zeros((b, steps), np.int32)], axis=1)
    valid = np.concatenate([mask, np.zeros((b, steps), bool)], axis=1)
    out = []
    for i in range(steps):
        positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
        logits = _forward_jit(graphdef, params, tokens, positions, valid)
        nxt = np.asarray(jnp.argmax(logits[:, t + i - 1], axis=-1)).astype(np.int32)
        tokens[:, t + i], valid[:, t + i] = nxt, True
        out.append(nxt)
    return np.stack(out, axis=1)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_recorded_hf(name, mesh):
    _, graphdef, params, _ = load_hf(os.path.join(FIXTURES, name), mesh)
    ref = _reference(name)
    np.testing.assert_array_equal(
        _greedy(graphdef, params, ref, ref["greedy"].shape[1]), ref["greedy"]
    )


def test_generation_ids_from_generation_config(mesh):
    *_, ids = load_hf(os.path.join(FIXTURES, "llama"), mesh)
    assert ids.eos_ids == (2, 3) and ids.pad_id == 0 and ids.bos_id == 1


@pytest.mark.parametrize("name", NAMES)
def test_export_import_is_bitwise_identity(name, mesh, tmp_path):
    cfg, _, params, ids = load_hf(os.path.join(FIXTURES, name), mesh)
    save_hf(str(tmp_path), cfg, params, ids, max_shard_bytes=200_000)  # force a sharded export
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    cfg2, _, params2, ids2 = load_hf(str(tmp_path), mesh)
    assert cfg2 == cfg and ids2 == ids
    a, b = flatten(params), flatten(params2)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].sharding == a[k].sharding, k
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_export_in_bfloat16(mesh, tmp_path):
    cfg, _, params, ids = load_hf(os.path.join(FIXTURES, "qwen3"), mesh)
    save_hf(str(tmp_path), cfg, params, ids, dtype="bfloat16")
    assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
    _, _, params2, _ = load_hf(str(tmp_path), mesh)
    a, b = flatten(params), flatten(params2)
    for k in a:
        assert b[k].dtype == jnp.float32  # converted to the param dtype on import
        np.testing.assert_allclose(np.asarray(b[k]), np.asarray(a[k]), rtol=2**-8, atol=0)


# --- broken inputs: one clear error naming the field, tensor or file -----------------------------


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def test_unknown_architecture(mesh, tmp_path):
    d = _copy("qwen3", tmp_path)
    cfg = json.load(open(d / "config.json"))
    cfg["architectures"] = ["MistralForCausalLM"]
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(
        CheckpointError, match=r"config.json: architectures=\['MistralForCausalLM'\]"
    ):
        load_hf(str(d), mesh)


def _rewrite(path, fn):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor(mesh, tmp_path):
    d = _copy("qwen3", tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"
    ):
        load_hf(str(d), mesh)


@pytest.mark.parametrize(
    "name, extra, refused",
    [
        # a part of a block the model would leave out: refused, named
        ("qwen3", "model.layers.1.mlp.shared_expert.gate_proj.weight", True),
        ("qwen3", "model.layers.0.self_attn.q_proj.bias", True),  # a bias config.json omits
        ("qwen2", "model.norm.bias", True),
        # not computed by the model: read past
        ("qwen3", "model.layers.0.self_attn.rotary_emb.inv_freq", False),
        ("qwen3", "model.layers.7.mlp.up_proj.weight", False),  # past num_hidden_layers
        ("qwen2", "mtp.head.weight", False),
    ],
)
def test_a_tensor_the_model_would_not_read(mesh, tmp_path, name, extra, refused):
    d = _copy(name, tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.update({extra: np.ones(4, np.float32)}))
    if refused:
        with pytest.raises(
            CheckpointError, match=rf"tensor '{re.escape(extra)}' is not a weight of"
        ):
            load_hf(str(d), mesh)
    else:
        assert load_hf(str(d), mesh)[0].family == name


def test_wrong_shape(mesh, tmp_path):
    d = _copy("qwen2", tmp_path)

    def cut(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][
            :-1
        ]

    _rewrite(d / "model.safetensors", cut)
    with pytest.raises(
        CheckpointError,
        match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(63, 64\), expected \(64, 64\)",
    ):
        load_hf(str(d), mesh)


def test_truncated_file(mesh, tmp_path):
    d = _copy("llama", tmp_path)
    path = d / "model-00002-of-00002.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: .*truncated"):
        load_hf(str(d), mesh)


def test_missing_config_field(mesh, tmp_path):
    d = _copy("qwen2", tmp_path)
    cfg = json.load(open(d / "config.json"))
    del cfg["hidden_size"]
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"config.json: missing field 'hidden_size'"):
        load_hf(str(d), mesh)


# --- live cross-checks against transformers ------------------------------------------------------


def _hf_logits(model_dir, ref):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ref["input_ids"]).long(),
            attention_mask=torch.from_numpy(ref["attention_mask"]).long(),
            position_ids=torch.from_numpy(ref["position_ids"]).long(),
        )
    return out.logits.float().numpy()


@pytest.mark.hf  # transformers / torch / peft: CI's second pass (.ci/run)
@pytest.mark.parametrize("name", NAMES)
def test_live_hf_parity_and_export_loads_in_transformers(name, mesh, tmp_path):
    pytest.importorskip("transformers")
    ref = _reference(name)
    valid = ref["attention_mask"].astype(bool)
    cfg, graphdef, params, ids = load_hf(os.path.join(FIXTURES, name), mesh)
    ours = _our_logits(graphdef, params, ref)
    live = _hf_logits(os.path.join(FIXTURES, name), ref)
    assert np.abs(ours[valid] - live[valid]).max() < 1e-4
    save_hf(str(tmp_path), cfg, params, ids)
    exported = _hf_logits(str(tmp_path), ref)
    np.testing.assert_array_equal(exported[valid], live[valid])


def test_bfloat16_compute_keeps_float32_master_weights(mesh):
    cfg, graphdef, params, _ = load_hf(os.path.join(FIXTURES, "qwen3"), mesh, dtype="bfloat16")
    assert cfg.dtype == "bfloat16"
    assert all(x.dtype == jnp.float32 for x in flatten(params).values())
    ref = _reference("qwen3")
    valid = ref["attention_mask"].astype(bool)
    ours = _our_logits(graphdef, params, ref)
    err = np.abs(ours[valid] - ref["logits"][valid]).max()
    assert 1e-4 < err < 0.1, err  # really computed in bf16, and still close
