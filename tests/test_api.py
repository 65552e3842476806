"""The public Python API (``import etgraph``): what it exports, and elastic training driven by a
program — data in memory, no run directory, callbacks, a period / an epoch / a step at a time,
weights in and out."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import etgraph
from etgraph.images import digits_images, load_digits_arrays


def test_every_public_name_resolves_and_the_package_is_typed():
    for name in etgraph.__all__:
        assert getattr(etgraph, name) is not None, name
    assert (Path(etgraph.__file__).parent / "py.typed").is_file()
    with pytest.raises(AttributeError):
        etgraph.no_such_name  # noqa: B018


def test_import_etgraph_stays_light():
    """``import etgraph`` and the CLI's module load no ONNX Runtime, torch or onnx_ir (whose
    sympy import alone took ~1 s): ``etgraph --help`` and usage errors stay fast."""
    import subprocess
    import sys

    heavy = ("onnxruntime", "torch", "onnx_ir")
    for module in ("etgraph", "etgraph.cli"):
        code = f"import sys, {module}; print(*(m in sys.modules for m in {heavy!r}))"
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert done.stdout.split() == ["False", "False", "False"], module
    # a mistyped run directory is refused before the run's modules are imported (was 4-15 s)
    code = (
        "import sys; from etgraph.entry import main; sys.argv = ['etgraph', 'train', "
        "'--resume', '/nowhere/run']\ntry: main()\nexcept SystemExit: pass\n"
        f"print(*(m in sys.modules for m in {heavy!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "not a run directory" in done.stderr
    assert done.stdout.split() == ["False", "False", "False"], done.stderr


def digits_arrays(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` digits of classes 5-9 (labels 0-4) as float32 ``[n, 3, 32, 32]`` in memory."""
    images, labels = load_digits_arrays()
    keep = np.flatnonzero(labels >= 5)[:n]
    x = digits_images(images[keep], (32, 32))
    x = (x - x.mean()) / x.std()
    return np.repeat(x[:, None], 3, axis=1).astype(np.float32), labels[keep] - 5


class Recorder(etgraph.Callback):
    def __init__(self):
        self.events = []

    def on_fit_start(self, trainer):
        self.events.append(("fit_start",))

    def on_period_start(self, trainer, info):
        self.events.append(("period_start", info.period, tuple(info.selected)))

    def on_epoch_end(self, trainer, record):
        self.events.append(("epoch_end", record["epoch"], record["val_acc"]))

    def on_period_end(self, trainer, info):
        self.events.append(("period_end", info.period))

    def on_fit_end(self, trainer, result):
        self.events.append(("fit_end", result.epochs))


@pytest.mark.slow
def test_fit_on_arrays_in_memory_writes_no_file(tmp_path, default_model, default_profile):
    """A whole run on arrays in memory, without a run directory: callbacks see every period and
    epoch in order, nothing is written to the working directory, and ``close`` removes the
    private temporary directory."""
    prof, _ = default_profile
    x, y = digits_arrays(160)
    recorder = Recorder()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        config = etgraph.TrainConfig(
            epochs=2, period=1, rho=0.6, max_steps_per_epoch=10, closed_loop=False
        )
        trainer = etgraph.ElasticTrainer(
            default_model,
            prof,
            config,
            data=(x[:120], y[:120]),
            val_data=(x[120:], y[120:]),
            callbacks=[recorder],
        )
        work = trainer.work_dir
        result = trainer.fit()
        assert list(tmp_path.iterdir()) == []  # nothing in the working directory
    finally:
        os.chdir(cwd)
    kinds = [e[0] for e in recorder.events]
    assert kinds == [
        "fit_start",
        "period_start",
        "epoch_end",
        "period_end",
        "period_start",
        "epoch_end",
        "period_end",
        "fit_end",
    ]
    assert result.epochs == 2 and result.trained_model == ""
    assert 0 <= result.final_val_acc <= 1 and trainer.dataset.n_val == 40
    assert work.is_dir()
    trainer.close()
    assert not work.exists()
    for call in (trainer.get_weights, lambda: trainer.step(x[:4], y[:4]), trainer.fit):
        with pytest.raises(etgraph.ConfigError, match=r"the trainer is closed: call \w+\(\)"):
            call()  # was: a missing checkpoint file named
    trainer.close()  # again: nothing


