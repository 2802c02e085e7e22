"""compare: traces name the first diverging step and its cause; weights; environments; plots.

Each trace scenario fits the tiny model twice with the same seed and settings;
the only difference between the two runs is the one under test (an unseeded
noise source from a given step, or a data order change), so the expected
answer is exact: that step, that record.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from reprotrain.compare.files import compare_files
from reprotrain.compare.report import ComparisonReport
from reprotrain.compare.weights import compare_weights
from reprotrain.hashing import canonical_json
from reprotrain.provenance.envdiff import classify_env_key, compare_environments
from reprotrain.trace.diff import (
    DIAGNOSES,
    TraceDiff,
    compare_traces,
    plot_losses,
    with_op_diagnosis,
)
from reprotrain.trace.tracefile import Trace, load_trace
from tests.test_fingerprint import OTHER_KINDS, _made
from tests.test_trace import (
    BATCH_SIZE,
    STEPS_PER_EPOCH,
    NoisyFromStep,
    NoisyGradFromStep,
    PrefixThenShuffle,
    TinyNet,
    fit_traced,
    unseeded_generator,
)

NOISE_FROM = 3


class NoisyGradOnOneParameter(TinyNet):
    """From step NOISE_FROM on, unseeded noise lands on the gradient of ``net.4.weight`` only."""

    def on_after_backward(self) -> None:
        if self.global_step >= NOISE_FROM:
            grad = self.net[4].weight.grad
            grad += 1e-3 * torch.randn(grad.shape, generator=unseeded_generator())


class NoisySGD(torch.optim.SGD):
    """SGD whose update gets unseeded noise from step NOISE_FROM on."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = super().step(closure)
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps > NOISE_FROM:
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p += 1e-4 * torch.randn(p.shape, generator=unseeded_generator())
        return loss


def _pair(tmp_path: Path, **options: object) -> tuple[Trace, Trace]:
    a = fit_traced(tmp_path / "a.safetensors", **options)  # type: ignore[arg-type]
    b = fit_traced(tmp_path / "b.safetensors", **options)  # type: ignore[arg-type]
    return load_trace(a), load_trace(b)


# -- compare_traces on real runs -------------------------------------------------------


def test_forward_noise_from_step_k_is_a_kernel_at_step_k(tmp_path: Path) -> None:
    model = lambda: TinyNet(NoisyFromStep(NOISE_FROM))  # noqa: E731
    a, b = _pair(tmp_path, make_model=model, weights_every=1)
    diff = compare_traces(a, b)
    assert not diff.identical
    assert (diff.first_step, diff.record) == (NOISE_FROM, "loss")
    assert diff.diagnosis == DIAGNOSES["loss"]  # weights traced every step: no caveat
    assert diff.diagnosis.startswith("non-deterministic kernel in the forward pass")
    assert "params" in diff.records_differing and "batch" not in diff.records_differing


def test_backward_noise_from_step_k_is_a_kernel_in_the_gradients(tmp_path: Path) -> None:
    model = lambda: TinyNet(NoisyGradFromStep(NOISE_FROM))  # noqa: E731
    a, b = _pair(tmp_path, make_model=model, weights_every=1)
    diff = compare_traces(a, b)
    assert (diff.first_step, diff.record) == (NOISE_FROM, "grads")
    assert diff.diagnosis.startswith("non-deterministic kernel in the backward pass")
    # Negative control: the loss at step k is still the same bits; it differs from k+1.
    assert np.array_equal(a.loss_value[: NOISE_FROM + 1], b.loss_value[: NOISE_FROM + 1])
    assert a.loss_value[NOISE_FROM + 1] != b.loss_value[NOISE_FROM + 1]


def test_default_detail_finds_backward_noise_at_the_next_loss_and_says_so(
    tmp_path: Path,
) -> None:
    # Weights traced on row 0 only (8 steps, every 8th row): the noise at step k shows
    # in the loss of step k+1, and compare names the untraced steps it may come from.
    a, b = _pair(tmp_path, make_model=lambda: TinyNet(NoisyGradFromStep(NOISE_FROM)))
    assert a.weights_traced.tolist() == [True] + [False] * (STEPS_PER_EPOCH - 1)
    diff = compare_traces(a, b)
    assert (diff.first_step, diff.record) == (NOISE_FROM + 1, "loss")
    assert "between step 1 and this step" in diff.diagnosis
    assert "weights_every=1" in diff.diagnosis


