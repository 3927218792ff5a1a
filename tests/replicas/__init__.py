"""Tiny checkpoints written at test time in the exact layout of published ones (config fields, tensor
names and shards, tokenizer files and chat templates); only the sizes shrink."""
