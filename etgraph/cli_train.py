"""``etgraph train``: a thin command over :class:`etgraph.trainer.ElasticTrainer` with a run
directory (:mod:`etgraph.loop`), from a compiled directory (:class:`etgraph.plan.Plan`), an ONNX
file or the embedded default."""

from __future__ import annotations

import time
from pathlib import Path

import click

from .cli_options import (
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    RHO,
    given,
    given_options,
    head_lr_note,
    head_lr_scale_option,
    input_shape_option,
    loss_option,
    model_input_options,
    output_option,
    parse_duration,
    profile_level_option,
    tokenizer_option,
    verbosity_options,
)
from .errors import ConfigError, HeadLrScaleError, ProfileMismatchError
from .files import require_model_path, require_run_dir
from .host import process_age_s
from .selection import IMPORTANCE_VARIANTS, STRATEGIES

#: When the command (this process) started, on the ``time.perf_counter`` clock: ``train
#: --deadline`` counts from here.
STARTED = time.perf_counter() - process_age_s()


@click.command("train")
@click.argument("model", required=False, type=click.Path())
@click.option(
    "--data",
    default=None,
    help="Dataset: 'digits' (embedded), an image-folder dir, FILE.npz (one array per model "
    "input, keyed by input name, + labels) or FILE.csv|FILE.jsonl (text, label; with "
    "--tokenizer) [digits; train DIR: the data DIR was compiled with].",
)
@tokenizer_option
@click.option("--epochs", default=12, show_default=True, type=POSITIVE_INT, help="Training epochs.")
@click.option(
    "--batch-size",
    type=POSITIVE_INT,
    help="Batch size [4; train DIR: the batch size DIR was compiled for].",
)
@click.option(
    "--lr", default=1e-4, show_default=True, type=POSITIVE, help="Peak AdamW lr (cosine)."
)
@click.option(
    "--weight-decay", default=0.01, show_default=True, type=NON_NEGATIVE, help="AdamW decay."
)
@click.option(
    "--rho",
    type=RHO,
    help="Step time / full step, in (0, 1] (within ±5% once the closed loop has measured "
    "steps) [0.5; train DIR: the rho DIR was compiled for].",
)
@click.option(
    "--rho-scope",
    default="step",
    show_default=True,
    type=click.Choice(["step", "run"]),
    help="What --rho bounds: a step's time (paper Eq. 3) or the whole run's, overheads, "
    "validation and export included (rho then planned per period).",
)
@click.option(
    "--period", default=3, show_default=True, type=POSITIVE_INT, help="Epochs per re-selection."
)
@click.option(
    "--strategy",
    default="elastic",
    show_default=True,
    type=click.Choice(STRATEGIES),
    help="Tensor selection: elastic (DP) or a baseline.",
)
@click.option(
    "--importance",
    default="adam",
    show_default=True,
    type=click.Choice(IMPORTANCE_VARIANTS),
    help="delta_w of the tensor importance: the optimizer's next step with the run's moments "
    "(adam), AdamW's first step (first-step), an SGD step (grad-sq), or random (ablations).",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=NON_NEGATIVE_INT,
    help="Run seed: data order, split, probes, Dropout masks.",
)
@click.option(
    "-o",
    "--out",
    "out",
    default=None,
    type=click.Path(),
    help="Run directory to write (required, unless --resume).",
)
@click.option("--resume", "resume_dir", default=None, type=click.Path(), help="Continue a run.")
@click.option("--profile", "profile_path", default=None, help="profile.json [measure, cached].")
@profile_level_option
@input_shape_option
@output_option
@loss_option
@click.option("--threads", default=None, type=POSITIVE_INT, help="ORT threads [the profile's].")
@click.option(
    "--max-steps-per-epoch",
    default=None,
    type=POSITIVE_INT,
    help="Subsample each epoch [all its steps].",
)
@click.option(
    "--max-val-batches", default=None, type=POSITIVE_INT, help="Subsample validation [every batch]."
)
@click.option(
    "--probe-batches", default=1, show_default=True, type=POSITIVE_INT, help="Importance batches."
)
@click.option(
    "--probe-batch-size",
    default=4,
    show_default=True,
    type=POSITIVE_INT,
    help="Examples per importance batch (at most --batch-size; paper §4: 4).",
)
@click.option(
    "--open-loop",
    is_flag=True,
    help="Select with the profile's time model as is (no re-fit to measured steps; repeatable).",
)
@click.option(
    "--deadline",
    default=None,
    help="Finish within this time from the start (90s, 10m, 1h): rho is chosen per period.",
)
@click.option(
    "--memory-mb",
    default=None,
    type=POSITIVE,
    help="Peak-memory budget in MiB for the selection (elastic) [none: time budget only].",
)
@click.option(
    "--spinning",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "off", "on", "on+stop"]),
    help="ORT thread-pool spinning of the training sessions (auto: measured at the start).",
)
@head_lr_scale_option
@model_input_options
@verbosity_options
@click.pass_context
def train_command(ctx: click.Context, model, **opts):
    """Train MODEL (an `etgraph compile` directory, an ONNX file, or by default the embedded
    model and digits data) with elastic tensor selection, re-selecting every --period epochs;
    a compiled directory gives its rho, batch size, preprocessing and data unless told
    otherwise. `--resume DIR` continues an interrupted run, or extends a finished one with a
    larger --epochs."""
    progress = not opts["quiet"]
    if opts["resume_dir"] is not None:
        extra = given_options(ctx, allowed=("resume_dir", "quiet", "verbose", "epochs"))
        if extra:
            raise ConfigError(
                f"--resume DIR continues a run as configured: drop {', '.join(extra)} (or start "
                "a new run with another --out)"
            )
        require_run_dir(Path(opts["resume_dir"]))  # before the heavy imports
        from .loop import resume
        from .rundir import format_summary

        epochs = opts["epochs"] if given(ctx, "epochs") else None
        click.echo(format_summary(resume(opts["resume_dir"], progress=progress, epochs=epochs)))
        return
    if opts["out"] is None:  # these two before the heavy imports (seconds): user errors
        raise ConfigError("missing --out DIR: where to write the log, checkpoints and model")
    if model is not None:
        require_model_path(model, directory_ok=True)
    from .config import load_run_data
    from .loop import train
    from .rundir import check_run_dir, format_summary

    plan = _compiled_plan(model)
    config = _train_config(plan, opts)  # validated before anything is measured
    loaded, profile = _train_model(model, plan, opts, config.head_lr_scale)
    if progress and config.head_lr_scale != 1.0:
        click.echo(head_lr_note(config.head_lr_scale), err=True)
    inputs = (loaded.source, config.data, config.tokenizer, opts["profile_path"])
    check_run_dir(Path(opts["out"]), inputs)  # before anything is measured
    # The data before the model is profiled: a data error must not wait for profiling.
    shapes = profile.input_shapes if profile is not None else opts["input_shape"] or None
    dataset = load_run_data(config, loaded, loaded.input_shapes(shapes))
    if profile is None:
        from .api import profile_model

        click.echo(f"profiling {loaded.source.name} on this device (cached) ...", err=True)
        profile = profile_model(
            loaded,
            batch_size=config.batch_size,
            input_shape=opts["input_shape"] or None,
            level=opts["profile_level"],
            threads=opts["threads"],
        )
    memory_profile = _memory_inputs(plan, loaded, profile, config)
    held = [loaded]  # handed over, not kept: under --memory-mb train() drops the weights
    del loaded
    result = train(
        held.pop(),
        profile,
        config,
        opts["out"],
        progress=progress,
        started_at=STARTED,
        memory_profile=memory_profile,
        dataset=dataset,
    )
    click.echo(format_summary(result))


