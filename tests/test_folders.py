"""Users' own captcha folders, as they come: label-sorted listings, odd modes, sizes and formats, broken files,
leakage between the folders, a decoded cache. Real image files written here (PNG, JPEG, truncated bytes, text);
real Ray where ranks are involved."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raysweep.cli import main
from raysweep.config import DataConfig
from raysweep.data import load_data, write_captcha_folder
from raysweep.data.folder import read_folder
from raysweep.errors import UserError

from conftest import tiny_spec, write_spec

CHARSET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
W, H = 64, 24


def _read(folder: Path, **kwargs):
    return read_folder(folder, CHARSET, 4, W, H, **kwargs)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def _copy_of_first(folder: Path) -> Image.Image:
    with Image.open(sorted(folder.glob("*.png"))[0]) as im:
        return im.copy()


# ---------------------------------------------------------------------------------------------
# Fair shards


def _rank_epochs(config: dict) -> None:
    """A Ray Train worker: the training samples this rank gets in epochs 1 and 2, built exactly as a warm group's
    rank builds its data (worker.shard.rank_shards) and dealt as train_one_epoch deals it (worker.shard.epoch_plan)."""
    import ray
    import ray.train
    import torch

    from raysweep.worker.shard import epoch_plan, rank_shards

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    train, _ = rank_shards(ray.get(config["data"]), 36, torch.device("cpu"), rank, world)
    for epoch in (1, 2):
        plan = epoch_plan(len(train), config["micro_batches"], config["micro_batch"], config["seed"], epoch, rank,
                          world).ravel()
        np.save(Path(config["out"]) / f"rank{rank}-epoch{epoch}.npy", plan)


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_every_rank_trains_on_a_uniform_sample_of_a_label_sorted_folder(ray_cluster, tmp_path):
    """A train and a validation folder of real PNGs, named by label (so listed in label order), 3 ranks through
    Ray Train: each rank's share of an epoch has the whole set's label mix within sampling error, the shares are
    disjoint, and the next epoch deals new ones. Before the fix rank 0 held the first third of the alphabet (mean
    first-character index 5.4 against the set's 17.4, sd 10.5)."""
    import ray
    from ray.train import RunConfig, ScalingConfig

    from raysweep.config import load_config
    from raysweep.trainer import _trainer_class

    write_captcha_folder(tmp_path / "train", 900, CHARSET, 4, W, H, seed=1)
    write_captcha_folder(tmp_path / "val", 90, CHARSET, 4, W, H, seed=2)
    spec = write_spec(tmp_path, tiny_spec(tmp_path, data={"train_dir": str(tmp_path / "train"),
                                                          "val_dir": str(tmp_path / "val")},
                                          scaling={"num_workers": 3, "cpus_per_worker": 0.5}))
    config = load_config(spec)
    data = load_data(config.data)
    firsts = data.train.labels[:, 0]
    assert (np.diff(firsts.astype(int)) >= 0).all()  # the listing is label-sorted: the case users bring
    trial = config.trials.trial({}, len(data.train))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    _trainer_class()(_rank_epochs, train_loop_config={"data": ray.put(data.for_workers()), "out": str(tmp_path),
                                                      "micro_batches": trial.micro_batches_per_epoch,
                                                      "micro_batch": trial.micro_batch_size,
                                                      "seed": config.train.seed},
                     scaling_config=ScalingConfig(num_workers=3, resources_per_worker={"CPU": 0.5}),
                     run_config=RunConfig(storage_path=str(tmp_path / "ray"))).fit()
    plans = {(r, e): np.load(tmp_path / f"rank{r}-epoch{e}.npy") for r in range(3) for e in (1, 2)}
    whole_mean, whole_sd = firsts.mean(), firsts.std()
    expected = np.bincount(data.train.labels.ravel(), minlength=36) / data.train.labels.size
    for r in range(3):
        labels = data.train.labels[plans[r, 1]]
        assert len(labels) >= 280
        # the mean first character within 4 standard errors of the whole set's
        assert abs(labels[:, 0].mean() - whole_mean) < 4 * whole_sd / np.sqrt(len(labels)), (r, labels[:, 0].mean())
        # every character, every position: a chi-square against the whole set's mix (35 dof; p = 0.001 at 66.6)
        counts = np.bincount(labels.ravel(), minlength=36)
        chi2 = ((counts - expected * labels.size) ** 2 / (expected * labels.size)).sum()
        assert chi2 < 66.6, (r, chi2)
    for e in (1, 2):
        dealt = np.concatenate([plans[r, e] for r in range(3)])
        assert len(np.unique(dealt)) == len(dealt)  # an epoch's shares are disjoint
    for r in range(3):
        again = len(np.intersect1d(plans[r, 1], plans[r, 2])) / len(plans[r, 1])
        assert again < 0.6, (r, again)  # a new share each epoch (a third of it, by chance, the same samples)


@pytest.mark.parametrize("source", ["folder", "held-out split", "synthetic"])
def test_shares_are_uniform_whatever_the_source(tmp_path, source):
    """The label mix of each of 3 ranks' shares matches the whole set's for every way data comes in."""
    from raysweep.worker.shard import epoch_plan

    if source == "synthetic":
        cfg = DataConfig(width=W, height=H, synthetic={"train_size": 600, "val_size": 30, "seed": 0})
    else:
        write_captcha_folder(tmp_path / "d", 660, CHARSET, 4, W, H, seed=3)
        cfg = DataConfig(train_dir=tmp_path / "d", val_fraction=0.1 if source != "folder" else 0.5, width=W, height=H)
    train = load_data(cfg).train
    firsts = train.labels[:, 0].astype(float)
    for rank in range(3):
        plan = epoch_plan(len(train), 5, len(train) // 3 // 5, 0, 1, rank, 3).ravel()
        assert abs(firsts[plan].mean() - firsts.mean()) < 4 * firsts.std() / np.sqrt(len(plan)), (source, rank)


# ---------------------------------------------------------------------------------------------
# What users' folders hold


def test_lowercase_labels_against_an_uppercase_charset_are_read_as_uppercase_and_said(tmp_path):
    write_captcha_folder(tmp_path, 3, CHARSET, 4, W, H)
    _copy_of_first(tmp_path).save(tmp_path / "a1bz_extra.png")
    _copy_of_first(tmp_path).save(tmp_path / "q9x0.png")  # a bare TEXT.png name
    read = _read(tmp_path)
    texts = ["".join(CHARSET[i] for i in row) for row in read.arrays.labels]
    assert "A1BZ" in texts and "Q9X0" in texts and read.facts.folded == 2 and read.facts.fold == "uppercase"
    data = load_data(DataConfig(train_dir=tmp_path, val_dir=tmp_path, width=W, height=H))
    assert any(n.startswith("data.train_dir: 2 labels with lowercase letters read as uppercase") for n in data.notes)
    # a charset with both cases tells them apart: no folding, and the lowercase label is simply read
    both = read_folder(tmp_path, CHARSET + "abcdefghijklmnopqrstuvwxyz", 4, W, H)
    assert both.facts.folded == 0


def test_labels_of_another_length_name_the_files_and_the_length_to_set(tmp_path):
    write_captcha_folder(tmp_path / "five", 3, CHARSET, 5, W, H)
    with pytest.raises(UserError) as e:
        _read(tmp_path / "five")
    assert "3 of 3 files" in _one_line(e) and "has 5 characters, not 4" in str(e.value)
    assert str(e.value).endswith("(every label has 5 characters: set data.length: 5)")
    write_captcha_folder(tmp_path / "mixed", 2, CHARSET, 4, W, H)
    _copy_of_first(tmp_path / "mixed").save(tmp_path / "mixed" / "ABCDE_1.png")
    with pytest.raises(UserError, match=r"1 of 3 files .*ABCDE_1\.png \(label 'ABCDE' has 5 characters, not 4\)"):
        _read(tmp_path / "mixed")


def test_characters_outside_the_charset_are_named_with_the_fix(tmp_path):
    write_captcha_folder(tmp_path, 2, CHARSET, 4, W, H)
    _copy_of_first(tmp_path).save(tmp_path / "A@B#_1.png")
    with pytest.raises(UserError) as e:
        _read(tmp_path)
    assert "A@B#_1.png (label 'A@B#' has '#@', not in data.charset)" in _one_line(e)
    assert str(e.value).endswith("(add '#@' to data.charset, or rename the files)")


def test_every_mode_becomes_8_bit_grayscale_and_is_said_once(tmp_path):
    """RGB, RGBA and gray + alpha (laid on white), palette, 1-bit and 16-bit: the pixel values a captcha means, and
    one note naming each conversion."""
    gray = np.tile(np.linspace(0, 255, W).astype(np.uint8), (H, 1))
    Image.fromarray(gray).save(tmp_path / "AAAA_gray.png")
    Image.fromarray(gray).convert("RGB").save(tmp_path / "AAAB_rgb.png")
    rgba = np.zeros((H, W, 4), np.uint8)
    rgba[..., 3] = 0  # fully transparent: the background
    rgba[:, :8, 3] = 255  # a black opaque band: the "ink"
    Image.fromarray(rgba, "RGBA").save(tmp_path / "AAAC_rgba.png")
    Image.fromarray(gray).convert("P").save(tmp_path / "AAAD_pal.png")
    Image.fromarray(gray).convert("1").save(tmp_path / "AAAE_bw.png")
    Image.fromarray(gray.astype(np.uint16) * 257).save(tmp_path / "AAAF_16.png")
    with Image.open(tmp_path / "AAAF_16.png") as im:
        assert im.mode.startswith("I")  # PIL reads a 16-bit PNG as I;16 (or I): the case to scale
    read = _read(tmp_path)
    images = dict(zip(read.names, read.arrays.images))
    assert np.array_equal(images["AAAA_gray.png"], gray)
    assert np.array_equal(images["AAAB_rgb.png"], gray)
    assert (images["AAAC_rgba.png"][:, :8] == 0).all() and (images["AAAC_rgba.png"][:, 8:] == 255).all()
    assert np.array_equal(images["AAAD_pal.png"], gray)  # a palette of the 256 grays
    assert set(np.unique(images["AAAE_bw.png"])) <= {0, 255}
    assert np.array_equal(images["AAAF_16.png"], gray)  # 65535 → 255 (PIL's own conversion clips at 255)
    assert read.facts.modes["L"] == 1 and read.facts.modes["RGB"] == 1 and read.facts.modes["RGBA"] == 1
    notes = load_data(DataConfig(train_dir=tmp_path, val_dir=tmp_path, width=W, height=H)).notes
    converted = [n for n in notes if n.startswith("data.train_dir: 5 of 6 images read as 8-bit grayscale from ")]
    assert len(converted) == 1, notes
    for said in ("RGB (1)", "RGBA (on white) (1)", "palette (1)", "1-bit (1)", "16-bit"):
        assert said in converted[0], converted[0]


def test_other_sizes_are_resized_and_said(tmp_path):
    write_captcha_folder(tmp_path, 3, CHARSET, 4, 100, 40)
    write_captcha_folder(tmp_path, 1, CHARSET, 4, W, H, seed=9)
    read = _read(tmp_path)
    assert read.arrays.images.shape == (4, H, W) and read.facts.resized == 3
    notes = load_data(DataConfig(train_dir=tmp_path, val_dir=tmp_path, width=W, height=H)).notes
    assert f"data.train_dir: 3 of 4 images resized to {W}×{H} (data.width × data.height) from 100×40 (3)" in notes


def test_jpegs_are_read_and_said(tmp_path):
    write_captcha_folder(tmp_path, 2, CHARSET, 4, W, H)
    source = sorted(tmp_path.glob("*.png"))[0].name
    _copy_of_first(tmp_path).save(tmp_path / "JPEG_1.jpg", quality=95)
    _copy_of_first(tmp_path).save(tmp_path / "JPEG_2.JPEG", quality=95)
    read = _read(tmp_path)
    assert read.facts.formats == {"PNG": 2, "JPEG": 2}
    jpeg = read.arrays.images[read.names.index("JPEG_1.jpg")]
    png = read.arrays.images[read.names.index(source)]
    assert np.abs(jpeg.astype(int) - png).mean() < 6  # lossy, but the same picture
    notes = load_data(DataConfig(train_dir=tmp_path, val_dir=tmp_path, width=W, height=H)).notes
    assert "data.train_dir: 2 of 4 images are JPEG (2), not PNG" in notes


def test_a_file_that_is_not_an_image_and_a_truncated_png_are_named_in_one_line(tmp_path):
    write_captcha_folder(tmp_path, 3, CHARSET, 4, W, H)
    (tmp_path / "ABCD_text.png").write_text("this is not a picture")
    whole = sorted(tmp_path.glob("*_0000*.png"))[0].read_bytes()
    (tmp_path / "EFGH_cut.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError) as e:
        _read(tmp_path)
    message = _one_line(e)
    assert message.startswith("data.train_dir: 2 of 5 files in ") and "cannot be read as images" in message
    assert "ABCD_text.png (not an image)" in message and "EFGH_cut.png (truncated or damaged" in message
    assert message.endswith("(remove them, or export them again)")


def test_a_link_to_nowhere_is_named_in_one_line(tmp_path):
    write_captcha_folder(tmp_path, 2, CHARSET, 4, W, H)
    (tmp_path / "WXYZ_gone.png").symlink_to(tmp_path / "elsewhere" / "WXYZ.png")
    with pytest.raises(UserError) as e:
        _read(tmp_path)
    assert _one_line(e).startswith("data.train_dir: 1 file(s) in ") and "WXYZ_gone.png (No such file or directory)" in \
        str(e.value) and str(e.value).endswith("(remove them, or point the links at the images)")


def test_a_16_bit_png_with_a_transparent_value_keeps_its_grays(tmp_path):
    """A 16-bit grayscale PNG whose tRNS chunk names one value transparent: PIL's RGBA conversion of I;16 clips every
    value at 255, so the whole image came out (almost) white. Its grays are scaled as any 16-bit image's; only the
    pixels of the transparent value are laid on white."""
    gray = np.tile(np.linspace(0, 255, W).astype(np.uint8), (H, 1))
    values = gray.astype(np.uint16) * 257
    values[:, -4:] = 12_345  # the transparent value: the background
    Image.fromarray(values).save(tmp_path / "AAAA_16t.png", transparency=12_345)
    with Image.open(tmp_path / "AAAA_16t.png") as im:
        assert im.mode.startswith("I") and im.info.get("transparency") == 12_345  # the case: 16-bit with tRNS
    (image,) = _read(tmp_path).arrays.images
    assert np.array_equal(image[:, :-4], gray[:, :-4]) and (image[:, -4:] == 255).all()


def test_macos_resource_forks_beside_the_images_are_ignored_by_name(tmp_path):
    """A folder copied from a Mac through a FAT or network share holds an AppleDouble `._NAME` beside each file: not
    an image, and its label `._A1B2` failed the whole folder as bad labels."""
    paths = write_captcha_folder(tmp_path, 3, CHARSET, 4, W, H)
    for path in paths:
        (tmp_path / f"._{path.name}").write_bytes(b"\0\5\x16\x07" + b"\0" * 80)  # AppleDouble's magic
    read = _read(tmp_path)
    assert len(read.names) == 3 and read.facts.ignored == tuple(sorted(f"._{p.name}" for p in paths))


def test_files_without_an_image_suffix_are_ignored_by_name(tmp_path):
    write_captcha_folder(tmp_path, 2, CHARSET, 4, W, H)
    (tmp_path / "labels.csv").write_text("a,b\n")
    (tmp_path / ".DS_Store").write_bytes(b"\0\1")
    read = _read(tmp_path)
    assert len(read.names) == 2 and read.facts.ignored == (".DS_Store", "labels.csv")
    notes = load_data(DataConfig(train_dir=tmp_path, val_dir=tmp_path, width=W, height=H)).notes
    assert "data.train_dir: ignored 2 files without an image suffix: .DS_Store, labels.csv" in notes


def test_the_same_image_in_both_folders_is_a_warning_with_the_count(tmp_path):
    write_captcha_folder(tmp_path / "train", 20, CHARSET, 4, W, H, seed=1)
    write_captcha_folder(tmp_path / "val", 5, CHARSET, 4, W, H, seed=2)
    copied = sorted((tmp_path / "train").glob("*.png"))[:3]
    for i, path in enumerate(copied):
        shutil.copy(path, tmp_path / "val" / f"{path.name[:4]}_copy{i}.png")
    data = load_data(DataConfig(train_dir=tmp_path / "train", val_dir=tmp_path / "val", width=W, height=H))
    assert data.facts.val_in_train == 3
    (leak,) = [n for n in data.notes if "validation overstates accuracy" in n]
    assert leak.startswith("data.val_dir: 3 validation images with the pixels of a training image, e.g. ")
    val_file, train_file = data.facts.leak_example
    assert "_copy" in val_file and train_file in {p.name for p in copied} and f"{val_file} = {train_file}" in leak
    # within one folder, a picture twice can land on both sides of the held-out split: said the same way
    for i in range(6):
        shutil.copy(copied[0], tmp_path / "train" / f"{copied[0].name[:4]}_twice{i}.png")
    split = load_data(DataConfig(train_dir=tmp_path / "train", val_fraction=0.5, width=W, height=H))
    assert split.facts.train.duplicates == 6 and split.facts.val_in_train >= 1
    assert any(n.startswith("data.val_fraction: ") and "held out of data.train_dir with the pixels" in n
               for n in split.notes)


def test_an_empty_validation_folder_and_a_folder_of_folders_are_one_line_with_the_fix(tmp_path):
    write_captcha_folder(tmp_path / "data" / "train", 4, CHARSET, 4, W, H)
    (tmp_path / "data" / "test").mkdir()
    with pytest.raises(UserError) as e:
        load_data(DataConfig(train_dir=tmp_path / "data" / "train", val_dir=tmp_path / "data" / "test"))
    assert _one_line(e).startswith("data.val_dir: no images (.png, .jpg")
    assert str(e.value).endswith("; or set data.val_dir: null to hold out data.val_fraction of data.train_dir")
    with pytest.raises(UserError) as e:
        load_data(DataConfig(train_dir=tmp_path / "data"))
    assert _one_line(e).startswith(f"data.train_dir: no images in '{tmp_path / 'data'}', only folders (test/, train/)")


def test_a_folder_too_small_for_the_workers_is_refused_before_ray(tmp_path, capsys):
    write_captcha_folder(tmp_path / "few", 5, CHARSET, 4, W, H)
    spec = write_spec(tmp_path, tiny_spec(tmp_path, data={"train_dir": str(tmp_path / "few")},
                                          scaling={"num_workers": 3, "cpus_per_worker": 0.5}))
    assert main(["check", str(spec)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("decoding ")]  # progress
    assert len(errors) == 1 and errors[0].startswith(
        f"raysweep: error: {spec}: search.per_gpu_batch_size: 16 × 1 accumulation step(s) is more than a rank's share "
        f"of the training set (4 images over 3 workers: 1 each)"), errors
    # tune refuses it the same way, before Ray starts (the session's Ray is not running here: it would need one)
    assert main(["tune", str(spec), "--address", "127.0.0.1:1"]) == 2
    assert "is more than a rank's share" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The decoded cache


class _Seen:
    def __init__(self):
        self.labels: list[str] = []

    def __call__(self, label: str, done: int, total: int) -> None:
        if done == 0:
            self.labels.append(label)


def test_a_second_read_of_an_unchanged_folder_decodes_nothing_and_a_changed_file_is_decoded_again(tmp_path):
    paths = write_captcha_folder(tmp_path / "d", 12, CHARSET, 4, W, H)
    first = _read(tmp_path / "d", progress=(progress := _Seen()))
    assert progress.labels == ["decoding d"] and not first.facts.from_cache
    again = _read(tmp_path / "d", progress=(progress := _Seen()))
    assert progress.labels == [] and again.facts.from_cache
    assert np.array_equal(first.arrays.images, again.arrays.images) and first.facts.modes == again.facts.modes
    cache = tmp_path / "cache" / "folders"
    assert len(list(cache.glob("*.npz"))) == 1 and not list(cache.glob(".*"))  # written whole: no temp file left
    # a file rewritten with other pixels: a new listing (size, modification time), decoded again, the old cache gone
    Image.fromarray(np.zeros((H, W), np.uint8)).save(paths[3])
    changed = _read(tmp_path / "d", progress=(progress := _Seen()))
    assert progress.labels == ["decoding d"] and (changed.arrays.images[changed.names.index(paths[3].name)] == 0).all()
    assert len(list(cache.glob("*.npz"))) == 1
    # a damaged cache is decoded again, never read as a wrong set
    (damaged,) = cache.glob("*.npz")
    damaged.write_bytes(damaged.read_bytes()[:100])
    fixed = _read(tmp_path / "d", progress=(progress := _Seen()))
    assert progress.labels == ["decoding d"] and np.array_equal(fixed.arrays.images, changed.arrays.images)
    # another image size is another cache, and the two live side by side (two specs on one folder deleted each
    # other's: every sweep of either decoded the folder again)
    resized = read_folder(tmp_path / "d", CHARSET, 4, 32, 12, progress=(progress := _Seen()))
    assert progress.labels == ["decoding d"] and resized.arrays.images.shape == (12, 12, 32)
    for width, height in ((W, H), (32, 12)):
        again = read_folder(tmp_path / "d", CHARSET, 4, width, height, progress=(progress := _Seen()))
        assert progress.labels == [] and again.facts.from_cache and again.arrays.images.shape == (12, height, width)
    assert len(list(cache.glob("*.npz"))) == 2


def test_a_cache_that_cannot_be_written_costs_the_next_run_a_decode_never_this_one(tmp_path, monkeypatch, caplog):
    write_captcha_folder(tmp_path / "d", 4, CHARSET, 4, W, H)
    (tmp_path / "not-a-folder").write_text("a file where the cache folder would go")
    monkeypatch.setenv("RAYSWEEP_CACHE_DIR", str(tmp_path / "not-a-folder"))
    assert len(_read(tmp_path / "d").names) == 4
    assert "could not write the cache" in caplog.text and "RAYSWEEP_CACHE_DIR moves the cache" in caplog.text
    again = _read(tmp_path / "d", progress=(progress := _Seen()))
    assert progress.labels == ["decoding d"] and not again.facts.from_cache


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSWEEP_CACHE_DIR", str(tmp_path / "cache"))


# ---------------------------------------------------------------------------------------------
# check describes the data


def test_check_describes_the_folders_it_will_train_on(tmp_path, capsys):
    write_captcha_folder(tmp_path / "train", 60, CHARSET, 4, W, H, seed=1)
    write_captcha_folder(tmp_path / "val", 10, CHARSET, 4, 100, 40, seed=2)
    shutil.copy(sorted((tmp_path / "train").glob("*.png"))[0], tmp_path / "val" / "LEAK_1.png")
    spec = write_spec(tmp_path, tiny_spec(tmp_path, data={"train_dir": str(tmp_path / "train"),
                                                          "val_dir": str(tmp_path / "val"), "charset": CHARSET + "@"},
                                          search={"per_gpu_batch_size": 8, "base_lr": 1.0e-3, "warmup_epochs": 1,
                                                  "weight_decay": 0.0}))
    assert main(["check", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "# derived at the defaults (60 training images)" in out
    assert f"# data: {tmp_path / 'train'} + {tmp_path / 'val'}: 60 train / 11 val images" in out
    assert "#   data.train_dir: 60 images (60 PNG); sizes 60 at 64×24; 0 resized; modes 60 RGB" in out
    assert "#   data.val_dir: 11 images (11 PNG); sizes 10 at 100×40, 1 at 64×24; 10 resized; modes 11 RGB" in out
    assert "#   leakage: 1 validation images have the pixels of a training image" in out
    assert ("#   characters: 36 of data.charset's 37 appear in the training labels; never in a training label: "
            "'@'") in out
    positions = [line for line in out.splitlines() if line.startswith("#     position ")]
    assert len(positions) == 4 and all("characters, least" in line for line in positions)


# ---------------------------------------------------------------------------------------------
# A sweep on a user's folder, end to end


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_train_on_a_users_folders_states_each_conversion_once_and_logs_it_with_the_sweep(ray_cluster, tmp_path, capsys):
    """`train` on a label-sorted train folder (with a lowercase label, an RGBA image and a text file in it) and a
    validation folder holding a copy of a training image, 3 CPU workers through Ray: it trains, the console says
    each conversion and the leakage once, and the sweep's MLflow parent run keeps them as params."""
    from mlflow.tracking import MlflowClient

    write_captcha_folder(tmp_path / "train", 240, CHARSET, 4, W, H, seed=1)
    write_captcha_folder(tmp_path / "val", 30, CHARSET, 4, W, H, seed=2)
    first = _copy_of_first(tmp_path / "train")
    first.convert("RGBA").save(tmp_path / "train" / "zz9a_rgba.png")
    (tmp_path / "train" / "README.txt").write_text("captchas from the old site")
    shutil.copy(sorted((tmp_path / "train").glob("*.png"))[0], tmp_path / "val" / "LEAK_1.png")
    spec = write_spec(tmp_path, tiny_spec(tmp_path, data={"train_dir": str(tmp_path / "train"),
                                                          "val_dir": str(tmp_path / "val")},
                                          scaling={"num_workers": 3, "cpus_per_worker": 0.5},
                                          train={"epochs": 1, "reference_batch_size": 64},
                                          search={"per_gpu_batch_size": 16, "base_lr": 2.0e-3, "warmup_epochs": 0,
                                                  "weight_decay": 1.0e-4}))
    assert main(["train", str(spec)]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("data: ")]
    assert said[0].startswith(f"data: {tmp_path / 'train'} + {tmp_path / 'val'}: 241 train / 31 val images")
    expected = ["data: data.train_dir: 1 label with lowercase letters read as uppercase",
                "data: data.train_dir: 241 of 241 images read as 8-bit grayscale from RGB (240), RGBA (on white) (1)",
                "data: data.train_dir: ignored 1 file without an image suffix: README.txt",
                "data: data.val_dir: 31 of 31 images read as 8-bit grayscale from RGB (31)",
                "data: data.val_dir: 1 validation image with the pixels of a training image, e.g. LEAK_1.png = "]
    for start in expected:
        assert sum(line.startswith(start) for line in said) == 1, (start, said)
    assert "summary: 1 epochs" in out
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (parent,) = [r for r in client.search_runs([client.get_experiment_by_name("t").experiment_id])
                 if "mlflow.parentRunId" not in r.data.tags]
    params = parent.data.params
    assert (params["data.train_images"], params["data.val_images"], params["data.val_in_train"]) == ("241", "31", "1")
    assert params["data.source"] == f"{tmp_path / 'train'} + {tmp_path / 'val'}"
    notes = params["data.notes"].split(" | ")
    assert [n for n in notes if any(("data: " + n).startswith(e) for e in expected)] == notes and len(notes) == 5