def test_a_trainer_removes_what_killed_etgraph_processes_left(
    tmp_path, monkeypatch, default_model, default_profile
):
    """A program on the library API, killed mid-run (a Flower SuperNode, a notebook kernel),
    leaves its private temporary directory; the next trainer removes it, as the CLI does."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = "import os, etgraph.files as f; d = f.private_temp_dir('train'); os.kill(os.getpid(), 9)"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)})
    (stale,) = tmp_path.iterdir()
    x, y = digits_arrays(16)
    trainer = etgraph.ElasticTrainer(default_model, default_profile[0], data=(x, y))
    assert not stale.exists() and list(tmp_path.iterdir()) == [trainer.work_dir]
    trainer.close()


def test_a_trainer_driven_by_hand_keeps_collections_off_what_it_built(
    default_model, default_profile
):
    """A federated client and a program on the API drive periods without fit(): the trainer
    freezes what exists once it is built (:func:`etgraph.host.freeze_gc`), so a full
    collection in its process does not walk torch's and ORT's objects (in a Flower client
    process it took up to 444 ms of CPU, inside a round)."""
    gc.unfreeze()  # what the fixtures' profiling froze is scanned again
    x, y = digits_arrays(16)
    with etgraph.ElasticTrainer(default_model, default_profile[0], data=(x, y)):
        assert gc.get_freeze_count() > 100_000  # torch alone holds more


@pytest.mark.slow
def test_period_epoch_and_step_levels_and_weights_in_and_out(
    tmp_path, monkeypatch, default_model, default_profile
):
    """Driven by hand: a period's selection, an epoch, single steps; the weights read back equal
    those set; ``trained_weights`` holds exactly the tensors selected since the last set (and
    running statistics that moved); the exported model scores what ``evaluate`` scores."""
    prof, _ = default_profile
    x, y = digits_arrays(120)
    config = etgraph.TrainConfig(epochs=3, period=1, rho=0.6, max_steps_per_epoch=6)
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 96, 4)]
    with etgraph.ElasticTrainer(
        default_model, prof, config, data=batches, val_data=(x[96:], y[96:])
    ) as trainer:
        initial = trainer.get_weights()
        assert set(initial) == set(default_model.names) | set(default_model.running_stats)
        info = trainer.begin_period()
        assert info.period == 0 and info.mask.dtype == bool and info.selected
        assert info.importance.shape == (len(default_model.names),)
        fsyncs = []
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", lambda fd: fsyncs.append(fd))
            record = trainer.train_epoch()  # the period's last epoch: it ends the period
        assert record["epoch"] == 1 and record["steps"] == 6
        # the period end's checkpoint in the private work directory: nothing resumes from it,
        # so no fsync, digest or previous version (a run directory's has them)
        assert fsyncs == []
        assert [p.name for p in trainer.work_dir.glob("checkpoint*")] == ["checkpoint"]
        trained = trainer.trained_weights()
        state_copy = trainer.work_dir / "state.ckpt"
        assert not state_copy.exists()  # between periods: read from the period end's checkpoint
        selected = set(info.selected)
        assert selected <= set(trained)
        assert any(not np.array_equal(trained[n], initial[n]) for n in selected)
        assert set(trained) - selected <= set(default_model.running_stats)
        for name in set(default_model.names) - selected:  # unselected tensors did not move
            np.testing.assert_array_equal(trainer.get_weights()[name], initial[name])
        # a server's model arrives: set it; nothing trained since
        trainer.set_weights(initial, reset_moments=True)
        for name, value in trainer.get_weights().items():
            np.testing.assert_array_equal(value, initial[name], err_msg=name)
        assert set(trainer.trained_weights()) <= set(default_model.running_stats)
        losses = [trainer.step(*batches[i]) for i in range(3)]
        assert all(np.isfinite(losses)) and trainer.global_step == 9
        moved = trainer.trained_weights()
        assert set(trainer._period.selected) <= set(moved)
        assert state_copy.exists()  # mid-period: the session's state, saved
        assert any(not np.array_equal(moved[n], initial[n]) for n in trainer._period.selected)
        loss, acc = trainer.evaluate()
        assert np.isfinite(loss) and 0 <= acc <= 1
        exported = trainer.export(tmp_path / "model.onnx")
        from etgraph.sessions import evaluate_onnx

        _, exported_acc = evaluate_onnx(exported, trainer.val_batches(), 4)
        assert exported_acc == pytest.approx(acc)
        with pytest.raises(etgraph.ConfigError, match="not a parameter"):
            trainer.set_weights({"nope": np.zeros(1, np.float32)})
        name = default_model.names[0]
        with pytest.raises(etgraph.ConfigError, match=name):
            trainer.set_weights({name: np.zeros(1, np.float32)})
        with pytest.raises(etgraph.DataError, match="batches of 4"):
            trainer.step(x[:3], y[:3])


def test_in_memory_data_is_checked_against_the_model(default_model):
    """Arrays of the wrong shape or labels outside the head get the one-line DataError."""
    from etgraph.data import as_dataset

    shapes = default_model.input_shapes()
    kwargs = dict(inputs=default_model.inputs, shapes=shapes, task=default_model.task)
    x, y = digits_arrays(40)
    ds = as_dataset((x, y), **kwargs)
    assert ds.n_train + ds.n_val == 40 and ds.num_classes == 5
    with pytest.raises(etgraph.DataError, match="shape"):
        as_dataset((x[:, :, :16], y), **kwargs)
    with pytest.raises(etgraph.DataError, match="classes"):
        as_dataset((x, y + 10), **kwargs)
    with pytest.raises(etgraph.DataError, match="no batch"):
        as_dataset([], **kwargs)
    batches = [({"input": x[i : i + 4]}, y[i : i + 4]) for i in range(0, 40, 4)]
    ds = as_dataset(batches, **kwargs, val_data=(x[:8], y[:8]))
    assert (ds.n_train, ds.n_val) == (40, 8)


def test_compile_refuses_arrays_in_memory_in_one_line():
    """``etgraph.compile(data=...)`` takes a data spec; arrays in memory (the README's example
    data) were a TypeError from pathlib, now the one-line DataError naming where they go."""
    x, y = digits_arrays(8)
    for data in ((x, y), [(x, y)], x):
        with pytest.raises(etgraph.DataError, match=r"plan\.trainer\(config, data=\.\.\.\)"):
            etgraph.compile(rho=0.5, data=data)


@pytest.mark.slow
def test_the_readme_python_example_runs_as_written(tmp_path, cache_env):
    """The README's "Python API" example, verbatim, in a fresh interpreter: it compiles, trains,
    exports, and writes nothing but the model it was asked for."""
    import re
    import subprocess
    import sys

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, **cache_env},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "period 1: training" in done.stdout and "val acc" in done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["model_trained.onnx"]


@pytest.mark.slow
def test_a_trainer_with_a_run_directory_holds_its_lock(tmp_path, default_model, default_profile):
    """A program's trainer owns its run directory like `etgraph train` does: another process is
    refused (naming this pid) until the trainer is closed."""
    from helpers import assert_user_error, run_cli

    prof, path = default_profile
    out = tmp_path / "run"
    config = etgraph.TrainConfig(epochs=1, period=1, rho=0.6, max_steps_per_epoch=4)
    trainer = etgraph.ElasticTrainer(default_model, prof, config, out_dir=out)
    done = run_cli("train", "--out", out, "--profile", path, "--epochs", "1")
    assert_user_error(done, f"pid {os.getpid()}", "in use by another etgraph process")
    trainer.close()
    assert not (out / ".etgraph-lock").exists()


@pytest.mark.slow
def test_the_next_period_s_importance_comes_from_the_period_end_step(
    default_model, default_profile
):
    """After a period's last step the all-trainable session takes the trained tensors, and the
    gradients of its step there are the next period's importance: equal to an evaluation of its
    own on that batch at the checkpointed weights (not the probe batch's), with no pass at the
    period start; weights set from outside drop them (a pass on the same batch then)."""
    from etgraph.checkpoint import read_checkpoint

    prof, _ = default_profile
    x, y = digits_arrays(120)
    config = etgraph.TrainConfig(
        epochs=3, period=1, rho=0.6, max_steps_per_epoch=6, closed_loop=False, spinning="off"
    )
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 96, 4)]
    with etgraph.ElasticTrainer(
        default_model, prof, config, data=batches, val_data=(x[96:], y[96:])
    ) as trainer:
        trainer.begin_period()
        trainer.train_epoch()  # period 0's last step is carried
        controller = trainer.controller
        reference = controller.reference_session()
        uses = reference.uses
        info = trainer.begin_period()
        assert reference.uses == uses  # no forward or backward pass at the period start
        state = read_checkpoint(trainer.checkpoint_path)[0]
        *_, last = trainer._train_batches(0)
        lr = config.learning_rate

        def evaluated(batches):
            return controller.evaluator().evaluate(
                state.weights, batches, lr, moments=state.moments, step=state.step
            )

        np.testing.assert_allclose(info.importance, evaluated([last]).importance, rtol=1e-6)
        probe = evaluated(controller.probe_batches(1)).importance
        assert not np.allclose(info.importance, probe, rtol=1e-3)
        trainer.train_epoch()
        trainer.set_weights(trainer.get_weights())  # from outside: nothing held any more
        info = trainer.begin_period()
        assert reference.uses > uses
        state = read_checkpoint(trainer.checkpoint_path)[0]
        *_, last = trainer._train_batches(1)
        np.testing.assert_allclose(info.importance, evaluated([last]).importance, rtol=1e-6)


@pytest.mark.slow
def test_importance_at_a_smaller_probe_batch_runs_in_a_session_of_its_own(
    default_model, default_profile
):
    """A probe batch smaller than the run's (paper §4: 4 examples): importance runs in an
    all-trainable session of its own at that batch, the reference steps in one at the run's
    batch, no period-end step is carried, and each period's importance is an evaluation on its
    own probe batch of that size at the carried weights."""
    from etgraph.checkpoint import read_checkpoint
    from etgraph.period import probe_seed

    prof, _ = default_profile  # batch 4
    x, y = digits_arrays(120)
    config = etgraph.TrainConfig(
        epochs=2,
        period=1,
        rho=0.6,
        max_steps_per_epoch=6,
        closed_loop=False,
        spinning="off",
        probe_batch_size=2,
    )
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 96, 4)]
    with etgraph.ElasticTrainer(
        default_model, prof, config, data=batches, val_data=(x[96:], y[96:])
    ) as trainer:
        controller = trainer.controller
        assert not controller.shared_session and not controller.carries_gradients
        trainer.begin_period()
        trainer.train_epoch()
        info = trainer.begin_period()
        evaluator, reference = controller.evaluator(), controller.reference_session()
        assert evaluator.session() is not reference
        assert evaluator.paths.directory != controller.full_artifacts()
        probe = controller.probe_batches(1)
        assert [len(y) for _, y in probe] == [2]
        assert len(controller.timing_batch()[1]) == 4
        state = read_checkpoint(trainer.checkpoint_path)[0]
        expected = evaluator.evaluate(
            state.weights,
            probe,
            config.learning_rate,
            moments=state.moments,
            step=state.step,
            seed=probe_seed(config.seed, 1),
        )
        np.testing.assert_allclose(info.importance, expected.importance, rtol=1e-6)
        session = evaluator.session()
        controller.use_options(True, reference)  # options changed, a full session won
        assert controller.reference_session() is reference
        assert evaluator.session() is not session  # reopened with the new options


@pytest.mark.slow
def test_dropout_masks_depend_only_on_the_run_seed(tmp_path, monkeypatch):
    """ORT draws a training graph's Dropout masks from one process-wide generator: unseeded, a
    second run with the same seed and data drew other masks than the first (every training-mode
    run in between moves the generator, so a cold and a warm profile cache trained differently).
    Each step is seeded from the run's seed and its global step, each importance pass from the
    period's probe seed: two runs of one process train alike, step for step."""
    import torch

    from models.export import export_onnx

    monkeypatch.setenv("ETGRAPH_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(8, 5),
    )
    path = export_onnx(module, tmp_path / "dropout.onnx", input_shape=(3, 32, 32), num_classes=5)
    model = etgraph.load_model(path)
    assert any(n.op_type == "Dropout" for n in model.proto.graph.node)
    prof = etgraph.profile_model(model, threads=1, cache=False)
    x, y = digits_arrays(64)
    config = etgraph.TrainConfig(
        epochs=2, period=1, rho=0.8, closed_loop=False, spinning="off", threads=1
    )

    def run() -> tuple[list[float], dict[str, np.ndarray]]:
        batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 48, 4)]
        with etgraph.ElasticTrainer(
            model, prof, config, data=batches, val_data=(x[48:], y[48:])
        ) as trainer:
            trainer.fit()
            return [r["train_loss"] for r in trainer.records], trainer.get_weights()

    losses, weights = run()
    again, weights_again = run()
    assert again == losses
    for name, value in weights.items():
        np.testing.assert_array_equal(weights_again[name], value, err_msg=name)