def test_full_detail_names_the_first_diverging_parameter(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, make_model=NoisyGradOnOneParameter, detail="full")
    diff = compare_traces(a, b)
    assert (diff.first_step, diff.record, diff.tensor) == (NOISE_FROM, "grads", "net.4.weight")


def test_noise_in_the_update_is_blamed_on_the_optimizer(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, make_model=lambda: TinyNet(optimizer=NoisySGD), weights_every=1)
    diff = compare_traces(a, b)
    assert (diff.first_step, diff.record) == (NOISE_FROM, "params")
    assert diff.diagnosis.startswith("optimizer")


def test_a_changed_shuffle_is_blamed_on_the_data_pipeline(tmp_path: Path) -> None:
    n = STEPS_PER_EPOCH * BATCH_SIZE
    prefix = NOISE_FROM * BATCH_SIZE  # batches before NOISE_FROM are in the same order
    a = fit_traced(tmp_path / "a.safetensors", sampler=PrefixThenShuffle(n, prefix, seed=1))
    b = fit_traced(tmp_path / "b.safetensors", sampler=PrefixThenShuffle(n, prefix, seed=2))
    diff = compare_traces(load_trace(a), load_trace(b))
    assert (diff.first_step, diff.record) == (NOISE_FROM, "batch")
    assert diff.diagnosis.startswith("data pipeline")


def test_different_seeds_diverge_at_step_zero(tmp_path: Path) -> None:
    a = fit_traced(tmp_path / "a.safetensors", seed=1)
    b = fit_traced(tmp_path / "b.safetensors", seed=2)
    assert a.read_bytes() != b.read_bytes()
    diff = compare_traces(load_trace(a), load_trace(b))
    assert diff.first_step == 0 and diff.record == "batch"
    assert not diff.initial_params_equal
    # One sentence names the cause, not the data pipeline the batch would suggest.
    assert diff.diagnosis.startswith("the initial weights differ") and "the seed" in diff.diagnosis
    assert "data pipeline" not in diff.to_text()


# -- compare_traces rules, on synthetic traces -----------------------------------------


def _synthetic(steps: int = 6) -> Trace:
    rows = np.arange(steps, dtype=np.int64)
    records = {name: rows * 10 + i for i, name in enumerate(("batch", "rng", "loss", "grads"))}
    records["params"] = rows * 10 + 4
    return Trace(
        detail="default",
        weights_every=1,
        step=rows,
        epoch=np.zeros(steps, np.int64),
        batch_idx=rows,
        loss_value=np.linspace(1.0, 0.5, steps),
        weights_traced=np.ones(steps, bool),
        records=records,
        initial_params=7,
        param_names=("w",),
        rng_sources=("python", "numpy", "torch"),
    )


def _changed(trace: Trace, record: str, row: int) -> Trace:
    values = trace.records[record].copy()
    values[row:] += 1
    return replace(trace, records={**trace.records, record: values})


def test_rng_first_means_random_consumption_changed() -> None:
    a = _synthetic()
    diff = compare_traces(a, _changed(_changed(a, "rng", 2), "loss", 2))
    assert (diff.first_step, diff.record) == (2, "rng")
    assert diff.diagnosis.startswith("random consumption changed")


def test_a_gradient_change_after_different_parameters_is_not_a_kernel() -> None:
    a = _synthetic()
    diff = compare_traces(a, replace(_changed(a, "grads", 0), initial_params=8))
    assert diff.record == "grads" and "kernel" not in diff.diagnosis


