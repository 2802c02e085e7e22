"""Two files of any kind get one verdict (tensors, fields, bytes, unreadable), never a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from reprotrain.compare.files import compare_files
from reprotrain.compare.readers import file_kind
from reprotrain.hashing import safetensors_metadata


def _runs(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "run-0", tmp_path / "run-1"
    a.mkdir()
    b.mkdir()
    return a, b


def _checkpoint(folder: Path, weight: float = 1.0, stamp: float = 0.0) -> Path:
    """A Lightning-like checkpoint: weights, Adam state, counters and the run's own path."""
    path = folder / "last.ckpt"
    state = {
        "state_dict": {
            "layer.weight": torch.full((3, 2), weight),
            "bn.running_mean": torch.ones(2),
        },
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3, 2), "step": 4}}}],
        "global_step": 4,
        "callbacks": {"ModelCheckpoint": {"dirpath": str(folder), "stamp": stamp}},
    }
    torch.save(state, path)
    return path


def test_checkpoints_with_equal_tensors_and_their_own_run_paths_are_identical(
    tmp_path: Path,
) -> None:
    a, b = _runs(tmp_path)
    pa, pb = _checkpoint(a), _checkpoint(b)
    assert pa.read_bytes() != pb.read_bytes()  # the run folder is in the bytes
    verdict = compare_files("last.ckpt", pa, pb, (a, b))
    assert (verdict.kind, verdict.status, verdict.tensors_compared) == (
        "checkpoint",
        "identical",
        3,
    )


def _model_checkpoint(folder: Path, best: str = "epoch=1-step=12.ckpt", kept: int = 20) -> Path:
    """Lightning's ModelCheckpoint state, whose ``best_k_models`` is keyed by each checkpoint's
    absolute path, and the same paths as ``Path`` objects, keys and lists."""
    ckpts = folder / "ckpts"
    state = {
        "dirpath": str(ckpts),
        "best_model_path": str(ckpts / best),
        "kth_best_model_path": str(ckpts / best),
        "last_model_path": "",
        "best_k_models": {str(ckpts / best): torch.tensor(0.25)},
        "as_paths": {ckpts / best: [ckpts, ckpts / "last.ckpt"]},
        "a_set": {str(ckpts / f"epoch={i}.ckpt") for i in range(kept)},  # in its hashes' order
        "kth_value": torch.tensor(0.25),
    }
    path = folder / "last.ckpt"
    torch.save({"callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": state}}, path)
    return path