def _compiled_plan(model):
    """The plan of a compiled directory ``model`` (:meth:`etgraph.plan.Plan.load`), else None."""
    from .plan import Plan

    return Plan.load(model) if model is not None and Path(model).is_dir() else None


def _train_config(plan, opts: dict):
    """The run's :class:`etgraph.config.TrainConfig` from the options, the compiled plan's
    settings where an option was not given (rho, batch size, preprocessing, batch-norm mode,
    data and tokenizer)."""
    from .config import TrainConfig
    from .plan import train_settings
    from .text import check_text_options

    preprocess, frozen_bn = train_settings(
        None if plan is None else plan.to_json(),
        preset=opts["preset"],
        mean=opts["mean"],
        std=opts["std"],
        scale=opts["scale"],
        channel_order=opts["channel_order"],
        frozen_bn=opts["frozen_bn"],
    )
    data, tokenizer = opts["data"], opts["tokenizer"]
    if data is None and plan is not None and plan.data is not None:  # the compiled data
        data, tokenizer = plan.data, tokenizer or plan.tokenizer
        click.echo(f"training on the data {model_name(plan)} was compiled with: {data}", err=True)
    check_text_options(data, tokenizer)  # before the model is profiled
    deadline = opts["deadline"]
    if deadline is not None and opts["rho"] is not None:  # else --rho is ignored, silently
        raise ConfigError(
            "--rho and --deadline both set the step time (with --deadline the run picks rho "
            "each period to end in time): give one of them"
        )
    return TrainConfig(
        epochs=opts["epochs"],
        batch_size=_or_plan(opts["batch_size"], plan, "batch_size", 4),
        learning_rate=opts["lr"],
        weight_decay=opts["weight_decay"],
        rho=_or_plan(opts["rho"], plan, "rho", 0.5),
        rho_scope=opts["rho_scope"],
        period=opts["period"],
        strategy=opts["strategy"],
        seed=opts["seed"],
        data=data,
        tokenizer=tokenizer,
        probe_batches=opts["probe_batches"],
        probe_batch_size=opts["probe_batch_size"],
        max_steps_per_epoch=opts["max_steps_per_epoch"],
        max_val_batches=opts["max_val_batches"],
        threads=opts["threads"],
        frozen_bn=frozen_bn,
        preprocess=preprocess,
        closed_loop=not opts["open_loop"],
        deadline_s=parse_duration(deadline) if deadline is not None else None,
        memory_mb=opts["memory_mb"],
        spinning=opts["spinning"],
        importance=opts["importance"],
        head_lr_scale=_head_lr_scale(plan, opts["head_lr_scale"]),
    ).validate()


