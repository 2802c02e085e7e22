"""A LightningCLI project (config in cli.yaml) that uses reprotrain's library.

The only reprotrain lines: ``configure_determinism`` before the CLI starts,
and the library's callbacks in the config's ``trainer.callbacks``. Check it:
``reprotrain verify -- python tests/projects/cli_train.py fit --config
tests/projects/cli.yaml --trainer.default_root_dir={out}``.
"""

from __future__ import annotations

from digits import DigitsData, DigitsMLP
from lightning.pytorch.cli import LightningCLI

from reprotrain.determinism import configure_determinism

if __name__ == "__main__":
    configure_determinism(0)
    LightningCLI(DigitsMLP, DigitsData, seed_everything_default=0)
