"""Seeding python, numpy and torch from one integer: at process start, and again inside a run.

:func:`seed_at_start` seeds as Lightning's ``seed_everything(seed, workers=True)``
does, without importing Lightning (:func:`reprotrain.determinism.configure_determinism`
calls it); :func:`seed_all` re-seeds every generator now (a micro-batch, a
replayed step); :func:`seed_torch` seeds torch's generators without the cost
``torch.manual_seed`` pays where CUDA is not started. numpy and torch are
imported inside each function, so importing this module costs nothing.
"""

from __future__ import annotations

import os


def seed_at_start(seed: int) -> None:
    """Seed as Lightning's ``seed_everything(seed, workers=True)`` does, without importing
    Lightning (about 2 s of a plain script's start): the same generators from the same
    integer, and ``PL_GLOBAL_SEED`` / ``PL_SEED_WORKERS``, which Lightning's Trainer and
    worker init function read. tests/test_determinism.py checks it leaves the very states
    and variables Lightning's function leaves."""
    import random

    import numpy as np
    import torch

    seed = int(seed)
    if not 0 <= seed <= np.iinfo(np.uint32).max:  # numpy's bounds, as Lightning checks
        raise ValueError(f"seed {seed} is out of bounds: give 0 to {np.iinfo(np.uint32).max}")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ["PL_SEED_WORKERS"] = "1"


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) from one integer, now.

    For re-seeding inside a run (a micro-batch, a replayed step); at process
    start :func:`configure_determinism` seeds with :func:`seed_at_start`, workers included.
    """
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    seed_torch(seed)


def seed_torch(seed: int) -> None:
    """Seed torch's CPU generator and, where CUDA is there, every CUDA device's: what
    ``torch.manual_seed`` does for the devices reprotrain trains on, at a fraction of its
    cost where CUDA is not started.

    ``torch.manual_seed`` queues the CUDA seed for a later start with a formatted stack
    trace (``traceback.format_stack``), also on a build or host without CUDA: 1-2 ms a
    call under Lightning's deep stack, paid per micro-batch and per sample by the
    world-size-invariant mode. Here a host without CUDA skips that queue; a host with it
    seeds it as ``torch.manual_seed`` does (at once when started, else queued).
    """
    import torch

    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