def test_nan_losses_are_compared_as_bits() -> None:
    nan_bits = np.array([np.nan]).view(np.int64)[0]
    records = {**_synthetic().records, "loss": np.full(6, nan_bits)}
    nans = replace(_synthetic(), loss_value=np.full(6, np.nan), records=records)
    assert compare_traces(nans, replace(nans)).identical
    diff = compare_traces(nans, _changed(nans, "loss", 4))  # another NaN payload from row 4
    assert (diff.first_row, diff.record) == (4, "loss")


def test_every_backward_loss_of_a_manual_step_counts_as_its_loss() -> None:
    """Two manual traces whose first losses agree but a later backward loss does not."""
    manual = replace(_synthetic(), backward_losses=np.arange(6, dtype=np.int64))
    later = replace(manual, backward_losses=np.array([0, 1, 2, 9, 9, 9], dtype=np.int64))
    assert compare_traces(manual, replace(manual)).identical
    diff = compare_traces(manual, later)
    assert (diff.first_row, diff.record) == (3, "loss")


def test_different_step_counts_are_reported() -> None:
    a = _synthetic(6)
    short = _synthetic(4)
    diff = compare_traces(a, short)
    assert not diff.identical
    assert (diff.first_step, diff.record, diff.steps_a, diff.steps_b) == (4, "length", 6, 4)
    assert compare_traces(a, _synthetic(6)).identical


# -- weights, environments, report, plot -----------------------------------------------


def test_compare_weights_finds_equal_perturbed_missing_and_reshaped_tensors() -> None:
    a = {"w": torch.ones(3, 2), "b": torch.zeros(2), "gone": torch.ones(1), "r": torch.ones(4)}
    b = {"w": a["w"].clone(), "b": a["b"].clone(), "new": torch.ones(1), "r": torch.ones(2, 2)}
    b["b"][1] = 0.5
    diffs = {d.name: d for d in compare_weights(a, b)}
    assert diffs["w"].equal and diffs["w"].max_abs_diff == 0 and diffs["w"].rel_l2 == 0
    assert diffs["b"].status == "different" and diffs["b"].max_abs_diff == 0.5
    assert diffs["b"].rel_l2 == float("inf")  # ||a|| is 0
    assert (diffs["gone"].status, diffs["new"].status, diffs["r"].status) == (
        "missing",
        "extra",
        "shape",
    )
    nudged = {"w": torch.nextafter(a["w"], torch.tensor(2.0))}
    one_ulp = compare_weights({"w": a["w"]}, nudged)[0]
    assert one_ulp.status == "different" and 0 < one_ulp.rel_l2 < 1e-6


@pytest.mark.parametrize("kind", sorted(OTHER_KINDS))
def test_sparse_quantized_and_nested_tensors_compare_by_their_parts(kind: str) -> None:
    """The same value is equal; one value changed is different, by its magnitude (a
    quantized tensor's dequantized) and the parts that differ."""
    same = compare_weights({"t": _made(kind, 2.0)}, {"t": _made(kind, 2.0)})[0]
    assert same.equal and (same.max_abs_diff, same.rel_l2) == (0.0, 0.0)
    changed = compare_weights({"t": _made(kind, 2.0)}, {"t": _made(kind, 3.0)})[0]
    assert changed.status == "different"
    assert changed.max_abs_diff == pytest.approx(1.0, rel=1e-6)
    assert "parts differing: " in changed.to_text()


def test_another_sparsity_pattern_is_a_difference_with_no_magnitude() -> None:
    other = torch.eye(3)
    other[0, 1] = 1.0
    diff = compare_weights({"adj": torch.eye(3).to_sparse()}, {"adj": other.to_sparse()})[0]
    assert (diff.status, diff.max_abs_diff, diff.rel_l2) == ("different", None, None)
    assert diff.to_text() == (
        "adj: different (parts differing: indices, values; another sparsity pattern: no max |a-b|)"
    )


