"""Sharding on 8 emulated CPU devices (in a subprocess: the device count is fixed when jax
starts), plus the rules on their own. The default suite runs generate on the 2x4 mesh,
which splits rows and heads; -m slow adds the 1x8 and 8x1 meshes."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import specjax
from specjax import loop, sharding
from specjax.sampling import Sampling
from tests import children
from tests.axes_drafter import Tabled


def _check(meshes: str) -> dict:
    env = children.env(PYTHONPATH=str(Path(__file__).parent.parent))
    result = subprocess.run([sys.executable, str(Path(__file__).parent / "sharded_check.py"), meshes],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def findings(request):
    """sharded_check.py's findings, generate on the 2x4 mesh (rows and heads both split); the
    slow run's, which hold 2x4's too, where that runs (one subprocess, not two)."""
    slow = any(getattr(item, "callspec", None) and item.callspec.params.get("mesh") in ("1x8", "8x1")
               for item in request.session.items if item.path == request.path)
    return request.getfixturevalue("every_mesh") if slow else _check("2x4")


@pytest.fixture(scope="module")
def every_mesh():
    """Its findings with generate on the 1x8, 2x4 and 8x1 meshes (minutes: -m slow)."""
    return _check("1x8,2x4,8x1")


def _on(request, mesh: str) -> dict:
    """The findings of generate on `mesh`: the default suite's for 2x4, the slow run's else."""
    return request.getfixturevalue("findings" if mesh == "2x4" else "every_mesh")["meshes"][mesh]


MESHES = [pytest.param("1x8", marks=pytest.mark.slow), "2x4", pytest.param("8x1", marks=pytest.mark.slow)]


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_generate_equals_single_device(findings, request, mesh):
    assert findings["single_accepted"] > 0  # both the accept and the reject paths ran
    assert _on(request, mesh)["equal"]


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


def test_a_paged_engine_on_a_mesh_equals_single_device(findings):
    """Pages on the 2x4 mesh: the target's and the draft model's pools split over model, the
    page table's rows over data; every request's output is single-device generate's alone,
    and every page is back when the engine is idle."""
    m = findings["engine"]["paged"]
    assert m["equal"] and m["free_pages"] == 10, m
    assert all("model" in spec and "data" not in spec for spec in m["pool_spec"]), m
    assert m["table_spec"] == "P('data',)", m


def test_a_drafter_state_on_a_mesh_follows_its_declared_axes(findings):
    """The engine on the 2x4 mesh with a drafter whose shared table's first dimension equals
    the slots (4): the table lies whole on every device (a guess from its shape split it
    over data), its rows-on-axis-1 array splits there, narrow runs and inserts leave the
    table whole (it still holds the 4 slots' prefill's values), and the output is exact."""
    m = findings["engine"]["declared"]
    assert m["equal"], m
    assert "data" not in m["table_spec"] and m["table_whole"], m
    assert m["seen_spec"] == [None, "data"], m
    assert m["table"][0] == [4000, 4001, 4002], m


@pytest.mark.parametrize("mesh, most", [pytest.param("1x8", 0.2, marks=pytest.mark.slow), ("2x4", 0.5)])
def test_weights_are_split(request, mesh, most):
    """Heads (6, 2) and vocab (389) divide no model axis: the fallbacks still split them."""
    assert _on(request, mesh)["max_device_fraction"] <= most


@pytest.mark.parametrize("mesh", MESHES)
def test_no_whole_weight_is_gathered_and_the_cache_is_sharded(findings, request, mesh):
    assert findings["detector_works"], "the all-gather detector misses a known whole-weight gather"
    m = _on(request, mesh)
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


@pytest.mark.parametrize("mesh, low, high", [pytest.param("1x8", 1.0, 1.0, marks=pytest.mark.slow), ("2x4", 1.9, 2.0),
                                             pytest.param("8x1", 1.0, 1.0, marks=pytest.mark.slow)])
def test_load_reads_only_each_devices_slices(request, mesh, low, high):
    """load_model(mesh=...) copies out of the files only the slices devices hold, each
    distinct slice once: every element once when the rules split everything over 8 devices
    (not 8 whole copies), twice over two data replicas of model-split weights (the
    replicated norms once). Read piece by piece, it loads the same parameters; every
    device's shard is exactly its own slice."""
    m = _on(request, mesh)
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


# A tiny target for the tests of declared axes: its shapes alone, or a prefill of a few rows.
TINY = specjax.ModelConfig(model_type="llama", vocab_size=53, hidden_size=16, num_layers=1, num_heads=2,
                           num_kv_heads=2, head_dim=8, intermediate_size=32, max_position_embeddings=64,
                           norm_eps=1e-5, tie_word_embeddings=False)


