"""What the ``etgraph`` commands share: their common options (model inputs and outputs, the
loss, preprocessing, verbosity), where progress lines go, and small parsers."""

from __future__ import annotations

import logging
import sys

import click

from .errors import ConfigError
from .images import CHANNEL_ORDERS, PREPROCESS_PRESETS

#: Option types that refuse a value out of range while the command line is parsed, before
#: anything is imported or measured (``--epochs 0`` is answered at once, not after the seconds
#: ORT and torch take to import); ``--help`` shows each range. The API checks the same ranges
#: (:meth:`etgraph.config.TrainConfig.validate`).
POSITIVE_INT = click.IntRange(min=1)
NON_NEGATIVE_INT = click.IntRange(min=0)
POSITIVE = click.FloatRange(min=0.0, min_open=True)
NON_NEGATIVE = click.FloatRange(min=0.0)
FRACTION = click.FloatRange(min=0.0, max=1.0)
RHO = click.FloatRange(min=0.0, max=1.0, min_open=True)

input_shape_option = click.option(
    "--input-shape",
    "input_shape",
    multiple=True,
    help="NAME=DIMS per model input (repeatable; the dims after the batch, or all dims with the "
    "batch first), or CxHxW for a one-input model, e.g. 3x224x224 [the model's own].",
)
output_option = click.option(
    "--output",
    "model_output",
    default=None,
    help="The graph output to train on, when the model has several [its only output].",
)
#: etgraph.io_specs.LOSSES, spelled out: importing etgraph.io_specs here would load onnx_ir's
#: passes and onnxscript for every command (tests/test_inputs_outputs.py checks they agree).
CLI_LOSSES = ("ce", "mse")

loss_option = click.option(
    "--loss",
    type=click.Choice(CLI_LOSSES),
    default=None,
    help="ce: cross-entropy on logits [B, K] (labels: class indices); mse: mean squared error "
    "on [B, D] (labels: float targets) [ce; train DIR: as compiled].",
)
tokenizer_option = click.option(
    "--tokenizer",
    default=None,
    type=click.Path(dir_okay=False),
    help="The model's tokenizer.json, for text data (--data FILE.csv|FILE.jsonl).",
)
profile_level_option = click.option(
    "--profile-level",
    type=click.Choice(["fast", "thorough"]),  # etgraph.profiler.LEVELS, written out (--help)
    default="fast",
    show_default=True,
    help="How much the profiler measures: fast (the graphs' own runs; the closed loop corrects "
    "scale and offset online) or thorough (also real training steps of every configuration, "
    "more repeats).",
)
head_lr_scale_option = click.option(
    "--head-lr-scale",
    "head_lr_scale",
    default=None,
    type=POSITIVE,
    metavar="S",
    help="Train the head (the dense layer making the output) at S times --lr, exactly: its "
    "weights stored divided by S, its output multiplied by S; the exported model folds S back. "
    "10 is the measured useful value for a fresh head [1; train DIR: as compiled].",
)


def head_lr_note(scale: float) -> str:
    """What ``--head-lr-scale`` did, in one line (compile, train and inspect print it)."""
    return (
        f"the head trains at {scale:g}x the learning rate (--head-lr-scale {scale:g}): the "
        f"compiled model and artifacts hold its weights divided by {scale:g} and multiply its "
        "output by it; the model etgraph train exports and the weights API fold it back"
    )


#: passes.onnx.FROZEN_BN_MODES, written out: importing passes.onnx here would slow --help.
FROZEN_BN_MODES = ("inference", "train")


def model_input_options(command):
    """The model's own preprocessing (etgraph.images.Preprocess) and --frozen-bn, shared by
    compile and train. None everywhere = not given (compile: the defaults; train on a compiled
    directory: the plan's)."""
    options = [
        click.option(
            "--preprocess",
            "preset",
            default=None,
            type=click.Choice(list(PREPROCESS_PRESETS), case_sensitive=False),
            help="Input normalisation preset for image folders: imagenet (torchvision), caffe "
            "(BGR, 0-255 minus mean), paddle ((x/255-0.5)/0.5), none (x/255) [imagenet; "
            "train DIR: the plan's].",
        ),
        click.option(
            "--mean", default=None, help="Per-channel mean, e.g. 0.485,0.456,0.406 [the preset's]."
        ),
        click.option(
            "--std", default=None, help="Per-channel std, e.g. 0.229,0.224,0.225 [the preset's]."
        ),
        click.option(
            "--scale",
            default=None,
            type=POSITIVE,
            help="Pixels (0-255) divided by it [the preset's].",
        ),
        click.option(
            "--channel-order",
            default=None,
            type=click.Choice(list(CHANNEL_ORDERS), case_sensitive=False),
            help="Channel order the model expects.",
        ),
        click.option(
            "--frozen-bn",
            default=None,
            type=click.Choice(list(FROZEN_BN_MODES)),
            help="Batch norms whose gamma and beta are not selected: inference (running "
            "statistics used and kept) or train (batch statistics, running statistics "
            "updated) [inference; train DIR: the plan's].",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _set_verbose(ctx: click.Context, param, value: bool) -> bool:
    if value:  # as the group's -v: progress logs
        logging.getLogger().setLevel(logging.INFO)
    return value


def progress_output(quiet: bool, verbose: bool):
    """Where a command's progress lines go: stderr at a terminal (or with -v), nowhere with -q
    or when stderr is a file or pipe (its one-line errors stay one line there)."""
    if quiet or not (verbose or sys.stderr.isatty()):
        return None
    return lambda line: click.echo(line, err=True)


def verbosity_options(command):
    """``-q/--quiet`` and ``-v/--verbose``, on every command."""
    command = click.option(
        "-v",
        "--verbose",
        is_flag=True,
        callback=_set_verbose,
        help="Show progress logs of every stage.",
    )(command)
    return click.option(
        "-q", "--quiet", is_flag=True, help="No progress lines or bars (results and errors only)."
    )(command)


def given(ctx: click.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line."""
    return ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE


def given_options(ctx: click.Context, allowed: tuple[str, ...]) -> list[str]:
    """The options given on the command line outside ``allowed``, as spelled in --help."""
    return [
        param.opts[0] if param.opts[0].startswith("-") else param.opts[0].upper()
        for param in ctx.command.params
        if param.name not in allowed and given(ctx, param.name)
    ]


def parse_duration(text: str) -> float:
    """Seconds of ``"90s"``, ``"10m"``, ``"1.5h"`` or a plain number of seconds.

    Raises:
        ConfigError: not a positive duration.
    """
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    scale = units.get(t[-1:], None)
    try:
        value = float(t[:-1] if scale else t) * (scale or 1.0)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(
            f"--deadline {text!r} is not a positive, finite duration: use e.g. 90s, 10m or 1h"
        )
    return value
