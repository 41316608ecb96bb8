import numpy as np
import pytest

from raysweep.config import DataConfig
from raysweep.data import load_data, read_folder, synthetic_split, write_captcha_folder
from raysweep.errors import UserError

CHARSET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def test_folder_loads_with_labels_from_file_names(tmp_path):
    paths = write_captcha_folder(tmp_path, 12, CHARSET, 4, 160, 60, seed=3)
    data = read_folder(tmp_path, CHARSET, 4, 160, 60)
    assert data.images.shape == (12, 60, 160) and data.images.dtype == np.uint8
    assert data.labels.shape == (12, 4)
    for path, label in zip(sorted(paths), data.labels):
        assert "".join(CHARSET[i] for i in label) == path.name.split("_")[0]
    assert data.images.std() > 10  # real pictures, not blank


def test_other_sizes_are_resized(tmp_path):
    write_captcha_folder(tmp_path, 3, CHARSET, 4, 100, 40)
    assert read_folder(tmp_path, CHARSET, 4, 160, 60).images.shape == (3, 60, 160)


def test_label_outside_charset_names_the_file(tmp_path):
    write_captcha_folder(tmp_path, 2, CHARSET, 4, 64, 24)
    (tmp_path / "a@1Z_x.png").write_bytes((next(tmp_path.glob("*.png"))).read_bytes())
    with pytest.raises(UserError, match=r"1 of 3 files .* a@1Z_x\.png \(label 'A@1Z' has '@', not in data\.charset\)"):
        read_folder(tmp_path, CHARSET, 4, 64, 24)


def test_wrong_length_names_the_file(tmp_path):
    write_captcha_folder(tmp_path, 2, CHARSET, 4, 64, 24)
    (tmp_path / "ABCDE_1.png").write_bytes((next(tmp_path.glob("*.png"))).read_bytes())
    with pytest.raises(UserError, match=r"ABCDE_1\.png \(label 'ABCDE' has 5 characters, not 4\)"):
        read_folder(tmp_path, CHARSET, 4, 64, 24)


def test_unreadable_image_names_the_file(tmp_path):
    write_captcha_folder(tmp_path, 2, CHARSET, 4, 64, 24)
    (tmp_path / "ABCD_broken.png").write_bytes(b"not a png")
    with pytest.raises(UserError, match=r"1 of 3 files .* cannot be read as images: ABCD_broken\.png \(not an image\)"):
        read_folder(tmp_path, CHARSET, 4, 64, 24)


def test_at_most_five_bad_files_are_named(tmp_path):
    for i in range(7):
        (tmp_path / f"AB{i}_x.png").write_bytes(b"")
    with pytest.raises(UserError) as e:
        read_folder(tmp_path, CHARSET, 4, 64, 24)
    assert str(e.value).count(".png (") == 5 and " ..." in str(e.value) and "7 of 7" in str(e.value)


def test_empty_folder(tmp_path):
    with pytest.raises(UserError, match=r"no images \(\.png, \.jpg"):
        read_folder(tmp_path, CHARSET, 4, 64, 24)


def test_held_out_split_from_one_folder(tmp_path):
    write_captcha_folder(tmp_path / "d", 20, CHARSET, 4, 64, 24)
    cfg = DataConfig(train_dir=tmp_path / "d", val_fraction=0.25, width=64, height=24)
    data = load_data(cfg)
    assert (len(data.train), len(data.val)) == (15, 5)
    both = np.concatenate([data.train.images, data.val.images]).reshape(20, -1)
    assert len({row.tobytes() for row in both}) == 20  # a partition, nothing twice


def test_synthetic_is_seeded_and_cached(tmp_path, monkeypatch):
    args = ("train", 40, 7, CHARSET, 4, 64, 24)
    monkeypatch.setenv("RAYSWEEP_CACHE_DIR", str(tmp_path / "a"))
    a = synthetic_split(*args)
    (cached,) = (tmp_path / "a").glob("*.npz")
    # the second call reads the cache instead of rendering: plant a marker there and get it back
    marker = np.full_like(a.images, 7)
    np.savez(cached, images=marker, labels=a.labels)
    again = synthetic_split(*args)
    assert np.array_equal(again.images, marker) and np.array_equal(again.labels, a.labels)
    np.savez(cached, images=a.images, labels=a.labels)
    monkeypatch.setenv("RAYSWEEP_CACHE_DIR", str(tmp_path / "b"))
    b = synthetic_split(*args)  # rendered again from scratch
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)
    other = synthetic_split("train", 40, 8, CHARSET, 4, 64, 24)
    assert not np.array_equal(a.images, other.images)
    assert a.images.shape == (40, 24, 64) and a.labels.max() < len(CHARSET)
