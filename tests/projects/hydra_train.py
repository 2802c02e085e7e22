"""A Hydra + Lightning project (config in conf/hydra.yaml) that uses reprotrain's library.

The only reprotrain lines: ``configure_determinism`` before anything runs,
and the library's callbacks, listed by ``_target_`` in the config. Check it:
``reprotrain verify -- python tests/projects/hydra_train.py 'hydra.run.dir={out}'``.
"""

from __future__ import annotations

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

from reprotrain.determinism import configure_determinism


@hydra.main(config_path="conf", config_name="hydra", version_base=None)
def main(cfg: DictConfig) -> None:
    configure_determinism(cfg.seed)
    callbacks = [instantiate(c) for c in cfg.callbacks]
    trainer = L.Trainer(**cfg.trainer, callbacks=callbacks)
    trainer.fit(instantiate(cfg.model), datamodule=instantiate(cfg.data))


if __name__ == "__main__":
    main()
