"""Write scikit-learn's bundled wine data as a CSV, once (the committed data/wine.csv).

Run from this folder: ``python make_wine_csv.py data/wine.csv``. The CSV is the
project's data from then on; the pipeline never runs this script. One header row
(the 13 feature names, then ``target``), one row per sample; every value is written
with ``repr`` of a Python float or int, which reads back with ``float``/``int`` to
the same bits.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from sklearn.datasets import load_wine


def write_wine_csv(out: Path) -> int:
    """Write the CSV to ``out``; returns the number of samples written."""
    wine = load_wine()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow([*wine.feature_names, "target"])
        for features, target in zip(wine.data, wine.target, strict=True):
            # float(), not numpy's scalar: numpy 2's repr is 'np.float64(14.23)'.
            writer.writerow([*(repr(float(v)) for v in features), repr(int(target))])
    return len(wine.target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="CSV file to write (e.g. data/wine.csv)")
    args = parser.parse_args()
    count = write_wine_csv(args.out)
    print(f"wrote {count} samples to {args.out}")


if __name__ == "__main__":
    main()