def test_uncoalesced_sparse_tensors_compare_by_their_value() -> None:
    """Duplicates and order are how a COO tensor was built; the value is what is compared."""

    def coo(indices: list[list[int]], values: list[float]) -> torch.Tensor:
        return torch.sparse_coo_tensor(indices, values, (2, 2), check_invariants=True)

    built = coo([[1, 0, 1], [0, 0, 0]], [1.0, 2.0, 3.0])
    assert compare_weights({"s": built}, {"s": coo([[0, 1], [0, 0]], [2.0, 4.0])})[0].equal
    other = coo([[0, 1], [0, 0]], [2.0, 5.0])
    assert compare_weights({"s": built}, {"s": other})[0].max_abs_diff == 1.0


def test_a_layout_or_dtype_change_is_a_difference() -> None:
    a = {"l": torch.eye(2), "d": torch.ones(2)}
    b = {"l": torch.eye(2).to_sparse(), "d": torch.ones(2, dtype=torch.float64)}
    diffs = {d.name: d.to_text() for d in compare_weights(a, b)}
    assert diffs == {
        "l": "l: layout strided vs sparse_coo",
        "d": "d: different (dtype torch.float32 vs torch.float64), max |a-b| 0, rel L2 0",
    }


def test_a_nan_with_the_same_bits_is_equal_and_another_payload_is_not() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    same = compare_weights({"w": nan}, {"w": nan.clone()})[0]
    assert same.to_text() == "w: equal, max |a-b| 0, rel L2 0"
    payload = nan.view(torch.int32).clone()
    payload[0] += 1
    other = compare_weights({"w": nan}, {"w": payload.view(torch.float32)})[0]
    assert other.to_text() == (
        "w: different (equal values, other bits: a signed zero or a NaN payload), "
        "max |a-b| 0, rel L2 0"
    )
    signed = compare_weights({"z": torch.tensor([0.0])}, {"z": torch.tensor([-0.0])})[0]
    assert signed.status == "different"


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.bfloat16, torch.float8_e4m3fn, torch.complex32, torch.complex64,
     torch.uint64, torch.float4_e2m1fn_x2, torch.bits8],
    ids=lambda dtype: str(dtype).removeprefix("torch."),
)  # fmt: skip
def test_every_dtype_compares_by_its_bits_whatever_its_strides(dtype: torch.dtype) -> None:
    raw = torch.arange(48, dtype=torch.uint8) % (2 if dtype == torch.bool else 255)
    tensor = raw.view(dtype).reshape(2, -1).t()  # not contiguous
    assert compare_weights({"t": tensor}, {"t": tensor.contiguous()})[0].equal
    flipped = raw.clone()
    flipped[0] ^= 1
    other = compare_weights({"t": tensor}, {"t": flipped.view(dtype).reshape(2, -1).t()})[0]
    assert other.status == "different"


def test_a_meta_tensor_is_compared_by_dtype_and_shape() -> None:
    meta = torch.empty(3, device="meta")
    assert compare_weights({"m": meta}, {"m": torch.empty(3, device="meta")})[0].equal
    wider = compare_weights({"m": meta}, {"m": torch.empty(3, device="meta").double()})[0]
    assert wider.to_text() == (
        "m: different (dtype torch.float32 vs torch.float64; meta tensors hold no data)"
    )


def test_trace_files_with_the_same_nan_losses_have_no_loss_row(tmp_path: Path) -> None:
    """A trace of a diverged run holds NaN losses: the same bits are no difference."""
    folders = (tmp_path / "a", tmp_path / "b")
    nan = torch.full((3,), float("nan"), dtype=torch.float64)
    paths = []
    for folder, rng in zip(folders, (0, 1), strict=True):
        folder.mkdir()
        rngs = torch.arange(3, dtype=torch.int64) + rng
        paths.append(_write_trace(folder / "trace.safetensors", loss_value=nan, rng=rngs))
    verdict = compare_files("trace.safetensors", *paths, folders)
    assert verdict.detail_lines() == ["rng: differs"]


