"""Training: loss goes down, distillation raises acceptance, resume is exact, export loads
in transformers, and the losses mean what they claim."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tr

import specjax
from specjax.config import ModelConfig
from specjax.models import init
from specjax.train import TrainConfig, train
from specjax.train import losses

V = 64


def _config(hidden=32, layers=2):
    return ModelConfig(model_type="llama", vocab_size=V, hidden_size=hidden, num_layers=layers,
                       num_heads=2, num_kv_heads=1, head_dim=hidden // 2, intermediate_size=2 * hidden,
                       max_position_embeddings=128, norm_eps=1e-5, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def stream():
    """A Markov chain over V tokens with a few likely successors each: learnable structure."""
    rng = np.random.RandomState(0)
    successors = rng.randint(0, V, (V, 3))
    out = [0]
    for _ in range(20000):
        out.append(successors[out[-1], rng.randint(3)] if rng.rand() < 0.9 else rng.randint(V))
    return np.array(out, np.int32)


CFG = TrainConfig(steps=40, batch=8, seq_len=32, lr=3e-3, warmup=5, eval_every=20,
                  eval_batches=2, checkpoint_every=20)


def test_training_lowers_the_loss(stream, tmp_path):
    model = init(_config(), jax.random.key(0), jnp.float32)
    _, first = train(model, stream, stream[-3000:], TrainConfig(**{**CFG.__dict__, "steps": 1}),
                     tmp_path / "a", progress=False, log=lambda s: None)
    _, last = train(model, stream, stream[-3000:], CFG, tmp_path / "b", progress=False, log=lambda s: None)
    assert last["loss"] < first["loss"] - 0.5, (first, last)


def test_resume_gives_the_same_params(stream, tmp_path, monkeypatch):
    """A run killed after 20 of 40 steps, started again, ends where an unbroken run ends."""
    from specjax.train import loop

    model = init(_config(), jax.random.key(1), jnp.float32)
    quiet = dict(progress=False, log=lambda s: None)
    straight, _ = train(model, stream, stream[-3000:], CFG, tmp_path / "straight", **quiet)

    real = loop.batch_at

    def crash_at_20(stream, step, *args):
        if step == 20:
            raise KeyboardInterrupt
        return real(stream, step, *args)

    monkeypatch.setattr(loop, "batch_at", crash_at_20)
    with pytest.raises(KeyboardInterrupt):
        train(model, stream, stream[-3000:], CFG, tmp_path / "resumed", **quiet)
    monkeypatch.undo()
    logs = []
    resumed, _ = train(model, stream, stream[-3000:], CFG, tmp_path / "resumed", progress=False,
                       log=logs.append)
    assert any("resumed from step 20" in line for line in logs)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 straight.params, resumed.params)


@pytest.mark.slow
def test_distillation_raises_acceptance(stream, tmp_path):
    teacher, _ = train(init(_config(hidden=48), jax.random.key(2), jnp.float32), stream,
                       stream[-3000:], CFG, tmp_path / "teacher", progress=False, log=lambda s: None)
    draft = init(_config(hidden=16, layers=1), jax.random.key(3), jnp.float32)
    # The draft before training, for both losses: one step, whose learning rate (the warmup's
    # first) is 0, and the metrics do not depend on the loss.
    _, before = train(draft, stream, stream[-3000:], TrainConfig(**{**CFG.__dict__, "steps": 1}),
                      tmp_path / "before", teacher=teacher, progress=False, log=lambda s: None)
    for loss in ("kl", "tv"):
        cfg = TrainConfig(**{**CFG.__dict__, "loss": loss})
        _, after = train(draft, stream, stream[-3000:], cfg, tmp_path / loss, teacher=teacher,
                         progress=False, log=lambda s: None)
        assert after["alpha"] > before["alpha"] + 0.05, (loss, before, after)
        if loss == "kl":  # TV minimises 1 - alpha itself; greedy agreement follows it only in time
            assert after["greedy_alpha"] > before["greedy_alpha"] + 0.05, (loss, before, after)
            assert after["greedy_tokens_per_pass"][4] > before["greedy_tokens_per_pass"][4]


def test_losses_mean_what_they_say():
    rng = np.random.RandomState(0)
    q, p = jnp.asarray(rng.randn(2, 3, 10)), jnp.asarray(rng.randn(2, 3, 10))
    targets = jnp.zeros((2, 3), jnp.int32)
    tv = losses.distill_loss(q, p, targets, "tv")
    alpha = losses.acceptance_metrics(q, p)["alpha"]
    assert abs(float(tv) - (1 - float(alpha))) < 1e-5  # acceptance = 1 - TV(p, q)
    assert float(losses.distill_loss(p, p, targets, "kl")) == pytest.approx(0.0, abs=1e-6)
    assert float(losses.distill_loss(q, p, targets, "kl")) > 0
    with pytest.raises(ValueError, match="distillation loss"):
        losses.distill_loss(q, p, targets, "js")


def test_export_loads_in_transformers(stream, tmp_path):
    from specjax.cli import main

    model = init(_config(), jax.random.key(4), jnp.float32)
    train(model, stream, stream[-3000:], TrainConfig(**{**CFG.__dict__, "steps": 5}), tmp_path / "run",
          progress=False, log=lambda s: None)
    main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "float32"])
    ours = specjax.load_model(tmp_path / "hf")
    theirs = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = stream[:24][None]
    with torch.no_grad():
        ref = theirs(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(specjax.forward(ours, tokens)), ref, atol=1e-4)


def test_a_run_of_the_stacked_layout_exports_converted_and_refuses_to_resume(stream, tmp_path):
    """tests/data/legacy_run was written by specjax at f58689a, when layers were stacked
    [L, ...] and q/k/v, gate/up separate (a GQA Llama with every bias), with the logits its
    model gave: today's export converts it to the same logits; resuming it is refused."""
    import shutil
    from pathlib import Path

    from specjax.train.loop import restore_model

    data = Path(__file__).parent / "data"
    run = shutil.copytree(data / "legacy_run", tmp_path / "run")
    model, record = restore_model(run)
    assert "layout" not in record and model.config.qkv_bias and model.config.num_kv_heads == 2
    tokens = np.random.RandomState(0).randint(0, 64, 5000).astype(np.int32)[:24][None]
    np.testing.assert_allclose(np.asarray(specjax.forward(model, tokens)), np.load(data / "legacy_run_logits.npy"),
                               atol=1e-5)
    with pytest.raises(ValueError, match="older specjax, whose params were laid out otherwise"):
        train(model, stream, stream[-3000:], CFG, run, progress=False, log=lambda s: None)


