"""configure_determinism: the flags it applies, and every failure it must detect."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from reprotrain import determinism, seeding
from reprotrain.determinism import DeterminismError, configure_determinism
from tests.helpers import cli_env

pytestmark = pytest.mark.usefixtures("restore_torch_flags")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with no PYTHONHASHSEED unless given."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_true_mode_applies_every_flag() -> None:
    settings = configure_determinism(seed=3, mode=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["PL_SEED_WORKERS"] == "1"
    assert settings.hash_seed_fixed_at_start and settings.problems == ()
    assert settings.trainer_flags() == {"deterministic": True, "benchmark": False}


def test_false_mode_is_the_fast_mode() -> None:
    settings = configure_determinism(seed=3, mode=False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert settings.trainer_flags() == {"deterministic": False, "benchmark": True}


def test_warn_mode_turns_alerts_into_warnings() -> None:
    configure_determinism(seed=3, mode="warn")
    assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_same_seed_same_streams_and_other_seed_differs() -> None:
    def draw(seed: int) -> tuple:
        configure_determinism(seed=seed, mode=True)
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    assert draw(11) == draw(11)
    assert draw(11) != draw(12)


@pytest.mark.parametrize("seed", [0, 42, 2**32 - 1])
def test_seeding_leaves_what_lightnings_seed_everything_leaves(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """configure_determinism seeds without importing Lightning; it must leave the same
    generator states and variables as Lightning's seed_everything(seed, workers=True)."""
    from lightning.fabric.utilities.seed import seed_everything

    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # put back after the test
        monkeypatch.setenv(name, "unset")

    def state() -> tuple:
        numpy_state = np.random.get_state()
        return (
            random.getstate(),
            (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
            torch.get_rng_state().tolist(),
            os.environ["PL_GLOBAL_SEED"],
            os.environ["PL_SEED_WORKERS"],
        )

    seed_everything(seed, workers=True, verbose=False)
    lightnings = state()
    seed_everything((seed + 1) % 2**32, workers=True, verbose=False)
    assert state() != lightnings  # the control: another seed leaves other states
    seeding.seed_at_start(seed)
    assert state() == lightnings
    for out_of_bounds in (-1, 2**32):  # refused, as numpy (and Lightning) refuse them
        with pytest.raises(ValueError):
            seeding.seed_at_start(out_of_bounds)


@pytest.mark.parametrize("seed", [0, 7, 2**63 - 1, 2**64 - 1])
def test_seed_all_seeds_torch_as_manual_seed_does(seed: int) -> None:
    torch.manual_seed(seed)
    expected = torch.get_rng_state()
    torch.manual_seed(seed + 1 if seed < 2**64 - 1 else 0)
    assert not torch.equal(torch.get_rng_state(), expected)  # the control: the state moved
    seeding.seed_all(seed)
    assert torch.equal(torch.get_rng_state(), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it is torch's own seeding")
def test_seed_all_without_cuda_formats_no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.manual_seed queues the CUDA seed with a formatted stack even without CUDA,
    1-2 ms a call under Lightning: the mode seeds every micro-batch and sample."""
    import traceback

    def stack_formatted(*args: object) -> list[str]:
        raise AssertionError("traceback.format_stack called")

    monkeypatch.setattr(traceback, "format_stack", stack_formatted)
    with pytest.raises(AssertionError, match="format_stack"):  # the control: torch's does
        torch.manual_seed(3)
    seeding.seed_all(3)
    assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(3).get_state())


def test_settings_are_json_ready() -> None:
    out = configure_determinism(seed=5, mode=True).as_dict()
    assert out["seed"] == 5 and out["python_hash_seed"] == "0" and out["problems"] == []


def test_unfixed_hash_seed_fails_closed_in_true_mode() -> None:
    result = _python(
        """
        from reprotrain.determinism import configure_determinism
        configure_determinism(seed=1, mode=True)
        """
    )
    assert result.returncode != 0
    assert "DeterminismError" in result.stderr and "PYTHONHASHSEED" in result.stderr


def test_hash_seed_set_after_start_is_still_detected() -> None:
    result = _python(
        """
        import os
        os.environ["PYTHONHASHSEED"] = "0"
        from reprotrain.determinism import configure_determinism
        configure_determinism(seed=1, mode=True)
        """
    )
    assert result.returncode != 0 and "PYTHONHASHSEED" in result.stderr


def test_unfixed_hash_seed_warns_in_warn_mode() -> None:
    result = _python(
        """
        import warnings
        from reprotrain.determinism import configure_determinism
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            settings = configure_determinism(seed=1, mode="warn")
        assert any("PYTHONHASHSEED" in str(w.message) for w in caught), caught
        assert not settings.hash_seed_fixed_at_start and len(settings.problems) == 1
        print("warned")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "warned"


def test_nonzero_hash_seed_fixed_at_start_is_accepted() -> None:
    result = _python(
        """
        from reprotrain.determinism import configure_determinism
        print(configure_determinism(seed=1, mode=True).python_hash_seed)
        """,
        PYTHONHASHSEED="1234",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1234"


def test_reexec_fixes_the_hash_seed_for_the_whole_process() -> None:
    result = _python(
        """
        import sys
        from reprotrain.determinism import reexec_with_fixed_hash_seed
        reexec_with_fixed_hash_seed()
        print(sys.flags.hash_randomization, hash("abc"))
        """
    )
    again = _python("print(0, hash('abc'))", PYTHONHASHSEED="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == again.stdout


def test_cuda_initialised_before_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: stand in for "something already called into CUDA".
    monkeypatch.setattr(determinism, "_cublas_before_cuda", None)
    monkeypatch.setattr(determinism, "_cuda_initialized", lambda: True)
    with pytest.raises(DeterminismError, match="CUDA was initialised before"):
        configure_determinism(seed=1, mode=True)


def test_a_second_call_after_cuda_started_keeps_the_first_calls_config(
    monkeypatch: pytest.MonkeyPatch, restore_torch_flags: None
) -> None:
    # Several fits in one process (a benchmark, a sweep): the first call ran before CUDA.
    monkeypatch.setattr(determinism, "_cublas_before_cuda", None)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    configure_determinism(seed=1, mode=True)
    monkeypatch.setattr(determinism, "_cuda_initialized", lambda: True)
    assert configure_determinism(seed=2, mode=True).problems == ()
    # The other deterministic value was not the one cuBLAS could have read: refused.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", determinism.CUBLAS_DETERMINISTIC_CONFIGS[1])
    with pytest.raises(DeterminismError, match="CUDA was initialised before"):
        configure_determinism(seed=3, mode=True)


def test_cuda_initialised_before_warns_in_warn_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(determinism, "_cublas_before_cuda", None)
    monkeypatch.setattr(determinism, "_cuda_initialized", lambda: True)
    with pytest.warns(UserWarning, match="CUDA was initialised before"):
        settings = configure_determinism(seed=1, mode="warn")
    assert settings.cuda_initialized_before


def test_cuda_check_is_skipped_in_fast_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(determinism, "_cuda_initialized", lambda: True)
    assert configure_determinism(seed=1, mode=False).problems == ()


def test_wrong_cublas_workspace_config_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(DeterminismError, match="CUBLAS_WORKSPACE_CONFIG=':0:0'"):
        configure_determinism(seed=1, mode=True)


@pytest.mark.parametrize("mode", [1, "true", None])
def test_unknown_mode_is_refused(mode: object) -> None:
    with pytest.raises(ValueError, match="mode must be"):
        configure_determinism(seed=1, mode=mode)  # type: ignore[arg-type]


def test_one_rule_decides_what_each_mode_does_with_a_problem() -> None:
    with pytest.raises(determinism.DeterminismError, match="the lock drifted"):
        determinism.refuse_or_warn(True, "the lock drifted")
    with pytest.warns(determinism.DeterminismWarning, match="the lock drifted"):
        determinism.refuse_or_warn("warn", "the lock drifted")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        determinism.refuse_or_warn(False, "the lock drifted")  # nothing promised, nothing said


#: ``if <mode test>:`` then a raise, a warning or a printed warning: a second copy of the rule.
_RULE_COPY = re.compile(r"if .*(is True|== \"warn\").*:\n\s+(raise|warnings\.warn|print)\b")


def _rule_copies(package: Path) -> list[str]:
    return sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "determinism.py" and _RULE_COPY.search(path.read_text())
    )


def test_no_other_module_decides_raise_or_warn_by_mode(tmp_path: Path) -> None:
    package = Path(determinism.__file__).parent
    assert _rule_copies(package) == []
    planted = tmp_path / "reprotrain"
    shutil.copytree(package, planted, ignore=shutil.ignore_patterns("__pycache__"))
    with (planted / "resume.py").open("a") as f:
        f.write("\n\ndef _planted(mode):\n    if mode is True:\n        raise ValueError\n")
    assert _rule_copies(planted) == ["resume.py"]


def test_fill_of_fresh_tensors_is_off_unless_asked_for_and_every_setting_says_why() -> None:
    settings = configure_determinism(seed=5, mode=True)
    assert settings.fill_uninitialized_memory is False
    assert set(settings.reasons()) == {
        "use_deterministic_algorithms",
        "CUBLAS_WORKSPACE_CONFIG",
        "cudnn.deterministic",
        "cudnn.benchmark",
        "fill_uninitialized_memory",
    }
    assert all(
        reason.split(":")[0] in ("kept", "off", "off unless asked for")
        for reason in settings.reasons().values()
    )
    filled = configure_determinism(seed=5, mode=True, fill_uninitialized_memory=True)
    assert filled.fill_uninitialized_memory and torch.isnan(torch.empty(64)).all()  # the control
    configure_determinism(seed=5, mode=True)
    assert not torch.utils.deterministic.fill_uninitialized_memory


def test_a_program_read_from_standard_input_is_not_restarted_into_nothing(tmp_path: Path) -> None:
    program = (
        "from reprotrain.determinism import reexec_with_fixed_hash_seed\n"
        "reexec_with_fixed_hash_seed()\nprint('restarted')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    piped = subprocess.run([sys.executable, "-"], input=program, text=True, capture_output=True,
                           env=env, cwd=tmp_path)  # fmt: skip
    assert piped.returncode == 1 and piped.stdout == ""
    assert "cannot restart this process: it read its program from standard input" in piped.stderr
    # Control: the same program as a file restarts and runs to its end.
    (tmp_path / "script.py").write_text(program)
    script = subprocess.run([sys.executable, "script.py"], text=True, capture_output=True,
                            env=env, cwd=tmp_path)  # fmt: skip
    assert script.returncode == 0 and script.stdout == "restarted\n", script.stderr