def test_environment_gpu_and_torch_changes_void_the_guarantee_but_a_commit_does_not() -> None:
    a = {"git": {"commit": "abc"}, "gpu": [{"name": "H100"}], "torch": {"version": "2.13.0"}}
    b = {"git": {"commit": "def"}, "gpu": [{"name": "A100"}], "torch": {"version": "2.12.0"}}
    diffs = {d.key: d for d in compare_environments(a, b)}
    assert set(diffs) == {"git.commit", "gpu.0.name", "torch.version"}
    assert diffs["gpu.0.name"].voids and diffs["torch.version"].voids
    assert not diffs["git.commit"].voids
    assert compare_environments(a, a) == []
    assert classify_env_key("python_version")[0] == "may matter"
    assert classify_env_key("cudnn_version")[0] == "voids"
    assert classify_env_key("data.digits_path")[0] == "no"  # "git" inside a word is not git


def test_report_renders_text_and_json(tmp_path: Path) -> None:
    a = _synthetic()
    report = ComparisonReport(
        trace=compare_traces(a, _changed(a, "batch", 3)),
        weights=compare_weights({"w": torch.zeros(2)}, {"w": torch.ones(2)}),  # rel L2 inf
        environment=compare_environments({"torch": "2.13"}, {"torch": "2.12"}),
    )
    text = report.to_text()
    assert "diverge at step 3" in text and "data pipeline" in text and "VOID" in text
    data = json.loads(canonical_json(report.to_dict()))  # strict JSON: no inf or NaN
    assert data["trace"]["record"] == "batch" and data["guarantee_applies"] is False
    assert data["weights_equal"] is False


def test_a_reports_weights_equal_is_null_when_it_holds_no_weights() -> None:
    """A library user's report of traces alone says nothing about weights, not "equal"."""
    assert ComparisonReport(trace=None).to_dict()["weights_equal"] is None
    same = compare_weights({"w": torch.zeros(2)}, {"w": torch.zeros(2)})
    assert ComparisonReport(weights=same).to_dict()["weights_equal"] is True  # the control


def test_plot_losses_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "loss.png"
    plot_losses(_synthetic(6), _synthetic(4), out)
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


# -- reprotrain compare on any script's files --------------------------------------------


def test_compare_takes_the_files_any_script_names(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from tests.helpers import run_cli

    for run, seed in (("a", 0), ("b", 0), ("c", 1)):
        fit_traced(tmp_path / run / "logs" / "steps.safetensors", seed=seed)
        weights = {"w": torch.arange(4.0) + (seed * 1e-3 if run == "c" else 0.0)}
        (tmp_path / run / "out").mkdir()
        save_file(weights, tmp_path / run / "out" / "final.safetensors")
    named = ("--model", "out/final.safetensors", "--trace", "logs/steps.safetensors")
    same = run_cli("compare", "a", "b", *named, cwd=tmp_path)
    assert same.returncode == 0 and "IDENTICAL" in same.stdout, same.stdout + same.stderr
    other = run_cli("compare", "a", "c", *named, cwd=tmp_path)
    assert other.returncode == 1, other.stderr
    assert "traces diverge at step 0" in other.stdout and "  w       different" in other.stdout
    # single files: two traces, or two weights files
    traces = run_cli(
        "compare", "a/logs/steps.safetensors", "c/logs/steps.safetensors", cwd=tmp_path
    )
    assert traces.returncode == 1 and "traces diverge at step 0" in traces.stdout
    weights = run_cli("compare", "a/out/final.safetensors", "b/out/final.safetensors", cwd=tmp_path)
    assert weights.returncode == 0, weights.stdout + weights.stderr
    for bad, says in (
        (("a/out/final.safetensors", "b/logs/steps.safetensors"), "nothing to compare"),
        (("a", "b", "--model", "out/nope.safetensors"), "out/nope.safetensors: not found"),
    ):
        done = run_cli("compare", *bad, cwd=tmp_path)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1


def _op(kind: str, diagnosis: str) -> dict:
    where = {"op": "aten.mul.Tensor", "phase": "forward", "line": "train.py:39"}
    return {"identical": False, "kind": kind, "diagnosis": diagnosis, "op": where}


def test_the_op_recording_decides_the_one_diagnosis() -> None:
    guess = TraceDiff(False, 9, 9, first_step=3, first_row=3, record="loss",
                      diagnosis=DIAGNOSES["loss"])  # fmt: skip
    here = "a Python value passed to this op differs: the cause is here"
    value = with_op_diagnosis(guess, _op("inputs", here))
    assert value.diagnosis.startswith(here) and "train.py:39" in value.diagnosis
    assert "kernel" not in value.to_text()
    kernel = with_op_diagnosis(guess, _op("kernel", "same inputs, different output"))
    assert kernel.diagnosis.startswith("non-deterministic kernel: aten.mul.Tensor")
    # Negative controls: nothing found by the recording, or a seed: the trace's words stay.
    assert with_op_diagnosis(guess, {"identical": True}) == guess
    seeded = replace(guess, initial_params_equal=False, diagnosis=DIAGNOSES["initial"])
    assert with_op_diagnosis(seeded, _op("inputs", here)) == seeded


# -- reprotrain compare on bad input: one line naming the file, exit 2 -------------------


def _write_trace(
    path: Path, shift: int = 0, drop: tuple[str, ...] = (), **tensors: torch.Tensor
) -> Path:
    """A three-step trace file as TraceCallback writes one; ``tensors`` replace columns."""
    from safetensors.torch import save_file

    from reprotrain.hashing import safetensors_metadata

    rows = torch.arange(3, dtype=torch.int64)
    columns = {name: rows + shift for name in ("step", "batch_idx", "batch", "rng", "loss")}
    columns |= {name: rows.clone() for name in ("grads", "params")}
    columns |= {"epoch": torch.zeros(3, dtype=torch.int64), "loss_value": rows.double()}
    columns |= {"weights_traced": torch.ones(3, dtype=torch.bool)}
    columns |= {"initial_params": torch.tensor([7]), **tensors}
    meta = {"format": "reprotrain.trace", "version": 2, "detail": "default",
            "weights_every": 1, "param_names": ["w"], "rng_sources": ["torch"]}  # fmt: skip
    kept = {name: column for name, column in columns.items() if name not in drop}
    save_file(kept, path, safetensors_metadata(meta))
    return path


def _write_header(path: Path, header: object) -> Path:
    """A file with a safetensors size prefix and ``header`` as its JSON header."""
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    return path


def _write_weights(path: Path, shift: float = 0.0) -> Path:
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4.0) + shift}, path)
    return path


