"""Per-run choice of the training sessions' ORT options (issue #16): candidates measured side
by side at the start of a run, and reference steps counted over the period."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from etgraph.clock import fit_clock
from etgraph.config import TrainConfig
from etgraph.config_choice import TRAIN_CANDIDATES, ConfigChoice, pick_fastest
from etgraph.errors import ConfigError
from etgraph.ort_options import ROLES


class _FakeClock:
    """A clock the steppers advance: each call of a stepper adds its next duration."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def stepper(self, seconds, calls):
        durations = list(seconds) if isinstance(seconds, list) else None

        def step():
            dt = durations.pop(0) if durations is not None else seconds
            self.now += dt
            calls.append(dt)

        return step


def test_pick_fastest_takes_the_fastest_beyond_the_margin_and_drops_slow_ones():
    clock = _FakeClock()
    calls = []
    steppers = {
        "off": clock.stepper(10.0, calls),
        "on": clock.stepper(7.0, calls),
        "slow": clock.stepper(30.0, calls),
    }
    best, medians = pick_fastest(steppers, 3, clock=clock)
    assert best == "on"
    assert medians == {"off": 10.0, "on": 7.0, "slow": 30.0}
    # "slow" ran one round (2 steps); the default and "on" all three rounds
    assert calls.count(30.0) == 2 and calls.count(10.0) == 6 and calls.count(7.0) == 6


def test_pick_fastest_keeps_the_default_unless_faster_beyond_the_margin_in_every_round():
    clock = _FakeClock()
    calls = []
    steppers = {"off": clock.stepper(10.0, calls), "on": clock.stepper(9.8, calls)}
    best, _ = pick_fastest(steppers, 2, margin=0.03, clock=clock)
    assert best == "off"  # 2% faster is within the default's 3% advantage
    best, _ = pick_fastest(steppers, 2, margin=0.01, clock=clock)
    assert best == "on"
    # faster by the median, but slower in one round (a burst hit the default twice): not chosen
    # (each round runs a stepper twice and times the second run)
    lucky = {
        "off": clock.stepper([1, 10.0, 1, 30.0, 1, 30.0], calls),
        "on": clock.stepper([1, 12.0, 1, 8.0, 1, 8.0], calls),
    }
    best, medians = pick_fastest(lucky, 3, clock=clock)
    assert medians == {"off": 30.0, "on": 8.0} and best == "off"
    with pytest.raises(ValueError, match="at least one stepper and one round"):
        pick_fastest(steppers, 0, clock=clock)


def test_config_choice_given_and_json():
    choice = ConfigChoice.given("on+stop")
    assert choice.config == TRAIN_CANDIDATES["on+stop"]
    assert choice.config.spinning and choice.config.stop_spinning
    assert not TRAIN_CANDIDATES["off"].spinning
    for config in TRAIN_CANDIDATES.values():  # the train role's options but the spinning
        assert replace(config, spinning=False, stop_spinning=False) == ROLES["train"]
    assert json.loads(json.dumps(choice.to_json()))["label"] == "on+stop"
    with pytest.raises(KeyError, match="fast"):
        ConfigChoice.given("fast")


def test_spinning_setting_is_validated_and_sets_the_fit_clock():
    assert TrainConfig(spinning="on").validate().spinning == "on"
    with pytest.raises(ConfigError, match="unknown spinning setting 'always'"):
        TrainConfig(spinning="always").validate()
    assert fit_clock(False) == "_cpu" and fit_clock(True) == ""


