"""Two runs' outputs, compared: weights tensor by tensor, modules within a step, any files.

``weights`` compares state dicts, ``modules`` finds the first module whose
output or gradient differs, ``files`` gives a verdict per output file of any
script (each read by its kind through ``readers``), ``report`` combines
trace, weights, inputs and environment diffs.
Trace and op-recording diffs live with their formats (``reprotrain.trace.diff``,
``reprotrain.ops.align``).
"""