def _bad_file(tmp_path: Path, case: str) -> Path:
    path = tmp_path / "bad.safetensors"
    if case == "truncated":
        path.write_bytes(_write_weights(tmp_path / "whole.safetensors").read_bytes()[:-4])
    elif case == "header a list":
        _write_header(path, [1, 2])
    elif case == "metadata a string":
        _write_header(path, {"__metadata__": "x"})
    elif case == "trace without tensors":
        _write_trace(path, drop=("initial_params",))
    elif case == "trace of rank 4 of 1":
        _write_trace(path, rank=torch.tensor([0, 0, 4]))
    elif case == "trace with flat final state":
        _write_trace(path, final_state=torch.zeros(3, dtype=torch.int64))
    else:
        _write_trace(path, batch=torch.zeros(3, dtype=torch.bfloat16))
    return path


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("truncated", "not a readable weights/trace file (Error while deserializing header"),
        ("header a list", "not a readable weights/trace file (its header is not a JSON object)"),
        ("metadata a string", "not a readable weights/trace file (its __metadata__ is not"),
        ("trace without tensors", "a damaged reprotrain trace (no 'initial_params' tensor)"),
        ("trace in bf16", "a damaged reprotrain trace ('batch' is bfloat16, not int64)"),
        ("trace of rank 4 of 1", "a damaged reprotrain trace (a 'rank' with no 'initial_params"),
        ("trace with flat final state", "a damaged reprotrain trace ('final_state' is not one"),
    ],
)
def test_compare_refuses_an_unreadable_file_in_one_line(
    tmp_path: Path, case: str, says: str
) -> None:
    from tests.helpers import run_in_process

    is_trace = case.startswith("trace")
    good = (
        (_write_trace(tmp_path / "a.safetensors"), _write_trace(tmp_path / "b.safetensors", 1))
        if is_trace
        else (
            _write_weights(tmp_path / "a.safetensors"),
            _write_weights(tmp_path / "b.safetensors", 1),
        )
    )
    done = run_in_process("compare", _bad_file(tmp_path, case), good[1])
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.startswith(f"reprotrain: error: {tmp_path / 'bad.safetensors'}: {says}")
    assert done.stderr.count("\n") == 1 and ("; rerun" in done.stderr or "; copy" in done.stderr)
    # negative control: good files of the same kind compare, and differ
    compared = run_in_process("compare", *good)
    assert compared.returncode == 1 and compared.stderr == "", compared.stderr
    assert "DIFFERENT" in compared.stdout


