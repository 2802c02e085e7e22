"""A two-layer MLP on scikit-learn's wine data: the user's side of a reprotrain project."""
