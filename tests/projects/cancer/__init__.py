"""A user's package written the way Lightning's docs and the LightningCLI/Hydra templates
write one, before reading reprotrain's docs: own dataloaders, ``save_hyperparameters`` only,
a nested ``net`` given by ``class_path``, torchmetrics, ``train/loss``-style names. The tests
train it as it is (tests/test_own_loaders.py); nothing here is written for the pipeline."""
