"""What every dataset shares: the train/validation split (stratified per class, or random),
the batch-size and class-count checks, and :class:`Split`, the base of
:class:`etgraph.data.Dataset` and :class:`etgraph.arrays.ArrayDataset`."""

from __future__ import annotations

import numpy as np

from .errors import ConfigError, DataError

Batch = tuple[np.ndarray, np.ndarray]


class Split:
    """What :class:`Dataset` and :class:`ArrayDataset` share: class names and the
    train/validation index split (``class_names``, ``train_index``, ``val_index`` fields)."""

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def n_train(self) -> int:
        return int(self.train_index.size)

    def check_probe_batches(self, batch_size: int, probe_batches: int) -> None:
        """Refuse more importance probe batches than the training set has batches (they are
        drawn from it and held in memory together: 100000 of them took 5 GB and minutes).

        Raises:
            ConfigError: ``probe_batches`` exceeds the training set's batches of
                ``batch_size`` (the message gives the largest count).
        """
        most = max(1, self.n_train // batch_size)
        if probe_batches > most:
            raise ConfigError(
                f"--probe-batches {probe_batches} is more than the {most} batches of "
                f"{batch_size} in the training set of {self.name} ({self.n_train} examples): "
                f"pass at most {most}"
            )

    @property
    def n_val(self) -> int:
        return int(self.val_index.size)

    def steps_per_epoch(self, batch_size: int, *, drop_last: bool = True) -> int:
        """Number of training batches :meth:`train_batches` yields per epoch."""
        check_batch_size(batch_size)
        full, rest = divmod(self.n_train, batch_size)
        return full if drop_last else full + (rest > 0)


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise DataError(f"batch size must be >= 1, got {batch_size}")


def stratified_split(
    labels: np.ndarray, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices per class: ``round(val_fraction * n_c)`` of class c go to validation
    (at least one when the class has >= 2 examples and ``val_fraction > 0``).

    Returns ``(train, val)``: train sorted; val interleaved class by class (one example of
    each class, then the next of each, ...), so the first batches of a capped validation
    (``--max-val-batches``) cover every class rather than the first classes only.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"validation fraction must be in [0, 1), got {val_fraction}")
    rng = np.random.default_rng(seed)
    train, val, rank = [], [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val = int(round(val_fraction * idx.size))
        if val_fraction > 0 and idx.size >= 2:
            n_val = min(max(n_val, 1), idx.size - 1)
        val.append(np.sort(idx[:n_val]))
        rank.append(np.arange(n_val))
        train.append(idx[n_val:])
    val_index, val_rank = np.concatenate(val), np.concatenate(rank)
    interleaved = val_index[np.lexsort((val_index, val_rank))]
    return np.sort(np.concatenate(train)), interleaved


def random_split(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(n)`` at random: ``round(val_fraction * n)`` to validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"validation fraction must be in [0, 1), got {val_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_val = min(int(round(val_fraction * n)), max(n - 1, 0))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def check_num_classes(name: str, n_data: int, num_classes: int | None) -> None:
    if n_data < 2:
        raise DataError(
            f"dataset {name} has {n_data} class: a classifier learns nothing from one; give one "
            "sub-directory of images per class, two or more"
        )
    if num_classes is not None and n_data > num_classes:
        raise DataError(
            f"dataset {name} has {n_data} classes but the model outputs {num_classes}: "
            "use a model with a wider output layer or fewer class folders"
        )