def _rows(drafter, B, seed=0):
    """A SlotState of B rows for `drafter` (prefilled with tiny random prompts)."""
    target = specjax.models.init(TINY, jax.random.key(0), jnp.float32)
    prompts = jnp.asarray(np.random.RandomState(seed).randint(1, 53, (B, 5)), jnp.int32)
    return jax.jit(lambda: loop.prefill(  # (one program, not op by op)
        target, drafter.resolve(2), prompts, jnp.full((B,), 5, jnp.int32), cache_len=16,
        limit=jnp.full((B,), 12, jnp.int32), sampling=Sampling.make(batch=B), stop_ids=jnp.full((B, 1), -1, jnp.int32),
        key=loop.row_keys(jax.random.key(1), B)))()


def test_a_drafter_state_is_laid_out_by_its_declared_axes_not_its_shape():
    """The table's first dimension equals B (4) but is no row axis: it is not split over
    data (a guess from shapes split it); `seen` [2, B] has its rows on axis 1, split there;
    the loop's own fields and caches keep rows over data."""
    drafter = Tabled(table_rows=4).resolve(2)
    state = jax.eval_shape(lambda: _rows(drafter, 4))
    mesh = sharding.make_mesh(devices=jax.devices()[:1])  # data=1: a split still shows in the spec
    placed = loop.state_shardings(state, drafter, mesh, sharding.DEFAULT_RULES)
    P = jax.sharding.PartitionSpec
    assert placed.draft_state.table.spec == P(None, None)
    assert placed.draft_state.seen.spec == P(None, "data")
    assert placed.tokens.spec == P("data", None) and placed.target_cache.k[0].spec[0] == "data"
    placed_shapes = sharding.place_carry(state.draft_state, drafter.state_axes(state.draft_state), mesh,
                                         sharding.DEFAULT_RULES)
    assert placed_shapes.table.sharding.spec == P(None, None)


def test_insert_writes_each_array_on_its_declared_row_axis():
    """A row goes into slot 2: `seen` [2, B] in its column 2; the shared table keeps the
    state's (1000 B + ids: the row's, prefilled alone, says 1000); the loop's fields in row 2."""
    drafter = Tabled(table_rows=4).resolve(2)
    state, row = _rows(drafter, 4), _rows(drafter, 1, seed=1)
    state = state.replace(draft_state=state.draft_state.replace(seen=jnp.arange(8).reshape(2, 4)))
    row = row.replace(draft_state=row.draft_state.replace(seen=jnp.array([[70], [71]])))
    out = jax.jit(lambda s, r: loop.insert(s, jnp.int32(2), r, drafter))(state, row)
    np.testing.assert_array_equal(out.draft_state.seen, [[0, 1, 70, 3], [4, 5, 71, 7]])
    np.testing.assert_array_equal(out.draft_state.table, state.draft_state.table)
    assert int(out.draft_state.table[0, 0]) == 4000
    np.testing.assert_array_equal(out.tokens[2], row.tokens[0])
    np.testing.assert_array_equal(out.target_cache.k[0][2], row.target_cache.k[0][0])


def test_a_drafters_axes_that_do_not_fit_its_state_are_refused_by_name():
    @struct.dataclass
    class Undeclared:
        seen: jax.Array

    @struct.dataclass
    class Partly:
        seen: jax.Array
        extra: jax.Array

        AXES = {"seen": ("batch",)}

    @struct.dataclass
    class WrongRank:
        seen: jax.Array

        AXES = {"seen": ("batch",)}

    class Own(Tabled):
        pass

    for state, error, match in [
        (Undeclared(jnp.zeros(3)), TypeError, r"Own's state \(Undeclared\) declares no logical axes"),
        (Partly(jnp.zeros(3), jnp.zeros(3)), ValueError, r"Own's state \(Partly\).*no axes for its field\(s\) extra"),
        (WrongRank(jnp.zeros((3, 2))), ValueError, r"Own's state \(WrongRank\)\.seen: declared axes "
                                                  r"Axes\('batch',\) for an array of 2 dims \(3, 2\)"),
    ]:
        with pytest.raises(error, match=match):
            drafter = Own()
            sharding.check_axes(state, drafter.state_axes(state), "Own's state")

    class Overridden(Tabled):
        def state_axes(self, state):
            return {"table": sharding.Axes(None, None)}  # not the state's structure

    with pytest.raises(ValueError, match=r"Overridden's state \(TableState\): its declared axes do not match"):
        loop.state_axes(_rows(Tabled(), 2), Overridden())

    class Wrong(Tabled):
        def start(self, *args, **kwargs):
            state = super().start(*args, **kwargs)
            return state.replace(seen=state.seen[0])  # [B], declared (None, "batch")

    with pytest.raises(ValueError, match=r"Wrong's state \(TableState\)\.seen: declared axes"):
        _rows(Wrong(), 2)  # prefill checks, mesh or none
