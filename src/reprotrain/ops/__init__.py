"""Individual aten ops: record every op of chosen steps, align two recordings, probe ops.

``recorder`` (a context manager for plain loops; ``fit_recorder`` the same as a
Lightning callback, exported by ``recorder`` on first use) records steps through
``capture`` (the dispatch mode and hooks), into a ``recording`` (the tables
and fingerprints; ``location`` names each op's source line), written in the
format ``opfile`` defines; ``align`` reads two of them through ``opfile`` (no
Lightning) and names the first op whose output differs, with its module and
source line; ``probes`` runs single ops twice to find the non-deterministic
ones and ``catalog`` writes what it found per device class.
"""
