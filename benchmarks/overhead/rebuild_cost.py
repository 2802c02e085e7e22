"""What `reprotrain verify-attestation --rebuild` costs against one pipeline run.

Copies this checkout into a temporary git repository, runs and commits the
pipeline, attests it with a fresh P-256 key, then times, one after another:
one `dvc repro --force` of the pipeline (the run the rebuild repeats), a
rebuild into an empty work folder (it installs the commit's lock into a new
environment), and a rebuild into the same folder again (the environment of
that lock is reused). Prints each time and its ratio to the pipeline run.

    .venv/bin/python benchmarks/overhead/rebuild_cost.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from tests.helpers import cli_env, commit_all, copy_checkout


def _timed(argv: list[str], repo: Path) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=repo, env=cli_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv))} failed:\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - start


def main() -> None:
    reprotrain = [sys.executable, "-m", "reprotrain"]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        copy_checkout(repo)
        subprocess.run(["dvc", "repro"], cwd=repo, env=cli_env(), check=True, capture_output=True)
        commit_all(repo, "the run")
        key = Path(tmp) / "key.pem"
        subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout",
                        "-out", key], check=True)  # fmt: skip
        pub = Path(tmp) / "pub.pem"
        subprocess.run(["openssl", "ec", "-in", key, "-pubout", "-out", pub], check=True,
                       capture_output=True)  # fmt: skip
        _timed([*reprotrain, "attest", "--key", str(key)], repo)
        bundle = "attestation/attestation.bundle.json"
        work = str(Path(tmp) / "work")
        rebuild = [*reprotrain, "verify-attestation", bundle, "--key", str(pub), "--rebuild",
                   "--workdir", work]  # fmt: skip
        times = {
            "one pipeline run (dvc repro --force)": _timed(["dvc", "repro", "--force"], repo),
            "rebuild, new environment": _timed(rebuild, repo),
            "rebuild, environment reused": _timed(rebuild, repo),
        }
    base = times["one pipeline run (dvc repro --force)"]
    for name, seconds in times.items():
        print(f"  {name:38s} {seconds:7.1f} s  x{seconds / base:.2f}")


if __name__ == "__main__":
    main()
