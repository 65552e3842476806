"""Weights in and out of an elastic trainer (:class:`etgraph.trainer.ElasticTrainer`): every
parameter by ONNX initializer name as numpy arrays, the tensors trained since a program last set
them (what a federated client uploads), and the AdamW moments handled as documented. A part of
the trainer kept in its own module; it reads the trainer's state between periods and its open
session.

Weights are always in the model's original parametrisation: a model loaded with
``head_lr_scale`` S stores its head's kernel and bias divided by S (:mod:`passes.onnx.head_lr`),
and these methods multiply them back on the way out and divide on the way in, so a program or a
federated server never sees the scaled values.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .checkpoint import CarriedState, read_checkpoint, write_checkpoint
from .errors import ConfigError

__all__ = ["WeightsAccess", "open_only"]


def open_only(method):
    """A trainer method that needs the trainer open: once it is closed (its sessions released,
    its run directory's lock given up, its temporary directory removed) the call raises
    :class:`etgraph.errors.ConfigError` saying so, not an error about a missing file (nor trains
    on without the lock)."""

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if self.closed:
            raise ConfigError(
                f"the trainer is closed: call {method.__name__}() before close() (inside its "
                "with-block), or resume its run directory"
            )
        return method(self, *args, **kwargs)

    return checked


class WeightsAccess:
    """:meth:`get_weights`, :meth:`set_weights`, :meth:`trained_weights` of
    :class:`etgraph.trainer.ElasticTrainer` (which holds ``_session``, ``_carried``,
    ``work_dir``, ``bounded``, ``model``, ``controller``, ``_period``, ``_since_set``,
    ``_stats_at_set`` and ``closed``)."""

    def _state_file(self) -> Path:
        """A checkpoint file of the current state (weights, moments, step): between periods the
        last period end's checkpoint (the open session has not stepped since: a federated
        client's upload no longer writes the state a second time), else the open session's
        saved to the work directory, else the carried state's file (written there if held)."""
        if self._period is None and isinstance(self._carried, Path):
            return self._carried  # between periods: the period end's checkpoint is the state
        path = self.work_dir / "state.ckpt"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self._session is not None and self._session.module is not None:
            self._session.save(path, {}, durable=False)  # the work directory's
        elif isinstance(self._carried, Path):
            return self._carried
        else:
            write_checkpoint(path, self._carried, sorted(self._carried.moments))
        return path

    def _state(self, *, copy: bool = True, moments: bool = True) -> CarriedState:
        """The current state (weights, moments, step); read from a file, as
        :func:`etgraph.checkpoint.read_checkpoint` reads it with ``copy`` and ``moments``."""
        if self._session is None and isinstance(self._carried, CarriedState):
            return self._carried
        return read_checkpoint(self._state_file(), copy=copy, moments=moments)[0]

    @open_only
    def get_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current value of every parameter: each trainable tensor (kernel, bias,
        gamma, beta, ...) and each BatchNorm running statistic, by ONNX initializer name; numpy
        arrays of the initializer's shape and dtype (float32). In the original
        parametrisation: with a head learning-rate scale S, the head's tensors are the stored
        ones times S (the values the exported model holds)."""
        held = self._state(copy=False, moments=False)  # from a file: views, copied once here
        weights = {k: np.array(v, copy=True) for k, v in held.weights.items()}
        head_lr = self.model.head_lr
        return weights if head_lr is None else head_lr.original(weights)

    @open_only
    def set_weights(self, weights: Mapping[str, np.ndarray], *, reset_moments: bool = False):
        """Overwrite parameters by initializer name (any subset of :meth:`get_weights`' names),
        e.g. a federated server's global model. The optimizer's AdamW moments of the tensors set
        are kept (Keras' ``set_weights``; the step count too), or with ``reset_moments`` zeroed
        for them (a fresh optimizer). Starts the record of :meth:`trained_weights` anew (with
        the selection of a period in progress, which trains on from these weights). The
        training session is reopened on the new state at the next step. ``weights`` are in the
        original parametrisation, as :meth:`get_weights` gives them (with a head learning-rate
        scale S the head's are stored divided by S).

        Raises:
            ConfigError: an unknown name, or an array of another shape or dtype than the
                initializer's.
        """
        head_lr = self.model.head_lr
        if head_lr is not None:
            weights = head_lr.stored(weights)
        state = self._state().updated(weights, self.model.proto, reset_moments=reset_moments)
        self._carried = state
        self.controller.forget_gradients()  # not at these weights
        if self.bounded:  # the state lives in a file (with the moments it has)
            path = self.work_dir / "set.ckpt"
            write_checkpoint(path, state, sorted(state.moments))
            self._carried = path
        self._session = None  # reopened on the new state (a baked session holds constants)
        # a period in progress trains its selection on from the weights set
        self._since_set = set(self._period.selected) if self._period is not None else set()
        stats = list(self.model.running_stats)
        self._stats_at_set = {n: np.array(state.weights[n], copy=True) for n in stats}

    @open_only
    def trained_weights(self) -> dict[str, np.ndarray]:
        """The parameters training may have changed since the last :meth:`set_weights` (or the
        start): every tensor selected in a period since, and every running statistic whose value
        changed. Copies, by initializer name (what a federated client uploads), in the original
        parametrisation (:meth:`get_weights`)."""
        weights = self.get_weights()
        names = set(self._since_set)
        at_set = self._stats_at_set or {}
        for name in self.model.running_stats:
            if name not in at_set or not np.array_equal(at_set[name], weights[name]):
                names.add(name)
        return {n: weights[n] for n in weights if n in names}
