"""Is a warm Inductor cache another torch wrote used? Inductor alone, and under reprotrain.

Inductor keys a compiled kernel's shared library by its C++ source and compile
command, not by the headers of the torch that built it. So when torch is replaced
at the same path (a venv or image rebuilt with another torch), a kernel whose
source did not change is loaded as the other torch built it. This measures how
many, with another torch installed in a folder of its own::

    pip install --target /tmp/other-torch torch==2.14.1        # any other torch build
    .venv/bin/python benchmarks/cpu/inductor_cache_reuse.py /tmp/other-torch

Both torches are reached through one path (a ``torch`` symlink in a scratch folder on
``PYTHONPATH``, switched between them), as an in-place upgrade leaves it. Per way, in
fresh processes: the lock's torch with a cold cache (how many kernels the loop needs),
the other torch writing a cache, then the lock's torch on that cache (how many kernels
it built anew; the rest it loaded). ``inductor alone`` is plain torch;
``reprotrain`` runs under ``reprotrain run --cpu-profile portable`` and
``configure_determinism``, whose cache folder is keyed by the torch build and
compiler (:func:`reprotrain.provenance.toolchain.keyed_cache_dir`). Each line also
says whether the warm run's weights equal the cold run's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("inductor alone", "reprotrain")


def child(way: str, out: Path) -> None:
    """Three AdamW steps of a compiled TinyGPT; writes the weights' sha256 and torch's version."""
    import torch

    from reprotrain.hashing import sha256_state_dict
    from reprotrain.recipes.language_model import TinyGPT

    if way == "reprotrain":
        from reprotrain.determinism import configure_determinism

        configure_determinism(0, True)
    else:
        torch.manual_seed(0)
    model = TinyGPT(vocab_size=40, block_size=32, n_layer=1, n_head=2, n_embd=32, attention="sdpa")
    model.blocks = torch.compile(model.blocks)
    optimizer = model.configure_optimizers()
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        tokens = torch.randint(0, 40, (8, 33), generator=g)
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        model.training_step(batch, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    out.write_text(f"{torch.__version__} {sha256_state_dict(model.state_dict())}\n")


def run(way: str, torch_dir: Path, swap: Path, cache: Path, out: Path, extra: str = "") -> str:
    """One child with ``swap/torch`` pointing at ``torch_dir/torch``; its output line."""
    link = swap / "torch"
    link.unlink(missing_ok=True)
    link.symlink_to(torch_dir / "torch")
    path = [str(swap), *([extra] if extra else []), str(ROOT / "src"), str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    me = [sys.executable, __file__, "--child", way, "--out", str(out)]
    if way == "reprotrain":
        me = [sys.executable, "-m", "reprotrain", "run", "--cpu-profile", "portable", "--", *me]
    done = subprocess.run(me, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{way} ({torch_dir}): exit {done.returncode}\n{done.stderr[-3000:]}")
    return out.read_text().strip()


def kernels(cache: Path) -> int:
    return sum(1 for _ in cache.rglob("*.so"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "other", type=Path, nargs="?", help="a folder holding another torch (pip --target)"
    )
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.out)
        return
    if args.other is None:
        parser.error("name a folder holding another torch (pip install --target DIR torch==X)")
    spec = importlib.util.find_spec("torch")
    lock_dir = Path(next(iter(spec.submodule_search_locations))).parent
    with tempfile.TemporaryDirectory(prefix="inductor-cache-reuse-") as scratch:
        tmp = Path(scratch)
        swap = tmp / "swap"
        swap.mkdir()
        for way in WAYS:
            name = way.replace(" ", "-")
            cold_cache, cache = tmp / f"{name}-cold", tmp / f"{name}-warm"
            cold = run(way, lock_dir, swap, cold_cache, tmp / f"{name}-cold.txt")
            needed = kernels(cold_cache)
            other = run(way, args.other, swap, cache, tmp / f"{name}-other.txt", str(args.other))
            before = kernels(cache)
            warm = run(way, lock_dir, swap, cache, tmp / f"{name}-warm.txt")
            loaded = needed - (kernels(cache) - before)
            same = "the same" if warm.split()[1] == cold.split()[1] else "OTHER"
            agree = "the same" if other.split()[1] == cold.split()[1] else "other"
            print(
                f"{way:15s} torch {cold.split()[0]} on a cache torch {other.split()[0]} wrote: "
                f"{loaded} of {needed} kernels loaded as the other torch built them; "
                f"weights {same} as with a cold cache (the other torch's: {agree})"
            )


if __name__ == "__main__":
    main()
