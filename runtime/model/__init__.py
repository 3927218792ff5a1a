"""The model: loading it (safetensors, GGUF, int4), the lean decoder, paged attention, the runner,
sampling and detokenizing. Tensors in, logits and tokens out; it never decides what runs."""
