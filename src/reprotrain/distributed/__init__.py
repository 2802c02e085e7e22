"""Several processes: DDP ranks that agree before they train, and world-size invariance.

``ddp`` starts, checks and gathers across ranks; ``worldsize`` is the strategy
that gives the same bits at any world size (fixed-order reduction), over
``microbatches``' one global order of micro-batches and per-sample keys.
"""
