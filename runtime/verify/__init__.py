"""Verifiers: the scorers that give a path's steps their scores, the store that keeps the reward
models' own prefix cache, and the verifier kinds (one adapter per reward-model family)."""