@pytest.mark.slow
def test_run_probes_session_options_without_changing_what_it_trains(
    tmp_path, default_profile, default_model, monkeypatch
):
    """``spinning="auto"`` measures the candidates at the start (logged, charged to the first
    epoch) at learning rate 0 on a throwaway copy: the run trains exactly what a run with the
    options given trains (open loop: same selections, same losses). On a loaded machine it
    does not probe (spinning off, the reason in the summary)."""
    from etgraph import ort_probe
    from etgraph.loop import train
    from etgraph.rundir import read_log

    prof, _ = default_profile
    common = dict(epochs=2, period=1, rho=0.6, max_steps_per_epoch=12, max_val_batches=2)
    monkeypatch.setattr(ort_probe, "PROBE_MAX_LOAD_PER_CORE", 0.0)  # every load is too high
    cfg = TrainConfig(closed_loop=False, **common)
    loaded = train(default_model, prof, cfg, tmp_path / "loaded", progress=False)
    assert loaded.ort_config == "off" and loaded.ort_probe_s == 0
    assert loaded.ort_note.startswith("not probed: load average")
    monkeypatch.setattr(ort_probe, "PROBE_MAX_LOAD_PER_CORE", float("inf"))  # probe at any load
    short = train(default_model, prof, cfg, tmp_path / "short", progress=False)
    assert short.ort_probe_s == 0 and "too few to pay for it" in short.ort_note
    assert short.ort_config == ort_probe.QUIET_CANDIDATE  # below the load gate: a quiet machine
    for a, b in zip(read_log(tmp_path / "short"), read_log(tmp_path / "loaded"), strict=True):
        assert a["selection"] == b["selection"]  # other options, the same training
        np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-5)
    monkeypatch.setattr(ort_probe, "PROBE_COST_FULL_STEPS", 0)  # and in a short run
    monkeypatch.setattr(ort_probe, "REPROBE_FACTOR", 1.0 + 1e-9)  # and again every period
    runs = {}
    for spinning in ("auto", "off"):
        cfg = TrainConfig(closed_loop=False, spinning=spinning, **common)
        result = train(default_model, prof, cfg, tmp_path / spinning, progress=False)
        runs[spinning] = (result, read_log(tmp_path / spinning))
    auto, auto_log = runs["auto"]
    off, off_log = runs["off"]
    assert auto.ort_config in TRAIN_CANDIDATES
    assert set(auto.ort_probe_step_ms) == set(TRAIN_CANDIDATES)
    assert auto.ort_probe_s > 0 and auto_log[0]["ort_probe_s"] > 0
    assert auto_log[0]["wall_time_s"] > auto_log[0]["ort_probe_s"]  # in the run's time
    assert auto_log[1]["ort_probe_s"] > 0 and auto_log[1]["ort_probe_step_ms"]  # re-probed
    assert auto.ort_probe_s == pytest.approx(sum(r["ort_probe_s"] for r in auto_log))
    assert off.ort_config == "off" and off.ort_probe_s == 0 and off.ort_probe_step_ms is None
    for a, b in zip(auto_log, off_log, strict=True):
        assert a["selection"] == b["selection"]
        assert a["ort_config"] in TRAIN_CANDIDATES
        np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-5)
        np.testing.assert_allclose(a["val_loss"], b["val_loss"], rtol=1e-5)


def test_reference_steps_are_counted_over_the_period():
    from etgraph.clock import period_reference_positions

    # the default model's 179-step epochs, period 3, rho 0.5, 1 %: one per period
    per_epoch = period_reference_positions(179, 3, 0.01, 0.5)
    assert len(per_epoch) == 3 and sum(len(p) for p in per_epoch) == 1
    assert per_epoch[1] and not per_epoch[0] and not per_epoch[2]  # in the middle
    # a period of one epoch still has one, never after its first step
    assert period_reference_positions(179, 1, 0.01, 0.5) == [frozenset({90})]
    # a larger budget spreads more over every epoch
    many = period_reference_positions(100, 2, 0.2, 1.0)
    assert [len(p) for p in many] == [10, 10]  # 0.2 * 200 steps / 2 full steps each
    assert all(0 <= i < 100 for p in many for i in p)
    # a period whose last step is carried (the next importance): the last one there, free
    at_end = period_reference_positions(179, 3, 0.01, 0.5, end=True)
    assert at_end == [frozenset(), frozenset(), frozenset({178})]
    many = period_reference_positions(100, 2, 0.2, 1.0, end=True)
    assert [len(p) for p in many] == [10, 10] and 99 in many[1] and 0 not in many[0]


