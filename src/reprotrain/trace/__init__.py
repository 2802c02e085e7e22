"""Per-step trace of a run: what each training step saw and produced, as fingerprints.

``callback`` (:class:`~reprotrain.trace.callback.TraceCallback`, Lightning)
writes the file; ``tracefile`` reads it without Lightning; ``rows``,
``batchcolumn``, ``rngstate`` and ``finalstate`` are the parts of a row;
``diff`` finds the first step and record where two traces part.
"""
