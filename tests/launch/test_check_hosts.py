"""launch.build.check_hosts: what a multi-process run refuses at start-up, in one line (faked
here with jax.process_count returning 2; the runs themselves are tests/launch/test_hosts.py)."""

import jax
import pytest

from launch.build import check_hosts
from models.sharding import DEFAULT_RULES, make_mesh


@pytest.fixture
def two_processes(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)


def test_one_process_is_never_refused():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    check_hosts(mesh, DEFAULT_RULES, kv_heads=1, weights_layout="tensor")


def test_cpu_decodes_from_the_training_layout(two_processes):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    check_hosts(mesh, DEFAULT_RULES, kv_heads=2, weights_layout="training")
    with pytest.raises(ValueError, match=r"weights_layout='tensor'.*weights_layout=training"):
        check_hosts(mesh, DEFAULT_RULES, kv_heads=2, weights_layout="tensor")


def test_kv_heads_split_over_a_batch_axis_are_refused(two_processes):
    rules = tuple((n, ("fsdp", "tensor") if n == "kv_heads" else t) for n, t in DEFAULT_RULES)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with pytest.raises(ValueError, match=r"KV heads are split over \['fsdp'\]"):
        check_hosts(mesh, rules, kv_heads=4, weights_layout="training")