def test_a_run_of_layout_2_exports_converted_and_refuses_to_resume(stream, tmp_path):
    """tests/data/layout2_run was written by specjax at b1ec4b0 (one dict per layer, qkv_kernel
    [E, G, R+2, D] and gate_up_kernel [E, 2, F]; a GQA Llama with every bias, an untied head),
    with the logits its model gave: it restores into today's layout with the same logits;
    resuming it is refused (its optimizer state has the old shapes)."""
    import shutil
    from pathlib import Path

    from specjax.train.loop import restore_model

    data = Path(__file__).parent / "data"
    run = shutil.copytree(data / "layout2_run", tmp_path / "run")
    model, record = restore_model(run)
    assert record["layout"] == 2 and model.config.qkv_bias and model.config.num_kv_heads == 2
    c = model.config
    assert model.params["layers"][0]["attn"]["qkv_kernel"].shape == (2, 4, 8, 32)  # [G, R+2, D, E]
    assert model.params["layers"][0]["mlp"]["gate_up_kernel"].shape == (2, 32, c.intermediate_size)
    tokens = np.random.RandomState(0).randint(0, 64, 5000).astype(np.int32)[:24][None]
    np.testing.assert_allclose(np.asarray(specjax.forward(model, tokens)), np.load(data / "layout2_run_logits.npy"),
                               atol=1e-5)
    with pytest.raises(ValueError, match=r"laid out otherwise \(layout 2, today's is 3\)"):
        train(model, stream, stream[-3000:], CFG, run, progress=False, log=lambda s: None)


