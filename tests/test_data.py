"""Datasets: the embedded digits transfer task and image-folder directories."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from PIL import Image

from etgraph import data
from etgraph.data import load_dataset
from etgraph.errors import DataError
from etgraph.images import IMAGENET_MEAN, IMAGENET_STD
from etgraph.labels import map_labels, set_class_names
from etgraph.model import LoadedModel

SHAPE = (3, 32, 32)


# ----------------------------------------------------------------------------- digits


def test_digits_transfer_task_shapes_and_classes():
    ds = load_dataset(None, input_shape=SHAPE, num_classes=5)
    assert ds.name == "digits"
    assert ds.num_classes == 5 and ds.class_names == ["5", "6", "7", "8", "9"]
    _, labels = data.load_digits_arrays()
    assert ds.n_train + ds.n_val == int(np.isin(labels, data.DIGITS_TRANSFER_CLASSES).sum())
    assert 0.18 < ds.n_val / (ds.n_train + ds.n_val) < 0.22
    x, y = next(ds.train_batches(4, seed=0))
    assert x.shape == (4, *SHAPE) and x.dtype == np.float32
    assert y.shape == (4,) and y.dtype == np.int64
    assert set(np.unique(ds.labels)) == set(range(5))
    # grey replicated to 3 channels
    np.testing.assert_array_equal(x[:, 0], x[:, 1])
    assert ds.steps_per_epoch(4) == ds.n_train // 4
    assert sum(1 for _ in ds.train_batches(4, seed=0)) == ds.n_train // 4


def test_digits_relabel_matches_source_digits():
    """Label 0 of the transfer task is digit 5: its images equal the pretraining pipeline's
    images of digit 5 (same resize), and the pretraining task uses digits 0-4."""
    images, labels = data.load_digits_arrays()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8 and images.max() == 16
    pre = data.load_digits_task(data.DIGITS_PRETRAIN_CLASSES, input_shape=SHAPE)
    assert pre.class_names == ["0", "1", "2", "3", "4"]
    assert pre.n_train + pre.n_val == int(np.isin(labels, range(5)).sum())


def test_digits_split_is_disjoint_stratified_and_deterministic():
    a = load_dataset("digits", input_shape=SHAPE, seed=0)
    b = load_dataset("digits", input_shape=SHAPE, seed=0)
    c = load_dataset("digits", input_shape=SHAPE, seed=1)
    assert not set(a.train_index) & set(a.val_index)
    assert a.n_train + a.n_val == a.labels.size
    np.testing.assert_array_equal(a.val_index, b.val_index)
    assert not np.array_equal(a.val_index, c.val_index)
    assert set(np.unique(a.labels[a.val_index])) == set(range(5))
    xa, ya = next(a.train_batches(8, seed=5))
    xb, yb = next(b.train_batches(8, seed=5))
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
    x6, _ = next(a.train_batches(8, seed=6))
    assert not np.array_equal(xa, x6), "a different epoch seed must reorder the data"
    px, py = a.probe_batch(4, seed=9)
    qx, qy = a.probe_batch(4, seed=9)
    np.testing.assert_array_equal(px, qx)
    np.testing.assert_array_equal(py, qy)


def test_digits_are_normalised_and_never_flipped():
    ds = load_dataset(None, input_shape=SHAPE)
    assert ds.augment_flip is False
    everything = ds._load(np.arange(ds.labels.size))
    assert abs(float(everything.mean())) < 1e-3 and abs(float(everything.std()) - 1) < 1e-3
    # a training batch holds exactly the stored (unflipped) images, in shuffled order
    order = np.random.default_rng(3).permutation(ds.train_index)[:16]
    x, _ = next(ds.train_batches(16, seed=3))
    np.testing.assert_array_equal(x, ds._load(order))


def test_val_batches_cover_validation_set_once():
    ds = load_dataset(None, input_shape=(1, 16, 16))
    batches = list(ds.val_batches(50))
    assert sum(len(y) for _, y in batches) == ds.n_val
    assert batches[0][0].shape == (50, 1, 16, 16)
    np.testing.assert_array_equal(np.concatenate([y for _, y in batches]), ds.labels[ds.val_index])
    # the first batch (a capped validation, --max-val-batches 1) covers every class evenly
    _, first = next(ds.val_batches(10))
    assert np.bincount(first, minlength=len(ds.class_names)).tolist() == [2] * 5


# ----------------------------------------------------------------------------- image folders


def make_folder(root, classes=("cat", "dog", "eel"), per_class=5, size=(12, 10)):
    """Tiny PNGs: class i is a solid colour with a white left column (so flips show)."""
    for i, name in enumerate(classes):
        d = root / name
        d.mkdir(parents=True)
        for j in range(per_class):
            arr = np.zeros((size[1], size[0], 3), dtype=np.uint8)
            arr[..., i % 3] = 200
            arr[:, 0] = 255
            Image.fromarray(arr).save(d / f"img{j}.png")
    return root


def test_image_folder_loads_classes_shapes_and_normalisation(tmp_path):
    root = make_folder(tmp_path / "ds")
    (root / ".hidden").mkdir()
    (root / "cat" / "notes.txt").write_text("not an image")
    ds = load_dataset(str(root), input_shape=(3, 8, 8), num_classes=10, val_fraction=0.2)
    assert ds.class_names == ["cat", "dog", "eel"]
    assert ds.n_train == 12 and ds.n_val == 3
    assert ds.augment_flip is True
    x, y = next(ds.val_batches(3))
    assert x.shape == (3, 3, 8, 8) and x.dtype == np.float32
    np.testing.assert_array_equal(y, [0, 1, 2])
    # interior pixel of class 0: R = 200/255, G = B = 0, ImageNet-normalised
    expected = (np.array([200 / 255, 0, 0], dtype=np.float32) - IMAGENET_MEAN) / IMAGENET_STD
    np.testing.assert_allclose(x[0, :, 4, 4], expected, atol=1e-5)


def test_hidden_folders_inside_a_class_are_skipped(tmp_path):
    """As hidden class folders are: thumbnails in cat/.thumbnails/ were examples of cat (copies
    of its images, some in validation); nested visible folders still count."""
    root = make_folder(tmp_path / "ds", classes=("cat", "dog"), per_class=5)
    for name in (".thumbnails", "more"):
        (root / "cat" / name).mkdir()
        (root / "cat" / name / "img0.png").write_bytes((root / "cat" / "img0.png").read_bytes())
    ds = load_dataset(root, input_shape=SHAPE)
    assert int((ds.labels == 0).sum()) == 6


def test_image_folder_flips_only_training_batches(tmp_path):
    root = make_folder(tmp_path / "ds", classes=("a", "b"), per_class=8, size=(8, 8))
    ds = load_dataset(root, input_shape=(3, 8, 8))
    white = (1.0 - IMAGENET_MEAN[1]) / IMAGENET_STD[1]
    for x, _ in ds.val_batches(8):
        assert np.allclose(x[:, 1, :, 0], white) and not np.allclose(x[:, 1, :, -1], white)
    # training images carry their white column on the left (unflipped) or right (flipped)
    left = right = 0
    for seed in range(5):
        for x, _ in ds.train_batches(2, seed=seed):
            for img in x:
                left += bool(np.allclose(img[1, :, 0], white, atol=1e-5))
                right += bool(np.allclose(img[1, :, -1], white, atol=1e-5))
    assert left > 0 and right > 0 and left + right == 5 * (ds.n_train // 2) * 2


def test_grey_input_shape(tmp_path):
    root = make_folder(tmp_path / "ds", classes=("a", "b"), per_class=3)
    ds = load_dataset(root, input_shape=(1, 6, 6))
    x, _ = next(ds.train_batches(2, seed=0))
    assert x.shape == (2, 1, 6, 6)


# ----------------------------------------------------------------------------- errors


def test_missing_directory(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(tmp_path / "nope", input_shape=SHAPE)


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is empty"):
        load_dataset(tmp_path / "empty", input_shape=SHAPE)


def test_no_class_subfolders(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    Image.new("RGB", (4, 4)).save(root / "a.png")
    with pytest.raises(DataError, match="no class sub-folders"):
        load_dataset(root, input_shape=SHAPE)


def test_broken_link_is_named(tmp_path):
    root = make_folder(tmp_path / "ds", classes=("a", "b"), per_class=2)
    (root / "b" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(DataError, match=r"gone.png is a broken link \(1 in .*b\): fix or remove"):
        load_dataset(root, input_shape=SHAPE)


def test_one_class_is_refused(tmp_path):
    root = make_folder(tmp_path / "ds", classes=("only",), per_class=6)
    with pytest.raises(DataError, match="has 1 class: a classifier learns nothing from one"):
        load_dataset(root, input_shape=SHAPE)


def test_class_folder_without_images(tmp_path):
    root = make_folder(tmp_path / "ds", classes=("a",), per_class=2)
    (root / "b").mkdir()
    with pytest.raises(DataError, match="has no images"):
        load_dataset(root, input_shape=SHAPE)


def test_unreadable_image_names_the_file(tmp_path):
    root = make_folder(tmp_path / "ds", classes=("a", "b"), per_class=2)
    bad = root / "b" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(DataError, match="broken.png"):
        load_dataset(root, input_shape=SHAPE)


def test_a_phone_photo_is_decoded_upright(tmp_path, caplog, monkeypatch):
    """A JPEG stored as the sensor saw it (40 wide, 20 high, left half white) with EXIF
    Orientation 6 ("turn 90 degrees clockwise to show"): shown upright it is 20 wide, 40 high,
    top half white. It was decoded as stored: the model trained it lying on its side. A tag
    that cannot be read leaves the picture as stored, with a warning naming the file."""
    from PIL import ImageOps

    from etgraph.images import decode_image

    stored = np.zeros((20, 40, 3), np.uint8)
    stored[:, :20] = 255
    img = Image.fromarray(stored)
    exif = img.getexif()
    exif[0x0112] = 6  # Orientation
    img.save(tmp_path / "phone.jpg", exif=exif, quality=95)
    x = decode_image(tmp_path / "phone.jpg", (8, 8), "RGB")[:, :, 0]
    assert x[:3].min() > 200 and x[5:].max() < 50  # top half white, bottom black

    def unreadable(*_, **__):  # what Pillow raises on some broken EXIF blocks (datasets #7668)
        raise SyntaxError("not a TIFF file")

    monkeypatch.setattr(ImageOps, "exif_transpose", unreadable)
    x = decode_image(tmp_path / "phone.jpg", (8, 8), "RGB")[:, :, 0]
    assert x[:, :3].min() > 200 and x[:, 5:].max() < 50  # as stored: left half white
    assert "phone.jpg: its EXIF orientation cannot be read (not a TIFF file)" in caplog.text


def test_photos_etgraph_cannot_read_are_named_not_left_out_silently(tmp_path, caplog):
    """A phone's HEIC photos (and camera raw) beside JPEGs in a class folder were left out
    of training without a word; a folder of them only said it "has no images". JPEG's other
    suffixes (.jfif, Windows' save name; .jpe) were left out too: they are read now."""
    root = make_folder(tmp_path / "ds", classes=("a", "b"), per_class=2)
    (root / "a" / "IMG_0001.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic")
    (root / "a" / "IMG_0002.heic").write_bytes(b"\x00\x00\x00\x18ftypheic")
    (root / "b" / "DSC_0001.dng").write_bytes(b"II*\x00")
    (root / "b" / "notes.txt").write_text("not a photo: not named")
    (root / "b" / "img0.png").rename(root / "b" / "img0.jfif")  # a PNG, whatever its name
    ds = load_dataset(root, input_shape=SHAPE, val_fraction=0)
    assert ds.n_train == 4  # the .jfif included
    assert "3 photos under" in caplog.text and "(1 .dng, 2 .heic)" in caplog.text
    only = tmp_path / "heic"
    (only / "a").mkdir(parents=True)
    (only / "a" / "IMG_0001.heic").write_bytes(b"\x00\x00\x00\x18ftypheic")
    make_folder(only, classes=("b",), per_class=1)
    with pytest.raises(DataError, match=r"class folder .*a has only photos etgraph cannot "
                       r"read \(1 .heic\): convert them to JPEG or PNG"):  # fmt: skip
        load_dataset(only, input_shape=SHAPE)


def test_an_image_folder_is_decoded_once_per_run_within_its_cache(
    tmp_path, default_model, monkeypatch
):
    """Decoded images are kept (up to ``cache_mb``): the second epoch reads no file (they are
    deleted here) and gives the same batches. Before, every epoch decoded every file again (a
    12 MP phone photo: 150-200 ms, against a 50-110 ms ResNet-18 step at 64 px). Without a
    cache (0, and under a memory budget: the budget does not count it) files are read again."""
    from etgraph.config import TrainConfig, load_run_data
    from etgraph.io_specs import input_shapes

    make_folder(tmp_path / "ds0", classes=("a", "b"), per_class=3)
    root = make_folder(tmp_path / "ds", classes=("a", "b"), per_class=3)
    ds = load_dataset(root, input_shape=SHAPE, val_fraction=0)
    first = np.concatenate([x for x, _ in ds.train_batches(2, seed=0)])
    for f in root.rglob("*.png"):
        f.unlink()
    again = np.concatenate([x for x, _ in ds.train_batches(2, seed=0)])
    np.testing.assert_array_equal(first, again)
    decoded = []
    real = data.decode_image
    monkeypatch.setattr(data, "decode_image", lambda *a: decoded.append(a[0]) or real(*a))
    one = SHAPE[0] * SHAPE[1] * SHAPE[2]  # bytes of one decoded image (uint8)
    for cache_mb, decodes in ((0.0, 12), (2 * one / 2**20, 10)):  # none kept; two kept
        decoded.clear()
        ds = load_dataset(root.parent / "ds0", input_shape=SHAPE, val_fraction=0, cache_mb=cache_mb)
        for epoch in range(2):
            list(ds.train_batches(2, seed=epoch))
        assert len(decoded) == decodes
    monkeypatch.undo()
    shapes = input_shapes(default_model.proto)
    root = make_folder(tmp_path / "budget", classes=("a", "b"), per_class=3)
    config = TrainConfig(data=str(root), memory_mb=900.0, val_fraction=0.0)
    ds = load_run_data(config, default_model, shapes)
    list(ds.train_batches(2, seed=0))
    for f in root.rglob("*.png"):
        f.write_bytes(b"gone")
    with pytest.raises(DataError, match="cannot read image"):
        list(ds.train_batches(2, seed=1))


def test_truncated_image_fails_at_batch_time_with_file_name(tmp_path):
    root = make_folder(tmp_path / "ds", classes=("a",), per_class=2)
    good = (root / "a" / "img0.png").read_bytes()
    (root / "a" / "img1.png").write_bytes(good[: len(good) // 2])
    ds = data.load_image_folder(root, input_shape=SHAPE, check_images=False, val_fraction=0)
    with pytest.raises(DataError, match="img1.png"):
        list(ds.train_batches(2, seed=0))


def test_more_classes_than_model_outputs(tmp_path):
    root = make_folder(tmp_path / "ds", classes=("a", "b", "c"), per_class=2)
    with pytest.raises(DataError, match="3 classes but the model outputs 2"):
        load_dataset(root, input_shape=SHAPE, num_classes=2)
    with pytest.raises(DataError, match="5 classes but the model outputs 4"):
        load_dataset(None, input_shape=SHAPE, num_classes=4)


def test_bad_arguments(tmp_path):
    with pytest.raises(DataError, match="input shape"):
        load_dataset(None, input_shape=(4, 32, 32))
    with pytest.raises(DataError, match="validation fraction"):
        load_dataset(None, input_shape=SHAPE, val_fraction=1.0)
    root = make_folder(tmp_path / "ds", classes=("a", "b"), per_class=3)
    ds = load_dataset(root, input_shape=SHAPE)
    with pytest.raises(DataError, match="fewer than the batch size"):
        next(ds.train_batches(8, seed=0))


def test_a_trained_heads_class_names_keep_their_indices(tmp_path, default_model_path):
    """A model etgraph trained carries its class names (metadata): data of a subset of them
    (fine-tuning it again) keeps the head's indices instead of renumbering the folders from 0,
    which trained sport texts on business's output; data of new names is a new task."""
    proto = onnx.load(str(default_model_path))
    set_class_names(proto, ["ant", "bee", "cat", "dog", "eel"])
    model = LoadedModel.from_proto(proto, source=default_model_path)
    assert model.task.class_names == ("ant", "bee", "cat", "dog", "eel")

    def load(root):
        return data.load_task_data(
            root, inputs=model.inputs, shapes=model.input_shapes(), task=model.task
        )

    ds = load(make_folder(tmp_path / "known", classes=("bee", "eel"), per_class=2))
    assert ds.class_names == ["ant", "bee", "cat", "dog", "eel"]
    assert sorted(set(ds.labels.tolist())) == [1, 4]
    ds = load(make_folder(tmp_path / "new", classes=("x", "y"), per_class=2))
    assert ds.class_names == ["x", "y"] and sorted(set(ds.labels.tolist())) == [0, 1]
    with pytest.raises(DataError, match="has 1 class"):
        load(make_folder(tmp_path / "one", classes=("bee",), per_class=2))
    names, labels = map_labels(["tech", "sport"], known=["business", "sport", "tech"])
    assert names == ["business", "sport", "tech"] and labels.tolist() == [2, 1]
    assert map_labels(["a", "b"], known=["b", "c"])[0] == ["a", "b"]
