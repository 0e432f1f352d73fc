"""The training loop's pieces: state, the pure train step, logging, sampling, the loop."""