def test_compare_refuses_a_model_path_that_leaves_the_folders(tmp_path: Path) -> None:
    from tests.helpers import run_in_process

    fa, fb = tmp_path / "fa", tmp_path / "fb"
    for folder, shift in ((fa, 0.0), (fb, 1.0)):
        folder.mkdir()
        _write_weights(folder / "model.safetensors", shift)
        (folder / "linked.safetensors").symlink_to(fa / "model.safetensors")  # leaves fb only
    outside = f"leads outside {fb} (to {fa / 'model.safetensors'})"
    for rel, says in (
        (str(fa / "model.safetensors"), "an absolute path names one file for both runs"),
        ("../fa/model.safetensors", outside),
        ("linked.safetensors", outside),
    ):
        done = run_in_process("compare", fa, fb, "--model", rel)
        assert done.returncode == 2 and done.stdout == "", done.stdout
        assert done.stderr.startswith(f"reprotrain: error: --model {rel}: "), done.stderr
        assert says in done.stderr and done.stderr.count("\n") == 1
    (fa / "loop").symlink_to("loop")  # a link to itself: one line, not Path.resolve's error
    looped = run_in_process("compare", fa, fb, "--model", "loop")
    assert looped.returncode == 2 and looped.stderr.count("\n") == 1, looped.stderr
    # negative control: the file named inside each folder finds the difference
    inside = run_in_process("compare", fa, fb, "--model", "model.safetensors")
    assert inside.returncode == 1 and "w       different" in inside.stdout, inside.stderr


def test_compare_refuses_a_plot_folder_before_comparing(tmp_path: Path) -> None:
    from tests.helpers import run_in_process

    a, b = _write_trace(tmp_path / "a.safetensors"), _write_trace(tmp_path / "b.safetensors", 1)
    folder = tmp_path / "plots"
    folder.mkdir()
    done = run_in_process("compare", a, b, "--plot", folder)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"reprotrain: error: --plot {folder}: is a folder; pass")
    assert list(folder.iterdir()) == []
    # negative control: a file path gets the plot
    plotted = run_in_process("compare", a, b, "--plot", folder / "loss.png")
    assert plotted.returncode == 1 and (folder / "loss.png").is_file(), plotted.stderr
    assert f"loss plot: {folder / 'loss.png'}" in plotted.stdout
    weights = [
        _write_weights(tmp_path / f"{name}.st", shift) for name, shift in (("c", 0), ("d", 1))
    ]
    unplotted = run_in_process("compare", *weights, "--plot", folder / "none.png")
    assert "no loss plot: a run has no trace" in unplotted.stdout, unplotted.stdout
    assert not (folder / "none.png").exists()


