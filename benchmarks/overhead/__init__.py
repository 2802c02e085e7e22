"""What the pipeline adds to a training: tracing, checkpoints, recording, verify, DDP modes."""