def test_weights_set_mid_period_report_the_period_s_selection_as_trained(
    default_model, default_profile
):
    """``set_weights`` inside a period, then the period trains on: ``trained_weights`` holds
    every tensor that moved since the set (was: only running statistics, the period's selection
    dropped, so a federated client would upload nothing it trained)."""
    prof, _ = default_profile
    x, y = digits_arrays(60)
    config = etgraph.TrainConfig(epochs=2, period=2, max_steps_per_epoch=4, closed_loop=False)
    with etgraph.ElasticTrainer(
        default_model, prof, config, data=(x[:40], y[:40]), val_data=(x[40:], y[40:])
    ) as trainer:
        info = trainer.begin_period()
        weights = trainer.get_weights()
        trainer.set_weights(weights)
        trainer.train_epoch()  # the period goes on (2 epochs)
        after = trainer.get_weights()
        moved = {n for n in weights if not np.array_equal(weights[n], after[n])}
        trained = set(trainer.trained_weights())
        assert set(info.selected) <= trained
        assert moved <= trained


def test_a_run_resumed_from_another_directory_trains_on_its_own_data(
    tmp_path, monkeypatch, default_model, default_profile
):
    """A run given its data by a relative path records it absolute: resumed from another
    working directory that holds a file of the same name, it trains on its own data (was: the
    other file, silently: a CLI run on `--data data.npz` killed after epoch 3 of 4 and resumed
    from another project's folder ended at 41.3% validation accuracy, uninterrupted 94.4%)."""
    prof, _ = default_profile
    x, y = digits_arrays(80)
    name = default_model.input_names[0]
    mine, other = tmp_path / "mine", tmp_path / "other"
    for folder, flip in ((mine, 1.0), (other, -1.0)):
        folder.mkdir()
        np.savez(folder / "data.npz", **{name: flip * x, "labels": y})
    monkeypatch.chdir(mine)
    config = etgraph.TrainConfig(epochs=2, period=1, max_steps_per_epoch=2, closed_loop=False)
    run = tmp_path / "run"
    with etgraph.ElasticTrainer(
        default_model, prof, config, data="data.npz", out_dir=run
    ) as trainer:
        trainer.train_epoch()  # period 0 ends: its checkpoint
    monkeypatch.chdir(other)
    with etgraph.ElasticTrainer.resume(run) as resumed:
        assert resumed.epoch == 1
        np.testing.assert_array_equal(resumed.dataset.arrays[name], x)


