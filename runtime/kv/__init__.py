"""Where each KV block lives this step: the tiered prefix cache, beam groups, the KV split, and the
layer-wise and head-wise residency modes, with the pool sizing and device peaks they are planned by."""
