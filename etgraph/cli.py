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
from pathlib import Path

import click

from . import __version__
from .cli_options import (
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    RHO,
    head_lr_note,
    head_lr_scale_option,
    input_shape_option,
    loss_option,
    model_input_options,
    output_option,
    profile_level_option,
    progress_output,
    tokenizer_option,
    verbosity_options,
)
from .cli_train import train_command
from .errors import (
    ConfigError,
    EtgraphError,
    Terminated,
    first_line,
    resource_error,
)
from .federated.cli import federate_command
from .files import require_model_path, sweep_stale_temp_dirs
from .host import exit_on_sigterm


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="etgraph")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.option("-v", "--verbose", is_flag=True, help="Show progress logs.")
@click.pass_context
def cli(ctx: click.Context, debug: bool, verbose: bool) -> None:
    """Make on-device training fast: select the tensors worth training (ElasticTrainer).

    \b
    etgraph compile MODEL.onnx -o DIR     graph, profile, selection, ORT training artifacts
    etgraph train DIR -o RUN              elastic training (or: train MODEL.onnx -o RUN)
    etgraph inspect DIR                   the tensor table and graph dumps
    etgraph profile MODEL.onnx -o P.json  the per-tensor backward timings alone
    """
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
    except Terminated as exc:  # SIGTERM, SIGHUP: cleaned up like Ctrl-C
        click.echo(f"etgraph: terminated{_resume_hint(args)}", err=True)
        sys.exit(128 + exc.signum)
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
        _exit_if_out_of_resources(exc, args)
        click.echo(f"etgraph: error: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:  # the file system refused a path (permissions, a file in the way)
        if debug:
            raise
        _exit_if_out_of_resources(exc, args)
        if exc.filename is None:
            raise
        click.echo(
            f"etgraph: error: {exc.filename}: {exc.strerror}: check the path and its permissions",
            err=True,
        )
        sys.exit(1)
    except Exception as exc:  # a bug, not a user error: one line, the traceback with --debug
        if debug:
            raise
        _exit_if_out_of_resources(exc, args)
        click.echo(
            f"etgraph: internal error: {_internal_cause(exc)} "
            "(a bug: rerun with --debug for the traceback and report it)",
            err=True,
        )
        sys.exit(3)


def _exit_if_out_of_resources(exc: Exception, args: list[str]) -> None:
    """Memory or disk ran out (:func:`etgraph.errors.resource_error`): one line saying so (and
    how to continue an interrupted run), exit 1."""
    resource = resource_error(exc)
    if resource is not None:
        click.echo(f"etgraph: error: {resource}{_resume_hint(args)}", err=True)
        sys.exit(1)


def _resume_hint(args: list[str]) -> str:
    """For an interrupted ``etgraph train`` or ``etgraph federate``: how to continue it (its
    ``--out``/``-o`` or ``--resume`` directory, from the command line, if a run was started
    there), else ""."""
    command = next((c for c in ("train", "federate") if c in args), None)
    if command is None:
        return ""
    for flag in ("--out", "-o", "--resume"):
        for i, arg in enumerate(args):
            value = args[i + 1] if arg == flag and i + 1 < len(args) else None
            if arg.startswith(f"{flag}=") or (
                flag == "-o" and arg.startswith("-o") and arg != flag
            ):
                value = arg.removeprefix(flag).removeprefix("=")
            if value and (Path(value) / "run.json").is_file():  # both commands' RUN_FILE
                return (
                    f": continue from the last checkpoint with `etgraph {command} --resume {value}`"
                )
    return ""


def _internal_cause(exc: BaseException) -> str:
    """``Type: first line`` of the innermost explicit cause of ``exc`` (``raise ... from``),
    skipping onnx_ir's ``PassError`` wrappers (``PreconditionError: <message>``); when that cause
    is itself wrapped by another named exception, the wrapper comes first
    (``PreconditionError: Pre-condition for pass 'X' failed: KeyError: 'index'``)."""

    from onnx_ir.passes import PassError  # imports sympy (~1 s): not on every CLI start

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
@click.option(
    "--render",
    is_flag=True,
    help="Render the DOT dump to SVG with Graphviz (without it: the tensor chain to chain.png).",
)
@click.option("--passes", "show_passes", is_flag=True, help="Print the pass pipeline and exit.")
@output_option
@loss_option
@verbosity_options
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
    if show_passes:
        from passes import describe_pipeline, tensor_graph_pipeline
        from passes.onnx import (
            eval_model_pipeline,
            legalization_pipeline,
            training_model_pipeline,
        )

        pipelines = (
            (
                "ONNX legalisation (passes/onnx/, every model loaded; the last with "
                "--head-lr-scale only)",
                legalization_pipeline(head_lr_scale=10.0),
            ),
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
    if not dumped:
        require_model_path(target, directory_ok=True)  # before the imports (seconds)
    given = [o for o, v in (("--output", model_output), ("--loss", loss)) if v is not None]
    if dumped and given:
        raise ConfigError(
            f"{target} holds a graph built as it was compiled: drop {', '.join(given)} (or "
            "inspect the .onnx model with them)"
        )
    from . import dumps, graph

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
    if tensor_graph.graph.get("head_lr_scale", 1.0) != 1.0:
        click.echo(head_lr_note(tensor_graph.graph["head_lr_scale"]))
    tpath = Path(target)
    if out_dir is None:
        out_dir = tpath if tpath.is_dir() else tpath.with_name(f"{tpath.stem}_graph")
    formats = dumps.GRAPH_FORMATS if fmt == "all" else (fmt,)
    for f in formats:
        written = dumps.write_graph(tensor_graph, Path(out_dir) / f"graph.{f}", f)
        click.echo(f"wrote {written}")
        if f == "dot" and render and (image := dumps.render_dot(written, "svg")) is not None:
            click.echo(f"wrote {image}")
        elif f == "dot" and render:  # no Graphviz: the tensor chain drawn with matplotlib
            from .plots import plot_tensor_chain

            chain = plot_tensor_chain(graph.tensor_table(tensor_graph), Path(out_dir) / "chain.png")
            click.echo(f"wrote {chain} (no graphviz 'dot' for the full graph: the tensor chain)")
    if render and "dot" not in formats:
        click.echo("note: --render needs --format dot or all")


# [profile]


@cli.command("profile")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--batch-size", default=4, show_default=True, type=POSITIVE_INT, help="Batch size B.")
@input_shape_option
@output_option
@loss_option
@profile_level_option
@click.option(
    "--repeats", default=None, type=POSITIVE_INT, help="Measured runs [fast 3, thorough 10]."
)
@click.option(
    "--warmup", default=None, type=NON_NEGATIVE_INT, help="Discarded runs [fast 1, thorough 3]."
)
@click.option(
    "--threads", default=None, type=POSITIVE_INT, help="Intra-op threads [physical cores]."
)
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
@verbosity_options
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
    require_model_path(model)  # before the imports (seconds)
    from . import onnx_io
    from .files import ensure_writable_file
    from .io_specs import parse_input_shapes
    from .model import LoadedModel
    from .profile import default_cache_dir, format_shapes
    from .profiler import profile_model

    parse_input_shapes(input_shape)  # malformed text is an error before the model loads
    # before measuring; not the model nor its external data
    ensure_writable_file(out, "-o", inputs=onnx_io.model_files(model))
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
    type=RHO,
    help="Step time as a fraction of full training, in (0, 1].",
)
@click.option(
    "--batch-size", default=4, show_default=True, type=POSITIVE_INT, help="Training batch size."
)
@input_shape_option
@output_option
@loss_option
@click.option(
    "--data",
    default=None,
    help="Probe data for importance: 'digits', an image-folder directory, FILE.npz (one "
    "array per model input + labels) or FILE.csv|FILE.jsonl (text, label; with --tokenizer) "
    "[none: parameter-share prior].",
)
@tokenizer_option
@profile_level_option
@click.option(
    "--repeats", default=None, type=POSITIVE_INT, help="Profiler repetitions [fast 3, thorough 10]."
)
@click.option(
    "--threads", default=None, type=POSITIVE_INT, help="ORT intra-op threads [physical cores]."
)
@click.option(
    "--resolution",
    default=None,
    type=POSITIVE_INT,
    help="DP time resolution T_q in budget units [exact microseconds].",
)
@click.option(
    "--memory-mb",
    default=None,
    type=POSITIVE,
    help="Peak-memory budget in MiB: the training process's peak RSS, libraries included "
    "[none: time budget only].",
)
@head_lr_scale_option
@model_input_options
@verbosity_options
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
    head_lr_scale,
    quiet,
    verbose,
) -> None:
    """Compile MODEL (default: the embedded pretrained CNN) for elastic training: tensor graph,
    profile, DP selection under rho * T_full (and a peak-memory budget with --memory-mb), and
    ONNX Runtime training artifacts in OUT; then `etgraph train OUT` trains it."""
    if model is not None:
        require_model_path(model)  # before the imports (seconds)
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
        head_lr_scale=head_lr_scale,
        progress=progress_output(quiet, verbose),
    )
    budget = "" if memory_mb is None else f" and {memory_mb:g} MiB"
    click.echo(
        f"{result.n_selected}/{result.n_tensors} tensors selected at rho={result.rho:g}{budget}: "
        f"predicted step {result.predicted_step_us / 1e3:.2f} ms vs full "
        f"{result.t_full_us / 1e3:.2f} ms ({result.predicted_speedup:.2f}x faster)"
    )
    if result.predicted_peak_mb is not None:
        click.echo(f"predicted peak memory {result.predicted_peak_mb:.0f} MiB")
    if result.head_lr_scale != 1.0:
        click.echo(head_lr_note(result.head_lr_scale))
    extra = " memory.json" if memory_mb is not None else ""
    click.echo(
        f"wrote {result.out_dir}/ plan.json profile.json{extra} graph.json|graphml|dot "
        f"artifacts/\nnext: etgraph train {result.out_dir}"
    )


cli.add_command(train_command)
cli.add_command(federate_command)  # etgraph.federated.cli: Flower is imported when it runs
