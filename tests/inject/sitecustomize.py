"""Test-only fault injection: Python imports this at start-up when ``tests/inject`` is on
PYTHONPATH, in every process a test starts (``reprotrain`` and the trainings it spawns).

With ``REPROTRAIN_TEST_NOISE_FROM_STEP=k`` the digits recipe's network (its module-level
:func:`reprotrain.recipes.digits.build_network`, which ``Classifier`` calls by name) gets one
extra layer, ``NoisyGrad``, after its first Linear layer: an identity in the forward pass whose
backward pass adds noise from an unseeded generator from its k-th training call on. That is a
stand-in for a non-deterministic backward kernel, which verify, compare and locate must find.
``REPROTRAIN_TEST_NOISE_RANK=r`` limits it to DDP rank r; ``REPROTRAIN_TEST_NOISE_IN=forward``
adds the noise to the forward pass instead (a difference that stays on that rank's loss).
``REPROTRAIN_TEST_SKEW_RANK=r`` gives rank r other run inputs (so another run ID).
``REPROTRAIN_TEST_KILL_AT=outputs|trace|run_record|cleanup`` SIGKILLs the train stage after
its final checkpoint: before its first output, its trace, its run record, or just after it.
``REPROTRAIN_TEST_SIGTERM_AT_STEP=k`` sends SIGTERM to the training process itself at the start
of training step k (global step, on rank 0), as a preemption that lands mid-epoch at a chosen
batch; the step finishes and the run stops with its interrupt checkpoint.
``REPROTRAIN_TEST_CPU=xeon-avx512`` makes the environment record see another CPU model of this
machine's vendor (AVX-512, more cores) in place of this machine's; ``no-fma`` a CPU whose flags
lack FMA (what the portable profile needs with AVX2).
"""

from __future__ import annotations

import os

FROM_STEP = os.environ.get("REPROTRAIN_TEST_NOISE_FROM_STEP")
ONLY_RANK = os.environ.get("REPROTRAIN_TEST_NOISE_RANK")
IN_FORWARD = os.environ.get("REPROTRAIN_TEST_NOISE_IN") == "forward"

if FROM_STEP is not None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import reprotrain.recipes.digits as digits

    def _noise_like(t: torch.Tensor) -> torch.Tensor:
        unseeded = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        return 1e-4 * torch.randn(t.shape, generator=unseeded).to(t)

    class _Noise(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x + _noise_like(x) if IN_FORWARD else x.view_as(x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            return grad if IN_FORWARD else grad + _noise_like(grad)

    def _this_rank_noisy() -> bool:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return ONLY_RANK is None or int(ONLY_RANK) == rank

    class NoisyGrad(nn.Module):
        def __init__(self, from_step: int) -> None:
            super().__init__()
            self.from_step, self.calls = from_step, 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.training:
                return x
            self.calls += 1
            noisy = self.calls > self.from_step and _this_rank_noisy()
            return _Noise.apply(x) if noisy else x

    original = digits.build_network

    def build_network(
        input_shape: tuple[int, ...], num_classes: int, channels: int, hidden: int, dropout: float
    ) -> nn.Module:
        layers = list(original(input_shape, num_classes, channels, hidden, dropout))
        first_linear = next(i for i, m in enumerate(layers) if isinstance(m, nn.Linear))
        layers.insert(first_linear + 1, NoisyGrad(int(FROM_STEP)))
        return nn.Sequential(*layers)

    digits.build_network = build_network

if os.environ.get("REPROTRAIN_TEST_SKEW_RANK") is not None:
    # Rank r computes its run inputs with one extra field, as a node with other code would.
    import reprotrain.pipeline.stages.train as pipeline_train

    skewed_rank = os.environ["REPROTRAIN_TEST_SKEW_RANK"]
    original_inputs = pipeline_train.stage_inputs

    def stage_inputs(*args: object, **kwargs: object) -> dict:
        inputs = original_inputs(*args, **kwargs)
        if os.environ.get("LOCAL_RANK", "0") == skewed_rank:
            inputs["skew"] = True
        return inputs

    pipeline_train.stage_inputs = stage_inputs

if os.environ.get("REPROTRAIN_TEST_KILL_AT") is not None:
    # SIGKILL the train stage at one point between its final checkpoint and its last write:
    # before the model/metrics/plots, before the trace, before or after the run record.
    import signal

    import reprotrain.pipeline.stages.train as pipeline_train
    import reprotrain.pipeline.train_files as train_files
    import reprotrain.trace.callback as trace_module

    where = os.environ["REPROTRAIN_TEST_KILL_AT"]

    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def _killing(original, after: bool = False):
        def wrapped(*args: object, **kwargs: object) -> object:
            if not after:
                _die()
            result = original(*args, **kwargs)
            _die()
            return result

        return wrapped

    if where == "outputs":
        train_files.write_outputs = _killing(train_files.write_outputs)
    elif where == "trace":
        trace_module.TraceCallback.write = _killing(trace_module.TraceCallback.write)
    elif where == "run_record":
        pipeline_train.write_run_record = _killing(pipeline_train.write_run_record)
    elif where == "cleanup":
        pipeline_train.write_run_record = _killing(pipeline_train.write_run_record, after=True)

if os.environ.get("REPROTRAIN_TEST_CPU") == "no-fma":
    # A CPU with AVX2 but no FMA, as the one reader of the CPU's flags reports it (patched
    # before anything imports it by name).
    import reprotrain.cpu.profile as cpuprofile

    real_flags = cpuprofile.host_cpu_flags

    def host_cpu_flags(*args: object) -> frozenset:
        return real_flags(*args) - {"fma"}

    cpuprofile.host_cpu_flags = host_cpu_flags

if os.environ.get("REPROTRAIN_TEST_CPU") == "xeon-avx512":
    import reprotrain.provenance.environment as environment

    host_vendor = environment.cpu_facts()["vendor"]

    def cpu_facts() -> dict:
        # Another model of this host's vendor: across vendors the portable bits differ.
        flags = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw"]
        return {
            "vendor": host_vendor,
            "model": "Intel(R) Xeon(R) Platinum 8480+",
            "dispatch_flags": flags,
            "usable_cpus": 112,
        }

    environment.cpu_facts = cpu_facts

if os.environ.get("REPROTRAIN_TEST_SIGTERM_AT_STEP") is not None:
    # Patches Lightning's base hook, which a user's module (tests/test_user_project.py: the
    # wine example) inherits unchanged; it never touches a random generator or a tensor.
    import signal

    import lightning as L

    sigterm_step = int(os.environ["REPROTRAIN_TEST_SIGTERM_AT_STEP"])
    original_batch_start = L.LightningModule.on_train_batch_start

    def on_train_batch_start(self: L.LightningModule, batch: object, batch_idx: int) -> None:
        if self.global_step == sigterm_step and self.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return original_batch_start(self, batch, batch_idx)

    L.LightningModule.on_train_batch_start = on_train_batch_start