def test_identical_revisions_without_the_dvc_cache_say_the_weights_were_not_compared(
    tmp_path: Path,
) -> None:
    from tests.helpers import ROOT, commit_all, run_checked, run_in_process

    repo = tmp_path / "repo"
    repo.mkdir()
    run_checked("git", "init", "-q", cwd=repo)
    run_checked(sys.executable, "-m", "dvc", "init", "-q", cwd=repo)
    (repo / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    trace = _write_trace((repo / "models").mkdir() or repo / "models" / "trace.safetensors")
    commit_all(repo, "a run whose weights are in no DVC cache")  # the trace is in git

    def compare_head() -> tuple[str, dict]:
        done = run_in_process("compare", "HEAD", "HEAD", "--repo", repo)
        as_json = run_in_process("compare", "HEAD", "HEAD", "--repo", repo, "--json")
        assert done.returncode == as_json.returncode == 0, done.stderr + as_json.stderr
        verdict = done.stdout.splitlines()[-1]
        assert verdict.startswith("IDENTICAL: the same bits (trace "), done.stdout
        return verdict, json.loads(as_json.stdout)

    # no dvc.lock records the model here: DVC's own reason reaches the user
    why = "models/model.safetensors at HEAD: cannot read it (PathMissingError: "
    verdict, as_json = compare_head()
    assert f"; weights not compared: {why}" in verdict
    assert as_json["identical"] is True and as_json["weights_equal"] is None
    assert list(as_json["sha256"]) == ["trace"] and as_json["weights"] == []
    assert [n for n in as_json["notes"] if n.startswith(f"weights not compared: {why}")]
    # dvc.lock records it: only its bytes are missing from the cache, and that is the reason
    md5 = "0123456789abcdef" * 2
    out = {"path": "models/model.safetensors", "hash": "md5", "md5": md5, "size": 4}
    stage = {"cmd": "reprotrain train", "outs": [out]}
    (repo / "dvc.lock").write_text(json.dumps({"schema": "2.0", "stages": {"train": stage}}))
    commit_all(repo, "the run's lock")
    why = f"models/model.safetensors at HEAD: dvc.lock there records it (md5 {md5}), but it "
    verdict, as_json = compare_head()
    assert f"; weights not compared: {why}is not in the DVC cache here" in verdict, verdict
    assert "PathMissingError" not in verdict  # DVC's "neither as a DVC output" is not true
    assert as_json["weights_equal"] is None
    assert [n for n in as_json["notes"] if n.startswith(f"weights not compared: {why}")]
    # negative control: two trace files are all the user asked about; nothing is missing
    files = run_in_process("compare", trace, trace)
    assert files.returncode == 0 and "IDENTICAL" in files.stdout
    assert "not compared" not in files.stdout, files.stdout
    files_json = json.loads(run_in_process("compare", trace, trace, "--json").stdout)
    assert files_json["weights_equal"] is None  # not compared, but nothing was missing
    assert not [note for note in files_json["notes"] if "not compared" in note]


def test_json_weights_equal_is_null_unless_weights_were_compared(tmp_path: Path) -> None:
    from tests.helpers import run_in_process

    def weights_equal(a: Path, b: Path) -> object:
        done = run_in_process("compare", a, b, "--json")
        assert done.returncode in (0, 1), done.stderr
        return json.loads(done.stdout)["weights_equal"]

    traces = [_write_trace(tmp_path / f"t{shift}.safetensors", shift) for shift in (0, 1)]
    weights = [
        _write_weights(tmp_path / f"w{i}.safetensors", shift) for i, shift in ((0, 0), (1, 1))
    ]
    same = _write_weights(tmp_path / "same.safetensors")
    # traces that differ load the weights report too; it had said true with no weights
    assert weights_equal(traces[0], traces[1]) is None
    assert weights_equal(traces[0], traces[0]) is None
    # controls: weights compared say what they found
    assert weights_equal(weights[0], same) is True
    assert weights_equal(weights[0], weights[1]) is False


def test_differing_run_inputs_come_before_the_traces_kernel_diagnosis() -> None:
    from reprotrain.provenance.envdiff import InputDiff

    a = _synthetic()
    trace = compare_traces(a, _changed(a, "loss", 3))
    changed = [InputDiff("recipe.model.init_args.optim.momentum", 0.9, 0.5)]
    lines = ComparisonReport(trace=trace, inputs=changed).to_text().splitlines()
    assert lines[:2] == [
        "run inputs that differ (1), the likely explanation:",
        "  recipe.model.init_args.optim.momentum: 0.9 -> 0.5",
    ]
    assert "as if the inputs were equal" in lines[-1]
    # Control: with equal inputs the trace leads, and nothing is said of inputs.
    alone = ComparisonReport(trace=trace).to_text()
    assert alone.startswith(trace.to_text()) and "inputs" not in alone