def _head_lr_scale(plan, given: float | None) -> float:
    """The run's head learning-rate factor: as given, else the compiled plan's, else 1. A
    compiled directory trains at the factor it was compiled with (its profile, importance and
    artifacts are of the model scaled so): another one is refused.

    Raises:
        HeadLrScaleError: not positive and finite, or other than the plan's.
    """
    from passes.onnx import check_head_lr_scale

    if given is not None:
        check_head_lr_scale(given)
    if plan is None:
        return 1.0 if given is None else given
    compiled = plan.model.head_lr_scale
    if given is not None and given != compiled:
        raise HeadLrScaleError(
            f"{model_name(plan)} was compiled with --head-lr-scale {compiled:g}, not {given:g}: "
            f"compile again with --head-lr-scale {given:g} (the profile, importance and "
            "artifacts are of the scaled model), or drop --head-lr-scale"
        )
    return compiled


def _or_plan(given, plan, field: str, default):
    """An option's value: as given, else the compiled plan's, else the default."""
    if given is not None:
        return given
    return getattr(plan, field) if plan is not None else default


def model_name(plan) -> str:
    """The compiled directory a plan was loaded from."""
    return str(plan.model.source.parent)


def _memory_inputs(plan, loaded, profile, config):
    """The memory model for `etgraph train`: a compiled directory's ``memory.json`` if it was
    measured in the run's batch-norm mode, else (with --memory-mb) measured on this device in
    that mode (cached), else None."""
    from .memory_profiler import image_input_shape, profile_memory
    from .profile import default_cache_dir

    compiled = plan.memory_profile if plan is not None else None
    if compiled is not None:
        try:
            compiled.check_matches(
                loaded.hash,
                batch_size=profile.batch_size,
                input_shape=image_input_shape(loaded, profile.input_shapes),
                threads=profile.threads,
            )
        except ProfileMismatchError as exc:  # name the file to delete
            raise ProfileMismatchError(f"{model_name(plan)}/memory.json: {exc}") from exc
        if compiled.frozen_bn == config.frozen_bn:
            return compiled
    if config.memory_mb is None:
        return None
    click.echo("measuring the memory model on this device (cached) ...", err=True)
    return profile_memory(
        loaded,
        batch_size=profile.batch_size,
        input_shapes=profile.input_shapes,
        threads=profile.threads,
        cache_dir=default_cache_dir(),
        frozen_bn=config.frozen_bn,
    )


def _train_model(model, plan, opts: dict, head_lr_scale: float):
    """(LoadedModel, Profile or None) for `etgraph train`: a compiled directory's (its model
    has one output; its loss is the one it was compiled for), an ONNX file or the default
    (loaded with its head at ``head_lr_scale``). The profile is the given or compiled one;
    None = measure it (after the data is loaded)."""
    from .api import load_model
    from .io_specs import parse_input_shapes
    from .profile import Profile, format_shapes

    input_shape, loss = opts["input_shape"] or None, opts["loss"]
    profile_path = opts["profile_path"]
    parse_input_shapes(input_shape)  # malformed text is an error before the model loads
    remedy = "re-profile with --input-shape or drop --profile"  # what to do on a shape mismatch
    if plan is not None:
        if loss is not None and loss != plan.model.task.loss:
            raise ConfigError(
                f"{model} was compiled for --loss {plan.model.task.loss}, not {loss}: compile "
                f"again with --loss {loss}, or drop --loss"
            )
        loaded, profile = plan.model, plan.profile
        remedy = "compile again with --input-shape, or drop --input-shape"
        if profile_path is not None:
            profile = Profile.load(profile_path)
    else:
        loaded = load_model(
            model, output=opts["model_output"], loss=loss or "ce", head_lr_scale=head_lr_scale
        )
        profile = Profile.load(profile_path) if profile_path is not None else None
    if profile is not None and input_shape:
        shapes = loaded.input_shapes(input_shape)
        if format_shapes(shapes) != format_shapes(profile.input_shapes):
            raise ProfileMismatchError(
                f"profile {profile_path or Path(model) / 'profile.json'} was measured at input "
                f"shape {format_shapes(profile.input_shapes)}, not {format_shapes(shapes)}: "
                f"{remedy}"
            )
    return loaded, profile
