"""The ``etgraph`` command line: thin click commands over the Python API.

Every user error is an :class:`~etgraph.errors.EtgraphError`; :func:`main` prints it as one line
``etgraph: error: ...`` on stderr and exits 1. ``--debug`` shows tracebacks of everything.

Each command imports the part of etgraph it runs when it runs, the one place in the package
where imports are not at the top: a training process on a device then holds only what training
needs. Measured (peak RSS of ``etgraph train`` on the default model): every module imported up
front adds 37 MiB (scipy's optimizer for the profiler alone 38 MiB of its own, networkx 11,
matplotlib 30) to the 283 MiB that onnxruntime-training and torch take, and 2 s to ``--help``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import click
from onnx_ir.passes import PassError

from . import __version__
from .data import CHANNEL_ORDERS, PREPROCESS_PRESETS
from .errors import (
    ConfigError,
    EtgraphError,
    ModelError,
    ProfileMismatchError,
    Terminated,
    first_line,
)
from .files import sweep_stale_temp_dirs
from .host import exit_on_sigterm, process_age_s
from .selection import STRATEGIES

#: When the command (this process) started, on the ``time.perf_counter`` clock: ``train
#: --deadline`` counts from here.
_STARTED = time.perf_counter() - process_age_s()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="etgraph")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option("-v", "--verbose", is_flag=True, help="Show progress logs.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, verbose: bool) -> None:
    """Make on-device training fast: select the tensors worth training (ElasticTrainer)."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI, turning EtgraphError into one line and exit 1,
    and any other exception (a bug) into one line naming its innermost cause and exit 3."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    exit_on_sigterm()  # temporary directories and partial files are removed on SIGTERM too
    sweep_stale_temp_dirs()  # and those of killed etgraph processes at the next start
    try:
        cli.main(args=args, prog_name="etgraph", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo(f"etgraph: interrupted{_resume_hint(args)}", err=True)
        sys.exit(130)
    except Terminated:
        click.echo(f"etgraph: terminated{_resume_hint(args)}", err=True)
        sys.exit(143)
    except click.exceptions.NoArgsIsHelpError as exc:  # a bare command: its help, as asked
        click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
        sys.exit(exc.exit_code)
    except click.ClickException as exc:  # usage errors: one line too, click's exit code (2)
        hint = f" (see `{exc.ctx.command_path} --help`)" if getattr(exc, "ctx", None) else ""
        click.echo(f"etgraph: error: {exc.format_message()}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except EtgraphError as exc:
        if debug:
            raise
        click.echo(f"etgraph: error: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:  # the file system refused a path (permissions, a file in the way)
        if debug or exc.filename is None:
            raise
        click.echo(
            f"etgraph: error: {exc.filename}: {exc.strerror}: check the path and its permissions",
            err=True,
        )
        sys.exit(1)
    except Exception as exc:  # a bug, not a user error: one line, the traceback with --debug
        if debug:
            raise
        click.echo(
            f"etgraph: internal error: {_internal_cause(exc)} "
            "(a bug: rerun with --debug for the traceback and report it)",
            err=True,
        )
        sys.exit(3)


def _resume_hint(args: list[str]) -> str:
    """For an interrupted ``etgraph train``: how to continue it (its ``--out`` or ``--resume``
    directory, from the command line, if a run was started there), else ""."""
    if "train" not in args:
        return ""
    for flag in ("--out", "--resume"):
        for i, arg in enumerate(args):
            value = args[i + 1] if arg == flag and i + 1 < len(args) else None
            if arg.startswith(f"{flag}="):
                value = arg.split("=", 1)[1]
            if value and (Path(value) / "run.json").is_file():  # etgraph.rundir.RUN_FILE
                return f": continue from the last checkpoint with `etgraph train --resume {value}`"
    return ""


def _internal_cause(exc: BaseException) -> str:
    """``Type: first line`` of the innermost explicit cause of ``exc`` (``raise ... from``),
    skipping onnx_ir's ``PassError`` wrappers (``PreconditionError: <message>``); when that cause
    is itself wrapped by another named exception, the wrapper comes first
    (``PreconditionError: Pre-condition for pass 'X' failed: KeyError: 'index'``)."""

    def text(e: BaseException) -> str:
        return f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__

    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__
    named = [e for e in chain if not (isinstance(e, PassError) and e.__cause__ is not None)]
    named = named or chain[-1:]
    if len(named) == 1:
        return text(named[0])
    return f"{text(named[-2])}: {text(named[-1])}"


# ---- commands: each parses options, calls the Python API, prints. Keep them thin. ----

_input_shape_option = click.option(
    "--input-shape",
    "input_shape",
    multiple=True,
    help="NAME=DIMS per model input (repeatable; the dims after the batch, or all dims with the "
    "batch first), or CxHxW for a one-input model, e.g. 3x224x224 [the model's own].",
)
_output_option = click.option(
    "--output",
    "model_output",
    default=None,
    help="The graph output to train on, when the model has several [its only output].",
)
#: etgraph.model.LOSSES, spelled out: importing etgraph.model here would load onnx_ir's passes
#: and onnxscript for every command (tests/test_inputs_outputs.py checks they agree).
CLI_LOSSES = ("ce", "mse")

_loss_option = click.option(
    "--loss",
    type=click.Choice(CLI_LOSSES),
    default=None,
    help="ce: cross-entropy on logits [B, K] (labels: class indices); mse: mean squared error "
    "on [B, D] (labels: float targets) [ce; train DIR: as compiled].",
)
_tokenizer_option = click.option(
    "--tokenizer",
    default=None,
    type=click.Path(dir_okay=False),
    help="The model's tokenizer.json, for text data (--data FILE.csv|FILE.jsonl).",
)
_profile_level_option = click.option(
    "--profile-level",
    type=click.Choice(["fast", "thorough"]),  # etgraph.profiler.LEVELS, written out (--help)
    default="fast",
    show_default=True,
    help="How much the profiler measures: fast (the graphs' own runs; the closed loop corrects "
    "scale and offset online) or thorough (also real training steps of every configuration, "
    "more repeats).",
)
#: passes.onnx.FROZEN_BN_MODES, written out: importing passes.onnx here would slow --help.
_FROZEN_BN_MODES = ("inference", "train")


def _model_input_options(command):
    """The model's own preprocessing (etgraph.data.Preprocess) and --frozen-bn, shared by
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
            "--scale", default=None, type=float, help="Pixels (0-255) divided by it [the preset's]."
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
            type=click.Choice(list(_FROZEN_BN_MODES)),
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


def _progress(quiet: bool, verbose: bool):
    """Where a command's progress lines go: stderr at a terminal (or with -v), nowhere with -q
    or when stderr is a file or pipe (its one-line errors stay one line there)."""
    if quiet or not (verbose or sys.stderr.isatty()):
        return None
    return lambda line: click.echo(line, err=True)


def _verbosity_options(command):
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


# [inspect]


@cli.command("inspect")
@click.argument("target", required=False, type=click.Path())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["json", "graphml", "dot", "all"]),
    default="all",
    show_default=True,
    help="Graph dump format(s) to write.",
)
@click.option(
    "-o",
    "--out",
    "out_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Directory for graph.<fmt> [TARGET dir, or <model>_graph/ next to the model].",
)
@click.option("--render", is_flag=True, help="Render the DOT dump to SVG with Graphviz.")
@click.option("--passes", "show_passes", is_flag=True, help="Print the pass pipeline and exit.")
@_output_option
@_loss_option
@_verbosity_options
def inspect_command(
    target: str | None,
    fmt: str,
    out_dir: str | None,
    render: bool,
    show_passes: bool,
    model_output: str | None,
    loss: str | None,
    quiet: bool,
    verbose: bool,
) -> None:
    """Print the tensor table of TARGET (an .onnx model, or a compiled directory: what
    `etgraph train DIR` trains) and write the tensor-level backward graph (JSON node-link,
    GraphML, DOT; the tensor chain as a picture with --render)."""
    from passes import describe_pipeline, tensor_graph_pipeline
    from passes.onnx import eval_model_pipeline, legalization_pipeline, training_model_pipeline

    from . import dumps, graph

    if show_passes:
        pipelines = (
            ("ONNX legalisation (passes/onnx/, every model loaded)", legalization_pipeline()),
            ("tensor-graph passes (passes/, on ORT's training graph)", tensor_graph_pipeline()),
            ("eval-model fix-ups (passes/onnx/, after generate_artifacts)", eval_model_pipeline()),
            (
                "training-model passes (passes/onnx/, after generate_artifacts)",
                training_model_pipeline(),
            ),
        )
        for title, pipeline in pipelines:
            click.echo(f"{title}:")
            click.echo("\n".join(describe_pipeline(pipeline, "  ")))
        return
    if target is None:  # optional only for --passes: the usual usage error otherwise
        raise click.UsageError("Missing argument 'TARGET'.", ctx=click.get_current_context())
    dumped = Path(target).is_dir() or Path(target).suffix == ".json"
    given = [o for o, v in (("--output", model_output), ("--loss", loss)) if v is not None]
    if dumped and given:
        raise ConfigError(
            f"{target} holds a graph built as it was compiled: drop {', '.join(given)} (or "
            "inspect the .onnx model with them)"
        )
    tensor_graph = graph.load_tensor_graph(target, output=model_output, loss=loss or "ce")
    click.echo(graph.format_tensor_table(graph.tensor_table(tensor_graph)))
    if tensor_graph.graph.get("num_ops") is not None:
        cov = graph.coverage(tensor_graph)
        click.echo(
            f"{len(graph.tensor_table(tensor_graph))} tensors; {cov['total']} training-graph ops, "
            f"{cov['charged']} charged (dw {cov['dw']}, dy {cov['dy']}, split {cov['split']}, "
            f"forward {cov['forward']}, loss {cov['loss']})"
        )
    if tensor_graph.graph.get("removed_head"):
        click.echo(
            f"the model's trailing {tensor_graph.graph['removed_head']} was taken off for the "
            "loss (the loss needs logits); `etgraph train` restores it on the exported model"
        )
    tpath = Path(target)
    if out_dir is None:
        out_dir = tpath if tpath.is_dir() else tpath.with_name(f"{tpath.stem}_graph")
    formats = dumps.GRAPH_FORMATS if fmt == "all" else (fmt,)
    for f in formats:
        written = dumps.write_graph(tensor_graph, Path(out_dir) / f"graph.{f}", f)
        click.echo(f"wrote {written}")
        if f == "dot" and render:
            image = dumps.render_dot(written, "svg")
            click.echo(f"wrote {image}" if image else "note: no graphviz 'dot': not rendered")
    if render and "dot" not in formats:
        click.echo("note: --render needs --format dot or all")


# [profile]


@cli.command("profile")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--batch-size", default=4, show_default=True, type=int, help="Batch size B.")
@_input_shape_option
@_output_option
@_loss_option
@_profile_level_option
@click.option("--repeats", default=None, type=int, help="Measured runs [fast 3, thorough 10].")
@click.option("--warmup", default=None, type=int, help="Discarded runs [fast 1, thorough 3].")
@click.option("--threads", default=None, type=int, help="Intra-op threads [physical cores].")
@click.option("-o", "--out", default="profile.json", show_default=True, help="Profile JSON.")
@click.option(
    "--cache-dir",
    default=None,
    help="Profile cache directory [$ETGRAPH_CACHE/profiles or ~/.cache/etgraph/profiles].",
)
@click.option("--no-cache", is_flag=True, help="Always measure; do not read or write the cache.")
@click.option(
    "--clock",
    type=click.Choice(["wall", "cpu"]),
    default="wall",
    show_default=True,
    help="Time real steps by wall clock, or by CPU time (needs --threads 1; shared machines).",
)
@_verbosity_options
def profile_command(
    model,
    batch_size,
    input_shape,
    model_output,
    loss,
    profile_level,
    repeats,
    warmup,
    threads,
    out,
    cache_dir,
    no_cache,
    clock,
    quiet,
    verbose,
):
    """Measure per-tensor backward times t_dw/t_dy of MODEL.onnx on this device (paper §5).
    `etgraph compile` profiles too (cached) and `etgraph train DIR` reuses a compiled
    directory's profile: run this one to inspect or share a profile."""
    from .files import ensure_writable_file
    from .model import LoadedModel, parse_input_shapes
    from .profile import default_cache_dir, format_shapes
    from .profiler import profile_model

    parse_input_shapes(input_shape)  # malformed text is an error before the model loads
    ensure_writable_file(out, "-o", inputs=[model])  # before measuring
    cache = None if no_cache else (cache_dir or default_cache_dir())
    prof = profile_model(
        LoadedModel.load(model, output=model_output, loss=loss or "ce"),
        batch_size=batch_size,
        input_shapes=input_shape or None,
        level=profile_level,
        repeats=repeats,
        warmup=warmup,
        threads=threads,
        cache_dir=cache,
        clock=clock,
    )
    path = prof.save(out)
    dw, dy = prof.t_dw_us, prof.t_dy_us
    click.echo(
        f"{len(prof.tensors)} tensors, batch {prof.batch_size}, input "
        f"{format_shapes(prof.input_shapes)}, {prof.threads} threads, ORT {prof.ort_version}, "
        f"level {prof.level}"
    )
    predicted = prof.t_full_us
    click.echo(
        f"full step {prof.measured_full_step_us / 1e3:.1f} ms measured, "
        f"{predicted / 1e3:.1f} ms predicted"
        f" = forward+fixed {prof.forward_us / 1e3:.1f} + t_dw {dw.sum() / 1e3:.1f}"
        f" + t_dy {dy.sum() / 1e3:.1f} ms"
    )
    for name, check in prof.checks.items():
        err = 100.0 * (check["predicted_us"] / check["measured_us"] - 1.0)
        click.echo(
            f"  check {name:<11} measured {check['measured_us'] / 1e3:8.1f} ms  "
            f"predicted {check['predicted_us'] / 1e3:8.1f} ms  ({err:+.1f}%)"
        )
    if prof.cached_from:  # nothing was measured in this process
        click.echo(
            f"wrote {path} (from the profile cache {prof.cached_from}, measured earlier in "
            f"{prof.profiling_s:.1f} s; --no-cache measures again)"
        )
    else:
        click.echo(f"wrote {path} (profiling took {prof.profiling_s:.1f} s)")


# [compile]


@cli.command("compile")
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--out",
    "out_dir",
    default="etgraph-out",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Compiled directory to write.",
)
@click.option(
    "--rho",
    default=0.5,
    show_default=True,
    type=float,
    help="Step time as a fraction of full training, in (0, 1].",
)
@click.option("--batch-size", default=4, show_default=True, type=int, help="Training batch size.")
@_input_shape_option
@_output_option
@_loss_option
@click.option(
    "--data",
    default=None,
    help="Probe data for importance: 'digits', an image-folder directory, FILE.npz (one "
    "array per model input + labels) or FILE.csv|FILE.jsonl (text, label; with --tokenizer) "
    "[none: parameter-share prior].",
)
@_tokenizer_option
@_profile_level_option
@click.option(
    "--repeats", default=None, type=int, help="Profiler repetitions [fast 3, thorough 10]."
)
@click.option("--threads", default=None, type=int, help="ORT intra-op threads [physical cores].")
@click.option(
    "--resolution",
    default=None,
    type=int,
    help="DP time resolution T_q in budget units [exact microseconds].",
)
@click.option(
    "--memory-mb",
    default=None,
    type=float,
    help="Peak-memory budget in MiB: the training process's peak RSS, libraries included "
    "[none: time budget only].",
)
@_model_input_options
@_verbosity_options
def compile_command(
    model,
    out_dir,
    rho,
    batch_size,
    input_shape,
    model_output,
    loss,
    data,
    tokenizer,
    profile_level,
    repeats,
    threads,
    resolution,
    preset,
    mean,
    std,
    scale,
    channel_order,
    frozen_bn,
    memory_mb,
    quiet,
    verbose,
) -> None:
    """Compile MODEL (default: the embedded pretrained CNN) for elastic training: tensor graph,
    profile, DP selection under rho * T_full (and a peak-memory budget with --memory-mb), and
    ONNX Runtime training artifacts in OUT; then `etgraph train OUT` trains it."""
    from .pipeline import compile_model
    from .plan import train_settings

    preprocess, frozen_bn = train_settings(
        None,
        preset=preset,
        mean=mean,
        std=std,
        scale=scale,
        channel_order=channel_order,
        frozen_bn=frozen_bn,
    )
    result = compile_model(
        model,
        out_dir,
        rho=rho,
        batch_size=batch_size,
        input_shape=input_shape or None,
        data=data,
        tokenizer=tokenizer,
        output=model_output,
        loss=loss or "ce",
        profile_level=profile_level,
        repeats=repeats,
        threads=threads,
        resolution=resolution,
        preprocess=preprocess,
        frozen_bn=frozen_bn,
        memory_mb=memory_mb,
        progress=_progress(quiet, verbose),
    )
    budget = "" if memory_mb is None else f" and {memory_mb:g} MiB"
    click.echo(
        f"{result.n_selected}/{result.n_tensors} tensors selected at rho={result.rho:g}{budget}: "
        f"predicted step {result.predicted_step_us / 1e3:.2f} ms vs full "
        f"{result.t_full_us / 1e3:.2f} ms ({result.predicted_speedup:.2f}x faster)"
    )
    if result.predicted_peak_mb is not None:
        click.echo(f"predicted peak memory {result.predicted_peak_mb:.0f} MiB")
    extra = " memory.json" if memory_mb is not None else ""
    click.echo(
        f"wrote {result.out_dir}/ plan.json profile.json{extra} graph.json|graphml|dot "
        f"artifacts/\nnext: etgraph train {result.out_dir}"
    )


# [train]


@cli.command("train")
@click.argument("model", required=False, type=click.Path())
@click.option(
    "--data",
    default=None,
    help="Dataset: 'digits' (embedded), an image-folder dir, FILE.npz (one array per model "
    "input, keyed by input name, + labels) or FILE.csv|FILE.jsonl (text, label; with "
    "--tokenizer) [digits; train DIR: the data DIR was compiled with].",
)
@_tokenizer_option
@click.option("--epochs", default=12, show_default=True, type=int, help="Training epochs.")
@click.option(
    "--batch-size", type=int, help="Batch size [4; train DIR: the batch size DIR was compiled for]."
)
@click.option("--lr", default=1e-4, show_default=True, type=float, help="Peak AdamW lr (cosine).")
@click.option("--weight-decay", default=0.01, show_default=True, type=float, help="AdamW decay.")
@click.option(
    "--rho",
    type=float,
    help="Step time / full step, in (0, 1] (within ±5% once the closed loop has measured "
    "steps) [0.5; train DIR: the rho DIR was compiled for].",
)
@click.option("--period", default=3, show_default=True, type=int, help="Epochs per re-selection.")
@click.option(
    "--strategy",
    default="elastic",
    show_default=True,
    type=click.Choice(STRATEGIES),
    help="Tensor selection: elastic (DP) or a baseline.",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Run seed.")
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
@_profile_level_option
@_input_shape_option
@_output_option
@_loss_option
@click.option("--threads", default=None, type=int, help="ORT threads [the profile's].")
@click.option(
    "--max-steps-per-epoch", default=None, type=int, help="Subsample each epoch [all its steps]."
)
@click.option(
    "--max-val-batches", default=None, type=int, help="Subsample validation [every batch]."
)
@click.option("--probe-batches", default=1, show_default=True, type=int, help="Importance batches.")
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
    type=float,
    help="Peak-memory budget in MiB for the selection (elastic) [none: time budget only].",
)
@click.option(
    "--spinning",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "off", "on", "on+stop"]),
    help="ORT thread-pool spinning of the training sessions (auto: measured at the start).",
)
@_model_input_options
@_verbosity_options
@click.pass_context
def train_command(ctx: click.Context, model, **opts):
    """Train MODEL (an `etgraph compile` directory, an ONNX file, or by default the embedded
    model and digits data) with elastic tensor selection, re-selecting every --period epochs;
    a compiled directory gives its rho, batch size, preprocessing and data unless told
    otherwise. `--resume DIR` continues an interrupted run, or extends a finished one with a
    larger --epochs."""
    from .config import load_run_data
    from .loop import resume, train
    from .rundir import format_summary

    progress = not opts["quiet"]
    if opts["resume_dir"] is not None:
        given = _given_options(ctx, allowed=("resume_dir", "quiet", "verbose", "epochs"))
        if given:
            raise ConfigError(
                f"--resume DIR continues a run as configured: drop {', '.join(given)} (or start "
                "a new run with another --out)"
            )
        epochs = opts["epochs"] if _given(ctx, "epochs") else None
        click.echo(format_summary(resume(opts["resume_dir"], progress=progress, epochs=epochs)))
        return
    if opts["out"] is None:
        raise ConfigError("missing --out DIR: where to write the log, checkpoints and model")
    plan = _compiled_plan(model)
    config = _train_config(plan, opts)  # validated before anything is measured
    loaded, profile = _train_model(model, plan, opts)
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
        started_at=_STARTED,
        memory_profile=memory_profile,
        dataset=dataset,
    )
    click.echo(format_summary(result))


