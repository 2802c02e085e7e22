"""Built-in recipes: LightningModules and LightningDataModules the pipeline trains,
named by class_path in params.
"""