def test_a_damaged_latest_step_is_never_restored_silently(stream, tmp_path, capfd):
    """Bytes flipped in the array data of the latest step's files: restoring warns, names the
    step and falls back to the previous kept step, bit for bit; with every kept step damaged,
    one clear error. A file missing, cut short or replaced by a FIFO: the same, caught before
    orbax reads anything (its readers failing half-way printed dozens of asyncio tracebacks)."""
    import os
    import shutil

    from specjax.checkpoint import CheckpointManager, DamagedCheckpointError
    from specjax.train.loop import restore_model

    model = init(_config(), jax.random.key(5), jnp.float32)
    run = tmp_path / "run"
    train(model, stream, stream[-3000:], CFG, run, progress=False, log=lambda s: None)
    latest, _ = restore_model(run)
    manager = CheckpointManager(run / "checkpoints")
    assert manager._manager.all_steps() == [20, 40]
    abstract = jax.tree.map(np.zeros_like, manager.restore_saved(20))
    step20 = manager.restore(abstract, step=20)[0]["params"]
    manager.close()

    def damage(step):
        files = [f for f in (run / "checkpoints" / str(step) / "state").rglob("*") if f.is_file()]
        data = max(files, key=lambda f: f.stat().st_size)  # the array data
        raw = bytearray(data.read_bytes())
        for i in range(len(raw) // 3, len(raw) // 3 + 64):
            raw[i] ^= 0xFF
        data.write_bytes(bytes(raw))

    pristine = tmp_path / "pristine"
    shutil.copytree(run, pristine)
    files = sorted(f.relative_to(run) for f in (run / "checkpoints" / "40").rglob("*") if f.is_file())
    array_data = max(files, key=lambda f: (run / f).stat().st_size)
    for name, harm, message in (
            (array_data, lambda f: f.unlink(), "is missing"),
            (array_data, lambda f: f.write_bytes(f.read_bytes()[:100]), "has changed"),
            (array_data, lambda f: (f.unlink(), os.mkfifo(f)), "has changed"),
            (next(f for f in files if f.name == "_METADATA"), lambda f: f.write_text("{"), "has changed")):
        harm(run / name)
        with pytest.warns(UserWarning, match=f"checkpoint step 40 .* is damaged \\(its file .*{message}"):
            restored, record = restore_model(run)
        assert record["step"] == 20
        shutil.rmtree(run)
        shutil.copytree(pristine, run)
    assert "Traceback" not in capfd.readouterr().err
    # An attacker's edit that also removes both checksums (manifest and the record's) is
    # still refused: every step of today's layout is saved with its checksum.
    shutil.rmtree(run / "checkpoints.sha256")
    record_file = next((run / "checkpoints" / "40" / "record").rglob("*metadata*"))
    record_file.write_text(json.dumps({k: v for k, v in json.loads(record_file.read_text()).items() if k != "sha256"}))
    with pytest.warns(UserWarning, match="step 40 .* lacks the checksum"):
        assert restore_model(run)[1]["step"] == 20
    # orbax reads each step's metadata as it opens a run: a FIFO there is refused, not read
    shutil.rmtree(run)
    shutil.copytree(pristine, run)
    metadata = next((run / "checkpoints" / "40").glob("_CHECKPOINT_METADATA"))
    metadata.unlink()
    os.mkfifo(metadata)
    with pytest.raises(DamagedCheckpointError, match="_CHECKPOINT_METADATA in a run's checkpoints is not a regular"):
        restore_model(run)
    shutil.rmtree(run)
    shutil.copytree(pristine, run)

    damage(40)
    with pytest.warns(UserWarning, match=r"checkpoint step 40 .* is damaged"):
        restored, record = restore_model(run)
    assert record["step"] == 20
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored.params, step20)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(latest.params)))
    damage(20)
    with pytest.raises(DamagedCheckpointError, match="tried 40: .*; 20: "):
        restore_model(run)


def test_continuations_are_the_targets_own_text(stream):
    """`continuations` (distill --on-policy): training windows continued by the target,
    greedy and temperature-1 batches in turn, each ended by EOS; deterministic."""
    from specjax.train import continuations

    target = init(_config(), jax.random.key(4), jnp.float32)
    make = lambda: continuations.continuations(target, stream, 4, eos_id=0, prompt_len=6, new_tokens=5,  # noqa: E731
                                               batch=2, seed=7)
    generated = make()
    np.testing.assert_array_equal(generated, make())
    starts = np.random.default_rng(7).integers(0, len(stream) - 6, 4)
    at, greedy_steps = 0, 0
    for i, start in enumerate(starts):
        np.testing.assert_array_equal(generated[at: at + 6], stream[start: start + 6])  # the window
        new = generated[at + 6: at + 11]
        n = int(np.argmax(new == 0)) + 1 if (new == 0).any() else 5  # tokens written, EOS included
        sequence = generated[at: at + 6 + n]
        if i < 2:  # the first batch is greedy: each token is the target's argmax after the ones before
            logits = np.asarray(specjax.forward(target, sequence[None]))[0]
            np.testing.assert_array_equal(logits[5: 5 + n].argmax(-1), sequence[6: 6 + n])
            greedy_steps += n
        at += 6 + n + (0 if sequence[-1] == 0 else 1)  # an EOS appended after a full continuation
        assert generated[at - 1] == 0
    assert at == len(generated) and greedy_steps >= 2
    mixed = continuations.mixed(stream, generated, 2)
    assert len(mixed) == len(stream) + 2 * len(generated)
    np.testing.assert_array_equal(mixed[-len(generated):], generated)
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        continuations.continuations(target, stream, 0, eos_id=0)
    with pytest.raises(ValueError, match="repeat must be an int >= 0"):
        continuations.mixed(stream, generated, -1)