def test_a_run_on_data_in_memory_resumes_only_with_it_given_again(
    tmp_path, default_model, default_profile
):
    """A run directory trained on arrays in memory is not resumed without them (was: on the
    embedded digits 5-9, silently: a run on digits 0-4 killed after its first period and
    resumed with `etgraph train --resume` ended at 19.6% validation accuracy, its
    classes.json rewritten to '5'..'9'); given again, it resumes."""
    prof, _ = default_profile
    x, y = digits_arrays(60)
    config = etgraph.TrainConfig(epochs=2, period=1, max_steps_per_epoch=2, closed_loop=False)
    run = tmp_path / "run"
    data, val_data = (x[:40], y[:40]), (x[40:], y[40:])
    with etgraph.ElasticTrainer(
        default_model, prof, config, data=data, val_data=val_data, out_dir=run
    ) as trainer:
        trainer.train_epoch()  # period 0 ends: its checkpoint
    with pytest.raises(etgraph.DataError, match=r"data and val_data given in memory"):
        etgraph.ElasticTrainer.resume(run)
    with pytest.raises(etgraph.DataError, match=r"pass val_data=\.\.\. again"):
        etgraph.ElasticTrainer.resume(run, data=data)
    with etgraph.ElasticTrainer.resume(run, data=data, val_data=val_data) as resumed:
        assert resumed.epoch == 1 and resumed.dataset.n_val == 20


