"""farloco.optim: outer strategies, codecs, error feedback and aggregation. Pure tensor math, no I/O."""
