"""LoRA adapters (models/lora.py) on the HF fixtures: the adapted forward against the folded
weights, adapters off against the plain model on the same arrays, and both exports against
transformers (merged) and peft (adapter directory)."""

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

from models import lora
from models.hf import load_hf, save_adapter, save_hf
from models.hf_config import config_from_hf
from models.sharding import base_graphdef, flatten, make_mesh
from tests.conftest import FIXTURES
from tests.models.test_hf import NAMES, _hf_logits, _our_logits, _reference

# qwen3 (grouped KV heads, heads x head_dim != d_model) in the fast tier, the others in the full suite.
FAMILIES = [pytest.param(n, marks=() if n == "qwen3" else pytest.mark.slow) for n in NAMES]

LORA = dict(lora_rank=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def _randomised(params, seed=0):
    """Adapters with non-zero B (a fresh B is zero, which would test nothing)."""
    adapters, base = lora.split(params)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge_state(jax.tree.unflatten(treedef, new), base)


def _lora_model(name, mesh, targets=lora.TARGETS):
    cfg, graphdef, params, ids = load_hf(
        os.path.join(FIXTURES, name), mesh, lora_targets=tuple(targets), **LORA
    )
    return cfg, graphdef, _randomised(params), ids


@pytest.mark.parametrize("name", FAMILIES)
def test_adapted_forward_is_the_folded_weights_and_adapters_off_is_the_base(name, mesh):
    ref = _reference(name)
    valid = ref["attention_mask"].astype(bool)
    cfg, graphdef, params, _ = _lora_model(name, mesh)
    adapted = _our_logits(graphdef, params, ref)
    # Independent: the plain model on W + (alpha / r) A B, folded on the host in float64.
    folded = _our_logits(base_graphdef(cfg), lora.merge(cfg, params), ref)
    np.testing.assert_allclose(adapted[valid], folded[valid], atol=1e-5, rtol=0)
    plain_cfg, plain_graphdef, plain, _ = load_hf(os.path.join(FIXTURES, name), mesh)
    assert plain_cfg == lora.base_config(cfg)
    # Adapters off: the very same base arrays in the plain model's graph, bitwise.
    base = lora.base(params)
    ids = {id(x) for x in jax.tree.leaves(params)}
    assert all(id(x) in ids for x in jax.tree.leaves(base))  # the policy's own arrays, no copy
    off = _our_logits(base_graphdef(cfg), base, ref)
    np.testing.assert_array_equal(off, _our_logits(plain_graphdef, plain, ref))
    assert np.abs(adapted[valid] - off[valid]).max() > 1e-3  # the adapters do something


def test_fresh_adapters_change_nothing_and_are_sharded(mesh):
    cfg, graphdef, params, _ = load_hf(os.path.join(FIXTURES, "qwen2"), mesh, **LORA)
    adapters = flatten(lora.split(params)[0])
    assert len(adapters) == 2 * len(lora.TARGETS) * cfg.num_layers
    assert all(not np.any(np.asarray(x)) for k, x in adapters.items() if k.endswith("lora_b"))
    ref = _reference("qwen2")
    valid = ref["attention_mask"].astype(bool)
    np.testing.assert_allclose(_our_logits(graphdef, params, ref)[valid],
                               ref["logits"][valid], atol=1e-4)  # fmt: skip
    a = adapters["blocks.0.attn.q_lora.lora_a"]  # [D, r]: D over fsdp, as the weight's D
    assert a.sharding.spec[0] == "fsdp"


@pytest.mark.hf  # transformers / torch / peft: CI's second pass (.ci/run)
@pytest.mark.parametrize("name", FAMILIES)
def test_merged_export_loads_in_transformers(name, mesh, tmp_path):
    pytest.importorskip("transformers")
    ref = _reference(name)
    valid = ref["attention_mask"].astype(bool)
    cfg, graphdef, params, ids = _lora_model(name, mesh, targets=("q", "v", "o", "down"))
    save_hf(str(tmp_path), cfg, params, ids)
    ours = _our_logits(graphdef, params, ref)
    assert np.abs(ours[valid] - _hf_logits(str(tmp_path), ref)[valid]).max() < 1e-4


@pytest.mark.hf  # transformers / torch / peft: CI's second pass (.ci/run)
@pytest.mark.parametrize("name", ["qwen2", pytest.param("llama", marks=pytest.mark.slow)])
def test_adapter_export_loads_through_peft(name, mesh, tmp_path):
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = _reference(name)
    valid = ref["attention_mask"].astype(bool)
    cfg, graphdef, params, _ = _lora_model(name, mesh)
    base_dir = os.path.join(FIXTURES, name)
    save_adapter(str(tmp_path), cfg, params, base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    with torch.no_grad():
        live = (
            model(
                input_ids=torch.from_numpy(ref["input_ids"]).long(),
                attention_mask=torch.from_numpy(ref["attention_mask"]).long(),
                position_ids=torch.from_numpy(ref["position_ids"]).long(),
            )
            .logits.float()
            .numpy()
        )
    ours = _our_logits(graphdef, params, ref)
    assert np.abs(ours[valid] - live[valid]).max() < 1e-4


def test_rank_must_be_non_negative():
    cfg = config_from_hf(os.path.join(FIXTURES, "qwen2"))
    with pytest.raises(ValueError, match="lora_rank=-1"):
        dataclasses.replace(cfg, lora_rank=-1)
