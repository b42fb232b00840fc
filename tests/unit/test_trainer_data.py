"""Dataset validation (every error names its file and what is wrong), reads, order, synth."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hpclaunch.config import ModelConfig
from hpclaunch.errors import DataError
from hpclaunch.shards import open_token_array, synth_dataset, validate_dataset
from hpclaunch.trainer.data.dataset import SampleOrder, ShardedDataset

M = ModelConfig(vocab_size=50, text_len=6, latent_len=3, latent_dim=4)


def write_pair(root: Path, stem: str, n: int = 5, *, ids=None, lat=None) -> None:  # type: ignore[no-untyped-def]
    (root / "tokens").mkdir(parents=True, exist_ok=True)
    (root / "latents").mkdir(parents=True, exist_ok=True)
    if ids is None:
        ids = np.arange(n * M.text_len, dtype=np.int32).reshape(n, M.text_len) % M.vocab_size
    if lat is None:
        lat = np.zeros((n, M.latent_len, M.latent_dim), dtype=np.float32)
    np.savez(root / "tokens" / f"{stem}.npz", input_ids=ids)
    np.save(root / "latents" / f"{stem}.npy", lat)


def check(root: Path, model: ModelConfig = M, **kw) -> None:  # type: ignore[no-untyped-def]
    validate_dataset(root / "tokens", root / "latents", model, **kw)


def error(root: Path, model: ModelConfig = M, **kw) -> DataError:  # type: ignore[no-untyped-def]
    with pytest.raises(DataError) as info:
        check(root, model, **kw)
    return info.value


def test_valid_dataset_info(tmp_path: Path) -> None:
    write_pair(tmp_path, "a", 5)
    write_pair(tmp_path, "b", 7)
    info = validate_dataset(tmp_path / "tokens", tmp_path / "latents", M)
    assert info.num_samples == 12
    assert [(s.stem, s.n) for s in info.shards] == [("a", 5), ("b", 7)]
    assert info.shards[1].token_path == tmp_path / "tokens" / "b.npz"
    assert info.shards[1].latent_path == tmp_path / "latents" / "b.npy"


def test_missing_directory(tmp_path: Path) -> None:
    e = error(tmp_path)
    assert e.where == str(tmp_path / "tokens")
    assert "token directory does not exist" in e.message
    assert "data synth" in (e.hint or "")


def test_no_shards(tmp_path: Path) -> None:
    (tmp_path / "tokens").mkdir()
    (tmp_path / "latents").mkdir()
    e = error(tmp_path)
    assert e.where == str(tmp_path / "tokens")
    assert "no *.npz token shards" in e.message


def test_token_shard_without_latent_pair(tmp_path: Path) -> None:
    write_pair(tmp_path, "a")
    write_pair(tmp_path, "b")
    (tmp_path / "latents" / "b.npy").unlink()
    e = error(tmp_path)
    assert e.where == str(tmp_path / "tokens" / "b.npz")
    assert f"token shard has no latent pair: {tmp_path / 'latents' / 'b.npy'} does not exist" in e.message


def test_latent_shard_without_token_pair(tmp_path: Path) -> None:
    write_pair(tmp_path, "a")
    np.save(tmp_path / "latents" / "extra.npy", np.zeros((5, 3, 4), np.float32))
    e = error(tmp_path)
    assert e.where == str(tmp_path / "latents" / "extra.npy")
    assert "latent shard has no token pair" in e.message and "extra.npz" in e.message


def test_n_mismatch(tmp_path: Path) -> None:
    write_pair(tmp_path, "a", 5, lat=np.zeros((4, 3, 4), np.float32))
    e = error(tmp_path)
    assert e.where == str(tmp_path / "latents" / "a.npy")
    assert e.message == "holds N=4 samples but its token shard a.npz holds N=5"


def test_token_dtype_not_integer(tmp_path: Path) -> None:
    write_pair(tmp_path, "a", ids=np.zeros((5, 6), np.float32))
    e = error(tmp_path)
    assert e.where == str(tmp_path / "tokens" / "a.npz")
    assert e.message == "input_ids has dtype float32; token ids must be integers"


def test_latent_dtype_not_floating(tmp_path: Path) -> None:
    write_pair(tmp_path, "a", lat=np.zeros((5, 3, 4), np.int16))
    e = error(tmp_path)
    assert e.where == str(tmp_path / "latents" / "a.npy")
    assert e.message == "latents have dtype int16; latents must be floating point"


def test_token_shape_vs_model(tmp_path: Path) -> None:
    write_pair(tmp_path, "a", ids=np.zeros((5, 7), np.int32))
    e = error(tmp_path)
    assert e.message == "input_ids has shape [5, 7]; the model wants [N, 6] (model.text_len=6)"


def test_latent_shape_vs_model(tmp_path: Path) -> None:
    write_pair(tmp_path, "a", lat=np.zeros((5, 3, 5), np.float32))
    e = error(tmp_path)
    assert e.where == str(tmp_path / "latents" / "a.npy")
    assert e.message == (
        "latents have shape [5, 3, 5]; the model wants [N, 3, 4] (model.latent_len=3, model.latent_dim=4)"
    )


def test_two_dimensional_latents_need_latent_len_1(tmp_path: Path) -> None:
    write_pair(tmp_path, "a", lat=np.zeros((5, 4), np.float32))
    e = error(tmp_path)
    assert "latents have shape [5, 4]; the model wants [N, 3, 4]" in e.message
    one = M.model_copy(update={"latent_len": 1})
    info = validate_dataset(tmp_path / "tokens", tmp_path / "latents", one)
    lat = ShardedDataset(info, one).get(np.array([2]))[1]
    assert lat.shape == (1, 1, 4)


def test_id_at_or_above_vocab_size(tmp_path: Path) -> None:
    ids = np.zeros((5, 6), np.int64)
    ids[3, 2] = 50
    write_pair(tmp_path, "a", ids=ids)
    e = error(tmp_path)
    assert e.where == str(tmp_path / "tokens" / "a.npz")
    assert e.message == (
        "input_ids holds id 50 at sample 3, position 2: >= model.vocab_size=50 (ids must be 0..49)"
    )
    assert "vocab_size" in (e.hint or "")


def test_negative_id(tmp_path: Path) -> None:
    ids = np.zeros((5, 6), np.int32)
    ids[0, 5] = -1
    write_pair(tmp_path, "a", ids=ids)
    e = error(tmp_path)
    assert e.message == "input_ids holds id -1 at sample 0, position 5: is negative (ids must be 0..49)"


def test_max_shards_limits_value_checks_not_header_checks(tmp_path: Path) -> None:
    write_pair(tmp_path, "a")
    bad = np.full((5, 6), 99, np.int32)
    write_pair(tmp_path, "b", ids=bad)
    info = validate_dataset(tmp_path / "tokens", tmp_path / "latents", M, max_shards=1)
    assert info.fully_checked == 1
    assert "id 99" in error(tmp_path).message
    write_pair(tmp_path, "c", lat=np.zeros((5, 3, 5), np.float32))
    assert "latents have shape" in error(tmp_path, max_shards=1).message


def test_npz_without_input_ids(tmp_path: Path) -> None:
    write_pair(tmp_path, "a")
    np.savez(tmp_path / "tokens" / "a.npz", ids=np.zeros((5, 6), np.int32))
    e = error(tmp_path)
    assert e.where == str(tmp_path / "tokens" / "a.npz")
    assert e.message == "has no input_ids array (arrays: ids)"


def test_unreadable_shards(tmp_path: Path) -> None:
    write_pair(tmp_path, "a")
    (tmp_path / "tokens" / "a.npz").write_bytes(b"not a zip")
    e = error(tmp_path)
    assert e.where == str(tmp_path / "tokens" / "a.npz")
    assert e.message.startswith("not a readable .npz archive")
    write_pair(tmp_path, "a")
    (tmp_path / "latents" / "a.npy").write_bytes(b"garbage")
    e = error(tmp_path)
    assert e.where == str(tmp_path / "latents" / "a.npy")
    assert e.message.startswith("not a readable .npy array")


def test_stored_npz_member_is_memory_mapped_and_compressed_is_read(tmp_path: Path) -> None:
    ids = np.arange(60, dtype=np.int32).reshape(10, 6)
    np.savez(tmp_path / "plain.npz", input_ids=ids)
    np.savez_compressed(tmp_path / "packed.npz", input_ids=ids)
    plain = open_token_array(tmp_path / "plain.npz")
    packed = open_token_array(tmp_path / "packed.npz")
    assert isinstance(plain, np.memmap)
    with zipfile.ZipFile(tmp_path / "packed.npz") as zf:
        assert zf.getinfo("input_ids.npy").compress_type != zipfile.ZIP_STORED
    np.testing.assert_array_equal(plain, ids)
    np.testing.assert_array_equal(packed, ids)


def test_dataset_reads_across_shards(tmp_path: Path) -> None:
    a = np.arange(30).reshape(5, 6) % 50
    b = (np.arange(18).reshape(3, 6) + 7) % 50
    write_pair(tmp_path, "a", ids=a.astype(np.int32))
    write_pair(tmp_path, "b", ids=b.astype(np.int16), lat=np.ones((3, 3, 4), np.float16))
    ds = ShardedDataset(validate_dataset(tmp_path / "tokens", tmp_path / "latents", M), M)
    ids, lat = ds.get(np.array([6, 0, 4, 5]))
    np.testing.assert_array_equal(ids, np.stack([b[1], a[0], a[4], b[0]]))
    assert ids.dtype == np.int64 and lat.dtype == np.float32
    assert lat[:, 0, 0].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_sample_order_is_a_permutation_per_epoch_and_position_based() -> None:
    order = SampleOrder(10, seed=3)
    first = order.indices(0, 10)
    second = order.indices(10, 10)
    assert sorted(first.tolist()) == list(range(10)) == sorted(second.tolist())
    assert first.tolist() != second.tolist()
    # One stream of positions, however it is cut into batches (any world size, any resume point).
    whole = SampleOrder(10, seed=3).indices(0, 27)
    pieces = np.concatenate([SampleOrder(10, seed=3).indices(s, 3) for s in range(0, 27, 3)])
    np.testing.assert_array_equal(whole, pieces)
    assert SampleOrder(10, seed=4).indices(0, 10).tolist() != first.tolist()


def test_synth_dataset_format_and_validity(tmp_path: Path) -> None:
    m = ModelConfig(vocab_size=40, text_len=12, latent_len=3, latent_dim=5)
    info = synth_dataset(tmp_path / "d", samples=70, seed=1, model_cfg=m, shard_size=32)
    assert [s.n for s in info.shards] == [32, 32, 6]
    assert sorted(p.name for p in (tmp_path / "d" / "tokens").iterdir()) == [
        "shard_00000.npz",
        "shard_00001.npz",
        "shard_00002.npz",
    ]
    again = validate_dataset(tmp_path / "d" / "tokens", tmp_path / "d" / "latents", m)
    assert again.num_samples == 70
    ids = open_token_array(info.shards[0].token_path)
    lat = np.load(info.shards[0].latent_path)
    assert ids.dtype == np.int32 and ids.shape == (32, 12)
    assert lat.dtype == np.float32 and lat.shape == (32, 3, 5)
    assert 0.5 < float(lat.std()) < 1.5


def test_synth_latents_are_a_function_of_the_tokens(tmp_path: Path) -> None:
    m = ModelConfig(vocab_size=30, text_len=8, latent_len=2, latent_dim=3)
    info = synth_dataset(tmp_path / "d", samples=400, seed=0, model_cfg=m, shard_size=400)
    ids = np.asarray(open_token_array(info.shards[0].token_path))
    lat = np.load(info.shards[0].latent_path)
    seen: dict[bytes, np.ndarray] = {}
    repeats = 0
    for row, vec in zip(ids, lat, strict=True):
        key = row.tobytes()
        if key in seen:
            repeats += 1
            np.testing.assert_array_equal(seen[key], vec)
        seen[key] = vec
    assert repeats > 50  # few templates: many samples share their text exactly


def test_synth_is_deterministic(tmp_path: Path) -> None:
    a = synth_dataset(tmp_path / "a", samples=20, seed=5, model_cfg=M, shard_size=20)
    b = synth_dataset(tmp_path / "b", samples=20, seed=5, model_cfg=M, shard_size=20)
    c = synth_dataset(tmp_path / "c", samples=20, seed=6, model_cfg=M, shard_size=20)
    read = [np.asarray(open_token_array(x.shards[0].token_path)) for x in (a, b, c)]
    np.testing.assert_array_equal(read[0], read[1])
    assert not np.array_equal(read[0], read[2])


def test_data_module_does_not_import_torch() -> None:
    code = "import sys, hpclaunch.trainer.data.dataset, hpclaunch.cli.data_cmd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
