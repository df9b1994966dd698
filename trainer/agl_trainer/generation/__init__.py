"""Generation in the trainer's process: the transformers backend (``serving.backend: hf``) with its
preallocated key/value slots, prefix cache, batched and fixed-shape decoding steps and CPU kernels."""