def test_a_checkpoint_keyed_by_its_own_run_paths_is_identical(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    verdict = compare_files("last.ckpt", _model_checkpoint(a), _model_checkpoint(b), (a, b))
    assert (verdict.status, verdict.tensors_compared) == ("identical", 2), verdict.detail_lines()
    assert verdict.detail == "same tensors and fields; the bytes differ"  # no class named
    # negative control: another checkpoint is the best one, in the keys as in the values
    other = _model_checkpoint(b, best="epoch=0-step=6.ckpt")
    verdict = compare_files("last.ckpt", _model_checkpoint(a), other, (a, b))
    assert verdict.status == "tensors"
    key = "callbacks/ModelCheckpoint{'monitor': 'val_loss'}/best_k_models/{out}/ckpts/epoch="
    assert [(d.name, d.status) for d in verdict.tensors] == [
        (f"{key}0-step=6.ckpt", "extra"),
        (f"{key}1-step=12.ckpt", "missing"),
    ]
    assert len(verdict.fields) == 6  # best and kth best path; the Path key's list, 2 each side
    assert (
        "callbacks/ModelCheckpoint{'monitor': 'val_loss'}/best_model_path: "
        "'{out}/ckpts/epoch=1-step=12.ckpt' vs '{out}/ckpts/epoch=0-step=6.ckpt'"
    ) in verdict.fields
    fewer = compare_files("last.ckpt", _model_checkpoint(a), _model_checkpoint(b, kept=19), (a, b))
    (row,) = fewer.fields
    assert row.startswith("callbacks/ModelCheckpoint{'monitor': 'val_loss'}/a_set: set({'{out}/")


def test_a_differing_tensor_inside_a_checkpoint_is_named_by_its_key(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    verdict = compare_files("last.ckpt", _checkpoint(a), _checkpoint(b, weight=1.5), (a, b))
    assert verdict.status == "tensors"
    assert verdict.detail_lines() == [
        "state_dict/layer.weight: different, max |a-b| 0.5, rel L2 0.5"
    ]
    assert verdict.summary() == "last.ckpt (checkpoint): 1 of 3 tensors differ"


def test_a_checkpoint_differing_only_outside_tensors_is_fields_not_tensors(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    verdict = compare_files("last.ckpt", _checkpoint(a), _checkpoint(b, stamp=2.0), (a, b))
    assert verdict.status == "fields" and verdict.tensors == []
    assert verdict.fields == ["callbacks/ModelCheckpoint/stamp: 0.0 vs 2.0"]


def test_a_config_that_records_its_run_folder_compares_equal(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    for folder in (a, b):
        (folder / "hydra.yaml").write_text(f"run:\n  dir: {folder}\n  seed: 0\n")
    verdict = compare_files("hydra.yaml", a / "hydra.yaml", b / "hydra.yaml", (a, b))
    assert (verdict.kind, verdict.status) == ("file", "identical")
    (b / "hydra.yaml").write_text(f"run:\n  dir: {b}\n  seed: 1\n")  # negative control
    verdict = compare_files("hydra.yaml", a / "hydra.yaml", b / "hydra.yaml", (a, b))
    assert verdict.status == "bytes"
    assert verdict.detail == "text, line 3: '  seed: 0' vs '  seed: 1'"


def test_unreadable_files_are_named_with_the_readers_error(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    good = _checkpoint(a)
    (b / "last.ckpt").write_bytes(good.read_bytes()[:100])  # truncated
    verdict = compare_files("last.ckpt", good, b / "last.ckpt", (a, b))
    assert verdict.status == "unreadable" and verdict.detail.startswith(f"{b / 'last.ckpt'}: ")
    # A header that promises more than the file holds: safetensors' own error, neither
    # OSError nor ValueError (it once ended verify with a traceback).
    save_file({"w": torch.ones(4)}, a / "w.safetensors")
    (b / "w.safetensors").write_bytes((a / "w.safetensors").read_bytes()[:-3])
    verdict = compare_files("w.safetensors", a / "w.safetensors", b / "w.safetensors", (a, b))
    assert (verdict.kind, verdict.status) == ("safetensors", "unreadable")
    assert str(b / "w.safetensors") in verdict.detail
    # Bytes that are no pickle: the weights-only unpickler pops an empty stack (IndexError);
    # random bytes in verify's test hit it now and then and ended verify with a traceback.
    (b / "last.ckpt").write_bytes(b".")
    verdict = compare_files("last.ckpt", good, b / "last.ckpt", (a, b))
    assert verdict.status == "unreadable" and "not a torch file (IndexError" in verdict.detail


class Net(torch.nn.Module):
    """A class of the run's own, as a Lightning checkpoint's hyper_parameters hold one."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        torch.nn.init.constant_(self.layer.weight, weight)
        torch.nn.init.zeros_(self.layer.bias)


def test_a_checkpoint_holding_objects_is_compared_by_their_tensors_without_their_code(
    tmp_path: Path,
) -> None:
    a, b = _runs(tmp_path)
    for folder, (value, weight) in ((a, (1, 0.5)), (b, (2, 0.5))):
        torch.save(
            {"when": Path(str(value)), "hyper_parameters": {"net": Net(weight)}}, folder / "x.pt"
        )
    verdict = compare_files("x.pt", a / "x.pt", b / "x.pt", (a, b))
    assert verdict.status == "fields" and verdict.tensors_compared == 2
    assert verdict.fields == ["when: PurePosixPath('1') vs PurePosixPath('2')"]  # read as a path
    assert "read without running its code: " in verdict.detail
    assert f"{__name__}.Net" in verdict.detail and "pathlib" not in verdict.detail
    # A tensor inside the pickled object is a tensor like any other.
    torch.save({"hyper_parameters": {"net": Net(0.5)}}, a / "y.pt")
    torch.save({"hyper_parameters": {"net": Net(0.25)}}, b / "y.pt")
    verdict = compare_files("y.pt", a / "y.pt", b / "y.pt", (a, b))
    assert verdict.status == "tensors"
    assert [d.name for d in verdict.tensors] == [
        "hyper_parameters/net/state/_modules/layer/state/_parameters/weight"
    ]


class Planted:
    """Unpickling it calls os.system: what a checkpoint from elsewhere may hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_runs_none(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"x": torch.ones(1), "payload": Planted(marker)}, a / "x.pt")
    torch.save({"x": torch.zeros(1), "payload": Planted(marker)}, b / "x.pt")
    verdict = compare_files("x.pt", a / "x.pt", b / "x.pt", (a, b))
    assert verdict.status == "tensors" and [d.name for d in verdict.tensors] == ["x"]
    assert not marker.exists() and "posix.system" in verdict.detail


def test_text_files_are_never_read_as_safetensors(tmp_path: Path) -> None:
    (tmp_path / "train.log").write_text("epoch 0 loss 0.5 at 12:00:00\n")
    assert file_kind(tmp_path / "train.log") == "file"
    save_file({"w": torch.ones(1)}, tmp_path / "weights.bin")
    assert file_kind(tmp_path / "weights.bin") == "safetensors"  # negative control


def test_a_traces_fingerprint_rows_say_differs_without_a_magnitude(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    for folder, value in ((a, 5), (b, 2**62)):
        tensors = {"grads": torch.tensor([1, value])}
        meta = safetensors_metadata({"format": "reprotrain.trace"})
        save_file(tensors, folder / "trace.safetensors", metadata=meta)
        save_file(tensors, folder / "counts.safetensors")
    trace = compare_files("trace", a / "trace.safetensors", b / "trace.safetensors", (a, b))
    assert trace.detail_lines() == ["grads: differs"]
    counts = compare_files("counts", a / "counts.safetensors", b / "counts.safetensors", (a, b))
    assert "max |a-b|" in counts.detail_lines()[0]  # negative control: not a trace


def test_numpy_values_inside_a_checkpoint_are_tensors_and_their_differences_found(
    tmp_path: Path,
) -> None:
    # A NumPy array and scalar, pickled by torch.save: their placeholders' contents are made
    # anew at each read, and a freed one's id once hid the second value ("<seen above>").
    a, b = _runs(tmp_path)
    for folder, shift in ((a, 0.0), (b, 1.0)):
        torch.save(
            {
                "w": np.ones(4, dtype=np.float32) + shift,
                "mean": np.float64(0.5 + shift),
                "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
                "big_endian": np.arange(3, dtype=">i4"),
                "t": torch.ones(2),
            },
            folder / "m.pt",
        )
    verdict = compare_files("m.pt", a / "m.pt", b / "m.pt", (a, b))
    assert verdict.status == "tensors" and verdict.tensors_compared == 5
    assert [d.name for d in verdict.tensors] == ["mean", "w"]
    assert verdict.detail_lines() == [
        "mean: different, max |a-b| 1, rel L2 2",
        "w: different, max |a-b| 1, rel L2 1",
    ]
    from reprotrain.compare.readers import read_checkpoint

    tensors, _, _ = read_checkpoint(a / "m.pt")
    assert torch.equal(tensors["fortran"], torch.arange(6.0, dtype=torch.float64).view(2, 3))
    assert tensors["big_endian"].tolist() == [0, 1, 2]
    # Control: the same values in both runs are identical.
    torch.save(torch.load(a / "m.pt", weights_only=False), b / "m.pt")
    assert compare_files("m.pt", a / "m.pt", b / "m.pt", (a, b)).status == "identical"


def test_numpy_files_are_read_as_tensors_without_pickle(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    for folder, shift in ((a, 0), (b, 1)):
        np.save(folder / "w.npy", np.arange(4.0) + shift)
        np.savez(folder / "w.npz", x=np.arange(3) + shift, y=np.zeros(2))
        np.save(folder / "o.npy", np.array([{"k": shift}], dtype=object), allow_pickle=True)
    assert file_kind(a / "w.npy") == file_kind(a / "w.npz") == "arrays"
    npy = compare_files("w.npy", a / "w.npy", b / "w.npy", (a, b))
    assert npy.status == "tensors" and npy.detail_lines() == [
        "(array): different, max |a-b| 1, rel L2 0.535"
    ]
    npz = compare_files("w.npz", a / "w.npz", b / "w.npz", (a, b))
    assert npz.status == "tensors" and [d.name for d in npz.tensors] == ["x"]
    assert npz.tensors_compared == 2
    objects = compare_files("o.npy", a / "o.npy", b / "o.npy", (a, b))
    assert objects.status == "unreadable" and "an object array" in objects.detail
    # Control: a file of another kind is still compared by its bytes.
    (a / "w.bin").write_bytes((a / "w.npy").read_bytes()[8:])
    (b / "w.bin").write_bytes((b / "w.npy").read_bytes()[8:])
    assert compare_files("w.bin", a / "w.bin", b / "w.bin", (a, b)).status == "bytes"


class Point:
    """Pickled as a call with its argument: a placeholder whose contents are made per read."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __reduce__(self) -> tuple:
        return (Point, (self.x,))


def test_every_differing_field_of_many_placeholders_is_named(tmp_path: Path) -> None:
    a, b = _runs(tmp_path)
    for folder, shift in ((a, 0), (b, 1)):
        torch.save({"points": [Point(i + shift) for i in range(5)]}, folder / "p.pt")
    verdict = compare_files("p.pt", a / "p.pt", b / "p.pt", (a, b))
    # Before, freed contents' ids were taken for "seen above": 2 of the 5 were named.
    assert verdict.fields == [f"points/{i}/args/0: {i} vs {i + 1}" for i in range(5)]
    # Control: a list that holds one object twice names the second as seen above.
    twice = Point(7)
    torch.save({"points": [twice, twice]}, a / "q.pt")
    torch.save({"points": [twice, Point(8)]}, b / "q.pt")
    verdict = compare_files("q.pt", a / "q.pt", b / "q.pt", (a, b))
    assert verdict.fields == [
        "points/1: missing (not in b)",  # a's "<seen above>"
        "points/1/args/0: extra (not in a)",
        "points/1/class: extra (not in a)",
    ]


def test_numpy_arrays_torch_cannot_hold_are_compared_by_their_bytes(tmp_path: Path) -> None:
    import io
    import zipfile

    a, b = _runs(tmp_path)
    words = np.array([str(i) for i in range(2000)])  # a repr would elide the middle
    changed = words.copy()
    changed[1000] = "x"
    np.save(a / "vocab.npy", words)
    np.save(b / "vocab.npy", changed)
    verdict = compare_files("vocab.npy", a / "vocab.npy", b / "vocab.npy", (a, b))
    assert verdict.status == "fields" and verdict.fields[0].startswith("(array): 'array <U4")
    np.save(b / "vocab.npy", words)  # control: the same strings are identical
    assert compare_files("vocab.npy", a / "vocab.npy", b / "vocab.npy", (a, b)).identical
    # A header that promises more than the file holds is refused before NumPy allocates it.
    for index, folder in enumerate((a, b)):
        header = io.BytesIO()
        shape = (10**13 + index,)
        np.lib.format.write_array_header_1_0(
            header, {"descr": "<f8", "fortran_order": False, "shape": shape}
        )
        (folder / "big.npy").write_bytes(header.getvalue() + bytes(8))
        with zipfile.ZipFile(folder / "big.npz", "w") as archive:
            archive.writestr("x.npy", header.getvalue() + bytes(8))
    for name in ("big.npy", "big.npz"):
        verdict = compare_files(name, a / name, b / name, (a, b))
        assert verdict.status == "unreadable" and "its header promises shape" in verdict.detail