def _given(ctx: click.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line."""
    return ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE


def _given_options(ctx: click.Context, allowed: tuple[str, ...]) -> list[str]:
    """The options given on the command line outside ``allowed``, as spelled in --help."""
    return [
        param.opts[0] if param.opts[0].startswith("-") else param.opts[0].upper()
        for param in ctx.command.params
        if param.name not in allowed and _given(ctx, param.name)
    ]


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
    return TrainConfig(
        epochs=opts["epochs"],
        batch_size=_or_plan(opts["batch_size"], plan, "batch_size", 4),
        learning_rate=opts["lr"],
        weight_decay=opts["weight_decay"],
        rho=_or_plan(opts["rho"], plan, "rho", 0.5),
        period=opts["period"],
        strategy=opts["strategy"],
        seed=opts["seed"],
        data=data,
        tokenizer=tokenizer,
        probe_batches=opts["probe_batches"],
        max_steps_per_epoch=opts["max_steps_per_epoch"],
        max_val_batches=opts["max_val_batches"],
        threads=opts["threads"],
        frozen_bn=frozen_bn,
        preprocess=preprocess,
        closed_loop=not opts["open_loop"],
        deadline_s=parse_duration(deadline) if deadline is not None else None,
        memory_mb=opts["memory_mb"],
        spinning=opts["spinning"],
    ).validate()


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


def _train_model(model, plan, opts: dict):
    """(LoadedModel, Profile or None) for `etgraph train`: a compiled directory's (its model
    has one output; its loss is the one it was compiled for), an ONNX file or the default. The
    profile is the given or compiled one; None = measure it (after the data is loaded)."""
    from .api import load_model
    from .model import parse_input_shapes
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
        if model is not None and not Path(model).is_file():
            raise ModelError(f"model {model} does not exist: pass an ONNX file or compiled dir")
        loaded = load_model(model, output=opts["model_output"], loss=loss or "ce")
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


# [federate] (the command lives in etgraph.federated.cli; Flower is imported when it runs)
from .federated.cli import federate_command  # noqa: E402

cli.add_command(federate_command)
