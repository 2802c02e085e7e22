"""What decides a run's bits, recorded and checkable.

``environment`` captures the record (hardware, software, lock, image);
``envdiff`` says which differences void the guarantee; ``runid`` hashes the
inputs and the code into the run ID; ``dvcchecksum`` checks files against the
md5s DVC recorded.
"""