def test_short_periods_take_reference_steps_within_the_budget_over_periods():
    """30-step epochs, period 3, rho 0.5, 1 %: a reference step (two full steps) per period
    would cost four elastic steps of 90; one every fifth period is the budget."""
    from etgraph.clock import period_reference_positions, reference_steps_at

    assert sum(map(len, period_reference_positions(30, 3, 0.01, 0.5))) == 1  # nothing yet
    assert period_reference_positions(30, 3, 0.01, 0.5, since_steps=90) == [frozenset()] * 3
    assert sum(map(len, period_reference_positions(30, 3, 0.01, 0.5, since_steps=330))) == 1
    # the default model's 179-step epochs still measure every period
    assert sum(map(len, period_reference_positions(179, 3, 0.01, 0.5, since_steps=537))) == 1
    records = [{"steps": 30, "reference_steps": int(e == 1)} for e in range(3)]
    records += [{"steps": 30, "reference_steps": 0} for _ in range(9)]
    taken = [
        sum(len(reference_steps_at(e, p * 3, p * 3 + 3, 30, 0.01, 0.5, records[: p * 3]))
            for e in range(p * 3, p * 3 + 3))
        for p in range(1, 5)
    ]  # fmt: skip
    assert taken == [0, 0, 0, 1]  # 60, 150, 240 steps since: not yet; 330 + 90: one


def test_recheck_after_a_slowdown_chooses_spinning_off_in_a_run_too_short_to_probe(
    monkeypatch,
):
    """A re-check is called because the full step moved: slower means other work started
    (the 1-minute load average lags it), so a run too short to probe turns spinning off rather
    than taking the quiet-machine choice; the next period's step is then the base to watch."""
    from etgraph import ort_probe

    monkeypatch.setattr(ort_probe, "PROBE_MAX_LOAD_PER_CORE", float("inf"))  # reads quiet
    options = ort_probe.OrtOptions("auto", bounded=False, threads=None, total_steps=24)

    def no_probe():
        raise AssertionError("a run this short is never probed")

    def choose():
        return options.choose(0.6, no_probe, None, ["x"])

    def recheck(records):
        return options.recheck(records, 1, 0.6, no_probe, None, ["x"])[0]

    assert choose() == (True, None) and options.choice.label == ort_probe.QUIET_CANDIDATE
    assert not recheck([{"reference_step_us": 1e3}]) and options._base_ms == 1.0  # the base
    assert not recheck([{"reference_step_us": 1.2e3}])  # within the factor
    assert recheck([{"reference_step_us": 2e3}])  # 2x slower: changed
    assert options.choice.label == "off" and "2.0x slower" in options.choice.note
    assert options._base_ms is None  # measured again in the new options
    assert not recheck([{"reference_step_us": 1.5e3}])
    assert options._base_ms == 1.5
    assert recheck([{"reference_step_us": 0.5e3}])  # 3x faster: quiet again
    assert options.choice.label == ort_probe.QUIET_CANDIDATE
    # spinning on: elastic steps 2.3x slower than predicted call a re-check even when the one
    # reference step moved less than the factor
    assert not recheck([{"reference_step_us": 0.5e3}])  # the new base
    slow = {"reference_step_us": 0.6e3, "median_step_us": 2.3e3, "predicted_measured_step_us": 1e3}
    assert recheck([slow]) and options.choice.label == "off"
    assert "2.3x slower" in options.choice.note


def test_fit_by_cpu_time_skips_epochs_whose_sessions_spun(default_profile):
    """After a re-check turned spinning off, the closed loop fits process CPU time, and the
    epochs trained with spinning on (their CPU time counts the spinning) are left out; until
    such an epoch exists, those epochs' wall-clock fit is used."""
    from etgraph.clock import fit_time_model

    prof, _ = default_profile

    def fit(records, spinning):
        return fit_time_model(
            records, spinning=spinning, closed_loop=True, t_full_us=prof.t_full_us
        )

    def epoch(label, spin):
        return {
            "reference_steps": 1,
            "ort_config": label,
            "predicted_step_us": 0.5 * prof.t_full_us,
            "median_step_us": 0.5 * prof.t_full_us,
            "reference_step_us": prof.t_full_us,
            "median_step_cpu_us": spin * 0.5 * prof.t_full_us,
            "reference_step_cpu_us": prof.t_full_us,  # the spin inflates the elastic side here
        }

    records = [epoch("on+stop", 1.8), epoch("on+stop", 1.8), epoch("off", 1.0)]
    assert fit(records, spinning=False).observations == 1  # CPU time: the "off" epoch
    # Right after the switch no epoch without spinning exists: their wall-clock fit, not the
    # CPU time the spinning inflated (that would put the offset far from 0 here).
    first = fit(records[:2], spinning=False)
    assert first.observations == 2 and first.offset_us == pytest.approx(0.0, abs=1e-6)
    assert fit(records, spinning=True).observations == 3  # wall clock: every epoch counts
