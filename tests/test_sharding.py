"""Sharding on 8 emulated CPU devices (in a subprocess: the device count is fixed when jax
starts), plus the rules on their own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from specjax import sharding
from tests import children


@pytest.fixture(scope="module")
def findings():
    env = children.env(PYTHONPATH=str(Path(__file__).parent.parent))
    result = subprocess.run([sys.executable, str(Path(__file__).parent / "sharded_check.py")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", ["1x8", "2x4", "8x1"])
def test_sharded_generate_equals_single_device(findings, mesh):
    assert findings["single_accepted"] > 0  # both the accept and the reject paths ran
    assert findings["meshes"][mesh]["equal"]


def test_a_sharded_tree_equals_single_device(findings):
    """A token tree on the 2x4 mesh; greedy, also the chain's output."""
    assert findings["tree_equal"]


def test_the_engine_on_a_mesh_equals_single_device(findings):
    """Slots over data, the cache's heads over model (the target's rules), K changing with the
    live rows: each request's output is single-device generate's on it alone."""
    m = findings["engine"]
    assert m["equal"], m
    assert len(m["steps_by_K"]) >= 2, m  # K changed
    assert "data" in m["tokens_spec"] and "model" in m["cache_spec"], m


@pytest.mark.parametrize("mesh, most", [("1x8", 0.2), ("2x4", 0.5)])
def test_weights_are_split(findings, mesh, most):
    """Heads (6, 2) and vocab (389) divide no model axis: the fallbacks still split them."""
    assert findings["meshes"][mesh]["max_device_fraction"] <= most


@pytest.mark.parametrize("mesh", ["1x8", "2x4", "8x1"])
def test_no_whole_weight_is_gathered_and_the_cache_is_sharded(findings, mesh):
    assert findings["detector_works"], "the all-gather detector misses a known whole-weight gather"
    m = findings["meshes"][mesh]
    assert m["whole_weight_gathers"] == []
    assert not m["whole_cache_in_program"]


def test_fewer_kv_heads_than_the_model_axis_are_duplicated(findings):
    """2 kv heads on a model axis of 4: two copies of each, output equal to one device's, and
    no floating-point collective of the compiled loop carries a cache-length dimension
    (neither attention scores nor keys/values); the old head_dim split does have them."""
    m = findings["kv_heads"]
    assert m["duplicated"]["kv_heads"] == 4 and m["head_dim_split"]["kv_heads"] == 2
    assert m["duplicated"]["equal"] and m["duplicated"]["accepted"] > 0
    assert m["head_dim_split"]["attention_collectives"], "the detector misses the head_dim split's collectives"
    assert m["duplicated"]["attention_collectives"] == []


def test_a_replicated_draft_keeps_a_replicated_cache(findings):
    """A draft replicated by its own rules keeps its cache whole on each device of a row
    group (rows still over data), while the target's is split by (duplicated) kv heads."""
    m = findings["kv_heads"]
    assert m["draft_rules"] == [["batch", "data"]]
    assert m["duplicated"]["draft_cache_whole_per_row_group"]
    assert m["duplicated"]["target_cache_split_by_heads"]


def test_int8_scales_shard_with_their_weights(findings):
    m = findings["int8"]
    assert m["num_int8"] == 4 * 2 + 2  # qkv o gate_up down in each of 2 layers, embedding, lm_head
    # Split scales: qkv's and gate_up's in each layer (split along their outputs); o, down, the
    # embedding and the head are split along axes that they contract, where a scale has size 1.
    assert m["scales_follow_weights"] and m["scales_split"] == 2 * 2
    assert m["equal"] and m["whole_weight_gathers"] == []


@pytest.mark.parametrize("mesh, low, high", [("1x8", 1.0, 1.0), ("2x4", 1.9, 2.0), ("8x1", 1.0, 1.0)])
def test_load_reads_only_each_devices_slices(findings, mesh, low, high):
    """load_model(mesh=...) copies out of the files only the slices devices hold, each
    distinct slice once: every element once when the rules split everything over 8 devices
    (not 8 whole copies), twice over two data replicas of model-split weights (the
    replicated norms once). Read piece by piece, it loads the same parameters; every
    device's shard is exactly its own slice."""
    m = findings["meshes"][mesh]
    assert low <= m["read_fraction"] <= high, m["read_fraction"]
    assert m["pieces_equal"] and m["shards_match"]


def test_rules_replicate_what_does_not_divide():
    class FakeMesh:  # spec() reads only .shape
        shape = {"data": 2, "model": 4}

    P = jax.sharding.PartitionSpec
    assert sharding.spec((389, 64), ("vocab", "embed"), FakeMesh) == P(None, "model")
    assert sharding.spec((64, 8, 16), ("embed", "heads", "head_dim"), FakeMesh) == P(None, "model", None)
    assert sharding.spec((64, 6, 16), ("embed", "heads", "head_dim"), FakeMesh) == P(None, None, "model")
    assert sharding.spec((6, 64), ("batch", "embed"), FakeMesh) == P("data", None)
    assert sharding.spec((5, 64), ("batch", "embed"), FakeMesh) == P(None, None)
    custom = (("batch", "data"), ("mlp", "data"))
    assert sharding.spec((64, 128), ("embed", "mlp"), FakeMesh, custom) == P(None, "data")
    with pytest.raises(ValueError, match="logical axes"):
        sharding.spec((3, 4), ("embed",), FakeMesh)


def test_make_mesh_checks_the_device_count():
    with pytest.raises(ValueError, match="needs 6 devices"):
        sharding.make_mesh(data=3, model=2, devices=jax.devices()[:1])


def test_a_weight_that_does_not_divide_warns_once_for_all_layers_naming_its_fallback():
    class FakeMesh:
        shape = {"data": 2, "model": 4}

    P = jax.sharding.PartitionSpec
    sharding._warned.clear()
    with pytest.warns(UserWarning, match=r"layers/\*/attn/qkv_kernel .*kv_heads dimension \(6\).*model axis \(4\); "
                                         r"split over its head_dim dimension instead"):
        sharding._warn_fallback("layers/0/attn/qkv_kernel", (64, 6, 3, 16), ("embed", "kv_heads", "qkv", "head_dim"),
                                P(None, None, None, "model"), FakeMesh, sharding.DEFAULT_RULES)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time, and for every other layer: silent
        for layer in (0, 1, 17):
            sharding._warn_fallback(f"layers/{layer}/attn/qkv_kernel", (64, 6, 3, 16),
                                    ("embed", "kv_heads", "qkv", "head_dim"), P(None, None, None, "model"), FakeMesh,
                                    sharding.DEFAULT_RULES)


def test_a_batch_that_does_not_divide_data_is_refused():
    class FakeMesh:
        shape = {"data": 2, "model": 4}

    with pytest.raises(ValueError, match=r"batch of 3 rows does not divide the mesh's data axis \(2"):
        sharding.place_rows([[1], [2], [3]], FakeMesh)


def test_the_prefix_kernel_runs_under_shard_map_on_a_mesh(findings):
    """A sharded program keeps the Pallas prefix kernel: under shard_map, each device on its
    own rows and kv heads (the TPU's and the GPU's, interpreted), equal to the portable path;
    a model without rules attends portably."""
    for case, m in findings["prefix_kernel"].items():
        assert m["under_shard_map"] and m["without_rules_portable"], case
        assert m["error"] < 1e-5, (case, m)