def test_a_run_does_not_resume_on_data_whose_classes_changed(
    tmp_path, default_model, default_profile
):
    """A class folder added to the image folder of a run between its kill and its resume
    renumbers the classes after it: the resume is refused in one line, ``classes.json`` kept
    (was: resumed on the new numbering, the head's outputs silently meaning other classes)."""
    from PIL import Image

    folder, rng = tmp_path / "images", np.random.default_rng(0)
    for label in ("cat", "dog", "bird"):
        (folder / label).mkdir(parents=True)
        for i in range(8):
            pixels = rng.integers(0, 256, (16, 16), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / label / f"{i}.png")
    hidden = tmp_path / "bird"
    (folder / "bird").rename(hidden)
    config = etgraph.TrainConfig(epochs=2, period=1, max_steps_per_epoch=2, closed_loop=False)
    run = tmp_path / "run"
    with etgraph.ElasticTrainer(
        default_model, default_profile[0], config, data=folder, out_dir=run
    ) as trainer:
        trainer.train_epoch()  # period 0 ends: its checkpoint
    saved = (run / "classes.json").read_text()
    hidden.rename(folder / "bird")
    with pytest.raises(etgraph.DataError, match=r"not the ones the run .* \(new classes bird\)"):
        etgraph.ElasticTrainer.resume(run)
    assert (run / "classes.json").read_text() == saved
    (folder / "bird").rename(hidden)
    with etgraph.ElasticTrainer.resume(run) as resumed:
        assert resumed.epoch == 1 and resumed.dataset.class_names == ["cat", "dog"]
