"""Built-in recipes: LightningModules and LightningDataModules named by class_path in params."""
