"""Constrained decoding: grammars compiled once per text (off the step loop) and cached, and each
sequence's matcher, forked and rolled back with it; the sampler receives a mask, never a grammar."""
